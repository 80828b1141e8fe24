#include <catch2/catch.hpp>

#include <csignal>
#include <functional>
#include <regex>
#include <set>

#include "ddprun/common/error.hpp"
#include "ddprun/common/version.hpp"
#include "ddprun/launcher/command_line.hpp"
#include "ddprun/launcher/values.hpp"
#include "sandbox.hpp"

using namespace ddprun::launcher;
using Catch::Matchers::Contains;
using ddprun::UsageError;
using ddprun::agent::AgentConfig;
using ddprun::agent::Streams;
using ddprun::test::Sandbox;
using Strings = std::vector<std::string>;
using Env = std::map<std::string, std::string>;

namespace {

std::string underscore(std::string s) {
  for (auto& c : s) {
    if (c == '-') c = '_';
  }
  return s;
}

std::string pet(const std::string& dash) {
  std::string s = "PET_" + underscore(dash);
  for (auto& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

bool has_note(const LaunchOptions& o, const std::string& text) {
  for (const auto& n : o.notes) {
    if (n.find(text) != std::string::npos) return true;
  }
  return false;
}

}  // namespace

TEST_CASE("defaults equal torchrun's") {
  Sandbox sb;
  const auto o = sb.parse({"train.py"});
  const AgentConfig& c = o.config;
  CHECK(o.command == CommandKind::run);
  CHECK(c.nproc_per_node == 1);
  CHECK(c.min_nodes == 1);
  CHECK(c.max_nodes == 1);
  CHECK(c.node_rank == 0);
  CHECK(c.role == "default");
  // One node and no port: standalone, as current torchrun (below).
  CHECK(c.rdzv_backend == "c10d");
  CHECK(c.rdzv_endpoint == "localhost:0");
  CHECK(c.run_id.size() == 36);  // a random UUID
  CHECK(c.rdzv_conf.empty());
  CHECK(c.standalone);
  CHECK(c.max_restarts == 0);
  CHECK(c.master_addr == "127.0.0.1");
  CHECK(c.master_port == 0);
  CHECK_FALSE(c.local_addr.has_value());
  CHECK(c.metrics_port == -1);  // no metrics endpoint unless asked
  CHECK(c.metrics_host == "127.0.0.1");
  CHECK_FALSE(c.log_dir.has_value());
  CHECK(c.redirects_all == Streams::none);
  CHECK(c.redirects.empty());
  CHECK(c.tee_all == Streams::none);
  CHECK(c.tee.empty());
  CHECK_FALSE(c.local_ranks_filter.has_value());
  CHECK(c.log_line_prefix_template == "[${role_name}${local_rank}]:");
  CHECK(c.signals_to_handle == std::vector<int>{SIGTERM, SIGINT, SIGHUP, SIGQUIT});
  CHECK(c.shutdown_timeout == std::chrono::seconds(30));
  CHECK(c.kill_timeout == std::chrono::seconds(30));
  CHECK_FALSE(c.virtual_local_rank);
  CHECK_FALSE(c.dry_run);
  CHECK(c.local_rank_arg == AgentConfig::LocalRankArg::none);
  CHECK(c.worker_argv == Strings{sb.path("bin/python3"), "-u", "train.py"});
  CHECK(c.python_worker);
  CHECK(c.working_dir == sb.dir());
  CHECK(o.log_level == spdlog::level::info);
  CHECK(o.notes.empty());
}

TEST_CASE("one node without a port or an endpoint is standalone, as current torchrun; otherwise static at 29500") {
  // torchrun (run.py, 2026): --master-port defaults to none, and a single-node job of the static
  // backend without a port and without --rdzv-endpoint takes the --standalone path, so that two
  // jobs on one machine do not both take port 29500.
  Sandbox sb;
  const auto a = sb.parse({"train.py"});
  const auto b = sb.parse({"train.py"});
  CHECK(a.config.standalone);
  CHECK(a.config.run_id != b.config.run_id);  // a new run id for each job
  CHECK(a.notes.empty());
  for (const auto& args : std::vector<Strings>{{"--nnodes", "1:1", "train.py"},
                                               {"--rdzv-backend", "static", "train.py"},
                                               {"--node-rank", "0", "train.py"}}) {
    INFO(Catch::StringMaker<Strings>::convert(args));
    const auto o = sb.parse(args);
    CHECK(o.config.standalone);
    CHECK(o.config.master_port == 0);
  }
  // Not with a node rank other than 0: a multi-node launch that forgot --nnodes is refused.
  CHECK_THROWS_WITH(sb.parse({"--node-rank", "1", "--master-addr", "10.1.2.3", "train.py"}),
                    Contains("--node-rank=1 is not below --nnodes=1"));
  // What it ignores is said, as for --standalone.
  const auto ignored = sb.parse({"--master-addr", "10.1.2.3", "--rdzv-id", "job7", "train.py"});
  CHECK(ignored.config.standalone);
  CHECK(ignored.config.master_addr == "127.0.0.1");
  CHECK(has_note(ignored,
                 "one node without --master-port (standalone, as torchrun): ignoring "
                 "--rdzv-id=job7, --master-addr=10.1.2.3"));
  // A port (flag or PET_MASTER_PORT, 29500 included), an endpoint, another backend or more nodes:
  // unchanged.
  for (const auto& [args, env] : std::vector<std::pair<Strings, Env>>{
           {{"--master-port", "29500", "train.py"}, {}},
           {{"--master-port=1234", "train.py"}, {}},
           {{"train.py"}, {{"PET_MASTER_PORT", "29500"}}},
           {{"--nnodes", "2", "train.py"}, {}},
           {{"--nnodes", "1:2", "train.py"}, {}},
           {{"--rdzv-endpoint", "127.0.0.1:29501", "train.py"}, {}},
       }) {
    INFO(Catch::StringMaker<Strings>::convert(args));
    const auto o = sb.parse(args, env);
    CHECK_FALSE(o.config.standalone);
    CHECK(o.config.rdzv_backend == "static");
    CHECK(o.config.run_id == "none");
    CHECK(o.config.master_port != 0);
  }
  CHECK(sb.parse({"--nnodes", "2", "train.py"}).config.master_port == 29500);
  const auto c10d = sb.parse({"--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "train.py"});
  CHECK_FALSE(c10d.config.standalone);
  CHECK(c10d.config.rdzv_endpoint == "h:1");
}

TEST_CASE("every value flag in both spellings, with = or a space, and as PET_*") {
  struct Case {
    std::string dash;
    std::string value;
    std::function<bool(const LaunchOptions&, const Sandbox&)> check;
    Strings extra = {};
    bool has_pet = true;
    std::string short_name = {};
  };
  const std::vector<Case> cases = {
      {"nnodes", "1:3", [](auto& o, auto&) { return o.config.min_nodes == 1 && o.config.max_nodes == 3; }},
      {"nproc-per-node", "3", [](auto& o, auto&) { return o.config.nproc_per_node == 3; }},
      {"rdzv-backend",
       "c10d",
       [](auto& o, auto&) { return o.config.rdzv_backend == "c10d"; },
       {"--rdzv-endpoint", "h:1"}},
      {"rdzv-endpoint", "node1:1234",
       [](auto& o, auto&) {
         return o.config.rdzv_endpoint == "node1:1234" && o.config.master_addr == "node1" &&
                o.config.master_port == 1234;
       }},
      {"rdzv-endpoint",
       "node1",
       [](auto& o, auto&) { return o.config.rdzv_endpoint == "node1:29400"; },
       {"--rdzv-backend", "c10d"}},
      {"rdzv-endpoint", "[::1]:7",
       [](auto& o, auto&) {
         return o.config.rdzv_endpoint == "[::1]:7" && o.config.master_addr == "::1" && o.config.master_port == 7;
       }},
      {"rdzv-endpoint",
       "r1:5, r2,[::1]:7",
       [](auto& o, auto&) { return o.config.rdzv_endpoint == "r1:5,r2:29400,[::1]:7"; },
       {"--rdzv-backend", "c10d"}},
      {"rdzv-id", "job7", [](auto& o, auto&) { return o.config.run_id == "job7"; }, {"--nnodes", "2"}},
      {"rdzv-conf", "join_timeout=5,is_host=1",
       [](auto& o, auto&) {
         return o.config.rdzv_conf == Env{{"join_timeout", "5"}, {"is_host", "1"}};
       }},
      {"max-restarts", "2", [](auto& o, auto&) { return o.config.max_restarts == 2; }},
      {"metrics-port", "0",
       [](auto& o, auto&) { return o.config.metrics_port == 0 && o.config.metrics_host == "127.0.0.1"; }},
      {"metrics-host",
       "[::1]",
       [](auto& o, auto&) { return o.config.metrics_host == "::1"; },
       {"--metrics-port", "9400"}},
      {"monitor-interval", "0.5", [](auto& o, auto&) { return has_note(o, "has no effect"); }},
      {"start-method", "fork", [](auto& o, auto&) { return has_note(o, "has no effect"); }},
      {"role", "trainer", [](auto& o, auto&) { return o.config.role == "trainer"; }},
      {"log-dir", "logs", [](auto& o, auto& sb) { return o.config.log_dir == sb.dir() / "logs"; }},
      {"log-dir", "/var/tmp/x", [](auto& o, auto&) { return o.config.log_dir == "/var/tmp/x"; }},
      {"redirects", "3", [](auto& o, auto&) { return o.config.redirects_all == Streams::both; }, {}, true, "r"},
      {"redirects",
       "0:1,1:2",
       [](auto& o, auto&) {
         return o.config.redirects == std::map<int, Streams>{{0, Streams::out}, {1, Streams::err}};
       },
       {},
       true,
       "r"},
      {"tee", "2", [](auto& o, auto&) { return o.config.tee_all == Streams::err; }, {}, true, "t"},
      {"tee",
       "1:3",
       [](auto& o, auto&) {
         return o.config.tee == std::map<int, Streams>{{1, Streams::both}};
       },
       {},
       true,
       "t"},
      {"local-ranks-filter", "0,2",
       [](auto& o, auto&) {
         return o.config.local_ranks_filter == std::set<int>{0, 2};
       }},
      {"node-rank", "1", [](auto& o, auto&) { return o.config.node_rank == 1; }, {"--nnodes", "2"}},
      {"master-addr", "10.1.2.3", [](auto& o, auto&) { return o.config.master_addr == "10.1.2.3"; }, {"--nnodes", "2"}},
      {"master-addr", "[::1]", [](auto& o, auto&) { return o.config.master_addr == "::1"; }, {"--nnodes", "2"}},
      {"master-port", "1234", [](auto& o, auto&) { return o.config.master_port == 1234; }},
      {"local-addr", "10.0.0.2", [](auto& o, auto&) { return o.config.local_addr == "10.0.0.2"; }},
      {"signals-to-handle", "SIGUSR1,TERM",
       [](auto& o, auto&) {
         return o.config.signals_to_handle == std::vector<int>{SIGUSR1, SIGTERM};
       }},
      {"shutdown-timeout", "2.5",
       [](auto& o, auto&) { return o.config.shutdown_timeout == std::chrono::milliseconds(2500); }},
      {"kill-timeout", "0.25", [](auto& o, auto&) { return o.config.kill_timeout == std::chrono::milliseconds(250); }},
      {"kill-timeout", "0.0001", [](auto& o, auto&) { return o.config.kill_timeout == std::chrono::milliseconds(1); }},
      {"local-rank-arg", "underscore",
       [](auto& o, auto&) { return o.config.local_rank_arg == AgentConfig::LocalRankArg::underscore; }},
      {"local-rank-arg", "dash",
       [](auto& o, auto&) { return o.config.local_rank_arg == AgentConfig::LocalRankArg::dash; }},
      {"log-level", "debug", [](auto& o, auto&) { return o.log_level == spdlog::level::debug; }, {}, false},
  };
  Sandbox sb;
  for (const auto& c : cases) {
    const std::string dash = "--" + c.dash;
    const std::string under = "--" + underscore(c.dash);
    std::vector<Strings> spellings = {
        {dash, c.value}, {dash + "=" + c.value}, {under, c.value}, {under + "=" + c.value}};
    if (!c.short_name.empty()) {
      // -r 3, -r3 and, as argparse reads it, -r=3
      spellings.push_back({"-" + c.short_name, c.value});
      spellings.push_back({"-" + c.short_name + c.value});
      spellings.push_back({"-" + c.short_name + "=" + c.value});
    }
    for (const auto& spelled : spellings) {
      Strings args = c.extra;
      args.insert(args.end(), spelled.begin(), spelled.end());
      args.push_back("train.py");
      INFO("args: " << Catch::StringMaker<Strings>::convert(args));
      const auto o = sb.parse(args);
      CHECK(c.check(o, sb));
      CHECK(o.config.worker_argv == Strings{sb.path("bin/python3"), "-u", "train.py"});
    }
    if (c.has_pet) {
      Strings args = c.extra;
      args.push_back("train.py");
      INFO("env: " << pet(c.dash) << "=" << c.value);
      CHECK(c.check(sb.parse(args, {{pet(c.dash), c.value}}), sb));
    }
  }
}

TEST_CASE("every boolean flag in both spellings and as PET_*=1/0") {
  Sandbox sb;
  Sandbox::write(sb.dir() / "exe.py", "#!/bin/sh\n", true);
  // A file named like the module, so that without -m the program still resolves (to a script).
  Sandbox::write(sb.dir() / "pkg.mod", "", false);
  struct Case {
    std::string dash;
    std::function<bool(const LaunchOptions&)> on;
    std::string program = "train.py";
    std::string short_name = {};
    Strings extra = {};  // before the flag, in every parse
  };
  const std::string python = sb.path("bin/python3");
  const std::vector<Case> cases = {
      // (with a port: one node without one is standalone anyway)
      {"standalone", [](auto& o) { return o.config.standalone; }, "train.py", {}, {"--master-port", "1234"}},
      {"virtual-local-rank", [](auto& o) { return o.config.virtual_local_rank; }},
      {"module",
       [&](auto& o) {
         return o.config.worker_argv == Strings{python, "-u", "-m", "pkg.mod"};
       },
       "pkg.mod", "m"},
      {"no-python", [&](auto& o) { return o.config.worker_argv == Strings{sb.path("exe.py")}; }, "exe.py"},
      {"run-path", [&](auto& o) { return o.config.worker_argv.size() == 5 && o.config.worker_argv[2] == "-c"; }},
      {"use-env", [](auto& o) { return has_note(o, "--use-env has no effect"); }},
      {"dry-run", [](auto& o) { return o.config.dry_run; }},
  };
  for (const auto& c : cases) {
    INFO("flag " << c.dash);
    Strings spellings = {"--" + c.dash, "--" + underscore(c.dash)};
    if (!c.short_name.empty()) spellings.push_back("-" + c.short_name);
    auto args = [&](std::initializer_list<std::string> tail) {
      Strings a = c.extra;
      a.insert(a.end(), tail);
      return a;
    };
    for (const auto& s : spellings) {
      INFO("spelled " << s);
      CHECK(c.on(sb.parse(args({s, c.program}))));
      CHECK(c.on(sb.parse(args({s, c.program}), {{pet(c.dash), "0"}})));  // flag wins over PET_X=0
    }
    CHECK_FALSE(c.on(sb.parse(args({c.program}))));
    if (c.dash == "dry-run") {
      CHECK_FALSE(c.on(sb.parse(args({c.program}), {{pet(c.dash), "1"}})));  // a ddprun extra: no PET form
      continue;
    }
    CHECK(c.on(sb.parse(args({c.program}), {{pet(c.dash), "1"}})));
    CHECK_FALSE(c.on(sb.parse(args({c.program}), {{pet(c.dash), "0"}})));
    CHECK_THROWS_WITH(sb.parse(args({c.program}), {{pet(c.dash), "yes"}}), Contains(pet(c.dash) + "=yes"));
  }
}

TEST_CASE("precedence: flag over PET_* over default") {
  Sandbox sb;
  const Env env = {{"PET_NPROC_PER_NODE", "5"}, {"PET_NNODES", "2:4"},     {"PET_MASTER_PORT", "4000"},
                   {"PET_RDZV_ID", "fromenv"},  {"PET_MAX_RESTARTS", "7"}, {"PET_ROLE", "envrole"}};
  const auto from_env = sb.parse({"train.py"}, env);
  CHECK(from_env.config.nproc_per_node == 5);
  CHECK(from_env.config.min_nodes == 2);
  CHECK(from_env.config.max_nodes == 4);
  CHECK(from_env.config.master_port == 4000);
  CHECK(from_env.config.run_id == "fromenv");
  CHECK(from_env.config.max_restarts == 7);
  CHECK(from_env.config.role == "envrole");

  const auto from_flags = sb.parse({"--nproc-per-node", "3", "--nnodes", "1", "--master_port", "4001", "--rdzv-id",
                                    "flag", "--max-restarts=1", "--role", "r", "train.py"},
                                   env);
  CHECK(from_flags.config.nproc_per_node == 3);
  CHECK(from_flags.config.min_nodes == 1);
  CHECK(from_flags.config.max_nodes == 1);
  CHECK(from_flags.config.master_port == 4001);
  CHECK(from_flags.config.run_id == "flag");
  CHECK(from_flags.config.max_restarts == 1);
  CHECK(from_flags.config.role == "r");

  // An empty PET value counts as unset.
  CHECK(sb.parse({"train.py"}, {{"PET_NPROC_PER_NODE", ""}}).config.nproc_per_node == 1);
  // Repeated flags: the last one wins, as with argparse.
  CHECK(sb.parse({"--nproc-per-node", "2", "--nproc_per_node", "6", "train.py"}).config.nproc_per_node == 6);
}

TEST_CASE(
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 0 hosts the workers' store where torch's dynamic rendezvous runs") {
  Sandbox sb;
  const Env opt_out = {{"TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"}};
  CHECK(sb.parse({"train.py"}).config.share_worker_store);
  CHECK_FALSE(sb.parse({"--standalone", "train.py"}, opt_out).config.share_worker_store);
  CHECK_FALSE(sb.parse({"train.py"}, opt_out).config.share_worker_store);  // one node, no port: standalone
  CHECK_FALSE(sb.parse({"--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "train.py"}, opt_out)
                  .config.share_worker_store);
  CHECK_FALSE(
      sb.parse({"--nnodes", "1:2", "--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "h:2379", "train.py"}, opt_out)
          .config.share_worker_store);
  // Exactly "1", as torch reads it.
  CHECK(sb.parse({"--standalone", "train.py"}, {{"TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "true"}})
            .config.share_worker_store);
  // The static rendezvous always shares, one node or several; ddprun says the variable does nothing.
  for (const auto& argv :
       {std::vector<std::string>{"--master-port", "29500", "train.py"},
        std::vector<std::string>{"--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "train.py"}}) {
    const auto o = sb.parse(argv, opt_out);
    CHECK(o.config.share_worker_store);
    CHECK(has_note(o, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 has no effect with the static rendezvous"));
  }
}

TEST_CASE("errors from PET_* values name the variable") {
  Sandbox sb;
  CHECK_THROWS_WITH(sb.parse({"train.py"}, {{"PET_NNODES", "3:1"}}), Contains("PET_NNODES=3:1: MIN must be <= MAX"));
  CHECK_THROWS_WITH(sb.parse({"train.py"}, {{"PET_MASTER_PORT", "99999"}}), Contains("PET_MASTER_PORT=99999"));
}

TEST_CASE("nproc-per-node gpu/cpu/auto read CUDA_VISIBLE_DEVICES and the CPU count") {
  Sandbox sb;
  CHECK(sb.parse({"--nproc-per-node", "cpu", "train.py"}).config.nproc_per_node == 7);
  CHECK(sb.parse({"--nproc-per-node", "gpu", "train.py"}, {{"CUDA_VISIBLE_DEVICES", "0,1"}}).config.nproc_per_node ==
        2);
  CHECK(sb.parse({"--nproc-per-node", "gpu", "train.py"}, {{"CUDA_VISIBLE_DEVICES", "0,-1,1"}}).config.nproc_per_node ==
        1);
  CHECK(sb.parse({"--nproc-per-node", "auto", "train.py"}, {{"CUDA_VISIBLE_DEVICES", "MIG-x"}}).config.nproc_per_node ==
        1);
  CHECK(sb.parse({"--nproc-per-node", "auto", "train.py"}, {{"CUDA_VISIBLE_DEVICES", ""}}).config.nproc_per_node == 7);
  CHECK(sb.parse({"--nproc-per-node", "auto", "train.py"}).config.nproc_per_node == 7);
  // No CUDA_VISIBLE_DEVICES and no GPU in the (here: absent) inventory.
  CHECK_THROWS_WITH(sb.parse({"--nproc-per-node", "gpu", "train.py"}),
                    Contains("--nproc-per-node=gpu") && Contains("no GPU found"));
}

namespace {

ddprun::worker_env::GpuInventory fake_inventory(int n) {
  ddprun::worker_env::GpuInventory inv;
  inv.source = "nvml:fake";
  for (int i = 0; i < n; ++i) {
    ddprun::worker_env::GpuDevice d;
    d.index = i;
    d.uuid = "GPU-0000000" + std::to_string(i) + "-aaaa-bbbb-cccc-dddddddddddd";
    d.pci_bus_id = "0000:0" + std::to_string(i) + ":00.0";
    d.name = "Fake GPU";
    inv.devices.push_back(d);
  }
  return inv;
}

// Parses with an injected GPU inventory of `n` devices; `probes` counts the probe calls.
LaunchOptions parse_gpus(const Sandbox& sb, int n, const Strings& args, const Env& env = {}, int* probes = nullptr) {
  auto ctx = sb.context(env);
  ctx.probe_gpus = [n, probes](const ddprun::worker_env::EnvMap&) {
    if (probes != nullptr) ++*probes;
    return fake_inventory(n);
  };
  return parse_command_line(args, ctx);
}

std::string env_value(const ddprun::worker_env::EnvList& env, const std::string& name) {
  for (const auto& [k, v] : env) {
    if (k == name) return v;
  }
  return "<unset>";
}

}  // namespace

TEST_CASE("nproc-per-node gpu/auto count AMD GPUs (ROCm) where no NVIDIA GPU is, without assigning them") {
  Sandbox sb;
  const auto parse = [&](const Strings& args, const Env& env = {}) {
    auto ctx = sb.context(env);
    ctx.probe_gpus = [](const ddprun::worker_env::EnvMap&) {
      ddprun::worker_env::GpuInventory inv;
      inv.device_nodes = false;
      inv.source = "kfd:/sys/class/kfd/kfd/topology/nodes";
      inv.amd_gpus = {"GPU-00000000000000a1", "GPU-00000000000000a2", "", "GPU-00000000000000a4"};
      return inv;
    };
    return parse_command_line(args, ctx);
  };
  auto o = parse({"--nproc-per-node", "gpu", "train.py"});
  CHECK(o.config.nproc_per_node == 4);
  CHECK(o.config.gpu_env.empty());  // no plan: each rank picks LOCAL_RANK's device, as under torchrun
  REQUIRE_FALSE(o.notes.empty());
  CHECK_THAT(o.notes.back(), Contains("4 visible of the 4 AMD GPU(s) of this machine (ROCm, kfd:"));
  CHECK(parse({"--nproc-per-node", "auto", "train.py"}, {{"HIP_VISIBLE_DEVICES", "3,1"}}).config.nproc_per_node == 2);
  // CUDA_VISIBLE_DEVICES counts as HIP reads it, and is passed on as it is.
  o = parse({"--nproc-per-node", "gpu", "train.py"}, {{"CUDA_VISIBLE_DEVICES", "0"}});
  CHECK(o.config.nproc_per_node == 1);
  CHECK(o.config.gpu_env.empty());
  CHECK_THROWS_WITH(parse({"--nproc-per-node", "gpu", "train.py"}, {{"ROCR_VISIBLE_DEVICES", ""}}),
                    Contains("--nproc-per-node=gpu: ROCR_VISIBLE_DEVICES, HIP_VISIBLE_DEVICES or CUDA_VISIBLE_DEVICES "
                             "hides all 4 AMD GPU(s)"));
  CHECK(parse({"--nproc-per-node", "auto", "train.py"}, {{"HIP_VISIBLE_DEVICES", "9"}}).config.nproc_per_node == 7);
  // Assigning them to ranks is not done yet: said so, not silently ignored.
  CHECK_THROWS_WITH(parse({"--nproc-per-node", "gpu", "--gpu-isolation", "train.py"}),
                    Contains("--gpu-isolation: the AMD GPUs of this machine (ROCm) are counted but not assigned to "
                             "ranks: not supported yet"));
  CHECK_THROWS_WITH(parse({"--nproc-per-node", "2", "--gpus", "0,1", "train.py"}), Contains("not supported yet"));
  CHECK_THROWS_WITH(parse({"--nproc-per-node", "2", "--virtual-local-rank", "train.py"}),
                    Contains("--virtual-local-rank: the AMD GPUs") && Contains("not supported yet"));
}

TEST_CASE("nproc-per-node gpu/auto count the injected GPU inventory, probing only when needed") {
  Sandbox sb;
  int probes = 0;
  CHECK(parse_gpus(sb, 3, {"--nproc-per-node", "gpu", "train.py"}, {}, &probes).config.nproc_per_node == 3);
  CHECK(probes == 1);
  CHECK(parse_gpus(sb, 3, {"--nproc-per-node", "auto", "train.py"}).config.nproc_per_node == 3);
  CHECK(parse_gpus(sb, 0, {"--nproc-per-node", "auto", "train.py"}).config.nproc_per_node == 7);
  CHECK(parse_gpus(sb, 4, {"--nproc-per-node", "gpu", "train.py"}, {{"CUDA_VISIBLE_DEVICES", "1,3"}})
            .config.nproc_per_node == 2);
  // Index 7 does not exist: CUDA stops the list there.
  CHECK(parse_gpus(sb, 4, {"--nproc-per-node", "gpu", "train.py"}, {{"CUDA_VISIBLE_DEVICES", "0,7,1"}})
            .config.nproc_per_node == 1);
  CHECK(parse_gpus(sb, 2, {"--nproc_per_node", "gpu", "train.py"}).config.nproc_per_node == 2);
  CHECK(parse_gpus(sb, 2, {"train.py"}, {{"PET_NPROC_PER_NODE", "gpu"}}).config.nproc_per_node == 2);
  CHECK_THROWS_WITH(parse_gpus(sb, 0, {"--nproc-per-node", "gpu", "train.py"}),
                    Contains("--nproc-per-node=gpu") && Contains("no GPU found"));
  // A CPU run without GPU flags neither probes nor gets a plan: exactly as before.
  probes = 0;
  const auto cpu = parse_gpus(sb, 2, {"--nproc-per-node", "4", "train.py"}, {}, &probes);
  CHECK(probes == 0);
  CHECK(cpu.config.gpu_env.empty());
  CHECK(cpu.config.gpu_devices.empty());
  // The GPU count from gpu/auto brings the plan (DDPRUN_CUDA_DEVICE; CUDA's own device order,
  // unless CPUs are bound near each rank's device).
  const auto gpu = parse_gpus(sb, 2, {"--nproc-per-node", "gpu", "train.py"});
  REQUIRE(gpu.config.gpu_env.size() == 2);
  CHECK(env_value(gpu.config.gpu_env[1], "CUDA_DEVICE_ORDER") == "<unset>");
  CHECK(env_value(gpu.config.gpu_env[1], "DDPRUN_CUDA_DEVICE") == "1");
  const auto bound = parse_gpus(sb, 2, {"--nproc-per-node", "gpu", "--numa-binding", "node", "train.py"});
  REQUIRE(bound.config.gpu_env.size() == 2);
  CHECK(env_value(bound.config.gpu_env[1], "CUDA_DEVICE_ORDER") == "PCI_BUS_ID");
}

TEST_CASE("--gpus, --gpu-isolation, --gpu-sharing: both spellings, PET_ forms, the plan per rank") {
  Sandbox sb;
  const Env cvd = {{"CUDA_VISIBLE_DEVICES", "0,1,2,3"}};
  for (const Strings& args : {Strings{"--gpus", "1,3"}, Strings{"--gpus=1,3"}}) {
    Strings full = args;
    full.insert(full.end(), {"--nproc-per-node", "2", "train.py"});
    const auto o = parse_gpus(sb, 4, full, cvd);
    REQUIRE(o.config.gpu_env.size() == 2);
    CHECK(env_value(o.config.gpu_env[0], "CUDA_VISIBLE_DEVICES") == "1,3");
    CHECK(env_value(o.config.gpu_env[1], "DDPRUN_CUDA_DEVICE") == "1");
  }
  const auto pet_gpus = parse_gpus(sb, 4, {"--nproc-per-node", "2", "train.py"}, {{"PET_GPUS", "2,3"}});
  REQUIRE(pet_gpus.config.gpu_env.size() == 2);
  CHECK(env_value(pet_gpus.config.gpu_env[0], "CUDA_VISIBLE_DEVICES") == "2,3");

  for (const std::string spelling : {"--gpu-isolation", "--gpu_isolation"}) {
    INFO(spelling);
    const auto o = parse_gpus(sb, 4, {spelling, "--nproc-per-node", "2", "train.py"}, cvd);
    REQUIRE(o.config.gpu_env.size() == 2);
    CHECK(env_value(o.config.gpu_env[1], "CUDA_VISIBLE_DEVICES") == "1");
    CHECK(env_value(o.config.gpu_env[1], "DDPRUN_CUDA_DEVICE") == "0");
    REQUIRE(o.config.gpu_devices.size() == 2);
    CHECK_THAT(o.config.gpu_devices[1], Contains("GPU 1"));
  }
  const auto pet_iso = parse_gpus(sb, 4, {"--nproc-per-node", "2", "train.py"}, {{"PET_GPU_ISOLATION", "1"}});
  REQUIRE(pet_iso.config.gpu_env.size() == 2);
  CHECK(env_value(pet_iso.config.gpu_env[1], "CUDA_VISIBLE_DEVICES") != "<unset>");

  // More workers than devices: an error naming the count, unless sharing is allowed.
  CHECK_THROWS_AS(parse_gpus(sb, 2, {"--gpu-isolation", "--nproc-per-node", "3", "train.py"}), UsageError);
  for (const Strings& sharing : {Strings{"--gpu-sharing"}, Strings{"--gpu_sharing"}}) {
    Strings full = sharing;
    full.insert(full.end(), {"--gpu-isolation", "--nproc-per-node", "3", "train.py"});
    const auto o = parse_gpus(sb, 2, full);
    REQUIRE(o.config.gpu_env.size() == 3);
    CHECK(env_value(o.config.gpu_env[2], "CUDA_VISIBLE_DEVICES") ==
          env_value(o.config.gpu_env[0], "CUDA_VISIBLE_DEVICES"));
  }
  CHECK(parse_gpus(sb, 2, {"--gpu-isolation", "--nproc-per-node", "3", "train.py"}, {{"PET_GPU_SHARING", "1"}})
            .config.gpu_env.size() == 3);
  // Bad --gpus entries name the flag.
  CHECK_THROWS_WITH(parse_gpus(sb, 2, {"--gpus", "5", "train.py"}), Contains("--gpus"));
  CHECK_THROWS_WITH(parse_gpus(sb, 2, {"--gpus", "", "train.py"}), Contains("--gpus"));
  CHECK_THROWS_WITH(parse_gpus(sb, 0, {"--gpu-isolation", "train.py"}), Contains("GPU"));
}

TEST_CASE("--virtual-local-rank goes through the GPU plan when there are GPUs") {
  Sandbox sb;
  const auto o = parse_gpus(sb, 4, {"--virtual-local-rank", "--nproc-per-node", "2", "train.py"},
                            {{"CUDA_VISIBLE_DEVICES", "2,3"}});
  CHECK(o.config.virtual_local_rank);
  REQUIRE(o.config.gpu_env.size() == 2);
  CHECK(env_value(o.config.gpu_env[1], "LOCAL_RANK") == "0");
  CHECK(env_value(o.config.gpu_env[1], "CUDA_VISIBLE_DEVICES") == "3");
  // Without any GPU it stays torchrun's plain behaviour (build_worker_env), no plan.
  const auto cpu = parse_gpus(sb, 0, {"--virtual-local-rank", "--nproc-per-node", "2", "train.py"});
  CHECK(cpu.config.virtual_local_rank);
  CHECK(cpu.config.gpu_env.empty());
}

TEST_CASE("--nccl-id and --nccl-roots") {
  Sandbox sb;
  using Mode = AgentConfig::NcclIdMode;
  CHECK(sb.parse({"train.py"}).config.nccl_id == Mode::automatic);
  CHECK(sb.parse({"train.py"}).config.nccl_roots == 0);
  CHECK(sb.parse({"--nccl-id", "env", "train.py"}).config.nccl_id == Mode::env);
  CHECK(sb.parse({"--nccl_id", "off", "train.py"}).config.nccl_id == Mode::off);
  CHECK(sb.parse({"--nccl-id=AUTO", "train.py"}).config.nccl_id == Mode::automatic);
  CHECK(sb.parse({"train.py"}, {{"PET_NCCL_ID", "off"}}).config.nccl_id == Mode::off);
  CHECK(sb.parse({"--nccl-id", "env", "train.py"}, {{"PET_NCCL_ID", "off"}}).config.nccl_id == Mode::env);
  CHECK(sb.parse({"--nccl-id", "comm-id", "train.py"}).config.nccl_id == Mode::comm_id);
  CHECK_THROWS_WITH(sb.parse({"--nccl-id", "maybe", "train.py"}), Contains("--nccl-id=maybe"));
  CHECK_THROWS_WITH(sb.parse({"train.py"}, {{"PET_NCCL_ID", "x"}}), Contains("PET_NCCL_ID=x"));
  CHECK(sb.parse({"--nccl-roots", "3", "train.py"}).config.nccl_roots == 3);
  CHECK(sb.parse({"--nccl_roots", "2", "train.py"}).config.nccl_roots == 2);
  CHECK(sb.parse({"train.py"}, {{"PET_NCCL_ROOTS", "4"}}).config.nccl_roots == 4);
  CHECK_THROWS_WITH(sb.parse({"--nccl-roots", "0", "train.py"}), Contains("--nccl-roots=0"));
  CHECK_THROWS_WITH(sb.parse({"--nccl-roots", "x", "train.py"}), Contains("--nccl-roots=x"));
}

TEST_CASE("parsing stops at the program: the rest is passed untouched") {
  Sandbox sb;
  const auto o = sb.parse({"--nproc-per-node", "2", "train.py", "--nproc-per-node", "5", "-m", "x"});
  CHECK(o.config.nproc_per_node == 2);
  CHECK(o.config.worker_argv == Strings{sb.path("bin/python3"), "-u", "train.py", "--nproc-per-node", "5", "-m", "x"});
  CHECK(o.config.user_args_index == 3);  // where a legacy --local-rank argument goes

  const auto help_after = sb.parse({"train.py", "--help", "--version", "--", "-h"});
  CHECK(help_after.command == CommandKind::run);
  CHECK(help_after.config.worker_argv ==
        Strings{sb.path("bin/python3"), "-u", "train.py", "--help", "--version", "--", "-h"});

  const auto module = sb.parse({"--master-port", "1234", "-m", "pkg.train", "--standalone", "--lr=3"});
  CHECK_FALSE(module.config.standalone);
  CHECK(module.config.worker_argv ==
        Strings{sb.path("bin/python3"), "-u", "-m", "pkg.train", "--standalone", "--lr=3"});
  CHECK(module.config.user_args_index == 4);

  const auto exe = sb.parse({"--no-python", "tool", "-r", "3", "--nnodes=9"});
  CHECK(exe.config.redirects_all == Streams::none);
  CHECK(exe.config.max_nodes == 1);
  CHECK(exe.config.worker_argv == Strings{sb.path("bin/tool"), "-r", "3", "--nnodes=9"});
  CHECK(exe.config.user_args_index == 1);

  // "--" ends ddprun's options explicitly.
  CHECK(sb.parse({"--nproc-per-node", "2", "--", "train.py", "x"}).config.worker_argv ==
        Strings{sb.path("bin/python3"), "-u", "train.py", "x"});
  // argparse drops the first "--" of the line: right after the program too (torchrun
  // `train.py -- --lr 0.1` gives the script ['--lr', '0.1']), and no later one.
  const std::string py = sb.path("bin/python3");
  const auto after = sb.parse({"train.py", "--", "--lr", "0.1"});
  CHECK(after.config.worker_argv == Strings{py, "-u", "train.py", "--lr", "0.1"});
  CHECK(after.config.user_args_index == 3);
  CHECK(sb.parse({"train.py", "--"}).config.worker_argv == Strings{py, "-u", "train.py"});
  CHECK(sb.parse({"train.py", "--", "--"}).config.worker_argv == Strings{py, "-u", "train.py", "--"});
  CHECK(sb.parse({"train.py", "a", "--", "b"}).config.worker_argv == Strings{py, "-u", "train.py", "a", "--", "b"});
  CHECK(sb.parse({"--", "train.py", "--", "b"}).config.worker_argv == Strings{py, "-u", "train.py", "--", "b"});
  CHECK(sb.parse({"-m", "pkg.train", "--", "--lr=3"}).config.worker_argv ==
        Strings{py, "-u", "-m", "pkg.train", "--lr=3"});
  CHECK(sb.parse({"--no-python", "tool", "--", "-x"}).config.worker_argv == Strings{sb.path("bin/tool"), "-x"});
  // Arguments with spaces and empty arguments survive.
  CHECK(sb.parse({"train.py", "a b", ""}).config.worker_argv ==
        Strings{sb.path("bin/python3"), "-u", "train.py", "a b", ""});
}

TEST_CASE("--flag= is an empty value, as argparse reads it, never the next word") {
  // What `--master_addr=$ADDR` becomes when ADDR is unset: CLI11 alone took the next word as the
  // value (MASTER_ADDR=--master_port=29652, and that flag lost).
  Sandbox sb;
  CHECK_THROWS_WITH(sb.parse({"--master_addr=", "--master_port=29652", "train.py"}),
                    Contains("--master-addr=: not a host name"));
  CHECK_THROWS_WITH(sb.parse({"--rdzv_id=", "--nnodes", "2", "train.py"}), Contains("--rdzv-id is empty"));
  CHECK_THROWS_WITH(sb.parse({"--log-dir=", "--tee", "3", "train.py"}), Contains("--log-dir is empty"));
  CHECK_THROWS_WITH(sb.parse({"--role=", "train.py", "x"}), Contains("--role is empty"));
  CHECK_THROWS_WITH(sb.parse({"--rol=", "train.py"}), Contains("--role is empty"));  // an abbreviation too
  // An empty value where the flag's default is the empty one is that default.
  const auto o = sb.parse({"--local-ranks-filter=", "--nproc-per-node=2", "train.py"});
  CHECK(o.config.nproc_per_node == 2);
  CHECK(o.config.worker_argv == Strings{sb.path("bin/python3"), "-u", "train.py"});
}

TEST_CASE("a per-rank list naming a local rank past --nproc-per-node is said to be ignored") {
  Sandbox sb;
  const auto o = sb.parse(
      {"--nproc-per-node", "2", "--redirects", "0:3,4:1", "--tee", "1:2", "--local-ranks-filter", "1,2,7", "train.py"});
  CHECK(has_note(o, "--redirects: local rank(s) 4 ignored: this node runs local ranks 0..1 (--nproc-per-node 2)"));
  CHECK(has_note(o, "--local-ranks-filter: local rank(s) 2,7 ignored: this node runs local ranks 0..1"));
  CHECK_FALSE(has_note(o, "--tee:"));
  CHECK(o.config.local_ranks_filter == std::set<int>{1, 2, 7});  // kept as given, as torchrun
  // Within range, or a form for every rank: nothing to say.
  const auto quiet = sb.parse({"--nproc-per-node", "3", "--redirects", "3", "--local-ranks-filter", "0,2", "train.py"});
  CHECK_FALSE(has_note(quiet, "ignored"));
}

TEST_CASE("a switch given a value is refused, as argparse refuses it") {
  // CLI11 alone read --standalone=false as off and --no-python= as on; argparse says "ignored
  // explicit argument" for any value, the empty one too.
  Sandbox sb;
  for (const Strings& args : {Strings{"--standalone=1", "train.py"}, Strings{"--standalone=false", "train.py"},
                              Strings{"--standalone=", "train.py"}, Strings{"--stand=", "train.py"},
                              Strings{"--no_python=0", "tool"}, Strings{"--run-path=yes", "train.py"}}) {
    CHECK_THROWS_AS(sb.parse(args), UsageError);
    CHECK_THROWS_WITH(sb.parse(args), Contains("is a switch and takes no value, got " + args.front()));
  }
  CHECK(sb.parse({"--standalone", "train.py"}).config.standalone);
  CHECK_THROWS_WITH(sb.parse({"-m=pkg.train"}),
                    Contains("-m (--module) is a switch and takes no value, got -m=pkg.train"));
}

TEST_CASE("usage errors: no program, unknown options, missing values") {
  Sandbox sb;
  CHECK_THROWS_WITH(sb.parse({}), Contains("no training program"));
  CHECK_THROWS_WITH(sb.parse({"--nproc-per-node", "2"}), Contains("no training program"));
  CHECK_THROWS_WITH(sb.parse({"--bogus", "train.py"}), Contains("unknown option --bogus"));
  CHECK_THROWS_WITH(sb.parse({"--nnodes"}), Contains("--nnodes"));
  CHECK_THROWS_AS(sb.parse({"--nnodes"}), UsageError);
  CHECK_THROWS_WITH(sb.parse({"missing.py"}), Contains("'missing.py' not found"));
  CHECK_THROWS_WITH(sb.parse({"--no-python", "-m", "pkg"}), Contains("--no-python") && Contains("-m/--module"));
}

TEST_CASE("bad values name the flag") {
  Sandbox sb;
  const std::vector<std::pair<Strings, std::string>> cases = {
      {{"--nnodes=2:1"}, "--nnodes=2:1: MIN must be <= MAX"},
      {{"--nproc_per_node", "x"}, "--nproc-per-node=x"},
      {{"--rdzv-backend", "etcd"}, "--rdzv-backend=etcd"},
      {{"--rdzv-backend", "zk"}, "--rdzv-backend=zk"},
      {{"--rdzv-backend", "c10d"}, "--rdzv-endpoint"},
      {{"--rdzv-endpoint", "h:99999"}, "--rdzv-endpoint"},
      {{"--rdzv-endpoint", "a:1,b:2"}, "--rdzv-endpoint=a:1,b:2: a list of endpoints is for --rdzv-backend=c10d"},
      {{"--rdzv-backend", "c10d", "--rdzv-endpoint", "a:1,b:0"},
       "port 0 (host the rendezvous here) cannot be in a list"},
      {{"--rdzv-backend", "c10d", "--rdzv-endpoint", "a:1,,b:2"}, "an empty endpoint in the list"},
      {{"--rdzv-conf", "novalue"}, "--rdzv-conf=novalue"},
      {{"--max-restarts", "-1"}, "--max-restarts=-1"},
      {{"--monitor-interval", "fast"}, "--monitor-interval=fast"},
      {{"--start-method", "thread"}, "--start-method=thread"},
      {{"--redirects", "5"}, "--redirects=5"},
      {{"-t", "0:9"}, "--tee=0:9"},
      {{"--local-ranks-filter", "a"}, "--local-ranks-filter=a"},
      {{"--node-rank", "x"}, "--node-rank=x"},
      {{"--nnodes", "2", "--node-rank", "2"}, "--node-rank=2 is not below --nnodes=2"},
      {{"--master-port", "70000"}, "--master-port=70000"},
      {{"--nnodes", "2", "--master-addr", "[::1"}, "--master-addr"},
      {{"--metrics-port", "70000"}, "--metrics-port=70000"},
      {{"--metrics-port", "0", "--metrics-host", "node1"}, "--metrics-host=node1: not an IP address"},
      {{"--metrics-host", "0.0.0.0"}, "--metrics-host is given without --metrics-port"},
      {{"--signals-to-handle", "SIGNOPE"}, "--signals-to-handle=SIGNOPE"},
      {{"--shutdown-timeout", "-3"}, "--shutdown-timeout=-3"},
      {{"--kill-timeout", "0"}, "--kill-timeout=0: must be more than 0"},
      {{"--kill-timeout", "soon"}, "--kill-timeout=soon: not a number of seconds"},
      {{"--local-rank-arg", "both"}, "--local-rank-arg=both"},
      {{"--log-level", "loud"}, "--log-level=loud"},
      {{"--numa-binding", "near"}, "--numa-binding='near'"},
      {{"--logs-specs", "x"}, "--logs-specs=x: ddprun cannot load torchrun.logs_specs"},
      {{"--event-log-handler", "syslog"}, "--event-log-handler=syslog"},
      {{"--use-env", "--local-rank-arg", "dash"}, "--use-env and --local-rank-arg"},
      {{"--role", ""}, "--role"},
      {{"--standalone", "--nnodes", "2"}, "--standalone"},
  };
  for (const auto& [args, text] : cases) {
    Strings full = args;
    full.push_back("train.py");
    INFO("args: " << Catch::StringMaker<Strings>::convert(full));
    CHECK_THROWS_AS(sb.parse(full), UsageError);
    CHECK_THROWS_WITH(sb.parse(full), Contains(text));
  }
  // No PET form for --numa-binding / --logs-specs: the variables are ignored.
  CHECK_NOTHROW(sb.parse({"train.py"}, {{"PET_NUMA_BINDING", "node"}, {"PET_LOGS_SPECS", "x"}}));
}

TEST_CASE("--standalone overrides the rendezvous settings") {
  Sandbox sb;
  const auto o = sb.parse({"--standalone", "--rdzv-backend", "static", "--rdzv-endpoint", "h:1", "--rdzv-id", "x",
                           "--master-port", "5", "train.py"});
  const std::regex uuid4("[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}");
  CHECK(o.config.standalone);
  CHECK(o.config.rdzv_backend == "c10d");
  CHECK(o.config.rdzv_endpoint == "localhost:0");
  CHECK(std::regex_match(o.config.run_id, uuid4));
  CHECK(o.config.master_port == 0);
  CHECK(has_note(o, "--standalone: ignoring --rdzv-backend=static, --rdzv-endpoint=h:1, --rdzv-id=x, --master-port=5"));
  // --master-addr too, from the flag or PET_MASTER_ADDR (Kubeflow sets it in every pod): before,
  // a standalone job hosted its store there, and failed (an address not this machine's) or hung
  // (a name that does not resolve) where torchrun ignores it.
  const std::string default_addr = sb.parse({"train.py"}).config.master_addr;
  const auto addr = sb.parse({"--standalone", "--master-addr", "10.255.255.1", "train.py"});
  CHECK(addr.config.master_addr == default_addr);
  CHECK(has_note(addr, "--standalone: ignoring --master-addr=10.255.255.1"));
  const auto pet = sb.parse({"--standalone", "train.py"}, {{"PET_MASTER_ADDR", "somehost.invalid"}});
  CHECK(pet.config.master_addr == default_addr);
  CHECK(has_note(pet, "--standalone: ignoring PET_MASTER_ADDR=somehost.invalid"));
  // Without --standalone, and with a port (one node without one is standalone too), it is used.
  CHECK(sb.parse({"--master-addr", "10.255.255.1", "--master-port", "29500", "train.py"}).config.master_addr ==
        "10.255.255.1");
  // An ignored --master-port is still a port, as torchrun's argparse (type=int) reads it.
  CHECK_THROWS_WITH(sb.parse({"--standalone", "--master-port", "abc", "train.py"}),
                    Contains("--master-port=abc: not a port"));
  CHECK_THROWS_WITH(sb.parse({"--rdzv-endpoint", "127.0.0.1:5", "--master-port", "x1", "train.py"}),
                    Contains("--master-port=x1: not a port"));
  // Without explicit values there is nothing to note, and each run gets its own id.
  const auto a = sb.parse({"--standalone", "train.py"});
  const auto b = sb.parse({"--standalone", "train.py"});
  CHECK(a.notes.empty());
  CHECK(a.config.run_id != b.config.run_id);
  // A bad rdzv value is ignored rather than rejected, as torchrun ignores it.
  CHECK_NOTHROW(sb.parse({"--standalone", "--rdzv-backend", "etcd", "train.py"}));
  // So is the node rank (torchrun's --standalone is c10d, which ranks the nodes itself).
  const auto ranked = sb.parse({"--standalone", "--node-rank", "1", "train.py"});
  CHECK(ranked.config.node_rank == 0);
  CHECK(has_note(ranked, "--standalone: ignoring --node-rank=1"));
  CHECK(sb.parse({"--standalone", "train.py"}, {{"PET_NODE_RANK", "3"}}).config.node_rank == 0);
  CHECK(sb.parse({"--standalone", "train.py"}, {{"PET_NODE_RANK", "0"}}).notes.empty());
  CHECK_THROWS_WITH(sb.parse({"--standalone", "--node-rank", "x", "train.py"}), Contains("--node-rank=x"));
}

TEST_CASE("the static backend meets at --rdzv-endpoint when one is given, as torchrun") {
  Sandbox sb;
  // One node: the agent's store (MASTER_ADDR/MASTER_PORT of the workers) is there.
  const auto one = sb.parse({"--rdzv-endpoint", "127.0.0.1:29601", "train.py"});
  CHECK(one.config.master_addr == "127.0.0.1");
  CHECK(one.config.master_port == 29601);
  CHECK(one.notes.empty());
  CHECK(sb.parse({"train.py"}, {{"PET_RDZV_ENDPOINT", "h:9"}}).config.master_port == 9);
  // Several nodes: node rank 0 serves there and the others join there.
  const auto two = sb.parse({"--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "127.0.0.3:29711", "train.py"});
  CHECK(two.config.master_addr == "127.0.0.3");
  CHECK(two.config.master_port == 29711);
  // With --master-addr/--master-port too, the endpoint wins (torchrun's get_rdzv_endpoint).
  const auto both =
      sb.parse({"--master-addr", "10.0.0.1", "--master-port", "5", "--rdzv-endpoint", "10.0.0.2:6", "train.py"});
  CHECK(both.config.master_addr == "10.0.0.2");
  CHECK(both.config.master_port == 6);
  CHECK(has_note(both, "ignoring --master-addr=10.0.0.1, --master-port=5"));
  // torchrun refuses a static endpoint without a port; port 0 is a free port, for one node only.
  CHECK_THROWS_WITH(sb.parse({"--rdzv-endpoint", "node1", "train.py"}),
                    Contains("--rdzv-endpoint=node1: the static backend needs a port"));
  CHECK(sb.parse({"--rdzv-endpoint", "127.0.0.1:0", "train.py"}).config.master_port == 0);
  CHECK_THROWS_WITH(sb.parse({"--nnodes", "2", "--rdzv-endpoint", "h:0", "train.py"}),
                    Contains("got 0 from --rdzv-endpoint"));
  // The other backends keep the master address and port apart from the endpoint.
  const auto c10d = sb.parse({"--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "train.py"});
  CHECK(c10d.config.master_addr == "127.0.0.1");
  CHECK(c10d.config.master_port == 29500);
}

TEST_CASE("--log-dir /dev/null means no log files, as torch 2.6's os.devnull") {
  Sandbox sb;
  for (const auto& args :
       {Strings{"--log-dir", "/dev/null", "train.py"}, Strings{"--log_dir=/dev//null", "train.py"}}) {
    const auto o = sb.parse(args);
    CHECK(o.config.no_log_files);
    CHECK_FALSE(o.config.log_dir.has_value());  // ddprun's run directory is the temporary one
    CHECK(o.notes.empty());
  }
  CHECK(sb.parse({"train.py"}, {{"PET_LOG_DIR", "/dev/null"}}).config.no_log_files);
  CHECK_FALSE(sb.parse({"--log-dir", "/dev/nulls", "train.py"}).config.no_log_files);
  // Nothing can be written to a file: redirected and tee'd streams stay on the console (as in
  // torch 2.6), the filters' copies are dropped; the note names what is ignored.
  const auto o = sb.parse(
      {"--log-dir", "/dev/null", "--redirects", "3", "-t", "0:1", "--duplicate-stdout-filters", "loss", "train.py"});
  CHECK(o.config.no_log_files);
  CHECK(o.config.redirects_all == Streams::none);
  CHECK(o.config.tee.empty());
  CHECK(o.config.duplicate_stdout_filters.empty());
  CHECK(has_note(o,
                 "--log-dir=/dev/null writes no log files: ignoring --redirects=3, --tee=0:1, "
                 "--duplicate-stdout-filters=loss"));
}

TEST_CASE("shutdown timeout: flag, PET_*, TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s") {
  Sandbox sb;
  using ms = std::chrono::milliseconds;
  CHECK(sb.parse({"train.py"}, {{"TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "7"}}).config.shutdown_timeout == ms(7000));
  CHECK(sb.parse({"train.py"}, {{"TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "7"}, {"PET_SHUTDOWN_TIMEOUT", "3"}})
            .config.shutdown_timeout == ms(3000));
  CHECK(sb.parse({"--shutdown-timeout", "0", "train.py"}, {{"TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "7"}})
            .config.shutdown_timeout == ms(0));
  CHECK_THROWS_WITH(sb.parse({"train.py"}, {{"TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "soon"}}),
                    Contains("TORCH_ELASTIC_SHUTDOWN_TIMEOUT=soon"));
}

TEST_CASE("log level: flag, DDPRUN_LOG_LEVEL, LOGLEVEL, info") {
  Sandbox sb;
  CHECK(sb.parse({"train.py"}, {{"LOGLEVEL", "WARNING"}}).log_level == spdlog::level::warn);
  CHECK(sb.parse({"train.py"}, {{"LOGLEVEL", "WARNING"}, {"DDPRUN_LOG_LEVEL", "trace"}}).log_level ==
        spdlog::level::trace);
  CHECK(sb.parse({"--log-level", "error", "train.py"}, {{"DDPRUN_LOG_LEVEL", "trace"}}).log_level ==
        spdlog::level::err);
  const auto bad_env = sb.parse({"train.py"}, {{"LOGLEVEL", "20"}});
  CHECK(bad_env.log_level == spdlog::level::info);
  CHECK(has_note(bad_env, "LOGLEVEL=20"));
}

TEST_CASE("log line prefix template comes from TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE") {
  Sandbox sb;
  CHECK(
      sb.parse({"train.py"}, {{"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "${rank}|"}}).config.log_line_prefix_template ==
      "${rank}|");
}

TEST_CASE("--help and --version") {
  Sandbox sb;
  for (const char* h : {"--help", "-h"}) {
    const auto o = sb.parse({"--nproc-per-node", "2", h});
    CHECK(o.command == CommandKind::help);
    CHECK_THAT(o.text, Contains("--nproc-per-node") && Contains("--nproc_per_node") && Contains("PET_NPROC_PER_NODE") &&
                           Contains("--monitor-interval") && Contains("event") && Contains("--local-rank-arg") &&
                           Contains("Exit codes"));
  }
  const auto v = sb.parse({"--version"});
  CHECK(v.command == CommandKind::version);
  CHECK(v.text == std::string("ddprun ") + ddprun::version_string + "\n");
  // --version needs no program, and wins over a missing one.
  CHECK(sb.parse({"--version", "--nnodes", "1"}).command == CommandKind::version);
}

TEST_CASE("argc/argv overload skips argv[0]") {
  Sandbox sb;
  const char* argv[] = {"ddprun", "--nproc-per-node", "4", "train.py", "z"};
  const auto o = parse_command_line(5, argv, sb.context());
  CHECK(o.config.nproc_per_node == 4);
  CHECK(o.config.worker_argv == Strings{sb.path("bin/python3"), "-u", "train.py", "z"});
}

TEST_CASE("ParseContext::from_process reads the real environment") {
  const auto ctx = ParseContext::from_process();
  CHECK(ctx.online_cpus == 0);  // asked only when --nproc-per-node needs it
  CHECK(ctx.cpus() == static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN)));
  CHECK(ctx.cwd == std::filesystem::current_path());
  CHECK(ctx.env.contains("PATH"));
}

TEST_CASE("a flag's value is not the next option: an empty shell variable is an error, as with argparse") {
  Sandbox sb;
  // --rdzv-id $JOB with JOB empty: before, --rdzv-backend=c10d became the run id and the backend
  // stayed static.
  CHECK_THROWS_WITH(
      sb.parse({"--nnodes", "2", "--rdzv-id", "--rdzv-backend=c10d", "--rdzv-endpoint", "h1:29400", "train.py"}),
      Contains("--rdzv-id expects a value, got the option --rdzv-backend=c10d"));
  CHECK_THROWS_WITH(sb.parse({"--log-dir", "--no-python", "/bin/true"}),
                    Contains("--log-dir expects a value, got the option --no-python"));
  CHECK_THROWS_WITH(sb.parse({"--max-re", "--standalone", "train.py"}),
                    Contains("--max-restarts expects a value, got the option --standalone"));
  CHECK_THROWS_WITH(sb.parse({"-r", "-t", "0:1", "train.py"}), Contains("-r expects a value, got the option -t"));
  // '-' alone and negative numbers are values (argparse's rule); so is anything after '='.
  CHECK(sb.parse({"--role", "-", "train.py"}).config.role == "-");
  CHECK_THROWS_WITH(sb.parse({"--max-restarts", "-1", "train.py"}), Contains("--max-restarts=-1: out of range"));
  CHECK_THROWS_WITH(sb.parse({"--monitor-interval", "-0.5", "train.py"}), !Contains("expects a value"));
  CHECK_THROWS_WITH(sb.parse({"--monitor-interval", "-1e-3", "train.py"}), !Contains("expects a value"));
  CHECK(sb.parse({"--log-line-prefix-template", "-[${rank}] ", "train.py"}).config.log_line_prefix_template ==
        "-[${rank}] ");
  // ... unless it names a flag before its '=' (argparse matches options first).
  CHECK_THROWS_WITH(sb.parse({"--rdzv-id", "--rdzv-conf=join_timeout=900, read_timeout=60", "train.py"}),
                    Contains("--rdzv-id expects a value"));
  CHECK(sb.parse({"--role=-x", "train.py"}).config.role == "-x");
  // The program's own arguments are not flags of ddprun.
  CHECK(sb.parse({"train.py", "--lr", "--x"}).config.worker_argv.back() == "--x");
}

TEST_CASE("unambiguous abbreviations of long options work, as with argparse") {
  Sandbox sb;
  const auto o =
      sb.parse({"--nproc", "3", "--max_re=2", "--stand", "--master-a", "10.0.0.1", "train.py", "--nproc", "9"});
  CHECK(o.config.nproc_per_node == 3);
  CHECK(o.config.max_restarts == 2);
  CHECK(o.config.standalone);
  CHECK(has_note(o, "--standalone: ignoring --master-addr=10.0.0.1"));  // read, and ignored as torchrun
  CHECK(o.config.worker_argv == Strings{sb.path("bin/python3"), "-u", "train.py", "--nproc", "9"});
  // A value that looks like an abbreviation is left alone; as the next word it is an option, and
  // the flag before has no value (argparse: "expected one argument").
  CHECK(sb.parse({"--role=--nproc", "train.py"}).config.role == "--nproc");
  CHECK_THROWS_WITH(sb.parse({"--role", "--nproc", "train.py"}),
                    Contains("--role expects a value, got the option --nproc") && Contains("--role=VALUE"));
  CHECK_THROWS_WITH(sb.parse({"--n", "2", "train.py"}),
                    Contains("ambiguous option --n") && Contains("--nnodes") && Contains("--nproc-per-node"));
  CHECK_THROWS_WITH(sb.parse({"--master", "h", "train.py"}), Contains("--master-addr") && Contains("--master-port"));
  // Short options with attached values.
  const auto s = sb.parse({"-r3", "-t", "0:1", "train.py"});
  CHECK(s.config.redirects_all == Streams::both);
  CHECK(s.config.tee == std::map<int, Streams>{{0, Streams::out}});
}

TEST_CASE("a prefix torchrun reads as one of its flags means that flag, whatever ddprun-only flags share it") {
  Sandbox sb;
  // torch 1.13 and 2.6: --node_rank (ddprun also has --node-label and --node-order).
  CHECK(sb.parse({"--nnodes", "2", "--node", "1", "train.py"}).config.node_rank == 1);
  CHECK(sb.parse({"--nnodes=2", "--node=1", "train.py"}).config.node_rank == 1);
  // torch 1.13: --log_dir (2.6 adds --logs-specs; ddprun --log-level and
  // --log-line-prefix-template); --lo likewise.
  CHECK(sb.parse({"--log", "logs", "train.py"}).config.log_dir == sb.dir() / "logs");
  CHECK(sb.parse({"--lo=logs", "train.py"}).config.log_dir == sb.dir() / "logs");
  // --redirects (ddprun: --remote-ddprun, --remote-cwd).
  CHECK(sb.parse({"--re", "3", "train.py"}).config.redirects_all == Streams::both);
  // torch 2.6: --local-ranks-filter (ddprun: --local-rank-arg), either spelling.
  CHECK(sb.parse({"--local-r", "0", "train.py"}).config.local_ranks_filter == std::set<int>{0});
  CHECK(sb.parse({"--local_r=1", "train.py"}).config.local_ranks_filter == std::set<int>{1});
  // --help (ddprun: --hang-timeout, --hostfile, --hosts).
  CHECK(sb.parse({"--h"}).command == CommandKind::help);
  CHECK(sb.parse({"--he", "train.py"}).command == CommandKind::help);
  // Current torchrun's flags: --virtual-local-rank (ddprun: --version), --log-line-prefix-template
  // (ddprun: --log-level). --pr stays ambiguous: --prefix-output and --print-completion.
  CHECK(sb.parse({"--v", "train.py"}).config.virtual_local_rank);
  CHECK(sb.parse({"--vir", "train.py"}).config.virtual_local_rank);
  CHECK(sb.parse({"--ver"}).command == CommandKind::version);
  CHECK(sb.parse({"--log-l", "<$rank>", "train.py"}).config.log_line_prefix_template == "<$rank>");
  CHECK(sb.parse({"--log-le", "debug", "train.py"}).log_level == spdlog::level::debug);
  CHECK_THROWS_WITH(sb.parse({"--pr", "bash"}), Contains("ambiguous option --pr"));
  CHECK(sb.parse({"--pri", "bash"}).command == CommandKind::completion);
  CHECK(sb.parse({"--pre", "train.py"}).config.prefix_console);
  // Ambiguous for torchrun too, or only among ddprun's flags: still an error.
  CHECK_THROWS_WITH(sb.parse({"--local", "x", "train.py"}),
                    Contains("ambiguous option --local") && Contains("--local-addr"));
  CHECK_THROWS_WITH(sb.parse({"--no", "train.py"}), Contains("ambiguous option --no"));
  CHECK_THROWS_WITH(sb.parse({"--nc", "1", "train.py"}), Contains("ambiguous option --nc"));
  CHECK_THROWS_WITH(sb.parse({"--ho", "a", "train.py"}), Contains("ambiguous option --ho"));
}

TEST_CASE("--print-completion bash|zsh (a flag proposed for torchrun); tcsh is not supported yet") {
  Sandbox sb;
  const auto bash = sb.parse({"--print-completion", "bash"});
  CHECK(bash.command == CommandKind::completion);
  CHECK(bash.text == "bash");
  CHECK(sb.parse({"--print_completion=zsh"}).text == "zsh");
  CHECK(sb.parse({"--nproc-per-node", "2", "--print-completion", "zsh", "train.py"}).command ==
        CommandKind::completion);
  CHECK_THROWS_WITH(sb.parse({"--print-completion", "tcsh"}), Contains("tcsh is not supported yet"));
  CHECK_THROWS_AS(sb.parse({"--print-completion", "fish"}), UsageError);
  CHECK_THROWS_AS(sb.parse({"--print-completion"}), UsageError);
  // No environment form (torchrun has none): PET_PRINT_COMPLETION starts nothing.
  CHECK(sb.parse({"train.py"}, {{"PET_PRINT_COMPLETION", "bash"}}).command == CommandKind::run);
}

TEST_CASE("a peer tool's option is never taken as an abbreviation of another ddprun flag") {
  Sandbox sb;
  // DeepSpeed's --launcher pdsh used to become --launcher-addr pdsh.
  CHECK_THROWS_WITH(sb.parse({"--launcher", "pdsh", "--hosts", "a,b", "train.py"}),
                    Contains("--launcher is DeepSpeed's option") && Contains("--launcher-addr") &&
                        Contains("write --launcher-addr in full"));
  CHECK_THROWS_WITH(sb.parse({"--launcher=openmpi", "train.py"}), Contains("DeepSpeed's option"));
  CHECK_THROWS_WITH(sb.parse({"--np", "8", "train.py"}),
                    Contains("--np is mpirun's and horovodrun's option") && Contains("--nproc-per-node"));
  CHECK_THROWS_WITH(sb.parse({"--prefix", "/opt/ompi", "train.py"}), Contains("mpirun's option"));
  // Other abbreviations of the same flags still work, and so do the full names.
  CHECK(sb.parse({"--nproc", "2", "train.py"}).config.nproc_per_node == 2);
  CHECK(sb.parse({"--prefix-o", "train.py"}).config.prefix_console);
}
