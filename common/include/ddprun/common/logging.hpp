#pragma once
// Logging setup shared by every binary: spdlog to stderr, "[ddprun] " style prefixes,
// level from --log-level / DDPRUN_LOG_LEVEL / LOGLEVEL (torchrun's variable).
#include <spdlog/spdlog.h>

#include <optional>
#include <string>
#include <string_view>

namespace ddprun {

// Parses "trace|debug|info|warning|warn|error|critical|off" (case-insensitive).
std::optional<spdlog::level::level_enum> parse_log_level(std::string_view text);

// Installs the default logger: stderr, pattern "[<name> <level>] message". Idempotent.
void setup_logging(std::string_view program_name, spdlog::level::level_enum level);

// Level from DDPRUN_LOG_LEVEL, then LOGLEVEL, else `fallback`.
spdlog::level::level_enum log_level_from_env(spdlog::level::level_enum fallback);

}  // namespace ddprun
