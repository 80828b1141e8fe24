#pragma once
// Error types, tier one of docs/errors.md: configuration and programmer errors that a user
// must act on. Each carries what went wrong, where (flag, host:port, rank, file) and what to do.
//
// Tier two (expected runtime failures: peer closed, timeout, child died) are values handled
// where they happen (std::expected-like results, status enums), not these exceptions.
#include <stdexcept>
#include <string>

namespace ddprun {

class Error : public std::runtime_error {
 public:
  // `what`: one sentence, names the object (flag/host:port/file). `hint`: what to do, may be empty.
  explicit Error(const std::string& what, std::string hint = {})
      : std::runtime_error(hint.empty() ? what : what + " (" + hint + ")"), message_(what), hint_(std::move(hint)) {}
  const std::string& message() const noexcept { return message_; }
  const std::string& hint() const noexcept { return hint_; }

 private:
  std::string message_;
  std::string hint_;
};

// A bad command-line value or configuration combination. Exit code 2 in the launcher.
class UsageError : public Error {
 public:
  using Error::Error;
};

// A network peer could not be reached or misbehaved (names host:port).
class NetworkError : public Error {
 public:
  using Error::Error;
};

// An operation ran past its deadline.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

}  // namespace ddprun
