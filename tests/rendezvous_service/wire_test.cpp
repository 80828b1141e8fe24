// Native rendezvous frame codec (rendezvous_wire.hpp): round trips of every message, truncation
// at every byte, limits enforced from the header, and malformed payloads.
#include <catch2/catch.hpp>

#include <algorithm>

#include <string>
#include <vector>
#include <utility>

#include <boost/json.hpp>

#include "ddprun/rendezvous/rendezvous_wire.hpp"

namespace rdzv = ddprun::rendezvous;
using namespace std::chrono_literals;

namespace {

rdzv::NodeId node(int i) { return rdzv::NodeId{"10.0.0." + std::to_string(i), 1000 + i, "inst-" + std::to_string(i)}; }

rdzv::NodeInfo info(int i) {
  rdzv::NodeInfo n;
  n.id = node(i);
  n.addr = n.id.addr;
  n.local_world_size = i + 1;
  n.store_host = "store-" + std::to_string(i);
  n.store_port = static_cast<std::uint16_t>(40000 + i);
  return n;
}

rdzv::JobConfig config() {
  rdzv::JobConfig c;
  c.min_nodes = 2;
  c.max_nodes = 4;
  c.max_restarts = 3;
  c.join_timeout = 7s;
  c.last_call_timeout = 250ms;
  c.heartbeat_interval = 100ms;
  c.missed_heartbeats = 5;
  return c;
}

rdzv::Assignment assignment() {
  rdzv::Assignment a;
  a.round = 3;
  a.group_rank = 1;
  a.group_world_size = 2;
  a.local_world_size = 4;
  a.rank_offset = 4;
  a.world_size = 8;
  a.master_addr = "10.0.0.1";
  a.master_port = 29500;
  a.restart_count = 2;
  a.max_restarts = 3;
  a.nccl_id = std::vector<std::uint8_t>{0x00, 0xab, 0xff, 0x10};
  return a;
}

rdzv::WorkerFailure failure() {
  rdzv::WorkerFailure f;
  f.round = 3;
  f.node = node(2);
  f.global_rank = 5;
  f.local_rank = 1;
  f.exit_code = 7;
  f.message = "boom \"quoted\" \n unicode \xc3\xa9";
  return f;
}

std::vector<rdzv::ClientMessage> client_messages() {
  rdzv::RejoinRequest with{info(1), config(), std::string(32, 'a'), assignment()};
  rdzv::RejoinRequest without{info(2), config(), "", std::nullopt};
  rdzv::WorkerFailure sig = failure();
  sig.exit_code.reset();
  sig.signal = 9;
  return {rdzv::JoinMessage{"job-a", rdzv::JoinRequest{info(0), config()}},
          rdzv::RejoinMessage{"job-a", with},
          rdzv::RejoinMessage{"job-b", without},
          rdzv::HeartbeatMessage{"job-a", node(3)},
          rdzv::LeaveMessage{"job-a", node(3)},
          rdzv::WorkerFailedMessage{"job-a", failure()},
          rdzv::WorkerFailedMessage{"job-a", sig},
          rdzv::SucceededMessage{"job-a", node(1), 42},
          rdzv::CloseMessage{"job-a"},
          rdzv::StatusMessage{""},
          rdzv::StatusMessage{"job-a"},
          rdzv::HelloMessage{1, std::string(64, 'b')},
          rdzv::AuthMessage{"job-a", std::string(64, 'c')}};
}

std::vector<rdzv::ServerMessage> server_messages() {
  rdzv::RootCause cause{failure(), "10.0.0.2", 1};
  rdzv::RegistryStatus status;
  rdzv::JobStatus j;
  j.run_id = "job-a";
  j.state = rdzv::JobState::running;
  j.round = 3;
  j.min_nodes = 2;
  j.max_nodes = 4;
  j.restarts_used = 1;
  j.max_restarts = 3;
  j.members.push_back(
      rdzv::MemberStatus{node(1), "10.0.0.1", 4, rdzv::MemberRole::participant, 0, true, false, 250ms, 2750ms, {}});
  j.members.push_back(rdzv::MemberStatus{node(2), "10.0.0.2", 2, rdzv::MemberRole::late, -1, false, true, 1s, 0ms, {}});
  j.exit_barrier_in = 299s;
  j.progress = "running round 3";
  j.last_failure = cause;
  status.jobs.push_back(j);
  status.jobs.push_back(rdzv::JobStatus{});
  return {rdzv::SendAssignment{"job-a", node(1), assignment()},
          rdzv::SendRestart{"job-a", node(1), 2, rdzv::RoundEnd::worker_failure, 1, "rank 5 failed"},
          rdzv::SendRestart{"job-a", node(1), 2, rdzv::RoundEnd::membership_change, 0, "node lost"},
          rdzv::SendJobFailed{"job-a", node(1), "budget spent", cause, 7},
          rdzv::SendJobFailed{"job-a", node(1), "timed out", std::nullopt, 1},
          rdzv::SendJobCompleted{"job-a", node(2)},
          rdzv::Refuse{"job-a", node(2), "token mismatch", rdzv::RefuseCode::other},
          rdzv::AskRejoin{"job-a", node(2), "unknown node"},
          rdzv::Progress{"job-a", node(2), "waiting for nodes: 1/2"},
          status,
          rdzv::ChallengeMessage{std::string(64, 'd'), true},
          rdzv::AuthOkMessage{std::string(64, 'e')},
          rdzv::JoinedMessage{"job-a", node(1), std::string(32, 'f')}};
}

std::string encoded(const rdzv::ClientMessage& m) {
  std::string s;
  rdzv::encode_client(s, m);
  return s;
}
std::string encoded(const rdzv::ServerMessage& m) {
  std::string s;
  rdzv::encode_server(s, m);
  return s;
}

std::string frame(std::uint8_t op, const std::string& payload) {
  std::string s(1, static_cast<char>(op));
  const auto n = static_cast<std::uint32_t>(payload.size());
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>((n >> (8 * i)) & 0xFFu));
  return s + payload;
}

rdzv::DecodeResult decode_c(const std::string& bytes, rdzv::WireLimits limits = {}) {
  rdzv::ClientMessage m;
  return rdzv::decode_client(bytes, limits, m);
}

}  // namespace

TEST_CASE("every client message survives a round trip", "[wire]") {
  for (const auto& m : client_messages()) {
    const std::string bytes = encoded(m);
    CAPTURE(bytes);
    CHECK(static_cast<std::uint8_t>(bytes[0]) >= 0x40);
    CHECK(static_cast<std::uint8_t>(bytes[0]) <= 0x49);
    rdzv::ClientMessage back;
    const auto r = rdzv::decode_client(bytes + "trailing", {}, back);
    REQUIRE(r.status == rdzv::DecodeStatus::ok);
    CHECK(r.consumed == bytes.size());
    CHECK(back.index() == m.index());
    CHECK(encoded(back) == bytes);
  }
}

TEST_CASE("client message fields decode to the values sent", "[wire]") {
  rdzv::ClientMessage back;
  REQUIRE(rdzv::decode_client(encoded(client_messages()[1]), {}, back).status == rdzv::DecodeStatus::ok);
  const auto& rejoin = std::get<rdzv::RejoinMessage>(back);
  CHECK(rejoin.run_id == "job-a");
  CHECK(rejoin.request.node.id == node(1));
  CHECK(rejoin.request.node.local_world_size == 2);
  CHECK(rejoin.request.node.store_port == 40001);
  CHECK(rejoin.request.node_secret == std::string(32, 'a'));
  CHECK(rejoin.request.config.last_call_timeout == std::chrono::milliseconds(250));
  CHECK(rejoin.request.config.max_nodes == 4);
  REQUIRE(rejoin.request.assignment);
  CHECK(*rejoin.request.assignment == assignment());

  REQUIRE(rdzv::decode_client(encoded(client_messages()[6]), {}, back).status == rdzv::DecodeStatus::ok);
  const auto& failed = std::get<rdzv::WorkerFailedMessage>(back);
  CHECK_FALSE(failed.failure.exit_code);
  CHECK(failed.failure.signal == 9);
  CHECK(failed.failure.message == failure().message);
}

TEST_CASE("every server message survives a round trip", "[wire]") {
  for (const auto& m : server_messages()) {
    const std::string bytes = encoded(m);
    CAPTURE(bytes);
    CHECK(static_cast<std::uint8_t>(bytes[0]) >= 0x60);
    rdzv::ServerMessage back;
    const auto r = rdzv::decode_server(bytes, {}, back);
    REQUIRE(r.status == rdzv::DecodeStatus::ok);
    CHECK(back.index() == m.index());
    CHECK(encoded(back) == bytes);
  }
  rdzv::ServerMessage back;
  REQUIRE(rdzv::decode_server(encoded(server_messages()[9]), {}, back).status == rdzv::DecodeStatus::ok);
  const auto& status = std::get<rdzv::RegistryStatus>(back);
  REQUIRE(status.jobs.size() == 2);
  CHECK(status.jobs[0].members.at(1).role == rdzv::MemberRole::late);
  CHECK(status.jobs[0].members.at(0).lease_left == std::chrono::milliseconds(2750));
  CHECK(status.jobs[0].exit_barrier_in == std::chrono::seconds(299));
  CHECK_FALSE(status.jobs[0].last_call_in);
  REQUIRE(status.jobs[0].last_failure);
  CHECK(status.jobs[0].last_failure->failure.global_rank == 5);
  CHECK(status.jobs[0].run_id == "job-a");
  CHECK(status.jobs[0].state == rdzv::JobState::running);
  CHECK(status.jobs[0].round == 3);
  const auto& members = status.jobs[0].members;
  CHECK(std::any_of(members.begin(), members.end(),
                    [](const rdzv::MemberStatus& m) { return m.role == rdzv::MemberRole::participant; }));
  CHECK(std::any_of(members.begin(), members.end(), [](const rdzv::MemberStatus& m) { return m.disconnected; }));
}

TEST_CASE("truncation at every byte asks for more, never errors", "[wire]") {
  for (const auto& m : client_messages()) {
    const std::string bytes = encoded(m);
    for (std::size_t n = 0; n < bytes.size(); ++n) {
      const auto r = decode_c(bytes.substr(0, n));
      INFO("prefix " << n << " of " << bytes.size());
      REQUIRE(r.status == rdzv::DecodeStatus::need_more);
      CHECK(r.min_total > n);
      CHECK(r.min_total == (n < 5 ? 5 : bytes.size()));
    }
  }
  for (const auto& m : server_messages()) {
    const std::string bytes = encoded(m);
    for (std::size_t n = 0; n < bytes.size(); ++n) {
      rdzv::ServerMessage back;
      REQUIRE(rdzv::decode_server(bytes.substr(0, n), {}, back).status == rdzv::DecodeStatus::need_more);
    }
  }
}

TEST_CASE("the payload limit is enforced from the header, before the body arrives", "[wire]") {
  rdzv::WireLimits limits;
  limits.max_payload_bytes = 100;
  std::string header = frame(0x42, "").substr(0, 1);
  const std::uint32_t n = 101;
  for (int i = 0; i < 4; ++i) header.push_back(static_cast<char>((n >> (8 * i)) & 0xFFu));
  const auto r = decode_c(header, limits);
  REQUIRE(r.status == rdzv::DecodeStatus::error);
  CHECK(r.reason.find("HEARTBEAT payload of 101 bytes exceeds the limit of 100") != std::string::npos);
  // A 4 GiB announcement with the default 1 MiB limit.
  const auto huge = decode_c(std::string("\x40\xff\xff\xff\xff", 5));
  REQUIRE(huge.status == rdzv::DecodeStatus::error);
  CHECK(huge.reason.find("JOIN payload") != std::string::npos);
  // Exactly at the limit is fine as far as the limit goes.
  const std::string at_limit = frame(0x47, R"({"run_id":")" + std::string(100 - 13, 'x') + R"("})");
  REQUIRE(at_limit.size() == 105);
  CHECK(decode_c(at_limit, limits).status == rdzv::DecodeStatus::ok);
}

TEST_CASE("NodeInfo.order travels as an optional field", "[wire]") {
  rdzv::NodeInfo n = info(0);
  n.order = 7;
  const std::string bytes = encoded(rdzv::JoinMessage{"job-a", rdzv::JoinRequest{n, config()}});
  CHECK(bytes.find("\"order\":7") != std::string::npos);
  rdzv::ClientMessage back;
  REQUIRE(rdzv::decode_client(bytes, {}, back).status == rdzv::DecodeStatus::ok);
  CHECK(std::get<rdzv::JoinMessage>(back).request.node.order == 7);
  const std::string plain = encoded(rdzv::JoinMessage{"job-a", rdzv::JoinRequest{info(0), config()}});
  CHECK(plain.find("order") == std::string::npos);
  REQUIRE(rdzv::decode_client(plain, {}, back).status == rdzv::DecodeStatus::ok);
  CHECK_FALSE(std::get<rdzv::JoinMessage>(back).request.node.order);
}

TEST_CASE("NodeInfo.nccl_ids travels as an optional hex field", "[wire][nccl]") {
  rdzv::NodeInfo n = info(0);
  for (std::size_t i = 0; i < 256; ++i) n.nccl_ids.push_back(static_cast<std::uint8_t>(255 - i));  // K = 2
  const std::string bytes = encoded(rdzv::JoinMessage{"job-a", rdzv::JoinRequest{n, config()}});
  CHECK(bytes.find("\"nccl_ids\":\"fffefd") != std::string::npos);
  rdzv::ClientMessage back;
  REQUIRE(rdzv::decode_client(bytes, {}, back).status == rdzv::DecodeStatus::ok);
  CHECK(std::get<rdzv::JoinMessage>(back).request.node.nccl_ids == n.nccl_ids);

  // No IDs: the field is left out, and a frame without it (an older agent's) decodes as none.
  const std::string plain = encoded(rdzv::JoinMessage{"job-a", rdzv::JoinRequest{info(0), config()}});
  CHECK(plain.find("nccl_ids") == std::string::npos);
  REQUIRE(rdzv::decode_client(plain, {}, back).status == rdzv::DecodeStatus::ok);
  CHECK(std::get<rdzv::JoinMessage>(back).request.node.nccl_ids.empty());

  // Malformed: odd length, not hex, not a whole number of 128-byte IDs.
  const std::string head =
      R"({"run_id":"j","node":{"id":{"addr":"a","pid":1,"instance":"i"},"addr":"a","local_world_size":1,"nccl_ids":")";
  const std::string tail = R"("},"config":{}})";
  for (const auto& [ids, expect] : std::vector<std::pair<std::string, std::string>>{
           {"abc", "field 'node.nccl_ids' must be a hex string of even length"},
           {std::string(254, 'a') + "zz", "field 'node.nccl_ids' must be a hex string"},
           {"abcd", "field 'node.nccl_ids' must be a whole number of 128-byte NCCL unique IDs"}}) {
    std::string f;
    f.push_back(static_cast<char>(0x40));
    const std::string body = head + ids + tail;
    const auto len = static_cast<std::uint32_t>(body.size());
    for (int i = 0; i < 4; ++i) f.push_back(static_cast<char>((len >> (8 * i)) & 0xFFu));
    f += body;
    const auto r = rdzv::decode_client(f, {}, back);
    INFO(ids);
    REQUIRE(r.status == rdzv::DecodeStatus::error);
    CHECK_THAT(r.reason, Catch::Contains(expect));
  }
}

TEST_CASE("malformed payloads are errors naming the op and field", "[wire]") {
  struct Case {
    std::uint8_t op;
    std::string payload;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {0x42, "not json", "HEARTBEAT message: payload is not valid JSON"},
      {0x42, "[1,2]", "payload must be a JSON object"},
      {0x42, R"({"run_id":"j"})", "missing field 'node'"},
      {0x42, R"({"run_id":5,"node":{}})", "field 'run_id' must be a string"},
      {0x42, R"({"run_id":"j","node":{"addr":"a","pid":"x","instance":"i"}})", "field 'node.pid' must be an integer"},
      {0x40,
       R"({"run_id":"j","node":{"id":{"addr":"a","pid":1,"instance":"i"},"addr":"a","local_world_size":1,"store_port":70000},"config":{}})",
       "field 'node.store_port' = 70000 is out of range"},
      {0x40,
       R"({"run_id":"j","node":{"id":{"addr":"a","pid":1,"instance":"i"},"addr":"a","local_world_size":1},"config":{"min_nodes":1}})",
       "missing field 'config.max_nodes'"},
      {0x45, R"({"run_id":"j","node":{"addr":"a","pid":1,"instance":"i"},"round":-1})",
       "field 'round' must be a non-negative integer"},
      {0x60, R"({"run_id":"j"})", "opcode 0x60 is not a client-to-server rendezvous operation"},
      {0x4f, R"({"run_id":"j"})", "is not a client-to-server rendezvous operation"},
      {0x47, std::string(40, '[') + std::string(40, ']'), "not valid JSON"},
      // ddprun exits with 128 + signal: INT_MAX would overflow it.
      {0x44,
       R"({"run_id":"j","failure":{"round":0,"node":{"addr":"a","pid":1,"instance":"i"},"global_rank":0,"local_rank":0,"signal":2147483647}})",
       "field 'failure.signal'"},
  };
  for (const auto& c : cases) {
    const auto r = decode_c(frame(c.op, c.payload));
    INFO(c.payload);
    REQUIRE(r.status == rdzv::DecodeStatus::error);
    CHECK_THAT(r.reason, Catch::Contains(c.expect));
  }
  rdzv::ServerMessage back;
  const auto wrong_dir = rdzv::decode_server(frame(0x40, "{}"), {}, back);
  REQUIRE(wrong_dir.status == rdzv::DecodeStatus::error);
  CHECK_THAT(wrong_dir.reason, Catch::Contains("not a server-to-client"));
  const auto bad_kind = rdzv::decode_server(
      frame(
          0x61,
          R"({"run_id":"j","node":{"addr":"a","pid":1,"instance":"i"},"ended_round":1,"kind":"x","restart_count":0})"),
      {}, back);
  REQUIRE(bad_kind.status == rdzv::DecodeStatus::error);
  CHECK_THAT(bad_kind.reason, Catch::Contains("field 'kind' must be worker_failure or membership_change"));
}

TEST_CASE("pipelined frames decode one at a time", "[wire]") {
  const std::string a = encoded(client_messages()[3]);
  const std::string b = encoded(client_messages()[7]);
  const std::string both = a + b;
  rdzv::ClientMessage m;
  auto r = rdzv::decode_client(both, {}, m);
  REQUIRE(r.status == rdzv::DecodeStatus::ok);
  CHECK(r.consumed == a.size());
  CHECK(std::holds_alternative<rdzv::HeartbeatMessage>(m));
  r = rdzv::decode_client(std::string_view(both).substr(r.consumed), {}, m);
  REQUIRE(r.status == rdzv::DecodeStatus::ok);
  CHECK(std::get<rdzv::SucceededMessage>(m).round == 42);
}

TEST_CASE("hand-written ASSIGNMENT and PROGRESS frames are the JSON a DOM encoder would write", "[wire]") {
  // Strings that need escaping: quotes, backslash, control characters, non-ASCII UTF-8.
  const std::string nasty = "a\"b\\c\n\t\x01\x1f \xc3\xa9 /";
  rdzv::NodeId id{nasty, -7, "inst\"" + nasty};
  rdzv::Assignment a = assignment();
  a.master_addr = nasty;
  a.nccl_id = std::vector<std::uint8_t>{0x00, 0xab, 0xff};
  const rdzv::SendAssignment sa{"job\\" + nasty, id, a};
  const rdzv::Progress pr{nasty, id, "waiting: " + nasty};

  namespace json = boost::json;
  const json::object id_json{{"addr", id.addr}, {"pid", id.pid}, {"instance", id.instance}};
  const json::object expect_assignment{{"run_id", sa.run_id},
                                       {"node", id_json},
                                       {"assignment", json::object{{"round", a.round},
                                                                   {"group_rank", a.group_rank},
                                                                   {"group_world_size", a.group_world_size},
                                                                   {"local_world_size", a.local_world_size},
                                                                   {"rank_offset", a.rank_offset},
                                                                   {"world_size", a.world_size},
                                                                   {"master_addr", a.master_addr},
                                                                   {"master_port", a.master_port},
                                                                   {"restart_count", a.restart_count},
                                                                   {"max_restarts", a.max_restarts},
                                                                   {"nccl_id", "00abff"}}}};
  const json::object expect_progress{{"run_id", pr.run_id}, {"node", id_json}, {"text", pr.text}};

  for (const auto& [message, expect] : {std::pair<rdzv::ServerMessage, json::object>{sa, expect_assignment},
                                        std::pair<rdzv::ServerMessage, json::object>{pr, expect_progress}}) {
    std::string bytes = encoded(message);
    // encode_decision writes the same bytes as encode_server.
    std::string via_action;
    if (const auto* s = std::get_if<rdzv::SendAssignment>(&message)) rdzv::encode_decision(via_action, *s);
    if (const auto* p = std::get_if<rdzv::Progress>(&message)) rdzv::encode_decision(via_action, *p);
    CHECK(via_action == bytes);
    REQUIRE(bytes.size() > rdzv::native_header_bytes);
    std::uint32_t len = 0;
    for (std::size_t b = 0; b < 4; ++b)
      len |= static_cast<std::uint32_t>(static_cast<unsigned char>(bytes[1 + b])) << (8 * b);
    REQUIRE(len == bytes.size() - rdzv::native_header_bytes);
    const json::value parsed = json::parse(std::string_view(bytes).substr(rdzv::native_header_bytes));
    CHECK(parsed == json::value(expect));
    rdzv::ServerMessage back;
    REQUIRE(rdzv::decode_server(bytes, {}, back).status == rdzv::DecodeStatus::ok);
    CHECK(encoded(back) == bytes);
  }
  rdzv::ServerMessage back;
  REQUIRE(rdzv::decode_server(encoded(sa), {}, back).status == rdzv::DecodeStatus::ok);
  const auto& got = std::get<rdzv::SendAssignment>(back);
  CHECK(got.run_id == sa.run_id);
  CHECK(got.node == id);
  CHECK(got.assignment == a);
}

TEST_CASE("NodeInfo.nccl_any_rank travels as an optional field", "[wire][nccl]") {
  rdzv::NodeInfo n = info(1);
  for (const bool any : {false, true}) {
    n.nccl_any_rank = any;
    const std::string bytes = encoded(rdzv::JoinMessage{"job", rdzv::JoinRequest{n, config()}});
    CHECK((bytes.find("nccl_any_rank") != std::string::npos) == any);  // absent when false
    rdzv::ClientMessage back;
    REQUIRE(rdzv::decode_client(bytes, {}, back).status == rdzv::DecodeStatus::ok);
    CHECK(std::get<rdzv::JoinMessage>(back).request.node.nccl_any_rank == any);
  }
}

TEST_CASE("an ASSIGNMENT whose IDs carry their hex encodes the same bytes", "[wire][nccl]") {
  // A round's IDs are hex-encoded once (SharedBytes::with_hex) for all its assignments.
  std::vector<std::uint8_t> ids(3 * 128);
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::uint8_t>(i * 37 + 5);
  rdzv::Assignment plain = assignment();
  plain.nccl_id = ids;
  rdzv::Assignment cached = plain;
  cached.nccl_id = rdzv::SharedBytes::with_hex(ids);
  REQUIRE(cached.nccl_id.hex() != nullptr);
  CHECK(plain.nccl_id.hex() == nullptr);
  CHECK(cached.nccl_id.held_bytes() == 3 * ids.size());
  const std::string a = encoded(rdzv::SendAssignment{"job", node(1), plain});
  const std::string b = encoded(rdzv::SendAssignment{"job", node(1), cached});
  CHECK(a == b);
  CHECK(b.find(std::string("\"nccl_id\":\"") + *cached.nccl_id.hex() + "\"") != std::string::npos);
  rdzv::ServerMessage back;
  REQUIRE(rdzv::decode_server(b, {}, back).status == rdzv::DecodeStatus::ok);
  CHECK(std::get<rdzv::SendAssignment>(back).assignment.nccl_id == ids);
  CHECK(rdzv::SharedBytes::with_hex({}).hex() == nullptr);  // nothing to encode
}

TEST_CASE("a WORKER_FAILED message past the bound is cut at a character boundary", "[wire]") {
  // The job keeps the message as its root cause and repeats it to every node: a frame's worth
  // (1 MiB) per job is what a peer may send, not what the daemon keeps.
  rdzv::WorkerFailure f = failure();
  f.message = std::string(rdzv::max_failure_message_bytes - 1, 'a') + "\xc3\xa9" + std::string(5000, 'b');
  std::string bytes;
  rdzv::encode_client(bytes, rdzv::WorkerFailedMessage{"job-a", f});
  rdzv::ClientMessage back;
  REQUIRE(rdzv::decode_client(bytes, {}, back).status == rdzv::DecodeStatus::ok);
  const std::string& got = std::get<rdzv::WorkerFailedMessage>(back).failure.message;
  // The two-byte character straddling the bound is dropped whole, and the cut says how much.
  CHECK(got == std::string(rdzv::max_failure_message_bytes - 1, 'a') + " [... 5002 more bytes cut by the rendezvous]");
  // A message within the bound arrives as sent.
  f.message = std::string(rdzv::max_failure_message_bytes, 'c');
  bytes.clear();
  rdzv::encode_client(bytes, rdzv::WorkerFailedMessage{"job-a", f});
  REQUIRE(rdzv::decode_client(bytes, {}, back).status == rdzv::DecodeStatus::ok);
  CHECK(std::get<rdzv::WorkerFailedMessage>(back).failure.message == f.message);
}

TEST_CASE("a failure message cut for the reasons every node gets stays valid UTF-8", "[wire]") {
  // describe() cuts the message at 512 bytes for the RESTART and job-failure reasons: a cut
  // through a multi-byte character made a frame that no agent could decode.
  rdzv::RootCause cause;
  cause.failure = failure();
  cause.failure.message = std::string(511, 'a') + "\xc3\xa9" + std::string(100, 'b');
  rdzv::SendRestart restart;
  restart.run_id = "job-a";
  restart.reason = cause.describe();
  std::string bytes;
  rdzv::encode_server(bytes, restart);
  rdzv::ServerMessage back;
  REQUIRE(rdzv::decode_server(bytes, {}, back).status == rdzv::DecodeStatus::ok);
  CHECK(std::get<rdzv::SendRestart>(back).reason.find(std::string(511, 'a') + " [... 102 more bytes]") !=
        std::string::npos);
}

TEST_CASE("a payload of tiny JSON values is refused at its decode cap, not after its DOM is built", "[wire]") {
  // `[0,0,...]`: 2 bytes of text a value, 16 of DOM value and 16 more on the parser's stack. Before
  // the cap, this 2 MiB STATUS_REPLY took ~34 MiB to be found not to be a status.
  const rdzv::WireLimits status_limits{std::size_t{64} << 20, 16};
  std::string payload = "{\"jobs\":[0";
  while (payload.size() < (std::size_t{2} << 20)) payload += ",0";
  payload += "]}";
  rdzv::ServerMessage back;
  const auto r = rdzv::decode_server(frame(0x67, payload), status_limits, back);
  REQUIRE(r.status == rdzv::DecodeStatus::error);
  INFO(r.reason);
  CHECK(r.reason.find("bad rendezvous STATUS_REPLY message: a payload of 2097154 bytes would take more than 12.0 MiB "
                      "to decode") != std::string::npos);
  // The daemon's side: a JOIN of nested empty arrays at the 1 MiB frame limit.
  std::string join = "{\"run_id\":\"j\",\"x\":[[]";
  while (join.size() < (std::size_t{1} << 20) - 4) join += ",[]";
  join += "]}";
  const auto c = decode_c(frame(0x40, join));
  REQUIRE(c.status == rdzv::DecodeStatus::error);
  CHECK(c.reason.find("would take more than 6.0 MiB to decode") != std::string::npos);
}

TEST_CASE("a STATUS_REPLY of 100,000 members decodes within its cap", "[wire]") {
  // What a real daemon sends for one job at the 100,000-agent goal (docs/daemon.md): the cap
  // must leave it room (long host names, instance ids and every optional field present).
  rdzv::RegistryStatus status;
  rdzv::JobStatus j;
  j.run_id = "job-a";
  j.state = rdzv::JobState::running;
  j.max_nodes = 100000;
  j.progress = "running round 1";
  for (int i = 0; i < 100000; ++i) {
    rdzv::NodeId id{"node-" + std::to_string(i) + ".rack-" + std::to_string(i / 64) + ".cluster.example.com",
                    100000 + i, "agent-" + std::to_string(i)};
    j.members.push_back(rdzv::MemberStatus{
        id, id.addr, 8, rdzv::MemberRole::participant, i, i % 2 == 0, i % 3 == 0, 250ms, 2750ms, {}});
  }
  status.jobs.push_back(j);
  std::string bytes;
  rdzv::encode_server(bytes, status);
  CAPTURE(bytes.size());
  rdzv::ServerMessage back;
  const auto r = rdzv::decode_server(bytes, rdzv::WireLimits{std::size_t{64} << 20, 16}, back);
  INFO(r.reason);
  REQUIRE(r.status == rdzv::DecodeStatus::ok);
  CHECK(std::get<rdzv::RegistryStatus>(back).jobs.at(0).members.size() == 100000);
}

TEST_CASE("a STATUS_REPLY naming a role or state this build does not know still decodes", "[wire]") {
  // A daemon newer than this `ddprun status`: the name is kept for display, the reply is not lost.
  rdzv::RegistryStatus status;
  rdzv::JobStatus j;
  j.run_id = "job-a";
  j.state = rdzv::JobState::running;
  j.members.push_back(
      rdzv::MemberStatus{node(1), "10.0.0.1", 4, rdzv::MemberRole::participant, 0, false, false, 250ms, 2750ms, {}});
  status.jobs.push_back(j);
  std::string bytes;
  rdzv::encode_server(bytes, status);
  const auto with = [&](std::string_view from, std::string_view to) {
    std::string payload = bytes.substr(5);
    const auto at = payload.find(from);
    REQUIRE(at != std::string::npos);
    payload.replace(at, from.size(), to);
    return frame(static_cast<std::uint8_t>(bytes[0]), payload);
  };
  rdzv::ServerMessage back;
  const auto r = rdzv::decode_server(with(R"("state":"running")", R"("state":"draining")"), {}, back);
  INFO(r.reason);
  REQUIRE(r.status == rdzv::DecodeStatus::ok);
  CHECK(rdzv::state_label(std::get<rdzv::RegistryStatus>(back).jobs.at(0)) == "draining");
  CHECK(rdzv::role_label(std::get<rdzv::RegistryStatus>(back).jobs.at(0).members.at(0)) == "participant");

  const auto m = rdzv::decode_server(with(R"("role":"participant")", R"("role":"observer")"), {}, back);
  INFO(m.reason);
  REQUIRE(m.status == rdzv::DecodeStatus::ok);
  const auto& job = std::get<rdzv::RegistryStatus>(back).jobs.at(0);
  CHECK(rdzv::role_label(job.members.at(0)) == "observer");
  CHECK(rdzv::state_label(job) == "running");
  std::string again;
  rdzv::encode_server(again, back);  // what a relay would pass on: the name, not the default
  CHECK(again.find(R"("role":"observer")") != std::string::npos);

  // Still a string, and not an empty one.
  for (std::string_view bad : {R"("role":"")", R"("role":7)"}) {
    CAPTURE(bad);
    const auto e = rdzv::decode_server(with(R"("role":"participant")", bad), {}, back);
    CHECK(e.status == rdzv::DecodeStatus::error);
    CHECK(e.reason.find("members[0].role") != std::string::npos);
  }
}
