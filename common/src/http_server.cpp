// http::Server (http_server.hpp has the contract). One Asio acceptor; each connection reads its
// request head into a capped buffer under a deadline, answers once and closes.
#include "ddprun/common/http_server.hpp"

#include <spdlog/spdlog.h>

#include <boost/asio/read_until.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/streambuf.hpp>
#include <boost/asio/write.hpp>
#include <algorithm>
#include <utility>

namespace ddprun::http {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

namespace {

struct Connection {
  Connection(tcp::socket s, std::size_t max_bytes)
      : socket(std::move(s)), timer(socket.get_executor()), in(max_bytes) {}
  tcp::socket socket;
  asio::steady_timer timer;
  asio::streambuf in;
  std::string reply;
  std::uint64_t id = 0;
  asio::ip::address peer;  // the client's address (unspecified when the socket could not say)
  bool closed = false;
  // Set once the head is read: a read-timeout handler already queued when the head arrived (its
  // cancel came too late) must not cut off the answer.
  bool head_read = false;
};

std::string_view reason_of(int status) {
  switch (status) {
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 431:
      return "Request Header Fields Too Large";
    case 500:
      return "Internal Server Error";
    case 503:
      return "Service Unavailable";
    default:
      return status < 400 ? "OK" : "Error";
  }
}

}  // namespace

std::string format_response(const Response& response) {
  std::string out =
      "HTTP/1.1 " + std::to_string(response.status) + " " + std::string(reason_of(response.status)) + "\r\n";
  out += "Content-Type: " + response.content_type + "\r\n";
  out += "Content-Length: " + std::to_string(response.body.size()) + "\r\n";
  out += "Connection: close\r\n\r\n";
  out += response.body;
  return out;
}

Response plain(int status, std::string_view text) {
  return Response{status, "text/plain; charset=utf-8", std::string(text) + "\n"};
}

// The end of a request head: an empty line, ended by CRLF or by a bare LF (RFC 9112 2.2 lets a
// server take LF alone as a line end): "\n\n" or "\n\r\n".
std::pair<asio::buffers_iterator<asio::streambuf::const_buffers_type>, bool> end_of_head(
    asio::buffers_iterator<asio::streambuf::const_buffers_type> begin,
    asio::buffers_iterator<asio::streambuf::const_buffers_type> end) {
  int state = 0;       // 1: after a LF; 2: after LF CR
  auto partial = end;  // where a terminator may have begun: the next read resumes there
  for (auto it = begin; it != end; ++it) {
    const char ch = *it;
    if (ch == '\n') {
      if (state != 0) return {std::next(it), true};
      state = 1;
      partial = it;
    } else if (ch == '\r' && state == 1) {
      state = 2;
    } else if (ch != '\r') {
      state = 0;
    }
  }
  return {state != 0 ? partial : end, false};
}

struct Server::Impl : std::enable_shared_from_this<Impl> {
  Impl(tcp::acceptor acceptor_, Options options_)
      : acceptor(std::move(acceptor_)), retry(acceptor.get_executor()), options(std::move(options_)) {}

  tcp::acceptor acceptor;
  asio::steady_timer retry;  // re-arms accept after a failed one
  Options options;
  std::map<std::uint64_t, std::shared_ptr<Connection>> connections;
  std::uint64_t next_id = 1;
  std::uint16_t bound_port = 0;
  bool stopped = false;
  Stats stats;

  void do_accept() {
    if (stopped) return;
    acceptor.async_accept([self = shared_from_this()](boost::system::error_code ec, tcp::socket socket) {
      if (self->stopped || ec == asio::error::operation_aborted) return;
      if (!ec) {
        self->on_accept(std::move(socket));
        self->do_accept();
        return;
      }
      // Out of descriptors or memory: the pending connection stays queued, so accepting again
      // at once would spin, and giving up would leave the port dead. Retry after a pause.
      spdlog::warn("{}: accept failed on port {}: {}; retrying in 1 s", self->options.name, self->bound_port,
                   ec.message());
      self->retry.expires_after(std::chrono::seconds(1));
      self->retry.async_wait([self](boost::system::error_code tec) {
        if (!tec && !self->stopped) self->do_accept();
      });
    });
  }

  // The connection a new one from `peer` replaces: the oldest still short of a complete request
  // from the address holding the most such connections, the new one counted (so a client that
  // opens connections in a loop replaces its own, not a probe from elsewhere that has connected
  // and not yet sent its request); nullptr when every connection has sent its request.
  std::shared_ptr<Connection> connection_to_evict(const asio::ip::address& peer) const {
    std::map<asio::ip::address, std::size_t> waiting{{peer, 1}};
    std::size_t most = 1;
    for (const auto& [id, c] : connections) {
      if (!c->head_read) most = std::max(most, ++waiting[c->peer]);
    }
    for (const auto& [id, c] : connections) {  // oldest first (ids grow)
      if (!c->head_read && waiting[c->peer] == most) return c;
    }
    return nullptr;
  }

  void on_accept(tcp::socket socket) {
    boost::system::error_code ec;
    const Limits& limits = options.limits;
    const tcp::endpoint remote = socket.remote_endpoint(ec);
    const asio::ip::address peer = ec ? asio::ip::address() : remote.address();
    if (connections.size() >= limits.max_connections) {
      // Idle connections must not pin descriptors, nor shut out a real client (a liveness probe):
      // a connection still short of a complete request gives way to the new one. Only when every
      // slot is sending an answer is the new one closed.
      const auto victim = connection_to_evict(peer);
      ++stats.rejected;
      ++stats.over_limit;
      if (victim == nullptr) {
        spdlog::debug("{}: closing a connection: {} already open", options.name, limits.max_connections);
        socket.close(ec);
        return;
      }
      spdlog::debug("{}: {} connections open: closing one without a complete request (from {})", options.name,
                    limits.max_connections, victim->peer.to_string());
      close(victim);
    }
    auto c = std::make_shared<Connection>(std::move(socket), limits.max_request_bytes);
    c->id = next_id++;
    c->peer = peer;
    connections.emplace(c->id, c);
    c->timer.expires_after(limits.read_timeout);
    c->timer.async_wait([self = shared_from_this(), c](boost::system::error_code tec) {
      if (tec || c->closed || c->head_read) return;
      ++self->stats.rejected;
      spdlog::debug("{}: closing a connection: no complete request within {} ms", self->options.name,
                    self->options.limits.read_timeout.count());
      self->close(c);
    });
    asio::async_read_until(
        c->socket, c->in, end_of_head,
        [self = shared_from_this(), c](boost::system::error_code rec, std::size_t n) { self->on_head(c, rec, n); });
  }

  void on_head(const std::shared_ptr<Connection>& c, boost::system::error_code ec, std::size_t n) {
    if (c->closed || stopped) return;
    c->head_read = true;
    c->timer.cancel();
    const Handler& fallback = options.fallback;
    if (ec == asio::error::not_found) {  // the head filled the capped buffer
      if (fallback) return answer(c, fallback(Request{}));
      return answer(c, plain(431, "request head over " + std::to_string(options.limits.max_request_bytes) + " bytes"));
    }
    if (ec && !fallback) return close(c);
    // With a fallback, a head cut off by EOF still gets its answer (a bare "GET /\n").
    const std::size_t len = ec ? c->in.size() : n;
    const std::string head(asio::buffers_begin(c->in.data()),
                           asio::buffers_begin(c->in.data()) + static_cast<long>(len));
    std::string_view line = std::string_view(head).substr(0, head.find('\n'));
    if (line.ends_with('\r')) line.remove_suffix(1);
    const auto sp1 = line.find(' ');
    const auto sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
    if (ec || sp2 == std::string_view::npos || !line.substr(sp2 + 1).starts_with("HTTP/1.")) {
      if (fallback) return answer(c, fallback(Request{}));
      const std::string example = options.routes.empty() ? "/" : options.routes.begin()->first;
      return answer(c, plain(400, "expected 'GET " + example + " HTTP/1.1'"));
    }
    Request request;
    request.complete = true;
    request.method = line.substr(0, sp1);
    std::string_view target = line.substr(sp1 + 1, sp2 - sp1 - 1);
    request.path = target.substr(0, target.find('?'));
    if (auto route = options.routes.find(request.path); route != options.routes.end()) {
      return answer(c, route->second(request));
    }
    if (fallback) return answer(c, fallback(request));
    std::string served;
    for (const auto& [path, handler] : options.routes) served += (served.empty() ? "" : ", ") + path;
    answer(c, plain(404, "only " + served + " is served here"));
  }

  void answer(const std::shared_ptr<Connection>& c, const Response& response) {
    if (response.status >= 200 && response.status < 300) ++stats.ok;
    if (response.status >= 400 && response.status < 500) ++stats.rejected;
    c->reply = format_response(response);
    // The write is bounded too: a client that never reads is cut off after read_timeout.
    c->timer.expires_after(options.limits.read_timeout);
    c->timer.async_wait([self = shared_from_this(), c](boost::system::error_code tec) {
      if (!tec) self->close(c);
    });
    asio::async_write(c->socket, asio::buffer(c->reply),
                      [self = shared_from_this(), c](boost::system::error_code, std::size_t) { self->close(c); });
  }

  void close(const std::shared_ptr<Connection>& c) {
    if (c->closed) return;
    c->closed = true;
    boost::system::error_code ec;
    c->timer.cancel();
    c->socket.shutdown(tcp::socket::shutdown_both, ec);
    c->socket.close(ec);
    connections.erase(c->id);
  }

  void stop() {
    if (stopped) return;
    stopped = true;
    boost::system::error_code ec;
    acceptor.close(ec);
    retry.cancel();
    auto open = connections;
    for (auto& [id, c] : open) close(c);
  }
};

Server::Server(tcp::acceptor acceptor, Options options)
    : impl_(std::make_shared<Impl>(std::move(acceptor), std::move(options))) {
  boost::system::error_code ec;
  const tcp::endpoint local = impl_->acceptor.local_endpoint(ec);
  impl_->bound_port = ec ? 0 : local.port();
}

Server::~Server() { stop(); }

void Server::start() { impl_->do_accept(); }
void Server::stop() { impl_->stop(); }
std::uint16_t Server::port() const { return impl_->bound_port; }
Stats Server::stats() const {
  Stats s = impl_->stats;
  s.open = impl_->connections.size();
  return s;
}

}  // namespace ddprun::http
