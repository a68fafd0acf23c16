// Dot-product attention and MultiHeadDotProductAttention, as Flax's `nn.dot_product_attention`
// and `nn.MultiHeadDotProductAttention`.
//
//   nn::MultiHeadDotProductAttention mha{.num_heads = 4};
//   Array y = s(mha, x);                                                 // self-attention
//   Array m = nn::make_causal_mask(tokens);                              // [B, 1, T, T]
//   Array z = s(mha, x, nn::AttentionArgs{.mask = m, .deterministic = !train});
//   Array c = s(nn::MultiHeadDotProductAttention{.num_heads = 8}, q, kv, nn::AttentionArgs{});   // cross
//
// Layouts are Flax's: queries/keys/values [batch..., length, heads, head_dim], attention weights
// [batch..., heads, q_length, kv_length], masks broadcastable to the weights with 1 (or any nonzero)
// meaning "attend". Masked logits are replaced by the lowest float32 before the softmax, so a row
// with nothing to attend to becomes uniform, as in Flax.
#pragma once

#include <linum/core/array.hpp>
#include <linum/modules/initializers.hpp>
#include <linum/nn/dtypes.hpp>
#include <linum/modules/scope.hpp>
#include <linum/rng/key.hpp>

#include <cstdint>
#include <optional>
#include <vector>

namespace linum::nn {

// Options of dot_product_attention_weights / dot_product_attention.
struct DotProductAttentionOptions {
  Array bias;                           // added to the logits if defined (broadcastable to the weights)
  Array mask;                           // attend where nonzero, if defined (broadcastable to the weights)
  bool broadcast_dropout = true;        // one dropout mask shared over the batch and head axes
  std::optional<rng::Key> dropout_rng;  // required when dropout is active
  double dropout_rate = 0.0;
  bool deterministic = false;           // no dropout when true
  Scope* sow_scope = nullptr;           // if set, the weights (after softmax, before dropout) are sown
                                        // into "intermediates" as "attention_weights" there
  bool is_causal = false;               // query i attends key j only when j <= i (with `mask`, both apply)
};

// softmax(query . key / sqrt(head_dim) [+ bias, masked]) with optional dropout.
// query [..., q, h, d], key [..., k, h, d] -> weights [..., h, q, k].
Array dot_product_attention_weights(const Array& query, const Array& key, const DotProductAttentionOptions& options = {});

// The attention-weighted sum of `value`: query [..., q, h, d], key [..., k, h, d],
// value [..., k, h, dv] -> [..., q, h, dv]. Without bias, active dropout or sown weights it runs as
// one fused op (core/ops/attention.hpp: the weights are recomputed in backward, never kept);
// otherwise as Flax composes it.
Array dot_product_attention(const Array& query, const Array& key, const Array& value,
                            const DotProductAttentionOptions& options = {});

// Flax's make_attention_mask with pairwise_fn = multiply: query_input [batch..., q] and
// key_input [batch..., k] (float32 0/1 or int32 validity) -> float32 [batch..., 1, q, k], with
// `extra_batch_dims` leading axes of size 1 added.
Array make_attention_mask(const Array& query_input, const Array& key_input, int extra_batch_dims = 0);

// Flax's make_causal_mask: for x of shape [batch..., len] (only the shape is used), the float32
// mask [batch..., 1, len, len] with 1 where key position <= query position.
Array make_causal_mask(const Array& x, int extra_batch_dims = 0);
// The same from the shape alone, no array needed: make_causal_mask(Shape{batch, len}) is [batch, 1,
// len, len]; make_causal_mask(Shape{len}) is [1, len, len].
Array make_causal_mask(const Shape& shape, int extra_batch_dims = 0);

// Elementwise logical AND of the defined masks (all of the same rank) as float32 0/1; undefined
// if none is defined.
Array combine_masks(const std::vector<Array>& masks);

// Call arguments of MultiHeadDotProductAttention (Flax's keyword arguments).
struct AttentionArgs {
  Array mask;                           // [batch, heads or 1, q, kv], attend where nonzero
  std::optional<bool> deterministic;    // set here or on the module, not both (only needed with dropout)
  std::optional<rng::Key> dropout_rng;  // default: a key from the "dropout" stream
  bool sow_weights = false;             // sow the attention weights into "intermediates"
  bool is_causal = false;               // causal self-attention without building a mask (as
                                        // jax.nn.dot_product_attention's is_causal); combines with mask
};

// Multi-head dot-product attention. Params (children): "query", "key", "value" are DenseGeneral
// with kernels (in, num_heads, head_dim) and biases (num_heads, head_dim); "out" is DenseGeneral
// over the last two axes with kernel (num_heads, head_dim, out_features) and bias (out_features,).
// With normalize_qk, LayerNorms "query_ln" and "key_ln" (no bias) follow the projections.
struct MultiHeadDotProductAttention {
  std::int64_t num_heads = 0;                    // required, must divide qkv_features
  std::optional<std::int64_t> qkv_features;      // default: inputs_q.dim(-1)
  std::optional<std::int64_t> out_features;      // default: inputs_q.dim(-1)
  bool broadcast_dropout = true;
  double dropout_rate = 0.0;
  std::optional<bool> deterministic;
  Initializer kernel_init = initializers::lecun_normal();
  Initializer out_kernel_init;                   // empty: kernel_init
  Initializer bias_init = initializers::zeros();
  Initializer out_bias_init;                     // empty: bias_init
  bool use_bias = true;
  bool normalize_qk = false;
  std::optional<DType> dtype;                                 // computation dtype; nullopt: promote inputs and params
  DType param_dtype = DType::f32;                             // dtype the params are created in
  // Autoregressive decoding (Flax's decode=True): init with a full-length input creates the "cache"
  // collection -- cached_key and cached_value [batch..., max_length, heads, head_dim] (zeros) and
  // cache_index (int32 0); each later call takes one position ([batch..., 1, features]), writes its
  // key and value at cache_index, attends to the positions written so far, and advances the index.
  // Apply with mutable_collections = {"cache"}:
  //   Tree cache = init(model, key, tokens).at("cache");                     // tokens [B, max_len]
  //   auto [y, upd] = apply(model, {{"params", p}, {"cache", cache}}, {.mutable_collections = {"cache"}}, tok_t);
  //   cache = upd.at("cache");
  bool decode = false;

  // Self-attention over inputs_q [batch..., length, features].
  void validate() const;  // ValueError naming an out-of-range field (on each call and on config load)
  Array operator()(Scope& s, const Array& inputs_q, const AttentionArgs& args = {}) const;
  // Attention of inputs_q over inputs_kv (keys and values from the same input).
  Array operator()(Scope& s, const Array& inputs_q, const Array& inputs_kv, const AttentionArgs& args = {}) const;
  // Attention with separate key and value inputs.
  Array operator()(Scope& s, const Array& inputs_q, const Array& inputs_k, const Array& inputs_v,
                   const AttentionArgs& args = {}) const;
};

}  // namespace linum::nn
