#pragma once
// WorkerGroupMachine: the decisions of the per-node agent, as a pure state machine.
//
// The shell (worker_run.cpp) feeds it events (a worker exited, a worker's output is drained, a
// handled signal arrived, the shutdown grace expired) and applies the actions it returns
// (signal every worker process group, arm/cancel the grace timer, start an attempt, finish
// with an exit code). No I/O, no clock, no processes: tests drive it directly. Not
// thread-safe; owned by the io_context thread.
//
// A worker is "done" once it has exited AND its output pipes reached EOF ("exited" is not
// "exited and drained"); the group only ends when every worker is done.
//
// Transition table (state × event → next state, actions):
//
// clang-format off
//   state         event               condition             next          actions
//   -----------   -----------------   -------------------   -----------   ----------------------------------
//   init          start                                     healthy       start_attempt(0)
//   healthy       exited(ok)          not all done          healthy       -
//   healthy       exited(ok)/drained  all done              succeeded     finish(0)
//   healthy       exited(failed)                            stopping[F]   record failure,
//                                                                         signal_groups(SIGTERM), arm_grace
//   healthy       signal(s)                                 stopping[S]   signal_groups(s), arm_grace
//   stopping      exited(any)/drained not all done          stopping      -
//   stopping      grace_expired                             stopping      signal_groups(SIGKILL), arm_kill_wait
//   stopping      kill_wait_expired   a worker not exited   as all done   abandon(r) for each such worker,
//                                     since its SIGKILL     (no restart)  then as all done
//   healthy       hang_kill                                 healthy       arm_kill_wait (the shell sent SIGKILL)
//   healthy       kill_wait_expired   after hang_kill, a    failed        abandon(r) for each worker not exited,
//                                     worker not exited                   then as all done (finish(1))
//   healthy       worker_kill(r)      r not exited nor      healthy       arm_kill_wait (the shell sent r SIGKILL)
//                                     killed this attempt,
//                                     no hang_kill
//   healthy       worker_kill(r)      otherwise             (same)        -
//   healthy       kill_wait_expired   no hang_kill, a       stopping[F]   signal_groups(SIGTERM), arm_grace,
//                                     worker_kill(r) not    (no restart)  abandon(r) for each such worker,
//                                     exited                              then as all done (finish(1) when
//                                                                         no other worker runs)
//   stopping[F]   signal(s)                                 stopping[S]   signal_groups(s) (grace keeps running)
//   stopping[S]   signal (second, no group SIGKILL yet)     stopping[S]   signal_groups(SIGKILL), arm_kill_wait
//   stopping[S]   signal after the SIGKILL                  as kill_wait_expired
//   stopping[F]   all done            restarts left,        healthy       cancel_grace, signal_groups(SIGKILL)
//                                     none abandoned                      (sweep leftovers), start_attempt(n+1)
//   stopping[F]   all done            budget spent or       failed        cancel_grace, signal_groups(SIGKILL),
//                                     one abandoned                       finish(first failure's code)
//   stopping[S]   all done                                  interrupted   cancel_grace, signal_groups(SIGKILL),
//                                                                         finish(128 + s)
//   succeeded/failed/interrupted   any                   (same)        - (terminal)
// clang-format on
//
// [F] = stopping because a worker failed, [S] = stopping because ddprun got a signal.
// The first SIGKILL of a stop (the grace's, a second signal's) arms the kill wait; a signal
// after it is taken as its expiry. A SIGKILL of one worker (the file timer's) arms it too, for
// that worker only. A worker that outlives it is stuck in the kernel (a SIGKILL it
// cannot act on): the group gives up waiting for it, and never restarts after that.
// A worker exiting 0 while others run keeps the group running (torchrun semantics).
// Only exits observed while healthy count as failures: exits caused by our own SIGTERM are not.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ddprun/agent/exit_status.hpp"

namespace ddprun::agent {

enum class GroupState : std::uint8_t { init, healthy, stopping, succeeded, failed, interrupted };
// requested = the agent stopped the group itself (a membership change, the round ended): not a
// user's signal, so a signal arriving during that stop is the first one, not a second Ctrl-C.
enum class StopCause : std::uint8_t { none, worker_failure, signal, requested };

const char* to_string(GroupState state);

struct GroupAction {
  enum class Kind : std::uint8_t {
    start_attempt,  // value = restart count (0 for the first attempt); reset store, spawn all
    signal_groups,  // value = signal to send to every worker process group of the attempt
    arm_grace,      // start the shutdown grace timer (shutdown_timeout)
    cancel_grace,   // cancels the grace and the kill wait
    arm_kill_wait,  // start the kill wait (kill_timeout): how long a SIGKILLed worker may take to end
    abandon,        // value = local rank: a worker that did not end within the kill wait; stop waiting for it
    finish,         // value = ddprun's exit code; the run is over
  };
  Kind kind;
  int value = 0;
  friend bool operator==(const GroupAction&, const GroupAction&) = default;
};
using GroupActions = std::vector<GroupAction>;

struct RecordedFailure {
  int attempt = 0;
  int local_rank = 0;
  ExitStatus status;
};

class WorkerGroupMachine {
 public:
  // `nproc`: workers per attempt (> 0). `max_restarts`: group restarts allowed (>= 0).
  WorkerGroupMachine(int nproc, int max_restarts);

  GroupActions start();
  GroupActions on_exited(int local_rank, ExitStatus status);
  GroupActions on_drained(int local_rank);
  GroupActions on_signal(int sig);
  // The agent stops a healthy group itself (SIGTERM, grace, SIGKILL); it ends as on a signal.
  GroupActions on_stop_request();
  GroupActions on_grace_expired();
  // The shell SIGKILLed every worker group itself (the hang detector): arms the kill wait, as a
  // stop's SIGKILL does (a signal after it gives up at once). Only while healthy.
  GroupActions on_hang_kill();
  // The shell SIGKILLed one worker's own process (the file timer): arms the kill wait again.
  // Only while healthy, once per worker and attempt.
  GroupActions on_worker_kill(int local_rank);
  // The kill wait after a SIGKILL expired: workers still not exited since their SIGKILL (all of
  // them after the group's SIGKILL, else those of on_worker_kill) are abandoned. While healthy
  // only with such a worker: the attempt then fails (exit 1) and the others are stopped.
  GroupActions on_kill_wait_expired();

  GroupState state() const { return state_; }
  StopCause stop_cause() const { return cause_; }
  int attempt() const { return attempt_; }  // restart count of the current attempt
  int max_restarts() const { return max_restarts_; }
  int restarts_left() const { return max_restarts_ - attempt_; }
  bool is_terminal() const;
  bool worker_exited(int local_rank) const;
  // Whether a worker of the current attempt was abandoned (it never ended after SIGKILL).
  bool abandoned() const { return abandoned_; }
  // Failures of every attempt in the order observed; the root cause of a run that failed is
  // the first failure of its last attempt (root_cause()).
  const std::vector<RecordedFailure>& failures() const { return failures_; }
  std::optional<RecordedFailure> root_cause() const;

 private:
  struct Worker {
    bool exited = false;
    bool drained = false;
    bool killed = false;  // on_worker_kill
  };
  GroupActions maybe_complete();
  GroupActions kill();  // SIGKILL to every group; the first one of a stop arms the kill wait
  void check_rank(int local_rank) const;

  int nproc_;
  int max_restarts_;
  GroupState state_ = GroupState::init;
  StopCause cause_ = StopCause::none;
  int stop_signal_ = 0;
  bool kill_sent_ = false;    // this stop (or the hang detector) sent SIGKILL and armed the kill wait
  bool hang_killed_ = false;  // on_hang_kill this attempt
  bool abandoned_ = false;
  int attempt_ = 0;
  std::vector<Worker> workers_;
  std::vector<RecordedFailure> failures_;
};

}  // namespace ddprun::agent
