// The handshake's cryptography (rendezvous_auth.hpp) against fixed vectors (RFC 4231 and
// values computed by Python's hmac module), the secret comparison, the hex checks, and the
// bounds every number of a frame is validated against (JobConfig::validate, the registry).
#include <catch2/catch.hpp>

#include <algorithm>
#include <boost/asio/io_context.hpp>
#include <chrono>
#include <climits>
#include <malloc.h>
#include <memory>
#include <set>
#include <string>
#include <sys/wait.h>
#include <unistd.h>

#include "ddprun/rendezvous/rendezvous_auth.hpp"
#include "ddprun/rendezvous/rendezvous_registry.hpp"
#include "ddprun/rendezvous/rendezvous_service.hpp"
#include "ddprun/rendezvous/rendezvous_wire.hpp"
#include "ddprun/rendezvous/store_state.hpp"

namespace auth = ddprun::rendezvous::auth;
namespace rdzv = ddprun::rendezvous;
using namespace std::chrono_literals;

TEST_CASE("HMAC-SHA256 matches RFC 4231 test case 2", "[auth]") {
  CHECK(auth::hmac_sha256_hex("Jefe", "what do ya want for nothing?") ==
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

TEST_CASE("HMAC-SHA256 keeps its answers when the key changes and comes back", "[auth]") {
  // The context is keyed once per thread and reused while the key stays the same.
  const std::string case1_key(20, '\x0b');  // RFC 4231 test case 1
  const std::string case1 = "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7";
  const std::string case2 = "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843";
  // python3: hmac.new(b'', b'', sha256).hexdigest()
  const std::string empty = "b613679a0814d9ec772f95d778c35fc5ff1697c493715653c6c712144292c5ad";
  for (int i = 0; i < 3; ++i) {
    CHECK(auth::hmac_sha256_hex("Jefe", "what do ya want for nothing?") == case2);
    CHECK(auth::hmac_sha256_hex("Jefe", "what do ya want for nothing?") == case2);
    CHECK(auth::hmac_sha256_hex(case1_key, "Hi There") == case1);
    CHECK(auth::hmac_sha256_hex("", "") == empty);
    CHECK(auth::hmac_sha256_hex("jefe", "what do ya want for nothing?") != case2);
  }
}

TEST_CASE("the handshake MACs match an independent implementation", "[auth]") {
  const std::string a(64, 'a');
  const std::string b(64, 'b');
  // python3: hmac.new(b'k', b'ddprun-rdzv-client-v1\0' + b'a'*64 + b'b'*64 + b'job', sha256)
  CHECK(auth::client_mac("k", a, b, "job") == "549dbda9eba3b0992c0710f8cfd4a1806229771665a8dc08608777e3332beaea");
  CHECK(auth::server_mac("k", b, a, "job") == "bb58b3289e62c5047ab5f43f2bfee55fc78062e8fc0ced3c3b255d5aacbff868");
  // Each input matters: another token, nonce order or run id gives another MAC.
  CHECK(auth::client_mac("k2", a, b, "job") != auth::client_mac("k", a, b, "job"));
  CHECK(auth::client_mac("k", b, a, "job") != auth::client_mac("k", a, b, "job"));
  CHECK(auth::client_mac("k", a, b, "*") != auth::client_mac("k", a, b, "job"));
  CHECK(auth::client_mac("k", a, b, "job") != auth::server_mac("k", a, b, "job"));
}

TEST_CASE("secrets compare by value and length; nonces are fresh hex", "[auth]") {
  CHECK(auth::equal_secret("abcd", "abcd"));
  CHECK_FALSE(auth::equal_secret("abcd", "abce"));
  CHECK_FALSE(auth::equal_secret("abcd", "abc"));
  CHECK_FALSE(auth::equal_secret("", "a"));
  const std::string n1 = auth::random_hex(auth::nonce_bytes);
  const std::string n2 = auth::random_hex(auth::nonce_bytes);
  CHECK(auth::is_hex_of(n1, 32));
  CHECK(n1 != n2);
  CHECK_FALSE(auth::is_hex_of(std::string(64, 'A'), 32));  // lower case only
  CHECK_FALSE(auth::is_hex_of(std::string(63, 'a'), 32));
  CHECK_FALSE(auth::is_hex_of(std::string(64, 'g'), 32));
}

TEST_CASE("random bytes come from a per-thread pool: fresh across refills, never shared with a fork", "[auth]") {
  // Past several refills of the 4 KiB pool, in draws that straddle its end, and one larger than it.
  std::set<std::string> seen;
  for (int i = 0; i < 600; ++i) {
    const std::string n = auth::random_hex(i % 7 == 0 ? 45 : auth::nonce_bytes);
    CHECK(seen.insert(n).second);
  }
  const std::string big = auth::random_hex(10000);
  CHECK(auth::is_hex_of(big, 10000));
  CHECK(big.find(std::string(64, '0')) == std::string::npos);  // never the wiped (zero) bytes of a drawn pool

  // A forked child must not draw what the parent draws next from the same pool.
  (void)auth::random_hex(auth::nonce_bytes);  // the pool holds unused bytes now
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {  // never back into Catch2 from the child
    try {
      const std::string n = auth::random_hex(auth::nonce_bytes);
      const bool ok = ::write(fds[1], n.data(), n.size()) == static_cast<ssize_t>(n.size());
      ::_exit(ok ? 0 : 1);
    } catch (...) {
      ::_exit(2);
    }
  }
  ::close(fds[1]);
  const std::string mine = auth::random_hex(auth::nonce_bytes);
  std::string theirs(64, '\0');
  std::size_t got = 0;
  while (got < theirs.size()) {
    const ssize_t r = ::read(fds[0], theirs.data() + got, theirs.size() - got);
    if (r <= 0) break;
    got += static_cast<std::size_t>(r);
  }
  ::close(fds[0]);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  REQUIRE(got == theirs.size());
  CHECK(auth::is_hex_of(theirs, auth::nonce_bytes));
  CHECK(theirs != mine);
}

namespace {

rdzv::JobConfig good_config() {
  rdzv::JobConfig c;
  c.min_nodes = 1;
  c.max_nodes = 2;
  c.join_timeout = 10s;
  c.last_call_timeout = 1s;
  c.close_timeout = 10s;
  c.heartbeat_interval = 1s;
  c.missed_heartbeats = 3;
  c.exit_barrier_timeout = 10s;
  c.rebuild_grace = 1s;
  return c;
}

rdzv::NodeInfo node(int i, int nproc = 1) {
  rdzv::NodeInfo n;
  n.id = rdzv::NodeId{"10.0.0." + std::to_string(i), 100 + i, "x"};
  n.addr = n.id.addr;
  n.local_world_size = nproc;
  return n;
}

// The reason of the one refusal `d` must hold.
std::string refusal(const rdzv::Decisions& d) {
  REQUIRE(d.size() == 1);
  REQUIRE(std::holds_alternative<rdzv::Refuse>(d[0]));
  return std::get<rdzv::Refuse>(d[0]).reason;
}

}  // namespace

TEST_CASE("every numeric field of a configuration is bounded, the field named", "[auth][validate]") {
  CHECK(good_config().validate().empty());
  auto with = [](auto&& change) {
    rdzv::JobConfig c = good_config();
    change(c);
    return c.validate();
  };
  CHECK(with([](auto& c) { c.min_nodes = 0; }) == "min_nodes must be >= 1, got 0");
  CHECK(with([](auto& c) { c.max_nodes = INT_MAX; }) == "max_nodes must be <= 1048576, got 2147483647");
  CHECK(with([](auto& c) { c.max_restarts = -1; }) == "max_restarts must be >= 0, got -1");
  CHECK(with([](auto& c) { c.max_restarts = INT_MAX; }) == "max_restarts must be <= 1000000, got 2147483647");
  CHECK(with([](auto& c) { c.missed_heartbeats = 0; }) == "missed_heartbeats must be >= 1, got 0");
  CHECK(with([](auto& c) { c.heartbeat_interval = 1ms; }) ==
        "heartbeat_interval must be between 0.01 s and 3600 s, got 0.001 s");
  CHECK(with([](auto& c) { c.heartbeat_interval = 2h; }) ==
        "heartbeat_interval must be between 0.01 s and 3600 s, got 7200 s");
  CHECK(with([](auto& c) { c.join_timeout = std::chrono::hours(24 * 365); }) ==
        "join_timeout must be <= 2592000 s, got 31536000 s");
  CHECK(with([](auto& c) { c.close_timeout = -1s; }) == "close_timeout must be > 0, got -1 s");
  CHECK(with([](auto& c) {
          c.heartbeat_interval = 1h;
          c.missed_heartbeats = INT_MAX;
        }).find("exceeds 100 years") != std::string::npos);
}

TEST_CASE("absurd node sizes and rejoin assignments are refused, not allocated", "[auth][validate]") {
  ddprun::ManualClock clock;
  rdzv::RendezvousRegistry reg;
  CHECK(refusal(reg.join("j", rdzv::JoinRequest{node(1, INT_MAX), good_config()}, clock.now())) ==
        "node 10.0.0.1:101/x announced local_world_size 2147483647: --nproc-per-node must be between 1 and 16384");
  CHECK_THAT(refusal(reg.join(std::string(300, 'r'), rdzv::JoinRequest{node(1), good_config()}, clock.now())),
             Catch::StartsWith("rendezvous id of 300 bytes is longer than 256 bytes"));
  rdzv::Assignment a;
  a.group_rank = 0;
  a.group_world_size = INT_MAX;
  a.local_world_size = 1;
  a.world_size = 2;
  CHECK_THAT(refusal(reg.rejoin("j", rdzv::RejoinRequest{node(1), good_config(), "", a}, clock.now())),
             Catch::StartsWith("rejoin for rendezvous 'j' carries an inconsistent assignment (group rank 0 of "
                               "2147483647 with max_nodes 2"));
  a.group_world_size = 2;
  a.world_size = INT_MAX;  // more ranks than 2 nodes of at most 16384 processes can have
  CHECK_THAT(refusal(reg.rejoin("j", rdzv::RejoinRequest{node(1), good_config(), "", a}, clock.now())),
             Catch::Contains("inconsistent assignment"));
  CHECK(reg.job_count() == 0);
}

TEST_CASE("a node's names and NCCL IDs are bounded: a member cannot make the daemon hold a frame's worth",
          "[auth][validate]") {
  ddprun::ManualClock clock;
  rdzv::RendezvousRegistry reg;
  const std::string longest(rdzv::max_node_text_bytes, 'a');
  const std::string too_long(rdzv::max_node_text_bytes + 1, 'a');
  for (auto field : {&rdzv::NodeInfo::addr, &rdzv::NodeInfo::store_host}) {
    rdzv::NodeInfo n = node(1);
    n.*field = too_long;
    CHECK(refusal(reg.join("j", rdzv::JoinRequest{n, good_config()}, clock.now())) ==
          "a node of rendezvous 'j' announced a " +
              std::string(field == &rdzv::NodeInfo::addr ? "addr" : "store_host") +
              " of 1025 bytes, longer than 1024 bytes");
  }
  rdzv::NodeInfo n = node(1);
  n.id.instance = too_long;
  CHECK_THAT(refusal(reg.rejoin("j", rdzv::RejoinRequest{n, good_config(), "", std::nullopt}, clock.now())),
             Catch::Contains("id.instance of 1025 bytes"));
  n = node(1);
  n.nccl_ids.assign((rdzv::max_nccl_ids + 1) * 128, 0);
  CHECK_THAT(refusal(reg.join("j", rdzv::JoinRequest{n, good_config()}, clock.now())),
             Catch::Contains("offered 4097 NCCL unique IDs for rendezvous 'j': at most 4096"));
  CHECK(reg.job_count() == 0);
  // At the limits: accepted.
  n = node(1);
  n.id.addr = longest;
  n.id.instance = longest;
  n.addr = longest;
  n.store_host = longest;
  n.nccl_ids.assign(rdzv::max_nccl_ids * 128, 0);
  const rdzv::Decisions ok = reg.join("j", rdzv::JoinRequest{n, good_config()}, clock.now());
  CHECK(std::none_of(ok.begin(), ok.end(),
                     [](const rdzv::Decision& d) { return std::holds_alternative<rdzv::Refuse>(d); }));
  CHECK(reg.job_count() == 1);
}

TEST_CASE("a REJOIN that claims a world of 2^20 nodes costs what the ranks that came back cost", "[auth][validate]") {
  ddprun::ManualClock clock;
  rdzv::RendezvousRegistry reg;
  rdzv::JobConfig big = good_config();
  big.max_nodes = rdzv::max_nodes_limit;
  rdzv::Assignment a;
  a.group_rank = 7;
  a.group_world_size = rdzv::max_nodes_limit;
  a.local_world_size = 1;
  a.world_size = rdzv::max_nodes_limit;
  a.rank_offset = 7;
  // A set of the 2^20 - 1 absent ranks held ~48 MiB per such job; the ranks that came back
  // (one) hold next to nothing.
  const std::size_t before = ::mallinfo2().uordblks;
  const rdzv::Decisions d = reg.rejoin("j", rdzv::RejoinRequest{node(1), big, "", a}, clock.now());
  const std::size_t after = ::mallinfo2().uordblks;
  CHECK(std::none_of(d.begin(), d.end(),
                     [](const rdzv::Decision& x) { return std::holds_alternative<rdzv::Refuse>(x); }));
  REQUIRE(reg.job_count() == 1);
  CHECK(after - before < 64 * 1024);
  // The round ends after the rebuild grace, its message listing the first absent ranks only.
  clock.advance(2s);
  reg.heartbeat("j", node(1).id, clock.now());
  const rdzv::Decisions t = reg.on_tick(clock.now());
  REQUIRE(t.size() == 1);
  REQUIRE(std::holds_alternative<rdzv::SendRestart>(t[0]));
  CHECK(
      std::get<rdzv::SendRestart>(t[0]).reason ==
      "group ranks 0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, "
      "28, 29, 30, 31, 32 and 1048543 more of round 0 did not re-register within 1 s after the daemon restarted");
}

TEST_CASE("a job may have 1,048,576 nodes as long as its ranks fit 2^30", "[auth][validate]") {
  ddprun::ManualClock clock;
  rdzv::RendezvousRegistry reg;
  rdzv::JobConfig big = good_config();
  big.min_nodes = 2;
  big.max_nodes = rdzv::max_nodes_limit;
  CHECK(big.validate().empty());
  // 1,048,576 nodes x 1,024 processes = 2^30 ranks: at the limit, accepted.
  const rdzv::Decisions ok = reg.join("big", rdzv::JoinRequest{node(1, 1024), big}, clock.now());
  CHECK(std::none_of(ok.begin(), ok.end(),
                     [](const rdzv::Decision& d) { return std::holds_alternative<rdzv::Refuse>(d); }));
  // One process more per node could make a round of more than 2^30 ranks: refused before it joins.
  const rdzv::Decisions refused = reg.join("big", rdzv::JoinRequest{node(2, 1025), big}, clock.now());
  REQUIRE(refused.size() == 1);
  REQUIRE(std::holds_alternative<rdzv::Refuse>(refused[0]));
  CHECK(std::get<rdzv::Refuse>(refused[0]).reason ==
        "node 10.0.0.2:102/x announced local_world_size 1025 for rendezvous 'big' of up to 1048576 nodes: "
        "1074790400 ranks would pass the limit of 1073741824 (lower --nproc-per-node or the maximum of --nnodes)");
  CHECK(reg.find("big")->member_count() == 1);
}

TEST_CASE("the progress fan-out to a large waiting round is spaced by its size", "[auth][service]") {
  // 12,000 waiting nodes: one fan-out per 1.2 s (100 us per node), not per progress_interval (1 s).
  constexpr int n = 12000;
  boost::asio::io_context io;
  rdzv::ManualTimers timers;
  auto service = std::make_shared<rdzv::RendezvousService>(io, rdzv::RendezvousServiceOptions{}, timers);
  rdzv::StoreState state(rdzv::StoreLimits{});
  rdzv::RecordingOutbox outbox;
  rdzv::JobConfig config = good_config();
  config.min_nodes = config.max_nodes = n + 10;
  config.join_timeout = 1h;
  config.last_call_timeout = 1h;
  config.heartbeat_interval = 600s;
  std::string frame;
  auto join = [&](int i) {
    rdzv::JoinMessage m;
    m.run_id = "wide";
    m.request.node = node(i);
    m.request.node.id.pid = 1000 + i;
    m.request.config = config;
    frame.clear();
    rdzv::encode_client(frame, m);
    outbox.out.clear();
    REQUIRE(service->on_frame(static_cast<rdzv::ConnectionId>(i + 1), frame, state, outbox).status ==
            rdzv::DecodeStatus::ok);
    return outbox.out.size();  // connections that got a frame: the joiner, plus everyone on a fan-out
  };
  for (int i = 0; i < n; ++i) join(i);
  timers.advance(1100ms);  // past progress_interval, not past 12,001 x 100 us
  const auto dropped = service->stats().progress_dropped;
  CHECK(join(n) == 1);
  CHECK(service->stats().progress_dropped == dropped + 1);
  timers.advance(200ms);  // 1.3 s since the last fan-out
  CHECK(join(n + 1) == static_cast<std::size_t>(n + 2));
  service->shutdown();
}
