// Error-file parsing (both torch formats, broken files) and the root-cause summary text.
#include <catch2/catch.hpp>
#include <csignal>
#include <fstream>
#include <sstream>

#include "ddprun/agent/failure.hpp"

using namespace ddprun::agent;

namespace {

std::string read_capture() {
  // The real file torch 1.13's @record wrote (shared/design/captures-torch-1.13/).
  std::ifstream in(DDPRUN_ERROR_FILE_EXAMPLE);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

TEST_CASE("parses the captured torch 1.13 error file") {
  const auto text = read_capture();
  REQUIRE_FALSE(text.empty());
  const auto parsed = parse_error_file(text);
  REQUIRE(parsed);
  CHECK(parsed->message == "ValueError: intentional failure for error-file capture");
  CHECK_THAT(parsed->traceback, Catch::StartsWith("Traceback (most recent call last):"));
  CHECK(parsed->timestamp == 1795329129);
}

TEST_CASE("message as a plain string with a top-level timestamp") {
  const auto parsed = parse_error_file(R"({"message": "RuntimeError: x", "timestamp": 12})");
  REQUIRE(parsed);
  CHECK(parsed->message == "RuntimeError: x");
  CHECK(parsed->traceback.empty());
  CHECK(parsed->timestamp == 12);
}

TEST_CASE("broken error files never throw and say why") {
  std::string why;
  CHECK_FALSE(parse_error_file("not json {", &why));
  CHECK_THAT(why, Catch::Contains("not valid JSON"));
  CHECK_FALSE(parse_error_file("[1,2]", &why));
  CHECK_THAT(why, Catch::Contains("not a JSON object"));
  CHECK_FALSE(parse_error_file(R"({"other": 1})", &why));
  CHECK_THAT(why, Catch::Contains("no \"message\""));
  CHECK_FALSE(parse_error_file(R"({"message": {"extraInfo": {}}})", &why));
  CHECK_THAT(why, Catch::Contains("message.message"));
  CHECK_FALSE(parse_error_file(R"({"message": 5})", &why));
  CHECK_FALSE(parse_error_file("", &why));
  // Odd but tolerated: a non-numeric timestamp is just absent.
  const auto p = parse_error_file(R"({"message": {"message": "m", "extraInfo": {"timestamp": "soon"}}})");
  REQUIRE(p);
  CHECK_FALSE(p->timestamp);
  // A worker's file: a timestamp too long for 64 bits, or signed, is absent too (not an overflow).
  const auto big = parse_error_file(
      R"({"message": {"message": "m", "extraInfo": {"timestamp": "170666666666666666666666666666666660000000"}}})");
  REQUIRE(big);
  CHECK_FALSE(big->timestamp);
  const auto huge = parse_error_file(R"({"message": "m", "timestamp": 18446744073709551615})");
  REQUIRE(huge);
  CHECK_FALSE(huge->timestamp);
  const auto negative = parse_error_file(R"({"message": "m", "timestamp": "-5"})");
  REQUIRE(negative);
  CHECK_FALSE(negative->timestamp);
  const auto largest = parse_error_file(R"({"message": "m", "timestamp": "9223372036854775807"})");
  REQUIRE(largest);
  CHECK(largest->timestamp == 9223372036854775807LL);
}

TEST_CASE("summary names time, host, ranks, pid, code, message and traceback") {
  FailureReport r;
  r.local_rank = 1;
  r.rank = 5;
  r.pid = 4242;
  r.status = ExitStatus::exited(7);
  r.time = std::chrono::system_clock::now();
  r.error_file = "/logs/x/attempt_0/1/error.json";
  r.error =
      ErrorFileContents{"ValueError: boom", "Traceback (most recent call last):\n  line 1\nValueError: boom\n", 1};
  const auto text = format_failure_summary("train.py", "node7", r, {});
  CHECK_THAT(text, Catch::Contains("train.py FAILED"));
  CHECK_THAT(text, Catch::Contains("Root Cause (first observed failure)"));
  CHECK_THAT(text, Catch::Contains("host       : node7"));
  CHECK_THAT(text, Catch::Contains("rank       : 5 (local_rank: 1)"));
  CHECK_THAT(text, Catch::Contains("exitcode   : 7 (pid: 4242)"));
  CHECK_THAT(text, Catch::Contains("error_file : /logs/x/attempt_0/1/error.json"));
  CHECK_THAT(text, Catch::Contains("message    : ValueError: boom"));
  CHECK_THAT(text, Catch::Contains("                 line 1"));  // traceback lines indented
  CHECK_THAT(text, Catch::Contains("<NO_OTHER_FAILURES>"));
}

TEST_CASE("summary spells out signals and missing error files") {
  FailureReport r;
  r.pid = 9;
  r.status = ExitStatus::killed(SIGSEGV);
  r.note = "error file could not be used: not valid JSON";
  const auto text = format_failure_summary("./train", "h", r, {r});
  CHECK_THAT(text, Catch::Contains("signal     : SIGSEGV (signal 11) (pid: 9, exit code 139)"));
  CHECK_THAT(text, Catch::Contains("error_file : <N/A>"));
  CHECK_THAT(text, Catch::Contains("note       : error file could not be used"));
  CHECK_THAT(text, Catch::Contains("[1]:"));  // the "other failures" list
}

TEST_CASE("summary lists the other failed ranks as [1], [2], ... before the root cause [0]") {
  FailureReport root;
  root.rank = 1;
  root.local_rank = 1;
  root.pid = 11;
  root.status = ExitStatus::exited(5);
  FailureReport second = root;
  second.rank = 2;
  second.local_rank = 2;
  second.pid = 12;
  second.status = ExitStatus::exited(4);
  second.cause = "failed on its own after the first failure (not ended by ddprun's teardown)";
  FailureReport third = second;
  third.rank = 6;
  third.pid = 13;
  third.host = "node9";  // another node's rank in a multi-node summary
  const auto text = format_failure_summary("train.py", "node7", root, {second, third});
  const auto failures = text.find("Failures:");
  const auto one = text.find("[1]:");
  const auto two = text.find("[2]:");
  const auto root_at = text.find("Root Cause (first observed failure):\n[0]:");
  REQUIRE(failures != std::string::npos);
  REQUIRE(root_at != std::string::npos);
  CHECK(failures < one);
  CHECK(one < two);
  CHECK(two < root_at);
  CHECK_THAT(text.substr(one, two - one), Catch::Contains("rank       : 2 (local_rank: 2)"));
  CHECK_THAT(text.substr(one, two - one), Catch::Contains("host       : node7"));
  CHECK_THAT(text.substr(two, root_at - two), Catch::Contains("host       : node9"));
  CHECK_THAT(text.substr(root_at), Catch::Contains("exitcode   : 5 (pid: 11)"));
  CHECK_THAT(text, !Catch::Contains("<NO_OTHER_FAILURES>"));
}

TEST_CASE("a diagnosis printed at the first failure is amended by the lines that changed since") {
  const std::vector<std::string> files = {"/run/x/attempt_0/0/stacks.txt"};
  const std::string printed = format_diagnosis_block(
      "node-a", "rank 3 failed first (exit code 7)", {},
      {"rank 3 (local 1, pid 11): exit code 7", "rank 2 (local 0, pid 10): in work at w.py:3 [faulthandler, 2.0 ms]"},
      files);
  CHECK(format_diagnosis_amendment(printed, printed).empty());
  CHECK(format_diagnosis_amendment("", printed).empty());  // nothing was printed: nothing to amend
  const std::string now = format_diagnosis_block(
      "node-a", "rank 3 failed first (exit code 7)", {},
      {"rank 3 (local 1, pid 11): exit code 7",
       "rank 2 (local 0, pid 10): failed on its own after the first failure (exit code 5); its stack a moment "
       "before: in work at w.py:3 [faulthandler, 2.0 ms]"},
      files);
  CHECK(format_diagnosis_amendment(printed, now) ==
        "Diagnosis (node-a), amended as more ranks ended:\n"
        "  rank 2 (local 0, pid 10): failed on its own after the first failure (exit code 5); its stack a moment "
        "before: in work at w.py:3 [faulthandler, 2.0 ms]\n");
}
