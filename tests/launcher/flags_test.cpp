// The flag table (launcher_flags) and the lists derived from it: every row is complete, the
// derived lists equal the hand-kept lists they replaced, fixed value sets are what the parser
// accepts, and --help shows the table.
#include <catch2/catch.hpp>

#include <algorithm>
#include <set>

#include "ddprun/common/error.hpp"
#include "ddprun/launcher/command_line.hpp"
#include "ddprun/launcher/flags.hpp"
#include "sandbox.hpp"

using namespace ddprun::launcher;
using Catch::Matchers::Contains;
using ddprun::FlagKind;
using ddprun::FlagScope;
using ddprun::UsageError;
using ddprun::test::Sandbox;
using Strings = std::vector<std::string>;
using Names = std::set<std::string>;

namespace {

Names names_in(FlagScope scope) {
  Names out;
  for (auto n : launcher_flags_in(scope)) out.emplace(n);
  return out;
}

Names names_where(bool (*pred)(const ddprun::FlagSpec&)) {
  Names out;
  for (const auto& f : launcher_flags()) {
    if (pred(f)) out.emplace(f.dash);
  }
  return out;
}

struct FanoutSandbox : Sandbox {
  FanoutSandbox() { write(dir() / "bin" / "ssh", "#!/bin/sh\n", true); }
};

}  // namespace

TEST_CASE("every flag has help text, a scope, and a metavar when it takes a value") {
  Names seen;
  for (const auto& f : launcher_flags()) {
    INFO("--" << f.dash);
    CHECK_FALSE(f.dash.empty());
    CHECK(seen.insert(std::string(f.dash)).second);
    CHECK_FALSE(f.help.empty());
    CHECK(f.help.back() == '.');
    CHECK(static_cast<int>(f.scope) <= static_cast<int>(FlagScope::process));
    CHECK(f.metavar.empty() == (f.kind == FlagKind::boolean));
    CHECK(f.default_text.find("Default") == std::string_view::npos);
    if (f.kind == FlagKind::repeated) CHECK_FALSE(f.env_form);  // one PET value cannot repeat
    CHECK(find_launcher_flag(f.dash) == &f);
    CHECK(find_launcher_flag(ddprun::underscore_spelling(f.dash)) == &f);
  }
  CHECK(find_launcher_flag("no-such-flag") == nullptr);
}

TEST_CASE("the derived flag lists equal the hand-kept lists they replace") {
  // Forwarded as typed to every remote agent by the fan-out launcher.
  CHECK(names_in(FlagScope::forwarded) == Names{"max-restarts",
                                                "metrics-host",
                                                "metrics-port",
                                                "redirects",
                                                "tee",
                                                "local-ranks-filter",
                                                "signals-to-handle",
                                                "shutdown-timeout",
                                                "kill-timeout",
                                                "nccl-id",
                                                "nccl-roots",
                                                "role",
                                                "log-dir",
                                                "local-rank-arg",
                                                "log-level",
                                                "virtual-local-rank",
                                                "gpu-isolation",
                                                "gpu-sharing",
                                                "module",
                                                "no-python",
                                                "run-path",
                                                "numa-binding",
                                                "containment",
                                                "rank-memory",
                                                "hang-timeout",
                                                "stacks",
                                                "event-log-handler",
                                                "duplicate-stdout-filters",
                                                "duplicate-stderr-filters"});
  // Rewritten per host or for the job by the fan-out plan.
  CHECK(names_in(FlagScope::planned) == Names{"nproc-per-node", "rdzv-conf", "gpus", "ranks-filter"});
  // Refused with a host list.
  CHECK(names_in(FlagScope::placement) == Names{"nnodes", "rdzv-backend", "rdzv-endpoint", "rdzv-id", "node-rank",
                                                "master-addr", "master-port", "local-addr", "node-label", "node-order",
                                                "standalone"});
  // Refused without a host list.
  CHECK(names_in(FlagScope::fanout) == Names{"include", "exclude", "num-nodes", "num-gpus", "ssh-port", "ssh-config",
                                             "ssh-max-inflight", "ssh-tree-threshold", "ssh-tree-fanout",
                                             "remote-ddprun", "remote-cwd", "env-file", "launcher-addr", "ssh-option",
                                             "env"});
  CHECK(names_in(FlagScope::host_list) == Names{"hostfile", "hosts"});
  // Any of these turns Slurm's defaults off.
  CHECK(names_where([](const ddprun::FlagSpec& f) { return f.overrides_slurm; }) ==
        Names{"nnodes", "rdzv-backend", "rdzv-endpoint", "rdzv-id", "node-rank", "master-addr", "standalone"});
  CHECK(names_where([](const ddprun::FlagSpec& f) { return !f.env_form; }) ==
        Names{"ssh-option", "env", "node-label", "node-order", "numa-binding", "logs-specs", "dry-run", "log-level",
              "version", "print-completion"});
  CHECK(names_where([](const ddprun::FlagSpec& f) { return f.hidden; }) == Names{"node-label", "node-order"});
}

TEST_CASE("every forwarded flag is checked by the fan-out launcher and forwarded as typed") {
  FanoutSandbox sb;
  const auto o = sb.parse({"--hosts",
                           "h0",
                           "--max-restarts",
                           "2",
                           "--metrics-host",
                           "0.0.0.0",
                           "--metrics-port",
                           "9400",
                           "-r",
                           "1",
                           "-t",
                           "0:3",
                           "--local-ranks-filter",
                           "0",
                           "--signals-to-handle",
                           "TERM",
                           "--shutdown-timeout",
                           "5",
                           "--kill-timeout",
                           "60",
                           "--nccl-id",
                           "off",
                           "--nccl-roots",
                           "2",
                           "--role",
                           "trainer",
                           "--log-dir",
                           "logs",
                           "--local-rank-arg",
                           "dash",
                           "--log-level",
                           "debug",
                           "--virtual-local-rank",
                           "--gpu-isolation",
                           "--gpu-sharing",
                           "-m",
                           "--no-python",
                           "--run-path",
                           "--numa-binding",
                           "node",
                           "--containment",
                           "proc",
                           "--hang-timeout",
                           "30",
                           "--stacks",
                           "off",
                           "pkg.train"});
  REQUIRE(o.fanout);
  const Strings& a = o.fanout->agent_args;
  CHECK(Names(a.begin(), a.end()) == Names{"--rdzv-conf=is_host=false",
                                           "--max-restarts=2",
                                           "--metrics-host=0.0.0.0",
                                           "--metrics-port=9400",
                                           "--redirects=1",
                                           "--tee=0:3",
                                           "--local-ranks-filter=0",
                                           "--signals-to-handle=TERM",
                                           "--shutdown-timeout=5",
                                           "--kill-timeout=60",
                                           "--nccl-id=off",
                                           "--nccl-roots=2",
                                           "--role=trainer",
                                           "--log-dir=logs",
                                           "--local-rank-arg=dash",
                                           "--log-level=debug",
                                           "--virtual-local-rank",
                                           "--gpu-isolation",
                                           "--gpu-sharing",
                                           "--module",
                                           "--no-python",
                                           "--run-path",
                                           "--numa-binding=node",
                                           "--containment=proc",
                                           "--hang-timeout=30",
                                           "--stacks=off"});
  // Each forwarded value flag fails before any ssh when its value is bad.
  for (const Strings& bad :
       {Strings{"--max-restarts", "-1"}, Strings{"--redirects", "7"}, Strings{"--tee", "x"},
        Strings{"--local-ranks-filter", "a"}, Strings{"--signals-to-handle", "KILL"},
        Strings{"--shutdown-timeout", "soon"}, Strings{"--kill-timeout", "0"}, Strings{"--nccl-id", "maybe"},
        Strings{"--nccl-roots", "0"}, Strings{"--role", " "}, Strings{"--log-dir", ""},
        Strings{"--local-rank-arg", "both"}, Strings{"--log-level", "loud"}, Strings{"--numa-binding", "nowhere"},
        Strings{"--containment", "jail"}, Strings{"--hang-timeout", "never"}, Strings{"--stacks", "maybe"},
        Strings{"--metrics-host", "node1"}, Strings{"--metrics-port", "70000"}}) {
    Strings args = {"--hosts", "h0"};
    args.insert(args.end(), bad.begin(), bad.end());
    args.emplace_back("train.py");
    INFO(bad[0] << " " << bad[1]);
    CHECK_THROWS_WITH(sb.parse(args), Contains(bad[0]));
  }
}

TEST_CASE("every value of a fixed set is accepted, and the error lists the set") {
  Sandbox sb;
  for (const auto& f : launcher_flags()) {
    if (f.choices.empty() || f.choices_open || f.scope == FlagScope::fanout) continue;
    for (auto choice : f.choices) {
      INFO("--" << f.dash << "=" << choice);
      // (c10d needs an endpoint; the static backend ignores it.)
      CHECK_NOTHROW(sb.parse(
          {"--rdzv-endpoint=localhost:1", "--" + std::string(f.dash) + "=" + std::string(choice), "train.py"}));
    }
    INFO("--" << f.dash);
    CHECK_THROWS_AS(sb.parse({"--" + std::string(f.dash) + "=bogus", "train.py"}), UsageError);
  }
  CHECK(sb.parse({"--nproc-per-node=cpu", "train.py"}).config.nproc_per_node >= 1);
  for (auto digit : {"0", "1", "2", "3"}) {
    CHECK_NOTHROW(sb.parse({"--redirects", digit, "--tee", digit, "train.py"}));
  }
}

TEST_CASE("--help shows every visible flag with its default and PET form, and no hidden one") {
  Sandbox sb;
  const auto o = sb.parse({"--help"});
  REQUIRE(o.command == CommandKind::help);
  for (const auto& f : launcher_flags()) {
    INFO("--" << f.dash);
    const bool shown = o.text.find("--" + std::string(f.dash) + " ") != std::string::npos ||
                       o.text.find("--" + std::string(f.dash) + ",") != std::string::npos;
    CHECK(shown == !f.hidden);
    if (f.hidden) continue;
    if (!f.default_text.empty()) CHECK_THAT(o.text, Contains("Default: " + std::string(f.default_text)));
    if (f.env_form) CHECK_THAT(o.text, Contains(ddprun::pet_variable(f.dash)));
  }
  // The footer's list of flags without a PET form comes from the table too.
  CHECK_THAT(o.text, Contains("except --ssh-option, --env, --numa-binding, --logs-specs, --dry-run, --log-level, "
                              "--version and --print-completion, an environment form"));
}

TEST_CASE("settings the agent would refuse are refused by the launcher, naming the flag") {
  Sandbox sb;
  // The agent refuses a node rank for a single-node job; with --standalone the launcher drops it.
  CHECK(sb.parse({"--standalone", "--node-rank", "1", "train.py"}).config.node_rank == 0);
  CHECK_THROWS_WITH(sb.parse({"--nnodes", "2", "--master-port", "0", "train.py"}), Contains("--master-port"));
  CHECK_NOTHROW(sb.parse({"--nnodes", "1", "--master-port", "0", "train.py"}));
}
