#pragma once
// ChildProcess: one child on the io_context, used for the agent's workers and the fan-out
// launcher's ssh clients alike. It spawns (process.hpp: own process group, pidfd), pumps the
// child's piped output (output.hpp: OutputPump), watches the pidfd, and reports two moments:
// on_exit (the process exited, and what it wrote before is out of its pipes, OutputPump::sync;
// it stays a zombie, so its process group id cannot be reused)
// and on_done (exited AND every piped stream reached EOF, or was cut `drain_timeout` after the
// exit because a grandchild holds it open). It reaps on kill_and_reap() or destruction.
//
// Optionally the child's stdin is a pipe the owner writes to asynchronously (write_stdin keeps
// order; a full pipe never blocks the io_context thread).
//
// Not thread-safe: everything runs on the io_context thread. Callbacks may destroy the
// ChildProcess that calls them.
#include <sys/types.h>

#include <boost/asio/io_context.hpp>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "ddprun/agent/exit_status.hpp"
#include "ddprun/agent/process.hpp"

namespace ddprun::agent {

// Where one output stream of the child goes.
struct ChildStream {
  enum class Kind : std::uint8_t {
    inherit,  // the parent's own stream
    fd,       // straight to `fd` (owned; closed after the spawn)
    console,  // piped: lines to `file_fd` (owned, -1 = none) and to `console_fd` with `prefix`
    sink,     // piped: blocks of whole lines to `sink` (LineBuffer::release's contract), paced on
              // `console_fd` (the console stream it writes to, -1: none; OutputPump)
  };
  Kind kind = Kind::inherit;
  int fd = -1;
  int file_fd = -1;
  int console_fd = -1;
  std::string prefix;
  std::function<void(std::string_view, bool)> sink;
  // With `sink`: where a partial line held for kOpenLineDelay goes (OutputPump::set_open_sink);
  // unset, it waits for its newline.
  std::function<bool(std::string_view)> open_sink;
};

class ChildProcess {
 public:
  struct Callbacks {
    std::function<void(const ExitStatus&)> on_exit;
    std::function<void()> on_done;
  };

  ChildProcess(boost::asio::io_context& io, std::chrono::milliseconds drain_timeout);
  ~ChildProcess();  // SIGKILLs the group of a child still running, then reaps it
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  // Spawns `request` (its stdout/stderr/stdin fds are set here from `out`, `err`, `stdin_pipe`).
  // When the spawn itself fails (no pid), on_exit reports exit 127 (the shell's "cannot
  // execute") from the io_context; a child that failed before exec exits 127 on its own. The
  // result says what failed either way.
  SpawnResult start(SpawnRequest request, ChildStream out, ChildStream err, bool stdin_pipe, Callbacks callbacks);

  // Queues bytes for the child's stdin (dropped when there is no stdin pipe or it was closed).
  void write_stdin(std::string_view bytes);
  // EOF for the child; anything still queued is dropped.
  void close_stdin();

  // killpg(pid, sig) while the child is not reaped (an exited child is a zombie: its group id
  // still names what is left of its group).
  void signal_group(int sig) const;
  // SIGKILL to the group unless it exited, then reap. Idempotent.
  void kill_and_reap();
  // Stops waiting for a child that did not end after SIGKILL (stuck in the kernel): its exit is
  // no longer watched, its piped output is written out as far as it is buffered, and it is never
  // reaped here (when it ends, it is a zombie until this process exits, then init's). No callback
  // follows. Nothing for a child that exited or was reaped.
  void abandon();

  pid_t pid() const;
  // The process ended (status() says how); Callbacks::on_exit may still be coming: it runs once
  // the output the process wrote before its end is out (OutputPump::sync).
  bool exited() const;
  bool done() const;
  const ExitStatus& status() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace ddprun::agent
