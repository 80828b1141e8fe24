#pragma once
// AgentConfig: everything the per-node agent needs, already validated by the launcher
// (launcher/ turns flags, PET_* variables and defaults into this). The agent never parses
// user text itself.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "ddprun/common/endpoint.hpp"
#include "ddprun/worker_env/worker_env.hpp"

namespace ddprun::agent {

// Rendezvous settings for elastic multi-node jobs (from --rdzv-conf and DDPRUN_RDZV_TOKEN; see
// docs/cli.md "Rendezvous settings"). Durations are exact milliseconds; all are > 0.
struct RendezvousSettings {
  std::chrono::milliseconds join_timeout{std::chrono::seconds(600)};
  std::chrono::milliseconds last_call_timeout{std::chrono::seconds(30)};
  std::chrono::milliseconds close_timeout{std::chrono::seconds(30)};
  std::chrono::milliseconds read_timeout{std::chrono::seconds(60)};  // connect/reconnect budget
  std::chrono::milliseconds heartbeat_interval{std::chrono::seconds(1)};
  int missed_heartbeats = 3;
  std::chrono::milliseconds exit_barrier_timeout{std::chrono::seconds(300)};
  std::optional<bool> is_host;  // nullopt = guess from the endpoint address
  std::string token;            // "" = none
};

// The etcd backend's connection (--rdzv-backend etcd; docs/cli.md "etcd backend"): the
// launcher fills it from --rdzv-endpoint and --rdzv-conf. Empty endpoints for every other backend.
struct EtcdSettings {
  std::vector<Endpoint> endpoints;  // every member the agent may talk to, in order
  bool tls = false;                 // protocol=https (or https:// endpoints)
  std::string cacert;               // PEM files; "" = system CAs / no client certificate
  std::string cert;
  std::string key;
  std::string username;             // etcd auth; "" = off
  std::string password;             // from password_file or DDPRUN_ETCD_PASSWORD (or password=)
  std::string prefix = "/ddprun/";  // etcd_prefix, always ending in '/'
};

// How the job runs, decided once from the flags (job_mode()):
//  * single_node: --standalone, or one node without --rdzv-backend=c10d; the local restart
//    budget decides restarts.
//  * static_multi_node: --rdzv-backend=static with more than one node; node rank 0 hosts the
//    rendezvous at --master-addr:--master-port, the world is always --nnodes' maximum.
//  * elastic: --rdzv-backend=c10d or etcd (any --nnodes) without --standalone; the rendezvous
//    at --rdzv-endpoint (ddprun-rdzvd, an embedded host, or etcd) decides membership and restarts.
enum class JobMode : std::uint8_t { single_node, static_multi_node, elastic };
const char* to_string(JobMode mode);

// torchrun's Std: which streams of a worker go to files (redirects) or to files and console (tee).
enum class Streams : std::uint8_t { none = 0, out = 1, err = 2, both = 3 };

struct AgentConfig {
  // The worker command, fully resolved: e.g. {"/usr/bin/python3", "-u", "train.py", "--lr", "1"}
  // or {"/abs/path/train", "--x"}. argv[0] is an absolute path or a name found on PATH.
  std::vector<std::string> worker_argv;
  bool python_worker = false;  // the worker is a Python interpreter (PYTHONUNBUFFERED=1)
  // Legacy torch.distributed.launch behaviour (--use-env off): append --local-rank=N /
  // --local_rank=N to each worker's arguments.
  enum class LocalRankArg : std::uint8_t { none, dash, underscore } local_rank_arg = LocalRankArg::none;
  // Index in worker_argv where the user's own arguments begin (after interpreter, -u, script):
  // the legacy --local-rank argument is inserted there, as torch.distributed.launch does.
  // Values past the end mean "append".
  std::size_t user_args_index = static_cast<std::size_t>(-1);
  std::optional<std::filesystem::path> working_dir;  // default: the agent's cwd

  int nproc_per_node = 1;
  int min_nodes = 1;
  int max_nodes = 1;
  int node_rank = 0;
  std::string role = "default";
  std::string rdzv_backend = "static";  // static | c10d | etcd (etcd-v2 is read as etcd)
  std::string rdzv_endpoint;            // host[:port]; etcd: h1:2379,h2:2379 as given
  EtcdSettings etcd;                    // etcd only
  std::string run_id = "none";
  std::map<std::string, std::string> rdzv_conf;  // as given (for messages)
  RendezvousSettings rdzv;                       // rdzv_conf translated and validated
  bool standalone = false;
  int max_restarts = 0;
  // Set by the launcher from decide_job_mode(); nullopt = decide from the fields above.
  std::optional<JobMode> job_mode;

  // The workers' store (TORCHELASTIC_USE_AGENT_STORE): true = the agent hosts it at
  // MASTER_ADDR:MASTER_PORT; false = rank 0 of the workers hosts it there (torch 2.x's
  // TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which the launcher reads for the modes torch's dynamic
  // rendezvous covers: --standalone and elastic), on a port the agent keeps reserved for it.
  bool share_worker_store = true;

  std::string master_addr = "127.0.0.1";
  std::uint16_t master_port = 29500;  // 0 = bind any free port (standalone)
  std::optional<std::string> local_addr;

  // Output. Empty maps mean "same for all local ranks" via the *_all fields.
  std::optional<std::filesystem::path> log_dir;  // default: a fresh dir under $TMPDIR
  // --log-dir /dev/null (torch 2.6's os.devnull): no log files and no error files
  // (TORCHELASTIC_ERROR_FILE empty); log_dir stays unset, so ddprun's own run directory is the
  // temporary one, and a stream that would go to a file only goes nowhere (Route::discard).
  bool no_log_files = false;
  Streams redirects_all = Streams::none;
  std::map<int, Streams> redirects;  // per local rank overrides
  Streams tee_all = Streams::none;
  std::map<int, Streams> tee;
  std::optional<std::set<int>> local_ranks_filter;  // console only; nullopt = all
  std::string log_line_prefix_template = "[${role_name}${local_rank}]:";
  // --prefix-output: every console line of every worker carries the prefix (the streams are
  // piped through the agent instead of inherited). The fan-out launcher asks remote agents for it.
  bool prefix_console = false;
  // --ranks-filter: only these GLOBAL ranks reach the console (the others go to their log files,
  // like --local-ranks-filter). nullopt = all. Global ranks are known per round, so the routes
  // are planned at each spawn.
  std::optional<std::set<int>> ranks_filter;

  std::vector<int> signals_to_handle;  // default SIGTERM, SIGINT, SIGHUP, SIGQUIT
  std::chrono::milliseconds shutdown_timeout{std::chrono::seconds(30)};
  // --kill-timeout: how long a worker may take to end after SIGKILL before ddprun stops waiting
  // for it (a process stuck in the kernel: it ends when the kernel lets it go).
  std::chrono::milliseconds kill_timeout{std::chrono::seconds(30)};
  // Containment and diagnosis (containment.hpp, diagnosis.hpp).
  std::string containment = "auto";           // auto | cgroup2 | cgroup1 | proc | off
  std::chrono::milliseconds hang_timeout{0};  // 0 = no hang detection
  bool stacks = true;                         // collect survivors' stacks on failure
  bool rank_memory = false;                   // a memory cgroup per rank (--rank-memory on)
  bool virtual_local_rank = false;            // as given; the GPU plan implements it when gpu_env is set

  // GPU plan (worker_env::plan_gpus, computed by the launcher; docs/gpus.md). Empty when no GPU
  // is involved (a CPU job behaves exactly as before). Otherwise one entry per local rank: the
  // variables appended AFTER build_worker_env (they win), and the --dry-run device column.
  std::vector<worker_env::EnvList> gpu_env;
  std::vector<std::string> gpu_devices;
  std::string gpu_summary;

  // --nccl-id: run the ddprun-nccl-id holder each attempt and export DDPRUN_NCCL_UNIQUE_ID(S).
  // automatic: without NCCL, say so once and export nothing; env: missing NCCL is an error.
  // comm_id: no holder; export NCCL_COMM_ID=<rank-0 node's address>:<a free port picked per
  // attempt> (docs/gpus.md: one communicator at a time).
  enum class NcclIdMode : std::uint8_t { automatic, env, off, comm_id } nccl_id = NcclIdMode::automatic;
  std::string nccl_id_holder;  // the holder binary; "" = ddprun-nccl-id next to the running executable
  int nccl_roots = 0;          // --nccl-roots; 0 = automatic: 1, or ceil(world_size / 256) above 256 ranks

  // --numa-binding (docs/gpus.md), planned by the launcher (worker_env::plan_numa_binding): the
  // CPU ids each local rank is bound to (sched_setaffinity in the child before exec; best effort).
  // Empty = no binding. numa_binding is the mode as given, for messages and --dry-run.
  std::string numa_binding;
  std::vector<std::vector<int>> cpu_binding;

  bool dry_run = false;  // print each rank's argv/env/cwd and exit 0
  // Prometheus metrics over HTTP (agent_metrics.hpp): -1 = none, 0 = a free port; on
  // metrics_host, an IP address literal (loopback unless told otherwise).
  int metrics_port = -1;
  std::string metrics_host = "127.0.0.1";

  // torch's elastic-agent environment (docs/worker-env.md), read by the launcher:
  // TORCHELASTIC_ENABLE_FILE_TIMER=1 serves torch's FileTimerClient on a FIFO (file_timer.hpp) at
  // file_timer_path (TORCHELASTIC_TIMER_FILE; "" = /tmp/watchdog_timer_<uuid>, as torch's agent),
  // exported to the workers as TORCHELASTIC_TIMER_FILE.
  bool file_timer = false;
  std::string file_timer_path;
  // TORCHELASTIC_HEALTH_CHECK_PORT: the HTTP health endpoint (health_endpoint.hpp); nullopt = none.
  std::optional<std::uint16_t> health_check_port;
  // TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT (seconds, as current torchrun): a worker process in
  // uninterruptible sleep (state D) this long makes the group unhealthy; this node then stops its
  // workers and leaves the job without a restart. 0 = off.
  std::chrono::milliseconds uninterruptible_state_timeout{0};
  // --event-log-handler (event_log.hpp): "null" = none, "console" = stderr, "file:PATH" = append to PATH.
  std::string event_log = "null";
  // --duplicate-stdout-filters / --duplicate-stderr-filters: worker lines containing any of these
  // substrings are also copied to <attempt>/filtered_std{out,err}.log. Empty = none.
  std::vector<std::string> duplicate_stdout_filters;
  std::vector<std::string> duplicate_stderr_filters;

  // Remote-agent mode (ddprun --remote-agent, started by a fan-out launcher over ssh; see
  // docs/multinode.md). control_fd is the launcher's control channel (the agent owns it; -1 =
  // none): lines "S<signo>\n" forward a signal as if the agent had received it; EOF means the
  // launcher or its ssh connection is gone, and the agent stops its workers and exits.
  // node_label names this host in messages; with it set, the job-failure summary is printed only
  // by the node whose worker failed (the launcher shows every host's output in one terminal).
  int control_fd = -1;
  std::string node_label;
  // The place of this node in the group-rank order (hidden --node-order, set by a fan-out
  // launcher to the host's position in its list; rendezvous NodeInfo::order). nullopt = join order.
  std::optional<int> node_order;
};

// The mode the flags above ask for (pure; see JobMode).
JobMode decide_job_mode(const AgentConfig& config);
// config.job_mode when set, else decide_job_mode(config).
JobMode job_mode(const AgentConfig& config);

// The signals the agent catches and forwards to its workers: --signals-to-handle, by default
// SIGTERM, SIGINT, SIGHUP, SIGQUIT (torchrun's).
std::vector<int> handled_signals(const AgentConfig& config);
// The same as torchrun >= 2.9 exports it to the workers (TORCHELASTIC_SIGNALS_TO_HANDLE):
// "SIGTERM,SIGINT,SIGHUP,SIGQUIT".
std::string handled_signals_text(const AgentConfig& config);

// Throws UsageError naming the flag for a configuration the agent cannot run.
void validate_config(const AgentConfig& config);

}  // namespace ddprun::agent
