#pragma once
// RendezvousServer: one rendezvous endpoint, the single place where a StoreServer and a
// RendezvousService are wired together. ddprun-rdzvd, the fan-out launcher and an agent that
// hosts the rendezvous itself all build one of these, so every bound on the shared port
// (RendezvousLimits) and its shutdown are set in RendezvousServerOptions and applied here once.
//
// What it does: binds the store server on options.host:options.port with the rendezvous service
// installed as its extension (native frames share the TCPStore port), attaches the service so
// timer-driven pushes reach the sockets, and, when options.stop_signals is non-empty, stops
// itself on the first of those signals and calls options.on_signal (the daemon's SIGINT/SIGTERM).
//
// Lifetime: the constructor binds (port() is valid on return) and throws ddprun::NetworkError
// naming host:port when the address cannot be bound; start() begins accepting. stop() closes
// the acceptor and every connection and is idempotent. The destructor stops and then releases
// the service's timer, so the object must be destroyed before the io_context it runs on (a
// pending store handler may keep the service object itself alive a little longer; without its
// timer it holds nothing of the io_context). Not thread-safe: every call on the io_context's
// thread, like StoreServer.
#include <csignal>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ddprun/common/clock.hpp"
#include "ddprun/rendezvous/protocol.hpp"
#include "ddprun/rendezvous/rendezvous_service.hpp"
#include "ddprun/rendezvous/rendezvous_wire.hpp"
#include "ddprun/rendezvous/store_server.hpp"
#include "ddprun/rendezvous/timers.hpp"

namespace boost::asio {
class io_context;
}

namespace ddprun::rendezvous {

// Every bound the server enforces, in one place: the store's (key/value sizes, keys per
// request, connections, bytes held, queued replies, timeouts) and the native frames' (payload
// size, JSON depth).
struct RendezvousLimits {
  StoreLimits store;
  WireLimits wire;
  // Connection timeouts of the store server (defaults and meaning: StoreServerOptions).
  std::chrono::milliseconds frame_timeout = StoreServerOptions{}.frame_timeout;
  std::chrono::milliseconds idle_timeout = StoreServerOptions{}.idle_timeout;
  std::chrono::milliseconds handshake_timeout = StoreServerOptions{}.handshake_timeout;
  std::chrono::milliseconds link_stall_timeout = StoreServerOptions{}.link_stall_timeout;
  // On for the daemon (a shared service): a client that stops reading gives its slot back.
  std::chrono::milliseconds reply_stall_timeout{std::chrono::seconds(60)};
};

struct RendezvousServerOptions {
  std::string host = "0.0.0.0";  // address to bind; "::" for dual stack
  std::uint16_t port = 0;        // 0 = pick a free port, read it back with port()
  // "" = no authentication (node binding still applies). Otherwise every connection must
  // authenticate with it (rendezvous_auth.hpp) before any native frame or store op.
  std::string token;
  // With a token: a rotated-out token still accepted for REJOINs of one job's nodes
  // (RendezvousServiceOptions::previous_token and previous_token_window). "" = none.
  std::string previous_token;
  Duration previous_token_window = std::chrono::seconds(60);
  // With a token: let connections that did not authenticate use TCPStore ops (torchrun's c10d
  // backend cannot authenticate). Anyone who reaches the port can then read and delete keys.
  bool allow_unauthenticated_store = false;
  // Hosted inside an agent (the c10d and static backends without a daemon): clients learn it in
  // the handshake and give up at once when it is gone (RendezvousClientOptions).
  bool embedded = false;
  RendezvousLimits limits;
  // Throttle for Progress lines to the nodes waiting in a collecting round.
  Duration progress_interval = std::chrono::seconds(1);
  // Jobs with no live member are forgotten this long after they last had one (ddprun-rdzvd
  // --job-expiry; rendezvous_registry.hpp); nullopt = never.
  std::optional<Duration> job_expiry = default_job_expiry;
  // Most jobs held at once (ddprun-rdzvd --max-jobs); 0 = no cap.
  std::size_t max_jobs = default_max_jobs;
  // Most members of all jobs together (ddprun-rdzvd --max-members); 0 = no cap.
  std::size_t max_members = default_max_members;
  std::size_t max_member_bytes = default_max_member_bytes;
  // Signals that stop the server (e.g. {SIGINT, SIGTERM} for the daemon); empty = the owner
  // handles signals itself. on_signal runs after the stop, with the signal number.
  std::vector<int> stop_signals;
  std::function<void(int signo)> on_signal;
};

class RendezvousServer {
 public:
  // `timers`: the service's clock and deadline timer (tests: ManualTimers).
  RendezvousServer(boost::asio::io_context& io, RendezvousServerOptions options, Timers& timers = Timers::steady());
  ~RendezvousServer();
  RendezvousServer(const RendezvousServer&) = delete;
  RendezvousServer& operator=(const RendezvousServer&) = delete;

  // Starts accepting connections (and listening for stop_signals).
  void start();
  // Detaches the service, closes the acceptor and every connection, stops listening for
  // signals. Idempotent.
  void stop();
  // Fails every unfinished job it serves with `reason` (an embedded host whose agent stops).
  void abort_jobs(const std::string& reason, int exit_code);

  std::uint16_t port() const;
  const std::string& host() const;
  const RendezvousServerOptions& options() const { return options_; }

  // Runs `callback` once, on the io_context, as soon as no client connection is open (see
  // StoreServer::on_drained): an agent hosting the rendezvous lingers until its peers left.
  void on_drained(std::function<void()> callback);

  // Replaces the token for every authentication from now on (RendezvousService::set_token);
  // already-authenticated connections stay.
  void set_token(std::string token);
  // Replaces the previous token (RendezvousService::set_previous_token); "" = none.
  void set_previous_token(std::string token);

  StoreStats store_stats() const;
  RendezvousServiceStats service_stats() const;
  const RendezvousRegistry& registry() const;
  // RendezvousService::round_opened_at: when the round `run_id` collects now saw its first join.
  std::optional<TimePoint> round_opened_at(const std::string& run_id) const;

  struct Signals;

 private:
  RendezvousServerOptions options_;
  std::shared_ptr<RendezvousService> service_;
  std::unique_ptr<StoreServer> store_;
  std::unique_ptr<Signals> signals_;
  bool stopped_ = false;
};

}  // namespace ddprun::rendezvous
