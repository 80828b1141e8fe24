// StoreState memory bounds without sockets: max_keys, max_waits, max_total_bytes for wait
// registrations, and replies refused before they are built when the outbox has no room.
#include <catch2/catch.hpp>

#include <chrono>
#include <string>
#include <unordered_map>
#include <vector>

#include "helpers.hpp"
#include "ddprun/rendezvous/store_state.hpp"

using namespace ddprun::rendezvous;

namespace {

// RecordingOutbox with a fixed reply room per connection.
class RoomOutbox final : public Outbox {
 public:
  explicit RoomOutbox(std::size_t room) : room_(room) {}
  std::string& buffer(ConnectionId conn) override { return out[conn]; }
  std::size_t reply_room(ConnectionId) override { return room_; }
  std::unordered_map<ConnectionId, std::string> out;

 private:
  std::size_t room_;
};

Request req(Op op, std::string_view key = {}, std::string_view value = {}) {
  Request r;
  r.op = op;
  r.key = key;
  r.value = value;
  return r;
}

Request keys_req(Op op, std::vector<std::string_view> keys) {
  Request r;
  r.op = op;
  r.keys = std::move(keys);
  return r;
}

}  // namespace

TEST_CASE("max_keys caps keys plus queued items; replacing a key is always allowed", "[state][bounds]") {
  StoreLimits limits;
  limits.max_keys = 3;
  StoreState state(limits);
  RecordingOutbox box;
  REQUIRE(state.apply(1, req(Op::set, "a", "1"), box).ok);
  REQUIRE(state.apply(1, req(Op::queue_push, "q", "x"), box).ok);
  REQUIRE(state.apply(1, req(Op::set, "b", "1"), box).ok);
  CHECK(state.entries() == 3);
  const ApplyResult refused = state.apply(1, req(Op::set, "c", "1"), box);
  CHECK_FALSE(refused.ok);
  CHECK_THAT(refused.reason, Catch::Contains("--max-keys"));
  CHECK_FALSE(state.value("c"));
  CHECK(state.apply(1, req(Op::set, "a", "2"), box).ok);  // an existing key: no new entry
  CHECK_FALSE(state.apply(1, req(Op::queue_push, "q", "y"), box).ok);
  Request add = req(Op::add, "n");
  add.number = 1;
  CHECK_FALSE(state.apply(1, add, box).ok);
  REQUIRE(state.apply(1, req(Op::queue_pop, "q"), box).ok);  // frees one entry
  CHECK(state.entries() == 2);
  CHECK(state.apply(1, add, box).ok);
}

TEST_CASE("max_waits caps WAIT, BARRIER and WATCH_KEY registrations, freed on wake and disconnect", "[state][bounds]") {
  StoreLimits limits;
  limits.max_waits = 3;
  StoreState state(limits);
  RoomOutbox box(1 << 20);  // cannot shed: a request that does not fit is refused
  CHECK_FALSE(state.apply(1, keys_req(Op::wait, {"a", "b", "c", "d"}), box).ok);
  CHECK(state.registrations() == 0);
  REQUIRE(state.apply(1, keys_req(Op::wait, {"a", "b"}), box).ok);
  REQUIRE(state.apply(2, req(Op::watch_key, "w"), box).ok);
  CHECK(state.registrations() == 3);
  Request barrier = req(Op::barrier, "bar");
  barrier.number = 2;
  const ApplyResult refused = state.apply(3, barrier, box);
  CHECK_FALSE(refused.ok);
  CHECK_THAT(refused.reason, Catch::Contains("--max-waits"));
  // The refused participant's arrival is not counted (its connection closes; a retry would count
  // it twice and release the barrier one arrival early). Before: "bar" was 1 here.
  CHECK_FALSE(state.value("bar"));
  Request last = barrier;
  last.number = 1;  // an arrival that releases the barrier needs no registration
  REQUIRE(state.apply(5, last, box).ok);
  REQUIRE(state.value("bar"));
  CHECK(*state.value("bar") == "1");
  CHECK(box.out[5] == test::u8(0));  // STOP_WAITING
  REQUIRE(state.apply(4, req(Op::set, "a", "1"), box).ok);
  REQUIRE(state.apply(4, req(Op::set, "b", "1"), box).ok);  // wakes connection 1
  CHECK(box.out[1] == test::u8(0));
  CHECK(state.registrations() == 1);
  state.disconnect(2);
  CHECK(state.registrations() == 0);
  CHECK(state.apply(3, req(Op::barrier, "bar2"), box).ok);
}

TEST_CASE("a full wait table sheds the connection holding the most, never one holding no more than the requester",
          "[state][bounds]") {
  // One client pipelining WAITs on many keys must not make another client's one-key WAIT (the
  // store barrier of init_process_group) fail.
  StoreLimits limits;
  limits.max_waits = 6;
  StoreState state(limits);
  RecordingOutbox box;
  REQUIRE(state.apply(1, keys_req(Op::wait, {"h1", "h2", "h3"}), box).ok);
  REQUIRE(state.apply(1, keys_req(Op::wait, {"h4", "h5"}), box).ok);  // pipelined: its first five stay
  REQUIRE(state.apply(2, keys_req(Op::wait, {"w"}), box).ok);
  CHECK(state.registrations() == 6);
  Request barrier = req(Op::barrier, "bar");
  barrier.number = 2;
  REQUIRE(state.apply(3, barrier, box).ok);  // connection 1 (5 held) gives way
  CHECK(box.shed_reasons.size() == 1);
  CHECK_THAT(box.shed_reasons[1], Catch::Contains("holds 5 wait registrations") && Catch::Contains("--max-waits"));
  CHECK(state.registrations() == 2);
  CHECK_FALSE(state.waiting(1));
  // Equal holders: nobody holds more than the requester would, so the requester is refused.
  REQUIRE(state.apply(4, keys_req(Op::wait, {"x"}), box).ok);
  REQUIRE(state.apply(5, keys_req(Op::wait, {"y"}), box).ok);
  REQUIRE(state.apply(6, keys_req(Op::wait, {"z"}), box).ok);
  REQUIRE(state.apply(7, req(Op::watch_key, "k"), box).ok);
  CHECK(state.registrations() == 6);
  const ApplyResult refused = state.apply(8, keys_req(Op::wait, {"v"}), box);
  CHECK_FALSE(refused.ok);
  CHECK_THAT(refused.reason, Catch::Contains("--max-waits"));
  CHECK(box.shed_reasons.size() == 1);
  // A request bigger than the whole table sheds nobody.
  CHECK_FALSE(state.apply(9, keys_req(Op::wait, {"1", "2", "3", "4", "5", "6", "7"}), box).ok);
  CHECK(box.shed_reasons.size() == 1);
}

TEST_CASE("a BARRIER arrival the key limits refuse sheds no one for its registration", "[state][bounds]") {
  StoreLimits limits;
  limits.max_waits = 6;
  limits.max_keys = 1;
  StoreState state(limits);
  RecordingOutbox box;
  REQUIRE(state.apply(1, keys_req(Op::wait, {"h1", "h2", "h3", "h4", "h5"}), box).ok);
  REQUIRE(state.apply(2, req(Op::set, "full", "1"), box).ok);  // --max-keys reached
  REQUIRE(state.apply(2, keys_req(Op::wait, {"w"}), box).ok);
  Request barrier = req(Op::barrier, "bar");
  barrier.number = 2;
  const ApplyResult refused = state.apply(3, barrier, box);
  CHECK_FALSE(refused.ok);
  CHECK_THAT(refused.reason, Catch::Contains("--max-keys"));
  // Connection 1 (5 registrations) was not closed for an arrival that could not be counted.
  CHECK(box.shed_reasons.empty());
  CHECK(state.waiting(1));
  CHECK(state.registrations() == 6);
}

TEST_CASE("wait registrations' key bytes count against max_total_bytes", "[state][bounds]") {
  // Each registration holds its key twice (per key and per connection): a 60-byte key costs
  // 120 bytes; two of them pass 200.
  StoreLimits limits;
  limits.max_total_bytes = 200;
  StoreState state(limits);
  RecordingOutbox box;
  const std::string k1(60, 'a');
  const std::string k2(60, 'b');
  REQUIRE(state.apply(1, keys_req(Op::wait, {k1}), box).ok);
  const ApplyResult refused = state.apply(2, keys_req(Op::wait, {k2}), box);
  CHECK_FALSE(refused.ok);
  CHECK_THAT(refused.reason, Catch::Contains("would copy 120 key bytes into wait registrations holding 120 already"));
  CHECK_THAT(refused.reason, Catch::Contains("--max-total-bytes"));
  state.disconnect(1);
  CHECK(state.apply(2, keys_req(Op::wait, {k2}), box).ok);
}

TEST_CASE("a reply larger than the outbox's room is refused before any byte is queued", "[state][bounds]") {
  StoreState state;
  RecordingOutbox setup;
  const std::string value(200, 'v');
  REQUIRE(state.apply(1, req(Op::set, "big", value), setup).ok);
  REQUIRE(state.apply(1, req(Op::set, "small", "s"), setup).ok);
  RoomOutbox box(100);
  SECTION("GET") {
    const ApplyResult r = state.apply(2, req(Op::get, "big"), box);
    CHECK_FALSE(r.ok);
    CHECK_THAT(r.reason, Catch::Contains("GET reply of 208 bytes refused"));
    CHECK_THAT(r.reason, Catch::Contains("--max-queued-reply-bytes"));
    CHECK(box.out[2].empty());
    CHECK(state.apply(2, req(Op::get, "small"), box).ok);
    CHECK(box.out[2].size() == 9);
  }
  SECTION("MULTI_GET adds up every value before replying") {
    std::vector<std::string_view> keys(11, "small");  // 11 x 9 = 99 bytes fit
    CHECK(state.apply(2, keys_req(Op::multi_get, keys), box).ok);
    box.out[2].clear();
    keys.push_back("small");  // 108 bytes do not
    CHECK_FALSE(state.apply(2, keys_req(Op::multi_get, keys), box).ok);
    CHECK(box.out[2].empty());
  }
  SECTION("COMPARE_SET, QUEUE_POP, LIST_KEYS") {
    Request cas = req(Op::compare_set, "big", "nope");
    cas.desired = "x";
    CHECK_FALSE(state.apply(2, cas, box).ok);  // the reply would be the 200-byte current value
    CHECK(state.value("big") == value);
    REQUIRE(state.apply(1, req(Op::queue_push, "q", value), setup).ok);
    CHECK_FALSE(state.apply(2, req(Op::queue_pop, "q"), box).ok);
    CHECK(state.entries() == 3);  // the item is still queued
    RoomOutbox tiny(20);
    CHECK_FALSE(state.apply(2, req(Op::list_keys), tiny).ok);
    CHECK(tiny.out[2].empty());
  }
}

TEST_CASE("a WATCH_KEY event the outbox will not take is not queued; the write still happens", "[state][bounds]") {
  class Refusing final : public Outbox {
   public:
    std::string& buffer(ConnectionId conn) override { return out[conn]; }
    bool reserve_push(ConnectionId conn, std::size_t n) override {
      asked = n;
      return conn != 2;
    }
    std::unordered_map<ConnectionId, std::string> out;
    std::size_t asked = 0;
  };
  StoreState state;
  Refusing box;
  REQUIRE(state.apply(2, req(Op::watch_key, "w"), box).ok);
  REQUIRE(state.apply(3, req(Op::watch_key, "w"), box).ok);
  box.out.clear();
  REQUIRE(state.apply(1, req(Op::set, "w", "value"), box).ok);
  CHECK(box.asked == 1 + 24 + 1 + 0 + 5);
  CHECK(box.out[2].empty());
  CHECK(box.out[3].size() == box.asked);
  CHECK(state.value("w") == "value");
}

TEST_CASE("QUEUE_PUSH wakes the oldest waiter it completes; one still missing a key does not swallow it",
          "[state][queue]") {
  StoreState state;
  RecordingOutbox box;
  // Connection 1 waits for q and x, connection 2 for q only; one push on q.
  REQUIRE(state.apply(1, keys_req(Op::wait, {"q", "x"}), box).ok);
  REQUIRE(state.apply(2, keys_req(Op::wait, {"q"}), box).ok);
  REQUIRE(state.apply(3, req(Op::queue_push, "q", "item"), box).ok);
  CHECK(box.take(1).empty());         // still waits for x
  CHECK(box.take(2) == test::u8(0));  // STOP_WAITING
  REQUIRE(state.apply(3, req(Op::set, "x", "1"), box).ok);
  CHECK(box.take(1) == test::u8(0));  // x completes it (its q was counted)
  CHECK(state.registrations() == 0);
  // Two waiters on q alone, one push: the older one only.
  REQUIRE(state.apply(4, req(Op::queue_pop, "q"), box).ok);
  REQUIRE(state.apply(5, keys_req(Op::wait, {"q"}), box).ok);
  REQUIRE(state.apply(6, keys_req(Op::wait, {"q"}), box).ok);
  REQUIRE(state.apply(3, req(Op::queue_push, "q", "item"), box).ok);
  CHECK(box.take(5) == test::u8(0));
  CHECK(box.take(6).empty());
  CHECK(state.registrations() == 1);
}

TEST_CASE("dropping a connection's waits costs its own registrations, not theirs times the key's", "[state][bounds]") {
  // Two connections each registered 400,000 times on one missing key (two WAITs of 200,000:
  // a new WAIT keeps the older registrations). Before, each of the leaving connection's
  // registrations scanned the key's whole list: 1.6 * 10^11 steps, ~17 s here; now ~0.2 s.
  StoreLimits limits;
  limits.max_keys_per_request = 200000;
  StoreState state(limits);
  RecordingOutbox box;
  const std::vector<std::string_view> keys(200000, "k");
  for (int i = 0; i < 2; ++i) {
    REQUIRE(state.apply(1, keys_req(Op::wait, keys), box).ok);
    REQUIRE(state.apply(2, keys_req(Op::wait, keys), box).ok);
  }
  REQUIRE(state.registrations() == 800000);
  const auto t0 = std::chrono::steady_clock::now();
  state.disconnect(1);
  REQUIRE(state.apply(2, req(Op::cancel_wait), box).ok);
  const auto took = std::chrono::steady_clock::now() - t0;
  CHECK(state.registrations() == 0);
  CHECK(took < std::chrono::seconds(5));
}

TEST_CASE("an APPEND to a large watched value does not copy it when the watcher takes no events", "[state][bounds]") {
  // Before, every write to a watched key copied the old value first: 200 one-byte APPENDs to a
  // 128 MiB value cost 25 GiB of copying while the watcher that does not read was still open.
  class Refusing final : public Outbox {
   public:
    std::string& buffer(ConnectionId conn) override { return out[conn]; }
    bool reserve_push(ConnectionId conn, std::size_t) override { return conn != 2; }
    std::unordered_map<ConnectionId, std::string> out;
  };
  StoreLimits limits;
  limits.max_value_bytes = 256u << 20;  // the codec bounds a SET's value; APPEND's result is bounded here
  StoreState state(limits);
  Refusing box;
  const std::string big(128u << 20, 'v');
  REQUIRE(state.apply(1, req(Op::set, "k", big), box).ok);
  REQUIRE(state.apply(2, req(Op::watch_key, "k"), box).ok);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 200; ++i) REQUIRE(state.apply(1, req(Op::append, "k", "x"), box).ok);
  const auto took = std::chrono::steady_clock::now() - t0;
  CHECK(state.value("k")->size() == big.size() + 200);
  CHECK(box.out[2].size() == 1);          // the registration's reply only
  CHECK(took < std::chrono::seconds(2));  // ~0 now; several seconds before
}

TEST_CASE("a watch event carries the old and the new value, APPEND's included", "[state]") {
  StoreState state;
  RecordingOutbox box;
  REQUIRE(state.apply(1, req(Op::set, "k", "ab"), box).ok);
  REQUIRE(state.apply(2, req(Op::watch_key, "k"), box).ok);
  REQUIRE(state.apply(2, req(Op::watch_key, "k"), box).ok);  // twice: two events per change
  box.take(2);
  REQUIRE(state.apply(1, req(Op::append, "k", "cd"), box).ok);
  std::string one;
  reply::watch_event(one, WatchResponse::key_updated, "k", "ab", "abcd");
  CHECK(box.take(2) == one + one);
  REQUIRE(state.apply(1, req(Op::delete_key, "k"), box).ok);
  std::string del;
  reply::watch_event(del, WatchResponse::key_deleted, "k", "abcd", "");
  CHECK(box.take(2) == del + del);
  state.disconnect(2);
  CHECK(state.registrations() == 0);
}

TEST_CASE("one connection repeats a WATCH_KEY at most kMaxWatchRepeats times", "[state][bounds]") {
  // Before, a connection could register one key max_waits (a million) times, and every SET of
  // it by anyone then wrote a million events.
  StoreState state;
  RecordingOutbox box;
  for (std::uint32_t i = 0; i < kMaxWatchRepeats; ++i) REQUIRE(state.apply(2, req(Op::watch_key, "k"), box).ok);
  const ApplyResult over = state.apply(2, req(Op::watch_key, "k"), box);
  CHECK_FALSE(over.ok);
  CHECK_THAT(over.reason, Catch::Contains("watches the key 64 times already"));
  CHECK(state.registrations() == kMaxWatchRepeats);
  // Other keys and other connections are not affected.
  CHECK(state.apply(2, req(Op::watch_key, "other"), box).ok);
  CHECK(state.apply(3, req(Op::watch_key, "k"), box).ok);
  box.take(2);
  box.take(3);
  REQUIRE(state.apply(1, req(Op::set, "k", "v"), box).ok);
  std::string one;
  reply::watch_event(one, WatchResponse::key_created, "k", "", "v");
  CHECK(box.take(2).size() == kMaxWatchRepeats * one.size());
  CHECK(box.take(3) == one);
  state.disconnect(2);
  state.disconnect(3);
  CHECK(state.registrations() == 0);
}

TEST_CASE("APPEND keeps a value within max_value_bytes, so a GET can read it back", "[state][bounds]") {
  StoreLimits limits;
  limits.max_value_bytes = 8;
  StoreState state(limits);
  RecordingOutbox box;
  REQUIRE(state.apply(1, req(Op::append, "k", "12345"), box).ok);  // creates it
  REQUIRE(state.apply(1, req(Op::append, "k", "678"), box).ok);    // exactly the limit
  const ApplyResult refused = state.apply(1, req(Op::append, "k", "9"), box);
  CHECK_FALSE(refused.ok);
  CHECK_THAT(refused.reason, Catch::Contains("would make its value 9 bytes") && Catch::Contains("--max-value-bytes"));
  REQUIRE(state.value("k"));
  CHECK(*state.value("k") == "12345678");  // unchanged
}

TEST_CASE("LIST_KEYS of more keys than one request may name is refused before any work", "[state][bounds]") {
  StoreLimits limits;
  limits.max_keys_per_request = 3;
  StoreState state(limits);
  RecordingOutbox box;
  for (const char* k : {"a", "b", "c"}) REQUIRE(state.apply(1, req(Op::set, k, "1"), box).ok);
  box.take(1);
  REQUIRE(state.apply(1, req(Op::list_keys), box).ok);
  CHECK(box.take(1).size() == 8 + 3 * 9);
  REQUIRE(state.apply(1, req(Op::set, "d", "1"), box).ok);
  const ApplyResult refused = state.apply(1, req(Op::list_keys), box);
  CHECK_FALSE(refused.ok);
  CHECK_THAT(refused.reason, Catch::Contains("would list 4 keys") && Catch::Contains("--max-keys-per-request 3"));
  CHECK(box.take(1).empty());
}

TEST_CASE("a wait table full in key bytes sheds the largest holder of bytes, and nobody when that cannot make room",
          "[state][bounds]") {
  StoreLimits limits;
  limits.max_total_bytes = 1000;  // registrations copy their keys twice
  StoreState state(limits);
  RecordingOutbox box;
  const std::string long_key(480, 'k');
  REQUIRE(state.apply(1, keys_req(Op::wait, {"a", "b", "c"}), box).ok);  // 3 registrations, 6 bytes
  REQUIRE(state.apply(2, keys_req(Op::wait, {long_key}), box).ok);       // 1 registration, 960 bytes
  const std::string k21(21, 'x');
  REQUIRE(state.apply(3, keys_req(Op::wait, {k21}), box).ok);  // 42 more bytes: connection 2 gives way
  CHECK(box.shed_reasons.size() == 1);
  CHECK_THAT(box.shed_reasons[2], Catch::Contains("960 key bytes") && Catch::Contains("--max-total-bytes"));
  CHECK(state.waiting(1));
  // Now 48 bytes held; a request of 960 more than fits nobody can make room for: refused, nobody shed.
  const std::string k476(476, 'y');
  const ApplyResult refused = state.apply(4, keys_req(Op::wait, {k476, "z"}), box);
  CHECK_FALSE(refused.ok);
  CHECK_THAT(refused.reason, Catch::Contains("--max-total-bytes"));
  CHECK(box.shed_reasons.size() == 1);
  CHECK(state.waiting(1));
  CHECK(state.waiting(3));
}
