#pragma once
// Backoff: exponential backoff with jitter, as pure arithmetic.
//
// It computes delays and never sleeps or reads a clock, so retry loops (store client
// connect, agent reconnects) decide *how long* here and do the waiting themselves, and unit
// tests drive it with a fixed random source. Not thread-safe; one instance per retry loop.
//
// Delay n (n = 0, 1, ...) is  base_n = min(initial * multiplier^n, max),  scaled by a factor
// drawn uniformly from [1 - jitter, 1 + jitter] and clamped to [0, max]. Jitter spreads a
// herd of clients that failed together (e.g. 1024 ranks hitting a full accept queue) so
// their retries do not arrive together again.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <random>
#include <utility>

namespace ddprun {

class Backoff {
 public:
  using Duration = std::chrono::nanoseconds;
  // Returns a number in [0, 1).
  using RandomSource = std::function<double()>;

  struct Options {
    Duration initial = std::chrono::milliseconds(1);
    Duration max = std::chrono::milliseconds(1000);
    double multiplier = 2.0;
    double jitter = 0.5;  // fraction of the delay, in [0, 1]
  };

  // `random` defaults to a per-instance std::minstd_rand seeded from std::random_device.
  explicit Backoff(Options options, RandomSource random = {}) : options_(options), random_(std::move(random)) {
    options_.jitter = std::clamp(options_.jitter, 0.0, 1.0);
    if (options_.multiplier < 1.0) options_.multiplier = 1.0;
    if (options_.initial < Duration::zero()) options_.initial = Duration::zero();
    if (options_.max < options_.initial) options_.max = options_.initial;
    if (!random_) {
      random_ = [engine = std::minstd_rand(std::random_device{}()),
                 dist = std::uniform_real_distribution<double>(0.0, 1.0)]() mutable { return dist(engine); };
    }
    current_base_ = initial_ns();
  }

  // The delay before the next retry; advances the attempt counter.
  Duration next_delay() {
    const double base = current_base_;
    current_base_ = std::min(current_base_ * options_.multiplier, max_ns());
    ++attempts_;
    const double u = std::clamp(random_(), 0.0, 1.0);
    const double factor = 1.0 - options_.jitter + 2.0 * options_.jitter * u;
    const double d = std::clamp(base * factor, 0.0, max_ns());
    return Duration(static_cast<Duration::rep>(d));
  }

  // Back to the first delay (after a success).
  void reset() {
    current_base_ = initial_ns();
    attempts_ = 0;
  }

  std::uint64_t attempts() const { return attempts_; }
  const Options& options() const { return options_; }

 private:
  double initial_ns() const { return static_cast<double>(options_.initial.count()); }
  double max_ns() const { return static_cast<double>(options_.max.count()); }

  Options options_;
  RandomSource random_;
  double current_base_ = 0.0;
  std::uint64_t attempts_ = 0;
};

}  // namespace ddprun
