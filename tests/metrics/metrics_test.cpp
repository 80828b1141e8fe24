// The Prometheus exposition writer: HELP/TYPE lines, label escaping, value spelling, cumulative
// histogram buckets ending at +Inf, and the refusal of invalid names (programmer errors).
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>

#include "ddprun/common/metrics.hpp"
#include "ddprun/rendezvous/rendezvous_metrics.hpp"
#include "ddprun/rendezvous/store_server.hpp"

using namespace ddprun::metrics;

TEST_CASE("values are spelled as the text format wants") {
  CHECK(format_value(0) == "0");
  CHECK(format_value(42) == "42");
  CHECK(format_value(-3) == "-3");
  CHECK(format_value(0.25) == "0.25");
  CHECK(format_value(std::numeric_limits<double>::infinity()) == "+Inf");
  CHECK(format_value(-std::numeric_limits<double>::infinity()) == "-Inf");
  CHECK(format_value(std::nan("")) == "NaN");
}

TEST_CASE("counters and gauges get one HELP and TYPE line and escaped labels") {
  Exposition out;
  out.counter("x_total", "Things\\done\nhere.", {Sample{{{"a", "q\"b\\c\nd"}}, 2}, Sample{{{"a", "e"}}, 0}});
  out.gauge("g", "A gauge.", 1.5);
  CHECK(out.text() ==
        "# HELP x_total Things\\\\done\\nhere.\n# TYPE x_total counter\n"
        "x_total{a=\"q\\\"b\\\\c\\nd\"} 2\nx_total{a=\"e\"} 0\n"
        "# HELP g A gauge.\n# TYPE g gauge\ng 1.5\n");
}

TEST_CASE("histograms are cumulative and end at +Inf") {
  Histogram h({0.25, 1, 10});
  h.observe(0.125);
  h.observe(1);  // on a bound: that bucket (le is <=)
  h.observe(5);
  h.observe(100);
  Exposition out;
  out.histogram("lat_seconds", "Latency.", h, {{"job", "a"}});
  CHECK(out.text() ==
        "# HELP lat_seconds Latency.\n# TYPE lat_seconds histogram\n"
        "lat_seconds_bucket{job=\"a\",le=\"0.25\"} 1\n"
        "lat_seconds_bucket{job=\"a\",le=\"1\"} 2\n"
        "lat_seconds_bucket{job=\"a\",le=\"10\"} 3\n"
        "lat_seconds_bucket{job=\"a\",le=\"+Inf\"} 4\n"
        "lat_seconds_sum{job=\"a\"} 106.125\n"
        "lat_seconds_count{job=\"a\"} 4\n");
}

TEST_CASE("invalid names and bounds are refused") {
  Exposition out;
  CHECK_THROWS_AS(out.gauge("1bad", "x", 1), std::invalid_argument);
  CHECK_THROWS_AS(out.gauge("bad-name", "x", 1), std::invalid_argument);
  CHECK_THROWS_AS(out.gauge("ok", "x", {Sample{{{"bad-label", "v"}}, 1}}), std::invalid_argument);
  CHECK_THROWS_AS(out.gauge("ok2", "x", {Sample{{{"__reserved", "v"}}, 1}}), std::invalid_argument);
  out.gauge("once", "x", 1);
  CHECK_THROWS_AS(out.gauge("once", "x", 1), std::invalid_argument);
  CHECK_THROWS_AS(Histogram({1, 1}), std::invalid_argument);
  CHECK_THROWS_AS(Histogram({2, 1}), std::invalid_argument);
  CHECK_THROWS_AS(Histogram({1, std::numeric_limits<double>::infinity()}), std::invalid_argument);
}

TEST_CASE("refused connection reasons have fixed names") {
  using ddprun::rendezvous::refused_reason_name;
  using ddprun::rendezvous::RefusedReason;
  CHECK(refused_reason_name(RefusedReason::connection_limit) == "connection_limit");
  CHECK(refused_reason_name(RefusedReason::peer_limit) == "peer_limit");
  CHECK(refused_reason_name(RefusedReason::out_of_descriptors) == "out_of_descriptors");
  CHECK(refused_reason_name(RefusedReason::protocol_error) == "protocol_error");
  CHECK(refused_reason_name(RefusedReason::buffer_limit) == "buffer_limit");
  CHECK(refused_reason_name(RefusedReason::timeout) == "timeout");
  CHECK(refused_reason_name(RefusedReason::unauthenticated) == "unauthenticated");
  CHECK(refused_reason_name(RefusedReason::wait_limit) == "wait_limit");
  CHECK(static_cast<std::size_t>(RefusedReason::wait_limit) + 1 == ddprun::rendezvous::kRefusedReasons);
}
