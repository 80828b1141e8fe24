// MetricsHttpServer (metrics_http.hpp has the contract): the bind, and one route on the
// common http::Server.
#include "ddprun/common/metrics_http.hpp"

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ip/v6_only.hpp>
#include <utility>

#include "ddprun/common/endpoint.hpp"
#include "ddprun/common/error.hpp"
#include "ddprun/common/http_server.hpp"

namespace ddprun::metrics {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

namespace {

tcp::acceptor listen_on(asio::io_context& io, const std::string& host, std::uint16_t port) {
  boost::system::error_code ec;
  asio::ip::address addr = asio::ip::make_address(host, ec);
  if (ec) {
    throw NetworkError("cannot listen for metrics on " + bracket_host(host) + ":" + std::to_string(port) + ": '" +
                           host + "' is not an IP address",
                       "pass an IP address with --metrics-host, e.g. 127.0.0.1 or 0.0.0.0");
  }
  tcp::acceptor acceptor(io);
  const tcp::endpoint ep(addr, port);
  acceptor.open(ep.protocol(), ec);
  if (!ec && addr.is_v6()) acceptor.set_option(asio::ip::v6_only(false), ec);
  if (!ec) acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) acceptor.bind(ep, ec);
  if (!ec) acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    throw NetworkError(
        "cannot listen for metrics on " + bracket_host(host) + ":" + std::to_string(port) + ": " + ec.message(),
        "pick another --metrics-port, or 0 for a free one");
  }
  return acceptor;
}

}  // namespace

struct MetricsHttpServer::Impl {
  Impl(tcp::acceptor acceptor, http::Options options) : server(std::move(acceptor), std::move(options)) {}
  http::Server server;
};

MetricsHttpServer::MetricsHttpServer(asio::io_context& io, const std::string& host, std::uint16_t port,
                                     std::function<std::string()> render, MetricsHttpLimits limits) {
  http::Options options;
  options.name = "metrics";
  options.limits = http::Limits{limits.max_request_bytes, limits.read_timeout, limits.max_connections};
  options.routes.emplace("/metrics", [render = std::move(render)](const http::Request& request) {
    if (request.method != "GET") return http::plain(405, "only GET is served here");
    return http::Response{200, "text/plain; version=0.0.4; charset=utf-8", render()};
  });
  impl_ = std::make_shared<Impl>(listen_on(io, host, port), std::move(options));
}

MetricsHttpServer::~MetricsHttpServer() { stop(); }

void MetricsHttpServer::start() { impl_->server.start(); }
void MetricsHttpServer::stop() { impl_->server.stop(); }
std::uint16_t MetricsHttpServer::port() const { return impl_->server.port(); }
MetricsHttpStats MetricsHttpServer::stats() const {
  const http::Stats s = impl_->server.stats();
  return MetricsHttpStats{s.ok, s.rejected};
}

}  // namespace ddprun::metrics
