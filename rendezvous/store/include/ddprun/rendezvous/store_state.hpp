#pragma once
// StoreState: the TCPStore key space and its wait/watch registrations, without sockets.
//
// apply() executes one decoded request for connection `conn` and expresses everything that
// must go on the wire as effects on an Outbox (bytes appended to a connection's outgoing
// stream, in order). A returned error means "close this connection" (the protocol has no error
// replies); the caller closes it and then calls disconnect(). Because all replies and wake-ups
// of one connection are appended to the same ordered stream, a STOP_WAITING produced before a
// CANCEL_WAIT always precedes its WAIT_CANCELED on the wire.
//
// Memory is bounded by StoreLimits: keys and queued items (max_keys), wait and watch
// registrations (max_waits; their key copies count against max_total_bytes separately from the
// key space) and held bytes (max_total_bytes). A request whose reply would not fit in
// Outbox::reply_room() is refused before any of the reply is built. Each refusal is an error
// naming the limit and its flag.
//
// Fairness: the registration table is shared by every connection. When a WAIT, BARRIER or
// WATCH_KEY does not fit (max_waits, or the key bytes registrations copy against
// max_total_bytes), the connections holding more than the requester would after its request, in
// the measure that is short, are closed to make room, largest first (Outbox::shed), if that makes
// enough; otherwise the requester is refused and nobody is shed. So one client pipelining WAITs on many keys cannot
// make every other client's one-key WAIT fail.
//
// Not thread-safe: owned by the one thread that runs the server's io_context. Connection ids are
// chosen by the caller and never reused while registrations for them exist.
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ddprun/rendezvous/codec.hpp"
#include "ddprun/rendezvous/protocol.hpp"

namespace ddprun::rendezvous {

using ConnectionId = std::uint64_t;

// Where the state machine puts the bytes it wants sent. buffer(conn) returns the outgoing
// byte stream of `conn`; the state only appends to it.
class Outbox {
 public:
  virtual ~Outbox() = default;
  virtual std::string& buffer(ConnectionId conn) = 0;
  // How many more reply bytes `conn` may have queued; a request whose reply is larger is refused
  // before it is built. Unbounded unless the outbox (the server) says otherwise.
  virtual std::size_t reply_room(ConnectionId conn) {
    (void)conn;
    return static_cast<std::size_t>(-1);
  }
  // Asks to queue `n` bytes for `conn` that another connection's request produced (a WATCH_KEY
  // event). False: they must not be queued, and the outbox closes `conn` (it does not read).
  virtual bool reserve_push(ConnectionId conn, std::size_t n) {
    (void)conn;
    (void)n;
    return true;
  }
  // Asks to close `conn` (another connection than the one whose request is being executed): it
  // holds the most wait registrations when the table is full (StoreState, "Fairness"). False:
  // the outbox cannot, and the request that needed the room is refused instead.
  virtual bool shed(ConnectionId conn, const std::string& why) {
    (void)conn;
    (void)why;
    return false;
  }
  // Turns `conn` into a relay link (store_server.hpp, "Relays"): every byte after the frame being
  // handled is a relay frame. "" = done; otherwise why not, and the caller refuses the request.
  // `trusted_frames`: the relay asked for TRUSTED frames (relay_link.hpp); the server sends them.
  virtual std::string make_relay_link(ConnectionId conn, bool trusted_frames) {
    (void)conn;
    (void)trusted_frames;
    return "this server does not carry relays";
  }
};

// Outbox for tests and tools: one string per connection.
class RecordingOutbox final : public Outbox {
 public:
  std::string& buffer(ConnectionId conn) override { return out[conn]; }
  // Returns and clears what was queued for `conn`.
  std::string take(ConnectionId conn) {
    std::string s = std::move(out[conn]);
    out[conn].clear();
    return s;
  }
  bool shed(ConnectionId conn, const std::string& why) override {
    shed_reasons[conn] = why;
    return true;
  }
  std::unordered_map<ConnectionId, std::string> out;
  std::unordered_map<ConnectionId, std::string> shed_reasons;  // connections shed, and why
};

// std::stoll-compatible lenient parse (leading whitespace, optional sign, digits, anything
// after them ignored). nullopt for empty / non-numeric / out-of-range text, where stoll throws.
std::optional<std::int64_t> parse_counter(std::string_view text);

// WATCH_KEYs of one key one connection may hold. torch's server registers every repeat, and
// each is one more copy of every event of the key; past this the connection is closed.
inline constexpr std::uint32_t kMaxWatchRepeats = 64;

struct ApplyResult {
  bool ok = true;
  std::string reason;  // when !ok: why the connection must be closed
};

class StoreState {
 public:
  explicit StoreState(StoreLimits limits = {});

  ApplyResult apply(ConnectionId conn, const Request& req, Outbox& outbox);
  // Forgets every wait and watch registration of `conn` (connection closed).
  void disconnect(ConnectionId conn);
  // Drops every key, queue and registration.
  void clear();

  std::size_t num_keys() const { return kv_.size(); }
  std::size_t bytes() const { return bytes_; }
  std::size_t pending_waits() const { return awaited_.size(); }
  // WAIT/BARRIER plus WATCH_KEY registrations held now (what max_waits caps).
  std::size_t registrations() const { return registrations_; }
  // Keys plus queued items held now (what max_keys caps).
  std::size_t entries() const { return kv_.size() + queued_items_; }
  // True while `conn` has a WAIT/BARRIER outstanding or watches a key: it legitimately sends
  // nothing while it waits for the server.
  bool waiting(ConnectionId conn) const { return awaited_.count(conn) != 0 || watched_.count(conn) != 0; }
  std::optional<std::string_view> value(std::string_view key) const;
  const StoreLimits& limits() const { return limits_; }

 private:
  struct Hash {
    using is_transparent = void;
    std::size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
  };
  using KeyMap = std::unordered_map<std::string, std::string, Hash, std::equal_to<>>;
  using QueueMap = std::unordered_map<std::string, std::deque<std::string>, Hash, std::equal_to<>>;
  // key -> its WAIT/BARRIER registrations in arrival order (QUEUE_PUSH wakes the oldest), by a
  // sequence number, so that a connection's registrations are removed in O(log n) each: a
  // vector scanned per registration made one disconnect cost |its registrations| x |the key's|.
  using WaitList = std::unordered_map<std::string, std::map<std::uint64_t, ConnectionId>, Hash, std::equal_to<>>;
  // key -> connections watching it, with how many WATCH_KEYs each sent (each gets every event).
  using WatchList =
      std::unordered_map<std::string, std::unordered_map<ConnectionId, std::uint32_t>, Hash, std::equal_to<>>;

  struct Awaiting {
    std::int64_t missing = 0;  // registrations still to be satisfied
    // (key, sequence number) of each registration of this connection (keys may repeat).
    std::vector<std::pair<std::string, std::uint64_t>> keys;
  };

  bool exists(std::string_view key) const;
  // Writes key=value (creating or replacing). Returns false if the total-bytes limit forbids it.
  bool store(ApplyResult& res, std::string_view key, std::string_view value, Outbox& outbox);
  void wake_all(std::string_view key, Outbox& outbox);
  void wake_one(std::string_view key, Outbox& outbox);
  void satisfy(ConnectionId conn, Outbox& outbox);
  void drop_waits(ConnectionId conn);
  void register_wait(ConnectionId conn, std::string_view key);
  // False (and `res` set) when `n` more registrations of keys totalling `key_bytes` would pass
  // max_waits or max_total_bytes.
  bool can_register(ApplyResult& res, Op op, std::size_t n, std::size_t key_bytes) const;
  // can_register, after shedding the connections that hold the most registrations when they
  // hold more than `conn` would (see "Fairness" above).
  bool make_room(ApplyResult& res, ConnectionId conn, Op op, std::size_t n, std::size_t key_bytes, Outbox& outbox);
  // Registrations `conn` holds (WAIT/BARRIER keys plus WATCH_KEYs) and the key bytes they copy.
  struct Held {
    std::size_t count = 0;
    std::size_t bytes = 0;
  };
  Held held_by(ConnectionId conn) const;
  // False (and `res` set) when one more key or queued item would pass max_keys.
  bool can_add_entry(ApplyResult& res, std::string_view key) const;
  // False (and `res` set) when a reply of `size` bytes does not fit in the outbox's room.
  bool reply_fits(ApplyResult& res, ConnectionId conn, Op op, std::size_t size, Outbox& outbox) const;
  // Sends the event to the key's watchers; call it before the change, with the value still in
  // place: no copy of the old value is made (a SET of a large value must not copy it per write).
  void notify_watchers(std::string_view key, WatchResponse type, std::string_view old_value, std::string_view new_value,
                       Outbox& outbox, std::string_view new_tail = {});
  ApplyResult too_big(std::string_view key, std::size_t extra) const;
  ApplyResult add(ConnectionId conn, std::string_view key, std::int64_t delta, std::int64_t& result, Outbox& outbox,
                  bool wake);

  StoreLimits limits_;
  KeyMap kv_;
  QueueMap queues_;
  WaitList waiters_;
  std::unordered_map<ConnectionId, Awaiting> awaited_;
  std::uint64_t next_wait_ = 0;  // sequence number of the next registration
  WatchList watchers_;           // 1.13 WATCH_KEY
  std::unordered_map<ConnectionId, std::vector<std::string>> watched_;
  std::size_t bytes_ = 0;
  std::size_t queued_items_ = 0;      // items in queues_
  std::size_t registrations_ = 0;     // entries of awaited_[*].keys plus watched_[*]
  std::size_t registered_bytes_ = 0;  // key bytes copied by those registrations (two copies each)
};

}  // namespace ddprun::rendezvous
