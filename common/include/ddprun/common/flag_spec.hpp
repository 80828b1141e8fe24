#pragma once
// FlagSpec: one row of a command-line flag table, as plain constexpr data. A binary keeps its
// flags in one table of these (ddprun's: ddprun::launcher::launcher_flags()), and everything that
// lists flags reads that table: the parser, --help, the lists of flags a mode refuses or forwards,
// and generators of man pages and shell completions. Nothing here parses or validates a value.
//
// Conventions: `dash` is the primary spelling without the leading "--"; every flag also has the
// underscore spelling (underscore_spelling) and, when `env_form` is set, the environment form
// PET_<NAME> (pet_variable), as torchrun derives them. Header-only, no state, thread-safe.
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace ddprun {

enum class FlagKind : std::uint8_t {
  value,     // takes one value; the last occurrence wins
  boolean,   // takes none
  repeated,  // takes one value per occurrence; every value is kept, in order
};

// Where a flag acts. ddprun is either the agent of one node or, with a host list, the fan-out
// launcher that starts one remote agent per host over ssh; the scope says what each flag means
// in each role.
enum class FlagScope : std::uint8_t {
  local,      // this node's agent only; a fan-out launcher does not forward it
  forwarded,  // an agent setting that a fan-out launcher checks and forwards as typed to every host
  planned,    // an agent setting that a fan-out launcher rewrites for each host or the whole job
  placement,  // where this node sits in the job; a fan-out launcher places its agents itself and
              // refuses it
  host_list,  // the hosts to fan out to: giving one makes this ddprun the fan-out launcher
  fanout,     // configures the fan-out launcher (ssh, host selection, the hosted rendezvous);
              // refused without a host list
  process,    // this ddprun process in either role (--dry-run, --version)
};

struct FlagSpec {
  std::string_view dash;        // "nproc-per-node"
  std::string_view short_name;  // "m" for -m; "" when none
  FlagKind kind = FlagKind::value;
  FlagScope scope = FlagScope::local;
  bool env_form = false;          // has a PET_<NAME> environment variable
  std::string_view metavar;       // the value's placeholder in --help, e.g. "N|MIN:MAX"; "" for booleans
  std::string_view help;          // one paragraph, without the default
  std::string_view default_text;  // what applies when the flag is not given; "" = nothing to say
  // The value's fixed set (or, with choices_open, its keywords beside other forms such as numbers).
  std::span<const std::string_view> choices = {};
  bool choices_open = false;
  bool hidden = false;  // set by ddprun for ddprun (a remote agent's label): not in --help
  // Giving it means the user placed this node; Slurm's allocation variables are then not used.
  bool overrides_slurm = false;
};

// "nproc_per_node" for "nproc-per-node".
inline std::string underscore_spelling(std::string_view dash) {
  std::string s(dash);
  for (char& c : s) {
    if (c == '-') c = '_';
  }
  return s;
}

// "PET_NPROC_PER_NODE" for "nproc-per-node".
inline std::string pet_variable(std::string_view dash) {
  std::string s = "PET_" + underscore_spelling(dash);
  for (char& c : s) {
    if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 'a' + 'A');
  }
  return s;
}

// The help paragraph as --help prints it: the help text, then "Default: X." when there is one.
inline std::string help_with_default(const FlagSpec& spec) {
  std::string text(spec.help);
  if (!spec.default_text.empty())
    text += (text.empty() ? "" : " ") + std::string("Default: ") + std::string(spec.default_text) + ".";
  return text;
}

}  // namespace ddprun
