#pragma once
// ddprun-rdzvd's flag table (ddprun::FlagSpec rows, common/flag_spec.hpp): names, metavars, help
// and defaults of every daemon flag, in --help order. The man page ddprun-rdzvd(8) and the
// shell completions are generated from it (launcher/tools/gen_docs.cpp). The daemon's flags
// have only their dash spelling and no PET_* form. Static data; thread-safe.
#include <span>

#include "ddprun/common/flag_spec.hpp"

namespace ddprun::rdzvd {

std::span<const FlagSpec> rdzvd_flags();

}  // namespace ddprun::rdzvd
