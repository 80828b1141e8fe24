// StoreState: TCPStore semantics (docs/protocol.md §"Operations"); see store_state.hpp.
#include "ddprun/rendezvous/store_state.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <limits>
#include <unordered_set>

namespace ddprun::rendezvous {
namespace {

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r'; }

// Keys are opaque bytes: show at most 80 of them, escaping what is not printable ASCII.
std::string printable(std::string_view key) {
  std::string s;
  const std::size_t n = std::min<std::size_t>(key.size(), 80);
  for (std::size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(key[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      s.push_back(static_cast<char>(c));
    } else {
      s += fmt::format("\\x{:02x}", c);
    }
  }
  if (key.size() > n) s += "...";
  return s;
}

}  // namespace

std::optional<std::int64_t> parse_counter(std::string_view text) {
  // Like strtoll on the C string: stops at an embedded NUL as well as at any non-digit.
  std::size_t i = 0;
  while (i < text.size() && is_space(text[i])) ++i;
  bool negative = false;
  if (i < text.size() && (text[i] == '+' || text[i] == '-')) {
    negative = text[i] == '-';
    ++i;
  }
  const std::uint64_t limit = negative ? std::uint64_t{1} << 63 : (std::uint64_t{1} << 63) - 1;
  std::uint64_t magnitude = 0;
  std::size_t digits = 0;
  for (; i < text.size() && text[i] >= '0' && text[i] <= '9'; ++i, ++digits) {
    const auto d = static_cast<std::uint64_t>(text[i] - '0');
    if (magnitude > (limit - d) / 10) return std::nullopt;  // out of range: stoll throws
    magnitude = magnitude * 10 + d;
  }
  if (digits == 0) return std::nullopt;
  if (negative) return static_cast<std::int64_t>(~magnitude + 1);
  return static_cast<std::int64_t>(magnitude);
}

StoreState::StoreState(StoreLimits limits) : limits_(limits) {}

std::optional<std::string_view> StoreState::value(std::string_view key) const {
  auto it = kv_.find(key);
  if (it == kv_.end()) return std::nullopt;
  return std::string_view(it->second);
}

bool StoreState::exists(std::string_view key) const {
  if (kv_.find(key) != kv_.end()) return true;
  auto q = queues_.find(key);
  return q != queues_.end() && !q->second.empty();
}

ApplyResult StoreState::too_big(std::string_view key, std::size_t extra) const {
  return {false, fmt::format("writing {} bytes to key '{}' would exceed the store's total of {} bytes "
                             "(--max-total-bytes; {} bytes held now)",
                             extra, printable(key), limits_.max_total_bytes, bytes_)};
}

bool StoreState::can_register(ApplyResult& res, Op op, std::size_t n, std::size_t key_bytes) const {
  key_bytes *= 2;  // each registration keeps its key twice: per key and per connection
  if (registrations_ + n > limits_.max_waits) {
    res = {false, fmt::format("{} would add {} wait registration(s) to the {} held; the limit is {} (--max-waits)",
                              op_name(op), n, registrations_, limits_.max_waits)};
    return false;
  }
  if (registered_bytes_ + key_bytes > limits_.max_total_bytes) {
    res = {false, fmt::format("{} would copy {} key bytes into wait registrations holding {} already; the limit is "
                              "{} (--max-total-bytes)",
                              op_name(op), key_bytes, registered_bytes_, limits_.max_total_bytes)};
    return false;
  }
  return true;
}

StoreState::Held StoreState::held_by(ConnectionId conn) const {
  Held h;
  if (auto a = awaited_.find(conn); a != awaited_.end()) {
    h.count += a->second.keys.size();
    for (const auto& [k, seq] : a->second.keys) h.bytes += 2 * k.size();
  }
  if (auto w = watched_.find(conn); w != watched_.end()) {
    h.count += w->second.size();
    for (const auto& k : w->second) h.bytes += 2 * k.size();
  }
  return h;
}

bool StoreState::make_room(ApplyResult& res, ConnectionId conn, Op op, std::size_t n, std::size_t key_bytes,
                           Outbox& outbox) {
  if (can_register(res, op, n, key_bytes)) return true;
  // The table is full (in registrations, or in their key bytes: each holds its key twice). The
  // connections holding more than this one would after its request give way, largest first, in
  // the measure that is short; nobody is shed unless that makes room.
  const bool count_short = registrations_ + n > limits_.max_waits;
  const bool bytes_short = registered_bytes_ + 2 * key_bytes > limits_.max_total_bytes;
  Held mine = held_by(conn);
  mine.count += n;
  mine.bytes += 2 * key_bytes;
  std::vector<std::pair<ConnectionId, Held>> larger;
  std::unordered_set<ConnectionId> seen;  // (a connection may both wait and watch)
  const auto consider = [&](ConnectionId c) {
    if (c == conn || !seen.insert(c).second) return;
    const Held h = held_by(c);
    if ((!count_short || h.count > mine.count) && (!bytes_short || h.bytes > mine.bytes)) larger.emplace_back(c, h);
  };
  for (const auto& [c, a] : awaited_) consider(c);
  for (const auto& [c, w] : watched_) consider(c);
  std::sort(larger.begin(), larger.end(), [&](const auto& x, const auto& y) {
    return bytes_short && !count_short ? x.second.bytes > y.second.bytes : x.second.count > y.second.count;
  });
  std::size_t count = registrations_;
  std::size_t bytes = registered_bytes_;
  std::size_t plan = 0;
  const auto fits = [&] { return count + n <= limits_.max_waits && bytes + 2 * key_bytes <= limits_.max_total_bytes; };
  while (!fits() && plan < larger.size()) {
    count -= larger[plan].second.count;
    bytes -= larger[plan].second.bytes;
    ++plan;
  }
  if (!fits()) return false;  // `res` says which limit: can_register's refusal
  const std::string limit = count_short ? "--max-waits" : "--max-total-bytes";
  for (std::size_t i = 0; i < plan; ++i) {
    const auto& [victim, held] = larger[i];
    if (!outbox.shed(victim, fmt::format("it holds {} wait registrations ({} key bytes), more than the requesting "
                                         "connection would, and the store's are taken ({}); a {} of another client "
                                         "needed room",
                                         held.count, held.bytes, limit, op_name(op)))) {
      return false;
    }
    disconnect(victim);  // its registrations go now; the server closes it after this request
  }
  res = {};
  return can_register(res, op, n, key_bytes);
}

bool StoreState::can_add_entry(ApplyResult& res, std::string_view key) const {
  if (entries() < limits_.max_keys) return true;
  res = {false, fmt::format("creating key '{}' would pass the store's limit of {} keys and queued items (--max-keys)",
                            printable(key), limits_.max_keys)};
  return false;
}

bool StoreState::reply_fits(ApplyResult& res, ConnectionId conn, Op op, std::size_t size, Outbox& outbox) const {
  const std::size_t room = outbox.reply_room(conn);
  if (size <= room) return true;
  res = {false, fmt::format("{} reply of {} bytes refused: the connection may queue only {} more reply bytes "
                            "(--max-queued-reply-bytes {})",
                            op_name(op), size, room, limits_.max_queued_reply_bytes)};
  return false;
}

bool StoreState::store(ApplyResult& res, std::string_view key, std::string_view value, Outbox& outbox) {
  auto it = kv_.find(key);
  if (it != kv_.end()) {
    const std::size_t after = bytes_ - it->second.size() + value.size();
    if (value.size() > it->second.size() && after > limits_.max_total_bytes) {
      res = too_big(key, value.size());
      return false;
    }
    if (!watchers_.empty()) notify_watchers(key, WatchResponse::key_updated, it->second, value, outbox);
    it->second.assign(value);
    bytes_ = after;
  } else {
    const std::size_t extra = key.size() + value.size();
    if (bytes_ + extra > limits_.max_total_bytes) {
      res = too_big(key, extra);
      return false;
    }
    if (!can_add_entry(res, key)) return false;
    kv_.emplace(std::string(key), std::string(value));
    bytes_ += extra;
    if (!watchers_.empty()) notify_watchers(key, WatchResponse::key_created, {}, value, outbox);
  }
  wake_all(key, outbox);
  return true;
}

void StoreState::notify_watchers(std::string_view key, WatchResponse type, std::string_view old_value,
                                 std::string_view new_value, Outbox& outbox, std::string_view new_tail) {
  auto it = watchers_.find(key);
  if (it == watchers_.end()) return;
  const std::size_t size = 1 + 3 * 8 + key.size() + old_value.size() + new_value.size() + new_tail.size();
  for (const auto& [c, times] : it->second) {
    for (std::uint32_t i = 0; i < times; ++i) {
      // Refused: the outbox closes `c` (it does not read its events); nothing more for it.
      if (!outbox.reserve_push(c, size)) break;
      reply::watch_event(outbox.buffer(c), type, key, old_value, new_value, new_tail);
    }
  }
}

void StoreState::register_wait(ConnectionId conn, std::string_view key) {
  auto it = waiters_.find(key);
  if (it == waiters_.end()) it = waiters_.try_emplace(std::string(key)).first;
  const std::uint64_t seq = next_wait_++;
  it->second.emplace_hint(it->second.end(), seq, conn);
  awaited_[conn].keys.emplace_back(std::string(key), seq);
  ++registrations_;
  registered_bytes_ += 2 * key.size();
}

void StoreState::satisfy(ConnectionId conn, Outbox& outbox) {
  reply::wait(outbox.buffer(conn), WaitResponse::stop_waiting);
  drop_waits(conn);
}

void StoreState::wake_all(std::string_view key, Outbox& outbox) {
  if (waiters_.empty()) return;
  auto it = waiters_.find(key);
  if (it == waiters_.end()) return;
  const std::map<std::uint64_t, ConnectionId> registered = std::move(it->second);
  waiters_.erase(it);
  for (const auto& [seq, c] : registered) {
    auto a = awaited_.find(c);
    if (a == awaited_.end()) continue;  // already satisfied by an earlier registration
    if (--a->second.missing <= 0) satisfy(c, outbox);
  }
}

void StoreState::wake_one(std::string_view key, Outbox& outbox) {
  // Oldest registration first, as torch's libuv server does: each one taken counts for its
  // waiter; the first waiter with nothing left to wait for is woken, and only one is. A waiter
  // that still misses another key does not swallow the push.
  for (;;) {
    auto it = waiters_.find(key);
    if (it == waiters_.end()) return;
    if (it->second.empty()) {
      waiters_.erase(it);
      return;
    }
    const ConnectionId c = it->second.begin()->second;
    it->second.erase(it->second.begin());
    if (it->second.empty()) waiters_.erase(it);
    auto a = awaited_.find(c);
    if (a == awaited_.end()) continue;
    if (--a->second.missing <= 0) {
      satisfy(c, outbox);
      return;
    }
  }
}

void StoreState::drop_waits(ConnectionId conn) {
  auto a = awaited_.find(conn);
  if (a == awaited_.end()) return;
  for (const auto& [k, seq] : a->second.keys) {
    registered_bytes_ -= 2 * k.size();
    auto it = waiters_.find(k);
    if (it == waiters_.end()) continue;
    it->second.erase(seq);
    if (it->second.empty()) waiters_.erase(it);
  }
  registrations_ -= a->second.keys.size();
  awaited_.erase(a);
}

ApplyResult StoreState::add(ConnectionId conn, std::string_view key, std::int64_t delta, std::int64_t& result,
                            Outbox& outbox, bool wake) {
  (void)conn;
  std::int64_t old = 0;
  auto it = kv_.find(key);
  if (it != kv_.end()) {
    auto parsed = parse_counter(it->second);
    if (!parsed) {
      return {false, fmt::format("ADD on key '{}' whose value '{}' is not a decimal integer", printable(key),
                                 printable(it->second))};
    }
    old = *parsed;
  }
  // Overflow wraps (two's complement), as the reference servers do in practice.
  result = static_cast<std::int64_t>(static_cast<std::uint64_t>(old) + static_cast<std::uint64_t>(delta));
  char buf[24];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, result);
  (void)ec;
  const std::string_view text(buf, static_cast<std::size_t>(end - buf));
  if (wake) {
    ApplyResult res;
    store(res, key, text, outbox);
    return res;
  }
  // BARRIER's increment: same write, but waiters are woken by the barrier logic itself.
  if (it != kv_.end()) {
    const std::size_t after = bytes_ - it->second.size() + text.size();
    if (text.size() > it->second.size() && after > limits_.max_total_bytes) return too_big(key, text.size());
    if (!watchers_.empty()) notify_watchers(key, WatchResponse::key_updated, it->second, text, outbox);
    it->second.assign(text);
    bytes_ = after;
  } else {
    if (bytes_ + key.size() + text.size() > limits_.max_total_bytes) return too_big(key, key.size() + text.size());
    ApplyResult res;
    if (!can_add_entry(res, key)) return res;
    kv_.emplace(std::string(key), std::string(text));
    bytes_ += key.size() + text.size();
    if (!watchers_.empty()) notify_watchers(key, WatchResponse::key_created, {}, text, outbox);
  }
  return {};
}

ApplyResult StoreState::apply(ConnectionId conn, const Request& req, Outbox& outbox) {
  ApplyResult res;
  switch (req.op) {
    case Op::validate:
      break;
    case Op::ping:
      reply::u32(outbox.buffer(conn), req.u32);
      break;
    case Op::set:
      store(res, req.key, req.value, outbox);
      break;
    case Op::compare_set: {
      auto it = kv_.find(req.key);
      // The reply is the desired, expected or current value: refuse before writing anything.
      const std::size_t reply_size =
          8 + std::max({req.desired.size(), req.value.size(), it == kv_.end() ? 0 : it->second.size()});
      if (!reply_fits(res, conn, req.op, reply_size, outbox)) break;
      if (it == kv_.end()) {
        if (req.value.empty()) {
          if (!store(res, req.key, req.desired, outbox)) break;
          reply::str(outbox.buffer(conn), req.desired);
        } else {
          reply::str(outbox.buffer(conn), req.value);  // the reference servers reply `expected`
          wake_all(req.key, outbox);
        }
      } else if (it->second == req.value) {
        if (!store(res, req.key, req.desired, outbox)) break;
        reply::str(outbox.buffer(conn), req.desired);
      } else {
        reply::str(outbox.buffer(conn), it->second);
        wake_all(req.key, outbox);
      }
      break;
    }
    case Op::get: {
      auto it = kv_.find(req.key);
      if (it != kv_.end() && !reply_fits(res, conn, req.op, 8 + it->second.size(), outbox)) break;
      reply::str(outbox.buffer(conn), it == kv_.end() ? std::string_view{} : std::string_view(it->second));
      break;
    }
    case Op::add: {
      std::int64_t result = 0;
      res = add(conn, req.key, req.number, result, outbox, true);
      if (res.ok) reply::i64(outbox.buffer(conn), result);
      break;
    }
    case Op::check: {
      bool all = true;
      for (auto k : req.keys) {
        if (!exists(k)) {
          all = false;
          break;
        }
      }
      reply::check(outbox.buffer(conn), all ? CheckResponse::ready : CheckResponse::not_ready);
      break;
    }
    case Op::wait: {
      std::int64_t missing = 0;
      for (auto k : req.keys) missing += exists(k) ? 0 : 1;
      if (missing == 0) {
        reply::wait(outbox.buffer(conn), WaitResponse::stop_waiting);
        break;
      }
      // A new WAIT replaces the count (as the reference servers do); older registrations of a
      // 1.13 client that timed out locally stay and may still wake it.
      std::size_t key_bytes = 0;
      for (auto k : req.keys) key_bytes += exists(k) ? 0 : k.size();
      if (!make_room(res, conn, req.op, static_cast<std::size_t>(missing), key_bytes, outbox)) break;
      awaited_[conn].missing = missing;
      for (auto k : req.keys) {
        if (!exists(k)) register_wait(conn, k);
      }
      break;
    }
    case Op::get_num_keys:
      reply::i64(outbox.buffer(conn), static_cast<std::int64_t>(kv_.size()));
      break;
    case Op::watch_key: {
      if (auto w = watchers_.find(req.key); w != watchers_.end()) {
        // Each repeat is one more copy of every event of the key, made by whoever writes it: a
        // connection repeating one WATCH_KEY a million times (max_waits) would make every SET of
        // that key write a million events.
        if (auto c = w->second.find(conn); c != w->second.end() && c->second >= kMaxWatchRepeats) {
          res = {false, fmt::format("this connection watches the key {} times already, the most one connection may "
                                    "(each repeat is one more copy of every event of the key)",
                                    c->second)};
          break;
        }
      }
      if (!make_room(res, conn, req.op, 1, req.key.size(), outbox)) break;
      reply::u8(outbox.buffer(conn), static_cast<std::uint8_t>(WatchResponse::key_callback_registered));
      auto it = watchers_.find(req.key);
      if (it == watchers_.end()) it = watchers_.try_emplace(std::string(req.key)).first;
      ++it->second[conn];
      watched_[conn].emplace_back(req.key);
      ++registrations_;
      registered_bytes_ += 2 * req.key.size();
      break;
    }
    case Op::delete_key: {
      auto it = kv_.find(req.key);
      if (it == kv_.end()) {
        reply::i64(outbox.buffer(conn), 0);
        break;
      }
      bytes_ -= it->first.size() + it->second.size();
      if (!watchers_.empty()) notify_watchers(req.key, WatchResponse::key_deleted, it->second, {}, outbox);
      kv_.erase(it);
      reply::i64(outbox.buffer(conn), 1);
      break;
    }
    case Op::append: {
      auto it = kv_.find(req.key);
      if (it == kv_.end()) {
        store(res, req.key, req.value, outbox);
        break;
      }
      if (it->second.size() + req.value.size() > limits_.max_value_bytes) {
        // A value SET could not write stays one GET can read back: its reply fits
        // --max-queued-reply-bytes whenever a SET's does.
        res = {false, fmt::format("APPEND of {} bytes to key '{}' would make its value {} bytes, over the largest "
                                  "value of {} bytes (--max-value-bytes)",
                                  req.value.size(), printable(req.key), it->second.size() + req.value.size(),
                                  limits_.max_value_bytes)};
        break;
      }
      if (bytes_ + req.value.size() > limits_.max_total_bytes) {
        res = too_big(req.key, req.value.size());
        break;
      }
      if (!watchers_.empty()) {
        notify_watchers(req.key, WatchResponse::key_updated, it->second, it->second, outbox, req.value);
      }
      it->second.append(req.value);
      bytes_ += req.value.size();
      wake_all(req.key, outbox);
      break;
    }
    case Op::multi_get: {
      std::size_t reply_size = 0;
      for (auto k : req.keys) {
        auto it = kv_.find(k);
        reply_size += 8 + (it == kv_.end() ? 0 : it->second.size());
      }
      if (!reply_fits(res, conn, req.op, reply_size, outbox)) break;
      std::string& out = outbox.buffer(conn);
      for (auto k : req.keys) {
        auto it = kv_.find(k);
        reply::str(out, it == kv_.end() ? std::string_view{} : std::string_view(it->second));
      }
      break;
    }
    case Op::multi_set:
      for (std::size_t i = 0; i < req.keys.size() && res.ok; ++i) store(res, req.keys[i], req.values[i], outbox);
      break;
    case Op::cancel_wait:
      drop_waits(conn);
      reply::wait(outbox.buffer(conn), WaitResponse::wait_canceled);
      break;
    case Op::queue_push: {
      auto it = queues_.find(req.key);
      const std::size_t extra = req.value.size() + (it == queues_.end() ? req.key.size() : 0);
      if (bytes_ + extra > limits_.max_total_bytes) {
        res = too_big(req.key, extra);
        break;
      }
      if (!can_add_entry(res, req.key)) break;
      if (it == queues_.end()) it = queues_.emplace(std::string(req.key), std::deque<std::string>{}).first;
      it->second.emplace_back(req.value);
      ++queued_items_;
      bytes_ += extra;
      wake_one(req.key, outbox);
      break;
    }
    case Op::queue_pop: {
      auto it = queues_.find(req.key);
      std::string& out = outbox.buffer(conn);
      if (it == queues_.end() || it->second.empty()) {
        reply::i64(out, 0);
        break;
      }
      if (!reply_fits(res, conn, req.op, 16 + it->second.front().size(), outbox)) break;
      reply::i64(out, static_cast<std::int64_t>(it->second.size()));
      reply::str(out, it->second.front());
      bytes_ -= it->second.front().size();
      it->second.pop_front();
      --queued_items_;
      if (it->second.empty()) {
        bytes_ -= it->first.size();
        queues_.erase(it);
      }
      break;
    }
    case Op::queue_len: {
      auto it = queues_.find(req.key);
      reply::i64(outbox.buffer(conn), it == queues_.end() ? 0 : static_cast<std::int64_t>(it->second.size()));
      break;
    }
    case Op::list_keys: {
      // One request's work stays bounded like a MULTI_GET's: listing millions of keys took the
      // one thread that serves every client (and an agent's heartbeats) for a second each time.
      if (kv_.size() > limits_.max_keys_per_request) {
        res = {false, fmt::format("LIST_KEYS would list {} keys, more than one request may name "
                                  "(--max-keys-per-request {})",
                                  kv_.size(), limits_.max_keys_per_request)};
        break;
      }
      std::size_t reply_size = 8;
      for (const auto& kv : kv_) reply_size += 8 + kv.first.size();
      if (!reply_fits(res, conn, req.op, reply_size, outbox)) break;
      std::string& out = outbox.buffer(conn);
      reply::i64(out, static_cast<std::int64_t>(kv_.size()));
      for (const auto& kv : kv_) reply::str(out, kv.first);
      break;
    }
    case Op::barrier: {
      // A participant that will wait needs a registration: made room for before its arrival is
      // counted, so that one refused (the connection closes) leaves the count as it was, and its
      // retry is not counted twice. (A value that is no counter is refused by add() below.)
      // Nor is anyone shed for an arrival add() then refuses (--max-keys, --max-total-bytes).
      if (auto it = kv_.find(req.key); it == kv_.end() || parse_counter(it->second)) {
        const std::int64_t old = it == kv_.end() ? 0 : *parse_counter(it->second);
        const auto next = static_cast<std::int64_t>(static_cast<std::uint64_t>(old) + 1);
        char buf[24];
        const std::size_t len = static_cast<std::size_t>(std::to_chars(buf, buf + sizeof buf, next).ptr - buf);
        const bool add_fits =
            it != kv_.end() ? len <= it->second.size() || bytes_ - it->second.size() + len <= limits_.max_total_bytes
                            : bytes_ + req.key.size() + len <= limits_.max_total_bytes && entries() < limits_.max_keys;
        if (next < req.number && add_fits && !make_room(res, conn, req.op, 1, req.key.size(), outbox)) break;
      }
      std::int64_t count = 0;
      res = add(conn, req.key, 1, count, outbox, false);
      if (!res.ok) break;
      if (count >= req.number) {
        reply::wait(outbox.buffer(conn), WaitResponse::stop_waiting);
        wake_all(req.key, outbox);
      } else {
        awaited_[conn].missing = 1;
        register_wait(conn, req.key);
      }
      break;
    }
  }
  return res;
}

void StoreState::disconnect(ConnectionId conn) {
  drop_waits(conn);
  auto w = watched_.find(conn);
  if (w == watched_.end()) return;
  for (const std::string& k : w->second) {
    registered_bytes_ -= 2 * k.size();
    auto it = watchers_.find(k);
    if (it == watchers_.end()) continue;
    it->second.erase(conn);  // all of its WATCH_KEYs on k (a repeat of k finds nothing more)
    if (it->second.empty()) watchers_.erase(it);
  }
  registrations_ -= w->second.size();
  watched_.erase(w);
}

void StoreState::clear() {
  kv_.clear();
  queues_.clear();
  waiters_.clear();
  awaited_.clear();
  watchers_.clear();
  watched_.clear();
  bytes_ = 0;
  queued_items_ = 0;
  registrations_ = 0;
  registered_bytes_ = 0;
}

}  // namespace ddprun::rendezvous
