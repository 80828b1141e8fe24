#pragma once
// Test helpers for the store server suites: hex bytes, request builders, a blocking loopback
// socket client with deadlines, and a StoreServer running on its own io_context thread.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>

#include "ddprun/common/strings.hpp"
#include "ddprun/rendezvous/codec.hpp"
#include "ddprun/rendezvous/store_server.hpp"
#include "ddprun/rendezvous/bytes.hpp"

namespace test {

namespace rdzv = ddprun::rendezvous;
namespace wire = ddprun::rendezvous::bytes;

// "03 0500000000000000" -> bytes (spaces ignored).
inline std::string hex(std::string_view text) {
  std::string compact;
  for (char c : text) {
    if (c != ' ') compact.push_back(c);
  }
  auto bytes = ddprun::from_hex(compact);
  if (!bytes) throw std::runtime_error("bad hex in test: " + std::string(text));
  return *bytes;
}

inline std::string str(std::string_view s) {
  std::string out;
  wire::put_str(out, s);
  return out;
}
inline std::string i64(std::int64_t v) {
  std::string out;
  wire::put_i64(out, v);
  return out;
}
inline std::string u64(std::uint64_t v) {
  std::string out;
  wire::put_u64(out, v);
  return out;
}
inline std::string u32(std::uint32_t v) {
  std::string out;
  wire::put_u32(out, v);
  return out;
}
inline std::string u8(std::uint8_t v) { return std::string(1, static_cast<char>(v)); }

inline const std::string validate_bytes = hex("00 ce f7 85 3c");

// Blocking client socket with per-call deadlines (poll), loopback only.
class RawClient {
 public:
  explicit RawClient(std::uint16_t port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd_ < 0) throw std::runtime_error("socket() failed");
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      ::close(fd_);
      throw std::runtime_error("connect() to 127.0.0.1:" + std::to_string(port) + " failed");
    }
    int one = 1;
    ::setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  }
  ~RawClient() {
    if (fd_ >= 0) ::close(fd_);
  }
  RawClient(const RawClient&) = delete;
  RawClient& operator=(const RawClient&) = delete;

  void send(std::string_view bytes) {
    while (!bytes.empty()) {
      const ssize_t n = ::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
      if (n <= 0) throw std::runtime_error("send() failed");
      bytes.remove_prefix(static_cast<std::size_t>(n));
    }
  }

  // Reads exactly n bytes; throws on EOF or when the deadline passes.
  std::string recv(std::size_t n, std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    std::string out;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (out.size() < n) {
      if (!wait_readable(deadline))
        throw std::runtime_error("recv timed out after " + std::to_string(out.size()) + " bytes");
      char buf[65536];
      const ssize_t r = ::recv(fd_, buf, std::min(sizeof buf, n - out.size()), 0);
      if (r <= 0) throw std::runtime_error("connection closed after " + std::to_string(out.size()) + " bytes");
      out.append(buf, static_cast<std::size_t>(r));
    }
    return out;
  }

  // True when the server closes the connection (EOF or reset) before the deadline, with no
  // data in between.
  bool closed_by_peer(std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    if (!wait_readable(deadline)) return false;
    char c;
    const ssize_t r = ::recv(fd_, &c, 1, 0);
    return r <= 0;
  }

  // True when the peer closes (FIN or reset) within `timeout`, whatever is still unread: the
  // bytes already received stay in the socket, so a test of a client that reads nothing can wait
  // for the server's close without reading.
  bool hung_up_within(std::chrono::milliseconds timeout) {
    const short got = poll_for(POLLRDHUP, std::chrono::steady_clock::now() + timeout);
    return (got & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
  }

  // True when at least one byte is readable within `timeout`.
  bool readable_within(std::chrono::milliseconds timeout) {
    return wait_readable(std::chrono::steady_clock::now() + timeout);
  }

  int fd() const { return fd_; }

 private:
  bool wait_readable(std::chrono::steady_clock::time_point deadline) { return poll_for(POLLIN, deadline) != 0; }

  // poll(2) for `events` until the deadline: the events that came (0: none by then).
  short poll_for(short events, std::chrono::steady_clock::time_point deadline) {
    for (;;) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() < 0) return 0;
      pollfd p{fd_, events, 0};
      const int r = ::poll(&p, 1, static_cast<int>(left.count()));
      if (r > 0) return p.revents;
      if (r == 0) return 0;
    }
  }
  int fd_ = -1;
};

// StoreServer on 127.0.0.1, port 0, served by its own io_context thread.
class ServerThread {
 public:
  explicit ServerThread(rdzv::StoreServerOptions options = {}) {
    options.host = "127.0.0.1";
    options.port = 0;
    server_ = std::make_unique<rdzv::StoreServer>(io_, options);
    server_->start();
    thread_ = std::thread([this] { io_.run(); });
  }
  ~ServerThread() {
    boost::asio::post(io_, [this] {
      server_->stop();
      io_.stop();
    });
    thread_.join();
  }
  std::uint16_t port() const { return server_->port(); }

  // Runs f on the io_context thread and returns its result.
  template <class F>
  auto on_io(F f) {
    std::packaged_task<decltype(f())()> task(std::move(f));
    auto fut = task.get_future();
    boost::asio::post(io_, [&task] { task(); });
    return fut.get();
  }
  rdzv::StoreStats stats() {
    return on_io([this] { return server_->stats(); });
  }
  void reset() {
    on_io([this] {
      server_->reset();
      return 0;
    });
  }
  void on_drained(std::function<void()> callback) {
    on_io([this, &callback] {
      server_->on_drained(std::move(callback));
      return 0;
    });
  }

 private:
  boost::asio::io_context io_{1};
  std::unique_ptr<rdzv::StoreServer> server_;
  std::thread thread_;
};

}  // namespace test
