// Batching rules' shared steps (vmap, core/transforms/vmap.hpp): how an op given batched inputs
// computes on their physical arrays (core/batch_levels.hpp), as JAX's batching rules and
// functorch's do.
//
// Each op with a batching rule checks its inputs first (`if (x.batched()) ...`), calls itself (or
// other ops) on the physical arrays, whose leading axes are the batch levels, and returns the
// result batched again. Those calls are ordinary ops on unbatched arrays, recorded as usual, so
// gradients, remat policies and memory accounting see batched computations as any other. The rule
// sits at the top of each op, next to its forward and backward. An op without one still works: the
// dispatcher runs it once per example (core/autodiff/primitive.hpp) and says so once.
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/autodiff/batching.hpp>

#include <initializer_list>
#include <span>
#include <vector>

namespace linum::ops::batching {

// The levels of the batched arrays among `arrays`, sorted (sizes must agree: BatchingError naming op).
std::vector<BatchLevel> levels_of(std::initializer_list<const Array*> arrays, const char* op);

inline Array wrap(const Array& physical, std::span<const BatchLevel> levels) {
  return Array::batched_view(physical, levels);
}

// x's physical array with exactly `levels` leading (repeated along the levels x lacks: a copy).
Array materialized(const Array& x, std::span<const BatchLevel> levels);

// x's physical array shaped to broadcast against an output of `rank` axes per example batched at
// `levels`: one leading axis per level (1 where x lacks it), 1s up to `rank`, then x's axes. A view;
// an unbatched x is returned as is (NumPy broadcasting aligns it from the right).
Array aligned(const Array& x, std::span<const BatchLevel> levels, int rank);

// `axis` (negative counts from the end) of an example of rank `rank`, as an axis of the physical
// array with `levels` leading axes.
// reshape (ops), for the templates here.
Array reshape_physical(const Array& x, const std::vector<std::int64_t>& dims);

int physical_axis(int axis, int rank, std::size_t levels, const char* op);
std::vector<int> physical_axes(const std::vector<int>& axes, int rank, std::size_t levels, const char* op);

// The rule of an op on images [N, H, W, C] (pooling, a convolution with a kernel the same for every
// example): the levels folded into N, the op, the levels unfolded.
template <class F>
Array images(const Array& x, F&& op) {
  const Array p = x.physical();
  const int nl = static_cast<int>(x.batch_levels().size());
  std::vector<std::int64_t> folded{-1};
  for (int i = nl + 1; i < p.rank(); ++i) folded.push_back(p.dim(i));
  const Array y = op(reshape_physical(p, folded));
  std::vector<std::int64_t> unfolded;
  for (int i = 0; i <= nl; ++i) unfolded.push_back(p.dim(i));
  for (int i = 1; i < y.rank(); ++i) unfolded.push_back(y.dim(i));
  return wrap(reshape_physical(y, unfolded), x.batch_levels());
}

// The rule of an op that acts on each element, or along axes it counts from the end: the op on the
// physical array, batched as x was.
template <class F>
Array per_element(const Array& x, F&& op) {
  return wrap(op(x.physical()), x.batch_levels());
}

// The rule of a broadcasting elementwise op of several operands.
template <class F>
Array broadcasting(const char* name, std::initializer_list<const Array*> operands, F&& op) {
  const std::vector<BatchLevel> levels = levels_of(operands, name);
  int rank = 0;
  for (const Array* a : operands) rank = std::max(rank, a->rank());
  std::vector<Array> physical;
  physical.reserve(operands.size());
  for (const Array* a : operands) physical.push_back(aligned(*a, levels, rank));
  if constexpr (requires { op(physical[0], physical[1], physical[2]); }) {
    return wrap(op(physical[0], physical[1], physical[2]), levels);
  } else {
    return wrap(op(physical[0], physical[1]), levels);
  }
}

}  // namespace linum::ops::batching
