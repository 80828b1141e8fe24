// Every way the service refuses a frame or a request is counted under its RefuseCode (the
// label of ddprun_rdzvd_refused_frames_total), driven frame by frame through on_frame: the
// handshake and job binding (auth), node ownership (not_owner), the registry's request checks
// (invalid_request, inconsistent_rejoin, other for --max-jobs) and the job's own answers
// (config_mismatch, job_full, job_closed, job_finished). Run ids and texts that would have
// fooled a match on the refusal's text are counted by where the refusal came from.
#include <catch2/catch.hpp>

#include <boost/asio/io_context.hpp>
#include <chrono>
#include <climits>
#include <memory>
#include <string>

#include "ddprun/rendezvous/rendezvous_service.hpp"
#include "ddprun/rendezvous/rendezvous_wire.hpp"
#include "ddprun/rendezvous/store_state.hpp"

namespace rdzv = ddprun::rendezvous;
using namespace std::chrono_literals;
using rdzv::RefuseCode;

namespace {

rdzv::JobConfig config_of(int min_nodes, int max_nodes) {
  rdzv::JobConfig c;
  c.min_nodes = min_nodes;
  c.max_nodes = max_nodes;
  c.join_timeout = 600s;
  c.last_call_timeout = 600s;
  c.close_timeout = 600s;
  c.heartbeat_interval = 60s;
  c.missed_heartbeats = 3;
  c.exit_barrier_timeout = 600s;
  c.rebuild_grace = 60s;
  return c;
}

rdzv::NodeInfo node(int i) {
  rdzv::NodeInfo n;
  n.id = rdzv::NodeId{"10.0.0." + std::to_string(i), 100 + i, "x"};
  n.addr = n.id.addr;
  n.local_world_size = 1;
  return n;
}

// Group rank `rank` of `nodes` one-process nodes, rank 0 at 10.0.0.1.
rdzv::Assignment assignment(int rank, int nodes) {
  rdzv::Assignment a;
  a.group_rank = rank;
  a.group_world_size = nodes;
  a.local_world_size = 1;
  a.rank_offset = rank;
  a.world_size = nodes;
  a.master_addr = "10.0.0.1";
  return a;
}

// One service fed frames directly; the connection id is the caller's choice.
struct Harness {
  explicit Harness(rdzv::RendezvousServiceOptions options = {})
      : service(std::make_shared<rdzv::RendezvousService>(io, std::move(options), timers)) {}
  ~Harness() { service->shutdown(); }
  Harness(const Harness&) = delete;
  Harness& operator=(const Harness&) = delete;

  // The frame's decode status: error = refused (REFUSED sent, connection to be closed).
  rdzv::DecodeStatus send(rdzv::ConnectionId conn, const rdzv::ClientMessage& message) {
    frame.clear();
    std::visit([&](const auto& m) { rdzv::encode_client(frame, m); }, message);
    return service->on_frame(conn, frame, state, outbox).status;
  }
  rdzv::DecodeStatus join(rdzv::ConnectionId conn, const std::string& run_id, int n, rdzv::JobConfig config) {
    return send(conn, rdzv::JoinMessage{run_id, rdzv::JoinRequest{node(n), config}});
  }
  // Moves the clock by `d` and runs the daemon's tick it made due.
  void advance(std::chrono::steady_clock::duration d) {
    timers.advance(d);
    if (io.stopped()) io.restart();
    io.poll();
  }
  std::uint64_t count(RefuseCode code) const { return service->stats().refused[static_cast<std::size_t>(code)]; }
  std::uint64_t total() const {
    std::uint64_t sum = 0;
    for (std::uint64_t c : service->stats().refused) sum += c;
    return sum;
  }

  boost::asio::io_context io;
  rdzv::ManualTimers timers;
  std::shared_ptr<rdzv::RendezvousService> service;
  rdzv::StoreState state{rdzv::StoreLimits{}};
  rdzv::RecordingOutbox outbox;
  std::string frame;
};

constexpr auto refused = rdzv::DecodeStatus::error;
constexpr auto ok = rdzv::DecodeStatus::ok;

}  // namespace

TEST_CASE("refuse codes have the metric labels docs/daemon.md lists, other last", "[refuse]") {
  CHECK(rdzv::refuse_code_label(RefuseCode::auth) == "auth");
  CHECK(rdzv::refuse_code_label(RefuseCode::not_owner) == "not_owner");
  CHECK(rdzv::refuse_code_label(RefuseCode::invalid_request) == "invalid_request");
  CHECK(rdzv::refuse_code_label(RefuseCode::config_mismatch) == "config_mismatch");
  CHECK(rdzv::refuse_code_label(RefuseCode::job_finished) == "job_finished");
  CHECK(rdzv::refuse_code_label(RefuseCode::job_closed) == "job_closed");
  CHECK(rdzv::refuse_code_label(RefuseCode::job_full) == "job_full");
  CHECK(rdzv::refuse_code_label(RefuseCode::inconsistent_rejoin) == "inconsistent_rejoin");
  CHECK(rdzv::refuse_code_label(RefuseCode::other) == "other");
  CHECK(static_cast<std::size_t>(RefuseCode::other) + 1 == rdzv::kRefuseCodes);
}

TEST_CASE("handshake and job binding refusals count as auth", "[refuse]") {
  rdzv::RendezvousServiceOptions options;
  options.token = "sekrit";
  Harness h(options);
  // A JOIN before any handshake on a token daemon.
  CHECK(h.join(1, "j", 1, config_of(1, 2)) == refused);
  CHECK(h.count(RefuseCode::auth) == 1);
  // AUTH before HELLO.
  CHECK(h.send(2, rdzv::AuthMessage{"j", std::string(64, 'a')}) == refused);
  CHECK(h.count(RefuseCode::auth) == 2);
  // A wrong MAC.
  CHECK(h.send(3, rdzv::HelloMessage{1, std::string(64, 'b')}) == ok);
  CHECK(h.send(3, rdzv::AuthMessage{"j", std::string(64, 'c')}) == refused);
  CHECK(h.count(RefuseCode::auth) == 3);
  CHECK(h.total() == 3);

  // Without a token, AUTH is refused too (nothing to authenticate against).
  Harness open;
  CHECK(open.send(1, rdzv::HelloMessage{1, std::string(64, 'b')}) == ok);
  CHECK(open.send(1, rdzv::AuthMessage{"j", std::string(64, 'c')}) == refused);
  CHECK(open.count(RefuseCode::auth) == 1);
  CHECK(open.total() == 1);
}

TEST_CASE("frames for a node another connection owns count as not_owner", "[refuse]") {
  Harness h;
  REQUIRE(h.join(1, "j", 1, config_of(2, 3)) == ok);
  // A heartbeat for node 1 from another connection.
  CHECK(h.send(2, rdzv::HeartbeatMessage{"j", node(1).id}) == refused);
  CHECK(h.count(RefuseCode::not_owner) == 1);
  // A JOIN as node 1 from another connection.
  CHECK(h.join(3, "j", 1, config_of(2, 3)) == refused);
  CHECK(h.count(RefuseCode::not_owner) == 2);
  // A REJOIN as node 1 without its secret: its text ("REJOIN as node ... without its node
  // secret") matched no phrase of the old text matching, so it was counted as "other".
  CHECK(h.send(4, rdzv::RejoinMessage{"j", rdzv::RejoinRequest{node(1), config_of(2, 3), std::string(32, 'a'),
                                                               std::nullopt}}) == refused);
  CHECK(h.count(RefuseCode::not_owner) == 3);
  // A CLOSE from a connection that owns no member.
  CHECK(h.send(5, rdzv::CloseMessage{"j"}) == refused);
  CHECK(h.count(RefuseCode::not_owner) == 4);
  CHECK(h.total() == 4);
}

TEST_CASE("the registry's request checks count as invalid_request, inconsistent_rejoin or other", "[refuse]") {
  rdzv::RendezvousServiceOptions options;
  options.max_jobs = 1;
  Harness h(options);
  // A run id longer than the limit: "rendezvous id of 300 bytes is longer ..." matched no
  // phrase of the old text matching ("other"); it is an invalid request.
  CHECK(h.join(1, std::string(300, 'r'), 1, config_of(1, 2)) == refused);
  CHECK(h.count(RefuseCode::invalid_request) == 1);
  rdzv::JobConfig bad = config_of(1, 2);
  bad.min_nodes = 3;  // more than max_nodes
  CHECK(h.join(2, "j", 2, bad) == refused);
  CHECK(h.count(RefuseCode::invalid_request) == 2);

  rdzv::Assignment a;
  a.group_rank = 0;
  a.group_world_size = INT_MAX;
  a.local_world_size = 1;
  a.world_size = 2;
  CHECK(h.send(3, rdzv::RejoinMessage{"j", rdzv::RejoinRequest{node(3), config_of(1, 2), "", a}}) == refused);
  CHECK(h.count(RefuseCode::inconsistent_rejoin) == 1);

  // --max-jobs: the first job fits, the second is refused.
  REQUIRE(h.join(4, "first", 4, config_of(2, 2)) == ok);
  CHECK(h.total() == 3);
  CHECK(h.join(5, "second", 5, config_of(2, 2)) == refused);
  CHECK(h.count(RefuseCode::other) == 1);
  CHECK(h.total() == 4);
}

TEST_CASE("a job's own refusals count as config_mismatch, job_full, job_closed, job_finished", "[refuse]") {
  Harness h;
  // The run id holds the phrase the old text matching took for job_full ("' is full"): the
  // mismatch text names the run id, and must still count as config_mismatch.
  const std::string tricky = "j' is full";
  REQUIRE(h.join(1, tricky, 1, config_of(2, 3)) == ok);
  CHECK(h.join(2, tricky, 2, config_of(2, 4)) == refused);
  CHECK(h.count(RefuseCode::config_mismatch) == 1);
  CHECK(h.count(RefuseCode::job_full) == 0);

  // min = max = 1: the first node starts round 0 at once, a second one waits as a spare (at
  // most max spares), a third finds the job full.
  REQUIRE(h.join(3, "full", 3, config_of(1, 1)) == ok);
  REQUIRE(h.service->registry().find("full")->state() == rdzv::JobState::running);
  CHECK(h.join(8, "full", 8, config_of(1, 1)) == ok);
  CHECK(h.count(RefuseCode::job_full) == 0);
  CHECK(h.join(4, "full", 4, config_of(1, 1)) == refused);
  CHECK(h.count(RefuseCode::job_full) == 1);

  // Closed by its member: a new node is refused.
  REQUIRE(h.join(5, "closed", 5, config_of(2, 3)) == ok);
  REQUIRE(h.send(5, rdzv::CloseMessage{"closed"}) == ok);
  CHECK(h.join(6, "closed", 6, config_of(2, 3)) == refused);
  CHECK(h.count(RefuseCode::job_closed) == 1);

  // Completed: its only node succeeded in round 0; a new node is refused.
  REQUIRE(h.send(3, rdzv::SucceededMessage{"full", node(3).id, 0}) == ok);
  REQUIRE(h.service->registry().find("full")->state() == rdzv::JobState::completed);
  CHECK(h.join(7, "full", 7, config_of(1, 1)) == refused);
  CHECK(h.count(RefuseCode::job_finished) == 1);
  CHECK(h.total() == 4);
}

TEST_CASE("a refused JOIN leaves nothing behind: the node may join later, the connection closes", "[refuse]") {
  Harness h;
  // Refused by the registry (local_world_size 0), on a job that never existed.
  rdzv::NodeInfo bad = node(1);
  bad.local_world_size = 0;
  CHECK(h.send(1, rdzv::JoinMessage{"j", rdzv::JoinRequest{bad, config_of(1, 2)}}) == refused);
  CHECK(h.count(RefuseCode::invalid_request) == 1);
  // One frame for that connection, REFUSED (the server then closes it).
  rdzv::ServerMessage reply;
  const std::string out = h.outbox.take(1);
  REQUIRE(rdzv::decode_server(out, rdzv::WireLimits{}, reply).status == ok);
  CHECK(std::holds_alternative<rdzv::Refuse>(reply));
  // The same node id joins properly from another connection: no secret was kept for it (a
  // kept one made it "a known member: it must REJOIN with its node secret").
  CHECK(h.join(2, "j", 1, config_of(1, 2)) == ok);
  CHECK(h.total() == 1);

  // A daemon that restarted knows no secret: a refused JOIN naming a node must not lock that
  // node's REJOIN (with the secret it holds) out.
  Harness r;
  bad = node(3);
  bad.local_world_size = 0;
  CHECK(r.send(1, rdzv::JoinMessage{"k", rdzv::JoinRequest{bad, config_of(1, 2)}}) == refused);
  rdzv::Assignment a;
  a.group_rank = 0;
  a.group_world_size = 1;
  a.local_world_size = 1;
  a.world_size = 1;
  CHECK(r.send(2, rdzv::RejoinMessage{"k", rdzv::RejoinRequest{node(3), config_of(1, 2), std::string(32, 'f'), a}}) ==
        ok);
  CHECK(r.total() == 1);
}

TEST_CASE("the secrets of nodes whose lease ran out in a job that lives on do not pile up", "[refuse]") {
  // One member keeps the job alive; 5,000 others join once each, on connections that close, and
  // lose their lease. Before: every one of their node secrets stayed until the whole job was
  // dropped, so churn in one live job grew the daemon without bound (2.3 KB a join).
  Harness h;
  rdzv::JobConfig config = config_of(1, 100000);
  config.heartbeat_interval = 1s;
  config.missed_heartbeats = 1;
  REQUIRE(h.join(1, "churn", 1, config) == ok);
  for (int i = 0; i < 5000; ++i) {
    const auto conn = static_cast<rdzv::ConnectionId>(100 + i);
    rdzv::NodeInfo n = node(2);
    n.id.pid = 1000 + i;
    REQUIRE(h.send(conn, rdzv::JoinMessage{"churn", rdzv::JoinRequest{n, config}}) == ok);
    h.service->on_disconnect(conn);
    if (i % 100 == 99) {
      // The keep-alive member heartbeats; the others' leases (1 s after their disconnect) run out.
      REQUIRE(h.send(1, rdzv::HeartbeatMessage{"churn", node(1).id}) == ok);
      h.advance(2s);
      REQUIRE(h.send(1, rdzv::HeartbeatMessage{"churn", node(1).id}) == ok);
    }
  }
  REQUIRE(h.service->registry().find("churn") != nullptr);
  CHECK(h.service->registry().find("churn")->member_count() <= 101);
  CHECK(h.service->stats().node_secrets < 2500);
}

TEST_CASE(
    "before AUTH a daemon with a token refuses a frame from its header when it declares more than a "
    "handshake needs",
    "[refuse]") {
  rdzv::RendezvousServiceOptions options;
  options.token = "sekrit";
  Harness h(options);
  // A HELLO header that announces 1 MiB, with only the first bytes sent: refused at once, before
  // the daemon buffers the rest (before: it waited for, and held, the whole megabyte).
  std::string header = "H";
  const std::uint32_t declared = (1U << 20) - 1;
  for (int i = 0; i < 4; ++i) header.push_back(static_cast<char>((declared >> (8 * i)) & 0xff));
  header += std::string(100, 'x');
  const auto r = h.service->on_frame(1, header, h.state, h.outbox);
  CHECK(r.status == refused);
  CHECK(r.reason.find("before authentication") != std::string::npos);
  // An ordinary HELLO is answered.
  CHECK(h.send(2, rdzv::HelloMessage{1, std::string(64, 'a')}) == ok);
}

TEST_CASE("a REJOIN's assignment is bounded: its master address and NCCL IDs", "[refuse]") {
  // Before: the master address was read at any length (up to the 1 MiB frame) and kept, several
  // times per job and uncounted by --max-member-bytes; nor were the round's NCCL IDs checked.
  Harness h;
  auto rejoin = [&](rdzv::ConnectionId conn, const std::string& run_id, const rdzv::Assignment& a) {
    return h.send(conn, rdzv::RejoinMessage{run_id, rdzv::RejoinRequest{node(1), config_of(1, 2), "", a}});
  };
  rdzv::Assignment a = assignment(0, 2);
  a.master_addr = std::string(rdzv::max_node_text_bytes + 1, 'm');
  CHECK(rejoin(1, "long-addr", a) == refused);
  CHECK(h.count(RefuseCode::inconsistent_rejoin) == 1);
  CHECK(h.service->registry().find("long-addr") == nullptr);
  a = assignment(0, 2);
  a.nccl_id = std::vector<std::uint8_t>(129, 1);  // not a whole number of IDs
  CHECK(rejoin(2, "odd-ids", a) == refused);
  // More IDs than --nccl-roots allows do not fit in a frame (the decoder refuses it).
  a.nccl_id = std::vector<std::uint8_t>((rdzv::max_nccl_ids + 1) * 128, 1);
  CHECK(rejoin(3, "many-ids", a) == refused);
  CHECK(h.service->registry().find("many-ids") == nullptr);
  CHECK(h.count(RefuseCode::inconsistent_rejoin) == 2);
  CHECK(h.total() == 2);
  // At the bounds it is taken.
  a = assignment(0, 2);
  a.master_addr = std::string(rdzv::max_node_text_bytes, 'm');
  a.nccl_id = std::vector<std::uint8_t>(2 * 128, 1);
  CHECK(rejoin(4, "ok", a) == ok);

  // The rebuilt round's IDs are charged against --max-member-bytes before the job is made.
  rdzv::RendezvousServiceOptions options;
  options.max_member_bytes = 64 * 1024;
  Harness small(options);
  a = assignment(0, 2);
  a.nccl_id = std::vector<std::uint8_t>(256 * 128, 1);  // 32 KiB, held as bytes and as hex: 96 KiB
  CHECK(small.send(1, rdzv::RejoinMessage{"big", rdzv::RejoinRequest{node(1), config_of(1, 2), "", a}}) == refused);
  CHECK(small.count(RefuseCode::other) == 1);
  CHECK(small.service->registry().find("big") == nullptr);
  a.nccl_id = std::vector<std::uint8_t>(8 * 128, 1);
  CHECK(small.send(2, rdzv::RejoinMessage{"big", rdzv::RejoinRequest{node(1), config_of(1, 2), "", a}}) == ok);
}

TEST_CASE("a closed job that emptied and gets an absent rank back has no deadline in the past", "[refuse]") {
  // A round rebuilt after a daemon restart: rank 0 re-registers, succeeds, closes the job and
  // leaves; the job is closed and empty (collected after close_timeout). Rank 1 then
  // re-registers. Before: the collection's deadline stayed, in the past, while the job was no
  // longer collectable: the daemon's timer fired again at once, for ever (a busy loop).
  Harness h;
  rdzv::JobConfig config = config_of(1, 2);
  config.close_timeout = 1ms;
  rdzv::Assignment a = assignment(0, 2);
  REQUIRE(h.send(1, rdzv::RejoinMessage{"j", rdzv::RejoinRequest{node(1), config, "", a}}) == ok);
  REQUIRE(h.send(1, rdzv::SucceededMessage{"j", node(1).id, 0}) == ok);
  REQUIRE(h.send(1, rdzv::CloseMessage{"j"}) == ok);
  REQUIRE(h.send(1, rdzv::LeaveMessage{"j", node(1).id}) == ok);
  REQUIRE(h.service->registry().find("j") != nullptr);
  REQUIRE(h.service->registry().find("j")->member_count() == 0);
  h.timers.advance(5ms);  // past the collection's deadline, before the daemon's tick ran
  a = assignment(1, 2);
  REQUIRE(h.send(2, rdzv::RejoinMessage{"j", rdzv::RejoinRequest{node(2), config, "", a}}) == ok);
  const rdzv::RendezvousJob* job = h.service->registry().find("j");
  REQUIRE(job != nullptr);
  REQUIRE(job->member_count() == 1);
  const auto next = job->next_deadline();
  REQUIRE(next.has_value());
  CHECK(*next > h.timers.now());
  // The daemon's tick keeps the job (it has a member), and finds nothing due again.
  h.advance(0s);
  REQUIRE(h.service->registry().find("j") != nullptr);
  CHECK(*h.service->registry().find("j")->next_deadline() > h.timers.now());
  // Rank 1 leaves: the closed job is empty again and is collected after close_timeout.
  REQUIRE(h.send(2, rdzv::LeaveMessage{"j", node(2).id}) == ok);
  h.advance(5ms);
  CHECK(h.service->registry().find("j") == nullptr);
}

TEST_CASE("a member whose connection is refused a second JOIN is told disconnected", "[refuse]") {
  // The refused frame closes the connection. Before: its binding was dropped before the close,
  // so the close found no member to tell: the member kept its whole lease (heartbeat interval
  // times missed heartbeats, up to years) as a connected node, holding a place under --max-members.
  Harness h;
  rdzv::JobConfig config = config_of(2, 3);
  config.heartbeat_interval = 60s;
  config.missed_heartbeats = 100;
  REQUIRE(h.join(1, "j", 1, config) == ok);
  rdzv::NodeInfo bad = node(1);
  bad.local_world_size = 0;
  CHECK(h.send(1, rdzv::JoinMessage{"j", rdzv::JoinRequest{bad, config}}) == refused);
  h.service->on_disconnect(1);  // the server closes the refused connection
  const auto status = h.service->registry().find("j")->status(h.timers.now());
  REQUIRE(status.members.size() == 1);
  CHECK(status.members[0].disconnected);
  // One heartbeat interval later the member is gone (its lease was 100 intervals).
  h.advance(61s);
  const rdzv::RendezvousJob* job = h.service->registry().find("j");
  CHECK((job == nullptr || job->member_count() == 0));
}
