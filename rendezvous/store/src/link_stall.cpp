// Relay link stall clock (link_stall.hpp has the contract).
#include "ddprun/rendezvous/link_stall.hpp"

#include <linux/sockios.h>
#include <sys/ioctl.h>

#include <algorithm>

namespace ddprun::rendezvous {

std::chrono::milliseconds LinkStallClock::check_period(std::chrono::milliseconds timeout) {
  using std::chrono::milliseconds;
  return std::clamp(timeout / 4, milliseconds(5), milliseconds(1000));
}

LinkStallClock::Clock::duration LinkStallClock::quiet(int fd, bool in_flight, Clock::time_point now,
                                                      std::chrono::milliseconds timeout) {
  const bool late = last_check_ != Clock::time_point{} && now - last_check_ > timeout / 2;
  const Clock::time_point previous_check = last_check_;
  last_check_ = now;
  if (late) progress_ = now;
  if (!in_flight) return Clock::duration::zero();
  int unacked = 0;
  if (::ioctl(fd, SIOCOUTQ, &unacked) == 0 && unacked != unacked_) {
    unacked_ = unacked;
    // Acknowledged at some time since the last check.
    progress_ = std::max(progress_, previous_check);
  }
  return now - progress_;
}

}  // namespace ddprun::rendezvous
