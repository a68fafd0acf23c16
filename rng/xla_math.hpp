// Float32 special functions computed the way XLA computes them, so that normal() and
// truncated_normal() agree with JAX to float32 rounding.
//
// JAX lowers `lax.erf_inv` to a CHLO op that XLA expands into Giles' single-precision
// approximation (chlo-legalize-to-stablehlo: `erfInv32`); `lax.erf` on the CPU backend (jaxlib
// 0.10) is XLA's own erf intrinsic, a rational interpolant of degrees 9/12 (older jaxlibs used
// a clamped 13/10 one: values differ in the last bit). XLA's CPU and GPU backends
// allow fusing a multiply and an add into one FMA, so every Horner step here is a fused
// multiply-add in float32, as JAX computes it on CPUs with FMA (x86-64 since 2013, all ARM64) and
// on GPUs. log1p and sqrt are computed correctly rounded; XLA's own log1p may differ in the last
// bit, which can move a result by an ulp (tests/test_oracles.cpp measures how often: variance-
// scaling initializers and gumbel draws, within 2 ulps of JAX's).
#pragma once

namespace linum::rng {

// Inverse error function, float32 (XLA's ErfInv for f32). erf_inv_f32(+-1) = +-inf.
float erf_inv_f32(float x);

// Error function, float32 (XLA's Erf for f32 on CPU): x * P(x^2) / Q(x^2), +-1 for |x| >= 3.8325.
float erf_f32(float x);

}  // namespace linum::rng
