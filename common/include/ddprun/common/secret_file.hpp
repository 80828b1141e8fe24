#pragma once
// Reading a secret (a rendezvous token) from a file, the way services receive secrets: a systemd
// credential ($CREDENTIALS_DIRECTORY/...), a Kubernetes secret volume, a 0600 file an admin wrote.
// Exactly one trailing newline ("\n" or "\r\n") is removed, since editors and `echo` add one; all
// other bytes are the secret. The secret itself never appears in an error or warning.
// Stateless; safe from any thread.
#include <string>

namespace ddprun {

struct SecretFile {
  std::string secret;
  std::string warning;  // non-empty when the file is readable by every user (the secret is still used)
};

// Throws ddprun::Error naming `flag` and `path` when the file cannot be opened or read, is not a
// regular file, is larger than 64 KiB, or holds nothing but a newline.
SecretFile read_secret_file(const std::string& path, const std::string& flag);

}  // namespace ddprun
