#pragma once
// Pure (or nearly pure) pieces of the multi-node rendezvous backends (backend_rendezvous.cpp):
// the rendezvous JobConfig a node asks for, the address it advertises, whether it may host an
// embedded rendezvous, and the failure / summary texts it exchanges with the rendezvous. Stateless free functions; safe
// from any thread.
//
// advertised_address() and is_local_address() ask the kernel (a UDP socket's connect() +
// getsockname(), which sends nothing; getifaddrs()) and never do reverse DNS or FQDN lookups:
// torchrun's FQDN habit is a top user complaint.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "ddprun/agent/config.hpp"
#include "ddprun/agent/exit_status.hpp"
#include "ddprun/agent/failure.hpp"
#include "ddprun/agent/nccl_ids.hpp"
#include "ddprun/common/endpoint.hpp"
#include "ddprun/rendezvous/rendezvous_state.hpp"
#include "ddprun/worker_env/worker_env.hpp"

namespace ddprun::agent {

// Shorthands of job_mode(config) (config.hpp): not single_node; static_multi_node.
bool uses_elastic_path(const AgentConfig& config);
bool is_static_multi_node(const AgentConfig& config);

// The rendezvous endpoints of an elastic job (c10d: --rdzv-endpoint, default port 29400, one
// or a list of relays of one daemon; static: --master-addr:--master-port; etcd: the first etcd
// member). Throws UsageError when it is missing. rendezvous_endpoint: the first of them.
std::vector<Endpoint> rendezvous_endpoints(const AgentConfig& config);
Endpoint rendezvous_endpoint(const AgentConfig& config);

// This node's placement for a round: the rendezvous' assignment (the one conversion from it);
// static multi-node jobs take the group rank from --node-rank.
worker_env::Placement placement_of(const AgentConfig& config, const rendezvous::Assignment& assignment);

// min/max nodes, the global restart budget and the --rdzv-conf timers.
rendezvous::JobConfig job_config(const AgentConfig& config);

// --local-addr when given, else the local address the kernel picks to reach `peer`.
// Throws NetworkError naming the peer when no route exists.
std::string advertised_address(const AgentConfig& config, const Endpoint& peer);
// The same towards the first of `peers` that resolves and has a route (etcd members: any will
// do). Throws NetworkError naming each peer and why when none does.
std::string advertised_address(const AgentConfig& config, const std::vector<Endpoint>& peers);

// `host` (a numeric address, or a name resolved without reverse lookups) is loopback or an
// address of one of this machine's interfaces.
bool is_local_address(const std::string& host);

// Whether this agent may host an embedded rendezvous at `endpoint` when no server answers there:
// static: node rank 0 only. c10d: is_host from --rdzv-conf when given; else, with --local-addr, only when the endpoint
// host is exactly that address; without it, when the endpoint host is one of this machine's addresses.
bool may_host(const AgentConfig& config, const Endpoint& endpoint, const std::string& advertised);

// Whether a TCP connection to `endpoint` succeeds within `timeout` (blocking; used once at start
// to decide between joining a running rendezvous server and hosting one).
bool tcp_connects(const Endpoint& endpoint, std::chrono::milliseconds timeout);

// A random hex string identifying this agent instance (NodeId::instance).
std::string random_instance_id();

// The report for a local worker's failure. `message`: from its error file, may be empty.
rendezvous::WorkerFailure make_failure(std::uint64_t round, const rendezvous::NodeId& node, int rank, int local_rank,
                                       const ExitStatus& status, const std::string& message);

// The text every agent prints when the job fails: the reason, then the bordered root-cause block
// naming the failing node and rank (when a worker failure caused it), with `local_others` (this
// node's other failed ranks of the round) listed under "Failures:". `local_root`: this node's own
// report of the root-cause rank when it failed here (pid, error file, traceback, cause), used
// instead of what the rendezvous relayed (the message alone).
std::string format_job_failed(const rendezvous::SendJobFailed& failed, const std::string& command,
                              const std::vector<FailureReport>& local_others = {},
                              const FailureReport* local_root = nullptr);

}  // namespace ddprun::agent
