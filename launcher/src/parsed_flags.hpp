#pragma once
// Internal to the launcher library: the command line after CLI11 has read it (ParsedFlags), and
// the two resolvers that turn it into what ddprun runs: resolve_agent (this node's agent config)
// and resolve_fanout (the SSH fan-out plan). Both read values through ParsedFlags::given/flag,
// which apply the precedence flag > PET_* > default, and each value is parsed by exactly one
// function of values.hpp.
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ddprun/launcher/command_line.hpp"
#include "ddprun/launcher/flags.hpp"

namespace CLI {
class App;
class Option;
}  // namespace CLI

namespace ddprun::launcher::detail {

class ParsedFlags {
 public:
  explicit ParsedFlags(const ParseContext& context);
  ~ParsedFlags();
  ParsedFlags(const ParsedFlags&) = delete;
  ParsedFlags& operator=(const ParsedFlags&) = delete;

  // Reads ddprun's part of `expanded` (expand_abbreviations' output). The common launch's forms
  // — known long and short flags, each value its own word or attached, the program after them —
  // are read here without CLI11 (building a CLI11 app costs more than the rest of the parse, and
  // its first option initialises the C++ locale: ~0.1 ms of every launch); anything else (help,
  // an unknown option, a missing or empty value, a value word that starts with '-', grouped
  // short flags, a boolean with "=") by CLI11 with every flag defined, with its usual messages. `with_cli11` forces the
  // latter (for the test that both agree). Returns the help text for --help/-h; throws UsageError on a parse error.
  std::optional<std::string> parse(const std::vector<std::string>& expanded, bool with_cli11 = false);
  // Whether parse() needed CLI11.
  bool read_with_cli11() const { return app_ != nullptr; }
  // The program part of the command line as CLI11 leaves it (a leading "--" kept).
  const std::vector<std::string>& remaining() const { return remaining_; }

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
  // Defines the flags of launcher_flags() on a CLI11 app: every one.
  void define();
  // The reading without CLI11; false (nothing read) when the words need CLI11.
  bool parse_simple(const std::vector<std::string>& expanded);

  const ParseContext& context_;
  std::unique_ptr<CLI::App> app_;                                  // only for what parse_simple leaves to CLI11
  std::map<std::string, std::string> storage_;                     // a value flag's last value
  std::map<std::string, std::vector<std::string>> multi_storage_;  // a repeated flag's values
  std::map<std::string, int> count_;                               // how often each flag was given on the command line
  std::map<std::string, std::pair<CLI::Option*, const FlagSpec*>> options_;
  std::vector<std::string> remaining_;
};

// argparse (and so torchrun) accepts unambiguous abbreviations of long options: --nproc 4 is
// --nproc_per_node 4. CLI11 does not, so they are expanded here, in ddprun's part of the command
// line only (up to the program or "--"). A prefix that torch 1.13's or 2.6's torchrun reads as
// exactly one of its flags means that flag even where ddprun-only flags share the prefix
// (--node, --log, --re, --h); other prefixes must match exactly one ddprun flag.
std::vector<std::string> expand_abbreviations(const std::vector<std::string>& args);

// The program part of the command line (`remaining` as CLI11 left it), with the "--" argparse
// drops: a leading one, else one right after the program; throws when it is empty or starts
// with an unknown option. `usage` is the hint for "no program".
std::vector<std::string> program_words(const std::vector<std::string>& remaining, const std::string& usage);

// This node's agent (no host list). Fills out.config and out.notes.
void resolve_agent(const ParsedFlags& p, const std::vector<std::string>& remaining, LaunchOptions& out);

// torchrun's flags that change nothing here (--monitor-interval, --start-method, --use-env,
// --logs-specs default): their values are checked as torchrun would and a note says so, for
// one node and for a host list alike. Returns --local-rank-arg's value (none when not given),
// which --use-env contradicts.
agent::AgentConfig::LocalRankArg check_no_effect_flags(const ParsedFlags& p, std::vector<std::string>& notes);

// `ddprun --hostfile/--hosts ... PROGRAM`: fills out.fanout (and out.config.dry_run).
void resolve_fanout(const ParsedFlags& p, const std::vector<std::string>& remaining, LaunchOptions& out);

}  // namespace ddprun::launcher::detail
