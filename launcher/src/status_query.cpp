// `ddprun status`: the network round trip (rendezvous::query_status) and printing.
#include <fstream>
#include <ostream>

#include "ddprun/launcher/status_command.hpp"
#include "ddprun/common/error.hpp"
#include "ddprun/rendezvous/etcd_rendezvous.hpp"
#include "ddprun/rendezvous/rendezvous_client.hpp"

namespace ddprun::launcher {

namespace {

int run_etcd_status(const StatusRequest& request, std::ostream& out) {
  const auto& e = *request.etcd;
  rendezvous::etcd::EtcdClientOptions opts;
  opts.endpoints = e.endpoints;
  opts.tls = e.tls;
  opts.cacert = e.cacert;
  opts.cert = e.cert;
  opts.key = e.key;
  opts.username = e.username;
  opts.password = e.password;
  if (!request.etcd_password_file.empty()) {
    std::ifstream in(request.etcd_password_file, std::ios::binary);
    std::getline(in, opts.password);
    if (!opts.password.empty() && opts.password.back() == '\r') opts.password.pop_back();
    if (!in && opts.password.empty()) {
      throw UsageError(request.etcd_conf_what + " key password_file=" + request.etcd_password_file +
                           ": cannot read the file",
                       "give a readable file holding the etcd password on its first line");
    }
  }
  const auto status = rendezvous::query_etcd_status(opts, e.prefix, request.run_id, request.timeout);
  std::string where;
  for (const auto& ep : e.endpoints) where += (where.empty() ? "" : ",") + ep.to_string();
  out << format_status(status, "etcd " + where, request.run_id);
  return (!request.run_id.empty() && status.jobs.empty()) ? 1 : 0;
}

}  // namespace

int run_status(const StatusRequest& request, std::ostream& out) {
  if (request.etcd) return run_etcd_status(request, out);
  const auto status = rendezvous::query_status(request.server, request.run_id, request.timeout);
  out << format_status(status, request.server.to_string(), request.run_id);
  return (!request.run_id.empty() && status.jobs.empty()) ? 1 : 0;
}

}  // namespace ddprun::launcher
