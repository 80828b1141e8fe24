#pragma once
// Diagnosis of a failed or hung attempt: the stacks of the ranks still running (Python ranks
// through the interpreter's own faulthandler, registered at startup by a sitecustomize the
// agent installs; other ranks through elfutils' eu-stack when installed), the cause of each
// rank's death, the culprit of a collective timeout, and the progress signal of the hang
// detector. See docs/errors.md for what the summaries look like.
//
// Stack collection is bounded in time (whatever the number of ranks) and only ever signals a rank that
// has the handler installed (its SigCgt mask in /proc says so): a rank without it is never sent
// the signal, whose default action would kill it.
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ddprun::agent {

// The real-time signal the faulthandler hook listens on (SIGRTMAX - 3).
int stacks_signal();

// Writes the sitecustomize hook under `job_dir` and returns the directory to put first on the
// workers' PYTHONPATH.
std::string install_python_hook(const std::string& job_dir);

// Whether a worker started as `executable` with `argv` may be (or start) a Python interpreter,
// so the hook is worth installing: true unless the executable is an ELF binary whose name and
// arguments never mention python (e.g. /bin/true, a compiled trainer). Scripts count as Python
// (their interpreter may be), and so does `env python3 ...` or `bash -c "python ..."`.
bool may_run_python(const std::string& executable, const std::vector<std::string>& argv);

struct RankStacks {
  int rank = 0;
  int local_rank = 0;
  pid_t pid = 0;
  std::string method;       // "faulthandler", "eu-stack", or "" (none could be taken)
  std::string text;         // the raw stacks
  std::string main_thread;  // eu-stack: the main thread's part of `text` ("" for faulthandler)
  std::string file;         // where they were written
  std::string where;        // one-line summary: "time.sleep at train.py:42" style, or why none
  double millis = 0;        // what collecting them cost
};

struct StackTarget {
  pid_t pid = 0;
  int rank = 0;
  int local_rank = 0;
  std::string rank_dir;
};

// Collects the stacks of every target, in parallel: each Python rank with the hook is signalled
// at once and writes `rank_dir`/stacks.txt (faulthandler, to the file the hook opened there);
// the others, and those whose dump did not come, get eu-stack into `rank_dir`/stacks-native.txt,
// all at once. Bounded by kStackBound for the dumps plus kStackBound for eu-stack, whatever the
// number of ranks. One result per target, in order.
std::vector<RankStacks> collect_stacks(const std::vector<StackTarget>& targets);

// Whether a faulthandler dump (or its tail) ends with the main thread's outermost frame, which
// faulthandler writes last: "<module>" (a script, -c) or runpy's "_run_module_as_main" (-m).
bool dump_complete(std::string_view text);

// One faulthandler frame line, `File "PATH", line N in FUNC`; nullopt when `line` is not one (or
// its path, name or number is out of bounds: the dump is the rank's to write).
struct PythonFrame {
  std::string file;
  int line = 0;
  std::string func;
};
std::optional<PythonFrame> parse_python_frame(std::string_view line);

// The symbol of the first named frame ("#2  0x... clock_nanosleep") of eu-stack output; "" when
// there is none.
std::string native_frame_symbol(std::string_view text);

// The innermost frame of the main Python thread of a faulthandler dump: "f at file.py:42
// (`source line`)"; "" when the text has no Python frame. With `proc_dir` ("/proc/PID" of the
// rank) the source line is read through the rank's own root and working directory; without it,
// from the agent's.
std::string python_where(const std::string& faulthandler_text, const std::string& proc_dir = {});
// Where a fatal signal hit a Python rank: python_where of the last "Fatal Python error:" dump in
// its stacks file (the hook's faulthandler.enable writes it there), as the rank's files are seen
// from here (the rank is gone); "" when there is none.
std::string fatal_where(const std::string& stacks_file);

// The collective a failing rank's output or traceback shows it timed out in ("all_reduce"),
// or "" when the text is not a collective timeout. A peer lost in a collective (a connection
// closed or reset by it, an aborted NCCL communicator) counts too: either way the rank that wrote
// it was waiting on another one.
std::string collective_timeout_in(const std::string& text);

// How the collective of such a text failed, as the words before its name on the failed rank's
// line: "timed out in" when the rank's own timeout is named (NCCL's watchdog, gloo's "Timed
// out"), else "lost a peer in" when a peer closed or reset the connection or the NCCL
// communicator was aborted for another reason (the peer died or tore its group down), else
// "timed out in" for a bare "timeout", else "failed in".
std::string_view collective_failure_words(const std::string& text);

// Whether a stack dump shows the rank inside a torch.distributed collective or the c10d layer.
bool in_collective(const std::string& stacks);

// CPU ticks (utime+stime) and bytes written (wchar) summed over `pids`: the hang detector's
// progress signal.
struct Progress {
  std::uint64_t ticks = 0;
  std::uint64_t wchar = 0;
  friend bool operator==(const Progress&, const Progress&) = default;
};
Progress sample_progress(const std::vector<pid_t>& pids);

// A file a worker wrote (or could have replaced): read only when it is a regular file, opened
// without blocking (a FIFO is refused, not waited on) and, unless `follow_links`, not through a
// symbolic link; at most `max_bytes` from offset `from`. nullopt when it cannot be used, with why
// in `problem` ("is a FIFO", "No such file or directory", ...). `size` (when not null) gets the
// file's whole size, so a caller can tell that it read only part of it.
std::optional<std::string> read_worker_file(const std::string& path, std::size_t max_bytes, std::size_t from = 0,
                                            bool follow_links = false, std::string* problem = nullptr,
                                            std::size_t* size = nullptr);

// Creates (truncates) `path` in a directory a worker can write to, for the agent to write: never
// blocks on a FIFO put there, never follows a link, keeps only a regular file. The descriptor
// (blocking again), or -1 with why in `problem`.
int create_agent_file(const std::string& path, std::string* problem = nullptr);

// The last `max_bytes` of a regular file ("" when unreadable or not a regular file).
std::string read_tail(const std::string& path, std::size_t max_bytes);

// Whether process `pid` has a handler for `sig` (SigCgt in /proc/PID/status); false when gone.
bool catches_signal(pid_t pid, int sig);

// "812.4 MiB".
std::string format_bytes(std::uint64_t bytes);

}  // namespace ddprun::agent
