#pragma once
// Internal to the launcher library: the command line after CLI11 has read it (ParsedFlags), and
// the two resolvers that turn it into what ddprun runs: resolve_agent (this node's agent config)
// and resolve_fanout (the SSH fan-out plan). Both read values through ParsedFlags::given/flag,
// which apply the precedence flag > PET_* > default, and each value is parsed by exactly one
// function of values.hpp.
#include <CLI/CLI.hpp>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ddprun/launcher/command_line.hpp"
#include "ddprun/launcher/flags.hpp"

namespace ddprun::launcher::detail {

class ParsedFlags {
 public:
  explicit ParsedFlags(const ParseContext& context);
  ParsedFlags(const ParsedFlags&) = delete;
  ParsedFlags& operator=(const ParsedFlags&) = delete;

  // Defines the flags of launcher_flags() on the CLI11 app: every one, or only those of `only`
  // (flags_named()). A flag that is not defined reads as not given on the command line; its
  // PET_* variable still counts.
  void define(const std::vector<const FlagSpec*>* only = nullptr);
  CLI::App& app() { return app_; }

  // The value of a flag by precedence, with the name to quote in errors; nullopt = default.
  struct Given {
    std::string text;
    std::string what;  // "--nnodes" or "PET_NNODES"
  };
  std::optional<Given> given(std::string_view dash) const;
  // A boolean flag: given on the command line, or its PET_* variable is a non-zero integer.
  bool flag(std::string_view dash) const;
  // Every value of a repeatable flag, in command-line order.
  std::vector<std::string> all(std::string_view dash) const;
  // Whether the flag was given at all, whatever its kind.
  bool present(const FlagSpec& spec) const;
  std::optional<std::string> env(const std::string& name) const;
  const ParseContext& context() const { return context_; }

 private:
  const ParseContext& context_;
  CLI::App app_{"", "ddprun"};
  std::map<std::string, std::string> storage_;
  std::map<std::string, std::vector<std::string>> multi_storage_;
  std::map<std::string, std::pair<CLI::Option*, const FlagSpec*>> options_;
};

// argparse (and so torchrun) accepts unambiguous abbreviations of long options: --nproc 4 is
// --nproc_per_node 4. CLI11 does not, so they are expanded here, in ddprun's part of the command
// line only (up to the program or "--").
std::vector<std::string> expand_abbreviations(const std::vector<std::string>& args);

// The flags that ddprun's part of `expanded` (expand_abbreviations' output) names, up to the
// program. Defining only these gives CLI11 the same parse as defining all 67 (each definition
// costs a comparison with every earlier one: most of the parsing time of a launch). nullopt when
// the words hold anything this scan does not read exactly as CLI11 does — help, an unknown
// option, a value that starts with '-', a missing value, grouped short flags —: then every flag
// is defined and CLI11 decides, with its usual messages.
std::optional<std::vector<const FlagSpec*>> flags_named(const std::vector<std::string>& expanded);

// The program part of the command line (`remaining` as CLI11 left it): a leading "--" dropped;
// throws when it is empty or starts with an unknown option. `usage` is the hint for "no program".
std::vector<std::string> program_words(const std::vector<std::string>& remaining, const std::string& usage);

// This node's agent (no host list). Fills out.config and out.notes.
void resolve_agent(const ParsedFlags& p, const std::vector<std::string>& remaining, LaunchOptions& out);

// `ddprun --hostfile/--hosts ... PROGRAM`: fills out.fanout (and out.config.dry_run).
void resolve_fanout(const ParsedFlags& p, const std::vector<std::string>& remaining, LaunchOptions& out);

}  // namespace ddprun::launcher::detail
