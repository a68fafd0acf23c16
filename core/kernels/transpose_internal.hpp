// Internal to the kernels: a float32 matrix copied transposed (the recurrent kernels' weight packing,
// recurrent_passes_internal.hpp; the weight-gradient pieces of AVX2 builds, gemm_onednn.cpp).
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__)
#include <linum/core/kernels/avx512_transpose_internal.hpp>
#elif defined(__AVX2__)
#include <immintrin.h>
#endif

namespace linum::kernels {

#if !defined(__AVX512F__) && defined(__AVX2__)
// Eight rows of eight floats transposed in registers (row j of the result: element j of each row).
inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}
#endif

// dst[j * ldd + i] = src[i * lds + j] for i < rows, j < cols: 16 x 16 tiles transposed in registers
// where the build has AVX-512, 8 x 8 tiles where it has AVX2; elsewhere, and at the edges, 16 x 16
// blocks element by element, each read and written within a few cache lines.
inline void transpose_into(const float* src, std::int64_t lds, std::int64_t rows, std::int64_t cols, float* dst,
                           std::int64_t ldd) {
  constexpr std::int64_t kBlock = 16;
  std::int64_t i0 = 0;
#if defined(__AVX512F__)
  for (; i0 + kBlock <= rows; i0 += kBlock) {
    std::int64_t j0 = 0;
    for (; j0 + kBlock <= cols; j0 += kBlock) {
      __m512 r[kBlock];
      for (int i = 0; i < kBlock; ++i) r[i] = _mm512_loadu_ps(src + (i0 + i) * lds + j0);
      detail::transpose16(r);
      for (int j = 0; j < kBlock; ++j) _mm512_storeu_ps(dst + (j0 + j) * ldd + i0, r[j]);
    }
    for (std::int64_t j = j0; j < cols; ++j)
      for (std::int64_t i = i0; i < i0 + kBlock; ++i) dst[j * ldd + i] = src[i * lds + j];
  }
#elif defined(__AVX2__)
  for (; i0 + 8 <= rows; i0 += 8) {
    std::int64_t j0 = 0;
    for (; j0 + 8 <= cols; j0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + (i0 + i) * lds + j0);
      transpose8(r);
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(dst + (j0 + j) * ldd + i0, r[j]);
    }
    for (std::int64_t j = j0; j < cols; ++j)
      for (std::int64_t i = i0; i < i0 + 8; ++i) dst[j * ldd + i] = src[i * lds + j];
  }
#endif
  for (; i0 < rows; i0 += kBlock) {
    const std::int64_t i1 = std::min(rows, i0 + kBlock);
    for (std::int64_t j0 = 0; j0 < cols; j0 += kBlock) {
      const std::int64_t j1 = std::min(cols, j0 + kBlock);
      for (std::int64_t j = j0; j < j1; ++j)
        for (std::int64_t i = i0; i < i1; ++i) dst[j * ldd + i] = src[i * lds + j];
    }
  }
}

}  // namespace linum::kernels
