#pragma once
// The control channel of a remote agent (ddprun --remote-agent): after the environment block
// (launcher/remote_env.hpp), the fan-out launcher writes "S<signo>\n" lines on the ssh session's
// stdin, each asking the agent to act as if it had received that signal; EOF means the launcher
// or its connection is gone. Pure; single owner, not thread safe.
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ddprun::agent {

// Control channel encoder: "S<signo>\n".
std::string encode_control_signal(int signo);

// Incremental control-channel parser. feed() returns the signals of the complete lines in
// `bytes`; a malformed line (not S followed by 1..3 digits, signo outside 1..64, or over 16
// bytes without '\n') sets error() and the reader ignores everything after it.
class ControlReader {
 public:
  struct Result {
    std::vector<int> signals;
    std::optional<std::string> error;  // set once, on the first malformed line
  };
  Result feed(std::string_view bytes);
  const std::optional<std::string>& error() const { return error_; }

 private:
  std::string line_;
  std::optional<std::string> error_;
};

}  // namespace ddprun::agent
