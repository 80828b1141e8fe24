// Slurm hostlist expansion and the settings derived from a job step's environment.
#include <catch2/catch.hpp>

#include "ddprun/common/error.hpp"
#include "ddprun/launcher/slurm.hpp"

using namespace ddprun::launcher;
using Catch::Matchers::Contains;
using ddprun::UsageError;
using Names = std::vector<std::string>;

TEST_CASE("hostlist: plain names, ranges, padding, lists") {
  CHECK(expand_hostlist("node1") == Names{"node1"});
  CHECK(expand_hostlist("a,b,c") == Names{"a", "b", "c"});
  CHECK(expand_hostlist(" a , b ") == Names{"a", "b"});
  CHECK(expand_hostlist("node[01-04,07],gpu-a[1-2]") ==
        Names{"node01", "node02", "node03", "node04", "node07", "gpu-a1", "gpu-a2"});
  CHECK(expand_hostlist("n[01-10]") == Names{"n01", "n02", "n03", "n04", "n05", "n06", "n07", "n08", "n09", "n10"});
  CHECK(expand_hostlist("n[8-10]") == Names{"n8", "n9", "n10"});
  CHECK(expand_hostlist("n[001-002]") == Names{"n001", "n002"});
  CHECK(expand_hostlist("n[098-101]") == Names{"n098", "n099", "n100", "n101"});
  CHECK(expand_hostlist("n[5]") == Names{"n5"});
  CHECK(expand_hostlist("n[3,1]") == Names{"n3", "n1"});
  CHECK(expand_hostlist("[1-2]x") == Names{"1x", "2x"});
  CHECK(expand_hostlist("n[1-2].cluster") == Names{"n1.cluster", "n2.cluster"});
}

TEST_CASE("hostlist: several bracket groups give the cartesian product, leftmost slowest") {
  CHECK(expand_hostlist("rack[1-2]-n[01-02]") == Names{"rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"});
  CHECK(expand_hostlist("r[1,3]n[1-2]s[0],x") == Names{"r1n1s0", "r1n2s0", "r3n1s0", "r3n2s0", "x"});
  CHECK(expand_hostlist("a[1-1000]").size() == 1000);
  CHECK(expand_hostlist("a[1-1000]").back() == "a1000");
}

TEST_CASE("hostlist: errors name the text and the position") {
  CHECK_THROWS_WITH(expand_hostlist("", "SLURM_JOB_NODELIST"), Contains("SLURM_JOB_NODELIST=: empty host list"));
  CHECK_THROWS_WITH(expand_hostlist("a,,b"), Contains("hostlist=a,,b: empty host name at position 2"));
  CHECK_THROWS_WITH(expand_hostlist("a,"), Contains("empty host name at position 2"));
  CHECK_THROWS_WITH(expand_hostlist("n[1-2"), Contains("'[' without ']' at position 1"));
  CHECK_THROWS_WITH(expand_hostlist("n1-2]"), Contains("']' without '[' at position 4"));
  CHECK_THROWS_WITH(expand_hostlist("n[[1]]"), Contains("nested '[' at position 2"));
  CHECK_THROWS_WITH(expand_hostlist("n[]"), Contains("empty '[]' at position 1"));
  CHECK_THROWS_WITH(expand_hostlist("n[1,,2]"), Contains("empty range") && Contains("position 4"));
  CHECK_THROWS_WITH(expand_hostlist("n[3-1]"), Contains("range '3-1' runs backwards at position 2"));
  CHECK_THROWS_WITH(expand_hostlist("n[a-b]"), Contains("'a-b' is not N or LO-HI"));
  CHECK_THROWS_WITH(expand_hostlist("n[1-2-3]"), Contains("'1-2-3' is not N or LO-HI"));
  CHECK_THROWS_WITH(expand_hostlist("n[-1]"), Contains("is not N or LO-HI"));
  CHECK_THROWS_WITH(expand_hostlist("a b"), Contains("unexpected 'b' at position 2"));
  CHECK_THROWS_WITH(expand_hostlist("n[0-99999999]"), Contains("too many hosts"));
  CHECK_THROWS_WITH(expand_hostlist("a[0-9999]b[0-999]"), Contains("too many hosts"));
  // Long names multiply out too: 1,000 bytes by 1,000,000 hosts would be a gigabyte of names.
  CHECK_THROWS_WITH(expand_hostlist(std::string(256, 'a')), Contains("a host name longer than 255 bytes"));
  CHECK_THROWS_WITH(expand_hostlist("n[1-2]" + std::string(255, 'a')),
                    Contains("a host name longer than 255 bytes at position 0"));
  CHECK_THROWS_WITH(expand_hostlist(std::string(200, 'a') + "[0-999][0-999]"),
                    Contains("the names take more than 64 MiB"));
  CHECK_THROWS_WITH(
      expand_hostlist("x,y," + std::string(200, 'a') + "[0-99][0-99]," + std::string(200, 'b') + "[0-999][0-399]"),
      Contains("the names take more than 64 MiB at position 217"));
  CHECK(expand_hostlist(std::string(255, 'a')).front().size() == 255);
  CHECK(expand_hostlist(std::string(40, 'n') + "[0-999][0-999]").size() == 1'000'000);
  try {
    expand_hostlist("n[");
    FAIL("no throw");
  } catch (const UsageError& e) {
    CHECK_THAT(e.hint(), Contains("node[01-04,07]"));
  }
}

TEST_CASE("slurm_from_env: not a Slurm step") {
  CHECK_FALSE(slurm_from_env({}).has_value());
  CHECK_FALSE(slurm_from_env({{"SLURM_NNODES", "2"}, {"SLURM_NODEID", "0"}}).has_value());
  // A job id without a node count (e.g. an odd wrapper): not used.
  CHECK_FALSE(slurm_from_env({{"SLURM_JOB_ID", "7"}, {"SLURM_STEP_ID", "0"}}).has_value());
  // A batch script of a 4-node allocation (what sbatch sets there: SLURM_NODEID=0, no
  // SLURM_STEP_*): before, it was taken for node 0 of a 4-node step and waited for the others.
  const std::map<std::string, std::string> batch = {
      {"SLURM_JOB_ID", "42"}, {"SLURM_NNODES", "4"}, {"SLURM_JOB_NUM_NODES", "4"},
      {"SLURM_NODEID", "0"},  {"SLURM_PROCID", "0"}, {"SLURM_JOB_NODELIST", "gnode[10,20,25,37]"}};
  CHECK_FALSE(slurm_step(batch));
  CHECK_FALSE(slurm_from_env(batch).has_value());
  auto step = batch;
  step["SLURM_STEP_NODELIST"] = "gnode[10,20,25,37]";
  CHECK(slurm_step(step));
  CHECK(slurm_from_env(step) == SlurmSettings{4, 0, "gnode10", "slurm-42"});
  // An interactive step (salloc's shell on the first node): one node of the job's four.
  auto interactive = batch;
  interactive["SLURM_STEP_ID"] = "4294967290";
  interactive["SLURM_STEP_NUM_NODES"] = "1";
  interactive["SLURM_STEP_NODELIST"] = "gnode10";
  CHECK(slurm_from_env(interactive) == SlurmSettings{1, 0, "gnode10", "slurm-42.4294967290"});
}

TEST_CASE("slurm_from_env: settings from a step's environment") {
  std::map<std::string, std::string> env = {{"SLURM_JOB_ID", "4242"},
                                            {"SLURM_NNODES", "4"},
                                            {"SLURM_STEP_NUM_NODES", "4"},
                                            {"SLURM_NODEID", "2"},
                                            {"SLURM_JOB_NODELIST", "gpu[07-08],cpu-[1-2]"}};
  CHECK(slurm_from_env(env) == SlurmSettings{4, 2, "gpu07", "slurm-4242"});
  auto with_step = env;
  with_step.emplace("SLURM_STEP_ID", "3");
  const auto stepped = slurm_from_env(with_step);
  REQUIRE(stepped.has_value());
  CHECK(stepped->run_id == std::string("slurm-4242.3"));
  // SLURM_JOB_NUM_NODES when SLURM_NNODES is missing; SLURM_NODELIST when the job list is.
  std::map<std::string, std::string> env2 = {{"SLURM_JOB_ID", "9"},
                                             {"SLURM_STEP_ID", "0"},
                                             {"SLURM_JOB_NUM_NODES", "2"},
                                             {"SLURM_NODEID", "0"},
                                             {"SLURM_NODELIST", "x,y"}};
  CHECK(slurm_from_env(env2) == SlurmSettings{2, 0, "x", "slurm-9.0"});
  // Inside srun the step's node list wins over the job's (a step may use fewer nodes).
  std::map<std::string, std::string> env3 = {{"SLURM_JOB_ID", "9"},
                                             {"SLURM_NNODES", "2"},
                                             {"SLURM_NODEID", "1"},
                                             {"SLURM_JOB_NODELIST", "n[1-4]"},
                                             {"SLURM_STEP_NODELIST", "n[3-4]"}};
  CHECK(slurm_from_env(env3) == SlurmSettings{2, 1, "n3", "slurm-9"});
}

TEST_CASE("slurm_from_env: inconsistent values name the variables") {
  const std::map<std::string, std::string> base = {{"SLURM_JOB_ID", "1"},
                                                   {"SLURM_STEP_ID", "0"},
                                                   {"SLURM_NNODES", "2"},
                                                   {"SLURM_NODEID", "0"},
                                                   {"SLURM_JOB_NODELIST", "a,b"}};
  REQUIRE(slurm_from_env(base).has_value());
  auto with = [&](const std::string& k, const std::string& v) {
    auto e = base;
    e[k] = v;
    return e;
  };
  auto without = [&](const std::string& k) {
    auto e = base;
    e.erase(k);
    return e;
  };
  CHECK_THROWS_WITH(slurm_from_env(with("SLURM_JOB_NODELIST", "a,b,c")),
                    Contains("SLURM_JOB_NODELIST=a,b,c names 3 node(s) but SLURM_NNODES=2"));
  CHECK_THROWS_WITH(slurm_from_env(with("SLURM_NNODES", "two")), Contains("SLURM_NNODES=two"));
  CHECK_THROWS_WITH(slurm_from_env(with("SLURM_NNODES", "0")), Contains("SLURM_NNODES=0"));
  CHECK_THROWS_WITH(slurm_from_env(with("SLURM_NODEID", "2")), Contains("SLURM_NODEID=2 is not below SLURM_NNODES=2"));
  CHECK_THROWS_WITH(slurm_from_env(with("SLURM_NODEID", "-1")), Contains("SLURM_NODEID=-1"));
  // An salloc shell (no srun step): not a Slurm launch, a plain job.
  CHECK_FALSE(slurm_from_env(without("SLURM_NODEID")).has_value());
  CHECK_THROWS_WITH(slurm_from_env(without("SLURM_JOB_NODELIST")), Contains("SLURM_JOB_NODELIST"));
  CHECK_THROWS_WITH(slurm_from_env(with("SLURM_JOB_NODELIST", "a[")), Contains("SLURM_JOB_NODELIST=a["));
  CHECK_THROWS_WITH(slurm_from_env(with("SLURM_JOB_ID", "")), Contains("SLURM_JOB_ID="));
}
