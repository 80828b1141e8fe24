#include <catch2/catch.hpp>

#include "ddprun/common/error.hpp"
#include "ddprun/launcher/program.hpp"
#include "sandbox.hpp"

using namespace ddprun::launcher;
using Catch::Matchers::Contains;
using ddprun::UsageError;
using ddprun::test::Sandbox;
using Strings = std::vector<std::string>;

namespace {
ResolvedProgram resolve(const Sandbox& sb, ProgramRequest req, std::map<std::string, std::string> env = {}) {
  auto ctx = sb.context(env);
  return resolve_program(req, ctx.env, ctx.cwd);
}
}  // namespace

TEST_CASE("a .py script runs under python3 from PATH with -u") {
  Sandbox sb;
  const auto r = resolve(sb, {"train.py", {"--lr", "1"}});
  CHECK(r.argv == Strings{sb.path("bin/python3"), "-u", "train.py", "--lr", "1"});
  CHECK(r.python_worker);
}

TEST_CASE("PYTHON_EXEC is honoured, absolute or looked up on PATH") {
  Sandbox sb;
  Sandbox::write(sb.dir() / "mypy", "#!/bin/sh\n", true);
  CHECK(resolve(sb, {"train.py", {}}, {{"PYTHON_EXEC", sb.path("mypy")}}).argv ==
        Strings{sb.path("mypy"), "-u", "train.py"});
  CHECK(resolve(sb, {"train.py", {}}, {{"PYTHON_EXEC", "tool"}}).argv.front() == sb.path("bin/tool"));
  CHECK_THROWS_WITH(resolve(sb, {"train.py", {}}, {{"PYTHON_EXEC", "/nonexistent/python"}}),
                    Contains("PYTHON_EXEC=/nonexistent/python"));
}

TEST_CASE("no python3 anywhere is a clear error") {
  Sandbox sb;
  std::filesystem::remove(sb.dir() / "bin" / "python3");
  CHECK_THROWS_WITH(resolve(sb, {"train.py", {}}), Contains("python3 not found") && Contains("PATH="));
}

TEST_CASE("-m runs a module; combined with --no-python it is an error") {
  Sandbox sb;
  const auto r = resolve(sb, {"pkg.train", {"a"}, true});
  CHECK(r.argv == Strings{sb.path("bin/python3"), "-u", "-m", "pkg.train", "a"});
  CHECK(r.python_worker);
  ProgramRequest bad{"pkg.train", {}, true, true};
  CHECK_THROWS_WITH(resolve(sb, bad), Contains("--no-python") && Contains("-m"));
}

TEST_CASE("--run-path uses runpy.run_path on the script as typed (checked to exist)") {
  Sandbox sb;
  ProgramRequest req{"train.py", {"x"}};
  req.run_path = true;
  req.no_python = true;  // --run-path wins, as in torchrun
  const auto r = resolve(sb, req);
  CHECK(r.argv == Strings{sb.path("bin/python3"), "-u", "-c", std::string(run_path_code), "train.py", "x"});
  req.program = "missing.py";
  CHECK_THROWS_WITH(resolve(sb, req), Contains("missing.py"));
}

TEST_CASE("other programs are executed directly") {
  Sandbox sb;
  CHECK(resolve(sb, {"./run.sh", {"1"}}).argv == Strings{sb.path("run.sh"), "1"});
  CHECK(resolve(sb, {"run.sh", {}}).argv == Strings{sb.path("run.sh")});
  CHECK(resolve(sb, {sb.path("run.sh"), {}}).argv == Strings{sb.path("run.sh")});
  const auto tool = resolve(sb, {"tool", {"--x"}});
  CHECK(tool.argv == Strings{sb.path("bin/tool"), "--x"});
  CHECK_FALSE(tool.python_worker);
  ProgramRequest nopy{"tool", {}};
  nopy.no_python = true;
  CHECK(resolve(sb, nopy).argv == Strings{sb.path("bin/tool")});
  // An interpreter named directly is still a Python worker.
  CHECK(resolve(sb, {"python3", {"train.py"}}).python_worker);
}

TEST_CASE("--no-python runs a .py file directly when it is executable") {
  Sandbox sb;
  Sandbox::write(sb.dir() / "exe.py", "#!/usr/bin/env python3\n", true);
  ProgramRequest req{"exe.py", {}};
  req.no_python = true;
  CHECK(resolve(sb, req).argv == Strings{sb.path("exe.py")});
  req.program = "train.py";  // not executable
  CHECK_THROWS_WITH(resolve(sb, req), Contains("train.py") && Contains("not executable"));
}

TEST_CASE("a non-executable file without --no-python runs under Python, as torchrun does") {
  Sandbox sb;
  CHECK(resolve(sb, {"notes.txt", {}}).argv == Strings{sb.path("bin/python3"), "-u", "notes.txt"});
}

TEST_CASE("missing programs name the program and what was searched") {
  Sandbox sb;
  CHECK_THROWS_WITH(resolve(sb, {"nope.py", {}}), Contains("'nope.py' not found") && Contains(sb.path("nope.py")));
  CHECK_THROWS_WITH(resolve(sb, {"nope", {}}),
                    Contains("'nope' not found") && Contains("PATH=" + sb.path("bin")) && Contains(sb.dir().string()));
  CHECK_THROWS_WITH(resolve(sb, {"./nope", {}}), Contains("'./nope' not found"));
  CHECK_THROWS_AS(resolve(sb, {"", {}}), UsageError);
}

TEST_CASE("find_on_path skips non-executables and directories") {
  Sandbox sb;
  Sandbox::write(sb.dir() / "bin" / "plain", "x", false);
  std::filesystem::create_directory(sb.dir() / "bin" / "adir");
  const std::string path_env = "/nonexistent:" + sb.path("bin");
  CHECK(find_on_path("tool", path_env, sb.dir()) == std::filesystem::path(sb.path("bin/tool")));
  CHECK_FALSE(find_on_path("plain", path_env, sb.dir()));
  CHECK_FALSE(find_on_path("adir", path_env, sb.dir()));
  CHECK_FALSE(find_on_path("a/b", path_env, sb.dir()));
}

TEST_CASE("a directory with __main__.py and a zip application run under Python, as torchrun runs them") {
  Sandbox sb;
  const std::string py = sb.path("bin/python3");
  std::filesystem::create_directory(sb.dir() / "appdir");
  Sandbox::write(sb.dir() / "appdir" / "__main__.py", "print('hi')\n", false);
  const auto app = resolve(sb, {"appdir", {"--lr", "1"}});
  CHECK(app.argv == Strings{py, "-u", "appdir", "--lr", "1"});
  CHECK(app.python_worker);
  CHECK(resolve(sb, {"./appdir/", {}}).argv == Strings{py, "-u", "./appdir/"});
  // runpy.run_path runs a directory by its __main__.py too.
  ProgramRequest run_path{"appdir", {}};
  run_path.run_path = true;
  CHECK(resolve(sb, run_path).argv == Strings{py, "-u", "-c", std::string(run_path_code), "appdir"});
  // A zip application runs under Python even when executable: without a #! line the kernel
  // cannot run it.
  Sandbox::write(sb.dir() / "app.pyz", "PK\x03\x04", true);
  CHECK(resolve(sb, {"app.pyz", {"x"}}).argv == Strings{py, "-u", "app.pyz", "x"});
  Sandbox::write(sb.dir() / "app.zip", "PK\x03\x04", true);
  CHECK(resolve(sb, {"./app.zip", {}}).argv == Strings{py, "-u", "./app.zip"});
  ProgramRequest exec_zip{"./app.pyz", {}};
  exec_zip.no_python = true;
  CHECK(resolve(sb, exec_zip).argv == Strings{sb.path("app.pyz")});
  // A directory without __main__.py, or one given with --no-python, says so.
  std::filesystem::create_directory(sb.dir() / "data");
  CHECK_THROWS_WITH(resolve(sb, {"data", {}}), Contains("'data' is a directory without __main__.py"));
  CHECK_THROWS_WITH(resolve(sb, {"./data", {}}), Contains("'./data' is a directory without __main__.py"));
  ProgramRequest nopy{"./appdir", {}};
  nopy.no_python = true;
  CHECK_THROWS_WITH(resolve(sb, nopy), Contains("'./appdir' is a directory") && Contains("drop --no-python"));
  // A bare name that is also a directory here, without __main__.py, is still looked up on PATH.
  std::filesystem::create_directory(sb.dir() / "tool");
  CHECK(resolve(sb, {"tool", {}}).argv == Strings{sb.path("bin/tool")});
}
