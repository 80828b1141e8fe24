#pragma once
// OpenSSL at run time: what the etcd backend's TLS and the rendezvous handshake's HMAC-SHA256
// need. Every binary but bin/ddprun links OpenSSL as usual. bin/ddprun (x86-64, the CMake
// option DDPRUN_LAZY_OPENSSL) loads libcrypto.so.3 and libssl.so.3 with dlopen the first time
// one of those features is used, so a launch that uses neither (every single-node job, every
// job without a token or TLS) never maps them: their relocations and their CPU-probing
// constructor cost ~0.3 ms of each launch (docs/performance.md), and the system's OpenSSL
// security updates reach ddprun without a rebuild.
#include <string_view>

namespace ddprun::rendezvous {

// Makes OpenSSL's functions callable. A no-op where OpenSSL is linked; in bin/ddprun it loads
// the libraries (once; thread-safe) and throws ddprun::Error naming `purpose`, the library and
// what to install when they cannot be loaded. Call it before the first OpenSSL function of a
// feature; a call without it loads on demand too, but can only abort on failure.
void require_openssl(std::string_view purpose);

// True when this binary loads OpenSSL on demand and has not loaded it yet (for tests and
// diagnostics; false where OpenSSL is linked).
bool openssl_deferred();

}  // namespace ddprun::rendezvous
