// Average and max pooling on NHWC images. Loops run per output pixel with the channels innermost
// (contiguous, vectorised). avg_pool's backward needs only shapes (and, without
// count_include_pad, one divisor per output pixel); max_pool keeps the int32 position of each
// window's maximum (one per output, not the whole input). bf16 images are read and written as they
// are, with float32 sums per pixel (and per image for the gradients): the float32 computation
// rounded once, without float32 copies of the images.
#include <linum/core/fp_mode.hpp>
#include <linum/core/threading.hpp>
#include <linum/core/autodiff/primitive.hpp>
#include <linum/core/ops/batching.hpp>
#include <linum/core/ops/conv.hpp>
#include <linum/core/ops/elementwise.hpp>
#include <linum/core/ops/kernel_util.hpp>
#include <linum/core/ops/shape_ops.hpp>

#include <algorithm>
#include <cstddef>
#include <limits>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

#include <linum/core/kernels/avx512_bf16_bits_internal.hpp>
#include <linum/core/kernels/avx512_lanes_internal.hpp>
#endif

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
  ops::detail::require_float(x, op);
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

// The calling thread's index in the current team (0 outside parallel regions).
int thread_index() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

// Runs f(p, scratch) for every output pixel, in parallel when the work is large; `scratch` holds C
// floats of the calling thread (allocated before the region).
template <class F>
void for_pixels(const PoolGeometry& G, F f) {
  const std::int64_t pixels = G.out_pixels();
  const int threads = pixels * G.c * G.kh * G.kw > ops::detail::kParallelMin ? linum::team_size() : 1;
  ops::detail::AlignedScratch scratch(static_cast<std::int64_t>(threads) * G.c);
  float* base = scratch.data();
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (std::int64_t p = 0; p < pixels; ++p) {
    linum::detail::enter_compute();
    f(p, base + static_cast<std::ptrdiff_t>(thread_index()) * G.c);
  }
}

// Runs f(n, scratch) for every image n, in parallel when the work is large (windows may overlap
// within an image, never across images); with `image_scratch`, `scratch` holds one input image
// (H * W * C floats) of the calling thread, an array the memory accounting counts.
template <class F>
void for_images(const PoolGeometry& G, bool image_scratch, F f) {
  const bool parallel = G.n > 1 && G.out_pixels() * G.c * G.kh * G.kw > ops::detail::kParallelMin;
  const int threads = parallel ? linum::team_size() : 1;
  const std::int64_t per = image_scratch ? G.h * G.w * G.c : 0;
  Array scratch = per > 0 ? Array::empty(Shape{threads, per}) : Array();
  float* base = per > 0 ? scratch.mutable_data() : nullptr;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (std::int64_t n = 0; n < G.n; ++n) {
    linum::detail::enter_compute();
    f(n, base != nullptr ? base + static_cast<std::ptrdiff_t>(thread_index()) * per : nullptr);
  }
}

// (bf16 lanes load and store as 16-bit elements: AVX-512BW and VL)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// 16 channels of a float or bfloat16 row as float32 (lanes past m zero), and back (bf16 rounded as
// bfloat16(float) rounds).
template <class T>
__m512 load_lanes(__mmask16 m, const T* p) {
  if constexpr (std::is_same_v<T, float>) return _mm512_maskz_loadu_ps(m, p);
  else return kernels::detail::widen_bf16(_mm256_maskz_loadu_epi16(m, p));
}
template <class T>
void store_lanes(__mmask16 m, T* p, __m512 v) {
  if constexpr (std::is_same_v<T, float>) _mm512_mask_storeu_ps(p, m, v);
  else _mm256_mask_storeu_epi16(p, m, kernels::detail::round_to_bf16(v));
}

// avg_pool's forward with AVX-512, per output row (image, row): each pixel's window summed in
// float32 registers 16 channels at a time (the last group masked), in for_window's order (window
// rows, then columns, in bounds only), then divided (and rounded to bf16 for bf16 images): the
// portable loop's sums and quotients, without its per-pixel index divisions and its sums in memory
// (which ran the main example's stem pooling at a tenth of the memory's speed).
template <class T>
void avg_pool_rows(const PoolGeometry& G, const T* x, T* y, float* divisors, float full) {
  const std::int64_t C = G.c, OH = G.ph.out, OW = G.pw.out, rows = G.n * OH;
  const int threads = G.out_pixels() * C * G.kh * G.kw > ops::detail::kParallelMin ? linum::team_size() : 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (std::int64_t row = 0; row < rows; ++row) {
    linum::detail::enter_compute();
    const std::int64_t n = row / OH, top = (row % OH) * G.sh - G.ph.pad_lo;
    const std::int64_t ih0 = std::max<std::int64_t>(0, top), ih1 = std::min(G.h, top + G.kh);
    for (std::int64_t ow = 0; ow < OW; ++ow) {
      const std::int64_t left = ow * G.sw - G.pw.pad_lo;
      const std::int64_t iw0 = std::max<std::int64_t>(0, left), iw1 = std::min(G.w, left + G.kw);
      const std::int64_t valid = std::max<std::int64_t>(0, ih1 - ih0) * std::max<std::int64_t>(0, iw1 - iw0);
      const float divisor = divisors != nullptr ? static_cast<float>(valid) : full;
      if (divisors != nullptr) divisors[row * OW + ow] = divisor;
      const __m512 d = _mm512_set1_ps(divisor);
      T* out = y + (row * OW + ow) * C;
      for (std::int64_t c0 = 0; c0 < C; c0 += 16) {
        const __mmask16 m = kernels::detail::lanes(C - c0);
        __m512 sum = _mm512_setzero_ps();
        for (std::int64_t ih = ih0; ih < ih1; ++ih)
          for (std::int64_t iw = iw0; iw < iw1; ++iw)
            sum = _mm512_add_ps(sum, load_lanes(m, x + ((n * G.h + ih) * G.w + iw) * C + c0));
        store_lanes(m, out + c0, _mm512_div_ps(sum, d));
      }
    }
  }
}
#endif

// Element type T of a float array (float or bfloat16) as float32, and back (rounded once).
template <class T>
float wide(T v) {
  return static_cast<float>(v);
}
template <class T>
T narrow(float v) {
  return T(v);
}

// Calls f.template operator()<T>() with T the C++ type of a float array's dtype.
template <class F>
decltype(auto) by_dtype(DType d, F&& f) {
  if (d == DType::bf16) return f.template operator()<bfloat16>();
  return f.template operator()<float>();
}

// A pooling gradient in g's dtype, summed per image in float32 (in dx itself for float32, else in a
// per-thread image of scratch) and rounded once: add(n, sums, pg) adds image n's contributions into
// `sums` (its H * W * C floats) from g's elements `pg` (float or bfloat16).
template <class Add>
Array per_image_gradient(const Array& g, const PoolGeometry& G, const Shape& xs, Add add) {
  const bool f32 = g.dtype() == DType::f32;
  Array dx = Array::empty(xs, g.dtype());  // (each image zeroed below, on its thread)
  const std::int64_t image = G.h * G.w * G.c;
  by_dtype(g.dtype(), [&]<class T>() {
    const T* pg = static_cast<const T*>(g.raw());
    T* pd = static_cast<T*>(dx.mutable_raw());
    for_images(G, !f32, [&](std::int64_t n, float* scratch) {
      float* sums = f32 ? reinterpret_cast<float*>(pd) + n * image : scratch;
      std::fill_n(sums, image, 0.0f);
      add(n, sums, pg);
      if (!f32)
        for (std::int64_t i = 0; i < image; ++i) pd[n * image + i] = narrow<T>(sums[i]);
    });
  });
  return dx;
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
  const PoolGeometry G = plan(x, o, "avg_pool");
  const float full = static_cast<float>(G.kh * G.kw);
  return primitive("avg_pool", {&x},
    [&](Residuals& r) {
      Array y = Array::empty(Shape{G.n, G.ph.out, G.pw.out, G.c}, x.dtype());
      // Without count_include_pad, windows at the border divide by their in-bounds size.
      Array divisors = o.count_include_pad ? Array() : Array::empty(Shape{G.n, G.ph.out, G.pw.out});
      float* pdiv = divisors.defined() ? divisors.mutable_data() : nullptr;
      by_dtype(x.dtype(), [&]<class T>() {
        const T* px = static_cast<const T*>(x.raw());
        T* py = static_cast<T*>(y.mutable_raw());
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
        avg_pool_rows(G, px, py, pdiv, full);
#else
        const std::int64_t C = G.c;
        for_pixels(G, [&](std::int64_t p, float* sum) {
          std::fill_n(sum, C, 0.0f);
          const std::int64_t valid = for_window(G, p, [&](std::int64_t in_pixel) {
            const T* in = px + in_pixel * C;
            for (std::int64_t ch = 0; ch < C; ++ch) sum[ch] += wide(in[ch]);
          });
          const float divisor = pdiv ? static_cast<float>(valid) : full;
          if (pdiv) pdiv[p] = divisor;
          T* out = py + p * C;
          for (std::int64_t ch = 0; ch < C; ++ch) out[ch] = narrow<T>(sum[ch] / divisor);
        });
#endif
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
                   [&](Residuals&) { return avg_pool_backward(g, G, full, xs, divisors); },
                   higher_order([o](Cotangents& c, autodiff::Saved) { c.set(0, avg_pool(c.out(), o)); }));
}

// dx in g's dtype (per_image_gradient).
Array avg_pool_backward(const Array& g, const PoolGeometry& G, float full, const Shape& xs, const Array& divisors) {
  ops::detail::require_float(g, "avg_pool");
  const float* pdiv = divisors.defined() ? divisors.data() : nullptr;
  const std::int64_t C = G.c, per_image = G.ph.out * G.pw.out;
  return per_image_gradient(g, G, xs, [&](std::int64_t n, float* sums, const auto* pg) {
    const std::int64_t first_pixel = n * G.h * G.w;
    for (std::int64_t p = n * per_image; p < (n + 1) * per_image; ++p) {
      const float inv = 1.0f / (pdiv ? pdiv[p] : full);
      const auto* gp = pg + p * C;
      for_window(G, p, [&](std::int64_t in_pixel) {
        float* d = sums + (in_pixel - first_pixel) * C;
        for (std::int64_t ch = 0; ch < C; ++ch) d[ch] += wide(gp[ch]) * inv;
      });
    }
  });
}
}  // namespace

Array max_pool(const Array& x, const PoolOptions& o) {
  ops::detail::require_float(x, "max_pool");
  if (x.batched()) [[unlikely]]  // vmap: the levels folded into the images
    return ops::batching::images(x, [&](const Array& p) { return max_pool(p, o); });
  const PoolGeometry G = plan(x, o, "max_pool");
  if (x.numel() > std::numeric_limits<std::int32_t>::max())
    throw ShapeError(detail::cat("max_pool: input of shape ", x.shape(), " is too large (more than 2^31 elements)"));
  return primitive("max_pool", {&x},
    [&](Residuals& r) {
      Array y = Array::empty(Shape{G.n, G.ph.out, G.pw.out, G.c}, x.dtype());
      Array where = Array::empty(y.shape(), DType::i32);  // flat input index of each maximum
      std::int32_t* pw = where.mutable_data_i32();
      const std::int64_t C = G.c;
      by_dtype(x.dtype(), [&]<class T>() {
        const T* px = static_cast<const T*>(x.raw());
        T* py = static_cast<T*>(y.mutable_raw());
        for_pixels(G, [&](std::int64_t p, float* best) {
          std::int32_t* arg = pw + p * C;
          std::fill_n(best, C, -std::numeric_limits<float>::infinity());
          std::fill_n(arg, C, -1);
          for_window(G, p, [&](std::int64_t in_pixel) {
            const T* in = px + in_pixel * C;
            for (std::int64_t ch = 0; ch < C; ++ch)
              if (wide(in[ch]) > best[ch] || arg[ch] < 0) {  // the first maximum wins ties
                best[ch] = wide(in[ch]);
                arg[ch] = static_cast<std::int32_t>(in_pixel * C + ch);
              }
          });
          T* out = py + p * C;
          for (std::int64_t ch = 0; ch < C; ++ch) out[ch] = narrow<T>(best[ch]);  // exact: best is an input element
        });
      });
      r.keep(where);
      return y;
    },
    higher_order([G, xs = x.shape()](Cotangents& c, autodiff::Saved s) {
      if (autodiff::creating_graph()) {  // the same scatter-add as an op (the positions are constants)
        const Array pos = s[0].detached();
        const DType dtype = c.out().dtype();  // summed in float32 (windows may overlap), rounded once
        const Array flat = reshape(astype(c.out(), DType::f32), {pos.numel()});
        std::vector<std::int32_t> idx = pos.to_vector_i32();
        const bool any_empty = std::any_of(idx.begin(), idx.end(), [](std::int32_t i) { return i < 0; });
        std::vector<float> valid(idx.size());
        for (std::size_t k = 0; k < idx.size(); ++k) valid[k] = idx[k] >= 0 ? 1.0f : 0.0f, idx[k] = std::max(idx[k], 0);
        const Array g = any_empty ? where(Array::from(Shape{pos.numel()}, valid), flat, Array::scalar(0.0f)) : flat;
        const Array dx = reshape(ops::detail::take_add(g, Array::from_i32(Shape{pos.numel()}, idx), Shape{xs.numel()}, 0), xs.vec());
        return c.set(0, astype(dx, dtype));
      }
      // Each image's sums in float32 (windows may overlap), rounded once (per_image_gradient): a
      // maximum's position is in its own output's image.
      const std::int32_t* pi = s[0].data_i32();
      const std::int64_t in_image = G.h * G.w * G.c, out_image = G.ph.out * G.pw.out * G.c;
      c.set(0, per_image_gradient(c.out(), G, xs, [&](std::int64_t n, float* sums, const auto* pg) {
        for (std::int64_t k = n * out_image; k < (n + 1) * out_image; ++k)
          if (pi[k] >= 0) sums[pi[k] - n * in_image] += wide(pg[k]);
      }));
    }));
}

}  // namespace linum
