// Handshake cryptography (rendezvous_auth.hpp has the contract).
#include "ddprun/rendezvous/rendezvous_auth.hpp"

#include <openssl/core_names.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <sys/random.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <vector>

#include "ddprun/common/error.hpp"
#include "ddprun/rendezvous/openssl_runtime.hpp"

namespace ddprun::rendezvous::auth {

namespace {

constexpr char hex_digits[] = "0123456789abcdef";
constexpr const char* kAuthPurpose =
    "the rendezvous handshake with a token (DDPRUN_RDZV_TOKEN, --rdzv-conf token_file, --token-file)";

std::string to_hex(const unsigned char* p, std::size_t n) {
  std::string out(2 * n, '0');
  for (std::size_t i = 0; i < n; ++i) {
    out[2 * i] = hex_digits[p[i] >> 4];
    out[2 * i + 1] = hex_digits[p[i] & 0xf];
  }
  return out;
}

std::string mac(std::string_view token, std::string_view label, std::string_view a, std::string_view b,
                std::string_view run_id) {
  std::string message;
  message.reserve(label.size() + 1 + a.size() + b.size() + run_id.size());
  message.append(label);
  message.push_back('\0');
  message.append(a);
  message.append(b);
  message.append(run_id);
  return hmac_sha256_hex(token, message);
}

}  // namespace

// Random bytes are taken from a per-thread pool filled by one getrandom(2) of 4 KiB: a daemon
// makes a nonce per connection and a secret per node, and a system call each was ~3 % of the
// root's CPU at 100,000 agents. Bytes handed out are wiped from the pool at once, and a forked
// child empties its copy before it can use it (pthread_atfork), so no two processes share one.
namespace {

void fill_random(unsigned char* out, std::size_t n) {
  std::size_t got = 0;
  while (got < n) {
    const ssize_t r = ::getrandom(out + got, n - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      throw Error(std::string("getrandom failed: ") + std::strerror(errno));
    }
    got += static_cast<std::size_t>(r);
  }
}

struct RandomPool {
  std::array<unsigned char, 4096> bytes{};
  std::size_t next = sizeof bytes;  // bytes[next..] are unused; empty at first

  ~RandomPool() { clear(); }
  void fill() {
    fill_random(bytes.data(), bytes.size());
    next = 0;
  }
  void clear() {
    explicit_bzero(bytes.data(), bytes.size());
    next = bytes.size();
  }
};

thread_local RandomPool random_pool;

void empty_pool_in_child() { random_pool.clear(); }

void take_random(unsigned char* out, std::size_t n) {
  // Without the fork handler a child could hand out its parent's next bytes: no pool then.
  static const bool pooled = pthread_atfork(nullptr, nullptr, empty_pool_in_child) == 0;
  if (!pooled) {
    fill_random(out, n);
    return;
  }
  while (n > 0) {
    if (random_pool.next == random_pool.bytes.size()) random_pool.fill();
    const std::size_t k = std::min(n, random_pool.bytes.size() - random_pool.next);
    unsigned char* from = random_pool.bytes.data() + random_pool.next;
    std::memcpy(out, from, k);
    explicit_bzero(from, k);
    random_pool.next += k;
    out += k;
    n -= k;
  }
}

}  // namespace

std::string random_hex(std::size_t n) {
  std::vector<unsigned char> bytes(n);
  take_random(bytes.data(), n);
  std::string hex = to_hex(bytes.data(), n);
  explicit_bzero(bytes.data(), n);
  return hex;
}

void require_crypto() { require_openssl(kAuthPurpose); }

namespace {

// One HMAC-SHA256 context per thread, keyed once: re-initialised with the same key for each
// message (EVP_MAC_init with no key keeps it). The one-shot HMAC() fetched the algorithm and
// built a context on every call: 1.2 us against 0.3 us here, and the daemon makes two MACs per
// connection (the bench's agents two more).
struct HmacContext {
  EVP_MAC* mac = nullptr;
  EVP_MAC_CTX* ctx = nullptr;
  std::string key;  // what ctx is keyed with (the token, which the caller holds anyway)
  bool keyed = false;

  ~HmacContext() {
    if (ctx != nullptr) EVP_MAC_CTX_free(ctx);
    if (mac != nullptr) EVP_MAC_free(mac);
    if (!key.empty()) explicit_bzero(key.data(), key.size());
  }

  EVP_MAC_CTX* for_key(std::string_view k) {
    if (ctx == nullptr) {
      if (mac == nullptr) mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
      if (mac == nullptr) throw Error("HMAC-SHA256 failed (OpenSSL has no HMAC)");
      ctx = EVP_MAC_CTX_new(mac);
      if (ctx == nullptr) throw Error("HMAC-SHA256 failed (OpenSSL)");
    }
    if (keyed && k == key) {
      if (EVP_MAC_init(ctx, nullptr, 0, nullptr) == 1) return ctx;
      keyed = false;  // keyed afresh next time
      throw Error("HMAC-SHA256 failed (OpenSSL)");
    }
    keyed = false;
    char digest[] = "SHA256";
    OSSL_PARAM params[2] = {
        {OSSL_MAC_PARAM_DIGEST, OSSL_PARAM_UTF8_STRING, digest, sizeof digest - 1, OSSL_PARAM_UNMODIFIED},
        {nullptr, 0, nullptr, 0, 0}};
    // A zero-length key is a valid HMAC key; OpenSSL wants a non-null pointer for it.
    static const unsigned char no_key = 0;
    const auto* key_bytes = k.empty() ? &no_key : reinterpret_cast<const unsigned char*>(k.data());
    if (EVP_MAC_init(ctx, key_bytes, k.size(), params) != 1) throw Error("HMAC-SHA256 failed (OpenSSL)");
    if (!key.empty()) explicit_bzero(key.data(), key.size());
    key.assign(k);
    keyed = true;
    return ctx;
  }
};

thread_local HmacContext hmac_context;

}  // namespace

std::string hmac_sha256_hex(std::string_view key, std::string_view message) {
  require_openssl(kAuthPurpose);
  EVP_MAC_CTX* ctx = hmac_context.for_key(key);
  std::array<unsigned char, EVP_MAX_MD_SIZE> out{};
  std::size_t len = 0;
  if (EVP_MAC_update(ctx, reinterpret_cast<const unsigned char*>(message.data()), message.size()) != 1 ||
      EVP_MAC_final(ctx, out.data(), &len, out.size()) != 1) {
    hmac_context.keyed = false;
    throw Error("HMAC-SHA256 failed (OpenSSL)");
  }
  return to_hex(out.data(), len);
}

std::string client_mac(std::string_view token, std::string_view server_nonce, std::string_view client_nonce,
                       std::string_view run_id) {
  return mac(token, "ddprun-rdzv-client-v1", server_nonce, client_nonce, run_id);
}

std::string server_mac(std::string_view token, std::string_view client_nonce, std::string_view server_nonce,
                       std::string_view run_id) {
  return mac(token, "ddprun-rdzv-server-v1", client_nonce, server_nonce, run_id);
}

bool equal_secret(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  // Every byte is looked at whatever differs; the volatile accumulator keeps the compiler from
  // stopping early.
  volatile unsigned char diff = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff = static_cast<unsigned char>(diff | (static_cast<unsigned char>(a[i]) ^ static_cast<unsigned char>(b[i])));
  }
  return diff == 0;
}

bool is_hex_of(std::string_view text, std::size_t bytes) {
  if (text.size() != 2 * bytes) return false;
  for (char c : text) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

}  // namespace ddprun::rendezvous::auth
