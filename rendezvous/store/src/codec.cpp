// TCPStore frame codec: see codec.hpp for the contract and docs/protocol.md for the layouts.
#include "ddprun/rendezvous/codec.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "ddprun/rendezvous/bytes.hpp"

namespace ddprun::rendezvous {
namespace {

constexpr unsigned char magic_bytes[4] = {0xCE, 0xF7, 0x85, 0x3C};

std::string_view generation_name(Generation g) { return g == Generation::legacy ? "legacy (1.13)" : "modern"; }

// Field reader over one request. Every read either succeeds or fills `res` (need_more with the
// minimum total length, or error) and returns false; the caller then returns `res` unchanged.
class FieldParser {
 public:
  FieldParser(std::string_view buf, std::size_t pos, DecodeResult& res, Op op)
      : buf_(buf), pos_(pos), res_(res), op_(op) {}

  std::size_t pos() const { return pos_; }
  // Continues at `pos` (a field boundary decoded before: DecoderState::resume_pos).
  void skip_to(std::size_t pos) { pos_ = pos; }

  bool u64(std::uint64_t& v) {
    if (!need(8)) return false;
    v = load<std::uint64_t>();
    return true;
  }
  bool i64(std::int64_t& v) {
    std::uint64_t u = 0;
    if (!u64(u)) return false;
    v = static_cast<std::int64_t>(u);
    return true;
  }
  bool u32(std::uint32_t& v) {
    if (!need(4)) return false;
    v = load<std::uint32_t>();
    return true;
  }
  // Length-prefixed string; the limit is checked as soon as the length is readable.
  bool str(std::string_view& out, std::size_t max_len, const char* what, const char* flag) {
    if (!need(8)) return false;
    const auto len = load<std::uint64_t>();
    if (len > max_len) {
      res_.status = DecodeStatus::error;
      res_.reason =
          fmt::format("{} {} length {} exceeds the limit of {} bytes ({})", op_name(op_), what, len, max_len, flag);
      return false;
    }
    const auto n = static_cast<std::size_t>(len);
    if (buf_.size() - pos_ < n) {
      res_.status = DecodeStatus::need_more;
      res_.min_total = pos_ + n;
      return false;
    }
    out = buf_.substr(pos_, n);
    pos_ += n;
    return true;
  }
  bool count(std::uint64_t& n, std::size_t max_count) {
    if (!u64(n)) return false;
    if (n > max_count) {
      res_.status = DecodeStatus::error;
      res_.reason =
          fmt::format("{} key count {} exceeds the limit of {} (--max-keys-per-request)", op_name(op_), n, max_count);
      return false;
    }
    return true;
  }

 private:
  bool need(std::size_t n) {
    if (buf_.size() - pos_ < n) {
      res_.status = DecodeStatus::need_more;
      res_.min_total = pos_ + n;
      return false;
    }
    return true;
  }
  // REQUIRES: need(sizeof(T)) held.
  template <class T>
  T load() {
    const T v = bytes::load_le<T>(buf_.data() + pos_);
    pos_ += sizeof(T);
    return v;
  }

  std::string_view buf_;
  std::size_t pos_;
  DecodeResult& res_;
  Op op_;
};

// The field layout of every op: the one mapping the decoder and the encoder share.
enum class Layout : std::uint8_t {
  u32,              // VALIDATE magic, PING nonce
  key,              // GET DELETE_KEY WATCH_KEY QUEUE_POP QUEUE_LEN
  key_value,        // SET APPEND QUEUE_PUSH
  key_two_values,   // COMPARE_SET: key, expected, desired
  key_number,       // ADD delta, BARRIER world size
  keys,             // CHECK WAIT MULTI_GET: count + keys
  key_value_pairs,  // MULTI_SET: count + (key, value) pairs
  none,             // GETNUMKEYS CANCEL_WAIT LIST_KEYS
};

constexpr Layout layout_of(Op op) {
  switch (op) {
    case Op::validate:
    case Op::ping:
      return Layout::u32;
    case Op::get:
    case Op::delete_key:
    case Op::watch_key:
    case Op::queue_pop:
    case Op::queue_len:
      return Layout::key;
    case Op::set:
    case Op::append:
    case Op::queue_push:
      return Layout::key_value;
    case Op::compare_set:
      return Layout::key_two_values;
    case Op::add:
    case Op::barrier:
      return Layout::key_number;
    case Op::check:
    case Op::wait:
    case Op::multi_get:
      return Layout::keys;
    case Op::multi_set:
      return Layout::key_value_pairs;
    case Op::get_num_keys:
    case Op::cancel_wait:
    case Op::list_keys:
      return Layout::none;
  }
  return Layout::none;
}

DecodeResult error(std::string reason) {
  DecodeResult r;
  r.status = DecodeStatus::error;
  r.reason = std::move(reason);
  return r;
}

}  // namespace

DecodeResult decode_request(std::string_view buffer, DecoderState& state, const StoreLimits& limits, Request& out) {
  DecodeResult res;
  if (buffer.empty()) {
    res.min_total = 1;
    return res;
  }
  const auto b0 = static_cast<std::uint8_t>(buffer[0]);
  if (b0 >= extension_opcode_base) {
    res.status = DecodeStatus::extension;
    return res;
  }

  Generation gen{};
  if (state.generation) {
    gen = *state.generation;
  } else if (b0 == 0) {
    // VALIDATE or a legacy SET: decide on the four bytes after the 00 (as far as present).
    const std::size_t have = std::min<std::size_t>(buffer.size() - 1, 4);
    bool prefix_matches = true;
    for (std::size_t i = 0; i < have; ++i) {
      if (static_cast<unsigned char>(buffer[1 + i]) != magic_bytes[i]) prefix_matches = false;
    }
    if (prefix_matches && have < 4) {
      res.min_total = 5;
      return res;
    }
    gen = prefix_matches ? Generation::modern : Generation::legacy;
  } else if (b0 <= 8) {
    gen = Generation::legacy;
  } else {
    return error(fmt::format("first byte 0x{:02x} is neither VALIDATE nor a 1.13 query", b0));
  }
  if (!state.generation && gen == Generation::legacy && !state.accept_legacy) {
    return error("connection does not open with VALIDATE and legacy (1.13) clients are not accepted");
  }

  const auto op_opt = decode_op(gen, b0);
  if (!op_opt) {
    return error(fmt::format("unknown opcode 0x{:02x} on a {} connection", b0, generation_name(gen)));
  }
  const Op op = *op_opt;
  if (op == Op::validate && state.generation) {
    return error("repeated VALIDATE (it must be the first and only handshake of a connection)");
  }

  out.reset(op);

  FieldParser p(buffer, 1, res, op);
  const std::size_t kmax = limits.max_key_bytes;
  const std::size_t vmax = limits.max_value_bytes;
  constexpr const char* kflag = "--max-key-bytes";
  constexpr const char* vflag = "--max-value-bytes";
  bool ok = true;
  switch (layout_of(op)) {
    case Layout::u32:
      ok = p.u32(out.u32);
      if (ok && op == Op::validate && out.u32 != validation_magic) return error("bad VALIDATE magic");
      break;
    case Layout::key_value:
      ok = p.str(out.key, kmax, "key", kflag) && p.str(out.value, vmax, "value", vflag);
      break;
    case Layout::key_two_values:
      ok = p.str(out.key, kmax, "key", kflag) && p.str(out.value, vmax, "expected value", vflag) &&
           p.str(out.desired, vmax, "desired value", vflag);
      break;
    case Layout::key:
      ok = p.str(out.key, kmax, "key", kflag);
      break;
    case Layout::key_number:
      ok = p.str(out.key, kmax, "key", kflag) && p.i64(out.number);
      break;
    case Layout::keys:
    case Layout::key_value_pairs: {
      // Decoded as (offset, length) spans kept in `state`, so that a need_more goes on from the
      // last whole key next time instead of reading every key again (quadratic in the size of a
      // request trickling in). The views are built once the request is whole.
      const bool pairs = layout_of(op) == Layout::key_value_pairs;
      const std::size_t per_key = pairs ? 2 : 1;
      std::uint64_t n = 0;
      if (state.resume_pos != 0 && state.resume_pos <= buffer.size() &&
          state.spans.size() <= state.resume_count * per_key) {
        p.skip_to(state.resume_pos);
        n = state.resume_count;
      } else {
        state.resume_pos = 0;
        state.spans.clear();
        ok = p.count(n, limits.max_keys_per_request);
      }
      const auto span_of = [&](std::string_view v) {
        return DecoderState::Span{static_cast<std::size_t>(v.data() - buffer.data()), v.size()};
      };
      for (std::uint64_t i = state.spans.size() / per_key; ok && i < n; ++i) {
        const std::size_t key_start = p.pos();
        std::string_view k;
        std::string_view v;
        ok = p.str(k, kmax, "key", kflag) && (!pairs || p.str(v, vmax, "value", vflag));
        if (!ok) {
          if (res.status == DecodeStatus::need_more) {
            // Go on from this key next time; and wait for the 8-byte length (and a value's)
            // every key still to come has at least, not only for this key.
            state.resume_pos = key_start;
            state.resume_count = n;
            res.min_total += (n - i - 1) * (pairs ? 16 : 8);
          }
          break;
        }
        state.spans.push_back(span_of(k));
        if (pairs) state.spans.push_back(span_of(v));
      }
      if (ok) {
        for (std::size_t j = 0; j < state.spans.size(); j += per_key) {
          out.keys.push_back(buffer.substr(state.spans[j].offset, state.spans[j].length));
          if (pairs) out.values.push_back(buffer.substr(state.spans[j + 1].offset, state.spans[j + 1].length));
        }
      }
      if (ok || res.status == DecodeStatus::error) {
        state.resume_pos = 0;
        // A huge request's spans are not kept for the rest of the connection.
        if (state.spans.capacity() > 4096) std::vector<DecoderState::Span>().swap(state.spans);
        state.spans.clear();
      }
      break;
    }
    case Layout::none:
      break;
  }
  if (!ok) return res;
  res.status = DecodeStatus::ok;
  res.consumed = p.pos();
  state.generation = gen;
  return res;
}

bool encode_request(std::string& out, Generation gen, const Request& req, std::string_view key_prefix) {
  const auto byte = encode_op(gen, req.op);
  if (!byte) return false;
  bytes::put_u8(out, *byte);
  const auto key = [&](std::string_view k) { bytes::put_str(out, k, key_prefix); };
  switch (layout_of(req.op)) {
    case Layout::u32:
      bytes::put_u32(out, req.u32);
      break;
    case Layout::key:
      key(req.key);
      break;
    case Layout::key_value:
      key(req.key);
      bytes::put_str(out, req.value);
      break;
    case Layout::key_two_values:
      key(req.key);
      bytes::put_str(out, req.value);
      bytes::put_str(out, req.desired);
      break;
    case Layout::key_number:
      key(req.key);
      bytes::put_i64(out, req.number);
      break;
    case Layout::keys:
    case Layout::key_value_pairs:
      bytes::put_u64(out, req.keys.size());
      for (std::size_t i = 0; i < req.keys.size(); ++i) {
        key(req.keys[i]);
        if (layout_of(req.op) != Layout::key_value_pairs) continue;
        bytes::put_str(out, i < req.values.size() ? req.values[i] : std::string_view{});
      }
      break;
    case Layout::none:
      break;
  }
  return true;
}

namespace reply {
void u8(std::string& out, std::uint8_t v) { bytes::put_u8(out, v); }
void i64(std::string& out, std::int64_t v) { bytes::put_i64(out, v); }
void u32(std::string& out, std::uint32_t v) { bytes::put_u32(out, v); }
void str(std::string& out, std::string_view s) { bytes::put_str(out, s); }
void check(std::string& out, CheckResponse r) { bytes::put_u8(out, static_cast<std::uint8_t>(r)); }
void wait(std::string& out, WaitResponse r) { bytes::put_u8(out, static_cast<std::uint8_t>(r)); }
void watch_event(std::string& out, WatchResponse type, std::string_view key, std::string_view old_value,
                 std::string_view new_value, std::string_view new_tail) {
  bytes::put_u8(out, static_cast<std::uint8_t>(type));
  bytes::put_str(out, key);
  bytes::put_str(out, old_value);
  bytes::put_str(out, new_tail, new_value);  // new_value + new_tail
}
}  // namespace reply

}  // namespace ddprun::rendezvous
