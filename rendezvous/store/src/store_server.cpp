// StoreServer: Asio shell around StoreState (store_server.hpp has the contract).
//
// Per connection: one read buffer parsed incrementally (every complete request in it is
// executed per read), one pending-output string filled by the state machine, and at most one
// async_write in flight (the pending bytes are swapped into the in-flight buffer). Replies
// produced while handling one read are written with one async_write.
#include "ddprun/rendezvous/store_server.hpp"


#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ip/v6_only.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <cstring>
#include <unordered_map>
#include <vector>

#include "ddprun/common/endpoint.hpp"
#include "ddprun/common/error.hpp"
#include "ddprun/rendezvous/codec.hpp"

namespace ddprun::rendezvous {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

namespace {

constexpr std::size_t initial_buffer = 4 * 1024;  // like libuv's; grows for big requests
constexpr std::size_t min_read_space = 2 * 1024;
constexpr std::size_t shrink_above = 1024 * 1024;
// A client that sends requests but does not read the replies stops being read once this much
// output is queued for it, so it cannot grow the server's memory without bound.
constexpr std::size_t max_queued_output = 16 * 1024 * 1024;

std::string endpoint_text(const tcp::endpoint& ep) {
  return bracket_host(ep.address().to_string()) + ":" + std::to_string(ep.port());
}

std::string bind_hint(const boost::system::error_code& ec) {
  if (ec == asio::error::address_in_use) return "port in use: pick another --port or use --port 0";
  if (ec == asio::error::access_denied) return "ports below 1024 need privileges: pick a port >= 1024 or use --port 0";
  if (ec == boost::system::errc::address_not_available) {
    return "the address is not one of this machine's: bind 0.0.0.0, :: or a local address";
  }
  return "check --host and --port";
}

struct Connection {
  explicit Connection(tcp::socket s) : socket(std::move(s)) {}
  tcp::socket socket;
  ConnectionId id = 0;
  std::string peer;
  std::vector<char> in;
  std::size_t begin = 0;   // first unparsed byte
  std::size_t end = 0;     // one past the last received byte
  std::size_t need = 1;    // do not parse before this many unparsed bytes are buffered
  DecoderState decoder;
  std::string pending;     // produced, not yet handed to async_write
  std::string writing;     // owned by the async_write in flight
  bool write_in_flight = false;
  bool read_paused = false;  // output backlog over max_queued_output
  bool dirty = false;
  bool closed = false;
};

using ConnectionPtr = std::shared_ptr<Connection>;

}  // namespace

// Shared with every pending handler, so a handler that runs after StoreServer is gone (the
// io_context outlived it) finds `stopped` set instead of a dangling pointer.
struct Core : Outbox, std::enable_shared_from_this<Core> {
  Core(asio::io_context& io_, StoreServerOptions opts)
      : io(io_), options(std::move(opts)), acceptor(io_), retry_timer(io_), state(options.limits) {}

  asio::io_context& io;
  StoreServerOptions options;
  tcp::acceptor acceptor;
  asio::steady_timer retry_timer;
  StoreState state;
  std::unordered_map<ConnectionId, ConnectionPtr> connections;
  std::function<void()> on_drained;  // StoreServer::on_drained: run once no connection is open
  ConnectionId next_id = 1;
  ConnectionPtr current;
  std::vector<ConnectionPtr> dirty;
  Request request;
  std::string scratch;
  std::string bound_host;
  std::uint16_t bound_port = 0;
  bool started = false;
  bool stopped = false;
  StoreStats counters;

  std::string& buffer(ConnectionId id) override {
    Connection* c = nullptr;
    if (current && current->id == id) {
      c = current.get();
      if (!c->dirty) {
        c->dirty = true;
        dirty.push_back(current);
      }
      return c->pending;
    }
    auto it = connections.find(id);
    if (it == connections.end()) {
      scratch.clear();
      return scratch;
    }
    if (!it->second->dirty) {
      it->second->dirty = true;
      dirty.push_back(it->second);
    }
    return it->second->pending;
  }

  void bind() {
    const std::string& host = options.host;
    boost::system::error_code ec;
    asio::ip::address addr = asio::ip::make_address(host, ec);
    if (ec) {
      tcp::resolver resolver(io);
      auto results = resolver.resolve(host, std::to_string(options.port), tcp::resolver::passive, ec);
      if (ec || results.empty()) {
        throw NetworkError(fmt::format("cannot listen on {}:{}: cannot resolve host '{}': {}", bracket_host(host),
                                       options.port, host, ec ? ec.message() : "no address"),
                           "pass an IP address or a resolvable host name with --host");
      }
      addr = results.begin()->endpoint().address();
    }
    ec = try_bind(tcp::endpoint(addr, options.port));
    if (ec && addr.is_v6() && addr.to_v6().is_unspecified() &&
        (ec == asio::error::address_family_not_supported || ec == boost::system::errc::address_not_available)) {
      spdlog::info("IPv6 unavailable ({}), listening on 0.0.0.0 instead of ::", ec.message());
      addr = asio::ip::address_v4::any();
      ec = try_bind(tcp::endpoint(addr, options.port));
    }
    if (ec) {
      throw NetworkError(fmt::format("cannot listen on {}:{}: {}", bracket_host(host), options.port, ec.message()),
                         bind_hint(ec));
    }
    bound_host = addr.to_string();
    bound_port = acceptor.local_endpoint().port();
  }

  boost::system::error_code try_bind(const tcp::endpoint& ep) {
    boost::system::error_code ec;
    if (acceptor.is_open()) acceptor.close(ec);
    acceptor.open(ep.protocol(), ec);
    if (ec) return ec;
    if (ep.address().is_v6()) acceptor.set_option(asio::ip::v6_only(false), ec);
    if (options.reuse_address) acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
    acceptor.bind(ep, ec);
    if (ec) return ec;
    acceptor.listen(std::max(options.backlog, static_cast<int>(asio::socket_base::max_listen_connections)), ec);
    return ec;
  }

  void do_accept() {
    if (stopped) return;
    acceptor.async_accept([self = shared_from_this()](boost::system::error_code ec, tcp::socket socket) {
      if (self->stopped) return;
      if (ec) {
        if (ec == asio::error::operation_aborted) return;
        // EMFILE and friends: accepting again at once would spin; retry shortly.
        spdlog::warn("store: accept failed on port {}: {} (raise the open-files limit, ulimit -n)",
                     self->bound_port, ec.message());
        self->retry_timer.expires_after(std::chrono::milliseconds(100));
        self->retry_timer.async_wait([self](boost::system::error_code tec) {
          if (!tec) self->do_accept();
        });
        return;
      }
      self->on_accept(std::move(socket));
      self->do_accept();
    });
  }

  void on_accept(tcp::socket socket) {
    boost::system::error_code ec;
    auto peer_ep = socket.remote_endpoint(ec);
    std::string peer = ec ? std::string("unknown peer") : endpoint_text(peer_ep);
    if (connections.size() >= options.limits.max_connections) {
      ++counters.connections_rejected;
      ++counters.refused_connection_limit;
      spdlog::warn("store: closing new connection from {}: connection limit of {} reached (--max-connections)",
                   peer, options.limits.max_connections);
      socket.close(ec);
      return;
    }
    socket.set_option(tcp::no_delay(true), ec);
    auto c = std::make_shared<Connection>(std::move(socket));
    c->id = next_id++;
    c->peer = std::move(peer);
    c->decoder.accept_legacy = options.accept_legacy;
    c->in.resize(initial_buffer);
    connections.emplace(c->id, c);
    ++counters.connections_total;
    spdlog::debug("store: connection {} from {}", c->id, c->peer);
    start_read(c);
  }

  void start_read(const ConnectionPtr& c) {
    if (c->closed) return;
    if (c->begin == c->end) {
      c->begin = c->end = 0;
      if (c->in.size() > shrink_above) {
        c->in.resize(initial_buffer);
        c->in.shrink_to_fit();
      }
    }
    const std::size_t want = std::max(min_read_space, c->need > c->end - c->begin ? c->need - (c->end - c->begin) : 0);
    if (c->in.size() - c->end < want) {
      if (c->begin > 0) {
        std::memmove(c->in.data(), c->in.data() + c->begin, c->end - c->begin);
        c->end -= c->begin;
        c->begin = 0;
      }
      if (c->in.size() - c->end < want) c->in.resize(std::max(c->in.size() * 2, c->end + want));
    }
    c->socket.async_read_some(asio::buffer(c->in.data() + c->end, c->in.size() - c->end),
                              [self = shared_from_this(), c](boost::system::error_code ec, std::size_t n) {
                                self->on_read(c, ec, n);
                              });
  }

  void on_read(const ConnectionPtr& c, boost::system::error_code ec, std::size_t n) {
    if (c->closed || stopped) return;
    if (ec) {
      if (ec == asio::error::eof || ec == asio::error::connection_reset) {
        spdlog::debug("store: connection {} from {} closed by peer", c->id, c->peer);
        close(c, {}, false);
      } else if (ec != asio::error::operation_aborted) {
        close(c, fmt::format("read failed: {}", ec.message()), false);
      }
      flush();
      return;
    }
    c->end += n;
    counters.bytes_in += n;
    process(c);
    flush();
    if (c->closed) return;
    if (c->pending.size() + c->writing.size() > max_queued_output) {
      c->read_paused = true;  // resumed by the write completion
      return;
    }
    start_read(c);
  }

  // Executes every complete request buffered on `c`.
  void process(const ConnectionPtr& c) {
    current = c;
    while (!c->closed && c->end - c->begin >= c->need) {
      const std::string_view view(c->in.data() + c->begin, c->end - c->begin);
      DecodeResult r = decode_request(view, c->decoder, options.limits, request);
      if (r.status == DecodeStatus::extension) {
        if (!options.extension) {
          close(c, fmt::format("opcode 0x{:02x} is in the extension range and no extension is installed",
                               static_cast<unsigned char>(view[0])), true);
          break;
        }
        r = options.extension->on_frame(c->id, view, state, *this);
      } else if (r.status == DecodeStatus::ok) {
        ++counters.requests;
        ++counters.ops[static_cast<std::size_t>(request.op)];
        ApplyResult res = state.apply(c->id, request, *this);
        if (!res.ok) {
          close(c, fmt::format("{} failed: {}", op_name(request.op), res.reason), true);
          break;
        }
      }
      if (r.status == DecodeStatus::ok) {
        c->begin += r.consumed;
        c->need = 1;
      } else if (r.status == DecodeStatus::need_more) {
        c->need = std::max<std::size_t>(r.min_total, (c->end - c->begin) + 1);
        break;
      } else {
        close(c, r.reason, true);
        break;
      }
    }
    current.reset();
  }

  void flush() {
    for (auto& c : dirty) {
      c->dirty = false;
      if (!c->closed) start_write(c);
    }
    dirty.clear();
  }

  void start_write(const ConnectionPtr& c) {
    if (c->write_in_flight || c->pending.empty()) return;
    c->writing.swap(c->pending);
    c->pending.clear();
    c->write_in_flight = true;
    counters.bytes_out += c->writing.size();
    asio::async_write(c->socket, asio::buffer(c->writing),
                      [self = shared_from_this(), c](boost::system::error_code ec, std::size_t) {
                        c->write_in_flight = false;
                        c->writing.clear();
                        if (c->closed || self->stopped) return;
                        if (ec) {
                          self->close(c, fmt::format("write failed: {}", ec.message()), false);
                          return;
                        }
                        self->start_write(c);
                        if (c->read_paused && c->pending.size() + c->writing.size() <= max_queued_output) {
                          c->read_paused = false;
                          self->start_read(c);
                        }
                      });
  }

  // `reason` empty: a normal close. `protocol_error`: counted and logged as a warning.
  void close(const ConnectionPtr& c, const std::string& reason, bool protocol_error) {
    if (c->closed) return;
    c->closed = true;
    if (protocol_error) {
      ++counters.connections_rejected;
      ++counters.closed_protocol_error;
      spdlog::warn("store: closing connection from {}: {}", c->peer, reason);
    } else if (!reason.empty()) {
      spdlog::debug("store: closing connection from {}: {}", c->peer, reason);
    }
    state.disconnect(c->id);
    if (options.extension) options.extension->on_disconnect(c->id);
    boost::system::error_code ec;
    c->socket.shutdown(tcp::socket::shutdown_both, ec);
    c->socket.close(ec);
    connections.erase(c->id);
    if (connections.empty() && on_drained) notify_drained();
  }

  void notify_drained() {
    asio::post(io, [cb = std::move(on_drained)] { cb(); });
    on_drained = nullptr;
  }

  void close_all() {
    std::vector<ConnectionPtr> all;
    all.reserve(connections.size());
    for (auto& [id, c] : connections) all.push_back(c);
    for (auto& c : all) close(c, {}, false);
  }
};

struct StoreServer::Impl {
  std::shared_ptr<Core> core;
};

StoreServer::StoreServer(asio::io_context& io, StoreServerOptions options) : impl_(std::make_unique<Impl>()) {
  impl_->core = std::make_shared<Core>(io, std::move(options));
  impl_->core->bind();
}

StoreServer::~StoreServer() { stop(); }

std::uint16_t StoreServer::port() const { return impl_->core->bound_port; }
const std::string& StoreServer::host() const { return impl_->core->bound_host; }

void StoreServer::start() {
  auto& core = *impl_->core;
  if (core.started || core.stopped) return;
  core.started = true;
  core.do_accept();
}

void StoreServer::stop() {
  if (!impl_) return;
  auto& core = *impl_->core;
  if (core.stopped) return;
  core.stopped = true;
  boost::system::error_code ec;
  core.acceptor.close(ec);
  core.retry_timer.cancel();
  core.close_all();
}

void StoreServer::reset() {
  auto& core = *impl_->core;
  core.state.clear();
  if (core.options.extension) core.options.extension->on_reset();
  if (!core.connections.empty()) spdlog::info("store: reset, closing {} connection(s)", core.connections.size());
  core.close_all();
}

void StoreServer::on_drained(std::function<void()> callback) {
  auto& core = *impl_->core;
  core.on_drained = std::move(callback);
  if (core.connections.empty() && core.on_drained) core.notify_drained();
}

StoreStats StoreServer::stats() const {
  const auto& core = *impl_->core;
  StoreStats s = core.counters;
  s.connections = core.connections.size();
  s.keys = core.state.num_keys();
  s.bytes = core.state.bytes();
  s.pending_waits = core.state.pending_waits();
  return s;
}

void StoreServer::send(ConnectionId conn, std::string_view bytes) {
  auto& core = *impl_->core;
  auto it = core.connections.find(conn);
  if (it == core.connections.end()) return;
  it->second->pending.append(bytes);
  core.start_write(it->second);
}

void StoreServer::close_connection(ConnectionId conn, std::string_view reason) {
  auto& core = *impl_->core;
  auto it = core.connections.find(conn);
  if (it == core.connections.end()) return;
  core.close(ConnectionPtr(it->second), std::string(reason), true);
}

}  // namespace ddprun::rendezvous
