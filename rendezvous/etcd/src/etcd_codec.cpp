#include "ddprun/rendezvous/etcd_codec.hpp"

#include <fmt/format.h>

#include <array>
#include <boost/json.hpp>
#include <cctype>
#include <charconv>
#include <limits>

#include "ddprun/common/error.hpp"
#include "ddprun/rendezvous/json_capped.hpp"

namespace ddprun::rendezvous::etcd {

namespace json = boost::json;

namespace {

constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

int b64_value(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

// Error carrier inside the decoders: a sentence naming the field.
struct Bad {
  std::string why;
};

std::string quote_start(std::string_view body) {
  std::string s(body.substr(0, 120));
  for (char& c : s) {
    if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) c = '?';
  }
  return body.size() > 120 ? s + "..." : s;
}

// In bounded memory (json_capped.hpp): replies and watch messages may be 32 MiB each, and JSON of
// tiny values from a bad etcd or anyone on a plain-HTTP path took ~17x that before.
json::value parse_body(std::string_view body) {
  CappedJson parsed = parse_json_capped(body, 32);
  if (!parsed.over_cap.empty()) throw Bad{fmt::format("{}: '{}'", parsed.over_cap, quote_start(body))};
  if (!parsed.invalid.empty()) throw Bad{fmt::format("not valid JSON ({}): '{}'", parsed.invalid, quote_start(body))};
  if (!parsed.value.is_object()) throw Bad{fmt::format("not a JSON object: '{}'", quote_start(body))};
  return std::move(parsed.value);
}

const json::object& as_object(const json::value& v, std::string_view field) {
  if (!v.is_object()) throw Bad{fmt::format("field '{}' is not an object", field)};
  return v.get_object();
}

const json::value* member(const json::object& o, std::string_view name) {
  auto it = o.find(name);
  return it == o.end() || it->value().is_null() ? nullptr : &it->value();
}

// proto3 JSON int64: a decimal string or a JSON number.
std::int64_t get_i64(const json::object& o, std::string_view name) {
  const json::value* v = member(o, name);
  if (v == nullptr) return 0;
  if (v->is_int64()) return v->get_int64();
  if (v->is_uint64()) {
    if (v->get_uint64() > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      throw Bad{fmt::format("field '{}' is out of range", name)};
    return static_cast<std::int64_t>(v->get_uint64());
  }
  if (v->is_string()) {
    const json::string& s = v->get_string();
    std::int64_t x = 0;
    const char* end = s.data() + s.size();
    auto [p, ec] = std::from_chars(s.data(), end, x);
    if (ec != std::errc{} || p != end || s.empty())
      throw Bad{fmt::format("field '{}' is not an integer: '{}'", name, quote_start(s))};
    return x;
  }
  throw Bad{fmt::format("field '{}' is not an integer", name)};
}

std::uint64_t get_u64(const json::object& o, std::string_view name) {
  const json::value* v = member(o, name);
  if (v == nullptr) return 0;
  if (v->is_uint64()) return v->get_uint64();
  if (v->is_int64()) {
    if (v->get_int64() < 0) throw Bad{fmt::format("field '{}' is negative", name)};
    return static_cast<std::uint64_t>(v->get_int64());
  }
  if (v->is_string()) {
    const json::string& s = v->get_string();
    std::uint64_t x = 0;
    const char* end = s.data() + s.size();
    auto [p, ec] = std::from_chars(s.data(), end, x);
    if (ec != std::errc{} || p != end || s.empty())
      throw Bad{fmt::format("field '{}' is not an unsigned integer", name)};
    return x;
  }
  throw Bad{fmt::format("field '{}' is not an unsigned integer", name)};
}

bool get_bool(const json::object& o, std::string_view name) {
  const json::value* v = member(o, name);
  if (v == nullptr) return false;
  if (!v->is_bool()) throw Bad{fmt::format("field '{}' is not a boolean", name)};
  return v->get_bool();
}

std::string get_string(const json::object& o, std::string_view name) {
  const json::value* v = member(o, name);
  if (v == nullptr) return {};
  if (!v->is_string()) throw Bad{fmt::format("field '{}' is not a string", name)};
  return std::string(v->get_string());
}

std::string get_bytes(const json::object& o, std::string_view name) {
  const json::value* v = member(o, name);
  if (v == nullptr) return {};
  if (!v->is_string()) throw Bad{fmt::format("field '{}' is not a base64 string", name)};
  auto d = base64_decode(v->get_string());
  if (!d) throw Bad{fmt::format("field '{}' is not valid base64", name)};
  return std::move(*d);
}

const json::array* get_array(const json::object& o, std::string_view name) {
  const json::value* v = member(o, name);
  if (v == nullptr) return nullptr;
  if (!v->is_array()) throw Bad{fmt::format("field '{}' is not an array", name)};
  return &v->get_array();
}

// A revision: etcd's are positive and far below the int64 limit; the clients add one to them (the
// next revision to watch from), which must not overflow on a value a proxy made up.
std::int64_t get_revision(const json::object& o, std::string_view name) {
  const std::int64_t r = get_i64(o, name);
  if (r < 0 || r == std::numeric_limits<std::int64_t>::max())
    throw Bad{fmt::format("field '{}' is not a revision (0 to 2^63-2): {}", name, r)};
  return r;
}

ResponseHeader header_of(const json::object& o) {
  ResponseHeader h;
  const json::value* v = member(o, "header");
  if (v == nullptr) return h;
  const json::object& ho = as_object(*v, "header");
  h.revision = get_revision(ho, "revision");
  h.member_id = get_u64(ho, "member_id");
  h.raft_term = get_u64(ho, "raft_term");
  return h;
}

KeyValue kv_of(const json::value& v) {
  const json::object& o = as_object(v, "kvs[]");
  KeyValue kv;
  kv.key = get_bytes(o, "key");
  kv.value = get_bytes(o, "value");
  kv.create_revision = get_revision(o, "create_revision");
  kv.mod_revision = get_revision(o, "mod_revision");
  kv.version = get_i64(o, "version");
  kv.lease = get_i64(o, "lease");
  return kv;
}

RangeResponse range_of(const json::object& o) {
  RangeResponse r;
  r.header = header_of(o);
  if (const json::array* a = get_array(o, "kvs")) {
    r.kvs.reserve(a->size());
    for (const json::value& v : *a) r.kvs.push_back(kv_of(v));
  }
  r.more = get_bool(o, "more");
  r.count = get_i64(o, "count");
  return r;
}

json::string i64_text(std::int64_t x) { return json::string(std::to_string(x)); }

json::object range_json(const RangeRequest& r) {
  json::object o{{"key", base64_encode(r.key)}};
  if (!r.range_end.empty()) o["range_end"] = base64_encode(r.range_end);
  if (r.limit != 0) o["limit"] = i64_text(r.limit);
  if (r.revision != 0) o["revision"] = i64_text(r.revision);
  if (r.keys_only) o["keys_only"] = true;
  if (r.count_only) o["count_only"] = true;
  return o;
}

json::object put_json(const PutRequest& r) {
  json::object o{{"key", base64_encode(r.key)}, {"value", base64_encode(r.value)}};
  if (r.lease != 0) o["lease"] = i64_text(r.lease);
  return o;
}

json::object delete_json(const DeleteRangeRequest& r) {
  json::object o{{"key", base64_encode(r.key)}};
  if (!r.range_end.empty()) o["range_end"] = base64_encode(r.range_end);
  return o;
}

json::array ops_json(const std::vector<TxnOp>& ops) {
  json::array a;
  for (const TxnOp& op : ops) {
    if (const auto* r = std::get_if<RangeRequest>(&op)) {
      a.push_back(json::object{{"request_range", range_json(*r)}});
    } else if (const auto* p = std::get_if<PutRequest>(&op)) {
      a.push_back(json::object{{"request_put", put_json(*p)}});
    } else {
      a.push_back(json::object{{"request_delete_range", delete_json(std::get<DeleteRangeRequest>(op))}});
    }
  }
  return a;
}

template <class F>
std::string guarded(F&& f) {
  try {
    f();
    return {};
  } catch (const Bad& b) {
    return b.why;
  }
}

// {"result": {...}} / {"error": {...}} of a gateway stream message.
const json::object* stream_result(const json::object& o, std::optional<GatewayError>& err) {
  err.reset();
  if (const json::value* e = member(o, "error")) {
    const json::object& eo = as_object(*e, "error");
    GatewayError g;
    g.code = static_cast<int>(get_i64(eo, "grpc_code") != 0 ? get_i64(eo, "grpc_code") : get_i64(eo, "code"));
    g.message = get_string(eo, "message");
    if (g.message.empty()) g.message = get_string(eo, "error");
    err = g;
    return nullptr;
  }
  const json::value* r = member(o, "result");
  if (r == nullptr) return &o;  // a bare message (tolerated)
  return &as_object(*r, "result");
}

}  // namespace

std::string base64_encode(std::string_view bytes) {
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  std::size_t i = 0;
  auto byte = [&](std::size_t k) { return static_cast<std::uint32_t>(static_cast<unsigned char>(bytes[k])); };
  for (; i + 3 <= bytes.size(); i += 3) {
    const std::uint32_t n = byte(i) << 16 | byte(i + 1) << 8 | byte(i + 2);
    out += kAlphabet[n >> 18 & 63];
    out += kAlphabet[n >> 12 & 63];
    out += kAlphabet[n >> 6 & 63];
    out += kAlphabet[n & 63];
  }
  const std::size_t rest = bytes.size() - i;
  if (rest == 1) {
    const std::uint32_t n = byte(i) << 16;
    out += kAlphabet[n >> 18 & 63];
    out += kAlphabet[n >> 12 & 63];
    out += "==";
  } else if (rest == 2) {
    const std::uint32_t n = byte(i) << 16 | byte(i + 1) << 8;
    out += kAlphabet[n >> 18 & 63];
    out += kAlphabet[n >> 12 & 63];
    out += kAlphabet[n >> 6 & 63];
    out += '=';
  }
  return out;
}

std::optional<std::string> base64_decode(std::string_view text) {
  if (text.size() % 4 != 0) return std::nullopt;
  std::string out;
  out.reserve(text.size() / 4 * 3);
  for (std::size_t i = 0; i < text.size(); i += 4) {
    const bool last = i + 4 == text.size();
    int v[4];
    int pad = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = text[i + static_cast<std::size_t>(k)];
      if (c == '=' && last && k >= 2) {
        v[k] = 0;
        ++pad;
        continue;
      }
      if (pad > 0) return std::nullopt;  // data after padding
      v[k] = b64_value(c);
      if (v[k] < 0) return std::nullopt;
    }
    const std::uint32_t n = static_cast<std::uint32_t>(v[0]) << 18 | static_cast<std::uint32_t>(v[1]) << 12 |
                            static_cast<std::uint32_t>(v[2]) << 6 | static_cast<std::uint32_t>(v[3]);
    // Canonical form: the bits dropped by padding must be zero.
    if ((pad == 1 && (n & 0xff) != 0) || (pad == 2 && (n & 0xffff) != 0)) return std::nullopt;
    out += static_cast<char>(n >> 16 & 0xff);
    if (pad < 2) out += static_cast<char>(n >> 8 & 0xff);
    if (pad < 1) out += static_cast<char>(n & 0xff);
  }
  return out;
}

std::string prefix_range_end(std::string_view prefix) {
  std::string end(prefix);
  while (!end.empty()) {
    auto& c = reinterpret_cast<unsigned char&>(end.back());
    if (c < 0xff) {
      ++c;
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');
}

EndpointList parse_endpoints(std::string_view text, std::string_view what) {
  const std::string forms =
      "accepted forms: [http://|https://]HOST[:PORT] (the scheme in any letter case, PORT 1..65535, 2379 by "
      "default, an IPv6 address in brackets), comma-separated, e.g. h1:2379,h2:2379";
  EndpointList out;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    std::size_t comma = text.find(',', pos);
    if (comma == std::string_view::npos) comma = text.size();
    std::string_view item = text.substr(pos, comma - pos);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    if (item.empty()) throw UsageError(fmt::format("{} '{}': empty endpoint in the list", what, text), forms);
    const std::string_view whole = item;
    auto fail = [&](const std::string& why) {
      throw UsageError(fmt::format("{} '{}': endpoint '{}' {}", what, text, whole, why), forms);
    };
    auto starts_with_nocase = [&](std::string_view prefix) {
      if (item.size() < prefix.size()) return false;
      for (std::size_t i = 0; i < prefix.size(); ++i) {
        if (std::tolower(static_cast<unsigned char>(item[i])) != prefix[i]) return false;
      }
      return true;
    };
    std::optional<bool> tls;
    if (starts_with_nocase("https://")) {
      tls = true;
      item.remove_prefix(8);
    } else if (starts_with_nocase("http://")) {
      tls = false;
      item.remove_prefix(7);
    } else if (const std::size_t s = item.find("://"); s != std::string_view::npos) {
      fail(fmt::format("has the scheme '{}' (etcd speaks http:// or https://)", item.substr(0, s)));
    }
    if (!item.empty() && item.back() == '/') item.remove_suffix(1);
    if (tls) {
      if (out.scheme_tls && *out.scheme_tls != *tls) {
        throw UsageError(fmt::format("{} '{}': endpoints mix http:// and https://", what, text),
                         "use one scheme for every etcd endpoint");
      }
      out.scheme_tls = tls;
    }
    Endpoint ep;
    try {
      ep = parse_endpoint(item, 2379, what);
    } catch (const UsageError& e) {
      throw UsageError(e.message(), forms);  // with the forms etcd accepts (no port 0)
    }
    if (ep.port == 0) fail("has port 0");
    if (ep.host.find_first_of(" \t\r\n@/?#") != std::string::npos)
      fail("has a space, '@', '/', '?' or '#' in its host (no user names, paths or queries)");
    // parse_endpoint takes text with several ':' for a bare IPv6 address. A link-local one may
    // name its zone: [fe80::1%eth0]:2379.
    if (const std::size_t colon = ep.host.find(':'); colon != std::string::npos) {
      const std::size_t pct = ep.host.find('%');
      const std::string_view addr = std::string_view(ep.host).substr(0, pct);
      const bool zone_ok = pct == std::string::npos ||
                           (pct + 1 < ep.host.size() && ep.host.find_first_of(":%", pct + 1) == std::string::npos);
      if (addr.find_first_not_of("0123456789abcdefABCDEF:.") != std::string_view::npos || !zone_ok)
        fail("is neither HOST:PORT nor an IPv6 address");
    }
    out.endpoints.push_back(std::move(ep));
    pos = comma + 1;
  }
  return out;
}

bool is_failover_error(const GatewayError& e) {
  if (e.code == 14 || e.code == 4) return true;  // Unavailable, DeadlineExceeded
  for (const char* m :
       {"no leader", "leader changed", "request timed out", "not capable", "too many requests", "stopped"}) {
    if (e.message.find(m) != std::string::npos) return true;
  }
  return false;
}

bool is_invalid_token_error(const GatewayError& e) {
  // Like etcd's Go client: a token older than the last user/role change (every token of the
  // cluster after any such change, JWT or simple) and a token etcd dropped ("user name is
  // empty": the request reached etcd as anonymous) are refreshed, not fatal.
  return e.message.find("invalid auth token") != std::string::npos ||
         e.message.find("revision of auth store is old") != std::string::npos ||
         e.message.find("user name is empty") != std::string::npos ||
         (e.code == 16 && e.message.find("token") != std::string::npos);
}

std::string encode_range(const RangeRequest& r) { return json::serialize(range_json(r)); }
std::string encode_put(const PutRequest& r) { return json::serialize(put_json(r)); }
std::string encode_delete_range(const DeleteRangeRequest& r) { return json::serialize(delete_json(r)); }

std::string encode_txn(const TxnRequest& r) {
  json::array cmp;
  for (const Compare& c : r.compare) {
    static constexpr const char* kTarget[] = {"VERSION", "CREATE", "MOD", "VALUE", "LEASE"};
    static constexpr const char* kResult[] = {"EQUAL", "GREATER", "LESS", "NOT_EQUAL"};
    json::object o{{"key", base64_encode(c.key)},
                   {"target", kTarget[static_cast<int>(c.target)]},
                   {"result", kResult[static_cast<int>(c.result)]}};
    switch (c.target) {
      case Compare::Target::version:
        o["version"] = i64_text(c.number);
        break;
      case Compare::Target::create_revision:
        o["create_revision"] = i64_text(c.number);
        break;
      case Compare::Target::mod_revision:
        o["mod_revision"] = i64_text(c.number);
        break;
      case Compare::Target::value:
        o["value"] = base64_encode(c.value);
        break;
      case Compare::Target::lease:
        o["lease"] = i64_text(c.number);
        break;
    }
    cmp.push_back(std::move(o));
  }
  return json::serialize(
      json::object{{"compare", std::move(cmp)}, {"success", ops_json(r.success)}, {"failure", ops_json(r.failure)}});
}

std::string encode_lease_grant(std::int64_t ttl_seconds) {
  return json::serialize(json::object{{"TTL", i64_text(ttl_seconds)}});
}

std::string encode_lease_id(std::int64_t id) { return json::serialize(json::object{{"ID", i64_text(id)}}); }

std::string encode_watch_create(const WatchCreate& w) {
  json::object o{{"key", base64_encode(w.key)}};
  if (!w.range_end.empty()) o["range_end"] = base64_encode(w.range_end);
  if (w.start_revision != 0) o["start_revision"] = i64_text(w.start_revision);
  if (w.progress_notify) o["progress_notify"] = true;
  return json::serialize(json::object{{"create_request", std::move(o)}});
}

std::string encode_authenticate(std::string_view name, std::string_view password) {
  return json::serialize(json::object{{"name", name}, {"password", password}});
}

std::string decode_range(std::string_view body, RangeResponse& out) {
  return guarded([&] { out = range_of(parse_body(body).get_object()); });
}

std::string decode_header_only(std::string_view body, ResponseHeader& out) {
  return guarded([&] { out = header_of(parse_body(body).get_object()); });
}

std::string decode_txn(std::string_view body, TxnResponse& out) {
  return guarded([&] {
    const json::value v = parse_body(body);
    const json::object& o = v.get_object();
    TxnResponse t;
    t.header = header_of(o);
    t.succeeded = get_bool(o, "succeeded");
    if (const json::array* a = get_array(o, "responses")) {
      for (const json::value& rv : *a) {
        const json::object& ro = as_object(rv, "responses[]");
        TxnOpResponse r;
        if (const json::value* x = member(ro, "response_range")) {
          r.kind = TxnOpResponse::Kind::range;
          r.range = range_of(as_object(*x, "response_range"));
        } else if (const json::value* y = member(ro, "response_delete_range")) {
          r.kind = TxnOpResponse::Kind::delete_range;
          r.deleted = get_i64(as_object(*y, "response_delete_range"), "deleted");
        } else if (member(ro, "response_put") != nullptr) {
          r.kind = TxnOpResponse::Kind::put;
        } else {
          throw Bad{"responses[] entry has no response_range/put/delete_range"};
        }
        t.responses.push_back(std::move(r));
      }
    }
    out = std::move(t);
  });
}

std::string decode_lease_grant(std::string_view body, LeaseGrantResponse& out) {
  return guarded([&] {
    const json::value v = parse_body(body);
    const json::object& o = v.get_object();
    LeaseGrantResponse r;
    r.header = header_of(o);
    r.id = get_i64(o, "ID");
    r.ttl = get_i64(o, "TTL");
    r.error = get_string(o, "error");
    if (r.error.empty() && r.id == 0) throw Bad{"lease grant reply carries no ID"};
    out = std::move(r);
  });
}

std::string decode_lease_keepalive(std::string_view body, LeaseKeepAliveResponse& out,
                                   std::optional<GatewayError>& stream_error) {
  return guarded([&] {
    const json::value v = parse_body(body);
    const json::object* o = stream_result(v.get_object(), stream_error);
    if (o == nullptr) return;
    LeaseKeepAliveResponse r;
    r.header = header_of(*o);
    r.id = get_i64(*o, "ID");
    r.ttl = get_i64(*o, "TTL");
    out = r;
  });
}

std::string decode_watch_message(std::string_view body, WatchMessage& out, std::optional<GatewayError>& stream_error) {
  return guarded([&] {
    const json::value v = parse_body(body);
    const json::object* o = stream_result(v.get_object(), stream_error);
    if (o == nullptr) return;
    WatchMessage m;
    m.header = header_of(*o);
    m.watch_id = get_i64(*o, "watch_id");
    m.created = get_bool(*o, "created");
    m.canceled = get_bool(*o, "canceled");
    m.compact_revision = get_revision(*o, "compact_revision");
    m.cancel_reason = get_string(*o, "cancel_reason");
    if (const json::array* a = get_array(*o, "events")) {
      for (const json::value& ev : *a) {
        const json::object& eo = as_object(ev, "events[]");
        WatchEvent e;
        const std::string type = get_string(eo, "type");
        if (type.empty() || type == "PUT") {
          e.type = WatchEvent::Type::put;
        } else if (type == "DELETE") {
          e.type = WatchEvent::Type::del;
        } else {
          throw Bad{fmt::format("events[].type '{}' is neither PUT nor DELETE", quote_start(type))};
        }
        const json::value* kv = member(eo, "kv");
        if (kv == nullptr) throw Bad{"events[] entry has no kv"};
        e.kv = kv_of(*kv);
        m.events.push_back(std::move(e));
      }
    }
    out = std::move(m);
  });
}

std::string decode_authenticate(std::string_view body, std::string& token) {
  return guarded([&] {
    const json::value v = parse_body(body);
    token = get_string(v.get_object(), "token");
    if (token.empty()) throw Bad{"authenticate reply carries no token"};
    if (token.size() > 4096) throw Bad{"authenticate reply carries a token over 4 KiB"};
    // It goes into every request's Authorization header: a CR or LF would end the header (and
    // smuggle what follows in as a request of its own). etcd's tokens are printable ASCII.
    for (const char c : token) {
      if (c < 0x21 || c > 0x7e) throw Bad{"authenticate reply carries a token with a byte that is not printable ASCII"};
    }
  });
}

GatewayError decode_error(std::string_view body) {
  GatewayError g;
  const std::string why = guarded([&] {
    const json::value v = parse_body(body);
    const json::object& o = v.get_object();
    std::optional<GatewayError> se;
    if (const json::value* e = member(o, "error"); e != nullptr && e->is_object()) {
      stream_result(o, se);
      if (se) g = *se;
      return;
    }
    g.code = static_cast<int>(get_i64(o, "code"));
    g.message = get_string(o, "message");
    if (g.message.empty()) g.message = get_string(o, "error");
  });
  if (!why.empty()) g = GatewayError{2, fmt::format("unexpected reply: '{}'", quote_start(body))};
  if (g.message.empty()) g.message = fmt::format("error without a message (gRPC code {})", g.code);
  return g;
}

}  // namespace ddprun::rendezvous::etcd
