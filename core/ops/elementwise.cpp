// Elementwise ops. Each op's backward rule follows its forward and captures only what it needs.
#include <linum/core/ops/elementwise.hpp>
#include <linum/core/ops/kernel_util.hpp>
#include <linum/core/ops/reduce.hpp>

#include <Eigen/Core>
#include <unsupported/Eigen/SpecialFunctions>

#include <cmath>

namespace linum {
namespace {

using autodiff::Cotangents;
using autodiff::needs_grad;
using autodiff::record;
using ops::detail::broadcast_shapes;
using ops::detail::for_blocks;
using ops::detail::require_f32;
using ops::detail::sum_to;
using Vec = Eigen::Map<Eigen::ArrayXf, Eigen::Aligned64>;
using CVec = Eigen::Map<const Eigen::ArrayXf>;
using OVec = Eigen::Map<Eigen::ArrayXf>;

// ---- kernels ---------------------------------------------------------------------------------

// out[i] = f(a[i], b[i]) with NumPy broadcasting; float32 in, T out.
template <class T, class F>
Array binary_kernel(const Array& a, const Array& b, const char* op, F f) {
  require_f32(a, op);
  require_f32(b, op);
  const Shape out_shape = broadcast_shapes(a.shape(), b.shape(), op);
  Array out = Array::empty(out_shape, std::is_same_v<T, float> ? DType::f32 : DType::i32);
  T* po = static_cast<T*>(const_cast<void*>(out.raw()));
  const float* pa = a.data();
  const float* pb = b.data();
  const std::int64_t n = out_shape.numel();
  if (a.numel() == n && b.numel() == n) {
    for_blocks(n, [&](std::int64_t s, std::int64_t c) {
      for (std::int64_t i = s; i < s + c; ++i) po[i] = f(pa[i], pb[i]);
    });
    return out;
  }
  if (b.numel() == 1 && a.numel() == n) {
    const float vb = pb[0];
    for_blocks(n, [&](std::int64_t s, std::int64_t c) {
      for (std::int64_t i = s; i < s + c; ++i) po[i] = f(pa[i], vb);
    });
    return out;
  }
  if (a.numel() == 1 && b.numel() == n) {
    const float va = pa[0];
    for_blocks(n, [&](std::int64_t s, std::int64_t c) {
      for (std::int64_t i = s; i < s + c; ++i) po[i] = f(va, pb[i]);
    });
    return out;
  }
  // General case: walk the output row by row (rows = all axes but the last).
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
  const std::int64_t ia_step = sa[rank - 1], ib_step = sb[rank - 1];
  auto do_rows = [&](std::int64_t r0, std::int64_t r1) {
    for (std::int64_t r = r0; r < r1; ++r) {
      std::int64_t rem = r, oa = 0, ob = 0;
      for (int d = rank - 2; d >= 0; --d) {
        const std::int64_t idx = rem % out_shape[d];
        rem /= out_shape[d];
        oa += idx * sa[d];
        ob += idx * sb[d];
      }
      T* o = po + r * inner;
      const float* xa = pa + oa;
      const float* xb = pb + ob;
      if (ia_step == 1 && ib_step == 1)
        for (std::int64_t j = 0; j < inner; ++j) o[j] = f(xa[j], xb[j]);
      else if (ia_step == 1 && ib_step == 0)
        for (std::int64_t j = 0; j < inner; ++j) o[j] = f(xa[j], xb[0]);
      else if (ia_step == 0 && ib_step == 1)
        for (std::int64_t j = 0; j < inner; ++j) o[j] = f(xa[0], xb[j]);
      else
        for (std::int64_t j = 0; j < inner; ++j) o[j] = f(xa[j * ia_step], xb[j * ib_step]);
    }
  };
  if (n >= ops::detail::kParallelMin && rows > 1) {
#pragma omp parallel for schedule(static)
    for (std::int64_t r = 0; r < rows; ++r) do_rows(r, r + 1);
  } else {
    do_rows(0, rows);
  }
  return out;
}

// out = f(x) using Eigen's vectorised array expressions: f(CVec in) -> expression.
template <class F>
Array unary_kernel(const Array& x, const char* op, F f) {
  require_f32(x, op);
  Array out = Array::empty(x.shape());
  const float* px = x.data();
  float* po = out.mutable_data();
  for_blocks(x.numel(), [&](std::int64_t s, std::int64_t c) { OVec(po + s, c) = f(CVec(px + s, c)); });
  return out;
}

// out = f(a, b) for same-shaped float arrays via Eigen expressions (used by backward rules). A
// three-argument f(a, b, out) writes the block itself, so it can use `out` as scratch space (an
// expression returned from f must not refer to f's locals: they are gone when it is evaluated).
template <class F>
Array zip_kernel(const Array& a, const Array& b, F f) {
  Array out = Array::empty(a.shape());
  const float* pa = a.data();
  const float* pb = b.data();
  float* po = out.mutable_data();
  for_blocks(a.numel(), [&](std::int64_t s, std::int64_t c) {
    if constexpr (std::is_invocable_v<F&, const CVec&, const CVec&, OVec&>) {
      OVec o(po + s, c);
      f(CVec(pa + s, c), CVec(pb + s, c), o);
    } else {
      OVec(po + s, c) = f(CVec(pa + s, c), CVec(pb + s, c));
    }
  });
  return out;
}

// The backward rule of an elementwise op: f(g, saved) -> gradient, where g is output 0's cotangent.
// The cotangent is taken from the sweep; when no other array refers to its buffer, the gradient is
// written into that buffer instead of a new one (one activation-sized buffer less at the peak).
template <class F>
Array pointwise_grad(Cotangents& c, const Array& saved, F f) {
  Array g = c.take_out(0);
  if (!g.owns_buffer_alone()) return zip_kernel(g, saved, f);
  float* pg = g.mutable_data();
  const float* ps = saved.data();
  for_blocks(g.numel(), [&](std::int64_t s, std::int64_t n) {
    OVec o(pg + s, n);
    if constexpr (std::is_invocable_v<F&, const CVec&, const CVec&, OVec&>) {
      // f uses `out` as scratch, so it needs its inputs elsewhere: keep a copy of this block of g.
      const Eigen::ArrayXf gin = CVec(pg + s, n);
      f(CVec(gin.data(), n), CVec(ps + s, n), o);
    } else {
      o = f(CVec(pg + s, n), CVec(ps + s, n));  // coefficient-wise: reading g[i] before writing it is fine
    }
  });
  return g.detached();
}

Array scalar(float v) { return Array::scalar(v); }

}  // namespace

// ---- arithmetic -----------------------------------------------------------------------------

Array add(const Array& a, const Array& b) {
  Array y = binary_kernel<float>(a, b, "add", [](float x, float z) { return x + z; });
  if (needs_grad(a, b))
    record("add", y, {&a, &b}, {}, [sa = a.shape(), sb = b.shape()](Cotangents& c, autodiff::Saved) {
      if (c.needs(0)) c.set(0, sum_to(c.out(), sa));
      if (c.needs(1)) c.set(1, sum_to(c.out(), sb));
    });
  return y;
}

Array sub(const Array& a, const Array& b) {
  Array y = binary_kernel<float>(a, b, "sub", [](float x, float z) { return x - z; });
  if (needs_grad(a, b))
    record("sub", y, {&a, &b}, {}, [sa = a.shape(), sb = b.shape()](Cotangents& c, autodiff::Saved) {
      if (c.needs(0)) c.set(0, sum_to(c.out(), sa));
      if (c.needs(1)) c.set(1, neg(sum_to(c.out(), sb)));
    });
  return y;
}

Array mul(const Array& a, const Array& b) {
  Array y = binary_kernel<float>(a, b, "mul", [](float x, float z) { return x * z; });
  if (needs_grad(a, b)) {
    // Each operand is kept only if the *other* one needs a gradient.
    Array keep_a = b.node() ? a.detached() : Array();
    Array keep_b = a.node() ? b.detached() : Array();
    record("mul", y, {&a, &b}, {keep_a, keep_b}, [sa = a.shape(), sb = b.shape()](Cotangents& c, autodiff::Saved s) {
      if (c.needs(0)) c.set(0, sum_to(mul(c.out(), s[1]), sa));
      if (c.needs(1)) c.set(1, sum_to(mul(c.out(), s[0]), sb));
    });
  }
  return y;
}

Array div(const Array& a, const Array& b) {
  Array y = binary_kernel<float>(a, b, "div", [](float x, float z) { return x / z; });
  if (needs_grad(a, b)) {
    Array keep_y = b.node() ? y.detached() : Array();
    record("div", y, {&a, &b}, {b, keep_y}, [sa = a.shape(), sb = b.shape()](Cotangents& c, autodiff::Saved s) {
      Array g_over_b = div(c.out(), s[0]);
      if (c.needs(0)) c.set(0, sum_to(g_over_b, sa));
      if (c.needs(1)) c.set(1, sum_to(neg(mul(g_over_b, s[1])), sb));  // -g a / b^2 = -(g/b) y
    });
  }
  return y;
}

Array pow(const Array& a, const Array& b) {
  Array y = binary_kernel<float>(a, b, "pow", [](float x, float z) { return std::pow(x, z); });
  if (needs_grad(a, b)) {
    record("pow", y, {&a, &b}, {a, b, y}, [](Cotangents& c, autodiff::Saved s) {
      if (c.needs(0)) {
        // d/da a^b = b a^(b-1); b == 0 gives 0 (as JAX).
        Array d = binary_kernel<float>(s[0], s[1], "pow", [](float x, float z) {
          return z == 0.0f ? 0.0f : z * std::pow(x, z - 1.0f);
        });
        c.set(0, sum_to(mul(c.out(), d), s[0].shape()));
      }
      if (c.needs(1)) {
        // d/db a^b = log(a) a^b, with log(0) replaced by 0 (as JAX).
        Array loga = unary_kernel(s[0], "pow", [](const CVec& v) { return (v == 0.0f).select(0.0f, v.log()); });
        c.set(1, sum_to(mul(c.out(), mul(loga, s[2])), s[1].shape()));
      }
    });
  }
  return y;
}

Array pow(const Array& a, float exponent) { return pow(a, scalar(exponent)); }

namespace {
// Gradient share of `a` in max(a, b): 1 where a wins, 1/2 at ties, 0 where b wins.
template <bool kMax>
Array extremum(const Array& a, const Array& b, const char* op) {
  Array y = binary_kernel<float>(a, b, op, [](float x, float z) { return kMax ? (x > z ? x : z) : (x < z ? x : z); });
  if (needs_grad(a, b))
    record(op, y, {&a, &b}, {a, b}, [op](Cotangents& c, autodiff::Saved s) {
      Array share_a = binary_kernel<float>(s[0], s[1], op, [](float x, float z) {
        return x == z ? 0.5f : ((kMax ? x > z : x < z) ? 1.0f : 0.0f);
      });
      if (c.needs(0)) c.set(0, sum_to(mul(c.out(), share_a), s[0].shape()));
      if (c.needs(1)) c.set(1, sum_to(mul(c.out(), sub(scalar(1.0f), share_a)), s[1].shape()));
    });
  return y;
}
}  // namespace

Array maximum(const Array& a, const Array& b) { return extremum<true>(a, b, "maximum"); }
Array minimum(const Array& a, const Array& b) { return extremum<false>(a, b, "minimum"); }

Array neg(const Array& x) {
  Array y = unary_kernel(x, "neg", [](const CVec& v) { return -v; });
  if (needs_grad(x)) record("neg", y, {&x}, {}, [](Cotangents& c, autodiff::Saved) { c.set(0, neg(c.out())); });
  return y;
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
  Array y = unary_kernel(x, "exp", [](const CVec& v) { return v.exp(); });
  if (needs_grad(x))  // keeps its output
    record("exp", y, {&x}, {y}, [](Cotangents& c, autodiff::Saved s) { c.set(0, mul(c.out(), s[0])); });
  return y;
}

Array log(const Array& x) {
  Array y = unary_kernel(x, "log", [](const CVec& v) { return v.log(); });
  if (needs_grad(x)) record("log", y, {&x}, {x}, [](Cotangents& c, autodiff::Saved s) { c.set(0, div(c.out(), s[0])); });
  return y;
}

Array log1p(const Array& x) {
  Array y = unary_kernel(x, "log1p", [](const CVec& v) { return v.log1p(); });
  if (needs_grad(x))
    record("log1p", y, {&x}, {x}, [](Cotangents& c, autodiff::Saved s) {
      c.set(0, pointwise_grad(c, s[0], [](const CVec& g, const CVec& v) { return g / (1.0f + v); }));
    });
  return y;
}

Array sqrt(const Array& x) {
  Array y = unary_kernel(x, "sqrt", [](const CVec& v) { return v.sqrt(); });
  if (needs_grad(x))
    record("sqrt", y, {&x}, {y}, [](Cotangents& c, autodiff::Saved s) {
      c.set(0, pointwise_grad(c, s[0], [](const CVec& g, const CVec& v) { return g * 0.5f / v; }));
    });
  return y;
}

Array rsqrt(const Array& x) {
  Array y = unary_kernel(x, "rsqrt", [](const CVec& v) { return v.rsqrt(); });
  if (needs_grad(x))  // d/dx x^-1/2 = -1/2 y^3
    record("rsqrt", y, {&x}, {y}, [](Cotangents& c, autodiff::Saved s) {
      c.set(0, pointwise_grad(c, s[0], [](const CVec& g, const CVec& v) { return g * (-0.5f) * v * v * v; }));
    });
  return y;
}

Array square(const Array& x) {
  Array y = unary_kernel(x, "square", [](const CVec& v) { return v.square(); });
  if (needs_grad(x))
    record("square", y, {&x}, {x}, [](Cotangents& c, autodiff::Saved s) {
      c.set(0, pointwise_grad(c, s[0], [](const CVec& g, const CVec& v) { return g * 2.0f * v; }));
    });
  return y;
}

Array abs(const Array& x) {
  Array y = unary_kernel(x, "abs", [](const CVec& v) { return v.abs(); });
  if (needs_grad(x))
    record("abs", y, {&x}, {x}, [](Cotangents& c, autodiff::Saved s) {
      c.set(0, pointwise_grad(c, s[0], [](const CVec& g, const CVec& v) {
              return g * ((v > 0.0f).cast<float>() - (v < 0.0f).cast<float>());
            }));
    });
  return y;
}

Array sign(const Array& x) {
  return unary_kernel(x, "sign", [](const CVec& v) { return (v > 0.0f).cast<float>() - (v < 0.0f).cast<float>(); });
}

Array tanh(const Array& x) {
  Array y = unary_kernel(x, "tanh", [](const CVec& v) { return v.tanh(); });
  if (needs_grad(x))
    record("tanh", y, {&x}, {y}, [](Cotangents& c, autodiff::Saved s) {
      c.set(0, pointwise_grad(c, s[0], [](const CVec& g, const CVec& v) { return g * (1.0f - v.square()); }));
    });
  return y;
}

Array sigmoid(const Array& x) {
  Array y = unary_kernel(x, "sigmoid", [](const CVec& v) { return v.logistic(); });
  if (needs_grad(x))
    record("sigmoid", y, {&x}, {y}, [](Cotangents& c, autodiff::Saved s) {
      c.set(0, pointwise_grad(c, s[0], [](const CVec& g, const CVec& v) { return g * v * (1.0f - v); }));
    });
  return y;
}

Array clip(const Array& x, float lo, float hi) {
  if (lo > hi) throw ValueError(detail::cat("clip: lower bound ", lo, " is above upper bound ", hi));
  return minimum(maximum(x, scalar(lo)), scalar(hi));
}

// ---- activations -------------------------------------------------------------------------------

Array relu(const Array& x) {
  Array y = unary_kernel(x, "relu", [](const CVec& v) { return v.max(0.0f); });
  if (needs_grad(x))  // keeps its output: y > 0 exactly where x > 0
    record("relu", y, {&x}, {y}, [](Cotangents& c, autodiff::Saved s) {
      c.set(0, pointwise_grad(c, s[0], [](const CVec& g, const CVec& v) { return (v > 0.0f).select(g, 0.0f); }));
    });
  return y;
}

namespace {
constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCoeff = 0.044715f;
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;
}  // namespace

Array gelu(const Array& x, bool approximate) {
  Array y = approximate ? unary_kernel(x, "gelu", [](const CVec& v) {
    return v * (0.5f * (1.0f + (kSqrt2OverPi * (v + kGeluCoeff * v.cube())).tanh()));
  })
                        : unary_kernel(x, "gelu", [](const CVec& v) {
                            return v * ((v * kInvSqrt2).erf() + 1.0f) * 0.5f;
                          });
  if (needs_grad(x))
    record("gelu", y, {&x}, {x}, [approximate](Cotangents& c, autodiff::Saved s) {
      if (approximate)
        c.set(0, pointwise_grad(c, s[0], [](const CVec& g, const CVec& v, OVec& out) {
                out = (kSqrt2OverPi * (v + kGeluCoeff * v.cube())).tanh();  // t, then the gradient in place
                out = g * (0.5f * (1.0f + out) +
                           0.5f * v * (1.0f - out.square()) * kSqrt2OverPi * (1.0f + 3.0f * kGeluCoeff * v.square()));
              }));
      else
        c.set(0, pointwise_grad(c, s[0], [](const CVec& g, const CVec& v) {
                return g * (0.5f * ((v * kInvSqrt2).erf() + 1.0f) + v * kInvSqrt2Pi * (-0.5f * v.square()).exp());
              }));
    });
  return y;
}

Array silu(const Array& x) {
  Array y = unary_kernel(x, "silu", [](const CVec& v) { return v * v.logistic(); });
  if (needs_grad(x))
    record("silu", y, {&x}, {x}, [](Cotangents& c, autodiff::Saved s) {
      c.set(0, pointwise_grad(c, s[0], [](const CVec& g, const CVec& v, OVec& out) {
              out = v.logistic();  // sigmoid(x), then the gradient in place
              out = g * out * (1.0f + v * (1.0f - out));
            }));
    });
  return y;
}

Array softplus(const Array& x) {
  // log(1 + e^x) computed stably as max(x, 0) + log1p(e^-|x|).
  Array y = unary_kernel(x, "softplus", [](const CVec& v) { return v.max(0.0f) + (-v.abs()).exp().log1p(); });
  if (needs_grad(x))
    record("softplus", y, {&x}, {x}, [](Cotangents& c, autodiff::Saved s) {
      c.set(0, pointwise_grad(c, s[0], [](const CVec& g, const CVec& v) { return g * v.logistic(); }));
    });
  return y;
}

// ---- selection and comparison ------------------------------------------------------------------

Array where(const Array& cond, const Array& a, const Array& b) {
  ops::detail::require_defined(cond, "where");
  Array c = cond.dtype() == DType::f32 ? cond : astype(cond, DType::f32);
  require_f32(a, "where");
  require_f32(b, "where");
  const Shape out_shape = broadcast_shapes(c.shape(), broadcast_shapes(a.shape(), b.shape(), "where"), "where");
  const Array cb = ops::detail::broadcast_raw(c, out_shape);
  const Array ab = ops::detail::broadcast_raw(a, out_shape);
  const Array bb = ops::detail::broadcast_raw(b, out_shape);
  Array y = Array::empty(out_shape);
  {
    float* py = y.mutable_data();
    const float* pc = cb.data();
    const float* pa = ab.data();
    const float* pb = bb.data();
    for_blocks(y.numel(), [&](std::int64_t s, std::int64_t n) {
      for (std::int64_t i = s; i < s + n; ++i) py[i] = pc[i] != 0.0f ? pa[i] : pb[i];
    });
  }
  if (needs_grad(a, b))
    record("where", y, {&a, &b}, {c}, [sa = a.shape(), sb = b.shape()](Cotangents& ct, autodiff::Saved s) {
      const Array& g = ct.out();
      if (ct.needs(0))
        ct.set(0, sum_to(binary_kernel<float>(g, s[0], "where", [](float v, float m) { return m != 0.0f ? v : 0.0f; }), sa));
      if (ct.needs(1))
        ct.set(1, sum_to(binary_kernel<float>(g, s[0], "where", [](float v, float m) { return m != 0.0f ? 0.0f : v; }), sb));
    });
  return y;
}

#define LINUM_COMPARISON(name, expr)                                                          \
  Array name(const Array& a, const Array& b) {                                                \
    return binary_kernel<float>(a, b, #name, [](float x, float z) { return (expr) ? 1.0f : 0.0f; }); \
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
  if (x.dtype() == dtype) return x.detached();
  Array out = Array::empty(x.shape(), dtype);
  if (dtype == DType::f32) {
    const std::int32_t* p = x.data_i32();
    float* o = out.mutable_data();
    for (std::int64_t i = 0; i < x.numel(); ++i) o[i] = static_cast<float>(p[i]);
  } else {
    const float* p = x.data();
    std::int32_t* o = out.mutable_data_i32();
    for (std::int64_t i = 0; i < x.numel(); ++i) {
      const float v = p[i];
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
