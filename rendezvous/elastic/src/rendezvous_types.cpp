// Plain rendezvous data: validation and formatting (rendezvous_types.hpp has the contract).
#include "ddprun/rendezvous/rendezvous_types.hpp"

#include <fmt/format.h>

#include <string>

#include "ddprun/common/strings.hpp"

namespace ddprun::rendezvous {

std::string format_seconds(Duration d) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(d).count();
  if (ms % 1000 == 0) return fmt::format("{} s", ms / 1000);
  std::string text = fmt::format("{:.3f}", static_cast<double>(ms) / 1000.0);
  while (text.back() == '0') text.pop_back();
  return text + " s";
}

SharedBytes SharedBytes::with_hex(std::vector<std::uint8_t> bytes) {
  std::string hex = to_hex(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));  // NOLINT
  return SharedBytes(std::move(bytes), std::move(hex));
}

std::string NodeId::to_string() const { return fmt::format("{}:{}/{}", addr, pid, instance); }

std::string JobConfig::validate() const {
  if (min_nodes < 1) return fmt::format("min_nodes must be >= 1, got {}", min_nodes);
  if (max_nodes < min_nodes) return fmt::format("max_nodes ({}) must be >= min_nodes ({})", max_nodes, min_nodes);
  if (max_nodes > max_nodes_limit) return fmt::format("max_nodes must be <= {}, got {}", max_nodes_limit, max_nodes);
  if (max_restarts < 0) return fmt::format("max_restarts must be >= 0, got {}", max_restarts);
  if (max_restarts > max_restarts_limit)
    return fmt::format("max_restarts must be <= {}, got {}", max_restarts_limit, max_restarts);
  if (missed_heartbeats < 1) return fmt::format("missed_heartbeats must be >= 1, got {}", missed_heartbeats);

  const std::pair<const char*, Duration> positive[] = {{"join_timeout", join_timeout},
                                                       {"last_call_timeout", last_call_timeout},
                                                       {"close_timeout", close_timeout},
                                                       {"heartbeat_interval", heartbeat_interval},
                                                       {"exit_barrier_timeout", exit_barrier_timeout},
                                                       {"rebuild_grace", rebuild_grace}};
  for (const auto& [name, value] : positive) {
    if (value <= Duration::zero()) return fmt::format("{} must be > 0, got {}", name, format_seconds(value));
    if (value > max_timeout)
      return fmt::format("{} must be <= {}, got {}", name, format_seconds(max_timeout), format_seconds(value));
  }
  if (heartbeat_interval < min_heartbeat_interval || heartbeat_interval > max_heartbeat_interval)
    return fmt::format("heartbeat_interval must be between {} and {}, got {}", format_seconds(min_heartbeat_interval),
                       format_seconds(max_heartbeat_interval), format_seconds(heartbeat_interval));
  if (missed_heartbeats > max_lease / heartbeat_interval)
    return fmt::format("missed_heartbeats {} times heartbeat_interval {} exceeds 100 years", missed_heartbeats,
                       format_seconds(heartbeat_interval));
  return {};
}

int WorkerFailure::ddprun_exit_code() const {
  if (signal) return 128 + *signal;
  if (exit_code && *exit_code != 0) return *exit_code;
  return 1;
}

std::string RootCause::describe(std::size_t max_message) const {
  std::string text =
      fmt::format("rank {} (local rank {} on node {}, group rank {})", failure.global_rank, failure.local_rank,
                  node_addr.empty() ? failure.node.to_string() : node_addr, group_rank);
  if (failure.signal) {
    text += fmt::format(" was killed by signal {}", *failure.signal);
  } else if (failure.exit_code) {
    text += fmt::format(" exited with code {}", *failure.exit_code);
  } else {
    text += " failed";
  }
  if (!failure.message.empty()) {
    const std::string_view kept = utf8_prefix(failure.message, max_message);
    text += ": ";
    text += kept;
    if (failure.message.size() > kept.size())
      text += fmt::format(" [... {} more bytes]", failure.message.size() - kept.size());
  }
  return text;
}

const char* to_string(JobState state) {
  switch (state) {
    case JobState::waiting:
      return "waiting";
    case JobState::running:
      return "running";
    case JobState::completed:
      return "completed";
    case JobState::failed:
      return "failed";
  }
  return "?";
}

const char* to_string(MemberRole role) {
  switch (role) {
    case MemberRole::joined:
      return "joined";
    case MemberRole::expected:
      return "expected";
    case MemberRole::participant:
      return "participant";
    case MemberRole::late:
      return "late";
    case MemberRole::spare:
      return "spare";
  }
  return "?";
}

std::string role_label(const MemberStatus& member) {
  return member.role_name.empty() ? std::string(to_string(member.role)) : member.role_name;
}

std::string state_label(const JobStatus& job) {
  return job.state_name.empty() ? std::string(to_string(job.state)) : job.state_name;
}

std::string_view refuse_code_label(RefuseCode code) {
  switch (code) {
    case RefuseCode::auth:
      return "auth";
    case RefuseCode::not_owner:
      return "not_owner";
    case RefuseCode::invalid_request:
      return "invalid_request";
    case RefuseCode::config_mismatch:
      return "config_mismatch";
    case RefuseCode::job_finished:
      return "job_finished";
    case RefuseCode::job_closed:
      return "job_closed";
    case RefuseCode::job_full:
      return "job_full";
    case RefuseCode::inconsistent_rejoin:
      return "inconsistent_rejoin";
    case RefuseCode::other:
      return "other";
  }
  return "other";
}

}  // namespace ddprun::rendezvous
