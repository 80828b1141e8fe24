// ddprun worker library: the C++ API (ddprun/worker.hpp) and the C API (ddprun/worker.h) over
// the project's StoreClient and NCCL ID decoding. Internals throw ddprun::Error and friends;
// the C++ API turns them into ddprun::worker::Error, the C API into status codes.
#include <cstdlib>
#include <cstring>
#include <utility>

#include "ddprun/common/error.hpp"
#include "ddprun/common/strings.hpp"
#include "ddprun/rendezvous/store_client.hpp"
#include "ddprun/worker.h"
#include "ddprun/worker.hpp"
#include "ddprun/worker_env/nccl_id.hpp"
#include "ddprun/worker_env/worker_env.hpp"

namespace ddprun::worker {

namespace {

// A required variable is missing (C: DDPRUN_ERR_NOT_SET).
class NotSet : public ddprun::Error {
 public:
  using ddprun::Error::Error;
};
// A variable is malformed (C: DDPRUN_ERR_INVALID).
class Invalid : public ddprun::Error {
 public:
  using ddprun::Error::Error;
};

const std::string* find(const Environment& env, const char* name) {
  const auto it = env.find(name);
  return it == env.end() ? nullptr : &it->second;
}

std::int64_t int_var(const Environment& env, const char* name, std::optional<std::int64_t> fallback, std::int64_t min,
                     std::int64_t max) {
  const std::string* v = find(env, name);
  if (v == nullptr) {
    if (fallback) return *fallback;
    throw NotSet(std::string(name) + " is not set", "run this program under ddprun or torchrun");
  }
  const auto n = parse_int(trim(*v));
  if (!n) throw Invalid(std::string(name) + "='" + *v + "' is not an integer");
  if (*n < min || *n > max) {
    throw Invalid(std::string(name) + "=" + *v + " is outside [" + std::to_string(min) + ", " + std::to_string(max) +
                  "]");
  }
  return *n;
}

Info parse_info_impl(const Environment& env) {
  Info i;
  constexpr std::int64_t big = 1 << 30;
  i.rank = static_cast<int>(int_var(env, "RANK", std::nullopt, 0, big));
  i.local_rank = static_cast<int>(int_var(env, "LOCAL_RANK", std::nullopt, 0, big));
  i.world_size = static_cast<int>(int_var(env, "WORLD_SIZE", std::nullopt, 1, big));
  i.local_world_size = static_cast<int>(int_var(env, "LOCAL_WORLD_SIZE", std::nullopt, 1, big));
  i.group_rank = static_cast<int>(int_var(env, "GROUP_RANK", 0, 0, big));
  i.group_world_size = static_cast<int>(int_var(env, "GROUP_WORLD_SIZE", 1, 1, big));
  i.restart_count = static_cast<int>(int_var(env, "TORCHELASTIC_RESTART_COUNT", 0, 0, big));
  i.max_restarts = static_cast<int>(int_var(env, "TORCHELASTIC_MAX_RESTARTS", 0, 0, big));
  i.master_port = static_cast<std::uint16_t>(int_var(env, "MASTER_PORT", std::nullopt, 1, 65535));
  i.cuda_device = static_cast<int>(int_var(env, "DDPRUN_CUDA_DEVICE", i.local_rank, 0, big));
  const std::string* addr = find(env, "MASTER_ADDR");
  if (addr == nullptr) throw NotSet("MASTER_ADDR is not set", "run this program under ddprun or torchrun");
  if (trim(*addr).empty()) throw Invalid("MASTER_ADDR is empty");
  i.master_addr = std::string(trim(*addr));
  const std::string* run_id = find(env, "TORCHELASTIC_RUN_ID");
  i.run_id = run_id != nullptr ? *run_id : "none";
  if (i.rank >= i.world_size) {
    throw Invalid("RANK=" + std::to_string(i.rank) + " is not below WORLD_SIZE=" + std::to_string(i.world_size));
  }
  if (i.local_rank >= i.local_world_size) {
    throw Invalid("LOCAL_RANK=" + std::to_string(i.local_rank) +
                  " is not below LOCAL_WORLD_SIZE=" + std::to_string(i.local_world_size));
  }
  if (i.local_world_size > i.world_size) {
    throw Invalid("LOCAL_WORLD_SIZE=" + std::to_string(i.local_world_size) +
                  " is more than WORLD_SIZE=" + std::to_string(i.world_size));
  }
  // Only against a GROUP_WORLD_SIZE that is set: a launcher that exports GROUP_RANK alone is left be.
  if (find(env, "GROUP_WORLD_SIZE") != nullptr && i.group_rank >= i.group_world_size) {
    throw Invalid("GROUP_RANK=" + std::to_string(i.group_rank) +
                  " is not below GROUP_WORLD_SIZE=" + std::to_string(i.group_world_size));
  }
  return i;
}

NcclUniqueId to_public(const worker_env::NcclUniqueId& id) {
  NcclUniqueId out{};
  std::memcpy(out.data(), id.data(), out.size());
  return out;
}

NcclUniqueId nccl_id_impl(const Environment& env) {
  const std::string* v = find(env, "DDPRUN_NCCL_UNIQUE_ID");
  if (v == nullptr) {
    throw NotSet("DDPRUN_NCCL_UNIQUE_ID is not set",
                 "ddprun exports it when the agent can load NCCL (--nccl-id auto|env)");
  }
  try {
    return to_public(worker_env::decode_nccl_id(*v, "DDPRUN_NCCL_UNIQUE_ID"));
  } catch (const ddprun::Error& e) {
    throw Invalid(e.message(), e.hint());
  }
}

std::vector<NcclUniqueId> nccl_ids_impl(const Environment& env) {
  const std::string* v = find(env, "DDPRUN_NCCL_UNIQUE_IDS");
  if (v == nullptr) return {nccl_id_impl(env)};
  std::vector<NcclUniqueId> out;
  try {
    for (const auto& id : worker_env::decode_nccl_id_list(*v, "DDPRUN_NCCL_UNIQUE_IDS")) out.push_back(to_public(id));
  } catch (const ddprun::Error& e) {
    throw Invalid(e.message(), e.hint());
  }
  return out;
}

StoreOptions store_options_impl(const Environment& env) {
  StoreOptions o;
  const std::string* addr = find(env, "MASTER_ADDR");
  if (addr == nullptr) throw NotSet("MASTER_ADDR is not set", "run this program under ddprun or torchrun");
  o.host = std::string(trim(*addr));
  if (o.host.empty()) throw Invalid("MASTER_ADDR is empty");  // not 300 s of retries against ":PORT"
  o.port = static_cast<std::uint16_t>(int_var(env, "MASTER_PORT", std::nullopt, 1, 65535));
  o.world_size = static_cast<int>(int_var(env, "WORLD_SIZE", std::nullopt, 1, 1 << 30));
  o.key_prefix = "/ddprun/attempt_" + std::to_string(int_var(env, "TORCHELASTIC_RESTART_COUNT", 0, 0, 1 << 30)) + "/";
  o.timeout = std::chrono::seconds(int_var(env, "DDPRUN_STORE_TIMEOUT", 300, 1, 86400 * 7));
  if (const std::string* g = find(env, "DDPRUN_STORE_GENERATION")) {
    const std::string t = to_lower(trim(*g));
    if (t == "legacy") {
      o.legacy_protocol = true;
    } else if (t != "modern") {
      throw Invalid("DDPRUN_STORE_GENERATION='" + *g + "' is not legacy or modern");
    }
  }
  return o;
}

// torch's rule (anything but "True"): rank 0 of the workers hosts the store, which this library
// cannot do; a failed connect then says so. Empty when the agent hosts it.
std::string agent_store_note(const Environment& env) {
  const std::string* shared = find(env, "TORCHELASTIC_USE_AGENT_STORE");
  if (shared == nullptr || *shared == "True") return {};
  return "TORCHELASTIC_USE_AGENT_STORE=" + *shared +
         ": rank 0 of the workers is to host the store at MASTER_ADDR:MASTER_PORT "
         "(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), and this library hosts none: start a TCPStore server in rank 0, "
         "or unset the opt-out so that the agent hosts the store";
}

// make() (a connect to the store of `env`), its network errors carrying agent_store_note.
template <class Make>
auto connect_from_env(const Environment& env, Make&& make) -> decltype(make()) {
  try {
    return make();
  } catch (const ddprun::TimeoutError& e) {
    const std::string note = agent_store_note(env);
    if (note.empty()) throw;
    throw ddprun::TimeoutError(e.message(), note);
  } catch (const ddprun::NetworkError& e) {
    const std::string note = agent_store_note(env);
    if (note.empty()) throw;
    throw ddprun::NetworkError(e.message(), note);
  }
}

// One store connection plus the barrier counter; shared by the C++ Store and the C handle.
struct StoreCore {
  explicit StoreCore(const StoreOptions& o) : options(o), client(client_options(o)) {}
  static rendezvous::StoreClientOptions client_options(const StoreOptions& o) {
    rendezvous::StoreClientOptions c;
    c.host = o.host;
    c.port = o.port;
    c.generation = o.legacy_protocol ? rendezvous::Generation::legacy : rendezvous::Generation::modern;
    c.connect_timeout = o.timeout;
    c.timeout = o.timeout;
    c.key_prefix = o.key_prefix;
    return c;
  }
  void barrier_named(const std::string& name, int count) {
    // ADD + WAIT works against every generation (torch 1.13 has no BARRIER op); the last one in
    // publishes "<name>/done".
    const std::string key = "barrier/" + name;
    if (client.add(key, 1) == count) client.set(key + "/done", "1");
    client.wait({key + "/done"});
  }
  void barrier() { barrier_named("auto_" + std::to_string(barriers++), options.world_size); }
  StoreOptions options;
  rendezvous::StoreClient client;
  std::uint64_t barriers = 0;
};

Environment process_env() {
  const auto m = worker_env::current_environment();
  return Environment(m.begin(), m.end());
}

// Runs `f`, turning project exceptions into ddprun::worker::Error.
template <class F>
auto cxx(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const ddprun::worker::Error&) {
    throw;
  } catch (const std::exception& e) {
    throw ddprun::worker::Error(e.what());
  }
}

}  // namespace

Error::Error(const std::string& what) : std::runtime_error(what) {}
Error::~Error() = default;

Info parse_info(const Environment& env) {
  return cxx([&] { return parse_info_impl(env); });
}
Info info() {
  return cxx([] { return parse_info_impl(process_env()); });
}
bool has_nccl_unique_id() { return std::getenv("DDPRUN_NCCL_UNIQUE_ID") != nullptr; }
NcclUniqueId parse_nccl_unique_id(const Environment& env) {
  return cxx([&] { return nccl_id_impl(env); });
}
NcclUniqueId nccl_unique_id() {
  return cxx([] { return nccl_id_impl(process_env()); });
}
std::vector<NcclUniqueId> parse_nccl_unique_ids(const Environment& env) {
  return cxx([&] { return nccl_ids_impl(env); });
}
std::vector<NcclUniqueId> nccl_unique_ids() {
  return cxx([] { return nccl_ids_impl(process_env()); });
}

struct Store::Impl : StoreCore {
  using StoreCore::StoreCore;
};

StoreOptions Store::options_from_env(const Environment& env) {
  return cxx([&] { return store_options_impl(env); });
}
Store Store::from_env() {
  return Store(cxx([] {
    const Environment env = process_env();
    const StoreOptions o = store_options_impl(env);
    return connect_from_env(env, [&] { return std::make_unique<Impl>(o); });
  }));
}
Store::Store(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Store::Store(const StoreOptions& options) : impl_(cxx([&] { return std::make_unique<Impl>(options); })) {}
Store::~Store() = default;
Store::Store(Store&&) noexcept = default;
Store& Store::operator=(Store&&) noexcept = default;

void Store::set(std::string_view key, std::string_view value) {
  cxx([&] { impl_->client.set(key, value); });
}
std::string Store::get(std::string_view key) {
  return cxx([&] { return impl_->client.get(key); });
}
std::int64_t Store::add(std::string_view key, std::int64_t delta) {
  return cxx([&] { return impl_->client.add(key, delta); });
}
bool Store::check(std::string_view key) {
  return cxx([&] { return impl_->client.check({std::string(key)}); });
}
void Store::barrier() {
  cxx([&] { impl_->barrier(); });
}
void Store::barrier(std::string_view name, int count) {
  cxx([&] {
    if (count < 1)
      throw Invalid("barrier '" + std::string(name) + "': count " + std::to_string(count) + " must be >= 1");
    impl_->barrier_named("named_" + std::string(name), count);
  });
}

}  // namespace ddprun::worker

// ---------------------------------------------------------------------------------------------
// C API: the same internals, errors as status codes + a thread-local message.

struct ddprun_store {
  explicit ddprun_store(const ddprun::worker::StoreOptions& o) : core(o) {}
  ddprun::worker::StoreCore core;
};

namespace {

thread_local std::string last_error;

template <class F>
int c_call(F&& f) {
  try {
    f();
    last_error.clear();
    return DDPRUN_OK;
  } catch (const ddprun::worker::NotSet& e) {
    last_error = e.what();
    return DDPRUN_ERR_NOT_SET;
  } catch (const ddprun::TimeoutError& e) {
    last_error = e.what();
    return DDPRUN_ERR_TIMEOUT;
  } catch (const ddprun::NetworkError& e) {
    last_error = e.what();
    return DDPRUN_ERR_NETWORK;
  } catch (const ddprun::Error& e) {
    last_error = e.what();
    return DDPRUN_ERR_INVALID;
  } catch (const std::exception& e) {
    last_error = e.what();
    return DDPRUN_ERR_INTERNAL;
  } catch (...) {
    last_error = "unknown error";
    return DDPRUN_ERR_INTERNAL;
  }
}

int invalid(const char* what) {
  last_error = what;
  return DDPRUN_ERR_INVALID;
}

}  // namespace

extern "C" {

const char* ddprun_last_error(void) { return last_error.c_str(); }

int ddprun_get_info(ddprun_info* out) {
  if (out == nullptr) return invalid("ddprun_get_info: out is NULL");
  return c_call([&] {
    const auto i = ddprun::worker::parse_info_impl(ddprun::worker::process_env());
    if (i.master_addr.size() >= DDPRUN_MAX_ADDR) {
      throw ddprun::worker::Invalid("MASTER_ADDR is longer than " + std::to_string(DDPRUN_MAX_ADDR - 1) + " bytes");
    }
    *out = ddprun_info{};
    out->rank = i.rank;
    out->local_rank = i.local_rank;
    out->world_size = i.world_size;
    out->local_world_size = i.local_world_size;
    out->group_rank = i.group_rank;
    out->group_world_size = i.group_world_size;
    out->restart_count = i.restart_count;
    out->max_restarts = i.max_restarts;
    out->master_port = i.master_port;
    out->cuda_device = i.cuda_device;
    std::memcpy(out->master_addr, i.master_addr.c_str(), i.master_addr.size() + 1);
  });
}

int ddprun_nccl_unique_id(unsigned char out[DDPRUN_NCCL_UNIQUE_ID_BYTES]) {
  if (out == nullptr) return invalid("ddprun_nccl_unique_id: out is NULL");
  return c_call([&] {
    const auto id = ddprun::worker::nccl_id_impl(ddprun::worker::process_env());
    std::memcpy(out, id.data(), id.size());
  });
}

int ddprun_nccl_unique_id_count(int* count) {
  if (count == nullptr) return invalid("ddprun_nccl_unique_id_count: count is NULL");
  return c_call(
      [&] { *count = static_cast<int>(ddprun::worker::nccl_ids_impl(ddprun::worker::process_env()).size()); });
}

int ddprun_nccl_unique_id_at(int index, unsigned char out[DDPRUN_NCCL_UNIQUE_ID_BYTES]) {
  if (out == nullptr) return invalid("ddprun_nccl_unique_id_at: out is NULL");
  return c_call([&] {
    const auto ids = ddprun::worker::nccl_ids_impl(ddprun::worker::process_env());
    if (index < 0 || static_cast<std::size_t>(index) >= ids.size()) {
      throw ddprun::worker::Invalid("NCCL unique ID index " + std::to_string(index) + " is outside [0, " +
                                    std::to_string(ids.size()) + ")");
    }
    std::memcpy(out, ids[static_cast<std::size_t>(index)].data(), DDPRUN_NCCL_UNIQUE_ID_BYTES);
  });
}

int ddprun_store_open(ddprun_store** out) {
  if (out == nullptr) return invalid("ddprun_store_open: out is NULL");
  *out = nullptr;
  return c_call([&] {
    const auto env = ddprun::worker::process_env();
    const auto options = ddprun::worker::store_options_impl(env);
    *out = ddprun::worker::connect_from_env(env, [&] { return new ddprun_store(options); });
  });
}

void ddprun_store_close(ddprun_store* store) { delete store; }

int ddprun_store_set(ddprun_store* store, const char* key, const void* value, size_t len) {
  if (store == nullptr || key == nullptr || (value == nullptr && len > 0))
    return invalid("ddprun_store_set: NULL argument");
  return c_call([&] { store->core.client.set(key, std::string_view(static_cast<const char*>(value), len)); });
}

int ddprun_store_get(ddprun_store* store, const char* key, void* buf, size_t cap, size_t* len) {
  if (store == nullptr || key == nullptr || len == nullptr || (buf == nullptr && cap > 0)) {
    return invalid("ddprun_store_get: NULL argument");
  }
  std::string value;
  const int rc = c_call([&] { value = store->core.client.get(key); });
  if (rc != DDPRUN_OK) return rc;
  *len = value.size();
  if (value.size() > cap) {
    last_error = "ddprun_store_get: value of '" + std::string(key) + "' has " + std::to_string(value.size()) +
                 " bytes, buffer " + std::to_string(cap);
    return DDPRUN_ERR_BUFFER;
  }
  if (!value.empty()) std::memcpy(buf, value.data(), value.size());
  return DDPRUN_OK;
}

int ddprun_store_add(ddprun_store* store, const char* key, int64_t delta, int64_t* result) {
  if (store == nullptr || key == nullptr) return invalid("ddprun_store_add: NULL argument");
  return c_call([&] {
    const auto v = store->core.client.add(key, delta);
    if (result != nullptr) *result = v;
  });
}

int ddprun_store_barrier(ddprun_store* store) {
  if (store == nullptr) return invalid("ddprun_store_barrier: store is NULL");
  return c_call([&] { store->core.barrier(); });
}

}  // extern "C"
