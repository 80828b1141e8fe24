// `ddprun --hostfile/--hosts ... PROGRAM`: flags, PET_* variables and defaults -> FanoutPlan.
// The flags that place a node are refused (the launcher places every agent); the agent flags are
// checked here with the same parsers the agent uses, so a typo fails before any ssh, and then
// forwarded as typed; the program is resolved on each host by its agent.
#include <chrono>
#include <cmath>
#include <map>
#include <stdexcept>

#include "ddprun/agent/process.hpp"
#include "ddprun/common/error.hpp"
#include "ddprun/common/strings.hpp"
#include "ddprun/launcher/hosts.hpp"
#include "ddprun/launcher/remote_env.hpp"
#include "ddprun/launcher/values.hpp"
#include "ddprun/worker_env/numa.hpp"
#include "parsed_flags.hpp"

namespace ddprun::launcher::detail {
namespace {

// The absolute path of the running ddprun (the default --remote-ddprun).
std::string own_executable() {
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string("ddprun") : self.string();
}

// Checks a forwarded flag's value with the parser the agent will use on it.
void check_forwarded_value(std::string_view dash, const ParsedFlags::Given& g) {
  using Check = void (*)(std::string_view text, std::string_view what);
  static const std::map<std::string_view, Check> checks = {
      {"max-restarts", [](std::string_view t, std::string_view w) { parse_max_restarts(t, w); }},
      {"role", [](std::string_view t, std::string_view w) { parse_non_empty(t, w, "give a role name, e.g. trainer"); }},
      {"log-dir", [](std::string_view t, std::string_view w) { parse_non_empty(t, w, "give a directory"); }},
      {"redirects", [](std::string_view t, std::string_view w) { parse_streams(t, w); }},
      {"tee", [](std::string_view t, std::string_view w) { parse_streams(t, w); }},
      {"local-ranks-filter", [](std::string_view t, std::string_view w) { parse_local_ranks_filter(t, w); }},
      {"signals-to-handle", [](std::string_view t, std::string_view w) { parse_signals(t, w); }},
      {"shutdown-timeout", [](std::string_view t, std::string_view w) { parse_seconds_value(t, w); }},
      {"kill-timeout", [](std::string_view t, std::string_view w) { parse_positive_seconds_value(t, w); }},
      {"nccl-id", [](std::string_view t, std::string_view w) { parse_nccl_id_mode(t, w); }},
      {"nccl-roots", [](std::string_view t, std::string_view w) { parse_nccl_roots(t, w); }},
      {"numa-binding", [](std::string_view t, std::string_view w) { worker_env::parse_numa_binding(t, w); }},
      {"local-rank-arg", [](std::string_view t, std::string_view w) { parse_local_rank_arg(t, w); }},
      {"log-level", [](std::string_view t, std::string_view w) { parse_log_level_value(t, w); }},
      {"containment", [](std::string_view t, std::string_view w) { parse_containment_value(t, w); }},
      {"hang-timeout", [](std::string_view t, std::string_view w) { parse_seconds_value(t, w); }},
      {"stacks", [](std::string_view t, std::string_view w) { parse_on_off(t, w); }},
      {"rank-memory", [](std::string_view t, std::string_view w) { parse_on_off(t, w); }},
      {"metrics-host", [](std::string_view t, std::string_view w) { parse_ip_address(t, w); }},
      {"metrics-port", [](std::string_view t, std::string_view w) { parse_port_value(t, w, 0); }},
      {"event-log-handler", [](std::string_view t, std::string_view w) { parse_event_log_handler(t, w); }},
      {"duplicate-stdout-filters", [](std::string_view t, std::string_view) { parse_duplicate_filters(t); }},
      {"duplicate-stderr-filters", [](std::string_view t, std::string_view) { parse_duplicate_filters(t); }},
  };
  const auto it = checks.find(dash);
  if (it == checks.end()) throw std::logic_error("no value check for the forwarded flag --" + std::string(dash));
  it->second(g.text, g.what);
}

// ssh's ConnectTimeout in the options it is given (the first value wins, as in ssh), in seconds:
// ssh's time format (30, 1m30s); 0 (no timeout of its own) or an unreadable value mean the kernel's connect
// timeout, about 127 s on Linux.
long ssh_connect_timeout_s(const std::vector<std::string>& ssh_command) {
  constexpr long kKernelConnectTimeout = 127;
  constexpr std::string_view key = "connecttimeout=";
  for (std::size_t i = 0; i + 1 < ssh_command.size(); ++i) {
    if (ssh_command[i] != "-o" || !starts_with(to_lower(ssh_command[i + 1]), key)) continue;
    const std::string value = to_lower(trim(std::string_view(ssh_command[i + 1]).substr(key.size())));
    long total = 0;
    long number = -1;
    for (const char c : value) {
      if (c >= '0' && c <= '9') {
        number = (number < 0 ? 0 : number) * 10 + (c - '0');
        if (number > 1'000'000) return kKernelConnectTimeout;
        continue;
      }
      const std::string_view units = "smhdw";
      static constexpr long kScale[] = {1, 60, 3600, 86400, 604800};
      const auto u = units.find(c);
      if (u == std::string_view::npos || number < 0) return kKernelConnectTimeout;
      total += number * kScale[u];
      number = -1;
    }
    if (number > 0) total += number;
    return total > 0 && total <= 7L * 86400 ? total : kKernelConnectTimeout;
  }
  return kKernelConnectTimeout;
}

}  // namespace

void resolve_fanout(const ParsedFlags& p, const std::vector<std::string>& remaining, LaunchOptions& out) {
  const ParseContext& ctx = p.context();
  const std::string source = p.given("hostfile") ? "--hostfile" : "--hosts";
  for (const auto& spec : launcher_flags()) {
    if (spec.scope != FlagScope::placement || !p.present(spec)) continue;
    if (spec.kind == FlagKind::boolean) {
      throw UsageError("--" + std::string(spec.dash) + " cannot be used with " + source,
                       "drop --" + std::string(spec.dash));
    }
    const auto g = p.given(spec.dash);
    throw UsageError(g->what + " cannot be used with " + source,
                     "the launcher runs the rendezvous itself and gives every host its place; drop " + g->what);
  }
  if (p.given("hostfile") && p.given("hosts")) {
    throw UsageError("--hostfile and --hosts cannot be used together", "list the hosts in one of them");
  }

  std::vector<HostEntry> entries;
  if (auto g = p.given("hostfile")) {
    std::filesystem::path file(std::string(trim(g->text)));
    if (file.is_relative()) file = ctx.cwd / file;
    entries = load_hostfile(file.string(), &out.notes);
  } else {
    const auto g2 = p.given("hosts");
    entries = parse_hosts_list(g2->text, g2->what);
  }

  std::optional<int> nproc_number;
  std::string nproc_word;  // gpu|cpu|auto: counted on each host
  if (auto g = p.given("nproc-per-node")) {
    const std::string kind = to_lower(trim(g->text));
    if (is_device_kind(kind)) {
      nproc_word = kind;
    } else {
      nproc_number = parse_nproc_per_node(g->text, g->what, std::nullopt, kind == "cpu" ? ctx.cpus() : 1);
    }
  }
  std::optional<int> num_nodes;
  std::optional<int> num_gpus;
  if (auto g = p.given("num-nodes")) num_nodes = parse_int_value(g->text, g->what, 1, 1'000'000);
  // As a host's slots (hosts.cpp): at most 65,536 devices a host.
  if (auto g = p.given("num-gpus")) num_gpus = parse_int_value(g->text, g->what, 1, 65536);
  const auto include = p.given("include");
  const auto exclude = p.given("exclude");
  const auto selected = select_hosts(entries, include ? include->text : "", exclude ? exclude->text : "", num_nodes,
                                     num_gpus, nproc_number);
  const auto counts = resolve_nproc(selected, nproc_number);

  FanoutPlan plan;
  // Checked here as a single-node run checks it, so a typo fails before any ssh; each host's
  // agent checks the entries against its own devices.
  const auto global_gpus = p.given("gpus");
  const std::string gpus_list = global_gpus ? parse_gpus_value(global_gpus->text, global_gpus->what) : "";
  std::vector<std::string> slots_win;  // hosts whose --include/--exclude slots replace --gpus
  for (std::size_t i = 0; i < selected.size(); ++i) {
    FanoutHost h;
    h.user = selected[i].user;
    h.host = selected[i].host;
    // gpu/cpu/auto given is counted on each host, also one with slots (an explicit
    // --nproc-per-node wins over them, docs/multinode.md); chosen slot indices are a number.
    const bool counted_here = selected[i].slot_indices || nproc_number || (selected[i].slots > 0 && nproc_word.empty());
    h.nproc = (!counted_here && !nproc_word.empty()) ? nproc_word : std::to_string(counts[i]);
    if (selected[i].slot_indices) {
      std::string list;
      for (int d : *selected[i].slot_indices) list += (list.empty() ? "" : ",") + std::to_string(d);
      h.gpus = list;
      if (global_gpus) slots_win.push_back(selected[i].host);
    } else if (global_gpus) {
      h.gpus = gpus_list;
    }
    h.index = plan.hosts.size();
    plan.hosts.push_back(std::move(h));
  }
  if (!slots_win.empty()) {
    std::string names;
    for (std::size_t i = 0; i < slots_win.size() && i < 8; ++i) names += (i ? ", " : "") + slots_win[i];
    if (slots_win.size() > 8) names += " and " + std::to_string(slots_win.size() - 8) + " more";
    out.notes.push_back(global_gpus->what + " is ignored on " + names + ": the slots " +
                        (include ? "--include" : "--exclude") + " chose there are its devices");
  }

  // ssh: BatchMode so a missing key fails instead of prompting; keepalives so a dead network is
  // noticed by the ssh client (the remote agent notices through its rendezvous heartbeats).
  const auto path_it = ctx.env.find("PATH");
  // ssh keeps the FIRST value it sees for an option, so the user's options go before ddprun's
  // defaults: --ssh-option ConnectTimeout=30 wins over ConnectTimeout=10.
  const std::string path_var = path_it == ctx.env.end() ? "" : path_it->second;
  std::string ssh;
  try {
    ssh = agent::resolve_executable("ssh", path_var, "");
  } catch (const UsageError&) {
    // resolve_executable speaks of the worker command; this is the launcher's own tool.
    throw UsageError("ssh (the OpenSSH client) was not found on PATH (" +
                         (path_var.empty() ? std::string("unset") : "PATH=" + path_var) + ")",
                     "install the OpenSSH client (Debian: openssh-client), or put ssh on PATH");
  }
  plan.ssh_command = {ssh, "-T"};
  if (auto g = p.given("ssh-config")) {
    std::filesystem::path file(std::string(trim(g->text)));
    if (file.is_relative()) file = ctx.cwd / file;
    plan.ssh_command.insert(plan.ssh_command.end(), {"-F", file.string()});
  }
  if (auto g = p.given("ssh-port")) {
    plan.ssh_command.insert(plan.ssh_command.end(), {"-p", std::to_string(parse_port_value(g->text, g->what, 1))});
  }
  for (const auto& opt : p.all("ssh-option")) {
    // ssh -o takes KEY=VALUE; "-oKEY=VALUE" (ssh's own spelling) would become -o -oKEY=VALUE, which
    // ssh refuses on every host.
    if (trim(opt).empty() || opt.find('=') == std::string::npos || opt.front() == '-') {
      throw UsageError("--ssh-option " + opt + ": not an ssh option",
                       "accepted form: KEY=VALUE without -o, e.g. --ssh-option IdentityFile=~/.ssh/id");
    }
    plan.ssh_command.insert(plan.ssh_command.end(), {"-o", opt});
  }
  plan.ssh_command.insert(plan.ssh_command.end(), {"-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o",
                                                   "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3"});
  if (auto g = p.given("ssh-max-inflight")) plan.max_inflight = parse_int_value(g->text, g->what, 1, 10'000);
  if (auto g = p.given("ssh-tree-threshold")) {
    const std::string t = to_lower(trim(g->text));
    plan.tree_threshold =
        t == "off"
            ? 0
            : static_cast<std::size_t>(parse_int_value(g->text, g->what + " (a host count, or off)", 0, 10'000'000));
  }
  if (auto g = p.given("ssh-tree-fanout")) plan.tree_fanout = parse_int_value(g->text, g->what, 2, 10'000);
  // Empty would run "exec  --remote-agent ..." there, or cd to the remote home without a word.
  plan.remote_ddprun =
      p.given("remote-ddprun")
          ? parse_non_empty(
                p.given("remote-ddprun")->text, p.given("remote-ddprun")->what,
                "give ddprun's path on the hosts, e.g. /opt/ddprun/bin/ddprun (default: this ddprun's path)")
          : own_executable();
  plan.remote_cwd = p.given("remote-cwd")
                        ? parse_non_empty(p.given("remote-cwd")->text, p.given("remote-cwd")->what,
                                          "give the workers' directory on the hosts: an absolute path, or ~ or "
                                          "'~/DIR' for the home directory there (default: this directory)")
                        : ctx.cwd.string();
  if (auto g = p.given("launcher-addr")) plan.launcher_addr = parse_host(g->text, g->what);
  if (auto g = p.given("ranks-filter")) {
    parse_ranks_filter(g->text, g->what);
    plan.ranks_filter = std::string(trim(g->text));
  }

  // The environment the workers get on every host (over ssh's stdin).
  std::vector<EnvFlag> env_flags;
  for (const auto& e : p.all("env")) env_flags.push_back(parse_env_flag(e));
  EnvEntries file_entries;
  if (auto g = p.given("env-file")) {
    std::filesystem::path file(std::string(trim(g->text)));
    if (file.is_relative()) file = ctx.cwd / file;
    file_entries = load_env_file(file.string());
  }
  plan.env = select_remote_env(ctx.env, env_flags, file_entries, &out.notes);

  // Rendezvous settings: checked here; the token travels in the environment, not on a command line.
  std::map<std::string, std::string> conf;
  if (auto g = p.given("rdzv-conf")) conf = parse_rdzv_conf(g->text, g->what);
  const auto settings = parse_rdzv_settings(conf, "--rdzv-conf", p.env("DDPRUN_RDZV_TOKEN"), &out.notes);
  plan.rdzv_token = settings.token;
  plan.ready_timeout = std::chrono::seconds(ssh_connect_timeout_s(plan.ssh_command)) + settings.join_timeout;
  conf.erase("token");
  conf.erase("token_file");
  for (auto it = conf.begin(); it != conf.end();) {
    if (is_etcd_conf_key(it->first)) {
      throw UsageError("--rdzv-conf: key '" + it->first + "' applies only to --rdzv-backend etcd",
                       "drop it: a --hostfile/--hosts launch hosts its own c10d rendezvous");
    }
    // What was reported as ignored above is not forwarded, so the hosts do not repeat the notes.
    const bool ignored = !is_rdzv_setting_key(it->first) || (it->first == "timeout" && conf.count("join_timeout") != 0);
    it = ignored ? conf.erase(it) : std::next(it);
  }
  conf["is_host"] = "false";  // the launcher hosts it
  std::string conf_text;
  for (const auto& [k, v] : conf) conf_text += (conf_text.empty() ? "" : ",") + k + "=" + v;

  // Agent flags forwarded as given (checked here first, so a typo fails before any ssh).
  auto& args = plan.agent_args;
  args.push_back("--rdzv-conf=" + conf_text);
  for (const auto& spec : launcher_flags()) {
    if (spec.scope != FlagScope::forwarded) continue;
    if (spec.kind == FlagKind::boolean) {
      if (p.flag(spec.dash)) args.push_back("--" + std::string(spec.dash));
    } else if (auto g = p.given(spec.dash)) {
      check_forwarded_value(spec.dash, *g);
      args.push_back("--" + std::string(spec.dash) + "=" + g->text);
    }
  }
  // The launcher itself also waits this long for the hosts to stop; torchrun's variable counts
  // as the flag, for the remote agents too.
  double grace = 30.0;
  if (auto g = p.given("shutdown-timeout")) {
    grace = parse_seconds_value(g->text, g->what);
  } else if (auto e = p.env("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"); e && !trim(*e).empty()) {
    grace = parse_seconds_value(*e, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT");
    args.push_back("--shutdown-timeout=" + *e);
  }
  plan.shutdown_timeout = std::chrono::milliseconds(seconds_to_ms(grace));
  if (auto g = p.given("kill-timeout")) {
    const double s = parse_positive_seconds_value(g->text, g->what);
    plan.kill_timeout = std::chrono::milliseconds(std::max<std::int64_t>(1, seconds_to_ms(s)));
  }
  // --local-rank-arg itself is forwarded above; --use-env, which contradicts it, is not.
  (void)check_no_effect_flags(p, out.notes);
  if (auto g = p.given("log-line-prefix-template")) {
    out.notes.push_back(g->what + " is ignored with " + source + ": remote lines are prefixed [host:rank]:");
  }

  std::vector<std::string> rest =
      program_words(remaining, "usage: ddprun --hostfile FILE [options] SCRIPT.py|PROGRAM [ARGS...]");
  plan.program = std::move(rest);
  out.config.dry_run = p.flag("dry-run");
  out.fanout = std::move(plan);
}

}  // namespace ddprun::launcher::detail
