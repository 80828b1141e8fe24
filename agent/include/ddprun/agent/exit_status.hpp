#pragma once
// ExitStatus: how a child process ended (a worker, an ssh client), and its shell-style
// description. Pure values; shared by the agent's workers and the fan-out launcher's hosts.
#include <string>

namespace ddprun::agent {

// How a worker ended. `signal` != 0 means killed by that signal (exit_code is then unused).
struct ExitStatus {
  int exit_code = 0;
  int signal = 0;

  bool ok() const { return signal == 0 && exit_code == 0; }
  // The shell convention: the code itself, or 128 + signal.
  int shell_code() const { return signal != 0 ? 128 + signal : exit_code; }
  static ExitStatus exited(int code) { return {code, 0}; }
  static ExitStatus killed(int sig) { return {0, sig}; }
  friend bool operator==(const ExitStatus&, const ExitStatus&) = default;
};

// "SIGSEGV (signal 11)" or "exit code 7".
std::string describe(const ExitStatus& status);
// "SIGSEGV", or "SIG<n>" for numbers without a name.
std::string signal_name(int sig);

}  // namespace ddprun::agent
