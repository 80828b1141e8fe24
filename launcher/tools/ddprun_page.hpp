#pragma once
// The documentation page of `ddprun` (its flags, the `status` subcommand and the man page's
// sections), shared by gen_docs, which renders the man page and the shell completions at build
// time, and by `ddprun --print-completion`, which renders a completion script on request.
#include "flag_docs.hpp"

namespace ddprun::docs {

PageDoc ddprun_page();

}  // namespace ddprun::docs
