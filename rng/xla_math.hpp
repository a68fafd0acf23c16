// Float32 special functions computed the way XLA computes them, so that normal() and
// truncated_normal() agree with JAX to float32 rounding.
//
// JAX lowers `lax.erf_inv` and `lax.erf` to CHLO ops that XLA expands into fixed polynomials
// (StableHLO's chlo-legalize-to-stablehlo: `erfInv32`, Giles' single-precision approximation, and
// `materializeErfApproximationF32`, Eigen's rational approximation). XLA's CPU and GPU backends
// allow fusing a multiply and an add into one FMA, so every Horner step here is a fused
// multiply-add in float32, as JAX computes it on CPUs with FMA (x86-64 since 2013, all ARM64) and
// on GPUs. log1p and sqrt are computed correctly rounded; XLA's own log1p may differ in the last
// bit, which can move a result by an ulp.
#pragma once

namespace linum::rng {

// Inverse error function, float32 (XLA's ErfInv for f32). erf_inv_f32(+-1) = +-inf.
float erf_inv_f32(float x);

// Error function, float32 (XLA's Erf for f32): x clamped to [-4, 4], x * P(x^2) / Q(x^2), result
// clamped to [-1, 1].
float erf_f32(float x);

}  // namespace linum::rng
