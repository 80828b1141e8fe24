// The worker library (ddprun/worker.hpp, ddprun/worker.h) through the shared libddprun_worker:
// env parsing (errors name the variable), NCCL IDs, and the store (set/get/add/barrier, C and
// C++) against a real in-process StoreServer on loopback.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <thread>

#include "ddprun/rendezvous/store_server.hpp"
#include "ddprun/worker.h"
#include "ddprun/worker.hpp"

namespace w = ddprun::worker;

namespace {

w::Environment base_env() {
  return {{"RANK", "3"},
          {"LOCAL_RANK", "1"},
          {"WORLD_SIZE", "8"},
          {"LOCAL_WORLD_SIZE", "4"},
          {"GROUP_RANK", "0"},
          {"MASTER_ADDR", "10.0.0.1"},
          {"MASTER_PORT", "29501"},
          {"TORCHELASTIC_RESTART_COUNT", "2"},
          {"TORCHELASTIC_RUN_ID", "job7"}};
}

std::string hex_id(int seed) {
  std::string s;
  static const char* digits = "0123456789abcdef";
  for (int i = 0; i < 256; ++i) s += digits[(i * 5 + seed) % 16];
  return s;
}

// A store server on an io_context thread, for the duration of a test.
struct Server {
  boost::asio::io_context io;
  ddprun::rendezvous::StoreServer server{io, [] {
                                           ddprun::rendezvous::StoreServerOptions o;
                                           o.host = "127.0.0.1";
                                           return o;
                                         }()};
  std::thread thread;
  Server() {
    server.start();
    thread = std::thread([this] { io.run(); });
  }
  ~Server() {
    server.stop();
    io.stop();
    thread.join();
  }
};

}  // namespace

TEST_CASE("worker info from the environment", "[worker]") {
  auto env = base_env();
  const auto i = w::parse_info(env);
  CHECK(i.rank == 3);
  CHECK(i.local_rank == 1);
  CHECK(i.world_size == 8);
  CHECK(i.local_world_size == 4);
  CHECK(i.group_world_size == 1);
  CHECK(i.master_addr == "10.0.0.1");
  CHECK(i.master_port == 29501);
  CHECK(i.restart_count == 2);
  CHECK(i.run_id == "job7");
  CHECK(i.cuda_device == 1);
  env["DDPRUN_CUDA_DEVICE"] = "0";
  CHECK(w::parse_info(env).cuda_device == 0);

  auto missing = base_env();
  missing.erase("WORLD_SIZE");
  CHECK_THROWS_WITH(w::parse_info(missing), Catch::Contains("WORLD_SIZE is not set"));
  auto bad = base_env();
  bad["LOCAL_RANK"] = "one";
  CHECK_THROWS_WITH(w::parse_info(bad), Catch::Contains("LOCAL_RANK='one' is not an integer"));
  bad = base_env();
  bad["MASTER_PORT"] = "70000";
  CHECK_THROWS_WITH(w::parse_info(bad), Catch::Contains("MASTER_PORT=70000 is outside [1, 65535]"));
  bad = base_env();
  bad["RANK"] = "8";
  CHECK_THROWS_WITH(w::parse_info(bad), Catch::Contains("RANK=8 is not below WORLD_SIZE=8"));
  CHECK_THROWS_AS(w::parse_info(bad), std::runtime_error);
  // Layouts no launcher makes.
  bad = base_env();
  bad["GROUP_RANK"] = "5";
  bad["GROUP_WORLD_SIZE"] = "2";
  CHECK_THROWS_WITH(w::parse_info(bad), Catch::Contains("GROUP_RANK=5 is not below GROUP_WORLD_SIZE=2"));
  bad = base_env();
  bad["LOCAL_WORLD_SIZE"] = "9";
  CHECK_THROWS_WITH(w::parse_info(bad), Catch::Contains("LOCAL_WORLD_SIZE=9 is more than WORLD_SIZE=8"));

  const auto o = w::Store::options_from_env(base_env());
  CHECK(o.host == "10.0.0.1");
  CHECK(o.port == 29501);
  CHECK(o.world_size == 8);
  CHECK(o.key_prefix == "/ddprun/attempt_2/");
  CHECK_FALSE(o.legacy_protocol);
  env = base_env();
  env["MASTER_ADDR"] = " ";  // was 300 s of retries against ":29501"
  CHECK_THROWS_WITH(w::Store::options_from_env(env), Catch::Contains("MASTER_ADDR is empty"));
  env = base_env();
  env["DDPRUN_STORE_GENERATION"] = "ancient";
  CHECK_THROWS_WITH(w::Store::options_from_env(env), Catch::Contains("DDPRUN_STORE_GENERATION='ancient'"));
}

TEST_CASE("a store that rank 0 is to host: a failed connect names TORCHELASTIC_USE_AGENT_STORE", "[worker]") {
  // TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 0 of the workers is to host the store, which this
  // library cannot; when nothing listens, the error says why.
  int closed_port = 0;
  {
    const int s = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    socklen_t len = sizeof a;
    REQUIRE(::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len) == 0);
    closed_port = ntohs(a.sin_port);
    ::close(s);
  }
  for (const auto& [k, v] : base_env()) setenv(k.c_str(), v.c_str(), 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", std::to_string(closed_port).c_str(), 1);
  setenv("DDPRUN_STORE_TIMEOUT", "1", 1);
  setenv("TORCHELASTIC_USE_AGENT_STORE", "False", 1);
  CHECK_THROWS_WITH(w::Store::from_env(),
                    Catch::Contains("127.0.0.1:" + std::to_string(closed_port)) &&
                        Catch::Contains("TORCHELASTIC_USE_AGENT_STORE=False: rank 0 of the workers is to host"));
  ddprun_store* h = nullptr;
  CHECK(ddprun_store_open(&h) == DDPRUN_ERR_NETWORK);
  CHECK(std::string(ddprun_last_error()).find("TORCHELASTIC_USE_AGENT_STORE=False") != std::string::npos);
  setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);  // the agent's store: the plain error
  CHECK_THROWS_WITH(w::Store::from_env(), !Catch::Contains("TORCHELASTIC_USE_AGENT_STORE"));
  for (const char* k : {"DDPRUN_STORE_TIMEOUT", "TORCHELASTIC_USE_AGENT_STORE"}) unsetenv(k);
  for (const auto& [k, v] : base_env()) unsetenv(k.c_str());
}

TEST_CASE("NCCL unique IDs from the environment", "[worker]") {
  auto env = base_env();
  CHECK_THROWS_WITH(w::parse_nccl_unique_id(env), Catch::Contains("DDPRUN_NCCL_UNIQUE_ID is not set"));
  env["DDPRUN_NCCL_UNIQUE_ID"] = hex_id(1);
  const auto id = w::parse_nccl_unique_id(env);
  CHECK(id[0] == 0x16);
  CHECK(id[1] == 0xb0);
  CHECK(w::parse_nccl_unique_ids(env).size() == 1);
  env["DDPRUN_NCCL_UNIQUE_IDS"] = hex_id(1) + "," + hex_id(2) + "," + hex_id(3);
  const auto ids = w::parse_nccl_unique_ids(env);
  REQUIRE(ids.size() == 3);
  CHECK(ids[0] == id);
  CHECK(ids[2][0] == 0x38);
  env["DDPRUN_NCCL_UNIQUE_ID"] = hex_id(1).substr(1);
  CHECK_THROWS_WITH(w::parse_nccl_unique_id(env), Catch::Contains("DDPRUN_NCCL_UNIQUE_ID has 255 characters"));
  env["DDPRUN_NCCL_UNIQUE_IDS"] = hex_id(1) + ",xyz";
  CHECK_THROWS_WITH(w::parse_nccl_unique_ids(env), Catch::Contains("DDPRUN_NCCL_UNIQUE_IDS[1]"));
}

TEST_CASE("C API: info, NCCL ID, errors as codes", "[worker][c]") {
  for (const auto& [k, v] : base_env()) setenv(k.c_str(), v.c_str(), 1);
  ddprun_info info{};
  REQUIRE(ddprun_get_info(&info) == DDPRUN_OK);
  CHECK(info.rank == 3);
  CHECK(info.master_port == 29501);
  CHECK(std::string(info.master_addr) == "10.0.0.1");

  unsetenv("DDPRUN_NCCL_UNIQUE_ID");
  unsetenv("DDPRUN_NCCL_UNIQUE_IDS");
  unsigned char id[DDPRUN_NCCL_UNIQUE_ID_BYTES];
  CHECK(ddprun_nccl_unique_id(id) == DDPRUN_ERR_NOT_SET);
  CHECK_THAT(ddprun_last_error(), Catch::Contains("DDPRUN_NCCL_UNIQUE_ID is not set"));
  setenv("DDPRUN_NCCL_UNIQUE_ID", hex_id(4).c_str(), 1);
  REQUIRE(ddprun_nccl_unique_id(id) == DDPRUN_OK);
  CHECK(id[0] == 0x49);
  int count = 0;
  REQUIRE(ddprun_nccl_unique_id_count(&count) == DDPRUN_OK);
  CHECK(count == 1);
  CHECK(ddprun_nccl_unique_id_at(1, id) == DDPRUN_ERR_INVALID);
  setenv("DDPRUN_NCCL_UNIQUE_ID", "nothex", 1);
  CHECK(ddprun_nccl_unique_id(id) == DDPRUN_ERR_INVALID);

  setenv("RANK", "x", 1);
  CHECK(ddprun_get_info(&info) == DDPRUN_ERR_INVALID);
  CHECK_THAT(ddprun_last_error(), Catch::Contains("RANK='x'"));
  unsetenv("RANK");
  CHECK(ddprun_get_info(&info) == DDPRUN_ERR_NOT_SET);
  CHECK(ddprun_get_info(nullptr) == DDPRUN_ERR_INVALID);
}

TEST_CASE("store: set/get/add/barrier against a real server (C++ and C)", "[worker][store]") {
  Server s;
  const int n = 3;
  std::vector<std::thread> threads;
  std::vector<std::string> results(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        w::StoreOptions o;
        o.host = "127.0.0.1";
        o.port = s.server.port();
        o.world_size = n;
        o.timeout = std::chrono::seconds(20);
        w::Store store(o);
        store.set("rank/" + std::to_string(r), "v" + std::to_string(r));
        store.add("sum", r + 1);
        store.barrier();
        std::string all;
        for (int q = 0; q < n; ++q) all += store.get("rank/" + std::to_string(q));
        all += ":" + std::to_string(store.add("sum", 0));
        store.barrier();
        store.barrier("again", n);
        results[static_cast<std::size_t>(r)] = all;
      } catch (const std::exception& e) {
        results[static_cast<std::size_t>(r)] = std::string("error: ") + e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& res : results) CHECK(res == "v0v1v2:6");

  // The C API against the same server (environment: MASTER_ADDR/PORT, WORLD_SIZE=1).
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", std::to_string(s.server.port()).c_str(), 1);
  setenv("WORLD_SIZE", "1", 1);
  setenv("TORCHELASTIC_RESTART_COUNT", "0", 1);
  ddprun_store* store = nullptr;
  REQUIRE(ddprun_store_open(&store) == DDPRUN_OK);
  // Keys live under /ddprun/attempt_0/: the C++ clients above wrote "rank/1" there.
  char buf[16];
  size_t len = 0;
  REQUIRE(ddprun_store_get(store, "rank/1", buf, sizeof buf, &len) == DDPRUN_OK);
  CHECK(std::string(buf, len) == "v1");
  REQUIRE(ddprun_store_set(store, "c", "hello world", 11) == DDPRUN_OK);
  CHECK(ddprun_store_get(store, "c", buf, 4, &len) == DDPRUN_ERR_BUFFER);
  CHECK(len == 11);
  std::int64_t v = 0;
  REQUIRE(ddprun_store_add(store, "sum", 10, &v) == DDPRUN_OK);
  CHECK(v == 16);
  CHECK(ddprun_store_barrier(store) == DDPRUN_OK);
  ddprun_store_close(store);

  // Nothing listening: a network error naming the address.
  setenv("MASTER_PORT", "1", 1);
  setenv("DDPRUN_STORE_TIMEOUT", "1", 1);
  store = nullptr;
  CHECK(ddprun_store_open(&store) == DDPRUN_ERR_NETWORK);
  CHECK_THAT(ddprun_last_error(), Catch::Contains("127.0.0.1:1"));
  CHECK(store == nullptr);
  unsetenv("DDPRUN_STORE_TIMEOUT");
}
