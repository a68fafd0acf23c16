#include <linum/core/ops/batching.hpp>
#include <linum/core/ops/normalization.hpp>
#include <linum/core/threading.hpp>

#include <linum/core/autodiff/primitive.hpp>
#include <linum/core/ops/elementwise.hpp>
#include <linum/core/ops/kernel_util.hpp>
#include <linum/core/ops/reduce.hpp>
#include <linum/core/ops/shape_ops.hpp>

#include <Eigen/Core>

#include <cmath>
#include <vector>

namespace linum {

namespace {

using autodiff::Cotangents;
using Row = Eigen::Map<Eigen::ArrayXf>;
using ConstRow = Eigen::Map<const Eigen::ArrayXf>;

// Rows per work item. Fixed (not derived from the thread count), so the row blocks whose partial
// sums make the scale and bias gradients are the same on every run.
constexpr std::int64_t kRowsPerBlock = 32;

struct NormShape {
  std::int64_t rows = 0, features = 0;
};

// Runs f(first_row, row_count, block_index, scratch) over row blocks, in parallel for large inputs
// (one contiguous run of blocks per thread: "Contiguous runs" in kernel_util.hpp).
template <class F>
void for_row_blocks(const NormShape& s, F&& f) {
  const std::int64_t blocks = (s.rows + kRowsPerBlock - 1) / kRowsPerBlock;
  [[maybe_unused]] const bool parallel = s.rows * s.features >= ops::detail::kParallelMin && blocks > 1;
#pragma omp parallel if (parallel) num_threads(linum::team_size())
  {
    linum::detail::enter_compute();
    ops::detail::AlignedScratch scratch(3 * s.features);
#pragma omp for schedule(static)
    for (std::int64_t b = 0; b < blocks; ++b) {
      const std::int64_t first = b * kRowsPerBlock;
      f(first, std::min(kRowsPerBlock, s.rows - first), b, scratch.data());
    }
  }
}

// A row of a float array as float32 (a pointer into it, or widened into `scratch`).
const float* row_f32(const Array& a, std::int64_t row, std::int64_t n, float* scratch) {
  return ops::detail::f32_view(a, row * n, n, scratch);
}

// The param as float32 values (empty vector when undefined).
std::vector<float> param_f32(const Array& p) {
  if (!p.defined()) return {};
  return p.to_vector();
}

Array norm_impl(const char* op, const Array& x, const Array& scale, const Array& bias, const NormOptions& o, bool center) {
  ops::detail::require_defined(x, op);
  ops::detail::require_float(x, op);
  if (o.num_axes < 1 || o.num_axes > x.rank())
    throw ShapeError(detail::cat(op, ": num_axes must be between 1 and the rank of x, got ", o.num_axes, " for x of shape ",
                                 x.shape()));
  if (!(o.epsilon >= 0.0)) throw ValueError(detail::cat(op, ": epsilon must be >= 0, got ", o.epsilon));
  if (scale.batched() || bias.batched()) [[unlikely]] {
    // vmap with per-example scale or bias (an ensemble's own LayerNorm): normalize, then scale and
    // shift as elementwise ops (in float32, rounded once to the output dtype).
    NormOptions plain = o;
    plain.dtype = DType::f32;
    Array y = norm_impl(op, x, Array(), Array(), plain, center);
    if (scale.defined()) y = mul(y, astype(scale, DType::f32));
    if (bias.defined()) y = add(y, astype(bias, DType::f32));
    DType out = o.dtype.value_or(x.dtype());
    if (!o.dtype) {
      if (scale.defined()) out = promote_types(out, false, scale.dtype(), false);
      if (bias.defined()) out = promote_types(out, false, bias.dtype(), false);
    }
    return astype(y, out);
  }
  if (x.batched()) [[unlikely]]  // vmap: the trailing axes of every example
    return ops::batching::wrap(norm_impl(op, x.physical(), scale, bias, o, center), x.batch_levels());
  Shape feature_shape;
  for (int a = x.rank() - o.num_axes; a < x.rank(); ++a) feature_shape.push_back(x.dim(a));
  for (const Array* p : {&scale, &bias}) {
    if (!p->defined()) continue;
    ops::detail::require_float(*p, op);
    if (!(p->shape() == feature_shape))
      throw ShapeError(detail::cat(op, ": scale and bias must have the shape of the normalized axes of x, ", feature_shape,
                                   ", got ", p->shape(), " for x of shape ", x.shape(), " (num_axes ", o.num_axes, ")"));
  }
  NormShape s;
  s.features = feature_shape.numel();
  s.rows = s.features == 0 ? 0 : x.numel() / s.features;
  DType out_dtype = x.dtype();
  if (o.dtype) out_dtype = *o.dtype;
  else for (const Array* p : {&scale, &bias}) if (p->defined()) out_dtype = promote_types(out_dtype, p->dtype());
  if (!is_floating(out_dtype))
    throw ValueError(detail::cat(op, ": dtype must be float32 or bfloat16, got ", dtype_name(out_dtype)));

  // One primitive: the kernel computes each row's statistics once; the rule reads them (an internal
  // residual, kept with the output when a remat policy saves it).
  auto forward = [&](autodiff::Residuals& keep) {
    const std::vector<float> sc = param_f32(scale), bi = param_f32(bias);
    Array y = Array::empty(x.shape(), out_dtype);
    Array stats = Array::empty(Shape{s.rows, 2});  // per row: mean (0 without centring), 1 / sqrt(var + eps)
    float* st = stats.mutable_data();
    const float n = static_cast<float>(s.features);
    const float eps = static_cast<float>(o.epsilon);
    for_row_blocks(s, [&](std::int64_t first, std::int64_t count, std::int64_t, float* scratch) {
      for (std::int64_t r = first; r < first + count; ++r) {
        ConstRow xr(row_f32(x, r, s.features, scratch), s.features);
        float mu = 0.0f, var;
        if (!center) {
          var = xr.square().sum() / n;
        } else if (o.fast_variance) {
          mu = xr.sum() / n;
          var = std::max(0.0f, xr.square().sum() / n - mu * mu);
        } else {
          mu = xr.sum() / n;
          var = (xr - mu).square().sum() / n;
        }
        const float rstd = 1.0f / std::sqrt(var + eps);
        st[2 * r] = mu;
        st[2 * r + 1] = rstd;
        float* yr = ops::detail::f32_target(y, r * s.features, scratch + s.features);
        Row out(yr, s.features);
        if (sc.empty()) out = (xr - mu) * rstd;
        else out = (xr - mu) * (rstd * ConstRow(sc.data(), s.features));
        if (!bi.empty()) out += ConstRow(bi.data(), s.features);
        ops::detail::f32_commit(y, r * s.features, s.features, yr);
      }
    });
    keep.keep(x, scale, stats);
    return y;
  };
  // Create-graph mode differentiates the same normalization written with ops.
  auto composite = [s, center, eps = static_cast<float>(o.epsilon), out_dtype, xshape = x.shape()](const std::vector<Array>& in) {
    Array xf = astype(reshape(in[0], {s.rows, s.features}), DType::f32);
    if (center) xf = xf - mean(xf, {1}, true);
    Array y = xf * rsqrt(mean(square(xf), {1}, true) + eps);
    if (in[1].defined()) y = y * astype(reshape(in[1], {s.features}), DType::f32);
    if (in[2].defined()) y = y + astype(reshape(in[2], {s.features}), DType::f32);
    return std::vector<Array>{astype(reshape(y, xshape.vec()), out_dtype)};
  };
  return autodiff::primitive(op, {&x, &scale, &bias}, forward,
                             autodiff::higher_order([s, center, has_bias = bias.defined(), composite, fshape = feature_shape](Cotangents& c, autodiff::Saved saved) {
      if (autodiff::creating_graph()) {
        const Array bias_stand_in = has_bias ? Array::zeros(fshape) : Array();  // its value does not enter the vjp
        return autodiff::composite_rule(c, {saved[0], saved[1], bias_stand_in}, composite);
      }
      const Array& xs = saved[0];
      const Array& scale_s = saved[1];
      const float* st = saved[2].data();
      const Array dy = c.out();
      const std::vector<float> sc = param_f32(scale_s);
      const bool want_params = c.needs(1) || c.needs(2);
      const std::int64_t blocks = (s.rows + kRowsPerBlock - 1) / kRowsPerBlock;
      // Per row block: partial sums of dy * xhat (scale) and dy (bias).
      std::vector<float> partial(want_params ? static_cast<std::size_t>(2 * blocks * s.features) : 0, 0.0f);
      Array dx = Array::empty(xs.shape(), xs.dtype());
      const float n = static_cast<float>(s.features);
      for_row_blocks(s, [&](std::int64_t first, std::int64_t count, std::int64_t block, float* scratch) {
        float* ds = want_params ? partial.data() + 2 * block * s.features : nullptr;
        for (std::int64_t r = first; r < first + count; ++r) {
          const float mu = st[2 * r], rstd = st[2 * r + 1];
          ConstRow xr(row_f32(xs, r, s.features, scratch), s.features);
          ConstRow g_out(row_f32(dy, r, s.features, scratch + s.features), s.features);
          float* dxr = ops::detail::f32_target(dx, r * s.features, scratch + 2 * s.features);
          Row d(dxr, s.features);
          d = (xr - mu) * rstd;  // xhat, in dx's storage until dx is formed
          if (ds != nullptr) {
            Row(ds, s.features) += g_out * d;
            Row(ds + s.features, s.features) += g_out;
          }
          const float mean_gx =
              (sc.empty() ? (g_out * d).sum() : (g_out * ConstRow(sc.data(), s.features) * d).sum()) / n;
          const float mean_g = center ? (sc.empty() ? g_out.sum() : (g_out * ConstRow(sc.data(), s.features)).sum()) / n : 0.0f;
          if (sc.empty()) d = rstd * (g_out - mean_g - d * mean_gx);
          else d = rstd * (g_out * ConstRow(sc.data(), s.features) - mean_g - d * mean_gx);
          ops::detail::f32_commit(dx, r * s.features, s.features, dxr);
        }
      });
      if (c.needs(0)) c.set(0, std::move(dx));
      if (!want_params) return;
      // The blocks' partial sums, added in block order.
      std::vector<float> dscale(static_cast<std::size_t>(s.features), 0.0f), dbias(dscale);
      for (std::int64_t b = 0; b < blocks; ++b) {
        Row(dscale.data(), s.features) += ConstRow(partial.data() + 2 * b * s.features, s.features);
        Row(dbias.data(), s.features) += ConstRow(partial.data() + (2 * b + 1) * s.features, s.features);
      }
      const Shape pshape = scale_s.defined() ? scale_s.shape() : Shape{s.features};
      if (c.needs(1)) c.set(1, Array::from(pshape, dscale));
      if (c.needs(2) && has_bias) c.set(2, Array::from(pshape, dbias));
    }));
}

}  // namespace

Array layer_norm(const Array& x, const Array& scale, const Array& bias, const NormOptions& options) {
  return norm_impl("layer_norm", x, scale, bias, options, true);
}

Array rms_norm(const Array& x, const Array& scale, const NormOptions& options) {
  return norm_impl("rms_norm", x, scale, Array(), options, false);
}

}  // namespace linum
