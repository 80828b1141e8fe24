// Output routes, whole-line buffering and the pipe pumps; see output.hpp.
#include "ddprun/agent/output.hpp"

#include <fcntl.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/steady_timer.hpp>
#include <cstdio>
#include <cerrno>
#include <climits>
#include <cstring>
#include <optional>

#include "ddprun/common/console.hpp"

namespace asio = boost::asio;

namespace ddprun::agent {

namespace {

bool has(Streams set, Streams stream) { return (static_cast<unsigned>(set) & static_cast<unsigned>(stream)) != 0; }

Streams lookup(const std::map<int, Streams>& per_rank, Streams all, int local_rank) {
  const auto it = per_rank.find(local_rank);
  return it == per_rank.end() ? all : it->second;
}

Route route_for(Streams tee, Streams redirects, bool on_console, bool prefixed, Streams stream) {
  if (has(tee, stream)) {
    return on_console ? Route::tee : Route::file;
  }
  if (has(redirects, stream)) {
    return Route::file;
  }
  if (!on_console) {
    return Route::file;
  }
  return prefixed ? Route::prefixed : Route::inherit;
}

}  // namespace

RankRoutes plan_routes(const AgentConfig& config, int local_rank, std::optional<int> rank) {
  const Streams tee = lookup(config.tee, config.tee_all, local_rank);
  const Streams redirects = lookup(config.redirects, config.redirects_all, local_rank);
  bool on_console = !config.local_ranks_filter || config.local_ranks_filter->count(local_rank) != 0;
  if (config.ranks_filter) {
    on_console = on_console && rank && config.ranks_filter->count(*rank) != 0;
  }
  const bool prefixed = config.prefix_console;
  RankRoutes routes{route_for(tee, redirects, on_console, prefixed, Streams::out),
                    route_for(tee, redirects, on_console, prefixed, Streams::err)};
  if (config.no_log_files) {
    // No file to keep a stream in (the launcher has already dropped --redirects and --tee).
    for (Route* r : {&routes.out, &routes.err}) {
      if (*r == Route::file) *r = Route::discard;
    }
  }
  return routes;
}

std::string expand_prefix(std::string_view templ, std::string_view role_name, int local_rank, int rank,
                          std::string_view hostname) {
  // Python's string.Template.safe_substitute, as torchrun applies it: "$$" is "$", "$name" and
  // "${name}" (name: a letter or "_", then letters, digits, "_") are replaced when the name is
  // one of the four, and everything else stays as written.
  auto is_start = [](char c) { return c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); };
  auto is_part = [&](char c) { return is_start(c) || (c >= '0' && c <= '9'); };
  auto value = [&](std::string_view name) -> std::optional<std::string> {
    if (name == "role_name") return std::string(role_name);
    if (name == "local_rank") return std::to_string(local_rank);
    if (name == "rank") return std::to_string(rank);
    if (name == "hostname") return std::string(hostname);
    return std::nullopt;
  };
  std::string out;
  out.reserve(templ.size() + 16);
  std::size_t i = 0;
  while (i < templ.size()) {
    if (templ[i] != '$' || i + 1 >= templ.size()) {
      out += templ[i++];
      continue;
    }
    if (templ[i + 1] == '$') {
      out += '$';
      i += 2;
      continue;
    }
    const bool braced = templ[i + 1] == '{';
    std::size_t begin = i + (braced ? 2 : 1);
    std::size_t end = begin;
    if (end < templ.size() && is_start(templ[end])) {
      ++end;
      while (end < templ.size() && is_part(templ[end])) ++end;
    }
    const bool named = end > begin && (!braced || (end < templ.size() && templ[end] == '}'));
    if (named) {
      if (auto v = value(templ.substr(begin, end - begin))) {
        out += *v;
        i = end + (braced ? 1 : 0);
        continue;
      }
    }
    out += templ[i++];  // not one of ours: the '$' as written, the rest follows
  }
  return out;
}

LineBuffer::LineBuffer(std::size_t capacity) : data_(std::max<std::size_t>(capacity, 2)) {}

void LineBuffer::release(const std::function<void(std::string_view, bool)>& sink, bool eof) {
  if (size_ == 0) {
    return;
  }
  const std::string_view view(data_.data(), size_);
  const auto last_nl = view.rfind('\n');
  std::size_t used = 0;
  if (last_nl != std::string_view::npos) {
    used = last_nl + 1;  // past shown_: no newline among the shown bytes
    sink(view.substr(shown_, used - shown_), true);
  }
  if (used < size_ && (eof || (used == 0 && size_ == data_.size()))) {
    // A partial line: the stream ended, or a single line filled the whole buffer.
    sink(view.substr(std::max(used, shown_)), false);
    used = size_;
  }
  if (used > 0) {
    std::memmove(data_.data(), data_.data() + used, size_ - used);
    size_ -= used;
    shown_ = 0;
  }
}

std::string_view LineBuffer::take_open() {
  const std::string_view open(data_.data() + shown_, size_ - shown_);
  shown_ = size_;
  return open;
}

bool write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t n = ::write(fd, data.data(), data.size());
    if (n >= 0) {
      data.remove_prefix(static_cast<std::size_t>(n));
      continue;
    }
    if (errno == EINTR) {
      continue;
    }
    if (errno == EAGAIN) {
      // Someone made the console non-blocking: wait until it takes more (not a polling loop:
      // poll blocks until writable).
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, -1);
      continue;
    }
    return false;
  }
  return true;
}

void write_log_file(int fd, std::string_view data, bool& reported) {
  if (write_all(fd, data) || reported) return;
  const int err = errno;
  reported = true;
  char link[64];
  std::snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  char path[4096];
  const ssize_t n = ::readlink(link, path, sizeof path - 1);
  const std::string name = n > 0 ? std::string(path, static_cast<std::size_t>(n)) : "fd " + std::to_string(fd);
  spdlog::warn(
      "cannot write the log file {}: {}; output is missing from it from here on until writes work again "
      "(free space on its file system, or give --log-dir a directory on another one)",
      name, std::strerror(err));
}

struct OutputPump::Impl : std::enable_shared_from_this<OutputPump::Impl> {
  Impl(asio::io_context& ctx, int read_fd, int file, int console, std::string pfx, std::function<void()> done,
       std::size_t capacity)
      : io(ctx),
        pipe(ctx, read_fd),
        open_timer(ctx),
        file_fd(file),
        console_fd(console),
        prefix(std::move(pfx)),
        on_done(std::move(done)),
        buffer(capacity) {}

  ~Impl() {
    if (file_fd >= 0) {
      ::close(file_fd);
    }
  }

  void read_more() {
    if (finished) {
      return;
    }
    auto self = shared_from_this();
    reading = true;
    pipe.async_read_some(asio::buffer(buffer.write_ptr(), buffer.write_space()),
                         [self](const boost::system::error_code& ec, std::size_t n) {
                           self->reading = false;
                           self->on_read(ec, n);
                         });
  }

  void on_read(const boost::system::error_code& ec, std::size_t n) {
    if (finished) {
      return;
    }
    buffer.commit(n);
    if (finish_requested) {
      drain_now();
      return;
    }
    // A read cancelled by sync() is no end of the stream.
    bool eof = ec && ec != asio::error::operation_aborted;
    if (sync_requested) {
      sync_requested = false;
      if (!eof) eof = read_held();
    }
    flush(eof);
    if (!synced.empty()) {
      if (!eof) show_open();  // its last line, without a newline, goes before the exit's report too
      run_synced();
      if (finished) return;  // the owner went
    }
    if (eof) {
      complete();
      return;
    }
    note_partial();
    {
      // A sink paces on the console stream it relays to (pace_fd; -1: none).
      const int fd = sink ? pace_fd : console_fd;
      if (fd >= 0 && console::over(fd)) {
        // The console is not taking what is queued: stop reading the pipe until it has room,
        // so the worker waits in its own write (console.hpp), not the agent's event loop.
        std::weak_ptr<Impl> weak = shared_from_this();
        room_wait = console::when_room(fd, io, [weak] {
          if (auto self = weak.lock(); self && !self->finished && !self->reading && !self->finish_requested) {
            self->room_wait = 0;
            self->read_more();
          }
        });
        return;
      }
    }
    read_more();
  }

  void flush(bool eof) {
    buffer.release(
        [this, eof](std::string_view block, bool whole) {
          if (whole) partial_since.reset();  // what is held now is a line begun since
          if (sink) {
            sink(block, whole);
            return;
          }
          if (file_fd >= 0 && !block.empty()) {
            write_log_file(file_fd, block, file_failed);
          }
          if (console_fd >= 0) {
            std::string_view shown = block;
            // The console got the last piece of a line cut where the buffer filled with a newline
            // of its own: the line's real newline, right after the cut, ends that line, not another.
            if (console_cut && !shown.empty() && shown.front() == '\n') shown.remove_prefix(1);
            // A line shown open that then filled the buffer stays open: nothing else cuts it.
            const bool stays_open = console_open && !whole && !eof;
            console_cut = !whole && !stays_open;
            console_open = stays_open;
            console::write_prefixed(console_fd, prefix, shown, whole, /*paced=*/true, owner, stays_open);
          }
        },
        eof);
    if (eof) end_open_line();  // the stream ended right after a line shown open (nothing left to release)
  }

  void end_open_line() {
    if (!console_open || console_fd < 0) return;
    console_open = false;
    console::write_prefixed(console_fd, prefix, {}, /*complete=*/false, /*paced=*/true, owner);
  }

  // After a read: a partial line held (or its rest since it was shown) is shown once it is
  // kOpenLineDelay old, however often bytes come meanwhile (a progress bar redrawn 20 times a
  // second), while a line a read happened to split and the next completes never is.
  bool shows_open() const { return sink ? static_cast<bool>(open_sink) : console_fd >= 0; }

  void note_partial() {
    if (!shows_open()) return;
    if (buffer.unshown() == 0) {
      partial_since.reset();
      return;
    }
    if (!partial_since) partial_since = std::chrono::steady_clock::now();
    if (open_timer_armed) return;
    open_timer_armed = true;
    open_timer.expires_at(*partial_since + kOpenLineDelay);
    open_timer.async_wait([weak = std::weak_ptr<Impl>(shared_from_this())](const boost::system::error_code& ec) {
      auto self = weak.lock();
      if (!self) return;
      self->open_timer_armed = false;
      if (ec || self->finished || !self->partial_since) return;
      if (std::chrono::steady_clock::now() >= *self->partial_since + kOpenLineDelay) {
        self->show_open();
      } else {
        self->note_partial();  // the line it was armed for ended; a younger one is held
      }
    });
  }

  // Shows the partial line held, open (its rest follows on it).
  void show_open() {
    if (finished || finish_requested || !shows_open()) return;
    partial_since.reset();
    if (sink) {
      // Given out only when the sink takes it (a relay holds a host's text before its agent).
      if (const std::string_view open = buffer.peek_open(); !open.empty() && open_sink(open)) (void)buffer.take_open();
      return;
    }
    const std::string_view open = buffer.take_open();  // moves nothing: a read may be in flight
    if (open.empty()) return;
    if (file_fd >= 0) write_log_file(file_fd, open, file_failed);
    console_cut = false;  // no newline in a partial line
    console_open = true;
    console::write_prefixed(console_fd, prefix, open, /*complete=*/false, /*paced=*/true, owner, /*leave_open=*/true);
  }

  void finish_now() {
    if (finished) {
      return;
    }
    if (room_wait != 0) {  // paused for the console: read the rest now
      console::cancel(room_wait);
      room_wait = 0;
    }
    if (reading) {
      // A read in flight may already have filled the buffer without its handler having run:
      // cancel it and let the handler commit those bytes first (reading now would overwrite them).
      finish_requested = true;
      boost::system::error_code ignored;
      pipe.cancel(ignored);
      return;
    }
    drain_now();
  }

  // Reads what the pipe holds right now into the buffer, without blocking (asio made the fd
  // non-blocking), flushing whole lines when the buffer fills, and no more: a process that still
  // holds the pipe and writes faster than this reads (a grandchild's logger) would keep the event
  // loop here, and the console's queue growing. Only with no read in flight. True at EOF.
  bool read_held() {
    const int fd = pipe.native_handle();
    int held = 0;
    if (::ioctl(fd, FIONREAD, &held) != 0 || held < 0) held = 0;
    auto left = static_cast<std::size_t>(held);
    while (left > 0) {
      if (buffer.write_space() == 0) {
        flush(false);
      }
      const ssize_t n = ::read(fd, buffer.write_ptr(), std::min(buffer.write_space(), left));
      if (n > 0) {
        buffer.commit(static_cast<std::size_t>(n));
        left -= static_cast<std::size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) {
        continue;
      }
      return n == 0;
    }
    return false;
  }

  void drain_now() {
    const bool eof = read_held();
    flush(true);
    complete(/*keep_reading=*/!eof);
  }

  // The writer exited: what it wrote is in the pipe. Its whole lines go out before `done` runs
  // (the caller's report of the exit then follows them on the console), and reading goes on.
  void sync(std::function<void()> done) {
    synced.push_back(std::move(done));
    if (finished) {
      run_synced();
    } else if (reading) {
      // The read in flight owns the buffer's free space: its handler (cancelled, or already due
      // with bytes) commits them, then reads the rest (on_read).
      if (!sync_requested && !finish_requested) {
        sync_requested = true;
        boost::system::error_code ignored;
        pipe.cancel(ignored);
      }
    } else {
      // Paused for the console: what the pipe holds is read now all the same (bounded by it).
      if (read_held()) {
        flush(true);
        run_synced();
        complete();
        return;
      }
      flush(false);
      show_open();
      run_synced();
    }
  }

  void run_synced() {
    auto callbacks = std::move(synced);
    synced.clear();
    for (auto& cb : callbacks) cb();
  }

  // keep_reading: the owner stops waiting for the stream before its end (finish_now), but a
  // process that still holds the pipe (a worker's background upload) may write on: what it
  // writes is read and dropped until EOF, or until the pump goes with the attempt, so it is not
  // ended by SIGPIPE, nor held in a full pipe.
  void complete(bool keep_reading = false) {
    if (finished) {
      return;
    }
    finished = true;
    if (room_wait != 0) console::cancel(room_wait);
    room_wait = 0;
    open_timer.cancel();
    run_synced();  // a sync() that finish_now() overtook: everything was read
    boost::system::error_code ignored;
    if (keep_reading) {
      discard();
    } else {
      pipe.close(ignored);
    }
    if (file_fd >= 0) {
      ::close(file_fd);
      file_fd = -1;
    }
    if (on_done) {
      auto cb = std::move(on_done);
      on_done = nullptr;
      cb();
    }
  }

  void discard() {
    auto self = shared_from_this();
    pipe.async_read_some(asio::buffer(buffer.write_ptr(), buffer.write_space()),
                         [self](const boost::system::error_code& ec, std::size_t) {
                           if (!ec) return self->discard();
                           boost::system::error_code ignored;
                           self->pipe.close(ignored);
                         });
  }

  asio::io_context& io;
  asio::posix::stream_descriptor pipe;
  asio::steady_timer open_timer;  // note_partial()
  bool open_timer_armed = false;
  std::optional<std::chrono::steady_clock::time_point> partial_since;  // the held partial line's first byte
  const std::uint64_t owner = console::new_owner();                    // this pump's open lines
  int file_fd;
  bool file_failed = false;  // a write to file_fd failed (reported once)
  int console_fd;
  int pace_fd = -1;             // a sink's console stream: it stops reading while that is full
  std::uint64_t room_wait = 0;  // console::when_room's id while paused for the console
  bool console_cut = false;     // the last block written to the console was a line cut short
  bool console_open = false;    // the last block written to the console was left open (show_open)
  bool finished = false;
  bool reading = false;                       // an async read owns the buffer's free space
  bool finish_requested = false;              // finish_now() waits for that read's handler
  bool sync_requested = false;                // sync() waits for it
  std::vector<std::function<void()>> synced;  // sync()'s callers, run once the pipe's bytes are out
  std::string prefix;
  std::function<void(std::string_view, bool)> sink;  // set: replaces the file and console writes
  std::function<bool(std::string_view)> open_sink;   // a sink's partial lines shown open (or none)
  std::function<void()> on_done;
  LineBuffer buffer;
};

OutputPump::OutputPump(asio::io_context& io, int read_fd, int file_fd, int console_fd, std::string prefix,
                       std::function<void()> on_done, std::size_t capacity)
    : impl_(std::make_shared<Impl>(io, read_fd, file_fd, console_fd, std::move(prefix), std::move(on_done), capacity)) {
}

OutputPump::OutputPump(asio::io_context& io, int read_fd, std::function<void(std::string_view, bool)> sink, int pace_fd,
                       std::function<void()> on_done, std::size_t capacity)
    : impl_(std::make_shared<Impl>(io, read_fd, -1, -1, std::string(), std::move(on_done), capacity)) {
  impl_->sink = std::move(sink);
  impl_->pace_fd = pace_fd;
}

OutputPump::~OutputPump() {
  if (!impl_) return;
  if (!impl_->finished) {
    impl_->finished = true;
    if (impl_->room_wait != 0) console::cancel(impl_->room_wait);
    impl_->open_timer.cancel();
    impl_->on_done = nullptr;
  }
  impl_->end_open_line();  // no line of a pump that is gone stays open
  boost::system::error_code ignored;
  impl_->pipe.close(ignored);  // also the reading of a stream finished before its end (discard)
}

void OutputPump::set_open_sink(std::function<bool(std::string_view)> open_sink) {
  impl_->open_sink = std::move(open_sink);
}
void OutputPump::start() { impl_->read_more(); }
void OutputPump::finish_now() { impl_->finish_now(); }
void OutputPump::sync(std::function<void()> done) { impl_->sync(std::move(done)); }
bool OutputPump::done() const { return impl_->finished; }

}  // namespace ddprun::agent
