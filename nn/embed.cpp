#include <linum/nn/embed.hpp>

#include <linum/core/ops/all.hpp>
#include <linum/rng/random.hpp>

#include <cmath>

#include <vector>

namespace linum::nn {

Initializer default_embed_init() {
  // initializers::variance_scaling refuses in_axis and out_axis naming the same axis, which is
  // exactly what Flax's default does for a (num_embeddings, features) table (-2 and 0). JAX then
  // computes receptive = prod(shape) / in / out and fan_in = in * receptive (= features) in
  // Python floats; the same arithmetic here, then normal * sqrt(float32(1 / fan_in)).
  return [](rng::Key key, const Shape& shape) {
    if (shape.rank() < 2 || shape.numel() == 0)
      throw ShapeError(detail::cat("default_embed_init: needs a non-empty shape of rank >= 2, got ", shape));
    const double in = static_cast<double>(shape.dim(-2));
    const double out = static_cast<double>(shape.dim(0));
    const double receptive = static_cast<double>(shape.numel()) / in / out;
    const double fan_in = in * receptive;
    const float variance = static_cast<float>(1.0 / fan_in);
    return rng::normal(key, shape) * std::sqrt(variance);
  };
}

namespace {

Array embedding_param(Scope& s, const Embed& e) {
  e.validate();
  Array table = s.param("embedding", initializer_in(e.embedding_init, e.param_dtype), Shape{e.num_embeddings, e.features});
  return e.dtype && table.dtype() != *e.dtype ? astype(table, *e.dtype) : table;  // Flax: promote_dtype(embedding, dtype)
}

}  // namespace

void Embed::validate() const {
  if (num_embeddings <= 0 || features <= 0)
    throw ValueError(detail::cat("Embed: num_embeddings and features must be positive (got ", num_embeddings, " and ",
                                 features, "); construct it as nn::Embed{.num_embeddings = V, .features = D}"));
  require_float_dtype(param_dtype, "Embed", "param_dtype");
}

Array Embed::operator()(Scope& s, const Array& indices) const {
  Array table = embedding_param(s, *this);
  if (indices.dtype() != DType::i32)
    throw ValueError(detail::cat("Embed: indices must be int32, got ", dtype_name(indices.dtype()), " of shape ",
                                 indices.shape(), "; convert them with astype(x, DType::i32)"));
  if (num_embeddings == 1) {
    Shape out = indices.shape();
    out.push_back(features);
    return broadcast_to(table, out);
  }
  // Wrap negative indices once (as jnp.take); anything else out of range is an error. Inside vmap
  // the check reads every example's indices (the physical array) and take batches.
  const Array all = indices.physical();
  const std::int32_t* raw = all.data_i32();
  bool negative = false;
  for (std::int64_t i = 0; i < all.numel(); ++i) {
    if (raw[i] < -num_embeddings || raw[i] >= num_embeddings)
      throw ValueError(detail::cat("Embed: index ", raw[i], " (at flat position ", i, " of indices of shape ",
                                   all.shape(), ") is out of range for num_embeddings = ", num_embeddings));
    negative = negative || raw[i] < 0;
  }
  Array idx = indices;
  if (negative) {
    std::vector<std::int32_t> wrapped(raw, raw + all.numel());
    for (auto& v : wrapped)
      if (v < 0) v += static_cast<std::int32_t>(num_embeddings);
    idx = Array::batched_view(Array::from_i32(all.shape(), wrapped), indices.batch_levels());
  }
  return take(table, idx, 0);
}

Array Embed::attend(Scope& s, const Array& query) const {
  Array table = embedding_param(s, *this);
  if (query.rank() < 1 || query.dim(-1) != features)
    throw ShapeError(detail::cat("Embed::attend: query of shape ", query.shape(), " must end in features = ", features));
  auto p = promote_dtype({query, table}, dtype);
  return dot_general(p[0], p[1], DotDims{.lhs_contracting = {query.rank() - 1}, .rhs_contracting = {1}});
}

}  // namespace linum::nn
