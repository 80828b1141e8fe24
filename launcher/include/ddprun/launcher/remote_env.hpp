#pragma once
// The environment the fan-out launcher carries to every remote agent, and the two byte streams
// on the ssh session's stdin (see docs: SSH fan-out spec):
//   1. the env block: entries "NAME=VALUE\0", ended by an empty entry (one more "\0");
//   2. the control channel: "S<signo>\n" lines, each asking the agent to act as if it had
//      received that signal; EOF means the launcher is gone (agent/control_channel.hpp).
// Values never appear on the remote command line (ps shows it to every user).
//
// Everything here is pure except load_env_file (reads a file) and read_env_block (reads a file
// descriptor). Classes are single-owner, not thread safe. Configuration errors throw
// ddprun::UsageError naming the flag or file:line; a malformed env block throws ddprun::Error
// naming the stdin env block; a malformed control line is reported as a value (tier two).
#include <array>
#include <cstddef>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ddprun::launcher {

using EnvEntries = std::vector<std::pair<std::string, std::string>>;

// Launcher variables carried to every host by default. "X_*" matches names starting with "X_";
// other entries match exactly.
inline constexpr std::array<std::string_view, 14> kDefaultRemoteEnvPatterns = {
    "NCCL_*", "CUDA_*", "PYTHONPATH", "PATH",    "LD_LIBRARY_PATH",  "OMP_*",   "TORCH_*",
    "GLOO_*", "PYTHON_EXEC", "VIRTUAL_ENV", "HF_*", "WANDB_*", "DDPRUN_LOG_LEVEL", "LOGLEVEL"};
// Never carried by default even when a pattern above matches: the launcher's own device
// visibility says nothing about a remote host's devices.
inline constexpr std::array<std::string_view, 1> kDefaultRemoteEnvExceptions = {"CUDA_VISIBLE_DEVICES"};
// Never carried at all (and an error in --env / --env-file): the remote agent sets these per
// worker, a value from the launcher would be wrong or overwritten.
inline constexpr std::array<std::string_view, 12> kReservedRemoteEnv = {
    "MASTER_ADDR", "MASTER_PORT", "RANK",      "LOCAL_RANK",   "WORLD_SIZE", "GROUP_RANK",
    "LOCAL_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "PET_*", "TORCHELASTIC_*"};

// True when `name` matches `pattern` (exact, or "X_*" prefix).
bool env_name_matches(std::string_view name, std::string_view pattern);
// [A-Za-z_][A-Za-z0-9_]*
bool is_env_name(std::string_view name);

// Env file text -> entries in file order (a later duplicate is kept; select_remote_env lets the
// last one win). Lines: NAME=VALUE, optional "export " prefix, '#' comment lines, blank lines,
// CRLF ok. The value is trimmed; one pair of matching surrounding quotes ('..' or "..") is
// stripped, with no escape processing inside. A value that opens a quote it does not close is
// an error (multi-line values are not supported). `file_name` is used in messages.
EnvEntries parse_env_file_text(std::string_view text, std::string_view file_name);
EnvEntries load_env_file(const std::string& path);

// --env NAME (copy from the launcher's environment when set there) or --env NAME=VALUE (VALUE
// verbatim, may be empty).
struct EnvFlag {
  std::string name;
  std::optional<std::string> value;
  bool operator==(const EnvFlag&) const = default;
};
EnvFlag parse_env_flag(std::string_view text);

// The entries for the remote env block: launcher variables matching kDefaultRemoteEnvPatterns
// (minus exceptions and reserved names), then env-file entries, then --env flags; a later
// source wins. Each name appears once, at the position where it first appeared (defaults in
// name order). Reserved names in the env file or flags throw UsageError.
EnvEntries select_remote_env(const std::map<std::string, std::string>& launcher_env, const std::vector<EnvFlag>& flags,
                             const EnvEntries& env_file_entries);

// "N1=V1\0N2=V2\0\0". Throws UsageError on an invalid name or a value containing NUL.
std::string encode_env_block(const EnvEntries& entries);

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
  const EnvEntries& entries() const { return entries_; }

 private:
  std::size_t max_bytes_;
  std::size_t total_ = 0;
  std::string current_;
  EnvEntries entries_;
  bool done_ = false;
};

// Whole-buffer form: the entries of the block at the start of `bytes`; `consumed` (if not null)
// receives the block's length. Throws ddprun::Error when the terminator is missing.
EnvEntries decode_env_block(std::string_view bytes, std::size_t* consumed = nullptr,
                            std::size_t max_bytes = kDefaultEnvBlockMax);

// Blocking read of an env block from `fd` (retries EINTR). Reads in chunks, so it may read past
// the terminator: those bytes are returned in `rest` (the start of the control channel).
// Throws ddprun::Error on EOF before the terminator, a read error, or a block over max_bytes.
struct EnvBlock {
  EnvEntries entries;
  std::string rest;
};
EnvBlock read_env_block(int fd, std::size_t max_bytes = kDefaultEnvBlockMax);

}  // namespace ddprun::launcher
