// The multi-node rendezvous backends (c10d and static): a RendezvousClient against a
// ddprun-rdzvd, or against an embedded rendezvous this agent hosts itself (host_embedded()).
// Static jobs (torchrun's static backend) are the same with node rank 0 hosting at
// --master-addr:--master-port, a fixed world and the group rank from --node-rank.
// Heartbeats and reconnects are the RendezvousClient's job.
#include <unistd.h>

#include <boost/asio/steady_timer.hpp>
#include <spdlog/spdlog.h>

#include "ddprun/agent/elastic.hpp"
#include "ddprun/agent/entrypoint.hpp"
#include "ddprun/agent/output.hpp"
#include "ddprun/agent/rendezvous_backend.hpp"
#include "ddprun/common/error.hpp"
#include "ddprun/rendezvous/rendezvous_client.hpp"
#include "ddprun/rendezvous/rendezvous_server.hpp"

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

class ClientBackend final : public RendezvousBackend {
 public:
  ClientBackend(asio::io_context& io, const AgentConfig& config, BackendEvents events)
      : io_(io),
        config_(config),
        events_(std::move(events)),
        static_(job_mode(config) == JobMode::static_multi_node),
        linger_timer_(io) {}

  ~ClientBackend() override { client_.reset(); }
  ClientBackend(const ClientBackend&) = delete;
  ClientBackend& operator=(const ClientBackend&) = delete;

  void start() override {
    endpoint_ = rendezvous_endpoint(config_);
    addr_ = advertised_address(config_, endpoint_);
    node_id_ = rendezvous::NodeId{addr_, static_cast<std::int64_t>(::getpid()), random_instance_id()};
    // This node's worker store: MASTER_ADDR/PORT for every worker when this node gets group rank 0.
    store_ = host_worker_store(io_, addr_, 0, false, "pass --local-addr with an address of this machine");
    if (static_) {
      if (may_host(config_, endpoint_, addr_)) host_embedded(endpoint_);
    } else if (endpoint_.port == 0) {
      host_on_free_port();
    } else if (may_host(config_, endpoint_, addr_) && !tcp_connects(endpoint_, kProbeTimeout)) {
      host_embedded(endpoint_);
    }
  }

  std::string comm_id_host() const override { return addr_; }

  void set_nccl_offer(std::vector<std::uint8_t> offer) override {
    offer_ = std::move(offer);
    if (client_) client_->set_nccl_ids(offer_);
  }

  void next_round() override {
    if (!client_) {
      create_client();
      client_->join();
      return;
    }
    store_->reset();  // a fresh key space for the next round's workers
    client_->join();
  }

  void report_failure(std::uint64_t round, const FailureReport& f) override {
    client_->report_failure(
        make_failure(round, node_id_, f.rank, f.local_rank, f.status, error_file_message(f.error_file)));
  }

  void report_success(std::uint64_t round) override {
    spdlog::info("all {} local worker(s) succeeded; waiting for the other nodes (exit barrier, at most {} s)",
                 config_.nproc_per_node, std::chrono::duration<double>(config_.rdzv.exit_barrier_timeout).count());
    client_->report_success(round);
  }

  void await_verdict(int exit_code) override {
    spdlog::info("local workers stopped after a failure (exit {}); waiting for the rendezvous' decision", exit_code);
  }

  void leave(int /*exit_code*/) override {
    spdlog::warn("workers stopped after a signal; leaving the rendezvous");
    client_->leave();
  }

  void stop(std::function<void()> stopped) override {
    stopped_ = true;
    if (store_) store_->stop();
    if (client_) client_->stop();
    if (!host_server_) {
      stopped();
      return;
    }
    on_host_stopped_ = std::move(stopped);
    linger_timer_.expires_after(kHostLinger);
    linger_timer_.async_wait([this](const boost::system::error_code& ec) {
      if (ec) return;  // cancelled: the peers are gone
      spdlog::debug("rendezvous peers still connected {} ms after the job ended; stopping anyway",
                    kHostLinger.count());
      stop_host();
    });
    host_server_->on_drained([this] {
      linger_timer_.cancel();
      stop_host();
    });
  }

 private:
  // The embedded rendezvous host: a rendezvous service on a store server at `endpoint`.
  void host_embedded(const Endpoint& endpoint) {
    rendezvous::RendezvousServerOptions opts;
    opts.host = bind_host(endpoint.host);
    opts.port = endpoint.port;
    opts.token = config_.rdzv.token;
    try {
      host_server_ = std::make_unique<rendezvous::RendezvousServer>(io_, opts);
    } catch (const Error& e) {
      // Another agent on this machine may have just bound it: join that one.
      spdlog::info("not hosting the rendezvous at {} ({}); joining it as a client", endpoint.to_string(), e.message());
      return;
    }
    host_server_->start();
    spdlog::info("no rendezvous server answered at {}: this agent hosts it", endpoint.to_string());
  }

  // torchrun's recipe for several single-node jobs on one machine, --rdzv-endpoint HOST:0: this
  // agent hosts the rendezvous on a free port of HOST and joins it there (no other node could
  // learn the port; the launcher allows port 0 only with one node).
  void host_on_free_port() {
    if (!may_host(config_, endpoint_, addr_)) {
      throw UsageError("--rdzv-endpoint " + endpoint_.to_string() + ": port 0 means 'host on a free port here', but " +
                           endpoint_.host + " is not an address of this machine",
                       "use an address of this machine (e.g. localhost:0) or a fixed port");
    }
    rendezvous::RendezvousServerOptions opts;
    opts.host = bind_host(endpoint_.host);
    opts.port = 0;
    opts.token = config_.rdzv.token;
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

  void create_client() {
    rendezvous::RendezvousClientOptions opts;
    opts.server = endpoint_;
    opts.run_id = config_.run_id;
    opts.token = config_.rdzv.token;
    opts.node.id = node_id_;
    opts.node.addr = addr_;
    opts.node.local_world_size = config_.nproc_per_node;
    opts.node.store_host = addr_;
    opts.node.store_port = store_->port();
    opts.node.nccl_ids = offer_;
    if (config_.node_order) opts.node.order = *config_.node_order;
    opts.config = job_config(config_);
    // static: the other nodes may start long before node rank 0 serves (torchrun waits as long).
    opts.give_up_after =
        static_ ? std::max(config_.rdzv.read_timeout, config_.rdzv.join_timeout) : config_.rdzv.read_timeout;

    rendezvous::RendezvousEvents ev;
    ev.on_assignment = [this](const rendezvous::Assignment& a) {
      if (!stopped_) on_assignment(a);
    };
    ev.on_restart = [this](const rendezvous::SendRestart& r) {
      if (stopped_) return;
      spdlog::warn("round {} ended ({}): {}; all nodes restart together (restarts used {}/{})", r.ended_round,
                   r.kind == rendezvous::RoundEnd::worker_failure ? "worker failure" : "membership change", r.reason,
                   r.restart_count, config_.max_restarts);
      events_.on_restart();
    };
    ev.on_job_failed = [this](const rendezvous::SendJobFailed& f) {
      if (stopped_) return;
      if (config_.node_label.empty() || !f.root_cause || f.root_cause->failure.node == node_id_) {
        write_all(STDERR_FILENO, format_job_failed(f, entrypoint_name(config_)));
      } else {
        // A fan-out launch shows every host's output in one terminal: one summary is enough, the
        // failing worker's node prints it.
        spdlog::error("job '{}' failed: {}", config_.run_id, f.root_cause->describe());
      }
      events_.on_job_failed(f.exit_code);
    };
    ev.on_job_completed = [this] {
      if (stopped_) return;
      spdlog::info("job '{}' completed on every node", config_.run_id);
      events_.on_job_completed();
    };
    ev.on_refused = [this](const std::string& reason) {
      if (!stopped_) events_.on_refused("the rendezvous at " + endpoint_.to_string() + " refused this node: " + reason);
    };
    ev.on_progress = [this](const std::string& text) {
      if (!stopped_) events_.on_progress(text);
    };
    ev.on_unreachable = [this](const std::string& error) {
      if (!stopped_) events_.on_unreachable(error);
    };
    spdlog::info("node {} joining rendezvous '{}' at {} ({} worker(s), nnodes {}:{})", addr_, config_.run_id,
                 endpoint_.to_string(), config_.nproc_per_node, config_.min_nodes, config_.max_nodes);
    client_ = std::make_unique<rendezvous::RendezvousClient>(io_, std::move(opts), std::move(ev));
  }

  void on_assignment(const rendezvous::Assignment& a) {
    if (static_) {
      // torchrun's static backend: the group rank is --node-rank and every node runs nproc workers.
      const int expected = config_.max_nodes * config_.nproc_per_node;
      if (a.world_size != expected || a.group_world_size != config_.max_nodes) {
        write_all(STDERR_FILENO, "ddprun: error: static rendezvous: the nodes disagree on the world size (" +
                                     std::to_string(a.world_size) + " workers on " + std::to_string(a.group_world_size) +
                                     " nodes, this node expects " + std::to_string(expected) +
                                     "); use the same --nproc-per-node and --nnodes on every node\n");
        events_.on_job_failed(1);
        return;
      }
    }
    RoundAssignment r;
    r.round = a.round;
    r.placement = placement_of(config_, a);
    r.nccl_id = a.nccl_id;
    r.dir_name = "round_" + std::to_string(a.round);
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
  Endpoint endpoint_;
  std::string addr_;
  rendezvous::NodeId node_id_;
  std::vector<std::uint8_t> offer_;
  std::unique_ptr<rendezvous::StoreServer> store_;
  std::unique_ptr<rendezvous::RendezvousServer> host_server_;
  std::unique_ptr<rendezvous::RendezvousClient> client_;
  asio::steady_timer linger_timer_;
  std::function<void()> on_host_stopped_;
  bool host_stopped_ = false;
  bool stopped_ = false;
};

}  // namespace

std::unique_ptr<RendezvousBackend> make_rendezvous_backend(asio::io_context& io, const AgentConfig& config,
                                                           BackendEvents events) {
  if (job_mode(config) == JobMode::single_node) return make_single_node_backend(io, config, std::move(events));
  return std::make_unique<ClientBackend>(io, config, std::move(events));
}

}  // namespace ddprun::agent
