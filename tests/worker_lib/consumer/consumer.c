/* Tiny C consumer of the installed worker library. */
#include <ddprun/worker.h>
#include <stdio.h>

int main(void) {
  ddprun_info info;
  unsigned char id[DDPRUN_NCCL_UNIQUE_ID_BYTES];
  if (ddprun_get_info(&info) != DDPRUN_OK) {
    fprintf(stderr, "c error: %s\n", ddprun_last_error());
    return 1;
  }
  printf("c rank=%d/%d local=%d/%d master=%s:%d", info.rank, info.world_size, info.local_rank, info.local_world_size,
         info.master_addr, info.master_port);
  if (ddprun_nccl_unique_id(id) == DDPRUN_OK) printf(" nccl=%02x%02x", id[0], id[127]);
  printf("\n");
  return 0;
}
