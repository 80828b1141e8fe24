#include "ddprun/rendezvous/rendezvous_service.hpp"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <optional>
#include <limits>
#include <type_traits>
#include <utility>

#include "ddprun/rendezvous/rendezvous_auth.hpp"
#include "ddprun/rendezvous/rendezvous_metrics.hpp"
#include "ddprun/rendezvous/store_server.hpp"

namespace ddprun::rendezvous {

RendezvousService::RendezvousService(boost::asio::io_context& io, RendezvousServiceOptions options, Timers& timers)
    : options_(std::move(options)),
      clock_(timers.clock()),
      started_(clock_.now()),
      registry_(options_.job_expiry, options_.max_jobs, options_.max_members, options_.max_member_bytes),
      timer_(timers.make_timer(io)) {}

RendezvousService::~RendezvousService() = default;

void RendezvousService::attach(StoreServer& server) { server_ = &server; }
void RendezvousService::detach() {
  server_ = nullptr;
  if (timer_) timer_->cancel();
  armed_.reset();
}

void RendezvousService::shutdown() {
  detach();
  timer_.reset();
}

std::optional<TimePoint> RendezvousService::round_opened_at(const std::string& run_id) const {
  const auto it = round_open_.find(run_id);
  if (it == round_open_.end()) return std::nullopt;
  return it->second;
}

RendezvousServiceStats RendezvousService::stats() const {
  RendezvousServiceStats s = counters_;
  s.jobs = registry_.job_count();
  s.nodes = node_of_.size();
  s.node_secrets = secret_of_.size();
  return s;
}

namespace {

// The run id and node a client frame names, for the REFUSED that answers it.
std::pair<std::string, NodeId> subject_of(const ClientMessage& message) {
  return std::visit(
      [](const auto& m) -> std::pair<std::string, NodeId> {
        using T = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<T, JoinMessage> || std::is_same_v<T, RejoinMessage>) {
          return {m.run_id, m.request.node.id};
        } else if constexpr (std::is_same_v<T, HeartbeatMessage> || std::is_same_v<T, LeaveMessage> ||
                             std::is_same_v<T, SucceededMessage>) {
          return {m.run_id, m.node};
        } else if constexpr (std::is_same_v<T, WorkerFailedMessage>) {
          return {m.run_id, m.failure.node};
        } else if constexpr (std::is_same_v<T, HelloMessage> || std::is_same_v<T, RelayMessage>) {
          return {};
        } else {
          return {m.run_id, NodeId{}};
        }
      },
      message);
}

std::uint8_t op_of(const ClientMessage& message) {
  static constexpr std::array<NativeOp, std::variant_size_v<ClientMessage>> ops{
      NativeOp::join,          NativeOp::rejoin,    NativeOp::heartbeat, NativeOp::leave,
      NativeOp::worker_failed, NativeOp::succeeded, NativeOp::close,     NativeOp::status,
      NativeOp::hello,         NativeOp::auth,      NativeOp::relay};
  return static_cast<std::uint8_t>(ops[message.index()]);
}

// Removes from `decisions` the refusal of `node`, if there is one, and returns it.
std::optional<Refuse> take_refusal(Decisions& decisions, const NodeId& node) {
  const auto it = std::find_if(decisions.begin(), decisions.end(), [&](const Decision& d) {
    const auto* r = std::get_if<Refuse>(&d);
    return r != nullptr && r->node == node;
  });
  if (it == decisions.end()) return std::nullopt;
  Refuse r = std::move(std::get<Refuse>(*it));
  decisions.erase(it);
  return r;
}

}  // namespace

DecodeResult RendezvousService::on_frame(ConnectionId conn, std::string_view buffer, StoreState& state,
                                         Outbox& outbox) {
  (void)state;
  // Before AUTH on a daemon with a token only HELLO and AUTH can be accepted, and both are a few
  // hundred bytes: a frame that declares more is refused from its header, so connections that
  // never authenticate cannot make the daemon buffer a megabyte each.
  if (!options_.token.empty() && buffer.size() >= native_header_bytes) {
    auto session = sessions_.find(conn);
    if (session == sessions_.end() || session->second.run_id.empty()) {
      std::uint32_t declared = 0;
      for (std::size_t i = 0; i < 4; ++i) {
        declared |= static_cast<std::uint32_t>(static_cast<unsigned char>(buffer[1 + i])) << (8 * i);
      }
      if (declared > max_handshake_payload_bytes) {
        ++counters_.frames_malformed;
        DecodeResult refused;
        refused.status = DecodeStatus::error;
        refused.reason = fmt::format(
            "a {} frame of {} bytes before authentication: until AUTH succeeds only HELLO and AUTH are accepted, "
            "at most {} bytes each",
            native_op_name(static_cast<std::uint8_t>(buffer[0])), declared, max_handshake_payload_bytes);
        return refused;
      }
    }
  }
  DecodeResult r = decode_client(buffer, options_.limits, message_);
  if (r.status == DecodeStatus::error) ++counters_.frames_malformed;
  if (r.status != DecodeStatus::ok) return r;
  ++counters_.frames;
  outbox_ = &outbox;
  // Replies of this frame go through the server's outbox: flushed after the batch of frames.
  struct Reset {
    Outbox*& p;
    ~Reset() { p = nullptr; }
  } reset{outbox_};
  if (Refusal why = handle(conn, message_); why.refused()) {
    // REFUSED, then the store server closes the connection and logs the reason with the peer.
    ++counters_.refused[static_cast<std::size_t>(why.code)];
    r.reason = fmt::format("rendezvous {} refused: {}", native_op_name(op_of(message_)), why.reason);
    auto [run_id, node] = subject_of(message_);
    scratch_.clear();
    encode_decision(scratch_, Refuse{std::move(run_id), std::move(node), std::move(why.reason), why.code});
    emit(conn, scratch_);
    r.status = DecodeStatus::error;
    r.consumed = 0;
  }
  rearm();
  return r;
}

RendezvousService::Refusal RendezvousService::handshake(ConnectionId conn, ClientMessage& message) {
  if (auto* hello = std::get_if<HelloMessage>(&message)) {
    auto [it, fresh] = sessions_.try_emplace(conn);
    if (!fresh) return {RefuseCode::auth, "HELLO sent twice on one connection"};
    it->second.server_nonce = auth::random_hex(auth::nonce_bytes);
    it->second.client_nonce = std::move(hello->client_nonce);
    scratch_.clear();
    encode_server(scratch_, ChallengeMessage{it->second.server_nonce, !options_.token.empty(), options_.embedded});
    emit(conn, scratch_);
    return {};
  }
  auto& m = std::get<AuthMessage>(message);
  auto it = sessions_.find(conn);
  if (it == sessions_.end()) return {RefuseCode::auth, "AUTH before HELLO: open the connection with HELLO"};
  if (options_.token.empty()) return {RefuseCode::auth, "this daemon has no token: AUTH is not needed"};
  Session& s = it->second;
  if (s.auth_tried) return {RefuseCode::auth, "one AUTH per connection"};
  s.auth_tried = true;
  if (m.run_id.empty() || m.run_id.size() > max_run_id_bytes) {
    return {RefuseCode::auth,
            fmt::format("AUTH names a run id of {} bytes: it must have 1 to {}", m.run_id.size(), max_run_id_bytes)};
  }
  const std::string* proved = &options_.token;
  if (!auth::equal_secret(auth::client_mac(options_.token, s.server_nonce, s.client_nonce, m.run_id), m.mac)) {
    // A token rotated out (--previous-token-file) still binds a connection to one job, for its
    // nodes to REJOIN (check_previous_token); never "*" (relays, STATUS of every job).
    const bool previous =
        !options_.previous_token.empty() && m.run_id != auth::any_run &&
        auth::equal_secret(auth::client_mac(options_.previous_token, s.server_nonce, s.client_nonce, m.run_id), m.mac);
    if (!previous) {
      return {RefuseCode::auth,
              "authentication failed: the client's token does not match this daemon's (check DDPRUN_RDZV_TOKEN or "
              "the token file on both sides)"};
    }
    proved = &options_.previous_token;
    s.previous_token = true;
  }
  s.run_id = m.run_id;
  scratch_.clear();
  encode_server(scratch_, AuthOkMessage{auth::server_mac(*proved, s.client_nonce, s.server_nonce, s.run_id)});
  emit(conn, scratch_);
  return {};
}

RendezvousService::Refusal RendezvousService::relay(ConnectionId conn, const RelayMessage& m) {
  // A relay speaks for many peers: only a holder of the daemon's token, bound to every job, may.
  if (options_.token.empty()) {
    return {RefuseCode::auth,
            "this daemon has no token, and relays need one: start ddprun-rdzvd with --token-file (or "
            "DDPRUN_RDZV_TOKEN) and give the relay the same token"};
  }
  auto it = sessions_.find(conn);
  if (it == sessions_.end() || it->second.run_id != auth::any_run) {
    return {RefuseCode::auth, "RELAY needs a connection authenticated for every job (AUTH with run id \"*\")"};
  }
  if (node_of_.count(conn) != 0) {
    return {RefuseCode::not_owner, "a connection that speaks for a node cannot become a relay link"};
  }
  if (std::string why = outbox_->make_relay_link(conn, m.trusted_frames); !why.empty()) {
    return {RefuseCode::other, why};
  }
  // RELAY_OK is the last frame of the plain protocol: the server reads relay frames after this
  // one, and everything it writes to the link from now on follows it.
  scratch_.clear();
  encode_relay_ok(scratch_, m.trusted_frames);
  emit(conn, scratch_);
  ++counters_.relay_links;
  return {};
}

RendezvousService::Refusal RendezvousService::check_run(ConnectionId conn, const std::string& run_id) const {
  if (options_.token.empty()) return {};
  auto it = sessions_.find(conn);
  if (it == sessions_.end() || it->second.run_id.empty()) {
    return {RefuseCode::auth,
            "authentication required: this daemon has a token; send HELLO and AUTH first (the agent reads "
            "DDPRUN_RDZV_TOKEN or --rdzv-conf token_file=...)"};
  }
  const std::string& bound = it->second.run_id;
  if (bound == auth::any_run || bound == run_id) return {};
  return {RefuseCode::auth, fmt::format("this connection authenticated for rendezvous '{}', not '{}'", bound, run_id)};
}

RendezvousService::Refusal RendezvousService::check_previous_token(ConnectionId conn, const std::string& run_id,
                                                                   const NodeId& node) const {
  auto it = sessions_.find(conn);
  if (it == sessions_.end() || !it->second.previous_token) return {};
  // A node that re-registered on this connection joins its job's next rounds as any member does.
  auto own = node_of_.find(conn);
  if (own != node_of_.end() && own->second.run_id == run_id && own->second.node == node) return {};
  return {RefuseCode::auth,
          fmt::format("this connection proved the daemon's previous token (--previous-token-file): its nodes of "
                      "rendezvous '{}' may REJOIN, but a JOIN needs the current token (give new agents the new "
                      "DDPRUN_RDZV_TOKEN)",
                      run_id)};
}

RendezvousService::Refusal RendezvousService::check_previous_token_rejoin(ConnectionId conn, const std::string& run_id,
                                                                          const NodeId& node, TimePoint now) const {
  auto it = sessions_.find(conn);
  if (it == sessions_.end() || !it->second.previous_token) return {};
  if (secret_of_.count(NodeKey{run_id, node}) != 0) return {};     // known: check_rejoin checked its secret
  if (now - started_ < options_.previous_token_window) return {};  // a restart forgot the secrets
  return {RefuseCode::auth,
          fmt::format("this connection proved the daemon's previous token (--previous-token-file): it re-registers "
                      "only nodes this daemon knows, or any node within {} of its start, and node {} of rendezvous "
                      "'{}' is not one (give new agents the new DDPRUN_RDZV_TOKEN)",
                      format_seconds(options_.previous_token_window), node.to_string(), run_id)};
}

RendezvousService::Refusal RendezvousService::check_owner(ConnectionId conn, const std::string& run_id,
                                                          const NodeId& node) const {
  auto it = conn_of_.find(NodeKey{run_id, node});
  if (it != conn_of_.end() && it->second == conn) return {};
  return {RefuseCode::not_owner,
          fmt::format("node {} of rendezvous '{}' is not owned by this connection (only the connection that "
                      "joined as it may speak for it)",
                      node.to_string(), run_id)};
}

RendezvousService::Refusal RendezvousService::check_join(ConnectionId conn, const std::string& run_id,
                                                         const NodeId& node) const {
  auto own = node_of_.find(conn);
  if (own != node_of_.end() && !(own->second.run_id == run_id && own->second.node == node)) {
    return {RefuseCode::not_owner, fmt::format("this connection already speaks for node {} of rendezvous '{}'",
                                               own->second.node.to_string(), own->second.run_id)};
  }
  const NodeKey key{run_id, node};
  auto it = conn_of_.find(key);
  if (it != conn_of_.end() && it->second != conn) {
    return {RefuseCode::not_owner, fmt::format("node {} of rendezvous '{}' is already a member from another connection",
                                               node.to_string(), run_id)};
  }
  if (it == conn_of_.end() && secret_of_.count(key) != 0) {
    return {RefuseCode::not_owner,
            fmt::format("node {} of rendezvous '{}' is a known member: it must REJOIN with its node secret",
                        node.to_string(), run_id)};
  }
  return {};
}

RendezvousService::Refusal RendezvousService::check_rejoin(ConnectionId conn, const std::string& run_id,
                                                           const RejoinRequest& request) const {
  auto own = node_of_.find(conn);
  if (own != node_of_.end() && !(own->second.run_id == run_id && own->second.node == request.node.id)) {
    return {RefuseCode::not_owner, fmt::format("this connection already speaks for node {} of rendezvous '{}'",
                                               own->second.node.to_string(), own->second.run_id)};
  }
  auto it = secret_of_.find(NodeKey{run_id, request.node.id});
  if (it == secret_of_.end()) return {};  // unknown here (a restarted daemon): the secret is adopted
  if (!auth::equal_secret(it->second, request.node_secret)) {
    return {RefuseCode::not_owner,
            fmt::format("REJOIN as node {} of rendezvous '{}' without its node secret (only the node itself can "
                        "rejoin as itself)",
                        request.node.id.to_string(), run_id)};
  }
  return {};
}

void RendezvousService::changed() {
  if (!status_all_at_) return;
  std::string().swap(status_all_);
  status_all_at_.reset();
  status_all_bytes_ = 0;
}

RendezvousService::Refusal RendezvousService::status_all(ConnectionId conn, TimePoint now) {
  if (!status_all_at_ || now - *status_all_at_ >= kStatusAllReuse || now < *status_all_at_) {
    changed();
    encode_server(status_all_, registry_.status(now));
    status_all_at_ = now;
    status_all_bytes_ = status_all_.size();
    // Too big to send: only its size is kept (the refusal's), not the snapshot.
    if (status_all_bytes_ > options_.max_reply_bytes) std::string().swap(status_all_);
  }
  if (status_all_bytes_ > options_.max_reply_bytes) {
    return {RefuseCode::other,
            fmt::format("the status of every job ({} jobs) is {} bytes, over this daemon's reply limit of {} bytes "
                        "(--max-queued-reply-bytes): ask for one job with --rdzv-id ID",
                        registry_.job_count(), status_all_bytes_, options_.max_reply_bytes)};
  }
  emit(conn, status_all_);
  return {};
}

RendezvousService::Refusal RendezvousService::handle(ConnectionId conn, ClientMessage& message) {
  // A frame about a job's nodes (not a heartbeat, the handshake, a relay or STATUS itself) may
  // change what STATUS shows (status_all_).
  if (!std::holds_alternative<HeartbeatMessage>(message) && !std::holds_alternative<StatusMessage>(message) &&
      !std::holds_alternative<HelloMessage>(message) && !std::holds_alternative<AuthMessage>(message) &&
      !std::holds_alternative<RelayMessage>(message)) {
    changed();
  }
  if (std::holds_alternative<HelloMessage>(message) || std::holds_alternative<AuthMessage>(message)) {
    return handshake(conn, message);
  }
  if (const auto* m = std::get_if<RelayMessage>(&message)) return relay(conn, *m);
  const TimePoint now = clock_.now();
  return std::visit(
      [&](auto& m) -> Refusal {
        using T = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<T, HelloMessage> || std::is_same_v<T, AuthMessage> ||
                      std::is_same_v<T, RelayMessage>) {
          return {};  // handled above
        } else if constexpr (std::is_same_v<T, StatusMessage>) {
          std::string run_id = m.run_id;
          if (!options_.token.empty() && run_id.empty()) {
            auto it = sessions_.find(conn);
            if (it != sessions_.end() && it->second.run_id != auth::any_run) run_id = it->second.run_id;
          }
          if (Refusal why = check_run(conn, run_id.empty() ? std::string(auth::any_run) : run_id); why.refused())
            return why;
          // One job: a lookup, not a snapshot of every job (STATUS must not cost O(jobs)).
          if (run_id.empty()) return status_all(conn, now);
          RegistryStatus status;
          if (auto job = registry_.status_of(run_id, now)) status.jobs.push_back(std::move(*job));
          scratch_.clear();
          encode_server(scratch_, status);
          emit(conn, scratch_);
          return {};
        } else if constexpr (std::is_same_v<T, JoinMessage> || std::is_same_v<T, RejoinMessage>) {
          const NodeId& node = m.request.node.id;
          if (Refusal why = check_run(conn, m.run_id); why.refused()) return why;
          std::string secret;
          if constexpr (std::is_same_v<T, JoinMessage>) {
            if (Refusal why = check_previous_token(conn, m.run_id, node); why.refused()) return why;
            if (Refusal why = check_join(conn, m.run_id, node); why.refused()) return why;
          } else {
            if (Refusal why = check_rejoin(conn, m.run_id, m.request); why.refused()) return why;
            if (Refusal why = check_previous_token_rejoin(conn, m.run_id, node, now); why.refused()) return why;
            secret = m.request.node_secret;
          }
          // A node the daemon did not know gets a secret below; if the registry refuses it, the
          // secret goes too (kept, it would hold memory and lock the node id out of a later JOIN).
          const bool known = secret_of_.count(NodeKey{m.run_id, node}) != 0;
          bind(conn, m.run_id, node, std::move(secret));
          ++counters_.joins;
          // A rejoin that carries an assignment re-registers with a running round (or is told
          // to restart); only a join starts the collection of a round.
          bool collects = true;
          if constexpr (std::is_same_v<T, RejoinMessage>) collects = !m.request.assignment.has_value();
          if (collects) round_open_.try_emplace(m.run_id, now);
          Decisions decisions;
          if constexpr (std::is_same_v<T, JoinMessage>) {
            decisions = registry_.join(m.run_id, m.request, now);
          } else {
            decisions = registry_.rejoin(m.run_id, m.request, now);
          }
          // Only a waiting job collects a round: a spare's join to a running job, or a rejoin
          // that rebuilt the running round, opens none (the next round's time would include
          // the run). After apply(), which times a round this join closed.
          auto settle_round_open = [&] {
            if (const auto* job = registry_.find(m.run_id); job == nullptr || job->state() != JobState::waiting) {
              round_open_.erase(m.run_id);
            }
          };
          if (auto refusal = take_refusal(decisions, node)) {
            // Refused like any other frame (REFUSED, then the connection closes); what else the
            // registry decided concerns other nodes.
            apply(decisions, &node);
            settle_round_open();
            // The connection closes: where it spoke for a member (its earlier JOIN, or a REJOIN
            // that moved the node here), the member is told disconnected now, as on_disconnect
            // would (which finds no binding after this): its lease is cut to one heartbeat
            // interval, rather than lasting its whole length.
            const auto owner = conn_of_.find(NodeKey{m.run_id, node});
            const bool owned = owner != conn_of_.end() && owner->second == conn;
            unbind(conn);
            if (!known) secret_of_.erase(NodeKey{m.run_id, node});
            if (const auto* job = registry_.find(m.run_id); owned && job != nullptr && job->role_of(node)) {
              changed();
              apply(registry_.disconnected(m.run_id, node, now));
            }
            return {refusal->code, std::move(refusal->reason)};
          }
          scratch_.clear();
          encode_server(scratch_, JoinedMessage{m.run_id, node, secret_of_[NodeKey{m.run_id, node}]});
          emit(conn, scratch_);
          apply(decisions, &node);
          settle_round_open();
          return {};
        } else if constexpr (std::is_same_v<T, CloseMessage>) {
          if (Refusal why = check_run(conn, m.run_id); why.refused()) return why;
          auto own = node_of_.find(conn);
          if (own == node_of_.end() || own->second.run_id != m.run_id) {
            return {RefuseCode::not_owner,
                    fmt::format("CLOSE of rendezvous '{}' needs a connection that owns one of its members", m.run_id)};
          }
          apply(registry_.close(m.run_id, now));
          return {};
        } else {
          const NodeId& node = [&]() -> const NodeId& {
            if constexpr (std::is_same_v<T, WorkerFailedMessage>) {
              return m.failure.node;
            } else {
              return m.node;
            }
          }();
          if (Refusal why = check_run(conn, m.run_id); why.refused()) return why;
          if (Refusal why = check_owner(conn, m.run_id, node); why.refused()) return why;
          if constexpr (std::is_same_v<T, HeartbeatMessage>) {
            apply(registry_.heartbeat(m.run_id, node, now), &node);
          } else if constexpr (std::is_same_v<T, LeaveMessage>) {
            apply(registry_.leave(m.run_id, node, now), &node);
            // A node that left no longer speaks through this connection, nor through any other.
            secret_of_.erase(NodeKey{m.run_id, node});
            unbind(conn);
          } else if constexpr (std::is_same_v<T, WorkerFailedMessage>) {
            apply(registry_.worker_failed(m.run_id, m.failure, now), &node);
          } else {
            static_assert(std::is_same_v<T, SucceededMessage>);
            apply(registry_.succeeded(m.run_id, node, m.round, now), &node);
          }
          return {};
        }
      },
      message);
}

void RendezvousService::sweep_secrets_if_large() {
  if (secret_of_.size() <= secrets_sweep_above_) return;
  for (auto it = secret_of_.begin(); it != secret_of_.end();) {
    const RendezvousJob* job = registry_.find(it->first.run_id);
    const bool keep = conn_of_.count(it->first) != 0 || (job != nullptr && job->role_of(it->first.node).has_value());
    it = keep ? std::next(it) : secret_of_.erase(it);
  }
  secrets_sweep_above_ = 2 * secret_of_.size() + 1024;
}

void RendezvousService::bind(ConnectionId conn, const std::string& run_id, const NodeId& node, std::string secret) {
  sweep_secrets_if_large();  // before this node's entry: it may not be a member yet
  NodeKey key{run_id, node};
  auto [s, fresh] = secret_of_.try_emplace(key);
  if (fresh || s->second.empty()) {
    s->second = secret.empty() ? auth::random_hex(auth::node_secret_bytes) : std::move(secret);
  }
  if (node_of_.count(conn) != 0) return;  // already this node's (checked by the caller)
  auto [it, inserted] = conn_of_.try_emplace(key, conn);
  if (!inserted && it->second != conn) {
    // A REJOIN that proved the secret: the node moved to this connection; the old one (if still
    // open) no longer speaks for it.
    node_of_.erase(it->second);
    it->second = conn;
  }
  node_of_.emplace(conn, std::move(key));
}

void RendezvousService::unbind(ConnectionId conn) {
  auto it = node_of_.find(conn);
  if (it == node_of_.end()) return;
  auto c = conn_of_.find(it->second);
  if (c != conn_of_.end() && c->second == conn) conn_of_.erase(c);
  node_of_.erase(it);
}

std::string RendezvousService::store_op_refusal(ConnectionId conn) {
  if (options_.token.empty() || options_.allow_unauthenticated_store) return {};
  auto it = sessions_.find(conn);
  if (it != sessions_.end() && !it->second.run_id.empty()) return {};
  return "this rendezvous daemon has a token and the connection did not authenticate (torchrun's c10d clients "
         "cannot: start ddprun-rdzvd with --allow-unauthenticated-store to let them in)";
}

bool RendezvousService::awaiting_authentication(ConnectionId conn) {
  // With --allow-unauthenticated-store a connection that never authenticates may be a torch
  // client: only a daemon that refuses those waits for every connection's handshake.
  if (options_.token.empty() || options_.allow_unauthenticated_store) return false;
  auto it = sessions_.find(conn);
  return it == sessions_.end() || it->second.run_id.empty();
}

void RendezvousService::on_disconnect(ConnectionId conn) {
  sessions_.erase(conn);
  auto it = node_of_.find(conn);
  if (it == node_of_.end()) return;
  changed();  // a node's connection: its member shows as disconnected
  NodeKey key = std::move(it->second);
  node_of_.erase(it);
  auto c = conn_of_.find(key);
  if (c == conn_of_.end() || c->second != conn) return;
  conn_of_.erase(c);
  apply(registry_.disconnected(key.run_id, key.node, clock_.now()));
  rearm();
}

void RendezvousService::forget_dead_secrets(const std::vector<std::string>& dropped) {
  // Secrets of jobs the registry dropped (collected or expired): a later job of the same id
  // starts fresh. Only the dropped jobs' range of the map is visited.
  for (const std::string& run_id : dropped) {
    auto it = secret_of_.lower_bound(NodeKey{run_id, NodeId{{}, std::numeric_limits<std::int64_t>::min(), {}}});
    while (it != secret_of_.end() && it->first.run_id == run_id) {
      it = conn_of_.count(it->first) == 0 ? secret_of_.erase(it) : std::next(it);
    }
    last_broadcast_.erase(run_id);
  }
}

void RendezvousService::apply(const Decisions& actions, const NodeId* origin) {
  for (const Decision& action : actions) {
    count(action);
    if (const auto* p = std::get_if<Progress>(&action); p != nullptr && p->broadcast) {
      broadcast_progress(*p, origin);
      continue;
    }
    const auto& [run_id, node] = std::visit(
        [](const auto& a) { return std::pair<const std::string&, const NodeId&>(a.run_id, a.node); }, action);
    auto it = conn_of_.find(NodeKey{run_id, node});
    if (it == conn_of_.end()) {
      spdlog::debug("rendezvous '{}': node {} has no connection; it learns the news when it rejoins", run_id,
                    node.to_string());
      continue;
    }
    scratch_.clear();
    encode_decision(scratch_, action);
    emit(it->second, scratch_);
  }
}

void RendezvousService::count(const Decision& action) {
  if (const auto* a = std::get_if<SendAssignment>(&action); a != nullptr && a->assignment.group_rank == 0) {
    // Rank 0's assignment goes out once per round, and again when it rejoins having missed
    // the push: count each round once.
    auto [last, inserted] = last_closed_.try_emplace(a->run_id, a->assignment.round);
    if (inserted || last->second != a->assignment.round) {
      last->second = a->assignment.round;
      ++counters_.rounds_closed;
      if (auto it = round_open_.find(a->run_id); it != round_open_.end()) {
        counters_.round_close_seconds.observe(std::chrono::duration<double>(clock_.now() - it->second).count());
        round_open_.erase(it);
      }
    }
  } else if (const auto* r = std::get_if<SendRestart>(&action)) {
    auto [it, inserted] = last_restart_.try_emplace(r->run_id, r->ended_round);
    if (inserted || it->second != r->ended_round) {
      it->second = r->ended_round;
      ++counters_.restarts;
    }
  } else if (const auto* f = std::get_if<Refuse>(&action)) {
    ++counters_.refused[static_cast<std::size_t>(f->code)];
  }
  if (round_open_.size() + last_restart_.size() + last_closed_.size() > 6 * registry_.job_count() + 32) {
    auto gone = [&](const auto& kv) { return registry_.find(kv.first) == nullptr; };
    std::erase_if(round_open_, gone);
    std::erase_if(last_restart_, gone);
    std::erase_if(last_closed_, gone);
  }
}

void RendezvousService::broadcast_progress(const Progress& progress, const NodeId* origin) {
  // Progress to the other waiting nodes: at most one fan-out per job per progress_interval
  // (a 10,000-node job would otherwise send N lines per join), and, for a large job, at most
  // one per progress_spacing_per_node times its waiting nodes: a fan-out writes one frame per
  // node, so a fixed interval would make the fan-outs of a round that takes time proportional
  // to N cost N^2 (100,000 joins over 10 s: ten fan-outs, a million frames, as many as every
  // other frame of the round together).
  const RendezvousJob* job = registry_.find(progress.run_id);
  if (job == nullptr) return;
  const TimePoint now = clock_.now();
  const Duration interval =
      std::max(options_.progress_interval, job->count(MemberRole::joined) * progress_spacing_per_node);
  auto [last, inserted] = last_broadcast_.try_emplace(progress.run_id, now);
  if (!inserted && now - last->second < interval) {
    ++counters_.progress_dropped;
    return;
  }
  last->second = now;
  if (last_broadcast_.size() > 2 * registry_.job_count() + 16) {
    std::erase_if(last_broadcast_, [&](const auto& kv) { return registry_.find(kv.first) == nullptr; });
  }
  Progress one{progress.run_id, NodeId{}, progress.text};
  for (NodeId& node : job->joined_nodes()) {
    if (origin != nullptr && node == *origin) continue;
    auto it = conn_of_.find(NodeKey{progress.run_id, node});
    if (it == conn_of_.end()) continue;
    one.node = std::move(node);
    scratch_.clear();
    encode_decision(scratch_, one);
    emit(it->second, scratch_);
  }
}

void RendezvousService::emit(ConnectionId conn, std::string_view bytes) {
  ++counters_.pushes;
  if (outbox_ != nullptr) {
    outbox_->buffer(conn).append(bytes);
  } else if (server_ != nullptr) {
    server_->send(conn, bytes);
  }
}

void RendezvousService::rearm() {
  if (!timer_) return;  // shut down: nothing is armed any more
  const std::optional<TimePoint> next = registry_.next_deadline();
  if (next == armed_) return;
  armed_ = next;
  if (!next) {
    timer_->cancel();
    return;
  }
  timer_->arm(*next, [weak = weak_from_this(), at = *next] {
    auto self = weak.lock();
    if (!self || self->armed_ != at) return;
    self->armed_.reset();
    self->on_timer();
  });
}

void RendezvousService::abort_all(const std::string& reason, int exit_code) {
  changed();
  apply(registry_.abort_all(reason, exit_code, clock_.now()));
  rearm();
}

void RendezvousService::on_timer() {
  changed();
  std::vector<std::string> dropped;
  apply(registry_.on_tick(clock_.now(), &dropped));
  if (!dropped.empty()) {
    spdlog::debug("rendezvous: forgot {} finished or expired job(s), e.g. '{}'", dropped.size(), dropped.front());
    forget_dead_secrets(dropped);
  }
  rearm();
}

}  // namespace ddprun::rendezvous
