#pragma once
// The name a failure summary gives the job's program, as torchrun's _get_entrypoint_name does:
// for a Python worker the script (or -m module) as the user wrote it, not the interpreter
// ("train.py FAILED"); for any other program its path. Pure.
#include <string>

#include "ddprun/agent/config.hpp"

namespace ddprun::agent {

std::string entrypoint_name(const AgentConfig& config);

}  // namespace ddprun::agent
