// ChildProcess; see child_process.hpp.
#include "ddprun/agent/child_process.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <boost/asio/post.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <vector>

#include "ddprun/agent/output.hpp"
#include "ddprun/common/error.hpp"

namespace asio = boost::asio;

namespace ddprun::agent {

struct ChildProcess::State {
  State(asio::io_context& i, std::chrono::milliseconds d) : io(i), drain_timeout(d) {}
  asio::io_context& io;
  std::chrono::milliseconds drain_timeout;
  Callbacks callbacks;
  pid_t pid = -1;
  std::unique_ptr<asio::posix::stream_descriptor> exit_watch;  // owns the pidfd
  std::vector<std::unique_ptr<OutputPump>> pumps;
  int pumps_open = 0;
  std::unique_ptr<asio::steady_timer> drain_timer;
  std::unique_ptr<asio::posix::stream_descriptor> stdin_pipe;
  std::string stdin_queue;     // not yet handed to a write
  std::string stdin_writing;   // the bytes of the write in flight (kept alive until it completes)
  bool exited = false;         // the process ended (its pidfd said so): not to be signalled
  bool exit_reported = false;  // ...and callbacks.on_exit ran (after its pumps' sync)
  bool done = false;
  bool detached = false;  // the ChildProcess is gone (possibly from inside a callback)
  bool reaped = false;
  ExitStatus status;

  void watch_exit(const std::weak_ptr<State>& self);
  void on_exit(const std::weak_ptr<State>& self, const ExitStatus& st);
  void report_exit(const std::weak_ptr<State>& self);
  void on_pump_done();
  void pump_stdin(const std::weak_ptr<State>& self);
  void report_done();
};

namespace {

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

}  // namespace

void ChildProcess::State::watch_exit(const std::weak_ptr<State>& self) {
  exit_watch->async_wait(asio::posix::stream_descriptor::wait_read, [self](const boost::system::error_code& ec) {
    const auto s = self.lock();
    if (ec || !s || s->detached) return;
    const auto st = peek_exit(s->pid);
    if (!st) {
      s->watch_exit(self);  // spurious wake-up
      return;
    }
    s->on_exit(self, *st);
  });
}

void ChildProcess::State::on_exit(const std::weak_ptr<State>& self, const ExitStatus& st) {
  exited = true;
  status = st;
  // What it wrote before it ended (a traceback) reaches the console before its exit is reported.
  // One count more than the pumps: a sync that completes at once must not report (which may
  // destroy the pumps) while this loop still walks them.
  auto left = std::make_shared<std::size_t>(1);
  const auto synced = [self, left] {
    if (--*left > 0) return;
    if (const auto s = self.lock(); s && !s->detached) s->report_exit(self);
  };
  for (auto& p : pumps) {
    if (p->done()) continue;
    ++*left;
    p->sync(synced);
  }
  synced();
}

void ChildProcess::State::report_exit(const std::weak_ptr<State>& self) {
  if (exit_reported) return;
  exit_reported = true;
  if (callbacks.on_exit) {
    const auto cb = callbacks.on_exit;
    cb(status);
  }
  if (detached || done) return;  // the callback may have destroyed the ChildProcess
  if (pumps_open == 0) {
    report_done();
    return;
  }
  // Usually EOF follows right away; a grandchild holding the pipe must not hold the owner.
  drain_timer = std::make_unique<asio::steady_timer>(io, drain_timeout);
  drain_timer->async_wait([self](const boost::system::error_code& ec) {
    const auto s2 = self.lock();
    if (ec || !s2 || s2->detached) return;
    for (auto& p : s2->pumps) p->finish_now();
  });
}

void ChildProcess::State::on_pump_done() {
  if (detached) return;
  --pumps_open;
  if (pumps_open == 0 && exit_reported && !done) {
    if (drain_timer) drain_timer->cancel();
    report_done();
  }
}

void ChildProcess::State::report_done() {
  done = true;
  if (callbacks.on_done) {
    const auto cb = callbacks.on_done;
    cb();  // last statement: it may destroy this state's owner
  }
}

void ChildProcess::State::pump_stdin(const std::weak_ptr<State>& self) {
  if (!stdin_pipe || !stdin_writing.empty() || stdin_queue.empty()) return;
  stdin_writing.swap(stdin_queue);
  asio::async_write(*stdin_pipe, asio::buffer(stdin_writing), [self](const boost::system::error_code& ec, std::size_t) {
    const auto s = self.lock();
    if (!s || s->detached) return;
    s->stdin_writing.clear();
    if (ec) {
      // The child is gone (EPIPE) or we closed it: nothing more can be said to it.
      s->stdin_queue.clear();
      if (s->stdin_pipe) {
        boost::system::error_code ignored;
        s->stdin_pipe->close(ignored);
        s->stdin_pipe.reset();
      }
      return;
    }
    s->pump_stdin(self);
  });
}

ChildProcess::ChildProcess(asio::io_context& io, std::chrono::milliseconds drain_timeout)
    : state_(std::make_shared<State>(io, drain_timeout)) {}

ChildProcess::~ChildProcess() {
  close_stdin();
  kill_and_reap();
  State& s = *state_;
  s.detached = true;
  s.callbacks = {};
  s.pumps.clear();  // an OutputPump's destructor drops its on_done
  s.drain_timer.reset();
  s.exit_watch.reset();
}

SpawnResult ChildProcess::start(SpawnRequest request, ChildStream out, ChildStream err, bool stdin_pipe,
                                Callbacks callbacks) {
  State& s = *state_;
  s.callbacks = std::move(callbacks);
  ChildStream* streams[2] = {&out, &err};
  int child_fds[3] = {-1, -1, -1};  // stdin, stdout, stderr
  int pump_fds[2] = {-1, -1};
  int parent_stdin = -1;
  auto fail = [&](const std::string& what) {
    const int e = errno;
    for (int& fd : child_fds) close_fd(fd);
    for (int& fd : pump_fds) close_fd(fd);
    close_fd(parent_stdin);
    for (auto* st : streams) {
      close_fd(st->fd);
      close_fd(st->file_fd);
    }
    throw Error(what + " failed: " + std::strerror(e), "raise the open-files limit (ulimit -n)");
  };
  if (stdin_pipe) {
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0) fail("pipe2");
    child_fds[0] = p[0];
    parent_stdin = p[1];
  }
  for (int i = 0; i < 2; ++i) {
    ChildStream& st = *streams[i];
    if (st.kind == ChildStream::Kind::fd) {
      child_fds[i + 1] = st.fd;
      st.fd = -1;
    } else if (st.kind != ChildStream::Kind::inherit) {
      int p[2];
      if (::pipe2(p, O_CLOEXEC) != 0) fail("pipe2");
      pump_fds[i] = p[0];
      child_fds[i + 1] = p[1];
    }
  }
  if (stdin_pipe) request.stdin_fd = child_fds[0];
  request.stdout_fd = child_fds[1];
  request.stderr_fd = child_fds[2];
  const SpawnResult res = spawn_worker(request);
  for (int& fd : child_fds) close_fd(fd);
  s.pid = res.pid;
  if (parent_stdin >= 0) s.stdin_pipe = std::make_unique<asio::posix::stream_descriptor>(s.io, parent_stdin);

  const std::weak_ptr<State> self = state_;
  for (int i = 0; i < 2; ++i) {
    if (pump_fds[i] < 0) continue;
    ChildStream& st = *streams[i];
    auto done = [self] {
      if (const auto sp = self.lock()) sp->on_pump_done();
    };
    ++s.pumps_open;
    if (st.kind == ChildStream::Kind::sink) {
      s.pumps.push_back(std::make_unique<OutputPump>(s.io, pump_fds[i], std::move(st.sink), st.console_fd, done));
      if (st.open_sink) s.pumps.back()->set_open_sink(std::move(st.open_sink));
    } else {
      s.pumps.push_back(
          std::make_unique<OutputPump>(s.io, pump_fds[i], st.file_fd, st.console_fd, std::move(st.prefix), done));
      st.file_fd = -1;
    }
    s.pumps.back()->start();
  }
  if (res.pid < 0) {
    // Never started: report it as exit 127 (the shell's "cannot execute"), from the io_context.
    s.reaped = true;
    asio::post(s.io, [self] {
      const auto sp = self.lock();
      if (sp && !sp->detached) sp->on_exit(self, ExitStatus::exited(127));
    });
    return res;
  }
  s.exit_watch = std::make_unique<asio::posix::stream_descriptor>(s.io, res.pidfd);
  s.watch_exit(self);
  return res;
}

void ChildProcess::write_stdin(std::string_view bytes) {
  if (!state_->stdin_pipe) return;
  state_->stdin_queue.append(bytes);
  state_->pump_stdin(state_);
}

void ChildProcess::close_stdin() {
  State& s = *state_;
  s.stdin_queue.clear();
  if (s.stdin_pipe) {
    boost::system::error_code ignored;
    s.stdin_pipe->close(ignored);
    s.stdin_pipe.reset();
  }
}

void ChildProcess::signal_group(int sig) const {
  if (state_->pid > 0 && !state_->reaped) agent::signal_group(state_->pid, sig);
}

void ChildProcess::kill_and_reap() {
  State& s = *state_;
  if (s.pid <= 0 || s.reaped) return;
  if (!s.exited) {
    // Only on an exception path or an unexpected end: never leave a child behind.
    agent::signal_group(s.pid, SIGKILL);
  }
  reap(s.pid, -1);  // the pidfd belongs to exit_watch
  s.reaped = true;
}

void ChildProcess::abandon() {
  State& s = *state_;
  if (s.pid <= 0 || s.reaped || s.exited) return;
  s.reaped = true;  // kill_and_reap() and the destructor must not block in waitid on it
  s.exit_watch.reset();
  s.callbacks = {};
  for (auto& p : s.pumps) p->finish_now();
}

pid_t ChildProcess::pid() const { return state_->pid; }
bool ChildProcess::exited() const { return state_->exited; }
bool ChildProcess::done() const { return state_->done; }
const ExitStatus& ChildProcess::status() const { return state_->status; }

}  // namespace ddprun::agent
