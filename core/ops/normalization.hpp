// Fused layer and RMS normalization over the trailing axes of x, with their backward rules.
//
//   Array y = layer_norm(x, scale, bias, {.num_axes = 1, .epsilon = 1e-6});  // Flax's LayerNorm math
//   Array z = rms_norm(x, scale, {.epsilon = 1e-6});                           // Flax's RMSNorm math
//
// One pass computes each row's statistics (mean and 1 / sqrt(var + epsilon), in float32) and the
// normalized output; backward keeps only x, the params and those two floats per row (the composed
// form keeps two x-sized arrays more), recomputing the normalized value from them.
// Rows are the leading axes of x, features the trailing `num_axes`; `scale` and `bias` are
// undefined (not used) or have the features' shape. bf16 inputs and params are computed in
// float32; the output has `dtype` or, when not given, the promotion of x, scale and bias (Flax).
// Gradients of scale and bias are summed over rows in a fixed order (bitwise reproducible).
#pragma once

#include <linum/core/array.hpp>

#include <optional>

namespace linum {

struct NormOptions {
  int num_axes = 1;              // trailing axes normalized together
  double epsilon = 1e-6;
  bool fast_variance = true;     // var = E[x^2] - E[x]^2 (clamped at 0), as Flax's use_fast_variance
  std::optional<DType> dtype;    // the output dtype (default: promote x, scale, bias)
};

// (x - mean) * rsqrt(var + epsilon) * scale + bias.
Array layer_norm(const Array& x, const Array& scale, const Array& bias, const NormOptions& options = {});
// x * rsqrt(mean(x^2) + epsilon) * scale.
Array rms_norm(const Array& x, const Array& scale, const NormOptions& options = {});

}  // namespace linum
