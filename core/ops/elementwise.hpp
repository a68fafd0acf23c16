// Elementwise ops: arithmetic with NumPy broadcasting, math functions, activations, comparisons.
//
// Every op is differentiable (except comparisons, which return float32 masks of 0 and 1), records
// its backward rule when an input is being differentiated, and throws linum::ShapeError naming
// the op and the shapes when the inputs cannot be broadcast together.
#pragma once

#include <linum/core/array.hpp>

namespace linum {

// ---- arithmetic (NumPy broadcasting) ---------------------------------------------------------
Array add(const Array& a, const Array& b);
Array sub(const Array& a, const Array& b);
Array mul(const Array& a, const Array& b);
Array div(const Array& a, const Array& b);
Array pow(const Array& a, const Array& b);
Array maximum(const Array& a, const Array& b);  // at ties each side gets half the gradient (JAX)
Array minimum(const Array& a, const Array& b);
Array neg(const Array& x);

Array operator+(const Array& a, const Array& b);
Array operator-(const Array& a, const Array& b);
Array operator*(const Array& a, const Array& b);
Array operator/(const Array& a, const Array& b);
Array operator-(const Array& x);
Array operator+(const Array& a, float b);
Array operator-(const Array& a, float b);
Array operator*(const Array& a, float b);
Array operator/(const Array& a, float b);
Array operator+(float a, const Array& b);
Array operator-(float a, const Array& b);
Array operator*(float a, const Array& b);
Array operator/(float a, const Array& b);
Array pow(const Array& a, float exponent);

// ---- math --------------------------------------------------------------------------------------
Array exp(const Array& x);
Array log(const Array& x);
Array log1p(const Array& x);
Array sqrt(const Array& x);
Array rsqrt(const Array& x);
Array square(const Array& x);
Array abs(const Array& x);
Array sign(const Array& x);  // no gradient (zero almost everywhere)
Array tanh(const Array& x);
Array sigmoid(const Array& x);
Array sin(const Array& x);
Array cos(const Array& x);
Array erf(const Array& x);
Array expm1(const Array& x);  // e^x - 1, accurate near 0
Array log2(const Array& x);
// Rounding (no gradient: zero almost everywhere, as JAX). round is to nearest, ties to even
// (jnp.round).
Array floor(const Array& x);
Array ceil(const Array& x);
Array round(const Array& x);
// min(max(x, lo), hi), with the gradients of maximum/minimum (as jnp.clip).
Array clip(const Array& x, float lo, float hi);

// ---- activations ---------------------------------------------------------------------------------
Array relu(const Array& x);  // gradient 0 at 0, as jax.nn.relu
// GELU. approximate=true is the tanh approximation (Flax's default), false uses erf.
Array gelu(const Array& x, bool approximate = true);
Array silu(const Array& x);
Array softplus(const Array& x);

// ---- selection and comparison --------------------------------------------------------------------
// cond ? a : b elementwise with broadcasting; cond is float32 or int32, nonzero means true.
Array where(const Array& cond, const Array& a, const Array& b);
Array greater(const Array& a, const Array& b);
Array greater_equal(const Array& a, const Array& b);
Array less(const Array& a, const Array& b);
Array less_equal(const Array& a, const Array& b);
Array equal(const Array& a, const Array& b);
Array not_equal(const Array& a, const Array& b);

// Converts between float32, bfloat16 and int32. float32 -> bfloat16 rounds to nearest even (as
// JAX); float -> int truncates toward zero. Float-to-float conversions are differentiable (the
// cotangent is converted back); conversions from or to int32 are not.
//
// Binary ops promote as JAX does: bf16 with f32 gives f32; a C++ scalar (x * 0.5f, Array::scalar)
// is weakly typed and does not widen a bf16 array. Comparisons return float32 masks.
Array astype(const Array& x, DType dtype);

// The same values as a constant: gradients do not flow through it.
Array stop_gradient(const Array& x);

}  // namespace linum
