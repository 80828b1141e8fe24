#pragma once
// The agent's side of torch's file-based worker watchdog (TORCHELASTIC_ENABLE_FILE_TIMER=1,
// torch.distributed.elastic.timer.FileTimerClient). A worker writes one JSON line per request
// into a FIFO the agent created:
//   {"version": 1, "pid": <worker pid>, "scope_id": "<name>", "expiration_time": <unix seconds>,
//    "signal": <signo>}
// acquire = a new deadline for (pid, scope_id); expiration_time < 0 = release that timer. When a
// deadline passes, every timer of that pid is dropped and the pid gets the signal of its
// earliest expired timer with a signal > 0 (none > 0: the pid is left alone), as torch's
// FileTimerServer does. The killed worker then fails like any other and the group restarts.
//
// Unlike torch's server, a request cannot aim the agent at any process: the Killer decides
// whether a pid may be signalled (the agent allows only live processes of the current attempt's
// workers), the table is cleared at every attempt start and a worker's timers go with it when it
// exits. Requests are bounded: pid 1..INT_MAX, signal 0..SIGRTMAX, a finite expiration_time,
// scope_id up to 256 bytes, 1024 timers per pid and 65536 in all (more are refused with a
// rate-limited warning). Deadlines are indexed, so each request costs O(log n).
//
// FileTimerTable is the pure bookkeeping; FileTimerServer owns the FIFO (created on
// construction, removed on destruction) and reads it on the agent's io_context: no thread, no
// polling; a steady_timer waits for the earliest deadline.
#include <sys/types.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/steady_timer.hpp>
#include <array>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "ddprun/agent/config.hpp"
#include "ddprun/common/rate_limited_warning.hpp"

namespace ddprun::agent {

struct TimerRequest {
  int version = 1;
  pid_t pid = 0;
  std::string scope_id;
  double expiration_time = 0;  // unix seconds; < 0 releases
  int signal = 0;
};

// One JSON line as FileTimerClient writes it; nullopt (and `problem`) for anything else.
std::optional<TimerRequest> parse_timer_request(std::string_view line, std::string* problem = nullptr);

class FileTimerTable {
 public:
  static constexpr std::size_t kMaxPerPid = 1024;
  static constexpr std::size_t kMaxTimers = 65536;
  enum class Applied { ok, too_many_for_pid, table_full };
  struct Reap {
    pid_t pid = 0;
    int signal = 0;  // 0: expired without a signal, not killed
    std::string scope_id;
    double expiration_time = 0;
  };
  Applied apply(const TimerRequest& request);
  // Removes every timer of each pid with a deadline <= now and says what to do with it.
  std::vector<Reap> take_expired(double now);
  // The earliest deadline, if any timer is armed.
  std::optional<double> next_deadline() const;
  std::size_t size() const { return timers_.size(); }
  std::size_t pids() const { return per_pid_.size(); }  // pids with timers
  void clear_pid(pid_t pid);
  void clear();

 private:
  using Key = std::pair<pid_t, std::string>;
  void erase(std::map<Key, TimerRequest>::iterator it);
  std::map<Key, TimerRequest> timers_;
  std::set<std::tuple<double, pid_t, std::string>> deadlines_;  // the same timers, by deadline
  std::map<pid_t, std::size_t> per_pid_;
};

class FileTimerServer {
 public:
  // Sends `signal` to `pid`; returns false when it did not (no such process, or not one the
  // caller lets a timer signal).
  using Killer = std::function<bool(pid_t pid, int signal)>;

  // Creates the FIFO at `path` and opens it. An existing file that is not a FIFO is never
  // replaced, nor a FIFO another reader holds (another job's agent); a stale FIFO nobody reads
  // is. The destructor removes the FIFO only while the path still names the one made here.
  // Throws ddprun::Error naming the path when that fails.
  FileTimerServer(boost::asio::io_context& io, std::string path, Killer killer);
  ~FileTimerServer();
  FileTimerServer(const FileTimerServer&) = delete;
  FileTimerServer& operator=(const FileTimerServer&) = delete;

  void start();
  // A new attempt: the previous attempt's timers are dropped.
  void reset();
  // A worker exited: its timers are dropped.
  void drop_pid(pid_t pid);
  const std::string& path() const { return path_; }
  dev_t fifo_dev() const { return fifo_dev_; }  // the FIFO made at path()
  ino_t fifo_ino() const { return fifo_ino_; }
  std::size_t timers() const { return table_.size(); }
  std::size_t requests_seen() const { return requests_; }

 private:
  void read();
  void on_line(std::string_view line);
  void rearm();
  void on_deadline();
  void warn_limited(const std::string& message);
  void flush_warnings();

  std::string path_;
  Killer killer_;
  boost::asio::posix::stream_descriptor reader_;
  int keeper_fd_ = -1;  // our own writer, so the FIFO never reports EOF between clients
  boost::asio::steady_timer timer_;
  FileTimerTable table_;
  std::array<char, 4096> buf_{};
  std::string partial_;
  bool skipping_ = false;  // the rest of a line cut for its length
  std::size_t requests_ = 0;
  dev_t fifo_dev_ = 0;
  ino_t fifo_ino_ = 0;
  // Lines and timers refused: a worker can write them as fast as they are read; one warning per 10 s.
  RateLimitedWarning ignored_{.window = std::chrono::seconds(10)};
  // A worker can make timers expire as fast as it writes lines (expiration_time 0): the expiry
  // lines, at most 64 a second (every local rank's timer expiring in a hang is shown), then a count.
  RateLimitedWarning expired_quietly_{.burst = 64};
  RateLimitedWarning expired_killed_{.burst = 64};
};

// Sends `signal` to `pid` unless it is the agent itself, pid <= 1, or `member(pid)` says it is
// not the job's. The process is pinned with a pidfd before `member` is asked and signalled through
// it, so a pid that is recycled in between is never signalled (kill() by number would be).
bool kill_timer_pid(pid_t pid, int signal, const std::function<bool(pid_t)>& member);

// With config.file_timer: creates and starts the server (FIFO at config.file_timer_path, else
// default_timer_file()) with `killer` and sets TORCHELASTIC_TIMER_FILE in `parent_env`, the base
// of every worker's environment. nullptr without it.
std::unique_ptr<FileTimerServer> start_file_timer(boost::asio::io_context& io, const AgentConfig& config,
                                                  worker_env::EnvMap& parent_env, FileTimerServer::Killer killer);

// The default FIFO path when TORCHELASTIC_TIMER_FILE is not set: /tmp/watchdog_timer_<uuid4>.
std::string default_timer_file();

}  // namespace ddprun::agent
