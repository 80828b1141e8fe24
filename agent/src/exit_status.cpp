// Exit status descriptions; see exit_status.hpp.
#include "ddprun/agent/exit_status.hpp"

#include <cstring>

namespace ddprun::agent {

std::string signal_name(int sig) {
  // sigabbrev_np (glibc 2.32+) returns the name without "SIG"; nullptr for unknown numbers.
  const char* abbrev = ::sigabbrev_np(sig);
  if (abbrev == nullptr) {
    return "SIG" + std::to_string(sig);
  }
  return std::string("SIG") + abbrev;
}

std::string describe(const ExitStatus& status) {
  if (status.signal != 0) {
    return signal_name(status.signal) + " (signal " + std::to_string(status.signal) + ")";
  }
  return "exit code " + std::to_string(status.exit_code);
}

}  // namespace ddprun::agent
