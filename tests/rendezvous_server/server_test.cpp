// StoreServer over real loopback sockets, driven with hand-written bytes.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <future>
#include <thread>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "helpers.hpp"

using namespace ddprun::rendezvous;
using test::hex;
using test::RawClient;
using test::ServerThread;

namespace {

const std::string stop_waiting = test::u8(0);

std::string modern_hello(std::uint32_t nonce = 0x1234) { return test::validate_bytes + hex("0d") + test::u32(nonce); }

void handshake(RawClient& c, std::uint32_t nonce = 0x1234) {
  c.send(modern_hello(nonce));
  REQUIRE(c.recv(4) == test::u32(nonce));
}

}  // namespace

TEST_CASE("replays the captured torch 1.13 session byte for byte", "[server]") {
  ServerThread server;
  std::ifstream in(std::string(DDPRUN_TEST_DATA_DIR) + "/raw_bytes_basic_ops.txt");
  REQUIRE(in);
  RawClient main(server.port());
  RawClient callback(server.port());  // 1.13's idle callback connection: kept open, no bytes
  {
    // In the capture the master's own client had already counted itself in "init/".
    RawClient master(server.port());
    master.send(hex("03") + test::str("init/") + test::i64(1));
    REQUIRE(master.recv(8) == test::i64(1));
  }
  std::string line;
  std::size_t exchanged = 0;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string conn, dir, len_tag, hexbytes;
    fields >> conn >> dir;
    if (conn != "1" || (dir != "c2s" && dir != "s2c")) continue;
    // "len= 22 0305..." or "len=22 0305..."
    std::string token;
    fields >> token;
    if (token == "len=") fields >> token;
    fields >> hexbytes;
    const std::string bytes = hex(hexbytes);
    if (dir == "c2s") {
      main.send(bytes);
    } else {
      INFO("reply #" << exchanged);
      CHECK(ddprun::to_hex(main.recv(bytes.size())) == ddprun::to_hex(bytes));
      ++exchanged;
    }
  }
  CHECK(exchanged == 17);
  // nothing extra was sent, and the idle callback connection is still served
  callback.send(hex("06"));
  CHECK(callback.recv(8) == test::i64(4));  // init/ /cnt /cas1 /after_timeout
}

TEST_CASE("modern client: VALIDATE, PING and every op", "[server]") {
  ServerThread server;
  RawClient c(server.port());
  handshake(c, 0xcafe);
  c.send(hex("04") + test::str("init/") + test::i64(1));  // ADD
  CHECK(c.recv(8) == test::i64(1));
  c.send(hex("01") + test::str("/k1") + test::str("v1"));  // SET
  c.send(hex("06") + test::u64(1) + test::str("/k1"));     // WAIT
  CHECK(c.recv(1) == stop_waiting);
  c.send(hex("03") + test::str("/k1"));  // GET
  CHECK(c.recv(10) == test::str("v1"));
  c.send(hex("03") + test::str("/missing"));
  CHECK(c.recv(8) == test::str(""));
  c.send(hex("02") + test::str("/cas") + test::str("") + test::str("new"));  // COMPARE_SET
  CHECK(c.recv(11) == test::str("new"));
  c.send(hex("05") + test::u64(2) + test::str("/k1") + test::str("/nope"));  // CHECK
  CHECK(c.recv(1) == hex("01"));
  c.send(hex("07"));  // GETNUMKEYS
  CHECK(c.recv(8) == test::i64(3));
  c.send(hex("09") + test::str("/k1") + test::str("+x"));                   // APPEND
  c.send(hex("0a") + test::u64(2) + test::str("/k1") + test::str("/cas"));  // MULTI_GET
  CHECK(c.recv(8 + 4 + 8 + 3) == test::str("v1+x") + test::str("new"));
  c.send(hex("0b") + test::u64(2) + test::str("/m1") + test::str("a") + test::str("/m2") + test::str("b"));
  c.send(hex("0e") + test::str("/q") + test::str("item"));  // QUEUE_PUSH
  c.send(hex("10") + test::str("/q"));                      // QUEUE_LEN
  CHECK(c.recv(8) == test::i64(1));
  c.send(hex("0f") + test::str("/q"));  // QUEUE_POP
  CHECK(c.recv(8 + 8 + 4) == test::i64(1) + test::str("item"));
  c.send(hex("08") + test::str("/m2"));  // DELETE_KEY
  CHECK(c.recv(8) == test::i64(1));
  c.send(hex("11"));  // LIST_KEYS: init/ /k1 /cas /m1
  auto count = c.recv(8);
  CHECK(count == test::i64(4));
  c.recv(4 * 8 + 5 + 3 + 4 + 3);
  c.send(hex("12") + test::str("/bar") + test::i64(1));  // BARRIER of one
  CHECK(c.recv(1) == stop_waiting);
  c.send(hex("0c"));  // CANCEL_WAIT with nothing pending
  CHECK(c.recv(1) == hex("01"));
  c.send(hex("0d") + test::u32(7));
  CHECK(c.recv(4) == test::u32(7));
  CHECK(server.stats().requests >= 20);
}

TEST_CASE("requests split at every byte and pipelined requests are all served", "[server]") {
  ServerThread server;
  RawClient c(server.port());
  std::string script = modern_hello(1) + hex("01") + test::str("/k") + test::str("v") + hex("03") + test::str("/k") +
                       hex("04") + test::str("/n") + test::i64(41);
  for (char ch : script) c.send(std::string(1, ch));  // one byte per send
  CHECK(c.recv(4 + 9 + 8) == test::u32(1) + test::str("v") + test::i64(41));
  std::string pipelined;
  for (int i = 0; i < 100; ++i) pipelined += hex("04") + test::str("/n") + test::i64(1);
  c.send(pipelined);
  auto replies = c.recv(100 * 8);
  CHECK(replies.substr(99 * 8) == test::i64(141));
}

TEST_CASE("a WAIT is woken by another connection's SET; CANCEL_WAIT ordering on the wire", "[server]") {
  ServerThread server;
  RawClient waiter(server.port());
  RawClient writer(server.port());
  handshake(waiter);
  handshake(writer);
  waiter.send(hex("06") + test::u64(1) + test::str("/late"));
  writer.send(hex("07"));
  CHECK(writer.recv(8) == test::i64(0));  // the WAIT is registered before this reply
  CHECK(server.stats().pending_waits == 1);
  writer.send(hex("01") + test::str("/late") + test::str("x"));
  CHECK(waiter.recv(1) == stop_waiting);

  // WAIT answered, then CANCEL_WAIT: STOP_WAITING (already sent) precedes WAIT_CANCELED
  waiter.send(hex("06") + test::u64(1) + test::str("/late2"));
  writer.send(hex("01") + test::str("/late2") + test::str("x") + hex("07"));
  writer.recv(8);
  waiter.send(hex("0c"));
  CHECK(waiter.recv(2) == hex("00 01"));

  // WAIT cancelled while pending: only WAIT_CANCELED, and no stray byte later
  waiter.send(hex("06") + test::u64(1) + test::str("/never"));
  waiter.send(hex("0c"));
  CHECK(waiter.recv(1) == hex("01"));
  writer.send(hex("01") + test::str("/never") + test::str("x") + hex("07"));
  CHECK(writer.recv(8) == test::i64(3));  // the SET has been applied
  waiter.send(hex("07"));
  CHECK(waiter.recv(8) == test::i64(3));  // the very next byte is the GETNUMKEYS reply
}

TEST_CASE("a client stalled mid-message does not stall anyone else", "[server]") {
  ServerThread server;
  RawClient stalled(server.port());
  RawClient other(server.port());
  stalled.send(test::validate_bytes.substr(0, 3));  // half a VALIDATE
  RawClient stalled2(server.port());
  stalled2.send(hex("00") + test::u64(3).substr(0, 4));  // half a legacy SET header
  handshake(other);
  other.send(hex("04") + test::str("/n") + test::i64(5));
  CHECK(other.recv(8) == test::i64(5));
  // the stalled clients resume later and are served normally
  stalled.send(test::validate_bytes.substr(3) + hex("0d") + test::u32(9));
  CHECK(stalled.recv(4) == test::u32(9));
  stalled2.send(test::u64(3).substr(4) + "/ab" + test::str("v") + hex("02") + test::str("/ab"));
  CHECK(stalled2.recv(9) == test::str("v"));
}

TEST_CASE("garbage closes only that connection", "[server]") {
  ServerThread server;
  RawClient good(server.port());
  handshake(good);
  SECTION("unknown first byte") {
    RawClient bad(server.port());
    bad.send(hex("2a 2a 2a"));
    CHECK(bad.closed_by_peer());
  }
  SECTION("second VALIDATE") {
    RawClient bad(server.port());
    handshake(bad);
    bad.send(test::validate_bytes);
    CHECK(bad.closed_by_peer());
  }
  SECTION("key length over the limit, before its body") {
    RawClient bad(server.port());
    handshake(bad);
    bad.send(hex("01") + test::u64(std::uint64_t{1} << 40));
    CHECK(bad.closed_by_peer());
  }
  SECTION("ADD on a non-numeric value") {
    RawClient bad(server.port());
    handshake(bad);
    bad.send(hex("01") + test::str("/s") + test::str("abc") + hex("04") + test::str("/s") + test::i64(1));
    CHECK(bad.closed_by_peer());
    good.send(hex("03") + test::str("/s"));
    CHECK(good.recv(11) == test::str("abc"));
  }
  SECTION("extension opcode without an extension") {
    RawClient bad(server.port());
    bad.send(hex("40 00"));
    CHECK(bad.closed_by_peer());
  }
  good.send(hex("0d") + test::u32(77));
  CHECK(good.recv(4) == test::u32(77));
  CHECK(server.stats().connections_rejected == 1);
}

TEST_CASE("connection limit: extra connections are accepted and closed", "[server]") {
  StoreServerOptions opts;
  opts.limits.max_connections = 2;
  ServerThread server(opts);
  RawClient a(server.port());
  RawClient b(server.port());
  handshake(a);
  handshake(b);  // both are registered now
  RawClient c(server.port());
  CHECK(c.closed_by_peer());
  CHECK(server.stats().connections_rejected == 1);
  a.send(hex("07"));
  CHECK(a.recv(8) == test::i64(0));
}

TEST_CASE("modern-only server closes legacy openings", "[server]") {
  StoreServerOptions opts;
  opts.accept_legacy = false;
  ServerThread server(opts);
  RawClient legacy(server.port());
  legacy.send(hex("03") + test::str("init/") + test::i64(1));
  CHECK(legacy.closed_by_peer());
  RawClient modern(server.port());
  handshake(modern);
}

TEST_CASE("reset() clears keys and closes clients", "[server]") {
  ServerThread server;
  RawClient c(server.port());
  handshake(c);
  c.send(hex("01") + test::str("/k") + test::str("v") + hex("07"));
  CHECK(c.recv(8) == test::i64(1));
  server.reset();
  CHECK(c.closed_by_peer());
  RawClient d(server.port());
  handshake(d);
  d.send(hex("07") + hex("03") + test::str("/k"));
  CHECK(d.recv(16) == test::i64(0) + test::str(""));
  auto st = server.stats();
  CHECK(st.keys == 0);
  CHECK(st.connections == 1);
}

TEST_CASE("idle connections are kept while others work", "[server]") {
  ServerThread server;
  RawClient idle(server.port());
  RawClient busy(server.port());
  for (int i = 0; i < 200; ++i) {
    busy.send(hex("03") + test::str("/n") + test::i64(1));  // legacy ADD
    REQUIRE(busy.recv(8) == test::i64(i + 1));
  }
  CHECK_FALSE(idle.readable_within(std::chrono::milliseconds(0)));
  idle.send(hex("02") + test::str("/n"));  // legacy GET
  CHECK(idle.recv(11) == test::str("200"));
  CHECK(server.stats().connections == 2);
}

TEST_CASE("legacy WATCH_KEY over sockets", "[server]") {
  ServerThread server;
  RawClient watcher(server.port());
  RawClient writer(server.port());
  watcher.send(hex("07") + test::str("/w"));
  CHECK(watcher.recv(1) == hex("03"));
  writer.send(hex("00") + test::str("/w") + test::str("first"));
  CHECK(watcher.recv(1 + 10 + 8 + 13) == hex("01") + test::str("/w") + test::str("") + test::str("first"));
}

TEST_CASE("many clients: connect, ADD, WAIT barrier", "[server]") {
  ServerThread server;
  constexpr int n = 200;
  std::vector<std::unique_ptr<RawClient>> clients;
  for (int i = 0; i < n; ++i) {
    clients.push_back(std::make_unique<RawClient>(server.port()));
    clients.back()->send(modern_hello() + hex("04") + test::str("/cnt") + test::i64(1) + hex("06") + test::u64(1) +
                         test::str("/go"));
  }
  std::int64_t max_seen = 0;
  for (auto& c : clients) {
    REQUIRE(c->recv(4) == test::u32(0x1234));
    const auto v = c->recv(8);
    std::int64_t x = 0;
    std::memcpy(&x, v.data(), 8);
    max_seen = std::max(max_seen, x);
  }
  CHECK(max_seen == n);
  clients[0]->send(hex("01") + test::str("/go") + test::str("1"));
  for (auto& c : clients) CHECK(c->recv(1) == stop_waiting);
}

TEST_CASE("a client that does not read its replies is paused, then served completely", "[server]") {
  ServerThread server;
  RawClient c(server.port());
  handshake(c);
  const std::string value(4096, 'v');
  c.send(hex("01") + test::str("/big") + test::str(value));
  constexpr int n = 6000;  // ~24 MiB of replies, over the server's 16 MiB output cap
  std::string request = hex("03") + test::str("/big");
  std::thread sender([&] {
    std::string batch;
    for (int i = 0; i < n; ++i) batch += request;
    c.send(batch);
  });
  const std::string expected = test::str(value);
  std::size_t good = 0;
  for (int i = 0; i < n; ++i) good += c.recv(expected.size(), std::chrono::seconds(30)) == expected ? 1u : 0u;
  sender.join();
  CHECK(good == static_cast<std::size_t>(n));
  c.send(hex("07"));
  CHECK(c.recv(8) == test::i64(1));
}

namespace {

// A toy extension: 0x40 <u8 n> <n bytes> -> replies the bytes reversed; 0x41 -> error.
class EchoExtension : public StoreExtension {
 public:
  DecodeResult on_frame(ConnectionId conn, std::string_view buffer, StoreState& state, Outbox& outbox) override {
    DecodeResult r;
    if (static_cast<unsigned char>(buffer[0]) != 0x40) {
      r.status = DecodeStatus::error;
      r.reason = "toy extension knows only 0x40";
      return r;
    }
    if (buffer.size() < 2) {
      r.min_total = 2;
      return r;
    }
    const auto n = static_cast<unsigned char>(buffer[1]);
    if (buffer.size() < 2u + n) {
      r.min_total = 2u + n;
      return r;
    }
    std::string body(buffer.substr(2, n));
    std::reverse(body.begin(), body.end());
    outbox.buffer(conn) += body;
    ++frames;
    keys_seen = state.num_keys();
    r.status = DecodeStatus::ok;
    r.consumed = 2u + n;
    return r;
  }
  void on_disconnect(ConnectionId) override { ++disconnects; }
  int frames = 0;
  int disconnects = 0;
  std::size_t keys_seen = 0;
};

}  // namespace

TEST_CASE("extension frames reach the installed StoreExtension, mixed with torch ops", "[server]") {
  auto ext = std::make_shared<EchoExtension>();
  StoreServerOptions opts;
  opts.extension = ext;
  {
    ServerThread server(opts);
    RawClient c(server.port());
    c.send(hex("40 03") + "abc");  // an extension frame may open a connection
    CHECK(c.recv(3) == "cba");
    c.send(test::validate_bytes + hex("01") + test::str("/k") + test::str("v") + hex("40 02"));
    c.send("xy" + (hex("03") + test::str("/k")));  // split extension frame, then a GET
    CHECK(c.recv(2 + 9) == "yx" + test::str("v"));
    RawClient bad(server.port());
    bad.send(hex("41"));
    CHECK(bad.closed_by_peer());
    CHECK(server.on_io([&] { return ext->frames; }) == 2);
    CHECK(server.on_io([&] { return ext->keys_seen; }) == 1u);
  }
  CHECK(ext->disconnects == 2);
}

TEST_CASE("a request whose handling throws closes its connection, not the server", "[server]") {
  class Throwing final : public StoreExtension {
   public:
    DecodeResult on_frame(ConnectionId, std::string_view, StoreState&, Outbox&) override {
      throw std::length_error("a reply too large to frame");
    }
  };
  StoreServerOptions opts;
  opts.extension = std::make_shared<Throwing>();
  ServerThread server(opts);
  RawClient legit(server.port());
  handshake(legit);
  RawClient bad(server.port());
  bad.send(hex("40"));
  CHECK(bad.closed_by_peer());
  CHECK(server.stats().connections_rejected == 1);
  legit.send(hex("0d") + test::u32(7));
  CHECK(legit.recv(4) == test::u32(7));
}

TEST_CASE("an extension whose on_disconnect throws still lets the connection go", "[server]") {
  class ThrowsOnClose final : public StoreExtension {
   public:
    DecodeResult on_frame(ConnectionId, std::string_view, StoreState&, Outbox&) override {
      DecodeResult r;
      r.status = DecodeStatus::error;
      r.reason = "no extension frames";
      return r;
    }
    void on_disconnect(ConnectionId) override { throw std::bad_alloc(); }
  };
  StoreServerOptions opts;
  opts.extension = std::make_shared<ThrowsOnClose>();
  ServerThread server(opts);
  auto connections_become = [&](std::size_t n) {  // a condition, bounded, not a sleep
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (server.stats().connections != n && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
    return server.stats().connections == n;
  };
  {
    RawClient peer_closes(server.port());  // the peer's close
    handshake(peer_closes);
  }
  REQUIRE(connections_become(0));
  RawClient refused(server.port());  // the server's own close, for a bad frame
  refused.send(hex("40"));
  CHECK(refused.closed_by_peer());
  REQUIRE(connections_become(0));
  RawClient after(server.port());  // and it goes on serving
  handshake(after);
  after.send(hex("0d") + test::u32(9));
  CHECK(after.recv(4) == test::u32(9));
}

TEST_CASE("on_drained runs once the last connection has closed, and at once when none is open", "[server]") {
  ServerThread server;
  // Waits for the server to have seen the closes (a condition, not a time).
  auto wait_connections = [&](std::size_t n) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (server.stats().connections != n && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::yield();
    }
    return server.stats().connections == n;
  };
  std::atomic<int> calls{0};
  std::promise<void> drained;
  auto fired = drained.get_future();
  auto a = std::make_unique<RawClient>(server.port());
  auto b = std::make_unique<RawClient>(server.port());
  for (RawClient* c : {a.get(), b.get()}) {              // served, so accepted, before the callback exists
    c->send(hex("03") + test::str("k") + test::i64(1));  // legacy (1.13) ADD
    c->recv(8);
  }
  server.on_drained([&] {
    ++calls;
    drained.set_value();
  });
  a.reset();  // one of two: not drained yet
  REQUIRE(wait_connections(1));
  CHECK(calls == 0);
  b.reset();
  REQUIRE(fired.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
  CHECK(calls == 1);
  // Once only: a later connection and close do not run it again.
  auto c = std::make_unique<RawClient>(server.port());
  c->send(hex("03") + test::str("k") + test::i64(1));
  c->recv(8);
  c.reset();
  REQUIRE(wait_connections(0));
  CHECK(calls == 1);
  // Registered with nothing open: runs right away.
  std::promise<void> again;
  auto now = again.get_future();
  server.on_drained([&] { again.set_value(); });
  CHECK(now.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
}
