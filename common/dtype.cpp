#include "common/dtype.h"

#include <cstring>
#include <vector>

namespace strata {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
  }
  return "?";
}

bool parse_dtype(std::string_view name, DType* out) {
  if (name == "f32" || name == "fp32" || name == "float32") { *out = DType::kF32; return true; }
  if (name == "bf16" || name == "bfloat16") { *out = DType::kBF16; return true; }
  if (name == "f16" || name == "fp16" || name == "float16") { *out = DType::kF16; return true; }
  return false;
}

uint16_t f32_to_f16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;  // NaN -> quiet NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: overflow to inf (and inf itself)
  if (abs >= 0x38800000u) {                        // normal f16 (>= 2^-14)
    // Re-bias exponent (127 -> 15) and round the 13 dropped mantissa bits to nearest even.
    uint32_t v = abs - 0x38000000u;
    v += 0xfffu + ((v >> 13) & 1u);
    return sign | static_cast<uint16_t>(v >> 13);
  }
  if (abs < 0x33000000u) return sign;  // below half the smallest subnormal (2^-25): signed zero
  // Subnormal f16: value = m * 2^-24 with m in [1, 1023]; shift the full significand and round to even.
  const int exp = static_cast<int>(abs >> 23);               // biased f32 exponent, 102..112
  const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;       // 24-bit significand
  const int shift = 126 - exp;                               // 14..24: bits dropped beyond f16's 2^-24 unit
  const uint32_t halfway = 1u << (shift - 1);
  uint32_t m = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u);
  if (rem > halfway || (rem == halfway && (m & 1u))) ++m;  // may carry into the smallest normal: still correct
  return sign | static_cast<uint16_t>(m);
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // inf / NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    bits = sign | ((112u - static_cast<uint32_t>(e)) << 23) | ((mant & 0x3ffu) << 13);
  }
  return std::bit_cast<float>(bits);
}

void f32_to_bf16_n(const float* src, uint16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}
void bf16_to_f32_n(const uint16_t* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}
void f32_to_f16_n(const float* src, uint16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = f32_to_f16(src[i]);
}
void f16_to_f32_n(const uint16_t* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(src[i]);
}

void to_f32_n(DType dtype, const void* src, float* dst, size_t n) {
  if (dtype == DType::kF32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  std::vector<uint16_t> halves(n);
  std::memcpy(halves.data(), src, n * sizeof(uint16_t));
  if (dtype == DType::kBF16)
    bf16_to_f32_n(halves.data(), dst, n);
  else
    f16_to_f32_n(halves.data(), dst, n);
}

void from_f32_n(DType dtype, const float* src, void* dst, size_t n) {
  if (dtype == DType::kBF16)
    f32_to_bf16_n(src, static_cast<uint16_t*>(dst), n);
  else if (dtype == DType::kF16)
    f32_to_f16_n(src, static_cast<uint16_t*>(dst), n);
  else
    std::memcpy(dst, src, n * sizeof(float));
}

size_t first_non_finite(const float* src, size_t n) {
  uint32_t any = 0;
  for (size_t i = 0; i < n; ++i) any |= (std::bit_cast<uint32_t>(src[i]) & 0x7f800000u) == 0x7f800000u;
  if (any == 0) return n;
  size_t i = 0;
  while ((std::bit_cast<uint32_t>(src[i]) & 0x7f800000u) != 0x7f800000u) ++i;
  return i;
}

}  // namespace strata
