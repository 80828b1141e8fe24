#include "ddprun/launcher/program.hpp"

#include <unistd.h>

#include <algorithm>
#include <regex>

#include "ddprun/agent/worker_spec.hpp"
#include "ddprun/common/error.hpp"
#include "ddprun/common/strings.hpp"

namespace ddprun::launcher {
namespace fs = std::filesystem;
namespace {

bool is_plain_file(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

bool is_executable_file(const fs::path& p) { return is_plain_file(p) && ::access(p.c_str(), X_OK) == 0; }

bool is_dir(const fs::path& p) {
  std::error_code ec;
  return fs::is_directory(p, ec);
}

// What Python runs a directory by (`python appdir`): its __main__ module, as source or bytecode.
bool has_main_module(const fs::path& dir) {
  return is_plain_file(dir / "__main__.py") || is_plain_file(dir / "__main__.pyc");
}

// Files Python runs whatever their mode bits: scripts, and zip applications (zipapp's .pyz, or
// any .zip with a __main__.py), which the kernel cannot exec without a #! line.
bool python_file_suffix(const fs::path& p) {
  const auto ext = p.extension();
  return ext == ".py" || ext == ".pyz" || ext == ".zip";
}

std::string lookup(const std::map<std::string, std::string>& env, const std::string& key) {
  const auto it = env.find(key);
  return it == env.end() ? std::string() : it->second;
}

fs::path absolute_from(const fs::path& p, const fs::path& cwd) {
  return (p.is_absolute() ? p : cwd / p).lexically_normal();
}

// "python" followed by digits and dots only (python, python3, python3.11); by hand, because a
// std::regex costs its construction on every launch.
bool looks_like_python(std::string_view argv0) {
  const std::string name = fs::path(argv0).filename().string();
  if (name.rfind("python", 0) != 0) return false;
  return std::all_of(name.begin() + 6, name.end(), [](char c) { return (c >= '0' && c <= '9') || c == '.'; });
}

std::string searched_dirs(std::string_view path_env) {
  return path_env.empty() ? std::string("PATH is empty") : "searched PATH=" + std::string(path_env);
}

}  // namespace

std::optional<fs::path> find_on_path(std::string_view name, std::string_view path_env, const fs::path& cwd) {
  if (name.empty() || name.find('/') != std::string_view::npos) return std::nullopt;
  for (const auto& dir : split(path_env, ':')) {
    const fs::path candidate = absolute_from(fs::path(dir.empty() ? "." : dir) / name, cwd);
    if (is_executable_file(candidate)) return candidate;
  }
  return std::nullopt;
}

std::string resolve_python(const std::map<std::string, std::string>& env, const fs::path& cwd) {
  const std::string path_env = lookup(env, "PATH");
  const std::string exec = std::string(trim(lookup(env, "PYTHON_EXEC")));
  if (!exec.empty()) {
    if (exec.find('/') != std::string::npos) {
      const fs::path p = absolute_from(exec, cwd);
      if (!is_executable_file(p)) {
        throw UsageError("PYTHON_EXEC=" + exec + ": not an executable file",
                         "point PYTHON_EXEC at a Python interpreter, or unset it to use python3 from PATH");
      }
      return p.string();
    }
    if (auto p = find_on_path(exec, path_env, cwd)) return p->string();
    throw UsageError("PYTHON_EXEC=" + exec + ": not found on PATH (" + searched_dirs(path_env) + ")",
                     "point PYTHON_EXEC at a Python interpreter, or unset it to use python3 from PATH");
  }
  if (auto p = find_on_path("python3", path_env, cwd)) return p->string();
  throw UsageError("python3 not found (" + searched_dirs(path_env) + ")",
                   "install Python 3, add it to PATH, or set PYTHON_EXEC to the interpreter");
}

ResolvedProgram resolve_program(const ProgramRequest& request, const std::map<std::string, std::string>& env,
                                const fs::path& cwd) {
  const std::string& program = request.program;
  const std::string path_env = lookup(env, "PATH");
  ResolvedProgram out;
  auto with_args = [&](std::vector<std::string> head) {
    head.insert(head.end(), request.args.begin(), request.args.end());
    return head;
  };
  if (program.empty()) throw UsageError("the training program is empty", "name a script, module or executable");

  if (request.module) {
    if (request.no_python) {
      throw UsageError("--no-python cannot be combined with -m/--module",
                       "drop --no-python to run the module under Python, or drop -m to run an executable");
    }
    out.argv = with_args({resolve_python(env, cwd), "-u", "-m", program});
    out.python_worker = true;
    return out;
  }

  const fs::path as_file = absolute_from(program, cwd);
  // A script given to Python is a worker argument, in which each agent replaces ${local_rank}
  // (worker_spec.hpp): checked as local rank 0 will name it.
  bool templated = false;
  const std::string rank0_script = agent::substitute_local_rank(program, 0, &templated);
  const fs::path script_file = templated ? absolute_from(rank0_script, cwd) : as_file;
  if (request.run_path) {
    // torchrun: --run-path takes precedence over --no-python. runpy.run_path also runs a
    // directory (or zip) by its __main__.py.
    if (!is_plain_file(script_file) && !(is_dir(script_file) && has_main_module(script_file))) {
      throw UsageError(
          "--run-path: training script '" + program + "' not found (looked for " + script_file.string() + ")",
          "pass the path of a Python file");
    }
    // The path as written, as torchrun passes it (the worker runs in this directory): sys.argv[0]
    // and __file__ look the same as under torchrun.
    out.argv = with_args({resolve_python(env, cwd), "-u", "-c", std::string(run_path_code), program});
    out.python_worker = true;
    return out;
  }

  const bool has_slash = program.find('/') != std::string::npos;
  const bool python_suffix = python_file_suffix(as_file);
  const bool directory = !request.no_python && is_dir(as_file);
  auto no_main_module = [&] {
    return UsageError(
        "training program '" + program + "' is a directory without __main__.py (" + as_file.string() + ")",
        "Python runs a directory by its __main__.py: add one, or name the script inside it");
  };
  if (directory && has_main_module(as_file)) {
    // torchrun runs `python -u appdir`, which runs appdir/__main__.py with appdir on sys.path.
    out.argv = with_args({resolve_python(env, cwd), "-u", program});
    out.python_worker = true;
    return out;
  }
  // Without __main__.py, a bare name may still be a command on PATH (a directory of that name
  // in the working directory is a coincidence).
  if (directory && has_slash) throw no_main_module();
  if (!request.no_python && python_suffix) {
    if (!is_plain_file(script_file)) {
      throw UsageError("training script '" + program + "' not found (looked for " + script_file.string() + ")",
                       "check the path; relative paths are taken from the current directory");
    }
    // Passed as written, like torchrun: the worker runs in the same directory, so sys.argv[0]
    // and __file__ look the same as under torchrun.
    out.argv = with_args({resolve_python(env, cwd), "-u", program});
    out.python_worker = true;
    return out;
  }

  // Anything else is an executable: a path (contains '/'), a file in the current directory, or
  // a name on PATH.
  std::optional<fs::path> exe;
  if (has_slash || is_plain_file(as_file)) {
    if (is_executable_file(as_file)) {
      exe = as_file;
    } else if (is_plain_file(as_file) && !request.no_python) {
      // A non-executable file without --no-python: torchrun runs every program under Python.
      out.argv = with_args({resolve_python(env, cwd), "-u", program});
      out.python_worker = true;
      return out;
    } else if (is_plain_file(as_file)) {
      throw UsageError("training program '" + program + "' is not executable (" + as_file.string() + ")",
                       "chmod +x it, or drop --no-python to run it under Python");
    } else if (has_slash && is_dir(as_file)) {
      throw UsageError("training program '" + program + "' is a directory (" + as_file.string() + ")",
                       "drop --no-python to run its __main__.py under Python, or name an executable");
    } else if (has_slash) {
      throw UsageError("training program '" + program + "' not found (looked for " + as_file.string() + ")",
                       "check the path; relative paths are taken from the current directory");
    }
  }
  if (!exe) exe = find_on_path(program, path_env, cwd);
  if (!exe && directory) throw no_main_module();
  if (!exe) {
    throw UsageError("training program '" + program + "' not found: not a file in " + cwd.string() +
                         " and not an executable on PATH (" + searched_dirs(path_env) + ")",
                     "give the path of a script or executable, or a command on PATH");
  }
  out.argv = with_args({exe->string()});
  out.python_worker = looks_like_python(exe->string());
  return out;
}

}  // namespace ddprun::launcher
