// parse_command_line reads the common command line without CLI11 (ParsedFlags::parse,
// parsed_flags.hpp). Differential test: for a corpus of command lines — every flag
// in every spelling, values that look like options, missing values, help, unknown options,
// program words that look like ddprun flags, PET_* variables for flags that are not on the
// command line — that reading and CLI11's with every flag defined must agree: the same error or
// help, the same words left for the program (also after program_words drops the "--" argparse
// drops), and the same answer from every ParsedFlags query the resolvers make.
#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "ddprun/common/error.hpp"
#include "ddprun/common/flag_spec.hpp"
#include "ddprun/launcher/command_line.hpp"
#include "ddprun/launcher/flags.hpp"
#include "flags_outcome.hpp"
#include "parsed_flags.hpp"

namespace launcher = ddprun::launcher;
namespace detail = ddprun::launcher::detail;
using Args = std::vector<std::string>;

namespace {

std::vector<Args> corpus() {
  std::vector<Args> out = {
      {},
      {"train.py"},
      {"--", "train.py"},
      {"-", "train.py"},
      {"--help"},
      {"-h"},
      {"--nproc-per-node", "--help"},
      {"--unknown-flag", "train.py"},
      {"-z", "train.py"},
      {"--nproc-per-node", "4", "train.py", "--nnodes", "2", "--help"},
      {"--nproc-per-node", "2", "--nproc-per-node", "3", "--no-python", "/bin/true"},
      {"--nproc_per_node=2", "--no_python", "/bin/true", "-m"},
      {"--nnodes", "2", "--", "prog", "--nnodes", "3"},
      {"-m", "pkg.mod", "--lr", "0.1"},
      {"-mr3", "train.py"},
      {"-r3", "-t", "1", "train.py"},
      {"-r", "-1", "train.py"},
      {"--nproc", "2", "train.py"},
      {"--nnodes", "-5", "train.py"},
      {"--nnodes"},
      {"--standalone", "--nproc-per-node=cpu", "train.py", "--standalone"},
      {"--nnodes=", "prog"},
      {"--nproc-per-node", "2", "--nproc_per_node=3", "-t", "4", "prog"},
      {"--no-python", "--", "--", "prog"},
      {"--no-python", "-", "prog"},
      // Words newer CLI11 releases give a meaning to in some option kinds (a CLI11 upgrade that
      // reads them differently fails here rather than in a user's launch).
      {"--rdzv-id", "{}", "--rdzv-conf", "[a,b]", "prog"},
      {"--rdzv-id", "%%", "--rdzv-id=[x]", "prog", "{}"},
      {"--env", "{}", "--env", "%%", "--env=[a,b]", "--ssh-option", "{}", "prog"},
      {"--nnodes", "", "prog"},
      // The "--" argparse drops (right after the program) and the ones it keeps.
      {"prog", "--", "--lr", "0.1"},
      {"prog", "--"},
      {"prog", "a", "--", "b"},
      {"--", "prog", "--", "b"},
      {"--nnodes", "2", "prog", "--", "--", "x"},
      {"-m", "pkg.mod", "--", "--nnodes", "3"},
      {"--no-python", "--", "--", "x"},
      // Prefixes torchrun reads as one of its flags, shared with ddprun-only flags.
      {"--node", "1", "--nnodes", "2", "prog"},
      {"--log=/x", "prog"},
      {"--re", "3", "prog"},
      {"--local-r", "0", "--local_r=1", "prog"},
      {"--h"},
      {"--he", "prog"},
      {"--local", "x", "prog"},
      {"--nc", "1", "prog"},
  };
  for (const auto& spec : launcher::launcher_flags()) {
    const std::string dash = "--" + std::string(spec.dash);
    const std::string under = "--" + ddprun::underscore_spelling(spec.dash);
    if (spec.kind == ddprun::FlagKind::boolean) {
      out.push_back({dash, "prog", dash});
      out.push_back({under, "--nproc-per-node", "2", "prog"});
      out.push_back({dash + "=1", "prog"});
      if (!spec.short_name.empty()) out.push_back({"-" + std::string(spec.short_name), "prog"});
    } else {
      out.push_back({dash, "1", "prog"});
      out.push_back({dash + "=x", under, "y", "prog"});
      out.push_back({dash, "-x", "prog"});
      out.push_back({"--nproc-per-node", "1", dash});
      if (!spec.short_name.empty()) {
        out.push_back({"-" + std::string(spec.short_name), "2", "prog"});
        out.push_back({"-" + std::string(spec.short_name) + "2", "prog"});
      }
    }
  }
  return out;
}

}  // namespace

TEST_CASE("the common command line is read without CLI11 as CLI11 reads it", "[cli][lazy]") {
  launcher::ParseContext ctx;
  ctx.cwd = "/";
  // PET_* forms of flags that are mostly not on the command line: read without a definition.
  ctx.env = {{"PET_NNODES", "3"}, {"PET_NO_PYTHON", "1"}, {"PET_MAX_RESTARTS", "2"}, {"PET_STANDALONE", "x"}};
  int lazy_parses = 0;
  for (const Args& args : corpus()) {
    std::string shown;
    for (const auto& a : args) shown += " '" + a + "'";
    INFO("ddprun" << shown);
    const auto lazy = ddprun_test::parse_outcome(args, ctx, true);
    const auto full = ddprun_test::parse_outcome(args, ctx, false);
    CHECK(lazy.error == full.error);
    CHECK(lazy.help == full.help);
    CHECK(lazy.remaining == full.remaining);
    CHECK(lazy.program == full.program);
    CHECK(lazy.answers == full.answers);
    CHECK(full.cli11);
    if (!lazy.cli11) ++lazy_parses;
  }
  // Most of the corpus takes the path without CLI11 (else this test compares CLI11 with itself).
  CHECK(lazy_parses > 100);
}

TEST_CASE("the common launch is read without CLI11, the unusual with it", "[cli][lazy]") {
  launcher::ParseContext ctx;
  ctx.cwd = "/";
  {
    detail::ParsedFlags p(ctx);
    CHECK_FALSE(p.parse({"--nproc-per-node", "8", "--no-python", "./train", "--nnodes", "4"}));
    CHECK_FALSE(p.read_with_cli11());
    CHECK(p.given("nproc-per-node")->text == "8");
    CHECK(p.flag("no-python"));
    CHECK_FALSE(p.given("nnodes"));  // the program's own flag
    CHECK(p.remaining() == Args{"./train", "--nnodes", "4"});
  }
  for (const Args& args : {Args{"--help"}, Args{"--nnodes"}, Args{"--nnodes", "--no-python", "x"}, Args{"-mr3", "x"},
                           Args{"--standalone=1", "x"}, Args{"--nnodes=", "x"}}) {
    detail::ParsedFlags p(ctx);
    try {
      p.parse(args);
    } catch (const ddprun::Error&) {  // CLI11's message
    }
    CHECK(p.read_with_cli11());
  }
  detail::ParsedFlags p(ctx);
  p.parse({"x", "--bogus"});  // after the program: not ddprun's
  CHECK_FALSE(p.read_with_cli11());
}
