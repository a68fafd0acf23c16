// Activation functions in `linum::nn`, as `flax.linen` re-exports them from `jax.nn`.
//
// The core ones (relu, gelu, silu, sigmoid, tanh, softplus, softmax, log_softmax, logsumexp,
// one_hot) are the ops of <linum/core/ops/all.hpp>; the rest are composed from ops here, so their
// gradients come from the ops' backward rules.
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/ops/all.hpp>

namespace linum::nn {

using linum::gelu;         // tanh approximation by default (approximate = true), as jax.nn.gelu
using linum::log_softmax;
using linum::logsumexp;
using linum::one_hot;
using linum::relu;
using linum::sigmoid;
using linum::silu;
using linum::softmax;
using linum::softplus;
using linum::tanh;

// x * sigmoid(x); the same function as silu (jax.nn.swish).
inline Array swish(const Array& x) { return silu(x); }

// log(sigmoid(x)) = -softplus(-x), as jax.nn.log_sigmoid.
inline Array log_sigmoid(const Array& x) { return -softplus(-x); }

// x where x >= 0, negative_slope * x elsewhere (jax.nn.leaky_relu).
inline Array leaky_relu(const Array& x, float negative_slope = 1e-2f) {
  return where(greater_equal(x, Array::scalar(0.0f)), x, x * negative_slope);
}

// x where x > 0, alpha * (exp(x) - 1) elsewhere (jax.nn.elu; JAX uses expm1, so values very
// close to 0 differ in the last bits).
inline Array elu(const Array& x, float alpha = 1.0f) {
  Array positive = greater(x, Array::scalar(0.0f));
  Array safe = where(positive, Array::scalar(0.0f), x);  // keeps exp finite on the unused branch
  return where(positive, x, alpha * (exp(safe) - 1.0f));
}

// min(max(x, 0), 6) (jax.nn.relu6).
inline Array relu6(const Array& x) { return clip(x, 0.0f, 6.0f); }

// clip(x, -1, 1) (jax.nn.hard_tanh).
inline Array hard_tanh(const Array& x) { return clip(x, -1.0f, 1.0f); }

// relu6(x + 3) / 6 (jax.nn.hard_sigmoid).
inline Array hard_sigmoid(const Array& x) { return relu6(x + 3.0f) / 6.0f; }

// x * hard_sigmoid(x) (jax.nn.hard_silu, also hard_swish).
inline Array hard_silu(const Array& x) { return x * hard_sigmoid(x); }

// scale * elu(x, alpha) with the constants of jax.nn.selu.
inline Array selu(const Array& x) {
  constexpr float alpha = 1.6732632423543772848170429916717f;
  constexpr float scale = 1.0507009873554804934193349852946f;
  return scale * elu(x, alpha);
}

}  // namespace linum::nn
