#include "ddprun/launcher/flags.hpp"

#include <algorithm>
#include <array>

namespace ddprun::launcher {
namespace {

using K = FlagKind;
using S = FlagScope;
using Words = std::string_view;

constexpr Words kNprocKeywords[] = {"gpu", "cpu", "auto"};
constexpr Words kBackends[] = {"static", "c10d", "etcd", "etcd-v2"};
constexpr Words kShells[] = {"bash", "zsh"};  // torchrun also takes tcsh: refused, not supported yet
constexpr Words kStartMethods[] = {"spawn", "fork", "forkserver"};
constexpr Words kStreamDigits[] = {"0", "1", "2", "3"};
constexpr Words kNcclIdModes[] = {"auto", "env", "comm-id", "off"};
constexpr Words kNumaModes[] = {"node", "socket", "exclusive", "core-complex"};
constexpr Words kLocalRankArgs[] = {"dash", "underscore", "none"};
constexpr Words kContainmentModes[] = {"auto", "cgroup2", "cgroup1", "proc", "off"};
constexpr Words kOnOff[] = {"on", "off"};
constexpr Words kLogLevels[] = {"trace", "debug", "info", "warning", "error", "critical", "off"};

// Each row names only the members that differ from FlagSpec's defaults; GCC's
// -Wmissing-field-initializers would flag every designated initializer that omits one.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
// clang-format off
constexpr FlagSpec kFlags[] = {
  {.dash = "nnodes", .scope = S::placement, .env_form = true, .metavar = "N|MIN:MAX",
   .help = "Number of nodes, or MIN:MAX for a range (0 < MIN <= MAX).", .default_text = "1:1",
   .overrides_slurm = true},
  {.dash = "nproc-per-node", .scope = S::planned, .env_form = true, .metavar = "N|gpu|cpu|auto",
   .help = "Workers per node: a number, gpu (visible GPUs: CUDA_VISIBLE_DEVICES, else NVML / the CUDA "
           "driver), cpu (online CPUs) or auto (gpu when there is a GPU, else cpu).",
   .default_text = "1", .choices = kNprocKeywords, .choices_open = true},
  {.dash = "rdzv-backend", .scope = S::placement, .env_form = true, .metavar = "static|c10d|etcd",
   .help = "Rendezvous backend (etcd-v2 is read as etcd: etcd's v3 API).", .default_text = "static", .choices = kBackends, .overrides_slurm = true},
  {.dash = "rdzv-endpoint", .scope = S::placement, .env_form = true, .metavar = "HOST[:PORT]",
   .help = "Rendezvous endpoint (c10d default port 29400; [IPV6]:PORT accepted; c10d also R1[:PORT],R2[:PORT],...: "
           "relays of one ddprun-rdzvd, tried in turn); etcd: H1[:PORT],H2[:PORT],... (default port 2379, http:// or "
           "https:// allowed).", .default_text = "none",
   .overrides_slurm = true},
  {.dash = "rdzv-id", .scope = S::placement, .env_form = true, .metavar = "ID",
   .help = "Job id shared by all nodes.", .default_text = "none", .overrides_slurm = true},
  {.dash = "rdzv-conf", .scope = S::planned, .env_form = true, .metavar = "K=V,...",
   .help = "Extra rendezvous settings, e.g. join_timeout=900; etcd: protocol=https, cacert, cert, key, "
           "etcd_prefix, username, password_file (or DDPRUN_ETCD_PASSWORD)."},
  {.dash = "standalone", .kind = K::boolean, .scope = S::placement, .env_form = true,
   .help = "Single-node job with a local c10d rendezvous on a free port and a random run id; explicit "
           "--rdzv-* values are ignored.",
   .overrides_slurm = true},
  {.dash = "max-restarts", .scope = S::forwarded, .env_form = true, .metavar = "N",
   .help = "Worker group restarts before failing.", .default_text = "0"},
  {.dash = "metrics-host", .scope = S::forwarded, .env_form = true, .metavar = "ADDR",
   .help = "The IP address the agent's metrics endpoint (--metrics-port) listens on: 0.0.0.0 or :: for every "
           "address. With a host list, every host's agent listens on it.",
   .default_text = "127.0.0.1"},
  {.dash = "metrics-port", .scope = S::forwarded, .env_form = true, .metavar = "PORT",
   .help = "Serve this agent's Prometheus metrics on GET /metrics over HTTP at this port on --metrics-host; 0 "
           "picks a free one (logged as 'metrics on http://ADDR:PORT/metrics'). With a host list, every host's "
           "agent serves its own."},
  {.dash = "monitor-interval", .scope = S::local, .env_form = true, .metavar = "SECONDS",
   .help = "Accepted for compatibility, no effect: ddprun reacts to worker exits as they happen (event "
           "driven, no polling).",
   .default_text = "0.1"},
  {.dash = "start-method", .scope = S::local, .env_form = true, .metavar = "spawn|fork|forkserver",
   .help = "Accepted for compatibility, no effect: workers are always started as new processes.",
   .default_text = "spawn", .choices = kStartMethods},
  {.dash = "role", .scope = S::forwarded, .env_form = true, .metavar = "NAME",
   .help = "Role name of the workers (ROLE_NAME, log prefix).", .default_text = "default"},
  {.dash = "module", .short_name = "m", .kind = K::boolean, .scope = S::forwarded, .env_form = true,
   .help = "Run the program as a Python module, like python -m."},
  {.dash = "no-python", .kind = K::boolean, .scope = S::forwarded, .env_form = true,
   .help = "Execute the program directly instead of under Python."},
  {.dash = "run-path", .kind = K::boolean, .scope = S::forwarded, .env_form = true,
   .help = "Run the script with runpy.run_path (takes precedence over --no-python)."},
  {.dash = "log-dir", .scope = S::forwarded, .env_form = true, .metavar = "DIR",
   .help = "Base directory for worker log files.", .default_text = "a new directory under $TMPDIR"},
  {.dash = "redirects", .short_name = "r", .scope = S::forwarded, .env_form = true, .metavar = "0-3|R:V,...",
   .help = "Send worker streams to log files only: 0 none, 1 stdout, 2 stderr, 3 both; or per local "
           "rank, e.g. 0:1,1:2.",
   .default_text = "0", .choices = kStreamDigits, .choices_open = true},
  {.dash = "tee", .short_name = "t", .scope = S::forwarded, .env_form = true, .metavar = "0-3|R:V,...",
   .help = "Send worker streams to log files and the console (same values as --redirects).",
   .default_text = "0", .choices = kStreamDigits, .choices_open = true},
  {.dash = "local-ranks-filter", .scope = S::forwarded, .env_form = true, .metavar = "R,...",
   .help = "Only these local ranks' output reaches the console (log files are unaffected).",
   .default_text = "all"},
  {.dash = "node-rank", .scope = S::placement, .env_form = true, .metavar = "N",
   .help = "Rank of this node (static backend only).", .default_text = "0", .overrides_slurm = true},
  {.dash = "master-addr", .scope = S::placement, .env_form = true, .metavar = "HOST",
   .help = "Address of the rank 0 node (static backend only; IPv6 as [::1]).", .default_text = "127.0.0.1",
   .overrides_slurm = true},
  {.dash = "master-port", .scope = S::placement, .env_form = true, .metavar = "PORT",
   .help = "Port on the rank 0 node (static backend only). Unset, a job of one node runs as --standalone "
           "(a free port).",
   .default_text = "29500 with several nodes"},
  {.dash = "local-addr", .scope = S::placement, .env_form = true, .metavar = "HOST",
   .help = "Address this node advertises to the others."},
  {.dash = "signals-to-handle", .scope = S::forwarded, .env_form = true, .metavar = "SIG,...",
   .help = "Signals ddprun catches and forwards to the workers.", .default_text = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"},
  {.dash = "shutdown-timeout", .scope = S::forwarded, .env_form = true, .metavar = "SECONDS",
   .help = "Grace between SIGTERM and SIGKILL when stopping workers.",
   .default_text = "$TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30"},
  {.dash = "kill-timeout", .scope = S::forwarded, .env_form = true, .metavar = "SECONDS",
   .help = "After SIGKILL, how long ddprun waits for a worker to end before it gives up on it (a process stuck in "
           "the kernel, which ends when the kernel lets it go): the node then leaves the job without a restart. "
           "A signal after that SIGKILL (another Ctrl-C) gives up at once.",
   .default_text = "30"},
  {.dash = "virtual-local-rank", .kind = K::boolean, .scope = S::forwarded, .env_form = true,
   .help = "Each worker sees LOCAL_RANK=0 and CUDA_VISIBLE_DEVICES set to its own device."},
  {.dash = "gpus", .scope = S::planned, .env_form = true, .metavar = "LIST",
   .help = "Devices the workers use: ordinals of the visible devices (cuda:N) or GPU UUIDs (prefixes), "
           "e.g. 1,3.",
   .default_text = "all visible devices"},
  {.dash = "gpu-isolation", .kind = K::boolean, .scope = S::forwarded, .env_form = true,
   .help = "Each worker's CUDA_VISIBLE_DEVICES holds exactly its own device (cuda:0 inside the worker)."},
  {.dash = "gpu-sharing", .kind = K::boolean, .scope = S::forwarded, .env_form = true,
   .help = "Allow more workers than selected devices (assigned round robin) with --gpus, --gpu-isolation "
           "or --virtual-local-rank."},
  {.dash = "nccl-id", .scope = S::forwarded, .env_form = true, .metavar = "auto|env|comm-id|off",
   .help = "Export a fresh NCCL unique ID per attempt as DDPRUN_NCCL_UNIQUE_ID. auto: skip it when NCCL is "
           "missing; env: missing NCCL is an error; comm-id: export NCCL_COMM_ID=<rank-0 address>:<free port> "
           "instead (one communicator at a time); off: export nothing.",
   .default_text = "auto", .choices = kNcclIdModes},
  {.dash = "nccl-roots", .scope = S::forwarded, .env_form = true, .metavar = "K",
   .help = "Number of NCCL unique IDs (bootstrap roots) per attempt, exported as DDPRUN_NCCL_UNIQUE_IDS "
           "when K > 1.",
   .default_text = "1, or ceil(world size / 256) above 256 ranks"},
  {.dash = "log-line-prefix-template", .scope = S::local, .env_form = true, .metavar = "TEMPLATE",
   .help = "Prefix of console lines that ddprun relays (--tee, --prefix-output): ${role_name}, ${rank}, "
           "${local_rank}.",
   .default_text = "$TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, else [${role_name}${local_rank}]:"},
  {.dash = "prefix-output", .kind = K::boolean, .scope = S::local, .env_form = true,
   .help = "Prefix every console line of every worker with the --log-line-prefix-template (whole lines)."},
  {.dash = "ranks-filter", .scope = S::planned, .env_form = true, .metavar = "R,R-R,...",
   .help = "Only these global ranks' output reaches the console, e.g. 0,3-5 (log files are unaffected).",
   .default_text = "all"},
  // SSH fan-out (docs/multinode.md): any host source makes this ddprun the launcher of the job.
  {.dash = "hostfile", .scope = S::host_list, .env_form = true, .metavar = "FILE",
   .help = "Start one agent per host over ssh. Lines: 'host slots=N', 'host:N' or 'host' (user@host ok), # comments."},
  {.dash = "hosts", .scope = S::host_list, .env_form = true, .metavar = "H[:N],...",
   .help = "Hosts to start agents on over ssh, e.g. node1,node2:4,user@node3."},
  {.dash = "include", .scope = S::fanout, .env_form = true, .metavar = "H[:S,S]@H...",
   .help = "DeepSpeed syntax: only these hosts (and slots), e.g. worker-0:0,2@worker-1."},
  {.dash = "exclude", .scope = S::fanout, .env_form = true, .metavar = "H[:S,S]@H...",
   .help = "DeepSpeed syntax: leave out these hosts (or slots of them)."},
  {.dash = "num-nodes", .scope = S::fanout, .env_form = true, .metavar = "N", .help = "Use only the first N hosts."},
  {.dash = "num-gpus", .scope = S::fanout, .env_form = true, .metavar = "N",
   .help = "Use only the first N slots (devices) of each host."},
  {.dash = "ssh-port", .scope = S::fanout, .env_form = true, .metavar = "PORT", .help = "Port of sshd on the hosts.",
   .default_text = "ssh's (its config, else 22)"},
  {.dash = "ssh-option", .kind = K::repeated, .scope = S::fanout, .metavar = "OPT",
   .help = "Extra ssh option, passed as -o OPT (repeatable), e.g. --ssh-option IdentityFile=~/.ssh/cluster."},
  {.dash = "ssh-config", .scope = S::fanout, .env_form = true, .metavar = "FILE",
   .help = "ssh client configuration file (ssh -F FILE).", .default_text = "~/.ssh/config"},
  {.dash = "ssh-max-inflight", .scope = S::fanout, .env_form = true, .metavar = "K",
   .help = "At most K ssh connections being set up at once.", .default_text = "32"},
  {.dash = "ssh-tree-threshold", .scope = S::fanout, .env_form = true, .metavar = "H",
   .help = "With more than H hosts, launch through a tree of agents that start agents (0 or off: always flat).",
   .default_text = "64"},
  {.dash = "ssh-tree-fanout", .scope = S::fanout, .env_form = true, .metavar = "F",
   .help = "Hosts each node of the launch tree (the launcher included) starts over ssh.", .default_text = "16"},
  {.dash = "remote-ddprun", .scope = S::fanout, .env_form = true, .metavar = "PATH", .help = "ddprun on the hosts.",
   .default_text = "this ddprun's own path"},
  {.dash = "remote-cwd", .scope = S::fanout, .env_form = true, .metavar = "DIR", .help = "Working directory on the hosts.",
   .default_text = "the current directory"},
  {.dash = "env", .kind = K::repeated, .scope = S::fanout, .metavar = "NAME[=VALUE]",
   .help = "Carry a variable to the workers on every host (repeatable): NAME copies this shell's value."},
  {.dash = "env-file", .scope = S::fanout, .env_form = true, .metavar = "FILE",
   .help = "Carry the NAME=VALUE lines of FILE to the workers on every host."},
  {.dash = "launcher-addr", .scope = S::fanout, .env_form = true, .metavar = "ADDR",
   .help = "Address of this machine the hosts reach the launcher's rendezvous at.",
   .default_text = "the one that routes to the first host"},
  {.dash = "node-label", .scope = S::placement, .metavar = "LABEL",
   .help = "The host name a fan-out launcher gives its remote agent, for log prefixes and messages.",
   .hidden = true},
  {.dash = "node-order", .scope = S::placement, .metavar = "N",
   .help = "The host's position in a fan-out launcher's host list: group ranks follow it (c10d backend).",
   .hidden = true},
  {.dash = "numa-binding", .scope = S::forwarded, .metavar = "node|socket|exclusive|core-complex",
   .help = "Bind each worker to the CPUs near its GPU: node (the GPU's NUMA node), socket (its sockets), "
           "exclusive (the node's cores split among its workers), core-complex (one L3 group each). "
           "Without a GPU, workers are spread over the NUMA nodes. Best effort.",
   .default_text = "no binding", .choices = kNumaModes},
  {.dash = "logs-specs", .scope = S::local, .metavar = "NAME",
   .help = "torchrun's torchrun.logs_specs entry point: only 'default' (ddprun's own log layout, torchrun's "
           "DefaultLogsSpecs); Python plugins cannot be loaded.",
   .default_text = "default"},
  {.dash = "event-log-handler", .scope = S::forwarded, .env_form = true,
   .metavar = "null|dynamic_rendezvous|console|file:PATH",
   .help = "Where the agent's events go, as JSON lines: null (nowhere), console (stderr), file:PATH (appended); "
           "torchrun's dynamic_rendezvous writes nothing, as in torchrun.",
   .default_text = "null"},
  {.dash = "duplicate-stdout-filters", .scope = S::forwarded, .env_form = true, .metavar = "TEXT,...",
   .help = "Copy every worker stdout line containing any of these substrings to filtered_stdout.log in the "
           "attempt's log directory (',,' is a literal comma).",
   .default_text = "none"},
  {.dash = "duplicate-stderr-filters", .scope = S::forwarded, .env_form = true, .metavar = "TEXT,...",
   .help = "The same for stderr, into filtered_stderr.log.", .default_text = "none"},
  // ddprun extras and torch.distributed.launch compatibility.
  {.dash = "local-rank-arg", .scope = S::forwarded, .env_form = true, .metavar = "none|dash|underscore",
   .help = "Legacy torch.distributed.launch behaviour: put --local-rank=N (dash) or --local_rank=N "
           "(underscore) before each worker's own arguments; none passes nothing.",
   .default_text = "none", .choices = kLocalRankArgs},
  {.dash = "use-env", .kind = K::boolean, .scope = S::local, .env_form = true,
   .help = "Accepted for torch.distributed.launch compatibility, no effect: LOCAL_RANK and the other "
           "variables are always set."},
  {.dash = "dry-run", .kind = K::boolean, .scope = S::process,
   .help = "Print each local rank's command, environment and directory, start nothing, exit 0."},
  {.dash = "log-level", .scope = S::forwarded, .metavar = "LEVEL",
   .help = "trace, debug, info, warning, error, critical or off.",
   .default_text = "$DDPRUN_LOG_LEVEL, else $LOGLEVEL, else info", .choices = kLogLevels},
  {.dash = "containment", .scope = S::forwarded, .env_form = true, .metavar = "MODE",
   .help = "How ddprun keeps every process a worker starts (daemons, double forks) inside the job and ends "
           "them with it, also when ddprun is killed with SIGKILL: cgroup2 (cgroup.kill), cgroup1 (freezer), "
           "proc (a job token in each process's environment), off. auto takes the first that works.",
   .default_text = "auto", .choices = kContainmentModes},
  {.dash = "rank-memory", .scope = S::forwarded, .env_form = true, .metavar = "on|off",
   .help = "Give each rank a memory cgroup of its own (the v1 memory hierarchy, or cgroup v2 where the memory "
           "controller can be delegated), so an OOM kill is pinned on the rank for certain and its peak covers "
           "all its processes. Costs about 0.1 ms per worker at launch; off, OOM kills are read from the "
           "enclosing cgroup and the peak is the worker process's.",
   .default_text = "off", .choices = kOnOff},
  {.dash = "hang-timeout", .scope = S::forwarded, .env_form = true, .metavar = "SECONDS",
   .help = "Declare the job hung when no rank wrote anything and no rank's process tree used CPU for this "
           "long: collect stacks, print the diagnosis and restart or fail as --max-restarts allows. 0 = off.",
   .default_text = "0 (off)"},
  {.dash = "stacks", .scope = S::forwarded, .env_form = true, .metavar = "on|off",
   .help = "When a job fails or hangs, collect the stacks of the ranks still running (Python: faulthandler, "
           "registered at startup; others: eu-stack) before stopping them.",
   .default_text = "on", .choices = kOnOff},
  {.dash = "version", .kind = K::boolean, .scope = S::process, .help = "Print the version and exit."},
  {.dash = "print-completion", .scope = S::process, .metavar = "SHELL",
   .help = "Print the shell completion script for ddprun and exit: ddprun --print-completion bash "
           "> ~/.local/share/bash-completion/completions/ddprun (tcsh: not supported yet).",
   .choices = kShells},
};
// clang-format on
#pragma GCC diagnostic pop

}  // namespace

std::span<const FlagSpec> launcher_flags() { return kFlags; }

const FlagSpec* find_launcher_flag(std::string_view name) {
  const auto* it = std::find_if(std::begin(kFlags), std::end(kFlags), [&](const FlagSpec& f) {
    return f.dash == name || underscore_spelling(f.dash) == name;
  });
  return it == std::end(kFlags) ? nullptr : it;
}

std::vector<std::string_view> launcher_flags_in(FlagScope scope) {
  std::vector<std::string_view> out;
  for (const auto& f : kFlags) {
    if (f.scope == scope) out.push_back(f.dash);
  }
  return out;
}

}  // namespace ddprun::launcher
