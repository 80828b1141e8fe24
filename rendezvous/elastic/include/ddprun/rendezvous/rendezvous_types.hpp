#pragma once
// The plain data of the elastic rendezvous: who a node is (NodeId, NodeInfo), the job's
// configuration, what a node receives (Assignment), worker failures, the decisions the pure
// state returns for the server to push (Decision: SendAssignment ... Progress) and the status
// snapshot behind `ddprun status`. Value types only: no I/O, no clock, no behaviour beyond
// validation and formatting. The decisions themselves live in rendezvous_job.hpp and
// rendezvous_registry.hpp.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "ddprun/common/clock.hpp"

namespace ddprun::rendezvous {

// Exit code every agent uses when the job fails for a rendezvous reason (timeout, barrier)
// rather than a worker's own exit status.
inline constexpr int kRendezvousFailureExitCode = 1;

// An immutable byte buffer whose copies share one allocation. A round's NCCL unique IDs go into
// every node's assignment, and their size grows with the job (one ID per 256 ranks): a copy per
// node would make the daemon's memory quadratic in the job's size. with_hex() also keeps the
// bytes' hex text, so that the N assignment frames of a round encode them once, not N times.
class SharedBytes {
 public:
  SharedBytes() = default;
  SharedBytes(std::vector<std::uint8_t> bytes)  // NOLINT(google-explicit-constructor): a value type
      : SharedBytes(std::move(bytes), std::string()) {}
  static SharedBytes with_hex(std::vector<std::uint8_t> bytes);  // hex computed now, once

  const std::vector<std::uint8_t>& bytes() const { return block_ ? block_->bytes : empty_bytes(); }
  operator const std::vector<std::uint8_t>&() const { return bytes(); }  // NOLINT(google-explicit-constructor)
  bool empty() const { return bytes().empty(); }
  std::size_t size() const { return bytes().size(); }
  auto begin() const { return bytes().begin(); }
  auto end() const { return bytes().end(); }
  // The lower-case hex of the bytes when with_hex() made them, else nullptr.
  const std::string* hex() const { return block_ && !block_->hex.empty() ? &block_->hex : nullptr; }
  // What the buffer holds: the bytes and their hex.
  std::size_t held_bytes() const { return block_ ? block_->bytes.size() + block_->hex.size() : 0; }

  friend bool operator==(const SharedBytes& a, const SharedBytes& b) {
    return a.block_ == b.block_ || a.bytes() == b.bytes();
  }
  friend bool operator==(const SharedBytes& a, const std::vector<std::uint8_t>& b) { return a.bytes() == b; }

 private:
  struct Block {
    std::vector<std::uint8_t> bytes;
    std::string hex;
  };
  SharedBytes(std::vector<std::uint8_t> bytes, std::string hex)
      : block_(bytes.empty() ? nullptr : std::make_shared<const Block>(Block{std::move(bytes), std::move(hex)})) {}
  static const std::vector<std::uint8_t>& empty_bytes() {
    static const std::vector<std::uint8_t> none;
    return none;
  }
  std::shared_ptr<const Block> block_;
};

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
  std::string addr;              // advertised address (messages, status; fallback for store_host)
  int local_world_size = 1;      // nproc on this node; may differ between nodes
  std::string store_host;        // the worker store this agent already bound: MASTER_ADDR if the
  std::uint16_t store_port = 0;  // node gets group rank 0 (empty host -> addr)
  // NCCL unique IDs (K x 128 bytes, or empty) created by this node's holder for the round it
  // joins. When the round closes, every Assignment::nccl_id is the group-rank-0 node's, or
  // another node's where the job did not keep that offer (RendezvousJob, "NCCL offers").
  std::vector<std::uint8_t> nccl_ids;
  // This agent keeps its holder whenever the round's IDs are its own offer, whatever its group
  // rank. Only such a node's offer can stand in for the group-rank-0 node's: an older agent
  // stops its holder unless it has group rank 0. Absent on the wire = false.
  bool nccl_any_rank = false;
  // Where this node wants to be in the group-rank order (a fan-out launcher passes each host's
  // position in its host list, so ranks follow the hostfile). Nodes with a key get the first
  // free ranks in key order; nodes without one (independent agents: the c10d default) follow in
  // join order. Absent on the wire = none.
  std::optional<std::int64_t> order;
};

// What one member costs the daemon, as counted against --max-member-bytes: a fixed share for
// its bookkeeping (the map node, lease index entry, assignment, ~1 KiB measured at 100,000
// agents), the texts it announced, and the NCCL IDs it offered, as far as the job keeps them
// (RendezvousJob, "NCCL offers"). A job also counts its round's IDs once, with their hex
// (RendezvousJob::member_bytes).
inline constexpr std::size_t member_bookkeeping_bytes = 1024;
inline std::size_t member_footprint(const NodeInfo& n) {
  return member_bookkeeping_bytes + n.id.addr.size() + n.id.instance.size() + n.addr.size() + n.store_host.size() +
         n.nccl_ids.size();
}

// The bounds every number from the network or a command line is checked against (a node
// count times a node's processes must fit a rank in an int: a node's local_world_size times
// the job's max_nodes is checked against max_world_size; a heartbeat faster than
// min_heartbeat_interval is a typo that would turn into a restart storm).
inline constexpr int max_nodes_limit = 1 << 20;  // 1,048,576 agents (docs/daemon.md, "Limits")
inline constexpr std::size_t max_run_id_bytes = 256;
// A node's names (NodeId::addr and ::instance, NodeInfo::addr and ::store_host: host names,
// addresses, labels) and its NCCL IDs (--nccl-roots is at most 4096): what a member can make
// the daemon hold is bounded by these, not by the 1 MiB frame.
inline constexpr std::size_t max_node_text_bytes = 1024;
inline constexpr std::size_t max_nccl_ids = 4096;
// A WORKER_FAILED's message (the rank's error-file message): the job keeps it as its root cause
// and repeats it to every node, so what arrives past this is cut (at a UTF-8 boundary).
inline constexpr std::size_t max_failure_message_bytes = 8192;
// What of it JOB_FAILED's root cause carries to every node (the node where the rank failed
// prints its own whole copy): 8 KiB to each of 100,000 nodes was 800 MB of pushes at once.
inline constexpr std::size_t broadcast_failure_message_bytes = 1024;
inline constexpr int max_local_world_size = 16384;
inline constexpr std::int64_t max_world_size = std::int64_t{1} << 30;  // ranks
inline constexpr int max_restarts_limit = 1000000;
inline constexpr Duration min_heartbeat_interval = std::chrono::milliseconds(10);
inline constexpr Duration max_heartbeat_interval = std::chrono::hours(1);
inline constexpr Duration max_timeout = std::chrono::hours(24 * 30);
// heartbeat_interval * missed_heartbeats (the etcd replicas use a 50-year lease on purpose);
// keeps TimePoint arithmetic far from overflow.
inline constexpr Duration max_lease = std::chrono::hours(24 * 365 * 100);

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
  // The round's NCCL IDs: the group-rank-0 node's NodeInfo::nccl_ids, or another node's where the
  // rendezvous did not keep that offer (rendezvous_job.hpp, "NCCL offers"); may be empty.
  SharedBytes nccl_id;

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
  // "rank 5 (local rank 1 on node 10.0.0.2) exited with code 3: msg", the message cut at
  // `max_message` bytes (the text goes to every node of the job).
  std::string describe(std::size_t max_message = 512) const;
};

struct JoinRequest {
  NodeInfo node;
  JobConfig config;
};

// Sent by an agent after it (re)connects: carries the assignment it is running with, if any,
// so a restarted daemon can rebuild the running round.
struct RejoinRequest {
  NodeInfo node;
  JobConfig config;
  // The per-node secret the server issued in JOINED (hex); proves that the connection speaks
  // for this node. "" when the node never got one (the daemon then issues a new one).
  std::string node_secret;
  std::optional<Assignment> assignment;
};

// ---- decisions (plain data; every one names its job and node) ----

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

// Why a request was refused, as a bounded code: the metrics count refusals by it, while
// Refuse::reason keeps the text users see. Its own order is the order of the labels the
// metrics endpoint lists (docs/daemon.md); `other` stays last.
enum class RefuseCode : std::uint8_t {
  auth,                 // handshake failed or missing, or the connection is bound to another job
  not_owner,            // the connection does not speak for that node
  invalid_request,      // bad run id, local_world_size or configuration
  config_mismatch,      // the configuration differs from the job's
  job_finished,         // the job already completed or failed
  job_closed,           // the job accepts no new nodes
  job_full,             // max nodes are taking part
  inconsistent_rejoin,  // a rejoin's assignment cannot be true
  other,                // anything else (the daemon's --max-jobs limit)
};
inline constexpr std::size_t kRefuseCodes = static_cast<std::size_t>(RefuseCode::other) + 1;

// The metrics label of `code`: "auth", "not_owner", ... "other".
std::string_view refuse_code_label(RefuseCode code);

// Not on the wire: a client decodes a Refuse with code `other`; only the daemon counts codes.
struct Refuse {
  std::string run_id;
  NodeId node;
  std::string reason;
  RefuseCode code = RefuseCode::other;
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

using Decision =
    std::variant<SendAssignment, SendRestart, SendJobFailed, SendJobCompleted, Refuse, AskRejoin, Progress>;
using Decisions = std::vector<Decision>;

// ---- status (for `ddprun status`) ----

enum class JobState { waiting, running, completed, failed };
const char* to_string(JobState state);

enum class MemberRole {
  joined,       // joined the collecting round (while running: the wait list)
  expected,     // took part in the previous round, not re-joined yet
  participant,  // has a group rank in the running round
  late,         // was expected when the round closed without it; its next join is a scale-up
  spare,        // joined a full job (max nodes taking part): takes the place of a lost node in
                // the next round that has room, in join order
};
inline constexpr int kMemberRoles = 5;
const char* to_string(MemberRole role);

struct MemberStatus;
struct JobStatus;
// What `ddprun status` shows: to_string of the enum, or the name a newer daemon sent.
std::string role_label(const MemberStatus& member);
std::string state_label(const JobStatus& job);

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
  // The role as a daemon newer than this build named it, where it is none of the above (then
  // `role` is only the default); empty otherwise. `ddprun status` shows this name.
  std::string role_name;
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
  std::string progress;                   // one line, e.g. the waiting text
  std::string result;                     // final reason when failed; "" otherwise
  std::optional<RootCause> last_failure;  // most recent worker failure (any round)
  std::string state_name;                 // as role_name: a state this build does not know, by its name
};

struct RegistryStatus {
  std::vector<JobStatus> jobs;  // by run id
};

// "600 s", "2.5 s", "0.25 s": durations in messages.
std::string format_seconds(Duration d);

}  // namespace ddprun::rendezvous
