// CPU/NUMA binding (docs/gpus.md): cpulist parsing, a fake sysfs tree in a temp dir, and the
// node/socket/exclusive/core-complex plans.
#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "ddprun/common/error.hpp"
#include "ddprun/worker_env/numa.hpp"

using namespace ddprun::worker_env;
namespace fs = std::filesystem;

namespace {

void write(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p) << text << "\n";
}

// 2 packages x 1 node each; 4 cores per node, 2 threads per core (siblings c and c+8);
// two L3 groups per node (cores 0-1 and 2-3). GPU 0000:1a:00.0 on node 0, 0000:3a:00.0 on node 1,
// 0000:5a:00.0 reports -1.
struct FakeSysfs {
  fs::path root;
  FakeSysfs() {
    char tmpl[] = "/tmp/ddprun-sysfs-XXXXXX";
    REQUIRE(mkdtemp(tmpl) != nullptr);
    root = tmpl;
    write(root / "devices/system/cpu/online", "0-15");
    write(root / "devices/system/node/node0/cpulist", "0-3,8-11");
    write(root / "devices/system/node/node1/cpulist", "4-7,12-15");
    write(root / "devices/system/node/possible", "0-1");  // not a node directory: ignored
    for (int c = 0; c < 16; ++c) {
      const int phys = c % 8;  // threads c and c+8 share a core
      const fs::path base = root / ("devices/system/cpu/cpu" + std::to_string(c));
      write(base / "topology/physical_package_id", std::to_string(phys / 4));
      write(base / "topology/core_id", std::to_string(phys % 4));
      const int l3 = (phys / 2) * 2;  // pairs of cores
      write(base / "cache/index3/shared_cpu_list", std::to_string(l3) + "-" + std::to_string(l3 + 1) + "," +
                                                       std::to_string(l3 + 8) + "-" + std::to_string(l3 + 9));
    }
    write(root / "bus/pci/devices/0000:1a:00.0/numa_node", "0");
    write(root / "bus/pci/devices/0000:3a:00.0/numa_node", "1");
    write(root / "bus/pci/devices/0000:5a:00.0/numa_node", "-1");
  }
  ~FakeSysfs() { fs::remove_all(root); }
};

}  // namespace

TEST_CASE("cpulist parsing and formatting", "[numa]") {
  CHECK(parse_cpu_list("0-3,8,10-11", "x") == std::vector<int>{0, 1, 2, 3, 8, 10, 11});
  CHECK(parse_cpu_list(" 5 ", "x") == std::vector<int>{5});
  CHECK(parse_cpu_list("", "x").empty());
  CHECK_THROWS_WITH(parse_cpu_list("0-3,a", "/sys/x/cpulist"), Catch::Contains("/sys/x/cpulist: 'a'"));
  CHECK_THROWS_AS(parse_cpu_list("3-1", "x"), ddprun::Error);
  CHECK(format_cpu_list({11, 0, 1, 2, 3, 8, 10}) == "0-3,8,10-11");
  CHECK(format_cpu_list({}).empty());
}

TEST_CASE("binding plans from a fake sysfs tree", "[numa]") {
  FakeSysfs sys;
  const auto topo = read_cpu_topology(sys.root.string());
  REQUIRE(topo.cpus.size() == 16);
  CHECK(topo.cpus[9].node == 0);
  CHECK(topo.cpus[9].core == 1);
  CHECK(topo.cpus[12].node == 1);
  CHECK(topo.cpus[12].package == 1);
  CHECK(topo.cpus[10].l3 == 2);
  CHECK(read_pci_numa_node(sys.root.string(), "0000:3a:00.0") == 1);
  CHECK(read_pci_numa_node(sys.root.string(), "0000:5a:00.0") == 0);  // -1 -> 0
  CHECK(read_pci_numa_node(sys.root.string(), "0000:ff:00.0") == 0);  // missing -> 0

  // Two GPUs per node: ranks 0,1 on node 0, ranks 2,3 on node 1.
  const std::vector<int> nodes{0, 0, 1, 1};
  auto plan = plan_cpu_binding(NumaBinding::node, topo, nodes, {});
  CHECK(format_cpu_list(plan[1]) == "0-3,8-11");
  CHECK(format_cpu_list(plan[2]) == "4-7,12-15");
  plan = plan_cpu_binding(NumaBinding::socket, topo, nodes, {});
  CHECK(format_cpu_list(plan[0]) == "0-3,8-11");
  plan = plan_cpu_binding(NumaBinding::exclusive, topo, nodes, {});
  CHECK(format_cpu_list(plan[0]) == "0-1,8-9");
  CHECK(format_cpu_list(plan[1]) == "2-3,10-11");
  CHECK(format_cpu_list(plan[3]) == "6-7,14-15");
  plan = plan_cpu_binding(NumaBinding::core_complex, topo, nodes, {});
  CHECK(format_cpu_list(plan[0]) == "0-1,8-9");
  CHECK(format_cpu_list(plan[1]) == "2-3,10-11");

  // Three ranks on node 0: 4 cores split 2/1/1, the lowest rank takes the remainder.
  plan = plan_cpu_binding(NumaBinding::exclusive, topo, {0, 0, 0}, {});
  CHECK(format_cpu_list(plan[0]) == "0-1,8-9");
  CHECK(format_cpu_list(plan[1]) == "2,10");
  CHECK(format_cpu_list(plan[2]) == "3,11");
  // The launcher's own affinity restricts everything.
  plan = plan_cpu_binding(NumaBinding::node, topo, {0}, {0, 1, 2, 12});
  CHECK(format_cpu_list(plan[0]) == "0-2");
  // More ranks than cores in exclusive mode: a clear error.
  CHECK_THROWS_WITH(plan_cpu_binding(NumaBinding::exclusive, topo, std::vector<int>(5, 0), {}),
                    Catch::Contains("local rank 4 (NUMA node 0) gets no CPU"));
  CHECK_THROWS_WITH(parse_numa_binding("fast", "--numa-binding"), Catch::Contains("--numa-binding='fast'"));
  CHECK(parse_numa_binding("core-complex", "--numa-binding") == NumaBinding::core_complex);
}

TEST_CASE("plan_numa_binding places ranks near their GPU, else spreads them", "[numa]") {
  FakeSysfs sys;
  const std::string root = sys.root.string();
  // GPUs on node 1, node 0, and one reporting -1 (node 0).
  auto plan = plan_numa_binding(NumaBinding::node, root, 3, {"0000:3a:00.0", "0000:1a:00.0", "0000:5a:00.0"}, {});
  REQUIRE(plan.per_rank.size() == 3);
  CHECK(plan.rank_nodes == std::vector<int>{1, 0, 0});
  CHECK(format_cpu_list(plan.per_rank[0]) == "4-7,12-15");
  CHECK(format_cpu_list(plan.per_rank[1]) == "0-3,8-11");
  CHECK_THAT(plan.note, Catch::Contains("near its GPU"));
  // Fewer devices than ranks (--gpu-sharing): rank r uses device r % n.
  plan = plan_numa_binding(NumaBinding::exclusive, root, 4, {"0000:1a:00.0", "0000:3a:00.0"}, {});
  CHECK(plan.rank_nodes == std::vector<int>{0, 1, 0, 1});
  CHECK(format_cpu_list(plan.per_rank[0]) == "0-1,8-9");
  CHECK(format_cpu_list(plan.per_rank[2]) == "2-3,10-11");
  CHECK(format_cpu_list(plan.per_rank[3]) == "6-7,14-15");
  // No GPU: round robin over the nodes that have allowed CPUs.
  plan = plan_numa_binding(NumaBinding::node, root, 3, {}, {});
  CHECK(plan.rank_nodes == std::vector<int>{0, 1, 0});
  CHECK_THAT(plan.note, Catch::Contains("round robin over NUMA node(s) 0-1"));
  // An unknown bus id for any rank also falls back; the affinity decides which nodes count.
  plan = plan_numa_binding(NumaBinding::socket, root, 2, {"0000:3a:00.0", ""}, {5, 6});
  CHECK(plan.rank_nodes == std::vector<int>{1, 1});
  CHECK(format_cpu_list(plan.per_rank[1]) == "5-6");
  CHECK_THROWS_WITH(plan_numa_binding(NumaBinding::node, root, 1, {}, {200}), Catch::Contains("affinity"));
  CHECK_THROWS_WITH(plan_numa_binding(NumaBinding::node, (sys.root / "missing").string(), 1, {}, {}),
                    Catch::Contains("cannot list CPUs"));
}

TEST_CASE("current_cpu_affinity matches /proc/self/status", "[numa]") {
  std::ifstream status("/proc/self/status");
  std::string line;
  std::string listed;
  while (std::getline(status, line)) {
    if (line.rfind("Cpus_allowed_list:", 0) == 0) listed = line.substr(line.find(':') + 1);
  }
  REQUIRE_FALSE(listed.empty());
  CHECK(current_cpu_affinity() == parse_cpu_list(listed, "Cpus_allowed_list"));
}

TEST_CASE("the real sysfs is readable", "[numa]") {
  if (!fs::exists("/sys/devices/system/cpu/online")) {
    WARN("SKIPPED: no /sys/devices/system/cpu/online");
    return;
  }
  const auto topo = read_cpu_topology();
  CHECK_FALSE(topo.cpus.empty());
}
