#include "ddprun/common/self_exe.hpp"

#include <unistd.h>

#ifndef DDPRUN_LIBEXEC_FROM_BIN
#define DDPRUN_LIBEXEC_FROM_BIN "../libexec/ddprun"
#endif

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

std::string installed_helper(std::string_view name) {
  std::string beside = beside_this_binary(name);
  if (beside.empty() || ::access(beside.c_str(), X_OK) == 0) return beside;
  const auto slash = beside.rfind('/');
  std::string installed = beside.substr(0, slash + 1) + DDPRUN_LIBEXEC_FROM_BIN "/" + std::string(name);
  return ::access(installed.c_str(), X_OK) == 0 ? installed : beside;
}

}  // namespace ddprun
