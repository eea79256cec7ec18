// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104) for the links' challenge-response; small and
// self-contained (no OpenSSL). Checked against hashlib and the RFC 4231 vectors in
// tests/native/test_auth.py.
#include "tmrun/auth.h"

#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace tmrun {
namespace auth {

namespace {

constexpr uint32_t kK[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

inline uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

class Sha256 {
 public:
  void update(const void* data, size_t len) {
    auto p = static_cast<const uint8_t*>(data);
    total_ += len;
    while (len > 0) {
      size_t take = std::min(len, sizeof(block_) - used_);
      std::memcpy(block_ + used_, p, take);
      used_ += take;
      p += take;
      len -= take;
      if (used_ == sizeof(block_)) {
        compress(block_);
        used_ = 0;
      }
    }
  }
  Digest finish() {
    uint64_t bits = total_ * 8;
    uint8_t pad = 0x80;
    update(&pad, 1);
    uint8_t zero = 0;
    while (used_ != 56) update(&zero, 1);
    uint8_t len_be[8];
    for (int i = 0; i < 8; ++i) len_be[i] = uint8_t(bits >> (56 - 8 * i));
    update(len_be, 8);
    Digest d;
    for (int i = 0; i < 8; ++i)
      for (int j = 0; j < 4; ++j) d[size_t(4 * i + j)] = uint8_t(h_[i] >> (24 - 8 * j));
    return d;
  }

 private:
  void compress(const uint8_t* b) {
    uint32_t w[64];
    for (int i = 0; i < 16; ++i)
      w[i] = uint32_t(b[4 * i]) << 24 | uint32_t(b[4 * i + 1]) << 16 | uint32_t(b[4 * i + 2]) << 8 | b[4 * i + 3];
    for (int i = 16; i < 64; ++i) {
      uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h_[0], bb = h_[1], c = h_[2], d = h_[3], e = h_[4], f = h_[5], g = h_[6], h = h_[7];
    for (int i = 0; i < 64; ++i) {
      uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + kK[i] + w[i];
      uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & bb) ^ (a & c) ^ (bb & c));
      h = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = bb;
      bb = a;
      a = t1 + t2;
    }
    h_[0] += a;
    h_[1] += bb;
    h_[2] += c;
    h_[3] += d;
    h_[4] += e;
    h_[5] += f;
    h_[6] += g;
    h_[7] += h;
  }

  uint32_t h_[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  uint8_t block_[64];
  size_t used_ = 0;
  uint64_t total_ = 0;
};

}  // namespace

Digest sha256(const void* data, size_t len) {
  Sha256 s;
  s.update(data, len);
  return s.finish();
}

Digest hmac_sha256(const void* key, size_t key_len, const void* msg, size_t msg_len) {
  uint8_t k[64] = {0};
  if (key_len > sizeof(k)) {
    Digest kd = sha256(key, key_len);
    std::memcpy(k, kd.data(), kd.size());
  } else if (key_len > 0) {
    std::memcpy(k, key, key_len);
  }
  uint8_t pad[64];
  for (size_t i = 0; i < 64; ++i) pad[i] = k[i] ^ 0x36;
  Sha256 inner;
  inner.update(pad, 64);
  inner.update(msg, msg_len);
  Digest ih = inner.finish();
  for (size_t i = 0; i < 64; ++i) pad[i] = k[i] ^ 0x5c;
  Sha256 outer;
  outer.update(pad, 64);
  outer.update(ih.data(), ih.size());
  return outer.finish();
}

bool equal_ct(const void* a, const void* b, size_t n) {
  auto x = static_cast<const volatile uint8_t*>(a);
  auto y = static_cast<const volatile uint8_t*>(b);
  uint8_t diff = 0;
  for (size_t i = 0; i < n; ++i) diff |= uint8_t(x[i] ^ y[i]);
  return diff == 0;
}

void random_bytes(void* buf, size_t n) {
  auto p = static_cast<uint8_t*>(buf);
  while (n > 0) {
    ssize_t got = ::getrandom(p, n, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error(std::string("getrandom: ") + std::strerror(errno));
    }
    p += got;
    n -= size_t(got);
  }
}

Digest proof(const std::string& token, const char role[4], const uint8_t* nonce_a, const uint8_t* nonce_d) {
  uint8_t msg[sizeof(kLabel) - 1 + 4 + 2 * kNonceSize];
  size_t off = 0;
  std::memcpy(msg + off, kLabel, sizeof(kLabel) - 1);
  off += sizeof(kLabel) - 1;
  std::memcpy(msg + off, role, 4);
  off += 4;
  std::memcpy(msg + off, nonce_a, kNonceSize);
  off += kNonceSize;
  std::memcpy(msg + off, nonce_d, kNonceSize);
  off += kNonceSize;
  return hmac_sha256(token.data(), token.size(), msg, off);
}

}  // namespace auth
}  // namespace tmrun
