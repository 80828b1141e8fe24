#pragma once
// Relay link frames (docs/protocol.md, "Relays"): what a relay (`ddprun-rdzvd --relay-to`) and
// the daemon it relays to exchange on one TCP connection once the daemon answered RELAY with
// RELAY_OK. Each frame carries one event of one relayed client connection, named by a number
// the relay chose (the vid):
//
//   u8 op | u32 LE vid | u32 LE payload length | payload
//
//   OPEN  (0x70) relay -> daemon: a client connected to the relay; payload = its address as
//                "host:port" (at most max_relay_peer_bytes). vid != 0, not in use on the link.
//   DATA  (0x71) both ways: bytes of that client's stream (1 to max_relay_data_bytes).
//   CLOSE (0x72) both ways: the connection ended on the sender's side; payload = a reason for the
//                logs (at most max_relay_reason_bytes, may be empty). No answer is expected; a
//                DATA or CLOSE that crosses it on the wire names a vid that is gone and is ignored.
//   TRUSTED (0x73) daemon -> relay, only on a link whose RELAY asked for it and whose RELAY_OK
//                said yes: the connection has authenticated (or the daemon awaits no handshake
//                from it); payload empty. At its --max-connections the relay makes room by
//                closing its oldest client without one, never a trusted one. Sent by a relay: a
//                protocol error. A vid that is gone is ignored.
//
// Pure codec, no I/O; thread-safe (no shared state). A frame that breaks these rules is a
// protocol error of the whole link (the daemon closes the link and with it every connection it
// carried).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace ddprun::rendezvous {

enum class RelayOp : std::uint8_t { open = 0x70, data = 0x71, close = 0x72, trusted = 0x73 };

inline constexpr std::size_t relay_header_bytes = 9;
inline constexpr std::size_t max_relay_data_bytes = std::size_t{1} << 20;
inline constexpr std::size_t max_relay_peer_bytes = 256;
inline constexpr std::size_t max_relay_reason_bytes = 1024;

// Appends one frame.
void append_relay_frame(std::string& out, RelayOp op, std::uint32_t vid, std::string_view payload);

struct RelayFrame {
  RelayOp op = RelayOp::data;
  std::uint32_t vid = 0;
  std::string_view payload;  // points into the decoded buffer
};

struct RelayDecodeResult {
  enum class Status { ok, need_more, error } status = Status::need_more;
  std::size_t consumed = 0;   // ok: bytes of the frame
  std::size_t min_total = 0;  // need_more: do not decode again before this many bytes are buffered
  std::string reason;         // error: what is wrong, for the log line
};

// Decodes the frame at the start of `buffer`. The length is checked against the op's bound as
// soon as the header is read, before the payload arrives.
RelayDecodeResult decode_relay_frame(std::string_view buffer, RelayFrame& out);

}  // namespace ddprun::rendezvous
