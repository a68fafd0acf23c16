// Elementwise ops. Each op's backward rule follows its forward and captures only what it needs.
#include <linum/core/fp_mode.hpp>
#include <linum/core/threading.hpp>
#include <linum/core/autodiff/primitive.hpp>
#include <linum/core/ops/batching.hpp>
#include <linum/core/ops/elementwise.hpp>
#include <linum/core/ops/kernel_util.hpp>
#include <linum/core/ops/activation_math_internal.hpp>
#include <linum/core/ops/bf16_table_internal.hpp>
#include <linum/core/ops/reduce.hpp>

#include <Eigen/Core>
#include <unsupported/Eigen/SpecialFunctions>

#include <bit>
#include <cmath>
#include <cstring>
#include <optional>

namespace linum {
namespace {

namespace activation_math = ops::detail::activation_math;

using autodiff::Cotangents;
using autodiff::needs_grad;
using ops::detail::broadcast_shapes;
using ops::detail::for_blocks;
using ops::detail::sum_to;
using Vec = Eigen::Map<Eigen::ArrayXf, Eigen::Aligned64>;
using CVec = Eigen::Map<const Eigen::ArrayXf>;
using OVec = Eigen::Map<Eigen::ArrayXf>;

// ---- kernels ---------------------------------------------------------------------------------
// Every kernel computes in float32. bf16 operands are widened a chunk at a time into stack scratch
// and bf16 results rounded back per chunk, so a bf16 op reads and writes 2 bytes per element and
// equals the float32 op rounded once. float32 operands are used in place (no copies).

using ops::detail::commit_padded;
using ops::detail::f32_at;
using ops::detail::f32_commit;
using ops::detail::f32_target;
using ops::detail::f32_view;
using ops::detail::for_chunks;
using ops::detail::kChunk;
using ops::detail::padded_view;
using ops::detail::require_float;
using ops::detail::whole_packets;

// The dtype of a binary op's result under JAX's promotion rules (weak scalars adopt the other side).
DType result_dtype(const Array& a, const Array& b) {
  return promote_types(a.dtype(), a.weak_type(), b.dtype(), b.weak_type());
}

// One machine-code copy of a function per instantiation: neither inlined nor cloned (see
// binary_floats and apply_unary for why).
#if defined(__GNUC__) && !defined(__clang__)
#define LINUM_ONE_COPY __attribute__((noinline, noclone))
#else
#define LINUM_ONE_COPY __attribute__((noinline))
#endif

// o[i] = f(a[i], b[i]) for i < n, where an operand that does not step is one value, broadcast. A
// loop per stepping pattern, so the compiler vectorises each. One copy per op, which every dtype's
// run goes through: a bf16 op is then the float32 op's instructions on the widened values, so its
// bits are the float32 result rounded also with subnormals flushed (when each combination of
// dtypes had its own loops, bf16 maximum and minimum selected a subnormal's bits where float32's
// maxps gave 0), and an op is 4 loops of machine code instead of 64 (core/ops/elementwise.cpp
// compiled in 55 s instead of 137 s, to 1.0 MB of code instead of 2.6 MB). An element may fall in
// the vectorised body on one path and in the scalar tail on another (float32 runs are up to 16384
// elements, bf16 ones 512): both compute the same for these ops (maxss and maxps, cmpss and cmpps
// read subnormals alike; pow stays a scalar call), which -ffast-math would not promise.
template <class F>
LINUM_ONE_COPY void binary_floats(F& f, const float* a, bool a_steps, const float* b, bool b_steps, float* __restrict o,
                                  std::int64_t n) {
  if (a_steps && b_steps) {
    for (std::int64_t i = 0; i < n; ++i) o[i] = f(a[i], b[i]);
  } else if (a_steps) {
    const float vb = b[0];
    for (std::int64_t i = 0; i < n; ++i) o[i] = f(a[i], vb);
  } else if (b_steps) {
    const float va = a[0];
    for (std::int64_t i = 0; i < n; ++i) o[i] = f(va, b[i]);
  } else {
    const float v = f(a[0], b[0]);
    for (std::int64_t i = 0; i < n; ++i) o[i] = v;
  }
}

// Scratch for binary runs with bf16 operands or results: 512-element runs of each operand widened,
// and of the result before rounding (6 KB: they stay in L1 with the operands' lines). A widened
// operand row is kept for the next run: a broadcast row (a bias) is widened once, not per row.
struct WidenedRuns {
  static constexpr std::int64_t kRun = 512;
  alignas(64) float a[kRun], b[kRun], out[kRun];
  const void* a_row = nullptr;  // the bf16 row whose widened values a holds, if any
  const void* b_row = nullptr;
};

// Widens elements [start, start + n) of x (n <= kRun) into run, or reuses them when run already
// holds that row (whole-row runs only). float32 is read in place.
inline const float* widened_run(const Array& x, std::int64_t start, std::int64_t n, bool whole_row, float* run, const void*& held) {
  if (x.dtype() == DType::f32) return static_cast<const float*>(x.raw()) + start;
  const void* row = static_cast<const bfloat16*>(x.raw()) + start;
  if (whole_row && held == row) return run;
  held = whole_row ? row : nullptr;
  return f32_view(x, start, n, run);
}

// out[o_start, o_start + n) = f(a, b) over a run of n elements when an operand or the result is
// bf16: a's run starts at a_start and steps by one, or is its element a_start broadcast (the same
// for b). bf16 operands are widened exactly, a run at a time, and the result rounded once per run
// (2 bytes read and written per element). Not inlined: one copy per op.
template <class F>
LINUM_ONE_COPY void binary_run_widened(F& f, const Array& a, std::int64_t a_start, bool a_steps, const Array& b,
                                       std::int64_t b_start, bool b_steps, Array& out, std::int64_t o_start, std::int64_t n,
                                       WidenedRuns& w) {
  constexpr std::int64_t kRun = WidenedRuns::kRun;
  const bool whole_row = n <= kRun;
  for (std::int64_t x = 0; x < n; x += kRun) {
    const std::int64_t c = std::min(kRun, n - x);
    const float* pa = a_steps ? widened_run(a, a_start + x, c, whole_row, w.a, w.a_row) : (w.a[0] = f32_at(a, a_start), w.a);
    const float* pb = b_steps ? widened_run(b, b_start + x, c, whole_row, w.b, w.b_row) : (w.b[0] = f32_at(b, b_start), w.b);
    float* po = f32_target(out, o_start + x, w.out);
    binary_floats(f, pa, a_steps, pb, b_steps, po, c);
    f32_commit(out, o_start + x, c, po);
  }
}

// out[o_start, o_start + n) = f(a, b) (see binary_run_widened): float32 operands and results in
// place, anything else through `w`.
template <class F>
inline void binary_run(F& f, const Array& a, std::int64_t a_start, bool a_steps, const Array& b, std::int64_t b_start,
                       bool b_steps, Array& out, std::int64_t o_start, std::int64_t n, WidenedRuns* w) {
  if (w == nullptr) {
    binary_floats(f, static_cast<const float*>(a.raw()) + a_start, a_steps, static_cast<const float*>(b.raw()) + b_start,
                  b_steps, static_cast<float*>(out.mutable_raw()) + o_start, n);
  } else {
    binary_run_widened(f, a, a_start, a_steps, b, b_start, b_steps, out, o_start, n, *w);
  }
}

// out[i] = f(a[i], b[i]) with NumPy broadcasting; float32 or bf16 in, `out_dtype` out (the
// promoted dtype unless given). Computed in float32, rounded once on store.
template <class F>
Array binary_kernel(const Array& a, const Array& b, const char* op, F f, std::optional<DType> out_dtype = std::nullopt) {
  require_float(a, op);
  require_float(b, op);
  const Shape out_shape = broadcast_shapes(a.shape(), b.shape(), op);
  Array out = Array::empty(out_shape, out_dtype ? *out_dtype : result_dtype(a, b));
  const std::int64_t n = out_shape.numel();
  const bool all_f32 = a.dtype() == DType::f32 && b.dtype() == DType::f32 && out.dtype() == DType::f32;
  if ((a.numel() == n || a.numel() == 1) && (b.numel() == n || b.numel() == 1)) {
    const bool a_steps = a.numel() == n && n > 1, b_steps = b.numel() == n && n > 1;
    auto widened_block = [&](std::int64_t s, std::int64_t c) __attribute__((noinline)) {
      WidenedRuns w;
      binary_run(f, a, a_steps ? s : 0, a_steps, b, b_steps ? s : 0, b_steps, out, s, c, &w);
    };
    for_blocks(n, [&](std::int64_t s, std::int64_t c) {
      if (all_f32) binary_run(f, a, a_steps ? s : 0, a_steps, b, b_steps ? s : 0, b_steps, out, s, c, nullptr);
      else widened_block(s, c);
    });
    return out;
  }
  // General case: walk the output row by row (rows = all axes but the last). Along the last axis an
  // operand either advances (step 1) or is broadcast (step 0).
  const int rank = out_shape.rank();
  std::array<std::int64_t, Shape::kMaxRank> sa{}, sb{};
  {
    auto stra = a.shape().strides();
    auto strb = b.shape().strides();
    for (int i = 0; i < rank; ++i) {
      const int ia = i - (rank - a.rank());
      const int ib = i - (rank - b.rank());
      sa[i] = (ia >= 0 && a.shape()[ia] != 1) ? stra[ia] : 0;
      sb[i] = (ib >= 0 && b.shape()[ib] != 1) ? strb[ib] : 0;
    }
  }
  const std::int64_t inner = out_shape[rank - 1];
  const std::int64_t rows = n / std::max<std::int64_t>(inner, 1);
  const bool a_steps = sa[rank - 1] != 0, b_steps = sb[rank - 1] != 0;
  auto rows_with = [&](std::int64_t r0, std::int64_t r1, WidenedRuns* w) {
    for (std::int64_t r = r0; r < r1; ++r) {
      std::int64_t rem = r, oa = 0, ob = 0;
      for (int d = rank - 2; d >= 0; --d) {
        const std::int64_t idx = rem % out_shape[d];
        rem /= out_shape[d];
        oa += idx * sa[d];
        ob += idx * sb[d];
      }
      binary_run(f, a, oa, a_steps, b, ob, b_steps, out, r * inner, inner, w);
    }
  };
  // The scratch lives in its own frame, which float32 rows never enter.
  auto widened_rows = [&](std::int64_t r0, std::int64_t r1) __attribute__((noinline)) {
    WidenedRuns w;  // one per thread's block of rows, so a broadcast row is widened once per block
    rows_with(r0, r1, &w);
  };
  auto do_rows = [&](std::int64_t r0, std::int64_t r1) {
    if (all_f32) rows_with(r0, r1, nullptr);
    else widened_rows(r0, r1);
  };
  // Blocks of whole rows, about kBlock elements each, one contiguous run per thread ("Contiguous runs" in kernel_util.hpp).
  const std::int64_t rows_per_block = std::max<std::int64_t>(1, ops::detail::kBlock / std::max<std::int64_t>(inner, 1));
  const std::int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  if (n >= ops::detail::kParallelMin && blocks > 1) {
#pragma omp parallel for schedule(static) num_threads(linum::team_size())
    for (std::int64_t blk = 0; blk < blocks; ++blk) {
      linum::detail::enter_compute();
      do_rows(blk * rows_per_block, std::min(rows, (blk + 1) * rows_per_block));
    }
  } else {
    do_rows(0, rows);
  }
  return out;
}

// f on p floats (a whole number of packets): f(CVec in) -> expression, or f(CVec in, OVec& out)
// writing them itself. Neither inlined nor cloned: one copy of each function's machine code computes
// both its tables and its results, so they agree to the NaN payload (in two copies the compiler may
// order an addition's operands differently, and x86 returns the first operand's NaN).
template <class F>
LINUM_ONE_COPY void apply_unary(F& f, const float* px, float* po, std::int64_t p) {
  if constexpr (std::is_invocable_v<F&, const CVec&, OVec&>) {
    OVec o(po, p);
    f(CVec(px, p), o);
  } else {
    OVec(po, p) = f(CVec(px, p));
  }
}

// A costly function of one float (a transcendental): unary_kernel reads its results on bf16 arrays
// from a table of all 65536 (ops/bf16_table_internal.hpp), the same bits as computing them. The table
// belongs to F's type, so F must carry no state (a lambda without captures, an empty function object).
template <class F>
struct Tabulated {
  static_assert(std::is_empty_v<F>, "a tabulated function must carry no state (a lambda without captures)");
  F f;
};
template <class F>
Tabulated(F) -> Tabulated<F>;
template <class F>
constexpr bool kIsTabulated = false;
template <class F>
constexpr bool kIsTabulated<Tabulated<F>> = true;

// out = f(x) using Eigen's vectorised array expressions (see apply_unary). The result has x's dtype.
template <class F>
Array unary_kernel(const Array& x, const char* op, F f) {
  if constexpr (kIsTabulated<F>) {
    if (x.dtype() != DType::bf16 || x.numel() < ops::detail::kBf16TableMinElements) return unary_kernel(x, op, f.f);
    static ops::detail::Bf16Tables<bfloat16> tables;  // one set per function (F's type)
    ops::detail::g_bf16_table_reads.fetch_add(1, std::memory_order_relaxed);
    Array out = Array::empty(x.shape(), x.dtype());
    const auto* in = static_cast<const bfloat16*>(x.raw());
    auto* o = static_cast<bfloat16*>(out.mutable_raw());
    for_chunks(x.numel(), [&](std::int64_t s, std::int64_t c) {
      const bfloat16* table = tables.get([&f](const float* v, bfloat16* entries, std::int64_t n) {
        alignas(64) float computed[kChunk];
        apply_unary(f.f, v, computed, n);
        f32_to_bf16(computed, entries, n);
      });
      ops::detail::bf16_lookup(table, in + s, o + s, c);
    });
    return out;
  } else {
    require_float(x, op);
    Array out = Array::empty(x.shape(), x.dtype());
    for_chunks(x.numel(), [&](std::int64_t s, std::int64_t c) {
      alignas(64) float sx[kChunk], so[kChunk];
      const std::int64_t p = whole_packets(c);
      const float* px = padded_view(f32_view(x, s, c, sx), c, sx);
      float* po = p == c ? f32_target(out, s, so) : so;
      apply_unary(f, px, po, p);
      commit_padded(out, s, c, po);
    });
    return out;
  }
}

// out = f(a, b) over chunks of same-shaped float arrays, written into `out` (which may be `a`'s
// buffer). A three-argument f(a, b, out) writes the chunk itself, so it can use `out` as scratch
// space (an expression returned from f must not refer to f's locals: they are gone when it is
// evaluated); `a` is then read from a copy.
template <class F>
void zip_into(Array& out, const Array& a, const Array& b, F f) {
  for_chunks(a.numel(), [&](std::int64_t s, std::int64_t c) {
    alignas(64) float sa[kChunk], sb[kChunk], so[kChunk];
    const std::int64_t p = whole_packets(c);
    const float* pb = padded_view(f32_view(b, s, c, sb), c, sb);
    float* po = p == c ? f32_target(out, s, so) : so;
    if constexpr (std::is_invocable_v<F&, const CVec&, const CVec&, OVec&>) {
      const float* pa = f32_view(a, s, c, sa);
      if (pa != sa && a.shares_buffer(out)) pa = static_cast<const float*>(std::memcpy(sa, pa, c * sizeof(float)));
      pa = padded_view(pa, c, sa);
      OVec o(po, p);
      f(CVec(pa, p), CVec(pb, p), o);
    } else {
      const float* pa = padded_view(f32_view(a, s, c, sa), c, sa);
      OVec(po, p) = f(CVec(pa, p), CVec(pb, p));  // coefficient-wise: reading a[i] before writing it is fine
    }
    commit_padded(out, s, c, po);
  });
}

// out = f(a, b) for same-shaped float arrays (used by backward rules); the result has a's dtype.
template <class F>
Array zip_kernel(const Array& a, const Array& b, F f) {
  Array out = Array::empty(a.shape(), a.dtype());
  zip_into(out, a, b, f);
  return out;
}

// The backward rule of an elementwise op: f(g, saved) -> gradient, where g is output 0's cotangent.
// The cotangent is taken from the sweep; when no other array refers to its buffer, the gradient is
// written into that buffer instead of a new one (one activation-sized buffer less at the peak).
// Create-graph mode: the gradient g * f'(saved) as one primitive running the fused kernel, so that a
// gradient which is differentiated again keeps only g (and saved, alive anyway) per op rather than
// every temporary of its formula; its own rule differentiates the formula written with ops.
template <class F, class WithOps>
Array pointwise_product(const Array& g, const Array& saved, F f, WithOps with_ops) {
  return autodiff::primitive("pointwise_grad", {&g, &saved},
                             [&](autodiff::Residuals& r) {
                               r.keep(g, saved);
                               return zip_kernel(g, saved, f);
                             },
                             autodiff::higher_order([with_ops](Cotangents& c, autodiff::Saved s) {
                               autodiff::composite_rule(c, {s[0], s[1]}, [with_ops](const std::vector<Array>& in) {
                                 return std::vector<Array>{with_ops(in[0], in[1])};
                               });
                             }));
}

// `with_ops(g, saved)` is the same gradient written with ops, for create-graph mode (the gradient
// is then differentiated again: saved is the op's input or output, linked to the graph).
template <class F, class WithOps>
Array pointwise_grad(Cotangents& c, const Array& saved, F f, WithOps with_ops) {
  if (autodiff::creating_graph()) return pointwise_product(c.out(), saved, f, with_ops);
  Array g = c.take_out(0);
  if (!g.owns_buffer_alone()) return zip_kernel(g, saved, f);
  zip_into(g, g, saved, f);
  return g.detached();
}

Array scalar(float v) { return Array::scalar(v); }

// Every op below is a primitive (core/autodiff/primitive.hpp): its forward kernel and what it keeps
// for the backward rule, then the rule.
using autodiff::Residuals;
using autodiff::primitive;
using autodiff::higher_order;

// What an elementwise op keeps for its rule: nothing, its input, or its output.
enum class Keep { nothing, input, output };

template <class F, class Rule>
Array unary_op(const char* op, const Array& x, Keep keep, F f, Rule&& rule) {
  if (x.batched()) [[unlikely]]  // vmap: the op on every example's elements at once
    return ops::batching::per_element(x, [&](const Array& p) { return unary_op(op, p, keep, f, rule); });
  return primitive(op, {&x}, [&](Residuals& r) {
    Array y = unary_kernel(x, op, f);
    if (keep == Keep::input) r.keep(x);
    else if (keep == Keep::output) r.keep(y);
    return y;
  }, autodiff::higher_order(std::forward<Rule>(rule)));
}

}  // namespace

// ---- arithmetic -----------------------------------------------------------------------------

Array add(const Array& a, const Array& b) {
  if (a.batched() || b.batched()) [[unlikely]]
    return ops::batching::broadcasting("add", {&a, &b}, [](const Array& x, const Array& y) { return add(x, y); });
  return primitive("add", {&a, &b}, [&](Residuals&) { return binary_kernel(a, b, "add", [](float x, float z) { return x + z; }); },
                   higher_order([sa = a.shape(), sb = b.shape()](Cotangents& c, autodiff::Saved) {
                     if (c.needs(0)) c.set(0, sum_to(c.out(), sa));
                     if (c.needs(1)) c.set(1, sum_to(c.out(), sb));
                   }));
}

Array sub(const Array& a, const Array& b) {
  if (a.batched() || b.batched()) [[unlikely]]
    return ops::batching::broadcasting("sub", {&a, &b}, [](const Array& x, const Array& y) { return sub(x, y); });
  return primitive("sub", {&a, &b}, [&](Residuals&) { return binary_kernel(a, b, "sub", [](float x, float z) { return x - z; }); },
                   higher_order([sa = a.shape(), sb = b.shape()](Cotangents& c, autodiff::Saved) {
                     if (c.needs(0)) c.set(0, sum_to(c.out(), sa));
                     if (c.needs(1)) c.set(1, neg(sum_to(c.out(), sb)));
                   }));
}

Array mul(const Array& a, const Array& b) {
  if (a.batched() || b.batched()) [[unlikely]]
    return ops::batching::broadcasting("mul", {&a, &b}, [](const Array& x, const Array& y) { return mul(x, y); });
  return primitive("mul", {&a, &b},
                   [&](Residuals& r) {
                     // Each operand is kept only if the *other* one needs a gradient.
                     if (r.recording()) r.keep(b.node() ? a : Array(), a.node() ? b : Array());
                     return binary_kernel(a, b, "mul", [](float x, float z) { return x * z; });
                   },
                   higher_order([sa = a.shape(), sb = b.shape()](Cotangents& c, autodiff::Saved s) {
                     if (c.needs(0)) c.set(0, sum_to(mul(c.out(), s[1]), sa));
                     if (c.needs(1)) c.set(1, sum_to(mul(c.out(), s[0]), sb));
                   }));
}

Array div(const Array& a, const Array& b) {
  if (a.batched() || b.batched()) [[unlikely]]
    return ops::batching::broadcasting("div", {&a, &b}, [](const Array& x, const Array& y) { return div(x, y); });
  return primitive("div", {&a, &b},
                   [&](Residuals& r) {
                     Array y = binary_kernel(a, b, "div", [](float x, float z) { return x / z; });
                     if (r.recording()) r.keep(b, b.node() ? y : Array());
                     return y;
                   },
                   higher_order([sa = a.shape(), sb = b.shape()](Cotangents& c, autodiff::Saved s) {
                     Array g_over_b = div(c.out(), s[0]);
                     if (c.needs(0)) c.set(0, sum_to(g_over_b, sa));
                     if (c.needs(1)) c.set(1, sum_to(neg(mul(g_over_b, s[1])), sb));  // -g a / b^2 = -(g/b) y
                   }));
}

Array pow(const Array& a, const Array& b) {
  if (a.batched() || b.batched()) [[unlikely]]
    return ops::batching::broadcasting("pow", {&a, &b}, [](const Array& x, const Array& y) { return pow(x, y); });
  return primitive("pow", {&a, &b},
                   [&](Residuals& r) {
                     Array y = binary_kernel(a, b, "pow", [](float x, float z) { return std::pow(x, z); });
                     r.keep(a, b, y);
                     return y;
                   },
                   higher_order([](Cotangents& c, autodiff::Saved s) {
                     if (autodiff::creating_graph()) {
                       // The same with ops: d/da = b a^(b-1) (0 where b == 0), d/db = log(a) a^b (0 where a == 0).
                       const Array zero = Array::zeros({}, s[0].dtype());
                       if (c.needs(0)) {
                         Array d = where(equal(s[1], zero), zero, mul(s[1], pow(s[0], sub(s[1], scalar(1.0f)))));
                         c.set(0, sum_to(mul(c.out(), d), s[0].shape()));
                       }
                       if (c.needs(1)) {
                         const Array is_zero = equal(s[0], zero);
                         Array loga = where(is_zero, zero, log(where(is_zero, Array::full(Shape{}, 1.0f, s[0].dtype()), s[0])));
                         c.set(1, sum_to(mul(c.out(), mul(loga, s[2])), s[1].shape()));
                       }
                       return;
                     }
                     if (c.needs(0)) {
                       // d/da a^b = b a^(b-1); b == 0 gives 0 (as JAX).
                       Array d = binary_kernel(s[0], s[1], "pow", [](float x, float z) {
                         return z == 0.0f ? 0.0f : z * std::pow(x, z - 1.0f);
                       });
                       c.set(0, sum_to(mul(c.out(), d), s[0].shape()));
                     }
                     if (c.needs(1)) {
                       // d/db a^b = log(a) a^b, with log(0) replaced by 0 (as JAX).
                       Array loga = unary_kernel(s[0], "pow", [](const CVec& v) { return (v == 0.0f).select(0.0f, v.log()); });
                       c.set(1, sum_to(mul(c.out(), mul(loga, s[2])), s[1].shape()));
                     }
                   }));
}

Array pow(const Array& a, float exponent) { return pow(a, scalar(exponent)); }

namespace {
// Gradient share of `a` in max(a, b): 1 where a wins, 1/2 at ties, 0 where b wins.
template <bool kMax>
Array extremum(const Array& a, const Array& b, const char* op) {
  if (a.batched() || b.batched()) [[unlikely]]
    return ops::batching::broadcasting(op, {&a, &b}, [op](const Array& x, const Array& y) { return extremum<kMax>(x, y, op); });
  return primitive(op, {&a, &b},
                   [&](Residuals& r) {
                     r.keep(a, b);
                     return binary_kernel(a, b, op, [](float x, float z) { return kMax ? (x > z ? x : z) : (x < z ? x : z); });
                   },
                   // share_a is piecewise constant in a and b: a constant in create-graph mode too
                   higher_order([op](Cotangents& c, autodiff::Saved s) {
                     Array share_a = binary_kernel(s[0].detached(), s[1].detached(), op, [](float x, float z) {
                       return x == z ? 0.5f : ((kMax ? x > z : x < z) ? 1.0f : 0.0f);
                     });
                     if (c.needs(0)) c.set(0, sum_to(mul(c.out(), share_a), s[0].shape()));
                     if (c.needs(1)) c.set(1, sum_to(mul(c.out(), sub(scalar(1.0f), share_a)), s[1].shape()));
                   }));
}
}  // namespace

Array maximum(const Array& a, const Array& b) { return extremum<true>(a, b, "maximum"); }
Array minimum(const Array& a, const Array& b) { return extremum<false>(a, b, "minimum"); }

Array neg(const Array& x) {
  return unary_op("neg", x, Keep::nothing, [](const CVec& v) { return -v; },
                  [](Cotangents& c, autodiff::Saved) { c.set(0, neg(c.out())); });
}

Array operator+(const Array& a, const Array& b) { return add(a, b); }
Array operator-(const Array& a, const Array& b) { return sub(a, b); }
Array operator*(const Array& a, const Array& b) { return mul(a, b); }
Array operator/(const Array& a, const Array& b) { return div(a, b); }
Array operator-(const Array& x) { return neg(x); }
Array operator+(const Array& a, float b) { return add(a, scalar(b)); }
Array operator-(const Array& a, float b) { return sub(a, scalar(b)); }
Array operator*(const Array& a, float b) { return mul(a, scalar(b)); }
Array operator/(const Array& a, float b) { return div(a, scalar(b)); }
Array operator+(float a, const Array& b) { return add(scalar(a), b); }
Array operator-(float a, const Array& b) { return sub(scalar(a), b); }
Array operator*(float a, const Array& b) { return mul(scalar(a), b); }
Array operator/(float a, const Array& b) { return div(scalar(a), b); }

// ---- math ------------------------------------------------------------------------------------

Array exp(const Array& x) {
  return unary_op("exp", x, Keep::output, [](const CVec& v) { return v.exp(); },
                  [](Cotangents& c, autodiff::Saved s) { c.set(0, mul(c.out(), s[0])); });
}

Array log(const Array& x) {
  return unary_op("log", x, Keep::input, Tabulated{[](const CVec& v) { return v.log(); }},
                  [](Cotangents& c, autodiff::Saved s) { c.set(0, div(c.out(), s[0])); });
}

Array log1p(const Array& x) {
  return unary_op("log1p", x, Keep::input, Tabulated{[](const CVec& v) { return v.log1p(); }}, [](Cotangents& c, autodiff::Saved s) {
    c.set(0, pointwise_grad(c, s[0], [](const CVec& g, const CVec& v) { return g / (1.0f + v); },
                       [](const Array& g, const Array& v) { return div(g, add(scalar(1.0f), v)); }));
  });
}

Array sqrt(const Array& x) {
  return unary_op("sqrt", x, Keep::output, [](const CVec& v) { return v.sqrt(); }, [](Cotangents& c, autodiff::Saved s) {
    c.set(0, pointwise_grad(c, s[0], [](const CVec& g, const CVec& v) { return g * 0.5f / v; },
                       [](const Array& g, const Array& y) { return div(mul(g, scalar(0.5f)), y); }));
  });
}

Array rsqrt(const Array& x) {  // d/dx x^-1/2 = -1/2 y^3
  return unary_op("rsqrt", x, Keep::output, [](const CVec& v) { return v.rsqrt(); }, [](Cotangents& c, autodiff::Saved s) {
    c.set(0, pointwise_grad(c, s[0], [](const CVec& g, const CVec& v) { return g * (-0.5f) * v * v * v; },
                       [](const Array& g, const Array& y) { return mul(mul(g, scalar(-0.5f)), mul(y, square(y))); }));
  });
}

Array square(const Array& x) {
  return unary_op("square", x, Keep::input, [](const CVec& v) { return v.square(); }, [](Cotangents& c, autodiff::Saved s) {
    c.set(0, pointwise_grad(c, s[0], [](const CVec& g, const CVec& v) { return g * 2.0f * v; },
                       [](const Array& g, const Array& x) { return mul(mul(g, scalar(2.0f)), x); }));
  });
}

Array abs(const Array& x) {
  return unary_op("abs", x, Keep::input, [](const CVec& v) { return v.abs(); }, [](Cotangents& c, autodiff::Saved s) {
    c.set(0, pointwise_grad(c, s[0], [](const CVec& g, const CVec& v) {
            return g * ((v > 0.0f).cast<float>() - (v < 0.0f).cast<float>());
          }, [](const Array& g, const Array& x) { return mul(g, sign(x)); }));
  });
}

Array sign(const Array& x) {
  if (x.batched()) [[unlikely]]
    return ops::batching::per_element(x, [](const Array& p) { return sign(p); });
  return unary_kernel(x, "sign", [](const CVec& v) { return (v > 0.0f).cast<float>() - (v < 0.0f).cast<float>(); });
}

Array tanh(const Array& x) {
  return unary_op("tanh", x, Keep::output, Tabulated{[](const CVec& v) { return v.tanh(); }}, [](Cotangents& c, autodiff::Saved s) {
    c.set(0, pointwise_grad(c, s[0], [](const CVec& g, const CVec& v) { return activation_math::tanh_grad(g, v); },
                       [](const Array& g, const Array& y) { return mul(g, sub(scalar(1.0f), square(y))); }));
  });
}

Array sigmoid(const Array& x) {
  return unary_op("sigmoid", x, Keep::output, Tabulated{[](const CVec& v) { return v.logistic(); }}, [](Cotangents& c, autodiff::Saved s) {
    c.set(0, pointwise_grad(c, s[0], [](const CVec& g, const CVec& v) { return activation_math::sigmoid_grad(g, v); },
                       [](const Array& g, const Array& y) { return mul(mul(g, y), sub(scalar(1.0f), y)); }));
  });
}

namespace {
constexpr float kInvSqrtPi = 0.5641895835477563f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kInvLn2 = 1.4426950408889634f;
}  // namespace

Array sin(const Array& x) {
  return unary_op("sin", x, Keep::input, Tabulated{[](const CVec& v) { return v.sin(); }}, [](Cotangents& c, autodiff::Saved s) {
    c.set(0, pointwise_grad(c, s[0], [](const CVec& g, const CVec& v) { return g * v.cos(); },
                       [](const Array& g, const Array& x) { return mul(g, cos(x)); }));
  });
}

Array cos(const Array& x) {
  return unary_op("cos", x, Keep::input, Tabulated{[](const CVec& v) { return v.cos(); }}, [](Cotangents& c, autodiff::Saved s) {
    c.set(0, pointwise_grad(c, s[0], [](const CVec& g, const CVec& v) { return -g * v.sin(); },
                       [](const Array& g, const Array& x) { return neg(mul(g, sin(x))); }));
  });
}

Array erf(const Array& x) {  // d/dx erf(x) = 2/sqrt(pi) e^(-x^2)
  return unary_op("erf", x, Keep::input, Tabulated{[](const CVec& v) { return v.erf(); }}, [](Cotangents& c, autodiff::Saved s) {
    c.set(0, pointwise_grad(c, s[0], [](const CVec& g, const CVec& v) { return g * (2.0f * kInvSqrtPi) * (-v.square()).exp(); },
                       [](const Array& g, const Array& x) { return mul(mul(g, scalar(2.0f * kInvSqrtPi)), exp(neg(square(x)))); }));
  });
}

Array expm1(const Array& x) {  // d/dx (e^x - 1) = y + 1
  return unary_op("expm1", x, Keep::output, Tabulated{[](const CVec& v) { return v.expm1(); }}, [](Cotangents& c, autodiff::Saved s) {
    c.set(0, pointwise_grad(c, s[0], [](const CVec& g, const CVec& v) { return g * (v + 1.0f); },
                       [](const Array& g, const Array& y) { return mul(g, add(y, scalar(1.0f))); }));
  });
}

Array log2(const Array& x) {
  return unary_op("log2", x, Keep::input, Tabulated{[](const CVec& v) { return v.log() * kInvLn2; }}, [](Cotangents& c, autodiff::Saved s) {
    c.set(0, pointwise_grad(c, s[0], [](const CVec& g, const CVec& v) { return g / (v * kLn2); },
                       [](const Array& g, const Array& x) { return div(g, mul(x, scalar(kLn2))); }));
  });
}

// Rounding: piecewise constant, so the gradient is zero (JAX's rule); a primitive all the same, so
// policies see it and gradients reaching it stop there with the right shape.
Array floor(const Array& x) {
  return unary_op("floor", x, Keep::nothing, [](const CVec& v) { return v.floor(); },
                  [](Cotangents& c, autodiff::Saved) {
                    c.set(0, autodiff::creating_graph() ? autodiff::linked_zeros(c.out()) : Array::zeros(c.out().shape(), c.out().dtype()));
                  });
}

Array ceil(const Array& x) {
  return unary_op("ceil", x, Keep::nothing, [](const CVec& v) { return v.ceil(); },
                  [](Cotangents& c, autodiff::Saved) {
                    c.set(0, autodiff::creating_graph() ? autodiff::linked_zeros(c.out()) : Array::zeros(c.out().shape(), c.out().dtype()));
                  });
}

Array round(const Array& x) {  // nearest, ties to even (the default rounding mode), as jnp.round
  return unary_op("round", x, Keep::nothing, [](const CVec& v) { return v.rint(); },
                  [](Cotangents& c, autodiff::Saved) {
                    c.set(0, autodiff::creating_graph() ? autodiff::linked_zeros(c.out()) : Array::zeros(c.out().shape(), c.out().dtype()));
                  });
}

Array clip(const Array& x, float lo, float hi) {
  if (lo > hi) throw ValueError(detail::cat("clip: lower bound ", lo, " is above upper bound ", hi));
  return minimum(maximum(x, scalar(lo)), scalar(hi));
}

// ---- activations -------------------------------------------------------------------------------

Array relu(const Array& x) {  // keeps its output: y > 0 exactly where x > 0
  return unary_op("relu", x, Keep::output, [](const CVec& v) { return v.max(0.0f); }, [](Cotangents& c, autodiff::Saved s) {
    c.set(0, pointwise_grad(c, s[0], [](const CVec& g, const CVec& v) { return activation_math::relu_grad(g, v); },
                       [](const Array& g, const Array& y) {  // the mask is piecewise constant
                         return where(greater(y.detached(), Array::zeros({}, y.dtype())), g, Array::zeros({}, g.dtype()));
                       }));
  });
}

using activation_math::kGeluCoeff;
using activation_math::kInvSqrt2;
using activation_math::kInvSqrt2Pi;
using activation_math::kSqrt2OverPi;

// gelu and silu take their derivative from their input, through the term their value also needs
// (activation_math::value_and_derivative): the forward kernel writes y = act(x), the backward rule
// g * act'(x), with the same bits as the fused linear op's value and gradient.
template <Activation A>
struct ActivationValue {  // (a type per activation: each has its own bf16 tables)
  void operator()(const CVec& v, OVec& y) const {
    alignas(64) float u[kChunk];
    activation_math::value_and_derivative(A, v.data(), y.data(), nullptr, u, v.size());
  }
};
template <Activation A>
void activation_grad(const CVec& g, const CVec& v, OVec& out) {
  activation_math::grad_from_input(A, g, v, out);
}

Array gelu(const Array& x, bool approximate) {
  if (approximate)
    return unary_op("gelu", x, Keep::input, Tabulated{ActivationValue<Activation::gelu>{}}, [](Cotangents& c, autodiff::Saved s) {
      c.set(0, pointwise_grad(c, s[0], activation_grad<Activation::gelu>, [](const Array& g, const Array& x) {
              const Array x2 = square(x);
              const Array t = tanh(mul(scalar(kSqrt2OverPi), add(x, mul(scalar(kGeluCoeff), mul(x, x2)))));
              const Array d = add(mul(scalar(0.5f), add(scalar(1.0f), t)),
                                  mul(mul(mul(scalar(0.5f * kSqrt2OverPi), x), sub(scalar(1.0f), square(t))),
                                      add(scalar(1.0f), mul(scalar(3.0f * kGeluCoeff), x2))));
              return mul(g, d);
            }));
    });
  return unary_op("gelu", x, Keep::input, Tabulated{ActivationValue<Activation::gelu_exact>{}}, [](Cotangents& c, autodiff::Saved s) {
    c.set(0, pointwise_grad(c, s[0], activation_grad<Activation::gelu_exact>, [](const Array& g, const Array& x) {
            const Array d = add(mul(scalar(0.5f), add(erf(mul(x, scalar(kInvSqrt2))), scalar(1.0f))),
                                mul(mul(x, scalar(kInvSqrt2Pi)), exp(mul(scalar(-0.5f), square(x)))));
            return mul(g, d);
          }));
  });
}

Array silu(const Array& x) {
  return unary_op("silu", x, Keep::input, Tabulated{ActivationValue<Activation::silu>{}}, [](Cotangents& c, autodiff::Saved s) {
    c.set(0, pointwise_grad(c, s[0], activation_grad<Activation::silu>, [](const Array& g, const Array& x) {
            const Array sg = sigmoid(x);
            return mul(g, mul(sg, add(scalar(1.0f), mul(x, sub(scalar(1.0f), sg)))));
          }));
  });
}

Array softplus(const Array& x) {
  // log(1 + e^x) computed stably as max(x, 0) + log1p(e^-|x|).
  return unary_op("softplus", x, Keep::input, Tabulated{[](const CVec& v) { return v.max(0.0f) + (-v.abs()).exp().log1p(); }},
                  [](Cotangents& c, autodiff::Saved s) {
                    c.set(0, pointwise_grad(c, s[0], [](const CVec& g, const CVec& v) { return g * v.logistic(); },
                       [](const Array& g, const Array& x) { return mul(g, sigmoid(x)); }));
                  });
}

// ---- selection and comparison ------------------------------------------------------------------

Array where(const Array& cond, const Array& a, const Array& b) {
  ops::detail::require_defined(cond, "where");
  if (cond.batched() || a.batched() || b.batched()) [[unlikely]]
    return ops::batching::broadcasting("where", {&cond, &a, &b}, [](const Array& c, const Array& x, const Array& y) {
      return where(c, x, y);
    });
  Array c = cond.dtype() == DType::f32 ? cond : astype(cond, DType::f32);
  require_float(a, "where");
  require_float(b, "where");
  if (a.dtype() != DType::f32 || b.dtype() != DType::f32) {
    // Select in float32 and round back: exact, since the values are only moved.
    const DType out = result_dtype(a, b);
    return astype(where(cond, astype(a, DType::f32), astype(b, DType::f32)), out);
  }
  const Shape out_shape = broadcast_shapes(c.shape(), broadcast_shapes(a.shape(), b.shape(), "where"), "where");
  // The condition is an input too (never given a gradient), so a replay can rebuild the mask the
  // rule keeps from it.
  return primitive("where", {&a, &b, &c},
                   [&](Residuals& r) {
                     r.keep(c);
                     const Array cb = ops::detail::broadcast_raw(c, out_shape);
                     const Array ab = ops::detail::broadcast_raw(a, out_shape);
                     const Array bb = ops::detail::broadcast_raw(b, out_shape);
                     Array y = Array::empty(out_shape);
                     float* py = y.mutable_data();
                     const float* pc = cb.data();
                     const float* pa = ab.data();
                     const float* pb = bb.data();
                     for_blocks(y.numel(), [&](std::int64_t s, std::int64_t n) {
                       for (std::int64_t i = s; i < s + n; ++i) py[i] = pc[i] != 0.0f ? pa[i] : pb[i];
                     });
                     return y;
                   },
                   higher_order([sa = a.shape(), sb = b.shape()](Cotangents& ct, autodiff::Saved s) {
                     const Array& g = ct.out();
                     if (autodiff::creating_graph()) {  // the same selection as an op (the mask is a constant)
                       const Array zero = Array::zeros({}, g.dtype());
                       if (ct.needs(0)) ct.set(0, sum_to(where(s[0].detached(), g, zero), sa));
                       if (ct.needs(1)) ct.set(1, sum_to(where(s[0].detached(), zero, g), sb));
                       return;
                     }
                     if (ct.needs(0))
                       ct.set(0, sum_to(binary_kernel(g, s[0], "where", [](float v, float m) { return m != 0.0f ? v : 0.0f; }, g.dtype()), sa));
                     if (ct.needs(1))
                       ct.set(1, sum_to(binary_kernel(g, s[0], "where", [](float v, float m) { return m != 0.0f ? 0.0f : v; }, g.dtype()), sb));
                   }));
}

#define LINUM_COMPARISON(name, expr)                                                          \
  Array name(const Array& a, const Array& b) {                                                \
    if (a.batched() || b.batched()) [[unlikely]]                                                \
      return ops::batching::broadcasting(#name, {&a, &b}, [](const Array& x, const Array& y) { return name(x, y); }); \
    return binary_kernel(a, b, #name, [](float x, float z) { return (expr) ? 1.0f : 0.0f; }, DType::f32); \
  }
LINUM_COMPARISON(greater, x > z)
LINUM_COMPARISON(greater_equal, x >= z)
LINUM_COMPARISON(less, x < z)
LINUM_COMPARISON(less_equal, x <= z)
LINUM_COMPARISON(equal, x == z)
LINUM_COMPARISON(not_equal, x != z)
#undef LINUM_COMPARISON

Array astype(const Array& x, DType dtype) {
  ops::detail::require_defined(x, "astype");
  if (x.dtype() == dtype) return x.weak_type() ? x.strongly_typed() : x;
  if (x.batched()) [[unlikely]]
    return ops::batching::per_element(x, [dtype](const Array& p) { return astype(p, dtype); });
  const std::int64_t n = x.numel();
  if (is_floating(x.dtype()) && is_floating(dtype))
    return primitive("astype", {&x},
                     [&](Residuals&) {
                       Array out = Array::empty(x.shape(), dtype);
                       if (dtype == DType::bf16)
                         for_blocks(n, [&](std::int64_t s, std::int64_t c) { f32_to_bf16(x.data() + s, out.mutable_data_bf16() + s, c); });
                       else
                         for_blocks(n, [&](std::int64_t s, std::int64_t c) { bf16_to_f32(x.data_bf16() + s, out.mutable_data() + s, c); });
                       return out;
                     },
                     // the cotangent goes back to the input's dtype
                     higher_order([from = x.dtype()](Cotangents& c, autodiff::Saved) { c.set(0, astype(c.out(), from)); }));
  // int32 <-> float: not differentiable.
  Array out = Array::empty(x.shape(), dtype);
  if (x.dtype() == DType::i32) {
    const std::int32_t* p = x.data_i32();
    for (std::int64_t i = 0; i < n; ++i) {
      if (dtype == DType::f32) out.mutable_data()[i] = static_cast<float>(p[i]);
      else out.mutable_data_bf16()[i] = bfloat16(static_cast<float>(p[i]));
    }
  } else {
    std::int32_t* o = out.mutable_data_i32();
    for (std::int64_t i = 0; i < n; ++i) {
      const float v = f32_at(x, i);
      if (!(v > -2147483904.0f && v < 2147483648.0f))
        throw ValueError(detail::cat("astype: value ", v, " at flat index ", i, " of ", x.shape(),
                                     " does not fit in int32"));
      o[i] = static_cast<std::int32_t>(v);
    }
  }
  return out;
}

Array stop_gradient(const Array& x) { return x.detached(); }

}  // namespace linum
