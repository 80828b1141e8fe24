#pragma once
// The environment the fan-out launcher carries to every remote agent: which launcher variables,
// env-file entries and --env flags make it up. The bytes that carry it on the ssh session's
// stdin (the env block, then the control channel) are agent/remote_protocol.hpp's, re-exported
// here.
//
// Everything here is pure except load_env_file (reads a file). Configuration errors throw
// ddprun::UsageError naming the flag or file:line.
#include <array>
#include <cstddef>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ddprun/agent/remote_protocol.hpp"

namespace ddprun::launcher {

using EnvEntries = agent::RemoteEnv;
using agent::decode_env_block;
using agent::encode_env_block;
using agent::EnvBlock;
using agent::EnvBlockReader;
using agent::kDefaultEnvBlockMax;
using agent::read_env_block;

// torch's agent settings: read by each host's agent, not set per worker, so --env and
// --env-file may carry them (TORCHELASTIC_* is reserved otherwise). All but the timer file come
// along by default too: a launcher started inside another job's worker has that job's
// TORCHELASTIC_TIMER_FILE (torch's agent sets it for its workers).
inline constexpr std::array<std::string_view, 4> kRemoteAgentSettings = {
    "TORCHELASTIC_ENABLE_FILE_TIMER", "TORCHELASTIC_TIMER_FILE", "TORCHELASTIC_HEALTH_CHECK_PORT",
    "TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT"};
// Launcher variables carried to every host by default. "X_*" matches names starting with "X_";
// other entries match exactly.
inline constexpr std::array<std::string_view, 17> kDefaultRemoteEnvPatterns = {
    "NCCL_*",
    "CUDA_*",
    "PYTHONPATH",
    "PATH",
    "LD_LIBRARY_PATH",
    "OMP_*",
    "TORCH_*",
    "GLOO_*",
    "PYTHON_EXEC",
    "VIRTUAL_ENV",
    "HF_*",
    "WANDB_*",
    "DDPRUN_LOG_LEVEL",
    "LOGLEVEL",
    "TORCHELASTIC_ENABLE_FILE_TIMER",
    "TORCHELASTIC_HEALTH_CHECK_PORT",
    "TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT"};
// Never carried by default even when a pattern above matches: the launcher's own device
// visibility says nothing about a remote host's devices.
inline constexpr std::array<std::string_view, 1> kDefaultRemoteEnvExceptions = {"CUDA_VISIBLE_DEVICES"};
// Never carried at all (and an error in --env / --env-file): the remote agent sets these per
// worker, a value from the launcher would be wrong or overwritten (kRemoteAgentSettings aside).
// PET_* are flags (give the flag: it is forwarded); TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE is
// --log-line-prefix-template, which remote lines do not use.
// DDPRUN_LAUNCH_TREE is the launch tree's own plan (fanout.hpp): a user's value would turn a host
// into a tree node.
inline constexpr std::array<std::string_view, 13> kReservedRemoteEnv = {
    "MASTER_ADDR",       "MASTER_PORT", "RANK",
    "LOCAL_RANK",        "WORLD_SIZE",  "GROUP_RANK",
    "LOCAL_WORLD_SIZE",  "ROLE_RANK",   "ROLE_WORLD_SIZE",
    "GROUP_WORLD_SIZE",  "PET_*",       "TORCHELASTIC_*",
    "DDPRUN_LAUNCH_TREE"};

// True when `name` matches `pattern` (exact, or "X_*" prefix).
bool env_name_matches(std::string_view name, std::string_view pattern);
using agent::is_env_name;

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
// name order). Reserved names in the env file or flags throw UsageError. A --env NAME whose NAME
// is not set here carries nothing: a note saying so goes to `notes` (when not null).
EnvEntries select_remote_env(const std::map<std::string, std::string>& launcher_env, const std::vector<EnvFlag>& flags,
                             const EnvEntries& env_file_entries, std::vector<std::string>* notes = nullptr);

}  // namespace ddprun::launcher
