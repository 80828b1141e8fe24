// Tiny C++ consumer of the installed worker library: prints what it read from the environment.
#include <ddprun/worker.hpp>
#include <cstdio>

int main() {
  try {
    const auto info = ddprun::worker::info();
    std::printf("cxx rank=%d/%d local=%d/%d master=%s:%u", info.rank, info.world_size, info.local_rank,
                info.local_world_size, info.master_addr.c_str(), static_cast<unsigned>(info.master_port));
    if (ddprun::worker::has_nccl_unique_id()) {
      const auto id = ddprun::worker::nccl_unique_id();
      std::printf(" nccl=%02x%02x", id[0], id[127]);
    }
    std::printf("\n");
    return 0;
  } catch (const ddprun::worker::Error& e) {
    std::fprintf(stderr, "cxx error: %s\n", e.what());
    return 1;
  }
}
