#include <linum/nn/attention.hpp>

#include <linum/core/ops/all.hpp>
#include <linum/nn/dense.hpp>
#include <linum/nn/normalization.hpp>
#include <linum/rng/random.hpp>

#include <cmath>
#include <limits>

namespace linum::nn {

namespace {

void check_qkv(const Array& query, const Array& key, const Array* value) {
  auto fail = [&](const char* why) {
    throw ShapeError(detail::cat("dot_product_attention: ", why, " (query ", query.shape(), ", key ", key.shape(),
                                 value ? detail::cat(", value ", value->shape()) : std::string(),
                                 "); the layout is [batch..., length, heads, head_dim]"));
  };
  if (query.rank() < 3 || query.rank() != key.rank() || (value && value->rank() != query.rank()))
    fail("query, key and value must have the same rank, at least 3");
  const int r = query.rank();
  for (int a = 0; a < r - 3; ++a)
    if (query.dim(a) != key.dim(a) || (value && value->dim(a) != query.dim(a))) fail("batch dims must match");
  if (query.dim(-2) != key.dim(-2) || (value && value->dim(-2) != query.dim(-2))) fail("num_heads must match");
  if (query.dim(-1) != key.dim(-1)) fail("query and key depths must match");
  if (value && value->dim(-3) != key.dim(-3)) fail("key and value lengths must match");
}

// Attend where both masks attend (nonzero), as float32 0/1.
Array logical_and_mask(const Array& a, const Array& b) {
  auto as01 = [](const Array& m) { return not_equal(m.dtype() == DType::f32 ? m : astype(m, DType::f32), Array::scalar(0.0f)); };
  return as01(a) * as01(b);
}

// The shape of the attention weights: [batch..., heads, q_length, kv_length].
Shape weights_shape(const Array& query, const Array& key) {
  Shape w;
  for (int a = 0; a < query.rank() - 3; ++a) w.push_back(query.dim(a));
  w.push_back(query.dim(-2));
  w.push_back(query.dim(-3));
  w.push_back(key.dim(-3));
  return w;
}

// A mask or bias must broadcast to the weights; say which argument does not (before any op would
// report it under its own name).
void check_broadcasts(const Array& a, const char* what, const Array& query, const Array& key) {
  if (!a.defined()) return;
  const Shape w = weights_shape(query, key);
  bool ok = a.rank() <= w.rank();
  for (int i = 1; ok && i <= a.rank(); ++i) ok = a.dim(-i) == 1 || a.dim(-i) == w[w.rank() - i];
  if (!ok)
    throw ShapeError(detail::cat("dot_product_attention: the ", what, " of shape ", a.shape(),
                                 " does not broadcast to the attention weights [batch..., heads, q_length, kv_length] = ", w,
                                 " (query ", query.shape(), ", key ", key.shape(), "); give it size 1 on the axes it shares"));
}

std::vector<int> iota(int n, int start = 0) {
  std::vector<int> v(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = start + i;
  return v;
}

}  // namespace

Array dot_product_attention_weights(const Array& query, const Array& key, const DotProductAttentionOptions& o) {
  check_qkv(query, key, nullptr);
  check_broadcasts(o.mask, "mask", query, key);
  check_broadcasts(o.bias, "bias", query, key);
  const int r = query.rank();
  const int nb = r - 3;  // leading batch axes
  const float depth = static_cast<float>(query.dim(-1));
  Array q = query / std::sqrt(depth);
  // '...qhd,...khd->...hqk'
  std::vector<int> lb = iota(nb), rb = iota(nb);
  lb.push_back(r - 2);
  rb.push_back(r - 2);
  Array w = dot_general(q, key, DotDims{.lhs_contracting = {r - 1}, .rhs_contracting = {r - 1},
                                        .lhs_batch = lb, .rhs_batch = rb});
  if (o.bias.defined()) w = w + o.bias;
  Array mask = o.mask;
  if (o.is_causal) {
    // [q, k]: 1 where key position <= query position.
    const Array causal =
        greater_equal(expand_dims(Array::arange(query.dim(-3)), -1), expand_dims(Array::arange(key.dim(-3)), 0));
    mask = mask.defined() ? logical_and_mask(mask, causal) : causal;
  }
  if (mask.defined()) {
    // jnp.finfo(dtype).min of the logits' dtype, as Flax (float32's lowest would round to -inf in bf16).
    bfloat16 bf16_lowest;
    bf16_lowest.bits = 0xff7f;
    const float big_neg = w.dtype() == DType::bf16 ? static_cast<float>(bf16_lowest) : std::numeric_limits<float>::lowest();
    w = where(mask, w, Array::scalar(big_neg));
  }
  w = softmax(w, {-1});
  if (o.sow_scope) o.sow_scope->sow("intermediates", "attention_weights", w);
  if (!o.deterministic && o.dropout_rate > 0.0) {
    if (!o.dropout_rng)
      throw ValueError("dot_product_attention: dropout_rate > 0 and not deterministic, but no dropout_rng was given");
    const float keep_prob = static_cast<float>(1.0 - o.dropout_rate);
    Shape mask_shape = w.shape();
    if (o.broadcast_dropout)
      for (int a = 0; a < w.rank() - 2; ++a) mask_shape[a] = 1;
    Array keep = rng::bernoulli(*o.dropout_rng, keep_prob, mask_shape);
    w = w * astype(keep / keep_prob, w.dtype());
  }
  return w;
}

Array dot_product_attention(const Array& query, const Array& key, const Array& value,
                            const DotProductAttentionOptions& options) {
  check_qkv(query, key, &value);
  check_broadcasts(options.mask, "mask", query, key);
  check_broadcasts(options.bias, "bias", query, key);
  const bool dropout = !options.deterministic && options.dropout_rate > 0.0;
  if (!options.bias.defined() && !dropout && options.sow_scope == nullptr)
    return scaled_dot_product_attention(query, key, value, {.mask = options.mask, .is_causal = options.is_causal});
  Array w = dot_product_attention_weights(query, key, options);  // [..., h, q, k]
  const int r = query.rank();
  const int nb = r - 3;
  // '...hqk,...khd->...qhd': batch (..., h), contract k; the result is [..., h, q, d].
  std::vector<int> lb = iota(nb), rb = iota(nb);
  lb.push_back(nb);
  rb.push_back(nb + 1);
  Array y = dot_general(w, value, DotDims{.lhs_contracting = {nb + 2}, .rhs_contracting = {nb},
                                          .lhs_batch = lb, .rhs_batch = rb});
  std::vector<int> perm = iota(nb);
  perm.push_back(nb + 1);
  perm.push_back(nb);
  perm.push_back(nb + 2);
  return transpose(y, perm);
}

Array make_attention_mask(const Array& query_input, const Array& key_input, int extra_batch_dims) {
  Array q = query_input.dtype() == DType::f32 ? query_input : astype(query_input, DType::f32);
  Array k = key_input.dtype() == DType::f32 ? key_input : astype(key_input, DType::f32);
  if (q.rank() < 1 || k.rank() != q.rank())
    throw ShapeError(detail::cat("make_attention_mask: query_input ", q.shape(), " and key_input ", k.shape(),
                                 " must be [batch..., length] of the same rank"));
  Array m = expand_dims(q, -1) * expand_dims(k, -2);  // [..., q, k]
  m = expand_dims(m, -3);                              // [..., 1, q, k]
  for (int i = 0; i < extra_batch_dims; ++i) m = expand_dims(m, 0);
  return stop_gradient(m);
}

Array make_causal_mask(const Array& x, int extra_batch_dims) {
  if (!x.defined()) throw ValueError("make_causal_mask: x is undefined; pass an array [batch..., length] or its Shape");
  return make_causal_mask(x.shape(), extra_batch_dims);
}

Array make_causal_mask(const Shape& shape, int extra_batch_dims) {
  if (shape.rank() < 1)
    throw ShapeError("make_causal_mask: the shape must be [batch..., length], got " + shape.str());
  if (extra_batch_dims < 0)
    throw ValueError("make_causal_mask: extra_batch_dims must be >= 0, got " + std::to_string(extra_batch_dims));
  const std::int64_t n = shape[shape.rank() - 1];
  Array idx = Array::arange(n);
  Array causal = greater_equal(expand_dims(idx, -1), expand_dims(idx, 0));  // [len, len], q >= k
  Shape out = shape;
  out[out.rank() - 1] = 1;  // becomes the heads axis
  out.push_back(n);
  out.push_back(n);
  Array m = broadcast_to(causal, out);
  for (int i = 0; i < extra_batch_dims; ++i) m = expand_dims(m, 0);
  return m;
}

Array combine_masks(const std::vector<Array>& masks) {
  Array out;
  for (const Array& m : masks) {
    if (!m.defined()) continue;
    Array f = m.dtype() == DType::f32 ? not_equal(m, Array::scalar(0.0f)) : not_equal(astype(m, DType::f32), Array::scalar(0.0f));
    if (out.defined() && out.rank() != f.rank())
      throw ShapeError(detail::cat("combine_masks: masks must have the same rank, got ", out.shape(), " and ", f.shape()));
    out = out.defined() ? out * f : f;
  }
  return out;
}

// ---- MultiHeadDotProductAttention --------------------------------------------------------------

Array MultiHeadDotProductAttention::operator()(Scope& s, const Array& inputs_q, const AttentionArgs& args) const {
  return (*this)(s, inputs_q, inputs_q, inputs_q, args);
}

Array MultiHeadDotProductAttention::operator()(Scope& s, const Array& inputs_q, const Array& inputs_kv,
                                               const AttentionArgs& args) const {
  return (*this)(s, inputs_q, inputs_kv, inputs_kv, args);
}

void MultiHeadDotProductAttention::validate() const {
  if (num_heads <= 0)
    throw ValueError(detail::cat("MultiHeadDotProductAttention: num_heads must be positive (got ", num_heads,
                                 "); construct it as nn::MultiHeadDotProductAttention{.num_heads = H}"));
  if (qkv_features && (*qkv_features <= 0 || *qkv_features % num_heads != 0))
    throw ValueError(detail::cat("MultiHeadDotProductAttention: qkv_features (", *qkv_features,
                                 ") must be positive and divisible by num_heads (", num_heads, ")"));
  if (out_features && *out_features <= 0)
    throw ValueError(detail::cat("MultiHeadDotProductAttention: out_features must be positive, got ", *out_features));
  if (!(dropout_rate >= 0.0 && dropout_rate <= 1.0))
    throw ValueError(detail::cat("MultiHeadDotProductAttention: dropout_rate must be in [0, 1], got ", dropout_rate));
}

Array MultiHeadDotProductAttention::operator()(Scope& s, const Array& inputs_q, const Array& inputs_k,
                                               const Array& inputs_v, const AttentionArgs& args) const {
  validate();
  if (inputs_q.rank() < 2)
    throw ShapeError(detail::cat("MultiHeadDotProductAttention: inputs_q of shape ", inputs_q.shape(),
                                 " must be [batch..., length, features]"));
  const std::int64_t features = out_features.value_or(inputs_q.dim(-1));
  const std::int64_t qkv = qkv_features.value_or(inputs_q.dim(-1));
  if (qkv % num_heads != 0)
    throw ValueError(detail::cat("MultiHeadDotProductAttention: qkv_features (", qkv,
                                 ") must be divisible by num_heads (", num_heads, ")"));
  const std::int64_t head_dim = qkv / num_heads;
  const DenseGeneral dense{.features = {num_heads, head_dim}, .axis = {-1}, .use_bias = use_bias,
                           .kernel_init = kernel_init, .bias_init = bias_init, .dtype = dtype,
                           .param_dtype = param_dtype};
  Array query = s("query", dense, inputs_q);
  Array key = s("key", dense, inputs_k);
  Array value = s("value", dense, inputs_v);
  if (normalize_qk) {
    query = s("query_ln", LayerNorm{.use_bias = false, .dtype = dtype, .param_dtype = param_dtype}, query);
    key = s("key_ln", LayerNorm{.use_bias = false, .dtype = dtype, .param_dtype = param_dtype}, key);
  }
  Array mask = args.mask;
  if (decode) {
    // Flax: the cache exists from init on; at init it is made (zeros, the init input's length) and
    // attention runs as usual.
    const bool initialized = s.has_variable("cache", "cached_key");
    Variable cached_key = s.variable("cache", "cached_key", [&] { return Array::zeros(key.shape(), key.dtype()); });
    Variable cached_value = s.variable("cache", "cached_value", [&] { return Array::zeros(value.shape(), value.dtype()); });
    Variable cache_index = s.variable("cache", "cache_index", [] { return Array::full_i32(Shape{}, 0); });
    if (initialized) {
      const Shape& cached = cached_key.value().shape();  // [batch..., max_length, heads, head_dim]
      Shape expected = cached;
      expected[cached.rank() - 3] = 1;
      if (!(query.shape() == expected))
        throw ValueError(detail::cat("MultiHeadDotProductAttention at '", s.path_str(), "': autoregressive cache shape error: ",
                                     "decoding takes one position at a time, the query ", expected, ", but got ",
                                     query.shape(), " (inputs ", inputs_q.shape(), "); pass [batch..., 1, features]"));
      if (args.is_causal)
        throw ValueError(detail::cat("MultiHeadDotProductAttention at '", s.path_str(),
                                     "': decode masks the positions not yet written itself; leave is_causal false"));
      const std::int64_t max_length = cached[cached.rank() - 3];
      const std::int32_t cur = cache_index.value().data_i32()[0];
      if (cur < 0 || cur >= max_length)
        throw ValueError(detail::cat("MultiHeadDotProductAttention at '", s.path_str(), "': the cache holds ", max_length,
                                     " positions and all are written (cache_index ", cur,
                                     "); init with a longer input to decode further"));
      // lax.dynamic_update_slice along the length axis.
      auto write_at = [&](const Array& cache, const Array& row) {
        const int axis = cache.rank() - 3;
        std::vector<Array> parts;
        if (cur > 0) parts.push_back(slice_axis(cache, axis, 0, cur));
        parts.push_back(astype(row, cache.dtype()));
        if (cur + 1 < max_length) parts.push_back(slice_axis(cache, axis, cur + 1, max_length));
        return concatenate(parts, axis);
      };
      key = write_at(cached_key.value(), key);
      value = write_at(cached_value.value(), value);
      cached_key.set(key);
      cached_value.set(value);
      cache_index.set(Array::full_i32(Shape{}, cur + 1));
      // The single query attends to the positions written so far: [batch..., 1, 1, max_length].
      Shape mask_shape;
      for (int a = 0; a < cached.rank() - 3; ++a) mask_shape.push_back(cached[a]);
      mask_shape.push_back(1);
      mask_shape.push_back(1);
      mask_shape.push_back(max_length);
      const Array written = broadcast_to(less_equal(Array::arange(max_length), Array::scalar(static_cast<float>(cur))), mask_shape);
      mask = combine_masks({mask, written});
    }
  }
  DotProductAttentionOptions o;
  o.mask = mask;
  o.is_causal = args.is_causal;
  o.broadcast_dropout = broadcast_dropout;
  o.dropout_rate = dropout_rate;
  o.deterministic = true;
  if (dropout_rate > 0.0) {
    o.deterministic = merge_param("MultiHeadDotProductAttention", "deterministic", deterministic, args.deterministic);
    if (!o.deterministic) o.dropout_rng = args.dropout_rng ? *args.dropout_rng : s.make_rng("dropout");
  }
  if (args.sow_weights) o.sow_scope = &s;
  Array x = dot_product_attention(query, key, value, o);  // [..., q, heads, head_dim]
  const DenseGeneral out{.features = {features}, .axis = {-2, -1}, .use_bias = use_bias,
                         .kernel_init = out_kernel_init ? out_kernel_init : kernel_init,
                         .bias_init = out_bias_init ? out_bias_init : bias_init, .dtype = dtype,
                         .param_dtype = param_dtype};
  return s("out", out, x);
}

}  // namespace linum::nn
