// The NCCL IDs of a round; see nccl_ids.hpp.
#include "ddprun/agent/nccl_ids.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <spdlog/spdlog.h>

#include "ddprun/common/error.hpp"
#include "ddprun/worker_env/gpus.hpp"

namespace ddprun::agent {

namespace {

constexpr long kRanksPerRoot = 256;  // NCCL's own root count heuristic for ncclCommInitRankScalable
constexpr long kMaxRoots = 4096;     // --nccl-roots' upper bound
long roots_for(long ranks) { return std::clamp((ranks + kRanksPerRoot - 1) / kRanksPerRoot, 1L, kMaxRoots); }

// How long the holder may take to print its IDs (it only loads NCCL and asks it for IDs).
constexpr std::chrono::milliseconds kNcclHolderTimeout{30000};

}  // namespace

int nccl_roots_to_offer(const AgentConfig& config) {
  if (config.nccl_roots > 0) return config.nccl_roots;
  return static_cast<int>(roots_for(static_cast<long>(config.max_nodes) * config.nproc_per_node));
}

std::size_t nccl_roots_for_round(const AgentConfig& config, int world_size, std::size_t offered) {
  if (config.nccl_roots > 0) return offered;
  return std::min(offered, static_cast<std::size_t>(roots_for(world_size)));
}

RoundNccl decide_round_nccl(const AgentConfig& config, std::uint64_t round, int world_size,
                            const std::vector<std::uint8_t>& chosen, const std::vector<std::uint8_t>& offered) {
  RoundNccl out;
  // Only the holder whose IDs the round uses serves the bootstrap roots: the group-rank-0 node's,
  // or another node's where the rendezvous did not keep rank 0's offer (unique IDs are random,
  // so equal bytes are this node's own). It keeps them until the round ends.
  out.keep_holder = !offered.empty() && chosen == offered;
  if (chosen.empty()) {
    if (!offered.empty()) {
      out.warning = "round " + std::to_string(round) +
                    ": the rendezvous carried no NCCL IDs (the group-rank-0 node offered none, or the nodes "
                    "whose offers it kept left before the round closed); " +
                    (config.nccl_id == AgentConfig::NcclIdMode::comm_id ? "NCCL_COMM_ID" : "DDPRUN_NCCL_UNIQUE_ID") +
                    " is not set (use the same --nccl-id on every node)";
    }
    return out;
  }
  if (config.nccl_id == AgentConfig::NcclIdMode::comm_id) {
    if (const auto value = worker_env::decode_comm_id_offer(chosen)) {
      out.env.emplace_back("NCCL_COMM_ID", *value);
    } else {
      out.warning = "round " + std::to_string(round) +
                    ": --nccl-id comm-id, but the group-rank-0 node offered NCCL unique IDs, not an address; "
                    "NCCL_COMM_ID is not set (use the same --nccl-id on every node)";
    }
    return out;
  }
  if (chosen.size() % worker_env::nccl_unique_id_bytes != 0) {
    out.warning = "round " + std::to_string(round) + ": the assignment's NCCL ID has " + std::to_string(chosen.size()) +
                  " bytes, not a multiple of " + std::to_string(worker_env::nccl_unique_id_bytes) +
                  "; DDPRUN_NCCL_UNIQUE_ID is not set";
    return out;
  }
  std::vector<std::string> hex;
  for (std::size_t at = 0; at < chosen.size(); at += worker_env::nccl_unique_id_bytes) {
    worker_env::NcclUniqueId id{};
    std::copy_n(chosen.begin() + static_cast<std::ptrdiff_t>(at), id.size(), id.begin());
    hex.push_back(worker_env::encode_nccl_id(id));
  }
  const std::size_t wanted = config.nccl_roots > 0 ? hex.size() : static_cast<std::size_t>(roots_for(world_size));
  hex.resize(nccl_roots_for_round(config, world_size, hex.size()));
  if (hex.size() < wanted) {
    out.warning = "round " + std::to_string(round) + ": " + std::to_string(world_size) + " ranks would use " +
                  std::to_string(wanted) + " NCCL roots but the round's offer has " + std::to_string(hex.size());
  }
  out.env.emplace_back("DDPRUN_NCCL_UNIQUE_ID", hex.front());
  if (hex.size() > 1) {
    std::string all;
    for (const auto& h : hex) all += (all.empty() ? "" : ",") + h;
    out.env.emplace_back("DDPRUN_NCCL_UNIQUE_IDS", std::move(all));
  }
  return out;
}

NcclIdOwner::NcclIdOwner(const AgentConfig& config, std::string comm_id_host)
    : config_(config), comm_id_host_(std::move(comm_id_host)) {}

std::vector<std::uint8_t> NcclIdOwner::prepare_offer() {
  if (holder_) {
    holder_->stop();  // its bootstrap roots belong to workers that are gone
    holder_.reset();
  }
  offer_.clear();
  if (config_.nccl_id == AgentConfig::NcclIdMode::comm_id) {
    // No holder: rank 0's ncclCommInitRank hosts the root on this address (used only when this
    // node gets group rank 0). A new port each round.
    comm_id_ = worker_env::pick_nccl_comm_id(comm_id_host_, comm_id_);
    spdlog::debug("--nccl-id comm-id: NCCL_COMM_ID={}", comm_id_);
    offer_ = worker_env::encode_comm_id_offer(comm_id_);
    return offer_;
  }
  if (config_.nccl_id == AgentConfig::NcclIdMode::off || unavailable_) return offer_;
  const bool required = config_.nccl_id == AgentConfig::NcclIdMode::env;
  std::optional<worker_env::NcclIdHolder> holder = std::move(prestarted_);
  prestarted_.reset();
  try {
    if (!holder) {
      std::string why;
      if (!holder_wanted(&why)) {
        if (!required) {
          unavailable_ = true;
          spdlog::log(cpu_only_ ? spdlog::level::debug : spdlog::level::info,
                      "--nccl-id auto: not exporting DDPRUN_NCCL_UNIQUE_ID: {} (--nccl-id env forces it)", why);
          return offer_;
        }
        throw worker_env::NcclUnavailable(why);
      }
      holder = worker_env::NcclIdHolder::spawn(holder_binary(), nccl_roots_to_offer(config_));
    }
    holder->await(kNcclHolderTimeout);
    holder_ = std::move(holder);
    spdlog::debug("NCCL unique ID holder running (pid {}, {} root(s))", holder_->pid(), holder_->ids().size());
  } catch (const worker_env::NcclUnavailable& e) {
    if (required) {
      throw Error("--nccl-id env: cannot create an NCCL unique ID: " + e.message(),
                  "install NCCL (libnccl.so.2) or set DDPRUN_NCCL_LIBRARY, or use --nccl-id auto/off");
    }
    unavailable_ = true;
    spdlog::info("--nccl-id auto: not exporting DDPRUN_NCCL_UNIQUE_ID: {}", e.message());
    return offer_;
  }
  for (const auto& id : holder_->ids()) offer_.insert(offer_.end(), id.begin(), id.end());
  return offer_;
}

std::string NcclIdOwner::holder_binary() const {
  return config_.nccl_id_holder.empty() ? worker_env::default_nccl_id_holder_path() : config_.nccl_id_holder;
}

bool NcclIdOwner::holder_wanted(std::string* why) const {
  if (!wanted_) {
    std::string reason;
    const bool wanted = holder_wanted_now(&reason);
    wanted_.emplace(wanted, std::move(reason));
  }
  *why = wanted_->second;
  return wanted_->first;
}

bool NcclIdOwner::holder_wanted_now(std::string* why) const {
  if (config_.nccl_id != AgentConfig::NcclIdMode::automatic && config_.nccl_id != AgentConfig::NcclIdMode::env) {
    *why = "no holder in this --nccl-id mode";
    return false;
  }
  // auto: an ID is only worth its cost (the holder: ~2 ms of CPU, docs/gpus.md) when a worker
  // could use NCCL.
  if (config_.nccl_id == AgentConfig::NcclIdMode::automatic) {
    worker_env::EnvMap cvd;  // all it reads (not a copy of the whole environment)
    if (const char* v = std::getenv("CUDA_VISIBLE_DEVICES")) cvd.emplace("CUDA_VISIBLE_DEVICES", v);
    if (!worker_env::nvidia_gpu_visible(cvd, "", why)) {
      cpu_only_ = cvd.empty();
      return false;
    }
  }
  const std::string binary = holder_binary();
  if (binary.empty() || ::access(binary.c_str(), X_OK) != 0) {
    *why = "the holder program ddprun-nccl-id was not found next to ddprun" +
           (binary.empty() ? std::string() : " (" + binary + ")");
    return false;
  }
  return true;
}

void NcclIdOwner::prestart() {
  std::string why;
  if (holder_ || prestarted_ || unavailable_ || !holder_wanted(&why)) return;
  try {
    prestarted_ = worker_env::NcclIdHolder::spawn(holder_binary(), nccl_roots_to_offer(config_));
  } catch (const Error& e) {
    spdlog::debug("NCCL holder not started early: {}", e.what());  // prepare_offer() tries again and reports
  }
}

RoundNccl NcclIdOwner::begin_round(std::uint64_t round, int world_size, const std::vector<std::uint8_t>& chosen,
                                   bool* withdrawn) {
  RoundNccl d = decide_round_nccl(config_, round, world_size, chosen, offer_);
  *withdrawn = false;
  if (holder_ && !d.keep_holder) {
    holder_->stop();
    holder_.reset();
    offer_.clear();
    *withdrawn = true;
  }
  if (d.warning) spdlog::warn("{}", *d.warning);
  return d;
}

void NcclIdOwner::stop() {
  holder_.reset();  // its destructor ends the holder process
  prestarted_.reset();
}

}  // namespace ddprun::agent
