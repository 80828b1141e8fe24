// StoreState semantics without sockets: replies and wake-ups as bytes on a RecordingOutbox.
#include <catch2/catch.hpp>

#include "helpers.hpp"
#include "ddprun/rendezvous/store_state.hpp"

using namespace ddprun::rendezvous;
using test::hex;

namespace {

struct Harness {
  StoreState state;
  RecordingOutbox box;
  explicit Harness(StoreLimits limits = {}) : state(limits) {}

  ApplyResult run(ConnectionId c, Request r) { return state.apply(c, r, box); }
  std::string take(ConnectionId c) { return box.take(c); }

  void set(ConnectionId c, std::string_view k, std::string_view v) {
    Request r;
    r.op = Op::set;
    r.key = k;
    r.value = v;
    REQUIRE(run(c, r).ok);
  }
  ApplyResult add(ConnectionId c, std::string_view k, std::int64_t d) {
    Request r;
    r.op = Op::add;
    r.key = k;
    r.number = d;
    return run(c, r);
  }
  std::string get(ConnectionId c, std::string_view k) {
    Request r;
    r.op = Op::get;
    r.key = k;
    REQUIRE(run(c, r).ok);
    return take(c);
  }
  void wait(ConnectionId c, std::vector<std::string_view> keys) {
    Request r;
    r.op = Op::wait;
    r.keys = std::move(keys);
    REQUIRE(run(c, r).ok);
  }
  std::string cas(ConnectionId c, std::string_view k, std::string_view e, std::string_view d) {
    Request r;
    r.op = Op::compare_set;
    r.key = k;
    r.value = e;
    r.desired = d;
    REQUIRE(run(c, r).ok);
    return take(c);
  }
  void simple(ConnectionId c, Op op, std::string_view k = {}, std::string_view v = {}, std::int64_t n = 0) {
    Request r;
    r.op = op;
    r.key = k;
    r.value = v;
    r.number = n;
    REQUIRE(run(c, r).ok);
  }
};

const std::string stop_waiting = test::u8(0);
const std::string wait_canceled = test::u8(1);

}  // namespace

TEST_CASE("parse_counter follows std::stoll", "[state]") {
  CHECK(parse_counter("7") == 7);
  CHECK(parse_counter(" 7") == 7);
  CHECK(parse_counter("\t\n-12") == -12);
  CHECK(parse_counter("+5") == 5);
  CHECK(parse_counter("7abc") == 7);
  CHECK(parse_counter(std::string_view("9\0"
                                       "1",
                                       3)) == 9);
  CHECK(parse_counter("9223372036854775807") == INT64_MAX);
  CHECK(parse_counter("-9223372036854775808") == INT64_MIN);
  CHECK_FALSE(parse_counter("9223372036854775808"));
  CHECK_FALSE(parse_counter("-9223372036854775809"));
  CHECK_FALSE(parse_counter(""));
  CHECK_FALSE(parse_counter("abc"));
  CHECK_FALSE(parse_counter("-"));
  CHECK_FALSE(parse_counter(" "));
  CHECK_FALSE(parse_counter("x7"));
}

TEST_CASE("ADD: lenient parse, decimal storage, errors keep the value", "[state]") {
  Harness h;
  struct Row {
    const char* before;
    std::int64_t delta;
    bool ok;
    std::int64_t result;
    const char* after;
  };
  const Row rows[] = {
      {" 7", 1, true, 8, "8"}, {"7abc", 1, true, 8, "8"},
      {"-3", 5, true, 2, "2"}, {"abc", 1, false, 0, "abc"},
      {"", 1, false, 0, ""},   {"99999999999999999999", 1, false, 0, "99999999999999999999"},
  };
  for (const auto& row : rows) {
    INFO("before '" << row.before << "'");
    h.set(1, "/c", row.before);
    auto r = h.add(1, "/c", row.delta);
    CHECK(r.ok == row.ok);
    if (row.ok) {
      CHECK(h.take(1) == test::i64(row.result));
    } else {
      CHECK_FALSE(r.reason.empty());
      CHECK(h.take(1).empty());
    }
    CHECK(*h.state.value("/c") == row.after);
  }
  // missing key counts from zero; negative deltas; overflow wraps
  REQUIRE(h.add(1, "/n", 5).ok);
  REQUIRE(h.add(1, "/n", -2).ok);
  CHECK(h.take(1) == test::i64(5) + test::i64(3));
  CHECK(*h.state.value("/n") == "3");
  h.set(1, "/max", "9223372036854775807");
  REQUIRE(h.add(1, "/max", 1).ok);
  CHECK(h.take(1) == test::i64(INT64_MIN));
}

TEST_CASE("COMPARE_SET follows the reference table", "[state]") {
  Harness h;
  // missing, expected empty -> create, reply desired
  CHECK(h.cas(1, "/a", "", "new") == test::str("new"));
  CHECK(*h.state.value("/a") == "new");
  // missing, expected non-empty -> no change, reply expected
  CHECK(h.cas(1, "/b", "x", "new") == test::str("x"));
  CHECK_FALSE(h.state.value("/b"));
  // present, equal -> replace, reply desired
  CHECK(h.cas(1, "/a", "new", "newer") == test::str("newer"));
  CHECK(*h.state.value("/a") == "newer");
  // present, different -> reply current
  CHECK(h.cas(1, "/a", "zzz", "other") == test::str("newer"));
  CHECK(*h.state.value("/a") == "newer");
  // present with empty value, expected empty -> replace
  h.set(1, "/e", "");
  CHECK(h.cas(1, "/e", "", "filled") == test::str("filled"));
}

TEST_CASE("GET, MULTI_GET, DELETE_KEY, GETNUMKEYS, LIST_KEYS, CHECK", "[state]") {
  Harness h;
  CHECK(h.get(1, "/missing") == test::str(""));  // libuv behaviour: empty, never blocks or closes
  h.set(1, "/k1", "v1");
  h.set(1, "init/", "1");
  h.set(1, "//worker/attempt_0/x", "y");  // slashes untouched
  CHECK(h.get(1, "/k1") == test::str("v1"));
  CHECK(h.get(1, "//worker/attempt_0/x") == test::str("y"));
  CHECK(h.get(1, "/worker/attempt_0/x") == test::str(""));

  Request mg;
  mg.op = Op::multi_get;
  mg.keys = {"/k1", "/nope", "init/"};
  REQUIRE(h.run(1, mg).ok);
  CHECK(h.take(1) == test::str("v1") + test::str("") + test::str("1"));

  h.simple(1, Op::queue_push, "/q", "item");  // queues do not count as keys
  h.simple(1, Op::get_num_keys);
  CHECK(h.take(1) == test::i64(3));

  h.simple(1, Op::list_keys);
  auto listed = h.take(1);
  REQUIRE(listed.substr(0, 8) == test::i64(3));
  CHECK(listed.find(test::str("init/")) != std::string::npos);
  CHECK(listed.find(test::str("/k1")) != std::string::npos);
  CHECK(listed.size() == 8 + 3 * 8 + 5 + 3 + 20);

  Request ck;
  ck.op = Op::check;
  ck.keys = {"/k1", "init/"};
  REQUIRE(h.run(1, ck).ok);
  ck.keys = {"/k1", "/nope"};
  REQUIRE(h.run(1, ck).ok);
  ck.keys = {};
  REQUIRE(h.run(1, ck).ok);
  ck.keys = {"/q"};  // a non-empty queue counts as present
  REQUIRE(h.run(1, ck).ok);
  CHECK(h.take(1) == hex("00 01 00 00"));

  h.simple(1, Op::delete_key, "/k1");
  h.simple(1, Op::delete_key, "/k1");
  CHECK(h.take(1) == test::i64(1) + test::i64(0));
  CHECK(h.state.num_keys() == 2);
}

TEST_CASE("WAIT: immediate, woken by every kind of write, not by DELETE", "[state]") {
  Harness h;
  h.set(1, "/have", "x");
  h.wait(2, {"/have"});
  CHECK(h.take(2) == stop_waiting);
  h.wait(2, {});
  CHECK(h.take(2) == stop_waiting);

  const Op writers[] = {Op::set, Op::add, Op::append, Op::multi_set, Op::compare_set, Op::queue_push};
  for (Op w : writers) {
    INFO(op_name(w));
    Harness g;
    g.wait(2, {"/k"});
    CHECK(g.take(2).empty());
    CHECK(g.state.pending_waits() == 1);
    Request r;
    r.op = w;
    r.key = "/k";
    r.value = "";
    r.desired = "v";
    r.number = 1;
    if (w == Op::multi_set) {
      r.keys = {"/k"};
      r.values = {"v"};
    }
    if (w == Op::set || w == Op::append || w == Op::queue_push) r.value = "1";
    REQUIRE(g.run(1, r).ok);
    CHECK(g.take(2) == stop_waiting);
    CHECK(g.state.pending_waits() == 0);
  }

  Harness d;
  d.set(1, "/k", "v");
  d.wait(2, {"/k", "/other"});
  d.simple(1, Op::delete_key, "/k");
  CHECK(d.take(2).empty());
  d.set(1, "/other", "1");
  CHECK(d.take(2) == stop_waiting);  // /k existed when the WAIT arrived
}

TEST_CASE("WAIT counts every missing key, duplicates included, and answers once", "[state]") {
  Harness h;
  h.wait(2, {"/a", "/b", "/a"});
  h.set(1, "/b", "1");
  CHECK(h.take(2).empty());
  h.set(1, "/a", "1");  // satisfies both registrations on /a
  CHECK(h.take(2) == stop_waiting);
  h.set(1, "/a", "2");
  CHECK(h.take(2).empty());  // never a second STOP_WAITING
  CHECK(h.state.pending_waits() == 0);
}

TEST_CASE("several connections wait on one key", "[state]") {
  Harness h;
  for (ConnectionId c = 10; c < 15; ++c) h.wait(c, {"/k"});
  h.set(1, "/k", "v");
  for (ConnectionId c = 10; c < 15; ++c) CHECK(h.take(c) == stop_waiting);
}

TEST_CASE("CANCEL_WAIT always answers, after an already queued STOP_WAITING", "[state]") {
  Harness h;
  SECTION("nothing pending") {
    h.simple(2, Op::cancel_wait);
    CHECK(h.take(2) == wait_canceled);
  }
  SECTION("pending wait is dropped") {
    h.wait(2, {"/k", "/j"});
    h.simple(2, Op::cancel_wait);
    CHECK(h.take(2) == wait_canceled);
    CHECK(h.state.pending_waits() == 0);
    h.set(1, "/k", "v");
    h.set(1, "/j", "v");
    CHECK(h.take(2).empty());
  }
  SECTION("wait satisfied before the cancel arrives: STOP_WAITING then WAIT_CANCELED") {
    h.wait(2, {"/k"});
    h.set(1, "/k", "v");
    h.simple(2, Op::cancel_wait);
    CHECK(h.take(2) == stop_waiting + wait_canceled);
  }
}

TEST_CASE("queues: FIFO, pop reply layout, push wakes exactly one waiter", "[state]") {
  Harness h;
  h.simple(1, Op::queue_pop, "/q");
  CHECK(h.take(1) == test::i64(0));
  h.simple(1, Op::queue_len, "/q");
  CHECK(h.take(1) == test::i64(0));

  h.wait(2, {"/q"});
  h.wait(3, {"/q"});
  h.simple(1, Op::queue_push, "/q", "a");
  CHECK(h.take(2) == stop_waiting);
  CHECK(h.take(3).empty());
  h.simple(1, Op::queue_push, "/q", "b");
  CHECK(h.take(3) == stop_waiting);

  h.simple(1, Op::queue_len, "/q");
  CHECK(h.take(1) == test::i64(2));
  h.simple(1, Op::queue_pop, "/q");
  CHECK(h.take(1) == test::i64(2) + test::str("a"));
  h.simple(1, Op::queue_pop, "/q");
  CHECK(h.take(1) == test::i64(1) + test::str("b"));
  CHECK(h.state.bytes() == 0);
  CHECK(h.get(1, "/q") == test::str(""));  // separate namespace

  h.simple(1, Op::queue_push, "/q2", "x");
  h.wait(4, {"/q2"});  // non-empty queue satisfies WAIT at once
  CHECK(h.take(4) == stop_waiting);
}

TEST_CASE("BARRIER", "[state]") {
  Harness h;
  h.wait(9, {"/b"});  // an ordinary waiter on the barrier key
  h.simple(1, Op::barrier, "/b", {}, 3);
  h.simple(2, Op::barrier, "/b", {}, 3);
  CHECK(h.take(1).empty());  // arrivals before the last are not released...
  CHECK(h.take(2).empty());
  CHECK(h.take(9).empty());  // ...and do not wake plain waiters
  CHECK(*h.state.value("/b") == "2");
  h.simple(3, Op::barrier, "/b", {}, 3);
  CHECK(h.take(3) == stop_waiting);
  CHECK(h.take(1) == stop_waiting);
  CHECK(h.take(2) == stop_waiting);
  CHECK(h.take(9) == stop_waiting);
  CHECK(h.state.pending_waits() == 0);
  // single use: the counter is already >= world size
  h.simple(4, Op::barrier, "/b", {}, 3);
  CHECK(h.take(4) == stop_waiting);
  // a non-numeric key closes the connection
  h.set(1, "/bad", "x");
  Request r;
  r.op = Op::barrier;
  r.key = "/bad";
  r.number = 2;
  CHECK_FALSE(h.run(5, r).ok);
  CHECK(*h.state.value("/bad") == "x");
}

TEST_CASE("a cancelled barrier arrival stays counted, its registration is gone", "[state]") {
  Harness h;
  h.simple(1, Op::barrier, "/b", {}, 2);
  h.simple(1, Op::cancel_wait);
  CHECK(h.take(1) == wait_canceled);
  h.simple(2, Op::barrier, "/b", {}, 2);
  CHECK(h.take(2) == stop_waiting);
  CHECK(h.take(1).empty());
}

TEST_CASE("disconnect forgets registrations", "[state]") {
  Harness h;
  h.wait(2, {"/k"});
  h.state.disconnect(2);
  CHECK(h.state.pending_waits() == 0);
  h.set(1, "/k", "v");
  CHECK(h.take(2).empty());
}

TEST_CASE("WATCH_KEY: ack then created/updated/deleted events", "[state]") {
  Harness h;
  h.simple(7, Op::watch_key, "/w");
  CHECK(h.take(7) == test::u8(3));
  h.set(1, "/w", "first");
  CHECK(h.take(7) == hex("01") + test::str("/w") + test::str("") + test::str("first"));
  h.set(1, "/w", "second");
  CHECK(h.take(7) == hex("00") + test::str("/w") + test::str("first") + test::str("second"));
  REQUIRE(h.add(1, "/w2", 1).ok);
  CHECK(h.take(7).empty());  // other keys are not reported
  h.simple(1, Op::delete_key, "/w");
  h.take(1);
  CHECK(h.take(7) == hex("02") + test::str("/w") + test::str("second") + test::str(""));
  h.state.disconnect(7);
  h.set(1, "/w", "again");
  CHECK(h.take(7).empty());
}

TEST_CASE("total-bytes limit refuses the write and keeps the store", "[state]") {
  StoreLimits limits;
  limits.max_total_bytes = 20;
  Harness h(limits);
  h.set(1, "/a", "0123456789");  // 12 bytes
  Request r;
  r.op = Op::set;
  r.key = "/b";
  r.value = "0123456789";  // would be 24
  auto res = h.run(1, r);
  CHECK_FALSE(res.ok);
  CHECK(res.reason.find("--max-total-bytes") != std::string::npos);
  CHECK_FALSE(h.state.value("/b"));
  r.op = Op::append;
  r.key = "/a";
  CHECK_FALSE(h.run(1, r).ok);
  r.op = Op::queue_push;
  CHECK_FALSE(h.run(1, r).ok);
  h.set(1, "/a", "x");  // shrinking is fine
  CHECK(h.state.bytes() == 3);
  h.state.clear();
  CHECK(h.state.bytes() == 0);
  CHECK(h.state.num_keys() == 0);
}

TEST_CASE("PING echoes, VALIDATE is silent", "[state]") {
  Harness h;
  Request r;
  r.op = Op::ping;
  r.u32 = 0xdeadbeef;
  REQUIRE(h.run(1, r).ok);
  CHECK(h.take(1) == test::u32(0xdeadbeef));
  r.op = Op::validate;
  REQUIRE(h.run(1, r).ok);
  CHECK(h.take(1).empty());
}
