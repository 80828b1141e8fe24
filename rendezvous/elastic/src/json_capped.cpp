// JSON parsed in bounded memory (json_capped.hpp has the contract).
#include "ddprun/rendezvous/json_capped.hpp"

#include <fmt/format.h>

#include <boost/json.hpp>
#include <algorithm>
#include <new>

namespace ddprun::rendezvous {

namespace json = boost::json;

namespace {

// Counts what the DOM and the parser's stack take and refuses past the cap. A DOM value is 16
// bytes and an object member 32 plus its key: text such as `[0,0,...]` or `[[],[],...]` (2-3
// bytes a value, held once on the stack and once in its array) took about 17x its size, so a
// 64 MiB STATUS_REPLY from any server `ddprun status` was pointed at took 1.1-1.7 GB before it
// was refused.
//
// The storage is a bump allocator (json::monotonic_resource): a parsed message is read and
// dropped whole, and a malloc per key and string was the daemon's largest single cost in a
// JOIN (12 % of the root's CPU at 100,000 agents). Nothing is handed back before the DOM dies,
// so what is counted is everything ever taken: the memory the DOM touches, 3-9 % more than the
// live DOM at its peak (the value stack's old copies as it grows). The arena's blocks (doubling
// from the first) reserve up to about twice the cap in address space, untouched past the cap.
class CappedResource final : public json::memory_resource {
 public:
  CappedResource(std::size_t cap, std::size_t first_block) : arena_(first_block), cap_(cap) {}

  struct Exceeded : std::bad_alloc {
    const char* what() const noexcept override { return "JSON DOM over its cap"; }
  };

 private:
  void* do_allocate(std::size_t n, std::size_t align) override {
    if (n > cap_ - used_) throw Exceeded{};  // used_ <= cap_ always
    void* p = arena_.allocate(n, align);
    used_ += n;
    return p;
  }
  void do_deallocate(void*, std::size_t, std::size_t) override {}  // freed with the arena
  bool do_is_equal(const json::memory_resource& other) const noexcept override { return this == &other; }

  json::monotonic_resource arena_;
  std::size_t cap_;
  std::size_t used_ = 0;
};

}  // namespace

CappedJson parse_json_capped(std::string_view text, std::size_t max_depth) {
  json::parse_options opts;
  opts.max_depth = max_depth;
  const std::size_t cap = json_dom_cap_bytes(text.size());
  // The first block holds a small message's DOM whole (a JOIN of ~200 bytes takes ~600); a large
  // one takes blocks of 1x, 2x, 4x its size, each touched only as far as it is used.
  const std::size_t first_block = std::min(cap, std::max<std::size_t>(1024, text.size()));
  const json::storage_ptr sp = json::make_shared_resource<CappedResource>(cap, first_block);
  unsigned char temp[4096];
  json::parser p(sp, opts, temp, sizeof temp);
  p.reset(sp);
  boost::system::error_code ec;
  try {
    p.write(text.data(), text.size(), ec);
  } catch (const CappedResource::Exceeded&) {
    return CappedJson{nullptr,
                      fmt::format("a payload of {} bytes would take more than {:.1f} MiB to decode, the limit for "
                                  "its size (JSON of many tiny values)",
                                  text.size(), static_cast<double>(cap) / (1 << 20)),
                      {}};
  } catch (const std::bad_alloc&) {  // the system's limit before ours (RLIMIT_AS, strict overcommit)
    return CappedJson{
        nullptr, fmt::format("a payload of {} bytes could not be decoded: out of memory", text.size()), {}};
  }
  if (ec) return CappedJson{nullptr, {}, ec.message()};
  // Constructed from the released value, not assigned: assigning to a value of the default
  // storage would copy the DOM out of the capped resource.
  return CappedJson{p.release(), {}, {}};
}

}  // namespace ddprun::rendezvous
