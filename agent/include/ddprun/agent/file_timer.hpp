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
// FileTimerTable is the pure bookkeeping; FileTimerServer owns the FIFO (created on
// construction, removed on destruction) and reads it on the agent's io_context: no thread, no
// polling; a steady_timer waits for the earliest deadline.
#include <sys/types.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/steady_timer.hpp>
#include <array>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ddprun/agent/config.hpp"

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
  struct Reap {
    pid_t pid = 0;
    int signal = 0;  // 0: expired without a signal, not killed
    std::string scope_id;
    double expiration_time = 0;
  };
  void apply(const TimerRequest& request);
  // Removes every timer of each pid with a deadline <= now and says what to do with it.
  std::vector<Reap> take_expired(double now);
  // The earliest deadline, if any timer is armed.
  std::optional<double> next_deadline() const;
  std::size_t size() const { return timers_.size(); }
  void clear_pid(pid_t pid);

 private:
  std::map<std::pair<pid_t, std::string>, TimerRequest> timers_;
};

class FileTimerServer {
 public:
  // Sends `signal` to `pid`; returns false when there is no such process.
  using Killer = std::function<bool(pid_t pid, int signal)>;

  // Creates the FIFO at `path` (an old file there is replaced, as torch does) and opens it.
  // Throws ddprun::Error naming the path when that fails.
  FileTimerServer(boost::asio::io_context& io, std::string path, Killer killer);
  ~FileTimerServer();
  FileTimerServer(const FileTimerServer&) = delete;
  FileTimerServer& operator=(const FileTimerServer&) = delete;

  void start();
  const std::string& path() const { return path_; }
  std::size_t requests_seen() const { return requests_; }

 private:
  void read();
  void on_line(std::string_view line);
  void rearm();
  void on_deadline();

  std::string path_;
  Killer killer_;
  boost::asio::posix::stream_descriptor reader_;
  int keeper_fd_ = -1;  // our own writer, so the FIFO never reports EOF between clients
  boost::asio::steady_timer timer_;
  FileTimerTable table_;
  std::array<char, 4096> buf_{};
  std::string partial_;
  std::size_t requests_ = 0;
};

// Sends `signal` to `pid` unless it is the agent itself or pid <= 1.
bool kill_timer_pid(pid_t pid, int signal);

// With config.file_timer: creates and starts the server (FIFO at config.file_timer_path, else
// default_timer_file()) and sets TORCHELASTIC_TIMER_FILE in `parent_env`, the base of every
// worker's environment. nullptr without it.
std::unique_ptr<FileTimerServer> start_file_timer(boost::asio::io_context& io, const AgentConfig& config,
                                                  worker_env::EnvMap& parent_env);

// The default FIFO path when TORCHELASTIC_TIMER_FILE is not set: /tmp/watchdog_timer_<uuid4>.
std::string default_timer_file();

}  // namespace ddprun::agent
