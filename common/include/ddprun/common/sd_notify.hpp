#pragma once
// systemd's readiness protocol (sd_notify(3)) without libsystemd: one datagram of
// newline-separated VAR=value assignments sent to the AF_UNIX socket named by $NOTIFY_SOCKET.
// A name starting with '@' is in the abstract namespace (the '@' becomes a NUL byte); any other
// name must be an absolute path. Without $NOTIFY_SOCKET (not started by systemd with
// Type=notify) every call is a no-op that reports success, so daemons call it unconditionally.
// Stateless and thread-safe: each call opens, sends on and closes its own socket.
#include <string>
#include <string_view>

namespace ddprun {

struct NotifyResult {
  bool sent = false;  // a datagram went out ($NOTIFY_SOCKET was set and reachable)
  std::string error;  // empty on success or when $NOTIFY_SOCKET is unset; else what failed, naming the socket
};

// Sends `state` (e.g. "READY=1\nSTATUS=listening on 0.0.0.0:29400") to $NOTIFY_SOCKET.
NotifyResult sd_notify(std::string_view state);

// The same to an explicit socket name (the value $NOTIFY_SOCKET would hold); for tests and callers
// that read the variable themselves.
NotifyResult sd_notify_to(std::string_view socket_name, std::string_view state);

// READY=1 with a STATUS= line: call once the service accepts work (its port is bound and listening).
NotifyResult notify_ready(std::string_view status);

}  // namespace ddprun
