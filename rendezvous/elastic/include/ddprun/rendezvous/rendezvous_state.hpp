#pragma once
// The pure decisions of the elastic rendezvous, in one include: rendezvous_types.hpp (plain
// data and decisions), rendezvous_job.hpp (one job's state machine and its transition table)
// and rendezvous_registry.hpp (many jobs, deadline index, expiry and GC).
#include "ddprun/rendezvous/rendezvous_job.hpp"       // IWYU pragma: export
#include "ddprun/rendezvous/rendezvous_registry.hpp"  // IWYU pragma: export
#include "ddprun/rendezvous/rendezvous_types.hpp"     // IWYU pragma: export
