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
  int backlog = 4096;            // listen backlog (clamped by net.core.somaxconn)
  bool reuse_address = true;
  // Accept legacy (1.13) and modern connections on the same port. When false, a connection
  // that does not open with VALIDATE is closed (modern-only, like the 2.x legacy backend).
  bool accept_legacy = true;
  // Handler for frames with opcode bytes >= extension_opcode_base (native rendezvous ops on the
  // same port); null = such frames close the connection. See store_extension.hpp.
  std::shared_ptr<StoreExtension> extension;
};

struct StoreStats {
  std::size_t connections = 0;        // open now
  std::size_t connections_total = 0;  // accepted since start
  std::size_t connections_rejected = 0;  // closed for a protocol error or limit
  std::size_t keys = 0;
  std::size_t bytes = 0;              // keys + values held
  std::size_t pending_waits = 0;      // connections blocked in WAIT/BARRIER
  std::uint64_t requests = 0;
  // For the metrics endpoint: connections_rejected split by reason, store requests by op
  // (indexed by Op; extension frames are not store ops), bytes read from and written to clients.
  std::size_t refused_connection_limit = 0;
  std::size_t closed_protocol_error = 0;
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
