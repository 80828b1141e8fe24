#include "ddprun/launcher/values.hpp"

#include <arpa/inet.h>
#include <sys/random.h>
#include <netinet/in.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <csignal>
#include <fstream>
#include <random>

#include "ddprun/common/endpoint.hpp"
#include "ddprun/common/error.hpp"
#include "ddprun/common/logging.hpp"
#include "ddprun/common/secret_file.hpp"
#include "ddprun/common/strings.hpp"
#include "ddprun/rendezvous/etcd_codec.hpp"

namespace ddprun::launcher {
namespace {

[[noreturn]] void fail(std::string_view what, std::string_view text, const std::string& why, const std::string& forms) {
  throw UsageError(std::string(what) + "=" + std::string(text) + ": " + why, "accepted forms: " + forms);
}

bool is_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

agent::Streams parse_stream_digit(std::string_view digit, std::string_view what, std::string_view text,
                                  const std::string& forms) {
  const auto v = parse_int(trim(digit));
  if (!v || *v < 0 || *v > 3 || !is_digits(trim(digit))) {
    fail(what, text, "'" + std::string(digit) + "' is not one of 0 (none), 1 (stdout), 2 (stderr), 3 (both)", forms);
  }
  return static_cast<agent::Streams>(*v);
}

struct NamedSignal {
  const char* name;
  int signo;
};

// Signals a launcher can sensibly catch and forward. SIGKILL/SIGSTOP cannot be caught and
// SIGCHLD is how the agent learns about its workers, so none of them is listed.
const std::array<NamedSignal, 17>& signal_table() {
  static const std::array<NamedSignal, 17> table{{
      {"SIGHUP", SIGHUP},
      {"SIGINT", SIGINT},
      {"SIGQUIT", SIGQUIT},
      {"SIGABRT", SIGABRT},
      {"SIGUSR1", SIGUSR1},
      {"SIGUSR2", SIGUSR2},
      {"SIGPIPE", SIGPIPE},
      {"SIGALRM", SIGALRM},
      {"SIGTERM", SIGTERM},
      {"SIGCONT", SIGCONT},
      {"SIGXCPU", SIGXCPU},
      {"SIGXFSZ", SIGXFSZ},
      {"SIGVTALRM", SIGVTALRM},
      {"SIGPROF", SIGPROF},
      {"SIGWINCH", SIGWINCH},
      {"SIGIO", SIGIO},
      {"SIGPWR", SIGPWR},
  }};
  return table;
}

}  // namespace

NodeRange parse_nnodes(std::string_view text, std::string_view what) {
  const std::string forms = "N or MIN:MAX with 0 < MIN <= MAX";
  const auto parts = split(trim(text), ':');
  auto number = [&](const std::string& s) {
    const auto v = parse_int(trim(s));
    if (!v || !is_digits(trim(s))) fail(what, text, "'" + s + "' is not a number", forms);
    if (*v <= 0) fail(what, text, "node counts must be > 0", forms);
    if (*v > 1'000'000) fail(what, text, "node count too large", forms);
    return static_cast<int>(*v);
  };
  NodeRange range;
  if (parts.size() == 1) {
    range.min_nodes = range.max_nodes = number(parts[0]);
  } else if (parts.size() == 2) {
    range.min_nodes = number(parts[0]);
    range.max_nodes = number(parts[1]);
    if (range.min_nodes > range.max_nodes) fail(what, text, "MIN must be <= MAX", forms);
  } else {
    fail(what, text, "not in N or MIN:MAX format", forms);
  }
  return range;
}

int parse_nproc_per_node(std::string_view text, std::string_view what,
                         const std::optional<std::string>& cuda_visible_devices, int online_cpus,
                         const worker_env::GpuInventory& inventory) {
  const std::string forms = "a positive integer, gpu, cpu or auto";
  const std::string t = to_lower(trim(text));
  if (t == "cpu") return std::max(online_cpus, 1);
  if (t == "gpu" || t == "auto") {
    const auto n =
        worker_env::nproc_for_device_kind(t, what, cuda_visible_devices, inventory, std::max(online_cpus, 1));
    if (n) return *n;
  }
  if (t == "xpu") {
    throw UsageError(std::string(what) + "=xpu: XPU devices are not supported yet", "accepted forms: " + forms);
  }
  const auto v = parse_int(t);
  if (!v || !is_digits(t)) fail(what, text, "not a number or a device kind", forms);
  if (*v <= 0) fail(what, text, "must be > 0", forms);
  if (*v > 65536) fail(what, text, "too many processes for one node", forms);
  return static_cast<int>(*v);
}

bool is_device_kind(std::string_view lowered) { return lowered == "gpu" || lowered == "cpu" || lowered == "auto"; }

StreamSpec parse_streams(std::string_view text, std::string_view what) {
  const std::string forms = "0 (none), 1 (stdout), 2 (stderr), 3 (both), or LOCAL_RANK:VALUE,... e.g. 0:1,1:2";
  StreamSpec spec;
  const std::string_view t = trim(text);
  if (t.empty()) return spec;
  if (t.find(':') == std::string_view::npos) {
    spec.all = parse_stream_digit(t, what, text, forms);
    return spec;
  }
  for (const auto& item : split(t, ',')) {
    const auto colon = item.find(':');
    if (colon == std::string::npos) fail(what, text, "'" + item + "' is not LOCAL_RANK:VALUE", forms);
    const std::string_view rank_text = trim(std::string_view(item).substr(0, colon));
    const auto rank = parse_int(rank_text);
    if (!rank || !is_digits(rank_text) || *rank > 65535) {
      fail(what, text, "'" + std::string(rank_text) + "' is not a local rank", forms);
    }
    const int r = static_cast<int>(*rank);
    if (spec.per_rank.contains(r)) fail(what, text, "local rank " + std::to_string(r) + " given twice", forms);
    spec.per_rank[r] = parse_stream_digit(std::string_view(item).substr(colon + 1), what, text, forms);
  }
  return spec;
}

namespace {
// One pair of matching quotes around `v` ('...' or "..."), as a shell leaves them when the user
// quoted twice (PET_RDZV_CONF="'a=1'") or wrote them in a config file.
std::string_view strip_quotes(std::string_view v) {
  if (v.size() >= 2 && (v.front() == '\'' || v.front() == '"') && v.back() == v.front()) {
    return trim(v.substr(1, v.size() - 2));
  }
  return v;
}
}  // namespace

std::map<std::string, std::string> parse_rdzv_conf(std::string_view text, std::string_view what) {
  const std::string forms = "KEY=VALUE,KEY=VALUE (e.g. join_timeout=900,read_timeout=60)";
  std::map<std::string, std::string> conf;
  const std::string_view t = strip_quotes(trim(text));
  if (t.empty()) return conf;
  for (const auto& item : split(t, ',')) {
    const auto eq = item.find('=');
    const std::string key(strip_quotes(trim(std::string_view(item).substr(0, eq))));
    if (eq == std::string::npos) fail(what, text, "'" + item + "' has no '='", forms);
    if (key.empty()) fail(what, text, "'" + item + "' has an empty key", forms);
    const std::string value(strip_quotes(trim(std::string_view(item).substr(eq + 1))));
    if (value.empty()) fail(what, text, "key '" + key + "' has no value", forms);
    conf[key] = value;
  }
  return conf;
}

std::string_view etcd_conf_key_name(std::string_view key) {
  if (key == "ca_cert") return "cacert";
  if (key == "ssl_cert") return "cert";
  if (key == "ssl_cert_key") return "key";
  return key;
}

bool is_etcd_conf_key(std::string_view key) {
  key = etcd_conf_key_name(key);
  return key == "protocol" || key == "cacert" || key == "cert" || key == "key" || key == "etcd_prefix" ||
         key == "username" || key == "password" || key == "password_file";
}

EtcdConf parse_etcd_conf(std::string_view endpoints, std::string_view endpoints_what,
                         const std::map<std::string, std::string>& given, std::string_view what,
                         const std::optional<std::string>& env_password) {
  // torch's etcd-v2 spellings of the TLS keys, read as the etcd backend's own; both spellings of
  // one key are refused rather than one of them silently winning.
  std::map<std::string, std::string> conf;
  std::map<std::string, std::string> spelled;
  for (const auto& [key, value] : given) {
    const std::string name(etcd_conf_key_name(key));
    if (auto it = spelled.find(name); it != spelled.end()) {
      throw UsageError(std::string(what) + ": both " + it->second + " and " + key + " given, which name the same file",
                       "give one of them");
    }
    spelled.emplace(name, key);
    conf.emplace(name, value);
  }
  EtcdConf out;
  auto& e = out.settings;
  const auto list = rendezvous::etcd::parse_endpoints(endpoints, endpoints_what);
  e.endpoints = list.endpoints;
  auto key_what = [&](const std::string& key) { return std::string(what) + " key " + key; };
  std::optional<bool> protocol_tls;
  if (auto it = conf.find("protocol"); it != conf.end()) {
    const std::string v = to_lower(trim(it->second));
    if (v != "http" && v != "https") fail(key_what("protocol"), it->second, "unknown protocol", "http, https");
    protocol_tls = v == "https";
  }
  if (protocol_tls && list.scheme_tls && *protocol_tls != *list.scheme_tls) {
    throw UsageError(std::string(what) + " key protocol=" + conf.at("protocol") + " disagrees with " +
                         std::string(endpoints_what) + "=" + std::string(endpoints),
                     "use https:// endpoints with protocol=https, http:// ones with protocol=http, or drop one");
  }
  e.tls = protocol_tls.value_or(false) || list.scheme_tls.value_or(false);
  auto get = [&](const char* key) -> std::string {
    auto it = conf.find(key);
    return it == conf.end() ? std::string() : it->second;
  };
  e.cacert = get("cacert");
  e.cert = get("cert");
  e.key = get("key");
  // Errors name a key as it was typed (torch's ssl_cert, or cert).
  auto typed = [&](const std::string& name) {
    auto it = spelled.find(name);
    return it == spelled.end() ? name : it->second;
  };
  if (e.cert.empty() != e.key.empty()) {
    const bool has_cert = !e.cert.empty();
    const std::string given = typed(has_cert ? "cert" : "key");
    const bool torch_names = given != "cert" && given != "key";
    const std::string missing = torch_names ? (has_cert ? "ssl_cert_key" : "ssl_cert") : (has_cert ? "key" : "cert");
    throw UsageError(std::string(what) + ": " + given + " given without " + missing,
                     std::string("give the client certificate and its private key together: ") +
                         (torch_names ? "ssl_cert=FILE,ssl_cert_key=FILE" : "cert=FILE,key=FILE"));
  }
  if ((!e.cacert.empty() || !e.cert.empty()) && !e.tls) {
    std::string files;
    for (const char* name : {"cacert", "cert", "key"}) {
      if (conf.count(name) != 0) files += (files.empty() ? "" : "/") + typed(name);
    }
    throw UsageError(std::string(what) + ": " + files + " given but the etcd connection is plain http",
                     "add protocol=https (or https:// endpoints) to use TLS");
  }
  if (auto it = conf.find("etcd_prefix"); it != conf.end()) {
    e.prefix = it->second;
    if (e.prefix.front() != '/') {
      fail(key_what("etcd_prefix"), it->second, "not an absolute key prefix",
           "a prefix starting with '/', e.g. /ddprun/");
    }
    if (e.prefix.back() != '/') e.prefix += '/';
  }
  e.username = get("username");
  const int password_keys = static_cast<int>(conf.count("password") + conf.count("password_file"));
  if (password_keys > 1) {
    throw UsageError(std::string(what) + ": both password and password_file given",
                     "give one: password_file=FILE keeps the password off the command line");
  }
  e.password = get("password");
  out.password_file = get("password_file");
  if (password_keys == 0 && env_password && !env_password->empty()) e.password = *env_password;
  const bool has_password = !e.password.empty() || !out.password_file.empty();
  if (!e.username.empty() && !has_password) {
    throw UsageError(std::string(what) + " key username=" + e.username + " has no password",
                     "add password_file=FILE to " + std::string(what) + ", or set DDPRUN_ETCD_PASSWORD");
  }
  if (e.username.empty() && has_password && (conf.count("password") + conf.count("password_file")) != 0) {
    throw UsageError(std::string(what) + ": a password without username", "add username=NAME to " + std::string(what));
  }
  return out;
}

bool is_rdzv_setting_key(std::string_view key) {
  static constexpr std::string_view kRead[] = {"join_timeout",
                                               "timeout",
                                               "last_call_timeout",
                                               "close_timeout",
                                               "read_timeout",
                                               "heartbeat_interval",
                                               "keep_alive_interval",
                                               "exit_barrier_timeout",
                                               "missed_heartbeats",
                                               "keep_alive_max_attempt",
                                               "is_host",
                                               "token",
                                               "token_file"};
  return std::find(std::begin(kRead), std::end(kRead), key) != std::end(kRead);
}

agent::RendezvousSettings parse_rdzv_settings(const std::map<std::string, std::string>& conf, std::string_view what,
                                              const std::optional<std::string>& env_token,
                                              std::vector<std::string>* notes) {
  static constexpr std::string_view kKeys =
      "join_timeout, last_call_timeout, close_timeout, read_timeout, heartbeat_interval (keep_alive_interval), "
      "missed_heartbeats (keep_alive_max_attempt), exit_barrier_timeout, is_host, token_file, timeout (alias of "
      "join_timeout); with --rdzv-backend etcd also protocol, cacert, cert, key, etcd_prefix, username, "
      "password_file, password; ignored: use_libuv, store_type";
  auto note = [&](std::string text) {
    if (notes != nullptr) notes->push_back(std::string(what) + ": " + std::move(text));
  };
  agent::RendezvousSettings s;
  auto seconds = [&](const std::string& key, const std::string& value) {
    const std::string where = std::string(what) + " key " + key;
    const auto v = parse_seconds(trim(value));
    // The daemon's bounds (rendezvous_types.hpp): 1 ms .. 30 days; a heartbeat 10 ms .. 1 h.
    const bool heartbeat = key == "heartbeat_interval";
    const double lo = heartbeat ? 0.01 : 0.001;
    const double hi = heartbeat ? 3600.0 : 30.0 * 86400.0;
    if (!v || !(*v >= lo && *v <= hi)) {
      fail(where, value, "not a number of seconds in range",
           heartbeat ? "a number of seconds from 0.01 to 3600, e.g. 1"
                     : "a number of seconds from 0.001 to 2592000 (30 days), e.g. 30 or 0.5");
    }
    return std::chrono::milliseconds(std::max<std::int64_t>(1, seconds_to_ms(*v)));
  };
  bool token_given = false;
  for (const auto& [key, value] : conf) {
    if (is_etcd_conf_key(key)) continue;  // parse_etcd_conf's
    if (key == "join_timeout") {
      s.join_timeout = seconds(key, value);
    } else if (key == "timeout") {
      // torchrun's c10d backend reads only join_timeout; its static and etcd backends read
      // timeout. Alone it sets the join timeout; beside join_timeout it is ignored.
      const auto t = seconds(key, value);
      if (conf.count("join_timeout") == 0) {
        s.join_timeout = t;
      } else {
        note("ignored: timeout=" + value + " (join_timeout is given and wins, as in torchrun's c10d backend)");
      }
    } else if (key == "last_call_timeout") {
      s.last_call_timeout = seconds(key, value);
    } else if (key == "close_timeout") {
      s.close_timeout = seconds(key, value);
    } else if (key == "read_timeout") {
      s.read_timeout = seconds(key, value);
    } else if (key == "heartbeat_interval" || key == "keep_alive_interval") {
      s.heartbeat_interval = seconds(key, value);
    } else if (key == "exit_barrier_timeout") {
      s.exit_barrier_timeout = seconds(key, value);
    } else if (key == "missed_heartbeats" || key == "keep_alive_max_attempt") {
      s.missed_heartbeats = parse_int_value(value, std::string(what) + " key " + key, 1, 1000);
    } else if (key == "is_host") {
      const std::string v = to_lower(trim(value));
      if (v == "1" || v == "true" || v == "t" || v == "yes" || v == "y") {
        s.is_host = true;
      } else if (v == "0" || v == "false" || v == "f" || v == "no" || v == "n") {
        s.is_host = false;
      } else {
        fail(std::string(what) + " key is_host", value, "not a boolean", "1, 0, true, false");
      }
    } else if (key == "token") {
      throw UsageError(
          std::string(what) +
              ": key 'token' is refused: a token on the command line is readable by every "
              "local user in /proc/*/cmdline",
          "set DDPRUN_RDZV_TOKEN in the environment or pass token_file=FILE (a file readable only by you)");
    } else if (key == "token_file") {
      try {
        auto secret = read_secret_file(std::string(trim(value)), std::string(what) + " key token_file");
        if (!secret.warning.empty()) spdlog::warn("{}", secret.warning);
        s.token = std::move(secret.secret);
      } catch (const Error& e) {
        throw UsageError(e.what(), "point token_file at a readable, non-empty file holding the daemon's token");
      }
      token_given = true;
    } else if (key == "use_libuv") {
      note("ignored: use_libuv=" + value + " (ddprun's store is native C++ on Boost.Asio; there is no libuv choice)");
    } else if (key == "store_type") {
      if (to_lower(trim(value)) != "tcp") {
        throw UsageError(std::string(what) + " key store_type=" + value + ": only the TCP store is supported",
                         "drop store_type or write store_type=tcp");
      }
      note("ignored: store_type=tcp (the only store ddprun has)");
    } else {
      // torchrun passes unknown keys through to the backend, which ignores what it does not read.
      note("ignored: unknown key '" + key + "' (accepted keys: " + std::string(kKeys) + ")");
    }
  }
  if (conf.count("heartbeat_interval") != 0 && conf.count("keep_alive_interval") != 0) {
    s.heartbeat_interval = seconds("heartbeat_interval", conf.at("heartbeat_interval"));
  }
  if (!token_given && env_token) s.token = std::string(trim(*env_token));
  return s;
}

std::optional<std::set<int>> parse_local_ranks_filter(std::string_view text, std::string_view what) {
  const std::string_view t = trim(text);
  if (t.empty()) return std::nullopt;
  std::set<int> ranks;
  for (const auto& item : split(t, ',')) {
    const std::string_view s = trim(item);
    const auto v = parse_int(s);
    if (!v || !is_digits(s) || *v > 65535) {
      fail(what, text, "'" + item + "' is not a local rank", "comma list of local ranks, e.g. 0,2");
    }
    ranks.insert(static_cast<int>(*v));
  }
  return ranks;
}

std::optional<std::set<int>> parse_ranks_filter(std::string_view text, std::string_view what) {
  const std::string_view t = trim(text);
  if (t.empty()) return std::nullopt;
  constexpr std::int64_t kMaxRank = 1'000'000;
  std::set<int> ranks;
  for (const auto& item : split(t, ',')) {
    const std::string_view s = trim(item);
    const auto dash = s.find('-');
    const std::string_view lo_text = dash == std::string_view::npos ? s : trim(s.substr(0, dash));
    const std::string_view hi_text = dash == std::string_view::npos ? s : trim(s.substr(dash + 1));
    const auto lo = parse_int(lo_text);
    const auto hi = parse_int(hi_text);
    if (!lo || !hi || !is_digits(lo_text) || !is_digits(hi_text) || *hi > kMaxRank) {
      fail(what, text, "'" + item + "' is not a rank or a range of ranks",
           "comma list of ranks and ranges, e.g. 0,3-5");
    }
    if (*lo > *hi) fail(what, text, "the range '" + item + "' is empty", "write ranges low-high, e.g. 3-5");
    for (auto r = *lo; r <= *hi; ++r) ranks.insert(static_cast<int>(r));
  }
  return ranks;
}

agent::AgentConfig::NcclIdMode parse_nccl_id_mode(std::string_view text, std::string_view what) {
  const std::string t = to_lower(trim(text));
  if (t == "auto") return agent::AgentConfig::NcclIdMode::automatic;
  if (t == "env") return agent::AgentConfig::NcclIdMode::env;
  if (t == "off") return agent::AgentConfig::NcclIdMode::off;
  if (t == "comm-id" || t == "comm_id") return agent::AgentConfig::NcclIdMode::comm_id;
  fail(what, text, "unknown mode", "auto, env, comm-id, off");
}

std::string signal_name(int signo) {
  for (const auto& s : signal_table()) {
    if (s.signo == signo) return s.name;
  }
  if (signo >= SIGRTMIN && signo <= SIGRTMAX) {
    return signo == SIGRTMIN ? "SIGRTMIN" : "SIGRTMIN+" + std::to_string(signo - SIGRTMIN);
  }
  return std::to_string(signo);
}

std::string accepted_signal_names() {
  std::string out;
  for (const auto& s : signal_table()) {
    if (!out.empty()) out += ",";
    out += s.name;
  }
  return out + " (with or without SIG, any case), SIGRTMIN+N, or their numbers";
}

std::vector<int> parse_signals(std::string_view text, std::string_view what) {
  const std::string forms = accepted_signal_names();
  std::vector<int> out;
  if (trim(text).empty()) fail(what, text, "no signals given", forms);
  for (const auto& raw : split(trim(text), ',')) {
    const std::string_view item = trim(raw);
    int signo = 0;
    if (is_digits(item)) {
      const auto v = parse_int(item);
      signo = (v && *v < 1000) ? static_cast<int>(*v) : -1;
      if (signo <= 0 || signal_name(signo) == std::to_string(signo)) {
        if (signo == SIGKILL || signo == SIGSTOP)
          fail(what, text, "signal " + std::string(item) + " cannot be caught", forms);
        fail(what, text, "signal number " + std::string(item) + " is not handled", forms);
      }
    } else {
      std::string name;
      for (char c : item) name.push_back(static_cast<char>(c >= 'a' && c <= 'z' ? c - 'a' + 'A' : c));
      if (!starts_with(name, "SIG")) name = "SIG" + name;
      for (const auto& s : signal_table()) {
        if (name == s.name) signo = s.signo;
      }
      if (signo == 0 && starts_with(name, "SIGRTMIN")) {
        const std::string_view rest = std::string_view(name).substr(8);
        const auto off = rest.empty() ? std::optional<std::int64_t>(0)
                                      : (starts_with(rest, "+") && is_digits(rest.substr(1)) ? parse_int(rest.substr(1))
                                                                                             : std::nullopt);
        if (off && *off <= SIGRTMAX - SIGRTMIN) signo = SIGRTMIN + static_cast<int>(*off);
      }
      if (signo == 0) {
        if (name == "SIGKILL" || name == "SIGSTOP") fail(what, text, name + " cannot be caught", forms);
        if (name == "SIGCHLD") fail(what, text, "SIGCHLD is used by ddprun to watch its workers", forms);
        fail(what, text, "unknown signal '" + std::string(item) + "'", forms);
      }
    }
    if (std::find(out.begin(), out.end(), signo) == out.end()) out.push_back(signo);
  }
  return out;
}

double parse_seconds_value(std::string_view text, std::string_view what) {
  const auto v = parse_seconds(trim(text));
  if (!v || *v > 1e7) {
    fail(what, text, "not a number of seconds",
         "a finite, non-negative number of seconds up to 10000000, e.g. 30 or 0.5");
  }
  return *v;
}

double parse_positive_seconds_value(std::string_view text, std::string_view what) {
  const double v = parse_seconds_value(text, what);
  if (v <= 0) fail(what, text, "must be more than 0", "a number of seconds above 0 up to 10000000, e.g. 30 or 0.5");
  return v;
}

int parse_int_value(std::string_view text, std::string_view what, int min, int max) {
  const std::string forms = "an integer in " + std::to_string(min) + ".." + std::to_string(max);
  const auto v = parse_int(trim(text));
  if (!v) fail(what, text, "not an integer", forms);
  if (*v < min || *v > max) fail(what, text, "out of range", forms);
  return static_cast<int>(*v);
}

bool parse_on_off(std::string_view text, std::string_view what) {
  const auto t = trim(text);
  if (t == "on") return true;
  if (t == "off") return false;
  fail(what, text, "not on or off", "on or off");
}

std::string parse_containment_value(std::string_view text, std::string_view what) {
  const std::string t(trim(text));
  if (t == "auto" || t == "cgroup2" || t == "cgroup1" || t == "proc" || t == "off") return t;
  fail(what, text, "not a containment mode", "auto, cgroup2, cgroup1, proc or off");
}

bool parse_env_bool(std::string_view text, std::string_view what) {
  const auto v = parse_int(trim(text));
  if (!v) fail(what, text, "not an integer", "1 (on) or 0 (off)");
  return *v != 0;
}

std::string parse_rdzv_backend(std::string_view text, std::string_view what) {
  const std::string b = to_lower(trim(text));
  if (b == "etcd" || b == "etcd-v2") return "etcd";
  if (b != "static" && b != "c10d") fail(what, text, "unknown rendezvous backend", "static, c10d, etcd, etcd-v2");
  return b;
}

void check_start_method(std::string_view text, std::string_view what) {
  const std::string m = to_lower(trim(text));
  if (m != "spawn" && m != "fork" && m != "forkserver")
    fail(what, text, "unknown start method", "spawn, fork, forkserver");
}

agent::AgentConfig::LocalRankArg parse_local_rank_arg(std::string_view text, std::string_view what) {
  const std::string v = to_lower(trim(text));
  if (v == "dash") return agent::AgentConfig::LocalRankArg::dash;
  if (v == "underscore") return agent::AgentConfig::LocalRankArg::underscore;
  if (v == "none") return agent::AgentConfig::LocalRankArg::none;
  fail(what, text, "unknown form", "dash (--local-rank=N), underscore (--local_rank=N), none");
}

spdlog::level::level_enum parse_log_level_value(std::string_view text, std::string_view what) {
  const auto level = parse_log_level(text);
  if (!level) fail(what, text, "unknown log level", "trace, debug, info, warning, error, critical, off");
  return *level;
}

int parse_max_restarts(std::string_view text, std::string_view what) {
  return parse_int_value(text, what, 0, 1'000'000);
}

int parse_nccl_roots(std::string_view text, std::string_view what) { return parse_int_value(text, what, 1, 4096); }

std::string parse_host(std::string_view text, std::string_view what) {
  std::string_view host = trim(text);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  if (host.empty() || host.find_first_of(" \t[]") != std::string_view::npos) {
    fail(what, text, "not a host name or address",
         "a host name, an IPv4 address, or an IPv6 address in brackets like [::1]");
  }
  return std::string(host);
}

std::string parse_ip_address(std::string_view text, std::string_view what) {
  std::string_view host = trim(text);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  const std::string literal(host);
  in6_addr buf{};
  if (::inet_pton(AF_INET, literal.c_str(), &buf) != 1 && ::inet_pton(AF_INET6, literal.c_str(), &buf) != 1) {
    fail(what, text, "not an IP address",
         "an IPv4 address (127.0.0.1, 0.0.0.0 for every address) or an IPv6 address (::1, :: for every address)");
  }
  return literal;
}

std::uint16_t parse_port_value(std::string_view text, std::string_view what, int min_port) {
  const auto port = parse_port(trim(text));
  if (!port || *port < min_port)
    fail(what, text, "not a port", "an integer in " + std::to_string(min_port) + "..65535");
  return *port;
}

std::string parse_non_empty(std::string_view text, std::string_view what, std::string_view hint) {
  const std::string_view t = trim(text);
  if (t.empty()) throw UsageError(std::string(what) + " is empty", std::string(hint));
  return std::string(t);
}

std::string parse_gpus_value(std::string_view text, std::string_view what) {
  std::string list = parse_non_empty(text, what, "give device ordinals or UUIDs, e.g. 0,1");
  worker_env::check_gpus_list(list);
  return list;
}

std::string random_uuid4() {
  std::array<unsigned char, 16> b{};
  // getrandom: one system call, where std::random_device plus seeding a Mersenne Twister cost a
  // measurable part of a launch.
  if (::getrandom(b.data(), b.size(), 0) != static_cast<ssize_t>(b.size())) {
    std::random_device rd;
    std::mt19937_64 gen((static_cast<std::uint64_t>(rd()) << 32) ^ rd());
    for (auto& x : b) x = static_cast<unsigned char>(gen() & 0xFF);
  }
  b[6] = static_cast<unsigned char>((b[6] & 0x0F) | 0x40);  // version 4
  b[8] = static_cast<unsigned char>((b[8] & 0x3F) | 0x80);  // RFC 4122 variant
  const std::string hex = to_hex(std::string_view(reinterpret_cast<const char*>(b.data()), b.size()));
  return hex.substr(0, 8) + "-" + hex.substr(8, 4) + "-" + hex.substr(12, 4) + "-" + hex.substr(16, 4) + "-" +
         hex.substr(20);
}

// --rdzv-conf password_file=FILE: the first line, without its line end. A file, not the command
// line, because every user of the machine can read a process' arguments in /proc. At most
// kMaxPasswordBytes are read, whatever the file holds.
std::string read_password_file(const std::string& file, const std::string& what) {
  constexpr std::size_t kMaxPasswordBytes = 4096;
  std::ifstream in(file, std::ios::binary);
  if (!in) {
    throw UsageError(what + " key password_file=" + file + ": cannot read the file",
                     "give a readable file holding the etcd password");
  }
  std::string line(kMaxPasswordBytes + 1, '\0');
  in.getline(line.data(), static_cast<std::streamsize>(line.size()));
  line.resize(static_cast<std::size_t>(std::max<std::streamsize>(in.gcount(), 0)));
  if (!line.empty() && line.back() == '\0') line.pop_back();  // getline counts the consumed '\n'
  if (!line.empty() && line.back() == '\r') line.pop_back();
  if (line.size() >= kMaxPasswordBytes) {
    throw UsageError(what + " key password_file=" + file + ": the first line is longer than 4096 bytes",
                     "write only the etcd password on the file's first line");
  }
  if (line.empty()) {
    throw UsageError(what + " key password_file=" + file + ": the file's first line is empty",
                     "write the etcd password on the file's first line");
  }
  return line;
}

std::string parse_event_log_handler(std::string_view text, std::string_view what) {
  const std::string t(trim(text));
  if (t == "null" || t == "dynamic_rendezvous") return "null";
  if (t == "console") return t;
  if (t.rfind("file:", 0) == 0 && t.size() > 5) return t;
  fail(what, text, "not an event log handler", "null, console, dynamic_rendezvous (torchrun's names) or file:PATH");
  return {};
}

std::vector<std::string> parse_duplicate_filters(std::string_view text) {
  // torchrun's comma_separated_list: ',,' stands for a literal comma; empty items are dropped.
  std::vector<std::string> out;
  std::string cur;
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] == ',' && i + 1 < text.size() && text[i + 1] == ',') {
      cur += ',';
      ++i;
    } else if (text[i] == ',') {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
    } else {
      cur += text[i];
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

}  // namespace ddprun::launcher
