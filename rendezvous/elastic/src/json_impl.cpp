// Boost.JSON is header-only when exactly one translation unit includes its sources. This is that
// unit for every ddprun library: the rendezvous wire codec uses Boost.JSON, and the agent (which
// links ddprun::rendezvous) does too.
#include <boost/json/src.hpp>
