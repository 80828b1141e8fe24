// GPU selection, pure part (docs/gpus.md): CUDA_VISIBLE_DEVICES with CUDA's rules, --gpus
// resolution, per-rank environment. The dlopen probing lives in gpu_probe.cpp.
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdio>
#include <fstream>
#include <set>
#include <string_view>
#include <utility>

#include "ddprun/common/error.hpp"
#include "ddprun/common/strings.hpp"
#include "ddprun/worker_env/gpus.hpp"

namespace ddprun::worker_env {

namespace {

bool all_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

bool uuid_chars(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return std::isxdigit(static_cast<unsigned char>(c)) != 0 || c == '-';
  });
}

// Syntax of one entry; nullopt when CUDA would stop here.
std::optional<CvdEntry> parse_entry(std::string_view raw) {
  const std::string_view t = trim(raw);
  CvdEntry e;
  e.text = std::string(t);
  if (all_digits(t)) {
    const auto v = parse_int(t);
    if (!v || *v > 1'000'000) return std::nullopt;
    e.kind = CvdEntry::Kind::index;
    e.index = static_cast<int>(*v);
    return e;
  }
  if (t.size() > 4 && starts_with(t, "GPU-") && uuid_chars(t.substr(4))) {
    e.kind = CvdEntry::Kind::gpu_uuid;
    return e;
  }
  if (t.size() > 4 && starts_with(t, "MIG-")) {
    e.kind = CvdEntry::Kind::mig;
    return e;
  }
  return std::nullopt;
}

std::string lower(std::string_view s) { return to_lower(s); }

// Inventory devices whose UUID starts with `prefix` (case-insensitive, "GPU-" included).
std::vector<const GpuDevice*> uuid_matches(std::string_view prefix, const GpuInventory& inv) {
  std::vector<const GpuDevice*> out;
  const std::string p = lower(prefix);
  for (const auto& d : inv.devices) {
    if (!d.uuid.empty() && starts_with(lower(d.uuid), p)) out.push_back(&d);
  }
  return out;
}

std::string describe(const VisibleDevice& v) {
  if (!v.device) return v.token;
  std::string s = "GPU " + std::to_string(v.device->index);
  std::string extra;
  if (!v.device->uuid.empty()) extra += v.device->uuid;
  if (!v.device->pci_bus_id.empty()) extra += (extra.empty() ? "" : ", ") + v.device->pci_bus_id;
  if (!extra.empty()) s += " (" + extra + ")";
  return s;
}

std::string join_tokens(const std::vector<VisibleDevice>& devs) {
  std::string s;
  for (const auto& d : devs) s += (s.empty() ? "" : ",") + d.token;
  return s;
}

}  // namespace

std::vector<CvdEntry> parse_cuda_visible_devices(std::string_view value) {
  std::vector<CvdEntry> out;
  if (trim(value).empty()) return out;
  std::set<std::string> seen;
  for (const auto& raw : split(value, ',')) {
    auto e = parse_entry(raw);
    if (!e) break;
    if (!seen.insert(lower(e->text)).second) break;  // CUDA rejects a repeated device
    out.push_back(std::move(*e));
  }
  return out;
}

std::vector<VisibleDevice> visible_devices(const std::optional<std::string>& cvd, const GpuInventory& inventory) {
  std::vector<VisibleDevice> out;
  if (!cvd) {
    for (const auto& d : inventory.devices) out.push_back(VisibleDevice{std::to_string(d.index), d});
    return out;
  }
  const auto entries = parse_cuda_visible_devices(*cvd);
  if (inventory.devices.empty()) {
    for (const auto& e : entries) out.push_back(VisibleDevice{e.text, std::nullopt});
    return out;
  }
  std::set<int> used;
  for (const auto& e : entries) {
    const GpuDevice* dev = nullptr;
    if (e.kind == CvdEntry::Kind::index) {
      if (e.index < 0 || static_cast<std::size_t>(e.index) >= inventory.devices.size()) break;
      dev = &inventory.devices[static_cast<std::size_t>(e.index)];
    } else if (e.kind == CvdEntry::Kind::gpu_uuid) {
      const auto m = uuid_matches(e.text, inventory);
      if (m.size() != 1) break;  // unknown or ambiguous prefix: CUDA stops here
      dev = m.front();
    } else {
      // MIG instances are not in the GPU inventory; keep the entry as the user wrote it.
      out.push_back(VisibleDevice{e.text, std::nullopt});
      continue;
    }
    if (!used.insert(dev->index).second) break;
    out.push_back(VisibleDevice{e.text, *dev});
  }
  return out;
}

int count_visible_gpus(const std::optional<std::string>& cvd, const GpuInventory& inventory) {
  return static_cast<int>(visible_devices(cvd, inventory).size());
}

std::optional<int> nproc_for_device_kind(std::string_view value, std::string_view what,
                                         const std::optional<std::string>& cvd, const GpuInventory& inventory,
                                         int online_cpus) {
  const std::string v = to_lower(trim(value));
  if (v != "gpu" && v != "auto") return std::nullopt;
  const int n = count_visible_gpus(cvd, inventory);
  if (n > 0) return n;
  if (v == "auto") return std::max(online_cpus, 1);
  std::string why;
  if (cvd) {
    why = "CUDA_VISIBLE_DEVICES='" + *cvd + "' names no usable GPU";
  } else {
    why = "no GPU found (" + (inventory.diagnostic.empty() ? inventory.source : inventory.diagnostic) + ")";
  }
  throw UsageError(std::string(what) + "=gpu: " + why,
                   "pass a number of processes, use auto (falls back to the CPU count), or fix "
                   "CUDA_VISIBLE_DEVICES / the NVIDIA driver installation");
}

GpuMode parse_gpu_mode(std::string_view text, std::string_view what) {
  const std::string t = to_lower(trim(text));
  if (t == "shared") return GpuMode::shared;
  if (t == "isolate" || t == "isolated") return GpuMode::isolate;
  if (t == "virtual" || t == "virtual-local-rank") return GpuMode::virtual_local_rank;
  throw UsageError(std::string(what) + "='" + std::string(text) + "' is not a GPU mode",
                   "use shared (all workers see all selected GPUs), isolate (one GPU per worker) or virtual");
}

void check_gpus_list(std::string_view text) {
  const std::string list(trim(text));
  if (list.empty()) {
    throw UsageError("--gpus is empty", "list device ordinals or UUIDs, e.g. --gpus 0,1 or --gpus GPU-8f2a");
  }
  std::set<std::string> seen;  // "0" and "00" are one ordinal; UUIDs compare without case
  for (const auto& raw : split(list, ',')) {
    const std::string e(trim(raw));
    std::string key;
    if (const auto v = all_digits(e) ? parse_int(e) : std::nullopt) {
      key = std::to_string(*v);
    } else if (e.size() > 4 && (starts_with(lower(e), "gpu-") || starts_with(e, "MIG-"))) {
      key = lower(e);
    } else {
      throw UsageError("--gpus: '" + e + "' is not a device ordinal or UUID",
                       "use e.g. --gpus 0,2 or --gpus GPU-8f2a,GPU-11c0");
    }
    if (!seen.insert(key).second) throw UsageError("--gpus names device " + e + " twice", "list each GPU once");
  }
}

GpuPlan plan_gpus(const GpuRequest& r) {
  if (r.nproc <= 0) throw UsageError("--nproc-per-node=" + std::to_string(r.nproc) + " must be > 0");
  const auto visible = visible_devices(r.parent_cvd, r.inventory);
  const std::string cvd_what =
      r.parent_cvd ? "CUDA_VISIBLE_DEVICES='" + *r.parent_cvd + "'" : std::string("CUDA_VISIBLE_DEVICES (unset)");

  GpuPlan plan;
  plan.per_rank_env.resize(static_cast<std::size_t>(r.nproc));
  plan.per_rank_device.resize(static_cast<std::size_t>(r.nproc));

  // 1. Selection: --gpus entries are CUDA ordinals of the visible devices (what the user sees
  //    as cuda:N) or UUIDs / unambiguous UUID prefixes.
  bool restricted = false;
  if (r.gpus) {
    restricted = true;
    check_gpus_list(*r.gpus);
    const std::string list(trim(*r.gpus));
    std::set<std::size_t> used;
    for (const auto& raw : split(list, ',')) {
      const std::string e(trim(raw));
      std::optional<std::size_t> pos;
      if (all_digits(e)) {
        const auto v = parse_int(e);
        if (!v || static_cast<std::size_t>(*v) >= visible.size()) {
          if (visible.empty() && r.inventory.devices.empty() && !r.parent_cvd) {
            // Nothing to check against (no NVML, no CUDA_VISIBLE_DEVICES): trust the user.
            plan.selected.push_back(VisibleDevice{e, std::nullopt});
            continue;
          }
          throw UsageError("--gpus: device " + e + " does not exist: " + std::to_string(visible.size()) +
                               " GPU(s) visible under " + cvd_what,
                           "--gpus takes ordinals 0.." +
                               (visible.empty() ? std::string("(none)") : std::to_string(visible.size() - 1)) +
                               " of the visible devices, or UUIDs");
        }
        pos = static_cast<std::size_t>(*v);
      } else if (starts_with(to_lower(e), "gpu-") && e.size() > 4) {
        std::vector<std::size_t> hits;
        for (std::size_t i = 0; i < visible.size(); ++i) {
          const auto& v = visible[i];
          const std::string uuid = v.device ? v.device->uuid : v.token;
          if (starts_with(to_lower(uuid), to_lower(e))) hits.push_back(i);
        }
        if (hits.empty() && visible.empty() && r.inventory.devices.empty() && !r.parent_cvd) {
          plan.selected.push_back(VisibleDevice{e, std::nullopt});
          continue;
        }
        if (hits.size() != 1) {
          throw UsageError("--gpus: " + e +
                               (hits.empty() ? " matches no visible GPU"
                                             : " is ambiguous (matches " + std::to_string(hits.size()) + " GPUs)"),
                           "give a longer UUID prefix; visible under " + cvd_what + ": " +
                               (visible.empty() ? std::string("none") : join_tokens(visible)));
        }
        pos = hits.front();
        // Selected by UUID: name it by UUID in the child too (independent of device order and MPS).
        if (used.insert(*pos).second) {
          VisibleDevice v = visible[*pos];
          if (v.device && !v.device->uuid.empty()) v.token = v.device->uuid;
          plan.selected.push_back(std::move(v));
          continue;
        }
        throw UsageError("--gpus names device " + e + " twice", "list each GPU once");
      } else if (starts_with(e, "MIG-") && e.size() > 4) {
        plan.selected.push_back(VisibleDevice{e, std::nullopt});
        continue;
      } else {
        throw UsageError("--gpus: '" + e + "' is not a device ordinal or UUID",
                         "use e.g. --gpus 0,2 or --gpus GPU-8f2a,GPU-11c0");
      }
      if (!used.insert(*pos).second) {
        throw UsageError("--gpus names device " + e + " twice", "list each GPU once");
      }
      plan.selected.push_back(visible[*pos]);
    }
  } else {
    plan.selected = visible;
  }

  const std::size_t n = plan.selected.size();
  const auto nproc = static_cast<std::size_t>(r.nproc);
  const bool per_worker = r.mode != GpuMode::shared;

  if (n == 0) {
    if (per_worker) {
      throw UsageError(std::string(r.mode == GpuMode::isolate ? "GPU isolation" : "--virtual-local-rank") +
                           " needs GPUs but none is visible under " + cvd_what +
                           (r.inventory.diagnostic.empty() ? "" : " (" + r.inventory.diagnostic + ")"),
                       "drop the isolation flag for a CPU job, or make GPUs visible");
    }
    for (auto& d : plan.per_rank_device) d = "cpu";
    plan.summary = "no GPU visible under " + cvd_what + " (" + r.inventory.source + "): CPU job";
    return plan;
  }
  if ((per_worker || restricted) && nproc > n && !r.allow_sharing) {
    throw UsageError("--nproc-per-node=" + std::to_string(r.nproc) + " workers but only " + std::to_string(n) +
                         " GPU(s) selected (" + join_tokens(plan.selected) + ")",
                     "lower --nproc-per-node, select more GPUs, or allow several workers per GPU with --gpu-sharing");
  }

  const std::string selected_cvd = join_tokens(plan.selected);
  // The bus order is pinned where ddprun names devices to a worker (its own list, isolation) or
  // binds CPUs near them: its numbers are nvidia-smi's. Otherwise the workers' numbering is what
  // CUDA gives the user's own environment, as under torchrun: with CUDA_DEVICE_ORDER unset CUDA
  // numbers the fastest model first, which on a machine with mixed models is not the bus order.
  const bool pin_order = (per_worker || restricted || r.bus_order_used) && !r.parent_device_order;
  // Mixed models anywhere on the machine: CUDA's default order then differs from the bus order
  // for the ordinals of CUDA_VISIBLE_DEVICES too, whichever devices they select.
  bool mixed = false;
  const std::string* model = nullptr;
  for (const auto& d : r.inventory.devices) {
    if (d.name.empty()) continue;
    if (model == nullptr) model = &d.name;
    mixed = mixed || d.name != *model;
  }
  for (std::size_t lr = 0; lr < nproc; ++lr) {
    auto& env = plan.per_rank_env[lr];
    const auto& dev = plan.selected[lr % n];
    if (pin_order) env.emplace_back("CUDA_DEVICE_ORDER", "PCI_BUS_ID");
    if (per_worker) {
      env.emplace_back("CUDA_VISIBLE_DEVICES", dev.token);
      env.emplace_back("DDPRUN_CUDA_DEVICE", "0");
      if (r.mode == GpuMode::virtual_local_rank) env.emplace_back("LOCAL_RANK", "0");
      plan.per_rank_device[lr] = "cuda:0 = " + describe(dev);
    } else {
      if (restricted) env.emplace_back("CUDA_VISIBLE_DEVICES", selected_cvd);
      env.emplace_back("DDPRUN_CUDA_DEVICE", std::to_string(lr % n));
      plan.per_rank_device[lr] = "cuda:" + std::to_string(lr % n) + " = " + describe(dev);
    }
    std::sort(env.begin(), env.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
  }
  plan.summary = std::to_string(n) + " GPU(s) selected [" + selected_cvd + "] of " + std::to_string(visible.size()) +
                 " visible under " + cvd_what + " (" + r.inventory.source + "), mode " +
                 (r.mode == GpuMode::shared    ? "shared"
                  : r.mode == GpuMode::isolate ? "isolate"
                                               : "virtual");
  if (mixed && pin_order) {
    plan.summary +=
        "; mixed GPU models: ordinals (CUDA_VISIBLE_DEVICES, --gpus) are read in bus order "
        "(CUDA_DEVICE_ORDER=PCI_BUS_ID, nvidia-smi's), not CUDA's default, fastest first";
  } else if (mixed && r.parent_device_order.value_or("") != "PCI_BUS_ID") {
    plan.summary += "; mixed GPU models and CUDA_DEVICE_ORDER " +
                    (r.parent_device_order ? "'" + *r.parent_device_order + "'" : std::string("unset")) +
                    ": CUDA numbers the fastest first, so a worker's cuda:N may not be the device listed here "
                    "(in bus order)";
  }
  return plan;
}

bool nvidia_gpu_visible(const EnvMap& env, const std::string& root, std::string* why) {
  if (auto it = env.find("CUDA_VISIBLE_DEVICES"); it != env.end()) {
    if (parse_cuda_visible_devices(it->second).empty()) {
      if (why != nullptr) *why = "CUDA_VISIBLE_DEVICES='" + it->second + "' names no device";
      return false;
    }
    // A value that leaked into a CPU-only container or CI job names devices that are not there.
    if (nvidia_device_present(root)) return true;
    if (why != nullptr) {
      *why = "CUDA_VISIBLE_DEVICES='" + it->second + "' is set, but this machine shows no NVIDIA GPU (" +
             kNoNvidiaDevice + ")";
    }
    return false;
  }
  if (nvidia_device_present(root)) return true;
  if (why != nullptr) *why = std::string("no NVIDIA GPU is visible (") + kNoNvidiaDevice + ")";
  return false;
}

bool nvidia_device_present(const std::string& root) {
  // Asked on every launch (--nccl-id auto): by stat and opendir, not std::filesystem.
  const auto any_entry = [](const std::string& dir, auto&& wanted) {
    DIR* d = ::opendir(dir.c_str());
    if (d == nullptr) return false;
    bool found = false;
    while (const dirent* e = ::readdir(d)) {
      const std::string_view name(e->d_name);
      if (name != "." && name != ".." && wanted(name)) {
        found = true;
        break;
      }
    }
    ::closedir(d);
    return found;
  };
  const auto exists = [](const std::string& path) {
    struct stat st {};
    return ::stat(path.c_str(), &st) == 0;
  };
  if (any_entry(root + "/proc/driver/nvidia/gpus", [](std::string_view) { return true; })) return true;
  // The usual case, one lookup; trusted alone, as before the control node was looked at.
  if (exists(root + "/dev/nvidia0")) return true;
  // Jetson boards (integrated GPU, no NVML) and WSL2 (the GPU behind /dev/dxg) have no nvidiaN.
  for (const char* other : {"/dev/nvhost-ctrl-gpu", "/dev/nvhost-gpu", "/dev/dxg"}) {
    if (exists(root + other)) return true;
  }
  // Listing /dev costs ~50 us in the kernel (devtmpfs, ~100-200 entries): only where the
  // driver's control node says an nvidiaN other than nvidia0 may be there.
  if (!exists(root + "/dev/nvidiactl")) return false;
  return any_entry(root + "/dev", [](std::string_view name) {
    return name.size() > 6 && name.substr(0, 6) == "nvidia" && all_digits(name.substr(6));
  });
}

std::vector<std::string> kfd_gpus(const std::string& nodes_dir, const std::string& dri_dir) {
  std::vector<std::pair<long, std::string>> found;
  // Without the KFD device (a container given /dev/dri but not /dev/kfd) ROCm finds no GPU.
  if (::access((dri_dir + "/../kfd").c_str(), R_OK | W_OK) != 0) return {};
  DIR* d = ::opendir(nodes_dir.c_str());
  if (d == nullptr) return {};
  while (const dirent* e = ::readdir(d)) {
    const std::string_view name(e->d_name);
    const auto node = all_digits(name) && name.size() < 9 ? parse_int(name) : std::nullopt;
    if (!node) continue;
    // "key value" lines, a few dozen of them; read at most 256.
    std::ifstream in(nodes_dir + "/" + std::string(name) + "/properties");
    std::string line;
    unsigned long long simd = 0;
    unsigned long long render_minor = 0;
    std::optional<unsigned long long> unique_id;
    for (int n = 0; n < 256 && std::getline(in, line); ++n) {
      const auto space = line.find(' ');
      if (space == std::string::npos) continue;
      const std::string_view key = std::string_view(line).substr(0, space);
      const std::string_view value = trim(std::string_view(line).substr(space + 1));
      unsigned long long v = 0;
      if (std::from_chars(value.data(), value.data() + value.size(), v).ec != std::errc{}) continue;
      if (key == "simd_count") simd = v;
      if (key == "unique_id") unique_id = v;
      if (key == "drm_render_minor") render_minor = v;
    }
    if (simd == 0) continue;  // a CPU node
    // A container given some of the GPUs sees every node but only their render nodes; ROCm uses
    // the GPUs whose render node it can open. Not opened here (that may wake the GPU): it must be
    // there, readable and writable.
    if (render_minor != 0 &&
        ::access((dri_dir + "/renderD" + std::to_string(render_minor)).c_str(), R_OK | W_OK) != 0) {
      continue;
    }
    std::string uuid;
    if (unique_id && *unique_id != 0) {
      char hex[17];
      std::snprintf(hex, sizeof hex, "%016llx", *unique_id);
      uuid = std::string("GPU-") + hex;
    }
    found.emplace_back(static_cast<long>(*node), std::move(uuid));
  }
  ::closedir(d);
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& f : found) out.push_back(std::move(f.second));
  return out;
}

int count_visible_amd_gpus(const EnvMap& env, const std::vector<std::string>& gpus) {
  GpuInventory inv;
  for (std::size_t i = 0; i < gpus.size(); ++i) inv.devices.push_back({static_cast<int>(i), gpus[i], "", ""});
  // One list applied to what the previous one left, renumbered from 0 as the runtime does.
  const auto apply = [&inv](const char* name, const EnvMap& e) {
    const auto it = e.find(name);
    if (it == e.end() || inv.devices.empty()) return it != e.end();
    GpuInventory next;
    for (const auto& v : visible_devices(it->second, inv)) {
      if (v.device) next.devices.push_back({static_cast<int>(next.devices.size()), v.device->uuid, "", ""});
    }
    inv = std::move(next);
    return true;
  };
  apply("ROCR_VISIBLE_DEVICES", env);
  if (!apply("HIP_VISIBLE_DEVICES", env)) apply("CUDA_VISIBLE_DEVICES", env);
  return static_cast<int>(inv.devices.size());
}

}  // namespace ddprun::worker_env
