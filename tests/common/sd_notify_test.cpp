// sd_notify without libsystemd: this test plays systemd's role. It binds the datagram socket a
// service manager would, points the library at it (path and abstract names), and reads back the
// exact datagram; without NOTIFY_SOCKET nothing is sent and nothing fails.
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

#include "ddprun/common/sd_notify.hpp"
#include "../helpers/scoped_env.hpp"

namespace {

// A bound AF_UNIX datagram socket: `name` as $NOTIFY_SOCKET would spell it.
class FakeSystemd {
 public:
  explicit FakeSystemd(bool abstract) {
    fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd_ >= 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    socklen_t len;
    if (abstract) {
      name_ = "@ddprun-notify-test-" + std::to_string(::getpid());
      std::memcpy(addr.sun_path + 1, name_.data() + 1, name_.size() - 1);
      len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name_.size());
    } else {
      dir_ = std::filesystem::temp_directory_path() / ("ddprun-notify-" + std::to_string(::getpid()));
      std::filesystem::create_directories(dir_);
      name_ = (dir_ / "notify").string();
      std::memcpy(addr.sun_path, name_.c_str(), name_.size() + 1);
      len = static_cast<socklen_t>(sizeof addr);
    }
    REQUIRE(::bind(fd_, reinterpret_cast<const sockaddr*>(&addr), len) == 0);
  }
  ~FakeSystemd() {
    ::close(fd_);
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }
  FakeSystemd(const FakeSystemd&) = delete;
  FakeSystemd& operator=(const FakeSystemd&) = delete;

  const std::string& name() const { return name_; }

  // The next datagram, waiting at most 5 s (it was sent before this is called; the bound is
  // only there so a broken sender fails the test instead of hanging it).
  std::string receive() const {
    pollfd pfd{fd_, POLLIN, 0};
    if (::poll(&pfd, 1, 5000) != 1) return "<nothing received>";
    char buf[4096];
    const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
    return n < 0 ? "<recv failed>" : std::string(buf, static_cast<std::size_t>(n));
  }

 private:
  int fd_ = -1;
  std::string name_;
  std::filesystem::path dir_;
};

}  // namespace

TEST_CASE("notify_ready sends READY=1 and STATUS to a path socket") {
  FakeSystemd systemd(false);
  ScopedEnv env("NOTIFY_SOCKET", systemd.name().c_str());
  const auto r = ddprun::notify_ready("listening on 0.0.0.0:29400");
  CHECK(r.error.empty());
  CHECK(r.sent);
  CHECK(systemd.receive() == "READY=1\nSTATUS=listening on 0.0.0.0:29400");
}

TEST_CASE("notify_ready reaches an abstract-namespace socket (@name)") {
  FakeSystemd systemd(true);
  ScopedEnv env("NOTIFY_SOCKET", systemd.name().c_str());
  const auto r = ddprun::notify_ready("up\nsecond line");
  CHECK(r.error.empty());
  CHECK(r.sent);
  // A newline inside STATUS would start a new assignment; it is flattened.
  CHECK(systemd.receive() == "READY=1\nSTATUS=up second line");
}

TEST_CASE("without NOTIFY_SOCKET nothing is sent and nothing fails") {
  ScopedEnv env("NOTIFY_SOCKET", nullptr);
  const auto r = ddprun::notify_ready("x");
  CHECK_FALSE(r.sent);
  CHECK(r.error.empty());
}

TEST_CASE("bad NOTIFY_SOCKET values are errors that name the variable") {
  auto r = ddprun::sd_notify_to("relative/path", "READY=1");
  CHECK_FALSE(r.sent);
  CHECK_THAT(r.error, Catch::Contains("NOTIFY_SOCKET=relative/path") && Catch::Contains("absolute path"));
  r = ddprun::sd_notify_to("/nonexistent-dir-for-ddprun/notify", "READY=1");
  CHECK_FALSE(r.sent);
  CHECK_THAT(r.error, Catch::Contains("cannot send to NOTIFY_SOCKET=/nonexistent-dir-for-ddprun/notify"));
  r = ddprun::sd_notify_to("/" + std::string(200, 'x'), "READY=1");
  CHECK_THAT(r.error, Catch::Contains("longer than a socket address"));
  r = ddprun::sd_notify_to("", "READY=1");
  CHECK_THAT(r.error, Catch::Contains("empty"));
}
