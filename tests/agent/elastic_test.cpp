// The pure pieces of the elastic agent: path selection, JobConfig translation, address choice,
// hosting decision, failure reports and the job-failed summary.
#include <catch2/catch.hpp>
#include <netdb.h>
#include <unistd.h>

#include <csignal>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>

#include "ddprun/agent/elastic.hpp"
#include "ddprun/agent/rendezvous_backend.hpp"
#include "ddprun/rendezvous/store_server.hpp"
#include "ddprun/common/error.hpp"

using namespace ddprun::agent;
namespace rdzv = ddprun::rendezvous;
using Catch::Matchers::Contains;

namespace {
AgentConfig base() {
  AgentConfig c;
  c.worker_argv = {"/bin/true"};
  return c;
}
}  // namespace

TEST_CASE("elastic path: multi-node or c10d without standalone") {
  AgentConfig c = base();
  CHECK_FALSE(uses_elastic_path(c));
  c.max_nodes = 2;
  CHECK(uses_elastic_path(c));
  c = base();
  c.rdzv_backend = "c10d";
  CHECK(uses_elastic_path(c));
  c.standalone = true;
  CHECK_FALSE(uses_elastic_path(c));
}

TEST_CASE("static multi-node: node 0 serves at the master address, the world is max nodes") {
  AgentConfig c = base();
  c.min_nodes = 2;
  c.max_nodes = 3;
  c.master_addr = "127.0.0.2";
  c.master_port = 4000;
  CHECK(is_static_multi_node(c));
  CHECK(rendezvous_endpoint(c) == ddprun::Endpoint{"127.0.0.2", 4000});
  CHECK(job_config(c).min_nodes == 3);
  CHECK(job_config(c).max_nodes == 3);
  c.local_addr = "127.0.0.3";
  c.node_rank = 0;
  CHECK(may_host(c, {"127.0.0.2", 4000}, "127.0.0.3"));
  c.node_rank = 1;
  CHECK_FALSE(may_host(c, {"127.0.0.2", 4000}, "127.0.0.2"));
  c.master_port = 0;
  CHECK_THROWS_WITH(rendezvous_endpoint(c), Contains("--master-port"));
  c.rdzv_backend = "c10d";
  CHECK_FALSE(is_static_multi_node(c));
}

TEST_CASE("job config carries nnodes, the global budget and the rdzv-conf timers") {
  AgentConfig c = base();
  c.rdzv_backend = "c10d";
  c.min_nodes = 2;
  c.max_nodes = 4;
  c.max_restarts = 3;
  c.rdzv.join_timeout = std::chrono::milliseconds(20000);
  c.rdzv.last_call_timeout = std::chrono::milliseconds(500);
  c.rdzv.heartbeat_interval = std::chrono::milliseconds(200);
  c.rdzv.missed_heartbeats = 5;
  c.rdzv.exit_barrier_timeout = std::chrono::milliseconds(7000);
  const auto j = job_config(c);
  CHECK(j.min_nodes == 2);
  CHECK(j.max_nodes == 4);
  CHECK(j.max_restarts == 3);
  CHECK(j.join_timeout == std::chrono::milliseconds(20000));
  CHECK(j.last_call_timeout == std::chrono::milliseconds(500));
  CHECK(j.heartbeat_interval == std::chrono::milliseconds(200));
  CHECK(j.missed_heartbeats == 5);
  CHECK(j.lease() == std::chrono::milliseconds(1000));
  CHECK(j.exit_barrier_timeout == std::chrono::milliseconds(7000));
  CHECK(j.validate().empty());
}

TEST_CASE("rendezvous endpoint: default port, missing endpoint named") {
  AgentConfig c = base();
  c.rdzv_backend = "c10d";
  CHECK_THROWS_WITH(rendezvous_endpoint(c), Contains("--rdzv-endpoint"));
  c.rdzv_endpoint = "10.1.2.3";
  CHECK(rendezvous_endpoint(c) == ddprun::Endpoint{"10.1.2.3", 29400});
  c.rdzv_endpoint = "127.0.0.2:5000";
  CHECK(rendezvous_endpoint(c) == ddprun::Endpoint{"127.0.0.2", 5000});
}

TEST_CASE("advertised address: --local-addr, else the route's source address (no DNS)") {
  AgentConfig c = base();
  c.local_addr = "127.0.0.3";
  CHECK(advertised_address(c, {"127.0.0.2", 29400}) == "127.0.0.3");
  c.local_addr.reset();
  CHECK(advertised_address(c, {"127.0.0.1", 29400}) == "127.0.0.1");
  CHECK(advertised_address(c, {"127.0.0.5", 29400}) == "127.0.0.1");  // the kernel's source for 127/8
}

TEST_CASE("advertised address: the first of several endpoints that resolves; none names each") {
  AgentConfig c = base();
  // ".invalid" never resolves (RFC 6761), and getaddrinfo says so without asking a DNS server.
  const std::vector<ddprun::Endpoint> some{{"no-such-host.invalid", 2379}, {"127.0.0.1", 2379}};
  CHECK(advertised_address(c, some) == "127.0.0.1");
  const std::vector<ddprun::Endpoint> none{{"no-such-host.invalid", 2379}, {"other-host.invalid", 2379}};
  CHECK_THROWS_WITH(advertised_address(c, none),
                    Catch::Contains("no-such-host.invalid") && Catch::Contains("other-host.invalid"));
  c.local_addr = "127.0.0.3";
  CHECK(advertised_address(c, none) == "127.0.0.3");
}

TEST_CASE("local addresses: loopback range and interfaces") {
  CHECK(is_local_address("127.0.0.1"));
  CHECK(is_local_address("127.0.0.4"));
  CHECK(is_local_address("::1"));
  CHECK_FALSE(is_local_address("192.0.2.77"));  // TEST-NET-1, never assigned
}

TEST_CASE("the worker store for a host name listens on IPv6 and IPv4; for an address, on it alone") {
  CHECK(bind_host("127.0.0.2") == "127.0.0.2");
  CHECK(bind_host("[::1]") == "::1");
  CHECK(bind_host("localhost") == "::");
  CHECK(bind_host("head-node.example") == "::");
  boost::asio::io_context io;
  const auto store = host_worker_store(io, "localhost", 0, false, "");
  auto reaches = [&](const char* address) {
    boost::asio::ip::tcp::socket s(io);
    boost::system::error_code ec;
    s.connect({boost::asio::ip::make_address(address), store->port()}, ec);
    return !ec;
  };
  // A name may resolve to either family first (an IPv6-only name to ::1-like addresses only).
  CHECK(reaches("127.0.0.1"));
  // Where the host has IPv6 at all: ::1 can be bound (a container may open AF_INET6 sockets with
  // IPv6 disabled by sysctl, and then has no ::1).
  boost::asio::ip::tcp::acceptor probe(io);
  boost::system::error_code no_v6;
  probe.open(boost::asio::ip::tcp::v6(), no_v6);
  if (!no_v6) probe.bind({boost::asio::ip::make_address("::1"), 0}, no_v6);
  if (!no_v6) CHECK(reaches("::1"));
}

TEST_CASE("a reserved worker-store port: no listener, no other binder, but the rank-0 worker's store can bind it") {
  namespace ip = boost::asio::ip;
  boost::asio::io_context io;
  for (const char* addr : {"127.0.0.1", "localhost"}) {
    INFO(addr);
    auto store = open_worker_store(io, addr, 0, false, false, "");
    REQUIRE_FALSE(store->hosted());
    REQUIRE(store->port() != 0);
    const ip::tcp::endpoint at(ip::make_address("127.0.0.1"), store->port());
    boost::system::error_code ec;
    ip::tcp::socket client(io);
    client.connect(at, ec);
    CHECK(ec == boost::asio::error::connection_refused);  // nothing listens until rank 0 does
    // Another program without SO_REUSEADDR, on any address (rank 0 will listen on all of them).
    for (const char* other : {"127.0.0.1", "127.0.0.2", "0.0.0.0"}) {
      INFO(other);
      ip::tcp::acceptor plain(io);
      plain.open(ip::tcp::v4());
      plain.bind({ip::make_address(other), store->port()}, ec);
      CHECK(ec == boost::asio::error::address_in_use);
    }
    // A TCPStore server (torch's, libuv's, ddprun's) binds every address with SO_REUSEADDR.
    ip::tcp::acceptor rank0(io);
    rank0.open(ip::tcp::v4());
    rank0.set_option(ip::tcp::acceptor::reuse_address(true));
    rank0.bind({ip::address_v4::any(), store->port()}, ec);
    REQUIRE_FALSE(ec);
    rank0.listen();
    ip::tcp::socket second(io);
    second.connect(at, ec);
    CHECK_FALSE(ec);
    store->reset();  // nothing to reset: the key space is rank 0's
    store->stop();
  }
  // The hosted store is the agent's own server.
  auto hosted = open_worker_store(io, "127.0.0.1", 0, true, false, "");
  CHECK(hosted->hosted());
  ip::tcp::socket s(io);
  boost::system::error_code ec;
  s.connect({ip::make_address("127.0.0.1"), hosted->port()}, ec);
  CHECK_FALSE(ec);
  // Binding errors name the address, as for the hosted store.
  CHECK_THROWS_WITH(open_worker_store(io, "192.0.2.77", 0, false, false, ""),
                    Catch::Contains("cannot reserve the port of the workers' store") &&
                        Catch::Contains("on 192.0.2.77") && Catch::Contains("is not an address of this machine"));
}

TEST_CASE("hosting decision") {
  AgentConfig c = base();
  const ddprun::Endpoint ep{"127.0.0.2", 29400};
  c.local_addr = "127.0.0.2";
  CHECK(may_host(c, ep, "127.0.0.2"));
  c.local_addr = "127.0.0.3";
  // An endpoint naming this machine may be hosted whatever --local-addr says, as torchrun
  // decides (a multi-NIC head node advertising its fabric address): the first to bind hosts.
  CHECK(may_host(c, ep, "127.0.0.3"));
  char name[256] = {};
  REQUIRE(::gethostname(name, sizeof name - 1) == 0);
  if (addrinfo* res = nullptr; ::getaddrinfo(name, nullptr, nullptr, &res) == 0) {  // (a name that resolves)
    ::freeaddrinfo(res);
    CHECK(may_host(c, {name, 29400}, "127.0.0.3"));  // this machine's host name
  }
  CHECK(may_host(c, {"localhost", 29400}, "127.0.0.3"));
  CHECK_FALSE(may_host(c, {"192.0.2.77", 29400}, "127.0.0.3"));  // not this machine
  c.local_addr = "192.0.2.77";
  CHECK(may_host(c, {"192.0.2.77", 29400}, "192.0.2.77"));  // the advertised address itself
  c.local_addr = "127.0.0.3";
  c.rdzv.is_host = true;
  CHECK(may_host(c, ep, "127.0.0.3"));
  c.rdzv.is_host = false;
  c.local_addr = "127.0.0.2";
  CHECK_FALSE(may_host(c, ep, "127.0.0.2"));  // is_host=0 never hosts
  c.rdzv.is_host.reset();
  c.local_addr.reset();
  CHECK(may_host(c, ep, "127.0.0.1"));  // a loopback endpoint is this machine
  CHECK_FALSE(may_host(c, {"192.0.2.77", 29400}, "10.0.0.1"));
}

TEST_CASE("tcp probe: a listening socket answers, a closed port does not") {
  boost::asio::io_context io;
  boost::asio::ip::tcp::acceptor acc(io, {boost::asio::ip::make_address("127.0.0.1"), 0});
  const auto port = acc.local_endpoint().port();
  CHECK(tcp_connects({"127.0.0.1", port}, std::chrono::milliseconds(500)));
  acc.close();
  CHECK_FALSE(tcp_connects({"127.0.0.1", port}, std::chrono::milliseconds(500)));
}

TEST_CASE("instance ids are random hex") {
  const auto a = random_instance_id();
  const auto b = random_instance_id();
  CHECK(a.size() == 12);
  CHECK(a != b);
  CHECK(a.find_first_not_of("0123456789abcdef") == std::string::npos);
}

TEST_CASE("failure reports carry exit code or signal") {
  const rdzv::NodeId node{"127.0.0.3", 42, "abc"};
  const auto f = make_failure(3, node, 5, 1, ExitStatus::exited(7), "boom");
  CHECK(f.round == 3);
  CHECK(f.node == node);
  CHECK(f.global_rank == 5);
  CHECK(f.local_rank == 1);
  CHECK(f.exit_code == 7);
  CHECK_FALSE(f.signal);
  CHECK(f.ddprun_exit_code() == 7);
  const auto k = make_failure(0, node, 2, 0, ExitStatus::killed(SIGKILL), "");
  CHECK(k.signal == SIGKILL);
  CHECK_FALSE(k.exit_code);
  CHECK(k.ddprun_exit_code() == 128 + SIGKILL);
}

TEST_CASE("job-failed summary names the node and the rank") {
  rdzv::SendJobFailed failed;
  failed.run_id = "job7";
  failed.reason = "worker failure with no restarts left";
  failed.exit_code = 3;
  rdzv::RootCause rc;
  rc.failure = make_failure(1, {"127.0.0.3", 42, "abc"}, 5, 1, ExitStatus::exited(3), "ValueError: bad");
  rc.node_addr = "127.0.0.3";
  rc.group_rank = 2;
  failed.root_cause = rc;
  const auto text = format_job_failed(failed, "train.py");
  CHECK_THAT(text, Contains("job 'job7' failed: worker failure with no restarts left"));
  CHECK_THAT(text, Contains("host       : 127.0.0.3"));
  CHECK_THAT(text, Contains("rank       : 5 (local_rank: 1)"));
  CHECK_THAT(text, Contains("exitcode   : 3"));
  CHECK_THAT(text, Contains("ValueError: bad"));
  CHECK_THAT(text, Contains("group rank 2"));
  CHECK_THAT(text, Contains("<NO_OTHER_FAILURES>"));
  // This node's own failed ranks of the round are listed under "Failures:" with its host.
  FailureReport mine;
  mine.rank = 0;
  mine.local_rank = 0;
  mine.pid = 77;
  mine.status = ExitStatus::exited(4);
  mine.host = "127.0.0.1";
  const auto with_local = format_job_failed(failed, "train.py", {mine});
  CHECK_THAT(with_local, Contains("[1]:\n"));
  CHECK_THAT(with_local, Contains("host       : 127.0.0.1"));
  CHECK_THAT(with_local, Contains("exitcode   : 4 (pid: 77)"));
  CHECK(with_local.find("exitcode   : 4") < with_local.find("Root Cause"));
  failed.root_cause.reset();
  CHECK(format_job_failed(failed, "train.py") == "ddprun: job 'job7' failed: worker failure with no restarts left\n");
}

TEST_CASE("NCCL roots: offered for the largest world the job allows, used for the round's world") {
  AgentConfig c = base();
  c.nproc_per_node = 8;
  c.max_nodes = 4;  // at most 32 ranks
  CHECK(nccl_roots_to_offer(c) == 1);
  c.max_nodes = 64;  // 512 ranks -> 2 roots
  CHECK(nccl_roots_to_offer(c) == 2);
  c.max_nodes = 1000;  // 8000 ranks -> 32 roots
  CHECK(nccl_roots_to_offer(c) == 32);
  // The round uses ceil(world / 256) of them.
  CHECK(nccl_roots_for_round(c, 256, 32) == 1);
  CHECK(nccl_roots_for_round(c, 257, 32) == 2);
  CHECK(nccl_roots_for_round(c, 8000, 32) == 32);
  CHECK(nccl_roots_for_round(c, 9000, 32) == 32);  // never more than were offered
  CHECK(nccl_roots_for_round(c, 1, 0) == 0);
  // --nccl-roots: exactly that many, whatever the world.
  c.nccl_roots = 3;
  CHECK(nccl_roots_to_offer(c) == 3);
  CHECK(nccl_roots_for_round(c, 10, 3) == 3);
}
