#pragma once
// Small string utilities shared across folders (no I/O).
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ddprun {

std::vector<std::string> split(std::string_view text, char sep);
std::string_view trim(std::string_view text);
std::string to_lower(std::string_view text);
bool starts_with(std::string_view text, std::string_view prefix);
// Strict decimal integer parse of the whole string (optional leading '-'); nullopt otherwise.
std::optional<std::int64_t> parse_int(std::string_view text);
// Strict non-negative decimal double ("1", "0.5", "1e-3"; "30s", "+1", "0x10", "inf" are
// rejected); nullopt otherwise.
std::optional<double> parse_seconds(std::string_view text);
// A non-negative number of seconds (finite, at most 1e12) as whole milliseconds, rounded to
// nearest. Without libm: bin/ddprun does not load it (docs/performance.md).
std::int64_t seconds_to_ms(double seconds);
// Text from the network made safe for a terminal: C0 controls (newline and tab included), DEL,
// the C1 controls (UTF-8 C2 80..C2 9F) and every byte that is not part of well-formed UTF-8
// become \xNN / \u00NN, and a backslash "\\" (unless `escape_backslash` is false: a text
// quoted for people to read, where a backslash the text holds, such as Python's `\udcff` for a
// byte that is not UTF-8, should stay one); the rest, UTF-8 included, is kept. A peer cannot move
// the cursor, recolour or forge lines with it.
std::string terminal_safe(std::string_view text, bool escape_backslash = true);
// The longest prefix of `text` of at most `max_bytes` that does not end inside a UTF-8
// sequence: cutting well-formed UTF-8 with it keeps it well-formed (a JSON decoder rejects a
// cut character).
std::string_view utf8_prefix(std::string_view text, std::size_t max_bytes);
// A worker's or a peer's text for a log line or a report: at most `max_bytes` of it (utf8_prefix),
// terminal_safe, and "..." when it was cut.
std::string terminal_safe_prefix(std::string_view text, std::size_t max_bytes, bool escape_backslash = true);
// Lowercase hex of bytes.
std::string to_hex(std::string_view bytes);
// Inverse of to_hex; nullopt on odd length or non-hex characters.
std::optional<std::string> from_hex(std::string_view hex);

}  // namespace ddprun
