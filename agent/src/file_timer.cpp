// torch's file-based worker watchdog, agent side; see file_timer.hpp.
#include "ddprun/agent/file_timer.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <boost/json.hpp>
#include <algorithm>
#include <csignal>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <spdlog/spdlog.h>

#include "ddprun/agent/exit_status.hpp"
#include "ddprun/common/error.hpp"
#include "ddprun/common/rate_limited_warning.hpp"
#include "ddprun/common/strings.hpp"

namespace json = boost::json;

namespace ddprun::agent {

namespace {
constexpr std::size_t kMaxScopeId = 256;
}  // namespace

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
  // Range checks before any cast: a double outside the target type's range is undefined to cast.
  auto integral_in = [](double x, double lo, double hi) {
    return std::isfinite(x) && x >= lo && x <= hi && static_cast<double>(static_cast<std::int64_t>(x)) == x;
  };
  if (!pid || !integral_in(*pid, 1, std::numeric_limits<int>::max()))
    return fail("no \"pid\" in 1.." + std::to_string(std::numeric_limits<int>::max()));
  if (!expiration || !std::isfinite(*expiration)) return fail("no finite numeric \"expiration_time\"");
  if (scope == nullptr || !scope->is_string()) return fail("no string \"scope_id\"");
  if (scope->as_string().size() > kMaxScopeId)
    return fail("\"scope_id\" longer than " + std::to_string(kMaxScopeId) + " bytes");
  if (sig && !integral_in(*sig, 0, SIGRTMAX)) return fail("\"signal\" not in 0.." + std::to_string(SIGRTMAX));
  r.pid = static_cast<pid_t>(*pid);
  r.expiration_time = *expiration;
  r.scope_id = json::value_to<std::string>(*scope);
  r.signal = sig ? static_cast<int>(*sig) : 0;
  if (const auto version = number("version"); version && integral_in(*version, 0, 1000000))
    r.version = static_cast<int>(*version);
  return r;
}

FileTimerTable::Applied FileTimerTable::apply(const TimerRequest& request) {
  auto it = timers_.find(Key(request.pid, request.scope_id));
  if (request.expiration_time < 0) {
    if (it != timers_.end()) erase(it);
    return Applied::ok;
  }
  if (it != timers_.end()) {
    deadlines_.erase({it->second.expiration_time, request.pid, request.scope_id});
    it->second = request;
  } else {
    // find, not []: a refused request must not leave an entry behind (a writer naming a new pid
    // on each line would grow the map without bound).
    if (const auto count = per_pid_.find(request.pid); count != per_pid_.end() && count->second >= kMaxPerPid)
      return Applied::too_many_for_pid;
    if (timers_.size() >= kMaxTimers) return Applied::table_full;
    timers_.emplace(Key(request.pid, request.scope_id), request);
    ++per_pid_[request.pid];
  }
  deadlines_.emplace(request.expiration_time, request.pid, request.scope_id);
  return Applied::ok;
}

void FileTimerTable::erase(std::map<Key, TimerRequest>::iterator it) {
  deadlines_.erase({it->second.expiration_time, it->first.first, it->first.second});
  const auto count = per_pid_.find(it->first.first);
  if (count != per_pid_.end() && --count->second == 0) per_pid_.erase(count);
  timers_.erase(it);
}

std::vector<FileTimerTable::Reap> FileTimerTable::take_expired(double now) {
  // Only the expired entries and the timers of their pids are visited, never the whole table.
  std::set<pid_t> pids;
  for (auto d = deadlines_.begin(); d != deadlines_.end() && std::get<0>(*d) <= now; ++d) pids.insert(std::get<1>(*d));
  std::vector<Reap> out;
  for (const pid_t pid : pids) {
    std::vector<const TimerRequest*> list;
    for (auto it = timers_.lower_bound(Key(pid, std::string())); it != timers_.end() && it->first.first == pid; ++it) {
      if (it->second.expiration_time <= now) list.push_back(&it->second);
    }
    std::sort(list.begin(), list.end(),
              [](const TimerRequest* a, const TimerRequest* b) { return a->expiration_time < b->expiration_time; });
    Reap reap{pid, 0, list.front()->scope_id, list.front()->expiration_time};
    for (const auto* t : list) {
      if (t->signal > 0) {
        reap = Reap{pid, t->signal, t->scope_id, t->expiration_time};
        break;
      }
    }
    out.push_back(reap);
    clear_pid(pid);
  }
  return out;
}

std::optional<double> FileTimerTable::next_deadline() const {
  if (deadlines_.empty()) return std::nullopt;
  return std::get<0>(*deadlines_.begin());
}

void FileTimerTable::clear_pid(pid_t pid) {
  for (auto it = timers_.lower_bound(Key(pid, std::string())); it != timers_.end() && it->first.first == pid;) {
    erase(it++);
  }
}

void FileTimerTable::clear() {
  timers_.clear();
  deadlines_.clear();
  per_pid_.clear();
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
  const std::string fix =
      "set TORCHELASTIC_TIMER_FILE to a new path in a writable directory (or unset it), or unset "
      "TORCHELASTIC_ENABLE_FILE_TIMER";
  struct stat st {};
  if (::lstat(path_.c_str(), &st) == 0) {
    if (!S_ISFIFO(st.st_mode)) {
      throw Error(
          "TORCHELASTIC_TIMER_FILE=" + path_ + " names an existing file that is not a FIFO; refusing to replace it",
          fix);
    }
    // A FIFO somebody reads (open for writing succeeds) belongs to a live agent: leave it. Only
    // ENXIO says that nobody does; any other failure (another user's FIFO: EACCES; a symbolic
    // link put there since: ELOOP) is no proof that it is stale.
    const int probe = ::open(path_.c_str(), O_WRONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
    if (probe >= 0) {
      ::close(probe);
      throw Error("TORCHELASTIC_TIMER_FILE=" + path_ + " is a FIFO another process (another job's agent?) is reading",
                  "give each job its own TORCHELASTIC_TIMER_FILE, or unset it for a fresh /tmp/watchdog_timer_<uuid>");
    }
    if (errno != ENXIO) {
      throw Error("TORCHELASTIC_TIMER_FILE=" + path_ + " names an existing FIFO ddprun cannot check (" +
                      std::strerror(errno) + "); refusing to replace it",
                  fix);
    }
    ::unlink(path_.c_str());  // a stale FIFO nobody reads, as torch replaces it
  }
  if (::mkfifo(path_.c_str(), 0600) != 0) {
    throw Error("cannot create the file-timer FIFO " + path_ + ": " + std::strerror(errno), fix);
  }
  // Both ends by the path, never through a symbolic link, and checked to be the FIFO this agent
  // owns, the same for both: in a directory others can write to, the path could be replaced
  // between the mkfifo and the opens.
  const int rfd = ::open(path_.c_str(), O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
  keeper_fd_ = rfd < 0 ? -1 : ::open(path_.c_str(), O_WRONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
  struct stat made {};
  struct stat kept {};
  std::string why;
  if (rfd < 0 || keeper_fd_ < 0 || ::fstat(rfd, &made) != 0 || ::fstat(keeper_fd_, &kept) != 0) {
    why = std::strerror(errno);
  } else if (!S_ISFIFO(made.st_mode) || made.st_uid != ::geteuid() || made.st_dev != kept.st_dev ||
             made.st_ino != kept.st_ino) {
    why = "the path was replaced while it was opened";
  }
  if (!why.empty()) {
    if (rfd >= 0) ::close(rfd);
    if (keeper_fd_ >= 0) ::close(keeper_fd_);
    keeper_fd_ = -1;
    // Only what this agent made: not a file put there since.
    struct stat st2 {};
    if (rfd >= 0 && S_ISFIFO(made.st_mode) && ::lstat(path_.c_str(), &st2) == 0 && st2.st_dev == made.st_dev &&
        st2.st_ino == made.st_ino) {
      ::unlink(path_.c_str());
    }
    throw Error("cannot open the file-timer FIFO " + path_ + ": " + why, fix);
  }
  fifo_dev_ = made.st_dev;
  fifo_ino_ = made.st_ino;
  reader_.assign(rfd);
}

FileTimerServer::~FileTimerServer() {
  flush_warnings();
  boost::system::error_code ignored;
  timer_.cancel();
  reader_.close(ignored);
  if (keeper_fd_ >= 0) ::close(keeper_fd_);
  // Only our own FIFO: the path may have been replaced since (by a user, or another job).
  struct stat st {};
  if (::lstat(path_.c_str(), &st) == 0 && st.st_dev == fifo_dev_ && st.st_ino == fifo_ino_) ::unlink(path_.c_str());
}

void FileTimerServer::reset() {
  flush_warnings();
  table_.clear();
  rearm();
}

void FileTimerServer::drop_pid(pid_t pid) {
  table_.clear_pid(pid);
  rearm();
}

void FileTimerServer::warn_limited(const std::string& message) { ignored_.warn("file timer: {}", message); }

void FileTimerServer::flush_warnings() {
  // Counts of lines not shown that no later line carried: said before they are lost.
  ignored_.flush(spdlog::level::warn, "file timer: lines and timers ignored");
  expired_quietly_.flush(spdlog::level::warn, "file timer: scopes expired without a signal");
  expired_killed_.flush(spdlog::level::err, "file timer: scopes expired and their workers killed");
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
      // The end of a line cut for its length is not a line of its own.
      if (!skipping_) on_line(std::string_view(partial_).substr(start, nl - start));
      skipping_ = false;
    }
    partial_.erase(0, start);
    if (partial_.size() > 65536) {  // a writer that never ends its line: the rest of it is dropped too
      warn_limited("ignoring a line in " + path_ + " longer than 64 KiB");
      partial_.clear();
      skipping_ = true;
    }
    rearm();
    read();
  });
}

void FileTimerServer::on_line(std::string_view line) {
  if (line.find_first_not_of(" \t\r") == std::string_view::npos) return;
  std::string problem;
  const auto request = parse_timer_request(line, &problem);
  if (!request) {
    warn_limited("ignoring a line in " + path_ + ": " + problem + ": " + terminal_safe_prefix(line, 200));
    return;
  }
  ++requests_;
  switch (table_.apply(*request)) {
    case FileTimerTable::Applied::ok:
      break;
    case FileTimerTable::Applied::too_many_for_pid:
      warn_limited("ignoring timer '" + terminal_safe_prefix(request->scope_id, 64) + "' of pid " +
                   std::to_string(request->pid) + ": that pid already holds " +
                   std::to_string(FileTimerTable::kMaxPerPid) + " timers; release timers the worker no longer needs");
      break;
    case FileTimerTable::Applied::table_full:
      warn_limited("ignoring timer '" + terminal_safe_prefix(request->scope_id, 64) + "' of pid " +
                   std::to_string(request->pid) + ": " + std::to_string(FileTimerTable::kMaxTimers) +
                   " timers are armed; release timers the workers no longer need");
      break;
  }
}

void FileTimerServer::rearm() {
  const auto next = table_.next_deadline();
  if (!next) {
    timer_.cancel();
    return;
  }
  // Clamped to a day: a far deadline (expiration_time 1e300) would overflow the clock, land in
  // the past and spin. The timer fires, finds nothing expired and waits again.
  constexpr double kMaxWait = 24.0 * 3600.0;
  const double wait = std::clamp(*next - unix_now(), 0.0, kMaxWait);
  // Rounded up by hand: std::ceil would be bin/ddprun's only use of libm.
  const double wait_us = wait * 1e6;
  auto us = static_cast<std::int64_t>(wait_us);
  if (static_cast<double>(us) < wait_us) ++us;
  timer_.expires_after(std::chrono::microseconds(us));
  timer_.async_wait([this](const boost::system::error_code& ec) {
    if (!ec) on_deadline();
  });
}

void FileTimerServer::on_deadline() {
  for (const auto& reap : table_.take_expired(unix_now())) {
    if (reap.signal <= 0) {
      expired_quietly_.warn("file timer: scope '{}' of pid {} expired without a signal; not killing it",
                            terminal_safe_prefix(reap.scope_id, 64), reap.pid);
      continue;
    }
    if (killer_(reap.pid, reap.signal)) {
      expired_killed_.log(spdlog::level::err, "file timer: scope '{}' of worker pid {} expired; killing it with {}",
                          terminal_safe_prefix(reap.scope_id, 64), reap.pid, signal_name(reap.signal));
    }
  }
  rearm();
}

bool kill_timer_pid(pid_t pid, int signal, const std::function<bool(pid_t)>& member) {
  // A worker can repeat the refused requests below as fast as it writes: one line a second, with
  // a count (it flooded the agent's stderr with 58,000 lines in 8 s).
  static RateLimitedWarning refused;
  // A request names any pid; never signal the agent itself, init or a process group.
  if (pid <= 1 || pid == ::getpid()) {
    refused.warn("file timer: refusing to signal pid {}", pid);
    return false;
  }
  // Pin the process first: if `pid` is recycled after the membership check, the pidfd still
  // names the process that was checked (then gone: ESRCH), never the newcomer.
  const int fd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  if (fd < 0 && errno == ESRCH) return false;  // gone already
  if (fd < 0 && (errno == EMFILE || errno == ENFILE || errno == ENOMEM)) {
    refused.warn("file timer: not signalling pid {}: cannot pin it with a pidfd ({})", pid, std::strerror(errno));
    return false;
  }
  // Where there are no pidfds (ENOSYS before Linux 5.3, EPERM from a seccomp filter): kill() by
  // number below, with the recycling window pidfds close.
  if (!member(pid)) {
    if (fd >= 0) ::close(fd);
    refused.warn("file timer: not signalling pid {}: it is not a live process of this attempt's workers", pid);
    return false;
  }
  if (fd < 0) return ::kill(pid, signal) == 0;
  const bool ok = ::syscall(SYS_pidfd_send_signal, fd, signal, nullptr, 0) == 0;
  ::close(fd);
  return ok;
}

std::unique_ptr<FileTimerServer> start_file_timer(boost::asio::io_context& io, const AgentConfig& config,
                                                  worker_env::EnvMap& parent_env, FileTimerServer::Killer killer) {
  if (!config.file_timer) return nullptr;
  const std::string path = config.file_timer_path.empty() ? default_timer_file() : config.file_timer_path;
  auto server = std::make_unique<FileTimerServer>(io, path, std::move(killer));
  parent_env["TORCHELASTIC_TIMER_FILE"] = path;  // torch's agent propagates it to every worker
  server->start();
  return server;
}

}  // namespace ddprun::agent
