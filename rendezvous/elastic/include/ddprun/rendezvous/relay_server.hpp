#pragma once
// RelayServer: the relay half of a two-level rendezvous daemon (`ddprun-rdzvd --relay-to`,
// docs/daemon.md "Relays"). It accepts the connections of agents and TCPStore clients exactly as
// ddprun-rdzvd does and carries all of them to one root daemon over a single TCP connection, the
// relay link (relay_link.hpp). The root holds no descriptor per relayed client, so one root serves
// more clients than its open-files limit, and the relays take the per-connection TCP work.
//
// The relay is transparent: the bytes of every client go to the root unchanged and back, so the
// handshake (HELLO, CHALLENGE, AUTH) is end to end between each client and the root, TCPStore ops
// work, and the relay never learns anything a client proves. The relay proves the daemon token
// itself, bound to every job ("*"), and asks RELAY; a root without a token refuses relays.
//
// Bounds: at most max_connections clients (clamped below the open-files limit); bytes from the
// root waiting for one client at most max_queued_bytes (past it that client is closed: it does not
// read); bytes waiting for the root at most max_upstream_backlog (past it the relay stops reading
// its clients until the link drains). Each client's bytes go up as soon as they are read, and one
// write to the root carries every frame produced since the last one.
//
// Lifetime: the constructor connects to the root, proves the token, gets RELAY_OK (each try
// within connect_timeout) and binds the listening socket; a root that does not answer yet is
// tried again (0.1 s doubling to 2 s) for up to relink_timeout. It throws ddprun::NetworkError
// naming the root's host:port (or the listening address) when the root refuses, or is still
// unreachable then. start() begins accepting. When the
// link to the root is lost the relay closes every client connection (their agents reconnect and
// REJOIN), keeps its port, stops accepting (new clients wait in the listen backlog) and links
// again, retrying with a backoff of 0.1 s doubling to 2 s, each try bounded by connect_timeout,
// for up to relink_timeout (a root restarted on the same address is found again; the agents'
// REJOINs then rebuild its rounds). A root that, while bytes wait for it, neither takes one nor
// sends one for link_stall_timeout (stopped or wedged) counts as a lost link too. Past relink_timeout, or at once when
// it is 0, it calls on_upstream_lost once: ddprun-rdzvd exits 1 so a service manager restarts it. stop() closes
// everything and is idempotent. Not thread-safe: every call on the io_context's thread.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace boost::asio {
class io_context;
}

namespace ddprun::rendezvous {

struct RelayServerOptions {
  std::string host = "0.0.0.0";  // address to listen on
  std::uint16_t port = 0;        // 0 = pick a free one, read it back with port()
  std::string upstream_host;     // the root daemon
  std::uint16_t upstream_port = 0;
  std::string token;  // the root's token (a relay needs one)
  std::size_t max_connections = 65536;
  std::size_t max_queued_bytes = std::size_t{16} << 20;
  // Replies queued for all clients together: past it the clients with the most unread are closed.
  std::size_t max_buffered_bytes = std::size_t{1} << 30;
  std::size_t max_upstream_backlog = std::size_t{64} << 20;
  std::chrono::milliseconds connect_timeout{10000};
  std::chrono::milliseconds relink_timeout{60000};  // 0: give up at the first loss
  // The link counts as lost (and is made again, as above) once the root has neither taken a byte
  // of what waits for it nor sent one for this long: a root that is stopped or wedged. Zero
  // disables.
  std::chrono::milliseconds link_stall_timeout{60000};
  std::function<void(const std::string& why)> on_upstream_lost;
};

struct RelayStats {
  std::size_t clients = 0;          // open now
  std::uint64_t clients_total = 0;  // accepted since start
  std::uint64_t clients_refused = 0;
  std::uint64_t clients_evicted = 0;  // closed at --max-connections to make room (not authenticated)
  std::uint64_t clients_shed = 0;     // closed past --max-buffered-bytes (the most unread replies)
  std::uint64_t bytes_up = 0;         // client bytes sent to the root
  std::uint64_t bytes_down = 0;       // root bytes written to clients
  std::size_t max_connections = 0;    // after the open-files clamp
};

class RelayServer {
 public:
  RelayServer(boost::asio::io_context& io, RelayServerOptions options);
  ~RelayServer();
  RelayServer(const RelayServer&) = delete;
  RelayServer& operator=(const RelayServer&) = delete;

  void start();
  void stop();
  std::uint16_t port() const;
  RelayStats stats() const;
  // The token for the links made from now on (SIGHUP re-reads --token-file); the link that is up
  // stays.
  void set_token(std::string token);

  struct Core;

 private:
  std::shared_ptr<Core> core_;
};

}  // namespace ddprun::rendezvous
