// libFuzzer target: the native rendezvous frames as the daemon receives them, through the whole
// server-side path (decode_client -> RendezvousService: handshake, node binding -> registry ->
// jobs -> encoded pushes), with protocol time moved by the input.
//
// Input: byte 0 picks the options (bit 0: the service has a token, so every frame must pass the
// handshake; bit 1: job expiry of 1 s instead of the default). Then a sequence of steps, each
// one control byte followed by a frame: bits 0-1 pick one of four client connections, bits 2-7
// (when non-zero) advance the clock by that many 250 ms steps first and fire what is due. The
// frame is fed to on_frame exactly as the store server does; an error closes that connection
// (on_disconnect) and the next step on its slot is a new connection. Invariants checked after
// every step: consumed never exceeds the buffer, need_more asks for more than is there, and
// the registry's deadline index and every job's incremental indexes agree with a full scan.
#include <boost/asio/io_context.hpp>
#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string_view>

#include "ddprun/rendezvous/rendezvous_service.hpp"
#include "ddprun/rendezvous/store_state.hpp"
#include "ddprun/rendezvous/timers.hpp"

using namespace ddprun::rendezvous;

namespace {

void check(const RendezvousService& service, const ManualTimers& timers) {
  const auto& registry = service.registry();
  if (!registry.audit().empty()) std::abort();
  for (const auto& job : registry.status(timers.now()).jobs) {
    const RendezvousJob* j = registry.find(job.run_id);
    if (j == nullptr || !j->audit().empty()) std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const std::uint8_t flags = data[0];
  std::string_view stream(reinterpret_cast<const char*>(data + 1), size - 1);

  ManualTimers timers;  // outlives the io_context (timers.hpp)
  boost::asio::io_context io;
  RendezvousServiceOptions options;
  if (flags & 1) options.token = "fuzz-token";
  if (flags & 2) options.job_expiry = std::chrono::seconds(1);
  options.limits.max_payload_bytes = 64 * 1024;
  auto service = std::make_shared<RendezvousService>(io, options, timers);
  StoreState state(StoreLimits{});
  RecordingOutbox outbox;
  ConnectionId slot_conn[4] = {1, 2, 3, 4};
  ConnectionId next_conn = 5;

  while (!stream.empty()) {
    const auto control = static_cast<std::uint8_t>(stream.front());
    stream.remove_prefix(1);
    if (const int steps = control >> 2; steps != 0) {
      timers.advance(std::chrono::milliseconds(250) * steps);
      io.poll();
      io.restart();
    }
    ConnectionId& conn = slot_conn[control & 3];
    DecodeResult r = service->on_frame(conn, stream, state, outbox);
    if (r.status == DecodeStatus::need_more) {
      if (r.min_total <= stream.size()) std::abort();
      break;
    }
    if (r.status != DecodeStatus::ok) {
      service->on_disconnect(conn);
      conn = next_conn++;
      // The server would close the connection; the fuzzer skips the frame by its declared length
      // and goes on with the other connections.
      std::size_t skip = stream.size();
      if (stream.size() >= 5) {
        std::uint32_t len = 0;
        std::memcpy(&len, stream.data() + 1, sizeof len);
        skip = std::min<std::size_t>(stream.size(), std::size_t{5} + len);
      }
      stream.remove_prefix(skip);
      outbox.out.clear();
      check(*service, timers);
      continue;
    }
    if (r.consumed == 0 || r.consumed > stream.size()) std::abort();
    stream.remove_prefix(r.consumed);
    if (outbox.out.size() > 64) outbox.out.clear();
    check(*service, timers);
  }
  for (ConnectionId c : slot_conn) service->on_disconnect(c);
  timers.advance(std::chrono::hours(24 * 31));
  io.poll();
  check(*service, timers);
  service->shutdown();
  return 0;
}
