#pragma once
// RendezvousJob: the decisions for one elastic job: pure state, events in, decisions out.
//
// A RendezvousJob holds the membership of one job (one --rdzv-id): its rounds, the join,
// last-call and exit-barrier deadlines, the heartbeat lease of every node and the job-wide
// restart budget (RendezvousRegistry in rendezvous_registry.hpp holds many of them). Every
// event method takes the current time as an argument and returns the
// messages the server must push (a std::vector<Decision>); nothing here does I/O, reads a clock,
// sleeps or spawns threads. The server arms ONE timer at next_deadline() and calls
// on_tick(now) when it fires; nothing polls.
//
// Cost: join, rejoin, heartbeat, disconnect, leave, success, next_deadline() and a tick that
// expires k leases are O(log N + k) for a job of N nodes (role and success counters and a lease
// index ordered by deadline are kept incrementally; audit() checks them against a scan). Closing
// or ending a round, failing/completing the job and status() are O(N): once per round.
//
// Not thread-safe: owned by the single io_context thread of the daemon (or embedded agent).
// Requests arrive from the network, so bad requests never throw: they produce a Refuse decision
// naming what was wrong and what to do.
//
// Job states and transitions ("J" = nodes that joined the collecting round, "E" = nodes of
// the previous round not yet re-joined, "P" = participants of the running round):
//
//   state     event                                    -> next state, decisions
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
// Rank offsets are prefix sums of local_world_size in group-rank order.
//
// NCCL offers: every assignment of a round carries one node's NodeInfo::nccl_ids as
// Assignment::nccl_id (one buffer shared by all of them), so all ranks get the same NCCL unique
// IDs, and new ones each round (docs/gpus.md). An offer of one ID (or an NCCL_COMM_ID block) is
// kept for every member. An offer of more — one ID per 256 ranks of the largest world the job
// allows, so it grows with the job — is kept only for the kOfferKeepers members guessed likeliest
// to get group rank 0 (previous rank 0, then new nodes by order key and join order, then the
// highest previous ranks; close_round's stable ranks cannot be known before the close); the
// others' are dropped at their join, so a job holds O(N + kOfferKeepers x offer) bytes, not
// O(N x offer). The round uses the group-rank-0 node's offer; where the job dropped it (the guess
// missed, or keepers left: a dropped offer is not restored), the first kept offer of more than one
// ID in rank order from a node with NodeInfo::nccl_any_rank, and none when there is no such
// offer. Participants' offers are dropped when the round closes (their holders are spent).
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "ddprun/common/clock.hpp"
#include "ddprun/rendezvous/rendezvous_types.hpp"

namespace ddprun::rendezvous {

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
  static RendezvousJob rebuild(std::string run_id, const RejoinRequest& request, TimePoint now, Decisions& out);

  const std::string& run_id() const { return run_id_; }
  const JobConfig& config() const { return config_; }
  JobState state() const { return state_; }
  std::uint64_t round() const { return round_; }
  int restarts_used() const { return restarts_used_; }
  bool closed() const { return closed_; }
  bool finished() const { return state_ == JobState::completed || state_ == JobState::failed; }
  // A job made afresh by a REJOIN without an assignment (the daemon restarted, and a node that had
  // none, a spare or one on the wait list, re-registered first): for rebuild_grace no round
  // closes, so that the nodes of a running round can re-register; the first with an assignment
  // makes the registry rebuild the running round and let the others join it (awaiting_rebuild).
  // The join window starts after the hold, so a join_timeout shorter than rebuild_grace does not
  // end the job at the hold's end.
  void hold_for_rebuild(TimePoint now) {
    hold_until_ = now + config_.rebuild_grace;
    join_deadline_ = *hold_until_ + config_.join_timeout;
  }
  bool awaiting_rebuild(TimePoint now) const {
    return hold_until_ && now < *hold_until_ && state_ == JobState::waiting && round_ == 0;
  }
  // Why `requested` cannot join this job (empty when it can).
  std::string config_mismatch(const JobConfig& requested) const;
  // The members' node infos, in join order.
  std::vector<NodeInfo> member_infos() const;
  // What a member carries into a rebuilt job besides its info: its lease's end, whether its
  // connection had closed, and whether the job had dropped its NCCL ID offer.
  struct Carried {
    TimePoint lease_deadline{};
    bool disconnected = false;
    bool offer_dropped = false;
  };
  std::optional<Carried> carried_of(const NodeId& node) const;
  // Gives a member (just joined again) what it carried: the earlier of the two leases, the closed
  // connection and the dropped offer (when its info came without one).
  void carry(const NodeId& node, const Carried& carried);

  // Events. `requested` is the joiner's config (checked against the job's).
  Decisions join(const NodeInfo& node, const JobConfig& requested, TimePoint now);
  Decisions rejoin(const RejoinRequest& request, TimePoint now);
  Decisions heartbeat(const NodeId& node, TimePoint now);
  // The node's connection closed: its lease shrinks to now + heartbeat_interval; a heartbeat or
  // rejoin before then restores it.
  Decisions disconnected(const NodeId& node, TimePoint now);
  Decisions leave(const NodeId& node, TimePoint now);
  Decisions worker_failed(const WorkerFailure& failure, TimePoint now);
  Decisions succeeded(const NodeId& node, std::uint64_t round, TimePoint now);
  Decisions close(TimePoint now);
  // Ends an unfinished job as failed with `reason` (the agent hosting an embedded rendezvous
  // stops: nobody can go on without it). Finished jobs keep their result.
  Decisions abort(const std::string& reason, int exit_code, TimePoint now);
  Decisions on_tick(TimePoint now);

  // Earliest time on_tick has something to do; nullopt when nothing is pending.
  std::optional<TimePoint> next_deadline() const;
  // True once the registry may forget the job (finished, or closed and empty, for close_timeout).
  bool collectable(TimePoint now) const;

  JobStatus status(TimePoint now) const;
  std::string progress_text(TimePoint now) const;
  // Nodes waiting in the collecting round (the targets of a broadcast Progress).
  std::vector<NodeId> joined_nodes() const;
  // The role of `node`, nullopt when it is not a member: O(log N).
  std::optional<MemberRole> role_of(const NodeId& node) const;
  // Members of any role (a finished job keeps them to answer their final result).
  std::size_t member_count() const { return members_.size(); }
  // Sum of member_footprint() over the members, plus the round's NCCL IDs (held_bytes()): O(1), kept
  // incrementally.
  std::size_t member_bytes() const { return member_bytes_; }
  // How many members' NCCL offers of more than one ID the job keeps at most ("NCCL offers").
  static constexpr std::size_t kOfferKeepers = 8;
  // member_footprint() of `node` as it is held now; 0 when it is not a member: O(log N).
  std::size_t footprint_of(const NodeId& node) const;
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
  // The members whose offer of more than one ID is kept, best candidate for group rank 0 first:
  // (previous rank 0 / new / previous rank > 0, minus the previous rank, no order key, order
  // key, join sequence) -> the member.
  using OfferKey = std::tuple<int, std::int64_t, int, std::int64_t, std::uint64_t>;
  using OfferKeepers = std::set<std::pair<OfferKey, const NodeId*>>;

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
    LeaseIndex::iterator lease_it{};               // this member's entry in leases_ (always valid)
    std::optional<OfferKeepers::iterator> keeper;  // its entry in offer_keepers_, if kept there
    bool offer_dropped = false;                    // the job dropped the offer its join made
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
  // The only writers of Member::info: they keep member_bytes_ and offer_keepers_ in step.
  // set_info() replaces the info (dropping its place among the keepers); place_offer() then
  // keeps or drops the new offer, by the member's current previous rank; drop_offer() frees it.
  void set_info(Member& m, const NodeInfo& info);
  void place_offer(std::map<NodeId, Member>::iterator it);
  void drop_offer(Member& m);
  void release_keeper(Member& m);  // its entry in offer_keepers_ erased, if it has one
  void set_round_ids(SharedBytes ids);
  Decisions final_result_for(const NodeId& node, TimePoint now) const;
  // Progress for `origin` (when it waits in the collecting round) plus one broadcast for the
  // other waiting nodes.
  void send_progress(Decisions& out, TimePoint now, const NodeId* origin = nullptr) const;

  // Spares become joined members, in join order, while fewer than `room` slots are taken:
  // room = max - joined - expected while collecting, max - joined as the round closes.
  void promote_spares(int room);
  // The slots taken (waiting: joined + expected; running: participants, the wait list and the
  // absent ranks of a rebuilt round), against which max nodes is counted.
  int taking_part() const;
  // What a spare is told: why it waits and for what.
  std::string spare_text() const;
  void evaluate_waiting(Decisions& out, TimePoint now);
  void close_round(Decisions& out);
  void end_round(Decisions& out, RoundEnd kind, const std::string& reason, TimePoint now);
  void fail_job(Decisions& out, const std::string& reason, std::optional<RootCause> cause, int exit_code,
                TimePoint now);
  void complete_job(Decisions& out, TimePoint now);
  void remove_members(Decisions& out, const std::vector<NodeId>& ids, const std::string& reason, TimePoint now);
  void mark_gc_if_empty(TimePoint now);
  void check_completion(Decisions& out, TimePoint now);

  std::string run_id_;
  JobConfig config_;
  JobState state_ = JobState::waiting;
  bool closed_ = false;
  std::uint64_t round_ = 0;
  int restarts_used_ = 0;
  std::uint64_t next_join_seq_ = 0;
  std::map<NodeId, Member> members_;
  std::size_t member_bytes_ = 0;       // member_footprint() of every member's info + round_ids_
  OfferKeepers offer_keepers_;         // at most kOfferKeepers
  SharedBytes round_ids_;              // the running round's NCCL IDs (every assignment shares them)
  int role_count_[kMemberRoles] = {};  // indexed by MemberRole
  int succeeded_count_ = 0;            // members with succeeded == true (all participants)
  LeaseIndex leases_;

  // waiting
  std::optional<TimePoint> hold_until_;  // hold_for_rebuild(): no round closes before
  // Spares waiting while fewer than min nodes are back: after last_call_timeout of the round the
  // slots of expected nodes that have not re-joined (alive but slow, or hung) go to them.
  std::optional<TimePoint> spare_deadline() const;
  TimePoint join_deadline_{};
  std::optional<TimePoint> last_call_;
  bool roster_round_ = false;  // follow-up round: closes early once every survivor is back
  std::string last_end_reason_;

  // running
  std::optional<TimePoint> exit_barrier_;
  // After a rebuild (rebuilt_template_ set): the group ranks that re-registered, the rebuilder's
  // included; the others of [0, group_world_size) are absent. Kept as the ranks that came back,
  // not the ones missing: a REJOIN claiming a world of 2^20 nodes must not cost 2^20 entries.
  std::set<int> returned_ranks_;
  int absent_count() const;
  bool is_absent(int group_rank) const;
  std::string absent_list() const;  // "3, 5, 9" (the first 32, then "and N more")
  std::optional<TimePoint> rebuild_deadline_;
  std::optional<Assignment> rebuilt_template_;  // fields every rebuilt rank must agree on

  // done
  std::optional<TimePoint> gc_deadline_;
  std::string result_reason_;
  std::optional<RootCause> root_cause_;
  int result_exit_code_ = 0;
  std::optional<RootCause> last_failure_;
};

}  // namespace ddprun::rendezvous
