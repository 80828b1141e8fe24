// --duplicate-std{out,err}-filters; see duplicate_filter.hpp.
#include "ddprun/agent/duplicate_filter.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "ddprun/common/console.hpp"
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

// The filtered copy of one stream. Lines longer than the pump's buffer arrive in pieces
// (complete == false); the unfinished line is kept (up to kMaxKept bytes) so a filter that
// straddles two pieces still matches and the copy gets the line once, whole. A stream that ends
// without a newline has its last line written when the stream is closed (destructor).
class FilteredCopy {
 public:
  static constexpr std::size_t kMaxKept = 1024 * 1024;
  FilteredCopy(const std::string& path, std::string prefix, std::vector<std::string> filters)
      : fd_(path), prefix_(std::move(prefix)), filters_(std::move(filters)) {
    for (const auto& f : filters_) longest_ = std::max(longest_, f.size());
  }
  ~FilteredCopy() { end_line(); }
  FilteredCopy(const FilteredCopy&) = delete;
  FilteredCopy& operator=(const FilteredCopy&) = delete;

  void feed(std::string_view block, bool complete) {
    while (!block.empty()) {
      const auto nl = block.find('\n');
      if (nl == std::string_view::npos) {
        add(block);
        return;
      }
      add(block.substr(0, nl));
      end_line();
      block.remove_prefix(nl + 1);
    }
    (void)complete;  // a partial piece simply continues the kept line
  }

 private:
  void add(std::string_view piece) {
    if (piece.empty()) return;
    open_ = true;
    if (!matched_) {
      // Search the new bytes together with the last longest_-1 bytes already seen.
      std::string window = tail_;
      window.append(piece);
      for (const auto& f : filters_) {
        if (!f.empty() && window.find(f) != std::string::npos) {
          matched_ = true;
          break;
        }
      }
      const std::size_t keep = longest_ > 0 ? longest_ - 1 : 0;
      tail_ = window.size() > keep ? window.substr(window.size() - keep) : window;
    }
    if (line_.size() < kMaxKept) {
      const std::size_t room = kMaxKept - line_.size();
      line_.append(piece.substr(0, room));
      truncated_ = truncated_ || piece.size() > room;
    } else {
      truncated_ = true;
    }
  }

  void end_line() {
    if (open_ && matched_) {
      std::string out = prefix_ + line_;
      if (truncated_) out += " [ddprun: line cut at 1 MiB]";
      out += "\n";
      write_log_file(fd_.fd, out, failed_);  // one write: ranks never interleave
    }
    line_.clear();
    tail_.clear();
    open_ = matched_ = truncated_ = false;
  }

  OwnedFd fd_;
  std::string prefix_;
  std::vector<std::string> filters_;
  std::size_t longest_ = 0;
  std::string line_;   // the current line so far (capped)
  std::string tail_;   // its last longest_-1 bytes, for matches across pieces
  bool open_ = false;  // a line has started (an empty line matches nothing)
  bool matched_ = false;
  bool truncated_ = false;
  bool failed_ = false;  // a write to the copy failed (reported once)
};

}  // namespace

ChildStream duplicating_stream(Route route, const std::string& log_path, const std::string& filtered_path,
                               int console_fd, std::string prefix, std::vector<std::string> filters) {
  auto filtered = std::make_shared<FilteredCopy>(filtered_path, prefix, std::move(filters));
  std::shared_ptr<OwnedFd> log;
  if (route == Route::file || route == Route::tee) log = std::make_shared<OwnedFd>(log_path);
  const bool to_console = route == Route::inherit || route == Route::tee || route == Route::prefixed;
  const std::string console_prefix = route == Route::inherit ? std::string() : prefix;
  ChildStream st;
  st.kind = ChildStream::Kind::sink;
  st.console_fd = to_console ? console_fd : -1;  // the pump paces on it
  struct ConsoleState {
    bool cut = false;         // the last block written to the console was a line cut short
    bool log_failed = false;  // a write to the log file failed (reported once)
  };
  st.sink = [=, console = std::make_shared<ConsoleState>()](std::string_view block, bool complete) {
    // The log file gets the bytes as they are, as without filters: a long line cut into pieces
    // by the pump's buffer stays one line.
    if (log) write_log_file(log->fd, block, console->log_failed);
    if (to_console && console_prefix.empty()) {
      // Not prefixed (inherit): the bytes as they are, as without filters (no newline of
      // ddprun's at a cut or at a last line without one).
      console::write(console_fd, block, /*paced=*/true);
    } else if (to_console) {
      // As the pump's own console path: a cut piece was ended with a newline of ddprun's, so the
      // line's real newline right after the cut ends that line, not an empty one.
      std::string_view shown = block;
      if (console->cut && !shown.empty() && shown.front() == '\n') shown.remove_prefix(1);
      console->cut = !complete;
      if (!shown.empty()) console::write_prefixed(console_fd, console_prefix, shown, complete, /*paced=*/true);
    }
    filtered->feed(block, complete);
  };
  return st;
}

}  // namespace ddprun::agent
