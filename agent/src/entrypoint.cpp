// entrypoint_name(); see entrypoint.hpp.
#include "ddprun/agent/entrypoint.hpp"

namespace ddprun::agent {

std::string entrypoint_name(const AgentConfig& config) {
  const auto& argv = config.worker_argv;
  if (argv.empty()) return "";
  // worker_argv is {PYTHON, -u, SCRIPT, ARGS...}, {PYTHON, -u, -m, MODULE, ARGS...} or
  // {PYTHON, -u, -c, RUNPY, SCRIPT, ARGS...}: the word before the user's arguments names it.
  if (config.python_worker && config.user_args_index >= 2 && config.user_args_index <= argv.size()) {
    return argv[config.user_args_index - 1];
  }
  return argv.front();
}

}  // namespace ddprun::agent
