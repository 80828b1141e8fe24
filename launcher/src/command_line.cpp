#include "ddprun/launcher/command_line.hpp"

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <csignal>
#include <optional>
#include <set>

#include "ddprun/common/endpoint.hpp"
#include "ddprun/common/error.hpp"
#include "ddprun/common/logging.hpp"
#include "ddprun/common/strings.hpp"
#include "ddprun/common/version.hpp"
#include "ddprun/launcher/program.hpp"
#include "ddprun/launcher/values.hpp"
#include "ddprun/worker_env/gpus.hpp"

extern char** environ;  // NOLINT: POSIX

namespace ddprun::launcher {
namespace {

enum class Kind : std::uint8_t { value, boolean };

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
  {"nccl-id", "", Kind::value, true, "auto|env|off",
   "Export a fresh NCCL unique ID per attempt as DDPRUN_NCCL_UNIQUE_ID (single node). auto: skip "
   "it when NCCL is missing; env: missing NCCL is an error; off: export nothing. Default: auto."},
  {"nccl-roots", "", Kind::value, true, "K",
   "Number of NCCL unique IDs (bootstrap roots) per attempt, exported as DDPRUN_NCCL_UNIQUE_IDS "
   "when K > 1. Default: 1, or ceil(world size / 256) above 256 ranks."},
  {"numa-binding", "", Kind::value, false, "node|socket|exclusive|core-complex", "Not supported yet."},
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
      } else {
        opt = app_.add_option(names, storage_[std::string(spec.dash)], help);
        opt->type_name(std::string(spec.type_name));
      }
      options_[std::string(spec.dash)] = {opt, &spec};
    }
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

void fill_config(const Parsed& p, const std::vector<std::string>& remaining, const ParseContext& ctx,
                 LaunchOptions& out) {
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

  for (std::string_view f : {"numa-binding", "logs-specs"}) {
    if (auto g = p.given(f)) {
      throw UsageError(g->what + " is not supported yet", "drop the option; ddprun does not bind CPUs or load log plugins");
    }
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
    if (match != nullptr && match->kind == Kind::value && eq == std::string::npos) ++i;  // skip its value
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
