// ddprun-nccl-id: holds NCCL bootstrap roots for one round (docs/gpus.md).
//
//   ddprun-nccl-id [--roots K]
//
// Calls ncclGetUniqueId K times (default 1; K > 1 for ncclCommInitRankScalable), prints each
// ID as 256 lowercase hex chars on its own line, flushes, then keeps the process (and NCCL's
// bootstrap root threads) alive until stdin reaches EOF or SIGTERM/SIGINT/SIGHUP arrives, and
// exits 0. Only the IDs go to stdout: whatever NCCL itself prints there (NCCL_DEBUG=INFO
// writes to stdout) goes to stderr. It never outlives its parent (PR_SET_PDEATHSIG). Exit
// codes: 0 done, 2 usage,
// 3 NCCL unavailable (one line on stderr: "ddprun-nccl-id: NCCL unavailable: <reason>"),
// 1 other errors.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include "ddprun/common/strings.hpp"
#include "ddprun/worker_env/nccl_id.hpp"

int main(int argc, char** argv) {
  using namespace ddprun::worker_env;
  const pid_t parent = getppid();
  // Die with the parent (the agent): a leaked root would hold a port and a magic forever.
  if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent) return 1;

  int roots = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if ((a == "--roots" || a == "-k") && i + 1 < argc) {
      const auto v = ddprun::parse_int(argv[++i]);
      if (!v || *v < 1 || *v > 4096) {
        std::fprintf(stderr, "ddprun-nccl-id: --roots=%s must be an integer in [1, 4096]\n", argv[i]);
        return 2;
      }
      roots = static_cast<int>(*v);
    } else if (a.rfind("--roots=", 0) == 0) {
      const auto v = ddprun::parse_int(a.substr(8));
      if (!v || *v < 1 || *v > 4096) {
        std::fprintf(stderr, "ddprun-nccl-id: %s must be an integer in [1, 4096]\n", a.c_str());
        return 2;
      }
      roots = static_cast<int>(*v);
    } else if (a == "-h" || a == "--help") {
      std::printf(
          "usage: ddprun-nccl-id [--roots K]\n"
          "Prints K ncclUniqueIds (256 hex chars each, one per line) and keeps their bootstrap\n"
          "roots alive until stdin closes or SIGTERM. Exit 3 when NCCL is unavailable.\n");
      return 0;
    } else {
      std::fprintf(stderr, "ddprun-nccl-id: unknown argument '%s' (usage: ddprun-nccl-id [--roots K])\n", a.c_str());
      return 2;
    }
  }

  // Block the stop signals before NCCL starts its threads (they inherit the mask), so the
  // signals arrive through the signalfd below and nowhere else.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);
  const int sfd = signalfd(-1, &stop_signals, SFD_CLOEXEC);

  // The IDs get stdout to themselves: NCCL (NCCL_DEBUG=INFO, without NCCL_DEBUG_FILE) and any
  // other library print to fd 1, which from here on is stderr.
  const int ids_fd = fcntl(STDOUT_FILENO, F_DUPFD_CLOEXEC, 3);
  if (ids_fd < 0 || dup2(STDERR_FILENO, STDOUT_FILENO) != STDOUT_FILENO) {
    std::fprintf(stderr, "ddprun-nccl-id: cannot set up stdout: %s\n", std::strerror(errno));
    return 1;
  }
  // NCCL writes its lines with vfprintf and does not flush: line by line, they reach the agent
  // while it waits for the IDs instead of dying in a buffer at _exit.
  setvbuf(stdout, nullptr, _IOLBF, 0);

  std::string text;
  try {
    for (const auto& id : generate_nccl_unique_ids(roots, current_environment())) {
      text += encode_nccl_id(id);
      text += '\n';
    }
  } catch (const NcclUnavailable& e) {
    std::fprintf(stderr, "ddprun-nccl-id: NCCL unavailable: %s\n", e.what());
    return 3;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddprun-nccl-id: %s\n", e.what());
    return 1;
  }
  for (std::size_t done = 0; done < text.size();) {
    const ssize_t n = write(ids_fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) _exit(1);
    done += static_cast<std::size_t>(n);
  }
  // ids_fd stays open: EOF on the holder's stdout means it is gone.

  // Hold until stdin EOF (the agent closed our pipe: the round is over) or a stop signal.
  for (;;) {
    pollfd fds[2] = {{0, POLLIN, 0}, {sfd, POLLIN, 0}};
    const int n = poll(fds, sfd >= 0 ? 2 : 1, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (fds[1].revents != 0) break;
    if (fds[0].revents != 0) {
      char buf[256];
      const ssize_t got = read(0, buf, sizeof buf);
      if (got == 0 || (got < 0 && errno != EINTR && errno != EAGAIN)) break;
    }
  }
  // _exit: NCCL's root threads are blocked in accept(); static destructors would race them.
  _exit(0);
}
