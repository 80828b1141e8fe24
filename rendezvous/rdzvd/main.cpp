// ddprun-rdzvd: a standalone store/rendezvous daemon speaking the c10d TCPStore protocol and
// ddprun's native rendezvous operations on the same port (docs/daemon.md).
//
//   ddprun-rdzvd [--host H] [--port P] [--port-file F] [--token-file F] [--allow-unauthenticated-store]
//                [limits...]
//                [--log-level L] [--log-format text|json]
//                [--metrics-port P [--metrics-host A] [--metrics-port-file F]]
//   ddprun-rdzvd --relay-to HOST:PORT [--host H] [--port P] [--port-file F] [--token-file F]
//                [--max-connections N] [--max-queued-reply-bytes N] [--max-buffered-bytes N]
//                [--relink-timeout S] [--link-stall-timeout-ms MS] [--log-level L]
//                [--log-format F]
//
// With --relay-to it is a relay (docs/daemon.md, "Relays"; relay_server.hpp): clients connect to
// it as to the daemon and it carries their connections to the daemon at HOST:PORT over one link.
// Same readiness contract and signals; losing the link exits 1 (a service manager restarts it).
//
// Readiness contract (docs/protocol.md, "The daemon"): after the socket is bound and listening,
// the first stdout line is exactly `listening on HOST:PORT` (flushed at once), and when
// --port-file is given the file holds the bound port number and a newline, written atomically
// (temporary file + rename); under systemd (Type=notify) READY=1 goes to $NOTIFY_SOCKET at the
// same moment. SIGINT/SIGTERM stop the daemon cleanly with exit code 0; SIGHUP re-reads
// --token-file (new connections use the new token, authenticated ones stay); a bind
// failure prints an error naming host:port and exits 1; a bad flag exits 2.

#include <sys/resource.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/address.hpp>
#include <boost/asio/signal_set.hpp>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
#include <iostream>
#include <string>

#include "ddprun/common/endpoint.hpp"
#include "ddprun/common/error.hpp"
#include "ddprun/common/logging.hpp"
#include "ddprun/common/metrics.hpp"
#include "ddprun/rendezvous/relay_server.hpp"
#include "ddprun/common/metrics_http.hpp"
#include "ddprun/common/sd_notify.hpp"
#include "ddprun/common/secret_file.hpp"
#include "ddprun/common/strings.hpp"
#include "ddprun/common/version.hpp"
#include "ddprun/rendezvous/rendezvous_metrics.hpp"
#include "ddprun/rendezvous/rendezvous_server.hpp"

namespace {

// Many agents and workers may connect at once; the default soft limit (1024) is too small.
// Raises the soft open-files limit to the hard one and, when the hard limit is below what
// --max-connections needs (the connections plus the store server's reserve of at most 1,024
// descriptors), the hard limit itself up to fs.nr_open, which only a privileged daemon (root
// with CAP_SYS_RESOURCE) may do. When that fails the store server lowers --max-connections to
// fit (and logs it); `explicit_cap` turns the explanation into a warning naming the fix.
void raise_fd_limit(std::size_t max_connections, bool explicit_cap) {
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return;
  const rlim_t want = static_cast<rlim_t>(max_connections) + 1024;
  std::string hard_error;
  if (rl.rlim_max != RLIM_INFINITY && rl.rlim_max < want) {
    rlim_t nr_open = 1048576;
    if (std::ifstream in("/proc/sys/fs/nr_open"); in) {
      unsigned long long v = 0;
      if (in >> v && v > 0) nr_open = static_cast<rlim_t>(v);
    }
    rlimit up{std::min(want, nr_open), std::min(want, nr_open)};
    if (up.rlim_max > rl.rlim_max) {
      if (setrlimit(RLIMIT_NOFILE, &up) == 0) {
        rl = up;
      } else {
        hard_error = std::strerror(errno);
      }
    }
    if (rl.rlim_max < want) {
      const auto level = explicit_cap ? spdlog::level::warn : spdlog::level::debug;
      spdlog::log(level,
                  "--max-connections {} needs about {} open files, but the hard limit is {}{}{}: raise it where the "
                  "daemon starts (LimitNOFILE={} in its systemd unit, or `ulimit -Hn {}` / prlimit from a process with "
                  "CAP_SYS_RESOURCE; fs.nr_open = {} caps it) or lower --max-connections",
                  max_connections, want, rl.rlim_max, hard_error.empty() ? "" : " and raising it failed: ", hard_error,
                  want, want, nr_open);
    }
  }
  if (rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0) {
      spdlog::warn("cannot raise the open-files limit to {}: {}", rl.rlim_max, std::strerror(errno));
    }
  }
}

void write_port_file(const std::string& path, std::uint16_t port) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << port << '\n';
    out.flush();
    if (!out) {
      throw ddprun::Error("cannot write the port file '" + tmp + "': " + std::strerror(errno),
                          "check that the directory of --port-file exists and is writable");
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::remove(tmp.c_str());
    throw ddprun::Error("cannot rename '" + tmp + "' to the port file '" + path + "': " + why,
                        "check that --port-file names a writable location");
  }
}

// read_secret_file with its warning (a file every user can read) logged; throws as it does.
std::string read_secret_logged(const std::string& path, const std::string& flag) {
  auto secret = ddprun::read_secret_file(path, flag);
  if (!secret.warning.empty()) spdlog::warn("{}", secret.warning);
  return std::move(secret.secret);
}

// On each SIGHUP of `hup`: re-reads `token_file` and hands the token to `apply` (a file that
// cannot be read keeps the old token, with an error line). `who` prefixes the log lines.
void reread_token_on_sighup(boost::asio::signal_set& hup, const std::string& token_file, const std::string& who,
                            const std::string& effect, std::function<void(std::string)> apply) {
  hup.async_wait([&hup, token_file, who, effect, apply](const boost::system::error_code& ec, int) {
    if (ec) return;
    if (token_file.empty()) {
      spdlog::warn("{}SIGHUP: no --token-file to re-read; the token is unchanged", who);
    } else {
      try {
        apply(read_secret_logged(token_file, "--token-file"));
        spdlog::info("{}SIGHUP: re-read the token from --token-file {}; {}", who, token_file, effect);
      } catch (const ddprun::Error& e) {
        spdlog::error("{}SIGHUP: keeping the old token: {}", who, e.what());
      }
    }
    reread_token_on_sighup(hup, token_file, who, effect, apply);
  });
}

// Relay mode: `relay_to` is the daemon's HOST:PORT. Exit 0 on SIGINT/SIGTERM, 1 when the daemon
// cannot be reached or proven, or the link is lost and not made again within `relink_timeout`,
// 2 on a bad flag.
int run_relay(const std::string& relay_to, const std::string& host, int port, const std::string& port_file,
              const std::string& token, const std::string& token_file, std::size_t max_connections,
              std::size_t max_queued_bytes, std::size_t max_buffered_bytes, double relink_timeout,
              std::chrono::milliseconds link_stall_timeout) {
  namespace rdzv = ddprun::rendezvous;
  rdzv::RelayServerOptions options;
  try {
    const auto ep = ddprun::parse_endpoint(relay_to, 29400, "--relay-to");
    options.upstream_host = ep.host;
    options.upstream_port = ep.port;
  } catch (const ddprun::Error& e) {
    std::cerr << "ddprun-rdzvd: error: " << e.what() << "\n";
    return 2;
  }
  if (token.empty()) {
    std::cerr << "ddprun-rdzvd: error: --relay-to needs the daemon's token: give --token-file FILE (or set "
                 "DDPRUN_RDZV_TOKEN); the daemon accepts relays only from a token holder\n";
    return 2;
  }
  options.host = host;
  options.port = static_cast<std::uint16_t>(port);
  options.token = token;
  options.max_connections = max_connections;
  options.max_queued_bytes = max_queued_bytes;
  options.max_buffered_bytes = max_buffered_bytes;
  options.relink_timeout = std::chrono::milliseconds(static_cast<std::int64_t>(relink_timeout * 1000.0));
  options.link_stall_timeout = link_stall_timeout;
  raise_fd_limit(max_connections, false);
  boost::asio::io_context io(1);
  int exit_code = 0;
  options.on_upstream_lost = [&io, &exit_code](const std::string& why) {
    std::cerr << "ddprun-rdzvd: error: relay: " << why
              << " (start the daemon again; a service manager restarts this relay)\n";
    exit_code = 1;
    io.stop();
  };
  try {
    // Installed before the relay waits for its root (which may take --relink-timeout): a SIGHUP
    // meanwhile is handled once the relay is up, not the signal's default (exit).
    boost::asio::signal_set hup(io, SIGHUP);
    rdzv::RelayServer relay(io, options);
    relay.start();
    boost::asio::signal_set stop_signals(io, SIGINT, SIGTERM);
    stop_signals.async_wait([&](const boost::system::error_code& ec, int signo) {
      if (ec) return;
      spdlog::info("relay: signal {}: stopping", signo);
      relay.stop();
      io.stop();
    });
    // SIGHUP re-reads --token-file, as the daemon does (`kill -HUP $(pidof ddprun-rdzvd)` reaches
    // both): the relay's next link proves the new token; the link that is up stays.
    reread_token_on_sighup(hup, token_file, "relay: ", "the next link to the daemon uses it",
                           [&](std::string fresh) { relay.set_token(std::move(fresh)); });
    spdlog::info("relaying to the daemon at {} ({})", relay_to,
                 token_file.empty() ? "token from DDPRUN_RDZV_TOKEN" : "token from --token-file " + token_file);
    if (!port_file.empty()) write_port_file(port_file, relay.port());
    const std::string listening = "listening on " + ddprun::bracket_host(host) + ":" + std::to_string(relay.port());
    std::cout << listening << std::endl;
    if (const auto ready = ddprun::notify_ready(listening); !ready.error.empty()) {
      spdlog::warn("cannot tell systemd the relay is ready: {}", ready.error);
    }
    io.run();
    return exit_code;
  } catch (const ddprun::Error& e) {
    std::cerr << "ddprun-rdzvd: error: " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "ddprun-rdzvd: error: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  namespace rdzv = ddprun::rendezvous;
  CLI::App app{"ddprun-rdzvd: TCPStore-compatible store and rendezvous daemon"};
  std::string host = "0.0.0.0";
  int port = 29400;
  std::string port_file;
  std::string log_level;  // empty: DDPRUN_LOG_LEVEL / LOGLEVEL, else info
  rdzv::RendezvousServerOptions options;
  app.add_option("--host", host, "Address to listen on (0.0.0.0, :: for dual stack, or a local address)")
      ->capture_default_str();
  app.add_option("--port", port, "TCP port; 0 picks a free one")->check(CLI::Range(0, 65535))->capture_default_str();
  app.add_option("--port-file", port_file, "Write the bound port number (and a newline) to this file, atomically");
  int metrics_port = -1;  // -1: no metrics endpoint
  std::string metrics_port_file;
  std::string metrics_host = "127.0.0.1";
  app.add_option("--metrics-host", metrics_host,
                 "IP address the metrics endpoint listens on (0.0.0.0 or :: for every address)")
      ->capture_default_str();
  app.add_option("--metrics-port", metrics_port,
                 "Serve Prometheus metrics on GET /metrics over HTTP at this port (on --metrics-host); 0 picks a free "
                 "one")
      ->check(CLI::Range(0, 65535));
  app.add_option("--metrics-port-file", metrics_port_file,
                 "Write the bound metrics port number (and a newline) to this file, atomically");
  // Every --max-* is unsigned: CLI11 reads "-1" into one as its largest value, i.e. no cap at all.
  const CLI::Validator unsigned_value(
      [](std::string& text) {
        return text.find('-') == std::string::npos ? std::string()
                                                   : "'" + text + "' is negative: give a number of 0 or more";
      },
      "");
  app.add_option("--max-key-bytes", options.limits.store.max_key_bytes, "Largest key accepted")
      ->check(unsigned_value)
      ->capture_default_str();
  app.add_option("--max-value-bytes", options.limits.store.max_value_bytes, "Largest value accepted")
      ->check(unsigned_value)
      ->capture_default_str();
  app.add_option("--max-keys-per-request", options.limits.store.max_keys_per_request,
                 "Most keys in one CHECK/WAIT/MULTI_GET/MULTI_SET")
      ->check(unsigned_value)
      ->capture_default_str();
  app.add_option("--max-connections", options.limits.store.max_connections, "Most open client connections")
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 24))
      ->capture_default_str();
  app.add_option("--max-total-bytes", options.limits.store.max_total_bytes, "Most bytes of keys+values held")
      ->check(unsigned_value)
      ->capture_default_str();
  // --- Store memory and connection bounds (docs/protocol.md, "Limits") ---
  app.add_option("--max-keys", options.limits.store.max_keys, "Most keys plus queued items held")
      ->check(unsigned_value)
      ->capture_default_str();
  app.add_option("--max-waits", options.limits.store.max_waits, "Most WAIT/BARRIER/WATCH_KEY registrations held")
      ->check(unsigned_value)
      ->capture_default_str();
  app.add_option("--max-queued-reply-bytes", options.limits.store.max_queued_reply_bytes,
                 "Most reply bytes queued for one connection; larger replies are refused")
      ->check(unsigned_value)
      ->capture_default_str();
  app.add_option("--max-buffered-bytes", options.limits.store.max_buffered_bytes,
                 "Most bytes in all connections' read buffers and queued replies together")
      ->check(unsigned_value)
      ->capture_default_str();
  app.add_option("--max-connections-per-peer", options.limits.store.max_connections_per_peer,
                 "Most connections from one peer address (0 = no cap)")
      ->check(unsigned_value)
      ->capture_default_str();
  app.add_option("--max-relayed-connections", options.limits.store.max_relayed_connections,
                 "Most client connections carried by relays (ddprun-rdzvd --relay-to), over all relays")
      ->check(unsigned_value)
      ->capture_default_str();
  app.add_option_function<std::int64_t>(
         "--frame-timeout-ms",
         [&](const std::int64_t& ms) { options.limits.frame_timeout = std::chrono::milliseconds(ms); },
         "Close a connection holding an incomplete request this long (0 = never)")
      ->check(CLI::NonNegativeNumber)
      ->default_str(std::to_string(options.limits.frame_timeout.count()));
  app.add_option_function<std::int64_t>(
         "--idle-timeout-ms",
         [&](const std::int64_t& ms) { options.limits.idle_timeout = std::chrono::milliseconds(ms); },
         "Close a connection silent this long and not waiting (0 = never; torch clients idle for a whole job)")
      ->check(CLI::NonNegativeNumber)
      ->default_str(std::to_string(options.limits.idle_timeout.count()));
  app.add_option_function<std::int64_t>(
         "--handshake-timeout-ms",
         [&](const std::int64_t& ms) { options.limits.handshake_timeout = std::chrono::milliseconds(ms); },
         "With a token (and no --allow-unauthenticated-store): close a connection that has not authenticated this "
         "long after connecting (0 = never). At --max-connections the oldest such connection always gives way")
      ->check(CLI::NonNegativeNumber)
      ->default_str(std::to_string(options.limits.handshake_timeout.count()));
  // A relay reads its link all the time and the daemon stops reading one only while its own
  // replies back up on it: a link that moves no byte for this long has a stopped or wedged peer.
  app.add_option_function<std::int64_t>(
         "--link-stall-timeout-ms",
         [&](const std::int64_t& ms) { options.limits.link_stall_timeout = std::chrono::milliseconds(ms); },
         "Close a relay link whose other end has read none of the bytes waiting for it this long (0 = never): the "
         "daemon then ends the connections the relay carried, a relay links again")
      ->check(CLI::NonNegativeNumber)
      ->default_str(std::to_string(options.limits.link_stall_timeout.count()));
  app.add_option_function<std::int64_t>(
         "--reply-stall-timeout-ms",
         [&](const std::int64_t& ms) { options.limits.reply_stall_timeout = std::chrono::milliseconds(ms); },
         "Close a client connection that has read none of the replies waiting for it this long, with the kernel's "
         "buffers full (0 = never); one that reads slowly is never closed")
      ->check(CLI::NonNegativeNumber)
      ->default_str(std::to_string(options.limits.reply_stall_timeout.count()));
  // --- end of store bounds ---
  // Accepted only to refuse it with a hint: a token on the command line is readable by every
  // local user in /proc/*/cmdline.
  std::string token_on_command_line;
  auto* token_opt =
      app.add_option("--token", token_on_command_line, "Refused: use --token-file or DDPRUN_RDZV_TOKEN")->group("");
  std::string token_file;
  app.add_option("--token-file", token_file,
                 "Shared secret every client must prove in the handshake, read from this file (one trailing "
                 "newline is dropped), e.g. a systemd credential (default: $DDPRUN_RDZV_TOKEN; empty = none)");
  std::string previous_token_file;
  app.add_option("--previous-token-file", previous_token_file,
                 "With --token-file: a token rotated out, still accepted from connections bound to one job to "
                 "re-register its nodes (REJOIN: the agents of jobs started before the rotation, after a reconnect "
                 "or a daemon restart), never for a new node's JOIN, a relay or every job's status. Re-read on "
                 "SIGHUP with --token-file; a missing or empty file then means none");
  std::string previous_window_text;
  app.add_option("--previous-token-window", previous_window_text,
                 "With --previous-token-file: for this long after the start a node the daemon does not know may "
                 "re-register with the previous token (a restart forgot every node); later only nodes it knows")
      ->default_str("60");
  app.add_flag("--allow-unauthenticated-store", options.allow_unauthenticated_store,
               "With a token: let clients that did not authenticate use TCPStore ops (torchrun's c10d backend "
               "cannot authenticate). RISK: anyone who reaches the port can then read and delete every key");
  app.add_option("--max-rdzv-payload-bytes", options.limits.wire.max_payload_bytes,
                 "Largest native rendezvous message accepted")
      ->check(unsigned_value)
      ->capture_default_str();
  std::string job_expiry_text;
  app.add_option("--job-expiry", job_expiry_text,
                 "Forget a job this many seconds after it last had a live member (every node left, was lost or "
                 "finished), whatever timeouts its clients chose; 0 = never")
      ->default_str("600");
  app.add_option("--max-jobs", options.max_jobs,
                 "Most jobs held at once; a JOIN that would start one more is refused (0 = no cap)")
      ->check(unsigned_value)
      ->capture_default_str();
  app.add_option("--max-members", options.max_members,
                 "Most members of all jobs together (nodes joined, and nodes whose connection closed within their "
                 "heartbeat interval); a JOIN that would add one more is refused (0 = no cap)")
      ->check(unsigned_value)
      ->capture_default_str();
  app.add_option("--max-member-bytes", options.max_member_bytes,
                 "Most bytes members of all jobs together may make the daemon hold (1 KiB each, plus the names "
                 "they announce and the NCCL unique IDs kept for them); a JOIN past it is refused (0 = no cap)")
      ->check(unsigned_value)
      ->capture_default_str();
  app.add_option("--log-level", log_level,
                 "trace|debug|info|warning|error|critical|off (default: $DDPRUN_LOG_LEVEL, else $LOGLEVEL, else info)");
  std::string log_format;  // empty: DDPRUN_LOG_FORMAT, else text
  app.add_option("--log-format", log_format,
                 "text|json (json: one object per line, for log shippers) (default: $DDPRUN_LOG_FORMAT, else text)")
      ->check(CLI::IsMember({"text", "json"}));
  std::string relay_to;
  app.add_option("--relay-to", relay_to,
                 "Run as a relay: accept clients here and carry their connections to the daemon at HOST:PORT over "
                 "one link (needs the daemon's token)");
  double relink_timeout = 60;
  app.add_option("--relink-timeout", relink_timeout,
                 "Relay only: how long to keep trying to link to the daemon, at start and after losing the link, "
                 "before exiting 1 (0 exits at once)")
      ->check(CLI::Range(0.0, 86400.0))
      ->capture_default_str();
  app.set_version_flag("--version", std::string("ddprun-rdzvd ") + ddprun::version_string);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);  // prints help/version, or the error
    return code == 0 ? 0 : 2;
  }
  if (!metrics_port_file.empty() && metrics_port < 0) {
    std::cerr << "ddprun-rdzvd: error: --metrics-port-file needs --metrics-port (0 picks a free port)\n";
    return 2;
  }
  if (app.count("--metrics-host") > 0 && metrics_port < 0) {
    std::cerr << "ddprun-rdzvd: error: --metrics-host needs --metrics-port (0 picks a free port)\n";
    return 2;
  }
  if (metrics_host.size() >= 2 && metrics_host.front() == '[' && metrics_host.back() == ']') {
    metrics_host = metrics_host.substr(1, metrics_host.size() - 2);
  }
  if (boost::system::error_code ec; (boost::asio::ip::make_address(metrics_host, ec), ec)) {
    std::cerr << "ddprun-rdzvd: error: --metrics-host '" << metrics_host
              << "' is not an IP address: give one such as 127.0.0.1 (the default), 0.0.0.0 or :: for every "
                 "address\n";
    return 2;
  }
  if (const auto& l = options.limits.store;
      relay_to.empty() && (l.max_queued_reply_bytes < 8 || l.max_value_bytes > l.max_queued_reply_bytes - 8)) {
    // A value the store accepts must fit one GET reply (8 bytes of length, then the value).
    std::cerr << "ddprun-rdzvd: error: --max-value-bytes " << l.max_value_bytes
              << " is more than one reply may queue (--max-queued-reply-bytes " << l.max_queued_reply_bytes
              << ", less 8 bytes of length): such a value could be written but never read back. Raise "
                 "--max-queued-reply-bytes or lower --max-value-bytes\n";
    return 2;
  }
  const auto level = log_level.empty() ? std::optional(ddprun::log_level_from_env(spdlog::level::info))
                                       : ddprun::parse_log_level(log_level);
  if (!level) {
    std::cerr << "ddprun-rdzvd: error: --log-level '" << log_level
              << "' is not one of trace|debug|info|warning|error|critical|off\n";
    return 2;
  }
  ddprun::setup_logging("ddprun-rdzvd", *level,
                        log_format.empty() ? ddprun::log_format_from_env(ddprun::LogFormat::text)
                                           : *ddprun::parse_log_format(log_format));
  raise_fd_limit(options.limits.store.max_connections, app.count("--max-connections") > 0);
  if (token_opt->count() > 0) {
    std::cerr << "ddprun-rdzvd: error: --token on the command line is refused: every local user can read it in "
                 "/proc/*/cmdline. Put it in a file readable only by the daemon and pass --token-file FILE, or set "
                 "DDPRUN_RDZV_TOKEN in the daemon's environment\n";
    return 2;
  }

  if (!job_expiry_text.empty()) {
    // Seconds, finite, at most the longest rendezvous timeout (30 days); 0 turns expiry off.
    const auto v = ddprun::parse_seconds(ddprun::trim(job_expiry_text));
    const double most = std::chrono::duration<double>(rdzv::max_timeout).count();
    if (!v || *v > most) {
      std::cerr << "ddprun-rdzvd: error: --job-expiry " << job_expiry_text << ": not a number of seconds from 0 to "
                << static_cast<long long>(most) << " (e.g. --job-expiry 600; 0 = never)\n";
      return 2;
    }
    if (*v == 0.0) {
      options.job_expiry.reset();
    } else {
      options.job_expiry = std::max(ddprun::Duration(1),
                                    std::chrono::duration_cast<ddprun::Duration>(std::chrono::duration<double>(*v)));
    }
  }
  if (!token_file.empty()) {
    try {
      options.token = read_secret_logged(token_file, "--token-file");
    } catch (const ddprun::Error& e) {
      std::cerr << "ddprun-rdzvd: error: " << e.what() << "\n";
      return 2;
    }
  }
  if (options.token.empty() && token_file.empty()) {
    if (const char* env = std::getenv("DDPRUN_RDZV_TOKEN")) options.token = env;
  }
  if (!previous_token_file.empty()) {
    try {
      options.previous_token = read_secret_logged(previous_token_file, "--previous-token-file");
    } catch (const ddprun::Error& e) {
      std::cerr << "ddprun-rdzvd: error: " << e.what() << "\n";
      return 2;
    }
    if (token_file.empty()) {
      // (Not DDPRUN_RDZV_TOKEN: the two files are re-read together on SIGHUP, which ends the overlap.)
      std::cerr << "ddprun-rdzvd: error: --previous-token-file needs a current token from --token-file FILE\n";
      return 2;
    }
    if (options.previous_token == options.token) {
      spdlog::warn("--previous-token-file holds the current token: nothing more is accepted");
      options.previous_token.clear();
    }
  }

  if (!previous_window_text.empty()) {
    const auto v = ddprun::parse_seconds(ddprun::trim(previous_window_text));
    if (!v || *v > 86400.0) {
      std::cerr << "ddprun-rdzvd: error: --previous-token-window " << previous_window_text
                << ": not a number of seconds from 0 to 86400 (e.g. --previous-token-window 60)\n";
      return 2;
    }
    options.previous_token_window = std::chrono::duration_cast<ddprun::Duration>(std::chrono::duration<double>(*v));
    if (previous_token_file.empty()) {
      std::cerr << "ddprun-rdzvd: error: --previous-token-window applies only with --previous-token-file\n";
      return 2;
    }
  }
  if (!relay_to.empty()) {
    // Flags of the daemon's store and registry mean nothing to a relay: refuse them rather than
    // ignore them.
    // clang-format off
    static constexpr const char* kRootOnly[] = {
        "--metrics-port", "--metrics-host", "--metrics-port-file", "--max-key-bytes", "--max-value-bytes",
        "--max-keys-per-request", "--max-total-bytes", "--max-keys", "--max-waits", "--max-connections-per-peer",
        "--max-relayed-connections", "--frame-timeout-ms", "--idle-timeout-ms", "--handshake-timeout-ms",
        "--reply-stall-timeout-ms",
        "--allow-unauthenticated-store", "--previous-token-file", "--previous-token-window",
        "--max-rdzv-payload-bytes", "--job-expiry", "--max-jobs", "--max-members",
        "--max-member-bytes"};
    // clang-format on
    for (const char* flag : kRootOnly) {
      if (app.count(flag) > 0) {
        std::cerr << "ddprun-rdzvd: error: " << flag << " does not apply to a relay (--relay-to): give it to the "
                  << "daemon the relay connects to\n";
        return 2;
      }
    }
    return run_relay(relay_to, host, port, port_file, options.token, token_file,
                     app.count("--max-connections") > 0 ? options.limits.store.max_connections : std::size_t{65536},
                     options.limits.store.max_queued_reply_bytes, options.limits.store.max_buffered_bytes,
                     relink_timeout, options.limits.link_stall_timeout);
  }
  if (app.count("--relink-timeout") > 0) {
    std::cerr << "ddprun-rdzvd: error: --relink-timeout applies only to a relay: give --relay-to HOST:PORT too\n";
    return 2;
  }

  boost::asio::io_context io(1);  // outlives `server` (declared before it)
  options.host = host;
  options.port = static_cast<std::uint16_t>(port);
  options.stop_signals = {SIGINT, SIGTERM};
  options.on_signal = [&io](int) { io.stop(); };
  try {
    rdzv::RendezvousServer server(io, options);
    server.start();
    std::optional<ddprun::metrics::MetricsHttpServer> metrics;
    if (metrics_port >= 0) {
      metrics.emplace(io, metrics_host, static_cast<std::uint16_t>(metrics_port), [&server] {
        ddprun::metrics::Exposition out;
        out.gauge("ddprun_build_info", "Always 1; the version label names the ddprun build.",
                  {ddprun::metrics::Sample{{{"version", ddprun::version_string}}, 1}});
        rdzv::add_rendezvous_metrics(out, server, std::chrono::steady_clock::now());
        return out.text();
      });
      metrics->start();
      spdlog::info("metrics on http://{}:{}/metrics", ddprun::bracket_host(metrics_host), metrics->port());
      if (!metrics_port_file.empty()) write_port_file(metrics_port_file, metrics->port());
    }
    // server.start() installed the SIGINT/SIGTERM handlers: a service manager may send SIGTERM
    // as soon as it sees readiness.
    if (!options.token.empty()) {
      spdlog::info("every client must authenticate with the token ({}){}",
                   token_file.empty() ? "DDPRUN_RDZV_TOKEN" : "--token-file " + token_file,
                   options.allow_unauthenticated_store
                       ? "; --allow-unauthenticated-store: TCPStore ops are open to anyone who reaches the port"
                       : "");
    } else if (options.allow_unauthenticated_store) {
      spdlog::warn("--allow-unauthenticated-store has no effect without a token (--token-file or DDPRUN_RDZV_TOKEN)");
    }
    // SIGHUP re-reads --token-file: new connections must prove the new token, connections that
    // already authenticated stay (rotating the token does not stop running jobs).
    if (!options.previous_token.empty()) {
      spdlog::info("the previous token (--previous-token-file {}) is accepted for REJOINs of a job's nodes",
                   previous_token_file);
    }
    boost::asio::signal_set hup(io, SIGHUP);
    reread_token_on_sighup(hup, token_file, "", "new connections must use it", [&](std::string fresh) {
      server.set_token(std::move(fresh));
      if (previous_token_file.empty()) return;
      // Re-read with the token: a rotation writes both files, then one SIGHUP. Missing or empty:
      // the overlap is over.
      std::string previous;
      try {
        previous = read_secret_logged(previous_token_file, "--previous-token-file");
      } catch (const ddprun::Error& e) {
        spdlog::info("SIGHUP: no previous token from now on ({})", e.what());
      }
      if (previous == server.options().token) previous.clear();
      if (!previous.empty()) {
        spdlog::info("SIGHUP: re-read the previous token from --previous-token-file {}; REJOINs may prove it",
                     previous_token_file);
      }
      server.set_previous_token(std::move(previous));
    });
    if (!port_file.empty()) write_port_file(port_file, server.port());
    const std::string listening = "listening on " + ddprun::bracket_host(host) + ":" + std::to_string(server.port());
    std::cout << listening << std::endl;
    if (const auto ready = ddprun::notify_ready(listening); !ready.error.empty()) {
      spdlog::warn("cannot tell systemd the daemon is ready: {}", ready.error);
    }
    io.run();
    return 0;
  } catch (const ddprun::Error& e) {
    std::cerr << "ddprun-rdzvd: error: " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "ddprun-rdzvd: error: " << e.what() << "\n";
    return 1;
  }
}
