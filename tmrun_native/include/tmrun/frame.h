// Wire format of the tmrun TCP transport.
//
// Every message on a link is a frame: a fixed 56-byte little-endian header followed by
// `length` payload bytes.
//
//   offset size field
//        0    4 magic        'TMRN' (0x4E524D54 read as little-endian u32)
//        4    2 version      kWireVersion
//        6    2 flags        bit 0: payload_crc is valid (CRC-32C of the payload)
//        8    1 type         FrameType
//        9    3 reserved     must be zero
//       12    4 tag          data: collective id / p2p tag; abort: lost rank
//       16    8 job_hash     FNV-1a 64 of the job id
//       24    8 epoch        membership epoch of the sender
//       32    8 seq          per-link, per-direction frame counter (starts at 1 after handshake)
//       40    8 length       payload bytes
//       48    4 payload_crc  CRC-32C of the payload when flags bit 0 is set, else 0
//       52    4 header_crc   CRC-32C of bytes [0, 52)
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace tmrun {

constexpr uint32_t kFrameMagic = 0x4E524D54u;  // "TMRN"
constexpr uint16_t kWireVersion = 1;
constexpr size_t kHeaderSize = 56;
constexpr uint64_t kMaxFrameLength = 1ull << 30;  // 1 GiB: anything larger is malformed
constexpr uint16_t kFlagPayloadCrc = 1u;
constexpr uint16_t kKnownFlags = kFlagPayloadCrc;

enum class FrameType : uint8_t {
  kData = 1,
  kHello = 2,      // dialer -> acceptor: payload HelloBody
  kHelloAck = 3,   // acceptor -> dialer: payload HelloBody
  kHeartbeat = 4,  // liveness, no payload
  kAbort = 5,      // the collective failed: `tag` is the rank that was lost
  kSync = 6,       // epoch switch marker (commit / connect)
  kReject = 7,     // handshake refused; payload is a reason string
  kGoodbye = 8,    // the sender closed its communicator (a clean leave), no payload
};

struct FrameHeader {
  uint16_t version = kWireVersion;
  uint16_t flags = 0;
  FrameType type = FrameType::kData;
  uint32_t tag = 0;
  uint64_t job_hash = 0;
  uint64_t epoch = 0;
  uint64_t seq = 0;
  uint64_t length = 0;
  uint32_t payload_crc = 0;
  uint32_t header_crc = 0;
};

// Payload of kHello / kHelloAck.
struct HelloBody {
  uint32_t from_rank = 0;
  uint32_t to_rank = 0;
  uint32_t world_size = 0;
};
constexpr size_t kHelloSize = 12;

uint64_t job_hash(const std::string& job_id) noexcept;
const char* frame_type_name(FrameType t) noexcept;

// Writes a header (computing header_crc) into out[kHeaderSize].
void encode_header(const FrameHeader& h, uint8_t* out) noexcept;

// Parses and validates a header: magic, version, reserved bits, flags, type, length bound,
// header CRC and (when expected_job_hash != 0) the job hash. Returns false with `*error` set
// when the bytes are not a valid header. Never reads past `len`.
bool parse_header(const uint8_t* data, size_t len, uint64_t expected_job_hash, FrameHeader* out,
                  std::string* error) noexcept;

void encode_hello(const HelloBody& b, uint8_t* out) noexcept;
HelloBody decode_hello(const uint8_t* in) noexcept;

}  // namespace tmrun
