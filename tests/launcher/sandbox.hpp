#pragma once
// A throw-away directory with programs for the launcher tests: bin/python3 and bin/tool
// (executable, on the sandbox PATH), train.py, run.sh (executable), notes.txt (not
// executable). Removed on destruction. Not thread-safe; one per test case.
#include <stdlib.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "ddprun/launcher/command_line.hpp"

namespace ddprun::test {

class Sandbox {
 public:
  Sandbox() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "ddprun-launcher-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    dir_ = tmpl;
    std::filesystem::create_directory(dir_ / "bin");
    write(dir_ / "bin" / "python3", "#!/bin/sh\n", true);
    write(dir_ / "bin" / "tool", "#!/bin/sh\n", true);
    write(dir_ / "train.py", "print('hi')\n", false);
    write(dir_ / "run.sh", "#!/bin/sh\n", true);
    write(dir_ / "notes.txt", "x\n", false);
  }
  ~Sandbox() {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  Sandbox(const Sandbox&) = delete;
  Sandbox& operator=(const Sandbox&) = delete;

  const std::filesystem::path& dir() const { return dir_; }
  std::string path(const std::string& rel) const { return (dir_ / rel).string(); }

  static void write(const std::filesystem::path& p, const std::string& text, bool executable) {
    std::ofstream(p) << text;
    ::chmod(p.c_str(), executable ? 0755 : 0644);
  }

  launcher::ParseContext context(const std::map<std::string, std::string>& extra_env = {}) const {
    launcher::ParseContext ctx;
    ctx.env["PATH"] = (dir_ / "bin").string();
    for (const auto& [k, v] : extra_env) ctx.env[k] = v;
    ctx.cwd = dir_;
    ctx.online_cpus = 7;
    return ctx;
  }

  launcher::LaunchOptions parse(std::vector<std::string> args,
                                const std::map<std::string, std::string>& extra_env = {}) const {
    return launcher::parse_command_line(args, context(extra_env));
  }

 private:
  std::filesystem::path dir_;
};

}  // namespace ddprun::test
