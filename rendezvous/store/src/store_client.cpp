// StoreClient: blocking c10d TCPStore client (see store_client.hpp for the contract).
//
// Design notes (why it looks like this):
//  * One request = one buffer = one send(): the 1.13 client sends the type byte in its own
//    send(), which costs a syscall and, with delayed ACKs, latency. We never do that.
//  * Replies go through a receive buffer: a reply normally arrives in one segment, so one
//    recv() serves it. Plain replies are read with a blocking recv() bounded by SO_RCVTIMEO
//    (= options.timeout, set once per connection) instead of poll()+recv(): one syscall
//    fewer per request. Waits with a caller deadline (wait/get/barrier/queue_pop_wait) use
//    poll() with the exact remaining time.
//  * Modern timeouts: CANCEL_WAIT, then drain (a STOP_WAITING may already be on the way;
//    WAIT_CANCELED always follows it), so the connection stays in sync and usable.
//  * Legacy (1.13) has no CANCEL_WAIT: the server keeps the registration and would later
//    push a stray STOP_WAITING that the next request would take for its own reply (the
//    1.13 client's own bug, protocol §5.1). So on a legacy timeout we drop the connection
//    (which clears the registration on the server) and reconnect.
#include "ddprun/rendezvous/store_client.hpp"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <thread>
#include <utility>

#include "ddprun/common/backoff.hpp"
#include "ddprun/common/error.hpp"
#include "ddprun/rendezvous/bytes.hpp"
#include "ddprun/rendezvous/codec.hpp"
#include "store_connect.hpp"

namespace ddprun::rendezvous {

using namespace store_connect;  // NOLINT: this client's connection helpers
using std::chrono::milliseconds;

namespace {

// Human-readable list of (unprefixed) keys for error messages; at most a few.
std::string keys_text(const std::vector<std::string>& keys) {
  std::string s = "[";
  for (std::size_t i = 0; i < keys.size() && i < 5; ++i) {
    if (i) s += ", ";
    s += "'" + keys[i] + "'";
  }
  if (keys.size() > 5) s += ", ... (" + std::to_string(keys.size()) + " keys)";
  return s + "]";
}

// Small on purpose: replies are mostly a few bytes, a process may hold many clients (a
// 1024-client connect storm), and large values bypass the buffer (read_exact).
constexpr std::size_t recv_buffer_size = 4096;

}  // namespace

struct StoreClient::Impl {
  StoreClientOptions opt;
  std::string where;
  int fd = -1;
  std::string out;
  std::vector<char> rbuf = std::vector<char>(recv_buffer_size);
  std::size_t rpos = 0;
  std::size_t rend = 0;
  std::array<int, 32> codes{};  // Op -> wire byte, -1 when the generation lacks it
  std::uint64_t attempts = 0;
  std::uint64_t connects = 0;
  Op current = Op::ping;
  Request req;  // the request being built; encoded into `out` by the codec

  explicit Impl(StoreClientOptions o) : opt(std::move(o)), where(endpoint_text(opt.host, opt.port)) {
    if (opt.pipelined_get && opt.generation != Generation::modern) {
      throw Error("StoreClientOptions::pipelined_get needs the modern protocol generation",
                  "a 1.13 server closes the connection on a GET of a missing key");
    }
    codes.fill(-1);
    for (unsigned i = 0; i <= static_cast<unsigned>(Op::barrier); ++i) {
      const auto op = static_cast<Op>(i);
      if (auto b = encode_op(opt.generation, op)) codes[i] = *b;
    }
    if (opt.generation == Generation::legacy) codes[static_cast<unsigned>(Op::watch_key)] = -1;
    out.reserve(4096);
  }
  ~Impl() { close_fd(); }
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  void close_fd() {
    if (fd >= 0) ::close(fd);
    fd = -1;
    rpos = rend = 0;
  }

  // ---- connection -------------------------------------------------------------------

  void connect() {
    close_fd();
    const SteadyTime deadline = now() + opt.connect_timeout;
    Backoff backoff({std::chrono::milliseconds(2), std::chrono::milliseconds(1000), 2.0, 0.5});
    std::string last_error = "no attempt made";
    for (;;) {
      ++attempts;
      int s = connect_once(opt.host, opt.port, deadline, opt.timeout, last_error);
      if (s >= 0 && opt.generation == Generation::modern) {
        const std::uint32_t nonce = handshake_nonce();
        const std::string hello = validate_and_ping_bytes(nonce);
        std::array<char, 4> echo{};
        std::string err;
        if (!send_all_raw(s, hello.data(), hello.size(), err) ||
            !recv_exact_raw(s, echo.data(), echo.size(), deadline, err)) {
          last_error = "VALIDATE/PING handshake failed: " + err;
          ::close(s);
          s = -1;
        } else {
          const auto got = bytes::load_le<std::uint32_t>(echo.data());
          if (got != nonce) {
            last_error = "PING echo mismatch (sent " + std::to_string(nonce) + ", got " + std::to_string(got) + ")";
            ::close(s);
            s = -1;
          }
        }
      }
      if (s >= 0) {
        fd = s;
        rpos = rend = 0;
        const bool first = connects++ == 0;
        if (first && opt.add_init_key) add_raw("init/", 1);
        return;
      }
      const SteadyTime t = now();
      if (t >= deadline) {
        std::string hint = "is ddprun-rdzvd running there?";
        if (opt.generation == Generation::modern && last_error.find("handshake") != std::string::npos) {
          hint += " A PyTorch 1.13/2.0 server needs generation=legacy";
        }
        throw NetworkError("could not connect to " + where + " within " + format_duration(opt.connect_timeout) +
                               " (last error: " + last_error + ", " + std::to_string(attempts) + " attempts)",
                           hint);
      }
      const auto left = deadline - t;
      const auto delay = std::min<std::chrono::steady_clock::duration>(backoff.next_delay(), left);
      std::this_thread::sleep_for(delay);
    }
  }

  void ensure_connected() {
    if (fd < 0) connect();
  }

  // ---- request encoding -------------------------------------------------------------

  std::uint8_t code(Op op) const {
    const int c = codes[static_cast<unsigned>(op)];
    if (c < 0) {
      throw Error(std::string(op_name(op)) + " is not supported by the " +
                      (opt.generation == Generation::legacy ? "1.13" : "modern") + " protocol generation (store " +
                      where + ")",
                  "use generation=modern with ddprun-rdzvd or a PyTorch >= 2.5 server");
    }
    return static_cast<std::uint8_t>(c);
  }

  // Starts building a request; checks the op exists before anything is encoded or sent.
  Request& begin(Op op) {
    code(op);
    current = op;
    req.reset(op);
    return req;
  }
  // Appends `req` to `out` (keys get key_prefix unless `raw`); send() = encode and flush.
  void encode(bool raw = false) {
    encode_request(out, opt.generation, req, raw ? std::string_view{} : std::string_view(opt.key_prefix));
  }
  void send(bool raw = false) {
    out.clear();
    encode(raw);
    flush();
  }
  void set_keys(const std::vector<std::string>& keys) {
    for (const auto& k : keys) req.keys.emplace_back(k);
  }

  void check_key(std::string_view key) const {
    const std::size_t n = opt.key_prefix.size() + key.size();
    if (n > opt.limits.max_key_bytes) {
      throw Error("store key '" + std::string(key.substr(0, 64)) + (key.size() > 64 ? "..." : "") + "' is " +
                      std::to_string(n) + " bytes with its prefix, over the limit of " +
                      std::to_string(opt.limits.max_key_bytes) + " bytes",
                  "use a shorter key or raise StoreClientOptions::limits.max_key_bytes (the "
                  "server must allow it too)");
    }
  }
  void check_raw_key(std::string_view key) const {
    if (key.size() > opt.limits.max_key_bytes) {
      throw Error("store key of " + std::to_string(key.size()) + " bytes is over the limit of " +
                      std::to_string(opt.limits.max_key_bytes) + " bytes",
                  "use a shorter key or raise StoreClientOptions::limits.max_key_bytes");
    }
  }
  void check_value(std::string_view value) const {
    if (value.size() > opt.limits.max_value_bytes) {
      throw Error("store value of " + std::to_string(value.size()) + " bytes is over the limit of " +
                      std::to_string(opt.limits.max_value_bytes) + " bytes",
                  "split the value or raise StoreClientOptions::limits.max_value_bytes (the "
                  "server must allow it too)");
    }
  }
  void check_count(std::size_t n) const {
    if (n > opt.limits.max_keys_per_request) {
      throw Error(std::to_string(n) + " keys in one store request is over the limit of " +
                      std::to_string(opt.limits.max_keys_per_request),
                  "split the request or raise StoreClientOptions::limits.max_keys_per_request");
    }
  }
  void check_keys(const std::vector<std::string>& keys) const {
    check_count(keys.size());
    for (const auto& k : keys) check_key(k);
  }

  // ---- I/O --------------------------------------------------------------------------

  [[noreturn]] void fail_network(const std::string& what) {
    close_fd();
    throw NetworkError("store connection to " + where + " failed during " + std::string(op_name(current)) + ": " + what,
                       "the server closes a connection on a malformed or unsupported request; "
                       "the next call reconnects");
  }

  void flush() {
    std::string err;
    if (!send_all_raw(fd, out.data(), out.size(), err)) fail_network(err);
  }

  // Makes at least one more byte available. With a deadline: returns false when it passes
  // first. Without: blocking recv() bounded by SO_RCVTIMEO (options.timeout).
  bool fill(const SteadyTime* deadline) {
    if (rpos == rend) {
      rpos = rend = 0;
    } else if (rend == rbuf.size()) {
      std::memmove(rbuf.data(), rbuf.data() + rpos, rend - rpos);
      rend -= rpos;
      rpos = 0;
    }
    for (;;) {
      if (deadline != nullptr && !wait_fd(fd, POLLIN, *deadline)) return false;
      const ssize_t n = ::recv(fd, rbuf.data() + rend, rbuf.size() - rend, 0);
      if (n > 0) {
        rend += static_cast<std::size_t>(n);
        return true;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && is_would_block(errno) && deadline != nullptr) continue;
      recv_failed(n, errno);
    }
  }

  // A recv() that returned `r` <= 0 with `err`: EOF, SO_RCVTIMEO expiry or a socket error.
  [[noreturn]] void recv_failed(ssize_t r, int err) {
    if (r == 0) fail_network("connection closed by the server");
    if (is_would_block(err)) {
      close_fd();
      throw TimeoutError("no reply from store " + where + " to " + std::string(op_name(current)) + " within " +
                             format_duration(opt.timeout),
                         "the server is overloaded or stuck; the connection was closed and the "
                         "next call reconnects");
    }
    fail_network(errno_text(err));
  }

  void read_exact(char* dst, std::size_t n) {
    while (n > 0) {
      if (rpos == rend && n >= rbuf.size()) {
        // Large value: straight into the destination, no copy through the buffer.
        const ssize_t r = ::recv(fd, dst, n, 0);
        if (r > 0) {
          dst += r;
          n -= static_cast<std::size_t>(r);
          continue;
        }
        if (r < 0 && errno == EINTR) continue;
        recv_failed(r, errno);
      }
      if (rpos == rend) fill(nullptr);
      const std::size_t take = std::min(n, rend - rpos);
      std::memcpy(dst, rbuf.data() + rpos, take);
      rpos += take;
      dst += take;
      n -= take;
    }
  }

  std::uint64_t read_u64() {
    char b[8];
    read_exact(b, 8);
    return bytes::load_le<std::uint64_t>(b);
  }
  std::int64_t read_i64() { return static_cast<std::int64_t>(read_u64()); }
  std::uint32_t read_u32() {
    char b[4];
    read_exact(b, 4);
    return bytes::load_le<std::uint32_t>(b);
  }
  std::uint8_t read_u8() {
    if (rpos == rend) fill(nullptr);
    return static_cast<std::uint8_t>(rbuf[rpos++]);
  }
  std::string read_str() {
    const std::uint64_t len = read_u64();
    const std::uint64_t cap = std::max(opt.limits.max_value_bytes, opt.limits.max_key_bytes);
    if (len > cap) {
      fail_network("reply announces a " + std::to_string(len) + "-byte string, over the " + std::to_string(cap) +
                   "-byte limit (stream out of sync?)");
    }
    std::string s(static_cast<std::size_t>(len), '\0');
    read_exact(s.data(), s.size());
    return s;
  }

  // ---- waits ------------------------------------------------------------------------

  // Sends the request in `req` (a WAIT or BARRIER) and waits for STOP_WAITING until the
  // deadline; on timeout cancels (modern) or reconnects (legacy) and throws TimeoutError.
  void await_stop_waiting(milliseconds timeout, const std::string& what) {
    send();
    const SteadyTime deadline = now() + timeout;
    if (rpos != rend || fill(&deadline)) {
      const std::uint8_t r = read_u8();
      if (r != static_cast<std::uint8_t>(WaitResponse::stop_waiting)) {
        fail_network("expected STOP_WAITING (0), got " + std::to_string(r));
      }
      return;
    }
    const std::string msg = what + " on store " + where + " timed out after " + format_duration(timeout);
    if (opt.generation == Generation::legacy) {
      // See the file comment: a late STOP_WAITING would desynchronise this connection.
      close_fd();
      try {
        connect();
      } catch (const Error&) {
        // Reconnect lazily on the next call; the timeout is what the caller asked about.
      }
      throw TimeoutError(msg, "the keys were not set in time; the connection was re-opened");
    }
    const Op waited = current;
    begin(Op::cancel_wait);
    send();
    std::uint8_t r = read_u8();
    if (r == static_cast<std::uint8_t>(WaitResponse::stop_waiting)) r = read_u8();
    if (r != static_cast<std::uint8_t>(WaitResponse::wait_canceled)) {
      fail_network("expected WAIT_CANCELED (1) after CANCEL_WAIT, got " + std::to_string(r));
    }
    current = waited;
    throw TimeoutError(msg, "the keys were not set in time; the connection remains usable");
  }

  void wait(const std::vector<std::string>& keys, milliseconds timeout) {
    check_keys(keys);
    ensure_connected();
    begin(Op::wait);
    set_keys(keys);
    await_stop_waiting(timeout, "wait for keys " + keys_text(keys));
  }

  std::int64_t add_raw(std::string_view raw_key, std::int64_t delta) {
    check_raw_key(raw_key);
    ensure_connected();
    begin(Op::add);
    req.key = raw_key;
    req.number = delta;
    send(/*raw=*/true);
    return read_i64();
  }
};

// ---- public API ---------------------------------------------------------------------

StoreClient::StoreClient(StoreClientOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {
  impl_->connect();
}
StoreClient::~StoreClient() = default;
StoreClient::StoreClient(StoreClient&&) noexcept = default;
StoreClient& StoreClient::operator=(StoreClient&&) noexcept = default;

const StoreClientOptions& StoreClient::options() const { return impl_->opt; }

void StoreClient::set(std::string_view key, std::string_view value) {
  auto& m = *impl_;
  m.check_key(key);
  m.check_value(value);
  m.ensure_connected();
  m.begin(Op::set);
  m.req.key = key;
  m.req.value = value;
  m.send();
}

std::string StoreClient::get(std::string_view key) { return get(key, impl_->opt.timeout); }

std::string StoreClient::get(std::string_view key, std::chrono::milliseconds timeout) {
  auto& m = *impl_;
  if (m.opt.pipelined_get) {
    m.check_key(key);
    m.ensure_connected();
    m.out.clear();
    m.begin(Op::check).keys.push_back(key);
    m.encode();
    m.begin(Op::get).key = key;
    m.encode();
    m.current = Op::check;
    m.flush();
    const std::uint8_t ready = m.read_u8();
    m.current = Op::get;
    std::string value = m.read_str();
    if (ready == static_cast<std::uint8_t>(CheckResponse::ready)) return value;
    if (ready != static_cast<std::uint8_t>(CheckResponse::not_ready)) {
      m.fail_network("unexpected CHECK reply " + std::to_string(ready));
    }
  }
  m.wait({std::string(key)}, timeout);
  m.begin(Op::get).key = key;
  m.send();
  return m.read_str();
}

std::int64_t StoreClient::add(std::string_view key, std::int64_t delta) {
  auto& m = *impl_;
  m.check_key(key);
  m.ensure_connected();
  m.begin(Op::add);
  m.req.key = key;
  m.req.number = delta;
  m.send();
  return m.read_i64();
}

std::int64_t StoreClient::add_raw(std::string_view raw_key, std::int64_t delta) {
  return impl_->add_raw(raw_key, delta);
}

std::string StoreClient::compare_set(std::string_view key, std::string_view expected, std::string_view desired) {
  auto& m = *impl_;
  m.check_key(key);
  m.check_value(expected);
  m.check_value(desired);
  m.ensure_connected();
  m.begin(Op::compare_set);
  m.req.key = key;
  m.req.value = expected;
  m.req.desired = desired;
  m.send();
  return m.read_str();
}

bool StoreClient::check(const std::vector<std::string>& keys) {
  auto& m = *impl_;
  m.check_keys(keys);
  m.ensure_connected();
  m.begin(Op::check);
  m.set_keys(keys);
  m.send();
  const std::uint8_t r = m.read_u8();
  if (r > 1) m.fail_network("unexpected CHECK reply " + std::to_string(r));
  return r == static_cast<std::uint8_t>(CheckResponse::ready);
}

void StoreClient::wait(const std::vector<std::string>& keys) { impl_->wait(keys, impl_->opt.timeout); }

void StoreClient::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  impl_->wait(keys, timeout);
}

std::int64_t StoreClient::num_keys() {
  auto& m = *impl_;
  m.ensure_connected();
  m.begin(Op::get_num_keys);
  m.send();
  return m.read_i64();
}

bool StoreClient::delete_key(std::string_view key) {
  auto& m = *impl_;
  m.check_key(key);
  m.ensure_connected();
  m.begin(Op::delete_key).key = key;
  m.send();
  return m.read_i64() == 1;
}

void StoreClient::append(std::string_view key, std::string_view value) {
  auto& m = *impl_;
  m.code(Op::append);
  m.check_key(key);
  m.check_value(value);
  m.ensure_connected();
  m.begin(Op::append);
  m.req.key = key;
  m.req.value = value;
  m.send();
}

std::vector<std::string> StoreClient::multi_get(const std::vector<std::string>& keys) {
  auto& m = *impl_;
  m.code(Op::multi_get);
  m.wait(keys, m.opt.timeout);
  m.begin(Op::multi_get);
  m.set_keys(keys);
  m.send();
  std::vector<std::string> values;
  values.reserve(keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) values.push_back(m.read_str());
  return values;
}

void StoreClient::multi_set(const std::vector<std::string>& keys, const std::vector<std::string>& values) {
  auto& m = *impl_;
  m.code(Op::multi_set);
  if (keys.size() != values.size()) {
    throw Error("multi_set got " + std::to_string(keys.size()) + " keys but " + std::to_string(values.size()) +
                " values");
  }
  m.check_keys(keys);
  for (const auto& v : values) m.check_value(v);
  m.ensure_connected();
  m.begin(Op::multi_set);
  m.set_keys(keys);
  for (const auto& v : values) m.req.values.emplace_back(v);
  m.send();
}

void StoreClient::queue_push(std::string_view key, std::string_view value) {
  auto& m = *impl_;
  m.code(Op::queue_push);
  m.check_key(key);
  m.check_value(value);
  m.ensure_connected();
  m.begin(Op::queue_push);
  m.req.key = key;
  m.req.value = value;
  m.send();
}

std::optional<std::string> StoreClient::queue_pop(std::string_view key) {
  auto& m = *impl_;
  m.code(Op::queue_pop);
  m.check_key(key);
  m.ensure_connected();
  m.begin(Op::queue_pop).key = key;
  m.send();
  const std::int64_t n = m.read_i64();
  if (n <= 0) return std::nullopt;
  return m.read_str();
}

std::string StoreClient::queue_pop_wait(std::string_view key, std::chrono::milliseconds timeout) {
  auto& m = *impl_;
  m.code(Op::queue_pop);
  const SteadyTime deadline = now() + timeout;
  for (;;) {
    // WAIT on a queue key completes when the queue is non-empty (protocol §4.14). Another
    // consumer may pop first, so loop until we get an element or run out of time.
    const auto left = std::chrono::ceil<milliseconds>(deadline - now());
    m.wait({std::string(key)}, std::max(left, milliseconds(0)));
    if (auto v = queue_pop(key)) return *std::move(v);
  }
}

std::int64_t StoreClient::queue_len(std::string_view key) {
  auto& m = *impl_;
  m.code(Op::queue_len);
  m.check_key(key);
  m.ensure_connected();
  m.begin(Op::queue_len).key = key;
  m.send();
  return m.read_i64();
}

std::vector<std::string> StoreClient::list_keys() {
  auto& m = *impl_;
  m.code(Op::list_keys);
  m.ensure_connected();
  m.begin(Op::list_keys);
  m.send();
  const std::int64_t n = m.read_i64();
  if (n < 0 || static_cast<std::uint64_t>(n) > std::uint64_t{1} << 32) {
    m.fail_network("LIST_KEYS reply announces " + std::to_string(n) + " keys");
  }
  std::vector<std::string> keys;
  const std::string& prefix = m.opt.key_prefix;
  for (std::int64_t i = 0; i < n; ++i) {
    std::string k = m.read_str();
    if (k.compare(0, prefix.size(), prefix) == 0 && k.size() >= prefix.size()) {
      keys.push_back(k.substr(prefix.size()));
    }
  }
  std::sort(keys.begin(), keys.end());
  return keys;
}

void StoreClient::barrier(std::string_view key, std::int64_t world_size, std::chrono::milliseconds timeout) {
  auto& m = *impl_;
  m.code(Op::barrier);
  m.check_key(key);
  m.ensure_connected();
  m.begin(Op::barrier);
  m.req.key = key;
  m.req.number = world_size;
  m.await_stop_waiting(timeout, "barrier '" + std::string(key) + "' (world size " + std::to_string(world_size) + ")");
}

std::uint32_t StoreClient::ping(std::uint32_t nonce) {
  auto& m = *impl_;
  m.code(Op::ping);
  m.ensure_connected();
  m.begin(Op::ping).u32 = nonce;
  m.send();
  return m.read_u32();
}

std::uint64_t StoreClient::connect_attempts() const { return impl_->attempts; }
std::uint64_t StoreClient::reconnects() const { return impl_->connects > 0 ? impl_->connects - 1 : 0; }

}  // namespace ddprun::rendezvous
