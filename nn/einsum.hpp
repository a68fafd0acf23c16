// A linear layer written as an einsum (flax.linen.Einsum): a "kernel" of a given shape contracted
// with the input by subscripts such as "btd,dhk->bthk" (the input first, the kernel second).
//
//   nn::Einsum qkv{.shape = {512, 8, 64}, .einsum_str = "btd,dhk->bthk"};
//   Array q = s(qkv, x);                                     // x [B, T, 512] -> [B, T, 8, 64]
//
// The subscripts are jnp.einsum's (core/ops/einsum.hpp), explicit ("->") and with exactly two
// operands; "..." may stand for leading input axes. The "bias" param has one entry per output
// axis that the kernel names (the shape of those kernel axes, in output order), broadcast over the
// others, as Flax's. Initializers see the kernel's own shape (lecun_normal: fan in = shape[-2] times
// the product of the leading axes). The subscripts are set on the module or given per call, not both.
#pragma once

#include <linum/core/array.hpp>
#include <linum/modules/initializers.hpp>
#include <linum/modules/scope.hpp>
#include <linum/nn/dtypes.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace linum::nn {

struct Einsum {
  std::vector<std::int64_t> shape;                            // the kernel's shape (required)
  std::string einsum_str;                                     // "input,kernel->output"; empty: given per call
  bool use_bias = true;
  Initializer kernel_init = initializers::lecun_normal();
  Initializer bias_init = initializers::zeros();
  std::optional<DType> dtype;                                 // computation dtype; nullopt: promote inputs and params
  DType param_dtype = DType::f32;                             // dtype the params are created in

  void validate() const;  // ValueError naming an out-of-range field (on each call and on config load)
  Array operator()(Scope& s, const Array& x) const;
  // With the subscripts given here (then einsum_str must be empty, as Flax's merge_param).
  Array operator()(Scope& s, const Array& x, std::string_view subscripts) const;
};

}  // namespace linum::nn
