#include "ddprun/common/endpoint.hpp"

#include <arpa/inet.h>

#include <string>

#include "ddprun/common/error.hpp"
#include "ddprun/common/strings.hpp"

namespace ddprun {

std::string bracket_host(std::string_view host) {
  if (host.find(':') != std::string_view::npos && !starts_with(host, "[")) {
    std::string out;
    out.reserve(host.size() + 2);
    out.push_back('[');
    out.append(host);
    out.push_back(']');
    return out;
  }
  return std::string(host);
}

std::string Endpoint::to_string() const { return bracket_host(host) + ":" + std::to_string(port); }

std::optional<std::uint16_t> parse_port(std::string_view text) {
  auto v = parse_int(text);
  if (!v || *v < 0 || *v > 65535 || text.front() == '-' || text.front() == '+') return std::nullopt;
  return static_cast<std::uint16_t>(*v);
}

bool is_ipv6_address(std::string_view text) {
  const auto pct = text.find('%');
  const std::string addr(text.substr(0, pct));
  if (addr.empty() || addr.size() > 45) return false;
  if (pct != std::string_view::npos && (pct + 1 == text.size() || text.find(':', pct) != std::string_view::npos)) {
    return false;  // an empty zone, or one with a colon
  }
  in6_addr a{};
  return ::inet_pton(AF_INET6, addr.c_str(), &a) == 1;
}

Endpoint parse_endpoint(std::string_view text, std::uint16_t default_port, std::string_view what) {
  const std::string forms = "accepted forms: HOST, HOST:PORT, [IPV6], [IPV6]:PORT with PORT in 0..65535";
  auto fail = [&](const std::string& why) -> Endpoint {
    throw UsageError(std::string(what) + "='" + terminal_safe(text) + "': " + why, forms);
  };
  const std::string_view t = trim(text);
  if (t.empty()) return fail("empty endpoint");
  Endpoint ep;
  ep.port = default_port;
  if (t.front() == '[') {
    const auto close = t.find(']');
    if (close == std::string_view::npos) return fail("missing ']' after IPv6 address");
    ep.host = std::string(t.substr(1, close - 1));
    std::string_view rest = t.substr(close + 1);
    if (!rest.empty()) {
      if (rest.front() != ':') return fail("unexpected text after ']'");
      auto p = parse_port(rest.substr(1));
      if (!p) return fail("invalid port '" + terminal_safe(rest.substr(1)) + "'");
      ep.port = *p;
    }
  } else {
    const auto first = t.find(':');
    const auto last = t.rfind(':');
    if (first != last) {
      // Several colons: an IPv6 address, without brackets. torchrun reads the text after the last
      // colon as a port (::1:29400 is [::1]:29400); an address whose last group is a number reads
      // both ways, and anything else is neither.
      const std::string_view before = t.substr(0, last);
      const auto port = parse_port(t.substr(last + 1));
      const bool whole = is_ipv6_address(t);
      const bool with_port = port && is_ipv6_address(before);
      if (whole && with_port) {
        return fail("an IPv6 address whose last group may be a port: write [" + terminal_safe(before) +
                    "]:" + std::to_string(*port) + " or [" + terminal_safe(t) + "]");
      }
      if (whole) {
        ep.host = std::string(t);
      } else if (with_port) {
        ep.host = std::string(before);
        ep.port = *port;
      } else {
        return fail("not a host or HOST:PORT (a host has no ':' and an IPv6 address goes in brackets)");
      }
    } else if (first != std::string_view::npos) {
      ep.host = std::string(t.substr(0, first));
      auto p = parse_port(t.substr(first + 1));
      if (!p) return fail("invalid port '" + terminal_safe(t.substr(first + 1)) + "'");
      ep.port = *p;
    } else {
      ep.host = std::string(t);
    }
  }
  if (ep.host.empty()) return fail("empty host");
  // What a resolver or a "host:port" text can carry: no blank, control character or bracket
  // (a host that cannot be written back as an endpoint, or that getaddrinfo reads cut at a NUL).
  for (const char c : ep.host) {
    const auto u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u == 0x7f || c == '[' || c == ']' || c == ',') {
      return fail(
          "host '" + terminal_safe(ep.host) + "' holds " +
          (c == '[' || c == ']' || c == ',' ? "'" + std::string(1, c) + "'" : "a blank or a control character"));
    }
  }
  return ep;
}

std::vector<Endpoint> parse_endpoint_list(std::string_view text, std::uint16_t default_port, std::string_view what) {
  std::vector<Endpoint> out;
  std::size_t begin = 0;
  for (;;) {
    const auto comma = text.find(',', begin);
    const std::string_view item = text.substr(begin, comma == std::string_view::npos ? comma : comma - begin);
    if (trim(item).empty() && (comma != std::string_view::npos || !out.empty())) {
      throw UsageError(std::string(what) + "='" + terminal_safe(text) + "': an empty endpoint in the list",
                       "separate endpoints with single commas: HOST[:PORT],HOST[:PORT]");
    }
    out.push_back(parse_endpoint(item, default_port, what));
    if (comma == std::string_view::npos) return out;
    begin = comma + 1;
  }
}

std::string endpoint_list_text(const std::vector<Endpoint>& list) {
  std::string out;
  for (const auto& e : list) out += (out.empty() ? "" : ",") + e.to_string();
  return out;
}

}  // namespace ddprun
