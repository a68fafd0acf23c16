// Serial float32 products on AVX2 with FMA: Linum's own kernel for CPUs without AVX-512 (AMD's Zen 3
// and earlier, Intel's client cores). See gemm.hpp for the contract and where the engine uses it
// (uses_f32_avx2).
//
// Why our own kernel: on an AVX2 CPU (AMD EPYC Zen 3, one thread) oneDNN 2.6's products run the
// fused recurrent layers' shapes at half the FMA units' speed: the LSTM's per-step product, 16 rows
// by a packed 256 x 1024 kernel, at 47 GFLOP/s, and the weight gradients (h^T . d_gates, a
// transposed left operand) at 46; this kernel runs them at 78-100 (measured numbers: engine.cpp,
// uses_f32_avx2).
//
// Layout. The right operand is packed into panels of kAvx2PanelCols (16) columns: panel p holds, for
// each row q, the 16 floats b[q, 16 p .. 16 p + 15], zero past n; a panel is contiguous (k x 64
// bytes). A tile is up to kTileRows (6) rows by one panel: 12 float32 accumulators of 8 lanes in
// registers, two panel registers and a broadcast of 16 ymm registers; each element of a row of A
// is one broadcast. A is read where it is when row-major; transposed (a [k, m]), a block's chunk is
// first copied tile by tile, a term's rows side by side (gemm_f32_avx2_packed says why). Rows go in
// blocks of about kRowBlockBytes of A (which stay in L2), sums in depth chunks of kDepthChunk;
// within them the panels in turn, so a panel's chunk stays in L1 while every row tile of the block
// passes over it.
//
// Order of the sums: each output element is summed over k in order (one fused multiply-add per
// term, from zero, or from c's value when alpha and beta are 1; a chunk's partial sums wait in c),
// then scaled by alpha and added to beta * c. The result depends only on the operands, so a
// recomputation is bitwise equal to the forward pass.
#include <linum/core/error.hpp>
#include <linum/core/fp_mode.hpp>
#include <linum/core/kernels/gemm.hpp>
#include <linum/core/kernels/transpose_internal.hpp>
#include <linum/core/threading.hpp>

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <utility>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LINUM_F32_AVX2 1
#else
#define LINUM_F32_AVX2 0
#endif

namespace linum::kernels {

bool f32_avx2_available() { return LINUM_F32_AVX2 != 0; }

std::int64_t avx2_packed_floats(std::int64_t k, std::int64_t n) {
  return (n + kAvx2PanelCols - 1) / kAvx2PanelCols * std::max<std::int64_t>(k, 1) * kAvx2PanelCols;
}

#if LINUM_F32_AVX2
namespace {

constexpr int kTileRows = 6;
constexpr std::int64_t kRowBlockBytes = 192 * 1024, kDepthChunk = 256;
constexpr std::int64_t kTeamPieceRows = 128;  // gemm_f32_avx2's rows per work item

// The first n lanes (0 <= n) of 8, as a mask for the masked loads and stores.
__m256i lanes(std::int64_t n) {
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::clamp<std::int64_t>(n, 0, 8))), index);
}

// How a tile's sums start and end: from zero, or chained on from c's values (the first part of a
// sum split over depth chunks left them there, or beta and alpha are 1); at the end times alpha,
// plus beta * c when beta is not 0 (c then read; only with start from zero).
struct TileEnds {
  bool from_c = false;
  float alpha = 1.0f, beta = 0.0f;
};

// The tile after this one (its rows and columns of c), whose c the tile fetches ahead into L1 while
// it sums: chunk after chunk, a block's c is read again from farther out than L2 (its panels and
// its rows of A pass through L2 in between), and a tile waits on its first loads otherwise. None
// after the last tile.
struct NextTile {
  const float* c = nullptr;
  int rows = 0;
  std::int64_t cols = 0;
};

// One tile: rows [0, R) of op(A) times one panel into c (row stride ldc), `cols` (1..16) of its
// columns read and written. A is row-major (row r at a + r * lda) or, with TA, transposed (row r's
// element q at a + q * lda + r).
template <int R, bool TA>
void tile(std::int64_t k, const float* a, std::int64_t lda, const float* panel, TileEnds ends, float* c, std::int64_t ldc,
          std::int64_t cols, NextTile next) {
  const bool whole = cols == kAvx2PanelCols;
  const __m256i m0 = whole ? _mm256_set1_epi32(-1) : lanes(cols), m1 = whole ? m0 : lanes(cols - 8);
  __m256 acc0[R], acc1[R];
  if (ends.from_c) {
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      acc0[r] = _mm256_maskload_ps(c + r * ldc, m0);
      acc1[r] = _mm256_maskload_ps(c + r * ldc + 8, m1);
    }
  } else {
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  }
  for (int r = 0; r < next.rows; ++r) {  // (for writing: c is read, then written)
    __builtin_prefetch(next.c + r * ldc, 1, 3);
    __builtin_prefetch(next.c + r * ldc + next.cols - 1, 1, 3);
  }
  for (std::int64_t q = 0; q < k; ++q) {
    const __m256 b0 = _mm256_load_ps(panel + q * kAvx2PanelCols);
    const __m256 b1 = _mm256_load_ps(panel + q * kAvx2PanelCols + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_broadcast_ss(TA ? a + q * lda + r : a + r * lda + q);
      acc0[r] = _mm256_fmadd_ps(av, b0, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(av, b1, acc1[r]);
    }
  }
  const __m256 va = _mm256_set1_ps(ends.alpha), vb = _mm256_set1_ps(ends.beta);
  auto result = [&](__m256 sum, const float* old, __m256i mask) {
    const __m256 scaled = ends.alpha == 1.0f ? sum : _mm256_mul_ps(va, sum);
    if (ends.beta == 0.0f) return scaled;
    const __m256 before = _mm256_maskload_ps(old, mask);
    return _mm256_add_ps(scaled, ends.beta == 1.0f ? before : _mm256_mul_ps(vb, before));
  };
  if (whole) {
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      float* row = c + r * ldc;
      _mm256_storeu_ps(row, result(acc0[r], row, m0));
      _mm256_storeu_ps(row + 8, result(acc1[r], row + 8, m1));
    }
    return;
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    float* row = c + r * ldc;
    _mm256_maskstore_ps(row, m0, result(acc0[r], row, m0));
    _mm256_maskstore_ps(row + 8, m1, result(acc1[r], row + 8, m1));
  }
}

using TileFn = void (*)(std::int64_t, const float*, std::int64_t, const float*, TileEnds, float*, std::int64_t, std::int64_t,
                        NextTile);
template <bool TA, int... R>
constexpr auto tiles(std::integer_sequence<int, R...>) {
  return std::array<TileFn, sizeof...(R)>{tile<R + 1, TA>...};
}
// [transposed A][rows - 1]
constexpr std::array<std::array<TileFn, kTileRows>, 2> kTiles{tiles<false>(std::make_integer_sequence<int, kTileRows>{}),
                                                           tiles<true>(std::make_integer_sequence<int, kTileRows>{})};

// A tile's rows of A packed by gemm_f32_avx2_packed: kPackedRows floats a term (the tile's rows, the
// rest unused), terms in order.
constexpr std::int64_t kPackedRows = 8;

// The calling thread's buffer for a block's chunk of A, packed: at most a block's tiles (a block
// holds about kRowBlockBytes of A) of kPackedRows x kDepthChunk floats, fixed, allocated on the
// thread's first use and kept (a kernel's scratch, as its registers: not an Array, so not in the
// memory accounting).
float* a_scratch() {
  constexpr std::size_t kFloats = kRowBlockBytes / 4 / kTileRows * kPackedRows + kPackedRows * kDepthChunk;
  thread_local std::unique_ptr<float[]> buffer(new float[kFloats]);
  return buffer.get();
}

// Rows [i, i + rows) of op(A) (rows <= kTileRows) of m, A transposed (a[r, q] at a + q * lda + r),
// terms [q0, q0 + depth), into `to` as to[q * kPackedRows + r].
void pack_a_tile(const float* a, std::int64_t lda, std::int64_t m, std::int64_t i, std::int64_t q0, int rows,
                 std::int64_t depth, float* to) {
  const float* from = a + q0 * lda + i;
  if (i + 8 <= m) {  // (8 floats a term, past the tile's rows but within op(A)'s: masked moves are slow)
    for (std::int64_t q = 0; q < depth; ++q) _mm256_storeu_ps(to + q * kPackedRows, _mm256_loadu_ps(from + q * lda));
    return;
  }
  const __m256i mask = lanes(rows);
  for (std::int64_t q = 0; q < depth; ++q) _mm256_storeu_ps(to + q * kPackedRows, _mm256_maskload_ps(from + q * lda, mask));
}

}  // namespace

void pack_f32_avx2(const float* b, std::int64_t ldb, bool tb, std::int64_t k, std::int64_t n, float* packed) {
  const std::int64_t depth = std::max<std::int64_t>(k, 1);
  for (std::int64_t j0 = 0; j0 < n; j0 += kAvx2PanelCols) {
    const std::int64_t cols = std::min(kAvx2PanelCols, n - j0);
    float* panel = packed + j0 * depth;
    if (k == 0) {
      std::fill(panel, panel + kAvx2PanelCols, 0.0f);
      continue;
    }
    if (tb) {  // column j of the panel is row j0 + j of b; columns past n zero
      transpose_into(b + j0 * ldb, ldb, cols, k, panel, kAvx2PanelCols);
      if (cols < kAvx2PanelCols)
        for (std::int64_t q = 0; q < k; ++q) std::fill(panel + q * kAvx2PanelCols + cols, panel + (q + 1) * kAvx2PanelCols, 0.0f);
      continue;
    }
    const __m256i m0 = lanes(cols), m1 = lanes(cols - 8);
    for (std::int64_t q = 0; q < k; ++q) {
      const float* row = b + q * ldb + j0;
      _mm256_store_ps(panel + q * kAvx2PanelCols, _mm256_maskload_ps(row, m0));
      _mm256_store_ps(panel + q * kAvx2PanelCols + 8, _mm256_maskload_ps(row + 8, m1));
    }
  }
}

void gemm_f32_avx2_packed(std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a, std::int64_t lda,
                          bool ta, const float* packed_b, float beta, float* c, std::int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  const std::int64_t depth = std::max<std::int64_t>(k, 1);
  // alpha = beta = 1: each sum chained on from c's value. Else alpha * sum + beta * c.
  const bool chain_c = alpha == 1.0f && beta == 1.0f;
  // Long sums in chunks of kDepthChunk, each chunk's partial sums left in c and chained on by the
  // next (the same fused multiply-adds in the same order as one pass), so that a chunk of a panel
  // stays in L1 and the rows' chunks of A in L2 while the tiles pass over them. Not with beta * c
  // to add at the end (c holds the partial sums meanwhile), other than chained.
  const std::int64_t chunk = chain_c || beta == 0.0f ? std::min(depth, kDepthChunk) : depth;
  // Rows in blocks whose chunk of A stays in L2 while the panels pass (a whole number of tiles).
  const std::int64_t block = std::max<std::int64_t>(kTileRows, kRowBlockBytes / (4 * chunk) / kTileRows * kTileRows);
  // A transposed (a [k, m]) is read a row of a per term, lda apart: over a chunk that strides
  // through a few L1 sets only, evicting the panel. With two or more panels to pass over it, the
  // block's chunk of A is copied first, tile by tile, each tile's rows of a term side by side
  // (kPackedRows floats a term), and the tile reads one stream (kTiles[true] with lda =
  // kPackedRows). 2 threads, AMD EPYC Zen 3, the deep MLP's weight gradient [2048, 512]^T [2048,
  // 512]: 163-165 GFLOP/s against 118-134 (in cache, alternating runs); its float32 step, steps
  // alternating in one process: 5% faster (median of 24 paired steps; the forward and input-gradient
  // products on oneDNN). A row-major A, read as one stream per row, was slower copied the same way
  // through register transposes (the MLP's forward product 147-155 against 164-178).
  const bool pack_a = ta && n > kAvx2PanelCols && chunk <= kDepthChunk;
  float* a_packed = pack_a ? a_scratch() : nullptr;
  for (std::int64_t i0 = 0; i0 < m; i0 += block) {
    const std::int64_t i1 = std::min(m, i0 + block);
    // Tiles of kTileRows rows, the last few sharing what is left evenly (16 rows: 6, 5, 5): a tile
    // of 4 rows or fewer has too few sums in flight to hide the multiply-adds' latency.
    const std::int64_t count = (i1 - i0 + kTileRows - 1) / kTileRows, full = std::max<std::int64_t>(0, count - 3);
    const std::int64_t rest = i1 - i0 - full * kTileRows, shared = count - full;
    auto tile_rows = [&](std::int64_t t) {
      const std::int64_t s = t - full;
      return static_cast<int>(s < 0 ? kTileRows : rest / shared + (s < rest % shared ? 1 : 0));
    };
    for (std::int64_t q0 = 0; q0 < std::max<std::int64_t>(k, 1); q0 += chunk) {
      const std::int64_t depth_here = std::min(chunk, k - q0);  // (0 when k is 0)
      if (pack_a)
        for (std::int64_t t = 0, i = i0; t < count; ++t) {
          const int rows = tile_rows(t);
          pack_a_tile(a, lda, m, i, q0, rows, depth_here, a_packed + t * kPackedRows * chunk);
          i += rows;
        }
      TileEnds ends;
      ends.from_c = q0 > 0 || chain_c;
      ends.alpha = q0 + chunk >= k ? alpha : 1.0f;
      ends.beta = chain_c ? 0.0f : beta;
      for (std::int64_t j0 = 0; j0 < n; j0 += kAvx2PanelCols) {
        const float* panel = packed_b + j0 * depth + q0 * kAvx2PanelCols;
        const std::int64_t cols = std::min(kAvx2PanelCols, n - j0);
        for (std::int64_t t = 0, i = i0; t < count; ++t) {
          const int rows = tile_rows(t);
          float* c_tile = c + i * ldc + j0;
          // Next: the tile below, else the block's top tile in the next panel, else in the first
          // panel for the next chunk.
          const std::int64_t next_j0 = j0 + kAvx2PanelCols;
          NextTile next;
          if (t + 1 < count) next = {c_tile + rows * ldc, tile_rows(t + 1), cols};
          else if (next_j0 < n) next = {c + i0 * ldc + next_j0, tile_rows(0), std::min(kAvx2PanelCols, n - next_j0)};
          else if (q0 + chunk < k) next = {c + i0 * ldc, tile_rows(0), std::min(kAvx2PanelCols, n)};
          const float* a_tile = pack_a ? a_packed + t * kPackedRows * chunk : ta ? a + q0 * lda + i : a + i * lda + q0;
          kTiles[ta][rows - 1](depth_here, a_tile, pack_a ? kPackedRows : lda, panel, ends, c_tile, ldc, cols, next);
          i += rows;
        }
      }
    }
  }
}

void gemm_f32_avx2_serial(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
                          std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  // The packed operand: an Array, so the memory accounting counts it (64-byte aligned).
  Array packed = Array::empty(Shape{avx2_packed_floats(k, n)});
  pack_f32_avx2(b, ldb, tb, k, n, packed.mutable_data());
  gemm_f32_avx2_packed(m, n, k, alpha, a, lda, ta, packed.data(), beta, c, ldc);
}

void gemm_f32_avx2(std::int64_t m, std::int64_t n, std::int64_t k, const float* a, bool ta, const float* b, bool tb,
                   float* out) {
  if (m <= 0 || n <= 0) return;
  const std::int64_t lda = ta ? m : k, ldb = tb ? k : n, depth = std::max<std::int64_t>(k, 1);
  const std::int64_t panels = (n + kAvx2PanelCols - 1) / kAvx2PanelCols, pieces = (m + kTeamPieceRows - 1) / kTeamPieceRows;
  // The packed operand: an Array (counted by the memory accounting), packed by the team panel by
  // panel, then the row pieces dealt dynamically: each element is summed on one thread in the same
  // order whatever the team, so the bits never depend on it.
  Array packed = Array::empty(Shape{avx2_packed_floats(k, n)});
  float* panels_at = packed.mutable_data();
  [[maybe_unused]] int threads = 1;
#ifdef _OPENMP
  const double work = static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  if (!omp_in_parallel() && work >= kParallelGemmWork) threads = team_size();
#pragma omp parallel num_threads(threads) if (threads > 1)
#endif
  {
    linum::detail::enter_compute();
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (std::int64_t p = 0; p < panels; ++p) {
      const std::int64_t j0 = p * kAvx2PanelCols;
      pack_f32_avx2(tb ? b + j0 * ldb : b + j0, ldb, tb, k, std::min(kAvx2PanelCols, n - j0), panels_at + j0 * depth);
    }
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
    for (std::int64_t piece = 0; piece < pieces; ++piece) {
      const std::int64_t r0 = piece * kTeamPieceRows, rows = std::min(kTeamPieceRows, m - r0);
      gemm_f32_avx2_packed(rows, n, k, 1.0f, ta ? a + r0 : a + r0 * lda, lda, ta, panels_at, 0.0f, out + r0 * n, n);
    }
  }
}

#else

namespace {
[[noreturn]] void no_avx2() {
  throw Error("the AVX2 float32 kernel: this build has no AVX2 and FMA (check f32_avx2_available() first)");
}
}  // namespace
void pack_f32_avx2(const float*, std::int64_t, bool, std::int64_t, std::int64_t, float*) { no_avx2(); }
void gemm_f32_avx2_packed(std::int64_t, std::int64_t, std::int64_t, float, const float*, std::int64_t, bool, const float*,
                          float, float*, std::int64_t) {
  no_avx2();
}
void gemm_f32_avx2_serial(bool, bool, std::int64_t, std::int64_t, std::int64_t, float, const float*, std::int64_t,
                          const float*, std::int64_t, float, float*, std::int64_t) {
  no_avx2();
}
void gemm_f32_avx2(std::int64_t, std::int64_t, std::int64_t, const float*, bool, const float*, bool, float*) { no_avx2(); }

#endif

}  // namespace linum::kernels
