// `ddprun status`: the network round trips (rendezvous::query_status, or query_etcd_status for an
// etcd rendezvous), printing, and --watch.
#include <signal.h>

#include <cerrno>
#include <chrono>
#include <ctime>
#include <ostream>
#include <tuple>
#include <utility>

#include <fmt/format.h>

#include <boost/json.hpp>

#include "ddprun/common/error.hpp"
#include "ddprun/launcher/status_command.hpp"
#include "ddprun/launcher/values.hpp"
#include "ddprun/rendezvous/etcd_rendezvous.hpp"
#include "ddprun/rendezvous/rendezvous_client.hpp"

namespace ddprun::launcher {
namespace {

// The etcd rendezvous' jobs (read from etcd's job logs) and how to name where they came from.
std::pair<rendezvous::RegistryStatus, std::string> etcd_status(const StatusRequest& request) {
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
    opts.password = read_password_file(request.etcd_password_file, request.etcd_conf_what);
  }
  const auto status = rendezvous::query_etcd_status(opts, e.prefix, request.run_id, request.timeout);
  std::string where;
  for (const auto& ep : e.endpoints) where += (where.empty() ? "" : ",") + ep.to_string();
  return {status, "etcd " + where};
}

// ANSI: cursor home, clear the screen. Plain escape codes, so no terminal library is needed.
constexpr std::string_view kRedraw = "\x1b[H\x1b[2J";

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

struct Update {
  std::string text;
  int code = 0;
};

// One query, rendered. `watching`: a failed query becomes the update's text instead of an error.
Update one_update(const StatusRequest& request, bool watching) {
  std::string endpoint = request.server.to_string();
  const std::string time = utc_now();
  try {
    rendezvous::RegistryStatus status;
    if (request.etcd) {
      std::tie(status, endpoint) = etcd_status(request);
    } else {
      // The first endpoint that answers (relays of one daemon); the last failure when none does.
      for (std::size_t i = 0;; ++i) {
        const Endpoint& server = i == 0 ? request.server : request.alternates[i - 1];
        try {
          status = rendezvous::query_status(server, request.run_id, request.timeout, request.token);
          endpoint = server.to_string();
          break;
        } catch (const NetworkError&) {
          if (i == request.alternates.size()) throw;
        }
      }
    }
    const int code = (!request.run_id.empty() && status.jobs.empty()) ? 1 : 0;
    if (request.json) return {format_status_json(status, endpoint, request.run_id, watching ? time : "") + "\n", code};
    std::string text = format_status(status, endpoint, request.run_id);
    if (watching) {
      text = fmt::format("ddprun status {} at {} (every {} s)\n", endpoint, time,
                         std::chrono::duration<double>(*request.watch).count()) +
             text;
    }
    return {text, code};
  } catch (const Error& e) {
    if (!watching) throw;
    if (request.json) {
      boost::json::object line{
          {"endpoint", endpoint},
          {"run_id", request.run_id.empty() ? boost::json::value(nullptr) : boost::json::value(request.run_id)},
          {"time", time},
          {"error", e.what()}};
      return {boost::json::serialize(line) + "\n", 1};
    }
    return {fmt::format("ddprun status {} at {}\nerror: {}\n", endpoint, time, e.what()), 1};
  }
}

}  // namespace

int run_status(const StatusRequest& request, std::ostream& out, bool terminal) {
  if (!request.watch) {
    const auto update = one_update(request, false);
    out << update.text;
    return update.code;
  }
  // SIGINT/SIGTERM stay pending while a query runs and end the wait between updates.
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  sigset_t previous;
  ::sigprocmask(SIG_BLOCK, &stop, &previous);
  int code = 0;
  const auto interval = *request.watch;
  for (int n = 1;; ++n) {
    const auto update = one_update(request, true);
    code = update.code;
    if (terminal && !request.json) {
      out << kRedraw << update.text;
    } else {
      out << update.text << (request.json ? "" : "\n");
    }
    out.flush();
    if (request.watch_count > 0 && n >= request.watch_count) break;
    const auto secs = std::chrono::duration_cast<std::chrono::seconds>(interval);
    timespec wait{static_cast<time_t>(secs.count()),
                  static_cast<long>(std::chrono::duration_cast<std::chrono::nanoseconds>(interval - secs).count())};
    int got = -1;
    do {
      got = ::sigtimedwait(&stop, nullptr, &wait);
    } while (got < 0 && errno == EINTR);
    if (got == SIGINT || got == SIGTERM) {
      code = 0;
      break;
    }
  }
  ::sigprocmask(SIG_SETMASK, &previous, nullptr);
  return code;
}

}  // namespace ddprun::launcher
