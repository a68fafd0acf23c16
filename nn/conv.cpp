#include <linum/nn/conv.hpp>

#include <linum/core/ops/all.hpp>

namespace linum::nn {

namespace {

// Flax's maybe_broadcast: empty -> 1 on every axis, one value -> that value on every axis.
std::vector<std::int64_t> per_axis(const std::vector<std::int64_t>& v, std::size_t n, const char* field,
                                   const char* layer = "Conv") {
  if (v.empty()) return std::vector<std::int64_t>(n, 1);
  std::vector<std::int64_t> out = v.size() == 1 ? std::vector<std::int64_t>(n, v[0]) : v;
  if (out.size() != n)
    throw ValueError(detail::cat(layer, ": ", field, " has ", v.size(), " values but the kernel has ", n,
                                 " spatial axes; give one value per axis or a single value"));
  for (std::int64_t x : out)
    if (x <= 0) throw ValueError(detail::cat(layer, ": ", field, " values must be positive, got ", x));
  return out;
}

// The layer's "kernel" (kernel_size..., kernel_in, kernel_out) and "bias" (features,) params, and
// the input, all promoted to the computation dtype (Flax's promote_dtype).
struct Operands {
  Array x, kernel, bias;
};
Operands conv_operands(Scope& s, const Array& x, const std::vector<std::int64_t>& kernel_size, std::int64_t kernel_in,
                       std::int64_t kernel_out, std::int64_t features, bool use_bias, const Initializer& kernel_init,
                       const Initializer& bias_init, std::optional<DType> dtype, DType param_dtype) {
  Shape kernel_shape;
  for (std::int64_t k : kernel_size) kernel_shape.push_back(k);
  kernel_shape.push_back(kernel_in);
  kernel_shape.push_back(kernel_out);
  const Array kernel = s.param("kernel", initializer_in(kernel_init, param_dtype), kernel_shape);
  const Array bias = use_bias ? s.param("bias", initializer_in(bias_init, param_dtype), Shape{features}) : Array();
  auto p = promote_dtype({x, kernel, bias}, dtype);
  return {p[0], p[1], p[2]};
}

// The checks both layers make of their configuration before anything runs.
void check_layer(const char* layer, std::int64_t features, const std::vector<std::int64_t>& kernel_size, DType param_dtype) {
  if (features <= 0)
    throw ValueError(detail::cat(layer, ": features must be positive (got ", features, "); construct it as nn::", layer,
                                 "{.features = N, .kernel_size = {3, 3}}"));
  const std::size_t nsp = kernel_size.size();
  if (nsp != 1 && nsp != 2)
    throw ValueError(detail::cat(layer, ": kernel_size must have 1 (sequences) or 2 (images) entries, got ", nsp,
                                 "; e.g. .kernel_size = {3, 3}"));
  for (std::int64_t k : kernel_size)
    if (k <= 0) throw ValueError(detail::cat(layer, ": kernel_size values must be positive"));
  require_float_dtype(param_dtype, layer, "param_dtype");
}

// Reshapes x to exactly one batch axis before `spatial` spatial axes and the channels (Flax adds
// one for an unbatched input and flattens several); returns the number of batch axes it had.
int flatten_batch_axes(const Array& x_in, std::size_t spatial, const char* layer, Array& x) {
  const int want = static_cast<int>(spatial) + 2;  // [N, spatial..., C]
  const char* layout = spatial == 2 ? "NHWC [N, H, W, C]" : "NWC [N, L, C]";
  if (x_in.rank() < want - 1)
    throw ShapeError(detail::cat(layer, ": input of shape ", x_in.shape(), " has rank ", x_in.rank(), "; a ", spatial,
                                 "-D convolution needs ", layout, " (or one example without the batch axis); "
                                 "add the missing axes with reshape, e.g. reshape(x, {N, H, W, 1}) for a batch of "
                                 "single-channel images"));
  if (!is_floating(x_in.dtype()))
    throw ShapeError(detail::cat(layer, ": input must be float32 or bfloat16, got ", dtype_name(x_in.dtype()),
                                 "; convert with astype(x, DType::f32)"));
  const int batch_axes = x_in.rank() - (want - 1);
  x = x_in;
  if (batch_axes != 1) {
    std::vector<std::int64_t> flat{-1};
    for (int a = batch_axes; a < x_in.rank(); ++a) flat.push_back(x_in.dim(a));
    x = reshape(x_in, flat);
  }
  return batch_axes;
}

// The output with the input's batch axes back.
Array restore_batch_axes(const Array& y, const Array& x_in, int batch_axes) {
  if (batch_axes == 1) return y;
  std::vector<std::int64_t> out;
  for (int a = 0; a < batch_axes; ++a) out.push_back(x_in.dim(a));
  for (int a = 1; a < y.rank(); ++a) out.push_back(y.dim(a));
  return reshape(y, out);
}


// The padding field: a mode this layer knows, or one (low, high) pair or one per spatial axis.
void check_padding(const char* layer, const Padding& padding, std::size_t nsp, bool causal_ok) {
  switch (padding.kind) {
    case Padding::Kind::same:
    case Padding::Kind::valid:
      return;
    case Padding::Kind::causal:
      if (!causal_ok)
        throw ValueError(detail::cat(layer, ": unknown padding 'CAUSAL'; use \"SAME\", \"VALID\", an int or (low, high) pairs "
                                            "(CAUSAL is Conv's, CIRCULAR is not supported)"));
      if (nsp != 1) throw ValueError(detail::cat(layer, ": CAUSAL padding is only implemented for 1-D convolutions (as in Flax)"));
      return;
    case Padding::Kind::explicit_pairs:
      if (padding.pairs.size() != 1 && padding.pairs.size() != nsp)
        throw ValueError(detail::cat(layer, ": padding has ", padding.pairs.size(), " (low, high) pairs but the kernel has ",
                                     nsp, " spatial axes"));
      for (const auto& [lo, hi] : padding.pairs)
        if (lo < 0 || hi < 0)
          throw ValueError(detail::cat(layer, ": padding (", lo, ", ", hi, ") is negative; pad with 0 or more"));
      return;
  }
}

// The 2-D op's padding for this layer's `nsp` spatial axes (a 1-D layer runs as 2-D with a leading
// axis of size 1, unpadded), after check_padding.
Padding op_padding(const Padding& padding, std::size_t nsp, std::int64_t causal_left) {
  switch (padding.kind) {
    case Padding::Kind::same:
    case Padding::Kind::valid:
      return padding;
    case Padding::Kind::causal:
      return Padding::explicit_pads(0, 0, causal_left, 0);
    case Padding::Kind::explicit_pairs:
      break;
  }
  const auto first = padding.pair(0);
  if (nsp == 1) return Padding::explicit_pads(0, 0, first.first, first.second);
  const auto second = padding.pair(1);
  return Padding::explicit_pads(first.first, first.second, second.first, second.second);
}

// The padding of a Conv-like layer as the 2-D op takes it: CAUSAL pads (k - 1) * dilation zeros on
// the left (computed only for it: sizes may be huge).
Padding layer_padding(const char* layer, const Padding& padding, const std::vector<std::int64_t>& kernel_size,
                      const std::vector<std::int64_t>& dilation_v) {
  std::int64_t causal_left = 0;
  if (padding.kind == Padding::Kind::causal && __builtin_mul_overflow(dilation_v[0], kernel_size[0] - 1, &causal_left))
    throw ShapeError(detail::cat(layer, ": CAUSAL padding of (kernel_size - 1) * kernel_dilation = (", kernel_size[0], " - 1) * ",
                                 dilation_v[0], " overflows 64 bits"));
  return op_padding(padding, kernel_size.size(), causal_left);
}

// A 1-D or 2-D convolution through the 2-D op (a 1-D one is a 2-D one over an image of height 1).
Array conv_1d_or_2d(const Array& x, const Array& kernel, const std::vector<std::int64_t>& strides_v,
                    const std::vector<std::int64_t>& dilation_v, const Padding& pad, std::int64_t feature_group_count) {
  ConvOptions opt;
  opt.padding = pad;
  opt.feature_group_count = feature_group_count;
  if (strides_v.size() == 2) {
    opt.strides = {strides_v[0], strides_v[1]};
    opt.dilation = {dilation_v[0], dilation_v[1]};
    return conv2d(x, kernel, opt);
  }
  opt.strides = {1, strides_v[0]};
  opt.dilation = {1, dilation_v[0]};
  Array x4 = reshape(x, {x.dim(0), 1, x.dim(1), x.dim(2)});
  Array k4 = reshape(kernel, {1, kernel.dim(0), kernel.dim(1), kernel.dim(2)});
  Array y4 = conv2d(x4, k4, opt);
  return reshape(y4, {y4.dim(0), y4.dim(2), y4.dim(3)});
}

}  // namespace

// The field checks every convolution layer makes (features, kernel size, param dtype, strides,
// dilation, padding).
template <class Layer>
void check_conv_fields(const char* name, const Layer& l, bool causal_ok) {
  check_layer(name, l.features, l.kernel_size, l.param_dtype);
  const std::size_t nsp = l.kernel_size.size();
  (void)per_axis(l.strides, nsp, "strides", name);
  (void)per_axis(l.kernel_dilation, nsp, "kernel_dilation", name);
  check_padding(name, l.padding, nsp, causal_ok);
}

void Conv::validate() const {
  if (feature_group_count <= 0 || (features > 0 && features % feature_group_count != 0))
    throw ValueError(detail::cat("Conv: feature_group_count ", feature_group_count, " must be positive and divide features (",
                                 features, ")"));
  check_conv_fields("Conv", *this, /*causal_ok=*/true);
}

void ConvTranspose::validate() const { check_conv_fields("ConvTranspose", *this, /*causal_ok=*/false); }

Array Conv::operator()(Scope& s, const Array& x_in) const {
  validate();
  const std::size_t nsp = kernel_size.size();
  Array x;
  const int batch_axes = flatten_batch_axes(x_in, nsp, "Conv", x);
  const std::int64_t in_features = x.dim(-1);
  if (feature_group_count <= 0 || in_features % feature_group_count != 0 || features % feature_group_count != 0)
    throw ValueError(detail::cat("Conv: feature_group_count ", feature_group_count, " must divide the input channels (",
                                 in_features, ") and features (", features, ")"));

  const auto strides_v = per_axis(strides, nsp, "strides");
  const auto dilation_v = per_axis(kernel_dilation, nsp, "kernel_dilation");

  const Padding pad = layer_padding("Conv", padding, kernel_size, dilation_v);

  Operands p = conv_operands(s, x, kernel_size, in_features / feature_group_count, features, features, use_bias,
                             kernel_init, bias_init, dtype, param_dtype);
  x = p.x;
  const Array kernel = p.kernel, bias = p.bias;
  Array y = conv_1d_or_2d(x, kernel, strides_v, dilation_v, pad, feature_group_count);
  if (use_bias) y = y + bias;

  return restore_batch_axes(y, x_in, batch_axes);
}

void ConvLocal::validate() const { check_conv_fields("ConvLocal", *this, /*causal_ok=*/true); }

Array ConvLocal::operator()(Scope& s, const Array& x_in) const {
  validate();
  const std::size_t nsp = kernel_size.size();
  Array x;
  const int batch_axes = flatten_batch_axes(x_in, nsp, "ConvLocal", x);
  const std::int64_t in_features = x.dim(-1);
  const auto strides_v = per_axis(strides, nsp, "strides", "ConvLocal");
  const auto dilation_v = per_axis(kernel_dilation, nsp, "kernel_dilation", "ConvLocal");
  const Padding pad = layer_padding("ConvLocal", padding, kernel_size, dilation_v);
  std::int64_t window = 1;
  for (std::int64_t k : kernel_size) window *= k;

  // Every output position's window as one vector, as lax.conv_general_dilated_patches lays it out
  // (channel-major: element c * window + k is channel c at window offset k): a convolution by a
  // one-hot kernel, one group per channel. Exact (one product by 1 per output).
  Shape eye_shape;
  for (std::int64_t k : kernel_size) eye_shape.push_back(k);
  eye_shape.push_back(1);
  eye_shape.push_back(in_features * window);
  std::vector<float> eye(static_cast<std::size_t>(eye_shape.numel()), 0.0f);
  for (std::int64_t c = 0; c < in_features; ++c)
    for (std::int64_t k = 0; k < window; ++k)
      eye[static_cast<std::size_t>(k * in_features * window + c * window + k)] = 1.0f;
  const Array patches_f = conv_1d_or_2d(x, astype(Array::from(eye_shape, eye), x.dtype()), strides_v, dilation_v, pad, in_features);

  // One kernel (and bias) per output position: (out positions..., window * C, features).
  Shape kernel_shape, bias_shape;
  std::int64_t positions = 1;
  for (int a = 1; a + 1 < patches_f.rank(); ++a) {
    kernel_shape.push_back(patches_f.dim(a));
    bias_shape.push_back(patches_f.dim(a));
    positions *= patches_f.dim(a);
  }
  kernel_shape.push_back(window * in_features);
  kernel_shape.push_back(features);
  bias_shape.push_back(features);
  const Array kernel_p = s.param("kernel", initializer_in(kernel_init, param_dtype), kernel_shape);
  const Array bias_p = use_bias ? s.param("bias", initializer_in(bias_init, param_dtype), bias_shape) : Array();
  const auto p = promote_dtype({patches_f, kernel_p, bias_p}, dtype);
  const Array patches = reshape(p[0], {x.dim(0), positions, window * in_features});
  Array y = einsum("bpk,pkf->bpf", patches, reshape(p[1], {positions, window * in_features, features}));
  std::vector<std::int64_t> out_shape{x.dim(0)};
  for (int a = 1; a + 1 < patches_f.rank(); ++a) out_shape.push_back(patches_f.dim(a));
  out_shape.push_back(features);
  y = reshape(y, out_shape);
  if (use_bias) y = y + p[2];
  return restore_batch_axes(y, x_in, batch_axes);
}

Array ConvTranspose::operator()(Scope& s, const Array& x_in) const {
  validate();
  const std::size_t nsp = kernel_size.size();
  Array x;
  const int batch_axes = flatten_batch_axes(x_in, nsp, "ConvTranspose", x);
  const std::int64_t in_features = x.dim(-1);
  const auto strides_v = per_axis(strides, nsp, "strides", "ConvTranspose");
  const auto dilation_v = per_axis(kernel_dilation, nsp, "kernel_dilation", "ConvTranspose");

  ConvTransposeOptions opt;
  opt.transpose_kernel = transpose_kernel;
  opt.padding = op_padding(padding, nsp, 0);

  Operands p = conv_operands(s, x, kernel_size, transpose_kernel ? features : in_features,
                             transpose_kernel ? in_features : features, features, use_bias, kernel_init, bias_init,
                             dtype, param_dtype);
  x = p.x;
  const Array kernel = p.kernel, bias = p.bias;
  Array y;
  if (nsp == 2) {
    opt.strides = {strides_v[0], strides_v[1]};
    opt.dilation = {dilation_v[0], dilation_v[1]};
    y = conv_transpose2d(x, kernel, opt);
  } else {  // over an image of height 1 (a 1-high kernel at stride 1 pads it by nothing, SAME or VALID)
    opt.strides = {1, strides_v[0]};
    opt.dilation = {1, dilation_v[0]};
    Array x4 = reshape(x, {x.dim(0), 1, x.dim(1), x.dim(2)});
    Array k4 = reshape(kernel, {1, kernel.dim(0), kernel.dim(1), kernel.dim(2)});
    Array y4 = conv_transpose2d(x4, k4, opt);
    y = reshape(y4, {y4.dim(0), y4.dim(2), y4.dim(3)});
  }
  if (use_bias) y = y + bias;
  return restore_batch_axes(y, x_in, batch_axes);
}

}  // namespace linum::nn
