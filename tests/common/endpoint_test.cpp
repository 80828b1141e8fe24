#include <catch2/catch.hpp>

#include "ddprun/common/endpoint.hpp"
#include "ddprun/common/error.hpp"

using ddprun::parse_endpoint;

TEST_CASE("endpoint forms") {
  CHECK(parse_endpoint("head", 29400, "--x") == ddprun::Endpoint{"head", 29400});
  CHECK(parse_endpoint("head:1234", 29400, "--x") == ddprun::Endpoint{"head", 1234});
  CHECK(parse_endpoint("127.0.0.1:0", 29400, "--x") == ddprun::Endpoint{"127.0.0.1", 0});
  CHECK(parse_endpoint("[::1]:5", 29400, "--x") == ddprun::Endpoint{"::1", 5});
  CHECK(parse_endpoint("[fe80::1]", 7, "--x") == ddprun::Endpoint{"fe80::1", 7});
  CHECK(parse_endpoint("fe80::1", 7, "--x") == ddprun::Endpoint{"fe80::1", 7});
  CHECK(ddprun::Endpoint{"::1", 5}.to_string() == "[::1]:5");
  CHECK(ddprun::Endpoint{"h", 5}.to_string() == "h:5");
}

TEST_CASE("an IPv6 address without brackets: a port after it as torchrun reads it, or an error") {
  // torchrun reads the text after the last colon as the port: ::1:29400 is [::1]:29400. Before,
  // every text with two colons was taken whole as a host: [::1:29400]:29400, and also
  // http://node1:29400, node1::29400, node1:29400: (failing only when the agent connected).
  CHECK(parse_endpoint("::1:29400", 7, "--x") == ddprun::Endpoint{"::1", 29400});
  CHECK(parse_endpoint("fe80::1%eth0:29400", 7, "--x") == ddprun::Endpoint{"fe80::1%eth0", 29400});
  CHECK(parse_endpoint("fe80::1%eth0", 7, "--x") == ddprun::Endpoint{"fe80::1%eth0", 7});
  CHECK(parse_endpoint("2001:db8::1", 7, "--x") == ddprun::Endpoint{"2001:db8::1", 7});
  CHECK(parse_endpoint("::1", 7, "--x") == ddprun::Endpoint{"::1", 7});
  for (const char* bad : {"http://node1:29400", "node1::29400", "node1:29400:", "a:b:c", "::1:99999", "fe80::1%:5"}) {
    CHECK_THROWS_WITH(parse_endpoint(bad, 1, "--rdzv-endpoint"),
                      Catch::Contains("--rdzv-endpoint") && Catch::Contains("not a host or HOST:PORT"));
  }
  // Both readings are addresses (the last group is a number a port can be): brackets needed.
  CHECK_THROWS_WITH(parse_endpoint("::1:2940", 1, "--rdzv-endpoint"),
                    Catch::Contains("[::1]:2940") && Catch::Contains("[::1:2940]"));
}

TEST_CASE("bad endpoints name the flag and the forms") {
  for (const char* bad : {"", "head:", "head:99999", "head:-1", "[::1", "[::1]x", ":80", "h:8a"}) {
    try {
      parse_endpoint(bad, 1, "--rdzv-endpoint");
      FAIL("accepted '" << bad << "'");
    } catch (const ddprun::UsageError& e) {
      CHECK_THAT(e.what(), Catch::Contains("--rdzv-endpoint"));
      CHECK_THAT(e.what(), Catch::Contains("accepted forms"));
    }
  }
}

TEST_CASE("an endpoint's host holds no blank, control character or bracket") {
  // Each would reach the resolver (cut at a NUL) or not be written back as the same endpoint.
  for (const std::string& bad :
       {std::string("he ad:1"), std::string("head\n:1"), std::string("h\x1f"), std::string("[\x0b\0\0]:5", 7),
        std::string("[[::1]:5"), std::string("a]b:5"), std::string("h\x7f:1"), std::string("[a,b]:5")}) {
    try {
      parse_endpoint(bad, 1, "--rdzv-endpoint");
      FAIL("accepted '" << bad << "'");
    } catch (const ddprun::UsageError& e) {
      CHECK_THAT(e.what(), Catch::Contains("--rdzv-endpoint") && Catch::Contains("' holds "));
      // Shown escaped: the terminal gets no control character from it.
      for (const char c : std::string(e.what())) CHECK((static_cast<unsigned char>(c) >= 0x20 && c != 0x7f));
    }
  }
  CHECK(parse_endpoint("[fe80::1%eth0]:5", 1, "--x") == ddprun::Endpoint{"fe80::1%eth0", 5});
  CHECK(parse_endpoint(" head:5\t", 1, "--x") == ddprun::Endpoint{"head", 5});
}

TEST_CASE("endpoint lists") {
  using ddprun::Endpoint;
  using ddprun::parse_endpoint_list;
  CHECK(parse_endpoint_list("head", 29400, "--x") == std::vector<Endpoint>{{"head", 29400}});
  const auto l = parse_endpoint_list("r1:29401, r2 ,[::1]:5", 29400, "--x");
  CHECK(l == std::vector<Endpoint>{{"r1", 29401}, {"r2", 29400}, {"::1", 5}});
  CHECK(ddprun::endpoint_list_text(l) == "r1:29401,r2:29400,[::1]:5");
  CHECK(parse_endpoint_list(ddprun::endpoint_list_text(l), 1, "--x") == l);
  for (const char* bad : {"", ",", "a,,b", "a,", ",a", "a,b:99999", "a, "}) {
    try {
      parse_endpoint_list(bad, 1, "--rdzv-endpoint");
      FAIL("accepted '" << bad << "'");
    } catch (const ddprun::UsageError& e) {
      CHECK_THAT(e.what(), Catch::Contains("--rdzv-endpoint"));
    }
  }
}
