#pragma once
// The connection layer of StoreClient (private to store/src): blocking POSIX sockets with
// deadlines (poll), connect to any address of host:port, the VALIDATE/PING handshake bytes
// (encoded through the codec) and the texts its errors use. No state; every function reports
// failure through its return value and an error text, never by throwing.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "ddprun/rendezvous/protocol.hpp"

namespace ddprun::rendezvous::store_connect {

using SteadyTime = std::chrono::steady_clock::time_point;

inline SteadyTime now() { return std::chrono::steady_clock::now(); }

// "30 s", "2.5 s", "250 ms".
std::string format_duration(std::chrono::milliseconds d);
// "host:port", "[v6]:port".
std::string endpoint_text(const std::string& host, std::uint16_t port);
std::string errno_text(int err);
// SO_RCVTIMEO/SO_SNDTIMEO expiry.
bool is_would_block(int err);
// Waits until `fd` has `events` (or an error/hangup) or the deadline passes; false on timeout.
bool wait_fd(int fd, short events, SteadyTime deadline);
// One TCP connect to any address of host:port before `deadline`: a connected blocking socket
// with TCP_NODELAY and `io_timeout` as SO_RCVTIMEO/SO_SNDTIMEO, or -1 with `last_error` set.
int connect_once(const std::string& host, std::uint16_t port, SteadyTime deadline, std::chrono::milliseconds io_timeout,
                 std::string& last_error);
bool send_all_raw(int fd, const char* data, std::size_t len, std::string& err);
// Reads exactly `len` bytes before `deadline` (handshakes and probes).
bool recv_exact_raw(int fd, char* out, std::size_t len, SteadyTime deadline, std::string& err);
// Appends a modern-generation request without keys (VALIDATE, PING, GETNUMKEYS).
void encode_modern(std::string& out, Op op, std::uint32_t u32 = 0);
std::string validate_and_ping_bytes(std::uint32_t nonce);
std::uint32_t handshake_nonce();

}  // namespace ddprun::rendezvous::store_connect
