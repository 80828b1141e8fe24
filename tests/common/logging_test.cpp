// The log formats: text keeps "[name level] message"; json writes one parseable object per line
// whatever the message holds (quotes, backslashes, control characters, invalid UTF-8).
#include <spdlog/sinks/ostream_sink.h>

#include <catch2/catch.hpp>
#include <memory>
#include <sstream>
#include <string>

#include "ddprun/common/logging.hpp"

namespace {

std::string log_one(ddprun::LogFormat format, spdlog::level::level_enum level, const std::string& message) {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_st>(out);
  spdlog::logger logger("ddprun-test", sink);
  logger.set_formatter(ddprun::make_log_formatter(format));
  logger.set_level(spdlog::level::trace);
  logger.log(level, "{}", message);
  return out.str();
}

// The part of a JSON line from "level" on (time and pid vary).
std::string after_time(const std::string& line) {
  const auto at = line.find("\"level\"");
  return at == std::string::npos ? line : line.substr(at);
}

}  // namespace

TEST_CASE("log formats parse") {
  CHECK(ddprun::parse_log_format("json") == ddprun::LogFormat::json);
  CHECK(ddprun::parse_log_format(" TEXT ") == ddprun::LogFormat::text);
  CHECK_FALSE(ddprun::parse_log_format("xml"));
}

TEST_CASE("text format is unchanged") {
  CHECK(log_one(ddprun::LogFormat::text, spdlog::level::warn, "disk full") == "[ddprun-test warning] disk full\n");
}

TEST_CASE("json format: fields, order, one line") {
  const auto line = log_one(ddprun::LogFormat::json, spdlog::level::info, "listening on 0.0.0.0:29400");
  REQUIRE(line.size() > 40);
  CHECK(line.rfind("{\"time\":\"", 0) == 0);
  // 2025-05-20T12:00:00.123456Z
  const auto stamp = line.substr(9, 27);
  CHECK(stamp.size() == 27);
  CHECK(stamp[4] == '-');
  CHECK(stamp[10] == 'T');
  CHECK(stamp[19] == '.');
  CHECK(stamp[26] == 'Z');
  CHECK_THAT(line, Catch::Contains(",\"pid\":"));
  CHECK(after_time(line).substr(0, 43) == "\"level\":\"info\",\"logger\":\"ddprun-test\",\"pid\"");
  CHECK(line.substr(line.size() - 40) == "\"message\":\"listening on 0.0.0.0:29400\"}\n");
  CHECK(line.find('\n') == line.size() - 1);
}

TEST_CASE("json format escapes everything that would break a line or the JSON") {
  const auto line = log_one(ddprun::LogFormat::json, spdlog::level::err,
                            std::string("q\"b\\n\nt\tc\x01"
                                        "d\x7f"
                                        "e\xc3\xa9"
                                        "f\xff"
                                        "g\xe2\x82"
                                        "h"));
  CHECK_THAT(line, Catch::EndsWith("\"message\":\"q\\\"b\\\\n\\nt\\tc\\u0001d\\u007fe\xc3\xa9"
                                   "f\xef\xbf\xbdg\xef\xbf\xbd\xef\xbf\xbdh\"}\n"));
  CHECK_THAT(line, Catch::Contains("\"level\":\"error\""));
  CHECK(line.find('\n') == line.size() - 1);
}

TEST_CASE("json format rejects overlong and surrogate UTF-8") {
  // C0 80 (overlong NUL) and ED A0 80 (a UTF-16 surrogate) are not UTF-8: each byte becomes U+FFFD.
  const auto line = log_one(ddprun::LogFormat::json, spdlog::level::info, std::string("a\xc0\x80z\xed\xa0\x80", 7));
  CHECK_THAT(line,
             Catch::EndsWith("\"message\":\"a\xef\xbf\xbd\xef\xbf\xbdz\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\"}\n"));
}
