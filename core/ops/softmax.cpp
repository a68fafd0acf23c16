#include <linum/core/ops/batching.hpp>
#include <linum/core/ops/softmax.hpp>
#include <linum/core/autodiff/primitive.hpp>
#include <linum/core/threading.hpp>
#include <linum/core/ops/elementwise.hpp>
#include <linum/core/ops/kernel_util.hpp>
#include <linum/core/ops/reduce.hpp>

#include <Eigen/Core>

#include <cmath>
#include <vector>

namespace linum {

using autodiff::Cotangents;

namespace {

using Row = Eigen::Map<Eigen::ArrayXf>;
using ConstRow = Eigen::Map<const Eigen::ArrayXf>;

// True when `axes` is just the last axis: the rows are contiguous and one fused kernel does it.
bool last_axis_only(const std::vector<int>& axes, const Array& x, const char* op) {
  const auto norm = ops::detail::normalize_axes(axes, x.rank(), op);
  return x.rank() >= 1 && norm.size() == 1 && norm[0] == x.rank() - 1 && x.dim(-1) > 0;
}

// Calls f(row, scratch) for every row of length n of an array with `rows` rows, in parallel
// blocks of rows for large arrays (rows are independent, so results do not depend on threads; one
// contiguous run of blocks per thread: "Contiguous runs" in kernel_util.hpp).
template <class F>
void for_rows(std::int64_t rows, std::int64_t n, F&& f) {
  const std::int64_t per_block = std::max<std::int64_t>(1, ops::detail::kBlock / n);
  const std::int64_t blocks = (rows + per_block - 1) / per_block;
#pragma omp parallel if (rows * n >= ops::detail::kParallelMin && blocks > 1) num_threads(linum::team_size())
  {
    linum::detail::enter_compute();
    ops::detail::AlignedScratch scratch(3 * n);
#pragma omp for schedule(static)
    for (std::int64_t b = 0; b < blocks; ++b)
      for (std::int64_t r = b * per_block; r < std::min(rows, (b + 1) * per_block); ++r) f(r, scratch.data());
  }
}

// One pass per row of the last axis, computed in float32, rounded once to x's dtype.
// log = false: softmax, exp(x - max) / sum; log = true: log_softmax, x - max - log(sum).
Array last_axis_forward(const Array& x, bool log) {
  const std::int64_t n = x.dim(-1), rows = x.numel() / n;
  Array y = Array::empty(x.shape(), x.dtype());
  for_rows(rows, n, [&](std::int64_t r, float* scratch) {
    ConstRow in(ops::detail::f32_view(x, r * n, n, scratch), n);
    float* out_ptr = ops::detail::f32_target(y, r * n, scratch + n);
    Row out(out_ptr, n);
    const float m = in.maxCoeff();
    if (log) {
      out = in - m;
      const float lse = std::log(out.exp().sum());
      out -= lse;
    } else {
      out = (in - m).exp();
      out /= out.sum();
    }
    ops::detail::f32_commit(y, r * n, n, out_ptr);
  });
  return y;
}

// Backward of the row kernels from the output y and the cotangent g:
// softmax: dx = y * (g - sum(g * y)); log_softmax: dx = g - exp(y) * sum(g).
Array last_axis_backward(const Array& y, const Array& g_in, bool log) {
  const std::int64_t n = y.dim(-1), rows = y.numel() / n;
  const Array g = g_in.dtype() == y.dtype() ? g_in : astype(g_in, y.dtype());
  Array dx = Array::empty(y.shape(), y.dtype());
  for_rows(rows, n, [&](std::int64_t r, float* scratch) {
    ConstRow yr(ops::detail::f32_view(y, r * n, n, scratch), n);
    ConstRow gr(ops::detail::f32_view(g, r * n, n, scratch + n), n);
    float* out_ptr = ops::detail::f32_target(dx, r * n, scratch + 2 * n);
    Row out(out_ptr, n);
    if (log) out = gr - yr.exp() * gr.sum();
    else out = yr * (gr - (gr * yr).sum());
    ops::detail::f32_commit(dx, r * n, n, out_ptr);
  });
  return dx;
}

}  // namespace

Array softmax(const Array& x, const std::vector<int>& axes) {
  ops::detail::require_float(x, "softmax");
  if (x.batched()) [[unlikely]]  // vmap: the same axes of every example
    return ops::batching::wrap(
        softmax(x.physical(), ops::batching::physical_axes(axes, x.rank(), x.batch_levels().size(), "softmax")), x.batch_levels());
  if (last_axis_only(axes, x, "softmax"))
    return autodiff::primitive("softmax", {&x},
                               [&](autodiff::Residuals& r) {
                                 Array y = last_axis_forward(x, false);
                                 r.keep(y);
                                 return y;
                               },
                               autodiff::higher_order([](Cotangents& c, autodiff::Saved s) {
                                 if (!autodiff::creating_graph()) return c.set(0, last_axis_backward(s[0], c.out(), false));
                                 Array gy = mul(c.out(), s[0]);  // create-graph mode: y (g - sum(g y)) with ops
                                 c.set(0, sub(gy, mul(s[0], sum(gy, {-1}, true))));
                               }));
  return autodiff::primitive("softmax", {&x},
                             [&](autodiff::Residuals& r) {
                               autodiff::NoGradGuard no_grad;  // computed in float32, rounded once to x's dtype; only y is kept
                               const Array xf = astype(x.detached(), DType::f32);
                               Array e = exp(xf - max(xf, axes, true));
                               Array y = astype(e / sum(e, axes, true), x.dtype());
                               r.keep(y);
                               return y;
                             },
                             autodiff::higher_order([axes](Cotangents& c, autodiff::Saved s) {
                               // dx = y * (g - sum(g * y))
                               Array gy = mul(c.out(), s[0]);
                               c.set(0, sub(gy, mul(s[0], sum(gy, axes, true))));
                             }));
}

Array log_softmax(const Array& x, const std::vector<int>& axes) {
  ops::detail::require_float(x, "log_softmax");
  if (x.batched()) [[unlikely]]  // vmap: the same axes of every example
    return ops::batching::wrap(
        log_softmax(x.physical(), ops::batching::physical_axes(axes, x.rank(), x.batch_levels().size(), "log_softmax")), x.batch_levels());
  if (last_axis_only(axes, x, "log_softmax"))
    return autodiff::primitive("log_softmax", {&x},
                               [&](autodiff::Residuals& r) {
                                 Array y = last_axis_forward(x, true);
                                 r.keep(y);
                                 return y;
                               },
                               autodiff::higher_order([](Cotangents& c, autodiff::Saved s) {
                                 if (!autodiff::creating_graph()) return c.set(0, last_axis_backward(s[0], c.out(), true));
                                 c.set(0, sub(c.out(), mul(exp(s[0]), sum(c.out(), {-1}, true))));  // g - exp(y) sum(g)
                               }));
  return autodiff::primitive("log_softmax", {&x},
                             [&](autodiff::Residuals& r) {
                               autodiff::NoGradGuard no_grad;  // computed in float32, rounded once to x's dtype
                               const Array xf = astype(x.detached(), DType::f32);
                               Array shifted = xf - max(xf, axes, true);
                               Array y = astype(shifted - log(sum(exp(shifted), axes, true)), x.dtype());
                               r.keep(y);
                               return y;
                             },
                             autodiff::higher_order([axes](Cotangents& c, autodiff::Saved s) {
                               // dx = g - exp(y) * sum(g)
                               c.set(0, sub(c.out(), mul(exp(s[0]), sum(c.out(), axes, true))));
                             }));
}

}  // namespace linum
