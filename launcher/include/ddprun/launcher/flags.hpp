#pragma once
// ddprun's flag table: every flag of `ddprun [options] PROGRAM`, with its spellings, kind, scope,
// help, metavar, default and fixed value set (ddprun::FlagSpec, common/flag_spec.hpp). The
// parser, --help, the lists of flags each mode refuses, the flags the fan-out launcher forwards
// and generated documentation all read this one table. Static data; thread-safe.
#include <span>
#include <string_view>
#include <vector>

#include "ddprun/common/flag_spec.hpp"

namespace ddprun::launcher {

// Every flag, in --help order. `-h/--help` is CLI11's own and not listed.
std::span<const FlagSpec> launcher_flags();

// The row for a flag by its dash or underscore spelling (without "--"); nullptr when unknown.
const FlagSpec* find_launcher_flag(std::string_view name);

// The dash spellings of the flags in `scope`, in table order.
std::vector<std::string_view> launcher_flags_in(FlagScope scope);

}  // namespace ddprun::launcher
