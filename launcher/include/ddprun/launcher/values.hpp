#pragma once
// Parsers for the values of ddprun's command-line flags (torchrun's syntax for each). Pure
// functions of their arguments: no environment, no filesystem, no processes. Each throws
// ddprun::UsageError whose message names `what` (the flag, e.g. "--nnodes", or the PET_*
// variable the value came from) and whose hint lists the accepted forms.
#include <spdlog/common.h>

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "ddprun/agent/config.hpp"
#include "ddprun/worker_env/gpus.hpp"

namespace ddprun::launcher {

struct NodeRange {
  int min_nodes = 1;
  int max_nodes = 1;
  bool operator==(const NodeRange&) const = default;
};

// "N" or "MIN:MAX" with 0 < MIN <= MAX.
NodeRange parse_nnodes(std::string_view text, std::string_view what);

// --nproc-per-node: a positive integer, "cpu" (online CPUs), "gpu" (the devices a worker would
// see: CUDA_VISIBLE_DEVICES checked against `inventory`, or the inventory itself when unset; no
// GPU is an error) or "auto" (the GPU count when there is a GPU, else the CPU count). The
// inventory comes from worker_env::probe_gpus (the caller probes; this stays pure).
int parse_nproc_per_node(std::string_view text, std::string_view what,
                         const std::optional<std::string>& cuda_visible_devices, int online_cpus,
                         const worker_env::GpuInventory& inventory = {});

// The --nproc-per-node keywords counted on the node that runs the workers: gpu, cpu, auto
// (`lowered` already lowercased and trimmed).
bool is_device_kind(std::string_view lowered);

// --nccl-id: auto | env | comm-id | off.
agent::AgentConfig::NcclIdMode parse_nccl_id_mode(std::string_view text, std::string_view what);

// -r/--redirects and -t/--tee: "0".."3" for all local ranks, or "LOCAL_RANK:0..3,..." per rank.
struct StreamSpec {
  agent::Streams all = agent::Streams::none;
  std::map<int, agent::Streams> per_rank;
  bool operator==(const StreamSpec&) const = default;
};
StreamSpec parse_streams(std::string_view text, std::string_view what);

// --rdzv-conf: "k1=v1,k2=v2"; "" -> empty. Keys and values are trimmed and must be non-empty;
// one pair of literal quotes around the whole text, a key or a value is dropped
// ('join_timeout=5,last_call_timeout=1' as typed with doubled shell quoting).
std::map<std::string, std::string> parse_rdzv_conf(std::string_view text, std::string_view what);

// --rdzv-conf keys that only the etcd backend reads (parse_rdzv_settings skips them; the
// launcher refuses them with another backend): protocol, cacert, cert, key, etcd_prefix,
// username, password, password_file; and torch's etcd-v2 names of the TLS files, ca_cert,
// ssl_cert and ssl_cert_key (etcd_conf_key_name).
bool is_etcd_conf_key(std::string_view key);

// The name parse_etcd_conf reads an etcd key under: cacert for ca_cert, cert for ssl_cert, key
// for ssl_cert_key (torch's etcd-v2 backend spells them so), any other key as it is.
std::string_view etcd_conf_key_name(std::string_view key);

// --rdzv-backend etcd: the endpoints ("h1:2379,h2:2379", http:// or https:// allowed, port 2379
// by default) and the etcd keys of `conf`. protocol=http|https (must agree with a scheme given
// in the endpoints); etcd_prefix gets a trailing '/'; username needs a password: password=,
// password_file= (read by the caller into settings.password; `password_file` is returned) or
// `env_password` (DDPRUN_ETCD_PASSWORD), at most one of the keys; cert needs key. Throws
// UsageError naming the flag and key.
struct EtcdConf {
  agent::EtcdSettings settings;
  std::string password_file;  // "" = none; the caller reads it
};
EtcdConf parse_etcd_conf(std::string_view endpoints, std::string_view endpoints_what,
                         const std::map<std::string, std::string>& conf, std::string_view what,
                         const std::optional<std::string>& env_password);

// --rdzv-conf keys -> typed settings: join_timeout, last_call_timeout, close_timeout,
// read_timeout, heartbeat_interval, exit_barrier_timeout (seconds, > 0, floats ok),
// missed_heartbeats (1..1000), is_host (torch's booleans), token; torchrun's keep_alive_interval
// and keep_alive_max_attempt name heartbeat_interval and missed_heartbeats; `timeout` sets the
// join timeout unless join_timeout is given (then it is ignored, as torchrun's c10d backend
// does). `env_token` (DDPRUN_RDZV_TOKEN) is used when no token key is given. As torchrun, an
// unknown key does not stop the job: it, use_libuv and store_type=tcp add a one-line
// "ignored: ..." to `notes` (when not null). A bad value of a known key throws UsageError naming
// `what` and the key. The etcd-only keys (is_etcd_conf_key) are left to parse_etcd_conf.
// Whether parse_rdzv_settings reads `key` (the keys above, torch's spellings included); the
// others it reports as ignored.
bool is_rdzv_setting_key(std::string_view key);
agent::RendezvousSettings parse_rdzv_settings(const std::map<std::string, std::string>& conf, std::string_view what,
                                              const std::optional<std::string>& env_token,
                                              std::vector<std::string>* notes = nullptr);

// --local-ranks-filter: comma list of non-negative local ranks; "" -> nullopt (all ranks).
std::optional<std::set<int>> parse_local_ranks_filter(std::string_view text, std::string_view what);
// --ranks-filter: comma list of global ranks and inclusive ranges ("0,3-5"); "" -> nullopt (all).
std::optional<std::set<int>> parse_ranks_filter(std::string_view text, std::string_view what);

// --signals-to-handle: comma list of names (SIGTERM or TERM, any case) or numbers. Signals
// that cannot be caught (SIGKILL, SIGSTOP) or that the agent itself relies on (SIGCHLD) are
// rejected. Duplicates are dropped, order is kept.
std::vector<int> parse_signals(std::string_view text, std::string_view what);
// "SIGTERM" for 15, "SIGRTMIN+2" for real-time signals, the number otherwise.
std::string signal_name(int signo);
// Names accepted by parse_signals, for messages and --help.
std::string accepted_signal_names();

// Seconds as a non-negative decimal ("30", "0.5").
double parse_seconds_value(std::string_view text, std::string_view what);
// The same, more than 0 (a wait that must let the kernel act: --kill-timeout).
double parse_positive_seconds_value(std::string_view text, std::string_view what);
// A decimal integer in [min, max].
int parse_int_value(std::string_view text, std::string_view what, int min, int max);
// --stacks: on | off.
bool parse_on_off(std::string_view text, std::string_view what);
// --containment: auto | cgroup2 | cgroup1 | proc | off, as given (trimmed).
std::string parse_containment_value(std::string_view text, std::string_view what);
// "1"/"0" style booleans of the PET_* variables: any integer, non-zero = on (torchrun: bool(int(x))).
bool parse_env_bool(std::string_view text, std::string_view what);

// --rdzv-backend: static | c10d | etcd (any case), lowercased; torchrun's etcd-v2 is read as etcd.
std::string parse_rdzv_backend(std::string_view text, std::string_view what);
// --start-method: spawn | fork | forkserver (accepted, no effect).
void check_start_method(std::string_view text, std::string_view what);
// --local-rank-arg: dash | underscore | none.
agent::AgentConfig::LocalRankArg parse_local_rank_arg(std::string_view text, std::string_view what);
// --log-level: trace, debug, info, warning (warn), error, critical (fatal), off.
spdlog::level::level_enum parse_log_level_value(std::string_view text, std::string_view what);
// --max-restarts: 0..1000000.
int parse_max_restarts(std::string_view text, std::string_view what);
// --nccl-roots: 1..4096.
int parse_nccl_roots(std::string_view text, std::string_view what);
// A host name or address (--master-addr, --local-addr, --launcher-addr): trimmed, IPv6 brackets
// removed ("[::1]" -> "::1"); empty or containing blanks or brackets is an error.
std::string parse_host(std::string_view text, std::string_view what);
// An IPv4 or IPv6 address literal to listen on (--metrics-host): trimmed, IPv6 brackets removed.
// A host name is an error (a listener binds one address, not what a name resolves to).
std::string parse_ip_address(std::string_view text, std::string_view what);
// A TCP port in [min_port, 65535].
std::uint16_t parse_port_value(std::string_view text, std::string_view what, int min_port);
// The trimmed text; empty is an error whose hint is `hint` (--role, --rdzv-id, --log-dir, --gpus).
std::string parse_non_empty(std::string_view text, std::string_view what, std::string_view hint);

// --gpus as any node can check it without its devices (worker_env::check_gpus_list): the
// trimmed list; empty names `what`. Each node checks the entries against its devices later.
std::string parse_gpus_value(std::string_view text, std::string_view what);

// A random version-4 UUID in the canonical 8-4-4-4-12 lowercase hex form (--standalone run id).
std::string random_uuid4();

// The etcd password from --rdzv-conf password_file=FILE (an absolute path, or relative to the
// current directory): its first line, at most 4 KiB. Throws UsageError naming `what` and the file.
std::string read_password_file(const std::string& file, const std::string& what);

// --event-log-handler: null | dynamic_rendezvous (both: nowhere, as torchrun) | console | file:PATH.
// Returns "null", "console" or "file:PATH"; anything else throws UsageError naming `what`.
std::string parse_event_log_handler(std::string_view text, std::string_view what);

// --duplicate-stdout-filters / --duplicate-stderr-filters: torchrun's comma list, ',,' for a
// literal comma, empty items dropped.
std::vector<std::string> parse_duplicate_filters(std::string_view text);

}  // namespace ddprun::launcher
