#include "tmrun/frame.h"

#include <cstring>

#include "tmrun/checksum.h"

namespace tmrun {
namespace {

void put16(uint8_t* p, uint16_t v) { p[0] = uint8_t(v); p[1] = uint8_t(v >> 8); }
void put32(uint8_t* p, uint32_t v) { for (int i = 0; i < 4; ++i) p[i] = uint8_t(v >> (8 * i)); }
void put64(uint8_t* p, uint64_t v) { for (int i = 0; i < 8; ++i) p[i] = uint8_t(v >> (8 * i)); }
uint16_t get16(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }
uint32_t get32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
uint64_t get64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

uint64_t job_hash(const std::string& job_id) noexcept {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : job_id) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h == 0 ? 1 : h;  // 0 means "do not check"
}

const char* frame_type_name(FrameType t) noexcept {
  switch (t) {
    case FrameType::kData: return "data";
    case FrameType::kHello: return "hello";
    case FrameType::kHelloAck: return "hello_ack";
    case FrameType::kHeartbeat: return "heartbeat";
    case FrameType::kAbort: return "abort";
    case FrameType::kSync: return "sync";
    case FrameType::kReject: return "reject";
    case FrameType::kGoodbye: return "goodbye";
  }
  return "unknown";
}

void encode_header(const FrameHeader& h, uint8_t* out) noexcept {
  put32(out + 0, kFrameMagic);
  put16(out + 4, h.version);
  put16(out + 6, h.flags);
  out[8] = static_cast<uint8_t>(h.type);
  out[9] = out[10] = out[11] = 0;
  put32(out + 12, h.tag);
  put64(out + 16, h.job_hash);
  put64(out + 24, h.epoch);
  put64(out + 32, h.seq);
  put64(out + 40, h.length);
  put32(out + 48, h.payload_crc);
  put32(out + 52, crc32c(0, out, 52));
}

bool parse_header(const uint8_t* d, size_t len, uint64_t expected_job_hash, FrameHeader* out,
                  std::string* error) noexcept {
  auto fail = [&](const char* why) {
    if (error) *error = why;
    return false;
  };
  if (d == nullptr || len < kHeaderSize) return fail("truncated header");
  if (get32(d) != kFrameMagic) return fail("bad magic");
  FrameHeader h;
  h.version = get16(d + 4);
  h.flags = get16(d + 6);
  uint8_t type = d[8];
  h.tag = get32(d + 12);
  h.job_hash = get64(d + 16);
  h.epoch = get64(d + 24);
  h.seq = get64(d + 32);
  h.length = get64(d + 40);
  h.payload_crc = get32(d + 48);
  h.header_crc = get32(d + 52);
  if (crc32c(0, d, 52) != h.header_crc) return fail("header checksum mismatch");
  if (h.version != kWireVersion) return fail("unsupported wire version");
  if (d[9] != 0 || d[10] != 0 || d[11] != 0) return fail("reserved bytes not zero");
  if ((h.flags & ~kKnownFlags) != 0) return fail("unknown flags");
  if (type < static_cast<uint8_t>(FrameType::kData) || type > static_cast<uint8_t>(FrameType::kGoodbye))
    return fail("unknown frame type");
  h.type = static_cast<FrameType>(type);
  if (h.length > kMaxFrameLength) return fail("frame length too large");
  if ((h.type == FrameType::kHeartbeat || h.type == FrameType::kAbort || h.type == FrameType::kSync) &&
      h.length != 0)
    return fail("control frame with payload");
  if ((h.type == FrameType::kHello || h.type == FrameType::kHelloAck) && h.length != kHelloSize)
    return fail("bad hello length");
  if (h.type == FrameType::kReject && h.length > 4096) return fail("reject reason too long");
  if (h.type == FrameType::kGoodbye && h.length != 0) return fail("goodbye with a payload");
  if ((h.flags & kFlagPayloadCrc) == 0 && h.payload_crc != 0) return fail("payload crc set without flag");
  if (expected_job_hash != 0 && h.job_hash != expected_job_hash) return fail("foreign job");
  *out = h;
  return true;
}

void encode_hello(const HelloBody& b, uint8_t* out) noexcept {
  put32(out, b.from_rank);
  put32(out + 4, b.to_rank);
  put32(out + 8, b.world_size);
}

HelloBody decode_hello(const uint8_t* in) noexcept {
  HelloBody b;
  b.from_rank = get32(in);
  b.to_rank = get32(in + 4);
  b.world_size = get32(in + 8);
  return b;
}

}  // namespace tmrun
