// Whole-array float32 products on AVX-512F, the bias added in the product's epilogue. See gemm.hpp
// for the contract.
//
// Why our own kernel: on a layer's forward and input-gradient products (2048 x 512 by 512 x 512, the
// deep MLP's, and wider) it is as fast as oneDNN 2.6's alone (1.00-1.07x), and faster inside a step,
// where the layer's input comes from memory and the next row tile's rows are fetched ahead: the
// MLP's float32 step with remat every layer, which is little more than products, ran 2.3-3.9% faster
// with the forward products here and a further 1.3-2.1% with the input gradients too (with the
// fetches). Where it is the faster, and where not: engine.cpp (uses_f32_panels).
//
// Layout. The right operand is packed once per product into panels of 32 columns: panel p holds, for
// each row q, the 32 floats b[q, 32 p .. 32 p + 31], zero past n. A panel is contiguous (K x 128
// bytes), so one tile streams it from L1 or L2 without cache-set conflicts. A tile is kTileRows rows by
// 32 columns: 28 float32 accumulators in registers; each element of a row of A is one broadcast.
// A transposed left operand (a [k, m]) is packed the same way, kTileRows columns wide.
//
// bf16 operands (bf16_products() == widened, engine.cpp): the same kernel reads them widened to
// float32 (B while it is packed, A one row tile at a time into a small buffer of the thread's, reused
// by the tile's panels) and rounds its results to bf16 in the epilogue. The same sums as on the
// widened copies, without writing those copies or the float32 result: a layer's product no longer
// makes three extra passes over memory.
//
// Order of the sums: each output element is summed over k in order (one fused multiply-add per
// term) on one thread, then the bias is added. So the result depends only on the operands, never on
// the thread or the team's size, and recomputation under remat is bitwise.
#include <linum/core/error.hpp>
#include <linum/core/kernels/gemm.hpp>
#include <linum/core/kernels/panel_schedule_internal.hpp>

#include <algorithm>
#include <array>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>

#include <linum/core/kernels/avx512_bf16_bits_internal.hpp>
#include <linum/core/kernels/avx512_lanes_internal.hpp>
#include <linum/core/kernels/avx512_transpose_internal.hpp>
#define LINUM_F32_PANELS 1
#else
#define LINUM_F32_PANELS 0
#endif
// The widened bf16 products also need AVX-512BW (16-bit lanes, masked).
#if LINUM_F32_PANELS && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LINUM_F32_PANELS_WIDENED 1
#else
#define LINUM_F32_PANELS_WIDENED 0
#endif

namespace linum::kernels {

bool f32_panels_available() { return LINUM_F32_PANELS != 0; }
bool f32_panels_widened_available() { return LINUM_F32_PANELS_WIDENED != 0; }

#if LINUM_F32_PANELS
namespace {

using detail::kPanelCols;
using detail::kTileRows;
using detail::lanes;
using detail::transpose16;

// 16 elements of a float32 or (widened) bf16 row, the lanes past the mask zero.
inline __m512 load_wide(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
#if LINUM_F32_PANELS_WIDENED
inline __m512 load_wide(const bfloat16* p, __mmask16 m) {
  return detail::widen_bf16(_mm256_maskz_loadu_epi16(m, reinterpret_cast<const std::uint16_t*>(p)));
}
#endif

// Rows [q0, q1) of b (float32 [k, n], row stride ldb) into all its panels, `width` wide (panel t at
// panels + t * panel_words), zero past n: panel by panel, so that each writes one run while the few
// rows of the range stay in cache. Meanwhile the rows two ranges ahead are fetched, a few lines per
// panel (as the bf16 kernel's packing does, for the same reason: a layer's input comes back from
// DRAM, and reading a range panel by panel walks it column slice by column slice).
// (T: float, or bfloat16 widened as it is packed.)
template <class T>
void pack_rows(const T* b, std::int64_t ldb, std::int64_t k, std::int64_t n, std::int64_t width, float* panels,
               std::int64_t panel_words, std::int64_t q0, std::int64_t q1) {
  const std::int64_t count = (n + width - 1) / width;
  const std::int64_t ahead_row = std::min(q1 + (q1 - q0), k), ahead_end = std::min(ahead_row + (q1 - q0), k);
  detail::FetchAhead ahead = detail::FetchAhead::rows(b, sizeof(T), ldb, n, ahead_row, ahead_end, count);
  for (std::int64_t t = 0; t < count; ++t) {
    ahead.step();
    const std::int64_t j0 = t * width, cols = std::min(width, n - j0);
    for (std::int64_t q = q0; q < q1; ++q) {
      const T* row = b + q * ldb + j0;
      float* out = panels + t * panel_words + q * width;
      for (std::int64_t j = 0; j < width; j += 16)
        _mm512_mask_storeu_ps(out + j, lanes(width - j), load_wide(row + j, lanes(cols - j)));
    }
  }
}

// Panel p (32 wide) of a transposed right operand, b [n, k] (row stride ldb): column j of the panel
// is row j0 + j of b. Blocks of 16 of b's rows by 16 of their elements, transposed in registers
// (rows past n are zeros).
template <class T>
void pack_transposed(const T* b, std::int64_t ldb, std::int64_t k, std::int64_t n, std::int64_t p, float* panel) {
  const std::int64_t j0 = p * kPanelCols, cols = std::min(kPanelCols, n - j0);
  for (std::int64_t h = 0; h < kPanelCols; h += 16) {
    const std::int64_t rows = std::clamp<std::int64_t>(cols - h, 0, 16);
    for (std::int64_t q0 = 0; q0 < k; q0 += 16) {
      const std::int64_t depth = std::min<std::int64_t>(16, k - q0);
      const __mmask16 in = lanes(depth);
      __m512 block[16];
      for (std::int64_t j = 0; j < 16; ++j)
        block[j] = j < rows ? load_wide(b + (j0 + h + j) * ldb + q0, in) : _mm512_setzero_ps();
      transpose16(block);
      for (std::int64_t q = 0; q < depth; ++q) _mm512_store_ps(panel + (q0 + q) * kPanelCols + h, block[q]);
    }
  }
}

static_assert(kScaledSumRows == kTileRows, "gemm_f32_panels' tile_sums are per row tile");

// What a tile's epilogue multiplies in (gemm.hpp: gemm_f32_panels' scale and tile_sums): the tile's
// rows of the scale (row stride ldo), and where its column sums go.
struct TileScale {
  const float* scale = nullptr;
  float* sums = nullptr;
  bool selects = false;  // the element where the scale's is > 0, else 0, instead of the product
  const std::uint16_t* scale16 = nullptr;  // bf16 results: a bf16 scale (Bf16ProductOut::scale's roundings)
};

// One tile: rows [0, R) of A times one panel, plus the bias, into out (row stride ldo; columns
// masked by m0, m1): float32, or with Bf16Out bf16 (each element rounded once, bfloat16::round_bits);
// times the scale when one is given (scaled.scale for float32, scaled.scale16 for bf16 results, with
// Bf16ProductOut::scale's roundings). A is row-major (row stride lda), or with
// PackedA a packed panel of a transposed A (pack_rows, kTileRows wide). Meanwhile `fetch`'s lines
// are fetched, spread over the steps of the sum (detail::fetch_evenly).
template <int R, bool PackedA, bool Bf16Out>
void tile(std::int64_t k, const float* a, std::int64_t lda, const float* panel, const float* bias, __mmask16 m0,
          __mmask16 m1, void* out_words, std::int64_t ldo, const detail::TileFetch& fetch, const TileScale& scaled) {
  float* out = static_cast<float*>(out_words);
  __m512 acc0[R], acc1[R];
#pragma GCC unroll 14
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  std::int64_t fetched = 0;
  for (std::int64_t q = 0; q < k; ++q) {
    if (fetch.from != nullptr) detail::fetch_evenly(fetch, q, k, fetched);
    const __m512 b0 = _mm512_load_ps(panel + q * kPanelCols);
    const __m512 b1 = _mm512_load_ps(panel + q * kPanelCols + 16);
#pragma GCC unroll 14
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(PackedA ? a[q * kTileRows + r] : a[r * lda + q]);
      acc0[r] = _mm512_fmadd_ps(av, b0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(av, b1, acc1[r]);
    }
  }
  const __m512 bias0 = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m0, bias);
  const __m512 bias1 = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m1, bias + 16);
#if LINUM_F32_PANELS_WIDENED
  if constexpr (Bf16Out) {
    auto* out16 = static_cast<std::uint16_t*>(out_words);
    if (scaled.scale16 == nullptr) {
#pragma GCC unroll 14
      for (int r = 0; r < R; ++r) {
        const __m512 z0 = bias == nullptr ? acc0[r] : _mm512_add_ps(acc0[r], bias0);
        const __m512 z1 = bias == nullptr ? acc1[r] : _mm512_add_ps(acc1[r], bias1);
        _mm256_mask_storeu_epi16(out16 + r * ldo, m0, detail::round_to_bf16(z0));
        _mm256_mask_storeu_epi16(out16 + r * ldo + 16, m1, detail::round_to_bf16(z1));
      }
      return;
    }
    // The rounded z times the scale, rounded again (or z where the scale is > 0, else +0: exact);
    // the tile's column sums of those products before their rounding. As gemm_bf16_panels' scale.
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
#pragma GCC unroll 14
    for (int r = 0; r < R; ++r) {
      __m256i h0 = detail::round_to_bf16(bias == nullptr ? acc0[r] : _mm512_add_ps(acc0[r], bias0));
      __m256i h1 = detail::round_to_bf16(bias == nullptr ? acc1[r] : _mm512_add_ps(acc1[r], bias1));
      const __m512 z0 = detail::widen_bf16(h0), z1 = detail::widen_bf16(h1);
      const __m512 s0 = detail::widen_bf16(_mm256_maskz_loadu_epi16(m0, scaled.scale16 + r * ldo));
      const __m512 s1 = detail::widen_bf16(_mm256_maskz_loadu_epi16(m1, scaled.scale16 + r * ldo + 16));
      __m512 p0, p1;
      if (scaled.selects) {
        const __mmask16 k0 = _mm512_cmp_ps_mask(s0, _mm512_setzero_ps(), _CMP_GT_OQ);
        const __mmask16 k1 = _mm512_cmp_ps_mask(s1, _mm512_setzero_ps(), _CMP_GT_OQ);
        p0 = _mm512_maskz_mov_ps(k0, z0);
        p1 = _mm512_maskz_mov_ps(k1, z1);
        h0 = _mm256_maskz_mov_epi16(k0, h0);
        h1 = _mm256_maskz_mov_epi16(k1, h1);
      } else {
        p0 = _mm512_mul_ps(z0, s0);
        p1 = _mm512_mul_ps(z1, s1);
        h0 = detail::round_to_bf16(p0);
        h1 = detail::round_to_bf16(p1);
      }
      if (scaled.sums != nullptr) {
        sum0 = _mm512_add_ps(sum0, p0);
        sum1 = _mm512_add_ps(sum1, p1);
      }
      _mm256_mask_storeu_epi16(out16 + r * ldo, m0, h0);
      _mm256_mask_storeu_epi16(out16 + r * ldo + 16, m1, h1);
    }
    if (scaled.sums != nullptr) {
      _mm512_mask_storeu_ps(scaled.sums, m0, sum0);
      _mm512_mask_storeu_ps(scaled.sums + 16, m1, sum1);
    }
    return;
  }
#endif
  if (scaled.scale != nullptr) {  // times the scale; the tile's column sums of the products
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512 z0 = bias == nullptr ? acc0[r] : _mm512_add_ps(acc0[r], bias0);
      const __m512 z1 = bias == nullptr ? acc1[r] : _mm512_add_ps(acc1[r], bias1);
      const __m512 s0 = _mm512_maskz_loadu_ps(m0, scaled.scale + r * ldo);
      const __m512 s1 = _mm512_maskz_loadu_ps(m1, scaled.scale + r * ldo + 16);
      const __m512 p0 = scaled.selects ? _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s0, _mm512_setzero_ps(), _CMP_GT_OQ), z0)
                                       : _mm512_mul_ps(z0, s0);
      const __m512 p1 = scaled.selects ? _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s1, _mm512_setzero_ps(), _CMP_GT_OQ), z1)
                                       : _mm512_mul_ps(z1, s1);
      if (scaled.sums != nullptr) {
        sum0 = _mm512_add_ps(sum0, p0);
        sum1 = _mm512_add_ps(sum1, p1);
      }
      _mm512_mask_storeu_ps(out + r * ldo, m0, p0);
      _mm512_mask_storeu_ps(out + r * ldo + 16, m1, p1);
    }
    if (scaled.sums != nullptr) {
      _mm512_mask_storeu_ps(scaled.sums, m0, sum0);
      _mm512_mask_storeu_ps(scaled.sums + 16, m1, sum1);
    }
    return;
  }
#pragma GCC unroll 14
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(out + r * ldo, m0, bias == nullptr ? acc0[r] : _mm512_add_ps(acc0[r], bias0));
    _mm512_mask_storeu_ps(out + r * ldo + 16, m1, bias == nullptr ? acc1[r] : _mm512_add_ps(acc1[r], bias1));
  }
}

using TileFn = void (*)(std::int64_t, const float*, std::int64_t, const float*, const float*, __mmask16, __mmask16, void*,
                        std::int64_t, const detail::TileFetch&, const TileScale&);
template <bool PackedA, bool Bf16Out, int... R>
constexpr auto tiles(std::integer_sequence<int, R...>) {
  return std::array<TileFn, sizeof...(R)>{tile<R + 1, PackedA, Bf16Out>...};
}
// [packed A][rows - 1], float32 results
constexpr std::array<std::array<TileFn, kTileRows>, 2> kTiles{tiles<false, false>(std::make_integer_sequence<int, kTileRows>{}),
                                                           tiles<true, false>(std::make_integer_sequence<int, kTileRows>{})};
#if LINUM_F32_PANELS_WIDENED
// [rows - 1], bf16 results (A row-major: a bf16 A is widened a row tile at a time, see panels_product)
constexpr std::array<TileFn, kTileRows> kBf16OutTiles = tiles<false, true>(std::make_integer_sequence<int, kTileRows>{});
#endif

// The product (gemm.hpp's contract) with A and B float32, or both bf16 (widened as they are read:
// B while it is packed, A a row tile at a time into a buffer of the thread's; not transposed) and
// then out bf16. Everything else is the float32 product's: the same sums in the same order, so a bf16
// product's bits are the float32 product's of the widened operands, rounded once.
template <class T>
void panels_product(std::int64_t m, std::int64_t n, std::int64_t k, const T* a, bool ta, const T* b, bool tb,
                    const float* bias, void* out_words, const T* scale, float* tile_sums, bool scale_selects) {
  constexpr bool kWidened = !std::is_same_v<T, float>;
  if (m == 0 || n == 0) return;
  constexpr std::int64_t kRowChunk = 32;  // rows of an operand packed at a time
  const std::int64_t depth = std::max<std::int64_t>(k, 1);  // a panel's rows (one, zero, when k = 0)
  const std::int64_t row_chunks = (k + kRowChunk - 1) / kRowChunk;
  const std::int64_t panel_count = (n + kPanelCols - 1) / kPanelCols, panel_words = depth * kPanelCols;
  const std::int64_t row_tiles = (m + kTileRows - 1) / kTileRows;
  // The packed operands: an Array, so the memory accounting counts them (64-byte aligned; a panel
  // of A is padded to whole cache lines).
  const std::int64_t a_panel_words = ta ? (depth * kTileRows + 15) / 16 * 16 : 0;
  Array packed = Array::empty(Shape{panel_count * panel_words + row_tiles * a_panel_words}, DType::f32);
  float* panels = packed.mutable_data();
  float* a_panels = ta ? panels + panel_count * panel_words : nullptr;
  if (k == 0) std::fill(panels, panels + panel_count * panel_words + row_tiles * a_panel_words, 0.0f);
  const detail::PanelSchedule schedule(m, panel_count, panel_words * 4, kTileRows);
  const double work = static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  const std::int64_t out_bytes = kWidened ? 2 : 4;
  detail::run_panel_product(
      work, tb ? panel_count : row_chunks,
      [&](std::int64_t u) {
        if (tb) pack_transposed(b, k, k, n, u, panels + u * panel_words);
        else pack_rows(b, n, k, n, kPanelCols, panels, panel_words, u * kRowChunk, std::min(k, (u + 1) * kRowChunk));
      },
      ta ? row_chunks : 0,
      [&](std::int64_t u) {
        if constexpr (!kWidened)
          pack_rows(a, m, k, m, kTileRows, a_panels, a_panel_words, u * kRowChunk, std::min(k, (u + 1) * kRowChunk));
      },
      schedule, [&](const detail::PanelSchedule::Item& it) {
        // (a bf16 A's row tile, widened: kTileRows x k floats, reused by the item's panels)
        [[maybe_unused]] float* wide = nullptr;
        if constexpr (kWidened) {
          thread_local std::vector<float> buffer;
          if (static_cast<std::int64_t>(buffer.size()) < kTileRows * k) buffer.resize(kTileRows * k);
          wide = buffer.data();
        }
        for (std::int64_t t = it.t0; t < it.t1; ++t) {
          const std::int64_t i0 = t * kTileRows;
          const int rows = static_cast<int>(std::min<std::int64_t>(kTileRows, m - i0));
          const float* a_rows = nullptr;
          if constexpr (kWidened) {
            for (int r = 0; r < rows; ++r)
              for (std::int64_t q = 0; q < k; q += 16)
                _mm512_mask_storeu_ps(wide + r * k + q, lanes(k - q), load_wide(a + (i0 + r) * k + q, lanes(k - q)));
            a_rows = wide;
          } else {
            a_rows = ta ? a_panels + t * a_panel_words : a + i0 * k;
          }
          for (std::int64_t p = it.p0; p < it.p1; ++p) {
            const std::int64_t j0 = p * kPanelCols;
            // (the next row tile's rows: panel_schedule_internal.hpp)
            const detail::TileFetch next =
                !ta && p == it.p0 ? detail::next_tile_rows(a, m, k * static_cast<std::int64_t>(sizeof(T)), t) : detail::TileFetch{};
            TileScale scaled;
            scaled.selects = scale_selects;
            if (scale != nullptr) {
              const T* tile_scale = scale + i0 * n + j0;
              if constexpr (kWidened) scaled.scale16 = reinterpret_cast<const std::uint16_t*>(tile_scale);
              else scaled.scale = tile_scale;
              if (tile_sums != nullptr) scaled.sums = tile_sums + t * n + j0;
              // (its lines, fetched now for the epilogue: a derivative kept since the forward pass)
              for (int r = 0; r < rows; ++r) {
                _mm_prefetch(reinterpret_cast<const char*>(tile_scale + r * n), _MM_HINT_T0);
                if constexpr (!kWidened) _mm_prefetch(reinterpret_cast<const char*>(tile_scale + r * n + 16), _MM_HINT_T0);
              }
            }
            void* out_tile = static_cast<char*>(out_words) + (i0 * n + j0) * out_bytes;
            TileFn fn = nullptr;
#if LINUM_F32_PANELS_WIDENED
            if constexpr (kWidened) fn = kBf16OutTiles[rows - 1];
#endif
            if constexpr (!kWidened) fn = kTiles[ta][rows - 1];
            fn(k, a_rows, k, panels + p * panel_words, bias == nullptr ? nullptr : bias + j0, lanes(n - j0),
               lanes(n - j0 - 16), out_tile, n, next, scaled);
          }
        }
      });
}

}  // namespace

void gemm_f32_panels(std::int64_t m, std::int64_t n, std::int64_t k, const float* a, bool ta, const float* b, bool tb,
                     const float* bias, float* out, const float* scale, float* tile_sums, bool scale_selects) {
  panels_product(m, n, k, a, ta, b, tb, bias, out, scale, tile_sums, scale_selects);
}

void gemm_f32_panels_widened(std::int64_t m, std::int64_t n, std::int64_t k, const bfloat16* a, const bfloat16* b,
                             bool tb, const float* bias, bfloat16* out, const bfloat16* scale, float* tile_sums,
                             bool scale_selects) {
#if LINUM_F32_PANELS_WIDENED
  panels_product(m, n, k, a, false, b, tb, bias, out, scale, tile_sums, scale_selects);
#else
  (void)m, (void)n, (void)k, (void)a, (void)b, (void)tb, (void)bias, (void)out, (void)scale, (void)tile_sums,
      (void)scale_selects;
  throw Error("gemm_f32_panels_widened: this build has no AVX-512BW kernel (check f32_panels_widened_available() first)");
#endif
}

#else

void gemm_f32_panels(std::int64_t, std::int64_t, std::int64_t, const float*, bool, const float*, bool, const float*,
                     float*, const float*, float*, bool) {
  throw Error("gemm_f32_panels: this build has no AVX-512 kernel (check f32_panels_available() first)");
}
void gemm_f32_panels_widened(std::int64_t, std::int64_t, std::int64_t, const bfloat16*, const bfloat16*, bool, const float*,
                             bfloat16*, const bfloat16*, float*, bool) {
  throw Error("gemm_f32_panels_widened: this build has no AVX-512 kernel (check f32_panels_widened_available() first)");
}

#endif

}  // namespace linum::kernels
