// RendezvousJob queries: deadlines, status snapshots, progress text and the index audit.
#include "ddprun/rendezvous/rendezvous_job.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "rendezvous_job_detail.hpp"

namespace ddprun::rendezvous {

using detail::nnodes;
using detail::node_label;
using detail::until;

std::string RendezvousJob::audit() const {
  int roles[kMemberRoles] = {};
  int succeeded = 0;
  std::size_t bytes = 0;
  std::string diffs;
  auto add = [&diffs](const std::string& text) { diffs += diffs.empty() ? text : "; " + text; };
  for (const auto& [id, m] : members_) {
    ++roles[static_cast<int>(m.role)];
    succeeded += m.succeeded ? 1 : 0;
    bytes += member_footprint(m.info);
    // Sizes equal and every member owning a distinct matching entry: a bijection.
    if (m.lease_it->second != &id || m.lease_it->first != m.lease_deadline) {
      add(fmt::format("lease index entry of {} does not match its lease", id.to_string()));
    }
  }
  for (int r = 0; r < kMemberRoles; ++r) {
    if (roles[r] != role_count_[r]) {
      add(fmt::format("{} count {} != {} members", to_string(static_cast<MemberRole>(r)), role_count_[r], roles[r]));
    }
  }
  if (succeeded != succeeded_count_) add(fmt::format("succeeded count {} != {} members", succeeded_count_, succeeded));
  bytes += round_ids_.held_bytes();
  std::size_t kept = 0;
  for (const auto& [id, m] : members_) {
    if (!m.keeper) continue;
    ++kept;
    if ((*m.keeper)->second != &id || m.info.nccl_ids.size() <= detail::kOneOfferBytes) {
      add(fmt::format("offer keeper entry of {} does not match its offer", id.to_string()));
    }
  }
  if (kept != offer_keepers_.size() || kept > kOfferKeepers)
    add(fmt::format("offer keepers hold {} entries for {} kept offers (at most {})", offer_keepers_.size(), kept,
                    kOfferKeepers));
  if (bytes != member_bytes_) add(fmt::format("member bytes {} != {} summed over the members", member_bytes_, bytes));
  if (leases_.size() != members_.size())
    add(fmt::format("lease index holds {} entries for {} members", leases_.size(), members_.size()));
  return diffs;
}

std::string RendezvousJob::progress_text(TimePoint now) const {
  switch (state_) {
    case JobState::waiting: {
      const int joined = count(MemberRole::joined);
      const int expected = count(MemberRole::expected);
      const int target = std::max(config_.min_nodes, joined + expected);
      std::string text = fmt::format("waiting for nodes: {}/{} joined (min {}, max {})", joined, target,
                                     config_.min_nodes, config_.max_nodes);
      if (hold_until_ && now < *hold_until_) {
        text += ", the nodes of a running round may re-register (daemon restart) for " +
                format_seconds(until(*hold_until_, now));
      }
      if (joined >= config_.min_nodes && last_call_) {
        text += ", last call in " + format_seconds(until(*last_call_, now));
      } else {
        text += ", join timeout in " + format_seconds(until(join_deadline_, now));
      }
      return text;
    }
    case JobState::running: {
      const int participants = count(MemberRole::participant);
      if (exit_barrier_) {
        return fmt::format("exit barrier: {}/{} nodes finished, timeout in {}", succeeded_count_,
                           participants + absent_count(), format_seconds(until(*exit_barrier_, now)));
      }
      return fmt::format("running round {} with {} nodes (restarts {}/{})", round_, participants, restarts_used_,
                         config_.max_restarts);
    }
    case JobState::completed:
      return "completed";
    case JobState::failed:
      return "failed: " + result_reason_;
  }
  return {};
}

void RendezvousJob::send_progress(Decisions& out, TimePoint now, const NodeId* origin) const {
  if (state_ != JobState::waiting) return;
  const std::string text = progress_text(now);
  int others = count(MemberRole::joined);
  if (origin != nullptr) {
    auto it = members_.find(*origin);
    if (it != members_.end() && it->second.role == MemberRole::joined) {
      out.push_back(Progress{run_id_, it->first, text});
      --others;
    }
  }
  if (others > 0) out.push_back(Progress{run_id_, NodeId{}, text, /*broadcast=*/true});
}

std::vector<NodeInfo> RendezvousJob::member_infos() const {
  std::vector<const Member*> by_join;
  by_join.reserve(members_.size());
  for (const auto& [id, m] : members_) by_join.push_back(&m);
  std::sort(by_join.begin(), by_join.end(), [](const Member* a, const Member* b) { return a->join_seq < b->join_seq; });
  std::vector<NodeInfo> out;
  out.reserve(by_join.size());
  for (const Member* m : by_join) out.push_back(m->info);
  return out;
}

std::optional<MemberRole> RendezvousJob::role_of(const NodeId& node) const {
  auto it = members_.find(node);
  if (it == members_.end()) return std::nullopt;
  return it->second.role;
}

std::vector<NodeId> RendezvousJob::joined_nodes() const {
  std::vector<NodeId> out;
  for (const auto& [id, m] : members_) {
    if (m.role == MemberRole::joined) out.push_back(id);
  }
  return out;
}

std::optional<TimePoint> RendezvousJob::next_deadline() const {
  std::optional<TimePoint> best;
  auto consider = [&best](std::optional<TimePoint> t) {
    if (t && (!best || *t < *best)) best = t;
  };
  // Only when it can be acted on (collectable()): a deadline in the past that is not would make
  // the server's timer fire again at once, for ever.
  if (finished() || members_.empty()) consider(gc_deadline_);
  if (finished()) return best;
  if (!leases_.empty()) consider(leases_.begin()->first);
  if (state_ == JobState::waiting && hold_until_) {
    consider(hold_until_);  // nothing else is acted on before it (evaluate_waiting)
  } else if (state_ == JobState::waiting) {
    consider(spare_deadline());
    if (count(MemberRole::joined) >= config_.min_nodes) {
      consider(last_call_);
    } else {
      consider(join_deadline_);
    }
  } else {
    consider(exit_barrier_);
    if (absent_count() > 0) consider(rebuild_deadline_);
  }
  return best;
}

bool RendezvousJob::collectable(TimePoint now) const {
  return gc_deadline_ && now >= *gc_deadline_ && (finished() || members_.empty());
}

JobStatus RendezvousJob::status(TimePoint now) const {
  JobStatus s;
  s.run_id = run_id_;
  s.state = state_;
  s.closed = closed_;
  s.round = round_;
  s.min_nodes = config_.min_nodes;
  s.max_nodes = config_.max_nodes;
  s.restarts_used = restarts_used_;
  s.max_restarts = config_.max_restarts;
  std::vector<const Member*> ordered;
  for (const auto& [id, m] : members_) ordered.push_back(&m);
  std::sort(ordered.begin(), ordered.end(), [](const Member* a, const Member* b) {
    const bool ra = a->group_rank >= 0;
    const bool rb = b->group_rank >= 0;
    if (ra != rb) return ra;
    if (ra) return a->group_rank < b->group_rank;
    return a->join_seq < b->join_seq;
  });
  for (const Member* m : ordered) {
    MemberStatus ms;
    ms.id = m->info.id;
    ms.addr = m->info.addr;
    ms.local_world_size = m->info.local_world_size;
    ms.role = m->role;
    ms.group_rank = m->group_rank;
    ms.succeeded = m->succeeded;
    ms.disconnected = m->disconnected;
    ms.last_heartbeat_age = now > m->last_heartbeat ? now - m->last_heartbeat : Duration::zero();
    ms.lease_left = until(m->lease_deadline, now);
    s.members.push_back(ms);
  }
  if (state_ == JobState::waiting) {
    if (count(MemberRole::joined) >= config_.min_nodes && last_call_) {
      s.last_call_in = until(*last_call_, now);
    } else {
      s.join_timeout_in = until(join_deadline_, now);
    }
  }
  if (state_ == JobState::running) {
    if (exit_barrier_) s.exit_barrier_in = until(*exit_barrier_, now);
    if (rebuild_deadline_ && absent_count() > 0) s.rebuild_in = until(*rebuild_deadline_, now);
  }
  if (gc_deadline_) s.gc_in = until(*gc_deadline_, now);
  s.progress = progress_text(now);
  s.result = state_ == JobState::failed ? result_reason_ : std::string{};
  s.last_failure = last_failure_;
  return s;
}

}  // namespace ddprun::rendezvous
