#pragma once
// The etcd v3 JSON gateway codec: a pure mapping between the plain structs below and the JSON
// bodies that etcd's grpc-gateway (POST /v3/kv/range, /v3/kv/txn, /v3/lease/grant, /v3/watch,
// ...) accepts and returns. No I/O, no clock.
//
// The gateway speaks proto3 JSON with the .proto field names: bytes fields (keys, values) are
// base64, 64-bit integers are decimal strings (numbers are accepted too), enums are names, and
// fields holding their default value (0, false, "", PUT, EQUAL) are omitted. Decoders therefore
// treat a missing field as its default, and reject a field of the wrong type, invalid base64, an
// out-of-range integer or a non-object body with a sentence naming the field: everything read
// from the network is treated as hostile. JSON nesting depth and the size of the body are
// bounded by the caller (the HTTP layer) before the body reaches a decoder.
//
// Thread-safe (no shared state).
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "ddprun/common/endpoint.hpp"

namespace ddprun::rendezvous::etcd {

// ---- pure helpers ----

std::string base64_encode(std::string_view bytes);
// nullopt on anything that is not canonical padded base64 (RFC 4648, standard alphabet).
std::optional<std::string> base64_decode(std::string_view text);

// The range_end that selects every key starting with `prefix` (etcd's "prefix" range): the
// prefix with its last byte below 0xff incremented and the rest dropped; "\0" (every key) when
// the prefix is empty or all 0xff.
std::string prefix_range_end(std::string_view prefix);

// "h1:2379,h2:2379", each optionally "http://h:p" or "https://h:p" (the scheme must then agree
// with `tls`, which `scheme_tls` reports when any endpoint carries one). Port defaults to 2379.
// Throws UsageError naming `what` (e.g. "--rdzv-endpoint") on an empty list or a bad endpoint.
struct EndpointList {
  std::vector<Endpoint> endpoints;
  std::optional<bool> scheme_tls;  // set when the text named http:// or https://
};
EndpointList parse_endpoints(std::string_view text, std::string_view what);

// ---- requests and responses ----

struct ResponseHeader {
  std::int64_t revision = 0;
  std::uint64_t member_id = 0;
  std::uint64_t raft_term = 0;
};

struct KeyValue {
  std::string key;
  std::string value;
  std::int64_t create_revision = 0;
  std::int64_t mod_revision = 0;
  std::int64_t version = 0;
  std::int64_t lease = 0;
  bool operator==(const KeyValue&) const = default;
};

struct RangeRequest {
  std::string key;
  std::string range_end;      // "" = just `key`; prefix_range_end(p) = every key under p
  std::int64_t limit = 0;     // 0 = no limit
  std::int64_t revision = 0;  // 0 = latest
  bool keys_only = false;
  bool count_only = false;
};

struct RangeResponse {
  ResponseHeader header;
  std::vector<KeyValue> kvs;
  bool more = false;
  std::int64_t count = 0;
};

struct PutRequest {
  std::string key;
  std::string value;
  std::int64_t lease = 0;  // 0 = no lease
};

struct DeleteRangeRequest {
  std::string key;
  std::string range_end;
};

struct Compare {
  enum class Target { version, create_revision, mod_revision, value, lease };
  enum class Result { equal, greater, less, not_equal };
  std::string key;
  Target target = Target::mod_revision;
  Result result = Result::equal;
  std::int64_t number = 0;  // version / revisions / lease
  std::string value;        // Target::value
};

using TxnOp = std::variant<RangeRequest, PutRequest, DeleteRangeRequest>;

struct TxnRequest {
  std::vector<Compare> compare;
  std::vector<TxnOp> success;
  std::vector<TxnOp> failure;
};

struct TxnOpResponse {
  enum class Kind { range, put, delete_range };
  Kind kind = Kind::put;
  RangeResponse range;       // Kind::range
  std::int64_t deleted = 0;  // Kind::delete_range
};

struct TxnResponse {
  ResponseHeader header;
  bool succeeded = false;
  std::vector<TxnOpResponse> responses;
};

struct LeaseGrantResponse {
  ResponseHeader header;
  std::int64_t id = 0;
  std::int64_t ttl = 0;
  std::string error;
};

// TTL <= 0 means the lease is gone (expired or revoked).
struct LeaseKeepAliveResponse {
  ResponseHeader header;
  std::int64_t id = 0;
  std::int64_t ttl = 0;
};

struct WatchCreate {
  std::string key;
  std::string range_end;
  std::int64_t start_revision = 0;  // 0 = from now
  bool progress_notify = false;
};

struct WatchEvent {
  enum class Type { put, del };
  Type type = Type::put;
  KeyValue kv;
};

// One message of the watch stream.
struct WatchMessage {
  ResponseHeader header;
  std::int64_t watch_id = 0;
  bool created = false;
  bool canceled = false;
  std::int64_t compact_revision = 0;
  std::string cancel_reason;
  std::vector<WatchEvent> events;
};

// A gRPC status the gateway returned as an error body.
struct GatewayError {
  int code = 2;  // gRPC code (2 = unknown)
  std::string message;
};

// gRPC codes that mean "this member cannot serve now, another may" (Unavailable, deadline
// exceeded, and the leader-loss messages etcd sends with other codes).
bool is_failover_error(const GatewayError& e);
// The token is unknown, expired, older than the auth store ("revision of auth store is old",
// after any user or role change) or was dropped ("user name is empty"): authenticate again and
// retry. Only meaningful with a user name configured (without one, "user name is empty" means
// etcd wants credentials).
bool is_invalid_token_error(const GatewayError& e);

// ---- encoding (request bodies) ----
std::string encode_range(const RangeRequest& r);
std::string encode_put(const PutRequest& r);
std::string encode_delete_range(const DeleteRangeRequest& r);
std::string encode_txn(const TxnRequest& r);
std::string encode_lease_grant(std::int64_t ttl_seconds);
std::string encode_lease_id(std::int64_t id);  // keepalive, revoke, timetolive
std::string encode_watch_create(const WatchCreate& w);
std::string encode_authenticate(std::string_view name, std::string_view password);

// ---- decoding (response bodies). Each returns "" on success, else what was wrong. ----
std::string decode_range(std::string_view body, RangeResponse& out);
std::string decode_header_only(std::string_view body, ResponseHeader& out);  // put, delete
std::string decode_txn(std::string_view body, TxnResponse& out);
std::string decode_lease_grant(std::string_view body, LeaseGrantResponse& out);
// The gateway wraps stream replies (keepalive, watch) as {"result": {...}} or {"error": {...}}:
// an error sets `stream_error` and returns "".
std::string decode_lease_keepalive(std::string_view body, LeaseKeepAliveResponse& out,
                                   std::optional<GatewayError>& stream_error);
std::string decode_watch_message(std::string_view body, WatchMessage& out, std::optional<GatewayError>& stream_error);
std::string decode_authenticate(std::string_view body, std::string& token);
// Decodes an error body ({"error": "...", "code": N, "message": "..."}); a body that is not
// such an object yields code 2 and a message quoting the start of the body.
GatewayError decode_error(std::string_view body);

}  // namespace ddprun::rendezvous::etcd
