// --dry-run: prints each local rank's WorkerSpec (worker_spec.hpp), the very value the agent
// would spawn, with placeholders for what is only known at launch or per round.
#include <filesystem>
#include <ostream>

#include "ddprun/agent/agent.hpp"
#include "ddprun/agent/diagnosis.hpp"
#include "ddprun/agent/elastic.hpp"
#include "ddprun/agent/job_dir.hpp"
#include "ddprun/agent/output.hpp"
#include "ddprun/agent/process.hpp"
#include "ddprun/agent/worker_spec.hpp"
#include "ddprun/common/shell.hpp"
#include "ddprun/worker_env/numa.hpp"

namespace fs = std::filesystem;

namespace ddprun::agent {

namespace {

const char* describe_route(Route route) {
  switch (route) {
    case Route::inherit:
      return "console";
    case Route::file:
      return "file only";
    case Route::tee:
      return "file and console (prefixed)";
    case Route::prefixed:
      return "console (prefixed)";
    case Route::discard:
      return "nowhere (--log-dir /dev/null)";
  }
  return "?";
}

}  // namespace

void print_dry_run(const AgentConfig& given, std::ostream& out) {
  const AgentConfig config = with_job_mode(given);
  validate_config(config);
  const bool multi_node = *config.job_mode != JobMode::single_node;
  const auto parent = worker_env::current_environment();
  const auto placement = local_placement(config);
  const bool port_at_launch = config.standalone || config.master_port == 0;
  AttemptContext attempt;
  attempt.dir = job_dir_pattern(config) + "/attempt_0";
  {  // the agent's choice of layout (agent.cpp, job_dir.hpp)
    bool any_files = false;
    for (int r = 0; r < config.nproc_per_node; ++r) any_files = any_files || plan_routes(config, r).needs_files();
    bool python = true;  // an executable that cannot be resolved here: assume the common case
    try {
      const auto path_it = parent.find("PATH");
      python = config.python_worker ||
               may_run_python(resolve_executable(config.worker_argv.front(),
                                                 path_it == parent.end() ? std::string() : path_it->second,
                                                 config.working_dir ? config.working_dir->string() : std::string()),
                              config.worker_argv);
    } catch (const std::exception&) {
    }
    attempt.flat = !rank_dirs_needed(config, any_files, python);
  }
  if (config.nccl_id == AgentConfig::NcclIdMode::comm_id) {
    attempt.nccl_env.emplace_back("NCCL_COMM_ID",
                                  (multi_node ? std::string("<group-rank-0 node's address>") : config.master_addr) +
                                      ":<port chosen per attempt>");
  }
  out << "ddprun dry run: " << config.nproc_per_node << " worker(s) on this node; nothing is started\n";
  if (!config.gpu_summary.empty()) {
    out << "gpus: " << config.gpu_summary << '\n';
  }
  if (multi_node) {
    // Where the agent will meet the others: for the static backend master_addr:master_port (the
    // launcher folds --rdzv-endpoint into them), which rendezvous_endpoint() reads.
    const bool fixed = is_static_multi_node(config);
    out << (fixed ? "static job '" : "elastic job '") << config.run_id << "': rendezvous at "
        << (fixed ? rendezvous_endpoint(config).to_string() : config.rdzv_endpoint) << ", nnodes " << config.min_nodes
        << ":" << config.max_nodes
        << "; RANK, WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT below are placeholders assigned per round\n";
  }
  for (int r = 0; r < config.nproc_per_node; ++r) {
    const WorkerSpec spec = worker_spec(config, placement, r, attempt, parent);
    out << "local rank " << r << ":\n  argv:";
    for (const auto& a : spec.argv) {
      out << ' ' << shell_quote(a);
    }
    out << "\n  cwd: " << (spec.cwd.empty() ? fs::current_path().string() : spec.cwd) << '\n';
    if (static_cast<std::size_t>(r) < config.gpu_devices.size()) {
      out << "  device: " << spec.device << '\n';
    }
    if (static_cast<std::size_t>(r) < config.cpu_binding.size()) {
      out << "  cpus: " << worker_env::format_cpu_list(spec.cpus) << " (--numa-binding " << config.numa_binding
          << ")\n";
    }
    out << "  env:\n";
    for (const auto& [k, v] : spec.env) {
      out << "    " << k << '=' << ((k == "MASTER_PORT" && port_at_launch) ? std::string("<chosen at launch>") : v)
          << '\n';
    }
    out << "  stdout: " << describe_route(spec.routes.out) << "\n  stderr: " << describe_route(spec.routes.err) << '\n';
  }
}

}  // namespace ddprun::agent
