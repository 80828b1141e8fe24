#include "ddprun/common/logging.hpp"

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/ansicolor_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>

#include "ddprun/common/console.hpp"
#include "ddprun/common/strings.hpp"

namespace ddprun {

namespace {

void append(spdlog::memory_buf_t& dest, std::string_view text) { dest.append(text.data(), text.data() + text.size()); }

// Length of the valid UTF-8 sequence starting at s[i], or 0 when the bytes there are not one
// (overlong forms, surrogates and code points above U+10FFFF are invalid too).
std::size_t utf8_sequence_length(std::string_view s, std::size_t i) {
  const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char b0 = byte(i);
  std::size_t len = 0;
  unsigned min = 0;
  unsigned cp = 0;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    len = 2, cp = b0 & 0x1Fu, min = 0x80;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    len = 3, cp = b0 & 0x0Fu, min = 0x800;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    len = 4, cp = b0 & 0x07u, min = 0x10000;
  } else {
    return 0;
  }
  if (i + len > s.size()) return 0;
  for (std::size_t k = 1; k < len; ++k) {
    if ((byte(i + k) & 0xC0u) != 0x80u) return 0;
    cp = (cp << 6) | (byte(i + k) & 0x3Fu);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  return len;
}

void append_json_string(spdlog::memory_buf_t& dest, std::string_view s) {
  static constexpr char kHex[] = "0123456789abcdef";
  dest.push_back('"');
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c == '"' || c == '\\') {
      dest.push_back('\\');
      dest.push_back(static_cast<char>(c));
    } else if (c == '\n') {
      append(dest, "\\n");
    } else if (c == '\r') {
      append(dest, "\\r");
    } else if (c == '\t') {
      append(dest, "\\t");
    } else if (c < 0x20 || c == 0x7F) {
      const char esc[] = {'\\', 'u', '0', '0', kHex[c >> 4], kHex[c & 0xF]};
      dest.append(esc, esc + sizeof esc);
    } else if (c < 0x80) {
      dest.push_back(static_cast<char>(c));
    } else if (const std::size_t len = utf8_sequence_length(s, i); len > 0) {
      dest.append(s.data() + i, s.data() + i + len);
      i += len;
      continue;
    } else {
      append(dest, "\xEF\xBF\xBD");  // U+FFFD for a byte that is not valid UTF-8
    }
    ++i;
  }
  dest.push_back('"');
}

// One JSON object per line. Field order is fixed (time, level, logger, pid, message) so that
// humans reading raw lines find the message last, as in the text format.
class JsonFormatter final : public spdlog::formatter {
 public:
  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    const auto since_epoch = msg.time.time_since_epoch();
    const auto secs = std::chrono::duration_cast<std::chrono::seconds>(since_epoch);
    const auto micros = std::chrono::duration_cast<std::chrono::microseconds>(since_epoch - secs).count();
    const std::time_t t = static_cast<std::time_t>(secs.count());
    std::tm tm{};
    ::gmtime_r(&t, &tm);
    char stamp[128];  // roomy enough for any int the compiler imagines in the fields
    std::snprintf(stamp, sizeof stamp, "%04d-%02d-%02dT%02d:%02d:%02d.%06ldZ", tm.tm_year + 1900, tm.tm_mon + 1,
                  tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<long>(micros));
    append(dest, "{\"time\":\"");
    append(dest, stamp);
    append(dest, "\",\"level\":");
    const auto level_name = spdlog::level::to_string_view(msg.level);
    append_json_string(dest, std::string_view(level_name.data(), level_name.size()));
    append(dest, ",\"logger\":");
    append_json_string(dest, std::string_view(msg.logger_name.data(), msg.logger_name.size()));
    append(dest, ",\"pid\":");
    append(dest, std::to_string(pid_));
    append(dest, ",\"message\":");
    append_json_string(dest, std::string_view(msg.payload.data(), msg.payload.size()));
    append(dest, "}\n");
  }
  std::unique_ptr<spdlog::formatter> clone() const override { return std::make_unique<JsonFormatter>(); }

 private:
  long pid_ = static_cast<long>(::getpid());
};

}  // namespace

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

std::optional<LogFormat> parse_log_format(std::string_view text) {
  const std::string t = to_lower(trim(text));
  if (t == "text") return LogFormat::text;
  if (t == "json") return LogFormat::json;
  return std::nullopt;
}

std::unique_ptr<spdlog::formatter> make_log_formatter(LogFormat format) {
  if (format == LogFormat::json) return std::make_unique<JsonFormatter>();
  return std::make_unique<spdlog::pattern_formatter>("[%n %^%l%$] %v");
}

void setup_logging(std::string_view program_name, spdlog::level::level_enum level, LogFormat format) {
  auto logger = spdlog::get(std::string(program_name));
  if (!logger) {
    // Through the console's writer thread (console.hpp): a stderr that stops reading must not
    // stop the caller's event loop. The sink writes a line at a time (it flushes each).
    static FILE* const console_stderr = [] {
      cookie_io_functions_t io{};
      io.write = [](void*, const char* data, std::size_t size) -> ssize_t {
        console::write(STDERR_FILENO, std::string_view(data, size));
        return static_cast<ssize_t>(size);
      };
      FILE* f = ::fopencookie(nullptr, "w", io);
      if (f != nullptr) ::setvbuf(f, nullptr, _IOFBF, 64 * 1024);
      return f;
    }();
    if (console_stderr != nullptr) {
      const bool colour = ::isatty(STDERR_FILENO) == 1 && spdlog::details::os::is_color_terminal();
      auto sink = std::make_shared<spdlog::sinks::ansicolor_sink<spdlog::details::console_mutex>>(
          console_stderr, colour ? spdlog::color_mode::always : spdlog::color_mode::never);
      logger = std::make_shared<spdlog::logger>(std::string(program_name), std::move(sink));
      spdlog::register_logger(logger);
    } else {
      logger = spdlog::stderr_color_mt(std::string(program_name));
    }
  }
  logger->set_formatter(make_log_formatter(format));
  logger->set_level(level);
  logger->flush_on(spdlog::level::warn);
  spdlog::set_default_logger(logger);
}

void setup_logging(std::string_view program_name, spdlog::level::level_enum level) {
  setup_logging(program_name, level, log_format_from_env(LogFormat::text));
}

spdlog::level::level_enum log_level_from_env(spdlog::level::level_enum fallback) {
  for (const char* name : {"DDPRUN_LOG_LEVEL", "LOGLEVEL"}) {
    if (const char* v = std::getenv(name)) {
      if (auto lvl = parse_log_level(v)) return *lvl;
    }
  }
  return fallback;
}

LogFormat log_format_from_env(LogFormat fallback) {
  if (const char* v = std::getenv("DDPRUN_LOG_FORMAT")) {
    if (auto format = parse_log_format(v)) return *format;
  }
  return fallback;
}

}  // namespace ddprun
