// The main example's model (examples/fashion_mnist/main.cpp), shared with the examples that train
// it in other ways (fashion_dpsgd: differentially private training with per-example gradients).
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
    if (batch_norm) h = s(nn::BatchNorm{.dtype = dtype, .param_dtype = param_dtype}, h, /*use_running_average=*/!train);
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

}  // namespace fashion
