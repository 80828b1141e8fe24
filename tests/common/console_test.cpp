// The console's writer threads (console.hpp): a destination that does not read holds up
// neither the caller nor another destination, and the pumps' back-pressure signals work.
#include "ddprun/common/console.hpp"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <catch2/catch.hpp>
#include <chrono>
#include <string>

namespace console = ddprun::console;
using namespace std::chrono_literals;

namespace {

struct Pipe {
  Pipe() { REQUIRE(::pipe2(fds, O_CLOEXEC) == 0); }
  ~Pipe() {
    ::close(fds[0]);
    ::close(fds[1]);
  }
  // Reads until `want` bytes came or `timeout` passed (poll-bounded, no sleeps).
  std::string read(std::size_t want, std::chrono::milliseconds timeout) const {
    std::string out;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    char buf[65536];
    while (out.size() < want) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) break;
      pollfd p{fds[0], POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      const ssize_t n = ::read(fds[0], buf, std::min(sizeof buf, want - out.size()));
      if (n <= 0) break;
      out.append(buf, static_cast<std::size_t>(n));
    }
    return out;
  }
  int fds[2];
};

}  // namespace

TEST_CASE("a destination that does not read holds up neither the caller nor another one", "[console]") {
  Pipe stalled;
  Pipe other;
  // 2 MiB into a pipe nobody reads (it holds 64 KiB): queued, the call returns at once.
  const std::string piece(64 * 1024, 'x');
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 32; ++i) console::write(stalled.fds[1], piece);
  CHECK(std::chrono::steady_clock::now() - t0 < 2s);
  CHECK(console::over(stalled.fds[1]));
  CHECK(console::queued(stalled.fds[1]) > console::kConsoleHighWater);

  // Another pipe is another queue: its lines arrive, in order, prefixed.
  console::write_prefixed(other.fds[1], "[0]: ", "a\nb\nc", false);
  CHECK(other.read(21, 10s) == "[0]: a\n[0]: b\n[0]: c\n");
  CHECK_FALSE(console::over(other.fds[1]));

  // A pump waiting for room resumes once the reader has taken enough.
  boost::asio::io_context io;
  bool resumed = false;
  console::when_room(stalled.fds[1], io, [&] { resumed = true; });
  io.run_for(50ms);
  CHECK_FALSE(resumed);
  io.restart();  // run_for found no work and stopped it
  const std::string got = stalled.read(32 * piece.size(), 30s);
  CHECK(got.size() == 32 * piece.size());
  CHECK(got.find_first_not_of('x') == std::string::npos);
  // The console's writer posts the resume once its queue is below the low-water mark, which can
  // be a moment after the reader took the last byte: wait for that post (the guard keeps
  // run_one_for waiting instead of returning at once on an io_context without work).
  auto guard = boost::asio::make_work_guard(io);
  for (int i = 0; i < 100 && !resumed; ++i) io.run_one_for(100ms);
  guard.reset();
  CHECK(resumed);
  CHECK_FALSE(console::over(stalled.fds[1]));
  console::drain();
  CHECK(console::queued(stalled.fds[1]) == 0);
}

TEST_CASE("a cancelled wait for room is never posted", "[console]") {
  Pipe stalled;
  const std::string piece(64 * 1024, 'y');
  for (int i = 0; i < 24; ++i) console::write(stalled.fds[1], piece);
  REQUIRE(console::over(stalled.fds[1]));
  boost::asio::io_context io;
  bool resumed = false;
  console::cancel(console::when_room(stalled.fds[1], io, [&] { resumed = true; }));
  CHECK(stalled.read(24 * piece.size(), 30s).size() == 24 * piece.size());
  console::drain();
  io.run_for(50ms);
  CHECK_FALSE(resumed);
}

TEST_CASE("paced pieces are not held to the hard cap; others past it are dropped", "[console]") {
  // A pump stops reading at over(): what it queued is bounded by that, and must not be lost.
  Pipe stalled;
  const std::string piece(1 << 20, 'p');
  const std::size_t paced_pieces = console::kConsoleHardCap / piece.size() + 4;  // 20 MiB
  for (std::size_t i = 0; i < paced_pieces; ++i) console::write_prefixed(stalled.fds[1], "", piece, true, true);
  // Past the cap, a piece that is not paced (a log line) is dropped, not queued.
  const std::size_t before = console::queued(stalled.fds[1]);
  console::write(stalled.fds[1], "dropped\n");
  CHECK(console::queued(stalled.fds[1]) == before);
  const std::string got = stalled.read(paced_pieces * piece.size(), 60s);
  CHECK(got.size() == paced_pieces * piece.size());
  CHECK(got.find_first_not_of('p') == std::string::npos);
  console::drain();
}
