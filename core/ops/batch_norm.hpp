// Fused batch normalization over every axis but the last (channels last, Flax's default axis = -1),
// with its backward rule.
//
//   auto [y, mean, var] = batch_norm(x, scale, bias, {.epsilon = 1e-5});   // training: batch statistics
//   Array z = batch_norm(x, running_mean, running_var, scale, bias, {});    // evaluation: given statistics
//
// Training computes each channel's batch mean and biased variance (float32, Flax's fast variance
// E[x^2] - E[x]^2 clamped at 0 by default) and y = (x - mean) * (rsqrt(var + epsilon) * scale) + bias
// in two passes over x; backward is two passes over x and the cotangent (the composed form is about
// ten, most of them broadcasts along a short channel axis). The statistics are outputs too (shape
// [C], float32; nn::BatchNorm moves its running averages with them) and differentiable like the
// composed mean and variance. Sums run over row blocks fixed by the shape and are added in block
// order, so the results are the same bits on any number of threads. bf16 inputs and params are
// computed in float32; y has `dtype` or, when not given, the promotion of x, scale and bias (Flax).
// `scale` and `bias` are undefined (not used) or of shape [C].
//
// What follows the normalization in a residual network can be part of the op (as oneDNN's
// fuse_norm_relu and TensorFlow's _FusedBatchNormEx with a side input; XLA fuses the same chain
// when Flax writes it):
//
//   auto r = batch_norm(h, scale, bias, {.residual = x, .activation = Activation::relu});  // relu(x + bn(h))
//
// y = activation(residual + normalized), the same values as the ops written out (normalized rounded
// to y's dtype, the sum rounded, then the activation). In training mode relu and none run inside
// the normalization's second pass, which reads the residual as it writes y (the composed form makes
// two more passes over the activations, and so does every recomputation under remat); backward
// recomputes relu's mask from x and the residual in the pass that sums the cotangent per channel
// (the op keeps neither y nor a mask) and hands the selected cotangent to the residual and the
// normalization. Other activations, a residual of another shape or dtype than y, vmapped inputs and
// evaluation mode run as the composed ops (the same values, not fused).
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/ops/linear.hpp>

#include <optional>

namespace linum {

struct BatchNormOptions {
  double epsilon = 1e-5;
  bool fast_variance = true;     // var = E[x^2] - E[x]^2 (clamped at 0), as Flax's use_fast_variance
  std::optional<DType> dtype;    // y's dtype (default: promote x, scale, bias)
  Array residual;                // added to the normalized x before the activation (undefined: none)
  Activation activation = Activation::none;  // applied last
};

struct BatchNormResult {
  Array y;     // x's shape
  Array mean;  // [C], float32
  Array var;   // [C], float32 (biased)
};

// Training mode: normalizes x with the statistics of the batch (every axis but the last).
BatchNormResult batch_norm(const Array& x, const Array& scale, const Array& bias, const BatchNormOptions& options = {});

// Evaluation mode: y = (x - mean) * (rsqrt(var + epsilon) * scale) + bias with given statistics of
// shape [C] (the running averages), in one pass.
Array batch_norm(const Array& x, const Array& mean, const Array& var, const Array& scale, const Array& bias,
                 const BatchNormOptions& options = {});

}  // namespace linum
