// GPU discovery through dlopen'd NVML or the CUDA driver (docs/gpus.md). The few NVML/CUDA
// types are declared here so nothing links against the NVIDIA libraries: the launcher runs on
// CPU-only nodes.
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>

#include "ddprun/common/strings.hpp"
#include "ddprun/worker_env/gpus.hpp"

namespace ddprun::worker_env {

namespace {

// --- NVML (nvml.h), only what is used ---
using NvmlReturn = int;  // nvmlReturn_t; 0 = NVML_SUCCESS
using NvmlDevice = void*;
struct NvmlPciInfo {  // nvmlPciInfo_t (v3 layout, NVML >= 11)
  char bus_id_legacy[16];
  unsigned int domain;
  unsigned int bus;
  unsigned int device;
  unsigned int pci_device_id;
  unsigned int pci_sub_system_id;
  char bus_id[32];
};
using NvmlInit = NvmlReturn (*)();
using NvmlShutdown = NvmlReturn (*)();
using NvmlGetCount = NvmlReturn (*)(unsigned int*);
using NvmlGetHandle = NvmlReturn (*)(unsigned int, NvmlDevice*);
using NvmlGetString = NvmlReturn (*)(NvmlDevice, char*, unsigned int);
using NvmlGetPci = NvmlReturn (*)(NvmlDevice, NvmlPciInfo*);
using NvmlErrorString = const char* (*)(NvmlReturn);

// --- CUDA driver (cuda.h) ---
using CuResult = int;
using CuInit = CuResult (*)(unsigned int);
using CuGetCount = CuResult (*)(int*);
using CuGet = CuResult (*)(int*, int);
using CuGetUuid = CuResult (*)(std::array<unsigned char, 16>*, int);
using CuGetPci = CuResult (*)(char*, int, int);
using CuGetName = CuResult (*)(char*, int, int);

class Library {
 public:
  explicit Library(const std::string& path) : handle_(dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL)) {
    if (handle_ == nullptr) {
      const char* e = dlerror();
      error_ = e != nullptr ? e : "dlopen failed";
    }
  }
  ~Library() {
    // NVML and the driver keep threads and handlers around; unloading them is not safe.
  }
  Library(const Library&) = delete;
  Library& operator=(const Library&) = delete;
  bool ok() const { return handle_ != nullptr; }
  const std::string& error() const { return error_; }
  template <class F>
  F sym(const char* name) const {
    void* p = dlsym(handle_, name);
    return reinterpret_cast<F>(p);  // NOLINT: dlsym returns object pointers for functions
  }

 private:
  void* handle_;
  std::string error_;
};

// "00000000:3B:00.0" (NVML) or "0000:3B:00.0" (CUDA) -> "0000:3b:00.0" (sysfs).
std::string normalize_bus_id(std::string_view id) {
  std::string s = to_lower(trim(std::string(id.data(), strnlen(id.data(), id.size()))));
  const auto colon = s.find(':');
  if (colon != std::string::npos && colon > 4) s = s.substr(colon - 4);
  return s;
}

std::string format_uuid(const std::array<unsigned char, 16>& b) {
  std::string hex = to_hex(std::string_view(reinterpret_cast<const char*>(b.data()), b.size()));
  return "GPU-" + hex.substr(0, 8) + "-" + hex.substr(8, 4) + "-" + hex.substr(12, 4) + "-" + hex.substr(16, 4) + "-" +
         hex.substr(20);
}

std::optional<std::string> env_value(const EnvMap& env, const std::string& name) {
  const auto it = env.find(name);
  if (it == env.end()) return std::nullopt;
  return it->second;
}

bool probe_nvml(const std::string& path, GpuInventory& inv, std::string& why) {
  Library lib(path);
  if (!lib.ok()) {
    why = "NVML " + path + ": " + lib.error();
    return false;
  }
  auto init = lib.sym<NvmlInit>("nvmlInit_v2");
  auto shutdown = lib.sym<NvmlShutdown>("nvmlShutdown");
  auto get_count = lib.sym<NvmlGetCount>("nvmlDeviceGetCount_v2");
  auto get_handle = lib.sym<NvmlGetHandle>("nvmlDeviceGetHandleByIndex_v2");
  auto get_uuid = lib.sym<NvmlGetString>("nvmlDeviceGetUUID");
  auto get_name = lib.sym<NvmlGetString>("nvmlDeviceGetName");
  auto get_pci = lib.sym<NvmlGetPci>("nvmlDeviceGetPciInfo_v3");
  auto error_string = lib.sym<NvmlErrorString>("nvmlErrorString");
  if (init == nullptr || get_count == nullptr || get_handle == nullptr) {
    why = "NVML " + path + ": nvmlInit_v2/nvmlDeviceGetCount_v2/nvmlDeviceGetHandleByIndex_v2 missing";
    return false;
  }
  auto err = [&](NvmlReturn r) {
    const char* s = error_string != nullptr ? error_string(r) : nullptr;
    return s != nullptr ? std::string(s) : "error " + std::to_string(r);
  };
  if (const auto r = init(); r != 0) {
    why = "NVML " + path + ": nvmlInit_v2: " + err(r);
    return false;
  }
  unsigned int count = 0;
  if (const auto r = get_count(&count); r != 0) {
    why = "NVML " + path + ": nvmlDeviceGetCount_v2: " + err(r);
    if (shutdown != nullptr) shutdown();
    return false;
  }
  for (unsigned int i = 0; i < count; ++i) {
    GpuDevice d;
    d.index = static_cast<int>(i);
    NvmlDevice h = nullptr;
    if (get_handle(i, &h) == 0) {
      std::array<char, 96> buf{};
      if (get_uuid != nullptr && get_uuid(h, buf.data(), static_cast<unsigned int>(buf.size())) == 0) {
        d.uuid = std::string(buf.data(), strnlen(buf.data(), buf.size()));
      }
      buf.fill('\0');
      if (get_name != nullptr && get_name(h, buf.data(), static_cast<unsigned int>(buf.size())) == 0) {
        d.name = std::string(buf.data(), strnlen(buf.data(), buf.size()));
      }
      NvmlPciInfo pci{};
      if (get_pci != nullptr && get_pci(h, &pci) == 0) {
        d.pci_bus_id = normalize_bus_id(std::string_view(pci.bus_id, sizeof pci.bus_id));
      }
    }
    inv.devices.push_back(std::move(d));
  }
  if (shutdown != nullptr) shutdown();
  inv.source = "nvml:" + path;
  if (count == 0) why = "NVML " + path + ": 0 devices";
  return count > 0;
}

bool probe_cuda(const std::string& path, GpuInventory& inv, std::string& why) {
  Library lib(path);
  if (!lib.ok()) {
    why = "CUDA driver " + path + ": " + lib.error();
    return false;
  }
  auto init = lib.sym<CuInit>("cuInit");
  auto get_count = lib.sym<CuGetCount>("cuDeviceGetCount");
  auto get = lib.sym<CuGet>("cuDeviceGet");
  auto get_uuid = lib.sym<CuGetUuid>("cuDeviceGetUuid_v2");
  auto get_pci = lib.sym<CuGetPci>("cuDeviceGetPCIBusId");
  auto get_name = lib.sym<CuGetName>("cuDeviceGetName");
  if (init == nullptr || get_count == nullptr) {
    why = "CUDA driver " + path + ": cuInit/cuDeviceGetCount missing";
    return false;
  }
  if (const auto r = init(0); r != 0) {
    why = "CUDA driver " + path + ": cuInit failed (CUresult " + std::to_string(r) + ")";
    return false;
  }
  int count = 0;
  if (get_count(&count) != 0 || count <= 0) {
    why = "CUDA driver " + path + ": no devices";
    return false;
  }
  std::vector<GpuDevice> devs;
  for (int i = 0; i < count; ++i) {
    GpuDevice d;
    int dev = i;
    if (get != nullptr) get(&dev, i);
    std::array<unsigned char, 16> uuid{};
    if (get_uuid != nullptr && get_uuid(&uuid, dev) == 0) d.uuid = format_uuid(uuid);
    std::array<char, 64> buf{};
    if (get_pci != nullptr && get_pci(buf.data(), static_cast<int>(buf.size()), dev) == 0) {
      d.pci_bus_id = normalize_bus_id(std::string_view(buf.data(), buf.size()));
    }
    buf.fill('\0');
    if (get_name != nullptr && get_name(buf.data(), static_cast<int>(buf.size()), dev) == 0) {
      d.name = std::string(buf.data(), strnlen(buf.data(), buf.size()));
    }
    devs.push_back(std::move(d));
  }
  // The driver enumerates FASTEST_FIRST unless told otherwise; NVML/PCI order is what
  // CUDA_DEVICE_ORDER=PCI_BUS_ID (exported to workers that ddprun names devices to) uses, so
  // renumber by bus id.
  std::stable_sort(devs.begin(), devs.end(),
                   [](const GpuDevice& a, const GpuDevice& b) { return a.pci_bus_id < b.pci_bus_id; });
  for (std::size_t i = 0; i < devs.size(); ++i) devs[i].index = static_cast<int>(i);
  inv.devices = std::move(devs);
  inv.source = "cuda:" + path;
  return true;
}

}  // namespace

GpuInventory probe_gpus(const EnvMap& env) {
  GpuInventory inv;
  std::string diag;
  auto note = [&diag](const std::string& s) {
    if (!s.empty()) diag += (diag.empty() ? "" : "; ") + s;
  };
  const std::string nvml = env_value(env, "DDPRUN_NVML_LIBRARY").value_or("libnvidia-ml.so.1");
  if (nvml != "none") {
    std::string why;
    if (probe_nvml(nvml, inv, why)) return inv;
    note(why);
    inv.devices.clear();
  }
  const std::string cuda = env_value(env, "DDPRUN_CUDA_LIBRARY").value_or("libcuda.so.1");
  if (cuda != "none") {
    if (env.count("CUDA_VISIBLE_DEVICES") != 0) {
      note("CUDA driver not asked: it would apply CUDA_VISIBLE_DEVICES");
    } else {
      std::string why;
      if (probe_cuda(cuda, inv, why)) return inv;
      note(why);
      inv.devices.clear();
    }
  }
  inv.source = "none";
  inv.diagnostic = diag.empty() ? "no GPU library tried" : diag;
  inv.device_nodes = nvidia_device_present();
  // AMD GPUs (ROCm) from the kernel's topology: no library, only counted (DDPRUN_KFD_TOPOLOGY and
  // DDPRUN_DRI_DIR for tests).
  const std::string kfd = env_value(env, "DDPRUN_KFD_TOPOLOGY").value_or("/sys/class/kfd/kfd/topology/nodes");
  if (!inv.device_nodes) inv.amd_gpus = kfd_gpus(kfd, env_value(env, "DDPRUN_DRI_DIR").value_or("/dev/dri"));
  if (!inv.amd_gpus.empty()) inv.source = "kfd:" + kfd;
  return inv;
}

}  // namespace ddprun::worker_env
