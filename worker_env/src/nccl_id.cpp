// NCCL unique IDs: hex form, bootstrap-root decoding, dlopen'd ncclGetUniqueId, and the
// per-round holder process (docs/gpus.md).
#include "ddprun/worker_env/nccl_id.hpp"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <glob.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>
#include <utility>

#include "ddprun/common/self_exe.hpp"
#include "ddprun/common/strings.hpp"

extern char** environ;  // NOLINT: POSIX

namespace ddprun::worker_env {

namespace {

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

using NcclGetUniqueId = int (*)(NcclUniqueId*);
using NcclGetErrorString = const char* (*)(int);

}  // namespace

std::string encode_nccl_id(const NcclUniqueId& id) {
  return to_hex(std::string_view(reinterpret_cast<const char*>(id.data()), id.size()));  // NOLINT: bytes
}

NcclUniqueId decode_nccl_id(std::string_view hex, std::string_view what) {
  const std::string_view t = trim(hex);
  if (t.size() != 2 * nccl_unique_id_bytes) {
    throw Error(std::string(what) + " has " + std::to_string(t.size()) + " characters, expected " +
                    std::to_string(2 * nccl_unique_id_bytes) + " hex digits (a 128-byte ncclUniqueId)",
                "pass the value ddprun exported unchanged");
  }
  NcclUniqueId id{};
  for (std::size_t i = 0; i < id.size(); ++i) {
    const int hi = hex_value(t[2 * i]);
    const int lo = hex_value(t[2 * i + 1]);
    if (hi < 0 || lo < 0) {
      throw Error(
          std::string(what) + " has a non-hex character at position " + std::to_string(hi < 0 ? 2 * i : 2 * i + 1),
          "pass the value ddprun exported unchanged");
    }
    id[i] = static_cast<std::uint8_t>(hi * 16 + lo);
  }
  return id;
}

std::vector<NcclUniqueId> decode_nccl_id_list(std::string_view list, std::string_view what) {
  std::vector<NcclUniqueId> out;
  if (trim(list).empty()) throw Error(std::string(what) + " is empty", "expected comma-separated 256-hex-char IDs");
  const auto parts = split(list, ',');
  for (std::size_t i = 0; i < parts.size(); ++i) {
    out.push_back(decode_nccl_id(parts[i], std::string(what) + "[" + std::to_string(i) + "]"));
  }
  return out;
}

std::optional<NcclBootstrapRoot> decode_bootstrap_root(const NcclUniqueId& id) {
  // ncclBootstrapHandle { uint64_t magic; union ncclSocketAddress addr; ... } (src/include/bootstrap.h).
  NcclBootstrapRoot root;
  std::memcpy(&root.magic, id.data(), sizeof root.magic);
  sa_family_t family = 0;
  std::memcpy(&family, id.data() + 8, sizeof family);
  char buf[INET6_ADDRSTRLEN] = {};
  if (family == AF_INET) {
    sockaddr_in sin{};
    std::memcpy(&sin, id.data() + 8, sizeof sin);
    if (inet_ntop(AF_INET, &sin.sin_addr, buf, sizeof buf) == nullptr) return std::nullopt;
    root.port = ntohs(sin.sin_port);
  } else if (family == AF_INET6) {
    sockaddr_in6 sin6{};
    std::memcpy(&sin6, id.data() + 8, sizeof sin6);
    if (inet_ntop(AF_INET6, &sin6.sin6_addr, buf, sizeof buf) == nullptr) return std::nullopt;
    root.port = ntohs(sin6.sin6_port);
  } else {
    return std::nullopt;
  }
  root.family = family;
  root.host = buf;
  return root;
}

std::vector<std::string> python_nccl_libraries(const EnvMap& env) {
  // The Python prefixes the workers may run under: PYTHON_EXEC's, then each PATH entry that
  // holds a python3 (a venv's bin/ first when it is activated). <prefix> is bin/'s parent.
  std::vector<std::string> prefixes;
  const auto add_prefix = [&](const std::string& python) {
    const auto slash = python.rfind('/');
    if (slash == std::string::npos || ::access(python.c_str(), X_OK) != 0) return;
    const std::string bin = python.substr(0, slash);
    const auto up = bin.rfind('/');
    const std::string prefix = up == std::string::npos || up == 0 ? std::string("/") : bin.substr(0, up);
    if (std::find(prefixes.begin(), prefixes.end(), prefix) == prefixes.end()) prefixes.push_back(prefix);
  };
  if (const auto it = env.find("PYTHON_EXEC"); it != env.end()) add_prefix(it->second);
  if (const auto it = env.find("PATH"); it != env.end()) {
    for (const auto& dir : split(it->second, ':')) {
      if (!dir.empty() && dir.front() == '/') add_prefix(std::string(dir) + "/python3");
    }
  }
  std::vector<std::string> found;
  for (const auto& prefix : prefixes) {
    const std::string base = prefix == "/" ? "" : prefix;
    for (const char* pattern : {"/lib/python3*/site-packages/nvidia/*/lib/libnccl.so.2",
                                "/local/lib/python3*/dist-packages/nvidia/*/lib/libnccl.so.2",
                                "/lib/python3/dist-packages/nvidia/*/lib/libnccl.so.2"}) {
      glob_t g{};
      if (::glob((base + pattern).c_str(), 0, nullptr, &g) == 0) {
        for (std::size_t i = 0; i < g.gl_pathc; ++i) {
          std::string path = g.gl_pathv[i];
          if (std::find(found.begin(), found.end(), path) == found.end()) found.push_back(std::move(path));
        }
      }
      ::globfree(&g);
    }
  }
  return found;
}

std::vector<std::string> nccl_library_candidates(const EnvMap& env) {
  if (const auto it = env.find("DDPRUN_NCCL_LIBRARY"); it != env.end() && !it->second.empty()) {
    return {it->second};
  }
  std::vector<std::string> out{"libnccl.so.2", "/usr/local/cuda/lib/libnccl.so.2",
                               "/usr/local/cuda/lib64/libnccl.so.2"};
  for (auto& path : python_nccl_libraries(env)) out.push_back(std::move(path));
  return out;
}

std::vector<NcclUniqueId> generate_nccl_unique_ids(int count, const EnvMap& env) {
  if (count < 1 || count > 4096) throw Error("NCCL roots: " + std::to_string(count) + " is outside [1, 4096]");
  void* handle = nullptr;
  std::string tried;
  std::string path;
  for (const auto& candidate : nccl_library_candidates(env)) {
    // Lazy binding: of libnccl's symbols the holder calls two; resolving them all up front
    // cost 0.2 ms of the ~1 ms dlopen of a 218 MB libnccl.so.2 (2.28) on the development VM.
    handle = dlopen(candidate.c_str(), RTLD_LAZY | RTLD_LOCAL);
    if (handle != nullptr) {
      path = candidate;
      break;
    }
    const char* e = dlerror();
    tried += (tried.empty() ? "" : "; ") + std::string(e != nullptr ? e : candidate + ": dlopen failed");
  }
  if (handle == nullptr) {
    throw NcclUnavailable("NCCL not found (" + tried + ")",
                          "install NCCL or set DDPRUN_NCCL_LIBRARY=/path/to/libnccl.so.2");
  }
  // Never dlclose: the bootstrap root threads run NCCL code until the process exits.
  auto get_id = reinterpret_cast<NcclGetUniqueId>(dlsym(handle, "ncclGetUniqueId"));           // NOLINT
  auto get_error = reinterpret_cast<NcclGetErrorString>(dlsym(handle, "ncclGetErrorString"));  // NOLINT
  if (get_id == nullptr) throw NcclUnavailable(path + " has no ncclGetUniqueId");
  std::vector<NcclUniqueId> ids(static_cast<std::size_t>(count));
  for (auto& id : ids) {
    if (const int r = get_id(&id); r != 0) {
      const char* s = get_error != nullptr ? get_error(r) : nullptr;
      throw NcclUnavailable(path + ": ncclGetUniqueId failed: " + (s != nullptr ? s : "error " + std::to_string(r)),
                            "see NCCL_DEBUG=INFO; NCCL needs a usable network interface (NCCL_SOCKET_IFNAME)");
    }
  }
  return ids;
}

// ---------------------------------------------------------------------------------------------
// NcclIdHolder

std::string default_nccl_id_holder_path() { return beside_this_binary("ddprun-nccl-id"); }

NcclIdHolder NcclIdHolder::start(const std::string& holder_binary, int roots, std::chrono::milliseconds timeout,
                                 const EnvList& extra_env) {
  NcclIdHolder h = spawn(holder_binary, roots, extra_env);
  h.await(timeout);
  return h;
}

NcclIdHolder NcclIdHolder::spawn(const std::string& holder_binary, int roots, const EnvList& extra_env) {
  int in_pipe[2];
  int out_pipe[2];
  int err_pipe[2];
  if (pipe2(in_pipe, O_CLOEXEC) != 0) throw Error("nccl-id holder: pipe: " + std::string(std::strerror(errno)));
  if (pipe2(out_pipe, O_CLOEXEC) != 0 || pipe2(err_pipe, O_CLOEXEC) != 0) {
    ::close(in_pipe[0]);
    ::close(in_pipe[1]);
    throw Error("nccl-id holder: pipe: " + std::string(std::strerror(errno)));
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, in_pipe[0], 0);
  posix_spawn_file_actions_adddup2(&fa, out_pipe[1], 1);
  posix_spawn_file_actions_adddup2(&fa, err_pipe[1], 2);
  EnvMap env = current_environment();
  std::vector<std::string> env_strings = merge_env(env, extra_env);
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string roots_arg = std::to_string(roots);
  std::string bin = holder_binary;
  std::string flag = "--roots";
  std::vector<char*> argv{bin.data(), flag.data(), roots_arg.data(), nullptr};
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, bin.c_str(), &fa, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&fa);
  ::close(in_pipe[0]);
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  if (rc != 0) {
    ::close(in_pipe[1]);
    ::close(out_pipe[0]);
    ::close(err_pipe[0]);
    throw Error("nccl-id holder: cannot start " + bin + ": " + std::strerror(rc),
                "check that ddprun-nccl-id is installed next to ddprun");
  }
  NcclIdHolder h;
  h.pid_ = pid;
  h.stdin_fd_ = in_pipe[1];
  h.out_fd_ = out_pipe[0];
  h.err_fd_ = err_pipe[0];
  h.roots_ = roots;
  h.binary_ = bin;
  return h;
}

void NcclIdHolder::close_output() {
  for (int* fd : {&out_fd_, &err_fd_}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
}

void NcclIdHolder::await(std::chrono::milliseconds timeout) {
  if (out_fd_ < 0) return;
  const int roots = roots_;
  // Read K lines from stdout (and stderr for the reason of a failure) until the deadline.
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::string out;
  std::string err;
  bool out_open = true;
  bool err_open = true;
  auto lines = [&out]() { return static_cast<int>(std::count(out.begin(), out.end(), '\n')); };
  // Bounded: stdout carries only the IDs (the holder sends everything else to stderr), stderr
  // NCCL's debug lines (NCCL_DEBUG=INFO) and the holder's own error line.
  const std::size_t out_cap = static_cast<std::size_t>(roots) * (2 * nccl_unique_id_bytes + 1);
  constexpr std::size_t kErrCap = 64 * 1024;
  while (lines() < roots && (out_open || err_open)) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) break;
    pollfd fds[2] = {{out_open ? out_fd_ : -1, POLLIN, 0}, {err_open ? err_fd_ : -1, POLLIN, 0}};
    const int ready = ::poll(fds, 2, static_cast<int>(std::min<long long>(left, 1000)));
    if (ready < 0 && errno != EINTR) break;
    char buf[4096];
    for (int i = 0; i < 2; ++i) {
      if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      const ssize_t got = ::read(fds[i].fd, buf, sizeof buf);
      if (got <= 0) {
        (i == 0 ? out_open : err_open) = false;
      } else {
        const auto n = static_cast<std::size_t>(got);
        if (i == 0) {
          out.append(buf, std::min(n, out_cap - std::min(out_cap, out.size())));
        } else {
          err.append(buf, n);  // the tail is kept: the holder's own error line comes last
          if (err.size() > kErrCap) err.erase(0, err.size() - kErrCap);
        }
      }
    }
  }
  close_output();
  if (lines() < roots) {
    stop(std::chrono::milliseconds(500));
    // stop() reaped it; a code-3 exit was recorded by stop() only as "gone", so read stderr: the
    // holder's own last line, else the last line (NCCL's debug lines may come first).
    std::string reason;
    for (const auto& line : split(std::string(trim(err)), '\n')) {
      if (line.rfind("ddprun-nccl-id:", 0) == 0 || reason.rfind("ddprun-nccl-id:", 0) != 0) reason = line;
    }
    if (reason.rfind("ddprun-nccl-id: NCCL unavailable:", 0) == 0) {
      throw NcclUnavailable(reason.substr(std::strlen("ddprun-nccl-id: NCCL unavailable: ")));
    }
    throw Error("nccl-id holder " + binary_ + " gave " + std::to_string(lines()) + " of " + std::to_string(roots) +
                " ID(s) within " + std::to_string(timeout.count()) + " ms" +
                (reason.empty() ? std::string() : ": " + reason));
  }
  // What NCCL printed while making the IDs (NCCL_DEBUG=INFO: the bootstrap root's interface and
  // address) goes where the holder's own stderr would have gone; later lines are dropped.
  if (!err.empty()) {
    [[maybe_unused]] const auto n = ::write(STDERR_FILENO, err.data(), err.size());
  }
  const auto parts = split(out, '\n');
  for (int i = 0; i < roots; ++i) {
    ids_.push_back(
        decode_nccl_id(parts[static_cast<std::size_t>(i)], "ddprun-nccl-id output line " + std::to_string(i + 1)));
  }
}

NcclIdHolder::NcclIdHolder(NcclIdHolder&& other) noexcept
    : pid_(std::exchange(other.pid_, -1)),
      stdin_fd_(std::exchange(other.stdin_fd_, -1)),
      out_fd_(std::exchange(other.out_fd_, -1)),
      err_fd_(std::exchange(other.err_fd_, -1)),
      roots_(other.roots_),
      binary_(std::move(other.binary_)),
      ids_(std::move(other.ids_)) {}

NcclIdHolder& NcclIdHolder::operator=(NcclIdHolder&& other) noexcept {
  if (this != &other) {
    stop();
    pid_ = std::exchange(other.pid_, -1);
    stdin_fd_ = std::exchange(other.stdin_fd_, -1);
    out_fd_ = std::exchange(other.out_fd_, -1);
    err_fd_ = std::exchange(other.err_fd_, -1);
    roots_ = other.roots_;
    binary_ = std::move(other.binary_);
    ids_ = std::move(other.ids_);
  }
  return *this;
}

NcclIdHolder::~NcclIdHolder() { stop(); }

EnvList NcclIdHolder::worker_env() const {
  EnvList env;
  if (ids_.empty()) return env;
  env.emplace_back("DDPRUN_NCCL_UNIQUE_ID", encode_nccl_id(ids_.front()));
  if (ids_.size() > 1) {
    std::string all;
    for (const auto& id : ids_) all += (all.empty() ? "" : ",") + encode_nccl_id(id);
    env.emplace_back("DDPRUN_NCCL_UNIQUE_IDS", std::move(all));
  }
  return env;
}

void NcclIdHolder::stop(std::chrono::milliseconds grace) {
  close_output();
  if (stdin_fd_ >= 0) {
    ::close(stdin_fd_);  // EOF on the holder's stdin: it exits
    stdin_fd_ = -1;
  }
  if (pid_ <= 0) return;
  const auto deadline = std::chrono::steady_clock::now() + grace;
  int status = 0;
  // A pidfd turns readable the moment the holder exits: no SIGCHLD plumbing, and no sleep on the
  // way out of every job (the holder needs a fraction of a millisecond to exit after EOF).
  const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid_, 0));
  for (;;) {
    const pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_ || (r < 0 && errno != EINTR)) break;
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, &status, 0);
      break;
    }
    if (pidfd >= 0) {
      pollfd p{pidfd, POLLIN, 0};
      ::poll(&p, 1, static_cast<int>(left));
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));  // kernels before 5.3
    }
  }
  if (pidfd >= 0) ::close(pidfd);
  pid_ = -1;
}

std::string pick_nccl_comm_id(const std::string& host, const std::string& avoid) {
  std::string bare = host;
  if (bare.size() > 2 && bare.front() == '[' && bare.back() == ']') bare = bare.substr(1, bare.size() - 2);
  sockaddr_storage addr{};
  socklen_t len = 0;
  bool v6 = false;
  auto* a4 = reinterpret_cast<sockaddr_in*>(&addr);   // NOLINT: sockaddr API
  auto* a6 = reinterpret_cast<sockaddr_in6*>(&addr);  // NOLINT: sockaddr API
  if (::inet_pton(AF_INET6, bare.c_str(), &a6->sin6_addr) == 1) {
    a6->sin6_family = AF_INET6;
    len = sizeof(sockaddr_in6);
    v6 = true;
  } else {
    a4->sin_family = AF_INET;
    if (::inet_pton(AF_INET, bare.c_str(), &a4->sin_addr) != 1) a4->sin_addr.s_addr = htonl(INADDR_ANY);
    len = sizeof(sockaddr_in);
  }
  const std::string shown = v6 ? "[" + bare + "]" : bare;
  for (int attempt = 0; attempt < 16; ++attempt) {
    const int fd = ::socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) throw NetworkError(std::string("--nccl-id comm-id: socket() failed: ") + std::strerror(errno));
    if (v6) {
      a6->sin6_port = 0;
    } else {
      a4->sin_port = 0;
    }
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) {  // NOLINT: sockaddr API
      const int err = errno;
      ::close(fd);
      throw NetworkError("--nccl-id comm-id: cannot bind a port on " + shown + ": " + std::strerror(err),
                         "pass --master-addr (or --local-addr) with an address of this machine");
    }
    sockaddr_storage got{};
    socklen_t got_len = sizeof(got);
    const int rc = ::getsockname(fd, reinterpret_cast<sockaddr*>(&got), &got_len);  // NOLINT: sockaddr API
    ::close(fd);
    if (rc != 0) throw NetworkError(std::string("--nccl-id comm-id: getsockname failed: ") + std::strerror(errno));
    const std::uint16_t port = ntohs(v6 ? reinterpret_cast<sockaddr_in6*>(&got)->sin6_port  // NOLINT
                                        : reinterpret_cast<sockaddr_in*>(&got)->sin_port);  // NOLINT
    std::string value = shown + ":" + std::to_string(port);
    if (value != avoid) return value;
  }
  throw NetworkError("--nccl-id comm-id: the kernel kept handing out the previous port on " + shown,
                     "retry, or use --nccl-id auto");
}

bool looks_like_comm_id(std::string_view bytes) {
  if (bytes.empty() || bytes.size() > 300) return false;
  for (char c : bytes) {
    if (c <= ' ' || c > '~') return false;
  }
  const auto colon = bytes.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == bytes.size()) return false;
  const auto port = parse_int(bytes.substr(colon + 1));
  return port && *port > 0 && *port < 65536;
}

namespace {
constexpr std::string_view kCommIdTag = "NCCL_COMM_ID=";
}  // namespace

std::vector<std::uint8_t> encode_comm_id_offer(const std::string& value) {
  const std::string text = std::string(kCommIdTag) + value;
  if (text.size() >= nccl_unique_id_bytes) {
    throw Error("--nccl-id comm-id: the address '" + value + "' is too long to offer to the rendezvous",
                "pass a numeric --local-addr");
  }
  std::vector<std::uint8_t> out(nccl_unique_id_bytes, 0);
  std::copy(text.begin(), text.end(), out.begin());
  return out;
}

std::optional<std::string> decode_comm_id_offer(const std::vector<std::uint8_t>& bytes) {
  if (bytes.size() != nccl_unique_id_bytes) return std::nullopt;
  const auto end = std::find(bytes.begin(), bytes.end(), std::uint8_t{0});
  if (std::any_of(end, bytes.end(), [](std::uint8_t b) { return b != 0; })) return std::nullopt;
  const std::string text(bytes.begin(), end);
  if (text.rfind(kCommIdTag, 0) != 0) return std::nullopt;
  std::string value = text.substr(kCommIdTag.size());
  if (!looks_like_comm_id(value)) return std::nullopt;
  return value;
}

}  // namespace ddprun::worker_env
