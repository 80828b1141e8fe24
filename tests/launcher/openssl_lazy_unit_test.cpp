// The lazy OpenSSL trampolines (rendezvous/openssl/lazy/openssl_lazy.cpp), linked the way
// bin/ddprun links them (DDPRUN_LAZY_OPENSSL on this test executable): an OpenSSL function
// called before anything loaded OpenSSL loads it from inside the trampoline and returns the
// right answer, arguments in registers and on the stack intact (HMAC takes seven).
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <string>

#include "ddprun/rendezvous/openssl_runtime.hpp"
#include "ddprun/rendezvous/rendezvous_auth.hpp"

namespace {

std::string hex(const unsigned char* p, unsigned n) {
  std::string out;
  char b[3];
  for (unsigned i = 0; i < n; ++i) {
    std::snprintf(b, sizeof b, "%02x", p[i]);
    out += b;
  }
  return out;
}

}  // namespace

TEST_CASE("an OpenSSL call before require_openssl loads OpenSSL in the trampoline") {
  // Nothing in this process has touched OpenSSL yet (one test case per process: ctest runs the
  // executable once; Catch runs the cases in declaration order).
  REQUIRE(ddprun::rendezvous::openssl_deferred());
  // Node secrets are compared also in jobs without a token: that comparison needs no OpenSSL.
  CHECK(ddprun::rendezvous::auth::equal_secret("abc", "abc"));
  CHECK_FALSE(ddprun::rendezvous::auth::equal_secret("abc", "abd"));
  CHECK_FALSE(ddprun::rendezvous::auth::equal_secret("abc", "ab"));
  REQUIRE(ddprun::rendezvous::openssl_deferred());
  // RFC 4231, test case 2.
  const std::string key = "Jefe";
  const std::string data = "what do ya want for nothing?";
  unsigned char out[EVP_MAX_MD_SIZE] = {};
  unsigned len = 0;
  const unsigned char* r = HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
                                reinterpret_cast<const unsigned char*>(data.data()), data.size(), out, &len);
  REQUIRE(r == out);
  CHECK(hex(out, len) == "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  CHECK_FALSE(ddprun::rendezvous::openssl_deferred());
  // And through ddprun's own wrappers, after loading.
  CHECK(ddprun::rendezvous::auth::hmac_sha256_hex(key, data) ==
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  REQUIRE_NOTHROW(ddprun::rendezvous::require_openssl("a test"));
}
