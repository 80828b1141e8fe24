// store_client_driver: drives ddprun's StoreClient from a command list, for the Python
// interop/contract tests and for manual poking at a store.
//
// Usage: store_client_driver --host H --port P [--generation legacy|modern]
//                            [--timeout-ms N] [--connect-timeout-ms N] [--prefix P]
// Reads one command per line on stdin and answers each with one JSON line on stdout
// (flushed), so a test can interleave it with other clients. Binary arguments and results
// are hex with an 'h' in front ("h6b31" = "k1", "h" = empty), so any byte string survives.
//
//   set K V | get K [timeout_ms] | add K N | add_raw K N | compare_set K E D | check K...
//   wait TIMEOUT_MS K...  (TIMEOUT_MS -1 = the client's default) | num_keys | delete_key K
//   append K V | multi_get K... | multi_set K V [K V...] | queue_push K V | queue_pop K
//   queue_pop_wait K TIMEOUT_MS | queue_len K | list_keys | barrier K WORLD TIMEOUT_MS
//   ping NONCE | quit
//
// Replies: {"ok":true,"result":R} with R null, an integer, true/false, "h..." or a list of
// those; {"ok":false,"error":"TimeoutError|NetworkError|Error|UsageError","message":"..."}.
// The first line is the connect result: {"ok":true,"result":"connected"} or an error (then
// exit status 2). With --detect-ms N the driver instead prints the probed generation
// (detect_generation: "legacy", "modern_no_ping" or "modern") and exits.
#include <chrono>
#include <cstdint>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "ddprun/common/error.hpp"
#include "ddprun/common/strings.hpp"
#include "ddprun/rendezvous/store_client.hpp"

namespace {

using ddprun::rendezvous::Generation;
using ddprun::rendezvous::StoreClient;
using ddprun::rendezvous::StoreClientOptions;

std::string json_escape(std::string_view s) {
  std::string out;
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += ch;
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += ch;
    }
  }
  return out;
}

std::string hexs(std::string_view bytes) { return "\"h" + ddprun::to_hex(bytes) + "\""; }

std::string hex_list(const std::vector<std::string>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + hexs(v[i]);
  return s + "]";
}

std::string unhex(const std::string& tok) {
  if (tok.empty() || tok[0] != 'h') throw ddprun::UsageError("argument '" + tok + "' must be 'h' + hex");
  auto v = ddprun::from_hex(std::string_view(tok).substr(1));
  if (!v) throw ddprun::UsageError("argument '" + tok + "' is not valid hex");
  return *v;
}

std::int64_t to_int(const std::string& tok) {
  auto v = ddprun::parse_int(tok);
  if (!v) throw ddprun::UsageError("argument '" + tok + "' is not an integer");
  return *v;
}

std::string run(StoreClient& c, const std::vector<std::string>& t) {
  const std::string& op = t[0];
  auto need = [&](std::size_t n) {
    if (t.size() < n + 1) throw ddprun::UsageError(op + " needs " + std::to_string(n) + " arguments");
  };
  auto keys_from = [&](std::size_t first) {
    std::vector<std::string> keys;
    for (std::size_t i = first; i < t.size(); ++i) keys.push_back(unhex(t[i]));
    return keys;
  };
  using std::chrono::milliseconds;
  if (op == "set") {
    need(2);
    c.set(unhex(t[1]), unhex(t[2]));
    return "null";
  }
  if (op == "get") {
    need(1);
    return hexs(t.size() > 2 ? c.get(unhex(t[1]), milliseconds(to_int(t[2]))) : c.get(unhex(t[1])));
  }
  if (op == "add") {
    need(2);
    return std::to_string(c.add(unhex(t[1]), to_int(t[2])));
  }
  if (op == "add_raw") {
    need(2);
    return std::to_string(c.add_raw(unhex(t[1]), to_int(t[2])));
  }
  if (op == "compare_set") {
    need(3);
    return hexs(c.compare_set(unhex(t[1]), unhex(t[2]), unhex(t[3])));
  }
  if (op == "check") {
    return c.check(keys_from(1)) ? "true" : "false";
  }
  if (op == "wait") {
    need(1);
    const auto ms = to_int(t[1]);
    if (ms < 0)
      c.wait(keys_from(2));
    else
      c.wait(keys_from(2), milliseconds(ms));
    return "null";
  }
  if (op == "num_keys") return std::to_string(c.num_keys());
  if (op == "delete_key") {
    need(1);
    return c.delete_key(unhex(t[1])) ? "true" : "false";
  }
  if (op == "append") {
    need(2);
    c.append(unhex(t[1]), unhex(t[2]));
    return "null";
  }
  if (op == "multi_get") return hex_list(c.multi_get(keys_from(1)));
  if (op == "multi_set") {
    std::vector<std::string> k, v;
    for (std::size_t i = 1; i + 1 < t.size(); i += 2) {
      k.push_back(unhex(t[i]));
      v.push_back(unhex(t[i + 1]));
    }
    c.multi_set(k, v);
    return "null";
  }
  if (op == "queue_push") {
    need(2);
    c.queue_push(unhex(t[1]), unhex(t[2]));
    return "null";
  }
  if (op == "queue_pop") {
    need(1);
    auto v = c.queue_pop(unhex(t[1]));
    return v ? hexs(*v) : "null";
  }
  if (op == "queue_pop_wait") {
    need(2);
    return hexs(c.queue_pop_wait(unhex(t[1]), milliseconds(to_int(t[2]))));
  }
  if (op == "queue_len") {
    need(1);
    return std::to_string(c.queue_len(unhex(t[1])));
  }
  if (op == "list_keys") return hex_list(c.list_keys());
  if (op == "barrier") {
    need(3);
    c.barrier(unhex(t[1]), to_int(t[2]), milliseconds(to_int(t[3])));
    return "null";
  }
  if (op == "ping") {
    need(1);
    return std::to_string(c.ping(static_cast<std::uint32_t>(to_int(t[1]))));
  }
  throw ddprun::UsageError("unknown command '" + op + "'");
}

template <class F>
bool guarded(F&& f) {
  try {
    const std::string r = f();
    std::cout << "{\"ok\":true,\"result\":" << r << "}" << std::endl;
    return true;
  } catch (const ddprun::TimeoutError& e) {
    std::cout << "{\"ok\":false,\"error\":\"TimeoutError\",\"message\":\"" << json_escape(e.what()) << "\"}"
              << std::endl;
  } catch (const ddprun::NetworkError& e) {
    std::cout << "{\"ok\":false,\"error\":\"NetworkError\",\"message\":\"" << json_escape(e.what()) << "\"}"
              << std::endl;
  } catch (const ddprun::UsageError& e) {
    std::cout << "{\"ok\":false,\"error\":\"UsageError\",\"message\":\"" << json_escape(e.what()) << "\"}" << std::endl;
  } catch (const ddprun::Error& e) {
    std::cout << "{\"ok\":false,\"error\":\"Error\",\"message\":\"" << json_escape(e.what()) << "\"}" << std::endl;
  }
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  StoreClientOptions opt;
  long detect_ms = -1;
  opt.connect_timeout = std::chrono::seconds(10);
  opt.timeout = std::chrono::seconds(30);
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) {
      std::cerr << "store_client_driver: option " << a << " needs a value\n";
      return 2;
    }
    const std::string v = argv[++i];
    if (a == "--host")
      opt.host = v;
    else if (a == "--port")
      opt.port = static_cast<std::uint16_t>(ddprun::parse_int(v).value_or(0));
    else if (a == "--generation") {
      if (v != "legacy" && v != "modern") {
        std::cerr << "store_client_driver: --generation legacy|modern\n";
        return 2;
      }
      opt.generation = v == "legacy" ? Generation::legacy : Generation::modern;
    } else if (a == "--timeout-ms")
      opt.timeout = std::chrono::milliseconds(ddprun::parse_int(v).value_or(30000));
    else if (a == "--connect-timeout-ms")
      opt.connect_timeout = std::chrono::milliseconds(ddprun::parse_int(v).value_or(10000));
    else if (a == "--prefix")
      opt.key_prefix = v;
    else if (a == "--detect-ms")
      detect_ms = ddprun::parse_int(v).value_or(1000);
    else {
      std::cerr << "store_client_driver: unknown option " << a << "\n";
      return 2;
    }
  }
  if (detect_ms >= 0) {
    return guarded([&] {
      const auto g = ddprun::rendezvous::detect_generation(opt.host, opt.port, std::chrono::milliseconds(detect_ms));
      using D = ddprun::rendezvous::DetectedGeneration;
      return std::string(g == D::modern ? "\"modern\"" : g == D::modern_no_ping ? "\"modern_no_ping\"" : "\"legacy\"");
    })
               ? 0
               : 2;
  }
  std::optional<StoreClient> client;
  if (!guarded([&] {
        client.emplace(opt);
        return std::string("\"connected\"");
      }))
    return 2;
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::vector<std::string> tokens;
    for (std::string tok; in >> tok;) tokens.push_back(tok);
    if (tokens.empty()) continue;
    if (tokens[0] == "quit") break;
    guarded([&] { return run(*client, tokens); });
  }
  return 0;
}
