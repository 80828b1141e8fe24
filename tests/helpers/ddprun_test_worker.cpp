// ddprun_test_worker: a controllable worker for agent and end-to-end tests.
//
// Steps, in this order (each only when asked):
//   --dump-env FILE       write the whole environment as a JSON object to FILE
//   --store-check         connect to MASTER_ADDR:MASTER_PORT (StoreClient) and ADD a key;
//                         prints "store-check ok <value>" (exit 3 on failure)
//   --print-lines N       N lines to stdout and N to stderr ("rank R line i stdout|stderr")
//   --long-line N         one stdout line of N 'x' characters
//   --partial TEXT        TEXT to stdout without a trailing newline
//   --write-error-file MSG  torch @record-format JSON to $TORCHELASTIC_ERROR_FILE
//   --error-file-raw TEXT   TEXT as is to $TORCHELASTIC_ERROR_FILE (for unparsable-file tests)
//   --vfork-sleep-ms N    (gated) vfork a child that sleeps N ms: this process waits in
//                         uninterruptible sleep (state D) meanwhile
//   --ready-file PATH     write "<pid>\n" to PATH atomically (tmp + rename): everything above is done;
//                         "-" prints "ready <rank> <pid>" on stdout instead
//   --wait-file PATH      wait (inotify, at most 30 s) until PATH exists
//   --ignore-sigterm      SIGTERM ignored (set first of all) (for grace/SIGKILL tests)
//   --sleep-ms N          sleep N ms (restarted after signals)
//   --signal-self SIG     raise SIG (number) at the end
//   --exit N              exit code (default 0)
// Gates: --only-rank R applies --exit/--signal-self/--write-error-file/--vfork-sleep-ms only when
// RANK == R;
// --fail-on-attempt A applies them only when TORCHELASTIC_RESTART_COUNT == A;
// --gated-no-sleep: ranks selected by the gates skip --sleep-ms (fail fast while others sleep).
// In paths, "%r" is replaced by LOCAL_RANK and "%a" by TORCHELASTIC_RESTART_COUNT.
#include <fcntl.h>
#include <poll.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <iostream>
#include <string>

#ifdef DDPRUN_TEST_WORKER_STORE
#include "ddprun/rendezvous/store_client.hpp"
#endif

extern char** environ;  // NOLINT: POSIX

namespace {

std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::string(v) : std::string(fallback);
}

std::string expand(std::string path) {
  const std::string local_rank = env_or("LOCAL_RANK", "0");
  const std::string attempt = env_or("TORCHELASTIC_RESTART_COUNT", "0");
  for (;;) {
    auto p = path.find("%r");
    if (p == std::string::npos) {
      break;
    }
    path.replace(p, 2, local_rank);
  }
  for (;;) {
    auto p = path.find("%a");
    if (p == std::string::npos) {
      break;
    }
    path.replace(p, 2, attempt);
  }
  return path;
}

std::string json_escape(const std::string& s) {
  std::string out;
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out;
}

bool write_file(const std::string& path, const std::string& content) {
  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) {
    std::fprintf(stderr, "test worker: cannot write %s: %s\n", tmp.c_str(), std::strerror(errno));
    return false;
  }
  std::fwrite(content.data(), 1, content.size(), f);
  std::fclose(f);
  return std::rename(tmp.c_str(), path.c_str()) == 0;
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// Waits for `path` to appear without a sleep loop: inotify on its directory.
bool wait_for_file(const std::string& path, int timeout_ms) {
  const auto slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? std::string(".") : path.substr(0, slash);
  const int fd = ::inotify_init1(IN_CLOEXEC);
  if (fd < 0) {
    return false;
  }
  ::inotify_add_watch(fd, dir.c_str(), IN_CREATE | IN_MOVED_TO);
  const auto deadline = std::time(nullptr) + timeout_ms / 1000 + 1;
  bool found = exists(path);
  while (!found && std::time(nullptr) < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 1000) > 0) {
      char buf[4096];
      (void)!::read(fd, buf, sizeof(buf));
    }
    found = exists(path);
  }
  ::close(fd);
  return found;
}

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "ddprun_test_worker: %s\n", why.c_str());
  std::exit(64);
}

}  // namespace

int main(int argc, char** argv) {
  int exit_code = 0;
  long sleep_ms = 0;
  bool ignore_sigterm = false;
  std::string dump_env;
  std::string ready_file;
  std::string error_msg;
  std::string partial;
  int fail_on_attempt = -1;
  int only_rank = -1;
  int print_lines = 0;
  long long_line = 0;
  int signal_self = 0;
  bool store_check = false;
  bool gated_no_sleep = false;
  long vfork_sleep_ms = 0;
  std::string wait_file;
  std::string error_raw;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        usage(a + " needs a value");
      }
      return argv[++i];
    };
    if (a == "--exit") {
      exit_code = std::atoi(next().c_str());
    } else if (a == "--sleep-ms") {
      sleep_ms = std::atol(next().c_str());
    } else if (a == "--ignore-sigterm") {
      ignore_sigterm = true;
    } else if (a == "--dump-env") {
      dump_env = next();
    } else if (a == "--ready-file") {
      ready_file = next();
    } else if (a == "--write-error-file") {
      error_msg = next();
    } else if (a == "--fail-on-attempt") {
      fail_on_attempt = std::atoi(next().c_str());
    } else if (a == "--only-rank") {
      only_rank = std::atoi(next().c_str());
    } else if (a == "--print-lines") {
      print_lines = std::atoi(next().c_str());
    } else if (a == "--long-line") {
      long_line = std::atol(next().c_str());
    } else if (a == "--partial") {
      partial = next();
    } else if (a == "--signal-self") {
      signal_self = std::atoi(next().c_str());
    } else if (a == "--wait-file") {
      wait_file = next();
    } else if (a == "--gated-no-sleep") {
      gated_no_sleep = true;
    } else if (a == "--error-file-raw") {
      error_raw = next();
    } else if (a == "--vfork-sleep-ms") {
      vfork_sleep_ms = std::atol(next().c_str());
    } else if (a == "--store-check") {
      store_check = true;
    } else if (a.rfind("--local-rank=", 0) == 0 || a.rfind("--local_rank=", 0) == 0) {
      std::printf("got %s\n", a.c_str());
    } else {
      usage("unknown argument " + a);
    }
  }
  const int rank = std::atoi(env_or("RANK", "0").c_str());
  const int attempt = std::atoi(env_or("TORCHELASTIC_RESTART_COUNT", "0").c_str());
  const bool gated = (only_rank < 0 || only_rank == rank) && (fail_on_attempt < 0 || fail_on_attempt == attempt);

  if (ignore_sigterm) {
    std::signal(SIGTERM, SIG_IGN);
  }
  if (!dump_env.empty()) {
    std::string json = "{";
    bool first = true;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string entry(*e);
      const auto eq = entry.find('=');
      if (eq == std::string::npos) {
        continue;
      }
      json += first ? "\n" : ",\n";
      first = false;
      json += " \"" + json_escape(entry.substr(0, eq)) + "\": \"" + json_escape(entry.substr(eq + 1)) + "\"";
    }
    json += "\n}\n";
    if (!write_file(expand(dump_env), json)) {
      return 65;
    }
  }
  if (store_check) {
#ifdef DDPRUN_TEST_WORKER_STORE
    try {
      ddprun::rendezvous::StoreClientOptions o;
      o.host = env_or("MASTER_ADDR", "127.0.0.1");
      o.port = static_cast<std::uint16_t>(std::atoi(env_or("MASTER_PORT", "0").c_str()));
      o.connect_timeout = std::chrono::seconds(10);
      o.timeout = std::chrono::seconds(10);
      ddprun::rendezvous::StoreClient client(o);
      const auto v = client.add("ddprun_test/store_check", 1);
      std::printf("store-check ok %lld\n", static_cast<long long>(v));
      std::fflush(stdout);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "store-check failed: %s\n", e.what());
      return 3;
    }
#else
    std::fprintf(stderr, "store-check: built without the store client\n");
    return 3;
#endif
  }
  for (int i = 0; i < print_lines; ++i) {
    std::printf("rank %d line %d stdout\n", rank, i);
    std::fprintf(stderr, "rank %d line %d stderr\n", rank, i);
  }
  if (long_line > 0) {
    std::string line(static_cast<std::size_t>(long_line), 'x');
    line += '\n';
    std::fwrite(line.data(), 1, line.size(), stdout);
  }
  if (!partial.empty()) {
    std::fwrite(partial.data(), 1, partial.size(), stdout);
  }
  std::fflush(stdout);
  std::fflush(stderr);
  if (!error_msg.empty() && gated) {
    const char* path = std::getenv("TORCHELASTIC_ERROR_FILE");
    if (path != nullptr) {
      const std::string json = "{\"message\": {\"message\": \"" + json_escape(error_msg) +
                               "\", \"extraInfo\": {\"py_callstack\": \"Traceback (most recent call last):\\n  "
                               "File \\\"worker.py\\\", line 1, in <module>\\n" +
                               json_escape(error_msg) + "\\n\", \"timestamp\": \"" +
                               std::to_string(std::time(nullptr)) + "\"}}}";
      write_file(path, json);
    }
  }
  if (!error_raw.empty() && gated) {
    if (const char* path = std::getenv("TORCHELASTIC_ERROR_FILE")) {
      write_file(path, error_raw);
    }
  }
  if (vfork_sleep_ms > 0 && gated) {
    // This process waits in the kernel (uninterruptible sleep, state D: vfork's wait for the
    // child's exec or exit) while the child sleeps: a stand-in for a rank stuck in a driver.
    const pid_t child = vfork();
    if (child == 0) {
      struct timespec ts = {vfork_sleep_ms / 1000, (vfork_sleep_ms % 1000) * 1000000L};
      syscall(SYS_nanosleep, &ts, nullptr);
      _exit(0);
    }
  }
  // The ready file comes last among the side effects, so a test that saw it also sees the rest.
  if (ready_file == "-") {
    std::printf("ready %d %d\n", rank, static_cast<int>(::getpid()));  // a line for readers of stdout
    std::fflush(stdout);
  } else if (!ready_file.empty()) {
    write_file(expand(ready_file), std::to_string(::getpid()) + "\n");
  }
  if (!wait_file.empty() && !wait_for_file(expand(wait_file), 30000)) {
    std::fprintf(stderr, "test worker: %s did not appear\n", wait_file.c_str());
    return 66;
  }
  if (sleep_ms > 0 && !(gated_no_sleep && gated)) {
    timespec ts{sleep_ms / 1000, (sleep_ms % 1000) * 1000000L};
    while (::nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
  }
  if (gated && signal_self != 0) {
    std::signal(signal_self, SIG_DFL);
    std::raise(signal_self);
  }
  return gated ? exit_code : 0;
}
