// The etcd transport (--rdzv-backend etcd, torchrun's etcd-v2 spelling too): ClientBackend's
// rounds through an EtcdRendezvous (etcd_rendezvous.hpp), the decision log replicated through
// etcd v3. Nothing is hosted: etcd is the only shared component. The worker store stays on the
// group-rank-0 node's agent (ClientBackend) and the NCCL IDs travel in the log with each join.
#include "ddprun/rendezvous/etcd_rendezvous.hpp"

#include <algorithm>
#include <chrono>
#include <string>

#include "ddprun/agent/elastic.hpp"
#include "ddprun/common/error.hpp"
#include "rendezvous_transport.hpp"

namespace asio = boost::asio;

namespace ddprun::agent {

namespace {

class EtcdTransport final : public ClientTransport<rendezvous::EtcdRendezvous> {
 public:
  EtcdTransport(asio::io_context& io, const AgentConfig& config) : io_(io), config_(config) {
    if (config.etcd.endpoints.empty()) {
      throw UsageError("--rdzv-backend=etcd needs --rdzv-endpoint", "pass the etcd members, e.g. h1:2379,h2:2379");
    }
    std::string list;
    for (const auto& e : config.etcd.endpoints) {
      list += (list.empty() ? "" : ",") + std::string(config.etcd.tls ? "https://" : "http://") + e.to_string();
    }
    where_ = "etcd " + list;
  }

  // Any member will do: one whose name does not resolve (or has no route) from here must not
  // fail the job while the others answer.
  std::vector<Endpoint> peers() const override { return config_.etcd.endpoints; }
  std::string where() const override { return where_; }
  void start(const std::string& /*advertised*/) override {}

 protected:
  std::unique_ptr<rendezvous::EtcdRendezvous> make_client(ClientParams p) override {
    rendezvous::EtcdRendezvousOptions opts;
    const auto& e = config_.etcd;
    opts.etcd.endpoints = e.endpoints;
    opts.etcd.tls = e.tls;
    opts.etcd.cacert = e.cacert;
    opts.etcd.cert = e.cert;
    opts.etcd.key = e.key;
    opts.etcd.username = e.username;
    opts.etcd.password = e.password;
    // A member that stops answering (stalled, partitioned from the client) must be left before
    // this node's lease runs out, else the job loses the node although etcd still has a quorum:
    // each call gets at most a third of the lease TTL before it moves to the next member.
    const Duration third = std::chrono::seconds(rendezvous::etcd::node_lease_ttl(p.config)) / 3;
    const Duration floor = std::chrono::milliseconds(300);
    opts.etcd.request_timeout = std::clamp(third, floor, opts.etcd.request_timeout);
    opts.etcd.connect_timeout = std::clamp(third, floor, opts.etcd.connect_timeout);
    opts.prefix = e.prefix;
    opts.run_id = config_.run_id;
    opts.node = std::move(p.node);
    opts.config = p.config;
    opts.give_up_after = p.give_up_after;
    return std::make_unique<rendezvous::EtcdRendezvous>(io_, std::move(opts), std::move(p.events));
  }

 private:
  asio::io_context& io_;
  const AgentConfig& config_;
  std::string where_;
};

}  // namespace

std::unique_ptr<RendezvousTransport> make_etcd_transport(asio::io_context& io, const AgentConfig& config) {
  return std::make_unique<EtcdTransport>(io, config);
}

}  // namespace ddprun::agent
