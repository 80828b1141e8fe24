#pragma once
// RateLimitedWarning: a warning that may repeat once per connection under attack (a flood of
// refused connections, clients that do not read) is logged at most `burst` times a window (one
// second unless told), and the next line shown after a window says how many were suppressed.
// flush() says it when no next line comes (the flood stopped, the owner is done); an owner with an
// event loop learns through on_suppressing when to arm a timer for it. Header-only; not
// thread-safe (one per event loop).
#include <spdlog/spdlog.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>
#include <string_view>
#include <utility>

namespace ddprun {

struct RateLimitedWarning {
  std::chrono::steady_clock::time_point last{};  // the start of the current window
  std::size_t suppressed = 0;
  // Lines a window shows before it suppresses: a burst of distinct real events (every rank's
  // timer expiring at once) is shown whole, a flood is not.
  std::size_t burst = 1;
  std::size_t in_window = 0;
  std::chrono::steady_clock::duration window = std::chrono::seconds(1);
  // When the first line not shown was suppressed (what the count covers).
  std::chrono::steady_clock::time_point first_suppressed{};
  // Called when a line is suppressed and none was before it (the count starts): an owner that
  // cannot count on a next line arms a timer here that calls flush() (flush_delay() is when).
  std::function<void()> on_suppressing{};

  template <class... Args>
  void warn(fmt::format_string<Args...> format, Args&&... args) {
    log(spdlog::level::warn, format, std::forward<Args>(args)...);
  }

  // The same at another level (an error line a peer can make repeat).
  template <class... Args>
  void log(spdlog::level::level_enum level, fmt::format_string<Args...> format, Args&&... args) {
    const auto now = std::chrono::steady_clock::now();
    if (last != std::chrono::steady_clock::time_point{} && now - last < window) {
      if (in_window >= burst) {
        if (suppressed++ == 0) {
          first_suppressed = now;
          if (on_suppressing) on_suppressing();
        }
        return;
      }
      ++in_window;
      spdlog::log(level, format, std::forward<Args>(args)...);
      return;
    }
    std::string text = fmt::format(format, std::forward<Args>(args)...);
    if (suppressed > 0) text += " (" + not_shown(now) + ")";
    spdlog::log(level, "{}", text);
    last = now;
    suppressed = 0;
    in_window = 1;
  }

  // "WHAT: N more like it not shown over the last T s", when lines were suppressed since the last
  // one shown; then the count starts again.
  void flush(spdlog::level::level_enum level, std::string_view what) {
    if (suppressed == 0) return;
    spdlog::log(level, "{}: {}", what, not_shown(std::chrono::steady_clock::now()));
    suppressed = 0;
  }

  // How long an owner's timer waits before it flushes: two windows, so that in a flood that goes
  // on the next line shown carries the count (and the next suppression re-arms the timer) and
  // the flush says it only once the flood has stopped.
  std::chrono::steady_clock::duration flush_delay() const { return 2 * window; }

 private:
  std::string not_shown(std::chrono::steady_clock::time_point now) const {
    const double over = std::chrono::duration<double>(now - first_suppressed).count();
    return fmt::format("{} more like it not shown over the last {:.1f} s", suppressed, over);
  }
};

}  // namespace ddprun
