// The etcd JSON-gateway codec: base64, key ranges, endpoint lists, request bodies and hostile
// response bodies. No sockets.
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include "ddprun/common/error.hpp"
#include "ddprun/rendezvous/etcd_codec.hpp"

using namespace ddprun::rendezvous::etcd;

TEST_CASE("base64 round-trips every length and rejects non-canonical text", "[etcd][codec]") {
  std::string bytes;
  for (int i = 0; i < 300; ++i) {
    REQUIRE(base64_decode(base64_encode(bytes)) == bytes);
    bytes += static_cast<char>((i * 37) & 0xff);
  }
  CHECK(base64_encode("foo") == "Zm9v");
  CHECK(base64_encode("fo") == "Zm8=");
  CHECK(base64_encode("f") == "Zg==");
  CHECK(base64_decode("Zm8=") == std::string("fo"));
  CHECK_FALSE(base64_decode("Zm8"));       // not a multiple of 4
  CHECK_FALSE(base64_decode("Zm9=Zm9v"));  // padding in the middle
  CHECK_FALSE(base64_decode("Zm!v"));      // bad character
  CHECK_FALSE(base64_decode("Zm9="));      // non-zero bits under the padding
  CHECK_FALSE(base64_decode("Z==="));
}

TEST_CASE("prefix_range_end selects exactly the keys under a prefix", "[etcd][codec]") {
  CHECK(prefix_range_end("/ddprun/job/") == "/ddprun/job0");
  CHECK(prefix_range_end("a\xff") == "b");
  CHECK(prefix_range_end("\xff\xff") == std::string(1, '\0'));
  CHECK(prefix_range_end("") == std::string(1, '\0'));
}

TEST_CASE("endpoint lists: several hosts, default port, schemes", "[etcd][codec]") {
  auto l = parse_endpoints("h1:2379, h2 ,[::1]:4001", "--rdzv-endpoint");
  REQUIRE(l.endpoints.size() == 3);
  CHECK(l.endpoints[0].to_string() == "h1:2379");
  CHECK(l.endpoints[1].to_string() == "h2:2379");
  CHECK(l.endpoints[2].to_string() == "[::1]:4001");
  CHECK_FALSE(l.scheme_tls);
  auto t = parse_endpoints("https://h1:2379/,https://h2:2380", "--rdzv-endpoint");
  CHECK(t.scheme_tls == true);
  CHECK(t.endpoints[1].port == 2380);
  CHECK_THROWS_AS(parse_endpoints("", "--rdzv-endpoint"), ddprun::UsageError);
  CHECK_THROWS_AS(parse_endpoints("h1:2379,,h2", "--rdzv-endpoint"), ddprun::UsageError);
  CHECK_THROWS_AS(parse_endpoints("http://h1,https://h2", "--rdzv-endpoint"), ddprun::UsageError);
  CHECK_THROWS_WITH(parse_endpoints("h1:99999", "--rdzv-endpoint"), Catch::Contains("--rdzv-endpoint"));
}

TEST_CASE("endpoint lists: schemes in any case; other schemes, port 0, user names and spaces refused",
          "[etcd][codec]") {
  auto u = parse_endpoints("HTTPS://h1:2379,Https://h2", "--rdzv-endpoint");
  CHECK(u.scheme_tls == true);
  REQUIRE(u.endpoints.size() == 2);
  CHECK(u.endpoints[0].to_string() == "h1:2379");
  CHECK(u.endpoints[1].to_string() == "h2:2379");
  CHECK(parse_endpoints("HTTP://[::1]:4001", "--rdzv-endpoint").endpoints.at(0).to_string() == "[::1]:4001");
  for (const char* bad :
       {"ftp://h1:2379", "h1:0", "user@h1:2379", "h 1:2379", "h1:2379,h1:2379:x", "h1/x:2379", "h1:99999", "[::1"}) {
    INFO(bad);
    CHECK_THROWS_AS(parse_endpoints(bad, "--rdzv-endpoint"), ddprun::UsageError);
    CHECK_THROWS_WITH(parse_endpoints(bad, "--rdzv-endpoint"),
                      Catch::Contains("--rdzv-endpoint") && Catch::Contains("[http://|https://]HOST[:PORT]"));
  }
  CHECK_THROWS_WITH(parse_endpoints("ftp://h1:2379", "--rdzv-endpoint"), Catch::Contains("scheme 'ftp'"));
}

TEST_CASE("endpoint lists: a link-local IPv6 address may name its zone", "[etcd][codec]") {
  const auto z = parse_endpoints("[fe80::1%eth0]:2379,http://[fe80::2%2]", "--rdzv-endpoint");
  REQUIRE(z.endpoints.size() == 2);
  CHECK(z.endpoints[0].host == "fe80::1%eth0");
  CHECK(z.endpoints[0].port == 2379);
  CHECK(z.endpoints[1].host == "fe80::2%2");
  for (const char* bad : {"[fe80::1%]:2379", "[fe80::1%a:b]:2379", "[fe80::1%a%b]:2379", "[fe8g::1%eth0]:2379"}) {
    INFO(bad);
    CHECK_THROWS_AS(parse_endpoints(bad, "--rdzv-endpoint"), ddprun::UsageError);
  }
}

TEST_CASE("request bodies use proto field names, base64 bytes and string int64", "[etcd][codec]") {
  CHECK(encode_range({"a", "b", 5, 0, false, false}) == R"({"key":"YQ==","range_end":"Yg==","limit":"5"})");
  CHECK(encode_put({"k", "v", 42}) == R"({"key":"aw==","value":"dg==","lease":"42"})");
  TxnRequest t;
  t.compare.push_back({"k", Compare::Target::create_revision, Compare::Result::equal, 0, {}});
  t.compare.push_back({"k", Compare::Target::value, Compare::Result::not_equal, 0, "x"});
  t.success.emplace_back(PutRequest{"k", "v", 0});
  t.failure.emplace_back(RangeRequest{"k", {}, 0, 0, false, false});
  t.failure.emplace_back(DeleteRangeRequest{"k", {}});
  CHECK(encode_txn(t) == R"({"compare":[{"key":"aw==","target":"CREATE","result":"EQUAL","create_revision":"0"},)"
                         R"({"key":"aw==","target":"VALUE","result":"NOT_EQUAL","value":"eA=="}],)"
                         R"("success":[{"request_put":{"key":"aw==","value":"dg=="}}],)"
                         R"("failure":[{"request_range":{"key":"aw=="}},{"request_delete_range":{"key":"aw=="}}]})");
  CHECK(encode_watch_create({"p/", "p0", 7, false}) ==
        R"({"create_request":{"key":"cC8=","range_end":"cDA=","start_revision":"7"}})");
  CHECK(encode_lease_id(9007199254740993) == R"({"ID":"9007199254740993"})");
}

TEST_CASE("responses: defaults omitted, strings or numbers for int64", "[etcd][codec]") {
  RangeResponse r;
  REQUIRE(decode_range(R"({"header":{"cluster_id":"1","member_id":"2","revision":"17","raft_term":"3"},)"
                       R"("kvs":[{"key":"YQ==","create_revision":"5","mod_revision":16,"version":"2",)"
                       R"("value":"dg=="}],"count":"1"})",
                       r) == "");
  CHECK(r.header.revision == 17);
  CHECK(r.header.member_id == 2);
  REQUIRE(r.kvs.size() == 1);
  CHECK(r.kvs[0] == KeyValue{"a", "v", 5, 16, 2, 0});
  CHECK_FALSE(r.more);
  REQUIRE(decode_range(R"({"header":{"revision":"3"}})", r) == "");
  CHECK(r.kvs.empty());
  CHECK(r.count == 0);

  TxnResponse t;
  REQUIRE(decode_txn(R"({"header":{"revision":"9"},"responses":[{"response_range":{"kvs":[{"key":"YQ=="}]}},)"
                     R"({"response_put":{}},{"response_delete_range":{"deleted":"2"}}]})",
                     t) == "");
  CHECK_FALSE(t.succeeded);
  REQUIRE(t.responses.size() == 3);
  CHECK(t.responses[0].range.kvs[0].key == "a");
  CHECK(t.responses[1].kind == TxnOpResponse::Kind::put);
  CHECK(t.responses[2].deleted == 2);

  WatchMessage w;
  std::optional<GatewayError> se;
  REQUIRE(
      decode_watch_message(R"({"result":{"header":{"revision":"8"},"events":[{"kv":{"key":"YQ==","mod_revision":"8"}},)"
                           R"({"type":"DELETE","kv":{"key":"Yg==","mod_revision":"8"}}]}})",
                           w, se) == "");
  CHECK_FALSE(se);
  REQUIRE(w.events.size() == 2);
  CHECK(w.events[0].type == WatchEvent::Type::put);
  CHECK(w.events[1].type == WatchEvent::Type::del);
  REQUIRE(decode_watch_message(R"({"error":{"grpc_code":14,"http_code":503,"message":"etcdserver: no leader"}})", w,
                               se) == "");
  REQUIRE(se);
  CHECK(is_failover_error(*se));

  LeaseKeepAliveResponse k;
  REQUIRE(decode_lease_keepalive(R"({"result":{"ID":"77","TTL":"3"}})", k, se) == "");
  CHECK(k.id == 77);
  CHECK(k.ttl == 3);
  REQUIRE(decode_lease_keepalive(R"({"result":{"ID":"77"}})", k, se) == "");
  CHECK(k.ttl == 0);  // omitted: the lease is gone
}

TEST_CASE("hostile responses are errors naming the field, never exceptions", "[etcd][codec]") {
  RangeResponse r;
  CHECK_THAT(decode_range("not json", r), Catch::Contains("not valid JSON"));
  CHECK_THAT(decode_range("[1,2]", r), Catch::Contains("not a JSON object"));
  CHECK_THAT(decode_range(R"({"kvs":[{"key":"!!"}]})", r), Catch::Contains("'key'"));
  CHECK_THAT(decode_range(R"({"kvs":{}})", r), Catch::Contains("'kvs'"));
  CHECK_THAT(decode_range(R"({"header":{"revision":"12x"}})", r), Catch::Contains("'revision'"));
  CHECK_THAT(decode_range(R"({"header":{"revision":"99999999999999999999"}})", r), Catch::Contains("'revision'"));
  CHECK_THAT(decode_range(R"({"more":"yes"})", r), Catch::Contains("'more'"));
  std::string deep(100, '[');
  CHECK_THAT(decode_range(deep, r), Catch::Contains("not valid JSON"));
  WatchMessage w;
  std::optional<GatewayError> se;
  CHECK_THAT(decode_watch_message(R"({"result":{"events":[{"type":"RENAME","kv":{}}]}})", w, se),
             Catch::Contains("RENAME"));
  LeaseGrantResponse g;
  CHECK_THAT(decode_lease_grant(R"({"TTL":"5"})", g), Catch::Contains("no ID"));
  // Revisions the watch would add one to: the int64 limit (and below zero) are refused.
  CHECK_THAT(decode_range(R"({"header":{"revision":"9223372036854775807"}})", r), Catch::Contains("'revision'"));
  CHECK_THAT(decode_range(R"({"header":{"revision":"-1"}})", r), Catch::Contains("'revision'"));
  CHECK_THAT(decode_range(R"({"kvs":[{"key":"YQ==","mod_revision":"9223372036854775807"}]})", r),
             Catch::Contains("'mod_revision'"));
  CHECK(decode_range(R"({"header":{"revision":"9223372036854775806"}})", r).empty());
  std::string token;
  CHECK_THAT(decode_authenticate("{}", token), Catch::Contains("no token"));
  // A token goes into a header line: CR, LF, spaces and other bytes are refused.
  CHECK_THAT(decode_authenticate(R"({"token":"x\r\nContent-Length: 0\r\n\r\nPOST /v3/kv/deleterange"})", token),
             Catch::Contains("printable"));
  CHECK_THAT(decode_authenticate(R"({"token":"a b"})", token), Catch::Contains("printable"));
  CHECK(decode_authenticate(R"({"token":"gZtEfZuYmQlHUlEs.12"})", token).empty());
  CHECK(token == "gZtEfZuYmQlHUlEs.12");
  const GatewayError e = decode_error("<html>bad gateway</html>");
  CHECK(e.code == 2);
  CHECK_THAT(e.message, Catch::Contains("<html>"));
  const GatewayError a = decode_error(
      R"({"error":"etcdserver: invalid auth token","code":16,"message":"etcdserver: invalid auth token"})");
  CHECK(a.code == 16);
  CHECK(is_invalid_token_error(a));
  CHECK_FALSE(is_failover_error(a));
}

TEST_CASE("replies are decoded in bounded memory; real ones fit", "[etcd][codec]") {
  // Before: json::parse built any reply whole; a 32 MiB body of tiny values (from a bad etcd, or
  // anyone on a plain-HTTP path) took ~17x its size. Now decoding stops at 6x (1 MiB at least).
  RangeResponse r;
  std::string tiny = R"({"kvs":[)";
  for (int i = 0; i < 400000; ++i) tiny += i == 0 ? "[]" : ",[]";
  tiny += "]}";
  CHECK_THAT(decode_range(tiny, r), Catch::Contains("would take more than") && Catch::Contains("MiB to decode"));
  WatchMessage w;
  std::optional<GatewayError> se;
  std::string events = R"({"result":{"events":[)";
  for (int i = 0; i < 400000; ++i) events += i == 0 ? "{}" : ",{}";
  events += "]}}";
  CHECK_THAT(decode_watch_message(events, w, se), Catch::Contains("would take more than"));

  // A real range page: 20,000 keys of the rendezvous log with 64-byte values, about 3 MB.
  std::string page = R"({"header":{"cluster_id":"14841639068965178418","member_id":"10276657743932975437",)"
                     R"("revision":"40017","raft_term":"2"},"kvs":[)";
  const std::string value64 = std::string(86, 'Q') + "==";  // base64 of 64 bytes
  for (int i = 0; i < 20000; ++i) {
    if (i != 0) page += ',';
    page += fmt::format(R"({{"key":"{}","create_revision":"{}","mod_revision":"{}","version":"1","value":"{}"}})",
                        base64_encode(fmt::format("ddprun/job7/log/{:012}", i)), 20000 + i, 20000 + i, value64);
  }
  page += R"(],"more":true,"count":"40000"})";
  REQUIRE(decode_range(page, r) == "");
  CHECK(r.kvs.size() == 20000);
  CHECK(r.more);
}
