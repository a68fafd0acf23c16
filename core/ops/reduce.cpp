// Reductions. sum and max are primitives with their own backward rules; mean, min, var and
// logsumexp are compositions whose gradients follow from their parts.
#include <linum/core/fp_mode.hpp>
#include <linum/core/threading.hpp>
#include <linum/core/autodiff/primitive.hpp>
#include <linum/core/ops/batching.hpp>
#include <linum/core/ops/reduce.hpp>
#include <linum/core/ops/elementwise.hpp>
#include <linum/core/ops/kernel_util.hpp>
#include <linum/core/ops/shape_ops.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <limits>
#include <optional>
#include <numeric>

namespace linum {
namespace {

using autodiff::Cotangents;
using autodiff::Residuals;
using autodiff::primitive;

enum class Reduction { sum, max };

std::vector<int> all_axes(int rank) {
  std::vector<int> axes(static_cast<std::size_t>(rank));
  std::iota(axes.begin(), axes.end(), 0);
  return axes;
}

Shape reduced_shape(const Shape& s, const std::vector<int>& axes, bool keepdims) {
  Shape out;
  std::size_t k = 0;
  for (int i = 0; i < s.rank(); ++i) {
    const bool reduced = k < axes.size() && axes[k] == i;
    if (reduced) ++k;
    if (!reduced) out.push_back(s[i]);
    else if (keepdims) out.push_back(1);
  }
  return out;
}

Array reduce_kernel_bf16(const Array& x, std::int64_t outer, std::int64_t red, std::int64_t inner, Reduction kind,
                        const Shape& keep_shape, DType out_dtype);

// Reduces x over the sorted axes `axes` with kind; the result has the keepdims shape and
// `out_dtype` (x's dtype unless given). float32 accumulation whatever the input dtype.
Array reduce_kernel(const Array& x, const std::vector<int>& axes, Reduction kind, const char* op,
                    std::optional<DType> out_dtype = std::nullopt) {
  const Shape keep_shape = reduced_shape(x.shape(), axes, true);
  if (axes.empty()) return x.detached();
  const bool contiguous = axes.back() - axes.front() + 1 == static_cast<int>(axes.size());
  if (!contiguous) {
    // Move the reduced axes to the end, then reduce them as one trailing block.
    std::vector<int> perm;
    std::size_t k = 0;
    for (int i = 0; i < x.rank(); ++i) {
      if (k < axes.size() && axes[k] == i) { ++k; continue; }
      perm.push_back(i);
    }
    const int kept = static_cast<int>(perm.size());
    for (int a : axes) perm.push_back(a);
    Array moved;
    {
      autodiff::NoGradGuard no_grad;
      moved = transpose(x.detached(), perm);
    }
    std::vector<int> tail(axes.size());
    std::iota(tail.begin(), tail.end(), kept);
    return reduce_kernel(moved, tail, kind, op, out_dtype).with_shape(keep_shape);
  }
  std::int64_t outer = 1, red = 1, inner = 1;
  for (int i = 0; i < x.rank(); ++i) {
    if (i < axes.front()) outer *= x.shape()[i];
    else if (i <= axes.back()) red *= x.shape()[i];
    else inner *= x.shape()[i];
  }
  if (red == 0 && kind == Reduction::max)
    throw ShapeError(detail::cat(op, ": cannot reduce an empty axis of shape ", x.shape(), " (no identity for max)"));
  if (x.dtype() == DType::bf16) return reduce_kernel_bf16(x, outer, red, inner, kind, keep_shape, out_dtype.value_or(DType::bf16));
  Array out = Array::empty(keep_shape);
  const float* px = x.data();
  float* po = out.mutable_data();
  const float init = kind == Reduction::sum ? 0.0f : -std::numeric_limits<float>::infinity();
  auto run = [&](std::int64_t o) {
    const float* base = px + o * red * inner;
    float* dst = po + o * inner;
    if (inner == 1) {
      Eigen::Map<const Eigen::ArrayXf> row(base, red);
      dst[0] = red == 0 ? init : (kind == Reduction::sum ? row.sum() : row.maxCoeff());
      return;
    }
    Eigen::Map<Eigen::ArrayXf> acc(dst, inner);
    acc.setConstant(init);
    for (std::int64_t r = 0; r < red; ++r) {
      Eigen::Map<const Eigen::ArrayXf> v(base + r * inner, inner);
      if (kind == Reduction::sum) acc += v;
      else acc = acc.max(v);
    }
  };
  ops::detail::for_items(outer, x.numel(), run);
  return out;
}

// The bf16 reduction: rows are widened a chunk at a time and accumulated in float32, which is
// rounded once to `out_dtype` at the end.
Array reduce_kernel_bf16(const Array& x, std::int64_t outer, std::int64_t red, std::int64_t inner, Reduction kind,
                        const Shape& keep_shape, DType out_dtype) {
  using ops::detail::f32_view;
  using ops::detail::kChunk;
  Array acc = Array::empty(keep_shape);
  float* pacc = acc.mutable_data();
  const float init = kind == Reduction::sum ? 0.0f : -std::numeric_limits<float>::infinity();
  auto run = [&](std::int64_t o) {
    float scratch[kChunk];
    float* dst = pacc + o * inner;
    const std::int64_t base = o * red * inner;
    if (inner == 1) {
      float total = init;
      for (std::int64_t r0 = 0; r0 < red; r0 += kChunk) {
        const std::int64_t len = std::min(kChunk, red - r0);
        Eigen::Map<const Eigen::ArrayXf> v(f32_view(x, base + r0, len, scratch), len);
        total = kind == Reduction::sum ? total + v.sum() : std::max(total, v.maxCoeff());
      }
      dst[0] = total;
      return;
    }
    std::fill_n(dst, inner, init);
    for (std::int64_t r = 0; r < red; ++r)
      for (std::int64_t j0 = 0; j0 < inner; j0 += kChunk) {
        const std::int64_t len = std::min(kChunk, inner - j0);
        Eigen::Map<Eigen::ArrayXf> a(dst + j0, len);
        Eigen::Map<const Eigen::ArrayXf> v(f32_view(x, base + r * inner + j0, len, scratch), len);
        if (kind == Reduction::sum) a += v;
        else a = a.max(v);
      }
  };
  ops::detail::for_items(outer, x.numel(), run);
  if (out_dtype == DType::f32) return acc;
  autodiff::NoGradGuard constants;
  return astype(acc, out_dtype);
}

Array finish(const Array& keep, const Shape& x_shape, const std::vector<int>& axes, bool keepdims) {
  return keepdims ? keep : keep.with_shape(reduced_shape(x_shape, axes, false));
}

}  // namespace

namespace {
// sum with the result in `out_dtype` (a bf16 sum may stay in its float32 accumulator).
Array sum_as(const Array& x, const std::vector<int>& axes_in, bool keepdims, DType out_dtype) {
  ops::detail::require_float(x, "sum");
  const std::vector<int> axes = ops::detail::normalize_axes(axes_in, x.rank(), "sum");
  if (x.batched()) [[unlikely]]  // vmap: the same axes of every example
    return ops::batching::wrap(sum_as(x.physical(), ops::batching::physical_axes(axes, x.rank(), x.batch_levels().size(), "sum"),
                                      keepdims, out_dtype),
                               x.batch_levels());
  return primitive("sum", {&x},
                   [&](Residuals&) { return finish(reduce_kernel(x, axes, Reduction::sum, "sum", out_dtype), x.shape(), axes, keepdims); },
                   autodiff::higher_order([xs = x.shape(), dt = x.dtype(), keep = reduced_shape(x.shape(), axes, true)](
                                              Cotangents& c, autodiff::Saved) {
                     if (autodiff::creating_graph()) return c.set(0, broadcast_to(reshape(c.out(), keep.vec()), xs));
                     // In x's dtype before the broadcast (a float32 sum of bf16, as mean's): the same
                     // values as the broadcast cast afterwards, without a float32 array of x's size.
                     Array g = c.out().with_shape(keep);
                     if (g.dtype() != dt) g = astype(g, dt);
                     c.set(0, ops::detail::broadcast_raw(g, xs));
                   }));
}
}  // namespace

Array sum(const Array& x, const std::vector<int>& axes_in, bool keepdims) {
  ops::detail::require_float(x, "sum");
  return sum_as(x, axes_in, keepdims, x.dtype());
}
Array sum(const Array& x) { return sum(x, all_axes(x.rank()), false); }

Array prod(const Array& x, const std::vector<int>& axes_in, bool keepdims) {
  ops::detail::require_float(x, "prod");
  const std::vector<int> axes = ops::detail::normalize_axes(axes_in, x.rank(), "prod");
  const Shape kept = reduced_shape(x.shape(), axes, true);
  std::int64_t count = 1;
  for (int a : axes) count *= x.dim(a);
  if (count == 0) return astype(Array::ones(reduced_shape(x.shape(), axes, keepdims)), x.dtype());
  // The reduced axes last, flattened into one: [kept..., count]; its last running product.
  std::vector<int> perm;
  for (int i = 0; i < x.rank(); ++i)
    if (std::find(axes.begin(), axes.end(), i) == axes.end()) perm.push_back(i);
  perm.insert(perm.end(), axes.begin(), axes.end());
  std::vector<std::int64_t> rows;
  for (std::size_t i = 0; i + axes.size() < perm.size(); ++i) rows.push_back(x.dim(perm[i]));
  rows.push_back(count);
  const Array running = cumprod(reshape(transpose(x, perm), rows), -1);
  const Array last = slice_axis(running, -1, count - 1, count);
  return reshape(last, (keepdims ? kept : reduced_shape(x.shape(), axes, false)).vec());
}
Array prod(const Array& x) { return prod(x, all_axes(x.rank()), false); }

Array mean(const Array& x, const std::vector<int>& axes_in, bool keepdims) {
  ops::detail::require_float(x, "mean");
  const std::vector<int> axes = ops::detail::normalize_axes(axes_in, x.rank(), "mean");
  std::int64_t count = 1;
  for (int a : axes) count *= x.shape()[a];
  if (x.dtype() == DType::bf16)  // the float32 sum, scaled, rounded once
    return astype(sum_as(x, axes, keepdims, DType::f32) * (1.0f / static_cast<float>(count)), x.dtype());
  return sum(x, axes, keepdims) * (1.0f / static_cast<float>(count));
}
Array mean(const Array& x) { return mean(x, all_axes(x.rank()), false); }

Array max(const Array& x, const std::vector<int>& axes_in, bool keepdims) {
  ops::detail::require_float(x, "max");
  const std::vector<int> axes = ops::detail::normalize_axes(axes_in, x.rank(), "max");
  if (x.batched()) [[unlikely]]
    return ops::batching::wrap(max(x.physical(), ops::batching::physical_axes(axes, x.rank(), x.batch_levels().size(), "max"), keepdims),
                               x.batch_levels());
  return primitive("max", {&x},
                   [&](Residuals& r) {
                     Array keep = reduce_kernel(x, axes, Reduction::max, "max");
                     r.keep(x, keep);  // keep: the keepdims-shaped maximum (an internal residual unless keepdims)
                     return finish(keep, x.shape(), axes, keepdims);
                   },
                   // Which elements hold the maximum is piecewise constant: the rule is linear in the cotangent.
                   autodiff::higher_order([axes](Cotangents& c, autodiff::Saved s) {
                     // Share the cotangent equally among the elements equal to the maximum.
                     Array hit = equal(s[0].detached(), s[1].detached());
                     Array count = reduce_kernel(hit, axes, Reduction::sum, "max");
                     Array g = autodiff::creating_graph() ? reshape(c.out(), s[1].shape().vec()) : c.out().with_shape(s[1].shape());
                     c.set(0, mul(hit, div(g, count)));
                   }));
}
Array max(const Array& x) { return max(x, all_axes(x.rank()), false); }

Array min(const Array& x, const std::vector<int>& axes, bool keepdims) { return neg(max(neg(x), axes, keepdims)); }
Array min(const Array& x) { return neg(max(neg(x))); }

Array var(const Array& x, const std::vector<int>& axes, bool keepdims) {
  ops::detail::require_float(x, "var");
  if (x.dtype() == DType::bf16) return ops::detail::via_f32(x, [&](const Array& w) { return var(w, axes, keepdims); });
  Array centered = x - mean(x, axes, true);
  return mean(square(centered), axes, keepdims);
}
Array var(const Array& x) { return var(x, all_axes(x.rank()), false); }

Array logsumexp(const Array& x, const std::vector<int>& axes_in, bool keepdims) {
  ops::detail::require_float(x, "logsumexp");
  if (x.dtype() == DType::bf16) return ops::detail::via_f32(x, [&](const Array& w) { return logsumexp(w, axes_in, keepdims); });
  const std::vector<int> axes = ops::detail::normalize_axes(axes_in, x.rank(), "logsumexp");
  if (x.batched()) [[unlikely]]
    return ops::batching::wrap(
        logsumexp(x.physical(), ops::batching::physical_axes(axes, x.rank(), x.batch_levels().size(), "logsumexp"), keepdims),
        x.batch_levels());
  Array m;
  {
    autodiff::NoGradGuard no_grad;
    m = max(x.detached(), axes, true);
    // An all -inf slice would give inf - inf; shift by 0 there instead.
    float* pm = m.mutable_data();
    for (std::int64_t i = 0; i < m.numel(); ++i)
      if (!std::isfinite(pm[i])) pm[i] = 0.0f;
  }
  Array lse = log(sum(exp(x - m), axes, true)) + m;
  return keepdims ? lse : reshape(lse, reduced_shape(x.shape(), axes, false).vec());
}
Array logsumexp(const Array& x) { return logsumexp(x, all_axes(x.rank()), false); }

Array argmax(const Array& x, int axis_in) {
  ops::detail::require_float(x, "argmax");
  if (x.batched()) [[unlikely]]
    return ops::batching::wrap(argmax(x.physical(), ops::batching::physical_axis(axis_in, x.rank(), x.batch_levels().size(), "argmax")),
                               x.batch_levels());
  if (x.dtype() == DType::bf16) {
    autodiff::NoGradGuard constants;
    return argmax(astype(x.detached(), DType::f32), axis_in);
  }
  const int axis = x.shape().normalize_axis(axis_in, "argmax");
  if (x.shape()[axis] == 0) throw ShapeError(detail::cat("argmax: axis ", axis_in, " of ", x.shape(), " is empty"));
  std::int64_t outer = 1, inner = 1;
  for (int i = 0; i < axis; ++i) outer *= x.shape()[i];
  for (int i = axis + 1; i < x.rank(); ++i) inner *= x.shape()[i];
  const std::int64_t n = x.shape()[axis];
  Array out = Array::empty(reduced_shape(x.shape(), {axis}, false), DType::i32);
  const float* px = x.data();
  std::int32_t* po = out.mutable_data_i32();
  for (std::int64_t o = 0; o < outer; ++o)
    for (std::int64_t i = 0; i < inner; ++i) {
      std::int64_t best = 0;
      float bv = px[o * n * inner + i];
      for (std::int64_t k = 1; k < n; ++k) {
        const float v = px[(o * n + k) * inner + i];
        if (v > bv || (std::isnan(v) && !std::isnan(bv))) { bv = v; best = k; }
      }
      po[o * inner + i] = static_cast<std::int32_t>(best);
    }
  return out;
}

}  // namespace linum
