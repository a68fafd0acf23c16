// Float32 special functions computed the way XLA computes them, so that normal() and
// truncated_normal() agree with JAX to float32 rounding.
//
// JAX lowers `lax.erf_inv` to a CHLO op that XLA expands into Giles' single-precision
// approximation (chlo-legalize-to-stablehlo: `erfInv32`); `lax.erf` on the CPU backend (jaxlib
// 0.10) is XLA's own erf intrinsic, a rational interpolant of degrees 9/12 (older jaxlibs used
// a clamped 13/10 one: values differ in the last bit). XLA's CPU and GPU backends
// allow fusing a multiply and an add into one FMA, so every Horner step here is a fused
// multiply-add in float32, as JAX computes it on CPUs with FMA (x86-64 since 2013, all ARM64) and
// on GPUs. log and log1p are XLA's CPU ones too (not correctly rounded: the C library's differ in
// the last bit for about 7% of arguments), so normal, truncated_normal and gumbel draws are JAX's
// bit for bit (tests/test_oracles.cpp). sqrt is correctly rounded in both.
#pragma once

namespace linum::rng {

// Natural logarithm, float32, as XLA's CPU backend computes it (Cephes' polynomial, products fused
// into the sums). NaN below 0, -inf at 0.
float log_f32(float x);

// log(1 + x), float32, as XLA's CPU backend computes it.
float log1p_f32(float x);

// Inverse error function, float32 (XLA's ErfInv for f32). erf_inv_f32(+-1) = +-inf.
float erf_inv_f32(float x);

// Error function, float32 (XLA's Erf for f32 on CPU): x * P(x^2) / Q(x^2), +-1 for |x| >= 3.8325.
float erf_f32(float x);

}  // namespace linum::rng
