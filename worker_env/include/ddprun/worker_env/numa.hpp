#pragma once
// Best-effort CPU/NUMA binding for GPU workers (docs/gpus.md, "CPU binding"), modelled on
// torchrun's --numa-binding: node | socket | exclusive | core-complex.
//
// read_cpu_topology()/read_pci_numa_node() read sysfs under a root directory (tests pass a fake
// tree); plan_cpu_binding() is pure; plan_numa_binding() combines them for a node's workers. The
// launcher computes the plan (AgentConfig::cpu_binding) and the agent applies it with
// sched_setaffinity in each worker's child process before exec (agent/process.hpp).
// Thread safety: all functions are reentrant.
#include <string>
#include <string_view>
#include <vector>

namespace ddprun::worker_env {

// Linux cpulist format "0-3,8,10-11" -> sorted unique ids; Error naming `what` when malformed.
std::vector<int> parse_cpu_list(std::string_view text, std::string_view what);
// Sorted ids -> "0-3,8,10-11".
std::string format_cpu_list(const std::vector<int>& cpus);

struct CpuInfo {
  int id = 0;
  int node = 0;     // NUMA node (0 when the machine has no node directories)
  int package = 0;  // physical_package_id (socket)
  int core = 0;     // core_id within the package
  int l3 = -1;      // lowest CPU id sharing this CPU's L3 (cache/index3), -1 when unknown
};

struct CpuTopology {
  std::vector<CpuInfo> cpus;  // online CPUs, by id
};

// Reads <sysfs_root>/devices/system/{cpu,node}. Missing files degrade gracefully (one node,
// package 0, core = cpu id, unknown L3). Throws ddprun::Error when no CPU can be listed.
CpuTopology read_cpu_topology(const std::string& sysfs_root = "/sys");

// <sysfs_root>/bus/pci/devices/<bus id>/numa_node; -1 or unreadable -> 0 (as torchrun does).
int read_pci_numa_node(const std::string& sysfs_root, const std::string& pci_bus_id);

enum class NumaBinding { node, socket, exclusive, core_complex };
NumaBinding parse_numa_binding(std::string_view text, std::string_view what);

// CPU set per local rank. `rank_nodes[i]`: the NUMA node of rank i's GPU. `allowed`: the
// launcher's own affinity (sched_getaffinity); empty = no restriction. node: every CPU of the
// node; socket: every CPU of the packages the node's CPUs are on; exclusive: the node's physical
// cores split evenly (contiguously) among the ranks on that node, lower ranks getting the
// remainder, each core with all its hardware threads; core-complex: the k-th rank on a node gets
// the node's k-th L3 group (round robin when there are more ranks). Throws ddprun::Error when a
// rank would get no CPU (e.g. more ranks than cores on a node in exclusive mode).
std::vector<std::vector<int>> plan_cpu_binding(NumaBinding mode, const CpuTopology& topology,
                                               const std::vector<int>& rank_nodes, const std::vector<int>& allowed);

// The calling thread's CPU affinity (sched_getaffinity), sorted; empty when it cannot be read.
std::vector<int> current_cpu_affinity();

struct NumaBindingPlan {
  std::vector<std::vector<int>> per_rank;  // CPU ids per local rank (sorted, never empty)
  std::vector<int> rank_nodes;             // the NUMA node each local rank was placed on
  std::string note;                        // one line for the log: how the nodes were chosen
};

// The --numa-binding plan for `nproc` local ranks. `rank_bus_ids[i]`: the PCI bus id of local
// rank i's GPU ("0000:3b:00.0"); rank i is placed on that device's NUMA node. When the vector is
// empty or any entry is "" (no GPU, or a device without a known bus id), the ranks are spread
// round robin over the NUMA nodes that hold allowed CPUs instead, and `note` says so. `allowed`
// as in plan_cpu_binding. Throws ddprun::Error as plan_cpu_binding and read_cpu_topology do.
NumaBindingPlan plan_numa_binding(NumaBinding mode, const std::string& sysfs_root, int nproc,
                                  const std::vector<std::string>& rank_bus_ids, const std::vector<int>& allowed);

}  // namespace ddprun::worker_env
