// Op identities that code beyond an op's own file refers to (checkpoint policies, residual reports):
// one spelling each, and the traits JAX's policies select on. Every op records under its name
// (autodiff::primitive(name, ...)); these are the names other layers compare against.
#pragma once

#include <string_view>

namespace linum::ops::kind {

inline constexpr char matmul[] = "matmul";
inline constexpr char batched_matmul[] = "batched_matmul";
inline constexpr char linear[] = "linear";                    // the fused dense layer: act(x @ W + b)
inline constexpr char conv2d[] = "conv2d";
inline constexpr char conv_transpose2d[] = "conv_transpose2d";  // on oneDNN: the data gradient of a convolution
inline constexpr char attention[] = "attention";              // the fused attention
inline constexpr char lstm_layer[] = "lstm_layer";            // the fused LSTM layer
inline constexpr char gru_layer[] = "gru_layer";              // the fused GRU layer
inline constexpr char checkpoint_name[] = "checkpoint_name";  // the identity op policies select by name

// A matrix product or convolution (JAX's dot_general and conv_general_dilated). The fused dense
// layer, the fused attention and the fused LSTM and GRU layers count as the products they contain
// (JAX's Dense is a dot_general and an add, its attention dot_generals around a softmax, its LSTM or
// GRU a scan of dot_generals and gates).
constexpr bool is_dot(std::string_view op) {
  return op == matmul || op == batched_matmul || op == linear || op == conv2d || op == conv_transpose2d || op == attention ||
         op == lstm_layer || op == gru_layer;
}
// A product with batch dimensions (a dot_general with batch axes; the attention's products have
// the batch and head axes).
constexpr bool has_batch_dims(std::string_view op) { return op == batched_matmul || op == attention; }

}  // namespace linum::ops::kind
