// gen_docs OUTDIR: writes the man pages and shell completions of ddprun and ddprun-rdzvd under
// OUTDIR (share/man/man1/ddprun.1, share/man/man8/ddprun-rdzvd.8,
// share/bash-completion/completions/{ddprun,ddprun-rdzvd}, share/zsh/site-functions/_{ddprun,
// ddprun-rdzvd}), rendered from the same flag tables the binaries parse with and print --help
// from. Run by the build; a file whose content is unchanged is not rewritten (no rebuild churn).
// Exit 0 on success, 1 when a file cannot be written (the message names it), 2 on bad usage.
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include "../../rendezvous/rdzvd/flags.hpp"
#include "ddprun/common/version.hpp"
#include "ddprun/launcher/flags.hpp"
#include "ddprun/launcher/status_command.hpp"
#include "flag_docs.hpp"

namespace {

namespace fs = std::filesystem;
using ddprun::docs::CommandDoc;
using ddprun::docs::PageDoc;
using ddprun::docs::Section;

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

PageDoc rdzvd_page() {
  PageDoc page;
  page.section = 8;
  page.version = ddprun::version_string;
  page.manual = "System Administration";
  page.summary = "TCPStore-compatible store and elastic rendezvous daemon for ddprun";
  page.command = CommandDoc{
      .name = "ddprun-rdzvd",
      .synopsis = "[OPTIONS]",
      .summary = "store and rendezvous daemon",
      .description =
          "ddprun-rdzvd serves ddprun's elastic rendezvous for any number of jobs at once, kept apart "
          "by their --rdzv-id, and a key-value store speaking PyTorch's c10d TCPStore protocol on the "
          "same port, so torchrun agents can use it as their c10d endpoint too. Agents point at it "
          "with ddprun --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id JOB.\n"
          "\n"
          "When the socket listens, the first line on standard output is exactly listening on "
          "HOST:PORT; with --port-file the file holds the bound port and a newline, written "
          "atomically. SIGINT and SIGTERM close every connection and stop the daemon. The open-files "
          "soft limit is raised to the hard limit at start. Logs go to standard error.",
      .flags = ddprun::rdzvd::rdzvd_flags(),
      .underscore_spellings = false,
      .takes_program = false,
  };
  page.sections = {
      Section{"ENVIRONMENT",
              "= DDPRUN_RDZV_TOKEN\n"
              "The token every client must prove in the handshake when --token-file is not given.\n"
              "\n"
              "= DDPRUN_LOG_LEVEL\n"
              "The log level when --log-level is not given."},
      Section{"EXIT STATUS",
              "0 clean stop (SIGINT or SIGTERM); 1 cannot listen (the message names host:port) or cannot "
              "write the port file; 2 bad command line."},
      Section{"EXAMPLES",
              "  ddprun-rdzvd --port 29400 --token-file /etc/ddprun/token\n"
              "  ddprun status --rdzv-endpoint localhost:29400 --token-file /etc/ddprun/token"},
      Section{"SEE ALSO", "ddprun(1)"},
  };
  return page;
}

void write_if_changed(const fs::path& path, const std::string& content) {
  {
    std::ifstream in(path, std::ios::binary);
    std::ostringstream old;
    if (in) {
      old << in.rdbuf();
      if (old.str() == content) return;
    }
  }
  std::error_code ec;
  fs::create_directories(path.parent_path(), ec);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << content;
  out.flush();
  if (!out) throw std::runtime_error("cannot write " + path.string() + ": " + std::strerror(errno));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: gen_docs OUTDIR\n";
    return 2;
  }
  const fs::path root = argv[1];
  try {
    for (const auto& page : {ddprun_page(), rdzvd_page()}) {
      const std::string name(page.command.name);
      write_if_changed(
          root / "share/man" / ("man" + std::to_string(page.section)) / (name + "." + std::to_string(page.section)),
          ddprun::docs::render_man(page));
      write_if_changed(root / "share/bash-completion/completions" / name, ddprun::docs::render_bash_completion(page));
      write_if_changed(root / "share/zsh/site-functions" / ("_" + name), ddprun::docs::render_zsh_completion(page));
    }
  } catch (const std::exception& e) {
    std::cerr << "gen_docs: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
