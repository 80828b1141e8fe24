// The command line of the fan-out launcher (--hostfile / --hosts) and of Slurm allocations,
// turned into a FanoutPlan / AgentConfig. Pure: no ssh is run.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "ddprun/common/error.hpp"
#include "ddprun/common/shell.hpp"
#include "ddprun/launcher/command_line.hpp"
#include "ddprun/launcher/fanout.hpp"
#include "ddprun/launcher/values.hpp"
#include "sandbox.hpp"

using namespace ddprun::launcher;
using Catch::Matchers::Contains;
using ddprun::shell_quote;
using ddprun::UsageError;
using ddprun::test::Sandbox;
using Strings = std::vector<std::string>;
using Env = std::map<std::string, std::string>;

namespace {

// A sandbox with an ssh on its PATH (the plan names the ssh client it will run).
struct FanoutSandbox : Sandbox {
  FanoutSandbox() { write(dir() / "bin" / "ssh", "#!/bin/sh\n", true); }
};

bool has(const Strings& v, const std::string& s) { return std::find(v.begin(), v.end(), s) != v.end(); }

bool any_contains(const Strings& v, const std::string& s) {
  return std::any_of(v.begin(), v.end(), [&](const std::string& x) { return x.find(s) != std::string::npos; });
}

const std::string* env_value(const FanoutPlan& plan, const std::string& name) {
  for (const auto& [k, v] : plan.env) {
    if (k == name) return &v;
  }
  return nullptr;
}

}  // namespace

TEST_CASE("--hosts makes a fan-out plan: hosts, workers per host, the program as typed") {
  FanoutSandbox sb;
  const auto o = sb.parse({"--hosts", "h0,u@h1:4", "--nproc-per-node", "2", "train.py", "--lr", "0.1"});
  REQUIRE(o.fanout);
  const FanoutPlan& p = *o.fanout;
  REQUIRE(p.hosts.size() == 2);
  CHECK(p.hosts[0].host == "h0");
  CHECK(p.hosts[0].user.empty());
  CHECK(p.hosts[0].nproc == "2");
  CHECK(p.hosts[1].host == "h1");
  CHECK(p.hosts[1].user == "u");
  CHECK(p.hosts[1].nproc == "2");                          // an explicit --nproc-per-node beats the slot count
  CHECK(p.program == Strings{"train.py", "--lr", "0.1"});  // resolved by each host's agent
  CHECK(p.remote_cwd == sb.dir().string());
  CHECK_FALSE(p.remote_ddprun.empty());
  CHECK(p.ssh_command.front() == sb.path("bin/ssh"));
  CHECK(has(p.ssh_command, "BatchMode=yes"));
  // The user's options come before the defaults: ssh keeps the first value of an option.
  const auto o2 = sb.parse({"--hosts", "h0", "--ssh-option", "ConnectTimeout=30", "train.py"});
  const auto& cmd = o2.fanout->ssh_command;
  const auto user = std::find(cmd.begin(), cmd.end(), "ConnectTimeout=30");
  const auto dflt = std::find(cmd.begin(), cmd.end(), "ConnectTimeout=10");
  REQUIRE(user != cmd.end());
  REQUIRE(dflt != cmd.end());
  CHECK(user < dflt);
  // ssh's own spelling (-oKEY=VALUE) would be passed as -o -oKEY=VALUE, which ssh refuses.
  CHECK_THROWS_WITH(sb.parse({"--hosts", "h0", "--ssh-option=-oStrictHostKeyChecking=no", "train.py"}),
                    Contains("not an ssh option") && Contains("without -o"));
  CHECK(has(p.agent_args, "--rdzv-conf=is_host=false"));
}

TEST_CASE("slots of a hostfile give the worker counts; include slots become the host's devices") {
  FanoutSandbox sb;
  Sandbox::write(sb.dir() / "hosts", "# cluster\nh0 slots=2\nh1 slots=4 # big\n\nh2:3\n", false);
  auto o = sb.parse({"--hostfile", "hosts", "train.py"});
  REQUIRE(o.fanout);
  REQUIRE(o.fanout->hosts.size() == 3);
  CHECK(o.fanout->hosts[0].nproc == "2");
  CHECK(o.fanout->hosts[1].nproc == "4");
  CHECK(o.fanout->hosts[2].nproc == "3");
  CHECK(o.fanout->hosts[1].gpus.empty());

  o = sb.parse({"--hostfile", "hosts", "--include", "h1:1,3@h2", "train.py"});
  REQUIRE(o.fanout->hosts.size() == 2);
  CHECK(o.fanout->hosts[0].host == "h1");
  CHECK(o.fanout->hosts[0].nproc == "2");
  CHECK(o.fanout->hosts[0].gpus == "1,3");
  CHECK(o.fanout->hosts[1].host == "h2");
  CHECK(o.fanout->hosts[1].nproc == "3");
  CHECK(o.notes.empty());
  // A --gpus beside them is kept for the hosts without chosen slots, and said to be ignored on the others.
  o = sb.parse({"--hostfile", "hosts", "--include", "h1:1,3@h2", "--gpus", "0,1,2", "train.py"});
  CHECK(o.fanout->hosts[0].gpus == "1,3");
  CHECK(o.fanout->hosts[1].gpus == "0,1,2");
  CHECK(o.notes == Strings{"--gpus is ignored on h1: the slots --include chose there are its devices"});

  o = sb.parse({"--hostfile", "hosts", "--num-nodes", "2", "--num-gpus", "1", "train.py"});
  REQUIRE(o.fanout->hosts.size() == 2);
  CHECK(o.fanout->hosts[1].host == "h1");
  CHECK(o.fanout->hosts[1].nproc == "1");
  CHECK(o.fanout->hosts[1].gpus == "0");
  CHECK_THROWS_WITH(sb.parse({"--hostfile", "hosts", "--exclude", "h0", "--num-nodes", "1", "train.py"}),
                    Contains("cannot be combined"));
  CHECK_THROWS_AS(sb.parse({"--hostfile", "hosts", "--include", "h9", "train.py"}), UsageError);
}

TEST_CASE("--nproc-per-node gpu|auto is counted on each host") {
  FanoutSandbox sb;
  const auto o = sb.parse({"--hosts", "h0,h1", "--nproc-per-node", "gpu", "train.py"});
  REQUIRE(o.fanout);
  CHECK(o.fanout->hosts[0].nproc == "gpu");
  CHECK(o.fanout->hosts[1].nproc == "gpu");
  // Also on hosts with slots: the explicit flag wins over them (before, the slots did, silently).
  const auto s = sb.parse({"--hosts", "h0:2,h1:4", "--nproc-per-node", "cpu", "train.py"});
  REQUIRE(s.fanout);
  CHECK(s.fanout->hosts[0].nproc == "cpu");
  CHECK(s.fanout->hosts[1].nproc == "cpu");
  // Slots chosen by --include are devices: their count, whatever the word.
  const auto i = sb.parse({"--hosts", "h0:4,h1:4", "--include", "h0:0,1@h1", "--nproc-per-node", "gpu", "train.py"});
  REQUIRE(i.fanout);
  CHECK(i.fanout->hosts[0].nproc == "2");
  CHECK(i.fanout->hosts[1].nproc == "gpu");
  // --num-gpus is bounded as a host's slots are.
  CHECK_THROWS_WITH(sb.parse({"--hosts", "h0,h1", "--num-gpus", "1000000", "train.py"}), Contains("1..65536"));
}

TEST_CASE("flags that place nodes cannot be mixed with a host list") {
  FanoutSandbox sb;
  for (const Strings& extra : {Strings{"--nnodes", "2"}, Strings{"--rdzv-endpoint", "x:1"}, Strings{"--node-rank", "1"},
                               Strings{"--master-addr", "10.0.0.1"}, Strings{"--standalone"}}) {
    Strings args = {"--hosts", "h0"};
    args.insert(args.end(), extra.begin(), extra.end());
    args.emplace_back("train.py");
    CHECK_THROWS_WITH(sb.parse(args), Contains("cannot be used with --hosts"));
  }
  CHECK_THROWS_WITH(sb.parse({"--hosts", "h0", "--hostfile", "f", "train.py"}), Contains("cannot be used together"));
}

TEST_CASE("fan-out flags without a host list are errors") {
  FanoutSandbox sb;
  CHECK_THROWS_WITH(sb.parse({"--include", "h0", "train.py"}), Contains("--include needs --hostfile or --hosts"));
  CHECK_THROWS_WITH(sb.parse({"--env", "A=1", "train.py"}), Contains("--env needs --hostfile or --hosts"));
  CHECK_THROWS_WITH(sb.parse({"--ssh-option", "Port=2", "train.py"}), Contains("--ssh-option needs"));
}

TEST_CASE("--gpus is checked as a single-node run checks it, before any host is contacted") {
  FanoutSandbox sb;
  for (const std::string bad : {"x,y", "-1", "0,,1", "0,0", "GPU-", "1.5"}) {
    CAPTURE(bad);
    CHECK_THROWS_AS(sb.parse({"--hosts", "h0,h1", "--gpus", bad, "--dry-run", "train.py"}), UsageError);
    // The same words from a single-node run.
    CHECK_THROWS_AS(sb.parse({"--gpus", bad, "--dry-run", "train.py"}), UsageError);
  }
  CHECK_THROWS_WITH(sb.parse({"--hosts", "h0", "--gpus", "x,y", "train.py"}),
                    Contains("--gpus: 'x' is not a device ordinal or UUID"));
  CHECK_THROWS_WITH(sb.parse({"--hosts", "h0", "--gpus", "", "train.py"}), Contains("--gpus is empty"));
  CHECK_THROWS_WITH(sb.parse({"--hosts", "h0", "--gpus", "1,01", "train.py"}), Contains("names device 01 twice"));
  CHECK_THROWS_WITH(sb.parse({"--hosts", "h0", "train.py"}, {{"PET_GPUS", "0,x"}}), Contains("'x' is not a device"));
  // Entries are checked against the devices on each host, by its agent: any ordinal or UUID passes here.
  const auto o = sb.parse({"--hosts", "h0,h1", "--gpus", " 7, GPU-8f2a ,MIG-1 ", "train.py"});
  REQUIRE(o.fanout);
  CHECK(o.fanout->hosts[0].gpus == "7, GPU-8f2a ,MIG-1");
  CHECK(o.fanout->hosts[1].gpus == "7, GPU-8f2a ,MIG-1");
}

TEST_CASE("a launcher without ssh on PATH says to install the OpenSSH client") {
  Sandbox sb;  // bin/ holds no ssh
  try {
    sb.parse({"--hosts", "h0", "train.py"});
    FAIL("no throw");
  } catch (const UsageError& e) {
    CHECK_THAT(e.message(), Contains("ssh (the OpenSSH client) was not found on PATH") && Contains(sb.path("bin")));
    CHECK_THAT(e.hint(), Contains("install the OpenSSH client"));
    CHECK_THAT(std::string(e.what()), !Contains("worker command") && !Contains("--no-python"));
  }
}

TEST_CASE("what every host would refuse is refused before any ssh runs") {
  FanoutSandbox sb;
  // An ssh that leaves a mark: nothing may run it.
  const std::string mark = sb.path("ssh-ran");
  Sandbox::write(sb.dir() / "bin" / "ssh", "#!/bin/sh\ntouch '" + mark + "'\n", true);
  SECTION("an environment block over the 1 MiB a host reads on stdin, flat launch") {
    std::string file;
    for (int i = 0; i < 9; ++i) file += "V" + std::to_string(i) + "=" + std::string(110'000, 'v') + "\n";
    file += "BIG=" + std::string(120'000, 'v') + "\n";
    Sandbox::write(sb.dir() / "job.env", file, false);
    const auto o = sb.parse({"--hosts", "h0,h1", "--launcher-addr", "127.0.0.1", "--env-file", "job.env", "train.py"});
    REQUIRE(o.fanout);
    REQUIRE_FALSE(uses_tree(*o.fanout));
    try {
      run_fanout(*o.fanout);
      FAIL("no throw");
    } catch (const UsageError& e) {
      CHECK_THAT(e.message(), Contains("the environment carried to every host") && Contains("BIG the largest") &&
                                  Contains("over the 1048576 a host reads on stdin"));
      CHECK_THAT(e.hint(), Contains("--env-file"));
    }
  }
  SECTION("one variable over the 128 KiB Linux allows an environment string") {
    // Under the 1 MiB of the block, but no worker could start with it (E2BIG) on any host.
    Sandbox::write(sb.dir() / "job.env", "CFG=" + std::string(200'000, 'c') + "\nSMALL=1\n", false);
    const auto o = sb.parse({"--hosts", "h0,h1", "--launcher-addr", "127.0.0.1", "--env-file", "job.env", "train.py"});
    REQUIRE(o.fanout);
    CHECK_THROWS_WITH(run_fanout(*o.fanout),
                      Contains("CFG (200000 bytes) is too large to carry to the hosts") && Contains("MAX_ARG_STRLEN"));
  }
  SECTION("a remote command longer than one exec argument") {
    // Each word fits in one argument of ddprun's own command line; together they do not.
    const std::string half(kMaxRemoteCommand / 2, 'a');
    const auto o = sb.parse({"--hosts", "h0,h1", "--launcher-addr", "127.0.0.1", "train.py", half, half});
    REQUIRE(o.fanout);
    try {
      run_fanout(*o.fanout);
      FAIL("no throw");
    } catch (const UsageError& e) {
      CHECK_THAT(e.message(),
                 Contains("the command ssh runs on host h0 is") &&
                     Contains("program and arguments: " + std::to_string(2 * half.size() + 10) + " bytes") &&
                     Contains("one argument"));
      CHECK_THAT(e.hint(), Contains("in a file"));
    }
  }
  CHECK_FALSE(std::filesystem::exists(mark));
}

TEST_CASE("check_remote_commands: the limit is one exec argument, the length is remote_command's") {
  FanoutSandbox sb;
  const auto o = sb.parse({"--hosts", "h0,host-with-a-longer-name", "train.py", "--data", "x"});
  REQUIRE(o.fanout);
  FanoutPlan plan = *o.fanout;
  const std::string endpoint = "127.0.0.1:29400";
  const std::string id = "fanout-run";
  const std::size_t longest = remote_command(plan, plan.hosts[1], endpoint, id).size();
  CHECK(remote_command(plan, plan.hosts[0], endpoint, id).size() < longest);
  // Grow the program until the longer host's command is exactly at the limit: it passes; one
  // byte more and that host is named.
  plan.program.back() += std::string(kMaxRemoteCommand - longest, 'x');
  REQUIRE(remote_command(plan, plan.hosts[1], endpoint, id).size() == kMaxRemoteCommand);
  CHECK_NOTHROW(check_remote_commands(plan, endpoint, id));
  plan.program.back() += "x";
  CHECK_THROWS_WITH(check_remote_commands(plan, endpoint, id), Contains("on host host-with-a-longer-name is"));
}

TEST_CASE("ssh_check_command: the launcher's own ssh command line, for the host it could not reach") {
  FanoutSandbox sb;
  Sandbox::write(sb.dir() / "cfg", "", false);
  const auto o = sb.parse({"--hosts", "u@h0", "--ssh-port", "2222", "--ssh-config", "cfg", "--ssh-option",
                           "IdentityFile=/k/id x", "train.py"});
  REQUIRE(o.fanout);
  const std::string cmd = ssh_check_command(*o.fanout, o.fanout->hosts[0]);
  CHECK_THAT(cmd, Contains(sb.path("bin/ssh") + " -T -F " + sb.path("cfg") + " -p 2222 -o 'IdentityFile=/k/id x'") &&
                      Contains("-o BatchMode=yes"));
  CHECK_THAT(cmd, Contains(" u@h0 true"));
}

TEST_CASE("agent flags are checked, then forwarded; PET_* values too") {
  FanoutSandbox sb;
  const auto o = sb.parse({"--hosts", "h0", "--max-restarts", "3", "--tee", "3", "-m", "--shutdown-timeout", "5",
                           "--kill-timeout", "7", "--log-level", "debug", "pkg.train"},
                          {{"PET_ROLE", "trainer"}});
  REQUIRE(o.fanout);
  const Strings& a = o.fanout->agent_args;
  CHECK(has(a, "--max-restarts=3"));
  CHECK(has(a, "--tee=3"));
  CHECK(has(a, "--module"));
  CHECK(has(a, "--role=trainer"));
  CHECK(has(a, "--log-level=debug"));
  CHECK(o.fanout->shutdown_timeout == std::chrono::milliseconds(5000));
  // The launcher waits for the agents' kill wait too before it cuts their connections.
  CHECK(has(a, "--kill-timeout=7"));
  CHECK(o.fanout->kill_timeout == std::chrono::milliseconds(7000));
  CHECK(o.fanout->program == Strings{"pkg.train"});
  CHECK_THROWS_AS(sb.parse({"--hosts", "h0", "--max-restarts", "x", "train.py"}), UsageError);
  CHECK_THROWS_AS(sb.parse({"--hosts", "h0", "--tee", "9", "train.py"}), UsageError);
}

TEST_CASE("flags without effect are checked with a host list as with one node, and not forwarded") {
  FanoutSandbox sb;
  const auto o = sb.parse({"--hosts", "h0", "--monitor-interval", "5", "--start-method", "fork", "--use-env",
                           "--logs-specs", "default", "train.py"});
  REQUIRE(o.fanout);
  for (const char* note :
       {"--monitor-interval has no effect", "--start-method has no effect", "--use-env has no effect"}) {
    CHECK(std::any_of(o.notes.begin(), o.notes.end(), [&](const std::string& n) { return n.find(note) == 0; }));
  }
  for (const auto& arg : o.fanout->agent_args) {
    CHECK(arg.find("monitor") == std::string::npos);
    CHECK(arg.find("start-method") == std::string::npos);
    CHECK(arg.find("use-env") == std::string::npos);
    CHECK(arg.find("logs-specs") == std::string::npos);
  }
  CHECK_THROWS_WITH(sb.parse({"--hosts", "h0", "--monitor-interval", "abc", "train.py"}),
                    Contains("--monitor-interval=abc"));
  CHECK_THROWS_WITH(sb.parse({"--hosts", "h0", "--start-method", "bogus", "train.py"}),
                    Contains("--start-method=bogus"));
  CHECK_THROWS_WITH(sb.parse({"--hosts", "h0", "--use-env", "--local-rank-arg", "dash", "train.py"}),
                    Contains("--use-env and --local-rank-arg contradict each other"));
  CHECK_THROWS_WITH(sb.parse({"--hosts", "h0", "--logs-specs", "custom", "train.py"}),
                    Contains("cannot load torchrun.logs_specs"));
}

TEST_CASE("the rendezvous token never goes on a command line") {
  FanoutSandbox sb;
  CHECK_THROWS_AS(sb.parse({"--hosts", "h0", "--rdzv-conf", "token=s3cret", "train.py"}), UsageError);
  const auto o =
      sb.parse({"--hosts", "h0", "--rdzv-conf", "join_timeout=5", "train.py"}, {{"DDPRUN_RDZV_TOKEN", "s3cret"}});
  REQUIRE(o.fanout);
  CHECK(o.fanout->rdzv_token == "s3cret");
  CHECK_FALSE(any_contains(o.fanout->agent_args, "s3cret"));
  CHECK(has(o.fanout->agent_args, "--rdzv-conf=is_host=false,join_timeout=5"));
  const std::string cmd = remote_command(*o.fanout, o.fanout->hosts[0], "10.0.0.1:5", "job");
  CHECK(cmd.find("s3cret") == std::string::npos);
  // From token_file as well; the path does not reach the remote agents either.
  Sandbox::write(sb.dir() / "tok", "filetok\n", false);
  const std::string conf = "token_file=" + (sb.dir() / "tok").string();
  const auto o2 = sb.parse({"--hosts", "h0", "--rdzv-conf", conf, "train.py"});
  CHECK(o2.fanout->rdzv_token == "filetok");
  CHECK_FALSE(any_contains(o2.fanout->agent_args, "token_file"));
}

TEST_CASE("rdzv-conf keys the launcher reported as ignored are not forwarded; etcd keys are refused") {
  FanoutSandbox sb;
  const auto o = sb.parse(
      {"--hosts", "h0", "--rdzv-conf", "foo=1,use_libuv=0,timeout=9,join_timeout=5,keep_alive_interval=2", "train.py"});
  REQUIRE(o.fanout);
  CHECK(has(o.fanout->agent_args, "--rdzv-conf=is_host=false,join_timeout=5,keep_alive_interval=2"));
  CHECK(any_contains(o.notes, "ignored: unknown key 'foo'"));
  CHECK_THROWS_WITH(sb.parse({"--hosts", "h0", "--rdzv-conf", "cacert=/x.pem", "train.py"}),
                    Catch::Contains("applies only to --rdzv-backend etcd"));
}

TEST_CASE("the carried environment: the default set, --env and --env-file; device selection stays behind") {
  FanoutSandbox sb;
  Sandbox::write(sb.dir() / "job.env", "export FROM_FILE=1\n# c\nFOO=file\n", false);
  const auto o =
      sb.parse({"--hosts", "h0", "--env", "FOO=flag", "--env", "ONLY_HERE", "--env-file", "job.env", "train.py"},
               {{"NCCL_DEBUG", "INFO"},
                {"CUDA_VISIBLE_DEVICES", "1"},
                {"ONLY_HERE", "x y"},
                {"UNRELATED", "no"},
                {"MASTER_ADDR", "1.2.3.4"}});
  REQUIRE(o.fanout);
  const auto& p = *o.fanout;
  REQUIRE(env_value(p, "NCCL_DEBUG"));
  CHECK(*env_value(p, "NCCL_DEBUG") == "INFO");
  CHECK(env_value(p, "CUDA_VISIBLE_DEVICES") == nullptr);
  CHECK(env_value(p, "UNRELATED") == nullptr);
  CHECK(env_value(p, "MASTER_ADDR") == nullptr);
  REQUIRE(env_value(p, "FOO"));
  CHECK(*env_value(p, "FOO") == "flag");  // --env wins over the file
  REQUIRE(env_value(p, "FROM_FILE"));
  REQUIRE(env_value(p, "ONLY_HERE"));
  CHECK(*env_value(p, "ONLY_HERE") == "x y");
  CHECK(o.notes.empty());
  CHECK_THROWS_AS(sb.parse({"--hosts", "h0", "--env", "RANK=3", "train.py"}), UsageError);
  // A name this shell does not have carries nothing, and says so (as mpirun -x warns).
  const auto unset = sb.parse({"--hosts", "h0", "--env", "NOT_SET_HERE", "train.py"}, {{"NCCL_DEBUG", "INFO"}});
  REQUIRE(unset.fanout);
  CHECK(env_value(*unset.fanout, "NOT_SET_HERE") == nullptr);
  REQUIRE(unset.notes.size() == 1);
  CHECK_THAT(unset.notes[0],
             Contains("--env NOT_SET_HERE: NOT_SET_HERE is not set here") && Contains("--env NOT_SET_HERE=VALUE"));
}

TEST_CASE("remote_command: the agent's flags, the host label in the prefix, every word quoted") {
  FanoutSandbox sb;
  const auto o =
      sb.parse({"--hosts", "h0", "--nproc-per-node", "2", "--ranks-filter", "0,3-5", "train.py", "a b", "it's"});
  REQUIRE(o.fanout);
  const std::string cmd = remote_command(*o.fanout, o.fanout->hosts[0], "10.0.0.1:5", "job-1");
  CHECK_THAT(cmd, Contains("cd -- "));
  CHECK_THAT(cmd, Contains(" --remote-agent "));
  CHECK_THAT(cmd, Contains("--node-label=h0"));
  CHECK_THAT(cmd, Contains("--rdzv-endpoint=10.0.0.1:5"));
  CHECK_THAT(cmd, Contains("--nnodes=1"));
  CHECK_THAT(cmd, Contains("--nproc-per-node=2"));
  CHECK_THAT(cmd, Contains("'--log-line-prefix-template=[h0:${rank}]:'"));  // quoted: no shell expansion
  CHECK_THAT(cmd, Contains("--ranks-filter=0,3-5"));
  CHECK_THAT(cmd, Contains(" -- train.py 'a b' 'it'\\''s'"));
  // Group ranks follow the host list: each agent is told its position.
  const auto three = sb.parse({"--hosts", "h2,h0,h1", "train.py"});
  REQUIRE(three.fanout);
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK_THAT(
        remote_command(*three.fanout, three.fanout->hosts[i], "10.0.0.1:5", "j"),
        Contains("--node-order=" + std::to_string(i)) && Contains("--node-label=" + three.fanout->hosts[i].host));
  }
  CHECK(three.fanout->hosts[0].host == "h2");
}

TEST_CASE("--remote-cwd: a leading ~ or ~user is left for the host's shell to expand, the rest quoted") {
  CHECK(remote_dir_word("/w/a b") == "'/w/a b'");
  CHECK(remote_dir_word("~") == "~");
  CHECK(remote_dir_word("~/") == "~/");
  CHECK(remote_dir_word("~/run dir/$x") == "~/'run dir/$x'");
  CHECK(remote_dir_word("~alice/w") == "~alice/w");
  CHECK(remote_dir_word("~a$(x)/w") == "'~a$(x)/w'");  // not a user name: all quoted
  CHECK(remote_dir_word("~-/w") == "'~-/w'");          // ~- is the shell's OLDPWD, not a home
  FanoutSandbox sb;
  const auto o = sb.parse({"--hosts", "h0", "--remote-cwd", "~/job 1", "train.py"});
  REQUIRE(o.fanout);
  CHECK_THAT(remote_command(*o.fanout, o.fanout->hosts[0], "10.0.0.1:5", "j"), Contains("cd -- ~/'job 1' && exec "));
  // What a POSIX shell makes of it: the home directory's "job 1".
  std::filesystem::create_directories(sb.dir() / "job 1");
  const std::string script = "HOME=" + shell_quote(sb.dir().string()) + "; cd -- " + remote_dir_word("~/job 1") +
                             " && pwd > " + shell_quote(sb.path("pwd.out"));
  REQUIRE(std::system(("/bin/sh -c " + shell_quote(script)).c_str()) == 0);
  std::ifstream in(sb.path("pwd.out"));
  std::string line;
  std::getline(in, line);
  CHECK(line == (sb.dir() / "job 1").string());
}

TEST_CASE("an empty --remote-cwd or --remote-ddprun is refused, naming the flag and what it takes") {
  FanoutSandbox sb;
  // Empty, the host's shell would cd to the remote home directory, or run "exec  --remote-agent".
  CHECK_THROWS_WITH(sb.parse({"--hosts", "h0", "--remote-cwd", "", "train.py"}),
                    Contains("--remote-cwd is empty") && Contains("absolute path") && Contains("'~/DIR'"));
  CHECK_THROWS_WITH(sb.parse({"--hosts", "h0", "--remote-cwd", " ", "train.py"}), Contains("--remote-cwd is empty"));
  CHECK_THROWS_WITH(sb.parse({"--hosts", "h0", "--remote-ddprun", "", "train.py"}),
                    Contains("--remote-ddprun is empty") && Contains("ddprun's path on the hosts"));
  CHECK_THROWS_AS(sb.parse({"--hosts", "h0", "--remote-ddprun=", "train.py"}), UsageError);
}

TEST_CASE("a host's agent must be ready within ssh's ConnectTimeout plus the rendezvous join timeout") {
  FanoutSandbox sb;
  using std::chrono::milliseconds;
  CHECK(sb.parse({"--hosts", "h0", "train.py"}).fanout->ready_timeout == milliseconds((10 + 600) * 1000));
  CHECK(sb.parse({"--hosts", "h0", "--rdzv-conf", "join_timeout=2.5", "train.py"}).fanout->ready_timeout ==
        milliseconds(12'500));
  CHECK(sb.parse({"--hosts", "h0", "--rdzv-conf", "timeout=30", "train.py"}).fanout->ready_timeout ==
        milliseconds(40'000));
  // The user's ConnectTimeout wins over the default, as in ssh; its time format too.
  CHECK(sb.parse({"--hosts", "h0", "--ssh-option", "connecttimeout=1m5s", "--rdzv-conf", "join_timeout=5", "train.py"})
            .fanout->ready_timeout == milliseconds(70'000));
  // No timeout of ssh's own: the kernel's connect timeout (127 s).
  CHECK(sb.parse({"--hosts", "h0", "--ssh-option", "ConnectTimeout=0", "--rdzv-conf", "join_timeout=5", "train.py"})
            .fanout->ready_timeout == milliseconds(132'000));
}

TEST_CASE("--ranks-filter takes ranks and ranges") {
  CHECK(parse_ranks_filter("0,3-5", "--ranks-filter") == std::set<int>{0, 3, 4, 5});
  CHECK(parse_ranks_filter(" 7 ", "--ranks-filter") == std::set<int>{7});
  CHECK_FALSE(parse_ranks_filter("", "--ranks-filter"));
  CHECK_THROWS_WITH(parse_ranks_filter("5-3", "--ranks-filter"), Contains("empty"));
  CHECK_THROWS_WITH(parse_ranks_filter("x", "--ranks-filter"), Contains("--ranks-filter"));
  CHECK_THROWS_AS(parse_ranks_filter("-1", "--ranks-filter"), UsageError);
  Sandbox sb;
  const auto o =
      sb.parse({"--ranks-filter", "1-2", "--prefix-output", "--log-line-prefix-template", "<${rank}>", "train.py"});
  CHECK(o.config.ranks_filter == std::set<int>{1, 2});
  CHECK(o.config.prefix_console);
  CHECK(o.config.log_line_prefix_template == "<${rank}>");
}

TEST_CASE("inside a Slurm allocation the node count, node rank and endpoint come from Slurm") {
  Sandbox sb;
  const Env slurm = {{"SLURM_JOB_ID", "77"},
                     {"SLURM_NNODES", "2"},
                     {"SLURM_NODEID", "1"},
                     {"SLURM_JOB_NODELIST", "gpu[07-08]"},
                     {"SLURM_STEP_NODELIST", "gpu[07-08]"}};
  auto o = sb.parse({"--nproc-per-node", "4", "train.py"}, slurm);
  CHECK(o.config.rdzv_backend == "c10d");
  CHECK(o.config.min_nodes == 2);
  CHECK(o.config.max_nodes == 2);
  CHECK(o.config.rdzv_endpoint == "gpu07:29400");
  CHECK(o.config.run_id == "slurm-77");
  CHECK(o.config.node_rank == 1);
  REQUIRE(o.config.rdzv.is_host);
  CHECK_FALSE(*o.config.rdzv.is_host);

  Env first = slurm;
  first["SLURM_NODEID"] = "0";
  o = sb.parse({"train.py"}, first);
  REQUIRE(o.config.rdzv.is_host);
  CHECK(*o.config.rdzv.is_host);

  Env other_port = slurm;
  other_port["DDPRUN_SLURM_RDZV_PORT"] = "31000";
  CHECK(sb.parse({"train.py"}, other_port).config.rdzv_endpoint == "gpu07:31000");
  other_port["DDPRUN_SLURM_RDZV_PORT"] = "x";
  CHECK_THROWS_WITH(sb.parse({"train.py"}, other_port), Contains("DDPRUN_SLURM_RDZV_PORT=x"));

  // srun with several tasks per node would start several agents per node.
  Env many = slurm;
  many["SLURM_STEP_NUM_TASKS"] = "8";
  CHECK_THROWS_WITH(sb.parse({"train.py"}, many), Contains("ddprun runs once per node"));
  many["SLURM_STEP_NUM_TASKS"] = "2";
  CHECK(sb.parse({"train.py"}, many).config.max_nodes == 2);
  // An salloc shell (no SLURM_NODEID): a plain single-node job (standalone: one node, no port).
  Env shell = slurm;
  shell.erase("SLURM_NODEID");
  CHECK(sb.parse({"train.py"}, shell).config.standalone);
  CHECK(sb.parse({"--master-port", "29500", "train.py"}, shell).config.rdzv_backend == "static");
  // A batch script (SLURM_NODEID=0, no srun step): a plain job on this node, and a note saying so.
  Env batch = slurm;
  batch.erase("SLURM_STEP_NODELIST");
  batch["SLURM_NODEID"] = "0";
  o = sb.parse({"train.py"}, batch);
  CHECK(o.config.standalone);
  CHECK(o.config.max_nodes == 1);
  CHECK(std::any_of(o.notes.begin(), o.notes.end(), [](const std::string& n) {
    return n.find("outside srun (a batch script or salloc shell): a job on this node only") != std::string::npos;
  }));
  CHECK(sb.parse({"--nnodes", "1", "train.py"}, batch).notes.empty());

  // Explicit rendezvous flags win; a one-node allocation is a plain single-node job.
  o = sb.parse({"--nnodes", "1", "train.py"}, slurm);
  CHECK(o.config.standalone);
  CHECK(o.config.max_nodes == 1);
  CHECK(o.notes.empty());  // one node asked for: nothing to warn about
  // A placement flag without --nnodes in an allocation of several nodes: one job per node, said.
  o = sb.parse({"--master-addr", "10.0.0.1", "train.py"}, slurm);
  CHECK(o.config.standalone);
  CHECK(std::any_of(o.notes.begin(), o.notes.end(), [](const std::string& n) {
    return n.find("a placement flag without --nnodes runs a separate one-node job on each node") != std::string::npos;
  }));
  Env one = slurm;
  one["SLURM_NNODES"] = "1";
  one["SLURM_NODEID"] = "0";
  one["SLURM_JOB_NODELIST"] = "gpu07";
  one["SLURM_STEP_NODELIST"] = "gpu07";
  o = sb.parse({"train.py"}, one);
  CHECK(o.config.standalone);
  CHECK(o.config.max_nodes == 1);
}
