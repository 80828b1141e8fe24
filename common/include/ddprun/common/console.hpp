#pragma once
// The console (stdout, stderr) written by threads of its own, so that a console that stops
// reading never stops the event loop.
//
// A terminal held with Ctrl-S, a `| less` left on one page, a slow log shipper: a write(2) to
// them blocks. ddprun's agent and launcher run everything on one event loop (heartbeats, the
// rendezvous, signals, the worker store): a blocking write of relayed worker output there
// stopped the heartbeats (the node was declared lost and the job restarted) and left Ctrl-C
// unanswered until the reader went on. Here the event loop only queues; a writer thread per
// destination blocks instead. Descriptors that name the same file (`2>&1`, one terminal)
// share a queue and keep their order; a stdout piped to a pager that waits does not hold back
// what goes to a terminal's stderr. A regular file or /dev/null has no reader to wait on: it is
// written directly by the caller, with no thread (a batch job's redirected output).
//
// Back-pressure: the pumps that copy worker pipes stop reading once their queue holds
// kConsoleHighWater bytes (over()) and go on when it is down to kConsoleLowWater (when_room):
// a worker whose output the console does not take blocks in its own write(2), as it would
// writing to the terminal itself (torchrun). What does not wait (log lines, summaries) is kept
// up to kConsoleHardCap per queue; past it output is dropped, and stderr is told how much once
// the queue drains.
//
// A queue's thread starts with its first write; everything queued is written before the
// process exits (atexit), as a direct write would have been (limit_exit_wait bounds that
// wait). In a child forked from the process writes are direct (the threads are not there).
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string_view>

namespace boost::asio {
class io_context;
}

namespace ddprun::console {

inline constexpr std::size_t kConsoleHighWater = 1 << 20;
inline constexpr std::size_t kConsoleLowWater = 256 << 10;
inline constexpr std::size_t kConsoleHardCap = 16 << 20;
// What ddprun's exit waits for the console after a signal ended the run (limit_exit_wait).
inline constexpr std::chrono::milliseconds kConsoleExitWaitAfterSignal{2000};

// Queues `data` for `fd` (never blocks, never throws: what cannot be queued is lost). A piece
// whose write fails is dropped; after EPIPE (the reader is gone) everything for that fd is, as
// write_all's callers dropped it. Where no writer thread can be started (pids.max,
// RLIMIT_NPROC) that destination is written directly, as before these queues.
void write(int fd, std::string_view data, bool paced = false) noexcept;
// `block` of whole lines (complete) or ending in a partial line (not complete: a newline is
// added), with `prefix` before each line: queued as one piece. `paced` (here and in write):
// the caller stops at over() (a pump), so the piece is not held to kConsoleHardCap (dropping it
// would lose output that back-pressure already bounds), except after limit_exit_wait.
//
// Open lines: a writer may leave its last line open (`leave_open`, with `owner` naming the
// writer: a pump's number from new_owner(), never reused), so that a prompt without a newline ("(Pdb) ") is seen at
// once. Its next piece then goes on on that line, without the prefix, as long as nothing else was written to the
// destination since (the same queue: stdout and stderr on one terminal count as one); any other piece first ends the
// open line with a newline, so lines of different writers never share a line, and the owner's next piece starts a line
// of its own, with the prefix. An empty block that is not complete ends the owner's line, if it is still open.
void write_prefixed(int fd, std::string_view prefix, std::string_view block, bool complete, bool paced = false,
                    std::uint64_t owner = 0, bool leave_open = false) noexcept;
// A number for write_prefixed's `owner` no other writer of this process has.
std::uint64_t new_owner() noexcept;
// fd's queue holds kConsoleHighWater bytes or more (fd -1: any queue does): a pump that
// writes there should stop reading.
bool over(int fd);
// Posts `resume` to `io` once fd's queue (fd -1: the fullest) is below kConsoleLowWater (at
// once when it is already).
// Returns an id for cancel(): a waiter must be cancelled before `io` is destroyed (after
// cancel() returns, nothing more is posted for it; what was posted may still run).
std::uint64_t when_room(int fd, boost::asio::io_context& io, std::function<void()> resume);
void cancel(std::uint64_t id);
// Blocks until everything queued so far was written (or dropped: a dead fd); after
// limit_exit_wait, for at most that limit.
void drain();
// From now on the wait at exit for what is queued is at most `limit` (a signal ended the run:
// a scheduler's SIGTERM before its SIGKILL must not wait on a console that does not read);
// what is left then is not written. Without it the exit waits as a direct write would. The
// pumps no longer pause either (over() is false from then on): the processes whose output they
// read must be able to end; what the console does not take past kConsoleHardCap is dropped.
void limit_exit_wait(std::chrono::milliseconds limit);
// What fd's queue holds and has not written yet, in bytes (fd -1: the fullest queue).
std::size_t queued(int fd);

}  // namespace ddprun::console
