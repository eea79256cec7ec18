// CRC-32C (Castagnoli) used for frame and state-transfer checksums.
#pragma once
#include <cstddef>
#include <cstdint>

namespace tmrun {

// Extends `crc` (0 for a fresh checksum) over `len` bytes at `data`.
uint32_t crc32c(uint32_t crc, const void* data, size_t len) noexcept;

}  // namespace tmrun
