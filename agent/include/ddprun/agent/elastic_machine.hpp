#pragma once
// ElasticMachine: the round decisions of the agent, as a pure state machine (every job mode:
// the single-node backend answers like a rendezvous of one node).
//
// The shell (agent.cpp) feeds it what the rendezvous backend pushes (assignment, restart,
// job failed / completed, refused, unreachable), what its local workers do (the first failure of
// a round, the whole group done) and handled signals, and applies the actions it returns. No
// I/O, no clock, no processes: tests drive it directly. Not thread-safe; owned by the
// io_context thread. (The worker group itself is run by a WorkerGroupMachine with no local
// restarts: restarts are the backend's decision.)
//
// States: idle (no workers: joining, or waiting for the rendezvous' verdict after the group
// ended), running (workers of a round run), stopping (workers are being stopped; `next` says
// what follows), done (exit decided).
//
//   state      event                       next       actions
//   ---------  --------------------------  ---------  -------------------------------------------
//   idle       assignment                  running    start_workers
//   running    assignment (missed restart) stopping   stop_workers; next = start the new one
//   stopping   assignment (rejoined alone) stopping   next = start the new one (unless exiting)
//   running    first local failure         running    report_failure (once per round)
//   running    group done, ok              idle       report_success (the exit barrier)
//   running    group done, failed          idle       - (the rendezvous decides: restart or fail)
//   running    restart                     stopping   stop_workers; next = rejoin
//   idle       restart                     idle       rejoin
//   stopping   restart                     stopping   next = rejoin (unless an exit is pending)
//   stopping   group done                  (next)     rejoin | start_workers | exit(code)
//   any        job failed(code) / refused / unreachable / completed(0)
//                                          stopping   stop_workers, next = exit(code) (running)
//                                          done       exit(code) (idle)
//   running    signal s (first)            stopping   forward_signal(s); next = exit(128+s), leave
//   stopping   signal s                    stopping   forward_signal(s) (escalates to SIGKILL)
//   idle       signal s                    done       leave, exit(128+s)
//   idle       give up                     done       leave, exit(1)
//   running    give up                     stopping   stop_workers; next = exit(1), leave
//   stopping   give up                     stopping   next = exit(1), leave (unless an exit is pending)
//   done       anything                    done       -
//
// An assignment that comes without a rejoin before it (the two assignment rows) is a round the
// backend resets for itself when it arrives (worker store, the round's failures), as next_round()
// does before it joins.
#include <cstdint>
#include <vector>

namespace ddprun::agent {

enum class ElasticState : std::uint8_t { idle, running, stopping, done };
const char* to_string(ElasticState state);

struct ElasticAction {
  enum class Kind : std::uint8_t {
    start_workers,   // the shell's latest assignment
    stop_workers,    // SIGTERM, grace, SIGKILL (the WorkerGroupMachine's stop)
    forward_signal,  // value = signal
    report_failure,  // the first local failure of this round
    report_success,  // all local workers exited 0
    rejoin,          // reset the worker store, join the next round
    leave,           // tell the rendezvous this node is gone
    exit,            // value = ddprun's exit code
  };
  Kind kind;
  int value = 0;
  friend bool operator==(const ElasticAction&, const ElasticAction&) = default;
};
using ElasticActions = std::vector<ElasticAction>;

class ElasticMachine {
 public:
  ElasticActions on_assignment();
  ElasticActions on_local_failure();
  ElasticActions on_group_done(bool succeeded);
  ElasticActions on_restart();
  // Job failed (its exit code), completed (0), refused or unreachable (1): stop and exit.
  ElasticActions on_result(int exit_code);
  // This node gives up on its own (an unhealthy worker group, no restart can help): stop the
  // workers, leave the job, exit 1.
  ElasticActions on_give_up();
  ElasticActions on_signal(int sig);

  ElasticState state() const { return state_; }
  bool workers_active() const { return state_ == ElasticState::running || state_ == ElasticState::stopping; }

 private:
  enum class Next : std::uint8_t { nothing, rejoin, start, exit };
  ElasticActions after_stop();

  ElasticState state_ = ElasticState::idle;
  Next next_ = Next::nothing;
  int exit_code_ = 0;
  bool leave_on_exit_ = false;
  bool failure_reported_ = false;
  int signal_ = 0;
};

}  // namespace ddprun::agent
