#include <linum/core/ops/recurrent.hpp>

#include <linum/core/autodiff/batching.hpp>
#include <linum/core/autodiff/primitive.hpp>
#include <linum/core/ops/batching.hpp>
#include <linum/core/dtype.hpp>
#include <linum/core/error.hpp>
#include <linum/core/kernels/gemm.hpp>
#include <linum/core/kernels/gru.hpp>
#include <linum/core/kernels/lstm.hpp>
#include <linum/core/ops/elementwise.hpp>
#include <linum/core/ops/linalg.hpp>
#include <linum/core/ops/kernel_util.hpp>
#include <linum/core/ops/kind.hpp>
#include <linum/core/ops/shape_ops.hpp>
#include <linum/core/threading.hpp>


#include <algorithm>
#include <optional>
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

// Float32 values rounded to bf16 in place (a rounded input's cotangent; undefined: nothing to do).
void round_to_bf16_values(Array& a) {
  if (a.defined() && a.numel() > 0) kernels::f32_rows_rounded_to_bf16(a.data(), a.numel(), 1, a.numel(), a.mutable_data());
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
namespace rb = kernels::recurrent;
namespace gk = kernels::gru;

struct LayerArgs;

// How many parts each weight of a layer op has and how many carries: what its backward rule needs
// to read its flat inputs as LayerArgs (the rule keeps no arrays of its own).
struct LayerStructure {
  std::vector<std::size_t> parts;
  std::size_t carries = 0;
  LayerArgs with(const std::vector<Array>& flat_arrays) const;
};

// A layer op's arguments: x, its weights (kernels and biases, each one array or one per gate), and
// its initial carries. The op's inputs are these flattened in that order.
struct LayerArgs {
  Array x;
  std::vector<std::vector<Array>> weights;
  std::vector<Array> carries;

  std::vector<const Array*> flat() const {
    std::vector<const Array*> out{&x};
    for (const auto& w : weights)
      for (const Array& p : w) out.push_back(&p);
    for (const Array& c : carries) out.push_back(&c);
    return out;
  }
  // The flat index of weight w's first part.
  std::size_t first_input(std::size_t w) const {
    std::size_t i = 1;
    for (std::size_t k = 0; k < w; ++k) i += weights[k].size();
    return i;
  }
  std::size_t carry_input(std::size_t c) const { return first_input(weights.size()) + c; }
  LayerStructure structure() const {
    LayerStructure out{{}, carries.size()};
    for (const auto& w : weights) out.parts.push_back(w.size());
    return out;
  }
  // The same structure over other arrays (flat, in the order of flat()).
  LayerArgs with(const std::vector<Array>& flat_arrays) const { return structure().with(flat_arrays); }
  template <class F>
  LayerArgs map(F f) const {
    std::vector<Array> arrays;
    for (const Array* a : flat()) arrays.push_back(f(*a));
    return with(arrays);
  }
  bool any(bool (*pred)(const Array&)) const {
    for (const Array* a : flat())
      if (pred(*a)) return true;
    return false;
  }
  DType promoted() const {
    DType dt = x.dtype();
    for (const Array* a : flat()) dt = promote_types(dt, a->dtype());
    return dt;
  }
};

LayerArgs LayerStructure::with(const std::vector<Array>& flat_arrays) const {
  LayerArgs out;
  std::size_t i = 0;
  out.x = flat_arrays.at(i++);
  for (std::size_t count : parts) {
    out.weights.emplace_back();
    for (std::size_t k = 0; k < count; ++k) out.weights.back().push_back(flat_arrays.at(i++));
  }
  for (std::size_t c = 0; c < carries; ++c) out.carries.push_back(flat_arrays.at(i++));
  return out;
}

// What a weight is: a kernel with rows x's features or the hidden units, or a bias.
enum class Rows { inputs, hidden, bias };
struct WeightSpec {
  const char* name;
  Rows rows;
};

std::string describe(const std::vector<Array>& parts) {
  if (parts.size() == 1) return parts[0].type_str();
  std::string out = "[";
  for (std::size_t k = 0; k < parts.size(); ++k) out += (k ? ", " : "") + parts[k].type_str();
  return out + "]";
}

// Checks a layer op's arguments and returns its dims: x [time, batch, in]; each weight one array
// ([rows, gates * hidden] or [gates * hidden]) or one per gate in gate order ([rows, hidden] or
// [hidden]); the carries [batch, hidden]. hidden is read from weight `recurrent` (a kernel over the
// hidden units).
lk::Dims check_layer(const char* op, std::int64_t gates, const LayerArgs& a, const std::vector<WeightSpec>& specs,
                     std::size_t recurrent, const std::vector<const char*>& carry_names, const char* usage) {
  auto fail = [&](const std::string& why) {
    std::string got = "x " + a.x.type_str();
    for (std::size_t w = 0; w < specs.size(); ++w) got += std::string(", ") + specs[w].name + " " + describe(a.weights[w]);
    for (std::size_t c = 0; c < carry_names.size(); ++c) got += std::string(", ") + carry_names[c] + " " + a.carries[c].type_str();
    throw ShapeError(std::string(op) + ": " + why + "; got " + got + " (" + usage + ")");
  };
  for (std::size_t w = 0; w < specs.size(); ++w)
    if (a.weights[w].size() != 1 && a.weights[w].size() != static_cast<std::size_t>(gates))
      fail(std::string(specs[w].name) + " must be one array or " + std::to_string(gates) + " (one per gate)");
  for (const Array* p : a.flat()) {
    if (!p->defined()) fail("an argument is undefined");
    if (p->dtype() != DType::f32 && p->dtype() != DType::bf16) fail("arguments must be float32 or bfloat16");
  }
  if (a.x.rank() != 3) fail("x must be [time, batch, in]");
  const std::vector<Array>& rec = a.weights[recurrent];
  if (rec[0].rank() != 2 || rec[0].dim(0) == 0) fail(std::string(specs[recurrent].name) + " must be [hidden, ...] with hidden > 0");
  const std::int64_t T = a.x.dim(0), N = a.x.dim(1), I = a.x.dim(2), H = rec[0].dim(0);
  for (std::size_t w = 0; w < specs.size(); ++w) {
    const bool one = a.weights[w].size() == 1;
    const std::int64_t cols = one ? gates * H : H;
    const Shape want = specs[w].rows == Rows::bias ? Shape{cols} : Shape{specs[w].rows == Rows::inputs ? I : H, cols};
    for (const Array& p : a.weights[w])
      if (!(p.shape() == want))
        fail(std::string(specs[w].name) + " must be " + (specs[w].rows == Rows::bias ? "[" : specs[w].rows == Rows::inputs ? "[in, " : "[hidden, ") +
             (one ? std::to_string(gates) + " * hidden]" : "hidden] per gate") + " with hidden = " + std::to_string(H));
  }
  for (std::size_t c = 0; c < a.carries.size(); ++c)
    if (!(a.carries[c].shape() == Shape{N, H})) fail(std::string(carry_names[c]) + " must be [batch, hidden]");
  return {T, N, I, H};
}

// A float32 weight's gates where they are: one array's column ranges, or one array per gate.
rb::GateColumns columns_of(const std::vector<Array>& parts, std::int64_t hidden, std::int64_t gates) {
  rb::GateColumns g;
  for (std::int64_t k = 0; k < gates; ++k)
    g.gate[static_cast<std::size_t>(k)] = parts.size() == 1 ? parts[0].data() + k * hidden : parts[static_cast<std::size_t>(k)].data();
  g.ld = parts.size() == 1 ? gates * hidden : hidden;
  return g;
}

std::int64_t rows_of(const std::vector<Array>& parts) { return parts[0].rank() == 1 ? 1 : parts[0].dim(0); }

// A float32 weight in a layer kernel's interleaved block layout, [rows, gates * H] ([gates * H]),
// its values rounded to bf16 when `round`.
Array interleaved(const std::vector<Array>& parts, const rb::UnitBlocks& bl, bool round = false) {
  const std::int64_t rows = rows_of(parts);
  Array out = parts[0].rank() == 1 ? Array::empty(Shape{bl.gates * bl.hidden}) : Array::empty(Shape{rows, bl.gates * bl.hidden});
  bl.interleave(columns_of(parts, bl.hidden, bl.gates), 0, rows, out.mutable_data());
  if (round) round_to_bf16_values(out);
  return out;
}

// A weight's gradient, computed interleaved, in the parts' layout.
std::vector<Array> gradient_parts(const Array& g, const std::vector<Array>& parts, const rb::UnitBlocks& bl) {
  std::vector<Array> out;
  rb::MutableGateColumns cols;
  for (std::size_t k = 0; k < parts.size(); ++k) out.push_back(Array::empty(parts[k].shape()));
  for (std::int64_t k = 0; k < bl.gates; ++k)
    cols.gate[static_cast<std::size_t>(k)] =
        out.size() == 1 ? out[0].mutable_data() + k * bl.hidden : out[static_cast<std::size_t>(k)].mutable_data();
  cols.ld = out.size() == 1 ? bl.gates * bl.hidden : bl.hidden;
  bl.deinterleave(g.data(), rows_of(parts), cols);
  return out;
}

// The weight as one array (create-graph mode's composite reads it so).
Array joined(const std::vector<Array>& parts) { return parts.size() == 1 ? parts[0] : concatenate(parts, -1); }

// vmap of a layer op: the layer once per example (each example may have its own weights), results
// stacked. `example_shapes` and `dtype`: one example's results (for a batch level of size 0).
template <class Layer>
std::vector<Array> per_example(const char* op, const std::vector<const Array*>& inputs, const std::vector<Shape>& example_shapes,
                               DType dtype, Layer layer) {
  const std::vector<BatchLevel> levels = autodiff::union_levels(std::span<const Array* const>(inputs.data(), inputs.size()), op);
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
      out.push_back(wrap(Array::zeros(Shape(dims), dtype), s));
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

bool is_batched(const Array& a) { return a.batched(); }
// Whether a layer's recurrent kernel (weight 2, every part) is bf16: its products then run on bf16
// operands, as bf16 layers do in oneDNN and PyTorch.
bool recurrent_kernel_bf16(const LayerArgs& a) {
  for (const Array& p : a.weights[2])
    if (p.dtype() != DType::bf16) return false;
  return true;
}
bool not_f32(const Array& a) { return a.dtype() != DType::f32; }
Array to_f32(const Array& a) { return a.dtype() == DType::f32 ? a : astype(a, DType::f32); }

// How a layer op's kernels (all on float32 arrays) treat bf16.
enum class Precision {
  f32,            // float32 products
  bf16_products,  // a bf16 recurrent kernel, given widened: every product rounds its operands to bf16
  // options.dtype = bf16: x and the weights read as bf16, rounded where they are read (the products'
  // operands, the interleaved copies of the input kernel and the biases; no rounded copy of x or the
  // recurrent kernel is made or kept), and their cotangents rounded as a cast's would be: bitwise
  // the layer on x and weights cast to bf16 first, without the casts' copies.
  bf16_inputs,
};
bool bf16_products(Precision p) { return p != Precision::f32; }

// Create-graph mode of Precision::bf16_inputs: x and the weights (flat inputs before the carries)
// cast to bf16 and back, so that the composed layer differentiates the casts too.
std::vector<Array> rounded_through_casts(const LayerStructure& shape, std::vector<Array> in) {
  const std::size_t carries_from = in.size() - shape.carries;
  for (std::size_t i = 0; i < carries_from; ++i) in[i] = astype(astype(in[i], DType::bf16), DType::f32);
  return in;
}

// options.dtype: float32 or bf16 (the dtypes the layer ops compute in).
void check_compute_dtype(const char* op, const std::optional<DType>& dtype) {
  if (dtype && *dtype != DType::f32 && *dtype != DType::bf16)
    throw ValueError(std::string(op) + ": dtype must be float32 or bfloat16 (the computation dtype, as Flax's dtype), got " +
                     dtype_name(*dtype));
}

// A layer op's seq_lengths as values (empty: none given), checked: int32 [batch], each a count of
// steps in [0, time].
std::vector<std::int32_t> lengths_of(const char* op, const std::optional<Array>& seq_lengths, const lk::Dims& d) {
  if (!seq_lengths) return {};
  const Array& l = *seq_lengths;
  if (!l.defined() || l.dtype() != DType::i32 || !(l.shape() == Shape{d.rows}))
    throw ShapeError(std::string(op) + ": seq_lengths must be int32 [batch] with batch = " + std::to_string(d.rows) + ", got " +
                     (l.defined() ? l.type_str() : std::string("an undefined array")));
  std::vector<std::int32_t> out(l.data_i32(), l.data_i32() + d.rows);
  for (std::size_t n = 0; n < out.size(); ++n)
    if (out[n] < 0 || out[n] > d.steps)
      throw ValueError(std::string(op) + ": seq_lengths[" + std::to_string(n) + "] = " + std::to_string(out[n]) +
                       " is not a number of steps in [0, " + std::to_string(d.steps) + "] (x has " + std::to_string(d.steps) +
                       " time steps)");
  return out;
}

// Each row's final state from the states of every step (ys [T, N, H]): row n's after lengths[n]
// steps, the initial state's row for 0 (no lengths: the last step's).
Array final_state(const Array& ys, const Array& initial, const std::vector<std::int32_t>& lengths) {
  const std::int64_t T = ys.dim(0), N = initial.dim(0), H = initial.dim(1);
  Array out = Array::empty(Shape{N, H});
  for (std::int64_t n = 0; n < N; ++n) {
    const std::int64_t len = lengths.empty() ? T : lengths[static_cast<std::size_t>(n)];
    const float* src = len == 0 ? initial.data() + n * H : ys.data() + ((len - 1) * N + n) * H;
    std::memcpy(out.mutable_data() + n * H, src, static_cast<std::size_t>(H) * sizeof(float));
  }
  return out;
}

// The composed layers' final carry with lengths: the state after each row's length, kept with
// masks as the steps go (create-graph mode differentiates it).
struct SelectedState {
  const std::vector<std::int32_t>& lengths;
  Array selected;  // starts as the initial state (rows of length 0)
  void after_step(std::int64_t t, const Array& state) {
    if (lengths.empty()) return;
    std::vector<float> mask(lengths.size());
    for (std::size_t n = 0; n < lengths.size(); ++n) mask[n] = lengths[n] == t + 1 ? 1.0f : 0.0f;
    selected = where(Array::from(Shape{static_cast<std::int64_t>(mask.size()), 1}, mask), state, selected);
  }
  Array final_or(const Array& last) const { return lengths.empty() ? last : selected; }
};

// vmap of a layer op with seq_lengths batched too: the lengths join the per-example inputs (last).
template <class Options>
std::vector<const Array*> with_batched_lengths(std::vector<const Array*> inputs, const Options& options) {
  if (options.seq_lengths && options.seq_lengths->batched()) inputs.push_back(&*options.seq_lengths);
  return inputs;
}
template <class Options>
std::pair<std::vector<Array>, Options> split_batched_lengths(std::vector<Array> one, Options options) {
  if (options.seq_lengths && options.seq_lengths->batched()) {
    options.seq_lengths = one.back();
    one.pop_back();
  }
  return {std::move(one), std::move(options)};
}
bool lengths_batched(const std::optional<Array>& seq_lengths) { return seq_lengths && seq_lengths->batched(); }

const std::vector<WeightSpec> kLSTMWeights{{"input_kernel", Rows::inputs}, {"bias", Rows::bias}, {"recurrent_kernel", Rows::hidden}};
constexpr const char* kLSTMUsage =
    "x [time, batch, in], input_kernel [in, 4 * hidden], bias [4 * hidden], recurrent_kernel [hidden, 4 * hidden] (or each "
    "as 4 arrays, one per gate i, f, g, o), c0 and h0 [batch, hidden]";

// The layer written with ops (create-graph mode differentiates it); `in` is the op's flat inputs.
// A layer's product as its kernels compute it: with bf16 products the operands rounded to bf16 and
// multiplied in float32 (what oneDNN's bf16 products compute), else float32.
Array layer_matmul(const Array& a, const Array& b, bool bf16_products) {
  if (!bf16_products) return matmul(a, b);
  auto rounded = [](const Array& v) { return astype(astype(v, DType::bf16), DType::f32); };
  return matmul(rounded(a), rounded(b));
}

std::vector<Array> composed_layer(const LayerStructure& shape, const std::vector<Array>& in,
                                  const std::vector<std::int32_t>& lengths, bool bf16_products) {
  const LayerArgs a = shape.with(in);
  const Array &x = a.x, wi = joined(a.weights[0]), b = joined(a.weights[1]), wh = joined(a.weights[2]);
  Array c = a.carries[0], h = a.carries[1];
  SelectedState c_final{lengths, c}, h_final{lengths, h};
  std::vector<Array> ys;
  for (std::int64_t t = 0; t < x.dim(0); ++t) {
    const Array xt = reshape(slice_axis(x, 0, t, t + 1), {x.dim(1), x.dim(2)});
    auto [cn, hn] = lstm_cell(layer_matmul(xt, wi, bf16_products) + b, layer_matmul(h, wh, bf16_products), c);
    c = cn;
    h = hn;
    c_final.after_step(t, c);
    h_final.after_step(t, h);
    ys.push_back(hn);
  }
  Array y = ys.empty() ? Array::zeros(Shape{0, x.dim(1), wh.dim(0)}) : stack(ys);
  return {y, c_final.final_or(c), h_final.final_or(h)};
}

// The input cotangents of a layer op's weights from their interleaved gradients (undefined: not
// needed), and of x and the carries as computed.
void set_layer_cotangents(Cotangents& cot, const LayerArgs& args, Array dx, std::vector<Array> weight_grads,
                          std::vector<Array> carry_grads, const rb::UnitBlocks& bl) {
  if (cot.needs(0)) cot.set(0, std::move(dx));
  for (std::size_t w = 0; w < weight_grads.size(); ++w) {
    if (!weight_grads[w].defined()) continue;
    std::vector<Array> parts = gradient_parts(weight_grads[w], args.weights[w], bl);
    for (std::size_t k = 0; k < parts.size(); ++k)
      if (cot.needs(args.first_input(w) + k)) cot.set(args.first_input(w) + k, std::move(parts[k]));
  }
  for (std::size_t c = 0; c < carry_grads.size(); ++c)
    if (cot.needs(args.carry_input(c))) cot.set(args.carry_input(c), std::move(carry_grads[c]));
}

// Whether any of weight w's parts needs a gradient.
bool needs_weight(const Cotangents& cot, const LayerArgs& args, std::size_t w) {
  for (std::size_t k = 0; k < args.weights[w].size(); ++k)
    if (cot.needs(args.first_input(w) + k)) return true;
  return false;
}

// The dtypes of a layer op's results when it computes in `dtype` (options.dtype): those of the layer
// on x and the weights cast to it, the carries as given.
DType result_dtype(const LayerArgs& a, DType dtype) {
  DType dt = dtype;
  for (const Array& c : a.carries) dt = promote_types(dt, c.dtype());
  return dt;
}
DType result_dtype(const LayerArgs& a, const std::optional<DType>& dtype) {
  return dtype ? result_dtype(a, *dtype) : a.promoted();
}

// precision: see Precision (the arguments are then float32).
std::tuple<Array, Array, Array> lstm_layer_op(const LayerArgs& args, const LSTMLayerOptions& options,
                                              Precision precision = Precision::f32) {
  lk::Dims d = check_layer("lstm_layer", 4, args, kLSTMWeights, 2, {"c0", "h0"}, kLSTMUsage);
  check_compute_dtype("lstm_layer", options.dtype);
  d.bf16_products = bf16_products(precision);
  if (options.recompute_segment < 0)
    throw ValueError("lstm_layer: recompute_segment must be >= 0 (0 keeps every step), got " +
                     std::to_string(options.recompute_segment));
  if (args.any(is_batched) || lengths_batched(options.seq_lengths)) [[unlikely]] {
    const std::vector<Array> out = per_example(
        "lstm_layer", with_batched_lengths(args.flat(), options),
        {Shape{d.steps, d.rows, d.hidden}, Shape{d.rows, d.hidden}, Shape{d.rows, d.hidden}}, result_dtype(args, options.dtype),
        [&](const std::vector<Array>& one) {
          auto [flat, o] = split_batched_lengths(one, options);
          auto [y, c, h] = lstm_layer_op(args.with(flat), o);
          return std::vector<Array>{y, c, h};
        });
    return {out[0], out[1], out[2]};
  }
  if (options.dtype) {  // as if x and the weights were cast to dtype (bf16 arguments widened: exact)
    const DType dt = result_dtype(args, *options.dtype);
    LSTMLayerOptions rest = options;
    rest.dtype.reset();
    auto [y, c, h] = lstm_layer_op(args.map(to_f32), rest, *options.dtype == DType::bf16 ? Precision::bf16_inputs : Precision::f32);
    return {astype(y, dt), astype(c, dt), astype(h, dt)};
  }
  if (args.any(not_f32)) {
    const DType dt = args.promoted();
    auto [y, c, h] = lstm_layer_op(args.map(to_f32), options,
                                   recurrent_kernel_bf16(args) ? Precision::bf16_products : Precision::f32);
    return {astype(y, dt), astype(c, dt), astype(h, dt)};
  }
  const std::vector<std::int32_t> lengths = lengths_of("lstm_layer", options.seq_lengths, d);
  const std::int32_t* lengths_ptr = lengths.empty() ? nullptr : lengths.data();
  const std::int64_t segment =
      options.recompute_segment == 0 ? 0 : (options.recompute_segment + lk::kChunk - 1) / lk::kChunk * lk::kChunk;
  const std::vector<const Array*> ins = args.flat();
  const std::size_t n_in = ins.size();
  std::vector<Array> out = autodiff::primitive_multi(
      ops::kind::lstm_layer, std::span<const Array* const>(ins),
      [&](autodiff::Residuals& r) {
        const auto bl = lk::blocks_of(d.hidden);
        // The input kernel and bias interleaved for the per-block products; the recurrent kernel is
        // packed a block at a time from where it is.
        const bool round = precision == Precision::bf16_inputs;
        const Array wi_i = interleaved(args.weights[0], bl, round), b_i = interleaved(args.weights[1], bl, round);
        Array ys = Array::empty(Shape{d.steps, d.rows, d.hidden});
        Array c_last = Array::empty(Shape{d.rows, d.hidden});
        // What the backward pass reads: every step's activations and cell states, or the cell state
        // at each segment's start (not recording: one segment, nothing kept).
        const std::int64_t seg = r.recording() ? segment : (d.steps + lk::kChunk - 1) / lk::kChunk * lk::kChunk;
        const bool keep_all = seg == 0;
        Array acts = keep_all ? Array::empty(Shape{d.steps, d.rows, 4 * d.hidden}) : Array();
        Array cs = keep_all ? Array::empty(Shape{d.steps, d.rows, d.hidden})
                            : Array::empty(Shape{std::max<std::int64_t>(1, (d.steps + seg - 1) / seg), d.rows, d.hidden});
        const Array &c0 = args.carries[0], &h0 = args.carries[1];
        lk::forward({d, args.x.data(), wi_i.data(), columns_of(args.weights[2], d.hidden, 4), b_i.data(), c0.data(), h0.data(),
                     ys.mutable_data(), keep_all ? acts.mutable_data() : nullptr, cs.mutable_data(), seg,
                     c_last.mutable_data(), lengths_ptr});
        Array h_last = final_state(ys, h0, lengths);
        for (const Array* a : ins) r.keep(*a);
        r.keep(wi_i, b_i, ys, acts, cs);
        return std::vector<Array>{std::move(ys), std::move(c_last), std::move(h_last)};
      },
      autodiff::higher_order([d, segment, n_in, lengths, precision, shape = args.structure()](Cotangents& cot, autodiff::Saved s) {
        const std::vector<Array> inputs(s.begin(), s.begin() + static_cast<std::ptrdiff_t>(n_in));
        if (autodiff::creating_graph())
          return autodiff::composite_rule(
              cot, inputs, [&shape, &lengths, &d, precision](const std::vector<Array>& in) {
                return composed_layer(shape, precision == Precision::bf16_inputs ? rounded_through_casts(shape, in) : in,
                                      lengths, d.bf16_products);
              });
        const LayerArgs a = shape.with(inputs);
        const Array &wi_i = s[n_in], &b_i = s[n_in + 1], &ys = s[n_in + 2], &acts = s[n_in + 3], &cs = s[n_in + 4];
        const Array &x = a.x, &c0 = a.carries[0], &h0 = a.carries[1];
        auto f32_or_null = [](const Array& t) -> const float* { return t.defined() ? t.data() : nullptr; };
        const Array d_ys = cot.out(0).defined() ? linum::detail::convert_float(cot.out(0), DType::f32) : Array();
        const Array d_c = cot.out(1).defined() ? linum::detail::convert_float(cot.out(1), DType::f32) : Array();
        const Array d_h = cot.out(2).defined() ? linum::detail::convert_float(cot.out(2), DType::f32) : Array();
        auto maybe = [&](bool needed, const Shape& shape_) { return needed ? Array::empty(shape_) : Array(); };
        Array dx = maybe(cot.needs(0), x.shape());
        Array dwi = maybe(needs_weight(cot, a, 0), wi_i.shape()), db = maybe(needs_weight(cot, a, 1), b_i.shape());
        Array dwh = maybe(needs_weight(cot, a, 2), Shape{d.hidden, 4 * d.hidden});
        Array dc0 = maybe(cot.needs(a.carry_input(0)), c0.shape()), dh0 = maybe(cot.needs(a.carry_input(1)), h0.shape());
        auto out_ptr = [](Array& t) -> float* { return t.defined() ? t.mutable_data() : nullptr; };
        const bool keep_all = acts.defined();
        lk::backward({{d, x.data(), wi_i.data(), columns_of(a.weights[2], d.hidden, 4), b_i.data(), c0.data(), h0.data(),
                       const_cast<float*>(ys.data()), keep_all ? const_cast<float*>(acts.data()) : nullptr,
                       const_cast<float*>(cs.data()), keep_all ? 0 : segment, nullptr,
                       lengths.empty() ? nullptr : lengths.data()},
                      f32_or_null(d_ys), f32_or_null(d_c), f32_or_null(d_h), out_ptr(dx), out_ptr(dwi), out_ptr(dwh),
                      out_ptr(db), out_ptr(dc0), out_ptr(dh0)});
        if (precision == Precision::bf16_inputs)
          for (Array* g : {&dx, &dwi, &db, &dwh}) round_to_bf16_values(*g);
        set_layer_cotangents(cot, a, std::move(dx), {std::move(dwi), std::move(db), std::move(dwh)},
                             {std::move(dc0), std::move(dh0)}, lk::blocks_of(d.hidden));
      }));
  return {std::move(out[0]), std::move(out[1]), std::move(out[2])};
}

const std::vector<WeightSpec> kGRUWeights{{"input_kernel", Rows::inputs},
                                          {"input_bias", Rows::bias},
                                          {"recurrent_kernel", Rows::hidden},
                                          {"recurrent_bias", Rows::bias}};
constexpr const char* kGRUUsage =
    "x [time, batch, in], input_kernel [in, 3 * hidden], recurrent_kernel [hidden, 3 * hidden], input_bias and "
    "recurrent_bias [3 * hidden] (or each as 3 arrays, one per gate r, z, n), h0 [batch, hidden]";

// The GRU layer written with ops (create-graph mode differentiates it), in Flax's GRUCell's form.
std::vector<Array> composed_gru(const LayerStructure& shape, const std::vector<Array>& in,
                                const std::vector<std::int32_t>& lengths, bool bf16_products) {
  const LayerArgs a = shape.with(in);
  const Array &x = a.x, wi = joined(a.weights[0]), bi = joined(a.weights[1]), wh = joined(a.weights[2]),
              bh = joined(a.weights[3]);
  const std::int64_t H = wh.dim(0);
  Array h = a.carries[0];
  SelectedState h_final{lengths, h};
  auto gate = [&](const Array& v, int k) { return slice_axis(v, -1, k * H, (k + 1) * H); };
  std::vector<Array> ys;
  for (std::int64_t t = 0; t < x.dim(0); ++t) {
    const Array xg = layer_matmul(reshape(slice_axis(x, 0, t, t + 1), {x.dim(1), x.dim(2)}), wi, bf16_products) + bi;
    const Array hg = layer_matmul(h, wh, bf16_products) + bh;
    const Array r = sigmoid(gate(xg, 0) + gate(hg, 0)), z = sigmoid(gate(xg, 1) + gate(hg, 1));
    const Array n = tanh(gate(xg, 2) + r * gate(hg, 2));
    h = (1.0f - z) * n + z * h;
    h_final.after_step(t, h);
    ys.push_back(h);
  }
  Array y = ys.empty() ? Array::zeros(Shape{0, x.dim(1), H}) : stack(ys);
  return {y, h_final.final_or(h)};
}

std::pair<Array, Array> gru_layer_op(const LayerArgs& args, const GRULayerOptions& options,
                                     Precision precision = Precision::f32) {
  lk::Dims d = check_layer("gru_layer", 3, args, kGRUWeights, 2, {"h0"}, kGRUUsage);
  check_compute_dtype("gru_layer", options.dtype);
  d.bf16_products = bf16_products(precision);
  if (args.any(is_batched) || lengths_batched(options.seq_lengths)) [[unlikely]] {
    const std::vector<Array> out = per_example("gru_layer", with_batched_lengths(args.flat(), options),
                                               {Shape{d.steps, d.rows, d.hidden}, Shape{d.rows, d.hidden}},
                                               result_dtype(args, options.dtype), [&](const std::vector<Array>& one) {
                                                 auto [flat, o] = split_batched_lengths(one, options);
                                                 auto [y, h] = gru_layer_op(args.with(flat), o);
                                                 return std::vector<Array>{y, h};
                                               });
    return {out[0], out[1]};
  }
  if (options.dtype) {  // as if x and the weights were cast to dtype (bf16 arguments widened: exact)
    const DType dt = result_dtype(args, *options.dtype);
    GRULayerOptions rest = options;
    rest.dtype.reset();
    auto [y, h] = gru_layer_op(args.map(to_f32), rest, *options.dtype == DType::bf16 ? Precision::bf16_inputs : Precision::f32);
    return {astype(y, dt), astype(h, dt)};
  }
  if (args.any(not_f32)) {
    const DType dt = args.promoted();
    auto [y, h] = gru_layer_op(args.map(to_f32), options, recurrent_kernel_bf16(args) ? Precision::bf16_products : Precision::f32);
    return {astype(y, dt), astype(h, dt)};
  }
  const std::vector<std::int32_t> lengths = lengths_of("gru_layer", options.seq_lengths, d);
  const std::vector<const Array*> ins = args.flat();
  const std::size_t n_in = ins.size();
  const bool recompute = options.recompute;
  std::vector<Array> out = autodiff::primitive_multi(
      ops::kind::gru_layer, std::span<const Array* const>(ins),
      [&](autodiff::Residuals& r) {
        const auto bl = gk::blocks_of(d.hidden);
        const bool round = precision == Precision::bf16_inputs;
        const Array wi_b = interleaved(args.weights[0], bl, round), bi_b = interleaved(args.weights[1], bl, round);
        const Array bh_b = interleaved(args.weights[3], bl, round);
        Array ys = Array::empty(Shape{d.steps, d.rows, d.hidden});
        // What the backward pass reads besides ys: every step's gates, or nothing (recompute, or not
        // recording).
        const bool keep = r.recording() && !recompute;
        Array acts = keep ? Array::empty(Shape{d.steps, d.rows, gk::kGates * d.hidden}) : Array();
        Array hgn = keep ? Array::empty(Shape{d.steps, d.rows, d.hidden}) : Array();
        const Array& h0 = args.carries[0];
        gk::forward({d, args.x.data(), wi_b.data(), columns_of(args.weights[2], d.hidden, 3), bi_b.data(), bh_b.data(),
                     h0.data(), ys.mutable_data(), keep ? acts.mutable_data() : nullptr, keep ? hgn.mutable_data() : nullptr});
        Array h_last = final_state(ys, h0, lengths);
        for (const Array* a : ins) r.keep(*a);
        r.keep(wi_b, bi_b, bh_b, ys, acts, hgn);
        return std::vector<Array>{std::move(ys), std::move(h_last)};
      },
      autodiff::higher_order([d, n_in, lengths, precision, shape = args.structure()](Cotangents& cot, autodiff::Saved s) {
        const std::vector<Array> inputs(s.begin(), s.begin() + static_cast<std::ptrdiff_t>(n_in));
        if (autodiff::creating_graph())
          return autodiff::composite_rule(
              cot, inputs, [&shape, &lengths, &d, precision](const std::vector<Array>& in) {
                return composed_gru(shape, precision == Precision::bf16_inputs ? rounded_through_casts(shape, in) : in,
                                    lengths, d.bf16_products);
              });
        const LayerArgs a = shape.with(inputs);
        const Array &wi_b = s[n_in], &bi_b = s[n_in + 1], &bh_b = s[n_in + 2], &ys = s[n_in + 3], &acts = s[n_in + 4],
                    &hgn = s[n_in + 5];
        const Array &x = a.x, &h0 = a.carries[0];
        const Array d_ys = cot.out(0).defined() ? linum::detail::convert_float(cot.out(0), DType::f32) : Array();
        const Array d_h = cot.out(1).defined() ? linum::detail::convert_float(cot.out(1), DType::f32) : Array();
        auto maybe = [&](bool needed, const Shape& shape_) { return needed ? Array::empty(shape_) : Array(); };
        Array dx = maybe(cot.needs(0), x.shape());
        Array dwi = maybe(needs_weight(cot, a, 0), wi_b.shape()), dbi = maybe(needs_weight(cot, a, 1), bi_b.shape());
        Array dwh = maybe(needs_weight(cot, a, 2), Shape{d.hidden, gk::kGates * d.hidden});
        Array dbh = maybe(needs_weight(cot, a, 3), bh_b.shape());
        Array dh0 = maybe(cot.needs(a.carry_input(0)), h0.shape());
        auto in_ptr = [](const Array& t) -> const float* { return t.defined() ? t.data() : nullptr; };
        auto out_ptr = [](Array& t) -> float* { return t.defined() ? t.mutable_data() : nullptr; };
        gk::backward({{d, x.data(), wi_b.data(), columns_of(a.weights[2], d.hidden, 3), bi_b.data(), bh_b.data(), h0.data(),
                       const_cast<float*>(ys.data()), const_cast<float*>(in_ptr(acts)), const_cast<float*>(in_ptr(hgn)),
                       lengths.empty() ? nullptr : lengths.data()},
                      in_ptr(d_ys), in_ptr(d_h), out_ptr(dx), out_ptr(dwi), out_ptr(dwh), out_ptr(dbi), out_ptr(dbh),
                      out_ptr(dh0)});
        if (precision == Precision::bf16_inputs)
          for (Array* g : {&dx, &dwi, &dbi, &dwh, &dbh}) round_to_bf16_values(*g);
        set_layer_cotangents(cot, a, std::move(dx), {std::move(dwi), std::move(dbi), std::move(dwh), std::move(dbh)},
                             {std::move(dh0)}, gk::blocks_of(d.hidden));
      }));
  return {std::move(out[0]), std::move(out[1])};
}

}  // namespace

std::tuple<Array, Array, Array> lstm_layer(const Array& x, const Array& input_kernel, const Array& bias,
                                           const Array& recurrent_kernel, const Array& c0, const Array& h0,
                                           const LSTMLayerOptions& options) {
  return lstm_layer_op({x, {{input_kernel}, {bias}, {recurrent_kernel}}, {c0, h0}}, options);
}

std::tuple<Array, Array, Array> lstm_layer(const Array& x, const std::vector<Array>& input_kernel, const std::vector<Array>& bias,
                                           const std::vector<Array>& recurrent_kernel, const Array& c0, const Array& h0,
                                           const LSTMLayerOptions& options) {
  return lstm_layer_op({x, {input_kernel, bias, recurrent_kernel}, {c0, h0}}, options);
}

std::pair<Array, Array> gru_layer(const Array& x, const Array& input_kernel, const Array& input_bias,
                                  const Array& recurrent_kernel, const Array& recurrent_bias, const Array& h0,
                                  const GRULayerOptions& options) {
  return gru_layer_op({x, {{input_kernel}, {input_bias}, {recurrent_kernel}, {recurrent_bias}}, {h0}}, options);
}

std::pair<Array, Array> gru_layer(const Array& x, const std::vector<Array>& input_kernel, const std::vector<Array>& input_bias,
                                  const std::vector<Array>& recurrent_kernel, const std::vector<Array>& recurrent_bias,
                                  const Array& h0, const GRULayerOptions& options) {
  return gru_layer_op({x, {input_kernel, input_bias, recurrent_kernel, recurrent_bias}, {h0}}, options);
}

}  // namespace linum
