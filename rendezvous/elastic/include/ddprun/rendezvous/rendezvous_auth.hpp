#pragma once
// The rendezvous handshake's cryptography (docs/protocol.md, "Authentication"): HMAC-SHA256
// (OpenSSL libcrypto) over fixed domain-separation labels and the two nonces, so the raw token
// never crosses the wire and a replayed AUTH is useless against a fresh server nonce. The server
// answers with its own MAC under a different label, so a client can tell a daemon that knows the
// token from one that does not.
//
//   client mac = HMAC(token, "ddprun-rdzv-client-v1\0" || server_nonce || client_nonce || run_id)
//   server mac = HMAC(token, "ddprun-rdzv-server-v1\0" || client_nonce || server_nonce || run_id)
//
// Nonces are 32 random bytes from getrandom(2) (drawn from a per-thread pool of 4 KiB, wiped as
// it is used and emptied in a forked child); they travel as 64 lower-case hex digits. MACs are
// compared with CRYPTO_memcmp (constant time). Thread-safe: the state is per thread (the pool,
// and one HMAC context keyed with the last key used, a copy of the token).
#include <cstddef>
#include <string>
#include <string_view>

namespace ddprun::rendezvous::auth {

inline constexpr std::size_t nonce_bytes = 32;
inline constexpr std::size_t node_secret_bytes = 16;
// The run id of a connection allowed to touch every job (ddprun status of all jobs, admin tools).
inline constexpr std::string_view any_run = "*";

// `n` random bytes from getrandom(2) (through the per-thread pool), as lower-case hex. Throws
// ddprun::Error if the kernel's generator fails (it blocks only before it is initialised at boot).
std::string random_hex(std::size_t n);

// HMAC-SHA256(key, message) as 64 lower-case hex digits.
std::string hmac_sha256_hex(std::string_view key, std::string_view message);

// Makes the handshake's cryptography usable (bin/ddprun loads OpenSSL on first use,
// openssl_runtime.hpp); throws ddprun::Error naming the token handshake when it cannot be
// loaded. Servers, clients and relays with a token call it when they are made, so a missing
// library stops them at start, not inside a connection's handler.
void require_crypto();

// The MACs of the handshake; nonces as hex text (the hex digits are what is signed).
std::string client_mac(std::string_view token, std::string_view server_nonce, std::string_view client_nonce,
                       std::string_view run_id);
std::string server_mac(std::string_view token, std::string_view client_nonce, std::string_view server_nonce,
                       std::string_view run_id);

// Constant-time equality (plain C++, no OpenSSL: node secrets are compared also in jobs
// without a token); different lengths compare unequal without looking at the bytes (lengths
// are public: a MAC is always 64 hex digits).
bool equal_secret(std::string_view a, std::string_view b);

// True for exactly 2*bytes lower-case hex digits.
bool is_hex_of(std::string_view text, std::size_t bytes);

}  // namespace ddprun::rendezvous::auth
