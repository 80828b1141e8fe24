// StoreServer: Asio shell around StoreState (store_server.hpp has the contract).
//
// Per connection: one read buffer parsed incrementally (every complete request in it is
// executed per read), one pending-output string filled by the state machine, and at most one
// async_write in flight (the pending bytes are swapped into the in-flight buffer). Replies
// produced while handling one read are written with one async_write. The read buffer exists
// only while bytes are buffered: a connection with nothing buffered waits for readability
// without one (16,384 ranks idle in a WAIT hold no read buffers) and takes a fresh one per read.
//
// Memory accounting: every connection's read-buffer size plus queued reply capacity is summed
// in Core::buffered (Core::account keeps it exact), checked against max_buffered_bytes. One
// sweep timer (not one per connection) enforces the frame, idle, handshake and link stall
// timeouts.
#include "ddprun/rendezvous/store_server.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ip/v6_only.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <iterator>
#include <list>
#include <optional>
#include <unordered_map>
#include <vector>

#include "ddprun/common/endpoint.hpp"
#include "ddprun/common/error.hpp"
#include "ddprun/common/rate_limited_warning.hpp"
#include "ddprun/rendezvous/codec.hpp"
#include "ddprun/rendezvous/link_stall.hpp"
#include "ddprun/rendezvous/relay_link.hpp"

namespace ddprun::rendezvous {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

namespace {

constexpr std::size_t initial_buffer = 4 * 1024;  // like libuv's; grows for big requests
constexpr std::size_t min_read_space = 2 * 1024;
constexpr std::size_t shrink_above = 1024 * 1024;
// A client that sends requests but does not read the replies stops being read (and its
// buffered requests stop being executed) once this much output is queued for it; the hard
// per-connection cap is StoreLimits::max_queued_reply_bytes.
constexpr std::size_t pause_output_above = 4 * 1024 * 1024;

using Clock = std::chrono::steady_clock;

constexpr std::size_t idx(RefusedReason r) { return static_cast<std::size_t>(r); }

// Descriptors kept free beyond --max-connections for the process's own files, pipes and the
// accept-and-close path: an eighth of the open-files limit, between 32 and 1024.
std::size_t descriptor_reserve(std::size_t nofile) { return std::clamp<std::size_t>(nofile / 8, 32, 1024); }

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
  std::string peer_address;  // without the port: the key of the per-peer connection count
  std::vector<char> in;
  std::size_t begin = 0;  // first unparsed byte
  std::size_t end = 0;    // one past the last received byte
  std::size_t need = 1;   // do not parse before this many unparsed bytes are buffered
  DecoderState decoder;
  std::string pending;  // produced, not yet handed to async_write
  std::string writing;  // owned by the async_write in flight
  bool write_in_flight = false;
  bool read_paused = false;  // output backlog over pause_output_above
  bool dirty = false;
  bool closed = false;
  std::size_t accounted = 0;  // this connection's share of Core::buffered
  std::string overflow;       // set by reserve_push or shed: why the connection must be closed
  RefusedReason overflow_reason = RefusedReason::buffer_limit;
  Clock::time_point last_active;  // last byte received or written
  Clock::time_point frame_start;  // first byte of the request still incomplete in `in`
  Clock::time_point accepted;
  // When its writes last moved (link_stall.hpp): what the link stall timeout measures, for a
  // relay link.
  LinkStallClock stall;
  // Listed in Core::awaiting (a socket) or Core::awaiting_relayed while the extension awaits its
  // handshake (awaiting_authentication); null once it authenticated or closed.
  std::list<ConnectionId>* awaiting_in = nullptr;
  std::list<ConnectionId>::iterator awaiting_pos;
  // Relays (relay_link.hpp): a relayed connection has no socket; its bytes arrive and leave as
  // relay frames numbered `vid` on the connection `link`. A link (is_link) carries `relayed`.
  std::weak_ptr<Connection> link;
  std::uint32_t vid = 0;
  bool is_link = false;
  bool trusted_frames = false;  // a link whose relay asked for TRUSTED frames
  bool peer_gone = false;       // the relay reported the close: no CLOSE goes back
  bool parked = false;          // a relayed connection listed in its link's `parked_relayed`
  bool frames_first = false;    // a link: whose turn it is at the next write completion
  std::unordered_map<std::uint32_t, std::shared_ptr<Connection>> relayed;
  // Relayed connections whose requests wait, oldest first, until the link's backlog is under
  // pause_output_above again (the link's write completion resumes them).
  std::vector<std::weak_ptr<Connection>> parked_relayed;
  bool relayed_conn() const { return vid != 0; }
  std::size_t queued() const { return pending.size() + writing.size(); }
};

using ConnectionPtr = std::shared_ptr<Connection>;

}  // namespace

// Shared with every pending handler, so a handler that runs after StoreServer is gone (the
// io_context outlived it) finds `stopped` set instead of a dangling pointer.
struct Core : Outbox, std::enable_shared_from_this<Core> {
  Core(asio::io_context& io_, StoreServerOptions opts)
      : io(io_),
        options(std::move(opts)),
        acceptor(io_),
        retry_timer(io_),
        sweep_timer(io_),
        refuse_flush_timer(io_),
        state(options.limits) {
    max_connections = clamp_connections();
    // Called from inside this object's own handlers only, so `this` is alive.
    refuse_warning.on_suppressing = [this] { arm_refuse_flush(); };
    // Half the hard cap, so that a pipelining client's small fixed-size replies can never carry
    // its backlog past the cap before it is paused.
    // At least one byte: with a zero cap every reply is refused (and the connection closed) rather
    // than its requests never executed.
    pause_above = std::max<std::size_t>(1, std::min(pause_output_above, options.limits.max_queued_reply_bytes / 2));
  }
  ~Core() override {
    if (spare_fd >= 0) ::close(spare_fd);
  }

  asio::io_context& io;
  StoreServerOptions options;
  tcp::acceptor acceptor;
  asio::steady_timer retry_timer;
  asio::steady_timer sweep_timer;
  // Says how many refusals refuse_warning did not show once a flood of them stops (no next line
  // would carry the count).
  asio::steady_timer refuse_flush_timer;
  StoreState state;
  std::size_t max_connections = 0;  // options.limits.max_connections after the open-files clamp
  std::size_t buffered = 0;         // sum of every connection's `accounted`
  std::size_t pause_above = pause_output_above;
  std::size_t pushed = 0;  // bytes admitted by reserve_push since the last flush (not yet accounted)
  std::unordered_map<std::string, std::size_t> per_peer;  // open connections per peer address
  int spare_fd = -1;                                      // released to accept-and-close when out of descriptors
  RateLimitedWarning refuse_warning;
  std::unordered_map<ConnectionId, ConnectionPtr> connections;
  // Socket connections the extension still awaits a handshake from, oldest first: closed after
  // options.handshake_timeout, and the first to give way at the connection limit.
  std::list<ConnectionId> awaiting;
  std::list<ConnectionId> awaiting_relayed;  // the same for connections carried by relays
  std::function<void()> on_drained;          // StoreServer::on_drained: run once no connection is open
  ConnectionId next_id = 1;
  std::size_t relayed_count = 0;  // relayed connections open (they hold no descriptor)
  std::size_t link_count = 0;     // relay links open
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

  std::size_t reply_room(ConnectionId id) override {
    const Connection* c = nullptr;
    if (current && current->id == id) {
      c = current.get();
    } else {
      auto it = connections.find(id);
      if (it == connections.end()) return static_cast<std::size_t>(-1);
      c = it->second.get();
    }
    const std::size_t cap = options.limits.max_queued_reply_bytes;
    const std::size_t queued = backlog(*c);
    return queued >= cap ? 0 : cap - queued;
  }

  bool reserve_push(ConnectionId id, std::size_t n) override {
    ConnectionPtr c;
    if (current && current->id == id) {
      c = current;
    } else {
      auto it = connections.find(id);
      if (it == connections.end()) return false;
      c = it->second;
    }
    if (!c->overflow.empty()) return false;
    const std::size_t cap = options.limits.max_queued_reply_bytes;
    if (backlog(*c) + n > cap) {
      c->overflow = fmt::format(
          "{} reply bytes queued{} and {} more pushed by another client's write, over the limit "
          "of {} (--max-queued-reply-bytes): the client does not read its replies",
          backlog(*c), c->relayed_conn() ? " (with its relay link's)" : "", n, cap);
    } else if (buffered + pushed + n > options.limits.max_buffered_bytes) {
      c->overflow = fmt::format(
          "{} bytes pushed by another client's write do not fit: the server's buffers hold {} "
          "bytes, the limit is {} (--max-buffered-bytes), and this connection has {} unread",
          n, buffered + pushed, options.limits.max_buffered_bytes, c->queued());
    } else {
      pushed += n;
      return true;
    }
    if (!c->dirty) {
      c->dirty = true;
      dirty.push_back(c);
    }
    return false;
  }

  bool shed(ConnectionId id, const std::string& why) override {
    auto it = connections.find(id);
    if (it == connections.end() || (current && current->id == id)) return false;
    const ConnectionPtr& c = it->second;
    if (c->overflow.empty()) {
      c->overflow = why;
      c->overflow_reason = RefusedReason::wait_limit;
    }
    mark_dirty(c);  // closed by the flush after this request
    return true;
  }

  std::string make_relay_link(ConnectionId id, bool trusted_frames) override {
    auto it = connections.find(id);
    if (it == connections.end()) return "the connection is gone";
    Connection& c = *it->second;
    if (c.relayed_conn())
      return "a relayed connection cannot carry relays itself (relays of relays: not supported yet)";
    if (c.is_link) return "the connection is a relay link already";
    c.is_link = true;
    c.trusted_frames = trusted_frames;
    ++link_count;
    spdlog::info("store: connection {} from {} is a relay link", c.id, c.peer);
    return {};
  }

  void mark_dirty(const ConnectionPtr& c) {
    if (!c->dirty) {
      c->dirty = true;
      dirty.push_back(c);
    }
  }

  static std::size_t nofile_soft() {
    rlimit rl{};
    return ::getrlimit(RLIMIT_NOFILE, &rl) == 0 ? static_cast<std::size_t>(rl.rlim_cur) : 0;
  }

  std::size_t clamp_connections() const {
    const std::size_t wanted = options.limits.max_connections;
    rlimit rl{};
    if (::getrlimit(RLIMIT_NOFILE, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return wanted;
    const auto nofile = static_cast<std::size_t>(rl.rlim_cur);
    const std::size_t reserve = descriptor_reserve(nofile);
    const std::size_t allowed = nofile > reserve + 1 ? nofile - reserve : 1;
    if (wanted <= allowed) return wanted;
    const auto level = wanted == StoreLimits{}.max_connections ? spdlog::level::debug : spdlog::level::info;
    spdlog::log(level,
                "store: --max-connections {} lowered to {}: the open-files limit is {} and {} descriptors are kept "
                "in reserve (raise ulimit -n to allow more connections)",
                wanted, allowed, nofile, reserve);
    return allowed;
  }

  // What `c` holds besides its read buffer: replies, and the spans of a many-key request being
  // received (16 bytes a key, as much as its 8-byte lengths of empty keys).
  static std::size_t held_besides_input(const Connection& c) {
    return c.pending.capacity() + c.writing.capacity() + c.decoder.spans.capacity() * sizeof(DecoderState::Span);
  }

  // Brings `c`'s share of `buffered` up to date with its buffers. A closed connection holds none
  // (close() took its share back).
  void account(Connection& c) {
    if (c.closed) return;
    const std::size_t now = c.in.size() + held_besides_input(c);
    buffered = buffered - c.accounted + now;
    c.accounted = now;
  }

  // The reply bytes that wait for `c`'s client: a relayed connection's replies move onto its
  // link at once, so the link's backlog is its backlog too (and the back-pressure on it).
  static std::size_t backlog(const Connection& c) {
    std::size_t n = c.queued();
    if (c.relayed_conn()) {
      if (auto link = c.link.lock()) n += link->queued();
    }
    return n;
  }

  // After replies were queued: closes a connection past its own cap (shed_if_over_budget, at the
  // flush's end, then handles the budget of all buffers together).
  void enforce_output_caps(const ConnectionPtr& c) {
    if (c->closed) return;
    account(*c);
    if (!c->overflow.empty()) {
      close(c, c->overflow, c->overflow_reason);
    } else if (c->queued() >
               options.limits.max_queued_reply_bytes + (c->is_link ? options.limits.max_value_bytes : std::size_t{0})) {
      // A link's backlog stays under the pause threshold plus the last request's reply (the
      // back-pressure on its relayed connections); past the cap plus one value its relay does
      // not read.
      close(c,
            c->is_link
                ? fmt::format("{} reply bytes queued on the relay link, over the limit of {} "
                              "(--max-queued-reply-bytes plus --max-value-bytes): the relay does not read them",
                              c->queued(), options.limits.max_queued_reply_bytes + options.limits.max_value_bytes)
                : fmt::format("{} reply bytes queued, over the limit of {} (--max-queued-reply-bytes): the "
                              "client does not read its replies",
                              c->queued(), options.limits.max_queued_reply_bytes),
            RefusedReason::buffer_limit);
    }
  }

  // A read buffer of `need` bytes does not fit the budget (`over`): what idle connections keep
  // goes first, then the connections that hold more of the budget than `need`, largest first,
  // give way (the same rule as shed_if_over_budget). Clients that pipeline requests and never
  // read, or that start large requests and never finish them, cannot keep everybody else from
  // sending a large request.
  template <typename Over>
  void make_buffer_room(const ConnectionPtr& c, std::size_t need, const Over& over) {
    trim_kept_buffers();
    if (!over()) return;
    const bool shed = shed_largest(c.get(), need, over, [&](const Connection& conn) {
      return fmt::format(
          "the server's buffers hold {} bytes, over the limit of {} (--max-buffered-bytes), another client's request "
          "needs {} bytes, and this connection holds more: {}",
          buffered, options.limits.max_buffered_bytes, need, holding_text(conn));
    });
    if (shed) flush();  // what the closes queued for others (an extension's notices)
  }

  // What `conn` holds of the budget, for the message that closes it.
  static std::string holding_text(const Connection& conn) {
    return fmt::format("{} bytes of replies it has not read and {} bytes of requests received but not run",
                       conn.queued(), conn.end - conn.begin);
  }

  // Closes the connections (but `keep`, and never a relay link: what it holds is its relayed
  // connections' traffic, bounded by back-pressure) that hold more than `above` bytes of the
  // budget (read buffer and replies), largest first, while `over()`; `why(conn)` says why. True
  // when it closed one.
  template <typename Over, typename Why>
  bool shed_largest(const Connection* keep, std::size_t above, const Over& over, const Why& why) {
    std::vector<ConnectionPtr> by_size;
    for (auto& [id, conn] : connections) {
      if (conn.get() != keep && !conn->closed && !conn->is_link && conn->accounted > above) by_size.push_back(conn);
    }
    std::sort(by_size.begin(), by_size.end(),
              [](const ConnectionPtr& a, const ConnectionPtr& b) { return a->accounted > b->accounted; });
    bool shed = false;
    for (auto& conn : by_size) {
      if (!over()) break;
      close(conn, why(*conn), RefusedReason::buffer_limit);
      shed = true;
    }
    return shed;
  }

  // What idle connections keep for their next reply (up to shrink_above per buffer): giving it
  // back loses nothing.
  void trim_kept_buffers() {
    for (auto& [id, conn] : connections) {
      if (conn->closed) continue;
      bool trimmed = false;
      if (conn->pending.empty() && conn->pending.capacity() > std::string().capacity()) {
        std::string().swap(conn->pending);
        trimmed = true;
      }
      if (!conn->write_in_flight && conn->writing.capacity() > std::string().capacity()) {
        std::string().swap(conn->writing);
        trimmed = true;
      }
      if (trimmed) account(*conn);
    }
  }

  void shed_if_over_budget() {
    if (buffered <= options.limits.max_buffered_bytes) return;
    // First what idle connections keep for their next reply: kept, a few hundred idle
    // connections that once read a large value held the budget and got innocent clients with a
    // reply in flight closed.
    trim_kept_buffers();
    // Then whoever holds the most: unread replies and half-sent requests alike. Shedding by reply
    // backlog alone let connections that each sent most of a large frame and stopped hold the
    // whole budget while clients with a reply in flight were closed.
    shed_largest(
        nullptr, 0, [&] { return buffered > options.limits.max_buffered_bytes; },
        [&](const Connection& conn) {
          return fmt::format(
              "the server's buffers hold {} bytes, over the limit of {} (--max-buffered-bytes), and this connection "
              "holds the most: {}",
              buffered, options.limits.max_buffered_bytes, holding_text(conn));
        });
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
        if ((ec == asio::error::no_descriptors || ec == boost::system::errc::too_many_files_open_in_system) &&
            self->refuse_with_spare_descriptor()) {
          self->do_accept();
          return;
        }
        // EMFILE and friends: accepting again at once would spin; retry shortly.
        spdlog::warn("store: accept failed on port {}: {} (raise the open-files limit, ulimit -n)", self->bound_port,
                     ec.message());
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

  // Out of descriptors: frees the spare one, accepts a pending connection, closes it with a log
  // line and takes the spare back. False when there was no spare or nothing to accept.
  bool refuse_with_spare_descriptor() {
    if (spare_fd < 0) return false;
    pollfd ready{acceptor.native_handle(), POLLIN, 0};
    if (::poll(&ready, 1, 0) != 1) return false;  // nothing pending: accept() would block
    ::close(spare_fd);
    spare_fd = -1;
    sockaddr_storage addr{};
    socklen_t len = sizeof addr;
    const int fd = ::accept4(acceptor.native_handle(), reinterpret_cast<sockaddr*>(&addr), &len, SOCK_CLOEXEC);
    bool refused = false;
    if (fd >= 0) {
      std::string peer = "unknown peer";
      tcp::endpoint ep;
      if (len <= ep.capacity()) {
        std::memcpy(ep.data(), &addr, len);
        ep.resize(len);
        peer = endpoint_text(ep);
      }
      ++counters.connections_rejected;
      ++counters.refused[idx(RefusedReason::out_of_descriptors)];
      refuse_warning.warn(
          "store: closing new connection from {}: out of file descriptors (raise ulimit -n or lower "
          "--max-connections)",
          peer);
      ::close(fd);
      refused = true;
    }
    spare_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    return refused;
  }

  void on_accept(tcp::socket socket) {
    boost::system::error_code ec;
    auto peer_ep = socket.remote_endpoint(ec);
    std::string peer = ec ? std::string("unknown peer") : endpoint_text(peer_ep);
    std::string peer_address = ec ? std::string() : peer_ep.address().to_string();
    // The address's own cap first: a connection refused for it makes nobody else give way.
    const std::size_t per_peer_cap = options.limits.max_connections_per_peer;
    if (per_peer_cap != 0 && !peer_address.empty()) {
      auto it = per_peer.find(peer_address);
      if (it != per_peer.end() && it->second >= per_peer_cap) {
        ++counters.connections_rejected;
        ++counters.refused[idx(RefusedReason::peer_limit)];
        refuse_warning.warn(
            "store: closing new connection from {}: {} connections from that address are open, the "
            "limit per address (--max-connections-per-peer)",
            peer, it->second);
        socket.close(ec);
        return;
      }
    }
    if (connections.size() - relayed_count >= max_connections) {
      evict_oldest_awaiting(awaiting, fmt::format("{} (--max-connections)", max_connections), true);
    }
    if (connections.size() - relayed_count >= max_connections) {
      ++counters.connections_rejected;
      // An agent's worker store has no --max-connections of its own: there the cap is the
      // open-files clamp alone, and the line must say so.
      refuse_warning.warn("store: closing new connection from {}: connection limit of {} reached (--max-connections){}",
                          peer, max_connections,
                          max_connections < options.limits.max_connections
                              ? fmt::format("; lowered from {} by the open-files limit (ulimit -n {}): raise ulimit -n",
                                            options.limits.max_connections, nofile_soft())
                              : std::string());
      ++counters.refused[idx(RefusedReason::connection_limit)];
      socket.close(ec);
      return;
    }
    socket.set_option(tcp::no_delay(true), ec);
    socket.non_blocking(true, ec);  // on_readable reads with read_some, which must not block
    auto c = std::make_shared<Connection>(std::move(socket));
    c->id = next_id++;
    c->peer = std::move(peer);
    c->peer_address = std::move(peer_address);
    c->decoder.accept_legacy = options.accept_legacy;
    c->last_active = Clock::now();
    c->accepted = c->last_active;
    account(*c);
    if (!c->peer_address.empty()) ++per_peer[c->peer_address];
    connections.emplace(c->id, c);
    start_awaiting(*c, awaiting);
    ++counters.connections_total;
    spdlog::debug("store: connection {} from {}", c->id, c->peer);
    start_read(c);
  }

  void start_read(const ConnectionPtr& c) {
    if (c->closed) return;
    if (c->begin == c->end) {
      // Nothing buffered: hold no read buffer while waiting (most connections of a big job sit
      // in a WAIT or idle for the whole run); on_readable takes one when bytes arrive.
      c->begin = c->end = 0;
      if (!c->in.empty()) {
        std::vector<char>().swap(c->in);
        account(*c);
      }
      c->socket.async_wait(tcp::socket::wait_read,
                           [self = shared_from_this(), c](boost::system::error_code ec) { self->on_readable(c, ec); });
      return;
    }
    const std::size_t want = std::max(min_read_space, c->need > c->end - c->begin ? c->need - (c->end - c->begin) : 0);
    if (c->in.size() - c->end < want) {
      if (c->begin > 0) {
        std::memmove(c->in.data(), c->in.data() + c->begin, c->end - c->begin);
        c->end -= c->begin;
        c->begin = 0;
      }
      if (c->in.size() - c->end < min_read_space) {
        // Grow with the bytes that arrived (doubling what is buffered), never to a length the
        // request only declares: a header announcing 64 MiB costs nothing until they arrive.
        const std::size_t grown = std::min(c->end + want, std::max(c->in.size() * 2, c->end + min_read_space));
        if (!size_read_buffer(c, grown)) return;
      }
    }
    c->socket.async_read_some(
        asio::buffer(c->in.data() + c->end, c->in.size() - c->end),
        [self = shared_from_this(), c](boost::system::error_code ec, std::size_t n) { self->on_read(c, ec, n); });
  }

  // Resizes `c`'s read buffer to `size` bytes within --max-buffered-bytes, making room first
  // (make_buffer_room); false when even then it does not fit: `c` is closed.
  bool size_read_buffer(const ConnectionPtr& c, std::size_t size) {
    const auto over = [&] {
      return buffered - c->accounted + size + held_besides_input(*c) > options.limits.max_buffered_bytes;
    };
    if (over()) make_buffer_room(c, size, over);
    // The room was made by closing others, whose notices were flushed: that may have closed `c`
    // too (shed as the largest holder).
    if (c->closed) return false;
    if (over()) {
      close(c,
            fmt::format("its read buffer of {} bytes (for a request of at least {} bytes) does not fit: the server's "
                        "buffers hold {} bytes, the limit is {} (--max-buffered-bytes)",
                        size, c->need, buffered, options.limits.max_buffered_bytes),
            RefusedReason::buffer_limit);
      flush();
      return false;
    }
    c->in.resize(size);
    account(*c);
    return true;
  }

  // The socket became readable with nothing buffered: read into a fresh buffer.
  void on_readable(const ConnectionPtr& c, boost::system::error_code ec) {
    if (c->closed || stopped) return;
    std::size_t n = 0;
    if (!ec) {
      // Even the first read buffer is paid from the budget: a crowd of connections that each
      // send a few bytes and stop must not push it over and get others shed.
      if (!size_read_buffer(c, initial_buffer)) return;
      n = c->socket.read_some(asio::buffer(c->in.data(), c->in.size()), ec);
      if (ec == asio::error::would_block || ec == asio::error::try_again || ec == asio::error::interrupted) {
        start_read(c);  // a spurious wake-up: wait again (start_read drops the buffer)
        return;
      }
    }
    on_read(c, ec, n);
  }

  void on_read(const ConnectionPtr& c, boost::system::error_code ec, std::size_t n) {
    if (c->closed || stopped) return;
    if (ec) {
      if (ec == asio::error::eof || ec == asio::error::connection_reset) {
        spdlog::debug("store: connection {} from {} closed by peer", c->id, c->peer);
        close(c, {});
      } else if (ec != asio::error::operation_aborted) {
        close(c, fmt::format("read failed: {}", ec.message()));
      }
      flush();
      return;
    }
    const auto now = Clock::now();
    if (c->begin == c->end) c->frame_start = now;
    c->last_active = now;
    c->end += n;
    counters.bytes_in += n;
    process(c);
    flush();
    if (c->closed) return;
    if (c->queued() >= pause_above) {
      c->read_paused = true;  // resumed by the write completion
      return;
    }
    start_read(c);
  }

  // Executes every complete request buffered on `c`.
  // Stops early, leaving requests buffered, once the connection's queued replies pass
  // pause_output_above; the write completion resumes it.
  void process(const ConnectionPtr& c) {
    if (c->is_link) {
      process_link(c);
      return;
    }
    current = c;
    try {
      process_requests(c);
    } catch (const std::exception& e) {
      // A request this server could not handle (memory exhausted, a reply too large to frame)
      // ends its own connection, not the server and every other client with it.
      close(c, fmt::format("internal error while handling its request: {}", e.what()), RefusedReason::protocol_error);
    }
    current.reset();
    if (c->is_link && !c->closed) process_link(c);
  }

  void process_requests(const ConnectionPtr& c) {
    // A connection marked for closing (shed, or pushed past its cap) runs nothing more.
    while (!c->closed && c->overflow.empty() && c->end - c->begin >= c->need && backlog(*c) < pause_above) {
      const std::string_view view(c->in.data() + c->begin, c->end - c->begin);
      // A connection that still owes the extension its handshake may send only the extension's
      // frames (0x40 and up): a store request is refused at its first byte, before its body is
      // read (a 64 MiB SET or a WAIT on 128 Ki keys would be buffered whole first, and many such
      // connections could hold the whole buffer budget without the token).
      if (c->awaiting_in != nullptr && options.extension &&
          static_cast<unsigned char>(view[0]) < extension_opcode_base) {
        if (std::string why = options.extension->store_op_refusal(c->id); !why.empty()) {
          close(c,
                fmt::format("a store request (opcode 0x{:02x}) refused: {}", static_cast<unsigned char>(view[0]), why),
                RefusedReason::unauthenticated);
          break;
        }
      }
      DecodeResult r = decode_request(view, c->decoder, options.limits, request);
      if (r.status == DecodeStatus::extension) {
        if (!options.extension) {
          close(c,
                fmt::format("opcode 0x{:02x} is in the extension range and no extension is installed",
                            static_cast<unsigned char>(view[0])),
                RefusedReason::protocol_error);
          break;
        }
        r = options.extension->on_frame(c->id, view, state, *this);
        if (c->awaiting_in != nullptr && !options.extension->awaiting_authentication(c->id)) {
          stop_awaiting(*c);
          tell_trusted(*c);
        }
      } else if (r.status == DecodeStatus::ok) {
        if (options.extension) {
          if (std::string why = options.extension->store_op_refusal(c->id); !why.empty()) {
            close(c, fmt::format("{} refused: {}", op_name(request.op), why), RefusedReason::unauthenticated);
            break;
          }
        }
        ++counters.requests;
        ++counters.ops[static_cast<std::size_t>(request.op)];
        ApplyResult res = state.apply(c->id, request, *this);
        if (!res.ok) {
          close(c, fmt::format("{} failed: {}", op_name(request.op), res.reason), RefusedReason::protocol_error);
          break;
        }
      }
      if (r.status == DecodeStatus::ok) {
        c->begin += r.consumed;
        c->need = 1;
        c->frame_start = c->last_active;
        if (c->is_link) break;  // RELAY was accepted: the rest are relay frames
      } else if (r.status == DecodeStatus::need_more) {
        c->need = std::max<std::size_t>(r.min_total, (c->end - c->begin) + 1);
        account(*c);  // the spans of a many-key request grew
        break;
      } else {
        close(c, r.reason, RefusedReason::protocol_error);
        break;
      }
    }
  }

  // ---- Relays (relay_link.hpp): the frames of a relay link ----

  // Executes every complete relay frame buffered on `link`; stops, like process(), while the
  // link's own output backlog is over pause_output_above (its write completion resumes it).
  void process_link(const ConnectionPtr& link) {
    RelayFrame f;
    while (!link->closed && link->end - link->begin >= link->need && link->queued() < pause_above) {
      const std::string_view view(link->in.data() + link->begin, link->end - link->begin);
      const RelayDecodeResult r = decode_relay_frame(view, f);
      if (r.status == RelayDecodeResult::Status::error) {
        close(link, r.reason, RefusedReason::protocol_error);
        return;
      }
      if (r.status == RelayDecodeResult::Status::need_more) {
        link->need = std::max<std::size_t>(r.min_total, (link->end - link->begin) + 1);
        return;
      }
      relay_event(link, f);
      if (link->closed) return;
      link->begin += r.consumed;
      link->need = 1;
      link->frame_start = link->last_active;
    }
  }

  static std::string address_of(std::string_view peer) {
    const auto colon = peer.rfind(':');
    std::string_view host = colon == std::string_view::npos ? peer : peer.substr(0, colon);
    if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
    return std::string(host);
  }

  void relay_event(const ConnectionPtr& link, const RelayFrame& f) {
    auto it = link->relayed.find(f.vid);
    switch (f.op) {
      case RelayOp::open:
        if (it != link->relayed.end()) {
          close(link, fmt::format("relay link: OPEN of connection {}, which is open already", f.vid),
                RefusedReason::protocol_error);
          return;
        }
        open_relayed(link, f.vid, f.payload);
        return;
      case RelayOp::data:
        // A vid that is gone was closed here while the relay was still sending: ignored.
        if (it != link->relayed.end()) deliver(ConnectionPtr(it->second), f.payload);
        return;
      case RelayOp::close:
        if (it != link->relayed.end()) {
          ConnectionPtr c = it->second;
          c->peer_gone = true;
          spdlog::debug("store: relayed connection {} from {} closed by peer", c->id, c->peer);
          close(c, {});
        }
        return;
      case RelayOp::trusted:
        close(link,
              fmt::format("relay link: TRUSTED of connection {} from the relay (only the daemon sends it)", f.vid),
              RefusedReason::protocol_error);
        return;
    }
  }

  // Tells the relay carrying `c` (if it asked) that `c` no longer awaits a handshake: at the
  // relay's own --max-connections it is then never the one that gives way.
  void tell_trusted(const Connection& c) {
    if (!c.relayed_conn()) return;
    ConnectionPtr link = c.link.lock();
    if (!link || link->closed || !link->trusted_frames) return;
    append_relay_frame(link->pending, RelayOp::trusted, c.vid, {});
    mark_dirty(link);
  }

  void open_relayed(const ConnectionPtr& link, std::uint32_t vid, std::string_view peer_text) {
    const bool printable =
        std::all_of(peer_text.begin(), peer_text.end(), [](char ch) { return ch > 0x20 && ch < 0x7f; });
    std::string peer = printable && !peer_text.empty() ? std::string(peer_text) : std::string("unknown peer");
    std::string address = printable ? address_of(peer_text) : std::string();
    std::string refusal;
    RefusedReason reason = RefusedReason::connection_limit;
    if (const std::size_t cap = options.limits.max_connections_per_peer; cap != 0 && !address.empty()) {
      auto pit = per_peer.find(address);
      if (pit != per_peer.end() && pit->second >= cap) {
        reason = RefusedReason::peer_limit;
        refusal = fmt::format(
            "{} connections from that address are open, the limit per address "
            "(--max-connections-per-peer)",
            pit->second);
      }
    }
    if (refusal.empty() && relayed_count >= options.limits.max_relayed_connections) {
      evict_oldest_awaiting(awaiting_relayed,
                            fmt::format("{} (--max-relayed-connections)", options.limits.max_relayed_connections),
                            false);
      if (relayed_count >= options.limits.max_relayed_connections || link->closed) {
        refusal = fmt::format("relayed connection limit of {} reached (--max-relayed-connections)",
                              options.limits.max_relayed_connections);
      }
    }
    if (!refusal.empty()) {
      ++counters.connections_rejected;
      ++counters.refused[idx(reason)];
      refuse_warning.warn("store: closing new connection from {} (via relay {}): {}", peer, link->peer, refusal);
      refusal.resize(std::min(refusal.size(), max_relay_reason_bytes));
      append_relay_frame(link->pending, RelayOp::close, vid, refusal);
      mark_dirty(link);
      return;
    }
    auto c = std::make_shared<Connection>(tcp::socket(io));
    c->id = next_id++;
    c->peer = peer + " (via relay " + link->peer + ")";
    c->peer_address = std::move(address);
    c->decoder.accept_legacy = options.accept_legacy;
    c->last_active = Clock::now();
    c->accepted = c->last_active;
    c->link = link;
    c->vid = vid;
    if (!c->peer_address.empty()) ++per_peer[c->peer_address];
    connections.emplace(c->id, c);
    link->relayed.emplace(vid, c);
    ++relayed_count;
    start_awaiting(*c, awaiting_relayed);
    if (c->awaiting_in == nullptr) tell_trusted(*c);  // no handshake awaited from it
    ++counters.connections_total;
    spdlog::debug("store: connection {} from {}", c->id, c->peer);
  }

  // Bytes of a relayed connection's stream: buffered and executed like a socket's read.
  void deliver(const ConnectionPtr& c, std::string_view data) {
    const auto now = Clock::now();
    if (c->begin == c->end) {
      c->begin = c->end = 0;
      c->frame_start = now;
    }
    c->last_active = now;
    if (c->in.size() - c->end < data.size()) {
      if (c->begin > 0) {
        std::memmove(c->in.data(), c->in.data() + c->begin, c->end - c->begin);
        c->end -= c->begin;
        c->begin = 0;
      }
      if (c->in.size() - c->end < data.size()) {
        const std::size_t grown = std::max({c->in.size() * 2, c->end + data.size(), initial_buffer});
        if (buffered - c->accounted + grown + held_besides_input(*c) > options.limits.max_buffered_bytes) {
          close(c,
                fmt::format("{} more bytes do not fit: the server's buffers hold {} bytes, the limit is {} "
                            "(--max-buffered-bytes)",
                            data.size(), buffered, options.limits.max_buffered_bytes),
                RefusedReason::buffer_limit);
          return;
        }
        c->in.resize(grown);
      }
    }
    std::memcpy(c->in.data() + c->end, data.data(), data.size());
    c->end += data.size();
    account(*c);
    if (c->read_paused) {
      // Its relay cannot be told to stop reading this one client: what it sends while its
      // requests wait is bounded here, beyond the request being received.
      const std::size_t waiting = c->end - c->begin;
      if (waiting > std::max(pause_above, c->need)) {
        close(c,
              fmt::format("{} bytes of requests wait while its replies back up on the relay link (more than {}): "
                          "the client sends requests without reading the replies",
                          waiting, pause_above),
              RefusedReason::buffer_limit);
      }
      return;  // resumed once its link's backlog is under pause_output_above
    }
    run_relayed(c);
    if (c->closed) return;
    if (c->begin == c->end) {
      // Nothing left unparsed: hold no buffer while the client is quiet (start_read does the same).
      c->begin = c->end = 0;
      std::vector<char>().swap(c->in);
      account(*c);
    }
  }

  // A relayed connection's replies go onto its link as DATA frames.
  void write_relayed(const ConnectionPtr& c) {
    if (c->pending.empty()) return;
    auto link = c->link.lock();
    if (!link || link->closed) return;  // closed with the link
    const std::string_view bytes(c->pending);
    for (std::size_t at = 0; at < bytes.size(); at += max_relay_data_bytes) {
      append_relay_frame(link->pending, RelayOp::data, c->vid, bytes.substr(at, max_relay_data_bytes));
    }
    if (c->pending.capacity() > shrink_above) {
      std::string().swap(c->pending);
    } else {
      c->pending.clear();
    }
    account(*c);
    mark_dirty(link);
    c->last_active = Clock::now();
  }

  // Runs a relayed connection's buffered requests and moves their replies onto the link at once,
  // so that the next connection on the link sees the link's backlog. Once that backlog passes
  // pause_output_above the connection waits, parked on the link, and the link is not read
  // either (process_link): one client that pipelines requests and never reads cannot push the
  // link past its cap, which would end every connection the relay carries.
  void run_relayed(const ConnectionPtr& c) {
    process(c);
    if (c->closed) return;
    write_relayed(c);
    if (c->end - c->begin >= c->need && backlog(*c) >= pause_above) {
      c->read_paused = true;
      auto link = c->link.lock();
      if (link && !link->closed && !c->parked) {
        c->parked = true;
        link->parked_relayed.push_back(c);
      }
    }
  }

  // The link's backlog went under pause_output_above: its parked connections run, oldest
  // first, until it is over again (the rest wait for the next write completion).
  void resume_parked(const ConnectionPtr& link) {
    auto list = std::move(link->parked_relayed);
    link->parked_relayed.clear();
    for (auto& weak : list) {
      auto c = weak.lock();
      if (!c || c->closed) continue;
      if (link->closed || link->queued() >= pause_above) {
        link->parked_relayed.push_back(c);  // still parked, in its turn
        continue;
      }
      c->parked = false;
      c->read_paused = false;
      c->frame_start = Clock::now();  // the wait was the server's doing
      run_relayed(c);
    }
  }

  void flush() {
    // close() may run extension hooks that queue more output: iterate over a stable copy.
    while (!dirty.empty()) {
      std::vector<ConnectionPtr> batch;
      batch.swap(dirty);
      for (auto& c : batch) {
        c->dirty = false;
        enforce_output_caps(c);
        if (!c->closed) start_write(c);
      }
    }
    pushed = 0;
    shed_if_over_budget();
  }

  void start_write(const ConnectionPtr& c) {
    if (c->relayed_conn()) {
      write_relayed(c);
      return;
    }
    if (c->write_in_flight || c->pending.empty()) return;
    c->writing.swap(c->pending);
    c->pending.clear();
    c->write_in_flight = true;
    c->stall.write_started(Clock::now());
    counters.bytes_out += c->writing.size();
    // The completion condition runs after every partial write: the time of the last one is what
    // the link stall timeout measures (a link that drains slowly keeps making progress).
    const auto progress = [c](const boost::system::error_code& ec, std::size_t n) -> std::size_t {
      c->stall.wrote(n, Clock::now());
      return ec ? 0 : std::size_t{65536};  // asio's transfer_all
    };
    asio::async_write(c->socket, asio::buffer(c->writing), progress,
                      [self = shared_from_this(), c](boost::system::error_code ec, std::size_t) {
                        c->write_in_flight = false;
                        if (c->writing.capacity() > shrink_above) {
                          std::string().swap(c->writing);
                        } else {
                          c->writing.clear();
                        }
                        if (c->closed || self->stopped) return;
                        self->account(*c);
                        if (ec) {
                          self->close(c, fmt::format("write failed: {}", ec.message()));
                          return;
                        }
                        c->last_active = Clock::now();
                        self->start_write(c);
                        // A link's parked connections and its own frames (the other clients' new
                        // requests) take turns at the room each write makes: either alone could
                        // refill it every time and starve the other.
                        const bool parked_first = c->is_link && !c->frames_first;
                        if (c->is_link) c->frames_first = !c->frames_first;
                        if (parked_first && !self->resume_link_parked(c)) return;
                        if (c->read_paused && c->queued() < self->pause_above) {
                          c->read_paused = false;
                          c->frame_start = c->last_active;  // the pause was the server's doing
                          self->process(c);                 // requests left buffered when the pause began
                          self->flush();
                          if (c->closed) return;
                          if (c->queued() >= self->pause_above) {
                            c->read_paused = true;
                            return;
                          }
                          self->start_read(c);
                        }
                        if (c->is_link && !parked_first) self->resume_link_parked(c);
                      });
  }

  // resume_parked when the link has room, then flush; false when the link closed meanwhile.
  bool resume_link_parked(const ConnectionPtr& link) {
    if (link->parked_relayed.empty() || link->queued() >= pause_above) return true;
    resume_parked(link);
    flush();
    return !link->closed;
  }

  // Lists a new connection in `list` when the extension awaits its handshake.
  void start_awaiting(Connection& c, std::list<ConnectionId>& list) {
    if (!options.extension || !options.extension->awaiting_authentication(c.id)) return;
    c.awaiting_in = &list;
    c.awaiting_pos = list.insert(list.end(), c.id);
  }

  void stop_awaiting(Connection& c) {
    if (c.awaiting_in == nullptr) return;
    c.awaiting_in->erase(c.awaiting_pos);
    c.awaiting_in = nullptr;
  }

  // At a connection limit: the oldest connection in `list` (not authenticated yet) gives way. An
  // agent completes its handshake within a round trip of connecting, so the oldest one waiting is
  // a client that never will (holding slots that way would lock every agent out of a token daemon).
  // `flush_now`: false inside a relay link's frames (the handler that runs them flushes after).
  void evict_oldest_awaiting(std::list<ConnectionId>& list, std::string_view limit, bool flush_now) {
    if (list.empty()) return;
    const ConnectionPtr oldest = connections.at(list.front());
    close(oldest,
          fmt::format("it has not authenticated {} ms after connecting; closed to admit a new connection at the "
                      "limit of {}",
                      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - oldest->accepted).count(),
                      limit),
          RefusedReason::connection_limit);
    if (flush_now) flush();
  }

  // `reason` empty: a normal close. With `refused`: counted under that reason and logged as a
  // warning.
  void close(const ConnectionPtr& c, const std::string& reason, std::optional<RefusedReason> refused = std::nullopt) {
    if (c->closed) return;
    c->closed = true;
    stop_awaiting(*c);
    if (refused) {
      ++counters.connections_rejected;
      ++counters.refused[idx(*refused)];
      spdlog::warn("store: closing connection from {}: {}", c->peer, reason);
    } else if (!reason.empty()) {
      spdlog::debug("store: closing connection from {}: {}", c->peer, reason);
    }
    state.disconnect(c->id);
    if (options.extension) {
      // The close goes on whatever the extension's bookkeeping does (e.g. out of memory while it
      // tells a job that a node went): the socket, its budget and its slot are freed below.
      try {
        options.extension->on_disconnect(c->id);
      } catch (const std::exception& e) {
        spdlog::error("store: while closing the connection from {}: {}", c->peer, e.what());
      }
    }
    if (c->is_link) {
      // Every connection the link carried ends with it (their nodes see a disconnect).
      auto carried = std::move(c->relayed);
      c->relayed.clear();
      for (auto& [vid, rc] : carried) {
        rc->peer_gone = true;
        close(rc, "its relay link closed");
      }
      --link_count;
    }
    if (c->relayed_conn()) {
      close_relayed(c, reason);
      return;
    }
    boost::system::error_code ec;
    if (refused && !c->write_in_flight && !c->pending.empty()) {
      // Best effort, never blocking: the frame that explains the close (an extension's
      // REFUSED) usually fits the socket's send buffer.
      c->socket.non_blocking(true, ec);
      if (!ec) c->socket.write_some(asio::buffer(c->pending), ec);
    }
    if (refused && c->write_in_flight) {
      // Closed with a write the peer has not taken (it does not read, or reads too slowly for a
      // cap): a graceful close would leave the kernel holding the unsent bytes, a send buffer's
      // worth, behind a FIN the peer never sees while its window stays shut. A reset frees them
      // and tells the peer at once.
      c->socket.set_option(tcp::socket::linger(true, 0), ec);
    } else {
      c->socket.shutdown(tcp::socket::shutdown_both, ec);
    }
    c->socket.close(ec);
    buffered -= c->accounted;
    c->accounted = 0;
    if (!c->peer_address.empty()) {
      auto it = per_peer.find(c->peer_address);
      if (it != per_peer.end() && --it->second == 0) per_peer.erase(it);
    }
    connections.erase(c->id);
    if (connections.empty() && on_drained) notify_drained();
  }

  // The rest of close() for a relayed connection: what it had queued (a REFUSED that explains
  // the close) and a CLOSE go onto the link, unless the relay reported the close itself.
  void close_relayed(const ConnectionPtr& c, const std::string& reason) {
    if (auto link = c->link.lock(); link && !link->closed) {
      if (!c->peer_gone) {
        if (!c->pending.empty()) {
          const std::string_view bytes(c->pending);
          for (std::size_t at = 0; at < bytes.size(); at += max_relay_data_bytes) {
            append_relay_frame(link->pending, RelayOp::data, c->vid, bytes.substr(at, max_relay_data_bytes));
          }
        }
        append_relay_frame(link->pending, RelayOp::close, c->vid,
                           std::string_view(reason).substr(0, max_relay_reason_bytes));
        mark_dirty(link);
      }
      link->relayed.erase(c->vid);
    }
    --relayed_count;
    buffered -= c->accounted;
    c->accounted = 0;
    if (!c->peer_address.empty()) {
      auto it = per_peer.find(c->peer_address);
      if (it != per_peer.end() && --it->second == 0) per_peer.erase(it);
    }
    connections.erase(c->id);
    if (connections.empty() && on_drained) notify_drained();
  }

  // One timer for every connection's frame, idle, handshake and link stall timeouts, armed only
  // when one is enabled; it runs every shortest timeout / 4 (5 ms to 1 s).
  std::chrono::milliseconds shortest_timeout() const {
    using std::chrono::milliseconds;
    milliseconds shortest{0};
    const milliseconds handshake = options.extension ? options.handshake_timeout : milliseconds(0);
    for (milliseconds t : {options.frame_timeout, options.idle_timeout, handshake, options.link_stall_timeout,
                           options.reply_stall_timeout}) {
      if (t.count() > 0 && (shortest.count() == 0 || t < shortest)) shortest = t;
    }
    return shortest;
  }

  std::chrono::milliseconds sweep_period() const {
    using std::chrono::milliseconds;
    return std::clamp(shortest_timeout() / 4, milliseconds(5), milliseconds(1000));
  }

  void arm_refuse_flush() {
    if (stopped) return;
    refuse_flush_timer.expires_after(refuse_warning.flush_delay());
    refuse_flush_timer.async_wait([self = shared_from_this()](boost::system::error_code ec) {
      if (ec || self->stopped) return;
      self->refuse_warning.flush(spdlog::level::warn, "store: closing new connections");
    });
  }

  void arm_sweep() {
    if (shortest_timeout().count() == 0 || stopped) return;
    sweep_timer.expires_after(sweep_period());
    sweep_timer.async_wait([self = shared_from_this()](boost::system::error_code ec) {
      if (ec || self->stopped) return;
      self->sweep();
      self->arm_sweep();
    });
  }

  void sweep() {
    const auto now = Clock::now();
    std::vector<std::pair<ConnectionPtr, std::string>> expired;
    const bool handshakes = options.extension && options.handshake_timeout.count() > 0;
    const auto handshake_over = [&](const Connection& c) {
      return handshakes && c.awaiting_in != nullptr && now - c.accepted > options.handshake_timeout;
    };
    for (const auto* list : {&awaiting, &awaiting_relayed}) {
      if (!handshakes) break;
      for (const ConnectionId id : *list) {
        const ConnectionPtr& c = connections.at(id);
        if (!handshake_over(*c)) break;  // oldest first: the rest are younger
        expired.emplace_back(c, fmt::format("no handshake within {} ms of connecting (--handshake-timeout-ms)",
                                            options.handshake_timeout.count()));
      }
    }
    for (auto& [id, c] : connections) {
      if (handshake_over(*c)) continue;  // listed above
      const bool partial = c->end > c->begin && c->end - c->begin < c->need;
      if (options.frame_timeout.count() > 0 && partial && !c->read_paused &&
          now - c->frame_start > options.frame_timeout) {
        expired.emplace_back(
            c, fmt::format("incomplete request: {} of at least {} bytes received in {} ms "
                           "(--frame-timeout-ms {})",
                           c->end - c->begin, c->need,
                           std::chrono::duration_cast<std::chrono::milliseconds>(now - c->frame_start).count(),
                           options.frame_timeout.count()));
      } else if (options.idle_timeout.count() > 0 && !c->is_link && c->end == c->begin && c->queued() == 0 &&
                 now - c->last_active > options.idle_timeout && !state.waiting(id)) {
        expired.emplace_back(c,
                             fmt::format("idle for more than {} ms (--idle-timeout-ms)", options.idle_timeout.count()));
      } else if (const Clock::duration quiet = write_quiet(*c, now);
                 !c->is_link && quiet > options.reply_stall_timeout) {
        expired.emplace_back(
            c, fmt::format("the client reads none of its replies: none of the {} bytes queued for it moved in {} ms "
                           "(--reply-stall-timeout-ms {})",
                           c->queued() - c->stall.written(),
                           std::chrono::duration_cast<std::chrono::milliseconds>(quiet).count(),
                           options.reply_stall_timeout.count()));
      } else if (c->is_link && quiet > options.link_stall_timeout) {
        // The relay never stops reading its link on purpose (it closes its own clients that do
        // not read instead): a link that takes nothing is a relay that is stopped or wedged.
        // Closed, its connections end and their agents reconnect, through another relay or this
        // one once it links again, instead of waiting on it for good.
        expired.emplace_back(
            c, fmt::format("relay link stalled: the relay has read nothing for {} ms while {} bytes wait for it "
                           "(--link-stall-timeout-ms {}); closing the link and the {} connection(s) it carries",
                           std::chrono::duration_cast<std::chrono::milliseconds>(quiet).count(),
                           c->queued() - c->stall.written(), options.link_stall_timeout.count(), c->relayed.size()));
      }
    }
    for (auto& [c, why] : expired) close(c, why, RefusedReason::timeout);
    if (!expired.empty()) flush();
  }

  // How long the write in flight of a relay link (link_stall_timeout) or of a client connection
  // on its own socket (reply_stall_timeout) has not moved; zero for a connection a relay carries
  // (the relay closes its clients that do not read) and with the connection's timeout off. Asked
  // at every sweep, so that a sweep that came late restarts the clock.
  Clock::duration write_quiet(Connection& c, Clock::time_point now) {
    const std::chrono::milliseconds timeout = c.is_link ? options.link_stall_timeout : options.reply_stall_timeout;
    if (timeout.count() <= 0 || c.relayed_conn()) return Clock::duration::zero();
    return c.stall.quiet(c.socket.native_handle(), c.write_in_flight, now, timeout);
  }

  void notify_drained() {
    asio::post(io, [cb = std::move(on_drained)] { cb(); });
    on_drained = nullptr;
  }

  void close_all() {
    std::vector<ConnectionPtr> all;
    all.reserve(connections.size());
    for (auto& [id, c] : connections) all.push_back(c);
    for (auto& c : all) close(c, {});
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

std::string_view refused_reason_name(RefusedReason reason) {
  switch (reason) {
    case RefusedReason::connection_limit:
      return "connection_limit";
    case RefusedReason::peer_limit:
      return "peer_limit";
    case RefusedReason::out_of_descriptors:
      return "out_of_descriptors";
    case RefusedReason::protocol_error:
      return "protocol_error";
    case RefusedReason::buffer_limit:
      return "buffer_limit";
    case RefusedReason::timeout:
      return "timeout";
    case RefusedReason::unauthenticated:
      return "unauthenticated";
    case RefusedReason::wait_limit:
      return "wait_limit";
  }
  return "unknown";
}

std::uint16_t StoreServer::port() const { return impl_->core->bound_port; }
const std::string& StoreServer::host() const { return impl_->core->bound_host; }

void StoreServer::start() {
  auto& core = *impl_->core;
  if (core.started || core.stopped) return;
  core.started = true;
  // Kept to be released when accept() fails for want of descriptors (see do_accept).
  if (core.spare_fd < 0) core.spare_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  core.do_accept();
  core.arm_sweep();
}

void StoreServer::stop() {
  if (!impl_) return;
  auto& core = *impl_->core;
  if (core.stopped) return;
  core.stopped = true;
  boost::system::error_code ec;
  core.acceptor.close(ec);
  core.retry_timer.cancel();
  core.sweep_timer.cancel();
  core.refuse_flush_timer.cancel();
  core.refuse_warning.flush(spdlog::level::warn, "store: closing new connections");
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
  s.buffered_bytes = core.buffered;
  s.max_connections = core.max_connections;
  s.relay_links = core.link_count;
  s.relayed_connections = core.relayed_count;
  return s;
}

void StoreServer::send(ConnectionId conn, std::string_view bytes) {
  auto& core = *impl_->core;
  auto it = core.connections.find(conn);
  if (it == core.connections.end()) return;
  ConnectionPtr c = it->second;
  c->pending.append(bytes);
  core.enforce_output_caps(c);
  if (!c->closed) core.start_write(c);
  core.flush();  // a relayed connection's bytes moved onto its link, which must be written too
}

void StoreServer::close_connection(ConnectionId conn, std::string_view reason) {
  auto& core = *impl_->core;
  auto it = core.connections.find(conn);
  if (it == core.connections.end()) return;
  core.close(ConnectionPtr(it->second), std::string(reason), RefusedReason::protocol_error);
}

}  // namespace ddprun::rendezvous
