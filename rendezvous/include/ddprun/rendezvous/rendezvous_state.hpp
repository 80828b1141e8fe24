#pragma once
// Rendezvous decisions for ddprun's elastic jobs: pure state, events in, actions out.
//
// A RendezvousJob holds the membership of one job (one --rdzv-id): its rounds, the join,
// last-call and exit-barrier deadlines, the heartbeat lease of every node and the job-wide
// restart budget. A RendezvousRegistry holds many isolated jobs keyed by run id and checks the
// server-wide token. Every event method takes the current time as an argument and returns the
// messages the server must push (a std::vector<Action>); nothing here does I/O, reads a clock,
// sleeps or spawns threads. The server arms ONE timer at next_deadline() and calls
// on_tick(now) when it fires; nothing polls.
//
// Cost: join, rejoin, heartbeat, disconnect, leave, success, next_deadline() and a tick that
// expires k leases are O(log N + k) for a job of N nodes (role and success counters and a lease
// index ordered by deadline are kept incrementally; audit() checks them against a scan). Closing
// or ending a round, failing/completing the job and status() are O(N): once per round.
//
// Not thread-safe: owned by the single io_context thread of the daemon (or embedded agent).
// Requests arrive from the network, so bad requests never throw: they produce a Refuse action
// naming what was wrong and what to do.
//
// Job states and transitions ("J" = nodes that joined the collecting round, "E" = nodes of
// the previous round not yet re-joined, "P" = participants of the running round):
//
//   state     event                                    -> next state, actions
//   --------  ---------------------------------------  ---------------------------------------
//   (none)    join / rejoin without assignment          waiting (round 0), config from joiner
//   (none)    rejoin with an assignment (daemon lost    running at the assignment's round; the
//             its state)                                missing group ranks must re-register
//                                                       within rebuild_grace or the round ends
//   waiting   join, J+E < max                           waiting; Progress to every joiner
//   waiting   join, J+E >= max                          Refuse "full" (spares not supported)
//   waiting   J == max                                  running: SendAssignment to each of J
//   waiting   J >= min, follow-up round, E == 0          running (every survivor is back)
//   waiting   J >= min first time                        last call = now + last_call_timeout
//   waiting   tick >= last call (J >= min)               running with the nodes present
//   waiting   tick >= join deadline (J < min)            failed: "timed out ... 1/2 joined"
//   waiting   lease expiry / leave                       waiting (node dropped; maybe J < min)
//   running   join of a new node, P+wait < max           waiting (round+1): SendRestart to P
//                                                        (membership change, no restart used)
//   running   join of a new node, P+wait >= max          Refuse "full"
//   running   lease expiry / leave of a participant      waiting (round+1): SendRestart to the
//                                                        survivors (membership change); if
//                                                        fewer than min remain the round waits
//                                                        for replacements up to join_timeout
//   running   worker failure, restarts left              waiting (round+1): SendRestart to P,
//                                                        restarts_used + 1
//   running   worker failure, budget spent               failed: SendJobFailed(root cause,
//                                                        exit code) to every node
//   running   failure / success for another round        ignored (stale)
//   running   succeeded, all of P succeeded              completed: SendJobCompleted to all
//   running   tick >= exit barrier (first success +      failed: "exit barrier timed out"
//             exit_barrier_timeout)
//   running   tick >= rebuild deadline, ranks missing    waiting (round+1): membership change
//   any       close()                                    closed flag: new nodes refused
//   done      any event from a node                      its final result again (completed/
//                                                        failed) or Refuse for unknown nodes
//   done      tick >= finished + close_timeout           registry drops the job (GC)
//
// Rank stability: when a round closes, a node keeps its previous group rank if that rank is
// below the new group size and free; other nodes fill the gaps in order of first join.
// Rank offsets are prefix sums of local_world_size in group-rank order. Every assignment of a
// round carries the group-rank-0 node's NodeInfo::nccl_ids as Assignment::nccl_id, so all
// ranks get the same NCCL unique ID, and a new one each round (docs/gpus.md).
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include "ddprun/common/clock.hpp"

namespace ddprun::rendezvous {

// Exit code every agent uses when the job fails for a rendezvous reason (timeout, barrier)
// rather than a worker's own exit status.
inline constexpr int kRendezvousFailureExitCode = 1;

// Identity of one agent process. `instance` is random, chosen by the agent at start, so a
// restarted agent with a recycled pid is a different node.
struct NodeId {
  std::string addr;
  std::int64_t pid = 0;
  std::string instance;

  auto operator<=>(const NodeId&) const = default;
  bool operator==(const NodeId&) const = default;
  std::string to_string() const;  // "addr:pid/instance"
};

// What an agent tells the rendezvous about itself when it joins.
struct NodeInfo {
  NodeId id;
  std::string addr;           // advertised address (messages, status; fallback for store_host)
  int local_world_size = 1;   // nproc on this node; may differ between nodes
  std::string store_host;     // the worker store this agent already bound: MASTER_ADDR if the
  std::uint16_t store_port = 0;  // node gets group rank 0 (empty host -> addr)
  // NCCL unique IDs (K x 128 bytes, or empty) created by this node's holder for the round it
  // joins. When the round closes, every Assignment::nccl_id is the group-rank-0 node's.
  std::vector<std::uint8_t> nccl_ids;
};

// Job configuration, fixed by the first joiner. Only min/max/max_restarts must agree between
// nodes; the timers of the first joiner win.
struct JobConfig {
  int min_nodes = 1;
  int max_nodes = 1;
  int max_restarts = 0;  // GLOBAL budget for the job (not per agent)
  Duration join_timeout = std::chrono::seconds(600);
  Duration last_call_timeout = std::chrono::seconds(30);
  Duration close_timeout = std::chrono::seconds(30);
  Duration heartbeat_interval = std::chrono::seconds(1);
  int missed_heartbeats = 3;
  Duration exit_barrier_timeout = std::chrono::seconds(300);
  // After a daemon restart, how long the first rejoiner's round waits for the other group ranks
  // to re-register before it ends as a membership change.
  Duration rebuild_grace = std::chrono::seconds(10);

  Duration lease() const { return heartbeat_interval * missed_heartbeats; }
  // Empty when valid, else a sentence naming the bad field and value.
  std::string validate() const;
};

// What a node receives when a round closes.
struct Assignment {
  std::uint64_t round = 0;
  int group_rank = 0;
  int group_world_size = 0;
  int local_world_size = 0;
  int rank_offset = 0;  // global rank of this node's local rank 0
  int world_size = 0;
  std::string master_addr;  // the group-rank-0 node's worker store
  std::uint16_t master_port = 0;
  int restart_count = 0;
  int max_restarts = 0;
  std::vector<std::uint8_t> nccl_id;  // the group-rank-0 node's NodeInfo::nccl_ids (may be empty)

  bool operator==(const Assignment&) const = default;
};

// A worker failure reported by an agent.
struct WorkerFailure {
  std::uint64_t round = 0;
  NodeId node;
  int global_rank = -1;
  int local_rank = -1;
  std::optional<int> exit_code;  // set when the worker exited
  std::optional<int> signal;     // set when a signal killed it
  std::string message;

  // The code ddprun exits with for this failure: 128+signal, else the exit code (1 if the
  // report carries neither or exit code 0).
  int ddprun_exit_code() const;
};

// The first failure of the round that ended the job, with where it happened.
struct RootCause {
  WorkerFailure failure;
  std::string node_addr;
  int group_rank = -1;
  std::string describe() const;  // "rank 5 (local rank 1 on node 10.0.0.2) exited with code 3: msg"
};

struct JoinRequest {
  NodeInfo node;
  JobConfig config;
  std::string token;
};

// Sent by an agent after it (re)connects: carries the assignment it is running with, if any,
// so a restarted daemon can rebuild the running round.
struct RejoinRequest {
  NodeInfo node;
  JobConfig config;
  std::string token;
  std::optional<Assignment> assignment;
};

// ---- actions (plain data; every one names its job and node) ----

struct SendAssignment {
  std::string run_id;
  NodeId node;
  Assignment assignment;
};

enum class RoundEnd { worker_failure, membership_change };

// "Stop your workers and join again": the round the node was running has ended.
struct SendRestart {
  std::string run_id;
  NodeId node;
  std::uint64_t ended_round = 0;
  RoundEnd kind = RoundEnd::membership_change;
  int restart_count = 0;  // restarts used after this decision
  std::string reason;
};

struct SendJobFailed {
  std::string run_id;
  NodeId node;
  std::string reason;
  std::optional<RootCause> root_cause;  // set when a worker failure spent the budget
  int exit_code = kRendezvousFailureExitCode;
};

struct SendJobCompleted {
  std::string run_id;
  NodeId node;
};

struct Refuse {
  std::string run_id;
  NodeId node;
  std::string reason;
};

// The daemon does not know this node (or job): the agent should send a rejoin with its
// current assignment.
struct AskRejoin {
  std::string run_id;
  NodeId node;
  std::string reason;
};

// A progress line for one node, or (broadcast) for every node that joined the collecting
// round: then `node` is empty and the server fans it out (throttled), so a join costs O(1)
// actions instead of one per waiting node (O(N^2) for a job of N nodes).
struct Progress {
  std::string run_id;
  NodeId node;
  std::string text;
  bool broadcast = false;
};

using Action = std::variant<SendAssignment, SendRestart, SendJobFailed, SendJobCompleted, Refuse,
                            AskRejoin, Progress>;
using Actions = std::vector<Action>;

// ---- status (for `ddprun status`) ----

enum class JobState { waiting, running, completed, failed };
const char* to_string(JobState state);

enum class MemberRole {
  joined,       // joined the collecting round (while running: the wait list)
  expected,     // took part in the previous round, not re-joined yet
  participant,  // has a group rank in the running round
  late,         // was expected when the round closed without it; its next join is a scale-up
};
const char* to_string(MemberRole role);

struct MemberStatus {
  NodeId id;
  std::string addr;
  int local_world_size = 0;
  MemberRole role = MemberRole::joined;
  int group_rank = -1;  // -1 unless participant
  bool succeeded = false;
  bool disconnected = false;
  Duration last_heartbeat_age{};
  Duration lease_left{};
};

struct JobStatus {
  std::string run_id;
  JobState state = JobState::waiting;
  bool closed = false;
  std::uint64_t round = 0;
  int min_nodes = 0;
  int max_nodes = 0;
  int restarts_used = 0;
  int max_restarts = 0;
  std::vector<MemberStatus> members;  // in group-rank order, then join order
  std::optional<Duration> join_timeout_in;
  std::optional<Duration> last_call_in;
  std::optional<Duration> exit_barrier_in;
  std::optional<Duration> rebuild_in;
  std::optional<Duration> gc_in;
  std::string progress;        // one line, e.g. the waiting text
  std::string result;          // final reason when failed; "" otherwise
  std::optional<RootCause> last_failure;  // most recent worker failure (any round)
};

struct RegistryStatus {
  std::vector<JobStatus> jobs;  // by run id
};

// ---- one job ----

class RendezvousJob {
 public:
  // REQUIRES: config.validate() is empty.
  RendezvousJob(std::string run_id, JobConfig config, TimePoint now);
  // Move-only: the lease index points into members_ (node-based, so a move keeps it valid).
  RendezvousJob(RendezvousJob&&) = default;
  RendezvousJob& operator=(RendezvousJob&&) = default;
  RendezvousJob(const RendezvousJob&) = delete;
  RendezvousJob& operator=(const RendezvousJob&) = delete;

  // Rebuilds a running job from the first rejoiner after a daemon restart.
  // REQUIRES: request.assignment is set and consistent (checked by the registry).
  static RendezvousJob rebuild(std::string run_id, const RejoinRequest& request, TimePoint now,
                               Actions& out);

  const std::string& run_id() const { return run_id_; }
  const JobConfig& config() const { return config_; }
  JobState state() const { return state_; }
  std::uint64_t round() const { return round_; }
  int restarts_used() const { return restarts_used_; }
  bool closed() const { return closed_; }
  bool finished() const { return state_ == JobState::completed || state_ == JobState::failed; }

  // Events. `requested` is the joiner's config (checked against the job's).
  Actions join(const NodeInfo& node, const JobConfig& requested, TimePoint now);
  Actions rejoin(const RejoinRequest& request, TimePoint now);
  Actions heartbeat(const NodeId& node, TimePoint now);
  // The node's connection closed: its lease shrinks to now + heartbeat_interval; a heartbeat or
  // rejoin before then restores it.
  Actions disconnected(const NodeId& node, TimePoint now);
  Actions leave(const NodeId& node, TimePoint now);
  Actions worker_failed(const WorkerFailure& failure, TimePoint now);
  Actions succeeded(const NodeId& node, std::uint64_t round, TimePoint now);
  Actions close(TimePoint now);
  Actions on_tick(TimePoint now);

  // Earliest time on_tick has something to do; nullopt when nothing is pending.
  std::optional<TimePoint> next_deadline() const;
  // True once the registry may forget the job (finished, or closed and empty, for close_timeout).
  bool collectable(TimePoint now) const;

  JobStatus status(TimePoint now) const;
  std::string progress_text(TimePoint now) const;
  // Nodes waiting in the collecting round (the targets of a broadcast Progress).
  std::vector<NodeId> joined_nodes() const;
  // Number of members in `role`: O(1), kept incrementally.
  int count(MemberRole role) const { return role_count_[static_cast<int>(role)]; }

  // Recomputes the incremental indexes (role counters, success counter, lease index) by brute
  // force over the members and compares: "" when they agree, else what differs. O(N); for
  // tests and assertions only.
  std::string audit() const;

 private:
  // Lease deadline -> member (its key in members_, which never moves): the earliest lease and
  // the expired ones without scanning every member.
  using LeaseIndex = std::multimap<TimePoint, const NodeId*>;

  struct Member {
    NodeInfo info;
    MemberRole role = MemberRole::joined;
    TimePoint last_heartbeat{};
    TimePoint lease_deadline{};
    bool disconnected = false;
    std::uint64_t join_seq = 0;
    std::optional<int> prev_rank;
    int group_rank = -1;
    bool succeeded = false;
    std::optional<Assignment> assignment;
    LeaseIndex::iterator lease_it{};  // this member's entry in leases_ (always valid)
  };

  Member* find(const NodeId& id);
  Member& add_member(const NodeInfo& info, MemberRole role, TimePoint now);
  void erase_member(std::map<NodeId, Member>::iterator it);
  void refresh(Member& m, TimePoint now);
  // The only writers of Member::role / succeeded / lease_deadline: they keep role_count_,
  // succeeded_count_ and leases_ in step, so a join costs O(log N) instead of a member scan.
  void set_role(Member& m, MemberRole role);
  void set_succeeded(Member& m, bool succeeded);
  void set_lease(Member& m, TimePoint deadline);
  std::string config_mismatch(const JobConfig& requested) const;
  Actions final_result_for(const NodeId& node, TimePoint now) const;
  // Progress for `origin` (when it waits in the collecting round) plus one broadcast for the
  // other waiting nodes.
  void send_progress(Actions& out, TimePoint now, const NodeId* origin = nullptr) const;

  void evaluate_waiting(Actions& out, TimePoint now);
  void close_round(Actions& out);
  void end_round(Actions& out, RoundEnd kind, const std::string& reason, TimePoint now);
  void fail_job(Actions& out, const std::string& reason, std::optional<RootCause> cause,
                int exit_code, TimePoint now);
  void complete_job(Actions& out, TimePoint now);
  void remove_members(Actions& out, const std::vector<NodeId>& ids, const std::string& reason,
                      TimePoint now);
  void mark_gc_if_empty(TimePoint now);
  void check_completion(Actions& out, TimePoint now);

  std::string run_id_;
  JobConfig config_;
  JobState state_ = JobState::waiting;
  bool closed_ = false;
  std::uint64_t round_ = 0;
  int restarts_used_ = 0;
  std::uint64_t next_join_seq_ = 0;
  std::map<NodeId, Member> members_;
  int role_count_[4] = {0, 0, 0, 0};  // indexed by MemberRole
  int succeeded_count_ = 0;           // members with succeeded == true (all participants)
  LeaseIndex leases_;

  // waiting
  TimePoint round_started_{};
  TimePoint join_deadline_{};
  std::optional<TimePoint> last_call_;
  bool roster_round_ = false;  // follow-up round: closes early once every survivor is back
  std::string last_end_reason_;

  // running
  std::optional<TimePoint> exit_barrier_;
  std::set<int> absent_ranks_;  // after a rebuild: group ranks that have not re-registered
  std::optional<TimePoint> rebuild_deadline_;
  std::optional<Assignment> rebuilt_template_;  // fields every rebuilt rank must agree on

  // done
  std::optional<TimePoint> gc_deadline_;
  std::string result_reason_;
  std::optional<RootCause> root_cause_;
  int result_exit_code_ = 0;
  std::optional<RootCause> last_failure_;
};

// ---- many jobs ----

class RendezvousRegistry {
 public:
  // `token`: when non-empty, every join/rejoin must carry the same token.
  explicit RendezvousRegistry(std::string token = {}) : token_(std::move(token)) {}

  Actions join(const std::string& run_id, const JoinRequest& request, TimePoint now);
  Actions rejoin(const std::string& run_id, const RejoinRequest& request, TimePoint now);
  Actions heartbeat(const std::string& run_id, const NodeId& node, TimePoint now);
  Actions disconnected(const std::string& run_id, const NodeId& node, TimePoint now);
  Actions leave(const std::string& run_id, const NodeId& node, TimePoint now);
  Actions worker_failed(const std::string& run_id, const WorkerFailure& failure, TimePoint now);
  Actions succeeded(const std::string& run_id, const NodeId& node, std::uint64_t round,
                    TimePoint now);
  // Unknown run ids are ignored (nothing to refuse later).
  Actions close(const std::string& run_id, TimePoint now);
  // Runs every job's timers and drops collectable jobs.
  Actions on_tick(TimePoint now);

  std::optional<TimePoint> next_deadline() const;
  RegistryStatus status(TimePoint now) const;
  const RendezvousJob* find(const std::string& run_id) const;
  std::size_t job_count() const { return jobs_.size(); }

 private:
  std::string check_request(const std::string& run_id, const std::string& token,
                            const NodeInfo& node, const JobConfig& config) const;

  std::string token_;
  std::map<std::string, RendezvousJob> jobs_;
};

// "600 s", "2.5 s", "0.25 s": durations in messages.
std::string format_seconds(Duration d);

}  // namespace ddprun::rendezvous
