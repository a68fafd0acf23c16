#include <linum/nn/normalization.hpp>

#include <linum/core/ops/all.hpp>

#include <algorithm>
#include <utility>

namespace linum::nn {

bool merge_param(const char* layer, const char* name, std::optional<bool> module_value, std::optional<bool> call_value) {
  if (module_value && call_value)
    throw ValueError(detail::cat(layer, ": '", name, "' is set both on the module and in the call; set it in one place"));
  if (!module_value && !call_value)
    throw ValueError(detail::cat(layer, ": '", name, "' is set neither on the module nor in the call; pass it as a call "
                                 "argument or set the field (e.g. nn::", layer, "{.", name, " = true})"));
  return module_value ? *module_value : *call_value;
}

namespace {

// Sorted, de-duplicated, non-negative axes (Flax's _canonicalize_axes).
std::vector<int> canonical_axes(const std::vector<int>& axes, const Array& x, const char* layer, const char* field) {
  std::vector<int> out;
  for (int a : axes) {
    const int n = a < 0 ? a + x.rank() : a;
    if (n < 0 || n >= x.rank())
      throw ShapeError(detail::cat(layer, ": ", field, " contains axis ", a, ", out of range for an input of shape ",
                                   x.shape()));
    out.push_back(n);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

void require_float(const Array& x, const char* layer, DType param_dtype) {
  if (!is_floating(x.dtype()))
    throw ShapeError(detail::cat(layer, ": input must be float32 or bfloat16, got ", dtype_name(x.dtype()), " of shape ",
                                 x.shape()));
  require_float_dtype(param_dtype, layer, "param_dtype");
}

// Flax computes statistics and the normalization in float32 at least (promote_types(dtype, f32)).
Array widened(const Array& x) { return x.dtype() == DType::f32 ? x : astype(x, DType::f32); }

// Flax's _compute_stats with keepdims: (mean, var) over `axes`. With use_mean false the mean is
// zero and var = E[x^2].
std::pair<Array, Array> compute_stats(const Array& x, const std::vector<int>& axes, bool use_mean, bool fast_variance) {
  if (!use_mean) return {Array(), mean(square(x), axes, true)};
  if (fast_variance) {
    Array mu = mean(x, axes, true);
    Array mu2 = mean(square(x), axes, true);
    return {mu, maximum(Array::scalar(0.0f), mu2 - square(mu))};
  }
  Array mu = mean(x, axes, true);
  return {mu, mean(square(x - mu), axes, true)};
}

// Flax's _normalize: y = (x - mean) * (rsqrt(var + eps) * scale) + bias, with "scale" and "bias"
// params of the shape of `feature_axes`. `mean` may be undefined (no centring).
Array normalize(Scope& s, const Array& x_in, const Array& mu, const Array& var, const std::vector<int>& feature_axes,
                double epsilon, bool use_bias, bool use_scale, const Initializer& bias_init, const Initializer& scale_init,
                std::optional<DType> dtype, DType param_dtype) {
  const Array x = widened(x_in);
  Shape param_shape;
  std::vector<std::int64_t> broadcast_shape(static_cast<std::size_t>(x.rank()), 1);
  for (int a : feature_axes) {
    param_shape.push_back(x.dim(a));
    broadcast_shape[static_cast<std::size_t>(a)] = x.dim(a);
  }
  Array y = mu.defined() ? x - mu : x;
  Array mul = rsqrt(var + static_cast<float>(epsilon));
  Array scale, bias;
  if (use_scale) {
    scale = s.param("scale", initializer_in(scale_init, param_dtype), param_shape);
    mul = mul * reshape(scale, broadcast_shape);
  }
  y = y * mul;
  if (use_bias) {
    bias = s.param("bias", initializer_in(bias_init, param_dtype), param_shape);
    y = y + reshape(bias, broadcast_shape);
  }
  // The result in `dtype`, or the promotion of the input and the params (Flax's canonicalize_dtype).
  const DType out = computation_dtype({&x_in, &scale, &bias}, dtype);
  return y.dtype() == out ? y : astype(y, out);
}

// How many trailing axes `red` and `feat` name when they are the same trailing run of axes (the
// layout the fused core ops normalize), else 0.
int trailing_run(const std::vector<int>& red, const std::vector<int>& feat, int rank) {
  if (red != feat || red.empty()) return 0;
  for (std::size_t i = 0; i < red.size(); ++i)
    if (red[i] != rank - static_cast<int>(red.size()) + static_cast<int>(i)) return 0;
  return static_cast<int>(red.size());
}

}  // namespace

namespace {
void check_epsilon(const char* layer, double epsilon) {
  if (!(epsilon >= 0.0)) throw ValueError(detail::cat(layer, ": epsilon must be >= 0, got ", epsilon));
}
}  // namespace

void LayerNorm::validate() const {
  check_epsilon("LayerNorm", epsilon);
  require_float_dtype(param_dtype, "LayerNorm", "param_dtype");
}
void RMSNorm::validate() const {
  check_epsilon("RMSNorm", epsilon);
  require_float_dtype(param_dtype, "RMSNorm", "param_dtype");
}
void GroupNorm::validate() const {
  if (num_groups.has_value() == group_size.has_value())
    throw ValueError("GroupNorm: set exactly one of num_groups and group_size; to use group_size write "
                     "nn::GroupNorm{.num_groups = std::nullopt, .group_size = G}");
  if (num_groups && *num_groups <= 0) throw ValueError(detail::cat("GroupNorm: num_groups must be positive, got ", *num_groups));
  if (group_size && *group_size <= 0) throw ValueError(detail::cat("GroupNorm: group_size must be positive, got ", *group_size));
  check_epsilon("GroupNorm", epsilon);
  require_float_dtype(param_dtype, "GroupNorm", "param_dtype");
}
void InstanceNorm::validate() const {
  check_epsilon("InstanceNorm", epsilon);
  require_float_dtype(param_dtype, "InstanceNorm", "param_dtype");
}
void BatchNorm::validate() const {
  if (!(momentum >= 0.0 && momentum <= 1.0))
    throw ValueError(detail::cat("BatchNorm: momentum must be in [0, 1] (the weight of the old running statistics), got ",
                                 momentum));
  check_epsilon("BatchNorm", epsilon);
  require_float_dtype(param_dtype, "BatchNorm", "param_dtype");
  if (dtype) require_float_dtype(*dtype, "BatchNorm", "dtype");
}

Array LayerNorm::operator()(Scope& s, const Array& x) const {
  validate();
  require_float(x, "LayerNorm", param_dtype);
  const auto red = canonical_axes(reduction_axes, x, "LayerNorm", "reduction_axes");
  const auto feat = canonical_axes(feature_axes, x, "LayerNorm", "feature_axes");
  if (const int k = trailing_run(red, feat, x.rank()); k > 0) {  // one fused op (core/ops/normalization.hpp)
    Shape param_shape;
    for (int a : feat) param_shape.push_back(x.dim(a));
    Array scale, bias;
    if (use_scale) scale = s.param("scale", initializer_in(scale_init, param_dtype), param_shape);
    if (use_bias) bias = s.param("bias", initializer_in(bias_init, param_dtype), param_shape);
    return layer_norm(x, scale, bias, {.num_axes = k, .epsilon = epsilon, .fast_variance = use_fast_variance, .dtype = dtype});
  }
  auto [mu, var] = compute_stats(widened(x), red, true, use_fast_variance);
  return normalize(s, x, mu, var, feat, epsilon, use_bias, use_scale, bias_init, scale_init, dtype, param_dtype);
}

Array RMSNorm::operator()(Scope& s, const Array& x) const {
  validate();
  require_float(x, "RMSNorm", param_dtype);
  const auto red = canonical_axes(reduction_axes, x, "RMSNorm", "reduction_axes");
  const auto feat = canonical_axes(feature_axes, x, "RMSNorm", "feature_axes");
  if (const int k = trailing_run(red, feat, x.rank()); k > 0) {
    Shape param_shape;
    for (int a : feat) param_shape.push_back(x.dim(a));
    Array scale;
    if (use_scale) scale = s.param("scale", initializer_in(scale_init, param_dtype), param_shape);
    return rms_norm(x, scale, {.num_axes = k, .epsilon = epsilon, .dtype = dtype});
  }
  auto [mu, var] = compute_stats(widened(x), red, false, use_fast_variance);
  return normalize(s, x, mu, var, feat, epsilon, false, use_scale, initializers::zeros(), scale_init, dtype, param_dtype);
}

Array InstanceNorm::operator()(Scope& s, const Array& x) const {
  validate();
  require_float(x, "InstanceNorm", param_dtype);
  const auto feat = canonical_axes(feature_axes, x, "InstanceNorm", "feature_axes");
  if (std::find(feat.begin(), feat.end(), 0) != feat.end())
    throw ValueError(detail::cat("InstanceNorm: feature_axes include the first axis of the input ", x.shape(),
                                 ", which is the batch axis; name the channel axes (the default -1 is the last)"));
  std::vector<int> red;
  for (int a = 1; a < x.rank(); ++a)
    if (std::find(feat.begin(), feat.end(), a) == feat.end()) red.push_back(a);
  if (red.empty())
    throw ShapeError(detail::cat("InstanceNorm: input of shape ", x.shape(),
                                 " has no axis to normalize over besides the batch and the features; it needs "
                                 "[N, spatial..., C] (for [N, C] use LayerNorm)"));
  auto [mu, var] = compute_stats(widened(x), red, true, use_fast_variance);
  return normalize(s, x, mu, var, feat, epsilon, use_bias, use_scale, bias_init, scale_init, dtype, param_dtype);
}

Array GroupNorm::operator()(Scope& s, const Array& x) const {
  validate();
  require_float(x, "GroupNorm", param_dtype);
  if (x.rank() < 2)
    throw ShapeError(detail::cat("GroupNorm: input of shape ", x.shape(), " needs at least a batch and a channel axis ([N, ..., C])"));
  std::vector<int> red_in;
  if (reduction_axes) {
    red_in = *reduction_axes;
  } else {
    for (int a = 1; a < x.rank() - 1; ++a) red_in.push_back(a);
    red_in.push_back(-1);
  }
  const auto red = canonical_axes(red_in, x, "GroupNorm", "reduction_axes");
  if (red.empty() || red.back() != x.rank() - 1)
    throw ValueError("GroupNorm: the reduction axes must include the last axis, which holds the channels");
  if (num_groups.has_value() == group_size.has_value())
    throw ValueError("GroupNorm: set exactly one of num_groups and group_size; to use group_size write "
                     "nn::GroupNorm{.num_groups = std::nullopt, .group_size = G}");
  const std::int64_t channels = x.dim(-1);
  std::int64_t groups = 0;
  if (group_size) {
    if (*group_size <= 0 || channels % *group_size != 0)
      throw ValueError(detail::cat("GroupNorm: the number of channels (", channels, ") is not a multiple of the group size (",
                                   *group_size, ")"));
    groups = channels / *group_size;
  } else {
    groups = *num_groups;
    if (groups <= 0 || channels % groups != 0)
      throw ValueError(detail::cat("GroupNorm: the number of groups (", groups, ") does not divide the number of channels (",
                                   channels, ")"));
  }
  const std::int64_t per_group = channels / groups;
  // Work on [..., G, C/G]: the statistics of each group, then the same per-element arithmetic as
  // Flax (which repeats the statistics over the channels).
  std::vector<std::int64_t> grouped(x.shape().begin(), x.shape().end() - 1);
  grouped.push_back(groups);
  grouped.push_back(per_group);
  Array xg = reshape(widened(x), grouped);
  std::vector<int> group_red(red.begin(), red.end() - 1);
  group_red.push_back(xg.rank() - 1);
  auto [mu, var] = compute_stats(xg, group_red, true, use_fast_variance);
  Array y = xg - mu;
  Array mul = rsqrt(var + static_cast<float>(epsilon));
  const Shape param_shape{channels};
  Array scale, bias;
  if (use_scale) {
    scale = s.param("scale", initializer_in(scale_init, param_dtype), param_shape);
    mul = mul * reshape(scale, {groups, per_group});
  }
  y = y * mul;
  if (use_bias) {
    bias = s.param("bias", initializer_in(bias_init, param_dtype), param_shape);
    y = y + reshape(bias, {groups, per_group});
  }
  y = reshape(y, x.shape().vec());
  const DType out = computation_dtype({&x, &scale, &bias}, dtype);
  return y.dtype() == out ? y : astype(y, out);
}

Array BatchNorm::operator()(Scope& s, const Array& x, std::optional<bool> use_running_average_arg) const {
  return (*this)(s, x, use_running_average_arg, Array());
}

Array BatchNorm::operator()(Scope& s, const Array& x, std::optional<bool> use_running_average_arg, const Array& residual) const {
  require_float(x, "BatchNorm", param_dtype);
  validate();
  const bool use_ra = merge_param("BatchNorm", "use_running_average", use_running_average, use_running_average_arg);
  const int feature_axis = x.shape().normalize_axis(axis, "BatchNorm (axis)");
  std::vector<int> red;
  for (int a = 0; a < x.rank(); ++a)
    if (a != feature_axis) red.push_back(a);
  const Shape feature_shape{x.dim(feature_axis)};
  std::vector<std::int64_t> broadcast_shape(static_cast<std::size_t>(x.rank()), 1);
  broadcast_shape[static_cast<std::size_t>(feature_axis)] = x.dim(feature_axis);

  Variable ra_mean = s.variable("batch_stats", "mean", [&] { return Array::zeros(feature_shape); });
  Variable ra_var = s.variable("batch_stats", "var", [&] { return Array::ones(feature_shape); });
  if (!use_ra && x.numel() == 0)
    throw ShapeError(detail::cat("BatchNorm: cannot compute batch statistics of an empty input of shape ", x.shape(),
                                 " (they would be NaN and poison the running statistics); skip empty batches, or "
                                 "use_running_average = true"));
  if (!use_ra && !s.is_initializing() && !s.is_mutable_collection("batch_stats"))
    // Flax raises here too (ModifyScopeVariableError): a training step that cannot store its
    // statistics would silently train with running averages that never move.
    throw ValueError(
        "BatchNorm in training mode (use_running_average = false) updates its running statistics in collection "
        "'batch_stats', which this call cannot write: apply with .mutable_collections = {\"batch_stats\"} (Flax's "
        "mutable=['batch_stats']) and keep the updated collection, or pass use_running_average = true to normalize "
        "with the stored statistics");
  auto update_running = [&](const Array& batch_mean, const Array& batch_var) {
    if (s.is_initializing()) return;  // Flax leaves them at their initial values at init
    const float m = static_cast<float>(momentum);
    const float one_minus = static_cast<float>(1.0 - momentum);  // computed in double, as Python does
    // The running statistics are state, not part of the differentiated computation.
    ra_mean.set(stop_gradient(m * ra_mean.value() + one_minus * reshape(batch_mean, feature_shape.vec())));
    ra_var.set(stop_gradient(m * ra_var.value() + one_minus * reshape(batch_var, feature_shape.vec())));
  };
  if (feature_axis == x.rank() - 1) {
    // Channels last (Flax's default): the fused op (core/ops/batch_norm.hpp), two passes each way.
    Array scale, bias;
    if (use_scale) scale = s.param("scale", initializer_in(scale_init, param_dtype), feature_shape);
    if (use_bias) bias = s.param("bias", initializer_in(bias_init, param_dtype), feature_shape);
    const BatchNormOptions options{
        .epsilon = epsilon, .fast_variance = use_fast_variance, .dtype = dtype, .residual = residual, .activation = activation};
    if (use_ra) {
      const Array mu = ra_mean.value(), var = ra_var.value();
      if (!(mu.shape() == feature_shape) || !(var.shape() == feature_shape))
        throw ShapeError(detail::cat("BatchNorm: batch_stats mean/var have shapes ", mu.shape(), " and ", var.shape(),
                                     " but the input of shape ", x.shape(), " has ", x.dim(feature_axis), " features"));
      return batch_norm(x, mu, var, scale, bias, options);
    }
    BatchNormResult r = batch_norm(x, scale, bias, options);
    update_running(r.mean, r.var);
    return std::move(r.y);
  }
  Array mu, var;
  if (use_ra) {
    mu = ra_mean.value();
    var = ra_var.value();
    if (!(mu.shape() == feature_shape) || !(var.shape() == feature_shape))
      throw ShapeError(detail::cat("BatchNorm: batch_stats mean/var have shapes ", mu.shape(), " and ", var.shape(),
                                   " but the input of shape ", x.shape(), " has ", x.dim(feature_axis), " features"));
    mu = reshape(mu, broadcast_shape);
    var = reshape(var, broadcast_shape);
  } else {
    auto stats = compute_stats(widened(x), red, true, use_fast_variance);
    mu = stats.first;
    var = stats.second;
    update_running(mu, var);
  }
  Array y = normalize(s, x, mu, var, {feature_axis}, epsilon, use_bias, use_scale, bias_init, scale_init, dtype, param_dtype);
  if (residual.defined()) y = residual + y;
  return activation == Activation::none ? y : activate(y, activation);
}

}  // namespace linum::nn
