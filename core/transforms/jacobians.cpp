#include <linum/core/transforms/jacobians.hpp>

#include <linum/core/error.hpp>
#include <linum/core/ops/elementwise.hpp>

namespace linum::autodiff::detail {

Array basis_vector(const Shape& shape, DType dtype, std::int64_t i) {
  Array e = Array::zeros(shape);
  e.mutable_data()[i] = 1.0f;
  return dtype == DType::f32 ? e : linum::detail::convert_float(e, dtype);
}

Array stack_as(const std::vector<Array>& rows, const Shape& lead, const Shape& row_shape, DType dtype) {
  Shape full = lead;
  for (std::int64_t d : row_shape) full.push_back(d);
  if (rows.empty()) return Array::zeros(full, dtype);
  return reshape(stack(rows), full.vec());
}

Array tree_vdot(const std::vector<Array>& a, const std::vector<Array>& b) {
  if (a.size() != b.size())
    throw ValueError(linum::detail::cat("hvp: the vector has ", b.size(), " arrays, the point ", a.size(),
                                        "; give v the structure of x"));
  Array total = Array::scalar(0.0f);
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!a[i].defined() || !is_floating(a[i].dtype())) continue;
    if (!(a[i].shape() == b[i].shape()))
      throw ValueError(linum::detail::cat("hvp: array ", i, " of v has shape ", b[i].shape(), ", x's has ", a[i].shape()));
    total = total + sum(astype(a[i], DType::f32) * astype(b[i], DType::f32));
  }
  return total;
}

}  // namespace linum::autodiff::detail
