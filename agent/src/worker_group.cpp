// Pure decisions of the per-node agent; see the transition table in worker_group.hpp.
#include "ddprun/agent/worker_group.hpp"

#include <algorithm>
#include <csignal>
#include <cstring>

#include "ddprun/common/error.hpp"

namespace ddprun::agent {

const char* to_string(GroupState state) {
  switch (state) {
    case GroupState::init:
      return "init";
    case GroupState::healthy:
      return "healthy";
    case GroupState::stopping:
      return "stopping";
    case GroupState::succeeded:
      return "succeeded";
    case GroupState::failed:
      return "failed";
    case GroupState::interrupted:
      return "interrupted";
  }
  return "?";
}

WorkerGroupMachine::WorkerGroupMachine(int nproc, int max_restarts) : nproc_(nproc), max_restarts_(max_restarts) {
  if (nproc <= 0) {
    throw Error("worker group: nproc_per_node must be > 0, got " + std::to_string(nproc));
  }
  if (max_restarts < 0) {
    throw Error("worker group: max_restarts must be >= 0, got " + std::to_string(max_restarts));
  }
}

bool WorkerGroupMachine::is_terminal() const {
  return state_ == GroupState::succeeded || state_ == GroupState::failed || state_ == GroupState::interrupted;
}

void WorkerGroupMachine::check_rank(int local_rank) const {
  if (local_rank < 0 || local_rank >= nproc_) {
    throw Error("worker group: event for unknown local rank " + std::to_string(local_rank));
  }
}

bool WorkerGroupMachine::worker_exited(int local_rank) const {
  check_rank(local_rank);
  return !workers_.empty() && workers_[static_cast<std::size_t>(local_rank)].exited;
}

std::optional<RecordedFailure> WorkerGroupMachine::root_cause() const {
  for (const auto& f : failures_) {
    if (f.attempt == attempt_) {
      return f;
    }
  }
  return std::nullopt;
}

GroupActions WorkerGroupMachine::start() {
  if (state_ != GroupState::init) {
    return {};
  }
  state_ = GroupState::healthy;
  attempt_ = 0;
  workers_.assign(static_cast<std::size_t>(nproc_), Worker{});
  return {{GroupAction::Kind::start_attempt, 0}};
}

GroupActions WorkerGroupMachine::on_exited(int local_rank, ExitStatus status) {
  check_rank(local_rank);
  if (is_terminal() || state_ == GroupState::init) {
    return {};
  }
  auto& w = workers_[static_cast<std::size_t>(local_rank)];
  if (w.exited) {
    return {};  // duplicate report
  }
  w.exited = true;
  GroupActions actions;
  if (state_ == GroupState::healthy && !status.ok()) {
    failures_.push_back({attempt_, local_rank, status});
    state_ = GroupState::stopping;
    cause_ = StopCause::worker_failure;
    actions.push_back({GroupAction::Kind::signal_groups, SIGTERM});
    actions.push_back({GroupAction::Kind::arm_grace, 0});
  }
  auto more = maybe_complete();
  actions.insert(actions.end(), more.begin(), more.end());
  return actions;
}

GroupActions WorkerGroupMachine::on_drained(int local_rank) {
  check_rank(local_rank);
  if (is_terminal() || state_ == GroupState::init) {
    return {};
  }
  workers_[static_cast<std::size_t>(local_rank)].drained = true;
  return maybe_complete();
}

GroupActions WorkerGroupMachine::on_signal(int sig) {
  switch (state_) {
    case GroupState::healthy:
      state_ = GroupState::stopping;
      cause_ = StopCause::signal;
      stop_signal_ = sig;
      return {{GroupAction::Kind::signal_groups, sig}, {GroupAction::Kind::arm_grace, 0}};
    case GroupState::stopping:
      if (cause_ == StopCause::signal) {
        // The user insists (a second Ctrl-C): no more grace. A signal after a SIGKILL of this
        // stop (the grace's or that one) stops waiting for what it could not end.
        if (kill_sent_) return on_kill_wait_expired();
        return kill();
      }
      // A restart or the agent's own stop was pending; the signal wins and ends the run after
      // this stop, and the workers see it (e.g. SIGINT forwarded through a launch tree that
      // arrives after a membership change already began the stop).
      cause_ = StopCause::signal;
      stop_signal_ = sig;
      return {{GroupAction::Kind::signal_groups, sig}};
    case GroupState::init:
      // Nothing runs yet: end right away with the signal's code.
      state_ = GroupState::interrupted;
      cause_ = StopCause::signal;
      stop_signal_ = sig;
      return {{GroupAction::Kind::finish, 128 + sig}};
    default:
      return {};
  }
}

GroupActions WorkerGroupMachine::on_stop_request() {
  if (state_ != GroupState::healthy) {
    return {};
  }
  state_ = GroupState::stopping;
  cause_ = StopCause::requested;
  stop_signal_ = SIGTERM;
  return {{GroupAction::Kind::signal_groups, SIGTERM}, {GroupAction::Kind::arm_grace, 0}};
}

GroupActions WorkerGroupMachine::on_grace_expired() {
  if (state_ != GroupState::stopping) {
    return {};
  }
  return kill();
}

GroupActions WorkerGroupMachine::kill() {
  GroupActions actions{{GroupAction::Kind::signal_groups, SIGKILL}};
  if (!kill_sent_) actions.push_back({GroupAction::Kind::arm_kill_wait, 0});
  kill_sent_ = true;
  return actions;
}

GroupActions WorkerGroupMachine::on_hang_kill() {
  if (state_ != GroupState::healthy) {
    return {};
  }
  hang_killed_ = true;
  kill_sent_ = true;
  return {{GroupAction::Kind::arm_kill_wait, 0}};
}

GroupActions WorkerGroupMachine::on_worker_kill(int local_rank) {
  check_rank(local_rank);
  if (state_ != GroupState::healthy) {
    return {};
  }
  auto& w = workers_[static_cast<std::size_t>(local_rank)];
  if (w.exited || w.killed) {
    return {};
  }
  w.killed = true;
  // The hang detector's wait already covers every worker; else the wait restarts, so none is
  // given up on sooner than kill_timeout after its own SIGKILL.
  if (hang_killed_) {
    return {};
  }
  return {{GroupAction::Kind::arm_kill_wait, 0}};
}

GroupActions WorkerGroupMachine::on_kill_wait_expired() {
  // Which workers got a SIGKILL they may not have acted on: every one after the group's SIGKILL
  // (a stop's, the hang detector's), else those the shell killed one by one (on_worker_kill).
  const bool all = kill_sent_;
  const auto given_up = [all](const Worker& w) { return !w.exited && (all || w.killed); };
  GroupActions actions;
  if (state_ == GroupState::healthy) {
    // Only with a worker that has not ended since its SIGKILL: the attempt fails with it,
    // without a failure of its own (exit 1). Otherwise a stale timer, or workers that exited 0
    // and are draining.
    if (!std::any_of(workers_.begin(), workers_.end(), given_up)) {
      return {};
    }
    state_ = GroupState::stopping;
    cause_ = StopCause::worker_failure;
    if (!all) {  // the others are still running: stop them as after a failure
      actions.push_back({GroupAction::Kind::signal_groups, SIGTERM});
      actions.push_back({GroupAction::Kind::arm_grace, 0});
    }
  }
  if (state_ != GroupState::stopping) {
    return {};
  }
  for (std::size_t r = 0; r < workers_.size(); ++r) {
    auto& w = workers_[r];
    if (!given_up(w)) continue;
    // Its output pipes stay open in the stuck process: it is done as far as the group goes.
    w.exited = true;
    w.drained = true;
    abandoned_ = true;
    actions.push_back({GroupAction::Kind::abandon, static_cast<int>(r)});
  }
  auto more = maybe_complete();
  actions.insert(actions.end(), more.begin(), more.end());
  return actions;
}

GroupActions WorkerGroupMachine::maybe_complete() {
  for (const auto& w : workers_) {
    if (!w.exited || !w.drained) {
      return {};
    }
  }
  if (state_ == GroupState::healthy) {
    state_ = GroupState::succeeded;
    return {{GroupAction::Kind::finish, 0}};
  }
  // stopping: every process has exited; the zombies still hold their process-group ids, so a
  // last SIGKILL reaches only leftovers (grandchildren) of our own groups.
  GroupActions actions{{GroupAction::Kind::cancel_grace, 0}, {GroupAction::Kind::signal_groups, SIGKILL}};
  if (cause_ == StopCause::signal || cause_ == StopCause::requested) {
    state_ = GroupState::interrupted;
    actions.push_back({GroupAction::Kind::finish, 128 + stop_signal_});
    return actions;
  }
  // A process that outlived SIGKILL still holds what it held (a GPU, a port): no restart beside it.
  if (attempt_ < max_restarts_ && !abandoned_) {
    ++attempt_;
    state_ = GroupState::healthy;
    cause_ = StopCause::none;
    kill_sent_ = false;
    hang_killed_ = false;
    workers_.assign(static_cast<std::size_t>(nproc_), Worker{});
    actions.push_back({GroupAction::Kind::start_attempt, attempt_});
    return actions;
  }
  state_ = GroupState::failed;
  const auto root = root_cause();
  actions.push_back({GroupAction::Kind::finish, root ? root->status.shell_code() : 1});
  return actions;
}

}  // namespace ddprun::agent
