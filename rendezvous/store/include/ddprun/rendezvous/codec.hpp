#pragma once
// The TCPStore frame codec: an incremental request decoder and the request/response encoders.
// Pure functions, no I/O, no allocation on the decode fast path (a Request is reused).
//
// decode_request() is given the bytes buffered for one connection (starting at a request
// boundary) and that connection's DecoderState. It answers one of:
//   * need_more  — the buffer ends inside the request; `min_total` says how many bytes the
//                  request needs at least (so a server need not re-parse before that many
//                  bytes are buffered);
//   * ok         — one complete request decoded into `out`, `consumed` bytes long;
//   * error      — a protocol error (`reason`); the connection must be closed;
//   * extension  — the opcode byte lies in the extension range (>= extension_opcode_base) of an
//                  established connection; the caller hands the frame to its extension hook.
// Limits are checked as soon as a length or count field is read, before its body arrives.
//
// Generation detection (first request of a connection): `00 CE F7 85 3C` = VALIDATE, the
// connection is modern; any other first byte 0x00..0x08 = legacy (1.13 numbering, no
// handshake); a leading 0x00 needs 5 bytes to decide (a legacy SET whose key length starts
// with the magic would be a > 2^32-byte key, rejected by every limit anyway).
//
// String views in a decoded Request point into the caller's buffer: valid until the caller
// discards or moves those bytes.
//
// A request of many keys is decoded incrementally: after need_more, the next call goes on from
// the last whole key (DecoderState::resume_pos), so the caller must give it a buffer starting
// with the same request (more of it), as a connection's buffer does. Each byte is read once.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ddprun/rendezvous/protocol.hpp"

namespace ddprun::rendezvous {

// Opcode bytes from here up are never used by torch (its enum ends below 0x20); reserved for
// ddprun's native rendezvous operations on the same port (docs/protocol.md, "Extension point").
inline constexpr std::uint8_t extension_opcode_base = 0x40;

struct Request {
  Op op = Op::get_num_keys;
  std::string_view key;                  // SET CAS GET ADD DELETE APPEND QUEUE_* BARRIER WATCH_KEY
  std::string_view value;                // SET APPEND QUEUE_PUSH value; COMPARE_SET expected
  std::string_view desired;              // COMPARE_SET desired
  std::int64_t number = 0;               // ADD delta, BARRIER world size
  std::uint32_t u32 = 0;                 // PING nonce, VALIDATE magic
  std::vector<std::string_view> keys;    // CHECK WAIT MULTI_GET MULTI_SET
  std::vector<std::string_view> values;  // MULTI_SET

  // A fresh request of `o` (the vectors keep their capacity).
  void reset(Op o) {
    op = o;
    key = {};
    value = {};
    desired = {};
    number = 0;
    u32 = 0;
    keys.clear();
    values.clear();
  }
};

struct DecoderState {
  std::optional<Generation> generation;  // unset until the first request decides it
  bool accept_legacy = true;             // false: a connection must open with VALIDATE

  // A request of many keys (CHECK WAIT MULTI_GET MULTI_SET) that ended in need_more: where its
  // decoding goes on, so that a request trickling in is read once, not again from its first key
  // on every decode. `spans` are the (offset, length) of every key (and, for MULTI_SET, value
  // after each key) decoded so far, relative to the request's first byte. resume_pos == 0: none.
  // After need_more, the next buffer given to decode_request must start with the same bytes.
  struct Span {
    std::size_t offset = 0;
    std::size_t length = 0;
  };
  std::size_t resume_pos = 0;
  std::uint64_t resume_count = 0;  // the request's key count
  std::vector<Span> spans;
};

enum class DecodeStatus : std::uint8_t { need_more, ok, error, extension };

struct DecodeResult {
  DecodeStatus status = DecodeStatus::need_more;
  std::size_t consumed = 0;   // ok: bytes of the request
  std::size_t min_total = 1;  // need_more: the request is at least this long
  std::string reason;         // error: what was wrong (names the op and the limit)
};

// Decodes one request at the start of `buffer`. On ok, `state.generation` is set if it was
// unset. `out` is overwritten (its vectors keep their capacity).
DecodeResult decode_request(std::string_view buffer, DecoderState& state, const StoreLimits& limits, Request& out);

// Appends the wire form of `req` for generation `gen` (the store client, tests and the fuzzer's
// seed generator). Every key (`key`, `keys`) is sent as `key_prefix` + key, without the caller
// building the concatenation. Returns false when `gen` lacks the op.
bool encode_request(std::string& out, Generation gen, const Request& req, std::string_view key_prefix = {});

// Response encoders (identical in both generations).
namespace reply {
void u8(std::string& out, std::uint8_t v);
void i64(std::string& out, std::int64_t v);
void u32(std::string& out, std::uint32_t v);
void str(std::string& out, std::string_view s);
void check(std::string& out, CheckResponse r);
void wait(std::string& out, WaitResponse r);
// 1.13 watch event on the callback connection: type | S key | S old | S new, where new is
// new_value followed by new_tail (an APPEND's event, built without a copy of the value).
void watch_event(std::string& out, WatchResponse type, std::string_view key, std::string_view old_value,
                 std::string_view new_value, std::string_view new_tail = {});
}  // namespace reply

}  // namespace ddprun::rendezvous
