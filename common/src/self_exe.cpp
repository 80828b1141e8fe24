#include "ddprun/common/self_exe.hpp"

#include <unistd.h>

namespace ddprun {

std::string beside_this_binary(std::string_view name) {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return {};
  std::string path(buf, static_cast<std::size_t>(n));
  const auto slash = path.rfind('/');
  if (slash == std::string::npos) return {};
  path.resize(slash + 1);
  path += name;
  return path;
}

}  // namespace ddprun
