// Internal: the derivatives of the activations, as Eigen array expressions on float32 runs, shared
// by the activation ops' backward rules (elementwise.cpp) and the fused linear op's backward pass
// (linear.cpp), so both compute every element the same way, bit for bit. `v` is what the op keeps:
// the input for gelu and silu, the output for relu, tanh and sigmoid. Not installed (pulls in Eigen).
#pragma once

#include <Eigen/Core>
#include <unsupported/Eigen/SpecialFunctions>

namespace linum::ops::detail::activation_math {

using CVec = Eigen::Map<const Eigen::ArrayXf>;
using OVec = Eigen::Map<Eigen::ArrayXf>;

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCoeff = 0.044715f;
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;

// Coefficient-wise expressions (the result may be written over g):
// g * relu'(x) from y = relu(x): y > 0 exactly where x > 0 (gradient 0 at 0, as jax.nn.relu).
inline auto relu_grad(const CVec& g, const CVec& y) { return (y > 0.0f).select(g, 0.0f); }
// g * tanh'(x) from y = tanh(x).
inline auto tanh_grad(const CVec& g, const CVec& y) { return g * (1.0f - y.square()); }
// g * sigmoid'(x) from y = sigmoid(x).
inline auto sigmoid_grad(const CVec& g, const CVec& y) { return g * y * (1.0f - y); }
// g * gelu'(x), with erf.
inline auto gelu_erf_grad(const CVec& g, const CVec& v) {
  return g * (0.5f * ((v * kInvSqrt2).erf() + 1.0f) + v * kInvSqrt2Pi * (-0.5f * v.square()).exp());
}

// Written into out, which must not alias g:
// out = g * gelu'(x), the tanh approximation.
inline void gelu_tanh_grad(const CVec& g, const CVec& v, OVec& out) {
  out = (kSqrt2OverPi * (v + kGeluCoeff * v.cube())).tanh();  // t, then the gradient in place
  out = g * (0.5f * (1.0f + out) + 0.5f * v * (1.0f - out.square()) * kSqrt2OverPi * (1.0f + 3.0f * kGeluCoeff * v.square()));
}
// out = g * silu'(x).
inline void silu_grad(const CVec& g, const CVec& v, OVec& out) {
  out = v.logistic();  // sigmoid(x), then the gradient in place
  out = g * out * (1.0f + v * (1.0f - out));
}

}  // namespace linum::ops::detail::activation_math
