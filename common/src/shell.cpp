#include "ddprun/common/shell.hpp"

#include "ddprun/common/error.hpp"

namespace ddprun {
namespace {

std::string single_quoted(std::string_view word) {
  std::string out;
  out.reserve(word.size() + 2);
  out.push_back('\'');
  for (char c : word) {
    // Inside '...' nothing is special except the closing quote: end the quoted run, add an
    // escaped quote, and open a new run.
    if (c == '\'') {
      out += "'\\''";
    } else {
      out.push_back(c);
    }
  }
  out.push_back('\'');
  return out;
}

void reject_nul(std::string_view word) {
  if (word.find('\0') != std::string_view::npos) {
    throw UsageError("a command-line word contains a NUL byte, which no shell or argv can carry",
                     "remove the NUL byte from the argument");
  }
}

}  // namespace

std::string shell_quote(std::string_view word) {
  reject_nul(word);
  // A word that starts with '=' is quoted too: zsh (a login shell ssh may run) expands "=cmd"
  // to the command's path, or stops with "cmd not found".
  if (!word.empty() && word.front() != '=' && word.find_first_not_of(kShellSafeChars) == std::string_view::npos) {
    return std::string(word);
  }
  return single_quoted(word);
}

std::string shell_join(const std::vector<std::string>& words) {
  std::string out;
  for (std::size_t i = 0; i < words.size(); ++i) {
    if (i != 0) out.push_back(' ');
    if (i == 0 && words[i].find('=') != std::string::npos) {
      reject_nul(words[i]);
      out += single_quoted(words[i]);
    } else {
      out += shell_quote(words[i]);
    }
  }
  return out;
}

}  // namespace ddprun
