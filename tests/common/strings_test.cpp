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
}

// As std::from_chars read it (before libm was dropped), but at most 64 characters.
TEST_CASE("parse_seconds: a strict non-negative decimal") {
  CHECK(ddprun::parse_seconds("0.5") == 0.5);
  CHECK(ddprun::parse_seconds("30") == 30.0);
  CHECK(ddprun::parse_seconds(".25") == 0.25);
  CHECK(ddprun::parse_seconds("2.") == 2.0);
  CHECK(ddprun::parse_seconds("1e-3") == 0.001);
  CHECK(ddprun::parse_seconds("1.5E+2") == 150.0);
  CHECK(ddprun::parse_seconds("0.1") == 0.1);  // correctly rounded, the same double as the literal
  CHECK(ddprun::parse_seconds("-0") == 0.0);
  CHECK(ddprun::parse_seconds("1e-310") > 0.0);  // subnormal, kept
  for (const char* bad : {"",     "-1",  "30s", "+1",       " 1",  "1 ",    ".",    "-",   "e3",     "1e",     "1e+",
                          "0x10", "inf", "nan", "infinity", "1,5", "1e999", "1..2", "--1", "1e-400", "-1e-400"}) {
    INFO(bad);
    CHECK_FALSE(ddprun::parse_seconds(bad));
  }
  CHECK_FALSE(ddprun::parse_seconds(std::string(65, '1')));  // longer than any duration is written
}

TEST_CASE("seconds_to_ms rounds to nearest, without libm") {
  CHECK(ddprun::seconds_to_ms(0) == 0);
  CHECK(ddprun::seconds_to_ms(0.0004) == 0);
  CHECK(ddprun::seconds_to_ms(0.0005) == 1);
  CHECK(ddprun::seconds_to_ms(0.001) == 1);
  CHECK(ddprun::seconds_to_ms(1.2345) == 1235);
  CHECK(ddprun::seconds_to_ms(30) == 30000);
  CHECK(ddprun::seconds_to_ms(2592000) == 2592000000LL);
  CHECK(ddprun::seconds_to_ms(1e300) == 1000000000000000LL);  // clamped, not undefined
  CHECK(ddprun::seconds_to_ms(-1) == 0);
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

TEST_CASE("utf8_prefix never ends inside a character", "[strings]") {
  const std::string text = "ab\xc3\xa9\xe2\x82\xac";  // "abé€": 2 + 2 + 3 bytes
  CHECK(ddprun::utf8_prefix(text, 100) == text);
  CHECK(ddprun::utf8_prefix(text, 2) == "ab");
  CHECK(ddprun::utf8_prefix(text, 3) == "ab");  // inside é
  CHECK(ddprun::utf8_prefix(text, 4) == "ab\xc3\xa9");
  CHECK(ddprun::utf8_prefix(text, 6) == "ab\xc3\xa9");  // inside €
  CHECK(ddprun::utf8_prefix(text, 0).empty());
}

TEST_CASE("terminal_safe_prefix cuts, escapes and marks the cut; a backslash may stay one", "[strings]") {
  CHECK(ddprun::terminal_safe_prefix("a\x1b[2Jb\\u", 100) == "a\\x1b[2Jb\\\\u");
  CHECK(ddprun::terminal_safe_prefix("a\x1b[2Jb\\u", 100, false) == "a\\x1b[2Jb\\u");
  CHECK(ddprun::terminal_safe_prefix("ab\xc3\xa9x", 3) == "ab...");  // not inside é
  CHECK(ddprun::terminal_safe_prefix("abc", 3) == "abc");
  CHECK(ddprun::terminal_safe("x\\y\n", false) == "x\\y\\x0a");
}
