// Native rendezvous frames: the decoders (rendezvous_wire.hpp has the contract;
// rendezvous_wire.cpp the encoders).
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
#include "ddprun/rendezvous/json_capped.hpp"
#include "ddprun/rendezvous/rendezvous_auth.hpp"

namespace ddprun::rendezvous {

namespace json = boost::json;

namespace {

// ---- decoding helpers ----

struct WireError {
  std::string what;
};

class Reader {
 public:
  Reader(const json::object& o, std::string path) : o_(o), path_(std::move(path)) {}

  const json::value* find(const char* key) const {
    auto it = o_.find(key);
    if (it == o_.end() || it->value().is_null()) return nullptr;
    return &it->value();
  }
  const json::value& need(const char* key) const {
    const json::value* v = find(key);
    if (v == nullptr) throw WireError{fmt::format("missing field '{}{}'", path_, key)};
    return *v;
  }
  [[noreturn]] void bad(const char* key, const char* want) const {
    throw WireError{fmt::format("field '{}{}' must be {}", path_, key, want)};
  }

  std::string str(const char* key) const {
    const json::value& v = need(key);
    if (!v.is_string()) bad(key, "a string");
    return std::string(v.get_string());
  }
  std::string str_or(const char* key, std::string fallback) const { return find(key) ? str(key) : fallback; }
  // Exactly `bytes` bytes as lower-case hex (nonces, MACs, node secrets).
  std::string hex_of(const char* key, std::size_t bytes) const {
    std::string s = str(key);
    if (!auth::is_hex_of(s, bytes)) {
      throw WireError{fmt::format("field '{}{}' must be {} lower-case hex digits", path_, key, 2 * bytes)};
    }
    return s;
  }
  std::int64_t i64(const char* key, std::int64_t lo, std::int64_t hi) const {
    const json::value& v = need(key);
    std::int64_t x = 0;
    if (v.is_int64()) {
      x = v.get_int64();
    } else if (v.is_uint64() &&
               v.get_uint64() <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      x = static_cast<std::int64_t>(v.get_uint64());
    } else {
      bad(key, "an integer");
    }
    if (x < lo || x > hi) {
      throw WireError{fmt::format("field '{}{}' = {} is out of range [{}, {}]", path_, key, x, lo, hi)};
    }
    return x;
  }
  int i32(const char* key, int lo = std::numeric_limits<int>::min(), int hi = std::numeric_limits<int>::max()) const {
    return static_cast<int>(i64(key, lo, hi));
  }
  std::optional<int> opt_i32(const char* key) const {
    if (!find(key)) return std::nullopt;
    return i32(key);
  }
  std::uint64_t u64(const char* key) const {
    const json::value& v = need(key);
    if (v.is_uint64()) return v.get_uint64();
    if (v.is_int64() && v.get_int64() >= 0) return static_cast<std::uint64_t>(v.get_int64());
    bad(key, "a non-negative integer");
  }
  bool boolean(const char* key) const {
    const json::value& v = need(key);
    if (!v.is_bool()) bad(key, "true or false");
    return v.get_bool();
  }
  Duration duration_ms(const char* key) const {
    // Bounded so that the conversion to nanoseconds cannot overflow (~ 292 years).
    return std::chrono::milliseconds(i64(key, -(std::int64_t{1} << 42), std::int64_t{1} << 42));
  }
  std::optional<Duration> opt_duration_ms(const char* key) const {
    if (!find(key)) return std::nullopt;
    return duration_ms(key);
  }
  Reader obj(const char* key) const {
    const json::value& v = need(key);
    if (!v.is_object()) bad(key, "an object");
    return Reader(v.get_object(), path_ + key + ".");
  }
  const json::array& arr(const char* key) const {
    const json::value& v = need(key);
    if (!v.is_array()) bad(key, "an array");
    return v.get_array();
  }
  const std::string& path() const { return path_; }

 private:
  const json::object& o_;
  std::string path_;
};

NodeId read_node_id(const Reader& r) {
  NodeId id;
  id.addr = r.str("addr");
  id.pid = r.i64("pid", std::numeric_limits<std::int64_t>::min(), std::numeric_limits<std::int64_t>::max());
  id.instance = r.str("instance");
  return id;
}

std::vector<std::uint8_t> unhex(const Reader& r, const char* key);

NodeInfo read_node_info(const Reader& r) {
  NodeInfo n;
  n.id = read_node_id(r.obj("id"));
  n.addr = r.str("addr");
  n.local_world_size = r.i32("local_world_size");
  n.store_host = r.str_or("store_host", "");
  n.store_port = r.find("store_port") ? static_cast<std::uint16_t>(r.i64("store_port", 0, 65535)) : 0;
  n.nccl_ids = unhex(r, "nccl_ids");
  if (n.nccl_ids.size() % 128 != 0) r.bad("nccl_ids", "a whole number of 128-byte NCCL unique IDs in hex");
  if (r.find("order")) n.order = r.i64("order", 0, std::numeric_limits<std::int32_t>::max());
  if (r.find("nccl_any_rank")) n.nccl_any_rank = r.boolean("nccl_any_rank");
  return n;
}

JobConfig read_config(const Reader& r) {
  JobConfig c;
  c.min_nodes = r.i32("min_nodes");
  c.max_nodes = r.i32("max_nodes");
  c.max_restarts = r.i32("max_restarts");
  c.join_timeout = r.duration_ms("join_timeout_ms");
  c.last_call_timeout = r.duration_ms("last_call_timeout_ms");
  c.close_timeout = r.duration_ms("close_timeout_ms");
  c.heartbeat_interval = r.duration_ms("heartbeat_interval_ms");
  c.missed_heartbeats = r.i32("missed_heartbeats");
  c.exit_barrier_timeout = r.duration_ms("exit_barrier_timeout_ms");
  c.rebuild_grace = r.duration_ms("rebuild_grace_ms");
  return c;
}

std::vector<std::uint8_t> unhex(const Reader& r, const char* key) {
  const auto bytes = from_hex(r.str_or(key, ""));
  if (!bytes) r.bad(key, "a hex string of even length");
  return {bytes->begin(), bytes->end()};
}

Assignment read_assignment(const Reader& r) {
  Assignment a;
  a.round = r.u64("round");
  a.group_rank = r.i32("group_rank");
  a.group_world_size = r.i32("group_world_size");
  a.local_world_size = r.i32("local_world_size");
  a.rank_offset = r.i32("rank_offset");
  a.world_size = r.i32("world_size");
  a.master_addr = r.str("master_addr");
  a.master_port = static_cast<std::uint16_t>(r.i64("master_port", 0, 65535));
  a.restart_count = r.i32("restart_count");
  a.max_restarts = r.i32("max_restarts");
  a.nccl_id = unhex(r, "nccl_id");
  return a;
}

WorkerFailure read_failure(const Reader& r) {
  WorkerFailure f;
  f.round = r.u64("round");
  f.node = read_node_id(r.obj("node"));
  f.global_rank = r.i32("global_rank");
  f.local_rank = r.i32("local_rank");
  f.exit_code = r.opt_i32("exit_code");
  f.signal = r.opt_i32("signal");
  // ddprun exits with 128 + signal: a signal number that is no signal would overflow it.
  if (f.signal && (*f.signal < 1 || *f.signal > 127)) r.bad("signal", "a signal number between 1 and 127");
  f.message = r.str_or("message", "");
  if (f.message.size() > max_failure_message_bytes) {
    const std::size_t total = f.message.size();
    const std::size_t cut = utf8_prefix(f.message, max_failure_message_bytes).size();
    f.message.resize(cut);
    f.message += fmt::format(" [... {} more bytes cut by the rendezvous]", total - cut);
  }
  return f;
}

RootCause read_root_cause(const Reader& r) {
  RootCause c;
  c.failure = read_failure(r.obj("failure"));
  c.node_addr = r.str("node_addr");
  c.group_rank = r.i32("group_rank");
  return c;
}

// A status enum: a name this build does not know (a newer daemon's) is kept as `unknown`, for
// display only, rather than failing the whole reply; it must still be a non-empty string.
template <typename Enum, std::size_t N>
Enum read_enum(const Reader& r, const char* key, const char* what, const std::array<Enum, N>& values,
               std::string& unknown) {
  std::string s = r.str(key);
  for (Enum e : values) {
    if (s == to_string(e)) return e;
  }
  if (s.empty()) r.bad(key, what);
  unknown = std::move(s);
  return values.front();
}

JobStatus read_job_status(const Reader& r) {
  JobStatus j;
  j.run_id = r.str("run_id");
  j.state =
      read_enum(r, "state", "a state name",
                std::array{JobState::waiting, JobState::running, JobState::completed, JobState::failed}, j.state_name);
  j.closed = r.boolean("closed");
  j.round = r.u64("round");
  j.min_nodes = r.i32("min_nodes");
  j.max_nodes = r.i32("max_nodes");
  j.restarts_used = r.i32("restarts_used");
  j.max_restarts = r.i32("max_restarts");
  std::size_t i = 0;
  for (const json::value& v : r.arr("members")) {
    const std::string path = fmt::format("{}members[{}].", r.path(), i++);
    if (!v.is_object()) throw WireError{fmt::format("field '{}' must be an object", path)};
    Reader m(v.get_object(), path);
    MemberStatus s;
    s.id = read_node_id(m.obj("id"));
    s.addr = m.str("addr");
    s.local_world_size = m.i32("local_world_size");
    s.role = read_enum(m, "role", "a role name",
                       std::array{MemberRole::joined, MemberRole::expected, MemberRole::participant, MemberRole::late,
                                  MemberRole::spare},
                       s.role_name);
    s.group_rank = m.i32("group_rank");
    s.succeeded = m.boolean("succeeded");
    s.disconnected = m.boolean("disconnected");
    s.last_heartbeat_age = m.duration_ms("last_heartbeat_age_ms");
    s.lease_left = m.duration_ms("lease_left_ms");
    j.members.push_back(std::move(s));
  }
  j.join_timeout_in = r.opt_duration_ms("join_timeout_in_ms");
  j.last_call_in = r.opt_duration_ms("last_call_in_ms");
  j.exit_barrier_in = r.opt_duration_ms("exit_barrier_in_ms");
  j.rebuild_in = r.opt_duration_ms("rebuild_in_ms");
  j.gc_in = r.opt_duration_ms("gc_in_ms");
  j.progress = r.str_or("progress", "");
  j.result = r.str_or("result", "");
  if (r.find("last_failure")) j.last_failure = read_root_cause(r.obj("last_failure"));
  return j;
}

// Splits off one frame: need_more / error (payload limit) / ok with op and payload.
DecodeResult split_frame(std::string_view buffer, const WireLimits& limits, std::uint8_t& op,
                         std::string_view& payload) {
  DecodeResult res;
  if (buffer.size() < native_header_bytes) {
    res.status = DecodeStatus::need_more;
    res.min_total = native_header_bytes;
    return res;
  }
  op = static_cast<std::uint8_t>(buffer[0]);
  const auto n = bytes::load_le<std::uint32_t>(buffer.data() + 1);
  if (n > limits.max_payload_bytes) {
    res.status = DecodeStatus::error;
    res.reason = fmt::format("rendezvous {} payload of {} bytes exceeds the limit of {} bytes", native_op_name(op), n,
                             limits.max_payload_bytes);
    return res;
  }
  const std::size_t total = native_header_bytes + n;
  if (buffer.size() < total) {
    res.status = DecodeStatus::need_more;
    res.min_total = total;
    return res;
  }
  payload = buffer.substr(native_header_bytes, n);
  res.status = DecodeStatus::ok;
  res.consumed = total;
  return res;
}

// Parses a JSON payload into an object, in bounded memory (json_capped.hpp); throws WireError.
json::value parse_payload(std::string_view payload, const WireLimits& limits) {
  CappedJson parsed = parse_json_capped(payload, static_cast<std::size_t>(std::max(limits.max_json_depth, 1)));
  if (!parsed.over_cap.empty()) throw WireError{parsed.over_cap + ": no ddprun sends such a frame"};
  if (!parsed.invalid.empty()) throw WireError{fmt::format("payload is not valid JSON ({})", parsed.invalid)};
  if (!parsed.value.is_object()) throw WireError{"payload must be a JSON object"};
  return std::move(parsed.value);
}

template <typename Out, typename Fn>
DecodeResult decode_with(std::string_view buffer, const WireLimits& limits, Out& out, Fn&& build) {
  std::uint8_t op = 0;
  std::string_view payload;
  DecodeResult res = split_frame(buffer, limits, op, payload);
  if (res.status != DecodeStatus::ok) return res;
  try {
    const json::value v = parse_payload(payload, limits);
    out = build(op, Reader(v.get_object(), ""));
  } catch (const WireError& e) {
    res.status = DecodeStatus::error;
    res.consumed = 0;
    res.reason = fmt::format("bad rendezvous {} message: {}", native_op_name(op), e.what);
  } catch (const std::exception& e) {  // allocation failures and the like
    res.status = DecodeStatus::error;
    res.consumed = 0;
    res.reason = fmt::format("bad rendezvous {} message: {}", native_op_name(op), e.what());
  }
  return res;
}

}  // namespace

DecodeResult decode_client(std::string_view buffer, const WireLimits& limits, ClientMessage& out) {
  return decode_with(buffer, limits, out, [](std::uint8_t op, const Reader& r) -> ClientMessage {
    switch (static_cast<NativeOp>(op)) {
      case NativeOp::join: {
        JoinMessage m;
        m.run_id = r.str("run_id");
        m.request.node = read_node_info(r.obj("node"));
        m.request.config = read_config(r.obj("config"));
        return m;
      }
      case NativeOp::rejoin: {
        RejoinMessage m;
        m.run_id = r.str("run_id");
        m.request.node = read_node_info(r.obj("node"));
        m.request.config = read_config(r.obj("config"));
        if (r.find("node_secret")) m.request.node_secret = r.hex_of("node_secret", auth::node_secret_bytes);
        if (r.find("assignment")) m.request.assignment = read_assignment(r.obj("assignment"));
        return m;
      }
      case NativeOp::heartbeat:
        return HeartbeatMessage{r.str("run_id"), read_node_id(r.obj("node"))};
      case NativeOp::leave:
        return LeaveMessage{r.str("run_id"), read_node_id(r.obj("node"))};
      case NativeOp::worker_failed:
        return WorkerFailedMessage{r.str("run_id"), read_failure(r.obj("failure"))};
      case NativeOp::succeeded:
        return SucceededMessage{r.str("run_id"), read_node_id(r.obj("node")), r.u64("round")};
      case NativeOp::close:
        return CloseMessage{r.str("run_id")};
      case NativeOp::status:
        return StatusMessage{r.str_or("run_id", "")};
      case NativeOp::hello:
        return HelloMessage{r.i32("v", 1, 1), r.hex_of("client_nonce", auth::nonce_bytes)};
      case NativeOp::auth:
        return AuthMessage{r.str("run_id"), r.hex_of("mac", 32)};
      case NativeOp::relay:
        return RelayMessage{r.i32("v", 1, 1), r.find("trusted") != nullptr && r.boolean("trusted")};
      default:
        throw WireError{fmt::format("opcode 0x{:02x} is not a client-to-server rendezvous operation", op)};
    }
  });
}

bool relay_ok_trusted_frames(std::string_view frame) {
  bool trusted = false;
  const DecodeResult res = decode_with(frame, WireLimits{}, trusted, [](std::uint8_t op, const Reader& r) -> bool {
    if (static_cast<NativeOp>(op) != NativeOp::relay_ok) throw WireError{"not RELAY_OK"};
    return r.find("trusted") != nullptr && r.boolean("trusted");
  });
  return res.status == DecodeStatus::ok && trusted;
}

DecodeResult decode_server(std::string_view buffer, const WireLimits& limits, ServerMessage& out) {
  // A server that speaks something else (an HTTP server, a TCPStore, sshd) is named as such
  // from its first byte, not read as a header whose length is four letters of its text.
  if (!buffer.empty()) {
    const auto op = static_cast<std::uint8_t>(buffer[0]);
    if (op < static_cast<std::uint8_t>(NativeOp::assignment) || op > static_cast<std::uint8_t>(NativeOp::relay_ok)) {
      DecodeResult res;
      res.status = DecodeStatus::error;
      res.reason = fmt::format(
          "the server's reply is not ddprun's rendezvous protocol (opcode 0x{:02x} is not a server-to-client "
          "rendezvous operation; it begins \"{}\"): is that address a ddprun-rdzvd, or the worker store of a "
          "--rdzv-backend c10d job's first node?",
          op, terminal_safe(buffer.substr(0, 16)));
      return res;
    }
  }
  return decode_with(buffer, limits, out, [](std::uint8_t op, const Reader& r) -> ServerMessage {
    switch (static_cast<NativeOp>(op)) {
      case NativeOp::assignment:
        return SendAssignment{r.str("run_id"), read_node_id(r.obj("node")), read_assignment(r.obj("assignment"))};
      case NativeOp::restart: {
        SendRestart m;
        m.run_id = r.str("run_id");
        m.node = read_node_id(r.obj("node"));
        m.ended_round = r.u64("ended_round");
        const std::string kind = r.str("kind");
        if (kind == "worker_failure") {
          m.kind = RoundEnd::worker_failure;
        } else if (kind == "membership_change") {
          m.kind = RoundEnd::membership_change;
        } else {
          r.bad("kind", "worker_failure or membership_change");
        }
        m.restart_count = r.i32("restart_count");
        m.reason = r.str_or("reason", "");
        return m;
      }
      case NativeOp::job_failed: {
        SendJobFailed m;
        m.run_id = r.str("run_id");
        m.node = read_node_id(r.obj("node"));
        m.reason = r.str_or("reason", "");
        m.exit_code = r.i32("exit_code");
        if (r.find("root_cause")) m.root_cause = read_root_cause(r.obj("root_cause"));
        return m;
      }
      case NativeOp::job_completed:
        return SendJobCompleted{r.str("run_id"), read_node_id(r.obj("node"))};
      case NativeOp::refused:
        return Refuse{r.str("run_id"), read_node_id(r.obj("node")), r.str_or("reason", ""), RefuseCode::other};
      case NativeOp::ask_rejoin:
        return AskRejoin{r.str("run_id"), read_node_id(r.obj("node")), r.str_or("reason", "")};
      case NativeOp::progress:
        return Progress{r.str("run_id"), read_node_id(r.obj("node")), r.str_or("text", "")};
      case NativeOp::status_reply: {
        RegistryStatus s;
        std::size_t i = 0;
        for (const json::value& v : r.arr("jobs")) {
          const std::string path = fmt::format("jobs[{}].", i++);
          if (!v.is_object()) throw WireError{fmt::format("field '{}' must be an object", path)};
          s.jobs.push_back(read_job_status(Reader(v.get_object(), path)));
        }
        return s;
      }
      case NativeOp::challenge:
        return ChallengeMessage{r.hex_of("server_nonce", auth::nonce_bytes), r.boolean("auth"),
                                r.find("embedded") != nullptr && r.boolean("embedded")};
      case NativeOp::auth_ok:
        return AuthOkMessage{r.hex_of("mac", 32)};
      case NativeOp::joined:
        return JoinedMessage{r.str("run_id"), read_node_id(r.obj("node")),
                             r.hex_of("node_secret", auth::node_secret_bytes)};
      default:
        throw WireError{fmt::format("opcode 0x{:02x} is not a server-to-client rendezvous operation", op)};
    }
  });
}

}  // namespace ddprun::rendezvous
