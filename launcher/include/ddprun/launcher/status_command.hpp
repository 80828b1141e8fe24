#pragma once
// `ddprun status --rdzv-endpoint HOST[:PORT] [--rdzv-id ID] [--timeout SECONDS] [--json]
// [--watch [SECONDS] [--watch-count N]]`: asks a rendezvous server (ddprun-rdzvd, or an agent
// hosting an embedded rendezvous) for its jobs, or with `--rdzv-backend etcd [--rdzv-conf K=V,...]`
// reads them from etcd (the job logs replayed by rendezvous::query_etcd_status), and prints them
// as a table: per job its state, round, node range, restarts, timers and progress line, then one
// row per member (role, group rank, address, workers, heartbeat age, lease). --json prints the
// same data as one JSON object per line (field names in docs/cli.md, stable); --watch repeats the
// query every SECONDS and redraws in place on a terminal, or prints one block (one JSON line) per
// update when piped.
//
// The flags are a FlagSpec table (status_flags()), which the parser, status_usage() and the
// generated man page and completions read. parse_status_args, format_status and
// format_status_json are pure (tests drive them directly); run_status does the round trips
// (rendezvous::query_status). Thread-compatible; no global state.
#include <chrono>
#include <iosfwd>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ddprun/agent/config.hpp"
#include "ddprun/common/endpoint.hpp"
#include "ddprun/common/flag_spec.hpp"
#include "ddprun/rendezvous/rendezvous_state.hpp"

namespace ddprun::launcher {

struct StatusRequest {
  Endpoint server;
  std::vector<Endpoint> alternates;  // c10d: more relays of the same daemon, asked when `server` fails
  std::string run_id;                // "" = every job
  // --rdzv-backend etcd: the etcd connection (server unused); password_file is read by run_status.
  std::optional<agent::EtcdSettings> etcd;
  std::string etcd_password_file;
  std::string etcd_conf_what = "--rdzv-conf";
  std::chrono::milliseconds timeout{std::chrono::seconds(5)};
  std::string token;  // from --token-file or DDPRUN_RDZV_TOKEN; "" = none (never printed)
  bool help = false;
  bool json = false;
  std::optional<std::chrono::milliseconds> watch;  // --watch: the interval between updates
  int watch_count = 0;                             // --watch-count: stop after N updates; 0 = never
};

// The flags of `ddprun status`, in --help order (`-h/--help` is not a row).
std::span<const FlagSpec> status_flags();

// `args` are the words after "status". The endpoint may also come from PET_RDZV_ENDPOINT and the
// id from PET_RDZV_ID (flags win), the token from --token-file FILE or DDPRUN_RDZV_TOKEN (--token
// itself is refused). Both spellings of every flag and --flag=VALUE are accepted; --watch takes the
// next word as its interval only when that word is a number. Throws UsageError naming the flag.
StatusRequest parse_status_args(const std::vector<std::string>& args, const std::map<std::string, std::string>& env);

std::string status_usage();

// The human-readable table. `endpoint` is named in the header line.
std::string format_status(const rendezvous::RegistryStatus& status, const std::string& endpoint,
                          const std::string& run_id);

// The registry status as one line of JSON (no newline): {"endpoint", "run_id", "time", "jobs":
// [...]}; field names are documented in docs/cli.md and do not change. `time` is the caller's
// ISO 8601 UTC timestamp of the query ("" leaves it out).
std::string format_status_json(const rendezvous::RegistryStatus& status, const std::string& endpoint,
                               const std::string& run_id, const std::string& time);

// Queries and prints; returns the exit code (0, or 1 when a named job does not exist).
// Without --watch: throws ddprun::NetworkError when the server cannot be reached.
// With --watch: repeats until SIGINT/SIGTERM (exit 0) or --watch-count updates (the last
// update's code); an unreachable server is shown as that update's text, and watching goes on.
// `terminal`: stdout is a terminal, so each update redraws the screen (ANSI home + clear)
// instead of appending a block. SIGINT and SIGTERM are blocked while watching.
int run_status(const StatusRequest& request, std::ostream& out, bool terminal = false);

}  // namespace ddprun::launcher
