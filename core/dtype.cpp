#include <linum/core/dtype.hpp>

#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#endif

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

// Plain loops over the bit patterns: GCC vectorises both at -O2 -march=native (the rounding takes
// AVX512-BF16's instruction where the build's CPU has it).
void bf16_to_f32(const bfloat16* in, float* out, std::int64_t n) {
  const std::uint16_t* src = reinterpret_cast<const std::uint16_t*>(in);
  std::uint32_t* dst = reinterpret_cast<std::uint32_t*>(out);
  for (std::int64_t i = 0; i < n; ++i) dst[i] = static_cast<std::uint32_t>(src[i]) << 16;
}

void f32_to_bf16(const float* in, bfloat16* out, std::int64_t n) {
  std::int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  // AVX512-BF16's conversion rounds to nearest even and quiets NaNs as round_bits does (one
  // instruction for 16 values instead of five integer operations), but flushes subnormal inputs to
  // zero: a block holding one takes the loop below, so the bits are round_bits' everywhere.
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(in + i);
    const __m512i u = _mm512_castps_si512(v);
    const __mmask16 subnormal = _mm512_test_epi32_mask(u, _mm512_set1_epi32(0x007fffff)) &
                                _mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7f800000));
    if (subnormal != 0) {
      for (std::int64_t j = i; j < i + 16; ++j) out[j].bits = bfloat16::round_bits(in[j]);
      continue;
    }
    const __m256bh r = _mm512_cvtneps_pbh(v);
    std::memcpy(static_cast<void*>(out + i), &r, sizeof(r));
  }
#endif
  for (; i < n; ++i) out[i].bits = bfloat16::round_bits(in[i]);
}

}  // namespace linum
