// The pure parts of diagnosis: reading what workers wrote (bounded, never blocking), when a
// faulthandler dump is complete, and which thread of it says where the rank is.
#include <sys/prctl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <array>
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <string>

#include "ddprun/agent/containment.hpp"
#include "ddprun/agent/diagnosis.hpp"
#include "ddprun/agent/failure.hpp"

using namespace ddprun::agent;
using Catch::Matchers::Contains;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "ddprun-diag-XXXXXX").string();
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~TempDir() { fs::remove_all(path); }
  std::string file(const std::string& name, const std::string& text) const {
    const std::string p = (path / name).string();
    std::ofstream(p, std::ios::binary) << text;
    return p;
  }
  fs::path path;
};

// A dump as faulthandler writes it: helper threads first (newest first), the main thread last.
const char* kDump =
    "Thread 0x00007f0000000002 (most recent call first):\n"
    "  File \"/usr/lib/python3.11/threading.py\", line 320 in wait\n"
    "  File \"/usr/lib/python3.11/threading.py\", line 995 in _bootstrap\n"
    "\n"
    "Current thread 0x00007f0000000001 (most recent call first):\n"
    "  File \"/w/train.py\", line 14 in train_step\n"
    "  File \"/w/train.py\", line 20 in <module>\n";

}  // namespace

TEST_CASE("a faulthandler dump is complete once the main thread's outermost frame is written") {
  CHECK(dump_complete(kDump));
  const std::string text = kDump;
  CHECK_FALSE(dump_complete(text.substr(0, text.find("  File \"/w/train.py\", line 20"))));  // main thread cut
  CHECK_FALSE(dump_complete(text.substr(0, text.find("\n\nCurrent"))));                      // a helper thread's end
  CHECK(
      dump_complete("Current thread 0x1 (most recent call first):\n"
                    "  File \"/w/pkg/__main__.py\", line 3 in <module>\n"
                    "  File \"<frozen runpy>\", line 88 in _run_code\n"
                    "  File \"<frozen runpy>\", line 198 in _run_module_as_main"));  // python -m, no newline yet
  CHECK_FALSE(dump_complete(""));
  CHECK_FALSE(dump_complete("  File \"/w/t.py\", line 1 in <mod"));
}

TEST_CASE("python_where names the main thread's innermost frame, and says when it cannot tell") {
  TempDir d;
  CHECK(python_where(kDump) == "train_step at train.py:14");
  // python -m: the main thread ends in runpy, not in <module>.
  const std::string module_run =
      "Thread 0x2 (most recent call first):\n"
      "  File \"/usr/lib/python3.11/threading.py\", line 320 in wait\n"
      "\n"
      "Current thread 0x1 (most recent call first):\n"
      "  File \"/w/pkg/loop.py\", line 7 in spin\n"
      "  File \"/w/pkg/__main__.py\", line 3 in <module>\n"
      "  File \"<frozen runpy>\", line 88 in _run_code\n"
      "  File \"<frozen runpy>\", line 198 in _run_module_as_main\n";
  CHECK(python_where(module_run) == "spin at loop.py:7");
  // No thread with a module frame (the dump was cut): the first thread, marked as a guess.
  const std::string cut = std::string(kDump).substr(0, std::string(kDump).find("Current"));
  const std::string guess = python_where(cut);
  CHECK(guess.rfind("wait at threading.py:320", 0) == 0);
  CHECK(guess.ends_with(" (not known to be the main thread)"));
  // The source line, from a regular file only.
  const std::string src = d.file("t.py", "import time\n    time.sleep(600)\n");
  CHECK(python_where("  File \"" + src + "\", line 2 in <module>\n") == "<module> at t.py:2 (`time.sleep(600)`)");
  const std::string fifo = (d.path / "fifo.py").string();
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK(python_where("  File \"" + fifo + "\", line 2 in <module>\n") == "<module> at fifo.py:2");  // no hang
  // With the rank's /proc/PID, its path is read through the rank's root (a chroot or a container
  // has another file at the same path: the agent's own showed the wrong line) and a relative
  // path through its working directory. A directory laid out as /proc/PID stands in for it.
  const std::string proc = (d.path / "proc").string();
  fs::create_directories(proc + "/root" + d.path.string());
  fs::create_directories(proc + "/cwd");
  {
    std::ofstream(proc + "/root" + src) << "import time\n    work.wait()\n";
    std::ofstream(proc + "/cwd/rel.py") << "x = 1\n";
  }
  CHECK(python_where("  File \"" + src + "\", line 2 in <module>\n", proc) == "<module> at t.py:2 (`work.wait()`)");
  CHECK(python_where("  File \"rel.py\", line 1 in <module>\n", proc) == "<module> at rel.py:1 (`x = 1`)");
  // The rank's file is not there (the rank is gone): no line rather than the agent's.
  CHECK(python_where("  File \"" + src + "\", line 2 in <module>\n", proc + "/none") == "<module> at t.py:2");
  // The real thing: this process's own /proc entry.
  CHECK(python_where("  File \"" + src + "\", line 2 in <module>\n", "/proc/" + std::to_string(::getpid())) ==
        "<module> at t.py:2 (`time.sleep(600)`)");
}

TEST_CASE("python_where cuts and escapes what the rank wrote: a path, a function, a source line") {
  // The line goes into ddprun's report on the terminal: before, an ESC in a source line or a
  // file name reached it raw, and a minified source line was copied whole.
  TempDir d;
  const std::string src = d.file("t\x1b[2J.py", "x = 1\nprint('\x1b[31mred') or '" + std::string(1000, 'y') + "'\n");
  const std::string where = python_where("  File \"" + src + "\", line 2 in f\x1b]0;title\x07\n");
  CHECK(where.find('\x1b') == std::string::npos);
  CHECK(where.find('\x07') == std::string::npos);
  CHECK_THAT(where, Contains("f\\x1b]0;title\\x07 at t\\x1b[2J.py:2 (`print('\\x1b[31mred') or 'yyy"));
  CHECK_THAT(where, Contains("y...`)"));
  CHECK(where.size() < 300);
}

TEST_CASE("read_worker_file reads regular files only, bounded, without blocking") {
  TempDir d;
  const std::string f = d.file("a", "0123456789");
  std::string problem;
  std::size_t size = 0;
  CHECK(read_worker_file(f, 4, 0, false, &problem, &size) == std::optional<std::string>("0123"));
  CHECK(size == 10);
  CHECK(read_worker_file(f, 100, 7) == std::optional<std::string>("789"));
  CHECK(read_worker_file(f, 100, 10) == std::optional<std::string>(""));
  const std::string fifo = (d.path / "fifo").string();
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_FALSE(read_worker_file(fifo, 100, 0, false, &problem));  // would block forever in open(2) before
  CHECK(problem == "is a FIFO");
  const std::string link = (d.path / "link").string();
  REQUIRE(::symlink("/dev/zero", link.c_str()) == 0);
  CHECK_FALSE(read_worker_file(link, 100, 0, false, &problem));
  CHECK(problem == "is a symbolic link");
  CHECK_FALSE(read_worker_file(link, 100, 0, true, &problem));  // followed: a device
  CHECK(problem == "is a device");
  CHECK_FALSE(read_worker_file((d.path / "missing").string(), 100, 0, false, &problem));
  CHECK(read_tail(f, 3) == "789");
  CHECK(read_tail(fifo, 3).empty());
}

TEST_CASE("an error file that is not a regular file, or too large, is noted and never read whole") {
  TempDir d;
  FailureReport r;
  r.error_file = (d.path / "fifo.json").string();
  REQUIRE(::mkfifo(r.error_file.c_str(), 0600) == 0);
  load_error_file(r);  // returns at once
  CHECK_FALSE(r.error);
  CHECK_THAT(r.note, Contains("could not be used: is a FIFO"));
  CHECK(error_file_message(r.error_file).empty());

  FailureReport big;
  big.error_file = (d.path / "big.json").string();
  {
    std::ofstream out(big.error_file, std::ios::binary);
    out << "{\"message\": \"" << std::string(kMaxErrorFileBytes, 'x') << "\"}";
  }
  load_error_file(big);
  CHECK_FALSE(big.error);
  CHECK_THAT(big.note, Contains("over the 1048576-byte read of an error file"));

  FailureReport none;
  none.error_file = (d.path / "absent.json").string();
  load_error_file(none);  // the rank wrote none: nothing to say
  CHECK(none.note.empty());
}

TEST_CASE("create_agent_file makes a regular file only, never blocking on a FIFO a worker put there") {
  TempDir d;
  std::string problem;
  const int fd = create_agent_file((d.path / "new.txt").string(), &problem);
  REQUIRE(fd >= 0);
  CHECK(::write(fd, "x", 1) == 1);
  ::close(fd);
  const std::string fifo = (d.path / "stacks-native.txt").string();
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK(create_agent_file(fifo, &problem) == -1);  // open(2) blocked until a reader came before
  CHECK_FALSE(problem.empty());
  const std::string link = (d.path / "diagnosis.txt").string();
  REQUIRE(::symlink((d.path / "elsewhere").c_str(), link.c_str()) == 0);
  CHECK(create_agent_file(link, &problem) == -1);
  CHECK(problem == "is a symbolic link");
  CHECK_FALSE(fs::exists(d.path / "elsewhere"));
}

TEST_CASE("the diagnosis parses what ranks wrote by hand, bounded: hostile text neither crashes nor floods it") {
  // Before: std::regex recursed once per character, and a 30,000-character run after "OpType="
  // (in a rank's stderr or error file), a 300 KB path in a faulthandler frame line or a long
  // symbol in eu-stack's output overflowed the agent's stack (SIGSEGV: no failure summary, no
  // restart); a line number past INT_MAX threw std::stoi's out_of_range out of the agent.
  const std::string long_run(1'000'000, 'A');
  CHECK(collective_timeout_in("Timed out OpType=" + long_run) == "a collective");  // too long to be an op: none named
  CHECK(collective_timeout_in("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3, OpType=ALLREDUCE)") ==
        "all_reduce");
  CHECK(collective_timeout_in("RuntimeError: Timed out\n  File \"t.py\", line 3, in all_gather_object\n") ==
        "all_gather_object");
  CHECK(collective_timeout_in("timeout in all_gather then in reduce_scatter_tensor here") == "reduce_scatter_tensor");
  CHECK(collective_timeout_in("no such thing in all_reduce") == "");  // not a timeout
  // A lost peer is a collective failure too: torch 1.13's gloo says "reset", 2.x's "closed".
  CHECK(collective_timeout_in("RuntimeError: [pair.cc:589] Read error [127.0.0.1]:1715: Connection reset by peer") ==
        "a collective");
  CHECK(collective_timeout_in("  in all_reduce\n    work.wait()\nRuntimeError: Connection closed by peer [::1]:7") ==
        "all_reduce");
  CHECK(collective_timeout_in(std::string(2'000'000, 'x') + " Timeout in barrier") == "barrier");

  CHECK_FALSE(parse_python_frame("  File \"" + std::string(300'000, 'p') + "\", line 2 in f"));
  CHECK_FALSE(parse_python_frame("  File \"t.py\", line 99999999999 in f"));
  CHECK_FALSE(parse_python_frame("  File \"t.py\", line 7 in " + std::string(100'000, 'f')));
  const auto frame = parse_python_frame("  File \"/x/t.py\", line 7 in step");
  REQUIRE(frame);
  CHECK(frame->file == "/x/t.py");
  CHECK(frame->line == 7);
  CHECK(frame->func == "step");
  CHECK(python_where("Current thread 0x1 (most recent call first):\n  File \"t.py\", line 99999999999 in f\n").empty());
  CHECK(python_where("Thread 0x1:\n  File \"" + std::string(300'000, 'p') + "\", line 2 in <module>\n").empty());

  CHECK(native_frame_symbol("TID 5:\n#0  0x00007f0000000001 __clock_nanosleep\n#1  0x0000000000401000 main\n") ==
        "__clock_nanosleep");
  CHECK(native_frame_symbol("#0  0x00007f0000000001\n#1  0x0000000000401000 main\n") == "main");
  CHECK(native_frame_symbol("#0  0x1 " + std::string(300'000, 's')).size() == 512);
  CHECK(native_frame_symbol("no frames here").empty());
}

TEST_CASE("the failed rank's line says how its collective failed: a lost peer is not a timeout") {
  CHECK(collective_failure_words("RuntimeError: [pair.cc:589] Read error [127.0.0.1]:1715: Connection reset by peer") ==
        "lost a peer in");
  // A source line of the traceback may say "timeout"; the peer's message decides.
  CHECK(collective_failure_words("    dist.init_process_group(\"gloo\", timeout=t)\n  in all_reduce\n"
                                 "RuntimeError: Connection closed by peer [::1]:7") == "lost a peer in");
  CHECK(collective_failure_words("torch.distributed.DistBackendError: NCCL communicator was aborted") ==
        "lost a peer in");
  CHECK(collective_failure_words("RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed "
                                 "out waiting 5000ms for recv operation to complete") == "timed out in");
  CHECK(collective_failure_words(
            "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3, OpType=ALLREDUCE)") == "timed out in");
  CHECK(collective_failure_words("torch.distributed.DistBackendError: NCCL error in: ...") == "failed in");
  // NCCL's watchdog aborts the communicator of the rank that timed out: the timeout decides.
  CHECK(collective_failure_words("RuntimeError: NCCL communicator was aborted on rank 0. Original reason for failure "
                                 "was: [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, "
                                 "OpType=ALLREDUCE, Timeout(ms)=600000) ran for 600123 milliseconds before timing "
                                 "out.") == "timed out in");
  CHECK(collective_failure_words("RuntimeError: NCCL communicator was aborted on rank 1. Original reason for failure "
                                 "was: NCCL error: remote process exited or there was a network error, "
                                 "ncclRemoteError") == "lost a peer in");
  CHECK(collective_failure_words("RuntimeError: Timeout in barrier") == "timed out in");
}

TEST_CASE("fatal_where names the frame of the thread a fatal signal hit, from the last crash dump") {
  TempDir dir;
  const std::string file = (dir.path / "stacks.txt").string();
  auto write = [&](const std::string& text) { dir.file("stacks.txt", text); };
  write("");
  CHECK(fatal_where(file).empty());
  CHECK(fatal_where((dir.path / "missing").string()).empty());
  // An on-demand dump earlier in the file is not a crash.
  write("Current thread 0x1 (most recent call first):\n  File \"a.py\", line 3 in <module>\n");
  CHECK(fatal_where(file).empty());
  // The signal hit a helper thread: its frame, not the main thread's (listed after it).
  write(
      "Thread 0x1 (most recent call first):\n  File \"old.py\", line 1 in <module>\n"
      "Fatal Python error: Segmentation fault\n\n"
      "Current thread 0x2 (most recent call first):\n  File \"ext.py\", line 7 in crash\n"
      "  File \"/usr/lib/python3.11/threading.py\", line 975 in run\n\n"
      "Thread 0x1 (most recent call first):\n  File \"train.py\", line 9 in <module>\n");
  CHECK(fatal_where(file) == "crash at ext.py:7 (not known to be the main thread)");
  // Two crashes (a forked child's, then the rank's): the last.
  write(
      "Fatal Python error: Aborted\n\nCurrent thread 0x3 (most recent call first):\n  File \"x.py\", line 1 in f\n"
      "Fatal Python error: Segmentation fault\n\nCurrent thread 0x4 (most recent call first):\n"
      "  File \"y.py\", line 2 in g\n  File \"y.py\", line 5 in <module>\n");
  CHECK(fatal_where(file) == "g at y.py:2");
}

TEST_CASE("sample_progress counts the CPU a process used, whatever its command name holds") {
  // A command name with ") " and digits in it: the fields are counted from the last ')'.
  std::array<char, 17> saved{};
  REQUIRE(::prctl(PR_GET_NAME, saved.data()) == 0);
  REQUIRE(::prctl(PR_SET_NAME, "x) 1 2 3 4 5 6") == 0);
  const auto before = sample_progress({::getpid()});
  const auto ticks = process_cpu_ticks(::getpid());
  // Spend 60 ms of CPU (clock ticks are 10 ms on Linux): the sample must grow.
  timespec start{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &start);
  volatile std::uint64_t sink = 0;
  for (;;) {
    for (int i = 0; i < 100000; ++i) sink = sink + static_cast<std::uint64_t>(i);
    timespec now{};
    ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &now);
    if ((now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000 >= 60) break;
  }
  const auto after = sample_progress({::getpid()});
  ::prctl(PR_SET_NAME, saved.data());
  REQUIRE(ticks.has_value());
  CHECK(*ticks >= before.ticks);
  CHECK(after.ticks >= before.ticks + 3);
  // A process that does not exist counts nothing.
  CHECK_FALSE(process_cpu_ticks(0).has_value());
  CHECK(sample_progress({0}).ticks == 0);
}
