#pragma once
// RateLimitedWarning: a warning that may repeat once per connection under attack (a flood of
// refused connections, clients that do not read) is logged at most once a second, with the
// number of repeats it suppressed. Header-only; not thread-safe (one per event loop).
#include <spdlog/spdlog.h>

#include <chrono>
#include <cstddef>
#include <string>
#include <utility>

namespace ddprun {

struct RateLimitedWarning {
  std::chrono::steady_clock::time_point last{};
  std::size_t suppressed = 0;

  template <class... Args>
  void warn(fmt::format_string<Args...> format, Args&&... args) {
    log(spdlog::level::warn, format, std::forward<Args>(args)...);
  }

  // The same at another level (an error line a peer can make repeat).
  template <class... Args>
  void log(spdlog::level::level_enum level, fmt::format_string<Args...> format, Args&&... args) {
    const auto now = std::chrono::steady_clock::now();
    if (last != std::chrono::steady_clock::time_point{} && now - last < std::chrono::seconds(1)) {
      ++suppressed;
      return;
    }
    std::string text = fmt::format(format, std::forward<Args>(args)...);
    if (suppressed > 0) text += fmt::format(" ({} more like it in the last second not shown)", suppressed);
    spdlog::log(level, "{}", text);
    last = now;
    suppressed = 0;
  }
};

}  // namespace ddprun
