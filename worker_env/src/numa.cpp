// CPU/NUMA binding plans from sysfs (docs/gpus.md, "CPU binding").
#include "ddprun/worker_env/numa.hpp"

#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>

#include "ddprun/common/error.hpp"
#include "ddprun/common/strings.hpp"

namespace ddprun::worker_env {

namespace {

std::optional<std::string> read_text(const std::filesystem::path& p) {
  std::ifstream in(p);
  if (!in) return std::nullopt;
  std::string s;
  std::getline(in, s);
  return std::string(trim(s));
}

std::optional<int> read_int(const std::filesystem::path& p) {
  const auto t = read_text(p);
  if (!t) return std::nullopt;
  const auto v = parse_int(*t);
  if (!v) return std::nullopt;
  return static_cast<int>(*v);
}

}  // namespace

std::vector<int> parse_cpu_list(std::string_view text, std::string_view what) {
  std::set<int> out;
  const std::string_view t = trim(text);
  if (t.empty()) return {};
  auto bad = [&](const std::string& part) {
    return Error(std::string(what) + ": '" + part + "' is not a CPU id or range", "expected e.g. 0-3,8,10-11");
  };
  for (const auto& raw : split(t, ',')) {
    const std::string part(trim(raw));
    const auto dash = part.find('-');
    const auto first = parse_int(part.substr(0, dash));
    const auto last = dash == std::string::npos ? first : parse_int(part.substr(dash + 1));
    if (!first || !last || *first < 0 || *last < *first || *last > 1'000'000) throw bad(part);
    for (auto c = *first; c <= *last; ++c) out.insert(static_cast<int>(c));
  }
  return {out.begin(), out.end()};
}

std::string format_cpu_list(const std::vector<int>& cpus) {
  std::vector<int> c = cpus;
  std::sort(c.begin(), c.end());
  c.erase(std::unique(c.begin(), c.end()), c.end());
  std::string s;
  for (std::size_t i = 0; i < c.size();) {
    std::size_t j = i;
    while (j + 1 < c.size() && c[j + 1] == c[j] + 1) ++j;
    if (!s.empty()) s += ',';
    s += std::to_string(c[i]);
    if (j > i) s += "-" + std::to_string(c[j]);
    i = j + 1;
  }
  return s;
}

CpuTopology read_cpu_topology(const std::string& sysfs_root) {
  namespace fs = std::filesystem;
  const fs::path cpu_dir = fs::path(sysfs_root) / "devices/system/cpu";
  const fs::path node_dir = fs::path(sysfs_root) / "devices/system/node";
  std::vector<int> online;
  if (const auto t = read_text(cpu_dir / "online")) online = parse_cpu_list(*t, (cpu_dir / "online").string());
  if (online.empty()) throw Error("cannot list CPUs: " + (cpu_dir / "online").string() + " is missing or empty");
  std::map<int, int> node_of;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(node_dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("node", 0) != 0) continue;
    const auto n = parse_int(name.substr(4));
    if (!n) continue;
    if (const auto t = read_text(entry.path() / "cpulist")) {
      for (int c : parse_cpu_list(*t, (entry.path() / "cpulist").string())) node_of[c] = static_cast<int>(*n);
    }
  }
  CpuTopology topo;
  for (int c : online) {
    CpuInfo info;
    info.id = c;
    const fs::path base = cpu_dir / ("cpu" + std::to_string(c));
    info.node = node_of.count(c) != 0 ? node_of[c] : 0;
    info.package = read_int(base / "topology/physical_package_id").value_or(0);
    info.core = read_int(base / "topology/core_id").value_or(c);
    if (const auto t = read_text(base / "cache/index3/shared_cpu_list")) {
      const auto shared = parse_cpu_list(*t, (base / "cache/index3/shared_cpu_list").string());
      if (!shared.empty()) info.l3 = shared.front();
    }
    topo.cpus.push_back(info);
  }
  return topo;
}

int read_pci_numa_node(const std::string& sysfs_root, const std::string& pci_bus_id) {
  const auto n = read_int(std::filesystem::path(sysfs_root) / "bus/pci/devices" / pci_bus_id / "numa_node");
  return n && *n >= 0 ? *n : 0;
}

NumaBinding parse_numa_binding(std::string_view text, std::string_view what) {
  const std::string t = to_lower(trim(text));
  if (t == "node") return NumaBinding::node;
  if (t == "socket") return NumaBinding::socket;
  if (t == "exclusive") return NumaBinding::exclusive;
  if (t == "core-complex" || t == "core_complex") return NumaBinding::core_complex;
  throw UsageError(std::string(what) + "='" + std::string(text) + "' is not a binding mode",
                   "use node, socket, exclusive or core-complex");
}

std::vector<std::vector<int>> plan_cpu_binding(NumaBinding mode, const CpuTopology& topology,
                                               const std::vector<int>& rank_nodes, const std::vector<int>& allowed) {
  const std::set<int> allow(allowed.begin(), allowed.end());
  std::vector<CpuInfo> cpus;
  for (const auto& c : topology.cpus) {
    if (allow.empty() || allow.count(c.id) != 0) cpus.push_back(c);
  }
  std::vector<std::vector<int>> out(rank_nodes.size());
  // Ranks sharing a node, in rank order: their position decides their share.
  std::map<int, std::vector<std::size_t>> ranks_on_node;
  for (std::size_t r = 0; r < rank_nodes.size(); ++r) ranks_on_node[rank_nodes[r]].push_back(r);

  for (const auto& [node, ranks] : ranks_on_node) {
    std::vector<CpuInfo> mine;
    for (const auto& c : cpus) {
      if (c.node == node) mine.push_back(c);
    }
    if (mode == NumaBinding::node) {
      for (auto r : ranks) {
        for (const auto& c : mine) out[r].push_back(c.id);
      }
    } else if (mode == NumaBinding::socket) {
      std::set<int> packages;
      for (const auto& c : mine) packages.insert(c.package);
      for (auto r : ranks) {
        for (const auto& c : cpus) {
          if (packages.count(c.package) != 0) out[r].push_back(c.id);
        }
      }
    } else if (mode == NumaBinding::exclusive) {
      // Physical cores (package, core) in order of their first CPU id.
      std::map<std::pair<int, int>, std::vector<int>> by_core;
      std::vector<std::pair<int, int>> order;
      for (const auto& c : mine) {
        const auto key = std::make_pair(c.package, c.core);
        if (by_core.count(key) == 0) order.push_back(key);
        by_core[key].push_back(c.id);
      }
      const std::size_t per = order.size() / ranks.size();
      const std::size_t extra = order.size() % ranks.size();
      std::size_t next = 0;
      for (std::size_t k = 0; k < ranks.size(); ++k) {
        const std::size_t take = per + (k < extra ? 1 : 0);
        for (std::size_t i = 0; i < take; ++i, ++next) {
          for (int id : by_core[order[next]]) out[ranks[k]].push_back(id);
        }
      }
    } else {
      std::map<int, std::vector<int>> by_l3;
      for (const auto& c : mine) by_l3[c.l3 >= 0 ? c.l3 : c.id].push_back(c.id);
      std::vector<std::vector<int>> groups;
      for (auto& [l3, ids] : by_l3) groups.push_back(ids);
      for (std::size_t k = 0; k < ranks.size() && !groups.empty(); ++k) out[ranks[k]] = groups[k % groups.size()];
    }
    for (auto r : ranks) {
      std::sort(out[r].begin(), out[r].end());
      if (out[r].empty()) {
        throw Error("CPU binding: local rank " + std::to_string(r) + " (NUMA node " + std::to_string(node) +
                        ") gets no CPU: " + std::to_string(ranks.size()) + " rank(s) share " +
                        std::to_string(mine.size()) + " allowed CPU(s) of that node",
                    "use --numa-binding node or fewer workers per node");
      }
    }
  }
  return out;
}

std::vector<int> current_cpu_affinity() {
  // CPU_ALLOC sizes the mask for machines with more than CPU_SETSIZE (1024) CPUs.
  for (int count = 1024; count <= (1 << 20); count *= 4) {
    cpu_set_t* set = CPU_ALLOC(static_cast<std::size_t>(count));
    if (set == nullptr) return {};
    const std::size_t size = CPU_ALLOC_SIZE(static_cast<std::size_t>(count));
    CPU_ZERO_S(size, set);
    if (::sched_getaffinity(0, size, set) == 0) {
      std::vector<int> out;
      for (int c = 0; c < count; ++c) {
        if (CPU_ISSET_S(static_cast<std::size_t>(c), size, set)) out.push_back(c);
      }
      CPU_FREE(set);
      return out;
    }
    CPU_FREE(set);
    if (errno != EINVAL) return {};
  }
  return {};
}

NumaBindingPlan plan_numa_binding(NumaBinding mode, const std::string& sysfs_root, int nproc,
                                  const std::vector<std::string>& rank_bus_ids, const std::vector<int>& allowed) {
  const CpuTopology topology = read_cpu_topology(sysfs_root);
  NumaBindingPlan plan;
  const auto count = static_cast<std::size_t>(std::max(nproc, 0));
  const bool by_gpu = !rank_bus_ids.empty() && std::none_of(rank_bus_ids.begin(), rank_bus_ids.end(),
                                                            [](const std::string& b) { return b.empty(); });
  if (by_gpu) {
    for (std::size_t r = 0; r < count; ++r) {
      plan.rank_nodes.push_back(read_pci_numa_node(sysfs_root, rank_bus_ids[r % rank_bus_ids.size()]));
    }
    plan.note = "each worker is bound near its GPU (" + sysfs_root + "/bus/pci/devices/<bus id>/numa_node)";
  } else {
    // No GPU to follow: spread the ranks over the nodes the launcher may run on.
    const std::set<int> allow(allowed.begin(), allowed.end());
    std::set<int> nodes;
    for (const auto& c : topology.cpus) {
      if (allow.empty() || allow.count(c.id) != 0) nodes.insert(c.node);
    }
    if (nodes.empty()) {
      throw Error(
          "CPU binding: none of the CPUs in " + sysfs_root + "/devices/system/cpu/online is in this process's affinity",
          "run ddprun without --numa-binding, or with a wider affinity (taskset)");
    }
    const std::vector<int> order(nodes.begin(), nodes.end());
    for (std::size_t r = 0; r < count; ++r) plan.rank_nodes.push_back(order[r % order.size()]);
    plan.note = "no GPU bus id known: local ranks are spread round robin over NUMA node(s) " + format_cpu_list(order);
  }
  plan.per_rank = plan_cpu_binding(mode, topology, plan.rank_nodes, allowed);
  return plan;
}

}  // namespace ddprun::worker_env
