#include "ddprun/rendezvous/etcd_rendezvous.hpp"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <charconv>
#include <climits>
#include <deque>
#include <map>
#include <set>

#include "ddprun/common/backoff.hpp"
#include "ddprun/common/error.hpp"

namespace ddprun::rendezvous {

namespace asio = boost::asio;
using namespace std::chrono_literals;

namespace etcd {

namespace {

constexpr std::string_view kMagic = "ddprun-etcd-event 1 ";

const char* kind_name(EventKind k) {
  switch (k) {
    case EventKind::message:
      return "message";
    case EventKind::tick:
      return "tick";
    case EventKind::expired:
      return "expired";
  }
  return "?";
}

bool valid_id(std::string_view id) {
  if (id.empty() || id.size() > 200) return false;
  for (char c : id) {
    if (c <= ' ' || c > '~') return false;
  }
  return true;
}

std::int64_t ceil_seconds(Duration d) { return std::chrono::ceil<std::chrono::seconds>(d).count(); }

}  // namespace

std::string encode_event(const LogEvent& e) {
  std::string out = fmt::format("{}{} {} {}\n", kMagic, e.time_ms, kind_name(e.kind), e.id);
  if (e.kind != EventKind::tick) encode_client(out, e.message);
  return out;
}

std::string decode_event(std::string_view value, const WireLimits& limits, LogEvent& out) {
  if (!value.starts_with(kMagic)) return "not a ddprun etcd event (bad magic or version)";
  value.remove_prefix(kMagic.size());
  const std::size_t nl = value.find('\n');
  if (nl == std::string_view::npos || nl > 300) return "event header has no end";
  std::string_view head = value.substr(0, nl);
  std::string_view frame = value.substr(nl + 1);
  const std::size_t s1 = head.find(' ');
  const std::size_t s2 = s1 == std::string_view::npos ? s1 : head.find(' ', s1 + 1);
  if (s2 == std::string_view::npos) return "event header is not '<time> <kind> <id>'";
  const std::string_view t = head.substr(0, s1), kind = head.substr(s1 + 1, s2 - s1 - 1), id = head.substr(s2 + 1);
  LogEvent e;
  auto [p, ec] = std::from_chars(t.data(), t.data() + t.size(), e.time_ms);
  if (ec != std::errc{} || p != t.data() + t.size() || e.time_ms < 0)
    return fmt::format("event time '{}' is not a non-negative integer", t);
  if (!valid_id(id)) return "event id is empty or has invalid characters";
  e.id = std::string(id);
  if (kind == "tick") {
    e.kind = EventKind::tick;
    if (!frame.empty()) return "tick event carries a payload";
    out = std::move(e);
    return {};
  }
  if (kind == "message") {
    e.kind = EventKind::message;
  } else if (kind == "expired") {
    e.kind = EventKind::expired;
  } else {
    return fmt::format("unknown event kind '{}'", kind.substr(0, 40));
  }
  DecodeResult r = decode_client(frame, limits, e.message);
  if (r.status != DecodeStatus::ok) {
    return r.status == DecodeStatus::need_more ? std::string("event frame is truncated") : "event frame: " + r.reason;
  }
  if (r.consumed != frame.size()) return "event carries bytes after its frame";
  if (e.kind == EventKind::expired && !std::holds_alternative<LeaveMessage>(e.message))
    return "expired event does not name a node";
  out = std::move(e);
  return {};
}

std::string log_seq_text(std::int64_t seq) { return fmt::format("{:012d}", seq); }

std::optional<std::int64_t> parse_log_seq(std::string_view text) {
  if (text.size() != 12) return std::nullopt;
  std::int64_t v = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc{} || p != text.data() + text.size() || v < 0) return std::nullopt;
  return v;
}

std::int64_t node_lease_ttl(const JobConfig& user) { return std::max<std::int64_t>(2, ceil_seconds(user.lease())); }

std::int64_t job_lease_ttl(const JobConfig& user) {
  return std::max<std::int64_t>({10, ceil_seconds(user.close_timeout), 3 * node_lease_ttl(user)});
}

JobConfig replica_config(const JobConfig& user, std::int64_t node_ttl_seconds) {
  JobConfig c = user;
  c.heartbeat_interval = std::chrono::seconds(node_ttl_seconds);
  // The registry's own heartbeat lease must never fire: etcd's leases decide liveness. Fifty
  // years keeps TimePoint arithmetic far from overflow.
  const auto horizon = std::chrono::hours(24 * 365 * 50);
  const auto n = horizon / c.heartbeat_interval;
  c.missed_heartbeats = static_cast<int>(std::clamp<decltype(n)>(n, 1, INT_MAX));
  return c;
}

JobLog::JobLog(std::string run_id) : run_id_(std::move(run_id)) {}

TimePoint JobLog::at(std::int64_t ms) const {
  return TimePoint{} + std::chrono::hours(1) + std::chrono::milliseconds(ms - t0_ms_);
}

Decisions JobLog::apply(std::int64_t seq, const LogEvent& e) {
  if (seq != next_seq_) return {};
  if (next_seq_ == 0) t0_ms_ = last_ms_ = e.time_ms;
  ++next_seq_;
  // Replicas never go back in time, whatever a skewed or hostile appender wrote.
  last_ms_ = std::max(last_ms_, e.time_ms);
  const TimePoint now = at(last_ms_);
  if (e.kind == EventKind::tick) return registry_.on_tick(now);
  const std::string* rid = std::visit(
      [](const auto& m) -> const std::string* {
        if constexpr (requires { m.run_id; }) {
          return &m.run_id;
        } else {
          return nullptr;  // a handshake frame: never a log event
        }
      },
      e.message);
  if (rid == nullptr || *rid != run_id_) {
    spdlog::warn("etcd rendezvous '{}': log entry {} is for run '{}'; ignored", run_id_, seq,
                 rid == nullptr ? std::string("(none)") : *rid);
    return {};
  }
  if (e.kind == EventKind::expired) {
    const NodeId& node = std::get<LeaveMessage>(e.message).node;
    const RendezvousJob* job = registry_.find(run_id_);
    if (job == nullptr) return {};
    // The registry's lost-node path: the connection is gone and was not re-registered within
    // the lease (heartbeat_interval of the replica config = the etcd lease TTL).
    Decisions out = registry_.disconnected(run_id_, node, now - job->config().heartbeat_interval);
    Decisions more = registry_.on_tick(now);
    out.insert(out.end(), std::make_move_iterator(more.begin()), std::make_move_iterator(more.end()));
    return out;
  }
  return std::visit(
      [&](const auto& m) -> Decisions {
        using M = std::decay_t<decltype(m)>;
        if constexpr (std::is_same_v<M, JoinMessage>) {
          return registry_.join(run_id_, m.request, now);
        } else if constexpr (std::is_same_v<M, RejoinMessage>) {
          return registry_.rejoin(run_id_, m.request, now);
        } else if constexpr (std::is_same_v<M, LeaveMessage>) {
          return registry_.leave(run_id_, m.node, now);
        } else if constexpr (std::is_same_v<M, WorkerFailedMessage>) {
          return registry_.worker_failed(run_id_, m.failure, now);
        } else if constexpr (std::is_same_v<M, SucceededMessage>) {
          return registry_.succeeded(run_id_, m.node, m.round, now);
        } else if constexpr (std::is_same_v<M, CloseMessage>) {
          return registry_.close(run_id_, now);
        } else {
          return {};  // heartbeat / status: not log events
        }
      },
      e.message);
}

std::optional<std::int64_t> JobLog::next_deadline_ms() const {
  const auto d = registry_.next_deadline();
  if (!d) return std::nullopt;
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(*d - at(t0_ms_)).count();
  return t0_ms_ + ms;
}

RegistryStatus JobLog::status(std::int64_t now_ms) const { return registry_.status(at(std::max(now_ms, last_ms_))); }

std::optional<MemberStatus> JobLog::member(const NodeId& id) const {
  const RendezvousJob* job = registry_.find(run_id_);
  if (job == nullptr) return std::nullopt;
  for (MemberStatus& m : job->status(at(last_ms_)).members) {
    if (m.id == id) return std::move(m);
  }
  return std::nullopt;
}

}  // namespace etcd

// ---------------------------------------------------------------------------------------------
// EtcdRendezvous

namespace {

std::int64_t wall_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string sanitize_id(std::string_view s) {
  std::string out;
  for (char c : s) out += (c > ' ' && c <= '~') ? c : '_';
  return out.empty() ? std::string("node") : out;
}

}  // namespace

struct EtcdRendezvous::Impl : std::enable_shared_from_this<EtcdRendezvous::Impl> {
  enum class Phase { idle, starting, ready, stopped };
  struct Op {
    etcd::EventKind kind = etcd::EventKind::message;
    ClientMessage message;
    std::string id;
    bool put_node_key = false;
    bool delete_node_key = false;
  };

  asio::io_context& io;
  EtcdRendezvousOptions options;
  RendezvousEvents events;
  etcd::EtcdClient client;
  etcd::JobLog log;
  std::string job_prefix, log_prefix, nodes_prefix, lease_key, my_key;
  std::int64_t node_ttl, job_ttl;
  JobConfig replica;
  Phase phase = Phase::idle;
  std::int64_t node_lease = 0, job_lease = 0;
  std::set<std::string> live;
  std::optional<Assignment> assignment;
  bool want_join = false;
  bool leaving = false;
  bool job_done = false;
  std::deque<Op> ops;
  bool appending = false;
  std::uint64_t op_counter = 0;
  std::optional<std::uint64_t> watch_id;
  asio::steady_timer keepalive_timer, deadline_timer, retry_timer, leave_timer;
  Backoff backoff{Backoff::Options{std::chrono::milliseconds(100), std::chrono::seconds(2), 2.0, 0.3}};
  TimePoint started_at{};
  std::optional<TimePoint> last_ok;
  std::string last_error;
  bool healthy = false;
  bool syncing = false;

  Impl(asio::io_context& io_, EtcdRendezvousOptions o, RendezvousEvents ev)
      : io(io_),
        options(std::move(o)),
        events(std::move(ev)),
        client(io_, options.etcd),
        log(options.run_id),
        node_ttl(etcd::node_lease_ttl(options.config)),
        job_ttl(etcd::job_lease_ttl(options.config)),
        replica(etcd::replica_config(options.config, node_ttl)),
        keepalive_timer(io_),
        deadline_timer(io_),
        retry_timer(io_),
        leave_timer(io_) {
    job_prefix = options.prefix + options.run_id + "/";
    log_prefix = job_prefix + "log/";
    nodes_prefix = job_prefix + "nodes/";
    lease_key = job_prefix + "lease";
    my_key = node_key(options.node.id);
  }

  std::string node_key(const NodeId& id) const { return nodes_prefix + id.to_string(); }
  bool stopped() const { return phase == Phase::stopped; }
  std::string where() const { return client.endpoints_text(); }

  // ---- lifecycle ----

  void ensure_started() {
    if (phase != Phase::idle) return;
    phase = Phase::starting;
    started_at = std::chrono::steady_clock::now();
    start_sequence();
  }

  void stop() {
    if (phase == Phase::stopped) return;
    phase = Phase::stopped;
    keepalive_timer.cancel();
    deadline_timer.cancel();
    retry_timer.cancel();
    leave_timer.cancel();
    client.shutdown();
    ops.clear();
  }

  template <class F>
  auto guard(F f) {
    return
        [self = shared_from_this(), f = std::move(f)](const std::optional<etcd::EtcdError>& err, auto value) mutable {
          if (self->stopped()) return;
          if (err) {
            self->on_error(*err);
            return;
          }
          self->on_ok();
          f(std::move(value));
        };
  }

  void on_ok() {
    last_ok = std::chrono::steady_clock::now();
    healthy = true;
    backoff.reset();
  }

  // A failed exchange: fatal for refused credentials, else retried until the budget is spent.
  void on_error(const etcd::EtcdError& err) {
    healthy = false;
    last_error = err.message;
    if (err.auth_failed) {
      auto cb = events.on_refused;
      stop();
      if (cb) cb(err.message);
      return;
    }
    const TimePoint now = std::chrono::steady_clock::now();
    Duration budget = options.give_up_after;
    if (!last_ok) budget = std::min(budget, options.config.join_timeout);
    const TimePoint since = last_ok.value_or(started_at);
    if (now - since >= budget) {
      auto cb = events.on_unreachable;
      const std::string msg = fmt::format(
          "etcd rendezvous '{}': no etcd endpoint of {} answered for {} ({}); last error: {}", options.run_id, where(),
          format_seconds(now - since), last_ok ? "after working before" : "since the start", err.message);
      stop();
      if (cb) cb(msg);
      return;
    }
    spdlog::warn("etcd rendezvous '{}': {}; retrying", options.run_id, err.message);
    schedule_retry();
  }

  void schedule_retry() {
    retry_timer.expires_after(backoff.next_delay());
    retry_timer.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
      if (ec || self->stopped()) return;
      if (self->phase == Phase::starting) {
        self->start_sequence();
      } else {
        self->appending = false;
        self->process_ops();
      }
    });
  }

  // node lease -> job lease -> read the job -> watch it -> ready.
  void start_sequence() {
    phase = Phase::starting;
    if (node_lease == 0) {
      client.lease_grant(node_ttl, guard([this](etcd::LeaseGrantResponse r) {
                           node_lease = r.id;
                           start_sequence();
                         }));
      return;
    }
    if (job_lease == 0) return claim_job_lease();
    sync();
  }

  void claim_job_lease() {
    client.lease_grant(
        job_ttl, guard([this](etcd::LeaseGrantResponse r) {
          const std::int64_t mine = r.id;
          etcd::TxnRequest t;
          t.compare.push_back({lease_key, etcd::Compare::Target::create_revision, etcd::Compare::Result::equal, 0, {}});
          t.success.emplace_back(etcd::PutRequest{lease_key, std::to_string(mine), mine});
          t.failure.emplace_back(etcd::RangeRequest{lease_key, {}, 0, 0, false, false});
          client.txn(std::move(t), guard([this, mine](etcd::TxnResponse tr) {
                       if (tr.succeeded) {
                         job_lease = mine;
                       } else {
                         client.lease_revoke(mine, [](const auto&, auto) {});
                         std::int64_t other = 0;
                         if (!tr.responses.empty() && !tr.responses[0].range.kvs.empty()) {
                           const std::string& v = tr.responses[0].range.kvs[0].value;
                           std::from_chars(v.data(), v.data() + v.size(), other);
                         }
                         if (other <= 0) {  // vanished meanwhile, or garbage: try again
                           return claim_job_lease();
                         }
                         job_lease = other;
                       }
                       sync();
                     }));
        }));
  }

  // Reads everything under the job prefix, applies the log, then follows it with a watch.
  void sync() {
    syncing = true;
    if (watch_id) client.cancel_watch(*watch_id);
    watch_id.reset();
    client.range({job_prefix, etcd::prefix_range_end(job_prefix), 0, 0, false, false},
                 guard([this](etcd::RangeResponse r) {
                   syncing = false;
                   bool has_lease_key = false;
                   std::set<std::string> now_live;
                   std::vector<std::pair<std::int64_t, std::string>> entries;
                   for (etcd::KeyValue& kv : r.kvs) {
                     if (kv.key == lease_key) {
                       has_lease_key = true;
                     } else if (kv.key.starts_with(nodes_prefix)) {
                       now_live.insert(kv.key);
                     } else if (kv.key.starts_with(log_prefix)) {
                       if (auto seq = etcd::parse_log_seq(std::string_view(kv.key).substr(log_prefix.size())))
                         entries.emplace_back(*seq, std::move(kv.value));
                     }
                   }
                   live = std::move(now_live);
                   if (!has_lease_key) {
                     job_vanished("its lease key is gone");
                     return;
                   }
                   if (log.next_seq() > 0 && (entries.empty() || entries.front().first != 0)) {
                     job_vanished("its log was removed");
                     return;
                   }
                   for (auto& [seq, value] : entries) {
                     if (seq < log.next_seq()) continue;
                     if (seq != log.next_seq()) break;
                     apply_entry(seq, value);
                     if (stopped()) return;
                   }
                   start_watch(r.header.revision + 1);
                   if (phase == Phase::starting) {
                     phase = Phase::ready;
                     keepalive_tick();
                   }
                   after_apply();
                 }));
  }

  // The job's state expired in etcd (every agent was cut off for the job lease TTL). Start a
  // fresh log; an agent with an assignment re-registers it (the registry's rebuild path).
  void job_vanished(const std::string& why) {
    spdlog::warn("etcd rendezvous '{}': the job's state in etcd vanished ({}); re-registering", options.run_id, why);
    log = etcd::JobLog(options.run_id);
    job_lease = 0;
    ops.erase(std::remove_if(ops.begin(), ops.end(), [](const Op& o) { return o.kind != etcd::EventKind::message; }),
              ops.end());
    if (assignment) {
      RejoinRequest rq{node_info(), replica, {}, assignment};
      enqueue_front(RejoinMessage{options.run_id, rq}, true);
    } else if (want_join) {
      enqueue_front(JoinMessage{options.run_id, JoinRequest{node_info(), replica}}, true);
    }
    phase = Phase::starting;
    start_sequence();
  }

  void start_watch(std::int64_t from) {
    etcd::WatchHandlers h;
    h.on_message = [this](const etcd::WatchMessage& m) { on_watch(m); };
    h.on_error = [this](const etcd::EtcdError& e) {
      if (stopped()) return;
      spdlog::warn("etcd rendezvous '{}': {}; re-reading the job", options.run_id, e.message);
      watch_id.reset();
      sync();
    };
    watch_id = client.watch({job_prefix, etcd::prefix_range_end(job_prefix), from, false}, std::move(h));
  }

  void on_watch(const etcd::WatchMessage& m) {
    if (stopped() || syncing) return;
    for (const etcd::WatchEvent& e : m.events) {
      const std::string& key = e.kv.key;
      if (key.starts_with(nodes_prefix)) {
        if (e.type == etcd::WatchEvent::Type::put) {
          live.insert(key);
        } else {
          live.erase(key);
          expire_if_member(key);
        }
      } else if (key.starts_with(log_prefix)) {
        auto seq = etcd::parse_log_seq(std::string_view(key).substr(log_prefix.size()));
        if (!seq) continue;
        if (e.type == etcd::WatchEvent::Type::del) {
          if (*seq == 0) return job_vanished("its log was removed");
          continue;
        }
        if (*seq < log.next_seq()) continue;
        if (*seq > log.next_seq()) return sync();  // a gap: re-read
        apply_entry(*seq, e.kv.value);
      } else if (key == lease_key && e.type == etcd::WatchEvent::Type::del) {
        return job_vanished("its lease expired");
      }
      if (stopped()) return;
    }
    after_apply();
  }

  void expire_if_member(const std::string& key) {
    const RendezvousJob* job = log.job();
    if (job == nullptr || job->finished()) return;
    for (const MemberStatus& m : job->status(TimePoint{}).members) {
      if (node_key(m.id) != key) continue;
      Op op;
      op.kind = etcd::EventKind::expired;
      op.message = LeaveMessage{options.run_id, m.id};
      enqueue(std::move(op));
      return;
    }
  }

  NodeInfo node_info() const { return options.node; }

  void apply_entry(std::int64_t seq, const std::string& value) {
    etcd::LogEvent ev;
    if (std::string why = etcd::decode_event(value, WireLimits{}, ev); !why.empty()) {
      // Every replica skips the same bad entry, so they stay in step.
      spdlog::error("etcd rendezvous '{}': log entry {} under {} is malformed ({}); skipped", options.run_id, seq,
                    log_prefix, why);
      ev = etcd::LogEvent{log.last_time_ms(), etcd::EventKind::message, "invalid", StatusMessage{options.run_id}};
    }
    Decisions actions = log.apply(seq, ev);
    spdlog::debug("etcd rendezvous '{}' [{}]: applied entry {} ({}, {} actions)", options.run_id,
                  options.node.id.to_string(), seq, value.substr(0, value.find('\n')), actions.size());
    // A join of a node whose key is already gone: nobody saw it alive, so expire it now.
    if (const auto* j = std::get_if<JoinMessage>(&ev.message);
        j != nullptr && ev.kind == etcd::EventKind::message && !live.count(node_key(j->request.node.id))) {
      expire_if_member(node_key(j->request.node.id));
    }
    for (const Decision& a : actions) {
      deliver(a);
      if (stopped()) return;
    }
  }

  void deliver(const Decision& action) {
    const NodeId& me = options.node.id;
    std::visit(
        [&](const auto& a) {
          using A = std::decay_t<decltype(a)>;
          if constexpr (std::is_same_v<A, Progress>) {
            bool mine = a.node == me;
            if (!mine && a.broadcast && log.job() != nullptr) {
              for (const NodeId& n : log.job()->joined_nodes()) mine = mine || n == me;
            }
            if (mine && events.on_progress) events.on_progress(a.text);
            return;
          } else {
            if (!(a.node == me)) return;
            if constexpr (std::is_same_v<A, SendAssignment>) {
              assignment = a.assignment;
              want_join = false;
              if (events.on_assignment) events.on_assignment(a.assignment);
            } else if constexpr (std::is_same_v<A, SendRestart>) {
              assignment.reset();
              if (events.on_restart) events.on_restart(a);
            } else if constexpr (std::is_same_v<A, SendJobFailed>) {
              job_done = true;
              want_join = false;
              if (events.on_job_failed) events.on_job_failed(a);
            } else if constexpr (std::is_same_v<A, SendJobCompleted>) {
              job_done = true;
              if (events.on_job_completed) events.on_job_completed();
            } else if constexpr (std::is_same_v<A, Refuse>) {
              want_join = false;
              if (events.on_refused) events.on_refused(a.reason);
            } else if constexpr (std::is_same_v<A, AskRejoin>) {
              RejoinRequest rq{node_info(), replica, {}, assignment};
              enqueue_front(RejoinMessage{options.run_id, rq}, true);
            }
          }
        },
        action);
  }

  // After a batch of entries: catch what no action said (our membership vanished), re-arm the
  // deadline timer and send what is queued.
  void after_apply() {
    if (stopped()) return;
    const RendezvousJob* job = log.job();
    const bool pending_join = std::any_of(ops.begin(), ops.end(), [](const Op& o) {
      return std::holds_alternative<JoinMessage>(o.message) || std::holds_alternative<RejoinMessage>(o.message);
    });
    if (job != nullptr && !job->finished() && !job_done && !pending_join && !leaving) {
      const auto me = log.member(options.node.id);
      if (assignment && (!me || me->role != MemberRole::participant)) {
        SendRestart r{options.run_id,
                      options.node.id,
                      assignment->round,
                      RoundEnd::membership_change,
                      job->restarts_used(),
                      fmt::format("this node is no longer a member of round {} of rendezvous '{}' "
                                  "(its etcd lease expired); stop the workers and join again",
                                  assignment->round, options.run_id)};
        assignment.reset();
        if (events.on_restart) events.on_restart(r);
        if (stopped()) return;
      } else if (want_join && !me) {
        enqueue(JoinMessage{options.run_id, JoinRequest{node_info(), replica}}, true);
      }
    }
    arm_deadline();
    process_ops();
  }

  void arm_deadline() {
    const auto due = log.next_deadline_ms();
    if (!due) {
      deadline_timer.cancel();
      return;
    }
    const std::int64_t wait = std::max<std::int64_t>(0, *due - wall_ms());
    deadline_timer.expires_after(std::chrono::milliseconds(wait));
    deadline_timer.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
      if (ec || self->stopped()) return;
      const bool queued =
          std::any_of(self->ops.begin(), self->ops.end(), [](const Op& o) { return o.kind == etcd::EventKind::tick; });
      if (!queued) {
        Op op;
        op.kind = etcd::EventKind::tick;
        self->enqueue(std::move(op));
      }
    });
  }

  // ---- appending ----

  std::string next_op_id() { return fmt::format("{}-{}", sanitize_id(options.node.id.instance), ++op_counter); }

  void enqueue(ClientMessage m, bool put_key = false, bool delete_key = false) {
    Op op;
    op.message = std::move(m);
    op.put_node_key = put_key;
    op.delete_node_key = delete_key;
    enqueue(std::move(op));
  }

  void enqueue_front(ClientMessage m, bool put_key) {
    Op op;
    op.message = std::move(m);
    op.put_node_key = put_key;
    op.id = next_op_id();
    ops.push_front(std::move(op));
  }

  void enqueue(Op op) {
    if (stopped()) return;
    op.id = next_op_id();
    ops.push_back(std::move(op));
    process_ops();
  }

  // Is the op still worth appending, judged on the replica as it is now?
  bool still_due(const Op& op) const {
    if (op.kind == etcd::EventKind::tick) {
      const auto due = log.next_deadline_ms();
      return due && *due <= wall_ms();
    }
    if (op.kind == etcd::EventKind::expired) {
      const NodeId& n = std::get<LeaveMessage>(op.message).node;
      return log.member(n).has_value() && !live.count(node_key(n));
    }
    return true;
  }

  void process_ops() {
    if (phase != Phase::ready || appending || syncing) return;
    while (!ops.empty() && !still_due(ops.front())) ops.pop_front();
    if (ops.empty()) return;
    appending = true;
    const Op& op = ops.front();
    etcd::LogEvent ev{std::max(wall_ms(), log.last_time_ms()), op.kind, op.id, op.message};
    const std::int64_t seq = log.next_seq();
    const std::string key = log_prefix + etcd::log_seq_text(seq);
    etcd::TxnRequest t;
    t.compare.push_back({key, etcd::Compare::Target::create_revision, etcd::Compare::Result::equal, 0, {}});
    if (seq > 0) {
      t.compare.push_back({log_prefix + etcd::log_seq_text(seq - 1),
                           etcd::Compare::Target::create_revision,
                           etcd::Compare::Result::greater,
                           0,
                           {}});
    }
    t.success.emplace_back(etcd::PutRequest{key, etcd::encode_event(ev), job_lease});
    if (op.put_node_key) t.success.emplace_back(etcd::PutRequest{my_key, options.node.id.to_string(), node_lease});
    if (op.delete_node_key) t.success.emplace_back(etcd::DeleteRangeRequest{my_key, {}});
    t.failure.emplace_back(etcd::RangeRequest{key, etcd::prefix_range_end(log_prefix), 256, 0, false, false});
    std::string gone_key;
    if (op.kind == etcd::EventKind::expired) {
      // Our view of the node keys may lag the log (a conflict reply carries log entries before
      // the watch delivers the keys written with them): etcd itself confirms the key is gone.
      gone_key = node_key(std::get<LeaveMessage>(op.message).node);
      t.compare.push_back({gone_key, etcd::Compare::Target::create_revision, etcd::Compare::Result::equal, 0, {}});
      t.failure.emplace_back(etcd::RangeRequest{gone_key, {}, 0, 0, true, false});
    }
    const std::string id = op.id;
    client.txn(std::move(t), guard([this, seq, ev, id, gone_key](etcd::TxnResponse r) {
                 appending = false;
                 if (!r.succeeded && !gone_key.empty() && r.responses.size() > 1 && !r.responses[1].range.kvs.empty()) {
                   live.insert(gone_key);  // alive after all: the expiry is not due
                   if (!ops.empty() && ops.front().id == id) ops.pop_front();
                   if (r.responses[0].range.kvs.empty()) return after_apply();
                 }
                 if (r.succeeded) {
                   if (!ops.empty() && ops.front().id == id) {
                     if (ops.front().put_node_key) live.insert(my_key);
                     if (ops.front().delete_node_key) live.erase(my_key);
                     ops.pop_front();
                   }
                   if (log.next_seq() == seq) apply_entry(seq, etcd::encode_event(ev));
                   return after_apply();
                 }
                 // Someone appended first: apply what they wrote (it may be our own event from
                 // an attempt whose answer was lost) and decide again.
                 const auto& kvs = r.responses.empty() ? std::vector<etcd::KeyValue>{} : r.responses[0].range.kvs;
                 if (kvs.empty() && seq > 0) return job_vanished("its log was removed");
                 for (const etcd::KeyValue& kv : kvs) {
                   auto s = etcd::parse_log_seq(std::string_view(kv.key).substr(log_prefix.size()));
                   if (!s || *s != log.next_seq()) continue;
                   etcd::LogEvent other;
                   if (etcd::decode_event(kv.value, WireLimits{}, other).empty() && other.id == id && !ops.empty() &&
                       ops.front().id == id) {
                     ops.pop_front();
                   }
                   apply_entry(*s, kv.value);
                   if (stopped()) return;
                 }
                 after_apply();
               }));
  }

  // ---- keepalive ----

  void keepalive_tick() {
    if (stopped()) return;
    if (node_lease != 0) {
      // Keepalives queue up while a member stalls; an answer about a lease this node already
      // replaced says nothing about the current one (acting on it would drop a live lease).
      client.lease_keepalive(node_lease, guard([this, id = node_lease](etcd::LeaseKeepAliveResponse r) {
                               if (r.ttl > 0 || id != node_lease) return;
                               spdlog::warn(
                                   "etcd rendezvous '{}': this node's lease expired; "
                                   "taking a new one",
                                   options.run_id);
                               node_lease = 0;
                               client.lease_grant(node_ttl, guard([this](etcd::LeaseGrantResponse g) {
                                                    node_lease = g.id;
                                                    after_apply();
                                                  }));
                             }));
    }
    if (job_lease != 0) {
      client.lease_keepalive(job_lease, guard([this](etcd::LeaseKeepAliveResponse r) {
                               if (r.ttl <= 0 && !syncing) job_vanished("its lease expired");
                             }));
    }
    keepalive_timer.expires_after(options.config.heartbeat_interval);
    keepalive_timer.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
      if (ec || self->stopped()) return;
      self->keepalive_tick();
    });
  }

  // ---- API ----

  void join() {
    if (stopped() || leaving) return;
    assignment.reset();
    std::string why;
    if (options.run_id.empty() || options.run_id.find('/') != std::string::npos) {
      why = fmt::format(
          "rendezvous id '{}' cannot be used as an etcd key part: pass a --rdzv-id "
          "without '/'",
          options.run_id);
    } else if (std::string v = options.config.validate(); !v.empty()) {
      why = fmt::format("invalid configuration for rendezvous '{}': {}", options.run_id, v);
    }
    if (!why.empty()) {
      asio::post(io, [self = shared_from_this(), why] {
        if (!self->stopped() && self->events.on_refused) self->events.on_refused(why);
      });
      return;
    }
    want_join = true;
    enqueue(JoinMessage{options.run_id, JoinRequest{node_info(), replica}}, true);
    ensure_started();
  }

  void leave() {
    if (stopped() || leaving) return;
    if (phase != Phase::ready) return stop();
    leaving = true;
    want_join = false;
    enqueue(LeaveMessage{options.run_id, options.node.id}, false, true);
    // Whatever happens, stop within two request timeouts.
    leave_timer.expires_after(2 * options.etcd.request_timeout);
    leave_timer.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
      if (!ec) self->stop();
    });
    wait_leave_done();
  }

  void wait_leave_done() {
    if (stopped()) return;
    const bool pending = std::any_of(ops.begin(), ops.end(), [](const Op& o) { return o.delete_node_key; });
    if (pending) {
      retry_timer.expires_after(10ms);
      retry_timer.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
        if (ec || self->stopped()) return;
        if (!self->appending) self->process_ops();
        self->wait_leave_done();
      });
      return;
    }
    const std::int64_t lease = node_lease;
    client.lease_revoke(lease, [self = shared_from_this()](const auto&, auto) { self->stop(); });
  }
};

EtcdRendezvous::EtcdRendezvous(asio::io_context& io, EtcdRendezvousOptions options, RendezvousEvents events)
    : impl_(std::make_shared<Impl>(io, std::move(options), std::move(events))) {}

EtcdRendezvous::~EtcdRendezvous() { impl_->stop(); }

void EtcdRendezvous::join() { impl_->join(); }
void EtcdRendezvous::set_nccl_ids(std::vector<std::uint8_t> ids) { impl_->options.node.nccl_ids = std::move(ids); }
void EtcdRendezvous::report_failure(const WorkerFailure& failure) {
  if (impl_->stopped()) return;
  impl_->enqueue(WorkerFailedMessage{impl_->options.run_id, failure});
}
void EtcdRendezvous::report_success(std::uint64_t round) {
  if (impl_->stopped()) return;
  impl_->enqueue(SucceededMessage{impl_->options.run_id, impl_->options.node.id, round});
}
void EtcdRendezvous::leave() { impl_->leave(); }
void EtcdRendezvous::stop() { impl_->stop(); }
const std::optional<Assignment>& EtcdRendezvous::current_assignment() const { return impl_->assignment; }
bool EtcdRendezvous::connected() const { return impl_->phase == Impl::Phase::ready && impl_->healthy; }

RegistryStatus query_etcd_status(const etcd::EtcdClientOptions& options, const std::string& prefix,
                                 const std::string& run_id, std::chrono::milliseconds timeout) {
  asio::io_context io;
  etcd::EtcdClient client(io, options);
  const std::string base = run_id.empty() ? prefix : prefix + run_id + "/";
  std::optional<etcd::EtcdError> error;
  std::optional<etcd::RangeResponse> reply;
  client.range({base, etcd::prefix_range_end(base), 0, 0, false, false},
               [&](const std::optional<etcd::EtcdError>& err, etcd::RangeResponse r) {
                 error = err;
                 if (!err) reply = std::move(r);
               });
  io.run_for(timeout);
  if (error) throw NetworkError(error->message, "check --rdzv-endpoint and --rdzv-conf");
  if (!reply) {
    throw NetworkError(fmt::format("etcd at {} did not answer within {} ms", client.endpoints_text(), timeout.count()),
                       "check --rdzv-endpoint");
  }
  // Group "<prefix><run>/log/<seq>" entries by run; keys arrive sorted, so each log is in order.
  std::map<std::string, etcd::JobLog> logs;
  for (const etcd::KeyValue& kv : reply->kvs) {
    if (!kv.key.starts_with(prefix)) continue;
    const std::string_view rest = std::string_view(kv.key).substr(prefix.size());
    const std::size_t slash = rest.find("/log/");
    if (slash == std::string_view::npos) continue;
    const std::string run(rest.substr(0, slash));
    if (!run_id.empty() && run != run_id) continue;
    auto seq = etcd::parse_log_seq(rest.substr(slash + 5));
    if (!seq) continue;
    auto it = logs.try_emplace(run, run).first;
    etcd::LogEvent ev;
    if (!etcd::decode_event(kv.value, WireLimits{}, ev).empty()) {
      ev = etcd::LogEvent{it->second.last_time_ms(), etcd::EventKind::message, "invalid", StatusMessage{run}};
    }
    it->second.apply(*seq, ev);
  }
  RegistryStatus out;
  const std::int64_t now = wall_ms();
  for (const auto& [run, jl] : logs) {
    RegistryStatus s = jl.status(now);
    out.jobs.insert(out.jobs.end(), s.jobs.begin(), s.jobs.end());
  }
  return out;
}

}  // namespace ddprun::rendezvous
