// The worker library's C++ API on a real GPU (run.sh builds it with nvcc): info(), the exported
// NCCL unique ID (or NCCL_COMM_ID under --nccl-id comm-id), a store barrier over the agent's
// store, and one NCCL all-reduce of rank+1. Prints one line ending in OK, or exits non-zero.
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ddprun/worker.hpp>
#include <stdexcept>
#include <string>

namespace {

void cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

void nccl(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw std::runtime_error(std::string(what) + ": " + ncclGetErrorString(r));
}

}  // namespace

int main() try {
  const auto info = ddprun::worker::info();
  ncclUniqueId id;
  const char* source = "DDPRUN_NCCL_UNIQUE_ID";
  if (ddprun::worker::has_nccl_unique_id()) {
    const auto raw = ddprun::worker::nccl_unique_id();
    static_assert(sizeof id.internal == std::tuple_size<ddprun::worker::NcclUniqueId>::value, "ncclUniqueId size");
    std::memcpy(id.internal, raw.data(), raw.size());
  } else if (std::getenv("NCCL_COMM_ID") != nullptr) {
    source = "NCCL_COMM_ID";
    nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
  } else {
    throw std::runtime_error("neither DDPRUN_NCCL_UNIQUE_ID nor NCCL_COMM_ID is set");
  }
  auto store = ddprun::worker::Store::from_env();
  store.add("arrived", 1);
  store.barrier();

  cuda(cudaSetDevice(info.cuda_device), "cudaSetDevice");
  ncclComm_t comm;
  nccl(ncclCommInitRank(&comm, info.world_size, id, info.rank), "ncclCommInitRank");
  double* buf = nullptr;
  cuda(cudaMalloc(&buf, sizeof(double)), "cudaMalloc");
  const double mine = info.rank + 1;
  cuda(cudaMemcpy(buf, &mine, sizeof mine, cudaMemcpyHostToDevice), "cudaMemcpy");
  nccl(ncclAllReduce(buf, buf, 1, ncclDouble, ncclSum, comm, nullptr), "ncclAllReduce");
  cuda(cudaStreamSynchronize(nullptr), "cudaStreamSynchronize");
  double sum = 0;
  cuda(cudaMemcpy(&sum, buf, sizeof sum, cudaMemcpyDeviceToHost), "cudaMemcpy");
  nccl(ncclCommDestroy(comm), "ncclCommDestroy");
  cuda(cudaFree(buf), "cudaFree");
  const double expected = info.world_size * (info.world_size + 1) / 2.0;
  const bool ok = sum == expected && store.add("arrived", 0) == info.world_size;
  std::printf("c++ worker rank %d/%d cuda:%d id from %s: sum=%g expected=%g %s\n", info.rank, info.world_size,
              info.cuda_device, source, sum, expected, ok ? "OK" : "WRONG");
  return ok ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "nccl_worker: %s\n", e.what());
  return 2;
}
