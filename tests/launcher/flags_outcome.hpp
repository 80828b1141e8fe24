#pragma once
// One reading of a ddprun command line, as the resolvers see it: the error or help, the words
// left for the program (and after program_words), and the answer of every ParsedFlags query.
// Taken with the reading without CLI11 (lazy) or with CLI11 and every flag defined, for the
// differential test (flags_lazy_test.cpp) and its fuzz target (tests/fuzz/fuzz_flags.cpp).
#include <string>
#include <vector>

#include "ddprun/common/error.hpp"
#include "ddprun/common/flag_spec.hpp"
#include "ddprun/launcher/command_line.hpp"
#include "ddprun/launcher/flags.hpp"
#include "parsed_flags.hpp"

namespace ddprun_test {

namespace launcher = ddprun::launcher;
namespace detail = ddprun::launcher::detail;
using Args = std::vector<std::string>;

struct Outcome {
  bool cli11 = false;  // (not compared)
  std::string error;
  bool help = false;
  Args remaining;
  Args program;  // program_words(remaining), or its error
  Args answers;
};

inline Outcome parse_outcome(const Args& args, const launcher::ParseContext& ctx, bool lazy) {
  Outcome o;
  detail::ParsedFlags p(ctx);
  Args expanded;
  try {
    expanded = detail::expand_abbreviations(args);
  } catch (const ddprun::Error& e) {
    o.cli11 = true;  // refused before either reading (the expansion is common to both): nothing to count
    o.error = e.what();
    return o;
  }
  try {
    const bool help = p.parse(expanded, !lazy).has_value();
    o.cli11 = p.read_with_cli11();
    if (help) {
      o.help = true;
      return o;
    }
  } catch (const ddprun::Error& e) {
    o.cli11 = p.read_with_cli11();
    o.error = e.what();
    return o;
  }
  o.remaining = p.remaining();
  try {
    o.program = detail::program_words(o.remaining, "usage");
  } catch (const ddprun::Error& e) {
    o.program = {"error", e.what()};
  }
  for (const auto& spec : launcher::launcher_flags()) {
    const std::string dash(spec.dash);
    try {
      switch (spec.kind) {
        case ddprun::FlagKind::boolean:
          o.answers.push_back(dash + (p.flag(dash) ? " on" : " off"));
          break;
        case ddprun::FlagKind::repeated:
          for (const auto& v : p.all(dash)) o.answers.push_back(dash + " += " + v);
          break;
        case ddprun::FlagKind::value:
          if (auto g = p.given(dash)) o.answers.push_back(dash + " = " + g->text + " from " + g->what);
          break;
      }
    } catch (const ddprun::Error& e) {
      o.answers.push_back(dash + " error " + e.what());
    }
  }
  return o;
}

inline bool operator==(const Outcome& a, const Outcome& b) {
  return a.error == b.error && a.help == b.help && a.remaining == b.remaining && a.program == b.program &&
         a.answers == b.answers;
}

}  // namespace ddprun_test
