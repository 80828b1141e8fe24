#pragma once
// RendezvousRegistry: many isolated RendezvousJobs keyed by run id (one per --rdzv-id), the
// earliest deadline over all jobs and the garbage collection of finished and abandoned ones.
// Pure like the job: every event takes the current time and returns the decisions to push; not
// thread-safe (owned by the service's io_context thread). Requests come from the network, so a
// bad one never throws: it gets a Refuse naming what was wrong.
//
// Cost: every event on one job, next_deadline() and a tick that finds k jobs due are
// O(log J + the job's own cost) for J jobs, however many of them are idle or dead: a deadline
// index (time -> job) is updated after each event on the job it touched, so nothing scans every
// job except status() of all jobs (its reply is that big anyway) and audit().
//
// Expiry: a job with no live member (every node left or lost its lease, or the job finished)
// is dropped `job_expiry` after it last had one, even when its own join/close timeouts (chosen
// by the clients, up to 30 days) are longer; a node arriving later starts a fresh job of that
// id. This bounds what abandoned jobs (crashed launchers, junk run ids) cost the daemon, and
// max_jobs bounds how many exist at once, max_members how many members they hold together (each
// job's own max_nodes is its first client's choice, up to 2^20, and a member whose connection
// closed is kept for its heartbeat interval, up to an hour: without a daemon-wide cap one token
// holder could make the daemon hold gigabytes of members).
#include <cstddef>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "ddprun/common/clock.hpp"
#include "ddprun/rendezvous/rendezvous_job.hpp"
#include "ddprun/rendezvous/rendezvous_types.hpp"

namespace ddprun::rendezvous {

// ddprun-rdzvd's --job-expiry and --max-jobs defaults.
inline constexpr Duration default_job_expiry = std::chrono::minutes(10);
inline constexpr std::size_t default_max_jobs = 100000;
// ddprun-rdzvd's --max-members default: 2.6 times the 100,000 agents it is measured with.
inline constexpr std::size_t default_max_members = 262144;
// ddprun-rdzvd's --max-member-bytes default (member_footprint summed over all jobs): what members
// may make the daemon hold, as etcd's default backend quota; 100,000 agents with --nccl-roots 1
// count about 130 MB.
inline constexpr std::size_t default_max_member_bytes = std::size_t{2} << 30;

class RendezvousRegistry {
 public:
  // Authentication is the service's (rendezvous_service.hpp): the registry sees only requests
  // from connections that passed it. `job_expiry`: nullopt = jobs without members stay until
  // their own timeouts collect them (the etcd replay, whose log decides when a job ends).
  // `max_jobs`: a JOIN or REJOIN that would create one more job is refused (0 = no cap).
  // `max_members`: a JOIN or REJOIN that would add a member while all jobs together hold this
  // many is refused (0 = no cap). `max_member_bytes`: likewise for one that would take the
  // members' member_footprint() over all jobs past this many bytes (0 = no cap).
  explicit RendezvousRegistry(std::optional<Duration> job_expiry = default_job_expiry,
                              std::size_t max_jobs = default_max_jobs, std::size_t max_members = 0,
                              std::size_t max_member_bytes = 0);

  Decisions join(const std::string& run_id, const JoinRequest& request, TimePoint now);
  Decisions rejoin(const std::string& run_id, const RejoinRequest& request, TimePoint now);
  Decisions heartbeat(const std::string& run_id, const NodeId& node, TimePoint now);
  Decisions disconnected(const std::string& run_id, const NodeId& node, TimePoint now);
  Decisions leave(const std::string& run_id, const NodeId& node, TimePoint now);
  Decisions worker_failed(const std::string& run_id, const WorkerFailure& failure, TimePoint now);
  Decisions succeeded(const std::string& run_id, const NodeId& node, std::uint64_t round, TimePoint now);
  // Unknown run ids are ignored (nothing to refuse later).
  Decisions close(const std::string& run_id, TimePoint now);
  // RendezvousJob::abort of every job.
  Decisions abort_all(const std::string& reason, int exit_code, TimePoint now);
  // Runs the timers of the jobs that are due and drops the collectable and expired ones; their
  // run ids are appended to `dropped` when given.
  Decisions on_tick(TimePoint now, std::vector<std::string>* dropped = nullptr);

  std::optional<TimePoint> next_deadline() const;
  RegistryStatus status(TimePoint now) const;
  // Every job, for counting (the metrics endpoint): no JobStatus is built, so a scrape over
  // 100,000 jobs costs a pass over them rather than a copy of each one's members.
  void for_each_job(const std::function<void(const RendezvousJob&)>& f) const;
  // One job's status; nullopt when the registry does not have it. O(log J + its members).
  std::optional<JobStatus> status_of(const std::string& run_id, TimePoint now) const;
  const RendezvousJob* find(const std::string& run_id) const;
  std::size_t job_count() const { return jobs_.size(); }
  std::size_t member_count() const { return members_; }       // over all jobs
  std::size_t member_bytes() const { return member_bytes_; }  // member_footprint() over all jobs
  std::optional<Duration> job_expiry() const { return job_expiry_; }

  // Recomputes the deadline index by brute force and compares: "" when it agrees, else what
  // differs. O(J); for tests only.
  std::string audit() const;

 private:
  struct Entry;
  using Jobs = std::map<std::string, Entry>;
  // Due time -> job (its key in jobs_, which never moves while the job exists).
  using DueIndex = std::multimap<TimePoint, const std::string*>;
  struct Entry {
    RendezvousJob job;
    std::optional<TimePoint> memberless_since;  // when it last had a live member; nullopt = it has one
    std::optional<DueIndex::iterator> due_it;   // this job's entry in due_ (none when nothing is pending)
    std::size_t counted_members = 0;            // its share of members_
    std::size_t counted_bytes = 0;              // its share of member_bytes_
  };

  std::string check_request(const std::string& run_id, const NodeInfo& node, const JobConfig& config) const;
  Jobs::iterator add_job(const std::string& run_id, RendezvousJob job, TimePoint now);
  // After any event on the job: its liveness and its place in the deadline index.
  Decisions touched(Jobs::iterator it, Decisions out, TimePoint now);
  void reindex(Jobs::iterator it, TimePoint now);
  std::optional<TimePoint> due_of(const Entry& e) const;
  bool expired(const Entry& e, TimePoint now) const;

  // "" when one more job fits, else the Refuse reason.
  std::string check_room(const std::string& run_id) const;
  // "" when `node` is a member of the job `it` (end(): none) already or one more member fits, and
  // its footprint (less what it held as a member already) fits under max_member_bytes.
  std::string check_member_room(const std::string& run_id, Jobs::const_iterator it, const NodeInfo& node) const;
  void recount(Entry& e);

  std::optional<Duration> job_expiry_;
  std::size_t max_jobs_;
  std::size_t max_members_;
  std::size_t max_member_bytes_;
  std::size_t members_ = 0;
  std::size_t member_bytes_ = 0;
  Jobs jobs_;
  DueIndex due_;
};

}  // namespace ddprun::rendezvous
