#pragma once
// Containment: every process a worker starts belongs to the job and ends with it, however it
// detaches (setsid, double fork), both when the job ends and when the agent itself is killed
// with SIGKILL. See docs/containment.md for the choice of mechanisms.
//
// One Containment per agent. It creates a job cgroup (cgroup v2 with cgroup.kill, else the v1
// freezer hierarchy); workers are started in it (cgroup v2: CLONE_INTO_CGROUP) or join it in the
// spawn child before exec, so nothing they start can escape it. Ranks get cgroups of their own
// below it only where those carry something: cgroup v2 with the memory controller delegated
// (per-rank memory), and the v1 freezer. Without a usable cgroup
// the job is the set of processes carrying this agent's unique DDPRUN_JOB_TOKEN in their
// environment (read from /proc/PID/environ). Membership is exact either way: sweep() never
// signals a process outside the job.
//
// A watchdog process started at creation holds one end of a socket pair whose other end only the
// agent holds. When the agent ends for any reason, SIGKILL included, the watchdog reads EOF,
// sweeps the job and removes its cgroups. The watchdog ignores terminal signals and runs in a
// session of its own, so neither a Ctrl-C nor a SIGKILL to ddprun's process group ends it before
// it has cleaned up. It is ddprun-watchdog from beside the ddprun binary (agent/watchdog/main.c,
// started with vfork + exec), else a fork of the agent.
//
// Independently of the mechanism, with --rank-memory on and the v1 memory hierarchy (or a v2
// job cgroup that can delegate the memory controller) writable, each rank also gets a memory
// cgroup so its OOM kills and peak usage can be read per rank (rank_memory). Without one (the
// default; and cgroup v2 below a cgroup that holds processes: a container, a systemd scope, a
// batch job, can never delegate it), OOM kills are counted where the kernel counts them for the
// workers: the nearest memory cgroup at or above the job, else the whole machine.
//
// Not thread-safe; create before any thread starts (it forks).
#include <sys/types.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace ddprun::agent {

// Where the cgroup hierarchy of `controller` ("" = cgroup2, else the v1 hierarchy carrying that
// controller) is mounted with the hierarchy's root as the mount's root (not a bind mount of a
// subtree); nullopt when none is. `statmount`: ask the kernel about the usual mount points
// (/sys/fs/cgroup, /sys/fs/cgroup/unified, /sys/fs/cgroup/CONTROLLER) with statmount(2),
// Linux 6.8, and nullopt where it cannot say; otherwise read /proc/self/mountinfo, whose
// formatting costs the kernel ~1.5 us per mount of the machine (~35 us on a small VM, more on a
// node with many mounts; the first matching line). Containment asks the first way, then the
// second; both are public for the test that the first names a mount the second lists.
enum class MountLookup { statmount, mountinfo };
std::optional<std::string> cgroup_mount_point(const std::string& controller, MountLookup how);

enum class ContainmentMode : std::uint8_t { automatic, cgroup2, cgroup1, proc, off };

// Parses "auto", "cgroup2", "cgroup1", "proc", "off"; throws UsageError naming --containment.
ContainmentMode parse_containment_mode(const std::string& text);

struct RankMemory {
  std::uint64_t oom_kills = 0;         // OOM kills in `oom_scope` since the attempt began
  std::optional<std::uint64_t> peak;   // bytes (memory.peak / max_usage_in_bytes), rank cgroups only
  std::optional<std::uint64_t> limit;  // bytes, the effective limit when one is set
  // Where oom_kills were counted: empty for the rank's own cgroup (the kills were of this rank's
  // processes); else "cgroup /a/b" (the nearest memory cgroup at or above the job) or "this
  // machine" (/proc/vmstat): kills of some process there, which may or may not be this rank's.
  std::string oom_scope;
  bool oom_scope_machine = false;  // oom_scope is the whole machine (/proc/vmstat)
};

class Containment {
 public:
  // Sets up the job's containment for `nproc` local ranks. Falls back (auto) or throws
  // UsageError (an explicit mode that cannot be used) with the reason.
  // `rank_memory` (--rank-memory on): a memory cgroup per rank where one can be made.
  static std::unique_ptr<Containment> create(ContainmentMode mode, int nproc, bool rank_memory = false);
  ~Containment();  // sweeps, removes the cgroups, ends the watchdog
  Containment(const Containment&) = delete;
  Containment& operator=(const Containment&) = delete;

  // "cgroup v2 /sys/fs/cgroup/unified/ddprun-123" etc., for logs and docs.
  const std::string& mechanism() const { return mechanism_; }
  // KEY=VALUE to add to every worker's environment (the job token).
  std::string token_env() const;
  // cgroup.procs files a worker of `local_rank` writes "0" to before exec (its containment
  // cgroup: the rank's or the job's; the memory cgroup is joined by join_memory).
  std::vector<std::string> join_files(int local_rank) const;
  // Moves `pid` (a worker just started) into its rank's memory cgroup when that is a separate
  // hierarchy (cgroup v1 memory), asynchronously: the watchdog process does the write. A
  // migration waits for the kernel's cgroup rwsem (an RCU grace period, milliseconds on a loaded
  // box); done by the child before exec it held back the first exec, done by the agent it held
  // back the agent's event loop. The price: a process the worker starts in its first moments
  // stays accounted to the agent's memory cgroup (containment does not depend on it). Failures
  // are silent: the rank's memory figures are then missing from a diagnosis.
  void join_memory(int local_rank, pid_t pid) const;
  // With cgroup v2: an fd of the cgroup directory to start the rank's worker in (the rank's or
  // the job's; SpawnRequest::cgroup_dir_fd; join_files(local_rank).front() is its cgroup.procs).
  // Else -1, also once a sweep has used cgroup.kill (killed_).
  int join_dir_fd(int local_rank) const;
  // Call before starting an attempt: resets per-rank peak counters and OOM baselines; before
  // the first, waits for the watchdog to be ready (await_watchdog).
  void begin_attempt();
  // Every process of the job's containment cgroup(s), or nullopt without one (proc, off: the
  // v1 memory cgroups are joined late and are not asked).
  std::optional<std::vector<pid_t>> job_pids() const;
  RankMemory rank_memory(int local_rank) const;
  // SIGKILLs every process of the job still alive, bounded in time; returns how many it killed.
  // `last`: the job's end (not an attempt's), where the proc mode's scan is repeated until
  // several in a row find nothing (a process that forks and exits without pause can slip past
  // one scan).
  int sweep(bool last = false);
  // A process of the job that outlived its SIGKILL (stuck in the kernel): sweeps no longer wait
  // for it to end (the cgroup modes still signal it; proc mode no longer reads its environ, nor
  // that of a process in D, which it looks at again until it was in D on two scans in a row);
  // the watchdog is told too, for its sweep after the agent's end.
  void give_up_on(pid_t pid);
  // Hands the removal of `dir` (an absolute path; with what is in it) to the watchdog, which does
  // it once the agent is gone: the agent's exit does not wait for a disk file system to free the
  // directory. False when there is no watchdog to take it, or when this process is PID 1 (its
  // exit ends the watchdog too).
  bool remove_when_gone(const std::string& dir) const;
  // Tells the watchdog about the run directory `dir` (absolute): should the agent end without
  // settling it (killed), the watchdog removes it unless it holds a file with data, by the rule
  // of remove_job_dir_unless_useful.
  void clean_up_when_gone(const std::string& dir) const;
  // Tells the watchdog about the file timer's FIFO `path` (absolute; the file `dev`/`ino`): should
  // the agent end without removing it (killed), the watchdog does, if the path still names it and
  // nobody reads it (a new job's agent at the same path would).
  void unlink_when_gone(const std::string& path, dev_t dev, ino_t ino) const;
  // Whether the watchdog still runs (one waitpid WNOHANG): one that ended already — a
  // ddprun-watchdog of another build refuses the protocol and exits 2 at once, or something
  // killed it — is reaped and reported (a warning); the agent then removes the job's cgroups and
  // run directory itself at its end. Called when the watchdog's pidfd says it ended, and at the end.
  void check_watchdog();
  // The watchdog's pid (this process's child until check_watchdog reaps it); -1 without one.
  pid_t watchdog_pid() const { return watchdog_fd_ >= 0 ? watchdog_ : -1; }

 private:
  Containment() = default;
  static pid_t start_watchdog_program(const Containment& c, const int fds[2]);  // -1: not available
  static pid_t fork_watchdog(std::unique_ptr<Containment>& c, const int fds[2]);
  // Waits (once, bounded) for the watchdog's "+": it runs under its own name, out of the agent's
  // process group and session, its terminal signals ignored. Before the first workers, so that
  // none runs while a `pkill ddprun`, a `kill -- -PGID` or a Ctrl-C could still end the watchdog
  // with the agent (a watchdog the agent forked gets there only when the scheduler runs it).
  void await_watchdog();
  int move_to_memory_cgroup(int local_rank, pid_t pid) const;  // 0 or errno
  bool send_dir(char kind, const std::string& dir) const;      // an "e DIR" / "r DIR" line
  std::string worker_cgroup(int local_rank) const;             // the directory a rank's worker joins
  std::string mechanism_;
  ContainmentMode mode_ = ContainmentMode::off;
  std::string token_;
  pid_t agent_sid_ = -1;           // the agent's session: proc sweeps signal no process group in it
  std::uint64_t start_ticks_ = 0;  // the agent's starttime: proc sweeps read no older process
  std::vector<pid_t> stuck_;       // give_up_on
  bool given_up(pid_t pid) const { return std::find(stuck_.begin(), stuck_.end(), pid) != stuck_.end(); }
  std::string job_dir_;     // the containment cgroup (v2 or v1 freezer); empty = proc/off
  bool rank_dirs_ = false;  // job_dir_ has a cgroup per rank (v2 with memory, v1 freezer)
  std::string memory_dir_;  // the job's memory cgroup; empty = none
  bool memory_v2_ = false;
  bool memory_fresh_ = true;  // the per-rank memory cgroups were created by this agent, unused so far
  std::vector<std::uint64_t> oom_base_;
  // Where the workers' OOM kills are counted without rank memory cgroups (or before a worker
  // joined its v1 one): the file whose "oom_kill N" counts them
  // (memory.events, memory.oom_control or /proc/vmstat), its label for RankMemory::oom_scope,
  // the cgroup directory and hierarchy root for the limit (empty for the machine), its baseline.
  std::string oom_scope_file_;
  std::string oom_scope_;
  std::string oom_scope_dir_;
  std::string memory_mount_;     // the hierarchy root of memory_dir_
  std::string oom_scope_mount_;  // the hierarchy root of oom_scope_dir_
  bool oom_scope_v2_ = false;
  std::uint64_t oom_scope_base_ = 0;
  std::vector<int> rank_dir_fds_;  // cgroup v2: O_PATH fds of the rank cgroups, or of the job cgroup
  // cgroup v2: the last sweep read "populated 0" and no worker was handed a way in since
  // (join_files, join_dir_fd): nothing can be in the job cgroup, the next sweep reads nothing.
  mutable bool known_empty_ = false;
  // cgroup v2: a sweep wrote cgroup.kill. Some kernels (6.18 here) SIGKILL at birth every
  // process cloned into a cgroup killed that way (CLONE_INTO_CGROUP compares kill counts), so
  // later workers join by writing cgroup.procs instead (join_dir_fd gives -1), which is not.
  bool killed_ = false;
  int nproc_ = 0;
  pid_t watchdog_ = -1;
  int watchdog_fd_ = -1;
  bool watchdog_ready_ = false;     // await_watchdog asked
  unsigned arrivals_at_start_ = 0;  // signal_arrivals() when made: a later one ends await_watchdog
};

// The processes of `root`'s tree (root, its children, recursively) read from
// /proc/PID/task/TID/children.
std::vector<pid_t> process_tree(pid_t root);

// The state letter of /proc/PID/stat (R, S, D, Z, ...), or 0 when it cannot be read.
char process_state(pid_t pid);
// utime + stime of /proc/PID/stat in clock ticks, or nullopt when it cannot be read.
std::optional<std::uint64_t> process_cpu_ticks(pid_t pid);

}  // namespace ddprun::agent
