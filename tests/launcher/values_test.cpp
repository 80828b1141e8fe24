#include <catch2/catch.hpp>

#include <csignal>
#include <regex>

#include "ddprun/common/error.hpp"
#include "ddprun/launcher/values.hpp"

using namespace ddprun::launcher;
using Catch::Matchers::Contains;
using ddprun::UsageError;
using ddprun::agent::Streams;

TEST_CASE("nnodes: N and MIN:MAX") {
  CHECK(parse_nnodes("1", "--nnodes") == NodeRange{1, 1});
  CHECK(parse_nnodes("4", "--nnodes") == NodeRange{4, 4});
  CHECK(parse_nnodes("1:4", "--nnodes") == NodeRange{1, 4});
  CHECK(parse_nnodes("3:3", "--nnodes") == NodeRange{3, 3});
}

TEST_CASE("nnodes: errors name the flag and the accepted forms") {
  CHECK_THROWS_WITH(parse_nnodes("2:1", "--nnodes"), Contains("--nnodes=2:1: MIN must be <= MAX") &&
                                                         Contains("accepted forms: N or MIN:MAX with 0 < MIN <= MAX"));
  CHECK_THROWS_WITH(parse_nnodes("0", "--nnodes"), Contains("--nnodes=0") && Contains("> 0"));
  CHECK_THROWS_WITH(parse_nnodes("0:2", "--nnodes"), Contains("> 0"));
  CHECK_THROWS_WITH(parse_nnodes("-1", "--nnodes"), Contains("--nnodes=-1"));
  CHECK_THROWS_WITH(parse_nnodes("1:2:3", "--nnodes"), Contains("MIN:MAX"));
  CHECK_THROWS_WITH(parse_nnodes("two", "PET_NNODES"), Contains("PET_NNODES=two"));
  CHECK_THROWS_AS(parse_nnodes("", "--nnodes"), UsageError);
  CHECK_THROWS_AS(parse_nnodes("1:", "--nnodes"), UsageError);
}

TEST_CASE("CUDA_VISIBLE_DEVICES counting follows CUDA's rules") {
  using Opt = std::optional<std::string>;
  // The launcher counts with worker_env's rules and no inventory (syntax only).
  const auto count_visible = [](const Opt& cvd) { return ddprun::worker_env::count_visible_gpus(cvd, {}); };
  CHECK(count_visible(Opt("0,1")) == 2);
  CHECK(count_visible(Opt("GPU-abc,1")) == 2);
  CHECK(count_visible(Opt("MIG-x")) == 1);
  CHECK(count_visible(Opt("MIG-GPU-1234/1/0,MIG-GPU-1234/2/0")) == 2);
  CHECK(count_visible(Opt("")) == 0);
  CHECK(count_visible(Opt("0,-1,1")) == 1);  // an invalid entry ends the list
  CHECK(count_visible(Opt("0,2,-1,1")) == 2);
  CHECK(count_visible(Opt("-1")) == 0);
  CHECK(count_visible(Opt("3,2,1,0")) == 4);
  CHECK(count_visible(Opt("0,,1")) == 1);
}

TEST_CASE("nproc-per-node forms") {
  using Opt = std::optional<std::string>;
  CHECK(parse_nproc_per_node("4", "--nproc-per-node", std::nullopt, 8) == 4);
  CHECK(parse_nproc_per_node("cpu", "--nproc-per-node", Opt("0"), 8) == 8);
  CHECK(parse_nproc_per_node("gpu", "--nproc-per-node", Opt("0,1,2"), 8) == 3);
  CHECK(parse_nproc_per_node("gpu", "--nproc-per-node", Opt("GPU-abc,1"), 8) == 2);
  CHECK(parse_nproc_per_node("auto", "--nproc-per-node", Opt("0,1"), 8) == 2);
  CHECK(parse_nproc_per_node("auto", "--nproc-per-node", Opt(""), 8) == 8);
  CHECK(parse_nproc_per_node("auto", "--nproc-per-node", std::nullopt, 8) == 8);
  CHECK(parse_nproc_per_node("auto", "--nproc-per-node", Opt("-1"), 5) == 5);
  // Without CUDA_VISIBLE_DEVICES the inventory (from worker_env::probe_gpus) is counted.
  CHECK_THROWS_WITH(parse_nproc_per_node("gpu", "--nproc-per-node", std::nullopt, 8),
                    Contains("--nproc-per-node=gpu") && Contains("no GPU found"));
  ddprun::worker_env::GpuInventory two;
  two.source = "nvml:fake";
  two.devices.resize(2);
  two.devices[1].index = 1;
  CHECK(parse_nproc_per_node("gpu", "--nproc-per-node", std::nullopt, 8, two) == 2);
  CHECK(parse_nproc_per_node("auto", "--nproc-per-node", std::nullopt, 8, two) == 2);
  CHECK(parse_nproc_per_node("gpu", "--nproc-per-node", Opt("1"), 8, two) == 1);
  CHECK(parse_nproc_per_node("gpu", "--nproc-per-node", Opt("1,5"), 8, two) == 1);  // no device 5
  CHECK(parse_nproc_per_node("cpu", "--nproc-per-node", std::nullopt, 8, two) == 8);
  CHECK_THROWS_WITH(parse_nproc_per_node("gpu", "--nproc-per-node", Opt(""), 8), Contains("no usable GPU"));
  CHECK_THROWS_WITH(parse_nproc_per_node("0", "--nproc-per-node", std::nullopt, 8),
                    Contains("--nproc-per-node=0") && Contains("gpu, cpu or auto"));
  CHECK_THROWS_WITH(parse_nproc_per_node("many", "PET_NPROC_PER_NODE", std::nullopt, 8),
                    Contains("PET_NPROC_PER_NODE=many"));
  CHECK_THROWS_AS(parse_nproc_per_node("-2", "--nproc-per-node", std::nullopt, 8), UsageError);
}

TEST_CASE("redirects/tee: one value or a per-local-rank map") {
  CHECK(parse_streams("0", "-r") == StreamSpec{Streams::none, {}});
  CHECK(parse_streams("3", "-r") == StreamSpec{Streams::both, {}});
  CHECK(parse_streams("0:1,1:2", "-r") == StreamSpec{Streams::none, {{0, Streams::out}, {1, Streams::err}}});
  CHECK(parse_streams("2:3", "--tee") == StreamSpec{Streams::none, {{2, Streams::both}}});
  CHECK_THROWS_WITH(parse_streams("4", "--redirects"), Contains("--redirects=4") && Contains("0 (none)"));
  CHECK_THROWS_WITH(parse_streams("0:1,x:2", "--tee"), Contains("--tee=0:1,x:2") && Contains("'x'"));
  CHECK_THROWS_WITH(parse_streams("0:1,0:2", "--tee"), Contains("given twice"));
  CHECK_THROWS_AS(parse_streams("0:", "--tee"), UsageError);
  CHECK_THROWS_AS(parse_streams("1,2", "--tee"), UsageError);
}

TEST_CASE("rdzv-conf: k=v pairs") {
  CHECK(parse_rdzv_conf("", "--rdzv-conf").empty());
  const auto conf = parse_rdzv_conf("join_timeout=900, read_timeout = 60", "--rdzv-conf");
  CHECK(conf == std::map<std::string, std::string>{{"join_timeout", "900"}, {"read_timeout", "60"}});
  CHECK_THROWS_WITH(parse_rdzv_conf("join_timeout", "--rdzv-conf"),
                    Contains("--rdzv-conf=join_timeout") && Contains("no '='"));
  CHECK_THROWS_WITH(parse_rdzv_conf("=3", "--rdzv-conf"), Contains("empty key"));
  CHECK_THROWS_WITH(parse_rdzv_conf("a=", "--rdzv-conf"), Contains("key 'a' has no value"));
  CHECK_THROWS_WITH(parse_rdzv_conf("a=1,,b=2", "PET_RDZV_CONF"), Contains("PET_RDZV_CONF"));
}

TEST_CASE("local-ranks-filter") {
  CHECK_FALSE(parse_local_ranks_filter("", "--local-ranks-filter").has_value());
  CHECK(parse_local_ranks_filter("0", "--local-ranks-filter") == std::set<int>{0});
  CHECK(parse_local_ranks_filter("3,0,3", "--local-ranks-filter") == std::set<int>{0, 3});
  CHECK_THROWS_WITH(parse_local_ranks_filter("0,-1", "--local-ranks-filter"), Contains("--local-ranks-filter=0,-1"));
  CHECK_THROWS_AS(parse_local_ranks_filter("a", "--local-ranks-filter"), UsageError);
}

TEST_CASE("signals: names with or without SIG, numbers, errors list accepted names") {
  CHECK(parse_signals("SIGTERM,SIGINT,SIGHUP,SIGQUIT", "x") == std::vector<int>{SIGTERM, SIGINT, SIGHUP, SIGQUIT});
  CHECK(parse_signals("term,Usr1, SIGUSR2", "x") == std::vector<int>{SIGTERM, SIGUSR1, SIGUSR2});
  CHECK(parse_signals("15,10", "x") == std::vector<int>{SIGTERM, SIGUSR1});
  CHECK(parse_signals("TERM,15,SIGTERM", "x") == std::vector<int>{SIGTERM});
  CHECK(parse_signals("SIGRTMIN+1", "x") == std::vector<int>{SIGRTMIN + 1});
  CHECK_THROWS_WITH(parse_signals("SIGFOO", "--signals-to-handle"), Contains("--signals-to-handle=SIGFOO") &&
                                                                        Contains("unknown signal 'SIGFOO'") &&
                                                                        Contains("SIGTERM") && Contains("SIGUSR1"));
  CHECK_THROWS_WITH(parse_signals("SIGKILL", "--signals-to-handle"), Contains("cannot be caught"));
  CHECK_THROWS_WITH(parse_signals("9", "--signals-to-handle"), Contains("cannot be caught"));
  CHECK_THROWS_WITH(parse_signals("SIGCHLD", "--signals-to-handle"), Contains("SIGCHLD"));
  CHECK_THROWS_AS(parse_signals("", "--signals-to-handle"), UsageError);
  CHECK_THROWS_AS(parse_signals("0", "--signals-to-handle"), UsageError);
  CHECK(signal_name(SIGTERM) == "SIGTERM");
  CHECK(signal_name(SIGRTMIN + 2) == "SIGRTMIN+2");
}

TEST_CASE("scalar values") {
  CHECK(parse_seconds_value("0.5", "--shutdown-timeout") == 0.5);
  CHECK_THROWS_WITH(parse_seconds_value("30s", "--shutdown-timeout"), Contains("--shutdown-timeout=30s"));
  CHECK(parse_int_value("3", "--max-restarts", 0, 10) == 3);
  CHECK_THROWS_WITH(parse_int_value("-1", "--max-restarts", 0, 10), Contains("--max-restarts=-1") && Contains("0..10"));
  CHECK(parse_env_bool("1", "PET_X"));
  CHECK(parse_env_bool("2", "PET_X"));
  CHECK_FALSE(parse_env_bool("0", "PET_X"));
  CHECK_THROWS_WITH(parse_env_bool("yes", "PET_STANDALONE"), Contains("PET_STANDALONE=yes"));
}

TEST_CASE("standalone run ids are random version-4 UUIDs") {
  const std::regex uuid4("[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}");
  const auto a = random_uuid4();
  const auto b = random_uuid4();
  CHECK(std::regex_match(a, uuid4));
  CHECK(std::regex_match(b, uuid4));
  CHECK(a != b);
}

TEST_CASE("rdzv-conf keys become typed settings") {
  const auto d = parse_rdzv_settings({}, "--rdzv-conf", std::nullopt);
  CHECK(d.join_timeout == std::chrono::seconds(600));
  CHECK(d.last_call_timeout == std::chrono::seconds(30));
  CHECK(d.close_timeout == std::chrono::seconds(30));
  CHECK(d.read_timeout == std::chrono::seconds(60));
  CHECK(d.heartbeat_interval == std::chrono::seconds(1));
  CHECK(d.missed_heartbeats == 3);
  CHECK(d.exit_barrier_timeout == std::chrono::seconds(300));
  CHECK_FALSE(d.is_host);
  CHECK(d.token.empty());

  const auto s = parse_rdzv_settings(
      parse_rdzv_conf("join_timeout=20,last_call_timeout=0.5,heartbeat_interval=0.2,missed_heartbeats=4,"
                      "close_timeout=2,read_timeout=9,exit_barrier_timeout=11,is_host=1",
                      "--rdzv-conf"),
      "--rdzv-conf", std::string("from-env"));
  CHECK(s.join_timeout == std::chrono::seconds(20));
  CHECK(s.last_call_timeout == std::chrono::milliseconds(500));
  CHECK(s.heartbeat_interval == std::chrono::milliseconds(200));
  CHECK(s.missed_heartbeats == 4);
  CHECK(s.close_timeout == std::chrono::seconds(2));
  CHECK(s.read_timeout == std::chrono::seconds(9));
  CHECK(s.exit_barrier_timeout == std::chrono::seconds(11));
  CHECK(s.is_host == true);
  CHECK(s.token == "from-env");
  // A token on the command line is refused; NaN, infinities and absurd heartbeats too.
  for (const char* bad : {"token=s3cret", "heartbeat_interval=1e-12", "heartbeat_interval=nan", "join_timeout=inf",
                          "join_timeout=-1", "last_call_timeout=1e300"}) {
    CAPTURE(bad);
    CHECK_THROWS_AS(parse_rdzv_settings(parse_rdzv_conf(bad, "--rdzv-conf"), "--rdzv-conf", std::nullopt), UsageError);
  }
  CHECK_THROWS_AS(parse_seconds_value("nan", "--shutdown-timeout"), UsageError);
  CHECK_THROWS_AS(parse_seconds_value("inf", "--shutdown-timeout"), UsageError);

  CHECK(parse_rdzv_settings({}, "--rdzv-conf", std::string("envtok")).token == "envtok");
  CHECK(parse_rdzv_settings({{"timeout", "900"}}, "--rdzv-conf", std::nullopt).join_timeout ==
        std::chrono::seconds(900));
  CHECK(parse_rdzv_settings({{"is_host", "false"}}, "--rdzv-conf", std::nullopt).is_host == false);
}

TEST_CASE("rdzv-conf: bad keys and values are named") {
  CHECK_THROWS_WITH(parse_rdzv_settings({{"join_timeout", "-1"}}, "PET_RDZV_CONF", std::nullopt),
                    Contains("PET_RDZV_CONF key join_timeout=-1"));
  CHECK_THROWS_WITH(parse_rdzv_settings({{"heartbeat_interval", "0"}}, "--rdzv-conf", std::nullopt),
                    Contains("heartbeat_interval"));
  CHECK_THROWS_WITH(parse_rdzv_settings({{"missed_heartbeats", "0"}}, "--rdzv-conf", std::nullopt),
                    Contains("missed_heartbeats"));
  CHECK_THROWS_WITH(parse_rdzv_settings({{"is_host", "maybe"}}, "--rdzv-conf", std::nullopt), Contains("is_host"));
  CHECK_THROWS_WITH(parse_rdzv_settings({{"store_type", "file"}}, "--rdzv-conf", std::nullopt),
                    Contains("store_type=file") && Contains("only the TCP store"));
}

TEST_CASE("rdzv-conf is as lenient as torchrun: unknown keys, quotes, timeout beside join_timeout") {
  std::vector<std::string> notes;
  const auto s = parse_rdzv_settings({{"join_timeot", "5"}}, "--rdzv-conf", std::nullopt, &notes);
  CHECK(s.join_timeout == std::chrono::seconds(600));
  REQUIRE(notes.size() == 1);
  CHECK_THAT(notes[0], Contains("ignored: unknown key 'join_timeot'") && Contains("last_call_timeout"));

  // Literal quotes around the whole text (PET_RDZV_CONF="'...'") are dropped.
  const auto quoted = parse_rdzv_conf("'join_timeout=5,last_call_timeout=1'", "--rdzv-conf");
  CHECK(quoted.at("join_timeout") == "5");
  CHECK(quoted.at("last_call_timeout") == "1");
  CHECK(parse_rdzv_conf("\"join_timeout=7\"", "--rdzv-conf").at("join_timeout") == "7");
  CHECK(parse_rdzv_conf("join_timeout='8'", "--rdzv-conf").at("join_timeout") == "8");

  // torchrun's c10d backend reads join_timeout only: beside it, timeout is ignored with a note.
  notes.clear();
  const auto both = parse_rdzv_settings({{"timeout", "5"}, {"join_timeout", "6"}}, "--rdzv-conf", std::nullopt, &notes);
  CHECK(both.join_timeout == std::chrono::seconds(6));
  REQUIRE(notes.size() == 1);
  CHECK_THAT(notes[0], Contains("ignored: timeout=5"));

  // torch's own key names and the ignored ones.
  notes.clear();
  const auto torch_keys = parse_rdzv_settings({{"keep_alive_interval", "2"},
                                               {"keep_alive_max_attempt", "5"},
                                               {"use_libuv", "0"},
                                               {"store_type", "tcp"},
                                               {"is_host", "t"}},
                                              "--rdzv-conf", std::nullopt, &notes);
  CHECK(torch_keys.heartbeat_interval == std::chrono::seconds(2));
  CHECK(torch_keys.missed_heartbeats == 5);
  CHECK(torch_keys.is_host == true);
  REQUIRE(notes.size() == 2);
  CHECK_THAT(notes[0], Contains("ignored: store_type=tcp"));
  CHECK_THAT(notes[1], Contains("ignored: use_libuv=0"));
}

TEST_CASE("rdzv-backend: etcd and torchrun's etcd-v2 spelling") {
  CHECK(parse_rdzv_backend("etcd", "--rdzv-backend") == "etcd");
  CHECK(parse_rdzv_backend("ETCD-v2", "--rdzv-backend") == "etcd");
  CHECK_THROWS_WITH(parse_rdzv_backend("zk", "--rdzv-backend"), Contains("etcd"));
}

TEST_CASE("etcd conf: endpoints, TLS, prefix, credentials") {
  const auto plain = parse_etcd_conf("127.0.0.1:2379,h2", "--rdzv-endpoint", {}, "--rdzv-conf", std::nullopt);
  REQUIRE(plain.settings.endpoints.size() == 2);
  CHECK(plain.settings.endpoints[1].port == 2379);
  CHECK_FALSE(plain.settings.tls);
  CHECK(plain.settings.prefix == "/ddprun/");

  const auto tls = parse_etcd_conf("h1:2379", "--rdzv-endpoint",
                                   {{"protocol", "https"},
                                    {"cacert", "ca.pem"},
                                    {"etcd_prefix", "/jobs"},
                                    {"username", "u"},
                                    {"password_file", "pw"}},
                                   "--rdzv-conf", std::nullopt);
  CHECK(tls.settings.tls);
  CHECK(tls.settings.cacert == "ca.pem");
  CHECK(tls.settings.prefix == "/jobs/");
  CHECK(tls.password_file == "pw");
  CHECK(parse_etcd_conf("https://h1:2379", "--rdzv-endpoint", {}, "--rdzv-conf", std::nullopt).settings.tls);
  // The password from the environment when no password key is given.
  CHECK(parse_etcd_conf("h1", "--rdzv-endpoint", {{"username", "u"}}, "--rdzv-conf", std::string("envpw"))
            .settings.password == "envpw");
  // parse_rdzv_settings leaves the etcd keys to parse_etcd_conf.
  CHECK_NOTHROW(parse_rdzv_settings({{"protocol", "https"}, {"username", "u"}}, "--rdzv-conf", std::nullopt));

  // torch's etcd-v2 backend names the TLS files ca_cert, ssl_cert and ssl_cert_key.
  const auto v2 =
      parse_etcd_conf("h1:2379", "--rdzv-endpoint",
                      {{"protocol", "https"}, {"ca_cert", "ca.pem"}, {"ssl_cert", "c.pem"}, {"ssl_cert_key", "k.pem"}},
                      "--rdzv-conf", std::nullopt);
  CHECK(v2.settings.cacert == "ca.pem");
  CHECK(v2.settings.cert == "c.pem");
  CHECK(v2.settings.key == "k.pem");
  for (const char* key : {"ca_cert", "ssl_cert", "ssl_cert_key"}) {
    CHECK(is_etcd_conf_key(key));
  }
  CHECK_FALSE(is_etcd_conf_key("ssl"));
  CHECK_THROWS_WITH(
      parse_etcd_conf("h1", "--rdzv-endpoint", {{"protocol", "https"}, {"cacert", "a.pem"}, {"ca_cert", "b.pem"}},
                      "--rdzv-conf", std::nullopt),
      Contains("both ca_cert and cacert given"));
  // Errors name the keys as typed.
  CHECK_THROWS_WITH(
      parse_etcd_conf("h1", "--rdzv-endpoint", {{"ssl_cert", "c.pem"}}, "--rdzv-conf", std::nullopt),
      Contains("--rdzv-conf: ssl_cert given without ssl_cert_key") && Contains("ssl_cert=FILE,ssl_cert_key=FILE"));
  CHECK_THROWS_WITH(parse_etcd_conf("h1", "--rdzv-endpoint", {{"ssl_cert_key", "k.pem"}}, "--rdzv-conf", std::nullopt),
                    Contains("--rdzv-conf: ssl_cert_key given without ssl_cert"));
  CHECK_THROWS_WITH(parse_etcd_conf("h1", "--rdzv-endpoint", {{"ca_cert", "a.pem"}}, "--rdzv-conf", std::nullopt),
                    Contains("--rdzv-conf: ca_cert given but the etcd connection is plain http"));
  CHECK_THROWS_WITH(parse_etcd_conf("h1", "--rdzv-endpoint", {{"ca_cert", "a.pem"}, {"cert", "c.pem"}, {"key", "k"}},
                                    "--rdzv-conf", std::nullopt),
                    Contains("--rdzv-conf: ca_cert/cert/key given but the etcd connection is plain http"));
}

TEST_CASE("etcd conf: errors name the key") {
  auto bad = [](std::string endpoints, std::map<std::string, std::string> conf) {
    return parse_etcd_conf(endpoints, "--rdzv-endpoint", conf, "--rdzv-conf", std::nullopt);
  };
  CHECK_THROWS_WITH(bad("h1", {{"protocol", "ftp"}}), Contains("--rdzv-conf key protocol=ftp"));
  CHECK_THROWS_WITH(bad("http://h1", {{"protocol", "https"}}), Contains("disagrees with --rdzv-endpoint"));
  CHECK_THROWS_WITH(bad("h1", {{"protocol", "https"}, {"cert", "c.pem"}}), Contains("cert given without key"));
  CHECK_THROWS_WITH(bad("h1", {{"cacert", "ca.pem"}}), Contains("plain http"));
  CHECK_THROWS_WITH(bad("h1", {{"etcd_prefix", "jobs"}}), Contains("--rdzv-conf key etcd_prefix=jobs"));
  CHECK_THROWS_WITH(bad("h1", {{"username", "u"}}), Contains("username=u has no password"));
  CHECK_THROWS_WITH(bad("h1", {{"password", "p"}}), Contains("without username"));
  CHECK_THROWS_WITH(bad("h1", {{"username", "u"}, {"password", "p"}, {"password_file", "f"}}),
                    Contains("both password and password_file"));
  CHECK_THROWS_WITH(bad("", {}), Contains("--rdzv-endpoint"));
}
