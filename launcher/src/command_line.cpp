#include "ddprun/launcher/command_line.hpp"

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <optional>
#include <set>

#include "ddprun/common/endpoint.hpp"
#include "ddprun/common/error.hpp"
#include "ddprun/common/logging.hpp"
#include "ddprun/common/strings.hpp"
#include "ddprun/agent/process.hpp"
#include "ddprun/common/version.hpp"
#include "ddprun/launcher/fanout.hpp"
#include "ddprun/launcher/hosts.hpp"
#include "ddprun/launcher/program.hpp"
#include "ddprun/launcher/remote_env.hpp"
#include "ddprun/launcher/slurm.hpp"
#include "ddprun/launcher/values.hpp"
#include "ddprun/worker_env/gpus.hpp"
#include "ddprun/worker_env/numa.hpp"

extern char** environ;  // NOLINT: POSIX

namespace ddprun::launcher {
namespace {

enum class Kind : std::uint8_t { value, boolean, multi };  // multi: repeatable, every value kept

// One row per flag. `dash` is the primary spelling; the underscore spelling and the PET_ name
// are derived from it, as torchrun derives PET_<DEST>.
struct FlagSpec {
  std::string_view dash;
  std::string_view short_name;  // "" when none
  Kind kind;
  bool pet;  // has a PET_<NAME> environment form
  std::string_view type_name;
  std::string_view help;
};

constexpr std::string_view kDefaultSignals = "SIGTERM,SIGINT,SIGHUP,SIGQUIT";

// clang-format off
constexpr FlagSpec kFlags[] = {
  {"nnodes", "", Kind::value, true, "N|MIN:MAX",
   "Number of nodes, or MIN:MAX for a range (0 < MIN <= MAX). Default: 1:1."},
  {"nproc-per-node", "", Kind::value, true, "N|gpu|cpu|auto",
   "Workers per node: a number, gpu (visible GPUs: CUDA_VISIBLE_DEVICES, else NVML / the CUDA "
   "driver), cpu (online CPUs) or auto (gpu when there is a GPU, else cpu). Default: 1."},
  {"rdzv-backend", "", Kind::value, true, "static|c10d", "Rendezvous backend. Default: static."},
  {"rdzv-endpoint", "", Kind::value, true, "HOST[:PORT]",
   "Rendezvous endpoint (c10d default port 29400; [IPV6]:PORT accepted). Default: none."},
  {"rdzv-id", "", Kind::value, true, "ID", "Job id shared by all nodes. Default: none."},
  {"rdzv-conf", "", Kind::value, true, "K=V,...", "Extra rendezvous settings, e.g. join_timeout=900."},
  {"standalone", "", Kind::boolean, true, "",
   "Single-node job with a local c10d rendezvous on a free port and a random run id; explicit "
   "--rdzv-* values are ignored."},
  {"max-restarts", "", Kind::value, true, "N", "Worker group restarts before failing. Default: 0."},
  {"monitor-interval", "", Kind::value, true, "SECONDS",
   "Accepted for compatibility, no effect: ddprun reacts to worker exits as they happen (event "
   "driven, no polling). Default: 0.1."},
  {"start-method", "", Kind::value, true, "spawn|fork|forkserver",
   "Accepted for compatibility, no effect: workers are always started as new processes. Default: spawn."},
  {"role", "", Kind::value, true, "NAME", "Role name of the workers (ROLE_NAME, log prefix). Default: default."},
  {"module", "m", Kind::boolean, true, "", "Run the program as a Python module, like python -m."},
  {"no-python", "", Kind::boolean, true, "", "Execute the program directly instead of under Python."},
  {"run-path", "", Kind::boolean, true, "",
   "Run the script with runpy.run_path (takes precedence over --no-python)."},
  {"log-dir", "", Kind::value, true, "DIR", "Base directory for worker log files. Default: a new directory under $TMPDIR."},
  {"redirects", "r", Kind::value, true, "0-3|R:V,...",
   "Send worker streams to log files only: 0 none, 1 stdout, 2 stderr, 3 both; or per local "
   "rank, e.g. 0:1,1:2. Default: 0."},
  {"tee", "t", Kind::value, true, "0-3|R:V,...",
   "Send worker streams to log files and the console (same values as --redirects). Default: 0."},
  {"local-ranks-filter", "", Kind::value, true, "R,...",
   "Only these local ranks' output reaches the console (log files are unaffected). Default: all."},
  {"node-rank", "", Kind::value, true, "N", "Rank of this node (static backend only). Default: 0."},
  {"master-addr", "", Kind::value, true, "HOST",
   "Address of the rank 0 node (static backend only; IPv6 as [::1]). Default: 127.0.0.1."},
  {"master-port", "", Kind::value, true, "PORT", "Port on the rank 0 node (static backend only). Default: 29500."},
  {"local-addr", "", Kind::value, true, "HOST", "Address this node advertises to the others."},
  {"signals-to-handle", "", Kind::value, true, "SIG,...",
   "Signals ddprun catches and forwards to the workers. Default: SIGTERM,SIGINT,SIGHUP,SIGQUIT."},
  {"shutdown-timeout", "", Kind::value, true, "SECONDS",
   "Grace between SIGTERM and SIGKILL when stopping workers. Default: $TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30."},
  {"virtual-local-rank", "", Kind::boolean, true, "",
   "Each worker sees LOCAL_RANK=0 and CUDA_VISIBLE_DEVICES set to its own device."},
  {"gpus", "", Kind::value, true, "LIST",
   "Devices the workers use: ordinals of the visible devices (cuda:N) or GPU UUIDs (prefixes), "
   "e.g. 1,3. Default: all visible devices."},
  {"gpu-isolation", "", Kind::boolean, true, "",
   "Each worker's CUDA_VISIBLE_DEVICES holds exactly its own device (cuda:0 inside the worker)."},
  {"gpu-sharing", "", Kind::boolean, true, "",
   "Allow more workers than selected devices (assigned round robin) with --gpus, --gpu-isolation "
   "or --virtual-local-rank."},
  {"nccl-id", "", Kind::value, true, "auto|env|comm-id|off",
   "Export a fresh NCCL unique ID per attempt as DDPRUN_NCCL_UNIQUE_ID. auto: skip it when NCCL is "
   "missing; env: missing NCCL is an error; comm-id: export NCCL_COMM_ID=<rank-0 address>:<free port> "
   "instead (one communicator at a time); off: export nothing. Default: auto."},
  {"nccl-roots", "", Kind::value, true, "K",
   "Number of NCCL unique IDs (bootstrap roots) per attempt, exported as DDPRUN_NCCL_UNIQUE_IDS "
   "when K > 1. Default: 1, or ceil(world size / 256) above 256 ranks."},
  {"log-line-prefix-template", "", Kind::value, true, "TEMPLATE",
   "Prefix of console lines that ddprun relays (--tee, --prefix-output): ${role_name}, ${rank}, "
   "${local_rank}. Default: $TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, else [${role_name}${local_rank}]:."},
  {"prefix-output", "", Kind::boolean, true, "",
   "Prefix every console line of every worker with the --log-line-prefix-template (whole lines)."},
  {"ranks-filter", "", Kind::value, true, "R,R-R,...",
   "Only these global ranks' output reaches the console, e.g. 0,3-5 (log files are unaffected). Default: all."},
  // SSH fan-out (docs/multinode.md): any host source makes this ddprun the launcher of the job.
  {"hostfile", "", Kind::value, true, "FILE",
   "Start one agent per host over ssh. Lines: 'host slots=N', 'host:N' or 'host' (user@host ok), # comments."},
  {"hosts", "", Kind::value, true, "H[:N],...", "Hosts to start agents on over ssh, e.g. node1,node2:4,user@node3."},
  {"include", "", Kind::value, true, "H[:S,S]@H...",
   "DeepSpeed syntax: only these hosts (and slots), e.g. worker-0:0,2@worker-1."},
  {"exclude", "", Kind::value, true, "H[:S,S]@H...", "DeepSpeed syntax: leave out these hosts (or slots of them)."},
  {"num-nodes", "", Kind::value, true, "N", "Use only the first N hosts."},
  {"num-gpus", "", Kind::value, true, "N", "Use only the first N slots (devices) of each host."},
  {"ssh-port", "", Kind::value, true, "PORT", "Port of sshd on the hosts. Default: ssh's (its config, else 22)."},
  {"ssh-option", "", Kind::multi, false, "OPT",
   "Extra ssh option, passed as -o OPT (repeatable), e.g. --ssh-option IdentityFile=~/.ssh/cluster."},
  {"ssh-config", "", Kind::value, true, "FILE", "ssh client configuration file (ssh -F FILE). Default: ~/.ssh/config."},
  {"ssh-max-inflight", "", Kind::value, true, "K", "At most K ssh connections being set up at once. Default: 32."},
  {"remote-ddprun", "", Kind::value, true, "PATH", "ddprun on the hosts. Default: this ddprun's own path."},
  {"remote-cwd", "", Kind::value, true, "DIR", "Working directory on the hosts. Default: the current directory."},
  {"env", "", Kind::multi, false, "NAME[=VALUE]",
   "Carry a variable to the workers on every host (repeatable): NAME copies this shell's value."},
  {"env-file", "", Kind::value, true, "FILE", "Carry the NAME=VALUE lines of FILE to the workers on every host."},
  {"launcher-addr", "", Kind::value, true, "ADDR",
   "Address of this machine the hosts reach the launcher's rendezvous at. Default: the one that routes to the first host."},
  {"node-label", "", Kind::value, false, "", ""},  // set by the fan-out launcher for its remote agents
  {"numa-binding", "", Kind::value, false, "node|socket|exclusive|core-complex",
   "Bind each worker to the CPUs near its GPU: node (the GPU's NUMA node), socket (its sockets), "
   "exclusive (the node's cores split among its workers), core-complex (one L3 group each). "
   "Without a GPU, workers are spread over the NUMA nodes. Best effort. Default: no binding."},
  {"logs-specs", "", Kind::value, false, "NAME", "Not supported yet (a torchrun Python plugin)."},
  // ddprun extras and torch.distributed.launch compatibility.
  {"local-rank-arg", "", Kind::value, true, "dash|underscore",
   "Legacy torch.distributed.launch behaviour: append --local-rank=N (dash) or --local_rank=N "
   "(underscore) to each worker's arguments."},
  {"use-env", "", Kind::boolean, true, "",
   "Accepted for torch.distributed.launch compatibility, no effect: LOCAL_RANK and the other "
   "variables are always set."},
  {"dry-run", "", Kind::boolean, false, "",
   "Print each local rank's command, environment and directory, start nothing, exit 0."},
  {"log-level", "", Kind::value, false, "LEVEL",
   "trace, debug, info, warning, error or critical. Default: $DDPRUN_LOG_LEVEL, else $LOGLEVEL, else info."},
  {"version", "", Kind::boolean, false, "", "Print the version and exit."},
};
// clang-format on

std::string underscore(std::string_view dash) {
  std::string s(dash);
  std::replace(s.begin(), s.end(), '-', '_');
  return s;
}

std::string pet_name(std::string_view dash) {
  std::string s = "PET_" + underscore(dash);
  std::transform(s.begin(), s.end(), s.begin(), [](char c) { return c >= 'a' && c <= 'z' ? static_cast<char>(c - 'a' + 'A') : c; });
  return s;
}

constexpr std::string_view kFooter =
    "The first argument that is not a ddprun option is the training program; it and everything\n"
    "after it are passed to the workers untouched. Program forms:\n"
    "  ddprun [options] train.py ARGS      PYTHON -u train.py ARGS   (PYTHON: $PYTHON_EXEC, else python3 on PATH)\n"
    "  ddprun [options] -m pkg.mod ARGS    PYTHON -u -m pkg.mod ARGS\n"
    "  ddprun [options] --run-path t.py    PYTHON -u -c <runpy.run_path> /abs/t.py ARGS\n"
    "  ddprun [options] ./prog ARGS        /abs/prog ARGS   (any executable; also with --no-python)\n"
    "\n"
    "Every option has a dash and an underscore spelling (--nproc-per-node, --nproc_per_node) and,\n"
    "except --numa-binding, --logs-specs, --dry-run, --log-level and --version, an environment form\n"
    "PET_<NAME> (PET_NPROC_PER_NODE=4; booleans: PET_STANDALONE=1). The flag wins over PET_*, which\n"
    "wins over the default.\n"
    "\n"
    "Exit codes: 0 success; the failing worker's own exit code (128+N for a worker killed by signal N);\n"
    "128+N when ddprun is stopped by signal N; 2 usage error; 1 other ddprun error.";

class Parsed {
 public:
  Parsed(const ParseContext& context) : context_(context) {}

  CLI::App& app() { return app_; }

  void define() {
    app_.description("ddprun " + std::string(version_string) +
                     ": launch a distributed training job on this node (a drop-in for torchrun)");
    app_.prefix_command();
    app_.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    app_.footer(std::string(kFooter));
    app_.get_formatter()->column_width(40);
    // The usage line is "Usage: ddprun [" + label + "]": name the program part there too.
    app_.get_formatter()->label("OPTIONS", "OPTIONS] PROGRAM|-m MODULE [ARGS...");
    for (const auto& spec : kFlags) {
      std::string names;
      if (!spec.short_name.empty()) names += "-" + std::string(spec.short_name) + ",";
      names += "--" + std::string(spec.dash);
      if (underscore(spec.dash) != spec.dash) names += ",--" + underscore(spec.dash);
      std::string help(spec.help);
      if (spec.pet) help += " [env: " + pet_name(spec.dash) + "]";
      CLI::Option* opt = nullptr;
      if (spec.kind == Kind::boolean) {
        opt = app_.add_flag(names)->description(help);  // (names, lvalue) would bind help as the result
      } else if (spec.kind == Kind::multi) {
        opt = app_.add_option(names, multi_storage_[std::string(spec.dash)], help);
        opt->type_name(std::string(spec.type_name));
        opt->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
        opt->allow_extra_args(false);  // one value per occurrence: the program follows
      } else {
        opt = app_.add_option(names, storage_[std::string(spec.dash)], help);
        opt->type_name(std::string(spec.type_name));
      }
      if (spec.help.empty()) opt->group("");  // internal: not in --help
      options_[std::string(spec.dash)] = {opt, &spec};
    }
  }

  // Every value of a repeatable flag, in command-line order.
  std::vector<std::string> all(std::string_view dash) const {
    const auto it = multi_storage_.find(std::string(dash));
    return it == multi_storage_.end() ? std::vector<std::string>{} : it->second;
  }

  // The value of a flag by precedence, with the name to quote in errors; nullopt = default.
  struct Given {
    std::string text;
    std::string what;
  };
  std::optional<Given> given(std::string_view dash) const {
    const auto& [opt, spec] = options_.at(std::string(dash));
    if (opt->count() > 0) return Given{storage_.at(std::string(dash)), "--" + std::string(dash)};
    if (spec->pet) {
      const std::string env = pet_name(dash);
      if (auto it = context_.env.find(env); it != context_.env.end() && !trim(it->second).empty()) {
        return Given{it->second, env};
      }
    }
    return std::nullopt;
  }

  bool flag(std::string_view dash) const {
    const auto& [opt, spec] = options_.at(std::string(dash));
    if (opt->count() > 0) return true;
    if (spec->pet) {
      const std::string env = pet_name(dash);
      if (auto it = context_.env.find(env); it != context_.env.end() && !trim(it->second).empty()) {
        return parse_env_bool(it->second, env);
      }
    }
    return false;
  }

  std::string value_or(std::string_view dash, std::string_view fallback) const {
    auto g = given(dash);
    return g ? g->text : std::string(fallback);
  }

  std::optional<std::string> env(const std::string& name) const {
    auto it = context_.env.find(name);
    if (it == context_.env.end()) return std::nullopt;
    return it->second;
  }

 private:
  const ParseContext& context_;
  CLI::App app_{"", "ddprun"};
  std::map<std::string, std::string> storage_;
  std::map<std::string, std::vector<std::string>> multi_storage_;
  std::map<std::string, std::pair<CLI::Option*, const FlagSpec*>> options_;
};

std::string strip_brackets(std::string_view host) {
  const std::string_view t = trim(host);
  if (t.size() >= 2 && t.front() == '[' && t.back() == ']') return std::string(t.substr(1, t.size() - 2));
  return std::string(t);
}

std::string checked_host(const Parsed::Given& g) {
  const std::string host = strip_brackets(g.text);
  if (host.empty() || host.find_first_of(" \t[]") != std::string::npos) {
    throw UsageError(g.what + "=" + g.text + ": not a host name or address",
                     "accepted forms: a host name, an IPv4 address, or an IPv6 address in brackets like [::1]");
  }
  return host;
}

// Inside a Slurm allocation (SLURM_JOB_ID set) with no rendezvous flags, `srun ddprun ...` on
// every node needs nothing else: the node count, this node's rank and the rendezvous endpoint
// (the first node of the allocation, port 29400 or $DDPRUN_SLURM_RDZV_PORT) come from Slurm's
// variables.
void apply_slurm(const Parsed& p, const ParseContext& ctx, LaunchOptions& out) {
  agent::AgentConfig& cfg = out.config;
  for (std::string_view f : {"nnodes", "rdzv-backend", "rdzv-endpoint", "rdzv-id", "node-rank", "master-addr"}) {
    if (p.given(f)) return;
  }
  if (cfg.standalone) return;
  const auto slurm = slurm_from_env(ctx.env);
  if (!slurm || slurm->nnodes <= 1) return;
  // One ddprun per node: several tasks of one step on a node would all try to host or join as
  // that node.
  for (const char* tasks_var : {"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"}) {
    if (auto t = p.env(tasks_var); t && !trim(*t).empty()) {
      const auto tasks = parse_int(trim(*t));
      if (tasks && *tasks > slurm->nnodes) {
        throw UsageError(std::string(tasks_var) + "=" + *t + " tasks on " + std::to_string(slurm->nnodes) +
                             " nodes: ddprun runs once per node and starts the workers itself",
                         "srun --ntasks-per-node=1 ddprun --nproc-per-node N ...");
      }
      break;
    }
  }
  std::uint16_t port = 29400;
  if (auto e = p.env("DDPRUN_SLURM_RDZV_PORT"); e && !trim(*e).empty()) {
    const auto parsed = parse_port(trim(*e));
    if (!parsed || *parsed == 0) {
      throw UsageError("DDPRUN_SLURM_RDZV_PORT=" + *e + ": not a port", "accepted forms: an integer in 1..65535");
    }
    port = *parsed;
  }
  cfg.min_nodes = cfg.max_nodes = slurm->nnodes;
  cfg.rdzv_backend = "c10d";
  cfg.rdzv_endpoint = Endpoint{slurm->first_host, port}.to_string();
  cfg.run_id = slurm->run_id;
  cfg.node_rank = slurm->node_id;
  if (!cfg.rdzv.is_host) cfg.rdzv.is_host = slurm->node_id == 0;
  out.notes.push_back("Slurm allocation: " + std::to_string(slurm->nnodes) + " nodes, this is node " +
                      std::to_string(slurm->node_id) + ", rendezvous '" + slurm->run_id + "' at " + cfg.rdzv_endpoint +
                      (slurm->node_id == 0 ? " (hosted here)" : ""));
}

// The absolute path of the running ddprun (the default --remote-ddprun).
std::string own_executable() {
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string("ddprun") : self.string();
}

// `ddprun --hostfile/--hosts ... PROGRAM`: this ddprun becomes the fan-out launcher
// (fanout.hpp). The flags that configure the agents are checked here and forwarded as they are;
// the program is resolved on each host by its agent.
void fill_fanout(const Parsed& p, const std::vector<std::string>& remaining, const ParseContext& ctx,
                 LaunchOptions& out) {
  const std::string source = p.given("hostfile") ? "--hostfile" : "--hosts";
  for (std::string_view f : {"nnodes", "rdzv-backend", "rdzv-endpoint", "rdzv-id", "node-rank", "master-addr",
                             "master-port", "local-addr", "node-label"}) {
    if (auto g = p.given(f)) {
      throw UsageError(g->what + " cannot be used with " + source,
                       "the launcher runs the rendezvous itself and gives every host its place; drop " + g->what);
    }
  }
  if (p.flag("standalone")) throw UsageError("--standalone cannot be used with " + source, "drop --standalone");
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
    if (kind == "gpu" || kind == "cpu" || kind == "auto") {
      nproc_word = kind;
    } else {
      nproc_number = parse_nproc_per_node(g->text, g->what, std::nullopt, ctx.online_cpus);
    }
  }
  std::optional<int> num_nodes;
  std::optional<int> num_gpus;
  if (auto g = p.given("num-nodes")) num_nodes = parse_int_value(g->text, g->what, 1, 1'000'000);
  if (auto g = p.given("num-gpus")) num_gpus = parse_int_value(g->text, g->what, 1, 1'000'000);
  const auto include = p.given("include");
  const auto exclude = p.given("exclude");
  const auto selected = select_hosts(entries, include ? include->text : "", exclude ? exclude->text : "", num_nodes,
                                     num_gpus, nproc_number);
  const auto counts = resolve_nproc(selected, nproc_number);

  FanoutPlan plan;
  const auto global_gpus = p.given("gpus");
  for (std::size_t i = 0; i < selected.size(); ++i) {
    FanoutHost h;
    h.user = selected[i].user;
    h.host = selected[i].host;
    const bool counted_here = selected[i].slot_indices || nproc_number || selected[i].slots > 0;
    h.nproc = (!counted_here && !nproc_word.empty()) ? nproc_word : std::to_string(counts[i]);
    if (selected[i].slot_indices) {
      std::string list;
      for (int d : *selected[i].slot_indices) list += (list.empty() ? "" : ",") + std::to_string(d);
      h.gpus = list;
    } else if (global_gpus) {
      h.gpus = std::string(trim(global_gpus->text));
    }
    plan.hosts.push_back(std::move(h));
  }

  // ssh: BatchMode so a missing key fails instead of prompting; keepalives so a dead network is
  // noticed by the ssh client (the remote agent notices through its rendezvous heartbeats).
  const auto path_it = ctx.env.find("PATH");
  // ssh keeps the FIRST value it sees for an option, so the user's options go before ddprun's
  // defaults: --ssh-option ConnectTimeout=30 wins over ConnectTimeout=10.
  plan.ssh_command = {agent::resolve_executable("ssh", path_it == ctx.env.end() ? "" : path_it->second, ""), "-T"};
  if (auto g = p.given("ssh-config")) {
    std::filesystem::path file(std::string(trim(g->text)));
    if (file.is_relative()) file = ctx.cwd / file;
    plan.ssh_command.insert(plan.ssh_command.end(), {"-F", file.string()});
  }
  if (auto g = p.given("ssh-port")) {
    const auto port = parse_port(trim(g->text));
    if (!port || *port == 0) throw UsageError(g->what + "=" + g->text + ": not a port", "accepted forms: 1..65535");
    plan.ssh_command.insert(plan.ssh_command.end(), {"-p", std::to_string(*port)});
  }
  for (const auto& opt : p.all("ssh-option")) {
    if (trim(opt).empty() || opt.find('=') == std::string::npos) {
      throw UsageError("--ssh-option " + opt + ": not an ssh option", "accepted form: KEY=VALUE, e.g. IdentityFile=~/.ssh/id");
    }
    plan.ssh_command.insert(plan.ssh_command.end(), {"-o", opt});
  }
  plan.ssh_command.insert(plan.ssh_command.end(), {"-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o",
                                                   "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3"});
  if (auto g = p.given("ssh-max-inflight")) plan.max_inflight = parse_int_value(g->text, g->what, 1, 10'000);
  plan.remote_ddprun = p.given("remote-ddprun") ? std::string(trim(p.given("remote-ddprun")->text)) : own_executable();
  plan.remote_cwd = p.given("remote-cwd") ? std::string(trim(p.given("remote-cwd")->text)) : ctx.cwd.string();
  if (auto g = p.given("launcher-addr")) plan.launcher_addr = checked_host(*g);
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
  plan.env = select_remote_env(ctx.env, env_flags, file_entries);

  // Rendezvous settings: checked here; the token travels in the environment, not on a command line.
  std::map<std::string, std::string> conf;
  if (auto g = p.given("rdzv-conf")) conf = parse_rdzv_conf(g->text, g->what);
  const auto settings = parse_rdzv_settings(conf, "--rdzv-conf", p.env("DDPRUN_RDZV_TOKEN"));
  plan.rdzv_token = settings.token;
  conf.erase("token");
  conf["is_host"] = "false";  // the launcher hosts it
  std::string conf_text;
  for (const auto& [k, v] : conf) conf_text += (conf_text.empty() ? "" : ",") + k + "=" + v;

  // Agent flags forwarded as given (checked here first, so a typo fails before any ssh).
  auto& args = plan.agent_args;
  args.push_back("--rdzv-conf=" + conf_text);
  if (auto g = p.given("max-restarts")) {
    parse_int_value(g->text, g->what, 0, 1'000'000);
    args.push_back("--max-restarts=" + g->text);
  }
  for (std::string_view f : {"redirects", "tee"}) {
    if (auto g = p.given(f)) {
      parse_streams(g->text, g->what);
      args.push_back("--" + std::string(f) + "=" + g->text);
    }
  }
  if (auto g = p.given("local-ranks-filter")) {
    parse_local_ranks_filter(g->text, g->what);
    args.push_back("--local-ranks-filter=" + g->text);
  }
  if (auto g = p.given("signals-to-handle")) {
    parse_signals(g->text, g->what);
    args.push_back("--signals-to-handle=" + g->text);
  }
  double grace = 30.0;
  if (auto g = p.given("shutdown-timeout")) {
    grace = parse_seconds_value(g->text, g->what);
    args.push_back("--shutdown-timeout=" + g->text);
  } else if (auto e = p.env("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"); e && !trim(*e).empty()) {
    grace = parse_seconds_value(*e, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT");
    args.push_back("--shutdown-timeout=" + *e);
  }
  plan.shutdown_timeout = std::chrono::milliseconds(static_cast<std::int64_t>(std::llround(grace * 1000.0)));
  if (auto g = p.given("nccl-id")) {
    parse_nccl_id_mode(g->text, g->what);
    args.push_back("--nccl-id=" + g->text);
  }
  if (auto g = p.given("nccl-roots")) {
    parse_int_value(g->text, g->what, 1, 4096);
    args.push_back("--nccl-roots=" + g->text);
  }
  for (std::string_view f : {"role", "log-dir", "local-rank-arg", "log-level"}) {
    if (auto g = p.given(f)) args.push_back("--" + std::string(f) + "=" + g->text);
  }
  for (std::string_view f : {"virtual-local-rank", "gpu-isolation", "gpu-sharing", "module", "no-python", "run-path"}) {
    if (p.flag(f)) args.push_back("--" + std::string(f));
  }
  if (auto g = p.given("numa-binding")) {
    worker_env::parse_numa_binding(g->text, g->what);  // each remote agent plans from its own sysfs
    args.push_back("--numa-binding=" + std::string(trim(g->text)));
  }
  if (auto g = p.given("logs-specs")) {
    throw UsageError(g->what + " is not supported yet", "drop the option; ddprun does not load log plugins");
  }
  if (auto g = p.given("log-line-prefix-template")) {
    out.notes.push_back(g->what + " is ignored with " + source + ": remote lines are prefixed [host:rank]:");
  }

  std::vector<std::string> rest = remaining;
  if (!rest.empty() && rest.front() == "--") rest.erase(rest.begin());
  if (rest.empty()) {
    throw UsageError("no training program given", "usage: ddprun --hostfile FILE [options] SCRIPT.py|PROGRAM [ARGS...]");
  }
  if (remaining.front() != "--" && rest.front().size() > 1 && rest.front().front() == '-') {
    throw UsageError("unknown option " + rest.front(), "run 'ddprun --help' for the accepted options");
  }
  plan.program = std::move(rest);
  out.config.dry_run = p.flag("dry-run");
  out.fanout = std::move(plan);
}

void fill_config(const Parsed& p, const std::vector<std::string>& remaining, const ParseContext& ctx,
                 LaunchOptions& out) {
  if (p.given("hostfile") || p.given("hosts")) {
    fill_fanout(p, remaining, ctx, out);
    return;
  }
  for (std::string_view f : {"include", "exclude", "num-nodes", "num-gpus", "ssh-port", "ssh-config",
                             "ssh-max-inflight", "remote-ddprun", "remote-cwd", "env-file", "launcher-addr"}) {
    if (auto g = p.given(f)) {
      throw UsageError(g->what + " needs --hostfile or --hosts", "it configures the agents started over ssh");
    }
  }
  for (std::string_view f : {"ssh-option", "env"}) {
    if (!p.all(f).empty()) {
      throw UsageError("--" + std::string(f) + " needs --hostfile or --hosts", "it configures the agents started over ssh");
    }
  }
  agent::AgentConfig& cfg = out.config;

  // Sizes.
  if (auto g = p.given("nnodes")) {
    const NodeRange r = parse_nnodes(g->text, g->what);
    cfg.min_nodes = r.min_nodes;
    cfg.max_nodes = r.max_nodes;
  }
  // The GPU inventory is probed (dlopen of NVML) only when GPUs matter, and at most once.
  const auto cvd = p.env("CUDA_VISIBLE_DEVICES");
  std::optional<worker_env::GpuInventory> inventory;
  auto probed = [&]() -> const worker_env::GpuInventory& {
    if (!inventory) inventory = ctx.probe_gpus ? ctx.probe_gpus(ctx.env) : worker_env::GpuInventory{};
    return *inventory;
  };
  bool nproc_from_gpus = false;
  if (auto g = p.given("nproc-per-node")) {
    const std::string kind = to_lower(trim(g->text));
    if (kind == "gpu" || kind == "auto") {
      cfg.nproc_per_node = parse_nproc_per_node(g->text, g->what, cvd, ctx.online_cpus, probed());
      nproc_from_gpus = worker_env::count_visible_gpus(cvd, probed()) > 0;
    } else {
      cfg.nproc_per_node = parse_nproc_per_node(g->text, g->what, cvd, ctx.online_cpus);
    }
  }
  if (auto g = p.given("max-restarts")) cfg.max_restarts = parse_int_value(g->text, g->what, 0, 1'000'000);
  if (auto g = p.given("monitor-interval")) {
    parse_seconds_value(g->text, g->what);
    out.notes.push_back(g->what + " has no effect: ddprun is event driven and reacts to worker exits as they happen");
  }
  if (auto g = p.given("start-method")) {
    const std::string m = to_lower(trim(g->text));
    if (m != "spawn" && m != "fork" && m != "forkserver") {
      throw UsageError(g->what + "=" + g->text + ": unknown start method", "accepted forms: spawn, fork, forkserver");
    }
    out.notes.push_back(g->what + " has no effect: ddprun always starts workers as new processes");
  }
  if (auto g = p.given("role")) {
    if (trim(g->text).empty()) throw UsageError(g->what + " is empty", "give a role name, e.g. trainer");
    cfg.role = std::string(trim(g->text));
  }

  // Rendezvous.
  cfg.standalone = p.flag("standalone");
  if (cfg.standalone) {
    std::vector<std::string> ignored;
    for (std::string_view f : {"rdzv-backend", "rdzv-endpoint", "rdzv-id"}) {
      if (auto g = p.given(f)) ignored.push_back(g->what + "=" + g->text);
    }
    if (!ignored.empty()) {
      std::string joined;
      for (const auto& s : ignored) joined += (joined.empty() ? "" : ", ") + s;
      out.notes.push_back("--standalone: ignoring " + joined);
    }
    if (cfg.max_nodes > 1) {
      throw UsageError("--standalone runs a single-node job but --nnodes allows " + std::to_string(cfg.max_nodes) +
                           " nodes",
                       "drop --standalone and use --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT for several nodes");
    }
    cfg.rdzv_backend = "c10d";
    cfg.rdzv_endpoint = "localhost:0";
    cfg.run_id = random_uuid4();
    cfg.master_port = 0;
  } else {
    if (auto g = p.given("rdzv-backend")) {
      const std::string b = to_lower(trim(g->text));
      if (b == "etcd" || b == "etcd-v2") {
        throw UsageError(g->what + "=" + g->text + ": the etcd backends are not supported",
                         "accepted forms: static, c10d");
      }
      if (b != "static" && b != "c10d") {
        throw UsageError(g->what + "=" + g->text + ": unknown rendezvous backend", "accepted forms: static, c10d");
      }
      cfg.rdzv_backend = b;
    }
    if (auto g = p.given("rdzv-endpoint")) {
      cfg.rdzv_endpoint = parse_endpoint(g->text, 29400, g->what).to_string();
    }
    if (cfg.rdzv_backend == "c10d" && cfg.rdzv_endpoint.empty()) {
      throw UsageError("--rdzv-backend=c10d needs --rdzv-endpoint",
                       "pass --rdzv-endpoint=HOST[:PORT] (the same on every node), or --standalone for one node");
    }
    if (auto g = p.given("rdzv-id")) {
      if (trim(g->text).empty()) throw UsageError(g->what + " is empty", "give a job id shared by all nodes");
      cfg.run_id = std::string(trim(g->text));
    }
  }
  {
    std::string conf_what = "--rdzv-conf";
    if (auto g = p.given("rdzv-conf")) {
      cfg.rdzv_conf = parse_rdzv_conf(g->text, g->what);
      conf_what = g->what;
    }
    cfg.rdzv = parse_rdzv_settings(cfg.rdzv_conf, conf_what, p.env("DDPRUN_RDZV_TOKEN"));
  }

  apply_slurm(p, ctx, out);

  if (auto g = p.given("node-rank")) cfg.node_rank = parse_int_value(g->text, g->what, 0, 1'000'000);
  if (cfg.rdzv_backend == "static" && cfg.node_rank >= cfg.max_nodes) {
    throw UsageError("--node-rank=" + std::to_string(cfg.node_rank) + " is not below --nnodes=" +
                         std::to_string(cfg.max_nodes),
                     "node ranks run from 0 to nnodes-1 with the static backend");
  }
  if (auto g = p.given("master-addr")) cfg.master_addr = checked_host(*g);
  if (!cfg.standalone) {
    if (auto g = p.given("master-port")) {
      const auto port = parse_port(trim(g->text));
      if (!port) throw UsageError(g->what + "=" + g->text + ": not a port", "accepted forms: an integer in 0..65535");
      cfg.master_port = *port;
    }
  }
  if (auto g = p.given("local-addr")) cfg.local_addr = checked_host(*g);

  // Output.
  if (auto g = p.given("log-dir")) {
    if (trim(g->text).empty()) throw UsageError(g->what + " is empty", "give a directory");
    const std::filesystem::path dir(std::string(trim(g->text)));
    cfg.log_dir = (dir.is_absolute() ? dir : ctx.cwd / dir).lexically_normal();
  }
  if (auto g = p.given("redirects")) {
    const StreamSpec s = parse_streams(g->text, g->what);
    cfg.redirects_all = s.all;
    cfg.redirects = s.per_rank;
  }
  if (auto g = p.given("tee")) {
    const StreamSpec s = parse_streams(g->text, g->what);
    cfg.tee_all = s.all;
    cfg.tee = s.per_rank;
  }
  if (auto g = p.given("local-ranks-filter")) cfg.local_ranks_filter = parse_local_ranks_filter(g->text, g->what);
  if (auto t = p.env("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"); t && !t->empty()) cfg.log_line_prefix_template = *t;
  if (auto g = p.given("log-line-prefix-template")) cfg.log_line_prefix_template = g->text;
  cfg.prefix_console = p.flag("prefix-output");
  if (auto g = p.given("ranks-filter")) cfg.ranks_filter = parse_ranks_filter(g->text, g->what);
  if (auto g = p.given("node-label")) cfg.node_label = std::string(trim(g->text));

  // Signals and shutdown.
  {
    auto g = p.given("signals-to-handle");
    cfg.signals_to_handle = g ? parse_signals(g->text, g->what) : parse_signals(kDefaultSignals, "default");
  }
  double grace = 30.0;
  if (auto g = p.given("shutdown-timeout")) {
    grace = parse_seconds_value(g->text, g->what);
  } else if (auto e = p.env("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"); e && !trim(*e).empty()) {
    grace = parse_seconds_value(*e, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT");
  }
  cfg.shutdown_timeout = std::chrono::milliseconds(static_cast<std::int64_t>(std::llround(grace * 1000.0)));
  cfg.virtual_local_rank = p.flag("virtual-local-rank");

  // GPUs: a plan only when GPUs are involved, so a CPU-only run is exactly as before.
  std::vector<std::string> rank_bus_ids;  // per local rank, from the plan (for --numa-binding)
  {
    const auto gpus = p.given("gpus");
    const bool isolation = p.flag("gpu-isolation");
    const bool sharing = p.flag("gpu-sharing");
    if (gpus && trim(gpus->text).empty()) throw UsageError(gpus->what + " is empty", "give device ordinals or UUIDs, e.g. 0,1");
    const bool wants_gpus = gpus.has_value() || isolation || cfg.virtual_local_rank;
    if (wants_gpus) probed();
    const bool have_gpus = inventory && !inventory->devices.empty();
    // torchrun's --virtual-local-rank on a machine without any GPU: LOCAL_RANK=0 and
    // CUDA_VISIBLE_DEVICES=<local rank>, as before (build_worker_env does it).
    const bool cpu_virtual = cfg.virtual_local_rank && !gpus && !isolation && !cvd && !have_gpus;
    if (!cpu_virtual && (cvd || wants_gpus || nproc_from_gpus)) {
      worker_env::GpuRequest req;
      req.parent_cvd = cvd;
      req.parent_device_order = p.env("CUDA_DEVICE_ORDER");
      if (inventory) req.inventory = *inventory;
      if (gpus) req.gpus = std::string(trim(gpus->text));
      req.mode = cfg.virtual_local_rank ? worker_env::GpuMode::virtual_local_rank
                 : isolation           ? worker_env::GpuMode::isolate
                                       : worker_env::GpuMode::shared;
      req.nproc = cfg.nproc_per_node;
      req.allow_sharing = sharing;
      const worker_env::GpuPlan plan = worker_env::plan_gpus(req);
      if (!plan.selected.empty()) {
        for (int r = 0; r < cfg.nproc_per_node; ++r) {  // local rank r uses selected[r % n] (--numa-binding)
          const auto& v = plan.selected[static_cast<std::size_t>(r) % plan.selected.size()];
          rank_bus_ids.push_back(v.device ? v.device->pci_bus_id : "");
        }
      }
      bool any = false;
      for (const auto& e : plan.per_rank_env) any = any || !e.empty();
      if (any) {
        cfg.gpu_env = plan.per_rank_env;
        cfg.gpu_devices = plan.per_rank_device;
        cfg.gpu_summary = plan.summary;
      }
    }
  }

  // NCCL unique IDs.
  if (auto g = p.given("nccl-id")) cfg.nccl_id = parse_nccl_id_mode(g->text, g->what);
  if (auto g = p.given("nccl-roots")) cfg.nccl_roots = parse_int_value(g->text, g->what, 1, 4096);

  // CPU/NUMA binding: planned here from sysfs (DDPRUN_SYSFS_ROOT overrides /sys, for tests), near
  // each rank's GPU when its PCI bus id is known, else spread over the NUMA nodes.
  if (auto g = p.given("numa-binding")) {
    const auto mode = worker_env::parse_numa_binding(g->text, g->what);
    std::vector<std::string> bus_ids;
    if (!rank_bus_ids.empty()) {
      bus_ids = rank_bus_ids;
    } else if (!(cvd && trim(*cvd).empty())) {
      for (const auto& v : worker_env::visible_devices(cvd, probed())) bus_ids.push_back(v.device ? v.device->pci_bus_id : "");
    }
    const auto root = p.env("DDPRUN_SYSFS_ROOT");
    const std::string sysfs = root && !trim(*root).empty() ? std::string(trim(*root)) : std::string("/sys");
    const auto plan = worker_env::plan_numa_binding(mode, sysfs, cfg.nproc_per_node, bus_ids,
                                                    worker_env::current_cpu_affinity());
    cfg.numa_binding = std::string(trim(g->text));
    cfg.cpu_binding = plan.per_rank;
    if (bus_ids.empty() || std::find(bus_ids.begin(), bus_ids.end(), std::string()) != bus_ids.end()) {
      out.notes.push_back(g->what + ": " + plan.note);
    }
  }
  if (auto g = p.given("logs-specs")) {
    throw UsageError(g->what + " is not supported yet", "drop the option; ddprun does not load log plugins");
  }

  // Legacy --local-rank argument.
  const bool use_env = p.flag("use-env");
  if (auto g = p.given("local-rank-arg")) {
    const std::string v = to_lower(trim(g->text));
    if (v == "dash") {
      cfg.local_rank_arg = agent::AgentConfig::LocalRankArg::dash;
    } else if (v == "underscore") {
      cfg.local_rank_arg = agent::AgentConfig::LocalRankArg::underscore;
    } else if (v == "none") {
      cfg.local_rank_arg = agent::AgentConfig::LocalRankArg::none;
    } else {
      throw UsageError(g->what + "=" + g->text + ": unknown form",
                       "accepted forms: dash (--local-rank=N), underscore (--local_rank=N), none");
    }
    if (use_env && cfg.local_rank_arg != agent::AgentConfig::LocalRankArg::none) {
      throw UsageError("--use-env and " + g->what + " contradict each other",
                       "--use-env means no --local-rank argument; drop one of them");
    }
  }
  if (use_env) out.notes.push_back("--use-env has no effect: LOCAL_RANK and the other variables are always set");

  cfg.dry_run = p.flag("dry-run");

  // The program.
  std::vector<std::string> rest = remaining;
  if (!rest.empty() && rest.front() == "--") rest.erase(rest.begin());
  if (rest.empty()) {
    throw UsageError("no training program given", "usage: ddprun [options] SCRIPT.py|-m MODULE|PROGRAM [ARGS...]");
  }
  if (remaining.front() != "--" && rest.front().size() > 1 && rest.front().front() == '-') {
    throw UsageError("unknown option " + rest.front(), "run 'ddprun --help' for the accepted options");
  }
  ProgramRequest req;
  req.program = rest.front();
  req.args.assign(rest.begin() + 1, rest.end());
  req.module = p.flag("module");
  req.no_python = p.flag("no-python");
  req.run_path = p.flag("run-path");
  ResolvedProgram prog = resolve_program(req, ctx.env, ctx.cwd);
  cfg.user_args_index = prog.argv.size() - req.args.size();
  cfg.worker_argv = std::move(prog.argv);
  cfg.python_worker = prog.python_worker;
  cfg.working_dir = ctx.cwd;
}

// argparse (and so torchrun) accepts unambiguous abbreviations of long options: --nproc 4 is
// --nproc_per_node 4. CLI11 does not, so expand them here, in ddprun's part of the command line
// only (up to the program or "--").
std::vector<std::string> expand_abbreviations(const std::vector<std::string>& args) {
  std::vector<std::string> out = args;
  for (std::size_t i = 0; i < out.size(); ++i) {
    const std::string& arg = out[i];
    if (arg == "--" || arg.empty() || arg.front() != '-' || arg == "-") break;  // the program starts here
    if (!starts_with(arg, "--")) {
      // Short options: -r/-t take a value unless it is attached (-r3); -m and -h take none.
      if (arg.size() == 2 && (arg[1] == 'r' || arg[1] == 't')) ++i;
      continue;
    }
    const auto eq = arg.find('=');
    const std::string name = arg.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    const FlagSpec* match = nullptr;
    bool exact = name == "help";
    std::set<const FlagSpec*> prefixed;  // dash and underscore spellings of one flag count once
    std::string first_spelling;
    std::string candidates;
    for (const auto& spec : kFlags) {
      for (const std::string& spelled : {std::string(spec.dash), underscore(spec.dash)}) {
        if (spelled == name) {
          exact = true;
          match = &spec;
        } else if (!name.empty() && starts_with(spelled, name) && !prefixed.contains(&spec)) {
          prefixed.insert(&spec);
          if (first_spelling.empty()) first_spelling = spelled;
          candidates += (candidates.empty() ? "--" : ", --") + spelled;
        }
      }
    }
    if (!exact && prefixed.size() > 1) {
      throw UsageError("ambiguous option --" + name + " could match " + candidates, "spell the option out");
    }
    if (!exact && prefixed.size() == 1) {
      match = *prefixed.begin();
      out[i] = "--" + first_spelling + (eq == std::string::npos ? std::string() : arg.substr(eq));
    }
    if (match != nullptr && match->kind != Kind::boolean && eq == std::string::npos) ++i;  // skip its value
  }
  return out;
}

}  // namespace

ParseContext ParseContext::from_process() {
  ParseContext ctx;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string_view kv(*e);
    const auto eq = kv.find('=');
    if (eq == std::string_view::npos) continue;
    ctx.env.emplace(std::string(kv.substr(0, eq)), std::string(kv.substr(eq + 1)));
  }
  std::error_code ec;
  ctx.cwd = std::filesystem::current_path(ec);
  if (ec) {
    // A deleted working directory: relative paths cannot be resolved, say so where it happens.
    ctx.cwd = "/";
  }
  const long cpus = ::sysconf(_SC_NPROCESSORS_ONLN);
  ctx.online_cpus = cpus > 0 ? static_cast<int>(cpus) : 1;
  ctx.probe_gpus = [](const worker_env::EnvMap& env) { return worker_env::probe_gpus(env); };
  return ctx;
}

LaunchOptions parse_command_line(const std::vector<std::string>& args, const ParseContext& context) {
  Parsed p(context);
  p.define();
  LaunchOptions out;
  try {
    const std::vector<std::string> expanded = expand_abbreviations(args);
    std::vector<std::string> reversed(expanded.rbegin(), expanded.rend());
    p.app().parse(reversed);
  } catch (const CLI::CallForHelp&) {
    out.action = Action::help;
    out.text = p.app().help();
    return out;
  } catch (const CLI::CallForAllHelp&) {
    out.action = Action::help;
    out.text = p.app().help();
    return out;
  } catch (const CLI::ParseError& e) {
    throw UsageError(e.what(), "run 'ddprun --help' for the accepted options");
  }
  if (p.flag("version")) {
    out.action = Action::version;
    out.text = std::string("ddprun ") + version_string + "\n";
    return out;
  }

  if (auto g = p.given("log-level")) {
    const auto lvl = parse_log_level(g->text);
    if (!lvl) {
      throw UsageError(g->what + "=" + g->text + ": unknown log level",
                       "accepted forms: trace, debug, info, warning, error, critical, off");
    }
    out.log_level = *lvl;
  } else {
    for (const char* name : {"DDPRUN_LOG_LEVEL", "LOGLEVEL"}) {
      if (auto v = p.env(name); v && !trim(*v).empty()) {
        if (auto lvl = parse_log_level(*v)) {
          out.log_level = *lvl;
        } else {
          out.notes.push_back(std::string(name) + "=" + *v + " is not a log level; using info");
        }
        break;
      }
    }
  }

  fill_config(p, p.app().remaining(), context, out);
  return out;
}

LaunchOptions parse_command_line(int argc, const char* const* argv, const ParseContext& context) {
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
  return parse_command_line(args, context);
}

}  // namespace ddprun::launcher
