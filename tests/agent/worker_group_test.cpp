// WorkerGroupMachine: every row of the transition table in worker_group.hpp.
#include <catch2/catch.hpp>
#include <csignal>

#include "ddprun/agent/worker_group.hpp"
#include "ddprun/common/error.hpp"

using namespace ddprun::agent;
using K = GroupAction::Kind;

namespace {

bool contains(const GroupActions& actions, GroupAction a) {
  for (const auto& x : actions) {
    if (x == a) {
      return true;
    }
  }
  return false;
}

// Exit + drain for one worker; returns the actions of both events.
GroupActions done(WorkerGroupMachine& m, int rank, ExitStatus s) {
  auto a = m.on_exited(rank, s);
  auto b = m.on_drained(rank);
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace

TEST_CASE("start begins attempt 0") {
  WorkerGroupMachine m(2, 1);
  CHECK(m.state() == GroupState::init);
  CHECK(m.start() == GroupActions{{K::start_attempt, 0}});
  CHECK(m.state() == GroupState::healthy);
  CHECK(m.start().empty());  // idempotent
}

TEST_CASE("all workers exit 0 and drain: succeeded, exit code 0") {
  WorkerGroupMachine m(3, 0);
  m.start();
  CHECK(done(m, 0, ExitStatus::exited(0)).empty());
  CHECK(m.state() == GroupState::healthy);  // a worker exiting 0 keeps the group running
  CHECK(done(m, 2, ExitStatus::exited(0)).empty());
  CHECK(m.on_exited(1, ExitStatus::exited(0)).empty());  // exited but not drained yet
  CHECK(m.state() == GroupState::healthy);
  CHECK(m.on_drained(1) == GroupActions{{K::finish, 0}});
  CHECK(m.state() == GroupState::succeeded);
  CHECK(m.is_terminal());
}

TEST_CASE("drained before exit also completes on the exit") {
  WorkerGroupMachine m(1, 0);
  m.start();
  CHECK(m.on_drained(0).empty());
  CHECK(m.on_exited(0, ExitStatus::exited(0)) == GroupActions{{K::finish, 0}});
}

TEST_CASE("a failure stops the group; budget spent → failed with the worker's code") {
  WorkerGroupMachine m(2, 0);
  m.start();
  const auto a = m.on_exited(1, ExitStatus::exited(7));
  CHECK(a == GroupActions{{K::signal_groups, SIGTERM}, {K::arm_grace, 0}});
  CHECK(m.state() == GroupState::stopping);
  CHECK(m.stop_cause() == StopCause::worker_failure);
  CHECK(m.on_drained(1).empty());
  // Rank 0 dies from our SIGTERM: not a failure of its own.
  const auto b = done(m, 0, ExitStatus::killed(SIGTERM));
  CHECK(b == GroupActions{{K::cancel_grace, 0}, {K::signal_groups, SIGKILL}, {K::finish, 7}});
  CHECK(m.state() == GroupState::failed);
  REQUIRE(m.failures().size() == 1);
  CHECK(m.root_cause()->local_rank == 1);
  CHECK(m.root_cause()->status == ExitStatus::exited(7));
}

TEST_CASE("a signal death maps to 128 + signal") {
  WorkerGroupMachine m(1, 0);
  m.start();
  const auto a = done(m, 0, ExitStatus::killed(SIGSEGV));
  CHECK(contains(a, {K::finish, 128 + SIGSEGV}));
  CHECK(m.state() == GroupState::failed);
}

TEST_CASE("restarts while the budget lasts, then fails with the last attempt's root cause") {
  WorkerGroupMachine m(2, 2);
  m.start();
  for (int attempt = 0; attempt < 2; ++attempt) {
    CHECK(m.attempt() == attempt);
    m.on_exited(0, ExitStatus::exited(3 + attempt));
    m.on_drained(0);
    const auto a = done(m, 1, ExitStatus::killed(SIGTERM));
    CHECK(a == GroupActions{{K::cancel_grace, 0}, {K::signal_groups, SIGKILL}, {K::start_attempt, attempt + 1}});
    CHECK(m.state() == GroupState::healthy);
    CHECK(m.restarts_left() == 2 - (attempt + 1));
    CHECK_FALSE(m.worker_exited(0));  // fresh worker state for the new attempt
  }
  m.on_exited(1, ExitStatus::exited(9));
  m.on_drained(1);
  const auto last = done(m, 0, ExitStatus::exited(0));
  CHECK(contains(last, {K::finish, 9}));
  CHECK(m.failures().size() == 3);
  CHECK(m.root_cause()->attempt == 2);
  CHECK(m.root_cause()->local_rank == 1);
}

TEST_CASE("success after a restart ends with 0") {
  WorkerGroupMachine m(1, 1);
  m.start();
  CHECK(contains(done(m, 0, ExitStatus::exited(1)), {K::start_attempt, 1}));
  CHECK(done(m, 0, ExitStatus::exited(0)) == GroupActions{{K::finish, 0}});
  CHECK(m.state() == GroupState::succeeded);
}

TEST_CASE("grace expiry sends SIGKILL only while stopping") {
  WorkerGroupMachine m(2, 0);
  m.start();
  CHECK(m.on_grace_expired().empty());  // healthy: a stale timer does nothing
  m.on_exited(0, ExitStatus::exited(1));
  CHECK(m.on_grace_expired() == GroupActions{{K::signal_groups, SIGKILL}, {K::arm_kill_wait, 0}});
  CHECK(m.state() == GroupState::stopping);
  CHECK(m.on_grace_expired() == GroupActions{{K::signal_groups, SIGKILL}});  // the wait is armed once
}

TEST_CASE("a handled signal is forwarded; the run ends with 128 + signal") {
  WorkerGroupMachine m(2, 5);
  m.start();
  CHECK(m.on_signal(SIGINT) == GroupActions{{K::signal_groups, SIGINT}, {K::arm_grace, 0}});
  CHECK(m.stop_cause() == StopCause::signal);
  // Exits caused by the forwarded signal are not failures and do not restart.
  m.on_drained(0);
  m.on_drained(1);
  CHECK(m.on_exited(0, ExitStatus::killed(SIGINT)).empty());
  const auto a = m.on_exited(1, ExitStatus::exited(1));
  CHECK(a == GroupActions{{K::cancel_grace, 0}, {K::signal_groups, SIGKILL}, {K::finish, 130}});
  CHECK(m.state() == GroupState::interrupted);
  CHECK(m.failures().empty());
}

TEST_CASE("a signal during the agent's own stop is forwarded, not escalated to SIGKILL") {
  WorkerGroupMachine m(2, 5);
  m.start();
  CHECK(m.on_stop_request() == GroupActions{{K::signal_groups, SIGTERM}, {K::arm_grace, 0}});
  CHECK(m.stop_cause() == StopCause::requested);
  CHECK(m.on_stop_request().empty());  // already stopping
  // The first user signal (e.g. SIGINT forwarded down a launch tree after a membership change
  // began the stop) reaches the workers as itself; only a second one means "no more grace".
  CHECK(m.on_signal(SIGINT) == GroupActions{{K::signal_groups, SIGINT}});
  CHECK(m.stop_cause() == StopCause::signal);
  CHECK(m.on_signal(SIGINT) == GroupActions{{K::signal_groups, SIGKILL}, {K::arm_kill_wait, 0}});
  m.on_drained(0);
  m.on_drained(1);
  CHECK(m.on_exited(0, ExitStatus::killed(SIGINT)).empty());
  const auto a = m.on_exited(1, ExitStatus::killed(SIGKILL));
  CHECK(a == GroupActions{{K::cancel_grace, 0}, {K::signal_groups, SIGKILL}, {K::finish, 130}});
  CHECK(m.state() == GroupState::interrupted);
}

TEST_CASE("the agent's own stop ends like SIGTERM and never restarts") {
  WorkerGroupMachine m(1, 5);
  m.start();
  m.on_stop_request();
  m.on_drained(0);
  const auto a = m.on_exited(0, ExitStatus::killed(SIGTERM));
  CHECK(a == GroupActions{{K::cancel_grace, 0}, {K::signal_groups, SIGKILL}, {K::finish, 143}});
  CHECK(m.failures().empty());
}

TEST_CASE("a second signal escalates to SIGKILL") {
  WorkerGroupMachine m(1, 0);
  m.start();
  m.on_signal(SIGTERM);
  CHECK(m.on_signal(SIGINT) == GroupActions{{K::signal_groups, SIGKILL}, {K::arm_kill_wait, 0}});
  CHECK(contains(done(m, 0, ExitStatus::killed(SIGKILL)), {K::finish, 128 + SIGTERM}));
}

TEST_CASE("a worker that outlives the kill wait is abandoned, and the group never restarts") {
  WorkerGroupMachine m(3, 5);
  m.start();
  m.on_exited(0, ExitStatus::exited(7));    // the first failure; restarts are left
  done(m, 1, ExitStatus::killed(SIGTERM));  // ends at the SIGTERM
  m.on_drained(0);
  CHECK(m.on_grace_expired() == GroupActions{{K::signal_groups, SIGKILL}, {K::arm_kill_wait, 0}});
  // Rank 2 never ends (stuck in the kernel): given up on, and no restart beside it.
  const auto a = m.on_kill_wait_expired();
  CHECK(a == GroupActions{{K::abandon, 2}, {K::cancel_grace, 0}, {K::signal_groups, SIGKILL}, {K::finish, 7}});
  CHECK(m.state() == GroupState::failed);
  CHECK(m.abandoned());
  CHECK(m.attempt() == 0);
  CHECK(m.on_kill_wait_expired().empty());  // terminal
  CHECK(m.on_exited(2, ExitStatus::killed(SIGKILL)).empty());
}

TEST_CASE("without a worker left, the kill wait's expiry changes nothing; restarts go on") {
  WorkerGroupMachine m(2, 1);
  m.start();
  m.on_exited(0, ExitStatus::exited(1));
  m.on_grace_expired();
  m.on_drained(0);
  // Rank 1 has exited but its output has not drained: it is not abandoned.
  CHECK(m.on_exited(1, ExitStatus::killed(SIGKILL)).empty());
  CHECK(m.on_kill_wait_expired().empty());
  CHECK_FALSE(m.abandoned());
  CHECK(contains(m.on_drained(1), {K::start_attempt, 1}));
  CHECK(m.state() == GroupState::healthy);
  // The new attempt's stop arms its own kill wait.
  m.on_exited(1, ExitStatus::exited(1));
  CHECK(m.on_grace_expired() == GroupActions{{K::signal_groups, SIGKILL}, {K::arm_kill_wait, 0}});
}

TEST_CASE("a third signal gives up at once on what the second one's SIGKILL did not end") {
  WorkerGroupMachine m(2, 0);
  m.start();
  CHECK(m.on_signal(SIGINT) == GroupActions{{K::signal_groups, SIGINT}, {K::arm_grace, 0}});
  done(m, 0, ExitStatus::killed(SIGINT));
  CHECK(m.on_signal(SIGINT) == GroupActions{{K::signal_groups, SIGKILL}, {K::arm_kill_wait, 0}});
  const auto a = m.on_signal(SIGINT);
  CHECK(a == GroupActions{{K::abandon, 1}, {K::cancel_grace, 0}, {K::signal_groups, SIGKILL}, {K::finish, 130}});
  CHECK(m.state() == GroupState::interrupted);
}

TEST_CASE("after the shell's own SIGKILL (a hang), a kill wait that finds no worker ended fails the attempt") {
  WorkerGroupMachine m(2, 3);
  m.start();
  CHECK(m.on_kill_wait_expired().empty());  // healthy without a hang kill: a stale timer does nothing
  CHECK(m.on_hang_kill() == GroupActions{{K::arm_kill_wait, 0}});
  // Both ranks stuck in the kernel: no exit ever comes, the group is still healthy.
  const auto a = m.on_kill_wait_expired();
  CHECK(a == GroupActions{
                 {K::abandon, 0}, {K::abandon, 1}, {K::cancel_grace, 0}, {K::signal_groups, SIGKILL}, {K::finish, 1}});
  CHECK(m.state() == GroupState::failed);
  CHECK(m.abandoned());
  CHECK(m.on_hang_kill().empty());  // terminal
  // One rank ended at the SIGKILL (the usual hang): the attempt fails through that exit; the
  // grace's SIGKILL does not arm the wait again, and the wait then gives up only on the other,
  // without a restart. A signal meanwhile would give up at once, as after a stop's SIGKILL.
  WorkerGroupMachine n(2, 3);
  n.start();
  n.on_hang_kill();
  CHECK(contains(n.on_exited(0, ExitStatus::killed(SIGKILL)), {K::arm_grace, 0}));
  n.on_drained(0);
  CHECK(n.on_grace_expired() == GroupActions{{K::signal_groups, SIGKILL}});
  CHECK(n.on_kill_wait_expired() ==
        GroupActions{{K::abandon, 1}, {K::cancel_grace, 0}, {K::signal_groups, SIGKILL}, {K::finish, 128 + SIGKILL}});
  // Every worker exited 0 just before the hang kill and is draining: nothing to give up on.
  WorkerGroupMachine o(1, 0);
  o.start();
  o.on_hang_kill();
  CHECK(o.on_exited(0, ExitStatus::exited(0)).empty());
  CHECK(o.on_kill_wait_expired().empty());
  CHECK(o.on_drained(0) == GroupActions{{K::finish, 0}});
}

TEST_CASE("a worker the shell SIGKILLed alone (the file timer) is given up on alone, and the others stop") {
  WorkerGroupMachine m(3, 3);
  m.start();
  CHECK(m.on_worker_kill(1) == GroupActions{{K::arm_kill_wait, 0}});
  CHECK(m.on_worker_kill(1).empty());                                 // once per worker
  CHECK(m.on_worker_kill(2) == GroupActions{{K::arm_kill_wait, 0}});  // the wait restarts for it
  // Neither rank 1 nor rank 2 reported an exit (both stuck in the kernel); rank 0 runs on.
  const auto a = m.on_kill_wait_expired();
  CHECK(a == GroupActions{{K::signal_groups, SIGTERM}, {K::arm_grace, 0}, {K::abandon, 1}, {K::abandon, 2}});
  CHECK(m.state() == GroupState::stopping);
  CHECK(m.abandoned());
  CHECK_FALSE(m.worker_exited(0));
  // Rank 0 is waited for as in any stop (a second expiry gives up on nobody), and no restart.
  CHECK(m.on_kill_wait_expired().empty());
  CHECK(m.on_exited(0, ExitStatus::killed(SIGTERM)).empty());
  CHECK(m.on_drained(0) == GroupActions{{K::cancel_grace, 0}, {K::signal_groups, SIGKILL}, {K::finish, 1}});
  CHECK(m.state() == GroupState::failed);

  // Rank 2 ended at its SIGKILL (its exit fails the attempt), rank 1 did not: the wait gives up
  // on rank 1 only, rank 0 (SIGTERM only) is waited for, and no restart follows.
  WorkerGroupMachine s(3, 3);
  s.start();
  s.on_worker_kill(1);
  s.on_worker_kill(2);
  CHECK(contains(s.on_exited(2, ExitStatus::killed(SIGKILL)), {K::arm_grace, 0}));
  s.on_drained(2);
  CHECK(s.on_kill_wait_expired() == GroupActions{{K::abandon, 1}});
  s.on_exited(0, ExitStatus::killed(SIGTERM));
  const auto end = s.on_drained(0);
  CHECK_FALSE(contains(end, {K::start_attempt, 1}));
  CHECK(s.state() == GroupState::failed);

  // One worker alone: given up on, nothing else to stop, the attempt fails at once.
  WorkerGroupMachine one(1, 3);
  one.start();
  one.on_worker_kill(0);
  CHECK(one.on_kill_wait_expired() == GroupActions{{K::signal_groups, SIGTERM},
                                                   {K::arm_grace, 0},
                                                   {K::abandon, 0},
                                                   {K::cancel_grace, 0},
                                                   {K::signal_groups, SIGKILL},
                                                   {K::finish, 1}});

  // The usual case: the killed worker ends; that exit fails the attempt and the kill wait that
  // expires during the stop gives up on nobody (the others got only SIGTERM), and the restart
  // happens.
  WorkerGroupMachine n(2, 1);
  n.start();
  n.on_worker_kill(0);
  CHECK(contains(n.on_exited(0, ExitStatus::killed(SIGKILL)), {K::arm_grace, 0}));
  n.on_drained(0);
  CHECK(n.on_kill_wait_expired().empty());
  CHECK_FALSE(n.abandoned());
  n.on_exited(1, ExitStatus::killed(SIGTERM));
  CHECK(contains(n.on_drained(1), {K::start_attempt, 1}));
  // A new attempt's workers start unkilled; a stale wait finds nothing.
  CHECK(n.on_kill_wait_expired().empty());
  CHECK(n.on_worker_kill(0) == GroupActions{{K::arm_kill_wait, 0}});

  // After the hang detector's SIGKILL of every group the wait covers all already; outside a
  // healthy group the shell's stop does the killing.
  WorkerGroupMachine o(2, 0);
  o.start();
  o.on_hang_kill();
  CHECK(o.on_worker_kill(0).empty());
  WorkerGroupMachine p(1, 0);
  p.start();
  p.on_signal(SIGTERM);
  CHECK(p.on_worker_kill(0).empty());
}

TEST_CASE("the agent's own stop gives up like the others") {
  WorkerGroupMachine m(1, 0);
  m.start();
  m.on_stop_request();
  m.on_grace_expired();
  CHECK(m.on_kill_wait_expired() ==
        GroupActions{{K::abandon, 0}, {K::cancel_grace, 0}, {K::signal_groups, SIGKILL}, {K::finish, 143}});
}

TEST_CASE("a signal during a failure stop wins over the pending restart") {
  WorkerGroupMachine m(2, 3);
  m.start();
  m.on_exited(0, ExitStatus::exited(2));
  CHECK(m.on_signal(SIGHUP) == GroupActions{{K::signal_groups, SIGHUP}});
  m.on_drained(0);
  const auto a = done(m, 1, ExitStatus::killed(SIGHUP));
  CHECK(contains(a, {K::finish, 128 + SIGHUP}));
  CHECK_FALSE(contains(a, {K::start_attempt, 1}));
  CHECK(m.state() == GroupState::interrupted);
}

TEST_CASE("a signal before start finishes at once") {
  WorkerGroupMachine m(1, 0);
  CHECK(m.on_signal(SIGTERM) == GroupActions{{K::finish, 128 + SIGTERM}});
  CHECK(m.is_terminal());
}

TEST_CASE("terminal states ignore events; duplicates are ignored") {
  WorkerGroupMachine m(1, 0);
  m.start();
  CHECK(m.on_exited(0, ExitStatus::exited(0)).empty());
  CHECK(m.on_exited(0, ExitStatus::exited(5)).empty());  // duplicate exit report
  CHECK(m.on_drained(0) == GroupActions{{K::finish, 0}});
  CHECK(m.on_signal(SIGINT).empty());
  CHECK(m.on_exited(0, ExitStatus::exited(1)).empty());
  CHECK(m.on_grace_expired().empty());
  CHECK(m.state() == GroupState::succeeded);
}

TEST_CASE("bad arguments") {
  CHECK_THROWS_AS(WorkerGroupMachine(0, 0), ddprun::Error);
  CHECK_THROWS_AS(WorkerGroupMachine(1, -1), ddprun::Error);
  WorkerGroupMachine m(2, 0);
  m.start();
  CHECK_THROWS_AS(m.on_exited(2, ExitStatus::exited(0)), ddprun::Error);
}

TEST_CASE("describe and signal names") {
  CHECK(describe(ExitStatus::killed(SIGSEGV)) == "SIGSEGV (signal 11)");
  CHECK(describe(ExitStatus::exited(7)) == "exit code 7");
  CHECK(ExitStatus::killed(SIGKILL).shell_code() == 137);
  CHECK(signal_name(SIGINT) == "SIGINT");
  CHECK(signal_name(200) == "SIG200");
}
