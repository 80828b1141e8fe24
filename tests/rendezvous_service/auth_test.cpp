// The handshake's cryptography (rendezvous_auth.hpp) against fixed vectors (RFC 4231 and
// values computed by Python's hmac module), the secret comparison, the hex checks, and the
// bounds every number of a frame is validated against (JobConfig::validate, the registry).
#include <catch2/catch.hpp>

#include <chrono>
#include <climits>

#include "ddprun/rendezvous/rendezvous_auth.hpp"
#include "ddprun/rendezvous/rendezvous_registry.hpp"

namespace auth = ddprun::rendezvous::auth;
namespace rdzv = ddprun::rendezvous;
using namespace std::chrono_literals;

TEST_CASE("HMAC-SHA256 matches RFC 4231 test case 2", "[auth]") {
  CHECK(auth::hmac_sha256_hex("Jefe", "what do ya want for nothing?") ==
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
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
  auto refusal = [](const rdzv::Decisions& d) {
    REQUIRE(d.size() == 1);
    REQUIRE(std::holds_alternative<rdzv::Refuse>(d[0]));
    return std::get<rdzv::Refuse>(d[0]).reason;
  };
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
