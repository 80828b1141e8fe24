// The replicated rendezvous log without etcd: events encode and decode, and replicas that apply
// the same entries reach the same decisions as one RendezvousRegistry would.
#include <catch2/catch.hpp>

#include "ddprun/rendezvous/etcd_rendezvous.hpp"

using namespace ddprun;
using namespace ddprun::rendezvous;
using namespace ddprun::rendezvous::etcd;
using namespace std::chrono_literals;

namespace {

NodeInfo node(int i) {
  NodeInfo n;
  n.id = NodeId{"10.0.0." + std::to_string(i), 100 + i, "inst" + std::to_string(i)};
  n.addr = n.id.addr;
  n.local_world_size = 2;
  n.store_port = static_cast<std::uint16_t>(29500 + i);
  n.nccl_ids.assign(128, static_cast<std::uint8_t>(i));
  return n;
}

JobConfig config(int min, int max, int restarts = 1) {
  JobConfig c;
  c.min_nodes = min;
  c.max_nodes = max;
  c.max_restarts = restarts;
  c.last_call_timeout = 2s;
  c.join_timeout = 30s;
  return c;
}

LogEvent join_event(std::int64_t t, int i, const JobConfig& c) {
  return {t, EventKind::message, "j" + std::to_string(i),
          JoinMessage{"job", JoinRequest{node(i), replica_config(c, node_lease_ttl(c))}}};
}

template <class A>
std::vector<A> only(const Decisions& actions) {
  std::vector<A> out;
  for (const Decision& a : actions) {
    if (const auto* x = std::get_if<A>(&a)) out.push_back(*x);
  }
  return out;
}

}  // namespace

TEST_CASE("log events round-trip and hostile values are rejected", "[etcd][log]") {
  const JobConfig c = config(2, 2);
  const LogEvent e = join_event(1700000000123, 1, c);
  LogEvent back;
  REQUIRE(decode_event(encode_event(e), WireLimits{}, back) == "");
  CHECK(back.time_ms == e.time_ms);
  CHECK(back.id == "j1");
  const auto& j = std::get<JoinMessage>(back.message);
  CHECK(j.request.node.id == node(1).id);
  CHECK(j.request.node.nccl_ids == node(1).nccl_ids);
  LogEvent tick{5, EventKind::tick, "t-1", StatusMessage{}};
  REQUIRE(decode_event(encode_event(tick), WireLimits{}, back) == "");
  CHECK(back.kind == EventKind::tick);

  const std::string good = encode_event(e);
  CHECK_THAT(decode_event("garbage", WireLimits{}, back), Catch::Contains("magic"));
  CHECK_THAT(decode_event(good.substr(0, good.size() - 3), WireLimits{}, back), Catch::Contains("truncated"));
  CHECK_THAT(decode_event(good + "x", WireLimits{}, back), Catch::Contains("after its frame"));
  CHECK_THAT(decode_event("ddprun-etcd-event 1 -5 tick x\n", WireLimits{}, back), Catch::Contains("time"));
  // Times near the int64 limit would overflow the deadlines computed from them.
  CHECK_THAT(decode_event("ddprun-etcd-event 1 9223372036854775807 tick x\n", WireLimits{}, back),
             Catch::Contains("time"));
  CHECK_THAT(decode_event("ddprun-etcd-event 1 253402300800000 tick x\n", WireLimits{}, back), Catch::Contains("time"));
  CHECK(decode_event("ddprun-etcd-event 1 253402300799999 tick x\n", WireLimits{}, back).empty());
  CHECK_THAT(decode_event("ddprun-etcd-event 1 5 nuke x\n", WireLimits{}, back), Catch::Contains("nuke"));
  LogEvent bad_expired{5, EventKind::expired, "x", JoinMessage{"job", {}}};
  CHECK_THAT(decode_event(encode_event(bad_expired), WireLimits{}, back), Catch::Contains("name a node"));
  CHECK(log_seq_text(42) == "000000000042");
  CHECK(parse_log_seq("000000000042") == 42);
  CHECK_FALSE(parse_log_seq("42"));
  CHECK_FALSE(parse_log_seq("00000000004x"));
}

TEST_CASE("replicas fed the same log decide the same rounds", "[etcd][log]") {
  const JobConfig c = config(2, 3);
  JobLog a("job"), b("job");
  std::vector<LogEvent> events = {join_event(1000, 1, c), join_event(1100, 2, c)};
  std::vector<Decisions> out_a, out_b;
  for (std::size_t i = 0; i < events.size(); ++i) {
    out_a.push_back(a.apply(static_cast<std::int64_t>(i), events[i]));
    out_b.push_back(b.apply(static_cast<std::int64_t>(i), events[i]));
  }
  // Two of 1..3 joined: a last call is armed 2 s after the second join.
  REQUIRE(a.next_deadline_ms() == 3100);
  CHECK(b.next_deadline_ms() == a.next_deadline_ms());
  const LogEvent tick{3100, EventKind::tick, "t", StatusMessage{}};
  const auto ra = only<SendAssignment>(a.apply(2, tick));
  const auto rb = only<SendAssignment>(b.apply(2, tick));
  REQUIRE(ra.size() == 2);
  REQUIRE(rb.size() == 2);
  CHECK(ra[0].assignment == rb[0].assignment);
  CHECK(ra[0].assignment.world_size == 4);
  CHECK(ra[0].assignment.nccl_id == ra[1].assignment.nccl_id);
  // Applying out of order is refused (no effect).
  CHECK(a.apply(7, tick).empty());
  CHECK(a.next_seq() == 3);
}

TEST_CASE("an expired event is the registry's lost-node path", "[etcd][log]") {
  const JobConfig c = config(2, 2);
  JobLog log("job");
  log.apply(0, join_event(1000, 1, c));
  REQUIRE(only<SendAssignment>(log.apply(1, join_event(1000, 2, c))).size() == 2);
  const LogEvent lost{1500, EventKind::expired, "x", LeaveMessage{"job", node(2).id}};
  const auto restarts = only<SendRestart>(log.apply(2, lost));
  REQUIRE(restarts.size() == 1);
  CHECK(restarts[0].node == node(1).id);
  CHECK(restarts[0].kind == RoundEnd::membership_change);
  CHECK_THAT(restarts[0].reason, Catch::Contains("lost"));
  CHECK_FALSE(log.member(node(2).id));
  // A clock going backwards in the log does not move the replica back.
  log.apply(3, LogEvent{10, EventKind::tick, "t", StatusMessage{}});
  CHECK(log.last_time_ms() == 1500);
}

TEST_CASE("lease TTLs and the replica config", "[etcd][log]") {
  JobConfig c = config(1, 1);
  c.heartbeat_interval = 500ms;
  c.missed_heartbeats = 3;
  CHECK(node_lease_ttl(c) == 2);  // 1.5 s rounds up, etcd's minimum is 2 s
  c.close_timeout = 45s;
  CHECK(job_lease_ttl(c) == 45);
  const JobConfig r = replica_config(c, 2);
  CHECK(r.heartbeat_interval == 2s);
  CHECK(r.lease() > std::chrono::hours(24 * 365 * 10));
  CHECK(r.validate() == "");
}

TEST_CASE("a batch carries many events in one log entry and replicas apply each id once", "[etcd][log]") {
  const JobConfig c = config(3, 3);
  std::vector<LogEvent> batch;
  for (int i = 1; i <= 3; ++i) {
    LogEvent e = join_event(2000, i, c);
    e.id = "src" + std::to_string(i) + ".7-" + std::string(11, '0') + "1";
    batch.push_back(e);
  }
  const std::string value = encode_batch(batch);
  std::vector<LogEvent> back;
  REQUIRE(decode_batch(value, WireLimits{}, back) == "");
  REQUIRE(back.size() == 3);
  CHECK(back[2].id == batch[2].id);
  CHECK(std::get<JoinMessage>(back[1].message).request.node.id == node(2).id);

  // One entry holding every join closes the round at once, the same way on every replica.
  JobLog a("job"), b("job");
  const auto ra = only<SendAssignment>(a.apply(0, back));
  REQUIRE(ra.size() == 3);
  CHECK(only<SendAssignment>(b.apply(0, batch)).size() == 3);
  CHECK(a.role(node(1).id) == MemberRole::participant);
  CHECK_FALSE(a.role(NodeId{"10.9.9.9", 1, "nobody"}));

  // The same ids again (a re-put inbox key, a second sequencer racing a takeover): skipped.
  CHECK(a.seen(batch[0].id));
  CHECK(a.seen("src1.7-000000000000"));
  CHECK_FALSE(a.seen("src1.7-000000000002"));
  CHECK_FALSE(a.seen("other-000000000001"));
  CHECK(a.apply(1, batch).empty());
  CHECK(a.job()->round() == 0);
  // Ids without a counter are never taken for duplicates.
  CHECK_FALSE(split_event_id("plain"));
  CHECK_FALSE(split_event_id("a-"));
  CHECK(split_event_id("a-b-12") == std::make_pair(std::string("a-b"), std::uint64_t{12}));

  // Hostile batches are refused whole, with the reason.
  CHECK_THAT(decode_batch("nonsense", WireLimits{}, back), Catch::Contains("magic"));
  CHECK_THAT(decode_batch("ddprun-etcd-batch 1 0\n", WireLimits{}, back), Catch::Contains("0 events"));
  CHECK_THAT(decode_batch("ddprun-etcd-batch 1 99999\n", WireLimits{}, back), Catch::Contains("allowed"));
  CHECK_THAT(decode_batch(value.substr(0, value.size() - 5), WireLimits{}, back), Catch::Contains("truncated"));
  CHECK_THAT(decode_batch(value + "x", WireLimits{}, back), Catch::Contains("after its last event"));
  CHECK_THAT(decode_batch("ddprun-etcd-batch 1 1\n5\nhello", WireLimits{}, back), Catch::Contains("batch event 0"));
  CHECK_THAT(decode_batch("ddprun-etcd-batch 1 2\nxx\n", WireLimits{}, back), Catch::Contains("no length"));
}

TEST_CASE("ticks and expiries are deduplicated like messages; the sequencer's get a source of their own",
          "[etcd][log]") {
  // The sequencer put its join (id S-1) in the inbox, then a deadline passed: its tick and an
  // expiry come first in the entry. With ids of a source of their own (S.seq-N) they hide
  // nothing.
  const JobConfig c = config(1, 1);
  const std::string s = "inst1.5f";
  LogEvent join = join_event(1000, 1, c);
  join.id = s + "-000000000001";
  const LogEvent tick{1000, EventKind::tick, s + ".seq-000000000001", StatusMessage{"job"}};
  const LogEvent lost{1000, EventKind::expired, s + ".seq-000000000002", LeaveMessage{"job", node(2).id}};
  JobLog log("job");
  const auto a = only<SendAssignment>(log.apply(0, std::vector<LogEvent>{tick, lost, join}));
  REQUIRE(a.size() == 1);
  CHECK(a[0].node == node(1).id);
  CHECK(log.seen(join.id));
  CHECK(log.seen(tick.id));
  CHECK(log.seen(lost.id));

  // A log written by an older sequencer (the tick S-2 ahead of the join S-1 of the same
  // source) is replayed the way that version's replicas applied it: the join is skipped, on
  // every replica alike.
  JobLog old("job");
  const LogEvent old_tick{1000, EventKind::tick, s + "-000000000002", StatusMessage{"job"}};
  CHECK(only<SendAssignment>(old.apply(0, std::vector<LogEvent>{old_tick, join})).empty());
  CHECK(old.seen(join.id));
}
