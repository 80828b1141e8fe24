/* A fake NVML (libnvidia-ml) for tests: loaded through DDPRUN_NVML_LIBRARY.
 * FAKE_NVML_COUNT   number of devices (default 4)
 * FAKE_NVML_FAIL    "init" -> nvmlInit_v2 fails (NVML_ERROR_DRIVER_NOT_LOADED = 9)
 * Device i: UUID GPU-dead000<i>-0000-4000-8000-00000000000<i>, PCI bus id 00000000:<1A+16i>:00.0,
 * name "Fake GPU" (one model, as on a cluster node). Only the symbols ddprun uses. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
  char busIdLegacy[16];
  unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
  char busId[32];
} fake_pci_info;

static int fake_count(void) {
  const char* c = getenv("FAKE_NVML_COUNT");
  return c ? atoi(c) : 4;
}

int nvmlInit_v2(void) {
  const char* f = getenv("FAKE_NVML_FAIL");
  return (f && strcmp(f, "init") == 0) ? 9 : 0;
}
int nvmlShutdown(void) { return 0; }
const char* nvmlErrorString(int r) { return r == 9 ? "Driver Not Loaded" : "Unknown Error"; }
int nvmlDeviceGetCount_v2(unsigned int* n) {
  *n = (unsigned int)fake_count();
  return 0;
}
int nvmlDeviceGetHandleByIndex_v2(unsigned int i, void** h) {
  if ((int)i >= fake_count()) return 2; /* NVML_ERROR_INVALID_ARGUMENT */
  *h = (void*)(size_t)(i + 1);
  return 0;
}
int nvmlDeviceGetUUID(void* h, char* buf, unsigned int len) {
  unsigned int i = (unsigned int)(size_t)h - 1;
  snprintf(buf, len, "GPU-dead%04x-0000-4000-8000-%012x", i, i);
  return 0;
}
int nvmlDeviceGetName(void* h, char* buf, unsigned int len) {
  (void)h;
  snprintf(buf, len, "Fake GPU");
  return 0;
}
int nvmlDeviceGetPciInfo_v3(void* h, fake_pci_info* p) {
  unsigned int i = (unsigned int)(size_t)h - 1;
  memset(p, 0, sizeof *p);
  p->bus = 0x1a + 16 * i;
  snprintf(p->busId, sizeof p->busId, "00000000:%02X:00.0", p->bus);
  snprintf(p->busIdLegacy, sizeof p->busIdLegacy, "0000:%02X:00.0", p->bus);
  return 0;
}
