// Prometheus text exposition writer (metrics.hpp has the contract).
#include "ddprun/common/metrics.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>

namespace ddprun::metrics {
namespace {

bool valid_name(std::string_view name, bool allow_colon) {
  if (name.empty()) return false;
  for (std::size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (allow_colon && c == ':');
    const bool digit = c >= '0' && c <= '9';
    if (!(alpha || (i > 0 && digit))) return false;
  }
  return true;
}

void check_name(std::string_view name) {
  if (!valid_name(name, true)) throw std::invalid_argument("invalid metric name '" + std::string(name) + "'");
}

void append_escaped(std::string& out, std::string_view text, bool quote) {
  for (char c : text) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (quote && c == '"') {
      out += "\\\"";
    } else {
      out += c;
    }
  }
}

void append_label(std::string& out, const std::pair<std::string, std::string>& label, bool& first) {
  if (!valid_name(label.first, false) || label.first.starts_with("__")) {
    throw std::invalid_argument("invalid label name '" + label.first + "'");
  }
  out += first ? '{' : ',';
  first = false;
  out += label.first;
  out += "=\"";
  append_escaped(out, label.second, true);
  out += '"';
}

}  // namespace

std::string format_value(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  char buf[64];
  if (std::fabs(value) < 1e15 && value == static_cast<double>(static_cast<std::int64_t>(value))) {
    std::snprintf(buf, sizeof buf, "%.0f", value);
    return buf;
  }
  // The shortest spelling that reads back as the same double (0.1, not 0.10000000000000001).
  for (int precision = 15; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*g", precision, value);
    if (std::strtod(buf, nullptr) == value) break;
  }
  return buf;
}

Histogram::Histogram(std::vector<double> upper_bounds) : bounds_(std::move(upper_bounds)) {
  if (!std::is_sorted(bounds_.begin(), bounds_.end()) ||
      std::adjacent_find(bounds_.begin(), bounds_.end()) != bounds_.end() ||
      std::any_of(bounds_.begin(), bounds_.end(), [](double b) { return !std::isfinite(b); })) {
    throw std::invalid_argument("histogram bounds must be finite and strictly ascending");
  }
  counts_.assign(bounds_.size() + 1, 0);
}

void Histogram::observe(double value) {
  const auto it = std::lower_bound(bounds_.begin(), bounds_.end(), value);
  ++counts_[static_cast<std::size_t>(it - bounds_.begin())];
  sum_ += value;
  ++count_;
}

void Exposition::family(std::string_view name, std::string_view help, std::string_view type) {
  check_name(name);
  if (std::find(names_.begin(), names_.end(), name) != names_.end()) {
    throw std::invalid_argument("metric '" + std::string(name) + "' added twice");
  }
  names_.emplace_back(name);
  out_ += "# HELP ";
  out_ += name;
  out_ += ' ';
  append_escaped(out_, help, false);
  out_ += "\n# TYPE ";
  out_ += name;
  out_ += ' ';
  out_ += type;
  out_ += '\n';
}

void Exposition::sample(std::string_view name, std::string_view suffix, const Labels& labels, double value,
                        const std::pair<std::string, std::string>* extra) {
  out_ += name;
  out_ += suffix;
  bool first = true;
  for (const auto& label : labels) append_label(out_, label, first);
  if (extra != nullptr) append_label(out_, *extra, first);
  if (!first) out_ += '}';
  out_ += ' ';
  out_ += format_value(value);
  out_ += '\n';
}

void Exposition::counter(std::string_view name, std::string_view help, const std::vector<Sample>& samples) {
  family(name, help, "counter");
  for (const Sample& s : samples) sample(name, "", s.labels, s.value);
}

void Exposition::gauge(std::string_view name, std::string_view help, const std::vector<Sample>& samples) {
  family(name, help, "gauge");
  for (const Sample& s : samples) sample(name, "", s.labels, s.value);
}

void Exposition::histogram(std::string_view name, std::string_view help, const Histogram& h, const Labels& labels) {
  family(name, help, "histogram");
  std::uint64_t cumulative = 0;
  const auto& counts = h.bucket_counts();
  for (std::size_t i = 0; i < counts.size(); ++i) {
    cumulative += counts[i];
    const std::pair<std::string, std::string> le{
        "le", i < h.upper_bounds().size() ? format_value(h.upper_bounds()[i]) : std::string("+Inf")};
    sample(name, "_bucket", labels, static_cast<double>(cumulative), &le);
  }
  sample(name, "_sum", labels, h.sum());
  sample(name, "_count", labels, static_cast<double>(h.count()));
}

}  // namespace ddprun::metrics
