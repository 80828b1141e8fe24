#include <catch2/catch.hpp>

#include "ddprun/common/clock.hpp"
#include "ddprun/common/logging.hpp"
#include "ddprun/common/strings.hpp"

TEST_CASE("split/trim/lower") {
  CHECK(ddprun::split("a,b,,c", ',') == std::vector<std::string>{"a", "b", "", "c"});
  CHECK(ddprun::split("", ',') == std::vector<std::string>{""});
  CHECK(ddprun::trim("  x y \n") == "x y");
  CHECK(ddprun::to_lower("SIGTerm") == "sigterm");
}

TEST_CASE("parse_int is strict") {
  CHECK(ddprun::parse_int("42") == 42);
  CHECK(ddprun::parse_int("-3") == -3);
  CHECK_FALSE(ddprun::parse_int("4x"));
  CHECK_FALSE(ddprun::parse_int(""));
  CHECK_FALSE(ddprun::parse_int(" 4"));
  CHECK(ddprun::parse_seconds("0.5") == 0.5);
  CHECK_FALSE(ddprun::parse_seconds("-1"));
  CHECK_FALSE(ddprun::parse_seconds("30s"));
}

TEST_CASE("hex round trip") {
  std::string bytes;
  for (int i = 0; i < 256; ++i) bytes.push_back(static_cast<char>(i));
  const auto hex = ddprun::to_hex(bytes);
  CHECK(hex.size() == 512);
  CHECK(hex.substr(0, 6) == "000102");
  CHECK(ddprun::from_hex(hex) == bytes);
  CHECK_FALSE(ddprun::from_hex("abc"));
  CHECK_FALSE(ddprun::from_hex("zz"));
}

TEST_CASE("manual clock") {
  ddprun::ManualClock clock;
  const auto t0 = clock.now();
  clock.advance(std::chrono::seconds(3));
  CHECK(clock.now() - t0 == std::chrono::seconds(3));
}

TEST_CASE("log levels") {
  CHECK(ddprun::parse_log_level("WARNING") == spdlog::level::warn);
  CHECK(ddprun::parse_log_level("debug") == spdlog::level::debug);
  CHECK_FALSE(ddprun::parse_log_level("loud"));
}
