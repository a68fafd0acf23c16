// Fused scaled dot-product attention: softmax(scale * q . k^T, masked) . v in one op whose backward
// recomputes the attention weights instead of keeping them (as jax.nn.dot_product_attention,
// PyTorch's scaled_dot_product_attention and FlashAttention do).
//
//   Array y = scaled_dot_product_attention(q, k, v, {.is_causal = true});
//
// Layout (Flax's and JAX's): q [batch..., q_len, heads, head_dim], k [batch..., kv_len, heads,
// head_dim], v [batch..., kv_len, heads, v_dim] -> [batch..., q_len, heads, v_dim].
//
// What it keeps for backward: q, k, v, the output and two float32 numbers per query row (the row
// maximum and the inverse row sum), never the [batch..., heads, q_len, kv_len] weights; the mask is
// read in place through broadcasting strides, never expanded. Logits, softmax and products run in
// float32 (bf16 inputs are widened), the output is rounded once to the inputs' dtype. Masked
// logits take float32's lowest value, so a query row with nothing to attend to averages every
// value uniformly, as Flax's composed attention does.
#pragma once

#include <linum/core/array.hpp>

#include <optional>

namespace linum {

struct ScaledDotProductAttentionOptions {
  Array mask;                  // broadcastable to [batch..., heads, q_len, kv_len]; attend where nonzero
  bool is_causal = false;      // query i attends key j only when j <= i (aligned at the top left)
  std::optional<float> scale;  // multiplies q . k^T; default 1 / sqrt(head_dim)
};

Array scaled_dot_product_attention(const Array& q, const Array& k, const Array& v,
                                   const ScaledDotProductAttentionOptions& options = {});

}  // namespace linum
