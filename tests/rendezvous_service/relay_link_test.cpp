// Relay link frames (relay_link.hpp): round trip, incremental decoding, and every refusal.
#include <catch2/catch.hpp>
#include <string>

#include "ddprun/rendezvous/relay_link.hpp"
#include "ddprun/rendezvous/rendezvous_wire.hpp"

namespace rdzv = ddprun::rendezvous;
using Status = rdzv::RelayDecodeResult::Status;

namespace {

std::string header(std::uint8_t op, std::uint32_t vid, std::uint32_t length) {
  std::string h;
  h.push_back(static_cast<char>(op));
  for (int i = 0; i < 4; ++i) h.push_back(static_cast<char>((vid >> (8 * i)) & 0xff));
  for (int i = 0; i < 4; ++i) h.push_back(static_cast<char>((length >> (8 * i)) & 0xff));
  return h;
}

}  // namespace

TEST_CASE("relay frames round-trip and decode one at a time", "[relay]") {
  std::string wire;
  rdzv::append_relay_frame(wire, rdzv::RelayOp::open, 7, "10.0.0.1:4242");
  rdzv::append_relay_frame(wire, rdzv::RelayOp::data, 7, std::string("\x48\0\0\0\0", 5));
  rdzv::append_relay_frame(wire, rdzv::RelayOp::close, 0xfffffffe, "");
  CHECK(wire.substr(0, 9) == header(0x70, 7, 13));

  rdzv::RelayFrame f;
  std::string_view rest(wire);
  auto r = rdzv::decode_relay_frame(rest, f);
  REQUIRE(r.status == Status::ok);
  CHECK(f.op == rdzv::RelayOp::open);
  CHECK(f.vid == 7);
  CHECK(f.payload == "10.0.0.1:4242");
  rest.remove_prefix(r.consumed);
  r = rdzv::decode_relay_frame(rest, f);
  REQUIRE(r.status == Status::ok);
  CHECK(f.op == rdzv::RelayOp::data);
  CHECK(f.payload.size() == 5);
  rest.remove_prefix(r.consumed);
  r = rdzv::decode_relay_frame(rest, f);
  REQUIRE(r.status == Status::ok);
  CHECK(f.op == rdzv::RelayOp::close);
  CHECK(f.vid == 0xfffffffe);
  CHECK(f.payload.empty());
  CHECK(r.consumed == rest.size());
}

TEST_CASE("a partial relay frame asks for the bytes it needs", "[relay]") {
  std::string wire;
  rdzv::append_relay_frame(wire, rdzv::RelayOp::data, 3, std::string(100, 'x'));
  rdzv::RelayFrame f;
  auto r = rdzv::decode_relay_frame(std::string_view(wire).substr(0, 4), f);
  CHECK(r.status == Status::need_more);
  CHECK(r.min_total == rdzv::relay_header_bytes);
  r = rdzv::decode_relay_frame(std::string_view(wire).substr(0, 50), f);
  CHECK(r.status == Status::need_more);
  CHECK(r.min_total == 109);
  CHECK(rdzv::decode_relay_frame(std::string_view(), f).status == Status::need_more);
}

TEST_CASE("malformed relay frames are refused from their header", "[relay]") {
  rdzv::RelayFrame f;
  SECTION("unknown op, even before the header is complete") {
    auto r = rdzv::decode_relay_frame(std::string("\x7f", 1), f);
    CHECK(r.status == Status::error);
    CHECK(r.reason.find("0x7f") != std::string::npos);
    CHECK(rdzv::decode_relay_frame(header(0x40, 1, 0), f).status == Status::error);
  }
  SECTION("connection number 0") {
    auto r = rdzv::decode_relay_frame(header(0x71, 0, 1) + "x", f);
    CHECK(r.status == Status::error);
    CHECK(r.reason.find("connection 0") != std::string::npos);
  }
  SECTION("oversized payloads, before the payload arrives") {
    auto r = rdzv::decode_relay_frame(header(0x71, 1, (1u << 20) + 1), f);
    CHECK(r.status == Status::error);
    CHECK(r.reason.find("1048577") != std::string::npos);
    CHECK(rdzv::decode_relay_frame(header(0x70, 1, 257), f).status == Status::error);
    CHECK(rdzv::decode_relay_frame(header(0x72, 1, 1025), f).status == Status::error);
    CHECK(rdzv::decode_relay_frame(header(0x73, 1, 1), f).status == Status::error);  // TRUSTED carries nothing
    CHECK(rdzv::decode_relay_frame(header(0x74, 1, 0), f).status == Status::error);
  }
  SECTION("an empty DATA") { CHECK(rdzv::decode_relay_frame(header(0x71, 1, 0), f).status == Status::error); }
  SECTION("limits themselves are accepted") {
    CHECK(rdzv::decode_relay_frame(header(0x70, 1, 256), f).status == Status::need_more);
    CHECK(rdzv::decode_relay_frame(header(0x71, 1, 1u << 20), f).status == Status::need_more);
    CHECK(rdzv::decode_relay_frame(header(0x72, 1, 0), f).status == Status::ok);
    CHECK(rdzv::decode_relay_frame(header(0x73, 7, 0), f).status == Status::ok);
    CHECK(f.op == rdzv::RelayOp::trusted);
    CHECK(f.vid == 7);
  }
}

TEST_CASE("RELAY asks for TRUSTED frames and RELAY_OK answers", "[relay]") {
  std::string out;
  rdzv::encode_client(out, rdzv::RelayMessage{1, true});
  rdzv::ClientMessage m;
  REQUIRE(rdzv::decode_client(out, rdzv::WireLimits{}, m).status == rdzv::DecodeStatus::ok);
  CHECK(std::get<rdzv::RelayMessage>(m).trusted_frames);
  out.clear();
  rdzv::encode_client(out, rdzv::RelayMessage{});
  REQUIRE(rdzv::decode_client(out, rdzv::WireLimits{}, m).status == rdzv::DecodeStatus::ok);
  CHECK_FALSE(std::get<rdzv::RelayMessage>(m).trusted_frames);  // an older relay: none are sent
  out.clear();
  rdzv::encode_relay_ok(out, true);
  CHECK(rdzv::relay_ok_trusted_frames(out));
  out.clear();
  rdzv::encode_relay_ok(out);
  CHECK(out.substr(rdzv::native_header_bytes) == "{}");  // what an older daemon sends
  CHECK_FALSE(rdzv::relay_ok_trusted_frames(out));
  CHECK_FALSE(rdzv::relay_ok_trusted_frames("garbage"));
}
