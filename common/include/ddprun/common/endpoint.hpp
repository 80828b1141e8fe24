#pragma once
// Host/port endpoints as users write them: "host", "host:port", "1.2.3.4:29400",
// "[::1]:29400", "[fe80::1]". Pure parsing, no name resolution.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ddprun {

struct Endpoint {
  std::string host;  // without brackets
  std::uint16_t port = 0;

  // "host:port", with brackets around IPv6 literals.
  std::string to_string() const;
  bool operator==(const Endpoint&) const = default;
};

// Parses `text`; `default_port` is used when no port is given. Throws UsageError naming
// `what` (e.g. "--rdzv-endpoint") and the accepted forms on malformed input.
Endpoint parse_endpoint(std::string_view text, std::uint16_t default_port, std::string_view what);

// "A,B,..." of the forms above (at least one; no empty element), in order. Throws UsageError
// naming `what` like parse_endpoint.
std::vector<Endpoint> parse_endpoint_list(std::string_view text, std::uint16_t default_port, std::string_view what);

// "a:1,b:2": the list as parse_endpoint_list reads it.
std::string endpoint_list_text(const std::vector<Endpoint>& list);

// Parses a decimal port 0..65535; nullopt on anything else.
std::optional<std::uint16_t> parse_port(std::string_view text);

// An IPv6 address (inet_pton), with a zone allowed (fe80::1%eth0; the zone neither empty nor
// holding a ':').
bool is_ipv6_address(std::string_view text);

// Formats host for use in "host:port" (adds brackets to IPv6 literals).
std::string bracket_host(std::string_view host);

}  // namespace ddprun
