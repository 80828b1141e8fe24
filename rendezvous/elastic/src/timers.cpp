// Timers: steady and manual implementations (timers.hpp has the contract).
//
// Both guard every wait with a sequence number shared with the posted handler: cancel() and
// arm() bump it, so a handler that was already due (asio queued its completion, or advance()
// posted it) but belongs to an older wait returns without running. The number lives in a
// shared_ptr so a handler that runs after its Timer was destroyed still reads valid memory.
#include "ddprun/rendezvous/timers.hpp"

#include <algorithm>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <utility>
#include <vector>

namespace ddprun::rendezvous {

namespace asio = boost::asio;

namespace {

using Sequence = std::shared_ptr<std::uint64_t>;

std::function<void()> guarded(const Sequence& seq, std::function<void()> handler) {
  return [seq, mine = *seq, h = std::move(handler)] {
    if (*seq == mine) h();
  };
}

class SteadyTimer final : public Timer {
 public:
  explicit SteadyTimer(asio::io_context& io) : timer_(io) {}
  ~SteadyTimer() override { cancel(); }
  SteadyTimer(const SteadyTimer&) = delete;
  SteadyTimer& operator=(const SteadyTimer&) = delete;

  void arm(TimePoint at, std::function<void()> handler) override {
    ++*seq_;
    timer_.expires_at(at);
    timer_.async_wait([run = guarded(seq_, std::move(handler))](const boost::system::error_code& ec) {
      if (!ec) run();
    });
  }
  void cancel() override {
    ++*seq_;
    timer_.cancel();
  }

 private:
  asio::steady_timer timer_;
  Sequence seq_ = std::make_shared<std::uint64_t>(0);
};

class SteadyTimers final : public Timers {
 public:
  const Clock& clock() const override { return SteadyClock::instance(); }
  std::unique_ptr<Timer> make_timer(asio::io_context& io) override { return std::make_unique<SteadyTimer>(io); }
};

}  // namespace

Timers& Timers::steady() {
  static SteadyTimers timers;
  return timers;
}

struct ManualTimers::Entry final : Timer {
  Entry(ManualTimers& owner_, asio::io_context& io_) : owner(owner_), io(io_) { owner.entries_.insert(this); }
  ~Entry() override {
    cancel();
    owner.entries_.erase(this);
  }
  Entry(const Entry&) = delete;
  Entry& operator=(const Entry&) = delete;

  void arm(TimePoint t, std::function<void()> h) override {
    ++*seq;
    at = t;
    handler = std::move(h);
    if (t <= owner.now()) fire();
  }
  void cancel() override {
    ++*seq;
    at.reset();
    handler = nullptr;
  }
  void fire() {
    at.reset();
    asio::post(io, guarded(seq, std::move(handler)));
    handler = nullptr;
  }

  ManualTimers& owner;
  asio::io_context& io;
  std::optional<TimePoint> at;
  std::function<void()> handler;
  Sequence seq = std::make_shared<std::uint64_t>(0);
};

std::unique_ptr<Timer> ManualTimers::make_timer(asio::io_context& io) { return std::make_unique<Entry>(*this, io); }

void ManualTimers::advance(Duration d) {
  clock_.advance(d);
  fire_due();
}

std::optional<TimePoint> ManualTimers::advance_to_next() {
  const auto next = next_expiry();
  if (next && *next > clock_.now()) clock_.set(*next);
  fire_due();
  return next;
}

std::optional<TimePoint> ManualTimers::next_expiry() const {
  std::optional<TimePoint> next;
  for (const Entry* e : entries_) {
    if (e->at && (!next || *e->at < *next)) next = e->at;
  }
  return next;
}

std::size_t ManualTimers::armed() const {
  return static_cast<std::size_t>(
      std::count_if(entries_.begin(), entries_.end(), [](const Entry* e) { return e->at.has_value(); }));
}

void ManualTimers::fire_due() {
  std::vector<Entry*> due;
  for (Entry* e : entries_) {
    if (e->at && *e->at <= clock_.now()) due.push_back(e);
  }
  std::sort(due.begin(), due.end(), [](const Entry* a, const Entry* b) { return *a->at < *b->at; });
  for (Entry* e : due) e->fire();
}

}  // namespace ddprun::rendezvous
