#pragma once
// StoreClient: a synchronous client of the c10d TCPStore protocol (our server or torch's).
//
// Blocking POSIX sockets with per-call deadlines (poll), no Asio, no threads: usable from the
// agent, from tools, and from the worker library. Not thread-safe: one connection, one
// request at a time, like torch's own client. Keys get `key_prefix` ("/" by default, as torch
// does), so a key set here as "k" is the key torch reads as "k".
//
// Errors: NetworkError (cannot connect / connection lost, names host:port), TimeoutError
// (a wait, get or barrier ran past its deadline; the connection stays usable in the modern
// generation thanks to CANCEL_WAIT, and is reconnected in the legacy one), ddprun::Error
// (a key/value over `limits`, checked before anything is sent; a modern-only op in the
// legacy generation).
//
// Cost model: every request is encoded into one buffer and written with one send(); replies
// are read through a receive buffer, so a reply normally costs one recv(). After an I/O
// error the connection is closed and the next call reconnects (connect_timeout applies).
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ddprun/rendezvous/protocol.hpp"

namespace ddprun::rendezvous {

struct StoreClientOptions {
  std::string host = "127.0.0.1";
  std::uint16_t port = 29500;
  Generation generation = Generation::modern;
  std::chrono::milliseconds connect_timeout{std::chrono::seconds(30)};
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};  // default for get/wait/barrier
  std::string key_prefix = "/";
  StoreLimits limits;
  // Count this client in the raw `init/` key on connect (ADD "init/" +1), as torch's
  // TCPStore(world_size=N) does; nothing waits on it.
  bool add_init_key = false;
  // get() in one round trip: CHECK + GET sent together; when the key is missing the GET's
  // reply is discarded and get() falls back to WAIT + GET. Needs a server that answers GET
  // on a missing key with an empty value instead of closing (ddprun-rdzvd, torch >= 2.4's
  // libuv server), so it is modern-generation only and off by default.
  bool pipelined_get = false;
};

// What a server speaks, as far as probing can tell (protocol §2.3).
enum class DetectedGeneration : std::uint8_t {
  legacy,          // 1.13 / 2.0 numbering, no handshake
  modern_no_ping,  // VALIDATE but no PING (2.2 - 2.4)
  modern,          // VALIDATE + PING (2.5+, ddprun-rdzvd)
};

// Probes host:port (two short connections, protocol §2.3) and reports the generation.
// Throws NetworkError when nothing accepts a connection within `timeout`. Prefer
// configuring the generation: against a 1.13 server each probe waits max(250 ms,
// timeout/8) for an answer that never comes, and that server serves nobody else meanwhile.
DetectedGeneration detect_generation(const std::string& host, std::uint16_t port, std::chrono::milliseconds timeout);

class StoreClient {
 public:
  // Connects (retrying with exponential backoff and jitter until connect_timeout) and, in the
  // modern generation, sends VALIDATE + PING and checks the echo.
  explicit StoreClient(StoreClientOptions options);
  ~StoreClient();
  StoreClient(StoreClient&&) noexcept;
  StoreClient& operator=(StoreClient&&) noexcept;

  const StoreClientOptions& options() const;

  void set(std::string_view key, std::string_view value);
  // Blocking get: WAIT for the key, then GET (as torch's client does).
  std::string get(std::string_view key);
  std::string get(std::string_view key, std::chrono::milliseconds timeout);
  std::int64_t add(std::string_view key, std::int64_t delta);
  // ADD on a key sent as is, without key_prefix (torch's `init/` counter).
  std::int64_t add_raw(std::string_view raw_key, std::int64_t delta);
  // Returns the value now held (see protocol §4.4: `expected` when the key is missing and
  // `expected` is non-empty).
  std::string compare_set(std::string_view key, std::string_view expected, std::string_view desired);
  bool check(const std::vector<std::string>& keys);
  void wait(const std::vector<std::string>& keys);
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);
  std::int64_t num_keys();
  bool delete_key(std::string_view key);

  // Modern generation only (throws ddprun::Error in legacy mode).
  void append(std::string_view key, std::string_view value);
  std::vector<std::string> multi_get(const std::vector<std::string>& keys);
  void multi_set(const std::vector<std::string>& keys, const std::vector<std::string>& values);
  void queue_push(std::string_view key, std::string_view value);
  // Non-blocking pop: nullopt when the queue is empty.
  std::optional<std::string> queue_pop(std::string_view key);
  // Blocking pop: waits up to `timeout` for an element.
  std::string queue_pop_wait(std::string_view key, std::chrono::milliseconds timeout);
  std::int64_t queue_len(std::string_view key);
  // Keys visible to this client (those starting with key_prefix, prefix stripped).
  std::vector<std::string> list_keys();
  void barrier(std::string_view key, std::int64_t world_size, std::chrono::milliseconds timeout);
  std::uint32_t ping(std::uint32_t nonce);

  // Diagnostics: TCP connect attempts made so far (all connects, including retries), and
  // how many times the connection was re-established after the first.
  std::uint64_t connect_attempts() const;
  std::uint64_t reconnects() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace ddprun::rendezvous
