#pragma once
// The c10d TCPStore wire protocol: query numbering of both generations, response codes and
// limits. Pure constants; see docs/protocol.md and shared/design/tcpstore-protocol.md §3.
//
// Generations:
//   legacy  PyTorch 1.13 / 2.0: no handshake, SET=0 … DELETE_KEY=8 (WATCH_KEY=7).
//   modern  PyTorch 2.2+: first message VALIDATE(0)+magic, everything else shifted by +1,
//           WATCH_KEY gone, APPEND…BARRIER added, PING since 2.5.
// ddprun works internally with `Op` (generation independent) and maps wire bytes per
// connection with `decode_op` / `encode_op`.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace ddprun::rendezvous {

enum class Generation : std::uint8_t { legacy, modern };

enum class Op : std::uint8_t {
  validate,
  set,
  compare_set,
  get,
  add,
  check,
  wait,
  get_num_keys,
  watch_key,  // legacy only
  delete_key,
  append,
  multi_get,
  multi_set,
  cancel_wait,
  ping,
  queue_push,
  queue_pop,
  queue_len,
  list_keys,
  barrier,
};

inline constexpr std::uint32_t validation_magic = 0x3C85F7CEu;  // wire: CE F7 85 3C

enum class CheckResponse : std::uint8_t { ready = 0, not_ready = 1 };
enum class WaitResponse : std::uint8_t { stop_waiting = 0, wait_canceled = 1 };
enum class WatchResponse : std::uint8_t {
  key_updated = 0,
  key_created = 1,
  key_deleted = 2,
  key_callback_registered = 3,
};

// Wire byte -> Op for a generation; nullopt for a byte that generation does not define.
constexpr std::optional<Op> decode_op(Generation gen, std::uint8_t byte) {
  if (gen == Generation::legacy) {
    switch (byte) {
      case 0:
        return Op::set;
      case 1:
        return Op::compare_set;
      case 2:
        return Op::get;
      case 3:
        return Op::add;
      case 4:
        return Op::check;
      case 5:
        return Op::wait;
      case 6:
        return Op::get_num_keys;
      case 7:
        return Op::watch_key;
      case 8:
        return Op::delete_key;
      default:
        return std::nullopt;
    }
  }
  switch (byte) {
    case 0:
      return Op::validate;
    case 1:
      return Op::set;
    case 2:
      return Op::compare_set;
    case 3:
      return Op::get;
    case 4:
      return Op::add;
    case 5:
      return Op::check;
    case 6:
      return Op::wait;
    case 7:
      return Op::get_num_keys;
    case 8:
      return Op::delete_key;
    case 9:
      return Op::append;
    case 10:
      return Op::multi_get;
    case 11:
      return Op::multi_set;
    case 12:
      return Op::cancel_wait;
    case 13:
      return Op::ping;
    case 14:
      return Op::queue_push;
    case 15:
      return Op::queue_pop;
    case 16:
      return Op::queue_len;
    case 17:
      return Op::list_keys;
    case 18:
      return Op::barrier;
    default:
      return std::nullopt;
  }
}

// Op -> wire byte for a generation; nullopt when that generation lacks the op.
constexpr std::optional<std::uint8_t> encode_op(Generation gen, Op op) {
  for (unsigned b = 0; b < 256; ++b) {
    if (decode_op(gen, static_cast<std::uint8_t>(b)) == op) return static_cast<std::uint8_t>(b);
  }
  return std::nullopt;
}

constexpr std::string_view op_name(Op op) {
  switch (op) {
    case Op::validate:
      return "VALIDATE";
    case Op::set:
      return "SET";
    case Op::compare_set:
      return "COMPARE_SET";
    case Op::get:
      return "GET";
    case Op::add:
      return "ADD";
    case Op::check:
      return "CHECK";
    case Op::wait:
      return "WAIT";
    case Op::get_num_keys:
      return "GETNUMKEYS";
    case Op::watch_key:
      return "WATCH_KEY";
    case Op::delete_key:
      return "DELETE_KEY";
    case Op::append:
      return "APPEND";
    case Op::multi_get:
      return "MULTI_GET";
    case Op::multi_set:
      return "MULTI_SET";
    case Op::cancel_wait:
      return "CANCEL_WAIT";
    case Op::ping:
      return "PING";
    case Op::queue_push:
      return "QUEUE_PUSH";
    case Op::queue_pop:
      return "QUEUE_POP";
    case Op::queue_len:
      return "QUEUE_LEN";
    case Op::list_keys:
      return "LIST_KEYS";
    case Op::barrier:
      return "BARRIER";
  }
  return "?";
}

// Limits enforced while parsing (server) and before sending (client). Defaults are at least
// as permissive as the libuv server's (8 KiB keys, 8 MiB values, 128 Ki keys per request).
// Every limit, its flag and what a client sees when it trips: docs/protocol.md, "Limits".
struct StoreLimits {
  std::size_t max_key_bytes = 64 * 1024;
  std::size_t max_value_bytes = 64 * 1024 * 1024;
  std::size_t max_keys_per_request = 128 * 1024;
  // Clamped by the server below the open-files limit, keeping a reserve of descriptors.
  std::size_t max_connections = 65536;
  std::size_t max_total_bytes = std::size_t{4} * 1024 * 1024 * 1024;  // all keys+values held
  // Keys plus queued QUEUE_PUSH items held at once.
  std::size_t max_keys = std::size_t{4} * 1024 * 1024;
  // WAIT/BARRIER registrations plus 1.13 WATCH_KEY registrations, over all connections.
  std::size_t max_waits = 1024 * 1024;
  // Reply bytes queued for one connection and not yet taken by its socket. A request whose
  // reply would pass it is refused before the reply is built; a connection that other
  // clients' writes (WATCH events, wake-ups) push past it is closed.
  std::size_t max_queued_reply_bytes = 128 * 1024 * 1024;
  // Read buffers plus queued replies of all connections together; past it the connections with
  // the largest backlogs are closed.
  std::size_t max_buffered_bytes = std::size_t{1} * 1024 * 1024 * 1024;
  // Connections from one peer address (0 = no cap); a relayed connection counts for the address
  // its relay reports.
  std::size_t max_connections_per_peer = 4096;
  // Client connections carried by relays (relay_link.hpp), over all relay links. They hold no
  // descriptor here, so the open-files clamp of max_connections does not apply to them.
  std::size_t max_relayed_connections = std::size_t{1} << 20;
};

}  // namespace ddprun::rendezvous
