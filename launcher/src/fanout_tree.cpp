// The launch tree's pure half (fanout.hpp): how the host list is cut into subtrees, and how a
// subtree travels to its root in the environment block. The running half is in fanout.cpp.
#include <unistd.h>

#include <algorithm>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ddprun/agent/process.hpp"
#include "ddprun/common/error.hpp"
#include "ddprun/common/strings.hpp"
#include "ddprun/launcher/fanout.hpp"

namespace ddprun::launcher {

namespace {

// Bumped whenever the encoding changes: a tree node refuses a plan of another version.
constexpr std::string_view kTreeFormat = "ddprun-tree-3";

// Fields are "<length>:<bytes>", so any byte but NUL (the env block's separator) survives.
class Writer {
 public:
  void put(std::string_view s) {
    out_ += std::to_string(s.size());
    out_.push_back(':');
    out_.append(s);
  }
  void put(std::size_t n) { put(std::to_string(n)); }
  void put(const std::vector<std::string>& list) {
    put(list.size());
    for (const auto& s : list) put(s);
  }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(std::string_view text) : text_(text) {}
  std::string get() {
    const auto colon = text_.find(':');
    if (colon == std::string_view::npos || colon == 0 || colon > 9) fail("a field without its length");
    const auto len = parse_int(text_.substr(0, colon));
    if (!len || *len < 0 || static_cast<std::size_t>(*len) > text_.size() - colon - 1) fail("a truncated field");
    std::string s(text_.substr(colon + 1, static_cast<std::size_t>(*len)));
    text_.remove_prefix(colon + 1 + static_cast<std::size_t>(*len));
    return s;
  }
  std::size_t get_size() {
    const std::string s = get();
    const auto v = parse_int(s);
    if (!v || *v < 0) fail("'" + s.substr(0, 32) + "' where a count belongs");
    return static_cast<std::size_t>(*v);
  }
  std::vector<std::string> get_list() {
    const std::size_t n = get_size();
    if (n > text_.size()) fail("a list longer than the text");
    std::vector<std::string> out;
    out.reserve(n);
    for (std::size_t i = 0; i < n; ++i) out.push_back(get());
    return out;
  }
  bool empty() const { return text_.empty(); }
  [[noreturn]] static void fail(const std::string& why) {
    throw Error("launch tree plan in the environment block (" + std::string(kTreeEnvName) + "): " + why,
                "the launcher and every host must run the same ddprun version (--remote-ddprun)");
  }

 private:
  std::string_view text_;
};

}  // namespace

std::vector<std::pair<std::size_t, std::size_t>> split_subtrees(std::size_t begin, std::size_t end, int fanout) {
  std::vector<std::pair<std::size_t, std::size_t>> runs;
  if (end <= begin) return runs;
  const std::size_t n = end - begin;
  const std::size_t k = std::min<std::size_t>(n, static_cast<std::size_t>(std::max(fanout, 1)));
  const std::size_t base = n / k;
  const std::size_t extra = n % k;
  std::size_t at = begin;
  for (std::size_t i = 0; i < k; ++i) {
    const std::size_t len = base + (i < extra ? 1 : 0);
    runs.emplace_back(at, at + len);
    at += len;
  }
  return runs;
}

bool uses_tree(const FanoutPlan& plan) {
  return plan.tree_fanout >= 2 && plan.tree_threshold > 0 && plan.hosts.size() > plan.tree_threshold;
}

std::vector<long> tree_parents(std::size_t hosts, int fanout) {
  std::vector<long> parent(hosts, -1);
  if (fanout < 2) return parent;
  // (range, parent) to cut; a range's first host is the root of the rest of it.
  std::vector<std::pair<std::pair<std::size_t, std::size_t>, long>> todo = {{{0, hosts}, -1}};
  while (!todo.empty()) {
    const auto [range, up] = todo.back();
    todo.pop_back();
    for (const auto& [b, e] : split_subtrees(range.first, range.second, fanout)) {
      parent[b] = up;
      if (e > b + 1) todo.push_back({{b + 1, e}, static_cast<long>(b)});
    }
  }
  return parent;
}

std::size_t tree_depth(std::size_t hosts, int fanout) {
  const auto parent = tree_parents(hosts, fanout);
  std::vector<std::size_t> depth(hosts, 1);
  std::size_t deepest = hosts == 0 ? 0 : 1;
  // A parent always precedes its children in the list.
  for (std::size_t i = 0; i < hosts; ++i) {
    if (parent[i] >= 0) depth[i] = depth[static_cast<std::size_t>(parent[i])] + 1;
    deepest = std::max(deepest, depth[i]);
  }
  return deepest;
}

std::string encode_tree_node(const TreeNodePlan& node) {
  const FanoutPlan& p = node.plan;
  Writer w;
  w.put(kTreeFormat);
  w.put(node.self_label);
  w.put(node.endpoint);
  w.put(node.run_id);
  w.put(node.path);
  w.put(p.ssh_command);
  w.put(static_cast<std::size_t>(p.max_inflight));
  w.put(p.remote_ddprun);
  w.put(p.remote_cwd);
  w.put(p.agent_args);
  w.put(p.program);
  w.put(p.ranks_filter);
  w.put(static_cast<std::size_t>(p.shutdown_timeout.count()));
  w.put(static_cast<std::size_t>(p.kill_timeout.count()));
  w.put(static_cast<std::size_t>(p.ready_timeout.count()));
  w.put(p.tree_threshold);
  w.put(static_cast<std::size_t>(p.tree_fanout));
  w.put(p.nnodes == 0 ? p.hosts.size() : p.nnodes);
  w.put(static_cast<std::size_t>(p.log_level));
  w.put(p.hosts.size());
  for (const auto& h : p.hosts) {
    w.put(h.user);
    w.put(h.host);
    w.put(h.nproc);
    w.put(h.gpus);
    w.put(h.index);
  }
  return w.take();
}

TreeNodePlan decode_tree_node(std::string_view text) {
  Reader r(text);
  if (r.get() != kTreeFormat) Reader::fail("not a " + std::string(kTreeFormat) + " plan");
  TreeNodePlan node;
  FanoutPlan& p = node.plan;
  node.self_label = r.get();
  node.endpoint = r.get();
  node.run_id = r.get();
  node.path = r.get();
  p.ssh_command = r.get_list();
  if (p.ssh_command.empty()) Reader::fail("no ssh command");
  p.max_inflight = static_cast<int>(std::clamp<std::size_t>(r.get_size(), 1, 10'000));
  p.remote_ddprun = r.get();
  p.remote_cwd = r.get();
  p.agent_args = r.get_list();
  p.program = r.get_list();
  p.ranks_filter = r.get();
  // Bounded like the flags they come from: a week of grace at most (no overflow when the kill
  // margin is added), a fan-out of at least 2 (1 would chain every host one below the other).
  p.shutdown_timeout = std::chrono::milliseconds(
      static_cast<std::int64_t>(std::min<std::size_t>(r.get_size(), 7ULL * 24 * 3600 * 1000)));
  p.kill_timeout = std::chrono::milliseconds(
      static_cast<std::int64_t>(std::clamp<std::size_t>(r.get_size(), 1, 7ULL * 24 * 3600 * 1000)));
  p.ready_timeout = std::chrono::milliseconds(
      static_cast<std::int64_t>(std::clamp<std::size_t>(r.get_size(), 1, 7ULL * 24 * 3600 * 1000)));
  p.tree_threshold = r.get_size();
  p.tree_fanout = static_cast<int>(std::min<std::size_t>(r.get_size(), 1'000'000));
  if (p.tree_fanout < 2) Reader::fail("a tree fan-out below 2");
  p.nnodes = r.get_size();
  p.log_level = static_cast<int>(std::min<std::size_t>(r.get_size(), 6));
  const std::size_t n = r.get_size();
  if (n > text.size()) Reader::fail("more hosts than the text can hold");
  for (std::size_t i = 0; i < n; ++i) {
    FanoutHost h;
    h.user = r.get();
    h.host = r.get();
    h.nproc = r.get();
    h.gpus = r.get();
    h.index = r.get_size();
    p.hosts.push_back(std::move(h));
  }
  if (!r.empty()) Reader::fail("bytes after the last host");
  return node;
}

std::string node_ssh_client(const std::string& launcher_ssh, const std::string& path_var) {
  // Hosts of one cluster may keep ssh in different places (/usr/bin, /usr/local/bin, a module).
  if (::access(launcher_ssh.c_str(), X_OK) == 0) return launcher_ssh;
  try {
    return agent::resolve_executable("ssh", path_var, "");
  } catch (const Error&) {
    return launcher_ssh;
  }
}

}  // namespace ddprun::launcher
