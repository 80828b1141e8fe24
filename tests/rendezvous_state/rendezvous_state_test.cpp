// Decision tables for the pure rendezvous state (rendezvous_state.hpp): explicit time points,
// no sockets, no sleeps.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "ddprun/common/clock.hpp"
#include "ddprun/rendezvous/rendezvous_state.hpp"

using namespace std::chrono_literals;
using namespace ddprun::rendezvous;
using ddprun::ManualClock;

namespace {

NodeInfo node(int i, int lws = 2) {
  NodeInfo n;
  n.id = NodeId{"10.0.0." + std::to_string(i), 1000 + i, "inst" + std::to_string(i)};
  n.addr = "10.0.0." + std::to_string(i);
  n.local_world_size = lws;
  n.store_host = "store" + std::to_string(i);
  n.store_port = static_cast<std::uint16_t>(29500 + i);
  return n;
}

JobConfig cfg(int min_nodes, int max_nodes, int max_restarts = 0) {
  JobConfig c;
  c.min_nodes = min_nodes;
  c.max_nodes = max_nodes;
  c.max_restarts = max_restarts;
  return c;
}

template <class T>
std::vector<T> of(const Decisions& actions) {
  std::vector<T> out;
  for (const auto& a : actions) {
    if (const T* t = std::get_if<T>(&a)) out.push_back(*t);
  }
  return out;
}

template <class T>
std::vector<T> for_node(const Decisions& actions, const NodeId& id) {
  std::vector<T> out;
  for (const T& t : of<T>(actions)) {
    if (t.node == id) out.push_back(t);
  }
  return out;
}

// Assignment of `id` among the actions; fails the test if absent.
Assignment assignment_of(const Decisions& actions, const NodeId& id) {
  auto sends = for_node<SendAssignment>(actions, id);
  REQUIRE(sends.size() == 1);
  return sends.front().assignment;
}

struct Fixture {
  ManualClock clock;
  RendezvousRegistry reg;
  std::string job = "job7";

  Decisions join(const NodeInfo& n, const JobConfig& c) { return reg.join(job, JoinRequest{n, c}, clock.now()); }
  Decisions tick() { return reg.on_tick(clock.now()); }
  // Heartbeats every given node (keeps leases alive while time passes).
  void beat(const std::vector<NodeInfo>& nodes) {
    for (const auto& n : nodes) REQUIRE(reg.heartbeat(job, n.id, clock.now()).empty());
  }
  // Advance in heartbeat-sized steps so leases of `alive` never expire.
  Decisions advance(ddprun::Duration d, const std::vector<NodeInfo>& alive) {
    Decisions all;
    while (d > ddprun::Duration::zero()) {
      const auto step = std::min<ddprun::Duration>(d, 1s);
      clock.advance(step);
      d -= step;
      beat(alive);
      auto a = tick();
      all.insert(all.end(), a.begin(), a.end());
    }
    return all;
  }
  const RendezvousJob& state() {
    const RendezvousJob* j = reg.find(job);
    REQUIRE(j != nullptr);
    return *j;
  }
};

}  // namespace

TEST_CASE("join below min waits, then fails at join_timeout with a named error", "[rdzv]") {
  Fixture f;
  auto a = f.join(node(1), cfg(2, 2));
  REQUIRE(of<SendAssignment>(a).empty());
  REQUIRE(for_node<Progress>(a, node(1).id).size() == 1);
  CHECK(of<Progress>(a)[0].text == "waiting for nodes: 1/2 joined (min 2, max 2), join timeout in 600 s");
  CHECK(f.state().state() == JobState::waiting);
  CHECK(f.reg.next_deadline() == f.clock.now() + 3s);  // the lease is the earliest deadline

  auto before = f.advance(599s, {node(1)});
  CHECK(of<SendJobFailed>(before).empty());
  auto at = f.advance(1s, {node(1)});
  auto failed = for_node<SendJobFailed>(at, node(1).id);
  REQUIRE(failed.size() == 1);
  CHECK(failed[0].reason == "rendezvous 'job7' timed out after 600 s waiting for nodes: 1/2 joined (min 2)");
  CHECK(failed[0].exit_code == kRendezvousFailureExitCode);
  CHECK_FALSE(failed[0].root_cause.has_value());
  CHECK(f.state().state() == JobState::failed);
}

TEST_CASE("min reached starts the last call; the round closes at the deadline with the nodes present", "[rdzv]") {
  Fixture f;
  f.join(node(1), cfg(2, 4));
  auto a = f.join(node(2), cfg(2, 4));
  REQUIRE(of<SendAssignment>(a).empty());
  // The joiner gets its line; the other waiting nodes get ONE broadcast action (the server fans
  // it out), so a join costs O(1) actions however many nodes wait.
  REQUIRE(of<Progress>(a).size() == 2);
  REQUIRE(for_node<Progress>(a, node(2).id).size() == 1);
  CHECK(for_node<Progress>(a, node(2).id)[0].text == "waiting for nodes: 2/2 joined (min 2, max 4), last call in 30 s");
  const auto broadcasts = [](const Decisions& acts) {
    std::vector<Progress> out;
    for (const auto& p : of<Progress>(acts))
      if (p.broadcast) out.push_back(p);
    return out;
  };
  REQUIRE(broadcasts(a).size() == 1);
  CHECK(broadcasts(a)[0].text == "waiting for nodes: 2/2 joined (min 2, max 4), last call in 30 s");
  CHECK(f.state().joined_nodes() == std::vector<NodeId>{node(1).id, node(2).id});
  // next_deadline: leases (3 s) come first; with heartbeats the last call is what remains.
  f.advance(10s, {node(1), node(2)});
  f.join(node(3), cfg(2, 4));  // a third node before the deadline joins the same round
  auto mid = f.advance(19s, {node(1), node(2), node(3)});
  CHECK(of<SendAssignment>(mid).empty());
  auto close = f.advance(1s, {node(1), node(2), node(3)});
  REQUIRE(of<SendAssignment>(close).size() == 3);
  for (int i = 1; i <= 3; ++i) {
    const Assignment as = assignment_of(close, node(i).id);
    CHECK(as.group_rank == i - 1);  // join order
    CHECK(as.group_world_size == 3);
    CHECK(as.world_size == 6);
    CHECK(as.rank_offset == 2 * (i - 1));
    CHECK(as.master_addr == "store1");
    CHECK(as.master_port == 29501);
    CHECK(as.round == 0);
    CHECK(as.restart_count == 0);
  }
  CHECK(f.state().state() == JobState::running);
}

TEST_CASE("reaching max closes the round immediately", "[rdzv]") {
  Fixture f;
  f.join(node(1), cfg(1, 2));
  auto a = f.join(node(2), cfg(1, 2));
  REQUIRE(of<SendAssignment>(a).size() == 2);
  CHECK(f.state().state() == JobState::running);
}

TEST_CASE("nodes with an order key get group ranks by key, the others follow in join order", "[rdzv]") {
  // A fan-out launcher passes each host's position (NodeInfo::order): ranks follow the host list
  // whatever order the ssh connections joined in.
  Fixture f;
  NodeInfo a = node(1), b = node(2), c = node(3), d = node(4);
  a.order = 2;
  b.order = 0;
  c.order = 1;  // d has none: an independent agent, after the ordered ones
  f.join(d, cfg(4, 4));
  f.join(a, cfg(4, 4));
  f.join(c, cfg(4, 4));
  const auto out = f.join(b, cfg(4, 4));
  CHECK(assignment_of(out, b.id).group_rank == 0);
  CHECK(assignment_of(out, c.id).group_rank == 1);
  CHECK(assignment_of(out, a.id).group_rank == 2);
  CHECK(assignment_of(out, d.id).group_rank == 3);
  CHECK(assignment_of(out, c.id).rank_offset == 2);
}

TEST_CASE("master falls back to the advertised address when no store host is given", "[rdzv]") {
  Fixture f;
  NodeInfo n = node(1);
  n.store_host.clear();
  auto a = f.join(n, cfg(1, 1));
  CHECK(assignment_of(a, n.id).master_addr == "10.0.0.1");
}

TEST_CASE("heterogeneous local_world_size gives prefix-sum rank offsets", "[rdzv]") {
  Fixture f;
  f.join(node(1, 4), cfg(3, 3));
  f.join(node(2, 1), cfg(3, 3));
  auto a = f.join(node(3, 3), cfg(3, 3));
  CHECK(assignment_of(a, node(1).id).rank_offset == 0);
  CHECK(assignment_of(a, node(2).id).rank_offset == 4);
  CHECK(assignment_of(a, node(3).id).rank_offset == 5);
  CHECK(assignment_of(a, node(3).id).local_world_size == 3);
  CHECK(assignment_of(a, node(2).id).world_size == 8);
}

TEST_CASE("a late join ends the running round as a free membership change with stable ranks", "[rdzv]") {
  Fixture f;
  const auto c = cfg(2, 4, 3);
  f.join(node(1), c);
  f.join(node(2), c);
  f.advance(30s, {node(1), node(2)});
  REQUIRE(f.state().state() == JobState::running);
  REQUIRE(f.state().round() == 0);

  auto a = f.join(node(3), c);
  auto restarts = of<SendRestart>(a);
  REQUIRE(restarts.size() == 2);
  for (const auto& r : restarts) {
    CHECK(r.kind == RoundEnd::membership_change);
    CHECK(r.ended_round == 0);
    CHECK(r.restart_count == 0);
    CHECK(r.reason.find("new node 10.0.0.3") != std::string::npos);
  }
  CHECK(for_node<SendRestart>(a, node(3).id).empty());
  CHECK(f.state().state() == JobState::waiting);
  CHECK(f.state().round() == 1);
  CHECK(f.state().restarts_used() == 0);

  // Survivors re-join in reverse order; the round closes as soon as both are back.
  auto b = f.join(node(2), c);
  CHECK(of<SendAssignment>(b).empty());
  auto d = f.join(node(1), c);
  REQUIRE(of<SendAssignment>(d).size() == 3);
  CHECK(assignment_of(d, node(1).id).group_rank == 0);
  CHECK(assignment_of(d, node(2).id).group_rank == 1);
  CHECK(assignment_of(d, node(3).id).group_rank == 2);
  CHECK(assignment_of(d, node(3).id).round == 1);
  CHECK(assignment_of(d, node(3).id).restart_count == 0);
}

TEST_CASE("a survivor that misses the last call joins late as a scale-up", "[rdzv]") {
  Fixture f;
  const auto c = cfg(1, 3);
  f.join(node(1), c);
  f.join(node(2), c);
  f.advance(30s, {node(1), node(2)});
  f.join(node(3), c);  // round 0 ends
  f.join(node(1), c);  // J=2 >= min, node 2 still expected -> last call
  auto a = f.advance(30s, {node(1), node(2), node(3)});
  REQUIRE(of<SendAssignment>(a).size() == 2);
  CHECK(assignment_of(a, node(1).id).group_rank == 0);
  CHECK(assignment_of(a, node(3).id).group_rank == 1);
  auto st = f.reg.status(f.clock.now()).jobs.at(0);
  auto it =
      std::find_if(st.members.begin(), st.members.end(), [](const MemberStatus& m) { return m.id == node(2).id; });
  REQUIRE(it != st.members.end());
  CHECK(it->role == MemberRole::late);
  // Its join now ends round 1 (room: 2 < 3) and it keeps its old rank 1 if free: 1 is taken by
  // node 3 in round 1, and node 3 keeps it, so node 2 gets the gap 2.
  auto b = f.join(node(2), c);
  REQUIRE(of<SendRestart>(b).size() == 2);
  f.join(node(1), c);
  auto d = f.join(node(3), c);
  REQUIRE(of<SendAssignment>(d).size() == 3);
  CHECK(assignment_of(d, node(3).id).group_rank == 1);
  CHECK(assignment_of(d, node(2).id).group_rank == 2);
}

// torch's redundancy list: a node that joins a full job waits as a spare and takes the place of
// a lost node in the next round; up to max spares, then refused.
TEST_CASE("joins beyond max wait as spares, then are refused", "[rdzv]") {
  Fixture f;
  const auto c = cfg(1, 2, 1);
  f.join(node(1), c);
  f.join(node(2), c);
  REQUIRE(f.state().state() == JobState::running);
  auto role = [&](int i) { return f.state().role_of(node(i).id); };
  auto a = f.join(node(3), c);
  CHECK(for_node<Refuse>(a, node(3).id).empty());
  CHECK(of<SendRestart>(a).empty());  // the running round goes on
  REQUIRE(for_node<Progress>(a, node(3).id).size() == 1);
  CHECK(for_node<Progress>(a, node(3).id)[0].text.find("waiting as a spare node") != std::string::npos);
  CHECK(role(3) == MemberRole::spare);
  f.clock.advance(100ms);
  auto again = f.join(node(3), c);  // a second JOIN (an agent that reconnected) is still a spare
  CHECK(of<SendRestart>(again).empty());
  CHECK(role(3) == MemberRole::spare);
  f.clock.advance(100ms);
  f.join(node(4), c);
  CHECK(role(4) == MemberRole::spare);
  auto d = f.join(node(5), c);  // at most max (2) spares
  auto refused = for_node<Refuse>(d, node(5).id);
  REQUIRE(refused.size() == 1);
  CHECK(refused[0].reason.find("is full: 2 of max 2 nodes are taking part and 2 spare nodes wait") !=
        std::string::npos);
  CHECK(refused[0].code == RefuseCode::job_full);
  CHECK(f.reg.status(f.clock.now()).jobs.at(0).members.size() == 4);
  CHECK(f.state().audit().empty());

  SECTION("a worker failure restarts the participants only") {
    auto r = f.reg.worker_failed(f.job, WorkerFailure{0, node(1).id, 0, 0, 1, std::nullopt, ""}, f.clock.now());
    CHECK(of<SendRestart>(r).size() == 2);
    CHECK(for_node<SendRestart>(r, node(3).id).empty());
    f.join(node(1), c);
    auto closed = f.join(node(2), c);
    CHECK(of<SendAssignment>(closed).size() == 2);
    CHECK(for_node<SendAssignment>(closed, node(3).id).empty());
    CHECK(role(3) == MemberRole::spare);
    CHECK(role(4) == MemberRole::spare);
  }
  SECTION("a lost participant's place goes to the first spare; the round keeps the survivor's rank") {
    f.clock.advance(2s);
    f.beat({node(1), node(3), node(4)});
    f.clock.advance(1s);
    f.beat({node(1), node(3), node(4)});
    auto lost = f.tick();  // node 2's lease (3 s) ran out
    REQUIRE(for_node<SendRestart>(lost, node(1).id).size() == 1);
    CHECK(for_node<SendRestart>(lost, node(3).id).empty());
    REQUIRE(f.state().state() == JobState::waiting);
    CHECK(role(3) == MemberRole::joined);  // promoted, in join order
    CHECK(role(4) == MemberRole::spare);
    auto closed = f.join(node(1), c);  // the roster is complete: 2 joined = max
    CHECK(assignment_of(closed, node(1).id).group_rank == 0);
    CHECK(assignment_of(closed, node(3).id).group_rank == 1);
    CHECK(for_node<SendAssignment>(closed, node(4).id).empty());
    CHECK(role(4) == MemberRole::spare);
    CHECK(f.state().audit().empty());
    // The job's end reaches the spare too.
    f.reg.succeeded(f.job, node(1).id, f.state().round(), f.clock.now());
    auto done = f.reg.succeeded(f.job, node(3).id, f.state().round(), f.clock.now());
    CHECK(for_node<SendJobCompleted>(done, node(4).id).size() == 1);
  }
  SECTION("a slot freed by a participant that had succeeded goes to the first spare, not to a new node") {
    f.reg.succeeded(f.job, node(2).id, f.state().round(), f.clock.now());
    auto gone = f.reg.leave(f.job, node(2).id, f.clock.now());
    CHECK(of<SendRestart>(gone).empty());  // losing a node that is done ends nothing
    REQUIRE(f.state().state() == JobState::running);
    CHECK(role(3) == MemberRole::spare);
    auto joined5 = f.join(node(5), c);
    CHECK(role(3) == MemberRole::joined);  // waited longest
    CHECK(role(4) == MemberRole::spare);
    CHECK(role(5) == MemberRole::spare);  // queued behind the spares (2 of max 2 again)
    CHECK(for_node<Refuse>(joined5, node(5).id).empty());
    REQUIRE(for_node<SendRestart>(joined5, node(1).id).size() == 1);
    CHECK(for_node<SendRestart>(joined5, node(1).id)[0].reason.find("1 spare node(s) took the free slots") !=
          std::string::npos);
    auto closed = f.join(node(1), c);
    CHECK(assignment_of(closed, node(3).id).group_rank >= 0);
    CHECK(for_node<SendAssignment>(closed, node(5).id).empty());
    CHECK(role(5) == MemberRole::spare);
    CHECK(f.state().audit().empty());
  }
  SECTION("a spare that goes silent is dropped without ending the round") {
    f.clock.advance(2s);
    f.beat({node(1), node(2), node(4)});
    f.clock.advance(1s);
    f.beat({node(1), node(2), node(4)});
    auto t = f.tick();
    CHECK(of<SendRestart>(t).empty());
    CHECK_FALSE(role(3).has_value());
    CHECK(role(4) == MemberRole::spare);
  }
  SECTION("while collecting, spares fill slots that no expected survivor holds") {
    // node 2 leaves: node 1 expected, node 3 promoted (1 + 1 = max), node 4 stays a spare.
    f.reg.leave(f.job, node(2).id, f.clock.now());
    CHECK(role(3) == MemberRole::joined);
    CHECK(role(4) == MemberRole::spare);
    f.clock.advance(100ms);
    auto b = f.join(node(6), c);  // J+E = 2 = max: a spare (the second)
    CHECK(of<Refuse>(b).empty());
    CHECK(role(6) == MemberRole::spare);
    CHECK(for_node<Refuse>(f.join(node(7), c), node(7).id).size() == 1);
    // node 1 stays alive but does not re-join: at the last call its slot goes to the first spare.
    auto closed = f.advance(30s, {node(1), node(3), node(4), node(6)});
    REQUIRE(of<SendAssignment>(closed).size() == 2);
    CHECK(for_node<SendAssignment>(closed, node(3).id).size() == 1);
    CHECK(for_node<SendAssignment>(closed, node(4).id).size() == 1);
    CHECK(role(1) == MemberRole::late);
    CHECK(role(6) == MemberRole::spare);
    // The late node comes back to a full job: it waits as a spare now, behind node 6.
    auto back = f.join(node(1), c);
    CHECK(of<SendRestart>(back).empty());
    CHECK(role(1) == MemberRole::spare);
    CHECK(f.state().audit().empty());
    f.reg.leave(f.job, node(3).id, f.clock.now());  // a slot: node 6 first, though node 1 joined long before
    CHECK(role(6) == MemberRole::joined);
    CHECK(role(1) == MemberRole::spare);
  }
}

TEST_CASE("lease expiry while waiting drops the node and cancels the last call", "[rdzv]") {
  Fixture f;
  const auto c = cfg(2, 3);
  f.join(node(1), c);
  f.join(node(2), c);
  CHECK(f.reg.status(f.clock.now()).jobs.at(0).last_call_in == 30s);
  f.clock.advance(2s);
  f.beat({node(1)});
  CHECK(f.reg.next_deadline() == f.clock.now() + 1s);  // node 2's lease
  f.clock.advance(1s);
  auto a = f.tick();
  // No node caused this: one broadcast to the nodes still waiting (node 1).
  REQUIRE(of<Progress>(a).size() == 1);
  CHECK(of<Progress>(a)[0].broadcast);
  CHECK(of<Progress>(a)[0].text.rfind("waiting for nodes: 1/2 joined", 0) == 0);
  CHECK(f.state().joined_nodes() == std::vector<NodeId>{node(1).id});
  auto st = f.reg.status(f.clock.now()).jobs.at(0);
  CHECK(st.members.size() == 1);
  CHECK_FALSE(st.last_call_in.has_value());
  CHECK(st.join_timeout_in == 597s);
  // The last call does not fire: nothing closes while below min.
  auto b = f.advance(40s, {node(1)});
  CHECK(of<SendAssignment>(b).empty());
}

TEST_CASE("lease expiry while running with >= min survivors shrinks the job", "[rdzv]") {
  Fixture f;
  const auto c = cfg(2, 3, 2);
  f.join(node(1), c);
  f.join(node(2), c);
  f.join(node(3), c);
  REQUIRE(f.state().state() == JobState::running);
  f.clock.advance(2s);
  f.beat({node(2), node(3)});
  f.clock.advance(1s);
  auto a = f.tick();
  auto restarts = of<SendRestart>(a);
  REQUIRE(restarts.size() == 2);
  CHECK(restarts[0].kind == RoundEnd::membership_change);
  CHECK(restarts[0].reason == "node 10.0.0.1 (10.0.0.1:1001/inst1) lost: no heartbeat for 3 s");
  CHECK(f.state().restarts_used() == 0);
  f.join(node(3), c);
  auto b = f.join(node(2), c);
  REQUIRE(of<SendAssignment>(b).size() == 2);
  // node 2 kept rank 1; node 3's old rank 2 does not fit in 2 nodes, so it takes the gap 0.
  CHECK(assignment_of(b, node(2).id).group_rank == 1);
  CHECK(assignment_of(b, node(3).id).group_rank == 0);
  CHECK(assignment_of(b, node(3).id).master_addr == "store3");
}

TEST_CASE("lease expiry below min waits for replacements, then fails", "[rdzv]") {
  Fixture f;
  const auto c = cfg(2, 2);
  f.join(node(1), c);
  f.join(node(2), c);
  f.clock.advance(3s);
  f.beat({node(1)});
  auto a = f.tick();
  auto restarts = of<SendRestart>(a);
  REQUIRE(restarts.size() == 1);
  CHECK(restarts[0].reason.find("1 nodes remain (min 2), waiting up to 600 s for replacements") != std::string::npos);
  f.join(node(1), c);

  SECTION("a replacement arrives in time") {
    f.advance(100s, {node(1)});
    auto b = f.join(node(3), c);
    REQUIRE(of<SendAssignment>(b).size() == 2);
    CHECK(assignment_of(b, node(1).id).group_rank == 0);
    CHECK(assignment_of(b, node(3).id).group_rank == 1);
  }
  SECTION("no replacement: failed at join_timeout naming the lost node") {
    auto b = f.advance(600s, {node(1)});
    auto failed = for_node<SendJobFailed>(b, node(1).id);
    REQUIRE(failed.size() == 1);
    CHECK(failed[0].reason.rfind("rendezvous 'job7' timed out after 600 s waiting for nodes: 1/2 joined (min 2); the "
                                 "last round ended because node 10.0.0.2",
                                 0) == 0);
  }
}

TEST_CASE("disconnected shortens the lease to one heartbeat; reconnecting keeps the node", "[rdzv]") {
  Fixture f;
  const auto c = cfg(2, 2);
  f.join(node(1), c);
  auto a = f.join(node(2), c);
  const Assignment as2 = assignment_of(a, node(2).id);
  REQUIRE(f.reg.disconnected(f.job, node(2).id, f.clock.now()).empty());
  CHECK(f.reg.next_deadline() == f.clock.now() + 1s);
  CHECK(f.reg.status(f.clock.now()).jobs.at(0).members.at(1).disconnected);

  SECTION("rejoin within the grace keeps it") {
    f.clock.advance(900ms);
    auto b = f.reg.rejoin(f.job, RejoinRequest{node(2), c, {}, as2}, f.clock.now());
    REQUIRE(for_node<Progress>(b, node(2).id).size() == 1);
    CHECK(of<SendRestart>(b).empty());
    CHECK(f.reg.status(f.clock.now()).jobs.at(0).members.at(1).lease_left == 3s);  // full lease
    CHECK_FALSE(f.reg.status(f.clock.now()).jobs.at(0).members.at(1).disconnected);
    auto c2 = f.advance(10s, {node(1), node(2)});
    CHECK(c2.empty());
    CHECK(f.state().state() == JobState::running);
  }
  SECTION("a heartbeat within the grace also keeps it") {
    f.clock.advance(900ms);
    f.beat({node(1), node(2)});
    CHECK(f.advance(5s, {node(1), node(2)}).empty());
  }
  SECTION("no reconnect: lost after the grace, with the reason") {
    f.clock.advance(1s);
    f.beat({node(1)});
    auto b = f.tick();
    auto r = for_node<SendRestart>(b, node(1).id);
    REQUIRE(r.size() == 1);
    CHECK(r[0].reason.find("node 10.0.0.2 (10.0.0.2:1002/inst2) lost: connection closed and not "
                           "re-registered within 1 s") == 0);
  }
}

TEST_CASE("a worker failure with budget left restarts every node and counts the restart", "[rdzv]") {
  Fixture f;
  const auto c = cfg(2, 2, 2);
  f.join(node(1), c);
  f.join(node(2), c);
  WorkerFailure w{0, node(2).id, 3, 1, 7, std::nullopt, "CUDA error"};
  auto a = f.reg.worker_failed(f.job, w, f.clock.now());
  auto restarts = of<SendRestart>(a);
  REQUIRE(restarts.size() == 2);
  for (const auto& r : restarts) {
    CHECK(r.kind == RoundEnd::worker_failure);
    CHECK(r.restart_count == 1);
    CHECK(r.reason ==
          "rank 3 (local rank 1 on node 10.0.0.2, group rank 1) exited with code 7: "
          "CUDA error (restart 1/2)");
  }
  CHECK(f.state().restarts_used() == 1);
  f.join(node(1), c);
  auto b = f.join(node(2), c);
  REQUIRE(of<SendAssignment>(b).size() == 2);
  CHECK(assignment_of(b, node(1).id).restart_count == 1);
  CHECK(assignment_of(b, node(1).id).max_restarts == 2);
  CHECK(assignment_of(b, node(1).id).round == 1);

  SECTION("stale reports for the ended round are ignored") {
    CHECK(f.reg.worker_failed(f.job, w, f.clock.now()).empty());
    CHECK(f.reg.succeeded(f.job, node(1).id, 0, f.clock.now()).empty());
    CHECK(f.state().restarts_used() == 1);
  }
  SECTION("reports from non-members and unknown jobs are ignored") {
    WorkerFailure x{1, node(8).id, 0, 0, 1, std::nullopt, ""};
    CHECK(f.reg.worker_failed(f.job, x, f.clock.now()).empty());
    CHECK(f.reg.worker_failed("other", x, f.clock.now()).empty());
  }
}

TEST_CASE("a spent budget fails the job with the failing rank's exit code", "[rdzv]") {
  Fixture f;
  const auto c = cfg(2, 2, 1);
  f.join(node(1), c);
  f.join(node(2), c);
  // Restart 1/1.
  f.reg.worker_failed(f.job, WorkerFailure{0, node(1).id, 0, 0, 1, std::nullopt, ""}, f.clock.now());
  f.join(node(1), c);
  f.join(node(2), c);
  REQUIRE(f.state().state() == JobState::running);

  SECTION("exit code") {
    WorkerFailure w{1, node(2).id, 3, 1, 42, std::nullopt, "boom"};
    auto a = f.reg.worker_failed(f.job, w, f.clock.now());
    auto failed = of<SendJobFailed>(a);
    REQUIRE(failed.size() == 2);
    for (const auto& x : failed) {
      CHECK(x.exit_code == 42);
      REQUIRE(x.root_cause.has_value());
      CHECK(x.root_cause->failure.global_rank == 3);
      CHECK(x.root_cause->node_addr == "10.0.0.2");
      CHECK(x.reason ==
            "rank 3 (local rank 1 on node 10.0.0.2, group rank 1) exited with code "
            "42: boom; the restart budget is spent (1/1 restarts used)");
    }
    CHECK(f.state().state() == JobState::failed);
    // First failure wins: a second report is stale and does not change the result.
    WorkerFailure later{1, node(1).id, 0, 0, 9, std::nullopt, ""};
    auto b = f.reg.worker_failed(f.job, later, f.clock.now());
    CHECK(of<SendJobFailed>(b).empty());
    // A late agent asking learns the stored result.
    auto hb = f.reg.heartbeat(f.job, node(1).id, f.clock.now());
    REQUIRE(of<SendJobFailed>(hb).size() == 1);
    CHECK(of<SendJobFailed>(hb)[0].exit_code == 42);
  }
  SECTION("signal -> 128 + signal") {
    WorkerFailure w{1, node(1).id, 1, 1, std::nullopt, 9, ""};
    auto a = f.reg.worker_failed(f.job, w, f.clock.now());
    auto failed = of<SendJobFailed>(a);
    REQUIRE(failed.size() == 2);
    CHECK(failed[0].exit_code == 137);
    CHECK(failed[0].reason.find("was killed by signal 9") != std::string::npos);
  }
}

TEST_CASE("max_restarts 0: the first failure fails the job", "[rdzv]") {
  Fixture f;
  f.join(node(1), cfg(1, 1));
  auto a = f.reg.worker_failed(f.job, WorkerFailure{0, node(1).id, 0, 0, 0, std::nullopt, ""}, f.clock.now());
  REQUIRE(of<SendJobFailed>(a).size() == 1);
  CHECK(of<SendJobFailed>(a)[0].exit_code == 1);  // exit code 0 reported as a failure -> 1
}

TEST_CASE("WorkerFailure::ddprun_exit_code", "[rdzv]") {
  CHECK(WorkerFailure{0, {}, 0, 0, 3, std::nullopt, ""}.ddprun_exit_code() == 3);
  CHECK(WorkerFailure{0, {}, 0, 0, std::nullopt, 15, ""}.ddprun_exit_code() == 143);
  CHECK(WorkerFailure{0, {}, 0, 0, std::nullopt, std::nullopt, ""}.ddprun_exit_code() == 1);
}

TEST_CASE("success: the exit barrier passes when every participant succeeded", "[rdzv]") {
  Fixture f;
  const auto c = cfg(2, 2);
  f.join(node(1), c);
  f.join(node(2), c);
  auto a = f.reg.succeeded(f.job, node(1).id, 0, f.clock.now());
  CHECK(of<SendJobCompleted>(a).empty());
  REQUIRE(for_node<Progress>(a, node(1).id).size() == 1);
  CHECK(for_node<Progress>(a, node(1).id)[0].text == "exit barrier: 1/2 nodes finished, timeout in 300 s");
  CHECK(f.reg.status(f.clock.now()).jobs.at(0).exit_barrier_in == 300s);

  SECTION("complete") {
    f.advance(100s, {node(1), node(2)});
    auto b = f.reg.succeeded(f.job, node(2).id, 0, f.clock.now());
    REQUIRE(of<SendJobCompleted>(b).size() == 2);
    CHECK(f.state().state() == JobState::completed);
    // Kept for close_timeout so late agents learn the result, then collected.
    CHECK(f.reg.next_deadline() == f.clock.now() + 30s);
    f.clock.advance(29s);
    f.tick();
    auto late = f.reg.heartbeat(f.job, node(2).id, f.clock.now());
    REQUIRE(of<SendJobCompleted>(late).size() == 1);
    auto stranger = f.join(node(5), c);
    REQUIRE(of<Refuse>(stranger).size() == 1);
    CHECK(of<Refuse>(stranger)[0].reason.find("already completed") != std::string::npos);
    f.clock.advance(1s);
    f.tick();
    CHECK(f.reg.find(f.job) == nullptr);
    CHECK(f.reg.job_count() == 0);
    CHECK_FALSE(f.reg.next_deadline().has_value());
  }
  SECTION("a node that already succeeded may vanish without ending the round") {
    f.clock.advance(3s);
    f.beat({node(2)});
    auto b = f.tick();
    CHECK(of<SendRestart>(b).empty());
    auto d = f.reg.succeeded(f.job, node(2).id, 0, f.clock.now());
    REQUIRE(of<SendJobCompleted>(d).size() == 1);
  }
  SECTION("barrier timeout fails the job with a named error") {
    auto b = f.advance(299s, {node(1), node(2)});
    CHECK(of<SendJobFailed>(b).empty());
    auto d = f.advance(1s, {node(1), node(2)});
    auto failed = of<SendJobFailed>(d);
    REQUIRE(failed.size() == 2);
    CHECK(failed[0].reason ==
          "rendezvous 'job7': exit barrier timed out after 300 s: 1/2 nodes "
          "finished; still running: group rank 1 on 10.0.0.2");
    CHECK(failed[0].exit_code == kRendezvousFailureExitCode);
  }
  SECTION("a failure during the barrier restarts everyone") {
    auto b = f.reg.worker_failed(f.job, WorkerFailure{0, node(2).id, 2, 0, 1, std::nullopt, ""}, f.clock.now());
    REQUIRE(of<SendJobFailed>(b).size() == 2);  // budget 0 here
  }
}

TEST_CASE("slots freed while running go to the spares in their order, then to a new node", "[rdzv]") {
  Fixture f;
  const auto c = cfg(1, 3, 1);
  for (int i = 1; i <= 3; ++i) f.join(node(i), c);
  REQUIRE(f.state().state() == JobState::running);
  auto role = [&](int i) { return f.state().role_of(node(i).id); };
  f.join(node(4), c);
  f.clock.advance(10ms);
  f.join(node(5), c);
  REQUIRE(role(4) == MemberRole::spare);
  REQUIRE(role(5) == MemberRole::spare);
  // Two participants finish and leave: two free slots, nothing restarts yet.
  for (int i : {2, 3}) {
    f.reg.succeeded(f.job, node(i).id, f.state().round(), f.clock.now());
    CHECK(of<SendRestart>(f.reg.leave(f.job, node(i).id, f.clock.now())).empty());
  }
  SECTION("two spares, two slots: both spares take part, the new node waits") {
    auto a = f.join(node(6), c);
    CHECK(role(4) == MemberRole::joined);
    CHECK(role(5) == MemberRole::joined);
    CHECK(role(6) == MemberRole::spare);
    REQUIRE(for_node<SendRestart>(a, node(1).id).size() == 1);
    CHECK(for_node<SendRestart>(a, node(1).id)[0].reason.find("2 spare node(s) took the free slots") !=
          std::string::npos);
    auto closed = f.join(node(1), c);
    CHECK(of<SendAssignment>(closed).size() == 3);
    CHECK(for_node<SendAssignment>(closed, node(6).id).empty());
    CHECK(f.state().audit().empty());
  }
  SECTION("one spare, two slots: the spare and the new node take part") {
    f.reg.leave(f.job, node(5).id, f.clock.now());  // a spare that gives up
    auto a = f.join(node(6), c);
    CHECK(role(4) == MemberRole::joined);
    CHECK(role(6) == MemberRole::joined);
    CHECK(for_node<SendRestart>(a, node(1).id).size() == 1);
    auto closed = f.join(node(1), c);
    CHECK(of<SendAssignment>(closed).size() == 3);
    CHECK(f.state().audit().empty());
  }
}

TEST_CASE("daemon restart: a spare that re-registers first does not end the running round", "[rdzv]") {
  Fixture f;
  const auto c = cfg(2, 2, 1);
  f.join(node(1), c);
  auto closed = f.join(node(2), c);
  const Assignment a1 = assignment_of(closed, node(1).id);
  const Assignment a2 = assignment_of(closed, node(2).id);
  f.join(node(3), c);
  REQUIRE(f.state().role_of(node(3).id) == MemberRole::spare);

  // The daemon restarts; the spare (no assignment) is first back and makes a fresh job.
  RendezvousRegistry fresh;
  auto s = fresh.rejoin(f.job, RejoinRequest{node(3), c, {}, std::nullopt}, f.clock.now());
  REQUIRE(fresh.find(f.job)->state() == JobState::waiting);
  CHECK(of<SendAssignment>(s).empty());
  // A participant with its assignment rebuilds the running round; the spare is a spare again.
  auto r1 = fresh.rejoin(f.job, RejoinRequest{node(1), c, {}, a1}, f.clock.now());
  CHECK(of<SendRestart>(r1).empty());
  REQUIRE(fresh.find(f.job)->state() == JobState::running);
  CHECK(fresh.find(f.job)->role_of(node(3).id) == MemberRole::spare);
  REQUIRE(for_node<Progress>(r1, node(3).id).size() == 1);
  CHECK(for_node<Progress>(r1, node(3).id)[0].text.find("waiting as a spare node") != std::string::npos);
  auto r2 = fresh.rejoin(f.job, RejoinRequest{node(2), c, {}, a2}, f.clock.now());
  CHECK(of<SendRestart>(r2).empty());
  CHECK(fresh.find(f.job)->role_of(node(2).id) == MemberRole::participant);
  CHECK(fresh.find(f.job)->round() == a1.round);
  CHECK(fresh.find(f.job)->audit().empty());

  SECTION("a spare whose connection closed before the rebuild is still on its short lease after it") {
    RendezvousRegistry again;
    again.rejoin(f.job, RejoinRequest{node(3), c, {}, std::nullopt}, f.clock.now());
    again.disconnected(f.job, node(3).id, f.clock.now());
    f.clock.advance(100ms);
    auto r = again.rejoin(f.job, RejoinRequest{node(1), c, {}, a1}, f.clock.now());
    REQUIRE(again.find(f.job)->state() == JobState::running);
    const auto st = again.status_of(f.job, f.clock.now());
    REQUIRE(st);
    bool seen = false;
    for (const auto& m : st->members) {
      if (m.id != node(3).id) continue;
      seen = true;
      CHECK(m.role == MemberRole::spare);
      CHECK(m.disconnected);
      CHECK(m.lease_left <= c.heartbeat_interval);
    }
    CHECK(seen);
    // Silent past that lease, it is dropped; the rebuilt round goes on.
    f.clock.advance(c.heartbeat_interval);
    again.heartbeat(f.job, node(1).id, f.clock.now());
    auto t = again.on_tick(f.clock.now());
    CHECK(of<SendRestart>(t).empty());
    CHECK(again.find(f.job)->role_of(node(3).id) == std::nullopt);
  }
  SECTION("a participant whose config differs from the fresh job's is refused") {
    RendezvousRegistry again;
    JobConfig roomy = cfg(1, 3, 1);
    roomy.min_nodes = 1;
    // (its config must match the rebuilding participant's: a mismatch is refused)
    auto m = again.rejoin(f.job, RejoinRequest{node(3), roomy, {}, std::nullopt}, f.clock.now());
    CHECK(of<Refuse>(m).empty());
    auto r = again.rejoin(f.job, RejoinRequest{node(1), c, {}, a1}, f.clock.now());
    REQUIRE(of<Refuse>(r).size() == 1);
    CHECK(of<Refuse>(r)[0].code == RefuseCode::config_mismatch);
  }
}

TEST_CASE("daemon restart: a spare alone enough to close a round waits for the participants", "[rdzv]") {
  // --nnodes 1 and one spare: the spare re-registers first and would fill the fresh job.
  Fixture f;
  const auto c = cfg(1, 1, 1);
  const Assignment a1 = assignment_of(f.join(node(1), c), node(1).id);
  f.join(node(2), c);
  REQUIRE(f.state().role_of(node(2).id) == MemberRole::spare);
  RendezvousRegistry fresh;
  auto s = fresh.rejoin(f.job, RejoinRequest{node(2), c, {}, std::nullopt}, f.clock.now());
  CHECK(of<SendAssignment>(s).empty());  // held for rebuild_grace, although J = max
  REQUIRE(fresh.find(f.job)->state() == JobState::waiting);
  auto beat = [&](const std::vector<NodeInfo>& nodes) {
    for (const auto& n : nodes) fresh.heartbeat(f.job, n.id, f.clock.now());
  };

  SECTION("the participant comes back within the grace: its round goes on, the spare waits") {
    f.clock.advance(2s);
    beat({node(2)});
    CHECK(fresh.on_tick(f.clock.now()).empty());
    auto r = fresh.rejoin(f.job, RejoinRequest{node(1), c, {}, a1}, f.clock.now());
    CHECK(of<SendRestart>(r).empty());
    CHECK(of<SendAssignment>(r).empty());
    CHECK(fresh.find(f.job)->state() == JobState::running);
    CHECK(fresh.find(f.job)->role_of(node(2).id) == MemberRole::spare);
  }
  SECTION("it does not: after the grace the spare's round closes") {
    Decisions all;
    for (int i = 0; i < 10; ++i) {
      f.clock.advance(1s);
      beat({node(2)});
      auto t = fresh.on_tick(f.clock.now());
      all.insert(all.end(), t.begin(), t.end());
    }
    CHECK(for_node<SendAssignment>(all, node(2).id).size() == 1);
    // The old participant, back too late, has a stale round: told to restart, as before.
    auto r = fresh.rejoin(f.job, RejoinRequest{node(1), c, {}, a1}, f.clock.now());
    CHECK(for_node<SendRestart>(r, node(1).id).size() == 1);
  }
}

TEST_CASE("the hold after a daemon restart: no past deadline, and the join window starts after it", "[rdzv]") {
  Fixture f;
  JobConfig c = cfg(2, 2);
  c.join_timeout = 5s;  // shorter than rebuild_grace (10 s)
  f.reg.rejoin(f.job, RejoinRequest{node(1), c, {}, std::nullopt}, f.clock.now());
  for (int i = 0; i < 14; ++i) {
    f.clock.advance(1s);
    f.beat({node(1)});
    CHECK(f.tick().empty());
    const auto next = f.reg.next_deadline();
    REQUIRE(next.has_value());
    CHECK(*next > f.clock.now());  // a deadline in the past would make the daemon's timer spin
  }
  CHECK(f.state().state() == JobState::waiting);  // 10 s hold + 5 s join window: not over yet
  f.clock.advance(1s);
  f.beat({node(1)});
  auto t = f.tick();
  CHECK(f.state().state() == JobState::failed);
  CHECK(for_node<SendJobFailed>(t, node(1).id).size() == 1);
}

TEST_CASE("a rejoin with an assignment does not rebuild a job that was created by a join", "[rdzv]") {
  // A stale agent (an older run with the same id) meets a new job collecting its first round.
  Fixture f;
  const auto c = cfg(2, 2);
  Assignment old;
  old.round = 4;
  old.group_rank = 0;
  old.group_world_size = 2;
  old.local_world_size = 1;
  old.world_size = 2;
  f.join(node(2), c);
  auto r = f.reg.rejoin(f.job, RejoinRequest{node(1), c, {}, old}, f.clock.now());
  CHECK(for_node<SendRestart>(r, node(1).id).size() == 1);
  CHECK(f.state().state() == JobState::waiting);
  CHECK(f.state().round() == 0);
}

TEST_CASE("spares take the slots of survivors that do not re-join within the last call", "[rdzv]") {
  Fixture f;
  const auto c = cfg(2, 2, 1);
  f.join(node(1), c);
  f.join(node(2), c);
  f.join(node(3), c);  // spare
  f.reg.worker_failed(f.job, WorkerFailure{0, node(1).id, 0, 0, 1, std::nullopt, ""}, f.clock.now());
  f.join(node(1), c);  // node 2 stays alive (heartbeats) but never re-joins: hung
  REQUIRE(f.state().role_of(node(2).id) == MemberRole::expected);
  auto early = f.advance(29s, {node(1), node(2), node(3)});
  CHECK(of<SendAssignment>(early).empty());
  auto closed = f.advance(2s, {node(1), node(2), node(3)});
  CHECK(for_node<SendAssignment>(closed, node(3).id).size() == 1);
  CHECK(for_node<SendAssignment>(closed, node(1).id).size() == 1);
  CHECK(f.state().role_of(node(2).id) == MemberRole::late);
  CHECK(f.state().audit().empty());
}

TEST_CASE("daemon restart: agents rebuild the running job with rejoin", "[rdzv]") {
  Fixture f;
  const auto c = cfg(2, 3, 5);
  f.join(node(1), c);
  f.join(node(2), c);
  f.advance(30s, {node(1), node(2)});
  REQUIRE(f.state().state() == JobState::running);
  f.reg.worker_failed(f.job, WorkerFailure{0, node(1).id, 0, 0, 1, std::nullopt, ""}, f.clock.now());
  f.join(node(1), c);
  f.join(node(2), c);
  REQUIRE(f.state().round() == 1);
  REQUIRE(f.state().state() == JobState::running);
  auto round1 = f.join(node(3), c);  // scale-up: round 1 ends, round 2 collects
  f.join(node(1), c);
  auto closed = f.join(node(2), c);
  const Assignment a1 = assignment_of(closed, node(1).id);
  const Assignment a2 = assignment_of(closed, node(2).id);
  const Assignment a3 = assignment_of(closed, node(3).id);
  REQUIRE(a1.round == 2);
  REQUIRE(a1.restart_count == 1);

  // The daemon restarts: a fresh registry.
  RendezvousRegistry fresh;
  auto r1 = fresh.rejoin(f.job, RejoinRequest{node(2), c, {}, a2}, f.clock.now());
  REQUIRE(for_node<Progress>(r1, node(2).id).size() == 1);
  const RendezvousJob* job = fresh.find(f.job);
  REQUIRE(job != nullptr);
  CHECK(job->state() == JobState::running);
  CHECK(job->round() == 2);
  CHECK(job->restarts_used() == 1);
  CHECK(fresh.status(f.clock.now()).jobs.at(0).rebuild_in == 10s);

  SECTION("every rank comes back: the job keeps running") {
    fresh.rejoin(f.job, RejoinRequest{node(1), c, {}, a1}, f.clock.now());
    auto r3 = fresh.rejoin(f.job, RejoinRequest{node(3), c, {}, a3}, f.clock.now());
    CHECK(of<SendRestart>(r3).empty());
    CHECK_FALSE(fresh.status(f.clock.now()).jobs.at(0).rebuild_in.has_value());
    // The rebuilt job is fully functional: success needs all three.
    fresh.succeeded(f.job, node(1).id, 2, f.clock.now());
    fresh.succeeded(f.job, node(2).id, 2, f.clock.now());
    auto done = fresh.succeeded(f.job, node(3).id, 2, f.clock.now());
    CHECK(of<SendJobCompleted>(done).size() == 3);
  }
  SECTION("a rank that never comes back ends the round as a membership change") {
    fresh.rejoin(f.job, RejoinRequest{node(1), c, {}, a1}, f.clock.now());
    // Success of the present ranks is not enough while a rank is missing.
    fresh.succeeded(f.job, node(1).id, 2, f.clock.now());
    CHECK(of<SendJobCompleted>(fresh.succeeded(f.job, node(2).id, 2, f.clock.now())).empty());
    f.clock.advance(2s);
    fresh.heartbeat(f.job, node(1).id, f.clock.now());
    fresh.heartbeat(f.job, node(2).id, f.clock.now());
    CHECK(fresh.next_deadline() == f.clock.now() + 3s);
    for (int i = 0; i < 8; ++i) {
      f.clock.advance(1s);
      fresh.heartbeat(f.job, node(1).id, f.clock.now());
      fresh.heartbeat(f.job, node(2).id, f.clock.now());
      auto t = fresh.on_tick(f.clock.now());
      if (i < 7) {
        CHECK(t.empty());
      } else {
        auto r = of<SendRestart>(t);
        REQUIRE(r.size() == 2);
        CHECK(r[0].reason ==
              "group ranks 2 of round 2 did not re-register within 10 s after "
              "the daemon restarted");
      }
    }
  }
  SECTION("an inconsistent rejoin is told to restart") {
    Assignment wrong = a3;
    wrong.round = 1;
    auto r = fresh.rejoin(f.job, RejoinRequest{node(3), c, {}, wrong}, f.clock.now());
    REQUIRE(for_node<SendRestart>(r, node(3).id).size() == 1);
    Assignment taken = a3;
    taken.group_rank = 1;  // node 2 already holds it
    auto r2 = fresh.rejoin(f.job, RejoinRequest{node(3), c, {}, taken}, f.clock.now());
    REQUIRE(for_node<SendRestart>(r2, node(3).id).size() == 1);
  }
  SECTION("a heartbeat before the rejoin asks for it") {
    RendezvousRegistry empty;
    auto hb = empty.heartbeat(f.job, node(1).id, f.clock.now());
    REQUIRE(of<AskRejoin>(hb).size() == 1);
    auto hb2 = fresh.heartbeat(f.job, node(1).id, f.clock.now());
    REQUIRE(of<AskRejoin>(hb2).size() == 1);
  }
  (void)round1;
}

TEST_CASE("rejoin on a live daemon: missed pushes are re-sent", "[rdzv]") {
  Fixture f;
  const auto c = cfg(2, 2, 1);
  f.join(node(1), c);
  auto a = f.join(node(2), c);
  const Assignment a2 = assignment_of(a, node(2).id);

  SECTION("missed assignment") {
    auto r = f.reg.rejoin(f.job, RejoinRequest{node(2), c, {}, std::nullopt}, f.clock.now());
    CHECK(assignment_of(r, node(2).id) == a2);
  }
  SECTION("missed restart") {
    f.reg.worker_failed(f.job, WorkerFailure{0, node(1).id, 0, 0, 1, std::nullopt, ""}, f.clock.now());
    auto r = f.reg.rejoin(f.job, RejoinRequest{node(2), c, {}, a2}, f.clock.now());
    auto restarts = for_node<SendRestart>(r, node(2).id);
    REQUIRE(restarts.size() == 1);
    CHECK(restarts[0].ended_round == 0);
    // A rejoin without an assignment from an expected node is its join.
    auto j = f.reg.rejoin(f.job, RejoinRequest{node(2), c, {}, std::nullopt}, f.clock.now());
    CHECK(of<Progress>(j).size() == 1);
  }
  SECTION("a participant that joins again while running starts a new round") {
    auto j = f.join(node(2), c);
    REQUIRE(for_node<SendRestart>(j, node(1).id).size() == 1);
    CHECK(for_node<SendRestart>(j, node(2).id).empty());
    auto k = f.join(node(1), c);
    REQUIRE(of<SendAssignment>(k).size() == 2);
    CHECK(assignment_of(k, node(2).id).group_rank == 1);
    CHECK(f.state().restarts_used() == 0);
  }
}

TEST_CASE("config and request checks refuse with a clear reason", "[rdzv]") {
  ManualClock clock;
  RendezvousRegistry reg;
  reg.join("j", JoinRequest{node(1), cfg(2, 4, 3)}, clock.now());
  auto mism = reg.join("j", JoinRequest{node(2), cfg(2, 3, 1)}, clock.now());
  REQUIRE(of<Refuse>(mism).size() == 1);
  CHECK(of<Refuse>(mism)[0].reason ==
        "configuration mismatch for rendezvous 'j': --nnodes: the job has 2:4, this node asked "
        "for 2:3; --max-restarts: the job has 3, this node asked for 1 (start every node with "
        "the same values)");

  JobConfig invalid = cfg(3, 2);
  auto inv = reg.join("k", JoinRequest{node(1), invalid}, clock.now());
  REQUIRE(of<Refuse>(inv).size() == 1);
  CHECK(of<Refuse>(inv)[0].reason ==
        "invalid configuration for rendezvous 'k': max_nodes (2) must be >= min_nodes (3)");
  JobConfig zero = cfg(1, 1);
  zero.heartbeat_interval = ddprun::Duration::zero();
  CHECK(zero.validate() == "heartbeat_interval must be > 0, got 0 s");
  NodeInfo no_procs = node(1, 0);
  auto np = reg.join("k", JoinRequest{no_procs, cfg(1, 1)}, clock.now());
  REQUIRE(of<Refuse>(np).size() == 1);
  CHECK(reg.rejoin("", RejoinRequest{node(1), cfg(1, 1), "s3cret", std::nullopt}, clock.now()).size() == 1);
}

TEST_CASE("close refuses new nodes; an empty closed job is collected", "[rdzv]") {
  Fixture f;
  const auto c = cfg(1, 3);
  f.join(node(1), c);
  f.reg.close(f.job, f.clock.now());
  auto a = f.join(node(2), c);
  REQUIRE(of<Refuse>(a).size() == 1);
  CHECK(of<Refuse>(a)[0].reason == "rendezvous 'job7' is closed: it accepts no new nodes (pick a new --rdzv-id)");
  CHECK(f.reg.status(f.clock.now()).jobs.at(0).closed);
  // The existing member still works: it can leave, after which the job is collected.
  f.reg.leave(f.job, node(1).id, f.clock.now());
  CHECK(f.reg.next_deadline() == f.clock.now() + 30s);
  f.clock.advance(30s);
  f.tick();
  CHECK(f.reg.job_count() == 0);
  CHECK(f.reg.close("unknown", f.clock.now()).empty());
}

TEST_CASE("leave of a participant is a membership change", "[rdzv]") {
  Fixture f;
  const auto c = cfg(1, 2);
  f.join(node(1), c);
  f.join(node(2), c);
  auto a = f.reg.leave(f.job, node(2).id, f.clock.now());
  auto r = for_node<SendRestart>(a, node(1).id);
  REQUIRE(r.size() == 1);
  CHECK(r[0].reason == "node 10.0.0.2 (10.0.0.2:1002/inst2) left");
  // Node 1 is the only survivor: its join closes the round at once.
  auto b = f.join(node(1), c);
  CHECK(assignment_of(b, node(1).id).group_world_size == 1);
}

TEST_CASE("next_deadline is the earliest pending timer", "[rdzv]") {
  Fixture f;
  JobConfig c = cfg(2, 3);
  c.heartbeat_interval = 100s;  // leases far away so the round timers show
  CHECK_FALSE(f.reg.next_deadline().has_value());
  const auto t0 = f.clock.now();
  f.join(node(1), c);
  CHECK(f.reg.next_deadline() == t0 + 300s);  // lease 100 s x 3 < join timeout 600 s
  f.clock.advance(10s);
  f.join(node(2), c);
  CHECK(f.reg.next_deadline() == f.clock.now() + 30s);  // last call
  f.clock.advance(30s);
  f.tick();
  REQUIRE(f.state().state() == JobState::running);
  CHECK(f.reg.next_deadline() == t0 + 300s);  // node 1's lease
  f.reg.succeeded(f.job, node(1).id, 0, f.clock.now());
  // node 1 refreshed by its report: node 2's lease (t0 + 10 s + 300 s) is next, before the barrier
  CHECK(f.reg.next_deadline() == t0 + 310s);
  f.reg.heartbeat(f.job, node(2).id, f.clock.now());
  CHECK(f.reg.next_deadline() == f.clock.now() + 300s);  // leases and barrier tie
  f.reg.succeeded(f.job, node(2).id, 0, f.clock.now());
  CHECK(f.reg.next_deadline() == f.clock.now() + 30s);  // GC only

  // Several jobs: the registry returns the minimum.
  JobConfig quick = cfg(1, 1);
  f.reg.join("other", JoinRequest{node(7), quick}, f.clock.now());
  CHECK(f.reg.next_deadline() == f.clock.now() + 3s);
}

TEST_CASE("jobs are isolated by run id", "[rdzv]") {
  Fixture f;
  f.reg.join("a", JoinRequest{node(1), cfg(2, 2)}, f.clock.now());
  auto b = f.reg.join("b", JoinRequest{node(2), cfg(1, 1)}, f.clock.now());
  REQUIRE(of<SendAssignment>(b).size() == 1);
  CHECK(of<SendAssignment>(b)[0].run_id == "b");
  CHECK(f.reg.find("a")->state() == JobState::waiting);
  CHECK(f.reg.find("b")->state() == JobState::running);
  // Same node id in two jobs is two memberships (in "b", which is full, a spare).
  auto c = f.reg.join("b", JoinRequest{node(1), cfg(1, 1)}, f.clock.now());
  CHECK(of<Refuse>(c).empty());
  CHECK(f.reg.find("b")->role_of(node(1).id) == MemberRole::spare);
  CHECK(f.reg.find("a")->role_of(node(1).id) == MemberRole::joined);
  CHECK(f.reg.find("a")->state() == JobState::waiting);
}

TEST_CASE("status lists jobs, members, roles and timers", "[rdzv]") {
  Fixture f;
  const auto c = cfg(2, 3, 4);
  f.join(node(1, 4), c);
  f.clock.advance(1s);
  f.join(node(2, 2), c);
  f.clock.advance(2s);
  f.beat({node(2)});
  f.clock.advance(500ms);
  auto st = f.reg.status(f.clock.now());
  REQUIRE(st.jobs.size() == 1);
  const JobStatus& j = st.jobs[0];
  CHECK(j.run_id == "job7");
  CHECK(j.state == JobState::waiting);
  CHECK(std::string(to_string(j.state)) == "waiting");
  CHECK(j.round == 0);
  CHECK(j.min_nodes == 2);
  CHECK(j.max_nodes == 3);
  CHECK(j.restarts_used == 0);
  CHECK(j.max_restarts == 4);
  CHECK(j.last_call_in == 27500ms);
  CHECK(j.progress == "waiting for nodes: 2/2 joined (min 2, max 3), last call in 27.5 s");
  REQUIRE(j.members.size() == 2);
  CHECK(j.members[0].id == node(1).id);
  CHECK(j.members[0].role == MemberRole::joined);
  CHECK(j.members[0].group_rank == -1);
  CHECK(j.members[0].last_heartbeat_age == 3500ms);
  CHECK(j.members[0].local_world_size == 4);
  CHECK(j.members[1].last_heartbeat_age == 500ms);
  CHECK(j.members[1].lease_left == 2500ms);

  f.clock.advance(27500ms);
  f.beat({node(1), node(2)});
  f.tick();
  auto st2 = f.reg.status(f.clock.now()).jobs.at(0);
  CHECK(st2.state == JobState::running);
  CHECK(st2.members[0].role == MemberRole::participant);
  CHECK(st2.members[0].group_rank == 0);
  CHECK(st2.members[1].group_rank == 1);
  CHECK(st2.progress == "running round 0 with 2 nodes (restarts 0/4)");
  f.reg.worker_failed(f.job, WorkerFailure{0, node(2).id, 5, 1, 3, std::nullopt, "x"}, f.clock.now());
  auto st3 = f.reg.status(f.clock.now()).jobs.at(0);
  CHECK(st3.restarts_used == 1);
  CHECK(st3.round == 1);
  REQUIRE(st3.last_failure.has_value());
  CHECK(st3.last_failure->failure.global_rank == 5);
  CHECK(st3.members[0].role == MemberRole::expected);
  CHECK(st3.join_timeout_in == 600s);
  CHECK(st3.progress == "waiting for nodes: 0/2 joined (min 2, max 3), join timeout in 600 s");
}

TEST_CASE("format_seconds", "[rdzv]") {
  CHECK(format_seconds(600s) == "600 s");
  CHECK(format_seconds(2500ms) == "2.5 s");
  CHECK(format_seconds(250ms) == "0.25 s");
  CHECK(format_seconds(0s) == "0 s");
}

TEST_CASE("remaining branches: late node refused when full, late lease expiry, rejoin corners", "[rdzv]") {
  Fixture f;
  const auto c = cfg(1, 2);
  f.join(node(1), c);
  f.join(node(2), c);
  REQUIRE(f.state().state() == JobState::running);
  // node 2 leaves -> round 1; node 1 back at once (roster complete); then node 3 fills the job.
  f.reg.leave(f.job, node(2).id, f.clock.now());
  auto a = f.join(node(1), c);
  REQUIRE(of<SendAssignment>(a).size() == 1);

  SECTION("late node whose lease expires is dropped without ending the round") {
    // Make node 3 late: round 1 running with node 1; node 3 joins (scale-up), node 1 is then
    // expected but misses the last call.
    f.join(node(3), c);  // ends round 1; node 1 expected
    auto b = f.advance(30s, {node(1), node(3)});
    REQUIRE(of<SendAssignment>(b).size() == 1);  // node 3 alone
    CHECK(f.reg.status(f.clock.now()).jobs.at(0).members.at(1).role == MemberRole::late);
    f.clock.advance(3s);
    f.beat({node(3)});
    auto d = f.tick();
    CHECK(of<SendRestart>(d).empty());
    CHECK(f.reg.status(f.clock.now()).jobs.at(0).members.size() == 1);
  }
  SECTION("a late node waits as a spare when the job is full, and is refused and forgotten beyond max spares") {
    f.join(node(3), c);                  // round 2 collects: node 3 joined, node 1 expected
    f.advance(30s, {node(1), node(3)});  // node 3 alone; node 1 late
    auto b = f.join(node(4), c);         // room: 1 participant < 2 -> round 3
    REQUIRE(of<SendRestart>(b).size() == 1);
    auto e = f.join(node(3), c);  // J = 2 (nodes 3, 4) = max: closes without node 1
    REQUIRE(of<SendAssignment>(e).size() == 2);
    f.join(node(5), c);           // spares: 5
    f.join(node(6), c);           // spares: 5, 6 = max
    auto d = f.join(node(1), c);  // late, the job is full and so are the spares: refused and forgotten
    REQUIRE(for_node<Refuse>(d, node(1).id).size() == 1);
    CHECK(for_node<Refuse>(d, node(1).id)[0].reason.find("is full: 2 of max 2") != std::string::npos);
    CHECK(of<SendRestart>(d).empty());
    CHECK(f.reg.status(f.clock.now()).jobs.at(0).members.size() == 4);
  }
  SECTION("rejoin corners") {
    // Unknown job without an assignment: a join that creates it, after rebuild_grace (the daemon
    // restarted: the nodes of a running round may still re-register).
    auto b = f.reg.rejoin("fresh", RejoinRequest{node(5), cfg(1, 1), {}, std::nullopt}, f.clock.now());
    CHECK(of<SendAssignment>(b).empty());
    REQUIRE(f.reg.find("fresh")->awaiting_rebuild(f.clock.now()));
    REQUIRE(f.reg.next_deadline() == f.clock.now() + 3s);  // node 5's lease comes first
    Decisions held;
    for (int i = 0; i < 10; ++i) {
      f.clock.advance(1s);
      f.reg.heartbeat("fresh", node(5).id, f.clock.now());
      f.beat({node(1)});
      auto t = f.tick();
      held.insert(held.end(), t.begin(), t.end());
    }
    REQUIRE(for_node<SendAssignment>(held, node(5).id).size() == 1);
    // Unknown job with a nonsense assignment: refused.
    Assignment bad;
    bad.group_rank = 3;
    bad.group_world_size = 2;
    auto d = f.reg.rejoin("fresh2", RejoinRequest{node(5), cfg(1, 1), {}, bad}, f.clock.now());
    REQUIRE(of<Refuse>(d).size() == 1);
    CHECK(of<Refuse>(d)[0].reason.find("inconsistent assignment (group rank 3 of 2") != std::string::npos);
    // Finished job: the final result.
    f.reg.succeeded("fresh", node(5).id, 0, f.clock.now());
    auto e = f.reg.rejoin("fresh", RejoinRequest{node(5), cfg(1, 1), {}, std::nullopt}, f.clock.now());
    REQUIRE(of<SendJobCompleted>(e).size() == 1);
    // Disconnect for unknown jobs/nodes is a no-op.
    CHECK(f.reg.disconnected("nope", node(1).id, f.clock.now()).empty());
    CHECK(f.reg.disconnected(f.job, node(9).id, f.clock.now()).empty());
    CHECK(f.reg.leave(f.job, node(9).id, f.clock.now()).empty());
  }
}

TEST_CASE("rejoin of a node that is waiting in the collecting round reports progress", "[rdzv]") {
  Fixture f;
  f.join(node(1), cfg(2, 2));
  auto a = f.reg.rejoin(f.job, RejoinRequest{node(1), cfg(2, 2), {}, std::nullopt}, f.clock.now());
  REQUIRE(for_node<Progress>(a, node(1).id).size() == 1);
  CHECK(f.reg.status(f.clock.now()).jobs.at(0).members.size() == 1);
}

TEST_CASE("failed job: strangers are refused, status shows the result", "[rdzv]") {
  Fixture f;
  f.join(node(1), cfg(1, 1));
  f.reg.worker_failed(f.job, WorkerFailure{0, node(1).id, 0, 0, std::nullopt, std::nullopt, ""}, f.clock.now());
  auto a = f.join(node(2), cfg(1, 1));
  REQUIRE(of<Refuse>(a).size() == 1);
  CHECK(of<Refuse>(a)[0].reason.find("already failed (rank 0 (local rank 0 on node 10.0.0.1, "
                                     "group rank 0) failed;") != std::string::npos);
  auto st = f.reg.status(f.clock.now()).jobs.at(0);
  CHECK(std::string(to_string(st.state)) == "failed");
  CHECK(st.progress == "failed: " + st.result);
  CHECK(std::string(to_string(st.members.at(0).role)) == "participant");
  CHECK(std::string(to_string(MemberRole::late)) == "late");
  CHECK(std::string(to_string(MemberRole::expected)) == "expected");
  CHECK(std::string(to_string(MemberRole::joined)) == "joined");
  CHECK(std::string(to_string(JobState::completed)) == "completed");
  CHECK(std::string(to_string(JobState::running)) == "running");
  JobConfig bad = cfg(1, 1);
  bad.missed_heartbeats = 0;
  CHECK(bad.validate() == "missed_heartbeats must be >= 1, got 0");
}

TEST_CASE("a join costs O(1) actions however many nodes wait (no N^2 progress)", "[rdzv]") {
  Fixture f;
  const JobConfig c = cfg(5000, 5000);
  std::size_t most = 0;
  for (int i = 1; i < 5000; ++i) {
    const auto a = f.join(node(i), c);
    most = std::max(most, a.size());
  }
  CHECK(most <= 2);  // the joiner's line + one broadcast
  CHECK(f.state().joined_nodes().size() == 4999);
  const auto last = f.join(node(5000), c);  // max reached: everyone gets an assignment
  CHECK(of<SendAssignment>(last).size() == 5000);
}

TEST_CASE("every assignment of a round carries the group-rank-0 node's NCCL IDs", "[rdzv][nccl]") {
  Fixture f;
  const auto c = cfg(3, 3, 1);
  // Distinct IDs per node and per round: byte (10 * node + round), 128 bytes each.
  auto with_ids = [](int i, int round, std::size_t roots = 1) {
    NodeInfo n = node(i);
    n.nccl_ids.assign(128 * roots, static_cast<std::uint8_t>(10 * i + round));
    return n;
  };
  f.join(with_ids(1, 0), c);
  f.join(with_ids(2, 0), c);
  auto a = f.join(with_ids(3, 0), c);
  REQUIRE(of<SendAssignment>(a).size() == 3);
  REQUIRE(assignment_of(a, node(1).id).group_rank == 0);
  for (int i = 1; i <= 3; ++i) {
    CAPTURE(i);
    CHECK(assignment_of(a, node(i).id).nccl_id == with_ids(1, 0).nccl_ids);
  }

  // A worker failure: every node joins the next round with fresh IDs, in reverse order. Rank
  // stability keeps node 1 at group rank 0, so its new IDs (two roots now) are everyone's.
  WorkerFailure w{0, node(2).id, 2, 0, 1, std::nullopt, "boom"};
  REQUIRE(of<SendRestart>(f.reg.worker_failed(f.job, w, f.clock.now())).size() == 3);
  f.join(with_ids(3, 1), c);
  f.join(with_ids(2, 1), c);
  auto b = f.join(with_ids(1, 1, 2), c);
  REQUIRE(of<SendAssignment>(b).size() == 3);
  for (int i = 1; i <= 3; ++i) {
    CAPTURE(i);
    CHECK(assignment_of(b, node(i).id).group_rank == i - 1);
    CHECK(assignment_of(b, node(i).id).nccl_id == with_ids(1, 1, 2).nccl_ids);
    CHECK(assignment_of(b, node(i).id).nccl_id != assignment_of(a, node(i).id).nccl_id);
  }

  SECTION("a rank-0 node without IDs gives every node none") {
    Fixture g;
    g.join(node(1), c);
    g.join(with_ids(2, 0), c);
    auto d = g.join(with_ids(3, 0), c);
    REQUIRE(of<SendAssignment>(d).size() == 3);
    for (const auto& s : of<SendAssignment>(d)) CHECK(s.assignment.nccl_id.empty());
  }
  SECTION("a rejoin after a daemon restart keeps the round's IDs; a different ID is a stale round") {
    Fixture g;
    // The rejoiners' own offers belong to rounds that are over: not kept.
    RejoinRequest r0{with_ids(1, 2, 2), c, {}, assignment_of(b, node(1).id)};
    g.reg.rejoin(g.job, r0, g.clock.now());
    RejoinRequest r1{with_ids(2, 2), c, {}, assignment_of(b, node(2).id)};
    CHECK(of<SendRestart>(g.reg.rejoin(g.job, r1, g.clock.now())).empty());
    CHECK(g.state().member_bytes() ==
          member_footprint(node(1)) + member_footprint(node(2)) + 3 * 2 * 128);  // IDs and hex
    CHECK(g.state().audit().empty());
    RejoinRequest r2{node(3), c, {}, assignment_of(b, node(3).id)};
    r2.assignment->nccl_id = with_ids(3, 1).nccl_ids;
    CHECK(of<SendRestart>(g.reg.rejoin(g.job, r2, g.clock.now())).size() == 1);
    // The re-sent assignment (a missed push) is the stored one, IDs included.
    RejoinRequest again{node(2), c, {}, std::nullopt};
    auto re = g.reg.rejoin(g.job, again, g.clock.now());
    REQUIRE(of<SendAssignment>(re).size() == 1);
    CHECK(of<SendAssignment>(re)[0].assignment.nccl_id == with_ids(1, 1, 2).nccl_ids);
  }
}

namespace {

// Node i's offer of `roots` NCCL IDs for round r: distinct bytes per node and round.
NodeInfo offering(int i, int round, std::size_t roots) {
  NodeInfo n = node(i);
  n.nccl_ids.assign(128 * roots, static_cast<std::uint8_t>(7 * i + round));
  n.nccl_any_rank = true;  // an agent that keeps its holder whenever its offer is chosen
  return n;
}

std::size_t plain_bytes(int first, int last) {
  std::size_t sum = 0;
  for (int i = first; i <= last; ++i) sum += member_footprint(node(i));
  return sum;
}

}  // namespace

TEST_CASE("a job keeps offers of many NCCL IDs only for its likeliest group-rank-0 nodes", "[rdzv][nccl]") {
  // Before: every member kept the IDs its JOIN offered (one per 256 ranks of the largest world
  // the job allows) and every assignment a copy of the round's: O(N x offer) bytes, so a job of
  // 16,000 nodes x 8 GPUs passed --max-member-bytes' 2 GiB with --nccl-id auto.
  constexpr int kKeep = static_cast<int>(RendezvousJob::kOfferKeepers);
  constexpr std::size_t kRoots = 3;
  Fixture f;
  const auto c = cfg(kKeep + 3, kKeep + 3);
  for (int i = 1; i <= kKeep + 2; ++i) {
    REQUIRE(of<SendAssignment>(f.join(offering(i, 0, kRoots), c)).empty());
    CHECK(f.state().audit().empty());
  }
  // The first kKeep joiners' offers are kept, the two after them dropped.
  CHECK(f.state().member_bytes() == plain_bytes(1, kKeep + 2) + kKeep * kRoots * 128);
  CHECK(f.state().footprint_of(node(1).id) == member_footprint(offering(1, 0, kRoots)));
  CHECK(f.state().footprint_of(node(kKeep + 2).id) == member_footprint(node(kKeep + 2)));
  // A node with an order key goes first in the group ranks: its offer displaces the last kept one.
  NodeInfo keyed = offering(kKeep + 3, 0, kRoots);
  keyed.order = 0;
  auto a = f.join(keyed, c);
  CHECK(f.state().audit().empty());
  REQUIRE(of<SendAssignment>(a).size() == static_cast<std::size_t>(kKeep + 3));
  CHECK(assignment_of(a, keyed.id).group_rank == 0);
  const SharedBytes first = of<SendAssignment>(a)[0].assignment.nccl_id;
  CHECK(first == keyed.nccl_ids);
  for (const auto& s : of<SendAssignment>(a)) {
    CHECK(s.assignment.nccl_id == keyed.nccl_ids);
    CHECK(&s.assignment.nccl_id.bytes() == &first.bytes());  // one buffer for the whole round
  }
  // Running: the participants' offers are spent; the job holds the round's IDs once, with their hex.
  CHECK(f.state().member_bytes() == plain_bytes(1, kKeep + 3) + 3 * kRoots * 128);
  CHECK(f.state().audit().empty());
}

TEST_CASE("a rejoining group-rank-0 node's offer is kept first, whenever it rejoins", "[rdzv][nccl]") {
  constexpr int kNodes = static_cast<int>(RendezvousJob::kOfferKeepers) + 2;
  Fixture f;
  const auto c = cfg(kNodes, kNodes, 1);
  Decisions a;
  for (int i = 1; i <= kNodes; ++i) a = f.join(offering(i, 0, 2), c);
  REQUIRE(of<SendAssignment>(a).size() == static_cast<std::size_t>(kNodes));
  CHECK(assignment_of(a, node(1).id).nccl_id == offering(1, 0, 2).nccl_ids);
  WorkerFailure w{0, node(2).id, 2, 0, 1, std::nullopt, "boom"};
  REQUIRE(of<SendRestart>(f.reg.worker_failed(f.job, w, f.clock.now())).size() == static_cast<std::size_t>(kNodes));
  // Back in reverse order: by the time node 1 (group rank 0) rejoins, kOfferKeepers offers are
  // kept and node 2's (group rank 1) was dropped; node 1's displaces one of them.
  Decisions b;
  for (int i = kNodes; i >= 1; --i) {
    b = f.join(offering(i, 1, 2), c);
    CHECK(f.state().audit().empty());
  }
  REQUIRE(of<SendAssignment>(b).size() == static_cast<std::size_t>(kNodes));
  for (int i = 1; i <= kNodes; ++i) {
    CAPTURE(i);
    CHECK(assignment_of(b, node(i).id).group_rank == i - 1);
    CHECK(assignment_of(b, node(i).id).nccl_id == offering(1, 1, 2).nccl_ids);
  }
}

TEST_CASE("where the job dropped rank 0's offer, the round takes the first kept one", "[rdzv][nccl]") {
  constexpr int kKeep = static_cast<int>(RendezvousJob::kOfferKeepers);
  Fixture f;
  const auto c = cfg(1, 64);
  std::vector<NodeInfo> alive;
  for (int i = 1; i <= kKeep + 1; ++i) f.join(offering(i, 0, 2), c);  // node kKeep + 1's offer dropped
  // Every node whose offer was kept leaves before the round closes.
  for (int i = 1; i <= kKeep; ++i) f.reg.leave(f.job, node(i).id, f.clock.now());
  CHECK(f.state().audit().empty());
  alive.push_back(node(kKeep + 1));

  SECTION("a kept offer is left and is the round's, from group rank 1") {
    f.join(offering(kKeep + 2, 0, 2), c);  // room among the keepers again
    alive.push_back(node(kKeep + 2));
    const auto a = f.advance(31s, alive);  // the last call
    REQUIRE(of<SendAssignment>(a).size() == 2);
    CHECK(assignment_of(a, node(kKeep + 1).id).group_rank == 0);
    CHECK(assignment_of(a, node(kKeep + 2).id).group_rank == 1);
    for (const auto& s : of<SendAssignment>(a)) CHECK(s.assignment.nccl_id == offering(kKeep + 2, 0, 2).nccl_ids);
  }
  SECTION("the kept offer left is an older agent's, so the round carries none") {
    // An older agent stops its holder unless it has group rank 0.
    NodeInfo older = offering(kKeep + 2, 0, 2);
    older.nccl_any_rank = false;
    f.join(older, c);
    alive.push_back(node(kKeep + 2));
    const auto a = f.advance(31s, alive);
    REQUIRE(of<SendAssignment>(a).size() == 2);
    for (const auto& s : of<SendAssignment>(a)) CHECK(s.assignment.nccl_id.empty());
  }
  SECTION("no kept offer is left, so the round carries none") {
    const auto a = f.advance(31s, alive);
    REQUIRE(of<SendAssignment>(a).size() == 1);
    CHECK(of<SendAssignment>(a)[0].assignment.nccl_id.empty());
  }
  CHECK(f.state().audit().empty());
}

TEST_CASE("nodes lost in one tick are named a few at a time in the RESTART every survivor gets", "[rdzv]") {
  // Before: the reason listed every lost node, and went to every survivor: a relay that dies
  // under a 100,000-node job loses 16,000 nodes in one tick, megabytes to each of 84,000 nodes.
  Fixture f;
  const auto c = cfg(1, 100);
  std::vector<NodeInfo> all;
  for (int i = 1; i <= 40; ++i) all.push_back(node(i));
  for (const auto& n : all) f.join(n, c);
  f.clock.advance(30s);  // the last call
  f.beat(all);
  f.tick();
  REQUIRE(f.state().state() == JobState::running);
  // 30 of them stop heartbeating; the 10 others go on.
  const std::vector<NodeInfo> alive(all.begin(), all.begin() + 10);
  const auto lost = f.advance(5s, alive);
  const auto restarts = of<SendRestart>(lost);
  REQUIRE(restarts.size() == 10);
  const std::string& reason = restarts.front().reason;
  CHECK(reason.find("and 22 more node(s) lost") != std::string::npos);
  CHECK(reason.size() < 2048);
  CHECK(f.state().member_count() == 10);
}

TEST_CASE("a worker failure's message is cut in the RESTART that goes to every node", "[rdzv]") {
  // Before: the whole message (up to 8 KiB) went into every node's RESTART reason: 800 MB of
  // pushes for one failure in a 100,000-node job.
  Fixture f;
  const auto c = cfg(2, 2, 3);
  f.join(node(1), c);
  f.join(node(2), c);
  REQUIRE(f.state().state() == JobState::running);
  const std::string message(8000, 'm');
  auto a = f.reg.worker_failed(f.job, WorkerFailure{0, node(1).id, 0, 0, 1, std::nullopt, message}, f.clock.now());
  const auto restarts = of<SendRestart>(a);
  REQUIRE(restarts.size() == 2);
  CHECK(restarts.front().reason.size() < 1024);
  CHECK(restarts.front().reason.find("[... 7488 more bytes]") != std::string::npos);
}

TEST_CASE("the root cause JOB_FAILED carries to every node keeps 1 KiB of the message", "[rdzv]") {
  // Before: the whole message (up to 8 KiB) went to every node in JOB_FAILED's root cause, as
  // 100,000 copies of the decision at once for a 100,000-node job. The node where the rank
  // failed prints its own whole copy; the others get the first KiB and where the rest is.
  Fixture f;
  const auto c = cfg(2, 2, 0);
  f.join(node(1), c);
  f.join(node(2), c);
  REQUIRE(f.state().state() == JobState::running);
  // A two-byte character straddles the 1 KiB line: it is dropped whole, never cut in half.
  const std::string message = std::string(1023, 'm') + "\xc3\xa9" + std::string(6000, 'n');
  auto a = f.reg.worker_failed(f.job, WorkerFailure{0, node(1).id, 0, 0, 1, std::nullopt, message}, f.clock.now());
  const auto failed = of<SendJobFailed>(a);
  REQUIRE(failed.size() == 2);
  for (const auto& j : failed) {
    REQUIRE(j.root_cause);
    const std::string& got = j.root_cause->failure.message;
    CHECK(got.rfind(std::string(1023, 'm') + " [... 6002 more bytes, in the failure summary on node ", 0) == 0);
    CHECK(got.size() < broadcast_failure_message_bytes + 128);
    CHECK(j.reason.find("[... 6513 more bytes]") != std::string::npos);
  }
}

TEST_CASE("daemon restart: a spare whose offer the fresh job dropped is marked so in the rebuilt job", "[rdzv][nccl]") {
  // The mark decides where a round's IDs come from when that node gets group rank 0 without
  // joining again (a spare promoted into a freed slot): without it the rebuilt job took its
  // emptied offer for the round's, and the round carried no IDs.
  constexpr int kKeep = static_cast<int>(RendezvousJob::kOfferKeepers);
  constexpr int kNodes = kKeep + 1;
  const int dropped = 2 * kNodes;  // the last spare
  Fixture f;
  const auto c = cfg(kNodes, kNodes);
  Decisions closed;
  for (int i = 1; i <= kNodes; ++i) closed = f.join(node(i), c);
  std::vector<Assignment> assigned;
  for (int i = 1; i <= kNodes; ++i) assigned.push_back(assignment_of(closed, node(i).id));
  for (int i = kNodes + 1; i <= dropped; ++i) f.join(offering(i, 0, 2), c);
  REQUIRE(f.state().role_of(node(dropped).id) == MemberRole::spare);

  // The daemon restarts. The spares re-register first (no assignment): the fresh job keeps
  // kKeep offers and drops the last one.
  Fixture g;
  for (int i = kNodes + 1; i <= dropped; ++i) {
    CHECK(
        of<Refuse>(g.reg.rejoin(g.job, RejoinRequest{offering(i, 0, 2), c, {}, std::nullopt}, g.clock.now())).empty());
  }
  REQUIRE(g.state().state() == JobState::waiting);
  CHECK(g.state().footprint_of(node(dropped).id) == member_footprint(node(dropped)));
  // The participants rebuild the running round; the spares are spares again.
  for (std::size_t i = 0; i < assigned.size(); ++i) {
    const NodeInfo n = node(static_cast<int>(i) + 1);
    CHECK(of<Refuse>(g.reg.rejoin(g.job, RejoinRequest{n, c, {}, assigned[i]}, g.clock.now())).empty());
  }
  REQUIRE(g.state().state() == JobState::running);
  CHECK(g.state().role_of(node(dropped).id) == MemberRole::spare);
  CHECK(g.state().audit().empty());
  // The other spares go, then group rank 0: the dropped node takes its slot.
  for (int i = kNodes + 1; i < dropped; ++i) g.reg.leave(g.job, node(i).id, g.clock.now());
  g.reg.leave(g.job, node(1).id, g.clock.now());
  std::vector<NodeInfo> alive{node(dropped)};
  Decisions a;
  for (int i = 2; i <= kNodes; ++i) {
    alive.push_back(offering(i, 1, 2));
    a = g.join(offering(i, 1, 2), c);
  }
  REQUIRE(of<SendAssignment>(a).size() == static_cast<std::size_t>(kNodes));
  CHECK(assignment_of(a, node(dropped).id).group_rank == 0);
  // Its own offer is gone: the round's IDs are the first kept offer's, in rank order.
  for (const auto& s : of<SendAssignment>(a)) CHECK(s.assignment.nccl_id == offering(2, 1, 2).nccl_ids);
  CHECK(g.state().audit().empty());
}
