#pragma once
// RendezvousRegistry: many isolated RendezvousJobs keyed by run id (one per --rdzv-id), the
// server-wide token check, the earliest deadline over all jobs and the garbage collection of
// finished ones. Pure like the job: every event takes the current time and returns the
// decisions to push; not thread-safe (owned by the service's io_context thread). Requests come
// from the network, so a bad one never throws: it gets a Refuse naming what was wrong.
#include <cstddef>
#include <map>
#include <optional>
#include <string>

#include "ddprun/common/clock.hpp"
#include "ddprun/rendezvous/rendezvous_job.hpp"
#include "ddprun/rendezvous/rendezvous_types.hpp"

namespace ddprun::rendezvous {

class RendezvousRegistry {
 public:
  // Authentication is the service's (rendezvous_service.hpp): the registry sees only requests
  // from connections that passed it.
  RendezvousRegistry() = default;

  Decisions join(const std::string& run_id, const JoinRequest& request, TimePoint now);
  Decisions rejoin(const std::string& run_id, const RejoinRequest& request, TimePoint now);
  Decisions heartbeat(const std::string& run_id, const NodeId& node, TimePoint now);
  Decisions disconnected(const std::string& run_id, const NodeId& node, TimePoint now);
  Decisions leave(const std::string& run_id, const NodeId& node, TimePoint now);
  Decisions worker_failed(const std::string& run_id, const WorkerFailure& failure, TimePoint now);
  Decisions succeeded(const std::string& run_id, const NodeId& node, std::uint64_t round,
                    TimePoint now);
  // Unknown run ids are ignored (nothing to refuse later).
  Decisions close(const std::string& run_id, TimePoint now);
  // Runs every job's timers and drops collectable jobs.
  Decisions on_tick(TimePoint now);

  std::optional<TimePoint> next_deadline() const;
  RegistryStatus status(TimePoint now) const;
  const RendezvousJob* find(const std::string& run_id) const;
  std::size_t job_count() const { return jobs_.size(); }

 private:
  std::string check_request(const std::string& run_id, const NodeInfo& node, const JobConfig& config) const;

  std::map<std::string, RendezvousJob> jobs_;
};

}  // namespace ddprun::rendezvous
