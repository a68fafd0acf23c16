// Embed: a table of learned vectors indexed by integers, as Flax's `nn.Embed`.
//
//   nn::Embed embed{.num_embeddings = 1000, .features = 64};
//   Array h = s("embed", embed, tokens);                              // int32 [B, T] -> [B, T, 64]
//   Array logits = s.call("embed", &nn::Embed::attend, embed, h);     // [B, T, 1000], shared table
//
// Param: "embedding" (num_embeddings, features), drawn by Flax's default_embed_init
// (variance_scaling(1, fan_in, normal, out_axis = 0)). To use the same table in `attend`, call it
// under the same explicit name as the lookup (an auto-named call would create a second table).
#pragma once

#include <linum/core/array.hpp>
#include <linum/modules/initializers.hpp>
#include <linum/nn/dtypes.hpp>
#include <linum/modules/scope.hpp>

#include <cstdint>
#include <optional>

namespace linum::nn {

// Flax's default_embed_init: variance_scaling(1.0, fan_in, normal, in_axis = -2, out_axis = 0),
// i.e. normal values with variance 1 / features for a (num_embeddings, features) table.
Initializer default_embed_init();

// An embedding table.
struct Embed {
  std::int64_t num_embeddings = 0;                 // vocabulary size (required, > 0)
  std::int64_t features = 0;                       // vector size (required, > 0)
  Initializer embedding_init = default_embed_init();
  std::optional<DType> dtype;                                 // computation dtype; nullopt: promote inputs and params
  DType param_dtype = DType::f32;                             // dtype the params are created in

  // Looks up int32 `indices` of any shape: the result has shape indices.shape + (features,).
  // Negative indices count from the end (as jnp.take); indices outside [-num_embeddings,
  // num_embeddings) are a ValueError (Flax returns NaN rows). With num_embeddings == 1 the single
  // vector is broadcast, as in Flax.
  void validate() const;  // ValueError naming an out-of-range field (on each call and on config load)
  Array operator()(Scope& s, const Array& indices) const;

  // The inner products of `query` ([..., features]) with every embedding: query @ embedding.T,
  // shape [..., num_embeddings]. Used to tie input and output embeddings.
  Array attend(Scope& s, const Array& query) const;
};

}  // namespace linum::nn
