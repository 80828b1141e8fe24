// `ddprun status`: argument parsing and the table (pure). The network round trip lives in
// status_query.cpp.
#include "ddprun/launcher/status_command.hpp"

#include <fmt/format.h>

#include <cmath>

#include "ddprun/common/error.hpp"
#include "ddprun/common/secret_file.hpp"
#include "ddprun/common/strings.hpp"

namespace ddprun::launcher {
namespace {

namespace rdzv = ddprun::rendezvous;

std::string secs(Duration d) { return rdzv::format_seconds(d); }

}  // namespace

std::string status_usage() {
  return "Usage: ddprun status --rdzv-endpoint HOST[:PORT] [--rdzv-id ID] [--timeout SECONDS]\n"
         "\n"
         "Prints the jobs of a rendezvous server (ddprun-rdzvd, or an agent hosting an embedded\n"
         "rendezvous): state, round, nodes, restarts, timers, and each member's role, group rank,\n"
         "address, workers, heartbeat age and lease. PORT defaults to 29400. Without --rdzv-id every\n"
         "job is listed. --rdzv-endpoint/--rdzv-id also come from PET_RDZV_ENDPOINT/PET_RDZV_ID.\n"
         "Exit codes: 0 printed; 1 the server cannot be reached or the job is unknown; 2 usage error.\n";
}

StatusRequest parse_status_args(const std::vector<std::string>& args, const std::map<std::string, std::string>& env) {
  StatusRequest req;
  std::optional<std::string> endpoint;
  std::string endpoint_what = "--rdzv-endpoint";
  std::optional<std::string> id;
  for (std::size_t i = 0; i < args.size(); ++i) {
    std::string arg = args[i];
    std::string value;
    bool has_value = false;
    if (const auto eq = arg.find('='); starts_with(arg, "--") && eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
      has_value = true;
    }
    if (arg == "-h" || arg == "--help") {
      req.help = true;
      return req;
    }
    const bool known = arg == "--rdzv-endpoint" || arg == "--rdzv_endpoint" || arg == "--rdzv-id" ||
                       arg == "--rdzv_id" || arg == "--timeout" || arg == "--token-file";
    if (arg == "--token") {
      throw UsageError("ddprun status: --token on the command line is refused (every local user can read it in "
                       "/proc/*/cmdline)",
                       "set DDPRUN_RDZV_TOKEN or pass --token-file FILE");
    }
    if (!known) {
      throw UsageError("ddprun status: unknown argument '" + args[i] + "'",
                       "usage: ddprun status --rdzv-endpoint HOST[:PORT] [--rdzv-id ID] [--timeout SECONDS] "
                       "[--token-file FILE]");
    }
    if (!has_value) {
      if (i + 1 >= args.size()) throw UsageError("ddprun status: " + arg + " needs a value");
      value = args[++i];
    }
    if (arg == "--rdzv-endpoint" || arg == "--rdzv_endpoint") {
      endpoint = value;
      endpoint_what = arg;
    } else if (arg == "--rdzv-id" || arg == "--rdzv_id") {
      id = value;
    } else if (arg == "--token-file") {
      try {
        req.token = read_secret_file(value, "--token-file").secret;
      } catch (const Error& e) {
        throw UsageError(std::string("ddprun status: ") + e.what(), "point --token-file at the daemon's token file");
      }
    } else {
      const auto v = parse_seconds(trim(value));
      if (!v || *v <= 0.0 || *v > 1e6) {
        throw UsageError("--timeout=" + value + ": not a positive number of seconds", "e.g. --timeout 5");
      }
      req.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(std::llround(*v * 1000.0)));
    }
  }
  if (!endpoint) {
    if (auto it = env.find("PET_RDZV_ENDPOINT"); it != env.end() && !trim(it->second).empty()) {
      endpoint = it->second;
      endpoint_what = "PET_RDZV_ENDPOINT";
    }
  }
  if (req.token.empty()) {
    if (auto it = env.find("DDPRUN_RDZV_TOKEN"); it != env.end()) req.token = std::string(trim(it->second));
  }
  if (!id) {
    if (auto it = env.find("PET_RDZV_ID"); it != env.end() && !trim(it->second).empty()) id = it->second;
  }
  if (!endpoint) {
    throw UsageError("ddprun status needs --rdzv-endpoint HOST[:PORT]",
                     "pass the endpoint the agents use (the ddprun-rdzvd address, or the hosting node)");
  }
  req.server = parse_endpoint(*endpoint, 29400, endpoint_what);
  if (id) req.run_id = std::string(trim(*id));
  return req;
}

std::string format_status(const rdzv::RegistryStatus& status, const std::string& endpoint, const std::string& run_id) {
  std::string out;
  if (status.jobs.empty()) {
    out += run_id.empty() ? fmt::format("rendezvous {}: no jobs\n", endpoint)
                          : fmt::format("rendezvous {}: no job '{}'\n", endpoint, run_id);
    return out;
  }
  out += fmt::format("rendezvous {}: {} job(s)\n", endpoint, status.jobs.size());
  for (const auto& job : status.jobs) {
    out += fmt::format("\njob '{}': {}{}, round {}, nodes {}:{}, restarts {}/{}\n", job.run_id,
                       rdzv::to_string(job.state), job.closed ? " (closed)" : "", job.round, job.min_nodes,
                       job.max_nodes, job.restarts_used, job.max_restarts);
    if (!job.progress.empty()) out += "  " + job.progress + "\n";
    std::string timers;
    auto timer = [&](const char* name, const std::optional<Duration>& d) {
      if (d) timers += fmt::format("{}{} in {}", timers.empty() ? "" : ", ", name, secs(*d));
    };
    timer("join timeout", job.join_timeout_in);
    timer("last call", job.last_call_in);
    timer("exit barrier", job.exit_barrier_in);
    timer("rebuild grace", job.rebuild_in);
    timer("forgotten", job.gc_in);
    if (!timers.empty()) out += "  timers: " + timers + "\n";
    if (!job.result.empty()) out += "  result: " + job.result + "\n";
    if (job.last_failure) out += "  last worker failure: " + job.last_failure->describe() + "\n";
    if (job.members.empty()) {
      out += "  no members\n";
      continue;
    }
    out += fmt::format("  {:<6} {:<12} {:<22} {:>7} {:<10} {:>9} {:>9}  {}\n", "GROUP", "ROLE", "ADDRESS", "WORKERS",
                       "STATE", "HEARTBEAT", "LEASE", "NODE");
    for (const auto& m : job.members) {
      std::string state = m.succeeded ? "succeeded" : (m.disconnected ? "disconn." : "ok");
      out += fmt::format("  {:<6} {:<12} {:<22} {:>7} {:<10} {:>9} {:>9}  {}\n",
                         m.group_rank >= 0 ? std::to_string(m.group_rank) : std::string("-"),
                         rdzv::to_string(m.role), m.addr, m.local_world_size, state,
                         secs(m.last_heartbeat_age) + " ago", secs(m.lease_left), m.id.to_string());
    }
  }
  return out;
}

}  // namespace ddprun::launcher
