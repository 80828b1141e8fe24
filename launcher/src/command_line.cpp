#include "ddprun/launcher/command_line.hpp"

#include <sched.h>
#include <unistd.h>

#include <cerrno>

#include "ddprun/common/error.hpp"
#include "ddprun/common/logging.hpp"
#include "ddprun/common/strings.hpp"
#include "ddprun/common/version.hpp"
#include "ddprun/launcher/values.hpp"
#include "parsed_flags.hpp"

extern char** environ;  // NOLINT: POSIX

namespace ddprun::launcher {

ParseContext ParseContext::from_process() {
  ParseContext ctx;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string_view kv(*e);
    const auto eq = kv.find('=');
    if (eq == std::string_view::npos) continue;
    ctx.env.emplace(std::string(kv.substr(0, eq)), std::string(kv.substr(eq + 1)));
  }
  std::error_code ec;
  ctx.cwd = std::filesystem::current_path(ec);
  if (ec) {
    // A deleted working directory: relative paths cannot be resolved, say so where it happens.
    ctx.cwd = "/";
  }
  ctx.probe_gpus = [](const worker_env::EnvMap& env) { return worker_env::probe_gpus(env); };
  return ctx;
}

int ParseContext::cpus() const {
  if (online_cpus > 0) return online_cpus;
  // The CPUs this process may run on, so that taskset, a cpuset or a Slurm allocation count, not
  // all the machine's (torch 2.6's os.cpu_count() counts all: docs/cli.md says so).
  for (int n = 1024; n <= (1 << 16); n *= 4) {
    cpu_set_t* set = CPU_ALLOC(static_cast<unsigned>(n));
    if (set == nullptr) break;
    const std::size_t bytes = CPU_ALLOC_SIZE(static_cast<unsigned>(n));
    const int r = ::sched_getaffinity(0, bytes, set);
    const int count = r == 0 ? CPU_COUNT_S(bytes, set) : 0;
    CPU_FREE(set);
    if (r == 0 && count > 0) return count;
    if (r != 0 && errno != EINVAL) break;  // EINVAL: the set is smaller than the kernel's
  }
  const long n = ::sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

LaunchOptions parse_command_line(const std::vector<std::string>& args, const ParseContext& context) {
  detail::ParsedFlags p(context);
  LaunchOptions out;
  if (auto help = p.parse(detail::expand_abbreviations(args))) {
    out.command = CommandKind::help;
    out.text = std::move(*help);
    return out;
  }
  if (p.flag("version")) {
    out.command = CommandKind::version;
    out.text = std::string("ddprun ") + version_string + "\n";
    return out;
  }
  if (auto g = p.given("print-completion")) {
    const std::string shell = to_lower(trim(g->text));
    if (shell != "bash" && shell != "zsh") {
      throw UsageError(g->what + "=" + g->text + (shell == "tcsh" ? ": tcsh is not supported yet" : ": not a shell"),
                       "accepted values: bash or zsh");
    }
    out.command = CommandKind::completion;
    out.text = shell;  // main renders the script (launcher/tools: the same as the installed ones)
    return out;
  }

  if (auto g = p.given("log-level")) {
    out.log_level = parse_log_level_value(g->text, g->what);
  } else {
    for (const char* name : {"DDPRUN_LOG_LEVEL", "LOGLEVEL"}) {
      if (auto v = p.env(name); v && !trim(*v).empty()) {
        if (auto lvl = parse_log_level(*v)) {
          out.log_level = *lvl;
        } else {
          out.notes.push_back(std::string(name) + "=" + *v + " is not a log level; using info");
        }
        break;
      }
    }
  }

  bool fanout = false;
  for (const auto& spec : launcher_flags()) fanout = fanout || (spec.scope == FlagScope::host_list && p.present(spec));
  if (fanout) {
    detail::resolve_fanout(p, p.remaining(), out);
  } else {
    detail::resolve_agent(p, p.remaining(), out);
  }
  return out;
}

LaunchOptions parse_command_line(int argc, const char* const* argv, const ParseContext& context) {
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
  return parse_command_line(args, context);
}

}  // namespace ddprun::launcher
