#pragma once
// The rendezvous client under ClientBackend (backend_rendezvous.cpp), private to agent/.
// ClientBackend owns everything the multi-node backends share (worker store, node identity,
// events, round summaries, the static world check); a RendezvousTransport is only "a rendezvous
// client": how this node reaches the rendezvous and talks to it. Two transports exist:
//
//   c10d / static  (backend_rendezvous.cpp)  RendezvousClient against ddprun-rdzvd or an
//                                            embedded host this agent may start itself
//   etcd           (backend_etcd.cpp)        EtcdRendezvous: the decision log replicated
//                                            through etcd, no ddprun process in the middle
//
// ClientTransport<Client> forwards the per-round calls to any class with RendezvousClient's
// shape, so each transport only says how its client is built (and, for c10d, hosts).
// Everything runs on the io_context thread.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ddprun/agent/config.hpp"
#include "ddprun/common/clock.hpp"
#include "ddprun/common/endpoint.hpp"
#include "ddprun/rendezvous/rendezvous_client.hpp"

namespace ddprun::agent {

// What every transport's client is built from.
struct ClientParams {
  rendezvous::NodeInfo node;
  rendezvous::JobConfig config;
  Duration give_up_after{};
  rendezvous::RendezvousEvents events;
};

class RendezvousTransport {
 public:
  virtual ~RendezvousTransport() = default;
  // The endpoints this node's advertised address is picked towards (advertised_address()): the
  // first that resolves and has a route.
  virtual std::vector<Endpoint> peers() const = 0;
  // The rendezvous in messages: "127.0.0.1:29400", "etcd http://h1:2379,http://h2:2379".
  virtual std::string where() const = 0;
  // Once this node's address and worker store are known: a transport may host here.
  virtual void start(const std::string& advertised) = 0;
  // Builds the client (the first next_round()).
  virtual void connect(ClientParams params) = 0;
  virtual bool has_client() const = 0;
  virtual void join() = 0;
  virtual void set_nccl_ids(std::vector<std::uint8_t> ids) = 0;
  virtual void report_failure(const rendezvous::WorkerFailure& failure) = 0;
  virtual void report_success(std::uint64_t round) = 0;
  virtual void leave(const std::string& why) = 0;  // why: as RendezvousBackend::leave
  // Stops the client (no callback after this), then `stopped`: at once, or once an embedded
  // host had its chance to tell its peers.
  virtual void stop(std::function<void()> stopped) = 0;
};

template <class Client>
class ClientTransport : public RendezvousTransport {
 public:
  ~ClientTransport() override { client_.reset(); }

  void connect(ClientParams params) override { client_ = make_client(std::move(params)); }
  bool has_client() const override { return client_ != nullptr; }
  void join() override { client_->join(); }
  void set_nccl_ids(std::vector<std::uint8_t> ids) override {
    if (client_) client_->set_nccl_ids(std::move(ids));
  }
  void report_failure(const rendezvous::WorkerFailure& failure) override { client_->report_failure(failure); }
  void report_success(std::uint64_t round) override { client_->report_success(round); }
  void leave(const std::string& /*why*/) override { client_->leave(); }
  void stop(std::function<void()> stopped) override {
    if (client_) client_->stop();
    stopped();
  }

 protected:
  virtual std::unique_ptr<Client> make_client(ClientParams params) = 0;
  void stop_client() {
    if (client_) client_->stop();
  }

 private:
  std::unique_ptr<Client> client_;
};

// c10d and static (backend_rendezvous.cpp).
std::unique_ptr<RendezvousTransport> make_c10d_transport(boost::asio::io_context& io, const AgentConfig& config);
// etcd (backend_etcd.cpp).
std::unique_ptr<RendezvousTransport> make_etcd_transport(boost::asio::io_context& io, const AgentConfig& config);

}  // namespace ddprun::agent
