// This node's agent: flags, PET_* variables, Slurm's variables and defaults -> agent::AgentConfig.
// Every value is parsed here once, by its parser in values.hpp; the agent takes the result as
// already valid.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <sstream>
#include <type_traits>

#include "ddprun/common/endpoint.hpp"
#include "ddprun/common/error.hpp"
#include "ddprun/common/strings.hpp"
#include "ddprun/launcher/program.hpp"
#include "ddprun/launcher/slurm.hpp"
#include "ddprun/launcher/values.hpp"
#include "ddprun/worker_env/gpus.hpp"
#include "ddprun/worker_env/numa.hpp"
#include "parsed_flags.hpp"

namespace ddprun::launcher::detail {
namespace {

constexpr std::string_view kDefaultSignals = "SIGTERM,SIGINT,SIGHUP,SIGQUIT";

std::filesystem::path absolute_in(const std::string& file, const std::filesystem::path& cwd) {
  const std::filesystem::path f(file);
  return f.is_absolute() ? f : cwd / f;
}

void check_readable(const std::string& file, const std::filesystem::path& cwd, const std::string& what,
                    const std::string& key) {
  std::ifstream in(absolute_in(file, cwd), std::ios::binary);
  if (!in) {
    throw UsageError(what + " key " + key + "=" + file + ": cannot read the file",
                     "give a readable PEM file (paths are taken from the working directory)");
  }
}

// The allocation apply_slurm takes its rendezvous from, if it does.
std::optional<SlurmSettings> slurm_to_apply(const ParsedFlags& p, const ParseContext& ctx) {
  for (const auto& spec : launcher_flags()) {
    if (spec.overrides_slurm && p.present(spec)) return std::nullopt;
  }
  auto slurm = slurm_from_env(ctx.env);
  if (!slurm || slurm->nnodes <= 1) return std::nullopt;
  return slurm;
}

// Inside a Slurm allocation (SLURM_JOB_ID set) with no rendezvous flags, `srun ddprun ...` on
// every node needs nothing else: the node count, this node's rank and the rendezvous endpoint
// (the first node of the allocation, port 29400 or $DDPRUN_SLURM_RDZV_PORT) come from Slurm's
// variables.
void apply_slurm(const ParsedFlags& p, const ParseContext& ctx, LaunchOptions& out) {
  agent::AgentConfig& cfg = out.config;
  const auto slurm = slurm_to_apply(p, ctx);
  if (!slurm) {
    // A batch script or salloc shell of an allocation of several nodes: a plain job on this node,
    // which may not be what was meant.
    const bool overridden = std::any_of(launcher_flags().begin(), launcher_flags().end(),
                                        [&](const auto& spec) { return spec.overrides_slurm && p.present(spec); });
    if (overridden || !p.env("SLURM_JOB_ID") || slurm_step(ctx.env)) return;
    auto nodes = p.env("SLURM_NNODES");
    if (!nodes) nodes = p.env("SLURM_JOB_NUM_NODES");
    const std::int64_t n = nodes ? parse_int(trim(*nodes)).value_or(0) : 0;
    if (n > 1) {
      out.notes.push_back("in a Slurm allocation of " + std::to_string(n) +
                          " nodes but outside srun (a batch script or salloc shell): a job on this node only; "
                          "to use every node, run it as `srun --ntasks-per-node=1 ddprun ...`");
    }
    return;
  }
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

// torch's elastic-agent variables (docs/worker-env.md), read from the launcher's environment.
void resolve_torchelastic_env(const ParsedFlags& p, agent::AgentConfig& cfg) {
  if (auto e = p.env("TORCHELASTIC_ENABLE_FILE_TIMER")) cfg.file_timer = trim(*e) == "1";  // torch: exactly "1"
  if (auto e = p.env("TORCHELASTIC_TIMER_FILE"); e && !trim(*e).empty()) {
    std::filesystem::path path(std::string(trim(*e)));
    if (path.is_relative()) path = p.context().cwd / path;
    cfg.file_timer_path = path.lexically_normal().string();
  }
  if (auto e = p.env("TORCHELASTIC_HEALTH_CHECK_PORT"); e && !trim(*e).empty()) {
    cfg.health_check_port = parse_port_value(*e, "TORCHELASTIC_HEALTH_CHECK_PORT", 0);
  }
}

// TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT: current torchrun reads a float of seconds and
// treats anything else as 0, off, and a negative value too; ddprun does the same and says so
// (a negative value included), and a value under 0.5 ms rounds to 0.
void resolve_uninterruptible_state_timeout(const ParsedFlags& p, LaunchOptions& out) {
  const auto e = p.env("TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT");
  if (!e || trim(*e).empty()) return;
  const auto secs = parse_seconds(trim(*e));
  if (!secs || *secs > 1e9) {
    out.notes.push_back("TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT=" + *e +
                        " is not a number of seconds: ignored (as torchrun; accepted forms: 30, 2.5)");
    return;
  }
  out.config.uninterruptible_state_timeout = std::chrono::milliseconds(seconds_to_ms(*secs));
}

}  // namespace

agent::AgentConfig::LocalRankArg check_no_effect_flags(const ParsedFlags& p, std::vector<std::string>& notes) {
  if (auto g = p.given("monitor-interval")) {
    parse_seconds_value(g->text, g->what);
    notes.push_back(g->what + " has no effect: ddprun is event driven and reacts to worker exits as they happen");
  }
  if (auto g = p.given("start-method")) {
    check_start_method(g->text, g->what);
    notes.push_back(g->what + " has no effect: ddprun always starts workers as new processes");
  }
  if (auto g = p.given("logs-specs")) {
    if (trim(g->text) != "default") {
      throw UsageError(
          g->what + "=" + g->text + ": ddprun cannot load torchrun.logs_specs Python plugins",
          "drop the option or write 'default' (ddprun's log layout, the same as torchrun's DefaultLogsSpecs)");
    }
  }
  auto local_rank_arg = agent::AgentConfig::LocalRankArg::none;
  const bool use_env = p.flag("use-env");
  if (auto g = p.given("local-rank-arg")) {
    local_rank_arg = parse_local_rank_arg(g->text, g->what);
    if (use_env && local_rank_arg != agent::AgentConfig::LocalRankArg::none) {
      throw UsageError("--use-env and " + g->what + " contradict each other",
                       "--use-env means no --local-rank argument; drop one of them");
    }
  }
  if (use_env) notes.push_back("--use-env has no effect: LOCAL_RANK and the other variables are always set");
  return local_rank_arg;
}

void resolve_agent(const ParsedFlags& p, const std::vector<std::string>& remaining, LaunchOptions& out) {
  const ParseContext& ctx = p.context();
  for (const auto& spec : launcher_flags()) {
    if (spec.scope != FlagScope::fanout || !p.present(spec)) continue;
    const auto g = spec.kind == FlagKind::value ? p.given(spec.dash) : std::nullopt;
    throw UsageError((g ? g->what : "--" + std::string(spec.dash)) + " needs --hostfile or --hosts",
                     "it configures the agents started over ssh");
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
  bool cvd_names_nothing_here = false;  // set on a machine without any NVIDIA device (below)
  // AMD GPUs (ROCm) where no NVIDIA GPU is: counted, not assigned to ranks.
  const auto amd_only = [&] {
    return inventory && inventory->devices.empty() && !inventory->device_nodes && !inventory->amd_gpus.empty();
  };
  if (auto g = p.given("nproc-per-node")) {
    const std::string kind = to_lower(trim(g->text));
    const bool device_kind = kind == "gpu" || kind == "auto";  // cpu needs no GPU inventory
    if (device_kind) probed();
    if (device_kind && amd_only()) {
      // What a ROCm build of torch counts with torch.cuda.device_count(): the devices HIP sees
      // under ROCR_VISIBLE_DEVICES, HIP_VISIBLE_DEVICES or CUDA_VISIBLE_DEVICES.
      const auto& amd = inventory->amd_gpus;
      const int n = worker_env::count_visible_amd_gpus(ctx.env, amd);
      const std::string of =
          std::to_string(amd.size()) + " AMD GPU(s) of this machine (ROCm, " + inventory->source + ")";
      if (n > 0) {
        cfg.nproc_per_node = n;
        out.notes.push_back(g->what + "=" + kind + ": " + std::to_string(n) + " visible of the " + of);
      } else if (kind == "gpu") {
        throw UsageError(
            g->what + "=gpu: ROCR_VISIBLE_DEVICES, HIP_VISIBLE_DEVICES or CUDA_VISIBLE_DEVICES hides all " + of,
            "fix those variables, pass a number of processes, or use auto (falls back to the CPU count)");
      } else {
        cfg.nproc_per_node = std::max(ctx.cpus(), 1);
        out.notes.push_back(g->what + "=auto: the visibility variables hide all " + of + ": counting the CPUs (" +
                            std::to_string(cfg.nproc_per_node) + ")");
      }
      cvd_names_nothing_here = true;  // no NVIDIA plan: the workers inherit the variables as they are
    } else if (device_kind) {
      if (cvd && !probed().device_nodes && !worker_env::parse_cuda_visible_devices(*cvd).empty()) {
        // CUDA_VISIBLE_DEVICES counts where no GPU library answers, but not on a machine that
        // shows no NVIDIA device at all (a CPU-only container or CI job the variable leaked
        // into): there torch.cuda.is_available() is false, and torchrun counts the CPUs.
        const std::string why = "CUDA_VISIBLE_DEVICES='" + *cvd + "' is set, but this machine shows no NVIDIA GPU (" +
                                worker_env::kNoNvidiaDevice + "; " + probed().diagnostic + ")";
        if (kind == "gpu") {
          throw UsageError(g->what + "=gpu: " + why,
                           "pass a number of processes, use auto (falls back to the CPU count), or run where the "
                           "GPUs are");
        }
        cfg.nproc_per_node = std::max(ctx.cpus(), 1);
        cvd_names_nothing_here = true;  // and no GPU plan from it: the workers inherit it as it is
        out.notes.push_back(g->what + "=auto: " + why + ": counting the CPUs (" + std::to_string(cfg.nproc_per_node) +
                            ")");
      } else {
        cfg.nproc_per_node = parse_nproc_per_node(g->text, g->what, cvd, ctx.cpus(), probed());
        nproc_from_gpus = worker_env::count_visible_gpus(cvd, probed()) > 0;
      }
    } else {
      cfg.nproc_per_node = parse_nproc_per_node(g->text, g->what, cvd, kind == "cpu" ? ctx.cpus() : 1);
    }
  }
  if (auto g = p.given("max-restarts")) cfg.max_restarts = parse_max_restarts(g->text, g->what);
  if (auto g = p.given("role")) cfg.role = parse_non_empty(g->text, g->what, "give a role name, e.g. trainer");

  // Rendezvous.
  std::string endpoint_what = "--rdzv-endpoint";
  std::optional<Endpoint> static_endpoint;  // --rdzv-endpoint with the static backend
  cfg.standalone = p.flag("standalone");
  // As current torchrun (run.py): one node, the static backend and neither a port (--master-port,
  // PET_MASTER_PORT) nor --rdzv-endpoint is a standalone job, so that two such jobs on one
  // machine do not both take port 29500: a free port and a new run id. Unlike torchrun, not with
  // a --node-rank other than 0: that is a multi-node launch that forgot --nnodes, refused below.
  const bool implied_standalone = [&] {
    if (cfg.standalone || cfg.max_nodes != 1 || p.given("master-port") || p.given("rdzv-endpoint")) return false;
    if (auto g = p.given("rdzv-backend"); g && parse_rdzv_backend(g->text, g->what) != "static") return false;
    if (auto g = p.given("node-rank"); g && trim(g->text) != "0") return false;
    return !slurm_to_apply(p, ctx);
  }();
  if (implied_standalone && !p.given("nnodes")) {
    if (const auto slurm = slurm_from_env(ctx.env); slurm && slurm->nnodes > 1) {
      out.notes.push_back("inside a Slurm allocation of " + std::to_string(slurm->nnodes) +
                          " nodes, a placement flag without --nnodes runs a separate one-node job on each node "
                          "(ignored: the allocation's nodes); give --nnodes " +
                          std::to_string(slurm->nnodes) + " and --master-port, or no placement flag");
    }
  }
  const std::string standalone_why =
      cfg.standalone ? "--standalone" : "one node without --master-port (standalone, as torchrun)";
  if (implied_standalone) cfg.standalone = true;
  if (cfg.standalone) {
    std::vector<std::string> ignored;
    // As torchrun: a standalone job hosts its store on this machine at a free port, whatever
    // --master-addr/--master-port (or PET_MASTER_ADDR, which e.g. Kubeflow sets) say.
    for (std::string_view f : {"rdzv-backend", "rdzv-endpoint", "rdzv-id", "master-addr", "master-port"}) {
      if (auto g = p.given(f)) ignored.push_back(g->what + "=" + g->text);
    }
    if (!ignored.empty()) {
      std::string joined;
      for (const auto& s : ignored) joined += (joined.empty() ? "" : ", ") + s;
      out.notes.push_back(standalone_why + ": ignoring " + joined);
    }
    if (cfg.max_nodes > 1) {
      throw UsageError(
          "--standalone runs a single-node job but --nnodes allows " + std::to_string(cfg.max_nodes) + " nodes",
          "drop --standalone and use --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT for several nodes");
    }
    cfg.rdzv_backend = "c10d";
    cfg.rdzv_endpoint = "localhost:0";
    cfg.run_id = random_uuid4();
    cfg.master_port = 0;
  } else {
    if (auto g = p.given("rdzv-backend")) cfg.rdzv_backend = parse_rdzv_backend(g->text, g->what);
    if (auto g = p.given("rdzv-endpoint")) {
      // etcd takes a list of members (parsed with --rdzv-conf below).
      if (cfg.rdzv_backend == "etcd") {
        cfg.rdzv_endpoint = std::string(trim(g->text));
      } else {
        // c10d: one endpoint, or several relays of one ddprun-rdzvd tried in turn.
        const auto list = parse_endpoint_list(g->text, 29400, g->what);
        if (list.size() > 1) {
          if (cfg.rdzv_backend != "c10d") {
            throw UsageError(g->what + "=" + g->text +
                                 ": a list of endpoints is for --rdzv-backend=c10d (relays of "
                                 "one ddprun-rdzvd) and etcd",
                             "give one HOST[:PORT] for the " + cfg.rdzv_backend + " backend");
          }
          for (const auto& e : list) {
            if (e.port == 0) {
              throw UsageError(g->what + "=" + g->text + ": port 0 (host the rendezvous here) cannot be in a list",
                               "give each relay's fixed port, or one HOST:0 alone");
            }
          }
        }
        cfg.rdzv_endpoint = endpoint_list_text(list);
        const Endpoint& e = list.front();
        if (cfg.rdzv_backend == "static") {
          // torchrun's static backend refuses an endpoint without a port ("Port is absent").
          if (parse_endpoint(g->text, 1, g->what).port != e.port) {
            throw UsageError(g->what + "=" + g->text + ": the static backend needs a port",
                             "give HOST:PORT (node rank 0 serves there), or --master-addr and --master-port");
          }
          static_endpoint = e;
        }
        if (e.port == 0 && cfg.rdzv_backend == "c10d" && cfg.max_nodes > 1) {
          throw UsageError(g->what + "=" + g->text +
                               ": port 0 hosts the rendezvous on a free port of this machine, "
                               "which the other nodes cannot know",
                           "port 0 is for one node (several jobs on one machine); give a fixed port for " +
                               std::to_string(cfg.max_nodes) + " nodes");
        }
      }
      endpoint_what = g->what;
    }
    if (cfg.rdzv_backend == "etcd" && cfg.rdzv_endpoint.empty()) {
      throw UsageError("--rdzv-backend=etcd needs --rdzv-endpoint",
                       "pass the etcd members, the same on every node: --rdzv-endpoint=H1:2379,H2:2379");
    }
    if (cfg.rdzv_backend == "c10d" && cfg.rdzv_endpoint.empty()) {
      throw UsageError("--rdzv-backend=c10d needs --rdzv-endpoint",
                       "pass --rdzv-endpoint=HOST[:PORT] (the same on every node), or --standalone for one node");
    }
    if (auto g = p.given("rdzv-id"))
      cfg.run_id = parse_non_empty(g->text, g->what, "give a job id shared by all nodes");
  }
  {
    std::string conf_what = "--rdzv-conf";
    if (auto g = p.given("rdzv-conf")) {
      cfg.rdzv_conf = parse_rdzv_conf(g->text, g->what);
      conf_what = g->what;
    }
    cfg.rdzv = parse_rdzv_settings(cfg.rdzv_conf, conf_what, p.env("DDPRUN_RDZV_TOKEN"), &out.notes);
    if (!cfg.standalone && cfg.rdzv_backend == "etcd") {
      auto etcd =
          parse_etcd_conf(cfg.rdzv_endpoint, endpoint_what, cfg.rdzv_conf, conf_what, p.env("DDPRUN_ETCD_PASSWORD"));
      if (!etcd.password_file.empty())
        etcd.settings.password = read_password_file(absolute_in(etcd.password_file, ctx.cwd).string(), conf_what);
      for (const auto& [key, value] : cfg.rdzv_conf) {
        const auto name = etcd_conf_key_name(key);
        if (name == "cacert" || name == "cert" || name == "key") check_readable(value, ctx.cwd, conf_what, key);
      }
      if (cfg.run_id.find('/') != std::string::npos) {
        throw UsageError(
            "--rdzv-id=" + cfg.run_id + ": the etcd backend uses the id as a key part, which cannot hold '/'",
            "pass a --rdzv-id without '/'");
      }
      cfg.etcd = std::move(etcd.settings);
      for (auto* file : {&cfg.etcd.cacert, &cfg.etcd.cert, &cfg.etcd.key}) {
        if (!file->empty()) *file = absolute_in(*file, ctx.cwd).lexically_normal().string();
      }
    } else {
      for (const auto& [key, value] : cfg.rdzv_conf) {
        if (is_etcd_conf_key(key)) {
          throw UsageError(conf_what + ": key '" + key + "' applies only to --rdzv-backend etcd",
                           "drop it, or use --rdzv-backend=etcd");
        }
      }
    }
  }

  apply_slurm(p, ctx, out);

  if (auto g = p.given("node-rank")) {
    const int rank = parse_int_value(g->text, g->what, 0, 1'000'000);
    if (!cfg.standalone) {
      cfg.node_rank = rank;
    } else if (rank != 0) {
      // As torchrun: --standalone is a c10d rendezvous, which ranks the nodes itself.
      out.notes.push_back(standalone_why + ": ignoring " + g->what + "=" + g->text + " (a single-node job is node 0)");
    }
  }
  if (cfg.rdzv_backend == "static" && cfg.node_rank >= cfg.max_nodes) {
    throw UsageError(
        "--node-rank=" + std::to_string(cfg.node_rank) + " is not below --nnodes=" + std::to_string(cfg.max_nodes),
        "node ranks run from 0 to nnodes-1 with the static backend");
  }
  if (auto g = p.given("master-port")) {
    // An int to torchrun's argparse even where it is then ignored (--standalone, a static
    // --rdzv-endpoint): a typo is an error either way.
    const auto port = parse_port_value(g->text, g->what, 0);
    if (!cfg.standalone) cfg.master_port = port;
  }
  if (!cfg.standalone) {
    if (auto g = p.given("master-addr")) cfg.master_addr = parse_host(g->text, g->what);
  }
  if (static_endpoint) {
    // torchrun (run.py get_rdzv_endpoint): the static backend serves and joins at the endpoint
    // when one is given, else at master_addr:master_port; the workers' MASTER_ADDR/PORT follow.
    // The agent reads only master_addr/master_port, so the endpoint is folded in here, once.
    std::string ignored;
    for (std::string_view f : {"master-addr", "master-port"}) {
      if (auto g = p.given(f)) ignored += (ignored.empty() ? "" : ", ") + g->what + "=" + g->text;
    }
    if (!ignored.empty()) {
      out.notes.push_back(endpoint_what + " " + static_endpoint->to_string() +
                          " is where the static backend meets, as in torchrun: ignoring " + ignored);
    }
    cfg.master_addr = static_endpoint->host;
    cfg.master_port = static_endpoint->port;
  }
  if (!cfg.standalone && cfg.rdzv_backend == "static" && cfg.max_nodes > 1 && cfg.master_port == 0) {
    const std::string from = static_endpoint ? endpoint_what : std::string("--master-port");
    throw UsageError("a static multi-node job needs a fixed port (got 0 from " + from + ")",
                     "pass the same --master-addr and --master-port (or --rdzv-endpoint HOST:PORT) on every node "
                     "(node rank 0 serves there)");
  }
  if (auto g = p.given("local-addr")) cfg.local_addr = parse_host(g->text, g->what);
  if (auto g = p.given("metrics-port")) cfg.metrics_port = parse_port_value(g->text, g->what, 0);
  if (auto g = p.given("metrics-host")) {
    cfg.metrics_host = parse_ip_address(g->text, g->what);
    if (cfg.metrics_port < 0) {
      throw UsageError(
          std::string(g->what) + " is given without --metrics-port",
          "add --metrics-port PORT (0 picks a free one) to serve metrics, or drop " + std::string(g->what));
    }
  }

  // Output.
  std::optional<std::string> no_log_dir;  // "--log-dir=/dev/null" (the words to quote) when given
  if (auto g = p.given("log-dir")) {
    const std::filesystem::path dir(parse_non_empty(g->text, g->what, "give a directory"));
    const auto path = (dir.is_absolute() ? dir : ctx.cwd / dir).lexically_normal();
    if (path == "/dev/null") {
      // torch 2.6's DefaultLogsSpecs: os.devnull means no log directory at all.
      cfg.no_log_files = true;
      no_log_dir = g->what + "=" + g->text;
    } else {
      cfg.log_dir = path;
    }
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
  // A local rank past --nproc-per-node in a per-rank list names no worker (torchrun is silent):
  // a typo there would quietly hide a rank's output, or show none.
  {
    const auto beyond = [&](const std::string& what, const auto& ranks) {
      std::string listed;
      for (const auto& entry : ranks) {
        int r = 0;
        if constexpr (std::is_same_v<std::decay_t<decltype(entry)>, int>) {
          r = entry;
        } else {
          r = entry.first;
        }
        if (r >= cfg.nproc_per_node) listed += (listed.empty() ? "" : ",") + std::to_string(r);
      }
      if (listed.empty()) return;
      out.notes.push_back(what + ": local rank(s) " + listed + " ignored: this node runs local ranks 0.." +
                          std::to_string(cfg.nproc_per_node - 1) + " (--nproc-per-node " +
                          std::to_string(cfg.nproc_per_node) + ")");
    };
    if (auto g = p.given("redirects")) beyond(g->what, cfg.redirects);
    if (auto g = p.given("tee")) beyond(g->what, cfg.tee);
    if (auto g = p.given("local-ranks-filter"); g && cfg.local_ranks_filter) beyond(g->what, *cfg.local_ranks_filter);
  }
  if (auto t = p.env("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"); t && !t->empty()) cfg.log_line_prefix_template = *t;
  if (auto g = p.given("log-line-prefix-template")) cfg.log_line_prefix_template = g->text;
  cfg.prefix_console = p.flag("prefix-output");
  if (auto g = p.given("ranks-filter")) cfg.ranks_filter = parse_ranks_filter(g->text, g->what);
  if (auto g = p.given("node-label")) cfg.node_label = std::string(trim(g->text));
  if (auto g = p.given("node-order")) cfg.node_order = parse_int_value(g->text, g->what, 0, 1'000'000);

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
  cfg.shutdown_timeout = std::chrono::milliseconds(seconds_to_ms(grace));
  if (auto g = p.given("kill-timeout")) {
    const double s = parse_positive_seconds_value(g->text, g->what);
    cfg.kill_timeout = std::chrono::milliseconds(std::max<std::int64_t>(1, seconds_to_ms(s)));
  }
  cfg.virtual_local_rank = p.flag("virtual-local-rank");

  // Containment and diagnosis.
  if (auto g = p.given("containment")) cfg.containment = parse_containment_value(g->text, g->what);
  if (auto g = p.given("hang-timeout")) {
    cfg.hang_timeout = std::chrono::milliseconds(seconds_to_ms(parse_seconds_value(g->text, g->what)));
  }
  if (auto g = p.given("stacks")) cfg.stacks = parse_on_off(g->text, g->what);
  if (auto g = p.given("rank-memory")) cfg.rank_memory = parse_on_off(g->text, g->what);

  // GPUs: a plan only when GPUs are involved, so a CPU-only run is exactly as before.
  std::vector<std::string> rank_bus_ids;  // per local rank, from the plan (for --numa-binding)
  {
    const auto gpus = p.given("gpus");
    const bool isolation = p.flag("gpu-isolation");
    const bool sharing = p.flag("gpu-sharing");
    if (gpus) parse_gpus_value(gpus->text, gpus->what);
    const bool wants_gpus = gpus.has_value() || isolation || cfg.virtual_local_rank;
    if (wants_gpus) probed();
    if (wants_gpus && amd_only()) {
      // (--virtual-local-rank too: its CUDA_VISIBLE_DEVICES per rank is ignored by HIP where
      // HIP_VISIBLE_DEVICES is set, and every rank would then use the same device.)
      throw UsageError(std::string(gpus        ? gpus->what
                                   : isolation ? "--gpu-isolation"
                                               : "--virtual-local-rank") +
                           ": the AMD GPUs of this machine (ROCm) are counted but not assigned to ranks: not "
                           "supported yet",
                       "run without it: each rank picks its device from LOCAL_RANK (torch.cuda.set_device)");
    }
    const bool have_gpus = inventory && !inventory->devices.empty();
    // torchrun's --virtual-local-rank on a machine without any GPU: LOCAL_RANK=0 and
    // CUDA_VISIBLE_DEVICES=<local rank>, as before (build_worker_env does it).
    const bool cpu_virtual = cfg.virtual_local_rank && !gpus && !isolation && !cvd && !have_gpus;
    if (cvd && !cvd_names_nothing_here && !wants_gpus && !nproc_from_gpus && !have_gpus &&
        !worker_env::parse_cuda_visible_devices(*cvd).empty() && !worker_env::nvidia_device_present()) {
      // Only CUDA_VISIBLE_DEVICES asks for a GPU plan, on a machine without any NVIDIA device: a
      // value leaked into a CPU-only container or CI job. The workers inherit it as it is.
      cvd_names_nothing_here = true;
      out.notes.push_back("CUDA_VISIBLE_DEVICES='" + *cvd + "' is set, but this machine shows no NVIDIA GPU (" +
                          worker_env::kNoNvidiaDevice + "): no GPU plan, the workers inherit it as it is");
    }
    if (!cpu_virtual && ((cvd && !cvd_names_nothing_here) || wants_gpus || nproc_from_gpus)) {
      worker_env::GpuRequest req;
      req.parent_cvd = cvd;
      req.parent_device_order = p.env("CUDA_DEVICE_ORDER");
      if (inventory) req.inventory = *inventory;
      if (gpus) req.gpus = std::string(trim(gpus->text));
      req.mode = cfg.virtual_local_rank ? worker_env::GpuMode::virtual_local_rank
                 : isolation            ? worker_env::GpuMode::isolate
                                        : worker_env::GpuMode::shared;
      req.nproc = cfg.nproc_per_node;
      req.allow_sharing = sharing;
      req.bus_order_used = p.given("numa-binding").has_value();
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
  if (auto g = p.given("nccl-roots")) cfg.nccl_roots = parse_nccl_roots(g->text, g->what);

  // CPU/NUMA binding: planned here from sysfs (DDPRUN_SYSFS_ROOT overrides /sys, for tests), near
  // each rank's GPU when its PCI bus id is known, else spread over the NUMA nodes.
  if (auto g = p.given("numa-binding")) {
    const auto mode = worker_env::parse_numa_binding(g->text, g->what);
    std::vector<std::string> bus_ids;
    if (!rank_bus_ids.empty()) {
      bus_ids = rank_bus_ids;
    } else if (!(cvd && trim(*cvd).empty())) {
      for (const auto& v : worker_env::visible_devices(cvd, probed()))
        bus_ids.push_back(v.device ? v.device->pci_bus_id : "");
    }
    const auto root = p.env("DDPRUN_SYSFS_ROOT");
    const std::string sysfs = root && !trim(*root).empty() ? std::string(trim(*root)) : std::string("/sys");
    const auto plan =
        worker_env::plan_numa_binding(mode, sysfs, cfg.nproc_per_node, bus_ids, worker_env::current_cpu_affinity());
    cfg.numa_binding = std::string(trim(g->text));
    cfg.cpu_binding = plan.per_rank;
    if (bus_ids.empty() || std::find(bus_ids.begin(), bus_ids.end(), std::string()) != bus_ids.end()) {
      out.notes.push_back(g->what + ": " + plan.note);
    }
  }
  if (auto g = p.given("event-log-handler")) cfg.event_log = parse_event_log_handler(g->text, g->what);
  resolve_torchelastic_env(p, cfg);
  resolve_uninterruptible_state_timeout(p, out);
  if (auto g = p.given("duplicate-stdout-filters")) cfg.duplicate_stdout_filters = parse_duplicate_filters(g->text);
  if (auto g = p.given("duplicate-stderr-filters")) cfg.duplicate_stderr_filters = parse_duplicate_filters(g->text);
  if (no_log_dir) {
    // No file for these to write: torch 2.6 leaves redirected and tee'd streams on the console,
    // and the filters' copies have nowhere to go.
    std::string ignored;
    for (std::string_view f : {"redirects", "tee", "duplicate-stdout-filters", "duplicate-stderr-filters"}) {
      if (auto g = p.given(f)) ignored += (ignored.empty() ? "" : ", ") + g->what + "=" + g->text;
    }
    if (!ignored.empty()) {
      out.notes.push_back(*no_log_dir + " writes no log files: ignoring " + ignored +
                          " (the streams go to the console)");
    }
    cfg.redirects_all = cfg.tee_all = agent::Streams::none;
    cfg.redirects.clear();
    cfg.tee.clear();
    cfg.duplicate_stdout_filters.clear();
    cfg.duplicate_stderr_filters.clear();
  }

  // Legacy --local-rank argument.
  cfg.local_rank_arg = check_no_effect_flags(p, out.notes);

  cfg.dry_run = p.flag("dry-run");

  // The program.
  const std::vector<std::string> rest =
      program_words(remaining, "usage: ddprun [options] SCRIPT.py|-m MODULE|PROGRAM [ARGS...]");
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
  // The one place the job's mode (single node / static multi-node / elastic) is decided.
  cfg.job_mode = agent::decide_job_mode(cfg);
  // torch 2.x's opt-out of the shared store, read as torch reads it (exactly "1"): only its
  // dynamic rendezvous (--standalone, c10d, etcd-v2) looks at it; its static one always shares.
  if (auto e = p.env("TORCH_DISABLE_SHARE_RDZV_TCP_STORE"); e && *e == "1") {
    if (cfg.standalone || *cfg.job_mode == agent::JobMode::elastic) {
      cfg.share_worker_store = false;
    } else {
      out.notes.push_back(
          "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 has no effect with the static rendezvous (as in torchrun): the agent "
          "hosts the workers' store; it applies with --standalone or --rdzv-backend c10d|etcd|etcd-v2");
    }
  }
}

}  // namespace ddprun::launcher::detail
