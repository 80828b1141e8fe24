// RendezvousRegistry: many jobs (rendezvous_registry.hpp has the contract).
#include "ddprun/rendezvous/rendezvous_registry.hpp"

#include <fmt/format.h>

#include <utility>

namespace ddprun::rendezvous {

std::string RendezvousRegistry::check_request(const std::string& run_id, const NodeInfo& node,
                                              const JobConfig& config) const {
  if (run_id.empty()) return "empty rendezvous id: pass --rdzv-id";
  if (run_id.size() > max_run_id_bytes)
    return fmt::format("rendezvous id of {} bytes is longer than {} bytes: pass a shorter --rdzv-id", run_id.size(),
                       max_run_id_bytes);
  if (node.local_world_size < 1 || node.local_world_size > max_local_world_size) {
    return fmt::format("node {} announced local_world_size {}: --nproc-per-node must be between 1 and {}",
                       node.id.to_string(), node.local_world_size, max_local_world_size);
  }
  if (std::string why = config.validate(); !why.empty())
    return fmt::format("invalid configuration for rendezvous '{}': {}", run_id, why);
  return {};
}

Decisions RendezvousRegistry::join(const std::string& run_id, const JoinRequest& request,
                                 TimePoint now) {
  if (std::string why = check_request(run_id, request.node, request.config);
      !why.empty()) {
    return {Refuse{run_id, request.node.id, why}};
  }
  auto it = jobs_.find(run_id);
  if (it == jobs_.end()) it = jobs_.try_emplace(run_id, run_id, request.config, now).first;
  return it->second.join(request.node, request.config, now);
}

Decisions RendezvousRegistry::rejoin(const std::string& run_id, const RejoinRequest& request,
                                   TimePoint now) {
  if (std::string why = check_request(run_id, request.node, request.config);
      !why.empty()) {
    return {Refuse{run_id, request.node.id, why}};
  }
  auto it = jobs_.find(run_id);
  if (it != jobs_.end()) return it->second.rejoin(request, now);
  if (!request.assignment) {
    it = jobs_.try_emplace(run_id, run_id, request.config, now).first;
    return it->second.join(request.node, request.config, now);
  }
  const Assignment& a = *request.assignment;
  if (a.group_world_size < 1 || a.group_world_size > request.config.max_nodes || a.group_rank < 0 ||
      a.group_rank >= a.group_world_size || a.restart_count < 0 || a.restart_count > max_restarts_limit ||
      a.local_world_size != request.node.local_world_size || a.rank_offset < 0 || a.world_size < 1 ||
      a.rank_offset > a.world_size - a.local_world_size ||
      static_cast<std::int64_t>(a.world_size) >
          static_cast<std::int64_t>(a.group_world_size) * max_local_world_size) {
    return {Refuse{run_id, request.node.id,
                   fmt::format("rejoin for rendezvous '{}' carries an inconsistent assignment "
                               "(group rank {} of {} with max_nodes {}, restart count {}, local world size {} "
                               "at rank offset {} of world size {})",
                               run_id, a.group_rank, a.group_world_size, request.config.max_nodes, a.restart_count,
                               a.local_world_size, a.rank_offset, a.world_size)}};
  }
  Decisions out;
  jobs_.emplace(run_id, RendezvousJob::rebuild(run_id, request, now, out));
  return out;
}

Decisions RendezvousRegistry::heartbeat(const std::string& run_id, const NodeId& node,
                                      TimePoint now) {
  auto it = jobs_.find(run_id);
  if (it == jobs_.end()) {
    return {AskRejoin{run_id, node,
                      fmt::format("rendezvous '{}' is not known to this daemon (restarted?); "
                                  "send rejoin with the current assignment",
                                  run_id)}};
  }
  return it->second.heartbeat(node, now);
}

Decisions RendezvousRegistry::disconnected(const std::string& run_id, const NodeId& node,
                                         TimePoint now) {
  auto it = jobs_.find(run_id);
  return it == jobs_.end() ? Decisions{} : it->second.disconnected(node, now);
}

Decisions RendezvousRegistry::leave(const std::string& run_id, const NodeId& node, TimePoint now) {
  auto it = jobs_.find(run_id);
  return it == jobs_.end() ? Decisions{} : it->second.leave(node, now);
}

Decisions RendezvousRegistry::worker_failed(const std::string& run_id, const WorkerFailure& failure,
                                          TimePoint now) {
  auto it = jobs_.find(run_id);
  return it == jobs_.end() ? Decisions{} : it->second.worker_failed(failure, now);
}

Decisions RendezvousRegistry::succeeded(const std::string& run_id, const NodeId& node,
                                      std::uint64_t round, TimePoint now) {
  auto it = jobs_.find(run_id);
  return it == jobs_.end() ? Decisions{} : it->second.succeeded(node, round, now);
}

Decisions RendezvousRegistry::close(const std::string& run_id, TimePoint now) {
  auto it = jobs_.find(run_id);
  return it == jobs_.end() ? Decisions{} : it->second.close(now);
}

Decisions RendezvousRegistry::on_tick(TimePoint now) {
  Decisions out;
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    Decisions job_actions = it->second.on_tick(now);
    out.insert(out.end(), std::make_move_iterator(job_actions.begin()),
               std::make_move_iterator(job_actions.end()));
    if (it->second.collectable(now)) {
      it = jobs_.erase(it);
    } else {
      ++it;
    }
  }
  return out;
}

std::optional<TimePoint> RendezvousRegistry::next_deadline() const {
  std::optional<TimePoint> best;
  for (const auto& [id, job] : jobs_) {
    const auto t = job.next_deadline();
    if (t && (!best || *t < *best)) best = t;
  }
  return best;
}

RegistryStatus RendezvousRegistry::status(TimePoint now) const {
  RegistryStatus s;
  for (const auto& [id, job] : jobs_) s.jobs.push_back(job.status(now));
  return s;
}

const RendezvousJob* RendezvousRegistry::find(const std::string& run_id) const {
  auto it = jobs_.find(run_id);
  return it == jobs_.end() ? nullptr : &it->second;
}

}  // namespace ddprun::rendezvous
