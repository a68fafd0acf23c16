#include <linum/core/ops/kernel_util.hpp>
#include <linum/core/autodiff/graph.hpp>
#include <linum/core/ops/reduce.hpp>
#include <linum/core/ops/shape_ops.hpp>

#include <sstream>

namespace linum::ops::detail {

void require_defined(const Array& a, const char* op) {
  if (!a.defined())
    throw ValueError(linum::detail::cat(op, ": got an undefined (default-constructed) array"));
}

void require_f32(const Array& a, const char* op) {
  require_defined(a, op);
  if (a.dtype() != DType::f32)
    throw ShapeError(linum::detail::cat(op, ": needs float32 input, got ", dtype_name(a.dtype()), a.shape().str(),
                                        "; convert with astype(x, DType::f32)"));
}

void require_float(const Array& a, const char* op) {
  require_defined(a, op);
  if (!is_floating(a.dtype()))
    throw ShapeError(linum::detail::cat(op, ": needs float32 or bfloat16 input, got ", dtype_name(a.dtype()),
                                        a.shape().str(), "; convert with astype(x, DType::f32)"));
}

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  if (a == b) return a;
  const int rank = std::max(a.rank(), b.rank());
  Shape out;
  for (int i = 0; i < rank; ++i) {
    const int ia = i - (rank - a.rank());
    const int ib = i - (rank - b.rank());
    const std::int64_t da = ia >= 0 ? a[ia] : 1;
    const std::int64_t db = ib >= 0 ? b[ib] : 1;
    if (da != db && da != 1 && db != 1)
      throw ShapeError(linum::detail::cat(op, ": shapes ", a, " and ", b,
                                          " cannot be broadcast together (axis ", i, ": ", da, " vs ", db, ")"));
    out.push_back(da == 1 ? db : da);
  }
  return out;
}

Array sum_to(const Array& g, const Shape& target) {
  if (g.shape() == target) return g;
  const int lead = g.rank() - target.rank();
  std::vector<int> axes;
  for (int i = 0; i < g.rank(); ++i) {
    if (i < lead || (target[i - lead] == 1 && g.shape()[i] != 1)) axes.push_back(i);
  }
  Array s = sum(g, axes, /*keepdims=*/false);
  return autodiff::creating_graph() ? reshape(s, target.vec()) : s.with_shape(target);
}

std::vector<int> normalize_axes(const std::vector<int>& axes, int rank, const char* op) {
  std::vector<int> out;
  out.reserve(axes.size());
  for (int a : axes) {
    int n = a < 0 ? a + rank : a;
    if (n < 0 || n >= rank)
      throw ShapeError(linum::detail::cat(op, ": axis ", a, " is out of range for rank ", rank));
    out.push_back(n);
  }
  std::sort(out.begin(), out.end());
  if (std::adjacent_find(out.begin(), out.end()) != out.end())
    throw ShapeError(linum::detail::cat(op, ": repeated axis in the axis list"));
  return out;
}

std::string shapes_str(std::initializer_list<const Array*> arrays) {
  std::ostringstream os;
  bool first = true;
  for (const Array* a : arrays) {
    if (!first) os << " and ";
    first = false;
    os << dtype_name(a->dtype()) << a->shape().str();
  }
  return os.str();
}

}  // namespace linum::ops::detail
