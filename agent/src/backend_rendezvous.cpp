// The multi-node rendezvous backends (c10d, static and etcd): ClientBackend runs every round
// through a RendezvousTransport (rendezvous_transport.hpp). This file holds ClientBackend and the
// c10d transport: a RendezvousClient against a ddprun-rdzvd, or against an embedded rendezvous
// this agent hosts itself. Static jobs (torchrun's static backend) are the same with node rank 0
// hosting at --master-addr:--master-port, a fixed world and the group rank from --node-rank.
// Heartbeats and reconnects are the client's job.
#include <unistd.h>

#include <map>

#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <spdlog/spdlog.h>

#include "ddprun/common/console.hpp"
#include "ddprun/agent/elastic.hpp"
#include "ddprun/agent/entrypoint.hpp"
#include "ddprun/agent/output.hpp"
#include "ddprun/agent/rendezvous_backend.hpp"
#include "ddprun/common/error.hpp"
#include "ddprun/rendezvous/rendezvous_client.hpp"
#include "ddprun/rendezvous/rendezvous_server.hpp"
#include "rendezvous_transport.hpp"

namespace asio = boost::asio;

namespace ddprun::agent {

std::unique_ptr<RendezvousBackend> make_single_node_backend(asio::io_context& io, const AgentConfig& config,
                                                            BackendEvents events);

namespace {

// How long to wait for an answer before deciding that nobody serves the endpoint yet.
constexpr std::chrono::milliseconds kProbeTimeout{500};
// An agent that hosts the rendezvous keeps serving for a moment after its own result so the
// pushes to the other agents are written and they can disconnect. The store server reports when
// its last connection closed (on_drained); kHostLinger bounds the wait for peers that do not
// disconnect.
constexpr std::chrono::milliseconds kHostLinger{3000};

// c10d and static: a RendezvousClient; hosts an embedded rendezvous when this node may and must.
class C10dTransport final : public ClientTransport<rendezvous::RendezvousClient> {
 public:
  C10dTransport(asio::io_context& io, const AgentConfig& config)
      : io_(io),
        config_(config),
        endpoints_(rendezvous_endpoints(config)),
        endpoint_(endpoints_.front()),
        linger_timer_(io) {}

  std::vector<Endpoint> peers() const override { return {endpoint_}; }

  void leave(const std::string& why) override {
    if (host_server_ && !host_stopped_) {
      // This agent hosts the rendezvous and stops (a signal): the others cannot go on without it;
      // tell them now rather than start a round it would leave within seconds.
      host_server_->abort_jobs("the agent hosting the rendezvous at " + endpoint_.to_string() + " stopped " + why +
                                   "; the job cannot go on without it (use ddprun-rdzvd for jobs that must survive "
                                   "the loss of any node)",
                               1);
    }
    ClientTransport::leave(why);
  }
  std::string where() const override {
    return endpoints_.size() > 1 ? endpoint_list_text(endpoints_) : endpoint_.to_string();
  }

  void start(const std::string& advertised) override {
    if (endpoints_.size() > 1) return;  // relays of a daemon elsewhere: never hosted here
    if (job_mode(config_) == JobMode::static_multi_node) {
      if (may_host(config_, endpoint_, advertised)) host_embedded();
    } else if (endpoint_.port == 0) {
      host_on_free_port(advertised);
    } else if (may_host(config_, endpoint_, advertised) && !tcp_connects(endpoint_, kProbeTimeout)) {
      host_embedded();
    }
  }

  void stop(std::function<void()> stopped) override {
    stop_client();
    if (!host_server_) {
      stopped();
      return;
    }
    on_host_stopped_ = std::move(stopped);
    linger_timer_.expires_after(kHostLinger);
    linger_timer_.async_wait([this](const boost::system::error_code& ec) {
      if (ec) return;  // cancelled: the peers are gone
      spdlog::debug("rendezvous peers still connected {} ms after the job ended; stopping anyway", kHostLinger.count());
      stop_host();
    });
    host_server_->on_drained([this] {
      linger_timer_.cancel();
      stop_host();
    });
  }

 protected:
  std::unique_ptr<rendezvous::RendezvousClient> make_client(ClientParams p) override {
    rendezvous::RendezvousClientOptions opts;
    opts.server = endpoint_;
    opts.alternates.assign(endpoints_.begin() + 1, endpoints_.end());
    opts.run_id = config_.run_id;
    opts.token = config_.rdzv.token;
    opts.node = std::move(p.node);
    opts.config = p.config;
    opts.give_up_after = p.give_up_after;
    return std::make_unique<rendezvous::RendezvousClient>(io_, std::move(opts), std::move(p.events));
  }

 private:
  // The embedded rendezvous host: a rendezvous service on a store server at the endpoint.
  void host_embedded() {
    rendezvous::RendezvousServerOptions opts;
    opts.host = bind_host(endpoint_.host);
    opts.port = endpoint_.port;
    opts.token = config_.rdzv.token;
    opts.embedded = true;
    try {
      host_server_ = std::make_unique<rendezvous::RendezvousServer>(io_, opts);
    } catch (const Error& e) {
      // Another agent on this machine may have just bound it: join that one.
      spdlog::info("not hosting the rendezvous at {} ({}); joining it as a client", endpoint_.to_string(), e.message());
      return;
    }
    host_server_->start();
    spdlog::info(
        "no rendezvous server answered at {}: this agent hosts it (it names this machine; where a ddprun-rdzvd "
        "should serve it, pass --rdzv-conf is_host=0 so that an agent started while the daemon restarts waits for "
        "it)",
        endpoint_.to_string());
  }

  // torchrun's recipe for several single-node jobs on one machine, --rdzv-endpoint HOST:0: this
  // agent hosts the rendezvous on a free port of HOST and joins it there (no other node could
  // learn the port; the launcher allows port 0 only with one node).
  void host_on_free_port(const std::string& advertised) {
    if (!may_host(config_, endpoint_, advertised)) {
      throw UsageError("--rdzv-endpoint " + endpoint_.to_string() + ": port 0 means 'host on a free port here', but " +
                           endpoint_.host + " is not an address of this machine",
                       "use an address of this machine (e.g. localhost:0) or a fixed port");
    }
    rendezvous::RendezvousServerOptions opts;
    opts.host = bind_host(endpoint_.host);
    opts.port = 0;
    opts.token = config_.rdzv.token;
    opts.embedded = true;
    host_server_ = std::make_unique<rendezvous::RendezvousServer>(io_, opts);
    host_server_->start();
    endpoint_.port = host_server_->port();
    spdlog::info("--rdzv-endpoint with port 0: this agent hosts the rendezvous at {}", endpoint_.to_string());
  }

  void stop_host() {
    if (host_stopped_) return;
    host_stopped_ = true;
    host_server_->stop();
    if (on_host_stopped_) on_host_stopped_();
  }

  asio::io_context& io_;
  const AgentConfig& config_;
  std::vector<Endpoint> endpoints_;  // --rdzv-endpoint: one, or relays of one daemon
  Endpoint endpoint_;                // the first; port 0 until host_on_free_port() learns the one it bound
  std::unique_ptr<rendezvous::RendezvousServer> host_server_;
  asio::steady_timer linger_timer_;
  std::function<void()> on_host_stopped_;
  bool host_stopped_ = false;
};

class ClientBackend final : public RendezvousBackend {
 public:
  ClientBackend(asio::io_context& io, const AgentConfig& config, BackendEvents events,
                std::unique_ptr<RendezvousTransport> transport)
      : io_(io),
        config_(config),
        events_(std::move(events)),
        static_(job_mode(config) == JobMode::static_multi_node),
        transport_(std::move(transport)) {}

  ~ClientBackend() override { transport_.reset(); }
  ClientBackend(const ClientBackend&) = delete;
  ClientBackend& operator=(const ClientBackend&) = delete;

  void start() override {
    addr_ = advertised_address(config_, transport_->peers());
    node_id_ = rendezvous::NodeId{addr_, static_cast<std::int64_t>(::getpid()), random_instance_id()};
    // This node's worker store: MASTER_ADDR/PORT for every worker when this node gets group rank 0.
    store_ = open_worker_store(io_, addr_, 0, config_.share_worker_store, false,
                               "pass --local-addr with an address of this machine");
    transport_->start(addr_);
  }

  std::string comm_id_host() const override { return addr_; }

  void set_nccl_offer(std::vector<std::uint8_t> offer) override {
    offer_ = std::move(offer);
    transport_->set_nccl_ids(offer_);
  }

  void next_round() override {
    if (!transport_->has_client()) {
      create_client();
      transport_->join();
      return;
    }
    if (deferred_job_failed_) {
      // The job failed while this node's workers were still stopping for a restart (its verdict
      // waited for them): no round follows. Joining would go to a client the failure stopped,
      // and nothing would ever end the agent.
      asio::post(io_, [this, f = std::move(*deferred_job_failed_)] {
        if (!stopped_) job_failed(f);
      });
      deferred_job_failed_.reset();
      return;
    }
    reset_round();
    deferred_job_failed_.reset();
    transport_->join();
  }

  void report_failure(std::uint64_t round, const FailureReport& f) override {
    // This node's own diagnosis (stacks, culprit): the job summary comes from the rendezvous.
    if (!f.diagnosis.empty()) console::write(STDERR_FILENO, f.diagnosis);
    printed_diagnosis_ = f.diagnosis;
    local_first_ = f;
    load_error_file(*local_first_);
    local_first_->diagnosis.clear();  // printed above
    // A rank without torch's @record wrote no error file: the other nodes' summaries name what it
    // raised, as the stacks hook recorded it, rather than only its exit code.
    std::string message = error_file_message(f.error_file);
    if (message.empty()) message = f.raised;
    transport_->report_failure(make_failure(round, node_id_, f.rank, f.local_rank, f.status, message));
  }

  void report_success(std::uint64_t round) override {
    spdlog::info("all {} local worker(s) succeeded; waiting for the other nodes (exit barrier, at most {} s)",
                 config_.nproc_per_node, std::chrono::duration<double>(config_.rdzv.exit_barrier_timeout).count());
    transport_->report_success(round);
  }

  std::optional<FailureReport> local_root_cause() const override { return root_cause_; }
  std::string job_failure_reason() const override { return failure_reason_; }

  void print_diagnosis(const std::string& block) override {
    if (block.empty() || !printed_diagnosis_.empty()) return;
    console::write(STDERR_FILENO, block);
    printed_diagnosis_ = block;
  }

  void update_diagnosis(const std::string& block) override {
    // Printed at the first failure, before the other local ranks ended: what they did since
    // (failed on their own, ended after the teardown signal they handle) follows it.
    const std::string amendment = format_diagnosis_amendment(printed_diagnosis_, block);
    if (!amendment.empty()) console::write(STDERR_FILENO, amendment);
    if (!amendment.empty()) printed_diagnosis_ = block;
  }

  void await_verdict(int exit_code, std::vector<FailureReport> others) override {
    local_others_ = std::move(others);
    group_done_ = true;
    if (deferred_job_failed_) {
      // Posted: the shell is still inside its group-done handler.
      asio::post(io_, [this, f = std::move(*deferred_job_failed_)] {
        if (!stopped_) job_failed(f);
      });
      deferred_job_failed_.reset();
      return;
    }
    spdlog::info("local workers stopped after a failure (exit {}); waiting for the rendezvous' decision", exit_code);
  }

  void leave(int /*exit_code*/, const std::string& why) override {
    leaving_ = true;  // (the job's end that our own leave may cause is no news here)
    spdlog::warn("workers stopped {}; leaving the rendezvous", why);
    transport_->leave(why);
  }

  void stop(std::function<void()> stopped) override {
    stopped_ = true;
    if (store_) store_->stop();
    transport_->stop(std::move(stopped));
  }

 private:
  void job_failed(const rendezvous::SendJobFailed& f) {
    if (!local_first_ && f.root_cause && f.root_cause->failure.node != node_id_ && events_.on_remote_failure) {
      events_.on_remote_failure(f.root_cause->describe());
    }
    if (root_here(f)) root_cause_ = *local_first_;
    if (!f.root_cause) failure_reason_ = "job '" + f.run_id + "' failed: " + f.reason;
    if (config_.node_label.empty() || !f.root_cause || f.root_cause->failure.node == node_id_) {
      console::write(STDERR_FILENO, format_job_failed(f, entrypoint_name(config_), local_failures(f),
                                                      root_here(f) ? &*local_first_ : nullptr));
    } else {
      // A fan-out launch shows every host's output in one terminal: one summary is enough, the
      // failing worker's node prints it.
      spdlog::error("job '{}' failed: {}", config_.run_id, f.root_cause->describe());
    }
    events_.on_job_failed(f.exit_code);
  }

  // The failed ranks of this node that the job summary lists besides the root cause: this
  // node's first failure unless it is the root cause itself, then the ranks that failed after it.
  bool root_here(const rendezvous::SendJobFailed& f) const {
    return f.root_cause && f.root_cause->failure.node == node_id_ && local_first_ &&
           f.root_cause->failure.global_rank == local_first_->rank;
  }

  std::vector<FailureReport> local_failures(const rendezvous::SendJobFailed& f) const {
    std::vector<FailureReport> out;
    if (local_first_ && !root_here(f)) out.push_back(*local_first_);
    out.insert(out.end(), local_others_.begin(), local_others_.end());
    for (auto& r : out) r.host = addr_;
    return out;
  }

  void create_client() {
    ClientParams p;
    p.node.id = node_id_;
    p.node.addr = addr_;
    p.node.local_world_size = config_.nproc_per_node;
    p.node.store_host = addr_;
    p.node.store_port = store_->port();
    p.node.nccl_ids = offer_;
    p.node.order = config_.node_order;
    // static: the store host (MASTER_ADDR) is the round's first node, which must be node rank 0,
    // where RANK 0 runs (GROUP_RANK is --node-rank), whichever node's join came first.
    if (static_ && !p.node.order) p.node.order = config_.node_rank;
    p.node.nccl_any_rank = true;  // decide_round_nccl keeps the holder whenever its offer is chosen
    p.config = job_config(config_);
    // static: the other nodes may start long before node rank 0 serves (torchrun waits as long).
    p.give_up_after =
        static_ ? std::max(config_.rdzv.read_timeout, config_.rdzv.join_timeout) : config_.rdzv.read_timeout;

    auto& ev = p.events;
    ev.on_assignment = [this](const rendezvous::Assignment& a) {
      if (!stopped_) on_assignment(a);
    };
    ev.on_restart = [this](const rendezvous::SendRestart& r) {
      if (stopped_) return;
      spdlog::warn("round {} ended ({}): {}; all nodes restart together (restarts used {}/{})", r.ended_round,
                   r.kind == rendezvous::RoundEnd::worker_failure ? "worker failure" : "membership change", r.reason,
                   r.restart_count, config_.max_restarts);
      if (r.kind == rendezvous::RoundEnd::worker_failure && !local_first_ && events_.on_remote_failure) {
        events_.on_remote_failure("round " + std::to_string(r.ended_round) + ": " + r.reason);
      }
      events_.on_restart();
    };
    ev.on_job_failed = [this](const rendezvous::SendJobFailed& f) {
      if (stopped_ || leaving_) return;
      if (local_first_ && !group_done_) {
        // This node's workers are still stopping after its own failure: the summary waits for
        // them (await_verdict), so it can list every local rank that failed on its own.
        deferred_job_failed_ = f;
        return;
      }
      job_failed(f);
    };
    ev.on_job_completed = [this] {
      if (stopped_) return;
      spdlog::info("job '{}' completed on every node", config_.run_id);
      events_.on_job_completed();
    };
    ev.on_refused = [this](const std::string& reason) {
      if (!stopped_) events_.on_refused("the rendezvous at " + transport_->where() + " refused this node: " + reason);
    };
    ev.on_progress = [this](const std::string& text) {
      if (!stopped_) events_.on_progress(text);
    };
    ev.on_unreachable = [this](const std::string& error) {
      if (!stopped_) events_.on_unreachable(error);
    };
    spdlog::info("node {} joining rendezvous '{}' at {} ({} worker(s), nnodes {}:{})", addr_, config_.run_id,
                 transport_->where(), config_.nproc_per_node, config_.min_nodes, config_.max_nodes);
    transport_->connect(std::move(p));
  }

  // What a round leaves behind that the next one must not see: the worker store's keys and this
  // node's failures of the round.
  void reset_round() {
    store_->reset();  // a fresh key space for the next round's workers
    local_first_.reset();
    printed_diagnosis_.clear();
    local_others_.clear();
    group_done_ = false;
    assigned_ = false;
  }

  void on_assignment(const rendezvous::Assignment& a) {
    if (assigned_) {
      // A second round without next_round() between: the client rejoined by itself (its
      // connection dropped during the restart's stop, and the daemon, restarted, closed a round)
      // or the node missed a restart. The reset next_round() does before it joins is done now,
      // as early as this node can: other nodes' workers of the new round may connect to this
      // store from now on, and a reset after the old workers are gone would drop their keys.
      // The old workers, still stopping, lose their store connections instead. No round-number
      // check: a restarted daemon numbers rounds from 0 again, and no daemon sends the running
      // round's assignment twice (a rebuild answers with progress).
      spdlog::info("round {} assigned before this node asked for it: resetting the worker store for it", a.round);
      reset_round();
    }
    assigned_ = true;
    if (static_) {
      // torchrun's static backend: the group rank is --node-rank and every node runs nproc workers.
      const int expected = config_.max_nodes * config_.nproc_per_node;
      if (a.world_size != expected || a.group_world_size != config_.max_nodes) {
        console::write(STDERR_FILENO, "ddprun: error: static rendezvous: the nodes disagree on the world size (" +
                                          std::to_string(a.world_size) + " workers on " +
                                          std::to_string(a.group_world_size) + " nodes, this node expects " +
                                          std::to_string(expected) +
                                          "); use the same --nproc-per-node and --nnodes on every node\n");
        events_.on_job_failed(1);
        return;
      }
    }
    RoundAssignment r;
    r.round = a.round;
    r.placement = placement_of(config_, a);
    r.nccl_id = a.nccl_id;
    // torchrun's layout, attempt_<restart count>: a scheduler's glob of attempt_*/*/error.json
    // finds them. A membership change starts a round without a restart (torchrun reuses and wipes
    // the directory then); here it gets attempt_<count>.<k>, and the earlier round's logs stay.
    const int again = rounds_at_count_[a.restart_count]++;
    r.dir_name = "attempt_" + std::to_string(a.restart_count) + (again == 0 ? "" : "." + std::to_string(again));
    const auto& p = r.placement;
    r.summary = "round " + std::to_string(a.round) + ": group rank " + std::to_string(p.group_rank) + " of " +
                std::to_string(a.group_world_size) + " nodes, ranks " + std::to_string(p.rank_offset) + ".." +
                std::to_string(p.rank_offset + a.local_world_size - 1) + " of " + std::to_string(a.world_size) +
                ", master " + a.master_addr + ":" + std::to_string(a.master_port) + ", restart count " +
                std::to_string(a.restart_count) + "/" + std::to_string(a.max_restarts);
    events_.on_assignment(r);
  }

  asio::io_context& io_;
  const AgentConfig& config_;
  BackendEvents events_;
  const bool static_;
  std::unique_ptr<RendezvousTransport> transport_;
  std::string addr_;
  rendezvous::NodeId node_id_;
  std::vector<std::uint8_t> offer_;
  std::unique_ptr<WorkerStore> store_;
  // This round's local failures, for the job summary: the first one (reported to the
  // rendezvous) and the ranks that failed on their own after it (await_verdict).
  std::optional<FailureReport> local_first_;
  std::vector<FailureReport> local_others_;
  std::optional<FailureReport> root_cause_;  // the job's root cause when it failed here (local_root_cause)
  std::string failure_reason_;               // the job's failure when no worker caused it (job_failure_reason)
  std::string printed_diagnosis_;            // this node's block as printed at its first failure, amended since
  std::map<int, int> rounds_at_count_;       // rounds started at each restart count (their directories)
  bool group_done_ = false;                  // this round's local workers have all exited (await_verdict)
  bool assigned_ = false;                    // an assignment came since the last next_round()
  std::optional<rendezvous::SendJobFailed> deferred_job_failed_;
  bool stopped_ = false;
  bool leaving_ = false;  // leave() after a signal: this node is on its way out
};

}  // namespace

std::unique_ptr<RendezvousTransport> make_c10d_transport(asio::io_context& io, const AgentConfig& config) {
  return std::make_unique<C10dTransport>(io, config);
}

std::unique_ptr<RendezvousBackend> make_rendezvous_backend(asio::io_context& io, const AgentConfig& config,
                                                           BackendEvents events) {
  if (job_mode(config) == JobMode::single_node) return make_single_node_backend(io, config, std::move(events));
  // The one place the backend's name matters.
  auto transport = config.rdzv_backend == "etcd" ? make_etcd_transport(io, config) : make_c10d_transport(io, config);
  return std::make_unique<ClientBackend>(io, config, std::move(events), std::move(transport));
}

}  // namespace ddprun::agent
