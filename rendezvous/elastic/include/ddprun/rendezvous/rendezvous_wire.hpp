#pragma once
// The native rendezvous frames (docs/protocol.md, "Native rendezvous operations"): a pure codec
// between bytes and the plain structs of rendezvous_state.hpp. No I/O, no clock.
//
// Frame = u8 op | u32 LE payload length | payload, where the payload is one UTF-8 JSON object.
// Client -> server ops are 0x40..0x47, server -> client (pushed) ops 0x60..0x67; both lie in the
// store's extension range (>= extension_opcode_base), so they share the TCPStore port.
//
// Decoding is incremental like the store codec: given the bytes buffered for a connection
// (starting at a frame boundary) decode_*() answers need_more (with the minimum total frame
// length), ok (one message decoded, `consumed` bytes) or error (reason names the op and field;
// the connection must be closed). The payload limit is checked as soon as the header is read,
// before the body arrives; JSON nesting depth is bounded; a field of the wrong type, a missing
// required field or an out-of-range number is an error, never an exception.
//
// Thread-safe (no shared state).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <variant>

#include "ddprun/rendezvous/codec.hpp"
#include "ddprun/rendezvous/json_capped.hpp"
#include "ddprun/rendezvous/rendezvous_state.hpp"

namespace ddprun::rendezvous {

enum class NativeOp : std::uint8_t {
  // client -> server
  join = 0x40,
  rejoin = 0x41,
  heartbeat = 0x42,
  leave = 0x43,
  worker_failed = 0x44,
  succeeded = 0x45,
  close = 0x46,
  status = 0x47,
  hello = 0x48,
  auth = 0x49,
  relay = 0x4a,  // a relay asks to carry other clients' connections (docs/protocol.md, "Relays")
  // server -> client (pushed)
  assignment = 0x60,
  restart = 0x61,
  job_failed = 0x62,
  job_completed = 0x63,
  refused = 0x64,
  ask_rejoin = 0x65,
  progress = 0x66,
  status_reply = 0x67,
  challenge = 0x68,
  auth_ok = 0x69,
  joined = 0x6a,
  relay_ok = 0x6b,  // the connection is a relay link from the next byte on (relay_link.hpp)
};

const char* native_op_name(std::uint8_t op);  // "JOIN", ..., "0x4f" style for unknown

inline constexpr std::size_t native_header_bytes = 5;
// The largest payload a daemon with a token accepts before AUTH (HELLO and AUTH are far smaller).
inline constexpr std::size_t max_handshake_payload_bytes = 4096;

struct WireLimits {
  std::size_t max_payload_bytes = std::size_t{1} << 20;  // 1 MiB
  int max_json_depth = 16;
};

// Decoding one payload may take at most json_dom_cap_bytes(its size) (json_capped.hpp): a frame
// past it is refused as malformed, so a peer's frame costs at most that, not the ~17x that JSON
// of tiny values inflates to.

// ---- client -> server messages ----
struct JoinMessage {
  std::string run_id;
  JoinRequest request;
};
struct RejoinMessage {
  std::string run_id;
  RejoinRequest request;
};
struct HeartbeatMessage {
  std::string run_id;
  NodeId node;
};
struct LeaveMessage {
  std::string run_id;
  NodeId node;
};
struct WorkerFailedMessage {
  std::string run_id;
  WorkerFailure failure;
};
struct SucceededMessage {
  std::string run_id;
  NodeId node;
  std::uint64_t round = 0;
};
struct CloseMessage {
  std::string run_id;
};
struct StatusMessage {
  std::string run_id;  // "" = every job
};
// The handshake (rendezvous_auth.hpp has the MACs): HELLO opens a connection, AUTH answers the
// server's CHALLENGE when it asks for authentication.
struct HelloMessage {
  int version = 1;
  std::string client_nonce;  // 64 hex digits
};
struct AuthMessage {
  std::string run_id;  // the job this connection may touch; "*" = every job
  std::string mac;     // 64 hex digits
};

// A relay (ddprun-rdzvd --relay-to) asks to turn its authenticated connection into a relay link.
struct RelayMessage {
  int version = 1;
  // Asks for TRUSTED link frames (relay_link.hpp): which relayed connections have authenticated,
  // so the relay knows which of its clients may give way at its own --max-connections. A daemon
  // that sends them says so in RELAY_OK; an older one ignores the field.
  bool trusted_frames = false;
};

using ClientMessage =
    std::variant<JoinMessage, RejoinMessage, HeartbeatMessage, LeaveMessage, WorkerFailedMessage, SucceededMessage,
                 CloseMessage, StatusMessage, HelloMessage, AuthMessage, RelayMessage>;

// ---- server -> client messages: the registry's actions plus the STATUS reply ----
struct ChallengeMessage {
  std::string server_nonce;  // 64 hex digits
  bool auth = false;         // false: the server has no token, no AUTH is needed
  // The server is a rendezvous embedded in one agent (no ddprun-rdzvd): once it refuses
  // connections, that agent is gone and the job cannot go on. Optional on the wire.
  bool embedded = false;
};
struct AuthOkMessage {
  std::string mac;  // the server's proof that it knows the token
};
// The answer to a JOIN that registered the node: the secret a later REJOIN must present.
struct JoinedMessage {
  std::string run_id;
  NodeId node;
  std::string node_secret;  // 32 hex digits
};

using ServerMessage = std::variant<SendAssignment, SendRestart, SendJobFailed, SendJobCompleted, Refuse, AskRejoin,
                                   Progress, RegistryStatus, ChallengeMessage, AuthOkMessage, JoinedMessage>;

// Appends one frame. Throws ddprun::Error only if the payload exceeds 4 GiB (never in practice).
void encode_client(std::string& out, const ClientMessage& message);
void encode_server(std::string& out, const ServerMessage& message);
void encode_decision(std::string& out, const Decision& action);
// RELAY_OK: the server's answer to an accepted RELAY; payload "{}", or {"trusted": true} when
// it will send TRUSTED link frames (RelayMessage::trusted_frames).
void encode_relay_ok(std::string& out, bool trusted_frames = false);
// Whether the RELAY_OK frame `frame` (whole) says TRUSTED frames will follow; false for a frame
// that does not decode or is not RELAY_OK.
bool relay_ok_trusted_frames(std::string_view frame);

// Decodes one frame at the start of `buffer`. A server->client op on the server side (and the
// reverse) is an error.
DecodeResult decode_client(std::string_view buffer, const WireLimits& limits, ClientMessage& out);
DecodeResult decode_server(std::string_view buffer, const WireLimits& limits, ServerMessage& out);

}  // namespace ddprun::rendezvous
