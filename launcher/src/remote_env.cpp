#include "ddprun/launcher/remote_env.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "ddprun/common/error.hpp"
#include "ddprun/common/strings.hpp"
#include "ddprun/launcher/hosts.hpp"

namespace ddprun::launcher {
namespace {

constexpr std::string_view kEnvFileForms =
    "lines NAME=VALUE (optionally 'export NAME=VALUE'), '#' comment lines, blank lines; VALUE may be "
    "wrapped in '...' or \"...\"";
constexpr std::string_view kEnvFlagForms = "NAME or NAME=VALUE, NAME matching [A-Za-z_][A-Za-z0-9_]*";

bool is_agent_setting(std::string_view name) {
  return std::find(kRemoteAgentSettings.begin(), kRemoteAgentSettings.end(), name) != kRemoteAgentSettings.end();
}

bool is_reserved(std::string_view name) {
  return !is_agent_setting(name) && std::any_of(kReservedRemoteEnv.begin(), kReservedRemoteEnv.end(),
                                                [&](std::string_view p) { return env_name_matches(name, p); });
}

void reject_reserved(std::string_view name, const std::string& where) {
  if (!is_reserved(name)) return;
  std::string why = "ddprun sets it for each worker; remove it";
  if (env_name_matches(name, "PET_*")) {
    why =
        "PET_ variables stand for ddprun's flags (PET_NNODES is --nnodes): give the flag on this command line "
        "instead, where it is checked, and forwarded to the hosts or refused with a host list";
  } else if (name == "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE") {
    why = "with a host list every relayed line is prefixed [host:RANK]:, whatever the template; remove it";
  } else if (name == "DDPRUN_LAUNCH_TREE") {
    why = "it is the launch tree's own plan; remove it";
  }
  throw UsageError(where + ": " + std::string(name) + " cannot be sent to the hosts", why);
}

// Adds or replaces, keeping the position of the first occurrence.
void upsert(EnvEntries& out, const std::string& name, const std::string& value) {
  const auto it = std::find_if(out.begin(), out.end(), [&](const auto& e) { return e.first == name; });
  if (it == out.end()) {
    out.emplace_back(name, value);
  } else {
    it->second = value;
  }
}

}  // namespace

bool env_name_matches(std::string_view name, std::string_view pattern) {
  if (!pattern.empty() && pattern.back() == '*') {
    const std::string_view prefix = pattern.substr(0, pattern.size() - 1);
    return name.size() > prefix.size() && starts_with(name, prefix);
  }
  return name == pattern;
}

EnvEntries parse_env_file_text(std::string_view text, std::string_view file_name) {
  EnvEntries out;
  int line_no = 0;
  for (const auto& raw : split(text, '\n')) {
    ++line_no;
    const std::string where = std::string(file_name) + ":" + std::to_string(line_no);
    auto fail = [&](const std::string& why) {
      throw UsageError(where + ": " + why, "accepted forms: " + std::string(kEnvFileForms));
    };
    std::string_view line = trim(raw);
    if (line.empty() || line.front() == '#') continue;
    if (line.find('\0') != std::string_view::npos) fail("contains a NUL byte");
    if (starts_with(line, "export") && line.size() > 6 && (line[6] == ' ' || line[6] == '\t')) {
      line = trim(line.substr(7));
    }
    const auto eq = line.find('=');
    if (eq == std::string_view::npos) fail("'" + std::string(line) + "' has no '='");
    const std::string name(trim(line.substr(0, eq)));
    if (!is_env_name(name)) fail("'" + name + "' is not a variable name ([A-Za-z_][A-Za-z0-9_]*)");
    reject_reserved(name, where);
    std::string_view value = trim(line.substr(eq + 1));
    if (!value.empty() && (value.front() == '"' || value.front() == '\'')) {
      if (value.size() < 2 || value.back() != value.front()) {
        fail("the value of " + name + " opens a " + std::string(1, value.front()) +
             " quote it does not close (multi-line values are not supported)");
      }
      value = value.substr(1, value.size() - 2);
    }
    out.emplace_back(name, std::string(value));
  }
  return out;
}

EnvEntries load_env_file(const std::string& path) {
  constexpr std::uintmax_t kMaxEnvFileBytes = 16U << 20;  // the block a host reads is 1 MiB
  return parse_env_file_text(
      read_flag_file("--env-file", path, kMaxEnvFileBytes, "an env file", "give a text file of NAME=VALUE lines"),
      path);
}

EnvFlag parse_env_flag(std::string_view text) {
  EnvFlag f;
  const auto eq = text.find('=');
  f.name = std::string(text.substr(0, eq));
  if (!is_env_name(f.name)) {
    throw UsageError("--env " + std::string(text) + ": '" + f.name + "' is not a variable name",
                     "accepted forms: " + std::string(kEnvFlagForms));
  }
  if (eq != std::string_view::npos) {
    const std::string_view value = text.substr(eq + 1);
    if (value.find('\0') != std::string_view::npos) {
      throw UsageError("--env " + f.name + ": the value contains a NUL byte", "remove it");
    }
    f.value = std::string(value);
  }
  reject_reserved(f.name, "--env " + f.name);
  return f;
}

EnvEntries select_remote_env(const std::map<std::string, std::string>& launcher_env, const std::vector<EnvFlag>& flags,
                             const EnvEntries& env_file_entries, std::vector<std::string>* notes) {
  EnvEntries out;
  for (const auto& [name, value] : launcher_env) {
    // (The name captured by value: clang before 16 cannot capture a structured binding.)
    const auto matches = [n = std::string_view(name)](std::string_view p) { return env_name_matches(n, p); };
    const bool wanted = std::any_of(kDefaultRemoteEnvPatterns.begin(), kDefaultRemoteEnvPatterns.end(), matches);
    const bool excepted = std::any_of(kDefaultRemoteEnvExceptions.begin(), kDefaultRemoteEnvExceptions.end(), matches);
    // A launcher variable with a NUL cannot exist; an invalid name (possible via env(1)) is skipped.
    if (wanted && !excepted && !is_reserved(name) && is_env_name(name)) out.emplace_back(name, value);
  }
  for (const auto& [name, value] : env_file_entries) {
    if (!is_env_name(name))
      throw UsageError("--env-file: '" + name + "' is not a variable name", std::string(kEnvFileForms));
    reject_reserved(name, "--env-file");
    upsert(out, name, value);
  }
  for (const auto& f : flags) {
    if (!is_env_name(f.name))
      throw UsageError("--env: '" + f.name + "' is not a variable name", std::string(kEnvFlagForms));
    reject_reserved(f.name, "--env " + f.name);
    if (f.value) {
      upsert(out, f.name, *f.value);
    } else if (const auto it = launcher_env.find(f.name); it != launcher_env.end()) {
      upsert(out, f.name, it->second);
    } else if (notes) {
      // As mpirun -x warns: the user asked for a value this shell does not have.
      notes->push_back("--env " + f.name + ": " + f.name +
                       " is not set here, so nothing is carried for it (the hosts' own value, if any, stays); "
                       "give --env " +
                       f.name + "=VALUE to set it");
    }
  }
  return out;
}

}  // namespace ddprun::launcher
