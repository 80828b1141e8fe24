// Job containment (cgroups, job token, watchdog); see containment.hpp and docs/containment.md.
#include "ddprun/agent/containment.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <string_view>
#include <system_error>
#include <thread>

#include <spdlog/spdlog.h>

#include "ddprun/agent/exit_status.hpp"
#include "ddprun/agent/job_dir.hpp"
#include "ddprun/agent/process.hpp"
#include "ddprun/common/error.hpp"
#include "ddprun/common/self_exe.hpp"
#include "ddprun/common/strings.hpp"

namespace ddprun::agent {

namespace {

constexpr const char* kTokenVar = "DDPRUN_JOB_TOKEN";
// Empty token scans in a row, 2 ms apart, that end the job's last proc sweep where processes
// were created on the machine during each (ddprun-watchdog's PROC_EMPTY_SCANS).
constexpr int kProcEmptyScans = 3;
// At most how many pids given while a proc sweep listed /proc are read besides (token_scan).
constexpr long kNewPidsProbed = 1024;
// The first argument of ddprun-watchdog (agent/watchdog/main.c): a watchdog of another build
// refuses to run (exit 2) rather than misread the lines; the agent finds it gone only when it
// next writes to it (docs/errors.md). 2: the "t" line carries the agent's session. 3: the job
// comes by the socket ("j", "c", "M"), not in the arguments, and "f" names the FIFO. 4: it
// writes "+" when it is ready, which the agent waits for (await_watchdog).
constexpr const char* kWatchdogProtocol = "5";
// How long the agent waits for the watchdog's "+" (await_watchdog) before its first workers.
constexpr std::chrono::seconds kWatchdogStartTimeout{10};
// What the watchdog calls itself (both kinds): not "ddprun-...", so that `pkill ddprun` and
// `pkill -f ddprun` end the agent and not the process that cleans up after it.
constexpr const char* kWatchdogName = "ddp-watchdog";

// The forked watchdog's command line (/proc/PID/cmdline, what `pkill -f` reads) is the agent's,
// copied: overwritten in place with kWatchdogName, as setproctitle does. The area's bounds are
// fields 48 and 49 of /proc/self/stat.
void rename_command_line() {
  const int fd = ::open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  char buf[2048];
  const ssize_t n = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (n <= 0) return;
  buf[n] = '\0';
  const char* p = std::strrchr(buf, ')');  // the name in parentheses may hold spaces
  if (p == nullptr) return;
  // After ')': field 3 (state) onwards; arg_start is field 48, arg_end 49.
  unsigned long long start = 0;
  unsigned long long end = 0;
  int field = 2;
  for (const char* q = p + 1; *q != '\0' && field < 49;) {
    while (*q == ' ') ++q;
    ++field;
    const char* tok = q;
    while (*q != ' ' && *q != '\0') ++q;
    if (field == 48 || field == 49) {
      unsigned long long v = 0;
      std::from_chars(tok, q, v);
      (field == 48 ? start : end) = v;
    }
  }
  if (start == 0 || end <= start) return;
  const auto size = static_cast<std::size_t>(end - start);
  char* area = reinterpret_cast<char*>(static_cast<std::uintptr_t>(start));  // NOLINT: our own memory
  std::memset(area, 0, size);
  // As much of the name as fits before the area's last byte, which stays 0 (a shorter command
  // line than the name, `ddprun x`, gets a shortened name: still no "ddprun").
  std::memcpy(area, kWatchdogName, std::min(std::strlen(kWatchdogName), size - 1));
}
constexpr std::chrono::milliseconds kSweepBound{3000};

// With read(2) rather than an ifstream (whose open, locale and stream copy cost ~25 µs a file:
// four of these are on the path to the first worker).
std::optional<std::string> read_text(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  std::string out;
  char buf[8192];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ::close(fd);
      if (n < 0) return std::nullopt;
      return out;
    }
    out.append(buf, static_cast<std::size_t>(n));
  }
}

bool write_text(const std::string& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ::close(fd);
  return ok;
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

std::optional<std::uint64_t> read_u64(const std::string& path) {
  const auto t = read_text(path);
  if (!t || t->empty() || (*t)[0] < '0' || (*t)[0] > '9') return std::nullopt;
  return std::stoull(*t);
}

// The whitespace-separated words of `text`, split by hand: a stream would initialise the C++
// locale, which nothing else on the path to the first worker needs (docs/performance.md).
std::vector<std::string_view> words_of(std::string_view text) {
  std::vector<std::string_view> out;
  constexpr std::string_view kSpace = " \t\n\r\f\v";
  for (;;) {
    const auto b = text.find_first_not_of(kSpace);
    if (b == std::string_view::npos) return out;
    text.remove_prefix(b);
    const auto e = text.find_first_of(kSpace);
    out.push_back(text.substr(0, e));
    if (e == std::string_view::npos) return out;
    text.remove_prefix(e);
  }
}

template <class T>
std::optional<T> number_of(std::string_view word) {
  T v{};
  const auto [p, ec] = std::from_chars(word.data(), word.data() + word.size(), v);
  if (ec != std::errc{} || p != word.data() + word.size()) return std::nullopt;
  return v;
}

// "key N" lines (memory.events, memory.oom_control).
std::uint64_t keyed_value(const std::string& path, const std::string& key) {
  const auto t = read_text(path);
  if (!t) return 0;
  const auto w = words_of(*t);
  for (std::size_t i = 0; i + 1 < w.size(); i += 2) {
    const auto v = number_of<std::uint64_t>(w[i + 1]);
    if (!v) return 0;  // (where a stream would have stopped)
    if (w[i] == key) return *v;
  }
  return 0;
}

std::vector<pid_t> read_pids(const std::string& procs_file) {
  std::vector<pid_t> out;
  const auto t = read_text(procs_file);
  if (!t) return out;
  for (const auto word : words_of(*t)) {
    const auto p = number_of<pid_t>(word);
    if (!p) break;
    out.push_back(*p);
  }
  return out;
}

// The names of the directories in `dir` (the cgroups below a cgroup), never through a link.
std::vector<std::string> subdirs_of(const std::string& dir) {
  std::vector<std::string> out;
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  DIR* d = fd < 0 ? nullptr : ::fdopendir(fd);
  if (d == nullptr) {
    if (fd >= 0) ::close(fd);
    return out;
  }
  while (const dirent* e = ::readdir(d)) {
    if (e->d_type == DT_DIR && std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) {
      out.emplace_back(e->d_name);
    }
  }
  ::closedir(d);
  return out;
}

// The members of the cgroup `dir` and of every cgroup below it (16 levels): a job process may
// make a cgroup of its own inside its rank's, and a cgroup.procs lists only its own members.
void add_subtree_pids(const std::string& dir, int depth, std::vector<pid_t>& out) {
  const auto own = read_pids(dir + "/cgroup.procs");
  out.insert(out.end(), own.begin(), own.end());
  if (depth >= 16) return;
  for (const auto& s : subdirs_of(dir)) add_subtree_pids(dir + "/" + s, depth + 1, out);
}

std::vector<pid_t> subtree_pids(const std::string& dir) {
  std::vector<pid_t> out;
  add_subtree_pids(dir, 0, out);
  return out;
}

// Writes THAWED to the v1 freezer.state of the cgroup `dir` and of every cgroup below it (16
// levels): a job process may freeze a cgroup it made inside its rank's, and a cgroup frozen on
// its own stays frozen when its parent thaws, its SIGKILLed processes with it.
void thaw_subtree(const std::string& dir, int depth) {
  write_text(dir + "/freezer.state", "THAWED");
  if (depth >= 16) return;
  for (const auto& s : subdirs_of(dir)) thaw_subtree(dir + "/" + s, depth + 1);
}

// rmdir of the cgroup `dir` and, when it says EBUSY (children, or members still leaving), of
// every cgroup below it first, deepest first; each rmdir retried for up to 2 s (a process
// SIGKILLed a moment ago may not have left its cgroup yet). 16 levels at most.
void remove_cgroup_tree(const std::string& dir, int depth) {
  if (::rmdir(dir.c_str()) == 0 || errno != EBUSY || depth >= 16) return;
  for (const auto& s : subdirs_of(dir)) remove_cgroup_tree(dir + "/" + s, depth + 1);
  for (int attempt = 0; attempt < 200; ++attempt) {
    if (::rmdir(dir.c_str()) == 0 || errno != EBUSY) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

struct Mount {
  std::string dir;   // mount point
  std::string path;  // this process's cgroup in that hierarchy ("/a/b")
};

std::optional<std::string> mountinfo_mount_point(const std::string& controller, const std::string& info);

// /proc/self/cgroup, and each hierarchy's mount point, found once for all the find_mount calls
// of one Containment::create: with statmount, else from /proc/self/mountinfo, read at most once
// (each read makes the kernel format the whole table).
struct ProcCgroupTexts {
  std::optional<std::string> own = read_text("/proc/self/cgroup");
  const std::optional<std::string>& mount_point(const std::string& controller) const {
    const auto it = points_.find(controller);
    if (it != points_.end()) return it->second;
    auto p = cgroup_mount_point(controller, MountLookup::statmount);
    if (!p) {
      if (!mountinfo_read_) {
        mountinfo_ = read_text("/proc/self/mountinfo");
        mountinfo_read_ = true;
      }
      if (mountinfo_) p = mountinfo_mount_point(controller, *mountinfo_);
    }
    return points_.emplace(controller, std::move(p)).first->second;
  }

 private:
  mutable std::map<std::string, std::optional<std::string>> points_;
  mutable std::optional<std::string> mountinfo_;
  mutable bool mountinfo_read_ = false;
};

// statmount(2) and its structures (Linux 6.8; the mount options 6.10; <linux/mount.h>, not in
// every distribution's headers yet). The same system call number on every architecture.
constexpr long kSysStatmount = 457;
constexpr std::uint64_t kStatmountMntRoot = 0x08;
constexpr std::uint64_t kStatmountMntPoint = 0x10;
constexpr std::uint64_t kStatmountFsType = 0x20;
constexpr std::uint64_t kStatmountMntOpts = 0x80;
constexpr unsigned kStatxMntIdUnique = 0x4000;  // STATX_MNT_ID_UNIQUE, Linux 6.8
struct MntIdReq {
  std::uint32_t size;
  std::uint32_t spare;
  std::uint64_t mnt_id;
  std::uint64_t param;
};
static_assert(sizeof(MntIdReq) == 24, "MNT_ID_REQ_SIZE_VER0");
// struct statmount: the fields read here, at their offsets; the strings from byte 512 on.
constexpr std::size_t kSmSize = 0, kSmMntOpts = 4, kSmMask = 8, kSmFsType = 36, kSmMntRoot = 104, kSmMntPoint = 108,
                      kSmStr = 512;

// The mount point `path` leads to, when it is the root of a mount of `fstype` whose root is the
// file system's (cgroupfs: the hierarchy's, relative to this cgroup namespace, as mountinfo
// shows it), and, with `opts`, the file system's options ("freezer" for a v1 hierarchy).
// nullopt when it is not, or statmount cannot say (kernel < 6.8, or < 6.10 for the options;
// a seccomp filter).
struct StatMount {
  std::string point;
  std::string opts;
};
std::optional<StatMount> statmount_of(const char* path, std::string_view fstype, bool opts) {
  struct statx sx {};
  if (::statx(AT_FDCWD, path, AT_NO_AUTOMOUNT, kStatxMntIdUnique, &sx) != 0) return std::nullopt;
  if ((sx.stx_mask & kStatxMntIdUnique) == 0 || (sx.stx_attributes_mask & STATX_ATTR_MOUNT_ROOT) == 0 ||
      (sx.stx_attributes & STATX_ATTR_MOUNT_ROOT) == 0) {
    return std::nullopt;
  }
  const std::uint64_t want = kStatmountMntRoot | kStatmountMntPoint | kStatmountFsType | (opts ? kStatmountMntOpts : 0);
  MntIdReq req{sizeof(MntIdReq), 0, sx.stx_mnt_id, want};
  alignas(8) char buf[4096];
  if (::syscall(kSysStatmount, &req, buf, sizeof buf, 0) != 0) return std::nullopt;
  auto u32 = [&buf](std::size_t off) {
    std::uint32_t v = 0;
    std::memcpy(&v, buf + off, sizeof v);
    return v;
  };
  std::uint64_t mask = 0;
  std::memcpy(&mask, buf + kSmMask, sizeof mask);
  const std::uint32_t size = u32(kSmSize);
  if ((mask & want) != want || size <= kSmStr || size > sizeof buf) return std::nullopt;
  // Each string: an offset into the strings, NUL-terminated inside what the kernel wrote.
  auto str = [&](std::size_t field) -> std::optional<std::string_view> {
    const std::size_t off = kSmStr + u32(field);
    if (off >= size) return std::nullopt;
    const void* nul = std::memchr(buf + off, '\0', size - off);
    if (nul == nullptr) return std::nullopt;
    return std::string_view(buf + off, static_cast<std::size_t>(static_cast<const char*>(nul) - (buf + off)));
  };
  const auto type = str(kSmFsType);
  const auto root = str(kSmMntRoot);
  const auto point = str(kSmMntPoint);
  if (!type || !root || !point || *type != fstype || *root != "/") return std::nullopt;
  StatMount out{std::string(*point), ""};
  if (opts) {
    const auto o = str(kSmMntOpts);
    if (!o) return std::nullopt;
    out.opts = *o;
  }
  return out;
}

}  // namespace

std::optional<std::string> cgroup_mount_point(const std::string& controller, MountLookup how) {
  if (how == MountLookup::mountinfo) {
    const auto info = read_text("/proc/self/mountinfo");
    return info ? mountinfo_mount_point(controller, *info) : std::nullopt;
  }
  if (controller.empty()) {
    for (const char* dir : {"/sys/fs/cgroup", "/sys/fs/cgroup/unified"}) {
      if (auto m = statmount_of(dir, "cgroup2", false)) return std::move(m->point);
    }
    return std::nullopt;
  }
  // A v1 hierarchy where it is usually mounted, carrying the controller when its options name it.
  const std::string dir = "/sys/fs/cgroup/" + controller;
  auto m = statmount_of(dir.c_str(), "cgroup", true);
  if (!m) return std::nullopt;
  for (const auto& opt : split(m->opts, ',')) {
    if (opt == controller) return std::move(m->point);
  }
  return std::nullopt;
}

namespace {

// The mount point in /proc/self/mountinfo (the first matching line).
std::optional<std::string> mountinfo_mount_point(const std::string& controller, const std::string& info) {
  for (const std::string& text : split(info, '\n')) {
    const std::string_view line(text);
    const auto dash = line.find(" - ");
    if (dash == std::string_view::npos) continue;
    const auto pre = words_of(line.substr(0, dash));    // id parent devno root point options ...
    const auto post = words_of(line.substr(dash + 3));  // fstype source options
    if (pre.size() < 5 || post.size() < 3) continue;
    if (pre[3] != "/") continue;  // a bind mount of a sub-tree: paths would not line up
    const std::string opts = "," + std::string(post[2]) + ",";
    if (controller.empty() ? post[0] == "cgroup2"
                           : (post[0] == "cgroup" && opts.find("," + controller + ",") != std::string::npos)) {
      return std::string(pre[4]);
    }
  }
  return std::nullopt;
}

// The mount of a cgroup hierarchy: cgroup2 (controller empty) or the v1 hierarchy carrying
// `controller`, with this process's cgroup path in it.
std::optional<Mount> find_mount(const std::string& controller, const ProcCgroupTexts& texts) {
  const auto& own = texts.own;
  if (!own) return std::nullopt;
  const auto& dir = texts.mount_point(controller);
  if (!dir) return std::nullopt;
  std::optional<Mount> m = Mount{*dir, ""};
  // "ID:CONTROLLERS:PATH" lines; split by hand (a stream would initialise the C++ locale, which
  // nothing else on the path to the first worker needs: docs/performance.md).
  for (const std::string& text : split(*own, '\n')) {
    const std::string_view line(text);
    const auto a = line.find(':');
    const auto b = a == std::string_view::npos ? a : line.find(':', a + 1);
    if (b == std::string_view::npos) continue;
    const std::string ctrls(line.substr(a + 1, b - a - 1));
    const bool match = controller.empty() ? line.substr(0, a) == "0" && ctrls.empty()
                                          : ("," + ctrls + ",").find("," + controller + ",") != std::string::npos;
    if (match) {
      m->path = std::string(line.substr(b + 1));
      if (m->path == "/") m->path.clear();
      return m;
    }
  }
  return std::nullopt;
}

// The smallest memory limit from `dir` up to the hierarchy's root `mount`, which counts too: in a
// container with its own cgroup namespace the mount's root is the container's cgroup, with the
// container's limit (the machine's root cgroup has no memory.max, and v1's says "unlimited").
// cgroup v2 memory.max, v1 memory.limit_in_bytes ("max" and v1's near-2^63 "unlimited" are none).
std::optional<std::uint64_t> effective_limit(std::string dir, const std::string& mount, bool v2) {
  std::optional<std::uint64_t> limit;
  for (int depth = 0; depth < 64 && dir.size() >= mount.size(); ++depth) {
    if (const auto l = read_u64(dir + (v2 ? "/memory.max" : "/memory.limit_in_bytes")); l && *l < (1ULL << 60)) {
      if (!limit || *l < *limit) limit = l;
    }
    const auto slash = dir.rfind('/');
    if (dir.size() == mount.size() || slash == std::string::npos || slash < mount.size()) break;
    dir.resize(slash);
  }
  return limit;
}

struct OomScope {
  std::string file;   // holds the "oom_kill N" line
  std::string label;  // RankMemory::oom_scope
  std::string dir;    // the cgroup, for the limit; empty for the machine
  std::string mount;  // its hierarchy's root
  bool v2 = false;
};

// Where the kernel counts an OOM kill of a worker when ranks have no memory cgroup of their own:
// a process in a cgroup v2 cgroup without the memory controller is charged to the nearest
// ancestor with it, whose memory.events counts the kill (hierarchically); with v1 the workers
// stay in the agent's memory cgroup (memory.oom_control counts its own kills, kernel >= 4.13);
// else only the machine-wide counter is left (/proc/vmstat, kernel >= 4.13).
// `job_v2` (the cgroup v2 job cgroup, when there is one) is where the search starts: it has the
// controller itself when the agent's cgroup is the root (which may enable it for children). The
// mount's root is searched too: in a container with its own cgroup namespace it is the
// container's cgroup (the machine's root cgroup has no memory.events).
OomScope find_oom_scope(const ProcCgroupTexts& texts, const std::string& job_v2) {
  if (const auto m = find_mount("", texts)) {
    for (std::string dir = job_v2.empty() ? m->dir + m->path : job_v2; dir.size() >= m->dir.size();
         dir.resize(dir.rfind('/'))) {
      if (exists(dir + "/memory.events")) {
        const std::string rel = dir.substr(m->dir.size());
        return {dir + "/memory.events", "cgroup " + (rel.empty() ? std::string("/") : rel), dir, m->dir, true};
      }
      if (dir.size() == m->dir.size()) break;
    }
  }
  if (const auto m = find_mount("memory", texts)) {
    const std::string dir = m->dir + m->path;
    if (exists(dir + "/memory.oom_control")) {
      return {dir + "/memory.oom_control", "cgroup " + (m->path.empty() ? std::string("/") : m->path), dir, m->dir,
              false};
    }
  }
  if (exists("/proc/vmstat")) return {"/proc/vmstat", "this machine", "", "", false};
  return {};
}

// A line to the watchdog: MSG_NOSIGNAL, so one that ended early cannot end the agent with
// SIGPIPE. False when it was not taken whole (a few bytes into an idle socket never block).
bool send_line(int fd, const std::string& line) {
  for (;;) {
    const ssize_t n = ::send(fd, line.data(), line.size(), MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    return n == static_cast<ssize_t>(line.size());
  }
}

bool make_cgroup(const std::string& dir) { return ::mkdir(dir.c_str(), 0755) == 0 || errno == EEXIST; }

// A job's own cgroup is made by this job or not used: one that exists already is another job's
// (an agent of the same pid in another PID namespace) or a leftover with its state (frozen,
// killed, controllers enabled); EEXIST says so.
bool make_job_cgroup(const std::string& dir) { return ::mkdir(dir.c_str(), 0755) == 0; }

std::string rank_dir(const std::string& job, int r) { return job + "/rank" + std::to_string(r); }

// What a sweep (and the hang detector: `cpu`) needs of /proc/PID/stat.
struct ProcStat {
  char state = '?';
  long pgrp = 0;
  long sid = 0;
  std::uint64_t cpu_ticks = 0;    // utime + stime, read only with `cpu`
  std::uint64_t start_ticks = 0;  // starttime (22), read only with `start`
};
std::optional<ProcStat> proc_stat(const std::string& path, bool cpu = false, bool start = false) {
  const auto st = read_text(path);
  if (!st) return std::nullopt;
  const auto close = st->rfind(')');  // the command name may hold anything, ')' included
  if (close == std::string::npos || close + 2 >= st->size()) return std::nullopt;
  // Fields from the third (1-based, proc(5)): state, ppid, pgrp, session, ..., utime (14), stime
  // (15), ..., starttime (22).
  ProcStat out;
  out.state = (*st)[close + 2];
  std::string_view rest(*st);
  rest.remove_prefix(close + 3);
  for (int field = 4; field <= (start ? 22 : cpu ? 15 : 6); ++field) {
    if (rest.empty() || rest.front() != ' ') return std::nullopt;
    rest.remove_prefix(1);
    const auto end = std::min(rest.find(' '), rest.size());
    const std::string_view value = rest.substr(0, end);
    rest.remove_prefix(end);
    const auto parse = [&](auto& to) {
      return std::from_chars(value.data(), value.data() + value.size(), to).ec == std::errc{};
    };
    std::uint64_t ticks = 0;
    if ((field == 5 && !parse(out.pgrp)) || (field == 6 && !parse(out.sid)) ||
        ((field == 14 || field == 15) && !parse(ticks)) || (field == 22 && !parse(out.start_ticks))) {
      return std::nullopt;
    }
    out.cpu_ticks += ticks;
  }
  return out;
}

// Processes created on this machine since boot ("processes" in /proc/stat: every fork and
// clone); 0 when unknown.
unsigned long long forks_so_far() {
  const auto text = read_text("/proc/stat");
  if (!text) return 0;
  const auto at = text->find("\nprocesses ");
  if (at == std::string::npos) return 0;
  unsigned long long n = 0;
  const char* from = text->data() + at + 11;
  std::from_chars(from, text->data() + text->size(), n);
  return n;
}

// The pid this PID namespace gave last (/proc/loadavg's last field): pids up to it were given
// since the pid counter last wrapped, newest highest; nullopt when unknown, or when /proc is
// another PID namespace's (loadavg speaks of the reader's own).
std::optional<long> last_pid() {
  char self[32];
  const ssize_t n = ::readlink("/proc/self", self, sizeof(self) - 1);
  if (n <= 0 || std::string_view(self, static_cast<std::size_t>(n)) != std::to_string(::getpid())) return std::nullopt;
  const auto text = read_text("/proc/loadavg");
  if (!text) return std::nullopt;
  const auto end = text->find_last_not_of(" \n");
  if (end == std::string::npos) return std::nullopt;
  const auto start = text->find_last_of(' ', end) + 1;  // npos + 1 = 0
  long last = 0;
  const auto r = std::from_chars(text->data() + start, text->data() + end + 1, last);
  if (r.ec != std::errc{} || r.ptr != text->data() + end + 1 || last <= 0) return std::nullopt;
  return last;
}

// Whether `p` is a process (its thread group's leader), from the Tgid line of its status:
// /proc/TID opens for any thread too, though a listing of /proc shows only processes.
bool is_process(long p) {
  const auto text = read_text("/proc/" + std::to_string(p) + "/status");
  if (!text) return false;
  auto at = text->find("\nTgid:");
  if (at == std::string::npos) return false;
  at = text->find_first_not_of(" \t", at + 6);
  long tgid = 0;
  return at != std::string::npos &&
         std::from_chars(text->data() + at, text->data() + text->size(), tgid).ec == std::errc{} && tgid == p;
}

// SIGKILLs the processes whose environment holds `needle` ("DDPRUN_JOB_TOKEN=..."), never this
// process, with their process groups, and returns the living ones it found. `/proc` is listed
// first, then read newest first: down from the last pid given (those given while the listing
// ran included), then down from the top (given before the pid counter wrapped). A process that
// forks and exits over and over is then read first with its newest pid, while it is still alive.
// Read in listing order it was gone by its turn, and its child unlisted, scan after scan; read
// from the highest pid down, the same once its pids had wrapped below older processes'. Its
// process group outlives each step, and a SIGKILL of the whole group also reaches a child being
// forked at that moment (the kernel restarts a fork that a group signal interrupts). A group is
// signalled only outside `agent_sid`, ddprun's own session (its process group may hold a
// pipeline's other commands; negative: unknown, no group is signalled): every worker starts a
// session of its own, so every session a job process is in was made by the job, and so is
// everything in it. The pids in `stuck` (given up on, SIGKILLed already) are skipped,
// and so is every process started before the agent (`not_before`, its starttime in clock ticks;
// 0: none): no job process is that old, and its environment is not read (reading one waits on
// the process's memory-map lock: a process stuck on a dead NFS or FUSE mount would stop the
// sweep, and the agent's event loop with it).
std::vector<pid_t> token_scan(const std::string& needle, pid_t agent_sid, std::uint64_t not_before,
                              const std::vector<pid_t>& stuck, std::vector<pid_t>& skipped) {
  skipped.clear();
  std::vector<pid_t> out;
  std::vector<pid_t> groups;
  std::vector<pid_t> listed;
  DIR* d = ::opendir("/proc");
  if (d == nullptr) return out;
  const pid_t self = ::getpid();
  // A process given up on is not read again: reading its environ may wait on the very lock it
  // is stuck holding.
  const auto readable = [&](long p) {
    return p != self && std::find(stuck.begin(), stuck.end(), static_cast<pid_t>(p)) == stuck.end();
  };
  while (const dirent* e = ::readdir(d)) {
    char* end = nullptr;
    const long p = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || p <= 0 || !readable(p)) continue;
    listed.push_back(static_cast<pid_t>(p));
  }
  ::closedir(d);
  const auto last = last_pid();
  if (last) {
    // The pids given while /proc was listed, past the highest listed up to the last (a bounded
    // number): the listing passed their place before they were given once they wrapped below
    // older pids, and they are the newest. Threads' ids among them are not read (a thread of a
    // worker given up on would be read as its process).
    pid_t top = 0;
    for (const pid_t p : listed) {
      if (p <= *last) top = std::max(top, p);
    }
    for (long p = *last; p > top && p > *last - kNewPidsProbed; --p) {
      if (readable(p) && is_process(p)) listed.push_back(static_cast<pid_t>(p));
    }
  }
  const long since = last.value_or(std::numeric_limits<long>::max());
  std::sort(listed.begin(), listed.end(), [since](pid_t a, pid_t b) {
    const bool a_since = a <= since;  // given since the counter last wrapped
    return a_since != (b <= since) ? a_since : a > b;
  });
  const pid_t own_group = ::getpgid(0);
  for (const pid_t p : listed) {
    const std::string dir = "/proc/" + std::to_string(p);
    const auto first = proc_stat(dir + "/stat", false, not_before > 0);
    if (!first) continue;  // gone
    if (first->start_ticks < not_before) continue;
    // Once a worker was given up on, processes in uninterruptible sleep are not read either (its
    // children may be stuck with it; those in its process group had the stop's SIGKILL), only
    // listed in `skipped`, to be looked at again.
    if (!stuck.empty() && first->state == 'D') {
      skipped.push_back(p);
      continue;
    }
    const auto env = read_text(dir + "/environ");
    if (!env) continue;
    bool holds = false;
    for (std::size_t pos = 0; pos < env->size() && !holds;) {
      const auto nul = env->find('\0', pos);
      const auto len = (nul == std::string::npos ? env->size() : nul) - pos;
      holds = env->compare(pos, len, needle) == 0;
      if (nul == std::string::npos) break;
      pos = nul + 1;
    }
    if (!holds) continue;
    // Read right after: a holder that has exited since is a zombie until it is reaped, and a
    // zombie's stat still names its process group (another process under the same pid would
    // take a full turn of the pid space in between).
    const auto st = proc_stat(dir + "/stat");
    if (!st) continue;
    // Signalled at once: the group of a holder read a moment ago, not after the whole scan.
    const auto group = static_cast<pid_t>(st->pgrp);
    if (group > 1 && group != own_group && agent_sid >= 0 && st->sid != agent_sid &&
        std::find(groups.begin(), groups.end(), group) == groups.end()) {
      ::kill(-group, SIGKILL);
      groups.push_back(group);
    }
    ::kill(p, SIGKILL);
    out.push_back(p);
  }
  return out;
}

}  // namespace

ContainmentMode parse_containment_mode(const std::string& text) {
  if (text == "auto") return ContainmentMode::automatic;
  if (text == "cgroup2") return ContainmentMode::cgroup2;
  if (text == "cgroup1") return ContainmentMode::cgroup1;
  if (text == "proc") return ContainmentMode::proc;
  if (text == "off") return ContainmentMode::off;
  throw UsageError("--containment: unknown value '" + text + "'", "use auto, cgroup2, cgroup1, proc or off");
}

// The watchdog forked from the agent, where ddprun-watchdog cannot be started: it runs the
// agent's own sweep (the copy of `c` it got), then removes the cgroups.
pid_t Containment::fork_watchdog(std::unique_ptr<Containment>& c, const int fds[2]) {
  const int nproc = c->nproc_;
  // The agent's end as an event: a pidfd the agent opens of itself, so no pid is ever read that
  // could already name another process (-1 before Linux 5.3, or where it is refused).
  const int self_end = static_cast<int>(::syscall(SYS_pidfd_open, ::getpid(), 0));
  const pid_t pid = ::fork();
  if (pid < 0) {
    const int err = errno;
    if (self_end >= 0) ::close(self_end);
    throw Error(std::string("containment: fork: ") + std::strerror(err));
  }
  if (pid == 0) {
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE, SIGTSTP, SIGTTIN, SIGTTOU}) ::signal(sig, SIG_IGN);
    ::prctl(PR_SET_NAME, kWatchdogName, 0, 0, 0);  // findable in ps and by the tests
    rename_command_line();
    const pid_t agent = ::getppid();
    ::setsid();  // out of the agent's process group: `kill -9 -PGID`, `timeout -s KILL` miss it
    ::close(fds[1]);
    // The socket as fd 3 and the agent's pidfd as 4, whatever numbers they have now.
    int end = self_end;
    if (end >= 0 && end < 5) {
      end = ::fcntl(self_end, F_DUPFD_CLOEXEC, 5);
      ::close(self_end);
    }
    if (fds[0] != 3) {
      ::dup2(fds[0], 3);
      ::close(fds[0]);
    }
    int agent_end = -1;
    if (end >= 0 && ::dup2(end, 4) == 4) agent_end = 4;
    close_descriptors_from(agent_end == 4 ? 5 : 4, false);
    const int null = ::open("/dev/null", O_RDWR);
    if (null >= 0) {
      ::dup2(null, 0);
      ::dup2(null, 1);
      ::dup2(null, 2);  // the agent's terminal may be gone; nothing to say there
    }
    // Without the agent's own pidfd (as the program's open_agent_end): one opened here, only
    // while the agent is still our parent, else the pid may already be somebody else's.
    if (agent_end < 0) {
      agent_end = static_cast<int>(::syscall(SYS_pidfd_open, agent, 0));
      if (agent_end >= 0 && ::getppid() != agent) {
        ::close(agent_end);
        agent_end = -1;
      }
    }
    // Ready, as the program says it (await_watchdog): named, out of the agent's process group.
    (void)::send(3, "+", 1, MSG_NOSIGNAL);
    // Lines from the agent (as for ddprun-watchdog, agent/watchdog/main.c): "m RANK PID"
    // (join_memory), "e DIR" (clean_up_when_gone), "r DIR" (remove_when_gone), "f MAJOR MINOR
    // INODE PATH" (unlink_when_gone), "g PID" (give_up_on), "d" (it ended normally and swept
    // the job itself); EOF
    // when it is gone, however it ended. The job's lines ("j", "c", "M") are for the program:
    // this copy of the agent knows the job.
    char buf[256];
    std::string pending;
    std::string run_dir;     // "r": remove
    std::string unused_dir;  // "e": remove unless it holds data (the agent did not settle it)
    std::string fifo;        // "f": the file timer's FIFO
    unsigned fifo_major = 0;
    unsigned fifo_minor = 0;
    unsigned long long fifo_ino = 0;
    bool swept = false;
    bool overlong = false;
    constexpr std::size_t kMaxLine = 4351;  // main.c's line buffer
    for (;;) {
      const ssize_t n = ::read(3, buf, sizeof(buf));
      if (n == 0 || (n < 0 && errno != EINTR)) break;
      if (n < 0) continue;
      pending.append(buf, static_cast<std::size_t>(n));
      for (auto nl = pending.find('\n'); nl != std::string::npos; nl = pending.find('\n')) {
        const std::string line = pending.substr(0, nl);
        pending.erase(0, nl + 1);
        if (overlong) {  // the end of a line too long to be one of ours
          overlong = false;
          continue;
        }
        int rank = -1;
        int worker = 0;
        if (line == "d") {
          swept = true;
        } else if (int g_end = 0; std::sscanf(line.c_str(), "g %d%n", &worker, &g_end) == 1 && worker > 0 &&
                                  static_cast<std::size_t>(g_end) == line.size()) {
          if (!c->given_up(worker)) c->stuck_.push_back(worker);
        } else if (std::sscanf(line.c_str(), "m %d %d", &rank, &worker) == 2 && rank >= 0 && rank < nproc &&
                   worker > 0) {
          c->move_to_memory_cgroup(rank, worker);
        } else if (line.rfind("r /", 0) == 0) {
          run_dir = line.substr(2);
        } else if (line.rfind("e /", 0) == 0) {
          unused_dir = line.substr(2);
        } else if (int at = 0;
                   std::sscanf(line.c_str(), "f %u %u %llu %n", &fifo_major, &fifo_minor, &fifo_ino, &at) == 3 &&
                   at > 0 && line[static_cast<std::size_t>(at)] == '/') {
          fifo = line.substr(static_cast<std::size_t>(at));
        }
      }
      // Lines are short (a path at most): as in the program (main.c), a longer one is dropped
      // whole, and what is kept of a line is bounded.
      if (pending.size() > kMaxLine) {
        pending.clear();
        overlong = true;
      }
    }
    c->watchdog_ = -1;
    c->watchdog_fd_ = -1;
    // The FIFO first, as main.c (remove_fifo): after "d" the agent removed it itself; else only
    // while the path names the agent's FIFO and nobody reads it (a new job's agent would), once
    // the agent's own reader is closed: when its last thread is gone (bounded).
    struct stat st {};
    if (!swept && !fifo.empty()) {
      if (agent_end >= 0) {
        pollfd p{agent_end, POLLIN, 0};
        const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
        for (;;) {
          const auto left =
              std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
          if (left.count() <= 0 || ::poll(&p, 1, static_cast<int>(left.count())) >= 0 || errno != EINTR) break;
        }
      } else {  // no pidfd (before Linux 5.3, or refused): its main thread's end re-parents us, its
                // other threads may still hold the descriptors
        const auto since = std::chrono::steady_clock::now();
        while (::getppid() == agent && std::chrono::steady_clock::now() - since < std::chrono::seconds(1)) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
      }
    }
    if (agent_end >= 0) ::close(agent_end);
    if (!swept && !fifo.empty() && ::lstat(fifo.c_str(), &st) == 0 && S_ISFIFO(st.st_mode) &&
        major(st.st_dev) == fifo_major && minor(st.st_dev) == fifo_minor && st.st_ino == fifo_ino) {
      const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
      if (fd >= 0) {
        ::close(fd);
      } else if (errno == ENXIO) {
        ::unlink(fifo.c_str());
      }
    }
    if (!swept) c->sweep(true);
    // The run directory before the cgroups (whose rmdir waits for grace periods), as main.c.
    std::error_code ec;
    if (!run_dir.empty()) {
      std::filesystem::remove_all(run_dir, ec);
    } else if (!unused_dir.empty() && !run_dir_holds_data(unused_dir)) {
      std::filesystem::remove_all(unused_dir, ec);
    }
    c->mode_ = ContainmentMode::off;  // the destructor's sweep is done
    c.reset();                        // removes the cgroups
    ::_exit(0);
  }
  if (self_end >= 0) ::close(self_end);
  return pid;
}

namespace {

// What the watchdog's vfork child reads, prepared by the agent: the child shares the agent's
// memory and may not allocate.
struct WatchdogChild {
  const char* path = nullptr;
  char* const* argv = nullptr;
  int sock = -1;
  int agent_end = -1;      // the agent's pidfd of itself, or -1
  volatile int error = 0;  // written by the child before its _exit, read after the vfork returns
};

// The child's steps before its exec; false (errno set) when one fails.
bool watchdog_child_setup(const WatchdogChild* a) {
  // Signals: every one is blocked (the agent blocked them before the clone) and stays blocked
  // through the exec (main.c unblocks them once it has ignored the terminal's), so no handler of
  // the agent can run in this child that shares its memory, and the exec resets every handled
  // signal to its default. Nothing to reset one by one: glibc's posix_spawn asks about all 64
  // (~130 system calls while the agent waits).
  // Its own session, out of the agent's process group: `kill -9 -PGID` and `timeout -s KILL`
  // (which signals its whole group) end the agent, not the watchdog that cleans up after it.
  if (::setsid() < 0) return false;
  // Its end of the socket pair as fd 3 (close-on-exec cleared), the agent's pidfd as fd 4,
  // stdio on /dev/null (the agent's terminal may be gone; nothing to say there), nothing else.
  // The pidfd first goes above 4, where neither dup2 below can replace it.
  int end = a->agent_end;
  if (end >= 0 && end < 5 && (end = ::fcntl(end, F_DUPFD_CLOEXEC, 5)) < 0) return false;
  if (a->sock == 3 ? ::fcntl(3, F_SETFD, 0) != 0 : ::dup2(a->sock, 3) != 3) return false;
  if (end >= 0 && ::dup2(end, 4) != 4) return false;
  const int null = ::open("/dev/null", O_RDWR);  // (not 3 or 4; closed below when above 2)
  if (null < 0 || ::dup2(null, 0) != 0 || ::dup2(null, 1) != 1 || ::dup2(null, 2) != 2) return false;
  close_descriptors_from(end >= 0 ? 5 : 4, true);
  return true;
}

int watchdog_child(void* raw) {
  auto* a = static_cast<WatchdogChild*>(raw);
  if (watchdog_child_setup(a)) {
    char* const envp[] = {nullptr};
    ::execve(a->path, a->argv, envp);
  }
  a->error = errno != 0 ? errno : EINVAL;
  ::_exit(127);
}

}  // namespace

// ddprun-watchdog from beside this binary (agent/watchdog/main.c), started with vfork + exec:
// no copy of the agent's page tables, no copy-on-write faults in the agent afterwards. -1 when it
// cannot be started (not built for this machine, not installed beside ddprun).
pid_t Containment::start_watchdog_program(const Containment& c, const int fds[2]) {
  const std::string path = installed_helper("ddprun-watchdog");
  if (path.empty()) return -1;
  const char* mode = c.mode_ == ContainmentMode::cgroup2   ? "cgroup2"
                     : c.mode_ == ContainmentMode::cgroup1 ? "cgroup1"
                                                           : "proc";
  // The job, by the socket before the start: it is there whenever the watchdog reads, even if the
  // agent is killed right after the clone, and not in its arguments (see kWatchdogName). Paths
  // that cannot be one line: the fork instead.
  for (const std::string* dir : {&c.job_dir_, &c.memory_dir_}) {
    if (dir->find('\n') != std::string::npos || dir->size() > 4000) return -1;
  }
  std::string job = "j " + std::string(mode) + " " + std::to_string(c.nproc_) + (c.rank_dirs_ ? " 1\n" : " 0\n");
  if (!c.job_dir_.empty()) job += "c " + c.job_dir_ + "\n";
  if (!c.memory_dir_.empty()) job += "M " + c.memory_dir_ + "\n";
  // The token too, not in the arguments every user can read.
  if (c.mode_ == ContainmentMode::proc) job += "t " + std::to_string(c.agent_sid_) + " " + c.token_env() + "\n";
  if (!send_line(fds[1], job)) return -1;  // (the fork ignores these lines)
  const char* argv[] = {kWatchdogName, kWatchdogProtocol, nullptr};
  WatchdogChild child;
  child.path = path.c_str();
  child.argv = const_cast<char* const*>(argv);  // NOLINT: execve's signature
  child.sock = fds[0];
  // The agent's end as an event for the watchdog (the FIFO's removal waits for it): opened here,
  // by the agent of itself, so the watchdog never has to trust a pid that may already be
  // somebody else's (-1 before Linux 5.3, or where it is refused: the watchdog opens one).
  child.agent_end = static_cast<int>(::syscall(SYS_pidfd_open, ::getpid(), 0));
  // The child runs on this stack until its exec (CLONE_VFORK: the agent waits until then).
  alignas(64) char stack[32 * 1024];  // glibc's posix_spawn gives its child 32 KiB too
  sigset_t all;
  sigset_t saved;
  ::sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, &saved);
  const pid_t pid = ::clone(watchdog_child, stack + sizeof stack, CLONE_VM | CLONE_VFORK | SIGCHLD, &child);
  const int clone_errno = errno;
  ::pthread_sigmask(SIG_SETMASK, &saved, nullptr);
  if (child.agent_end >= 0) ::close(child.agent_end);
  if (pid < 0 || child.error != 0) {
    const int err = pid < 0 ? clone_errno : child.error;
    if (pid > 0) {
      int status = 0;
      while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
    }
    spdlog::debug("containment: cannot start {} ({}); forking the watchdog", path, std::strerror(err));
    return -1;
  }
  return pid;
}

std::unique_ptr<Containment> Containment::create(ContainmentMode mode, int nproc, bool rank_memory) {
  std::unique_ptr<Containment> c(new Containment());
  c->arrivals_at_start_ = signal_arrivals();
  c->nproc_ = nproc;
  c->oom_base_.assign(static_cast<std::size_t>(nproc), 0);
  // 2 x 64 random bits (getrandom: std::random_device probes the CPU for RDRAND first, and
  // CPUID is a slow trap under a hypervisor): the token's, and the job cgroup's name's (readable
  // by anyone in /proc/PID/cgroup, so not the token's).
  std::uint64_t bits[2] = {0, 0};
  for (std::size_t got = 0; got < sizeof bits;) {
    const ssize_t n = ::getrandom(reinterpret_cast<char*>(bits) + got, sizeof bits - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw std::system_error(errno, std::generic_category(), "containment: getrandom");
    }
    got += static_cast<std::size_t>(n);
  }
  c->token_ = std::to_string(::getpid()) + "-" + std::to_string(bits[0]);
  const ProcCgroupTexts texts;
  // The pid and random bits: agents of one pid in different PID namespaces (a container,
  // `unshare -p`, ddprun as its namespace's pid 1) share the cgroup tree.
  const std::string leaf = "ddprun-" + std::to_string(::getpid()) + "-" + std::to_string(bits[1]);
  std::string why;  // why a cgroup mode was not used
  // Where the workers' OOM kills are counted without a rank memory cgroup (rank_memory).
  auto set_oom_scope = [&c, &texts] {
    OomScope s = find_oom_scope(texts, c->mode_ == ContainmentMode::cgroup2 ? c->job_dir_ : std::string());
    c->oom_scope_file_ = std::move(s.file);
    c->oom_scope_ = std::move(s.label);
    c->oom_scope_dir_ = std::move(s.dir);
    c->oom_scope_mount_ = std::move(s.mount);
    c->oom_scope_v2_ = s.v2;
  };

  auto try_v2 = [&]() -> bool {
    const auto m = find_mount("", texts);
    if (!m) {
      why = "no cgroup2 hierarchy mounted";
      return false;
    }
    const std::string job = m->dir + m->path + "/" + leaf;
    if (!make_job_cgroup(job)) {
      why = "cannot create " + job + ": " + std::strerror(errno);
      return false;
    }
    if (!exists(job + "/cgroup.kill")) {  // (the root cgroup has none: look in ours)
      ::rmdir(job.c_str());
      why = "cgroup2 without cgroup.kill (kernel < 5.14)";
      return false;
    }
    // With --rank-memory on, memory accounting per rank where the controller can be delegated:
    // then each rank gets its own cgroup (a cgroup whose children have controllers holds no
    // process itself). Otherwise a rank cgroup would buy nothing (the sweep, cgroup.kill and the
    // job's member list all work on the job cgroup), so every worker starts in the job cgroup: a
    // mkdir, an open and an rmdir per rank less on the launch path (docs/containment.md, "Cost").
    const auto ctrls = rank_memory ? read_text(job + "/cgroup.controllers") : std::nullopt;
    const bool per_rank =
        ctrls && ctrls->find("memory") != std::string::npos && write_text(job + "/cgroup.subtree_control", "+memory");
    if (per_rank) {
      for (int r = 0; r < nproc; ++r) {
        if (::mkdir(rank_dir(job, r).c_str(), 0755) == 0) continue;
        if (errno == EEXIST) {
          c->memory_fresh_ = false;  // left over: its counters are not at zero
          continue;
        }
        why = "cannot create " + rank_dir(job, r);
        for (int k = 0; k < r; ++k) ::rmdir(rank_dir(job, k).c_str());
        ::rmdir(job.c_str());
        return false;
      }
    }
    c->job_dir_ = job;
    c->mode_ = ContainmentMode::cgroup2;
    c->rank_dirs_ = per_rank;
    // Not inherited by the watchdog's exec-less child nor by workers (O_CLOEXEC, close_range).
    if (per_rank) {
      for (int r = 0; r < nproc; ++r) {
        c->rank_dir_fds_.push_back(::open(rank_dir(job, r).c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
      }
    } else {
      c->rank_dir_fds_.push_back(::open(job.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    }
    c->mechanism_ = "cgroup v2 " + job;
    if (per_rank) {
      c->memory_dir_ = job;
      c->memory_mount_ = m->dir;
      c->memory_v2_ = true;
    }
    return true;
  };
  auto try_v1 = [&]() -> bool {
    const auto m = find_mount("freezer", texts);
    if (!m) {
      why += (why.empty() ? "" : "; ") + std::string("no v1 freezer hierarchy mounted");
      return false;
    }
    const std::string job = m->dir + m->path + "/" + leaf;
    if (!make_job_cgroup(job)) {
      why += "; cannot create " + job + ": " + std::strerror(errno);
      return false;
    }
    for (int r = 0; r < nproc; ++r) make_cgroup(rank_dir(job, r));
    c->job_dir_ = job;
    c->rank_dirs_ = true;
    c->mode_ = ContainmentMode::cgroup1;
    c->mechanism_ = "cgroup v1 freezer " + job;
    return true;
  };

  bool ok = false;
  switch (mode) {
    case ContainmentMode::automatic:
      ok = try_v2() || try_v1();
      break;
    case ContainmentMode::cgroup2:
      if (!try_v2()) throw UsageError("--containment cgroup2: " + why, "use --containment auto, cgroup1 or proc");
      ok = true;
      break;
    case ContainmentMode::cgroup1:
      if (!try_v1()) throw UsageError("--containment cgroup1: " + why, "use --containment auto, cgroup2 or proc");
      ok = true;
      break;
    case ContainmentMode::proc:
      break;
    case ContainmentMode::off:
      c->mode_ = ContainmentMode::off;
      c->mechanism_ = "off";
      set_oom_scope();
      if (rank_memory) {
        spdlog::warn(
            "--rank-memory on needs containment: with --containment off the ranks get no memory cgroup; "
            "an OOM kill is read from {}",
            c->oom_scope_.empty() ? std::string("nowhere") : c->oom_scope_);
      }
      return c;
  }
  if (!ok) {
    c->mode_ = ContainmentMode::proc;
    c->mechanism_ = "job token in /proc/PID/environ";
    c->agent_sid_ = ::getsid(0);
    if (const auto self = proc_stat("/proc/self/stat", false, true)) c->start_ticks_ = self->start_ticks;
    // Said at info: the job token misses what a cgroup holds (a process that makes a new session
    // and clears its environment, one whose environment cannot be read: docs/containment.md).
    if (mode == ContainmentMode::automatic)
      spdlog::info("containment: no usable cgroup ({}); using the job token in the processes' environment", why);
  }
  if (rank_memory && !c->memory_v2_) {
    if (const auto mm = find_mount("memory", texts)) {
      const std::string job = mm->dir + mm->path + "/" + leaf;
      if (make_job_cgroup(job)) {
        c->memory_dir_ = job;
        c->memory_mount_ = mm->dir;
        for (int r = 0; r < nproc; ++r) {
          if (::mkdir(rank_dir(job, r).c_str(), 0755) == 0) continue;
          if (errno == EEXIST) {
            c->memory_fresh_ = false;  // left over: its counters are not at zero
            continue;
          }
          spdlog::debug("containment: cannot create {}: {}", rank_dir(job, r), std::strerror(errno));
          for (int k = 0; k < r; ++k) ::rmdir(rank_dir(job, k).c_str());
          ::rmdir(job.c_str());
          c->memory_dir_.clear();
          break;
        }
      }
    }
  }
  // Also with rank cgroups: a worker the OOM killer ends before the watchdog moved it into its
  // rank's v1 memory cgroup is counted in the agent's (rank_memory).
  set_oom_scope();
  if (rank_memory && c->memory_dir_.empty()) {
    spdlog::warn(
        "--rank-memory on: the ranks cannot get memory cgroups of their own here (no writable v1 memory "
        "hierarchy, and a cgroup v2 below a cgroup that holds processes cannot delegate the memory "
        "controller); an OOM kill is read from {}",
        c->oom_scope_.empty() ? std::string("nowhere") : c->oom_scope_);
  }

  // The watchdog: sweeps the job when the agent is gone, however it ended.
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
    throw Error(std::string("containment: socketpair: ") + std::strerror(errno));
  }
  pid_t pid = start_watchdog_program(*c, fds);
  if (pid < 0) pid = fork_watchdog(c, fds);
  ::close(fds[0]);
  c->watchdog_ = pid;
  c->watchdog_fd_ = fds[1];
  spdlog::debug("containment: {} (watchdog pid {})", c->mechanism_, pid);
  return c;
}

Containment::~Containment() {
  for (int fd : rank_dir_fds_) {
    if (fd >= 0) ::close(fd);
  }
  rank_dir_fds_.clear();
  sweep(true);
  check_watchdog();
  if (watchdog_fd_ >= 0) {
    // The agent's own end: the job is swept; the watchdog removes the cgroups (rmdir of a cgroup
    // waits for the kernel's RCU grace periods: ~ms each, not worth delaying the exit for).
    // It is not waited for: it ends on its own and is reaped by init.
    const bool told = send_line(watchdog_fd_, "d\n");
    const int err = errno;
    ::close(watchdog_fd_);
    watchdog_fd_ = -1;
    // Not as a container's init: when it exits, the kernel ends everything else in its PID
    // namespace, the watchdog too, before it could remove anything (as remove_when_gone).
    if (told && ::getpid() != 1) return;
    if (!told) {
      spdlog::warn("containment: the watchdog (pid {}) ended before the job ({}); removing the job's cgroups here",
                   watchdog_, std::strerror(err));
    }
  }
  // Rank cgroups, cgroups a job process made, and processes still leaving make the job's rmdir
  // fail with EBUSY; only then is the tree below looked at.
  if (!job_dir_.empty()) remove_cgroup_tree(job_dir_, 0);
  if (!memory_dir_.empty() && memory_dir_ != job_dir_) remove_cgroup_tree(memory_dir_, 0);
}

void Containment::check_watchdog() {
  if (watchdog_ <= 0 || watchdog_fd_ < 0) return;
  int status = 0;
  if (::waitpid(watchdog_, &status, WNOHANG) != watchdog_) return;  // running (or not ours to wait for)
  const std::string how = WIFEXITED(status)     ? "exit " + std::to_string(WEXITSTATUS(status))
                          : WIFSIGNALED(status) ? "killed by " + signal_name(WTERMSIG(status))
                                                : std::string("ended");
  if (WIFEXITED(status) && WEXITSTATUS(status) == 2) {
    spdlog::warn(
        "containment: {} refused to start ({}): it is not of this ddprun's build; if ddprun is killed now, "
        "nothing ends the job's detached processes{} (ddprun still does at its own end); install ddprun and "
        "ddprun-watchdog from the same build",
        installed_helper("ddprun-watchdog"), how, job_dir_.empty() ? "" : " or removes its cgroups");
  } else {
    spdlog::warn(
        "containment: the watchdog (pid {}) ended before the job ({}): if ddprun is killed now, nothing ends the "
        "job's detached processes (ddprun still does at its own end)",
        watchdog_, how);
  }
  ::close(watchdog_fd_);
  watchdog_fd_ = -1;
  watchdog_ = -1;
}

void Containment::give_up_on(pid_t pid) {
  if (pid <= 0 || given_up(pid)) return;
  stuck_.push_back(pid);
  if (watchdog_fd_ >= 0) (void)send_line(watchdog_fd_, "g " + std::to_string(pid) + "\n");
}

std::string Containment::token_env() const { return std::string(kTokenVar) + "=" + token_; }

std::string Containment::worker_cgroup(int local_rank) const {
  return rank_dirs_ ? rank_dir(job_dir_, local_rank) : job_dir_;
}

std::vector<std::string> Containment::join_files(int local_rank) const {
  known_empty_ = false;
  std::vector<std::string> out;
  if (!job_dir_.empty()) out.push_back(worker_cgroup(local_rank) + "/cgroup.procs");
  return out;
}

void Containment::join_memory(int local_rank, pid_t pid) const {
  if (memory_dir_.empty() || memory_dir_ == job_dir_) return;
  if (watchdog_fd_ >= 0) {
    // A line of a few bytes into an idle pipe: never blocks, the watchdog does the write.
    if (send_line(watchdog_fd_, "m " + std::to_string(local_rank) + " " + std::to_string(pid) + "\n")) return;
  }
  move_to_memory_cgroup(local_rank, pid);
}

bool Containment::send_dir(char kind, const std::string& dir) const {
  // An absolute path on one line that fits the watchdog's buffer (main.c: 4096 bytes).
  if (watchdog_fd_ < 0 || dir.empty() || dir.front() != '/' || dir.find('\n') != std::string::npos ||
      dir.size() > 4000) {
    return false;
  }
  return send_line(watchdog_fd_, std::string(1, kind) + " " + dir + "\n");
}

bool Containment::remove_when_gone(const std::string& dir) const {
  // Not as a container's init: when it exits, the kernel ends everything else in its PID
  // namespace, the watchdog too, before it could remove anything.
  return ::getpid() != 1 && send_dir('r', dir);
}

void Containment::clean_up_when_gone(const std::string& dir) const { send_dir('e', dir); }

void Containment::unlink_when_gone(const std::string& path, dev_t dev, ino_t ino) const {
  // As send_dir: an absolute path on one line that fits the watchdog's buffer.
  if (watchdog_fd_ < 0 || path.empty() || path.front() != '/' || path.find('\n') != std::string::npos ||
      path.size() > 4000) {
    return;
  }
  send_line(watchdog_fd_, "f " + std::to_string(major(dev)) + " " + std::to_string(minor(dev)) + " " +
                              std::to_string(ino) + " " + path + "\n");
}

int Containment::move_to_memory_cgroup(int local_rank, pid_t pid) const {
  const std::string file = rank_dir(memory_dir_, local_rank) + "/cgroup.procs";
  const int fd = ::open(file.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return errno;
  const std::string text = std::to_string(pid);
  const int err = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()) ? 0 : errno;
  ::close(fd);
  return err;
}

int Containment::join_dir_fd(int local_rank) const {
  known_empty_ = false;
  if (killed_) return -1;  // join by cgroup.procs (killed_)
  const auto i = rank_dirs_ ? static_cast<std::size_t>(local_rank) : 0;
  return i < rank_dir_fds_.size() ? rank_dir_fds_[i] : -1;
}

void Containment::await_watchdog() {
  if (watchdog_ready_ || watchdog_fd_ < 0) return;
  watchdog_ready_ = true;  // asked once, before the first workers
  // "+" (usually there already: one system call), or EOF: a watchdog that ended already (one of
  // another build refuses the protocol) is reported by check_watchdog, from its pidfd.
  char byte = 0;
  // (EWOULDBLOCK is EAGAIN on Linux.)
  if (::recv(watchdog_fd_, &byte, 1, MSG_DONTWAIT) >= 0 || errno != EAGAIN) return;
  // Bounded: a watchdog that never gets to run (stopped) must not stop the job from starting. And
  // a signal the agent handles (a Ctrl-C) ends the wait: the workers start and get it at once,
  // rather than after the whole wait. The handled signals are blocked from the check to the wait,
  // which unblocks them, so one that comes in between ends it too.
  pollfd p{watchdog_fd_, POLLIN, 0};
  const auto deadline = std::chrono::steady_clock::now() + kWatchdogStartTimeout;
  sigset_t open_mask;
  ::pthread_sigmask(SIG_BLOCK, &noted_signals(), &open_mask);
  int ready = 0;
  bool interrupted = false;
  for (;;) {
    if (signal_arrivals() != arrivals_at_start_) {
      interrupted = true;
      break;
    }
    const auto left = std::max(deadline - std::chrono::steady_clock::now(), std::chrono::steady_clock::duration{});
    const auto sec = std::chrono::duration_cast<std::chrono::seconds>(left);
    const timespec ts{static_cast<time_t>(sec.count()),
                      static_cast<long>(std::chrono::duration_cast<std::chrono::nanoseconds>(left - sec).count())};
    ready = ::ppoll(&p, 1, &ts, &open_mask);
    if (ready >= 0 || errno != EINTR) break;
  }
  ::pthread_sigmask(SIG_SETMASK, &open_mask, nullptr);
  if (interrupted) {
    spdlog::debug("containment: a signal came while waiting for the watchdog (pid {}) to start; not waiting longer",
                  watchdog_);
    return;
  }
  if (ready <= 0) {
    spdlog::warn(
        "containment: the watchdog (pid {}) did not start within {} s; the workers start without it (if ddprun "
        "is killed before it runs, nothing ends the job's detached processes)",
        watchdog_, std::chrono::duration_cast<std::chrono::seconds>(kWatchdogStartTimeout).count());
    return;
  }
  (void)::recv(watchdog_fd_, &byte, 1, MSG_DONTWAIT);
}

void Containment::begin_attempt() {
  await_watchdog();
  if (!oom_scope_file_.empty()) oom_scope_base_ = keyed_value(oom_scope_file_, "oom_kill");
  if (memory_dir_.empty()) return;
  if (memory_fresh_) {
    // Cgroups this agent just created start at zero OOM kills and zero peak: nothing to reset
    // (2 file operations per rank off the path to the first exec).
    memory_fresh_ = false;
    return;
  }
  for (int r = 0; r < nproc_; ++r) {
    const std::string d = rank_dir(memory_dir_, r);
    if (memory_v2_) {
      oom_base_[static_cast<std::size_t>(r)] = keyed_value(d + "/memory.events", "oom_kill");
    } else {
      oom_base_[static_cast<std::size_t>(r)] = keyed_value(d + "/memory.oom_control", "oom_kill");
      write_text(d + "/memory.max_usage_in_bytes", "0");
    }
  }
}

std::optional<std::vector<pid_t>> Containment::job_pids() const {
  // proc/off: the token would need a scan of every /proc/PID/environ; v1 memory cgroups are
  // joined after the start (join_memory) and miss what a worker started early. Neither is exact.
  if (job_dir_.empty()) return std::nullopt;
  // The whole subtree: the rank cgroups, and any cgroup a job process made below them.
  return subtree_pids(job_dir_);
}

RankMemory Containment::rank_memory(int local_rank) const {
  RankMemory m;
  if (!memory_dir_.empty()) {
    const std::string d = rank_dir(memory_dir_, local_rank);
    const auto base = oom_base_[static_cast<std::size_t>(local_rank)];
    const auto kills = keyed_value(d + (memory_v2_ ? "/memory.events" : "/memory.oom_control"), "oom_kill");
    m.oom_kills = kills > base ? kills - base : 0;
    m.peak = read_u64(d + (memory_v2_ ? "/memory.peak" : "/memory.max_usage_in_bytes"));
    if (m.oom_kills > 0) {
      // The effective limit: the smallest on the way up (a container's, a batch job's).
      m.limit = effective_limit(d, memory_mount_, memory_v2_);
      return m;
    }
  }
  // No rank cgroup, or none counted a kill (a worker killed before its v1 join): the scope's.
  if (oom_scope_file_.empty()) return m;
  const auto now = keyed_value(oom_scope_file_, "oom_kill");
  m.oom_kills = now > oom_scope_base_ ? now - oom_scope_base_ : 0;
  m.oom_scope = oom_scope_;
  m.oom_scope_machine = oom_scope_dir_.empty();
  if (m.oom_kills > 0 && !oom_scope_dir_.empty())
    m.limit = effective_limit(oom_scope_dir_, oom_scope_mount_, oom_scope_v2_);
  return m;
}

int Containment::sweep(bool last) {
  if (mode_ == ContainmentMode::off) return 0;
  if (mode_ == ContainmentMode::cgroup2) {
    // Once empty, it stays empty until a worker is started in it: a process enters a cgroup by
    // a fork of a member (there is none) or a write to its cgroup.procs (this agent's, for its
    // workers). The end of a run sweeps up to five times (each stop, the group's end, this
    // destructor): one read is enough.
    if (known_empty_) return 0;
    // One read answers for the whole job: "populated 0" once no process is left in any rank's
    // cgroup (an exited process leaves the count at its exit, zombie or not).
    const auto events = read_text(job_dir_ + "/cgroup.events");
    if (events && events->find("populated 0") != std::string::npos) {
      known_empty_ = true;
      return 0;
    }
  }
  std::vector<pid_t> killed;
  const auto deadline = std::chrono::steady_clock::now() + kSweepBound;
  const auto living = [](const std::vector<pid_t>& pids) {
    std::vector<pid_t> out;
    for (pid_t p : pids) {
      // A zombie stays listed until its parent reaps it; only count the living.
      const auto st = proc_stat("/proc/" + std::to_string(p) + "/stat");
      if (st && st->state != 'Z') out.push_back(p);
    }
    return out;
  };
  // Once a worker was given up on (give_up_on), the sweep stops waiting when only stuck processes
  // are left: that worker, and processes in uninterruptible sleep on two passes after a SIGKILL
  // (its children, stuck in the same driver or file system; not one passing through the state for
  // a page-in or a flush at close). Waiting cannot end them.
  std::vector<pid_t> in_d;  // the previous pass's
  const auto only_stuck = [&](const std::vector<pid_t>& pids) {
    std::vector<pid_t> now_d;
    bool all = !stuck_.empty() && !pids.empty();
    for (const pid_t p : pids) {
      if (given_up(p)) continue;
      if (process_state(p) == 'D') {
        now_d.push_back(p);
        if (std::find(in_d.begin(), in_d.end(), p) != in_d.end()) continue;
      }
      all = false;
    }
    in_d = std::move(now_d);
    return all;
  };
  std::vector<pid_t> alive;
  int empty_scans = 0;
  std::vector<pid_t> skipped;         // in uninterruptible sleep, not read (token_scan)
  std::vector<pid_t> skipped_before;  // the previous scan's
  for (;;) {
    if (mode_ == ContainmentMode::proc) {
      const auto forks_before = last ? forks_so_far() : 0;
      alive = token_scan(token_env(), agent_sid_, start_ticks_, stuck_, skipped);  // SIGKILLed as found
      // A process skipped in uninterruptible sleep is looked at again until it was so on two
      // scans in a row (stuck), not one passing through the state for a page-in.
      std::sort(skipped.begin(), skipped.end());
      const bool settled = std::includes(skipped_before.begin(), skipped_before.end(), skipped.begin(), skipped.end());
      skipped_before = skipped;
      if (alive.empty()) {
        // A scan can miss a process that forks and exits without pause: the holder it listed
        // is gone by its turn, its child not listed. A scan during which this machine created
        // no process has missed nothing; at the job's end another follows any other, up to
        // kProcEmptyScans in a row.
        const bool exact = forks_before != 0 && forks_so_far() == forks_before;
        if (std::chrono::steady_clock::now() > deadline ||
            (settled && (!last || exact || ++empty_scans >= kProcEmptyScans)))
          break;
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        continue;
      }
      empty_scans = 0;
    } else if (mode_ == ContainmentMode::cgroup2) {
      // "populated 0" once no process is left in the job cgroup or below; `cgroup.kill` reaches
      // every one, a process forking at that moment included.
      const auto events = read_text(job_dir_ + "/cgroup.events");
      if (!events || events->find("populated 0") != std::string::npos) break;
      alive = living(*job_pids());
      write_text(job_dir_ + "/cgroup.kill", "1");
      killed_ = true;
    } else {
      // cgroup v1 has no populated flag: a process that forks and exits may show only pids that
      // are gone. An empty member list is final (a forking process is listed until its child
      // is); otherwise the list is read again frozen, where nothing can fork or exit.
      if (const auto pids = living(*job_pids());
          pids.empty() ||
          (!stuck_.empty() && std::all_of(pids.begin(), pids.end(), [this](pid_t p) { return given_up(p); })))
        break;
      for (int r = 0; r < nproc_; ++r) write_text(rank_dir(job_dir_, r) + "/freezer.state", "FROZEN");
      // FREEZING until every task has stopped; bounded by the sweep's deadline.
      for (int r = 0; r < nproc_ && std::chrono::steady_clock::now() < deadline;) {
        const auto state = read_text(rank_dir(job_dir_, r) + "/freezer.state");
        if (!state || state->rfind("FROZEN", 0) == 0) {
          ++r;
        } else {
          std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
      }
      alive = living(*job_pids());
      for (pid_t p : alive) ::kill(p, SIGKILL);  // takes effect on thaw
      thaw_subtree(job_dir_, 0);                 // the ranks, and what a job process froze itself
      if (alive.empty()) break;
    }
    if (!stuck_.empty() && only_stuck(alive)) break;  // (not counted as ended below: they did not end)
    for (pid_t p : alive) {
      if (given_up(p)) continue;  // not ended here
      if (std::find(killed.begin(), killed.end(), p) == killed.end()) killed.push_back(p);
    }
    if (std::chrono::steady_clock::now() > deadline) {
      spdlog::warn("containment: {} process(es) of the job still alive after {} ms", alive.size(), kSweepBound.count());
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));  // the kernel delivers SIGKILL asynchronously
  }
  return static_cast<int>(killed.size());
}

char process_state(pid_t pid) {
  const auto st = proc_stat("/proc/" + std::to_string(pid) + "/stat");
  return st ? st->state : 0;
}

std::optional<std::uint64_t> process_cpu_ticks(pid_t pid) {
  const auto st = proc_stat("/proc/" + std::to_string(pid) + "/stat", true);
  if (!st) return std::nullopt;
  return st->cpu_ticks;
}

std::vector<pid_t> process_tree(pid_t root) {
  std::vector<pid_t> out{root};
  for (std::size_t i = 0; i < out.size() && out.size() < 4096; ++i) {
    const std::string task = "/proc/" + std::to_string(out[i]) + "/task";
    DIR* d = ::opendir(task.c_str());
    if (d == nullptr) continue;
    while (const dirent* e = ::readdir(d)) {
      if (e->d_name[0] == '.') continue;
      for (pid_t c : read_pids(task + "/" + e->d_name + "/children")) out.push_back(c);
    }
    ::closedir(d);
  }
  return out;
}

}  // namespace ddprun::agent
