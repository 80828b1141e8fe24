#pragma once
// Primitive encodings of the TCPStore wire: little-endian u8/u32/i64/u64 and
// length-prefixed strings (u64 LE length + raw bytes). Pure, no I/O.
//
// WireReader reads from a byte span without copying and reports "incomplete" (nullopt)
// when the span ends mid-field, so a server can parse incrementally: keep the bytes, wait
// for more, retry from the message start. Limit violations are reported separately so a
// connection can be closed as soon as a bogus length is seen, before its body arrives.
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

namespace ddprun::rendezvous::wire {

inline void put_u8(std::string& out, std::uint8_t v) { out.push_back(static_cast<char>(v)); }

template <class T>
inline void put_le(std::string& out, T v) {
  static_assert(std::is_integral_v<T>);
  char buf[sizeof(T)];
  for (std::size_t i = 0; i < sizeof(T); ++i) {
    buf[i] = static_cast<char>((static_cast<std::uint64_t>(v) >> (8 * i)) & 0xFF);
  }
  out.append(buf, sizeof(T));
}

inline void put_u32(std::string& out, std::uint32_t v) { put_le(out, v); }
inline void put_u64(std::string& out, std::uint64_t v) { put_le(out, v); }
inline void put_i64(std::string& out, std::int64_t v) { put_le(out, v); }
inline void put_str(std::string& out, std::string_view s) {
  put_u64(out, s.size());
  out.append(s.data(), s.size());
}

enum class ReadStatus { ok, incomplete, too_large };

class WireReader {
 public:
  explicit WireReader(std::string_view data) : data_(data) {}

  std::size_t consumed() const { return pos_; }
  std::size_t remaining() const { return data_.size() - pos_; }

  std::optional<std::uint8_t> u8() {
    if (remaining() < 1) return std::nullopt;
    return static_cast<std::uint8_t>(data_[pos_++]);
  }
  std::optional<std::uint32_t> u32() { return le<std::uint32_t>(); }
  std::optional<std::uint64_t> u64() { return le<std::uint64_t>(); }
  std::optional<std::int64_t> i64() {
    auto v = le<std::uint64_t>();
    if (!v) return std::nullopt;
    return static_cast<std::int64_t>(*v);
  }

  // Reads a length-prefixed string of at most `max_len` bytes into `out`.
  ReadStatus str(std::string_view& out, std::uint64_t max_len) {
    if (remaining() < 8) return ReadStatus::incomplete;
    const std::size_t save = pos_;
    const std::uint64_t len = *le<std::uint64_t>();
    if (len > max_len) return ReadStatus::too_large;
    if (remaining() < len) {
      pos_ = save;
      return ReadStatus::incomplete;
    }
    out = data_.substr(pos_, static_cast<std::size_t>(len));
    pos_ += static_cast<std::size_t>(len);
    return ReadStatus::ok;
  }

 private:
  template <class T>
  std::optional<T> le() {
    if (remaining() < sizeof(T)) return std::nullopt;
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < sizeof(T); ++i) {
      v |= static_cast<std::uint64_t>(static_cast<unsigned char>(data_[pos_ + i])) << (8 * i);
    }
    pos_ += sizeof(T);
    return static_cast<T>(v);
  }

  std::string_view data_;
  std::size_t pos_ = 0;
};

}  // namespace ddprun::rendezvous::wire
