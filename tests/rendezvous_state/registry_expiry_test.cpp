// RendezvousRegistry's job expiry, job cap and deadline index (rendezvous_registry.hpp):
// explicit time points, no sockets, no sleeps.
#include <catch2/catch.hpp>

#include <chrono>
#include <string>
#include <vector>

#include "ddprun/common/clock.hpp"
#include "ddprun/rendezvous/rendezvous_state.hpp"

using namespace std::chrono_literals;
using namespace ddprun::rendezvous;
using ddprun::ManualClock;

namespace {

NodeInfo node(int i) {
  NodeInfo n;
  n.id = NodeId{"10.0.0." + std::to_string(i % 250), 1000 + i, "inst" + std::to_string(i)};
  n.addr = n.id.addr;
  n.local_world_size = 1;
  n.store_host = "store";
  n.store_port = 29500;
  return n;
}

JobConfig cfg(int min_nodes, int max_nodes) {
  JobConfig c;
  c.min_nodes = min_nodes;
  c.max_nodes = max_nodes;
  c.join_timeout = std::chrono::hours(24);  // a client asking for long timeouts
  c.close_timeout = std::chrono::hours(24);
  c.heartbeat_interval = 1s;
  c.missed_heartbeats = 3;
  return c;
}

bool refused_with(const Decisions& d, const std::string& needle) {
  for (const auto& a : d) {
    if (const auto* r = std::get_if<Refuse>(&a); r != nullptr && r->reason.find(needle) != std::string::npos) {
      return true;
    }
  }
  return false;
}

}  // namespace

TEST_CASE("a job whose nodes all left is forgotten job_expiry later, not at its own 24 h timeouts", "[registry]") {
  ManualClock clock;
  RendezvousRegistry reg(600s);
  reg.join("gone", JoinRequest{node(1), cfg(1, 1)}, clock.now());
  reg.leave("gone", node(1).id, clock.now());
  REQUIRE(reg.find("gone") != nullptr);
  CHECK(reg.next_deadline() == clock.now() + 600s);
  clock.advance(599s);
  std::vector<std::string> dropped;
  reg.on_tick(clock.now(), &dropped);
  CHECK(dropped.empty());
  CHECK(reg.find("gone") != nullptr);
  clock.advance(1s);
  reg.on_tick(clock.now(), &dropped);
  CHECK(dropped == std::vector<std::string>{"gone"});
  CHECK(reg.find("gone") == nullptr);
  CHECK(reg.job_count() == 0);
  CHECK(reg.audit().empty());
  // The id starts afresh.
  reg.join("gone", JoinRequest{node(2), cfg(1, 1)}, clock.now());
  REQUIRE(reg.find("gone") != nullptr);
  CHECK(reg.find("gone")->round() == 0);
}

TEST_CASE("a node that returns before expiry keeps the job; a live job never expires", "[registry]") {
  ManualClock clock;
  RendezvousRegistry reg(10s);
  reg.join("j", JoinRequest{node(1), cfg(2, 2)}, clock.now());
  reg.leave("j", node(1).id, clock.now());
  clock.advance(9s);
  reg.join("j", JoinRequest{node(2), cfg(2, 2)}, clock.now());
  for (int i = 0; i < 60; ++i) {  // a minute of heartbeats
    clock.advance(1s);
    REQUIRE(reg.heartbeat("j", node(2).id, clock.now()).empty());
    reg.on_tick(clock.now());
    REQUIRE(reg.audit().empty());
  }
  CHECK(reg.find("j") != nullptr);
  // Lost lease (3 missed heartbeats), then 10 s of expiry.
  clock.advance(3s);
  reg.on_tick(clock.now());
  REQUIRE(reg.find("j") != nullptr);
  CHECK(reg.find("j")->member_count() == 0);
  clock.advance(10s);
  reg.on_tick(clock.now());
  CHECK(reg.find("j") == nullptr);
}

TEST_CASE("a finished job goes at expiry when its close_timeout is longer", "[registry]") {
  ManualClock clock;
  RendezvousRegistry reg(60s);
  reg.join("done", JoinRequest{node(1), cfg(1, 1)}, clock.now());
  reg.succeeded("done", node(1).id, 0, clock.now());
  REQUIRE(reg.find("done")->finished());
  clock.advance(59s);
  reg.on_tick(clock.now());
  REQUIRE(reg.find("done") != nullptr);
  clock.advance(1s);
  reg.on_tick(clock.now());
  CHECK(reg.find("done") == nullptr);
}

TEST_CASE("without expiry a memberless job stays until its own timeouts", "[registry]") {
  ManualClock clock;
  RendezvousRegistry reg(std::nullopt);
  reg.join("j", JoinRequest{node(1), cfg(1, 1)}, clock.now());
  reg.leave("j", node(1).id, clock.now());
  clock.advance(std::chrono::hours(23));
  reg.on_tick(clock.now());
  CHECK(reg.find("j") != nullptr);
  CHECK(reg.audit().empty());
}

TEST_CASE("max_jobs refuses a new job, naming the flag; existing jobs go on", "[registry]") {
  ManualClock clock;
  RendezvousRegistry reg(600s, 3);
  for (int i = 0; i < 3; ++i) reg.join("j" + std::to_string(i), JoinRequest{node(i), cfg(2, 2)}, clock.now());
  auto refused = reg.join("j3", JoinRequest{node(3), cfg(2, 2)}, clock.now());
  CHECK(refused_with(refused, "--max-jobs"));
  CHECK(reg.find("j3") == nullptr);
  auto rejoin = reg.rejoin("j4", RejoinRequest{node(4), cfg(2, 2), {}, std::nullopt}, clock.now());
  CHECK(refused_with(rejoin, "--max-jobs"));
  auto joined = reg.join("j0", JoinRequest{node(10), cfg(2, 2)}, clock.now());
  CHECK_FALSE(refused_with(joined, ""));
  CHECK(reg.job_count() == 3);
}

TEST_CASE("max_members caps the members of all jobs together; a member's own events go on", "[registry]") {
  // Before: each job's max_nodes (its first client's choice, up to 2^20) was the only bound, and
  // a member whose connection closed stays for its heartbeat interval: joining and closing in a
  // loop grew the daemon without bound.
  ManualClock clock;
  RendezvousRegistry reg(600s, 100, 5);
  for (int i = 0; i < 4; ++i) {
    CHECK_FALSE(refused_with(reg.join("big", JoinRequest{node(i), cfg(1, 1000)}, clock.now()), ""));
  }
  CHECK_FALSE(refused_with(reg.join("other", JoinRequest{node(4), cfg(1, 1000)}, clock.now()), ""));
  CHECK(reg.member_count() == 5);
  auto refused = reg.join("big", JoinRequest{node(5), cfg(1, 1000)}, clock.now());
  CHECK(refused_with(refused, "--max-members"));
  CHECK(refused_with(reg.join("third", JoinRequest{node(6), cfg(1, 1000)}, clock.now()), "--max-members"));
  CHECK(reg.find("third") == nullptr);
  CHECK(refused_with(reg.rejoin("big", RejoinRequest{node(7), cfg(1, 1000), {}, std::nullopt}, clock.now()),
                     "--max-members"));
  // A member's own rejoin is not a new member.
  CHECK_FALSE(refused_with(reg.rejoin("big", RejoinRequest{node(1), cfg(1, 1000), {}, std::nullopt}, clock.now()), ""));
  // Two nodes go (one leaves, one disconnects and its lease runs out): two fit again.
  reg.leave("big", node(0).id, clock.now());
  reg.disconnected("big", node(2).id, clock.now());
  clock.advance(2s);
  for (int i : {1, 3}) reg.heartbeat("big", node(i).id, clock.now());
  reg.heartbeat("other", node(4).id, clock.now());
  clock.advance(2s);
  reg.on_tick(clock.now());
  CHECK(reg.member_count() == 3);
  CHECK_FALSE(refused_with(reg.join("big", JoinRequest{node(8), cfg(1, 1000)}, clock.now()), ""));
  CHECK_FALSE(refused_with(reg.join("big", JoinRequest{node(9), cfg(1, 1000)}, clock.now()), ""));
  CHECK(refused_with(reg.join("big", JoinRequest{node(10), cfg(1, 1000)}, clock.now()), "--max-members"));
  // A dropped job gives its members back.
  reg.leave("other", node(4).id, clock.now());
  clock.advance(601s);
  reg.on_tick(clock.now());
  CHECK(reg.find("other") == nullptr);
  CHECK(reg.audit().empty());
}

TEST_CASE("the deadline index agrees with a scan through thousands of jobs and events", "[registry]") {
  ManualClock clock;
  RendezvousRegistry reg(30s);
  // 3,000 jobs: a third abandoned, a third waiting for a second node, a third finished.
  for (int i = 0; i < 3000; ++i) {
    const std::string id = "j" + std::to_string(i);
    if (i % 3 == 0) {
      reg.join(id, JoinRequest{node(i), cfg(1, 1)}, clock.now());
      reg.leave(id, node(i).id, clock.now());
    } else if (i % 3 == 1) {
      reg.join(id, JoinRequest{node(i), cfg(2, 2)}, clock.now());
    } else {
      reg.join(id, JoinRequest{node(i), cfg(1, 1)}, clock.now());
      reg.succeeded(id, node(i).id, 0, clock.now());
    }
    if (i % 500 == 0) clock.advance(1s);
  }
  REQUIRE(reg.audit().empty());
  std::size_t ticks = 0;
  while (auto next = reg.next_deadline()) {
    clock.set(*next);
    reg.on_tick(clock.now());
    REQUIRE(reg.audit().empty());
    REQUIRE(++ticks < 10000);
  }
  // Every job lost its only node (leases, no heartbeats) or ended: all expired.
  CHECK(reg.job_count() == 0);
}

TEST_CASE("max_member_bytes caps what members of all jobs hold; it is counted and given back", "[registry]") {
  // Before: members were capped by count only, and a member keeps the NCCL IDs its JOIN offered
  // (up to 4,096 of 128 bytes in a 1 MiB frame): at the default --max-members the daemon could be
  // made to hold ~128 GiB.
  ManualClock clock;
  auto with_ids = [](int i, std::size_t ids) {
    NodeInfo n = node(i);
    n.nccl_ids.assign(ids * 128, std::uint8_t{7});
    return n;
  };
  const std::size_t plain = member_footprint(node(0));
  const std::size_t big = member_footprint(with_ids(1, 64));
  REQUIRE(big == plain + 64 * 128);
  // Room for one big member and three plain ones, not one byte more.
  RendezvousRegistry reg(600s, 100, 0, big + 3 * plain);
  CHECK_FALSE(refused_with(reg.join("a", JoinRequest{with_ids(1, 64), cfg(1, 1000)}, clock.now()), ""));
  for (int i : {2, 3}) CHECK_FALSE(refused_with(reg.join("a", JoinRequest{node(i), cfg(1, 1000)}, clock.now()), ""));
  CHECK_FALSE(refused_with(reg.join("b", JoinRequest{node(4), cfg(1, 1000)}, clock.now()), ""));
  CHECK(reg.member_bytes() == big + 3 * plain);
  CHECK(refused_with(reg.join("b", JoinRequest{node(5), cfg(1, 1000)}, clock.now()), "--max-member-bytes"));
  CHECK(refused_with(reg.join("c", JoinRequest{node(5), cfg(1, 1000)}, clock.now()), "--max-member-bytes"));
  CHECK(reg.find("c") == nullptr);
  CHECK(refused_with(reg.rejoin("a", RejoinRequest{node(6), cfg(1, 1000), {}, std::nullopt}, clock.now()),
                     "--max-member-bytes"));
  // A member announcing itself again with what it held is not charged twice; growing is.
  CHECK_FALSE(refused_with(reg.join("a", JoinRequest{node(2), cfg(1, 1000)}, clock.now()), ""));
  CHECK(refused_with(reg.join("a", JoinRequest{with_ids(2, 1), cfg(1, 1000)}, clock.now()), "--max-member-bytes"));
  // Shrinking is always allowed and gives bytes back.
  CHECK_FALSE(refused_with(reg.join("a", JoinRequest{with_ids(1, 63), cfg(1, 1000)}, clock.now()), ""));
  CHECK(reg.member_bytes() == big - 128 + 3 * plain);
  CHECK(reg.audit().empty());
  // A member that leaves, and a dropped job, give their bytes back.
  reg.leave("a", node(1).id, clock.now());
  CHECK(reg.member_bytes() == 3 * plain);
  CHECK_FALSE(refused_with(reg.join("b", JoinRequest{with_ids(5, 60), cfg(1, 1000)}, clock.now()), ""));
  reg.leave("b", node(4).id, clock.now());
  reg.leave("b", node(5).id, clock.now());
  CHECK(reg.member_bytes() == 2 * plain);
  clock.advance(601s);
  reg.on_tick(clock.now());
  CHECK(reg.find("b") == nullptr);
  // (Job a's members, silent for 601 s, lost their leases meanwhile.)
  CHECK(reg.member_bytes() == (reg.find("a") != nullptr ? reg.find("a")->member_bytes() : 0));
  CHECK(reg.member_bytes() < 2 * plain + 1);
  CHECK(reg.audit().empty());
}
