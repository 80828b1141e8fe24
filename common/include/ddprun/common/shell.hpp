#pragma once
// Quoting for the POSIX shell (sh, dash, bash in sh mode) that runs a command line given to
// ssh on the remote host. Pure functions; thread safe.
//
// shell_quote(word) yields text that the shell reads back as exactly `word`, one field, with no
// expansion of any kind: words made only of [A-Za-z0-9_@%+=:,./-] (and not empty, and not
// starting with '=', which zsh expands) are left as they are, everything else is put in single
// quotes with each ' written as '\'' . Any byte but
// NUL survives (newlines, UTF-8, control bytes); a NUL cannot be passed through argv at all, so
// a word containing one throws ddprun::UsageError.
#include <string>
#include <string_view>
#include <vector>

namespace ddprun {

// Characters that never need quoting (the same set as Python's shlex.quote).
inline constexpr std::string_view kShellSafeChars =
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_@%+=:,./-";

std::string shell_quote(std::string_view word);

// The words quoted and joined with single spaces. The first word is always quoted when it
// contains '=': unquoted, `A=b cmd` would be read as a variable assignment, not a command.
std::string shell_join(const std::vector<std::string>& words);

}  // namespace ddprun
