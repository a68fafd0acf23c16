#include <linum/core/ops/recurrent.hpp>

#include <linum/core/autodiff/primitive.hpp>
#include <linum/core/ops/batching.hpp>
#include <linum/core/dtype.hpp>
#include <linum/core/error.hpp>
#include <linum/core/kernels/gru.hpp>
#include <linum/core/kernels/lstm.hpp>
#include <linum/core/ops/elementwise.hpp>
#include <linum/core/ops/linalg.hpp>
#include <linum/core/ops/kernel_util.hpp>
#include <linum/core/ops/kind.hpp>
#include <linum/core/ops/shape_ops.hpp>
#include <linum/core/threading.hpp>


#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

namespace linum {

namespace {

using autodiff::Cotangents;
namespace lk = kernels::lstm;

constexpr std::int64_t kRowsPerBlock = 16;

// Elements [start, start + n) of a float array into dst as float32.
void load_row(const Array& a, std::int64_t start, std::int64_t n, float* dst) {
  if (a.dtype() == DType::f32)
    std::memcpy(dst, static_cast<const float*>(a.raw()) + start, static_cast<std::size_t>(n) * sizeof(float));
  else
    bf16_to_f32(static_cast<const bfloat16*>(a.raw()) + start, dst, n);
}

void store_row(Array& out, std::int64_t start, std::int64_t n, const float* src) {
  if (out.dtype() == DType::f32)
    std::memcpy(static_cast<float*>(out.mutable_raw()) + start, src, static_cast<std::size_t>(n) * sizeof(float));
  else
    f32_to_bf16(src, static_cast<bfloat16*>(out.mutable_raw()) + start, n);
}

struct Geometry {
  std::int64_t rows = 0, hidden = 0;
};

// Runs f(row, scratch) for every row, row blocks in parallel for large inputs; scratch holds
// `floats` floats per thread, 64-byte aligned. The row's computation (the layer kernel's cell row)
// does not depend on where the row sits: a row gives the same bits in a batch of any size, and an
// example under vmap the same bits as in the batch.
template <class F>
void for_rows(const Geometry& g, std::int64_t floats, F&& f) {
  const std::int64_t blocks = (g.rows + kRowsPerBlock - 1) / kRowsPerBlock;
  [[maybe_unused]] const bool parallel = g.rows * 4 * g.hidden >= ops::detail::kParallelMin && blocks > 1;
#pragma omp parallel if (parallel) num_threads(linum::team_size())
  {
    linum::detail::enter_compute();
    ops::detail::AlignedScratch scratch(floats);
#pragma omp for schedule(static)
    for (std::int64_t b = 0; b < blocks; ++b)
      for (std::int64_t r = b * kRowsPerBlock; r < std::min(g.rows, (b + 1) * kRowsPerBlock); ++r) f(r, scratch.data());
  }
}

// Row r's cell, forward, in scratch: z = x_gates + h_gates [4h] (replaced by the activations),
// c's row, c_next's, h_next's, the cotangents' rows; the cell kernel's own scratch first (aligned).
struct RowScratch {
  float *z, *c, *c_next, *h_next, *dh, *dc, *dz, *kernel;
  RowScratch(float* s, std::int64_t h)
      : z(s + lk::cell_scratch_floats(h)), c(z + 4 * h), c_next(c + h), h_next(c_next + h), dh(h_next + h), dc(dh + h),
        dz(dc + h), kernel(s) {}
  static std::int64_t floats(std::int64_t h) { return lk::cell_scratch_floats(h) + 13 * h; }
};

void cell_forward(const Geometry& g, const Array& xg, const Array& hg, const Array& c, std::int64_t r, RowScratch& rs,
                  bool write_h) {
  const std::int64_t h = g.hidden;
  load_row(xg, r * 4 * h, 4 * h, rs.z);
  load_row(hg, r * 4 * h, 4 * h, rs.dz);  // dz as a temporary
  for (std::int64_t j = 0; j < 4 * h; ++j) rs.z[j] += rs.dz[j];
  load_row(c, r * h, h, rs.c);
  lk::cell_row(rs.z, h, rs.c, rs.c_next, write_h ? rs.h_next : nullptr, rs.kernel);
}

Geometry geometry_of(const Array& xg, const Array& hg, const Array& c) {
  auto fail = [&](const std::string& why) -> Geometry {
    throw ShapeError("lstm_cell: " + why + "; got x_gates " + xg.type_str() + ", h_gates " + hg.type_str() + ", c " +
                     c.type_str() + " (x_gates and h_gates [..., 4 * hidden], c [..., hidden])");
  };
  for (const Array* a : {&xg, &hg, &c}) {
    if (!a->defined()) fail("an input is undefined");
    if (!is_floating(a->dtype()) || (a->dtype() != DType::f32 && a->dtype() != DType::bf16))
      fail("inputs must be float32 or bfloat16");
    if (a->rank() < 1) fail("inputs need a feature axis");
  }
  if (!(xg.shape() == hg.shape())) fail("x_gates and h_gates must have the same shape");
  const std::int64_t four_h = xg.dim(-1);
  if (four_h % 4 != 0 || four_h == 0) fail("the gates' last axis must be 4 * hidden, hidden > 0");
  const std::int64_t h = four_h / 4;
  Shape want = xg.shape();
  want[want.rank() - 1] = h;
  if (!(c.shape() == want)) fail("c must be the gates' shape with hidden = " + std::to_string(h) + " features");
  return {c.numel() / h, h};
}

void forward(const Geometry& g, const Array& xg, const Array& hg, const Array& c, Array& c_next, Array& h_next) {
  const std::int64_t h = g.hidden;
  for_rows(g, RowScratch::floats(h), [&](std::int64_t r, float* s) {
    RowScratch rs(s, h);
    cell_forward(g, xg, hg, c, r, rs, true);
    store_row(c_next, r * h, h, rs.c_next);
    store_row(h_next, r * h, h, rs.h_next);
  });
}

// Gradients of z (the gates, for both products) and c from those of c_next and h_next (either may
// be undefined: no gradient reached it). The forward is computed again for the activations.
void backward(const Geometry& g, const Array& xg, const Array& hg, const Array& c, const Array& d_c_next,
              const Array& d_h_next, Array& dz, Array& dc) {
  const std::int64_t h = g.hidden;
  for_rows(g, RowScratch::floats(h), [&](std::int64_t r, float* s) {
    RowScratch rs(s, h);
    cell_forward(g, xg, hg, c, r, rs, false);
    if (d_h_next.defined()) load_row(d_h_next, r * h, h, rs.dh);
    else std::fill(rs.dh, rs.dh + h, 0.0f);
    if (d_c_next.defined()) load_row(d_c_next, r * h, h, rs.dc);
    else std::fill(rs.dc, rs.dc + h, 0.0f);
    lk::cell_row_backward(rs.z, h, rs.c, rs.c_next, rs.dh, rs.dc, rs.dz, rs.kernel);
    store_row(dz, r * 4 * h, 4 * h, rs.dz);
    store_row(dc, r * h, h, rs.dc);
  });
}

// The same cell written with differentiable ops (create-graph mode differentiates it).
std::vector<Array> composed(std::int64_t h, const std::vector<Array>& in) {
  const Array z = in[0] + in[1];
  auto gate = [&](int k) { return slice_axis(z, -1, k * h, (k + 1) * h); };
  const Array i = sigmoid(gate(0)), f = sigmoid(gate(1)), g = tanh(gate(2)), o = sigmoid(gate(3));
  Array c_next = f * in[2] + i * g;
  Array h_next = o * tanh(c_next);
  return {std::move(c_next), std::move(h_next)};
}

}  // namespace

std::pair<Array, Array> lstm_cell(const Array& x_gates, const Array& h_gates, const Array& c) {
  if (x_gates.batched() || h_gates.batched() || c.batched()) [[unlikely]] {
    // vmap: rows are independent, so the levels become leading axes of all three inputs.
    const std::vector<BatchLevel> levels = ops::batching::levels_of({&x_gates, &h_gates, &c}, "lstm_cell");
    auto [c_next, h_next] = lstm_cell(ops::batching::materialized(x_gates, levels),
                                      ops::batching::materialized(h_gates, levels), ops::batching::materialized(c, levels));
    return {ops::batching::wrap(c_next, levels), ops::batching::wrap(h_next, levels)};
  }
  const Geometry g = geometry_of(x_gates, h_gates, c);
  const DType dt = promote_types(promote_types(x_gates.dtype(), h_gates.dtype()), c.dtype());
  const Array* const ins[] = {&x_gates, &h_gates, &c};
  std::vector<Array> out = autodiff::primitive_multi(
      "lstm_cell", std::span<const Array* const>(ins),
      [&](autodiff::Residuals& r) {
        Array c_next = Array::empty(c.shape(), dt), h_next = Array::empty(c.shape(), dt);
        forward(g, x_gates, h_gates, c, c_next, h_next);
        r.keep(x_gates, h_gates, c);
        return std::vector<Array>{std::move(c_next), std::move(h_next)};
      },
      autodiff::higher_order([g, dt](Cotangents& cot, autodiff::Saved s) {
        if (autodiff::creating_graph())
          return autodiff::composite_rule(cot, {s[0], s[1], s[2]},
                                          [h = g.hidden](const std::vector<Array>& in) { return composed(h, in); });
        Array dz = Array::empty(s[0].shape(), dt), dc = Array::empty(s[2].shape(), dt);
        backward(g, s[0], s[1], s[2], cot.out(0), cot.out(1), dz, dc);
        if (cot.needs(2)) cot.set(2, std::move(dc));
        if (cot.needs(1)) cot.set(1, dz);
        if (cot.needs(0)) cot.set(0, std::move(dz));
      }));
  return {std::move(out[0]), std::move(out[1])};
}

namespace {

static_assert(kLSTMLayerChunk == lk::kChunk);

struct LayerShape {
  lk::Dims d;
};

LayerShape layer_shape(const Array& x, const Array& wi, const Array& b, const Array& wh, const Array& c0, const Array& h0) {
  auto fail = [&](const std::string& why) -> LayerShape {
    throw ShapeError("lstm_layer: " + why + "; got x " + x.type_str() + ", input_kernel " + wi.type_str() + ", bias " +
                     b.type_str() + ", recurrent_kernel " + wh.type_str() + ", c0 " + c0.type_str() + ", h0 " + h0.type_str() +
                     " (x [time, batch, in], input_kernel [in, 4 * hidden], bias [4 * hidden], recurrent_kernel "
                     "[hidden, 4 * hidden], c0 and h0 [batch, hidden])");
  };
  for (const Array* a : {&x, &wi, &b, &wh, &c0, &h0}) {
    if (!a->defined()) fail("an argument is undefined");
    if (a->dtype() != DType::f32 && a->dtype() != DType::bf16) fail("arguments must be float32 or bfloat16");
  }
  if (x.rank() != 3 || wi.rank() != 2 || b.rank() != 1 || wh.rank() != 2 || c0.rank() != 2 || h0.rank() != 2)
    fail("wrong ranks");
  const std::int64_t T = x.dim(0), N = x.dim(1), I = x.dim(2), H = wh.dim(0);
  if (H == 0 || wh.dim(1) != 4 * H) fail("recurrent_kernel must be [hidden, 4 * hidden] with hidden > 0");
  if (wi.dim(0) != I || wi.dim(1) != 4 * H) fail("input_kernel must be [in, 4 * hidden]");
  if (b.dim(0) != 4 * H) fail("bias must be [4 * hidden]");
  if (!(c0.shape() == Shape{N, H}) || !(h0.shape() == Shape{N, H})) fail("c0 and h0 must be [batch, hidden]");
  return {{T, N, I, H}};
}

// A float32 [rows, gates * H] matrix (a kernel, a bias, their gradients) from gate order into a
// layer kernel's block layout (to_blocks), or back.
Array blocked(const Array& w, const kernels::recurrent::UnitBlocks& bl, bool to_blocks) {
  Array out = Array::empty(w.shape());
  const std::int64_t rows = w.numel() / (bl.gates * bl.hidden);
  if (to_blocks) bl.interleave(w.data(), out.mutable_data(), rows);
  else bl.deinterleave(w.data(), out.mutable_data(), rows);
  return out;
}

// vmap of a layer op: the layer once per example (each example may have its own weights), results
// stacked. `example_shapes`: one example's results (for a batch level of size 0).
template <class Layer>
std::vector<Array> per_example(const char* op, std::initializer_list<const Array*> inputs, const std::vector<Shape>& example_shapes,
                               Layer layer) {
  const std::vector<BatchLevel> levels = ops::batching::levels_of(inputs, op);
  std::int64_t examples = 1;
  std::vector<std::int64_t> level_dims;
  for (const BatchLevel& l : levels) {
    examples *= l.size;
    level_dims.push_back(l.size);
  }
  auto wrap = [&](const Array& stacked, const Shape& example) {
    std::vector<std::int64_t> dims = level_dims;
    for (std::int64_t v : example.vec()) dims.push_back(v);
    return ops::batching::wrap(reshape(stacked, dims), levels);
  };
  std::vector<Array> out;
  if (examples == 0) {  // a level of size 0: empty results of the right shapes
    for (const Shape& s : example_shapes) {
      std::vector<std::int64_t> dims = level_dims;
      for (std::int64_t v : s.vec()) dims.push_back(v);
      out.push_back(wrap(Array::zeros(Shape(dims)), s));
    }
    return out;
  }
  std::vector<Array> flat;
  for (const Array* a : inputs) {
    std::vector<std::int64_t> dims{examples};
    for (std::int64_t v : a->shape().vec()) dims.push_back(v);
    flat.push_back(reshape(ops::batching::materialized(*a, levels), dims));
  }
  std::vector<std::vector<Array>> results(example_shapes.size());
  for (std::int64_t e = 0; e < examples; ++e) {
    std::vector<Array> one;
    for (const Array& f : flat) {
      const std::vector<std::int64_t> dims = f.shape().vec();
      one.push_back(reshape(slice_axis(f, 0, e, e + 1), std::vector<std::int64_t>(dims.begin() + 1, dims.end())));
    }
    const std::vector<Array> r = layer(one);
    for (std::size_t k = 0; k < r.size(); ++k) results[k].push_back(r[k]);
  }
  for (std::size_t k = 0; k < results.size(); ++k) out.push_back(wrap(stack(results[k]), results[k][0].shape()));
  return out;
}

// The layer written with ops (create-graph mode differentiates it).
std::vector<Array> composed_layer(const std::vector<Array>& in) {
  const Array &x = in[0], &wi = in[1], &b = in[2], &wh = in[3];
  Array c = in[4], h = in[5];
  std::vector<Array> ys;
  for (std::int64_t t = 0; t < x.dim(0); ++t) {
    const Array xt = reshape(slice_axis(x, 0, t, t + 1), {x.dim(1), x.dim(2)});
    auto [cn, hn] = lstm_cell(matmul(xt, wi) + b, matmul(h, wh), c);
    c = cn;
    h = hn;
    ys.push_back(hn);
  }
  Array y = ys.empty() ? Array::zeros(Shape{0, x.dim(1), wh.dim(0)}) : stack(ys);
  return {y, c, h};
}

}  // namespace

std::tuple<Array, Array, Array> lstm_layer(const Array& x, const Array& wi, const Array& b, const Array& wh, const Array& c0,
                                           const Array& h0, const LSTMLayerOptions& options) {
  const LayerShape shape = layer_shape(x, wi, b, wh, c0, h0);
  const lk::Dims d = shape.d;
  if (options.recompute_segment < 0)
    throw ValueError("lstm_layer: recompute_segment must be >= 0 (0 keeps every step), got " +
                     std::to_string(options.recompute_segment));
  if (x.batched() || wi.batched() || b.batched() || wh.batched() || c0.batched() || h0.batched()) [[unlikely]] {
    const std::vector<Array> out = per_example(
        "lstm_layer", {&x, &wi, &b, &wh, &c0, &h0}, {Shape{d.steps, d.rows, d.hidden}, Shape{d.rows, d.hidden}, Shape{d.rows, d.hidden}},
        [&](const std::vector<Array>& a) {
          auto [y, c, h] = lstm_layer(a[0], a[1], a[2], a[3], a[4], a[5], options);
          return std::vector<Array>{y, c, h};
        });
    return {out[0], out[1], out[2]};
  }
  const DType dt = promote_types(promote_types(promote_types(x.dtype(), wi.dtype()), promote_types(b.dtype(), wh.dtype())),
                                 promote_types(c0.dtype(), h0.dtype()));
  if (dt != DType::f32 || x.dtype() != DType::f32 || wi.dtype() != DType::f32 || b.dtype() != DType::f32 ||
      wh.dtype() != DType::f32 || c0.dtype() != DType::f32 || h0.dtype() != DType::f32) {
    auto f32 = [](const Array& a) { return a.dtype() == DType::f32 ? a : astype(a, DType::f32); };
    auto [y, c, h] = lstm_layer(f32(x), f32(wi), f32(b), f32(wh), f32(c0), f32(h0), options);
    return {astype(y, dt), astype(c, dt), astype(h, dt)};
  }
  const std::int64_t segment =
      options.recompute_segment == 0 ? 0 : (options.recompute_segment + lk::kChunk - 1) / lk::kChunk * lk::kChunk;
  const Array* const ins[] = {&x, &wi, &b, &wh, &c0, &h0};
  std::vector<Array> out = autodiff::primitive_multi(
      ops::kind::lstm_layer, std::span<const Array* const>(ins),
      [&](autodiff::Residuals& r) {
        const auto bl = lk::blocks_of(d.hidden);
        const Array wi_i = blocked(wi, bl, true), wh_i = blocked(wh, bl, true), b_i = blocked(b, bl, true);
        Array ys = Array::empty(Shape{d.steps, d.rows, d.hidden});
        Array c_last = Array::empty(Shape{d.rows, d.hidden});
        // What the backward pass reads: every step's activations and cell states, or the cell state
        // at each segment's start (not recording: one segment, nothing kept).
        const std::int64_t seg = r.recording() ? segment : (d.steps + lk::kChunk - 1) / lk::kChunk * lk::kChunk;
        const bool keep_all = seg == 0;
        Array acts = keep_all ? Array::empty(Shape{d.steps, d.rows, 4 * d.hidden}) : Array();
        Array cs = keep_all ? Array::empty(Shape{d.steps, d.rows, d.hidden})
                            : Array::empty(Shape{std::max<std::int64_t>(1, (d.steps + seg - 1) / seg), d.rows, d.hidden});
        lk::forward({d, x.data(), wi_i.data(), wh_i.data(), b_i.data(), c0.data(), h0.data(), ys.mutable_data(),
                     keep_all ? acts.mutable_data() : nullptr, cs.mutable_data(), seg, c_last.mutable_data()});
        Array h_last = Array::empty(Shape{d.rows, d.hidden});
        std::memcpy(h_last.mutable_data(), d.steps == 0 ? h0.data() : ys.data() + (d.steps - 1) * d.rows * d.hidden,
                    static_cast<std::size_t>(d.rows * d.hidden) * sizeof(float));
        r.keep(x, wi, b, wh, c0, h0, wi_i, wh_i, b_i, ys, acts, cs);
        return std::vector<Array>{std::move(ys), std::move(c_last), std::move(h_last)};
      },
      autodiff::higher_order([d, segment](Cotangents& cot, autodiff::Saved s) {
        if (autodiff::creating_graph())
          return autodiff::composite_rule(cot, {s[0], s[1], s[2], s[3], s[4], s[5]}, composed_layer);
        const Array &x = s[0], &c0 = s[4], &h0 = s[5], &wi_i = s[6], &wh_i = s[7], &b_i = s[8], &ys = s[9], &acts = s[10],
                    &cs = s[11];
        auto f32_or_null = [](const Array& a) -> const float* {
          if (!a.defined()) return nullptr;
          return a.data();
        };
        const Array d_ys = cot.out(0).defined() ? linum::detail::convert_float(cot.out(0), DType::f32) : Array();
        const Array d_c = cot.out(1).defined() ? linum::detail::convert_float(cot.out(1), DType::f32) : Array();
        const Array d_h = cot.out(2).defined() ? linum::detail::convert_float(cot.out(2), DType::f32) : Array();
        Array dx = cot.needs(0) ? Array::empty(x.shape()) : Array();
        Array dwi = cot.needs(1) ? Array::empty(wi_i.shape()) : Array();
        Array db = cot.needs(2) ? Array::empty(b_i.shape()) : Array();
        Array dwh = cot.needs(3) ? Array::empty(wh_i.shape()) : Array();
        Array dc0 = cot.needs(4) ? Array::empty(c0.shape()) : Array();
        Array dh0 = cot.needs(5) ? Array::empty(h0.shape()) : Array();
        auto out_ptr = [](Array& a) -> float* { return a.defined() ? a.mutable_data() : nullptr; };
        const bool keep_all = acts.defined();
        lk::backward({{d, x.data(), wi_i.data(), wh_i.data(), b_i.data(), c0.data(), h0.data(), const_cast<float*>(ys.data()),
                       keep_all ? const_cast<float*>(acts.data()) : nullptr, const_cast<float*>(cs.data()),
                       keep_all ? 0 : segment, nullptr},
                      f32_or_null(d_ys), f32_or_null(d_c), f32_or_null(d_h), out_ptr(dx), out_ptr(dwi), out_ptr(dwh),
                      out_ptr(db), out_ptr(dc0), out_ptr(dh0)});
        if (cot.needs(0)) cot.set(0, std::move(dx));
        if (cot.needs(1)) cot.set(1, blocked(dwi, lk::blocks_of(d.hidden), false));
        if (cot.needs(2)) cot.set(2, blocked(db, lk::blocks_of(d.hidden), false));
        if (cot.needs(3)) cot.set(3, blocked(dwh, lk::blocks_of(d.hidden), false));
        if (cot.needs(4)) cot.set(4, std::move(dc0));
        if (cot.needs(5)) cot.set(5, std::move(dh0));
      }));
  return {std::move(out[0]), std::move(out[1]), std::move(out[2])};
}

namespace {

namespace gk = kernels::gru;

lk::Dims gru_shape(const Array& x, const Array& wi, const Array& bi, const Array& wh, const Array& bh, const Array& h0) {
  auto fail = [&](const std::string& why) -> lk::Dims {
    throw ShapeError("gru_layer: " + why + "; got x " + x.type_str() + ", input_kernel " + wi.type_str() + ", input_bias " +
                     bi.type_str() + ", recurrent_kernel " + wh.type_str() + ", recurrent_bias " + bh.type_str() + ", h0 " +
                     h0.type_str() +
                     " (x [time, batch, in], input_kernel [in, 3 * hidden], recurrent_kernel [hidden, 3 * hidden], "
                     "input_bias and recurrent_bias [3 * hidden], h0 [batch, hidden])");
  };
  for (const Array* a : {&x, &wi, &bi, &wh, &bh, &h0}) {
    if (!a->defined()) fail("an argument is undefined");
    if (a->dtype() != DType::f32 && a->dtype() != DType::bf16) fail("arguments must be float32 or bfloat16");
  }
  if (x.rank() != 3 || wi.rank() != 2 || bi.rank() != 1 || wh.rank() != 2 || bh.rank() != 1 || h0.rank() != 2)
    fail("wrong ranks");
  const std::int64_t T = x.dim(0), N = x.dim(1), I = x.dim(2), H = wh.dim(0);
  if (H == 0 || wh.dim(1) != 3 * H) fail("recurrent_kernel must be [hidden, 3 * hidden] with hidden > 0");
  if (wi.dim(0) != I || wi.dim(1) != 3 * H) fail("input_kernel must be [in, 3 * hidden]");
  if (bi.dim(0) != 3 * H || bh.dim(0) != 3 * H) fail("input_bias and recurrent_bias must be [3 * hidden]");
  if (!(h0.shape() == Shape{N, H})) fail("h0 must be [batch, hidden]");
  return {T, N, I, H};
}

// The GRU layer written with ops (create-graph mode differentiates it), in Flax's GRUCell's form.
std::vector<Array> composed_gru(const std::vector<Array>& in) {
  const Array &x = in[0], &wi = in[1], &bi = in[2], &wh = in[3], &bh = in[4];
  const std::int64_t H = wh.dim(0);
  Array h = in[5];
  auto gate = [&](const Array& a, int k) { return slice_axis(a, -1, k * H, (k + 1) * H); };
  std::vector<Array> ys;
  for (std::int64_t t = 0; t < x.dim(0); ++t) {
    const Array xg = matmul(reshape(slice_axis(x, 0, t, t + 1), {x.dim(1), x.dim(2)}), wi) + bi;
    const Array hg = matmul(h, wh) + bh;
    const Array r = sigmoid(gate(xg, 0) + gate(hg, 0)), z = sigmoid(gate(xg, 1) + gate(hg, 1));
    const Array n = tanh(gate(xg, 2) + r * gate(hg, 2));
    h = (1.0f - z) * n + z * h;
    ys.push_back(h);
  }
  Array y = ys.empty() ? Array::zeros(Shape{0, x.dim(1), H}) : stack(ys);
  return {y, h};
}

}  // namespace

std::pair<Array, Array> gru_layer(const Array& x, const Array& wi, const Array& bi, const Array& wh, const Array& bh,
                                  const Array& h0, const GRULayerOptions& options) {
  const lk::Dims d = gru_shape(x, wi, bi, wh, bh, h0);
  if (x.batched() || wi.batched() || bi.batched() || wh.batched() || bh.batched() || h0.batched()) [[unlikely]] {
    const std::vector<Array> out =
        per_example("gru_layer", {&x, &wi, &bi, &wh, &bh, &h0}, {Shape{d.steps, d.rows, d.hidden}, Shape{d.rows, d.hidden}},
                    [&](const std::vector<Array>& a) {
                      auto [y, h] = gru_layer(a[0], a[1], a[2], a[3], a[4], a[5], options);
                      return std::vector<Array>{y, h};
                    });
    return {out[0], out[1]};
  }
  bool all_f32 = true;
  for (const Array* a : {&x, &wi, &bi, &wh, &bh, &h0}) all_f32 = all_f32 && a->dtype() == DType::f32;
  const DType dt = promote_types(promote_types(promote_types(x.dtype(), wi.dtype()), promote_types(bi.dtype(), wh.dtype())),
                     promote_types(bh.dtype(), h0.dtype()));
  if (!all_f32) {
    auto f32 = [](const Array& a) { return a.dtype() == DType::f32 ? a : astype(a, DType::f32); };
    auto [y, h] = gru_layer(f32(x), f32(wi), f32(bi), f32(wh), f32(bh), f32(h0), options);
    return {astype(y, dt), astype(h, dt)};
  }
  const Array* const ins[] = {&x, &wi, &bi, &wh, &bh, &h0};
  const bool recompute = options.recompute;
  std::vector<Array> out = autodiff::primitive_multi(
      ops::kind::gru_layer, std::span<const Array* const>(ins),
      [&](autodiff::Residuals& r) {
        const auto bl = gk::blocks_of(d.hidden);
        const Array wi_b = blocked(wi, bl, true), wh_b = blocked(wh, bl, true);
        const Array bi_b = blocked(bi, bl, true), bh_b = blocked(bh, bl, true);
        Array ys = Array::empty(Shape{d.steps, d.rows, d.hidden});
        // What the backward pass reads besides ys: every step's gates, or nothing (recompute, or not
        // recording).
        const bool keep = r.recording() && !recompute;
        Array acts = keep ? Array::empty(Shape{d.steps, d.rows, gk::kGates * d.hidden}) : Array();
        Array hgn = keep ? Array::empty(Shape{d.steps, d.rows, d.hidden}) : Array();
        gk::forward({d, x.data(), wi_b.data(), wh_b.data(), bi_b.data(), bh_b.data(), h0.data(), ys.mutable_data(),
                     keep ? acts.mutable_data() : nullptr, keep ? hgn.mutable_data() : nullptr});
        Array h_last = Array::empty(Shape{d.rows, d.hidden});
        std::memcpy(h_last.mutable_data(), d.steps == 0 ? h0.data() : ys.data() + (d.steps - 1) * d.rows * d.hidden,
                    static_cast<std::size_t>(d.rows * d.hidden) * sizeof(float));
        r.keep(x, wi, bi, wh, bh, h0, wi_b, wh_b, bi_b, bh_b, ys, acts, hgn);
        return std::vector<Array>{std::move(ys), std::move(h_last)};
      },
      autodiff::higher_order([d](Cotangents& cot, autodiff::Saved s) {
        if (autodiff::creating_graph())
          return autodiff::composite_rule(cot, {s[0], s[1], s[2], s[3], s[4], s[5]}, composed_gru);
        const Array &x = s[0], &h0 = s[5], &wi_b = s[6], &wh_b = s[7], &bi_b = s[8], &bh_b = s[9], &ys = s[10];
        const Array &acts = s[11], &hgn = s[12];
        const Array d_ys = cot.out(0).defined() ? linum::detail::convert_float(cot.out(0), DType::f32) : Array();
        const Array d_h = cot.out(1).defined() ? linum::detail::convert_float(cot.out(1), DType::f32) : Array();
        auto maybe = [&](int k, const Array& like) { return cot.needs(k) ? Array::empty(like.shape()) : Array(); };
        Array dx = maybe(0, x), dwi = maybe(1, wi_b), dbi = maybe(2, bi_b), dwh = maybe(3, wh_b), dbh = maybe(4, bh_b);
        Array dh0 = maybe(5, h0);
        auto in_ptr = [](const Array& a) -> const float* { return a.defined() ? a.data() : nullptr; };
        auto out_ptr = [](Array& a) -> float* { return a.defined() ? a.mutable_data() : nullptr; };
        gk::backward({{d, x.data(), wi_b.data(), wh_b.data(), bi_b.data(), bh_b.data(), h0.data(), const_cast<float*>(ys.data()),
                       const_cast<float*>(in_ptr(acts)), const_cast<float*>(in_ptr(hgn))},
                      in_ptr(d_ys), in_ptr(d_h), out_ptr(dx), out_ptr(dwi), out_ptr(dwh), out_ptr(dbi), out_ptr(dbh),
                      out_ptr(dh0)});
        if (cot.needs(0)) cot.set(0, std::move(dx));
        if (cot.needs(1)) cot.set(1, blocked(dwi, gk::blocks_of(d.hidden), false));
        if (cot.needs(2)) cot.set(2, blocked(dbi, gk::blocks_of(d.hidden), false));
        if (cot.needs(3)) cot.set(3, blocked(dwh, gk::blocks_of(d.hidden), false));
        if (cot.needs(4)) cot.set(4, blocked(dbh, gk::blocks_of(d.hidden), false));
        if (cot.needs(5)) cot.set(5, std::move(dh0));
      }));
  return {std::move(out[0]), std::move(out[1])};
}

}  // namespace linum
