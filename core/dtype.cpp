#include <linum/core/dtype.hpp>

namespace linum {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::i32: return "int32";
    case DType::bf16: return "bfloat16";
  }
  return "unknown";
}

const char* dtype_short_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::i32: return "i32";
    case DType::bf16: return "bf16";
  }
  return "?";
}

DType promote_types(DType a, DType b) {
  if (a == b) return a;
  if (a == DType::i32) return b;
  if (b == DType::i32) return a;
  return DType::f32;  // bf16 with f32
}

DType promote_types(DType a, bool a_weak, DType b, bool b_weak) {
  if (a_weak && !b_weak && is_floating(b)) return b;
  if (b_weak && !a_weak && is_floating(a)) return a;
  return promote_types(a, b);
}

// Plain loops over the bit patterns: GCC vectorises both at -O2 -march=native.
void bf16_to_f32(const bfloat16* in, float* out, std::int64_t n) {
  const std::uint16_t* src = reinterpret_cast<const std::uint16_t*>(in);
  std::uint32_t* dst = reinterpret_cast<std::uint32_t*>(out);
  for (std::int64_t i = 0; i < n; ++i) dst[i] = static_cast<std::uint32_t>(src[i]) << 16;
}

void f32_to_bf16(const float* in, bfloat16* out, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) out[i].bits = bfloat16::round_bits(in[i]);
}

}  // namespace linum
