// RendezvousRegistry: many jobs (rendezvous_registry.hpp has the contract).
#include "ddprun/rendezvous/rendezvous_registry.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

namespace ddprun::rendezvous {
namespace {

// A member that can still act: finished jobs keep their members only to repeat the result.
bool has_live_member(const RendezvousJob& job) { return !job.finished() && job.member_count() > 0; }

}  // namespace

RendezvousRegistry::RendezvousRegistry(std::optional<Duration> job_expiry, std::size_t max_jobs,
                                       std::size_t max_members, std::size_t max_member_bytes)
    : job_expiry_(job_expiry), max_jobs_(max_jobs), max_members_(max_members), max_member_bytes_(max_member_bytes) {}

std::string RendezvousRegistry::check_member_room(const std::string& run_id, Jobs::const_iterator it,
                                                  const NodeInfo& node) const {
  const bool member = it != jobs_.end() && it->second.job.role_of(node.id);
  if (!member && max_members_ != 0 && members_ >= max_members_) {
    return fmt::format(
        "cannot add node {} to rendezvous '{}': the daemon's jobs hold {} members together, its limit "
        "(--max-members); members whose connection is gone are dropped after their heartbeat interval, so retry "
        "later or ask the admin to raise the limit",
        node.id.to_string(), run_id, members_);
  }
  // A member announcing itself again is charged only what it grows by.
  const std::size_t held = member ? it->second.job.footprint_of(node.id) : 0;
  const std::size_t wants = member_footprint(node);
  if (max_member_bytes_ != 0 && wants > held && member_bytes_ + (wants - held) > max_member_bytes_) {
    return fmt::format(
        "cannot add node {} to rendezvous '{}': the daemon's jobs hold {} bytes of members together and this one "
        "needs {} more ({} NCCL unique IDs of 128 bytes), past its limit of {} (--max-member-bytes); "
        "members whose connection is gone are dropped after their heartbeat interval, so retry later, use fewer "
        "--nccl-roots, or ask the admin to raise the limit",
        node.id.to_string(), run_id, member_bytes_, wants - held, node.nccl_ids.size() / 128, max_member_bytes_);
  }
  return {};
}

void RendezvousRegistry::recount(Entry& e) {
  const std::size_t now_members = e.job.member_count();
  members_ = members_ - e.counted_members + now_members;
  e.counted_members = now_members;
  const std::size_t now_bytes = e.job.member_bytes();
  member_bytes_ = member_bytes_ - e.counted_bytes + now_bytes;
  e.counted_bytes = now_bytes;
}

std::string RendezvousRegistry::check_room(const std::string& run_id) const {
  if (max_jobs_ == 0 || jobs_.size() < max_jobs_) return {};
  return fmt::format(
      "cannot start rendezvous '{}': the daemon holds {} jobs, its limit (--max-jobs); jobs without "
      "live members are forgotten after --job-expiry, so retry later or ask the admin to raise the limit",
      run_id, jobs_.size());
}

std::string RendezvousRegistry::check_request(const std::string& run_id, const NodeInfo& node,
                                              const JobConfig& config) const {
  if (run_id.empty()) return "empty rendezvous id: pass --rdzv-id";
  if (run_id.size() > max_run_id_bytes)
    return fmt::format("rendezvous id of {} bytes is longer than {} bytes: pass a shorter --rdzv-id", run_id.size(),
                       max_run_id_bytes);
  const std::pair<const char*, const std::string*> texts[] = {{"id.addr", &node.id.addr},
                                                              {"id.instance", &node.id.instance},
                                                              {"addr", &node.addr},
                                                              {"store_host", &node.store_host}};
  for (const auto& [field, text] : texts) {
    if (text->size() > max_node_text_bytes) {
      return fmt::format("a node of rendezvous '{}' announced a {} of {} bytes, longer than {} bytes", run_id, field,
                         text->size(), max_node_text_bytes);
    }
  }
  if (node.nccl_ids.size() > max_nccl_ids * 128) {
    return fmt::format("node {} offered {} NCCL unique IDs for rendezvous '{}': at most {} (--nccl-roots)",
                       node.id.to_string(), node.nccl_ids.size() / 128, run_id, max_nccl_ids);
  }
  if (node.local_world_size < 1 || node.local_world_size > max_local_world_size) {
    return fmt::format("node {} announced local_world_size {}: --nproc-per-node must be between 1 and {}",
                       node.id.to_string(), node.local_world_size, max_local_world_size);
  }
  if (std::string why = config.validate(); !why.empty())
    return fmt::format("invalid configuration for rendezvous '{}': {}", run_id, why);
  // Every node's local_world_size is at most max_world_size / max_nodes, so no round's world
  // size (their sum) can pass max_world_size.
  if (static_cast<std::int64_t>(node.local_world_size) * config.max_nodes > max_world_size) {
    return fmt::format(
        "node {} announced local_world_size {} for rendezvous '{}' of up to {} nodes: {} ranks would pass the "
        "limit of {} (lower --nproc-per-node or the maximum of --nnodes)",
        node.id.to_string(), node.local_world_size, run_id, config.max_nodes,
        static_cast<std::int64_t>(node.local_world_size) * config.max_nodes, max_world_size);
  }
  return {};
}

Decisions RendezvousRegistry::join(const std::string& run_id, const JoinRequest& request, TimePoint now) {
  if (std::string why = check_request(run_id, request.node, request.config); !why.empty()) {
    return {Refuse{run_id, request.node.id, why, RefuseCode::invalid_request}};
  }
  auto it = jobs_.find(run_id);
  if (std::string why = check_member_room(run_id, it, request.node); !why.empty()) {
    return {Refuse{run_id, request.node.id, why, RefuseCode::other}};
  }
  if (it == jobs_.end()) {
    if (std::string why = check_room(run_id); !why.empty()) {
      return {Refuse{run_id, request.node.id, why, RefuseCode::other}};
    }
    it = add_job(run_id, RendezvousJob(run_id, request.config, now), now);
  }
  return touched(it, it->second.job.join(request.node, request.config, now), now);
}

Decisions RendezvousRegistry::rejoin(const std::string& run_id, const RejoinRequest& request, TimePoint now) {
  if (std::string why = check_request(run_id, request.node, request.config); !why.empty()) {
    return {Refuse{run_id, request.node.id, why, RefuseCode::invalid_request}};
  }
  auto it = jobs_.find(run_id);
  if (std::string why = check_member_room(run_id, it, request.node); !why.empty()) {
    return {Refuse{run_id, request.node.id, why, RefuseCode::other}};
  }
  const bool rebuild_over = it != jobs_.end() && request.assignment && it->second.job.awaiting_rebuild(now);
  if (it != jobs_.end() && !rebuild_over) return touched(it, it->second.job.rejoin(request, now), now);
  if (it == jobs_.end()) {
    if (std::string why = check_room(run_id); !why.empty()) {
      return {Refuse{run_id, request.node.id, why, RefuseCode::other}};
    }
    if (!request.assignment) {
      it = add_job(run_id, RendezvousJob(run_id, request.config, now), now);
      it->second.job.hold_for_rebuild(now);
      return touched(it, it->second.job.join(request.node, request.config, now), now);
    }
  }
  const Assignment& a = *request.assignment;
  if (a.group_world_size < 1 || a.group_world_size > request.config.max_nodes || a.group_rank < 0 ||
      a.group_rank >= a.group_world_size || a.restart_count < 0 || a.restart_count > max_restarts_limit ||
      a.local_world_size != request.node.local_world_size || a.rank_offset < 0 || a.world_size < 1 ||
      a.rank_offset > a.world_size - a.local_world_size ||
      static_cast<std::int64_t>(a.world_size) > static_cast<std::int64_t>(a.group_world_size) * max_local_world_size ||
      a.master_addr.size() > max_node_text_bytes || a.nccl_id.size() > max_nccl_ids * 128 ||
      a.nccl_id.size() % 128 != 0) {
    return {Refuse{run_id, request.node.id,
                   fmt::format("rejoin for rendezvous '{}' carries an inconsistent assignment "
                               "(group rank {} of {} with max_nodes {}, restart count {}, local world size {} "
                               "at rank offset {} of world size {}, a master address of {} bytes (at most {}), "
                               "{} bytes of NCCL unique IDs (128 each, at most {}))",
                               run_id, a.group_rank, a.group_world_size, request.config.max_nodes, a.restart_count,
                               a.local_world_size, a.rank_offset, a.world_size, a.master_addr.size(),
                               max_node_text_bytes, a.nccl_id.size(), max_nccl_ids),
                   RefuseCode::inconsistent_rejoin}};
  }
  // The rebuilt round's NCCL IDs (kept as bytes and as hex) are charged as members' bytes are,
  // with what the node adds (its own offer is spent at once; a member is charged its growth).
  const std::size_t round_bytes = 3 * a.nccl_id.size();
  const std::size_t node_bytes = member_footprint(request.node) - request.node.nccl_ids.size();
  const std::size_t held = it != jobs_.end() ? it->second.job.footprint_of(request.node.id) : 0;
  const std::size_t wants = (node_bytes > held ? node_bytes - held : 0) + round_bytes;
  if (max_member_bytes_ != 0 && member_bytes_ + wants > max_member_bytes_) {
    return {Refuse{run_id, request.node.id,
                   fmt::format("cannot rebuild rendezvous '{}' from node {}: the daemon's jobs hold {} bytes of "
                               "members together and its round needs {} more, past its limit of {} "
                               "(--max-member-bytes); retry later or ask the admin to raise the limit",
                               run_id, request.node.id.to_string(), member_bytes_, wants, max_member_bytes_),
                   RefuseCode::other}};
  }
  Decisions out;
  if (!rebuild_over) {
    it = add_job(run_id, RendezvousJob::rebuild(run_id, request, now, out), now);
    return touched(it, std::move(out), now);
  }
  // The daemon restarted and nodes without an assignment (spares, the wait list) re-registered
  // before any participant, making a fresh job: the running round is rebuilt from this
  // participant, and they join it again (as spares while it is full), with the config they came with.
  if (std::string why = it->second.job.config_mismatch(request.config); !why.empty()) {
    return {Refuse{run_id, request.node.id, why, RefuseCode::config_mismatch}};
  }
  const JobConfig waiting_config = it->second.job.config();
  const std::vector<NodeInfo> waiting = it->second.job.member_infos();
  RendezvousJob rebuilt = RendezvousJob::rebuild(run_id, request, now, out);
  for (const NodeInfo& node : waiting) {
    if (node.id == request.node.id) continue;
    Decisions d = rebuilt.join(node, waiting_config, now);
    out.insert(out.end(), std::make_move_iterator(d.begin()), std::make_move_iterator(d.end()));
    // Not a fresh lease for a node whose connection had closed meanwhile.
    if (const auto carried = it->second.job.carried_of(node.id)) rebuilt.carry(node.id, *carried);
  }
  it->second.job = std::move(rebuilt);
  return touched(it, std::move(out), now);
}

Decisions RendezvousRegistry::heartbeat(const std::string& run_id, const NodeId& node, TimePoint now) {
  auto it = jobs_.find(run_id);
  if (it == jobs_.end()) {
    return {AskRejoin{run_id, node,
                      fmt::format("rendezvous '{}' is not known to this daemon (restarted?); "
                                  "send rejoin with the current assignment",
                                  run_id)}};
  }
  return touched(it, it->second.job.heartbeat(node, now), now);
}

Decisions RendezvousRegistry::disconnected(const std::string& run_id, const NodeId& node, TimePoint now) {
  auto it = jobs_.find(run_id);
  return it == jobs_.end() ? Decisions{} : touched(it, it->second.job.disconnected(node, now), now);
}

Decisions RendezvousRegistry::leave(const std::string& run_id, const NodeId& node, TimePoint now) {
  auto it = jobs_.find(run_id);
  return it == jobs_.end() ? Decisions{} : touched(it, it->second.job.leave(node, now), now);
}

Decisions RendezvousRegistry::worker_failed(const std::string& run_id, const WorkerFailure& failure, TimePoint now) {
  auto it = jobs_.find(run_id);
  return it == jobs_.end() ? Decisions{} : touched(it, it->second.job.worker_failed(failure, now), now);
}

Decisions RendezvousRegistry::succeeded(const std::string& run_id, const NodeId& node, std::uint64_t round,
                                        TimePoint now) {
  auto it = jobs_.find(run_id);
  return it == jobs_.end() ? Decisions{} : touched(it, it->second.job.succeeded(node, round, now), now);
}

Decisions RendezvousRegistry::close(const std::string& run_id, TimePoint now) {
  auto it = jobs_.find(run_id);
  return it == jobs_.end() ? Decisions{} : touched(it, it->second.job.close(now), now);
}

Decisions RendezvousRegistry::abort_all(const std::string& reason, int exit_code, TimePoint now) {
  Decisions out;
  for (auto it = jobs_.begin(); it != jobs_.end(); ++it) {
    Decisions d = touched(it, it->second.job.abort(reason, exit_code, now), now);
    out.insert(out.end(), std::make_move_iterator(d.begin()), std::make_move_iterator(d.end()));
  }
  return out;
}

RendezvousRegistry::Jobs::iterator RendezvousRegistry::add_job(const std::string& run_id, RendezvousJob job,
                                                               TimePoint now) {
  auto it = jobs_.try_emplace(run_id, Entry{std::move(job), std::nullopt, std::nullopt}).first;
  it->second.memberless_since = now;  // until its first member is in (touched() follows)
  return it;
}

Decisions RendezvousRegistry::touched(Jobs::iterator it, Decisions out, TimePoint now) {
  Entry& e = it->second;
  recount(e);
  if (has_live_member(e.job)) {
    e.memberless_since.reset();
  } else if (!e.memberless_since) {
    e.memberless_since = now;
  }
  reindex(it, now);
  return out;
}

std::optional<TimePoint> RendezvousRegistry::due_of(const Entry& e) const {
  std::optional<TimePoint> due = e.job.next_deadline();
  if (job_expiry_ && e.memberless_since) {
    const TimePoint expiry = *e.memberless_since + *job_expiry_;
    if (!due || expiry < *due) due = expiry;
  }
  return due;
}

void RendezvousRegistry::reindex(Jobs::iterator it, TimePoint now) {
  (void)now;
  Entry& e = it->second;
  if (e.due_it) {
    due_.erase(*e.due_it);
    e.due_it.reset();
  }
  if (const auto due = due_of(e)) e.due_it = due_.emplace(*due, &it->first);
}

bool RendezvousRegistry::expired(const Entry& e, TimePoint now) const {
  return job_expiry_ && e.memberless_since && now >= *e.memberless_since + *job_expiry_;
}

Decisions RendezvousRegistry::on_tick(TimePoint now, std::vector<std::string>* dropped) {
  Decisions out;
  // Only the jobs that are due, each once (in run-id order, as the full scan used to go).
  std::vector<Jobs::iterator> due;
  for (auto d = due_.begin(); d != due_.end() && d->first <= now; ++d) due.push_back(jobs_.find(*d->second));
  std::sort(due.begin(), due.end(), [](const auto& a, const auto& b) { return a->first < b->first; });
  for (auto it : due) {
    Entry& e = it->second;
    Decisions job_actions = e.job.on_tick(now);
    recount(e);
    out.insert(out.end(), std::make_move_iterator(job_actions.begin()), std::make_move_iterator(job_actions.end()));
    if (has_live_member(e.job)) {
      e.memberless_since.reset();
    } else if (!e.memberless_since) {
      e.memberless_since = now;
    }
    if (e.job.collectable(now) || expired(e, now)) {
      if (e.due_it) due_.erase(*e.due_it);
      if (dropped != nullptr) dropped->push_back(it->first);
      members_ -= e.counted_members;
      member_bytes_ -= e.counted_bytes;
      jobs_.erase(it);
    } else {
      reindex(it, now);
    }
  }
  return out;
}

std::optional<TimePoint> RendezvousRegistry::next_deadline() const {
  if (due_.empty()) return std::nullopt;
  return due_.begin()->first;
}

RegistryStatus RendezvousRegistry::status(TimePoint now) const {
  RegistryStatus s;
  for (const auto& [id, e] : jobs_) s.jobs.push_back(e.job.status(now));
  return s;
}

void RendezvousRegistry::for_each_job(const std::function<void(const RendezvousJob&)>& f) const {
  for (const auto& [id, e] : jobs_) f(e.job);
}

std::optional<JobStatus> RendezvousRegistry::status_of(const std::string& run_id, TimePoint now) const {
  auto it = jobs_.find(run_id);
  if (it == jobs_.end()) return std::nullopt;
  return it->second.job.status(now);
}

const RendezvousJob* RendezvousRegistry::find(const std::string& run_id) const {
  auto it = jobs_.find(run_id);
  return it == jobs_.end() ? nullptr : &it->second.job;
}

std::string RendezvousRegistry::audit() const {
  std::size_t indexed = 0;
  std::size_t members = 0;
  std::size_t bytes = 0;
  for (const auto& [id, e] : jobs_) {
    members += e.job.member_count();
    bytes += e.job.member_bytes();
    const auto due = due_of(e);
    if (due.has_value() != e.due_it.has_value()) {
      return fmt::format("job '{}': {} a deadline but {} in the index", id, due ? "has" : "has no",
                         e.due_it ? "is" : "is not");
    }
    if (has_live_member(e.job) == e.memberless_since.has_value()) {
      return fmt::format("job '{}': memberless_since disagrees with its members", id);
    }
    if (!due) continue;
    ++indexed;
    if ((*e.due_it)->first != *due || (*e.due_it)->second != &id) {
      return fmt::format("job '{}': its index entry is stale", id);
    }
  }
  if (indexed != due_.size())
    return fmt::format("{} jobs have a deadline but the index holds {}", indexed, due_.size());
  if (members != members_ || bytes != member_bytes_)
    return fmt::format("the jobs hold {} members of {} bytes, counted as {} of {}", members, bytes, members_,
                       member_bytes_);
  return {};
}

}  // namespace ddprun::rendezvous
