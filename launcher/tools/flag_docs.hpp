#pragma once
// Renders a command's documentation from its flag table (ddprun::FlagSpec rows): a man(7) page
// in roff, a bash completion script and a zsh completion script. gen_docs.cpp calls these at
// build time for ddprun(1) and ddprun-rdzvd(8), so the installed pages and completions list the
// same flags, help paragraphs, defaults and value sets as `--help` of the binaries built from
// the same tables. Pure functions of their inputs (no I/O, no state); thread-safe.
//
// Conventions read from the rows:
// - hidden rows appear nowhere;
// - a metavar written in brackets ("[SECONDS]") is an optional value: the flag may be given
//   alone, or with a value (`--watch=5`, `--watch 5`);
// - a metavar FILE or PATH completes file names, DIR directory names; `choices` complete as
//   the value set (with `choices_open`, as keywords beside other forms).
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ddprun/common/flag_spec.hpp"

namespace ddprun::docs {

// A command (or subcommand: `ddprun status`) and its flags.
struct CommandDoc {
  std::string_view name;         // "ddprun", or "status" for a subcommand
  std::string_view synopsis;     // arguments after the name, e.g. "[OPTIONS] PROGRAM [ARGS...]"
  std::string_view summary;      // one line for the subcommand list / completion menus
  std::string_view description;  // text (see Section::body)
  std::span<const FlagSpec> flags;
  // Every flag also has its underscore spelling (--nproc_per_node). ddprun's parser accepts
  // both; a binary whose parser does not must say false here.
  bool underscore_spellings = true;
  // Words after the options are a program with its own arguments (ddprun PROGRAM ARGS...):
  // completion offers files for the first one and stops completing this command's flags after it.
  bool takes_program = false;
};

// A man page section. `body` is plain text: paragraphs separated by a blank line; a line that
// starts with two spaces is a literal (example) line; "- " at the start of a line is a bullet;
// "= TERM" starts a definition (in bold) that the following lines, up to a blank one, describe.
struct Section {
  std::string_view title;  // "EXIT STATUS"
  std::string_view body;
};

struct PageDoc {
  CommandDoc command;
  int section = 1;                      // 1 user command, 8 daemon
  std::string_view summary;             // NAME line text after "name \- "
  std::string_view version;             // "0.1.0"
  std::string_view manual;              // "User Commands", "System Administration"
  std::vector<CommandDoc> subcommands;  // documented after OPTIONS, completed as subcommands
  std::vector<Section> sections;        // after the options: ENVIRONMENT, EXIT STATUS, FILES, SEE ALSO...
};

// The man page in roff with man(7) macros.
std::string render_man(const PageDoc& page);

// A bash completion script defining _<name> and `complete -F _<name> <name>`.
std::string render_bash_completion(const PageDoc& page);

// A zsh completion function file (#compdef <name>) built on _arguments.
std::string render_zsh_completion(const PageDoc& page);

// Every spelling of a flag as typed: "-r", "--redirects" (and "--nproc_per_node" for a dashed
// name when `underscore` is set).
std::vector<std::string> spellings(const FlagSpec& spec, bool underscore);

}  // namespace ddprun::docs
