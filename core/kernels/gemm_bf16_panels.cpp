// Whole-array bfloat16 products on AVX512-BF16, with the layer's epilogue inside the product: the
// bias, the rounding to bf16, and for the fused linear layer its activation's (value, derivative)
// pair. See gemm.hpp for the contract.
//
// Why our own kernel: oneDNN 2.6 reaches the machine's bf16 peak on a product alone, but a layer is
// more than its product. Its activation pass (a table lookup per element: scalar loads and stores)
// ran after the product, on cores that had just been busy with vdpbf16ps and whose load ports sat
// mostly idle meanwhile. Here the lookups of one tile run inside the product of the next, so they use
// those idle ports. The same tile loop, with nothing interleaved, is also a little faster than
// oneDNN's product on the MLP and GPT shapes (1.03-1.18x, engine.cpp; the step's figures are in
// docs/performance.md, "Zen 5").
//
// Layout. The right operand is packed once per product into panels of 32 columns: panel p holds,
// for each pair of rows (2q, 2q + 1), the 32 words (b[2q, j] | b[2q + 1, j] << 16), zero-padded past
// n and past an odd k. A panel is contiguous (K / 2 x 128 bytes), so one tile streams it from L2
// without cache-set conflicts. A tile is kTileRows rows by 32 columns: 28 float32 accumulators in
// registers; each pair of a row of A is one 32-bit broadcast (vdpbf16ps's memory operand).
//
// Order of the sums: each output element is summed over k in order (pairs of k, each pair's two
// products added in one vdpbf16ps lane operation) on one thread, then the bias is added and the sum
// rounded once to bf16 (to nearest even; vdpbf16ps treats subnormal inputs and outputs as zero, as
// oneDNN's bf16 products do). So the result depends only on the operands, never on the thread or
// the team's size, and recomputation under remat is bitwise.
#include <linum/core/error.hpp>
#include <linum/core/kernels/gemm.hpp>
#include <linum/core/kernels/panel_schedule_internal.hpp>

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#include <immintrin.h>

#include <linum/core/kernels/avx512_bf16_bits_internal.hpp>
#include <linum/core/kernels/avx512_lanes_internal.hpp>
#include <linum/core/kernels/avx512_transpose_internal.hpp>
#define LINUM_BF16_PANELS 1
#else
#define LINUM_BF16_PANELS 0
#endif

namespace linum::kernels {

bool bf16_panels_available() { return LINUM_BF16_PANELS != 0; }

#if LINUM_BF16_PANELS
namespace {

using detail::kPanelCols;
using detail::kTileRows;
using detail::lanes;
using detail::round_to_bf16;
using detail::transpose16;
using detail::widen_bf16;

// Packing. A panel holds, for each pair of rows q of the operand, `width` words
// (b[2q, j] | b[2q + 1, j] << 16), zero past n and past an odd k. Right operands are packed 32
// columns wide; a transposed left operand (a [k, m]) is packed the same way, kTileRows columns wide, so
// that a tile's rows read their pairs side by side.

// One pair of rows (hi null for an odd k's last row), columns [0, cols), as `width` words.
void pair_words(const std::uint16_t* lo, const std::uint16_t* hi, std::int64_t cols, std::int64_t width, std::uint32_t* out) {
  for (std::int64_t j = 0; j < width; j += 16) {
    const __mmask16 in = lanes(cols - j);
    const __m512i low = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(in, lo + j));
    const __m512i high = hi == nullptr ? _mm512_setzero_si512()
                                       : _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(in, hi + j)), 16);
    _mm512_mask_storeu_epi32(out + j, lanes(width - j), _mm512_or_si512(low, high));
  }
}

// Pairs [q0, q1) of b (bf16 [k, n], row stride ldb) into all its panels, `width` wide (panel t at
// panels + t * panel_words): panel by panel, so that each writes one run while the few rows of the
// range stay in cache.
//
// Meanwhile the rows of the range two ranges ahead are fetched, a few lines per panel. Reading a
// range panel by panel walks its rows column slice by column slice, a pattern the hardware
// prefetchers follow poorly; the operand is often in DRAM (a layer's input, kept since its forward
// pass, is the weight gradient's left operand). Measured on the deep MLP's bf16 step, steps
// alternating in one process (Zen 5): 1.2-3.6% faster with the fetches one range ahead, a further
// 0.5-0.8% two ahead; three ahead was no better.
// (With b_f32, b's rows are rounded from it just before their packing: its rows are the ones fetched.)
void pack_rows(const std::uint16_t* b, std::int64_t ldb, std::int64_t k, std::int64_t n, std::int64_t width,
               std::uint32_t* panels, std::int64_t panel_words, std::int64_t q0, std::int64_t q1, const float* b_f32 = nullptr) {
  const std::int64_t count = (n + width - 1) / width;
  const std::int64_t ahead_row = std::min(2 * (2 * q1 - q0), k), ahead_end = std::min(ahead_row + 2 * (q1 - q0), k);
  detail::FetchAhead ahead = b_f32 != nullptr ? detail::FetchAhead::rows(b_f32, 4, ldb, n, ahead_row, ahead_end, count)
                                              : detail::FetchAhead::rows(b, 2, ldb, n, ahead_row, ahead_end, count);
  for (std::int64_t t = 0; t < count; ++t) {
    ahead.step();
    const std::int64_t j0 = t * width, cols = std::min(width, n - j0);
    for (std::int64_t q = q0; q < q1; ++q) {
      const std::uint16_t* lo = b + 2 * q * ldb + j0;
      pair_words(lo, 2 * q + 1 < k ? lo + ldb : nullptr, cols, width, panels + t * panel_words + q * width);
    }
  }
}

// Panel p (32 wide) of a transposed right operand, b [n, k] (row stride ldb): column j of the panel is
// row j0 + j of b, whose pairs are adjacent words: the panel is a transpose of those rows' words,
// done 16 rows by 16 pairs in registers. Word by word it took 7-23 us (median of five runs 19) of a
// 1.1 ms input gradient g W^T on the deep MLP's shapes, now 5-18 us (median 9; 2 threads, Zen 5,
// the product with and without its packing, alternating in one process). Meanwhile the next
// panel's rows are fetched, a few lines per block (the weight of an input gradient, kept since the
// forward pass, comes from memory): on the deep MLP's bf16 step, steps alternating in one process,
// 0.55-0.6% faster by the best step.
void pack_transposed(const std::uint16_t* b, std::int64_t ldb, std::int64_t k, std::int64_t n, std::int64_t p,
                     std::uint32_t* panel) {
  const std::int64_t j0 = p * kPanelCols, cols = std::min(kPanelCols, n - j0), pairs = (k + 1) / 2, full = k / 2;
  const std::int64_t blocks = full / 16, groups = cols / 16;
  detail::FetchAhead ahead = detail::FetchAhead::rows(b, 2, ldb, k, std::min(n, j0 + kPanelCols), std::min(n, j0 + 2 * kPanelCols),
                                                      groups * blocks + (cols - groups * 16));
  // (one row's pairs from q0 on, word by word)
  const auto rest_of_row = [&](std::int64_t j, std::int64_t q0) {
    const std::uint16_t* row = b + (j0 + j) * ldb;
    for (std::int64_t q = q0; q < full; ++q) std::memcpy(panel + q * kPanelCols + j, row + 2 * q, 4);
    if (k & 1) panel[full * kPanelCols + j] = row[k - 1];
  };
  for (std::int64_t g = 0; g < groups; ++g) {
    for (std::int64_t q0 = 0; q0 < blocks * 16; q0 += 16) {
      ahead.step();
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(b + (j0 + g * 16 + i) * ldb + 2 * q0);
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_store_si512(panel + (q0 + i) * kPanelCols + g * 16, r[i]);
    }
    for (std::int64_t j = g * 16; j < g * 16 + 16; ++j) rest_of_row(j, blocks * 16);
  }
  for (std::int64_t j = groups * 16; j < cols; ++j) {
    ahead.step();
    rest_of_row(j, 0);
  }
  for (std::int64_t q = 0; q < pairs; ++q)
    for (std::int64_t j = cols; j < kPanelCols; ++j) panel[q * kPanelCols + j] = 0;
}

__m512 widen_bias(const std::uint16_t* bias, __mmask16 mask) {
  return bias == nullptr ? _mm512_setzero_ps() : widen_bf16(_mm256_maskz_loadu_epi16(mask, bias));
}

// The work a tile's product runs on the side: the previous tile's pairs, table[z[j]] into staged[j]
// for j < count (count even); and `fetch`'s lines, spread over the steps of the sum
// (detail::fetch_evenly).
struct SideLookups {
  const std::uint32_t* table = nullptr;
  const std::uint16_t* z = nullptr;
  std::uint32_t* staged = nullptr;
  int count = 0;
  detail::TileFetch fetch;
  float* z_f32 = nullptr;  // when set: the rounded values widened to float32 there (row stride ldo), not into out
  const std::uint16_t* scale = nullptr;  // when set: the rounded values times these (row stride ldo), rounded again
  float* sums = nullptr;                 // with scale: the tile's column sums of those products
  bool selects = false;                  // with scale: the value where the scale's is > 0, else 0, not rounded again
};

static_assert(kScaledSumRows == kTileRows, "Bf16ProductOut::tile_sums are per row tile");

// One tile: rows [0, R) of A times one panel, plus the bias, rounded to bf16 into out (row stride
// ldo; columns masked by m0, m1). A is row-major (row stride lda), or with PackedA a packed panel of
// a transposed A (pack_rows, kTileRows wide: its odd k is already zero-padded). Runs `side`'s lookups
// between its multiply-adds.
template <int R, bool Side, bool PackedA>
void tile(std::int64_t k, const std::uint16_t* a, std::int64_t lda, const std::uint32_t* panel, const std::uint16_t* bias,
          __mmask16 m0, __mmask16 m1, std::uint16_t* out, std::int64_t ldo, const SideLookups& side) {
  __m512 acc0[R], acc1[R];
#pragma GCC unroll 14
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  const std::int64_t pairs = PackedA ? (k + 1) / 2 : k / 2;
  int j = 0;
  std::int64_t fetched = 0;
  for (std::int64_t q = 0; q < pairs; ++q) {
    if (side.fetch.from != nullptr) detail::fetch_evenly(side.fetch, q, pairs, fetched);
    const __m512bh b0 = (__m512bh)_mm512_load_si512(panel + q * kPanelCols);
    const __m512bh b1 = (__m512bh)_mm512_load_si512(panel + q * kPanelCols + 16);
#pragma GCC unroll 14
    for (int r = 0; r < R; ++r) {
      std::int32_t pair;
      std::memcpy(&pair, PackedA ? a + 2 * (q * kTileRows + r) : a + r * lda + 2 * q, 4);
      const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
      acc0[r] = _mm512_dpbf16_ps(acc0[r], av, b0);
      acc1[r] = _mm512_dpbf16_ps(acc1[r], av, b1);
    }
    if constexpr (Side) {
      if (j < side.count) {
        side.staged[j] = side.table[side.z[j]];
        side.staged[j + 1] = side.table[side.z[j + 1]];
        j += 2;
      }
    }
  }
  if (!PackedA && (k & 1)) {  // the last, odd, column of A: its pair's high half is zero, whatever lies past the row
    const __m512bh b0 = (__m512bh)_mm512_load_si512(panel + pairs * kPanelCols);
    const __m512bh b1 = (__m512bh)_mm512_load_si512(panel + pairs * kPanelCols + 16);
#pragma GCC unroll 14
    for (int r = 0; r < R; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<std::int32_t>(a[r * lda + 2 * pairs]));
      acc0[r] = _mm512_dpbf16_ps(acc0[r], av, b0);
      acc1[r] = _mm512_dpbf16_ps(acc1[r], av, b1);
    }
  }
  if constexpr (Side)
    for (; j < side.count; ++j) side.staged[j] = side.table[side.z[j]];
  const __m512 bias0 = widen_bias(bias, m0), bias1 = widen_bias(bias == nullptr ? nullptr : bias + 16, m1);
  const __mmask32 mask = static_cast<__mmask32>(m0) | static_cast<__mmask32>(m1) << 16;
  if (side.scale != nullptr) {  // z times the scale, rounded again; the tile's column sums of the products
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512i z = (__m512i)_mm512_cvtne2ps_pbh(_mm512_add_ps(acc1[r], bias1), _mm512_add_ps(acc0[r], bias0));
      const __m512 z0 = widen_bf16(_mm512_castsi512_si256(z)), z1 = widen_bf16(_mm512_extracti64x4_epi64(z, 1));
      const __m512 s0 = widen_bf16(_mm256_maskz_loadu_epi16(m0, side.scale + r * ldo));
      const __m512 s1 = widen_bf16(_mm256_maskz_loadu_epi16(m1, side.scale + r * ldo + 16));
      if (side.selects) {  // z where the scale is > 0, else +0 (exact: no second rounding)
        const __mmask16 k0 = _mm512_cmp_ps_mask(s0, _mm512_setzero_ps(), _CMP_GT_OQ);
        const __mmask16 k1 = _mm512_cmp_ps_mask(s1, _mm512_setzero_ps(), _CMP_GT_OQ);
        if (side.sums != nullptr) {
          sum0 = _mm512_add_ps(sum0, _mm512_maskz_mov_ps(k0, z0));
          sum1 = _mm512_add_ps(sum1, _mm512_maskz_mov_ps(k1, z1));
        }
        _mm512_mask_storeu_epi16(out + r * ldo, mask,
                                 _mm512_maskz_mov_epi16(static_cast<__mmask32>(k0) | static_cast<__mmask32>(k1) << 16, z));
        continue;
      }
      const __m512 p0 = _mm512_mul_ps(z0, s0), p1 = _mm512_mul_ps(z1, s1);
      if (side.sums != nullptr) {
        sum0 = _mm512_add_ps(sum0, p0);
        sum1 = _mm512_add_ps(sum1, p1);
      }
      // (vcvtne2ps2bf16 rounds as round_bits but flushes a subnormal input to zero: those, only
      // without flushing, take the integer rounding)
      const __mmask16 sub0 = _mm512_fpclass_ps_mask(p0, 0x20), sub1 = _mm512_fpclass_ps_mask(p1, 0x20);
      const __m512i rounded =
          (sub0 | sub1) == 0 ? (__m512i)_mm512_cvtne2ps_pbh(p1, p0)
                             : _mm512_inserti64x4(_mm512_castsi256_si512(round_to_bf16(p0)), round_to_bf16(p1), 1);
      _mm512_mask_storeu_epi16(out + r * ldo, mask, rounded);
    }
    if (side.sums != nullptr) {
      _mm512_mask_storeu_ps(side.sums, m0, sum0);
      _mm512_mask_storeu_ps(side.sums + 16, m1, sum1);
    }
    return;
  }
#pragma GCC unroll 14
  for (int r = 0; r < R; ++r) {
    const __m512bh z = _mm512_cvtne2ps_pbh(_mm512_add_ps(acc1[r], bias1), _mm512_add_ps(acc0[r], bias0));
    if (side.z_f32 != nullptr) {
      const __m512i bits = (__m512i)z;
      _mm512_mask_storeu_ps(side.z_f32 + r * ldo, m0, widen_bf16(_mm512_castsi512_si256(bits)));
      _mm512_mask_storeu_ps(side.z_f32 + r * ldo + 16, m1, widen_bf16(_mm512_extracti64x4_epi64(bits, 1)));
    } else {
      _mm512_mask_storeu_epi16(out + r * ldo, mask, (__m512i)z);
    }
  }
}

using TileFn = void (*)(std::int64_t, const std::uint16_t*, std::int64_t, const std::uint32_t*, const std::uint16_t*,
                        __mmask16, __mmask16, std::uint16_t*, std::int64_t, const SideLookups&);
template <bool Side, bool PackedA, int... R>
constexpr auto tiles(std::integer_sequence<int, R...>) {
  return std::array<TileFn, sizeof...(R)>{tile<R + 1, Side, PackedA>...};
}
// [packed A][rows - 1]
constexpr std::array<std::array<TileFn, kTileRows>, 2> kPlainTiles{tiles<false, false>(std::make_integer_sequence<int, kTileRows>{}),
                                                                tiles<false, true>(std::make_integer_sequence<int, kTileRows>{})};
constexpr std::array<std::array<TileFn, kTileRows>, 2> kSideTiles{tiles<true, false>(std::make_integer_sequence<int, kTileRows>{}),
                                                               tiles<true, true>(std::make_integer_sequence<int, kTileRows>{})};

// A tile's staged pairs (rows x 32, columns masked) split into its rows of y and d: y with plain
// stores (the next layer reads it soon), d around the caches when whole aligned lines.
void write_pairs(const std::uint32_t* staged, int rows, __mmask16 m0, __mmask16 m1, std::uint16_t* y, std::uint16_t* d,
                 std::int64_t ld) {
  const __mmask32 mask = static_cast<__mmask32>(m0) | static_cast<__mmask32>(m1) << 16;
  for (int r = 0; r < rows; ++r) {
    const __m512i t0 = _mm512_load_si512(staged + r * kPanelCols), t1 = _mm512_load_si512(staged + r * kPanelCols + 16);
    const __m512i first = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(t0)), _mm512_cvtepi32_epi16(t1), 1);
    const __m512i second = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(_mm512_srli_epi32(t0, 16))),
                                              _mm512_cvtepi32_epi16(_mm512_srli_epi32(t1, 16)), 1);
    std::uint16_t* yr = y + r * ld;
    std::uint16_t* dr = d + r * ld;
    _mm512_mask_storeu_epi16(yr, mask, first);
    if (mask == 0xFFFFFFFFu && reinterpret_cast<std::uintptr_t>(dr) % 64 == 0) _mm512_stream_si512(reinterpret_cast<__m512i*>(dr), second);
    else _mm512_mask_storeu_epi16(dr, mask, second);
  }
}

// Where a product's operands are, packed or not.
struct PanelOperands {
  std::int64_t m, n, k;
  const std::uint16_t* a;      // row-major [m, k] (row stride k), when a_panels is null
  const std::uint32_t* a_panels;  // else a transposed A packed kTileRows columns per panel
  std::int64_t a_panel_words;
  const std::uint32_t* panels;  // B, 32 columns per panel
  std::int64_t panel_words;
  const std::uint16_t* bias;
};

// Row tiles [t0, t1) times panels [p0, p1) of the product, on the calling thread.
void run_tiles(const PanelOperands& o, std::int64_t t0, std::int64_t t1, std::int64_t p0, std::int64_t p1,
               const Bf16ProductOut& out) {
  const std::int64_t m = o.m, n = o.n, k = o.k;
  const bool packed_a = o.a_panels != nullptr;
  auto a_rows = [&](std::int64_t t) {
    return packed_a ? reinterpret_cast<const std::uint16_t*>(o.a_panels + t * o.a_panel_words) : o.a + t * kTileRows * k;
  };
  auto bias_at = [&](std::int64_t j0) { return o.bias == nullptr ? nullptr : o.bias + j0; };
  // (the next row tile's rows, or its packed panel: panel_schedule_internal.hpp)
  auto next_rows = [&](std::int64_t t, std::int64_t p) {
    SideLookups s;
    if (p == p0)
      s.fetch = packed_a ? detail::next_tile_panel(o.a_panels, m, o.a_panel_words * 4, t) : detail::next_tile_rows(o.a, m, k * 2, t);
    return s;
  };
  if (out.pair_table == nullptr) {
    auto* z = reinterpret_cast<std::uint16_t*>(out.z);
    const auto* scale = reinterpret_cast<const std::uint16_t*>(out.scale);
    auto next = [&](std::int64_t t, std::int64_t p) {
      SideLookups s = next_rows(t, p);
      if (out.z_f32 != nullptr) s.z_f32 = out.z_f32 + t * kTileRows * n + p * kPanelCols;
      if (scale != nullptr) {
        s.selects = out.scale_selects;
        s.scale = scale + t * kTileRows * n + p * kPanelCols;
        if (out.tile_sums != nullptr) s.sums = out.tile_sums + t * n + p * kPanelCols;
      }
      return s;
    };
    for (std::int64_t t = t0; t < t1; ++t) {
      const std::int64_t i0 = t * kTileRows;
      const int rows = static_cast<int>(std::min<std::int64_t>(kTileRows, m - i0));
      for (std::int64_t p = p0; p < p1; ++p) {
        const std::int64_t j0 = p * kPanelCols;
        // The scale's lines of the tile, fetched now for its epilogue (a derivative kept since the
        // forward pass: in memory). A tile's sum takes longer than their trip.
        if (scale != nullptr)
          for (int r = 0; r < rows; ++r) _mm_prefetch(reinterpret_cast<const char*>(scale + (i0 + r) * n + j0), _MM_HINT_T0);
        kPlainTiles[packed_a][rows - 1](k, a_rows(t), k, o.panels + p * o.panel_words, bias_at(j0), lanes(n - j0),
                                        lanes(n - j0 - 16), z == nullptr ? nullptr : z + i0 * n + j0, n, next(t, p));
      }
    }
    return;
  }
  // The pair epilogue, software-pipelined: tile i's z goes to a small buffer; tile i + 1's product
  // looks its pairs up on the side, then they are written out.
  // (zeroed: a tile's columns past n are never written, but their lookups still read them)
  alignas(64) std::uint16_t z_tiles[2][kTileRows * kPanelCols] = {};
  alignas(64) std::uint32_t staged[kTileRows * kPanelCols];
  auto* y = reinterpret_cast<std::uint16_t*>(out.y);
  auto* d = reinterpret_cast<std::uint16_t*>(out.d);
  struct Pending {
    int rows = 0;
    std::int64_t i0 = 0, j0 = 0;
  } pending;
  int current = 0;
  auto flush = [&] {
    if (pending.rows == 0) return;
    write_pairs(staged, pending.rows, lanes(n - pending.j0), lanes(n - pending.j0 - 16), y + pending.i0 * n + pending.j0,
                d + pending.i0 * n + pending.j0, n);
  };
  for (std::int64_t t = t0; t < t1; ++t) {
    const std::int64_t i0 = t * kTileRows;
    const int rows = static_cast<int>(std::min<std::int64_t>(kTileRows, m - i0));
    for (std::int64_t p = p0; p < p1; ++p) {
      const std::int64_t j0 = p * kPanelCols;
      // The tile's lines of y, fetched for writing now: they are written one tile later, and y is new
      // memory (a step's forward writes 2 MB of it per MLP layer), whose stores would wait for them.
      for (int r = 0; r < rows; ++r) _mm_prefetch(reinterpret_cast<const char*>(y + (i0 + r) * n + j0), _MM_HINT_ET0);
      SideLookups side = next_rows(t, p);
      side.table = out.pair_table;
      side.z = z_tiles[current ^ 1];
      side.staged = staged;
      side.count = pending.rows * static_cast<int>(kPanelCols);
      (pending.rows > 0 ? kSideTiles : kPlainTiles)[packed_a][rows - 1](
          k, a_rows(t), k, o.panels + p * o.panel_words, bias_at(j0), lanes(n - j0), lanes(n - j0 - 16), z_tiles[current],
          kPanelCols, side);
      flush();
      pending = Pending{rows, i0, j0};
      current ^= 1;
    }
  }
  if (pending.rows > 0) {
    for (int j = 0; j < pending.rows * kPanelCols; ++j) staged[j] = out.pair_table[z_tiles[current ^ 1][j]];
    flush();
  }
  _mm_sfence();  // the streamed rows of d are visible before the team's barrier
}

// The product; with b_f32 (not tb), b_rounded is b: b_f32 rounded to bf16 into it as it is packed,
// pair chunk by pair chunk (the rows in cache for the packing that follows).
void panels_product(std::int64_t m, std::int64_t n, std::int64_t k, const bfloat16* a, bool ta, const bfloat16* b, bool tb,
                    const bfloat16* bias, const Bf16ProductOut& out, const float* b_f32 = nullptr,
                    bfloat16* b_rounded = nullptr) {
  if (m == 0 || n == 0) return;
  constexpr std::int64_t kPairChunk = 16;  // pairs of rows packed at a time
  const std::int64_t k_pairs = (k + 1) / 2, pair_chunks = (k_pairs + kPairChunk - 1) / kPairChunk;
  const std::int64_t pairs = std::max<std::int64_t>(k_pairs, 1);  // a panel's rows (one, zero, when k = 0)
  const std::int64_t panel_count = (n + kPanelCols - 1) / kPanelCols, panel_words = pairs * kPanelCols;
  const std::int64_t row_tiles = (m + kTileRows - 1) / kTileRows;
  // The packed operands: Arrays, so the memory accounting counts them (64-byte aligned; a panel of
  // A is padded to whole cache lines).
  const std::int64_t a_panel_words = ta ? (pairs * kTileRows + 15) / 16 * 16 : 0;
  Array packed = Array::empty(Shape{panel_count * panel_words + row_tiles * a_panel_words}, DType::f32);
  auto* panels = static_cast<std::uint32_t*>(packed.mutable_raw());
  std::uint32_t* a_panels = ta ? panels + panel_count * panel_words : nullptr;
  const auto* a16 = reinterpret_cast<const std::uint16_t*>(a);
  const auto* b16 = reinterpret_cast<const std::uint16_t*>(b);
  const PanelOperands o{m, n, k, a16, a_panels, a_panel_words, panels, panel_words, reinterpret_cast<const std::uint16_t*>(bias)};
  // Panels in groups, row tiles in items (panel_schedule_internal.hpp).
  const detail::PanelSchedule schedule(m, panel_count, panel_words * 4, kTileRows);
  const double work = static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  detail::run_panel_product(
      work, tb ? panel_count : pair_chunks,
      [&](std::int64_t u) {
        if (tb) pack_transposed(b16, k, k, n, u, panels + u * panel_words);
        else {
          if (b_f32 != nullptr)
            f32_to_bf16(b_f32 + 2 * u * kPairChunk * n, b_rounded + 2 * u * kPairChunk * n,
                        (std::min(k, 2 * (u + 1) * kPairChunk) - 2 * u * kPairChunk) * n);
          pack_rows(b16, n, k, n, kPanelCols, panels, panel_words, u * kPairChunk, std::min(k_pairs, (u + 1) * kPairChunk), b_f32);
        }
      },
      ta ? pair_chunks : 0,
      [&](std::int64_t u) {
        pack_rows(a16, m, k, m, kTileRows, a_panels, a_panel_words, u * kPairChunk, std::min(k_pairs, (u + 1) * kPairChunk));
      },
      schedule, [&](const detail::PanelSchedule::Item& it) { run_tiles(o, it.t0, it.t1, it.p0, it.p1, out); });
}

}  // namespace

void gemm_bf16_panels(std::int64_t m, std::int64_t n, std::int64_t k, const bfloat16* a, bool ta, const bfloat16* b,
                      bool tb, const bfloat16* bias, const Bf16ProductOut& out) {
  panels_product(m, n, k, a, ta, b, tb, bias, out);
}

void gemm_bf16_panels_f32_b(std::int64_t m, std::int64_t n, std::int64_t k, const bfloat16* a, const float* b_f32,
                            bfloat16* b_rounded, const bfloat16* bias, const Bf16ProductOut& out) {
  if (m == 0 || n == 0) {  // no product to pack for; b_rounded is still written
    f32_to_bf16(b_f32, b_rounded, k * n);
    return;
  }
  panels_product(m, n, k, a, false, b_rounded, false, bias, out, b_f32, b_rounded);
}

#else

void gemm_bf16_panels(std::int64_t, std::int64_t, std::int64_t, const bfloat16*, bool, const bfloat16*, bool,
                      const bfloat16*, const Bf16ProductOut&) {
  throw Error("gemm_bf16_panels: this build has no AVX512-BF16 kernel (check bf16_panels_available() first)");
}
void gemm_bf16_panels_f32_b(std::int64_t, std::int64_t, std::int64_t, const bfloat16*, const float*, bfloat16*,
                            const bfloat16*, const Bf16ProductOut&) {
  throw Error("gemm_bf16_panels_f32_b: this build has no AVX512-BF16 kernel (check bf16_panels_available() first)");
}

#endif

}  // namespace linum::kernels
