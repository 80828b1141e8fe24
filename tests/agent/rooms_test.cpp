// The pure pieces of the agent's rooms: the job mode decision, worker_spec() (what is spawned
// and what --dry-run prints), the round's NCCL decision and the placement a rendezvous
// assignment converts to.
#include <catch2/catch.hpp>
#include <csignal>

#include <map>

#include "ddprun/agent/config.hpp"
#include "ddprun/agent/elastic.hpp"
#include "ddprun/agent/nccl_ids.hpp"
#include "ddprun/agent/worker_spec.hpp"

using namespace ddprun::agent;
namespace we = ddprun::worker_env;

namespace {

AgentConfig base() {
  AgentConfig c;
  c.worker_argv = {"/usr/bin/python3", "-u", "train.py", "--lr", "1"};
  return c;
}

std::map<std::string, std::string> as_map(const we::EnvList& env) { return {env.begin(), env.end()}; }

std::vector<std::uint8_t> ids(std::size_t n, std::uint8_t fill) {
  return std::vector<std::uint8_t>(n * we::nccl_unique_id_bytes, fill);
}

}  // namespace

TEST_CASE("job mode: decided once from standalone, backend and nnodes") {
  AgentConfig c = base();
  CHECK(decide_job_mode(c) == JobMode::single_node);
  c.max_nodes = 2;
  CHECK(decide_job_mode(c) == JobMode::static_multi_node);
  c.rdzv_backend = "c10d";
  CHECK(decide_job_mode(c) == JobMode::elastic);
  c.max_nodes = 1;
  CHECK(decide_job_mode(c) == JobMode::elastic);  // c10d with one node still joins the rendezvous
  c.standalone = true;
  CHECK(decide_job_mode(c) == JobMode::single_node);
  // A mode set by the launcher wins over the fields.
  c.job_mode = JobMode::static_multi_node;
  CHECK(job_mode(c) == JobMode::static_multi_node);
  CHECK(is_static_multi_node(c));
  CHECK(std::string(to_string(JobMode::elastic)) == "elastic");
}

TEST_CASE("worker_spec: argv, env layering, cwd, cpus, routes and prefix") {
  AgentConfig c = base();
  c.nproc_per_node = 2;
  c.local_rank_arg = AgentConfig::LocalRankArg::underscore;
  c.user_args_index = 3;
  c.working_dir = "/work/dir";
  c.cpu_binding = {{0, 1}, {2, 3}};
  c.gpu_devices = {"cuda:0", "cuda:1"};
  c.gpu_env = {{{"CUDA_VISIBLE_DEVICES", "0"}, {"OMP_NUM_THREADS", "4"}}, {{"CUDA_VISIBLE_DEVICES", "1"}}};
  c.log_line_prefix_template = "[${role_name}${local_rank}:${rank}]:";
  we::Placement p = local_placement(c);
  p.rank_offset = 6;
  p.world_size = 8;
  const AttemptContext attempt{"/logs/attempt_0", {{"DDPRUN_NCCL_UNIQUE_ID", "ab"}, {"CUDA_VISIBLE_DEVICES", "7"}}};

  const WorkerSpec s = worker_spec(c, p, 1, attempt, {});
  CHECK(s.local_rank == 1);
  CHECK(s.rank == 7);
  CHECK(s.argv == std::vector<std::string>{"/usr/bin/python3", "-u", "train.py", "--local_rank=1", "--lr", "1"});
  CHECK(s.cwd == "/work/dir");
  CHECK(s.cpus == std::vector<int>{2, 3});
  CHECK(s.device == "cuda:1");
  CHECK(s.error_file == "/logs/attempt_0/1/error.json");
  CHECK(s.prefix == "[default1:7]:");
  const auto env = as_map(s.env);
  CHECK(env.at("RANK") == "7");
  CHECK(env.at("LOCAL_RANK") == "1");
  CHECK(env.at("WORLD_SIZE") == "8");
  CHECK(env.at("DDPRUN_NCCL_UNIQUE_ID") == "ab");
  CHECK(env.at("CUDA_VISIBLE_DEVICES") == "7");  // the round's NCCL variables are the last source
  CHECK(env.at("TORCHELASTIC_ERROR_FILE") == s.error_file);
  // torchrun >= 2.9's variable: the default set, then what --signals-to-handle gave.
  CHECK(env.at("TORCHELASTIC_SIGNALS_TO_HANDLE") == "SIGTERM,SIGINT,SIGHUP,SIGQUIT");
  c.signals_to_handle = {SIGUSR1, SIGTERM, SIGRTMIN + 2};
  CHECK(as_map(worker_spec(c, p, 1, attempt, {}).env).at("TORCHELASTIC_SIGNALS_TO_HANDLE") ==
        "SIGUSR1,SIGTERM,SIGRTMIN+2");
  // One entry per name, sorted (what merge_env and --dry-run both expect).
  CHECK(env.size() == s.env.size());
  CHECK(std::is_sorted(s.env.begin(), s.env.end(), [](const auto& x, const auto& y) { return x.first < y.first; }));

  const WorkerSpec s0 = worker_spec(c, p, 0, {"/logs/attempt_0", {}}, {});
  CHECK(as_map(s0.env).at("OMP_NUM_THREADS") == "4");  // the GPU plan wins over build_worker_env
  CHECK(as_map(s0.env).at("CUDA_VISIBLE_DEVICES") == "0");
  CHECK(s0.argv[3] == "--local_rank=0");
}

TEST_CASE("worker_spec: ${local_rank} in the arguments, as Python's Template.safe_substitute") {
  // The expected values are what Python 3 gives for Template(arg).safe_substitute(local_rank="3").
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"plain", "plain"},
      {"x${local_rank}y", "x3y"},
      {"$local_rank", "3"},
      {"d=$$", "d=$"},
      {"$$local_rank", "$local_rank"},
      {"$$$local_rank", "$3"},
      {"${local_rank", "${local_rank"},
      {"$local_rank}", "3}"},
      {"$local_rank0", "$local_rank0"},
      {"${local_rank}0", "30"},
      {"$LOCAL_RANK", "$LOCAL_RANK"},
      {"${rank}", "${rank}"},
      {"$1", "$1"},
      {"$", "$"},
      {"a$", "a$"},
      {"${}", "${}"},
      {"${ local_rank}", "${ local_rank}"},
      {"$_x", "$_x"},
      {"--out=log_${local_rank}.txt", "--out=log_3.txt"},
      {"$local_rank$local_rank", "33"},
      {"\xc3\xa9$local_rank\xc3\xbc",
       "\xc3\xa9"
       "3\xc3\xbc"},
  };
  for (const auto& [in, want] : cases) {
    INFO(in);
    bool named = true;
    CHECK(substitute_local_rank(in, 3, &named) == want);
    CHECK(named == (in.find("local_rank") != std::string::npos && want.find('3') != std::string::npos));
  }

  // Every argument after the program that names the placeholder, the script included; never the
  // program itself; an argument without it unchanged ("$$" stays: `sh -c 'echo $$'`).
  AgentConfig c = base();
  c.nproc_per_node = 2;
  c.worker_argv = {"/opt/$local_rank/python3", "-u",     "run_${local_rank}.py",
                   "--out=log_${local_rank}",  "$$HOME", "echo $$ ${local_rank}"};
  c.user_args_index = 3;
  c.local_rank_arg = AgentConfig::LocalRankArg::dash;
  const we::Placement p = local_placement(c);
  CHECK(worker_spec(c, p, 1, {"/logs/attempt_0", {}}, {}).argv ==
        std::vector<std::string>{"/opt/$local_rank/python3", "-u", "run_1.py", "--local-rank=1", "--out=log_1",
                                 "$$HOME", "echo $ 1"});
}

TEST_CASE("worker_spec: routes follow the global rank for --ranks-filter") {
  AgentConfig c = base();
  c.nproc_per_node = 2;
  c.ranks_filter = std::set<int>{3};
  we::Placement p = local_placement(c);
  p.rank_offset = 2;
  CHECK(worker_spec(c, p, 1, {"/d", {}}, {}).routes.out == Route::inherit);
  CHECK(worker_spec(c, p, 0, {"/d", {}}, {}).routes.out == Route::file);
}

TEST_CASE("round NCCL: the node whose offer was chosen keeps its holder, the others take its IDs") {
  AgentConfig c = base();
  const auto mine = ids(1, 0x11);
  const auto theirs = ids(1, 0x22);
  const RoundNccl rank0 = decide_round_nccl(c, 3, 8, mine, mine);
  CHECK(rank0.keep_holder);
  REQUIRE(rank0.env.size() == 1);
  CHECK(rank0.env[0].first == "DDPRUN_NCCL_UNIQUE_ID");
  CHECK(rank0.env[0].second == std::string(2 * we::nccl_unique_id_bytes, '1'));
  CHECK_FALSE(rank0.warning);

  const RoundNccl other = decide_round_nccl(c, 3, 8, theirs, mine);
  CHECK_FALSE(other.keep_holder);
  CHECK(other.env[0].second == std::string(2 * we::nccl_unique_id_bytes, '2'));
  // Another node's offer was chosen (whatever this node's group rank): this holder serves nobody.
  CHECK_FALSE(decide_round_nccl(c, 3, 8, theirs, mine).keep_holder);
  CHECK(decide_round_nccl(c, 3, 8, {}, {}).env.empty());
  CHECK_FALSE(decide_round_nccl(c, 3, 8, {}, {}).warning);
  CHECK_FALSE(decide_round_nccl(c, 3, 8, {}, {}).keep_holder);
  // No IDs in the round although this node offered some: said, nothing exported, holder spent.
  const RoundNccl none = decide_round_nccl(c, 3, 8, {}, mine);
  CHECK(none.env.empty());
  CHECK_FALSE(none.keep_holder);
  REQUIRE(none.warning);
  CHECK_THAT(*none.warning, Catch::Matchers::Contains("round 3: the rendezvous carried no NCCL IDs") &&
                                Catch::Matchers::Contains("DDPRUN_NCCL_UNIQUE_ID is not set"));
}

TEST_CASE("round NCCL: as many roots as the world needs, a warning when too few were offered") {
  AgentConfig c = base();
  const auto four = ids(4, 0x33);
  const RoundNccl small = decide_round_nccl(c, 1, 100, four, {});
  REQUIRE(small.env.size() == 1);  // 100 ranks: one root
  const RoundNccl big = decide_round_nccl(c, 1, 600, four, {});
  REQUIRE(big.env.size() == 2);  // 600 ranks: three roots
  CHECK(big.env[1].first == "DDPRUN_NCCL_UNIQUE_IDS");
  CHECK(std::count(big.env[1].second.begin(), big.env[1].second.end(), ',') == 2);
  const RoundNccl starved = decide_round_nccl(c, 5, 600, ids(2, 0x44), {});
  REQUIRE(starved.warning);
  CHECK_THAT(*starved.warning, Catch::Matchers::Contains("600 ranks would use 3 NCCL roots") &&
                                   Catch::Matchers::Contains("the round's offer has 2"));
  const RoundNccl odd = decide_round_nccl(c, 5, 8, std::vector<std::uint8_t>(5, 1), {});
  CHECK(odd.env.empty());
  CHECK_THAT(*odd.warning, Catch::Matchers::Contains("not a multiple of"));
  c.nccl_roots = 2;  // --nccl-roots: every offered ID
  CHECK(decide_round_nccl(c, 1, 8, ids(2, 0x55), {}).env.size() == 2);
}

TEST_CASE("round NCCL: comm-id offers become NCCL_COMM_ID") {
  AgentConfig c = base();
  c.nccl_id = AgentConfig::NcclIdMode::comm_id;
  const auto offer = we::encode_comm_id_offer("10.0.0.1:4567");
  const RoundNccl d = decide_round_nccl(c, 2, 8, offer, {});
  REQUIRE(d.env.size() == 1);
  CHECK(d.env[0] == std::pair<std::string, std::string>{"NCCL_COMM_ID", "10.0.0.1:4567"});
  const RoundNccl mixed = decide_round_nccl(c, 2, 8, ids(1, 0x66), {});
  CHECK(mixed.env.empty());
  CHECK_THAT(*mixed.warning, Catch::Matchers::Contains("--nccl-id comm-id"));
}

TEST_CASE("placement of a rendezvous assignment; static jobs take --node-rank") {
  AgentConfig c = base();
  c.nproc_per_node = 4;
  c.rdzv_backend = "c10d";
  c.max_nodes = 3;
  ddprun::rendezvous::Assignment a;
  a.round = 2;
  a.group_rank = 2;
  a.group_world_size = 3;
  a.local_world_size = 4;
  a.rank_offset = 8;
  a.world_size = 12;
  a.master_addr = "10.1.1.1";
  a.master_port = 4242;
  a.restart_count = 1;
  a.max_restarts = 3;
  const auto p = placement_of(c, a);
  CHECK(p.group_rank == 2);
  CHECK(p.rank_offset == 8);
  CHECK(p.world_size == 12);
  CHECK(p.master_addr == "10.1.1.1");
  CHECK(p.master_port == 4242);
  CHECK(p.restart_count == 1);
  CHECK(p.max_restarts == 3);
  CHECK(p.role == c.role);
  c.rdzv_backend = "static";
  c.node_rank = 1;
  const auto s = placement_of(c, a);
  CHECK(s.group_rank == 1);
  CHECK(s.rank_offset == 4);
}
