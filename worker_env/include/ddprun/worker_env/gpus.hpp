#pragma once
// GPU discovery and per-worker GPU selection (docs/gpus.md).
//
// Two halves:
//  * probe_gpus(): the only I/O here. Loads NVML (libnvidia-ml.so.1) or, failing that, the CUDA
//    driver (libcuda.so.1) with dlopen (no link-time dependency) and lists the node's physical
//    devices. Test override: env DDPRUN_NVML_LIBRARY=/path/lib.so (and DDPRUN_CUDA_LIBRARY) name
//    the library to load instead; DDPRUN_NVML_LIBRARY=none / DDPRUN_CUDA_LIBRARY=none skip it.
//  * everything else is pure: CUDA_VISIBLE_DEVICES parsing with CUDA's rules, resolution of a
//    --gpus list against the visible devices, and plan_gpus(), which turns (parent env,
//    inventory, --gpus, mode, nproc, sharing) into per-local-rank environment additions plus a
//    device description for --dry-run. Errors are UsageError naming the flag or variable.
//
// Thread safety: the pure functions are reentrant. probe_gpus() calls nvmlInit/nvmlShutdown
// (or cuInit) in the calling process; call it once, from one thread, before spawning workers.
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ddprun/worker_env/worker_env.hpp"

namespace ddprun::worker_env {

// One usable entry of CUDA_VISIBLE_DEVICES, as CUDA reads it.
struct CvdEntry {
  enum class Kind { index, gpu_uuid, mig };
  Kind kind = Kind::index;
  std::string text;  // the entry as written (trimmed): "3", "GPU-8f2a", "MIG-…"
  int index = -1;    // for Kind::index
};

// CUDA's reading of CUDA_VISIBLE_DEVICES, syntax only: a comma list of non-negative indices,
// GPU-<uuid or unambiguous prefix>, MIG-<…>. Empty (or blank) means no devices. The list ends
// at the first invalid entry (CUDA stops enumerating there): "0,2,-1,1" -> [0, 2]. A repeated
// entry is invalid too (CUDA refuses duplicates), so it also ends the list.
std::vector<CvdEntry> parse_cuda_visible_devices(std::string_view value);

// A physical device as NVML numbers it (PCI bus order, the order nvidia-smi shows and
// CUDA_DEVICE_ORDER=PCI_BUS_ID uses).
struct GpuDevice {
  int index = 0;
  std::string uuid;        // "GPU-xxxxxxxx-xxxx-…" (empty when unknown)
  std::string pci_bus_id;  // sysfs form, "0000:3b:00.0" (empty when unknown)
  std::string name;        // "NVIDIA H100 80GB HBM3" (may be empty)
};

struct GpuInventory {
  std::vector<GpuDevice> devices;  // physical devices, index order; empty: none found
  // Where the list came from: "nvml:<path>", "cuda:<path>" or "none".
  std::string source = "none";
  // Why nothing was found (libraries tried and their errors); empty when devices were found.
  std::string diagnostic;
  // False when the probe found no GPU and the machine shows no NVIDIA device either
  // (nvidia_device_present): a CPU-only machine, whatever CUDA_VISIBLE_DEVICES says.
  bool device_nodes = true;
  // Where no NVIDIA GPU was found: the AMD GPUs (ROCm) of the kernel's KFD topology, in its node
  // order (HIP's device order), each as its UUID "GPU-<16 hex digits>" ("" when the kernel
  // gives none). Only counted (--nproc-per-node gpu|auto), not planned: no isolation yet.
  std::vector<std::string> amd_gpus;
};

// Lists the node's GPUs: NVML first (DDPRUN_NVML_LIBRARY or libnvidia-ml.so.1), then the CUDA
// driver (DDPRUN_CUDA_LIBRARY or libcuda.so.1; only when `env` has no CUDA_VISIBLE_DEVICES,
// since the driver applies it and would hide devices). Never throws: a node without a driver
// gets an empty inventory with a diagnostic.
GpuInventory probe_gpus(const EnvMap& env);

// The AMD GPUs of a KFD topology directory (/sys/class/kfd/kfd/topology/nodes): the nodes, in
// number order, whose `properties` give a `simd_count` above 0 (CPU nodes give 0) and whose
// render node `<dri_dir>/renderD<drm_render_minor>` this process may open (read and write
// access; as ROCm, which opens it: a container sees every node but only the render nodes it was
// given), each as "GPU-" and the 16 hex digits of its `unique_id` ("" without one). Empty when
// the directory is missing (no amdgpu driver), or when `<dri_dir>/../kfd` (/dev/kfd, which ROCm
// opens first) may not be opened. No library loaded.
std::vector<std::string> kfd_gpus(const std::string& nodes_dir, const std::string& dri_dir = "/dev/dri");

// How many of `gpus` (kfd_gpus) a HIP program started with `env` sees: ROCR_VISIBLE_DEVICES
// selects among them first, then HIP_VISIBLE_DEVICES, or CUDA_VISIBLE_DEVICES when that is unset,
// among those. Each list is read with CUDA's rules (parse_cuda_visible_devices): ordinals, or
// GPU-<UUID prefix> matched against the UUIDs, ending at the first entry that names no device.
int count_visible_amd_gpus(const EnvMap& env, const std::vector<std::string>& gpus);

// A cheap "could a worker use an NVIDIA GPU here?" without loading any library: false when
// CUDA_VISIBLE_DEVICES is set and names nothing; otherwise (set or not) whether the driver shows
// a device (nvidia_device_present). `root` is for tests. Used by --nccl-id auto, so CPU-only jobs
// do not pay for an NCCL unique ID nobody can use. `why` (optional) gets a reason when false.
bool nvidia_gpu_visible(const EnvMap& env, const std::string& root = "", std::string* why = nullptr);

// Whether the driver shows an NVIDIA device: an entry in `<root>/proc/driver/nvidia/gpus/`,
// `<root>/dev/nvidia0`, another `/dev/nvidiaN` beside `/dev/nvidiactl` (a container given one
// GPU may have /dev/nvidia2 alone; /dev is listed only where the control node, which CUDA opens
// first, is there), a Jetson's `/dev/nvhost-*-gpu` or WSL2's `/dev/dxg`. No library loaded.
bool nvidia_device_present(const std::string& root = "");
inline constexpr const char* kNoNvidiaDevice =
    "no /proc/driver/nvidia/gpus/*, no /dev/nvidiaN (with /dev/nvidiactl), /dev/nvhost-*-gpu or /dev/dxg";

// A device a CUDA program started with the parent's environment would see, in CUDA ordinal
// order (cuda:0, cuda:1, …).
struct VisibleDevice {
  std::string token;                // how to name it in a child's CUDA_VISIBLE_DEVICES (physical index or UUID)
  std::optional<GpuDevice> device;  // the inventory entry, when one matches
};

// The devices visible under `cvd` (nullopt: CUDA_VISIBLE_DEVICES unset -> every inventory
// device). Against a non-empty inventory, entries are resolved as CUDA does: an index past the
// device count, an unknown or ambiguous UUID prefix, or a device named twice ends the list.
// With an empty inventory (no NVML) the syntactic parse is taken as is.
std::vector<VisibleDevice> visible_devices(const std::optional<std::string>& cvd, const GpuInventory& inventory);

// How many GPUs a worker started with `cvd` would see; what `--nproc-per-node gpu` counts.
int count_visible_gpus(const std::optional<std::string>& cvd, const GpuInventory& inventory);

// `--nproc-per-node gpu|auto` with the inventory: gpu -> the visible count (UsageError naming
// `what` when there is none, with the probe's diagnostic); auto -> the visible count, or
// `online_cpus` when there is no GPU. Other values are not handled here (nullopt).
std::optional<int> nproc_for_device_kind(std::string_view value, std::string_view what,
                                         const std::optional<std::string>& cvd, const GpuInventory& inventory,
                                         int online_cpus);

enum class GpuMode {
  shared,              // torchrun default: every worker sees the whole selected list, uses LOCAL_RANK
  isolate,             // each worker's CUDA_VISIBLE_DEVICES is exactly its own device (cuda:0)
  virtual_local_rank,  // torchrun --virtual-local-rank: isolate + LOCAL_RANK=0
};

struct GpuRequest {
  std::optional<std::string> parent_cvd;           // the agent's CUDA_VISIBLE_DEVICES (nullopt: unset)
  std::optional<std::string> parent_device_order;  // the agent's CUDA_DEVICE_ORDER (nullopt: unset)
  GpuInventory inventory;                          // from probe_gpus (may be empty)
  std::optional<std::string> gpus;                 // --gpus LIST: ordinals of visible devices or UUID (prefixes)
  GpuMode mode = GpuMode::shared;
  int nproc = 1;                // workers on this node
  bool allow_sharing = false;   // isolate/virtual/--gpus: allow more workers than devices (round robin)
  bool bus_order_used = false;  // the caller places work by the devices' bus ids (--numa-binding)
};

struct GpuPlan {
  std::vector<VisibleDevice> selected;  // the devices the job uses, in order
  // Per local rank: variables to add on top of build_worker_env's (they win: append them after
  // it before merge_env). Contains CUDA_VISIBLE_DEVICES when it changes, CUDA_DEVICE_ORDER=
  // PCI_BUS_ID when unset and ddprun names devices (--gpus, isolation) or bus_order_used,
  // LOCAL_RANK=0 in virtual mode, and
  // DDPRUN_CUDA_DEVICE (the ordinal the worker should use: LOCAL_RANK % n shared, 0 isolated).
  std::vector<EnvList> per_rank_env;
  std::vector<std::string> per_rank_device;  // --dry-run column: "cuda:1 = GPU 3 (GPU-8f2a…, 0000:3b:00.0)"
  std::string summary;                       // one line: what was selected and from where
};

// What a node can check of a --gpus list without its devices: not empty; every entry an
// ordinal (0, 1, ...), GPU-<UUID or prefix> or MIG-<...>; no entry twice. Throws UsageError
// naming --gpus. plan_gpus starts with it; the fan-out launcher applies it before contacting
// any host, whose agent then checks the entries against its devices.
void check_gpus_list(std::string_view text);

// The GPU part of every worker's environment. Pure. Throws UsageError naming --gpus,
// --nproc-per-node or CUDA_VISIBLE_DEVICES: an unknown/ambiguous/out-of-range/duplicate --gpus
// entry, --gpus with an empty selection, isolation (or --gpus) with more workers than devices
// and !allow_sharing, isolation with no GPU at all. With no GPU and no --gpus in shared mode the
// plan is empty (CPU job): per_rank_env holds empty lists, per_rank_device says "cpu".
GpuPlan plan_gpus(const GpuRequest& request);

// Parses --gpu-mode style values: "shared" | "isolate" | "virtual"; UsageError naming `what`.
GpuMode parse_gpu_mode(std::string_view text, std::string_view what);

}  // namespace ddprun::worker_env
