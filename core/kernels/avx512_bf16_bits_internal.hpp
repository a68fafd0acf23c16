// Internal to the AVX-512 kernels (gemm_bf16_panels.cpp, gemm_f32_panels.cpp, batch_norm's and avg_pool's
// row loops): bf16 bits to float32
// and back, 16 lanes at a time, exactly as the scalar bfloat16 conversions (core/dtype.hpp). Needs
// AVX-512F only (no bf16 instructions: those flush subnormals).
#pragma once

#include <immintrin.h>

namespace linum::kernels::detail {

// bf16 (in 16-bit lanes) widened to float32.
inline __m512 widen_bf16(__m256i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)); }

// float32 to bf16 bits, rounded to nearest even, NaNs kept quiet: bfloat16::round_bits, 16 lanes.
inline __m256i round_to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                             _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)))),
                        16);
  const __m512i nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  const __mmask16 is_nan =
      _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, nan));
}

}  // namespace linum::kernels::detail
