// EtcdClient against real etcd members on loopback: KV, txn, leases, watch, failover, auth, TLS.
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <boost/asio/io_context.hpp>
#include <optional>
#include <regex>

#include "ddprun/common/error.hpp"
#include "ddprun/rendezvous/etcd_client.hpp"
#include "ddprun/rendezvous/etcd_codec.hpp"
#include "etcd_harness.hpp"
#include "fake_gateway.hpp"

using namespace ddprun;
using namespace ddprun::rendezvous::etcd;
using namespace std::chrono_literals;
using ddprun::test::EtcdCluster;
using ddprun::test::FakeGateway;
using ddprun::test::run_until;

namespace {

EtcdClientOptions options_for(const std::string& endpoints) {
  EtcdClientOptions o;
  o.endpoints = parse_endpoints(endpoints, "test").endpoints;
  o.connect_timeout = 1s;
  o.request_timeout = 3s;
  return o;
}

// Runs one call to completion.
template <class T, class Start>
std::pair<std::optional<EtcdError>, T> call(boost::asio::io_context& io, Start start) {
  bool done = false;
  std::optional<EtcdError> err;
  T value{};
  start([&](const std::optional<EtcdError>& e, T v) {
    err = e;
    value = std::move(v);
    done = true;
  });
  REQUIRE(run_until(
      io, [&] { return done; }, 20s));
  return {err, std::move(value)};
}

}  // namespace

TEST_CASE("etcd client: kv, prefixes, txn, leases and a watch against one member", "[etcd][client]") {
  EtcdCluster cluster(1, "client");
  boost::asio::io_context io;
  EtcdClient c(io, options_for(cluster.endpoints()));

  auto [e1, h1] = call<ResponseHeader>(io, [&](auto cb) { c.put({"/t/a", std::string("v\0a", 3), 0}, cb); });
  REQUIRE_FALSE(e1);
  call<ResponseHeader>(io, [&](auto cb) { c.put({"/t/b", "vb", 0}, cb); });
  call<ResponseHeader>(io, [&](auto cb) { c.put({"/u", "other", 0}, cb); });
  auto [e2, r] = call<RangeResponse>(io, [&](auto cb) {
    c.range({"/t/", prefix_range_end("/t/"), 0, 0, false, false}, cb);
  });
  REQUIRE_FALSE(e2);
  REQUIRE(r.kvs.size() == 2);
  CHECK(r.kvs[0].value == std::string("v\0a", 3));
  CHECK(r.kvs[1].key == "/t/b");

  // Compare-and-swap on mod_revision: the second writer with a stale revision loses.
  const std::int64_t rev = r.kvs[1].mod_revision;
  auto cas = [&](std::int64_t expected, const std::string& v) {
    TxnRequest t;
    t.compare.push_back({"/t/b", Compare::Target::mod_revision, Compare::Result::equal, expected, {}});
    t.success.emplace_back(PutRequest{"/t/b", v, 0});
    t.failure.emplace_back(RangeRequest{"/t/b", {}, 0, 0, false, false});
    return call<TxnResponse>(io, [&](auto cb) { c.txn(t, cb); });
  };
  auto [e3, t1] = cas(rev, "first");
  REQUIRE_FALSE(e3);
  CHECK(t1.succeeded);
  auto [e4, t2] = cas(rev, "second");
  REQUIRE_FALSE(e4);
  CHECK_FALSE(t2.succeeded);
  REQUIRE(t2.responses.size() == 1);
  CHECK(t2.responses[0].range.kvs.at(0).value == "first");

  // Watch from a revision: sees history first, then live puts and deletes.
  std::vector<WatchEvent> seen;
  WatchHandlers wh;
  wh.on_message = [&](const WatchMessage& m) { seen.insert(seen.end(), m.events.begin(), m.events.end()); };
  wh.on_error = [&](const EtcdError& e) { FAIL("watch error: " << e.message); };
  c.watch({"/t/", prefix_range_end("/t/"), rev + 1, false}, wh);
  REQUIRE(run_until(
      io, [&] { return !seen.empty(); }, 10s));
  CHECK(seen[0].kv.value == "first");

  // Lease: a key attached to it vanishes on revoke, and the watch reports the delete.
  auto [e5, g] = call<LeaseGrantResponse>(io, [&](auto cb) { c.lease_grant(5, cb); });
  REQUIRE_FALSE(e5);
  CHECK(g.ttl == 5);
  call<ResponseHeader>(io, [&](auto cb) { c.put({"/t/leased", "x", g.id}, cb); });
  auto [e6, k] = call<LeaseKeepAliveResponse>(io, [&](auto cb) { c.lease_keepalive(g.id, cb); });
  REQUIRE_FALSE(e6);
  CHECK(k.ttl == 5);
  call<ResponseHeader>(io, [&](auto cb) { c.lease_revoke(g.id, cb); });
  REQUIRE(run_until(
      io,
      [&] {
        return std::any_of(seen.begin(), seen.end(), [](const WatchEvent& e) {
          return e.type == WatchEvent::Type::del && e.kv.key == "/t/leased";
        });
      },
      10s));
  auto [e7, k2] = call<LeaseKeepAliveResponse>(io, [&](auto cb) { c.lease_keepalive(g.id, cb); });
  REQUIRE_FALSE(e7);
  CHECK(k2.ttl <= 0);
  auto [e8, hd] = call<ResponseHeader>(io, [&](auto cb) { c.delete_range({"/t/", prefix_range_end("/t/")}, cb); });
  REQUIRE_FALSE(e8);
  auto [e9, r2] = call<RangeResponse>(io, [&](auto cb) {
    c.range({"/t/", prefix_range_end("/t/"), 0, 0, false, false}, cb);
  });
  CHECK(r2.kvs.empty());
}

TEST_CASE("etcd client: a range over the response cap says so; range_all reads it in pages, up to a total",
          "[etcd][client][paging]") {
  EtcdCluster cluster(1, "client-paging");
  boost::asio::io_context io;
  EtcdClientOptions o = options_for(cluster.endpoints());
  o.max_response_bytes = 256 << 10;
  EtcdClient c(io, o);
  // 40 values of 20 KiB (about 1.1 MiB of JSON): over the cap at once, 9 or so per page.
  std::int64_t last_rev = 0;
  for (int i = 0; i < 40; ++i) {
    auto [e, h] = call<ResponseHeader>(io, [&](auto cb) {
      c.put({fmt::format("/big/k{:02d}", i), std::string(20 << 10, static_cast<char>('a' + i % 26)), 0}, cb);
    });
    REQUIRE_FALSE(e);
    last_rev = h.revision;
  }
  call<ResponseHeader>(io, [&](auto cb) { c.put({"/bigger", "outside", 0}, cb); });

  auto [e1, r1] = call<RangeResponse>(io, [&](auto cb) {
    c.range({"/big/", prefix_range_end("/big/"), 0, 0, false, false}, cb);
  });
  REQUIRE(e1);
  CHECK(e1->too_large);
  CHECK_FALSE(e1->permanent);
  CHECK_THAT(e1->message, Catch::Contains("over the response size limit (256 KiB)") &&
                              Catch::Contains(cluster.endpoints()) && !Catch::Contains("no etcd endpoint answered"));

  auto [e2, r2] = call<RangeResponse>(io, [&](auto cb) {
    c.range_all({"/big/", prefix_range_end("/big/"), 0, 0, false, false}, 64 << 20, cb);
  });
  REQUIRE_FALSE(e2);
  REQUIRE(r2.kvs.size() == 40);
  CHECK(r2.count == 40);
  CHECK_FALSE(r2.more);
  CHECK(r2.header.revision > last_rev);
  for (int i = 0; i < 40; ++i) {
    CHECK(r2.kvs[static_cast<std::size_t>(i)].key == fmt::format("/big/k{:02d}", i));
    CHECK(r2.kvs[static_cast<std::size_t>(i)].value == std::string(20 << 10, static_cast<char>('a' + i % 26)));
  }

  // More than the total: a final error naming the keys and the size.
  auto [e3, r3] = call<RangeResponse>(io, [&](auto cb) {
    c.range_all({"/big/", prefix_range_end("/big/"), 0, 0, false, false}, 300 << 10, cb);
  });
  REQUIRE(e3);
  CHECK(e3->permanent);
  CHECK_THAT(e3->message, Catch::Contains("'/big/' .. '/big0'") && Catch::Contains("hold over 300 KiB") &&
                              Catch::Contains(cluster.endpoints()));

  // One value over the cap on its own: pages shrink to one key, then the error is the cap's.
  call<ResponseHeader>(io, [&](auto cb) { c.put({"/big/k20x", std::string(300 << 10, 'z'), 0}, cb); });
  auto [e4, r4] = call<RangeResponse>(io, [&](auto cb) {
    c.range_all({"/big/", prefix_range_end("/big/"), 0, 0, false, false}, 64 << 20, cb);
  });
  REQUIRE(e4);
  CHECK(e4->too_large);
  CHECK(e4->permanent);
  CHECK_THAT(e4->message, Catch::Contains("over the response size limit"));
}

TEST_CASE("etcd client: a dead endpoint is skipped; all dead is an error naming each", "[etcd][client]") {
  EtcdCluster cluster(1, "failover");
  boost::asio::io_context io;
  const std::string dead = "127.0.0.1:" + std::to_string(ddprun::test::free_port());
  EtcdClient c(io, options_for(dead + "," + cluster.endpoints()));
  auto [e1, h] = call<ResponseHeader>(io, [&](auto cb) { c.put({"/f", "1", 0}, cb); });
  REQUIRE_FALSE(e1);

  const std::string dead2 = "127.0.0.1:" + std::to_string(ddprun::test::free_port());
  EtcdClient d(io, options_for(dead + "," + dead2));
  auto [e2, r] = call<RangeResponse>(io, [&](auto cb) { d.range({"/f", {}, 0, 0, false, false}, cb); });
  REQUIRE(e2);
  CHECK_THAT(e2->message, Catch::Contains(dead) && Catch::Contains(dead2) && Catch::Contains("connect"));
}

TEST_CASE("etcd client: watch resumes on another member after its member is killed", "[etcd][client][ha]") {
  EtcdCluster cluster(3, "watch-ha");
  boost::asio::io_context io;
  EtcdClient c(io, options_for(cluster.endpoints()));
  std::vector<std::string> values;
  WatchHandlers wh;
  wh.on_message = [&](const WatchMessage& m) {
    for (const auto& e : m.events) values.push_back(e.kv.value);
  };
  wh.on_error = [&](const EtcdError& e) { FAIL("watch error: " << e.message); };
  // From revision 1, not "from now": a put that commits before the watch is set up (a loaded
  // box) is still seen.
  c.watch({"/w/", prefix_range_end("/w/"), 1, false}, wh);
  call<ResponseHeader>(io, [&](auto cb) { c.put({"/w/1", "one", 0}, cb); });
  REQUIRE(run_until(
      io, [&] { return values.size() == 1; }, 10s));
  // The watch and the unary connection both sit on member 0: kill it.
  cluster.member(0).kill_now();
  for (int i = 2; i <= 5; ++i) {
    auto [e, h] = call<ResponseHeader>(io, [&](auto cb) {
      c.put({"/w/" + std::to_string(i), std::to_string(i), 0}, cb);
    });
    REQUIRE_FALSE(e);
  }
  REQUIRE(run_until(
      io, [&] { return values.size() == 5; }, 20s));
  CHECK(values == std::vector<std::string>{"one", "2", "3", "4", "5"});  // nothing lost, nothing twice
}

TEST_CASE("etcd client: auth with username/password, token refresh, wrong password", "[etcd][client][auth]") {
  EtcdCluster cluster(1, "auth", {"--auth-token", "simple"});
  const std::string ep = "--endpoints=" + cluster.member(0).client_url(false);
  std::string out;
  REQUIRE(ddprun::test::run_shell("ETCDCTL_API=3 etcdctl " + ep + " user add root:rootpw", &out) == 0);
  REQUIRE(ddprun::test::run_shell("ETCDCTL_API=3 etcdctl " + ep + " auth enable", &out) == 0);

  boost::asio::io_context io;
  auto good = options_for(cluster.endpoints());
  good.username = "root";
  good.password = "rootpw";
  EtcdClient c(io, good);
  auto [e1, h1] = call<ResponseHeader>(io, [&](auto cb) { c.put({"/a", "1", 0}, cb); });
  REQUIRE_FALSE(e1);
  // Disabling and enabling auth drops every simple token: the client must re-authenticate.
  REQUIRE(ddprun::test::run_shell("ETCDCTL_API=3 etcdctl " + ep + " --user root:rootpw auth disable", &out) == 0);
  REQUIRE(ddprun::test::run_shell("ETCDCTL_API=3 etcdctl " + ep + " user get root", &out) == 0);
  REQUIRE(ddprun::test::run_shell("ETCDCTL_API=3 etcdctl " + ep + " auth enable", &out) == 0);
  auto [e2, r] = call<RangeResponse>(io, [&](auto cb) { c.range({"/a", {}, 0, 0, false, false}, cb); });
  REQUIRE_FALSE(e2);
  CHECK(r.kvs.at(0).value == "1");

  auto bad = good;
  bad.password = "nope";
  EtcdClient d(io, bad);
  auto [e3, h3] = call<ResponseHeader>(io, [&](auto cb) { d.put({"/a", "2", 0}, cb); });
  REQUIRE(e3);
  CHECK(e3->auth_failed);
  CHECK_THAT(e3->message, Catch::Contains(cluster.endpoints()) && Catch::Contains("root"));

  auto anon = options_for(cluster.endpoints());
  EtcdClient n(io, anon);
  auto [e4, h4] = call<ResponseHeader>(io, [&](auto cb) { n.put({"/a", "3", 0}, cb); });
  REQUIRE(e4);
  CHECK_THAT(e4->message, Catch::Contains(cluster.endpoints()));
}

TEST_CASE("etcd client: an auth store newer than the token or a dropped token refreshes it, on each member",
          "[etcd][client][auth]") {
  // After any user or role change etcd answers every older token with HTTP 400 "revision of
  // auth store is old", and a request whose token it dropped with "user name is empty": both
  // mean authenticate again, not a refused call. The one refresh a call may make is per member.
  EtcdCluster cluster(1, "auth-old", {"--auth-token", "simple"});
  const std::string ep = "--endpoints=" + cluster.member(0).client_url(false);
  REQUIRE(ddprun::test::run_shell("ETCDCTL_API=3 etcdctl " + ep + " user add root:rootpw") == 0);
  REQUIRE(ddprun::test::run_shell("ETCDCTL_API=3 etcdctl " + ep + " auth enable") == 0);
  REQUIRE(ddprun::test::run_shell("ETCDCTL_API=3 etcdctl " + ep + " --user root:rootpw put /a 1") == 0);
  const std::string direct = cluster.endpoints();
  const auto upstream = static_cast<std::uint16_t>(std::stoi(direct.substr(direct.rfind(':') + 1)));
  using ddprun::test::http_reply;
  boost::asio::io_context io;
  int auth1 = 0, range1 = 0, auth2 = 0, range2 = 0;
  // The first member: the auth store moved on, then (with a fresh token) it fails.
  FakeGateway g1(io, [&](const std::string& line, const std::string& body) {
    if (line.starts_with("POST /v3/auth/authenticate ")) {
      ++auth1;
      return ddprun::test::forward(upstream, line, body);
    }
    if (++range1 == 1) {
      return FakeGateway::Reply{http_reply(
          400,
          R"({"error":"etcdserver: revision of auth store is old","code":3,"message":"etcdserver: revision of auth store is old"})")};
    }
    return FakeGateway::Reply{http_reply(503, R"({"error":"overloaded","code":2,"message":"overloaded"})")};
  });
  // The second member dropped the token, then answers.
  FakeGateway* g2p = nullptr;
  FakeGateway g2(io, [&](const std::string& line, const std::string& body) {
    if (line.starts_with("POST /v3/auth/authenticate ")) {
      ++auth2;
      return ddprun::test::forward(upstream, line, body);
    }
    if (++range2 == 1) {
      return FakeGateway::Reply{http_reply(
          400, R"({"error":"etcdserver: user name is empty","code":3,"message":"etcdserver: user name is empty"})")};
    }
    return ddprun::test::forward(upstream, line, body, g2p->authorization());
  });
  g2p = &g2;
  auto o = options_for(g1.endpoint() + "," + g2.endpoint());
  o.username = "root";
  o.password = "rootpw";
  EtcdClient c(io, o);
  auto [e1, r] = call<RangeResponse>(io, [&](auto cb) { c.range({"/a", {}, 0, 0, false, false}, cb); });
  INFO((e1 ? e1->message : std::string()));
  REQUIRE_FALSE(e1);
  REQUIRE(r.kvs.size() == 1);
  CHECK(r.kvs[0].value == "1");
  CHECK(auth1 == 2);
  CHECK(range1 == 2);
  CHECK(auth2 == 1);
  CHECK(range2 == 2);
}

TEST_CASE("etcd client: a member failing the authentication (5xx, a proxy's 404) is skipped, not taken for a refusal",
          "[etcd][client][auth]") {
  EtcdCluster cluster(1, "auth-failover", {"--auth-token", "simple"});
  const std::string ep = "--endpoints=" + cluster.member(0).client_url(false);
  REQUIRE(ddprun::test::run_shell("ETCDCTL_API=3 etcdctl " + ep + " user add root:rootpw") == 0);
  REQUIRE(ddprun::test::run_shell("ETCDCTL_API=3 etcdctl " + ep + " auth enable") == 0);
  boost::asio::io_context io;
  using ddprun::test::http_reply;
  FakeGateway g503(io, [](const std::string&, const std::string&) {
    return FakeGateway::Reply{http_reply(503, R"({"error":"overloaded","code":2,"message":"overloaded"})")};
  });
  FakeGateway g404(io, [](const std::string&, const std::string&) {
    return FakeGateway::Reply{http_reply(404, "404 page not found\n")};
  });
  // A load balancer's pages: a redirect, and a rate limit without etcd's body (before, any status
  // but 5xx/404/400/401/403 was taken for a refusal of the credentials, and the agent ended).
  FakeGateway g302(io, [](const std::string&, const std::string&) {
    return FakeGateway::Reply{http_reply(302, "<html>moved</html>")};
  });
  FakeGateway g429(io, [](const std::string&, const std::string&) {
    return FakeGateway::Reply{http_reply(429, "<html>slow down</html>")};
  });
  auto o = options_for(g503.endpoint() + "," + g404.endpoint() + "," + g302.endpoint() + "," + g429.endpoint() + "," +
                       cluster.endpoints());
  o.username = "root";
  o.password = "rootpw";
  EtcdClient c(io, o);
  auto [e1, h1] = call<ResponseHeader>(io, [&](auto cb) { c.put({"/f", "1", 0}, cb); });
  INFO((e1 ? e1->message : std::string()));
  REQUIRE_FALSE(e1);
  CHECK(g503.requests() == 1);
  CHECK(g404.requests() == 1);
  CHECK(g302.requests() == 1);
  CHECK(g429.requests() == 1);

  // Only failing members: an error naming each, not a refusal of the credentials.
  auto od = options_for(g503.endpoint() + "," + g404.endpoint());
  od.username = "root";
  od.password = "rootpw";
  EtcdClient e(io, od);
  auto [e2, h2] = call<ResponseHeader>(io, [&](auto cb) { e.put({"/f", "2", 0}, cb); });
  REQUIRE(e2);
  CHECK_FALSE(e2->auth_failed);
  CHECK_FALSE(e2->permanent);
  CHECK_THAT(e2->message, Catch::Contains(g503.endpoint() + ": authenticate: HTTP 503: overloaded") &&
                              Catch::Contains(g404.endpoint() + ": authenticate: HTTP 404"));
}

TEST_CASE("etcd client: TLS with a CA and a client certificate", "[etcd][client][tls]") {
  const auto certs_dir = ddprun::test::make_temp_dir("certs");
  const auto f = ddprun::test::make_tls_files(certs_dir);
  EtcdCluster cluster(
      1, "tls",
      {"--cert-file", f.server_cert, "--key-file", f.server_key, "--trusted-ca-file", f.ca, "--client-cert-auth"},
      true);
  boost::asio::io_context io;
  auto o = options_for(cluster.endpoints());
  o.tls = true;
  o.cacert = f.ca;
  o.cert = f.client_cert;
  o.key = f.client_key;
  EtcdClient c(io, o);
  auto [e1, h] = call<ResponseHeader>(io, [&](auto cb) { c.put({"/tls", "ok", 0}, cb); });
  REQUIRE_FALSE(e1);
  std::optional<std::string> got;
  WatchHandlers wh;
  wh.on_message = [&](const WatchMessage& m) { got = m.events.at(0).kv.value; };
  c.watch({"/tls", {}, 1, false}, wh);
  REQUIRE(run_until(
      io, [&] { return got.has_value(); }, 10s));
  CHECK(*got == "ok");

  auto wrong_ca = o;
  wrong_ca.cacert = f.other_ca;
  EtcdClient d(io, wrong_ca);
  auto [e2, r2] = call<RangeResponse>(io, [&](auto cb) { d.range({"/tls", {}, 0, 0, false, false}, cb); });
  REQUIRE(e2);
  CHECK_THAT(e2->message, Catch::Contains("TLS handshake failed") && Catch::Contains(cluster.endpoints()));

  auto no_cert = o;
  no_cert.cert.clear();
  no_cert.key.clear();
  EtcdClient n(io, no_cert);
  auto [e3, r3] = call<RangeResponse>(io, [&](auto cb) { n.range({"/tls", {}, 0, 0, false, false}, cb); });
  REQUIRE(e3);
  CHECK_THAT(e3->message, Catch::Contains(cluster.endpoints()));

  auto missing = o;
  missing.cacert = (certs_dir / "nope.pem").string();
  CHECK_THROWS_WITH(EtcdClient(io, missing), Catch::Contains("nope.pem"));
  std::filesystem::remove_all(certs_dir);
}

TEST_CASE("etcd client: a chunk-size line or chunk extension without end fails the call at once", "[etcd][client]") {
  // 8 MiB of one chunk header, then silence: the client must give up on the line after a bounded
  // buffer, not keep reading it until the request timeout.
  const std::string endless_size = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + std::string(8 << 20, '0');
  const std::string endless_ext =
      "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1;a=" + std::string(8 << 20, 'b');
  boost::asio::io_context io;
  FakeGateway g1(io, [&](const std::string&, const std::string&) { return FakeGateway::Reply{endless_size}; });
  FakeGateway g2(io, [&](const std::string&, const std::string&) { return FakeGateway::Reply{endless_ext}; });
  EtcdClient c(io, options_for(g1.endpoint() + "," + g2.endpoint()));  // request timeout 3 s
  const auto t0 = std::chrono::steady_clock::now();
  auto [e, r] = call<RangeResponse>(io, [&](auto cb) { c.range({"/k", {}, 0, 0, false, false}, cb); });
  REQUIRE(e);
  CHECK(std::chrono::steady_clock::now() - t0 < 2s);
  CHECK_THAT(e->message, Catch::Contains(g1.endpoint() + ": no reply: a reply line or chunk header over") &&
                             Catch::Contains(g2.endpoint() + ": no reply: a reply line or chunk header over"));

  // The watch stream: the broken stream is reported and resumed elsewhere, not read forever.
  std::vector<std::string> broke;
  WatchHandlers wh;
  wh.on_reconnect = [&](const std::string& why, bool) { broke.push_back(why); };
  c.watch({"/k", {}, 0, false}, wh);
  REQUIRE(run_until(
      io, [&] { return broke.size() >= 2; }, 2s));
  CHECK_THAT(broke[0], Catch::Contains("chunk header over"));
  CHECK_THAT(broke[1], Catch::Contains("chunk header over"));
}

TEST_CASE("etcd client: range_all refuses pages that are not a page of the range in order", "[etcd][client][paging]") {
  // A proxy or cache that replays one page ("more": true, the same key each time) had range_all
  // read it again and again without end; empty keys cost memory the byte count did not see.
  using ddprun::test::http_reply;
  boost::asio::io_context io;
  const std::string same = R"({"header":{"revision":"5"},"kvs":[{"key":"L2ova2Fh","value":"MQ==",)"
                           R"("mod_revision":"5"}],"more":true,"count":"99"})";  // "/j/kaa"
  FakeGateway replay(io,
                     [&](const std::string&, const std::string&) { return FakeGateway::Reply{http_reply(200, same)}; });
  EtcdClient c(io, options_for(replay.endpoint()));
  auto [e1, r1] = call<RangeResponse>(io, [&](auto cb) {
    c.range_all({"/j/", prefix_range_end("/j/"), 0, 0, false, false}, 64 << 20, cb);
  });
  REQUIRE(e1);
  CHECK(e1->permanent);
  CHECK_THAT(e1->message, Catch::Contains("not a page of that range in order") && Catch::Contains(replay.endpoint()));
  CHECK(replay.requests() == 2);  // the first page, then the replay of it
  // Empty keys (outside any range that starts with a key) and more keys than asked for.
  const std::string empties = R"({"header":{"revision":"5"},"kvs":[{"key":""},{"key":""}],"more":true})";
  FakeGateway empty(
      io, [&](const std::string&, const std::string&) { return FakeGateway::Reply{http_reply(200, empties)}; });
  EtcdClient d(io, options_for(empty.endpoint()));
  auto [e2, r2] = call<RangeResponse>(io, [&](auto cb) {
    d.range_all({"/j/", prefix_range_end("/j/"), 0, 0, false, false}, 64 << 20, cb);
  });
  REQUIRE(e2);
  CHECK_THAT(e2->message, Catch::Contains("2 keys that are not a page of that range in order (limit 1)"));
}

TEST_CASE("etcd client: range_all asks for fewer keys when a page does not come within the request timeout",
          "[etcd][client][paging]") {
  // A member on a slow link: a page of more than 3 keys never comes in time (here: never), a
  // smaller one does. Before, the read failed the same way on each try.
  using ddprun::test::http_reply;
  boost::asio::io_context io;
  std::vector<std::string> keys;
  for (int i = 0; i < 10; ++i) keys.push_back(fmt::format("/t/k{:02d}", i));
  std::vector<std::int64_t> limits;
  FakeGateway slow(io, [&](const std::string&, const std::string& body) {
    std::smatch m;
    std::int64_t limit = 0;
    if (std::regex_search(body, m, std::regex(R"re("limit":"?(\d+))re"))) limit = std::stoll(m[1].str());
    limits.push_back(limit);
    if (limit == 0 || limit > 3) return FakeGateway::Reply{""};  // never in time
    std::string from;
    if (std::regex_search(body, m, std::regex(R"re("key":"([^"]*)")re"))) from = *base64_decode(m[1].str());
    std::string kvs;
    std::size_t n = 0;
    bool more = false;
    for (const auto& k : keys) {
      if (k < from) continue;
      if (n == static_cast<std::size_t>(limit)) {
        more = true;
        break;
      }
      kvs += fmt::format(R"({}{{"key":"{}","value":"{}","mod_revision":"5"}})", kvs.empty() ? "" : ",",
                         base64_encode(k), base64_encode("v"));
      ++n;
    }
    return FakeGateway::Reply{
        http_reply(200, fmt::format(R"({{"header":{{"revision":"5"}},"kvs":[{}],"more":{}}})", kvs, more))};
  });
  auto o = options_for(slow.endpoint());
  o.request_timeout = 300ms;
  EtcdClient c(io, o);
  auto [e, r] = call<RangeResponse>(io, [&](auto cb) {
    c.range_all({"/t/", prefix_range_end("/t/"), 0, 0, false, false}, 64 << 20, cb);
  });
  REQUIRE_FALSE(e);
  REQUIRE(r.kvs.size() == keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) CHECK(r.kvs[i].key == keys[i]);
  CHECK(std::find_if(limits.begin(), limits.end(), [](std::int64_t l) { return l > 3; }) != limits.end());
}

TEST_CASE("etcd client: a connection the member closed while idle is replaced, not taken for a failed member",
          "[etcd][client]") {
  // The only member closes every connection after its reply without saying so (an idle limit of
  // its own or of a load balancer in front of it): the next call finds the kept connection
  // closed. Before, that call failed ("no etcd endpoint answered"); now it goes again on a new
  // connection to the same member.
  using ddprun::test::http_reply;
  boost::asio::io_context io;
  FakeGateway closing(io, [&](const std::string&, const std::string&) {
    return FakeGateway::Reply{http_reply(200, R"({"header":{"revision":"7"}})"), /*close=*/true};
  });
  EtcdClient c(io, options_for(closing.endpoint()));
  for (int i = 0; i < 3; ++i) {
    auto [e, h] = call<ResponseHeader>(io, [&](auto cb) { c.put({"/idle", "1", 0}, cb); });
    REQUIRE_FALSE(e);
    CHECK(h.revision == 7);
  }
  CHECK(closing.requests() == 3);
}

TEST_CASE("etcd client: a member another client found silent moves this client's watch on at once",
          "[etcd][client][ha]") {
  // Endpoint 0 accepts a watch and then says nothing, and never answers a call (a stalled member
  // that keeps its connections); endpoint 1 is etcd. The watch of client B sits on endpoint 0;
  // client A's call there times out and moves on, and its hook tells B: B's watch resumes at
  // once, not after its 30 s idle timeout.
  EtcdCluster cluster(1, "hook");
  boost::asio::io_context io;
  const std::string created = R"({"result":{"header":{"revision":"5"},"created":true}})"
                              "\n";
  char size[16];
  std::snprintf(size, sizeof size, "%zx", created.size());
  FakeGateway stalled(io, [&](const std::string& line, const std::string&) {
    if (!line.starts_with("POST /v3/watch ")) return FakeGateway::Reply{""};  // never answered
    return FakeGateway::Reply{
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n" + std::string(size) +
        "\r\n" + created + "\r\n"};
  });
  auto o = options_for(stalled.endpoint() + "," + cluster.endpoints());
  o.request_timeout = 500ms;
  o.watch_idle_timeout = 30s;
  EtcdClient a(io, o);
  EtcdClient b(io, o);
  a.set_endpoint_failed_hook([&](std::size_t index) { b.endpoint_failed(index); });
  std::vector<std::string> resumed;
  WatchHandlers wh;
  wh.on_reconnect = [&](const std::string& why, bool) { resumed.push_back(why); };
  b.watch({"/hook", {}, 0, false}, wh);
  REQUIRE(run_until(
      io, [&] { return stalled.requests() >= 1; }, 5s));  // B's watch is on the stalled member
  const auto t0 = std::chrono::steady_clock::now();
  auto [e, h] = call<ResponseHeader>(io, [&](auto cb) { a.put({"/hook", "1", 0}, cb); });
  REQUIRE_FALSE(e);  // on endpoint 1, after endpoint 0 timed out
  REQUIRE(run_until(
      io, [&] { return !resumed.empty(); }, 5s));
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);
  CHECK_THAT(resumed[0], Catch::Contains(stalled.endpoint()));
}

TEST_CASE("etcd client: a member answering 5xx, 404 or a malformed reply is skipped for the next", "[etcd][client]") {
  EtcdCluster cluster(1, "bad-member");
  boost::asio::io_context io;
  using ddprun::test::http_reply;
  FakeGateway g500(io, [](const std::string&, const std::string&) {
    return FakeGateway::Reply{http_reply(503, R"({"error":"overloaded","code":2,"message":"overloaded"})")};
  });
  FakeGateway g404(io, [](const std::string&, const std::string&) {
    return FakeGateway::Reply{http_reply(404, "404 page not found\n")};
  });
  FakeGateway bad(io, [](const std::string&, const std::string&) {
    return FakeGateway::Reply{http_reply(200, R"({"header":{"revision":"x"}})")};
  });
  EtcdClient c(io,
               options_for(g500.endpoint() + "," + g404.endpoint() + "," + bad.endpoint() + "," + cluster.endpoints()));
  auto [e1, h1] = call<ResponseHeader>(io, [&](auto cb) { c.put({"/m", "1", 0}, cb); });
  REQUIRE_FALSE(e1);
  CHECK(g500.requests() == 1);
  CHECK(g404.requests() == 1);
  CHECK(bad.requests() == 1);
  // The call stays on the member that answered.
  auto [e2, r] = call<RangeResponse>(io, [&](auto cb) { c.range({"/m", {}, 0, 0, false, false}, cb); });
  REQUIRE_FALSE(e2);
  CHECK(r.kvs.at(0).value == "1");
  CHECK(bad.requests() == 1);

  // Only bad members: the error names each and what it answered.
  EtcdClient d(io, options_for(g500.endpoint() + "," + bad.endpoint()));
  auto [e3, r3] = call<RangeResponse>(io, [&](auto cb) { d.range({"/m", {}, 0, 0, false, false}, cb); });
  REQUIRE(e3);
  CHECK_THAT(e3->message, Catch::Contains(g500.endpoint() + ": HTTP 503: overloaded") &&
                              Catch::Contains(bad.endpoint() + ": malformed reply: "));
}

TEST_CASE("etcd client: a 400/401/403 that is not etcd's error moves to the next member; etcd's own is final",
          "[etcd][client]") {
  EtcdCluster cluster(1, "proxy-4xx");
  boost::asio::io_context io;
  using ddprun::test::http_reply;
  // A proxy's pages, and an etcd-looking body whose code does not go with its status.
  FakeGateway html403(io, [](const std::string&, const std::string&) {
    return FakeGateway::Reply{http_reply(403, "<html><body>Forbidden by the proxy</body></html>")};
  });
  FakeGateway html401(io, [](const std::string&, const std::string&) {
    return FakeGateway::Reply{http_reply(401, "<html><body>Log in first</body></html>")};
  });
  FakeGateway odd400(io, [](const std::string&, const std::string&) {
    return FakeGateway::Reply{http_reply(400, R"({"error":"bad gateway","code":14,"message":"bad gateway"})")};
  });
  EtcdClient c(io, options_for(html403.endpoint() + "," + html401.endpoint() + "," + odd400.endpoint() + "," +
                               cluster.endpoints()));
  auto [e1, h1] = call<ResponseHeader>(io, [&](auto cb) { c.put({"/p", "1", 0}, cb); });
  REQUIRE_FALSE(e1);
  CHECK(html403.requests() == 1);
  CHECK(html401.requests() == 1);
  CHECK(odd400.requests() == 1);

  // etcd's own InvalidArgument: no other member would answer otherwise.
  FakeGateway refusal(io, [](const std::string&, const std::string&) {
    return FakeGateway::Reply{http_reply(
        400, R"({"error":"etcdserver: key is not provided","code":3,"message":"etcdserver: key is not provided"})")};
  });
  EtcdClient d(io, options_for(refusal.endpoint() + "," + cluster.endpoints()));
  auto [e2, h2] = call<ResponseHeader>(io, [&](auto cb) { d.put({"/p", "2", 0}, cb); });
  REQUIRE(e2);
  CHECK(e2->permanent);
  CHECK(e2->grpc_code == 3);
  CHECK_THAT(e2->message, Catch::Contains(refusal.endpoint()) && Catch::Contains("key is not provided"));
}

TEST_CASE("etcd client: a watch refused with a body that never comes times out; a silent stream is resumed",
          "[etcd][client]") {
  boost::asio::io_context io;
  // HTTP 400 announcing 100 bytes of body, then silence: the request timeout applies to the
  // body of a refusal like to any reply (the stream had no deadline at all).
  FakeGateway stuck(io, [](const std::string&, const std::string&) {
    return FakeGateway::Reply{
        "HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        "{\"error\":"};
  });
  auto o = options_for(stuck.endpoint());
  o.request_timeout = 500ms;
  EtcdClient c(io, o);
  std::vector<std::string> broke;
  std::vector<bool> broke_worked;
  WatchHandlers wh;
  wh.on_reconnect = [&](const std::string& why, bool worked) {
    broke.push_back(why);
    broke_worked.push_back(worked);
  };
  wh.on_error = [&](const EtcdError& e) { broke.push_back("error: " + e.message); };
  c.watch({"/k", {}, 0, false}, wh);
  REQUIRE(run_until(
      io, [&] { return !broke.empty(); }, 5s));
  CHECK_THAT(broke[0], Catch::Contains(stuck.endpoint()) && Catch::Contains("timed out"));
  REQUIRE(!broke_worked.empty());
  CHECK_FALSE(broke_worked[0]);  // never a stream: counts towards the owner's give-up

  // A stream that was created and then says nothing for the idle timeout is resumed on the same
  // member (a healthy quiet one answers again; a stalled one then times out and is left).
  const std::string created = R"({"result":{"header":{"revision":"5"},"created":true}})"
                              "\n";
  char size[16];
  std::snprintf(size, sizeof size, "%zx", created.size());
  FakeGateway quiet(io, [&](const std::string&, const std::string&) {
    return FakeGateway::Reply{
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n" + std::string(size) +
        "\r\n" + created + "\r\n"};
  });
  auto q = options_for(quiet.endpoint());
  q.watch_idle_timeout = 300ms;
  q.request_timeout = 200ms;  // a stream that lived that long worked
  EtcdClient d(io, q);
  std::vector<std::string> resumed;
  std::vector<bool> resumed_worked;
  WatchHandlers qh;
  qh.on_reconnect = [&](const std::string& why, bool worked) {
    resumed.push_back(why);
    resumed_worked.push_back(worked);
  };
  qh.on_error = [&](const EtcdError& e) { FAIL("watch error: " << e.message); };
  const auto t0 = std::chrono::steady_clock::now();
  d.watch({"/k", {}, 0, true}, qh);
  REQUIRE(run_until(
      io, [&] { return resumed.size() >= 2 && quiet.requests() >= 3; }, 5s));
  CHECK(std::chrono::steady_clock::now() - t0 >= 600ms);
  CHECK_THAT(resumed[0], Catch::Contains("no message for 300 ms"));
  CHECK(resumed_worked[0]);  // a stream that lived the request timeout: not counted towards a give-up
  for (const std::string& line : quiet.request_lines()) CHECK(line.starts_with("POST /v3/watch "));
}

TEST_CASE("etcd client: a quiet watch resumes from its last progress notification; a healthy stream resets the backoff",
          "[etcd][client]") {
  // Each watch is accepted, created at revision 5 and told (progress notification) that all is
  // sent up to revision 100, then goes quiet until the idle timeout resumes it.
  boost::asio::io_context io;
  auto chunk = [](const std::string& text) {
    char size[16];
    std::snprintf(size, sizeof size, "%zx", text.size());
    return std::string(size) + "\r\n" + text + "\r\n";
  };
  std::vector<std::string> bodies;
  std::vector<std::chrono::steady_clock::time_point> arrived;
  FakeGateway quiet(io, [&](const std::string&, const std::string& body) {
    bodies.push_back(body);
    arrived.push_back(std::chrono::steady_clock::now());
    return FakeGateway::Reply{
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n" +
        chunk(R"({"result":{"header":{"revision":"5"},"created":true}})"
              "\n") +
        chunk(R"({"result":{"header":{"revision":"100"}}})"
              "\n")};
  });
  auto o = options_for(quiet.endpoint());
  o.watch_idle_timeout = 300ms;
  o.request_timeout = 200ms;
  EtcdClient c(io, o);
  std::vector<std::chrono::steady_clock::time_point> broke;
  WatchHandlers h;
  h.on_reconnect = [&](const std::string&, bool) { broke.push_back(std::chrono::steady_clock::now()); };
  h.on_error = [&](const EtcdError& e) { FAIL("watch error: " << e.message); };
  c.watch({"/k", {}, 0, true}, h);
  REQUIRE(run_until(
      io, [&] { return bodies.size() >= 7; }, 15s));
  CHECK_THAT(bodies[0], !Catch::Contains("start_revision"));
  for (std::size_t i = 1; i < bodies.size(); ++i) CHECK_THAT(bodies[i], Catch::Contains(R"("start_revision":"101")"));
  // Every stream lasted the idle timeout, longer than the request timeout: each resume waits the
  // first backoff step (50 ms), not 0.4, 0.8, 1.6 s...
  for (std::size_t i = 3; i < 6; ++i) {
    INFO("resume " << i);
    CHECK(arrived.at(i + 1) - broke.at(i) < 450ms);
  }
}
