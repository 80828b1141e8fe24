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

constexpr std::int64_t kMaxEventTimeMs = 253402300799999;  // 9999-12-31T23:59:59.999Z

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
  // Milliseconds since 1970, before the year 10000 (far from the int64 limit: deadlines are
  // computed from them).
  if (ec != std::errc{} || p != t.data() + t.size() || e.time_ms < 0 || e.time_ms > kMaxEventTimeMs)
    return fmt::format("event time '{}' is not a time in milliseconds since 1970 before the year 10000", t);
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

namespace {
constexpr std::string_view kBatchMagic = "ddprun-etcd-batch 1 ";
}  // namespace

std::string encode_batch(const std::vector<LogEvent>& events) {
  std::string out = fmt::format("{}{}\n", kBatchMagic, events.size());
  for (const LogEvent& e : events) {
    const std::string one = encode_event(e);
    out += fmt::format("{}\n", one.size());
    out += one;
  }
  return out;
}

std::string decode_batch(std::string_view value, const WireLimits& limits, std::vector<LogEvent>& out) {
  if (!value.starts_with(kBatchMagic)) return "not a ddprun etcd batch (bad magic or version)";
  value.remove_prefix(kBatchMagic.size());
  auto read_number = [&value](std::size_t& n) {
    const std::size_t nl = value.find('\n');
    if (nl == std::string_view::npos || nl == 0 || nl > 12) return false;
    auto [p, ec] = std::from_chars(value.data(), value.data() + nl, n);
    if (ec != std::errc{} || p != value.data() + nl) return false;
    value.remove_prefix(nl + 1);
    return true;
  };
  std::size_t count = 0;
  if (!read_number(count)) return "batch header has no event count";
  if (count == 0 || count > kMaxBatchEvents)
    return fmt::format("batch holds {} events (1..{} allowed)", count, kMaxBatchEvents);
  std::vector<LogEvent> events;
  events.reserve(count);
  for (std::size_t i = 0; i < count; ++i) {
    std::size_t size = 0;
    if (!read_number(size)) return fmt::format("batch event {} has no length", i);
    if (size > value.size()) return fmt::format("batch event {} is truncated", i);
    LogEvent e;
    if (std::string why = decode_event(value.substr(0, size), limits, e); !why.empty())
      return fmt::format("batch event {}: {}", i, why);
    value.remove_prefix(size);
    events.push_back(std::move(e));
  }
  if (!value.empty()) return "batch carries bytes after its last event";
  out = std::move(events);
  return {};
}

std::optional<std::pair<std::string, std::uint64_t>> split_event_id(std::string_view id) {
  const std::size_t dash = id.rfind('-');
  if (dash == std::string_view::npos || dash == 0 || dash + 1 == id.size()) return std::nullopt;
  std::uint64_t n = 0;
  auto [p, ec] = std::from_chars(id.data() + dash + 1, id.data() + id.size(), n);
  if (ec != std::errc{} || p != id.data() + id.size()) return std::nullopt;
  return std::make_pair(std::string(id.substr(0, dash)), n);
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
  return std::max<std::int64_t>({30, ceil_seconds(user.close_timeout), 3 * node_lease_ttl(user)});
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
  // Event times come from agents' clocks (and from etcd, so anyone who can write the job's keys):
  // held within 100 years of the first, so that the nanoseconds of a TimePoint cannot overflow.
  constexpr std::int64_t kSpan = std::int64_t{100} * 366 * 24 * 3600 * 1000;
  const std::int64_t d = ms >= t0_ms_ ? std::min(ms - t0_ms_, kSpan) : -std::min(t0_ms_ - ms, kSpan);
  return TimePoint{} + std::chrono::hours(1) + std::chrono::milliseconds(d);
}

bool JobLog::seen(std::string_view id) const {
  const auto split = split_event_id(id);
  if (!split) return false;
  auto it = applied_.find(split->first);
  return it != applied_.end() && it->second >= split->second;
}

Decisions JobLog::apply(std::int64_t seq, const std::vector<LogEvent>& batch) {
  if (seq != next_seq_) return {};
  ++next_seq_;
  if (!started_ && !batch.empty()) {
    started_ = true;
    t0_ms_ = last_ms_ = batch.front().time_ms;
  }
  Decisions out;
  for (const LogEvent& e : batch) {
    // Every event is deduplicated by its id (an inbox key put twice, two sequencers during a
    // takeover), ticks and expiries included: replicas of any version must skip the same
    // events of a log, whoever wrote it. The sequencer gives its ticks and expiries ids of a
    // source of their own (fold), so they never pass for a later id of its pending messages.
    if (seen(e.id)) continue;
    if (auto split = split_event_id(e.id)) applied_[split->first] = split->second;
    Decisions more = apply_one(seq, e);
    if (out.empty()) {
      out = std::move(more);
    } else {
      out.insert(out.end(), std::make_move_iterator(more.begin()), std::make_move_iterator(more.end()));
    }
  }
  return out;
}

Decisions JobLog::apply_one(std::int64_t seq, const LogEvent& e) {
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

std::optional<MemberRole> JobLog::role(const NodeId& id) const {
  const RendezvousJob* job = registry_.find(run_id_);
  return job == nullptr ? std::nullopt : job->role_of(id);
}

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
  // An event of this agent on its way into the log: put under its inbox key, then applied.
  struct Op {
    ClientMessage message;
    std::string id;              // "" until first put (ids grow in put order)
    bool put = false;            // the inbox key is written (under the current node lease)
    bool with_node_key = false;  // join / rejoin: the same transaction puts nodes/<self>
    bool is_leave = false;
  };
  struct InboxEntry {
    std::int64_t mod_revision = 0;
    std::string value;
  };

  asio::io_context& io;
  EtcdRendezvousOptions options;
  RendezvousEvents events;
  etcd::EtcdClient client;
  // Keepalives go on their own connection: a call stuck on a member that lost its leader (up to
  // the request timeout per member) must not hold this node's lease renewal behind it.
  etcd::EtcdClient lease_client;
  etcd::JobLog log;
  std::string job_prefix, log_prefix, nodes_prefix, inbox_prefix, lease_key, leader_key, my_key;
  std::string source;  // this object's event-id source: "<instance>.<nonce>"
  std::int64_t node_ttl, job_ttl;
  JobConfig replica;
  Phase phase = Phase::idle;
  std::int64_t node_lease = 0, job_lease = 0;
  std::int64_t spare_job_lease = 0;  // granted for a job-lease claim that failed
  // The job's epoch: mod_revision of P"lease" as this agent last saw it (0: none yet). A claim
  // puts that key only where it still holds `claim_expect` (0: absent), and clears the job's
  // log, inbox and leader key in the same transaction, so a fresh log never inherits entries of
  // the job it replaces and is never sequenced by an agent elected before it.
  std::int64_t lease_rev = 0;
  std::int64_t claim_expect = 0;
  std::optional<Assignment> assignment;
  bool want_join = false;
  bool leaving = false;
  bool job_done = false;
  std::deque<Op> ops;
  bool putting = false;
  std::uint64_t op_counter = 0;
  std::uint64_t seq_counter = 0;  // ticks and expiries this agent appends as the sequencer
  std::optional<std::uint64_t> watch_id;
  // leave_poll_timer is the leave's own: sharing retry_timer, a retry and the poll cancelled each
  // other (a failed call's retry never ran, or the poll ended and the lease was never revoked).
  asio::steady_timer keepalive_timer, deadline_timer, retry_timer, leave_timer, leave_poll_timer, watch_retry_timer;
  Backoff backoff{Backoff::Options{std::chrono::milliseconds(100), std::chrono::seconds(2), 2.0, 0.3}};
  // Watches that ended one after the other (each soon after it started), since when, and the
  // delay before the next re-read.
  Backoff watch_backoff{Backoff::Options{std::chrono::milliseconds(100), std::chrono::seconds(2), 2.0, 0.3}};
  TimePoint watch_started{};
  std::optional<TimePoint> watch_failing_since;
  int watch_failures = 0;
  std::optional<TimePoint> watch_breaking_since;  // watch_broke: the first break since a stream worked
  int watch_breaks = 0;
  TimePoint started_at{};
  std::optional<TimePoint> last_ok;  // the last success of an operation that is progress
  // Operations whose last try failed, each with when it started failing: the budget is per
  // operation, and one that is no longer tried (abandoned) is dropped, so neither pins it.
  std::map<std::string, TimePoint> failing;
  bool granting_node_lease = false;
  std::string last_error;
  bool healthy = false;
  bool syncing = false;
  std::uint64_t sync_gen = 0;
  std::uint64_t epoch = 0;  // job_vanished() count: answers about the job before are stale

  // Sequencer election.
  bool leader_known = false;  // a P"leader" key exists, as far as this agent has seen
  bool campaigning = false;
  bool leader = false;          // this agent holds P"leader"
  std::int64_t leader_rev = 0;  // create_revision of our P"leader" key
  // Sequencer state (only while `leader`): pending inbox keys, live node keys, nodes that may
  // have to be expired, and whether an append is in flight.
  std::map<std::string, InboxEntry> inbox;
  std::set<std::string> live;
  std::set<std::string> expiry_candidates;
  bool folding = false;

  Impl(asio::io_context& io_, EtcdRendezvousOptions o, RendezvousEvents ev)
      : io(io_),
        options(with_defaults(std::move(o))),
        events(std::move(ev)),
        client(io_, options.etcd),
        lease_client(io_, options.etcd),
        log(options.run_id),
        node_ttl(etcd::node_lease_ttl(options.config)),
        job_ttl(etcd::job_lease_ttl(options.config)),
        replica(etcd::replica_config(options.config, node_ttl)),
        keepalive_timer(io_),
        deadline_timer(io_),
        retry_timer(io_),
        leave_timer(io_),
        leave_poll_timer(io_),
        watch_retry_timer(io_) {
    job_prefix = options.prefix + options.run_id + "/";
    log_prefix = job_prefix + "log/";
    nodes_prefix = job_prefix + "nodes/";
    inbox_prefix = job_prefix + "inbox/";
    lease_key = job_prefix + "lease";
    leader_key = job_prefix + "leader";
    my_key = node_key(options.node.id);
    new_source();
    // The lease client calls every TTL/3: it finds a member that stopped answering (stalled,
    // cut off without a closed connection) first. The watch on that member then resumes on the
    // next one at once, not after its idle timeout (half the give-up budget), during which this
    // agent would see none of the job's restarts.
    lease_client.set_endpoint_failed_hook([this](std::size_t index) { client.endpoint_failed(index); });
  }

  // A watch silent for half the give-up budget is resumed anew: one on a member that stalled
  // without closing the connection would otherwise miss the log until the job is given up.
  static EtcdRendezvousOptions with_defaults(EtcdRendezvousOptions o) {
    if (o.etcd.watch_idle_timeout <= Duration::zero()) o.etcd.watch_idle_timeout = o.give_up_after / 2;
    return o;
  }

  // A fresh id source: the node instance plus a nonce, so two objects of one agent (or a
  // restarted one reusing an instance name) never share counters.
  void new_source() {
    source = fmt::format("{}.{:x}", sanitize_id(options.node.id.instance),
                         static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
                             reinterpret_cast<std::uintptr_t>(this));
    op_counter = 0;
    seq_counter = 0;
  }

  std::string node_key(const NodeId& id) const { return nodes_prefix + id.to_string(); }
  bool stopped() const { return phase == Phase::stopped; }
  std::string where() const { return client.endpoints_text(); }
  // What this agent reads and watches: everything while it is the sequencer, else only the
  // leader key, the lease key and the log (contiguous: "leader" < "lease" < "log/").
  std::pair<std::string, std::string> view_range() const {
    if (leader) return {job_prefix, etcd::prefix_range_end(job_prefix)};
    return {leader_key, etcd::prefix_range_end(log_prefix)};
  }

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
    leave_poll_timer.cancel();
    watch_retry_timer.cancel();
    client.shutdown();
    lease_client.shutdown();
    ops.clear();
  }

  // Wraps a call's callback: `op` names the operation for the give-up clock (on_error). A
  // `progress` operation that succeeds is the agent's work moving on; lease grants and
  // keepalives are not: they succeed while, say, every job-lease claim is refused.
  template <class F>
  auto guard(const char* op, F f, bool progress = true) {
    return [self = shared_from_this(), f = std::move(f), op, progress](const std::optional<etcd::EtcdError>& err,
                                                                       auto value) mutable {
      if (self->stopped()) return;
      if (err) {
        self->on_error(*err, op);
        return;
      }
      self->on_ok(op, progress);
      f(std::move(value));
    };
  }

  void on_ok(const char* op, bool progress) {
    healthy = true;
    failing.erase(op);
    if (progress) {
      last_ok = std::chrono::steady_clock::now();
      failing.clear();
    }
    if (failing.empty()) backoff.reset();
  }

  // A failed exchange: fatal for refused credentials and for answers a retry cannot change,
  // else retried until the budget is spent. The budget runs from the first failure while some
  // operation has not succeeded since (before any progress: from the start).
  void on_error(const etcd::EtcdError& err, const char* op) {
    healthy = false;
    last_error = err.message;
    if (err.auth_failed || err.permanent) {
      auto cb = events.on_refused;
      stop();
      if (cb) cb(err.message);
      return;
    }
    const TimePoint now = std::chrono::steady_clock::now();
    const TimePoint since = failing.emplace(op, last_ok ? now : started_at).first->second;
    Duration budget = options.give_up_after;
    if (!last_ok) budget = std::min(budget, options.config.join_timeout);
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
        if (self->node_lease == 0) self->grant_node_lease();  // a re-grant that failed
        // Whatever was in flight failed (a late answer is harmless: puts are idempotent and
        // an append is a compare-and-swap).
        self->putting = false;
        self->folding = false;
        self->campaigning = false;
        if (self->syncing) return self->sync();  // the read failed: read again
        self->pump();
      }
    });
  }

  // node lease -> job lease -> read the job -> watch it -> ready.
  void start_sequence() {
    phase = Phase::starting;
    if (node_lease == 0) {
      client.lease_grant(node_ttl, guard(
                                       "node lease grant",
                                       [this](etcd::LeaseGrantResponse r) {
                                         node_lease = r.id;
                                         start_sequence();
                                       },
                                       false));
      return;
    }
    if (job_lease == 0) return claim_job_lease();
    sync();
  }

  void claim_job_lease() {
    // A lease of a claim that failed goes to the next one: a new lease per try would leave one
    // more lease in etcd each time (until its TTL), and revoking it is unsafe, since the failed
    // claim may have committed (its answer lost) and other agents may already use it.
    if (spare_job_lease != 0) return claim_job_lease_with(spare_job_lease);
    client.lease_grant(
        job_ttl, guard(
                     "job lease grant", [this](etcd::LeaseGrantResponse r) { claim_job_lease_with(r.id); }, false));
  }

  // Takes the job lease: puts P"lease" if it is absent (a new job) or still holds the epoch this
  // agent found gone (claim_expect, see job_vanished), and with it clears what the job it
  // replaces left behind: the log (entries on the old job lease, which a deleted lease key or
  // entry 0 leaves in place), the inbox (events reported to that job; their agents report them
  // again) and P"leader" (a sequencer of the old log, whose node lease lives on). Otherwise
  // another agent claimed first: its lease is the job's.
  void claim_job_lease_with(std::int64_t mine) {
    spare_job_lease = 0;
    etcd::TxnRequest t;
    t.compare.push_back(
        {lease_key, etcd::Compare::Target::mod_revision, etcd::Compare::Result::equal, claim_expect, {}});
    t.success.emplace_back(etcd::PutRequest{lease_key, std::to_string(mine), mine});
    t.success.emplace_back(etcd::DeleteRangeRequest{log_prefix, etcd::prefix_range_end(log_prefix)});
    t.success.emplace_back(etcd::DeleteRangeRequest{inbox_prefix, etcd::prefix_range_end(inbox_prefix)});
    t.success.emplace_back(etcd::DeleteRangeRequest{leader_key, {}});
    t.failure.emplace_back(etcd::RangeRequest{lease_key, {}, 0, 0, false, false});
    auto claimed = guard("job lease claim", [this, mine](etcd::TxnResponse tr) {
      if (tr.succeeded) {
        job_lease = mine;
        lease_rev = tr.header.revision;
      } else {
        const etcd::KeyValue* kv =
            tr.responses.empty() || tr.responses[0].range.kvs.empty() ? nullptr : &tr.responses[0].range.kvs[0];
        if (kv == nullptr) {  // gone meanwhile (or the epoch we found gone was deleted): claim it absent
          claim_expect = 0;
          return claim_job_lease_with(mine);
        }
        std::int64_t other = 0;
        std::from_chars(kv->value.data(), kv->value.data() + kv->value.size(), other);
        // The key may hold our own lease: the client retries a request whose
        // answer was lost on the next endpoint, and the first try committed.
        // Revoking it then would delete the job's state with it.
        if (other != mine) client.lease_revoke(mine, [](const auto&, auto) {});
        if (other <= 0) {  // garbage: replace it (and what its job left) with a lease of our own
          spdlog::warn("etcd rendezvous '{}': {} holds '{}', not a lease id; claiming the job anew", options.run_id,
                       lease_key, kv->value.substr(0, 40));
          claim_expect = kv->mod_revision;
          return claim_job_lease();
        }
        job_lease = other;
        lease_rev = kv->mod_revision;
      }
      claim_expect = 0;
      sync();
    });
    client.txn(std::move(t), [this, mine, claimed = std::move(claimed)](const std::optional<etcd::EtcdError>& err,
                                                                        etcd::TxnResponse tr) mutable {
      // A lease etcd no longer knows (NotFound) is not kept for the next try.
      if (err && !stopped() && err->grpc_code != 5) spare_job_lease = mine;
      claimed(err, std::move(tr));
    });
  }

  // Reads this agent's view of the job (view_range), applies the log, then follows it with a
  // watch from the revision of the read.
  void sync() {
    syncing = true;
    watch_retry_timer.cancel();  // a re-read after a failed watch is this one
    if (watch_id) client.cancel_watch(*watch_id);
    watch_id.reset();
    const auto [from, to] = view_range();
    // Only the latest read counts: the role (and with it the range) may have changed since.
    const std::uint64_t gen = ++sync_gen;
    client.range_all({from, to, 0, 0, false, false}, etcd::kMaxJobBytes,
                     guard("read", [this, gen](etcd::RangeResponse r) {
                       if (gen != sync_gen) return;
                       syncing = false;
                       on_view(std::move(r));
                     }));
  }

  // The read of sync(): checks the job is still the one this agent follows, then applies it.
  void on_view(etcd::RangeResponse r) {
    std::optional<etcd::KeyValue> lease_kv, leader_kv;
    std::set<std::string> now_live;
    std::map<std::string, InboxEntry> now_inbox;
    std::vector<std::pair<std::int64_t, std::string>> entries;
    for (etcd::KeyValue& kv : r.kvs) {
      if (kv.key == lease_key) {
        lease_kv = kv;
      } else if (kv.key == leader_key) {
        leader_kv = kv;
      } else if (kv.key.starts_with(nodes_prefix)) {
        now_live.insert(kv.key);
      } else if (kv.key.starts_with(inbox_prefix)) {
        now_inbox[kv.key] = InboxEntry{kv.mod_revision, std::move(kv.value)};
      } else if (kv.key.starts_with(log_prefix)) {
        if (auto seq = etcd::parse_log_seq(std::string_view(kv.key).substr(log_prefix.size())))
          entries.emplace_back(*seq, std::move(kv.value));
      }
    }
    if (!lease_kv) {
      job_vanished("its lease key is gone");
      return;
    }
    if (lease_kv->mod_revision != lease_rev) {
      // Another agent claimed the job anew since our claim (it found the job gone). Nothing
      // applied yet: that job is ours to follow. Else our replica is of a job that is gone.
      std::int64_t other = 0;
      std::from_chars(lease_kv->value.data(), lease_kv->value.data() + lease_kv->value.size(), other);
      if (log.next_seq() > 0 || leader || other <= 0) {
        job_vanished(fmt::format("its lease key {} was replaced at revision {}", lease_key, lease_kv->mod_revision));
        return;
      }
      job_lease = other;
      lease_rev = lease_kv->mod_revision;
    }
    // Entries are never removed from a job's log: one that does not start at 0, or that lost
    // what this replica applied, is the remains of a removed log.
    if (entries.empty() ? log.next_seq() > 0 : entries.front().first != 0) {
      job_vanished(fmt::format(
          "its log was removed: a read at revision {} found {} entries{} where this agent applied {}",
          r.header.revision, entries.size(),
          entries.empty() ? std::string() : fmt::format(", the first {}", entries.front().first), log.next_seq()));
      return;
    }
    // Our own leader key that we do not sequence with (a campaign that committed while the job
    // was claimed anew): take it up, else nobody would sequence while it lives.
    if (!leader && leader_kv && node_lease != 0 && leader_kv->lease == node_lease &&
        leader_kv->value == options.node.id.to_string()) {
      spdlog::info("etcd rendezvous '{}': this agent holds {}; sequencing the log", options.run_id, leader_key);
      leader = true;
      leader_rev = leader_kv->create_revision;
      return sync();  // read the inbox and the node keys, watch everything
    }
    leader_known = leader_kv.has_value();
    if (leader && !(leader_kv && leader_kv->create_revision == leader_rev)) {
      spdlog::info("etcd rendezvous '{}': this agent no longer sequences the log", options.run_id);
      leader = false;
    }
    if (leader) {
      live = std::move(now_live);
      inbox = std::move(now_inbox);
    } else {
      live.clear();
      inbox.clear();
    }
    for (auto& [seq, value] : entries) {
      if (seq < log.next_seq()) continue;
      if (seq != log.next_seq()) break;
      apply_entry(seq, value);
      if (stopped()) return;
    }
    if (leader) {
      // A member whose node key is absent may have died while nobody sequenced.
      if (const RendezvousJob* job = log.job()) {
        for (const MemberStatus& m : job->status(TimePoint{}).members) {
          if (!live.count(node_key(m.id))) expiry_candidates.insert(node_key(m.id));
        }
      }
    }
    start_watch(r.header.revision + 1);
    if (phase == Phase::starting) {
      phase = Phase::ready;
      keepalive_tick();
    }
    after_apply();
  }

  // The job's state expired in etcd (every agent was cut off for the job lease TTL), or someone
  // deleted part of it. Start a fresh log: the job lease claim replaces the epoch this agent
  // knew (unless another agent did so first) and clears what is left of it, P"leader" included;
  // an agent with an assignment re-registers it (the registry's rebuild path).
  void job_vanished(const std::string& why) {
    spdlog::warn("etcd rendezvous '{}': the job's state in etcd vanished ({}); re-registering", options.run_id, why);
    log = etcd::JobLog(options.run_id);
    ++epoch;  // answers to calls of the old job's replica are ignored
    watch_retry_timer.cancel();
    if (watch_id) client.cancel_watch(*watch_id);
    watch_id.reset();
    ++sync_gen;
    syncing = false;
    putting = false;
    folding = false;
    campaigning = false;
    claim_expect = lease_rev;
    lease_rev = 0;
    job_lease = 0;
    leader = false;
    leader_known = false;
    inbox.clear();
    live.clear();
    expiry_candidates.clear();
    deadline_timer.cancel();
    // Events not applied yet go again, with ids of a new source, after the re-registration;
    // the old inbox keys are dropped so the fresh log cannot apply them first.
    client.delete_range({inbox_prefix + source + "-", etcd::prefix_range_end(inbox_prefix + source + "-")},
                        [](const auto&, auto) {});
    new_source();
    // A join or rejoin still queued is replaced by the one below.
    std::erase_if(ops, [](const Op& o) {
      return std::holds_alternative<JoinMessage>(o.message) || std::holds_alternative<RejoinMessage>(o.message);
    });
    for (Op& op : ops) {
      op.put = false;
      op.id.clear();
    }
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
      watch_id.reset();
      watch_failed(e);
    };
    h.on_reconnect = [this](const std::string& why, bool worked) {
      if (!stopped()) watch_broke(why, worked);
    };
    const auto [key, end] = view_range();
    watch_started = std::chrono::steady_clock::now();
    watch_id = client.watch({key, end, from, true}, std::move(h));
  }

  // The watch ended (refused, malformed or oversized message): re-read the job after a backoff.
  // A watch that keeps ending soon after it starts counts against the same budget as failed
  // calls (give_up_after), so a member that answers every watch wrongly ends the job with its
  // error instead of being asked again and again.
  void watch_failed(const etcd::EtcdError& e) {
    const TimePoint now = std::chrono::steady_clock::now();
    // One that ran for a while (or delivered events) worked: a new streak starts.
    if (watch_failing_since && now - watch_started > options.etcd.request_timeout) watch_failing_since.reset();
    if (!watch_failing_since) {
      watch_failing_since = now;
      watch_failures = 0;
      watch_backoff.reset();
    }
    ++watch_failures;
    healthy = false;
    last_error = e.message;
    if (now - *watch_failing_since >= options.give_up_after) {
      auto cb = events.on_unreachable;
      const std::string msg =
          fmt::format("etcd rendezvous '{}': the watch on etcd {} failed {} times in a row for {}; last error: {}",
                      options.run_id, where(), watch_failures, format_seconds(now - *watch_failing_since), e.message);
      stop();
      if (cb) cb(msg);
      return;
    }
    spdlog::warn("etcd rendezvous '{}': {}; re-reading the job", options.run_id, e.message);
    // Nothing is applied, appended or put on a view that is not followed.
    syncing = true;
    ++sync_gen;
    watch_retry_timer.expires_after(watch_backoff.next_delay());
    watch_retry_timer.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
      if (ec || self->stopped()) return;
      self->sync();
    });
  }

  // The client resumes a broken watch by itself, without end. One that breaks again and again
  // before its stream ever works (no connection, no reply in time: a proxy that buffers the
  // stream, a member that accepts and never answers) would leave the agent waiting for events
  // that never come, while its calls succeed: counted against the same budget as failed calls.
  void watch_broke(const std::string& why, bool worked) {
    if (worked) {
      watch_breaking_since.reset();
      return;
    }
    const TimePoint now = std::chrono::steady_clock::now();
    if (!watch_breaking_since) {
      watch_breaking_since = now;
      watch_breaks = 0;
    }
    ++watch_breaks;
    if (now - *watch_breaking_since >= options.give_up_after) {
      auto cb = events.on_unreachable;
      const std::string msg = fmt::format(
          "etcd rendezvous '{}': the watch on etcd {} broke {} times in a row for {} without a stream that worked; "
          "last: {}",
          options.run_id, where(), watch_breaks, format_seconds(now - *watch_breaking_since), why);
      stop();
      if (cb) cb(msg);
      return;
    }
    if (watch_breaks == 3) {
      spdlog::warn(
          "etcd rendezvous '{}': the watch on etcd {} keeps breaking before its stream works ({}); resuming it",
          options.run_id, where(), why);
    }
  }

  void on_watch(const etcd::WatchMessage& m) {
    if (phase != Phase::ready || syncing) return;  // stopped, or a watch of a job that vanished
    watch_failing_since.reset();
    watch_breaking_since.reset();
    for (const etcd::WatchEvent& e : m.events) {
      const std::string& key = e.kv.key;
      const bool put = e.type == etcd::WatchEvent::Type::put;
      if (key.starts_with(log_prefix)) {
        auto seq = etcd::parse_log_seq(std::string_view(key).substr(log_prefix.size()));
        if (!seq) continue;
        if (!put) {
          if (*seq == 0) {
            return job_vanished(fmt::format("its log was removed: entry 0 deleted at revision {}", e.kv.mod_revision));
          }
          continue;
        }
        if (*seq < log.next_seq()) continue;
        if (*seq > log.next_seq()) return sync();  // a gap: re-read
        apply_entry(*seq, e.kv.value);
      } else if (key == leader_key) {
        leader_known = put;
        if (leader && (!put || e.kv.create_revision != leader_rev)) return step_down("its leader key is gone");
      } else if (key == lease_key) {
        // Deleted: by the job lease's expiry, or by another client. Put anew: another agent
        // claimed the job anew (it found the job gone) and cleared the log this replica follows.
        if (!put) {
          return job_vanished(
              fmt::format("its lease key {} was deleted at revision {} (the job lease expired, or "
                          "another etcd client deleted the key)",
                          lease_key, e.kv.mod_revision));
        }
        if (e.kv.mod_revision != lease_rev) {
          return job_vanished(
              fmt::format("its lease key {} was replaced at revision {}", lease_key, e.kv.mod_revision));
        }
      } else if (!leader) {
        continue;
      } else if (key.starts_with(nodes_prefix)) {
        if (put) {
          live.insert(key);
        } else {
          live.erase(key);
          expiry_candidates.insert(key);
        }
      } else if (key.starts_with(inbox_prefix)) {
        if (put) {
          inbox[key] = InboxEntry{e.kv.mod_revision, e.kv.value};
        } else {
          inbox.erase(key);
        }
      }
      if (stopped()) return;
    }
    after_apply();
  }

  // ---- sequencer election ----

  void campaign() {
    if (leader || leader_known) failing.erase("campaign");  // no longer tried
    if (phase != Phase::ready || leader || leader_known || campaigning || leaving || syncing || node_lease == 0) return;
    campaigning = true;
    etcd::TxnRequest t;
    t.compare.push_back({leader_key, etcd::Compare::Target::create_revision, etcd::Compare::Result::equal, 0, {}});
    t.success.emplace_back(etcd::PutRequest{leader_key, options.node.id.to_string(), node_lease});
    t.failure.emplace_back(etcd::RangeRequest{leader_key, {}, 0, 0, false, false});
    client.txn(std::move(t), guard("campaign", [this, gen = epoch](etcd::TxnResponse r) {
                 if (gen != epoch) return;  // a later claim deleted the key, or sync() takes it up
                 campaigning = false;
                 std::int64_t rev = r.header.revision;
                 if (!r.succeeded) {
                   const etcd::KeyValue* kv =
                       r.responses.empty() || r.responses[0].range.kvs.empty() ? nullptr : &r.responses[0].range.kvs[0];
                   leader_known = kv != nullptr;
                   // Our own key under our lease: a retry of this txn whose first answer was lost
                   // (the client tries the next endpoint) found the put that had committed.
                   if (kv == nullptr || kv->value != options.node.id.to_string() || kv->lease != node_lease) {
                     return pump();
                   }
                   rev = kv->create_revision;
                 }
                 spdlog::debug("etcd rendezvous '{}' [{}]: sequencing the log", options.run_id,
                               options.node.id.to_string());
                 leader = true;
                 leader_known = true;
                 leader_rev = rev;
                 sync();  // read the inbox and the node keys, watch everything
               }));
  }

  void step_down(const std::string& why) {
    spdlog::info("etcd rendezvous '{}': this agent stops sequencing the log ({})", options.run_id, why);
    leader = false;
    inbox.clear();
    live.clear();
    expiry_candidates.clear();
    deadline_timer.cancel();
    sync();
  }

  NodeInfo node_info() const { return options.node; }

  void apply_entry(std::int64_t seq, const std::string& value) {
    std::vector<etcd::LogEvent> batch;
    if (std::string why = etcd::decode_batch(value, WireLimits{}, batch); !why.empty()) {
      // Every replica skips the same bad entry, so they stay in step.
      spdlog::error("etcd rendezvous '{}': log entry {} under {} is malformed ({}); skipped", options.run_id, seq,
                    log_prefix, why);
      batch.clear();
    }
    Decisions actions = log.apply(seq, batch);
    spdlog::debug("etcd rendezvous '{}' [{}]: applied entry {} ({} events, {} actions)", options.run_id,
                  options.node.id.to_string(), seq, batch.size(), actions.size());
    for (const etcd::LogEvent& ev : batch) {
      // Our own event is in: forget it and drop its inbox key.
      auto mine = std::find_if(ops.begin(), ops.end(), [&](const Op& o) { return !o.id.empty() && o.id == ev.id; });
      if (mine != ops.end()) {
        client.delete_range({inbox_prefix + mine->id, {}}, [](const auto&, auto) {});
        ops.erase(mine);
      }
      // A join of a node whose key is already gone: nobody saw it alive, so expire it now.
      if (const auto* j = std::get_if<JoinMessage>(&ev.message);
          leader && j != nullptr && ev.kind == etcd::EventKind::message && !live.count(node_key(j->request.node.id))) {
        expiry_candidates.insert(node_key(j->request.node.id));
      }
    }
    // Of the progress lines for this node only the last of the entry is news: a batch of N
    // joins would otherwise report N intermediate counts at once.
    std::size_t last_progress = actions.size();
    for (std::size_t i = 0; i < actions.size(); ++i) {
      if (const auto* p = std::get_if<Progress>(&actions[i]); p != nullptr && progress_is_mine(*p)) last_progress = i;
    }
    for (std::size_t i = 0; i < actions.size(); ++i) {
      if (std::holds_alternative<Progress>(actions[i]) && i != last_progress) continue;
      deliver(actions[i]);
      if (stopped()) return;
    }
  }

  bool progress_is_mine(const Progress& p) const {
    const NodeId& me = options.node.id;
    return p.node == me || (p.broadcast && log.role(me) == MemberRole::joined);
  }

  void deliver(const Decision& action) {
    const NodeId& me = options.node.id;
    std::visit(
        [&](const auto& a) {
          using A = std::decay_t<decltype(a)>;
          if constexpr (std::is_same_v<A, Progress>) {
            if (progress_is_mine(a) && events.on_progress) events.on_progress(a.text);
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
  // deadline timer (sequencer) and send what is queued.
  void after_apply() {
    if (stopped()) return;
    const RendezvousJob* job = log.job();
    const bool pending_join = std::any_of(ops.begin(), ops.end(), [](const Op& o) {
      return std::holds_alternative<JoinMessage>(o.message) || std::holds_alternative<RejoinMessage>(o.message);
    });
    if (job != nullptr && !job->finished() && !job_done && !pending_join && !leaving) {
      const auto role = log.role(options.node.id);
      if (assignment && role != MemberRole::participant) {
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
      } else if (want_join && !role) {
        enqueue(JoinMessage{options.run_id, JoinRequest{node_info(), replica}}, true);
      }
    }
    arm_deadline();
    pump();
  }

  void arm_deadline() {
    const auto due = leader ? log.next_deadline_ms() : std::nullopt;
    if (!due) {
      deadline_timer.cancel();
      return;
    }
    // At most a day at a time (re-armed when it fires early): a deadline far away must not
    // overflow the timer's nanoseconds.
    const std::int64_t wait = std::clamp<std::int64_t>(*due - wall_ms(), 0, std::int64_t{24} * 3600 * 1000);
    deadline_timer.expires_after(std::chrono::milliseconds(wait));
    deadline_timer.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
      if (ec || self->stopped()) return;
      // Not due by the wall clock (it went back meanwhile: a step of the time service, a
      // restored VM): wait again, or no tick would ever be appended for it.
      if (const auto d = self->leader ? self->log.next_deadline_ms() : std::nullopt; d && *d > wall_ms()) {
        return self->arm_deadline();
      }
      self->fold();
    });
  }

  // Everything this agent may have to send now.
  void pump() {
    if (stopped()) return;
    process_ops();
    campaign();
    fold();
  }

  // ---- reporting: our events into our inbox ----

  void enqueue(ClientMessage m, bool with_node_key = false, bool is_leave = false) {
    if (stopped()) return;
    Op op;
    op.message = std::move(m);
    op.with_node_key = with_node_key;
    op.is_leave = is_leave;
    ops.push_back(std::move(op));
    process_ops();
  }

  void enqueue_front(ClientMessage m, bool with_node_key) {
    Op op;
    op.message = std::move(m);
    op.with_node_key = with_node_key;
    ops.push_front(std::move(op));
  }

  // Puts the first event not yet in the inbox (one at a time, so the inbox holds our events in
  // the order of their counters and mod revisions).
  void process_ops() {
    // Without a lease (being replaced) a put would leave keys that never expire.
    if (phase != Phase::ready || putting || syncing || node_lease == 0) return;
    auto it = std::find_if(ops.begin(), ops.end(), [](const Op& o) { return !o.put; });
    if (it == ops.end()) return;
    if (it->id.empty()) it->id = fmt::format("{}-{:012d}", source, ++op_counter);
    putting = true;
    const etcd::LogEvent ev{wall_ms(), etcd::EventKind::message, it->id, it->message};
    etcd::TxnRequest t;
    t.success.emplace_back(etcd::PutRequest{inbox_prefix + it->id, etcd::encode_event(ev), node_lease});
    if (it->with_node_key) t.success.emplace_back(etcd::PutRequest{my_key, options.node.id.to_string(), node_lease});
    client.txn(std::move(t), guard("report", [this, id = it->id, lease = node_lease, gen = epoch](etcd::TxnResponse) {
                 if (gen != epoch) return;  // job_vanished() put every event up again
                 putting = false;
                 auto op = std::find_if(ops.begin(), ops.end(), [&](const Op& o) { return o.id == id; });
                 // Under a lease we since replaced the key is gone again: put it once more.
                 if (op != ops.end() && lease == node_lease) op->put = true;
                 process_ops();
               }));
  }

  // ---- sequencing: pending events into the log ----

  void fold() {
    if (!leader || folding || syncing || phase != Phase::ready) return;
    const RendezvousJob* job = log.job();
    const std::int64_t now = std::max(wall_ms(), log.last_time_ms());
    std::vector<etcd::LogEvent> batch;
    std::vector<std::string> gone;
    std::size_t bytes = 0;
    // Ids of the sequencer's own events: a source of their own (not op_counter: a later id of
    // this agent's source would make replicas skip its messages still in the inbox).
    auto next_id = [this] { return fmt::format("{}.seq-{:012d}", source, ++seq_counter); };
    // Deadlines that passed come first: they passed before the events still pending.
    if (const auto due = log.next_deadline_ms(); due && *due <= wall_ms()) {
      batch.push_back(etcd::LogEvent{now, etcd::EventKind::tick, next_id(), StatusMessage{options.run_id}});
    }
    // Members whose node key etcd deleted (at most 32 per batch: one compare each).
    if (!expiry_candidates.empty()) {
      std::map<std::string, NodeId> members;
      if (job != nullptr && !job->finished()) {
        for (const MemberStatus& m : job->status(TimePoint{}).members) members.emplace(node_key(m.id), m.id);
      }
      for (auto it = expiry_candidates.begin(); it != expiry_candidates.end();) {
        auto m = members.find(*it);
        if (m == members.end() || live.count(*it)) {
          it = expiry_candidates.erase(it);
          continue;
        }
        if (gone.size() < 32) {
          gone.push_back(*it);
          batch.push_back(
              etcd::LogEvent{now, etcd::EventKind::expired, next_id(), LeaveMessage{options.run_id, m->second}});
        }
        ++it;
      }
    }
    // Pending inbox events, oldest first.
    std::vector<std::pair<std::int64_t, std::string>> order;
    for (const auto& [key, entry] : inbox) order.emplace_back(entry.mod_revision, key);
    std::sort(order.begin(), order.end());
    std::vector<std::string> taken;
    for (const auto& [rev, key] : order) {
      if (batch.size() >= etcd::kMaxBatchEvents) break;
      const std::string& value = inbox[key].value;
      etcd::LogEvent ev;
      std::string why = etcd::decode_event(value, WireLimits{}, ev);
      if (why.empty() && ev.kind != etcd::EventKind::message) why = "only agents' messages may be reported";
      if (why.empty() && "inbox/" + ev.id != std::string_view(key).substr(job_prefix.size()))
        why = "its id does not match its key";
      if (!why.empty()) {
        spdlog::error("etcd rendezvous '{}': inbox key {} is malformed ({}); ignored", options.run_id, key, why);
        inbox.erase(key);
        continue;
      }
      if (log.seen(ev.id)) {  // applied already; its owner deletes the key
        inbox.erase(key);
        continue;
      }
      if (bytes + value.size() > etcd::kMaxBatchBytes && !taken.empty()) break;
      bytes += value.size();
      ev.time_ms = now;
      batch.push_back(std::move(ev));
      taken.push_back(key);
    }
    if (batch.empty()) return;
    folding = true;
    const std::int64_t seq = log.next_seq();
    const std::string key = log_prefix + etcd::log_seq_text(seq);
    std::string value = etcd::encode_batch(batch);
    etcd::TxnRequest t;
    t.compare.push_back({key, etcd::Compare::Target::create_revision, etcd::Compare::Result::equal, 0, {}});
    // The log has no gap and still starts at entry 0 (a removed entry 0 is a removed log: the
    // replicas that see it start a fresh one, and must not apply this entry first).
    auto exists = [&](std::int64_t n) {
      t.compare.push_back({log_prefix + etcd::log_seq_text(n),
                           etcd::Compare::Target::create_revision,
                           etcd::Compare::Result::greater,
                           0,
                           {}});
    };
    if (seq > 0) exists(seq - 1);
    if (seq > 1) exists(0);
    t.compare.push_back(
        {leader_key, etcd::Compare::Target::create_revision, etcd::Compare::Result::equal, leader_rev, {}});
    // Our view of the node keys may lag: etcd itself confirms each expired node's key is gone.
    for (const std::string& g : gone) {
      t.compare.push_back({g, etcd::Compare::Target::create_revision, etcd::Compare::Result::equal, 0, {}});
    }
    t.success.emplace_back(etcd::PutRequest{key, value, job_lease});
    t.failure.emplace_back(etcd::RangeRequest{key, etcd::prefix_range_end(log_prefix), 256, 0, false, false});
    t.failure.emplace_back(etcd::RangeRequest{leader_key, {}, 0, 0, true, false});
    for (const std::string& g : gone) t.failure.emplace_back(etcd::RangeRequest{g, {}, 0, 0, true, false});
    client.txn(std::move(t), guard("append", [this, seq, value = std::move(value), taken = std::move(taken),
                                              gone = std::move(gone), gen = epoch](etcd::TxnResponse r) {
                 if (gen != epoch) return;  // an entry of a job that vanished
                 folding = false;
                 if (!leader) return;
                 if (r.succeeded) {
                   for (const std::string& k : taken) inbox.erase(k);
                   if (log.next_seq() == seq) apply_entry(seq, value);
                   return after_apply();
                 }
                 if (r.responses.size() < 2 + gone.size()) return sync();
                 const auto& lk = r.responses[1].range.kvs;
                 if (lk.empty() || lk[0].create_revision != leader_rev) return step_down("another agent took over");
                 bool changed = false;
                 for (std::size_t i = 0; i < gone.size(); ++i) {
                   if (!r.responses[2 + i].range.kvs.empty()) {
                     live.insert(gone[i]);  // alive after all: the expiry is not due
                     changed = true;
                   }
                 }
                 // Someone appended first (a former sequencer): apply what it wrote, decide again.
                 // Or we did: the client retries a txn whose answer was lost on the next
                 // endpoint, and the watch may have applied our committed entry meanwhile.
                 bool seq_written = false;
                 for (const etcd::KeyValue& kv : r.responses[0].range.kvs) {
                   auto s = etcd::parse_log_seq(std::string_view(kv.key).substr(log_prefix.size()));
                   if (s && *s == seq) seq_written = true;
                   if (!s || *s != log.next_seq()) continue;
                   apply_entry(*s, kv.value);
                   changed = true;
                   if (stopped()) return;
                 }
                 // Neither entry `seq` nor our copy of it: the entry before it or entry 0 must be gone.
                 if (!changed && !seq_written && log.next_seq() <= seq && seq > 0) {
                   return job_vanished(seq == 1
                                           ? std::string("its log was removed: entry 0 is gone")
                                           : fmt::format("its log was removed: entry {} or entry 0 is gone", seq - 1));
                 }
                 after_apply();
               }));
  }

  // ---- keepalive ----

  // A new node lease after this node's expired (the inbox keys wait for it).
  void grant_node_lease() {
    if (stopped() || node_lease != 0 || granting_node_lease) return;
    granting_node_lease = true;
    client.lease_grant(
        node_ttl, [self = shared_from_this()](const std::optional<etcd::EtcdError>& err, etcd::LeaseGrantResponse g) {
          self->granting_node_lease = false;
          self->guard(
              "node lease grant",
              [self](etcd::LeaseGrantResponse r) {
                self->node_lease = r.id;
                self->after_apply();
              },
              false)(err, std::move(g));
        });
  }

  void keepalive_tick() {
    if (stopped()) return;
    if (node_lease != 0) {
      // Keepalives queue up while a member stalls; an answer about a lease this node already
      // replaced says nothing about the current one (acting on it would drop a live lease).
      lease_client.lease_keepalive(node_lease, guard(
                                                   "keepalive",
                                                   [this, id = node_lease](etcd::LeaseKeepAliveResponse r) {
                                                     if (r.ttl > 0 || id != node_lease) return;
                                                     spdlog::warn(
                                                         "etcd rendezvous '{}': this node's lease expired; "
                                                         "taking a new one",
                                                         options.run_id);
                                                     node_lease = 0;
                                                     if (leader) step_down("its lease expired");
                                                     // The inbox keys went with the lease: put what is not applied
                                                     // again.
                                                     for (Op& op : ops) op.put = false;
                                                     grant_node_lease();
                                                   },
                                                   false));
    } else {
      failing.erase("keepalive");                     // of a lease that is gone
      if (phase == Phase::ready) grant_node_lease();  // retried on every tick until it works
    }
    // The job lease needs one keeper: the sequencer (or, while none is known, everyone). A
    // sequencer that dies is replaced within a node TTL; the job TTL is at least three.
    if (job_lease != 0 && (leader || !leader_known)) {
      // An answer about a job lease this agent no longer uses (the job was claimed anew) says
      // nothing about the job.
      lease_client.lease_keepalive(job_lease,
                                   guard(
                                       "job keepalive",
                                       [this, id = job_lease](etcd::LeaseKeepAliveResponse r) {
                                         if (r.ttl <= 0 && !syncing && id == job_lease && phase == Phase::ready)
                                           job_vanished("its lease expired");
                                       },
                                       false));
    } else {
      failing.erase("job keepalive");  // another agent keeps it now
    }
    // Three keepalives per TTL, like etcd's own clients: one lost or late keepalive costs nothing.
    keepalive_timer.expires_after(std::chrono::milliseconds(node_ttl * 1000 / 3));
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

  // The leave is applied once it left `ops`; then the lease goes (and with it our node key).
  void wait_leave_done() {
    if (stopped()) return;
    const bool pending = std::any_of(ops.begin(), ops.end(), [](const Op& o) { return o.is_leave; });
    if (pending) {
      leave_poll_timer.expires_after(10ms);
      leave_poll_timer.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
        if (ec || self->stopped()) return;
        self->pump();
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
bool EtcdRendezvous::sequencing() const { return impl_->leader && impl_->phase == Impl::Phase::ready; }
bool EtcdRendezvous::connected() const { return impl_->phase == Impl::Phase::ready && impl_->healthy; }

RegistryStatus query_etcd_status(const etcd::EtcdClientOptions& options, const std::string& prefix,
                                 const std::string& run_id, std::chrono::milliseconds timeout) {
  asio::io_context io;
  etcd::EtcdClient client(io, options);
  const std::string base = run_id.empty() ? prefix : prefix + run_id + "/";
  std::optional<etcd::EtcdError> error;
  std::optional<etcd::RangeResponse> reply;
  client.range_all({base, etcd::prefix_range_end(base), 0, 0, false, false}, etcd::kMaxJobBytes,
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
    std::vector<etcd::LogEvent> batch;
    if (!etcd::decode_batch(kv.value, WireLimits{}, batch).empty()) batch.clear();  // skipped, as replicas do
    it->second.apply(*seq, batch);
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
