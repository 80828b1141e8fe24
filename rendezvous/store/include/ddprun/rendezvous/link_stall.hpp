#pragma once
// When a relay link's outgoing bytes last moved, for --link-stall-timeout-ms: both ends of a link
// (the daemon's store server and ddprun-rdzvd --relay-to) close a link whose peer has taken none of
// the bytes waiting for it for the timeout. "Moved" is:
//   * the socket taking bytes of the write in flight (async_write's completion condition: wrote());
//   * the peer acknowledging some of what the socket holds (SIOCOUTQ changed): the kernel wakes a
//     writer only once about a third of its send buffer drained, so on a link that drains slowly
//     the write alone can sit still for long;
//   * whatever the caller counts as the peer being alive (moved(): a relay counts the root's bytes).
// A check that itself comes more than half the timeout late (this process was stopped, or starved)
// restarts the clock: the peer was not the one that stood still. One per link; not thread-safe.
#include <chrono>
#include <cstddef>

namespace ddprun::rendezvous {

class LinkStallClock {
 public:
  using Clock = std::chrono::steady_clock;

  // How often to call quiet(): a quarter of the timeout, 5 ms to 1 s.
  static std::chrono::milliseconds check_period(std::chrono::milliseconds timeout);

  void moved(Clock::time_point now) { progress_ = now; }
  // A write of a new buffer starts.
  void write_started(Clock::time_point now) {
    progress_ = now;
    written_ = 0;
  }
  // `n` bytes of that buffer are written so far.
  void wrote(std::size_t n, Clock::time_point now) {
    if (n > written_) {
      written_ = n;
      progress_ = now;
    }
  }
  std::size_t written() const { return written_; }

  // Called at every check, whether a write is in flight on socket `fd` or not: how long the write
  // in flight has not moved; zero when none is in flight.
  Clock::duration quiet(int fd, bool in_flight, Clock::time_point now, std::chrono::milliseconds timeout);

 private:
  Clock::time_point progress_{};
  Clock::time_point last_check_{};
  std::size_t written_ = 0;
  int unacked_ = -1;
};

}  // namespace ddprun::rendezvous
