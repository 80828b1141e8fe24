#pragma once
// NCCL unique IDs (docs/gpus.md, "NCCL unique ID"): the 128-byte ncclUniqueId, its 256-hex-char
// form (DDPRUN_NCCL_UNIQUE_ID / DDPRUN_NCCL_UNIQUE_IDS), generation through a dlopen'd
// libnccl.so.2, and NcclIdHolder, which runs the `ddprun-nccl-id` holder process for one round.
//
// Why a holder process: ncclGetUniqueId starts NCCL's bootstrap root thread in the calling
// process; it must live until every rank has called ncclCommInitRank, and a restart needs a
// fresh ID. One short-lived child per round keeps those threads out of the agent.
//
// Thread safety: encode/decode are pure. generate_nccl_unique_ids() loads NCCL into the calling
// process (use it from the holder, not the agent). NcclIdHolder is a move-only owner of one
// child process; not thread-safe.
#include <sys/types.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ddprun/common/error.hpp"
#include "ddprun/worker_env/worker_env.hpp"

namespace ddprun::worker_env {

inline constexpr std::size_t nccl_unique_id_bytes = 128;  // NCCL_UNIQUE_ID_BYTES
using NcclUniqueId = std::array<std::uint8_t, nccl_unique_id_bytes>;

// 128 bytes -> 256 lowercase hex chars.
std::string encode_nccl_id(const NcclUniqueId& id);
// 256 hex chars (either case, surrounding blanks ignored) -> 128 bytes. Throws ddprun::Error
// naming `what` (e.g. "DDPRUN_NCCL_UNIQUE_ID") on a wrong length or a non-hex character.
NcclUniqueId decode_nccl_id(std::string_view hex, std::string_view what);
// Comma-separated list (DDPRUN_NCCL_UNIQUE_IDS); entry i is named "<what>[i]" in errors.
std::vector<NcclUniqueId> decode_nccl_id_list(std::string_view list, std::string_view what);

// The bootstrap root an ID names (NCCL's ncclBootstrapHandle: uint64 magic, then a
// sockaddr_in/sockaddr_in6 at offset 8). nullopt when the family is neither AF_INET nor AF_INET6.
struct NcclBootstrapRoot {
  std::uint64_t magic = 0;
  int family = 0;    // AF_INET or AF_INET6
  std::string host;  // numeric address
  std::uint16_t port = 0;
};
std::optional<NcclBootstrapRoot> decode_bootstrap_root(const NcclUniqueId& id);

// NCCL could not be loaded or ncclGetUniqueId failed (the message says which library, why).
class NcclUnavailable : public Error {
 public:
  using Error::Error;
};

// Where libnccl is looked for, in order: $DDPRUN_NCCL_LIBRARY (only that, when set),
// else libnccl.so.2 through the default loader path, /usr/local/cuda/lib/libnccl.so.2,
// /usr/local/cuda/lib64/libnccl.so.2, then python_nccl_libraries(env).
std::vector<std::string> nccl_library_candidates(const EnvMap& env);

// The NCCL that pip's nvidia-nccl wheels install beside torch: nvidia/*/lib/libnccl.so.2 under
// the site-packages (or dist-packages) of the Python prefix of $PYTHON_EXEC and of each PATH
// directory that holds an executable python3, in that order, existing files only.
std::vector<std::string> python_nccl_libraries(const EnvMap& env);

// Calls ncclGetUniqueId `count` times in THIS process (starting `count` bootstrap root threads
// here). Throws NcclUnavailable.
std::vector<NcclUniqueId> generate_nccl_unique_ids(int count, const EnvMap& env);

// `ddprun-nccl-id` next to the running executable (/proc/self/exe), where the build and
// `cmake --install` put it beside `ddprun`. Empty when /proc/self/exe cannot be read.
std::string default_nccl_id_holder_path();

// Runs `<holder_binary> --roots K` for one round: the child prints K IDs and keeps their
// bootstrap roots alive until this object is destroyed or stop() is called (stdin closed, then
// SIGTERM/SIGKILL after `grace`). The child also dies with the thread that started it
// (PR_SET_PDEATHSIG): start it from a long-lived thread.
class NcclIdHolder {
 public:
  // Spawns and waits up to `timeout` for the IDs. Throws NcclUnavailable when the holder exits
  // with code 3 (no NCCL: its one-line reason is the message), ddprun::Error otherwise
  // (cannot spawn, bad output, timeout). `extra_env` is added to the child's environment.
  static NcclIdHolder start(const std::string& holder_binary, int roots, std::chrono::milliseconds timeout,
                            const EnvList& extra_env = {});
  // start() in two halves, so the caller can do other work while the holder loads NCCL:
  // spawn() only starts the process (throws ddprun::Error when it cannot); await() reads the IDs
  // with start()'s rules and errors. await() on a holder that has its IDs does nothing.
  static NcclIdHolder spawn(const std::string& holder_binary, int roots, const EnvList& extra_env = {});
  void await(std::chrono::milliseconds timeout);
  NcclIdHolder(NcclIdHolder&& other) noexcept;
  NcclIdHolder& operator=(NcclIdHolder&& other) noexcept;
  NcclIdHolder(const NcclIdHolder&) = delete;
  NcclIdHolder& operator=(const NcclIdHolder&) = delete;
  ~NcclIdHolder();

  const std::vector<NcclUniqueId>& ids() const { return ids_; }
  // DDPRUN_NCCL_UNIQUE_ID (first ID) and, when roots > 1, DDPRUN_NCCL_UNIQUE_IDS (all, comma list).
  EnvList worker_env() const;
  pid_t pid() const { return pid_; }
  // Ends the round: closes the child's stdin, waits up to `grace`, then SIGKILL. Idempotent.
  void stop(std::chrono::milliseconds grace = std::chrono::milliseconds(2000));

 private:
  NcclIdHolder() = default;
  void close_output();
  pid_t pid_ = -1;
  int stdin_fd_ = -1;
  int out_fd_ = -1;  // until await() has read the IDs
  int err_fd_ = -1;
  int roots_ = 0;
  std::string binary_;
  std::vector<NcclUniqueId> ids_;
};

// --nccl-id comm-id: the NCCL_COMM_ID value "host:port" ("[v6]:port" for an IPv6 literal) for
// one attempt. The port is found by binding a TCP socket to `host` (a numeric address; a name
// binds the wildcard address) on port 0 and closing it again, so another process may take the
// port before rank 0's ncclCommInitRank listens on it (a small race, documented in docs/gpus.md).
// Never returns `avoid` (the previous attempt's value: its rank 0 may not have let go of it).
// Throws ddprun::NetworkError naming the host when no port can be bound.
std::string pick_nccl_comm_id(const std::string& host, const std::string& avoid = "");

// True when `text` looks like a pick_nccl_comm_id value: printable, "host:port", port 1..65535.
bool looks_like_comm_id(std::string_view text);

// Elastic jobs: what a comm-id node offers to the rendezvous in place of unique IDs. The
// rendezvous carries whole 128-byte IDs only (docs/protocol.md), so the value travels as one
// block: "NCCL_COMM_ID=" + value, NUL padded. Throws ddprun::Error when it does not fit (a host
// name longer than 100 characters: pass a numeric --local-addr).
std::vector<std::uint8_t> encode_comm_id_offer(const std::string& value);
// The value of such a block; nullopt when `bytes` are anything else (e.g. real unique IDs from a
// node that runs another --nccl-id mode).
std::optional<std::string> decode_comm_id_offer(const std::vector<std::uint8_t>& bytes);

}  // namespace ddprun::worker_env
