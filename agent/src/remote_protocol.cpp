// The remote-agent stdin protocol; see remote_protocol.hpp.
#include "ddprun/agent/remote_protocol.hpp"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>

#include "ddprun/common/error.hpp"
#include "ddprun/common/strings.hpp"

namespace ddprun::agent {
namespace {

constexpr std::string_view kEnvNameForms = "NAME or NAME=VALUE, NAME matching [A-Za-z_][A-Za-z0-9_]*";

[[noreturn]] void block_error(const std::string& why) {
  throw Error("env block on stdin: " + why, "the launcher and the remote ddprun must be the same version");
}

}  // namespace

bool is_env_name(std::string_view name) {
  if (name.empty()) return false;
  const auto ok_first = [](char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; };
  if (!ok_first(name.front())) return false;
  return std::all_of(name.begin(), name.end(), [&](char c) { return ok_first(c) || (c >= '0' && c <= '9'); });
}

std::string encode_env_block(const RemoteEnv& entries) {
  std::string out;
  for (const auto& [name, value] : entries) {
    if (!is_env_name(name)) {
      throw UsageError("remote environment: '" + name + "' is not a variable name", std::string(kEnvNameForms));
    }
    if (value.find('\0') != std::string::npos) {
      throw UsageError("remote environment: the value of " + name + " contains a NUL byte", "remove it");
    }
    out += name;
    out.push_back('=');
    out += value;
    out.push_back('\0');
  }
  out.push_back('\0');
  return out;
}

std::size_t EnvBlockReader::feed(std::string_view bytes) {
  std::size_t used = 0;
  while (!done_ && used < bytes.size()) {
    const auto nul = bytes.find('\0', used);
    const std::size_t end = nul == std::string_view::npos ? bytes.size() : nul;
    const std::size_t take = end - used + (nul == std::string_view::npos ? 0 : 1);
    if (total_ + take > max_bytes_) {
      block_error("larger than " + std::to_string(max_bytes_) + " bytes without its terminator");
    }
    total_ += take;
    current_.append(bytes.substr(used, end - used));
    used += take;
    if (nul == std::string_view::npos) break;
    if (current_.empty()) {
      done_ = true;
      break;
    }
    const auto eq = current_.find('=');
    if (eq == std::string::npos) block_error("entry '" + current_.substr(0, 64) + "' has no '='");
    std::string name = current_.substr(0, eq);
    if (!is_env_name(name)) block_error("'" + name.substr(0, 64) + "' is not a variable name");
    entries_.emplace_back(std::move(name), current_.substr(eq + 1));
    current_.clear();
  }
  return used;
}

RemoteEnv decode_env_block(std::string_view bytes, std::size_t* consumed, std::size_t max_bytes) {
  EnvBlockReader reader(max_bytes);
  const std::size_t used = reader.feed(bytes);
  if (!reader.done()) block_error("ended after " + std::to_string(bytes.size()) + " bytes, before its terminator");
  if (consumed != nullptr) *consumed = used;
  return reader.entries();
}

EnvBlock read_env_block(int fd, std::size_t max_bytes) {
  EnvBlockReader reader(max_bytes);
  std::array<char, 4096> buf{};
  std::size_t total = 0;
  while (true) {
    const ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      block_error("read failed: " + std::string(std::strerror(err)));
    }
    if (n == 0) block_error("EOF after " + std::to_string(total) + " bytes, before its terminator");
    const std::string_view chunk(buf.data(), static_cast<std::size_t>(n));
    total += chunk.size();
    const std::size_t used = reader.feed(chunk);
    if (reader.done()) return EnvBlock{reader.entries(), std::string(chunk.substr(used))};
  }
}

std::string encode_control_signal(int signo) { return "S" + std::to_string(signo) + "\n"; }

ControlReader::Result ControlReader::feed(std::string_view bytes) {
  constexpr std::size_t kMaxLine = 16;
  Result r;
  for (char c : bytes) {
    if (error_) break;
    if (c != '\n') {
      line_.push_back(c);
      if (line_.size() > kMaxLine) {
        error_ = "control channel: line longer than " + std::to_string(kMaxLine) + " bytes";
      }
      continue;
    }
    const std::string_view digits = line_.size() > 1 ? std::string_view(line_).substr(1) : std::string_view{};
    const bool ok_form = !line_.empty() && line_.front() == 'S' && !digits.empty() && digits.size() <= 3 &&
                         std::all_of(digits.begin(), digits.end(), [](char d) { return d >= '0' && d <= '9'; });
    const auto v = ok_form ? parse_int(digits) : std::nullopt;
    if (!v || *v < 1 || *v > 64) {
      error_ = "control channel: malformed line '" + line_ + "' (expected S<signal number>)";
      break;
    }
    r.signals.push_back(static_cast<int>(*v));
    line_.clear();
  }
  r.error = error_;
  return r;
}

}  // namespace ddprun::agent
