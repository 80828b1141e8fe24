// trusted_path: where an installed ddprun may run a helper from outside its own directory.
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <string>

#include "ddprun/common/self_exe.hpp"

namespace fs = std::filesystem;

TEST_CASE("trusted_path: owned by root or us, writable by no one else, a sticky directory above allowed") {
  const fs::path base = fs::temp_directory_path() / ("ddprun-self-exe-test-" + std::to_string(::getpid()));
  fs::remove_all(base);
  fs::create_directories(base / "libexec" / "ddprun");
  ::chmod(base.c_str(), 0755);
  ::chmod((base / "libexec").c_str(), 0755);
  ::chmod((base / "libexec" / "ddprun").c_str(), 0755);
  const std::string helper = (base / "libexec" / "ddprun" / "helper").string();
  { std::ofstream(helper) << "#!/bin/sh\n"; }
  ::chmod(helper.c_str(), 0755);
  if (!ddprun::trusted_path(base.string())) {
    WARN("the temporary directory " << base.parent_path() << " is not a trusted place; nothing to compare");
    fs::remove_all(base);
    return;
  }
  CHECK(ddprun::trusted_path(helper));
  CHECK_FALSE(ddprun::trusted_path((base / "libexec" / "ddprun" / "missing").string()));
  // A directory on the way that others may write to (not sticky): someone could have swapped it.
  ::chmod((base / "libexec").c_str(), 0777);
  CHECK_FALSE(ddprun::trusted_path(helper));
  ::chmod((base / "libexec").c_str(), 01777);  // sticky: what others make in it is theirs
  CHECK(ddprun::trusted_path(helper));
  ::chmod((base / "libexec").c_str(), 0755);
  ::chmod(helper.c_str(), 0775);  // the helper itself writable by its group
  CHECK_FALSE(ddprun::trusted_path(helper));
  ::chmod(helper.c_str(), 0755);
  // A link is judged by where it points.
  const std::string link = (base / "link").string();
  fs::create_symlink(helper, link);
  CHECK(ddprun::trusted_path(link));
  // Owned by another user (as root, in CI: nobody), directly or behind the link.
  if (::geteuid() == 0) {
    REQUIRE(::chown((base / "libexec" / "ddprun").c_str(), 65534, 65534) == 0);
    CHECK_FALSE(ddprun::trusted_path(helper));
    CHECK_FALSE(ddprun::trusted_path(link));
  }
  fs::remove_all(base);
}
