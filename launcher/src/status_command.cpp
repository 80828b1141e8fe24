// `ddprun status`: argument parsing and the table (pure). The network round trip lives in
// status_query.cpp.
#include "ddprun/launcher/status_command.hpp"

#include <fmt/format.h>

#include <boost/json.hpp>

#include <cmath>
#include <optional>
#include <string_view>

#include "ddprun/common/error.hpp"
#include "ddprun/common/secret_file.hpp"
#include "ddprun/common/strings.hpp"
#include "ddprun/launcher/values.hpp"

namespace ddprun::launcher {
namespace {

namespace rdzv = ddprun::rendezvous;

std::string secs(Duration d) { return rdzv::format_seconds(d); }

constexpr std::string_view kStatusBackends[] = {"c10d", "etcd", "etcd-v2"};

// The flags of `ddprun status`. Rows name only the members that differ from FlagSpec's defaults.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
// clang-format off
constexpr FlagSpec kStatusFlags[] = {
  {.dash = "rdzv-endpoint", .scope = FlagScope::process, .env_form = true, .metavar = "HOST[:PORT]",
   .help = "Rendezvous server to ask: the ddprun-rdzvd address, or the node hosting the job's rendezvous "
           "(PORT defaults to 29400); R1[:PORT],R2[:PORT],...: relays of one daemon, asked in turn until one "
           "answers.",
   .default_text = "none, required"},
  {.dash = "rdzv-id", .scope = FlagScope::process, .env_form = true, .metavar = "ID",
   .help = "Only this job; exit 1 when the server does not have it.", .default_text = "every job"},
  {.dash = "rdzv-backend", .scope = FlagScope::process, .metavar = "BACKEND",
   .help = "Where the jobs live: c10d (a ddprun-rdzvd or an embedded rendezvous) or etcd (read from the "
           "etcd members named by --rdzv-endpoint).",
   .default_text = "c10d", .choices = kStatusBackends},
  {.dash = "rdzv-conf", .scope = FlagScope::process, .metavar = "K=V,...",
   .help = "With --rdzv-backend etcd: protocol, cacert, cert, key, etcd_prefix, username, password_file, "
           "password (as for the agent)."},
  {.dash = "timeout", .scope = FlagScope::process, .metavar = "SECONDS",
   .help = "How long to wait for the server's answer.", .default_text = "5"},
  {.dash = "token-file", .scope = FlagScope::process, .metavar = "FILE",
   .help = "Read the daemon's token from FILE (one trailing newline removed) to authenticate; DDPRUN_RDZV_TOKEN is used when "
           "not given. Never pass the token itself on a command line.",
   .default_text = "DDPRUN_RDZV_TOKEN, else none"},
  {.dash = "json", .kind = FlagKind::boolean, .scope = FlagScope::process,
   .help = "Print the status as one JSON object per line (field names in docs/cli.md)."},
  {.dash = "watch", .scope = FlagScope::process, .metavar = "[SECONDS]",
   .help = "Query again every SECONDS (2 when not given) until Ctrl-C: a terminal is redrawn in place, "
           "a pipe gets one block (or JSON line) per update."},
  {.dash = "watch-count", .scope = FlagScope::process, .metavar = "N",
   .help = "With --watch: stop after N updates.", .default_text = "no limit"},
};
// clang-format on
#pragma GCC diagnostic pop

constexpr std::chrono::milliseconds kDefaultWatch{2000};

const FlagSpec* find_status_flag(std::string_view name) {
  for (const auto& f : kStatusFlags) {
    if (f.dash == name || underscore_spelling(f.dash) == name) return &f;
  }
  return nullptr;
}

std::chrono::milliseconds parse_interval(const std::string& value, const std::string& what, double min) {
  const auto v = parse_seconds(trim(value));
  if (!v || *v < min || *v > 1e6) {
    throw UsageError(fmt::format("{}={}: not a number of seconds from {} to 1000000", what, value, min),
                     "e.g. " + what + " 5");
  }
  return std::chrono::milliseconds(seconds_to_ms(*v));
}

// "  --a, --b METAVAR" then the help paragraph wrapped at 100 columns, indented by 8.
std::string usage_entry(const std::string& names, const std::string& text) {
  std::string out = "  " + names + "\n";
  std::string line = "       ";
  std::size_t pos = 0;
  while (pos < text.size()) {
    auto end = text.find(' ', pos);
    if (end == std::string::npos) end = text.size();
    if (text.compare(pos, 6, "[env: ") == 0) end = text.find(' ', pos + 6);  // keep "[env: NAME]" whole
    if (end == std::string::npos) end = text.size();
    const std::string word = text.substr(pos, end - pos);
    if (line.size() + 1 + word.size() > 100 && line.size() > 8) {
      out += line + "\n";
      line = "       ";
    }
    line += " " + word;
    pos = end + 1;
  }
  return out + line + "\n";
}

}  // namespace

std::span<const FlagSpec> status_flags() { return kStatusFlags; }

std::string status_usage() {
  std::string out =
      "Usage: ddprun status --rdzv-endpoint HOST[:PORT] [--rdzv-id ID] [--timeout SECONDS] [--json]\n"
      "                     [--watch [SECONDS] [--watch-count N]]\n"
      "       ddprun status --rdzv-backend etcd --rdzv-endpoint H1:2379,H2:2379 [--rdzv-conf K=V,...] ...\n"
      "\n"
      "Prints the jobs of a rendezvous server (ddprun-rdzvd, or an agent hosting an embedded\n"
      "rendezvous) or of an etcd rendezvous: state, round, nodes, restarts, timers, and each member's\n"
      "role, group rank, address, workers, heartbeat age and lease. Without --rdzv-id every job is\n"
      "listed.\n"
      "\n"
      "Options:\n";
  out += usage_entry("-h, --help", "Print this help message and exit.");
  for (const auto& f : kStatusFlags) {
    std::string names = "--" + std::string(f.dash);
    if (underscore_spelling(f.dash) != f.dash) names += ", --" + underscore_spelling(f.dash);
    if (!f.metavar.empty()) names += " " + std::string(f.metavar);
    std::string text = help_with_default(f);
    if (f.env_form) text += " [env: " + pet_variable(f.dash) + "]";
    out += usage_entry(names, text);
  }
  out +=
      "\nExit codes: 0 printed (--watch: stopped by Ctrl-C); 1 the server cannot be reached or the job\n"
      "is unknown; 2 usage error.\n";
  return out;
}

StatusRequest parse_status_args(const std::vector<std::string>& args, const std::map<std::string, std::string>& env) {
  StatusRequest req;
  std::map<std::string_view, std::pair<std::string, std::string>> given;  // dash -> (value, what)
  bool watch = false;
  for (std::size_t i = 0; i < args.size(); ++i) {
    std::string arg = args[i];
    std::optional<std::string> value;
    if (const auto eq = arg.find('='); starts_with(arg, "--") && eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    }
    if (arg == "-h" || arg == "--help") {
      req.help = true;
      return req;
    }
    if (arg == "--token") {
      throw UsageError(
          "ddprun status: --token on the command line is refused (every local user can read it in "
          "/proc/*/cmdline)",
          "set DDPRUN_RDZV_TOKEN or pass --token-file FILE");
    }
    const FlagSpec* spec = starts_with(arg, "--") ? find_status_flag(std::string_view(arg).substr(2)) : nullptr;
    if (spec == nullptr) {
      throw UsageError("ddprun status: unknown argument '" + args[i] + "'",
                       "run 'ddprun status --help' for the options");
    }
    if (spec->kind == FlagKind::boolean) {
      if (value) throw UsageError("ddprun status: " + arg + " takes no value (got '" + *value + "')");
      req.json = true;  // the one boolean row
      continue;
    }
    if (spec->dash == "watch") {
      watch = true;
      // The next word is the interval only when it is one: `--watch --json` stays two flags.
      if (!value && i + 1 < args.size() && parse_seconds(trim(args[i + 1]))) value = args[++i];
      if (value) req.watch = parse_interval(*value, arg, 0.1);
      continue;
    }
    if (!value) {
      if (i + 1 >= args.size()) throw UsageError("ddprun status: " + arg + " needs a value");
      value = args[++i];
    }
    given[spec->dash] = {*value, arg};
  }
  for (const auto& f : kStatusFlags) {
    if (!f.env_form || given.contains(f.dash)) continue;
    const std::string var = pet_variable(f.dash);
    if (auto it = env.find(var); it != env.end() && !trim(it->second).empty()) given[f.dash] = {it->second, var};
  }
  if (auto it = given.find("token-file"); it != given.end()) {
    try {
      req.token = read_secret_file(it->second.first, it->second.second).secret;
    } catch (const Error& e) {
      throw UsageError(std::string("ddprun status: ") + e.what(), "point --token-file at the daemon's token file");
    }
  } else if (auto env_token = env.find("DDPRUN_RDZV_TOKEN"); env_token != env.end()) {
    req.token = std::string(trim(env_token->second));
  }
  if (watch && !req.watch) req.watch = kDefaultWatch;
  if (auto it = given.find("timeout"); it != given.end()) {
    req.timeout = parse_interval(it->second.first, it->second.second, 0.001);
  }
  if (auto it = given.find("watch-count"); it != given.end()) {
    const auto& [text, what] = it->second;
    const auto n = parse_int(trim(text));
    if (!n || *n < 1) throw UsageError(what + "=" + text + ": not a positive whole number", "e.g. " + what + " 3");
    if (!watch) throw UsageError("ddprun status: " + what + " needs --watch", "e.g. --watch 1 " + what + " " + text);
    req.watch_count = static_cast<int>(*n);
  }
  const auto endpoint = given.find("rdzv-endpoint");
  if (endpoint == given.end()) {
    throw UsageError("ddprun status needs --rdzv-endpoint HOST[:PORT]",
                     "pass the endpoint the agents use (the ddprun-rdzvd address, or the hosting node)");
  }
  std::string backend = "c10d";
  if (auto it = given.find("rdzv-backend"); it != given.end()) {
    const auto& [text, what] = it->second;
    backend = parse_rdzv_backend(text, what);
    if (backend == "static") {
      throw UsageError(what + "=" + text + ": ddprun status reads a c10d or etcd rendezvous",
                       "use --rdzv-backend c10d (the default) or etcd");
    }
  }
  const auto conf_it = given.find("rdzv-conf");
  if (backend == "etcd") {
    const std::string conf_what = conf_it == given.end() ? std::string("--rdzv-conf") : conf_it->second.second;
    const auto conf = parse_rdzv_conf(conf_it == given.end() ? std::string() : conf_it->second.first, conf_what);
    for (const auto& [key, v] : conf) {
      if (!is_etcd_conf_key(key)) {
        throw UsageError(conf_what + ": key '" + key + "' does not apply to ddprun status",
                         "accepted keys: protocol, cacert, cert, key, etcd_prefix, username, password_file, password "
                         "(ca_cert, ssl_cert, ssl_cert_key: torch's etcd-v2 names of cacert, cert, key)");
      }
    }
    auto env_password = std::optional<std::string>{};
    if (auto it = env.find("DDPRUN_ETCD_PASSWORD"); it != env.end()) env_password = it->second;
    auto etcd = parse_etcd_conf(endpoint->second.first, endpoint->second.second, conf, conf_what, env_password);
    req.etcd = std::move(etcd.settings);
    req.etcd_password_file = etcd.password_file;
    req.etcd_conf_what = conf_what;
    req.server = req.etcd->endpoints.front();
  } else {
    if (conf_it != given.end()) {
      throw UsageError("ddprun status: " + conf_it->second.second + " applies only to --rdzv-backend etcd", "drop it");
    }
    auto list = parse_endpoint_list(endpoint->second.first, 29400, endpoint->second.second);
    req.server = list.front();
    req.alternates.assign(list.begin() + 1, list.end());
  }
  if (auto it = given.find("rdzv-id"); it != given.end()) req.run_id = std::string(trim(it->second.first));
  return req;
}

std::string format_status(const rdzv::RegistryStatus& status, const std::string& endpoint, const std::string& run_id) {
  // Every string below but the endpoint came from the server, and most from its other clients.
  std::string out;
  if (status.jobs.empty()) {
    out += run_id.empty() ? fmt::format("rendezvous {}: no jobs\n", endpoint)
                          : fmt::format("rendezvous {}: no job '{}'\n", endpoint, terminal_safe(run_id));
    return out;
  }
  out += fmt::format("rendezvous {}: {} job(s)\n", endpoint, status.jobs.size());
  for (const auto& job : status.jobs) {
    out += fmt::format("\njob '{}': {}{}, round {}, nodes {}:{}, restarts {}/{}\n", terminal_safe(job.run_id),
                       terminal_safe(rdzv::state_label(job)), job.closed ? " (closed)" : "", job.round, job.min_nodes,
                       job.max_nodes, job.restarts_used, job.max_restarts);
    if (!job.progress.empty()) out += "  " + terminal_safe(job.progress) + "\n";
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
    if (!job.result.empty()) out += "  result: " + terminal_safe(job.result) + "\n";
    if (job.last_failure) out += "  last worker failure: " + terminal_safe(job.last_failure->describe()) + "\n";
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
                         terminal_safe(rdzv::role_label(m)), terminal_safe(m.addr), m.local_world_size, state,
                         secs(m.last_heartbeat_age) + " ago", secs(m.lease_left), terminal_safe(m.id.to_string()));
    }
  }
  return out;
}

namespace {

namespace json = boost::json;

json::value seconds_json(const std::optional<Duration>& d) {
  if (!d) return nullptr;
  return std::chrono::duration<double>(*d).count();
}

json::object member_json(const rdzv::MemberStatus& m) {
  return json::object{
      {"node", m.id.to_string()},
      {"node_addr", m.id.addr},
      {"pid", m.id.pid},
      {"instance", m.id.instance},
      {"addr", m.addr},
      {"role", rdzv::role_label(m)},
      {"group_rank", m.group_rank >= 0 ? json::value(m.group_rank) : json::value(nullptr)},
      {"local_world_size", m.local_world_size},
      {"state", m.succeeded ? "succeeded" : (m.disconnected ? "disconnected" : "ok")},
      {"heartbeat_age_s", seconds_json(m.last_heartbeat_age)},
      {"lease_left_s", seconds_json(m.lease_left)},
  };
}

json::value failure_json(const std::optional<rdzv::RootCause>& cause) {
  if (!cause) return nullptr;
  const auto& f = cause->failure;
  return json::object{
      {"description", cause->describe()},
      {"round", f.round},
      {"node", f.node.to_string()},
      {"node_addr", cause->node_addr},
      {"group_rank", cause->group_rank},
      {"global_rank", f.global_rank},
      {"local_rank", f.local_rank},
      {"exit_code", f.exit_code ? json::value(*f.exit_code) : json::value(nullptr)},
      {"signal", f.signal ? json::value(*f.signal) : json::value(nullptr)},
      {"message", f.message},
  };
}

json::object job_json(const rdzv::JobStatus& job) {
  json::array members;
  for (const auto& m : job.members) members.push_back(member_json(m));
  return json::object{
      {"run_id", job.run_id},
      {"state", rdzv::state_label(job)},
      {"closed", job.closed},
      {"round", job.round},
      {"min_nodes", job.min_nodes},
      {"max_nodes", job.max_nodes},
      {"restarts_used", job.restarts_used},
      {"max_restarts", job.max_restarts},
      {"progress", job.progress},
      {"result", job.result},
      {"timers_s", json::object{{"join_timeout", seconds_json(job.join_timeout_in)},
                                {"last_call", seconds_json(job.last_call_in)},
                                {"exit_barrier", seconds_json(job.exit_barrier_in)},
                                {"rebuild_grace", seconds_json(job.rebuild_in)},
                                {"forgotten", seconds_json(job.gc_in)}}},
      {"last_failure", failure_json(job.last_failure)},
      {"members", std::move(members)},
  };
}

}  // namespace

std::string format_status_json(const rdzv::RegistryStatus& status, const std::string& endpoint,
                               const std::string& run_id, const std::string& time) {
  json::array jobs;
  for (const auto& job : status.jobs) jobs.push_back(job_json(job));
  json::object out{{"endpoint", endpoint}, {"run_id", run_id.empty() ? json::value(nullptr) : json::value(run_id)}};
  if (!time.empty()) out["time"] = time;
  out["jobs"] = std::move(jobs);
  return json::serialize(out);
}

}  // namespace ddprun::launcher
