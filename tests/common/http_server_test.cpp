// The bounded HTTP server behind the metrics and health endpoints, over loopback with a plain
// blocking client: the route table, the metrics endpoint's 404/405/400/431 answers, a fallback
// that answers everything (the health endpoint's way, a head cut off by EOF included), and the
// cap on open connections. The server runs on its own io_context thread; the client reads until
// the server closes, so nothing waits on time.
#include <catch2/catch.hpp>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "ddprun/common/http_server.hpp"
#include "ddprun/common/metrics_http.hpp"

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

namespace {

tcp::acceptor loopback_acceptor(asio::io_context& io) {
  tcp::acceptor a(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
  return a;
}

// Sends `request` (then shuts the write side when `eof`), reads until the server closes.
std::string roundtrip(std::uint16_t port, const std::string& request, bool eof = false) {
  asio::io_context io;
  tcp::socket s(io);
  s.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
  asio::write(s, asio::buffer(request));
  if (eof) s.shutdown(tcp::socket::shutdown_send);
  std::string reply;
  boost::system::error_code ec;
  asio::read(s, asio::dynamic_buffer(reply), ec);
  return reply;
}

// Runs `io` on a thread until the test ends; `on_io` runs a call on that thread.
struct Runner {
  asio::io_context io;
  std::thread thread;
  asio::executor_work_guard<asio::io_context::executor_type> work{io.get_executor()};
  void start() {
    thread = std::thread([this] { io.run(); });
  }
  template <class F>
  auto on_io(F f) {
    std::packaged_task<decltype(f())()> task(std::move(f));
    auto result = task.get_future();
    asio::post(io, [&task] { task(); });
    return result.get();
  }
  ~Runner() {
    work.reset();
    io.stop();
    if (thread.joinable()) thread.join();
  }
};

}  // namespace

TEST_CASE("the metrics endpoint answers its route and refuses the rest with the right status") {
  Runner r;
  ddprun::metrics::MetricsHttpServer server(
      r.io, "127.0.0.1", 0, [] { return std::string("up 1\n"); },
      ddprun::metrics::MetricsHttpLimits{256, std::chrono::seconds(30), 16});
  server.start();
  r.start();
  const std::uint16_t port = server.port();
  const std::string ok = roundtrip(port, "GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\n\r\n");
  CHECK_THAT(ok, Catch::StartsWith("HTTP/1.1 200 OK\r\n") &&
                     Catch::Contains("Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n") &&
                     Catch::Contains("Connection: close\r\n") && Catch::EndsWith("\r\n\r\nup 1\n"));
  // Lines may end with a bare LF (RFC 9112 2.2); before, such a head was never seen to end.
  CHECK_THAT(roundtrip(port, "GET /metrics HTTP/1.1\nHost: a\n\n"), Catch::StartsWith("HTTP/1.1 200 OK\r\n"));
  CHECK_THAT(roundtrip(port, "GET /metrics HTTP/1.0\n\r\n"), Catch::StartsWith("HTTP/1.1 200 OK\r\n"));
  CHECK_THAT(roundtrip(port, "GET /other HTTP/1.1\r\n\r\n"),
             Catch::StartsWith("HTTP/1.1 404 Not Found\r\n") && Catch::EndsWith("only /metrics is served here\n"));
  CHECK_THAT(roundtrip(port, "HEAD /metrics HTTP/1.1\r\n\r\n"), Catch::StartsWith("HTTP/1.1 405 Method Not Allowed"));
  CHECK_THAT(roundtrip(port, "garbage\r\n\r\n"), Catch::StartsWith("HTTP/1.1 400 Bad Request"));
  CHECK_THAT(roundtrip(port, "GET /metrics HTTP/1.1\r\nX: " + std::string(400, 'a') + "\r\n\r\n"),
             Catch::StartsWith("HTTP/1.1 431 Request Header Fields Too Large"));
  // A head cut off by EOF gets no answer here (no fallback): the connection is just closed.
  CHECK(roundtrip(port, "GET /metrics", true).empty());
  const auto stats = r.on_io([&] { return server.stats(); });
  CHECK(stats.scrapes == 3);
  CHECK(stats.rejected == 4);
}

TEST_CASE("a fallback answers every request, a cut-off head included; routes come first") {
  Runner r;
  ddprun::http::Options options;
  options.name = "test";
  options.limits.max_request_bytes = 256;
  std::vector<std::string> seen;  // only touched on the io thread
  options.routes.emplace("/a", [](const ddprun::http::Request&) {
    return ddprun::http::Response{200, "text/plain", "route\n"};
  });
  options.fallback = [&seen](const ddprun::http::Request& req) {
    seen.push_back(req.complete ? std::string(req.method) + " " + std::string(req.path) : "incomplete");
    return ddprun::http::Response{503, "application/json", "{}\n"};
  };
  ddprun::http::Server server(loopback_acceptor(r.io), std::move(options));
  server.start();
  r.start();
  const std::uint16_t port = server.port();
  CHECK_THAT(roundtrip(port, "GET /a HTTP/1.1\r\n\r\n"), Catch::EndsWith("route\n"));
  CHECK_THAT(roundtrip(port, "POST /health?q HTTP/1.0\r\n\r\n"),
             Catch::StartsWith("HTTP/1.1 503 Service Unavailable\r\n") && Catch::Contains("application/json"));
  CHECK_THAT(roundtrip(port, "GET /\n", true), Catch::StartsWith("HTTP/1.1 503"));
  CHECK_THAT(roundtrip(port, "GET / HTTP/1.1\r\nX: " + std::string(400, 'a') + "\r\n\r\n"),
             Catch::StartsWith("HTTP/1.1 503"));
  const auto seen_now = r.on_io([&] { return seen; });
  CHECK(seen_now == std::vector<std::string>{"POST /health", "incomplete", "incomplete"});
}

TEST_CASE("beyond the cap the oldest connection without a request gives way; the server keeps serving") {
  Runner r;
  ddprun::http::Options options;
  options.name = "test";
  options.limits.max_connections = 2;
  options.fallback = [](const ddprun::http::Request&) { return ddprun::http::Response{200, "text/plain", "ok\n"}; };
  ddprun::http::Server server(loopback_acceptor(r.io), std::move(options));
  server.start();
  r.start();
  const std::uint16_t port = server.port();
  asio::io_context client;
  std::vector<tcp::socket> idle;
  for (int i = 0; i < 2; ++i) {
    idle.emplace_back(client);
    idle.back().connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port));
  }
  // The server has taken both idle ones once it counts them open.
  while (r.on_io([&] { return server.stats().open; }) < 2) std::this_thread::yield();
  // A third is answered: the oldest idle one is closed for it (before, idle connections shut out
  // every new one, a liveness probe included).
  CHECK_THAT(roundtrip(port, "GET / HTTP/1.1\r\n\r\n"), Catch::EndsWith("ok\n"));
  CHECK(r.on_io([&] { return server.stats().over_limit; }) == 1);
  std::string left;
  boost::system::error_code ec;
  asio::read(idle.front(), asio::dynamic_buffer(left), ec);  // the oldest: closed, no answer
  CHECK(ec == asio::error::eof);
  CHECK(left.empty());
  idle.clear();  // closing them frees their places (the server sees EOF and answers into a closed socket)
  while (r.on_io([&] { return server.stats().open; }) > 0) std::this_thread::yield();
  CHECK_THAT(roundtrip(port, "GET / HTTP/1.1\r\n\r\n"), Catch::EndsWith("ok\n"));
}

TEST_CASE("over the cap a client opening connections in a loop replaces its own, not another's waiting one") {
  Runner r;
  ddprun::http::Options options;
  options.name = "test";
  options.limits.max_connections = 3;
  options.fallback = [](const ddprun::http::Request&) { return ddprun::http::Response{200, "text/plain", "ok\n"}; };
  ddprun::http::Server server(loopback_acceptor(r.io), std::move(options));
  server.start();
  r.start();
  const std::uint16_t port = server.port();
  const tcp::endpoint to(asio::ip::make_address("127.0.0.1"), port);
  asio::io_context client;
  // A probe from 127.0.0.2 connects first and has not sent its request yet...
  tcp::socket probe(client);
  probe.open(tcp::v4());
  probe.bind(tcp::endpoint(asio::ip::make_address("127.0.0.2"), 0));
  probe.connect(to);
  while (r.on_io([&] { return server.stats().open; }) < 1) std::this_thread::yield();
  // ...when 127.0.0.1 opens twice the cap's worth of idle connections, one at a time.
  std::vector<tcp::socket> flood;
  for (int i = 0; i < 6; ++i) {
    flood.emplace_back(client);
    flood.back().connect(to);
    const std::size_t accepted = static_cast<std::size_t>(i) + 2;
    while (r.on_io([&] { return server.stats().open + server.stats().over_limit; }) < accepted)
      std::this_thread::yield();
  }
  CHECK(r.on_io([&] { return server.stats().over_limit; }) == 4);
  // The probe was the oldest connection the whole time, and it still gets its answer.
  asio::write(probe, asio::buffer(std::string("GET / HTTP/1.1\r\n\r\n")));
  std::string reply;
  boost::system::error_code ec;
  asio::read(probe, asio::dynamic_buffer(reply), ec);
  CHECK_THAT(reply, Catch::EndsWith("ok\n"));
  // The flood's four oldest were closed unanswered.
  for (int i = 0; i < 4; ++i) {
    std::string left;
    asio::read(flood[static_cast<std::size_t>(i)], asio::dynamic_buffer(left), ec);
    CHECK(ec == asio::error::eof);
    CHECK(left.empty());
  }
}
