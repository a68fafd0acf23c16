// Element types: float32, bfloat16 and int32, with JAX's promotion rules.
//
// bfloat16 is float32's upper half: the same 8-bit exponent (so the same range) with 8 bits of
// mantissa instead of 24. Linum stores bf16 arrays at 2 bytes per element and computes on them in
// float32 (every kernel widens a block, computes, and rounds its result back), so a bf16 op gives
// the float32 result rounded once, as XLA's CPU backend does. Conversions round to nearest, ties to
// even, like JAX/XLA; NaN stays NaN.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

namespace linum {

enum class DType : std::uint8_t { f32, i32, bf16 };

// "float32", "int32", "bfloat16" (NumPy's names, as flax.serialization writes them).
const char* dtype_name(DType t);
// "f32", "i32", "bf16" (as JAX prints arrays: bf16[2048,512]).
const char* dtype_short_name(DType t);
inline std::size_t dtype_size(DType t) { return t == DType::bf16 ? 2 : 4; }
inline bool is_floating(DType t) { return t != DType::i32; }

// The dtype of a binary op's result (jnp.promote_types restricted to Linum's dtypes): equal dtypes
// stay; bf16 with f32 gives f32; int32 with a float gives that float. A weakly typed operand (a C++
// scalar, see Array::scalar) takes the other operand's float dtype instead of widening it.
DType promote_types(DType a, DType b);
DType promote_types(DType a, bool a_weak, DType b, bool b_weak);

// One bfloat16 value (its bits). Arithmetic goes through float.
struct bfloat16 {
  std::uint16_t bits = 0;
  bfloat16() = default;
  explicit bfloat16(float v) : bits(round_bits(v)) {}
  explicit operator float() const { return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16); }

  // Round to nearest, ties to even; NaNs stay (quiet) NaNs of the same sign. Branch-free, so loops
  // that call it vectorise.
  static std::uint16_t round_bits(float v) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(v);
    const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const std::uint32_t nan = (u >> 16) | 0x0040u;
    return static_cast<std::uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
  }
};

// Bulk conversions (vectorised; the rounding is the one above).
void bf16_to_f32(const bfloat16* in, float* out, std::int64_t n);
void f32_to_bf16(const float* in, bfloat16* out, std::int64_t n);

}  // namespace linum
