#include "ddprun/common/self_exe.hpp"

#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>

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

bool trusted_path(const std::string& path) {
  char buf[PATH_MAX];
  if (::realpath(path.c_str(), buf) == nullptr) return false;
  std::string p(buf);
  const uid_t me = ::geteuid();
  for (bool first = true;; first = false) {
    struct stat st {};
    if (::stat(p.c_str(), &st) != 0) return false;
    if (st.st_uid != 0 && st.st_uid != me) return false;
    // Writable by others: only a sticky directory (/tmp), where what others create is theirs
    // and fails the owner check one level down; never the file itself.
    if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0 && (first || !S_ISDIR(st.st_mode) || (st.st_mode & S_ISVTX) == 0)) {
      return false;
    }
    if (p == "/") return true;
    const auto slash = p.rfind('/');
    p.resize(slash == 0 ? 1 : slash);
  }
}

std::string installed_helper(std::string_view name) {
  std::string beside = beside_this_binary(name);
  if (beside.empty() || ::access(beside.c_str(), X_OK) == 0) return beside;
  // Outside its own directory, ddprun runs only what nobody else could have put there: a copy of
  // ddprun in /tmp/x must not run /tmp/libexec/ddprun/<name> of another user's making.
  const auto slash = beside.rfind('/');
  std::string installed = beside.substr(0, slash + 1) + DDPRUN_LIBEXEC_FROM_BIN "/" + std::string(name);
  return ::access(installed.c_str(), X_OK) == 0 && trusted_path(installed) ? installed : beside;
}

}  // namespace ddprun
