#include <linum/core/ops/batching.hpp>
#include <linum/core/ops/shape_ops.hpp>

#include <algorithm>

namespace linum::ops::batching {

std::vector<BatchLevel> levels_of(std::initializer_list<const Array*> arrays, const char* op) {
  return autodiff::union_levels(std::span<const Array* const>(arrays.begin(), arrays.size()), op);
}

Array materialized(const Array& x, std::span<const BatchLevel> levels) {
  return autodiff::broadcast_levels(x, levels).physical();
}

Array aligned(const Array& x, std::span<const BatchLevel> levels, int rank) {
  if (!x.batched()) return x;
  std::vector<std::int64_t> dims;
  const auto own = x.batch_levels();
  for (const BatchLevel& l : levels)
    dims.push_back(std::find(own.begin(), own.end(), l) != own.end() ? l.size : 1);
  for (int i = x.rank(); i < rank; ++i) dims.push_back(1);
  for (int i = 0; i < x.rank(); ++i) dims.push_back(x.dim(i));
  return reshape(x.physical(), dims);
}

Array reshape_physical(const Array& x, const std::vector<std::int64_t>& dims) { return reshape(x, dims); }

int physical_axis(int axis, int rank, std::size_t levels, const char* op) {
  const int a = axis < 0 ? axis + rank : axis;
  if (a < 0 || a >= std::max(rank, 1))
    throw ShapeError(linum::detail::cat(op, ": axis ", axis, " is out of range for an example of rank ", rank));
  return a + static_cast<int>(levels);
}

std::vector<int> physical_axes(const std::vector<int>& axes, int rank, std::size_t levels, const char* op) {
  std::vector<int> out;
  out.reserve(axes.size());
  for (int a : axes) out.push_back(physical_axis(a, rank, levels, op));
  return out;
}

}  // namespace linum::ops::batching
