#pragma once
// worker_spec(): everything one worker process is started with (argv, environment additions,
// working directory, CPU binding, output routes, console prefix, error file), as a pure value.
// The spawner (worker_run.cpp) starts exactly this; --dry-run (dry_run.cpp) prints exactly this.
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ddprun/agent/config.hpp"
#include "ddprun/agent/output.hpp"
#include "ddprun/worker_env/worker_env.hpp"

namespace ddprun::agent {

// What an attempt adds to every worker's spec.
struct AttemptContext {
  std::string dir;               // error files go to <dir>/<local_rank>/error.json
  worker_env::EnvList nccl_env;  // the round's NCCL variables (nccl_ids.hpp)
  bool flat = false;             // or to <dir>.<local_rank>.error.json (job_dir.hpp's flat layout)
};

struct WorkerSpec {
  int local_rank = 0;
  int rank = 0;                   // global rank
  std::vector<std::string> argv;  // argv[0] as given; the spawner resolves the executable
  // The variables on top of the agent's environment: build_worker_env's, then the GPU plan's,
  // then the round's NCCL variables, each later source winning; one entry per name, sorted.
  worker_env::EnvList env;
  std::string cwd;         // "" = the agent's working directory
  std::vector<int> cpus;   // --numa-binding; empty = unbound
  std::string device;      // the GPU plan's device column ("" = none)
  std::string error_file;  // TORCHELASTIC_ERROR_FILE ("" = none)
  RankRoutes routes;
  std::string prefix;  // the console prefix of its lines
};

// Worker argv with `${local_rank}` replaced in every argument after the program that names it
// (as torchrun does), and the legacy --local-rank / --local_rank argument when asked for.
// Arguments without the placeholder are passed as they are: torchrun would also turn their `$$`
// into `$`, which breaks `sh -c '... $$ ...'` and is not copied.
std::vector<std::string> worker_args(const AgentConfig& config, int local_rank);

// `arg` with `$local_rank` and `${local_rank}` replaced by `local_rank` and `$$` by `$`; any other
// `$` is kept as it is: Python's string.Template(arg).safe_substitute(local_rank=N), which
// torchrun applies to each worker's arguments. `*named` (when given) says whether a placeholder
// was replaced.
std::string substitute_local_rank(std::string_view arg, int local_rank, bool* named = nullptr);

// The placement a single-node job (and --dry-run) uses: this node is the whole job.
worker_env::Placement local_placement(const AgentConfig& config);

// The spec of local rank `local_rank` (0 <= local_rank < placement.local_world_size).
// `parent` is the agent's environment (some variables are set only when it lacks them).
WorkerSpec worker_spec(const AgentConfig& config, const worker_env::Placement& placement, int local_rank,
                       const AttemptContext& attempt, const worker_env::EnvMap& parent);

}  // namespace ddprun::agent
