#pragma once
// Turning "the training program and its arguments" into the worker argv, the way torchrun does:
//   train.py ARGS         -> PYTHON -u train.py ARGS        (PYTHON = $PYTHON_EXEC, else python3 on PATH)
//   appdir, app.pyz ARGS  -> PYTHON -u appdir ARGS          (a directory with __main__.py, a zip app)
//   -m pkg.mod ARGS       -> PYTHON -u -m pkg.mod ARGS
//   --run-path train.py   -> PYTHON -u -c "<runpy.run_path>" /abs/train.py ARGS
//   ./prog ARGS, prog     -> /abs/prog ARGS                 (also with --no-python)
// Reads the filesystem (stat) to find programs; starts nothing. Throws ddprun::UsageError naming
// the program and where it looked when it cannot be found.
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ddprun::launcher {

struct ProgramRequest {
  std::string program;            // the first positional argument
  std::vector<std::string> args;  // everything after it, untouched
  bool module = false;            // -m/--module
  bool no_python = false;         // --no-python
  bool run_path = false;          // --run-path
};

struct ResolvedProgram {
  std::vector<std::string> argv;
  bool python_worker = false;
  bool operator==(const ResolvedProgram&) const = default;
};

// The code --run-path passes to `python -c`; argv[1] of that interpreter is the script.
// As torchrun's run_script_path, which is decorated with @record: an exception the script raises
// is written to $TORCHELASTIC_ERROR_FILE in torch's format (the summary shows its traceback), and
// raised on. Without importing torch: a plain Python worker runs this way too.
inline constexpr std::string_view run_path_code =
    "import runpy,sys\n"
    "sys.argv=sys.argv[1:]\n"
    "try:\n"
    " runpy.run_path(sys.argv[0],run_name='__main__')\n"
    "except SystemExit:\n"
    " raise\n"
    "except Exception as e:\n"
    " import json,os,time,traceback\n"
    " f=os.environ.get('TORCHELASTIC_ERROR_FILE')\n"
    " if f:\n"
    "  try:\n"
    "   with open(f,'w') as o:json.dump({'message':{'message':'%s: %s'%(type(e).__name__,e),"
    "'extraInfo':{'py_callstack':traceback.format_exc(),'timestamp':str(int(time.time()))}}},o)\n"
    "  except OSError:\n"
    "   pass\n"
    " raise\n";

// `env` supplies PATH and PYTHON_EXEC; relative names are resolved against `cwd`.
ResolvedProgram resolve_program(const ProgramRequest& request, const std::map<std::string, std::string>& env,
                                const std::filesystem::path& cwd);

// Searches `path_env` (a PATH value; empty entries mean the current directory) for an
// executable regular file called `name`. Returns its absolute path.
std::optional<std::filesystem::path> find_on_path(std::string_view name, std::string_view path_env,
                                                  const std::filesystem::path& cwd);

// The interpreter for Python workers: $PYTHON_EXEC (absolute or looked up on PATH), else
// python3 on PATH. Throws UsageError when neither exists.
std::string resolve_python(const std::map<std::string, std::string>& env, const std::filesystem::path& cwd);

}  // namespace ddprun::launcher
