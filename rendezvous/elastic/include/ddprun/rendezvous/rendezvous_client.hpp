#pragma once
// RendezvousClient: an agent's connection to the elastic rendezvous (ddprun-rdzvd, or a
// rendezvous embedded in another agent), on the agent's io_context.
//
// The client joins a job, sends heartbeats every config.heartbeat_interval for as long as it
// is not stopped (also while the agent stops or restarts workers), and delivers what the
// server PUSHES (assignment, restart, job failed/completed, refusal, progress) to the event
// callbacks. Nothing polls. When the connection drops it reconnects with exponential backoff
// and jitter and re-registers with a rejoin carrying its current assignment, so a restarted
// daemon rebuilds the running round and the workers keep running. If the server stays
// unreachable for longer than options.give_up_after, on_unreachable reports it (naming
// host:port and what was tried) and the client stops.
//
// State: one link state (idle -> connecting -> connected, with retry_wait between attempts,
// leaving while a LEAVE is written, stopped for good) and a registration (none, join wanted,
// registered); the transition table is at the top of rendezvous_client.cpp. Protocol time
// (heartbeats, reconnect backoff, give_up_after) comes from a Timers (timers.hpp): tests pass
// ManualTimers and advance it instead of sleeping.
//
// Not thread-safe: every member and every callback runs on the io_context thread. Callbacks
// may call back into the client (e.g. join() from on_restart).
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ddprun/common/clock.hpp"
#include "ddprun/common/endpoint.hpp"
#include "ddprun/rendezvous/rendezvous_state.hpp"
#include "ddprun/rendezvous/timers.hpp"

namespace boost::asio {
class io_context;
}

namespace ddprun::rendezvous {

struct RendezvousClientOptions {
  Endpoint server;  // host:port of the rendezvous
  // More endpoints of the same rendezvous (relays of one ddprun-rdzvd): after a failed connect
  // or a lost connection the client tries the next one, round-robin, within give_up_after.
  std::vector<Endpoint> alternates;
  std::string run_id = "none";
  // The daemon's shared secret: proves this client in the handshake (never sent itself); "" =
  // none (a daemon with a token then refuses the connection).
  std::string token;
  NodeInfo node;     // who we are (id, advertised addr, nproc, our worker store)
  JobConfig config;  // min/max nodes, restart budget, timeouts, heartbeat
  // Reconnect budget: how long the server may stay unreachable (first connect included)
  // before on_unreachable fires.
  Duration give_up_after = std::chrono::seconds(60);
};

struct RendezvousEvents {
  std::function<void(const Assignment&)> on_assignment;
  std::function<void(const SendRestart&)> on_restart;            // stop workers, then join() again
  std::function<void(const SendJobFailed&)> on_job_failed;       // stop workers, exit with exit_code
  std::function<void()> on_job_completed;                        // exit barrier passed: exit 0
  std::function<void(const std::string& reason)> on_refused;     // fatal (token, config, full…)
  std::function<void(const std::string& text)> on_progress;      // "waiting for nodes: 2/3 …"
  std::function<void(const std::string& error)> on_unreachable;  // gave up reconnecting
};

class RendezvousClient {
 public:
  RendezvousClient(boost::asio::io_context& io, RendezvousClientOptions options, RendezvousEvents events,
                   Timers& timers = Timers::steady());
  ~RendezvousClient();
  RendezvousClient(const RendezvousClient&) = delete;
  RendezvousClient& operator=(const RendezvousClient&) = delete;

  // Connects if needed and joins the collecting round. Forgets the current assignment.
  void join();
  // Replaces NodeInfo::nccl_ids for the next join/rejoin (the IDs of this node's NCCL holder
  // for the round it joins; empty once they are not needed).
  void set_nccl_ids(std::vector<std::uint8_t> ids);
  // This node's workers: a failure (the server decides restart vs job failure) ...
  void report_failure(const WorkerFailure& failure);
  // ... or all of them exited 0 in `round` (the exit barrier).
  void report_success(std::uint64_t round);
  // Leaves the job (e.g. on a handled signal) and stops.
  void leave();
  // Stops heartbeats and reconnects and closes the connection. Idempotent.
  void stop();

  const std::optional<Assignment>& current_assignment() const;
  bool connected() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// `ddprun status`: one synchronous exchange with a rendezvous server (HELLO, AUTH with `token`
// when the server asks for it, STATUS). `run_id` empty = all jobs (authenticates for "*").
// Throws NetworkError naming host:port when it cannot be reached within `timeout`, when the
// server refuses, or when it wants a token and `token` is empty.
RegistryStatus query_status(const Endpoint& server, const std::string& run_id, std::chrono::milliseconds timeout,
                            const std::string& token = {});

}  // namespace ddprun::rendezvous
