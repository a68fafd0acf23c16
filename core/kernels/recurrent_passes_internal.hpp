// Internal (not installed: it pulls in Eigen): what the fused recurrent layers' kernels (lstm.cpp,
// gru.cpp) share besides their layout (recurrent_blocks.hpp): the per-row scratch that makes a cell
// row's bits independent of where the row is stored, per-thread buffers, and the handling of
// exceptions and threads inside their parallel regions.
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/kernels/gemm.hpp>
#include <linum/core/kernels/recurrent_blocks.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <memory>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <linum/core/kernels/transpose_internal.hpp>

namespace linum::kernels::recurrent {

// A cell row is computed where it is when its runs sit at 64-byte boundaries and fill whole packets,
// else in aligned scratch, each run of w units padded to whole packets (padding repeats the run's
// first element): Eigen then takes the same packet path for every element whatever the address it
// is stored at, so a forward pass, its recomputation in another buffer and any thread give the same
// bits.
inline constexpr std::int64_t kLanes = 16;
// A chunk's first step starts a whole number of packets into a [T, N, width] buffer whatever N and
// width: keeping and recomputing a chunk's gates then see the same alignment.
static_assert(kChunk % kLanes == 0);
inline std::int64_t padded(std::int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }
using Aligned = Eigen::Map<Eigen::ArrayXf, Eigen::Aligned64>;
using ConstAligned = Eigen::Map<const Eigen::ArrayXf, Eigen::Aligned64>;

// Whether a row's runs of w units can be computed where they are: each starts on a 64-byte boundary
// (null: absent) and w fills whole packets (hidden sizes that are multiples of 16). The cells then
// run the scratch path's functions on the same packets, without copying the runs in and out.
inline bool in_place(std::int64_t w, std::initializer_list<const float*> runs) {
  if (w % kLanes != 0) return false;
  for (const float* r : runs)
    if (r != nullptr && reinterpret_cast<std::uintptr_t>(r) % 64 != 0) return false;
  return true;
}
using Run = Eigen::Map<Eigen::ArrayXf>;
using ConstRun = Eigen::Map<const Eigen::ArrayXf>;

inline void load(const float* src, std::int64_t n, std::int64_t width, float* dst) {
  std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(float));
  for (std::int64_t j = n; j < width; ++j) dst[j] = dst[0];
}
inline void store(const float* src, std::int64_t n, float* dst) {
  std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(float));
}

// Asks for the cache lines of n floats from p (into L1), for a cell row computed soon after: the
// cells' operands are short runs (a row of a block's units per array), too short for the hardware
// prefetchers to follow in time. An asm statement, which the compiler keeps: written with
// __builtin_prefetch, this loop left no prefetch at all in lstm.cpp's object under GCC 12 (the panel
// kernels' prefetch loops do survive there: their objects hold the instructions).
inline void fetch_lines(const float* p, std::int64_t n) {
  for (std::int64_t j = 0; j < n; j += 64 / static_cast<std::int64_t>(sizeof(float))) {
#if defined(__x86_64__)
    asm volatile("prefetcht0 %0" : : "m"(p[j]));
#else
    __builtin_prefetch(p + j, 0, 3);
#endif
  }
}
// How many rows ahead a backward cell row fetches its operands.
inline constexpr std::int64_t kRowsAhead = 3;

// The first exception a worker thread raised (the others keep running the passes' barriers).
struct Failure {
  std::exception_ptr first;
  template <class F>
  void run(F&& f) {
    try {
      f();
    } catch (...) {
#pragma omp critical(linum_recurrent_failure)
      if (!first) first = std::current_exception();
    }
  }
  void rethrow() const {
    if (first) std::rethrow_exception(first);
  }
};

// Inside the passes' parallel regions: oneDNN's products (and anything else) called from a worker
// run on that thread alone, also when the team has one thread (an inactive region, where oneDNN
// would otherwise start a team of its own): the results then never depend on the team's size.
inline void single_threaded_calls() {
#ifdef _OPENMP
  omp_set_num_threads(1);
#endif
}

inline int thread_index() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

inline int threads_in_region() {
#ifdef _OPENMP
  return omp_get_num_threads();
#else
  return 1;
#endif
}

// Per-thread buffers of `per_thread` floats, allocated before a parallel region (an allocation
// failure inside one would end the process), as an Array so that the memory accounting sees them.
struct PerThread {
  Array buffer;
  std::int64_t per_thread;
  PerThread(int threads, std::int64_t floats) : per_thread(padded(floats)) {
    buffer = Array::empty(Shape{std::max(1, threads) * per_thread});
  }
  float* of_this_thread() { return buffer.mutable_data() + thread_index() * per_thread; }
};

// The per-step products' operands for a layer of these dims.
inline Operands step_operands(const Dims& d) { return d.bf16_products ? Operands::bf16 : Operands::f32; }

// The passes' other products (input projections, weight gradients, the inputs' cotangents):
// gemm_f32_serial, or on bf16-rounded operands for bf16 layers.
inline void layer_gemm(const Dims& d, bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, const float* a,
                       std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  if (d.bf16_products) return gemm_bf16_rounded_serial(ta, tb, m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
  gemm_f32_serial(ta, tb, m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
}

// The inputs' cotangents of one step, d_x = d_gates . wi^T (d_gates [N, cols] and wi [I, cols],
// both interleaved): gemm_f32_serial per step; for bf16 layers one packed bf16 product per thread,
// wi rounded and packed once for the pass rather than on every step.
struct InputCotangents {
  Dims d;
  const float* wi;
  std::int64_t cols;
  std::vector<std::unique_ptr<PackedProduct>> per_thread;
  InputCotangents(const Dims& dims, const float* w, std::int64_t c, int team, bool needed) : d(dims), wi(w), cols(c) {
    if (needed && d.bf16_products && d.rows > 0 && d.inputs > 0 && d.steps > 0)
      for (int i = 0; i < std::max(1, team); ++i)
        per_thread.push_back(std::make_unique<PackedProduct>(d.rows, d.inputs, cols, wi, cols, /*tb=*/true, cols, d.inputs,
                                                             /*accumulate=*/false, Operands::bf16));
  }
  void run(const float* d_gates, float* dx) const {
    if (!per_thread.empty()) return per_thread[static_cast<std::size_t>(thread_index())]->run(d_gates, dx);
    layer_gemm(d, false, true, d.rows, d.inputs, cols, d_gates, cols, wi, cols, 0.0f, dx, d.inputs);
  }
};

// Workspace as Arrays, so that the memory accounting (peaks, timelines) sees it.
inline float* workspace(Array& a, std::int64_t floats) {
  a = Array::empty(Shape{floats});
  return a.mutable_data();
}

using Products = std::vector<std::unique_ptr<PackedProduct>>;

// Rows [r0, r0 + rows) of the recurrent kernel (gate order) in the interleaved layout, transposed:
// out [gates * H, rows] (row stride rows). The transposed products pack their weights from it as a
// plain matrix: oneDNN's reorder from the transposed one took 110 us for a 256 x 1024 kernel (this
// machine, warm caches), from the plain one 30, and this copy 20.
inline void interleave_transposed(const UnitBlocks& bl, const GateColumns& in, std::int64_t r0, std::int64_t rows,
                                  float* out) {
  for (std::int64_t b = 0; b < bl.count; ++b)
    for (int k = 0; k < bl.gates; ++k)
      transpose_into(in.row(k, r0) + bl.first(b), in.ld, rows, bl.width(b), out + (bl.base(b) + k * bl.width(b)) * rows,
                     rows);
}

// The recurrent kernel's products for the fused layers' steps, per unit block, packed once from the
// kernel in gate order (wh [H, gates * H], not interleaved), one block's columns or rows at a time:
// no whole interleaved copy is made. Block b's forward product: c (+)= h . (wh's block b columns,
// interleaved) (m rows, c's row stride ldc(b), accumulate: add to c).
template <class Ldc>
std::vector<std::unique_ptr<PackedProduct>> recurrent_products(const UnitBlocks& bl, const GateColumns& wh, std::int64_t m,
                                                               Ldc ldc, bool accumulate, Operands operands) {
  std::vector<std::unique_ptr<PackedProduct>> out;
  for (std::int64_t b = 0; b < bl.count; ++b) {
    const std::int64_t cols = bl.gates * bl.width(b);
    Array block = Array::empty(Shape{bl.hidden * cols});
    bl.gather_block(wh, 0, bl.hidden, b, block.mutable_data());
    out.push_back(std::make_unique<PackedProduct>(m, cols, bl.hidden, block.data(), cols, false, bl.hidden, ldc(b), accumulate,
                                                  operands));
  }
  return out;
}
// The backward products: dh[:, block b] (+)= d_gates . (wh's rows of block b, interleaved)^T, d_gates
// [m, gates * H] interleaved (row stride gates * H), dh's row stride H.
inline std::vector<std::unique_ptr<PackedProduct>> transposed_products(const UnitBlocks& bl, const GateColumns& wh,
                                                                       std::int64_t m, bool accumulate, Operands operands) {
  std::vector<std::unique_ptr<PackedProduct>> out;
  const std::int64_t cols = bl.gates * bl.hidden;
  for (std::int64_t b = 0; b < bl.count; ++b) {
    Array block_t = Array::empty(Shape{cols * bl.width(b)});
    interleave_transposed(bl, wh, bl.first(b), bl.width(b), block_t.mutable_data());
    out.push_back(std::make_unique<PackedProduct>(m, bl.width(b), cols, block_t.data(), bl.width(b), false, cols, bl.hidden,
                                                  accumulate, operands));
  }
  return out;
}

// The same products over every unit block at once, for the steps of a piece of m rows (RowPieces):
// forward, gates[rows, :] (+)= h[rows] . wh (interleaved), or transposed, dh[rows, :] = d_gates[rows]
// . wh^T (interleaved; dh's row stride H).
inline std::unique_ptr<PackedProduct> whole_recurrent_product(const UnitBlocks& bl, const GateColumns& wh, std::int64_t m,
                                                              bool transposed, bool accumulate, Operands operands) {
  const std::int64_t cols = bl.gates * bl.hidden;
  Array all = Array::empty(Shape{bl.hidden * cols});
  if (transposed) {
    interleave_transposed(bl, wh, 0, bl.hidden, all.mutable_data());
    return std::make_unique<PackedProduct>(m, bl.hidden, cols, all.data(), bl.hidden, false, cols, bl.hidden, accumulate,
                                           operands);
  }
  bl.interleave(wh, 0, bl.hidden, all.mutable_data());
  return std::make_unique<PackedProduct>(m, cols, bl.hidden, all.data(), cols, false, bl.hidden, cols, accumulate, operands);
}

// A pass's per-step products, by set: with one row piece (RowPieces), one set of per-block products
// over every row (by_blocks()); with several, a set per thread (at most one per piece) holding one
// product over a piece's rows and every block (whole()), the first packing the weights and the
// others sharing them (a product object runs on one thread at a time).
template <class ByBlocks, class Whole>
std::vector<Products> step_product_sets(const RowPieces& pieces, int team, ByBlocks by_blocks, Whole whole) {
  std::vector<Products> sets;
  if (pieces.count == 1) {
    sets.push_back(by_blocks());
    return sets;
  }
  for (std::int64_t i = 0, n = std::min<std::int64_t>(std::max(1, team), pieces.count); i < n; ++i) {
    sets.emplace_back();
    sets.back().push_back(i == 0 ? whole() : sets[0][0]->sharing_weights());
  }
  return sets;
}

// dw[:, cols] += sum over the steps t of [t0, t0 + g) of h_before(t)^T . d_gates(t): the recurrent
// kernel's gradient from one chunk, on the calling thread. h_before(t) is h0 for t = 0, else ys of
// step t - 1 ([N, H] each); d_gates holds the chunk's steps' rows (row stride ld) from its first
// step. One product over the chunk's rows, or two when the chunk starts at step 0 (h0 is not next to
// ys): the same products whatever kept or recomputed the gates.
inline void add_recurrent_gradient(const Dims& d, std::int64_t t0, std::int64_t g, const float* h0, const float* ys,
                                   const float* d_gates, std::int64_t ld, std::int64_t cols, float* dw, std::int64_t ldw) {
  const std::int64_t N = d.rows, H = d.hidden;
  if (t0 > 0) return layer_gemm(d, true, false, H, cols, g * N, ys + (t0 - 1) * N * H, H, d_gates, ld, 1.0f, dw, ldw);
  layer_gemm(d, true, false, H, cols, N, h0, H, d_gates, ld, 1.0f, dw, ldw);
  if (g > 1) layer_gemm(d, true, false, H, cols, (g - 1) * N, ys, H, d_gates + N * ld, ld, 1.0f, dw, ldw);
}

}  // namespace linum::kernels::recurrent
