// RendezvousJob events and round transitions (rendezvous_job.hpp has the contract and the
// transition table).
#include "ddprun/rendezvous/rendezvous_job.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "ddprun/common/strings.hpp"
#include "rendezvous_job_detail.hpp"

namespace ddprun::rendezvous {

using detail::nnodes;
using detail::node_label;
using detail::until;

RendezvousJob::RendezvousJob(std::string run_id, JobConfig config, TimePoint now)
    : run_id_(std::move(run_id)), config_(config), join_deadline_(now + config.join_timeout) {}

RendezvousJob RendezvousJob::rebuild(std::string run_id, const RejoinRequest& request, TimePoint now, Decisions& out) {
  const Assignment& a = *request.assignment;
  RendezvousJob job(std::move(run_id), request.config, now);
  job.state_ = JobState::running;
  job.round_ = a.round;
  job.restarts_used_ = a.restart_count;
  Member& m = job.add_member(request.node, MemberRole::participant, now);
  m.group_rank = a.group_rank;
  job.drop_offer(m);  // a participant of a running round: its offer is spent
  job.set_round_ids(SharedBytes::with_hex(a.nccl_id.bytes()));
  m.assignment = a;
  m.assignment->nccl_id = job.round_ids_;
  job.rebuilt_template_ = m.assignment;
  job.returned_ranks_.insert(a.group_rank);
  if (job.absent_count() > 0) job.rebuild_deadline_ = now + job.config_.rebuild_grace;
  out.push_back(Progress{job.run_id_, request.node.id,
                         fmt::format("re-registered with rendezvous '{}' in round {} "
                                     "(rebuilt after a daemon restart)",
                                     job.run_id_, a.round)});
  return job;
}

int RendezvousJob::absent_count() const {
  return rebuilt_template_ ? rebuilt_template_->group_world_size - static_cast<int>(returned_ranks_.size()) : 0;
}

bool RendezvousJob::is_absent(int group_rank) const {
  return rebuilt_template_ && group_rank >= 0 && group_rank < rebuilt_template_->group_world_size &&
         returned_ranks_.count(group_rank) == 0;
}

std::string RendezvousJob::absent_list() const {
  constexpr int kListed = 32;
  std::string out;
  int listed = 0;
  const int total = absent_count();
  for (int r = 0; rebuilt_template_ && r < rebuilt_template_->group_world_size && listed < kListed; ++r) {
    if (returned_ranks_.count(r) != 0) continue;
    out += (out.empty() ? "" : ", ") + std::to_string(r);
    ++listed;
  }
  if (total > listed) out += fmt::format(" and {} more", total - listed);
  return out;
}

RendezvousJob::Member* RendezvousJob::find(const NodeId& id) {
  auto it = members_.find(id);
  return it == members_.end() ? nullptr : &it->second;
}

std::size_t RendezvousJob::footprint_of(const NodeId& node) const {
  const auto it = members_.find(node);
  return it == members_.end() ? 0 : member_footprint(it->second.info);
}

RendezvousJob::Member& RendezvousJob::add_member(const NodeInfo& info, MemberRole role, TimePoint now) {
  if (auto old = members_.find(info.id); old != members_.end()) erase_member(old);
  const auto it = members_.try_emplace(info.id).first;
  Member& m = it->second;
  member_bytes_ += member_footprint(m.info);  // set_info() takes the empty info's share back
  set_info(m, info);
  m.role = role;
  ++role_count_[static_cast<int>(role)];
  m.join_seq = next_join_seq_++;
  m.last_heartbeat = now;
  m.lease_deadline = now + config_.lease();
  // Leases are mostly granted in time order: the end is the right hint (amortized O(1)).
  m.lease_it = leases_.emplace_hint(leases_.end(), m.lease_deadline, &it->first);
  place_offer(it);
  // A closed job that had emptied (collected at gc_deadline_) has a member again: an absent rank of
  // a rebuilt round re-registering. It lives on; it is collected once empty again (or finished).
  if (!finished()) gc_deadline_.reset();
  return m;
}

void RendezvousJob::erase_member(std::map<NodeId, Member>::iterator it) {
  Member& m = it->second;
  release_keeper(m);
  member_bytes_ -= member_footprint(m.info);
  --role_count_[static_cast<int>(m.role)];
  if (m.succeeded) --succeeded_count_;
  leases_.erase(m.lease_it);
  members_.erase(it);
}

void RendezvousJob::refresh(Member& m, TimePoint now) {
  m.last_heartbeat = now;
  set_lease(m, now + config_.lease());
  m.disconnected = false;
}

void RendezvousJob::set_role(Member& m, MemberRole role) {
  --role_count_[static_cast<int>(m.role)];
  ++role_count_[static_cast<int>(role)];
  m.role = role;
}

void RendezvousJob::set_succeeded(Member& m, bool succeeded) {
  if (m.succeeded == succeeded) return;
  succeeded_count_ += succeeded ? 1 : -1;
  m.succeeded = succeeded;
}

void RendezvousJob::release_keeper(Member& m) {
  if (!m.keeper) return;
  offer_keepers_.erase(*m.keeper);
  m.keeper.reset();
}

void RendezvousJob::set_info(Member& m, const NodeInfo& info) {
  release_keeper(m);
  member_bytes_ = member_bytes_ - member_footprint(m.info) + member_footprint(info);
  m.info = info;
  m.offer_dropped = false;
}

void RendezvousJob::place_offer(std::map<NodeId, Member>::iterator it) {
  Member& m = it->second;
  release_keeper(m);
  if (m.info.nccl_ids.size() <= detail::kOneOfferBytes) return;  // none, one ID or an address: always kept
  // A guess at who close_round() gives group rank 0 (its stable ranks depend on the group size,
  // known only at the close): the previous rank 0 keeps it; then new nodes by order key and join
  // order; then previous ranks, the highest first (the likeliest to be past the new group size and
  // moved). A miss costs only the bootstrap root's place (the fallback in close_round).
  const int cls = m.prev_rank == 0 ? 0 : m.prev_rank ? 2 : 1;
  const OfferKey key{cls, m.prev_rank ? -static_cast<std::int64_t>(*m.prev_rank) : 0, m.info.order ? 0 : 1,
                     m.info.order.value_or(0), m.join_seq};
  if (offer_keepers_.size() >= kOfferKeepers) {
    const auto worst = std::prev(offer_keepers_.end());
    if (!(key < worst->first)) {
      drop_offer(m);
      return;
    }
    drop_offer(members_.find(*worst->second)->second);  // erases `worst`
  }
  m.keeper = offer_keepers_.emplace(key, &it->first).first;
}

void RendezvousJob::drop_offer(Member& m) {
  release_keeper(m);
  if (m.info.nccl_ids.empty()) return;
  member_bytes_ -= m.info.nccl_ids.size();
  std::vector<std::uint8_t>().swap(m.info.nccl_ids);
  m.offer_dropped = true;
}

std::optional<RendezvousJob::Carried> RendezvousJob::carried_of(const NodeId& node) const {
  const auto it = members_.find(node);
  if (it == members_.end()) return std::nullopt;
  return Carried{it->second.lease_deadline, it->second.disconnected, it->second.offer_dropped};
}

void RendezvousJob::carry(const NodeId& node, const Carried& carried) {
  Member* m = find(node);
  if (m == nullptr) return;
  set_lease(*m, std::min(m->lease_deadline, carried.lease_deadline));
  m->disconnected = m->disconnected || carried.disconnected;
  if (carried.offer_dropped && m->info.nccl_ids.empty()) m->offer_dropped = true;
}

void RendezvousJob::set_round_ids(SharedBytes ids) {
  member_bytes_ = member_bytes_ - round_ids_.held_bytes() + ids.held_bytes();
  round_ids_ = std::move(ids);
}

void RendezvousJob::set_lease(Member& m, TimePoint deadline) {
  if (deadline == m.lease_deadline) return;
  const NodeId* key = m.lease_it->second;
  leases_.erase(m.lease_it);
  m.lease_deadline = deadline;
  m.lease_it = leases_.emplace_hint(leases_.end(), deadline, key);
}

std::string RendezvousJob::config_mismatch(const JobConfig& requested) const {
  std::string diffs;
  auto add = [&diffs](const std::string& text) { diffs += diffs.empty() ? text : "; " + text; };
  if (requested.min_nodes != config_.min_nodes || requested.max_nodes != config_.max_nodes) {
    add(fmt::format("--nnodes: the job has {}, this node asked for {}", nnodes(config_.min_nodes, config_.max_nodes),
                    nnodes(requested.min_nodes, requested.max_nodes)));
  }
  if (requested.max_restarts != config_.max_restarts) {
    add(fmt::format("--max-restarts: the job has {}, this node asked for {}", config_.max_restarts,
                    requested.max_restarts));
  }
  if (diffs.empty()) return {};
  return fmt::format(
      "configuration mismatch for rendezvous '{}': {} (start every node with the "
      "same values)",
      run_id_, diffs);
}

Decisions RendezvousJob::final_result_for(const NodeId& node, TimePoint now) const {
  if (state_ == JobState::completed) {
    if (members_.count(node) != 0) return {SendJobCompleted{run_id_, node}};
    return {Refuse{run_id_, node,
                   fmt::format("rendezvous '{}' already completed; its id can be reused in {} "
                               "(close_timeout) or pick a new --rdzv-id",
                               run_id_, format_seconds(gc_deadline_ ? until(*gc_deadline_, now) : Duration::zero())),
                   RefuseCode::job_finished}};
  }
  if (members_.count(node) != 0) return {SendJobFailed{run_id_, node, result_reason_, root_cause_, result_exit_code_}};
  return {Refuse{
      run_id_, node,
      fmt::format("rendezvous '{}' already failed ({}); pick a new --rdzv-id or retry "
                  "in {}",
                  run_id_, result_reason_, format_seconds(gc_deadline_ ? until(*gc_deadline_, now) : Duration::zero())),
      RefuseCode::job_finished}};
}

void RendezvousJob::promote_spares(int room) {
  if (room <= 0 || count(MemberRole::spare) == 0) return;
  std::vector<Member*> spares;
  for (auto& [id, m] : members_) {
    if (m.role == MemberRole::spare) spares.push_back(&m);
  }
  std::sort(spares.begin(), spares.end(), [](const Member* a, const Member* b) { return a->join_seq < b->join_seq; });
  for (std::size_t i = 0; i < spares.size() && static_cast<int>(i) < room; ++i)
    set_role(*spares[i], MemberRole::joined);
}

std::string RendezvousJob::spare_text() const {
  return fmt::format(
      "waiting as a spare node: rendezvous '{}' is full ({} of max {} nodes take part); this node takes the place "
      "of a lost one in the next round that has room",
      run_id_, taking_part(), config_.max_nodes);
}

int RendezvousJob::taking_part() const {
  // Running: the ranks of a rebuilt round that have not re-registered yet keep their slots.
  return state_ == JobState::waiting ? count(MemberRole::joined) + count(MemberRole::expected)
                                     : count(MemberRole::participant) + count(MemberRole::joined) + absent_count();
}

std::optional<TimePoint> RendezvousJob::spare_deadline() const {
  if (state_ != JobState::waiting || count(MemberRole::spare) == 0 || count(MemberRole::expected) == 0 ||
      count(MemberRole::joined) >= config_.min_nodes) {
    return std::nullopt;
  }
  // The round's start + last call, and no later than the join deadline (which would fail the job).
  return std::min(join_deadline_ - config_.join_timeout + config_.last_call_timeout, join_deadline_);
}

void RendezvousJob::evaluate_waiting(Decisions& out, TimePoint now) {
  if (state_ != JobState::waiting) return;
  promote_spares(config_.max_nodes - count(MemberRole::joined) - count(MemberRole::expected));
  if (hold_until_) {
    if (now < *hold_until_) return;  // the nodes of a running round may still re-register
    hold_until_.reset();
  }
  if (const auto d = spare_deadline(); d && now >= *d) promote_spares(config_.max_nodes - count(MemberRole::joined));
  const int joined = count(MemberRole::joined);
  const int expected = count(MemberRole::expected);
  if (joined >= config_.max_nodes) {
    close_round(out);
  } else if (joined >= config_.min_nodes) {
    if (roster_round_ && expected == 0) {
      close_round(out);
      return;
    }
    if (!last_call_) last_call_ = now + config_.last_call_timeout;
    if (now >= *last_call_) close_round(out);
  } else {
    last_call_.reset();
    if (now >= join_deadline_) {
      std::string reason =
          fmt::format("rendezvous '{}' timed out after {} waiting for nodes: {}/{} joined (min {})", run_id_,
                      format_seconds(config_.join_timeout), joined, config_.min_nodes, config_.min_nodes);
      if (!last_end_reason_.empty()) reason += "; the last round ended because " + last_end_reason_;
      fail_job(out, reason, std::nullopt, kRendezvousFailureExitCode, now);
    }
  }
}

void RendezvousJob::close_round(Decisions& out) {
  // The expected nodes that did not come back are about to be late: spares take their slots.
  promote_spares(config_.max_nodes - count(MemberRole::joined));
  std::vector<Member*> roster;
  for (auto& [id, m] : members_) {
    if (m.role == MemberRole::joined) roster.push_back(&m);
  }
  const int n = static_cast<int>(roster.size());
  // Join order, except that nodes with an order key (NodeInfo::order) come first, by key.
  std::sort(roster.begin(), roster.end(), [](const Member* a, const Member* b) {
    if (a->info.order.has_value() != b->info.order.has_value()) return a->info.order.has_value();
    if (a->info.order && *a->info.order != *b->info.order) return *a->info.order < *b->info.order;
    return a->join_seq < b->join_seq;
  });
  // Stable ranks: keep the previous rank when it still fits and is free, then fill the gaps in
  // join order.
  std::vector<Member*> by_rank(static_cast<std::size_t>(n), nullptr);
  std::vector<Member*> unplaced;
  for (Member* m : roster) {
    if (m->prev_rank && *m->prev_rank >= 0 && *m->prev_rank < n &&
        by_rank[static_cast<std::size_t>(*m->prev_rank)] == nullptr) {
      by_rank[static_cast<std::size_t>(*m->prev_rank)] = m;
    } else {
      unplaced.push_back(m);
    }
  }
  auto next = unplaced.begin();
  for (auto& slot : by_rank) {
    if (slot == nullptr) slot = *next++;
  }

  Member& master = *by_rank.front();
  const std::string master_addr = master.info.store_host.empty() ? master.info.addr : master.info.store_host;
  int world_size = 0;
  for (const Member* m : by_rank) world_size += m->info.local_world_size;
  // The group-rank-0 node's NCCL offer, or where the job dropped it the first kept offer of the
  // same kind (more than one ID) in rank order from a node that keeps its holder at any group
  // rank ("NCCL offers" in rendezvous_job.hpp).
  const Member* ids_from = &master;
  if (master.offer_dropped) {
    ids_from = nullptr;
    for (const Member* m : by_rank) {
      if (m->info.nccl_ids.size() > detail::kOneOfferBytes && m->info.nccl_any_rank) {
        ids_from = m;
        break;
      }
    }
  }
  set_round_ids(ids_from != nullptr ? SharedBytes::with_hex(ids_from->info.nccl_ids) : SharedBytes());

  state_ = JobState::running;
  last_call_.reset();
  exit_barrier_.reset();
  int offset = 0;
  for (int rank = 0; rank < n; ++rank) {
    Member& m = *by_rank[static_cast<std::size_t>(rank)];
    set_role(m, MemberRole::participant);
    m.group_rank = rank;
    set_succeeded(m, false);
    Assignment a;
    a.round = round_;
    a.group_rank = rank;
    a.group_world_size = n;
    a.local_world_size = m.info.local_world_size;
    a.rank_offset = offset;
    a.world_size = world_size;
    a.master_addr = master_addr;
    a.master_port = master.info.store_port;
    a.restart_count = restarts_used_;
    a.max_restarts = config_.max_restarts;
    a.nccl_id = round_ids_;
    offset += m.info.local_world_size;
    m.assignment = a;
    out.push_back(SendAssignment{run_id_, m.info.id, a});
  }
  // The participants' offers are spent: their holders stop when the assignments arrive, all but
  // the one whose IDs the round uses, which round_ids_ holds.
  for (Member* m : by_rank) drop_offer(*m);
  // Survivors that did not make it back in time: their next join is a scale-up.
  // Their old rank belongs to an older round now, so it no longer claims a slot.
  for (auto& [id, m] : members_) {
    if (m.role == MemberRole::expected) {
      set_role(m, MemberRole::late);
      m.prev_rank.reset();
    }
  }
}

void RendezvousJob::end_round(Decisions& out, RoundEnd kind, const std::string& reason, TimePoint now) {
  const std::uint64_t ended = round_;
  ++round_;
  state_ = JobState::waiting;
  join_deadline_ = now + config_.join_timeout;
  last_call_.reset();
  exit_barrier_.reset();
  returned_ranks_.clear();
  rebuild_deadline_.reset();
  rebuilt_template_.reset();
  roster_round_ = true;
  last_end_reason_ = reason;
  set_round_ids({});
  for (auto& [id, m] : members_) {
    if (m.role == MemberRole::participant) {
      m.prev_rank = m.group_rank;
      m.group_rank = -1;
      set_succeeded(m, false);
      m.assignment.reset();
      set_role(m, MemberRole::expected);
      out.push_back(SendRestart{run_id_, id, ended, kind, restarts_used_, reason});
    } else if (m.role == MemberRole::late) {
      // Already told to restart when its own round ended; it is on its way back.
      set_role(m, MemberRole::expected);
    }
  }
  evaluate_waiting(out, now);
  send_progress(out, now);
}

void RendezvousJob::fail_job(Decisions& out, const std::string& reason, std::optional<RootCause> cause, int exit_code,
                             TimePoint now) {
  state_ = JobState::failed;
  result_reason_ = reason;
  root_cause_ = std::move(cause);
  if (root_cause_) {
    std::string& message = root_cause_->failure.message;
    if (const std::size_t kept = utf8_prefix(message, broadcast_failure_message_bytes).size(); kept < message.size()) {
      const std::size_t cut = message.size() - kept;
      message.resize(kept);
      message +=
          fmt::format(" [... {} more bytes, in the failure summary on node {}]", cut,
                      root_cause_->node_addr.empty() ? root_cause_->failure.node.to_string() : root_cause_->node_addr);
    }
  }
  result_exit_code_ = exit_code;
  gc_deadline_ = now + config_.close_timeout;
  last_call_.reset();
  exit_barrier_.reset();
  rebuild_deadline_.reset();
  for (const auto& [id, m] : members_) {
    out.push_back(SendJobFailed{run_id_, id, reason, root_cause_, exit_code});
  }
}

void RendezvousJob::complete_job(Decisions& out, TimePoint now) {
  state_ = JobState::completed;
  result_exit_code_ = 0;
  gc_deadline_ = now + config_.close_timeout;
  exit_barrier_.reset();
  rebuild_deadline_.reset();
  for (const auto& [id, m] : members_) out.push_back(SendJobCompleted{run_id_, id});
}

void RendezvousJob::check_completion(Decisions& out, TimePoint now) {
  if (state_ != JobState::running || !exit_barrier_ || absent_count() > 0) return;
  // Only participants ever succeed (set_succeeded), so this is "every participant succeeded".
  if (succeeded_count_ < count(MemberRole::participant)) return;
  complete_job(out, now);
}

void RendezvousJob::mark_gc_if_empty(TimePoint now) {
  if (closed_ && members_.empty() && !gc_deadline_) gc_deadline_ = now + config_.close_timeout;
}

void RendezvousJob::remove_members(Decisions& out, const std::vector<NodeId>& ids, const std::string& reason,
                                   TimePoint now) {
  bool running_participant_lost = false;
  for (const NodeId& id : ids) {
    auto it = members_.find(id);
    if (it == members_.end()) continue;
    // A participant that already succeeded has done its part: losing it ends nothing.
    if (it->second.role == MemberRole::participant && !it->second.succeeded) running_participant_lost = true;
    erase_member(it);
  }
  mark_gc_if_empty(now);
  if (state_ == JobState::waiting) {
    evaluate_waiting(out, now);
    send_progress(out, now);
  } else if (state_ == JobState::running) {
    if (running_participant_lost) {
      const int remaining = count(MemberRole::participant) + count(MemberRole::joined);
      std::string text = reason;
      if (remaining < config_.min_nodes) {
        text += fmt::format("; {} nodes remain (min {}), waiting up to {} for replacements", remaining,
                            config_.min_nodes, format_seconds(config_.join_timeout));
      }
      end_round(out, RoundEnd::membership_change, text, now);
    } else {
      check_completion(out, now);
    }
  }
}

Decisions RendezvousJob::join(const NodeInfo& node, const JobConfig& requested, TimePoint now) {
  if (finished()) return final_result_for(node.id, now);
  Decisions out;
  if (std::string why = config_mismatch(requested); !why.empty()) {
    out.push_back(Refuse{run_id_, node.id, why, RefuseCode::config_mismatch});
    return out;
  }
  Member* m = find(node.id);
  if (m == nullptr && closed_) {
    out.push_back(Refuse{run_id_, node.id,
                         fmt::format("rendezvous '{}' is closed: it accepts no new nodes "
                                     "(pick a new --rdzv-id)",
                                     run_id_),
                         RefuseCode::job_closed});
    return out;
  }
  int capacity_used = taking_part();
  // A new node while spares wait for a slot that is free (a participant that had succeeded is
  // gone): the spares that waited longest take it before this node is placed.
  int promoted = 0;
  if (m == nullptr && state_ == JobState::running && capacity_used < config_.max_nodes &&
      count(MemberRole::spare) > 0) {
    const int joined_before = count(MemberRole::joined);
    promote_spares(config_.max_nodes - capacity_used);
    promoted = count(MemberRole::joined) - joined_before;
    capacity_used = taking_part();
  }
  // A node beyond max waits as a spare (torch's redundancy list), up to max spares.
  const bool spare_room = count(MemberRole::spare) < config_.max_nodes;
  auto refuse_full = [&] {
    out.push_back(
        Refuse{run_id_, node.id,
               fmt::format("rendezvous '{}' is full: {} of max {} nodes are taking part and {} spare "
                           "nodes wait (at most {}; raise the maximum of --nnodes)",
                           run_id_, capacity_used, config_.max_nodes, count(MemberRole::spare), config_.max_nodes),
               RefuseCode::job_full});
  };
  if (m != nullptr) {
    set_info(*m, node);
    // A participant's previous rank is its rank in the running round (below), and the rank its
    // new offer is ranked by.
    if (state_ == JobState::running && m->role == MemberRole::participant) m->prev_rank = m->group_rank;
    place_offer(members_.find(node.id));
    refresh(*m, now);
    if (m->role == MemberRole::spare) {
      evaluate_waiting(out, now);  // promotes it when a slot is free
      if (m->role == MemberRole::spare) {
        out.push_back(Progress{run_id_, node.id, spare_text()});
      } else {
        send_progress(out, now, &node.id);
      }
      return out;
    }
    if (state_ == JobState::waiting) {
      if (m->role == MemberRole::expected) set_role(*m, MemberRole::joined);
      evaluate_waiting(out, now);
      send_progress(out, now, &node.id);
    } else if (m->role == MemberRole::participant) {
      // The node wants a new round (its agent restarted its group): a membership change.
      m->prev_rank = m->group_rank;
      m->group_rank = -1;
      set_succeeded(*m, false);
      m->assignment.reset();
      set_role(*m, MemberRole::joined);
      end_round(out, RoundEnd::membership_change,
                fmt::format("node {} re-joined while round {} was running", node_label(node), round_), now);
    } else if (m->role == MemberRole::late) {
      if (capacity_used >= config_.max_nodes) {
        if (spare_room) {
          set_role(*m, MemberRole::spare);
          m->join_seq = next_join_seq_++;       // spares are promoted in the order they became spares
          place_offer(members_.find(node.id));  // its offer's place follows the new join order
          out.push_back(Progress{run_id_, node.id, spare_text()});
        } else {
          refuse_full();
          erase_member(members_.find(node.id));
        }
        return out;
      }
      set_role(*m, MemberRole::joined);
      end_round(out, RoundEnd::membership_change, fmt::format("node {} joined late", node_label(node)), now);
    }
    // joined while running: already on the wait list, nothing changes.
    return out;
  }
  if (capacity_used >= config_.max_nodes) {
    if (spare_room) {
      add_member(node, MemberRole::spare, now);
      out.push_back(Progress{run_id_, node.id, spare_text()});
    } else {
      refuse_full();
    }
    if (promoted > 0) {
      end_round(out, RoundEnd::membership_change,
                fmt::format("{} spare node(s) took the free slots as node {} joined", promoted, node_label(node)), now);
    }
    return out;
  }
  add_member(node, MemberRole::joined, now);
  if (state_ == JobState::waiting) {
    evaluate_waiting(out, now);
    send_progress(out, now, &node.id);
  } else {
    end_round(out, RoundEnd::membership_change, fmt::format("new node {} joined", node_label(node)), now);
  }
  return out;
}

Decisions RendezvousJob::rejoin(const RejoinRequest& request, TimePoint now) {
  const NodeId& id = request.node.id;
  if (finished()) return final_result_for(id, now);
  if (std::string why = config_mismatch(request.config); !why.empty()) {
    return {Refuse{run_id_, id, why, RefuseCode::config_mismatch}};
  }
  const std::optional<Assignment>& a = request.assignment;
  auto restart_stale = [&](std::uint64_t old_round) -> Decisions {
    return {SendRestart{run_id_, id, old_round, RoundEnd::membership_change, restarts_used_,
                        fmt::format("round {} of rendezvous '{}' is over (now at round {}); "
                                    "stop the workers and join again",
                                    old_round, run_id_, round_)}};
  };
  Member* m = find(id);
  if (m != nullptr) {
    refresh(*m, now);
    if (state_ == JobState::running && m->role == MemberRole::participant) {
      if (a && a->round == round_) {
        return {Progress{run_id_, id, fmt::format("re-registered with rendezvous '{}' in round {}", run_id_, round_)}};
      }
      return {SendAssignment{run_id_, id, *m->assignment}};  // it missed the push
    }
    if (a && a->round < round_ && (m->role == MemberRole::expected || m->role == MemberRole::late)) {
      return restart_stale(a->round);  // it missed the SendRestart
    }
    if (m->role == MemberRole::joined) {
      Decisions out;
      send_progress(out, now, &id);
      if (std::none_of(out.begin(), out.end(), [&](const Decision& x) {
            const auto* p = std::get_if<Progress>(&x);
            return p != nullptr && p->node == id;
          })) {
        out.push_back(Progress{run_id_, id, "on the wait list of the running round"});
      }
      return out;
    }
    return join(request.node, request.config, now);
  }
  if (!a) return join(request.node, request.config, now);
  if (state_ == JobState::running && a->round == round_ && rebuilt_template_ && is_absent(a->group_rank) &&
      a->group_world_size == rebuilt_template_->group_world_size && a->world_size == rebuilt_template_->world_size &&
      a->restart_count == rebuilt_template_->restart_count && a->master_addr == rebuilt_template_->master_addr &&
      a->master_port == rebuilt_template_->master_port && a->nccl_id == rebuilt_template_->nccl_id) {
    Member& added = add_member(request.node, MemberRole::participant, now);
    added.group_rank = a->group_rank;
    drop_offer(added);
    added.assignment = *a;
    added.assignment->nccl_id = round_ids_;  // equal to the template's: share its buffer
    returned_ranks_.insert(a->group_rank);
    if (absent_count() == 0) rebuild_deadline_.reset();
    return {Progress{run_id_, id,
                     fmt::format("re-registered with rendezvous '{}' in round {} (rebuilt after "
                                 "a daemon restart)",
                                 run_id_, round_)}};
  }
  return restart_stale(a->round);
}

Decisions RendezvousJob::heartbeat(const NodeId& node, TimePoint now) {
  if (finished()) return final_result_for(node, now);
  Member* m = find(node);
  if (m == nullptr) {
    return {AskRejoin{run_id_, node,
                      fmt::format("node {} is not a member of rendezvous '{}' (its lease expired "
                                  "or the daemon restarted); send rejoin",
                                  node.to_string(), run_id_)}};
  }
  refresh(*m, now);
  return {};
}

Decisions RendezvousJob::disconnected(const NodeId& node, TimePoint now) {
  Member* m = find(node);
  if (m == nullptr || finished()) return {};
  set_lease(*m, std::min(m->lease_deadline, now + config_.heartbeat_interval));
  m->disconnected = true;
  return {};
}

Decisions RendezvousJob::leave(const NodeId& node, TimePoint now) {
  if (finished()) return {};
  Decisions out;
  Member* m = find(node);
  if (m == nullptr) return out;
  remove_members(out, {node}, fmt::format("node {} left", node_label(m->info)), now);
  return out;
}

Decisions RendezvousJob::worker_failed(const WorkerFailure& failure, TimePoint now) {
  Decisions out;
  if (state_ != JobState::running || failure.round != round_) return out;  // stale
  Member* m = find(failure.node);
  if (m == nullptr || m->role != MemberRole::participant) return out;
  RootCause cause{failure, m->info.addr, m->group_rank};
  last_failure_ = cause;
  refresh(*m, now);
  if (restarts_used_ < config_.max_restarts) {
    ++restarts_used_;
    end_round(out, RoundEnd::worker_failure,
              fmt::format("{} (restart {}/{})", cause.describe(), restarts_used_, config_.max_restarts), now);
  } else {
    const std::string reason = fmt::format("{}; the restart budget is spent ({}/{} restarts used)", cause.describe(),
                                           restarts_used_, config_.max_restarts);
    fail_job(out, reason, cause, failure.ddprun_exit_code(), now);
  }
  return out;
}

Decisions RendezvousJob::succeeded(const NodeId& node, std::uint64_t round, TimePoint now) {
  Decisions out;
  if (finished()) return final_result_for(node, now);
  if (state_ != JobState::running || round != round_) return out;  // stale
  Member* m = find(node);
  if (m == nullptr || m->role != MemberRole::participant) return out;
  refresh(*m, now);
  set_succeeded(*m, true);
  if (!exit_barrier_) exit_barrier_ = now + config_.exit_barrier_timeout;
  check_completion(out, now);
  if (state_ == JobState::running) out.push_back(Progress{run_id_, node, progress_text(now)});
  return out;
}

Decisions RendezvousJob::abort(const std::string& reason, int exit_code, TimePoint now) {
  Decisions out;
  if (!finished()) fail_job(out, reason, std::nullopt, exit_code, now);
  return out;
}

Decisions RendezvousJob::close(TimePoint now) {
  closed_ = true;
  mark_gc_if_empty(now);
  return {};
}

Decisions RendezvousJob::on_tick(TimePoint now) {
  Decisions out;
  if (finished()) return out;
  // Expired leases come first in the index; report them in node order, as a scan would.
  std::vector<const NodeId*> expired;
  for (auto it = leases_.begin(); it != leases_.end() && it->first <= now; ++it) expired.push_back(it->second);
  std::sort(expired.begin(), expired.end(), [](const NodeId* a, const NodeId* b) { return *a < *b; });
  std::vector<NodeId> lost;
  std::string reason;
  // The reason goes to every survivor: name a few lost nodes, count the rest (a relay that dies
  // under a 100,000-node job loses 16,000 in one tick; listing them all sent each survivor
  // megabytes).
  constexpr std::size_t kNamed = 8;
  for (const NodeId* id : expired) {
    const Member& m = members_.find(*id)->second;
    lost.push_back(*id);
    if (lost.size() > kNamed) continue;
    const std::string why = m.disconnected
                                ? fmt::format("node {} lost: connection closed and not re-registered within {}",
                                              node_label(m.info), format_seconds(config_.heartbeat_interval))
                                : fmt::format("node {} lost: no heartbeat for {}", node_label(m.info),
                                              format_seconds(now - m.last_heartbeat));
    reason += reason.empty() ? why : "; " + why;
  }
  if (lost.size() > kNamed) reason += fmt::format("; and {} more node(s) lost", lost.size() - kNamed);
  if (!lost.empty()) remove_members(out, lost, reason, now);
  if (state_ == JobState::running && rebuild_deadline_ && now >= *rebuild_deadline_ && absent_count() > 0) {
    const std::string ranks = absent_list();
    end_round(out, RoundEnd::membership_change,
              fmt::format("group ranks {} of round {} did not re-register within {} after the "
                          "daemon restarted",
                          ranks, round_, format_seconds(config_.rebuild_grace)),
              now);
  }
  if (state_ == JobState::running && exit_barrier_ && now >= *exit_barrier_) {
    int done = 0;
    int unnamed = 0;
    std::string pending;
    for (const auto& [id, m] : members_) {
      if (m.role != MemberRole::participant) continue;
      if (m.succeeded) {
        ++done;
      } else if (pending.size() < 2048) {  // the message goes to every node: a few, then a count
        pending += fmt::format("{}group rank {} on {}", pending.empty() ? "" : ", ", m.group_rank, m.info.addr);
      } else {
        ++unnamed;
      }
    }
    if (unnamed > 0) pending += fmt::format(" and {} more", unnamed);
    if (absent_count() > 0) {
      pending += fmt::format("{}group ranks {} (not re-registered)", pending.empty() ? "" : ", ", absent_list());
    }
    const int total = count(MemberRole::participant) + absent_count();
    fail_job(out,
             fmt::format("rendezvous '{}': exit barrier timed out after {}: {}/{} nodes "
                         "finished; still running: {}",
                         run_id_, format_seconds(config_.exit_barrier_timeout), done, total, pending),
             std::nullopt, kRendezvousFailureExitCode, now);
  }
  evaluate_waiting(out, now);
  return out;
}

}  // namespace ddprun::rendezvous
