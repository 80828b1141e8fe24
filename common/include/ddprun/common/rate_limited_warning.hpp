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
  std::chrono::steady_clock::time_point last{};  // the start of the current one-second window
  std::size_t suppressed = 0;
  // Lines a window shows before it suppresses: a burst of distinct real events (every rank's
  // timer expiring at once) is shown whole, a flood is not.
  std::size_t burst = 1;
  std::size_t in_window = 0;

  template <class... Args>
  void warn(fmt::format_string<Args...> format, Args&&... args) {
    log(spdlog::level::warn, format, std::forward<Args>(args)...);
  }

  // The same at another level (an error line a peer can make repeat).
  template <class... Args>
  void log(spdlog::level::level_enum level, fmt::format_string<Args...> format, Args&&... args) {
    const auto now = std::chrono::steady_clock::now();
    if (last != std::chrono::steady_clock::time_point{} && now - last < std::chrono::seconds(1)) {
      if (in_window >= burst) {
        ++suppressed;
        return;
      }
      ++in_window;
      spdlog::log(level, format, std::forward<Args>(args)...);
      return;
    }
    std::string text = fmt::format(format, std::forward<Args>(args)...);
    if (suppressed > 0) text += fmt::format(" ({} more like it in the last second not shown)", suppressed);
    spdlog::log(level, "{}", text);
    last = now;
    suppressed = 0;
    in_window = 1;
  }
};

}  // namespace ddprun
