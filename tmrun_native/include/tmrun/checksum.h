// CRC-32C (Castagnoli) used for frame and state-transfer checksums.
#pragma once
#include <cstddef>
#include <cstdint>

namespace tmrun {

// Extends `crc` (0 for a fresh checksum) over `len` bytes at `data`.
// Uses the CPU's crc32 instruction where there is one (x86-64 with SSE4.2).
uint32_t crc32c(uint32_t crc, const void* data, size_t len) noexcept;

// The same checksum with lookup tables only (every CPU); crc32c() falls back to it.
uint32_t crc32c_portable(uint32_t crc, const void* data, size_t len) noexcept;

// Whether crc32c() uses the CPU's instruction.
bool crc32c_hardware() noexcept;

}  // namespace tmrun
