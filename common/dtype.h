// dtype.h — the element types Strata stores (f32, bf16, f16) and their conversions.
//
// Conversions from f32 round to nearest, ties to even; NaN stays NaN (quiet), infinities stay infinite, and
// f16 overflow becomes infinity and underflow goes through subnormals to signed zero, as IEEE 754 says.
// Pure functions, thread-safe.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace strata {

enum class DType : uint8_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

constexpr size_t dtype_size(DType t) { return t == DType::kF32 ? 4 : 2; }
const char* dtype_name(DType t);  // "f32", "bf16", "f16"
// Parses "f32"/"fp32"/"float32", "bf16"/"bfloat16", "f16"/"fp16"/"float16"; false if unknown.
bool parse_dtype(std::string_view name, DType* out);

// bfloat16: the top 16 bits of an IEEE f32.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);  // ties to even
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}
inline float bf16_to_f32(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

uint16_t f32_to_f16(float f);
float f16_to_f32(uint16_t h);

// Bulk conversions (vectorised by the compiler; n may be anything).
void f32_to_bf16_n(const float* src, uint16_t* dst, size_t n);
void bf16_to_f32_n(const uint16_t* src, float* dst, size_t n);
void f32_to_f16_n(const float* src, uint16_t* dst, size_t n);
void f16_to_f32_n(const uint16_t* src, float* dst, size_t n);
// n values of `dtype` at src (any alignment: a file's mapped bytes) as fp32.
void to_f32_n(DType dtype, const void* src, float* dst, size_t n);
// And back: n fp32 values stored as `dtype` (F32, or BF16 rounded to nearest even) at dst.
void from_f32_n(DType dtype, const float* src, void* dst, size_t n);

// The index of the first NaN or infinity in src[0..n), or n when every value is finite. A branch-free pass
// (vectorised) over the whole range first: the common case, all finite, runs at memory speed.
size_t first_non_finite(const float* src, size_t n);

}  // namespace strata
