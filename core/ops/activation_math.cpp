// The activations whose derivative reads their input, compiled in one place (see
// activation_math_internal.hpp): the gelu and silu ops and the fused linear op call these.
#include <linum/core/ops/activation_math_internal.hpp>

#include <unsupported/Eigen/SpecialFunctions>

namespace linum::ops::detail::activation_math {
namespace {

// ---- from the input: each activation's shared term u, its value and its derivative from (x, u) ---
// gelu with erf: u = erf(x / sqrt(2)).
auto gelu_erf_term(const CVec& v) { return (v * kInvSqrt2).erf(); }
auto gelu_erf_value(const CVec& v, const CVec& u) { return v * (u + 1.0f) * 0.5f; }
auto gelu_erf_derivative(const CVec& v, const CVec& u) {
  return 0.5f * (u + 1.0f) + v * kInvSqrt2Pi * (-0.5f * v.square()).exp();
}
// silu: u = sigmoid(x).
auto silu_term(const CVec& v) { return v.logistic(); }
auto silu_value(const CVec& v, const CVec& u) { return v * u; }
auto silu_derivative(const CVec& v, const CVec& u) { return u * (1.0f + v * (1.0f - u)); }

// gelu (tanh form) in one pass of whole SIMD packets: each element's x is loaded once and y and d
// come from one tanh, with the derivative written through s = (1 + u) / 2 (the value's own factor):
// d = s + x (1 - u^2) (sqrt(2/pi) / 2) (1 + 3 * 0.044715 x^2). About a third fewer operations than
// evaluating the term, the value and the derivative as three array expressions (this pass is most of
// a bf16 MLP layer's elementwise time). p is a whole number of packets (the callers pad). Eigen's
// ptanh is its rational approximation (what `.tanh()` on arrays evaluates with EIGEN_FAST_MATH, the
// default).
template <bool Value, bool Derivative>
void gelu_tanh_packets(const float* x, float* y, float* d, std::int64_t p) {
  namespace ei = Eigen::internal;
  using Packet = ei::packet_traits<float>::type;
  constexpr std::int64_t kSize = ei::packet_traits<float>::size;
  const Packet one = ei::pset1<Packet>(1.0f), half = ei::pset1<Packet>(0.5f);
  const Packet c = ei::pset1<Packet>(kSqrt2OverPi), k = ei::pset1<Packet>(kGeluCoeff);
  const Packet dc0 = ei::pset1<Packet>(0.5f * kSqrt2OverPi), dc2 = ei::pset1<Packet>(1.5f * kGeluCoeff * kSqrt2OverPi);
  for (std::int64_t i = 0; i < p; i += kSize) {
    const Packet v = ei::ploadu<Packet>(x + i);  // (d may be x's memory: read before written)
    const Packet v2 = ei::pmul(v, v);
    const Packet u = ei::ptanh(ei::pmul(ei::pmul(c, v), ei::pmadd(k, v2, one)));
    const Packet s = ei::pmadd(half, u, half);
    if constexpr (Value) ei::pstoreu(y + i, ei::pmul(v, s));
    if constexpr (Derivative) {  // (every multiply-add spelled as one: nothing left for the compiler to
                                 // contract differently in one instantiation than in another)
      const Packet one_minus_u2 = ei::pmadd(ei::pnegate(u), u, one);
      ei::pstoreu(d + i, ei::pmadd(ei::pmul(v, one_minus_u2), ei::pmadd(dc2, v2, dc0), s));
    }
  }
}

}  // namespace

void value_and_derivative(Activation act, const float* x, float* y, float* d, float* u, std::int64_t p) {
  const CVec v(x, p);
  OVec uo(u, p);
  const CVec uc(u, p);
  auto both = [&](auto term, auto value, auto derivative) {
    uo = term(v);
    if (y != nullptr) OVec(y, p) = value(v, uc);
    if (d != nullptr) OVec(d, p) = derivative(v, uc);
  };
  switch (act) {
    case Activation::gelu:
      if (y != nullptr && d != nullptr) gelu_tanh_packets<true, true>(x, y, d, p);
      else if (y != nullptr) gelu_tanh_packets<true, false>(x, y, nullptr, p);
      else if (d != nullptr) gelu_tanh_packets<false, true>(x, nullptr, d, p);
      break;
    case Activation::gelu_exact:
      both([](const CVec& v) { return gelu_erf_term(v); }, [](const CVec& v, const CVec& u) { return gelu_erf_value(v, u); },
           [](const CVec& v, const CVec& u) { return gelu_erf_derivative(v, u); });
      break;
    case Activation::silu:
      both([](const CVec& v) { return silu_term(v); }, [](const CVec& v, const CVec& u) { return silu_value(v, u); },
           [](const CVec& v, const CVec& u) { return silu_derivative(v, u); });
      break;
    default: break;  // the others take their derivative from the output
  }
}

void grad_from_input(Activation act, const CVec& g, const CVec& v, OVec& out) {
  value_and_derivative(act, v.data(), nullptr, out.data(), out.data(), v.size());  // u, then d over it
  out = g * out;
}

}  // namespace linum::ops::detail::activation_math
