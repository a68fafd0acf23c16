// Normalization layers, as Flax's `nn.LayerNorm`, `nn.RMSNorm`, `nn.GroupNorm`, `nn.InstanceNorm` and
// `nn.BatchNorm`.
//
//   x = s(nn::LayerNorm{}, x);                                    // over the last axis
//   x = s(nn::GroupNorm{.num_groups = 8}, x);                     // NHWC, groups of channels
//   x = s(nn::BatchNorm{}, x, /*use_running_average=*/!train);    // "batch_stats" mean/var
//
// Numerics follow Flax: statistics in float32 with the fast variance E[x^2] - E[x]^2 clipped at
// zero (use_fast_variance = true), then y = (x - mean) * (rsqrt(var + epsilon) * scale) + bias.
// Params are "scale" (ones) and "bias" (zeros) with the shape of the feature axes. Hyperparameters
// that are Python floats in Flax are doubles here and enter the float32 arithmetic the same way.
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/ops/linear.hpp>
#include <linum/modules/initializers.hpp>
#include <linum/nn/dtypes.hpp>
#include <linum/modules/scope.hpp>

#include <optional>
#include <vector>

namespace linum::nn {

// Layer normalization: statistics over `reduction_axes` of each example; scale and bias per
// element of `feature_axes`.
struct LayerNorm {
  double epsilon = 1e-6;
  bool use_bias = true;
  bool use_scale = true;
  Initializer bias_init = initializers::zeros();
  Initializer scale_init = initializers::ones();
  std::vector<int> reduction_axes = {-1};
  std::vector<int> feature_axes = {-1};
  bool use_fast_variance = true;

  std::optional<DType> dtype;                                 // computation dtype; nullopt: promote inputs and params
  DType param_dtype = DType::f32;                             // dtype the params are created in
  // Normalizes `x`; same shape out. Statistics and normalization run in float32 (or wider); the
  // result is cast to `dtype` (default: the promotion of x and the params), as Flax does.
  void validate() const;  // ValueError naming an out-of-range field (on each call and on config load)
  Array operator()(Scope& s, const Array& x) const;
};

// Root-mean-square normalization: x * rsqrt(mean(x^2) + epsilon) * scale (no centring, no bias).
struct RMSNorm {
  double epsilon = 1e-6;
  bool use_scale = true;
  Initializer scale_init = initializers::ones();
  std::vector<int> reduction_axes = {-1};
  std::vector<int> feature_axes = {-1};
  bool use_fast_variance = true;  // unused without the mean; kept for configuration parity with Flax

  std::optional<DType> dtype;                                 // computation dtype; nullopt: promote inputs and params
  DType param_dtype = DType::f32;                             // dtype the params are created in
  // Normalizes `x`; same shape out. Statistics and normalization run in float32 (or wider); the
  // result is cast to `dtype` (default: the promotion of x and the params), as Flax does.
  void validate() const;  // ValueError naming an out-of-range field (on each call and on config load)
  Array operator()(Scope& s, const Array& x) const;
};

// Group normalization: the channels (last axis) are split into groups and each example is
// normalized per group over `reduction_axes` (default: every axis but the first). Exactly one of
// num_groups / group_size must be set (pass `.num_groups = std::nullopt` to use group_size).
struct GroupNorm {
  std::optional<int> num_groups = 32;
  std::optional<int> group_size;
  double epsilon = 1e-6;
  bool use_bias = true;
  bool use_scale = true;
  Initializer bias_init = initializers::zeros();
  Initializer scale_init = initializers::ones();
  std::optional<std::vector<int>> reduction_axes;  // must include the last axis; default 1..rank-1
  bool use_fast_variance = true;

  std::optional<DType> dtype;                                 // computation dtype; nullopt: promote inputs and params
  DType param_dtype = DType::f32;                             // dtype the params are created in
  // Normalizes `x` ([N, ..., C]); same shape out. Params "scale"/"bias" of shape (C,).
  void validate() const;  // ValueError naming an out-of-range field (on each call and on config load)
  Array operator()(Scope& s, const Array& x) const;
};

// Instance normalization (flax.linen.InstanceNorm, Ulyanov et al. 2016): each example and each
// feature normalized on its own, over every axis but the batch axis (the first) and `feature_axes`
// (an image [N, H, W, C]: over H and W per example and channel). Params "scale" / "bias" of the
// shape of the feature axes. The first axis cannot be a feature axis; an input with no axis left to
// normalize over ([N, C]) is a ShapeError.
struct InstanceNorm {
  double epsilon = 1e-6;
  bool use_bias = true;
  bool use_scale = true;
  Initializer bias_init = initializers::zeros();
  Initializer scale_init = initializers::ones();
  std::vector<int> feature_axes = {-1};
  bool use_fast_variance = true;

  std::optional<DType> dtype;                                 // computation dtype; nullopt: promote inputs and params
  DType param_dtype = DType::f32;                             // dtype the params are created in
  void validate() const;  // ValueError naming an out-of-range field (on each call and on config load)
  Array operator()(Scope& s, const Array& x) const;
};

// Batch normalization with running statistics in the "batch_stats" collection ("mean" zeros,
// "var" ones, shape of the feature axis).
//
// Training (use_running_average false): normalizes with the batch mean and (biased) variance over
// every axis but `axis`; when "batch_stats" is mutable and the call is not init, the running
// statistics become momentum * old + (1 - momentum) * batch. At init they are not updated (as
// Flax). Flax raises when "batch_stats" is not mutable in training mode; here the statistics are
// then simply left unchanged. Evaluation (use_running_average true): normalizes with the stored
// statistics. `use_running_average` is set either on the module or per call, not both (Flax's
// merge_param).
//
// `activation` is applied to the result in the same op (as nn::Dense's), and a residual given to
// the call is added before it: s(nn::BatchNorm{.activation = Activation::relu}, h, !train, x) is
// relu(x + s(nn::BatchNorm{}, h, !train)), the end of a ResNet block, with the same values, in the
// passes of the normalization (ops/batch_norm.hpp says when it is fused).
struct BatchNorm {
  std::optional<bool> use_running_average;
  int axis = -1;                  // the feature axis
  double momentum = 0.99;
  double epsilon = 1e-5;
  bool use_bias = true;
  bool use_scale = true;
  Initializer bias_init = initializers::zeros();
  Initializer scale_init = initializers::ones();
  bool use_fast_variance = true;

  std::optional<DType> dtype;                                 // computation dtype; nullopt: promote inputs and params
  DType param_dtype = DType::f32;                             // dtype the params are created in
  Activation activation = Activation::none;                   // applied to the result, in the same op
  // Normalizes `x`; same shape out. Statistics and normalization run in float32 (or wider); the
  // result is cast to `dtype` (default: the promotion of x and the params), as Flax does.
  void validate() const;  // ValueError naming an out-of-range field (on each call and on config load)
  Array operator()(Scope& s, const Array& x, std::optional<bool> use_running_average = std::nullopt) const;
  // activation(residual + the normalized x); `residual` has x's shape (or broadcasts to it).
  Array operator()(Scope& s, const Array& x, std::optional<bool> use_running_average, const Array& residual) const;
};

// Flax's merge_param: the value given either on the module or in the call. Throws ValueError
// naming `layer` and `name` if both or neither are given.
bool merge_param(const char* layer, const char* name, std::optional<bool> module_value, std::optional<bool> call_value);

}  // namespace linum::nn
