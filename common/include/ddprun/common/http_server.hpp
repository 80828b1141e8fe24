#pragma once
// http::Server: the one bounded HTTP/1.x listener behind the metrics endpoint
// (MetricsHttpServer) and the agent's health endpoint (HealthEndpoint). It answers once per
// connection from a route table (exact path, query string ignored -> handler returning status,
// content type and body) and closes: the reply carries `Connection: close`. The port is
// reachable by anyone who can reach the host, so every connection is treated as hostile: the
// request head must arrive within limits.read_timeout and the answer be read within another,
// a head larger than limits.max_request_bytes is not read further, at most
// limits.max_connections are served at once (a new one beyond that takes the slot of the oldest
// connection still short of a complete request, or is closed at accept when every slot is
// answering), a head may end its lines with CRLF or a bare LF, and a failed
// accept (out of descriptors) is retried after 1 s instead of ending the listener. Request
// bodies are never read.
//
// A request no route takes goes to `fallback` when one is set, and so does a head that could
// not be read (cut off, oversized, no HTTP version): then Request::complete is false. Without a
// fallback such requests get 404, 400 or 431 as text.
//
// Lifetime: the caller opens, binds and listens the acceptor (each endpoint has its own bind
// address and error text) and hands it over; start() begins accepting; stop() closes the
// acceptor and every connection, idempotent, and no handler runs after it; the destructor
// stops. Must be destroyed before its io_context. Not thread-safe: every call, and every
// handler, on the io_context's thread, so handlers may read their owner's state without locks.
#include <boost/asio/ip/tcp.hpp>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>

namespace ddprun::http {

struct Limits {
  std::size_t max_request_bytes = 8 * 1024;
  std::chrono::milliseconds read_timeout{5000};
  std::size_t max_connections = 16;
};

struct Request {
  std::string_view method;  // "" when the head could not be read
  std::string_view path;    // the target without its query string
  bool complete = false;    // a whole head with a request line "METHOD TARGET HTTP/1.x"
};

struct Response {
  int status = 200;
  std::string content_type;
  std::string body;
};

using Handler = std::function<Response(const Request&)>;

struct Stats {
  std::uint64_t ok = 0;          // 2xx answers
  std::uint64_t rejected = 0;    // 4xx answers, read timeouts and connections over the limit
  std::uint64_t over_limit = 0;  // of those, connections closed for the cap (at accept, or the oldest idle one)
  std::size_t open = 0;          // connections open now
};

// "HTTP/1.1 <status> <reason>" with Content-Type, Content-Length and Connection: close.
std::string format_response(const Response& response);
// A text/plain answer: `text` plus a newline.
Response plain(int status, std::string_view text);

struct Options {
  std::string name;  // names the listener in logs, e.g. "metrics"
  Limits limits;
  std::map<std::string, Handler, std::less<>> routes;
  Handler fallback;
};

class Server {
 public:
  Server(boost::asio::ip::tcp::acceptor acceptor, Options options);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  void start();
  void stop();
  std::uint16_t port() const;
  Stats stats() const;

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace ddprun::http
