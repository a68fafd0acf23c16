// Dense and DenseGeneral: linear layers, as Flax's `nn.Dense` and `nn.DenseGeneral`.
//
//   Array y = s(nn::Dense{.features = 10}, x);                       // kernel (x.dim(-1), 10), bias (10,)
//   Array h = s(nn::DenseGeneral{.features = {4, 8}}, x);            // kernel (in, 4, 8), bias (4, 8)
//   Array o = s(nn::DenseGeneral{.features = {16}, .axis = {-2, -1}}, h);   // kernel (4, 8, 16)
//   Array a = s(nn::Dense{.features = 512, .activation = Activation::gelu}, x);  // gelu(x @ kernel + bias)
//
// Both run on the fused linear op (core/ops/linear.hpp): the bias is added in the product's
// epilogue, and an `activation` (Keras's Dense(activation=...); Flax applies it as a separate call)
// is applied in the same op, whose backward pass computes the activation's derivative and the bias
// gradient in one pass. nn::gelu(s(nn::Dense{...}, x)) gives the same values as .activation = gelu;
// the fused form passes over the activations fewer times. A remat policy that saves products saves
// a fused Dense's output with what the op keeps for its backward pass (the output, or gelu's and
// silu's derivative; see linear.hpp).
//
// Parameter names, shapes, defaults and initializer calls are Flax's, so variable dicts move
// between the two and the same key gives the same parameters.
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/ops/linear.hpp>
#include <linum/modules/initializers.hpp>
#include <linum/nn/dtypes.hpp>
#include <linum/modules/scope.hpp>

#include <cstdint>
#include <optional>
#include <vector>

namespace linum::nn {

// y = activation(x @ kernel + bias) over the last axis of x (any rank >= 1).
// Params: "kernel" (x.dim(-1), features), "bias" (features,).
struct Dense {
  std::int64_t features = 0;                                  // output size (required, > 0)
  bool use_bias = true;                                       // add the "bias" param
  Initializer kernel_init = initializers::lecun_normal();     // Flax's default_kernel_init
  Initializer bias_init = initializers::zeros();
  std::optional<DType> dtype;                                 // computation dtype; nullopt: promote inputs and params
  DType param_dtype = DType::f32;                             // dtype the params are created in
  Activation activation = Activation::none;                   // applied to the result, in the same op

  // The layer applied to `x` ([..., in] -> [..., features]).
  void validate() const;  // ValueError naming an out-of-range field (on each call and on config load)
  Array operator()(Scope& s, const Array& x) const;
};

// A linear map contracting the input axes `axis` against a kernel of shape
// (x.shape[axis]..., features...); the output has x's other axes followed by `features`.
// As in Flax, the initializers see the kernel flattened to (prod(input dims), prod(features))
// (and the bias to (prod(features),)) and the result is reshaped, so fans are those of that
// matrix. Flax's `batch_dims` is not supported.
struct DenseGeneral {
  std::vector<std::int64_t> features;                         // output feature dims (required)
  std::vector<int> axis = {-1};                               // input axes to contract (sorted after normalising)
  bool use_bias = true;                                       // add the "bias" param (shape `features`)
  Initializer kernel_init = initializers::lecun_normal();
  Initializer bias_init = initializers::zeros();
  std::optional<DType> dtype;                                 // computation dtype; nullopt: promote inputs and params
  DType param_dtype = DType::f32;                             // dtype the params are created in
  Activation activation = Activation::none;                   // applied to the result, in the same op

  // The layer applied to `x`.
  void validate() const;  // ValueError naming an out-of-range field (on each call and on config load)
  Array operator()(Scope& s, const Array& x) const;
};

}  // namespace linum::nn
