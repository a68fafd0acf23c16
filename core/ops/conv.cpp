// conv2d: on oneDNN's convolution primitives when the engine is oneDNN (core/kernels/conv_onednn.cpp),
// else through im2col + Eigen GEMM, processed in chunks of images so the column buffer stays small.
// The backward rules keep x and w (not the 9x larger columns); the Eigen one rebuilds columns per
// chunk.
#include <linum/core/ops/kind.hpp>
#include <linum/core/fp_mode.hpp>
#include <linum/core/threading.hpp>
#include <linum/core/ops/batching.hpp>
#include <linum/core/ops/conv.hpp>
#include <linum/core/ops/shape_ops.hpp>
#include <linum/core/ops/elementwise.hpp>
#include <linum/core/ops/linalg.hpp>
#include <linum/core/autodiff/primitive.hpp>
#include <linum/core/kernels/eigen_gemm_internal.hpp>
#include <linum/core/kernels/engine.hpp>
#include <linum/core/kernels/conv.hpp>
#include <linum/core/ops/kernel_util.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cctype>
#include <limits>
#include <cstring>
#include <optional>

namespace linum {

namespace {
Padding::Kind kind_of_mode(const std::string& mode) {
  std::string upper;
  for (char c : mode) upper.push_back(static_cast<char>(std::toupper(static_cast<unsigned char>(c))));
  if (upper == "SAME") return Padding::Kind::same;
  if (upper == "VALID") return Padding::Kind::valid;
  if (upper == "CAUSAL") return Padding::Kind::causal;
  throw ValueError("unknown padding '" + mode +
                   "'; use \"SAME\", \"VALID\", \"CAUSAL\" (1-D convolutions), an int or (low, high) pairs "
                   "(CIRCULAR and REFLECT are not supported)");
}
}  // namespace

Padding::Padding(const char* mode) : Padding(std::string(mode == nullptr ? "" : mode)) {}
Padding::Padding(const std::string& mode) : kind(kind_of_mode(mode)) {}
Padding::Padding(int p) : kind(Kind::explicit_pairs), pairs{{p, p}} {
  if (p < 0) throw ValueError(detail::cat("padding: ", p, " zeros is negative; use 0 or more"));
}

std::string Padding::mode() const {
  switch (kind) {
    case Kind::same: return "SAME";
    case Kind::valid: return "VALID";
    case Kind::causal: return "CAUSAL";
    case Kind::explicit_pairs: return "";
  }
  return "";
}

std::pair<std::int64_t, std::int64_t> Padding::pair(int axis) const {
  if (pairs.empty()) return {0, 0};
  return pairs.size() == 1 ? pairs.front() : pairs.at(static_cast<std::size_t>(axis));
}

void Padding::check(const char* op, int spatial_axes, bool causal_ok) const {
  if (kind == Kind::causal && !causal_ok)
    throw ShapeError(detail::cat(op, ": CAUSAL padding is for 1-D convolutions (one spatial axis); use \"SAME\", \"VALID\" "
                                     "or explicit pairs"));
  if (kind != Kind::explicit_pairs) return;
  if (pairs.size() != 1 && pairs.size() != static_cast<std::size_t>(spatial_axes))
    throw ShapeError(detail::cat(op, ": ", pairs.size(), " padding pairs for ", spatial_axes,
                                 " spatial axes; give one (low, high) pair per spatial axis, or one for all"));
  for (const auto& [lo, hi] : pairs)
    if (lo < 0 || hi < 0)
      throw ShapeError(detail::cat(op, ": padding (", lo, ", ", hi, ") is negative; pad with 0 or more"));
}

detail::AxisPlan detail::plan_axis(std::int64_t in, std::int64_t window, std::int64_t stride, std::int64_t dilation,
                                   const Padding& padding, int axis, const char* op) {
  if (window < 1 || stride < 1 || dilation < 1)
    throw ShapeError(detail::cat(op, ": window ", window, ", stride ", stride, " and dilation ", dilation,
                                 " on spatial axis ", axis, " must all be >= 1"));
  // Sizes from user options may be huge: every step is checked, so a geometry that does not fit in
  // 64 bits is an error instead of a wrapped (undefined) size.
  auto overflow = [&](const char* what) {
    return ShapeError(detail::cat(op, ": the ", what, " on spatial axis ", axis, " overflows 64 bits (input size ", in,
                                  ", window ", window, ", stride ", stride, ", dilation ", dilation,
                                  "); use a smaller dilation, padding or window"));
  };
  std::int64_t eff = 0;
  if (__builtin_mul_overflow(window - 1, dilation, &eff) || __builtin_add_overflow(eff, 1, &eff))
    throw overflow("effective window (window - 1) * dilation + 1");
  AxisPlan p{0, 0, 0};
  switch (padding.kind) {
    case Padding::Kind::valid:
      break;
    case Padding::Kind::same: {
      const std::int64_t out = in / stride + (in % stride != 0 ? 1 : 0);
      std::int64_t total = 0;
      if (__builtin_mul_overflow(std::max<std::int64_t>(out - 1, 0), stride, &total) ||
          __builtin_add_overflow(total, eff - in, &total))
        throw overflow("'same' padding");
      total = std::max<std::int64_t>(total, 0);
      p.pad_lo = total / 2;
      p.pad_hi = total - p.pad_lo;
      break;
    }
    case Padding::Kind::explicit_pairs:
      padding.check(op, 2, false);
      p.pad_lo = padding.pair(axis).first;
      p.pad_hi = padding.pair(axis).second;
      if (p.pad_lo < 0 || p.pad_hi < 0)
        throw ShapeError(detail::cat(op, ": negative padding on spatial axis ", axis));
      break;
    case Padding::Kind::causal:
      padding.check(op, 2, false);  // throws: 2-D ops have two spatial axes
      break;
  }
  std::int64_t padded = 0;
  if (__builtin_add_overflow(in, p.pad_lo, &padded) || __builtin_add_overflow(padded, p.pad_hi, &padded))
    throw overflow("padded size");
  if (padded < eff)
    throw ShapeError(detail::cat(op, ": window of effective size ", eff, " does not fit spatial axis ", axis,
                                 " of size ", in, " (padded ", padded, ")"));
  // Checked before any engine sees the geometry: a dilation that makes the window span more than
  // 2^31 positions reads almost nothing but padding, and oneDNN spends minutes and gigabytes
  // planning such a primitive (found by fuzzing module configs).
  constexpr std::int64_t kMaxExtent = std::numeric_limits<std::int32_t>::max();
  if (eff > kMaxExtent || padded > kMaxExtent)
    throw ShapeError(detail::cat(op, ": on spatial axis ", axis, " the effective window (", eff, ") or the padded size (",
                                 padded, ") exceeds 2^31 - 1 (input size ", in, ", window ", window, ", dilation ", dilation,
                                 "); use a smaller dilation or padding"));
  p.out = (padded - eff) / stride + 1;
  return p;
}

namespace {

using autodiff::Cotangents;
using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Strided = Eigen::OuterStride<>;

struct ConvGeometry {
  std::int64_t n, h, w, c, kh, kw, cg, o, og, groups;
  detail::AxisPlan ph, pw;
  std::int64_t sh, sw, dh, dw;
  std::int64_t rows_per_image() const { return ph.out * pw.out; }
  std::int64_t col_width() const { return kh * kw * cg; }
};

// The convolution written with ops (create-graph mode differentiates it): zero padding, one strided
// slice per kernel tap, and a product per feature group, in float32.
Array composed_conv(const ConvGeometry& G, const Array& x_in, const Array& w_in) {
  Array x = pad(astype(x_in, DType::f32), {{0, 0}, {G.ph.pad_lo, G.ph.pad_hi}, {G.pw.pad_lo, G.pw.pad_hi}, {0, 0}});
  const Array w = astype(w_in, DType::f32);
  const std::int64_t OH = G.ph.out, OW = G.pw.out;
  std::vector<Array> outs;
  for (std::int64_t g = 0; g < G.groups; ++g) {
    std::vector<Array> taps;
    for (std::int64_t i = 0; i < G.kh; ++i)
      for (std::int64_t j = 0; j < G.kw; ++j)
        taps.push_back(slice(x, {0, i * G.dh, j * G.dw, g * G.cg},
                             {G.n, i * G.dh + (OH - 1) * G.sh + 1, j * G.dw + (OW - 1) * G.sw + 1, (g + 1) * G.cg},
                             {1, G.sh, G.sw, 1}));
    const Array cols = reshape(concatenate(taps, 3), {G.n * OH * OW, G.col_width()});
    const Array wg = reshape(slice(w, {0, 0, 0, g * G.og}, {G.kh, G.kw, G.cg, (g + 1) * G.og}), {G.col_width(), G.og});
    outs.push_back(reshape(matmul(cols, wg), {G.n, OH, OW, G.og}));
  }
  Array y = outs.size() == 1 ? outs[0] : concatenate(outs, 3);
  return astype(y, x_in.dtype());
}

// The create-graph rule of both engines' conv2d: the composite's vjp. A product is linear in each
// operand, so an operand the forward did not keep (its gradient was not needed) stands in as zeros.
void conv_rule_with_ops(Cotangents& c, const ConvGeometry& G, const Array& x, const Array& w, const Shape& xs, const Shape& ws) {
  autodiff::composite_rule(c, {x.defined() ? x : Array::zeros(xs), w.defined() ? w : Array::zeros(ws)},
                           [G](const std::vector<Array>& in) { return std::vector<Array>{composed_conv(G, in[0], in[1])}; });
}

// The output columns ow whose input column ow * stride - pad + j * dilation lies in [0, w): [lo, hi).
struct ColumnRange {
  std::int64_t lo, hi;
};
ColumnRange valid_columns(const ConvGeometry& G, std::int64_t j) {
  const std::int64_t offset = j * G.dw - G.pw.pad_lo;  // iw = ow * sw + offset
  std::int64_t lo = offset >= 0 ? 0 : (-offset + G.sw - 1) / G.sw;
  std::int64_t hi = G.w - offset <= 0 ? 0 : (G.w - offset + G.sw - 1) / G.sw;
  lo = std::min(lo, G.pw.out);
  hi = std::max(lo, std::min(hi, G.pw.out));
  return {lo, hi};
}

// Columns of images [n0, n0 + count) for group g: [count * OH * OW, KH * KW * Cg]. Work goes by
// output row (n, oh) and kernel tap (i, j), so bounds are settled once per tap, not per element.
void im2col(const float* x, const ConvGeometry& G, std::int64_t n0, std::int64_t count, std::int64_t g, float* cols) {
  const std::int64_t width = G.col_width(), cg = G.cg;
  const std::int64_t rows = count * G.ph.out;
#pragma omp parallel for schedule(static) num_threads(linum::team_size()) if (rows * G.pw.out * width > ops::detail::kParallelMin)
  for (std::int64_t row = 0; row < rows; ++row) {
    linum::detail::enter_compute();
    const std::int64_t n = n0 + row / G.ph.out, oh = row % G.ph.out;
    float* base = cols + row * G.pw.out * width;
    for (std::int64_t i = 0; i < G.kh; ++i) {
      const std::int64_t ih = oh * G.sh - G.ph.pad_lo + i * G.dh;
      for (std::int64_t j = 0; j < G.kw; ++j) {
        float* dst = base + (i * G.kw + j) * cg;
        const ColumnRange cr = (ih < 0 || ih >= G.h) ? ColumnRange{0, 0} : valid_columns(G, j);
        for (std::int64_t ow = 0; ow < cr.lo; ++ow)
          for (std::int64_t k = 0; k < cg; ++k) dst[ow * width + k] = 0.0f;
        for (std::int64_t ow = cr.hi; ow < G.pw.out; ++ow)
          for (std::int64_t k = 0; k < cg; ++k) dst[ow * width + k] = 0.0f;
        if (cr.lo >= cr.hi) continue;
        const float* src = x + ((n * G.h + ih) * G.w + (cr.lo * G.sw + j * G.dw - G.pw.pad_lo)) * G.c + g * cg;
        const std::int64_t src_step = G.sw * G.c;
        for (std::int64_t ow = cr.lo; ow < cr.hi; ++ow, src += src_step)
          for (std::int64_t k = 0; k < cg; ++k) dst[ow * width + k] = src[k];
      }
    }
  }
}

// dx += col2im(dcols) for images [n0, n0 + count), group g. One image per thread, so the
// accumulation is race-free and its order does not depend on the number of threads.
void col2im(const float* dcols, const ConvGeometry& G, std::int64_t n0, std::int64_t count, std::int64_t g, float* dx) {
  const std::int64_t width = G.col_width(), cg = G.cg;
#pragma omp parallel for schedule(static) num_threads(linum::team_size()) if (count > 1 && count * G.rows_per_image() * width > ops::detail::kParallelMin)
  for (std::int64_t ni = 0; ni < count; ++ni) {
    linum::detail::enter_compute();
    const std::int64_t n = n0 + ni;
    for (std::int64_t oh = 0; oh < G.ph.out; ++oh) {
      const float* base = dcols + (ni * G.ph.out + oh) * G.pw.out * width;
      for (std::int64_t i = 0; i < G.kh; ++i) {
        const std::int64_t ih = oh * G.sh - G.ph.pad_lo + i * G.dh;
        if (ih < 0 || ih >= G.h) continue;
        for (std::int64_t j = 0; j < G.kw; ++j) {
          const ColumnRange cr = valid_columns(G, j);
          const float* src = base + (i * G.kw + j) * cg;
          float* d = dx + ((n * G.h + ih) * G.w + (cr.lo * G.sw + j * G.dw - G.pw.pad_lo)) * G.c + g * cg;
          const std::int64_t d_step = G.sw * G.c;
          for (std::int64_t ow = cr.lo; ow < cr.hi; ++ow, d += d_step)
            for (std::int64_t k = 0; k < cg; ++k) d[k] += src[ow * width + k];
        }
      }
    }
  }
}

std::int64_t images_per_chunk(const ConvGeometry& G) {
  return std::max<std::int64_t>(1, std::min<std::int64_t>(G.n, 8192 / std::max<std::int64_t>(1, G.rows_per_image())));
}

// Accounted scratch for a column buffer.
Array scratch(std::int64_t rows, std::int64_t width) { return Array::empty(Shape{rows, width}); }

}  // namespace

namespace {
// vmap with a kernel per example (an ensemble's convolutions, per-example gradients): one grouped
// convolution, each example's channels a group of their own (P examples, G groups: P * G groups).
Array conv2d_batched_kernel(const Array& x, const Array& w, const ConvOptions& opt) {
  if (x.rank() != 4 || w.rank() != 4)
    throw ShapeError(detail::cat("conv2d: needs x as [N, H, W, C] and kernel as [KH, KW, C/groups, O], got ",
                                 ops::detail::shapes_str({&x, &w})));
  const std::vector<BatchLevel> levels = ops::batching::levels_of({&x, &w}, "conv2d");
  std::int64_t p = 1;
  for (const BatchLevel& l : levels) p *= l.size;
  const std::int64_t n = x.dim(0), h = x.dim(1), wd = x.dim(2), c = x.dim(3);
  const std::int64_t kh = w.dim(0), kw = w.dim(1), cg = w.dim(2), o = w.dim(3);
  const Array xs = transpose(reshape(ops::batching::materialized(x, levels), {p, n, h, wd, c}), {1, 2, 3, 0, 4});
  const Array ws = transpose(reshape(ops::batching::materialized(w, levels), {p, kh, kw, cg, o}), {1, 2, 3, 0, 4});
  ConvOptions grouped = opt;
  grouped.feature_group_count = opt.feature_group_count * p;
  const Array y = conv2d(reshape(xs, {n, h, wd, p * c}), reshape(ws, {kh, kw, cg, p * o}), grouped);
  const std::int64_t oh = y.dim(1), ow = y.dim(2);
  Array per = transpose(reshape(y, {n, oh, ow, p, o}), {3, 0, 1, 2, 4});  // [P, N, OH, OW, O]
  std::vector<std::int64_t> dims;
  for (const BatchLevel& l : levels) dims.push_back(l.size);
  for (std::int64_t d : {n, oh, ow, o}) dims.push_back(d);
  return ops::batching::wrap(reshape(per, dims), levels);
}
}  // namespace

Array conv2d(const Array& x, const Array& w, const ConvOptions& opt) {
  ops::detail::require_float(x, "conv2d");
  ops::detail::require_float(w, "conv2d");
  if (w.batched()) [[unlikely]]
    return conv2d_batched_kernel(x, w, opt);
  if (x.batched()) [[unlikely]]  // vmap, one kernel: the levels folded into the images
    return ops::batching::images(x, [&](const Array& p) { return conv2d(p, w, opt); });
  const DType t = promote_types(x.dtype(), x.weak_type(), w.dtype(), w.weak_type());
  const bool onednn = LINUM_HAVE_ONEDNN && engine() == Engine::onednn;
  if (onednn && (x.dtype() != t || w.dtype() != t)) return conv2d(astype(x, t), astype(w, t), opt);
  if (!onednn && t != DType::f32)  // Eigen: the float32 kernel on widened operands, rounded once
    return astype(conv2d(astype(x, DType::f32), astype(w, DType::f32), opt), t);
  if (x.rank() != 4 || w.rank() != 4)
    throw ShapeError(detail::cat("conv2d: needs x as [N, H, W, C] and kernel as [KH, KW, C/groups, O], got ",
                                 ops::detail::shapes_str({&x, &w})));
  const std::int64_t groups = opt.feature_group_count;
  ConvGeometry G{};
  G.n = x.dim(0); G.h = x.dim(1); G.w = x.dim(2); G.c = x.dim(3);
  G.kh = w.dim(0); G.kw = w.dim(1); G.cg = w.dim(2); G.o = w.dim(3);
  G.groups = groups;
  if (groups < 1 || G.c % groups != 0 || G.o % groups != 0 || G.cg * groups != G.c)
    throw ShapeError(detail::cat("conv2d: input ", x.shape(), " and kernel ", w.shape(), " do not match with ",
                                 groups, " feature group(s): need C = kernel's in-features * groups (", G.c, " vs ",
                                 G.cg, " * ", groups, ") and O divisible by groups"));
  G.og = G.o / groups;
  G.sh = opt.strides[0]; G.sw = opt.strides[1];
  G.dh = opt.dilation[0]; G.dw = opt.dilation[1];
  G.ph = detail::plan_axis(G.h, G.kh, G.sh, G.dh, opt.padding, 0, "conv2d");
  G.pw = detail::plan_axis(G.w, G.kw, G.sw, G.dw, opt.padding, 1, "conv2d");

#if LINUM_HAVE_ONEDNN
  if (onednn) {
    const kernels::ConvShape S{G.n, G.h, G.w, G.c, G.kh, G.kw, G.cg, G.o, G.groups, G.ph.out, G.pw.out, G.sh, G.sw,
                               G.dh, G.dw, G.ph.pad_lo, G.ph.pad_hi, G.pw.pad_lo, G.pw.pad_hi, t};
    return autodiff::primitive(ops::kind::conv2d, {&x, &w},
                               [&](autodiff::Residuals& r) {
                                 if (r.recording()) r.keep(w.node() ? x : Array(),   // for dw
                                        x.node() ? w : Array());  // for dx
                                 return kernels::conv_forward_onednn(x, w, S);
                               },
                               autodiff::higher_order([S, G, xs = x.shape(), ws = w.shape()](Cotangents& c, autodiff::Saved s) {
                                 if (autodiff::creating_graph()) return conv_rule_with_ops(c, G, s[0], s[1], xs, ws);
                                 const Array gy = c.take_out(0);
                                 if (c.needs(1)) c.set(1, kernels::conv_backward_weights_onednn(s[0], gy, S));
                                 if (c.needs(0)) c.set(0, kernels::conv_backward_data_onednn(gy, s[1], S));
                               }));
  }
#endif
  return autodiff::primitive(ops::kind::conv2d, {&x, &w}, [&](autodiff::Residuals& r) {
    // x is needed for dw (columns) -- and cheap compared to the columns.
    if (r.recording()) r.keep(x, x.node() ? w : Array());
    profiler::detail::add_flops(kernels::conv_flops(G.n, G.ph.out, G.pw.out, G.o, G.cg, G.kh, G.kw));
    Array y = Array::empty(Shape{G.n, G.ph.out, G.pw.out, G.o});
    const std::int64_t chunk = images_per_chunk(G), R = G.col_width();
    Array cols = scratch(chunk * G.rows_per_image(), R);
    for (std::int64_t n0 = 0; n0 < G.n; n0 += chunk) {
      const std::int64_t count = std::min(chunk, G.n - n0), P = count * G.rows_per_image();
      for (std::int64_t g = 0; g < groups; ++g) {
        im2col(x.data(), G, n0, count, g, cols.mutable_data());
        Eigen::Map<const RowMat> C(cols.data(), P, R);
        Eigen::Map<const RowMat, 0, Strided> W(w.data() + g * G.og, R, G.og, Strided(G.o));
        Eigen::Map<RowMat, 0, Strided> Y(y.mutable_data() + n0 * G.rows_per_image() * G.o + g * G.og, P, G.og,
                                         Strided(G.o));
        kernels::detail::gemm_into(Y, C, W);
      }
    }
    return y;
  }, autodiff::higher_order([G, xs = x.shape(), ws = w.shape()](Cotangents& c, autodiff::Saved s) {
      if (autodiff::creating_graph()) return conv_rule_with_ops(c, G, s[0], s[1], xs, ws);
      const Array& gy = c.out();
      const std::int64_t chunk = images_per_chunk(G), R = G.col_width();
      Array dx = c.needs(0) ? Array::zeros(s[0].shape()) : Array();
      Array dw = c.needs(1) ? Array::zeros(Shape{G.kh, G.kw, G.cg, G.o}) : Array();
      profiler::detail::add_flops((c.needs(0) + c.needs(1)) *
                                  kernels::conv_flops(G.n, G.ph.out, G.pw.out, G.o, G.cg, G.kh, G.kw));
      Array cols = scratch(chunk * G.rows_per_image(), R);
      for (std::int64_t n0 = 0; n0 < G.n; n0 += chunk) {
        const std::int64_t count = std::min(chunk, G.n - n0), P = count * G.rows_per_image();
        for (std::int64_t g = 0; g < G.groups; ++g) {
          Eigen::Map<const RowMat, 0, Strided> GY(gy.data() + n0 * G.rows_per_image() * G.o + g * G.og, P, G.og,
                                                  Strided(G.o));
          if (c.needs(1)) {
            im2col(s[0].data(), G, n0, count, g, cols.mutable_data());
            Eigen::Map<const RowMat> C(cols.data(), P, R);
            Eigen::Map<RowMat, 0, Strided> DW(dw.mutable_data() + g * G.og, R, G.og, Strided(G.o));
            kernels::detail::gemm_into(DW, C.transpose(), GY, /*accumulate=*/true);
          }
          if (c.needs(0)) {
            Eigen::Map<const RowMat, 0, Strided> W(s[1].data() + g * G.og, R, G.og, Strided(G.o));
            Eigen::Map<RowMat> DC(cols.mutable_data(), P, R);
            kernels::detail::gemm_into(DC, GY, W.transpose());
            col2im(cols.data(), G, n0, count, g, dx.mutable_data());
          }
        }
      }
      if (c.needs(0)) c.set(0, dx);
      if (c.needs(1)) c.set(1, dw);
  }));
}

namespace {

using Pads = std::array<std::pair<std::int64_t, std::int64_t>, 2>;

// lax.conv_transpose as its definition: the input dilated by the strides, padded, convolved with
// stride 1 (kernel [KH, KW, C, O]). The multiplies by the dilation's zeros are stride^2 of the work.
Array conv_transpose_by_dilation(const Array& x, const Array& kernel, const Pads& pads, const ConvTransposeOptions& o) {
  const Array dilated = o.strides[0] == 1 && o.strides[1] == 1 ? x : dilate(x, {1, o.strides[0], o.strides[1], 1});
  ConvOptions conv;
  conv.strides = {1, 1};
  conv.padding = Padding::explicit_pads(pads[0].first, pads[0].second, pads[1].first, pads[1].second);
  conv.dilation = o.dilation;
  return conv2d(dilated, kernel, conv);
}

#if LINUM_HAVE_ONEDNN
// The same on oneDNN, as what it is: the data gradient of the strided convolution it transposes,
// which runs oneDNN's backward-data kernel (no zeros multiplied). That convolution, G, maps y
// [N, OH, OW, O] to x [N, H, W, C] with the kernel flipped and its channel axes swapped, the same
// strides and dilation, and padding k - 1 - pad on each side; its weight gradient and its forward
// pass are this op's gradients. Nullopt when no such convolution exists for the padding (a low
// pad beyond the dilated kernel, or a high one cutting rows G would read): the dilated path runs.
std::optional<Array> conv_transpose_as_gradient(const Array& x_in, const Array& kernel_in, const Pads& pads,
                                                const ConvTransposeOptions& o) {
  if (x_in.rank() != 4 || kernel_in.rank() != 4 || x_in.numel() == 0 || kernel_in.numel() == 0) return std::nullopt;
  std::int64_t out[2], pad_lo[2], pad_hi[2], eff[2];
  for (int a = 0; a < 2; ++a) {
    const auto i = static_cast<std::size_t>(a);
    const std::int64_t in = x_in.dim(1 + a), s = o.strides[i];
    if (kernel_in.dim(a) > (std::int64_t{1} << 30) || o.dilation[i] > (std::int64_t{1} << 30) || s > (std::int64_t{1} << 30) ||
        in > (std::int64_t{1} << 30) || pads[i].first > (std::int64_t{1} << 30) || pads[i].second > (std::int64_t{1} << 30))
      return std::nullopt;  // sizes the dilated path checks with its overflow-safe planner
    eff[a] = (kernel_in.dim(a) - 1) * o.dilation[i] + 1;
    out[a] = (in - 1) * s + 1 + pads[i].first + pads[i].second - eff[a] + 1;
    pad_lo[a] = eff[a] - 1 - pads[i].first;
    pad_hi[a] = eff[a] - 1 - pads[i].second;
    if (out[a] < 1 || pad_lo[a] < 0 || -pad_hi[a] >= s) return std::nullopt;
    pad_hi[a] = std::max<std::int64_t>(pad_hi[a], 0);  // rows G would not read anyway: y is 0 there
    if ((out[a] + pad_lo[a] + pad_hi[a] - eff[a]) / s + 1 != in) return std::nullopt;
  }
  const DType t = promote_types(x_in.dtype(), x_in.weak_type(), kernel_in.dtype(), kernel_in.weak_type());
  const Array x = x_in.dtype() == t ? x_in : astype(x_in, t);
  const Array kernel = kernel_in.dtype() == t ? kernel_in : astype(kernel_in, t);
  // G's kernel [KH, KW, O, C] (differentiable ops: the gradient reaches the caller's kernel).
  const Array wg = transpose(flip(kernel, {0, 1}), {0, 1, 3, 2});
  const std::int64_t N = x.dim(0), H = x.dim(1), W = x.dim(2), C = x.dim(3), O = kernel.dim(3);
  const kernels::ConvShape S{N, out[0], out[1], O, kernel.dim(0), kernel.dim(1), O, C, 1, H, W, o.strides[0], o.strides[1],
                             o.dilation[0], o.dilation[1], pad_lo[0], pad_hi[0], pad_lo[1], pad_hi[1], t};
  return autodiff::primitive(
      ops::kind::conv_transpose2d, {&x, &wg},
      [&](autodiff::Residuals& r) {
        if (r.recording()) r.keep(wg.node() ? x : Array(), x.node() ? wg : Array());
        return kernels::conv_backward_data_onednn(x, wg, S);
      },
      autodiff::higher_order([S, pads, o, xs = x.shape(), ws = wg.shape()](Cotangents& c, autodiff::Saved s) {
        if (autodiff::creating_graph()) {
          // The dilated form written with ops; G's kernel flipped and swapped back is the kernel.
          const Array xv = s[0].defined() ? s[0] : Array::zeros(xs, S.dtype);
          const Array wv = s[1].defined() ? s[1] : Array::zeros(ws, S.dtype);
          return autodiff::composite_rule(c, {xv, wv}, [pads, o](const std::vector<Array>& in) {
            return std::vector<Array>{conv_transpose_by_dilation(in[0], transpose(flip(in[1], {0, 1}), {0, 1, 3, 2}), pads, o)};
          });
        }
        const Array gy = c.take_out(0);
        if (c.needs(1)) c.set(1, kernels::conv_backward_weights_onednn(gy, s[0], S));
        if (c.needs(0)) c.set(0, kernels::conv_forward_onednn(gy, s[1], S));
      }));
}
#endif

}  // namespace

Array conv_transpose2d(const Array& x, const Array& w, const ConvTransposeOptions& o) {
  ops::detail::require_float(x, "conv_transpose2d");
  ops::detail::require_float(w, "conv_transpose2d");
  if (x.rank() != 4 || w.rank() != 4)
    throw ShapeError(detail::cat("conv_transpose2d: needs x [N, H, W, C] and w [KH, KW, C, O], got x ", x.shape(), " and w ",
                                 w.shape()));
  for (int a = 0; a < 2; ++a)
    if (o.strides[static_cast<std::size_t>(a)] < 1 || o.dilation[static_cast<std::size_t>(a)] < 1)
      throw ShapeError(detail::cat("conv_transpose2d: strides and dilation must be >= 1, got strides (", o.strides[0], ", ",
                                   o.strides[1], ") and dilation (", o.dilation[0], ", ", o.dilation[1], ")"));
  Array kernel = w;
  if (o.transpose_kernel) kernel = transpose(flip(w, {0, 1}), {0, 1, 3, 2});
  if (kernel.dim(2) != x.dim(3))
    throw ShapeError(detail::cat("conv_transpose2d: the kernel ", w.shape(), o.transpose_kernel ? " (transposed)" : "",
                                 " takes ", kernel.dim(2), " input channels but x ", x.shape(), " has ", x.dim(3)));
  // lax's padding of the dilated input, per spatial axis, for the dilated kernel size k.
  Pads pads{};
  for (int a = 0; a < 2; ++a) {
    const auto i = static_cast<std::size_t>(a);
    const std::int64_t k = (kernel.dim(a) - 1) * o.dilation[i] + 1, s = o.strides[i];
    switch (o.padding.kind) {
      case Padding::Kind::same: {
        const std::int64_t len = k + s - 2;
        const std::int64_t lo = s > k - 1 ? k - 1 : (len + 1) / 2;
        pads[i] = {lo, len - lo};
        break;
      }
      case Padding::Kind::valid: {
        const std::int64_t len = k + s - 2 + std::max<std::int64_t>(k - s, 0);
        pads[i] = {k - 1, len - (k - 1)};
        break;
      }
      case Padding::Kind::explicit_pairs:
        o.padding.check("conv_transpose2d", 2, false);
        pads[i] = o.padding.pair(a);
        break;
      case Padding::Kind::causal:
        o.padding.check("conv_transpose2d", 2, false);  // throws
        break;
    }
  }
#if LINUM_HAVE_ONEDNN
  if (engine() == Engine::onednn && !x.batched() && !kernel.batched()) {
    try {
      if (std::optional<Array> y = conv_transpose_as_gradient(x, kernel, pads, o)) return std::move(*y);
    } catch (const ShapeError&) {
      // oneDNN refused the transposed convolution's geometry (its dimension limits): the dilated
      // form, whose own convolution names the problem if oneDNN refuses that too.
    }
  }
#endif
  return conv_transpose_by_dilation(x, kernel, pads, o);
}

}  // namespace linum
