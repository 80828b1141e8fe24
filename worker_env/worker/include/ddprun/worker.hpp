#pragma once
// ddprun worker library, C++ API (docs/gpus.md, "Worker library"). For native workers started
// by ddprun (or torchrun): reads the worker environment (RANK, LOCAL_RANK, WORLD_SIZE, …,
// DDPRUN_NCCL_UNIQUE_ID) and talks to the job's store at MASTER_ADDR:MASTER_PORT.
//
// Errors: ddprun::worker::Error (a std::runtime_error) whose message names the variable or the
// store address, e.g. "RANK is not set" or "WORLD_SIZE='x' is not an integer".
// Thread safety: the free functions are reentrant (they read the environment); a Store is one
// connection and must not be used by two threads at once (create one per thread).
// Keys: every Store key lives under "/ddprun/attempt_<TORCHELASTIC_RESTART_COUNT>/", so it never
// collides with torch's own keys nor with a previous restart's.
#include <array>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "ddprun/worker_export.h"

namespace ddprun::worker {

class DDPRUN_WORKER_API Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what);
  ~Error() override;
  Error(const Error&) = default;
  Error& operator=(const Error&) = default;
};

using Environment = std::map<std::string, std::string>;

struct Info {
  int rank = 0;                   // RANK
  int local_rank = 0;             // LOCAL_RANK
  int world_size = 1;             // WORLD_SIZE
  int local_world_size = 1;       // LOCAL_WORLD_SIZE
  int group_rank = 0;             // GROUP_RANK (node rank)
  int group_world_size = 1;       // GROUP_WORLD_SIZE (default 1 when unset)
  int restart_count = 0;          // TORCHELASTIC_RESTART_COUNT (default 0)
  int max_restarts = 0;           // TORCHELASTIC_MAX_RESTARTS (default 0)
  std::string master_addr;        // MASTER_ADDR
  std::uint16_t master_port = 0;  // MASTER_PORT
  std::string run_id;             // TORCHELASTIC_RUN_ID (default "none")
  int cuda_device = 0;            // DDPRUN_CUDA_DEVICE when set, else LOCAL_RANK
};

// The worker's place in the job, from this process's environment / from `env`.
// RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT are required.
DDPRUN_WORKER_API Info info();
DDPRUN_WORKER_API Info parse_info(const Environment& env);

inline constexpr std::size_t nccl_unique_id_bytes = 128;
// Byte-compatible with ncclUniqueId: memcpy it into one.
using NcclUniqueId = std::array<unsigned char, nccl_unique_id_bytes>;

// Whether DDPRUN_NCCL_UNIQUE_ID is set.
DDPRUN_WORKER_API bool has_nccl_unique_id();
// DDPRUN_NCCL_UNIQUE_ID decoded (throws when unset or malformed).
DDPRUN_WORKER_API NcclUniqueId nccl_unique_id();
DDPRUN_WORKER_API NcclUniqueId parse_nccl_unique_id(const Environment& env);
// DDPRUN_NCCL_UNIQUE_IDS (comma-separated, for ncclCommInitRankScalable) or, when unset,
// the single DDPRUN_NCCL_UNIQUE_ID.
DDPRUN_WORKER_API std::vector<NcclUniqueId> nccl_unique_ids();
DDPRUN_WORKER_API std::vector<NcclUniqueId> parse_nccl_unique_ids(const Environment& env);

struct StoreOptions {
  std::string host = "127.0.0.1";
  std::uint16_t port = 29500;
  int world_size = 1;  // participants of barrier()
  std::string key_prefix = "/ddprun/attempt_0/";
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  // get / barrier / connect
  // The TCPStore wire generation: false = torch >= 2.x / ddprun's own store (what ddprun serves),
  // true = torch 1.13's server. From the environment: DDPRUN_STORE_GENERATION=legacy|modern.
  bool legacy_protocol = false;
};

// A client of the job's store (the TCPStore protocol).
class DDPRUN_WORKER_API Store {
 public:
  // MASTER_ADDR, MASTER_PORT, WORLD_SIZE, TORCHELASTIC_RESTART_COUNT, DDPRUN_STORE_GENERATION,
  // DDPRUN_STORE_TIMEOUT (seconds).
  static StoreOptions options_from_env(const Environment& env);
  static Store from_env();
  explicit Store(const StoreOptions& options);  // connects (throws Error naming host:port)
  ~Store();
  Store(Store&&) noexcept;
  Store& operator=(Store&&) noexcept;
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  void set(std::string_view key, std::string_view value);
  std::string get(std::string_view key);  // waits for the key (up to the timeout)
  std::int64_t add(std::string_view key, std::int64_t delta);
  bool check(std::string_view key);
  // Waits until all world_size workers called barrier() the same number of times.
  void barrier();
  // A named barrier of `count` participants (each name usable once per attempt).
  void barrier(std::string_view name, int count);

 private:
  struct Impl;
  explicit Store(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ddprun::worker
