// StoreServer bounds over loopback sockets: buffers grow only with received bytes, reply caps,
// backpressure, frame and idle timeouts, per-peer and descriptor-clamped connection caps.
// Timeouts are configured short; every wait is for a reply or a close, never a sleep.
#include <sys/resource.h>

#include <catch2/catch.hpp>

#include <chrono>
#include <memory>
#include <thread>
#include <vector>

#include "helpers.hpp"

using namespace ddprun::rendezvous;
using test::hex;
using test::RawClient;
using test::ServerThread;

namespace {

void hello(RawClient& c) {
  c.send(test::validate_bytes + hex("0d") + test::u32(1));
  REQUIRE(c.recv(4) == test::u32(1));
}

bool pings(RawClient& c, std::uint32_t nonce = 99) {
  c.send(hex("0d") + test::u32(nonce));
  return c.recv(4) == test::u32(nonce);
}

}  // namespace

TEST_CASE("a declared value length is not allocated before its bytes arrive", "[server][bounds]") {
  ServerThread server;
  std::vector<std::unique_ptr<RawClient>> attackers;
  for (int i = 0; i < 20; ++i) {
    attackers.push_back(std::make_unique<RawClient>(server.port()));
    hello(*attackers.back());  // the server has read this connection's bytes so far
    attackers.back()->send(hex("01") + test::str("k") + test::u64((std::uint64_t{64} << 20) - 1));
  }
  RawClient legit(server.port());
  hello(legit);
  // 20 headers declaring 64 MiB each: with declared-length allocation this would be 1.25 GiB.
  CHECK(server.stats().buffered_bytes < std::size_t{4} << 20);
  // Bytes that do arrive are buffered (up to about twice what arrived), and the request completes.
  const std::string chunk(std::size_t{1} << 20, 'x');
  for (int i = 0; i < 8; ++i) attackers[0]->send(chunk);
  CHECK(server.stats().buffered_bytes < std::size_t{40} << 20);
  CHECK(pings(legit));
}

TEST_CASE("a reply over --max-queued-reply-bytes closes only the asking connection, unbuilt", "[server][bounds]") {
  StoreServerOptions opts;
  opts.limits.max_queued_reply_bytes = 256 * 1024;
  ServerThread server(opts);
  RawClient legit(server.port());
  hello(legit);
  legit.send(hex("01") + test::str("big") + test::str(std::string(100 * 1024, 'v')));
  legit.send(hex("03") + test::str("big"));
  CHECK(legit.recv(8 + 100 * 1024).size() == 8 + 100 * 1024);
  RawClient asker(server.port());
  hello(asker);
  std::string multi = hex("0a") + test::u64(3);
  for (int i = 0; i < 3; ++i) multi += test::str("big");
  asker.send(multi);
  CHECK(asker.closed_by_peer());
  CHECK(server.stats().connections_rejected == 1);
  CHECK(pings(legit));
}

TEST_CASE("watch events a slow reader never takes close it at its reply cap", "[server][bounds]") {
  StoreServerOptions opts;
  opts.limits.max_queued_reply_bytes = 512 * 1024;
  ServerThread server(opts);
  RawClient watcher(server.port());
  watcher.send(hex("07") + test::str("/w"));  // legacy WATCH_KEY
  REQUIRE(watcher.recv(1) == hex("03"));
  RawClient writer(server.port());
  const std::string value(64 * 1024, 'v');
  bool closed = false;
  // Each SET queues ~128 KiB of event for the watcher; kernel buffers absorb a few MiB first.
  for (int i = 0; i < 400 && !closed; ++i) {
    writer.send(hex("00") + test::str("/w") + test::str(value) + hex("06"));  // legacy SET + GETNUMKEYS
    REQUIRE(writer.recv(8) == test::i64(1));
    closed = server.stats().connections == 1;
  }
  CHECK(closed);
  CHECK(server.stats().connections_rejected == 1);
}

TEST_CASE("the global buffer cap closes the largest backlog first", "[server][bounds]") {
  StoreServerOptions opts;
  opts.limits.max_buffered_bytes = 8 << 20;
  ServerThread server(opts);
  std::vector<std::unique_ptr<RawClient>> watchers;
  for (int i = 0; i < 4; ++i) {
    watchers.push_back(std::make_unique<RawClient>(server.port()));
    watchers.back()->send(hex("07") + test::str("/w"));
    REQUIRE(watchers.back()->recv(1) == hex("03"));
  }
  RawClient writer(server.port());
  const std::string value(256 * 1024, 'v');
  for (int i = 0; i < 200 && server.stats().connections > 1; ++i) {
    writer.send(hex("00") + test::str("/w") + test::str(value) + hex("06"));
    REQUIRE(writer.recv(8) == test::i64(1));
    REQUIRE(server.stats().buffered_bytes <= opts.limits.max_buffered_bytes);
  }
  CHECK(server.stats().connections == 1);  // every watcher shed, the writer kept
}

TEST_CASE("backpressure: buffered requests wait for the client to drain its replies", "[server][bounds]") {
  StoreServerOptions opts;
  opts.limits.max_queued_reply_bytes = 1 << 20;  // pause threshold 512 KiB
  ServerThread server(opts);
  RawClient c(server.port());
  hello(c);
  const std::string value(64 * 1024, 'v');
  c.send(hex("01") + test::str("/big") + test::str(value));
  constexpr int n = 400;  // 25 MiB of replies against a 1 MiB cap: must pause, not close
  std::string batch;
  for (int i = 0; i < n; ++i) batch += hex("03") + test::str("/big");
  std::thread sender([&] { c.send(batch); });
  std::size_t peak = 0;
  const std::string expected = test::str(value);
  std::size_t good = 0;
  for (int i = 0; i < n; ++i) {
    good += c.recv(expected.size(), std::chrono::seconds(30)) == expected ? 1u : 0u;
    if (i % 50 == 0) peak = std::max(peak, server.stats().buffered_bytes);
  }
  sender.join();
  CHECK(good == static_cast<std::size_t>(n));
  CHECK(peak < std::size_t{4} << 20);
  CHECK(server.stats().connections_rejected == 0);
}

TEST_CASE("a client that reads none of its replies is closed after the reply stall timeout; a slow one is not",
          "[server][bounds]") {
  StoreServerOptions opts;
  opts.limits.max_queued_reply_bytes = 1 << 20;                // pause threshold 512 KiB
  opts.reply_stall_timeout = std::chrono::milliseconds(1000);  // 20 times the slow reader's pace
  ServerThread server(opts);
  RawClient setter(server.port());
  hello(setter);
  const std::string value(256 * 1024, 'v');
  setter.send(hex("01") + test::str("/big") + test::str(value));
  REQUIRE(pings(setter));
  // 96 GETs: 24 MiB of replies, more than the kernel's buffers on both ends hold.
  constexpr std::size_t n = 96;
  std::string batch;
  for (std::size_t i = 0; i < n; ++i) batch += hex("03") + test::str("/big");
  RawClient slow(server.port());
  hello(slow);
  slow.send(batch);
  // The slow client reads a reply every 50 ms (about 5 s for all against a 1 s timeout): its
  // replies keep moving, if slowly, and it gets every one.
  const std::string expected = test::str(value);
  std::size_t good = 0;
  std::thread reader([&] {
    try {
      for (std::size_t i = 0; i < n; ++i) {
        good += slow.recv(expected.size()) == expected ? 1u : 0u;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the slowness under test, not a wait
      }
    } catch (const std::exception&) {
    }
  });
  RawClient stopped(server.port());
  hello(stopped);
  stopped.send(batch);
  CHECK(stopped.hung_up_within(std::chrono::seconds(10)));
  reader.join();
  CHECK(good == n);
  const StoreStats stats = server.stats();
  CHECK(stats.refused[static_cast<std::size_t>(RefusedReason::timeout)] == 1);
  CHECK(stats.connections == 2);  // the setter and the slow reader
  CHECK(pings(setter));
}

TEST_CASE("frame timeout closes a half-sent request; idle timeout spares waiters and watchers", "[server][bounds]") {
  StoreServerOptions opts;
  opts.frame_timeout = std::chrono::milliseconds(100);
  opts.idle_timeout = std::chrono::milliseconds(150);
  ServerThread server(opts);
  RawClient waiter(server.port());
  hello(waiter);
  waiter.send(hex("06") + test::u64(1) + test::str("/go"));
  RawClient watcher(server.port());
  watcher.send(hex("07") + test::str("/go"));
  REQUIRE(watcher.recv(1) == hex("03"));
  RawClient half(server.port());
  half.send(test::validate_bytes + hex("01") + test::u64(4));
  RawClient idle(server.port());
  hello(idle);
  CHECK(half.closed_by_peer());
  CHECK(idle.closed_by_peer());
  RawClient setter(server.port());
  hello(setter);
  setter.send(hex("01") + test::str("/go") + test::str("1"));
  CHECK(waiter.recv(1) == test::u8(0));  // silent for longer than both timeouts, still served
  CHECK(watcher.recv(1) == hex("01"));
  CHECK(server.stats().connections_rejected >= 2);
}

TEST_CASE("per-peer connection cap", "[server][bounds]") {
  StoreServerOptions opts;
  opts.limits.max_connections_per_peer = 2;
  ServerThread server(opts);
  RawClient a(server.port());
  RawClient b(server.port());
  hello(a);
  hello(b);
  RawClient c(server.port());
  CHECK(c.closed_by_peer());
  CHECK(pings(a));
  CHECK(server.stats().connections_rejected == 1);
}

TEST_CASE("--max-connections is clamped below the open-files limit", "[server][bounds]") {
  rlimit rl{};
  REQUIRE(getrlimit(RLIMIT_NOFILE, &rl) == 0);
  StoreServerOptions opts;
  opts.limits.max_connections = std::size_t{1} << 40;
  ServerThread server(opts);
  const std::size_t effective = server.stats().max_connections;
  if (rl.rlim_cur != RLIM_INFINITY) {
    CHECK(effective < rl.rlim_cur);
    CHECK(effective + 32 <= rl.rlim_cur);
  }
  StoreServerOptions small;
  small.limits.max_connections = 5;
  ServerThread server2(small);
  CHECK(server2.stats().max_connections == 5);
}

TEST_CASE("idle connections that once read a large value do not get others closed for the budget", "[server][bounds]") {
  // Each connection keeps up to 1 MiB per buffer for its next reply. Before, 8 idle readers of
  // a 512 KiB value held 8 MiB of a 4 MiB --max-buffered-bytes, and the next client with a
  // reply in flight was closed as "the largest unread backlog" (its 4-byte PING reply). Over
  // the budget, what idle connections keep is given back first.
  StoreServerOptions opts;
  opts.limits.max_buffered_bytes = std::size_t{4} << 20;
  ServerThread server(opts);
  const std::string value(512 * 1024, 'v');
  RawClient setter(server.port());
  hello(setter);
  setter.send(hex("01") + test::str("big") + test::str(value));
  REQUIRE(pings(setter));
  std::vector<std::unique_ptr<RawClient>> idle;
  for (int i = 0; i < 8; ++i) {
    idle.push_back(std::make_unique<RawClient>(server.port()));
    hello(*idle.back());
    for (int j = 0; j < 2; ++j) {
      idle.back()->send(hex("03") + test::str("big"));
      REQUIRE(idle.back()->recv(8 + value.size()).size() == 8 + value.size());
    }
  }
  RawClient next(server.port());
  hello(next);
  for (std::uint32_t n = 0; n < 4; ++n) CHECK(pings(next, n));
  for (auto& c : idle) CHECK(pings(*c));
  CHECK(server.stats().connections_rejected == 0);
  CHECK(server.stats().buffered_bytes <= opts.limits.max_buffered_bytes);
}

TEST_CASE("the keys of a many-key request being received count against --max-buffered-bytes", "[server][bounds]") {
  // A WAIT of 65,536 keys, 65,535 of them empty, sent but for the last key's 100 bytes: 512 KiB
  // of request, and the decoder keeps a 16-byte span for each key read so far (so that the rest
  // is read once, not again), 1 MiB more. Before, only the request's bytes counted: ~500 such
  // connections held 2-3 times --max-buffered-bytes.
  ServerThread server;
  RawClient a(server.port());
  hello(a);
  constexpr std::uint64_t n = 65536;
  std::string request = hex("06") + test::u64(n);
  request.reserve(request.size() + n * 8);
  for (std::uint64_t i = 0; i + 1 < n; ++i) request += test::u64(0);
  request += test::u64(100);
  a.send(request);
  constexpr std::size_t spans = (n - 1) * 16;
  const std::size_t expected = (n - 1) * 8 + spans;
  // The server reads the request in pieces; wait (bounded) until it has read all of it.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  std::size_t held = 0;
  while ((held = server.stats().buffered_bytes) < expected && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::yield();
  }
  CHECK(held >= expected);
  // The last key's bytes complete it: a WAIT on keys that are not there, answered once they are.
  const std::string last(100, 'k');
  a.send(last);
  RawClient b(server.port());
  hello(b);
  b.send(hex("01") + test::str("") + test::str("v"));  // SET "" = "v"
  b.send(hex("01") + test::str(last) + test::str("v"));
  CHECK(a.recv(1) == test::u8(0));  // STOP_WAITING
}
