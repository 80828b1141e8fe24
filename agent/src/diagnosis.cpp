// Stacks, culprits and progress samples; see diagnosis.hpp.
#include "ddprun/agent/diagnosis.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "ddprun/agent/process.hpp"
#include "ddprun/common/error.hpp"

namespace ddprun::agent {

namespace {

// Per rank: how long a faulthandler dump or an eu-stack run may take before we give up.
constexpr std::chrono::milliseconds kStackBound{2000};

constexpr const char* kSiteCustomize =
    R"PY(# Installed by ddprun (see docs/errors.md): lets the agent ask this rank for the stacks of
# all its threads (faulthandler on a real-time signal, written to the file the agent named)
# and records an uncaught exception's traceback next to it. Only the rank process itself
# registers (the variable is removed for its children); then the sitecustomize this file
# shadows, if any, runs as usual.
import os
import sys


def _ddprun_setup():
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    path = os.environ.pop("DDPRUN_STACKS_FILE", None)
    if path:
        try:
            import faulthandler

            f = open(path, "w")
            faulthandler.register(int(os.environ.get("DDPRUN_STACKS_SIGNAL", "61")), file=f, all_threads=True)
            sys._ddprun_stacks_file = f
            previous = sys.excepthook

            def hook(kind, value, tb):
                try:
                    import traceback

                    with open(path + ".exception", "w") as out:
                        traceback.print_exception(kind, value, tb, file=out)
                except Exception:
                    pass
                previous(kind, value, tb)

            sys.excepthook = hook
        except Exception:
            pass
    me = sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # noqa: F401  (the shadowed one)
    except ImportError:
        sys.modules["sitecustomize"] = me


_ddprun_setup()
del _ddprun_setup
)PY";

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
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("SigCgt:", 0) == 0) {
      const auto mask = std::stoull(line.substr(7), nullptr, 16);
      return ((mask >> (sig - 1)) & 1ULL) != 0;
    }
  }
  return false;
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

std::string source_line(const std::string& file, int line) {
  std::ifstream in(file);
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

RankStacks collect_stacks(pid_t pid, int rank, int local_rank, const std::string& rank_dir) {
  RankStacks s;
  s.rank = rank;
  s.local_rank = local_rank;
  s.pid = pid;
  const auto t0 = std::chrono::steady_clock::now();
  const auto deadline = t0 + kStackBound;
  auto finish = [&] {
    s.millis = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    return s;
  };
  if (catches(pid, stacks_signal())) {
    const std::string file = rank_dir + "/stacks.txt";
    const off_t before = std::max<off_t>(file_size(file), 0);
    ::kill(pid, stacks_signal());
    // faulthandler writes the whole dump from the signal handler in one go: done when the file
    // grew and stopped growing.
    off_t last = before;
    int stable = 0;
    while (std::chrono::steady_clock::now() < deadline) {
      const off_t now = file_size(file);
      if (now > before && now == last) {
        if (++stable >= 3) break;
      } else {
        stable = 0;
      }
      last = now;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (last > before) {
      const std::string all = read_all(file);
      s.text = all.substr(static_cast<std::size_t>(std::min<off_t>(before, static_cast<off_t>(all.size()))));
      s.method = "faulthandler";
      s.file = file;
      s.where = python_where(s.text);
      return finish();
    }
    s.where = "no faulthandler dump within " + std::to_string(kStackBound.count()) + " ms";
  }
  const std::string eu = find_on_path("eu-stack");
  if (eu.empty()) {
    if (s.where.empty())
      s.where = "no stacks: not a Python rank with the ddprun hook, and eu-stack (elfutils) is not installed";
    return finish();
  }
  const std::string file = rank_dir + "/stacks-native.txt";
  const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    s.where = "cannot write " + file + ": " + std::strerror(errno);
    return finish();
  }
  SpawnRequest req;
  req.path = eu;
  req.argv = {"eu-stack", "-p", std::to_string(pid)};
  req.envp = {"PATH=/usr/bin:/bin", "LC_ALL=C"};
  req.stdout_fd = fd;
  req.stderr_fd = fd;
  const SpawnResult res = spawn_worker(req);
  ::close(fd);
  if (res.pid <= 0) {
    s.where = "cannot run eu-stack";
    return finish();
  }
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
  pollfd p{res.pidfd, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(std::max<long>(left.count(), 1))) <= 0) {
    signal_group(res.pid, SIGKILL);
    s.where = "eu-stack did not finish within " + std::to_string(kStackBound.count()) + " ms";
  }
  reap(res.pid, res.pidfd);
  s.text = read_all(file);
  s.file = file;
  s.method = "eu-stack";
  // Only the main thread (TID == pid) says where the rank is: torch's helper threads sit in
  // c10d/gloo code whatever the main thread does.
  const std::string tid = "TID " + std::to_string(pid) + ":";
  if (const auto b = s.text.find(tid); b != std::string::npos) {
    const auto e = s.text.find("\nTID ", b + tid.size());
    s.main_thread = s.text.substr(b, e == std::string::npos ? std::string::npos : e - b);
  }
  if (s.where.empty()) {
    // The innermost frame with a symbol: "#2  0x... clock_nanosleep".
    static const std::regex frame(R"(#\d+[ \t]+0x[0-9a-f]+[ \t]+(\S+))");
    std::smatch m;
    s.where = std::regex_search(s.main_thread, m, frame) ? m[1].str() + " (native, main thread)"
                                                         : "no named frame in the main thread (eu-stack)";
  }
  return finish();
}

std::string python_where(const std::string& text) {
  // faulthandler: "Current thread 0x... (most recent call first):" or "Thread 0x...", then
  // frames "  File \"path\", line N in func". Prefer the thread that holds <module> (the main
  // thread); its first frame is the innermost one.
  static const std::regex frame(R"re(File "([^"]+)", line (\d+) in (\S+))re");
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
  for (const auto& t : raw) {
    if (t.empty()) continue;
    if (best == nullptr) best = &t;
    if (t.back().find("in <module>") != std::string::npos) {
      best = &t;
      break;
    }
  }
  if (best == nullptr) return {};
  std::smatch m;
  const std::string& top = best->front();
  if (!std::regex_search(top, m, frame)) return {};
  const std::string file = m[1].str();
  const int ln = std::stoi(m[2].str());
  std::string out = m[3].str() + " at " + base_name(file) + ":" + std::to_string(ln);
  if (const std::string src = source_line(file, ln); !src.empty()) out += " (`" + src + "`)";
  return out;
}

std::string collective_timeout_in(const std::string& text) {
  static const std::regex timeout(
      R"(([Tt]imed out|[Tt]imeout|DistBackendError|Watchdog caught collective operation timeout|Connection closed by peer))");
  if (!std::regex_search(text, timeout)) return {};
  static const std::regex call(
      R"(in (all_reduce|all_gather_into_tensor|all_gather_object|all_gather|reduce_scatter_tensor|reduce_scatter|broadcast_object_list|broadcast|barrier|monitored_barrier|all_to_all_single|all_to_all|reduce|gather|scatter|send|recv)\b)");
  std::string last;
  for (auto it = std::sregex_iterator(text.begin(), text.end(), call); it != std::sregex_iterator(); ++it) {
    last = (*it)[1].str();
  }
  if (last.empty()) {
    static const std::regex nccl(R"(OpType=([A-Z_]+))");  // NCCL watchdog: WorkNCCL(SeqNum=.., OpType=ALLREDUCE, ..)
    std::smatch m;
    if (std::regex_search(text, m, nccl)) {
      last = m[1].str();
      for (auto& c : last) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      if (last == "allreduce") last = "all_reduce";
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
    const std::string stat = read_all(base + "/stat");
    const auto close = stat.rfind(')');
    if (close != std::string::npos) {
      std::istringstream in(stat.substr(close + 2));
      std::string field;
      // Fields after the name: state(3) ... utime(14) stime(15), 1-based in proc(5).
      std::uint64_t utime = 0;
      std::uint64_t stime = 0;
      for (int i = 3; i <= 15 && in >> field; ++i) {
        if (i == 14) utime = std::stoull(field);
        if (i == 15) stime = std::stoull(field);
      }
      p.ticks += utime + stime;
    }
    std::istringstream io(read_all(base + "/io"));
    std::string key;
    std::uint64_t v = 0;
    while (io >> key >> v) {
      if (key == "wchar:") p.wchar += v;
    }
  }
  return p;
}

std::string read_tail(const std::string& path, std::size_t max_bytes) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return {};
  const auto size = static_cast<std::size_t>(in.tellg());
  const auto from = size > max_bytes ? size - max_bytes : 0;
  in.seekg(static_cast<std::streamoff>(from));
  std::string out(size - from, '\0');
  in.read(out.data(), static_cast<std::streamsize>(out.size()));
  return out;
}

std::string format_bytes(std::uint64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.1f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return buf;
}

}  // namespace ddprun::agent
