#include "ddprun/common/secret_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "ddprun/common/error.hpp"

namespace ddprun {

namespace {

constexpr std::size_t kMaxSecretBytes = 64 * 1024;

std::string mode_string(mode_t mode) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "%04o", static_cast<unsigned>(mode & 07777));
  return buf;
}

}  // namespace

SecretFile read_secret_file(const std::string& path, const std::string& flag) {
  const std::string where = flag + " '" + path + "'";
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) {
    const int err = errno;
    throw Error("cannot open " + where + ": " + std::strerror(err),
                err == EACCES ? "make it readable by the user the daemon runs as (under systemd, pass it "
                                "with LoadCredential= and read it from $CREDENTIALS_DIRECTORY)"
                              : "check the path; the file must hold the token");
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};

  struct stat st {};
  if (::fstat(fd, &st) != 0) throw Error("cannot stat " + where + ": " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) throw Error(where + " is not a regular file", "name the file that holds the token");
  if (static_cast<std::size_t>(st.st_size) > kMaxSecretBytes) {
    throw Error(where + " is " + std::to_string(st.st_size) + " bytes; a token file holds at most " +
                    std::to_string(kMaxSecretBytes),
                "check that it names the token file");
  }

  SecretFile result;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw Error("cannot read " + where + ": " + std::strerror(errno));
    if (n == 0) break;
    result.secret.append(buf, static_cast<std::size_t>(n));
    if (result.secret.size() > kMaxSecretBytes) {
      throw Error(where + " grew past " + std::to_string(kMaxSecretBytes) + " bytes while being read");
    }
  }
  if (result.secret.ends_with('\n')) {
    result.secret.pop_back();
    if (result.secret.ends_with('\r')) result.secret.pop_back();
  }
  if (result.secret.empty()) {
    throw Error(where + " is empty",
                "write the token into it (e.g. `head -c 32 /dev/urandom | base64 > FILE`), or leave out " + flag +
                    " to run without a token");
  }
  if ((st.st_mode & S_IROTH) != 0) {
    result.warning = where + " is readable by every user (mode " + mode_string(st.st_mode) +
                     "); anyone on this host can join jobs with it: chmod o-r it";
  }
  return result;
}

}  // namespace ddprun
