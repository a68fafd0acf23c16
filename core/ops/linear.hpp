// The fused dense layer: act(x @ kernel + bias) as one op (nn::Dense and nn::DenseGeneral run on
// it). The bias is added in the product's epilogue (on oneDNN inside the matmul, to the float32
// accumulator, before the one rounding to bf16), the activation in one pass over the product (in
// float32, gelu and silu also compute their derivative there, from the same tanh, erf or sigmoid,
// and keep it in the product's place); the backward pass applies the activation's derivative and
// sums the bias gradient in one pass over the cotangent, then the two products. Where ops would pass
// over an activation-sized array five times (product, bias add, activation; activation derivative,
// bias sum), this passes three times.
#pragma once

#include <optional>

#include <linum/core/array.hpp>

#include <string_view>

namespace linum {

// The activations a linear op can apply to its product (the same functions as relu, gelu, ...).
enum class Activation {
  none,
  relu,
  gelu,        // the tanh approximation, as gelu(x) (Flax's default)
  gelu_exact,  // with erf, as gelu(x, false) (PyTorch's nn.GELU default)
  silu,
  tanh,
  sigmoid,
};

// The activation's name as written above ("gelu_exact", ...).
std::string_view activation_name(Activation a);
// The activation named `name`, or a ValueError listing the names.
Activation activation_from_name(std::string_view name);

// act applied alone: relu(x), gelu(x), ... (x itself for none).
Array activate(const Array& x, Activation act);

// act(x @ kernel + bias) for x [..., K], kernel [K, N], bias [N] (or undefined: no bias): the
// result is [..., N]. x, kernel and bias are promoted to one dtype as matmul's operands are. Equal to
// activate(add(matmul(x, kernel), bias), act) up to rounding: the bias is added before the product
// is rounded (bitwise the same in float32; one rounding instead of two in bf16).
//
// It is one op: a remat policy that saves products (dots_saveable,
// dots_with_no_batch_dims_saveable) saves its output and, with an activation, what it keeps for the
// backward pass (relu, tanh, sigmoid: the output; gelu, gelu_exact, silu: their derivative, computed
// in the forward pass from the same tanh, erf or sigmoid and stored in the product's dtype, so in
// bf16 its gradients are one rounding from the unfused ops'; JAX would save the product and
// recompute the activation); to save only the product, apply the activation as a separate op. Under
// vmap, and when differentiated with create_graph, it runs as those separate ops (in bf16 their
// gelu and silu gradients lack the kept derivative's rounding).
Array linear(const Array& x, const Array& kernel, const Array& bias = Array(), Activation act = Activation::none);
// The same computed in `dtype` (Flax's Dense `dtype`, PyTorch's autocast): bitwise
// linear(astype(x, dtype), astype(kernel, dtype), astype(bias, dtype), act), each gradient in its
// input's own dtype. With float32 parameters, a bf16 computation and an activation that keeps its
// derivative (gelu, gelu_exact, silu), the casts are folded into the op (one node): on the bf16
// panel kernel the kernel is rounded to bf16 while the product packs it, and its gradient leaves the
// weight gradient's product in float32 (no cast passes; the deep MLP's bf16 step 0.5-1.1% faster).
// Otherwise it is those ops.
Array linear(const Array& x, const Array& kernel, const Array& bias, Activation act, std::optional<DType> dtype);

}  // namespace linum
