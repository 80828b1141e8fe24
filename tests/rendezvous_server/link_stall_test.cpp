// LinkStallClock: when a relay link's writes last moved (no socket: fd -1, so the peer's
// acknowledgements never count here; the link stall ctest covers them with real sockets).
#include <catch2/catch.hpp>

#include "ddprun/rendezvous/link_stall.hpp"

using namespace ddprun::rendezvous;
using namespace std::chrono_literals;

TEST_CASE("the link stall clock measures from the last move, not from the write's start", "[link_stall]") {
  const std::chrono::milliseconds timeout = 1000ms;
  CHECK(LinkStallClock::check_period(timeout) == 250ms);
  CHECK(LinkStallClock::check_period(8ms) == 5ms);
  CHECK(LinkStallClock::check_period(600s) == 1s);
  LinkStallClock c;
  const auto t0 = LinkStallClock::Clock::time_point{} + 1h;
  c.write_started(t0);
  CHECK(c.quiet(-1, true, t0 + 250ms, timeout) == 250ms);
  // The socket took part of the buffer: the clock starts again there; the same count again is no move.
  c.wrote(4096, t0 + 400ms);
  c.wrote(4096, t0 + 450ms);
  CHECK(c.written() == 4096);
  CHECK(c.quiet(-1, true, t0 + 500ms, timeout) == 100ms);
  CHECK(c.quiet(-1, true, t0 + 750ms, timeout) == 350ms);
  // Nothing in flight: never quiet, however long.
  CHECK(c.quiet(-1, false, t0 + 1000ms, timeout) == 0ms);
  // Bytes from the peer (a relay's root) count as a move.
  c.moved(t0 + 1100ms);
  CHECK(c.quiet(-1, true, t0 + 1250ms, timeout) == 150ms);
  CHECK(c.quiet(-1, true, t0 + 1500ms, timeout) == 400ms);
  // A check more than half the timeout late: this process was stopped, the clock restarts.
  CHECK(c.quiet(-1, true, t0 + 5000ms, timeout) == 0ms);
  CHECK(c.quiet(-1, true, t0 + 5250ms, timeout) == 250ms);
  // On time, the checks see it pass the timeout.
  for (auto t = t0 + 5500ms; t <= t0 + 6250ms; t += 250ms) (void)c.quiet(-1, true, t, timeout);
  CHECK(c.quiet(-1, true, t0 + 6500ms, timeout) == 1500ms);
  // A new buffer's write starts the count of its bytes again.
  c.write_started(t0 + 6600ms);
  CHECK(c.written() == 0);
}
