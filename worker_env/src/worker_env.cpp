// The worker environment contract (docs/worker-env.md). Pure: no I/O except
// current_environment(), which reads this process's `environ`.
#include "ddprun/worker_env/worker_env.hpp"

#include <locale.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <string_view>

#include "ddprun/common/error.hpp"
#include "ddprun/common/strings.hpp"

extern char** environ;  // NOLINT: POSIX

namespace ddprun::worker_env {

namespace {

bool parent_has(const EnvMap& parent, const std::string& name) { return parent.find(name) != parent.end(); }

// The device a virtual-local-rank worker sees: the parent's CUDA_VISIBLE_DEVICES entry at
// index `local_rank` (so `CUDA_VISIBLE_DEVICES=4,5 --virtual-local-rank` gives rank 1 device 5),
// or the local rank itself when the parent restricts nothing.
std::string virtual_device(const EnvMap& parent, int local_rank) {
  const auto it = parent.find("CUDA_VISIBLE_DEVICES");
  if (it == parent.end()) {
    return std::to_string(local_rank);
  }
  std::vector<std::string> devices;
  for (const auto& d : split(it->second, ',')) {
    const auto t = trim(d);
    if (!t.empty()) {
      devices.emplace_back(t);
    }
  }
  if (local_rank < 0 || static_cast<std::size_t>(local_rank) >= devices.size()) {
    throw UsageError("--virtual-local-rank: CUDA_VISIBLE_DEVICES='" + it->second + "' lists " +
                         std::to_string(devices.size()) + " device(s) but local rank " + std::to_string(local_rank) +
                         " needs its own",
                     "list at least --nproc-per-node devices in CUDA_VISIBLE_DEVICES, or unset it");
  }
  return devices[static_cast<std::size_t>(local_rank)];
}

}  // namespace

EnvList build_worker_env(const Placement& a, int local_rank, const EnvOptions& opts, const EnvMap& parent) {
  if (local_rank < 0 || local_rank >= a.local_world_size) {
    throw Error("worker env: local rank " + std::to_string(local_rank) + " is outside [0, " +
                std::to_string(a.local_world_size) + ")");
  }
  const std::string rank = std::to_string(a.rank_offset + local_rank);
  const std::string world_size = std::to_string(a.world_size);
  const std::string local_world_size = std::to_string(a.local_world_size);
  const std::string group_rank = std::to_string(a.group_rank);
  const std::string group_world_size = std::to_string(a.group_world_size);

  EnvList env;
  env.reserve(32);
  env.emplace_back("RANK", rank);
  env.emplace_back("LOCAL_RANK", opts.virtual_local_rank ? std::string("0") : std::to_string(local_rank));
  env.emplace_back("WORLD_SIZE", world_size);
  env.emplace_back("LOCAL_WORLD_SIZE", local_world_size);
  env.emplace_back("GROUP_RANK", group_rank);
  env.emplace_back("GROUP_WORLD_SIZE", group_world_size);
  env.emplace_back("ROLE_NAME", a.role);
  // One role per job: role rank/world size equal the global ones (as torchrun computes them
  // for a single role).
  env.emplace_back("ROLE_RANK", rank);
  env.emplace_back("ROLE_WORLD_SIZE", world_size);
  env.emplace_back("MASTER_ADDR", a.master_addr);
  env.emplace_back("MASTER_PORT", std::to_string(a.master_port));
  env.emplace_back("TORCHELASTIC_RESTART_COUNT", std::to_string(a.restart_count));
  env.emplace_back("TORCHELASTIC_MAX_RESTARTS", std::to_string(a.max_restarts));
  env.emplace_back("TORCHELASTIC_RUN_ID", a.run_id);
  // Python's str(bool): torch compares against the exact string "True".
  env.emplace_back("TORCHELASTIC_USE_AGENT_STORE", a.use_agent_store ? "True" : "False");
  if (opts.no_error_file) {
    env.emplace_back("TORCHELASTIC_ERROR_FILE", std::string());
  } else if (opts.error_file_dir) {
    std::string path = *opts.error_file_dir;
    if (opts.flat_error_file) {
      while (!path.empty() && path.back() == '/') path.pop_back();
      path += '.';
      path += std::to_string(local_rank);
      path += ".error.json";
    } else {
      if (!path.empty() && path.back() != '/') {
        path += '/';
      }
      path += std::to_string(local_rank);
      path += "/error.json";
    }
    env.emplace_back("TORCHELASTIC_ERROR_FILE", std::move(path));
  }
  // Only when unset: a user who exported a value keeps it (torchrun semantics).
  for (const char* name : {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"}) {
    if (!parent_has(parent, name)) {
      env.emplace_back(name, "1");
    }
  }
  if (a.local_world_size > 1 && !parent_has(parent, "OMP_NUM_THREADS")) {
    env.emplace_back("OMP_NUM_THREADS", "1");
  }
  if (opts.python_worker && !parent_has(parent, "PYTHONUNBUFFERED")) {
    env.emplace_back("PYTHONUNBUFFERED", "1");
  }
  if (opts.virtual_local_rank) {
    env.emplace_back("CUDA_VISIBLE_DEVICES", virtual_device(parent, local_rank));
  }
  // Aliases read by Horovod-style code (LOCAL_SIZE) and frameworks that think in nodes.
  env.emplace_back("LOCAL_SIZE", local_world_size);
  env.emplace_back("CROSS_RANK", group_rank);
  env.emplace_back("CROSS_SIZE", group_world_size);

  std::sort(env.begin(), env.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
  return env;
}

std::vector<std::string> merge_env(const EnvMap& parent, const EnvList& additions) {
  std::vector<std::string> out;
  out.reserve(parent.size() + additions.size());
  // Both inputs are sorted by name (EnvMap always, EnvList from build_worker_env); a merge
  // keeps the result sorted and costs no extra map. Unsorted additions are handled too:
  // they are sorted into a copy first.
  EnvList sorted_additions;
  const EnvList* add = &additions;
  if (!std::is_sorted(additions.begin(), additions.end(),
                      [](const auto& x, const auto& y) { return x.first < y.first; })) {
    sorted_additions = additions;
    std::stable_sort(sorted_additions.begin(), sorted_additions.end(),
                     [](const auto& x, const auto& y) { return x.first < y.first; });
    add = &sorted_additions;
  }
  auto emit = [&out](const std::string& k, const std::string& v) {
    std::string s;
    s.reserve(k.size() + 1 + v.size());
    s += k;
    s += '=';
    s += v;
    out.push_back(std::move(s));
  };
  auto p = parent.begin();
  auto q = add->begin();
  while (p != parent.end() || q != add->end()) {
    if (q == add->end() || (p != parent.end() && p->first < q->first)) {
      emit(p->first, p->second);
      ++p;
      continue;
    }
    // Additions win; with duplicate names in `additions`, the last one wins.
    auto last = q;
    while (std::next(last) != add->end() && std::next(last)->first == q->first) {
      ++last;
    }
    if (p != parent.end() && p->first == q->first) {
      ++p;
    }
    emit(last->first, last->second);
    q = std::next(last);
  }
  return out;
}

EnvMap current_environment() {
  EnvMap env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    const std::string_view entry(*e);
    const auto eq = entry.find('=');
    if (eq == std::string_view::npos || eq == 0) {
      continue;  // not a NAME=VALUE entry; execve would pass it on but nothing can read it
    }
    env.emplace(std::string(entry.substr(0, eq)), std::string(entry.substr(eq + 1)));
  }
  return env;
}

std::optional<std::string> python_coerced_lc_ctype(const EnvMap& env,
                                                   const std::function<bool(const std::string&)>& available) {
  auto value = [&](const char* name) -> std::string {
    const auto it = env.find(name);
    return it == env.end() ? std::string() : it->second;
  };
  if (!value("LC_ALL").empty() || value("PYTHONCOERCECLOCALE") == "0") return std::nullopt;
  std::string ctype = value("LC_CTYPE");
  if (ctype.empty()) ctype = value("LANG");
  if (!ctype.empty() && ctype != "C" && ctype != "POSIX") return std::nullopt;
  for (const char* target : {"C.UTF-8", "C.utf8", "UTF-8"}) {
    if (available(target)) return std::string(target);
  }
  return std::nullopt;
}

bool ctype_locale_available(const std::string& name) {
  // The usual answer without newlocale's parse of locale.alias (~60 µs of a launch): the C.utf8
  // that Debian, Ubuntu and Fedora install.
  if ((name == "C.UTF-8" || name == "C.utf8") && std::getenv("LOCPATH") == nullptr) {
    struct stat st {};
    if (::stat("/usr/lib/locale/C.utf8/LC_CTYPE", &st) == 0) return true;
  }
  locale_t loc = ::newlocale(LC_CTYPE_MASK, name.c_str(), static_cast<locale_t>(nullptr));
  if (loc == static_cast<locale_t>(nullptr)) return false;
  ::freelocale(loc);
  return true;
}

}  // namespace ddprun::worker_env
