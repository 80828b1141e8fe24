// ddprun-rdzvd as a process: readiness line, port file, serving, SIGTERM, bind conflict.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>

#include "helpers.hpp"

using test::hex;

namespace {

// A child process with stdout and stderr on pipes; killed on destruction if still running.
class Child {
 public:
  explicit Child(std::vector<std::string> args) {
    int out[2], err[2];
    REQUIRE(::pipe2(out, O_CLOEXEC) == 0);
    REQUIRE(::pipe2(err, O_CLOEXEC) == 0);
    pid_ = ::fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      ::dup2(out[1], 1);
      ::dup2(err[1], 2);
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    ::close(out[1]);
    ::close(err[1]);
    out_ = out[0];
    err_ = err[0];
  }
  ~Child() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    ::close(out_);
    ::close(err_);
  }
  // Reads one line from stdout (without the newline) within the timeout.
  std::string read_line(std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    std::string line;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return line + "<timeout>";
      pollfd p{out_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char c;
      if (::read(out_, &c, 1) != 1) return line + "<eof>";
      if (c == '\n') return line;
      line.push_back(c);
    }
  }
  // Waits for the exit (its pidfd readable, within the timeout; where pidfds are unavailable,
  // waitpid polled); returns the exit code or -signal, -1000 when it is still running.
  int wait_exit(std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    int status = 0;
    if (const int fd = static_cast<int>(::syscall(SYS_pidfd_open, pid_, 0)); fd >= 0) {
      pollfd p{fd, POLLIN, 0};
      for (;;) {
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
        if (::poll(&p, 1, static_cast<int>(std::max<std::int64_t>(left.count(), 0))) > 0 || left.count() <= 0) break;
      }
      ::close(fd);
      if (::waitpid(pid_, &status, WNOHANG) != pid_) return -1000;
    } else {
      while (::waitpid(pid_, &status, WNOHANG) == 0) {
        if (std::chrono::steady_clock::now() > deadline) return -1000;
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    }
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
  }
  std::string read_stderr() {
    std::string s;
    char buf[4096];
    ssize_t n;
    while ((n = ::read(err_, buf, sizeof buf)) > 0) s.append(buf, static_cast<std::size_t>(n));
    return s;
  }
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  int out_ = -1;
  int err_ = -1;
};

std::filesystem::path temp_dir() {
  auto dir = std::filesystem::temp_directory_path() / ("ddprun-rdzvd-test-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace

TEST_CASE("ddprun-rdzvd announces its port, serves, and stops on SIGTERM", "[rdzvd]") {
  const auto dir = temp_dir();
  const auto port_file = dir / "port";
  std::filesystem::remove(port_file);
  Child child({DDPRUN_RDZVD_PATH, "--host", "127.0.0.1", "--port", "0", "--port-file", port_file.string()});
  const std::string line = child.read_line();
  REQUIRE(line.rfind("listening on 127.0.0.1:", 0) == 0);
  const int port = std::stoi(line.substr(std::string("listening on 127.0.0.1:").size()));
  REQUIRE(port > 0);
  std::string content;
  {
    std::ifstream pf(port_file);
    std::getline(pf, content);
    content += pf.eof() ? "" : "\n";
  }
  CHECK(content == std::to_string(port) + "\n");

  test::RawClient c(static_cast<std::uint16_t>(port));
  c.send(test::validate_bytes + hex("0d") + test::u32(5) + hex("04") + test::str("init/") + test::i64(1));
  CHECK(c.recv(12) == test::u32(5) + test::i64(1));

  REQUIRE(::kill(child.pid(), SIGTERM) == 0);
  CHECK(child.wait_exit() == 0);
  std::filesystem::remove_all(dir);
}

TEST_CASE("ddprun-rdzvd exits 1 naming host:port when the port is taken", "[rdzvd]") {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  REQUIRE(::listen(fd, 1) == 0);
  socklen_t len = sizeof addr;
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  const std::string port = std::to_string(ntohs(addr.sin_port));

  Child child({DDPRUN_RDZVD_PATH, "--host", "127.0.0.1", "--port", port});
  CHECK(child.wait_exit() == 1);
  const std::string err = child.read_stderr();
  CHECK(err.find("127.0.0.1:" + port) != std::string::npos);
  CHECK(err.find("--port 0") != std::string::npos);
  ::close(fd);
}

TEST_CASE("ddprun-rdzvd rejects bad flags with exit code 2", "[rdzvd]") {
  Child child({DDPRUN_RDZVD_PATH, "--port", "70000"});
  CHECK(child.wait_exit() == 2);
  Child version({DDPRUN_RDZVD_PATH, "--version"});
  CHECK(version.read_line().rfind("ddprun-rdzvd ", 0) == 0);
  CHECK(version.wait_exit() == 0);
}
