// Serial bfloat16 products with float32 accumulation on AVX512-BF16 (vdpbf16ps), for fused kernels
// that run their own parallel loop over small products (attention's per-head blocks), where a
// library call per product costs as much as the product. See gemm.hpp for the contract.
//
// vdpbf16ps multiplies pairs of bf16 values and adds both products to a float32 lane, so the right
// operand is stored "pair-interleaved": element (k, j) of B sits at packed[(k / 2) * ldp + j] as the
// low (k even) or high (k odd) half of a 32-bit word, and a row of A contributes one 32-bit pair
// (a[i, k], a[i, k + 1]) broadcast to all lanes. A tile of 8 rows by 32 columns keeps 16 float32
// accumulators in registers.
#include <linum/core/kernels/engine.hpp>
#include <linum/core/kernels/gemm.hpp>

#include <algorithm>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#include <linum/core/kernels/avx512_lanes_internal.hpp>
#define LINUM_BF16_DOT 1
#else
#define LINUM_BF16_DOT 0
#endif

namespace linum::kernels {

bool bf16_dot_available() { return LINUM_BF16_DOT != 0 && bf16_products() == Bf16Products::dot_instructions; }

void pack_bf16_pairs(const bfloat16* b, std::int64_t ldb, bool tb, std::int64_t k, std::int64_t n, std::uint32_t* packed,
                     std::int64_t ldp) {
  const std::uint16_t* src = reinterpret_cast<const std::uint16_t*>(b);
  const std::int64_t pairs = (k + 1) / 2;
  for (std::int64_t p = 0; p < pairs; ++p) {
    const std::int64_t k0 = 2 * p;
    const bool has_hi = k0 + 1 < k;
    std::uint32_t* out = packed + p * ldp;
    if (tb) {  // b is [n, k]: the pair is adjacent in row j
      for (std::int64_t j = 0; j < n; ++j) {
        const std::uint16_t* row = src + j * ldb + k0;
        out[j] = static_cast<std::uint32_t>(row[0]) | (has_hi ? static_cast<std::uint32_t>(row[1]) << 16 : 0u);
      }
    } else {  // b is [k, n]: the pair comes from rows k0 and k0 + 1
      const std::uint16_t* lo = src + k0 * ldb;
      const std::uint16_t* hi = src + (k0 + 1) * ldb;
      if (has_hi)
        for (std::int64_t j = 0; j < n; ++j) out[j] = static_cast<std::uint32_t>(lo[j]) | static_cast<std::uint32_t>(hi[j]) << 16;
      else
        for (std::int64_t j = 0; j < n; ++j) out[j] = static_cast<std::uint32_t>(lo[j]);
    }
  }
}

void f32_rows_to_bf16(const float* a, std::int64_t lda, std::int64_t rows, std::int64_t cols, bfloat16* out) {
  for (std::int64_t r = 0; r < rows; ++r) f32_to_bf16(a + r * lda, out + r * cols, cols);
}

void f32_rows_rounded_to_bf16(const float* a, std::int64_t lda, std::int64_t rows, std::int64_t cols, float* out) {
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) out[r * cols + c] = static_cast<float>(bfloat16(a[r * lda + c]));
}

void f32_to_bf16_transposed(const float* a, std::int64_t lda, std::int64_t rows, std::int64_t cols, bfloat16* out,
                            std::int64_t ldo) {
  constexpr std::int64_t kTile = 16;  // stay within a few cache lines of both matrices
  for (std::int64_t r0 = 0; r0 < rows; r0 += kTile)
    for (std::int64_t c0 = 0; c0 < cols; c0 += kTile) {
      const std::int64_t r1 = std::min(rows, r0 + kTile), c1 = std::min(cols, c0 + kTile);
      for (std::int64_t c = c0; c < c1; ++c)
        for (std::int64_t r = r0; r < r1; ++r) out[c * ldo + r] = bfloat16(a[r * lda + c]);
    }
}

#if LINUM_BF16_DOT
namespace {

inline std::uint32_t a_pair(const std::uint16_t* row, std::int64_t p) {
  std::uint32_t v;
  std::memcpy(&v, row + 2 * p, 4);
  return v;
}

// C[0:MR, 0:32] (columns masked by m0, m1) = alpha * A B + beta * C.
template <int MR>
void tile(std::int64_t k, float alpha, const std::uint16_t* a, std::int64_t lda, const std::uint32_t* b,
          std::int64_t ldp, float beta, float* c, std::int64_t ldc, __mmask16 m0, __mmask16 m1) {
  __m512 acc0[MR], acc1[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  const std::int64_t full = k / 2;
  for (std::int64_t p = 0; p < full; ++p) {
    const __m512i b0 = _mm512_maskz_loadu_epi32(m0, b + p * ldp);
    const __m512i b1 = _mm512_maskz_loadu_epi32(m1, b + p * ldp + 16);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(a_pair(a + r * lda, p)));
      acc0[r] = _mm512_dpbf16_ps(acc0[r], av, (__m512bh)b0);
      acc1[r] = _mm512_dpbf16_ps(acc1[r], av, (__m512bh)b1);
    }
  }
  if (k & 1) {  // the last, odd, column of A: its pair's high half is zero, whatever lies beyond the row
    const __m512i b0 = _mm512_maskz_loadu_epi32(m0, b + full * ldp);
    const __m512i b1 = _mm512_maskz_loadu_epi32(m1, b + full * ldp + 16);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r * lda + 2 * full]));
      acc0[r] = _mm512_dpbf16_ps(acc0[r], av, (__m512bh)b0);
      acc1[r] = _mm512_dpbf16_ps(acc1[r], av, (__m512bh)b1);
    }
  }
  const __m512 va = _mm512_set1_ps(alpha);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    float* row = c + r * ldc;
    __m512 y0 = _mm512_mul_ps(acc0[r], va), y1 = _mm512_mul_ps(acc1[r], va);
    if (beta != 0.0f) {
      const __m512 vb = _mm512_set1_ps(beta);
      y0 = _mm512_add_ps(y0, _mm512_mul_ps(vb, _mm512_maskz_loadu_ps(m0, row)));
      y1 = _mm512_add_ps(y1, _mm512_mul_ps(vb, _mm512_maskz_loadu_ps(m1, row + 16)));
    }
    _mm512_mask_storeu_ps(row, m0, y0);
    _mm512_mask_storeu_ps(row + 16, m1, y1);
  }
}

using TileFn = void (*)(std::int64_t, float, const std::uint16_t*, std::int64_t, const std::uint32_t*, std::int64_t, float,
                        float*, std::int64_t, __mmask16, __mmask16);
constexpr TileFn kTiles[8] = {tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>, tile<7>, tile<8>};

using detail::lanes;

}  // namespace

void gemm_bf16_packed_serial(std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const bfloat16* a,
                             std::int64_t lda, const std::uint32_t* packed_b, std::int64_t ldp, float beta, float* c,
                             std::int64_t ldc) {
  const std::uint16_t* a16 = reinterpret_cast<const std::uint16_t*>(a);
  for (std::int64_t j0 = 0; j0 < n; j0 += 32) {
    const __mmask16 m0 = lanes(n - j0), m1 = lanes(n - j0 - 16);
    for (std::int64_t i0 = 0; i0 < m; i0 += 8) {
      const std::int64_t rows = std::min<std::int64_t>(8, m - i0);
      kTiles[rows - 1](k, alpha, a16 + i0 * lda, lda, packed_b + j0, ldp, beta, c + i0 * ldc + j0, ldc, m0, m1);
    }
  }
}

#else

// Without AVX512-BF16 the same contract in scalar code (callers use it only for tests; the fused
// kernels widen to float32 and use gemm_f32_serial instead).
void gemm_bf16_packed_serial(std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const bfloat16* a,
                             std::int64_t lda, const std::uint32_t* packed_b, std::int64_t ldp, float beta, float* c,
                             std::int64_t ldc) {
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      float acc = 0.0f;
      for (std::int64_t kk = 0; kk < k; ++kk) {
        const std::uint32_t word = packed_b[(kk / 2) * ldp + j];
        const std::uint32_t bits = (kk % 2 == 0 ? word & 0xFFFFu : word >> 16) << 16;
        float bv;
        std::memcpy(&bv, &bits, 4);
        acc += static_cast<float>(a[i * lda + kk]) * bv;
      }
      float& out = c[i * ldc + j];
      out = alpha * acc + (beta != 0.0f ? beta * out : 0.0f);
    }
}

#endif

}  // namespace linum::kernels
