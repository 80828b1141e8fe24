// run_agent with real processes: each test forks a child that runs the agent (so its signal
// handling and exit never touch the test runner) with ddprun_test_worker as the workload.
// Waits are bounded and event-driven: pidfd + poll for exits, inotify for ready files.
#include <fcntl.h>
#include <poll.h>
#include <sys/inotify.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <unistd.h>

#include <boost/json.hpp>
#include <catch2/catch.hpp>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

#include "ddprun/agent/agent.hpp"
#include "ddprun/common/error.hpp"
#include "ddprun/common/logging.hpp"
#include "../helpers/scoped_env.hpp"

using namespace ddprun::agent;
namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace {

struct TempDir {
  TempDir() {
    std::string t = (std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp") + std::string("/ddprun_agent_test_XXXXXX");
    REQUIRE(::mkdtemp(t.data()) != nullptr);
    path = t;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string operator/(const std::string& name) const { return path + "/" + name; }
  std::string path;
};

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

int pidfd_open(pid_t pid) { return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)); }

// True when `pid` has exited (or is gone) within `timeout`.
bool wait_gone(pid_t pid, std::chrono::milliseconds timeout) {
  const int fd = pidfd_open(pid);
  if (fd < 0) {
    return errno == ESRCH;
  }
  pollfd p{fd, POLLIN, 0};
  const int r = ::poll(&p, 1, static_cast<int>(timeout.count()));
  ::close(fd);
  return r == 1;
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// Waits for every path (inotify on their directory; no sleeps).
bool wait_files(const std::string& dir, const std::vector<std::string>& paths, std::chrono::milliseconds timeout) {
  const int fd = ::inotify_init1(IN_CLOEXEC);
  REQUIRE(fd >= 0);
  ::inotify_add_watch(fd, dir.c_str(), IN_CREATE | IN_MOVED_TO);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto all = [&] {
    for (const auto& p : paths) {
      if (!exists(p)) {
        return false;
      }
    }
    return true;
  };
  bool ok = all();
  while (!ok && std::chrono::steady_clock::now() < deadline) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(std::max<long>(left.count(), 1))) > 0) {
      char buf[4096];
      (void)!::read(fd, buf, sizeof(buf));
    }
    ok = all();
  }
  ::close(fd);
  return ok;
}

struct AgentRun {
  pid_t pid = -1;
  std::string out;  // file with the agent's stdout
  std::string err;  // file with the agent's stderr
};

AgentRun start_agent(const AgentConfig& config, const TempDir& dir) {
  AgentRun run;
  run.out = dir / "agent.out";
  run.err = dir / "agent.err";
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    const int o = ::open(run.out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int e = ::open(run.err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(o, 1);
    ::dup2(e, 2);
    ddprun::setup_logging("ddprun", spdlog::level::info);  // as the launcher does: logs on stderr
    int code = 0;
    try {
      code = run_agent(config);
    } catch (const std::exception& ex) {
      ::dprintf(2, "agent threw: %s\n", ex.what());
      code = 250;
    }
    ::_exit(code);
  }
  run.pid = pid;
  return run;
}

// The agent's exit code (128+signal if it died by one); fails the test after `timeout`.
int wait_agent(const AgentRun& run, std::chrono::milliseconds timeout = 20s) {
  if (!wait_gone(run.pid, timeout)) {
    ::kill(run.pid, SIGKILL);
    ::waitpid(run.pid, nullptr, 0);
    FAIL("agent did not finish within " << timeout.count() << " ms; stderr:\n" << slurp(run.err));
  }
  int status = 0;
  REQUIRE(::waitpid(run.pid, &status, 0) == run.pid);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

AgentConfig make_config(const TempDir& dir, int nproc, std::vector<std::string> args) {
  AgentConfig c;
  c.worker_argv = {DDPRUN_TEST_WORKER};
  c.worker_argv.insert(c.worker_argv.end(), args.begin(), args.end());
  c.nproc_per_node = nproc;
  c.standalone = true;
  c.master_port = 0;
  c.run_id = "t";
  c.log_dir = dir / "logs";
  c.shutdown_timeout = 3s;
  return c;
}

boost::json::object read_json(const std::string& path) {
  const auto text = slurp(path);
  INFO(path << ": " << text);
  return boost::json::parse(text).as_object();
}

std::string env_of(const boost::json::object& env, const char* name) {
  const auto* v = env.if_contains(name);
  return v == nullptr ? std::string("<unset>") : std::string(v->as_string().c_str());
}

// The single job dir under <log_dir> (<run_id>_<random>).
std::string job_dir(const TempDir& dir) {
  std::vector<std::string> found;
  for (const auto& e : fs::directory_iterator(dir / "logs")) {
    found.push_back(e.path().string());
  }
  REQUIRE(found.size() == 1);
  return found.front();
}

pid_t read_pid(const std::string& path) { return static_cast<pid_t>(std::stol(slurp(path))); }

}  // namespace

TEST_CASE("every rank gets its environment; the agent store is reachable") {
  TempDir dir;
  const ScopedEnv parent_var("DDPRUN_TEST_PARENT_VAR", "inherited");
  const ScopedEnv no_omp("OMP_NUM_THREADS", nullptr);
  auto c = make_config(dir, 3, {"--dump-env", dir / "env_%r.json", "--store-check"});
  const auto run = start_agent(c, dir);
  REQUIRE(wait_agent(run) == 0);
  const auto job = job_dir(dir);
  CHECK_THAT(fs::path(job).filename().string(), Catch::StartsWith("t_"));
  std::string port;
  for (int r = 0; r < 3; ++r) {
    const auto env = read_json(dir / ("env_" + std::to_string(r) + ".json"));
    CHECK(env_of(env, "RANK") == std::to_string(r));
    CHECK(env_of(env, "LOCAL_RANK") == std::to_string(r));
    CHECK(env_of(env, "WORLD_SIZE") == "3");
    CHECK(env_of(env, "LOCAL_WORLD_SIZE") == "3");
    CHECK(env_of(env, "GROUP_RANK") == "0");
    CHECK(env_of(env, "TORCHELASTIC_USE_AGENT_STORE") == "True");
    CHECK(env_of(env, "TORCHELASTIC_RESTART_COUNT") == "0");
    CHECK(env_of(env, "TORCHELASTIC_RUN_ID") == "t");
    CHECK(env_of(env, "TORCHELASTIC_ERROR_FILE") == job + "/attempt_0/" + std::to_string(r) + "/error.json");
    CHECK(env_of(env, "OMP_NUM_THREADS") == "1");
    CHECK(env_of(env, "DDPRUN_TEST_PARENT_VAR") == "inherited");
    CHECK(env_of(env, "MASTER_ADDR") == "127.0.0.1");
    if (r == 0) {
      port = env_of(env, "MASTER_PORT");
      CHECK(port != "0");
    } else {
      CHECK(env_of(env, "MASTER_PORT") == port);  // one store for the whole group
    }
  }
  // Three workers each ADDed 1 to the same key in the agent's store.
  const auto out = slurp(run.out);
  CHECK_THAT(out, Catch::Contains("store-check ok 1"));
  CHECK_THAT(out, Catch::Contains("store-check ok 2"));
  CHECK_THAT(out, Catch::Contains("store-check ok 3"));
}

TEST_CASE("the failing worker's exit code is ddprun's exit code, with a root-cause summary") {
  TempDir dir;
  auto c = make_config(dir, 2, {"--only-rank", "1", "--exit", "7"});
  const auto run = start_agent(c, dir);
  CHECK(wait_agent(run) == 7);
  const auto err = slurp(run.err);
  CHECK_THAT(err, Catch::Contains("Root Cause (first observed failure)"));
  CHECK_THAT(err, Catch::Contains("rank       : 1 (local_rank: 1)"));
  CHECK_THAT(err, Catch::Contains("exitcode   : 7"));
}

TEST_CASE("a worker killed by SIGSEGV gives 139 and names the signal") {
  TempDir dir;
  auto c = make_config(dir, 1, {"--signal-self", "11"});
  const auto run = start_agent(c, dir);
  CHECK(wait_agent(run) == 139);
  CHECK_THAT(slurp(run.err), Catch::Contains("SIGSEGV (signal 11)"));
}

TEST_CASE("restarts with an incremented restart count and a fresh store, then succeeds") {
  TempDir dir;
  auto c = make_config(dir, 2,
                       {"--dump-env", dir / "env_%r_%a.json", "--store-check", "--fail-on-attempt", "0", "--only-rank",
                        "0", "--exit", "5"});
  c.max_restarts = 2;
  const auto run = start_agent(c, dir);
  REQUIRE(wait_agent(run) == 0);
  for (int r = 0; r < 2; ++r) {
    CHECK(env_of(read_json(dir / ("env_" + std::to_string(r) + "_1.json")), "TORCHELASTIC_RESTART_COUNT") == "1");
    CHECK(env_of(read_json(dir / ("env_" + std::to_string(r) + "_1.json")), "TORCHELASTIC_MAX_RESTARTS") == "2");
  }
  // Rank 1 may be stopped by the SIGTERM before its attempt-0 dump; rank 0 dumps, then fails.
  CHECK(env_of(read_json(dir / "env_0_0.json"), "TORCHELASTIC_RESTART_COUNT") == "0");
  CHECK_FALSE(exists(dir / "env_0_2.json"));
  const auto job = job_dir(dir);
  CHECK(exists(job + "/attempt_0/1"));
  CHECK(exists(job + "/attempt_1/1"));
  CHECK_THAT(slurp(run.err), Catch::Contains("restarting worker group (attempt 1 of 2)"));
  // store.reset() between attempts: the counter starts again, so "ok 1" appears in attempt 1 too
  // and no count above 2 is ever seen.
  const auto out = slurp(run.out);
  CHECK_THAT(out, !Catch::Contains("store-check ok 3"));
}

TEST_CASE("the restart budget is spent: last failure's code") {
  TempDir dir;
  auto c = make_config(dir, 1, {"--exit", "4"});
  c.max_restarts = 1;
  const auto run = start_agent(c, dir);
  CHECK(wait_agent(run) == 4);
  const auto job = job_dir(dir);
  CHECK(exists(job + "/attempt_1"));
  CHECK_FALSE(exists(job + "/attempt_2"));
}

TEST_CASE("a worker ignoring SIGTERM is SIGKILLed after the shutdown timeout") {
  TempDir dir;
  auto c = make_config(dir, 2,
                       {"--ignore-sigterm", "--ready-file", dir / "ready_%r", "--wait-file", dir / "ready_0",
                        "--sleep-ms", "60000", "--only-rank", "1", "--exit", "3", "--gated-no-sleep"});
  c.shutdown_timeout = 300ms;
  const auto t0 = std::chrono::steady_clock::now();
  const auto run = start_agent(c, dir);
  CHECK(wait_agent(run, 10s) == 3);
  const auto elapsed = std::chrono::steady_clock::now() - t0;
  CHECK(elapsed >= 300ms);
  CHECK(elapsed < 5s);
  CHECK_THAT(slurp(run.err), Catch::Contains("did not stop within 300 ms: sending SIGKILL"));
  CHECK(wait_gone(read_pid(dir / "ready_0"), 2s));
}

TEST_CASE("SIGINT to the agent is forwarded to the workers; the agent exits 130") {
  TempDir dir;
  auto c = make_config(dir, 2, {"--ready-file", dir / "ready_%r", "--sleep-ms", "60000"});
  c.max_restarts = 3;  // a signal never restarts
  const auto run = start_agent(c, dir);
  REQUIRE(wait_files(dir.path, {dir / "ready_0", dir / "ready_1"}, 10s));
  const pid_t w0 = read_pid(dir / "ready_0");
  const pid_t w1 = read_pid(dir / "ready_1");
  REQUIRE(::kill(run.pid, SIGINT) == 0);
  CHECK(wait_agent(run, 10s) == 130);
  CHECK(wait_gone(w0, 2s));
  CHECK(wait_gone(w1, 2s));
  CHECK_FALSE(exists(job_dir(dir) + "/attempt_1"));
}

TEST_CASE("kill -9 of the agent leaves no worker alive") {
  TempDir dir;
  auto c = make_config(dir, 3, {"--ready-file", dir / "ready_%r", "--sleep-ms", "60000", "--ignore-sigterm"});
  const auto run = start_agent(c, dir);
  REQUIRE(wait_files(dir.path, {dir / "ready_0", dir / "ready_1", dir / "ready_2"}, 10s));
  std::vector<pid_t> workers;
  for (int r = 0; r < 3; ++r) {
    workers.push_back(read_pid(dir / ("ready_" + std::to_string(r))));
    REQUIRE(::kill(workers.back(), 0) == 0);
  }
  REQUIRE(::kill(run.pid, SIGKILL) == 0);
  CHECK(wait_agent(run, 5s) == 128 + SIGKILL);
  for (pid_t w : workers) {
    INFO("worker pid " << w);
    CHECK(wait_gone(w, 5s));  // PR_SET_PDEATHSIG
  }
}

TEST_CASE("tee: files per attempt and rank, prefixed whole lines on the console") {
  TempDir dir;
  auto c = make_config(dir, 2, {"--print-lines", "3", "--long-line", "100000", "--partial", "tail-no-newline"});
  c.tee_all = Streams::both;
  const auto run = start_agent(c, dir);
  REQUIRE(wait_agent(run) == 0);
  const auto job = job_dir(dir);
  for (int r = 0; r < 2; ++r) {
    const std::string rs = std::to_string(r);
    const auto out_file = slurp(job + "/attempt_0/" + rs + "/stdout.log");
    const auto err_file = slurp(job + "/attempt_0/" + rs + "/stderr.log");
    // Files hold the raw bytes: no prefix, nothing added, the partial line as written.
    CHECK_THAT(out_file, Catch::StartsWith("rank " + rs + " line 0 stdout\nrank " + rs + " line 1 stdout\n"));
    CHECK_THAT(out_file, Catch::Contains(std::string(100000, 'x') + "\ntail-no-newline"));
    CHECK_THAT(out_file, Catch::EndsWith("tail-no-newline"));
    CHECK(err_file == "rank " + rs + " line 0 stderr\nrank " + rs + " line 1 stderr\nrank " + rs + " line 2 stderr\n");
  }
  const auto console = slurp(run.out);
  const auto console_err = slurp(run.err);
  CHECK_THAT(console, Catch::Contains("[default0]:rank 0 line 2 stdout\n"));
  CHECK_THAT(console, Catch::Contains("[default1]:rank 1 line 0 stdout\n"));
  CHECK_THAT(console, Catch::Contains("[default1]:tail-no-newline\n"));
  CHECK_THAT(console_err, Catch::Contains("[default0]:rank 0 line 1 stderr\n"));
  // Every console line starts with a prefix: ranks never interleave mid-line, and the long
  // line was cut at the pump capacity with the prefix repeated.
  std::istringstream lines(console);
  std::string line;
  int long_pieces = 0;
  while (std::getline(lines, line)) {
    if (line.find("store") != std::string::npos || line.find("ddprun") != std::string::npos ||
        line.find("log directory") != std::string::npos) {
      continue;  // the agent's own log lines
    }
    INFO(line.substr(0, 80));
    CHECK((line.rfind("[default0]:", 0) == 0 || line.rfind("[default1]:", 0) == 0));
    if (line.find("xxxx") != std::string::npos) {
      ++long_pieces;
      CHECK(line.find_first_not_of('x', 11) == std::string::npos);
    }
  }
  CHECK(long_pieces >= 4);  // 2 ranks x (100000 / 65536 rounded up)
}

TEST_CASE("custom prefix template with the global rank") {
  TempDir dir;
  auto c = make_config(dir, 2, {"--print-lines", "1"});
  c.tee_all = Streams::out;
  c.log_line_prefix_template = "<${role_name}|${rank}> ";
  c.role = "trainer";
  const auto run = start_agent(c, dir);
  REQUIRE(wait_agent(run) == 0);
  CHECK_THAT(slurp(run.out), Catch::Contains("<trainer|1> rank 1 line 0 stdout\n"));
  // stderr not tee'd: inherited, unprefixed.
  CHECK_THAT(slurp(run.err), Catch::Contains("rank 1 line 0 stderr\n"));
  CHECK_THAT(slurp(run.err), !Catch::Contains("<trainer|1> rank 1 line 0 stderr"));
}

TEST_CASE("redirects: output only in files") {
  TempDir dir;
  auto c = make_config(dir, 2, {"--print-lines", "2"});
  c.redirects_all = Streams::both;
  const auto run = start_agent(c, dir);
  REQUIRE(wait_agent(run) == 0);
  CHECK_THAT(slurp(run.out), !Catch::Contains("line 0 stdout"));
  CHECK_THAT(slurp(run.err), !Catch::Contains("line 0 stderr"));
  const auto job = job_dir(dir);
  CHECK(slurp(job + "/attempt_0/1/stdout.log") == "rank 1 line 0 stdout\nrank 1 line 1 stdout\n");
  CHECK(slurp(job + "/attempt_0/0/stderr.log") == "rank 0 line 0 stderr\nrank 0 line 1 stderr\n");
}

TEST_CASE("local_ranks_filter limits the console, files keep everything") {
  TempDir dir;
  auto c = make_config(dir, 3, {"--print-lines", "1"});
  c.tee_all = Streams::both;
  c.local_ranks_filter = std::set<int>{1};
  const auto run = start_agent(c, dir);
  REQUIRE(wait_agent(run) == 0);
  const auto console = slurp(run.out);
  CHECK_THAT(console, Catch::Contains("[default1]:rank 1 line 0 stdout"));
  CHECK_THAT(console, !Catch::Contains("rank 0 line 0"));
  CHECK_THAT(console, !Catch::Contains("rank 2 line 0"));
  const auto job = job_dir(dir);
  for (int r = 0; r < 3; ++r) {
    CHECK(slurp(job + "/attempt_0/" + std::to_string(r) + "/stdout.log") ==
          "rank " + std::to_string(r) + " line 0 stdout\n");
  }
}

TEST_CASE("local_ranks_filter without tee keeps filtered ranks' output in their files") {
  TempDir dir;
  auto c = make_config(dir, 2, {"--print-lines", "1"});
  c.local_ranks_filter = std::set<int>{0};
  const auto run = start_agent(c, dir);
  REQUIRE(wait_agent(run) == 0);
  const auto console = slurp(run.out);
  CHECK_THAT(console, Catch::Contains("rank 0 line 0 stdout"));
  CHECK_THAT(console, !Catch::Contains("rank 1 line 0 stdout"));
  CHECK(slurp(job_dir(dir) + "/attempt_0/1/stdout.log") == "rank 1 line 0 stdout\n");
}

TEST_CASE("the summary shows the worker's error file message and traceback") {
  TempDir dir;
  auto c = make_config(dir, 2, {"--write-error-file", "ValueError: boom", "--only-rank", "0", "--exit", "1"});
  const auto run = start_agent(c, dir);
  CHECK(wait_agent(run) == 1);
  const auto err = slurp(run.err);
  CHECK_THAT(err, Catch::Contains("message    : ValueError: boom"));
  CHECK_THAT(err, Catch::Contains("Traceback (most recent call last):"));
  CHECK_THAT(err, Catch::Contains("/attempt_0/0/error.json"));
}

TEST_CASE("an unparsable error file does not crash the agent") {
  TempDir dir;
  auto c = make_config(dir, 1, {"--error-file-raw", "{not json", "--exit", "2"});
  const auto run = start_agent(c, dir);
  CHECK(wait_agent(run) == 2);
  const auto err = slurp(run.err);
  CHECK_THAT(err, Catch::Contains("could not be used: not valid JSON"));
  CHECK_THAT(err, Catch::Contains("exitcode   : 2"));
}

TEST_CASE("legacy --local_rank argument") {
  TempDir dir;
  auto c = make_config(dir, 2, {});
  c.local_rank_arg = AgentConfig::LocalRankArg::underscore;
  const auto run = start_agent(c, dir);
  REQUIRE(wait_agent(run) == 0);
  CHECK_THAT(slurp(run.out), Catch::Contains("got --local_rank=1"));
  CHECK_THAT(slurp(run.out), Catch::Contains("got --local_rank=0"));
}

TEST_CASE("a worker exiting 0 early keeps the group running") {
  TempDir dir;
  auto c = make_config(dir, 2, {"--only-rank", "0", "--gated-no-sleep", "--sleep-ms", "300"});
  const auto t0 = std::chrono::steady_clock::now();
  const auto run = start_agent(c, dir);
  REQUIRE(wait_agent(run) == 0);
  CHECK(std::chrono::steady_clock::now() - t0 >= 300ms);
}

TEST_CASE("configuration errors are thrown before anything starts") {
  TempDir dir;
  SECTION("multi-node with --standalone") {
    auto c = make_config(dir, 1, {});
    c.standalone = true;
    c.max_nodes = 2;
    CHECK_THROWS_WITH(run_agent(c), Catch::Contains("--standalone runs a single-node job"));
  }
  SECTION("c10d without an endpoint") {
    auto c = make_config(dir, 1, {});
    c.standalone = false;
    c.rdzv_backend = "c10d";
    c.max_nodes = 2;
    CHECK_THROWS_WITH(run_agent(c), Catch::Contains("--rdzv-endpoint"));
  }
  SECTION("static multi-node without a fixed master port") {
    auto c = make_config(dir, 1, {});
    c.standalone = false;
    c.max_nodes = 2;
    c.master_port = 0;
    CHECK_THROWS_WITH(run_agent(c), Catch::Contains("--master-port"));
  }
  SECTION("invalid rendezvous timers") {
    auto c = make_config(dir, 1, {});
    c.standalone = false;
    c.rdzv_backend = "c10d";
    c.rdzv_endpoint = "127.0.0.1:1";
    c.rdzv.missed_heartbeats = 0;
    CHECK_THROWS_WITH(run_agent(c), Catch::Contains("missed_heartbeats"));
  }
  SECTION("missing worker program") {
    auto c = make_config(dir, 1, {});
    c.worker_argv = {"ddprun-no-such-program-xyz"};
    CHECK_THROWS_WITH(run_agent(c), Catch::Contains("'ddprun-no-such-program-xyz' was not found on PATH"));
  }
  SECTION("master port in use") {
    const int s = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
    REQUIRE(::listen(s, 1) == 0);
    socklen_t len = sizeof(addr);
    ::getsockname(s, reinterpret_cast<sockaddr*>(&addr), &len);
    auto c = make_config(dir, 1, {});
    c.standalone = false;
    c.master_port = ntohs(addr.sin_port);
    const std::string where = "127.0.0.1:" + std::to_string(c.master_port);
    CHECK_THROWS_WITH(run_agent(c), Catch::Contains(where) && Catch::Contains("--master-port 0"));
    ::close(s);
  }
}

TEST_CASE("dry run prints argv, env and cwd per rank without starting anything") {
  TempDir dir;
  auto c = make_config(dir, 2, {"--exit", "1"});
  c.local_rank_arg = AgentConfig::LocalRankArg::dash;
  c.user_args_index = 1;  // after the program, before its own arguments (torch.distributed.launch)
  c.working_dir = dir.path;
  std::ostringstream out;
  print_dry_run(c, out);
  const auto text = out.str();
  CHECK_THAT(text, Catch::Contains("local rank 1:"));
  CHECK_THAT(text, Catch::Contains(std::string(DDPRUN_TEST_WORKER) + " --local-rank=1 --exit 1"));
  CHECK_THAT(text, Catch::Contains("    RANK=1\n"));
  CHECK_THAT(text, Catch::Contains("MASTER_PORT=<chosen at launch>"));
  CHECK_THAT(text, Catch::Contains("cwd: " + dir.path));
  CHECK_FALSE(exists(dir / "logs"));  // nothing created
}

namespace {

// Processes whose environment holds `marker` (NAME=VALUE), i.e. descendants of a test's agent.
std::vector<pid_t> processes_with_env(const std::string& marker) {
  std::vector<pid_t> found;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) {
      continue;
    }
    const std::string env_text = slurp(e.path().string() + "/environ");
    if (env_text.find(marker + '\0') != std::string::npos || env_text.find('\0' + marker) != std::string::npos) {
      found.push_back(static_cast<pid_t>(std::stol(name)));
    }
  }
  return found;
}

bool is_hex_id(const std::string& s) {
  return s.size() == 256 && s.find_first_not_of("0123456789abcdef") == std::string::npos;
}

}  // namespace

TEST_CASE("NCCL unique ID: one per attempt, the same for every rank, holder gone after exit") {
  TempDir dir;
  auto c = make_config(
      dir, 2, {"--dump-env", dir / "env_%r_%a.json", "--fail-on-attempt", "0", "--only-rank", "0", "--exit", "5"});
  c.max_restarts = 1;
  c.nccl_id = AgentConfig::NcclIdMode::env;
  c.nccl_id_holder = DDPRUN_NCCL_ID_HOLDER;
  // Inherited by the agent, its holder and its workers.
  const std::string tag = fs::path(dir.path).filename().string();
  const std::string marker = "DDPRUN_NCCL_TEST_MARKER=" + tag;
  const ScopedEnv marker_env("DDPRUN_NCCL_TEST_MARKER", tag.c_str());
  const auto run = start_agent(c, dir);
  REQUIRE(wait_agent(run) == 0);
  // Attempt 0: rank 0 dumps before failing (rank 1 may be stopped before its dump).
  const auto first = env_of(read_json(dir / "env_0_0.json"), "DDPRUN_NCCL_UNIQUE_ID");
  const auto r0 = env_of(read_json(dir / "env_0_1.json"), "DDPRUN_NCCL_UNIQUE_ID");
  const auto r1 = env_of(read_json(dir / "env_1_1.json"), "DDPRUN_NCCL_UNIQUE_ID");
  CHECK(is_hex_id(first));
  CHECK(is_hex_id(r0));
  CHECK(r0 == r1);                                                                        // one ID for the whole group
  CHECK(first != r0);                                                                     // a fresh ID for the restart
  CHECK(env_of(read_json(dir / "env_0_1.json"), "DDPRUN_NCCL_UNIQUE_IDS") == "<unset>");  // one root
  // The agent is gone, and so is every process it started (workers and holders).
  CHECK(processes_with_env(marker).empty());
}

TEST_CASE("NCCL unique ID: --nccl-id env without NCCL is an error, auto continues without it") {
  TempDir dir;
  const ScopedEnv library("DDPRUN_NCCL_LIBRARY", (dir / "no-such-libnccl.so").c_str());
  auto c = make_config(dir, 1, {"--dump-env", dir / "env_%r.json"});
  c.nccl_id_holder = DDPRUN_NCCL_ID_HOLDER;
  c.nccl_id = AgentConfig::NcclIdMode::env;
  const auto failed = start_agent(c, dir);
  const int failed_code = wait_agent(failed);
  const std::string failed_err = slurp(failed.err);
  const bool started_worker = exists(dir / "env_0.json");
  c.nccl_id = AgentConfig::NcclIdMode::automatic;
  // A device named (on a CPU-only machine: leaked into it), so that the reason is said at the
  // default level (a plain CPU-only machine says it at debug level, gpu_cli_test.py).
  std::optional<ScopedEnv> cvd;
  cvd.emplace("CUDA_VISIBLE_DEVICES", "0");
  const auto run = start_agent(c, dir);
  const int code = wait_agent(run);
  cvd.reset();
  CHECK(failed_code == 250);  // run_agent threw (the launcher maps ddprun::Error to exit 1)
  CHECK_THAT(failed_err, Catch::Contains("--nccl-id env"));
  CHECK_FALSE(started_worker);  // the error comes before any worker starts
  REQUIRE(code == 0);
  CHECK(env_of(read_json(dir / "env_0.json"), "DDPRUN_NCCL_UNIQUE_ID") == "<unset>");
  CHECK_THAT(slurp(run.err), Catch::Contains("--nccl-id auto: not exporting DDPRUN_NCCL_UNIQUE_ID"));
}

TEST_CASE("without --log-dir the run directory under TMPDIR is removed unless it holds a file to read") {
  TempDir dir;
  const std::string tmp = (dir / "tmp");
  std::filesystem::create_directories(tmp);
  const ScopedEnv tmpdir("TMPDIR", tmp.c_str());
  auto count = [&] {
    return std::distance(std::filesystem::directory_iterator(tmp), std::filesystem::directory_iterator());
  };
  SECTION("a failed run without files leaves nothing") {
    auto c = make_config(dir, 2, {"--exit", "3"});
    c.log_dir.reset();
    c.stacks = false;  // else the other rank's stacks, when it is still running, are a file worth keeping
    CHECK(wait_agent(start_agent(c, dir)) == 3);
    CHECK(count() == 0);
  }
  SECTION("a failed run whose worker wrote an error file keeps it for the summary") {
    auto c = make_config(dir, 1, {"--write-error-file", "boom", "--exit", "2"});
    c.log_dir.reset();
    CHECK(wait_agent(start_agent(c, dir)) == 2);
    REQUIRE(count() == 1);
    // A native rank without log files: the flat layout (job_dir.hpp), one directory per job.
    const auto job = fs::directory_iterator(tmp)->path();
    CHECK(fs::is_regular_file(job / "attempt_0.0.error.json"));
    CHECK_FALSE(fs::exists(job / "attempt_0"));
  }
  SECTION("the flat layout still gets a rank directory for native stacks (eu-stack)") {
    if (!exists("/usr/bin/eu-stack")) {
      WARN("eu-stack (elfutils) is not installed: nothing to check");
    } else {
      // Rank 0 fails at once; rank 1 is still running, so its native stacks are collected.
      auto c = make_config(dir, 2, {"--only-rank", "0", "--exit", "3", "--sleep-ms", "20000", "--gated-no-sleep"});
      c.log_dir.reset();
      CHECK(wait_agent(start_agent(c, dir)) == 3);
      REQUIRE(count() == 1);
      const auto job = fs::directory_iterator(tmp)->path();
      INFO(slurp(dir / "agent.err"));
      CHECK(fs::file_size(job / "attempt_0" / "1" / "stacks-native.txt") > 0);
      CHECK_FALSE(fs::exists(job / "attempt_0" / "0"));  // no directory for the rank that had nothing to write
    }
  }
}
