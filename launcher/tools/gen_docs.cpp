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
#include "ddprun_page.hpp"
#include "flag_docs.hpp"

namespace {

namespace fs = std::filesystem;
using ddprun::docs::CommandDoc;
using ddprun::docs::ddprun_page;
using ddprun::docs::PageDoc;
using ddprun::docs::Section;

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
