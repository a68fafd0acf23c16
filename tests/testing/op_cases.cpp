#include "testing/op_cases.hpp"

#include <linum/core/autodiff/custom_vjp.hpp>

namespace linum::testing {

Array swish(const Array& x) {
  static const auto op = custom_vjp(
      "swish",
      [](const Array& a) {
        Array s = sigmoid(a);
        return std::make_pair(a * s, std::make_tuple(a, s));
      },
      [](const std::tuple<Array, Array>& res, const Array& g) {
        const auto& [a, s] = res;
        return g * s * (1.0f + a * (1.0f - s));
      });
  return op(x);
}

std::vector<OpCase> op_cases() {
  return {
      {"elementwise", "add", {4, 6}, {6}, [](const Array& z, const Array& w) { return add(z, w); }, true},
      {"elementwise", "div", {4, 6}, {6}, [](const Array& z, const Array& w) { return z / (w * w + 1.0f); }, true},
      {"elementwise", "mul", {4, 6}, {6}, [](const Array& z, const Array& w) { return z * w; }, false},
      {"elementwise", "maximum", {4, 6}, {6}, [](const Array& z, const Array& w) { return maximum(z, w); }, false},
      {"elementwise", "where", {4, 6}, {6}, [](const Array& z, const Array& w) {
         return where(greater(w, Array::scalar(0.0f)), z, w);
       }, true},
      {"elementwise", "sub", {4, 6}, {6}, [](const Array& z, const Array& w) { return sub(z, w); }, true},
      {"elementwise", "neg", {4, 6}, {6}, [](const Array& z, const Array& w) { return neg(z) * w; }, true},
      {"elementwise", "minimum", {4, 6}, {6}, [](const Array& z, const Array& w) { return minimum(z, w); }, false},
      {"elementwise", "pow", {4, 6}, {6}, [](const Array& z, const Array& w) { return pow(square(z) + 1.0f, w); }, false},
      {"math", "exp", {4, 6}, {6}, [](const Array& z, const Array& w) { return exp(z) * w; }, true},
      {"math", "log", {4, 6}, {6}, [](const Array& z, const Array& w) { return log(square(z) + 1.0f) * w; }, false},
      {"math", "log1p", {4, 6}, {6}, [](const Array& z, const Array& w) { return log1p(square(z)) * w; }, false},
      {"math", "sqrt", {4, 6}, {6}, [](const Array& z, const Array& w) { return sqrt(square(z) + 1.0f) * w; }, true},
      {"math", "rsqrt", {4, 6}, {6}, [](const Array& z, const Array& w) { return rsqrt(square(z) + 1.0f) * w; }, true},
      {"math", "square", {4, 6}, {6}, [](const Array& z, const Array& w) { return square(z) * w; }, false},
      {"math", "abs", {4, 6}, {6}, [](const Array& z, const Array& w) { return abs(z) * w; }, false},
      {"math", "cos", {4, 6}, {6}, [](const Array& z, const Array& w) { return cos(z) * w; }, false},
      {"rounding", "ceil", {4, 6}, {6}, [](const Array& z, const Array& w) { return ceil(z * 3.0f) * w; }, true},
      {"activation", "silu", {4, 6}, {6}, [](const Array& z, const Array& w) { return silu(z) * w; }, false},
      {"activation", "softplus", {4, 6}, {6}, [](const Array& z, const Array& w) { return softplus(z) * w; }, false},
      {"activation", "gelu", {4, 6}, {6}, [](const Array& z, const Array& w) { return gelu(z, /*approximate=*/false) * w; }, false},
      {"data movement", "dilate", {4, 6}, {4, 11}, [](const Array& z, const Array& w) { return dilate(z, {1, 2}) * w; }, true},
      {"activation", "relu", {4, 6}, {6}, [](const Array& z, const Array& w) { return relu(z - 1.5f) * w; }, true},
      {"activation", "tanh", {4, 6}, {6}, [](const Array& z, const Array& w) { return tanh(z) * w; }, true},
      {"math", "sin", {4, 6}, {6}, [](const Array& z, const Array& w) { return sin(z) * w; }, false},
      {"math", "erf", {4, 6}, {6}, [](const Array& z, const Array& w) { return erf(z) * w; }, false},
      {"math", "expm1", {4, 6}, {6}, [](const Array& z, const Array& w) { return expm1(z) * w; }, true},
      {"math", "log2", {4, 6}, {6}, [](const Array& z, const Array& w) { return log2(square(z) + 1.0f) * w; }, false},
      {"rounding", "floor", {4, 6}, {6}, [](const Array& z, const Array& w) { return floor(z) * w + z; }, false},
      {"rounding", "round", {4, 6}, {6}, [](const Array& z, const Array& w) { return round(z * 3.0f) * w; }, true},
      {"activation", "gelu", {4, 6}, {6}, [](const Array& z, const Array& w) { return gelu(z) * w; }, false},
      {"activation", "sigmoid", {4, 6}, {6}, [](const Array& z, const Array& w) { return sigmoid(z) * w; }, true},
      {"softmax family", "softmax", {4, 6}, {6}, [](const Array& z, const Array& w) { return softmax(z) * w; }, true},
      {"softmax family", "log_softmax", {4, 6}, {6}, [](const Array& z, const Array& w) { return log_softmax(z) * w; }, true},
      {"softmax family", "softmax", {2, 3, 4}, {4}, [](const Array& z, const Array& w) { return softmax(z, {0, 1}) * w; }, true},
      {"attention", "attention", {2, 5, 2, 4}, {2, 5, 2, 4}, [](const Array& z, const Array& w) {
         return scaled_dot_product_attention(z, w, w);
       }, false},
      {"recurrent", "lstm_cell", {4, 8}, {4, 2}, [](const Array& z, const Array& w) {
         auto [c, h] = lstm_cell(z, z * 0.5f, w);
         return h * 2.0f + c;
       }, false},
      {"recurrent", "lstm_layer", {3, 2, 2}, {2, 8}, [](const Array& z, const Array& w) {
         // time 3, batch 2, inputs 2, hidden 2: z's first step is also c0 and h0's source.
         const Array first = reshape(slice_axis(z, 0, 0, 1), {2, 2});
         auto [ys, c, h] = lstm_layer(z, w * 0.5f, sum(w, {0}) * 0.25f, w, first, tanh(first));
         return ys * 2.0f + c + h;
       }, false},
      {"recurrent", "gru_layer", {3, 2, 2}, {2, 6}, [](const Array& z, const Array& w) {
         // time 3, batch 2, inputs 2, hidden 2: z's first step is also h0's source.
         const Array first = reshape(slice_axis(z, 0, 0, 1), {2, 2});
         auto [ys, h] = gru_layer(z, w * 0.5f, sum(w, {0}) * 0.25f, w, sum(w, {0}) * 0.1f, tanh(first));
         return ys * 2.0f + h;
       }, false},
      {"normalization", "layer_norm", {4, 6}, {6}, [](const Array& z, const Array& w) {
         return layer_norm(z, w, Array::zeros(Shape{6}));
       }, false},
      {"normalization", "rms_norm", {4, 6}, {6}, [](const Array& z, const Array& w) { return rms_norm(z, w); }, false},
      {"normalization", "batch_norm", {4, 6}, {6}, [](const Array& z, const Array& w) {
         // every output read: the statistics are differentiable too (the bias is w itself: an op
         // computing it would be left out, the rule does not read the bias)
         BatchNormResult r = batch_norm(z, w, w);
         return r.y + r.mean * 0.5f + r.var * 0.25f;
       }, false},
      {"normalization", "batch_norm_eval", {4, 6}, {6}, [](const Array& z, const Array& w) {
         return batch_norm(z, w * 0.1f, square(w) + 0.5f, w, Array());
       }, false},
      {"reduction", "sum", {4, 6}, {6}, [](const Array& z, const Array& w) { return sum(z, {0}) * w; }, true},
      {"reduction", "max", {4, 6}, {6}, [](const Array& z, const Array& w) { return max(z, {0}) * w; }, false},
      {"data movement", "reshape", {4, 6}, {3, 8}, [](const Array& z, const Array& w) { return reshape(z, {3, 8}) * w; }, true},
      {"data movement", "transpose", {4, 6}, {6, 4}, [](const Array& z, const Array& w) { return transpose(z) * w; }, true},
      {"data movement", "slice", {4, 6}, {2, 6}, [](const Array& z, const Array& w) { return slice(z, {1, 0}, {3, 6}) * w; }, true},
      {"data movement", "concatenate", {4, 6}, {4, 6}, [](const Array& z, const Array& w) { return concatenate({z, w}, 0); }, true},
      {"data movement", "take", {4, 6}, {3, 6}, [](const Array& z, const Array& w) {
         return take(z, Array::from_i32(Shape{3}, {2, 0, 2}), 0) * w;
       }, true},
      {"data movement", "broadcast_to", {1, 6}, {4, 6}, [](const Array& z, const Array& w) {
         return broadcast_to(z, Shape{4, 6}) * w;
       }, true},
      {"data movement", "pad", {4, 6}, {5, 9}, [](const Array& z, const Array& w) { return pad(z, {{0, 1}, {1, 2}}) * w; }, true},
      {"data movement", "flip", {4, 6}, {4, 6}, [](const Array& z, const Array& w) { return flip(z, {1}) * w; }, true},
      {"scan", "cumsum", {4, 6}, {6}, [](const Array& z, const Array& w) { return cumsum(z, 1) * w; }, true},
      {"scan", "cumprod", {4, 6}, {6}, [](const Array& z, const Array& w) { return cumprod(z * 0.5f + 1.0f, 1) * w; }, false},
      {"prod: the last of a cumprod", "cumprod", {4, 6}, {6}, [](const Array& z, const Array& w) { return prod(z * 0.5f + 1.0f, {0}) * w; }, false},
      {"product", "matmul", {4, 6}, {4, 5}, [](const Array& z, const Array& w) { return einsum("ij,ik->jk", z, w); }, false},  // einsum: its product
      // The product reading an operand stored transposed (dot_general contracting a leading axis of
      // the left operand or a trailing one of the right: the kernel's ta / tb, no transposed copy).
      {"product", "matmul", {4, 6}, {5, 6}, [](const Array& z, const Array& w) {  // z w^T
         return dot_general(z, w, DotDims{.lhs_contracting = {1}, .rhs_contracting = {1}});
       }, false},
      {"product", "matmul", {6, 4}, {5, 6}, [](const Array& z, const Array& w) {  // z^T w^T
         return dot_general(z, w, DotDims{.lhs_contracting = {0}, .rhs_contracting = {1}});
       }, false},
      {"product", "batched_matmul", {2, 4, 6}, {2, 4, 5}, [](const Array& z, const Array& w) {  // z^T w per batch
         return dot_general(z, w, DotDims{.lhs_contracting = {1}, .rhs_contracting = {1}, .lhs_batch = {0}, .rhs_batch = {0}});
       }, false},
      {"product", "batched_matmul", {2, 4, 6}, {2, 5, 4}, [](const Array& z, const Array& w) {  // z^T w^T per batch
         return dot_general(z, w, DotDims{.lhs_contracting = {1}, .rhs_contracting = {2}, .lhs_batch = {0}, .rhs_batch = {0}});
       }, false},
      {"data movement", "unstack", {3, 6}, {6}, [](const Array& z, const Array& w) {
         std::vector<Array> rows = unstack(z);
         return rows[0] * w + rows[2];
       }, true},
      {"product", "matmul", {4, 6}, {6, 5}, [](const Array& z, const Array& w) { return matmul(z, w); }, false},
      // The fused dense layer, with each activation (its bias: a function of w, so it has a gradient
      // too). Without an activation its rule keeps no bias, so what computes the bias is left out.
      {"product", "linear", {4, 6}, {6, 5}, [](const Array& z, const Array& w) { return linear(z, w, sum(w, {0}) * 0.1f); }, true},
      {"product", "linear", {2, 3, 6}, {6, 5}, [](const Array& z, const Array& w) { return linear(z, w); }, false},
      {"product", "linear", {2, 3, 6}, {6, 5}, [](const Array& z, const Array& w) {  // keeps its output, [..., N]
         return linear(z, w, sum(w, {0}) * 0.1f, Activation::relu);
       }, false},
      {"product", "linear", {4, 6}, {6, 5}, [](const Array& z, const Array& w) {
         return linear(z, w, sum(w, {0}) * 0.1f, Activation::relu);
       }, false},
      {"product", "linear", {4, 6}, {6, 5}, [](const Array& z, const Array& w) {
         return linear(z, w, sum(w, {0}) * 0.1f, Activation::gelu);
       }, false},
      {"product", "linear", {4, 6}, {6, 5}, [](const Array& z, const Array& w) {
         return linear(z, w, sum(w, {0}) * 0.1f, Activation::gelu_exact);
       }, false},
      {"product", "linear", {4, 6}, {6, 5}, [](const Array& z, const Array& w) {
         return linear(z, w, sum(w, {0}) * 0.1f, Activation::silu);
       }, false},
      {"product", "linear", {4, 6}, {6, 5}, [](const Array& z, const Array& w) {
         return linear(z, w, sum(w, {0}) * 0.1f, Activation::tanh);
       }, false},
      {"product", "linear", {4, 6}, {6, 5}, [](const Array& z, const Array& w) {
         return linear(z, w, sum(w, {0}) * 0.1f, Activation::sigmoid);
       }, false},
      {"product", "batched_matmul", {2, 4, 6}, {2, 6, 3}, [](const Array& z, const Array& w) { return matmul(z, w); }, false},
      {"convolution", "conv2d", {2, 5, 5, 3}, {3, 3, 3, 4}, [](const Array& z, const Array& w) { return conv2d(z, w); }, false},
      // On oneDNN its own primitive (the data gradient of a convolution); on Eigen a convolution of
      // the stride-dilated input.
      {"convolution", engine() == Engine::onednn ? "conv_transpose2d" : "conv2d", {2, 3, 3, 3}, {3, 3, 3, 4},
       [](const Array& z, const Array& w) { return conv_transpose2d(z, w, {.strides = {2, 2}}); }, false},
      {"pooling", "avg_pool", {2, 4, 4, 3}, {3}, [](const Array& z, const Array& w) {
         return avg_pool(z, {.window = {2, 2}, .strides = {2, 2}}) * w;
       }, true},
      {"pooling", "max_pool", {2, 4, 4, 3}, {3}, [](const Array& z, const Array& w) {
         return max_pool(z, {.window = {2, 2}, .strides = {2, 2}}) * w;
       }, true},
      {"cast", "astype", {4, 6}, {6}, [](const Array& z, const Array& w) { return astype(z, DType::bf16) * w; }, true},
      {"user-defined", "swish", {4, 6}, {6}, [](const Array& z, const Array& w) { return swish(z) * w; }, false},
      {"named", "checkpoint_name", {4, 6}, {6}, [](const Array& z, const Array& w) { return checkpoint_name(z, "z") * w; }, true},
  };
}


}  // namespace linum::testing
