#include "parsed_flags.hpp"

// clang-format off
#include "lazy_iostream.hpp"  // before CLI11, which includes <iostream>
// clang-format on
#include <CLI/CLI.hpp>
#include <algorithm>
#include <set>
#include <stdexcept>

#include "ddprun/common/error.hpp"
#include "ddprun/common/strings.hpp"
#include "ddprun/common/version.hpp"
#include "ddprun/launcher/values.hpp"

namespace ddprun::launcher::detail {
namespace {

const FlagSpec* find_flag(std::string_view dash) {
  for (const auto& spec : launcher_flags()) {
    if (spec.dash == dash) return &spec;
  }
  return nullptr;
}

// The flags that have no PET_* form, for the footer ("except --a, --b and --c").
std::string flags_without_env_form() {
  std::vector<std::string> names;
  for (const auto& spec : launcher_flags()) {
    if (!spec.env_form && !spec.hidden) names.push_back("--" + std::string(spec.dash));
  }
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i) {
    out += (i == 0 ? "" : i + 1 == names.size() ? " and " : ", ") + names[i];
  }
  return out;
}

std::string footer() {
  return "The first argument that is not a ddprun option is the training program; it and everything\n"
         "after it are passed to the workers untouched. Program forms:\n"
         "  ddprun [options] train.py ARGS      PYTHON -u train.py ARGS   (PYTHON: $PYTHON_EXEC, else python3 on "
         "PATH)\n"
         "  ddprun [options] -m pkg.mod ARGS    PYTHON -u -m pkg.mod ARGS\n"
         "  ddprun [options] --run-path t.py    PYTHON -u -c <runpy.run_path> t.py ARGS\n"
         "  ddprun [options] ./prog ARGS        /abs/prog ARGS   (any executable; also with --no-python)\n"
         "\n"
         "Every option has a dash and an underscore spelling (--nproc-per-node, --nproc_per_node) and,\n"
         "except " +
         flags_without_env_form() +
         ", an environment form\n"
         "PET_<NAME> (PET_NPROC_PER_NODE=4; booleans: PET_STANDALONE=1). The flag wins over PET_*, which\n"
         "wins over the default.\n"
         "\n"
         "Exit codes: 0 success; the failing worker's own exit code (128+N for a worker killed by signal N);\n"
         "128+N when ddprun is stopped by signal N; 2 usage error; 1 other ddprun error.";
}

// Long options of the tools ddprun stands in for (DeepSpeed's runner, mpirun, horovodrun,
// accelerate) that would otherwise read as an abbreviation of a DIFFERENT ddprun flag: their
// users mean the peer tool's option, so a prefix match must not pick ours. Spelled with dashes;
// the underscore spelling is compared the same way.
struct PeerFlag {
  std::string_view name;
  std::string_view tool;
  std::string_view hint;
};
constexpr PeerFlag kPeerFlags[] = {
    {"launcher", "DeepSpeed's",
     "ddprun starts the remote agents over ssh itself (--hostfile/--hosts): drop --launcher; "
     "write --launcher-addr in full if you meant the address the hosts reach this launcher at"},
    {"prefix", "mpirun's",
     "drop it (the hosts run --remote-ddprun); write --prefix-output in full if you meant prefixed console lines"},
    {"np", "mpirun's and horovodrun's",
     "--np counts the processes of the whole job; ddprun takes --nproc-per-node (workers per node) with "
     "--nnodes or a host list (slots)"},
};

const PeerFlag* peer_flag(const std::string& name) {
  std::string dashed = name;
  std::replace(dashed.begin(), dashed.end(), '_', '-');
  for (const auto& peer : kPeerFlags) {
    if (peer.name == dashed) return &peer;
  }
  return nullptr;
}

// torchrun's long options in torch 1.13's run.py (spelled there with underscores only; ddprun
// reads either spelling everywhere), and those torch 2.6's adds.
constexpr std::string_view kTorchrun113Flags[] = {
    "help",       "nnodes",       "nproc-per-node",   "rdzv-backend", "rdzv-endpoint", "rdzv-id",     "rdzv-conf",
    "standalone", "max-restarts", "monitor-interval", "start-method", "role",          "module",      "no-python",
    "run-path",   "log-dir",      "redirects",        "tee",          "node-rank",     "master-addr", "master-port"};
constexpr std::string_view kTorchrun26Flags[] = {"local-addr", "local-ranks-filter", "logs-specs"};
// And those current torchrun's adds (run.py of 2026; not --print-completion, whose torch patch
// was not merged when this was written: ddprun has the flag, but --pr stays ambiguous).
constexpr std::string_view kTorchrunCurrentFlags[] = {
    "event-log-handler", "log-line-prefix-template", "duplicate-stdout-filters", "duplicate-stderr-filters",
    "numa-binding",      "signals-to-handle",        "shutdown-timeout",         "virtual-local-rank"};

// The torchrun flag that `prefix` abbreviates for argparse, in torch 1.13, else in 2.6, else in
// current torchrun (a prefix unique among a later set of flags is unique among an earlier one,
// which is a subset, or matches none of it: they never disagree); "" when none reads it as
// exactly one flag. A torchrun command line must mean the same under ddprun, so such a prefix
// wins over ddprun-only flags that share it (`--node 1` is --node-rank, whatever --node-* flags
// ddprun adds; `--v` is --virtual-local-rank, not --version).
std::string_view torchrun_abbreviation(std::string_view prefix) {
  for (const int level : {0, 1, 2}) {
    std::string_view found;
    int matches = 0;
    auto count = [&](std::string_view flag) {
      if (starts_with(flag, prefix) || starts_with(underscore_spelling(flag), prefix)) {
        ++matches;
        found = flag;
      }
    };
    for (const auto flag : kTorchrun113Flags) count(flag);
    if (level >= 1) {
      for (const auto flag : kTorchrun26Flags) count(flag);
    }
    if (level >= 2) {
      for (const auto flag : kTorchrunCurrentFlags) count(flag);
    }
    if (matches == 1) return found;
  }
  return {};
}

// argparse's reading of the word after a flag that takes a value: a word that starts with '-' is
// an option, so the flag has no value ("expected one argument"), except '-' alone, a word that
// looks like a negative number (-5, -.5, -1e-3: current argparse's test, a digit or '.' and a
// digit after the '-') and a word with a space. Taken as the value, an empty shell variable
// (--rdzv-id $JOB) would make the next flag the value and drop it: --rdzv-backend=c10d read as the
// run id.
void require_value_word(const std::vector<std::string>& words, std::size_t at, const std::string& flag) {
  if (at >= words.size()) return;  // no word at all: the parser says the value is missing
  const std::string& w = words[at];
  if (w.size() < 2 || w.front() != '-') return;
  if (w.find(' ') != std::string::npos) {
    // argparse first matches "--name=..." (or a prefix of a name) against its options; only a word
    // that names none and holds a space is a value.
    const auto eq = w.find('=');
    const std::string name =
        w.rfind("--", 0) == 0 ? w.substr(2, eq == std::string::npos ? std::string::npos : eq - 2) : std::string();
    const bool names_a_flag = !name.empty() && name.find(' ') == std::string::npos &&
                              std::any_of(launcher_flags().begin(), launcher_flags().end(), [&](const FlagSpec& f) {
                                return starts_with(f.dash, name) || starts_with(underscore_spelling(f.dash), name);
                              });
    if (!names_a_flag) return;
  }
  const auto digit = [&](std::size_t k) { return k < w.size() && w[k] >= '0' && w[k] <= '9'; };
  if (digit(1) || (w[1] == '.' && digit(2))) return;
  throw UsageError(flag + " expects a value, got the option " + w + " (an empty shell variable before it?)",
                   "give " + flag + " its value, or write " + flag + "=VALUE for a value that starts with '-'");
}

}  // namespace

ParsedFlags::ParsedFlags(const ParseContext& context) : context_(context) {}

ParsedFlags::~ParsedFlags() = default;

std::optional<std::string> ParsedFlags::parse(const std::vector<std::string>& expanded, bool with_cli11) {
  if (!with_cli11 && parse_simple(expanded)) return std::nullopt;
  define();
  try {
    std::vector<std::string> reversed(expanded.rbegin(), expanded.rend());
    app_->parse(reversed);
  } catch (const CLI::CallForHelp&) {
    return app_->help();
  } catch (const CLI::CallForAllHelp&) {
    return app_->help();
  } catch (const CLI::ParseError& e) {
    throw UsageError(e.what(), "run 'ddprun --help' for the accepted options");
  }
  for (const auto& [dash, option] : options_) count_[dash] = static_cast<int>(option.first->count());
  remaining_ = app_->remaining();
  return std::nullopt;
}

bool ParsedFlags::parse_simple(const std::vector<std::string>& expanded) {
  std::map<std::string, std::string> storage;
  std::map<std::string, std::vector<std::string>> multi;
  std::map<std::string, int> count;
  std::size_t i = 0;
  for (; i < expanded.size(); ++i) {
    const std::string& word = expanded[i];
    if (word == "--" || word.size() < 2 || word.front() != '-') break;  // the program starts here
    const FlagSpec* spec = nullptr;
    std::optional<std::string> value;  // attached: --name=VALUE, -xVALUE
    if (word[1] == '-') {
      const auto eq = word.find('=');
      const std::string name = word.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
      for (const auto& s : launcher_flags()) {
        if (s.dash == name || underscore_spelling(s.dash) == name) spec = &s;
      }
      if (eq != std::string::npos) value = word.substr(eq + 1);
    } else {
      for (const auto& s : launcher_flags()) {
        if (!s.short_name.empty() && s.short_name == word.substr(1, 1)) spec = &s;
      }
      if (word.size() > 2) value = word.substr(2);
    }
    if (spec == nullptr) return false;  // --help, -h, or an option CLI11 must reject
    const std::string dash(spec->dash);
    if (spec->kind == FlagKind::boolean) {
      if (value) return false;  // --flag=VALUE, grouped short flags -xy: CLI11's reading
    } else {
      if (!value) {
        // A value word must not look like an option: CLI11 might read it as one.
        if (i + 1 >= expanded.size() || (!expanded[i + 1].empty() && expanded[i + 1].front() == '-')) return false;
        value = expanded[++i];
      }
      if (value->empty()) return false;  // --name=, --name "": CLI11's reading
      if (spec->kind == FlagKind::repeated) {
        multi[dash].push_back(*value);
      } else {
        storage[dash] = *value;  // the last one wins, as with CLI11's TakeLast
      }
    }
    ++count[dash];
  }
  storage_ = std::move(storage);
  multi_storage_ = std::move(multi);
  count_ = std::move(count);
  remaining_.assign(expanded.begin() + static_cast<std::ptrdiff_t>(i), expanded.end());
  return true;
}

void ParsedFlags::define() {
  ensure_iostreams();  // CLI11 may write to them (lazy_iostream.hpp)
  app_ = std::make_unique<CLI::App>("", "ddprun");
  options_.clear();
  app_->description("ddprun " + std::string(version_string) +
                    ": launch a distributed training job on this node (a drop-in for torchrun)");
  app_->prefix_command();
  app_->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app_->footer(footer());
  app_->get_formatter()->column_width(
      41);  // >= 2 spaces after every option name of this table (the docs drift test splits on them)
  // The usage line is "Usage: ddprun [" + label + "]": name the program part there too.
  app_->get_formatter()->label("OPTIONS", "OPTIONS] PROGRAM|-m MODULE [ARGS...");
  for (const auto& spec : launcher_flags()) {
    std::string names;
    if (!spec.short_name.empty()) names += "-" + std::string(spec.short_name) + ",";
    names += "--" + std::string(spec.dash);
    if (underscore_spelling(spec.dash) != spec.dash) names += ",--" + underscore_spelling(spec.dash);
    std::string help = help_with_default(spec);
    if (spec.env_form) help += " [env: " + pet_variable(spec.dash) + "]";
    CLI::Option* opt = nullptr;
    if (spec.kind == FlagKind::boolean) {
      opt = app_->add_flag(names)->description(help);  // (names, lvalue) would bind help as the result
    } else if (spec.kind == FlagKind::repeated) {
      opt = app_->add_option(names, multi_storage_[std::string(spec.dash)], help);
      opt->type_name(std::string(spec.metavar));
      opt->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
      opt->allow_extra_args(false);  // one value per occurrence: the program follows
    } else {
      opt = app_->add_option(names, storage_[std::string(spec.dash)], help);
      opt->type_name(std::string(spec.metavar));
    }
    if (spec.hidden) opt->group("");
    options_[std::string(spec.dash)] = {opt, &spec};
  }
}

std::vector<std::string> ParsedFlags::all(std::string_view dash) const {
  const auto it = multi_storage_.find(std::string(dash));
  return it == multi_storage_.end() ? std::vector<std::string>{} : it->second;
}

std::optional<ParsedFlags::Given> ParsedFlags::given(std::string_view dash) const {
  const FlagSpec* spec = find_flag(dash);
  if (spec == nullptr) throw std::logic_error("ParsedFlags::given: no flag --" + std::string(dash));
  if (const auto it = count_.find(std::string(dash)); it != count_.end() && it->second > 0) {
    return Given{storage_.at(std::string(dash)), "--" + std::string(dash)};
  }
  if (spec->env_form) {
    const std::string env = pet_variable(dash);
    if (auto it = context_.env.find(env); it != context_.env.end() && !trim(it->second).empty()) {
      return Given{it->second, env};
    }
  }
  return std::nullopt;
}

bool ParsedFlags::flag(std::string_view dash) const {
  const FlagSpec* spec = find_flag(dash);
  if (spec == nullptr) throw std::logic_error("ParsedFlags::flag: no flag --" + std::string(dash));
  if (const auto it = count_.find(std::string(dash)); it != count_.end() && it->second > 0) return true;
  if (spec->env_form) {
    const std::string env = pet_variable(dash);
    if (auto it = context_.env.find(env); it != context_.env.end() && !trim(it->second).empty()) {
      return parse_env_bool(it->second, env);
    }
  }
  return false;
}

bool ParsedFlags::present(const FlagSpec& spec) const {
  switch (spec.kind) {
    case FlagKind::boolean:
      return flag(spec.dash);
    case FlagKind::repeated:
      return !all(spec.dash).empty();
    case FlagKind::value:
      return given(spec.dash).has_value();
  }
  return false;
}

std::optional<std::string> ParsedFlags::env(const std::string& name) const {
  auto it = context_.env.find(name);
  if (it == context_.env.end()) return std::nullopt;
  return it->second;
}

std::vector<std::string> expand_abbreviations(const std::vector<std::string>& args) {
  std::vector<std::string> out = args;
  for (std::size_t i = 0; i < out.size(); ++i) {
    const std::string& arg = out[i];
    if (arg == "--" || arg.empty() || arg.front() != '-' || arg == "-") break;  // the program starts here
    if (!starts_with(arg, "--")) {
      // A short option takes its value from the next word unless it is attached (-r3, or -r=3
      // as argparse reads it: the value 3, made two words here for CLI11, which would read "=3").
      const FlagSpec* spec = nullptr;
      for (const auto& f : launcher_flags()) {
        if (f.short_name.empty() || arg.size() < 3 || f.short_name != arg.substr(1, 1)) continue;
        if (f.kind == FlagKind::boolean && arg[2] == '=') {  // -m=x: argparse's "ignored explicit argument"
          throw UsageError("-" + std::string(f.short_name) + " (--" + std::string(f.dash) +
                               ") is a switch and takes no value, got " + arg,
                           "write -" + std::string(f.short_name) + " alone");
        }
      }
      for (const auto& f : launcher_flags()) {
        if (!f.short_name.empty() && arg.size() >= 2 && f.short_name == arg.substr(1, 1) &&
            f.kind != FlagKind::boolean) {
          spec = &f;
        }
      }
      if (spec != nullptr && arg.size() == 2) {
        require_value_word(out, i + 1, arg);
        ++i;
      } else if (spec != nullptr && arg[2] == '=') {
        const std::string value = arg.substr(3);
        out[i] = arg.substr(0, 2);
        out.insert(out.begin() + static_cast<std::ptrdiff_t>(i) + 1, value);
        ++i;
      }
      continue;
    }
    const auto eq = arg.find('=');
    const bool empty_value = eq != std::string::npos && eq + 1 == arg.size();  // (arg changes below)
    const std::string as_given = arg;
    const std::string name = arg.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    const FlagSpec* match = nullptr;
    bool exact = name == "help";
    std::set<const FlagSpec*> prefixed;  // dash and underscore spellings of one flag count once
    std::string first_spelling;
    std::string candidates;
    for (const auto& spec : launcher_flags()) {
      for (const std::string& spelled : {std::string(spec.dash), underscore_spelling(spec.dash)}) {
        if (spelled == name) {
          exact = true;
          match = &spec;
        } else if (!name.empty() && starts_with(spelled, name) && !prefixed.contains(&spec)) {
          prefixed.insert(&spec);
          if (first_spelling.empty()) first_spelling = spelled;
          candidates += (candidates.empty() ? "--" : ", --") + spelled;
        }
      }
    }
    if (!exact && !name.empty() && prefixed.size() != 1) {
      // Ambiguous among ddprun's flags (or, for --help, matching none of them): what torchrun
      // makes of it decides, else it stays ambiguous.
      const std::string_view meant = torchrun_abbreviation(name);
      if (meant == "help") {  // CLI11's own, not in launcher_flags()
        out[i] = "--help" + (eq == std::string::npos ? std::string() : arg.substr(eq));
        continue;
      }
      if (!meant.empty()) {
        const FlagSpec* spec = find_launcher_flag(meant);
        if (spec == nullptr) throw std::logic_error("torchrun's --" + std::string(meant) + " is not a ddprun flag");
        prefixed = {spec};
        first_spelling = std::string(meant);
      } else if (!prefixed.empty()) {
        throw UsageError("ambiguous option --" + name + " could match " + candidates, "spell the option out");
      }
    }
    if (!exact && !prefixed.empty()) {
      if (const PeerFlag* peer = peer_flag(name)) {
        throw UsageError(
            "--" + name + " is " + std::string(peer->tool) + " option, not an abbreviation of " + candidates,
            std::string(peer->hint));
      }
    }
    if (!exact && prefixed.size() == 1) {
      match = *prefixed.begin();
      out[i] = "--" + first_spelling + (eq == std::string::npos ? std::string() : arg.substr(eq));
    }
    if (match != nullptr && match->kind == FlagKind::boolean && eq != std::string::npos) {
      // argparse refuses a value for a switch ("ignored explicit argument"); CLI11 would read
      // --standalone=false as off and --no-python= as on.
      throw UsageError("--" + std::string(match->dash) + " is a switch and takes no value, got " + as_given,
                       "write --" + std::string(match->dash) + " alone to turn it on, or leave it out");
    }
    if (match != nullptr && match->kind != FlagKind::boolean && empty_value) {
      // --name= (a shell variable that was empty): the empty value, as argparse reads it, made
      // two words for CLI11, which would take the next word as the value instead.
      out[i].pop_back();
      out.insert(out.begin() + static_cast<std::ptrdiff_t>(i) + 1, std::string());
      ++i;
    } else if (match != nullptr && match->kind != FlagKind::boolean && eq == std::string::npos) {
      require_value_word(out, i + 1, "--" + std::string(match->dash));
      ++i;  // skip its value
    }
  }
  return out;
}

std::vector<std::string> program_words(const std::vector<std::string>& remaining, const std::string& usage) {
  std::vector<std::string> rest = remaining;
  const bool options_ended = !rest.empty() && rest.front() == "--";
  if (options_ended) rest.erase(rest.begin());
  if (rest.empty()) throw UsageError("no training program given", usage);
  if (!options_ended && rest.front().size() > 1 && rest.front().front() == '-') {
    throw UsageError("unknown option " + rest.front(), "run 'ddprun --help' for the accepted options");
  }
  // argparse drops the first "--" of a command line wherever it stands, and torchrun's program
  // is a positional: so a "--" right after the program (`train.py -- --lr 0.1`) is dropped, as
  // with torchrun 1.13 and 2.6 (Python 3.11 and 3.13 agree). Once a "--" came before the
  // program, or another word after it, every later "--" is the program's.
  if (!options_ended && rest.size() > 1 && rest[1] == "--") rest.erase(rest.begin() + 1);
  return rest;
}

}  // namespace ddprun::launcher::detail
