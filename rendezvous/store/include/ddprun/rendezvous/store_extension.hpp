#pragma once
// StoreExtension: the hook through which native (non-torch) operations share the store port.
//
// torch's TCPStore opcodes all lie below 0x20 in both generations. A frame whose opcode byte is
// >= extension_opcode_base (0x40) — as the first byte of a connection or at any later request
// boundary — is not parsed by the TCPStore codec: the server hands the buffered bytes to the
// installed extension (StoreServerOptions::extension). Without an extension such a frame is a
// protocol error and closes the connection. RendezvousService (elastic/) implements this
// interface for the native rendezvous frames; docs/protocol.md describes the contract.
//
// Called only on the server's io_context thread, like everything else in the server.
#include <cstddef>
#include <string>
#include <string_view>

#include "ddprun/rendezvous/codec.hpp"
#include "ddprun/rendezvous/store_state.hpp"

namespace ddprun::rendezvous {

class StoreExtension {
 public:
  virtual ~StoreExtension() = default;

  // `buffer` starts at a request boundary whose first byte is >= extension_opcode_base.
  // Decode and execute at most one frame, appending replies through `outbox` (which may also
  // address other connections). Return need_more (with min_total), ok (with consumed > 0) or
  // error (with reason: the connection is closed and logged). `state` is the shared key space.
  virtual DecodeResult on_frame(ConnectionId conn, std::string_view buffer, StoreState& state, Outbox& outbox) = 0;
  // Asked before every TCPStore request on `conn`: "" lets it run, a reason closes the
  // connection (logged with the peer). An authenticating extension refuses store ops on
  // connections that did not authenticate.
  virtual std::string store_op_refusal(ConnectionId conn) {
    (void)conn;
    return {};
  }
  // Whether `conn` must still authenticate before it may do anything (a token daemon that lets
  // no unauthenticated client in). Such a connection is closed after the server's handshake
  // timeout, and is the first to give way when the connection limit is reached.
  virtual bool awaiting_authentication(ConnectionId conn) {
    (void)conn;
    return false;
  }
  // The connection closed (peer, error, reset or stop).
  virtual void on_disconnect(ConnectionId conn) { (void)conn; }
  // StoreServer::reset() dropped the key space.
  virtual void on_reset() {}
};

}  // namespace ddprun::rendezvous
