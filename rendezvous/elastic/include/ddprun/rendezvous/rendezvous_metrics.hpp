#pragma once
// What a RendezvousServer reports to Prometheus: the families docs/daemon.md ("Metrics")
// lists, named ddprun_rdzvd_*, written into a metrics::Exposition from store_stats(),
// service_stats() and the registry's job states at `now`. Every labelled family lists all of
// its label values, zeros included, so series exist from the first scrape. Pure apart from
// reading the server; call it on the server's io_context thread.
#include <string_view>

#include "ddprun/common/clock.hpp"
#include "ddprun/common/metrics.hpp"

namespace ddprun::rendezvous {

class RendezvousServer;

void add_rendezvous_metrics(metrics::Exposition& out, const RendezvousServer& server, TimePoint now);

}  // namespace ddprun::rendezvous
