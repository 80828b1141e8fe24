// libFuzzer target: the launcher's command line read without CLI11 (ParsedFlags::parse, the path
// every common launch takes) against CLI11 with every flag defined. A command line the two read
// differently (another error, help or not, other words left for the program, another answer to
// any query the resolvers make) aborts: it is a launch that would not do what torchrun's
// spelling of it means. The differential test flags_lazy_test.cpp does the same over a fixed
// corpus; this one lets the fuzzer look for the lines nobody wrote down. A line both read alike
// then goes through parse_command_line whole (the resolvers, under ASan and UBSan).
//
// Input: byte 0 picks the PET_* environment (bit 0: none or a few PET_* forms of flags that are
// mostly not on the command line). The rest is split at NUL into argv words. A word starting with
// byte 1..4 names a flag of the table by its next byte (index modulo the table's size), so the
// fuzzer reaches every flag without guessing its name: 1 "--dash-spelling", 2
// "--underscore_spelling", 3 "-s" (the short name, or the dash spelling), 4 "--dash-spelling=REST"
// with the word's remaining bytes as the value.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "flags_outcome.hpp"

namespace {

std::string word(std::string_view raw) {
  const auto& flags = ddprun::launcher::launcher_flags();
  if (raw.size() < 2 || raw[0] < 1 || raw[0] > 4) return std::string(raw);
  const auto& spec = flags[static_cast<unsigned char>(raw[1]) % flags.size()];
  switch (raw[0]) {
    case 1:
      return "--" + std::string(spec.dash);
    case 2:
      return "--" + ddprun::underscore_spelling(spec.dash);
    case 3:
      return spec.short_name.empty() ? "--" + std::string(spec.dash) : "-" + std::string(spec.short_name);
    default:
      return "--" + std::string(spec.dash) + "=" + std::string(raw.substr(2));
  }
}

// A removed directory, the parse's working directory: a relative file name a flag gives
// (--hostfile hosts, password_file=p) names nothing there, and nothing is left behind however the
// fuzzer ends. (The process keeps its own: libFuzzer writes corpus units and reproducers there.)
const std::string& empty_dir() {
  static const std::string dir = [] {
    char templ[] = "/tmp/ddprun-fuzz-flags-XXXXXX";
    if (::mkdtemp(templ) == nullptr || ::rmdir(templ) != 0) std::abort();
    return std::string(templ);
  }();
  return dir;
}

std::string shown(const ddprun_test::Args& args) {
  std::string out = "ddprun";
  for (const auto& a : args) out += " '" + a + "'";
  return out;
}

void print(const char* name, const ddprun_test::Outcome& o) {
  std::fprintf(stderr, "%s: error '%s' help %d\n", name, o.error.c_str(), o.help ? 1 : 0);
  for (const auto& w : o.remaining) std::fprintf(stderr, "  remaining '%s'\n", w.c_str());
  for (const auto& w : o.program) std::fprintf(stderr, "  program '%s'\n", w.c_str());
  for (const auto& w : o.answers) std::fprintf(stderr, "  %s\n", w.c_str());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1 || size > 4096) return 0;
  ddprun::launcher::ParseContext ctx;
  ctx.cwd = empty_dir();
  if ((data[0] & 1) != 0) {
    ctx.env = {{"PET_NNODES", "3"}, {"PET_NO_PYTHON", "1"}, {"PET_MAX_RESTARTS", "2"}, {"PET_STANDALONE", "x"}};
  }
  const std::string_view rest(reinterpret_cast<const char*>(data + 1), size - 1);
  ddprun_test::Args args;
  if (!rest.empty()) {
    std::size_t from = 0;
    for (;;) {
      const auto nul = rest.find('\0', from);
      args.push_back(word(rest.substr(from, nul == std::string_view::npos ? std::string_view::npos : nul - from)));
      if (nul == std::string_view::npos || args.size() >= 64) break;
      from = nul + 1;
    }
  }
  const auto lazy = ddprun_test::parse_outcome(args, ctx, true);
  const auto full = ddprun_test::parse_outcome(args, ctx, false);
  if (!(lazy == full)) {
    std::fprintf(stderr, "read differently without CLI11: %s\n", shown(args).c_str());
    print("without CLI11", lazy);
    print("with CLI11", full);
    std::abort();
  }
  // Then the whole command line as a launch resolves it (every value parsed and checked against
  // the others): a refusal or a configuration, nothing else. A file a flag names is looked for in
  // the empty directory; a word with a '/' could name a device that never ends (/dev/zero) or one
  // that blocks (a FIFO), so such lines stop here.
  if (!lazy.error.empty() || lazy.help) return 0;
  for (const auto& a : args) {
    if (a.find('/') != std::string::npos) return 0;
  }
  try {
    (void)ddprun::launcher::parse_command_line(args, ctx);
  } catch (const ddprun::Error&) {
  }
  return 0;
}
