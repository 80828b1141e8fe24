// Output routes, prefix templates, whole-line buffering and prefixed writes (pure parts).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <catch2/catch.hpp>
#include <spdlog/sinks/ringbuffer_sink.h>
#include <spdlog/spdlog.h>
#include <algorithm>
#include <chrono>
#include <csignal>
#include <memory>
#include <string>

#include "ddprun/common/console.hpp"
#include "ddprun/agent/output.hpp"

using namespace ddprun::agent;

namespace {

struct Chunk {
  std::string bytes;
  bool complete;
};

std::vector<Chunk> feed(LineBuffer& b, std::string_view input, bool eof) {
  std::vector<Chunk> out;
  while (!input.empty()) {
    const auto n = std::min(input.size(), b.write_space());
    std::copy_n(input.data(), n, b.write_ptr());
    b.commit(n);
    input.remove_prefix(n);
    b.release([&](std::string_view s, bool c) { out.push_back({std::string(s), c}); }, false);
  }
  if (eof) {
    b.release([&](std::string_view s, bool c) { out.push_back({std::string(s), c}); }, true);
  }
  return out;
}

std::string read_all(int fd) {
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof(buf))) > 0) {
    out.append(buf, static_cast<std::size_t>(n));
  }
  return out;
}

}  // namespace

TEST_CASE("routes: default inherits, redirect goes to file, tee pumps") {
  ddprun::agent::AgentConfig c;
  c.nproc_per_node = 3;
  auto r = plan_routes(c, 0);
  CHECK(r.out == Route::inherit);
  CHECK(r.err == Route::inherit);
  CHECK_FALSE(r.needs_files());

  c.redirects_all = Streams::err;
  c.tee[1] = Streams::out;
  r = plan_routes(c, 0);
  CHECK(r.out == Route::inherit);
  CHECK(r.err == Route::file);
  r = plan_routes(c, 1);
  CHECK(r.out == Route::tee);   // per-rank tee
  CHECK(r.err == Route::file);  // redirect_all still applies to the other stream
  c.redirects[2] = Streams::none;
  r = plan_routes(c, 2);
  CHECK(r.out == Route::inherit);
  CHECK(r.err == Route::inherit);
}

TEST_CASE("routes: the console filter keeps filtered ranks in files, never drops them") {
  ddprun::agent::AgentConfig c;
  c.nproc_per_node = 2;
  c.local_ranks_filter = std::set<int>{1};
  c.tee_all = Streams::both;
  CHECK(plan_routes(c, 0).out == Route::file);
  CHECK(plan_routes(c, 0).err == Route::file);
  CHECK(plan_routes(c, 1).out == Route::tee);
  c.tee_all = Streams::none;
  CHECK(plan_routes(c, 0).out == Route::file);
  CHECK(plan_routes(c, 1).out == Route::inherit);
}

TEST_CASE("routes: without log files (--log-dir /dev/null) a filtered rank's streams go nowhere") {
  ddprun::agent::AgentConfig c;
  c.nproc_per_node = 2;
  c.no_log_files = true;
  c.local_ranks_filter = std::set<int>{1};
  CHECK(plan_routes(c, 0).out == Route::discard);
  CHECK(plan_routes(c, 0).err == Route::discard);
  CHECK_FALSE(plan_routes(c, 0).needs_files());
  CHECK(plan_routes(c, 1).out == Route::inherit);
}

TEST_CASE("prefix template placeholders") {
  CHECK(expand_prefix("[${role_name}${local_rank}]:", "default", 3, 11) == "[default3]:");
  CHECK(expand_prefix("${rank}|${local_rank}|${role_name} ", "r", 1, 9) == "9|1|r ");
  CHECK(expand_prefix("${unknown}$x${", "r", 1, 9) == "${unknown}$x${");
  CHECK(expand_prefix("", "r", 0, 0).empty());
  // Python's Template.safe_substitute, as torchrun: $name without braces, "$$", and ${hostname}.
  CHECK(expand_prefix("$rank:$local_rank:$role_name|", "r", 1, 9) == "9:1:r|");
  CHECK(expand_prefix("$$rank $$ ${rank}$", "r", 1, 9) == "$rank $ 9$");
  CHECK(expand_prefix("${hostname}:$hostname:${rank}: ", "r", 1, 9, "node7") == "node7:node7:9: ");
  // A longer name is another name (kept), as is a name that is not ours or a bad brace.
  CHECK(expand_prefix("$ranks $rank_x ${rank ${RANK} $1 ${1x} $", "r", 1, 9) ==
        "$ranks $rank_x ${rank ${RANK} $1 ${1x} $");
  CHECK(expand_prefix("[$rank]", "r", 1, 9) == "[9]");
}

TEST_CASE("LineBuffer releases whole lines, holds partials until newline or EOF") {
  LineBuffer b(64);
  auto chunks = feed(b, "abc", false);
  CHECK(chunks.empty());
  CHECK(b.pending() == 3);
  chunks = feed(b, "def\ngh\nij", false);
  REQUIRE(chunks.size() == 1);
  CHECK(chunks[0].bytes == "abcdef\ngh\n");
  CHECK(chunks[0].complete);
  CHECK(b.pending() == 2);
  chunks = feed(b, "", true);
  REQUIRE(chunks.size() == 1);
  CHECK(chunks[0].bytes == "ij");
  CHECK_FALSE(chunks[0].complete);
  CHECK(b.pending() == 0);
}

TEST_CASE("LineBuffer cuts a line longer than its capacity") {
  LineBuffer b(8);
  const auto chunks = feed(b, "0123456789AB\n", true);
  std::string joined;
  for (const auto& c : chunks) {
    joined += c.bytes;
  }
  CHECK(joined == "0123456789AB\n");  // nothing lost, nothing added
  REQUIRE(chunks.size() >= 2);
  CHECK(chunks[0].bytes == "01234567");
  CHECK_FALSE(chunks[0].complete);
}

TEST_CASE("OutputPump: a line cut where the buffer filled goes on under its prefix, with no empty line") {
  // 8 bytes of buffer: "01234567" fills it exactly, so its newline comes in the next read;
  // "abcdefghij" is cut once and goes on.
  int in[2];
  int console[2];
  REQUIRE(::pipe(in) == 0);
  REQUIRE(::pipe(console) == 0);
  boost::asio::io_context io;
  bool done = false;
  OutputPump pump(
      io, in[0], -1, console[1], "[r0]:", [&] { done = true; }, 8);
  pump.start();
  const std::string text = "01234567\nabcdefghij\n\nx\n";
  REQUIRE(::write(in[1], text.data(), text.size()) == static_cast<ssize_t>(text.size()));
  ::close(in[1]);
  io.run();
  CHECK(done);
  ddprun::console::drain();  // the console's writer thread has written it all
  ::close(console[1]);
  CHECK(read_all(console[0]) == "[r0]:01234567\n[r0]:abcdefgh\n[r0]:ij\n[r0]:\n[r0]:x\n");
  ::close(console[0]);
}

TEST_CASE("LineBuffer: take_open gives a held partial line once; release goes on after it") {
  LineBuffer b(64);
  auto put = [&b](std::string_view text) {
    std::copy_n(text.data(), text.size(), b.write_ptr());
    b.commit(text.size());
  };
  std::vector<Chunk> out;
  const auto sink = [&out](std::string_view s, bool c) { out.push_back({std::string(s), c}); };
  put("(Pdb) ");
  b.release(sink, false);
  CHECK(out.empty());
  CHECK(b.take_open() == "(Pdb) ");
  CHECK(b.take_open().empty());
  CHECK(b.unshown() == 0);
  put("n\nnext");
  b.release(sink, false);
  REQUIRE(out.size() == 1);
  CHECK(out[0].bytes == "n\n");  // not the shown "(Pdb) " again
  CHECK(out[0].complete);
  CHECK(b.take_open() == "next");
  out.clear();
  b.release(sink, true);  // the end of the stream: the shown line ends with nothing new
  REQUIRE(out.size() == 1);
  CHECK(out[0].bytes.empty());
  CHECK_FALSE(out[0].complete);
  CHECK(b.pending() == 0);
}

TEST_CASE("OutputPump: a partial line (a prompt) is shown open after a pause; lines never share a console line") {
  int in[2];
  int console[2];
  REQUIRE(::pipe(in) == 0);
  REQUIRE(::pipe(console) == 0);
  REQUIRE(::fcntl(console[0], F_SETFL, O_NONBLOCK) == 0);
  const int file = ::memfd_create("tee", MFD_CLOEXEC);
  REQUIRE(file >= 0);
  const int file_copy = ::dup(file);  // the pump closes its own
  boost::asio::io_context io;
  bool done = false;
  OutputPump pump(io, in[0], file, console[1], "[r0]:", [&] { done = true; });
  pump.start();
  std::string seen;
  // Runs the pump until the console shows `want` (the open line appears only after
  // kOpenLineDelay with nothing more: the wait is for it, bounded).
  auto until_seen = [&](const std::string& want) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (seen != want && std::chrono::steady_clock::now() < deadline) {
      io.run_for(std::chrono::milliseconds(10));
      ddprun::console::drain();
      char buf[4096];
      ssize_t n;
      while ((n = ::read(console[0], buf, sizeof buf)) > 0) seen.append(buf, static_cast<std::size_t>(n));
    }
    return seen;
  };
  auto put = [&](std::string_view text) {
    REQUIRE(::write(in[1], text.data(), text.size()) == static_cast<ssize_t>(text.size()));
  };
  put("(Pdb) ");
  CHECK(until_seen("[r0]:(Pdb) ") == "[r0]:(Pdb) ");
  put("c\nx");  // the rest of the line goes on on it; the next partial is shown open too
  CHECK(until_seen("[r0]:(Pdb) c\n[r0]:x") == "[r0]:(Pdb) c\n[r0]:x");
  ddprun::console::write(console[1], "another writer\n");  // ends the open line first
  put("y\n");                                              // its rest starts a line of its own, with the prefix
  const std::string want = "[r0]:(Pdb) c\n[r0]:x\nanother writer\n[r0]:y\n";
  CHECK(until_seen(want) == want);
  put("z");
  ::close(in[1]);  // a partial line at the end still ends with a newline
  CHECK(until_seen(want + "[r0]:z\n") == want + "[r0]:z\n");
  CHECK(done);
  // The log file has the worker's bytes as written, each once.
  char buf[256];
  const ssize_t n = ::pread(file_copy, buf, sizeof buf, 0);
  CHECK(std::string(buf, static_cast<std::size_t>(std::max<ssize_t>(n, 0))) == "(Pdb) c\nxy\nz");
  ::close(file_copy);
  ::close(console[0]);
  ::close(console[1]);
}

TEST_CASE("OutputPump::sync writes what the pipe holds before it calls back, and reading goes on") {
  int in[2];
  int console[2];
  REQUIRE(::pipe(in) == 0);
  REQUIRE(::pipe(console) == 0);
  REQUIRE(::fcntl(console[0], F_SETFL, O_NONBLOCK) == 0);
  boost::asio::io_context io;
  bool done = false;
  OutputPump pump(io, in[0], -1, console[1], "[r0]:", [&] { done = true; });
  pump.start();  // a read in flight from here on: sync() has it hand its bytes over first
  const std::string last = "Traceback (most recent call last):\nRuntimeError: boom\n";
  REQUIRE(::write(in[1], last.data(), last.size()) == static_cast<ssize_t>(last.size()));
  auto console_now = [&] {
    ddprun::console::drain();
    std::string seen;
    char buf[4096];
    ssize_t n;
    while ((n = ::read(console[0], buf, sizeof buf)) > 0) seen.append(buf, static_cast<std::size_t>(n));
    return seen;
  };
  std::string at_sync;
  bool synced = false;
  pump.sync([&] {
    synced = true;
    at_sync = console_now();
  });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!synced && std::chrono::steady_clock::now() < deadline) io.run_one_for(std::chrono::milliseconds(100));
  REQUIRE(synced);
  CHECK(at_sync == "[r0]:Traceback (most recent call last):\n[r0]:RuntimeError: boom\n");
  CHECK_FALSE(done);  // the stream goes on: a cancelled read is no EOF
  REQUIRE(::write(in[1], "after\n", 6) == 6);
  ::close(in[1]);
  io.run();
  CHECK(done);
  CHECK(console_now() == "[r0]:after\n");
  ::close(console[0]);
  ::close(console[1]);
}

namespace {

// A pump from a pipe to a console pipe, run by hand: the test writes the worker's side and reads
// what the console got so far.
struct PumpBench {
  explicit PumpBench(std::size_t capacity = 64 * 1024) {
    REQUIRE(::pipe(in) == 0);
    REQUIRE(::pipe(console) == 0);
    REQUIRE(::fcntl(console[0], F_SETFL, O_NONBLOCK) == 0);
    pump = std::make_unique<OutputPump>(
        io, in[0], -1, console[1], "[r0]:", [this] { done = true; }, capacity);
    pump->start();
  }
  ~PumpBench() {
    pump.reset();
    if (in[1] >= 0) ::close(in[1]);
    ::close(console[0]);
    ::close(console[1]);
  }
  void put(std::string_view text) {
    REQUIRE(::write(in[1], text.data(), text.size()) == static_cast<ssize_t>(text.size()));
  }
  void end() {
    ::close(in[1]);
    in[1] = -1;
  }
  // What the console got since the last call.
  std::string take() {
    ddprun::console::drain();
    std::string got;
    char buf[4096];
    ssize_t n;
    while ((n = ::read(console[0], buf, sizeof buf)) > 0) got.append(buf, static_cast<std::size_t>(n));
    return got;
  }
  // Runs the pump until the console has shown `want` in all (bounded).
  std::string until(const std::string& want) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (seen != want && std::chrono::steady_clock::now() < deadline) {
      io.run_for(std::chrono::milliseconds(10));
      seen += take();
    }
    return seen;
  }
  int in[2]{-1, -1};
  int console[2]{-1, -1};
  boost::asio::io_context io;
  std::unique_ptr<OutputPump> pump;
  bool done = false;
  std::string seen;
};

}  // namespace

TEST_CASE("OutputPump: a line shown open that then filled the buffer is ended at EOF") {
  PumpBench b(8);
  b.put("ab");
  CHECK(b.until("[r0]:ab") == "[r0]:ab");
  b.put("cdefgh");  // fills the 8 bytes: goes on on the open line, nothing held after it
  b.end();
  CHECK(b.until("[r0]:abcdefgh\n") == "[r0]:abcdefgh\n");
  CHECK(b.done);
}

TEST_CASE("OutputPump: a partial line redrawn faster than the delay is still shown") {
  PumpBench b;
  // A progress bar: a byte every 20 ms, never a newline; it must show while it goes on.
  std::string drawn;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (b.seen.empty() && std::chrono::steady_clock::now() < deadline) {
    b.put("#");
    drawn += "#";
    const auto next = std::chrono::steady_clock::now() + std::chrono::milliseconds(20);
    while (std::chrono::steady_clock::now() < next) b.io.run_for(std::chrono::milliseconds(5));
    b.seen += b.take();
  }
  REQUIRE_FALSE(b.seen.empty());
  CHECK(b.seen.rfind("[r0]:#", 0) == 0);
  CHECK(b.seen.find('\n') == std::string::npos);
  b.put("\n");
  b.end();
  CHECK(b.until("[r0]:" + drawn + "\n") == "[r0]:" + drawn + "\n");
}

TEST_CASE("OutputPump::sync shows a last line without a newline before it calls back") {
  PumpBench b;
  b.put("done\nlast words");
  std::string at_sync;
  bool synced = false;
  b.pump->sync([&] {
    synced = true;
    at_sync = b.take();
  });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!synced && std::chrono::steady_clock::now() < deadline) b.io.run_one_for(std::chrono::milliseconds(100));
  REQUIRE(synced);
  CHECK(at_sync == "[r0]:done\n[r0]:last words");
  b.end();
  b.seen = at_sync;
  CHECK(b.until("[r0]:done\n[r0]:last words\n") == "[r0]:done\n[r0]:last words\n");
}

namespace {

// A sink pump (a relay's) fed by hand: what its sink and its open sink got.
struct SinkBench {
  explicit SinkBench(bool take_open) {
    REQUIRE(::pipe(in) == 0);
    pump = std::make_unique<OutputPump>(
        io, in[0], [this](std::string_view b, bool) { lines += b; }, -1, [this] { done = true; });
    pump->set_open_sink([this, take_open](std::string_view piece) {
      offered += piece;
      if (take_open) opened += piece;
      return take_open;
    });
    pump->start();
  }
  ~SinkBench() {
    pump.reset();
    if (in[1] >= 0) ::close(in[1]);
  }
  void put(std::string_view text) {
    REQUIRE(::write(in[1], text.data(), text.size()) == static_cast<ssize_t>(text.size()));
  }
  // Runs the io_context for `d` of steady time.
  void run_for(std::chrono::milliseconds d) {
    const auto until = std::chrono::steady_clock::now() + d;
    while (std::chrono::steady_clock::now() < until) io.run_for(std::chrono::milliseconds(5));
  }
  void finish() {
    ::close(in[1]);
    in[1] = -1;
    io.run_for(std::chrono::seconds(10));
  }
  int in[2]{-1, -1};
  boost::asio::io_context io;
  std::unique_ptr<OutputPump> pump;
  std::string lines, offered, opened;
  bool done = false;
};

}  // namespace

TEST_CASE("OutputPump (sink): lines that reads split and the next read completes are never shown open") {
  SinkBench b(true);
  std::string all;
  // Every 20 ms a read ends mid-line and the next completes it, for 400 ms: no partial line is
  // ever 100 ms old. Unless this thread was held up between two writes for most of the delay
  // (a loaded machine): then the partial line was old enough to show, and nothing is checked.
  auto last = std::chrono::steady_clock::now();
  auto longest = std::chrono::steady_clock::duration::zero();
  for (int i = 0; i < 20; ++i) {
    const std::string piece = "end" + std::to_string(i) + "\nstart" + std::to_string(i);
    b.put(piece);
    const auto now = std::chrono::steady_clock::now();
    longest = std::max(longest, now - last);
    last = now;
    all += piece;
    b.run_for(std::chrono::milliseconds(20));
  }
  b.put("\n");
  longest = std::max(longest, std::chrono::steady_clock::now() - last);
  b.finish();
  CHECK(b.done);
  if (longest < kOpenLineDelay * 3 / 4) {
    CHECK(b.offered.empty());
  } else {
    WARN("a write came " << std::chrono::duration_cast<std::chrono::milliseconds>(longest).count()
                         << " ms after the one before: whether a partial line showed is not checked");
  }
  CHECK(b.lines == all + "\n");
}

TEST_CASE("OutputPump (sink): a partial line the open sink does not take comes in the sink's next block") {
  SinkBench b(false);
  b.put("login: ");
  b.run_for(std::chrono::milliseconds(300));
  CHECK(b.offered.rfind("login: ", 0) == 0);  // offered (at least once), not taken
  b.put("ok\n");
  b.finish();
  CHECK(b.lines == "login: ok\n");
}

TEST_CASE("write_all reports a closed pipe instead of dying") {
  int p[2];
  REQUIRE(::pipe(p) == 0);
  ::close(p[0]);
  ::signal(SIGPIPE, SIG_IGN);
  CHECK_FALSE(write_all(p[1], "x"));
  ::signal(SIGPIPE, SIG_DFL);
  ::close(p[1]);
}

TEST_CASE("a log file that cannot be written (a full disk) is reported once, naming it; the stream goes on") {
  // Before: write failures of --log-dir files were ignored: a full disk cut every log short with
  // no word, the job exiting 0. /dev/full fails every write with ENOSPC.
  const int fd = ::open("/dev/full", O_WRONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  auto sink = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(16);
  spdlog::default_logger()->sinks().push_back(sink);
  bool reported = false;
  for (int i = 0; i < 3; ++i) ddprun::agent::write_log_file(fd, "line\n", reported);
  auto& sinks = spdlog::default_logger()->sinks();
  sinks.erase(std::remove(sinks.begin(), sinks.end(), sink), sinks.end());
  ::close(fd);
  CHECK(reported);
  const auto lines = sink->last_formatted();
  REQUIRE(lines.size() == 1);
  CHECK(lines[0].find("cannot write the log file /dev/full: No space left on device") != std::string::npos);
  CHECK(lines[0].find("--log-dir") != std::string::npos);
}
