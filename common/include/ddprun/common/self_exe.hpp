#pragma once
// Programs installed beside the running binary (ddprun-nccl-id, and ddprun-watchdog in the build
// and the wheel): `bin/` of the build, `/usr/bin` of the .deb, `_bin/` of the wheel; helpers that
// are not commands are installed in `<libexecdir>/ddprun` (the .deb's /usr/libexec/ddprun).
#include <string>
#include <string_view>

namespace ddprun {

// The absolute path of `name` in the directory of this process's executable (/proc/self/exe);
// empty when that cannot be read. Whether the file exists is the caller's question.
std::string beside_this_binary(std::string_view name);

// A helper program: beside this binary when it is there (the build, the wheel), else in the
// installed `<libexecdir>/ddprun` next to this binary's `<bindir>` (the .deb) when that is a
// trusted_path, else the path beside this binary (for messages). Empty when /proc/self/exe
// cannot be read.
std::string installed_helper(std::string_view name);

// Whether `path` (symbolic links resolved) and every directory above it are owned by root or by
// this process's user and writable by no one else, a sticky directory (/tmp) above it excepted.
bool trusted_path(const std::string& path);

}  // namespace ddprun
