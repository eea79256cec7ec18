#include "tmrun/reduce.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

namespace tmrun {

size_t dtype_size(DType t) noexcept {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kUInt8: return 1;
  }
  return 0;
}

const char* dtype_name(DType t) noexcept {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
  }
  return "?";
}

const char* reduce_op_name(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kProduct: return "product";
  }
  return "?";
}

float half_to_float(uint16_t h) noexcept {
  uint32_t sign = (uint32_t(h) & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        man <<= 1;
      } while ((man & 0x400u) == 0);
      man &= 0x3FFu;
      bits = sign | (uint32_t(127 - 15 - e) << 23) | (man << 13);
    }
  } else if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_half(float f) noexcept {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t absx = x & 0x7FFFFFFFu;
  if (absx >= 0x7F800000u) {  // inf or nan
    return uint16_t(sign | 0x7C00u | (absx > 0x7F800000u ? 0x200u | ((absx >> 13) & 0x3FFu) : 0));
  }
  if (absx >= 0x477FF000u) return uint16_t(sign | 0x7C00u);  // rounds to >= 65520: overflow
  if (absx < 0x38800000u) {                                   // result is subnormal or zero
    if (absx < 0x33000000u) return uint16_t(sign);            // < 2^-25: rounds to zero
    uint32_t e = absx >> 23;
    uint32_t man = (absx & 0x7FFFFFu) | 0x800000u;
    uint32_t shift = 126 - e;  // 14 + (113 - e) - ... gives bits to drop from 24-bit mantissa
    // value = man * 2^(e-150); half subnormal unit = 2^-24 -> q = man * 2^(e-126)
    uint32_t q = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1);
    uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
    return uint16_t(sign | q);
  }
  uint32_t e = (absx >> 23) - 127 + 15;
  uint32_t man = absx & 0x7FFFFFu;
  uint32_t q = (e << 10) | (man >> 13);
  uint32_t rem = man & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) ++q;  // may carry into exponent: correct
  return uint16_t(sign | q);
}

float bf16_to_float(uint16_t h) noexcept {
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_bf16(float f) noexcept {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((x >> 16) | 0x40u);  // quiet NaN
  x += 0x7FFFu + ((x >> 16) & 1u);
  return uint16_t(x >> 16);
}

namespace {

template <typename T>
inline T fmin_nan(T a, T b) {
  if (a != a) return a;
  if (b != b) return b;
  return b < a ? b : a;
}
template <typename T>
inline T fmax_nan(T a, T b) {
  if (a != a) return a;
  if (b != b) return b;
  return b > a ? b : a;
}

template <typename T>
void reduce_native(ReduceOp op, T* out, const T* a, const T* b, size_t n) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      if constexpr (std::is_integral_v<T>) {
        using U = std::make_unsigned_t<T>;
        for (size_t i = 0; i < n; ++i) out[i] = T(U(a[i]) + U(b[i]));
      } else {
        for (size_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
      }
      break;
    case ReduceOp::kProduct:
      if constexpr (std::is_integral_v<T>) {
        using U = std::make_unsigned_t<T>;
        for (size_t i = 0; i < n; ++i) out[i] = T(U(a[i]) * U(b[i]));
      } else {
        for (size_t i = 0; i < n; ++i) out[i] = a[i] * b[i];
      }
      break;
    case ReduceOp::kMin:
      if constexpr (std::is_integral_v<T>) {
        for (size_t i = 0; i < n; ++i) out[i] = b[i] < a[i] ? b[i] : a[i];
      } else {
        for (size_t i = 0; i < n; ++i) out[i] = fmin_nan(a[i], b[i]);
      }
      break;
    case ReduceOp::kMax:
      if constexpr (std::is_integral_v<T>) {
        for (size_t i = 0; i < n; ++i) out[i] = b[i] > a[i] ? b[i] : a[i];
      } else {
        for (size_t i = 0; i < n; ++i) out[i] = fmax_nan(a[i], b[i]);
      }
      break;
  }
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void reduce_half(ReduceOp op, uint16_t* out, const uint16_t* a, const uint16_t* b, size_t n) {
  float fa[256], fb[256];
  for (size_t base = 0; base < n; base += 256) {
    size_t m = n - base < 256 ? n - base : 256;
    for (size_t i = 0; i < m; ++i) {
      fa[i] = ToF(a[base + i]);
      fb[i] = ToF(b[base + i]);
    }
    reduce_native<float>(op, fa, fa, fb, m);
    for (size_t i = 0; i < m; ++i) out[base + i] = FromF(fa[i]);
  }
}

}  // namespace

void reduce(DType t, ReduceOp op, void* out, const void* a, const void* b, size_t n) noexcept {
  switch (t) {
    case DType::kFloat32:
      reduce_native(op, static_cast<float*>(out), static_cast<const float*>(a),
                    static_cast<const float*>(b), n);
      break;
    case DType::kFloat64:
      reduce_native(op, static_cast<double*>(out), static_cast<const double*>(a),
                    static_cast<const double*>(b), n);
      break;
    case DType::kInt32:
      reduce_native(op, static_cast<int32_t*>(out), static_cast<const int32_t*>(a),
                    static_cast<const int32_t*>(b), n);
      break;
    case DType::kInt64:
      reduce_native(op, static_cast<int64_t*>(out), static_cast<const int64_t*>(a),
                    static_cast<const int64_t*>(b), n);
      break;
    case DType::kUInt8:
      reduce_native(op, static_cast<uint8_t*>(out), static_cast<const uint8_t*>(a),
                    static_cast<const uint8_t*>(b), n);
      break;
    case DType::kFloat16:
      reduce_half<half_to_float, float_to_half>(op, static_cast<uint16_t*>(out),
                                                static_cast<const uint16_t*>(a),
                                                static_cast<const uint16_t*>(b), n);
      break;
    case DType::kBFloat16:
      reduce_half<bf16_to_float, float_to_bf16>(op, static_cast<uint16_t*>(out),
                                                static_cast<const uint16_t*>(a),
                                                static_cast<const uint16_t*>(b), n);
      break;
  }
}

void divide(DType t, void* buf, size_t n, int d) noexcept {
  if (d <= 1) return;
  switch (t) {
    case DType::kFloat32: {
      auto* p = static_cast<float*>(buf);
      for (size_t i = 0; i < n; ++i) p[i] = p[i] / float(d);
      break;
    }
    case DType::kFloat64: {
      auto* p = static_cast<double*>(buf);
      for (size_t i = 0; i < n; ++i) p[i] = p[i] / double(d);
      break;
    }
    case DType::kInt32: {
      auto* p = static_cast<int32_t*>(buf);
      for (size_t i = 0; i < n; ++i) p[i] = p[i] / d;
      break;
    }
    case DType::kInt64: {
      auto* p = static_cast<int64_t*>(buf);
      for (size_t i = 0; i < n; ++i) p[i] = p[i] / d;
      break;
    }
    case DType::kUInt8: {
      auto* p = static_cast<uint8_t*>(buf);
      for (size_t i = 0; i < n; ++i) p[i] = uint8_t(p[i] / d);
      break;
    }
    case DType::kFloat16: {
      auto* p = static_cast<uint16_t*>(buf);
      for (size_t i = 0; i < n; ++i) p[i] = float_to_half(half_to_float(p[i]) / float(d));
      break;
    }
    case DType::kBFloat16: {
      auto* p = static_cast<uint16_t*>(buf);
      for (size_t i = 0; i < n; ++i) p[i] = float_to_bf16(bf16_to_float(p[i]) / float(d));
      break;
    }
  }
}

}  // namespace tmrun
