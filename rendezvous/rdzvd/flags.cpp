#include "flags.hpp"

namespace ddprun::rdzvd {
namespace {

constexpr std::string_view kLogFormats[] = {"text", "json"};
constexpr std::string_view kLogLevels[] = {"trace", "debug", "info", "warning", "error", "critical", "off"};

// Rows name only the members that differ from FlagSpec's defaults (see launcher/src/flags.cpp).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
// clang-format off
constexpr FlagSpec kFlags[] = {
  {.dash = "host", .metavar = "HOST",
   .help = "Address to listen on (0.0.0.0, :: for dual stack, or a local address).", .default_text = "0.0.0.0"},
  {.dash = "port", .metavar = "PORT", .help = "TCP port; 0 picks a free one.", .default_text = "29400"},
  {.dash = "port-file", .metavar = "FILE",
   .help = "Write the bound port number (and a newline) to this file, atomically."},
  {.dash = "metrics-host", .metavar = "ADDR",
   .help = "IP address the metrics endpoint listens on (0.0.0.0 or :: for every address).",
   .default_text = "127.0.0.1"},
  {.dash = "metrics-port", .metavar = "PORT",
   .help = "Serve Prometheus metrics on GET /metrics over HTTP at this port (on --metrics-host); 0 picks a free "
           "one."},
  {.dash = "metrics-port-file", .metavar = "FILE",
   .help = "Write the bound metrics port number (and a newline) to this file, atomically."},
  {.dash = "max-key-bytes", .metavar = "N", .help = "Largest key accepted.", .default_text = "65536"},
  {.dash = "max-value-bytes", .metavar = "N", .help = "Largest value accepted.", .default_text = "67108864"},
  {.dash = "max-keys-per-request", .metavar = "N", .help = "Most keys in one CHECK/WAIT/MULTI_GET/MULTI_SET.",
   .default_text = "131072"},
  {.dash = "max-connections", .metavar = "N", .help = "Most open client connections.", .default_text = "65536"},
  {.dash = "max-total-bytes", .metavar = "N", .help = "Most bytes of keys+values held.",
   .default_text = "4294967296"},
  {.dash = "max-keys", .metavar = "N", .help = "Most keys plus queued items held.", .default_text = "4194304"},
  {.dash = "max-waits", .metavar = "N", .help = "Most WAIT/BARRIER/WATCH_KEY registrations held.",
   .default_text = "1048576"},
  {.dash = "max-queued-reply-bytes", .metavar = "N",
   .help = "Most reply bytes queued for one connection; larger replies are refused.", .default_text = "134217728"},
  {.dash = "max-buffered-bytes", .metavar = "N",
   .help = "Most bytes in all connections' read buffers and queued replies together.",
   .default_text = "1073741824"},
  {.dash = "max-connections-per-peer", .metavar = "N", .help = "Most connections from one peer address (0 = no cap).",
   .default_text = "4096"},
  {.dash = "max-relayed-connections", .metavar = "N",
   .help = "Most client connections carried by relays (ddprun-rdzvd --relay-to), over all relays.",
   .default_text = "1048576"},
  {.dash = "frame-timeout-ms", .metavar = "MS",
   .help = "Close a connection holding an incomplete request this long (0 = never).", .default_text = "30000"},
  {.dash = "idle-timeout-ms", .metavar = "MS",
   .help = "Close a connection silent this long and not waiting (0 = never; torch clients idle for a whole job).",
   .default_text = "0"},
  {.dash = "handshake-timeout-ms", .metavar = "MS",
   .help = "With a token (and no --allow-unauthenticated-store): close a connection that has not authenticated this long "
           "after connecting (0 = never). At --max-connections the oldest such connection always gives way.",
   .default_text = "10000"},
  {.dash = "link-stall-timeout-ms", .metavar = "MS",
   .help = "Close a relay link whose other end has read none of the bytes waiting for it this long (0 = never): the "
           "daemon then ends the connections the relay carried, a relay links again.",
   .default_text = "60000"},
  {.dash = "reply-stall-timeout-ms", .metavar = "MS",
   .help = "Close a client connection that has read none of the replies waiting for it this long, with the kernel's "
           "buffers full (0 = never); one that reads slowly is never closed.",
   .default_text = "60000"},
  {.dash = "token", .metavar = "TOKEN", .help = "Refused: use --token-file or DDPRUN_RDZV_TOKEN.", .hidden = true},
  {.dash = "token-file", .metavar = "FILE",
   .help = "Shared secret every client must prove in the handshake, read from this file (one trailing newline is "
           "dropped), e.g. a systemd credential.",
   .default_text = "$DDPRUN_RDZV_TOKEN; empty = none"},
  {.dash = "previous-token-file", .metavar = "FILE",
   .help = "With --token-file: a token rotated out, still accepted from connections bound to one job to re-register "
           "its nodes (REJOIN: the agents of jobs started before the rotation, after a reconnect or a daemon restart), "
           "never for a new node's JOIN, a relay or every job's status. Re-read on SIGHUP with --token-file; a missing "
           "or empty file then means none."},
  {.dash = "previous-token-window", .metavar = "SECONDS",
   .help = "With --previous-token-file: for this long after the start a node the daemon does not know may re-register "
           "with the previous token (a restart forgot every node); later only nodes it knows.",
   .default_text = "60"},
  {.dash = "allow-unauthenticated-store", .kind = FlagKind::boolean,
   .help = "With a token: let clients that did not authenticate use TCPStore ops (torchrun's c10d backend cannot "
           "authenticate). RISK: anyone who reaches the port can then read and delete every key."},
  {.dash = "max-rdzv-payload-bytes", .metavar = "N", .help = "Largest native rendezvous message accepted.",
   .default_text = "1048576"},
  {.dash = "job-expiry", .metavar = "SECONDS",
   .help = "Forget a job this many seconds after it last had a live member (every node left, was lost or "
           "finished), whatever timeouts its clients chose; 0 = never.",
   .default_text = "600"},
  {.dash = "max-jobs", .metavar = "N", .help = "Most jobs held at once; a JOIN that would start one more is refused "
                                               "(0 = no cap).",
   .default_text = "100000"},
  {.dash = "max-members", .metavar = "N",
   .help = "Most members of all jobs together (nodes joined, and nodes whose connection closed within their "
           "heartbeat interval); a JOIN that would add one more is refused (0 = no cap).",
   .default_text = "262144"},
  {.dash = "max-member-bytes", .metavar = "BYTES",
   .help = "Most bytes members of all jobs together may make the daemon hold (1 KiB each, plus the names "
           "they announce and the NCCL unique IDs kept for them); a JOIN past it is refused (0 = no cap).",
   .default_text = "2147483648"},
  {.dash = "log-level", .metavar = "LEVEL", .help = "trace|debug|info|warning|error|critical|off.",
   .default_text = "$DDPRUN_LOG_LEVEL, else $LOGLEVEL, else info", .choices = kLogLevels},
  {.dash = "log-format", .metavar = "FORMAT",
   .help = "text|json (json: one object per line, for log shippers).", .default_text = "$DDPRUN_LOG_FORMAT, else text",
   .choices = kLogFormats},
  {.dash = "relay-to", .metavar = "HOST:PORT",
   .help = "Run as a relay: accept clients here and carry their connections to the daemon at HOST:PORT over one "
           "link (needs the daemon's token)."},
  {.dash = "relink-timeout", .metavar = "SECONDS",
   .help = "Relay only: how long to keep trying to link to the daemon, at start and after losing the link, "
           "before exiting 1 (0 exits at once).", .default_text = "60"},
  {.dash = "version", .kind = FlagKind::boolean, .help = "Display program version information and exit."},
};
// clang-format on
#pragma GCC diagnostic pop

}  // namespace

std::span<const FlagSpec> rdzvd_flags() { return kFlags; }

}  // namespace ddprun::rdzvd
