// Native rendezvous frames: the encoders and native_op_name (rendezvous_wire.hpp has the
// contract; rendezvous_wire_decode.cpp the decoders).
#include "ddprun/rendezvous/rendezvous_wire.hpp"

#include <fmt/format.h>

#include <array>
#include <boost/json.hpp>
#include <iterator>
#include <limits>
#include <string_view>
#include <optional>
#include <type_traits>

#include "ddprun/common/error.hpp"
#include "ddprun/common/strings.hpp"
#include "ddprun/rendezvous/bytes.hpp"

namespace ddprun::rendezvous {

namespace json = boost::json;

namespace {

// ---- encoding helpers ----

std::int64_t ms(Duration d) { return std::chrono::duration_cast<std::chrono::milliseconds>(d).count(); }

json::object node_id_json(const NodeId& id) {
  return json::object{{"addr", id.addr}, {"pid", id.pid}, {"instance", id.instance}};
}

std::string hex(const std::vector<std::uint8_t>& bytes);

json::object node_info_json(const NodeInfo& n) {
  json::object o{{"id", node_id_json(n.id)},
                 {"addr", n.addr},
                 {"local_world_size", n.local_world_size},
                 {"store_host", n.store_host},
                 {"store_port", n.store_port}};
  // Optional (absent = none), so frames without it stay valid both ways.
  if (!n.nccl_ids.empty()) o["nccl_ids"] = hex(n.nccl_ids);
  if (n.order) o["order"] = *n.order;
  if (n.nccl_any_rank) o["nccl_any_rank"] = true;
  return o;
}

json::object config_json(const JobConfig& c) {
  return json::object{{"min_nodes", c.min_nodes},
                      {"max_nodes", c.max_nodes},
                      {"max_restarts", c.max_restarts},
                      {"join_timeout_ms", ms(c.join_timeout)},
                      {"last_call_timeout_ms", ms(c.last_call_timeout)},
                      {"close_timeout_ms", ms(c.close_timeout)},
                      {"heartbeat_interval_ms", ms(c.heartbeat_interval)},
                      {"missed_heartbeats", c.missed_heartbeats},
                      {"exit_barrier_timeout_ms", ms(c.exit_barrier_timeout)},
                      {"rebuild_grace_ms", ms(c.rebuild_grace)}};
}

std::string hex(const std::vector<std::uint8_t>& bytes) {
  return to_hex(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));  // NOLINT: bytes
}

json::object assignment_json(const Assignment& a) {
  return json::object{{"round", a.round},
                      {"group_rank", a.group_rank},
                      {"group_world_size", a.group_world_size},
                      {"local_world_size", a.local_world_size},
                      {"rank_offset", a.rank_offset},
                      {"world_size", a.world_size},
                      {"master_addr", a.master_addr},
                      {"master_port", a.master_port},
                      {"restart_count", a.restart_count},
                      {"max_restarts", a.max_restarts},
                      {"nccl_id", hex(a.nccl_id)}};
}

json::object failure_json(const WorkerFailure& f) {
  json::object o{{"round", f.round},
                 {"node", node_id_json(f.node)},
                 {"global_rank", f.global_rank},
                 {"local_rank", f.local_rank},
                 {"message", f.message}};
  if (f.exit_code) o["exit_code"] = *f.exit_code;
  if (f.signal) o["signal"] = *f.signal;
  return o;
}

json::object root_cause_json(const RootCause& r) {
  return json::object{{"failure", failure_json(r.failure)}, {"node_addr", r.node_addr}, {"group_rank", r.group_rank}};
}

void put_optional_ms(json::object& o, const char* key, const std::optional<Duration>& d) {
  if (d) o[key] = ms(*d);
}

json::object job_status_json(const JobStatus& j) {
  json::array members;
  for (const MemberStatus& m : j.members) {
    members.push_back(json::object{{"id", node_id_json(m.id)},
                                   {"addr", m.addr},
                                   {"local_world_size", m.local_world_size},
                                   {"role", role_label(m)},
                                   {"group_rank", m.group_rank},
                                   {"succeeded", m.succeeded},
                                   {"disconnected", m.disconnected},
                                   {"last_heartbeat_age_ms", ms(m.last_heartbeat_age)},
                                   {"lease_left_ms", ms(m.lease_left)}});
  }
  json::object o{{"run_id", j.run_id},
                 {"state", state_label(j)},
                 {"closed", j.closed},
                 {"round", j.round},
                 {"min_nodes", j.min_nodes},
                 {"max_nodes", j.max_nodes},
                 {"restarts_used", j.restarts_used},
                 {"max_restarts", j.max_restarts},
                 {"members", std::move(members)},
                 {"progress", j.progress},
                 {"result", j.result}};
  put_optional_ms(o, "join_timeout_in_ms", j.join_timeout_in);
  put_optional_ms(o, "last_call_in_ms", j.last_call_in);
  put_optional_ms(o, "exit_barrier_in_ms", j.exit_barrier_in);
  put_optional_ms(o, "rebuild_in_ms", j.rebuild_in);
  put_optional_ms(o, "gc_in_ms", j.gc_in);
  if (j.last_failure) o["last_failure"] = root_cause_json(*j.last_failure);
  return o;
}

// ---- hand-written encoders for the hot frames ----
// A round of N nodes sends N ASSIGNMENT frames at once and every join gets a PROGRESS line; a
// Boost.JSON DOM costs a dozen allocations per frame, so these two are written directly (same
// keys, same JSON; the decoder cannot tell the difference, wire_test checks the round trip).

void put_json_string(std::string& out, std::string_view s) {
  static constexpr char digits[] = "0123456789abcdef";
  out.push_back('"');
  for (const char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(c);
    } else if (u < 0x20) {
      out.append("\\u00");
      out.push_back(digits[u >> 4]);
      out.push_back(digits[u & 0xF]);
    } else {
      out.push_back(c);
    }
  }
  out.push_back('"');
}

void put_node_id(std::string& out, const NodeId& id) {
  out.append("{\"addr\":");
  put_json_string(out, id.addr);
  fmt::format_to(std::back_inserter(out), ",\"pid\":{},\"instance\":", id.pid);
  put_json_string(out, id.instance);
  out.push_back('}');
}

// Appends op + length placeholder; returns the frame start for end_frame.
std::size_t begin_frame(std::string& out, NativeOp op) {
  const std::size_t start = out.size();
  bytes::put_u8(out, static_cast<std::uint8_t>(op));
  bytes::put_u32(out, 0);
  return start;
}

// Patches the payload length of the frame that begins at `start`.
void end_frame(std::string& out, std::size_t start, NativeOp op) {
  const std::size_t body = out.size() - start - native_header_bytes;
  if (body > std::numeric_limits<std::uint32_t>::max()) {
    throw Error(fmt::format("rendezvous {} message of {} bytes is too large",
                            native_op_name(static_cast<std::uint8_t>(op)), body),
                "this is a bug in ddprun");
  }
  bytes::store_le(out.data() + start + 1, static_cast<std::uint32_t>(body));
}

// A frame whose payload is a Boost.JSON object (the frames that are not on the hot path).
void frame(std::string& out, NativeOp op, const json::object& payload) {
  const std::size_t start = begin_frame(out, op);
  out.append(json::serialize(payload));
  end_frame(out, start, op);
}

void frame_assignment(std::string& out, const SendAssignment& m) {
  const std::size_t start = begin_frame(out, NativeOp::assignment);
  const Assignment& a = m.assignment;
  out.append("{\"run_id\":");
  put_json_string(out, m.run_id);
  out.append(",\"node\":");
  put_node_id(out, m.node);
  fmt::format_to(std::back_inserter(out),
                 ",\"assignment\":{{\"round\":{},\"group_rank\":{},\"group_world_size\":{},"
                 "\"local_world_size\":{},\"rank_offset\":{},\"world_size\":{},\"master_addr\":",
                 a.round, a.group_rank, a.group_world_size, a.local_world_size, a.rank_offset, a.world_size);
  put_json_string(out, a.master_addr);
  fmt::format_to(std::back_inserter(out), ",\"master_port\":{},\"restart_count\":{},\"max_restarts\":{},\"nccl_id\":\"",
                 a.master_port, a.restart_count, a.max_restarts);
  if (const std::string* h = a.nccl_id.hex()) {
    out.append(*h);  // a round's IDs: encoded once for all its assignments
  } else {
    out.append(hex(a.nccl_id));
  }
  out.append("\"}}");
  end_frame(out, start, NativeOp::assignment);
}

void frame_progress(std::string& out, const Progress& m) {
  const std::size_t start = begin_frame(out, NativeOp::progress);
  out.append("{\"run_id\":");
  put_json_string(out, m.run_id);
  out.append(",\"node\":");
  put_node_id(out, m.node);
  out.append(",\"text\":");
  put_json_string(out, m.text);
  out.push_back('}');
  end_frame(out, start, NativeOp::progress);
}

}  // namespace

const char* native_op_name(std::uint8_t op) {
  switch (static_cast<NativeOp>(op)) {
    case NativeOp::join:
      return "JOIN";
    case NativeOp::rejoin:
      return "REJOIN";
    case NativeOp::heartbeat:
      return "HEARTBEAT";
    case NativeOp::leave:
      return "LEAVE";
    case NativeOp::worker_failed:
      return "WORKER_FAILED";
    case NativeOp::succeeded:
      return "SUCCEEDED";
    case NativeOp::close:
      return "CLOSE";
    case NativeOp::status:
      return "STATUS";
    case NativeOp::hello:
      return "HELLO";
    case NativeOp::auth:
      return "AUTH";
    case NativeOp::relay:
      return "RELAY";
    case NativeOp::relay_ok:
      return "RELAY_OK";
    case NativeOp::challenge:
      return "CHALLENGE";
    case NativeOp::auth_ok:
      return "AUTH_OK";
    case NativeOp::joined:
      return "JOINED";
    case NativeOp::assignment:
      return "ASSIGNMENT";
    case NativeOp::restart:
      return "RESTART";
    case NativeOp::job_failed:
      return "JOB_FAILED";
    case NativeOp::job_completed:
      return "JOB_COMPLETED";
    case NativeOp::refused:
      return "REFUSED";
    case NativeOp::ask_rejoin:
      return "ASK_REJOIN";
    case NativeOp::progress:
      return "PROGRESS";
    case NativeOp::status_reply:
      return "STATUS_REPLY";
  }
  static constexpr std::array<const char*, 256> names = [] {
    std::array<const char*, 256> a{};
    for (auto& s : a) s = "unknown op";
    return a;
  }();
  return names[op];
}

void encode_client(std::string& out, const ClientMessage& message) {
  std::visit(
      [&](const auto& m) {
        using T = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<T, JoinMessage>) {
          frame(out, NativeOp::join,
                json::object{{"run_id", m.run_id},
                             {"node", node_info_json(m.request.node)},
                             {"config", config_json(m.request.config)}});
        } else if constexpr (std::is_same_v<T, RejoinMessage>) {
          json::object o{{"run_id", m.run_id},
                         {"node", node_info_json(m.request.node)},
                         {"config", config_json(m.request.config)}};
          if (!m.request.node_secret.empty()) o["node_secret"] = m.request.node_secret;
          if (m.request.assignment) o["assignment"] = assignment_json(*m.request.assignment);
          frame(out, NativeOp::rejoin, o);
        } else if constexpr (std::is_same_v<T, HeartbeatMessage>) {
          frame(out, NativeOp::heartbeat, json::object{{"run_id", m.run_id}, {"node", node_id_json(m.node)}});
        } else if constexpr (std::is_same_v<T, LeaveMessage>) {
          frame(out, NativeOp::leave, json::object{{"run_id", m.run_id}, {"node", node_id_json(m.node)}});
        } else if constexpr (std::is_same_v<T, WorkerFailedMessage>) {
          frame(out, NativeOp::worker_failed, json::object{{"run_id", m.run_id}, {"failure", failure_json(m.failure)}});
        } else if constexpr (std::is_same_v<T, SucceededMessage>) {
          frame(out, NativeOp::succeeded,
                json::object{{"run_id", m.run_id}, {"node", node_id_json(m.node)}, {"round", m.round}});
        } else if constexpr (std::is_same_v<T, CloseMessage>) {
          frame(out, NativeOp::close, json::object{{"run_id", m.run_id}});
        } else if constexpr (std::is_same_v<T, StatusMessage>) {
          frame(out, NativeOp::status, json::object{{"run_id", m.run_id}});
        } else if constexpr (std::is_same_v<T, HelloMessage>) {
          frame(out, NativeOp::hello, json::object{{"v", m.version}, {"client_nonce", m.client_nonce}});
        } else if constexpr (std::is_same_v<T, AuthMessage>) {
          frame(out, NativeOp::auth, json::object{{"run_id", m.run_id}, {"mac", m.mac}});
        } else {
          static_assert(std::is_same_v<T, RelayMessage>);
          json::object o{{"v", m.version}};
          if (m.trusted_frames) o["trusted"] = true;
          frame(out, NativeOp::relay, std::move(o));
        }
      },
      message);
}

namespace {

// One server message of any type (shared by encode_server and encode_decision, so a Decision is
// encoded in place rather than copied into a ServerMessage first).
template <class T>
void encode_one(std::string& out, const T& m) {
  if constexpr (std::is_same_v<T, SendAssignment>) {
    frame_assignment(out, m);
  } else if constexpr (std::is_same_v<T, SendRestart>) {
    frame(out, NativeOp::restart,
          json::object{{"run_id", m.run_id},
                       {"node", node_id_json(m.node)},
                       {"ended_round", m.ended_round},
                       {"kind", m.kind == RoundEnd::worker_failure ? "worker_failure" : "membership_change"},
                       {"restart_count", m.restart_count},
                       {"reason", m.reason}});
  } else if constexpr (std::is_same_v<T, SendJobFailed>) {
    json::object o{
        {"run_id", m.run_id}, {"node", node_id_json(m.node)}, {"reason", m.reason}, {"exit_code", m.exit_code}};
    if (m.root_cause) o["root_cause"] = root_cause_json(*m.root_cause);
    frame(out, NativeOp::job_failed, o);
  } else if constexpr (std::is_same_v<T, SendJobCompleted>) {
    frame(out, NativeOp::job_completed, json::object{{"run_id", m.run_id}, {"node", node_id_json(m.node)}});
  } else if constexpr (std::is_same_v<T, Refuse>) {
    frame(out, NativeOp::refused,
          json::object{{"run_id", m.run_id}, {"node", node_id_json(m.node)}, {"reason", m.reason}});
  } else if constexpr (std::is_same_v<T, AskRejoin>) {
    frame(out, NativeOp::ask_rejoin,
          json::object{{"run_id", m.run_id}, {"node", node_id_json(m.node)}, {"reason", m.reason}});
  } else if constexpr (std::is_same_v<T, Progress>) {
    frame_progress(out, m);
  } else if constexpr (std::is_same_v<T, ChallengeMessage>) {
    json::object o{{"server_nonce", m.server_nonce}, {"auth", m.auth}};
    if (m.embedded) o["embedded"] = true;
    frame(out, NativeOp::challenge, std::move(o));
  } else if constexpr (std::is_same_v<T, AuthOkMessage>) {
    frame(out, NativeOp::auth_ok, json::object{{"mac", m.mac}});
  } else if constexpr (std::is_same_v<T, JoinedMessage>) {
    frame(out, NativeOp::joined,
          json::object{{"run_id", m.run_id}, {"node", node_id_json(m.node)}, {"node_secret", m.node_secret}});
  } else {
    static_assert(std::is_same_v<T, RegistryStatus>);
    json::array jobs;
    for (const JobStatus& j : m.jobs) jobs.push_back(job_status_json(j));
    frame(out, NativeOp::status_reply, json::object{{"jobs", std::move(jobs)}});
  }
}

}  // namespace

void encode_server(std::string& out, const ServerMessage& message) {
  std::visit([&](const auto& m) { encode_one(out, m); }, message);
}

void encode_relay_ok(std::string& out, bool trusted_frames) {
  json::object o;
  if (trusted_frames) o["trusted"] = true;
  frame(out, NativeOp::relay_ok, std::move(o));
}

void encode_decision(std::string& out, const Decision& action) {
  std::visit([&](const auto& a) { encode_one(out, a); }, action);
}

}  // namespace ddprun::rendezvous
