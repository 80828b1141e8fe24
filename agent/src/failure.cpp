// Error-file parsing and the root-cause summary; see failure.hpp.
#include "ddprun/agent/failure.hpp"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <limits>
#include <cstring>
#include <fstream>
#include <sstream>

#include <boost/json.hpp>
#include <ctime>

#include "ddprun/agent/diagnosis.hpp"
#include "ddprun/agent/output.hpp"

namespace json = boost::json;

namespace ddprun::agent {

namespace {

std::optional<std::int64_t> as_int(const json::value& v) {
  if (v.is_int64()) {
    return v.as_int64();
  }
  if (v.is_uint64()) {
    if (v.as_uint64() > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) return std::nullopt;
    return static_cast<std::int64_t>(v.as_uint64());
  }
  if (v.is_string()) {
    // Digits only (no sign, no spaces), and nothing that does not fit: a worker wrote this file.
    const auto& s = v.as_string();
    if (s.empty() || s.front() < '0' || s.front() > '9') return std::nullopt;
    std::int64_t out = 0;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
    if (ec != std::errc() || end != s.data() + s.size()) return std::nullopt;
    return out;
  }
  return std::nullopt;
}

std::string format_time(std::chrono::system_clock::time_point t) {
  const std::time_t tt = std::chrono::system_clock::to_time_t(t);
  std::tm tm{};
  ::localtime_r(&tt, &tm);
  char buf[64];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d_%H:%M:%S", &tm);
  return buf;
}

void append_indented(std::string& out, std::string_view text, std::string_view indent) {
  std::size_t pos = 0;
  bool first = true;
  while (pos < text.size()) {
    auto nl = text.find('\n', pos);
    if (nl == std::string_view::npos) {
      nl = text.size();
    }
    if (!first) {
      out += indent;
    }
    out += text.substr(pos, nl - pos);
    out += '\n';
    first = false;
    pos = nl + 1;
  }
  if (first) {
    out += '\n';
  }
}

void append_report(std::string& out, std::size_t index, std::string_view host, const FailureReport& r) {
  const std::string indent(15, ' ');
  out += "[" + std::to_string(index) + "]:\n";
  out += "  time       : " + format_time(r.time) + "\n";
  out += "  host       : " + (r.host.empty() ? std::string(host) : r.host) + "\n";
  out += "  rank       : " + std::to_string(r.rank) + " (local_rank: " + std::to_string(r.local_rank) + ")\n";
  // pid 0: the failure happened on another node (multi-node summary); its pid is not known here.
  const std::string pid = r.pid > 0 ? "pid: " + std::to_string(r.pid) : std::string("pid: on that node");
  if (r.status.signal != 0) {
    out += "  signal     : " + describe(r.status) + " (" + pid + ", exit code " +
           std::to_string(r.status.shell_code()) + ")\n";
  } else {
    out += "  exitcode   : " + std::to_string(r.status.exit_code) + " (" + pid + ")\n";
  }
  if (r.error) {
    // Empty: the message came from another node (relayed by the rendezvous), not from a file here.
    out += "  error_file : " + (r.error_file.empty() ? std::string("<N/A>") : r.error_file) + "\n";
    out += "  message    : ";
    append_indented(out, r.error->message, indent);
    out += "  traceback  : ";
    append_indented(out, r.error->traceback.empty() ? std::string("<not recorded>") : r.error->traceback, indent);
  } else {
    out += "  error_file : <N/A>\n";
    out += "  traceback  : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html\n";
  }
  if (!r.cause.empty()) {
    out += "  cause      : ";
    append_indented(out, r.cause, indent);
  }
  if (!r.note.empty()) {
    out += "  note       : ";
    append_indented(out, r.note, indent);
  }
}

}  // namespace

std::optional<ErrorFileContents> parse_error_file(std::string_view text, std::string* problem) {
  auto fail = [problem](std::string why) -> std::optional<ErrorFileContents> {
    if (problem != nullptr) {
      *problem = std::move(why);
    }
    return std::nullopt;
  };
  boost::system::error_code ec;
  const json::value root = json::parse(json::string_view(text.data(), text.size()), ec);
  if (ec) {
    return fail("not valid JSON: " + ec.message());
  }
  if (!root.is_object()) {
    return fail("not a JSON object");
  }
  const auto& obj = root.as_object();
  const auto* message = obj.if_contains("message");
  if (message == nullptr) {
    return fail("no \"message\" field");
  }
  ErrorFileContents out;
  if (message->is_string()) {
    out.message = json::value_to<std::string>(*message);
    if (const auto* ts = obj.if_contains("timestamp")) {
      out.timestamp = as_int(*ts);
    }
    return out;
  }
  if (!message->is_object()) {
    return fail("\"message\" is neither a string nor an object");
  }
  const auto& m = message->as_object();
  if (const auto* inner = m.if_contains("message"); inner != nullptr && inner->is_string()) {
    out.message = json::value_to<std::string>(*inner);
  } else {
    return fail("no \"message.message\" string");
  }
  if (const auto* extra = m.if_contains("extraInfo"); extra != nullptr && extra->is_object()) {
    const auto& e = extra->as_object();
    if (const auto* cs = e.if_contains("py_callstack"); cs != nullptr && cs->is_string()) {
      out.traceback = json::value_to<std::string>(*cs);
    }
    if (const auto* ts = e.if_contains("timestamp")) {
      out.timestamp = as_int(*ts);
    }
  }
  return out;
}

std::string format_failure_summary(std::string_view command, std::string_view host, const FailureReport& root,
                                   const std::vector<FailureReport>& others) {
  const std::string rule(60, '=');
  const std::string thin(60, '-');
  std::string out;
  out += rule + "\n";
  out += std::string(command) + " FAILED\n";
  out += thin + "\n";
  out += "Failures:\n";
  if (others.empty()) {
    out += "  <NO_OTHER_FAILURES>\n";
  } else {
    std::size_t i = 1;
    for (const auto& r : others) {
      append_report(out, i++, host, r);
    }
  }
  out += thin + "\n";
  out += "Root Cause (first observed failure):\n";
  append_report(out, 0, host, root);
  if (!root.diagnosis.empty()) {
    out += thin + "\n";
    out += root.diagnosis;
  }
  out += rule + "\n";
  return out;
}

std::string format_diagnosis_block(std::string_view host, std::string_view headline,
                                   const std::vector<std::string>& culprits, const std::vector<std::string>& ranks,
                                   const std::vector<std::string>& files) {
  std::string out = "Diagnosis (" + std::string(host) + "): " + std::string(headline) + "\n";
  for (const auto& c : culprits) out += "  culprit    : " + c + "\n";
  for (const auto& r : ranks) out += "  " + r + "\n";
  for (const auto& f : files) out += "  stacks     : " + f + "\n";
  return out;
}

std::string format_diagnosis_amendment(std::string_view printed, std::string_view now) {
  if (printed.empty() || now == printed) return {};
  const auto lines = [](std::string_view text) {
    std::vector<std::string_view> out;
    while (!text.empty()) {
      const auto nl = text.find('\n');
      out.push_back(text.substr(0, nl));
      text = nl == std::string_view::npos ? std::string_view() : text.substr(nl + 1);
    }
    return out;
  };
  const auto before = lines(printed);
  const auto after = lines(now);
  std::string changed;
  for (const auto line : after) {
    if (std::find(before.begin(), before.end(), line) == before.end()) changed += std::string(line) + "\n";
  }
  if (changed.empty() || after.empty()) return {};
  // "Diagnosis (HOST): headline" -> "Diagnosis (HOST), amended as more ranks ended:"
  std::string_view head = after.front();
  const auto close = head.find("): ");
  const std::string_view host_part =
      close == std::string_view::npos ? std::string_view("Diagnosis") : head.substr(0, close + 1);
  return std::string(host_part) + ", amended as more ranks ended:\n" + changed;
}

void write_launcher_error_file(const std::string& path, const FailureReport* root, const std::string& own_error) {
  if (path.empty()) return;
  std::string text;
  if (root != nullptr && root->error && !root->error_file.empty()) {
    const auto raw = read_worker_file(root->error_file, kMaxErrorFileBytes, 0, false, nullptr, nullptr);
    boost::system::error_code ec;
    json::value v = raw ? json::parse(*raw, ec) : json::value();
    if (raw && !ec && v.is_object()) {
      auto* message = v.as_object().if_contains("message");
      if (message != nullptr && message->is_object()) {
        // torch's exitcode: the code, or minus the signal (multiprocessing's convention).
        message->as_object()["errorCode"] = root->status.signal != 0 ? -root->status.signal : root->status.exit_code;
      }
      text = json::serialize(v);
    }
  }
  if (text.empty() && !own_error.empty()) {
    json::object extra;
    extra["py_callstack"] = "";
    extra["timestamp"] = std::to_string(static_cast<long long>(std::time(nullptr)));
    json::object message;
    message["message"] = own_error;
    message["extraInfo"] = std::move(extra);
    json::object top;
    top["message"] = std::move(message);
    text = json::serialize(top);
  }
  if (text.empty()) return;
  // Replaced, not written through: a link planted at the path must not redirect the write (torch
  // removes the file first too).
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    spdlog::warn("cannot replace TORCHELASTIC_ERROR_FILE={}: {}", path, std::strerror(errno));
    return;
  }
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY, 0644);
  if (fd < 0 || !write_all(fd, text)) {
    spdlog::warn("cannot write the root cause to TORCHELASTIC_ERROR_FILE={}: {}", path, std::strerror(errno));
  }
  if (fd >= 0) ::close(fd);
}

void load_error_file(FailureReport& report) {
  if (report.error_file.empty()) return;
  std::string problem;
  std::size_t size = 0;
  const auto text = read_worker_file(report.error_file, kMaxErrorFileBytes, 0, false, &problem, &size);
  if (!text) {
    if (problem == std::strerror(ENOENT)) return;  // the rank wrote none
  } else if (size > kMaxErrorFileBytes) {
    problem = "it is " + std::to_string(size) + " bytes, over the " + std::to_string(kMaxErrorFileBytes) +
              "-byte read of an error file";
  } else {
    report.error = parse_error_file(*text, &problem);
  }
  if (!report.error) {
    report.note += (report.note.empty() ? "" : "; ") + std::string("error file ") + report.error_file +
                   " could not be used: " + problem;
  }
}

std::string error_file_message(const std::string& path) {
  if (path.empty()) return {};
  std::size_t size = 0;
  const auto text = read_worker_file(path, kMaxErrorFileBytes, 0, false, nullptr, &size);
  if (!text || size > kMaxErrorFileBytes) return {};
  const auto parsed = parse_error_file(*text);
  return parsed ? parsed->message : std::string();
}

}  // namespace ddprun::agent
