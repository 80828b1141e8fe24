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

namespace ddprun::rendezvous {

namespace json = boost::json;

namespace {

// ---- encoding helpers ----

std::int64_t ms(Duration d) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(d).count();
}

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
  return json::object{
      {"failure", failure_json(r.failure)}, {"node_addr", r.node_addr}, {"group_rank", r.group_rank}};
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
                                   {"role", to_string(m.role)},
                                   {"group_rank", m.group_rank},
                                   {"succeeded", m.succeeded},
                                   {"disconnected", m.disconnected},
                                   {"last_heartbeat_age_ms", ms(m.last_heartbeat_age)},
                                   {"lease_left_ms", ms(m.lease_left)}});
  }
  json::object o{{"run_id", j.run_id},
                 {"state", to_string(j.state)},
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

void frame(std::string& out, NativeOp op, const json::object& payload) {
  const std::string body = json::serialize(payload);
  if (body.size() > std::numeric_limits<std::uint32_t>::max()) {
    throw Error(fmt::format("rendezvous {} message of {} bytes is too large", native_op_name(static_cast<std::uint8_t>(op)),
                            body.size()),
                "this is a bug in ddprun");
  }
  const auto n = static_cast<std::uint32_t>(body.size());
  out.push_back(static_cast<char>(op));
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xFFu));
  out.append(body);
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
  out.push_back(static_cast<char>(op));
  out.append(4, '\0');
  return start;
}

void end_frame(std::string& out, std::size_t start, NativeOp op) {
  const std::size_t body = out.size() - start - native_header_bytes;
  if (body > std::numeric_limits<std::uint32_t>::max()) {
    throw Error(fmt::format("rendezvous {} message of {} bytes is too large",
                            native_op_name(static_cast<std::uint8_t>(op)), body),
                "this is a bug in ddprun");
  }
  const auto n = static_cast<std::uint32_t>(body);
  for (std::size_t i = 0; i < 4; ++i)
    out[start + 1 + i] = static_cast<char>((n >> (8 * i)) & 0xFFu);
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
                 a.round, a.group_rank, a.group_world_size, a.local_world_size, a.rank_offset,
                 a.world_size);
  put_json_string(out, a.master_addr);
  fmt::format_to(std::back_inserter(out),
                 ",\"master_port\":{},\"restart_count\":{},\"max_restarts\":{},\"nccl_id\":\"",
                 a.master_port, a.restart_count, a.max_restarts);
  out.append(hex(a.nccl_id));
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
  std::string str_or(const char* key, std::string fallback) const {
    return find(key) ? str(key) : fallback;
  }
  std::int64_t i64(const char* key, std::int64_t lo, std::int64_t hi) const {
    const json::value& v = need(key);
    std::int64_t x = 0;
    if (v.is_int64()) {
      x = v.get_int64();
    } else if (v.is_uint64() && v.get_uint64() <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
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
  f.message = r.str_or("message", "");
  return f;
}

RootCause read_root_cause(const Reader& r) {
  RootCause c;
  c.failure = read_failure(r.obj("failure"));
  c.node_addr = r.str("node_addr");
  c.group_rank = r.i32("group_rank");
  return c;
}

template <typename Enum, std::size_t N>
Enum read_enum(const Reader& r, const char* key, const std::array<Enum, N>& values) {
  const std::string s = r.str(key);
  for (Enum e : values) {
    if (s == to_string(e)) return e;
  }
  r.bad(key, "a known state name");
}

JobStatus read_job_status(const Reader& r) {
  JobStatus j;
  j.run_id = r.str("run_id");
  j.state = read_enum(r, "state",
                      std::array{JobState::waiting, JobState::running, JobState::completed, JobState::failed});
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
    s.role = read_enum(m, "role",
                       std::array{MemberRole::joined, MemberRole::expected, MemberRole::participant,
                                  MemberRole::late});
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
  std::uint32_t n = 0;
  for (int i = 0; i < 4; ++i) {
    n |= static_cast<std::uint32_t>(static_cast<unsigned char>(buffer[static_cast<std::size_t>(1 + i)])) << (8 * i);
  }
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

// Parses the JSON payload of `op` into an object; throws WireError.
json::value parse_payload(std::uint8_t op, std::string_view payload, const WireLimits& limits) {
  json::parse_options opts;
  opts.max_depth = static_cast<std::size_t>(std::max(limits.max_json_depth, 1));
  boost::system::error_code ec;
  json::value v = json::parse(json::string_view(payload.data(), payload.size()), ec, {}, opts);
  if (ec) throw WireError{fmt::format("payload is not valid JSON ({})", ec.message())};
  if (!v.is_object()) throw WireError{"payload must be a JSON object"};
  (void)op;
  return v;
}

template <typename Out, typename Fn>
DecodeResult decode_with(std::string_view buffer, const WireLimits& limits, Out& out, Fn&& build) {
  std::uint8_t op = 0;
  std::string_view payload;
  DecodeResult res = split_frame(buffer, limits, op, payload);
  if (res.status != DecodeStatus::ok) return res;
  try {
    const json::value v = parse_payload(op, payload, limits);
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

const char* native_op_name(std::uint8_t op) {
  switch (static_cast<NativeOp>(op)) {
    case NativeOp::join: return "JOIN";
    case NativeOp::rejoin: return "REJOIN";
    case NativeOp::heartbeat: return "HEARTBEAT";
    case NativeOp::leave: return "LEAVE";
    case NativeOp::worker_failed: return "WORKER_FAILED";
    case NativeOp::succeeded: return "SUCCEEDED";
    case NativeOp::close: return "CLOSE";
    case NativeOp::status: return "STATUS";
    case NativeOp::assignment: return "ASSIGNMENT";
    case NativeOp::restart: return "RESTART";
    case NativeOp::job_failed: return "JOB_FAILED";
    case NativeOp::job_completed: return "JOB_COMPLETED";
    case NativeOp::refused: return "REFUSED";
    case NativeOp::ask_rejoin: return "ASK_REJOIN";
    case NativeOp::progress: return "PROGRESS";
    case NativeOp::status_reply: return "STATUS_REPLY";
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
                             {"config", config_json(m.request.config)},
                             {"token", m.request.token}});
        } else if constexpr (std::is_same_v<T, RejoinMessage>) {
          json::object o{{"run_id", m.run_id},
                         {"node", node_info_json(m.request.node)},
                         {"config", config_json(m.request.config)},
                         {"token", m.request.token}};
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
        } else {
          static_assert(std::is_same_v<T, StatusMessage>);
          frame(out, NativeOp::status, json::object{{"run_id", m.run_id}});
        }
      },
      message);
}

namespace {

// One server message of any type (shared by encode_server and encode_action, so an Action is
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
    json::object o{{"run_id", m.run_id},
                   {"node", node_id_json(m.node)},
                   {"reason", m.reason},
                   {"exit_code", m.exit_code}};
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

void encode_action(std::string& out, const Action& action) {
  std::visit([&](const auto& a) { encode_one(out, a); }, action);
}

DecodeResult decode_client(std::string_view buffer, const WireLimits& limits, ClientMessage& out) {
  return decode_with(buffer, limits, out, [](std::uint8_t op, const Reader& r) -> ClientMessage {
    switch (static_cast<NativeOp>(op)) {
      case NativeOp::join: {
        JoinMessage m;
        m.run_id = r.str("run_id");
        m.request.node = read_node_info(r.obj("node"));
        m.request.config = read_config(r.obj("config"));
        m.request.token = r.str_or("token", "");
        return m;
      }
      case NativeOp::rejoin: {
        RejoinMessage m;
        m.run_id = r.str("run_id");
        m.request.node = read_node_info(r.obj("node"));
        m.request.config = read_config(r.obj("config"));
        m.request.token = r.str_or("token", "");
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
      default:
        throw WireError{fmt::format("opcode 0x{:02x} is not a client-to-server rendezvous operation", op)};
    }
  });
}

DecodeResult decode_server(std::string_view buffer, const WireLimits& limits, ServerMessage& out) {
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
        return Refuse{r.str("run_id"), read_node_id(r.obj("node")), r.str_or("reason", "")};
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
      default:
        throw WireError{fmt::format("opcode 0x{:02x} is not a server-to-client rendezvous operation", op)};
    }
  });
}

std::string format_status(const RegistryStatus& status) {
  if (status.jobs.empty()) return "no rendezvous jobs\n";
  std::string out;
  for (const JobStatus& j : status.jobs) {
    out += fmt::format("job '{}': {}{}, round {}, nodes {}:{}, restarts {}/{}\n", j.run_id, to_string(j.state),
                       j.closed ? " (closed)" : "", j.round, j.min_nodes, j.max_nodes, j.restarts_used, j.max_restarts);
    if (!j.progress.empty()) out += fmt::format("  progress: {}\n", j.progress);
    if (!j.result.empty()) out += fmt::format("  result: {}\n", j.result);
    if (j.join_timeout_in) out += fmt::format("  join timeout in {}\n", format_seconds(*j.join_timeout_in));
    if (j.last_call_in) out += fmt::format("  last call in {}\n", format_seconds(*j.last_call_in));
    if (j.exit_barrier_in) out += fmt::format("  exit barrier in {}\n", format_seconds(*j.exit_barrier_in));
    if (j.rebuild_in) out += fmt::format("  rebuild grace ends in {}\n", format_seconds(*j.rebuild_in));
    if (j.gc_in) out += fmt::format("  forgotten in {}\n", format_seconds(*j.gc_in));
    if (j.last_failure) out += fmt::format("  last failure: {}\n", j.last_failure->describe());
    out += fmt::format("  {} member(s):\n", j.members.size());
    for (const MemberStatus& m : j.members) {
      const std::string rank = m.group_rank >= 0 ? fmt::format("group rank {}", m.group_rank) : std::string("-");
      out += fmt::format("    {:<12} {:<13} {} nproc={} heartbeat {} ago, lease {}{}{}\n", to_string(m.role), rank,
                         m.addr.empty() ? m.id.to_string() : m.addr + " (" + m.id.to_string() + ")",
                         m.local_world_size, format_seconds(m.last_heartbeat_age), format_seconds(m.lease_left),
                         m.succeeded ? ", succeeded" : "", m.disconnected ? ", disconnected" : "");
    }
  }
  return out;
}

}  // namespace ddprun::rendezvous
