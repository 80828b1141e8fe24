// libFuzzer target: the parsers of text that ddprun reads from outside, other than the wire
// frames (fuzz_store_codec, fuzz_rdzv_frames): files and flags a user or a cluster hands it
// (hostfiles, --hosts, --include/--exclude, Slurm's node lists, env files, endpoints, flag
// values), what a rank writes and the agent reads (the error file, the file timer's requests,
// faulthandler and eu-stack dumps, collective errors), the launcher's stdin protocol to remote
// agents, and the etcd gateway's replies.
//
// Input: byte 0 picks the parser (modulo the number of cases below), byte 1 is a parameter for
// the case (a depth, a default port, how to cut the text into pieces), the rest is the text.
// A documented refusal (ddprun::Error and its subclasses, an error string, nullopt) is fine; any
// other exception, a sanitizer finding, or a broken invariant (checked per case: names a parser
// let through are valid, encodings round-trip, incremental and whole-buffer reads agree) aborts.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ddprun/agent/diagnosis.hpp"
#include "ddprun/agent/failure.hpp"
#include "ddprun/agent/file_timer.hpp"
#include "ddprun/agent/remote_protocol.hpp"
#include "ddprun/common/endpoint.hpp"
#include "ddprun/common/error.hpp"
#include "ddprun/launcher/hosts.hpp"
#include "ddprun/launcher/remote_env.hpp"
#include "ddprun/launcher/slurm.hpp"
#include "ddprun/launcher/status_command.hpp"
#include "ddprun/launcher/values.hpp"
#include "ddprun/rendezvous/etcd_codec.hpp"
#include "ddprun/rendezvous/json_capped.hpp"
#include "ddprun/rendezvous/rendezvous_wire.hpp"

namespace launcher = ddprun::launcher;
namespace agent = ddprun::agent;
namespace etcd = ddprun::rendezvous::etcd;
namespace rdzv = ddprun::rendezvous;

namespace {

// Lists of up to 20,000 names and 1 MiB: the same code as the real bounds (1,000,000 and 64 MiB,
// tested in fanout_slurm_test), without ~0.5 GB per input that ASan keeps across inputs.
const launcher::HostlistLimits kSmallHostlists{20'000, std::size_t{1} << 20};

void require(bool ok) {
  if (!ok) std::abort();
}

bool is_name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
}

// What ends up as an ssh argument: never an option ("-oProxyCommand=..."), never a blank or a
// shell character (hosts.hpp).
void check_hosts(const std::vector<launcher::HostEntry>& hosts) {
  for (const auto& h : hosts) {
    require(!h.host.empty() && h.host.front() != '-');
    for (char c : h.host) require(is_name_char(c) || c == ':' || c == '%');
    require(h.user.empty() || h.user.front() != '-');
    for (char c : h.user) require(is_name_char(c));
    require(h.slots == -1 || h.slots > 0);
  }
}

// The text cut into at most `pieces` parts at positions taken from `param` (for the incremental
// readers: whatever the cut, they must read what the whole-buffer form reads).
std::vector<std::string_view> cut(std::string_view text, std::uint8_t param) {
  std::vector<std::string_view> out;
  std::size_t step = 1 + param % 7;
  while (!text.empty()) {
    const std::size_t n = std::min(step, text.size());
    out.push_back(text.substr(0, n));
    text.remove_prefix(n);
    step = 1 + (step * 5 + param) % 13;
  }
  return out;
}

std::map<std::string, std::string> env_lines(std::string_view text) {
  std::map<std::string, std::string> env;
  while (!text.empty()) {
    const auto nl = text.find('\n');
    const std::string_view line = text.substr(0, nl);
    if (const auto eq = line.find('='); eq != std::string_view::npos)
      env[std::string(line.substr(0, eq))] = std::string(line.substr(eq + 1));
    if (nl == std::string_view::npos) break;
    text.remove_prefix(nl + 1);
  }
  return env;
}

void values(std::string_view text, std::uint8_t param) {
  switch (param % 16) {
    case 0: {
      const auto r = launcher::parse_nnodes(text, "--nnodes");
      require(r.min_nodes > 0 && r.min_nodes <= r.max_nodes);
      break;
    }
    case 1:
      (void)launcher::parse_rdzv_conf(text, "--rdzv-conf");
      break;
    case 2:
      for (int s : launcher::parse_signals(text, "--signals-to-handle")) require(s > 0 && s <= 64);
      break;
    case 3:
      (void)launcher::parse_ranks_filter(text, "--ranks-filter");
      break;
    case 4:
      (void)launcher::parse_local_ranks_filter(text, "--local-ranks-filter");
      break;
    case 5:
      require(launcher::parse_seconds_value(text, "--rdzv-timeout") >= 0);
      break;
    case 6:
      (void)launcher::parse_streams(text, "--redirects");
      break;
    case 7:
      (void)launcher::parse_duplicate_filters(text);
      break;
    case 8:
      (void)launcher::parse_host(text, "--master-addr");
      break;
    case 9:
      (void)launcher::parse_ip_address(text, "--metrics-host");
      break;
    case 10:
      (void)launcher::parse_event_log_handler(text, "--event-log-handler");
      break;
    case 11:
      (void)launcher::parse_gpus_value(text, "--gpus");
      break;
    case 12:
      (void)launcher::parse_nproc_per_node(text, "--nproc-per-node", std::string(text), 4);
      break;
    case 13: {
      const auto conf = launcher::parse_rdzv_conf(text, "--rdzv-conf");
      (void)launcher::parse_rdzv_settings(conf, "--rdzv-conf", std::nullopt);
      break;
    }
    case 14:
      (void)launcher::parse_int_value(text, "--nccl-roots", 1, 4096);
      break;
    default:
      (void)launcher::parse_env_bool(text, "PET_STANDALONE");
      break;
  }
}

// One reply body decoded into a fresh `Out` (each decoder reports a problem as a string).
template <typename Out>
void decode(std::string (*decoder)(std::string_view, Out&), std::string_view body) {
  Out out;
  (void)decoder(body, out);
}

void etcd_reply(std::string_view body, std::uint8_t param) {
  std::optional<etcd::GatewayError> stream_error;
  switch (param % 9) {
    case 0:
      return decode<etcd::RangeResponse>(etcd::decode_range, body);
    case 1:
      return decode<etcd::ResponseHeader>(etcd::decode_header_only, body);
    case 2:
      return decode<etcd::TxnResponse>(etcd::decode_txn, body);
    case 3:
      return decode<etcd::LeaseGrantResponse>(etcd::decode_lease_grant, body);
    case 4: {
      etcd::LeaseKeepAliveResponse k;
      (void)etcd::decode_lease_keepalive(body, k, stream_error);
      return;
    }
    case 5: {
      etcd::WatchMessage w;
      (void)etcd::decode_watch_message(body, w, stream_error);
      return;
    }
    case 6:
      return decode<std::string>(etcd::decode_authenticate, body);
    case 7:
      (void)etcd::decode_error(body);
      return;
    default:
      if (const auto d = etcd::base64_decode(body)) require(etcd::base64_encode(*d) == body);
      return;
  }
}

// Native rendezvous frames, one after another, as the agent (server pushes) or the daemon (client
// requests) reads them: the decoder never claims more than it has or asks for less than it has,
// and what it decoded encodes to a frame that decodes again to the same encoding (and passes
// `check`, when given).
// What `ddprun status` prints from a daemon's reply reaches a terminal: no control character
// but the line ends, no DEL, no C1 control (UTF-8 C2 80..9F) a peer could move the cursor with.
void check_status_text(const rdzv::ServerMessage& m) {
  const auto* status = std::get_if<rdzv::RegistryStatus>(&m);
  if (status == nullptr) return;
  const std::string text = launcher::format_status(*status, "head:29400", "");
  for (std::size_t i = 0; i < text.size(); ++i) {
    const auto u = static_cast<unsigned char>(text[i]);
    require((u >= 0x20 || text[i] == '\n') && u != 0x7f);
    if (u == 0xc2 && i + 1 < text.size()) {
      const auto next = static_cast<unsigned char>(text[i + 1]);
      require(next < 0x80 || next > 0x9f);
    }
  }
  (void)launcher::format_status_json(*status, "head:29400", "", "");
}

template <typename Message>
void frames(std::string_view stream, rdzv::DecodeResult (*decode)(std::string_view, const rdzv::WireLimits&, Message&),
            void (*encode)(std::string&, const Message&), void (*check)(const Message&)) {
  rdzv::WireLimits limits;
  limits.max_payload_bytes = 16384;
  while (!stream.empty()) {
    Message m;
    const auto r = decode(stream, limits, m);
    if (r.status == rdzv::DecodeStatus::need_more) {
      require(r.min_total > stream.size());
      return;
    }
    if (r.status != rdzv::DecodeStatus::ok) return;
    require(r.consumed > 0 && r.consumed <= stream.size());
    if (check != nullptr) check(m);
    std::string once;
    encode(once, m);
    Message again;
    rdzv::WireLimits roomy;
    roomy.max_payload_bytes = once.size();
    const auto r2 = decode(once, roomy, again);
    require(r2.status == rdzv::DecodeStatus::ok && r2.consumed == once.size());
    std::string twice;
    encode(twice, again);
    require(twice == once);
    stream.remove_prefix(r.consumed);
  }
}

void run(std::uint8_t which, std::uint8_t param, std::string_view text) {
  switch (which % 18) {
    case 0: {
      std::vector<std::string> notes;
      check_hosts(launcher::parse_hostfile_text(text, "hosts.txt", &notes));
      break;
    }
    case 1:
      check_hosts(launcher::parse_hosts_list(text, "--hosts"));
      break;
    case 2: {
      // A host list on the first line, a selection on the second.
      const auto nl = text.find('\n');
      const auto hosts = launcher::parse_hosts_list(text.substr(0, nl), "--hosts");
      const std::string_view sel = nl == std::string_view::npos ? std::string_view{} : text.substr(nl + 1);
      const bool include = (param & 1) != 0;
      std::optional<int> default_slots;
      if ((param & 2) != 0) default_slots = 1 + (param >> 2);
      check_hosts(launcher::select_hosts(hosts, include ? sel : "", include ? "" : sel, std::nullopt, std::nullopt,
                                         default_slots));
      break;
    }
    case 3:
      for (const auto& name : launcher::expand_hostlist(text, "hostlist", kSmallHostlists)) require(!name.empty());
      break;
    case 4:
      (void)launcher::slurm_from_env(env_lines(text), kSmallHostlists);
      break;
    case 5:
      for (const auto& [name, value] : launcher::parse_env_file_text(text, "env.txt"))
        require(agent::is_env_name(name));
      break;
    case 6: {
      const auto f = launcher::parse_env_flag(text);
      require(agent::is_env_name(f.name));
      break;
    }
    case 7: {
      // The env block, whole and in pieces: the same entries, the same length; and an encoding
      // of what was read reads back the same.
      std::size_t consumed = 0;
      std::optional<agent::RemoteEnv> whole;
      try {
        whole = agent::decode_env_block(text, &consumed, 4096);
      } catch (const ddprun::Error&) {
      }
      agent::EnvBlockReader reader(4096);
      std::size_t fed = 0;
      try {
        for (auto piece : cut(text, param)) {
          fed += reader.feed(piece);
          if (reader.done()) break;
        }
      } catch (const ddprun::Error&) {
        require(!whole);
        break;
      }
      if (!whole) {
        require(!reader.done());
        break;
      }
      require(reader.done() && reader.entries() == *whole && fed == consumed);
      require(agent::decode_env_block(agent::encode_env_block(*whole), nullptr, 1 << 20) == *whole);
      break;
    }
    case 8: {
      agent::ControlReader reader;
      for (auto piece : cut(text, param)) {
        for (int s : reader.feed(piece).signals) require(s >= 1 && s <= 64);
      }
      break;
    }
    case 9: {
      std::string problem;
      const auto e = agent::parse_error_file(text, &problem);
      require(e.has_value() || !problem.empty());
      break;
    }
    case 10: {
      std::string problem;
      const auto r = agent::parse_timer_request(text, &problem);
      require(r.has_value() || !problem.empty());
      break;
    }
    case 11: {
      const std::string s(text);
      (void)agent::parse_python_frame(text);
      (void)agent::native_frame_symbol(text);
      (void)agent::collective_timeout_in(s);
      (void)agent::collective_failure_words(s);
      (void)agent::in_collective(s);
      break;
    }
    case 12: {
      // Bounded memory whatever the text (the cap; ASan's RSS limit catches a miss).
      const auto j = ddprun::rendezvous::parse_json_capped(text, 1 + param % 64);
      require(j.ok() || j.value.is_null());
      break;
    }
    case 13: {
      const auto list = ddprun::parse_endpoint_list(text, static_cast<std::uint16_t>(param * 257), "--rdzv-endpoint");
      require(!list.empty());
      require(ddprun::parse_endpoint_list(ddprun::endpoint_list_text(list), 1, "--rdzv-endpoint") == list);
      break;
    }
    case 14:
      etcd_reply(text, param);
      break;
    case 15:
      frames<rdzv::ServerMessage>(text, rdzv::decode_server, rdzv::encode_server, check_status_text);
      break;
    case 16:
      frames<rdzv::ClientMessage>(text, rdzv::decode_client, rdzv::encode_client, nullptr);
      break;
    default:
      values(text, param);
      break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2 || size > 65536) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data + 2), size - 2);
  try {
    run(data[0], data[1], text);
  } catch (const ddprun::Error&) {
    // A refusal, with its message: what these parsers are for.
  }
  return 0;
}
