// native_allreduce: a CPU "all-reduce" through the job's store, using the ddprun worker library.
//
//   ddprun --standalone --nproc-per-node 4 ./native_allreduce
//
// Every rank adds rank+1 to a shared counter, publishes a per-rank value, waits at a barrier,
// then checks the sum (world*(world+1)/2) and its neighbour's value. Exits 1 on a wrong result.
#include <ddprun/worker.hpp>

#include <cstdio>
#include <string>

int main() {
  try {
    const auto info = ddprun::worker::info();
    auto store = ddprun::worker::Store::from_env();
    store.add("sum", info.rank + 1);
    store.set("value/" + std::to_string(info.rank), std::to_string(info.rank * info.rank));
    store.barrier();

    const std::int64_t sum = store.add("sum", 0);
    const std::int64_t expected = static_cast<std::int64_t>(info.world_size) * (info.world_size + 1) / 2;
    const int peer = (info.rank + 1) % info.world_size;
    const std::string peer_value = store.get("value/" + std::to_string(peer));
    const bool ok = sum == expected && peer_value == std::to_string(peer * peer);
    std::printf("rank %d/%d (local %d, restart %d): sum=%lld expected=%lld peer %d value=%s %s\n", info.rank,
                info.world_size, info.local_rank, info.restart_count, static_cast<long long>(sum),
                static_cast<long long>(expected), peer, peer_value.c_str(), ok ? "OK" : "WRONG");
    std::fflush(stdout);
    // A last barrier so no rank leaves (and the agent tears the store down) while others read.
    store.barrier();
    return ok ? 0 : 1;
  } catch (const ddprun::worker::Error& e) {
    std::fprintf(stderr, "native_allreduce: %s\n", e.what());
    return 2;
  }
}
