#pragma once
// The one byte module of rendezvous/: every encoder and decoder of the TCPStore codec, the
// store client and the native rendezvous frames writes and reads its integers through here.
//
// Encodings: little-endian unsigned/signed integers of 1, 4 and 8 bytes, and length-prefixed
// strings (u64 LE length + raw bytes). put_* append to a std::string; load_le reads a value
// from a byte pointer the caller has checked is long enough; store_le overwrites bytes already
// in a buffer (a length field patched once the body is known). Pure, no I/O, no allocation
// beyond the appended bytes.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

namespace ddprun::rendezvous::bytes {

// Writes `v` little-endian into dst[0 .. sizeof(T)).
template <class T>
inline void store_le(char* dst, T v) {
  static_assert(std::is_integral_v<T>);
  for (std::size_t i = 0; i < sizeof(T); ++i) {
    dst[i] = static_cast<char>((static_cast<std::uint64_t>(v) >> (8 * i)) & 0xFFu);
  }
}

// Reads a little-endian T from src[0 .. sizeof(T)).
template <class T>
inline T load_le(const char* src) {
  static_assert(std::is_integral_v<T>);
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) {
    v |= static_cast<std::uint64_t>(static_cast<unsigned char>(src[i])) << (8 * i);
  }
  return static_cast<T>(v);
}

template <class T>
inline void put_le(std::string& out, T v) {
  char buf[sizeof(T)];
  store_le(buf, v);
  out.append(buf, sizeof(T));
}

inline void put_u8(std::string& out, std::uint8_t v) { out.push_back(static_cast<char>(v)); }
inline void put_u32(std::string& out, std::uint32_t v) { put_le(out, v); }
inline void put_u64(std::string& out, std::uint64_t v) { put_le(out, v); }
inline void put_i64(std::string& out, std::int64_t v) { put_le(out, v); }

// Length-prefixed string whose bytes are `prefix` followed by `s` (the store client's key
// prefix, without building the concatenation first).
inline void put_str(std::string& out, std::string_view s, std::string_view prefix = {}) {
  put_u64(out, prefix.size() + s.size());
  out.append(prefix.data(), prefix.size());
  out.append(s.data(), s.size());
}

}  // namespace ddprun::rendezvous::bytes
