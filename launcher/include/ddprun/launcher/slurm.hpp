#pragma once
// Slurm integration: hostlist expansion and the settings a job step's environment implies.
// Pure functions (the environment is passed in); thread safe. Errors are ddprun::UsageError
// naming the variable / text and position.
//
// Hostlist syntax (as scontrol show hostnames expands it):
//   name                      a plain host
//   a,b                       commas between names separate hosts
//   pre[01-04,07]suf          a bracket group: comma list of N or LO-HI ranges; the width of LO
//                             is kept as zero padding ("01-10" -> 01..10, "8-10" -> 8,9,10)
//   rack[1-2]-n[01-02]        several groups: the cartesian product, leftmost group varying
//                             slowest (rack1-n01, rack1-n02, rack2-n01, rack2-n02)
// No escapes; whitespace around names is ignored. At most kMaxHostlistHosts names, each at most
// kMaxHostlistNameBytes long, kMaxHostlistBytes in all (a short list of long names with two
// bracket groups would otherwise expand to gigabytes).
#include <cstddef>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ddprun::launcher {

inline constexpr std::size_t kMaxHostlistHosts = 1'000'000;
inline constexpr std::size_t kMaxHostlistNameBytes = 255;  // a DNS name's limit (253) and then some
inline constexpr std::size_t kMaxHostlistBytes = std::size_t{64} << 20;

// The bounds of an expansion; the defaults are what ddprun uses (a fuzzer passes smaller ones).
struct HostlistLimits {
  std::size_t max_hosts = kMaxHostlistHosts;
  std::size_t max_bytes = kMaxHostlistBytes;
};

// `what` names the source in messages (e.g. "SLURM_JOB_NODELIST").
std::vector<std::string> expand_hostlist(std::string_view text, std::string_view what = "hostlist",
                                         const HostlistLimits& limits = {});

struct SlurmSettings {
  int nnodes = 0;          // nodes of this step: --nnodes N:N
  int node_id = 0;         // SLURM_NODEID: 0 hosts the rendezvous (is_host)
  std::string first_host;  // rendezvous endpoint host (first node of the node list)
  std::string run_id;      // "slurm-<JOB_ID>[.<STEP_ID>]"
  bool operator==(const SlurmSettings&) const = default;
};

// True when `env` is a task of an srun step: srun sets SLURM_STEP_ID, SLURM_STEP_NODELIST and
// SLURM_STEP_NUM_NODES; a batch script (sbatch, on the first node only) and an salloc shell have
// none of them (a batch script does have SLURM_NODEID=0).
bool slurm_step(const std::map<std::string, std::string>& env);

// nullopt unless SLURM_JOB_ID, a step (slurm_step), a node count (SLURM_STEP_NUM_NODES, else
// SLURM_NNODES, else SLURM_JOB_NUM_NODES) and SLURM_NODEID are set: only then is this a task of
// an srun step ddprun can use (an salloc or sbatch shell runs a plain job).
// Node list: SLURM_STEP_NODELIST (inside srun: the step's nodes), else SLURM_JOB_NODELIST, else
// SLURM_NODELIST. Errors: a count or id that is not a number, SLURM_NODEID outside
// 0..nnodes-1, no node list, a node list whose size differs from the node count.
std::optional<SlurmSettings> slurm_from_env(const std::map<std::string, std::string>& env,
                                            const HostlistLimits& limits = {});

}  // namespace ddprun::launcher
