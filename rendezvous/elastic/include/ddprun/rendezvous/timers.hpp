#pragma once
// Timers: the clock/timer seam of the rendezvous service and client.
//
// Everything in elastic/ that waits for protocol time (heartbeats, reconnect backoff, the
// registry's next deadline) takes a `Timers&` and asks it for the time and for one-shot timers,
// instead of reading steady_clock and building asio timers itself. Production passes
// Timers::steady() (steady_clock + asio::steady_timer); tests pass ManualTimers and move time
// forward with advance(), so they check "the lease expires after 500 ms" without sleeping.
//
// Timer contract: arm(at, handler) runs `handler` once on the timer's io_context when the
// clock reaches `at` (at once, posted, if `at` is not in the future). Re-arming or cancel()
// drops the previous handler: it never runs, even when it was already due. Destroying a Timer
// cancels it. Not thread-safe: everything on the io_context's thread.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>

#include "ddprun/common/clock.hpp"

namespace boost::asio {
class io_context;
}

namespace ddprun::rendezvous {

class Timer {
 public:
  virtual ~Timer() = default;
  virtual void arm(TimePoint at, std::function<void()> handler) = 0;
  virtual void cancel() = 0;
};

class Timers {
 public:
  virtual ~Timers() = default;
  virtual const Clock& clock() const = 0;
  virtual std::unique_ptr<Timer> make_timer(boost::asio::io_context& io) = 0;

  // steady_clock and asio::steady_timer; process-wide, stateless.
  static Timers& steady();
};

// Test time: a ManualClock and timers that fire only when advance() moves the clock past them.
// It must outlive every Timer it made: declare it before the io_context whose pending handlers
// may keep a client (and its timers) alive.
class ManualTimers final : public Timers {
 public:
  explicit ManualTimers(TimePoint start = TimePoint{} + std::chrono::hours(1)) : clock_(start) {}
  ManualTimers(const ManualTimers&) = delete;
  ManualTimers& operator=(const ManualTimers&) = delete;

  const Clock& clock() const override { return clock_; }
  TimePoint now() const { return clock_.now(); }
  std::unique_ptr<Timer> make_timer(boost::asio::io_context& io) override;

  // Moves the clock forward by `d` and posts, in expiry order, the handler of every timer due.
  void advance(Duration d);
  // Moves the clock to the earliest armed expiry (if any) and fires what is due; returns it.
  std::optional<TimePoint> advance_to_next();
  // Earliest armed expiry; nullopt when no timer is armed.
  std::optional<TimePoint> next_expiry() const;
  std::size_t armed() const;

  struct Entry;

 private:
  void fire_due();

  ManualClock clock_;
  std::set<Entry*> entries_;
};

}  // namespace ddprun::rendezvous
