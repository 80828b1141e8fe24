// RendezvousServer + RendezvousClient over real loopback sockets: a StoreServer with the
// service installed on port 0, and several clients on the same io_context thread (the test's).
// Every wait is a condition checked while the io_context runs, bounded by a deadline.
#include <catch2/catch.hpp>

#include <array>
#include <boost/asio/io_context.hpp>
#include <cstdio>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "ddprun/common/error.hpp"
#include "ddprun/rendezvous/rendezvous_client.hpp"
#include "ddprun/rendezvous/rendezvous_server.hpp"
#include "ddprun/rendezvous/timers.hpp"

namespace rdzv = ddprun::rendezvous;
using namespace std::chrono_literals;

namespace {

struct Daemon {
  Daemon(boost::asio::io_context& io, std::uint16_t port, std::string token = {},
         rdzv::Timers& timers = rdzv::Timers::steady(), std::size_t max_reply_bytes = 0) {
    rdzv::RendezvousServerOptions options;
    options.host = "127.0.0.1";
    options.port = port;
    options.token = std::move(token);
    if (max_reply_bytes > 0) options.limits.store.max_queued_reply_bytes = max_reply_bytes;
    server = std::make_unique<rdzv::RendezvousServer>(io, options, timers);
    server->start();
  }
  void stop() { server.reset(); }
  std::uint16_t port() const { return server->port(); }

  std::unique_ptr<rdzv::RendezvousServer> server;
};

rdzv::JobConfig test_config(int min_nodes, int max_nodes, int max_restarts = 1) {
  rdzv::JobConfig c;
  c.min_nodes = min_nodes;
  c.max_nodes = max_nodes;
  c.max_restarts = max_restarts;
  c.join_timeout = 20s;
  c.last_call_timeout = 200ms;
  c.close_timeout = 10s;
  c.heartbeat_interval = 100ms;
  c.missed_heartbeats = 5;
  c.rebuild_grace = 5s;
  return c;
}

struct Agent {
  int index = 0;
  std::unique_ptr<rdzv::RendezvousClient> client;
  std::vector<rdzv::Assignment> assignments;
  std::vector<rdzv::SendRestart> restarts;
  std::optional<rdzv::SendJobFailed> failed;
  bool completed = false;
  std::string refused;
  std::string unreachable;
  std::vector<std::string> progress;
  bool rejoin_on_restart = true;
};

rdzv::NodeInfo node_info(int i) {
  rdzv::NodeInfo n;
  n.id = rdzv::NodeId{"127.0.0.1", 5000 + i, "instance-" + std::to_string(i)};
  n.addr = "127.0.0.1";
  n.local_world_size = i + 1;  // heterogeneous: 1, 2, 3 ...
  n.store_host = "127.0.0.1";
  n.store_port = static_cast<std::uint16_t>(41000 + i);
  return n;
}

std::unique_ptr<Agent> make_agent(boost::asio::io_context& io, std::uint16_t port, int i, rdzv::JobConfig config,
                                  std::string token = {}, ddprun::Duration give_up = 10s, std::string run_id = "job1",
                                  rdzv::Timers& timers = rdzv::Timers::steady(),
                                  std::vector<ddprun::Endpoint> alternates = {}) {
  auto a = std::make_unique<Agent>();
  a->index = i;
  rdzv::RendezvousClientOptions o;
  o.server = ddprun::Endpoint{"127.0.0.1", port};
  o.alternates = std::move(alternates);
  o.run_id = std::move(run_id);
  o.token = std::move(token);
  o.node = node_info(i);
  o.config = config;
  o.give_up_after = give_up;
  Agent* p = a.get();
  rdzv::RendezvousEvents ev;
  ev.on_assignment = [p](const rdzv::Assignment& as) { p->assignments.push_back(as); };
  ev.on_restart = [p](const rdzv::SendRestart& r) {
    p->restarts.push_back(r);
    if (p->rejoin_on_restart) p->client->join();
  };
  ev.on_job_failed = [p](const rdzv::SendJobFailed& f) { p->failed = f; };
  ev.on_job_completed = [p] { p->completed = true; };
  ev.on_refused = [p](const std::string& why) { p->refused = why; };
  ev.on_progress = [p](const std::string& text) { p->progress.push_back(text); };
  ev.on_unreachable = [p](const std::string& why) { p->unreachable = why; };
  a->client = std::make_unique<rdzv::RendezvousClient>(io, o, ev, timers);
  return a;
}

// Runs the io_context until pred() holds or the deadline passes; returns pred().
bool run_until(boost::asio::io_context& io, const std::function<bool()>& pred, ddprun::Duration timeout = 10s) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!pred()) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return false;
    if (io.stopped()) io.restart();
    io.run_one_for(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now) + 1ms);
  }
  return true;
}

using Agents = std::vector<std::unique_ptr<Agent>>;

bool all(const Agents& agents, const std::function<bool(const Agent&)>& f) {
  for (const auto& a : agents) {
    if (!f(*a)) return false;
  }
  return true;
}

// Checks that the latest assignments form one consistent round.
void check_consistent(const Agents& agents, std::uint64_t round, int restart_count) {
  const int n = static_cast<int>(agents.size());
  std::vector<const rdzv::Assignment*> by_rank(agents.size(), nullptr);
  int world = 0;
  for (const auto& a : agents) {
    REQUIRE(!a->assignments.empty());
    const rdzv::Assignment& as = a->assignments.back();
    CHECK(as.round == round);
    CHECK(as.group_world_size == n);
    CHECK(as.restart_count == restart_count);
    CHECK(as.local_world_size == a->index + 1);
    REQUIRE(as.group_rank >= 0);
    REQUIRE(as.group_rank < n);
    CHECK(by_rank[static_cast<std::size_t>(as.group_rank)] == nullptr);
    by_rank[static_cast<std::size_t>(as.group_rank)] = &as;
    world += as.local_world_size;
  }
  int offset = 0;
  std::uint16_t master_port = 0;
  for (const auto* as : by_rank) {
    REQUIRE(as != nullptr);
    CHECK(as->rank_offset == offset);
    CHECK(as->world_size == world);
    CHECK(as->master_addr == "127.0.0.1");
    offset += as->local_world_size;
  }
  // MASTER = the group-rank-0 node's worker store.
  for (const auto& a : agents) {
    if (a->assignments.back().group_rank == 0) master_port = node_info(a->index).store_port;
  }
  for (const auto* as : by_rank) CHECK(as->master_port == master_port);
}

Agents start_job(boost::asio::io_context& io, std::uint16_t port, int count, rdzv::JobConfig config,
                 rdzv::Timers& timers = rdzv::Timers::steady()) {
  Agents agents;
  for (int i = 0; i < count; ++i) agents.push_back(make_agent(io, port, i, config, {}, 10s, "job1", timers));
  for (auto& a : agents) a->client->join();
  return agents;
}

}  // namespace

TEST_CASE("three agents join a 2:4 job and get one consistent round after the last call", "[service]") {
  rdzv::ManualTimers timers;  // protocol time moves only when the test says so; outlives io
  boost::asio::io_context io(1);
  Daemon d(io, 0, {}, timers);
  auto agents = start_job(io, d.port(), 3, test_config(2, 4), timers);
  REQUIRE(run_until(io, [&] {
    const auto* job = d.server->registry().find("job1");
    return job != nullptr && job->count(rdzv::MemberRole::joined) == 3;
  }));
  // The round closes at the last call (200 ms after min was reached), not before.
  timers.advance(150ms);
  if (io.stopped()) io.restart();
  io.poll();  // runs every handler the advance made due
  CHECK(d.server->registry().find("job1")->state() == rdzv::JobState::waiting);
  CHECK(all(agents, [](const Agent& a) { return a.assignments.empty(); }));
  timers.advance(50ms);
  REQUIRE(run_until(io, [&] { return all(agents, [](const Agent& a) { return !a.assignments.empty(); }); }));
  check_consistent(agents, 0, 0);
  for (const auto& a : agents) {
    CHECK(a->client->current_assignment() == a->assignments.back());
    CHECK(a->client->connected());
    CHECK_FALSE(a->progress.empty());
  }
  // Heartbeats keep the round alive well past the lease (5 x 100 ms): eight heartbeat
  // intervals, each step waiting until the daemon has read the three heartbeats it triggered.
  for (int step = 0; step < 8; ++step) {
    const auto frames = d.server->service_stats().frames;
    timers.advance(100ms);
    REQUIRE(run_until(io, [&] { return d.server->service_stats().frames >= frames + 3; }));
  }
  CHECK(d.server->registry().find("job1")->state() == rdzv::JobState::running);
  for (const auto& a : agents) {
    CHECK(a->restarts.empty());
    CHECK(a->assignments.size() == 1);
  }
}

TEST_CASE("a worker failure restarts everyone; when the budget is spent the job fails with the exit code",
          "[service]") {
  boost::asio::io_context io(1);
  Daemon d(io, 0);
  auto agents = start_job(io, d.port(), 3, test_config(3, 3, 1));
  REQUIRE(run_until(io, [&] { return all(agents, [](const Agent& a) { return !a.assignments.empty(); }); }));
  check_consistent(agents, 0, 0);

  rdzv::WorkerFailure f;
  f.round = 0;
  f.global_rank = agents[1]->assignments.back().rank_offset;
  f.local_rank = 0;
  f.exit_code = 3;
  f.message = "first failure";
  agents[1]->client->report_failure(f);
  REQUIRE(run_until(io, [&] { return all(agents, [](const Agent& a) { return a.assignments.size() == 2; }); }));
  for (const auto& a : agents) {
    REQUIRE(a->restarts.size() == 1);
    CHECK(a->restarts[0].restart_count == 1);
    CHECK(a->restarts[0].kind == rdzv::RoundEnd::worker_failure);
    CHECK(a->restarts[0].ended_round == 0);
  }
  check_consistent(agents, 1, 1);

  f.round = 1;
  f.exit_code = 7;
  f.message = "second failure";
  agents[2]->client->report_failure(f);
  REQUIRE(run_until(io, [&] { return all(agents, [](const Agent& a) { return a.failed.has_value(); }); }));
  for (const auto& a : agents) {
    CHECK(a->failed->exit_code == 7);
    REQUIRE(a->failed->root_cause);
    CHECK(a->failed->root_cause->failure.message == "second failure");
    CHECK_FALSE(a->client->connected());
  }
}

TEST_CASE("all nodes succeeding completes the job everywhere", "[service]") {
  boost::asio::io_context io(1);
  Daemon d(io, 0);
  auto agents = start_job(io, d.port(), 2, test_config(2, 2));
  REQUIRE(run_until(io, [&] { return all(agents, [](const Agent& a) { return !a.assignments.empty(); }); }));
  const auto frames = d.server->service_stats().frames;
  agents[0]->client->report_success(0);
  REQUIRE(run_until(io, [&] { return d.server->service_stats().frames > frames; }));  // the daemon read it
  CHECK_FALSE(agents[0]->completed);  // the exit barrier waits for node 1
  agents[1]->client->report_success(0);
  REQUIRE(run_until(io, [&] { return all(agents, [](const Agent& a) { return a.completed; }); }));
  for (const auto& a : agents) CHECK(a->failed == std::nullopt);
}

TEST_CASE("a join with the wrong token is refused with a clear reason", "[service]") {
  boost::asio::io_context io(1);
  Daemon d(io, 0, "s3cret");
  auto good = make_agent(io, d.port(), 0, test_config(1, 2), "s3cret");
  auto bad = make_agent(io, d.port(), 1, test_config(1, 2), "wrong");
  auto none = make_agent(io, d.port(), 2, test_config(1, 2), "");
  good->client->join();
  bad->client->join();
  none->client->join();
  REQUIRE(run_until(io, [&] { return !bad->refused.empty() && !none->refused.empty(); }));
  CHECK_THAT(bad->refused, Catch::Contains("token"));
  CHECK_THAT(none->refused, Catch::Contains("token"));
  CHECK(bad->assignments.empty());
  CHECK(good->refused.empty());
  CHECK_FALSE(bad->client->connected());
}

TEST_CASE("a daemon restart on the same port: agents reconnect, rejoin and keep their assignment", "[service]") {
  boost::asio::io_context io(1);
  auto d = std::make_unique<Daemon>(io, 0);
  const std::uint16_t port = d->port();
  auto agents = start_job(io, port, 3, test_config(3, 3));
  REQUIRE(run_until(io, [&] { return all(agents, [](const Agent& a) { return !a.assignments.empty(); }); }));
  std::vector<rdzv::Assignment> before;
  for (const auto& a : agents) before.push_back(a->assignments.back());

  d.reset();  // the daemon is gone, with all its state
  REQUIRE(run_until(io, [&] { return all(agents, [](const Agent& a) { return !a.client->connected(); }); }));
  // A report made while the daemon is away reaches the new one after the rejoin.
  agents[0]->client->report_success(0);
  d = std::make_unique<Daemon>(io, port);
  REQUIRE(run_until(io, [&] {
    if (!all(agents, [](const Agent& a) { return a.client->connected(); })) return false;
    const auto* job = d->server->registry().find("job1");
    if (job == nullptr || job->state() != rdzv::JobState::running) return false;
    const auto st = job->status(std::chrono::steady_clock::now());
    if (st.members.size() != 3) return false;
    for (const auto& m : st.members) {
      if (m.role != rdzv::MemberRole::participant) return false;
    }
    return true;
  }));
  for (std::size_t i = 0; i < agents.size(); ++i) {
    CHECK(agents[i]->restarts.empty());
    CHECK(agents[i]->client->current_assignment() == before[i]);
    CHECK(agents[i]->failed == std::nullopt);
  }
  // The job goes on: the other two succeed too, the new daemon completes it.
  CHECK_FALSE(agents[0]->completed);
  agents[1]->client->report_success(0);
  agents[2]->client->report_success(0);
  REQUIRE(run_until(io, [&] { return all(agents, [](const Agent& a) { return a.completed; }); }));
}

TEST_CASE("a daemon gone for good is reported within give_up_after, naming host:port", "[service]") {
  rdzv::ManualTimers timers;  // outlives io (a client's pending handlers hold its timers)
  boost::asio::io_context io(1);
  auto d = std::make_unique<Daemon>(io, 0, std::string{}, timers);
  const std::uint16_t port = d->port();
  auto a = make_agent(io, port, 0, test_config(1, 1), {}, 1s, "job1", timers);
  a->client->join();
  REQUIRE(run_until(io, [&] { return !a->assignments.empty(); }));
  d.reset();
  REQUIRE(run_until(io, [&] { return !a->client->connected(); }));
  // Every reconnect attempt fails at once (nothing listens); between attempts only the backoff
  // timer is armed, so jump to it, until the client gives up.
  const auto t0 = timers.now();
  while (a->unreachable.empty() && timers.now() - t0 < 10s) {
    REQUIRE(run_until(io, [&] { return timers.armed() > 0 || !a->unreachable.empty(); }));
    if (a->unreachable.empty()) timers.advance_to_next();
  }
  REQUIRE_FALSE(a->unreachable.empty());
  CHECK(timers.now() - t0 == 1s);  // exactly give_up_after: the last backoff is clipped to it
  CHECK_THAT(a->unreachable, Catch::Contains("127.0.0.1:" + std::to_string(port)));
  CHECK_THAT(a->unreachable, Catch::Contains("unreachable for 1 s"));
  CHECK_THAT(a->unreachable, Catch::Contains("ddprun-rdzvd"));
  CHECK_FALSE(a->client->connected());
}

TEST_CASE("no daemon at all: the first connect is bounded by give_up_after too", "[service]") {
  boost::asio::io_context io(1);
  std::uint16_t port = 0;
  {
    Daemon d(io, 0);
    port = d.port();
  }
  auto a = make_agent(io, port, 0, test_config(1, 1), {}, 500ms);
  a->client->join();
  REQUIRE(run_until(
      io, [&] { return !a->unreachable.empty(); }, 5s));
  CHECK_THAT(a->unreachable, Catch::Contains("connect failed"));
}

TEST_CASE("alternates: a dead first endpoint is passed over, a lost one is replaced by the next", "[service]") {
  boost::asio::io_context io(1);
  std::uint16_t dead = 0;
  {
    Daemon gone(io, 0);
    dead = gone.port();
  }
  auto d = std::make_unique<Daemon>(io, 0);
  const std::uint16_t live = d->port();
  const ddprun::Endpoint live_ep{"127.0.0.1", live};
  // The first endpoint has nothing listening: the client goes on to the second and joins there.
  auto a = make_agent(io, dead, 0, test_config(1, 1), {}, 10s, "job1", rdzv::Timers::steady(), {live_ep});
  a->client->join();
  REQUIRE(run_until(io, [&] { return !a->assignments.empty(); }));
  CHECK(a->unreachable.empty());
  // Both gone: the give-up message names every endpoint it tried.
  d.reset();
  auto b = make_agent(io, dead, 1, test_config(1, 1), {}, 500ms, "job2", rdzv::Timers::steady(), {live_ep});
  b->client->join();
  REQUIRE(run_until(
      io, [&] { return !b->unreachable.empty(); }, 5s));
  CHECK_THAT(b->unreachable,
             Catch::Contains("127.0.0.1:" + std::to_string(dead) + ",127.0.0.1:" + std::to_string(live)));
}

TEST_CASE("query_status reports jobs, rounds and members", "[service]") {
  boost::asio::io_context io(1);
  Daemon d(io, 0);
  auto agents = start_job(io, d.port(), 2, test_config(2, 2));
  auto other = make_agent(io, d.port(), 5, test_config(2, 3), {}, 10s, "job2");
  other->client->join();
  REQUIRE(run_until(io, [&] {
    return all(agents, [](const Agent& a) { return !a.assignments.empty(); }) && !other->progress.empty();
  }));
  // query_status is synchronous: run it on another thread while this one serves.
  auto all_jobs = std::async(std::launch::async, [&] {
    return rdzv::query_status(ddprun::Endpoint{"127.0.0.1", d.port()}, "", 5000ms);
  });
  REQUIRE(run_until(io, [&] { return all_jobs.wait_for(0s) == std::future_status::ready; }));
  const rdzv::RegistryStatus st = all_jobs.get();
  REQUIRE(st.jobs.size() == 2);
  CHECK(st.jobs[0].run_id == "job1");
  CHECK(st.jobs[0].state == rdzv::JobState::running);
  REQUIRE(st.jobs[0].members.size() == 2);
  CHECK(st.jobs[0].members[0].group_rank == 0);
  CHECK(st.jobs[0].members[0].role == rdzv::MemberRole::participant);
  CHECK(st.jobs[1].run_id == "job2");
  CHECK(st.jobs[1].state == rdzv::JobState::waiting);

  auto one = std::async(std::launch::async, [&] {
    return rdzv::query_status(ddprun::Endpoint{"127.0.0.1", d.port()}, "job2", 5000ms);
  });
  REQUIRE(run_until(io, [&] { return one.wait_for(0s) == std::future_status::ready; }));
  const auto st2 = one.get();
  REQUIRE(st2.jobs.size() == 1);
  CHECK(st2.jobs[0].members.size() == 1);

  const std::uint16_t port = d.port();
  d.stop();
  CHECK_THROWS_AS(rdzv::query_status(ddprun::Endpoint{"127.0.0.1", port}, "", 2000ms), ddprun::NetworkError);
}

TEST_CASE("a STATUS of every job is one snapshot a second while only heartbeats come; over the reply limit, refused",
          "[service]") {
  rdzv::ManualTimers timers;  // outlives io
  boost::asio::io_context io(1);
  Daemon d(io, 0, std::string{}, timers, 4096);
  rdzv::JobConfig config = test_config(2, 2);
  config.heartbeat_interval = 10s;  // no heartbeat in the time this test moves: leases only run down
  auto agents = start_job(io, d.port(), 2, config, timers);
  REQUIRE(run_until(io, [&] { return all(agents, [](const Agent& a) { return !a.assignments.empty(); }); }));
  auto ask = [&](const std::string& run_id) {
    auto f = std::async(std::launch::async, [&] {
      return rdzv::query_status(ddprun::Endpoint{"127.0.0.1", d.port()}, run_id, 5000ms);
    });
    REQUIRE(run_until(io, [&] { return f.wait_for(0s) == std::future_status::ready; }));
    return f.get();
  };
  const auto leases = [](const rdzv::RegistryStatus& st) {
    std::vector<ddprun::Duration> out;
    for (const auto& j : st.jobs) {
      for (const auto& m : j.members) out.push_back(m.lease_left);
    }
    return out;
  };
  const rdzv::RegistryStatus first = ask("");
  REQUIRE(first.jobs.size() == 1);
  timers.advance(300ms);  // within the second: the same snapshot, leases as they were
  const rdzv::RegistryStatus again = ask("");
  CHECK(leases(again) == leases(first));
  // A join changes what STATUS shows: a fresh snapshot at once.
  auto other = make_agent(io, d.port(), 5, test_config(2, 3), {}, 10s, "job2", timers);
  other->client->join();
  REQUIRE(run_until(io, [&] { return !other->progress.empty(); }));
  CHECK(ask("").jobs.size() == 2);
  timers.advance(1s);  // a second later, fresh again though only time passed
  const rdzv::RegistryStatus later = ask("");
  REQUIRE(later.jobs.size() == 2);
  CHECK(later.jobs[0].members[0].lease_left < first.jobs[0].members[0].lease_left);

  // Jobs enough that every job's status outgrows the 4 KiB reply limit: refused with the way out;
  // one job's status still answers.
  Agents more;
  for (int i = 0; i < 12; ++i) {
    more.push_back(make_agent(io, d.port(), 10 + i, test_config(2, 3), {}, 10s,
                              "job-" + std::to_string(i) + std::string(100, 'x'), timers));
    more.back()->client->join();
  }
  REQUIRE(run_until(io, [&] { return all(more, [](const Agent& a) { return !a.progress.empty(); }); }));
  auto refused = std::async(std::launch::async, [&] {
    try {
      rdzv::query_status(ddprun::Endpoint{"127.0.0.1", d.port()}, "", 5000ms);
    } catch (const ddprun::NetworkError& e) {
      return std::string(e.what());
    }
    return std::string("answered");
  });
  REQUIRE(run_until(io, [&] { return refused.wait_for(0s) == std::future_status::ready; }));
  const std::string why = refused.get();
  CHECK_THAT(why, Catch::Contains("over this daemon's reply limit of 4096 bytes (--max-queued-reply-bytes)"));
  CHECK_THAT(why, Catch::Contains("ask for one job with --rdzv-id ID"));
  CHECK(ask("job2").jobs.size() == 1);
}

TEST_CASE("torch 1.13's TCPStore client works on the same port while rendezvous traffic flows", "[service][torch]") {
  boost::asio::io_context io(1);
  Daemon d(io, 0);
  auto agents = start_job(io, d.port(), 3, test_config(3, 3));
  const std::string script =
      "import datetime, sys, torch.distributed as dist\n"
      "s = dist.TCPStore('127.0.0.1', int(sys.argv[1]), 2, False, timeout=datetime.timedelta(seconds=30))\n"
      "s.set('k', 'v')\n"
      "assert s.get('k') == b'v'\n"
      "assert s.add('c', 5) == 5\n"
      "s.wait(['k'])\n"
      "assert s.compare_set('k', 'v', 'w') == b'w'\n"
      "print('TORCH_OK', s.num_keys())\n";
  const std::string cmd =
      "timeout 60 /usr/bin/python3 -c \"$(cat <<'EOF'\n" + script + "EOF\n)\" " + std::to_string(d.port()) + " 2>&1";
  auto torch = std::async(std::launch::async, [cmd] {
    std::string out;
    FILE* p = ::popen(cmd.c_str(), "r");
    if (p == nullptr) return std::string("popen failed");
    std::array<char, 4096> buf{};
    std::size_t n = 0;
    while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
    ::pclose(p);
    return out;
  });
  REQUIRE(run_until(
      io, [&] { return torch.wait_for(0s) == std::future_status::ready; }, 90s));
  const std::string out = torch.get();
  INFO(out);
  CHECK_THAT(out, Catch::Contains("TORCH_OK"));
  REQUIRE(run_until(io, [&] { return all(agents, [](const Agent& a) { return !a.assignments.empty(); }); }));
  check_consistent(agents, 0, 0);
}

TEST_CASE("a node that leaves, or whose connection dies, ends the round as a membership change", "[service]") {
  boost::asio::io_context io(1);
  Daemon d(io, 0);
  auto agents = start_job(io, d.port(), 3, test_config(1, 3, 0));
  REQUIRE(run_until(io, [&] { return all(agents, [](const Agent& a) { return !a.assignments.empty(); }); }));

  // An explicit LEAVE: the two others restart (no restart spent) and form round 1.
  agents[2]->client->leave();
  Agents rest;
  rest.push_back(std::move(agents[0]));
  rest.push_back(std::move(agents[1]));
  REQUIRE(run_until(io, [&] { return all(rest, [](const Agent& a) { return a.assignments.size() == 2; }); }));
  for (const auto& a : rest) {
    REQUIRE(a->restarts.size() == 1);
    CHECK(a->restarts[0].kind == rdzv::RoundEnd::membership_change);
    CHECK(a->restarts[0].restart_count == 0);
  }
  check_consistent(rest, 1, 0);

  // A node that vanishes without a word (connection closed, no reconnect): noticed within
  // about one heartbeat interval after the close.
  const auto t0 = std::chrono::steady_clock::now();
  rest[1]->client.reset();
  REQUIRE(run_until(
      io, [&] { return rest[0]->assignments.size() == 3; }, 5s));
  CHECK(std::chrono::steady_clock::now() - t0 < 2s);
  CHECK(rest[0]->restarts.size() == 2);
  CHECK(rest[0]->assignments.back().group_world_size == 1);
  CHECK(rest[0]->assignments.back().round == 2);
}

TEST_CASE("metrics count each round once and time it from the first join, across a daemon restart", "[service]") {
  boost::asio::io_context io(1);
  auto d = std::make_unique<Daemon>(io, 0);
  const std::uint16_t port = d->port();
  auto agents = start_job(io, port, 2, test_config(2, 2, 2));
  REQUIRE(run_until(io, [&] { return all(agents, [](const Agent& a) { return !a.assignments.empty(); }); }));
  auto stats = d->server->service_stats();
  CHECK(stats.joins == 2);
  CHECK(stats.rounds_closed == 1);
  CHECK(stats.round_close_seconds.count() == 1);
  CHECK_FALSE(d->server->round_opened_at("job1").has_value());  // closed: nothing collects
  // A spare that joins the running (full) job opens no round either.
  agents.push_back(make_agent(io, port, 2, test_config(2, 2, 2)));
  agents.back()->client->join();
  REQUIRE(run_until(io, [&] { return !agents.back()->progress.empty(); }));
  CHECK(agents.back()->progress.back().find("waiting as a spare node") != std::string::npos);
  CHECK_FALSE(d->server->round_opened_at("job1").has_value());
  agents.pop_back();

  // A new daemon learns the running round from rejoins that carry the assignment: they
  // re-register, they open no round (else the next round's latency would include the run).
  d.reset();
  REQUIRE(run_until(io, [&] { return all(agents, [](const Agent& a) { return !a.client->connected(); }); }));
  d = std::make_unique<Daemon>(io, port);
  REQUIRE(run_until(io, [&] {
    const auto* job = d->server->registry().find("job1");
    return job != nullptr && job->status(std::chrono::steady_clock::now()).members.size() == 2;
  }));
  CHECK_FALSE(d->server->round_opened_at("job1").has_value());
  CHECK(d->server->service_stats().rounds_closed == 0);

  // A worker failure: both join the next round, which closes once and is timed from its first join.
  const auto failed_at = std::chrono::steady_clock::now();
  rdzv::WorkerFailure f;
  f.round = 0;
  f.global_rank = 0;
  f.exit_code = 3;
  f.message = "failure";
  agents[0]->client->report_failure(f);
  REQUIRE(run_until(io, [&] { return all(agents, [](const Agent& a) { return a.assignments.size() == 2; }); }));
  const double bound = std::chrono::duration<double>(std::chrono::steady_clock::now() - failed_at).count();
  stats = d->server->service_stats();
  CHECK(stats.restarts == 1);
  CHECK(stats.rounds_closed == 1);
  REQUIRE(stats.round_close_seconds.count() == 1);
  CHECK(stats.round_close_seconds.sum() <= bound);
  CHECK_FALSE(d->server->round_opened_at("job1").has_value());
}
