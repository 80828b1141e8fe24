#pragma once
// Logging setup shared by every binary: spdlog to stderr (through console.hpp's writer threads:
// a stderr that stops reading does not stop the caller), level from --log-level /
// DDPRUN_LOG_LEVEL / LOGLEVEL (torchrun's variable), format from --log-format / DDPRUN_LOG_FORMAT.
//   text (default): "[<name> <level>] message", colored on a terminal.
//   json: one JSON object per line for log shippers (journald, Loki, Elasticsearch):
//     {"time":"2025-05-20T12:00:00.123456Z","level":"info","logger":"ddprun-rdzvd","pid":42,"message":"..."}
//   time is UTC with microseconds; level is spdlog's name (trace, debug, info, warning, error,
//   critical); the message is escaped so every line parses (control characters as \u00XX,
//   invalid UTF-8 bytes as U+FFFD).
// setup_logging() replaces the default logger; call it from main() before other threads log.
#include <spdlog/spdlog.h>

#include <memory>
#include <optional>
#include <string>
#include <string_view>

namespace ddprun {

enum class LogFormat { text, json };

// Parses "trace|debug|info|warning|warn|error|critical|off" (case-insensitive).
std::optional<spdlog::level::level_enum> parse_log_level(std::string_view text);

// Parses "text|json" (case-insensitive).
std::optional<LogFormat> parse_log_format(std::string_view text);

// Installs the default logger on stderr with `level` and `format`. Idempotent.
void setup_logging(std::string_view program_name, spdlog::level::level_enum level, LogFormat format);

// The same with the format from DDPRUN_LOG_FORMAT (text when unset or not text|json).
void setup_logging(std::string_view program_name, spdlog::level::level_enum level);

// Level from DDPRUN_LOG_LEVEL, then LOGLEVEL, else `fallback`.
spdlog::level::level_enum log_level_from_env(spdlog::level::level_enum fallback);

// Format from DDPRUN_LOG_FORMAT, else `fallback`.
LogFormat log_format_from_env(LogFormat fallback);

// The formatter setup_logging installs for `format` (for sinks of one's own, and tests).
std::unique_ptr<spdlog::formatter> make_log_formatter(LogFormat format);

}  // namespace ddprun
