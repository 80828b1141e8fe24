#include "ddprun/common/logging.hpp"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>

#include "ddprun/common/strings.hpp"

namespace ddprun {

std::optional<spdlog::level::level_enum> parse_log_level(std::string_view text) {
  const std::string t = to_lower(trim(text));
  if (t == "trace") return spdlog::level::trace;
  if (t == "debug") return spdlog::level::debug;
  if (t == "info") return spdlog::level::info;
  if (t == "warning" || t == "warn") return spdlog::level::warn;
  if (t == "error") return spdlog::level::err;
  if (t == "critical" || t == "fatal") return spdlog::level::critical;
  if (t == "off") return spdlog::level::off;
  return std::nullopt;
}

void setup_logging(std::string_view program_name, spdlog::level::level_enum level) {
  auto logger = spdlog::get(std::string(program_name));
  if (!logger) {
    logger = spdlog::stderr_color_mt(std::string(program_name));
  }
  logger->set_pattern("[%n %^%l%$] %v");
  logger->set_level(level);
  logger->flush_on(spdlog::level::warn);
  spdlog::set_default_logger(logger);
}

spdlog::level::level_enum log_level_from_env(spdlog::level::level_enum fallback) {
  for (const char* name : {"DDPRUN_LOG_LEVEL", "LOGLEVEL"}) {
    if (const char* v = std::getenv(name)) {
      if (auto lvl = parse_log_level(v)) return *lvl;
    }
  }
  return fallback;
}

}  // namespace ddprun
