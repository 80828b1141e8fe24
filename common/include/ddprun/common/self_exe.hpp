#pragma once
// Programs installed beside the running binary (ddprun-nccl-id, ddprun-watchdog): `bin/` of the
// build, `/usr/bin` of the .deb, `_bin/` of the wheel.
#include <string>
#include <string_view>

namespace ddprun {

// The absolute path of `name` in the directory of this process's executable (/proc/self/exe);
// empty when that cannot be read. Whether the file exists is the caller's question.
std::string beside_this_binary(std::string_view name);

}  // namespace ddprun
