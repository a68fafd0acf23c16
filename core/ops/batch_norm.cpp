#include <linum/core/ops/batch_norm.hpp>

#include <linum/core/autodiff/primitive.hpp>
#include <linum/core/kernels/channel_rows_internal.hpp>
#include <linum/core/ops/batching.hpp>
#include <linum/core/ops/elementwise.hpp>
#include <linum/core/ops/kernel_util.hpp>
#include <linum/core/ops/reduce.hpp>
#include <linum/core/ops/shape_ops.hpp>
#include <linum/core/threading.hpp>

#include <algorithm>
#include <bit>
#include <type_traits>
#include <cmath>
#include <vector>

namespace linum {

namespace {

using autodiff::Cotangents;

// Elements per work item, and at most this many items (wide channel axes get blocks of more
// elements, so the partial sums, one row of C per block, stay small next to x). Fixed by the shape,
// not by the thread count, so the blocks whose partial sums make the statistics and the parameter
// gradients are the same on every run.
constexpr std::int64_t kBlockElements = 8192;
constexpr std::int64_t kMaxBlocks = 256;

// x viewed as [rows, channels], cut into blocks of whole rows.
struct Geometry {
  std::int64_t rows = 0, channels = 0, rows_per_block = 1, blocks = 0;
  std::int64_t block_elements() const { return rows_per_block * channels; }
};

Geometry geometry_of(const Array& x) {
  Geometry g;
  g.channels = x.rank() == 0 ? 1 : x.dim(-1);
  g.rows = g.channels == 0 ? 0 : x.numel() / g.channels;
  g.rows_per_block = std::max<std::int64_t>(1, (kBlockElements + g.channels - 1) / std::max<std::int64_t>(1, g.channels));
  g.rows_per_block = std::max(g.rows_per_block, (g.rows + kMaxBlocks - 1) / kMaxBlocks);
  g.blocks = (g.rows + g.rows_per_block - 1) / g.rows_per_block;
  return g;
}

// Runs f(block, first_row, row_count, scratch) over the row blocks, in parallel for large inputs;
// each thread's scratch holds `scratch_blocks` blocks of float32. Each thread takes one contiguous
// run of blocks ("Contiguous runs" in kernel_util.hpp).
template <class F>
void for_row_blocks(const Geometry& g, int scratch_blocks, F&& f) {
  [[maybe_unused]] const bool parallel = g.rows * g.channels >= ops::detail::kParallelMin && g.blocks > 1;
#pragma omp parallel if (parallel) num_threads(linum::team_size())
  {
    linum::detail::enter_compute();
    ops::detail::AlignedScratch scratch(std::max<std::int64_t>(1, scratch_blocks * g.block_elements()));
#pragma omp for schedule(static)
    for (std::int64_t b = 0; b < g.blocks; ++b) {
      const std::int64_t first = b * g.rows_per_block;
      f(b, first, std::min(g.rows_per_block, g.rows - first), scratch.data());
    }
  }
}

// Elements [start, start + n) of a float array as float32: a pointer into it, or widened into
// `scratch` (which holds a whole block).
using ops::detail::f32_view;

// A [C] param or statistic as float32 values (empty when undefined).
std::vector<float> values_f32(const Array& p) { return p.defined() ? p.to_vector() : std::vector<float>{}; }

// Per-channel sums over the rows of one or two [rows, C] arrays: float within a row block, the
// blocks' sums added in block order in double. `term(row_of_a, row_of_b, c, out)` writes the
// `Parts` summands of one element. The second array's block comes from
// `b_block(first_row, rows, a_block, scratch)` (float32 values, or null for none; a_block is the first
// array's block in float32; `scratch` holds `b_scratch_blocks` blocks). `block_sums(a_block, b_block,
// rows, out)` may add a whole block's sums into out itself (the same sums, in registers: see
// channel_rows_internal.hpp) and return true; else the rows run through `term`.
template <int Parts, class BBlock, class Term, class BlockSums>
std::vector<double> channel_sums_with(const Geometry& g, const Array& a, int b_scratch_blocks, BBlock&& b_block, Term&& term,
                                      BlockSums&& block_sums) {
  const std::int64_t C = g.channels;
  Array partial_sums = Array::zeros(Shape{g.blocks, Parts * C});  // counted by the memory timeline
  float* partial = partial_sums.mutable_data();
  for_row_blocks(g, 1 + b_scratch_blocks, [&](std::int64_t block, std::int64_t first, std::int64_t count, float* scratch) {
    const float* ab = f32_view(a, first * C, count * C, scratch);
    const float* bb = b_block(first, count, ab, scratch + g.block_elements());
    float* out = partial + Parts * block * C;
    if (block_sums(ab, bb, count, out)) return;
    for (std::int64_t r = 0; r < count; ++r) {
      const float* ar = ab + r * C;
      const float* br = bb != nullptr ? bb + r * C : nullptr;
      for (std::int64_t c = 0; c < C; ++c) {
        float t[Parts];
        term(ar, br, c, t);
        for (int p = 0; p < Parts; ++p) out[p * C + c] += t[p];
      }
    }
  });
  std::vector<double> total(static_cast<std::size_t>(Parts * C), 0.0);
  for (std::int64_t block = 0; block < g.blocks; ++block)
    for (std::int64_t i = 0; i < Parts * C; ++i) total[i] += partial[block * Parts * C + i];
  return total;
}

// No block function: the rows through `term`.
constexpr auto kRowsOnly = [](const float*, const float*, std::int64_t, float*) { return false; };

template <int Parts, class Term, class BlockSums = decltype(kRowsOnly)>
std::vector<double> channel_sums(const Geometry& g, const Array& a, const Array& b, Term&& term, BlockSums block_sums = {}) {
  const std::int64_t C = g.channels;
  return channel_sums_with<Parts>(
      g, a, 1,
      [&](std::int64_t first, std::int64_t count, const float*, float* scratch) {
        return b.defined() ? f32_view(b, first * C, count * C, scratch) : nullptr;
      },
      std::forward<Term>(term), block_sums);
}

// The backward pass's per-channel sums of dy and of dy * xhat, xhat = (x - mu) * rstd: the term of
// one element (for channel_sums' rows), and the same sums of a whole block in registers.
auto cotangent_term(const float* mu, const float* rstd) {
  return [mu, rstd](const float* xr, const float* gr, std::int64_t ch, float* t) {
    t[0] = gr[ch];
    t[1] = gr[ch] * ((xr[ch] - mu[ch]) * rstd[ch]);
  };
}
auto cotangent_block_sums(const float* mu, const float* rstd, std::int64_t C) {
  return [mu, rstd, C](const float* xb, const float* gb, std::int64_t rows, float* out) {
    return kernels::detail::sums_of_cotangent(xb, gb, mu, rstd, rows, C, out);
  };
}

// Rows of the values before the activation, as y's dtype holds them: (x - mu) * a + bias per
// channel (bias may be absent), rounded to y's dtype (Bf16); with a residual row, rr + that,
// rounded again: the roundings of the composed ops. With Relu, max(that, 0) (std::max, as the relu
// op: -0 and NaN stay). One loop, its variant fixed at compile time, so it vectorises (for up to 64
// channels on AVX-512 or AVX2, with the per-channel values held in registers across the rows:
// channel_rows_internal.hpp, which gives the same values). relu's rule
// recomputes these values from what the op keeps (x and the residual, which the layers around it
// keep anyway) rather than keeping y.
template <bool Bf16, bool Bias, bool Residual, bool Relu>
void pre_activation_rows(const float* __restrict x, const float* __restrict residual, const float* __restrict mu,
                         const float* __restrict a, const float* __restrict bias, float* __restrict out, std::int64_t rows,
                         std::int64_t C) {
  // (a value as y's dtype holds it: rounded to bf16 and widened back, or itself in float32)
  if (kernels::detail::pre_activation<Bf16, Bias, Residual, Relu>(x, residual, mu, a, bias, out, rows, C)) return;
  auto stored = [](float v) {
    if constexpr (Bf16) return std::bit_cast<float>(static_cast<std::uint32_t>(bfloat16::round_bits(v)) << 16);
    else return v;
  };
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * C;
    const float* rr = Residual ? residual + r * C : nullptr;
    float* o = out + r * C;
    if constexpr (Bias)
      for (std::int64_t c = 0; c < C; ++c) o[c] = (xr[c] - mu[c]) * a[c] + bias[c];
    else
      for (std::int64_t c = 0; c < C; ++c) o[c] = (xr[c] - mu[c]) * a[c];
    // A second loop: the normalized value is rounded (stored) before the residual is added, so the
    // compiler cannot contract (x - mu) * a + residual into one multiply-add, which the composed
    // ops do not make.
    if constexpr (Residual || Relu || Bf16)
      for (std::int64_t c = 0; c < C; ++c) {
        float v = o[c];
        if constexpr (Residual) v = rr[c] + stored(v);
        v = stored(v);  // (the residual sum's rounding; with none, the normalization's, which f32_commit repeats exactly)
        if constexpr (Relu) v = std::max(v, 0.0f);
        o[c] = v;
      }
  }
}

// The row function for a pass's variant.
using RowFn = void (*)(const float*, const float*, const float*, const float*, const float*, float*, std::int64_t, std::int64_t);
template <bool Relu>
RowFn row_function(bool bf16, bool bias, bool residual) {
  constexpr RowFn table[2][2][2] = {
      {{pre_activation_rows<false, false, false, Relu>, pre_activation_rows<false, false, true, Relu>},
       {pre_activation_rows<false, true, false, Relu>, pre_activation_rows<false, true, true, Relu>}},
      {{pre_activation_rows<true, false, false, Relu>, pre_activation_rows<true, false, true, Relu>},
       {pre_activation_rows<true, true, false, Relu>, pre_activation_rows<true, true, true, Relu>}}};
  return table[bf16][bias][residual];
}

// y = pre_activation_rows' values (relu's too when asked), rounded to y's dtype, in one pass.
void normalize_pass(const Geometry& g, const Array& x, const std::vector<float>& mu, const std::vector<float>& a,
                    const std::vector<float>& bias, Array& y, const Array& residual = Array(), bool relu = false) {
  const std::int64_t C = g.channels;
  const RowFn row = relu ? row_function<true>(y.dtype() == DType::bf16, !bias.empty(), residual.defined())
                         : row_function<false>(y.dtype() == DType::bf16, !bias.empty(), residual.defined());
  for_row_blocks(g, 3, [&](std::int64_t, std::int64_t first, std::int64_t count, float* scratch) {
    const std::int64_t e = g.block_elements();
    const float* xb = f32_view(x, first * C, count * C, scratch);
    const float* rb = residual.defined() ? f32_view(residual, first * C, count * C, scratch + 2 * e) : nullptr;
    float* yb = ops::detail::f32_target(y, first * C, scratch + e);
    row(xb, rb, mu.data(), a.data(), bias.empty() ? nullptr : bias.data(), yb, count, C);
    ops::detail::f32_commit(y, first * C, count * C, yb);
  });
}

// relu's rule (the cotangent where y > 0, else +0) for rows [first, first + count): from dy into
// out (which may be dy itself), y > 0 decided by the recomputed pre-activation (row: its
// pre_activation_rows); in float32 (a bf16 cotangent widened and narrowed again, exactly), so the
// select vectorises. `xb` is x's block in float32. Returns the block's values in float32 (scratch
// holds 2 blocks).
const float* relu_select_block(const Geometry& g, RowFn row, const float* xb, const Array& residual, const float* mu,
                               const float* a, const float* bias, const Array& dy, Array& out, std::int64_t first,
                               std::int64_t count, float* scratch) {
  const std::int64_t C = g.channels, e = g.block_elements(), n = count * C;
  float* pre = scratch;
  row(xb, residual.defined() ? f32_view(residual, first * C, n, scratch + e) : nullptr, mu, a, bias, pre, count, C);
  const float* gb = f32_view(dy, first * C, n, scratch + e);
  float* ob = ops::detail::f32_target(out, first * C, scratch + e);
  for (std::int64_t i = 0; i < n; ++i) ob[i] = pre[i] > 0.0f ? gb[i] : 0.0f;
  ops::detail::f32_commit(out, first * C, n, ob);
  return ob;
}

// The normalization's factor per channel, rstd * scale (or rstd), from the kept statistics [3, C]
// (mean, rstd, ...): the forward pass's `a`, the same floats.
std::vector<float> scaled_rstd(const Array& stats, const Array& scale) {
  const std::int64_t C = stats.dim(1);
  const float* rstd = stats.data() + C;
  const std::vector<float> sc = values_f32(scale);
  std::vector<float> a(static_cast<std::size_t>(C));
  for (std::int64_t c = 0; c < C; ++c) a[c] = sc.empty() ? rstd[c] : rstd[c] * sc[c];
  return a;
}

// What follows the normalization, as ops: residual + y, then the activation.
Array finish_composed(Array y, const BatchNormOptions& o) {
  if (o.residual.defined()) y = o.residual + y;
  return o.activation == Activation::none ? y : activate(y, o.activation);
}

struct Checked {
  Geometry g;
  DType out_dtype;
};

// Shapes and dtypes shared by both modes: x float with a last (channel) axis, every [C] operand
// float of shape [C].
Checked check(const char* op, const Array& x, std::initializer_list<std::pair<const char*, const Array*>> per_channel,
              const BatchNormOptions& o) {
  ops::detail::require_defined(x, op);
  ops::detail::require_float(x, op);
  if (x.rank() < 1)
    throw ShapeError(detail::cat(op, ": x must have a channel axis (the last), got a scalar"));
  if (!(o.epsilon >= 0.0)) throw ValueError(detail::cat(op, ": epsilon must be >= 0, got ", o.epsilon));
  const Shape channel_shape{x.dim(-1)};
  DType out = x.dtype();
  for (const auto& [name, p] : per_channel) {
    if (!p->defined()) continue;
    ops::detail::require_float(*p, op);
    if (!(p->shape() == channel_shape))
      throw ShapeError(detail::cat(op, ": ", name, " must have the shape of x's last (channel) axis, ", channel_shape, ", got ",
                                   p->shape(), " for x of shape ", x.shape()));
  }
  if (o.dtype) out = *o.dtype;
  else
    for (const auto& [name, p] : per_channel)
      if (p->defined() && (std::string_view(name) == "scale" || std::string_view(name) == "bias"))
        out = promote_types(out, p->dtype());
  if (!is_floating(out)) throw ValueError(detail::cat(op, ": dtype must be float32 or bfloat16, got ", dtype_name(out)));
  return {geometry_of(x), out};
}

// The same normalization written with ops (create-graph rules, and inputs under vmap): x [R, C].
Array composed_normalize(const Array& x, const Array& mu, const Array& var, const Array& scale, const Array& bias,
                         float eps, DType out_dtype) {
  Array mul = rsqrt(var + eps);
  if (scale.defined()) mul = mul * astype(scale, DType::f32);
  Array y = (astype(x, DType::f32) - mu) * mul;
  if (bias.defined()) y = y + astype(bias, DType::f32);
  return astype(y, out_dtype);
}


// vmap: each example normalizes over its own rows (as a function vmapped in JAX sees its own
// batch). The examples' channels become the channels of one call: x's physical [B..., rows..., C]
// as [rows, B * C], each per-channel operand as [B * C]; the results are unfolded again.
struct Folded {
  std::vector<BatchLevel> levels;
  Shape physical;  // x's physical shape, levels leading
  std::int64_t examples = 1, rows = 0, channels = 0;
};

Folded fold_levels(std::vector<BatchLevel> levels, const Array& x) {
  Folded f;
  f.levels = std::move(levels);
  const Array p = ops::batching::materialized(x, f.levels);
  f.physical = p.shape();
  for (std::size_t i = 0; i < f.levels.size(); ++i) f.examples *= p.dim(static_cast<int>(i));
  f.channels = p.dim(-1);
  f.rows = f.examples * f.channels == 0 ? 0 : p.numel() / (f.examples * f.channels);
  return f;
}

Array folded_x(const Folded& f, const Array& x) {
  const Array p = ops::batching::materialized(x, f.levels);
  return reshape(transpose(reshape(p, {f.examples, f.rows, f.channels}), {1, 0, 2}), {f.rows, f.examples * f.channels});
}

Array folded_channels(const Folded& f, const Array& a) {
  if (!a.defined()) return a;
  return reshape(ops::batching::materialized(a, f.levels), {f.examples * f.channels});
}

Array unfolded_x(const Folded& f, const Array& y) {
  return ops::batching::wrap(reshape(transpose(reshape(y, {f.rows, f.examples, f.channels}), {1, 0, 2}), f.physical.vec()),
                             f.levels);
}

Array unfolded_channels(const Folded& f, const Array& v) {
  std::vector<std::int64_t> dims;
  for (std::size_t i = 0; i < f.levels.size(); ++i) dims.push_back(f.physical[static_cast<int>(i)]);
  dims.push_back(f.channels);
  return ops::batching::wrap(reshape(v, dims), f.levels);
}

}  // namespace

BatchNormResult batch_norm(const Array& x, const Array& scale, const Array& bias, const BatchNormOptions& o) {
  constexpr const char* op = "batch_norm";
  const Checked checked = check(op, x, {{"scale", &scale}, {"bias", &bias}}, o);
  const Geometry g = checked.g;
  const DType out_dtype = checked.out_dtype;
  const Array& residual = o.residual;
  const bool relu = o.activation == Activation::relu;
  if (residual.defined() || o.activation != Activation::none) {
    // Fused: relu or none, a residual of y's shape and dtype, nothing vmapped. Otherwise the ops.
    const bool fusable = (relu || o.activation == Activation::none) && !x.batched() && !scale.batched() && !bias.batched() &&
                         (!residual.defined() || (!residual.batched() && residual.shape() == x.shape() && residual.dtype() == out_dtype));
    if (!fusable) {
      BatchNormOptions plain = o;
      plain.residual = Array();
      plain.activation = Activation::none;
      BatchNormResult r = batch_norm(x, scale, bias, plain);
      r.y = finish_composed(std::move(r.y), o);
      return r;
    }
  }
  if (x.batched() || scale.batched() || bias.batched()) [[unlikely]] {
    const Folded f = fold_levels(ops::batching::levels_of({&x, &scale, &bias}, op), x);
    BatchNormResult r = batch_norm(folded_x(f, x), folded_channels(f, scale), folded_channels(f, bias), o);
    return {unfolded_x(f, r.y), unfolded_channels(f, r.mean), unfolded_channels(f, r.var)};
  }
  if (x.numel() == 0)
    throw ShapeError(detail::cat(op, ": cannot compute batch statistics of an empty input of shape ", x.shape(),
                                 " (they would be NaN); skip empty batches, or normalize with given statistics"));
  const float eps = static_cast<float>(o.epsilon);
  const bool fast = o.fast_variance;
  const std::int64_t C = g.channels;
  const auto R = static_cast<double>(g.rows);

  auto forward = [&](autodiff::Residuals& keep) {
    // The statistics: per channel sums of x and x^2 (or of (x - mean)^2 in a second pass).
    std::vector<double> sums = channel_sums<2>(
        g, x, Array(),
        [](const float* xr, const float*, std::int64_t c, float* t) {
          t[0] = xr[c];
          t[1] = xr[c] * xr[c];
        },
        [C](const float* xb, const float*, std::int64_t rows, float* out) {
          return kernels::detail::sums_and_squares(xb, rows, C, out);
        });
    std::vector<float> mu(static_cast<std::size_t>(C)), var(mu.size());
    std::vector<float> var_moves(mu.size(), 1.0f);  // 0 where the fast variance was clamped at 0
    for (std::int64_t c = 0; c < C; ++c) {
      const double m = sums[c] / R;
      mu[c] = static_cast<float>(m);
      if (fast) {
        const double v = sums[C + c] / R - m * m;
        var[c] = static_cast<float>(std::max(0.0, v));
        if (v < 0.0) var_moves[c] = 0.0f;  // max(0, v): no gradient reaches x through the variance
      }
    }
    if (!fast) {
      std::vector<double> sq = channel_sums<1>(g, x, Array(), [&mu](const float* xr, const float*, std::int64_t c, float* t) {
        const float d = xr[c] - mu[c];
        t[0] = d * d;
      });
      for (std::int64_t c = 0; c < C; ++c) var[c] = static_cast<float>(sq[c] / R);
    }
    Array stats = Array::empty(Shape{3, C});  // mean, 1 / sqrt(var + eps), whether var moves with x
    float* st = stats.mutable_data();
    std::vector<float> a(static_cast<std::size_t>(C));
    const std::vector<float> sc = values_f32(scale), bi = values_f32(bias);
    for (std::int64_t c = 0; c < C; ++c) {
      st[c] = mu[c];
      st[C + c] = 1.0f / std::sqrt(var[c] + eps);
      st[2 * C + c] = var_moves[c];
      a[c] = sc.empty() ? st[C + c] : st[C + c] * sc[c];
    }
    Array y = Array::empty(x.shape(), out_dtype);
    normalize_pass(g, x, mu, a, bi, y, residual, relu);
    if (relu) keep.keep(x, scale, stats, bias, residual);  // relu's mask, recomputed (not y)
    else keep.keep(x, scale, stats);
    return std::vector<Array>{std::move(y), Array::from(Shape{C}, mu), Array::from(Shape{C}, var)};
  };
  // Create-graph mode differentiates the same computation written with ops; with relu, its mask
  // from the recomputed pre-activation (constant: relu is linear on each side of it).
  auto composite = [g, eps, fast, out_dtype, xshape = x.shape()](const std::vector<Array>& in, const Array& residual_in,
                                                                 const Array& relu_mask) {
    const Array xf = astype(reshape(in[0], {g.rows, g.channels}), DType::f32);
    Array mu = mean(xf, {0}, true), var;
    if (fast) var = maximum(Array::scalar(0.0f), mean(square(xf), {0}, true) - square(mu));
    else var = mean(square(xf - mu), {0}, true);
    Array y = reshape(composed_normalize(xf, mu, var, in[1], in[2], eps, out_dtype), xshape.vec());
    if (residual_in.defined()) y = residual_in + y;
    if (relu_mask.defined()) y = where(relu_mask, y, Array::zeros({}, y.dtype()));
    return std::vector<Array>{y, reshape(mu, {g.channels}), reshape(var, {g.channels})};
  };
  const Array* const ins[] = {&x, &scale, &bias, &residual};
  std::vector<Array> out = autodiff::primitive_multi(
      op, std::span<const Array* const>(ins, residual.defined() ? 4 : 3), forward,
      autodiff::higher_order([g, composite, relu, out_dtype, has_bias = bias.defined(), has_residual = residual.defined()](
                                 Cotangents& c, autodiff::Saved saved) {
        if (autodiff::creating_graph()) {
          // (bias and residual enter linearly: their values do not enter the vjp)
          const Array bias_stand_in = has_bias ? Array::zeros(Shape{g.channels}) : Array();
          std::vector<Array> inputs{saved[0], saved[1], bias_stand_in};
          if (has_residual) inputs.push_back(Array::zeros(saved[0].shape(), out_dtype));
          Array mask;
          if (relu) {
            Array pre = Array::empty(saved[0].shape(), out_dtype);
            const std::vector<float> a = scaled_rstd(saved[2], saved[1]), st = saved[2].to_vector();
            normalize_pass(g, saved[0].detached(), std::vector<float>(st.begin(), st.begin() + g.channels), a,
                           values_f32(saved[3]), pre, saved[4].defined() ? saved[4].detached() : Array());
            mask = greater(pre, Array::zeros({}, out_dtype));
          }
          return autodiff::composite_rule(c, std::move(inputs), [composite, mask](const std::vector<Array>& in) {
            return composite(in, in.size() > 3 ? in[3] : Array(), mask);
          });
        }
        const Array& xs = saved[0];
        const std::int64_t C = g.channels;
        const float* mu = saved[2].data();
        const float* rstd = mu + C;
        const float* var_moves = mu + 2 * C;
        const std::vector<float> sc = values_f32(saved[1]);
        // The cotangent of the normalized x (and of the residual): through relu first.
        Array dy = c.out(0);
        // Per channel: the sums of dy and of dy * xhat, xhat = (x - mean) * rstd.
        const auto term = cotangent_term(mu, rstd);
        const auto block_sums = cotangent_block_sums(mu, rstd, C);
        std::vector<double> sums;
        if (relu && dy.defined()) {
          // The cotangent through relu (over dy's buffer when it owns it), made block by block in
          // the sums' pass: the same sums as over it made first.
          const std::vector<float> a = scaled_rstd(saved[2], saved[1]), bias_values = values_f32(saved[3]);
          const float* bias_p = bias_values.empty() ? nullptr : bias_values.data();
          const RowFn row = row_function<false>(dy.dtype() == DType::bf16, bias_p != nullptr, saved[4].defined());
          dy = Array();
          Array in = c.take_out(0);
          Array g1 = in.owns_buffer_alone() ? std::move(in) : Array::empty(in.shape(), in.dtype());
          const Array& from = in.defined() ? in : g1;  // (moved from: read what is written over)
          sums = channel_sums_with<2>(
              g, xs, 2,
              [&](std::int64_t first, std::int64_t count, const float* xb, float* scratch) {
                return relu_select_block(g, row, xb, saved[4], mu, a.data(), bias_p, from, g1, first, count, scratch);
              },
              term, block_sums);
          dy = g1.detached();
        } else if (dy.defined()) {
          sums = channel_sums<2>(g, xs, dy, term, block_sums);
        }
        if (has_residual && c.needs(3) && dy.defined()) c.set(3, dy);
        const std::vector<float> g_mean = values_f32(c.out(1)), g_var = values_f32(c.out(2));
        const auto R = static_cast<double>(g.rows);
        if (c.needs(0)) {
          // dx = a * (dy - mean(dy) - xhat * mean(dy * xhat)) + g_mean / R + g_var * 2 (x - mean) / R
          std::vector<float> a(static_cast<std::size_t>(C)), m1(a.size(), 0.0f), m2(a.size(), 0.0f), gm(a.size(), 0.0f),
              gv(a.size(), 0.0f);
          for (std::int64_t ch = 0; ch < C; ++ch) {
            a[ch] = sc.empty() ? rstd[ch] : rstd[ch] * sc[ch];
            if (!sums.empty()) {
              m1[ch] = static_cast<float>(sums[ch] / R);
              m2[ch] = static_cast<float>(sums[C + ch] / R) * var_moves[ch];
            }
            if (!g_mean.empty()) gm[ch] = static_cast<float>(g_mean[ch] / R);
            if (!g_var.empty()) gv[ch] = static_cast<float>(2.0 * g_var[ch] / R) * var_moves[ch];
          }
          Array dx = Array::empty(xs.shape(), xs.dtype());
          for_row_blocks(g, 3, [&](std::int64_t, std::int64_t first, std::int64_t count, float* scratch) {
            const std::int64_t n = count * C, e = g.block_elements();
            const float* xb = f32_view(xs, first * C, n, scratch);
            const float* gb = dy.defined() ? f32_view(dy, first * C, n, scratch + e) : nullptr;
            float* db = ops::detail::f32_target(dx, first * C, scratch + 2 * e);
            const bool in_registers = kernels::detail::input_gradient(xb, gb, mu, rstd, a.data(), m1.data(), m2.data(),
                                                                     gm.data(), gv.data(), db, count, C);
            for (std::int64_t r = 0; r < count && !in_registers; ++r) {
              const float* xr = xb + r * C;
              float* dr = db + r * C;
              if (gb != nullptr) {
                const float* gr = gb + r * C;
                for (std::int64_t ch = 0; ch < C; ++ch) {
                  const float xc = xr[ch] - mu[ch];
                  dr[ch] = a[ch] * (gr[ch] - m1[ch] - (xc * rstd[ch]) * m2[ch]) + gm[ch] + gv[ch] * xc;
                }
              } else {
                for (std::int64_t ch = 0; ch < C; ++ch) dr[ch] = gm[ch] + gv[ch] * (xr[ch] - mu[ch]);
              }
            }
            ops::detail::f32_commit(dx, first * C, n, db);
          });
          c.set(0, std::move(dx));
        }
        auto sum_part = [&](int part) {
          std::vector<float> v(static_cast<std::size_t>(C), 0.0f);
          if (!sums.empty())
            for (std::int64_t ch = 0; ch < C; ++ch) v[ch] = static_cast<float>(sums[part * C + ch]);
          return Array::from(Shape{C}, v);
        };
        if (c.needs(1)) c.set(1, sum_part(1));
        if (c.needs(2) && has_bias) c.set(2, sum_part(0));
      }));
  return {std::move(out[0]), std::move(out[1]), std::move(out[2])};
}

Array batch_norm(const Array& x, const Array& mean_in, const Array& var_in, const Array& scale, const Array& bias,
                 const BatchNormOptions& o) {
  constexpr const char* op = "batch_norm_eval";
  for (const Array* s : {&mean_in, &var_in})
    if (!s->defined())
      throw ValueError(detail::cat(op, ": the mean and the variance must be given (the running statistics); for the "
                                   "batch's own, call batch_norm(x, scale, bias)"));
  const Checked checked = check(op, x, {{"mean", &mean_in}, {"var", &var_in}, {"scale", &scale}, {"bias", &bias}}, o);
  const Geometry g = checked.g;
  const DType out_dtype = checked.out_dtype;
  if (o.residual.defined() || o.activation != Activation::none) {  // (not fused in evaluation mode)
    BatchNormOptions plain = o;
    plain.residual = Array();
    plain.activation = Activation::none;
    return finish_composed(batch_norm(x, mean_in, var_in, scale, bias, plain), o);
  }
  if (x.batched() || mean_in.batched() || var_in.batched() || scale.batched() || bias.batched()) [[unlikely]] {
    const Folded f = fold_levels(ops::batching::levels_of({&x, &mean_in, &var_in, &scale, &bias}, op), x);
    return unfolded_x(f, batch_norm(folded_x(f, x), folded_channels(f, mean_in), folded_channels(f, var_in),
                                    folded_channels(f, scale), folded_channels(f, bias), o));
  }
  const float eps = static_cast<float>(o.epsilon);
  const std::int64_t C = g.channels;
  auto forward = [&](autodiff::Residuals& keep) {
    const std::vector<float> mu = values_f32(mean_in), var = values_f32(var_in), sc = values_f32(scale),
                             bi = values_f32(bias);
    std::vector<float> a(static_cast<std::size_t>(C));
    for (std::int64_t c = 0; c < C; ++c) {
      const float rstd = 1.0f / std::sqrt(var[c] + eps);
      a[c] = sc.empty() ? rstd : rstd * sc[c];
    }
    Array y = Array::empty(x.shape(), out_dtype);
    normalize_pass(g, x, mu, a, bi, y);
    keep.keep(x, mean_in, var_in, scale);
    return y;
  };
  auto composite = [g, eps, out_dtype, xshape = x.shape()](const std::vector<Array>& in) {
    const Array xf = reshape(in[0], {g.rows, g.channels});
    Array y = composed_normalize(xf, astype(in[1], DType::f32), astype(in[2], DType::f32), in[3], in[4], eps, out_dtype);
    return std::vector<Array>{reshape(y, xshape.vec())};
  };
  return autodiff::primitive(
      op, {&x, &mean_in, &var_in, &scale, &bias}, forward,
      autodiff::higher_order([g, eps, composite, has_bias = bias.defined()](Cotangents& c, autodiff::Saved saved) {
        if (autodiff::creating_graph()) {
          const Array bias_stand_in = has_bias ? Array::zeros(Shape{g.channels}) : Array();
          return autodiff::composite_rule(c, {saved[0], saved[1], saved[2], saved[3], bias_stand_in}, composite);
        }
        // y = (x - mean) * rstd * scale + bias: one pass for dx and the sums of dy and dy * xhat.
        const std::int64_t C = g.channels;
        const std::vector<float> mu = values_f32(saved[1]), var = values_f32(saved[2]), sc = values_f32(saved[3]);
        std::vector<float> rstd(static_cast<std::size_t>(C)), a(rstd.size());
        for (std::int64_t ch = 0; ch < C; ++ch) {
          rstd[ch] = 1.0f / std::sqrt(var[ch] + eps);
          a[ch] = sc.empty() ? rstd[ch] : rstd[ch] * sc[ch];
        }
        const Array& xs = saved[0];
        const Array& dy = c.out();
        if (c.needs(0)) {
          Array dx = Array::empty(xs.shape(), xs.dtype());
          for_row_blocks(g, 2, [&](std::int64_t, std::int64_t first, std::int64_t count, float* scratch) {
            const std::int64_t n = count * C;
            const float* gb = f32_view(dy, first * C, n, scratch);
            float* db = ops::detail::f32_target(dx, first * C, scratch + g.block_elements());
            for (std::int64_t r = 0; r < count; ++r)
              for (std::int64_t ch = 0; ch < C; ++ch) db[r * C + ch] = gb[r * C + ch] * a[ch];
            ops::detail::f32_commit(dx, first * C, n, db);
          });
          c.set(0, std::move(dx));
        }
        if (!(c.needs(1) || c.needs(2) || c.needs(3) || c.needs(4))) return;
        const float* mup = mu.data();
        const float* rp = rstd.data();
        std::vector<double> sums = channel_sums<2>(g, xs, dy, cotangent_term(mup, rp), cotangent_block_sums(mup, rp, C));
        auto channel_array = [&](auto&& value) {
          std::vector<float> v(static_cast<std::size_t>(C));
          for (std::int64_t ch = 0; ch < C; ++ch) v[ch] = static_cast<float>(value(ch));
          return Array::from(Shape{C}, v);
        };
        // d mean = -a * sum(dy); d var = -1/2 scale rstd^2 * sum(dy * xhat); d scale = sum(dy * xhat).
        if (c.needs(1)) c.set(1, channel_array([&](std::int64_t ch) { return -a[ch] * sums[ch]; }));
        if (c.needs(2))
          c.set(2, channel_array([&](std::int64_t ch) {
                  return -0.5 * (sc.empty() ? 1.0 : sc[ch]) * rstd[ch] * rstd[ch] * sums[C + ch];
                }));
        if (c.needs(3)) c.set(3, channel_array([&](std::int64_t ch) { return sums[C + ch]; }));
        if (c.needs(4) && has_bias) c.set(4, channel_array([&](std::int64_t ch) { return sums[ch]; }));
      }));
}

}  // namespace linum
