// Stacks, culprits and progress samples; see diagnosis.hpp.
#include "ddprun/agent/diagnosis.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <csignal>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>
#include <thread>

#include "ddprun/agent/containment.hpp"
#include "ddprun/agent/process.hpp"
#include "ddprun/common/error.hpp"
#include "ddprun/common/strings.hpp"

namespace ddprun::agent {

namespace {

// Per rank: how long a faulthandler dump or an eu-stack run may take before we give up.
constexpr std::chrono::milliseconds kStackBound{2000};
// The most of one rank's dump read back (faulthandler stops at 100 threads of 100 frames).
// Every rank's dump is held at once while the diagnosis is built: 2 MiB each (a real one is tens
// of KB; 64 ranks that each write garbage then hold 128 MiB, not half a GiB).
constexpr std::size_t kMaxDumpBytes = 2u << 20;

constexpr const char* kSiteCustomize =
    R"PY(# Installed by ddprun (see docs/errors.md): lets the agent ask this rank for the stacks of
# all its threads (faulthandler on a real-time signal, written to the file the agent named; the
# same file gets them on a fatal signal) and records an uncaught exception's traceback next to it. Only the rank process itself
# registers (the variable is removed for its children); then the sitecustomize this file
# shadows, if any, runs as usual. It also drops NCCL_ASYNC_ERROR_HANDLING where the torch on the
# path is 2.2 or later (below).
import os
import sys


def _ddprun_nccl_env():
    # ddprun sets NCCL_ASYNC_ERROR_HANDLING (all torch 1.x reads) and TORCH_NCCL_ASYNC_ERROR_HANDLING
    # (its name since torch 2.2, which wins over the old one there and warns on every rank that
    # still has the old one). Where torch/version.py on the path says 2.2 or later, the old name
    # goes: the same value stands, without the warning. Nothing is imported to find out.
    if "NCCL_ASYNC_ERROR_HANDLING" not in os.environ or "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ:
        return
    for entry in sys.path:
        try:
            with open(os.path.join(entry or ".", "torch", "version.py")) as f:
                text = f.read(8192)
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("__version__"):
                parts = line.split("=", 1)[1].strip().strip("'\"").split(".")
                try:
                    if (int(parts[0]), int(parts[1])) >= (2, 2):
                        del os.environ["NCCL_ASYNC_ERROR_HANDLING"]
                except (ValueError, IndexError):
                    pass
                break
        return


def _ddprun_setup():
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    path = os.environ.pop("DDPRUN_STACKS_FILE", None)
    if path:
        try:
            import faulthandler

            f = open(path, "w")
            signum = int(os.environ.get("DDPRUN_STACKS_SIGNAL", "61"))
            faulthandler.register(signum, file=f, all_threads=True)
            # A fatal signal (a C extension's SIGSEGV, an abort) writes the Python stacks to the
            # same file ("Fatal Python error: ..."), and the failure block names the frame. Not
            # when the user enabled faulthandler (PYTHONFAULTHANDLER, -X faulthandler): theirs
            # goes where they asked.
            ours = not faulthandler.is_enabled()
            if ours:
                faulthandler.enable(file=f, all_threads=True)
            sys._ddprun_stacks_file = f
            rank_pid = os.getpid()

            def forked():
                # A forked child (a DataLoader worker) is not the rank: its crash goes to its
                # stderr, as with -X faulthandler, not into the file read as the rank's. File
                # descriptor 2, not sys.stderr: a file object would be flushed, under a lock
                # another thread of the rank may have held at the fork.
                try:
                    faulthandler.unregister(signum)
                    if ours:
                        faulthandler.enable(file=2, all_threads=True)
                except Exception:
                    try:
                        faulthandler.disable()
                    except Exception:
                        pass

            if hasattr(os, "register_at_fork"):
                os.register_at_fork(after_in_child=forked)
            previous = sys.excepthook

            def hook(kind, value, tb):
                # A forked child's uncaught exception is its own: the record is the rank's.
                if os.getpid() == rank_pid:
                    try:
                        import traceback

                        # Any message, an undecodable byte's surrogate escape included: strict
                        # encoding lost the exception's own line, which the diagnosis names.
                        with open(path + ".exception", "w", encoding="utf-8", errors="backslashreplace") as out:
                            traceback.print_exception(kind, value, tb, file=out)
                    except Exception:
                        pass
                previous(kind, value, tb)

            sys.excepthook = hook
        except Exception:
            pass
    try:
        _ddprun_nccl_env()
    except Exception:
        pass
    me = sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # noqa: F401  (the shadowed one)
    except ImportError:
        sys.modules["sitecustomize"] = me


_ddprun_setup()
del _ddprun_setup, _ddprun_nccl_env
)PY";

// /proc files: small, and the kernel's own.
std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

off_t file_size(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? st.st_size : -1;
}

// Whether `pid` catches `sig` (SigCgt in /proc/PID/status).
bool catches(pid_t pid, int sig) {
  // read(2), not an ifstream: the teardown asks this too, and a launch builds no C++ locale.
  // (Not read_worker_file: it reads up to the size fstat gives, 0 for a /proc file.)
  const int fd = ::open(("/proc/" + std::to_string(pid) + "/status").c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  std::string buf(8192, '\0');
  std::size_t got = 0;
  for (;;) {
    if (got == buf.size()) buf.resize(buf.size() * 2);
    const ssize_t n = ::read(fd, buf.data() + got, buf.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0 || buf.size() > 64 * 1024) break;
    got += static_cast<std::size_t>(n);
  }
  ::close(fd);
  buf.resize(got);
  const auto at = buf.find("\nSigCgt:");
  if (at == std::string::npos) return false;
  const char* from = buf.data() + at + 8;
  const char* end = buf.data() + buf.size();
  while (from < end && (*from == ' ' || *from == '\t')) ++from;
  std::uint64_t mask = 0;
  if (std::from_chars(from, end, mask, 16).ec != std::errc{}) return false;
  return sig >= 1 && sig <= 64 && ((mask >> (sig - 1)) & 1ULL) != 0;
}

std::string find_on_path(const std::string& name) {
  for (const char* dir : {"/usr/bin", "/bin", "/usr/local/bin"}) {
    const std::string p = std::string(dir) + "/" + name;
    if (::access(p.c_str(), X_OK) == 0) return p;
  }
  return {};
}

std::string base_name(const std::string& path) {
  const auto s = path.rfind('/');
  return s == std::string::npos ? path : path.substr(s + 1);
}

std::string source_line(const std::string& file, int line, const std::string& proc_dir) {
  // The path comes from the rank's own dump: a regular file only (checked before any open: opening
  // some devices acts), its first 4 MiB. It names the file as the rank sees it: through the rank's
  // own root and working directory (/proc/PID/root, /proc/PID/cwd) when its pid is known, since a
  // rank in a chroot or a container has other files at the same paths (the agent's torch showed
  // the wrong line of distributed_c10d.py for a chrooted torch 2.6 rank).
  const std::string path = proc_dir.empty()        ? file
                           : file.starts_with('/') ? proc_dir + "/root" + file
                                                   : proc_dir + "/cwd/" + file;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return {};
  std::istringstream in(read_worker_file(path, 4u << 20, 0, true).value_or(std::string()));
  std::string text;
  for (int i = 1; std::getline(in, text); ++i) {
    if (i == line) {
      const auto b = text.find_first_not_of(" \t");
      return b == std::string::npos ? std::string() : text.substr(b);
    }
  }
  return {};
}

}  // namespace

int stacks_signal() { return SIGRTMAX - 3; }

bool may_run_python(const std::string& executable, const std::vector<std::string>& argv) {
  if (base_name(executable).find("python") != std::string::npos) return true;
  for (const auto& a : argv) {
    if (a.find("python") != std::string::npos) return true;
  }
  char magic[4] = {};
  const int fd = ::open(executable.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return true;  // cannot tell: install it
  const auto n = ::read(fd, magic, sizeof(magic));
  ::close(fd);
  return !(n == 4 && magic[0] == '\x7f' && magic[1] == 'E' && magic[2] == 'L' && magic[3] == 'F');
}

std::string install_python_hook(const std::string& job_dir) {
  const std::string dir = job_dir + "/.ddprun-python";
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
    throw Error("cannot create " + dir + ": " + std::strerror(errno));
  }
  std::ofstream out(dir + "/sitecustomize.py", std::ios::binary | std::ios::trunc);
  out << kSiteCustomize;
  if (!out) throw Error("cannot write " + dir + "/sitecustomize.py");
  return dir;
}

std::vector<RankStacks> collect_stacks(const std::vector<StackTarget>& targets) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  const std::string bound = std::to_string(kStackBound.count()) + " ms";
  std::vector<RankStacks> out(targets.size());
  auto done_at = [&](RankStacks& s, Clock::time_point at) {
    s.millis = std::chrono::duration<double, std::milli>(at - t0).count();
  };
  // 1. Every rank with the hook is asked at once; the dumps are written in parallel.
  struct Dump {
    std::size_t index = 0;
    std::string file;
    std::size_t before = 0;  // bytes of earlier dumps (a restarted attempt's rank dir is new, but be safe)
    std::size_t last = 0;
    Clock::time_point changed;
    bool done = false;
  };
  std::vector<Dump> dumps;
  std::vector<std::size_t> native;
  for (std::size_t i = 0; i < targets.size(); ++i) {
    const auto& t = targets[i];
    out[i].rank = t.rank;
    out[i].local_rank = t.local_rank;
    out[i].pid = t.pid;
    if (!catches(t.pid, stacks_signal())) {
      native.push_back(i);
      continue;
    }
    Dump d;
    d.index = i;
    d.file = t.rank_dir + "/stacks.txt";
    d.before = d.last = static_cast<std::size_t>(std::max<off_t>(file_size(d.file), 0));
    d.changed = Clock::now();
    ::kill(t.pid, stacks_signal());
    dumps.push_back(std::move(d));
  }
  // faulthandler writes line by line from the signal handler, the main thread last. A dump is
  // complete once its last line is the main thread's outermost frame; a dump that never shows one
  // (a main thread already past its module, a stack cut at 100 frames) once it has been still for
  // kDumpQuiet. A preempted writer pauses for milliseconds, so stillness alone is not enough.
  constexpr auto kDumpQuiet = std::chrono::milliseconds(150);
  constexpr auto kMarkerQuiet = std::chrono::milliseconds(10);
  const auto deadline = t0 + kStackBound;
  std::size_t open = dumps.size();
  while (open > 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    const auto now = Clock::now();
    for (auto& d : dumps) {
      if (d.done) continue;
      const auto size = static_cast<std::size_t>(std::max<off_t>(file_size(d.file), 0));
      if (size != d.last) {
        d.last = size;
        d.changed = now;
        continue;
      }
      if (size <= d.before) continue;
      const bool quiet = now - d.changed >= kDumpQuiet;
      // The marker line may also be a mid-stack frame (a module being imported, -m's own
      // module) where the writer was preempted: it counts once the file has been still a while.
      if (!quiet && now - d.changed < kMarkerQuiet) continue;
      const auto tail = read_worker_file(d.file, 4096, size > 4096 ? size - 4096 : 0);
      if (quiet || (tail && dump_complete(*tail))) {
        d.done = true;
        --open;
        done_at(out[d.index], now);
      }
    }
  }
  for (auto& d : dumps) {
    RankStacks& s = out[d.index];
    if (d.last <= d.before) {
      s.where = "no faulthandler dump within " + bound;
      native.push_back(d.index);
      continue;
    }
    std::size_t size = 0;
    s.text = read_worker_file(d.file, kMaxDumpBytes, d.before, false, nullptr, &size).value_or(std::string());
    s.method = "faulthandler";
    s.file = d.file;
    s.where = python_where(s.text, "/proc/" + std::to_string(s.pid));
    if (!d.done) {
      done_at(s, Clock::now());
      s.where += std::string(s.where.empty() ? "" : " ") + "(the dump was still being written after " + bound + ")";
    }
  }
  if (native.empty()) return out;

  // 2. The others through eu-stack, all at once, with a bound of their own.
  const std::string eu = find_on_path("eu-stack");
  struct Run {
    std::size_t index;
    std::string file;
    SpawnResult res;
  };
  std::vector<Run> runs;
  for (const std::size_t i : native) {
    RankStacks& s = out[i];
    auto because = [&](const std::string& why) { s.where = s.where.empty() ? why : s.where + "; " + why; };
    if (eu.empty()) {
      because(s.where.empty() ? "no stacks: not a Python rank with the ddprun hook, and eu-stack (elfutils) is not "
                                "installed"
                              : "eu-stack (elfutils) is not installed");
      continue;
    }
    Run r{i, targets[i].rank_dir + "/stacks-native.txt", {}};
    std::string why;
    const int fd = create_agent_file(r.file, &why);
    if (fd < 0) {
      because("cannot write " + r.file + ": " + why);
      continue;
    }
    SpawnRequest req;
    req.path = eu;
    req.argv = {"eu-stack", "-p", std::to_string(targets[i].pid)};
    req.envp = {"PATH=/usr/bin:/bin", "LC_ALL=C"};
    req.stdout_fd = fd;
    req.stderr_fd = fd;
    r.res = spawn_worker(req);
    ::close(fd);
    if (r.res.pid <= 0) {
      because("cannot run eu-stack");
      continue;
    }
    runs.push_back(std::move(r));
  }
  const auto eu_deadline = Clock::now() + kStackBound;
  std::vector<bool> finished(runs.size(), false);
  std::size_t running = runs.size();
  while (running > 0) {
    std::vector<pollfd> fds;
    std::vector<std::size_t> which;
    for (std::size_t k = 0; k < runs.size(); ++k) {
      if (finished[k]) continue;
      fds.push_back({runs[k].res.pidfd, POLLIN, 0});
      which.push_back(k);
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(eu_deadline - Clock::now()).count();
    if (left <= 0) break;
    const int ready = ::poll(fds.data(), fds.size(), static_cast<int>(left));
    if (ready == 0 || (ready < 0 && errno != EINTR)) break;
    if (ready < 0) continue;
    for (std::size_t j = 0; j < fds.size(); ++j) {
      if (fds[j].revents == 0) continue;
      finished[which[j]] = true;
      --running;
      done_at(out[runs[which[j]].index], Clock::now());
    }
  }
  for (std::size_t k = 0; k < runs.size(); ++k) {
    Run& r = runs[k];
    RankStacks& s = out[r.index];
    const pid_t pid = targets[r.index].pid;
    const bool timed_out = !finished[k];
    if (timed_out) {
      signal_group(r.res.pid, SIGKILL);
      done_at(s, Clock::now());
    }
    reap(r.res.pid, r.res.pidfd);
    s.text = read_worker_file(r.file, kMaxDumpBytes).value_or(std::string());
    s.file = r.file;
    s.method = "eu-stack";
    // Only the main thread (TID == pid) says where the rank is: torch's helper threads sit in
    // c10d/gloo code whatever the main thread does.
    const std::string tid = "TID " + std::to_string(pid) + ":";
    if (const auto b = s.text.find(tid); b != std::string::npos) {
      const auto e = s.text.find("\nTID ", b + tid.size());
      s.main_thread = s.text.substr(b, e == std::string::npos ? std::string::npos : e - b);
    }
    std::string where;
    if (timed_out) {
      where = "eu-stack did not finish within " + bound;
    } else {
      // The innermost frame with a symbol: "#2  0x... clock_nanosleep".
      const std::string symbol = native_frame_symbol(s.main_thread);
      where = !symbol.empty() ? terminal_safe_prefix(symbol, 160, false) + " (native, main thread)"
                              : "no named frame in the main thread (eu-stack)";
    }
    // A faulthandler that did not answer stays said: it is why eu-stack was run.
    s.where = s.where.empty() ? where : where + " (" + s.where + ")";
  }
  return out;
}

bool dump_complete(std::string_view text) {
  // The last line: the main thread's outermost frame, a script's or -c's "<module>", or runpy's
  // "_run_module_as_main" under -m.
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.remove_suffix(1);
  if (text.size() == 0) return false;
  const auto nl = text.rfind('\n');
  const std::string_view last = nl == std::string_view::npos ? text : text.substr(nl + 1);
  if (last.find("File \"") == std::string_view::npos) return false;
  return last.ends_with(" in <module>") || last.ends_with(" in _run_module_as_main");
}

std::optional<PythonFrame> parse_python_frame(std::string_view line) {
  // `File "PATH", line N in FUNC`, by hand: the dump is the rank's to write (a hostile or broken
  // one included), and std::regex recursed once per character of a long path, overflowing the
  // agent's stack. Paths over 4 KiB and names over 512 bytes (faulthandler cuts at 500) are not
  // frames; the line number must fit an int.
  constexpr std::string_view open = "File \"";
  const auto f = line.find(open);
  if (f == std::string_view::npos) return std::nullopt;
  const std::size_t path_begin = f + open.size();
  const auto path_end = line.find('"', path_begin);
  if (path_end == std::string_view::npos || path_end == path_begin || path_end - path_begin > 4096) return std::nullopt;
  std::string_view rest = line.substr(path_end + 1);
  constexpr std::string_view at_line = ", line ";
  if (!rest.starts_with(at_line)) return std::nullopt;
  rest.remove_prefix(at_line.size());
  int number = 0;
  const auto [ptr, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), number);
  if (ec != std::errc() || ptr == rest.data() || number < 0) return std::nullopt;
  rest.remove_prefix(static_cast<std::size_t>(ptr - rest.data()));
  constexpr std::string_view in = " in ";
  if (!rest.starts_with(in)) return std::nullopt;
  rest.remove_prefix(in.size());
  std::size_t n = 0;
  while (n < rest.size() && std::isspace(static_cast<unsigned char>(rest[n])) == 0) ++n;
  if (n == 0 || n > 512) return std::nullopt;
  return PythonFrame{std::string(line.substr(path_begin, path_end - path_begin)), number,
                     std::string(rest.substr(0, n))};
}

std::string native_frame_symbol(std::string_view text) {
  // eu-stack's "#2  0x00007f... clock_nanosleep": the first such line's symbol (the innermost
  // named frame), by hand for the reason parse_python_frame gives (the symbols are the
  // worker's). A symbol over 512 bytes is cut.
  std::size_t pos = 0;
  while (pos < text.size()) {
    const auto nl = text.find('\n', pos);
    std::string_view line = text.substr(pos, nl == std::string_view::npos ? std::string_view::npos : nl - pos);
    pos = nl == std::string_view::npos ? text.size() : nl + 1;
    const auto hash = line.find('#');
    if (hash == std::string_view::npos) continue;
    line.remove_prefix(hash + 1);
    std::size_t i = 0;
    while (i < line.size() && std::isdigit(static_cast<unsigned char>(line[i])) != 0) ++i;
    if (i == 0) continue;
    std::size_t j = i;
    while (j < line.size() && (line[j] == ' ' || line[j] == '\t')) ++j;
    if (j == i || !line.substr(j).starts_with("0x")) continue;
    std::size_t k = j + 2;
    while (k < line.size() && std::isxdigit(static_cast<unsigned char>(line[k])) != 0) ++k;
    if (k == j + 2) continue;
    std::size_t m = k;
    while (m < line.size() && (line[m] == ' ' || line[m] == '\t')) ++m;
    if (m == k) continue;
    std::size_t e = m;
    while (e < line.size() && std::isspace(static_cast<unsigned char>(line[e])) == 0) ++e;
    if (e == m) continue;
    return std::string(line.substr(m, std::min<std::size_t>(e - m, 512)));
  }
  return {};
}

std::string fatal_where(const std::string& stacks_file) {
  const std::string text = read_tail(stacks_file, 256 * 1024);
  const std::size_t at = text.rfind("Fatal Python error: ");
  if (at == std::string::npos) return {};
  // The thread the signal hit is "Current thread"; the others follow as "Thread 0x...".
  std::string dump = text.substr(at);
  if (const std::size_t cur = dump.find("Current thread "); cur != std::string::npos) {
    const std::size_t next = dump.find("\nThread 0x", cur);
    dump = dump.substr(cur, next == std::string::npos ? std::string::npos : next - cur + 1);
  }
  return python_where(dump);
}

std::string python_where(const std::string& text, const std::string& proc_dir) {
  // faulthandler: "Current thread 0x... (most recent call first):" or "Thread 0x...", then
  // frames "  File \"path\", line N in func". Prefer the thread that holds <module> (the main
  // thread); its first frame is the innermost one.
  std::istringstream in(text);
  std::string line;
  std::vector<std::vector<std::string>> raw;
  while (std::getline(in, line)) {
    if (line.find("hread 0x") != std::string::npos || line.rfind("Stack (most recent", 0) == 0) {
      raw.emplace_back();
      continue;
    }
    if (raw.empty()) raw.emplace_back();
    if (line.find("File \"") != std::string::npos) raw.back().push_back(line);
  }
  const std::vector<std::string>* best = nullptr;
  bool main_thread = false;
  for (const auto& t : raw) {
    if (t.empty()) continue;
    if (best == nullptr) best = &t;
    if (dump_complete(t.back())) {
      best = &t;
      main_thread = true;
      break;
    }
  }
  if (best == nullptr) return {};
  const auto frame = parse_python_frame(best->front());
  if (!frame) return {};
  const auto& [file, ln, func] = *frame;
  // The rank's text (its dump, its source file) as a line of ddprun's report: cut and escaped, so
  // that a control character in a path or a source line cannot recolour the terminal or forge a
  // line, and a minified source line of a megabyte does not become the report.
  std::string out = terminal_safe_prefix(func, 128, false) + " at " +
                    terminal_safe_prefix(base_name(file), 128, false) + ":" + std::to_string(ln);
  if (const std::string src = source_line(file, ln, proc_dir); !src.empty()) {
    out += " (`" + terminal_safe_prefix(src, 160, false) + "`)";
  }
  // No thread of the dump holds a module's frame: the one shown may be a helper thread.
  if (!main_thread) out += " (not known to be the main thread)";
  return out;
}

namespace {

// The messages of a peer lost in a collective: gloo's (torch 2.x, then 1.13) and NCCL's.
constexpr std::string_view kPeerLost[] = {"Connection closed by peer", "Connection reset by peer",
                                          "NCCL communicator was aborted", "ncclRemoteError"};

}  // namespace

std::string_view collective_failure_words(const std::string& text) {
  const auto has = [&](std::string_view t) { return text.find(t) != std::string::npos; };
  // A timeout's own words first: NCCL's watchdog aborts the communicator of a rank that timed out
  // ("NCCL communicator was aborted on rank 0. Original reason for failure was: [Rank 0] Watchdog
  // caught collective operation timeout: ..."). Then a lost peer's message, then a bare
  // "timeout", which may be any source line of the traceback (`init_process_group(timeout=...)`).
  constexpr std::string_view kTimedOut[] = {"Watchdog caught collective operation timeout", "Timed out", "timed out"};
  if (std::any_of(std::begin(kTimedOut), std::end(kTimedOut), has)) return "timed out in";
  if (std::any_of(std::begin(kPeerLost), std::end(kPeerLost), has)) return "lost a peer in";
  if (has("Timeout") || has("timeout")) return "timed out in";
  return "failed in";
}

std::string collective_timeout_in(const std::string& text) {
  // Plain searches, no std::regex: the text is the rank's (up to 1 MiB of its error file and
  // output), and libstdc++'s regex recursed once per character of a long run.
  // A peer lost in the collective counts too (a peer that died or tore its process group down):
  // gloo's "Connection closed by peer" (torch 2.x) and "Read error ...: Connection reset by peer"
  // (1.13), an aborted NCCL communicator.
  constexpr std::string_view kTimeouts[] = {"Timed out",        "timed out",
                                            "Timeout",          "timeout",
                                            "DistBackendError", "Watchdog caught collective operation timeout"};
  const auto has = [&](std::string_view t) { return text.find(t) != std::string::npos; };
  if (std::none_of(std::begin(kTimeouts), std::end(kTimeouts), has) &&
      std::none_of(std::begin(kPeerLost), std::end(kPeerLost), has)) {
    return {};
  }
  // The last "in <collective>" (a traceback's innermost frame comes last), as a whole word.
  constexpr std::string_view kCalls[] = {"all_reduce",
                                         "all_gather_into_tensor",
                                         "all_gather_object",
                                         "all_gather",
                                         "reduce_scatter_tensor",
                                         "reduce_scatter",
                                         "broadcast_object_list",
                                         "broadcast",
                                         "barrier",
                                         "monitored_barrier",
                                         "all_to_all_single",
                                         "all_to_all",
                                         "reduce",
                                         "gather",
                                         "scatter",
                                         "send",
                                         "recv"};
  const auto word_char = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_'; };
  std::string last;
  std::size_t last_at = 0;
  for (std::string_view name : kCalls) {
    const std::string needle = "in " + std::string(name);
    for (auto at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) {
      const std::size_t after = at + needle.size();
      if (after < text.size() && word_char(text[after])) continue;  // all_gather in all_gather_object
      if (last.empty() || at > last_at) {                           // whole words: two names never match at one place
        last = std::string(name);
        last_at = at;
      }
    }
  }
  if (last.empty()) {
    // NCCL watchdog: WorkNCCL(SeqNum=.., OpType=ALLREDUCE, ..). Scanned by hand: the text is the
    // worker's, and std::regex recurses once per character of a run (a long one overflowed the
    // agent's stack).
    constexpr std::string_view key = "OpType=";
    if (const auto at = text.find(key); at != std::string::npos) {
      std::size_t e = at + key.size();
      while (e < text.size() && (std::isupper(static_cast<unsigned char>(text[e])) != 0 || text[e] == '_')) ++e;
      const std::size_t n = e - (at + key.size());
      if (n > 0 && n <= 64) {
        last = text.substr(at + key.size(), n);
        for (auto& c : last) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
        if (last == "allreduce") last = "all_reduce";
      }
    }
  }
  return last.empty() ? std::string("a collective") : last;
}

bool in_collective(const std::string& stacks) {
  return stacks.find("distributed_c10d.py") != std::string::npos || stacks.find("c10d::") != std::string::npos ||
         stacks.find("gloo::") != std::string::npos || stacks.find("ncclKernel") != std::string::npos;
}

Progress sample_progress(const std::vector<pid_t>& pids) {
  Progress p;
  for (pid_t pid : pids) {
    const std::string base = "/proc/" + std::to_string(pid);
    p.ticks += process_cpu_ticks(pid).value_or(0);
    std::istringstream io(read_all(base + "/io"));
    std::string key;
    std::uint64_t v = 0;
    while (io >> key >> v) {
      if (key == "wchar:") p.wchar += v;
    }
  }
  return p;
}

int create_agent_file(const std::string& path, std::string* problem) {
  // O_NONBLOCK: a FIFO a worker put there fails (ENXIO without a reader) instead of blocking
  // the agent; O_NOFOLLOW: no link is followed; then only a regular file is kept.
  const int fd =
      ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY, 0644);
  if (fd < 0) {
    if (problem) *problem = errno == ELOOP ? "is a symbolic link" : std::strerror(errno);
    return -1;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    if (problem) *problem = "is not a regular file";
    return -1;
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  return fd;
}

std::optional<std::string> read_worker_file(const std::string& path, std::size_t max_bytes, std::size_t from,
                                            bool follow_links, std::string* problem, std::size_t* size) {
  auto fail = [&](std::string why) -> std::optional<std::string> {
    if (problem) *problem = std::move(why);
    return std::nullopt;
  };
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY | (follow_links ? 0 : O_NOFOLLOW));
  if (fd < 0) return fail(errno == ELOOP ? "is a symbolic link" : std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const auto mode = st.st_mode & S_IFMT;
    ::close(fd);
    return fail(mode == S_IFIFO                      ? "is a FIFO"
                : mode == S_IFDIR                    ? "is a directory"
                : mode == S_IFCHR || mode == S_IFBLK ? "is a device"
                : mode == S_IFSOCK                   ? "is a socket"
                                                     : "is not a regular file");
  }
  const auto whole = static_cast<std::size_t>(st.st_size);
  if (size) *size = whole;
  std::string out;
  if (from < whole) {
    out.resize(std::min(max_bytes, whole - from));
    std::size_t got = 0;
    while (got < out.size()) {
      const ssize_t n = ::pread(fd, out.data() + got, out.size() - got, static_cast<off_t>(from + got));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;  // shrunk meanwhile, or an error: what was read stands
      got += static_cast<std::size_t>(n);
    }
    out.resize(got);
  }
  ::close(fd);
  return out;
}

bool catches_signal(pid_t pid, int sig) { return catches(pid, sig); }

std::string read_tail(const std::string& path, std::size_t max_bytes) {
  std::size_t size = 0;
  if (!read_worker_file(path, 0, 0, false, nullptr, &size)) return {};
  return read_worker_file(path, max_bytes, size > max_bytes ? size - max_bytes : 0).value_or(std::string());
}

std::string format_bytes(std::uint64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.1f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return buf;
}

}  // namespace ddprun::agent
