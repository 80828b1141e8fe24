// GPU selection (docs/gpus.md): CUDA_VISIBLE_DEVICES with CUDA's rules, the fake NVML loaded
// through DDPRUN_NVML_LIBRARY, --gpus resolution, isolation, virtual local rank, sharing errors.
#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <unistd.h>

#include "ddprun/common/error.hpp"
#include "ddprun/worker_env/gpus.hpp"

using namespace ddprun::worker_env;

namespace {

std::vector<std::string> texts(const std::vector<CvdEntry>& v) {
  std::vector<std::string> out;
  for (const auto& e : v) out.push_back(e.text);
  return out;
}

std::vector<std::string> tokens(const std::vector<VisibleDevice>& v) {
  std::vector<std::string> out;
  for (const auto& e : v) out.push_back(e.token);
  return out;
}

GpuInventory fake_inventory(int count) {
  setenv("FAKE_NVML_COUNT", std::to_string(count).c_str(), 1);
  EnvMap env{{"DDPRUN_NVML_LIBRARY", FAKE_NVML_PATH}, {"DDPRUN_CUDA_LIBRARY", "none"}};
  auto inv = probe_gpus(env);
  unsetenv("FAKE_NVML_COUNT");
  return inv;
}

std::string env_of(const EnvList& env, const std::string& name) {
  for (const auto& [k, v] : env) {
    if (k == name) return v;
  }
  return "<unset>";
}

}  // namespace

TEST_CASE("CUDA_VISIBLE_DEVICES is parsed as CUDA does", "[gpus]") {
  using V = std::vector<std::string>;
  CHECK(texts(parse_cuda_visible_devices("0,1,2,3")) == V{"0", "1", "2", "3"});
  CHECK(texts(parse_cuda_visible_devices(" 2 , 1 ")) == V{"2", "1"});
  CHECK(texts(parse_cuda_visible_devices("")).empty());
  CHECK(texts(parse_cuda_visible_devices("  ")).empty());
  CHECK(texts(parse_cuda_visible_devices("0,2,-1,1")) == V{"0", "2"});  // invalid entry truncates
  CHECK(texts(parse_cuda_visible_devices("1,x,2")) == V{"1"});
  CHECK(texts(parse_cuda_visible_devices("-1")).empty());
  CHECK(texts(parse_cuda_visible_devices("0,0,1")) == V{"0"});  // a repeat ends the list
  CHECK(texts(parse_cuda_visible_devices("GPU-8f2a,1")) == V{"GPU-8f2a", "1"});
  CHECK(texts(parse_cuda_visible_devices("GPU-,1")).empty());
  CHECK(texts(parse_cuda_visible_devices("GPU-zz")).empty());
  CHECK(texts(parse_cuda_visible_devices("gpu-8f2a")).empty());  // CUDA wants the GPU- spelling
  const auto mig = parse_cuda_visible_devices("MIG-GPU-8f2a/1/0,MIG-4b1d");
  REQUIRE(mig.size() == 2);
  CHECK(mig[0].kind == CvdEntry::Kind::mig);
  const auto idx = parse_cuda_visible_devices("7");
  REQUIRE(idx.size() == 1);
  CHECK(idx[0].kind == CvdEntry::Kind::index);
  CHECK(idx[0].index == 7);
}

TEST_CASE("the fake NVML is loaded through DDPRUN_NVML_LIBRARY", "[gpus][nvml]") {
  const auto inv = fake_inventory(4);
  REQUIRE(inv.devices.size() == 4);
  CHECK(inv.source == std::string("nvml:") + FAKE_NVML_PATH);
  CHECK(inv.devices[2].index == 2);
  CHECK(inv.devices[2].uuid == "GPU-dead0002-0000-4000-8000-000000000002");
  CHECK(inv.devices[2].pci_bus_id == "0000:3a:00.0");
  CHECK(inv.devices[2].name == "Fake GPU");
  CHECK(fake_inventory(2).devices.size() == 2);

  SECTION("counting: CVD wins, NVML otherwise") {
    CHECK(count_visible_gpus(std::nullopt, inv) == 4);
    CHECK(count_visible_gpus(std::string("1,3"), inv) == 2);
    CHECK(count_visible_gpus(std::string(""), inv) == 0);
    CHECK(count_visible_gpus(std::string("1,7,2"), inv) == 1);  // 7 does not exist: CUDA stops
    CHECK(count_visible_gpus(std::string("GPU-dead0003,0"), inv) == 2);
    CHECK(count_visible_gpus(std::string("GPU-dead,0"), inv) == 0);      // ambiguous prefix
    CHECK(count_visible_gpus(std::string("3,GPU-dead0003"), inv) == 1);  // same device twice
    CHECK(nproc_for_device_kind("gpu", "--nproc-per-node", std::nullopt, inv, 16) == 4);
    CHECK(nproc_for_device_kind("auto", "--nproc-per-node", std::string("2"), inv, 16) == 1);
    CHECK_FALSE(nproc_for_device_kind("8", "--nproc-per-node", std::nullopt, inv, 16));
  }
}

TEST_CASE("no GPU: auto falls back to CPUs, gpu is a clear error", "[gpus][nvml]") {
  setenv("FAKE_NVML_FAIL", "init", 1);
  const auto failing = probe_gpus({{"DDPRUN_NVML_LIBRARY", FAKE_NVML_PATH}, {"DDPRUN_CUDA_LIBRARY", "none"}});
  unsetenv("FAKE_NVML_FAIL");
  CHECK(failing.devices.empty());
  CHECK_THAT(failing.diagnostic, Catch::Contains("Driver Not Loaded"));

  const auto missing = probe_gpus({{"DDPRUN_NVML_LIBRARY", "/nonexistent/libnvidia-ml.so.1"},
                                   {"DDPRUN_CUDA_LIBRARY", "/nonexistent/libcuda.so.1"}});
  CHECK(missing.devices.empty());
  CHECK(missing.source == "none");
  CHECK_THAT(missing.diagnostic, Catch::Contains("/nonexistent/libnvidia-ml.so.1"));
  CHECK_THAT(missing.diagnostic, Catch::Contains("/nonexistent/libcuda.so.1"));

  CHECK(nproc_for_device_kind("auto", "--nproc-per-node", std::nullopt, missing, 6) == 6);
  CHECK(nproc_for_device_kind("AUTO", "--nproc-per-node", std::string(""), missing, 6) == 6);
  CHECK_THROWS_WITH(nproc_for_device_kind("gpu", "--nproc-per-node", std::nullopt, missing, 6),
                    Catch::Contains("--nproc-per-node=gpu: no GPU found") && Catch::Contains("libnvidia-ml"));
  CHECK_THROWS_WITH(nproc_for_device_kind("gpu", "--nproc-per-node", std::string("-1"), missing, 6),
                    Catch::Contains("CUDA_VISIBLE_DEVICES='-1' names no usable GPU"));
  // Without any inventory the syntax of CUDA_VISIBLE_DEVICES still counts.
  CHECK(nproc_for_device_kind("gpu", "--nproc-per-node", std::string("0,2,-1,1"), missing, 6) == 2);
}

TEST_CASE("plan_gpus: shared mode is torchrun's default", "[gpus][plan]") {
  GpuRequest r;
  r.inventory = fake_inventory(4);
  r.nproc = 4;
  const auto plan = plan_gpus(r);
  REQUIRE(plan.per_rank_env.size() == 4);
  CHECK(tokens(plan.selected) == std::vector<std::string>{"0", "1", "2", "3"});
  // CVD and the device order as the user left them (CUDA's own numbering, as under torchrun),
  // worker uses LOCAL_RANK.
  CHECK(env_of(plan.per_rank_env[1], "CUDA_VISIBLE_DEVICES") == "<unset>");
  CHECK(env_of(plan.per_rank_env[1], "CUDA_DEVICE_ORDER") == "<unset>");
  CHECK(env_of(plan.per_rank_env[3], "DDPRUN_CUDA_DEVICE") == "3");
  CHECK_THAT(plan.per_rank_device[2], Catch::Contains("cuda:2 = GPU 2") && Catch::Contains("0000:3a:00.0"));
  CHECK_THAT(plan.summary, !Catch::Contains("mixed"));
  // Mixed models: CUDA's default numbering is not the list's, and the summary says so.
  auto mixed = r;
  mixed.inventory.devices[3].name = "NVIDIA GeForce RTX 3060";
  CHECK_THAT(plan_gpus(mixed).summary, Catch::Contains("mixed GPU models and CUDA_DEVICE_ORDER unset"));
  CHECK(env_of(plan_gpus(mixed).per_rank_env[0], "CUDA_DEVICE_ORDER") == "<unset>");
  // Mixed anywhere on the machine counts (ordinals are read across all of it); a device without
  // a name does not make it mixed.
  auto selecting = mixed;
  selecting.parent_cvd = "0,1";
  CHECK_THAT(plan_gpus(selecting).summary, Catch::Contains("mixed GPU models"));
  auto unnamed = r;
  unnamed.inventory.devices[0].name.clear();
  CHECK_THAT(plan_gpus(unnamed).summary, !Catch::Contains("mixed"));
  // The user's own order: told when it is not the bus order.
  selecting.parent_device_order = "FASTEST_FIRST";
  CHECK_THAT(plan_gpus(selecting).summary, Catch::Contains("CUDA_DEVICE_ORDER 'FASTEST_FIRST'"));
  selecting.parent_device_order = "PCI_BUS_ID";
  CHECK_THAT(plan_gpus(selecting).summary, !Catch::Contains("mixed"));
  // Pinned to the bus order where CPUs are bound near each rank's device (--numa-binding); the
  // summary says ordinals are then read in bus order.
  mixed.bus_order_used = true;
  CHECK(env_of(plan_gpus(mixed).per_rank_env[0], "CUDA_DEVICE_ORDER") == "PCI_BUS_ID");
  CHECK_THAT(plan_gpus(mixed).summary,
             Catch::Contains("ordinals (CUDA_VISIBLE_DEVICES, --gpus) are read in bus order"));

  r.parent_device_order = "FASTEST_FIRST";  // the user's choice is kept
  r.bus_order_used = true;
  CHECK(env_of(plan_gpus(r).per_rank_env[0], "CUDA_DEVICE_ORDER") == "<unset>");
  r.bus_order_used = false;
  // torchrun allows more workers than GPUs when nothing was selected.
  r.nproc = 6;
  CHECK(env_of(plan_gpus(r).per_rank_env[5], "DDPRUN_CUDA_DEVICE") == "1");
}

TEST_CASE("plan_gpus: --gpus selects among the visible devices", "[gpus][plan]") {
  GpuRequest r;
  r.inventory = fake_inventory(4);
  r.nproc = 2;
  r.gpus = "1,3";
  auto plan = plan_gpus(r);
  CHECK(env_of(plan.per_rank_env[0], "CUDA_VISIBLE_DEVICES") == "1,3");
  CHECK(env_of(plan.per_rank_env[1], "CUDA_VISIBLE_DEVICES") == "1,3");
  CHECK(env_of(plan.per_rank_env[1], "DDPRUN_CUDA_DEVICE") == "1");
  CHECK(env_of(plan.per_rank_env[1], "CUDA_DEVICE_ORDER") == "PCI_BUS_ID");  // ddprun names the devices

  // Ordinals are relative to the parent's CUDA_VISIBLE_DEVICES (cuda:N as the user sees it).
  r.parent_cvd = "3,2,1";
  r.gpus = "2,0";
  plan = plan_gpus(r);
  CHECK(env_of(plan.per_rank_env[0], "CUDA_VISIBLE_DEVICES") == "1,3");
  REQUIRE(plan.selected.size() == 2);
  REQUIRE(plan.selected[0].device);
  CHECK(plan.selected[0].device->uuid == "GPU-dead0001-0000-4000-8000-000000000001");
}

TEST_CASE("plan_gpus: --gpus errors name the flag", "[gpus][plan]") {
  GpuRequest r;
  r.inventory = fake_inventory(4);
  r.nproc = 2;
  r.gpus = "1,3";
  r.parent_cvd = "3,2,1";
  CHECK_THROWS_WITH(plan_gpus(r), Catch::Contains("--gpus: device 3 does not exist") &&
                                      Catch::Contains("CUDA_VISIBLE_DEVICES='3,2,1'"));
  r.parent_cvd.reset();
  r.gpus = "GPU-dead";
  CHECK_THROWS_WITH(plan_gpus(r), Catch::Contains("--gpus: GPU-dead is ambiguous (matches 4 GPUs)"));
  r.gpus = "GPU-beef";
  CHECK_THROWS_WITH(plan_gpus(r), Catch::Contains("matches no visible GPU"));
  r.gpus = "0,0";
  CHECK_THROWS_WITH(plan_gpus(r), Catch::Contains("--gpus names device 0 twice"));
  r.gpus = "zero";
  CHECK_THROWS_WITH(plan_gpus(r), Catch::Contains("--gpus: 'zero' is not a device ordinal or UUID"));
  r.gpus = " ";
  CHECK_THROWS_AS(plan_gpus(r), ddprun::UsageError);
  r.gpus = "GPU-dead0002";
  r.nproc = 3;
  CHECK_THROWS_WITH(plan_gpus(r), Catch::Contains("--nproc-per-node=3 workers but only 1 GPU(s) selected"));
  r.allow_sharing = true;
  const auto plan = plan_gpus(r);
  CHECK(env_of(plan.per_rank_env[2], "CUDA_VISIBLE_DEVICES") == "GPU-dead0002-0000-4000-8000-000000000002");
}

TEST_CASE("plan_gpus: isolation and virtual local rank", "[gpus][plan]") {
  GpuRequest r;
  r.inventory = fake_inventory(4);
  r.nproc = 2;
  r.mode = GpuMode::isolate;
  r.gpus = "GPU-dead0003,GPU-dead0001";
  auto plan = plan_gpus(r);
  CHECK(env_of(plan.per_rank_env[0], "CUDA_VISIBLE_DEVICES") == "GPU-dead0003-0000-4000-8000-000000000003");
  CHECK(env_of(plan.per_rank_env[1], "CUDA_VISIBLE_DEVICES") == "GPU-dead0001-0000-4000-8000-000000000001");
  CHECK(env_of(plan.per_rank_env[1], "DDPRUN_CUDA_DEVICE") == "0");
  CHECK(env_of(plan.per_rank_env[1], "LOCAL_RANK") == "<unset>");
  CHECK_THAT(plan.per_rank_device[0], Catch::Contains("cuda:0 = GPU 3"));

  r.mode = GpuMode::virtual_local_rank;
  r.gpus.reset();
  r.parent_cvd = "2,3";
  plan = plan_gpus(r);
  CHECK(env_of(plan.per_rank_env[0], "CUDA_VISIBLE_DEVICES") == "2");
  CHECK(env_of(plan.per_rank_env[1], "CUDA_VISIBLE_DEVICES") == "3");
  CHECK(env_of(plan.per_rank_env[1], "LOCAL_RANK") == "0");

  r.nproc = 3;
  CHECK_THROWS_WITH(plan_gpus(r), Catch::Contains("--nproc-per-node=3 workers but only 2 GPU(s)"));
  r.allow_sharing = true;
  CHECK(env_of(plan_gpus(r).per_rank_env[2], "CUDA_VISIBLE_DEVICES") == "2");

  // Isolation without GPUs is an error; a CPU job in shared mode is not.
  GpuRequest cpu;
  cpu.nproc = 2;
  cpu.parent_cvd = "";
  const auto cpu_plan = plan_gpus(cpu);
  CHECK(cpu_plan.per_rank_env[0].empty());
  CHECK(cpu_plan.per_rank_device[1] == "cpu");
  cpu.mode = GpuMode::isolate;
  CHECK_THROWS_WITH(plan_gpus(cpu), Catch::Contains("GPU isolation needs GPUs but none is visible"));
  CHECK_THROWS_WITH(parse_gpu_mode("exclusive", "--gpu-mode"), Catch::Contains("--gpu-mode='exclusive'"));
  CHECK(parse_gpu_mode("isolate", "--gpu-mode") == GpuMode::isolate);
}

TEST_CASE("plan_gpus without NVML trusts the parent's CUDA_VISIBLE_DEVICES", "[gpus][plan]") {
  GpuRequest r;
  r.parent_cvd = "4,5,6,7";
  r.nproc = 2;
  r.gpus = "1,3";
  r.mode = GpuMode::isolate;
  const auto plan = plan_gpus(r);
  CHECK(env_of(plan.per_rank_env[0], "CUDA_VISIBLE_DEVICES") == "5");
  CHECK(env_of(plan.per_rank_env[1], "CUDA_VISIBLE_DEVICES") == "7");
}

TEST_CASE("check_gpus_list: what any node can check without its devices, plan_gpus first of all", "[gpus][plan]") {
  for (const char* good : {"0", " 0 , 3 ", "GPU-8f2a,gpu-11c0", "MIG-x,1"}) {
    CAPTURE(good);
    CHECK_NOTHROW(check_gpus_list(good));
  }
  CHECK_THROWS_WITH(check_gpus_list(" "), Catch::Contains("--gpus is empty"));
  CHECK_THROWS_WITH(check_gpus_list("x,y"), Catch::Contains("--gpus: 'x' is not a device ordinal or UUID"));
  CHECK_THROWS_WITH(check_gpus_list("0,-1"), Catch::Contains("'-1' is not"));
  CHECK_THROWS_WITH(check_gpus_list("0,,1"), Catch::Contains("'' is not"));
  CHECK_THROWS_WITH(check_gpus_list("GPU-"), Catch::Contains("'GPU-' is not"));
  CHECK_THROWS_WITH(check_gpus_list("2,02"), Catch::Contains("--gpus names device 02 twice"));
  CHECK_THROWS_WITH(check_gpus_list("GPU-8f2a,gpu-8F2A"), Catch::Contains("names device gpu-8F2A twice"));
  // Without NVML plan_gpus takes the entries on trust, but not a device named twice.
  GpuRequest r;
  r.gpus = "0,0";
  CHECK_THROWS_WITH(plan_gpus(r), Catch::Contains("--gpus names device 0 twice"));
}

TEST_CASE("nvidia_gpu_visible: CUDA_VISIBLE_DEVICES first, then the driver's device nodes", "[gpus]") {
  namespace fs = std::filesystem;
  const fs::path root = fs::temp_directory_path() / ("ddprun-gpu-visible-" + std::to_string(::getpid()));
  fs::remove_all(root);
  fs::create_directories(root / "dev");
  std::string why;
  CHECK_FALSE(ddprun::worker_env::nvidia_gpu_visible({}, root.string(), &why));
  CHECK_THAT(why, Catch::Contains("no NVIDIA GPU is visible"));
  CHECK_FALSE(ddprun::worker_env::nvidia_gpu_visible({{"CUDA_VISIBLE_DEVICES", ""}}, root.string(), &why));
  CHECK_THAT(why, Catch::Contains("CUDA_VISIBLE_DEVICES=''"));
  // Set but leaked into a machine without any NVIDIA device: nothing a worker could use.
  CHECK_FALSE(ddprun::worker_env::nvidia_gpu_visible({{"CUDA_VISIBLE_DEVICES", "1"}}, root.string(), &why));
  CHECK_THAT(why, Catch::Contains("CUDA_VISIBLE_DEVICES='1' is set, but this machine shows no NVIDIA GPU"));
  CHECK_FALSE(ddprun::worker_env::nvidia_gpu_visible({{"CUDA_VISIBLE_DEVICES", "-1"}}, root.string()));
  { std::ofstream(root / "dev" / "nvidia0") << ""; }
  CHECK(ddprun::worker_env::nvidia_gpu_visible({}, root.string()));
  CHECK(ddprun::worker_env::nvidia_gpu_visible({{"CUDA_VISIBLE_DEVICES", "1"}}, root.string()));
  fs::remove(root / "dev" / "nvidia0");
  // The driver's other nodes are not a GPU; an nvidiaN other than nvidia0 is (a container given
  // one GPU of several).
  for (const char* other : {"nvidiactl", "nvidia-uvm", "nvidia-modeset", "nvidia", "nvidia1a"}) {
    std::ofstream(root / "dev" / other) << "";
  }
  fs::create_directories(root / "dev" / "nvidia-caps");
  fs::create_directories(root / "proc/driver/nvidia/gpus");  // the driver loaded, no GPU listed
  CHECK_FALSE(ddprun::worker_env::nvidia_device_present(root.string()));
  { std::ofstream(root / "dev" / "nvidia3") << ""; }
  CHECK(ddprun::worker_env::nvidia_device_present(root.string()));
  fs::remove(root / "dev" / "nvidiactl");  // no control node: no device CUDA could open
  CHECK_FALSE(ddprun::worker_env::nvidia_device_present(root.string()));
  { std::ofstream(root / "dev" / "nvidiactl") << ""; }
  fs::remove(root / "dev" / "nvidia3");
  { std::ofstream(root / "dev" / "dxg") << ""; }  // WSL2
  CHECK(ddprun::worker_env::nvidia_device_present(root.string()));
  fs::remove(root / "dev" / "dxg");
  CHECK_FALSE(ddprun::worker_env::nvidia_device_present(root.string()));
  fs::create_directories(root / "proc/driver/nvidia/gpus/0000:3b:00.0");
  CHECK(ddprun::worker_env::nvidia_gpu_visible({}, root.string()));
  fs::remove_all(root);
}

TEST_CASE("AMD GPUs (ROCm): the KFD topology's GPU nodes, and what HIP's variables leave visible", "[gpus][amd]") {
  namespace fs = std::filesystem;
  const fs::path nodes = fs::temp_directory_path() / ("ddprun-kfd-" + std::to_string(::getpid()));
  fs::remove_all(nodes);
  CHECK(kfd_gpus(nodes.string()).empty());  // no amdgpu driver
  const auto node = [&](const std::string& n, const std::string& properties) {
    fs::create_directories(nodes / n);
    std::ofstream(nodes / n / "properties") << properties;
  };
  node("0", "cpu_cores_count 64\nsimd_count 0\nunique_id 0\n");  // the CPU
  node("10", "cpu_cores_count 0\nsimd_count 304\nunique_id 11259375\ngfx_target_version 90402\n");
  node("2", "simd_count 304\nunique_id 3054986523408297983\n");
  node("3", "simd_count 304\n");  // no unique_id: an older kernel
  fs::create_directories(nodes / "not-a-node");
  // Render nodes: a GPU whose render node is missing (a container not given it) is not used.
  const fs::path dri = nodes / "dev" / "dri";
  fs::create_directories(dri);
  CHECK(kfd_gpus(nodes.string(), dri.string()).empty());  // no /dev/kfd: ROCm finds no GPU
  std::ofstream(nodes / "dev" / "kfd") << "";
  for (const char* r : {"renderD128", "renderD129"}) std::ofstream(dri / r) << "";
  node("11", "simd_count 304\nunique_id 17\ndrm_render_minor 130\n");
  node("12", "simd_count 304\nunique_id 18\ndrm_render_minor 128\n");
  CHECK(kfd_gpus(nodes.string(), dri.string()) ==
        std::vector<std::string>{"GPU-2a657e0e995b6fff", "", "GPU-0000000000abcdef", "GPU-0000000000000012"});
  fs::remove_all(nodes / "11");
  fs::remove_all(nodes / "12");
  // In node number order (HIP's device order), not the directory's.
  const auto gpus = kfd_gpus(nodes.string(), dri.string());
  REQUIRE(gpus == std::vector<std::string>{"GPU-2a657e0e995b6fff", "", "GPU-0000000000abcdef"});
  CHECK(count_visible_amd_gpus({}, gpus) == 3);
  CHECK(count_visible_amd_gpus({{"HIP_VISIBLE_DEVICES", "2,0"}}, gpus) == 2);
  CHECK(count_visible_amd_gpus({{"CUDA_VISIBLE_DEVICES", "1"}}, gpus) == 1);
  // HIP_VISIBLE_DEVICES wins over CUDA_VISIBLE_DEVICES.
  CHECK(count_visible_amd_gpus({{"HIP_VISIBLE_DEVICES", "0,1,2"}, {"CUDA_VISIBLE_DEVICES", "0"}}, gpus) == 3);
  // ROCR_VISIBLE_DEVICES first, then HIP's ordinals among what it left, from 0.
  CHECK(count_visible_amd_gpus({{"ROCR_VISIBLE_DEVICES", "2,1"}, {"HIP_VISIBLE_DEVICES", "1"}}, gpus) == 1);
  CHECK(count_visible_amd_gpus({{"ROCR_VISIBLE_DEVICES", "2"}, {"HIP_VISIBLE_DEVICES", "1"}}, gpus) == 0);
  // UUID prefixes (any case); an entry that names no device ends the list; empty hides all.
  CHECK(count_visible_amd_gpus({{"ROCR_VISIBLE_DEVICES", "GPU-0000000000ABC,GPU-2a65"}}, gpus) == 2);
  CHECK(count_visible_amd_gpus({{"HIP_VISIBLE_DEVICES", "0,5,1"}}, gpus) == 1);
  CHECK(count_visible_amd_gpus({{"HIP_VISIBLE_DEVICES", "GPU-ffff,0"}}, gpus) == 0);
  CHECK(count_visible_amd_gpus({{"HIP_VISIBLE_DEVICES", ""}}, gpus) == 0);
  CHECK(count_visible_amd_gpus({{"ROCR_VISIBLE_DEVICES", ""}, {"HIP_VISIBLE_DEVICES", "0"}}, gpus) == 0);
  // probe_gpus lists them only where no NVIDIA GPU answers (this test's NVML and CUDA: none).
  const auto inv = probe_gpus({{"DDPRUN_NVML_LIBRARY", "none"},
                               {"DDPRUN_CUDA_LIBRARY", "none"},
                               {"DDPRUN_KFD_TOPOLOGY", nodes.string()},
                               {"DDPRUN_DRI_DIR", dri.string()}});
  if (!inv.device_nodes) {
    CHECK(inv.amd_gpus == gpus);
    CHECK(inv.source == "kfd:" + nodes.string());
  } else {
    CHECK(inv.amd_gpus.empty());  // an NVIDIA machine: not asked
  }
  fs::remove_all(nodes);
}
