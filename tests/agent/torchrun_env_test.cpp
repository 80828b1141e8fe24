// torch's agent environment on the agent side: the file timer (FileTimerClient's JSON lines,
// torch's expiry rules, a real FIFO), the health endpoint's answer, the event log's line and the
// entry-point name of the failure summary.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <spdlog/sinks/ringbuffer_sink.h>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <boost/json.hpp>
#include <algorithm>
#include <catch2/catch.hpp>
#include <cctype>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <future>
#include <string>
#include <thread>

#include "ddprun/common/console.hpp"
#include "ddprun/agent/duplicate_filter.hpp"
#include "ddprun/agent/entrypoint.hpp"
#include "ddprun/agent/event_log.hpp"
#include "ddprun/agent/file_timer.hpp"
#include "ddprun/agent/health_endpoint.hpp"

using namespace ddprun::agent;
using Catch::Matchers::Contains;

namespace {
double unix_now() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }
}  // namespace

TEST_CASE("file timer: FileTimerClient's JSON line") {
  // As torch's FileTimerRequest.to_json writes it.
  const auto r = parse_timer_request(
      R"({"version": 1, "pid": 4242, "scope_id": "train_step", "expiration_time": 1700000000.25, "signal": 9})");
  REQUIRE(r);
  CHECK(r->pid == 4242);
  CHECK(r->scope_id == "train_step");
  CHECK(r->expiration_time == Approx(1700000000.25));
  CHECK(r->signal == 9);
  const auto release = parse_timer_request(R"({"version":1,"pid":7,"scope_id":"s","expiration_time":-1,"signal":0})");
  REQUIRE(release);
  CHECK(release->expiration_time < 0);
  std::string problem;
  CHECK_FALSE(parse_timer_request("not json", &problem));
  CHECK_THAT(problem, Contains("not valid JSON"));
  CHECK_FALSE(parse_timer_request(R"({"pid": 1, "expiration_time": 1})", &problem));
  CHECK_THAT(problem, Contains("scope_id"));
  CHECK_FALSE(parse_timer_request(R"({"pid": -3, "scope_id": "s", "expiration_time": 1})", &problem));
  CHECK_THAT(problem, Contains("pid"));
}

TEST_CASE("file timer: torch's rules for acquire, release and expiry") {
  FileTimerTable t;
  t.apply({1, 100, "a", 10.0, 0});
  t.apply({1, 100, "b", 12.0, 15});
  t.apply({1, 100, "c", 11.0, 9});
  t.apply({1, 200, "x", 20.0, 9});
  t.apply({1, 300, "y", 5.0, 9});
  t.apply({1, 300, "y", -1, 0});  // released
  CHECK(t.size() == 4);
  CHECK(t.next_deadline() == Approx(10.0));
  CHECK(t.take_expired(9.0).empty());
  const auto reaped = t.take_expired(12.0);
  REQUIRE(reaped.size() == 1);
  CHECK(reaped[0].pid == 100);
  CHECK(reaped[0].signal == 9);  // the earliest expired timer with a signal > 0 ("c"), not "a" (0)
  CHECK(reaped[0].scope_id == "c");
  CHECK(t.size() == 1);  // every timer of pid 100 is gone
  CHECK(t.next_deadline() == Approx(20.0));
  t.apply({1, 400, "quiet", 1.0, 0});
  const auto quiet = t.take_expired(21.0);
  REQUIRE(quiet.size() == 2);
  CHECK(quiet[1].pid == 400);
  CHECK(quiet[1].signal == 0);  // expired without a signal: not killed
}

TEST_CASE("file timer: a real FIFO, a writer, and the kill at the deadline") {
  namespace fs = std::filesystem;
  const fs::path path = fs::temp_directory_path() / ("ddprun_timer_test_" + std::to_string(::getpid()));
  boost::asio::io_context io;
  pid_t killed = 0;
  int signal_sent = 0;
  {
    FileTimerServer server(io, path.string(), [&](pid_t pid, int sig) {
      killed = pid;
      signal_sent = sig;
      io.stop();
      return true;
    });
    server.start();
    CHECK(fs::is_fifo(path));
    // A client opens the FIFO non-blocking (FileTimerClient does): the server's reader is there.
    const int fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
    REQUIRE(fd >= 0);
    const std::string lines = R"({"version": 1, "pid": 31337, "scope_id": "later", "expiration_time": )" +
                              std::to_string(unix_now() + 300) +
                              R"(, "signal": 9})"
                              "\n"
                              R"({"version": 1, "pid": 31338, "scope_id": "now", "expiration_time": )" +
                              std::to_string(unix_now() + 0.2) +
                              R"(, "signal": 15})"
                              "\n";
    REQUIRE(::write(fd, lines.data(), lines.size()) == static_cast<ssize_t>(lines.size()));
    ::close(fd);
    io.run_for(std::chrono::seconds(20));
    CHECK(server.requests_seen() == 2);
  }
  CHECK(killed == 31338);
  CHECK(signal_sent == SIGTERM);
  CHECK_FALSE(fs::exists(path));  // removed with the server
}

TEST_CASE("file timer: a worker's expired timers cannot flood the log or forge lines in it") {
  // A worker may write timers that expire at once, as fast as it writes (expiration_time 0,
  // signal 0: nothing is killed), with any text as the scope id. Before: a warning line for each
  // (600,000 in 3 s), the scope id printed raw (a newline forged a "[ddprun error]" line, an ESC
  // reached the terminal).
  namespace fs = std::filesystem;
  const fs::path path = fs::temp_directory_path() / ("ddprun_timer_flood_" + std::to_string(::getpid()));
  auto sink = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(4096);
  spdlog::default_logger()->sinks().push_back(sink);
  constexpr int kLines = 2000;
  boost::asio::io_context io;
  int kills = 0;
  {
    FileTimerServer server(io, path.string(), [&](pid_t, int) { return ++kills, true; });
    server.start();
    const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
    REQUIRE(fd >= 0);
    // From another thread: more than the pipe holds, read by the server as it comes.
    std::thread writer([fd] {
      for (int i = 0; i < kLines; ++i) {
        // A pid per line: each timer is reaped (one reap per pid and deadline).
        const std::string line =
            R"({"version": 1, "pid": )" + std::to_string(100000 + i) +
            R"(, "scope_id": "s\n[ddprun error] forged\u001b[2J", "expiration_time": 0, "signal": )" +
            std::string(i % 2 == 0 ? "0" : "18") + "}\n";
        if (::write(fd, line.data(), line.size()) != static_cast<ssize_t>(line.size())) break;
      }
      ::close(fd);
    });
    // Until every line is read and every timer reaped (bounded).
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while ((server.requests_seen() < kLines || server.timers() > 0) && std::chrono::steady_clock::now() < give_up) {
      io.run_for(std::chrono::milliseconds(20));
    }
    writer.join();
    CHECK(server.requests_seen() == kLines);
    CHECK(server.timers() == 0);
  }
  auto& sinks = spdlog::default_logger()->sinks();
  sinks.erase(std::remove(sinks.begin(), sinks.end(), sink), sinks.end());
  CHECK(kills == kLines / 2);
  const auto lines = sink->last_formatted();
  const auto count = [&](const char* what) {
    return std::count_if(lines.begin(), lines.end(), [&](const std::string& l) { return l.find(what) != l.npos; });
  };
  // 64 lines of each kind a second at most (the whole run takes a second or two at most): every
  // timer of a burst of real expiries shows, a flood does not.
  CHECK(count("expired without a signal") >= 64);
  CHECK(count("expired without a signal") <= 3 * 64);
  CHECK(count("expired; killing it with SIGCONT") >= 64);
  CHECK(count("expired; killing it with SIGCONT") <= 3 * 64);
  // Nothing is lost: the lines shown and the counts of those not shown add up to every expiry,
  // the last count said when the server ends (no later line carried it).
  const auto accounted = [&](const char* event, const char* flushed) {
    std::size_t n = 0;
    for (const auto& l : lines) {
      if (l.find(event) != l.npos) ++n;
      if (l.find(event) == l.npos && l.find(flushed) == l.npos) continue;
      if (const auto at = l.find(" more like it not shown over the last "); at != l.npos) {
        auto b = at;
        while (b > 0 && std::isdigit(static_cast<unsigned char>(l[b - 1])) != 0) --b;
        n += std::stoul(l.substr(b, at - b));
      }
    }
    return n;
  };
  CHECK(accounted("expired without a signal; not killing it", "scopes expired without a signal:") == kLines / 2);
  CHECK(accounted("expired; killing it with SIGCONT", "scopes expired and their workers killed:") == kLines / 2);
  for (const auto& l : lines) {
    // Each log line is one line, with no escape character; the scope id shows escaped.
    CHECK(std::count(l.begin(), l.end(), '\n') <= 1);
    CHECK(l.find('\x1b') == std::string::npos);
    if (l.find("file timer: scope '") != l.npos) CHECK(l.find("'s\\x0a[ddprun error] forged\\x1b[2J") != l.npos);
  }
}

TEST_CASE("file timer: numbers out of range are refused, never cast") {
  std::string problem;
  auto line = [](const std::string& pid, const std::string& exp, const std::string& sig) {
    return R"({"version": 1, "pid": )" + pid + R"(, "scope_id": "s", "expiration_time": )" + exp + R"(, "signal": )" +
           sig + "}";
  };
  CHECK(parse_timer_request(line("4242", "1e300", "9")));                    // far, but a deadline: the wait is clamped
  CHECK_FALSE(parse_timer_request(line("4294967301", "1", "9"), &problem));  // pid 5 after a cast
  CHECK_THAT(problem, Contains("pid"));
  CHECK_FALSE(parse_timer_request(line("4242.5", "1", "9"), &problem));
  CHECK_THAT(problem, Contains("pid"));
  CHECK_FALSE(parse_timer_request(line("1e300", "1", "9"), &problem));
  CHECK_FALSE(parse_timer_request(line("4242", "1", "1e20"), &problem));
  CHECK_THAT(problem, Contains("signal"));
  CHECK_FALSE(parse_timer_request(line("4242", "1", "-9"), &problem));
  CHECK_FALSE(parse_timer_request(line("4242", "1", std::to_string(SIGRTMAX + 1)), &problem));
  CHECK(parse_timer_request(line("4242", "1", std::to_string(SIGRTMAX))));
  CHECK_FALSE(parse_timer_request(
      R"({"pid": 7, "scope_id": ")" + std::string(257, 'x') + R"(", "expiration_time": 1, "signal": 9})", &problem));
  CHECK_THAT(problem, Contains("scope_id"));
}

TEST_CASE("file timer: the table is bounded per pid and in all") {
  FileTimerTable t;
  for (std::size_t i = 0; i < FileTimerTable::kMaxPerPid; ++i) {
    REQUIRE(t.apply({1, 100, "s" + std::to_string(i), 50.0 + static_cast<double>(i), 9}) ==
            FileTimerTable::Applied::ok);
  }
  CHECK(t.apply({1, 100, "one_more", 1.0, 9}) == FileTimerTable::Applied::too_many_for_pid);
  CHECK(t.apply({1, 100, "s3", 2.0, 9}) == FileTimerTable::Applied::ok);  // re-arming an existing one is fine
  CHECK(t.next_deadline() == Approx(2.0));
  for (pid_t pid = 101; t.size() < FileTimerTable::kMaxTimers; ++pid) {
    for (std::size_t i = 0; i < FileTimerTable::kMaxPerPid && t.size() < FileTimerTable::kMaxTimers; ++i) {
      REQUIRE(t.apply({1, pid, std::to_string(i), 1000.0, 9}) == FileTimerTable::Applied::ok);
    }
  }
  CHECK(t.apply({1, 99999, "x", 1.0, 9}) == FileTimerTable::Applied::table_full);
  // Refused requests leave nothing behind, whatever pid they name (a map entry each grew it
  // without bound).
  const std::size_t pids = t.pids();
  for (pid_t pid = 200000; pid < 210000; ++pid) t.apply({1, pid, "x", 1.0, 9});
  CHECK(t.pids() == pids);
  t.clear_pid(100);
  CHECK(t.size() == FileTimerTable::kMaxTimers - FileTimerTable::kMaxPerPid);
  CHECK(t.next_deadline() == Approx(1000.0));  // the deadline index follows the timers
  t.clear();
  CHECK(t.size() == 0);
  CHECK_FALSE(t.next_deadline());
  CHECK(t.apply({1, 100, "again", 3.0, 9}) == FileTimerTable::Applied::ok);
}

TEST_CASE("file timer: a deadline centuries away does not spin the event loop") {
  namespace fs = std::filesystem;
  const fs::path path = fs::temp_directory_path() / ("ddprun_timer_far_" + std::to_string(::getpid()));
  boost::asio::io_context io;
  int kills = 0;
  FileTimerServer server(io, path.string(), [&](pid_t, int) { return ++kills > 0; });
  server.start();
  const int fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
  REQUIRE(fd >= 0);
  const std::string lines =
      "{\"version\": 1, \"pid\": 31337, \"scope_id\": \"far\", \"expiration_time\": 1e300, \"signal\": 9}\n"
      "{\"version\": 1, \"pid\": 31338, \"scope_id\": \"farther\", \"expiration_time\": 1e18, \"signal\": 9}\n";
  REQUIRE(::write(fd, lines.data(), lines.size()) == static_cast<ssize_t>(lines.size()));
  ::close(fd);
  // An overflowed deadline lands in the past and fires again at once: thousands of handlers.
  const std::size_t handlers = io.run_for(std::chrono::milliseconds(500));
  CHECK(server.requests_seen() == 2);
  CHECK(server.timers() == 2);
  CHECK(kills == 0);
  CHECK(handlers < 20);
}

TEST_CASE("file timer: the end of a line cut for its length is not read as a line") {
  namespace fs = std::filesystem;
  const fs::path path = fs::temp_directory_path() / ("ddprun_timer_long_" + std::to_string(::getpid()));
  boost::asio::io_context io;
  std::vector<pid_t> killed;
  FileTimerServer server(io, path.string(), [&](pid_t pid, int) {
    killed.push_back(pid);
    return true;
  });
  server.start();
  const int fd = ::open(path.c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC);  // RDWR: never blocks the test
  REQUIRE(fd >= 0);
  // 70,000 bytes without a newline (over the 64 KiB a line may have), ending in what would parse
  // as a request of its own; then a real one.
  const std::string tail = R"({"version": 1, "pid": 31337, "scope_id": "tail", "expiration_time": 1, "signal": 9})";
  const std::string text = std::string(70000, ' ') + tail + "\n" +
                           R"({"version": 1, "pid": 31338, "scope_id": "real", "expiration_time": 1, "signal": 9})" +
                           "\n";
  std::size_t sent = 0;
  while (sent < text.size()) {  // the pipe holds 64 KiB: the server reads as the test writes
    const ssize_t n = ::write(fd, text.data() + sent, text.size() - sent);
    if (n > 0) sent += static_cast<std::size_t>(n);
    io.run_for(std::chrono::milliseconds(20));
  }
  for (int i = 0; i < 50 && killed.empty(); ++i) io.run_for(std::chrono::milliseconds(20));
  ::close(fd);
  CHECK(killed == std::vector<pid_t>{31338});
  CHECK(server.requests_seen() == 1);
}

TEST_CASE("file timer: the FIFO path never costs a user's file or another job's FIFO") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("ddprun_timer_path_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  boost::asio::io_context io;
  auto never = [](pid_t, int) { return false; };
  {
    // TORCHELASTIC_TIMER_FILE=train.py must not delete the script.
    const fs::path script = dir / "train.py";
    {
      std::FILE* f = std::fopen(script.c_str(), "w");
      REQUIRE(f != nullptr);
      std::fputs("print(1)\n", f);
      std::fclose(f);
    }
    CHECK_THROWS_WITH(FileTimerServer(io, script.string(), never), Contains(script.string()) && Contains("not a FIFO"));
    CHECK(fs::is_regular_file(script));
    CHECK(fs::file_size(script) == 9);
  }
  {
    // Two jobs, one path: the second refuses instead of stealing the first one's FIFO.
    const fs::path fifo = dir / "shared.fifo";
    FileTimerServer first(io, fifo.string(), never);
    CHECK_THROWS_WITH(FileTimerServer(io, fifo.string(), never), Contains(fifo.string()) && Contains("another"));
    CHECK(fs::is_fifo(fifo));
  }
  {
    // A stale FIFO nobody reads (an agent that was SIGKILLed) is replaced, as torch does.
    const fs::path stale = dir / "stale.fifo";
    REQUIRE(::mkfifo(stale.c_str(), 0600) == 0);
    {
      FileTimerServer server(io, stale.string(), never);
      CHECK(fs::is_fifo(stale));
    }
    CHECK_FALSE(fs::exists(stale));
  }
  {
    // At exit only our own FIFO is removed, not what replaced it at the path meanwhile.
    const fs::path path = dir / "replaced.fifo";
    {
      FileTimerServer server(io, path.string(), never);
      fs::remove(path);
      std::FILE* f = std::fopen(path.c_str(), "w");
      REQUIRE(f != nullptr);
      std::fclose(f);
    }
    CHECK(fs::is_regular_file(path));
  }
  fs::remove_all(dir);
}

TEST_CASE("file timer: never signals the agent itself or init, nor a pid its check refuses") {
  const auto anyone = [](pid_t) { return true; };
  CHECK_FALSE(kill_timer_pid(::getpid(), SIGKILL, anyone));
  CHECK_FALSE(kill_timer_pid(1, SIGKILL, anyone));
  CHECK_FALSE(kill_timer_pid(0, SIGKILL, anyone));

  // A live child: refused by the membership check it stays alive; accepted, it gets the signal
  // through its pidfd. An exited (reaped) pid is not signalled.
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    for (;;) ::pause();
  }
  pid_t asked = 0;
  CHECK_FALSE(kill_timer_pid(child, SIGKILL, [&asked](pid_t p) {
    asked = p;
    return false;
  }));
  CHECK(asked == child);
  CHECK(::kill(child, 0) == 0);
  const bool signalled = kill_timer_pid(child, SIGKILL, anyone);
  CHECK(signalled);
  if (!signalled) ::kill(child, SIGKILL);  // never leave it behind
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGKILL);
  CHECK_FALSE(kill_timer_pid(child, SIGKILL, anyone));
}

TEST_CASE("health endpoint: the answer and a real request") {
  const std::string ok = HealthEndpoint::response(true, 1700000000, 42, 3, "running round 3");
  CHECK_THAT(ok, Contains("HTTP/1.1 200 OK\r\n") && Contains("Content-Type: application/json"));
  const auto body = boost::json::parse(ok.substr(ok.find("\r\n\r\n") + 4)).as_object();
  CHECK(body.at("status").as_string() == "alive");
  CHECK(body.at("last_progress_time").as_int64() == 1700000000);
  CHECK(body.at("round").to_number<int>() == 3);
  CHECK_THAT(HealthEndpoint::response(false, 1, 42, 0, "x"), Contains("503") && Contains("\"stale\""));

  boost::asio::io_context io;
  HealthEndpoint ep(io, 0);
  ep.start();
  ep.set_state("running round 1", 1);
  std::string answer;
  std::thread client([&] {
    boost::asio::io_context cio;
    boost::asio::ip::tcp::socket s(cio);
    s.connect({boost::asio::ip::make_address("127.0.0.1"), ep.port()});
    const std::string req = "GET / HTTP/1.1\r\n\r\n";
    boost::asio::write(s, boost::asio::buffer(req));
    boost::system::error_code ec;
    std::array<char, 4096> buf{};
    for (;;) {
      const auto n = s.read_some(boost::asio::buffer(buf), ec);
      if (ec) break;
      answer.append(buf.data(), n);
    }
    io.stop();
  });
  io.run_for(std::chrono::seconds(20));
  client.join();
  CHECK_THAT(answer, Contains("200 OK") && Contains("\"state\":\"running round 1\""));
}

TEST_CASE("event log: torch's Event layout") {
  const auto line = EventLog::format("ddprun.round.started", "AGENT", 1700000000123,
                                     {{"round", std::int64_t{2}}, {"role", std::string("trainer")}});
  const auto o = boost::json::parse(line).as_object();
  CHECK(o.at("name").as_string() == "ddprun.round.started");
  CHECK(o.at("source").as_string() == "AGENT");
  CHECK(o.at("timestamp").as_int64() == 1700000000123);
  CHECK(o.at("metadata").as_object().at("round").as_int64() == 2);
  CHECK(o.at("metadata").as_object().at("role").as_string() == "trainer");
  CHECK_FALSE(EventLog("null").enabled());
  CHECK(EventLog("console").enabled());
  CHECK_THROWS_WITH(EventLog("file:/nonexistent-dir/x.jsonl"), Contains("/nonexistent-dir/x.jsonl"));
}

TEST_CASE("the failure summary names the script, not the interpreter") {
  AgentConfig c;
  c.worker_argv = {"/usr/bin/python3", "-u", "train.py", "--lr", "1"};
  c.python_worker = true;
  c.user_args_index = 3;
  CHECK(entrypoint_name(c) == "train.py");
  c.worker_argv = {"/usr/bin/python3", "-u", "-m", "pkg.train"};
  c.user_args_index = 4;
  CHECK(entrypoint_name(c) == "pkg.train");
  c.worker_argv = {"/opt/bin/train", "--x"};
  c.python_worker = false;
  c.user_args_index = 1;
  CHECK(entrypoint_name(c) == "/opt/bin/train");
}

TEST_CASE("health endpoint: idle connections neither exhaust the agent nor stop the endpoint") {
  namespace fs = std::filesystem;
  boost::asio::io_context io;
  auto guard = boost::asio::make_work_guard(io);
  HealthEndpoint ep(io, 0);
  ep.start();
  std::thread server([&] { io.run(); });
  // Ask the endpoint on its own thread: it is not thread-safe.
  auto query = [&](auto f) {
    std::promise<decltype(f())> p;
    boost::asio::post(io, [&] { p.set_value(f()); });
    return p.get_future().get();
  };
  auto connect = [&]() -> int {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(ep.port());
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      ::close(fd);
      return -1;
    }
    return fd;
  };

  // Few descriptors to spare, as an agent near its limit: before the cap, the endpoint took
  // every idle connection until accept failed with EMFILE, and then never accepted again.
  rlimit old{};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &old) == 0);
  std::size_t used = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator("/proc/self/fd")) ++used;
  rlimit tight = old;
  tight.rlim_cur = used + 120;
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &tight) == 0);
  std::vector<int> idle;
  for (int i = 0; i < 100; ++i) {
    const int fd = connect();
    if (fd >= 0) idle.push_back(fd);
  }
  REQUIRE(idle.size() >= 60);
  // Readiness: the endpoint has taken (served or refused) every idle connection.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < deadline &&
         query([&] { return ep.open_connections() + ep.rejected(); }) < idle.size()) {
  }
  CHECK(query([&] { return ep.open_connections(); }) <= HealthEndpoint::kMaxConnections);
  CHECK(query([&] { return ep.rejected(); }) >= idle.size() - HealthEndpoint::kMaxConnections);
  for (const int fd : idle) ::close(fd);
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &old) == 0);
  while (std::chrono::steady_clock::now() < deadline && query([&] { return ep.open_connections(); }) > 0) {
  }

  // The endpoint still answers.
  std::string answer;
  for (int attempt = 0; attempt < 3 && answer.empty(); ++attempt) {
    const int fd = connect();
    REQUIRE(fd >= 0);
    timeval tv{3, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    const std::string req = "GET / HTTP/1.1\r\n\r\n";
    CHECK(::write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size()));
    std::array<char, 4096> buf{};
    for (ssize_t n; (n = ::read(fd, buf.data(), buf.size())) > 0;)
      answer.append(buf.data(), static_cast<std::size_t>(n));
    ::close(fd);
  }
  CHECK_THAT(answer, Contains("200 OK") && Contains("\"status\":\"alive\""));
  guard.reset();
  boost::asio::post(io, [&] { ep.stop(); });
  io.stop();
  server.join();
}

TEST_CASE("duplicate filters: on the console, a line cut where the buffer filled adds no empty line") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("ddprun_dupconsole_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  int console[2];
  REQUIRE(::pipe(console) == 0);
  {
    ChildStream st =
        duplicating_stream(Route::prefixed, "", (dir / "filtered.log").string(), console[1], "[0]:", {"x"});
    // A line exactly as long as the pump's buffer: released as a cut piece, its newline next.
    st.sink("01234567", false);
    st.sink("\nabcdefgh", false);
    st.sink("ij\n\nz\n", true);
  }
  ddprun::console::drain();  // the console's writer thread has written it all
  ::close(console[1]);
  std::string shown;
  char buf[256];
  for (ssize_t n; (n = ::read(console[0], buf, sizeof buf)) > 0;) shown.append(buf, static_cast<std::size_t>(n));
  ::close(console[0]);
  // As OutputPump's own console path: the real newline after a cut ends that line; an empty
  // line of the worker's stays.
  CHECK(shown == "[0]:01234567\n[0]:abcdefgh\n[0]:ij\n[0]:\n[0]:z\n");
  fs::remove_all(dir);
}

TEST_CASE("duplicate filters: a line longer than the pump's buffer stays one line") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("ddprun_dupfilter_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path log = dir / "stdout.log";
  const fs::path filtered = dir / "filtered_stdout.log";
  auto read = [](const fs::path& p) {
    std::string out;
    std::FILE* f = std::fopen(p.c_str(), "r");
    REQUIRE(f != nullptr);
    for (int c; (c = std::fgetc(f)) != EOF;) out += static_cast<char>(c);
    std::fclose(f);
    return out;
  };
  {
    ChildStream st = duplicating_stream(Route::file, log.string(), filtered.string(), -1, "[0]:", {"NEEDLE", "x"});
    // As LineBuffer releases them: a long line in buffer-sized pieces (complete == false), the
    // filter cut across the boundary, then whole lines, then a last line without a newline.
    st.sink("long aaaNEE", false);
    st.sink("DLE bbb\nplain\n", true);
    st.sink("the xend", false);
  }  // the stream closes: its unfinished last line is matched and written
  CHECK(read(log) == "long aaaNEEDLE bbb\nplain\nthe xend");  // no newline added inside a line
  CHECK(read(filtered) == "[0]:long aaaNEEDLE bbb\n[0]:the xend\n");
  fs::remove_all(dir);
}
