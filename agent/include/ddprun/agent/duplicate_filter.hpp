#pragma once
// --duplicate-stdout-filters / --duplicate-stderr-filters (torchrun's semantics): every line a
// worker writes to the stream that contains any of the filter substrings is ALSO appended, with
// the rank's log-line prefix, to one file per attempt (<attempt>/filtered_stdout.log or
// filtered_stderr.log, shared by the local ranks, one write per line so ranks never interleave
// mid-line). The stream itself still goes where its route says (console, log file, both).
//
// duplicating_stream() builds the piped ChildStream that does both.
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ddprun/agent/child_process.hpp"
#include "ddprun/agent/output.hpp"

namespace ddprun::agent {

// A sink stream for `route` (inherit/file/tee/prefixed: the same destinations as without
// filters) that also copies matching lines to `filtered_path`. Files are opened here (append);
// throws ddprun::Error naming a file that cannot be opened.
ChildStream duplicating_stream(Route route, const std::string& log_path, const std::string& filtered_path,
                               int console_fd, std::string prefix, std::vector<std::string> filters);

}  // namespace ddprun::agent
