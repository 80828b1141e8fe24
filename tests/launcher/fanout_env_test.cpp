// The remote environment: env files, --env, the default set, the stdin env block and the
// control channel that follows it.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <csignal>
#include <fstream>
#include <thread>

#include "ddprun/common/error.hpp"
#include "ddprun/agent/remote_protocol.hpp"
#include "ddprun/launcher/remote_env.hpp"

using namespace ddprun::launcher;
using Catch::Matchers::Contains;
using ddprun::UsageError;
using ddprun::agent::ControlReader;
using ddprun::agent::encode_control_signal;

namespace {

struct Pipe {
  int r = -1;
  int w = -1;
  Pipe() {
    int fds[2];
    REQUIRE(::pipe(fds) == 0);
    r = fds[0];
    w = fds[1];
  }
  ~Pipe() {
    close_write();
    if (r >= 0) ::close(r);
  }
  void close_write() {
    if (w >= 0) ::close(w);
    w = -1;
  }
  void write_all(std::string_view bytes) const {
    while (!bytes.empty()) {
      const ssize_t n = ::write(w, bytes.data(), bytes.size());
      REQUIRE(n > 0);
      bytes.remove_prefix(static_cast<std::size_t>(n));
    }
  }
};

// Values that must survive the block unchanged.
const EnvEntries& tricky_entries() {
  static const EnvEntries e = {
      {"PLAIN", "value"},
      {"SPACES", "  a b  c  "},
      {"QUOTES", "it's \"quoted\" `x` $HOME \\n"},
      {"NEWLINES", "line1\nline2\r\n"},
      {"EQUALS", "a=b=c"},
      {"EMPTY", ""},
      {"UNICODE", "h\xC3\xA9llo \xE2\x9C\x93 \xF0\x9F\x9A\x80"},
      {"_UNDER9", "\x01\x7f\xff"},
  };
  return e;
}

}  // namespace

TEST_CASE("env file: accepted forms") {
  const std::string text =
      "# comment\n"
      "\n"
      "A=1\n"
      "export B=two words\n"
      "export\tC='single # not a comment'\n"
      "D=\"double 'inner'\"\n"
      "  E = spaced  \n"
      "F=\n"
      "G=''\n"
      "H=a=b\n"
      "I=\"\"\"\n"
      "J='x'y'\n"
      "CRLF=v\r\n"
      "A=again\n"
      "exporter=1\n";
  const EnvEntries want = {{"A", "1"},
                           {"B", "two words"},
                           {"C", "single # not a comment"},
                           {"D", "double 'inner'"},
                           {"E", "spaced"},
                           {"F", ""},
                           {"G", ""},
                           {"H", "a=b"},
                           {"I", "\""},
                           {"J", "x'y"},
                           {"CRLF", "v"},
                           {"A", "again"},
                           {"exporter", "1"}};
  CHECK(parse_env_file_text(text, "job.env") == want);
  CHECK(parse_env_file_text("", "job.env").empty());
}

TEST_CASE("env file: errors name file:line") {
  CHECK_THROWS_WITH(parse_env_file_text("A=1\nnoequals\n", "e.env"), Contains("e.env:2") && Contains("has no '='"));
  CHECK_THROWS_WITH(parse_env_file_text("1A=x\n", "e.env"), Contains("e.env:1") && Contains("'1A' is not a variable"));
  CHECK_THROWS_WITH(parse_env_file_text("A-B=x\n", "e.env"), Contains("'A-B'"));
  CHECK_THROWS_WITH(parse_env_file_text("=x\n", "e.env"), Contains("'' is not a variable"));
  CHECK_THROWS_WITH(parse_env_file_text("\n\nA=\"open\n", "e.env"), Contains("e.env:3") && Contains("does not close"));
  CHECK_THROWS_WITH(parse_env_file_text("A='\n", "e.env"), Contains("does not close"));
  CHECK_THROWS_WITH(parse_env_file_text("A='x\"\n", "e.env"), Contains("does not close"));
  CHECK_THROWS_WITH(parse_env_file_text("export A\n", "e.env"), Contains("has no '='"));
  CHECK_THROWS_WITH(parse_env_file_text(std::string("A=x\0y\n", 6), "e.env"), Contains("NUL"));
  CHECK_THROWS_WITH(parse_env_file_text("MASTER_ADDR=h\n", "e.env"), Contains("e.env:1: MASTER_ADDR cannot be sent"));
  CHECK_THROWS_WITH(parse_env_file_text("PET_NNODES=2\n", "e.env"), Contains("PET_NNODES"));
  try {
    parse_env_file_text("bad\n", "e.env");
    FAIL("no throw");
  } catch (const UsageError& e) {
    CHECK_THAT(e.hint(), Contains("NAME=VALUE"));
  }
}

TEST_CASE("load_env_file") {
  char dir_template[] = "/tmp/ddprun-envfile-XXXXXX";
  REQUIRE(::mkdtemp(dir_template) != nullptr);
  const std::string path = std::string(dir_template) + "/job.env";
  { std::ofstream(path) << "export NCCL_DEBUG=INFO\nX='1 2'\n"; }
  CHECK(load_env_file(path) == EnvEntries{{"NCCL_DEBUG", "INFO"}, {"X", "1 2"}});
  { std::ofstream(path) << "X=1\nY\n"; }
  CHECK_THROWS_WITH(load_env_file(path), Contains(path + ":2"));
  ::unlink(path.c_str());
  CHECK_THROWS_WITH(load_env_file(path), Contains("--env-file " + path + ": cannot be read"));
  // Not a file of NAME=VALUE lines: a device that reads without end, a directory.
  CHECK_THROWS_WITH(load_env_file("/dev/zero"), Contains("--env-file /dev/zero: is a device, not an env file"));
  CHECK_THROWS_WITH(load_env_file(dir_template), Contains("is a directory, not an env file"));
  ::rmdir(dir_template);
}

TEST_CASE("--env flag") {
  CHECK(parse_env_flag("NAME") == EnvFlag{"NAME", std::nullopt});
  CHECK(parse_env_flag("NAME=") == EnvFlag{"NAME", std::string()});
  CHECK(parse_env_flag("N=a = b='c'") == EnvFlag{"N", std::string("a = b='c'")});
  CHECK_THROWS_WITH(parse_env_flag(""), Contains("is not a variable name"));
  CHECK_THROWS_WITH(parse_env_flag("=x"), Contains("--env =x"));
  CHECK_THROWS_WITH(parse_env_flag("A B=1"), Contains("'A B'"));
  CHECK_THROWS_WITH(parse_env_flag("RANK=3"), Contains("RANK cannot be sent") && Contains("ddprun sets it"));
  CHECK_THROWS_WITH(parse_env_flag("TORCHELASTIC_RUN_ID"),
                    Contains("TORCHELASTIC_RUN_ID") && Contains("ddprun sets it"));
  // Each refusal says why, per kind of name.
  CHECK_THROWS_WITH(parse_env_flag("PET_NNODES=2"), Contains("give the flag on this command line"));
  CHECK_THROWS_WITH(parse_env_flag("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE=x"), Contains("[host:RANK]:"));
  CHECK_THROWS_WITH(parse_env_flag("DDPRUN_LAUNCH_TREE=x"), Contains("launch tree's own plan"));
  // torch's agent settings are read by each host's agent: they may be sent.
  for (const char* name : {"TORCHELASTIC_ENABLE_FILE_TIMER", "TORCHELASTIC_TIMER_FILE",
                           "TORCHELASTIC_HEALTH_CHECK_PORT", "TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT"}) {
    INFO(name);
    CHECK(parse_env_flag(std::string(name) + "=1") == EnvFlag{name, std::string("1")});
    CHECK(select_remote_env({}, {}, {{name, "2"}}) == EnvEntries{{name, "2"}});
  }
  CHECK_THROWS_WITH(parse_env_flag(std::string("A=x\0y", 5)), Contains("NUL"));
}

TEST_CASE("name patterns") {
  CHECK(env_name_matches("NCCL_DEBUG", "NCCL_*"));
  CHECK_FALSE(env_name_matches("NCCL_", "NCCL_*"));
  CHECK_FALSE(env_name_matches("NCCLX", "NCCL_*"));
  CHECK(env_name_matches("PATH", "PATH"));
  CHECK_FALSE(env_name_matches("PATHX", "PATH"));
  CHECK(is_env_name("_a1"));
  CHECK_FALSE(is_env_name("1a"));
  CHECK_FALSE(is_env_name(""));
  CHECK_FALSE(is_env_name("a.b"));
}

TEST_CASE("select_remote_env: the default set") {
  const std::map<std::string, std::string> env = {{"NCCL_DEBUG", "INFO"},
                                                  {"NCCL_SOCKET_IFNAME", "eth0"},
                                                  {"CUDA_HOME", "/cuda"},
                                                  {"CUDA_VISIBLE_DEVICES", "0,1"},
                                                  {"PYTHONPATH", "/p"},
                                                  {"PATH", "/bin"},
                                                  {"LD_LIBRARY_PATH", "/l"},
                                                  {"OMP_NUM_THREADS", "4"},
                                                  {"TORCH_SHOW_CPP_STACKTRACES", "1"},
                                                  {"GLOO_SOCKET_IFNAME", "lo"},
                                                  {"PYTHON_EXEC", "/py"},
                                                  {"VIRTUAL_ENV", "/venv"},
                                                  {"HF_HOME", "/hf"},
                                                  {"WANDB_MODE", "offline"},
                                                  {"DDPRUN_LOG_LEVEL", "debug"},
                                                  {"LOGLEVEL", "INFO"},
                                                  {"MASTER_ADDR", "x"},
                                                  {"MASTER_PORT", "1"},
                                                  {"RANK", "0"},
                                                  {"LOCAL_RANK", "0"},
                                                  {"WORLD_SIZE", "1"},
                                                  {"GROUP_RANK", "0"},
                                                  {"LOCAL_WORLD_SIZE", "1"},
                                                  {"PET_NNODES", "2"},
                                                  {"TORCHELASTIC_RUN_ID", "r"},
                                                  {"TORCHELASTIC_ERROR_FILE", "/e"},
                                                  {"TORCHELASTIC_HEALTH_CHECK_PORT", "9000"},
                                                  {"TORCHELASTIC_TIMER_FILE", "/outer/job/fifo"},
                                                  {"TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT", "60"},
                                                  {"HOME", "/root"},
                                                  {"TMPDIR", "/tmp"},
                                                  {"USER", "me"},
                                                  {"SSH_AUTH_SOCK", "/s"},
                                                  {"PATHEXT", "x"},
                                                  {"DDPRUN_RDZV_TOKEN", "secret"}};
  const EnvEntries got = select_remote_env(env, {}, {});
  const EnvEntries want = {{"CUDA_HOME", "/cuda"},
                           {"DDPRUN_LOG_LEVEL", "debug"},
                           {"GLOO_SOCKET_IFNAME", "lo"},
                           {"HF_HOME", "/hf"},
                           {"LD_LIBRARY_PATH", "/l"},
                           {"LOGLEVEL", "INFO"},
                           {"NCCL_DEBUG", "INFO"},
                           {"NCCL_SOCKET_IFNAME", "eth0"},
                           {"OMP_NUM_THREADS", "4"},
                           {"PATH", "/bin"},
                           {"PYTHONPATH", "/p"},
                           {"PYTHON_EXEC", "/py"},
                           {"TORCHELASTIC_HEALTH_CHECK_PORT", "9000"},
                           {"TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT", "60"},
                           {"TORCH_SHOW_CPP_STACKTRACES", "1"},
                           {"VIRTUAL_ENV", "/venv"},
                           {"WANDB_MODE", "offline"}};
  CHECK(got == want);
}

TEST_CASE("select_remote_env: env file then --env, later wins") {
  const std::map<std::string, std::string> env = {
      {"NCCL_DEBUG", "INFO"}, {"MY_VAR", "from-launcher"}, {"CUDA_VISIBLE_DEVICES", "3"}};
  const EnvEntries file = {{"NCCL_DEBUG", "WARN"}, {"FILE_ONLY", "f"}, {"OVER", "file"}};
  const std::vector<EnvFlag> flags = {{"MY_VAR", std::nullopt},
                                      {"UNSET_IN_LAUNCHER", std::nullopt},
                                      {"OVER", std::string("flag")},
                                      {"CUDA_VISIBLE_DEVICES", std::nullopt},
                                      {"NCCL_DEBUG", std::string("TRACE")}};
  const EnvEntries want = {{"NCCL_DEBUG", "TRACE"},
                           {"FILE_ONLY", "f"},
                           {"OVER", "flag"},
                           {"MY_VAR", "from-launcher"},
                           {"CUDA_VISIBLE_DEVICES", "3"}};
  CHECK(select_remote_env(env, flags, file) == want);
  CHECK_THROWS_WITH(select_remote_env(env, {}, {{"WORLD_SIZE", "2"}}), Contains("--env-file: WORLD_SIZE"));
  CHECK_THROWS_WITH(select_remote_env(env, {{"MASTER_PORT", std::nullopt}}, {}), Contains("--env MASTER_PORT"));
  CHECK_THROWS_WITH(select_remote_env(env, {{"1X", std::nullopt}}, {}), Contains("'1X'"));
}

TEST_CASE("env block: encode/decode round trip") {
  const std::string block = encode_env_block(tricky_entries());
  CHECK(block.substr(0, 12) == std::string("PLAIN=value\0", 12));
  CHECK(block.size() >= 2);
  CHECK(block.substr(block.size() - 2) == std::string("\0\0", 2));
  std::size_t used = 0;
  CHECK(decode_env_block(block, &used) == tricky_entries());
  CHECK(used == block.size());
  // Empty block: just the terminator.
  CHECK(encode_env_block({}) == std::string(1, '\0'));
  CHECK(decode_env_block(std::string(1, '\0')).empty());
  // Bytes after the block are not consumed (they are the control channel).
  const std::string with_tail = block + "S15\n";
  CHECK(decode_env_block(with_tail, &used) == tricky_entries());
  CHECK(with_tail.substr(used) == "S15\n");
}

TEST_CASE("env block: byte-at-a-time and arbitrary splits") {
  const std::string stream = encode_env_block(tricky_entries()) + "S2\nS15\n";
  for (std::size_t chunk : {std::size_t{1}, std::size_t{2}, std::size_t{3}, std::size_t{7}, std::size_t{64}}) {
    EnvBlockReader reader;
    std::size_t pos = 0;
    while (!reader.done() && pos < stream.size()) {
      const auto piece = std::string_view(stream).substr(pos, chunk);
      const std::size_t used = reader.feed(piece);
      pos += used;
      if (used < piece.size()) break;
    }
    INFO("chunk " << chunk);
    REQUIRE(reader.done());
    CHECK(reader.entries() == tricky_entries());
    CHECK(stream.substr(pos) == "S2\nS15\n");
    // Once done, the reader consumes nothing more.
    CHECK(reader.feed("X=1") == 0);
  }
}

TEST_CASE("env block: encode and decode errors") {
  CHECK_THROWS_WITH(encode_env_block({{"A", std::string("x\0y", 3)}}), Contains("value of A contains a NUL"));
  CHECK_THROWS_WITH(encode_env_block({{"A=B", "x"}}), Contains("'A=B' is not a variable name"));
  CHECK_THROWS_WITH(encode_env_block({{"", "x"}}), Contains("is not a variable name"));
  CHECK_THROWS_WITH(decode_env_block(std::string("A=1\0", 4)),
                    Contains("env block on stdin") && Contains("before its terminator"));
  CHECK_THROWS_WITH(decode_env_block(""), Contains("before its terminator"));
  CHECK_THROWS_WITH(decode_env_block(std::string("NOEQUALS\0\0", 10)), Contains("'NOEQUALS' has no '='"));
  CHECK_THROWS_WITH(decode_env_block(std::string("1A=x\0\0", 6)), Contains("'1A' is not a variable name"));
  // Size limit: counted over the whole block, including an entry still being read.
  const std::string big = encode_env_block({{"A", std::string(100, 'x')}});
  CHECK_NOTHROW(decode_env_block(big, nullptr, big.size()));
  CHECK_THROWS_WITH(decode_env_block(big, nullptr, big.size() - 1), Contains("larger than"));
  EnvBlockReader reader(10);
  CHECK_THROWS_WITH(reader.feed(std::string(11, 'a')), Contains("larger than 10 bytes"));
  // Corruption: flipping any byte of a valid block either decodes or throws ddprun::Error,
  // never crashes or reads out of bounds.
  const std::string good = encode_env_block(tricky_entries());
  for (std::size_t i = 0; i < good.size(); ++i) {
    std::string bad = good;
    bad[i] = bad[i] == '\0' ? '=' : '\0';
    try {
      (void)decode_env_block(bad);
    } catch (const ddprun::Error&) {
    }
  }
}

TEST_CASE("read_env_block from a pipe") {
  const std::string block = encode_env_block(tricky_entries());
  SECTION("block and control bytes in one write; the rest comes back") {
    Pipe p;
    p.write_all(block + "S10\nS1");
    const EnvBlock got = read_env_block(p.r);
    CHECK(got.entries == tricky_entries());
    CHECK(got.rest == "S10\nS1");
  }
  SECTION("block written in pieces by another thread") {
    Pipe p;
    std::thread writer([&] {
      for (char c : block) p.write_all(std::string_view(&c, 1));
    });
    const EnvBlock got = read_env_block(p.r);
    writer.join();
    CHECK(got.entries == tricky_entries());
    CHECK(got.rest.empty());
  }
  SECTION("a block larger than the pipe buffer") {
    Pipe p;
    EnvEntries many;
    for (int i = 0; i < 2000; ++i) many.emplace_back("V" + std::to_string(i), std::string(100, 'v'));
    const std::string big = encode_env_block(many);
    std::thread writer([&] { p.write_all(big); });
    const EnvBlock got = read_env_block(p.r);
    writer.join();
    CHECK(got.entries == many);
  }
  SECTION("EOF before the terminator") {
    Pipe p;
    p.write_all(std::string("A=1\0B=", 6));
    p.close_write();
    CHECK_THROWS_WITH(read_env_block(p.r), Contains("EOF after 6 bytes"));
  }
  SECTION("EOF at once") {
    Pipe p;
    p.close_write();
    CHECK_THROWS_WITH(read_env_block(p.r), Contains("EOF after 0 bytes"));
  }
  SECTION("over the size limit") {
    Pipe p;
    p.write_all(std::string(200, 'a'));
    CHECK_THROWS_WITH(read_env_block(p.r, 100), Contains("larger than 100 bytes"));
  }
  SECTION("a read error names the cause") { CHECK_THROWS_WITH(read_env_block(-1), Contains("read failed")); }
}

TEST_CASE("control channel") {
  CHECK(encode_control_signal(SIGTERM) == "S15\n");
  ControlReader reader;
  auto r = reader.feed(encode_control_signal(SIGINT) + encode_control_signal(SIGTERM) + "S1");
  CHECK(r.signals == std::vector<int>{SIGINT, SIGTERM});
  CHECK_FALSE(r.error);
  r = reader.feed("0\n");
  CHECK(r.signals == std::vector<int>{10});
  r = reader.feed("");
  CHECK(r.signals.empty());
  // Byte at a time.
  ControlReader slow;
  std::vector<int> got;
  for (char c : std::string("S64\nS1\nS2\n")) {
    const auto part = slow.feed(std::string_view(&c, 1));
    REQUIRE_FALSE(part.error);
    got.insert(got.end(), part.signals.begin(), part.signals.end());
  }
  CHECK(got == std::vector<int>{64, 1, 2});
}

TEST_CASE("control channel: malformed lines are error values") {
  for (const std::string bad : {"X15\n", "S\n", "S0\n", "S65\n", "S1000\n", "S-1\n", "S 1\n", "s15\n", "\n", "S1x\n"}) {
    ControlReader reader;
    const auto r = reader.feed(bad);
    INFO(bad);
    CHECK(r.signals.empty());
    REQUIRE(r.error);
    CHECK_THAT(*r.error, Contains("control channel"));
  }
  // Signals before the bad line are still delivered; nothing after it is.
  ControlReader reader;
  auto r = reader.feed("S15\nbogus\nS2\n");
  CHECK(r.signals == std::vector<int>{15});
  REQUIRE(r.error);
  CHECK_THAT(*r.error, Contains("'bogus'"));
  r = reader.feed("S2\n");
  CHECK(r.signals.empty());
  CHECK(r.error);
  CHECK(reader.error());
  // A line that never ends is cut off.
  ControlReader endless;
  const auto e = endless.feed(std::string(17, '1'));
  REQUIRE(e.error);
  CHECK_THAT(*e.error, Contains("longer than 16 bytes"));
}
