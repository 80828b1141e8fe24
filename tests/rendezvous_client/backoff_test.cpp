// Backoff: pure arithmetic, driven by a fixed random source.
#include <catch2/catch.hpp>

#include <chrono>
#include <vector>

#include "ddprun/common/backoff.hpp"

using namespace std::chrono_literals;
using ddprun::Backoff;

namespace {
Backoff make(double jitter, double u, std::chrono::nanoseconds max = 100ms) {
  return Backoff({10ms, max, 2.0, jitter}, [u] { return u; });
}
}  // namespace

TEST_CASE("Backoff without jitter doubles up to the cap", "[backoff]") {
  Backoff b = make(0.0, 0.3, 100ms);
  std::vector<std::chrono::nanoseconds> got;
  for (int i = 0; i < 6; ++i) got.push_back(b.next_delay());
  CHECK(got == std::vector<std::chrono::nanoseconds>{10ms, 20ms, 40ms, 80ms, 100ms, 100ms});
  CHECK(b.attempts() == 6);
}

TEST_CASE("Backoff jitter spans [1-j, 1+j] of the base delay", "[backoff]") {
  CHECK(make(0.5, 0.0).next_delay() == 5ms);   // lowest factor 0.5
  CHECK(make(0.5, 0.5).next_delay() == 10ms);  // middle: the base delay itself
  // Highest factor approaches 1.5; u is in [0,1) so use 0.75 -> factor 1.25.
  CHECK(make(0.5, 0.75).next_delay() == std::chrono::microseconds(12500));
}

TEST_CASE("Backoff never exceeds max, even with jitter", "[backoff]") {
  Backoff b = make(1.0, 0.999, 100ms);
  for (int i = 0; i < 20; ++i) CHECK(b.next_delay() <= 100ms);
}

TEST_CASE("Backoff reset starts over", "[backoff]") {
  Backoff b = make(0.0, 0.0);
  b.next_delay();
  b.next_delay();
  CHECK(b.next_delay() == 40ms);
  b.reset();
  CHECK(b.attempts() == 0);
  CHECK(b.next_delay() == 10ms);
}

TEST_CASE("Backoff sanitises bad options", "[backoff]") {
  Backoff b({-5ms, -10ms, 0.5, 7.0}, [] { return 0.5; });
  CHECK(b.options().jitter == 1.0);
  CHECK(b.options().multiplier == 1.0);
  CHECK(b.next_delay() == 0ms);
}

TEST_CASE("Backoff default random source stays in range", "[backoff]") {
  Backoff b({10ms, 10ms, 2.0, 0.5});
  for (int i = 0; i < 100; ++i) {
    const auto d = b.next_delay();
    CHECK(d >= 5ms);
    CHECK(d <= 10ms);  // clamped to max
  }
}
