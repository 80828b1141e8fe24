// posix_spawn-style launcher; see process.hpp for why not Boost.Process v2's launchers.
#include "ddprun/agent/process.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <linux/sched.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstring>

#include "ddprun/common/error.hpp"
#include "ddprun/common/strings.hpp"

namespace ddprun::agent {

namespace {

// Everything the child reads, prepared by the parent before clone: the child must not
// allocate (it shares the parent's heap and the parent's malloc lock state).
struct ChildArgs {
  const char* path = nullptr;
  char* const* argv = nullptr;
  char* const* envp = nullptr;
  const char* cwd = nullptr;
  int stdin_fd = -1;
  int stdout_fd = -1;
  int stderr_fd = -1;
  pid_t parent_pid = 0;
  const unsigned long* cpu_mask = nullptr;  // NOLINT: the kernel's cpumask unit; nullptr = no binding
  std::size_t cpu_mask_bytes = 0;
  const char* const* cgroup_procs = nullptr;  // nullptr-terminated
  bool in_first_cgroup = false;               // started in cgroup_procs[0]'s cgroup (CLONE_INTO_CGROUP)
  bool reset_listed = false;                  // SpawnRequest::reset_signals given; else look at every signal
  bool new_session = false;                   // SpawnRequest::new_session
  const int* reset_signals = nullptr;
  std::size_t reset_count = 0;
  // Written by the child (shared memory: CLONE_VM), read by the parent after the vfork-style
  // suspension ends (exec or _exit).
  volatile int error = 0;
  const char* volatile failed_step = nullptr;
  volatile int affinity_error = 0;
  volatile int cgroup_error = 0;
};

[[noreturn]] void child_fail(ChildArgs* args, const char* step) {
  args->error = errno;
  args->failed_step = step;
  ::_exit(127);
}

bool move_fd(int from, int to) {
  if (from < 0) {
    return true;
  }
  if (from == to) {
    // dup2 would be a no-op and leave O_CLOEXEC set: clear it instead.
    const int flags = ::fcntl(to, F_GETFD);
    return flags >= 0 && ::fcntl(to, F_SETFD, flags & ~FD_CLOEXEC) == 0;
  }
  return ::dup2(from, to) == to;
}

// Whether `sig` has a handler in this process (not SIG_DFL, not SIG_IGN). False for the signals
// sigaction refuses (SIGKILL, SIGSTOP, glibc's reserved real-time signals).
bool has_handler(int sig) {
  struct sigaction old {};
  if (::sigaction(sig, nullptr, &old) != 0) return false;
  return (old.sa_flags & SA_SIGINFO) != 0 || (old.sa_handler != SIG_DFL && old.sa_handler != SIG_IGN);  // NOLINT
}

int child_main(void* raw) {
  auto* args = static_cast<ChildArgs*>(raw);
  // Handlers installed by the agent (asio's signal_set) must not run in the worker; ignored
  // signals stay ignored (nohup semantics) except SIGPIPE, which the agent ignores for itself.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;  // NOLINT
  if (args->reset_listed) {
    for (std::size_t i = 0; i < args->reset_count; ++i) ::sigaction(args->reset_signals[i], &dfl, nullptr);
  } else {
    for (int sig = 1; sig < NSIG; ++sig) {
      if (sig == SIGPIPE || has_handler(sig)) ::sigaction(sig, &dfl, nullptr);
    }
  }
  sigset_t empty;
  ::sigemptyset(&empty);
  ::sigprocmask(SIG_SETMASK, &empty, nullptr);

  // Either way the child leads a process group whose id is its pid (signal_group's killpg).
  if (args->new_session) {
    if (::setsid() < 0) child_fail(args, "setsid");
  } else if (::setpgid(0, 0) != 0) {
    child_fail(args, "setpgid");
  }
  if (::prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0) {
    child_fail(args, "prctl(PR_SET_PDEATHSIG)");
  }
  if (::getppid() != args->parent_pid) {
    ::_exit(127);  // the agent died before the death signal was armed
  }
  // Join the job's cgroups before anything else can be started from here.
  const char* const* first = args->cgroup_procs;
  if (first != nullptr && *first != nullptr && args->in_first_cgroup) ++first;
  for (const char* const* p = first; p != nullptr && *p != nullptr; ++p) {
    const int fd = ::open(*p, O_WRONLY | O_CLOEXEC);
    if (fd < 0 || ::write(fd, "0", 1) != 1) args->cgroup_error = errno;
    if (fd >= 0) ::close(fd);
  }
  if (!move_fd(args->stdin_fd, STDIN_FILENO) || !move_fd(args->stdout_fd, STDOUT_FILENO) ||
      !move_fd(args->stderr_fd, STDERR_FILENO)) {
    child_fail(args, "dup2");
  }
  // Asio does not open every descriptor with O_CLOEXEC (e.g. accepted sockets): close them all.
  close_descriptors_from(3, true);
  // Best effort: a worker that cannot be bound (e.g. a cgroup cpuset narrower than the plan)
  // still runs; the parent logs the error.
  if (args->cpu_mask != nullptr && ::syscall(SYS_sched_setaffinity, 0, args->cpu_mask_bytes, args->cpu_mask) != 0) {
    args->affinity_error = errno;
  }
  if (args->cwd != nullptr && ::chdir(args->cwd) != 0) {
    child_fail(args, "chdir");
  }
  ::execve(args->path, args->argv, args->envp);
  child_fail(args, "execve");
}

std::vector<char*> c_array(const std::vector<std::string>& items) {
  std::vector<char*> out;
  out.reserve(items.size() + 1);
  for (const auto& s : items) {
    out.push_back(const_cast<char*>(s.c_str()));  // NOLINT: execve's signature
  }
  out.push_back(nullptr);
  return out;
}

// The child's stack. CLONE_VFORK suspends the parent until exec/_exit, so one stack serves
// every spawn of the (single) agent thread.
alignas(64) char g_child_stack[64 * 1024];

#if defined(__x86_64__) && defined(SYS_clone3) && defined(CLONE_INTO_CGROUP)
// clone3 has no glibc wrapper: the child of a CLONE_VM clone starts on its own stack, so it must
// not return into this function's frame. The child calls fn(arg) and exits with its result
// (child_main never returns: it execs or _exits). Returns the child's pid or -errno.
long clone3_call(clone_args* cl, int (*fn)(void*), void* arg) {
  long ret = SYS_clone3;
  register long r12 asm("r12") = reinterpret_cast<long>(fn);   // NOLINT: kept across the syscall
  register long r13 asm("r13") = reinterpret_cast<long>(arg);  // NOLINT
  asm volatile(
      "syscall\n\t"
      "testq %%rax, %%rax\n\t"
      "jnz 1f\n\t"
      "xorl %%ebp, %%ebp\n\t"
      "movq %%r13, %%rdi\n\t"
      "callq *%%r12\n\t"
      "movl %%eax, %%edi\n\t"
      "movl $60, %%eax\n\t"  // SYS_exit
      "syscall\n\t"
      "hlt\n\t"
      "1:\n\t"
      : "+a"(ret)
      : "D"(cl), "S"(sizeof(*cl)), "r"(r12), "r"(r13)
      : "rcx", "r11", "memory", "cc");
  return ret;
}
constexpr bool kHaveClone3 = true;
#else
constexpr bool kHaveClone3 = false;
#endif

// Set once the kernel refused CLONE_INTO_CGROUP: later spawns go straight to clone.
bool g_clone3_refused = false;

volatile std::sig_atomic_t g_arrivals = 0;
// asio's handler for each noted signal, run after the count. Written before the handler that
// reads it is installed; a signal number indexes it.
struct sigaction g_next[NSIG];
// The signals passed to note_arrivals_of (an empty set until then).
sigset_t& noted_set() {
  static sigset_t set = [] {
    sigset_t s;
    ::sigemptyset(&s);
    return s;
  }();
  return set;
}

void count_then_forward(int sig, siginfo_t* info, void* context) {
  g_arrivals = static_cast<std::sig_atomic_t>(g_arrivals + 1);
  if (sig <= 0 || sig >= NSIG) return;
  const struct sigaction& next = g_next[sig];
  if ((next.sa_flags & SA_SIGINFO) != 0) {
    if (next.sa_sigaction != nullptr) next.sa_sigaction(sig, info, context);                            // NOLINT
  } else if (next.sa_handler != SIG_DFL && next.sa_handler != SIG_IGN && next.sa_handler != nullptr) {  // NOLINT
    next.sa_handler(sig);                                                                               // NOLINT
  }
}

}  // namespace

void note_arrivals_of(int sig) {
  struct sigaction current {};
  if (sig <= 0 || sig >= NSIG || ::sigaction(sig, nullptr, &current) != 0) return;
  if ((current.sa_flags & SA_SIGINFO) != 0 && current.sa_sigaction == count_then_forward) return;  // NOLINT
  g_next[sig] = current;
  struct sigaction mine = current;
  mine.sa_flags |= SA_SIGINFO;
  mine.sa_sigaction = count_then_forward;  // NOLINT
  if (::sigaction(sig, &mine, nullptr) == 0) ::sigaddset(&noted_set(), sig);
}

unsigned signal_arrivals() { return static_cast<unsigned>(g_arrivals); }

const sigset_t& noted_signals() { return noted_set(); }

void close_descriptors_from(int low, bool at_exec) {
  if (::syscall(SYS_close_range, static_cast<unsigned>(low), ~0U, 0U) == 0) return;
  auto drop = [at_exec](int fd) { at_exec ? ::fcntl(fd, F_SETFD, FD_CLOEXEC) : ::close(fd); };
  const int dir = ::open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    // Closing while reading may make the directory skip entries: read it again until a pass
    // finds nothing left to close (marking close-on-exec changes nothing: one pass).
    for (int pass = 0; pass < 8; ++pass) {
      bool dropped = false;
      ::lseek(dir, 0, SEEK_SET);
      alignas(8) char buf[4096];
      for (;;) {
        const long n = ::syscall(SYS_getdents64, dir, buf, sizeof buf);
        if (n <= 0) break;
        for (long off = 0; off < n;) {
          const auto* e = reinterpret_cast<const struct dirent64*>(buf + off);  // NOLINT: the kernel's layout
          off += e->d_reclen;
          int fd = 0;
          const char* c = e->d_name;
          if (*c < '0' || *c > '9') continue;  // "." and ".."
          for (; *c >= '0' && *c <= '9' && fd < (1 << 30); ++c) fd = fd * 10 + (*c - '0');
          if (fd >= low && fd != dir) {
            drop(fd);
            dropped = true;
          }
        }
      }
      if (at_exec || !dropped) break;
    }
    ::close(dir);
    return;
  }
  rlimit lim{};
  const rlim_t max_fd = ::getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY ? lim.rlim_cur : 65536;
  for (rlim_t fd = static_cast<rlim_t>(low); fd < max_fd; ++fd) drop(static_cast<int>(fd));
}

std::vector<int> signals_to_reset() {
  std::vector<int> out{SIGPIPE};
  for (int sig = 1; sig < NSIG; ++sig) {
    if (sig != SIGPIPE && has_handler(sig)) out.push_back(sig);
  }
  return out;
}

SpawnResult spawn_worker(const SpawnRequest& request) {
  auto argv = c_array(request.argv);
  auto envp = c_array(request.envp);
  ChildArgs args;
  args.path = request.path.c_str();
  args.argv = argv.data();
  args.envp = envp.data();
  args.cwd = request.cwd.empty() ? nullptr : request.cwd.c_str();
  args.stdin_fd = request.stdin_fd;
  args.stdout_fd = request.stdout_fd;
  args.stderr_fd = request.stderr_fd;
  args.parent_pid = ::getpid();
  args.new_session = request.new_session;
  if (request.reset_signals != nullptr) {
    args.reset_listed = true;
    args.reset_signals = request.reset_signals->data();
    args.reset_count = request.reset_signals->size();
  }
  // The affinity mask in the kernel's layout (bit c of word c / bits-per-long), built here: the
  // child may not allocate.
  std::vector<unsigned long> mask;                                           // NOLINT: the kernel's cpumask unit
  constexpr int kBitsPerWord = static_cast<int>(sizeof(unsigned long) * 8);  // NOLINT
  for (int c : request.cpus) {
    if (c < 0) {
      continue;
    }
    const auto word = static_cast<std::size_t>(c / kBitsPerWord);
    if (mask.size() <= word) {
      mask.resize(word + 1, 0);
    }
    mask[word] |= 1UL << static_cast<unsigned>(c % kBitsPerWord);
  }
  std::vector<const char*> cgroups;
  for (const auto& c : request.cgroup_procs) cgroups.push_back(c.c_str());
  cgroups.push_back(nullptr);
  args.cgroup_procs = cgroups.data();
  if (!mask.empty()) {
    args.cpu_mask = mask.data();
    args.cpu_mask_bytes = mask.size() * sizeof(unsigned long);  // NOLINT
  }

  // No signal handler may run in the child while it still shares our memory.
  sigset_t all;
  sigset_t saved;
  ::sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, &saved);
  int pidfd = -1;
  pid_t pid = -1;
  int clone_errno = 0;
  bool cloned = false;
#if defined(__x86_64__) && defined(SYS_clone3) && defined(CLONE_INTO_CGROUP)
  if (kHaveClone3 && request.cgroup_dir_fd >= 0 && !request.cgroup_procs.empty() && !g_clone3_refused) {
    clone_args cl{};
    cl.flags = CLONE_VM | CLONE_VFORK | CLONE_PIDFD | CLONE_INTO_CGROUP;
    cl.pidfd = reinterpret_cast<__u64>(&pidfd);  // NOLINT: the kernel's u64 pointer
    cl.exit_signal = SIGCHLD;
    cl.stack = reinterpret_cast<__u64>(g_child_stack);  // NOLINT
    cl.stack_size = sizeof(g_child_stack);
    cl.cgroup = static_cast<__u64>(request.cgroup_dir_fd);
    args.in_first_cgroup = true;
    const long r = clone3_call(&cl, child_main, &args);
    if (r >= 0) {
      pid = static_cast<pid_t>(r);
      cloned = true;
    } else if (r == -ENOSYS || r == -EINVAL || r == -E2BIG || r == -EOPNOTSUPP || r == -EPERM) {
      // An older kernel, a seccomp filter or a cgroup it will not start us in: join by writing.
      g_clone3_refused = true;
      args.in_first_cgroup = false;
    } else {
      clone_errno = static_cast<int>(-r);
      cloned = true;  // a real failure (EAGAIN, ENOMEM): reported below, as clone's would be
    }
  }
#endif
  if (!cloned) {
    pid = ::clone(child_main, g_child_stack + sizeof(g_child_stack), CLONE_VM | CLONE_VFORK | CLONE_PIDFD | SIGCHLD,
                  &args, &pidfd);
    clone_errno = errno;
  }
  ::pthread_sigmask(SIG_SETMASK, &saved, nullptr);

  SpawnResult result;
  if (pid < 0) {
    result.error = clone_errno;
    result.failed_step = "clone";
    return result;
  }
  result.pid = pid;
  result.pidfd = pidfd;
  result.error = args.error;
  result.failed_step = args.failed_step;
  result.affinity_error = args.affinity_error;
  result.cgroup_error = args.cgroup_error;
  return result;
}

std::optional<ExitStatus> peek_exit(pid_t pid) {
  siginfo_t info{};
  for (;;) {
    if (::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0) {
      break;
    }
    if (errno != EINTR) {
      throw Error("waitid(" + std::to_string(pid) + ") failed: " + std::strerror(errno));
    }
  }
  if (info.si_pid == 0) {
    return std::nullopt;
  }
  if (info.si_code == CLD_EXITED) {
    return ExitStatus::exited(info.si_status);
  }
  return ExitStatus::killed(info.si_status);
}

std::optional<ExitDetail> peek_exit_detail(pid_t pid) {
  // The raw syscall: glibc's waitid has no rusage argument.
  siginfo_t info{};
  struct rusage ru {};
  if (::syscall(SYS_waitid, P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOHANG | WNOWAIT, &ru) != 0 ||
      info.si_pid == 0) {
    return std::nullopt;
  }
  ExitDetail d;
  d.core_dumped = info.si_code == CLD_DUMPED;
  d.max_rss_kb = ru.ru_maxrss;
  return d;
}

void reap(pid_t pid, int pidfd) {
  siginfo_t info{};
  while (::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED) != 0 && errno == EINTR) {
  }
  if (pidfd >= 0) {
    ::close(pidfd);
  }
}

bool signal_group(pid_t pgid, int sig) {
  if (pgid <= 0) {
    return true;
  }
  return ::killpg(pgid, sig) == 0 || errno == ESRCH || errno == EPERM;
}

std::string resolve_executable(const std::string& name, const std::string& path_var, const std::string& cwd) {
  if (name.empty()) {
    throw UsageError("no worker command given", "pass the training script or program after the ddprun options");
  }
  auto executable = [](const std::string& p) {
    struct stat st {};
    return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(p.c_str(), X_OK) == 0;
  };
  if (name.find('/') != std::string::npos) {
    const std::string full = (name.front() == '/' || cwd.empty()) ? name : cwd + "/" + name;
    if (!executable(full)) {
      throw UsageError("worker command '" + name + "' is not an executable file" +
                           (cwd.empty() ? std::string() : " (relative to working dir " + cwd + ")"),
                       "check the path and its execute permission");
    }
    return name;  // execve runs after chdir, so a relative name stays relative to cwd
  }
  const std::string dirs = path_var.empty() ? std::string("/usr/local/bin:/usr/bin:/bin") : path_var;
  for (const auto& dir : split(dirs, ':')) {
    const std::string candidate = (dir.empty() ? std::string(".") : dir) + "/" + name;
    if (executable(candidate)) {
      if (candidate.front() != '/') {
        // A relative PATH entry means the agent's directory, not the worker's working dir.
        char here[4096];
        if (::getcwd(here, sizeof(here)) != nullptr) {
          return std::string(here) + "/" + candidate;
        }
      }
      return candidate;
    }
  }
  throw UsageError("worker command '" + name + "' was not found on PATH",
                   "give its path, or pass --no-python for binaries; PATH=" + dirs);
}

}  // namespace ddprun::agent
