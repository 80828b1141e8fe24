/* ddprun worker library, C API (usable from C, C++ and CUDA). See ddprun/worker.hpp and
 * docs/gpus.md. Every function returns DDPRUN_OK (0) or an error code; ddprun_last_error()
 * then returns a message naming the variable or address (valid until the next call on the
 * same thread; thread-local). A ddprun_store must not be used by two threads at once. */
#ifndef DDPRUN_WORKER_H
#define DDPRUN_WORKER_H

#include <stddef.h>
#include <stdint.h>

#include "ddprun/worker_export.h"

#ifdef __cplusplus
extern "C" {
#endif

enum ddprun_status {
  DDPRUN_OK = 0,
  DDPRUN_ERR_NOT_SET = 1, /* a required variable is missing */
  DDPRUN_ERR_INVALID = 2, /* malformed variable or bad argument */
  DDPRUN_ERR_NETWORK = 3, /* store unreachable / connection lost */
  DDPRUN_ERR_TIMEOUT = 4, /* get/barrier ran past the timeout */
  DDPRUN_ERR_BUFFER = 5,  /* value larger than the buffer (*len says how large) */
  DDPRUN_ERR_INTERNAL = 6
};

#define DDPRUN_NCCL_UNIQUE_ID_BYTES 128
#define DDPRUN_MAX_ADDR 256

typedef struct ddprun_info {
  int rank, local_rank, world_size, local_world_size;
  int group_rank, group_world_size;
  int restart_count, max_restarts;
  int master_port;
  int cuda_device; /* DDPRUN_CUDA_DEVICE, else local_rank */
  char master_addr[DDPRUN_MAX_ADDR];
} ddprun_info;

DDPRUN_WORKER_API const char* ddprun_last_error(void);

DDPRUN_WORKER_API int ddprun_get_info(ddprun_info* out);
/* DDPRUN_NCCL_UNIQUE_ID into out[128]; DDPRUN_ERR_NOT_SET when unset. */
DDPRUN_WORKER_API int ddprun_nccl_unique_id(unsigned char out[DDPRUN_NCCL_UNIQUE_ID_BYTES]);
/* Number of IDs in DDPRUN_NCCL_UNIQUE_IDS (or 1 for a single DDPRUN_NCCL_UNIQUE_ID). */
DDPRUN_WORKER_API int ddprun_nccl_unique_id_count(int* count);
DDPRUN_WORKER_API int ddprun_nccl_unique_id_at(int index, unsigned char out[DDPRUN_NCCL_UNIQUE_ID_BYTES]);

typedef struct ddprun_store ddprun_store;
/* Connects to MASTER_ADDR:MASTER_PORT (see ddprun::worker::Store::from_env). */
DDPRUN_WORKER_API int ddprun_store_open(ddprun_store** out);
DDPRUN_WORKER_API void ddprun_store_close(ddprun_store* store);
DDPRUN_WORKER_API int ddprun_store_set(ddprun_store* store, const char* key, const void* value, size_t len);
/* Waits for `key`; copies up to `cap` bytes into `buf` and the value's size into *len. */
DDPRUN_WORKER_API int ddprun_store_get(ddprun_store* store, const char* key, void* buf, size_t cap, size_t* len);
DDPRUN_WORKER_API int ddprun_store_add(ddprun_store* store, const char* key, int64_t delta, int64_t* result);
DDPRUN_WORKER_API int ddprun_store_barrier(ddprun_store* store);

#ifdef __cplusplus
}
#endif
#endif /* DDPRUN_WORKER_H */
