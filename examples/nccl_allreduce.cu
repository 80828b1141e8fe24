// nccl_allreduce: one NCCL all-reduce with the ncclUniqueId ddprun exports (GPU nodes only).
//
//   ddprun --standalone --nproc-per-node gpu ./nccl_allreduce
//
// Uses DDPRUN_NCCL_UNIQUE_ID (no store round trip for the ID), or NCCL_COMM_ID under
// --nccl-id comm-id, and DDPRUN_CUDA_DEVICE for the device; sums rank+1 over all ranks and
// checks world*(world+1)/2. Exit 1 if wrong.
#include <cuda_runtime.h>
#include <ddprun/worker.h>
#include <nccl.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#define CHECK_CUDA(x)                                               \
  do {                                                              \
    cudaError_t e_ = (x);                                           \
    if (e_ != cudaSuccess) {                                        \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_)); \
      return 2;                                                     \
    }                                                               \
  } while (0)
#define CHECK_NCCL(x)                                               \
  do {                                                              \
    ncclResult_t r_ = (x);                                          \
    if (r_ != ncclSuccess) {                                        \
      std::fprintf(stderr, "%s: %s\n", #x, ncclGetErrorString(r_)); \
      return 2;                                                     \
    }                                                               \
  } while (0)

int main() {
  ddprun_info info;
  if (ddprun_get_info(&info) != DDPRUN_OK) {
    std::fprintf(stderr, "nccl_allreduce: %s\n", ddprun_last_error());
    return 2;
  }
  ncclUniqueId id;
  static_assert(sizeof id.internal == DDPRUN_NCCL_UNIQUE_ID_BYTES, "ncclUniqueId size");
  if (std::getenv("DDPRUN_NCCL_UNIQUE_ID") == nullptr && std::getenv("NCCL_COMM_ID") != nullptr) {
    // --nccl-id comm-id: NCCL builds the ID from NCCL_COMM_ID, the same on every rank, and rank 0
    // listens at that address in ncclCommInitRank.
    CHECK_NCCL(ncclGetUniqueId(&id));
  } else if (ddprun_nccl_unique_id(reinterpret_cast<unsigned char*>(id.internal)) != DDPRUN_OK) {
    std::fprintf(stderr, "nccl_allreduce: %s\n", ddprun_last_error());
    return 2;
  }
  CHECK_CUDA(cudaSetDevice(info.cuda_device));
  ncclComm_t comm;
  CHECK_NCCL(ncclCommInitRank(&comm, info.world_size, id, info.rank));
  float* buf = nullptr;
  CHECK_CUDA(cudaMalloc(&buf, sizeof(float)));
  const float mine = static_cast<float>(info.rank + 1);
  CHECK_CUDA(cudaMemcpy(buf, &mine, sizeof mine, cudaMemcpyHostToDevice));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  CHECK_NCCL(ncclAllReduce(buf, buf, 1, ncclFloat, ncclSum, comm, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  float sum = 0;
  CHECK_CUDA(cudaMemcpy(&sum, buf, sizeof sum, cudaMemcpyDeviceToHost));
  const float expected = static_cast<float>(info.world_size) * static_cast<float>(info.world_size + 1) / 2.0f;
  const bool ok = sum == expected;
  std::printf("rank %d/%d on cuda:%d: sum=%g expected=%g %s\n", info.rank, info.world_size, info.cuda_device, sum,
              expected, ok ? "OK" : "WRONG");
  ncclCommDestroy(comm);
  cudaFree(buf);
  return ok ? 0 : 1;
}
