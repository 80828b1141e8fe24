// The job's log directory; see job_dir.hpp.
#include "ddprun/agent/job_dir.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <vector>

#include <spdlog/spdlog.h>

#include "ddprun/common/error.hpp"

namespace fs = std::filesystem;

namespace ddprun::agent {

namespace {

std::string sanitize(std::string_view s) {
  std::string out;
  for (char c : s) {
    out += (std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '-' || c == '_' || c == '.') ? c : '_';
  }
  return out.empty() ? std::string("none") : out;
}

std::string temp_base() {
  const char* t = std::getenv("TMPDIR");
  return (t != nullptr && *t != '\0') ? std::string(t) : std::string("/tmp");
}

}  // namespace

std::string job_dir_pattern(const AgentConfig& config) {
  return config.log_dir ? config.log_dir->string() + "/" + sanitize(config.run_id) + "_<random>"
                        : temp_base() + "/ddprun-" + sanitize(config.run_id) + "_<random>";
}

// <log_dir>/<run_id>_<random> or $TMPDIR/ddprun-<run_id>_<random>, created fresh.
std::string make_job_dir(const AgentConfig& config) {
  std::string templ;
  if (config.log_dir) {
    std::error_code ec;
    fs::create_directories(*config.log_dir, ec);
    if (ec) {
      throw Error("cannot create --log-dir " + config.log_dir->string() + ": " + ec.message(),
                  "pick a writable directory");
    }
    templ = config.log_dir->string() + "/" + sanitize(config.run_id) + "_XXXXXX";
  } else {
    templ = temp_base() + "/ddprun-" + sanitize(config.run_id) + "_XXXXXX";
  }
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  if (::mkdtemp(buf.data()) == nullptr) {
    throw Error("cannot create the log directory " + templ + ": " + std::strerror(errno),
                config.log_dir ? "pick a writable --log-dir" : "set TMPDIR to a writable directory or pass --log-dir");
  }
  // Absolute: the watchdog, the workers' TORCHELASTIC_ERROR_FILE and the summary name it.
  std::error_code ec;
  const auto abs = fs::absolute(buf.data(), ec);
  return ec ? std::string(buf.data()) : abs.string();
}

bool rank_dirs_needed(const AgentConfig& config, bool any_files, bool may_run_python) {
  return config.log_dir || any_files || may_run_python || !config.duplicate_stdout_filters.empty() ||
         !config.duplicate_stderr_filters.empty();
}

bool ensure_dir(const std::string& job_dir, const std::string& dir) {
  if (dir.size() < job_dir.size() || dir.compare(0, job_dir.size(), job_dir) != 0) {
    errno = EINVAL;
    return false;
  }
  for (std::size_t at = job_dir.size(); at < dir.size();) {
    std::size_t next = dir.find('/', at + 1);
    if (next == std::string::npos) next = dir.size();
    const std::string part = dir.substr(0, next);
    if (::mkdir(part.c_str(), 0755) != 0 && errno != EEXIST) return false;
    at = next;
  }
  return true;
}

bool run_dir_holds_data(const std::string& dir) {
  std::error_code ec;
  for (fs::recursive_directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    // ddprun's own Python hook and the empty stacks files it opened are not worth keeping.
    if (it->is_directory(ec) && it->path().filename() == ".ddprun-python") {
      it.disable_recursion_pending();
      continue;
    }
    if (it->is_regular_file(ec) && it->file_size(ec) > 0) return true;
  }
  return false;
}

void tidy_job_dir(const std::string& dir) {
  if (dir.empty()) return;
  const int top = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (top < 0) return;
  std::error_code ec;
  fs::remove_all(fs::path(dir) / ".ddprun-python", ec);  // a link there goes, not what it points to
  // Every directory below, two levels deep (attempt_N/R, attempt_N.K/R after a membership change),
  // each opened without following a link, its stacks.txt removed relative to it when empty.
  const auto each_dir = [](int parent, const std::function<void(int)>& f) {
    const int fd = ::dup(parent);
    DIR* d = fd < 0 ? nullptr : ::fdopendir(fd);
    if (d == nullptr) {
      if (fd >= 0) ::close(fd);
      return;
    }
    std::vector<std::string> names;
    while (const dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != ".." && n != ".ddprun-python") names.push_back(n);
    }
    ::closedir(d);
    for (const auto& n : names) {
      const int sub = ::openat(parent, n.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (sub < 0) continue;
      f(sub);
      ::close(sub);
    }
  };
  each_dir(top, [&](int attempt) {
    each_dir(attempt, [](int rank) {
      struct stat st {};
      if (::fstatat(rank, "stacks.txt", &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode) && st.st_size == 0) {
        ::unlinkat(rank, "stacks.txt", 0);
      }
    });
  });
  ::close(top);
}

void remove_job_dir_unless_useful(const AgentConfig& config, const std::string& dir, bool may_hold_files,
                                  const std::function<bool(const std::string&)>& remove_later) {
  if (config.log_dir || dir.empty()) return;
  // The default run directory under $TMPDIR: keep it only when it holds something worth reading
  // (log files, an error file a worker wrote); otherwise leave no litter behind.
  if (may_hold_files && run_dir_holds_data(dir)) return;
  if (remove_later && remove_later(dir)) {
    spdlog::debug("run directory {} left to the watchdog to remove after the agent's exit", dir);
    return;
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
}

}  // namespace ddprun::agent
