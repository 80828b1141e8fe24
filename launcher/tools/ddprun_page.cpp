// ddprun_page(): see ddprun_page.hpp.
#include "ddprun_page.hpp"

#include "ddprun/common/version.hpp"
#include "ddprun/launcher/flags.hpp"
#include "ddprun/launcher/status_command.hpp"

namespace ddprun::docs {

PageDoc ddprun_page() {
  PageDoc page;
  page.section = 1;
  page.version = ddprun::version_string;
  page.manual = "User Commands";
  page.summary = "launch a distributed training job (a drop-in for torchrun)";
  page.command = CommandDoc{
      .name = "ddprun",
      .synopsis = "[OPTIONS] PROGRAM|-m MODULE [ARGS...]",
      .summary = "launch a distributed training job",
      .description =
          "ddprun starts the workers of a distributed training job on this node and negotiates "
          "their place in the job (MASTER_ADDR, MASTER_PORT, RANK, LOCAL_RANK, WORLD_SIZE and the "
          "rest of torchrun's environment) with the other nodes through a rendezvous: static (fixed "
          "node ranks), or c10d (elastic, hosted by one of the agents or by ddprun-rdzvd(8)). It "
          "takes torchrun's command line; failed worker groups are restarted up to --max-restarts "
          "times.\n"
          "\n"
          "With --hosts or --hostfile ddprun is instead the fan-out launcher: it starts one ddprun "
          "agent per host over ssh and hosts the job's rendezvous itself.\n"
          "\n"
          "The first argument that is not a ddprun option is the training program; it and everything "
          "after it are passed to the workers untouched. Program forms:\n"
          "  ddprun [options] train.py ARGS      PYTHON -u train.py ARGS\n"
          "  ddprun [options] -m pkg.mod ARGS    PYTHON -u -m pkg.mod ARGS\n"
          "  ddprun [options] --run-path t.py    PYTHON -u -c <runpy.run_path> /abs/t.py ARGS\n"
          "  ddprun [options] ./prog ARGS        /abs/prog ARGS\n"
          "\n"
          "PYTHON is $PYTHON_EXEC, else python3 on PATH. Every option has a dash and an underscore "
          "spelling (--nproc-per-node, --nproc_per_node), takes its value as --flag VALUE or "
          "--flag=VALUE, and may be abbreviated when the abbreviation is unambiguous. The flag wins "
          "over its PET_* environment form, which wins over the default.",
      .flags = ddprun::launcher::launcher_flags(),
      .underscore_spellings = true,
      .takes_program = true,
  };
  page.subcommands.push_back(CommandDoc{
      .name = "status",
      .synopsis = "--rdzv-endpoint HOST[:PORT] [--rdzv-id ID] [--json] [--watch [SECONDS]]",
      .summary = "show the jobs of a rendezvous server",
      .description = "Asks a rendezvous server (ddprun-rdzvd(8), or an agent hosting an embedded rendezvous) for "
                     "its jobs and prints, per job, its state, round, node range, restarts, timers and progress, "
                     "then one row per member: group rank, role, address, workers, state, heartbeat age and "
                     "lease. --json prints the same as one JSON object per line; --watch repeats the query, "
                     "redrawing a terminal in place. A training program literally named status must be run as "
                     "./status.",
      .flags = ddprun::launcher::status_flags(),
      .underscore_spellings = true,
      .takes_program = false,
  });
  page.sections = {
      Section{"ENVIRONMENT",
              "= PET_<NAME>\n"
              "The environment form of an option (PET_NPROC_PER_NODE=4); booleans take 1 or 0. Listed "
              "with each option above.\n"
              "\n"
              "= PYTHON_EXEC\n"
              "The Python interpreter that runs the training program (default: python3 on PATH).\n"
              "\n"
              "= DDPRUN_LOG_LEVEL, LOGLEVEL\n"
              "ddprun's own log level when --log-level is not given.\n"
              "\n"
              "= DDPRUN_RDZV_TOKEN\n"
              "The token the agent proves to ddprun-rdzvd in the handshake (never sent itself); removed from the "
              "workers' environment.\n"
              "\n"
              "= SLURM_*\n"
              "Inside a Slurm allocation the node count, node rank and rendezvous come from Slurm's "
              "variables unless a placement option is given."},
      Section{"EXIT STATUS",
              "0 success; the failing worker's own exit code (128+N for a worker killed by signal N); "
              "128+N when ddprun is stopped by signal N; 2 usage error; 1 other ddprun error.\n"
              "\n"
              "ddprun status: 0 printed (with --watch: stopped by Ctrl-C); 1 the server cannot be "
              "reached or the job is unknown; 2 usage error."},
      Section{"EXAMPLES",
              "  ddprun --nproc-per-node gpu train.py --epochs 3\n"
              "  ddprun --nnodes 2:4 --rdzv-backend c10d --rdzv-endpoint head:29400 --rdzv-id job7 train.py\n"
              "  ddprun --hosts node1,node2 --nproc-per-node 8 train.py\n"
              "  ddprun status --rdzv-endpoint head:29400 --watch"},
      Section{"SEE ALSO", "ddprun-rdzvd(8), torchrun(1)"},
  };
  return page;
}

}  // namespace ddprun::docs
