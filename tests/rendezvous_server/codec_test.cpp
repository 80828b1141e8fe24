// Codec: round trips for every opcode of both generations, truncation at every byte, byte
// corruption at every position (LevelDB log_test style), limits checked at the length field,
// generation detection.
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <cstring>
#include <memory>
#include <vector>

#include "helpers.hpp"

using namespace ddprun::rendezvous;
using test::hex;

namespace {

struct Sample {
  Generation gen;
  Request req;
};

Request make(Op op) {
  Request r;
  r.op = op;
  return r;
}

// One representative request per op and generation (keys with slashes and binary bytes).
std::vector<Sample> samples() {
  std::vector<Sample> out;
  for (Generation gen : {Generation::legacy, Generation::modern}) {
    for (int i = 0; i <= static_cast<int>(Op::barrier); ++i) {
      const auto op = static_cast<Op>(i);
      if (!encode_op(gen, op)) continue;
      Request r = make(op);
      switch (op) {
        case Op::validate:
          r.u32 = validation_magic;
          break;
        case Op::ping:
          r.u32 = 0x12345678u;
          break;
        case Op::set:
        case Op::append:
        case Op::queue_push:
          r.key = "//worker/attempt_0/k";
          r.value = std::string_view("v\0x", 3);
          break;
        case Op::compare_set:
          r.key = "/cas";
          r.value = "";
          r.desired = "new";
          break;
        case Op::get:
        case Op::delete_key:
        case Op::watch_key:
        case Op::queue_pop:
        case Op::queue_len:
          r.key = "/k1";
          break;
        case Op::add:
          r.key = "init/";
          r.number = -2;
          break;
        case Op::barrier:
          r.key = "/b";
          r.number = 4;
          break;
        case Op::check:
        case Op::wait:
        case Op::multi_get:
          r.keys = {"/a", "", "/a"};
          break;
        case Op::multi_set:
          r.keys = {"/a", "/b"};
          r.values = {"1", ""};
          break;
        case Op::get_num_keys:
        case Op::cancel_wait:
        case Op::list_keys:
          break;
      }
      out.push_back({gen, r});
    }
  }
  return out;
}

// A state in which a non-first request of `gen` is decoded.
DecoderState established(Generation gen) {
  DecoderState s;
  s.generation = gen;
  return s;
}

DecoderState state_for(const Sample& s) {
  // VALIDATE is only legal as a first frame; everything else is decoded mid-connection.
  return s.req.op == Op::validate ? DecoderState{} : established(s.gen);
}

// Exactly-sized heap copy so that ASan catches any read past the end.
struct ExactBuffer {
  explicit ExactBuffer(std::string_view s) : size(s.size()), data(new char[s.size() ? s.size() : 1]) {
    if (!s.empty()) std::memcpy(data.get(), s.data(), s.size());
  }
  std::string_view view() const { return {data.get(), size}; }
  std::size_t size;
  std::unique_ptr<char[]> data;
};

}  // namespace

TEST_CASE("every opcode of both generations round-trips", "[codec]") {
  StoreLimits limits;
  for (const auto& s : samples()) {
    INFO(op_name(s.req.op) << (s.gen == Generation::legacy ? " legacy" : " modern"));
    std::string bytes;
    REQUIRE(encode_request(bytes, s.gen, s.req));
    REQUIRE(static_cast<std::uint8_t>(bytes[0]) == *encode_op(s.gen, s.req.op));
    DecoderState st = state_for(s);
    Request out;
    auto r = decode_request(bytes, st, limits, out);
    REQUIRE(r.status == DecodeStatus::ok);
    CHECK(r.consumed == bytes.size());
    CHECK(out.op == s.req.op);
    CHECK(out.key == s.req.key);
    CHECK(out.value == s.req.value);
    CHECK(out.desired == s.req.desired);
    CHECK(out.number == s.req.number);
    CHECK(out.u32 == s.req.u32);
    CHECK(out.keys == s.req.keys);
    CHECK(out.values == s.req.values);
    std::string again;
    REQUIRE(encode_request(again, s.gen, out));
    CHECK(again == bytes);
  }
}

TEST_CASE("legacy lacks modern-only ops and modern lacks WATCH_KEY", "[codec]") {
  std::string b;
  CHECK_FALSE(encode_request(b, Generation::legacy, make(Op::ping)));
  CHECK_FALSE(encode_request(b, Generation::legacy, make(Op::barrier)));
  CHECK_FALSE(encode_request(b, Generation::modern, make(Op::watch_key)));
}

TEST_CASE("captured 1.13 frames decode as documented", "[codec]") {
  StoreLimits limits;
  Request out;
  DecoderState st;
  auto add = hex("03 0500000000000000 696e69742f 0100000000000000");
  auto r = decode_request(add, st, limits, out);
  REQUIRE(r.status == DecodeStatus::ok);
  CHECK(st.generation == Generation::legacy);
  CHECK(out.op == Op::add);
  CHECK(out.key == "init/");
  CHECK(out.number == 1);

  auto check = hex("04 0200000000000000 0200000000000000 2f61 0500000000000000 2f6e6f7065");
  r = decode_request(check, st, limits, out);
  REQUIRE(r.status == DecodeStatus::ok);
  CHECK(out.op == Op::check);
  CHECK(out.keys == std::vector<std::string_view>{"/a", "/nope"});
}

TEST_CASE("two requests in one buffer are decoded one at a time", "[codec]") {
  StoreLimits limits;
  std::string both = test::validate_bytes + hex("0d 34120000") + hex("07");
  DecoderState st;
  Request out;
  auto r = decode_request(both, st, limits, out);
  REQUIRE(r.status == DecodeStatus::ok);
  CHECK(out.op == Op::validate);
  CHECK(r.consumed == 5);
  std::string_view rest(both);
  rest.remove_prefix(r.consumed);
  r = decode_request(rest, st, limits, out);
  REQUIRE(r.status == DecodeStatus::ok);
  CHECK(out.op == Op::ping);
  CHECK(out.u32 == 0x1234);
  rest.remove_prefix(r.consumed);
  r = decode_request(rest, st, limits, out);
  REQUIRE(r.status == DecodeStatus::ok);
  CHECK(out.op == Op::get_num_keys);
  CHECK(r.consumed == 1);
}

TEST_CASE("a frame truncated at any byte needs more, and min_total is honest", "[codec]") {
  StoreLimits limits;
  for (const auto& s : samples()) {
    std::string bytes;
    REQUIRE(encode_request(bytes, s.gen, s.req));
    INFO(op_name(s.req.op) << " size " << bytes.size());
    for (std::size_t len = 0; len < bytes.size(); ++len) {
      INFO("prefix " << len);
      ExactBuffer buf(std::string_view(bytes).substr(0, len));
      DecoderState st = state_for(s);
      Request out;
      auto r = decode_request(buf.view(), st, limits, out);
      REQUIRE(r.status == DecodeStatus::need_more);
      CHECK(r.min_total > len);
      CHECK(r.min_total <= bytes.size());
      CHECK(st.generation == state_for(s).generation);  // nothing committed before a full frame
    }
    ExactBuffer full(bytes);
    DecoderState st = state_for(s);
    Request out;
    CHECK(decode_request(full.view(), st, limits, out).status == DecodeStatus::ok);
  }
}

TEST_CASE("corrupted frames decode cleanly or fail cleanly", "[codec]") {
  StoreLimits limits;
  limits.max_key_bytes = 1024;
  limits.max_value_bytes = 4096;
  limits.max_keys_per_request = 64;
  std::size_t oks = 0, errors = 0, need = 0;
  for (const auto& s : samples()) {
    std::string bytes;
    REQUIRE(encode_request(bytes, s.gen, s.req));
    for (std::size_t pos = 0; pos < bytes.size(); ++pos) {
      std::vector<std::uint8_t> replacements = {0x00, 0xff, 0x7f, 0x40, 0x13};
      for (int bit = 0; bit < 8; ++bit) {
        replacements.push_back(static_cast<std::uint8_t>(static_cast<std::uint8_t>(bytes[pos]) ^ (1u << bit)));
      }
      for (std::uint8_t v : replacements) {
        std::string corrupt = bytes;
        corrupt[pos] = static_cast<char>(v);
        for (bool first_frame : {true, false}) {
          ExactBuffer buf(corrupt);
          DecoderState st = first_frame ? DecoderState{} : established(s.gen);
          Request out;
          auto r = decode_request(buf.view(), st, limits, out);
          switch (r.status) {
            case DecodeStatus::ok:
              ++oks;
              REQUIRE(r.consumed > 0);
              REQUIRE(r.consumed <= corrupt.size());
              for (auto k : out.keys) REQUIRE(k.size() <= limits.max_key_bytes);
              break;
            case DecodeStatus::error:
              ++errors;
              REQUIRE_FALSE(r.reason.empty());
              break;
            case DecodeStatus::need_more:
              ++need;
              REQUIRE(r.min_total > corrupt.size());
              break;
            case DecodeStatus::extension:
              REQUIRE(static_cast<std::uint8_t>(corrupt[0]) >= extension_opcode_base);
              break;
          }
        }
      }
    }
  }
  CHECK(oks > 0);
  CHECK(errors > 0);
  CHECK(need > 0);
}

TEST_CASE("limits are enforced as soon as the length field is read", "[codec]") {
  StoreLimits limits;
  limits.max_key_bytes = 16;
  limits.max_value_bytes = 32;
  limits.max_keys_per_request = 4;
  Request out;
  SECTION("key length over the limit, body absent") {
    DecoderState st = established(Generation::modern);
    auto r = decode_request(hex("01") + test::u64(17), st, limits, out);
    REQUIRE(r.status == DecodeStatus::error);
    CHECK(r.reason.find("--max-key-bytes") != std::string::npos);
    CHECK(r.reason.find("SET") != std::string::npos);
  }
  SECTION("a key of exactly the limit is fine") {
    DecoderState st = established(Generation::modern);
    auto r = decode_request(hex("03") + test::str(std::string(16, 'k')), st, limits, out);
    CHECK(r.status == DecodeStatus::ok);
  }
  SECTION("value length over the limit, body absent") {
    DecoderState st = established(Generation::legacy);
    auto r = decode_request(hex("00") + test::str("/k") + test::u64(33), st, limits, out);
    REQUIRE(r.status == DecodeStatus::error);
    CHECK(r.reason.find("--max-value-bytes") != std::string::npos);
  }
  SECTION("CAS desired over the limit") {
    DecoderState st = established(Generation::modern);
    auto r = decode_request(hex("02") + test::str("/k") + test::str("") + test::u64(1u << 30), st, limits, out);
    REQUIRE(r.status == DecodeStatus::error);
  }
  SECTION("key count over the limit, keys absent") {
    DecoderState st = established(Generation::modern);
    auto r = decode_request(hex("06") + test::u64(5), st, limits, out);
    REQUIRE(r.status == DecodeStatus::error);
    CHECK(r.reason.find("--max-keys-per-request") != std::string::npos);
    st = established(Generation::modern);
    r = decode_request(hex("0b") + test::u64(5), st, limits, out);
    REQUIRE(r.status == DecodeStatus::error);
  }
  SECTION("a 2^63 length does not overflow anything") {
    DecoderState st = established(Generation::modern);
    auto r = decode_request(hex("03 ffffffffffffffff"), st, limits, out);
    REQUIRE(r.status == DecodeStatus::error);
  }
}

TEST_CASE("generation detection from the first bytes", "[codec]") {
  StoreLimits limits;
  Request out;
  SECTION("VALIDATE makes the connection modern") {
    DecoderState st;
    auto r = decode_request(test::validate_bytes, st, limits, out);
    REQUIRE(r.status == DecodeStatus::ok);
    CHECK(out.op == Op::validate);
    CHECK(st.generation == Generation::modern);
    // modern numbering from now on: 03 = GET
    r = decode_request(hex("03") + test::str("/k"), st, limits, out);
    REQUIRE(r.status == DecodeStatus::ok);
    CHECK(out.op == Op::get);
  }
  SECTION("a partial magic waits for five bytes") {
    for (std::size_t n = 1; n < 5; ++n) {
      DecoderState st;
      auto r = decode_request(test::validate_bytes.substr(0, n), st, limits, out);
      CHECK(r.status == DecodeStatus::need_more);
      CHECK(r.min_total == 5);
    }
  }
  SECTION("00 not followed by the magic is a legacy SET") {
    DecoderState st;
    auto set = hex("00") + test::str("/k1") + test::str("v1");
    auto r = decode_request(set, st, limits, out);
    REQUIRE(r.status == DecodeStatus::ok);
    CHECK(out.op == Op::set);
    CHECK(st.generation == Generation::legacy);
    // legacy numbering: 03 = ADD, 07 = WATCH_KEY, 00 = SET again (not VALIDATE)
    r = decode_request(hex("03") + test::str("c") + test::i64(2), st, limits, out);
    REQUIRE(r.status == DecodeStatus::ok);
    CHECK(out.op == Op::add);
    r = decode_request(hex("07") + test::str("/w"), st, limits, out);
    REQUIRE(r.status == DecodeStatus::ok);
    CHECK(out.op == Op::watch_key);
    r = decode_request(test::validate_bytes, st, limits, out);
    CHECK(r.status != DecodeStatus::ok);  // a 0x3C85F7CE-byte key: over the key limit
  }
  SECTION("a partial legacy SET whose length diverges from the magic is decided early") {
    DecoderState st;
    auto r = decode_request(hex("00 03"), st, limits, out);
    CHECK(r.status == DecodeStatus::need_more);
    CHECK(r.min_total == 9);
  }
  SECTION("second VALIDATE closes") {
    DecoderState st = established(Generation::modern);
    auto r = decode_request(test::validate_bytes, st, limits, out);
    REQUIRE(r.status == DecodeStatus::error);
    CHECK(r.reason.find("VALIDATE") != std::string::npos);
  }
  SECTION("modern-only servers reject legacy openings") {
    DecoderState st;
    st.accept_legacy = false;
    auto r = decode_request(hex("03") + test::str("init/") + test::i64(1), st, limits, out);
    CHECK(r.status == DecodeStatus::error);
    st = DecoderState{};
    st.accept_legacy = false;
    CHECK(decode_request(test::validate_bytes, st, limits, out).status == DecodeStatus::ok);
  }
  SECTION("unknown opcodes") {
    DecoderState st;
    CHECK(decode_request(hex("09"), st, limits, out).status == DecodeStatus::error);
    st = established(Generation::legacy);
    CHECK(decode_request(hex("09"), st, limits, out).status == DecodeStatus::error);
    st = established(Generation::modern);
    CHECK(decode_request(hex("13"), st, limits, out).status == DecodeStatus::error);
    CHECK(decode_request(hex("ff"), st, limits, out).status == DecodeStatus::extension);
    DecoderState fresh;
    CHECK(decode_request(hex("40"), fresh, limits, out).status == DecodeStatus::extension);
  }
}

TEST_CASE("response encoders", "[codec]") {
  std::string out;
  reply::i64(out, 2);
  CHECK(out == hex("0200000000000000"));
  out.clear();
  reply::str(out, "v1");
  CHECK(out == hex("0200000000000000 7631"));
  out.clear();
  reply::watch_event(out, WatchResponse::key_created, "/w", "", "first");
  CHECK(out == hex("01 0200000000000000 2f77 0000000000000000 0500000000000000 6669727374"));
  out.clear();
  reply::wait(out, WaitResponse::wait_canceled);
  reply::check(out, CheckResponse::not_ready);
  reply::u32(out, 0x1234);
  CHECK(out == hex("01 01 34120000"));
}

TEST_CASE("a request of many keys arriving in small pieces is decoded a bounded number of times", "[codec]") {
  // The server decodes again once min_total bytes are buffered. With min_total only covering
  // the next field, a 1 MiB CHECK of 131072 keys trickling in 64-byte pieces was decoded from
  // its first byte ~16,000 times; counting the length field every remaining key must have,
  // empty keys are decoded once, longer ones a logarithmic number of times.
  for (const std::size_t key_len : {std::size_t{0}, std::size_t{56}}) {
    DYNAMIC_SECTION("keys of " << key_len << " bytes") {
      const std::string key(key_len, 'k');
      Request r = make(Op::check);
      r.keys.assign(131072, key);
      std::string wire;
      REQUIRE(encode_request(wire, Generation::modern, r));
      StoreLimits limits;
      limits.max_keys_per_request = 131072;
      DecoderState state;
      state.generation = Generation::modern;
      Request out;
      std::size_t have = 0;
      std::size_t need = 1;
      int decodes = 0;
      DecodeResult res;
      while (true) {
        have = std::min(wire.size(), have + 64);
        if (have < need) continue;
        ++decodes;
        res = decode_request(std::string_view(wire).substr(0, have), state, limits, out);
        if (res.status != DecodeStatus::need_more) break;
        REQUIRE(res.min_total > have);
        REQUIRE(res.min_total <= wire.size());  // a lower bound: never waits for bytes that will not come
        need = res.min_total;
      }
      REQUIRE(res.status == DecodeStatus::ok);
      CHECK(res.consumed == wire.size());
      CHECK(out.keys.size() == 131072);
      CHECK(decodes <= (key_len == 0 ? 3 : 200));
    }
  }
}

TEST_CASE("a request of many keys goes on where the last decode stopped", "[codec]") {
  // Each key is read once: after need_more the decoder resumes at the first key it has not
  // decoded whole. Proof that it does not read the earlier keys again: their bytes are
  // overwritten between the calls (a length field made huge) and the request still decodes,
  // its keys taken from where they were when they were read.
  for (const Op op : {Op::check, Op::multi_set}) {
    DYNAMIC_SECTION(op_name(op)) {
      Request r = make(op);
      std::vector<std::string> keys;
      for (int i = 0; i < 100; ++i) keys.push_back(fmt::format("key-{:03}", i));
      for (const auto& k : keys) r.keys.push_back(k);
      if (op == Op::multi_set) r.values = r.keys;
      std::string wire;
      REQUIRE(encode_request(wire, Generation::modern, r));
      StoreLimits limits;
      DecoderState state;
      state.generation = Generation::modern;
      Request out;
      const std::size_t half = wire.size() / 2;
      std::string buf = wire.substr(0, half);
      auto res = decode_request(buf, state, limits, out);
      REQUIRE(res.status == DecodeStatus::need_more);
      REQUIRE(state.resume_pos > 9);
      const std::size_t kept = state.spans.size();
      CHECK(kept >= 2);
      // The first key's length field, already read, now says 2^60 (over every limit).
      buf = wire;
      buf[1 + 8 + 7] = '\x10';
      res = decode_request(buf, state, limits, out);
      REQUIRE(res.status == DecodeStatus::ok);
      CHECK(res.consumed == wire.size());
      REQUIRE(out.keys.size() == keys.size());
      for (std::size_t i = 0; i < keys.size(); ++i) CHECK(out.keys[i] == keys[i]);
      CHECK(out.values.size() == (op == Op::multi_set ? keys.size() : 0));
      CHECK(state.resume_pos == 0);
      CHECK(state.spans.empty());

      // A fresh decode of the same corrupted bytes reads that length and refuses it.
      DecoderState fresh;
      fresh.generation = Generation::modern;
      CHECK(decode_request(buf, fresh, limits, out).status == DecodeStatus::error);
    }
  }
}

TEST_CASE("a resumed decode ignores a state whose request is longer than the buffer", "[codec]") {
  // A caller that breaks the contract (a shorter buffer after need_more) gets a decode from the
  // first byte, never a read past the buffer.
  Request r = make(Op::wait);
  r.keys = {"a", "b", "c", "d"};
  std::string wire;
  REQUIRE(encode_request(wire, Generation::modern, r));
  StoreLimits limits;
  DecoderState state;
  state.generation = Generation::modern;
  Request out;
  REQUIRE(decode_request(std::string_view(wire).substr(0, wire.size() - 1), state, limits, out).status ==
          DecodeStatus::need_more);
  REQUIRE(state.resume_pos != 0);
  auto res = decode_request(std::string_view(wire).substr(0, 3), state, limits, out);
  CHECK(res.status == DecodeStatus::need_more);
  res = decode_request(wire, state, limits, out);
  REQUIRE(res.status == DecodeStatus::ok);
  CHECK(out.keys == std::vector<std::string_view>{"a", "b", "c", "d"});
}
