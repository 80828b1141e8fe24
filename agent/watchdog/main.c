/* ddprun-watchdog: the containment watchdog of one ddprun agent (agent/src/containment.cpp,
 * docs/containment.md).
 *
 * The agent starts it once, before any worker, with one end of a socket pair as fd 3 whose other
 * end only the agent holds (a socket, not a pipe: the agent writes with MSG_NOSIGNAL, so a
 * watchdog that ended early cannot end the agent with SIGPIPE). It reads lines from the agent:
 *   "j MODE NPROC RANK_DIRS" the job (written before the agent starts it, so it is never
 *                 missing): MODE cgroup2, cgroup1 or proc; RANK_DIRS 1 when the job cgroup has a
 *                 cgroup rankR per local rank. Without it the watchdog touches nothing.
 *   "c DIR"       the job's containment cgroup (cgroup2, cgroup1)
 *   "M DIR"       the job's v1 memory cgroup (--rank-memory on)
 *   "t SID ENTRY" the agent's session and the job token as in the workers' environment,
 *                 "DDPRUN_JOB_TOKEN=..." (proc)
 *   "m RANK PID"  move PID into the rank's memory cgroup (v1 memory, --rank-memory on)
 *   "e DIR"       the run directory: if the agent ends without settling it ("r", or removing or
 *                 keeping it itself), remove it unless it holds a file with data (ddprun's Python
 *                 hook aside), as the agent would have
 *   "r DIR"       remove the run directory DIR once the agent is gone (nothing in it to keep)
 *   "f MAJOR MINOR INODE PATH" remove the FIFO at PATH (the file timer's) once the agent is
 *                 gone, if it is still that file and nobody reads it (remove_fifo)
 *   "g PID"       the agent gave up on PID, a worker SIGKILL did not end (stuck in the kernel):
 *                 its environ is not read again (the read may wait on the lock it holds), nor,
 *                 from then on, that of a process in uninterruptible sleep (its children may be
 *                 stuck with it), and sweeps stop waiting when only such processes are left
 *   "d"           the agent ended normally and swept the job itself
 * and, at EOF (the agent is gone, however it ended, SIGKILL included), unless told "d" removes
 * the FIFO and sweeps the job, then removes the run directory and the job's cgroups.
 *
 * Its name: it calls itself "ddp-watchdog" (comm) and is started with that name alone in its
 * arguments, the job's paths coming by the socket: `pkill ddprun` and `pkill -f ddprun`, which
 * end the agent, must not end the process that cleans up after it.
 *
 * Why a program of its own, and without a C library: the agent used to fork(), and a fork of
 * the agent copies its page tables and makes every page the agent writes afterwards fault
 * (copy-on-write): about 0.4 ms of CPU on the path to the first worker. Starting this program
 * costs the agent a vfork and an exec; a C library's start-up alone (CPU feature probes, a
 * slow trap under a hypervisor) would cost as much again, so it uses system calls directly.
 * It is built for x86-64 and aarch64; elsewhere the agent forks as before.
 *
 * Fd 4, when open, is a pidfd of the agent, opened by the agent itself before the start (no
 * window in which its pid could name another process); readable once the agent has ended.
 *
 * It writes one byte, "+", to fd 3 once it is ready (named, its terminal signals ignored); the
 * agent starts no worker before it has read it.
 *
 * Usage (the agent's, not a user's):
 *   ddp-watchdog 5
 * where 5 is the version of the protocol above (the agent's kWatchdogProtocol). */
#include <asm/unistd.h>
#include <linux/fcntl.h>
#include <linux/signal.h>
#include <stddef.h>

#if !defined(__x86_64__) && !defined(__aarch64__)
#error "ddprun-watchdog supports x86-64 and aarch64; other machines use the agent's fork"
#endif

/* ----------------------------------------------------------------------------------------- */
/* System calls */

static long sys6(long n, long a, long b, long c, long d, long e, long f) {
#if defined(__x86_64__)
  long ret;
  register long r10 __asm__("r10") = d;
  register long r8 __asm__("r8") = e;
  register long r9 __asm__("r9") = f;
  __asm__ volatile("syscall"
                   : "=a"(ret)
                   : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8), "r"(r9)
                   : "rcx", "r11", "memory");
  return ret;
#else
  register long x8 __asm__("x8") = n;
  register long x0 __asm__("x0") = a;
  register long x1 __asm__("x1") = b;
  register long x2 __asm__("x2") = c;
  register long x3 __asm__("x3") = d;
  register long x4 __asm__("x4") = e;
  register long x5 __asm__("x5") = f;
  __asm__ volatile("svc 0" : "+r"(x0) : "r"(x8), "r"(x1), "r"(x2), "r"(x3), "r"(x4), "r"(x5) : "memory");
  return x0;
#endif
}
#define SYS(n, a, b, c) sys6((n), (long)(a), (long)(b), (long)(c), 0, 0, 0)
#define SYS4(n, a, b, c, d) sys6((n), (long)(a), (long)(b), (long)(c), (long)(d), 0, 0)

#define E_NOENT 2
#define E_SRCH 3
#define E_INTR 4
#define E_NXIO 6
#define E_BUSY 16
#define E_ISDIR 21
#define E_NOTEMPTY 39
#define AT_FD_CWD (-100)
#define AT_REMOVE_DIR 0x200
#define DT_DIRECTORY 4

/* Compilers may emit calls to these for copies and zeroing even in freestanding code. */
void* memset(void* d, int c, size_t n) {
  unsigned char* p = d;
  while (n-- > 0) *p++ = (unsigned char)c;
  return d;
}
void* memcpy(void* d, const void* s, size_t n) {
  unsigned char* p = d;
  const unsigned char* q = s;
  while (n-- > 0) *p++ = *q++;
  return d;
}

static long sys_read(int fd, void* buf, long n) { return SYS(__NR_read, fd, buf, n); }
static long sys_write(int fd, const void* buf, long n) { return SYS(__NR_write, fd, buf, n); }
static int sys_open(const char* path, int flags) { return (int)SYS4(__NR_openat, AT_FD_CWD, path, flags, 0); }
static int sys_openat(int dirfd, const char* path, int flags) { return (int)SYS4(__NR_openat, dirfd, path, flags, 0); }
static void sys_close(int fd) { SYS(__NR_close, fd, 0, 0); }
static long sys_unlinkat(int dirfd, const char* path, int flags) { return SYS(__NR_unlinkat, dirfd, path, flags); }
static long sys_kill(int pid, int sig) { return SYS(__NR_kill, pid, sig, 0); }
static int sys_getpid(void) { return (int)SYS(__NR_getpid, 0, 0, 0); }
static int sys_getppid(void) { return (int)SYS(__NR_getppid, 0, 0, 0); }
static long sys_getdents(int fd, void* buf, long n) { return SYS(__NR_getdents64, fd, buf, n); }
static long sys_readlink(const char* path, char* buf, long n) { return SYS4(__NR_readlinkat, AT_FD_CWD, path, buf, n); }
static void sys_exit(int code) {
  for (;;) SYS(__NR_exit_group, code, 0, 0);
}
static long sys_lseek0(int fd) { return SYS(__NR_lseek, fd, 0, 0 /* SEEK_SET */); }
/* CLOCK_MONOTONIC in milliseconds. */
static long now_ms(void) {
  struct {
    long sec, nsec;
  } ts = {0, 0};
  SYS(__NR_clock_gettime, 1 /* CLOCK_MONOTONIC */, &ts, 0);
  return ts.sec * 1000 + ts.nsec / 1000000;
}
/* statx (the same layout on every machine, unlike struct stat): the file type bits of stx_mode
 * the device and the inode, of `path` below `dirfd` or of `dirfd` itself (path ""). -1 on failure. */
struct file_id {
  unsigned type;
  unsigned dev_major, dev_minor;
  unsigned long long size, ino;
};
static int file_of(int dirfd, const char* path, struct file_id* out) {
  unsigned char buf[256] __attribute__((aligned(8)));
  const long r = sys6(__NR_statx, dirfd, (long)path, 0x1000 /* AT_EMPTY_PATH */ | 0x100 /* AT_SYMLINK_NOFOLLOW */,
                      0x1 /* STATX_TYPE */ | 0x100 /* STATX_INO */ | 0x200 /* STATX_SIZE */, (long)buf, 0);
  if (r < 0) return -1;
  out->type = *(const unsigned short*)(buf + 0x1c) & 0170000u;
  out->dev_major = *(const unsigned*)(buf + 0x88);
  out->dev_minor = *(const unsigned*)(buf + 0x8c);
  out->size = *(const unsigned long long*)(buf + 0x28);
  out->ino = *(const unsigned long long*)(buf + 0x20);
  return 0;
}

/* A pidfd of the agent, where the agent could not pass its own: -1 before Linux 5.3 or where it
 * is refused, or when the agent is already gone (then its pid may be somebody else's).
 * Readable once the agent's last thread has exited, which is after every one of its threads
 * dropped its descriptors and ran the deferred closes (the kernel's do_exit: exit_files, then
 * exit_task_work, then exit_notify). A reference held outside the agent (a /proc/PID/fd reader)
 * can delay the last close past that: the FIFO is then kept, the safe way round. */
static int open_agent_end(int agent) {
  const int fd = (int)SYS(__NR_pidfd_open, agent, 0, 0);
  if (fd < 0) return -1;
  if (sys_getppid() != agent) {
    sys_close(fd);
    return -1;
  }
  return fd;
}

/* Waits until `fd` is readable, at most `ms` milliseconds. */
static void wait_readable(int fd, long ms) {
  struct {
    int fd;
    short events, revents;
  } p = {fd, 1 /* POLLIN */, 0};
  struct {
    long sec, nsec;
  } ts = {ms / 1000, (ms % 1000) * 1000000L};
  while (sys6(__NR_ppoll, (long)&p, 1, (long)&ts, 0, 8, 0) == -E_INTR) {
  }
}

static void sleep_ms(long ms) {
  struct {
    long sec, nsec;
  } ts = {ms / 1000, (ms % 1000) * 1000000L};
  SYS(__NR_nanosleep, &ts, 0, 0);
}

/* ----------------------------------------------------------------------------------------- */
/* Strings and files */

static size_t str_len(const char* s) {
  size_t n = 0;
  while (s[n] != '\0') ++n;
  return n;
}
static int str_eq(const char* a, const char* b) {
  while (*a != '\0' && *a == *b) ++a, ++b;
  return *a == *b;
}
static int has(const char* hay, long n, const char* needle) {
  const long k = (long)str_len(needle);
  for (long i = 0; i + k <= n; ++i) {
    long j = 0;
    while (j < k && hay[i + j] == needle[j]) ++j;
    if (j == k) return 1;
  }
  return 0;
}
/* Parses a decimal number at *s, advancing *s; -1 when there is none or it is too large. */
static long parse_num(const char** s) {
  long v = 0;
  int digits = 0;
  while (**s >= '0' && **s <= '9') {
    if (v > 100000000L) return -1;
    v = v * 10 + (**s - '0');
    ++*s;
    ++digits;
  }
  return digits > 0 ? v : -1;
}
/* An unsigned 64-bit number (an inode, a device number); 0 with *ok cleared when there are no
 * digits or it does not fit. */
static unsigned long long parse_u64(const char** s, int* ok) {
  unsigned long long v = 0;
  int digits = 0;
  while (**s >= '0' && **s <= '9') {
    const unsigned d = (unsigned)(**s - '0');
    if (v > (~0ULL - d) / 10) {
      *ok = 0;
      return 0;
    }
    v = v * 10 + d;
    ++*s;
    ++digits;
  }
  if (digits == 0) *ok = 0;
  return v;
}
static char* put_num(char* p, long v) {
  char tmp[24];
  int n = 0;
  do {
    tmp[n++] = (char)('0' + v % 10);
    v /= 10;
  } while (v > 0);
  while (n > 0) *p++ = tmp[--n];
  return p;
}

/* A path "A" + "/rankR" (r >= 0) + "/B" (when b is set) into buf; 0 when it does not fit. */
static char path_buf[8192];
static const char* path_of(const char* a, long r, const char* b) {
  const size_t la = str_len(a), lb = b ? str_len(b) : 0;
  if (la + lb + 40 > sizeof path_buf) return 0;
  char* p = path_buf;
  for (size_t i = 0; i < la; ++i) *p++ = a[i];
  if (r >= 0) {
    const char* rank = "/rank";
    while (*rank != '\0') *p++ = *rank++;
    p = put_num(p, r);
  }
  if (b) {
    *p++ = '/';
    for (size_t i = 0; i < lb; ++i) *p++ = b[i];
  }
  *p = '\0';
  return path_buf;
}

/* Up to `cap` bytes of `name` below `dirfd` (AT_FD_CWD: a path); -1 when it cannot be opened. */
static long read_at(int dirfd, const char* name, char* buf, long cap) {
  if (!name) return -1;
  const int fd = sys_openat(dirfd, name, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  long got = 0;
  while (got < cap) {
    const long n = sys_read(fd, buf + got, cap - got);
    if (n == -E_INTR) continue;
    if (n <= 0) break;
    got += n;
  }
  sys_close(fd);
  return got;
}
static long read_file(const char* path, char* buf, long cap) { return read_at(AT_FD_CWD, path, buf, cap); }

/* Calls f(fd, name, type, ctx) for every entry of the directory open as `fd` but "." and "..",
 * from its start, until f returns non-zero, which is returned; 0 at the end, -1 when the listing
 * fails. */
typedef int (*entry_fn)(int fd, const char* name, unsigned char type, void* ctx);
static int each_entry(int fd, entry_fn f, void* ctx) {
  char dents[4096] __attribute__((aligned(8)));
  sys_lseek0(fd);
  for (;;) {
    const long n = sys_getdents(fd, dents, (long)sizeof dents);
    if (n <= 0) return n < 0 ? -1 : 0;
    for (long off = 0; off < n;) {
      const unsigned short reclen = *(const unsigned short*)(dents + off + 16);
      const unsigned char type = (unsigned char)dents[off + 18];
      const char* entry = dents + off + 19;
      off += reclen;
      if (str_eq(entry, ".") || str_eq(entry, "..")) continue;
      const int r = f(fd, entry, type, ctx);
      if (r != 0) return r;
    }
  }
}
static void write_file(const char* path, const char* text) {
  if (!path) return;
  const int fd = sys_open(path, O_WRONLY | O_CLOEXEC);
  if (fd < 0) return;
  sys_write(fd, text, (long)str_len(text));
  sys_close(fd);
}

/* ----------------------------------------------------------------------------------------- */
/* The job */

static int configured; /* a "j" line came: without it nothing is touched */
static char mode[8];
static char job_dir[4096];
static long nproc;
static int rank_dirs;
static char memory_dir[4096];
static char fifo[4096]; /* "f": the file timer's FIFO */
static unsigned fifo_major, fifo_minor;
static unsigned long long fifo_ino;
static char token[256];
static long agent_sid = -1;
static char run_dir[4096]; /* "r": remove */
#define MAX_STUCK 1024
static int stuck[MAX_STUCK]; /* "g": given up on */
static long nstuck;
static int is_stuck(long pid) {
  for (long i = 0; i < nstuck; ++i) {
    if (stuck[i] == pid) return 1;
  }
  return 0;
}
static char unused_dir[4096]; /* "e": remove unless it holds data */

/* Alive (not a zombie): a zombie stays listed in its cgroup until its parent reaps it. */
static int alive(long pid) {
  static char st[1024];
  char path[40] = "/proc/";
  char* e = put_num(path + 6, pid);
  const char* tail = "/stat";
  while (*tail != '\0') *e++ = *tail++;
  *e = '\0';
  const long n = read_file(path, st, (long)sizeof st);
  if (n <= 0) return 0;
  long close = -1;
  for (long i = 0; i < n; ++i) {
    if (st[i] == ')') close = i;
  }
  return !(close >= 0 && close + 2 < n && st[close + 2] == 'Z');
}

#define MAX_PIDS 65536
static int pids[MAX_PIDS];
static long npids;
static void add_pid(long pid) {
  if (pid <= 0 || npids >= MAX_PIDS) return;
  for (long i = 0; i < npids; ++i) {
    if (pids[i] == pid) return;
  }
  if (alive(pid)) pids[npids++] = (int)pid;
}

static char procs[1 << 20];
static long add_listed_pids(long n);
/* Adds the living processes listed in the cgroup.procs of the cgroup open as `dirfd` and of every
 * cgroup below it (16 levels); returns how many were listed. A job process
 * may make a cgroup of its own inside its rank's, and a v1 cgroup.procs lists only its own
 * members. Never through a symbolic link. */
struct tree_pids {
  long listed;
  int depth;
};
static int add_subtree_pids(int fd, const char* name, unsigned char type, void* ctx);
static long add_cgroup_tree_pids(int dirfd, int depth) {
  struct tree_pids t = {add_listed_pids(read_at(dirfd, "cgroup.procs", procs, (long)sizeof procs - 1)), depth};
  if (depth < 16) each_entry(dirfd, add_subtree_pids, &t);
  return t.listed;
}
static int add_subtree_pids(int fd, const char* name, unsigned char type, void* ctx) {
  struct tree_pids* t = (struct tree_pids*)ctx;
  if (type != DT_DIRECTORY) return 0;
  const int sub = sys_openat(fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (sub < 0) return 0;
  t->listed += add_cgroup_tree_pids(sub, t->depth + 1);
  sys_close(sub);
  return 0;
}

static long add_listed_pids(long n) {
  if (n <= 0) return 0;
  procs[n] = '\0';
  long listed_here = 0;
  for (const char* s = procs; *s != '\0';) {
    const long pid = parse_num(&s);
    if (pid > 0) {
      ++listed_here;
      add_pid(pid);
    }
    while (*s != '\0' && (*s < '0' || *s > '9')) ++s;
  }
  return listed_here;
}

/* Whether /proc/PID/environ holds the entry `token`, read as a stream of NUL-ended entries. */
static int has_token(const char* pid_name) {
  char path[64] = "/proc/";
  size_t l = 6;
  for (const char* s = pid_name; *s != '\0' && l < 40; ++s) path[l++] = *s;
  const char* tail = "/environ";
  while (*tail != '\0') path[l++] = *tail++;
  path[l] = '\0';
  const int fd = sys_open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  static char buf[16384];
  const long k = (long)str_len(token);
  long at = 0;   /* position in the current entry */
  int match = 1; /* the current entry matches `token` so far */
  int found = 0;
  for (;;) {
    const long n = sys_read(fd, buf, (long)sizeof buf);
    if (n == -E_INTR) continue;
    if (n <= 0) break;
    for (long i = 0; i < n && !found; ++i) {
      if (buf[i] == '\0') {
        found = match && at == k;
        at = 0;
        match = 1;
      } else {
        match = match && at < k && buf[i] == token[at];
        ++at;
      }
    }
    if (found) break;
  }
  sys_close(fd);
  return found || (match && at == k); /* a last entry without its NUL */
}

/* Process groups of token holders outside the agent's session (the agent's sweep, token_scan). */
#define MAX_GROUPS 4096
static int groups[MAX_GROUPS];
static long ngroups;

/* From /proc/PID/stat: the state letter, process group and session; 0 when unreadable. */
static int stat_of(const char* pid_name, char* state, long* pgrp, long* sid) {
  static char st[1024];
  char path[64] = "/proc/";
  size_t l = 6;
  for (const char* s = pid_name; *s != '\0' && l < 40; ++s) path[l++] = *s;
  const char* tail = "/stat";
  while (*tail != '\0') path[l++] = *tail++;
  path[l] = '\0';
  const long n = read_file(path, st, (long)sizeof st - 1);
  if (n <= 0) return 0;
  st[n] = '\0';
  long close = -1;
  for (long i = 0; i < n; ++i) {
    if (st[i] == ')') close = i;
  }
  if (close < 0 || close + 2 >= n) return 0;
  *state = st[close + 2];
  const char* s = st + close + 3;
  long fields[3];
  for (int i = 0; i < 3; ++i) {
    if (*s != ' ') return 0;
    ++s;
    fields[i] = parse_num(&s);
  }
  *pgrp = fields[1];
  *sid = fields[2];
  return 1;
}

/* Processes created on this machine since boot ("processes" in /proc/stat); 0 when unknown. */
static char stat_text[1 << 18];
static unsigned long forks_so_far(void) {
  const long n = read_file("/proc/stat", stat_text, (long)sizeof stat_text);
  static const char key[] = "\nprocesses ";
  const long k = (long)sizeof key - 1;
  for (long i = 0; i + k < n; ++i) {
    long j = 0;
    while (j < k && stat_text[i + j] == key[j]) ++j;
    if (j < k) continue;
    unsigned long v = 0;
    for (long d = i + k; d < n && stat_text[d] >= '0' && stat_text[d] <= '9'; ++d)
      v = v * 10 + (unsigned long)(stat_text[d] - '0');
    return v;
  }
  return 0;
}

/* Processes in uninterruptible sleep that add_token_pids did not read (after a give-up), this
 * scan and the one before: a sweep ends only once each was in that state on two scans in a row
 * (stuck, as the worker given up on), not one passing through it for a page-in. */
#define MAX_SKIPPED 4096
static int skipped_now[MAX_SKIPPED], skipped_before[MAX_SKIPPED];
static long nskipped_now, nskipped_before;
static int skipped_twice(void) {
  int all = 1;
  for (long i = 0; i < nskipped_now && all; ++i) {
    long j = 0;
    while (j < nskipped_before && skipped_before[j] != skipped_now[i]) ++j;
    all = j < nskipped_before;
  }
  for (long i = 0; i < nskipped_now; ++i) skipped_before[i] = skipped_now[i];
  nskipped_before = nskipped_now;
  return all;
}

#define NEW_PIDS_PROBED 1024 /* the agent's kNewPidsProbed */
/* The pid this PID namespace gave last (/proc/loadavg's last field), or a number above every
 * pid when it cannot be read or /proc is another PID namespace's (loadavg speaks of the
 * reader's own): pids up to it were given since the counter last wrapped. */
static long last_pid(long self) {
  char link[32];
  const long k = sys_readlink("/proc/self", link, (long)sizeof link - 1);
  if (k <= 0) return 0x7fffffffL;
  link[k] = '\0';
  const char* l = link;
  if (parse_num(&l) != self || *l != '\0') return 0x7fffffffL;
  char text[128];
  const long n = read_file("/proc/loadavg", text, (long)sizeof text - 1);
  if (n <= 0) return 0x7fffffffL;
  text[n] = '\0';
  long at = n;
  while (at > 0 && (text[at - 1] == '\n' || text[at - 1] == ' ')) --at;
  while (at > 0 && text[at - 1] != ' ') --at;
  const char* s = text + at;
  const long last = parse_num(&s);
  return last > 0 ? last : 0x7fffffffL;
}

/* Whether `pid` is a process (its thread group's leader), from the Tgid line of its status:
 * /proc/TID opens for any thread too, though a listing of /proc shows only processes. */
static int is_process(long pid) {
  char path[40] = "/proc/";
  char* end = put_num(path + 6, pid);
  const char* rest = "/status";
  while (*rest) *end++ = *rest++;
  *end = '\0';
  static char text[1024];
  const long n = read_file(path, text, (long)sizeof text - 1);
  if (n <= 0) return 0;
  text[n] = '\0';
  for (long i = 0; i + 6 < n; ++i) {
    if (text[i] == '\n' && text[i + 1] == 'T' && text[i + 2] == 'g' && text[i + 3] == 'i' && text[i + 4] == 'd' &&
        text[i + 5] == ':') {
      const char* s = text + i + 6;
      while (*s == ' ' || *s == '\t') ++s;
      return parse_num(&s) == pid;
    }
  }
  return 0;
}

static int listed[MAX_PIDS];
/* One pid of add_token_pids: SIGKILLed, with its process group, when it holds the token. */
static void add_if_holder(long self, int pid) {
  char name[24];
  *put_num(name, pid) = '\0';
  char state = '?';
  long pgrp = 0, sid = 0;
  /* Once a worker was given up on, processes in uninterruptible sleep are not read either
   * (its children may be stuck with it), only looked at again. */
  if (nstuck > 0 && stat_of(name, &state, &pgrp, &sid) && state == 'D') {
    if (nskipped_now < MAX_SKIPPED) {
      skipped_now[nskipped_now++] = pid;
    } else {
      nskipped_before = 0; /* more than can be told apart: not "twice" */
    }
    return;
  }
  if (!has_token(name) || !stat_of(name, &state, &pgrp, &sid)) return;
  if (pgrp > 1 && pgrp != self && agent_sid >= 0 && sid != agent_sid) {
    long g = 0;
    while (g < ngroups && groups[g] != pgrp) ++g;
    if (g == ngroups) {
      sys_kill(-(int)pgrp, 9); /* also stops a fork under way */
      if (ngroups < MAX_GROUPS) groups[ngroups++] = (int)pgrp;
    }
  }
  sys_kill(pid, 9);
  if (npids < MAX_PIDS) pids[npids++] = pid;
}

/* SIGKILLs the job token's holders, newest first, with their process groups (not in the
 * agent's session; none when that is unknown), as found; adds them to `pids`. As the agent's
 * token_scan (agent/src/containment.cpp), which says why in that order and why a group may be
 * signalled. /proc lists pids in increasing order; newest first is down from the last pid given,
 * then down from the top (those were given before the counter wrapped). Past MAX_PIDS the
 * highest are kept. */
static void add_token_pids(void) {
  const int fd = sys_open("/proc", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  const long self = sys_getpid();
  long nlisted = 0; /* how many were listed: the last MAX_PIDS of them are kept, in a ring */
  static char dents[32768] __attribute__((aligned(8)));
  for (;;) {
    const long n = sys_getdents(fd, dents, (long)sizeof dents);
    if (n <= 0) break;
    for (long off = 0; off < n;) {
      const unsigned short reclen = *(const unsigned short*)(dents + off + 16);
      const char* name = dents + off + 19;
      off += reclen;
      const char* s = name;
      const long pid = parse_num(&s);
      if (pid <= 0 || *s != '\0' || pid == self || is_stuck(pid)) continue;
      listed[nlisted++ % MAX_PIDS] = (int)pid;
    }
  }
  sys_close(fd);
  ngroups = 0;
  nskipped_now = 0;
  const long last = last_pid(self);
  const long first = nlisted > MAX_PIDS ? nlisted - MAX_PIDS : 0;
  /* The pids given while /proc was listed, past the highest listed up to the last (at most
   * NEW_PIDS_PROBED), first: the listing passed their place before they were given once they
   * wrapped below older pids. Threads' ids among them are not read. */
  if (last != 0x7fffffffL) {
    long top = 0;
    for (long i = first; i < nlisted; ++i) {
      const long pid = listed[i % MAX_PIDS];
      if (pid <= last && pid > top) top = pid;
    }
    for (long pid = last; pid > top && pid > last - NEW_PIDS_PROBED; --pid) {
      if (pid != self && !is_stuck(pid) && is_process(pid)) add_if_holder(self, (int)pid);
    }
  }
  /* Then down the list twice: the pids up to `last`, then those above it. */
  for (long k = 2 * (nlisted - first) - 1; k >= 0; --k) {
    const long i = first + k % (nlisted - first);
    const int pid = listed[i % MAX_PIDS];
    if ((pid <= last) == (k >= nlisted - first)) add_if_holder(self, pid);
  }
}

/* After a give-up ("g"): whether every process in `pids` is one given up on, or was in
 * uninterruptible sleep on this pass and the one before (its children, stuck with it; not one
 * passing through the state for a page-in): waiting cannot end them (the agent's sweep). */
#define MAX_D 4096
static int d_before[MAX_D], d_now[MAX_D];
static long n_before;
static int only_stuck_left(void) {
  if (nstuck == 0 || npids == 0) return 0;
  int all = 1;
  long n_now = 0;
  for (long i = 0; i < npids; ++i) {
    if (is_stuck(pids[i])) continue;
    char name[24];
    *put_num(name, pids[i]) = '\0';
    char state = '?';
    long pgrp = 0, sid = 0;
    if (stat_of(name, &state, &pgrp, &sid) && state == 'D' && n_now < MAX_D) {
      d_now[n_now++] = pids[i];
      long j = 0;
      while (j < n_before && d_before[j] != pids[i]) ++j;
      if (j < n_before) continue;
    }
    all = 0;
  }
  for (long i = 0; i < n_now; ++i) d_before[i] = d_now[i];
  n_before = n_now;
  return all;
}

static void freeze_ranks(const char* state) {
  for (long r = 0; r < (rank_dirs ? nproc : 1); ++r)
    write_file(path_of(job_dir, rank_dirs ? r : -1, "freezer.state"), state);
}

/* Writes THAWED to freezer.state in the cgroup open as `dirfd` and in every cgroup below it (16
 * levels): a job process may freeze a cgroup it made inside its rank's, and a cgroup frozen on
 * its own stays frozen when its parent thaws, its SIGKILLed processes with it (the agent's
 * thaw_subtree). Never through a symbolic link. */
static int thaw_entry(int fd, const char* name, unsigned char type, void* ctx);
static void thaw_tree(int dirfd, int depth) {
  const int f = sys_openat(dirfd, "freezer.state", O_WRONLY | O_CLOEXEC);
  if (f >= 0) {
    sys_write(f, "THAWED", 6);
    sys_close(f);
  }
  if (depth < 16) each_entry(dirfd, thaw_entry, &depth);
}
static int thaw_entry(int fd, const char* name, unsigned char type, void* ctx) {
  if (type != DT_DIRECTORY) return 0;
  const int sub = sys_openat(fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (sub < 0) return 0;
  thaw_tree(sub, *(const int*)ctx + 1);
  sys_close(sub);
  return 0;
}

#define PROC_EMPTY_SCANS 3
/* SIGKILLs every process of the job still alive, for up to 3 s (the agent's Containment::sweep). */
static void sweep(void) {
  const int v2 = str_eq(mode, "cgroup2"), v1 = str_eq(mode, "cgroup1");
  const long deadline = now_ms() + 3000;
  const long ranks = rank_dirs ? nproc : 1;
  int empty_scans = 0;
  for (;;) {
    if (v2) {
      /* One read answers for the whole job: "populated 0" once no process is left in any rank's
       * cgroup (an exited process leaves the count at its exit, zombie or not). */
      static char events[512];
      const long n = read_file(path_of(job_dir, -1, "cgroup.events"), events, (long)sizeof events);
      if (n < 0 || has(events, n, "populated 0")) return;
      write_file(path_of(job_dir, -1, "cgroup.kill"), "1"); /* the job cgroup and every one below */
      if (nstuck > 0) { /* only then are the members listed: "populated" answers otherwise */
        const int job_fd = sys_open(job_dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (job_fd < 0) return;
        npids = 0;
        add_cgroup_tree_pids(job_fd, 0);
        sys_close(job_fd);
        if (only_stuck_left()) return;
      }
    } else if (v1) {
      /* As the agent's sweep: an empty member list is final; otherwise it is read again frozen
       * (a process that forks and exits may show only pids that are gone). */
      /* The whole subtree: the rank cgroups and any cgroup a job process made below them. */
      const int job_fd = sys_open(job_dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
      if (job_fd < 0) return;
      npids = 0;
      const long listed_pids = add_cgroup_tree_pids(job_fd, 0);
      if (listed_pids == 0 || only_stuck_left()) {
        sys_close(job_fd);
        return;
      }
      freeze_ranks("FROZEN");
      for (long r = 0; r < ranks && now_ms() <= deadline;) { /* FREEZING until every task stopped */
        static char state[64];
        const long n = read_file(path_of(job_dir, rank_dirs ? r : -1, "freezer.state"), state, (long)sizeof state);
        if (n < 6 || has(state, 6, "FROZEN")) {
          ++r;
        } else {
          sleep_ms(1);
        }
      }
      npids = 0;
      add_cgroup_tree_pids(job_fd, 0);
      for (long i = 0; i < npids; ++i) sys_kill(pids[i], 9); /* takes effect on thaw */
      thaw_tree(job_fd, 0);                                  /* the ranks, and what a job process froze itself */
      sys_close(job_fd);
      if (npids == 0) return;
    } else {
      if (token[0] == '\0') return;
      npids = 0;
      const unsigned long forks_before = forks_so_far();
      add_token_pids(); /* SIGKILLs as it finds */
      const int settled = skipped_twice();
      if (npids == 0) {
        /* A token scan can miss a process that forks and exits without pause; one during which
         * the machine created no process has missed nothing (the agent's sweep). A process
         * skipped in uninterruptible sleep is looked at again until it was so on two scans. */
        if (now_ms() > deadline ||
            (settled && ((forks_before != 0 && forks_so_far() == forks_before) || ++empty_scans >= PROC_EMPTY_SCANS))) {
          return;
        }
        sleep_ms(2);
        continue;
      }
      empty_scans = 0;
    }
    if (now_ms() > deadline) return;
    sleep_ms(2); /* the kernel delivers SIGKILL asynchronously */
  }
}

/* Removes the cgroup `name` below `dirfd` and every cgroup below it, deepest first: the rank
 * cgroups, and any a job process made (its rmdir says EBUSY while a cgroup has children or
 * members leaving). Only on EBUSY are they looked for: an rmdir that works costs nothing more.
 * Never through a symbolic link, 16 levels at most; each rmdir retried for up to 2 s. */
struct cgroup_pass {
  int depth;
  int seen;
};
static int remove_child_cgroup(int fd, const char* name, unsigned char type, void* ctx);
static void remove_cgroup_tree(int dirfd, const char* name, int depth) {
  if (sys_unlinkat(dirfd, name, AT_REMOVE_DIR) != -E_BUSY || depth >= 16) return;
  const int fd = sys_openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd >= 0) {
    /* Read again until a pass finds no cgroup below: entries removed while read may hide others. */
    struct cgroup_pass p = {depth, 1};
    for (int pass = 0; p.seen && pass < 8; ++pass) {
      p.seen = 0;
      each_entry(fd, remove_child_cgroup, &p);
    }
    sys_close(fd);
  }
  for (int attempt = 0; attempt < 200; ++attempt) {
    if (sys_unlinkat(dirfd, name, AT_REMOVE_DIR) != -E_BUSY) return;
    sleep_ms(10);
  }
}
static int remove_child_cgroup(int fd, const char* name, unsigned char type, void* ctx) {
  struct cgroup_pass* p = (struct cgroup_pass*)ctx;
  if (type != DT_DIRECTORY) return 0;
  p->seen = 1;
  remove_cgroup_tree(fd, name, p->depth + 1);
  return 0;
}
static void remove_cgroups(const char* job) {
  if (job[0] == '\0') return;
  remove_cgroup_tree(AT_FD_CWD, job, 0);
}

/* Removes `name` below `dirfd` with what is in it: never through a symbolic link (O_NOFOLLOW,
 * every step relative to its directory's fd), never into another file system (a mount point
 * below it stays, as does the directory above it), at most 64 levels deep. Each directory is
 * read again until a pass finds nothing left, as some file systems skip entries of a directory
 * that changes while it is read. */
struct tree_walk {
  const struct file_id* top;
  int depth;
  int seen;
};
static int remove_entry(int fd, const char* name, unsigned char type, void* ctx);
static void remove_tree(int dirfd, const char* name, const struct file_id* top, int depth) {
  if (sys_unlinkat(dirfd, name, AT_REMOVE_DIR) != -E_NOTEMPTY || depth >= 64) return;
  const int fd = sys_openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return;
  struct file_id here;
  if (file_of(fd, "", &here) != 0 || here.dev_major != top->dev_major || here.dev_minor != top->dev_minor) {
    sys_close(fd);
    return;
  }
  struct tree_walk w = {top, depth, 1};
  for (int pass = 0; w.seen && pass < 8; ++pass) {
    w.seen = 0;
    each_entry(fd, remove_entry, &w);
  }
  sys_close(fd);
  sys_unlinkat(dirfd, name, AT_REMOVE_DIR);
}
static int remove_entry(int fd, const char* name, unsigned char type, void* ctx) {
  struct tree_walk* w = (struct tree_walk*)ctx;
  w->seen = 1;
  if (type == DT_DIRECTORY || sys_unlinkat(fd, name, 0) == -E_ISDIR) remove_tree(fd, name, w->top, w->depth + 1);
  return 0;
}

/* Whether the tree `name` below `dirfd` holds a regular file with data (at its top, ddprun's
 * Python hook ".ddprun-python" aside): the agent's rule for keeping a run directory
 * (remove_job_dir_unless_useful). What cannot be read, another file system, more than 64
 * levels: kept. */
static int entry_holds_data(int fd, const char* name, unsigned char type, void* ctx);
static int holds_data(int dirfd, const char* name, const struct file_id* top, int depth) {
  if (depth >= 64) return 1;
  const int fd = sys_openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return fd != -E_NOENT;
  struct file_id here;
  int found = file_of(fd, "", &here) != 0 || here.dev_major != top->dev_major || here.dev_minor != top->dev_minor;
  struct tree_walk w = {top, depth, 0};
  if (!found) found = each_entry(fd, entry_holds_data, &w) != 0; /* a listing that fails counts as data */
  sys_close(fd);
  return found;
}
static int entry_holds_data(int fd, const char* name, unsigned char type, void* ctx) {
  (void)type;
  const struct tree_walk* w = (const struct tree_walk*)ctx;
  if (w->depth == 0 && str_eq(name, ".ddprun-python")) return 0;
  struct file_id f;
  if (file_of(fd, name, &f) != 0) return 1;
  if (f.type == 0100000u /* S_IFREG */) return f.size > 0;
  if (f.type == 0040000u) return holds_data(fd, name, w->top, w->depth + 1);
  return f.type == 0120000u; /* a symbolic link: the agent's check follows it to what may be data; kept */
}
/* The run directory `dir` (a real directory, not a link to one), with what is in it; when
 * `if_unused`, only where it holds no data (holds_data). */
static void remove_run_dir(const char* dir, int if_unused) {
  struct file_id top;
  if (dir[0] == '\0' || file_of(AT_FD_CWD, dir, &top) != 0 || top.type != 0040000u) return;
  if (!if_unused || !holds_data(AT_FD_CWD, dir, &top, 0)) remove_tree(AT_FD_CWD, dir, &top, 0);
}

/* ----------------------------------------------------------------------------------------- */

/* Copies `src` into `dst` (of `cap` bytes) when it fits; else leaves `dst` as it was. */
static void keep_text(char* dst, size_t cap, const char* src) {
  const size_t n = str_len(src);
  if (n < cap) memcpy(dst, src, n + 1);
}

/* "j MODE NPROC RANK_DIRS": the first one counts. */
static void configure(const char* s) {
  if (configured) return;
  char m[sizeof mode];
  size_t n = 0;
  while (s[n] != ' ' && s[n] != '\0' && n + 1 < sizeof m) {
    m[n] = s[n];
    ++n;
  }
  m[n] = '\0';
  if (s[n] != ' ' || !(str_eq(m, "cgroup2") || str_eq(m, "cgroup1") || str_eq(m, "proc"))) return;
  s += n + 1;
  const long np = parse_num(&s);
  if (np < 0 || *s != ' ' || (s[1] != '0' && s[1] != '1') || s[2] != '\0') return;
  memcpy(mode, m, n + 1);
  nproc = np;
  rank_dirs = s[1] == '1';
  configured = 1;
}

/* "f MAJOR MINOR INODE PATH" (inodes use all 64 bits on XFS, overlayfs, large ext4) */
static void remember_fifo(const char* s) {
  int ok = 1;
  const unsigned long long major = parse_u64(&s, &ok);
  if (!ok || major > 0xffffffffULL || *s++ != ' ') return;
  const unsigned long long minor = parse_u64(&s, &ok);
  if (!ok || minor > 0xffffffffULL || *s++ != ' ') return;
  const unsigned long long ino = parse_u64(&s, &ok);
  if (!ok || ino == 0 || *s++ != ' ' || *s != '/') return;
  keep_text(fifo, sizeof fifo, s);
  fifo_major = (unsigned)major;
  fifo_minor = (unsigned)minor;
  fifo_ino = ino;
}

static void handle_line(const char* line, int* swept) {
  if (line[0] == '\0' || (line[1] != ' ' && line[1] != '\0')) return;
  const char* arg = line[1] == ' ' ? line + 2 : line + 1;
  switch (line[0]) {
    case 'j':
      configure(arg);
      return;
    case 'c':
    case 'M':
      /* The agent sends them right after "j". */
      if (configured && arg[0] == '/') keep_text(line[0] == 'c' ? job_dir : memory_dir, sizeof job_dir, arg);
      return;
    case 'd':
      if (line[1] == '\0') *swept = 1;
      return;
    case 'f':
      remember_fifo(arg);
      return;
    default:
      break;
  }
  if (line[0] == 'm' && line[1] == ' ' && memory_dir[0] != '\0') {
    const char* s = line + 2;
    const long rank = parse_num(&s);
    if (*s != ' ') return;
    ++s;
    const long pid = parse_num(&s);
    if (rank < 0 || rank >= nproc || pid <= 0 || *s != '\0') return;
    char text[24];
    *put_num(text, pid) = '\0';
    write_file(path_of(memory_dir, rank, "cgroup.procs"), text);
  } else if (line[0] == 't' && line[1] == ' ') {
    /* "t SID ENTRY"; SID may be 0 (a session led from outside this PID namespace). Without a
     * readable SID the token is kept and no process group is signalled. */
    const char* s = line + 2;
    const long sid = parse_num(&s);
    const char* entry = sid >= 0 && *s == ' ' ? s + 1 : line + 2;
    const size_t n = str_len(entry);
    if (n < sizeof token) {
      memcpy(token, entry, n + 1);
      agent_sid = entry == line + 2 ? -1 : sid;
    }
  } else if (line[0] == 'g' && line[1] == ' ') {
    const char* s = line + 2;
    const long pid = parse_num(&s);
    if (pid > 0 && *s == '\0' && nstuck < MAX_STUCK && !is_stuck(pid)) stuck[nstuck++] = (int)pid;
  } else if ((line[0] == 'r' || line[0] == 'e') && line[1] == ' ' && line[2] == '/') {
    keep_text(line[0] == 'r' ? run_dir : unused_dir, sizeof run_dir, line + 2);
  }
}

/* The file timer's FIFO, if PATH still names the one the agent made and nobody reads it: a
 * device and inode can be reused by a FIFO made there since (a new job with the same
 * TORCHELASTIC_TIMER_FILE), whose agent reads it; the agent's own rule for a stale FIFO. */
static void remove_fifo(void) {
  struct file_id f;
  if (fifo[0] == '\0' || file_of(AT_FD_CWD, fifo, &f) != 0) return;
  if (f.type != 0010000u /* S_IFIFO */ || f.dev_major != fifo_major || f.dev_minor != fifo_minor || f.ino != fifo_ino)
    return;
  const int fd = sys_open(fifo, O_WRONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
  if (fd >= 0) { /* a reader: another agent's */
    sys_close(fd);
    return;
  }
  if (fd == -E_NXIO) sys_unlinkat(AT_FD_CWD, fifo, 0);
}

static const char usage[] =
    "ddprun-watchdog: started by ddprun's agent with a socket on fd 3; not a command to run by hand\n";

__attribute__((used)) void watchdog_main(long* sp) {
  /* Not "ddprun-watchdog" (the file's name, which the exec gave it): see the top. */
  SYS(__NR_prctl, 15 /* PR_SET_NAME */, "ddp-watchdog", 0);
  const int agent = sys_getppid(); /* the agent started it */
  const long argc = sp[0];
  char** argv = (char**)(sp + 1);
  if (argc != 2 || !str_eq(argv[1], "5")) { /* the protocol's version: the agent's kWatchdogProtocol */
    sys_write(2, usage, (long)sizeof usage - 1);
    sys_exit(2);
  }

  /* Started with every signal blocked (the agent's spawn): ignore the terminal's, so a Ctrl-C to
   * the process group does not end it before it has cleaned up, then unblock. */
  struct {
    unsigned long handler, flags, restorer, mask;
  } ign = {1 /* SIG_IGN */, 0, 0, 0};
  static const int ignored[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGPIPE, SIGTSTP, SIGTTIN, SIGTTOU};
  for (size_t i = 0; i < sizeof ignored / sizeof ignored[0]; ++i) SYS4(__NR_rt_sigaction, ignored[i], &ign, 0, 8);
  const unsigned long none = 0;
  SYS4(__NR_rt_sigprocmask, 2 /* SIG_SETMASK */, &none, 0, 8);

  /* Without the agent's socket on fd 3 it is not the watchdog of anything: refuse before
   * touching a thing (a by-hand run with some other fd 3 would read EOF and sweep). */
  struct file_id fd3;
  if (file_of(3, "", &fd3) != 0 || fd3.type != 0140000u /* S_IFSOCK */) {
    sys_write(2, usage, (long)sizeof usage - 1);
    sys_exit(2);
  }
  /* The agent's pidfd, passed as fd 4 (protocol 5): signal 0 through it works, or says the
   * agent is gone already (ESRCH); anything else on fd 4 (nothing, a socket) says EBADF or
   * EINVAL. Else one opened here, while the agent is still the parent. */
  const long probe = SYS4(__NR_pidfd_send_signal, 4, 0, 0, 0);
  const int agent_end = probe == 0 || probe == -E_SRCH ? 4 : open_agent_end(agent);
  /* Ready: named, in its own session (since before the exec), the terminal's signals ignored.
   * The agent waits for this byte before its first worker, so no worker runs while a `pkill
   * ddprun` could still match this process or a Ctrl-C could end it. */
  sys_write(3, "+", 1);

  char buf[256];
  char line[4352];
  size_t len = 0;
  int swept = 0;
  int overlong = 0;
  for (;;) {
    const long n = sys_read(3, buf, (long)sizeof buf);
    if (n == -E_INTR) continue;
    if (n <= 0) break; /* EOF: the agent is gone */
    for (long i = 0; i < n; ++i) {
      if (buf[i] != '\n') {
        if (len + 1 < sizeof line) {
          line[len++] = buf[i];
        } else {
          overlong = 1;
        }
        continue;
      }
      line[len] = '\0';
      if (!overlong) handle_line(line, &swept);
      len = 0;
      overlong = 0;
    }
  }
  if (!configured) sys_exit(0); /* not told of a job: nothing of it to touch */
  /* The FIFO first, before a new job can take its path: after "d" the agent removed it itself.
   * EOF comes as the dying agent's descriptors are closed, its FIFO reader maybe not yet: wait
   * for its last thread's end (bounded). Its children (this one) are re-parented when its main
   * thread ends, which may be before another thread of it has closed the shared descriptors:
   * only the fallback before Linux 5.3. */
  if (!swept && fifo[0] != '\0') {
    if (agent_end >= 0) {
      wait_readable(agent_end, 1000);
    } else {
      const long since = now_ms();
      while (sys_getppid() == agent && now_ms() - since < 1000) sleep_ms(1);
    }
    remove_fifo();
  }
  if (agent_end >= 0) sys_close(agent_end);
  if (!swept) sweep();
  /* The run directory first: a cgroup's rmdir waits for the kernel's grace periods, and a
   * service manager may kill what is left of the job soon after the agent's exit. */
  if (run_dir[0] != '\0') {
    remove_run_dir(run_dir, 0);
  } else {
    remove_run_dir(unused_dir, 1); /* the agent ended without settling it: killed, most likely */
  }
  if (job_dir[0] != '\0') remove_cgroups(job_dir);
  if (memory_dir[0] != '\0' && !str_eq(memory_dir, job_dir)) remove_cgroups(memory_dir);
  sys_exit(0);
}

#if defined(__x86_64__)
__asm__(
    ".text\n"
    ".global _start\n"
    "_start:\n"
    "  xor %rbp, %rbp\n"
    "  mov %rsp, %rdi\n"
    "  and $-16, %rsp\n"
    "  call watchdog_main\n"
    "  hlt\n");
#else
__asm__(
    ".text\n"
    ".global _start\n"
    "_start:\n"
    "  mov x29, #0\n"
    "  mov x30, #0\n"
    "  mov x0, sp\n"
    "  bl watchdog_main\n"
    "  brk #0\n");
#endif
