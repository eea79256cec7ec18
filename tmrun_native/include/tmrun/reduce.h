// Element types and reduction kernels of the tmrun communicator (no torch dependency).
#pragma once
#include <cstddef>
#include <cstdint>

namespace tmrun {

enum class DType : uint8_t { kFloat32 = 0, kFloat64, kFloat16, kBFloat16, kInt32, kInt64, kUInt8 };
enum class ReduceOp : uint8_t { kSum = 0, kAvg, kMin, kMax, kProduct };

size_t dtype_size(DType t) noexcept;
const char* dtype_name(DType t) noexcept;
const char* reduce_op_name(ReduceOp op) noexcept;

// out[i] = a[i] (op) b[i] for `count` elements; `out` may alias `a` or `b`.
// kAvg reduces like kSum (the division is applied once at the end, see divide()).
// float16/bfloat16 are widened to float, combined, and rounded back to nearest-even.
// min/max propagate NaN. Integer sum/product wrap around (two's complement).
void reduce(DType t, ReduceOp op, void* out, const void* a, const void* b, size_t count) noexcept;

// buf[i] /= n (integers: truncating division; halves through float, round to nearest-even).
void divide(DType t, void* buf, size_t count, int n) noexcept;

float half_to_float(uint16_t h) noexcept;
uint16_t float_to_half(float f) noexcept;
float bf16_to_float(uint16_t h) noexcept;
uint16_t float_to_bf16(float f) noexcept;

}  // namespace tmrun
