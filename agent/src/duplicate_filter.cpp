// --duplicate-std{out,err}-filters; see duplicate_filter.hpp.
#include "ddprun/agent/duplicate_filter.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "ddprun/common/error.hpp"

namespace ddprun::agent {

namespace {

struct OwnedFd {
  int fd = -1;
  explicit OwnedFd(const std::string& path)
      : fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644)) {
    if (fd < 0) throw Error("cannot open log file " + path + ": " + std::strerror(errno));
  }
  ~OwnedFd() {
    if (fd >= 0) ::close(fd);
  }
  OwnedFd(const OwnedFd&) = delete;
  OwnedFd& operator=(const OwnedFd&) = delete;
};

}  // namespace

std::vector<std::string_view> filter_lines(std::string_view block, const std::vector<std::string>& filters) {
  std::vector<std::string_view> out;
  std::size_t start = 0;
  while (start < block.size()) {
    const auto nl = block.find('\n', start);
    const std::size_t end = nl == std::string_view::npos ? block.size() : nl;
    const std::string_view line = block.substr(start, end - start);
    for (const auto& f : filters) {
      if (!f.empty() && line.find(f) != std::string_view::npos) {
        out.push_back(line);
        break;
      }
    }
    start = end + 1;
  }
  return out;
}

ChildStream duplicating_stream(Route route, const std::string& log_path, const std::string& filtered_path,
                               int console_fd, std::string prefix, std::vector<std::string> filters) {
  auto filtered = std::make_shared<OwnedFd>(filtered_path);
  std::shared_ptr<OwnedFd> log;
  if (route == Route::file || route == Route::tee) log = std::make_shared<OwnedFd>(log_path);
  const bool to_console = route == Route::inherit || route == Route::tee || route == Route::prefixed;
  const std::string console_prefix = route == Route::inherit ? std::string() : prefix;
  ChildStream st;
  st.kind = ChildStream::Kind::sink;
  st.sink = [=, scratch = std::make_shared<std::vector<iovec>>()](std::string_view block, bool complete) {
    if (log) write_all(log->fd, complete ? block : std::string(block) + "\n");
    if (to_console) write_prefixed_lines(console_fd, console_prefix, block, complete, *scratch);
    for (const auto line : filter_lines(block, filters)) {
      write_all(filtered->fd, prefix + std::string(line) + "\n");  // one write: ranks never interleave
    }
  };
  return st;
}

}  // namespace ddprun::agent
