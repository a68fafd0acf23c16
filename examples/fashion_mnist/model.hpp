// The main example's model (examples/fashion_mnist/main.cpp: ResNet below) and a small CNN of the
// same blocks for the examples that train in other ways (fashion_dpsgd: differentially private
// training with per-example gradients).
#pragma once

#include <linum/linum.hpp>

#include <optional>

namespace fashion {

using namespace linum;

// Conv 3x3 -> (BatchNorm) -> ReLU -> 2x2 average pool.
struct ConvBlock {
  std::int64_t features = 32;
  bool batch_norm = false;
  std::optional<DType> dtype;  // the computation dtype (Flax's dtype)
  DType param_dtype = DType::f32;  // the parameters' dtype (Flax's param_dtype)
  Array operator()(Scope& s, const Array& x, bool train) const {
    Array h = s(nn::Conv{.features = features, .kernel_size = {3, 3}, .dtype = dtype, .param_dtype = param_dtype}, x);
    // (BatchNorm's relu in the same op: one pass over h less, the same values as relu(h) after it)
    if (batch_norm)
      h = s(nn::BatchNorm{.dtype = dtype, .param_dtype = param_dtype, .activation = Activation::relu}, h,
            /*use_running_average=*/!train);
    else
      h = relu(h);  // reassigning frees the conv output now: relu keeps only its own output
    return avg_pool(h, {.window = {2, 2}, .strides = {2, 2}});
  }
};

// Flatten -> Dense 256 -> ReLU -> (Dropout) -> Dense 10.
struct Head {
  double dropout = 0.0;
  std::optional<DType> dtype;
  DType param_dtype = DType::f32;
  Array operator()(Scope& s, const Array& x, bool train) const {
    Array h = reshape(x, {x.dim(0), -1});
    h = relu(s(nn::Dense{.features = 256, .dtype = dtype, .param_dtype = param_dtype}, h));
    if (dropout > 0) h = s(nn::Dropout{.rate = dropout}, h, /*deterministic=*/!train);
    return s(nn::Dense{.features = 10, .dtype = dtype, .param_dtype = param_dtype}, h);
  }
};

enum class Remat { none, full, dots };

// The CNN of Flax's MNIST example. Whatever `remat` says, the variable dict is the same: remat<M>
// keeps M's name.
struct CNN {
  Remat remat = Remat::full;
  bool batch_norm = false;
  double dropout = 0.0;
  std::optional<DType> dtype;
  DType param_dtype = DType::f32;

  template <class Block>
  Array run(Scope& s, Array x, bool train) const {
    x = s(Block{{.features = 32, .batch_norm = batch_norm, .dtype = dtype, .param_dtype = param_dtype}}, x, train);
    x = s(Block{{.features = 64, .batch_norm = batch_norm, .dtype = dtype, .param_dtype = param_dtype}}, x, train);
    return x;
  }
  Array operator()(Scope& s, const Array& images, bool train) const {
    Array x;
    switch (remat) {
      case Remat::none: x = run<lift::remat<ConvBlock, lift::policy<policies::everything_saveable>>>(s, images, train); break;
      case Remat::full: x = run<lift::remat<ConvBlock>>(s, images, train); break;
      case Remat::dots: x = run<lift::remat<ConvBlock, lift::policy<policies::dots_saveable>>>(s, images, train); break;
    }
    return s(Head{.dropout = dropout, .dtype = dtype, .param_dtype = param_dtype}, x, train);
  }
};

// Flax's ResNet block (examples/imagenet/models.py): conv -> BatchNorm -> ReLU -> conv -> BatchNorm,
// plus the input, then ReLU. The convolutions have no bias when BatchNorm follows them (the norm's
// own bias takes its place). Flax's ImageNet ResNet also starts the second norm's scale at zero;
// this one keeps BatchNorm's default of one (as torch_cnn.py and flax_cnn.py do).
struct ResidualBlock {
  std::int64_t features = 32;
  bool batch_norm = true;
  std::optional<DType> dtype;
  DType param_dtype = DType::f32;
  Array operator()(Scope& s, const Array& x, bool train) const {
    const nn::Conv conv{.features = features, .kernel_size = {3, 3}, .use_bias = !batch_norm, .dtype = dtype,
                        .param_dtype = param_dtype};
    if (!batch_norm) return relu(x + s(conv, relu(s(conv, x))));
    // BatchNorm's relu, and the second one's residual, in the same op: relu(bn(y)) and relu(x + bn(y))
    // with the values of the ops written out, in two passes over the activations fewer each.
    const nn::BatchNorm norm_relu{.momentum = 0.9, .dtype = dtype, .param_dtype = param_dtype, .activation = Activation::relu};
    Array y = s(norm_relu, s(conv, x), !train);
    return s(norm_relu, s(conv, y), !train, /*residual=*/x);
  }
};

template <class M>
using NoRemat = M;
template <class M>
using RematFull = lift::remat<M>;
template <class M>
using RematDots = lift::remat<M, lift::policy<policies::dots_saveable>>;

// The main example's model: a convolution block at full resolution pooled to 14x14, `depth`
// residual blocks at that size, and the head. Every residual block's activations are the same size,
// so what remat keeps (each block's input) is a small part of what the plain model keeps (about six
// arrays per block): the deeper the stack, the larger the saving.
struct ResNet {
  Remat remat = Remat::full;
  int depth = 8;
  std::int64_t features = 24;
  bool batch_norm = true;
  double dropout = 0.0;
  std::optional<DType> dtype;
  DType param_dtype = DType::f32;

  // Wrap<M> is M itself or lift::remat<M, ...>; the parameter names are the same either way. The
  // last block runs plain whatever `remat` says: its backward comes right after its forward, so
  // recomputing it would cost time and save nothing (the peak is in an earlier block's backward).
  template <template <class> class Wrap>
  Array run(Scope& s, const Array& images, bool train) const {
    const ConvBlock stem{.features = features, .batch_norm = batch_norm, .dtype = dtype, .param_dtype = param_dtype};
    const ResidualBlock block{.features = features, .batch_norm = batch_norm, .dtype = dtype, .param_dtype = param_dtype};
    Array x = s(Wrap<ConvBlock>{stem}, images, train);  // [N, 14, 14, features]
    for (int i = 0; i + 1 < depth; ++i) x = s(Wrap<ResidualBlock>{block}, x, train);
    x = s(block, x, train);
    x = avg_pool(x, {.window = {2, 2}, .strides = {2, 2}});  // [N, 7, 7, features]
    return s(Head{.dropout = dropout, .dtype = dtype, .param_dtype = param_dtype}, x, train);
  }
  Array operator()(Scope& s, const Array& images, bool train) const {
    switch (remat) {
      case Remat::none: return run<NoRemat>(s, images, train);
      case Remat::full: return run<RematFull>(s, images, train);
      case Remat::dots: return run<RematDots>(s, images, train);
    }
    throw ValueError("ResNet: unknown remat choice");
  }
};

}  // namespace fashion
