#pragma once
// Text helpers shared by the RendezvousJob sources (private to elastic/src).
#include <fmt/format.h>

#include <cstddef>
#include <string>

#include "ddprun/rendezvous/rendezvous_types.hpp"

namespace ddprun::rendezvous::detail {

// An NCCL offer of at most this many bytes (one unique ID, or one NCCL_COMM_ID block) is kept
// for every member; larger ones only for the likeliest group-rank-0 nodes (rendezvous_job.hpp).
inline constexpr std::size_t kOneOfferBytes = 128;

inline std::string node_label(const NodeInfo& info) {
  return info.addr.empty() ? info.id.to_string() : info.addr + " (" + info.id.to_string() + ")";
}

inline std::string nnodes(int min_nodes, int max_nodes) {
  return min_nodes == max_nodes ? std::to_string(min_nodes) : fmt::format("{}:{}", min_nodes, max_nodes);
}

inline Duration until(TimePoint deadline, TimePoint now) { return deadline > now ? deadline - now : Duration::zero(); }

}  // namespace ddprun::rendezvous::detail
