// `ddprun status`: the network round trip (rendezvous::query_status) and printing.
#include <ostream>

#include "ddprun/launcher/status_command.hpp"
#include "ddprun/rendezvous/rendezvous_client.hpp"

namespace ddprun::launcher {

int run_status(const StatusRequest& request, std::ostream& out) {
  const auto status = rendezvous::query_status(request.server, request.run_id, request.timeout, request.token);
  out << format_status(status, request.server.to_string(), request.run_id);
  return (!request.run_id.empty() && status.jobs.empty()) ? 1 : 0;
}

}  // namespace ddprun::launcher
