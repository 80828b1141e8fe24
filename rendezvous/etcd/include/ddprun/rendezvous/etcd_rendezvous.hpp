#pragma once
// EtcdRendezvous: the elastic rendezvous (--rdzv-backend etcd) with etcd v3 as the only shared
// component: no ddprun process in the middle. Same shape and same semantics as RendezvousClient
// (rendezvous_client.hpp), so the agent drives either one the same way.
//
// How agents decide consistently: every agent keeps a replica of the job's decision state, a
// RendezvousRegistry (rendezvous_state.hpp, the same pure decision core ddprun-rdzvd runs), and
// etcd holds the ordered log of the events that drive it. Every agent watches the log and applies
// each entry in order, so all replicas run the same events at the same recorded times and reach
// the same decisions; each agent delivers the actions addressed to its own NodeId (assignment,
// restart, job failed/completed, refusal, progress).
//
// Who writes the log: one agent at a time, the sequencer (the holder of P"leader", a key on its
// own node lease, taken with a create-if-absent transaction). To report something (join,
// failure, success, leave) an agent puts the event under its own inbox key P"inbox/<id>": a put
// of a key nobody else writes never conflicts, so N agents joining cost N puts. The sequencer
// watches the inbox and appends everything pending as ONE log entry (a batch) with a
// transaction that succeeds only if the log has exactly the entries it applied and it still
// holds P"leader"; the owner deletes its inbox key once it sees its event applied. Forming a
// round of N nodes therefore costs O(N) etcd operations in total, not O(N^2) retried
// compare-and-swaps on one log slot. Event ids are "<source>-<counter>" with a counter that
// grows per source, and a replica skips an id it has applied (a re-put, or a second sequencer
// that raced a leadership change), so an event is applied at most once.
//
// Time: every event of a batch carries the sequencer's wall-clock time (ms), clamped so the log
// never goes back in time; replicas replay that time, never their own clock. Deadlines (join,
// last call, exit barrier) are armed by the sequencer from its replica's next_deadline(); it
// appends a tick when its clock reaches one.
//
// Liveness: each agent's membership key (nodes/<node id>) is attached to its own etcd lease,
// kept alive every heartbeat_interval; when an agent stops (SIGKILL, SIGSTOP, partition) etcd
// deletes the key after the lease TTL, the sequencer sees the deletion and appends an "expired"
// event (the registry's lost-node path). When the sequencer itself stops, its P"leader" key
// goes with its lease, every agent sees that and one of them takes over (re-reading the whole
// job first). Every key of the job lives under P = <etcd_prefix><run_id>/; the log and the lease
// key are attached to a shared job lease that the sequencer keeps alive (every agent, while no
// sequencer is known): once no agent is left, etcd removes the whole job after its TTL.
// Keepalives use a connection of their own, so a call stuck on a member that lost its leader
// never delays a lease renewal.
//
// A job that vanished (its lease key gone, its log removed, by expiry or by another etcd client):
// every agent that notices claims the job anew with a transaction that puts P"lease" only where
// it still has the mod revision the agent followed (absent: 0), and clears P"log/", P"inbox/"
// and P"leader" in the same revision. One agent wins; the others follow its lease. The fresh
// log thus never inherits old entries, and always gets a sequencer (no orphaned leader key);
// running nodes re-register their assignments into it.
//
// Key layout: P"inbox/<source>-<counter, 12 digits>" = one pending event (owner's node lease);
// P"leader" = node id of the sequencer (its node lease); P"lease" = decimal id of the job
// lease; P"log/<seq, 12 digits>" = one batch of events; P"nodes/<addr:pid/instance>" = a live
// agent. Agents other than the sequencer read and watch only [P"leader", P"log/\xff"): the
// log, the leader and the lease key, never the other agents' inbox and node keys.
//
// Not thread-safe: every member and every callback runs on the io_context thread. Callbacks may
// call back into the object (e.g. join() from on_restart).
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
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
  // True while this agent is the job's sequencer (holds P"leader" and appends to the log).
  bool sequencing() const;

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

// One event (the value of an inbox key, and one element of a batch): "ddprun-etcd-event 1
// <time_ms> <kind> <id>\n" + a native wire frame (rendezvous_wire.hpp) for message/expired.
// decode returns "" or what is wrong.
std::string encode_event(const LogEvent& event);
std::string decode_event(std::string_view value, const WireLimits& limits, LogEvent& out);

// Value of a log key: "ddprun-etcd-batch 1 <count>\n" then, per event, "<bytes>\n" + the
// encoded event. decode returns "" or what is wrong (a batch is applied whole or not at all).
std::string encode_batch(const std::vector<LogEvent>& events);
std::string decode_batch(std::string_view value, const WireLimits& limits, std::vector<LogEvent>& out);
// Most events and bytes the sequencer puts in one batch: etcd refuses requests above
// --max-request-bytes (1.5 MiB by default).
inline constexpr std::size_t kMaxBatchEvents = 4096;
inline constexpr std::size_t kMaxBatchBytes = std::size_t{512} << 10;
// Most bytes (keys and values) an agent reads of a job at once (its view, read in pages under
// the client's response cap): about 1,000 rounds of a 1,024-node job. More fails the read,
// naming the keys and their size.
inline constexpr std::size_t kMaxJobBytes = std::size_t{512} << 20;

// "<source>-<counter>" -> (source, counter); nullopt when the id has no numeric counter.
std::optional<std::pair<std::string, std::uint64_t>> split_event_id(std::string_view id);

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
  // REQUIRES seq == next_seq() (else nothing happens). Applies the events of one log entry in
  // order, skipping any event whose id was applied before (seen()), and returns every action
  // (for every node).
  Decisions apply(std::int64_t seq, const std::vector<LogEvent>& batch);
  Decisions apply(std::int64_t seq, const LogEvent& event) { return apply(seq, std::vector<LogEvent>{event}); }
  // True when an event with this id, or a later one of the same source, was applied.
  bool seen(std::string_view id) const;
  std::int64_t next_seq() const { return next_seq_; }
  std::int64_t last_time_ms() const { return last_ms_; }
  // Wall-clock ms when a tick is next due; nullopt when no timer is pending.
  std::optional<std::int64_t> next_deadline_ms() const;
  const RendezvousJob* job() const { return registry_.find(run_id_); }
  RegistryStatus status(std::int64_t now_ms) const;
  // This node's status in the job (nullopt when not a member). O(N): status of every member.
  std::optional<MemberStatus> member(const NodeId& id) const;
  // This node's role in the job (nullopt when not a member). O(log N).
  std::optional<MemberRole> role(const NodeId& id) const;

 private:
  TimePoint at(std::int64_t ms) const;
  Decisions apply_one(std::int64_t seq, const LogEvent& event);

  std::string run_id_;
  RendezvousRegistry registry_{std::nullopt};  // no expiry: the log alone decides when the job ends
  std::int64_t next_seq_ = 0;
  bool started_ = false;  // t0_ms_ is the time of the first event applied
  std::int64_t t0_ms_ = 0;
  std::int64_t last_ms_ = 0;
  std::map<std::string, std::uint64_t, std::less<>> applied_;  // source -> highest counter applied
};

}  // namespace etcd
}  // namespace ddprun::rendezvous
