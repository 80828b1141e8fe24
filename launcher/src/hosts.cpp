#include "ddprun/launcher/hosts.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "ddprun/common/endpoint.hpp"
#include "ddprun/common/error.hpp"
#include "ddprun/common/strings.hpp"

namespace ddprun::launcher {
namespace {

// --hosts items: no "host slots=N" there (that is a hostfile line; a space cannot be in an item).
constexpr std::string_view kHostsListForms =
    "comma list of host, host:SLOTS, user@host, user@host:SLOTS, an IPv6 address, [ipv6] or [ipv6]:SLOTS; "
    "SLOTS a positive integer, e.g. h1,h2:4,user@h3";
constexpr std::string_view kHostfileForms =
    "one host per line: 'host slots=N' (DeepSpeed/OpenMPI), 'host:N' or 'host', optionally "
    "user@host; an IPv6 address as it is, or as [ipv6] / [ipv6]:N; '#' starts a comment";
constexpr std::string_view kFilterForms =
    "NODE_SPEC[@NODE_SPEC...] with NODE_SPEC = NAME[:SLOT[,SLOT...]], an IPv6 address in brackets "
    "([fd00::5] or [fd00::5]:0,1), e.g. worker-0:0,2@worker-1";
constexpr int kMaxSlots = 65536;
// A hostfile is a few lines per host: anything this large is not one (/dev/zero, a wrong file).
constexpr std::uintmax_t kMaxHostfileBytes = 64ULL << 20;
// "user@host:slots" at most: a 253-character DNS name, a user name, a slot count.
constexpr std::size_t kMaxHostWord = 512;

bool is_digits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

bool is_name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
}

bool is_plain_name(std::string_view s) {
  return !s.empty() && s.front() != '-' && std::all_of(s.begin(), s.end(), is_name_char);
}

bool is_ipv6_literal(std::string_view s) {
  // Syntax only: hex digits, ':' and '.' (v4-mapped tail), '%zone'; at least two colons.
  return std::count(s.begin(), s.end(), ':') >= 2 &&
         std::all_of(s.begin(), s.end(), [](char c) { return is_name_char(c) || c == ':' || c == '%'; }) &&
         s.front() != '-';
}

// Parses one "[user@]host[:N]" word. `where` prefixes messages ("hosts.txt:3" or "--hosts").
// `slots_follow`: a hostfile line gives slots=N after the word, so a word that is an IPv6 address
// whole is that address (its last group cannot be a slot count given twice).
HostEntry parse_host_word(std::string_view word, const std::string& where, std::string_view forms,
                          bool slots_follow = false) {
  auto fail = [&](const std::string& why) -> HostEntry {
    throw UsageError(where + ": '" + std::string(word) + "': " + why, "accepted forms: " + std::string(forms));
  };
  // A DNS name has at most 253 characters; a word far longer is not a host, and would be
  // echoed whole into every message that names it.
  if (word.size() > kMaxHostWord) {
    throw UsageError(where + ": '" + std::string(word.substr(0, 64)) + "...' (" + std::to_string(word.size()) +
                         " characters): too long for a host (at most " + std::to_string(kMaxHostWord) + ")",
                     "accepted forms: " + std::string(forms));
  }
  HostEntry e;
  std::string_view rest = word;
  if (const auto at = rest.find('@'); at != std::string_view::npos) {
    e.user = std::string(rest.substr(0, at));
    rest = rest.substr(at + 1);
    if (!is_plain_name(e.user))
      fail("'" + e.user + "' is not a valid user name ([A-Za-z0-9._-], not starting with '-')");
  }
  std::string_view slots_text;
  bool has_slots = false;
  if (!rest.empty() && rest.front() == '[') {
    const auto close = rest.find(']');
    if (close == std::string_view::npos) fail("'[' without ']'");
    const std::string_view inner = rest.substr(1, close - 1);
    const std::string_view after = rest.substr(close + 1);
    if (!is_ipv6_literal(inner) || !is_ipv6_address(inner)) fail("'" + std::string(inner) + "' is not an IPv6 address");
    e.host = std::string(inner);
    if (!after.empty()) {
      if (after.front() != ':') fail("unexpected text after ']'");
      slots_text = after.substr(1);
      has_slots = true;
    }
  } else {
    const auto colons = std::count(rest.begin(), rest.end(), ':');
    if (colons >= 2) {
      // As --include: an address whose last group could be a slot count of the address before it
      // (fd00::5:4) is ambiguous; brackets say which.
      const auto last = rest.rfind(':');
      const std::string_view before = rest.substr(0, last);
      const std::string_view after = rest.substr(last + 1);
      const auto count = parse_int(after);
      const bool slot_count = !after.empty() && is_digits(after) && count && *count >= 1 && *count <= kMaxSlots;
      if (slot_count && !(slots_follow && is_ipv6_address(rest)) && is_ipv6_literal(before) &&
          is_ipv6_address(before)) {
        fail("'" + std::string(rest) + "' is ambiguous: write an IPv6 address in brackets, [" + std::string(before) +
             "]:" + std::string(after) + " for " + std::string(after) + " slots on " + std::string(before) +
             (is_ipv6_address(rest) ? ", [" + std::string(rest) + "] for the whole address" : std::string()));
      }
      if (!is_ipv6_literal(rest) || !is_ipv6_address(rest)) fail("not a host name or IPv6 address");
      e.host = std::string(rest);
    } else {
      const auto colon = rest.find(':');
      e.host = std::string(rest.substr(0, colon));
      if (colon != std::string_view::npos) {
        slots_text = rest.substr(colon + 1);
        has_slots = true;
      }
      if (e.host.empty()) fail("empty host name");
      if (!is_plain_name(e.host)) {
        fail("'" + e.host + "' is not a valid host name ([A-Za-z0-9._-], not starting with '-')");
      }
    }
  }
  if (has_slots) {
    const auto v = parse_int(slots_text);
    if (!is_digits(slots_text) || !v || *v <= 0 || *v > kMaxSlots) {
      fail("slot count '" + std::string(slots_text) + "' is not a positive integer (1.." + std::to_string(kMaxSlots) +
           ")");
    }
    e.slots = static_cast<int>(*v);
  }
  return e;
}

std::vector<std::string> split_whitespace(std::string_view line) {
  std::vector<std::string> out;
  std::istringstream in{std::string(line)};
  std::string word;
  while (in >> word) out.push_back(word);
  return out;
}

// Two spellings of one host: ssh (and DNS) ignore the case of host names, and IPv6 literals are
// hex, so "Node1" and "node1" reach the same machine; the messages keep the user's spelling.
std::string same_host_key(std::string_view host) { return to_lower(host); }

// " as 'first'; ..." when a duplicate was first written with other letter case; "" otherwise.
std::string first_spelling(std::string_view host, std::string_view first) {
  return host == first ? std::string() : " as '" + std::string(first) + "'; host names ignore case";
}

int effective_slots(const HostEntry& e, std::optional<int> default_slots) {
  if (e.slots > 0) return e.slots;
  return default_slots.value_or(-1);
}

}  // namespace

std::vector<HostEntry> parse_hostfile_text(std::string_view text, std::string_view file_name,
                                           std::vector<std::string>* notes) {
  std::vector<HostEntry> out;
  // same_host_key(host) -> where it was first listed (line number, spelling), for duplicates
  std::map<std::string, std::pair<int, std::string>> first_line;
  int line_no = 0;
  // Editors on Windows may start a UTF-8 file with a byte order mark: not part of the first host.
  if (starts_with(text, "\xEF\xBB\xBF")) text.remove_prefix(3);
  for (const auto& raw : split(text, '\n')) {
    ++line_no;
    std::string_view line = raw;
    if (const auto hash = line.find('#'); hash != std::string_view::npos) line = line.substr(0, hash);
    line = trim(line);  // also drops a CRLF file's '\r'
    if (line.empty()) continue;
    const std::string where = std::string(file_name) + ":" + std::to_string(line_no);
    if (line.find('\0') != std::string_view::npos) {
      throw UsageError(where + ": contains a NUL byte", "is this a text file? " + std::string(kHostfileForms));
    }
    const auto words = split_whitespace(line);
    const bool slots_follow =
        std::any_of(words.begin() + 1, words.end(), [](const std::string& w) { return w.rfind("slots=", 0) == 0; });
    HostEntry e = parse_host_word(words[0], where, kHostfileForms, slots_follow);
    for (std::size_t i = 1; i < words.size(); ++i) {
      const std::string& w = words[i];
      const auto eq = w.find('=');
      if (eq == std::string::npos || eq == 0) {
        throw UsageError(where + ": '" + w + "' is not a KEY=VALUE setting (only one host per line)",
                         "accepted forms: " + std::string(kHostfileForms));
      }
      const std::string key = w.substr(0, eq);
      const std::string value = w.substr(eq + 1);
      if (key == "slots") {
        const auto v = parse_int(value);
        if (!is_digits(value) || !v || *v <= 0 || *v > kMaxSlots) {
          throw UsageError(
              where + ": slots=" + value + " is not a positive integer (1.." + std::to_string(kMaxSlots) + ")",
              "accepted forms: " + std::string(kHostfileForms));
        }
        if (e.slots > 0) {
          throw UsageError(where + ": the slot count is given twice ('" + words[0] + "' and '" + w + "')",
                           "give either host:N or host slots=N");
        }
        e.slots = static_cast<int>(*v);
      } else if (notes != nullptr) {
        notes->push_back(where + ": ignoring '" + w + "' (ddprun only uses slots=)");
      }
    }
    if (const auto it = first_line.find(same_host_key(e.host)); it != first_line.end()) {
      throw UsageError(where + ": host '" + e.host + "' is listed twice (first at line " +
                           std::to_string(it->second.first) + first_spelling(e.host, it->second.second) + ")",
                       "list each host once, with its total slot count");
    }
    first_line.emplace(same_host_key(e.host), std::make_pair(line_no, e.host));
    out.push_back(std::move(e));
  }
  return out;
}

std::string read_flag_file(std::string_view flag, const std::string& path, std::uintmax_t max_bytes,
                           std::string_view kind, std::string_view hint) {
  // A regular file, or a pipe (--hostfile <(scontrol show hostnames)); not a directory or a
  // device, which would read as nothing or without end (/dev/zero).
  const std::string what = std::string(flag) + " " + path;
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (!ec && st.type() != std::filesystem::file_type::regular && st.type() != std::filesystem::file_type::fifo) {
    const std::string type =
        st.type() == std::filesystem::file_type::directory ? "a directory"
        : st.type() == std::filesystem::file_type::character || st.type() == std::filesystem::file_type::block
            ? "a device"
            : "a special file";
    throw UsageError(what + ": is " + type + ", not " + std::string(kind), std::string(hint));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError(what + ": cannot be read", "check the path and its permissions");
  std::string text;
  std::array<char, 65536> buf{};
  while (in.read(buf.data(), buf.size()) || in.gcount() > 0) {
    text.append(buf.data(), static_cast<std::size_t>(in.gcount()));
    if (text.size() > max_bytes) {
      throw UsageError(what + ": is larger than " + std::to_string(max_bytes >> 20) + " MiB, more than " +
                           std::string(kind) + " holds",
                       "check the path: " + std::string(hint));
    }
  }
  if (in.bad()) throw UsageError(what + ": read error", "check the file");
  return text;
}

std::vector<HostEntry> load_hostfile(const std::string& path, std::vector<std::string>* notes) {
  const std::string text = read_flag_file("--hostfile", path, kMaxHostfileBytes, "a host list",
                                          "give a text file listing one host per line");
  auto hosts = parse_hostfile_text(text, path, notes);
  if (hosts.empty()) {
    throw UsageError("--hostfile " + path + ": lists no host", "accepted forms: " + std::string(kHostfileForms));
  }
  return hosts;
}

std::vector<HostEntry> parse_hosts_list(std::string_view text, std::string_view what) {
  const std::string where(what);
  const std::string forms(kHostsListForms);
  if (trim(text).empty()) throw UsageError(where + ": no hosts given", "accepted forms: " + forms);
  std::vector<HostEntry> out;
  std::map<std::string, std::string> seen;  // same_host_key(host) -> the host as first written
  for (const auto& raw : split(text, ',')) {
    const std::string_view item = trim(raw);
    if (item.empty())
      throw UsageError(where + "=" + std::string(text) + ": empty host name", "accepted forms: " + forms);
    if (item.find_first_of(" \t=") != std::string_view::npos) {
      throw UsageError(where + ": '" + std::string(item) + "' is not a host",
                       "accepted forms: " + forms + " ('host slots=N' is a --hostfile line; here write host:N)");
    }
    HostEntry e = parse_host_word(item, where, forms);
    if (const auto [it, added] = seen.emplace(same_host_key(e.host), e.host); !added) {
      throw UsageError(
          where + ": host '" + e.host + "' is listed twice" +
              (it->second == e.host ? std::string() : " (first" + first_spelling(e.host, it->second) + ")"),
          "list each host once");
    }
    out.push_back(std::move(e));
  }
  return out;
}

std::map<std::string, std::optional<std::vector<int>>> parse_include_exclude(std::string_view text,
                                                                             std::string_view what) {
  const std::string where = std::string(what) + "=" + std::string(text);
  auto fail = [&](const std::string& why) {
    throw UsageError(where + ": " + why, "accepted forms: " + std::string(kFilterForms));
  };
  std::map<std::string, std::optional<std::vector<int>>> out;
  std::map<std::string, std::string> spelled;  // same_host_key(name) -> the name as first written
  if (trim(text).empty()) fail("empty");
  for (const auto& raw : split(trim(text), '@')) {
    std::string_view spec = trim(raw);
    if (spec.empty()) fail("empty node spec (two '@' in a row, or a leading/trailing '@')");
    std::string_view name = spec;
    std::optional<std::string_view> slot_text;
    if (spec.front() == '[') {  // [ipv6]:slots
      const auto close = spec.find(']');
      if (close == std::string_view::npos) fail("'[' without ']' in '" + std::string(spec) + "'");
      name = spec.substr(1, close - 1);
      const std::string_view after = spec.substr(close + 1);
      if (!after.empty()) {
        if (after.front() != ':') fail("unexpected text after ']' in '" + std::string(spec) + "'");
        slot_text = after.substr(1);
      }
    } else if (const auto last = spec.rfind(':'); std::count(spec.begin(), spec.end(), ':') >= 2 &&
                                                  (is_ipv6_address(spec) || is_ipv6_address(spec.substr(0, last)))) {
      // An IPv6 address without brackets names the whole host, as in a hostfile, unless its
      // last group could be a slot index of the address before it (fd00::5:1): then refuse.
      const std::string_view before = spec.substr(0, last);
      const std::string_view after = spec.substr(last + 1);
      const bool slot_like = !after.empty() && std::all_of(after.begin(), after.end(),
                                                           [](char c) { return (c >= '0' && c <= '9') || c == ','; });
      if (slot_like && is_ipv6_address(before)) {
        fail("'" + std::string(spec) + "' is ambiguous: write an IPv6 address in brackets, [" + std::string(before) +
             "]:" + std::string(after) + " for slots " + std::string(after) + " of " + std::string(before) +
             (is_ipv6_address(spec) ? ", [" + std::string(spec) + "] for the whole host" : std::string()));
      }
      if (!is_ipv6_address(spec)) fail("'" + std::string(spec) + "' is not a host name or IPv6 address");
    } else if (const auto colon = spec.find(':'); colon != std::string_view::npos) {
      name = spec.substr(0, colon);
      slot_text = spec.substr(colon + 1);
    }
    name = trim(name);
    if (name.empty()) fail("empty host name in '" + std::string(spec) + "'");
    // Host names ignore case (as in the host list): Node1 and node1 are one host.
    const auto [first, added] = spelled.emplace(same_host_key(name), std::string(name));
    const bool seen_before = !added;
    auto& entry = out[first->second];
    if (!slot_text) {
      entry.reset();  // a bare name means the whole host, whatever else names it
      continue;
    }
    std::vector<int> slots;
    for (const auto& s_raw : split(*slot_text, ',')) {
      const std::string_view s = trim(s_raw);
      const auto v = parse_int(s);
      if (!is_digits(s) || !v || *v >= kMaxSlots) {
        fail("'" + std::string(s) + "' is not a slot index (a non-negative integer) in '" + std::string(spec) + "'");
      }
      slots.push_back(static_cast<int>(*v));
    }
    if (!seen_before) {
      entry = std::move(slots);
    } else if (entry) {  // merge: the union, in the order first named
      for (int v : slots) {
        if (std::find(entry->begin(), entry->end(), v) == entry->end()) entry->push_back(v);
      }
    }
  }
  return out;
}

std::vector<HostEntry> select_hosts(const std::vector<HostEntry>& entries, std::string_view include,
                                    std::string_view exclude, std::optional<int> num_nodes, std::optional<int> num_gpus,
                                    std::optional<int> default_slots) {
  const bool has_include = !trim(include).empty();
  const bool has_exclude = !trim(exclude).empty();
  if (has_include && has_exclude) {
    throw UsageError("--include and --exclude are both given",
                     "they are mutually exclusive (as in DeepSpeed): use one");
  }
  if ((num_nodes || num_gpus) && (has_include || has_exclude)) {
    throw UsageError("--num-nodes/--num-gpus cannot be combined with --include/--exclude",
                     "select hosts and slots with one or the other (as in DeepSpeed)");
  }
  if (num_nodes && *num_nodes <= 0) {
    throw UsageError("--num-nodes=" + std::to_string(*num_nodes) + ": must be > 0", "a positive number of hosts");
  }
  if (num_gpus && *num_gpus <= 0) {
    throw UsageError("--num-gpus=" + std::to_string(*num_gpus) + ": must be > 0",
                     "a positive number of slots per host");
  }
  if (entries.empty()) throw UsageError("no hosts given", "use --hostfile FILE or --hosts h1,h2");

  std::vector<HostEntry> out;
  if (has_include || has_exclude) {
    const std::string flag = has_include ? "--include" : "--exclude";
    const std::string_view text = has_include ? include : exclude;
    const auto spec = parse_include_exclude(text, flag);
    // Host names ignore case, as the host list's duplicate check does.
    std::map<std::string, const HostEntry*> by_name;
    for (const auto& e : entries) by_name.emplace(same_host_key(e.host), &e);
    std::map<std::string, const std::optional<std::vector<int>>*> spec_by_key;
    for (const auto& [name, slots] : spec) spec_by_key.emplace(same_host_key(name), &slots);
    // Validate every name and index before applying anything (DeepSpeed checks them all).
    for (const auto& [name, slots] : spec) {
      const auto it = by_name.find(same_host_key(name));
      if (it == by_name.end()) {
        std::string known;
        for (const auto& e : entries) known += (known.empty() ? "" : ", ") + e.host;
        throw UsageError(flag + "=" + std::string(text) + ": host '" + name + "' is not in the host list",
                         "known hosts: " + known);
      }
      if (!slots) continue;
      const int n = effective_slots(*it->second, default_slots);
      if (n <= 0) {
        throw UsageError(
            flag + "=" + std::string(text) + ": host '" + name + "' has no slot count to check slot indices against",
            "give its slots in the hostfile (host slots=N) or pass --nproc-per-node");
      }
      for (int s : *slots) {
        if (s >= n) {
          throw UsageError(flag + "=" + std::string(text) + ": host '" + name + "' has no slot " + std::to_string(s),
                           "its slots are 0.." + std::to_string(n - 1));
        }
      }
    }
    for (const auto& e : entries) {
      const auto found = spec_by_key.find(same_host_key(e.host));
      const std::optional<std::vector<int>>* slots = found == spec_by_key.end() ? nullptr : found->second;
      if (has_include) {
        if (slots == nullptr) continue;
        HostEntry kept = e;
        if (*slots) {
          std::vector<int> uniq;  // keep the given order (DeepSpeed's _stable_remove_duplicates)
          for (int s : **slots) {
            if (std::find(uniq.begin(), uniq.end(), s) == uniq.end()) uniq.push_back(s);
          }
          kept.slot_indices = std::move(uniq);
        }
        out.push_back(std::move(kept));
      } else {
        if (slots == nullptr) {
          out.push_back(e);
          continue;
        }
        if (!*slots) continue;  // whole host excluded
        const int n = effective_slots(e, default_slots);
        std::vector<int> remaining;
        for (int s = 0; s < n; ++s) {
          if (std::find((*slots)->begin(), (*slots)->end(), s) == (*slots)->end()) remaining.push_back(s);
        }
        if (remaining.empty()) continue;
        HostEntry kept = e;
        kept.slot_indices = std::move(remaining);
        out.push_back(std::move(kept));
      }
    }
  } else {
    out = entries;
  }

  if (num_nodes) {
    if (static_cast<std::size_t>(*num_nodes) > out.size()) {
      throw UsageError(
          "--num-nodes=" + std::to_string(*num_nodes) + ": only " + std::to_string(out.size()) + " host(s) are listed",
          "list more hosts or lower --num-nodes");
    }
    out.resize(static_cast<std::size_t>(*num_nodes));
  }
  if (num_gpus) {
    for (auto& e : out) {
      const int n = e.slots > 0 ? e.slots : -1;
      if (n > 0 && *num_gpus > n) {
        throw UsageError("--num-gpus=" + std::to_string(*num_gpus) + ": host '" + e.host + "' has only " +
                             std::to_string(n) + " slot(s)",
                         "lower --num-gpus or raise the host's slots");
      }
      std::vector<int> first;
      for (int s = 0; s < *num_gpus; ++s) first.push_back(s);
      e.slot_indices = std::move(first);
    }
  }
  if (out.empty()) {
    throw UsageError("--" + std::string(has_include ? "include" : "exclude") + " leaves no host to run on",
                     "check the host names and slot indices");
  }
  return out;
}

std::vector<int> resolve_nproc(const std::vector<HostEntry>& hosts, std::optional<int> nproc_per_node) {
  std::vector<int> out;
  out.reserve(hosts.size());
  for (const auto& e : hosts) {
    if (e.slot_indices) {
      out.push_back(static_cast<int>(e.slot_indices->size()));
    } else if (nproc_per_node) {
      out.push_back(*nproc_per_node);
    } else if (e.slots > 0) {
      out.push_back(e.slots);
    } else {
      out.push_back(1);
    }
  }
  return out;
}

}  // namespace ddprun::launcher
