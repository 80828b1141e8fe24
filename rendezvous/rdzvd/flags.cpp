#include "flags.hpp"

namespace ddprun::rdzvd {
namespace {

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
  {.dash = "metrics-port", .metavar = "PORT",
   .help = "Serve Prometheus metrics on GET /metrics over HTTP at this port (on --host); 0 picks a free one."},
  {.dash = "metrics-port-file", .metavar = "FILE",
   .help = "Write the bound metrics port number (and a newline) to this file, atomically."},
  {.dash = "max-key-bytes", .metavar = "N", .help = "Largest key accepted.", .default_text = "65536"},
  {.dash = "max-value-bytes", .metavar = "N", .help = "Largest value accepted.", .default_text = "67108864"},
  {.dash = "max-keys-per-request", .metavar = "N", .help = "Most keys in one CHECK/WAIT/MULTI_GET/MULTI_SET.",
   .default_text = "131072"},
  {.dash = "max-connections", .metavar = "N", .help = "Most open client connections.", .default_text = "65536"},
  {.dash = "max-total-bytes", .metavar = "N", .help = "Most bytes of keys+values held.",
   .default_text = "4294967296"},
  {.dash = "token", .metavar = "TOKEN", .help = "Shared secret every rendezvous join must carry.",
   .default_text = "$DDPRUN_RDZV_TOKEN; empty = none"},
  {.dash = "max-rdzv-payload-bytes", .metavar = "N", .help = "Largest native rendezvous message accepted.",
   .default_text = "1048576"},
  {.dash = "log-level", .metavar = "LEVEL", .help = "trace|debug|info|warning|error|critical|off.",
   .default_text = "$DDPRUN_LOG_LEVEL, else info", .choices = kLogLevels},
  {.dash = "version", .kind = FlagKind::boolean, .help = "Display program version information and exit."},
};
// clang-format on
#pragma GCC diagnostic pop

}  // namespace

std::span<const FlagSpec> rdzvd_flags() { return kFlags; }

}  // namespace ddprun::rdzvd
