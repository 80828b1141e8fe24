// ddprun-rdzvd: a standalone store/rendezvous daemon speaking the c10d TCPStore protocol and
// ddprun's native rendezvous operations on the same port (docs/daemon.md).
//
//   ddprun-rdzvd [--host H] [--port P] [--port-file F] [--token T] [limits...] [--log-level L]
//
// Readiness contract (docs/protocol.md, "The daemon"): after the socket is bound and listening,
// the first stdout line is exactly `listening on HOST:PORT` (flushed at once), and when
// --port-file is given the file holds the bound port number and a newline, written atomically
// (temporary file + rename). SIGINT/SIGTERM stop the daemon cleanly with exit code 0; a bind
// failure prints an error naming host:port and exits 1; a bad flag exits 2.

#include <sys/resource.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/signal_set.hpp>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <iostream>
#include <string>

#include "ddprun/common/endpoint.hpp"
#include "ddprun/common/error.hpp"
#include "ddprun/common/logging.hpp"
#include "ddprun/common/version.hpp"
#include "ddprun/rendezvous/rendezvous_service.hpp"
#include "ddprun/rendezvous/store_server.hpp"

namespace {

// Many agents and workers may connect at once; the default soft limit (1024) is too small.
void raise_fd_limit() {
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return;
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

}  // namespace

int main(int argc, char** argv) {
  namespace rdzv = ddprun::rendezvous;
  CLI::App app{"ddprun-rdzvd: TCPStore-compatible store and rendezvous daemon"};
  std::string host = "0.0.0.0";
  int port = 29400;
  std::string port_file;
  std::string log_level;  // empty: DDPRUN_LOG_LEVEL / LOGLEVEL, else info
  // Declared before `options`: the rendezvous service that `options.extension` keeps alive owns
  // a timer, which must be destroyed while its io_context still exists.
  boost::asio::io_context io(1);
  rdzv::StoreServerOptions options;
  std::string token;
  std::size_t max_rdzv_payload = rdzv::WireLimits{}.max_payload_bytes;
  app.add_option("--host", host, "Address to listen on (0.0.0.0, :: for dual stack, or a local address)")
      ->capture_default_str();
  app.add_option("--port", port, "TCP port; 0 picks a free one")->check(CLI::Range(0, 65535))->capture_default_str();
  app.add_option("--port-file", port_file, "Write the bound port number (and a newline) to this file, atomically");
  app.add_option("--max-key-bytes", options.limits.max_key_bytes, "Largest key accepted")->capture_default_str();
  app.add_option("--max-value-bytes", options.limits.max_value_bytes, "Largest value accepted")->capture_default_str();
  app.add_option("--max-keys-per-request", options.limits.max_keys_per_request,
                 "Most keys in one CHECK/WAIT/MULTI_GET/MULTI_SET")
      ->capture_default_str();
  app.add_option("--max-connections", options.limits.max_connections, "Most open client connections")
      ->capture_default_str();
  app.add_option("--max-total-bytes", options.limits.max_total_bytes, "Most bytes of keys+values held")
      ->capture_default_str();
  // --- Store memory and connection bounds (docs/protocol.md, "Limits") ---
  app.add_option("--max-keys", options.limits.max_keys, "Most keys plus queued items held")->capture_default_str();
  app.add_option("--max-waits", options.limits.max_waits, "Most WAIT/BARRIER/WATCH_KEY registrations held")
      ->capture_default_str();
  app.add_option("--max-queued-reply-bytes", options.limits.max_queued_reply_bytes,
                 "Most reply bytes queued for one connection; larger replies are refused")
      ->capture_default_str();
  app.add_option("--max-buffered-bytes", options.limits.max_buffered_bytes,
                 "Most bytes in all connections' read buffers and queued replies together")
      ->capture_default_str();
  app.add_option("--max-connections-per-peer", options.limits.max_connections_per_peer,
                 "Most connections from one peer address (0 = no cap)")
      ->capture_default_str();
  app.add_option_function<std::int64_t>(
         "--frame-timeout-ms", [&](const std::int64_t& ms) { options.frame_timeout = std::chrono::milliseconds(ms); },
         "Close a connection holding an incomplete request this long (0 = never)")
      ->check(CLI::NonNegativeNumber)
      ->default_str(std::to_string(options.frame_timeout.count()));
  app.add_option_function<std::int64_t>(
         "--idle-timeout-ms", [&](const std::int64_t& ms) { options.idle_timeout = std::chrono::milliseconds(ms); },
         "Close a connection silent this long and not waiting (0 = never; torch clients idle for a whole job)")
      ->check(CLI::NonNegativeNumber)
      ->default_str(std::to_string(options.idle_timeout.count()));
  // --- end of store bounds ---
  app.add_option("--token", token,
                 "Shared secret every rendezvous join must carry (default: $DDPRUN_RDZV_TOKEN; empty = none)");
  app.add_option("--max-rdzv-payload-bytes", max_rdzv_payload, "Largest native rendezvous message accepted")
      ->capture_default_str();
  app.add_option("--log-level", log_level,
                 "trace|debug|info|warning|error|critical|off (default: $DDPRUN_LOG_LEVEL, else info)");
  app.set_version_flag("--version", std::string("ddprun-rdzvd ") + ddprun::version_string);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);  // prints help/version, or the error
    return code == 0 ? 0 : 2;
  }
  const auto level = log_level.empty() ? std::optional(ddprun::log_level_from_env(spdlog::level::info))
                                       : ddprun::parse_log_level(log_level);
  if (!level) {
    std::cerr << "ddprun-rdzvd: error: --log-level '" << log_level
              << "' is not one of trace|debug|info|warning|error|critical|off\n";
    return 2;
  }
  ddprun::setup_logging("ddprun-rdzvd", *level);
  raise_fd_limit();

  if (token.empty()) {
    if (const char* env = std::getenv("DDPRUN_RDZV_TOKEN")) token = env;
  }

  options.host = host;
  options.port = static_cast<std::uint16_t>(port);
  rdzv::RendezvousServiceOptions service_options;
  service_options.token = token;
  service_options.limits.max_payload_bytes = max_rdzv_payload;
  auto service = std::make_shared<rdzv::RendezvousService>(io, service_options);
  options.extension = service;
  try {
    rdzv::StoreServer server(io, options);
    service->attach(server);
    server.start();
    if (!token.empty()) spdlog::info("rendezvous joins must carry the token (--token / DDPRUN_RDZV_TOKEN)");
    if (!port_file.empty()) write_port_file(port_file, server.port());
    std::cout << "listening on " << ddprun::bracket_host(host) << ":" << server.port() << std::endl;

    boost::asio::signal_set signals(io, SIGINT, SIGTERM);
    signals.async_wait([&](const boost::system::error_code& ec, int signo) {
      if (ec) return;
      spdlog::info("received {}, shutting down", signo == SIGINT ? "SIGINT" : "SIGTERM");
      service->detach();
      server.stop();
      io.stop();
    });
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
