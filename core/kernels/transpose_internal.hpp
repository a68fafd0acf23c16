// Internal to the kernels: a float32 matrix copied transposed (the recurrent kernels' weight packing,
// recurrent_passes_internal.hpp; the weight-gradient pieces of AVX2 builds, gemm_onednn.cpp).
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__)
#include <linum/core/kernels/avx512_transpose_internal.hpp>
#endif

namespace linum::kernels {

// dst[j * ldd + i] = src[i * lds + j] for i < rows, j < cols: 16 x 16 tiles transposed in registers
// where the build has AVX-512; elsewhere, and at the edges, 16 x 16 blocks element by element, each
// read and written within a few cache lines.
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
