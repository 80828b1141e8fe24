#pragma once
// RendezvousService: the server side of the native rendezvous, installed as the StoreServer's
// extension (StoreServerOptions::extension) so it shares the store port.
//
// It owns a RendezvousRegistry (many jobs, isolated by run id), decodes the native frames of
// rendezvous_wire.hpp, feeds them to the registry with the current time and pushes every
// resulting action, encoded, to the connection of the node it names. It maps connections to
// (run id, node): the newest connection of a node wins, and the close of a connection that
// still speaks for a node reports `disconnected` (a reconnect within one heartbeat interval
// keeps the node). Progress lines are throttled per job: the node whose message caused them
// always gets its line, the other waiting nodes at most one per progress_interval, and at most
// one per progress_spacing_per_node times their number (a round of N joins would otherwise push
// N^2/2 lines). One asio::steady_timer is armed at
// registry.next_deadline() after every event and tick (a Timer of timers.hpp); nothing polls. STATUS frames get a
// STATUS_REPLY snapshot.
//
// Authentication (docs/protocol.md, "Authentication"; rendezvous_auth.hpp): a connection opens
// with HELLO and gets a CHALLENGE; with a token it must then AUTH (HMAC over both nonces and the
// run id it wants) before any other frame, and is bound to that run id ("*" = every job). On a
// token daemon TCPStore ops of a connection that did not authenticate are refused unless
// allow_unauthenticated_store. Node binding applies with or without a token: JOIN registers
// (run id, node) to the connection and answers JOINED with a random node secret; HEARTBEAT,
// LEAVE, WORKER_FAILED and SUCCEEDED are accepted only from the owning connection, CLOSE only
// from a connection owning a member of that job; a JOIN naming a node that another connection
// owns (or that holds a secret) is refused; REJOIN must present the node's secret and moves the
// ownership (a daemon that does not know the node adopts the presented secret). Every refusal
// answers REFUSED and closes the connection (the store server logs it with the peer).
//
// Lifetime: RendezvousServer (rendezvous_server.hpp) does the wiring: it creates the service with
// std::make_shared, installs it as StoreServerOptions::extension, builds the StoreServer, calls
// attach(server) so that timer-driven pushes reach the sockets, and detach()/shutdown() before
// the server and the io_context go. Not thread-safe: everything runs on the io_context thread
// that runs the server.
#include <array>
#include <cstddef>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "ddprun/common/clock.hpp"
#include "ddprun/common/metrics.hpp"
#include "ddprun/rendezvous/rendezvous_state.hpp"
#include "ddprun/rendezvous/rendezvous_wire.hpp"
#include "ddprun/rendezvous/store_extension.hpp"
#include "ddprun/rendezvous/timers.hpp"

namespace boost::asio {
class io_context;
}

namespace ddprun::rendezvous {

class StoreServer;

// A job's progress fan-out to its waiting nodes is spaced by at least this much per waiting
// node (and by progress_interval): 100 us per node keeps the fan-outs of a large round near 5 %
// of the daemon's time (a frame costs about 5 us to write), e.g. one per 10 s at 100,000 nodes.
inline constexpr Duration progress_spacing_per_node = std::chrono::microseconds(100);

struct RendezvousServiceOptions {
  std::string token;  // "" = no authentication (node binding still applies)
  // With a token: a token rotated out that still authenticates connections bound to one job,
  // which may then only re-register nodes (the agents of jobs started before the rotation,
  // through a reconnect or a daemon restart); never relays or every-job STATUS. "" = none.
  std::string previous_token;
  // A REJOIN with the previous token of a node the daemon does not know (no node secret) is
  // accepted only this long after the service started (a restart forgot every secret); later
  // only known nodes re-register with it.
  Duration previous_token_window = std::chrono::seconds(60);
  bool allow_unauthenticated_store = false;  // with a token: torch clients may use store ops
  WireLimits limits;
  Duration progress_interval = std::chrono::seconds(1);
  // Jobs with no live member are forgotten this long after they last had one
  // (rendezvous_registry.hpp); nullopt = never.
  std::optional<Duration> job_expiry = default_job_expiry;
  std::size_t max_jobs = default_max_jobs;                  // 0 = no cap
  std::size_t max_members = default_max_members;            // over all jobs; 0 = no cap
  std::size_t max_member_bytes = default_max_member_bytes;  // member_footprint() over all jobs; 0 = no cap
  bool embedded = false;  // hosted inside an agent, not a ddprun-rdzvd: said in CHALLENGE
  // The store's --max-queued-reply-bytes: a STATUS of every job whose reply is larger is refused
  // (with a hint to ask for one job) instead of queued and its connection closed for it.
  std::size_t max_reply_bytes = StoreLimits{}.max_queued_reply_bytes;
};

struct RendezvousServiceStats {
  std::size_t jobs = 0;
  std::size_t nodes = 0;         // nodes with a live connection
  std::size_t node_secrets = 0;  // node secrets held (members, and nodes gone since the last sweep)
  std::uint64_t frames = 0;
  std::uint64_t pushes = 0;
  std::uint64_t progress_dropped = 0;  // throttled Progress lines
  // Counted for the metrics endpoint (rendezvous_metrics.hpp).
  std::uint64_t joins = 0;             // join and rejoin frames
  std::uint64_t rounds_closed = 0;     // assignments to group rank 0: one per closed round
  std::uint64_t restarts = 0;          // distinct (run id, ended round) restart decisions
  std::uint64_t frames_malformed = 0;  // native frames that failed to decode
  std::uint64_t relay_links = 0;       // connections accepted as relay links (RELAY)
  // Refuse decisions and refused frames (authentication, node ownership), by RefuseCode.
  std::array<std::uint64_t, kRefuseCodes> refused{};
  // From the first join of the round being collected to its close.
  metrics::Histogram round_close_seconds{round_close_buckets()};
  static std::vector<double> round_close_buckets() {
    return {0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800};
  }
};

class RendezvousService final : public StoreExtension, public std::enable_shared_from_this<RendezvousService> {
 public:
  // `timers`: the clock of every decision and the one deadline timer (tests: ManualTimers).
  RendezvousService(boost::asio::io_context& io, RendezvousServiceOptions options, Timers& timers = Timers::steady());
  ~RendezvousService() override;
  RendezvousService(const RendezvousService&) = delete;
  RendezvousService& operator=(const RendezvousService&) = delete;

  // The server that carries timer-driven pushes. Pushes produced while a frame is handled go
  // through the server's outbox and need no attach.
  void attach(StoreServer& server);
  void detach();
  // detach() and release the timer for good: later events still update the registry but arm
  // nothing. After this the service holds no object of the io_context, so it may outlive it.
  void shutdown();
  // Every unfinished job fails with `reason` (RendezvousJob::abort); its members are told now.
  void abort_all(const std::string& reason, int exit_code);

  DecodeResult on_frame(ConnectionId conn, std::string_view buffer, StoreState& state, Outbox& outbox) override;
  void on_disconnect(ConnectionId conn) override;
  std::string store_op_refusal(ConnectionId conn) override;
  bool awaiting_authentication(ConnectionId conn) override;
  // on_reset: the default (nothing). The server closes every connection right after a reset
  // (on_disconnect follows for each); the jobs themselves survive a key-space reset.

  // A new token (ddprun-rdzvd's SIGHUP re-read of --token-file): connections that already
  // authenticated keep their binding; every AUTH from now on is checked against `token`.
  void set_token(std::string token) { options_.token = std::move(token); }
  // The rotated-out token still accepted for rejoins (RendezvousServiceOptions::previous_token);
  // "" = none from now on (connections that proved it keep their binding).
  void set_previous_token(std::string token) { options_.previous_token = std::move(token); }

  const RendezvousRegistry& registry() const { return registry_; }
  RendezvousServiceStats stats() const;
  // When the round `run_id` is collecting now saw its first join (nullopt: none is collecting,
  // or its joins predate this daemon). For the metrics endpoint.
  std::optional<TimePoint> round_opened_at(const std::string& run_id) const;

 private:
  struct NodeKey {
    std::string run_id;
    NodeId node;
    auto operator<=>(const NodeKey&) const = default;
  };

  // What a connection has proved (absent = nothing: no HELLO yet).
  struct Session {
    std::string server_nonce;
    std::string client_nonce;
    std::string run_id;  // bound by AUTH; "" = not authenticated
    bool auth_tried = false;
    bool previous_token = false;  // proved the previous token: REJOIN only, no JOIN
  };

  // A refused frame: the text the client sees and the code the metrics count. An empty
  // reason means the frame was accepted.
  struct Refusal {
    RefuseCode code = RefuseCode::other;
    std::string reason;
    bool refused() const { return !reason.empty(); }
  };

  // Handles one decoded frame; no refusal = done, else refuse it and close.
  Refusal handle(ConnectionId conn, ClientMessage& message);
  Refusal handshake(ConnectionId conn, ClientMessage& message);
  // RELAY: a token holder authenticated for every job turns its connection into a relay link.
  Refusal relay(ConnectionId conn, const RelayMessage& m);
  // No refusal when `conn` may act on `run_id` (authenticated for it, or no token).
  Refusal check_run(ConnectionId conn, const std::string& run_id) const;
  // No refusal when `conn` owns (run_id, node).
  // A JOIN on a connection that proved the previous token: refused unless the connection already
  // speaks for that node (it re-registered with a REJOIN and joins its job's next round).
  Refusal check_previous_token(ConnectionId conn, const std::string& run_id, const NodeId& node) const;
  // A REJOIN on such a connection: refused for a node the daemon does not know once
  // previous_token_window has passed since the service started.
  Refusal check_previous_token_rejoin(ConnectionId conn, const std::string& run_id, const NodeId& node,
                                      TimePoint now) const;
  Refusal check_owner(ConnectionId conn, const std::string& run_id, const NodeId& node) const;
  Refusal check_join(ConnectionId conn, const std::string& run_id, const NodeId& node) const;
  Refusal check_rejoin(ConnectionId conn, const std::string& run_id, const RejoinRequest& request) const;
  // After an accepted JOIN/REJOIN: `conn` speaks for the node; JOINED carries its secret.
  void bind(ConnectionId conn, const std::string& run_id, const NodeId& node, std::string secret);
  void unbind(ConnectionId conn);
  // Secrets of nodes that are neither connected nor members any more (their lease ran out in a
  // job that lives on): dropped once the map doubled since the last sweep, so churn within one
  // live job cannot grow it without bound. Amortised O(log) per bind.
  void sweep_secrets_if_large();
  void forget_dead_secrets(const std::vector<std::string>& dropped);
  // `origin`: the node whose message produced the actions (null for timer ticks).
  void apply(const Decisions& actions, const NodeId* origin = nullptr);
  void broadcast_progress(const Progress& progress, const NodeId* origin);
  void emit(ConnectionId conn, std::string_view bytes);
  void rearm();
  void on_timer();

  RendezvousServiceOptions options_;
  const Clock& clock_;
  TimePoint started_;  // for previous_token_window
  RendezvousRegistry registry_;
  StoreServer* server_ = nullptr;
  Outbox* outbox_ = nullptr;  // set while a frame is handled
  std::unique_ptr<Timer> timer_;
  std::optional<TimePoint> armed_;
  std::map<NodeKey, ConnectionId> conn_of_;
  std::map<NodeKey, std::string> secret_of_;  // node secrets issued (or adopted) per member
  std::size_t secrets_sweep_above_ = 1024;    // sweep_secrets_if_large's threshold
  std::unordered_map<ConnectionId, Session> sessions_;
  std::unordered_map<ConnectionId, NodeKey> node_of_;
  std::unordered_map<std::string, TimePoint> last_broadcast_;  // per run id: Progress to everyone
  std::string scratch_;
  // The last STATUS reply of every job, encoded, and when: reused for kStatusAllReuse while no
  // frame but heartbeats and STATUS came, nothing disconnected and no timer ran (changed()
  // drops it, and its memory), so that clients asking again and again (several `ddprun status
  // --watch`) cost one snapshot of every member per second, not one each. Only lease and
  // heartbeat ages are that stale.
  static constexpr Duration kStatusAllReuse = std::chrono::seconds(1);
  Refusal status_all(ConnectionId conn, TimePoint now);
  void changed();
  std::string status_all_;
  std::optional<TimePoint> status_all_at_;
  std::size_t status_all_bytes_ = 0;  // its size (kept alone for one over max_reply_bytes)
  ClientMessage message_;
  RendezvousServiceStats counters_;
  // Metrics bookkeeping per run id, pruned like last_broadcast_.
  void count(const Decision& action);
  std::unordered_map<std::string, TimePoint> round_open_;        // first join of the collecting round
  std::unordered_map<std::string, std::uint64_t> last_restart_;  // last ended round counted
  std::unordered_map<std::string, std::uint64_t> last_closed_;   // last closed round counted
};

}  // namespace ddprun::rendezvous
