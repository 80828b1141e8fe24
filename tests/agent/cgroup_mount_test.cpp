// Containment finds the cgroup hierarchies with statmount(2) at their usual mount points, and
// reads /proc/self/mountinfo only where that cannot answer: both must name the same mount.
#include <sys/utsname.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "ddprun/agent/containment.hpp"

using ddprun::agent::cgroup_mount_point;
using ddprun::agent::MountLookup;

namespace {

// Kernel release as major * 100 + minor (6.18 -> 618).
int kernel_version() {
  utsname u{};
  if (::uname(&u) != 0) return 0;
  int major = 0;
  int minor = 0;
  if (std::sscanf(u.release, "%d.%d", &major, &minor) != 2) return 0;
  return major * 100 + minor;
}

// The mountinfo lines of the mounts at `dir`, the visible one (mounted last) at the back.
std::vector<std::string> mounted_at(const std::string& dir) {
  std::ifstream in("/proc/self/mountinfo");
  std::vector<std::string> out;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream f(line);
    std::string id, parent, devno, root, point;
    f >> id >> parent >> devno >> root >> point;
    if (point == dir) out.push_back(line);
  }
  return out;
}

// Whether mountinfo lists a mount of `controller`'s hierarchy at `dir` with the hierarchy's root
// as its root (the first such line is what the mountinfo lookup answers; there may be others).
bool hierarchy_mounted_at(const std::string& controller, const std::string& dir) {
  for (const auto& line : mounted_at(dir)) {
    std::istringstream f(line);
    std::string id, parent, devno, root, point, word;
    f >> id >> parent >> devno >> root >> point;
    while (f >> word && word != "-") {
    }
    std::string type, source, opts;
    f >> type >> source >> opts;
    if (root != "/") continue;
    if (controller.empty() ? type == "cgroup2"
                           : type == "cgroup" && ("," + opts + ",").find("," + controller + ",") != std::string::npos) {
      return true;
    }
  }
  return false;
}

}  // namespace

TEST_CASE("cgroup mounts: statmount names a mount mountinfo lists") {
  const int kernel = kernel_version();
  for (const std::string controller : {"", "memory", "freezer", "cpu", "no-such-controller"}) {
    INFO("controller '" << controller << "', kernel " << kernel);
    const auto by_mountinfo = cgroup_mount_point(controller, MountLookup::mountinfo);
    const auto by_statmount = cgroup_mount_point(controller, MountLookup::statmount);
    if (by_statmount) {
      CHECK(by_mountinfo);
      CHECK(hierarchy_mounted_at(controller, *by_statmount));
    }
    // Where the hierarchy is at its usual place and the kernel has statmount (6.8; the options
    // that name a v1 hierarchy's controllers 6.10), the fast way must answer: otherwise every
    // launch would pay for the mountinfo table again.
    const std::string usual = controller.empty() ? "" : "/sys/fs/cgroup/" + controller;
    const bool at_usual_place =
        by_mountinfo &&
        (controller.empty() ? (*by_mountinfo == "/sys/fs/cgroup" || *by_mountinfo == "/sys/fs/cgroup/unified")
                            : *by_mountinfo == usual);
    if (at_usual_place && kernel >= (controller.empty() ? 608 : 610)) {
      CHECK(by_statmount);
    }
  }
  // Something mounted at /sys/fs/cgroup that is not cgroup2 (a hybrid layout's tmpfs) is not
  // taken for it.
  const auto at_root = mounted_at("/sys/fs/cgroup");
  if (!at_root.empty() && at_root.back().find(" - cgroup2 ") == std::string::npos) {
    const auto v2 = cgroup_mount_point("", MountLookup::statmount);
    CHECK((!v2 || *v2 != "/sys/fs/cgroup"));
  }
}
