#pragma once
// StoreServer: a key/value server byte-compatible with PyTorch's c10d TCPStore.
//
// Runs on a caller-owned boost::asio::io_context; every member must be called from the
// thread running that io_context (or before it runs). No internal locking: one thread owns
// all state (docs/architecture.md, "Concurrency").
//
// Each connection is parsed incrementally and independently; the protocol generation
// (legacy 1.13 numbering, or modern with VALIDATE) is detected per connection from its
// first bytes. A malformed frame or a limit violation closes that one connection and logs
// the peer; the server keeps running. WAITs are registrations woken by the write that
// satisfies them; nothing polls.
//
// Bounded by construction (StoreLimits and the timeouts below; docs/protocol.md, "Limits"):
// a read buffer grows only as bytes arrive (at most about twice what is buffered), never to a
// declared length; a connection whose queued replies pass a pause threshold is not read (nor
// are its buffered requests executed) until its socket drains them; replies other clients
// trigger count against the same per-connection cap, and a connection pushed past it is closed;
// read buffers and queued replies of all connections share one global cap. Connections are
// capped overall (clamped below the open-files limit with a reserve, and a spare descriptor
// lets the server accept and close a connection it has no room for, with a log line) and per
// peer address; at the connection cap, a connection still owing its handshake to an
// authenticating extension gives way to the new one, and such a connection is closed after
// handshake_timeout. A connection stuck inside a request is closed after frame_timeout; an idle
// connection after idle_timeout (off by default: torch keeps its store connection idle for a
// whole job). A connection waiting in WAIT/BARRIER or watching a key is never idle. A relay link
// whose relay takes none of its queued bytes for link_stall_timeout is closed, with every
// connection it carries; a client that reads none of its for reply_stall_timeout, too.
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "ddprun/rendezvous/protocol.hpp"
#include "ddprun/rendezvous/store_extension.hpp"
#include "ddprun/rendezvous/store_state.hpp"

namespace boost::asio {
class io_context;
}

namespace ddprun::rendezvous {

struct StoreServerOptions {
  std::string host = "0.0.0.0";  // address to bind; "::" for dual stack
  std::uint16_t port = 0;        // 0 = pick a free port, read it back with port()
  StoreLimits limits;
  int backlog = 4096;  // listen backlog (clamped by net.core.somaxconn)
  bool reuse_address = true;
  // Accept legacy (1.13) and modern connections on the same port. When false, a connection
  // that does not open with VALIDATE is closed (modern-only, like the 2.x legacy backend).
  bool accept_legacy = true;
  // Handler for frames with opcode bytes >= extension_opcode_base (native rendezvous ops on the
  // same port); null = such frames close the connection. See store_extension.hpp.
  std::shared_ptr<StoreExtension> extension;
  // Close a connection that has buffered part of a request for this long without completing it
  // (the clock starts at the request's first byte; it does not run while the server itself has
  // paused reading). Zero disables.
  std::chrono::milliseconds frame_timeout{std::chrono::seconds(30)};
  // Close a connection that has sent and received nothing for this long, has no partial request
  // and is not waiting for a WAIT/BARRIER or watching a key. Zero (the default) disables:
  // torch's clients hold their store connection idle through a whole job and do not reconnect.
  std::chrono::milliseconds idle_timeout{0};
  // Close a connection the extension still awaits a handshake from (awaiting_authentication)
  // this long after its accept. Zero disables. Whatever it is, when the connection limit is
  // reached the oldest such connection is closed to admit the new one.
  std::chrono::milliseconds handshake_timeout{std::chrono::seconds(10)};
  // Close a relay link (ddprun-rdzvd --relay-to) that has taken none of the bytes queued for it
  // for this long: its relay is stopped or wedged, and every connection it carries would wait on
  // it. Measured from the last byte the socket took, so a link that drains slowly is never
  // closed. Zero disables.
  std::chrono::milliseconds link_stall_timeout{std::chrono::seconds(60)};
  // Close a client connection (not a link, not one a relay carries) whose replies have filled
  // the kernel's buffers and none of whose queued bytes moved for this long: a client that stopped
  // reading (a stopped process, a hostile one) would otherwise hold its connection slot and up to
  // the reply cap of memory for good. Measured like link_stall_timeout, so a client that reads
  // slowly is never closed. Zero (the default here; the daemon turns it on) disables: an agent's
  // workers may sit stopped in a debugger with a reply pending.
  std::chrono::milliseconds reply_stall_timeout{0};
};

// Why a connection was refused at accept or closed by the server (StoreStats::refused):
// connection_limit: --max-connections reached (refused, or a connection that had not
// authenticated closed to admit a new one); peer_limit: --max-connections-per-peer reached;
// out_of_descriptors: accepted with the spare descriptor and closed; protocol_error: a
// malformed frame or a failed request; buffer_limit: a reply backlog or read buffer over its
// cap; timeout: --frame-timeout-ms, --idle-timeout-ms, --handshake-timeout-ms,
// --link-stall-timeout-ms or --reply-stall-timeout-ms; unauthenticated:
// a TCPStore op on a connection the extension (the daemon's token) has not authenticated;
// wait_limit: it held the most wait registrations when another client's WAIT needed room
// (StoreState, "Fairness").
enum class RefusedReason : std::uint8_t {
  connection_limit,
  peer_limit,
  out_of_descriptors,
  protocol_error,
  buffer_limit,
  timeout,
  unauthenticated,
  wait_limit,
};
inline constexpr std::size_t kRefusedReasons = 8;
std::string_view refused_reason_name(RefusedReason reason);

struct StoreStats {
  std::size_t connections = 0;           // open now
  std::size_t connections_total = 0;     // accepted since start
  std::size_t connections_rejected = 0;  // refused at accept or closed for a protocol error or limit
  std::size_t keys = 0;
  std::size_t bytes = 0;          // keys + values held
  std::size_t pending_waits = 0;  // connections blocked in WAIT/BARRIER
  std::uint64_t requests = 0;
  std::size_t buffered_bytes = 0;       // read buffers + queued replies of every connection
  std::size_t max_connections = 0;      // effective connection cap (after the open-files clamp)
  std::size_t relay_links = 0;          // open connections of relays (ddprun-rdzvd --relay-to)
  std::size_t relayed_connections = 0;  // open client connections carried by them (in `connections`)
  // For the metrics endpoint: connections_rejected split by reason (indexed by RefusedReason),
  // store requests by op (indexed by Op; extension frames are not store ops), and bytes read
  // from and written to clients.
  std::array<std::size_t, kRefusedReasons> refused{};
  std::array<std::uint64_t, static_cast<std::size_t>(Op::barrier) + 1> ops{};
  std::uint64_t bytes_in = 0;
  std::uint64_t bytes_out = 0;
};

class StoreServer {
 public:
  // Binds and listens immediately, so port() is valid on return. Throws ddprun::NetworkError
  // naming host:port when the address cannot be bound.
  StoreServer(boost::asio::io_context& io, StoreServerOptions options);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  std::uint16_t port() const;
  const std::string& host() const;

  // Starts accepting connections (asynchronously, on the io_context).
  void start();
  // Closes the acceptor and every connection. Idempotent.
  void stop();
  // A fresh, empty key space: drops every key, queue and wait registration and closes every
  // client connection. Used by the agent between restarts.
  void reset();

  StoreStats stats() const;

  // For extensions that push data later (e.g. an assignment when a round closes): queue
  // `bytes` on connection `conn` and start writing; a no-op if it is gone.
  void send(ConnectionId conn, std::string_view bytes);
  // Closes one connection, logging `reason` with the peer address.
  void close_connection(ConnectionId conn, std::string_view reason);
  // Runs `callback` once, on the io_context, as soon as no client connection is open (posted at
  // once when none is open now). A later call replaces an earlier callback that has not run.
  // Used by an agent hosting the rendezvous to stop when its peers have disconnected.
  void on_drained(std::function<void()> callback);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace ddprun::rendezvous
