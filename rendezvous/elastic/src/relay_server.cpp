// RelayServer (relay_server.hpp has the contract).
#include "ddprun/rendezvous/relay_server.hpp"

#include <sys/resource.h>
#include <sys/socket.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ip/v6_only.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <cstring>
#include <list>
#include <thread>
#include <unordered_map>
#include <vector>

#include "ddprun/common/endpoint.hpp"
#include "ddprun/common/error.hpp"
#include "ddprun/common/rate_limited_warning.hpp"
#include "ddprun/rendezvous/link_stall.hpp"
#include "ddprun/rendezvous/relay_link.hpp"
#include "ddprun/rendezvous/rendezvous_auth.hpp"
#include "ddprun/rendezvous/rendezvous_wire.hpp"

namespace ddprun::rendezvous {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

namespace {

constexpr std::size_t read_chunk = 64 * 1024;

// Nothing answered at the root's address (resolve, connect or its timeout): worth trying again,
// unlike a root that answers and refuses.
class Unreachable : public NetworkError {
 public:
  using NetworkError::NetworkError;
};

std::string endpoint_text(const tcp::endpoint& ep) {
  return bracket_host(ep.address().to_string()) + ":" + std::to_string(ep.port());
}

struct Client {
  explicit Client(tcp::socket s) : socket(std::move(s)) {}
  tcp::socket socket;
  std::uint32_t vid = 0;
  std::string peer;
  std::string pending;  // from the root, not yet handed to async_write
  std::string writing;
  bool write_in_flight = false;
  bool close_after_write = false;  // the root closed it: write what is left, then close
  bool paused = false;             // not reading: the link to the root is backed up
  bool closed = false;
  // Listed in Core::untrusted (oldest first) until the root's TRUSTED frame: it has not
  // authenticated, and at --max-connections it may give way to a new client.
  bool listed = false;
  std::list<std::uint32_t>::iterator untrusted_pos;
};
using ClientPtr = std::shared_ptr<Client>;

// The root's side of the handshake, read frame by frame on a blocking socket.
std::string read_native_frame(tcp::socket& s, const std::string& where) {
  std::string frame(native_header_bytes, '\0');
  boost::system::error_code ec;
  asio::read(s, asio::buffer(frame), ec);
  if (ec) throw NetworkError(fmt::format("relay: the daemon at {} closed the handshake: {}", where, ec.message()));
  std::uint32_t len = 0;
  for (int i = 0; i < 4; ++i)
    len |= static_cast<std::uint32_t>(static_cast<unsigned char>(frame[static_cast<std::size_t>(1 + i)])) << (8 * i);
  if (len > (std::size_t{1} << 20)) {
    throw NetworkError(fmt::format("relay: the daemon at {} sent a {}-byte handshake frame", where, len),
                       "check that --relay-to names a ddprun-rdzvd");
  }
  frame.resize(native_header_bytes + len);
  asio::read(s, asio::buffer(frame.data() + native_header_bytes, len), ec);
  if (ec) throw NetworkError(fmt::format("relay: the daemon at {} closed the handshake: {}", where, ec.message()));
  return frame;
}

template <class T>
T expect(const std::string& frame, const std::string& where, const char* what) {
  ServerMessage m;
  const DecodeResult r = decode_server(frame, WireLimits{}, m);
  if (r.status != DecodeStatus::ok) {
    throw NetworkError(
        fmt::format("relay: the daemon at {} answered {} with a frame that does not decode: {}", where, what, r.reason),
        "check that --relay-to names a ddprun-rdzvd of the same version");
  }
  if (const auto* refused = std::get_if<Refuse>(&m)) {
    throw NetworkError(fmt::format("relay: the daemon at {} refused the relay: {}", where, refused->reason),
                       "give the relay the daemon's token (--token-file or DDPRUN_RDZV_TOKEN) and start the daemon "
                       "with a token");
  }
  if (const auto* t = std::get_if<T>(&m)) return *t;
  throw NetworkError(fmt::format("relay: the daemon at {} answered {} with {}", where, what,
                                 native_op_name(static_cast<std::uint8_t>(frame[0]))),
                     "check that --relay-to names a ddprun-rdzvd of the same version");
}

}  // namespace

struct RelayServer::Core : std::enable_shared_from_this<RelayServer::Core> {
  Core(asio::io_context& io_, RelayServerOptions opts)
      : io(io_),
        options(std::move(opts)),
        acceptor(io_),
        upstream(io_),
        relink_timer(io_),
        stall_timer(io_),
        refuse_flush_timer(io_) {
    // Called from inside this object's own handlers only, so `this` is alive.
    refuse_warning.on_suppressing = [this] { arm_refuse_flush(); };
    where = bracket_host(options.upstream_host) + ":" + std::to_string(options.upstream_port);
  }

  asio::io_context& io;
  RelayServerOptions options;
  std::string where;  // the root's host:port
  tcp::acceptor acceptor;
  tcp::socket upstream;
  std::string up_pending;
  std::string up_writing;
  bool up_in_flight = false;
  bool up_kick_posted = false;  // a kick_upstream is posted (schedule_upstream)
  std::vector<char> up_in;
  std::size_t up_begin = 0;
  std::size_t up_end = 0;
  std::vector<char> scratch = std::vector<char>(read_chunk);
  std::unordered_map<std::uint32_t, ClientPtr> clients;
  std::list<std::uint32_t> untrusted;  // clients without TRUSTED yet, oldest first
  bool root_sends_trusted = false;     // the root's RELAY_OK said it sends TRUSTED frames
  tcp::endpoint accepted_from;         // the peer of the connection being accepted (one accept at a time)
  RateLimitedWarning refuse_warning;   // refusals a flood of clients could repeat
  std::vector<std::weak_ptr<Client>> paused;
  std::size_t queued_total = 0;  // every client's pending + writing: bounded by max_buffered_bytes
  std::uint32_t next_vid = 1;
  std::size_t max_connections = 0;
  std::uint16_t bound_port = 0;
  bool stopped = false;
  bool lost = false;           // the link is down: relinking (or given up)
  std::uint64_t link = 0;      // bumped when a link is lost: completions of an older link are ignored
  bool accept_paused = false;  // no accept armed while the link is down (clients wait in the backlog)
  asio::steady_timer relink_timer;
  // The link stall check (link_stall_timeout): when the link last moved (the socket took bytes,
  // the root acknowledged or sent some; link_stall.hpp).
  asio::steady_timer stall_timer;
  // Says how many refusals refuse_warning did not show once a flood of them stops.
  asio::steady_timer refuse_flush_timer;
  LinkStallClock up_stall;
  std::chrono::steady_clock::time_point lost_at;
  std::chrono::milliseconds relink_delay{0};
  int relink_attempts = 0;
  std::string lost_why;
  RateLimitedWarning relink_warning;
  RelayStats counters;

  void connect_and_prove() {
    // A private io_context bounds the connect by connect_timeout; the socket then moves to `io`.
    asio::io_context once;
    tcp::socket s(once);
    boost::system::error_code ec = asio::error::timed_out;
    tcp::resolver resolver(once);
    auto results = resolver.resolve(options.upstream_host, std::to_string(options.upstream_port), ec);
    if (ec) {
      throw Unreachable(
          fmt::format("relay: cannot resolve the daemon's host in --relay-to {}: {}", where, ec.message()),
          "give --relay-to HOST:PORT of a running ddprun-rdzvd");
    }
    ec = asio::error::timed_out;
    asio::async_connect(s, results, [&](const boost::system::error_code& e, const tcp::endpoint&) { ec = e; });
    once.run_for(options.connect_timeout);
    if (ec) {
      throw Unreachable(fmt::format("relay: cannot connect to the daemon at {}: {}", where, ec.message()),
                        "check that ddprun-rdzvd runs there and that --relay-to names its host and port");
    }
    const int fd = s.native_handle();
    timeval tv{};
    tv.tv_sec = static_cast<time_t>(options.connect_timeout.count() / 1000);
    tv.tv_usec = static_cast<suseconds_t>((options.connect_timeout.count() % 1000) * 1000);
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    s.set_option(tcp::no_delay(true), ec);

    const std::string client_nonce = auth::random_hex(auth::nonce_bytes);
    std::string out;
    encode_client(out, HelloMessage{1, client_nonce});
    asio::write(s, asio::buffer(out), ec);
    if (ec) throw NetworkError(fmt::format("relay: cannot write to the daemon at {}: {}", where, ec.message()));
    const auto challenge = expect<ChallengeMessage>(read_native_frame(s, where), where, "HELLO");
    if (!challenge.auth) {
      throw NetworkError(fmt::format("relay: the daemon at {} has no token, and relays need one", where),
                         "start ddprun-rdzvd with --token-file (or DDPRUN_RDZV_TOKEN) and give the relay the same "
                         "token");
    }
    out.clear();
    const std::string run_id(auth::any_run);
    encode_client(out,
                  AuthMessage{run_id, auth::client_mac(options.token, challenge.server_nonce, client_nonce, run_id)});
    asio::write(s, asio::buffer(out), ec);
    if (ec) throw NetworkError(fmt::format("relay: cannot write to the daemon at {}: {}", where, ec.message()));
    const auto ok = expect<AuthOkMessage>(read_native_frame(s, where), where, "AUTH");
    if (!auth::equal_secret(ok.mac, auth::server_mac(options.token, client_nonce, challenge.server_nonce, run_id))) {
      throw NetworkError(fmt::format("relay: the daemon at {} did not prove the token", where),
                         "check that --relay-to names your ddprun-rdzvd and that both use the same token");
    }
    out.clear();
    encode_client(out, RelayMessage{1, true});
    asio::write(s, asio::buffer(out), ec);
    if (ec) throw NetworkError(fmt::format("relay: cannot write to the daemon at {}: {}", where, ec.message()));
    const std::string answer = read_native_frame(s, where);
    if (static_cast<std::uint8_t>(answer[0]) != static_cast<std::uint8_t>(NativeOp::relay_ok)) {
      (void)expect<AuthOkMessage>(answer, where, "RELAY");  // throws with the refusal's reason
    }
    // A root of an older version sends no TRUSTED frames: then no client can be told from one
    // that authenticated, and the relay refuses at its limit instead of making room.
    root_sends_trusted = relay_ok_trusted_frames(answer);
    tv = timeval{};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    const auto protocol = s.local_endpoint(ec).protocol();
    const int raw = s.release(ec);
    upstream.assign(protocol, raw, ec);
    if (ec) throw NetworkError(fmt::format("relay: cannot keep the connection to {}: {}", where, ec.message()));
    upstream.non_blocking(true, ec);
  }

  void bind() {
    boost::system::error_code ec;
    auto addr = asio::ip::make_address(options.host, ec);
    if (ec) {
      throw NetworkError(fmt::format("relay: cannot listen on {}:{}: '{}' is not an IP address",
                                     bracket_host(options.host), options.port, options.host),
                         "pass an IP address with --host");
    }
    const tcp::endpoint ep(addr, options.port);
    acceptor.open(ep.protocol(), ec);
    if (!ec && addr.is_v6()) acceptor.set_option(asio::ip::v6_only(false), ec);
    if (!ec) acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor.bind(ep, ec);
    if (!ec) acceptor.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) {
      throw NetworkError(
          fmt::format("relay: cannot listen on {}:{}: {}", bracket_host(options.host), options.port, ec.message()),
          "pick another --port or use --port 0");
    }
    bound_port = acceptor.local_endpoint().port();
    // Descriptors: one per client, plus the link, the listener and a reserve for the process.
    max_connections = options.max_connections;
    rlimit rl{};
    if (::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
      const auto nofile = static_cast<std::size_t>(rl.rlim_cur);
      const std::size_t reserve = std::clamp<std::size_t>(nofile / 8, 32, 1024);
      const std::size_t allowed = nofile > reserve + 1 ? nofile - reserve : 1;
      if (allowed < max_connections) {
        spdlog::info(
            "relay: --max-connections {} lowered to {}: the open-files limit is {} (raise ulimit -n, or run "
            "more relays)",
            max_connections, allowed, nofile);
        max_connections = allowed;
      }
    }
    counters.max_connections = max_connections;
  }

  // ---- clients ----

  void do_accept() {
    if (stopped) return;
    if (lost) {
      accept_paused = true;  // resumed once the link is back
      return;
    }
    acceptor.async_accept(accepted_from, [self = shared_from_this()](boost::system::error_code ec, tcp::socket socket) {
      if (self->stopped) return;
      if (!ec && self->lost) {
        // Accepted while the link was going down: nothing can carry it. Its agent reconnects.
        boost::system::error_code ignored;
        socket.close(ignored);
        self->accept_paused = true;
        return;
      }
      if (ec) {
        if (ec == asio::error::operation_aborted) return;
        spdlog::warn("relay: accept failed on port {}: {} (raise the open-files limit, ulimit -n)", self->bound_port,
                     ec.message());
        auto timer = std::make_shared<asio::steady_timer>(self->io, std::chrono::milliseconds(100));
        timer->async_wait([self, timer](boost::system::error_code) { self->do_accept(); });
        return;
      }
      self->on_accept(std::move(socket));
      self->do_accept();
    });
  }

  void on_accept(tcp::socket socket) {
    boost::system::error_code ec;
    std::string peer = endpoint_text(accepted_from);  // filled by accept: no getpeername per client
    if (clients.size() >= max_connections && root_sends_trusted && !untrusted.empty()) {
      // The oldest client that has not authenticated gives way (as at the root's limits): an
      // agent completes its handshake within a round trip, so silent connections cannot hold
      // every slot and lock the agents behind this relay out.
      ClientPtr oldest = clients.at(untrusted.front());
      ++counters.clients_evicted;
      refuse_warning.warn(
          "relay: connection limit of {} reached (--max-connections): closing the oldest connection that has not "
          "authenticated, from {}, for a new one from {}",
          max_connections, oldest->peer, peer);
      close_client(oldest, "gave way to a new connection: it had not authenticated", true);
    }
    if (clients.size() >= max_connections) {
      ++counters.clients_refused;
      refuse_warning.warn("relay: closing new connection from {}: connection limit of {} reached (--max-connections)",
                          peer, max_connections);
      socket.close(ec);
      return;
    }
    while (next_vid == 0 || clients.count(next_vid) != 0) ++next_vid;
    auto c = std::make_shared<Client>(std::move(socket));
    c->vid = next_vid++;
    c->peer = std::move(peer);
    c->socket.set_option(tcp::no_delay(true), ec);
    c->socket.non_blocking(true, ec);
    clients.emplace(c->vid, c);
    c->untrusted_pos = untrusted.insert(untrusted.end(), c->vid);
    c->listed = true;
    ++counters.clients_total;
    append_relay_frame(up_pending, RelayOp::open, c->vid, std::string_view(c->peer).substr(0, max_relay_peer_bytes));
    schedule_upstream();
    wait_readable(c);
  }

  void wait_readable(const ClientPtr& c) {
    if (c->closed) return;
    c->socket.async_wait(tcp::socket::wait_read,
                         [self = shared_from_this(), c](boost::system::error_code ec) { self->on_readable(c, ec); });
  }

  void on_readable(const ClientPtr& c, boost::system::error_code ec) {
    if (c->closed || stopped) return;
    std::size_t n = 0;
    if (!ec) n = c->socket.read_some(asio::buffer(scratch), ec);
    if (ec == asio::error::would_block || ec == asio::error::try_again || ec == asio::error::interrupted) {
      wait_readable(c);
      return;
    }
    if (ec) {
      close_client(c, ec == asio::error::eof ? std::string() : "read failed: " + ec.message(), true);
      return;
    }
    counters.bytes_up += n;
    append_relay_frame(up_pending, RelayOp::data, c->vid, std::string_view(scratch.data(), n));
    schedule_upstream();
    if (up_pending.size() + up_writing.size() > options.max_upstream_backlog) {
      c->paused = true;
      paused.push_back(c);
      return;
    }
    wait_readable(c);
  }

  void resume_paused() {
    auto list = std::move(paused);
    paused.clear();
    for (auto& w : list) {
      if (auto c = w.lock(); c && !c->closed && c->paused) {
        c->paused = false;
        wait_readable(c);
      }
    }
  }

  void write_client(const ClientPtr& c) {
    if (c->closed || c->write_in_flight) return;
    if (c->pending.empty()) {
      if (c->close_after_write) close_client(c, {}, false);
      return;
    }
    c->writing.swap(c->pending);
    c->pending.clear();
    c->write_in_flight = true;
    asio::async_write(c->socket, asio::buffer(c->writing),
                      [self = shared_from_this(), c](boost::system::error_code ec, std::size_t n) {
                        c->write_in_flight = false;
                        if (!c->closed) self->queued_total -= c->writing.size();  // close_client counted it
                        c->writing.clear();
                        if (c->closed || self->stopped) return;
                        if (ec) {
                          self->close_client(c, "write failed: " + ec.message(), true);
                          return;
                        }
                        self->counters.bytes_down += n;
                        self->write_client(c);
                      });
  }

  // `tell_root`: send CLOSE (the client side ended it); false when the root closed it.
  void close_client(const ClientPtr& c, const std::string& reason, bool tell_root) {
    if (c->closed) return;
    c->closed = true;
    if (!reason.empty()) spdlog::debug("relay: closing connection from {}: {}", c->peer, reason);
    boost::system::error_code ec;
    c->socket.close(ec);  // the only descriptor of the connection: close() ends it (no shutdown)
    queued_total -= c->pending.size() + c->writing.size();
    untrust_list_drop(*c);
    clients.erase(c->vid);
    if (tell_root && !lost) {
      append_relay_frame(up_pending, RelayOp::close, c->vid,
                         std::string_view(reason).substr(0, max_relay_reason_bytes));
      schedule_upstream();
    }
  }

  // Every client's replies together passed --max-buffered-bytes: the clients with the most
  // unread close, largest first, until under it. Each one's own cap (--max-queued-reply-bytes)
  // alone let a few thousand clients that never read hold the relay's memory a hundredfold.
  void shed_largest() {
    std::vector<ClientPtr> by_size;
    for (auto& [vid, c] : clients) {
      if (!c->closed && c->pending.size() + c->writing.size() > 0) by_size.push_back(c);
    }
    std::sort(by_size.begin(), by_size.end(), [](const ClientPtr& a, const ClientPtr& b) {
      return a->pending.size() + a->writing.size() > b->pending.size() + b->writing.size();
    });
    for (auto& c : by_size) {
      if (queued_total <= options.max_buffered_bytes) break;
      ++counters.clients_shed;
      refuse_warning.warn(
          "relay: closing connection from {}: replies for all clients hold {} bytes, over the limit of {} "
          "(--max-buffered-bytes), and this client has the most unread ({} bytes)",
          c->peer, queued_total, options.max_buffered_bytes, c->pending.size() + c->writing.size());
      close_client(c, "its replies were not read and the relay's buffers are full", true);
    }
  }

  void untrust_list_drop(Client& c) {
    if (!c.listed) return;
    untrusted.erase(c.untrusted_pos);
    c.listed = false;
  }

  // ---- the link to the root ----

  // What clients send goes to the root once every handler of the same wake-up has added its
  // frames: one write to the link for a batch of clients, not one per frame (a write on the link
  // costs both ends a trip through the TCP stack; at 100,000 agents that was ~2.8 per agent).
  void schedule_upstream() {
    if (up_kick_posted || up_in_flight) return;  // a write in flight kicks again when it completes
    up_kick_posted = true;
    asio::post(io, [self = shared_from_this()] {
      self->up_kick_posted = false;
      self->kick_upstream();
    });
  }

  void kick_upstream() {
    if (up_in_flight || up_pending.empty() || lost || stopped) return;
    up_writing.swap(up_pending);
    up_pending.clear();
    up_in_flight = true;
    up_stall.write_started(std::chrono::steady_clock::now());
    // Runs after every partial write: a root that reads slowly keeps the link (check_stall).
    const auto progress = [self = shared_from_this()](const boost::system::error_code& ec,
                                                      std::size_t n) -> std::size_t {
      self->up_stall.wrote(n, std::chrono::steady_clock::now());
      return ec ? 0 : std::size_t{65536};  // asio's transfer_all
    };
    asio::async_write(upstream, asio::buffer(up_writing), progress,
                      [self = shared_from_this(), gen = link](boost::system::error_code ec, std::size_t) {
                        self->up_in_flight = false;
                        if (self->up_writing.capacity() > (std::size_t{4} << 20)) {
                          std::string().swap(self->up_writing);
                        } else {
                          self->up_writing.clear();
                        }
                        if (self->stopped || self->lost) return;
                        if (gen != self->link) {  // a write of a lost link, completed after the relink
                          self->kick_upstream();
                          return;
                        }
                        if (ec) {
                          self->upstream_lost("write failed: " + ec.message());
                          return;
                        }
                        self->kick_upstream();
                        if (!self->paused.empty() && self->up_pending.size() + self->up_writing.size() <=
                                                         self->options.max_upstream_backlog / 2) {
                          self->resume_paused();
                        }
                      });
  }

  void read_upstream() {
    if (stopped || lost) return;
    if (up_begin == up_end) up_begin = up_end = 0;
    if (up_in.size() - up_end < read_chunk) {
      if (up_begin > 0) {
        std::memmove(up_in.data(), up_in.data() + up_begin, up_end - up_begin);
        up_end -= up_begin;
        up_begin = 0;
      }
      if (up_in.size() - up_end < read_chunk) up_in.resize(up_end + read_chunk);
    }
    upstream.async_read_some(asio::buffer(up_in.data() + up_end, up_in.size() - up_end),
                             [self = shared_from_this(), gen = link](boost::system::error_code ec, std::size_t n) {
                               if (self->stopped || self->lost || gen != self->link) return;
                               if (ec) {
                                 self->upstream_lost(ec == asio::error::eof ? std::string("the daemon closed the link")
                                                                            : "read failed: " + ec.message());
                                 return;
                               }
                               self->up_end += n;
                               // The root sending is the root alive: while its replies back up on
                               // the link it stops reading it on purpose (check_stall).
                               self->up_stall.moved(std::chrono::steady_clock::now());
                               if (!self->on_upstream_bytes()) return;
                               self->read_upstream();
                             });
  }

  // False when the link was given up (a protocol error).
  bool on_upstream_bytes() {
    RelayFrame f;
    while (up_end > up_begin) {
      const std::string_view view(up_in.data() + up_begin, up_end - up_begin);
      const RelayDecodeResult r = decode_relay_frame(view, f);
      if (r.status == RelayDecodeResult::Status::need_more) break;
      if (r.status == RelayDecodeResult::Status::error || f.op == RelayOp::open) {
        upstream_lost(r.status == RelayDecodeResult::Status::error ? r.reason
                                                                   : std::string("relay link: OPEN from the daemon"));
        return false;
      }
      auto it = clients.find(f.vid);
      if (it != clients.end()) {
        ClientPtr c = it->second;
        if (f.op == RelayOp::trusted) {
          untrust_list_drop(*c);
        } else if (f.op == RelayOp::data) {
          if (c->pending.size() + c->writing.size() + f.payload.size() > options.max_queued_bytes) {
            refuse_warning.warn(
                "relay: closing connection from {}: {} bytes from the daemon wait for it, over the limit of {} "
                "(--max-queued-reply-bytes): the client does not read",
                c->peer, c->pending.size() + c->writing.size() + f.payload.size(), options.max_queued_bytes);
            close_client(c, "the client does not read its replies", true);
          } else {
            c->pending.append(f.payload);
            queued_total += f.payload.size();
            write_client(c);
            if (queued_total > options.max_buffered_bytes) shed_largest();
          }
        } else {
          // CLOSE: what the root sent before (a REFUSED that explains it) is written first.
          if (!f.payload.empty()) spdlog::debug("relay: the daemon closed {}: {}", c->peer, f.payload);
          c->close_after_write = true;
          write_client(c);
        }
      }
      up_begin += r.consumed;
    }
    if (up_in.size() > (std::size_t{4} << 20) && up_end - up_begin < read_chunk) {
      std::vector<char> smaller(up_in.begin() + static_cast<std::ptrdiff_t>(up_begin),
                                up_in.begin() + static_cast<std::ptrdiff_t>(up_end));
      up_in.swap(smaller);
      up_end -= up_begin;
      up_begin = 0;
    }
    return true;
  }

  // Every link_stall_timeout / 4 (5 ms to 1 s): a root that, while bytes wait for it, has taken
  // none and sent none for link_stall_timeout is stopped or wedged (the root pauses reading a
  // link only while its own replies back up on it, and then it sends). Its clients would wait
  // on it for good: the link counts as lost, as if it had closed, and is made again.
  void arm_stall_check() {
    if (options.link_stall_timeout.count() <= 0 || stopped) return;
    stall_timer.expires_after(LinkStallClock::check_period(options.link_stall_timeout));
    stall_timer.async_wait([self = shared_from_this()](boost::system::error_code ec) {
      if (ec || self->stopped) return;
      self->check_stall();
      self->arm_stall_check();
    });
  }

  void check_stall() {
    const auto quiet = up_stall.quiet(upstream.native_handle(), !lost && up_in_flight, std::chrono::steady_clock::now(),
                                      options.link_stall_timeout);
    if (quiet <= options.link_stall_timeout) return;
    upstream_lost(fmt::format(
        "the daemon has read nothing of the link for {} ms while {} bytes wait for it, and sent nothing either "
        "(--link-stall-timeout-ms {}): it is stopped or wedged",
        std::chrono::duration_cast<std::chrono::milliseconds>(quiet).count(),
        up_pending.size() + up_writing.size() - up_stall.written(), options.link_stall_timeout.count()));
  }

  // The link is down: every carried connection ended with it at the root, so the clients are
  // closed (their agents reconnect and REJOIN). The relay keeps its port and links again
  // (relink) for up to relink_timeout; new clients wait in the listen backlog meanwhile.
  void upstream_lost(const std::string& why) {
    if (lost || stopped) return;
    lost = true;
    ++link;
    lost_at = std::chrono::steady_clock::now();
    lost_why = why;
    relink_attempts = 0;
    const auto secs = std::chrono::duration<double>(options.relink_timeout).count();
    spdlog::error(
        "relay: lost the link to the daemon at {}: {}; closing {} client connection(s) (their agents "
        "reconnect){}",
        where, why, clients.size(),
        options.relink_timeout.count() > 0 ? fmt::format("; linking again for up to {:g} s (--relink-timeout)", secs)
                                           : std::string());
    close_all_clients();
    paused.clear();
    up_pending.clear();
    up_begin = up_end = 0;
    boost::system::error_code ec;
    upstream.close(ec);
    acceptor.cancel(ec);  // its completion (operation_aborted) does not arm another
    accept_paused = true;
    if (options.relink_timeout.count() <= 0) {
      give_up(why);
      return;
    }
    relink_delay = std::chrono::milliseconds(100);
    schedule_relink();
  }

  void arm_refuse_flush() {
    if (stopped) return;
    refuse_flush_timer.expires_after(refuse_warning.flush_delay());
    refuse_flush_timer.async_wait([self = shared_from_this()](boost::system::error_code ec) {
      if (ec || self->stopped) return;
      self->refuse_warning.flush(spdlog::level::warn, "relay: closing connections at its limits");
    });
  }

  void schedule_relink() {
    relink_timer.expires_after(relink_delay);
    relink_timer.async_wait([self = shared_from_this()](boost::system::error_code ec) {
      if (ec || self->stopped || !self->lost) return;
      self->try_relink();
    });
  }

  void try_relink() {
    ++relink_attempts;
    try {
      connect_and_prove();
    } catch (const Error& e) {
      boost::system::error_code ignored;
      upstream.close(ignored);
      if (std::chrono::steady_clock::now() - lost_at >= options.relink_timeout) {
        give_up(fmt::format("{}; not linked again within {:g} s ({} attempts; last: {})", lost_why,
                            std::chrono::duration<double>(options.relink_timeout).count(), relink_attempts, e.what()));
        return;
      }
      relink_warning.warn("relay: cannot link to the daemon at {} again yet (attempt {}): {}", where, relink_attempts,
                          e.what());
      relink_delay = std::min(relink_delay * 2, std::chrono::milliseconds(2000));
      schedule_relink();
      return;
    }
    lost = false;
    up_stall.moved(std::chrono::steady_clock::now());
    spdlog::warn("relay: linked to the daemon at {} again after {:.1f} s ({} attempt(s)); accepting clients", where,
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - lost_at).count(), relink_attempts);
    read_upstream();
    kick_upstream();
    if (accept_paused) {
      accept_paused = false;
      do_accept();
    }
  }

  void give_up(const std::string& why) {
    boost::system::error_code ec;
    acceptor.close(ec);
    if (options.on_upstream_lost) {
      auto cb = options.on_upstream_lost;
      cb(fmt::format("lost the link to the daemon at {}: {}", where, why));
    }
  }

  void close_all_clients() {
    std::vector<ClientPtr> all;
    all.reserve(clients.size());
    for (auto& [vid, c] : clients) all.push_back(c);
    for (auto& c : all) close_client(c, {}, false);
  }
};

RelayServer::RelayServer(asio::io_context& io, RelayServerOptions options)
    : core_(std::make_shared<Core>(io, std::move(options))) {
  if (core_->options.token.empty()) {
    throw UsageError("a relay needs the daemon's token: give --token-file FILE (or DDPRUN_RDZV_TOKEN)",
                     "relays speak for many clients, so the daemon accepts them only from a token holder");
  }
  auth::require_crypto();
  // A root that is not up yet (started after its relays, restarting) is waited for, as a lost
  // link is, for up to relink_timeout; a root that answers and refuses is not.
  const auto start = std::chrono::steady_clock::now();
  auto delay = std::chrono::milliseconds(100);
  for (int attempt = 1;; ++attempt) {
    try {
      core_->connect_and_prove();
      break;
    } catch (const Unreachable& e) {
      const auto waited = std::chrono::steady_clock::now() - start;
      if (waited + delay >= core_->options.relink_timeout) {
        if (attempt == 1) throw;
        throw NetworkError(fmt::format("{}; tried {} times over {:.1f} s (--relink-timeout)", e.message(), attempt,
                                       std::chrono::duration<double>(waited).count()),
                           e.hint());
      }
      core_->relink_warning.warn(
          "relay: the daemon at {} does not answer yet (attempt {}: {}); trying again for up "
          "to {:g} s (--relink-timeout)",
          core_->where, attempt, e.message(), std::chrono::duration<double>(core_->options.relink_timeout).count());
      std::this_thread::sleep_for(delay);
      delay = std::min(delay * 2, std::chrono::milliseconds(2000));
    }
  }
  core_->bind();
}

RelayServer::~RelayServer() { stop(); }

void RelayServer::start() {
  core_->do_accept();
  core_->read_upstream();
  core_->arm_stall_check();
}

void RelayServer::stop() {
  if (!core_ || core_->stopped) return;
  core_->stopped = true;
  boost::system::error_code ec;
  core_->relink_timer.cancel();
  core_->stall_timer.cancel();
  core_->refuse_flush_timer.cancel();
  core_->refuse_warning.flush(spdlog::level::warn, "relay: closing connections at its limits");
  core_->acceptor.close(ec);
  core_->close_all_clients();
  core_->upstream.close(ec);
}

std::uint16_t RelayServer::port() const { return core_->bound_port; }

RelayStats RelayServer::stats() const {
  RelayStats s = core_->counters;
  s.clients = core_->clients.size();
  return s;
}

void RelayServer::set_token(std::string token) {
  if (!token.empty()) core_->options.token = std::move(token);
}

}  // namespace ddprun::rendezvous
