#include "ddprun/rendezvous/rendezvous_service.hpp"

#include <spdlog/spdlog.h>

#include <type_traits>

#include "ddprun/rendezvous/rendezvous_metrics.hpp"
#include "ddprun/rendezvous/store_server.hpp"

namespace ddprun::rendezvous {

RendezvousService::RendezvousService(boost::asio::io_context& io, RendezvousServiceOptions options, Timers& timers)
    : options_(std::move(options)), clock_(timers.clock()), registry_(options_.token), timer_(timers.make_timer(io)) {}

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
  return s;
}

DecodeResult RendezvousService::on_frame(ConnectionId conn, std::string_view buffer, StoreState& state,
                                         Outbox& outbox) {
  (void)state;
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
  if (std::holds_alternative<StatusMessage>(message_)) {
    const std::string& run_id = std::get<StatusMessage>(message_).run_id;
    RegistryStatus status = registry_.status(clock_.now());
    if (!run_id.empty()) std::erase_if(status.jobs, [&](const JobStatus& j) { return j.run_id != run_id; });
    scratch_.clear();
    encode_server(scratch_, status);
    emit(conn, scratch_);
    return r;
  }
  handle(conn, message_);
  rearm();
  return r;
}

void RendezvousService::handle(ConnectionId conn, ClientMessage& message) {
  const TimePoint now = clock_.now();
  std::visit(
      [&](auto& m) {
        using T = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<T, JoinMessage> || std::is_same_v<T, RejoinMessage>) {
          ++counters_.joins;
          // A rejoin that carries an assignment re-registers with a running round (or is told
          // to restart); only a join starts the collection of a round.
          bool collects = true;
          if constexpr (std::is_same_v<T, RejoinMessage>) collects = !m.request.assignment.has_value();
          if (collects) round_open_.try_emplace(m.run_id, now);
        }
        if constexpr (std::is_same_v<T, JoinMessage>) {
          bind(conn, m.run_id, m.request.node.id);
          apply(registry_.join(m.run_id, m.request, now), &m.request.node.id);
        } else if constexpr (std::is_same_v<T, RejoinMessage>) {
          bind(conn, m.run_id, m.request.node.id);
          apply(registry_.rejoin(m.run_id, m.request, now), &m.request.node.id);
        } else if constexpr (std::is_same_v<T, HeartbeatMessage>) {
          bind(conn, m.run_id, m.node);
          apply(registry_.heartbeat(m.run_id, m.node, now), &m.node);
        } else if constexpr (std::is_same_v<T, LeaveMessage>) {
          apply(registry_.leave(m.run_id, m.node, now), &m.node);
          // A node that left no longer speaks through this connection.
          auto it = conn_of_.find(NodeKey{m.run_id, m.node});
          if (it != conn_of_.end() && it->second == conn) {
            conn_of_.erase(it);
            node_of_.erase(conn);
          }
        } else if constexpr (std::is_same_v<T, WorkerFailedMessage>) {
          bind(conn, m.run_id, m.failure.node);
          apply(registry_.worker_failed(m.run_id, m.failure, now), &m.failure.node);
        } else if constexpr (std::is_same_v<T, SucceededMessage>) {
          bind(conn, m.run_id, m.node);
          apply(registry_.succeeded(m.run_id, m.node, m.round, now), &m.node);
        } else if constexpr (std::is_same_v<T, CloseMessage>) {
          apply(registry_.close(m.run_id, now));
        }
      },
      message);
}

void RendezvousService::bind(ConnectionId conn, const std::string& run_id, const NodeId& node) {
  auto cur = node_of_.find(conn);
  if (cur != node_of_.end()) {
    if (cur->second.run_id == run_id && cur->second.node == node) return;  // the common case
    auto old = conn_of_.find(cur->second);
    if (old != conn_of_.end() && old->second == conn) conn_of_.erase(old);
    node_of_.erase(cur);
  }
  NodeKey key{run_id, node};
  auto [it, inserted] = conn_of_.try_emplace(key, conn);
  if (!inserted && it->second != conn) {
    // The newest connection speaks for the node; the old one (if still open) is forgotten.
    node_of_.erase(it->second);
    it->second = conn;
  }
  node_of_.emplace(conn, std::move(key));
}

void RendezvousService::on_disconnect(ConnectionId conn) {
  auto it = node_of_.find(conn);
  if (it == node_of_.end()) return;
  NodeKey key = std::move(it->second);
  node_of_.erase(it);
  auto c = conn_of_.find(key);
  if (c == conn_of_.end() || c->second != conn) return;
  conn_of_.erase(c);
  apply(registry_.disconnected(key.run_id, key.node, clock_.now()));
  rearm();
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
    ++counters_.refused[std::string(refuse_reason_label(f->reason))];
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
  // (a 10,000-node job would otherwise send N lines per join).
  const TimePoint now = clock_.now();
  auto [last, inserted] = last_broadcast_.try_emplace(progress.run_id, now);
  if (!inserted && now - last->second < options_.progress_interval) {
    ++counters_.progress_dropped;
    return;
  }
  last->second = now;
  if (last_broadcast_.size() > 2 * registry_.job_count() + 16) {
    std::erase_if(last_broadcast_, [&](const auto& kv) { return registry_.find(kv.first) == nullptr; });
  }
  const RendezvousJob* job = registry_.find(progress.run_id);
  if (job == nullptr) return;
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

void RendezvousService::on_timer() {
  apply(registry_.on_tick(clock_.now()));
  rearm();
}

}  // namespace ddprun::rendezvous
