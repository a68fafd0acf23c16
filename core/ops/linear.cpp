// The fused dense layer (linear.hpp): one primitive whose forward is a product with the bias in its
// epilogue followed by the activation (gelu and silu compute their derivative in the same pass and
// keep it), and whose backward rule passes over the cotangent once (the activation's derivative and
// the bias sum together) before the two products.
#include <linum/core/ops/linear.hpp>

#include <linum/core/autodiff/primitive.hpp>
#include <linum/core/kernels/gemm.hpp>
#include <linum/core/ops/activation_math_internal.hpp>
#include <linum/core/ops/bf16_table_internal.hpp>
#include <linum/core/ops/elementwise.hpp>
#include <linum/core/ops/kernel_util.hpp>
#include <linum/core/ops/kind.hpp>
#include <linum/core/ops/linalg.hpp>
#include <linum/core/ops/reduce.hpp>
#include <linum/core/ops/shape_ops.hpp>
#include <linum/core/threading.hpp>

#include <array>
#include <cstring>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace linum {
namespace {

namespace am = ops::detail::activation_math;
namespace od = ops::detail;
using autodiff::Cotangents;
using autodiff::Residuals;

constexpr std::array<std::pair<Activation, std::string_view>, 7> kNames{{
    {Activation::none, "none"},
    {Activation::relu, "relu"},
    {Activation::gelu, "gelu"},
    {Activation::gelu_exact, "gelu_exact"},
    {Activation::silu, "silu"},
    {Activation::tanh, "tanh"},
    {Activation::sigmoid, "sigmoid"},
}};

// Rows per block of the backward pass: each block sums its rows' cotangents per column in row order,
// and the blocks' sums are added in block order, so the bias gradient's bits depend on the shape
// alone (not on the threads). For the activations whose pass the layer after can do
// (offers_cotangent_pass), the row tiles of the panel kernels, whose input gradient can hand the
// layer before its pass done, sums included (input_gradient below); otherwise 64 (a quarter of the
// block sums to keep: a logits layer's are [rows / 64, vocabulary] floats).
// relu (selects by its kept output) and the activations that keep their derivative (multiply by it).
bool offers_cotangent_pass(Activation act) { return am::derivative_from_input(act) || act == Activation::relu; }
std::int64_t rows_per_block(Activation act) { return offers_cotangent_pass(act) ? kernels::kScaledSumRows : 64; }
// One row of g2 = g * act'(x) in float32 (n floats, padded to whole packets in the scratch runs),
// from what the op keeps (`v`): the output for relu, tanh and sigmoid; for gelu and silu the
// derivative itself.
void derivative_row(Activation act, const float* g, const float* v, float* out, std::int64_t n) {
  const am::CVec G(g, n), V(v, n);
  am::OVec O(out, n);
  switch (act) {
    case Activation::none: O = G; break;
    case Activation::relu: O = am::relu_grad(G, V); break;
    case Activation::gelu:
    case Activation::gelu_exact:
    case Activation::silu:
      O = G * V;
      break;
    case Activation::tanh: O = am::tanh_grad(G, V); break;
    case Activation::sigmoid: O = am::sigmoid_grad(G, V); break;
  }
}

// Row r of a float array, n wide, as float32 in `scratch` (padded to whole packets, as the
// elementwise kernels pad a chunk, so every element takes the vectorised path).
const float* row_f32(const Array& a, std::int64_t r, std::int64_t n, float* scratch) {
  return od::padded_view(od::f32_view(a, r * n, n, scratch), n, scratch);
}

// The bf16 table of (value, derivative) pairs of gelu, gelu_exact or silu: every bf16 input's pair,
// filled on first use (per floating-point mode) by this same computation.
const std::uint32_t* pair_table(Activation act) {
  static std::array<od::Bf16Tables<std::uint32_t>, 3> tables;  // gelu, gelu_exact, silu
  if (!am::derivative_from_input(act)) throw Error("linear: no (value, derivative) table for this activation");
  auto& table_set = tables[act == Activation::gelu ? 0 : act == Activation::gelu_exact ? 1 : 2];
  od::g_bf16_table_reads.fetch_add(1, std::memory_order_relaxed);
  return table_set.get([act](const float* x, std::uint32_t* entries, std::int64_t n) {
    alignas(64) float sy[od::kChunk], sd[od::kChunk], u[od::kChunk];
    alignas(64) bfloat16 ry[od::kChunk], rd[od::kChunk];
    am::value_and_derivative(act, x, sy, sd, u, n);
    f32_to_bf16(sy, ry, n);
    f32_to_bf16(sd, rd, n);
    for (std::int64_t i = 0; i < n; ++i) entries[i] = ry[i].bits | static_cast<std::uint32_t>(rd[i].bits) << 16;
  });
}

// Whether a bf16 (value, derivative) pass over `elements` elements reads pair_table.
bool pairs_from_table(DType dtype, std::int64_t elements) {
  return dtype == DType::bf16 && elements >= od::kBf16TableMinElements;
}

// y = act(z) and d = act'(z) in one pass, for an activation whose derivative reads its input (the
// same bits as the activation op's value and its backward rule's derivative).
// In bf16 both come from a table of the pair for every bf16 input (ops/bf16_table_internal.hpp),
// filled by this same computation: the same bits, 0.22 against 0.34 ms on [2048, 512] (2 threads).
// There d goes to a buffer of its own, written around the caches (it is next read in the backward
// pass), and z's buffer is freed when the op returns, still in cache, for the next layer's product
// to write into (the block cache hands back the last freed block of a size first): about 1.5% of a
// bf16 MLP step (24 x 512, batch 2048, AMD EPYC Zen 5, steps alternating in one process). In float32
// d is written over z when no other array shares z's buffer.
// (On the bf16 panel kernel the fused linear layer looks the pairs up inside its product instead:
// kernels::gemm_bias_pairs.)
std::pair<Array, Array> value_and_derivative(Array z, Activation act) {
  Array y = Array::empty(z.shape(), z.dtype());
  if (pairs_from_table(z.dtype(), z.numel())) {
    Array d = Array::empty(z.shape(), z.dtype());
    const std::uint32_t* table = pair_table(act);
    const auto* in = static_cast<const bfloat16*>(z.raw());
    auto* value = static_cast<bfloat16*>(y.mutable_raw());
    auto* derivative = static_cast<bfloat16*>(d.mutable_raw());
    od::for_chunks(z.numel(), [&](std::int64_t s, std::int64_t c) {
      od::bf16_lookup_pair_streaming(table, in + s, value + s, derivative + s, c);
    });
    return {std::move(y), std::move(d)};
  }
  Array d = z.owns_buffer_alone() ? z : Array::empty(z.shape(), z.dtype());
  od::for_chunks(z.numel(), [&](std::int64_t s, std::int64_t c) {
    alignas(64) float sz[od::kChunk], sy[od::kChunk], sd[od::kChunk], u[od::kChunk];
    const std::int64_t p = od::whole_packets(c);
    const float* pz = od::padded_view(od::f32_view(z, s, c, sz), c, sz);
    float* py = p == c ? od::f32_target(y, s, sy) : sy;
    float* pd = p == c ? od::f32_target(d, s, sd) : sd;
    am::value_and_derivative(act, pz, py, pd, u, p);
    od::commit_padded(y, s, c, py);
    od::commit_padded(d, s, c, pd);
  });
  return {std::move(y), std::move(d)};
}

// acc[j] += row[j] (distinct arrays), vectorised: each column's sum keeps its order.
void add_row(float* __restrict acc, const float* __restrict row, std::int64_t n) {
  for (std::int64_t j = 0; j < n; ++j) acc[j] += row[j];
}

// One row of the backward pass straight from storage, for g, v and g2 of one dtype (float32 or
// bf16): each element widened to float32; g itself (Kind::sum), g * d for a kept derivative
// (Kind::product) or relu's select from its output (Kind::relu); with Sum added unrounded to the
// bias sums `acc`, and (unless Kind::sum) written to out, rounded once in bf16. derivative_row's
// arithmetic and the general path's roundings in one vectorised loop, without scratch rows.
enum class RowKind { sum, product, relu };
inline float widen(float v) { return v; }
inline float widen(bfloat16 v) { return static_cast<float>(v); }
inline void store(float* out, float v) { *out = v; }
inline void store(bfloat16* out, float v) { out->bits = bfloat16::round_bits(v); }
template <class T, bool Sum, RowKind Kind>
void storage_row(const T* g, const T* v, T* out, float* acc, std::int64_t n) {
  // out may be g itself: element j is read before it is written, no other overlap (so the compiler
  // may vectorise without its runtime overlap check, which exact aliasing would fail).
#if defined(__clang__)
#pragma clang loop vectorize(assume_safety)
#elif defined(__GNUC__)
#pragma GCC ivdep
#endif
  for (std::int64_t j = 0; j < n; ++j) {
    const float gj = widen(g[j]);
    float o = gj;
    if constexpr (Kind == RowKind::product) o = gj * widen(v[j]);
    if constexpr (Kind == RowKind::relu) o = widen(v[j]) > 0.0f ? gj : 0.0f;
    if constexpr (Sum) acc[j] += o;
    if constexpr (Kind != RowKind::sum) store(out + j, o);
  }
}
template <class T, RowKind Kind>
void storage_row(const T* g, const T* v, T* out, float* acc, std::int64_t n) {
  if (acc != nullptr) storage_row<T, true, Kind>(g, v, out, acc, n);
  else storage_row<T, false, Kind>(g, v, out, acc, n);
}
// Rows [begin, end) of a pass from storage (see storage_row), rows n wide.
template <class T>
void storage_rows(RowKind kind, const T* g, const T* v, T* out, float* acc, std::int64_t begin, std::int64_t end,
                  std::int64_t n) {
  for (std::int64_t r = begin; r < end; ++r) {
    const T* gr = g + r * n;
    const T* vr = v == nullptr ? nullptr : v + r * n;
    T* o = out == nullptr ? nullptr : out + r * n;
    switch (kind) {
      case RowKind::sum: storage_row<T, RowKind::sum>(gr, vr, o, acc, n); break;
      case RowKind::product: storage_row<T, RowKind::product>(gr, vr, o, acc, n); break;
      case RowKind::relu: storage_row<T, RowKind::relu>(gr, vr, o, acc, n); break;
    }
  }
}

// The bias gradient from the blocks' column sums [blocks, n]: added in block order in float32,
// rounded once to `dtype`.
Array column_total(const Array& partial, DType dtype) {
  const std::int64_t blocks = partial.dim(0), n = partial.dim(1);
  Array sum = Array::zeros(Shape{n}, DType::f32);
  float* s = sum.mutable_data();
  const float* sums = partial.data();
  for (std::int64_t b = 0; b < blocks; ++b) add_row(s, sums + b * n, n);
  return dtype == DType::f32 ? sum : astype(sum, dtype);
}

// The backward pass over the cotangent g [M, N]: g2 = g * act'(x) from what the op kept, `v` (see
// derivative_row; g itself for none; written over g when `in_place`), and, when `bias_dtype` is
// given, the column sums of g2 (the bias gradient, summed in float32 and rounded once; in bf16 it
// sums g2 before g2 is rounded, while the products read the rounded g2).
std::pair<Array, Array> cotangent_pass(Array g, const Array& v, Activation act, std::optional<DType> bias_dtype,
                                       bool in_place) {
  const std::int64_t n = g.dim(-1), m = n == 0 ? 0 : g.numel() / n;
  const std::int64_t p = od::whole_packets(n);
  const bool write = act != Activation::none;
  if (!write && !bias_dtype) return {std::move(g), Array()};  // nothing to compute
  Array g2 = !write ? g : in_place ? g : Array::empty(g.shape(), g.dtype());
  // From storage in one loop per row (storage_rows) when g, v and g2 share a dtype and the
  // activation's backward is a product with a kept derivative, relu's select, or nothing (the bias
  // sum alone); tanh and sigmoid take the general path (their Eigen expressions, the activation ops'
  // own arithmetic).
  const DType dt = g.dtype();
  const std::optional<RowKind> kind = !write                          ? std::optional<RowKind>(RowKind::sum)
                                      : am::derivative_from_input(act) ? std::optional<RowKind>(RowKind::product)
                                      : act == Activation::relu       ? std::optional<RowKind>(RowKind::relu)
                                                                      : std::nullopt;
  const bool from_storage = kind && g2.dtype() == dt && (!write || v.dtype() == dt);
  // (raw pointers fetched before the region: the accessors check)
  const void* graw = from_storage ? g.raw() : nullptr;
  const void* vraw = from_storage && write ? v.raw() : nullptr;
  void* g2raw = from_storage && write ? g2.mutable_raw() : nullptr;
  const std::int64_t block_rows = rows_per_block(act), blocks = (m + block_rows - 1) / block_rows;
  // The blocks' column sums (an Array: counted by memory accounting and the remat planner).
  Array partial = bias_dtype ? Array::empty(Shape{blocks, n}, DType::f32) : Array();
  const int threads = m * n >= ops::detail::kParallelMin ? team_size() : 1;
  // Per thread: g's row, v's row, the result row (each p floats, 64-byte aligned: Eigen computes the
  // elements before a destination's first aligned one without vectors, which would change their
  // last bits), allocated before the region.
  ops::detail::AlignedScratch scratch(from_storage ? 0 : static_cast<std::int64_t>(threads) * 3 * p);
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
#endif
  for (std::int64_t b = 0; b < blocks; ++b) {
    linum::detail::enter_compute();
#ifdef _OPENMP
    const int t = omp_get_thread_num();
#else
    const int t = 0;
#endif
    float* acc = bias_dtype ? partial.mutable_data() + b * n : nullptr;
    if (acc != nullptr) std::fill(acc, acc + n, 0.0f);
    const std::int64_t end = std::min(m, (b + 1) * block_rows);
    if (from_storage) {
      if (dt == DType::f32)
        storage_rows(*kind, static_cast<const float*>(graw), static_cast<const float*>(vraw), static_cast<float*>(g2raw), acc,
                     b * block_rows, end, n);
      else
        storage_rows(*kind, static_cast<const bfloat16*>(graw), static_cast<const bfloat16*>(vraw),
                     static_cast<bfloat16*>(g2raw), acc, b * block_rows, end, n);
      continue;
    }
    float* sg = scratch.data() + static_cast<std::size_t>(t) * 3 * p;
    float* sv = sg + p;
    float* so = sv + p;
    for (std::int64_t r = b * block_rows; r < end; ++r) {
      const float* gr = row_f32(g, r, n, sg);
      const float* out = gr;
      if (write) {
        derivative_row(act, gr, row_f32(v, r, n, sv), so, p);
        out = so;
        if (g2.dtype() == DType::f32) std::memcpy(g2.mutable_data() + r * n, so, static_cast<std::size_t>(n) * sizeof(float));
        else ops::detail::f32_commit(g2, r * n, n, so);
      }
      if (acc != nullptr) add_row(acc, out, n);
    }
  }
  Array db = bias_dtype ? column_total(partial, *bias_dtype) : Array();
  return {std::move(g2), std::move(db)};
}

// The layer's first step backward, g2 and the bias gradient: from the cotangent as it arrived with
// its cotangent pass already done by the layer after (input_gradient), or by cotangent_pass.
std::pair<Array, Array> layer_cotangent(Cotangents& c, Array g, const Array& v, Activation act,
                                        std::optional<DType> bias_dtype, bool in_place) {
  if (!c.prologue_applied()) return cotangent_pass(std::move(g), v, act, bias_dtype, in_place);
  Array db;
  if (bias_dtype) {
    const Array sums = c.take_prologue_sums();
    if (!sums.defined() || sums.rank() != 2 || sums.dim(1) != g.dim(-1))
      throw AutodiffError("linear: the cotangent came without the column sums its bias gradient needs (a bug; please report it)");
    db = column_total(sums, *bias_dtype);
  }
  return {std::move(g), std::move(db)};
}

// What the layer's rule does first with its cotangent, offered to the op computing it (a layer after
// it, whose input gradient then multiplies by the kept derivative, residual 3, or for relu selects by
// the kept output, residual 3 too, and sums its columns inside its product: input_gradient).
void declare_cotangent_pass(const Array& y, Activation act, bool bias_needs_grad) {
  if (!offers_cotangent_pass(act) || y.node() == nullptr || y.node()->op() != ops::kind::linear) return;
  using Kind = autodiff::CotangentPrologue::Kind;
  y.node()->set_cotangent_prologue(autodiff::CotangentPrologue{
      .derivative = 3, .column_sums = bias_needs_grad, .kind = act == Activation::relu ? Kind::select_positive : Kind::multiply});
}

// dx = g2 W^T [rows, k] as input 0's cotangent; when the layer before is a fused linear layer that
// offers its cotangent pass (its only consumer is this op) and the product runs on a panel kernel
// (bf16 or float32), with that pass done in the product's epilogue: its derivative multiplied in
// and its bias sums taken, in its own pass's blocks (the same bits: cotangent_pass over tiles of
// kernels::kScaledSumRows rows). That saves the layer before a pass reading two arrays of the
// layer's width and writing one, and a parallel region.
void input_gradient(Cotangents& c, const Array& g2, const Array& w, const Shape& x_shape) {
  if (std::optional<Cotangents::PrologueOffer> offer = c.producer_prologue(0)) {
    // (the kept array, of x's size, as [rows, k]: relu keeps its output at the layer's own shape)
    const Array d = offer->derivative->with_shape(Shape{g2.dim(0), w.dim(0)});
    if (kernels::scaled_product_bt_runs(g2, w, d)) {
      Array sums;
      Array dx = kernels::scaled_product_bt(g2, w, d, offer->column_sums ? &sums : nullptr,
                                            offer->kind == autodiff::CotangentPrologue::Kind::select_positive);
      c.set_with_prologue(0, dx.with_shape(x_shape), std::move(sums));
      return;
    }
  }
  c.set(0, kernels::batched_gemm(g2, w, false, true).with_shape(x_shape));
}

// The same computation as separate differentiable ops (vmap; create-graph rules).
Array composed(const Array& x, const Array& kernel, const Array& bias, Activation act) {
  Array y = dot_general(x, kernel, DotDims{.lhs_contracting = {x.rank() - 1}, .rhs_contracting = {0}});
  if (bias.defined()) y = add(y, bias);
  return activate(y, act);
}

// The casts of a bf16 computation on float32 parameters folded into the op (linear with a dtype,
// linear.hpp): x bf16 [..., k] (rows rows), kernel float32 [k, n], bias float32 [n] or undefined, an
// activation that keeps its derivative. On the bf16 panel kernel the kernel is rounded while the
// product packs it; elsewhere it is rounded first and the product is linear's. It keeps x, the
// rounded parameters (not the float32 ones: hooks that move or regather what ops keep see only what
// the rule reads) and the derivative. Which kernel runs is chosen inside the forward pass, so the
// graph is the same whatever the engine.
Array linear_casts_folded(const Array& x, std::int64_t rows, const Array& kernel, const Array& bias, Activation act,
                          const Shape& out_shape) {
  const std::int64_t k = kernel.dim(0), n = kernel.dim(1);
  const Shape rows_shape{rows, n}, x2_shape{rows, k};
  const Array x2 = x.with_shape(x2_shape);
  const bool has_bias = bias.defined();
  // (rounded outside the graph: the rule returns the parameters' gradients in float32 itself)
  const Array bias16 = has_bias ? astype(bias.detached(), DType::bf16) : Array();
  auto forward = [&](Residuals& r) {
    Array kernel16, y, d;
    if (pairs_from_table(DType::bf16, rows * n) && kernels::bf16_panels_take(k, n)) {
      y = Array::empty(rows_shape, DType::bf16);
      d = Array::empty(rows_shape, DType::bf16);
      kernels::gemm_bias_pairs_f32_kernel(x2, kernel, bias16, pair_table(act), kernel16, y, d);
    } else {  // linear's own path on the rounded parameters
      kernel16 = astype(kernel.detached(), DType::bf16);
      Array z = has_bias ? kernels::gemm_bias(x2, kernel16, bias16) : kernels::batched_gemm(x2, kernel16, false, false);
      std::tie(y, d) = value_and_derivative(std::move(z), act);
    }
    r.keep(x, kernel16, bias16, d);
    return y.with_shape(out_shape);
  };
  auto rule = autodiff::higher_order([act, has_bias, rows_shape, x2_shape, out_shape, x_shape = x.shape()](
                                         Cotangents& c, autodiff::Saved s) {
    if (autodiff::creating_graph()) {
      // The casts and linear in differentiable ops, on the parameters rebuilt from their rounded
      // copies (widened: rounding them gives those copies back, and a cast's derivative does not
      // depend on its input), linked to the parameters' producers.
      std::vector<Array> inputs{s[0], c.linked_input(1, astype(s[1], DType::f32))};
      if (has_bias) inputs.push_back(c.linked_input(2, astype(s[2], DType::f32)));
      autodiff::composite_rule(c, std::move(inputs), [act, has_bias, out_shape](const std::vector<Array>& in) {
        const Array b = has_bias ? astype(in[2], DType::bf16) : Array();
        return std::vector<Array>{reshape(composed(in[0], astype(in[1], DType::bf16), b, act), out_shape.vec())};
      });
      return;
    }
    Array g = c.take_out(0).with_shape(rows_shape);
    const bool bias_needed = has_bias && c.needs(2);
    const bool in_place = g.owns_buffer_alone();
    auto [g2, db] = layer_cotangent(c, std::move(g), s[3], act,
                                    bias_needed ? std::optional<DType>(DType::bf16) : std::nullopt, in_place);
    if (c.needs(0)) input_gradient(c, g2, s[1], x_shape);                                // dx = g2 W^T
    if (c.needs(1)) c.set(1, kernels::transposed_product_f32(s[0].with_shape(x2_shape), g2));  // dW = x^T g2, widened
    if (bias_needed) c.set(2, astype(db, DType::f32));
  });
  Array y = has_bias ? autodiff::primitive(ops::kind::linear, {&x, &kernel, &bias}, forward, std::move(rule))
                     : autodiff::primitive(ops::kind::linear, {&x, &kernel}, forward, std::move(rule));
  declare_cotangent_pass(y, act, has_bias && bias.node() != nullptr);
  return y;
}
}  // namespace

std::string_view activation_name(Activation a) {
  for (const auto& [act, name] : kNames)
    if (act == a) return name;
  return "unknown";
}

Activation activation_from_name(std::string_view name) {
  std::string known;
  for (const auto& [act, n] : kNames) {
    if (n == name) return act;
    known += (known.empty() ? "" : ", ") + std::string(n);
  }
  throw ValueError(detail::cat("unknown activation '", name, "' (one of: ", known, ")"));
}

Array activate(const Array& x, Activation act) {
  switch (act) {
    case Activation::none: return x;
    case Activation::relu: return relu(x);
    case Activation::gelu: return gelu(x, true);
    case Activation::gelu_exact: return gelu(x, false);
    case Activation::silu: return silu(x);
    case Activation::tanh: return tanh(x);
    case Activation::sigmoid: return sigmoid(x);
  }
  throw ValueError("activate: unknown activation");
}

Array linear(const Array& x_in, const Array& kernel_in, const Array& bias_in, Activation act) {
  ops::detail::require_float(x_in, "linear");
  ops::detail::require_float(kernel_in, "linear");
  if (bias_in.defined()) ops::detail::require_float(bias_in, "linear");
  auto shapes = [&] { return ops::detail::shapes_str({&x_in, &kernel_in, &bias_in}); };
  if (x_in.rank() < 1 || kernel_in.rank() != 2)
    throw ShapeError(detail::cat("linear: x must have at least one axis and the kernel two ([in, out]); got ", shapes()));
  if (x_in.dim(-1) != kernel_in.dim(0))
    throw ShapeError(detail::cat("linear: x's last axis (", x_in.dim(-1), ") must equal the kernel's first (",
                                 kernel_in.dim(0), "); got ", shapes()));
  if (bias_in.defined() && !(bias_in.shape() == Shape{kernel_in.dim(1)}))
    throw ShapeError(detail::cat("linear: the bias must have shape (", kernel_in.dim(1), ",), one entry per output; got ",
                                 shapes()));
  // One dtype for all three (JAX's promotion; a bf16 input with a float32 kernel computes in float32).
  DType t = promote_types(x_in.dtype(), x_in.weak_type(), kernel_in.dtype(), kernel_in.weak_type());
  if (bias_in.defined()) t = promote_types(t, false, bias_in.dtype(), bias_in.weak_type());
  const Array x = astype(x_in, t), kernel = astype(kernel_in, t);
  const Array bias = bias_in.defined() ? astype(bias_in, t) : Array();
  if (x.batched() || kernel.batched() || bias.batched()) [[unlikely]]
    return composed(x, kernel, bias, act);

  const std::int64_t k = kernel.dim(0), n = kernel.dim(1);
  std::vector<std::int64_t> out = x.shape().vec();
  out.back() = n;
  const Shape out_shape(out);
  std::int64_t rows = 1;  // explicit (not -1): a zero-width input (k = 0) has rows too
  for (int i = 0; i + 1 < x.rank(); ++i) rows *= x.dim(i);
  // The op's input is x itself (a view of it [rows, k] for the kernels, no reshape op between it and
  // its producer: that layer's cotangent pass can be done by this one's input gradient).
  const Shape x2_shape{rows, k}, rows_shape{rows, n};
  const Array x2 = x.with_shape(x2_shape);
  const bool has_bias = bias.defined();
  const bool keep_derivative = am::derivative_from_input(act);  // gelu, gelu_exact, silu (any float dtype)
  auto forward = [&](Residuals& r) {
    if (r.recording() && keep_derivative && pairs_from_table(t, rows * n) && kernels::uses_bf16_panels(x2, false, kernel, false)) {
      // bf16 on the own product kernel: the pairs looked up inside the product (the same bits as
      // the product, then value_and_derivative's table).
      Array y = Array::empty(rows_shape, t), d = Array::empty(rows_shape, t);
      kernels::gemm_bias_pairs(x2, kernel, has_bias ? bias : Array(), pair_table(act), y, d);
      r.keep(x, kernel, has_bias ? bias : Array(), d);
      return y.with_shape(out_shape);
    }
    Array z = has_bias ? kernels::gemm_bias(x2, kernel, bias) : kernels::batched_gemm(x2, kernel, false, false);
    // The output at its own shape, so a kept output is recognised as the op's output (remat
    // policies, saved-value hooks). Create-graph rules recompute from x, W and b.
    if (r.recording() && keep_derivative) {
      // gelu, silu: the value and the derivative from one evaluation of the activation's term; the
      // backward pass reads the derivative (kept in z's dtype; value_and_derivative says where) and
      // multiplies. In bf16 the kept derivative is rounded, one rounding more than the unfused ops
      // make (they compute it in float32 in their backward rule): a second tanh per element in every
      // backward pass cost about 3% of a bf16 MLP step (24 x 512, batch 2048), the rounding at most
      // 2^-8 relative.
      auto [y, d] = value_and_derivative(std::move(z), act);
      r.keep(x, kernel, has_bias ? bias : Array(), d);
      return y.with_shape(out_shape);
    }
    const Array y = activate(z, act).with_shape(out_shape);  // recording is off here: the kernel alone
    if (r.recording()) {
      if (act == Activation::none) r.keep(kernel.node() ? x : Array(), x.node() ? kernel : Array());
      else r.keep(x, kernel, has_bias ? bias : Array(), y);  // relu, tanh, sigmoid: from the output
    }
    return y;
  };
  auto rule = autodiff::higher_order([act, has_bias, rows_shape, x2_shape, out_shape, x_shape = x.shape()](
                                         Cotangents& c, autodiff::Saved s) {
    if (autodiff::creating_graph()) {  // the same function in differentiable ops
      if (act == Activation::none) {
        const Array g = reshape(c.out(), rows_shape.vec());
        if (c.needs(0))
          c.set(0, reshape(dot_general(g, s[1], DotDims{.lhs_contracting = {1}, .rhs_contracting = {1}}), x_shape.vec()));
        if (c.needs(1))
          c.set(1, dot_general(reshape(s[0], x2_shape.vec()), g, DotDims{.lhs_contracting = {0}, .rhs_contracting = {0}}));
        if (has_bias && c.needs(2)) c.set(2, sum(g, {0}));
        return;
      }
      std::vector<Array> inputs{s[0], s[1]};
      if (has_bias) inputs.push_back(s[2]);
      autodiff::composite_rule(c, std::move(inputs), [act, has_bias, out_shape](const std::vector<Array>& in) {
        return std::vector<Array>{reshape(composed(in[0], in[1], has_bias ? in[2] : Array(), act), out_shape.vec())};
      });
      return;
    }
    Array g = c.take_out(0).with_shape(rows_shape);
    const std::optional<DType> bias_dtype = has_bias && c.needs(2) ? std::optional<DType>(g.dtype()) : std::nullopt;
    const bool in_place = act != Activation::none && g.owns_buffer_alone();
    auto [g2, db] = layer_cotangent(c, std::move(g), act == Activation::none ? Array() : s[3], act, bias_dtype, in_place);
    if (c.needs(0)) input_gradient(c, g2, s[1], x_shape);                     // dx = g2 W^T
    if (c.needs(1)) c.set(1, kernels::batched_gemm(s[0].with_shape(x2_shape), g2, true, false));  // dW = x^T g2
    if (bias_dtype) c.set(2, std::move(db));
  });
  Array y = has_bias ? autodiff::primitive(ops::kind::linear, {&x, &kernel, &bias}, forward, std::move(rule))
                     : autodiff::primitive(ops::kind::linear, {&x, &kernel}, forward, std::move(rule));
  // (residual 3, the kept derivative or relu's output, exists when the forward kept one: a recorded layer)
  declare_cotangent_pass(y, act, has_bias && bias.node() != nullptr);
  return y;
}

Array linear(const Array& x_in, const Array& kernel, const Array& bias, Activation act, std::optional<DType> dtype) {
  if (!dtype) return linear(x_in, kernel, bias, act);
  if (!is_floating(*dtype))
    throw ValueError(detail::cat("linear: the computation dtype must be a float dtype (f32 or bf16); got ", dtype_name(*dtype)));
  const Array x = astype(x_in, *dtype);  // (integer inputs too, as Flax's promote_dtype)
  // The casts folded into the op: float32 parameters, a bf16 computation being differentiated, an
  // activation with a kept derivative, and shapes that linear accepts (otherwise the ops below say
  // what is wrong). Not the engine: it picks kernels inside the op, never which ops record.
  const bool params_f32 = kernel.dtype() == DType::f32 && (!bias.defined() || bias.dtype() == DType::f32);
  if (*dtype == DType::bf16 && params_f32 && x.rank() >= 1 && kernel.rank() == 2 && x.dim(-1) == kernel.dim(0) &&
      (!bias.defined() || bias.shape() == Shape{kernel.dim(1)}) && !x.batched() && !kernel.batched() && !bias.batched() &&
      am::derivative_from_input(act) && autodiff::is_recording() &&
      (x.node() != nullptr || kernel.node() != nullptr || bias.node() != nullptr)) {
    std::int64_t rows = 1;
    for (int i = 0; i + 1 < x.rank(); ++i) rows *= x.dim(i);
    std::vector<std::int64_t> out = x.shape().vec();
    out.back() = kernel.dim(1);
    return linear_casts_folded(x, rows, kernel, bias, act, Shape(out));
  }
  return linear(x, astype(kernel, *dtype), bias.defined() ? astype(bias, *dtype) : Array(), act);
}

}  // namespace linum
