#pragma once
// The rendezvous-backend seam: how the agent learns each round's place in the job and tells
// the job what its workers did. The agent (agent.cpp) only ever asks "next round / report
// failure / report success / leave" and obeys the events; which backend serves it is decided
// once, from the job mode (config.hpp JobMode), by make_rendezvous_backend():
//
//   single_node         SingleNodeBackend   this node is the job: each round is local, restarts
//                                           come from the local budget (--max-restarts)
//   elastic (c10d)      ClientBackend over  a RendezvousClient against a ddprun-rdzvd, or an
//   static_multi_node   the c10d transport  embedded rendezvous host this agent starts itself
//   elastic (etcd)      ClientBackend over  an EtcdRendezvous: the decision log replicated
//                       the etcd transport  through etcd, nothing hosted but the worker store
//
// (agent/src/rendezvous_transport.hpp). The factory is the only code that reads the backend's
// name.
// Every backend also hosts this node's worker store (MASTER_ADDR/PORT when this node gets group
// rank 0) and resets it before each later round.
//
// Events are delivered on the io_context thread, never from inside a call the agent makes (a
// backend that decides at once posts its answer). The backend reports to the user what only it
// knows (the job-failed summary, a refusal's reason), then raises the event.
#include <cstdint>
#include <functional>
#include <optional>
#include <memory>
#include <string>
#include <vector>

#include <boost/asio/io_context.hpp>

#include "ddprun/agent/config.hpp"
#include "ddprun/agent/failure.hpp"
#include "ddprun/rendezvous/store_server.hpp"
#include "ddprun/worker_env/worker_env.hpp"

namespace ddprun::agent {

// One round for this node.
struct RoundAssignment {
  std::uint64_t round = 0;
  worker_env::Placement placement;
  std::vector<std::uint8_t> nccl_id;  // the NCCL offer chosen for the round (nccl_ids.hpp)
  std::string dir_name;               // the round's directory under the job's log directory
  std::string summary;                // logged when the round's workers start ("" = nothing)
};

struct BackendEvents {
  std::function<void(const RoundAssignment&)> on_assignment;
  std::function<void()> on_restart;                                // every node restarts: stop, then next_round
  std::function<void(int exit_code)> on_job_failed;                // stop the workers, exit with this code
  std::function<void()> on_job_completed;                          // every node succeeded: exit 0
  std::function<void(const std::string& message)> on_refused;      // stop, exit 1
  std::function<void(const std::string& text)> on_progress;        // a status line while waiting
  std::function<void(const std::string& message)> on_unreachable;  // stop, exit 1
  // A worker of another node failed and this node's own workers did not: called before the
  // restart or the job failure that follows (its summary included), with the failure described.
  std::function<void(const std::string& failure)> on_remote_failure;
};

class RendezvousBackend {
 public:
  virtual ~RendezvousBackend() = default;

  // Hosts the worker store (and, when this node may and must, the rendezvous itself). Throws
  // ddprun::Error (NetworkError, UsageError) when that cannot be done.
  virtual void start() = 0;
  // The address this node's NCCL_COMM_ID root would listen on (--nccl-id comm-id).
  virtual std::string comm_id_host() const = 0;
  // This node's NCCL offer for the next round(s) (empty = none).
  virtual void set_nccl_offer(std::vector<std::uint8_t> offer) = 0;
  // Asks for the next round (the first one, or the one after a restart): on_assignment follows.
  virtual void next_round() = 0;
  // The round's first local failure, as soon as it is seen: its diagnosis follows
  // (print_diagnosis) once the survivors' stacks are taken.
  virtual void report_failure(std::uint64_t round, const FailureReport& failure) = 0;
  // The diagnosis of the failure just reported (stacks, culprit): shown now, or kept for the
  // summary.
  virtual void print_diagnosis(const std::string& block) { update_diagnosis(block); }
  // All local workers of `round` exited 0 (the exit barrier): on_job_completed (or a restart) follows.
  virtual void report_success(std::uint64_t round) = 0;
  // The local workers stopped after that failure and no verdict came yet: on_restart or
  // on_job_failed follows. `exit_code` is the group's (the failure's) code; `others` are the
  // attempt's other local ranks that failed on their own (WorkerRun::other_failures), which a
  // failure summary lists after the root cause.
  virtual void await_verdict(int exit_code, std::vector<FailureReport> others) = 0;
  // The round's diagnosis block as it stands once the local workers have stopped (a rank that
  // ended on its own after the first failure gets its line amended); called before
  // await_verdict. A backend that printed the block at report_failure keeps what it printed.
  virtual void update_diagnosis(const std::string& /*block*/) {}
  // The failure the job ended with, when its root-cause rank ran on this node (its error file
  // loaded): what the launcher's own TORCHELASTIC_ERROR_FILE gets (write_launcher_error_file).
  virtual std::optional<FailureReport> local_root_cause() const { return std::nullopt; }
  // Why the job failed when no worker's failure caused it (a rendezvous that timed out, say).
  virtual std::string job_failure_reason() const { return {}; }
  // This node stops and exits with `exit_code`; `why` completes "workers stopped ...": "after a
  // signal", or the agent's own reason to give up (an unhealthy worker group).
  virtual void leave(int exit_code, const std::string& why) = 0;
  // The agent is done: stop serving, then call `stopped` (at once, or once peers had their
  // chance to hear the result). No events after this.
  virtual void stop(std::function<void()> stopped) = 0;
};

// The address a server for `addr` binds: `addr` itself when numeric (brackets dropped), else
// "::", every interface of both families (a name like "localhost" may resolve to several
// addresses, IPv6 among them).
std::string bind_host(const std::string& addr);

// This node's worker store, bound to bind_host(addr)
// at `port` (0 = any free port). Throws NetworkError with `hint` when it cannot bind (naming the
// port when `name_port`).
std::unique_ptr<rendezvous::StoreServer> host_worker_store(boost::asio::io_context& io, const std::string& addr,
                                                           std::uint16_t port, bool name_port, const std::string& hint);

// This node's side of the workers' store at MASTER_ADDR:MASTER_PORT. Hosted: the agent's own
// store server (TORCHELASTIC_USE_AGENT_STORE=True). Reserved (AgentConfig::share_worker_store
// false): rank 0 of the workers hosts the store, and the agent only keeps its port: a socket
// bound with SO_REUSEADDR that never listens, so that neither another program's bind nor an
// outgoing connection's ephemeral port takes it, while the rank-0 worker's TCPStore server,
// which binds with SO_REUSEADDR too, can. The port is the same for every round of the agent.
class WorkerStore {
 public:
  explicit WorkerStore(std::unique_ptr<rendezvous::StoreServer> server);
  // Takes `reserved_fd`, a bound socket that is not listening.
  WorkerStore(int reserved_fd, std::uint16_t port);
  ~WorkerStore();
  WorkerStore(const WorkerStore&) = delete;
  WorkerStore& operator=(const WorkerStore&) = delete;

  std::uint16_t port() const { return port_; }
  bool hosted() const { return server_ != nullptr; }
  // A fresh, empty key space for the next round: the hosted store is reset; a reserved port needs
  // nothing (the next rank-0 worker starts a new server).
  void reset();
  // Ends the hosted server, or gives the reserved port back.
  void stop();

 private:
  std::unique_ptr<rendezvous::StoreServer> server_;
  int reserved_fd_ = -1;
  std::uint16_t port_ = 0;
};

// host_worker_store when `hosted`, else a port reserved the same way (bind_host(addr), `port`,
// the same errors and hints).
std::unique_ptr<WorkerStore> open_worker_store(boost::asio::io_context& io, const std::string& addr, std::uint16_t port,
                                               bool hosted, bool name_port, const std::string& hint);

// The backend for job_mode(config). `config` must outlive it.
std::unique_ptr<RendezvousBackend> make_rendezvous_backend(boost::asio::io_context& io, const AgentConfig& config,
                                                           BackendEvents events);

}  // namespace ddprun::agent
