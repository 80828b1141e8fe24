// OpenSSL linked into the binary: nothing to load (openssl_runtime.hpp).
#include "ddprun/rendezvous/openssl_runtime.hpp"

namespace ddprun::rendezvous {

void require_openssl(std::string_view) {}

bool openssl_deferred() { return false; }

}  // namespace ddprun::rendezvous
