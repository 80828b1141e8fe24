// NCCL unique IDs (docs/gpus.md): hex encode/decode, and the ddprun-nccl-id holder against the
// real libnccl: its IDs name a bootstrap root that accepts connections while it lives and
// refuses them once it is gone; it dies with its parent (PR_SET_PDEATHSIG).
#include <arpa/inet.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "ddprun/common/error.hpp"
#include "ddprun/worker_env/nccl_id.hpp"

using namespace ddprun::worker_env;
using namespace std::chrono_literals;

namespace {

// The reason NCCL cannot be used here, or empty when it can.
std::string nccl_missing() {
  std::string why;
  for (const auto& c : nccl_library_candidates(current_environment())) {
    if (void* h = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL)) {
      dlclose(h);
      return {};
    }
    why += c + " ";
  }
  return "libnccl not found (tried " + why + ")";
}

// Keep NCCL's bootstrap on loopback: test traffic stays on this host.
const EnvList loopback{{"NCCL_SOCKET_IFNAME", "lo"}};

// true when a TCP connect to the root succeeds; false when refused.
bool root_accepts(const NcclBootstrapRoot& root) {
  const int fd = ::socket(root.family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  int rc = -1;
  if (root.family == AF_INET) {
    sockaddr_in sin{};
    sin.sin_family = AF_INET;
    sin.sin_port = htons(root.port);
    REQUIRE(inet_pton(AF_INET, root.host.c_str(), &sin.sin_addr) == 1);
    rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&sin), sizeof sin);
  } else {
    sockaddr_in6 sin6{};
    sin6.sin6_family = AF_INET6;
    sin6.sin6_port = htons(root.port);
    REQUIRE(inet_pton(AF_INET6, root.host.c_str(), &sin6.sin6_addr) == 1);
    rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&sin6), sizeof sin6);
  }
  const int err = errno;
  ::close(fd);
  if (rc != 0) {
    CHECK(err == ECONNREFUSED);
  }
  return rc == 0;
}

}  // namespace

TEST_CASE("ncclUniqueId hex encoding", "[nccl]") {
  NcclUniqueId id{};
  for (std::size_t i = 0; i < id.size(); ++i) id[i] = static_cast<std::uint8_t>(i * 7 + 3);
  const std::string hex = encode_nccl_id(id);
  CHECK(hex.size() == 256);
  CHECK(hex.substr(0, 6) == "030a11");
  CHECK(decode_nccl_id(hex, "X") == id);
  std::string upper = hex;
  for (auto& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  CHECK(decode_nccl_id(" " + upper + "\n", "X") == id);
  CHECK_THROWS_WITH(decode_nccl_id(hex.substr(2), "DDPRUN_NCCL_UNIQUE_ID"),
                    Catch::Contains("DDPRUN_NCCL_UNIQUE_ID has 254 characters, expected 256"));
  std::string bad = hex;
  bad[17] = 'g';
  CHECK_THROWS_WITH(decode_nccl_id(bad, "DDPRUN_NCCL_UNIQUE_ID"),
                    Catch::Contains("DDPRUN_NCCL_UNIQUE_ID has a non-hex character at position 17"));
  const auto list = decode_nccl_id_list(hex + "," + hex, "DDPRUN_NCCL_UNIQUE_IDS");
  CHECK(list.size() == 2);
  CHECK_THROWS_WITH(decode_nccl_id_list(hex + ",zz", "DDPRUN_NCCL_UNIQUE_IDS"),
                    Catch::Contains("DDPRUN_NCCL_UNIQUE_IDS[1] has 2 characters"));
  CHECK_FALSE(decode_bootstrap_root(NcclUniqueId{}));  // family 0
}

TEST_CASE("the holder is found next to the executable", "[nccl]") {
  // This test binary and ddprun-nccl-id are both built into <build>/bin.
  CHECK(default_nccl_id_holder_path() == std::string(HOLDER_PATH));
}

TEST_CASE("pip's NCCL is found in the workers' Python environment", "[nccl]") {
  namespace fs = std::filesystem;
  char tmpl[] = "/tmp/ddprun-pynccl-XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  const fs::path root = tmpl;
  const auto touch = [](const fs::path& p, bool exec) {
    fs::create_directories(p.parent_path());
    std::ofstream(p) << "";
    if (exec) fs::permissions(p, fs::perms::owner_all);
  };
  // A venv named by PYTHON_EXEC (site-packages, wheel layout nvidia/nccl), a system prefix on
  // PATH (Debian's dist-packages, CUDA 13 wheel layout nvidia/cu13), and a PATH entry whose
  // prefix has NCCL but no python3: ignored.
  const fs::path venv_nccl = root / "venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2";
  const fs::path sys_nccl = root / "usr/local/lib/python3.11/dist-packages/nvidia/cu13/lib/libnccl.so.2";
  touch(root / "venv/bin/python3", true);
  touch(venv_nccl, false);
  touch(root / "usr/bin/python3", true);
  touch(sys_nccl, false);
  touch(root / "nopython/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2", false);
  fs::create_directories(root / "nopython/bin");
  const std::string path = (root / "nopython/bin").string() + ":relative/bin:" + (root / "usr/bin").string() + ":" +
                           (root / "venv/bin").string();

  const EnvMap env{{"PYTHON_EXEC", (root / "venv/bin/python3").string()}, {"PATH", path}};
  CHECK(python_nccl_libraries(env) == std::vector<std::string>{venv_nccl.string(), sys_nccl.string()});
  const auto all = nccl_library_candidates(env);
  REQUIRE(all.size() == 5);
  CHECK(all.front() == "libnccl.so.2");  // the loader path and /usr/local/cuda come first
  CHECK(all.back() == sys_nccl.string());
  // PATH order when PYTHON_EXEC is unset; DDPRUN_NCCL_LIBRARY replaces the whole search.
  CHECK(python_nccl_libraries({{"PATH", path}}) == std::vector<std::string>{sys_nccl.string(), venv_nccl.string()});
  CHECK(nccl_library_candidates({{"PATH", path}, {"DDPRUN_NCCL_LIBRARY", "/x/libnccl.so.2"}}) ==
        std::vector<std::string>{"/x/libnccl.so.2"});
  CHECK(python_nccl_libraries({}).empty());
  fs::remove_all(root);
}

TEST_CASE("missing NCCL is reported as NcclUnavailable", "[nccl]") {
  CHECK_THROWS_AS(generate_nccl_unique_ids(1, {{"DDPRUN_NCCL_LIBRARY", "/nonexistent/libnccl.so.2"}}), NcclUnavailable);
  try {
    NcclIdHolder::start(HOLDER_PATH, 1, 20s, {{"DDPRUN_NCCL_LIBRARY", "/nonexistent/libnccl.so.2"}});
    FAIL("holder started without NCCL");
  } catch (const NcclUnavailable& e) {
    CHECK_THAT(std::string(e.what()), Catch::Contains("/nonexistent/libnccl.so.2"));
  }
}

TEST_CASE("the holder's IDs name a live bootstrap root", "[nccl][holder]") {
  if (const auto why = nccl_missing(); !why.empty()) {
    std::cout << "SKIPPED: " << why << "\n";
    return;
  }
  auto holder = NcclIdHolder::start(HOLDER_PATH, 2, 30s, loopback);
  REQUIRE(holder.ids().size() == 2);
  CHECK(holder.ids()[0] != holder.ids()[1]);
  const auto env = holder.worker_env();
  REQUIRE(env.size() == 2);
  CHECK(env[0].first == "DDPRUN_NCCL_UNIQUE_ID");
  CHECK(env[0].second.size() == 256);
  CHECK(env[1].second == env[0].second + "," + encode_nccl_id(holder.ids()[1]));

  std::vector<NcclBootstrapRoot> roots;
  for (const auto& id : holder.ids()) {
    const auto root = decode_bootstrap_root(id);
    REQUIRE(root);
    CHECK(root->host == "127.0.0.1");
    CHECK(root->port != 0);
    CHECK(root->magic != 0);
    CHECK(root_accepts(*root));
    roots.push_back(*root);
  }
  CHECK(roots[0].port != roots[1].port);

  // A second run gives different IDs.
  auto other = NcclIdHolder::start(HOLDER_PATH, 1, 30s, loopback);
  CHECK(other.ids()[0] != holder.ids()[0]);
  CHECK(other.ids()[0] != holder.ids()[1]);

  // Closing stdin ends the round: the roots go away.
  const pid_t pid = holder.pid();
  holder.stop();
  CHECK(::kill(pid, 0) != 0);
  for (const auto& root : roots) CHECK_FALSE(root_accepts(root));
}

TEST_CASE("NCCL's own output (NCCL_DEBUG=INFO prints to stdout) does not mix with the IDs", "[nccl][holder]") {
  if (const auto why = nccl_missing(); !why.empty()) {
    std::cout << "SKIPPED: " << why << "\n";
    return;
  }
  auto env = loopback;
  env.emplace_back("NCCL_DEBUG", "INFO");
  env.emplace_back("NCCL_DEBUG_SUBSYS", "ALL");
  auto holder = NcclIdHolder::start(HOLDER_PATH, 2, 30s, env);
  REQUIRE(holder.ids().size() == 2);
  for (const auto& id : holder.ids()) {
    const auto root = decode_bootstrap_root(id);
    REQUIRE(root);
    CHECK(root_accepts(*root));
  }
}

TEST_CASE("the holder dies with its parent", "[nccl][holder]") {
  if (const auto why = nccl_missing(); !why.empty()) {
    std::cout << "SKIPPED: " << why << "\n";
    return;
  }
  // This process keeps the holder's stdin open, so only PR_SET_PDEATHSIG can end it when the
  // middle process (its parent) is SIGKILLed. Its stdout reaching EOF says it is gone.
  int in_pipe[2];
  int out_pipe[2];
  REQUIRE(::pipe2(in_pipe, O_CLOEXEC) == 0);
  REQUIRE(::pipe2(out_pipe, O_CLOEXEC) == 0);
  const pid_t middle = ::fork();
  REQUIRE(middle >= 0);
  if (middle == 0) {
    const pid_t holder = ::fork();
    if (holder == 0) {
      ::dup2(in_pipe[0], 0);
      ::dup2(out_pipe[1], 1);
      ::setenv("NCCL_SOCKET_IFNAME", "lo", 1);
      ::execl(HOLDER_PATH, HOLDER_PATH, static_cast<char*>(nullptr));
      ::_exit(127);
    }
    for (;;) ::pause();
  }
  ::close(in_pipe[0]);
  ::close(out_pipe[1]);
  // Wait for the ID line (readiness), then kill the middle process.
  std::string out;
  char buf[512];
  while (out.find('\n') == std::string::npos) {
    pollfd p{out_pipe[0], POLLIN, 0};
    REQUIRE(::poll(&p, 1, 30000) == 1);
    const ssize_t got = ::read(out_pipe[0], buf, sizeof buf);
    REQUIRE(got > 0);
    out.append(buf, static_cast<std::size_t>(got));
  }
  const auto root = decode_bootstrap_root(decode_nccl_id(out.substr(0, out.find('\n')), "holder output"));
  REQUIRE(root);
  CHECK(root_accepts(*root));
  REQUIRE(::kill(middle, SIGKILL) == 0);
  int status = 0;
  REQUIRE(::waitpid(middle, &status, 0) == middle);
  // EOF on the holder's stdout within 10 s (it is killed at once; the bound is for slow CI).
  bool eof = false;
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (!eof && std::chrono::steady_clock::now() < deadline) {
    pollfd p{out_pipe[0], POLLIN, 0};
    if (::poll(&p, 1, 1000) == 1) eof = ::read(out_pipe[0], buf, sizeof buf) <= 0;
  }
  CHECK(eof);
  CHECK_FALSE(root_accepts(*root));
  ::close(in_pipe[1]);
  ::close(out_pipe[0]);
}

TEST_CASE("--nccl-id comm-id picks a bindable port on the given address", "[nccl][comm-id]") {
  const std::string first = pick_nccl_comm_id("127.0.0.1");
  REQUIRE(first.rfind("127.0.0.1:", 0) == 0);
  CHECK(looks_like_comm_id(first));
  const int port = std::stoi(first.substr(first.rfind(':') + 1));
  CHECK(port > 0);
  CHECK(port < 65536);
  // The port was released: rank 0's NCCL can listen on it now.
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  CHECK(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);  // NOLINT
  ::close(fd);
  for (int i = 0; i < 20; ++i) CHECK(pick_nccl_comm_id("127.0.0.1", first) != first);
  CHECK(pick_nccl_comm_id("[::1]").rfind("[::1]:", 0) == 0);
  CHECK(pick_nccl_comm_id("::1").rfind("[::1]:", 0) == 0);
  CHECK_THROWS_WITH(pick_nccl_comm_id("192.0.2.77"), Catch::Contains("cannot bind a port on 192.0.2.77"));
  CHECK_FALSE(looks_like_comm_id(std::string(128, '\x01')));
  CHECK_FALSE(looks_like_comm_id("host"));
  CHECK_FALSE(looks_like_comm_id("host:0"));
  CHECK(looks_like_comm_id("node1.example:29501"));
  // The rendezvous carries 128-byte blocks: the offer is one, and real IDs are not offers.
  const auto offer = encode_comm_id_offer(first);
  CHECK(offer.size() == nccl_unique_id_bytes);
  CHECK(decode_comm_id_offer(offer) == first);
  CHECK_FALSE(decode_comm_id_offer(std::vector<std::uint8_t>(nccl_unique_id_bytes, 7)).has_value());
  auto two = offer;
  two.insert(two.end(), offer.begin(), offer.end());
  CHECK_FALSE(decode_comm_id_offer(two).has_value());
  CHECK_THROWS_WITH(encode_comm_id_offer(std::string(120, 'h') + ":1"), Catch::Contains("too long"));
}
