// Internal helpers shared by the op implementations (.cpp files only; not part of the public API).
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/threading.hpp>
#include <linum/core/autodiff/graph.hpp>
#include <linum/core/fp_mode.hpp>
#include <linum/core/ops/elementwise.hpp>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <cstdint>
#include <string>
#include <vector>

namespace linum::ops::detail {

// Elements per parallel block; arrays smaller than kParallelMin run on one thread.
constexpr std::int64_t kBlock = 16384;
constexpr std::int64_t kParallelMin = 1 << 18;

// Contiguous runs: how the elementwise and per-channel passes share their blocks among threads: one contiguous run
// per thread (OpenMP's static schedule), the first part of the array on the first thread, as
// oneDNN's convolutions and products split theirs. So a thread mostly reads what it wrote in the
// pass before, from its own core's cache, rather than lines the other core holds: the main example's
// step ran 3% faster than with blocks handed to whichever thread was free (dynamic), which puts
// every other block on the other core. A busy machine is met by the team size instead
// (core/threading.hpp: a core another process keeps busy leaves the team; linum-bench load gave
// 1.91x with this schedule against 2.03x with the dynamic one, one run each). Results never depend
// on which thread computes a block.

// Calls f(i) for i in [0, items) (rows, tiles, reduction slices): in parallel (static schedule)
// when the work touches at least kParallelMin elements and there is more than one item, else in
// order on the calling thread.
template <class F>
void for_items(std::int64_t items, std::int64_t elements, F&& f) {
  if (elements >= kParallelMin && items > 1) {
#pragma omp parallel for schedule(static) num_threads(linum::team_size())
    for (std::int64_t i = 0; i < items; ++i) {
      linum::detail::enter_compute();
      f(i);
    }
  } else {
    for (std::int64_t i = 0; i < items; ++i) f(i);
  }
}

// Calls f(begin, count) over [0, n) in blocks, in parallel for large n.
template <class F>
void for_blocks(std::int64_t n, F&& f) {
  if (n < kParallelMin) {
    if (n > 0) f(std::int64_t{0}, n);
    return;
  }
  const std::int64_t blocks = (n + kBlock - 1) / kBlock;
  // (one contiguous run of blocks per thread: "Contiguous runs" above)
#pragma omp parallel for schedule(static) num_threads(linum::team_size())
  for (std::int64_t b = 0; b < blocks; ++b) {
    linum::detail::enter_compute();
    const std::int64_t begin = b * kBlock;
    f(begin, std::min(kBlock, n - begin));
  }
}

// A thread's reusable float32 scratch, 64-byte aligned. Kernels whose row sums go through Eigen
// need it: Eigen's vectorized sums start at the first aligned element, so the summation order (and
// the last bit of the result) depends on a buffer's alignment, which must not vary between runs
// or threads.
class AlignedScratch {
 public:
  AlignedScratch() = default;
  explicit AlignedScratch(std::int64_t count) { get(count); }
  AlignedScratch(const AlignedScratch&) = delete;
  AlignedScratch& operator=(const AlignedScratch&) = delete;
  ~AlignedScratch() { std::free(data_); }
  // At least `count` floats (contents unspecified).
  float* get(std::int64_t count) {
    if (count > capacity_) {
      std::free(data_);
      data_ = nullptr;
      const std::size_t bytes = (static_cast<std::size_t>(count) * sizeof(float) + 63) / 64 * 64;
      data_ = static_cast<float*>(std::aligned_alloc(64, bytes));
      if (data_ == nullptr) throw std::bad_alloc();
      capacity_ = count;
    }
    return data_;
  }
  float* data() { return data_; }

 private:
  float* data_ = nullptr;
  std::int64_t capacity_ = 0;
};

// Throws ShapeError unless `a` is float32.
void require_f32(const Array& a, const char* op);
// Throws ShapeError unless `a` is float32 or bfloat16.
void require_float(const Array& a, const char* op);

// ---- bf16 support: kernels compute in float32 on chunks of at most kChunk elements ------------
constexpr std::int64_t kChunk = 2048;

// Elements [start, start + n) of a float array as float32: a pointer into `a` itself when it is
// float32, else the elements widened into `scratch` (n <= kChunk).
inline const float* f32_view(const Array& a, std::int64_t start, std::int64_t n, float* scratch) {
  if (a.dtype() == DType::f32) return static_cast<const float*>(a.raw()) + start;
  bf16_to_f32(static_cast<const bfloat16*>(a.raw()) + start, scratch, n);
  return scratch;
}
// Element i of a float array as float32.
inline float f32_at(const Array& a, std::int64_t i) {
  return a.dtype() == DType::f32 ? static_cast<const float*>(a.raw())[i]
                                 : static_cast<float>(static_cast<const bfloat16*>(a.raw())[i]);
}
// Where a kernel writes elements [start, start + n) of `out` in float32: `out` itself when it is
// float32, else `scratch`, which f32_commit then rounds into `out`.
inline float* f32_target(Array& out, std::int64_t start, float* scratch) {
  return out.dtype() == DType::f32 ? static_cast<float*>(out.mutable_raw()) + start : scratch;
}
inline void f32_commit(Array& out, std::int64_t start, std::int64_t n, const float* scratch) {
  if (out.dtype() == DType::bf16) f32_to_bf16(scratch, static_cast<bfloat16*>(out.mutable_raw()) + start, n);
}
// How ops that accumulate (reductions, softmax) take bf16 input, as Flax does: `f` runs on the
// input widened to float32 (differentiably) and its result is rounded back once.
template <class F>
Array via_f32(const Array& x, F&& f) {
  return astype(f(astype(x, DType::f32)), x.dtype());
}

// Calls f(begin, count) over [0, n) in chunks of at most kChunk elements, blocks in parallel.
template <class F>
void for_chunks(std::int64_t n, F&& f) {
  for_blocks(n, [&](std::int64_t s, std::int64_t c) {
    for (std::int64_t x = s; x < s + c; x += kChunk) f(x, std::min(kChunk, s + c - x));
  });
}
// Position independence: Eigen computes whole SIMD packets with one formula and a ragged tail with
// another (scalar std::exp vs its packet exp, say), which round differently. So the elementwise
// kernels hand Eigen only whole packets from 64-byte-aligned addresses, padding the last chunk:
// every element takes the same path wherever it sits, and an op on a batch of examples (vmap)
// computes each one bitwise as on that example alone.
constexpr std::int64_t kLanes = 16;  // a multiple of every packet width (AVX-512: 16 floats)
inline std::int64_t whole_packets(std::int64_t c) { return (c + kLanes - 1) / kLanes * kLanes; }

// `src` (c floats) as a padded run of whole_packets(c) floats: `src` itself when c is already whole,
// else copied into `scratch` (aligned, kChunk floats) and padded with copies of its first element.
inline const float* padded_view(const float* src, std::int64_t c, float* scratch) {
  const std::int64_t p = whole_packets(c);
  if (p == c) return src;
  if (src != scratch) std::memcpy(scratch, src, static_cast<std::size_t>(c) * sizeof(float));
  for (std::int64_t i = c; i < p; ++i) scratch[i] = scratch[0];
  return scratch;
}

// Writes the first c of `computed` into out at s (a no-op when it is out's own memory).
inline void commit_padded(Array& out, std::int64_t s, std::int64_t c, const float* computed) {
  if (out.dtype() == DType::f32) {
    float* dst = static_cast<float*>(out.mutable_raw()) + s;
    if (dst != computed) std::memcpy(dst, computed, static_cast<std::size_t>(c) * sizeof(float));
  } else {
    f32_commit(out, s, c, computed);
  }
}

// Throws ShapeError unless `a` is defined.
void require_defined(const Array& a, const char* op);

// The NumPy broadcast of two shapes, or a ShapeError naming op and both shapes.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);

// Sums `g` (whose shape is a broadcast of `target`) back down to `target`. Returns `g` itself when
// the shapes already match. Used by backward rules of broadcasting ops.
Array sum_to(const Array& g, const Shape& target);

// `x` materialised at a shape it broadcasts to (no gradient; a plain copy when shapes match).
Array broadcast_raw(const Array& x, const Shape& shape);

// Normalised, sorted, de-duplicated axes; empty `axes` with `all_if_empty` means every axis.
std::vector<int> normalize_axes(const std::vector<int>& axes, int rank, const char* op);

std::string shapes_str(std::initializer_list<const Array*> arrays);

}  // namespace linum::ops::detail
