#include <linum/nn/dense.hpp>

#include <linum/core/ops/all.hpp>

#include <algorithm>

namespace linum::nn {

void Dense::validate() const {
  if (features <= 0)
    throw ValueError(detail::cat("Dense: features must be positive (got ", features,
                                 "); construct it as nn::Dense{.features = N}"));
  require_float_dtype(param_dtype, "Dense", "param_dtype");
}

Array Dense::operator()(Scope& s, const Array& x) const {
  validate();
  if (x.rank() < 1)
    throw ShapeError(detail::cat("Dense: the input must have at least one axis (got shape ", x.shape(),
                                 "); reshape a scalar to (1,) first"));
  require_float_dtype(param_dtype, "Dense", "param_dtype");
  Array kernel = s.param("kernel", initializer_in(kernel_init, param_dtype), Shape{x.dim(-1), features});
  Array bias = use_bias ? s.param("bias", initializer_in(bias_init, param_dtype), Shape{features}) : Array();
  // Flax: inputs, kernel, bias in one dtype (linear casts inside, folding the casts into its product
  // where it can)
  if (dtype) return linear(x, kernel, bias, activation, *dtype);
  auto p = promote_dtype({x, kernel, bias}, dtype);
  return linear(p[0], p[1], p[2], activation);
}

namespace {

// An initializer that draws `inner` at the flattened shape (rows, cols) (or (cols,) for a bias)
// and reshapes the result, as Flax's DenseGeneral kernel_init_wrap / bias_init_wrap.
Initializer flattened(const Initializer& inner, std::int64_t rows, std::int64_t cols, bool matrix) {
  return [inner, rows, cols, matrix](rng::Key key, const Shape& shape) {
    Array flat = matrix ? inner(key, Shape{rows, cols}) : inner(key, Shape{cols});
    return flat.with_shape(shape);
  };
}

}  // namespace

void DenseGeneral::validate() const {
  if (features.empty() || std::any_of(features.begin(), features.end(), [](std::int64_t f) { return f <= 0; }))
    throw ValueError(detail::cat("DenseGeneral: features must be a non-empty list of positive sizes; construct it as "
                                 "nn::DenseGeneral{.features = {N}} or {.features = {heads, head_dim}}"));
  if (axis.empty()) throw ValueError("DenseGeneral: axis must name at least one input axis (e.g. .axis = {-1})");
  for (std::size_t i = 0; i < axis.size(); ++i)
    if (std::find(axis.begin() + static_cast<std::ptrdiff_t>(i) + 1, axis.end(), axis[i]) != axis.end())
      throw ValueError(detail::cat("DenseGeneral: axis ", axis[i], " is listed twice"));
  require_float_dtype(param_dtype, "DenseGeneral", "param_dtype");
}

Array DenseGeneral::operator()(Scope& s, const Array& x) const {
  validate();
  std::vector<int> axes;
  for (int a : axis) {
    const int n = a < 0 ? a + x.rank() : a;
    if (n < 0 || n >= x.rank())
      throw ShapeError(detail::cat("DenseGeneral: axis ", a, " is out of range for an input of shape ", x.shape()));
    if (std::find(axes.begin(), axes.end(), n) != axes.end())
      throw ValueError(detail::cat("DenseGeneral: axis ", a, " is listed twice"));
    axes.push_back(n);
  }
  std::sort(axes.begin(), axes.end());  // as Flax's _normalize_axes

  Shape kernel_shape;
  std::int64_t rows = 1, cols = 1;
  for (int a : axes) {
    kernel_shape.push_back(x.dim(a));
    rows *= x.dim(a);
  }
  Shape bias_shape;
  for (std::int64_t f : features) {
    kernel_shape.push_back(f);
    bias_shape.push_back(f);
    cols *= f;
  }
  require_float_dtype(param_dtype, "DenseGeneral", "param_dtype");
  Array kernel = s.param("kernel", initializer_in(flattened(kernel_init, rows, cols, true), param_dtype), kernel_shape);
  Array bias = use_bias ? s.param("bias", initializer_in(flattened(bias_init, 1, cols, false), param_dtype), bias_shape)
                        : Array();
  auto p = promote_dtype({x, kernel, bias}, dtype);
  // The contracted axes moved last and flattened, the kernel and bias flattened: one linear op on
  // [..., rows] x [rows, cols] (a transpose only when the axes are not already the last ones).
  std::vector<int> perm;
  for (int i = 0; i < x.rank(); ++i)
    if (std::find(axes.begin(), axes.end(), i) == axes.end()) perm.push_back(i);
  std::vector<std::int64_t> out;
  std::int64_t lead = 1;
  for (int i : perm) {
    out.push_back(x.dim(i));
    lead *= x.dim(i);
  }
  for (std::int64_t f : features) out.push_back(f);
  perm.insert(perm.end(), axes.begin(), axes.end());
  bool identity = true;
  for (std::size_t i = 0; i < perm.size(); ++i) identity = identity && perm[i] == static_cast<int>(i);
  const Array moved = identity ? p[0] : transpose(p[0], perm);
  const Array y = linear(reshape(moved, {lead, rows}), reshape(p[1], {rows, cols}),
                         use_bias ? reshape(p[2], {cols}) : Array(), activation);
  return reshape(y, out);
}

}  // namespace linum::nn
