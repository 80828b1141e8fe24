// ddprun: parse the command line into an AgentConfig, then run the per-node agent. Everything
// of substance lives in ddprun::launcher (parsing) and ddprun::agent (running).
#include <fcntl.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstdlib>
#include <exception>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ddprun/agent/failure.hpp"
#include "ddprun/agent/agent.hpp"
#include "ddprun/common/console.hpp"
#include "ddprun/common/error.hpp"
#include "ddprun/common/logging.hpp"
#include "ddprun/agent/output.hpp"
#include "ddprun/launcher/command_line.hpp"
#include "ddprun/launcher/fanout.hpp"
#include "ddprun/agent/remote_protocol.hpp"
#include "ddprun/launcher/status_command.hpp"
#include "ddprun_page.hpp"
#include "lazy_iostream.hpp"

namespace {

constexpr int kExitUsage = 2;
constexpr int kExitError = 1;

// `ddprun --remote-agent ...`: started by a fan-out launcher over ssh (fanout.hpp). stdin first
// carries the environment block, then stays open as the launcher's control channel; the workers
// get /dev/null as stdin instead. A block holding a launch tree plan makes this process a tree
// node (`tree` set): it keeps the variables for the agent it starts instead of setting them.
int prepare_remote_agent(std::optional<std::string>& tree, ddprun::agent::RemoteEnv& env) {
  auto block = ddprun::agent::read_env_block(STDIN_FILENO);
  for (auto it = block.entries.begin(); it != block.entries.end();) {
    if (it->first == ddprun::launcher::kTreeEnvName) {
      tree = std::move(it->second);
      it = block.entries.erase(it);
    } else {
      ++it;
    }
  }
  if (tree) {
    env = std::move(block.entries);
  } else {
    for (const auto& [name, value] : block.entries) ::setenv(name.c_str(), value.c_str(), 1);
  }
  if (!block.rest.empty()) {
    // The launcher writes control lines only after the agent said it is ready.
    throw ddprun::Error("--remote-agent: unexpected bytes after the environment block on stdin");
  }
  const int control = ::fcntl(STDIN_FILENO, F_DUPFD_CLOEXEC, 3);
  const int devnull = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (control < 0 || devnull < 0 || ::dup2(devnull, STDIN_FILENO) != STDIN_FILENO) {
    throw ddprun::Error("--remote-agent: cannot set up stdin");
  }
  ::close(devnull);
  // On a line of its own even if the remote login's rc files printed something without a newline.
  // Direct: the first bytes on stdout, before anything is queued for the console.
  ddprun::agent::write_all(STDOUT_FILENO, "\n" + std::string(ddprun::agent::kRemoteAgentReadyLine) + "\n");
  return control;
}

bool status_command = false;  // `ddprun status`: not a launch, its errors are not a job's

// torchrun's main is decorated with @record: an error of the launcher itself goes to its
// TORCHELASTIC_ERROR_FILE, for the scheduler that set it.
void record_error(const std::string& what) {
  if (status_command) return;
  const char* path = std::getenv("TORCHELASTIC_ERROR_FILE");
  if (path != nullptr && *path != '\0') ddprun::agent::write_launcher_error_file(path, nullptr, what);
}

int run(int argc, char** argv) {
  int control_fd = -1;
  if (argc >= 2 && std::string_view(argv[1]) == "--remote-agent") {
    std::optional<std::string> tree;
    ddprun::agent::RemoteEnv env;
    control_fd = prepare_remote_agent(tree, env);
    if (tree) {
      // A launch tree node: this host's agent is the same command, started as a child.
      auto node = ddprun::launcher::decode_tree_node(*tree);
      const char* path = std::getenv("PATH");
      node.plan.ssh_command[0] = ddprun::launcher::node_ssh_client(node.plan.ssh_command[0], path ? path : "");
      ddprun::setup_logging("ddprun@" + node.self_label, static_cast<spdlog::level::level_enum>(node.plan.log_level));
      // argv[0] of this host's agent: the running binary's name (the exec itself goes through
      // /proc/self/exe, see run_tree_node); the kernel appends " (deleted)" once the file is gone.
      std::error_code ec;
      std::string self = std::filesystem::read_symlink("/proc/self/exe", ec).string();
      constexpr std::string_view deleted = " (deleted)";
      if (self.ends_with(deleted)) self.resize(self.size() - deleted.size());
      std::vector<std::string> agent_argv = {ec || self.empty() ? std::string(argv[0]) : self};
      agent_argv.insert(agent_argv.end(), argv + 1, argv + argc);
      return ddprun::launcher::run_tree_node(node, agent_argv, env, control_fd);
    }
    --argc;
    ++argv;  // parse the rest as usual (argv[0] is not an option)
  }
  auto context = ddprun::launcher::ParseContext::from_process();
  if (control_fd >= 0) {
    // The launcher gives a remote agent every setting on its command line; PET_* variables of
    // the remote login (a .bashrc with PET_HOSTFILE, say) must not change its meaning.
    std::erase_if(context.env, [](const auto& kv) { return kv.first.rfind("PET_", 0) == 0; });
  }
  if (argc >= 2 && std::string_view(argv[1]) == "status") {
    status_command = true;
    // `ddprun status ...` (a training program literally named "status" needs ./status).
    const std::vector<std::string> args(argv + 2, argv + argc);
    const auto request = ddprun::launcher::parse_status_args(args, context.env);
    if (request.help) {
      ddprun::launcher::lazy_cout() << ddprun::launcher::status_usage();
      return 0;
    }
    ddprun::setup_logging("ddprun", spdlog::level::warn);
    return ddprun::launcher::run_status(request, ddprun::launcher::lazy_cout(), ::isatty(STDOUT_FILENO) == 1);
  }
  auto options = ddprun::launcher::parse_command_line(argc, argv, context);
  if (options.command == ddprun::launcher::CommandKind::completion) {
    const auto page = ddprun::docs::ddprun_page();
    options.text =
        options.text == "zsh" ? ddprun::docs::render_zsh_completion(page) : ddprun::docs::render_bash_completion(page);
  }
  if (options.command != ddprun::launcher::CommandKind::run) {
    ddprun::launcher::lazy_cout() << options.text;
    if (!options.text.empty() && options.text.back() != '\n') ddprun::launcher::lazy_cout() << '\n';
    return 0;
  }
  const std::string label = options.config.node_label;
  ddprun::setup_logging(label.empty() ? std::string("ddprun") : "ddprun@" + label, options.log_level);
  // Notes that drop part of the user's input ("ignored: ...") are warnings; the rest information.
  for (const auto& note : options.notes) {
    spdlog::log(note.find("ignored: ") != std::string::npos ? spdlog::level::warn : spdlog::level::info, "{}", note);
  }
  if (options.fanout) {
    if (options.config.dry_run) {
      ddprun::console::drain();  // the notes above first
      ddprun::launcher::print_fanout_dry_run(*options.fanout, ddprun::launcher::lazy_cout());
      return 0;
    }
    options.fanout->log_level = static_cast<int>(options.log_level);
    return ddprun::launcher::run_fanout(*options.fanout);
  }
  options.config.control_fd = control_fd;
  if (options.config.dry_run) {
    ddprun::console::drain();  // the notes above first
    ddprun::agent::print_dry_run(options.config, ddprun::launcher::lazy_cout());
    ddprun::launcher::lazy_cout().flush();
    return 0;
  }
  return ddprun::agent::run_agent(options.config);
}

}  // namespace

int main(int argc, char** argv) {
  // An ignored SIGCHLD (SIG_IGN, or SA_NOCLDWAIT) survives exec: inherited from a parent that set
  // it, the kernel would reap ddprun's workers itself, and their exit statuses would be lost.
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;  // NOLINT
  ::sigaction(SIGCHLD, &dfl, nullptr);
  try {
    return run(argc, argv);
  } catch (const ddprun::UsageError& e) {
    ddprun::console::drain();  // after what the job printed
    ddprun::launcher::lazy_cerr() << "ddprun: error: " << e.what() << '\n';
    if (e.hint().find("--help") == std::string::npos)
      ddprun::launcher::lazy_cerr() << "ddprun: run 'ddprun --help' for usage\n";
    record_error(e.what());
    return kExitUsage;
  } catch (const ddprun::Error& e) {
    ddprun::console::drain();  // after what the job printed
    ddprun::launcher::lazy_cerr() << "ddprun: error: " << e.what() << '\n';
    record_error(e.what());
    return kExitError;
  } catch (const std::exception& e) {
    ddprun::console::drain();  // after what the job printed
    ddprun::launcher::lazy_cerr() << "ddprun: internal error: " << e.what() << '\n';
    record_error(std::string("internal error: ") + e.what());
    return kExitError;
  }
}
