// The remote agent's control channel parser; see control_channel.hpp.
#include "ddprun/agent/control_channel.hpp"

#include <algorithm>

#include "ddprun/common/strings.hpp"

namespace ddprun::agent {

std::string encode_control_signal(int signo) { return "S" + std::to_string(signo) + "\n"; }

ControlReader::Result ControlReader::feed(std::string_view bytes) {
  constexpr std::size_t kMaxLine = 16;
  Result r;
  for (char c : bytes) {
    if (error_) break;
    if (c != '\n') {
      line_.push_back(c);
      if (line_.size() > kMaxLine) {
        error_ = "control channel: line longer than " + std::to_string(kMaxLine) + " bytes";
      }
      continue;
    }
    const std::string_view digits = line_.size() > 1 ? std::string_view(line_).substr(1) : std::string_view{};
    const bool ok_form = !line_.empty() && line_.front() == 'S' && !digits.empty() && digits.size() <= 3 &&
                         std::all_of(digits.begin(), digits.end(), [](char d) { return d >= '0' && d <= '9'; });
    const auto v = ok_form ? parse_int(digits) : std::nullopt;
    if (!v || *v < 1 || *v > 64) {
      error_ = "control channel: malformed line '" + line_ + "' (expected S<signal number>)";
      break;
    }
    r.signals.push_back(static_cast<int>(*v));
    line_.clear();
  }
  r.error = error_;
  return r;
}

}  // namespace ddprun::agent
