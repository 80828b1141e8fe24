#include "ddprun/common/strings.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>

namespace ddprun {

std::vector<std::string> split(std::string_view text, char sep) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (true) {
    const std::size_t pos = text.find(sep, start);
    if (pos == std::string_view::npos) {
      out.emplace_back(text.substr(start));
      break;
    }
    out.emplace_back(text.substr(start, pos - start));
    start = pos + 1;
  }
  return out;
}

std::string_view trim(std::string_view text) {
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) text.remove_prefix(1);
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.remove_suffix(1);
  return text;
}

std::string to_lower(std::string_view text) {
  std::string out(text);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

bool starts_with(std::string_view text, std::string_view prefix) { return text.substr(0, prefix.size()) == prefix; }

std::optional<std::int64_t> parse_int(std::string_view text) {
  if (text.empty()) return std::nullopt;
  std::int64_t value = 0;
  const char* first = text.data();
  const char* last = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(first, last, value);
  if (ec != std::errc{} || ptr != last) return std::nullopt;
  return value;
}

std::optional<double> parse_seconds(std::string_view text) {
  // std::from_chars(double) would pull libstdc++'s floating_from_chars and with it libm into
  // bin/ddprun. The grammar is checked here, strtod converts (ddprun never changes the C locale,
  // so '.' is the decimal point): [-]digits[.digits][(e|E)[+|-]digits], at least one digit.
  if (text.empty() || text.size() > 64) return std::nullopt;
  std::size_t i = 0;
  auto digits = [&] {
    const std::size_t from = i;
    while (i < text.size() && text[i] >= '0' && text[i] <= '9') ++i;
    return i - from;
  };
  if (text[i] == '-') ++i;
  std::size_t mantissa = digits();
  if (i < text.size() && text[i] == '.') {
    ++i;
    mantissa += digits();
  }
  if (mantissa == 0) return std::nullopt;
  if (i < text.size() && (text[i] == 'e' || text[i] == 'E')) {
    ++i;
    if (i < text.size() && (text[i] == '+' || text[i] == '-')) ++i;
    if (digits() == 0) return std::nullopt;
  }
  if (i != text.size()) return std::nullopt;
  const std::string copy(text);
  char* end = nullptr;
  errno = 0;
  const double value = std::strtod(copy.c_str(), &end);
  // Overflow gives HUGE_VAL, never a duration; an underflow to zero ("1e-400") is out of range,
  // as std::from_chars says (a subnormal result is kept, as it keeps it); "-0" is 0.
  if (end != copy.c_str() + copy.size() || !std::isfinite(value) || value < 0) return std::nullopt;
  if (errno == ERANGE && value == 0) return std::nullopt;
  return value;
}

std::int64_t seconds_to_ms(double seconds) {
  if (!(seconds > 0)) return 0;
  if (seconds > 1e12) seconds = 1e12;
  return static_cast<std::int64_t>(seconds * 1000.0 + 0.5);
}

std::string_view utf8_prefix(std::string_view text, std::size_t max_bytes) {
  if (text.size() <= max_bytes) return text;
  std::size_t cut = max_bytes;
  // Back off continuation bytes (10xxxxxx) to the start of the character the cut falls in.
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0u) == 0x80u) --cut;
  return text.substr(0, cut);
}

std::string terminal_safe_prefix(std::string_view text, std::size_t max_bytes, bool escape_backslash) {
  const std::string_view cut = utf8_prefix(text, max_bytes);
  return terminal_safe(cut, escape_backslash) + (cut.size() < text.size() ? "..." : "");
}

std::string terminal_safe(std::string_view text, bool escape_backslash) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  auto escape = [&](const char* prefix, unsigned char c) {
    out += prefix;
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 0xF]);
  };
  auto byte = [&](std::size_t i) -> unsigned char { return i < text.size() ? static_cast<unsigned char>(text[i]) : 0; };
  for (std::size_t i = 0; i < text.size();) {
    const unsigned char c = byte(i);
    if (c < 0x80) {
      if (c < 0x20 || c == 0x7f) {
        escape("\\x", c);
      } else if (c == '\\' && escape_backslash) {
        out += "\\\\";
      } else {
        out.push_back(static_cast<char>(c));
      }
      ++i;
      continue;
    }
    // A well-formed UTF-8 sequence is kept, but for the C1 controls (U+0080..U+009F); any other
    // byte >= 0x80 is escaped: a lone 0x9b is CSI to a terminal reading Latin-1.
    std::size_t n = 0;
    unsigned char lo = 0x80, hi = 0xbf;  // the second byte's range
    if (c >= 0xc2 && c <= 0xdf) {
      n = 2;
    } else if (c >= 0xe0 && c <= 0xef) {
      n = 3;
      if (c == 0xe0) lo = 0xa0;
      if (c == 0xed) hi = 0x9f;
    } else if (c >= 0xf0 && c <= 0xf4) {
      n = 4;
      if (c == 0xf0) lo = 0x90;
      if (c == 0xf4) hi = 0x8f;
    }
    bool valid = n > 0 && i + n <= text.size() && byte(i + 1) >= lo && byte(i + 1) <= hi;
    for (std::size_t k = 2; valid && k < n; ++k) valid = byte(i + k) >= 0x80 && byte(i + k) <= 0xbf;
    if (!valid) {
      escape("\\x", c);
      ++i;
    } else if (n == 2 && c == 0xc2 && byte(i + 1) <= 0x9f) {
      escape("\\u00", byte(i + 1));
      i += 2;
    } else {
      out.append(text.substr(i, n));
      i += n;
    }
  }
  return out;
}

std::string to_hex(std::string_view bytes) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (const char ch : bytes) {
    const auto c = static_cast<unsigned char>(ch);
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 0xF]);
  }
  return out;
}

std::optional<std::string> from_hex(std::string_view hex) {
  if (hex.size() % 2 != 0) return std::nullopt;
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out;
  out.reserve(hex.size() / 2);
  for (std::size_t i = 0; i < hex.size(); i += 2) {
    const int hi = nibble(hex[i]);
    const int lo = nibble(hex[i + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    out.push_back(static_cast<char>((hi << 4) | lo));
  }
  return out;
}

}  // namespace ddprun
