#pragma once
// JSON from the network parsed in bounded memory. Boost.JSON's DOM inflates text of many tiny
// values (`[0,0,...]`, `[[],[],...]`, `{"a":{},...}`) to ~17x its size, and json::parse keeps the
// parser's value stack on the default allocator, uncounted. Here the DOM and the stack draw from
// one resource capped at `cap_bytes`: past it the parse stops with an error instead of taking
// gigabytes. Users: the native rendezvous frames (rendezvous_wire) and the etcd client's replies.
#include <boost/json/value.hpp>
#include <cstddef>
#include <string>
#include <string_view>

namespace ddprun::rendezvous {

// What decoding one message may take (its DOM and the parser's stack), as a multiple of its size,
// with a floor for small messages. Real messages need far less: a STATUS_REPLY of 100,000 members
// takes 2.8x (host names of 40 bytes, a 29 MB reply) to 3.5x (names of 1 byte, 21 MB), an etcd
// range reply of 20,000 small keys and values 3.3x, a JOIN 3.3x, measured with a counting resource.
inline constexpr std::size_t json_dom_bytes_per_payload_byte = 6;
inline constexpr std::size_t json_dom_min_cap_bytes = std::size_t{1} << 20;
inline constexpr std::size_t json_dom_cap_bytes(std::size_t payload_bytes) {
  return payload_bytes * json_dom_bytes_per_payload_byte > json_dom_min_cap_bytes
             ? payload_bytes * json_dom_bytes_per_payload_byte
             : json_dom_min_cap_bytes;
}

struct CappedJson {
  boost::json::value value;  // null on error; its storage is the capped resource (kept alive by it)
  // Set when the cap stopped the parse: "a payload of N bytes would take more than M MiB to
  // decode, the limit for its size (JSON of many tiny values)".
  std::string over_cap;
  std::string invalid;  // set when the text is not JSON (or nests deeper): the parser's words
  bool ok() const { return over_cap.empty() && invalid.empty(); }
};

// Parses `text` with nesting at most `max_depth`, the DOM and the parser's stack together under
// json_dom_cap_bytes(text.size()).
CappedJson parse_json_capped(std::string_view text, std::size_t max_depth);

}  // namespace ddprun::rendezvous
