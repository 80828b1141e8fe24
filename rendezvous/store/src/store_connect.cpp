// StoreClient's connection layer: blocking sockets with deadlines, the VALIDATE/PING
// handshake bytes, and generation probing (store_connect.hpp; the contract of
// detect_generation is in store_client.hpp).
#include "store_connect.hpp"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <thread>

#include "ddprun/common/backoff.hpp"
#include "ddprun/common/error.hpp"
#include "ddprun/rendezvous/bytes.hpp"
#include "ddprun/rendezvous/codec.hpp"
#include "ddprun/rendezvous/store_client.hpp"

namespace ddprun::rendezvous {
namespace store_connect {

using std::chrono::milliseconds;

namespace {

// Remaining time until `deadline` for poll(): rounded up to whole ms, clamped to int.
int poll_timeout_ms(SteadyTime deadline) {
  const auto left = deadline - now();
  if (left <= std::chrono::steady_clock::duration::zero()) return 0;
  const auto ms = std::chrono::ceil<milliseconds>(left).count();
  return static_cast<int>(std::min<std::int64_t>(ms, INT_MAX));
}

void set_blocking_options(int fd, milliseconds io_timeout) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  const auto ms = std::max<std::int64_t>(io_timeout.count(), 1);
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(ms / 1000);
  tv.tv_usec = static_cast<suseconds_t>((ms % 1000) * 1000);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

}  // namespace

std::string format_duration(milliseconds d) {
  const auto n = d.count();
  if (n >= 1000 && n % 1000 == 0) return std::to_string(n / 1000) + " s";
  if (n >= 1000) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f s", static_cast<double>(n) / 1000.0);
    return buf;
  }
  return std::to_string(n) + " ms";
}

std::string endpoint_text(const std::string& host, std::uint16_t port) {
  if (host.find(':') != std::string::npos) return "[" + host + "]:" + std::to_string(port);
  return host + ":" + std::to_string(port);
}

std::string errno_text(int err) { return std::strerror(err); }

// SO_RCVTIMEO/SO_SNDTIMEO expiry.
bool is_would_block(int err) {
#if EAGAIN != EWOULDBLOCK
  if (err == EWOULDBLOCK) return true;
#endif
  return err == EAGAIN;
}

// Waits until `fd` has `events` (or an error/hangup) or the deadline passes.
// Returns false on timeout.
bool wait_fd(int fd, short events, SteadyTime deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, poll_timeout_ms(deadline));
    if (r > 0) return true;
    if (r == 0) {
      if (now() >= deadline) return false;
      continue;  // poll rounds to ms; keep going until the deadline really passed
    }
    if (errno != EINTR) return true;  // let the following syscall report the error
  }
}

// One TCP connect to any address of host:port (all families, in getaddrinfo order), before
// `deadline`. Returns a connected blocking socket, or -1 with `last_error` set.
int connect_once(const std::string& host, std::uint16_t port, SteadyTime deadline, milliseconds io_timeout,
                 std::string& last_error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;  // no service lookup; getaddrinfo never reverse-resolves
  addrinfo* res = nullptr;
  const std::string port_text = std::to_string(port);
  const int gai = ::getaddrinfo(host.c_str(), port_text.c_str(), &hints, &res);
  if (gai != 0) {
    last_error = std::string("cannot resolve host: ") + ::gai_strerror(gai);
    return -1;
  }
  int result = -1;
  for (addrinfo* ai = res; ai != nullptr && result < 0; ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) {
      last_error = "socket(): " + errno_text(errno);
      continue;
    }
    int rc = ::connect(fd, ai->ai_addr, ai->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      if (!wait_fd(fd, POLLOUT, deadline)) {
        last_error = "connect timed out";
        ::close(fd);
        continue;
      }
      int err = 0;
      socklen_t len = sizeof err;
      ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      rc = err == 0 ? 0 : -1;
      errno = err;
    }
    if (rc != 0) {
      last_error = errno_text(errno);
      ::close(fd);
      continue;
    }
    set_blocking_options(fd, io_timeout);
    result = fd;
  }
  ::freeaddrinfo(res);
  return result;
}

bool send_all_raw(int fd, const char* data, std::size_t len, std::string& err) {
  while (len > 0) {
    const ssize_t n = ::send(fd, data, len, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      err = is_would_block(errno) ? std::string("send timed out") : errno_text(errno);
      return false;
    }
    data += n;
    len -= static_cast<std::size_t>(n);
  }
  return true;
}

// Reads exactly `len` bytes before `deadline` (for handshakes and probes).
bool recv_exact_raw(int fd, char* out, std::size_t len, SteadyTime deadline, std::string& err) {
  while (len > 0) {
    if (!wait_fd(fd, POLLIN, deadline)) {
      err = "no reply (timed out)";
      return false;
    }
    const ssize_t n = ::recv(fd, out, len, 0);
    if (n == 0) {
      err = "connection closed by the server";
      return false;
    }
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      err = errno_text(errno);
      return false;
    }
    out += n;
    len -= static_cast<std::size_t>(n);
  }
  return true;
}

// Modern-generation requests without keys (handshakes and probes), through the codec.
void encode_modern(std::string& out, Op op, std::uint32_t u32) {
  Request req;
  req.op = op;
  req.u32 = u32;
  encode_request(out, Generation::modern, req);
}

std::string validate_and_ping_bytes(std::uint32_t nonce) {
  std::string out;
  encode_modern(out, Op::validate, validation_magic);
  encode_modern(out, Op::ping, nonce);
  return out;
}

std::uint32_t handshake_nonce() { return static_cast<std::uint32_t>(::getpid()); }

}  // namespace store_connect

using namespace store_connect;  // NOLINT
using std::chrono::milliseconds;

// ---- probing (protocol §2.3) --------------------------------------------------------

DetectedGeneration detect_generation(const std::string& host, std::uint16_t port, std::chrono::milliseconds timeout) {
  const SteadyTime deadline = now() + timeout;
  // A 1.13 server reads our VALIDATE as a SET with a ~2^40-byte key and sits in a blocking
  // recv() for it, stalling all its clients until we close (protocol §2.5, §10.14). So each
  // probe waits only briefly for its answer; a modern server answers within a round trip.
  const milliseconds probe_wait = std::max(milliseconds(250), timeout / 8);
  const std::string where = endpoint_text(host, port);
  std::string err;
  auto open = [&]() {
    for (Backoff backoff({milliseconds(2), milliseconds(500), 2.0, 0.5});;) {
      const int fd = connect_once(host, port, deadline, timeout, err);
      if (fd >= 0) return fd;
      if (now() >= deadline) {
        throw NetworkError("could not connect to " + where + " within " + format_duration(timeout) +
                               " to probe its protocol (last error: " + err + ")",
                           "is a TCPStore server running there?");
      }
      std::this_thread::sleep_for(
          std::min<std::chrono::steady_clock::duration>(backoff.next_delay(), deadline - now()));
    }
  };
  auto probe_deadline = [&]() { return std::min(deadline, now() + probe_wait); };
  {
    const int fd = open();
    const std::uint32_t nonce = handshake_nonce();
    const std::string hello = validate_and_ping_bytes(nonce);
    std::array<char, 4> echo{};
    const bool ok = send_all_raw(fd, hello.data(), hello.size(), err) &&
                    recv_exact_raw(fd, echo.data(), echo.size(), probe_deadline(), err);
    ::close(fd);
    if (ok) {
      if (bytes::load_le<std::uint32_t>(echo.data()) == nonce) return DetectedGeneration::modern;
    }
  }
  {
    const int fd = open();
    std::string probe;
    encode_modern(probe, Op::validate, validation_magic);
    for (int i = 0; i < 4; ++i) encode_modern(probe, Op::get_num_keys);
    std::array<char, 32> replies{};
    const bool ok = send_all_raw(fd, probe.data(), probe.size(), err) &&
                    recv_exact_raw(fd, replies.data(), replies.size(), probe_deadline(), err);
    ::close(fd);
    return ok ? DetectedGeneration::modern_no_ping : DetectedGeneration::legacy;
  }
}

}  // namespace ddprun::rendezvous
