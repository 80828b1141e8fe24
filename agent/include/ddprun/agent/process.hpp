#pragma once
// Process primitives of the agent: spawn a worker in its own process group (a session of its
// own for workers), observe its exit through a pidfd without reaping it, signal its group, reap it.
//
// Why not Boost.Process v2's launchers: in Boost 1.81 both default_launcher (plain fork of a
// parent that may be large) and vfork_launcher (calls io_context::notify_fork(fork_child) in the
// vfork child, which rebuilds the epoll reactor inside the parent's shared memory, then ::exit)
// are unsuitable. spawn_worker() is a posix_spawn-style launcher: clone(CLONE_VM|CLONE_VFORK|
// CLONE_PIDFD) on a private stack, only async-signal-safe calls in the child, the pidfd obtained
// atomically with the child. The pidfd is then watched on the io_context (readable = exited).
//
// Child setup, in order: signal dispositions that are handlers in the agent go back to SIG_DFL,
// SIGPIPE to SIG_DFL, signal mask cleared; setpgid(0, 0), or setsid() with new_session (own
// process group with the child's pid as its id either way, so the agent's killpg reaches the
// worker and its children but a terminal Ctrl-C does not go around the agent);
// prctl(PR_SET_PDEATHSIG, SIGKILL) and a getppid() check (so `kill -9 ddprun` kills the
// worker, even if the agent died during the spawn); dup2 of the requested stdin/stdout/stderr; every
// other descriptor above 2 closed (close_range; the agent's sockets never leak into workers);
// joining the requested cgroups (containment); CPU affinity (--numa-binding: the raw sched_setaffinity syscall with a
// mask built by the parent; a failure is recorded in SpawnResult::affinity_error and the worker still starts, unbound:
// binding is a performance hint, not a correctness requirement); chdir; execve.
//
// Not thread-safe: call from the agent's io_context thread (the clone stack is shared).
#include <sys/types.h>

#include <csignal>

#include <string>
#include <vector>

#include <optional>

#include "ddprun/agent/exit_status.hpp"

namespace ddprun::agent {

struct SpawnRequest {
  std::string path;               // executable, already resolved (see resolve_executable)
  std::vector<std::string> argv;  // argv[0] included
  std::vector<std::string> envp;  // complete environment, KEY=VALUE
  std::string cwd;                // empty = inherit
  int stdin_fd = -1;              // -1 = inherit the agent's
  int stdout_fd = -1;             // -1 = inherit the agent's
  int stderr_fd = -1;
  std::vector<int> cpus;  // CPU ids to bind the worker to; empty = inherit the agent's affinity
  // cgroup.procs files the child joins (writes "0") before exec, so everything it starts stays
  // in them (containment.hpp). A failure is recorded in SpawnResult::cgroup_error.
  std::vector<std::string> cgroup_procs;
  // A cgroup v2 directory (an fd of it, owned by the caller) to start the child in, atomically
  // with clone3(CLONE_INTO_CGROUP): no migration, so no wait for the kernel's cgroup rwsem (an
  // RCU grace period, milliseconds on a loaded box) before the first exec. When the kernel
  // refuses it (before 5.7, or not x86-64), cgroup_procs.front() is the same cgroup's
  // cgroup.procs and the child joins it by writing instead. -1 = none.
  int cgroup_dir_fd = -1;
  // The signals the child sets to SIG_DFL before exec: signals_to_reset(), computed by the caller
  // once for a batch of spawns (owned by the caller). nullptr: the child asks the kernel about
  // every signal itself, ~64 sigaction calls (0.6 µs each on the development VM) per worker
  // while the agent waits for the exec.
  const std::vector<int>* reset_signals = nullptr;
  // setsid() instead of setpgid(0, 0): a session of its own, without a controlling terminal, as
  // torch 2.6 starts workers (start_new_session=True). A process group of ddprun's session is a
  // background job of ddprun's terminal, and reading that terminal (pdb, breakpoint(), input())
  // stops it with SIGTTIN; a process of another session reads it freely.
  bool new_session = false;
};

// SIGPIPE (which the agent ignores for itself) and every signal this process has a handler for:
// what a child must set back to SIG_DFL before exec so that no handler of the agent runs in it
// (ignored signals stay ignored, nohup semantics). Valid until a handler is installed or removed.
std::vector<int> signals_to_reset();

// Arrivals of the signals the agent handles, for a wait outside its event loop (the watchdog's
// start): asio's signal_set tells only its own loop, through a pipe. After the signal_set has
// added `sig`, note_arrivals_of puts a handler in front of asio's that counts the arrival and then
// runs asio's. Removing the signal from the set (which restores the default) removes both.
void note_arrivals_of(int sig);
// Arrivals counted since note_arrivals_of was first called in this process.
unsigned signal_arrivals();
// The signals passed to note_arrivals_of: blocked around a check of signal_arrivals and unblocked
// by the wait itself (ppoll), so that an arrival between the two cannot be missed.
const sigset_t& noted_signals();

// For a child between fork/vfork and exec: every descriptor from `low` on is closed by the exec
// (`at_exec`: a vfork child that execs) or now (a forked child that does not exec). close_range
// (Linux 5.9), else each entry of /proc/self/fd (a kernel without close_range, a seccomp filter
// that refuses it), else every number up to the RLIMIT_NOFILE soft limit. Async-signal-safe: no
// allocation.
void close_descriptors_from(int low, bool at_exec);

struct SpawnResult {
  pid_t pid = -1;
  int pidfd = -1;                     // owned by the caller (close after reap)
  int error = 0;                      // errno of the failed step when pid == -1 or the child failed before exec
  const char* failed_step = nullptr;  // "clone", "setpgid", "setsid", "prctl", "dup2", "chdir", "execve", ...
  int affinity_error = 0;             // errno of sched_setaffinity when `cpus` was given and binding failed (not fatal)
  int cgroup_error = 0;               // errno of joining one of `cgroup_procs` (not fatal; the caller warns)
  bool ok() const { return pid > 0 && error == 0; }
};

// What the kernel reports about an exited, not yet reaped child beyond its ExitStatus.
struct ExitDetail {
  bool core_dumped = false;
  long max_rss_kb = 0;  // the child's own peak RSS (rusage ru_maxrss, children included once reaped)
};
// Like peek_exit, with the core-dump flag and the rusage (nullopt while running).
std::optional<ExitDetail> peek_exit_detail(pid_t pid);

// Starts the process. When the child fails before exec (e.g. chdir or execve fails), the child
// has already exited with 127; the result carries its pid, pidfd, error and step, and the
// caller still reaps it.
SpawnResult spawn_worker(const SpawnRequest& request);

// Non-blocking: the exit status when the process has exited, without reaping it (the zombie
// keeps the pid and process-group id from being reused until reap()). nullopt while running.
std::optional<ExitStatus> peek_exit(pid_t pid);

// Reaps an exited process (blocks if it has not exited) and closes its pidfd.
void reap(pid_t pid, int pidfd);

// killpg(pgid, sig), ignoring ESRCH (an empty group). Returns false on another error.
bool signal_group(pid_t pgid, int sig);

// The absolute path execve should run for `name`: names containing '/' are taken as is
// (relative to `cwd` when set); other names are searched in `path_var` (PATH). Throws
// ddprun::Error naming the command when nothing executable is found.
std::string resolve_executable(const std::string& name, const std::string& path_var, const std::string& cwd);

}  // namespace ddprun::agent
