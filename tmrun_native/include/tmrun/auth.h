// Authentication of native links: SHA-256, HMAC-SHA256 (no OpenSSL), constant-time comparison,
// nonces from the kernel, and the challenge-response messages every link exchanges before its
// first frame when the communicator has a job token (docs/native.md, "Authentication").
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace tmrun {
namespace auth {

using Digest = std::array<uint8_t, 32>;

Digest sha256(const void* data, size_t len);
Digest hmac_sha256(const void* key, size_t key_len, const void* msg, size_t msg_len);
// Compares without an early exit (the time does not depend on where the bytes differ).
bool equal_ct(const void* a, const void* b, size_t n);
// Fills buf from the kernel's random source (getrandom); throws std::runtime_error.
void random_bytes(void* buf, size_t n);

// The handshake (acceptor A, dialer D, token K), before any frame:
//   A -> D  challenge: kChallengeMagic (8 bytes) || nonce_a (32)
//   D -> A  reply:     nonce_d (32) || HMAC(K, kLabel || "dial" || nonce_a || nonce_d)   (then its hello)
//   A -> D  verdict:   1 byte (kVerdictOk, or kVerdictRefused and close) || on ok,
//                      HMAC(K, kLabel || "acpt" || nonce_a || nonce_d)
constexpr char kChallengeMagic[8] = {'T', 'M', 'R', 'A', 'U', 'T', 'H', '1'};
constexpr char kLabel[] = "tmrun-auth-v1";
constexpr size_t kNonceSize = 32;
constexpr size_t kChallengeSize = 8 + kNonceSize;
constexpr size_t kReplySize = kNonceSize + 32;
constexpr size_t kVerdictSize = 1 + 32;
constexpr uint8_t kVerdictOk = 0, kVerdictRefused = 1;

// The proof of `role` ("dial" or "acpt") for the two nonces.
Digest proof(const std::string& token, const char role[4], const uint8_t* nonce_a, const uint8_t* nonce_d);

}  // namespace auth
}  // namespace tmrun
