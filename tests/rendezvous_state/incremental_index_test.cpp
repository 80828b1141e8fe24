// Property test for the incremental indexes of RendezvousJob (role counters, success counter,
// lease index -> next_deadline): across random join / rejoin / heartbeat / disconnect / leave /
// failure / success / expiry sequences (fixed seeds, so a failure replays), every index must
// equal a brute-force recomputation from the job's status snapshot after every event.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "ddprun/common/clock.hpp"
#include "ddprun/rendezvous/rendezvous_state.hpp"

using namespace std::chrono_literals;
using namespace ddprun::rendezvous;
using ddprun::Duration;
using ddprun::TimePoint;

namespace {

NodeInfo pool_node(int i) {
  // Built with += : GCC 12 reports a false -Wrestrict for "literal" + std::to_string here.
  std::string addr = "10.1.0.";
  addr += std::to_string(i % 5);
  std::string instance = "p";
  instance += std::to_string(i);
  NodeInfo n;
  n.id = NodeId{addr, 2000 + i, instance};
  n.addr = addr;
  n.local_world_size = 1 + i % 3;
  n.store_port = static_cast<std::uint16_t>(30000 + i);
  return n;
}

JobConfig property_config() {
  JobConfig c;
  c.min_nodes = 2;
  c.max_nodes = 6;
  c.max_restarts = 1000000;  // keep the job alive through many rounds
  c.join_timeout = 20s;
  c.last_call_timeout = 2s;
  c.heartbeat_interval = 1s;
  c.missed_heartbeats = 3;
  c.exit_barrier_timeout = 5s;
  c.close_timeout = 3s;
  return c;
}

// next_deadline() recomputed from scratch out of status(now). Valid right after on_tick(now):
// then every pending deadline lies after `now`, so status' clamped "time left" values are exact.
std::optional<TimePoint> brute_next_deadline(const RendezvousJob& job, const JobStatus& s, TimePoint now) {
  std::optional<TimePoint> best;
  auto consider = [&](std::optional<Duration> left) {
    if (left && (!best || now + *left < *best)) best = now + *left;
  };
  consider(s.gc_in);
  if (job.finished()) return best;
  for (const MemberStatus& m : s.members) consider(m.lease_left);
  if (s.state == JobState::waiting) {
    const auto joined = std::count_if(s.members.begin(), s.members.end(),
                                      [](const MemberStatus& m) { return m.role == MemberRole::joined; });
    consider(joined >= job.config().min_nodes ? s.last_call_in : s.join_timeout_in);
  } else {
    consider(s.exit_barrier_in);
    consider(s.rebuild_in);
  }
  return best;
}

void check_indexes(const RendezvousJob& job, TimePoint now, int step) {
  INFO("step " << step << ", state " << to_string(job.state()) << ", round " << job.round());
  REQUIRE(job.audit() == "");
  const JobStatus s = job.status(now);
  for (MemberRole role : {MemberRole::joined, MemberRole::expected, MemberRole::participant, MemberRole::late}) {
    const auto brute =
        std::count_if(s.members.begin(), s.members.end(), [role](const MemberStatus& m) { return m.role == role; });
    INFO("role " << to_string(role));
    REQUIRE(job.count(role) == static_cast<int>(brute));
  }
  REQUIRE(job.joined_nodes().size() == static_cast<std::size_t>(job.count(MemberRole::joined)));
  for (const MemberStatus& m : s.members) REQUIRE(m.lease_left > Duration::zero());
  REQUIRE(job.next_deadline() == brute_next_deadline(job, s, now));
}

}  // namespace

TEST_CASE("incremental counters and the lease index equal a brute-force recomputation", "[rdzv][property]") {
  const std::uint32_t seed = GENERATE(1u, 7u, 42u, 20261122u);
  INFO("seed " << seed);
  std::mt19937 rng(seed);
  auto pick = [&rng](int n) { return std::uniform_int_distribution<int>(0, n - 1)(rng); };
  constexpr int kPool = 10;
  const JobConfig config = property_config();
  TimePoint now = TimePoint{} + 1h;
  int jobs_started = 0;
  std::optional<RendezvousJob> job;
  int rounds_seen = 0;
  int expiries = 0;
  for (int step = 0; step < 4000; ++step) {
    if (!job || job->finished()) {
      job.emplace("prop" + std::to_string(jobs_started++), config, now);
    }
    now += std::chrono::milliseconds(pick(4) == 0 ? pick(3500) : pick(400));
    const NodeInfo n = pool_node(pick(kPool));
    const JobStatus before = job->status(now);
    const std::size_t members_before = before.members.size();
    switch (pick(9)) {
      case 0:
      case 1:
        job->join(n, config, now);
        break;
      case 2:
        job->rejoin(RejoinRequest{n, config, {}, std::nullopt}, now);
        break;
      case 3:
      case 4:
        job->heartbeat(n.id, now);
        break;
      case 5:
        job->disconnected(n.id, now);
        break;
      case 6:
        job->leave(n.id, now);
        break;
      case 7: {
        WorkerFailure f;
        f.round = job->round();
        f.node = n.id;
        f.global_rank = 0;
        f.exit_code = 3;
        job->worker_failed(f, now);
        break;
      }
      default:
        job->succeeded(n.id, job->round() - static_cast<std::uint64_t>(pick(2) == 0 && job->round() > 0), now);
    }
    REQUIRE(job->audit() == "");
    job->on_tick(now);
    if (job->status(now).members.size() < members_before) ++expiries;
    rounds_seen = std::max(rounds_seen, static_cast<int>(job->round()));
    check_indexes(*job, now, step);
  }
  // The sequence must have exercised the interesting transitions, or the property says little.
  CHECK(jobs_started > 1);
  CHECK(rounds_seen > 5);
  CHECK(expiries > 10);
}
