#pragma once
// --event-log-handler: the agent's events as JSON lines, one object per line, in the layout of
// torch.distributed.elastic.events.Event:
//   {"name": "...", "source": "AGENT"|"WORKER", "timestamp": <unix ms>, "metadata": {...}}
// Handlers (torch's names): "null" (default) and "dynamic_rendezvous" write nothing (torch maps
// both to a NullHandler), "console" writes to stderr; ddprun adds "file:PATH" (appended).
// The events and their metadata are listed in docs/cli.md ("Event log").
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <variant>

namespace ddprun::agent {

using EventValue = std::variant<std::string, std::int64_t>;
using EventFields = std::map<std::string, EventValue>;

class EventLog {
 public:
  // `handler` as accepted by parse_event_log_handler(); a file that cannot be opened throws
  // ddprun::Error naming it.
  explicit EventLog(const std::string& handler);
  ~EventLog();
  EventLog(const EventLog&) = delete;
  EventLog& operator=(const EventLog&) = delete;

  bool enabled() const { return out_ != nullptr; }
  void emit(const std::string& name, const char* source, const EventFields& metadata);

  // One event as the line written (pure; without the newline).
  static std::string format(const std::string& name, const char* source, std::int64_t timestamp_ms,
                            const EventFields& metadata);

 private:
  std::FILE* out_ = nullptr;
  bool owned_ = false;
};

}  // namespace ddprun::agent
