// The daemon's metric families (rendezvous_metrics.hpp has the contract).
#include "ddprun/rendezvous/rendezvous_metrics.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <string>

#include "ddprun/rendezvous/rendezvous_server.hpp"

namespace ddprun::rendezvous {

void add_rendezvous_metrics(metrics::Exposition& out, const RendezvousServer& server, TimePoint now) {
  using metrics::Sample;
  const StoreStats store = server.store_stats();
  const RendezvousServiceStats service = server.service_stats();

  out.gauge("ddprun_rdzvd_connections", "Client connections open now (agents, workers, tools).",
            static_cast<double>(store.connections));
  out.counter("ddprun_rdzvd_connections_accepted_total", "Client connections accepted since start.",
              static_cast<double>(store.connections_total));
  out.gauge("ddprun_rdzvd_relay_links", "Relays (ddprun-rdzvd --relay-to) connected now.",
            static_cast<double>(store.relay_links));
  out.gauge("ddprun_rdzvd_relayed_connections",
            "Client connections carried by relays now (also counted in ddprun_rdzvd_connections).",
            static_cast<double>(store.relayed_connections));
  std::vector<Sample> refused_connections;
  for (std::size_t i = 0; i < kRefusedReasons; ++i) {
    refused_connections.push_back(Sample{{{"reason", std::string(refused_reason_name(static_cast<RefusedReason>(i)))}},
                                         static_cast<double>(store.refused[i])});
  }
  out.counter("ddprun_rdzvd_connections_refused_total",
              "Connections refused at accept (connection_limit, peer_limit, out_of_descriptors) or closed by the "
              "server (protocol_error, buffer_limit, timeout, unauthenticated, wait_limit).",
              refused_connections);

  std::array<double, 4> by_state{};
  Duration longest_wait{};
  double missing = 0;
  // Counted from the jobs themselves: building every job's status (members and all) made each
  // scrape stall the daemon's loop for ~200 ms at 100,000 jobs.
  double spares = 0;
  server.registry().for_each_job([&](const RendezvousJob& job) {
    ++by_state[static_cast<std::size_t>(job.state())];
    if (!job.finished()) spares += job.count(MemberRole::spare);  // a finished job's spares wait no more
    if (job.state() != JobState::waiting) return;
    if (const auto since = server.round_opened_at(job.run_id()); since && now - *since > longest_wait) {
      longest_wait = now - *since;
    }
    const int joined = job.count(MemberRole::joined);
    if (joined < job.config().min_nodes) missing += static_cast<double>(job.config().min_nodes - joined);
  });
  std::vector<Sample> jobs;
  for (JobState s : {JobState::waiting, JobState::running, JobState::completed, JobState::failed}) {
    jobs.push_back(Sample{{{"state", to_string(s)}}, by_state[static_cast<std::size_t>(s)]});
  }
  out.gauge("ddprun_rdzvd_jobs", "Rendezvous jobs known to the daemon, by state.", jobs);
  out.gauge("ddprun_rdzvd_waiting_seconds_max",
            "Seconds the longest-waiting job has been collecting its current round (0 when none waits).",
            std::chrono::duration<double>(longest_wait).count());
  out.gauge("ddprun_rdzvd_waiting_nodes_missing",
            "Nodes the waiting jobs still need to reach their minimum (--nnodes MIN), summed over jobs.", missing);
  out.gauge("ddprun_rdzvd_nodes", "Agents with a live connection.", static_cast<double>(service.nodes));
  out.gauge("ddprun_rdzvd_spare_nodes",
            "Spare nodes waiting in the jobs (joined while --nnodes MAX nodes took part), summed over jobs.", spares);
  out.counter("ddprun_rdzvd_joins_total", "Join and rejoin requests received.", static_cast<double>(service.joins));
  out.counter("ddprun_rdzvd_rounds_closed_total", "Rendezvous rounds closed (assignments sent).",
              static_cast<double>(service.rounds_closed));
  out.counter("ddprun_rdzvd_restarts_total",
              "Rounds ended by a restart decision (worker failure or membership change).",
              static_cast<double>(service.restarts));
  out.histogram("ddprun_rdzvd_round_close_seconds", "Seconds from the first join of a round to its close.",
                service.round_close_seconds);
  out.counter("ddprun_rdzvd_frames_total", "Native rendezvous frames decoded.", static_cast<double>(service.frames));

  std::vector<Sample> refused;
  refused.push_back(Sample{{{"reason", "malformed"}}, static_cast<double>(service.frames_malformed)});
  for (std::size_t i = 0; i < kRefuseCodes; ++i) {
    refused.push_back(Sample{{{"reason", std::string(refuse_code_label(static_cast<RefuseCode>(i)))}},
                             static_cast<double>(service.refused[i])});
  }
  out.counter("ddprun_rdzvd_refused_frames_total",
              "Native rendezvous frames refused: malformed (connection closed) or a refused join, by reason.", refused);

  std::vector<Sample> ops;
  for (std::size_t i = 0; i < store.ops.size(); ++i) {
    ops.push_back(Sample{{{"op", std::string(op_name(static_cast<Op>(i)))}}, static_cast<double>(store.ops[i])});
  }
  out.counter("ddprun_rdzvd_store_ops_total", "TCPStore requests executed, by operation.", ops);
  out.counter("ddprun_rdzvd_received_bytes_total", "Bytes read from clients (store and rendezvous frames).",
              static_cast<double>(store.bytes_in));
  out.counter("ddprun_rdzvd_sent_bytes_total", "Bytes written to clients (store replies and rendezvous pushes).",
              static_cast<double>(store.bytes_out));
  out.gauge("ddprun_rdzvd_store_keys", "Keys held in the store.", static_cast<double>(store.keys));
  out.gauge("ddprun_rdzvd_store_held_bytes", "Bytes of keys and values held in the store.",
            static_cast<double>(store.bytes));
  out.gauge("ddprun_rdzvd_store_pending_waits", "Connections blocked in WAIT or BARRIER.",
            static_cast<double>(store.pending_waits));
}

}  // namespace ddprun::rendezvous
