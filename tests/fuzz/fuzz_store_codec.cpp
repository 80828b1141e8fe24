// libFuzzer target: the TCPStore frame decoder and the store state machine.
//
// The input is one connection's byte stream. Byte 0 picks the options (legacy allowed or not,
// which connection id the frames belong to); the rest is decoded frame by frame exactly as the
// server does, every decoded request is applied to a StoreState, and a few invariants are
// checked: consumed never exceeds the buffer, need_more always asks for more than is there,
// and a request decoded from an exact-sized copy decodes identically (no reads past the frame).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#include "ddprun/rendezvous/codec.hpp"
#include "ddprun/rendezvous/store_state.hpp"

using namespace ddprun::rendezvous;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const std::uint8_t flags = data[0];
  std::string_view stream(reinterpret_cast<const char*>(data + 1), size - 1);

  StoreLimits limits;
  limits.max_key_bytes = 256;
  limits.max_value_bytes = 1024;
  limits.max_keys_per_request = 32;
  limits.max_total_bytes = 4096;
  StoreState state(limits);
  RecordingOutbox outbox;
  DecoderState decoder;
  decoder.accept_legacy = (flags & 1) == 0;
  const ConnectionId conn = 1 + ((flags >> 1) & 3);
  Request req;

  while (!stream.empty()) {
    DecoderState before = decoder;
    auto r = decode_request(stream, decoder, limits, req);
    if (r.status == DecodeStatus::need_more) {
      if (r.min_total <= stream.size()) std::abort();
      break;
    }
    if (r.status != DecodeStatus::ok) break;
    if (r.consumed == 0 || r.consumed > stream.size()) std::abort();

    // Decoding only the frame's own bytes must give the same frame.
    {
      std::string exact(stream.substr(0, r.consumed));
      Request again;
      DecoderState st = before;
      auto r2 = decode_request(exact, st, limits, again);
      if (r2.status != DecodeStatus::ok || r2.consumed != r.consumed || again.op != req.op) std::abort();

      // So must decoding it in two pieces (the second call goes on where the first stopped).
      const std::size_t cut = 1 + (r.consumed * static_cast<std::size_t>(flags >> 5)) / 8;
      if (cut < r.consumed) {
        Request split;
        DecoderState st2 = before;
        auto r3 = decode_request(std::string_view(exact).substr(0, cut), st2, limits, split);
        if (r3.status == DecodeStatus::need_more) r3 = decode_request(exact, st2, limits, split);
        if (r3.status != DecodeStatus::ok || r3.consumed != r.consumed || split.op != req.op ||
            split.keys != again.keys || split.values != again.values || st2.resume_pos != 0)
          std::abort();
      }
    }

    if (!state.apply(conn, req, outbox).ok) {
      state.disconnect(conn);
      break;
    }
    // Something else writes the waited keys now and then, to exercise wake-ups.
    if ((flags & 0x10) && !req.keys.empty()) {
      Request set;
      set.op = Op::set;
      set.key = req.keys.front();
      set.value = "x";
      (void)state.apply(99, set, outbox);
    }
    if (state.bytes() > limits.max_total_bytes) std::abort();
    stream.remove_prefix(r.consumed);
  }
  state.disconnect(conn);
  return 0;
}
