// The worker env contract (docs/worker-env.md): every variable, per-rank values, the
// only-when-unset rules, virtual local rank, merge order.
#include <catch2/catch.hpp>
#include <cstdlib>

#include "ddprun/common/error.hpp"
#include "ddprun/worker_env/worker_env.hpp"

using namespace ddprun::worker_env;

namespace {

EnvMap as_map(const EnvList& list) {
  EnvMap m;
  for (const auto& [k, v] : list) {
    REQUIRE(m.count(k) == 0);  // no duplicates
    m[k] = v;
  }
  return m;
}

Placement two_node_assignment() {
  Placement a;
  a.role = "trainer";
  a.local_world_size = 4;
  a.group_rank = 1;
  a.group_world_size = 2;
  a.rank_offset = 4;
  a.world_size = 8;
  a.master_addr = "10.0.0.1";
  a.master_port = 29511;
  a.restart_count = 2;
  a.max_restarts = 3;
  a.run_id = "job42";
  a.use_agent_store = true;
  return a;
}

}  // namespace

TEST_CASE("every torchrun variable with per-rank values") {
  const auto a = two_node_assignment();
  for (int lr = 0; lr < 4; ++lr) {
    const auto env = as_map(build_worker_env(a, lr, {}, {}));
    CHECK(env.at("RANK") == std::to_string(4 + lr));
    CHECK(env.at("LOCAL_RANK") == std::to_string(lr));
    CHECK(env.at("WORLD_SIZE") == "8");
    CHECK(env.at("LOCAL_WORLD_SIZE") == "4");
    CHECK(env.at("GROUP_RANK") == "1");
    CHECK(env.at("GROUP_WORLD_SIZE") == "2");
    CHECK(env.at("ROLE_NAME") == "trainer");
    CHECK(env.at("ROLE_RANK") == std::to_string(4 + lr));
    CHECK(env.at("ROLE_WORLD_SIZE") == "8");
    CHECK(env.at("MASTER_ADDR") == "10.0.0.1");
    CHECK(env.at("MASTER_PORT") == "29511");
    CHECK(env.at("TORCHELASTIC_RESTART_COUNT") == "2");
    CHECK(env.at("TORCHELASTIC_MAX_RESTARTS") == "3");
    CHECK(env.at("TORCHELASTIC_RUN_ID") == "job42");
    CHECK(env.at("TORCHELASTIC_USE_AGENT_STORE") == "True");
    CHECK(env.at("LOCAL_SIZE") == "4");
    CHECK(env.at("CROSS_RANK") == "1");
    CHECK(env.at("CROSS_SIZE") == "2");
    CHECK(env.count("TORCHELASTIC_ERROR_FILE") == 0);
    CHECK(env.count("DDPRUN_NCCL_UNIQUE_ID") == 0);
    CHECK(env.count("PYTHONUNBUFFERED") == 0);
    CHECK(env.count("CUDA_VISIBLE_DEVICES") == 0);
  }
}

TEST_CASE("matches the captured torch 1.13 static-agent-store environment") {
  // shared/design/captures-torch-1.13/worker_env_static.json, local rank 1 of 2.
  Placement a;
  a.local_world_size = 2;
  a.world_size = 2;
  a.master_addr = "127.0.0.1";
  a.master_port = 29810;
  a.run_id = "none";
  EnvOptions o;
  o.python_worker = true;
  o.error_file_dir = "/tmp/run/logsB/none_3c11smjh/attempt_0";
  const auto env = as_map(build_worker_env(a, 1, o, {}));
  const EnvMap expected = {{"GROUP_RANK", "0"},
                           {"GROUP_WORLD_SIZE", "1"},
                           {"LOCAL_RANK", "1"},
                           {"LOCAL_WORLD_SIZE", "2"},
                           {"MASTER_ADDR", "127.0.0.1"},
                           {"MASTER_PORT", "29810"},
                           {"NCCL_ASYNC_ERROR_HANDLING", "1"},
                           {"OMP_NUM_THREADS", "1"},
                           {"PYTHONUNBUFFERED", "1"},
                           {"RANK", "1"},
                           {"ROLE_NAME", "default"},
                           {"ROLE_RANK", "1"},
                           {"ROLE_WORLD_SIZE", "2"},
                           {"TORCHELASTIC_ERROR_FILE", "/tmp/run/logsB/none_3c11smjh/attempt_0/1/error.json"},
                           {"TORCHELASTIC_MAX_RESTARTS", "0"},
                           {"TORCHELASTIC_RESTART_COUNT", "0"},
                           {"TORCHELASTIC_RUN_ID", "none"},
                           {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                           {"WORLD_SIZE", "2"}};
  for (const auto& [k, v] : expected) {
    INFO(k);
    REQUIRE(env.count(k) == 1);
    CHECK(env.at(k) == v);
  }
}

TEST_CASE("use_agent_store is Python's str(bool)") {
  Placement a;
  a.use_agent_store = false;
  CHECK(as_map(build_worker_env(a, 0, {}, {})).at("TORCHELASTIC_USE_AGENT_STORE") == "False");
  a.use_agent_store = true;
  CHECK(as_map(build_worker_env(a, 0, {}, {})).at("TORCHELASTIC_USE_AGENT_STORE") == "True");
}

TEST_CASE("error file path per local rank, with or without a trailing slash") {
  Placement a;
  a.local_world_size = 3;
  EnvOptions o;
  o.error_file_dir = "/logs/job_x/attempt_1/";
  CHECK(as_map(build_worker_env(a, 2, o, {})).at("TORCHELASTIC_ERROR_FILE") == "/logs/job_x/attempt_1/2/error.json");
  o.error_file_dir = "/logs/job_x/attempt_1";
  CHECK(as_map(build_worker_env(a, 0, o, {})).at("TORCHELASTIC_ERROR_FILE") == "/logs/job_x/attempt_1/0/error.json");
  // --log-dir /dev/null: set and empty, as torch 2.6's agent sets it.
  o.no_error_file = true;
  CHECK(as_map(build_worker_env(a, 1, o, {})).at("TORCHELASTIC_ERROR_FILE").empty());
}

TEST_CASE("NCCL async error handling only when unset in the parent, each name on its own") {
  Placement a;
  auto env = as_map(build_worker_env(a, 0, {}, {}));
  CHECK(env.at("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "1");
  CHECK(env.at("NCCL_ASYNC_ERROR_HANDLING") == "1");
  env = as_map(build_worker_env(a, 0, {}, {{"TORCH_NCCL_ASYNC_ERROR_HANDLING", "0"}}));
  CHECK(env.count("TORCH_NCCL_ASYNC_ERROR_HANDLING") == 0);
  CHECK(env.at("NCCL_ASYNC_ERROR_HANDLING") == "1");
  env = as_map(build_worker_env(a, 0, {}, {{"NCCL_ASYNC_ERROR_HANDLING", "3"}}));
  CHECK(env.at("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "1");
  CHECK(env.count("NCCL_ASYNC_ERROR_HANDLING") == 0);
}

TEST_CASE("OMP_NUM_THREADS=1 only when unset and more than one local worker") {
  Placement a;
  a.local_world_size = 1;
  CHECK(as_map(build_worker_env(a, 0, {}, {})).count("OMP_NUM_THREADS") == 0);
  a.local_world_size = 2;
  CHECK(as_map(build_worker_env(a, 1, {}, {})).at("OMP_NUM_THREADS") == "1");
  CHECK(as_map(build_worker_env(a, 1, {}, {{"OMP_NUM_THREADS", "8"}})).count("OMP_NUM_THREADS") == 0);
  // Set but empty still counts as set (torchrun checks membership, not value).
  CHECK(as_map(build_worker_env(a, 1, {}, {{"OMP_NUM_THREADS", ""}})).count("OMP_NUM_THREADS") == 0);
}

TEST_CASE("PYTHONUNBUFFERED for Python workers unless the parent chose") {
  Placement a;
  EnvOptions o;
  CHECK(as_map(build_worker_env(a, 0, o, {})).count("PYTHONUNBUFFERED") == 0);
  o.python_worker = true;
  CHECK(as_map(build_worker_env(a, 0, o, {})).at("PYTHONUNBUFFERED") == "1");
  CHECK(as_map(build_worker_env(a, 0, o, {{"PYTHONUNBUFFERED", "x"}})).count("PYTHONUNBUFFERED") == 0);
}

TEST_CASE("virtual local rank maps through the parent's CUDA_VISIBLE_DEVICES") {
  Placement a;
  a.local_world_size = 3;
  EnvOptions o;
  o.virtual_local_rank = true;
  SECTION("no CVD in the parent: device = local rank") {
    for (int lr = 0; lr < 3; ++lr) {
      const auto env = as_map(build_worker_env(a, lr, o, {}));
      CHECK(env.at("LOCAL_RANK") == "0");
      CHECK(env.at("RANK") == std::to_string(lr));
      CHECK(env.at("CUDA_VISIBLE_DEVICES") == std::to_string(lr));
    }
  }
  SECTION("parent CVD entries by index (UUIDs too, spaces trimmed)") {
    const EnvMap parent{{"CUDA_VISIBLE_DEVICES", "4, GPU-abc ,7"}};
    CHECK(as_map(build_worker_env(a, 0, o, parent)).at("CUDA_VISIBLE_DEVICES") == "4");
    CHECK(as_map(build_worker_env(a, 1, o, parent)).at("CUDA_VISIBLE_DEVICES") == "GPU-abc");
    CHECK(as_map(build_worker_env(a, 2, o, parent)).at("CUDA_VISIBLE_DEVICES") == "7");
  }
  SECTION("too few devices is a usage error naming the variable") {
    const EnvMap parent{{"CUDA_VISIBLE_DEVICES", "4,5"}};
    try {
      (void)build_worker_env(a, 2, o, parent);
      FAIL("expected an error");
    } catch (const ddprun::UsageError& e) {
      CHECK_THAT(e.what(), Catch::Contains("CUDA_VISIBLE_DEVICES") && Catch::Contains("local rank 2"));
    }
  }
  SECTION("without virtual mode CVD is not touched") {
    o.virtual_local_rank = false;
    const auto env = as_map(build_worker_env(a, 1, o, {{"CUDA_VISIBLE_DEVICES", "4,5,6"}}));
    CHECK(env.count("CUDA_VISIBLE_DEVICES") == 0);
    CHECK(env.at("LOCAL_RANK") == "1");
  }
}

TEST_CASE("local rank out of range is rejected") {
  Placement a;
  a.local_world_size = 2;
  CHECK_THROWS_AS(build_worker_env(a, 2, {}, {}), ddprun::Error);
  CHECK_THROWS_AS(build_worker_env(a, -1, {}, {}), ddprun::Error);
}

TEST_CASE("additions are sorted by name") {
  const auto env = build_worker_env(two_node_assignment(), 0, {}, {});
  for (std::size_t i = 1; i < env.size(); ++i) {
    CHECK(env[i - 1].first < env[i].first);
  }
}

TEST_CASE("merge_env: additions override the parent, order is by name") {
  const EnvMap parent{{"A", "1"}, {"PATH", "/bin"}, {"RANK", "99"}, {"Z", "z"}};
  const EnvList additions{{"B", "2"}, {"RANK", "3"}};
  const auto merged = merge_env(parent, additions);
  const std::vector<std::string> expected{"A=1", "B=2", "PATH=/bin", "RANK=3", "Z=z"};
  CHECK(merged == expected);
}

TEST_CASE("merge_env: unsorted additions and duplicates (last wins)") {
  const EnvMap parent{{"M", "parent"}};
  const EnvList additions{{"Z", "1"}, {"M", "first"}, {"A", "0"}, {"M", "second"}};
  const std::vector<std::string> expected{"A=0", "M=second", "Z=1"};
  CHECK(merge_env(parent, additions) == expected);
  CHECK(merge_env({}, {}).empty());
  CHECK(merge_env(parent, {}) == std::vector<std::string>{"M=parent"});
}

TEST_CASE("current_environment reflects setenv, values with '=' intact") {
  ::setenv("DDPRUN_WORKER_ENV_TEST", "a=b=c", 1);
  const auto env = current_environment();
  REQUIRE(env.count("DDPRUN_WORKER_ENV_TEST") == 1);
  CHECK(env.at("DDPRUN_WORKER_ENV_TEST") == "a=b=c");
  ::unsetenv("DDPRUN_WORKER_ENV_TEST");
  CHECK(current_environment().count("DDPRUN_WORKER_ENV_TEST") == 0);
}

TEST_CASE("python_coerced_lc_ctype: the LC_CTYPE Python sets in a C locale, as torchrun's workers inherit it") {
  const auto any = [](const std::string&) { return true; };
  CHECK(python_coerced_lc_ctype({}, any) == "C.UTF-8");  // nothing set: the C locale
  CHECK(python_coerced_lc_ctype({{"LANG", "C"}}, any) == "C.UTF-8");
  CHECK(python_coerced_lc_ctype({{"LANG", "POSIX"}}, any) == "C.UTF-8");
  CHECK(python_coerced_lc_ctype({{"LC_ALL", ""}, {"LC_CTYPE", ""}, {"LANG", "C"}}, any) == "C.UTF-8");  // empty: unset
  CHECK(python_coerced_lc_ctype({{"LC_CTYPE", "C"}, {"LANG", "en_US.UTF-8"}}, any) == "C.UTF-8");
  CHECK(python_coerced_lc_ctype({{"PYTHONCOERCECLOCALE", "warn"}}, any) == "C.UTF-8");
  // Not the C locale, or coercion off: nothing.
  CHECK_FALSE(python_coerced_lc_ctype({{"LANG", "C.UTF-8"}}, any));
  CHECK_FALSE(python_coerced_lc_ctype({{"LC_CTYPE", "en_US.UTF-8"}, {"LANG", "C"}}, any));
  CHECK_FALSE(python_coerced_lc_ctype({{"LC_ALL", "C"}}, any));
  CHECK_FALSE(python_coerced_lc_ctype({{"PYTHONCOERCECLOCALE", "0"}}, any));
  // The first target the machine has, as Python tries them.
  CHECK(python_coerced_lc_ctype({}, [](const std::string& n) { return n != "C.UTF-8"; }) == "C.utf8");
  CHECK(python_coerced_lc_ctype({}, [](const std::string& n) { return n == "UTF-8"; }) == "UTF-8");
  CHECK_FALSE(python_coerced_lc_ctype({}, [](const std::string&) { return false; }));
  // This machine: C always exists, a made-up name never does.
  CHECK(ctype_locale_available("C"));
  CHECK_FALSE(ctype_locale_available("xx_NOWHERE.UTF-8"));
}
