#pragma once
// Clock: the only source of time for decision code (rendezvous rounds, leases, deadlines).
//
// Pure logic takes a `const Clock&` (or a time_point argument) and never calls
// steady_clock::now() itself, so unit tests drive it with ManualClock and never sleep.
// SteadyClock is stateless and thread-safe; ManualClock is not thread-safe (tests only).
#include <chrono>

namespace ddprun {

using Duration = std::chrono::steady_clock::duration;
using TimePoint = std::chrono::steady_clock::time_point;

class Clock {
 public:
  virtual ~Clock() = default;
  virtual TimePoint now() const = 0;
};

class SteadyClock final : public Clock {
 public:
  TimePoint now() const override { return std::chrono::steady_clock::now(); }
  // A process-wide instance for production wiring.
  static const SteadyClock& instance() {
    static const SteadyClock clock;
    return clock;
  }
};

class ManualClock final : public Clock {
 public:
  explicit ManualClock(TimePoint start = TimePoint{} + std::chrono::hours(1)) : now_(start) {}
  TimePoint now() const override { return now_; }
  void advance(Duration d) { now_ += d; }
  void set(TimePoint t) { now_ = t; }

 private:
  TimePoint now_;
};

}  // namespace ddprun
