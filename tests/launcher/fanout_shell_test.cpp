// shell_quote/shell_join checked against a real /bin/sh: the quoted words are handed to
// printf '%s\0' through popen (which runs /bin/sh -c) and must come back byte for byte.
#include <catch2/catch.hpp>

#include <cstdio>

#include "ddprun/common/error.hpp"
#include "ddprun/common/shell.hpp"

using Catch::Matchers::Contains;
using ddprun::shell_join;
using ddprun::shell_quote;

namespace {

// Runs `printf '%s\0' <quoted words>` in /bin/sh and splits its output at NULs.
std::vector<std::string> words_seen_by_sh(const std::vector<std::string>& words) {
  std::string cmd = "printf '%s\\0'";
  for (const auto& w : words) cmd += " " + shell_quote(w);
  FILE* f = ::popen(cmd.c_str(), "r");
  REQUIRE(f != nullptr);
  std::string out;
  char buf[4096];
  std::size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
  const int status = ::pclose(f);
  CHECK(status == 0);
  std::vector<std::string> got;
  std::size_t start = 0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    if (out[i] == '\0') {
      got.push_back(out.substr(start, i - start));
      start = i + 1;
    }
  }
  CHECK(start == out.size());
  return got;
}

}  // namespace

TEST_CASE("shell_quote: safe words stay bare, others are single-quoted") {
  CHECK(shell_quote("abc") == "abc");
  CHECK(shell_quote("--rdzv-endpoint=10.0.0.1:29400") == "--rdzv-endpoint=10.0.0.1:29400");
  CHECK(shell_quote("/usr/bin/python3") == "/usr/bin/python3");
  CHECK(shell_quote("user@host,%+") == "user@host,%+");
  CHECK(shell_quote("") == "''");
  CHECK(shell_quote("a b") == "'a b'");
  CHECK(shell_quote("it's") == "'it'\\''s'");
  CHECK(shell_quote("'") == "''\\'''");
  CHECK(shell_quote("$HOME") == "'$HOME'");
  CHECK(shell_quote("~") == "'~'");
  CHECK(shell_quote("[host:${rank}]:") == "'[host:${rank}]:'");
  // zsh expands a word that starts with '=' (=python3: the command's path, or "not found").
  CHECK(shell_quote("=python3") == "'=python3'");
  CHECK(shell_quote("a=b") == "a=b");
  CHECK_THROWS_WITH(shell_quote(std::string("a\0b", 3)), Contains("NUL"));
}

TEST_CASE("shell_join: spaces between words; a first word with '=' is quoted") {
  CHECK(shell_join({}).empty());
  CHECK(shell_join({"cd", "--", "/my dir"}) == "cd -- '/my dir'");
  CHECK(shell_join({"A=b", "cmd", "x=y"}) == "'A=b' cmd x=y");
  CHECK_THROWS_AS(shell_join({std::string("\0", 1)}), ddprun::UsageError);
  CHECK_THROWS_AS(shell_join({"ok", std::string("a\0", 2)}), ddprun::UsageError);
}

TEST_CASE("shell_quote round-trips through /bin/sh") {
  std::vector<std::string> words = {"plain",
                                    "",
                                    " ",
                                    "two words",
                                    "it's",
                                    "''",
                                    "\"double\"",
                                    "$HOME",
                                    "${x:-y}",
                                    "`id`",
                                    "$(id)",
                                    "a\\b",
                                    "\\",
                                    "back\\\\slash",
                                    "semi;colon",
                                    "amp&",
                                    "pipe|",
                                    "<in>",
                                    "glob*?[a]",
                                    "~root",
                                    "#hash",
                                    "!bang",
                                    "tab\there",
                                    "new\nline",
                                    "cr\r",
                                    "unicode h\xC3\xA9llo \xE2\x9C\x93",
                                    "\x01\x02\x7f\xff",
                                    "-n",
                                    "-e",
                                    "--",
                                    "a=b",
                                    "%s",
                                    "{a,b}",
                                    "'\\''",
                                    "end'"};
  std::string all_bytes;
  for (int c = 1; c < 256; ++c) all_bytes.push_back(static_cast<char>(c));
  words.push_back(all_bytes);
  CHECK(words_seen_by_sh(words) == words);
  // shell_join's output as a whole command line: the first word is a command, the rest args.
  const std::vector<std::string> cmd = {"printf", "%s\\0", "x y", "it's", "$(false)"};
  FILE* f = ::popen(shell_join(cmd).c_str(), "r");
  REQUIRE(f != nullptr);
  std::string out;
  char buf[256];
  std::size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
  CHECK(::pclose(f) == 0);
  CHECK(out == std::string("x y\0it's\0$(false)\0", 18));
}
