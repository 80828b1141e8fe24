// Boost.JSON is header-only when exactly one translation unit includes its sources.
// (If another ddprun library ever needs Boost.JSON, move this file to common/.)
#include <boost/json/src.hpp>
