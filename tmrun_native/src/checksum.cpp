#include "tmrun/checksum.h"

#include <array>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TMRUN_CRC_HW 1
#include <nmmintrin.h>
#endif

namespace tmrun {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

struct Tables {
  std::array<std::array<uint32_t, 256>, 8> t{};
  constexpr Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ kPoly : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFFu];
    }
  }
};

constexpr Tables kTables{};

}  // namespace

#ifdef TMRUN_CRC_HW
namespace {

// SSE4.2's crc32 instruction computes CRC-32C; three independent streams hide its 3-cycle
// latency. The three partial CRCs are joined by shifting the first two over the bytes that
// follow them (multiplication by x^(8n) mod P, done with the slice tables).
__attribute__((target("sse4.2"))) uint32_t crc_hw_stream(uint32_t c, const unsigned char* p, size_t len) {
  while (len >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = static_cast<uint32_t>(_mm_crc32_u64(c, word));
    p += 8;
    len -= 8;
  }
  while (len--) c = _mm_crc32_u8(c, *p++);
  return c;
}

// a * b mod P, polynomials in the reflected bit order (bit 31 is x^0), as in zlib's crc32_combine
uint32_t multiply_mod_p(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t m = 1u << 31; m; m >>= 1) {
    if (a & m) product ^= b;
    b = (b & 1u) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return product;
}

// x^(8 * len) mod P: multiplying a CRC register by it feeds `len` zero bytes through it.
uint32_t zero_bytes_operator(size_t len) {
  uint32_t power = 1u << 23;  // x^8, one zero byte
  uint32_t result = 1u << 31;  // x^0
  for (size_t n = len; n; n >>= 1) {
    if (n & 1u) result = multiply_mod_p(result, power);
    power = multiply_mod_p(power, power);
  }
  return result;
}

constexpr size_t kBlock = 8192;  // bytes per stream per round of crc_hw
const uint32_t kSkipBlock = zero_bytes_operator(kBlock);

__attribute__((target("sse4.2"))) uint32_t crc_hw(uint32_t crc, const unsigned char* p, size_t len) {
  uint32_t c = ~crc;
  while (len >= 3 * kBlock) {
    uint32_t a = c, b = 0, d = 0;
    for (size_t i = 0; i < kBlock; i += 8) {
      uint64_t wa, wb, wd;
      std::memcpy(&wa, p + i, 8);
      std::memcpy(&wb, p + kBlock + i, 8);
      std::memcpy(&wd, p + 2 * kBlock + i, 8);
      a = static_cast<uint32_t>(_mm_crc32_u64(a, wa));
      b = static_cast<uint32_t>(_mm_crc32_u64(b, wb));
      d = static_cast<uint32_t>(_mm_crc32_u64(d, wd));
    }
    c = multiply_mod_p(multiply_mod_p(a, kSkipBlock) ^ b, kSkipBlock) ^ d;
    p += 3 * kBlock;
    len -= 3 * kBlock;
  }
  return ~crc_hw_stream(c, p, len);
}

const bool kHaveSse42 = [] {
  __builtin_cpu_init();  // this runs among the library's static initialisers
  return __builtin_cpu_supports("sse4.2") != 0;
}();

}  // namespace
#endif

uint32_t crc32c(uint32_t crc, const void* data, size_t len) noexcept {
#ifdef TMRUN_CRC_HW
  if (kHaveSse42) return crc_hw(crc, static_cast<const unsigned char*>(data), len);
#endif
  return crc32c_portable(crc, data, len);
}

bool crc32c_hardware() noexcept {
#ifdef TMRUN_CRC_HW
  return kHaveSse42;
#else
  return false;
#endif
}

uint32_t crc32c_portable(uint32_t crc, const void* data, size_t len) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
  while (len >= 8) {  // slice-by-8
    uint64_t word;
    std::memcpy(&word, p, 8);
    word ^= c;
    c = kTables.t[7][word & 0xFF] ^ kTables.t[6][(word >> 8) & 0xFF] ^
        kTables.t[5][(word >> 16) & 0xFF] ^ kTables.t[4][(word >> 24) & 0xFF] ^
        kTables.t[3][(word >> 32) & 0xFF] ^ kTables.t[2][(word >> 40) & 0xFF] ^
        kTables.t[1][(word >> 48) & 0xFF] ^ kTables.t[0][(word >> 56) & 0xFF];
    p += 8;
    len -= 8;
  }
  while (len--) c = (c >> 8) ^ kTables.t[0][(c ^ *p++) & 0xFFu];
  return ~c;
}

}  // namespace tmrun
