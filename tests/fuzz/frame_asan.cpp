// The wire-frame parser (tmrun_native/src/frame.cpp) under AddressSanitizer and
// UndefinedBehaviorSanitizer: random bytes, mutated valid frames and every prefix of valid
// frames, each in a heap buffer of exactly its size (a read past the end hits a redzone).
// Checks what parse_header promises: a refusal has a reason; an accepted header is
// self-consistent; a valid frame's prefix is refused below the header size and parses to the
// same fields from there. Usage: frame_asan [iterations] [seed]; prints counts; aborts on a finding.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tmrun/frame.h"

namespace {

uint64_t state = 0x9E3779B97F4A7C15ull;
uint64_t next() {
  state ^= state << 13;
  state ^= state >> 7;
  state ^= state << 17;
  return state;
}
size_t below(size_t n) { return n ? size_t(next() % n) : 0; }

[[noreturn]] void finding(const char* what, size_t i) {
  std::fprintf(stderr, "FINDING at iteration %zu: %s\n", i, what);
  std::abort();
}

bool parse(const std::vector<uint8_t>& in, uint64_t job, tmrun::FrameHeader* h, std::string* err) {
  // exactly-sized heap copy: any read past len is an ASan report
  uint8_t* buf = in.empty() ? nullptr : new uint8_t[in.size()];
  if (buf) std::memcpy(buf, in.data(), in.size());
  bool ok = tmrun::parse_header(buf, in.size(), job, h, err);
  delete[] buf;
  return ok;
}

std::vector<uint8_t> valid_frame(uint64_t job, tmrun::FrameHeader* out) {
  tmrun::FrameHeader h;
  static const uint8_t kinds[] = {1, 2, 3, 4, 5, 6, 7};
  h.type = static_cast<tmrun::FrameType>(kinds[below(7)]);
  h.tag = uint32_t(next());
  h.job_hash = job;
  h.epoch = next() >> below(64);
  h.seq = next() >> below(64);
  size_t len = 0;
  if (h.type == tmrun::FrameType::kData) len = below(300);
  if (h.type == tmrun::FrameType::kHello || h.type == tmrun::FrameType::kHelloAck) len = tmrun::kHelloSize;
  if (h.type == tmrun::FrameType::kReject) len = below(16) ? below(300) : below(4097);
  h.length = len;
  std::vector<uint8_t> f(tmrun::kHeaderSize + len);
  for (size_t i = 0; i < len; ++i) f[tmrun::kHeaderSize + i] = uint8_t(next());
  tmrun::encode_header(h, f.data());
  *out = h;
  return f;
}

void check_accepted(const tmrun::FrameHeader& h, size_t i) {
  using tmrun::FrameType;
  if (h.version != tmrun::kWireVersion) finding("accepted a foreign version", i);
  if (uint8_t(h.type) < 1 || uint8_t(h.type) > 7) finding("accepted an unknown type", i);
  if (h.length > tmrun::kMaxFrameLength) finding("accepted a length beyond the bound", i);
  if ((h.flags & ~tmrun::kKnownFlags) != 0) finding("accepted unknown flags", i);
  if ((h.type == FrameType::kHeartbeat || h.type == FrameType::kAbort || h.type == FrameType::kSync) && h.length)
    finding("accepted a control frame with a payload", i);
  if ((h.type == FrameType::kHello || h.type == FrameType::kHelloAck) && h.length != tmrun::kHelloSize)
    finding("accepted a hello of the wrong size", i);
}

}  // namespace

int main(int argc, char** argv) {
  size_t iterations = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 200000;
  if (argc > 2) state ^= std::strtoull(argv[2], nullptr, 10) * 0x2545F4914F6CDD1Dull;
  const uint64_t job = tmrun::job_hash("job");
  size_t accepted = 0, refused = 0, prefixes = 0;
  for (size_t i = 0; i < iterations; ++i) {
    tmrun::FrameHeader h, want;
    std::string err;
    std::vector<uint8_t> in;
    switch (i % 4) {
      case 0: {  // random bytes around the header size
        in.resize(below(130));
        for (auto& b : in) b = uint8_t(next());
        if (in.size() >= 4 && below(2)) std::memcpy(in.data(), "TMRN", 4);
        break;
      }
      case 1:  // a valid frame with a few bytes changed, cut or extended
      case 2: {
        in = valid_frame(job, &want);
        for (size_t k = 0, n = 1 + below(4); k < n; ++k) {
          size_t op = below(3);
          if (op == 0 && !in.empty()) in[below(in.size())] ^= uint8_t(1u << below(8));
          if (op == 1) in.resize(below(in.size() + 1));
          if (op == 2) in.push_back(uint8_t(next()));
        }
        break;
      }
      default: {  // every prefix of a valid frame
        in = valid_frame(job, &want);
        for (size_t cut = 0; cut <= in.size(); ++cut, ++prefixes) {
          std::vector<uint8_t> part(in.begin(), in.begin() + long(cut));
          std::string e;
          bool ok = parse(part, job, &h, &e);
          if (cut < tmrun::kHeaderSize) {
            if (ok || e.empty()) finding("a prefix shorter than the header parsed, or no reason", i);
          } else if (!ok || h.type != want.type || h.tag != want.tag || h.epoch != want.epoch ||
                     h.seq != want.seq || h.length != want.length || h.job_hash != want.job_hash) {
            finding("a valid frame's prefix parsed differently", i);
          }
        }
        if (parse(in, job ^ 1, &h, &err)) finding("accepted a foreign job", i);
        continue;
      }
    }
    uint64_t expect = (i & 8) ? job : 0;
    bool ok = parse(in, expect, &h, &err);
    if (ok) {
      ++accepted;
      check_accepted(h, i);
      if (expect && h.job_hash != expect) finding("accepted a foreign job hash", i);
    } else {
      ++refused;
      if (err.empty()) finding("refused without a reason", i);
    }
    tmrun::parse_header(in.data(), in.size(), 0, &h, nullptr);  // a null error pointer is allowed
  }
  std::printf("iterations %zu accepted %zu refused %zu prefixes %zu\n", iterations, accepted, refused, prefixes);
  return 0;
}
