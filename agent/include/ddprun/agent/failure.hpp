#pragma once
// Failure reporting: reading a worker's TORCHELASTIC_ERROR_FILE (the JSON written by torch's
// @record, tcpstore-protocol.md §8.1) and formatting the root-cause summary ddprun prints when
// the restart budget is spent. Pure functions, except the two file readers at the end.
//
// A file that is not valid JSON or lacks the expected fields never throws: the summary says
// what was wrong with it instead.
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ddprun/agent/exit_status.hpp"

namespace ddprun::agent {

struct ErrorFileContents {
  std::string message;                    // message.message, or the message string itself
  std::string traceback;                  // message.extraInfo.py_callstack (may be empty)
  std::optional<std::int64_t> timestamp;  // unix seconds, when present
};

// Parses the error file text. On failure returns nullopt and sets `problem` (if given) to a
// short reason ("not valid JSON: ...", "no \"message\" field").
std::optional<ErrorFileContents> parse_error_file(std::string_view json, std::string* problem = nullptr);

struct FailureReport {
  int local_rank = 0;
  int rank = 0;
  pid_t pid = 0;
  ExitStatus status;
  std::chrono::system_clock::time_point time;
  std::string error_file;                  // path given to the worker; empty = none
  std::optional<ErrorFileContents> error;  // parsed contents, when the worker wrote one
  std::string note;                        // e.g. why the error file could not be used, spawn error
  std::string cause;                       // why it ended: out of memory, core dump, hang detector (diagnosis.hpp)
  std::string diagnosis;                   // the attempt's diagnosis block (culprit, stacks), when one was made
  std::string host;                        // where it failed; "" = the summary's host
  // The last line of the uncaught exception the stacks hook recorded ("ValueError: boom"), made
  // terminal-safe; set for the first failure only. Relayed as the message to the other nodes
  // when the rank wrote no error file.
  std::string raised;
};

// The diagnosis block: culprits first, then one line per rank (cause of death or stack
// summary), then where the full stacks were written. Kept apart from the root-cause layout.
std::string format_diagnosis_block(std::string_view host, std::string_view headline,
                                   const std::vector<std::string>& culprits, const std::vector<std::string>& ranks,
                                   const std::vector<std::string>& files);

// What a diagnosis block printed earlier lacks: `now` is the same block re-rendered after more
// ranks ended (their lines amended). Empty when nothing changed; else a header naming the host
// and the lines of `now` that `printed` does not hold, for a node that printed its block at the
// first failure and cannot take it back.
std::string format_diagnosis_amendment(std::string_view printed, std::string_view now);

// The bordered root-cause block (torchrun's ChildFailedError layout, with the exit code or the
// signal name spelled out): `others` under "Failures:" as [1], [2], ... (further ranks of the
// same attempt that failed on their own, in exit order), then the root cause as [0].
std::string format_failure_summary(std::string_view command, std::string_view host, const FailureReport& root,
                                   const std::vector<FailureReport>& others);

// What torchrun's own @record writes to the launcher's TORCHELASTIC_ERROR_FILE (`path`, from
// ddprun's environment) when the job fails: the root-cause rank's error file, its message given
// an "errorCode" (the exit code, or minus the signal), when that rank ran here and wrote one;
// else, with `own_error`, ddprun's own failure (rendezvous timeout, unreachable server, bad
// flag) in torch's format. Nothing otherwise. The file is replaced (unlinked, then created
// without following a link). Never throws; a file that cannot be written is logged.
void write_launcher_error_file(const std::string& path, const FailureReport* root, const std::string& own_error);

// The most of an error file read: a worker's traceback is kilobytes; more is not one.
inline constexpr std::size_t kMaxErrorFileBytes = 1024 * 1024;

// Reads `report.error_file` (when set and present) into `report.error`; a file that cannot be
// used (not a regular file, a symbolic link, over kMaxErrorFileBytes, not torch's JSON) adds why
// to `report.note`. Never blocks (a FIFO is refused).
void load_error_file(FailureReport& report);

// The message of the error file at `path`; "" when there is none or it cannot be used.
std::string error_file_message(const std::string& path);

}  // namespace ddprun::agent
