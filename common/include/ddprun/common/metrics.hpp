#pragma once
// Prometheus text exposition (format version 0.0.4), pure: the caller lists its metric
// families (counters, gauges, histograms) with their samples and gets the text a scrape
// answers. Nothing here keeps state between scrapes except Histogram, which owns its bucket
// counts. Names must match [a-zA-Z_:][a-zA-Z0-9_:]* and label names [a-zA-Z_][a-zA-Z0-9_]*
// (programmer errors: they throw std::invalid_argument); label values and HELP texts are
// escaped as the format requires. Each family gets one HELP and one TYPE line, in the order
// the caller adds them. Not thread-safe.
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ddprun::metrics {

using Labels = std::vector<std::pair<std::string, std::string>>;

struct Sample {
  Labels labels;
  double value = 0;
};

// A histogram with fixed upper bounds (ascending, finite; +Inf is implied). observe() puts a
// value in the first bucket whose bound is >= the value, like Prometheus' client libraries.
class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void observe(double value);
  const std::vector<double>& upper_bounds() const { return bounds_; }
  // Per-bucket (not cumulative) counts; one more than upper_bounds(): the last is +Inf.
  const std::vector<std::uint64_t>& bucket_counts() const { return counts_; }
  double sum() const { return sum_; }
  std::uint64_t count() const { return count_; }

 private:
  std::vector<double> bounds_;
  std::vector<std::uint64_t> counts_;
  double sum_ = 0;
  std::uint64_t count_ = 0;
};

class Exposition {
 public:
  void counter(std::string_view name, std::string_view help, const std::vector<Sample>& samples);
  void counter(std::string_view name, std::string_view help, double value) { counter(name, help, {Sample{{}, value}}); }
  void gauge(std::string_view name, std::string_view help, const std::vector<Sample>& samples);
  void gauge(std::string_view name, std::string_view help, double value) { gauge(name, help, {Sample{{}, value}}); }
  void histogram(std::string_view name, std::string_view help, const Histogram& h, const Labels& labels = {});

  const std::string& text() const { return out_; }

 private:
  void family(std::string_view name, std::string_view help, std::string_view type);
  void sample(std::string_view name, std::string_view suffix, const Labels& labels, double value,
              const std::pair<std::string, std::string>* extra = nullptr);
  std::string out_;
  std::vector<std::string> names_;
};

// The value as the format spells it: integers without a fraction, +Inf, -Inf, NaN.
std::string format_value(double value);

}  // namespace ddprun::metrics
