// etcd_bench: the etcd rendezvous (--rdzv-backend etcd) under N simulated agents.
//
// N EtcdRendezvous instances in this one process (one io_context thread), each with its own
// etcd connections, leases and watch, exactly as N agents would run them, against the etcd
// members at --endpoints. All N join one job with min = max = N and max_restarts = 1:
//   setup  connect + N-1 joins, until every one of them was told "N-1/N joined" (all replicas
//          applied every join, so the next step measures one event);
//   close  the last join -> every agent holds its assignment;
//   restart  one agent reports a worker failure -> every agent heard the restart, rejoined and
//          holds its round-1 assignment (the whole restart as a job sees it).
// Every replica applies every event in this one process, so the figures include N replicas'
// work done one after another; real agents do it in parallel on their own machines.
//
//   etcd_bench --nodes N --endpoints H:P[,H:P...] [--timeout S] [--lease-ttl S]
//
// --lease-ttl is each agent's etcd lease TTL (heartbeat 1 s x S missed; default 5 s). N agents
// keep N leases alive from this one thread, so on a small shared machine a large N needs a
// longer TTL than real agents on their own machines would.
//
// Prints one JSON object on stdout; exit 0, or 1 with a message on stderr.
#include <sys/resource.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <boost/asio/io_context.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "ddprun/rendezvous/etcd_codec.hpp"
#include "ddprun/rendezvous/etcd_rendezvous.hpp"

namespace rdzv = ddprun::rendezvous;
using Clock = std::chrono::steady_clock;

namespace {

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "etcd_bench: error: %s\n", what.c_str());
  std::exit(1);
}

struct Agent {
  std::unique_ptr<rdzv::EtcdRendezvous> r;
  bool saw_all_joins = false;
  std::uint64_t assigned_round = static_cast<std::uint64_t>(-1);
  bool restarted = false;
};

// `s` with JSON's special characters dropped (messages only, for the "error" field).
std::string json_text(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c != '"' && c != '\\' && static_cast<unsigned char>(c) >= 0x20) out += c;
  }
  return out;
}

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

}  // namespace

int main(int argc, char** argv) {
  int nodes = 16;
  std::string endpoints;
  double timeout_s = 300;
  int lease_ttl_s = 5;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) die("missing value after " + a);
      return argv[++i];
    };
    if (a == "--nodes") {
      nodes = std::atoi(value().c_str());
    } else if (a == "--endpoints") {
      endpoints = value();
    } else if (a == "--timeout") {
      timeout_s = std::atof(value().c_str());
    } else if (a == "--lease-ttl") {
      lease_ttl_s = std::atoi(value().c_str());
    } else {
      die("unknown argument '" + a + "' (see the header of bench/rendezvous/etcd_bench.cpp)");
    }
  }
  if (nodes < 2) die("--nodes must be at least 2");
  if (lease_ttl_s < 2) die("--lease-ttl must be at least 2 (etcd's minimum)");
  // DDPRUN_TEST_DEBUG=1 logs every applied log entry (with times) to stderr.
  if (std::getenv("DDPRUN_TEST_DEBUG") != nullptr) spdlog::set_level(spdlog::level::debug);
  if (endpoints.empty()) die("give --endpoints H:P");
  rlimit rl{};
  getrlimit(RLIMIT_NOFILE, &rl);
  rl.rlim_cur = rl.rlim_max;
  setrlimit(RLIMIT_NOFILE, &rl);

  boost::asio::io_context io;
  const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s * 1000));
  // What finished before a phase timed out is still printed (with "error"), so a run that
  // cannot complete a phase at some N still reports the phases before it.
  std::string partial;
  auto run_until = [&](const char* what, auto done) {
    while (!done()) {
      if (Clock::now() > deadline) {
        std::printf("{\"nodes\": %d%s, \"error\": \"timed out: %s\"}\n", nodes, partial.c_str(), what);
        std::fflush(stdout);
        die(std::string("timed out: ") + what);
      }
      io.run_one_for(std::chrono::milliseconds(50));
    }
  };

  const auto list = rdzv::etcd::parse_endpoints(endpoints, "--endpoints");
  const std::string run_id = "bench-" + std::to_string(::getpid());
  std::vector<Agent> agents(static_cast<std::size_t>(nodes));
  const std::string all_but_one = "nodes: " + std::to_string(nodes - 1) + "/";
  int failures = 0;
  std::string failure_text;
  for (int i = 0; i < nodes; ++i) {
    rdzv::EtcdRendezvousOptions o;
    o.etcd.endpoints = list.endpoints;
    o.prefix = "/ddprun-bench/";
    o.run_id = run_id;
    o.node.id = rdzv::NodeId{"127.0.0.1", static_cast<std::int64_t>(::getpid()), "a" + std::to_string(i)};
    o.node.addr = "127.0.0.1";
    o.node.local_world_size = 1;
    o.node.store_host = "127.0.0.1";
    o.node.store_port = static_cast<std::uint16_t>(20000 + i % 20000);
    o.config.min_nodes = nodes;
    o.config.max_nodes = nodes;
    o.config.max_restarts = 1;
    o.config.join_timeout = std::chrono::seconds(static_cast<int>(timeout_s));
    o.config.last_call_timeout = std::chrono::seconds(30);
    o.config.heartbeat_interval = std::chrono::seconds(1);
    o.config.missed_heartbeats = lease_ttl_s;
    o.give_up_after = std::chrono::seconds(60);
    Agent& ag = agents[static_cast<std::size_t>(i)];
    rdzv::RendezvousEvents ev;
    ev.on_assignment = [&ag](const rdzv::Assignment& a) { ag.assigned_round = a.round; };
    ev.on_progress = [&ag, &all_but_one](const std::string& text) {
      if (text.find(all_but_one) != std::string::npos) ag.saw_all_joins = true;
    };
    ev.on_restart = [&ag](const rdzv::SendRestart&) {
      ag.restarted = true;
      ag.r->join();
    };
    auto fail = [&failures, &failure_text](const std::string& why) {
      ++failures;
      failure_text = why;
    };
    ev.on_job_failed = [fail](const rdzv::SendJobFailed& f) { fail("job failed: " + f.reason); };
    ev.on_refused = [fail](const std::string& why) { fail("refused: " + why); };
    ev.on_unreachable = [fail](const std::string& why) { fail("unreachable: " + why); };
    ag.r = std::make_unique<rdzv::EtcdRendezvous>(io, std::move(o), std::move(ev));
  }
  auto check_failures = [&] {
    if (failures == 0) return;
    std::printf("{\"nodes\": %d%s, \"error\": \"%d agent(s) failed, e.g. %s\"}\n", nodes, partial.c_str(), failures,
                json_text(failure_text).c_str());
    std::fflush(stdout);
    die(failure_text);
  };

  const auto t_setup = Clock::now();
  for (int i = 0; i + 1 < nodes; ++i) agents[static_cast<std::size_t>(i)].r->join();
  run_until("N-1 joins", [&] {
    check_failures();
    for (int i = 0; i + 1 < nodes; ++i) {
      if (!agents[static_cast<std::size_t>(i)].saw_all_joins) return false;
    }
    return true;
  });
  const double setup_ms = ms_since(t_setup);
  partial += ", \"setup_ms\": " + std::to_string(setup_ms);

  const auto t_close = Clock::now();
  agents.back().r->join();
  run_until("round 0 assignments", [&] {
    check_failures();
    for (const auto& a : agents) {
      if (a.assigned_round == static_cast<std::uint64_t>(-1)) return false;
    }
    return true;
  });
  const double close_ms = ms_since(t_close);
  partial += ", \"close_ms\": " + std::to_string(close_ms);
  const std::uint64_t round0 = agents.front().assigned_round;

  const auto t_restart = Clock::now();
  rdzv::WorkerFailure f;
  f.round = round0;
  f.node = agents.front().r ? rdzv::NodeId{"127.0.0.1", static_cast<std::int64_t>(::getpid()), "a0"} : rdzv::NodeId{};
  f.global_rank = 0;
  f.local_rank = 0;
  f.exit_code = 1;
  agents.front().r->report_failure(f);
  run_until("the restarted round's assignments", [&] {
    check_failures();
    for (const auto& a : agents) {
      if (!a.restarted || a.assigned_round == round0 || a.assigned_round == static_cast<std::uint64_t>(-1))
        return false;
    }
    return true;
  });
  const double restart_ms = ms_since(t_restart);

  for (auto& a : agents) a.r->leave();
  const auto t_leave = Clock::now();
  while (ms_since(t_leave) < 2000 && io.run_one_for(std::chrono::milliseconds(50)) > 0) {
  }
  for (auto& a : agents) a.r->stop();
  std::printf("{\"nodes\": %d, \"setup_ms\": %.3f, \"close_ms\": %.3f, \"restart_ms\": %.3f}\n", nodes, setup_ms,
              close_ms, restart_ms);
  return 0;
}
