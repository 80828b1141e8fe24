// --event-log-handler; see event_log.hpp.
#include "ddprun/agent/event_log.hpp"

#include <boost/json.hpp>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "ddprun/common/error.hpp"

namespace ddprun::agent {

EventLog::EventLog(const std::string& handler) {
  if (handler == "console") {
    out_ = stderr;
  } else if (handler.rfind("file:", 0) == 0) {
    const std::string path = handler.substr(5);
    out_ = std::fopen(path.c_str(), "ae");
    if (out_ == nullptr) {
      throw Error("--event-log-handler file:" + path + ": cannot open it: " + std::strerror(errno),
                  "give a writable file path");
    }
    owned_ = true;
  }
}

EventLog::~EventLog() {
  if (owned_ && out_ != nullptr) std::fclose(out_);
}

std::string EventLog::format(const std::string& name, const char* source, std::int64_t timestamp_ms,
                             const EventFields& metadata) {
  boost::json::object md;
  for (const auto& [k, v] : metadata) {
    if (const auto* s = std::get_if<std::string>(&v)) {
      md[k] = *s;
    } else {
      md[k] = std::get<std::int64_t>(v);
    }
  }
  boost::json::object o;
  o["name"] = name;
  o["source"] = source;
  o["timestamp"] = timestamp_ms;
  o["metadata"] = std::move(md);
  return boost::json::serialize(o);
}

void EventLog::emit(const std::string& name, const char* source, const EventFields& metadata) {
  if (out_ == nullptr) return;
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count();
  const std::string line = format(name, source, ms, metadata) + "\n";
  std::fwrite(line.data(), 1, line.size(), out_);
  std::fflush(out_);
}

}  // namespace ddprun::agent
