// RendezvousServer: store server + rendezvous service + limits + signals (rendezvous_server.hpp
// has the contract).
#include "ddprun/rendezvous/rendezvous_server.hpp"

#include <spdlog/spdlog.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/signal_set.hpp>
#include <utility>

#include "ddprun/common/error.hpp"
#include "ddprun/rendezvous/rendezvous_auth.hpp"

namespace ddprun::rendezvous {

struct RendezvousServer::Signals {
  explicit Signals(boost::asio::io_context& io) : set(io) {}
  boost::asio::signal_set set;
};

namespace {

const char* signal_text(int signo) {
  switch (signo) {
    case SIGINT:
      return "SIGINT";
    case SIGTERM:
      return "SIGTERM";
    case SIGHUP:
      return "SIGHUP";
    case SIGQUIT:
      return "SIGQUIT";
    default:
      return "a signal";
  }
}

}  // namespace

RendezvousServer::RendezvousServer(boost::asio::io_context& io, RendezvousServerOptions options, Timers& timers)
    : options_(std::move(options)) {
  if (!options_.token.empty()) auth::require_crypto();
  RendezvousServiceOptions service_options;
  service_options.token = options_.token;
  service_options.previous_token = options_.previous_token;
  service_options.previous_token_window = options_.previous_token_window;
  service_options.allow_unauthenticated_store = options_.allow_unauthenticated_store;
  service_options.embedded = options_.embedded;
  service_options.limits = options_.limits.wire;
  service_options.progress_interval = options_.progress_interval;
  service_options.job_expiry = options_.job_expiry;
  service_options.max_jobs = options_.max_jobs;
  service_options.max_members = options_.max_members;
  service_options.max_member_bytes = options_.max_member_bytes;
  service_options.max_reply_bytes = options_.limits.store.max_queued_reply_bytes;
  service_ = std::make_shared<RendezvousService>(io, std::move(service_options), timers);

  StoreServerOptions store_options;
  store_options.host = options_.host;
  store_options.port = options_.port;
  store_options.limits = options_.limits.store;
  store_options.frame_timeout = options_.limits.frame_timeout;
  store_options.idle_timeout = options_.limits.idle_timeout;
  store_options.handshake_timeout = options_.limits.handshake_timeout;
  store_options.link_stall_timeout = options_.limits.link_stall_timeout;
  store_options.reply_stall_timeout = options_.limits.reply_stall_timeout;
  store_options.extension = service_;
  try {
    store_ = std::make_unique<StoreServer>(io, std::move(store_options));
  } catch (...) {
    service_->shutdown();
    throw;
  }
  service_->attach(*store_);
  if (!options_.stop_signals.empty()) signals_ = std::make_unique<Signals>(io);
}

void RendezvousServer::abort_jobs(const std::string& reason, int exit_code) {
  if (service_) service_->abort_all(reason, exit_code);
}

RendezvousServer::~RendezvousServer() {
  stop();
  // The store's pending handlers may keep the service object alive after this; its timer must
  // not outlive the io_context, so it goes now.
  service_->shutdown();
  signals_.reset();
  store_.reset();
}

void RendezvousServer::start() {
  if (stopped_) return;
  store_->start();
  if (!signals_) return;
  for (int signo : options_.stop_signals) signals_->set.add(signo);
  signals_->set.async_wait([this](const boost::system::error_code& ec, int signo) {
    if (ec) return;
    spdlog::info("received {}, shutting down", signal_text(signo));
    stop();
    if (options_.on_signal) options_.on_signal(signo);
  });
}

void RendezvousServer::stop() {
  if (stopped_) return;
  stopped_ = true;
  service_->detach();
  store_->stop();
  if (signals_) {
    boost::system::error_code ignored;
    signals_->set.cancel(ignored);
  }
}

std::uint16_t RendezvousServer::port() const { return store_->port(); }
const std::string& RendezvousServer::host() const { return store_->host(); }

void RendezvousServer::on_drained(std::function<void()> callback) { store_->on_drained(std::move(callback)); }

StoreStats RendezvousServer::store_stats() const { return store_->stats(); }
RendezvousServiceStats RendezvousServer::service_stats() const { return service_->stats(); }

void RendezvousServer::set_token(std::string token) {
  if (!token.empty()) auth::require_crypto();
  options_.token = token;
  service_->set_token(std::move(token));
}

void RendezvousServer::set_previous_token(std::string token) {
  if (!token.empty()) auth::require_crypto();
  options_.previous_token = token;
  service_->set_previous_token(std::move(token));
}
const RendezvousRegistry& RendezvousServer::registry() const { return service_->registry(); }
std::optional<TimePoint> RendezvousServer::round_opened_at(const std::string& run_id) const {
  return service_->round_opened_at(run_id);
}

}  // namespace ddprun::rendezvous
