// StoreClient against ddprun's own StoreServer, run in-process on an io_context thread
// (port 0), in both protocol generations.
#include <catch2/catch.hpp>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <chrono>
#include <future>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "ddprun/common/error.hpp"
#include "ddprun/rendezvous/store_client.hpp"
#include "ddprun/rendezvous/store_server.hpp"

using namespace std::chrono_literals;
using ddprun::rendezvous::DetectedGeneration;
using ddprun::rendezvous::Generation;
using ddprun::rendezvous::StoreClient;
using ddprun::rendezvous::StoreClientOptions;
using ddprun::rendezvous::StoreServer;
using ddprun::rendezvous::StoreServerOptions;
using ddprun::rendezvous::StoreStats;

namespace {

// A StoreServer on its own io_context thread; every server call is posted to that thread.
class ServerThread {
 public:
  explicit ServerThread(const std::string& host = "127.0.0.1") : work_(io_.get_executor()) {
    StoreServerOptions o;
    o.host = host;
    o.port = 0;
    server_.emplace(io_, o);
    server_->start();
    port_ = server_->port();
    thread_ = std::thread([this] { io_.run(); });
  }
  ~ServerThread() {
    boost::asio::post(io_, [this] { server_->stop(); });
    work_.reset();
    io_.stop();
    thread_.join();
  }
  std::uint16_t port() const { return port_; }
  StoreStats stats() {
    std::promise<StoreStats> p;
    boost::asio::post(io_, [&] { p.set_value(server_->stats()); });
    return p.get_future().get();
  }
  // Readiness without sleeping: spin (yielding) on the server's own counter.
  void await_pending_waits(std::size_t n) {
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (stats().pending_waits < n) {
      REQUIRE(std::chrono::steady_clock::now() < deadline);
      std::this_thread::yield();
    }
  }
  StoreClientOptions options(Generation g) const {
    StoreClientOptions o;
    o.host = "127.0.0.1";
    o.port = port_;
    o.generation = g;
    o.connect_timeout = 5s;
    o.timeout = 10s;
    return o;
  }

 private:
  boost::asio::io_context io_;
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> work_;
  std::optional<StoreServer> server_;
  std::thread thread_;
  std::uint16_t port_ = 0;
};

// A port on which nothing listens (bound, never listen()ed: connects are refused) for as
// long as this object lives.
class RefusingPort {
 public:
  RefusingPort() {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    REQUIRE(::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    socklen_t len = sizeof a;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
  }
  ~RefusingPort() { ::close(fd_); }
  std::uint16_t port() const { return port_; }

 private:
  int fd_ = -1;
  std::uint16_t port_ = 0;
};

const char* gen_name(Generation g) { return g == Generation::legacy ? "legacy" : "modern"; }

}  // namespace

TEST_CASE("basic ops in both generations", "[store_client]") {
  ServerThread srv;
  const Generation gen = GENERATE(Generation::legacy, Generation::modern);
  INFO("generation " << gen_name(gen));
  StoreClient c(srv.options(gen));
  StoreClient other(srv.options(gen));

  c.set("k1", "v1");
  CHECK(c.get("k1") == "v1");
  CHECK(other.get("k1") == "v1");
  c.set("bin", std::string("\0\xff\x01", 3));
  CHECK(other.get("bin") == std::string("\0\xff\x01", 3));
  c.set("empty", "");
  CHECK(c.get("empty").empty());

  CHECK(c.add("cnt", 5) == 5);
  CHECK(other.add("cnt", -2) == 3);
  CHECK(c.get("cnt") == "3");
  CHECK(c.add("cnt", 0) == 3);

  // compare_set, the four branches of protocol §4.4.
  CHECK(c.compare_set("cas", "", "first") == "first");  // missing, expected empty
  CHECK(c.get("cas") == "first");
  CHECK(c.compare_set("nocas", "x", "y") == "x");  // missing, expected non-empty
  CHECK_FALSE(c.check({"nocas"}));
  CHECK(c.compare_set("cas", "first", "second") == "second");  // present, equal
  CHECK(c.compare_set("cas", "wrong", "third") == "second");   // present, different
  CHECK(c.get("cas") == "second");

  CHECK(c.check({}));
  CHECK(c.check({"k1", "cnt"}));
  CHECK_FALSE(c.check({"k1", "missing"}));
  c.wait({"k1", "cnt"});
  c.wait({"k1"}, 1s);

  const std::int64_t n = c.num_keys();
  CHECK(n == 5);  // /k1 /bin /empty /cnt /cas
  CHECK(c.add_raw("init/", 1) == 1);
  CHECK(c.num_keys() == n + 1);
  CHECK(c.delete_key("k1"));
  CHECK_FALSE(c.delete_key("k1"));
  CHECK_FALSE(c.check({"k1"}));
  CHECK(c.num_keys() == n);

  // A key prefix other than "/" is honoured (the key travels as "pre/k").
  StoreClientOptions po = srv.options(gen);
  po.key_prefix = "/pre/";
  StoreClient p(po);
  p.set("k", "pv");
  CHECK(c.get("pre/k") == "pv");
}

TEST_CASE("a blocked wait is woken by another client's set", "[store_client]") {
  ServerThread srv;
  const Generation gen = GENERATE(Generation::legacy, Generation::modern);
  INFO("generation " << gen_name(gen));
  StoreClient waiter(srv.options(gen));
  StoreClient setter(srv.options(gen));
  auto result = std::async(std::launch::async, [&] { return waiter.get("late", 10s); });
  srv.await_pending_waits(1);
  setter.set("late", "here");
  REQUIRE(result.wait_for(10s) == std::future_status::ready);
  CHECK(result.get() == "here");
}

TEST_CASE("add_init_key counts the client in init/", "[store_client]") {
  ServerThread srv;
  const Generation gen = GENERATE(Generation::legacy, Generation::modern);
  auto o = srv.options(gen);
  o.add_init_key = true;
  StoreClient a(o);
  StoreClient b(o);
  CHECK(a.add_raw("init/", 0) == 2);
  CHECK(b.num_keys() == 1);
}

TEST_CASE("modern-only ops", "[store_client]") {
  ServerThread srv;
  StoreClient c(srv.options(Generation::modern));
  StoreClient d(srv.options(Generation::modern));

  c.append("ap", "ab");
  c.append("ap", "cd");
  CHECK(c.get("ap") == "abcd");

  c.multi_set({"m1", "m2", "m3"}, {"a", "", "c"});
  CHECK(d.multi_get({"m3", "m1", "m2"}) == std::vector<std::string>{"c", "a", ""});
  CHECK(d.multi_get({}).empty());
  CHECK_THROWS_AS(c.multi_set({"a"}, {}), ddprun::Error);

  CHECK(c.queue_len("q") == 0);
  CHECK_FALSE(c.queue_pop("q").has_value());
  c.queue_push("q", "one");
  c.queue_push("q", "two");
  CHECK(c.queue_len("q") == 2);  // pushes have no reply: sync on c before d looks
  CHECK(d.queue_len("q") == 2);
  CHECK(d.queue_pop("q") == std::optional<std::string>("one"));
  CHECK(d.queue_pop_wait("q", 1s) == "two");
  CHECK_THROWS_AS(d.queue_pop_wait("q", 50ms), ddprun::TimeoutError);
  auto popped = std::async(std::launch::async, [&] { return d.queue_pop_wait("q", 10s); });
  srv.await_pending_waits(1);
  c.queue_push("q", "three");
  REQUIRE(popped.wait_for(10s) == std::future_status::ready);
  CHECK(popped.get() == "three");
  // The queue namespace is separate from keys.
  CHECK_FALSE(c.check({"q"}));

  c.add_raw("init/", 1);
  const auto keys = c.list_keys();
  CHECK(keys == std::vector<std::string>{"ap", "m1", "m2", "m3"});  // init/ filtered out

  CHECK(c.ping(0xDEADBEEF) == 0xDEADBEEF);
  CHECK(c.ping(0) == 0);
}

TEST_CASE("barrier releases all participants together", "[store_client]") {
  ServerThread srv;
  constexpr int world = 4;
  std::vector<std::future<void>> parts;
  for (int i = 0; i < world - 1; ++i) {
    parts.push_back(std::async(std::launch::async, [&] {
      StoreClient c(srv.options(Generation::modern));
      c.barrier("bar", world, 10s);
      c.set("after", "ok");  // the connection stays usable after the barrier
    }));
  }
  srv.await_pending_waits(world - 1);
  for (auto& p : parts) CHECK(p.wait_for(0s) == std::future_status::timeout);
  StoreClient last(srv.options(Generation::modern));
  last.barrier("bar", world, 10s);
  for (auto& p : parts) {
    REQUIRE(p.wait_for(10s) == std::future_status::ready);
    p.get();
  }
  CHECK(last.get("after") == "ok");
  // Barrier timeout: cancelled, connection still usable.
  CHECK_THROWS_AS(last.barrier("bar2", 2, 30ms), ddprun::TimeoutError);
  CHECK(last.add("x", 1) == 1);
  CHECK(srv.stats().pending_waits == 0);
}

TEST_CASE("modern wait timeout cancels and keeps the connection usable", "[store_client]") {
  ServerThread srv;
  StoreClient c(srv.options(Generation::modern));
  StoreClient setter(srv.options(Generation::modern));
  try {
    c.wait({"never"}, 50ms);
    FAIL("wait did not time out");
  } catch (const ddprun::TimeoutError& e) {
    CHECK_THAT(e.what(), Catch::Contains("never") && Catch::Contains("50 ms"));
  }
  CHECK_THROWS_AS(c.get("never", 20ms), ddprun::TimeoutError);
  CHECK(srv.stats().pending_waits == 0);
  setter.set("never", "now");  // must not produce a stray STOP_WAITING on c's connection
  CHECK(c.add("ctr", 1) == 1);
  CHECK(c.get("never") == "now");
  CHECK(c.reconnects() == 0);

  // Zero timeouts on a present key race the server's STOP_WAITING against our
  // CANCEL_WAIT: either way the stream must stay in sync (drain path of protocol §5.2).
  int timeouts = 0;
  for (int i = 1; i <= 300; ++i) {
    try {
      c.wait({"never"}, 0ms);
    } catch (const ddprun::TimeoutError&) {
      ++timeouts;
    }
    REQUIRE(c.add("ctr2", 1) == i);
  }
  INFO("zero-timeout waits that timed out: " << timeouts);
  CHECK(c.reconnects() == 0);
}

TEST_CASE("legacy wait timeout reconnects", "[store_client]") {
  ServerThread srv;
  StoreClient c(srv.options(Generation::legacy));
  StoreClient setter(srv.options(Generation::legacy));
  CHECK_THROWS_AS(c.wait({"never"}, 30ms), ddprun::TimeoutError);
  CHECK(c.reconnects() == 1);
  setter.set("never", "now");  // the dropped connection's registration died with it
  CHECK(c.add("ctr", 7) == 7);
  CHECK(c.get("never") == "now");
  CHECK(c.add("ctr", 1) == 8);
  CHECK(c.reconnects() == 1);
}

TEST_CASE("modern-only ops are refused in the legacy generation", "[store_client]") {
  ServerThread srv;
  StoreClient c(srv.options(Generation::legacy));
  auto refused = [](auto&& f) {
    try {
      f();
      FAIL("no error");
    } catch (const ddprun::NetworkError&) {
      FAIL("NetworkError instead of a usage error");
    } catch (const ddprun::Error& e) {
      CHECK_THAT(e.what(), Catch::Contains("not supported by the 1.13 protocol generation"));
    }
  };
  refused([&] { c.append("a", "b"); });
  refused([&] { c.multi_get({"a"}); });
  refused([&] { c.multi_set({"a"}, {"b"}); });
  refused([&] { c.queue_push("q", "v"); });
  refused([&] { c.queue_pop("q"); });
  refused([&] { c.queue_pop_wait("q", 1s); });
  refused([&] { c.queue_len("q"); });
  refused([&] { c.list_keys(); });
  refused([&] { c.barrier("b", 2, 1s); });
  refused([&] { c.ping(1); });
  CHECK(c.add("still", 1) == 1);
  CHECK(c.reconnects() == 0);
}

TEST_CASE("connect timeout names host:port", "[store_client]") {
  RefusingPort refusing;
  const Generation gen = GENERATE(Generation::legacy, Generation::modern);
  StoreClientOptions o;
  o.host = "127.0.0.1";
  o.port = refusing.port();
  o.generation = gen;
  o.connect_timeout = 200ms;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    StoreClient c(o);
    FAIL("connected to a port nobody listens on");
  } catch (const ddprun::NetworkError& e) {
    const std::string where = "127.0.0.1:" + std::to_string(refusing.port());
    CHECK_THAT(e.what(), Catch::Contains(where) && Catch::Contains("within 200 ms") && Catch::Contains("refused") &&
                             Catch::Contains("ddprun-rdzvd"));
  }
  const auto took = std::chrono::steady_clock::now() - t0;
  CHECK(took >= 200ms);
  CHECK(took < 2s);
}

TEST_CASE("unresolvable host is a NetworkError", "[store_client]") {
  StoreClientOptions o;
  o.host = "no-such-host.invalid";
  o.port = 1;
  o.connect_timeout = 50ms;
  CHECK_THROWS_AS(StoreClient(o), ddprun::NetworkError);
}

TEST_CASE("limits are enforced before sending", "[store_client]") {
  ServerThread srv;
  const Generation gen = GENERATE(Generation::legacy, Generation::modern);
  auto o = srv.options(gen);
  o.limits.max_key_bytes = 16;  // includes the "/" prefix
  o.limits.max_value_bytes = 32;
  o.limits.max_keys_per_request = 3;
  StoreClient c(o);
  auto usage = [](auto&& f, const char* what) {
    try {
      f();
      FAIL("no error");
    } catch (const ddprun::NetworkError&) {
      FAIL("NetworkError instead of a limit error");
    } catch (const ddprun::Error& e) {
      CHECK_THAT(e.what(), Catch::Contains(what));
    }
  };
  const std::string key15(15, 'k');
  c.set(key15, std::string(32, 'v'));  // exactly at the limits
  usage([&] { c.set(key15 + "x", "v"); }, "over the limit of 16 bytes");
  usage([&] { c.set("k", std::string(33, 'v')); }, "over the limit of 32 bytes");
  usage([&] { c.compare_set("k", "", std::string(33, 'v')); }, "over the limit of 32 bytes");
  usage([&] { c.check({"a", "b", "c", "d"}); }, "over the limit of 3");
  usage([&] { c.wait({"a", "b", "c", "d"}, 1s); }, "over the limit of 3");
  usage([&] { c.add(key15 + "x", 1); }, "over the limit");
  CHECK(c.get(key15) == std::string(32, 'v'));
  CHECK(c.reconnects() == 0);
}

TEST_CASE("detect_generation sees a modern server", "[store_client]") {
  ServerThread srv;
  CHECK(ddprun::rendezvous::detect_generation("127.0.0.1", srv.port(), 2s) == DetectedGeneration::modern);
  RefusingPort refusing;
  CHECK_THROWS_AS(ddprun::rendezvous::detect_generation("127.0.0.1", refusing.port(), 100ms), ddprun::NetworkError);
}

TEST_CASE("the client reconnects after the server closed its connection", "[store_client]") {
  ServerThread srv;
  StoreClient c(srv.options(Generation::modern));
  CHECK(c.add("a", 1) == 1);
  // ADD on a non-numeric value makes the server close the connection (protocol §4.6).
  c.set("text", "abc");
  CHECK_THROWS_AS(c.add("text", 1), ddprun::NetworkError);
  CHECK(c.add("a", 1) == 2);  // reconnected lazily
  CHECK(c.reconnects() == 1);
}

TEST_CASE("pipelined get: one round trip when present, WAIT+GET when missing", "[store_client]") {
  ServerThread srv;
  auto o = srv.options(Generation::modern);
  o.pipelined_get = true;
  StoreClient c(o);
  StoreClient setter(srv.options(Generation::modern));
  setter.set("k", "v");
  setter.set("empty", "");
  CHECK(c.get("k") == "v");
  CHECK(c.get("empty").empty());
  CHECK_THROWS_AS(c.get("missing", 30ms), ddprun::TimeoutError);
  auto later = std::async(std::launch::async, [&] { return c.get("late", 10s); });
  srv.await_pending_waits(1);
  setter.set("late", "here");
  REQUIRE(later.wait_for(10s) == std::future_status::ready);
  CHECK(later.get() == "here");
  CHECK(c.add("n", 1) == 1);  // stream still in sync
  CHECK(c.reconnects() == 0);

  auto legacy = srv.options(Generation::legacy);
  legacy.pipelined_get = true;
  CHECK_THROWS_AS(StoreClient(legacy), ddprun::Error);
}

TEST_CASE("host names resolve over all address families", "[store_client]") {
  // "localhost" may resolve to ::1 first: the client must try every address in turn.
  {
    ServerThread v4;
    auto o = v4.options(Generation::modern);
    o.host = "localhost";
    StoreClient c(o);
    CHECK(c.add("a", 1) == 1);
  }
  std::optional<ServerThread> v6;
  try {
    v6.emplace("::1");
  } catch (const ddprun::Error& e) {
    WARN("no IPv6 loopback here, skipping the ::1 part: " << e.what());
    return;
  }
  auto o = v6->options(Generation::modern);
  o.host = "::1";
  StoreClient c(o);
  CHECK(c.add("b", 2) == 2);
  // Errors spell IPv6 endpoints with brackets.
  StoreClientOptions bad = o;
  bad.port = RefusingPort().port();  // released at once: nothing listens on ::1 there
  bad.connect_timeout = 50ms;
  CHECK_THROWS_WITH(StoreClient(bad), Catch::Contains("[::1]:" + std::to_string(bad.port)));
}

TEST_CASE("values larger than the receive buffer", "[store_client]") {
  ServerThread srv;
  const Generation gen = GENERATE(Generation::legacy, Generation::modern);
  StoreClient c(srv.options(gen));
  StoreClient d(srv.options(gen));
  auto pattern = [](std::size_t n, char seed) {
    std::string s(n, '\0');
    for (std::size_t i = 0; i < n; ++i) s[i] = static_cast<char>(seed + static_cast<char>(i * 7));
    return s;
  };
  for (std::size_t n :
       {std::size_t{4095}, std::size_t{4096}, std::size_t{4097}, std::size_t{100000}, std::size_t{3} << 20}) {
    INFO("value size " << n);
    const std::string v = pattern(n, static_cast<char>(n));
    c.set("big", v);
    CHECK(c.check({"big"}));  // SET has no reply: a round trip on c orders it before d's get
    CHECK(d.get("big") == v);
    CHECK(d.compare_set("big", v, "small") == "small");
    CHECK(d.add("after", 1) > 0);  // still in sync
  }
  if (gen == Generation::modern) {
    const std::string a = pattern(70000, 'a');
    const std::string b = pattern(5000, 'b');
    c.multi_set({"ma", "mb", "mc"}, {a, "", b});
    CHECK(d.multi_get({"ma", "mb", "mc"}) == std::vector<std::string>{a, "", b});
  }
}
