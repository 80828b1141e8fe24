#pragma once
// Worker output: where each stream of each local rank goes, and the pumps that copy piped
// streams to log files and the console in whole lines.
//
// Routes (plan_routes, pure):
//   inherit - the worker writes to the agent's own stdout/stderr: zero copies, the default.
//   file    - the worker writes straight into <attempt>/<local_rank>/std{out,err}.log
//             (--redirects, or a stream of a rank that --local-ranks-filter keeps off the console:
//             it is kept in its file rather than thrown away).
//   tee     - a pipe the agent reads on its io_context; each line goes to the log file as is and
//             to the console with the prefix (--tee).
//   prefixed - a pipe the agent reads; each line goes to the console with the prefix, no file
//             (--prefix-output, used by remote agents of a fan-out launch).
//   discard - /dev/null: a stream kept off the console when there are no log files
//             (--log-dir /dev/null).
//
// LineBuffer (pure) holds a partial line until its newline arrives or the buffer is full (a line
// longer than the capacity is cut there and ended with a newline on the console; its rest goes
// on in the next console line, under the same prefix), so lines of different ranks never
// interleave mid-line on the console. OutputPump (shell) drives one
// LineBuffer from a pipe on the io_context; it is done only at EOF ("exited" is not "drained").
// A partial line held for kOpenLineDelay (a "(Pdb) " prompt, input()'s, a progress bar redrawn
// with "\r" however often) is shown then, left open on the console (console.hpp, "Open lines")
// and written to the log file; the rest of the line follows on it unless another writer wrote
// between. A line a read split and the next read completes within the delay is never split.
// Single-threaded: everything runs on the agent's io_context thread; console writes are queued
// for the console's writer threads (ddprun/common/console.hpp), which the pump follows: it stops
// reading its pipe while its console queue is over kConsoleHighWater.
#include <chrono>
#include <cstddef>
#include <functional>
#include <optional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ddprun/agent/config.hpp"

namespace boost::asio {
class io_context;
}

namespace ddprun::agent {

enum class Route : std::uint8_t { inherit, file, tee, prefixed, discard };

struct RankRoutes {
  Route out = Route::inherit;
  Route err = Route::inherit;
  bool needs_files() const { return is_file(out) || is_file(err); }
  static bool is_file(Route r) { return r == Route::file || r == Route::tee; }
};

// Which route each stream of `local_rank` takes under `config` (tee, redirects, the local and
// global rank filters, --prefix-output). `rank` is the worker's global rank when known (at
// spawn); without it, --ranks-filter counts as "maybe off the console" (a file route).
RankRoutes plan_routes(const AgentConfig& config, int local_rank, std::optional<int> rank = std::nullopt);

// Expands $role_name, $local_rank, $rank and $hostname (also as ${name}) in a
// TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE and "$$" to "$", as torchrun (Python's
// Template.safe_substitute). Anything else stays as written.
std::string expand_prefix(std::string_view templ, std::string_view role_name, int local_rank, int rank,
                          std::string_view hostname = {});

// A fixed-capacity buffer that releases output in whole lines.
class LineBuffer {
 public:
  explicit LineBuffer(std::size_t capacity);

  // Space to read into, and how much of it was filled.
  char* write_ptr() { return data_.data() + size_; }
  std::size_t write_space() const { return data_.size() - size_; }
  void commit(std::size_t n) { size_ += n; }

  // Calls sink(block, complete) with the releasable bytes: complete == true for a run of whole
  // lines (ends with '\n'); complete == false for a partial line released because the buffer is
  // full or `eof` is set. What is left (a partial line) moves to the front. Bytes take_open()
  // gave out already are not given again.
  void release(const std::function<void(std::string_view, bool)>& sink, bool eof);

  // The partial line held, or what of it came since the last take_open(), shown now although no
  // newline ended it (a prompt); empty when there is none. It stays held (release() ends it),
  // and nothing moves: safe while a read fills write_ptr().
  std::string_view take_open();
  // What take_open() would give, without giving it.
  std::string_view peek_open() const { return {data_.data() + shown_, size_ - shown_}; }

  std::size_t pending() const { return size_; }
  // Bytes held that take_open() did not give out.
  std::size_t unshown() const { return size_ - shown_; }

 private:
  std::vector<char> data_;
  std::size_t size_ = 0;
  std::size_t shown_ = 0;  // the front bytes take_open() gave out (no newline among them)
};

// Writes all of `data` to fd (retrying on EINTR, short writes, and EAGAIN via poll). Returns
// false when the fd is gone (EPIPE, EBADF): console output is then dropped, never fatal.
bool write_all(int fd, std::string_view data);

// write_all to a log file (--log-dir, --redirects, --tee, the filtered copies): the first
// failure of a file (a full disk, a quota) is logged once, naming the file and what to do
// (`reported` remembers it); the stream goes on (to the console where it goes there too).
void write_log_file(int fd, std::string_view data, bool& reported);

// How long a partial line waits for more bytes before an OutputPump with a console shows it.
inline constexpr std::chrono::milliseconds kOpenLineDelay{100};

class OutputPump {
 public:
  // Takes ownership of `read_fd` and `file_fd` (-1 = no file). `console_fd` is borrowed (-1 = no
  // console). `on_done` runs once, on the io_context, after EOF (or finish_now) when every byte
  // read has been written.
  OutputPump(boost::asio::io_context& io, int read_fd, int file_fd, int console_fd, std::string prefix,
             std::function<void()> on_done, std::size_t capacity = 64 * 1024);
  // The same pump with the lines handed to `sink(block, complete)` (LineBuffer::release's
  // contract) instead of a file and the console; used by the fan-out launcher to relay hosts.
  // `pace_fd`: the console stream the sink writes to (it stops reading while that one's queue
  // is full, console::over), or -1 when it writes none.
  OutputPump(boost::asio::io_context& io, int read_fd, std::function<void(std::string_view, bool)> sink, int pace_fd,
             std::function<void()> on_done, std::size_t capacity = 64 * 1024);
  ~OutputPump();
  OutputPump(const OutputPump&) = delete;
  OutputPump& operator=(const OutputPump&) = delete;

  // A sink pump's partial line held for kOpenLineDelay goes to `open_sink` (the bytes not given
  // before; the rest of the line follows in the sink's next block), which returns whether it
  // took them (if not, they stay held for the sink's next block). Before start().
  void set_open_sink(std::function<bool(std::string_view)> open_sink);
  void start();
  // Stops waiting for EOF (a grandchild may hold the pipe open): reads what is buffered in the
  // pipe now, writes it, and completes.
  void finish_now();
  // The process writing the pipe exited, so what it wrote is in the pipe: reads what the pipe
  // holds now and writes its whole lines, then calls `done` (at once, or from the io_context
  // once the read in flight has handed its bytes over), before reading on to EOF as ever. Its
  // owner reports the exit from `done`, after the process's last lines (a traceback).
  void sync(std::function<void()> done);
  bool done() const;

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace ddprun::agent
