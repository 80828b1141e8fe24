// torch's file-based worker watchdog, agent side; see file_timer.hpp.
#include "ddprun/agent/file_timer.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <boost/json.hpp>
#include <algorithm>
#include <csignal>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <spdlog/spdlog.h>

#include "ddprun/agent/exit_status.hpp"
#include "ddprun/common/error.hpp"

namespace json = boost::json;

namespace ddprun::agent {

std::optional<TimerRequest> parse_timer_request(std::string_view line, std::string* problem) {
  auto fail = [&](std::string why) -> std::optional<TimerRequest> {
    if (problem != nullptr) *problem = std::move(why);
    return std::nullopt;
  };
  boost::system::error_code ec;
  const json::value v = json::parse(json::string_view(line.data(), line.size()), ec);
  if (ec) return fail("not valid JSON: " + ec.message());
  if (!v.is_object()) return fail("not a JSON object");
  const auto& o = v.as_object();
  auto number = [&](const char* key) -> std::optional<double> {
    const auto* f = o.if_contains(key);
    if (f == nullptr) return std::nullopt;
    if (f->is_int64()) return static_cast<double>(f->as_int64());
    if (f->is_uint64()) return static_cast<double>(f->as_uint64());
    if (f->is_double()) return f->as_double();
    return std::nullopt;
  };
  TimerRequest r;
  const auto pid = number("pid");
  const auto expiration = number("expiration_time");
  const auto sig = number("signal");
  const auto* scope = o.if_contains("scope_id");
  if (!pid || *pid <= 0) return fail("no positive \"pid\"");
  if (!expiration || !std::isfinite(*expiration)) return fail("no numeric \"expiration_time\"");
  if (scope == nullptr || !scope->is_string()) return fail("no string \"scope_id\"");
  r.pid = static_cast<pid_t>(*pid);
  r.expiration_time = *expiration;
  r.scope_id = json::value_to<std::string>(*scope);
  r.signal = sig ? static_cast<int>(*sig) : 0;
  if (const auto version = number("version")) r.version = static_cast<int>(*version);
  return r;
}

void FileTimerTable::apply(const TimerRequest& request) {
  const auto key = std::make_pair(request.pid, request.scope_id);
  if (request.expiration_time < 0) {
    timers_.erase(key);
  } else {
    timers_[key] = request;
  }
}

std::vector<FileTimerTable::Reap> FileTimerTable::take_expired(double now) {
  std::map<pid_t, std::vector<TimerRequest>> expired;
  for (const auto& [key, t] : timers_) {
    if (t.expiration_time <= now) expired[key.first].push_back(t);
  }
  std::vector<Reap> out;
  for (auto& [pid, list] : expired) {
    std::sort(list.begin(), list.end(),
              [](const TimerRequest& a, const TimerRequest& b) { return a.expiration_time < b.expiration_time; });
    Reap reap{pid, 0, list.front().scope_id, list.front().expiration_time};
    for (const auto& t : list) {
      if (t.signal > 0) {
        reap = Reap{pid, t.signal, t.scope_id, t.expiration_time};
        break;
      }
    }
    out.push_back(reap);
    clear_pid(pid);
  }
  return out;
}

std::optional<double> FileTimerTable::next_deadline() const {
  std::optional<double> best;
  for (const auto& [key, t] : timers_) {
    if (!best || t.expiration_time < *best) best = t.expiration_time;
  }
  return best;
}

void FileTimerTable::clear_pid(pid_t pid) {
  for (auto it = timers_.begin(); it != timers_.end();) {
    it = it->first.first == pid ? timers_.erase(it) : std::next(it);
  }
}

namespace {

double unix_now() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

}  // namespace

std::string default_timer_file() {
  std::random_device rd;
  std::mt19937_64 gen((static_cast<std::uint64_t>(rd()) << 32U) ^ rd());
  const std::uint64_t a = gen();
  const std::uint64_t b = gen();
  char buf[64];
  std::snprintf(buf, sizeof buf, "%08x-%04x-4%03x-%04x-%012llx", static_cast<unsigned>(a >> 32U),
                static_cast<unsigned>((a >> 16U) & 0xffffU), static_cast<unsigned>(a & 0xfffU),
                static_cast<unsigned>(0x8000U | ((b >> 48U) & 0x3fffU)),
                static_cast<unsigned long long>(b & 0xffffffffffffULL));
  return std::string("/tmp/watchdog_timer_") + buf;
}

FileTimerServer::FileTimerServer(boost::asio::io_context& io, std::string path, Killer killer)
    : path_(std::move(path)), killer_(std::move(killer)), reader_(io), timer_(io) {
  ::unlink(path_.c_str());
  if (::mkfifo(path_.c_str(), 0600) != 0) {
    throw Error(
        "cannot create the file-timer FIFO " + path_ + ": " + std::strerror(errno),
        "set TORCHELASTIC_TIMER_FILE to a path in a writable directory, or unset TORCHELASTIC_ENABLE_FILE_TIMER");
  }
  const int rfd = ::open(path_.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  keeper_fd_ = rfd < 0 ? -1 : ::open(path_.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
  if (rfd < 0 || keeper_fd_ < 0) {
    const std::string why = std::strerror(errno);
    if (rfd >= 0) ::close(rfd);
    ::unlink(path_.c_str());
    throw Error("cannot open the file-timer FIFO " + path_ + ": " + why);
  }
  reader_.assign(rfd);
}

FileTimerServer::~FileTimerServer() {
  boost::system::error_code ignored;
  timer_.cancel();
  reader_.close(ignored);
  if (keeper_fd_ >= 0) ::close(keeper_fd_);
  ::unlink(path_.c_str());
}

void FileTimerServer::start() {
  spdlog::info("file timer: serving torch's FileTimerClient at {} (TORCHELASTIC_TIMER_FILE)", path_);
  read();
}

void FileTimerServer::read() {
  reader_.async_read_some(boost::asio::buffer(buf_), [this](const boost::system::error_code& ec, std::size_t n) {
    if (ec) {
      if (ec != boost::asio::error::operation_aborted)
        spdlog::warn("file timer: reading {} failed: {}", path_, ec.message());
      return;
    }
    partial_.append(buf_.data(), n);
    std::size_t start = 0;
    for (std::size_t nl; (nl = partial_.find('\n', start)) != std::string::npos; start = nl + 1) {
      on_line(std::string_view(partial_).substr(start, nl - start));
    }
    partial_.erase(0, start);
    if (partial_.size() > 65536) partial_.clear();  // a writer that never ends its line
    rearm();
    read();
  });
}

void FileTimerServer::on_line(std::string_view line) {
  if (line.find_first_not_of(" \t\r") == std::string_view::npos) return;
  std::string problem;
  const auto request = parse_timer_request(line, &problem);
  if (!request) {
    spdlog::warn("file timer: ignoring a line in {}: {}: {}", path_, problem, std::string(line.substr(0, 200)));
    return;
  }
  ++requests_;
  table_.apply(*request);
}

void FileTimerServer::rearm() {
  const auto next = table_.next_deadline();
  if (!next) {
    timer_.cancel();
    return;
  }
  const double wait = std::max(0.0, *next - unix_now());
  timer_.expires_after(std::chrono::microseconds(static_cast<std::int64_t>(std::ceil(wait * 1e6))));
  timer_.async_wait([this](const boost::system::error_code& ec) {
    if (!ec) on_deadline();
  });
}

void FileTimerServer::on_deadline() {
  for (const auto& reap : table_.take_expired(unix_now())) {
    if (reap.signal <= 0) {
      spdlog::warn("file timer: scope '{}' of pid {} expired without a signal; not killing it", reap.scope_id,
                   reap.pid);
      continue;
    }
    spdlog::error("file timer: scope '{}' of worker pid {} expired; killing it with {}", reap.scope_id, reap.pid,
                  signal_name(reap.signal));
    if (!killer_(reap.pid, reap.signal)) spdlog::info("file timer: pid {} is already gone", reap.pid);
  }
  rearm();
}

bool kill_timer_pid(pid_t pid, int signal) {
  // A request names any pid; never signal the agent itself, init or a process group.
  if (pid <= 1 || pid == ::getpid()) {
    spdlog::warn("file timer: refusing to signal pid {}", pid);
    return false;
  }
  return ::kill(pid, signal) == 0;
}

std::unique_ptr<FileTimerServer> start_file_timer(boost::asio::io_context& io, const AgentConfig& config,
                                                  worker_env::EnvMap& parent_env) {
  if (!config.file_timer) return nullptr;
  const std::string path = config.file_timer_path.empty() ? default_timer_file() : config.file_timer_path;
  auto server = std::make_unique<FileTimerServer>(io, path, kill_timer_pid);
  parent_env["TORCHELASTIC_TIMER_FILE"] = path;  // torch's agent propagates it to every worker
  server->start();
  return server;
}

}  // namespace ddprun::agent
