#include "ddprun/rendezvous/etcd_client.hpp"

#include <fmt/format.h>
#include <openssl/ssl.h>
#include <spdlog/spdlog.h>

#include <array>
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/address.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
#include <deque>
#include <map>

#include "ddprun/common/backoff.hpp"
#include "ddprun/common/error.hpp"
#include "ddprun/rendezvous/openssl_runtime.hpp"

namespace ddprun::rendezvous::etcd {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
namespace ssl = asio::ssl;
using tcp = asio::ip::tcp;
using boost::system::error_code;

namespace {

constexpr std::size_t kHeaderLimit = 16 * 1024;
constexpr std::size_t kErrorBodyLimit = 64 * 1024;
// What one connection may hold read but not parsed yet: the headers, or a chunk-size line with
// its extensions (Beast needs the whole line buffered). Body bytes pass through in pieces. A
// server that never ends such a line fails the read with buffer_overflow instead of growing
// the buffer without end.
constexpr std::size_t kReadBufferLimit = kHeaderLimit + 64 * 1024;

// "32 MiB", "256 KiB".
std::string size_text(std::size_t bytes) {
  return bytes >= (std::size_t{1} << 20) ? fmt::format("{} MiB", bytes >> 20) : fmt::format("{} KiB", bytes >> 10);
}

std::string describe(const error_code& ec) {
  if (ec == beast::error::timeout) return "timed out";
  if (ec == http::error::body_limit) return "reply larger than the response size limit";
  if (ec == http::error::header_limit) return "reply headers over 16 KiB";
  if (ec == http::error::buffer_overflow) return "a reply line or chunk header over 80 KiB (not an etcd gateway?)";
  if (ec == asio::error::eof || ec == http::error::end_of_stream || ec == ssl::error::stream_truncated)
    return "connection closed by the server";
  return ec.message();
}

// etcd's own refusal of a request: grpc-gateway maps these gRPC codes to these statuses
// (InvalidArgument, FailedPrecondition and OutOfRange to 400, Unauthenticated to 401,
// PermissionDenied to 403) with the JSON error body. The same status without such a body comes
// from something else in the way (a proxy's page) and says nothing about the other members.
bool is_etcd_refusal(unsigned status, const GatewayError& g) {
  switch (status) {
    case 400:
      return g.code == 3 || g.code == 9 || g.code == 11;
    case 401:
      return g.code == 16;
    case 403:
      return g.code == 7;
    default:
      return false;
  }
}

// This member cannot serve the request now, another may: it is failing (5xx, leader loss), has
// no such API (a 404 that is not etcd's NotFound), or a 400/401/403 did not come from etcd.
bool is_member_failure(unsigned status, const GatewayError& g) {
  if (is_failover_error(g) || status >= 500) return true;
  if (status == 404) return g.code != 5;
  if (status == 400 || status == 401 || status == 403) return !is_etcd_refusal(status, g);
  return false;
}

// A request sent whose reply did not come within the request timeout ("no reply: " + describe of
// beast's timeout): failover counts them.
constexpr std::string_view kReplyTimedOut = "no reply: timed out";

bool is_ip_literal(const std::string& host) {
  error_code ec;
  asio::ip::make_address(host, ec);
  return !ec;
}

// One HTTP/1.1 connection (plain or TLS) to one endpoint.
class Conn : public std::enable_shared_from_this<Conn> {
 public:
  using Tls = beast::ssl_stream<beast::tcp_stream>;

  Conn(asio::io_context& io, ssl::context* tls, Endpoint ep)
      : ep_(std::move(ep)), resolver_(io), resolve_deadline_(io) {
    if (tls != nullptr) {
      tls_ = std::make_unique<Tls>(io, *tls);
    } else {
      tcp_ = std::make_unique<beast::tcp_stream>(io);
    }
  }

  const Endpoint& endpoint() const { return ep_; }
  beast::tcp_stream& lowest() { return tls_ ? beast::get_lowest_layer(*tls_) : *tcp_; }
  template <class F>
  void with_stream(F&& f) {
    if (tls_) {
      f(*tls_);
    } else {
      f(*tcp_);
    }
  }
  beast::flat_buffer& buffer() { return buf_; }
  bool open() const { return open_; }
  // Replies read on this connection so far.
  std::size_t served() const { return served_; }
  void count_served() { ++served_; }

  void connect(Duration timeout, std::function<void(const std::string&)> done) {
    auto self = shared_from_this();
    auto finished = std::make_shared<bool>(false);  // the first of the lookup and its deadline
    auto once = [finished, done = std::move(done)](const std::string& why) mutable {
      if (*finished) return;
      *finished = true;
      done(why);
    };
    // An address needs no lookup (nor the resolver's thread, where a slow lookup of another
    // name would make it wait).
    if (error_code ec; is_ip_literal(ep_.host)) {
      const tcp::endpoint at(asio::ip::make_address(ep_.host, ec), ep_.port);
      return connect_to(tcp::resolver::results_type::create(at, ep_.host, std::to_string(ep_.port)), timeout,
                        std::move(once));
    }
    // A name: the lookup counts against the connect timeout too. getaddrinfo cannot be stopped
    // (a DNS server that does not answer holds it for seconds per try): past the deadline the
    // connection fails and its late answer is dropped.
    resolve_deadline_.expires_after(timeout);
    resolve_deadline_.async_wait([self, finished, once](const error_code& ec) mutable {
      if (ec || *finished) return;
      self->resolver_.cancel();
      once("cannot resolve the host name: no answer within the connect timeout");
    });
    resolver_.async_resolve(
        ep_.host, std::to_string(ep_.port),
        [self, finished, timeout, once](const error_code& ec, tcp::resolver::results_type results) mutable {
          self->resolve_deadline_.cancel();
          if (*finished) return;
          if (ec) return once("cannot resolve the host name: " + ec.message());
          self->connect_to(std::move(results), timeout, std::move(once));
        });
  }

  void connect_to(tcp::resolver::results_type results, Duration timeout, std::function<void(const std::string&)> done) {
    auto self = shared_from_this();
    lowest().expires_after(timeout);
    lowest().async_connect(
        results, [self, done = std::move(done)](const error_code& ec2, const tcp::endpoint&) mutable {
          if (ec2) {
            return done(ec2 == beast::error::timeout ? "connect timed out" : "cannot connect: " + ec2.message());
          }
          error_code ignored;
          self->lowest().socket().set_option(tcp::no_delay(true), ignored);
          self->lowest().socket().set_option(asio::socket_base::keep_alive(true), ignored);
          if (!self->tls_) {
            self->open_ = true;
            return done("");
          }
          if (!is_ip_literal(self->ep_.host) &&
              SSL_ctrl(self->tls_->native_handle(), SSL_CTRL_SET_TLSEXT_HOSTNAME, TLSEXT_NAMETYPE_host_name,
                       const_cast<char*>(self->ep_.host.c_str())) != 1) {
            return done("cannot set the TLS server name");
          }
          self->tls_->set_verify_callback(ssl::host_name_verification(self->ep_.host));
          self->tls_->async_handshake(ssl::stream_base::client,
                                      [self, done = std::move(done)](const error_code& ec3) mutable {
                                        if (ec3) return done("TLS handshake failed: " + ec3.message());
                                        self->open_ = true;
                                        done("");
                                      });
        });
  }

  void close() {
    open_ = false;
    resolver_.cancel();
    resolve_deadline_.cancel();
    error_code ignored;
    lowest().socket().shutdown(tcp::socket::shutdown_both, ignored);
    lowest().close();
  }

 private:
  Endpoint ep_;
  tcp::resolver resolver_;
  asio::steady_timer resolve_deadline_;
  std::unique_ptr<beast::tcp_stream> tcp_;
  std::unique_ptr<Tls> tls_;
  beast::flat_buffer buf_{kReadBufferLimit};
  bool open_ = false;
  std::size_t served_ = 0;
};

http::request<http::string_body> make_request(const Endpoint& ep, const std::string& target, std::string body,
                                              const std::string& token) {
  http::request<http::string_body> req{http::verb::post, target, 11};
  req.set(http::field::host, ep.to_string());
  req.set(http::field::content_type, "application/json");
  req.set(http::field::user_agent, "ddprun");
  // Fail fast on a member without a leader instead of waiting for an election there.
  req.set("Grpc-Metadata-hasleader", "true");
  if (!token.empty()) req.set(http::field::authorization, token);
  req.keep_alive(true);
  req.body() = std::move(body);
  req.prepare_payload();
  return req;
}

}  // namespace

struct EtcdClient::Impl : std::enable_shared_from_this<EtcdClient::Impl> {
  struct Call {
    std::string path;
    std::string body;
    // Decodes a 200 reply (into the caller's value); "" or why it is malformed.
    std::function<std::string(std::string_view)> accept;
    std::function<void(const std::optional<EtcdError>&, std::string)> done;
    std::size_t tried = 0;
    std::size_t timeouts = 0;  // endpoints that took the request and did not answer in time
    std::string errors;
    bool token_retry = false;
  };

  struct Watch {
    std::uint64_t id = 0;
    WatchCreate create;
    std::int64_t next_revision = 0;
    WatchHandlers handlers;
    std::size_t endpoint = 0;
    std::shared_ptr<Conn> conn;
    std::unique_ptr<asio::steady_timer> retry;
    std::unique_ptr<asio::steady_timer> idle;  // a 200 stream silent for watch_idle_timeout
    std::unique_ptr<Backoff> backoff;
    std::string pending;  // bytes of the message being assembled
    // When the current stream was accepted (HTTP 200); one that lasted the request timeout
    // was healthy, and the backoff starts anew when it breaks.
    std::optional<std::chrono::steady_clock::time_point> stream_since;
    bool cancelled = false;
    std::uint64_t generation = 0;  // bumps on each (re)connect: stale handlers stop
  };

  asio::io_context& io;
  EtcdClientOptions options;
  std::unique_ptr<ssl::context> tls;
  bool closed = false;
  std::deque<std::shared_ptr<Call>> queue;
  bool busy = false;
  std::shared_ptr<Conn> conn;
  std::size_t current = 0;
  std::string token;
  std::map<std::uint64_t, std::shared_ptr<Watch>> watches;
  std::uint64_t next_watch_id = 1;
  std::function<void(std::size_t)> failed_hook;  // set_endpoint_failed_hook

  Impl(asio::io_context& io_, EtcdClientOptions o) : io(io_), options(std::move(o)) {
    if (options.endpoints.empty())
      throw UsageError("no etcd endpoint given", "pass --rdzv-endpoint host:2379[,host:2379...]");
    if (options.cert.empty() != options.key.empty()) {
      throw UsageError("etcd TLS: cert and key must be given together",
                       "pass both --rdzv-conf cert=FILE,key=FILE or neither");
    }
    if (options.tls) {
      require_openssl("TLS to etcd");
      tls = std::make_unique<ssl::context>(ssl::context::tls_client);
      tls->set_verify_mode(ssl::verify_peer);
      error_code ec;
      if (options.cacert.empty()) {
        tls->set_default_verify_paths(ec);
        if (ec) throw Error("etcd TLS: cannot load the system CA certificates: " + ec.message());
      } else {
        tls->load_verify_file(options.cacert, ec);
        if (ec) {
          throw Error(fmt::format("etcd TLS: cannot load cacert '{}': {}", options.cacert, ec.message()),
                      "check --rdzv-conf cacert=FILE (a PEM CA certificate)");
        }
      }
      if (!options.cert.empty()) {
        tls->use_certificate_chain_file(options.cert, ec);
        if (ec) {
          throw Error(fmt::format("etcd TLS: cannot load cert '{}': {}", options.cert, ec.message()),
                      "check --rdzv-conf cert=FILE (a PEM client certificate)");
        }
        tls->use_private_key_file(options.key, ssl::context::pem, ec);
        if (ec) {
          throw Error(fmt::format("etcd TLS: cannot load key '{}': {}", options.key, ec.message()),
                      "check --rdzv-conf key=FILE (the PEM private key of cert)");
        }
      }
    }
  }

  std::string scheme() const { return options.tls ? "https://" : "http://"; }
  std::string endpoint_text(std::size_t i) const { return scheme() + options.endpoints[i].to_string(); }

  // ---- unary calls ----

  void submit(std::string path, std::string body,
              std::function<void(const std::optional<EtcdError>&, std::string)> done,
              std::function<std::string(std::string_view)> accept = {}) {
    if (closed) return;
    auto call = std::make_shared<Call>();
    call->path = std::move(path);
    call->body = std::move(body);
    call->accept = std::move(accept);
    call->done = std::move(done);
    queue.push_back(std::move(call));
    pump();
  }

  void pump() {
    if (closed || busy || queue.empty()) return;
    busy = true;
    run(queue.front());
  }

  void finish(const std::shared_ptr<Call>& call, const std::optional<EtcdError>& err, std::string body) {
    if (closed) return;
    queue.pop_front();
    busy = false;
    auto done = std::move(call->done);
    // The next call starts before this one's callback, so a callback that submits more work
    // queues behind what is already waiting.
    pump();
    if (done) done(err, std::move(body));
  }

  void run(std::shared_ptr<Call> call) {
    if (closed) return;
    if (conn && conn->open()) {
      with_auth(std::move(call));
      return;
    }
    if (conn) conn->close();
    conn = std::make_shared<Conn>(io, tls.get(), options.endpoints[current]);
    auto self = shared_from_this();
    auto c = conn;
    c->connect(options.connect_timeout, [self, c, call](const std::string& err) {
      if (self->closed || c != self->conn) return;
      if (!err.empty()) return self->failover(call, err);
      self->with_auth(call);
    });
  }

  void with_auth(std::shared_ptr<Call> call) {
    if (options.username.empty() || !token.empty()) return send(std::move(call));
    auto self = shared_from_this();
    exchange("/v3/auth/authenticate", encode_authenticate(options.username, options.password), "",
             options.max_response_bytes,
             [self, call](const std::string& terr, unsigned status, std::string body, bool) {
               if (!terr.empty()) return self->failover(call, terr);
               if (status != 200) {
                 GatewayError g = decode_error(body);
                 // Only etcd's own refusal is about the credentials; a failing member or a
                 // proxy's page (a redirect, 405, 429 without etcd's body, ...) is not.
                 if (!is_etcd_refusal(status, g)) {
                   return self->failover(call, fmt::format("authenticate: HTTP {}: {}", status,
                                                           g.message.empty() ? std::string("no message") : g.message));
                 }
                 const std::size_t i = self->current;
                 EtcdError e{fmt::format("etcd at {} refused the credentials of user '{}': {} "
                                         "(check --rdzv-conf username=/password=)",
                                         self->endpoint_text(i), self->options.username, g.message),
                             self->options.endpoints[i].to_string(), g.code, true};
                 return self->finish(call, e, {});
               }
               std::string tok;
               if (std::string why = decode_authenticate(body, tok); !why.empty())
                 return self->failover(call, "malformed authenticate reply: " + why);
               self->token = std::move(tok);
               // On the same connection unless the member closed it after the token.
               self->run(call);
             });
  }

  void send(std::shared_ptr<Call> call) {
    if (call->path.empty()) return finish(call, std::nullopt, {});  // authenticate only
    auto self = shared_from_this();
    exchange(
        call->path, call->body, token, options.max_response_bytes,
        [self, call](const std::string& terr, unsigned status, std::string body, bool too_large) {
          // Every member holds the same keys: a reply too large here is too large anywhere.
          if (too_large) {
            if (self->conn) self->conn->close();
            self->conn.reset();
            const std::size_t i = self->current;
            EtcdError e{fmt::format("etcd at {} answered {} with a reply over the response size limit ({})",
                                    self->endpoint_text(i), call->path, size_text(self->options.max_response_bytes)),
                        self->options.endpoints[i].to_string(), 0, false};
            e.too_large = true;
            return self->finish(call, e, {});
          }
          if (!terr.empty()) return self->failover(call, terr);
          if (status == 200) {
            // A reply that does not decode is this member's fault: the next may answer.
            if (call->accept) {
              if (std::string why = call->accept(body); !why.empty())
                return self->failover(call, "malformed reply: " + why);
            }
            return self->finish(call, std::nullopt, std::move(body));
          }
          GatewayError g = decode_error(body);
          if (!self->options.username.empty() && is_invalid_token_error(g) && !call->token_retry) {
            call->token_retry = true;
            self->token.clear();
            return self->run(call);
          }
          // A member that fails (5xx) or has no such API (404 but not etcd's NotFound: not
          // an etcd gateway, a proxy in the way) says nothing about the others.
          if (is_member_failure(status, g)) {
            return self->failover(
                call, fmt::format("HTTP {}: {}", status, g.message.empty() ? std::string("no message") : g.message));
          }
          const std::size_t i = self->current;
          // etcd with auth on, asked without a user name.
          const bool no_user = g.message.find("user name is empty") != std::string::npos;
          EtcdError e{
              fmt::format("etcd at {} answered {} with HTTP {}: {}{}", self->endpoint_text(i), call->path, status,
                          g.message, no_user ? " (etcd has auth enabled: pass --rdzv-conf username=/password=)" : ""),
              self->options.endpoints[i].to_string(), g.code, g.code == 16 || g.code == 7 || no_user};
          e.permanent = is_etcd_refusal(status, g);
          self->finish(call, e, {});
        });
  }

  // One request/response on the unary connection. `done(transport_error, status, body)`.
  void exchange(const std::string& path, std::string body, const std::string& tok, std::size_t limit,
                std::function<void(const std::string&, unsigned, std::string, bool)> done) {
    auto ex = std::make_shared<Exchange>();
    ex->req = make_request(conn->endpoint(), path, std::move(body), tok);
    ex->limit = limit;
    ex->done = std::move(done);
    exchange_on(conn, ex, /*may_retry=*/true);
  }

  struct Exchange {
    http::request<http::string_body> req;
    std::optional<http::response_parser<http::string_body>> parser;
    std::size_t limit = 0;
    std::function<void(const std::string&, unsigned, std::string, bool)> done;
  };

  // The member closed a connection that sat idle between calls (its own idle limit, or a proxy's
  // or load balancer's): the request found it closed, or was read as the connection's end. Not
  // a failure of the member: the request goes again once, on a new connection to it.
  static bool closed_while_idle(const error_code& ec) {
    return ec == asio::error::eof || ec == http::error::end_of_stream || ec == asio::error::connection_reset ||
           ec == asio::error::broken_pipe || ec == ssl::error::stream_truncated;
  }

  void exchange_on(const std::shared_ptr<Conn>& c, const std::shared_ptr<Exchange>& ex, bool may_retry) {
    ex->parser.emplace();
    ex->parser->body_limit(ex->limit);
    ex->parser->header_limit(kHeaderLimit);
    auto self = shared_from_this();
    // Only a connection that has served a call before can have been closed while idle.
    const bool reused = may_retry && c->served() > 0;
    c->lowest().expires_after(options.request_timeout);
    c->with_stream([&](auto& s) {
      http::async_write(s, ex->req, [self, c, ex, reused](const error_code& ec, std::size_t) {
        if (self->closed || c != self->conn) return;
        if (ec && reused && closed_while_idle(ec)) return self->exchange_again(ex);
        if (ec) return ex->done("cannot send the request: " + describe(ec), 0, {}, false);
        c->with_stream([&](auto& s2) {
          http::async_read(s2, c->buffer(), *ex->parser, [self, c, ex, reused](const error_code& ec2, std::size_t) {
            if (self->closed || c != self->conn) return;
            if (ec2 && reused && closed_while_idle(ec2) && !ex->parser->got_some()) {
              return self->exchange_again(ex);
            }
            if (ec2) return ex->done("no reply: " + describe(ec2), 0, {}, ec2 == http::error::body_limit);
            auto& res = ex->parser->get();
            c->count_served();
            if (!res.keep_alive()) c->close();
            ex->done("", res.result_int(), std::move(res.body()), false);
          });
        });
      });
    });
  }

  void exchange_again(const std::shared_ptr<Exchange>& ex) {
    spdlog::debug("etcd: {} closed the idle connection; sending the request again on a new one",
                  endpoint_text(current));
    conn->close();
    conn = std::make_shared<Conn>(io, tls.get(), options.endpoints[current]);
    auto self = shared_from_this();
    auto c = conn;
    c->connect(options.connect_timeout, [self, c, ex](const std::string& err) {
      if (self->closed || c != self->conn) return;
      if (!err.empty()) return ex->done(err, 0, {}, false);
      self->exchange_on(c, ex, /*may_retry=*/false);
    });
  }

  void failover(std::shared_ptr<Call> call, const std::string& why) {
    if (closed) return;
    const std::size_t failed = current;
    call->errors += fmt::format("{}{}: {}", call->errors.empty() ? "" : "; ", endpoint_text(failed), why);
    if (why == kReplyTimedOut) ++call->timeouts;
    spdlog::debug("etcd: {} failed ({}); trying the next endpoint", endpoint_text(failed), why);
    if (conn) conn->close();
    conn.reset();
    current = (current + 1) % options.endpoints.size();
    call->token_retry = false;  // the next member may refuse the token as well: one refresh each
    endpoint_failed(failed);
    if (failed_hook) failed_hook(failed);
    if (++call->tried >= options.endpoints.size()) {
      EtcdError e{fmt::format("no etcd endpoint answered {}: {}", call->path.empty() ? "authenticate" : call->path,
                              call->errors),
                  options.endpoints[failed].to_string(), 0, false};
      e.timed_out = call->timeouts == call->tried;
      return finish(call, e, {});
    }
    run(std::move(call));
  }

  // ---- watches ----

  void endpoint_failed(std::size_t index) {
    for (auto& [id, w] : watches) {
      if (w->conn && w->endpoint == index && w->conn->open()) {
        w->conn->close();  // its read fails and it resumes on the next endpoint
      }
    }
  }

  std::uint64_t start_watch(WatchCreate create, WatchHandlers handlers) {
    auto w = std::make_shared<Watch>();
    w->id = next_watch_id++;
    w->next_revision = create.start_revision;
    w->create = std::move(create);
    w->handlers = std::move(handlers);
    w->endpoint = current;
    w->retry = std::make_unique<asio::steady_timer>(io);
    w->idle = std::make_unique<asio::steady_timer>(io);
    w->backoff =
        std::make_unique<Backoff>(Backoff::Options{std::chrono::milliseconds(50), std::chrono::seconds(2), 2.0, 0.3});
    watches[w->id] = w;
    connect_watch(w);
    return w->id;
  }

  void cancel(std::uint64_t id) {
    auto it = watches.find(id);
    if (it == watches.end()) return;
    auto w = it->second;
    w->cancelled = true;
    w->retry->cancel();
    w->idle->cancel();
    if (w->conn) w->conn->close();
    watches.erase(it);
  }

  bool alive(const std::shared_ptr<Watch>& w, std::uint64_t gen) const {
    return !closed && !w->cancelled && w->generation == gen;
  }

  void watch_broken(const std::shared_ptr<Watch>& w, const std::string& why, bool rotate) {
    if (closed || w->cancelled) return;
    ++w->generation;
    w->idle->cancel();
    if (w->conn) w->conn->close();
    w->conn.reset();
    w->pending.clear();
    const bool worked =
        w->stream_since && std::chrono::steady_clock::now() - *w->stream_since >= options.request_timeout;
    if (worked) w->backoff->reset();
    w->stream_since.reset();
    const std::string where = endpoint_text(w->endpoint);
    if (rotate) w->endpoint = (w->endpoint + 1) % options.endpoints.size();
    spdlog::debug("etcd: watch on {} broke ({}); resuming at revision {} on {}", where, why, w->next_revision,
                  endpoint_text(w->endpoint));
    if (w->handlers.on_reconnect) w->handlers.on_reconnect(where + ": " + why, worked);
    if (closed || w->cancelled) return;
    w->retry->expires_after(w->backoff->next_delay());
    auto self = shared_from_this();
    const std::uint64_t gen = w->generation;
    w->retry->async_wait([self, w, gen](const error_code& ec) {
      if (ec || !self->alive(w, gen)) return;
      self->connect_watch(w);
    });
  }

  void watch_fatal(const std::shared_ptr<Watch>& w, const std::string& message, int code) {
    if (closed || w->cancelled) return;
    EtcdError e{message, options.endpoints[w->endpoint].to_string(), code, false};
    auto handlers = w->handlers;
    cancel(w->id);
    if (handlers.on_error) handlers.on_error(e);
  }

  void connect_watch(std::shared_ptr<Watch> w) {
    if (closed || w->cancelled) return;
    const std::uint64_t gen = ++w->generation;
    if (!options.username.empty() && token.empty()) {
      // Authenticate through the unary path (it rotates endpoints and reports bad credentials).
      auto self = shared_from_this();
      submit("", "", [self, w, gen](const std::optional<EtcdError>& err, std::string) {
        if (!self->alive(w, gen)) return;
        if (err && err->auth_failed) return self->watch_fatal(w, err->message, err->grpc_code);
        if (err) return self->watch_broken(w, err->message, true);
        self->connect_watch(w);
      });
      return;
    }
    w->conn = std::make_shared<Conn>(io, tls.get(), options.endpoints[w->endpoint]);
    auto self = shared_from_this();
    w->conn->connect(options.connect_timeout, [self, w, gen](const std::string& err) {
      if (!self->alive(w, gen)) return;
      if (!err.empty()) return self->watch_broken(w, err, true);
      self->open_watch_stream(w, gen);
    });
  }

  struct Stream {
    http::request<http::string_body> req;
    http::response_parser<http::buffer_body> parser;
    std::array<char, 64 * 1024> chunk{};
    std::string error_body;
    unsigned status = 0;
  };

  void open_watch_stream(std::shared_ptr<Watch> w, std::uint64_t gen) {
    auto st = std::make_shared<Stream>();
    WatchCreate create = w->create;
    create.start_revision = w->next_revision;
    st->req = make_request(w->conn->endpoint(), "/v3/watch", encode_watch_create(create), token);
    st->parser.body_limit(boost::none);
    st->parser.header_limit(kHeaderLimit);
    auto self = shared_from_this();
    auto c = w->conn;
    c->lowest().expires_after(options.request_timeout);
    c->with_stream([&](auto& s) {
      http::async_write(s, st->req, [self, w, gen, c, st](const error_code& ec, std::size_t) {
        if (!self->alive(w, gen)) return;
        if (ec) return self->watch_broken(w, "cannot send the watch: " + describe(ec), true);
        c->with_stream([&](auto& s2) {
          http::async_read_header(s2, c->buffer(), st->parser,
                                  [self, w, gen, c, st](const error_code& ec2, std::size_t) {
                                    if (!self->alive(w, gen)) return;
                                    if (ec2) return self->watch_broken(w, "no watch reply: " + describe(ec2), true);
                                    st->status = st->parser.get().result_int();
                                    if (st->status == 200) {
                                      // A stream: no deadline, but silence for the idle timeout
                                      // reconnects it.
                                      c->lowest().expires_never();
                                      w->stream_since = std::chrono::steady_clock::now();
                                      self->arm_idle(w, gen);
                                    } else {
                                      // An error body is a reply like any other.
                                      c->lowest().expires_after(self->options.request_timeout);
                                    }
                                    self->read_watch(w, gen, st);
                                  });
        });
      });
    });
  }

  void read_watch(std::shared_ptr<Watch> w, std::uint64_t gen, std::shared_ptr<Stream> st) {
    st->parser.get().body().data = st->chunk.data();
    st->parser.get().body().size = st->chunk.size();
    auto self = shared_from_this();
    auto c = w->conn;
    c->with_stream([&](auto& s) {
      // The handler owns the connection (its buffer and stream) until the read completes:
      // watch_broken (the idle timer, a failed endpoint) closes the socket and drops w->conn
      // while this read is pending; the aborted read still writes to both.
      http::async_read_some(s, c->buffer(), st->parser, [self, w, gen, c, st](error_code ec, std::size_t) {
        if (!self->alive(w, gen)) return;
        if (ec == http::error::need_buffer) ec = {};
        const std::size_t got = st->chunk.size() - st->parser.get().body().size;
        if (got > 0 && st->status == 200) self->arm_idle(w, gen);
        if (got > 0 && !self->feed(w, gen, *st, std::string_view(st->chunk.data(), got))) return;
        if (!self->alive(w, gen)) return;
        if (ec) return self->watch_broken(w, "stream ended: " + describe(ec), true);
        if (st->parser.is_done()) {
          if (st->status != 200) return self->watch_http_error(w, *st);
          return self->watch_broken(w, "stream ended by the server", true);
        }
        self->read_watch(w, gen, st);
      });
    });
  }

  // A watch stream that says nothing for watch_idle_timeout may sit on a member that stalled
  // or was cut off without closing the connection: resume it (from the next revision, so
  // nothing is lost) on the same endpoint; one that does not answer moves it to the next.
  void arm_idle(const std::shared_ptr<Watch>& w, std::uint64_t gen) {
    if (options.watch_idle_timeout <= Duration::zero()) return;
    w->idle->expires_after(options.watch_idle_timeout);
    auto self = shared_from_this();
    w->idle->async_wait([self, w, gen](const error_code& ec) {
      if (ec || !self->alive(w, gen)) return;
      self->watch_broken(
          w,
          fmt::format("no message for {} ms",
                      std::chrono::duration_cast<std::chrono::milliseconds>(self->options.watch_idle_timeout).count()),
          false);
    });
  }

  void watch_http_error(const std::shared_ptr<Watch>& w, const Stream& st) {
    GatewayError g = decode_error(st.error_body);
    if (!options.username.empty() && is_invalid_token_error(g)) {
      token.clear();
      return watch_broken(w, g.message, false);
    }
    if (is_member_failure(st.status, g)) {
      return watch_broken(w, fmt::format("HTTP {}: {}", st.status, g.message), true);
    }
    watch_fatal(w,
                fmt::format("etcd at {} refused the watch on '{}' with HTTP {}: {}", endpoint_text(w->endpoint),
                            w->create.key, st.status, g.message),
                g.code);
  }

  // Splits the stream into newline-delimited messages. False once the watch was torn down.
  bool feed(const std::shared_ptr<Watch>& w, std::uint64_t gen, Stream& st, std::string_view bytes) {
    if (st.status != 200) {
      st.error_body.append(bytes.substr(0, kErrorBodyLimit - std::min(kErrorBodyLimit, st.error_body.size())));
      return true;
    }
    while (!bytes.empty()) {
      const std::size_t nl = bytes.find('\n');
      const std::string_view part = bytes.substr(0, nl);
      if (w->pending.size() + part.size() > options.max_watch_message_bytes) {
        watch_fatal(w,
                    fmt::format("etcd at {} sent a watch message over {} bytes", endpoint_text(w->endpoint),
                                options.max_watch_message_bytes),
                    0);
        return false;
      }
      w->pending.append(part);
      if (nl == std::string_view::npos) break;
      bytes.remove_prefix(nl + 1);
      std::string line = std::move(w->pending);
      w->pending.clear();
      if (line.find_first_not_of(" \r\t") == std::string::npos) continue;
      if (!handle_watch_line(w, line)) return false;
      if (!alive(w, gen)) return false;
    }
    return true;
  }

  bool handle_watch_line(const std::shared_ptr<Watch>& w, const std::string& line) {
    WatchMessage m;
    std::optional<GatewayError> se;
    if (std::string why = decode_watch_message(line, m, se); !why.empty()) {
      watch_fatal(w, fmt::format("etcd at {} sent a malformed watch message: {}", endpoint_text(w->endpoint), why), 0);
      return false;
    }
    if (se) {
      if (!options.username.empty() && is_invalid_token_error(*se)) {
        token.clear();
        watch_broken(w, se->message, false);
        return false;
      }
      if (is_failover_error(*se)) {
        watch_broken(w, se->message, true);
        return false;
      }
      watch_fatal(
          w,
          fmt::format("etcd at {} ended the watch on '{}': {}", endpoint_text(w->endpoint), w->create.key, se->message),
          se->code);
      return false;
    }
    if (m.created && w->next_revision == 0) w->next_revision = m.header.revision + 1;
    // A progress notification (asked with progress_notify): etcd sends it to a watcher that has
    // caught up, with the store's revision, after every event up to it. A quiet watch resumed
    // later starts there, not at its last event (possibly hours old: etcd would scan all the
    // history since, and cancel the watch once that was compacted).
    if (!m.created && !m.canceled && m.events.empty() && w->next_revision > 0 &&
        m.header.revision >= w->next_revision) {
      w->next_revision = m.header.revision + 1;
    }
    if (m.canceled) {
      if (m.compact_revision > 0) {
        watch_fatal(w,
                    fmt::format("etcd at {}: revision {} of '{}' was compacted (oldest kept: {}); "
                                "re-read the state",
                                endpoint_text(w->endpoint), w->next_revision, w->create.key, m.compact_revision),
                    11);
      } else {
        watch_fatal(w,
                    fmt::format("etcd at {} cancelled the watch on '{}': {}", endpoint_text(w->endpoint), w->create.key,
                                m.cancel_reason.empty() ? "no reason given" : m.cancel_reason),
                    0);
      }
      return false;
    }
    if (m.events.empty()) return true;
    std::int64_t last = 0;
    for (const WatchEvent& e : m.events) last = std::max(last, e.kv.mod_revision);
    // A resumed stream may repeat what was delivered before the break: drop it.
    if (last < w->next_revision) return true;
    std::erase_if(m.events, [&](const WatchEvent& e) { return e.kv.mod_revision < w->next_revision; });
    w->next_revision = last + 1;
    w->backoff->reset();
    if (w->handlers.on_message) w->handlers.on_message(m);
    return true;
  }

  void shutdown() {
    if (closed) return;
    closed = true;
    if (conn) conn->close();
    conn.reset();
    for (auto& [id, w] : watches) {
      w->cancelled = true;
      w->retry->cancel();
      w->idle->cancel();
      if (w->conn) w->conn->close();
    }
    watches.clear();
    queue.clear();
  }
};

EtcdClient::EtcdClient(asio::io_context& io, EtcdClientOptions options)
    : impl_(std::make_shared<Impl>(io, std::move(options))) {}

EtcdClient::~EtcdClient() { impl_->shutdown(); }

void EtcdClient::shutdown() { impl_->shutdown(); }

std::string EtcdClient::endpoints_text() const {
  std::string s;
  for (std::size_t i = 0; i < impl_->options.endpoints.size(); ++i) s += (i == 0 ? "" : ",") + impl_->endpoint_text(i);
  return s;
}

namespace {

// Submits a call whose 200 reply decodes into T. A reply that does not decode fails over to the
// next endpoint like a member that does not answer; the caller sees the value or the error.
template <class T, class Decode>
void submit_typed(EtcdClient::Impl& impl, std::string path, std::string body, EtcdCallback<T> done, Decode decode) {
  auto value = std::make_shared<T>();
  impl.submit(
      std::move(path), std::move(body),
      [done = std::move(done), value](const std::optional<EtcdError>& err, std::string) {
        if (!done) return;
        if (err) return done(err, T{});
        done(std::nullopt, std::move(*value));
      },
      [decode, value](std::string_view reply) {
        *value = T{};
        return decode(reply, *value);
      });
}

}  // namespace

void EtcdClient::range(RangeRequest request, EtcdCallback<RangeResponse> done) {
  submit_typed<RangeResponse>(*impl_, "/v3/kv/range", encode_range(request), std::move(done), decode_range);
}

namespace {

struct PagedRange {
  EtcdClient* client = nullptr;
  RangeRequest first;  // as the caller asked (limit and revision ignored)
  RangeRequest next;   // the next page
  std::size_t max_total = 0;
  std::size_t response_cap = 0;
  std::size_t bytes = 0;  // keys and values read so far, with each key's own size
  int restarts = 0;       // reads begun anew after a compaction
  RangeResponse out;
  EtcdCallback<RangeResponse> done;
};

// The first page is one key (values may be up to etcd's request limit, 1.5 MiB by default); the
// next ones follow the largest key seen.
constexpr std::int64_t kFirstPageKeys = 1;
constexpr std::int64_t kMostPageKeys = 4096;

std::string range_text(const RangeRequest& r) {
  return r.range_end.empty() ? fmt::format("'{}'", r.key) : fmt::format("'{}' .. '{}'", r.key, r.range_end);
}

void read_page(const std::shared_ptr<PagedRange>& p) {
  p->client->range(p->next, [p](const std::optional<EtcdError>& err, RangeResponse r) {
    if (err) {
      // Too large for the response cap, or too slow to come within the request timeout on every
      // member (a slow link to etcd): the next try asks for half the keys.
      if ((err->too_large || err->timed_out) && p->next.limit > 1) {
        p->next.limit = std::max<std::int64_t>(1, p->next.limit / 2);
        return read_page(p);
      }
      // The snapshot's revision was compacted between two pages: read it all again.
      if (p->next.revision != 0 && err->grpc_code == 11 && err->message.find("compacted") != std::string::npos &&
          p->restarts < 3) {
        ++p->restarts;
        p->next = p->first;
        p->next.limit = kFirstPageKeys;
        p->next.revision = 0;
        p->bytes = 0;
        p->out = RangeResponse{};
        return read_page(p);
      }
      EtcdError e = *err;
      if (e.grpc_code == 11) e.permanent = false;  // compacted again: a later read may work
      if (e.too_large) e.permanent = true;         // one key over the cap: no retry reads it
      return p->done(e, RangeResponse{});
    }
    // A page holds at most the keys asked for, in increasing order, inside the range and after
    // the previous page. A broken endpoint or a proxy replaying one page could otherwise have
    // the read go on without end, or fill memory with empty keys.
    {
      const std::string& end = p->first.range_end;
      const auto inside = [&](const std::string& k) {
        if (k < p->next.key) return false;
        if (end.empty()) return k == p->first.key;
        return (end.size() == 1 && end[0] == '\0') || k < end;
      };
      bool fits = p->next.limit <= 0 || static_cast<std::int64_t>(r.kvs.size()) <= p->next.limit;
      for (std::size_t i = 0; fits && i < r.kvs.size(); ++i) {
        fits = inside(r.kvs[i].key) && (i == 0 || r.kvs[i - 1].key < r.kvs[i].key);
      }
      if (!fits) {
        EtcdError e;
        e.message = fmt::format(
            "etcd {} answered a read of the keys {} with {} keys that are not a page of that range in order "
            "(limit {}): not etcd's answer (a proxy or cache between ddprun and etcd?)",
            p->client->endpoints_text(), range_text(p->first), r.kvs.size(), p->next.limit);
        e.permanent = true;
        return p->done(e, RangeResponse{});
      }
    }
    if (p->next.revision == 0) {
      p->out.header = r.header;
      p->next.revision = r.header.revision;
    }
    std::size_t largest = 1;
    for (const KeyValue& kv : r.kvs) {
      // What a key costs in memory, not only its bytes: empty keys are not free.
      p->bytes += kv.key.size() + kv.value.size() + sizeof(KeyValue);
      largest = std::max(largest, kv.key.size() + kv.value.size());
    }
    if (p->bytes > p->max_total) {
      EtcdError e;
      e.message = fmt::format(
          "the keys {} in etcd {} hold over {} ({} read in {} keys at revision {}), more than is read at once",
          range_text(p->first), p->client->endpoints_text(), size_text(p->max_total), size_text(p->bytes),
          p->out.kvs.size() + r.kvs.size(), p->next.revision);
      e.permanent = true;
      return p->done(e, RangeResponse{});
    }
    const bool more = r.more && !r.kvs.empty();
    std::string last = r.kvs.empty() ? std::string() : r.kvs.back().key;
    if (p->out.kvs.empty()) {
      p->out.kvs = std::move(r.kvs);
    } else {
      p->out.kvs.insert(p->out.kvs.end(), std::make_move_iterator(r.kvs.begin()), std::make_move_iterator(r.kvs.end()));
    }
    if (!more) {
      p->out.more = false;
      p->out.count = static_cast<std::int64_t>(p->out.kvs.size());
      return p->done(std::nullopt, std::move(p->out));
    }
    // The next page starts right after the last key; its size aims at an eighth of the
    // response cap for keys as large as the largest of this page (JSON carries them in base64,
    // 4/3 of their size, plus a little per key), so a page also comes within the request
    // timeout. A larger one halves the page (too_large).
    p->next.key = std::move(last);
    p->next.key.push_back('\0');
    const std::size_t per_key = largest / 3 * 4 + 256;
    p->next.limit =
        std::clamp<std::int64_t>(static_cast<std::int64_t>(p->response_cap / 8 / per_key), 1, kMostPageKeys);
    read_page(p);
  });
}

}  // namespace

void EtcdClient::range_all(RangeRequest request, std::size_t max_total_bytes, EtcdCallback<RangeResponse> done) {
  auto p = std::make_shared<PagedRange>();
  p->client = this;
  p->first = request;
  p->first.limit = 0;
  p->first.revision = 0;
  p->next = p->first;
  p->next.limit = kFirstPageKeys;
  p->max_total = max_total_bytes;
  p->response_cap = impl_->options.max_response_bytes;
  p->done = std::move(done);
  read_page(p);
}

void EtcdClient::put(PutRequest request, EtcdCallback<ResponseHeader> done) {
  submit_typed<ResponseHeader>(*impl_, "/v3/kv/put", encode_put(request), std::move(done), decode_header_only);
}

void EtcdClient::delete_range(DeleteRangeRequest request, EtcdCallback<ResponseHeader> done) {
  submit_typed<ResponseHeader>(*impl_, "/v3/kv/deleterange", encode_delete_range(request), std::move(done),
                               decode_header_only);
}

void EtcdClient::txn(TxnRequest request, EtcdCallback<TxnResponse> done) {
  submit_typed<TxnResponse>(*impl_, "/v3/kv/txn", encode_txn(request), std::move(done), decode_txn);
}

void EtcdClient::lease_grant(std::int64_t ttl_seconds, EtcdCallback<LeaseGrantResponse> done) {
  submit_typed<LeaseGrantResponse>(*impl_, "/v3/lease/grant", encode_lease_grant(ttl_seconds), std::move(done),
                                   decode_lease_grant);
}

void EtcdClient::lease_keepalive(std::int64_t id, EtcdCallback<LeaseKeepAliveResponse> done) {
  auto decode = [](std::string_view body, LeaseKeepAliveResponse& out) -> std::string {
    std::optional<GatewayError> se;
    std::string why = decode_lease_keepalive(body, out, se);
    if (why.empty() && se) return "stream error: " + se->message;
    return why;
  };
  submit_typed<LeaseKeepAliveResponse>(*impl_, "/v3/lease/keepalive", encode_lease_id(id), std::move(done), decode);
}

void EtcdClient::lease_revoke(std::int64_t id, EtcdCallback<ResponseHeader> done) {
  submit_typed<ResponseHeader>(*impl_, "/v3/lease/revoke", encode_lease_id(id), std::move(done), decode_header_only);
}

std::uint64_t EtcdClient::watch(WatchCreate create, WatchHandlers handlers) {
  return impl_->start_watch(std::move(create), std::move(handlers));
}

void EtcdClient::cancel_watch(std::uint64_t id) { impl_->cancel(id); }

void EtcdClient::set_endpoint_failed_hook(std::function<void(std::size_t index)> hook) {
  impl_->failed_hook = std::move(hook);
}

void EtcdClient::endpoint_failed(std::size_t index) {
  if (!impl_->closed) impl_->endpoint_failed(index);
}

}  // namespace ddprun::rendezvous::etcd
