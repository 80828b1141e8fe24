#pragma once
// The ddprun command line: torchrun's flags (each in the dash and the underscore spelling, each
// with its PET_<NAME> environment form, torchrun's defaults) plus ddprun's extras, turned into a
// validated agent::AgentConfig.
//
// Precedence for every value: the flag on the command line, then PET_<NAME> (an empty PET value
// counts as unset), then the default. Parsing stops at the training program: the first
// positional argument and everything after it belong to the program, untouched.
//
// parse_command_line is pure apart from stat()-ing the filesystem to find the program: the
// environment, working directory and CPU count come in through ParseContext, so tests drive it
// without processes. Throws ddprun::UsageError (exit code 2) for bad input, naming the flag (or
// PET_* variable) and the accepted forms. Thread-compatible; no global state.
#include <spdlog/common.h>

#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "ddprun/agent/config.hpp"
#include "ddprun/launcher/fanout.hpp"
#include "ddprun/worker_env/gpus.hpp"

namespace ddprun::launcher {

// What the parse may look at besides argv.
struct ParseContext {
  std::map<std::string, std::string> env;  // the process environment
  std::filesystem::path cwd;               // relative program paths are resolved here
  // For --nproc-per-node=cpu|auto; 0: ask the system when needed (cpus()): sysconf reads a sysfs
  // file, ~20 µs not worth spending on every launch.
  int online_cpus = 0;
  // Lists the node's GPUs (worker_env::probe_gpus in from_process()). Called at most once, and
  // only when GPUs matter (--nproc-per-node gpu|auto, --gpus, --gpu-isolation,
  // --virtual-local-rank). Unset: no GPU inventory (tests inject a fake one here).
  std::function<worker_env::GpuInventory(const worker_env::EnvMap&)> probe_gpus;

  // online_cpus, or when it is 0 the count of CPUs this process may run on (its affinity mask,
  // as torchrun; at least 1).
  int cpus() const;

  // The running process's environment and working directory.
  static ParseContext from_process();
};

// What the command line asks for: run a job (this node's agent, or the fan-out launcher), or
// print help or the version.
enum class CommandKind { run, help, version, completion };

struct LaunchOptions {
  CommandKind command = CommandKind::run;
  std::string text;  // what to print for CommandKind::help / CommandKind::version
  agent::AgentConfig config;
  // Set for `--hostfile` / `--hosts`: this ddprun is the fan-out launcher (fanout.hpp); `config`
  // then only carries dry_run.
  std::optional<FanoutPlan> fanout;
  spdlog::level::level_enum log_level = spdlog::level::info;
  // Informational lines for the log once logging is set up (ignored values, no-op flags).
  std::vector<std::string> notes;
};

// `args` excludes the program name (argv[0]).
LaunchOptions parse_command_line(const std::vector<std::string>& args, const ParseContext& context);
LaunchOptions parse_command_line(int argc, const char* const* argv, const ParseContext& context);

}  // namespace ddprun::launcher
