// Average and max pooling on NHWC images. avg_pool's backward needs only shapes; max_pool keeps the
// int32 position of each window's maximum (one per output, not the whole input).
#include <linum/core/ops/conv.hpp>
#include <linum/core/ops/kernel_util.hpp>

#include <limits>

namespace linum {
namespace {

using autodiff::Cotangents;

struct PoolGeometry {
  std::int64_t n, h, w, c, kh, kw, sh, sw;
  detail::AxisPlan ph, pw;
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

// Calls f(out_index, in_index) for each in-bounds input of the window of every output element,
// with begin(out_index) before and end(out_index, valid_count) after each window.
template <class Begin, class Visit, class End>
void for_windows(const PoolGeometry& G, Begin begin, Visit visit, End end) {
  const std::int64_t total = G.n * G.ph.out * G.pw.out;
#pragma omp parallel for schedule(static) if (total * G.c > (1 << 16))
  for (std::int64_t p = 0; p < total; ++p) {
    const std::int64_t n = p / (G.ph.out * G.pw.out);
    const std::int64_t oh = (p / G.pw.out) % G.ph.out, ow = p % G.pw.out;
    for (std::int64_t ch = 0; ch < G.c; ++ch) {
      const std::int64_t out = p * G.c + ch;
      begin(out);
      std::int64_t valid = 0;
      for (std::int64_t i = 0; i < G.kh; ++i) {
        const std::int64_t ih = oh * G.sh - G.ph.pad_lo + i;
        if (ih < 0 || ih >= G.h) continue;
        for (std::int64_t j = 0; j < G.kw; ++j) {
          const std::int64_t iw = ow * G.sw - G.pw.pad_lo + j;
          if (iw < 0 || iw >= G.w) continue;
          visit(out, ((n * G.h + ih) * G.w + iw) * G.c + ch);
          ++valid;
        }
      }
      end(out, valid);
    }
  }
}

}  // namespace

Array avg_pool(const Array& x, const PoolOptions& o) {
  const PoolGeometry G = plan(x, o, "avg_pool");
  Array y = Array::empty(Shape{G.n, G.ph.out, G.pw.out, G.c});
  Array counts = Array::empty(y.shape());  // divisor per output
  const float* px = x.data();
  float* py = y.mutable_data();
  float* pc = counts.mutable_data();
  const float full = static_cast<float>(G.kh * G.kw);
  for_windows(
      G, [&](std::int64_t out) { py[out] = 0.0f; }, [&](std::int64_t out, std::int64_t in) { py[out] += px[in]; },
      [&](std::int64_t out, std::int64_t valid) {
        pc[out] = o.count_include_pad ? full : static_cast<float>(valid);
        py[out] /= pc[out];
      });
  if (autodiff::needs_grad(x))
    autodiff::record("avg_pool", y, {&x}, {o.count_include_pad ? Array() : counts}, [G, full, xs = x.shape()](Cotangents& c, autodiff::Saved s) {
      Array dx = Array::zeros(xs);
      float* pd = dx.mutable_data();
      const float* pg = c.out().data();
      const float* pcnt = s[0].defined() ? s[0].data() : nullptr;
      // Windows overlap, so scatter serially per batch element to stay race-free.
      PoolGeometry serial = G;
      for (std::int64_t n = 0; n < G.n; ++n) {
        serial.n = 1;
        const std::int64_t out_off = n * G.ph.out * G.pw.out * G.c, in_off = n * G.h * G.w * G.c;
        const std::int64_t total = G.ph.out * G.pw.out;
        for (std::int64_t p = 0; p < total; ++p) {
          const std::int64_t oh = p / G.pw.out, ow = p % G.pw.out;
          for (std::int64_t ch = 0; ch < G.c; ++ch) {
            const std::int64_t out = out_off + p * G.c + ch;
            const float share = pg[out] / (pcnt ? pcnt[out] : full);
            for (std::int64_t i = 0; i < G.kh; ++i) {
              const std::int64_t ih = oh * G.sh - G.ph.pad_lo + i;
              if (ih < 0 || ih >= G.h) continue;
              for (std::int64_t j = 0; j < G.kw; ++j) {
                const std::int64_t iw = ow * G.sw - G.pw.pad_lo + j;
                if (iw < 0 || iw >= G.w) continue;
                pd[in_off + (ih * G.w + iw) * G.c + ch] += share;
              }
            }
          }
        }
      }
      c.set(0, dx);
    });
  return y;
}

Array max_pool(const Array& x, const PoolOptions& o) {
  const PoolGeometry G = plan(x, o, "max_pool");
  Array y = Array::empty(Shape{G.n, G.ph.out, G.pw.out, G.c});
  Array where = Array::empty(y.shape(), DType::i32);  // flat input index of each maximum
  const float* px = x.data();
  float* py = y.mutable_data();
  std::int32_t* pw = where.mutable_data_i32();
  if (x.numel() > std::numeric_limits<std::int32_t>::max())
    throw ShapeError(detail::cat("max_pool: input of shape ", x.shape(), " is too large (more than 2^31 elements)"));
  for_windows(
      G,
      [&](std::int64_t out) {
        py[out] = -std::numeric_limits<float>::infinity();
        pw[out] = -1;
      },
      [&](std::int64_t out, std::int64_t in) {
        if (px[in] > py[out] || pw[out] < 0) {
          py[out] = px[in];
          pw[out] = static_cast<std::int32_t>(in);
        }
      },
      [](std::int64_t, std::int64_t) {});
  if (autodiff::needs_grad(x))
    autodiff::record("max_pool", y, {&x}, {where}, [xs = x.shape()](Cotangents& c, autodiff::Saved s) {
      Array dx = Array::zeros(xs);
      float* pd = dx.mutable_data();
      const float* pg = c.out().data();
      const std::int32_t* pi = s[0].data_i32();
      for (std::int64_t k = 0; k < s[0].numel(); ++k)
        if (pi[k] >= 0) pd[pi[k]] += pg[k];
      c.set(0, dx);
    });
  return y;
}

}  // namespace linum
