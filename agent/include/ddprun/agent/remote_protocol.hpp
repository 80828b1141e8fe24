#pragma once
// The remote-agent stdin protocol, both ends: what a fan-out launcher (launcher/fanout.cpp)
// writes on an ssh session's stdin and stdout, and what `ddprun --remote-agent`
// (launcher/main.cpp, agent.cpp) reads. Values never appear on the remote command line (ps
// shows it to every user).
//
//   stdin  1. the env block: entries "NAME=VALUE\0", ended by an empty entry (one more "\0");
//          2. the control channel: "S<signo>\n" lines, each asking the agent to act as if it
//             had received that signal; EOF means the launcher or its connection is gone.
//   stdout kRemoteAgentReadyLine on a line of its own once the agent has read its environment.
//
// Pure except read_env_block (reads a file descriptor). Classes are single-owner, not thread
// safe. A malformed env block throws ddprun::Error naming the stdin env block; a malformed
// control line is reported as a value.
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ddprun::agent {

using RemoteEnv = std::vector<std::pair<std::string, std::string>>;

// The line a remote agent writes on its stdout once it has read its environment: the launcher
// counts the host as connected (and frees an in-flight slot) when it arrives.
inline constexpr std::string_view kRemoteAgentReadyLine = "ddprun-remote-agent-ready";

// [A-Za-z_][A-Za-z0-9_]*
bool is_env_name(std::string_view name);

// "N1=V1\0N2=V2\0\0". Throws UsageError on an invalid name or a value containing NUL.
std::string encode_env_block(const RemoteEnv& entries);

inline constexpr std::size_t kDefaultEnvBlockMax = 1 << 20;

// Incremental decoder of an env block. feed() consumes bytes up to and including the
// terminator and returns how many it consumed: bytes after the terminator belong to the
// control channel and are left to the caller. Throws ddprun::Error on an entry without '=',
// an invalid name, or when the block grows past max_bytes.
class EnvBlockReader {
 public:
  explicit EnvBlockReader(std::size_t max_bytes = kDefaultEnvBlockMax) : max_bytes_(max_bytes) {}
  std::size_t feed(std::string_view bytes);
  bool done() const { return done_; }
  const RemoteEnv& entries() const { return entries_; }

 private:
  std::size_t max_bytes_;
  std::size_t total_ = 0;
  std::string current_;
  RemoteEnv entries_;
  bool done_ = false;
};

// Whole-buffer form: the entries of the block at the start of `bytes`; `consumed` (if not null)
// receives the block's length. Throws ddprun::Error when the terminator is missing.
RemoteEnv decode_env_block(std::string_view bytes, std::size_t* consumed = nullptr,
                           std::size_t max_bytes = kDefaultEnvBlockMax);

// Blocking read of an env block from `fd` (retries EINTR). Reads in chunks, so it may read past
// the terminator: those bytes are returned in `rest` (the start of the control channel).
// Throws ddprun::Error on EOF before the terminator, a read error, or a block over max_bytes.
struct EnvBlock {
  RemoteEnv entries;
  std::string rest;
};
EnvBlock read_env_block(int fd, std::size_t max_bytes = kDefaultEnvBlockMax);

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
