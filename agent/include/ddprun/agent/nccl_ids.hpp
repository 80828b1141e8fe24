#pragma once
// The NCCL IDs of a round (--nccl-id, --nccl-roots; docs/gpus.md).
//
// Every round, in every mode, goes the same way: before it, this node prepares an offer (a
// fresh ddprun-nccl-id holder's unique IDs, or with --nccl-id comm-id an "addr:port" block);
// the rendezvous backend hands the group-rank-0 node's offer (or, at scale, the one the
// rendezvous kept in its place: rendezvous_job.hpp, "NCCL offers") to every node in the round's
// assignment (the single-node backend hands back this node's own offer); decide_round_nccl()
// turns that into the workers' variables and says whether this node's holder serves the round.
// The root count is one rule: nccl_roots_to_offer() before the world is known,
// nccl_roots_for_round() once it is.
//
// decide_round_nccl and the root counts are pure. NcclIdOwner runs the holder process; it is
// single-owner, not thread safe.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ddprun/agent/config.hpp"
#include "ddprun/worker_env/nccl_id.hpp"
#include "ddprun/worker_env/worker_env.hpp"

namespace ddprun::agent {

// A node offers its IDs before the world size is known, so without --nccl-roots it offers enough
// for the largest world the job allows (max nodes x its own workers): ceil(that / 256), at least 1.
int nccl_roots_to_offer(const AgentConfig& config);
// The IDs a round's workers use: with --nccl-roots all of them; without it ceil(world / 256)
// (1 up to 256 ranks) of the offered ones, fewer only when fewer were offered.
std::size_t nccl_roots_for_round(const AgentConfig& config, int world_size, std::size_t offered);

struct RoundNccl {
  bool keep_holder = false;            // this node's holder serves the round's bootstrap roots
  worker_env::EnvList env;             // DDPRUN_NCCL_UNIQUE_ID(S) or NCCL_COMM_ID; empty = none
  std::optional<std::string> warning;  // an offer that does not fit this node's --nccl-id
};

// The decision for one round: `chosen` is the assignment's IDs (the group-rank-0 node's offer,
// or the one the rendezvous kept in its place), `offered` this node's own offer for the round.
// Whichever node's offer `chosen` is keeps its holder, whatever its group rank.
RoundNccl decide_round_nccl(const AgentConfig& config, std::uint64_t round, int world_size,
                            const std::vector<std::uint8_t>& chosen, const std::vector<std::uint8_t>& offered);

class NcclIdOwner {
 public:
  // `comm_id_host`: where this node's NCCL_COMM_ID root would listen (--nccl-id comm-id).
  NcclIdOwner(const AgentConfig& config, std::string comm_id_host);
  // The backend knows the address only once it has started (after prestart()).
  void set_comm_id_host(std::string host) { comm_id_host_ = std::move(host); }
  // Ends the previous round's holder, then prepares this node's offer for the next round: a fresh
  // holder's IDs, a fresh comm-id port, or nothing (--nccl-id off, or NCCL found missing before:
  // said once). Throws ddprun::Error for --nccl-id env without NCCL.
  std::vector<std::uint8_t> prepare_offer();
  // Starts the first round's holder now, so that it loads NCCL while the agent sets up; the
  // first prepare_offer() then only collects its IDs. Does nothing when that round would start
  // no holder; never throws (prepare_offer() reports what failed).
  void prestart();
  // Applies decide_round_nccl: stops the holder when another node's IDs were chosen. Returns the
  // decision; `withdrawn` is set when this node's offer was withdrawn (the holder stopped).
  RoundNccl begin_round(std::uint64_t round, int world_size, const std::vector<std::uint8_t>& chosen, bool* withdrawn);
  // The job is over: ends the holder.
  void stop();

 private:
  const AgentConfig& config_;
  std::string comm_id_host_;
  // Whether a holder is wanted at all (mode, GPU visible, binary present); `why` says why not.
  // Asked once per agent (the answer is kept: an absent holder is final anyway, unavailable_).
  bool holder_wanted(std::string* why) const;
  bool holder_wanted_now(std::string* why) const;
  mutable std::optional<std::pair<bool, std::string>> wanted_;
  // Not wanted because this is a CPU-only machine (no CUDA_VISIBLE_DEVICES, no NVIDIA device):
  // the expected case, said at debug level rather than on every launch.
  mutable bool cpu_only_ = false;
  std::string holder_binary() const;
  std::optional<worker_env::NcclIdHolder> holder_;
  std::optional<worker_env::NcclIdHolder> prestarted_;
  std::vector<std::uint8_t> offer_;
  std::string comm_id_;
  bool unavailable_ = false;
};

}  // namespace ddprun::agent
