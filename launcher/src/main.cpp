// ddprun: parse the command line into an AgentConfig, then run the per-node agent. Everything
// of substance lives in ddprun::launcher (parsing) and ddprun::agent (running).
#include <spdlog/spdlog.h>

#include <exception>
#include <iostream>
#include <string>
#include <string_view>
#include <vector>

#include "ddprun/agent/agent.hpp"
#include "ddprun/common/error.hpp"
#include "ddprun/common/logging.hpp"
#include "ddprun/launcher/command_line.hpp"
#include "ddprun/launcher/status_command.hpp"

namespace {

constexpr int kExitUsage = 2;
constexpr int kExitError = 1;

int run(int argc, char** argv) {
  const auto context = ddprun::launcher::ParseContext::from_process();
  if (argc >= 2 && std::string_view(argv[1]) == "status") {
    // `ddprun status ...` (a training program literally named "status" needs ./status).
    const std::vector<std::string> args(argv + 2, argv + argc);
    const auto request = ddprun::launcher::parse_status_args(args, context.env);
    if (request.help) {
      std::cout << ddprun::launcher::status_usage();
      return 0;
    }
    ddprun::setup_logging("ddprun", spdlog::level::warn);
    return ddprun::launcher::run_status(request, std::cout);
  }
  const auto options = ddprun::launcher::parse_command_line(argc, argv, context);
  if (options.action != ddprun::launcher::Action::run) {
    std::cout << options.text;
    if (!options.text.empty() && options.text.back() != '\n') std::cout << '\n';
    return 0;
  }
  ddprun::setup_logging("ddprun", options.log_level);
  for (const auto& note : options.notes) spdlog::info("{}", note);
  if (options.config.dry_run) {
    ddprun::agent::print_dry_run(options.config, std::cout);
    std::cout.flush();
    return 0;
  }
  return ddprun::agent::run_agent(options.config);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const ddprun::UsageError& e) {
    std::cerr << "ddprun: error: " << e.what() << '\n';
    if (e.hint().find("--help") == std::string::npos) std::cerr << "ddprun: run 'ddprun --help' for usage\n";
    return kExitUsage;
  } catch (const ddprun::Error& e) {
    std::cerr << "ddprun: error: " << e.what() << '\n';
    return kExitError;
  } catch (const std::exception& e) {
    std::cerr << "ddprun: internal error: " << e.what() << '\n';
    return kExitError;
  }
}
