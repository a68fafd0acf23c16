// Average and max pooling on NHWC images. Loops run per output pixel with the channels innermost
// (contiguous, vectorised). avg_pool's backward needs only shapes (and, without
// count_include_pad, one divisor per output pixel); max_pool keeps the int32 position of each
// window's maximum (one per output, not the whole input).
#include <linum/core/fp_mode.hpp>
#include <linum/core/threading.hpp>
#include <linum/core/autodiff/primitive.hpp>
#include <linum/core/ops/batching.hpp>
#include <linum/core/ops/conv.hpp>
#include <linum/core/ops/elementwise.hpp>
#include <linum/core/ops/kernel_util.hpp>
#include <linum/core/ops/shape_ops.hpp>

#include <algorithm>
#include <limits>

namespace linum {
namespace {

using autodiff::Cotangents;
using autodiff::Residuals;
using autodiff::primitive;
using autodiff::higher_order;

struct PoolGeometry {
  std::int64_t n, h, w, c, kh, kw, sh, sw;
  detail::AxisPlan ph, pw;
  std::int64_t out_pixels() const { return n * ph.out * pw.out; }
};

PoolGeometry plan(const Array& x, const PoolOptions& o, const char* op) {
  ops::detail::require_f32(x, op);
  if (x.rank() != 4)
    throw ShapeError(detail::cat(op, ": needs an NHWC array [N, H, W, C], got shape ", x.shape(),
                                 "; add a batch axis with expand_dims(x, 0) for a single image"));
  PoolGeometry G{x.dim(0), x.dim(1), x.dim(2), x.dim(3), o.window[0], o.window[1], o.strides[0], o.strides[1], {}, {}};
  G.ph = detail::plan_axis(G.h, G.kh, G.sh, 1, o.padding, 0, op);
  G.pw = detail::plan_axis(G.w, G.kw, G.sw, 1, o.padding, 1, op);
  return G;
}

// Calls visit(in_pixel) for each in-bounds input pixel of output pixel p's window; returns how many.
template <class Visit>
std::int64_t for_window(const PoolGeometry& G, std::int64_t p, Visit visit) {
  const std::int64_t n = p / (G.ph.out * G.pw.out);
  const std::int64_t oh = (p / G.pw.out) % G.ph.out, ow = p % G.pw.out;
  std::int64_t valid = 0;
  for (std::int64_t i = 0; i < G.kh; ++i) {
    const std::int64_t ih = oh * G.sh - G.ph.pad_lo + i;
    if (ih < 0 || ih >= G.h) continue;
    for (std::int64_t j = 0; j < G.kw; ++j) {
      const std::int64_t iw = ow * G.sw - G.pw.pad_lo + j;
      if (iw < 0 || iw >= G.w) continue;
      visit((n * G.h + ih) * G.w + iw);
      ++valid;
    }
  }
  return valid;
}

// Runs f(p) for every output pixel, in parallel when the work is large.
template <class F>
void for_pixels(const PoolGeometry& G, F f) {
  const std::int64_t pixels = G.out_pixels();
  [[maybe_unused]] const bool parallel = pixels * G.c * G.kh * G.kw > ops::detail::kParallelMin;
#pragma omp parallel for schedule(static) num_threads(linum::team_size()) if (parallel)
  for (std::int64_t p = 0; p < pixels; ++p) {
    linum::detail::enter_compute();
    f(p);
  }
}

}  // namespace

namespace {
Array avg_pool_backward(const Array& g, const PoolGeometry& G, float full, const Shape& xs, const Array& divisors);
Array avg_pool_transpose(const Array& g, const PoolGeometry& G, float full, const Shape& xs, const Array& divisors,
                         const PoolOptions& o);
}  // namespace

Array avg_pool(const Array& x, const PoolOptions& o) {
  ops::detail::require_float(x, "avg_pool");
  if (x.batched()) [[unlikely]]  // vmap: the levels folded into the images
    return ops::batching::images(x, [&](const Array& p) { return avg_pool(p, o); });
  if (x.dtype() == DType::bf16) return ops::detail::via_f32(x, [&](const Array& w) { return avg_pool(w, o); });
  const PoolGeometry G = plan(x, o, "avg_pool");
  const float full = static_cast<float>(G.kh * G.kw);
  return primitive("avg_pool", {&x},
    [&](Residuals& r) {
      Array y = Array::empty(Shape{G.n, G.ph.out, G.pw.out, G.c});
      // Without count_include_pad, windows at the border divide by their in-bounds size.
      Array divisors = o.count_include_pad ? Array() : Array::empty(Shape{G.n, G.ph.out, G.pw.out});
      const float* px = x.data();
      float* py = y.mutable_data();
      float* pdiv = divisors.defined() ? divisors.mutable_data() : nullptr;
      const std::int64_t C = G.c;
      for_pixels(G, [&](std::int64_t p) {
        float* out = py + p * C;
        std::fill_n(out, C, 0.0f);
        const std::int64_t valid = for_window(G, p, [&](std::int64_t in_pixel) {
          const float* in = px + in_pixel * C;
          for (std::int64_t ch = 0; ch < C; ++ch) out[ch] += in[ch];
        });
        const float divisor = pdiv ? static_cast<float>(valid) : full;
        if (pdiv) pdiv[p] = divisor;
        for (std::int64_t ch = 0; ch < C; ++ch) out[ch] /= divisor;
      });
      r.keep(divisors);  // undefined with count_include_pad (the rule divides by `full`)
      return y;
    },
    higher_order([G, full, xs = x.shape(), o](Cotangents& c, autodiff::Saved s) {
      if (autodiff::creating_graph()) return c.set(0, avg_pool_transpose(c.out(), G, full, xs, s[0].detached(), o));
      c.set(0, avg_pool_backward(c.out(), G, full, xs, s[0]));
    }));
}

namespace {
// The transpose of avg_pool (its gradient), as a primitive whose rule is avg_pool again: create-graph
// mode differentiates pooling to any order.
Array avg_pool_transpose(const Array& g, const PoolGeometry& G, float full, const Shape& xs, const Array& divisors,
                         const PoolOptions& o) {
  return primitive("avg_pool_transpose", {&g},
                   [&](Residuals&) { return avg_pool_backward(astype(g, DType::f32), G, full, xs, divisors); },
                   higher_order([o](Cotangents& c, autodiff::Saved) { c.set(0, avg_pool(c.out(), o)); }));
}
}  // namespace

namespace {
Array avg_pool_backward(const Array& g, const PoolGeometry& G, float full, const Shape& xs, const Array& divisors) {
      Array dx = Array::zeros(xs);
      float* pd = dx.mutable_data();
      const float* pg = g.data();
      const float* pdiv = divisors.defined() ? divisors.data() : nullptr;
      const std::int64_t C = G.c, per_image = G.ph.out * G.pw.out;
      // Windows may overlap within an image but never across images: one image per thread.
#pragma omp parallel for schedule(static) num_threads(linum::team_size()) if (G.n > 1 && G.out_pixels() * C * G.kh * G.kw > ops::detail::kParallelMin)
      for (std::int64_t n = 0; n < G.n; ++n) {
        linum::detail::enter_compute();
        for (std::int64_t p = n * per_image; p < (n + 1) * per_image; ++p) {
          const float inv = 1.0f / (pdiv ? pdiv[p] : full);
          const float* gp = pg + p * C;
          for_window(G, p, [&](std::int64_t in_pixel) {
            float* d = pd + in_pixel * C;
            for (std::int64_t ch = 0; ch < C; ++ch) d[ch] += gp[ch] * inv;
          });
        }
      }
      return dx;
}
}  // namespace

Array max_pool(const Array& x, const PoolOptions& o) {
  ops::detail::require_float(x, "max_pool");
  if (x.batched()) [[unlikely]]  // vmap: the levels folded into the images
    return ops::batching::images(x, [&](const Array& p) { return max_pool(p, o); });
  if (x.dtype() == DType::bf16) return ops::detail::via_f32(x, [&](const Array& w) { return max_pool(w, o); });
  const PoolGeometry G = plan(x, o, "max_pool");
  if (x.numel() > std::numeric_limits<std::int32_t>::max())
    throw ShapeError(detail::cat("max_pool: input of shape ", x.shape(), " is too large (more than 2^31 elements)"));
  return primitive("max_pool", {&x},
    [&](Residuals& r) {
      Array y = Array::empty(Shape{G.n, G.ph.out, G.pw.out, G.c});
      Array where = Array::empty(y.shape(), DType::i32);  // flat input index of each maximum
      const float* px = x.data();
      float* py = y.mutable_data();
      std::int32_t* pw = where.mutable_data_i32();
      const std::int64_t C = G.c;
      for_pixels(G, [&](std::int64_t p) {
        float* out = py + p * C;
        std::int32_t* arg = pw + p * C;
        std::fill_n(out, C, -std::numeric_limits<float>::infinity());
        std::fill_n(arg, C, -1);
        for_window(G, p, [&](std::int64_t in_pixel) {
          const float* in = px + in_pixel * C;
          for (std::int64_t ch = 0; ch < C; ++ch)
            if (in[ch] > out[ch] || arg[ch] < 0) {  // the first maximum wins ties
              out[ch] = in[ch];
              arg[ch] = static_cast<std::int32_t>(in_pixel * C + ch);
            }
        });
      });
      r.keep(where);
      return y;
    },
    higher_order([xs = x.shape()](Cotangents& c, autodiff::Saved s) {
      if (autodiff::creating_graph()) {  // the same scatter-add as an op (the positions are constants)
        const Array pos = s[0].detached();
        const Array flat = reshape(c.out(), {pos.numel()});
        std::vector<std::int32_t> idx = pos.to_vector_i32();
        const bool any_empty = std::any_of(idx.begin(), idx.end(), [](std::int32_t i) { return i < 0; });
        std::vector<float> valid(idx.size());
        for (std::size_t k = 0; k < idx.size(); ++k) valid[k] = idx[k] >= 0 ? 1.0f : 0.0f, idx[k] = std::max(idx[k], 0);
        const Array g = any_empty ? where(Array::from(Shape{pos.numel()}, valid), flat, Array::scalar(0.0f)) : flat;
        return c.set(0, reshape(ops::detail::take_add(g, Array::from_i32(Shape{pos.numel()}, idx), Shape{xs.numel()}, 0), xs.vec()));
      }
      Array dx = Array::zeros(xs);
      float* pd = dx.mutable_data();
      const float* pg = c.out().data();
      const std::int32_t* pi = s[0].data_i32();
      for (std::int64_t k = 0; k < s[0].numel(); ++k)
        if (pi[k] >= 0) pd[pi[k]] += pg[k];
      c.set(0, dx);
    }));
}

}  // namespace linum
