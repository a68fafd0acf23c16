// Internal helpers shared by the op implementations (.cpp files only; not part of the public API).
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/autodiff/graph.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace linum::ops::detail {

// Elements per parallel block; arrays smaller than kParallelMin run on one thread.
constexpr std::int64_t kBlock = 16384;
constexpr std::int64_t kParallelMin = 1 << 18;

// Calls f(begin, count) over [0, n) in blocks, in parallel for large n.
template <class F>
void for_blocks(std::int64_t n, F&& f) {
  if (n < kParallelMin) {
    if (n > 0) f(std::int64_t{0}, n);
    return;
  }
  const std::int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (std::int64_t b = 0; b < blocks; ++b) {
    const std::int64_t begin = b * kBlock;
    f(begin, std::min(kBlock, n - begin));
  }
}

// Throws ShapeError unless `a` is float32.
void require_f32(const Array& a, const char* op);
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
