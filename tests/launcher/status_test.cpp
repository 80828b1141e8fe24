// `ddprun status`: argument parsing and the table, from plain RegistryStatus data.
#include <catch2/catch.hpp>

#include "ddprun/common/error.hpp"
#include "ddprun/common/strings.hpp"
#include "ddprun/launcher/status_command.hpp"

using namespace ddprun::launcher;
namespace rdzv = ddprun::rendezvous;
using Catch::Matchers::Contains;

TEST_CASE("status arguments") {
  auto r = parse_status_args({"--rdzv-endpoint", "127.0.0.1:5000", "--rdzv-id", "job7"}, {});
  CHECK(r.server == ddprun::Endpoint{"127.0.0.1", 5000});
  CHECK(r.run_id == "job7");
  r = parse_status_args({"--rdzv_endpoint=head", "--timeout", "0.5"}, {});
  CHECK(r.server == ddprun::Endpoint{"head", 29400});
  CHECK(r.run_id.empty());
  CHECK(r.timeout == std::chrono::milliseconds(500));
  r = parse_status_args({}, {{"PET_RDZV_ENDPOINT", "h:7"}, {"PET_RDZV_ID", "j"}});
  CHECK(r.server == ddprun::Endpoint{"h", 7});
  CHECK(r.run_id == "j");
  CHECK(r.alternates.empty());
  r = parse_status_args({"--rdzv-endpoint", "r1:5,r2"}, {});
  CHECK(r.server == ddprun::Endpoint{"r1", 5});
  CHECK(r.alternates == std::vector<ddprun::Endpoint>{{"r2", 29400}});
  CHECK_THROWS_WITH(parse_status_args({"--rdzv-endpoint", "r1:5,,r2"}, {}), Contains("empty endpoint"));
  CHECK(parse_status_args({"--help"}, {}).help);
  CHECK_THROWS_WITH(parse_status_args({}, {}), Contains("--rdzv-endpoint"));
  CHECK_THROWS_WITH(parse_status_args({"--bogus"}, {}), Contains("'--bogus'"));
  CHECK_THROWS_WITH(parse_status_args({"--rdzv-endpoint"}, {}), Contains("needs a value"));
  CHECK_THROWS_AS(parse_status_args({"--rdzv-endpoint", "h:99999"}, {}), ddprun::UsageError);
}

TEST_CASE("status table lists jobs, timers and members") {
  rdzv::RegistryStatus st;
  CHECK_THAT(format_status(st, "127.0.0.1:5000", ""), Contains("no jobs"));
  CHECK_THAT(format_status(st, "127.0.0.1:5000", "x"), Contains("no job 'x'"));
  rdzv::JobStatus job;
  job.run_id = "job7";
  job.state = rdzv::JobState::running;
  job.round = 2;
  job.min_nodes = 2;
  job.max_nodes = 4;
  job.restarts_used = 1;
  job.max_restarts = 3;
  job.exit_barrier_in = std::chrono::seconds(12);
  rdzv::MemberStatus m;
  m.id = {"127.0.0.2", 100, "aa"};
  m.addr = "127.0.0.2";
  m.local_world_size = 2;
  m.role = rdzv::MemberRole::participant;
  m.group_rank = 0;
  m.succeeded = true;
  job.members.push_back(m);
  m.id = {"127.0.0.3", 101, "bb"};
  m.addr = "127.0.0.3";
  m.group_rank = -1;
  m.role = rdzv::MemberRole::joined;
  m.succeeded = false;
  job.members.push_back(m);
  st.jobs.push_back(job);
  const auto text = format_status(st, "127.0.0.1:5000", "");
  CHECK_THAT(text, Contains("job 'job7': running, round 2, nodes 2:4, restarts 1/3"));
  CHECK_THAT(text, Contains("exit barrier in 12 s"));
  CHECK_THAT(text, Contains("participant"));
  CHECK_THAT(text, Contains("127.0.0.2"));
  CHECK_THAT(text, Contains("succeeded"));
  CHECK_THAT(text, Contains("127.0.0.3:101/bb"));
}

TEST_CASE("status shows a role or state a newer daemon named, as named") {
  rdzv::RegistryStatus st;
  rdzv::JobStatus job;
  job.run_id = "job7";
  job.state_name = "draining\x1b[2J";
  rdzv::MemberStatus m;
  m.id = {"127.0.0.2", 100, "aa"};
  m.role_name = "observer";
  job.members.push_back(m);
  st.jobs.push_back(job);
  const auto text = format_status(st, "127.0.0.1:5000", "");
  CHECK_THAT(text, Contains("job 'job7': draining\\x1b[2J, round 0"));
  CHECK_THAT(text, Contains(" observer "));
  CHECK(text.find('\x1b') == std::string::npos);
  const auto json = format_status_json(st, "127.0.0.1:5000", "", "");
  CHECK_THAT(json, Contains(R"("state":"draining\u001b[2J")"));
  CHECK_THAT(json, Contains(R"("role":"observer")"));
}

TEST_CASE("status text: what other clients sent cannot drive the terminal") {
  rdzv::RegistryStatus st;
  rdzv::JobStatus job;
  job.run_id = "job\x1b[31mRED\x1b]0;pwned\x07";
  job.result = "ok\r\nforged line";
  rdzv::MemberStatus m;
  m.id = {"h\x1b[2J", 100, "aa"};
  m.addr = "10.0.0.1\x9b";  // a lone byte: CSI to a Latin-1 terminal
  job.members.push_back(m);
  st.jobs.push_back(job);
  const auto text = format_status(st, "127.0.0.1:5000", "");
  CHECK(text.find('\x1b') == std::string::npos);
  CHECK(text.find('\x07') == std::string::npos);
  CHECK(text.find('\r') == std::string::npos);
  CHECK_THAT(text, Contains("job 'job\\x1b[31mRED\\x1b]0;pwned\\x07'"));
  CHECK_THAT(text, Contains("result: ok\\x0d\\x0aforged line\n"));
  CHECK_THAT(text, Contains("h\\x1b[2J:100/aa"));
  CHECK_THAT(text, Contains("10.0.0.1\\x9b"));
  CHECK(ddprun::terminal_safe("caf\xc3\xa9 \xc2\x9b x\\y") == "caf\xc3\xa9 \\u009b x\\\\y");
  // Bytes outside well-formed UTF-8 (a lone CSI for a Latin-1 terminal, a cut sequence, an
  // overlong form, a surrogate) are escaped one by one; a 4-byte character is kept.
  CHECK(ddprun::terminal_safe("a\x9b[2Jb") == "a\\x9b[2Jb");
  CHECK(ddprun::terminal_safe("\xe2\x82") == "\\xe2\\x82");
  CHECK(ddprun::terminal_safe("\xc0\xaf") == "\\xc0\\xaf");
  CHECK(ddprun::terminal_safe("\xed\xa0\x80") == "\\xed\\xa0\\x80");
  CHECK(ddprun::terminal_safe("\xf0\x9f\x98\x80") == "\xf0\x9f\x98\x80");
}

TEST_CASE("status --json and --watch arguments") {
  auto r = parse_status_args({"--rdzv-endpoint", "h:1", "--json", "--watch"}, {});
  CHECK(r.json);
  REQUIRE(r.watch);
  CHECK(*r.watch == std::chrono::seconds(2));
  CHECK(r.watch_count == 0);
  r = parse_status_args({"--rdzv-endpoint", "h:1", "--watch", "0.5", "--watch_count=3"}, {});
  CHECK(*r.watch == std::chrono::milliseconds(500));
  CHECK(r.watch_count == 3);
  r = parse_status_args({"--rdzv-endpoint", "h:1", "--watch=4"}, {});
  CHECK(*r.watch == std::chrono::seconds(4));
  CHECK_FALSE(parse_status_args({"--rdzv-endpoint", "h:1"}, {}).watch);
  CHECK_THROWS_WITH(parse_status_args({"--rdzv-endpoint", "h:1", "--watch-count", "2"}, {}), Contains("needs --watch"));
  CHECK_THROWS_WITH(parse_status_args({"--rdzv-endpoint", "h:1", "--watch", "0"}, {}), Contains("--watch=0"));
  CHECK_THROWS_WITH(parse_status_args({"--rdzv-endpoint", "h:1", "--json=yes"}, {}), Contains("takes no value"));
  CHECK_THROWS_WITH(parse_status_args({"--rdzv-endpoint", "h:1", "--watch", "1", "--watch-count", "0"}, {}),
                    Contains("--watch-count=0"));
}

TEST_CASE("status flag table drives the usage text") {
  const auto usage = status_usage();
  for (const auto& f : status_flags()) {
    CHECK_THAT(usage, Contains("--" + std::string(f.dash)));
    CHECK_FALSE(f.help.empty());
  }
  CHECK_THAT(usage, Contains("[env: PET_RDZV_ENDPOINT]"));
}

TEST_CASE("status JSON has stable field names") {
  rdzv::RegistryStatus st;
  CHECK(format_status_json(st, "h:1", "", "") == R"({"endpoint":"h:1","run_id":null,"jobs":[]})");
  rdzv::JobStatus job;
  job.run_id = "j\"1";
  job.state = rdzv::JobState::failed;
  job.join_timeout_in = std::chrono::milliseconds(1500);
  rdzv::RootCause cause;
  cause.failure.exit_code = 3;
  cause.failure.global_rank = 5;
  job.last_failure = cause;
  rdzv::MemberStatus m;
  m.id = {"10.0.0.2", 7, "ab"};
  m.group_rank = -1;
  m.disconnected = true;
  job.members.push_back(m);
  st.jobs.push_back(job);
  const auto text = format_status_json(st, "h:1", "j\"1", "2026-01-01T00:00:00Z");
  CHECK_THAT(text, Contains(R"("run_id":"j\"1")"));
  CHECK_THAT(text, Contains(R"("time":"2026-01-01T00:00:00Z")"));
  CHECK_THAT(text, Contains(R"("state":"failed")"));
  CHECK_THAT(text, Contains(R"("join_timeout":1.5)"));
  CHECK_THAT(text, Contains(R"("last_call":null)"));
  CHECK_THAT(text, Contains(R"("exit_code":3)"));
  CHECK_THAT(text, Contains(R"("signal":null)"));
  CHECK_THAT(text, Contains(R"("node":"10.0.0.2:7/ab")"));
  CHECK_THAT(text, Contains(R"("group_rank":null)"));
  CHECK_THAT(text, Contains(R"("state":"disconnected")"));
  CHECK(text.find('\n') == std::string::npos);
}

TEST_CASE("status arguments: the etcd backend") {
  auto r = parse_status_args({"--rdzv-backend", "etcd", "--rdzv-endpoint", "127.0.0.1:2379,h2", "--rdzv-conf",
                              "etcd_prefix=/jobs,username=u,password_file=pw", "--rdzv-id", "job7"},
                             {});
  REQUIRE(r.etcd);
  CHECK(r.etcd->endpoints.size() == 2);
  CHECK(r.etcd->prefix == "/jobs/");
  CHECK(r.etcd->username == "u");
  CHECK(r.etcd_password_file == "pw");
  CHECK(r.run_id == "job7");
  CHECK(parse_status_args({"--rdzv-backend=etcd-v2", "--rdzv-endpoint=https://h:1"}, {}).etcd->tls);
  CHECK_FALSE(parse_status_args({"--rdzv-endpoint", "h:1"}, {}).etcd);
  CHECK_THROWS_WITH(parse_status_args({"--rdzv-endpoint", "h:1", "--rdzv-conf", "username=u"}, {}),
                    Contains("only to --rdzv-backend etcd"));
  CHECK_THROWS_WITH(
      parse_status_args({"--rdzv-backend", "etcd", "--rdzv-endpoint", "h", "--rdzv-conf", "join_timeout=3"}, {}),
      Contains("'join_timeout' does not apply"));
  CHECK_THROWS_WITH(parse_status_args({"--rdzv-backend", "static", "--rdzv-endpoint", "h"}, {}),
                    Contains("c10d or etcd"));
}
