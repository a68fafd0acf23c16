// The activations whose derivative reads their input, compiled in one place (see
// activation_math_internal.hpp): the gelu and silu ops and the fused linear op call these.
#include <linum/core/ops/activation_math_internal.hpp>

#include <unsupported/Eigen/SpecialFunctions>

namespace linum::ops::detail::activation_math {
namespace {

// ---- from the input: each activation's shared term u, its value and its derivative from (x, u) ---
// gelu, tanh approximation: u = tanh(sqrt(2/pi) (x + 0.044715 x^3)).
auto gelu_tanh_term(const CVec& v) { return (kSqrt2OverPi * (v + kGeluCoeff * v.cube())).tanh(); }
auto gelu_tanh_value(const CVec& v, const CVec& u) { return v * (0.5f * (1.0f + u)); }
auto gelu_tanh_derivative(const CVec& v, const CVec& u) {
  return 0.5f * (1.0f + u) + 0.5f * v * (1.0f - u.square()) * kSqrt2OverPi * (1.0f + 3.0f * kGeluCoeff * v.square());
}
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
      both([](const CVec& v) { return gelu_tanh_term(v); }, [](const CVec& v, const CVec& u) { return gelu_tanh_value(v, u); },
           [](const CVec& v, const CVec& u) { return gelu_tanh_derivative(v, u); });
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
