// PyTorch weights in Linum's (Flax's) layouts: each function reads one PyTorch module's tensors from
// a state dict (a flat Tree of PyTorch names, e.g. from safetensors::load) and returns the variables
// of the equivalent Linum layer, {"params": {...}} (and {"batch_stats": {...}} for BatchNorm), to
// put at that layer's path:
//
//   const Tree sd = safetensors::load("model.safetensors").tensors;      // PyTorch's state_dict
//   Tree vars;
//   vars.set_path("params/Conv_0", torch_layouts::conv2d(sd, "features.0").at("params"));
//
// `prefix` is the PyTorch module's name in the state dict ("features.0" for "features.0.weight");
// a missing tensor, or one of the wrong shape, is a ValueError naming it and what was expected.
//
//   PyTorch                       Linum layer (its fields to match)
//   Linear                        nn::Dense (kernel = weight^T)
//   Conv2d                        nn::Conv, NHWC (kernel [kh, kw, in/groups, out]); padding=p is
//                                 .padding = p, groups is .feature_group_count, dilation as is
//   ConvTranspose2d               nn::ConvTranspose with .transpose_kernel = true (kernel
//                                 [kh, kw, out, in]); PyTorch's padding p, output_padding q and
//                                 dilation d are .padding = {{d(k-1)-p, d(k-1)-p+q}} per axis;
//                                 groups 1
//   LayerNorm                     nn::LayerNorm (scale, bias); eps 1e-5 is .epsilon = 1e-5
//   GroupNorm                     nn::GroupNorm (scale, bias); eps 1e-5 is .epsilon = 1e-5
//   BatchNorm1d/2d                nn::BatchNorm (params scale, bias; batch_stats mean, var);
//                                 eval mode is .use_running_average = true; PyTorch's momentum m is
//                                 Flax's 1 - m
//   Embedding                     nn::Embed (embedding = weight)
//   LSTM (one layer, one direction)  nn::LSTMCell / OptimizedLSTMCell in nn::RNN: gates (i, f, g, o)
//                                 split into ii/if/ig/io (input kernels) and hi/hf/hg/ho (recurrent
//                                 kernels; bias_ih + bias_hh as their bias)
//   GRU (one layer, one direction)   nn::GRUCell in nn::RNN: gates (r, z, n) into ir/iz/in and
//                                 hr/hz/hn; b_ir + b_hr and b_iz + b_hz as ir's and iz's bias (Flax's
//                                 hr and hz have none), b_in as in's, b_hn as hn's (PyTorch's
//                                 n = tanh(W_in x + b_in + r * (W_hn h + b_hn)) is Flax's)
//   MultiheadAttention            nn::MultiHeadDotProductAttention with .num_heads = heads
//                                 (query/key/value [E, heads, head_dim], out [heads, head_dim, E]);
//                                 inputs batch-first ([batch, length, E]: batch_first=True)
//
// Values are copied exactly (transposes and reshapes only; the two RNN bias sums round once).
#pragma once

#include <linum/core/tree.hpp>

#include <cstdint>
#include <string_view>

namespace linum::torch_layouts {

Tree linear(const Tree& state_dict, std::string_view prefix);
Tree conv2d(const Tree& state_dict, std::string_view prefix);
Tree conv_transpose2d(const Tree& state_dict, std::string_view prefix);
Tree layer_norm(const Tree& state_dict, std::string_view prefix);
Tree group_norm(const Tree& state_dict, std::string_view prefix);
Tree batch_norm(const Tree& state_dict, std::string_view prefix);
Tree embedding(const Tree& state_dict, std::string_view prefix);
// `layer` selects weight_ih_l<layer>, ...: one cell of a stacked LSTM (each becomes its own RNN).
Tree lstm(const Tree& state_dict, std::string_view prefix, int layer = 0);
Tree gru(const Tree& state_dict, std::string_view prefix, int layer = 0);
Tree multihead_attention(const Tree& state_dict, std::string_view prefix, std::int64_t num_heads);

}  // namespace linum::torch_layouts
