// The launch tree's pure parts (fanout.hpp): who starts whom, how deep, and the subtree plan that
// travels to each root in the environment block. No ssh is run.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <map>
#include <sstream>

#include "ddprun/common/error.hpp"
#include "ddprun/launcher/command_line.hpp"
#include "ddprun/launcher/fanout.hpp"
#include "sandbox.hpp"

using namespace ddprun::launcher;
using Catch::Matchers::Contains;
using Runs = std::vector<std::pair<std::size_t, std::size_t>>;

namespace {

// The hosts each position starts (the launcher is position -1).
std::map<long, std::vector<std::size_t>> children_of(const std::vector<long>& parent) {
  std::map<long, std::vector<std::size_t>> out;
  for (std::size_t i = 0; i < parent.size(); ++i) out[parent[i]].push_back(i);
  return out;
}

}  // namespace

TEST_CASE("split_subtrees cuts a host range into at most F contiguous runs of nearly equal size") {
  CHECK(split_subtrees(0, 7, 2) == Runs{{0, 4}, {4, 7}});
  CHECK(split_subtrees(1, 4, 2) == Runs{{1, 3}, {3, 4}});
  CHECK(split_subtrees(0, 3, 5) == Runs{{0, 1}, {1, 2}, {2, 3}});  // fewer hosts than F: one each
  CHECK(split_subtrees(5, 5, 4).empty());
  for (std::size_t n : {1u, 2u, 15u, 16u, 17u, 999u, 1000u}) {
    for (int f : {2, 3, 16, 32}) {
      const auto runs = split_subtrees(10, 10 + n, f);
      REQUIRE(runs.size() == std::min<std::size_t>(n, static_cast<std::size_t>(f)));
      std::size_t at = 10;
      std::size_t lo = n;
      std::size_t hi = 0;
      for (const auto& [b, e] : runs) {
        CHECK(b == at);  // contiguous, in order, nothing lost
        CHECK(e > b);
        lo = std::min(lo, e - b);
        hi = std::max(hi, e - b);
        at = e;
      }
      CHECK(at == 10 + n);
      CHECK(hi - lo <= 1);
    }
  }
}

TEST_CASE("tree_parents: the launcher starts F roots, every node at most F hosts, parents come first") {
  // 7 hosts, fan-out 2: launcher -> {0, 4}; 0 -> {1, 3}; 1 -> {2}; 4 -> {5, 6}.
  CHECK(tree_parents(7, 2) == std::vector<long>{-1, 0, 1, 0, -1, 4, 4});
  CHECK(tree_depth(7, 2) == 3);
  // Fan-out below 2: flat, everything from the launcher.
  CHECK(tree_parents(5, 0) == std::vector<long>(5, -1));
  CHECK(tree_depth(5, 0) == 1);
  CHECK(tree_depth(0, 16) == 0);
  CHECK(tree_depth(1, 16) == 1);
  for (std::size_t n : {1u, 16u, 17u, 64u, 65u, 1000u, 10000u}) {
    for (int f : {2, 4, 16, 32}) {
      const auto parent = tree_parents(n, f);
      for (const auto& [p, kids] : children_of(parent)) CHECK(kids.size() <= static_cast<std::size_t>(f));
      for (std::size_t i = 0; i < n; ++i) CHECK(parent[i] < static_cast<long>(i));
      // A subtree is a contiguous run: each child sits after its parent and before the next
      // host its parent starts.
      const auto kids = children_of(parent);
      for (const auto& [p, list] : kids) CHECK(std::is_sorted(list.begin(), list.end()));
    }
  }
  // O(log_F hosts) deep: what docs/multinode.md promises.
  CHECK(tree_depth(16, 16) == 1);
  CHECK(tree_depth(17, 16) == 2);
  CHECK(tree_depth(1000, 16) == 3);
  CHECK(tree_depth(10000, 16) == 4);
  CHECK(tree_depth(1000, 32) == 2);
}

TEST_CASE("uses_tree: only above the threshold, never when off or fan-out < 2") {
  FanoutPlan p;
  p.hosts.resize(64);
  CHECK_FALSE(uses_tree(p));  // the default threshold is 64: more than 64 hosts
  p.hosts.resize(65);
  CHECK(uses_tree(p));
  p.tree_threshold = 0;  // off
  CHECK_FALSE(uses_tree(p));
  p.tree_threshold = 1;
  p.tree_fanout = 1;
  CHECK_FALSE(uses_tree(p));
}

TEST_CASE("a subtree plan survives the environment block byte for byte") {
  TreeNodePlan n;
  n.self_label = "h3";
  n.endpoint = "[fd00::1]:29400";
  n.run_id = "job-1";
  n.path = "launcher -> h0 -> h3";
  n.plan.ssh_command = {"/usr/bin/ssh", "-T", "-F", "/a dir/cfg", "-o", "BatchMode=yes"};
  n.plan.max_inflight = 7;
  n.plan.remote_ddprun = "/opt/dd prun";
  n.plan.remote_cwd = "/work/x";
  n.plan.agent_args = {"--rdzv-conf=is_host=false", "--max-restarts=2"};
  n.plan.program = {"train.py", "--msg", "a:b 12:34\nnew line 'q' \"d\" $X", ""};
  n.plan.ranks_filter = "0,3";
  n.plan.shutdown_timeout = std::chrono::milliseconds(2500);
  n.plan.kill_timeout = std::chrono::milliseconds(750);
  n.plan.ready_timeout = std::chrono::milliseconds(13500);
  n.plan.tree_fanout = 3;
  n.plan.tree_threshold = 9;
  n.plan.nnodes = 40;
  n.plan.log_level = 1;
  for (std::size_t i = 0; i < 3; ++i) {
    FanoutHost h;
    h.user = i == 1 ? "u" : "";
    h.host = "h" + std::to_string(4 + i);
    h.nproc = i == 2 ? "gpu" : "2";
    h.gpus = i == 0 ? "0,1" : "";
    h.index = 4 + i;
    n.plan.hosts.push_back(h);
  }
  const std::string text = encode_tree_node(n);
  CHECK(text.find('\0') == std::string::npos);  // it is an env value
  const TreeNodePlan d = decode_tree_node(text);
  CHECK(d.self_label == n.self_label);
  CHECK(d.endpoint == n.endpoint);
  CHECK(d.run_id == n.run_id);
  CHECK(d.path == n.path);
  CHECK(d.plan.ssh_command == n.plan.ssh_command);
  CHECK(d.plan.max_inflight == 7);
  CHECK(d.plan.remote_ddprun == n.plan.remote_ddprun);
  CHECK(d.plan.remote_cwd == n.plan.remote_cwd);
  CHECK(d.plan.agent_args == n.plan.agent_args);
  CHECK(d.plan.program == n.plan.program);
  CHECK(d.plan.ranks_filter == "0,3");
  CHECK(d.plan.shutdown_timeout == std::chrono::milliseconds(2500));
  CHECK(d.plan.kill_timeout == std::chrono::milliseconds(750));
  CHECK(d.plan.ready_timeout == std::chrono::milliseconds(13500));
  CHECK(d.plan.tree_fanout == 3);
  CHECK(d.plan.tree_threshold == 9);
  CHECK(d.plan.nnodes == 40);
  CHECK(d.plan.log_level == 1);
  REQUIRE(d.plan.hosts.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(d.plan.hosts[i].user == n.plan.hosts[i].user);
    CHECK(d.plan.hosts[i].host == n.plan.hosts[i].host);
    CHECK(d.plan.hosts[i].nproc == n.plan.hosts[i].nproc);
    CHECK(d.plan.hosts[i].gpus == n.plan.hosts[i].gpus);
    CHECK(d.plan.hosts[i].index == n.plan.hosts[i].index);
  }
  // Every agent of the subtree is told the whole job's node count, not its subtree's.
  CHECK_THAT(remote_command(d.plan, d.plan.hosts[0], d.endpoint, d.run_id), Contains("--nnodes=40"));
  CHECK_THAT(remote_command(d.plan, d.plan.hosts[0], d.endpoint, d.run_id), Contains("--node-order=4"));

  // Another version's or a damaged plan is refused with a message naming the variable.
  CHECK_THROWS_WITH(decode_tree_node("garbage"), Contains(std::string(kTreeEnvName)));
  CHECK_THROWS_WITH(decode_tree_node(text.substr(0, text.size() - 3)), Contains("same ddprun version"));
  CHECK_THROWS_WITH(decode_tree_node(text + "1:x"), Contains("bytes after the last host"));
  CHECK_THROWS_WITH(decode_tree_node("13:ddprun-tree-9"), Contains("not a ddprun-tree-3 plan"));

  // Numbers from the plan are bounded like the flags they come from.
  TreeNodePlan chain = n;
  chain.plan.tree_fanout = 1;
  CHECK_THROWS_WITH(decode_tree_node(encode_tree_node(chain)), Contains("fan-out below 2"));
  TreeNodePlan slow = n;
  slow.plan.shutdown_timeout = std::chrono::milliseconds(std::numeric_limits<std::int64_t>::max());
  slow.plan.kill_timeout = std::chrono::milliseconds(std::numeric_limits<std::int64_t>::max());
  CHECK(decode_tree_node(encode_tree_node(slow)).plan.shutdown_timeout <= std::chrono::hours(24 * 7));
  CHECK(decode_tree_node(encode_tree_node(slow)).plan.kill_timeout <= std::chrono::hours(24 * 7));
}

TEST_CASE("--ssh-tree-threshold and --ssh-tree-fanout reach the plan; bad values name the flag") {
  ddprun::test::Sandbox sb;
  sb.write(sb.dir() / "bin" / "ssh", "#!/bin/sh\n", true);
  auto o = sb.parse({"--hosts", "h0,h1", "train.py"});
  REQUIRE(o.fanout);
  CHECK(o.fanout->tree_threshold == kDefaultTreeThreshold);
  CHECK(o.fanout->tree_fanout == kDefaultTreeFanout);
  o = sb.parse({"--hosts", "h0,h1", "--ssh-tree-threshold", "1", "--ssh-tree-fanout", "2", "train.py"});
  CHECK(o.fanout->tree_threshold == 1);
  CHECK(o.fanout->tree_fanout == 2);
  CHECK(uses_tree(*o.fanout));
  o = sb.parse({"--hosts", "h0,h1", "--ssh-tree-threshold", "off", "train.py"});
  CHECK(o.fanout->tree_threshold == 0);
  CHECK_FALSE(uses_tree(*o.fanout));
  CHECK_THROWS_WITH(sb.parse({"--hosts", "h0", "--ssh-tree-fanout", "1", "train.py"}), Contains("--ssh-tree-fanout"));
  CHECK_THROWS_WITH(sb.parse({"--hosts", "h0", "--ssh-tree-threshold", "many", "train.py"}),
                    Contains("--ssh-tree-threshold"));
  CHECK_THROWS_WITH(sb.parse({"--ssh-tree-fanout", "4", "train.py"}), Contains("--ssh-tree-fanout"));
  // The tree's own plan variable cannot be forwarded by hand: it would make a host a tree node.
  CHECK_THROWS_WITH(sb.parse({"--hosts", "h0", "--env", "DDPRUN_LAUNCH_TREE=x", "train.py"}),
                    Contains("DDPRUN_LAUNCH_TREE"));
}

TEST_CASE("--dry-run shows who starts whom in a launch tree") {
  FanoutPlan p;
  p.ssh_command = {"/usr/bin/ssh"};
  p.program = {"train.py"};
  p.tree_threshold = 1;
  p.tree_fanout = 2;
  for (const char* h : {"a", "b", "c", "d", "e"}) {
    FanoutHost x;
    x.host = h;
    x.index = p.hosts.size();
    p.hosts.push_back(x);
  }
  std::ostringstream out;
  print_fanout_dry_run(p, out);
  CHECK_THAT(out.str(), Contains("fan-out 2, depth 2"));
  CHECK_THAT(out.str(), Contains("host a is started by the launcher"));
  CHECK_THAT(out.str(), Contains("host c is started by a"));
  CHECK_THAT(out.str(), Contains("host e is started by d"));
  p.tree_threshold = 0;
  std::ostringstream flat;
  print_fanout_dry_run(p, flat);
  CHECK_THAT(flat.str(), !Contains("started by"));
}

TEST_CASE("a subtree plan larger than a host reads on stdin is refused before any host is contacted") {
  FanoutPlan p;
  p.ssh_command = {"/bin/false"};  // never run: the refusal comes first
  p.launcher_addr = "127.0.0.1";
  p.tree_threshold = 1;
  p.tree_fanout = 2;
  p.remote_ddprun = "ddprun";
  p.remote_cwd = "/";
  p.program = {"true"};
  for (std::size_t i = 0; i < 4000; ++i) {
    FanoutHost h;
    h.host = "host-with-a-longish-name-" + std::to_string(i);
    h.index = i;
    p.hosts.push_back(h);
  }
  // Under 1 MiB on its own (a leaf's block would fit), over it with 1,999 hosts of plan added.
  for (int i = 0; i < 10; ++i) p.env.emplace_back("BIG" + std::to_string(i), std::string(100'000, 'x'));
  CHECK_THROWS_WITH(run_fanout(p), Contains("hosts below it") && Contains("over the 1048576"));
}

TEST_CASE("a tree node runs the launcher's ssh where it exists, else the ssh on its own PATH") {
  ddprun::test::Sandbox sb;
  std::filesystem::create_directories(sb.dir() / "node-bin");
  ddprun::test::Sandbox::write(sb.dir() / "node-bin" / "ssh", "#!/bin/sh\n", true);
  const std::string node_path = "/nonexistent:" + sb.path("node-bin");
  CHECK(node_ssh_client(sb.path("bin/python3"), node_path) == sb.path("bin/python3"));  // executable here: kept
  CHECK(node_ssh_client("/opt/launcher-only/bin/ssh", node_path) == sb.path("node-bin/ssh"));
  CHECK(node_ssh_client("/opt/launcher-only/bin/ssh", "/nonexistent") == "/opt/launcher-only/bin/ssh");
}
