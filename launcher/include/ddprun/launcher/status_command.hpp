#pragma once
// `ddprun status --rdzv-endpoint HOST[:PORT] [--rdzv-id ID] [--timeout SECONDS]`: asks a
// rendezvous server (ddprun-rdzvd, or an agent hosting an embedded rendezvous) for its jobs and
// prints them as a table: per job its state, round, node range, restarts, timers and progress
// line, then one row per member (role, group rank, address, workers, heartbeat age, lease).
//
// parse_status_args and format_status are pure (tests drive them directly); run_status does one
// synchronous round trip (rendezvous::query_status). Thread-compatible; no global state.
#include <chrono>
#include <iosfwd>
#include <map>
#include <string>
#include <vector>

#include "ddprun/common/endpoint.hpp"
#include "ddprun/rendezvous/rendezvous_state.hpp"

namespace ddprun::launcher {

struct StatusRequest {
  Endpoint server;
  std::string run_id;  // "" = every job
  std::chrono::milliseconds timeout{std::chrono::seconds(5)};
  std::string token;  // from --token-file or DDPRUN_RDZV_TOKEN; "" = none (never printed)
  bool help = false;
};

// `args` are the words after "status". The endpoint may also come from PET_RDZV_ENDPOINT and the
// id from PET_RDZV_ID (flags win), the token from --token-file FILE or DDPRUN_RDZV_TOKEN.
// Throws UsageError naming the flag.
StatusRequest parse_status_args(const std::vector<std::string>& args, const std::map<std::string, std::string>& env);

std::string status_usage();

// The human-readable table. `endpoint` is named in the header line.
std::string format_status(const rendezvous::RegistryStatus& status, const std::string& endpoint,
                          const std::string& run_id);

// Queries and prints; returns the exit code (0, or 1 when a named job does not exist).
// Throws ddprun::NetworkError when the server cannot be reached.
int run_status(const StatusRequest& request, std::ostream& out);

}  // namespace ddprun::launcher
