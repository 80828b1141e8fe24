// Relay link frames (relay_link.hpp has the contract).
#include "ddprun/rendezvous/relay_link.hpp"

#include <fmt/format.h>

#include "ddprun/rendezvous/bytes.hpp"

namespace ddprun::rendezvous {

namespace {

std::size_t max_payload(RelayOp op) {
  switch (op) {
    case RelayOp::open:
      return max_relay_peer_bytes;
    case RelayOp::data:
      return max_relay_data_bytes;
    case RelayOp::close:
      return max_relay_reason_bytes;
    case RelayOp::trusted:
      return 0;
  }
  return 0;
}

}  // namespace

void append_relay_frame(std::string& out, RelayOp op, std::uint32_t vid, std::string_view payload) {
  bytes::put_u8(out, static_cast<std::uint8_t>(op));
  bytes::put_u32(out, vid);
  bytes::put_u32(out, static_cast<std::uint32_t>(payload.size()));
  out.append(payload);
}

RelayDecodeResult decode_relay_frame(std::string_view buffer, RelayFrame& out) {
  RelayDecodeResult r;
  if (buffer.size() < relay_header_bytes) {
    r.min_total = relay_header_bytes;
    if (!buffer.empty()) {
      const auto op = static_cast<unsigned char>(buffer[0]);
      if (op < 0x70 || op > 0x73) {
        r.status = RelayDecodeResult::Status::error;
        r.reason = fmt::format("relay link: opcode 0x{:02x} is not OPEN, DATA, CLOSE or TRUSTED", op);
      }
    }
    return r;
  }
  const auto op_byte = static_cast<unsigned char>(buffer[0]);
  if (op_byte < 0x70 || op_byte > 0x73) {
    r.status = RelayDecodeResult::Status::error;
    r.reason = fmt::format("relay link: opcode 0x{:02x} is not OPEN, DATA, CLOSE or TRUSTED", op_byte);
    return r;
  }
  const auto op = static_cast<RelayOp>(op_byte);
  const std::uint32_t vid = bytes::load_le<std::uint32_t>(buffer.data() + 1);
  const std::size_t length = bytes::load_le<std::uint32_t>(buffer.data() + 5);
  const char* name = op == RelayOp::open    ? "OPEN"
                     : op == RelayOp::data  ? "DATA"
                     : op == RelayOp::close ? "CLOSE"
                                            : "TRUSTED";
  if (vid == 0) {
    r.status = RelayDecodeResult::Status::error;
    r.reason = fmt::format("relay link: {} names connection 0 (connection numbers start at 1)", name);
    return r;
  }
  if (length > max_payload(op) || (op == RelayOp::data && length == 0)) {
    r.status = RelayDecodeResult::Status::error;
    r.reason = fmt::format("relay link: {} of connection {} carries {} bytes; it must carry {} to {}", name, vid,
                           length, op == RelayOp::data ? 1 : 0, max_payload(op));
    return r;
  }
  if (buffer.size() < relay_header_bytes + length) {
    r.min_total = relay_header_bytes + length;
    return r;
  }
  out.op = op;
  out.vid = vid;
  out.payload = buffer.substr(relay_header_bytes, length);
  r.status = RelayDecodeResult::Status::ok;
  r.consumed = relay_header_bytes + length;
  return r;
}

}  // namespace ddprun::rendezvous
