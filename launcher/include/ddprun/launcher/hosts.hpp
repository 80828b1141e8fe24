#pragma once
// Host lists for the SSH fan-out launcher: --hostfile, --hosts, and DeepSpeed's --include /
// --exclude / --num-nodes / --num-gpus selection. Pure functions of their arguments (only
// load_hostfile reads a file); thread safe. Every error is a ddprun::UsageError naming the flag
// or file:line and the accepted forms.
//
// Accepted host syntax (hostfile lines and --hosts items):
//   host                      slots unknown (the host gets --nproc-per-node processes)
//   host slots=N              DeepSpeed / OpenMPI hostfile; other KEY=VALUE words such as
//                             max_slots=N are ignored (a note is returned)
//   host:N                    MPICH / Intel MPI style
//   user@host ...             ssh login name
//   [v6addr] / [v6addr]:N     IPv6 literal; a bare v6 literal (2+ colons) has no slot count
// Host and user names may only contain [A-Za-z0-9._-] (plus ':' / '[]' for IPv6 literals) and
// may not start with '-': they end up as an ssh argument, where "-oProxyCommand=..." would be an
// option. A host listed twice is an error (hosts are identified by name, not user@name).
//
// Selection (select_hosts) follows DeepSpeed's runner (parse_resource_filter and main() in
// deepspeed/launcher/runner.py):
//   --include S   keep only the named hosts; NAME:i,j keeps only those slots (in the order
//                 given, duplicates dropped). Hosts keep the hostfile order.
//   --exclude S   drop the named hosts; NAME:i,j drops those slots of NAME (a host left with
//                 no slots is dropped).
//   S = NODE_SPEC[@NODE_SPEC...], NODE_SPEC = NAME[:SLOT[,SLOT...]]
//   --num-nodes N keep the first N hosts; --num-gpus N keep the first N slots of each host.
// Errors (DeepSpeed raises for all of the first four): include and exclude both given; a name
// not in the host list; a slot index >= the host's slot count; --num-nodes/--num-gpus together
// with --include/--exclude. ddprun additionally rejects (DeepSpeed silently accepts):
// --num-nodes larger than the number of hosts, --num-gpus larger than a host's known slot
// count, and a selection that leaves no host.
// A name listed twice in one S is merged (union of slots; a bare name means the whole host);
// DeepSpeed keeps only the last spec for --include.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ddprun::launcher {

struct HostEntry {
  std::string user;  // ssh login name, empty if none given
  std::string host;
  int slots = -1;  // -1: not given
  // The slots (device indices) this host runs on, set when --include/--exclude named slot
  // indices or --num-gpus applied; nullopt: all `slots` (or --nproc-per-node) devices.
  std::optional<std::vector<int>> slot_indices;

  // "user@host" or "host": the ssh destination.
  std::string destination() const { return user.empty() ? host : user + "@" + host; }
  bool operator==(const HostEntry&) const = default;
};

// Hostfile text -> entries in file order. `file_name` is used in messages ("hosts.txt:3: ...").
// Notes about ignored keys (max_slots=...) are appended to `notes` when it is not null.
// An empty result is not an error here (load_hostfile rejects it).
std::vector<HostEntry> parse_hostfile_text(std::string_view text, std::string_view file_name,
                                           std::vector<std::string>* notes = nullptr);

// Reads and parses `path`; throws when it cannot be read or lists no host.
std::vector<HostEntry> load_hostfile(const std::string& path, std::vector<std::string>* notes = nullptr);

// The text of the file a flag names ("--hostfile", "--env-file"): a regular file or a pipe of at
// most `max_bytes`, not a directory or a device that reads without end. `kind` says what it
// should be ("a host list"), `hint` how to give one; errors name the flag and the path.
std::string read_flag_file(std::string_view flag, const std::string& path, std::uintmax_t max_bytes,
                           std::string_view kind, std::string_view hint);

// --hosts "h1,h2:4,user@h3" (items trimmed; empty items, duplicates and "slots=" are errors).
std::vector<HostEntry> parse_hosts_list(std::string_view text, std::string_view what);

// DeepSpeed's include/exclude string -> host -> slot indices (nullopt: the whole host).
// `what` names the flag ("--include").
std::map<std::string, std::optional<std::vector<int>>> parse_include_exclude(std::string_view text,
                                                                             std::string_view what);

// Applies --include / --exclude (texts, "" = not given), --num-nodes and --num-gpus (nullopt =
// not given; must be > 0) to `entries`. `default_slots` (the explicit --nproc-per-node, if any)
// stands in for the slot count of hosts that have none when checking or removing slot indices;
// a host with neither cannot have slot indices excluded or range-checked (error).
std::vector<HostEntry> select_hosts(const std::vector<HostEntry>& entries, std::string_view include,
                                    std::string_view exclude, std::optional<int> num_nodes, std::optional<int> num_gpus,
                                    std::optional<int> default_slots);

// Processes per host, in `hosts` order:
//   1. slot_indices set  -> its size (the devices selected by include/exclude/--num-gpus);
//   2. nproc_per_node    -> that value (an explicit flag beats the hostfile's slots=);
//   3. slots given       -> slots;
//   4. otherwise         -> 1 (torchrun's default --nproc-per-node).
// Hosts may end up with different counts: ddprun's rendezvous supports a different local world
// size per node, so differing slots= are not an error.
std::vector<int> resolve_nproc(const std::vector<HostEntry>& hosts, std::optional<int> nproc_per_node);

}  // namespace ddprun::launcher
