#pragma once
// Text helpers shared by the RendezvousJob sources (private to elastic/src).
#include <fmt/format.h>

#include <string>

#include "ddprun/rendezvous/rendezvous_types.hpp"

namespace ddprun::rendezvous::detail {

inline std::string node_label(const NodeInfo& info) {
  return info.addr.empty() ? info.id.to_string() : info.addr + " (" + info.id.to_string() + ")";
}

inline std::string nnodes(int min_nodes, int max_nodes) {
  return min_nodes == max_nodes ? std::to_string(min_nodes) : fmt::format("{}:{}", min_nodes, max_nodes);
}

inline Duration until(TimePoint deadline, TimePoint now) { return deadline > now ? deadline - now : Duration::zero(); }

}  // namespace ddprun::rendezvous::detail
