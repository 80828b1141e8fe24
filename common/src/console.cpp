// The console written by a thread of its own (console.hpp has the contract).
#include "ddprun/common/console.hpp"

#include <fmt/format.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace ddprun::console {
namespace {

constexpr std::size_t kCoalesceBytes = 256 << 10;  // one write(2) of consecutive pieces

// One lane per destination: fds that name the same file (2>&1, one terminal) share a lane and
// keep their order; a destination that stops reading holds up only its own lane (a stdout piped
// to a pager that waits does not hold back ddprun's messages on a terminal's stderr).
struct Lane {
  dev_t dev = 0;
  ino_t ino = 0;
  dev_t rdev = 0;
  bool known = false;  // fstat worked: the key above names the file
  // A regular file or /dev/null: a write there does not wait on a reader, so it is made
  // directly by the caller (no thread, nothing queued; the common case of a batch job).
  bool direct = false;
  std::condition_variable work;
  std::deque<std::pair<int, std::string>> pieces;
  std::size_t queued = 0;  // bytes in `pieces` and in the writer's hands
  // The writer whose last line is open (write_prefixed's leave_open), or 0: what is queued next,
  // unless the same writer's, begins with a newline.
  std::uint64_t open_owner = 0;
  std::size_t dropped = 0;  // bytes not queued past kConsoleHardCap, not yet told
};

struct Waiter {
  std::uint64_t id;
  Lane* lane;
  boost::asio::io_context* io;
  std::function<void()> resume;
};

struct State {
  std::mutex m;
  std::condition_variable idle;  // drain(): every lane empty
  std::vector<std::unique_ptr<Lane>> lanes;
  std::vector<std::pair<int, Lane*>> by_fd;
  std::vector<Waiter> waiters;
  std::vector<int> dead;  // fds a write failed on
  std::uint64_t next_id = 1;
  bool hooked = false;                                 // atexit and atfork installed
  bool direct = false;                                 // a forked child, or past the exit's drain: writes are direct
  bool closed = false;                                 // past an exit's drain that was cut short: writes are dropped
  std::optional<std::chrono::milliseconds> exit_wait;  // limit_exit_wait
};

// Never destroyed: writer threads may still wait on it while static objects go.
State& state() {
  static State* s = new State;
  return *s;
}

// write(2) of all of it, waiting (poll) where the descriptor was made non-blocking by someone.
bool write_fully(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t n = ::write(fd, data.data(), data.size());
    if (n >= 0) {
      data.remove_prefix(static_cast<std::size_t>(n));
    } else if (errno == EAGAIN) {
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, -1);
    } else if (errno != EINTR) {
      return false;
    }
  }
  return true;
}

bool all_empty(const State& st) {
  return std::all_of(st.lanes.begin(), st.lanes.end(), [](const auto& l) { return l->queued == 0; });
}

void wake_waiters(State& st, const Lane* lane) {
  const auto woken = std::stable_partition(st.waiters.begin(), st.waiters.end(),
                                           [&](const Waiter& w) { return lane != nullptr && w.lane != lane; });
  std::vector<Waiter> go(std::make_move_iterator(woken), std::make_move_iterator(st.waiters.end()));
  st.waiters.erase(woken, st.waiters.end());
  for (auto& w : go) boost::asio::post(*w.io, std::move(w.resume));
}

void push_locked(State& st, Lane& lane, int fd, std::string&& data, bool paced = false);
Lane& lane_for(State& st, int fd);

// One turn of a lane's writer, called and returning with the lock held.
void write_next(State* st, Lane* lane, std::unique_lock<std::mutex>& lock) {
  auto [fd, data] = std::move(lane->pieces.front());
  lane->pieces.pop_front();
  std::size_t taken = data.size();
  try {
    while (!lane->pieces.empty() && lane->pieces.front().first == fd && data.size() < kCoalesceBytes) {
      data += lane->pieces.front().second;
      taken += lane->pieces.front().second.size();
      lane->pieces.pop_front();
    }
  } catch (const std::bad_alloc&) {  // write what was joined so far; the piece it failed on waits
  }
  const bool dead = std::find(st->dead.begin(), st->dead.end(), fd) != st->dead.end();
  lock.unlock();
  const bool ok = dead || write_fully(fd, data);
  const int err = errno;
  lock.lock();
  lane->queued -= taken;
  if (!ok && err == EPIPE) st->dead.push_back(fd);  // the reader is gone: drop the rest for it
  if (lane->queued < kConsoleLowWater) {
    if (lane->dropped > 0) {
      std::string note =
          fmt::format("ddprun: {} bytes of output were dropped: the console did not read them (at most {} MiB wait)\n",
                      lane->dropped, kConsoleHardCap >> 20);
      lane->dropped = 0;
      if (Lane& err_lane = lane_for(*st, STDERR_FILENO); err_lane.direct) {
        (void)write_fully(STDERR_FILENO, note);  // a file: does not wait on a reader
      } else {
        push_locked(*st, err_lane, STDERR_FILENO, std::move(note));
      }
    }
    wake_waiters(*st, lane);
  }
}

void writer(State* st, Lane* lane) {
  sigset_t all;
  ::sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, nullptr);  // signals are the event loop's
  std::unique_lock lock(st->m);
  for (;;) {
    lane->work.wait(lock, [lane] { return !lane->pieces.empty(); });
    try {
      write_next(st, lane, lock);
    } catch (...) {  // out of memory for the note or a wake-up: what it was for is lost, not the process
      if (!lock.owns_lock()) lock.lock();
    }
    if (all_empty(*st)) st->idle.notify_all();
  }
}

void after_fork_in_child() {
  // The writer threads are not in the child, and the lock may have been held at the fork.
  State& st = state();
  new (&st.m) std::mutex;
  st.direct = true;
}

void drain_at_exit() {
  drain();
  // What static destructors and stdio's own exit flush write from here on: directly where the
  // queues drained (nothing would write it later), dropped where the wait was cut short (a
  // direct write would wait on the console that did not read).
  State& st = state();
  std::lock_guard lock(st.m);
  if (all_empty(st)) {
    st.direct = true;
  } else {
    st.closed = true;
  }
}

Lane& lane_for(State& st, int fd) {
  for (const auto& [f, lane] : st.by_fd) {
    if (f == fd) return *lane;
  }
  if (!st.hooked) {
    st.hooked = true;
    ::pthread_atfork(nullptr, nullptr, after_fork_in_child);
    std::atexit(drain_at_exit);
  }
  struct stat sb {};
  const bool known = ::fstat(fd, &sb) == 0;
  Lane* lane = nullptr;
  for (const auto& l : st.lanes) {
    if (known && l->known && l->dev == sb.st_dev && l->ino == sb.st_ino && l->rdev == sb.st_rdev) lane = l.get();
  }
  if (lane == nullptr) {
    auto fresh = std::make_unique<Lane>();
    fresh->known = known;
    fresh->dev = sb.st_dev;
    fresh->ino = sb.st_ino;
    fresh->rdev = sb.st_rdev;
    fresh->direct = known && (S_ISREG(sb.st_mode) || (S_ISCHR(sb.st_mode) && sb.st_rdev == makedev(1, 3)));
    lane = fresh.get();
    st.lanes.reserve(st.lanes.size() + 1);
    if (!lane->direct) {
      try {
        std::thread(writer, &st, lane).detach();
      } catch (const std::system_error&) {
        lane->direct = true;  // no thread to be had (pids.max, RLIMIT_NPROC): written as before, directly
      }
    }
    st.lanes.push_back(std::move(fresh));
  }
  st.by_fd.emplace_back(fd, lane);
  return *lane;
}

void push_locked(State& st, Lane& lane, int fd, std::string&& data, bool paced) {
  // A paced piece is bounded by its pump's pause at over(); after a signal the pumps no longer
  // pause (limit_exit_wait), so then the cap holds for every piece.
  if ((!paced || st.exit_wait) && lane.queued + data.size() > kConsoleHardCap) {
    lane.dropped += data.size();
    return;
  }
  lane.queued += data.size();
  lane.pieces.emplace_back(fd, std::move(data));
  lane.work.notify_one();
}

// `build(text, open_owner)` makes the piece under the lock, seeing which writer's line is open
// on the destination (0: none; only tracked where a lane is), and returns the writer whose line
// the piece leaves open.
template <class Build>
void enqueue_built(int fd, bool paced, Build build) {
  State& st = state();
  std::unique_lock lock(st.m);
  if (st.closed) return;
  std::string text;
  if (!st.direct) {
    Lane& lane = lane_for(st, fd);
    lane.open_owner = build(text, lane.open_owner);
    if (text.empty()) return;
    if (!lane.direct) return push_locked(st, lane, fd, std::move(text), paced);
  } else {
    (void)build(text, 0);
  }
  lock.unlock();
  if (!text.empty()) (void)write_fully(fd, text);
}

void enqueue(int fd, std::string&& data, bool paced) {
  enqueue_built(fd, paced, [&data](std::string& text, std::uint64_t open) -> std::uint64_t {
    if (open != 0) data.insert(data.begin(), '\n');  // ends another writer's open line
    text = std::move(data);
    return 0;
  });
}

// `continuing`: the block goes on on a line already started (no prefix before its first line).
void append_prefixed(std::string& out, std::string_view prefix, std::string_view block, bool complete,
                     bool continuing = false) {
  std::size_t pos = 0;
  while (pos < block.size()) {
    const auto nl = block.find('\n', pos);
    const std::size_t end = nl == std::string_view::npos ? block.size() : nl + 1;
    if (pos > 0 || !continuing) out += prefix;
    out += block.substr(pos, end - pos);
    pos = end;
  }
  if (!complete) out += '\n';
}

// The lane that holds `fd`'s output (fd -1: the fullest of all), or nullptr.
Lane* lane_of(State& st, int fd) {
  Lane* out = nullptr;
  for (const auto& [f, lane] : st.by_fd) {
    if (f == fd) return lane;
    if (fd == -1 && (out == nullptr || lane->queued > out->queued)) out = lane;
  }
  return out;
}

}  // namespace

void write(int fd, std::string_view data, bool paced) noexcept {
  if (data.empty()) return;
  try {
    enqueue(fd, std::string(data), paced);
  } catch (...) {  // out of memory: this piece is lost, as a failed write's is
  }
}

void write_prefixed(int fd, std::string_view prefix, std::string_view block, bool complete, bool paced,
                    std::uint64_t owner, bool leave_open) noexcept {
  try {
    if (block.empty()) {
      // Nothing but the end of the owner's open line (a stream that ended right after it).
      if (complete || leave_open || owner == 0) return;
      enqueue_built(fd, paced, [owner](std::string& text, std::uint64_t open) -> std::uint64_t {
        if (open != owner) return open;
        text += '\n';
        return 0;
      });
      return;
    }
    enqueue_built(fd, paced, [&](std::string& text, std::uint64_t open) -> std::uint64_t {
      const bool continuing = owner != 0 && open == owner;
      text.reserve(block.size() + prefix.size() * 8 + 2);
      if (open != 0 && !continuing) text += '\n';
      append_prefixed(text, prefix, block, complete || leave_open, continuing);
      return leave_open ? owner : 0;
    });
  } catch (...) {  // out of memory: this piece is lost, as a failed write's is
  }
}

std::uint64_t new_owner() noexcept {
  static std::atomic<std::uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

bool over(int fd) {
  State& st = state();
  std::lock_guard lock(st.m);
  const Lane* lane = st.direct ? nullptr : lane_of(st, fd);
  return !st.exit_wait && lane != nullptr && lane->queued >= kConsoleHighWater;
}

std::uint64_t when_room(int fd, boost::asio::io_context& io, std::function<void()> resume) {
  State& st = state();
  std::lock_guard lock(st.m);
  const std::uint64_t id = st.next_id++;
  Lane* lane = st.direct ? nullptr : lane_of(st, fd);
  if (lane == nullptr || lane->queued < kConsoleLowWater || st.exit_wait) {
    boost::asio::post(io, std::move(resume));
  } else {
    st.waiters.push_back(Waiter{id, lane, &io, std::move(resume)});
  }
  return id;
}

void cancel(std::uint64_t id) {
  State& st = state();
  std::lock_guard lock(st.m);
  std::erase_if(st.waiters, [id](const Waiter& w) { return w.id == id; });
}

void drain() {
  State& st = state();
  std::unique_lock lock(st.m);
  if (st.direct) return;
  const auto done = [&st] { return all_empty(st); };
  if (st.exit_wait) {
    st.idle.wait_for(lock, *st.exit_wait, done);  // a signal ended the run (limit_exit_wait)
  } else {
    st.idle.wait(lock, done);
  }
}

void limit_exit_wait(std::chrono::milliseconds limit) {
  State& st = state();
  std::lock_guard lock(st.m);
  st.exit_wait = limit;
  wake_waiters(st, nullptr);  // pumps read on: what a console cannot take past kConsoleHardCap is dropped
}

std::size_t queued(int fd) {
  State& st = state();
  std::lock_guard lock(st.m);
  const Lane* lane = lane_of(st, fd);
  return lane == nullptr ? 0 : lane->queued;
}

}  // namespace ddprun::console
