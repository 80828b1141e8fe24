#include "ddprun/agent/elastic_machine.hpp"

namespace ddprun::agent {

namespace {
using K = ElasticAction::Kind;
}

const char* to_string(ElasticState state) {
  switch (state) {
    case ElasticState::idle:
      return "idle";
    case ElasticState::running:
      return "running";
    case ElasticState::stopping:
      return "stopping";
    case ElasticState::done:
      return "done";
  }
  return "?";
}

ElasticActions ElasticMachine::on_assignment() {
  switch (state_) {
    case ElasticState::idle:
      state_ = ElasticState::running;
      failure_reported_ = false;
      return {{K::start_workers}};
    case ElasticState::running:
      state_ = ElasticState::stopping;
      next_ = Next::start;
      return {{K::stop_workers}};
    case ElasticState::stopping:
      if (next_ != Next::exit) next_ = Next::start;
      return {};
    case ElasticState::done:
      return {};
  }
  return {};
}

ElasticActions ElasticMachine::on_local_failure() {
  if (state_ != ElasticState::running || failure_reported_) return {};
  failure_reported_ = true;
  return {{K::report_failure}};
}

ElasticActions ElasticMachine::on_group_done(bool succeeded) {
  if (state_ == ElasticState::stopping) return after_stop();
  if (state_ != ElasticState::running) return {};
  state_ = ElasticState::idle;
  if (succeeded) return {{K::report_success}};
  return {};  // the failure was reported; the rendezvous pushes restart or job failed
}

ElasticActions ElasticMachine::after_stop() {
  const Next next = next_;
  next_ = Next::nothing;
  switch (next) {
    case Next::exit: {
      state_ = ElasticState::done;
      ElasticActions out;
      if (leave_on_exit_) out.push_back({K::leave});
      out.push_back({K::exit, exit_code_});
      return out;
    }
    case Next::rejoin:
      state_ = ElasticState::idle;
      return {{K::rejoin}};
    case Next::start:
      state_ = ElasticState::running;
      failure_reported_ = false;
      return {{K::start_workers}};
    case Next::nothing:
      state_ = ElasticState::idle;
      return {};
  }
  return {};
}

ElasticActions ElasticMachine::on_restart() {
  switch (state_) {
    case ElasticState::idle:
      return {{K::rejoin}};
    case ElasticState::running:
      state_ = ElasticState::stopping;
      next_ = Next::rejoin;
      return {{K::stop_workers}};
    case ElasticState::stopping:
      if (next_ != Next::exit) next_ = Next::rejoin;
      return {};
    case ElasticState::done:
      return {};
  }
  return {};
}

ElasticActions ElasticMachine::on_result(int exit_code) {
  switch (state_) {
    case ElasticState::idle:
      state_ = ElasticState::done;
      return {{K::exit, exit_code}};
    case ElasticState::running:
      state_ = ElasticState::stopping;
      next_ = Next::exit;
      exit_code_ = exit_code;
      return {{K::stop_workers}};
    case ElasticState::stopping:
      if (next_ != Next::exit) {  // a signal's exit (already pending) wins
        next_ = Next::exit;
        exit_code_ = exit_code;
      }
      return {};
    case ElasticState::done:
      return {};
  }
  return {};
}

ElasticActions ElasticMachine::on_give_up() {
  if (state_ == ElasticState::idle) {
    state_ = ElasticState::done;
    return {{K::leave}, {K::exit, 1}};
  }
  auto out = on_result(1);
  if (state_ == ElasticState::stopping && next_ == Next::exit && exit_code_ == 1) leave_on_exit_ = true;
  return out;
}

ElasticActions ElasticMachine::on_signal(int sig) {
  const bool first = signal_ == 0;
  if (first) signal_ = sig;
  switch (state_) {
    case ElasticState::idle:
      state_ = ElasticState::done;
      return {{K::leave}, {K::exit, 128 + sig}};
    case ElasticState::running:
    case ElasticState::stopping: {
      // The first verdict wins, as a signal's wins over a later result: a job the rendezvous
      // failed (on_result) keeps its code when a signal comes while the workers stop (srun
      // sending SIGTERM to the other tasks once one failed), as the fan-out launcher keeps it.
      const bool verdict = state_ == ElasticState::stopping && next_ == Next::exit;
      state_ = ElasticState::stopping;
      if (first && !verdict) {
        next_ = Next::exit;
        exit_code_ = 128 + sig;
        leave_on_exit_ = true;
      }
      return {{K::forward_signal, sig}};
    }
    case ElasticState::done:
      return {};
  }
  return {};
}

}  // namespace ddprun::agent
