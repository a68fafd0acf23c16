// Conv: convolution over NHWC images (or NWC sequences), as Flax's `nn.Conv`.
//
//   Array y = s(nn::Conv{.features = 16, .kernel_size = {3, 3}}, x);            // x [N, H, W, C], SAME
//   Array z = s(nn::Conv{.features = 32, .kernel_size = {3, 3}, .strides = {2, 2},
//                        .padding = "VALID"}, y);
//   Array w = s(nn::Conv{.features = 8, .kernel_size = {5}, .padding = "CAUSAL"}, seq);   // x [N, L, C]
//
// Params: "kernel" (kernel_size..., C / feature_group_count, features) (HWIO), "bias" (features,).
// As in Flax, an input with one axis fewer than [N, spatial..., C] is treated as a single example
// (the batch axis is added and removed again) and several leading batch axes are flattened.
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/ops/conv.hpp>
#include <linum/modules/initializers.hpp>
#include <linum/nn/dtypes.hpp>
#include <linum/modules/scope.hpp>

#include <cstdint>
#include <optional>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

namespace linum::nn {

// The Conv layers' padding is linum::Padding (core/ops/conv.hpp), the one type pooling and the conv
// ops take too: "SAME", "VALID", "CAUSAL" (1-D Conv only), an int, or (low, high) pairs, one per
// spatial axis or one for all.

// A 1-D or 2-D convolution (lax.conv_general_dilated with NHWC/HWIO layouts).
struct Conv {
  std::int64_t features = 0;                                  // output channels (required, > 0)
  std::vector<std::int64_t> kernel_size;                      // {kh, kw} for images, {k} for sequences (required)
  std::vector<std::int64_t> strides;                          // per spatial axis; empty = 1, one value = all axes
  Padding padding = Padding::same();                          // "SAME" by default (Flax's)
  std::vector<std::int64_t> kernel_dilation;                  // per spatial axis; empty = 1, one value = all axes
  std::int64_t feature_group_count = 1;                       // C and features must be divisible by it
  bool use_bias = true;                                       // add the "bias" param
  Initializer kernel_init = initializers::lecun_normal();
  Initializer bias_init = initializers::zeros();
  std::optional<DType> dtype;                                 // computation dtype; nullopt: promote inputs and params
  DType param_dtype = DType::f32;                             // dtype the params are created in

  // The convolution of `x` ([N, H, W, C] or [N, L, C]; see the file comment for other ranks).
  void validate() const;  // ValueError naming an out-of-range field (on each call and on config load)
  Array operator()(Scope& s, const Array& x) const;
};

// A locally connected layer (Flax's nn.ConvLocal): a convolution whose kernel and bias are not
// shared between output positions. Params "kernel" (output positions..., prod(kernel_size) * C,
// features), its rows in lax.conv_general_dilated_patches' order (channel-major), and "bias"
// (output positions..., features). Strides, padding (CAUSAL for 1-D), kernel dilation and inputs
// as Conv's.
//
//   Array y = s(nn::ConvLocal{.features = 8, .kernel_size = {3, 3}}, x);  // [N, H, W, 8], H*W kernels
struct ConvLocal {
  std::int64_t features = 0;                                  // output channels (required, > 0)
  std::vector<std::int64_t> kernel_size;                      // {kh, kw} for images, {k} for sequences (required)
  std::vector<std::int64_t> strides;                          // per spatial axis; empty = 1, one value = all axes
  Padding padding = Padding::same();                          // "SAME" by default (Flax's)
  std::vector<std::int64_t> kernel_dilation;                  // per spatial axis; empty = 1, one value = all axes
  bool use_bias = true;                                       // add the "bias" param
  Initializer kernel_init = initializers::lecun_normal();
  Initializer bias_init = initializers::zeros();
  std::optional<DType> dtype;                                 // computation dtype; nullopt: promote inputs and params
  DType param_dtype = DType::f32;                             // dtype the params are created in

  void validate() const;  // ValueError naming an out-of-range field (on each call and on config load)
  Array operator()(Scope& s, const Array& x) const;
};

// A transposed convolution (Flax's nn.ConvTranspose, lax.conv_transpose with NHWC/HWIO layouts):
// upsamples by `strides`. SAME padding gives spatial size in * stride; VALID in * stride +
// max(k - stride, 0); explicit (low, high) pairs pad the stride-dilated input.
//
//   Array up = s(nn::ConvTranspose{.features = 16, .kernel_size = {3, 3}, .strides = {2, 2}}, x);  // [N, 2H, 2W, 16]
//
// Params: "kernel" (kernel_size..., C, features), or (kernel_size..., features, C) with
// transpose_kernel (the kernel of the convolution this one is the gradient of), and "bias"
// (features,). Unbatched and multi-batch-axis inputs as Conv.
struct ConvTranspose {
  std::int64_t features = 0;                                  // output channels (required, > 0)
  std::vector<std::int64_t> kernel_size;                      // {kh, kw} for images, {k} for sequences (required)
  std::vector<std::int64_t> strides;                          // per spatial axis; empty = 1, one value = all axes
  Padding padding = Padding::same();                          // "SAME", "VALID" or explicit pairs
  std::vector<std::int64_t> kernel_dilation;                  // per spatial axis; empty = 1
  bool use_bias = true;
  Initializer kernel_init = initializers::lecun_normal();
  Initializer bias_init = initializers::zeros();
  std::optional<DType> dtype;
  DType param_dtype = DType::f32;
  bool transpose_kernel = false;

  void validate() const;  // ValueError naming an out-of-range field (on each call and on config load)
  Array operator()(Scope& s, const Array& x) const;
};

// Pooling as parameterless modules (Flax has the functions nn.avg_pool / nn.max_pool; these are
// them as layers, e.g. inside nn::Sequential). Inputs [N, H, W, C]; defaults as Flax's functions
// (strides 1: pass the window for non-overlapping pools).
struct AvgPool {
  std::array<std::int64_t, 2> window{2, 2};
  std::array<std::int64_t, 2> strides{1, 1};
  linum::Padding padding = linum::Padding::valid();
  bool count_include_pad = true;
  Array operator()(Scope&, const Array& x) const {
    return avg_pool(x, {.window = window, .strides = strides, .padding = padding, .count_include_pad = count_include_pad});
  }
};
struct MaxPool {
  std::array<std::int64_t, 2> window{2, 2};
  std::array<std::int64_t, 2> strides{1, 1};
  linum::Padding padding = linum::Padding::valid();
  Array operator()(Scope&, const Array& x) const {
    return max_pool(x, {.window = window, .strides = strides, .padding = padding});
  }
};

}  // namespace linum::nn
