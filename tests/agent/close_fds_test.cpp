// close_descriptors_from: what a worker's or the watchdog's child closes before its exec, also
// where close_range is refused (a seccomp filter, as older container runtimes had; a kernel
// before 5.9): then from /proc/self/fd, with no upper bound on the descriptor numbers.
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cerrno>
#include <cstddef>
#include <vector>

#include "ddprun/agent/process.hpp"

namespace {

// Makes close_range fail with EPERM in this process (and its children).
bool refuse_close_range() {
#ifdef SYS_close_range
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_close_range, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog prog{static_cast<unsigned short>(sizeof filter / sizeof filter[0]), filter};
  return ::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 && ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) == 0;
#else
  return false;
#endif
}

// In a forked child: opens descriptors (one above 65,536 where the limit allows), runs
// close_descriptors_from(3, at_exec) and exits 0 when every one from 3 on is closed (or marked
// close-on-exec), 1 when one is left, 2 when close_range could not be refused.
int run_in_child(bool refused, bool at_exec) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (refused && (!refuse_close_range() || ::syscall(SYS_close_range, 3U, ~0U, 0U) == 0)) ::_exit(2);
    std::vector<int> fds;
    for (int i = 0; i < 5; ++i) fds.push_back(::open("/dev/null", O_RDONLY));
    // Above 65,536 (the old fallback's bound), where the limit can be raised that far
    // (CAP_SYS_RESOURCE; not in every container, this development box's included).
    rlimit lim{70001, 70001};
    const bool high = ::setrlimit(RLIMIT_NOFILE, &lim) == 0 && ::dup2(fds[0], 70000) == 70000;
    if (high) fds.push_back(70000);
    ddprun::agent::close_descriptors_from(3, at_exec);
    for (int fd : fds) {
      // Closed, or (at_exec) marked to be closed by the exec.
      const int flags = ::fcntl(fd, F_GETFD);
      if (flags >= 0 && !(at_exec && (flags & FD_CLOEXEC) != 0)) ::_exit(1);
    }
    ::_exit(0);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 3;
}

}  // namespace

TEST_CASE("close_descriptors_from closes everything from the low mark on") {
  for (bool refused : {false, true}) {
    for (bool at_exec : {false, true}) {
      INFO("close_range refused: " << refused << ", at exec: " << at_exec);
      CHECK(run_in_child(refused, at_exec) == 0);
    }
  }
}
