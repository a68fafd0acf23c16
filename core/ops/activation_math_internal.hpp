// Internal: the activations' values and derivatives on float32 runs (Eigen array expressions; gelu's
// tanh form as one loop of Eigen packets), shared by the activation ops (elementwise.cpp) and the
// fused linear op (linear.cpp), so every path computes each element the same way, bit for bit. Not
// installed (pulls in Eigen).
//
// relu, tanh and sigmoid take their derivative from their output. gelu (both forms) and silu take it
// from their input, through the transcendental their value also needs: `value_and_derivative`
// computes both from one evaluation of it, so the fused linear op can keep the derivative instead of
// the pre-activation and its backward pass is a product (no second tanh, erf or exp).
#pragma once

#include <linum/core/ops/linear.hpp>

#include <Eigen/Core>
#include <cstdint>

namespace linum::ops::detail::activation_math {

using CVec = Eigen::Map<const Eigen::ArrayXf>;
using OVec = Eigen::Map<Eigen::ArrayXf>;

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCoeff = 0.044715f;
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;

// ---- from the output: g * act'(x) as an expression (the result may be written over g) ----------
// g * relu'(x) from y = relu(x): y > 0 exactly where x > 0 (gradient 0 at 0, as jax.nn.relu).
inline auto relu_grad(const CVec& g, const CVec& y) { return (y > 0.0f).select(g, 0.0f); }
// g * tanh'(x) from y = tanh(x).
inline auto tanh_grad(const CVec& g, const CVec& y) { return g * (1.0f - y.square()); }
// g * sigmoid'(x) from y = sigmoid(x).
inline auto sigmoid_grad(const CVec& g, const CVec& y) { return g * y * (1.0f - y); }

// Whether act's derivative is computed from its input (gelu, gelu_exact, silu).
constexpr bool derivative_from_input(Activation act) {
  return act == Activation::gelu || act == Activation::gelu_exact || act == Activation::silu;
}

// For an activation whose derivative reads its input: y = act(x) and/or d = act'(x) (either pointer
// may be null), p floats each (a whole number of packets), from one evaluation of the shared term
// (into `u`, p floats of scratch not aliasing x, where the activation needs it). d may be x's own
// memory or u's (each element is read before it is written).
// Compiled once (activation_math.cpp), so every caller gets the same bits whatever the compiler
// would contract into fused multiply-adds in its own translation unit.
void value_and_derivative(Activation act, const float* x, float* y, float* d, float* u, std::int64_t p);

// out = g * act'(x) for an activation whose derivative reads its input x: the derivative (through
// `out` as scratch), then the product. out must alias neither g nor x. Compiled once, as above.
void grad_from_input(Activation act, const CVec& g, const CVec& v, OVec& out);

}  // namespace linum::ops::detail::activation_math
