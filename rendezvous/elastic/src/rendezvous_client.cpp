// RendezvousClient (rendezvous_client.hpp has the contract).
//
// Link state (LinkState), one value at a time; every transition is made in one place:
//
//   from         event                                   to
//   -----------  --------------------------------------  ---------------------------------
//   idle         join() / report while unregistered      connecting
//   connecting   connected                               handshaking (HELLO sent)
//   handshaking  CHALLENGE without auth, or AUTH_OK       connected (JOIN/REJOIN if wanted)
//                with the server's MAC verified
//   handshaking  server MAC wrong, token missing          stopped (on_refused)
//   connecting   resolve/connect failed or timed out     retry_wait, or stopped (give up)
//   retry_wait   backoff timer fired                     connecting
//   connected    read/write error, EOF, protocol error   retry_wait, or stopped (give up)
//   connected    leave() while registered                leaving (LEAVE queued)
//   leaving      LEAVE written, or the write failed      stopped
//   any          stop(), job failed/completed, refused   stopped (final)
//
// Registration (Registration) is separate: none -> join_wanted (join() while not connected)
// -> registered (a JOIN or REJOIN was sent; every later connect sends REJOIN with the current
// assignment). The one remaining flag, write_in_flight, belongs to the write pipeline: at most
// one async_write at a time, whatever the link state.
#include "ddprun/rendezvous/rendezvous_client.hpp"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#include "ddprun/common/backoff.hpp"
#include "ddprun/common/error.hpp"
#include "ddprun/common/strings.hpp"
#include "ddprun/rendezvous/rendezvous_auth.hpp"
#include "ddprun/rendezvous/rendezvous_wire.hpp"

namespace ddprun::rendezvous {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

namespace {

// One connect attempt may not hang longer than this (a SYN to a dead host); the overall budget
// is options.give_up_after.
constexpr auto connect_attempt_limit = std::chrono::seconds(5);

std::string seconds_text(Duration d) { return format_seconds(d); }

}  // namespace

struct ClientCore : std::enable_shared_from_this<ClientCore> {
  enum class LinkState : std::uint8_t { idle, connecting, retry_wait, handshaking, connected, leaving, stopped };
  enum class Registration : std::uint8_t { none, join_wanted, registered };

  ClientCore(asio::io_context& io_, RendezvousClientOptions opts, RendezvousEvents ev, Timers& timers_)
      : options(std::move(opts)),
        events(std::move(ev)),
        timers(timers_),
        socket(io_),
        resolver(io_),
        heartbeat_timer(timers_.make_timer(io_)),
        retry_timer(timers_.make_timer(io_)),
        connect_timer(io_),
        backoff(Backoff::Options{std::chrono::milliseconds(50), std::chrono::seconds(2), 2.0, 0.5}) {}

  RendezvousClientOptions options;
  RendezvousEvents events;
  Timers& timers;
  tcp::socket socket;
  tcp::resolver resolver;
  std::unique_ptr<Timer> heartbeat_timer;  // protocol time: Timers
  std::unique_ptr<Timer> retry_timer;
  // Bounds one OS-level connect attempt (a SYN to a dead host): real time, not protocol time.
  asio::steady_timer connect_timer;
  Backoff backoff;
  WireLimits limits;

  // The connection generation: handlers of an older connection ignore their completions.
  std::uint64_t generation = 0;
  LinkState link = LinkState::idle;
  Registration registration = Registration::none;
  std::optional<Assignment> assignment;
  std::string client_nonce;  // of the current connection's handshake
  std::string server_nonce;
  std::string node_secret;  // from JOINED; presented by every REJOIN
  std::optional<TimePoint> unreachable_since;
  std::string last_error;
  bool host_embedded = false;  // the server said (CHALLENGE) it is a rendezvous inside one agent
  bool last_refused = false;   // the last connect was refused: nothing listens there

  std::string in;
  std::size_t in_begin = 0;
  std::string pending;           // frames queued for the current connection
  std::string writing;           // owned by the async_write in flight
  bool write_in_flight = false;  // the write pipeline: one async_write at a time
  // Success/failure reports of the current round, re-sent after every REJOIN: a report written
  // just before the daemon died may never have been read, and the registry ignores duplicates.
  std::vector<std::string> reports;

  // The endpoint tried now: options.server, then each of options.alternates in turn after a
  // failed connect or a lost connection (relays of one daemon).
  std::size_t current = 0;
  const Endpoint& server() const { return current == 0 ? options.server : options.alternates[current - 1]; }
  std::string endpoint_text() const { return server().to_string(); }
  std::string all_endpoints_text() const {
    std::vector<Endpoint> all{options.server};
    all.insert(all.end(), options.alternates.begin(), options.alternates.end());
    return endpoint_list_text(all);
  }
  bool stopped() const { return link == LinkState::stopped; }
  bool is_connected() const { return link == LinkState::connected || link == LinkState::leaving; }
  bool socket_up() const { return is_connected() || link == LinkState::handshaking; }
  bool registered() const { return registration == Registration::registered; }

  // ---- outgoing ----

  void send_frame(const ClientMessage& m) {
    encode_client(pending, m);
    start_write();
  }

  void start_write() {
    if (!socket_up() || write_in_flight || pending.empty()) return;
    writing.swap(pending);
    pending.clear();
    write_in_flight = true;
    asio::async_write(socket, asio::buffer(writing),
                      [self = shared_from_this(), gen = generation](boost::system::error_code ec, std::size_t) {
                        // A write of an older connection: connection_lost/stop already reset the
                        // buffers, which may belong to the new connection's write by now.
                        if (gen != self->generation) return;
                        self->write_in_flight = false;
                        self->writing.clear();
                        if (self->stopped()) return;
                        if (ec) {
                          self->connection_lost(fmt::format("write failed: {}", ec.message()));
                          return;
                        }
                        self->start_write();
                        if (self->link == LinkState::leaving && !self->write_in_flight) self->stop();
                      });
  }

  void send_join_or_rejoin() {
    if (registration == Registration::join_wanted) {
      reports.clear();
      send_frame(JoinMessage{options.run_id, JoinRequest{options.node, options.config}});
    } else {
      send_frame(RejoinMessage{options.run_id, RejoinRequest{options.node, options.config, node_secret, assignment}});
      for (const auto& frame : reports) pending.append(frame);
    }
    registration = Registration::registered;
    start_write();
  }

  // A report: sent now if registered, else after the next (re)registration.
  void report(const ClientMessage& m) {
    if (stopped() || link == LinkState::leaving) return;
    std::string frame;
    encode_client(frame, m);
    if (is_connected() && registered()) {
      pending.append(frame);
      start_write();
    } else {
      ensure_connecting();
    }
    reports.push_back(std::move(frame));
  }

  // ---- connection management ----

  // Only from idle: connecting and connected need nothing, retry_wait connects when its
  // backoff timer fires.
  void ensure_connecting() {
    if (link == LinkState::idle) connect();
  }

  void connect() {
    if (stopped()) return;
    link = LinkState::connecting;
    const std::uint64_t gen = ++generation;
    resolver.async_resolve(
        server().host, std::to_string(server().port),
        [self = shared_from_this(), gen](boost::system::error_code ec, tcp::resolver::results_type results) {
          if (gen != self->generation || self->stopped()) return;
          if (ec) {
            self->connect_failed(fmt::format("cannot resolve '{}': {}", self->server().host, ec.message()));
            return;
          }
          self->connect_timer.expires_after(connect_attempt_limit);
          self->connect_timer.async_wait([weak = std::weak_ptr<ClientCore>(self), gen](boost::system::error_code tec) {
            auto s = weak.lock();
            if (tec || !s || gen != s->generation || s->link != LinkState::connecting) return;
            boost::system::error_code ignored;
            s->socket.close(ignored);  // the pending connect completes with operation_aborted
          });
          asio::async_connect(self->socket, results, [self, gen](boost::system::error_code cec, const tcp::endpoint&) {
            self->connect_timer.cancel();
            if (gen != self->generation || self->stopped()) return;
            if (cec) {
              self->last_refused = cec == asio::error::connection_refused;
              self->connect_failed(cec == asio::error::operation_aborted
                                       ? std::string("connect timed out")
                                       : fmt::format("connect failed: {}", cec.message()));
              return;
            }
            self->on_connected();
          });
        });
  }

  // connecting -> handshaking: every (re)connect authenticates before anything else is sent.
  void on_connected() {
    link = LinkState::handshaking;
    last_refused = false;
    boost::system::error_code ec;
    socket.set_option(tcp::no_delay(true), ec);
    in.clear();
    in_begin = 0;
    pending.clear();
    client_nonce = auth::random_hex(auth::nonce_bytes);
    send_frame(HelloMessage{1, client_nonce});
    start_read();
  }

  void on_challenge(const ChallengeMessage& m) {
    if (link != LinkState::handshaking) {
      connection_lost("protocol error from the server: CHALLENGE outside the handshake");
      return;
    }
    host_embedded = m.embedded;
    if (!m.auth) {
      if (!options.token.empty()) {
        // Anything can say "no token needed"; only the daemon that holds it can prove it (AUTH_OK).
        // A client with a token never takes assignments from a server that did not.
        refused(
            fmt::format("the rendezvous server {} did not ask for the token: it is not the daemon the token "
                        "is for, or that daemon runs without one. Check --rdzv-endpoint, or unset "
                        "DDPRUN_RDZV_TOKEN / the token_file setting to use a daemon without a token",
                        endpoint_text()));
        return;
      }
      handshake_done();
      return;
    }
    if (options.token.empty()) {
      refused(
          fmt::format("the rendezvous server {} requires a token: set DDPRUN_RDZV_TOKEN or --rdzv-conf "
                      "token_file=FILE to the daemon's token",
                      endpoint_text()));
      return;
    }
    server_nonce = m.server_nonce;
    send_frame(
        AuthMessage{options.run_id, auth::client_mac(options.token, server_nonce, client_nonce, options.run_id)});
  }

  void on_auth_ok(const AuthOkMessage& m) {
    if (link != LinkState::handshaking || server_nonce.empty()) {
      connection_lost("protocol error from the server: AUTH_OK outside the handshake");
      return;
    }
    if (!auth::equal_secret(auth::server_mac(options.token, client_nonce, server_nonce, options.run_id), m.mac)) {
      refused(
          fmt::format("the rendezvous server {} could not prove that it knows the token (wrong MAC in AUTH_OK): "
                      "check --rdzv-endpoint and the token on both sides",
                      endpoint_text()));
      return;
    }
    handshake_done();
  }

  // handshaking -> connected.
  void handshake_done() {
    link = LinkState::connected;
    server_nonce.clear();
    unreachable_since.reset();
    backoff.reset();
    spdlog::debug("rendezvous: connected to {}", endpoint_text());
    if (registration != Registration::none) send_join_or_rejoin();
    arm_heartbeat();
  }

  void refused(const std::string& reason) {
    stop();
    if (events.on_refused) events.on_refused(reason);
  }

  void connect_failed(std::string why) {
    boost::system::error_code ec;
    socket.close(ec);
    last_error = std::move(why);
    schedule_reconnect();
  }

  void connection_lost(std::string why) {
    if (stopped()) return;
    if (link == LinkState::leaving) {
      stop();
      return;
    }
    spdlog::warn("rendezvous: connection to {} lost ({}); reconnecting", endpoint_text(), why);
    ++generation;
    boost::system::error_code ec;
    socket.close(ec);
    heartbeat_timer->cancel();
    write_in_flight = false;  // the socket is closed: the aborted write no longer reads `writing`
    writing.clear();
    pending.clear();
    last_error = std::move(why);
    schedule_reconnect();
  }

  // From connecting (failed) or connected (lost): retry_wait, or stopped when the server has
  // been unreachable for give_up_after.
  void schedule_reconnect() {
    if (stopped()) return;
    const TimePoint now = timers.clock().now();
    if (!unreachable_since) unreachable_since = now;
    const Duration down = now - *unreachable_since;
    if (host_embedded && last_refused && options.alternates.empty()) {
      // Nothing listens where an agent hosted the rendezvous: that agent is gone, and with it the
      // job's state; nobody else serves that address (torchrun fails at once too).
      const std::string msg = fmt::format(
          "the rendezvous at {} was hosted by the agent on that node (no ddprun-rdzvd), and it is gone "
          "({}): the job cannot go on without it. Use ddprun-rdzvd (or --rdzv-backend etcd) for jobs that must "
          "survive the loss of any node",
          endpoint_text(), last_error);
      stop();
      if (events.on_unreachable) events.on_unreachable(msg);
      return;
    }
    if (down >= options.give_up_after) {
      give_up();
      return;
    }
    Duration delay = std::chrono::duration_cast<Duration>(backoff.next_delay());
    delay = std::min(delay, options.give_up_after - down);
    if (!options.alternates.empty()) {
      current = (current + 1) % (options.alternates.size() + 1);
      spdlog::info("rendezvous: trying {} next (--rdzv-endpoint lists {})", endpoint_text(), all_endpoints_text());
    }
    link = LinkState::retry_wait;
    retry_timer->arm(now + delay, [self = shared_from_this()] {
      if (self->link != LinkState::retry_wait) return;
      self->connect();
    });
  }

  void give_up() {
    const std::string msg = fmt::format(
        "rendezvous server {} unreachable for {} (last error: {}); is ddprun-rdzvd running there? "
        "Check --rdzv-endpoint and that the port is open; without a daemon, the node that names the endpoint "
        "hosts it (pass --rdzv-conf is_host=1 there if it is not recognised as that machine)",
        all_endpoints_text(), seconds_text(options.give_up_after), last_error.empty() ? "none" : last_error);
    stop();
    if (events.on_unreachable) events.on_unreachable(msg);
  }

  void arm_heartbeat() {
    if (!is_connected()) return;
    heartbeat_timer->arm(timers.clock().now() + options.config.heartbeat_interval,
                         [self = shared_from_this(), gen = generation] {
                           if (gen != self->generation || !self->is_connected()) return;
                           if (self->registered())
                             self->send_frame(HeartbeatMessage{self->options.run_id, self->options.node.id});
                           self->arm_heartbeat();
                         });
  }

  // ---- incoming ----

  void start_read() {
    if (in_begin > 0 && in_begin == in.size()) {
      in.clear();
      in_begin = 0;
    }
    const std::size_t old = in.size();
    in.resize(old + 64 * 1024);
    socket.async_read_some(
        asio::buffer(in.data() + old, in.size() - old),
        [self = shared_from_this(), gen = generation, old](boost::system::error_code ec, std::size_t n) {
          if (gen != self->generation || self->stopped()) return;
          self->in.resize(old + n);
          if (ec) {
            self->connection_lost(ec == asio::error::eof ? std::string("closed by the server") : ec.message());
            return;
          }
          self->process();
          if (gen != self->generation || self->stopped()) return;
          self->start_read();
        });
  }

  void process() {
    // Keep ourselves alive: a callback may destroy the RendezvousClient.
    auto keep = shared_from_this();
    const std::uint64_t gen = generation;
    while (!stopped() && gen == generation) {
      ServerMessage msg;
      DecodeResult r = decode_server(std::string_view(in).substr(in_begin), limits, msg);
      if (r.status == DecodeStatus::need_more) break;
      if (r.status != DecodeStatus::ok) {
        connection_lost(fmt::format("protocol error from the server: {}", r.reason));
        return;
      }
      in_begin += r.consumed;
      dispatch(msg);
    }
    if (in_begin > 0 && !stopped() && gen == generation) {
      in.erase(0, in_begin);
      in_begin = 0;
    }
  }

  void dispatch(ServerMessage& msg) {
    std::visit(
        [&](auto& m) {
          using T = std::decay_t<decltype(m)>;
          if constexpr (std::is_same_v<T, SendAssignment>) {
            assignment = m.assignment;
            if (events.on_assignment) events.on_assignment(m.assignment);
          } else if constexpr (std::is_same_v<T, SendRestart>) {
            assignment.reset();
            reports.clear();
            if (events.on_restart) events.on_restart(m);
          } else if constexpr (std::is_same_v<T, SendJobFailed>) {
            stop();
            if (events.on_job_failed) events.on_job_failed(m);
          } else if constexpr (std::is_same_v<T, SendJobCompleted>) {
            stop();
            if (events.on_job_completed) events.on_job_completed();
          } else if constexpr (std::is_same_v<T, Refuse>) {
            refused(m.reason);
          } else if constexpr (std::is_same_v<T, ChallengeMessage>) {
            on_challenge(m);
          } else if constexpr (std::is_same_v<T, AuthOkMessage>) {
            on_auth_ok(m);
          } else if constexpr (std::is_same_v<T, JoinedMessage>) {
            node_secret = m.node_secret;
          } else if constexpr (std::is_same_v<T, AskRejoin>) {
            spdlog::info("rendezvous {}: {}; re-registering", endpoint_text(), m.reason);
            send_join_or_rejoin();
          } else if constexpr (std::is_same_v<T, Progress>) {
            if (events.on_progress) events.on_progress(m.text);
          } else {
            spdlog::debug("rendezvous: ignoring an unexpected STATUS_REPLY");
          }
        },
        msg);
  }

  // Any state -> stopped (final).
  void stop() {
    if (stopped()) return;
    link = LinkState::stopped;
    ++generation;
    write_in_flight = false;
    boost::system::error_code ec;
    resolver.cancel();
    heartbeat_timer->cancel();
    retry_timer->cancel();
    connect_timer.cancel();
    if (socket.is_open()) {
      socket.shutdown(tcp::socket::shutdown_both, ec);
      socket.close(ec);
    }
  }
};

struct RendezvousClient::Impl {
  std::shared_ptr<ClientCore> core;
  ClientCore* operator->() const { return core.get(); }
  ClientCore& operator*() const { return *core; }
};

namespace {

struct ResolvedName {
  boost::system::error_code ec;
  std::vector<tcp::endpoint> endpoints;
};

// Name lookups under way, or finished after their query gave up and not used since.
struct Lookup {
  std::uint64_t id = 0;
  std::shared_future<ResolvedName> answer;
};
struct PendingLookups {
  std::mutex mutex;
  std::uint64_t next_id = 1;
  std::map<std::string, Lookup> by_name;
};
PendingLookups& pending_lookups() {
  static PendingLookups p;
  return p;
}
std::string lookup_key(const std::string& host, std::uint16_t port) { return host + "\n" + std::to_string(port); }

// `host`:`port` resolved on a detached thread (getaddrinfo cannot be cancelled). A lookup of the
// same name still under way is shared rather than started again, and one that finished after
// its query gave up answers the next query (a name server slower than the timeout still
// answers every other tick); once an answer is used (lookup_used), a query starts a new lookup.
Lookup resolve_in_background(const std::string& host, std::uint16_t port) {
  auto& p = pending_lookups();
  const std::lock_guard lock(p.mutex);
  if (const auto it = p.by_name.find(lookup_key(host, port)); it != p.by_name.end()) return it->second;
  auto promise = std::make_shared<std::promise<ResolvedName>>();
  std::shared_future<ResolvedName> future = promise->get_future().share();
  std::thread([promise, host, port = std::to_string(port)] {
    ResolvedName r;
    asio::io_context rio(1);
    tcp::resolver name_resolver(rio);
    for (const auto& e : name_resolver.resolve(host, port, r.ec)) r.endpoints.push_back(e.endpoint());
    promise->set_value(std::move(r));
  }).detach();
  const Lookup lookup{p.next_id++, future};
  p.by_name.emplace(lookup_key(host, port), lookup);
  return lookup;
}

// The answer of `lookup` was used: the next query of the name asks the name server again.
void lookup_used(const std::string& host, std::uint16_t port, const Lookup& lookup) {
  auto& p = pending_lookups();
  const std::lock_guard lock(p.mutex);
  if (const auto it = p.by_name.find(lookup_key(host, port)); it != p.by_name.end() && it->second.id == lookup.id) {
    p.by_name.erase(it);
  }
}

// A client with a token needs the handshake's cryptography: checked before anything connects.
RendezvousClientOptions with_crypto(RendezvousClientOptions options) {
  if (!options.token.empty()) auth::require_crypto();
  return options;
}
}  // namespace

RendezvousClient::RendezvousClient(asio::io_context& io, RendezvousClientOptions options, RendezvousEvents events,
                                   Timers& timers)
    : impl_(std::make_unique<Impl>(
          Impl{std::make_shared<ClientCore>(io, with_crypto(std::move(options)), std::move(events), timers)})) {}

RendezvousClient::~RendezvousClient() {
  if (impl_) impl_->core->stop();
}

void RendezvousClient::set_nccl_ids(std::vector<std::uint8_t> ids) {
  impl_->core->options.node.nccl_ids = std::move(ids);
}

void RendezvousClient::join() {
  auto& s = *impl_->core;
  if (s.stopped() || s.link == ClientCore::LinkState::leaving) return;
  s.assignment.reset();
  s.reports.clear();
  if (s.registration != ClientCore::Registration::registered) s.registration = ClientCore::Registration::join_wanted;
  if (!s.is_connected()) {
    s.ensure_connecting();  // the JOIN (or REJOIN when registered) goes out once connected
  } else if (s.registered()) {
    // A known node joining again: the server treats a JOIN from a member as "next round".
    s.send_frame(JoinMessage{s.options.run_id, JoinRequest{s.options.node, s.options.config}});
  } else {
    s.send_join_or_rejoin();
  }
}

void RendezvousClient::report_failure(const WorkerFailure& failure) {
  WorkerFailure f = failure;
  f.node = impl_->core->options.node.id;
  impl_->core->report(WorkerFailedMessage{impl_->core->options.run_id, std::move(f)});
}

void RendezvousClient::report_success(std::uint64_t round) {
  impl_->core->report(SucceededMessage{impl_->core->options.run_id, impl_->core->options.node.id, round});
}

void RendezvousClient::leave() {
  auto& s = *impl_->core;
  if (s.stopped() || s.link == ClientCore::LinkState::leaving) return;
  if (!s.is_connected() || !s.registered()) {
    s.stop();
    return;
  }
  // connected -> leaving: send LEAVE after whatever is queued, then stop once it is written
  // (or the write fails).
  s.link = ClientCore::LinkState::leaving;
  s.heartbeat_timer->cancel();
  s.retry_timer->cancel();
  s.send_frame(LeaveMessage{s.options.run_id, s.options.node.id});
}

void RendezvousClient::stop() { impl_->core->stop(); }

const std::optional<Assignment>& RendezvousClient::current_assignment() const { return impl_->core->assignment; }

bool RendezvousClient::connected() const { return impl_->core->is_connected(); }

RegistryStatus query_status(const Endpoint& server, const std::string& run_id, std::chrono::milliseconds timeout,
                            const std::string& token) {
  if (!token.empty()) auth::require_crypto();
  asio::io_context io(1);
  tcp::socket socket(io);
  std::optional<RegistryStatus> result;
  std::string error;
  const std::string client_nonce = auth::random_hex(auth::nonce_bytes);
  const std::string bound_run = run_id.empty() ? std::string(auth::any_run) : run_id;
  std::string server_nonce;
  std::string in;
  const WireLimits limits{std::size_t{64} << 20, 16};  // a status of many jobs can be large
  std::function<void()> read_more;
  // HELLO, then AUTH (with a token), then STATUS: each sent once, in its own buffer, each after
  // the server's answer to the one before (a server that answers out of turn is refused below,
  // so at most three writes are ever in flight).
  auto send = [&](const ClientMessage& m) {
    auto out = std::make_shared<std::string>();
    encode_client(*out, m);
    asio::async_write(socket, asio::buffer(*out), [&, out](boost::system::error_code wec, std::size_t) {
      if (wec && error.empty()) error = wec.message();
    });
  };
  bool challenged = false;
  bool authenticated = false;
  const auto out_of_turn = [&](const char* what) {
    error = fmt::format(
        "the server sent {} out of turn: it does not follow ddprun's rendezvous handshake (an impostor, or "
        "not a ddprun-rdzvd)",
        what);
    return true;
  };
  // Returns true when the exchange is over (result or error).
  auto on_message = [&](ServerMessage& msg) -> bool {
    if (auto* c = std::get_if<ChallengeMessage>(&msg)) {
      if (challenged) return out_of_turn("a second CHALLENGE");
      challenged = true;
      if (!c->auth) {
        if (!token.empty()) {
          error =
              "the server did not ask for the token: it is not the daemon the token is for, or that daemon runs "
              "without one (unset DDPRUN_RDZV_TOKEN or drop --token-file to query a daemon without a token)";
          return true;
        }
        send(StatusMessage{run_id});
        return false;
      }
      if (token.empty()) {
        error = "the daemon requires a token: set DDPRUN_RDZV_TOKEN or pass --token-file FILE";
        return true;
      }
      server_nonce = c->server_nonce;
      send(AuthMessage{bound_run, auth::client_mac(token, server_nonce, client_nonce, bound_run)});
      return false;
    }
    if (auto* ok = std::get_if<AuthOkMessage>(&msg)) {
      if (authenticated) return out_of_turn("a second AUTH_OK");
      authenticated = true;
      if (server_nonce.empty() ||
          !auth::equal_secret(auth::server_mac(token, client_nonce, server_nonce, bound_run), ok->mac)) {
        error = "the server could not prove that it knows the token (wrong MAC in AUTH_OK)";
        return true;
      }
      send(StatusMessage{run_id});
      return false;
    }
    if (auto* r = std::get_if<Refuse>(&msg)) {
      error = "refused: " + ddprun::terminal_safe(r->reason);
      return true;
    }
    if (auto* s = std::get_if<RegistryStatus>(&msg)) {
      result = std::move(*s);
      return true;
    }
    return false;  // not ours (cannot happen on a fresh connection)
  };
  read_more = [&] {
    const std::size_t old = in.size();
    in.resize(old + 64 * 1024);
    socket.async_read_some(asio::buffer(in.data() + old, in.size() - old),
                           [&, old](boost::system::error_code ec, std::size_t n) {
                             in.resize(old + n);
                             if (ec) {
                               if (error.empty())
                                 error = ec == asio::error::eof ? "the server closed the connection" : ec.message();
                               return;
                             }
                             for (;;) {
                               ServerMessage msg;
                               DecodeResult r = decode_server(in, limits, msg);
                               if (r.status == DecodeStatus::need_more) break;
                               if (r.status == DecodeStatus::error) {
                                 error = r.reason;
                                 return;
                               }
                               in.erase(0, r.consumed);
                               if (on_message(msg)) {
                                 socket.close(ec);
                                 return;
                               }
                             }
                             read_more();
                           });
  };
  // getaddrinfo cannot be cancelled, and Asio's resolver thread is joined when its io_context
  // goes: a slow or black-holed DNS server held the call past `timeout`. The name is resolved on
  // a thread of its own, waited for no longer than the timeout and then left to finish alone.
  // A lookup still under way is shared by the next query of the same name (`status --watch`
  // asks every interval): one thread per name, not one per tick.
  const auto started = std::chrono::steady_clock::now();
  const Lookup lookup = resolve_in_background(server.host, server.port);
  const std::shared_future<ResolvedName>& resolved_future = lookup.answer;
  const bool answered = resolved_future.wait_for(timeout) == std::future_status::ready;
  if (answered) lookup_used(server.host, server.port, lookup);
  if (!answered) {
    error =
        fmt::format("cannot resolve '{}' within {} ms (the name server does not answer)", server.host, timeout.count());
  } else if (const ResolvedName& r = resolved_future.get(); r.ec || r.endpoints.empty()) {
    error = fmt::format("cannot resolve '{}': {}", server.host, r.ec ? r.ec.message() : "no address");
  } else {
    asio::async_connect(socket, r.endpoints, [&](boost::system::error_code cec, const tcp::endpoint&) {
      if (cec) {
        error = cec.message();
        return;
      }
      send(HelloMessage{1, client_nonce});
      read_more();
    });
    const auto left =
        timeout - std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - started);
    io.run_for(std::max(left, std::chrono::milliseconds(1)));
  }
  if (result) return std::move(*result);
  if (error.empty()) error = fmt::format("no reply within {} ms", timeout.count());
  // This side's decode limit (split_frame's words), not a server's text (a refusal's starts "refused: ").
  if (run_id.empty() && error.rfind("rendezvous STATUS_REPLY payload of ", 0) == 0) {
    // The status of every job is one reply, bounded on this side: a daemon holding tens of
    // thousands of jobs with long names passes it.
    throw NetworkError(fmt::format("cannot get the rendezvous status from {}: {}", server.to_string(), error),
                       "the daemon holds too many jobs to list at once: ask for one with --rdzv-id ID");
  }
  // A reply refused at its decode cap (json_capped.hpp, json_dom_cap_bytes): a real daemon's
  // status, of one job or of many, stays far below it, so this is not a daemon of ddprun's.
  if (error.rfind("bad rendezvous STATUS_REPLY message: a payload of ", 0) == 0 &&
      error.find("to decode") != std::string::npos) {
    throw NetworkError(
        fmt::format("cannot get the rendezvous status from {}: {}", server.to_string(), error),
        "no ddprun-rdzvd sends such a reply: check that --rdzv-endpoint names a ddprun-rdzvd (to ask a daemon about "
        "one job, pass --rdzv-id ID)");
  }
  throw NetworkError(fmt::format("cannot get the rendezvous status from {}: {}", server.to_string(), error),
                     "check --rdzv-endpoint, that ddprun-rdzvd is running there and, if it has a token, that "
                     "DDPRUN_RDZV_TOKEN or --token-file holds it");
}

}  // namespace ddprun::rendezvous
