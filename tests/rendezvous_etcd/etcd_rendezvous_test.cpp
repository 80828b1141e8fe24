// EtcdRendezvous against real etcd: simulated agents (instances on one io_context) forming
// rounds, restarts, the budget, lease expiry (shrink), a late joiner (grow), the exit barrier,
// unreachable etcd / wrong credentials, `status`, and leader loss in a 3-member cluster.
#include <catch2/catch.hpp>

#include <algorithm>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <set>
#include <spdlog/sinks/ringbuffer_sink.h>
#include <spdlog/spdlog.h>

#include "ddprun/rendezvous/etcd_rendezvous.hpp"
#include "etcd_harness.hpp"
#include "fake_gateway.hpp"

using namespace ddprun;
using namespace ddprun::rendezvous;
using namespace std::chrono_literals;
using ddprun::test::EtcdCluster;
using ddprun::test::run_until;

namespace {

// DDPRUN_TEST_DEBUG=1 shows every applied log entry.
const bool kDebug = [] {
  if (std::getenv("DDPRUN_TEST_DEBUG") != nullptr) spdlog::set_level(spdlog::level::debug);
  return true;
}();

JobConfig test_config(int min, int max, int restarts) {
  JobConfig c;
  c.min_nodes = min;
  c.max_nodes = max;
  c.max_restarts = restarts;
  c.join_timeout = 30s;
  c.last_call_timeout = 1s;
  c.close_timeout = 10s;
  c.heartbeat_interval = 500ms;
  c.missed_heartbeats = 3;  // etcd lease TTL 2 s
  c.exit_barrier_timeout = 20s;
  return c;
}

struct Agent {
  int index = 0;
  std::unique_ptr<EtcdRendezvous> rdzv;
  NodeInfo node;
  std::vector<Assignment> assignments;
  std::vector<SendRestart> restarts;
  std::optional<SendJobFailed> failed;
  bool completed = false;
  std::optional<std::string> refused, unreachable;

  Agent(boost::asio::io_context& io, int i, const std::string& endpoints, const std::string& run_id,
        const JobConfig& config, const std::string& user = {}, const std::string& password = {},
        Duration give_up_after = 20s) {
    index = i;
    node.id = NodeId{"127.0.0." + std::to_string(i + 1), 1000 + i, "inst" + std::to_string(i)};
    node.addr = node.id.addr;
    node.local_world_size = 2;
    node.store_host = node.addr;
    node.store_port = static_cast<std::uint16_t>(29500 + i);
    EtcdRendezvousOptions o;
    o.etcd.endpoints = etcd::parse_endpoints(endpoints, "test").endpoints;
    o.etcd.connect_timeout = 1s;
    o.etcd.request_timeout = 3s;
    o.etcd.username = user;
    o.etcd.password = password;
    o.prefix = "/ddprun-test/";
    o.run_id = run_id;
    o.node = node;
    o.config = config;
    o.give_up_after = give_up_after;
    RendezvousEvents ev;
    ev.on_assignment = [this](const Assignment& a) { assignments.push_back(a); };
    ev.on_restart = [this](const SendRestart& r) {
      restarts.push_back(r);
      rejoin();
    };
    ev.on_job_failed = [this](const SendJobFailed& f) { failed = f; };
    ev.on_job_completed = [this] { completed = true; };
    ev.on_refused = [this](const std::string& why) { refused = why; };
    ev.on_unreachable = [this](const std::string& why) { unreachable = why; };
    rdzv = std::make_unique<EtcdRendezvous>(io, std::move(o), std::move(ev));
  }

  void rejoin() {
    // Like the agent: a new NCCL id for the round it joins.
    rdzv->set_nccl_ids(std::vector<std::uint8_t>(
        128, static_cast<std::uint8_t>(10 * static_cast<std::size_t>(index) + restarts.size())));
    rdzv->join();
  }
  std::uint64_t round() const { return assignments.empty() ? ~0ULL : assignments.back().round; }
};

using Agents = std::vector<std::unique_ptr<Agent>>;

Agents make_agents(boost::asio::io_context& io, int n, const std::string& endpoints, const std::string& run_id,
                   const JobConfig& c) {
  Agents a;
  for (int i = 0; i < n; ++i) a.push_back(std::make_unique<Agent>(io, i, endpoints, run_id, c));
  return a;
}

// Every agent in `who` holds an assignment for the same round, above `after` (when given).
bool same_round(const std::vector<Agent*>& who, std::optional<std::uint64_t> after = {}) {
  if (who.empty() || who[0]->assignments.empty() || who[0]->rdzv->current_assignment() == std::nullopt) return false;
  const std::uint64_t r = who[0]->round();
  if (after && r <= *after) return false;
  for (Agent* a : who) {
    if (!a->rdzv->current_assignment() || a->round() != r) return false;
  }
  return true;
}

std::vector<Agent*> ptrs(Agents& agents, std::vector<int> only = {}) {
  std::vector<Agent*> out;
  for (auto& a : agents) {
    if (only.empty() || std::find(only.begin(), only.end(), a->index) != only.end()) out.push_back(a.get());
  }
  return out;
}

void check_consistent_round(const std::vector<Agent*>& who) {
  std::set<int> ranks;
  const Assignment& first = who[0]->assignments.back();
  const Assignment* rank0 = nullptr;
  for (Agent* a : who) {
    const Assignment& x = a->assignments.back();
    ranks.insert(x.group_rank);
    CHECK(x.group_world_size == static_cast<int>(who.size()));
    CHECK(x.world_size == 2 * static_cast<int>(who.size()));
    CHECK(x.rank_offset == 2 * x.group_rank);
    CHECK(x.master_addr == first.master_addr);
    CHECK(x.master_port == first.master_port);
    CHECK(x.nccl_id == first.nccl_id);
    CHECK(x.restart_count == first.restart_count);
    if (x.group_rank == 0) rank0 = &x;
  }
  CHECK(ranks.size() == who.size());
  REQUIRE(rank0 != nullptr);
}

}  // namespace

// A worker failure of `node` in `round`: what an agent reports (no ranks).
WorkerFailure failure(std::uint64_t round, const NodeId& node, int exit_code, std::string message) {
  WorkerFailure f;
  f.round = round;
  f.node = node;
  f.exit_code = exit_code;
  f.message = std::move(message);
  return f;
}

TEST_CASE("etcd rendezvous: a round, a worker failure restarts everyone, the spent budget fails the job",
          "[etcd][rendezvous]") {
  EtcdCluster cluster(1, "rdzv-restart");
  boost::asio::io_context io;
  Agents agents = make_agents(io, 3, cluster.endpoints(), "job1", test_config(3, 3, 1));
  for (auto& a : agents) a->rejoin();
  auto all = ptrs(agents);
  REQUIRE(run_until(
      io, [&] { return same_round(all); }, 20s));
  check_consistent_round(all);
  std::map<int, int> rank_of;
  for (auto& a : agents) rank_of[a->index] = a->assignments.back().group_rank;
  CHECK(agents[0]->rdzv->connected());

  // status through etcd, as `ddprun status --rdzv-backend etcd` reads it.
  etcd::EtcdClientOptions so;
  so.endpoints = etcd::parse_endpoints(cluster.endpoints(), "test").endpoints;
  const RegistryStatus st = query_etcd_status(so, "/ddprun-test/", "", 5000ms);
  REQUIRE(st.jobs.size() == 1);
  CHECK(st.jobs[0].run_id == "job1");
  CHECK(st.jobs[0].state == JobState::running);
  CHECK(st.jobs[0].members.size() == 3);

  const std::uint64_t r0 = agents[0]->round();
  WorkerFailure f;
  f.round = r0;
  f.node = agents[1]->node.id;
  f.global_rank = agents[1]->assignments.back().rank_offset + 1;
  f.local_rank = 1;
  f.exit_code = 3;
  f.message = "boom";
  agents[1]->rdzv->report_failure(f);
  REQUIRE(run_until(
      io, [&] { return same_round(all, r0); }, 20s));
  for (auto& a : agents) {
    REQUIRE(a->restarts.size() == 1);
    CHECK(a->restarts[0].kind == RoundEnd::worker_failure);
    CHECK_THAT(a->restarts[0].reason, Catch::Contains("boom"));
    CHECK(a->assignments.back().restart_count == 1);
    CHECK(a->assignments.back().group_rank == rank_of[a->index]);  // stable ranks
  }
  check_consistent_round(all);

  f.round = agents[0]->round();
  f.node = agents[2]->node.id;
  f.exit_code = 7;
  agents[2]->rdzv->report_failure(f);
  REQUIRE(run_until(
      io, [&] { return std::all_of(agents.begin(), agents.end(), [](auto& a) { return a->failed.has_value(); }); },
      20s));
  for (auto& a : agents) {
    CHECK(a->failed->exit_code == 7);
    REQUIRE(a->failed->root_cause);
    CHECK(a->failed->root_cause->failure.exit_code == 7);
    CHECK_THAT(a->failed->reason, Catch::Contains("budget is spent"));
    CHECK(a->restarts.size() == 1);
  }
}

TEST_CASE("etcd rendezvous: a stopped agent's lease expires (shrink), a late joiner grows, exit barrier",
          "[etcd][rendezvous]") {
  EtcdCluster cluster(1, "rdzv-elastic");
  boost::asio::io_context io;
  const JobConfig c = test_config(2, 3, 0);
  Agents agents = make_agents(io, 3, cluster.endpoints(), "job2", c);
  for (auto& a : agents) a->rejoin();
  REQUIRE(run_until(
      io, [&] { return same_round(ptrs(agents)); }, 20s));
  const std::uint64_t r0 = agents[0]->round();

  // Agent 2 stops heartbeating (as if SIGKILLed): etcd drops its key after the 2 s lease.
  agents[2]->rdzv->stop();
  auto survivors = ptrs(agents, {0, 1});
  REQUIRE(run_until(
      io, [&] { return same_round(survivors, r0); }, 20s));
  for (Agent* a : survivors) {
    REQUIRE(a->restarts.size() == 1);
    CHECK(a->restarts[0].kind == RoundEnd::membership_change);
    CHECK_THAT(a->restarts[0].reason, Catch::Contains("lost"));
  }
  check_consistent_round(survivors);
  CHECK(survivors[0]->assignments.back().restart_count == 0);  // membership changes are free

  // A new node joins the running job: a membership change grows it to 3.
  const std::uint64_t r1 = agents[0]->round();
  agents.push_back(std::make_unique<Agent>(io, 3, cluster.endpoints(), "job2", c));
  agents.back()->rejoin();
  auto grown = ptrs(agents, {0, 1, 3});
  REQUIRE(run_until(
      io, [&] { return same_round(grown, r1); }, 20s));
  check_consistent_round(grown);

  // Exit barrier: completed only once every participant succeeded.
  const std::uint64_t r2 = agents[0]->round();
  agents[0]->rdzv->report_success(r2);
  agents[1]->rdzv->report_success(r2);
  run_until(
      io, [&] { return agents[0]->completed; }, 1000ms);
  CHECK_FALSE(agents[0]->completed);
  agents[3]->rdzv->report_success(r2);
  REQUIRE(run_until(
      io, [&] { return std::all_of(grown.begin(), grown.end(), [](Agent* a) { return a->completed; }); }, 20s));
}

TEST_CASE("etcd rendezvous: the sequencer dies, another agent takes over and the job goes on smaller",
          "[etcd][rendezvous]") {
  EtcdCluster cluster(1, "rdzv-sequencer");
  boost::asio::io_context io;
  const JobConfig c = test_config(2, 3, 0);
  Agents agents = make_agents(io, 3, cluster.endpoints(), "job7", c);
  for (auto& a : agents) a->rejoin();
  REQUIRE(run_until(
      io, [&] { return same_round(ptrs(agents)); }, 20s));
  const std::uint64_t r0 = agents[0]->round();
  // Exactly one agent appends to the log.
  REQUIRE(std::count_if(agents.begin(), agents.end(), [](auto& a) { return a->rdzv->sequencing(); }) == 1);
  const int seq = static_cast<int>(
      std::find_if(agents.begin(), agents.end(), [](auto& a) { return a->rdzv->sequencing(); }) - agents.begin());

  // The sequencer stops (as if SIGKILLed): its lease, its node key and P/leader expire; another
  // agent takes over and appends the old sequencer's expiry (a free membership change).
  agents[static_cast<std::size_t>(seq)]->rdzv->stop();
  std::vector<int> rest_idx;
  for (int i = 0; i < 3; ++i) {
    if (i != seq) rest_idx.push_back(i);
  }
  auto rest = ptrs(agents, rest_idx);
  REQUIRE(run_until(
      io, [&] { return same_round(rest, r0); }, 20s));
  for (Agent* a : rest) {
    REQUIRE(a->restarts.size() == 1);
    CHECK(a->restarts[0].kind == RoundEnd::membership_change);
    CHECK_THAT(a->restarts[0].reason, Catch::Contains("lost"));
  }
  check_consistent_round(rest);
  CHECK(rest[0]->assignments.back().restart_count == 0);
  CHECK(std::count_if(rest.begin(), rest.end(), [](Agent* a) { return a->rdzv->sequencing(); }) == 1);

  // The new sequencer serves reports: a failure with no budget left fails the job everywhere.
  const WorkerFailure f = failure(rest[0]->round(), rest[0]->node.id, 7, "after the takeover");
  rest[1]->rdzv->report_failure(f);
  REQUIRE(run_until(
      io, [&] { return std::all_of(rest.begin(), rest.end(), [](Agent* a) { return a->failed.has_value(); }); }, 20s));
  CHECK(rest[0]->failed->exit_code == 7);
}

TEST_CASE("etcd rendezvous: a new sequencer's tick and expiry ahead of its own pending join do not hide it",
          "[etcd][rendezvous]") {
  // B sequences its own join (entry 0, a last-call deadline 1 s later) and dies. A joins while
  // B's leader key still lives: A's join waits in the inbox. When B's lease expires A takes
  // over and appends, in one entry, the tick of the deadline that passed, B's expiry, then its
  // own join. The tick and the expiry must not carry later ids of A's own source, else every
  // replica skips the join as seen (A's agent notices and sends it again, one entry later; a
  // skipped failure report is not sent again).
  EtcdCluster cluster(1, "rdzv-takeover-pending");
  boost::asio::io_context io;
  JobConfig c = test_config(1, 2, 0);
  c.last_call_timeout = 1s;
  Agent b(io, 1, cluster.endpoints(), "job-pending", c);
  Agent a(io, 0, cluster.endpoints(), "job-pending", c);
  etcd::EtcdClientOptions wo;
  wo.endpoints = etcd::parse_endpoints(cluster.endpoints(), "test").endpoints;
  etcd::EtcdClient watcher(io, wo);
  const std::string log_prefix = "/ddprun-test/job-pending/log/";
  // A replica of our own, fed by a watch on the log: whether A is a member after entry 1.
  int entries = 0;
  etcd::JobLog replay("job-pending");
  std::optional<std::optional<MemberRole>> a_after_takeover;
  etcd::WatchHandlers wh;
  wh.on_message = [&](const etcd::WatchMessage& m) {
    for (const etcd::WatchEvent& e : m.events) {
      if (e.type != etcd::WatchEvent::Type::put) continue;
      ++entries;
      const auto seq = etcd::parse_log_seq(std::string_view(e.kv.key).substr(log_prefix.size()));
      std::vector<etcd::LogEvent> batch;
      REQUIRE(seq.has_value());
      REQUIRE(etcd::decode_batch(e.kv.value, WireLimits{}, batch) == "");
      replay.apply(*seq, batch);
      if (*seq == 1) a_after_takeover = replay.role(a.node.id);
    }
  };
  watcher.watch({log_prefix, etcd::prefix_range_end(log_prefix), 1, false}, wh);
  b.rejoin();
  REQUIRE(run_until(
      io, [&] { return entries >= 1; }, 20s));
  REQUIRE(b.rdzv->sequencing());
  REQUIRE(b.assignments.empty());  // the last call is still open
  b.rdzv->stop();
  a.rejoin();
  REQUIRE(run_until(
      io, [&] { return !a.assignments.empty() || a.failed || a.refused || a.unreachable; }, 20s));
  REQUIRE(a.assignments.size() == 1);
  CHECK(a.assignments[0].group_world_size == 1);
  CHECK(a.rdzv->sequencing());
  // The takeover entry itself made A a member (not a join sent again after it was skipped).
  REQUIRE(run_until(
      io, [&] { return a_after_takeover.has_value(); }, 10s));
  CHECK(a_after_takeover->has_value());
}

// A TCP proxy in front of one etcd member. It relays both ways, except that the answer to the
// first request whose bytes contain every string of `match` is swallowed and that connection
// closed: what a client sees when a member commits a write and dies before answering.
class DroppingProxy {
 public:
  DroppingProxy(boost::asio::io_context& io, std::uint16_t upstream, std::vector<std::string> match)
      : io_(io),
        acceptor_(io, {boost::asio::ip::make_address("127.0.0.1"), 0}),
        upstream_(upstream),
        match_(std::move(match)) {
    accept();
  }
  std::uint16_t port() const { return acceptor_.local_endpoint().port(); }
  bool dropped() const { return dropped_; }
  // The first line of every request relayed (of its first read).
  std::vector<std::string> request_lines;
  // From now on, drop the answer to the first request that matches `match`; with `refuse`, that
  // request is not passed on and its answer is an HTTP 503 (a member that cannot serve it).
  void set_match(std::vector<std::string> match, bool refuse = false) {
    match_ = std::move(match);
    dropped_ = false;
    refuse_ = refuse;
  }

 private:
  using tcp = boost::asio::ip::tcp;
  struct Pipe {
    tcp::socket client, server;
    bool drop_answer = false;
    std::string request;  // what the client sent since the last answer (a request may span reads)
    std::array<char, 65536> up{}, down{};
    explicit Pipe(boost::asio::io_context& io) : client(io), server(io) {}
    void close() {
      boost::system::error_code ec;
      client.close(ec);
      server.close(ec);
    }
  };

  void accept() {
    auto p = std::make_shared<Pipe>(io_);
    acceptor_.async_accept(p->client, [this, p](const boost::system::error_code& ec) {
      if (ec) return;
      boost::system::error_code cec;
      p->server.connect({boost::asio::ip::make_address("127.0.0.1"), upstream_}, cec);
      if (cec) {
        p->close();
      } else {
        relay_up(p);
        relay_down(p);
      }
      accept();
    });
  }

  void relay_up(const std::shared_ptr<Pipe>& p) {
    p->client.async_read_some(
        boost::asio::buffer(p->up), [this, p](const boost::system::error_code& ec, std::size_t n) {
          if (ec) return p->close();
          if (p->request.empty()) {
            const std::string_view first(p->up.data(), n);
            request_lines.emplace_back(first.substr(0, first.find('\r')));
          }
          p->request.append(p->up.data(), n);
          if (!dropped_ && std::all_of(match_.begin(), match_.end(),
                                       [&](const std::string& m) { return p->request.find(m) != std::string::npos; })) {
            dropped_ = true;
            p->drop_answer = true;
            if (refuse_) {
              boost::system::error_code ignored;
              p->server.close(ignored);
              static const std::string body = R"({"error":"overloaded","code":14,"message":"overloaded"})";
              auto reply = std::make_shared<std::string>(
                  "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: " +
                  std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" + body);
              boost::asio::async_write(p->client, boost::asio::buffer(*reply),
                                       [p, reply](const boost::system::error_code&, std::size_t) { p->close(); });
              return;
            }
          }
          boost::asio::async_write(p->server, boost::asio::buffer(p->up.data(), n),
                                   [this, p](const boost::system::error_code& wec, std::size_t) {
                                     if (wec) return p->close();
                                     relay_up(p);
                                   });
        });
  }

  void relay_down(const std::shared_ptr<Pipe>& p) {
    p->server.async_read_some(boost::asio::buffer(p->down),
                              [this, p](const boost::system::error_code& ec, std::size_t n) {
                                if (ec || p->drop_answer) return p->close();
                                p->request.clear();
                                boost::asio::async_write(p->client, boost::asio::buffer(p->down.data(), n),
                                                         [this, p](const boost::system::error_code& wec, std::size_t) {
                                                           if (wec) return p->close();
                                                           relay_down(p);
                                                         });
                              });
  }

  boost::asio::io_context& io_;
  tcp::acceptor acceptor_;
  std::uint16_t upstream_;
  std::vector<std::string> match_;
  bool dropped_ = false;
  bool refuse_ = false;
};

// The last 256 lines the default logger writes while it lives.
struct LogCapture {
  std::shared_ptr<spdlog::sinks::ringbuffer_sink_mt> sink = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(256);
  LogCapture() { spdlog::default_logger()->sinks().push_back(sink); }
  ~LogCapture() {
    auto& v = spdlog::default_logger()->sinks();
    v.erase(std::remove(v.begin(), v.end(), sink), v.end());
  }
  LogCapture(const LogCapture&) = delete;
  LogCapture& operator=(const LogCapture&) = delete;
  std::vector<std::string> lines() const { return sink->last_formatted(); }
};

// One agent behind a DroppingProxy (first endpoint) and the member itself (second): the answer to
// the first txn that names `key` is lost, so the client retries it on the member. The job must
// get its round (with `restart`: then fail it once and get the next one), keep it, and its state
// must never vanish.
void lost_answer_case(const std::string& run_id, const std::string& key_suffix, bool restart = false) {
  EtcdCluster cluster(1, run_id);
  boost::asio::io_context io;
  const std::string direct = cluster.endpoints();
  const auto colon = direct.rfind(':');
  DroppingProxy proxy(io, static_cast<std::uint16_t>(std::stoi(direct.substr(colon + 1))),
                      {"POST /v3/kv/txn", etcd::base64_encode("/ddprun-test/" + run_id + "/" + key_suffix)});
  LogCapture log;

  Agent a(io, 0, "127.0.0.1:" + std::to_string(proxy.port()) + "," + direct, run_id,
          test_config(1, 1, restart ? 1 : 0));
  a.rejoin();
  REQUIRE(run_until(
      io, [&] { return !a.assignments.empty(); }, 20s));
  if (restart) {
    const WorkerFailure f = failure(a.round(), a.node.id, 1, "one failure");
    a.rdzv->report_failure(f);
    REQUIRE(run_until(
        io, [&] { return a.assignments.size() == 2; }, 20s));
    CHECK(a.assignments.back().restart_count == 1);
    CHECK(a.assignments.back().round > a.assignments.front().round);
  }
  CHECK(proxy.dropped());
  const std::uint64_t r0 = a.round();
  run_until(
      io, [&] { return a.round() != r0; }, 1500ms);
  CHECK(a.round() == r0);
  for (const std::string& line : log.lines()) {
    INFO(line);
    CHECK(line.find("vanished") == std::string::npos);
  }
}

TEST_CASE("etcd rendezvous: a lost answer to the job lease claim does not revoke the lease it put",
          "[etcd][rendezvous]") {
  // The retried claim fails its compare on the key it put itself; revoking that lease would take
  // the job's state with it.
  lost_answer_case("job-lost-lease", "lease");
}

TEST_CASE("etcd rendezvous: a lost answer to the sequencer campaign still makes the agent the sequencer",
          "[etcd][rendezvous]") {
  // The retried campaign finds the leader key it put itself; an agent that took it for another's
  // would wait for a sequencer that never comes (its own key, kept alive by its own lease).
  lost_answer_case("job-lost-leader", "leader");
}

TEST_CASE("etcd rendezvous: a lost answer to a log append is not taken for a removed log", "[etcd][rendezvous]") {
  // The sequencer's append of entry 1 commits; its answer is lost and the retry fails its
  // compare on the entry it wrote itself, which the watch may already have applied. That is the
  // log going on, not the log gone: the job must not re-register from scratch.
  lost_answer_case("job-lost-append", "log/" + etcd::log_seq_text(1), true);
}

// Another etcd client deletes one key of a running 3-node job (after a restart, so the log has
// several entries). The agents must start a fresh log with a sequencer, re-register, and serve
// the next failure as one restart with the budget counted once; the fresh log holds no entry
// of the old one (all on the new job lease).
void deleted_key_case(const std::string& run_id, const std::string& suffix, const std::string& said) {
  EtcdCluster cluster(1, run_id);
  boost::asio::io_context io;
  LogCapture log;
  Agents agents = make_agents(io, 3, cluster.endpoints(), run_id, test_config(3, 3, 3));
  for (auto& a : agents) a->rejoin();
  auto all = ptrs(agents);
  REQUIRE(run_until(
      io, [&] { return same_round(all); }, 20s));
  const WorkerFailure f = failure(agents[0]->round(), agents[1]->node.id, 3, "first");
  agents[1]->rdzv->report_failure(f);
  REQUIRE(run_until(
      io, [&] { return same_round(all, f.round); }, 20s));
  const std::uint64_t r1 = agents[0]->round();

  etcd::EtcdClientOptions co;
  co.endpoints = etcd::parse_endpoints(cluster.endpoints(), "test").endpoints;
  etcd::EtcdClient tenant(io, co);
  const std::string P = "/ddprun-test/" + run_id + "/";
  // Follow the lease key and the log from the deletion on: the fresh log, replayed, must name
  // all three nodes (each re-registered) before the next failure is reported.
  std::optional<etcd::ResponseHeader> deleted;
  tenant.delete_range({P + suffix, {}}, [&](const std::optional<etcd::EtcdError>& err, etcd::ResponseHeader h) {
    REQUIRE_FALSE(err);
    deleted = h;
  });
  REQUIRE(run_until(
      io, [&] { return deleted.has_value(); }, 10s));
  bool claimed = false;
  std::optional<etcd::JobLog> fresh;
  etcd::WatchHandlers wh;
  wh.on_message = [&](const etcd::WatchMessage& m) {
    for (const etcd::WatchEvent& e : m.events) {
      if (e.type != etcd::WatchEvent::Type::put) continue;
      if (e.kv.key == P + "lease") {
        claimed = true;
        fresh.emplace(run_id);
        continue;
      }
      const auto seq = etcd::parse_log_seq(std::string_view(e.kv.key).substr((P + "log/").size()));
      std::vector<etcd::LogEvent> batch;
      if (!claimed || !seq || !etcd::decode_batch(e.kv.value, WireLimits{}, batch).empty()) continue;
      fresh->apply(*seq, batch);
    }
  };
  tenant.watch({P + "lease", etcd::prefix_range_end(P + "log/"), deleted->revision + 1, false}, wh);
  REQUIRE(run_until(
      io,
      [&] {
        return fresh && std::all_of(agents.begin(), agents.end(), [&](auto& a) { return fresh->role(a->node.id); });
      },
      20s));

  // The next failure: one restart everywhere, counted once.
  agents[2]->rdzv->report_failure(failure(r1, agents[2]->node.id, 4, "second"));
  REQUIRE(run_until(
      io, [&] { return same_round(all, r1); }, 20s));
  for (auto& a : agents) {
    CHECK(a->restarts.size() == 2);
    CHECK_THAT(a->restarts.back().reason, Catch::Contains("second"));
    CHECK(a->assignments.back().restart_count == 2);
  }
  check_consistent_round(all);
  CHECK(std::count_if(agents.begin(), agents.end(), [](auto& a) { return a->rdzv->sequencing(); }) == 1);

  // Every log entry is on the job lease P"lease" names: nothing of the old log is left.
  std::optional<etcd::RangeResponse> keys;
  tenant.range({P, etcd::prefix_range_end(P), 0, 0, false, false},
               [&](const std::optional<etcd::EtcdError>& err, etcd::RangeResponse r) {
                 REQUIRE_FALSE(err);
                 keys = std::move(r);
               });
  REQUIRE(run_until(
      io, [&] { return keys.has_value(); }, 10s));
  std::string job_lease;
  int entries = 0;
  for (const etcd::KeyValue& kv : keys->kvs) {
    if (kv.key == P + "lease") job_lease = kv.value;
  }
  REQUIRE_FALSE(job_lease.empty());
  for (const etcd::KeyValue& kv : keys->kvs) {
    if (!kv.key.starts_with(P + "log/")) continue;
    ++entries;
    INFO(kv.key);
    CHECK(std::to_string(kv.lease) == job_lease);
  }
  CHECK(entries >= 2);
  int vanished = 0;
  for (const std::string& line : log.lines()) {
    if (line.find("vanished") == std::string::npos) continue;
    ++vanished;
    INFO(line);
    CHECK_THAT(line, Catch::Contains(said));
  }
  CHECK(vanished >= 1);
  CHECK(vanished <= 3);  // once per agent at most
}

TEST_CASE("etcd rendezvous: a deleted log entry 0 starts a fresh log with a sequencer; the job goes on",
          "[etcd][rendezvous][vanished]") {
  deleted_key_case("job-del-log0", "log/000000000000", "its log was removed");
}

TEST_CASE("etcd rendezvous: a deleted job lease key starts a fresh log without the old entries; the job goes on",
          "[etcd][rendezvous][vanished]") {
  deleted_key_case("job-del-lease", "lease", "was deleted at revision");
}

TEST_CASE("etcd rendezvous: unreachable etcd fails within the join timeout naming the endpoint", "[etcd][rendezvous]") {
  boost::asio::io_context io;
  const std::string dead = "127.0.0.1:" + std::to_string(ddprun::test::free_port());
  JobConfig c = test_config(1, 1, 0);
  c.join_timeout = 3s;
  Agent a(io, 0, dead, "job3", c);
  const auto t0 = std::chrono::steady_clock::now();
  a.rejoin();
  REQUIRE(run_until(
      io, [&] { return a.unreachable.has_value(); }, 15s));
  CHECK(std::chrono::steady_clock::now() - t0 < 8s);
  CHECK_THAT(*a.unreachable, Catch::Contains(dead));
  CHECK_FALSE(a.rdzv->connected());
}

TEST_CASE("etcd rendezvous: wrong credentials are refused naming the endpoint", "[etcd][rendezvous][auth]") {
  EtcdCluster cluster(1, "rdzv-auth");
  const std::string ep = "--endpoints=" + cluster.member(0).client_url(false);
  REQUIRE(ddprun::test::run_shell("ETCDCTL_API=3 etcdctl " + ep + " user add root:rootpw") == 0);
  REQUIRE(ddprun::test::run_shell("ETCDCTL_API=3 etcdctl " + ep + " auth enable") == 0);
  boost::asio::io_context io;
  Agent bad(io, 0, cluster.endpoints(), "job4", test_config(1, 1, 0), "root", "wrong");
  bad.rejoin();
  REQUIRE(run_until(
      io, [&] { return bad.refused.has_value(); }, 15s));
  CHECK_THAT(*bad.refused, Catch::Contains(cluster.endpoints()) && Catch::Contains("credentials"));
  Agent good(io, 1, cluster.endpoints(), "job4", test_config(1, 1, 0), "root", "rootpw");
  good.rejoin();
  REQUIRE(run_until(
      io, [&] { return !good.assignments.empty(); }, 15s));
}

TEST_CASE("etcd rendezvous: leader loss while a round runs and during a restart", "[etcd][rendezvous][ha]") {
  EtcdCluster cluster(3, "rdzv-ha");
  boost::asio::io_context io;
  Agents agents = make_agents(io, 3, cluster.endpoints(), "job5", test_config(3, 3, 3));
  for (auto& a : agents) a->rejoin();
  auto all = ptrs(agents);
  REQUIRE(run_until(
      io, [&] { return same_round(all); }, 20s));
  const std::uint64_t r0 = agents[0]->round();

  // Kill the leader while the round is held; watch for three lease TTLs: no restart may follow.
  const int leader = cluster.leader();
  REQUIRE(leader >= 0);
  cluster.member(leader).kill_now();
  run_until(
      io, [&] { return std::any_of(agents.begin(), agents.end(), [](auto& a) { return !a->restarts.empty(); }); },
      6000ms);
  for (auto& a : agents) {
    CHECK(a->restarts.empty());
    CHECK(a->round() == r0);
  }

  // The log still works on the surviving majority: a failure restarts everyone once.
  const WorkerFailure f = failure(r0, agents[0]->node.id, 1, "after failover");
  agents[0]->rdzv->report_failure(f);
  REQUIRE(run_until(
      io, [&] { return same_round(all, r0); }, 30s));
  for (auto& a : agents) CHECK(a->restarts.size() == 1);
  check_consistent_round(all);

  // Bring the member back, then kill the leader in the middle of the next restart.
  cluster.restart(leader);
  const std::uint64_t r1 = agents[0]->round();
  agents[1]->rdzv->report_failure(failure(r1, agents[0]->node.id, 1, "during failover"));
  const int leader2 = cluster.leader();
  REQUIRE(leader2 >= 0);
  cluster.member(leader2).kill_now();
  REQUIRE(run_until(
      io, [&] { return same_round(all, r1); }, 30s));
  for (auto& a : agents) {
    CHECK(a->restarts.size() == 2);
    CHECK(a->assignments.back().restart_count == 2);
  }
  check_consistent_round(all);
  // Still quiet afterwards.
  const std::uint64_t r2 = agents[0]->round();
  run_until(
      io, [&] { return std::any_of(agents.begin(), agents.end(), [](auto& a) { return a->restarts.size() > 2; }); },
      4000ms);
  for (auto& a : agents) CHECK(a->round() == r2);
}

TEST_CASE("etcd rendezvous: leave() ends the round for the others and the job goes on smaller", "[etcd][rendezvous]") {
  EtcdCluster cluster(1, "rdzv-leave");
  boost::asio::io_context io;
  Agents agents = make_agents(io, 2, cluster.endpoints(), "job6", test_config(1, 2, 0));
  for (auto& a : agents) a->rejoin();
  REQUIRE(run_until(
      io, [&] { return same_round(ptrs(agents)) && agents[0]->assignments.back().group_world_size == 2; }, 20s));
  const std::uint64_t r0 = agents[0]->round();
  agents[1]->rdzv->leave();
  auto rest = ptrs(agents, {0});
  REQUIRE(run_until(
      io, [&] { return same_round(rest, r0); }, 20s));
  REQUIRE(agents[0]->restarts.size() == 1);
  CHECK_THAT(agents[0]->restarts[0].reason, Catch::Contains("left"));
  CHECK(agents[0]->assignments.back().group_world_size == 1);
  CHECK(agents[1]->restarts.empty());
  CHECK(run_until(
      io, [&] { return !agents[1]->rdzv->connected(); }, 10s));
}

TEST_CASE("etcd rendezvous: a watch refused again and again backs off and gives up after the read timeout",
          "[etcd][rendezvous]") {
  // A gateway in front of a real member that answers every watch with HTTP 400: the agent reads
  // the job again after a backoff (not at once, thousands of times a second) and ends with the
  // error when the failures outlast give_up_after.
  EtcdCluster cluster(1, "watch-refused");
  const std::string direct = cluster.endpoints();
  const auto upstream = static_cast<std::uint16_t>(std::stoi(direct.substr(direct.rfind(':') + 1)));
  boost::asio::io_context io;
  int watches = 0;
  ddprun::test::FakeGateway gw(io, [&](const std::string& line, const std::string& body) {
    if (line.starts_with("POST /v3/watch ")) {
      ++watches;
      return ddprun::test::FakeGateway::Reply{
          ddprun::test::http_reply(400, R"({"error":"bad watch","code":3,"message":"bad watch"})")};
    }
    return ddprun::test::forward(upstream, line, body);
  });
  Agent a(io, 0, gw.endpoint(), "watch-refused", test_config(1, 1, 0), {}, {}, 3s);
  const auto t0 = std::chrono::steady_clock::now();
  a.rejoin();
  REQUIRE(run_until(
      io, [&] { return a.unreachable.has_value(); }, 15s));
  CHECK(std::chrono::steady_clock::now() - t0 >= 3s);
  CHECK(watches >= 3);
  CHECK(watches < 40);
  CHECK_THAT(*a.unreachable,
             Catch::Contains(gw.endpoint()) && Catch::Contains("bad watch") && Catch::Contains("watch"));
}

TEST_CASE(
    "etcd rendezvous: a job-lease claim failing again and again gives up after the join timeout, "
    "with one lease",
    "[etcd][rendezvous]") {
  // Every txn fails (HTTP 503) while lease grants and keepalives work: those successes are not
  // progress of the claim, and each retry reuses the lease of the failed claim.
  EtcdCluster cluster(1, "claim-fails");
  const std::string direct = cluster.endpoints();
  const auto upstream = static_cast<std::uint16_t>(std::stoi(direct.substr(direct.rfind(':') + 1)));
  boost::asio::io_context io;
  int grants = 0, txns = 0;
  ddprun::test::FakeGateway gw(io, [&](const std::string& line, const std::string& body) {
    if (line.starts_with("POST /v3/kv/txn ")) {
      ++txns;
      return ddprun::test::FakeGateway::Reply{
          ddprun::test::http_reply(503, R"({"error":"overloaded","code":2,"message":"overloaded"})")};
    }
    if (line.starts_with("POST /v3/lease/grant ")) ++grants;
    return ddprun::test::forward(upstream, line, body);
  });
  JobConfig c = test_config(1, 1, 0);
  c.join_timeout = 3s;
  Agent a(io, 0, gw.endpoint(), "claim-fails", c);
  const auto t0 = std::chrono::steady_clock::now();
  a.rejoin();
  REQUIRE(run_until(
      io, [&] { return a.unreachable.has_value(); }, 15s));
  CHECK(std::chrono::steady_clock::now() - t0 < 8s);
  CHECK(txns >= 3);
  CHECK(grants == 2);  // the node lease and one job lease
  CHECK_THAT(*a.unreachable, Catch::Contains("HTTP 503: overloaded"));
}

TEST_CASE("etcd rendezvous: etcd with auth on and no user name given is refused at once", "[etcd][rendezvous][auth]") {
  EtcdCluster cluster(1, "rdzv-no-user");
  const std::string ep = "--endpoints=" + cluster.member(0).client_url(false);
  REQUIRE(ddprun::test::run_shell("ETCDCTL_API=3 etcdctl " + ep + " user add root:rootpw") == 0);
  REQUIRE(ddprun::test::run_shell("ETCDCTL_API=3 etcdctl " + ep + " auth enable") == 0);
  boost::asio::io_context io;
  JobConfig c = test_config(1, 1, 0);
  c.join_timeout = 60s;
  Agent anon(io, 0, cluster.endpoints(), "job-no-user", c);
  const auto t0 = std::chrono::steady_clock::now();
  anon.rejoin();
  REQUIRE(run_until(
      io, [&] { return anon.refused.has_value() || anon.unreachable.has_value(); }, 15s));
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);
  REQUIRE(anon.refused.has_value());
  CHECK_THAT(*anon.refused, Catch::Contains(cluster.endpoints()) && Catch::Contains("user name is empty") &&
                                Catch::Contains("username="));
}

TEST_CASE("etcd rendezvous: a node lease re-grant that fails is retried", "[etcd][rendezvous]") {
  // A gateway in front of a real member that, once the agent runs, answers one keepalive of the
  // node lease with TTL 0 (the lease expired) and the next lease grant with HTTP 503.
  EtcdCluster cluster(1, "regrant");
  const std::string direct = cluster.endpoints();
  const auto upstream = static_cast<std::uint16_t>(std::stoi(direct.substr(direct.rfind(':') + 1)));
  boost::asio::io_context io;
  using ddprun::test::FakeGateway;
  using ddprun::test::http_reply;
  bool expire = false, expired = false, refuse_grant = false;
  int grants = 0, refused_grants = 0;
  std::string node_lease;
  FakeGateway gw(io, [&](const std::string& line, const std::string& body) {
    if (line.starts_with("POST /v3/watch ")) {
      // forward() cannot relay a stream: a watch that is created and stays quiet (one agent
      // applies its own appends without it).
      const std::string created = R"({"result":{"header":{"revision":"1"},"created":true}})"
                                  "\n";
      char size[16];
      std::snprintf(size, sizeof size, "%zx", created.size());
      return FakeGateway::Reply{
          "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n" +
          std::string(size) + "\r\n" + created + "\r\n"};
    }
    if (line.starts_with("POST /v3/lease/grant ")) {
      ++grants;
      if (refuse_grant) {
        refuse_grant = false;
        ++refused_grants;
        return FakeGateway::Reply{http_reply(503, R"({"error":"overloaded","code":2,"message":"overloaded"})")};
      }
      FakeGateway::Reply r = ddprun::test::forward(upstream, line, body);
      if (node_lease.empty()) {  // the first grant is the node lease
        const auto p = r.bytes.find("\"ID\":\"");
        node_lease = r.bytes.substr(p + 6, r.bytes.find('"', p + 6) - p - 6);
      }
      return r;
    }
    if (line.starts_with("POST /v3/lease/keepalive ") && expire && !expired &&
        body.find(node_lease) != std::string::npos) {
      expired = true;
      refuse_grant = true;
      return FakeGateway::Reply{
          http_reply(200, R"({"result":{"header":{"revision":"1"},"ID":")" + node_lease + R"(","TTL":"0"}})")};
    }
    return ddprun::test::forward(upstream, line, body);
  });
  Agent a(io, 0, gw.endpoint(), "regrant", test_config(1, 1, 0));
  a.rejoin();
  REQUIRE(run_until(
      io, [&] { return !a.assignments.empty() || a.unreachable || a.refused || a.failed; }, 20s));
  REQUIRE(a.assignments.size() == 1);
  REQUIRE(grants == 2);  // the node lease and the job lease
  expire = true;
  // The failed re-grant is tried again: a third grant refused, a fourth that works.
  REQUIRE(run_until(
      io, [&] { return grants >= 4 || a.unreachable.has_value() || a.refused.has_value(); }, 20s));
  CHECK(refused_grants == 1);
  CHECK_FALSE(a.unreachable);
  CHECK_FALSE(a.refused);
}

TEST_CASE("etcd rendezvous: a leave whose put fails once is retried and the lease revoked", "[etcd][rendezvous]") {
  // The only endpoint is a proxy that swallows the answer to the leave's inbox put (the call
  // fails on every endpoint: retried after a backoff). The retry of a failed call and the leave's
  // wait for its event shared one timer, each cancelling the other: the leave's put was retried,
  // but nothing waited for its event any more, so the lease was never revoked (the agent stopped
  // after two request timeouts) and the others learnt of the leave only when the lease expired.
  const std::string run_id = "leaveretry";  // the inbox prefix is 30 bytes: whole base64 groups
  EtcdCluster cluster(1, run_id);
  const std::string direct = cluster.endpoints();
  const auto upstream = static_cast<std::uint16_t>(std::stoi(direct.substr(direct.rfind(':') + 1)));
  boost::asio::io_context io;
  DroppingProxy proxy(io, upstream, {"no request holds this"});
  const std::string endpoint = "127.0.0.1:" + std::to_string(proxy.port());
  Agent a(io, 0, endpoint, run_id, test_config(1, 1, 0));
  a.rejoin();
  REQUIRE(run_until(
      io, [&] { return !a.assignments.empty() || a.unreachable || a.refused || a.failed; }, 20s));
  REQUIRE(a.assignments.size() == 1);
  const std::string inbox = "/ddprun-test/" + run_id + "/inbox/";
  REQUIRE(inbox.size() % 3 == 0);
  proxy.set_match({"POST /v3/kv/txn", etcd::base64_encode(inbox)}, true);
  a.rdzv->leave();
  const auto revoked = [&] {
    return std::any_of(proxy.request_lines.begin(), proxy.request_lines.end(),
                       [](const std::string& l) { return l.starts_with("POST /v3/lease/revoke "); });
  };
  run_until(io, revoked, 20s);
  CHECK(proxy.dropped());
  for (const auto& l : proxy.request_lines) UNSCOPED_INFO(l);
  CHECK(revoked());
}
