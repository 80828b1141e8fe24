// worker_spec(); see worker_spec.hpp.
#include "ddprun/agent/worker_spec.hpp"

#include <unistd.h>

#include <algorithm>
#include <array>

namespace ddprun::agent {

namespace {

// Adds or replaces `k` (a later source wins, as in merge_env).
void put(worker_env::EnvList& env, const std::string& k, const std::string& v) {
  auto it = std::find_if(env.begin(), env.end(), [&](const auto& kv) { return kv.first == k; });
  if (it != env.end()) {
    it->second = v;
  } else {
    env.emplace_back(k, v);
  }
}

// Python's Template identifier: [_a-z][_a-z0-9]*, ASCII, either case.
bool id_start(char c) { return c == '_' || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool id_char(char c) { return id_start(c) || (c >= '0' && c <= '9'); }

}  // namespace

std::string substitute_local_rank(std::string_view arg, int local_rank, bool* named) {
  constexpr std::string_view name = "local_rank";
  if (named != nullptr) *named = false;
  std::string out;
  out.reserve(arg.size());
  std::size_t i = 0;
  while (i < arg.size()) {
    const std::size_t dollar = arg.find('$', i);
    if (dollar == std::string_view::npos) {
      out.append(arg.substr(i));
      break;
    }
    out.append(arg.substr(i, dollar - i));
    i = dollar + 1;
    if (i < arg.size() && arg[i] == '$') {  // "$$": an escaped "$"
      out += '$';
      ++i;
      continue;
    }
    const bool braced = i < arg.size() && arg[i] == '{';
    std::size_t j = braced ? i + 1 : i;
    if (j >= arg.size() || !id_start(arg[j])) {  // not a placeholder: the "$" stays
      out += '$';
      continue;
    }
    const std::size_t id_begin = j;
    while (j < arg.size() && id_char(arg[j])) ++j;
    const std::string_view id = arg.substr(id_begin, j - id_begin);
    if (braced) {
      if (j >= arg.size() || arg[j] != '}') {  // "${x" unclosed: the "$" stays, the rest is text
        out += '$';
        continue;
      }
      ++j;
    }
    if (id == name) {
      out += std::to_string(local_rank);
      if (named != nullptr) *named = true;
    } else {
      out.append(arg.substr(dollar, j - dollar));  // another name: kept whole
    }
    i = j;
  }
  return out;
}

std::vector<std::string> worker_args(const AgentConfig& config, int local_rank) {
  std::vector<std::string> argv = config.worker_argv;
  // Every argument after the program, the script's path included (torchrun's cmd_args), that
  // names the placeholder.
  for (std::size_t k = 1; k < argv.size(); ++k) {
    if (argv[k].find('$') == std::string::npos) continue;
    bool named = false;
    std::string substituted = substitute_local_rank(argv[k], local_rank, &named);
    if (named) argv[k] = std::move(substituted);
  }
  std::string arg;
  switch (config.local_rank_arg) {
    case AgentConfig::LocalRankArg::dash:
      arg = "--local-rank=" + std::to_string(local_rank);
      break;
    case AgentConfig::LocalRankArg::underscore:
      arg = "--local_rank=" + std::to_string(local_rank);
      break;
    case AgentConfig::LocalRankArg::none:
      return argv;
  }
  // Before the script's own arguments, as torch.distributed.launch puts it.
  const std::size_t at = std::min(config.user_args_index, argv.size());
  argv.insert(argv.begin() + static_cast<std::ptrdiff_t>(at), std::move(arg));
  return argv;
}

worker_env::Placement local_placement(const AgentConfig& config) {
  worker_env::Placement p;
  p.role = config.role;
  p.local_world_size = config.nproc_per_node;
  p.group_rank = 0;
  p.group_world_size = 1;
  p.rank_offset = 0;
  p.world_size = config.nproc_per_node;
  p.master_addr = config.master_addr;
  p.master_port = config.master_port;
  p.max_restarts = config.max_restarts;
  p.run_id = config.run_id;
  p.use_agent_store = config.share_worker_store;
  return p;
}

WorkerSpec worker_spec(const AgentConfig& config, const worker_env::Placement& placement, int local_rank,
                       const AttemptContext& attempt, const worker_env::EnvMap& parent) {
  const auto index = static_cast<std::size_t>(local_rank);
  WorkerSpec s;
  s.local_rank = local_rank;
  s.rank = placement.rank_offset + local_rank;
  s.argv = worker_args(config, local_rank);
  if (config.working_dir) s.cwd = config.working_dir->string();
  if (index < config.cpu_binding.size()) s.cpus = config.cpu_binding[index];
  if (index < config.gpu_devices.size()) s.device = config.gpu_devices[index];

  worker_env::EnvOptions opts;
  opts.python_worker = config.python_worker;
  opts.error_file_dir = attempt.dir;
  opts.flat_error_file = attempt.flat;
  opts.no_error_file = config.no_log_files;
  // The GPU plan implements --virtual-local-rank when there is one (docs/gpus.md).
  opts.virtual_local_rank = config.virtual_local_rank && config.gpu_env.empty();
  s.env = worker_env::build_worker_env(placement, local_rank, opts, parent);
  if (index < config.gpu_env.size()) {
    for (const auto& [k, v] : config.gpu_env[index]) put(s.env, k, v);
  }
  for (const auto& [k, v] : attempt.nccl_env) put(s.env, k, v);
  // torchrun >= 2.9 sets it in its own environment, so its workers inherit it.
  put(s.env, "TORCHELASTIC_SIGNALS_TO_HANDLE", handled_signals_text(config));
  std::sort(s.env.begin(), s.env.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
  for (const auto& [k, v] : s.env) {
    if (k == "TORCHELASTIC_ERROR_FILE") s.error_file = v;
  }
  // Planned per round: --ranks-filter depends on the global rank.
  s.routes = plan_routes(config, local_rank, s.rank);
  std::string host;
  if (config.log_line_prefix_template.find("hostname") != std::string::npos) {
    std::array<char, 256> name{};  // as torchrun: gethostname, not the FQDN
    if (::gethostname(name.data(), name.size() - 1) == 0) host = name.data();
  }
  s.prefix = expand_prefix(config.log_line_prefix_template, config.role, local_rank, s.rank, host);
  return s;
}

}  // namespace ddprun::agent
