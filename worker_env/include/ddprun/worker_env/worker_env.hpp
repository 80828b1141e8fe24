#pragma once
// The worker environment contract (docs/worker-env.md): what every worker process gets on top
// of the agent's own environment. Pure: builds name/value pairs from a placement, no I/O (but
// current_environment and ctype_locale_available, which read the process and the machine).
//
// torchrun-compatible names (RANK, LOCAL_RANK, WORLD_SIZE, …, TORCHELASTIC_*), plus ddprun's
// own (DDPRUN_*) and cheap aliases other frameworks read (LOCAL_SIZE, CROSS_RANK, CROSS_SIZE).
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ddprun::worker_env {

// This node's place in the job for one round (attempt): the agent converts the rendezvous'
// assignment (or, on a single node, its own settings) into it.
struct Placement {
  std::string role = "default";
  int local_world_size = 1;  // workers on this node (--nproc-per-node)
  int group_rank = 0;        // this node's rank among nodes
  int group_world_size = 1;  // number of nodes
  int rank_offset = 0;       // global rank of this node's local rank 0
  int world_size = 1;        // total workers
  std::string master_addr = "127.0.0.1";
  std::uint16_t master_port = 29500;
  int restart_count = 0;
  int max_restarts = 0;
  std::string run_id = "none";
  bool use_agent_store = true;  // TORCHELASTIC_USE_AGENT_STORE
};

struct EnvOptions {
  bool python_worker = false;  // adds PYTHONUNBUFFERED=1
  // Directory for per-worker error files: <dir>/<local_rank>/error.json (TORCHELASTIC_ERROR_FILE).
  std::optional<std::string> error_file_dir;
  // Instead <dir>.<local_rank>.error.json: no directory per rank (the agent's flat layout).
  bool flat_error_file = false;
  // TORCHELASTIC_ERROR_FILE set but empty, whatever error_file_dir says: torch 2.6's agent with
  // --log-dir /dev/null (torch's error handler then only logs the error).
  bool no_error_file = false;
  bool virtual_local_rank = false;  // LOCAL_RANK=0 and CUDA_VISIBLE_DEVICES=<its one device>
};

using EnvList = std::vector<std::pair<std::string, std::string>>;  // ordered, name -> value
using EnvMap = std::map<std::string, std::string>;

// The variables worker `local_rank` gets on top of `parent` (the agent's environment).
// Variables whose torchrun semantics are "only when unset" (OMP_NUM_THREADS,
// *NCCL_ASYNC_ERROR_HANDLING) consult `parent`.
EnvList build_worker_env(const Placement& a, int local_rank, const EnvOptions& opts, const EnvMap& parent);

// `parent` with `additions` applied (additions win), as a KEY=VALUE list for execve.
std::vector<std::string> merge_env(const EnvMap& parent, const EnvList& additions);

// The current process environment as a map.
EnvMap current_environment();

// torchrun is a Python program, and Python coerces a "C" LC_CTYPE locale to a UTF-8 one in its
// own environment at start (PEP 538), which every worker of torchrun inherits: when LC_ALL is
// unset or empty, the LC_CTYPE locale (LC_CTYPE, else LANG, else none) is "C" or "POSIX", and
// PYTHONCOERCECLOCALE is not "0", the value Python sets LC_CTYPE to in `env`: the first of
// "C.UTF-8", "C.utf8", "UTF-8" that `available` accepts. nullopt otherwise. (Python also coerces
// when LANG names a locale that is not installed; that case is not detected here.)
std::optional<std::string> python_coerced_lc_ctype(const EnvMap& env,
                                                   const std::function<bool(const std::string&)>& available);

// Whether this machine has the LC_CTYPE locale `name` (newlocale; the process locale stays).
bool ctype_locale_available(const std::string& name);

}  // namespace ddprun::worker_env
