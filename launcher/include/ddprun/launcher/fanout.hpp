#pragma once
// The fan-out launcher: `ddprun --hostfile FILE ... train.py` on one machine starts one agent per
// host over the system OpenSSH client and shows every rank's output in its own terminal
// (docs/multinode.md).
//
// How it works: the launcher hosts an embedded rendezvous (store server + RendezvousService,
// the same code as ddprun-rdzvd) on an address the hosts can reach, then runs
//   ssh -o BatchMode=yes ... [user@]host 'cd -- CWD && exec DDPRUN --remote-agent ... -- PROGRAM ARGS'
// for every host, at most max_inflight connections being set up at once. Each remote agent is an
// ordinary elastic agent (c10d rendezvous against the launcher, N:N nodes) with three
// differences: it reads its environment from ssh's stdin (values never appear on a command
// line), it keeps that stdin as the launcher's control channel ("S<signo>\n" = forward a signal,
// EOF = the launcher or the connection is gone: stop the workers), and it prefixes every worker
// line with "[host:RANK]:". The launcher relays whole lines from every host; lines that are not a
// worker's or the agent's log get a "[host] " prefix.
//
// Exit code: the first failing agent's (every agent exits with the failing rank's own code);
// 128+N when the launcher is stopped by signal N; 1 when a host cannot be reached or set up (the
// message names the host and ssh's own explanation). Nothing outlives the launcher: ssh clients
// die with it (PR_SET_PDEATHSIG), remote agents see their stdin close, the rendezvous goes away.
//
// The launch tree (docs/multinode.md "Launch tree"): above tree_threshold hosts the launcher
// ssh's only to tree_fanout subtree roots. The host list is cut into tree_fanout contiguous,
// nearly equal runs (hostfile order); the first host of a run is its root and the rest of the run
// is the root's subtree, cut the same way below it. A root's remote ddprun reads its subtree
// (hosts, ssh command, agent flags, the rendezvous endpoint) from the environment block on
// stdin, entry kTreeEnvName, never from its command line, and becomes a tree node: it starts its
// own agent as a local child and its children over ssh, writes their lines upward unchanged
// (their prefixes name their hosts; other lines of a child get "[child] "), forwards "S<signo>"
// to every child and closes their stdin when its own closes (EOF cascades down: nothing outlives
// a SIGKILLed launcher at any depth; a tree node that dies itself takes its own agent with it by
// PR_SET_PDEATHSIG, without that agent's orderly stop, while the hosts below it see EOF), and exits
// with the first failing child's code. Every agent
// still joins the launcher's rendezvous directly, with --node-order = its hostfile index, so
// ranks and output are those of the flat launch.
//
// run_fanout runs its own io_context on the calling thread; not reentrant.
#include <chrono>
#include <cstddef>
#include <ostream>
#include <string_view>
#include <string>
#include <utility>
#include <vector>

#include "ddprun/agent/remote_protocol.hpp"

namespace ddprun::launcher {

// The tree's defaults: docs/performance.md "Multi-node from one command: SSH fan-out" has the
// measurements and the model behind them (break-even near 60 hosts on an 8-core launcher).
inline constexpr std::size_t kDefaultTreeThreshold = 64;
inline constexpr int kDefaultTreeFanout = 16;

struct FanoutHost {
  std::string user;         // "" = ssh's default (its config, else the local user name)
  std::string host;         // a name, an address, or an alias of the ssh config
  std::string nproc = "1";  // --nproc-per-node for this host's agent: N, or gpu|cpu|auto (counted there)
  std::string gpus;         // --gpus for this host's agent ("" = the agent's default: every visible device)
  // Position in the host list (after --include/--exclude/--num-nodes): the agents' group ranks
  // follow it (--node-order), as with DeepSpeed, mpirun and horovodrun.
  std::size_t index = 0;
  // How the host is named in output prefixes and messages.
  const std::string& label() const { return host; }
};

struct FanoutPlan {
  std::vector<FanoutHost> hosts;
  // The ssh client and its options, without the destination or the command, e.g.
  // {"/usr/bin/ssh", "-o", "BatchMode=yes", ..., "-p", "2222"}.
  std::vector<std::string> ssh_command;
  int max_inflight = 32;      // ssh connections being set up at once
  std::string remote_ddprun;  // ddprun's path on the hosts
  std::string remote_cwd;     // the workers' directory on the hosts
  // Flags forwarded to every remote agent as they are, before the program (--max-restarts 2 ...).
  std::vector<std::string> agent_args;
  std::vector<std::string> program;                      // the program and its arguments, as typed
  std::vector<std::pair<std::string, std::string>> env;  // carried to every host over stdin
  std::string launcher_addr;                             // where the hosts reach the embedded rendezvous ("" = pick)
  std::string ranks_filter;                              // --ranks-filter as typed ("" = every rank)
  std::string rdzv_token;                                // "" = a random one
  std::string run_id;                                    // "" = a random one
  std::chrono::milliseconds shutdown_timeout{std::chrono::seconds(30)};
  // The agents' --kill-timeout: after their grace they may wait this long for a worker's SIGKILL.
  std::chrono::milliseconds kill_timeout{std::chrono::seconds(30)};
  // How long a host's agent may take to say it is ready once its ssh client started: ssh's
  // ConnectTimeout (past it an unreachable host has made ssh exit 255) plus the rendezvous join
  // timeout (past it the other agents give up waiting for this one anyway). A host whose agent
  // is not ready by then (a login script or a stalled file system holds it) fails the launch.
  std::chrono::milliseconds ready_timeout{std::chrono::seconds(10 + 600)};
  // Launch tree: used when hosts.size() > tree_threshold and tree_fanout >= 2 (0 = always flat).
  std::size_t tree_threshold = kDefaultTreeThreshold;
  int tree_fanout = kDefaultTreeFanout;
  // --nnodes of every agent: the whole job's host count (0 = hosts.size()); a tree node's plan
  // holds only its subtree.
  std::size_t nnodes = 0;
  int log_level = 2;  // spdlog level of the launcher, given to tree nodes (2 = info)
};

// The env-block entry that turns a remote ddprun into a tree node (removed before its agent or
// workers see the environment).
inline constexpr std::string_view kTreeEnvName = "DDPRUN_LAUNCH_TREE";

// Cuts the hosts [begin, end) into at most `fanout` contiguous, non-empty runs whose sizes differ
// by at most one (the longer ones first). Pure.
std::vector<std::pair<std::size_t, std::size_t>> split_subtrees(std::size_t begin, std::size_t end, int fanout);

// Whether a launch of plan.hosts uses the tree.
bool uses_tree(const FanoutPlan& plan);

// Levels of ssh hops a launch of `hosts` hosts takes with `fanout` (1 = flat). Pure.
std::size_t tree_depth(std::size_t hosts, int fanout);

// Who starts whom: for every host (by position in the list) the position of the host that
// ssh's to it, or -1 for the launcher itself. Pure; what run_fanout does.
std::vector<long> tree_parents(std::size_t hosts, int fanout);

// What a tree node needs: its subtree's plan (hosts = the hosts below it, in hostfile order),
// its own label, the rendezvous endpoint and run id of the job, and the path of hosts from the
// launcher to it (for messages: "launcher -> h0 -> h3").
struct TreeNodePlan {
  FanoutPlan plan;
  std::string self_label;
  std::string endpoint;
  std::string run_id;
  std::string path;
};

// The kTreeEnvName value (length-prefixed fields, no NUL) and back. decode throws ddprun::Error
// on a malformed value (another ddprun version).
std::string encode_tree_node(const TreeNodePlan& node);
TreeNodePlan decode_tree_node(std::string_view text);

// The ssh client a tree node runs: the launcher's (an absolute path found on the launcher's
// PATH) when it is an executable here too, else the first ssh on this node's `path_var`; the
// launcher's path when neither is, so the error names what was tried.
std::string node_ssh_client(const std::string& launcher_ssh, const std::string& path_var);

// A tree node's whole run: `agent_argv` starts this host's own agent (the remote agent command
// this process was started with; it is executed through /proc/self/exe, so the agent runs the
// same image as this node even if the file at agent_argv[0] was replaced since), `env` is the environment block it read
// (kTreeEnvName removed), control_fd the parent's control channel. Returns the exit code.
int run_tree_node(const TreeNodePlan& node, const std::vector<std::string>& agent_argv,
                  const std::vector<std::pair<std::string, std::string>>& env, int control_fd);
// --remote-cwd as a word of the remote command: quoted for a POSIX shell, except a leading ~ or
// ~user (letters, digits, '.', '_', '-'), left for the host's shell to expand. Pure.
std::string remote_dir_word(const std::string& dir);

// The command line the remote login shell runs for `host` (every word quoted for a POSIX shell).
// Pure; exposed for tests and --dry-run.
std::string remote_command(const FanoutPlan& plan, const FanoutHost& host, const std::string& rdzv_endpoint,
                           const std::string& run_id);

// The longest command a host's shell can be given: ssh passes it as one argument, and sshd hands
// it to the login shell as one, and Linux refuses an exec argument of MAX_ARG_STRLEN bytes (32
// pages of 4 KiB, its NUL included) or more with E2BIG.
inline constexpr std::size_t kMaxRemoteCommand = 32 * 4096 - 1;

// Throws UsageError naming the first host whose remote_command is longer than kMaxRemoteCommand,
// with what makes it long and what to do. Pure; run_fanout calls it before contacting any host.
void check_remote_commands(const FanoutPlan& plan, const std::string& rdzv_endpoint, const std::string& run_id);

// The command that tries a batch-mode login to `host` the way the launcher connects (its ssh
// client and every option it passes: -F, -p, -o), running `true`; for messages. Pure.
std::string ssh_check_command(const FanoutPlan& plan, const FanoutHost& host);

// The remote agent's ready line (agent/remote_protocol.hpp).
using agent::kRemoteAgentReadyLine;

// Runs the whole job; returns the launcher's exit code. Throws ddprun::Error for setup failures
// before any host was contacted (e.g. no address to host the rendezvous on).
int run_fanout(const FanoutPlan& plan);

// Prints what run_fanout would run on every host (the ssh argv and remote command; no values of
// the carried environment, only their names). Starts nothing.
void print_fanout_dry_run(const FanoutPlan& plan, std::ostream& out);

}  // namespace ddprun::launcher
