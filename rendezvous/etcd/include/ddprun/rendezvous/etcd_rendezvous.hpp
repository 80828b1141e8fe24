#pragma once
// EtcdRendezvous: the elastic rendezvous (--rdzv-backend etcd) with etcd v3 as the only shared
// component: no ddprun process in the middle. Same shape and same semantics as RendezvousClient
// (rendezvous_client.hpp), so the agent drives either one the same way.
//
// How agents decide consistently: every agent keeps a replica of the job's decision state, a
// RendezvousRegistry (rendezvous_state.hpp, the same pure decision core ddprun-rdzvd runs), and
// etcd holds the ordered log of the events that drive it. To report something (join, failure,
// success, leave, a lost node, a deadline that passed) an agent appends one event with a
// transaction that succeeds only if the log has exactly the entries the agent has applied
// (compare: log/<seq> absent and log/<seq-1> present). On conflict it applies what others
// appended (returned by the same txn) and re-decides whether its event is still due. Every
// agent watches the log and applies each entry in order, so all replicas run the same events at
// the same recorded times and reach the same decisions; each agent delivers the actions
// addressed to its own NodeId (assignment, restart, job failed/completed, refusal, progress).
//
// Time: an event carries the wall-clock time (ms) of the agent that appended it, clamped so the
// log never goes back in time; replicas replay that time, never their own clock. Deadlines
// (join, last call, exit barrier) are armed locally from the replica's next_deadline(); the
// first agent whose clock reaches it appends a tick. Clock skew between agents therefore moves
// a deadline by at most the skew of the earliest agent (NTP keeps that to milliseconds) and can
// never make replicas disagree.
//
// Liveness: each agent's membership key (nodes/<node id>) is attached to its own etcd lease,
// kept alive every heartbeat_interval; when an agent stops (SIGKILL, SIGSTOP, partition) etcd
// deletes the key after the lease TTL, every watcher sees the deletion, and one of them appends
// an "expired" event (the registry's lost-node path). Every key of the job lives under
// <etcd_prefix><run_id>/ and the log and the lease key are attached to a shared job lease that
// every agent keeps alive: once no agent is left, etcd removes the whole job after its TTL.
//
// Key layout (P = etcd_prefix + run_id + "/"): P"lease" = decimal id of the job lease;
// P"log/<seq, 12 digits>" = one event; P"nodes/<addr:pid/instance>" = a live agent.
//
// Not thread-safe: every member and every callback runs on the io_context thread. Callbacks may
// call back into the object (e.g. join() from on_restart).
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ddprun/rendezvous/etcd_client.hpp"
#include "ddprun/rendezvous/rendezvous_client.hpp"
#include "ddprun/rendezvous/rendezvous_state.hpp"
#include "ddprun/rendezvous/rendezvous_wire.hpp"

namespace ddprun::rendezvous {

struct EtcdRendezvousOptions {
  etcd::EtcdClientOptions etcd;     // endpoints, TLS, credentials, timeouts
  std::string prefix = "/ddprun/";  // --rdzv-conf etcd_prefix
  std::string run_id = "none";      // --rdzv-id (no '/')
  NodeInfo node;                    // who we are (id, advertised addr, nproc, our worker store)
  JobConfig config;                 // min/max nodes, restart budget, timeouts, heartbeat
  // How long etcd may stay unreachable (no endpoint answers) before on_unreachable fires;
  // before the first successful exchange the join timeout bounds it too.
  Duration give_up_after = std::chrono::seconds(60);
};

class EtcdRendezvous {
 public:
  // Throws ddprun::Error / UsageError for unusable options (TLS files, empty endpoint list).
  EtcdRendezvous(boost::asio::io_context& io, EtcdRendezvousOptions options, RendezvousEvents events);
  ~EtcdRendezvous();
  EtcdRendezvous(const EtcdRendezvous&) = delete;
  EtcdRendezvous& operator=(const EtcdRendezvous&) = delete;

  // Connects if needed and joins the collecting round. Forgets the current assignment.
  void join();
  // NodeInfo::nccl_ids for the next join (this node's NCCL holder's IDs for that round).
  void set_nccl_ids(std::vector<std::uint8_t> ids);
  void report_failure(const WorkerFailure& failure);
  void report_success(std::uint64_t round);
  // Appends a leave event, revokes this agent's lease, then stops.
  void leave();
  // Stops keepalives, the watch and every retry. Idempotent; no callback fires afterwards.
  void stop();

  const std::optional<Assignment>& current_assignment() const;
  // True while the log is being followed and the last exchange with etcd succeeded.
  bool connected() const;

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

// `ddprun status --rdzv-backend etcd`: reads the job logs under `prefix` (one job, or every job
// when run_id is empty) and replays them. Throws NetworkError naming the endpoints when etcd
// cannot be read within `timeout`.
RegistryStatus query_etcd_status(const etcd::EtcdClientOptions& options, const std::string& prefix,
                                 const std::string& run_id, std::chrono::milliseconds timeout);

// ---- the replicated log (pure; exposed for tests) ----
namespace etcd {

enum class EventKind { message, tick, expired };

struct LogEvent {
  std::int64_t time_ms = 0;  // wall clock of the appending agent, ms since the Unix epoch
  EventKind kind = EventKind::message;
  std::string id;         // unique per event: "<instance>-<counter>" of the appending agent
  ClientMessage message;  // message: what happened; expired: a LeaveMessage naming the node
};

// Value of a log key: "ddprun-etcd-event 1 <time_ms> <kind> <id>\n" + a native wire frame
// (rendezvous_wire.hpp) for message/expired. decode returns "" or what is wrong.
std::string encode_event(const LogEvent& event);
std::string decode_event(std::string_view value, const WireLimits& limits, LogEvent& out);

// "0000000000042"-style key suffix and its inverse (nullopt unless exactly 12 digits).
std::string log_seq_text(std::int64_t seq);
std::optional<std::int64_t> parse_log_seq(std::string_view text);

// The config the replicas run: the user's, with heartbeats handed to etcd leases (the
// registry's own lease never expires; an "expired" event removes a node after
// `node_ttl_seconds`, which is the etcd lease TTL and is what messages report).
JobConfig replica_config(const JobConfig& user, std::int64_t node_ttl_seconds);
// etcd lease TTLs (whole seconds; etcd's minimum is 2 s with default election timing).
std::int64_t node_lease_ttl(const JobConfig& user);
std::int64_t job_lease_ttl(const JobConfig& user);

// One replica: applies log entries in order and answers what the registry decided.
class JobLog {
 public:
  explicit JobLog(std::string run_id);
  // REQUIRES seq == next_seq(). Returns every action of the event (for every node).
  Decisions apply(std::int64_t seq, const LogEvent& event);
  std::int64_t next_seq() const { return next_seq_; }
  std::int64_t last_time_ms() const { return last_ms_; }
  // Wall-clock ms when a tick is next due; nullopt when no timer is pending.
  std::optional<std::int64_t> next_deadline_ms() const;
  const RendezvousJob* job() const { return registry_.find(run_id_); }
  RegistryStatus status(std::int64_t now_ms) const;
  // This node's status in the job (nullopt when not a member).
  std::optional<MemberStatus> member(const NodeId& id) const;

 private:
  TimePoint at(std::int64_t ms) const;

  std::string run_id_;
  RendezvousRegistry registry_{std::nullopt};  // no expiry: the log alone decides when the job ends
  std::int64_t next_seq_ = 0;
  std::int64_t t0_ms_ = 0;
  std::int64_t last_ms_ = 0;
};

}  // namespace etcd
}  // namespace ddprun::rendezvous
