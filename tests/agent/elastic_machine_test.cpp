// ElasticMachine: every row of the transition table in elastic_machine.hpp.
#include <catch2/catch.hpp>
#include <csignal>

#include "ddprun/agent/elastic_machine.hpp"

using namespace ddprun::agent;
using K = ElasticAction::Kind;
using A = ElasticActions;

namespace {
ElasticMachine running() {
  ElasticMachine m;
  REQUIRE(m.on_assignment() == A{{K::start_workers}});
  REQUIRE(m.state() == ElasticState::running);
  return m;
}
}  // namespace

TEST_CASE("elastic: assignment starts the workers; success reports the exit barrier") {
  ElasticMachine m = running();
  CHECK(m.workers_active());
  CHECK(m.on_group_done(true) == A{{K::report_success}});
  CHECK(m.state() == ElasticState::idle);
  CHECK(m.on_result(0) == A{{K::exit, 0}});
  CHECK(m.state() == ElasticState::done);
  CHECK(m.on_assignment().empty());
  CHECK(m.on_restart().empty());
}

TEST_CASE("elastic: the first local failure is reported once per round") {
  ElasticMachine m = running();
  CHECK(m.on_local_failure() == A{{K::report_failure}});
  CHECK(m.on_local_failure().empty());
  CHECK(m.on_group_done(false).empty());  // the rendezvous decides
  CHECK(m.state() == ElasticState::idle);
  CHECK(m.on_restart() == A{{K::rejoin}});
  CHECK(m.on_assignment() == A{{K::start_workers}});
  CHECK(m.on_local_failure() == A{{K::report_failure}});  // a new round reports again
}

TEST_CASE("elastic: a restart while running stops the workers, then rejoins") {
  ElasticMachine m = running();
  CHECK(m.on_restart() == A{{K::stop_workers}});
  CHECK(m.state() == ElasticState::stopping);
  CHECK(m.on_local_failure().empty());  // exits caused by our stop are not failures
  CHECK(m.on_restart().empty());
  CHECK(m.on_group_done(false) == A{{K::rejoin}});
  CHECK(m.state() == ElasticState::idle);
}

TEST_CASE("elastic: an assignment while running (missed restart) stops, then starts it") {
  ElasticMachine m = running();
  CHECK(m.on_assignment() == A{{K::stop_workers}});
  CHECK(m.on_group_done(false) == A{{K::start_workers}});
  CHECK(m.state() == ElasticState::running);
}

TEST_CASE("elastic: job failed while running stops the workers and exits with its code") {
  ElasticMachine m = running();
  CHECK(m.on_result(7) == A{{K::stop_workers}});
  CHECK(m.on_restart().empty());  // the exit stays pending
  CHECK(m.on_assignment().empty());
  CHECK(m.on_group_done(false) == A{{K::exit, 7}});
  CHECK(m.state() == ElasticState::done);
}

TEST_CASE("elastic: a node that gives up stops its workers, leaves the job and exits 1") {
  ElasticMachine m = running();
  CHECK(m.on_give_up() == A{{K::stop_workers}});
  CHECK(m.on_restart().empty());
  CHECK(m.on_group_done(false) == A{{K::leave}, {K::exit, 1}});
  CHECK(m.state() == ElasticState::done);
  ElasticMachine idle;
  CHECK(idle.on_give_up() == A{{K::leave}, {K::exit, 1}});
  // A failed job's exit (no leave: the job is over) stays as it was.
  ElasticMachine failed = running();
  CHECK(failed.on_result(7) == A{{K::stop_workers}});
  CHECK(failed.on_give_up().empty());
  CHECK(failed.on_group_done(false) == A{{K::exit, 7}});
}

TEST_CASE("elastic: refused or unreachable while idle exits at once") {
  ElasticMachine m;
  CHECK(m.on_result(1) == A{{K::exit, 1}});
  CHECK(m.on_result(3).empty());
}

TEST_CASE("elastic: a signal forwards, leaves and exits 128+s once the workers are gone") {
  ElasticMachine m = running();
  CHECK(m.on_signal(SIGTERM) == A{{K::forward_signal, SIGTERM}});
  CHECK(m.state() == ElasticState::stopping);
  CHECK(m.on_signal(SIGINT) == A{{K::forward_signal, SIGINT}});  // the group machine escalates
  CHECK(m.on_result(5).empty());                                 // the signal's exit wins
  CHECK(m.on_group_done(false) == A{{K::leave}, {K::exit, 128 + SIGTERM}});
}

TEST_CASE("elastic: a signal after the job's failure keeps the failure's exit code") {
  // Before, the signal's 128+s replaced it: under srun, the SIGTERM sent to the other tasks once
  // one had failed turned every node's exit code into 143 after the failure summary.
  ElasticMachine m = running();
  CHECK(m.on_result(7) == A{{K::stop_workers}});
  CHECK(m.on_signal(SIGTERM) == A{{K::forward_signal, SIGTERM}});
  CHECK(m.on_group_done(false) == A{{K::exit, 7}});
}

TEST_CASE("elastic: a signal while stopping for a restart turns the rejoin into an exit") {
  ElasticMachine m = running();
  CHECK(m.on_restart() == A{{K::stop_workers}});
  CHECK(m.on_signal(SIGINT) == A{{K::forward_signal, SIGINT}});
  CHECK(m.on_group_done(false) == A{{K::leave}, {K::exit, 128 + SIGINT}});
}

TEST_CASE("elastic: a signal without workers leaves and exits") {
  ElasticMachine m;
  CHECK(m.on_signal(SIGHUP) == A{{K::leave}, {K::exit, 128 + SIGHUP}});
  CHECK(m.state() == ElasticState::done);
  CHECK(m.on_signal(SIGHUP).empty());
  CHECK(std::string(to_string(m.state())) == "done");
}
