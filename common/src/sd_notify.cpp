#include "ddprun/common/sd_notify.hpp"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>

namespace ddprun {

namespace {

// Closes the socket on every path out of sd_notify_to.
class FdGuard {
 public:
  explicit FdGuard(int fd) : fd_(fd) {}
  FdGuard(const FdGuard&) = delete;
  FdGuard& operator=(const FdGuard&) = delete;
  ~FdGuard() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

}  // namespace

NotifyResult sd_notify_to(std::string_view socket_name, std::string_view state) {
  NotifyResult result;
  const std::string shown = "NOTIFY_SOCKET=" + std::string(socket_name);
  if (socket_name.empty()) {
    result.error = "NOTIFY_SOCKET is empty";
    return result;
  }
  const bool abstract = socket_name.front() == '@';
  if (!abstract && socket_name.front() != '/') {
    // systemd 253+ may also name an AF_VSOCK address ("vsock:CID:PORT"); only a VM's service
    // manager does that, and AF_UNIX is what every host systemd uses.
    result.error =
        shown + " is neither an absolute path nor an abstract name (@...); only AF_UNIX sockets are supported";
    return result;
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_name.size() > sizeof addr.sun_path) {
    result.error =
        shown + " is longer than a socket address may be (" + std::to_string(sizeof addr.sun_path) + " bytes)";
    return result;
  }
  std::memcpy(addr.sun_path, socket_name.data(), socket_name.size());
  if (abstract) addr.sun_path[0] = '\0';
  // An abstract name's length is exact (no terminating NUL); a path gets the NUL when it fits.
  std::size_t len = offsetof(sockaddr_un, sun_path) + socket_name.size();
  if (!abstract && socket_name.size() < sizeof addr.sun_path) ++len;

  FdGuard fd(::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) {
    result.error = "cannot create a datagram socket for " + shown + ": " + std::strerror(errno);
    return result;
  }
  ssize_t n;
  do {
    n = ::sendto(fd.get(), state.data(), state.size(), MSG_NOSIGNAL, reinterpret_cast<const sockaddr*>(&addr),
                 static_cast<socklen_t>(len));
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    result.error = "cannot send to " + shown + ": " + std::strerror(errno);
    return result;
  }
  if (static_cast<std::size_t>(n) != state.size()) {
    result.error = "short send to " + shown;
    return result;
  }
  result.sent = true;
  return result;
}

NotifyResult sd_notify(std::string_view state) {
  const char* name = std::getenv("NOTIFY_SOCKET");
  if (name == nullptr) return {};
  return sd_notify_to(name, state);
}

NotifyResult notify_ready(std::string_view status) {
  std::string state = "READY=1";
  if (!status.empty()) {
    state += "\nSTATUS=";
    // STATUS is one line; a newline would start a new assignment.
    for (char c : status) state += (c == '\n' ? ' ' : c);
  }
  return sd_notify(state);
}

}  // namespace ddprun
