// rdzv_logic_bench: the daemon's rendezvous logic for N agents without sockets.
//
// Feeds ddprun-rdzvd's own RendezvousService (the extension the store server calls for every
// native frame) the frames of N agents: HELLO, AUTH (token ON unless --no-token), JOIN, all to
// one job with min = max = N, through on_frame() with an in-memory outbox, exactly as the store
// server does after a read. Then the last JOIN closes the round and N ASSIGNMENT frames are
// encoded. Only the CPU time inside on_frame() is counted (the agents' side, the nonces and MACs
// they compute, is not), so the figures are the daemon's user-space cost per agent above the
// socket path that rdzv_bench measures, at sizes a machine's open-files limit does not allow
// with real connections (one connection per agent needs N descriptors in one process).
//
//   rdzv_logic_bench --nodes N [--no-token] [--nccl-ids K]
//
// --nccl-ids K: every JOIN offers K NCCL unique IDs of 128 bytes (distinct per agent), as agents
// with --nccl-id auto do: one per 256 ranks of the largest world the job allows.
//
// Prints one JSON object: setup_s (HELLO + AUTH + JOIN of N-1 agents and the handshake of the
// last), close_ms (the last JOIN: ranks, N ASSIGNMENT frames encoded), per-agent figures, the
// process's VmRSS growth per agent (the service's state: sessions, node bindings, secrets, the
// job's members; the outbox is emptied after every frame, as the socket writes would), then the
// steady state: CPU per HEARTBEAT (one from every agent) and one STATUS of the job (its reply
// lists every member: time and size).
#include <time.h>

#include <boost/asio/io_context.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "ddprun/rendezvous/rendezvous_auth.hpp"
#include "ddprun/rendezvous/rendezvous_service.hpp"
#include "ddprun/rendezvous/rendezvous_wire.hpp"
#include "ddprun/rendezvous/store_state.hpp"

namespace rdzv = ddprun::rendezvous;

// The thread's CPU time: on a shared machine wall time inside a call also counts the time the
// thread waited for a core.
struct Clock {
  using duration = std::chrono::nanoseconds;
  static duration now() {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec);
  }
};

namespace {

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "rdzv_logic_bench: error: %s\n", what.c_str());
  std::exit(1);
}

long rss_kib() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::atol(line.c_str() + 6);
  }
  return 0;
}

// One reply buffer per connection, emptied by the bench after each frame.
class Outbox final : public rdzv::Outbox {
 public:
  explicit Outbox(std::size_t n) : out_(n + 1) {}
  std::string& buffer(rdzv::ConnectionId conn) override {
    if (conn >= out_.size()) die("connection id out of range");
    if (out_[conn].empty()) touched_.push_back(conn);
    return out_[conn];
  }
  std::string take(rdzv::ConnectionId conn) {
    std::string s;
    s.swap(out_[conn]);
    return s;
  }
  std::size_t bytes = 0;  // every frame's bytes since the start
  std::size_t frames_and_clear() {
    std::size_t frames = 0;
    for (const rdzv::ConnectionId conn : touched_) {
      std::string& s = out_[conn];
      std::size_t pos = 0;
      while (s.size() - pos >= rdzv::native_header_bytes) {
        std::uint32_t len = 0;
        for (int b = 0; b < 4; ++b) {
          len |= static_cast<std::uint32_t>(static_cast<unsigned char>(s[pos + 1 + static_cast<std::size_t>(b)]))
                 << (8 * b);
        }
        pos += rdzv::native_header_bytes + len;
        bytes += rdzv::native_header_bytes + len;
        ++frames;
      }
      std::string().swap(s);
    }
    touched_.clear();
    return frames;
  }

 private:
  std::vector<std::string> out_;
  std::vector<rdzv::ConnectionId> touched_;  // connections with output since the last clear
};

}  // namespace

int main(int argc, char** argv) {
  int nodes = 0;
  bool token_on = true;
  std::size_t nccl_ids = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--nodes" && i + 1 < argc) {
      nodes = std::atoi(argv[++i]);
    } else if (a == "--nccl-ids" && i + 1 < argc) {
      nccl_ids = static_cast<std::size_t>(std::atol(argv[++i]));
    } else if (a == "--no-token") {
      token_on = false;
    } else {
      die("unknown argument '" + a + "' (see the header of bench/rendezvous/rdzv_logic_bench.cpp)");
    }
  }
  if (nodes < 2) die("--nodes N (at least 2) is required");
  if (nccl_ids > rdzv::max_nccl_ids) {
    die("--nccl-ids K: at most " + std::to_string(rdzv::max_nccl_ids) + " (what a JOIN may offer)");
  }
  const auto n = static_cast<std::size_t>(nodes);
  const std::string run_id = "bench";
  const std::string token = token_on ? rdzv::auth::random_hex(16) : std::string();

  boost::asio::io_context io(1);  // the service's deadline timer is armed on it, never run
  rdzv::RendezvousServiceOptions options;
  options.token = token;
  auto service = std::make_shared<rdzv::RendezvousService>(io, options);
  rdzv::StoreState state(rdzv::StoreLimits{});
  Outbox outbox(n);
  const long rss0 = rss_kib();

  Clock::duration inside{};
  std::string frame;
  auto feed = [&](rdzv::ConnectionId conn, const rdzv::ClientMessage& m) {
    frame.clear();
    rdzv::encode_client(frame, m);
    const auto t0 = Clock::now();
    const auto r = service->on_frame(conn, frame, state, outbox);
    inside += Clock::now() - t0;
    if (r.status != rdzv::DecodeStatus::ok)
      die("frame refused on connection " + std::to_string(conn) + ": " + r.reason);
  };
  auto join_message = [&](std::size_t i) {
    rdzv::JoinMessage m;
    m.run_id = run_id;
    const std::string addr =
        "10." + std::to_string(i >> 16) + "." + std::to_string((i >> 8) & 255) + "." + std::to_string(i & 255);
    m.request.node.id = rdzv::NodeId{addr, static_cast<std::int64_t>(100000 + i), "bench-" + std::to_string(i)};
    m.request.node.addr = addr;
    m.request.node.local_world_size = 8;
    m.request.node.store_host = addr;
    m.request.node.store_port = 29500;
    m.request.node.nccl_ids.resize(128 * nccl_ids);
    for (std::size_t b = 0; b < m.request.node.nccl_ids.size(); ++b) {
      m.request.node.nccl_ids[b] = static_cast<std::uint8_t>((i * 131 + b * 7) & 255);
    }
    m.request.config.min_nodes = nodes;
    m.request.config.max_nodes = nodes;
    m.request.config.join_timeout = std::chrono::seconds(3600);
    m.request.config.last_call_timeout = std::chrono::seconds(3600);
    m.request.config.heartbeat_interval = std::chrono::seconds(600);
    return m;
  };

  std::size_t setup_frames = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const auto conn = static_cast<rdzv::ConnectionId>(i + 1);
    const std::string client_nonce = rdzv::auth::random_hex(rdzv::auth::nonce_bytes);
    feed(conn, rdzv::HelloMessage{1, client_nonce});
    if (token_on) {
      rdzv::ServerMessage reply;
      const std::string bytes = outbox.take(conn);
      if (rdzv::decode_server(bytes, {}, reply).status != rdzv::DecodeStatus::ok) die("bad CHALLENGE");
      const auto& c = std::get<rdzv::ChallengeMessage>(reply);
      feed(conn, rdzv::AuthMessage{run_id, rdzv::auth::client_mac(token, c.server_nonce, client_nonce, run_id)});
    }
    outbox.take(conn);
    if (i + 1 < n) {
      feed(conn, join_message(i));
      setup_frames += outbox.frames_and_clear();  // JOINED, PROGRESS and any fan-out
    }
  }
  const Clock::duration setup = inside;
  const long rss_joined = rss_kib();

  inside = {};
  feed(static_cast<rdzv::ConnectionId>(n), join_message(n - 1));
  const Clock::duration close = inside;
  const std::size_t bytes_before_close = outbox.bytes;
  const std::size_t close_frames = outbox.frames_and_clear();
  const std::size_t close_bytes = outbox.bytes - bytes_before_close;
  const long rss_closed = rss_kib();  // + the running round's assignments
  if (service->stats().rounds_closed != 1) die("the round did not close");

  // Steady state: one HEARTBEAT per agent (what N agents send every heartbeat interval).
  inside = {};
  for (std::size_t i = 0; i < n; ++i) {
    const rdzv::JoinMessage j = join_message(i);
    feed(static_cast<rdzv::ConnectionId>(i + 1), rdzv::HeartbeatMessage{run_id, j.request.node.id});
  }
  const Clock::duration heartbeats = inside;
  outbox.frames_and_clear();
  // STATUS of the job: its reply lists every member.
  inside = {};
  feed(1, rdzv::StatusMessage{run_id});
  const Clock::duration status = inside;
  const std::size_t status_bytes = outbox.take(1).size();

  const double setup_s = std::chrono::duration<double>(setup).count();
  const double close_ms = std::chrono::duration<double, std::milli>(close).count();
  std::printf(
      "{\"nodes\": %d, \"token\": %s, \"nccl_ids\": %zu, \"setup_s\": %.3f, \"setup_us_per_agent\": %.2f, "
      "\"close_ms\": %.3f, "
      "\"close_us_per_agent\": %.3f, \"setup_frames_out\": %zu, \"close_frames_out\": %zu, \"close_bytes_out\": %zu, "
      "\"rss_growth_kib\": %ld, "
      "\"rss_kib_per_agent\": %.3f, \"rss_running_kib\": %ld, \"heartbeat_us\": %.3f, \"status_ms\": %.3f, "
      "\"status_reply_bytes\": %zu}\n",
      nodes, token_on ? "true" : "false", nccl_ids, setup_s, setup_s * 1e6 / static_cast<double>(n), close_ms,
      close_ms * 1e3 / static_cast<double>(n), setup_frames, close_frames, close_bytes, rss_joined - rss0,
      static_cast<double>(rss_joined - rss0) / static_cast<double>(n), rss_closed - rss0,
      std::chrono::duration<double, std::micro>(heartbeats).count() / static_cast<double>(n),
      std::chrono::duration<double, std::milli>(status).count(), status_bytes);
  service->shutdown();
  return 0;
}
