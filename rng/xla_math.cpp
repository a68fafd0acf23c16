// XLA's float32 erf and erf_inv polynomials (see xla_math.hpp for where they come from).
#include <linum/rng/xla_math.hpp>

#include <cmath>
#include <limits>

namespace linum::rng {

namespace {

// Horner evaluation with the highest-order coefficient first: p = c[0]; p = p * x + c[i].
template <int N>
float horner(const float (&c)[N], float x) {
  float p = c[0];
  for (int i = 1; i < N; ++i) p = std::fma(p, x, c[i]);
  return p;
}

}  // namespace

float erf_inv_f32(float x) {
  // Giles, "Approximating the erfinv function" (GPU Computing Gems, 2011), single precision.
  static constexpr float kSmall[9] = {2.81022636e-08f,  3.43273939e-07f, -3.5233877e-06f,
                                      -4.39150654e-06f, 0.00021858087f,  -0.00125372503f,
                                      -0.00417768164f,  0.246640727f,    1.50140941f};
  static constexpr float kLarge[9] = {-0.000200214257f, 0.000100950558f, 0.00134934322f,
                                      -0.00367342844f,  0.00573950773f,  -0.0076224613f,
                                      0.00943887047f,   1.00167406f,     2.83297682f};
  if (std::fabs(x) == 1.0f) return x * std::numeric_limits<float>::infinity();
  const float minus_x_squared = x * -x;
  float w = -static_cast<float>(std::log1p(static_cast<double>(minus_x_squared)));
  float p;
  if (w < 5.0f) {
    w = w - 2.5f;
    p = horner(kSmall, w);
  } else {
    w = std::sqrt(w) - 3.0f;
    p = horner(kLarge, w);
  }
  return p * x;
}

float erf_f32(float x) {
  // The rational interpolant XLA's CPU backend emits for f32 erf (jaxlib 0.10; also Eigen's
  // generic_fast_erf): erf(x) = x P(x^2) / Q(x^2), P of degree 4 and Q of degree 6 in x^2, each
  // Horner step a fused multiply-add; |x| at or above erfinv(1 - ulp/2) = 3.8325... gives +-1.
  // Checked bit for bit against jax.lax.erf (tests/test_oracles.cpp, via truncated_normal).
  static constexpr float kP[5] = {0.00022905065861350646f, 0.0034082910107109506f, 0.050955695062380861f,
                                  0.18520832239976145f, 1.128379143519084f};
  static constexpr float kQ[7] = {-1.1791602954361697e-7f, 0.000023547966471313185f, 0.0010179625278914885f,
                                  0.014070470171167667f,   0.11098505178285362f,     0.49746925110067538f,
                                  1.0f};
  if (std::isnan(x)) return x;
  if (std::fabs(x) >= 3.832506856900711f) return std::copysign(1.0f, x);
  const float x2 = x * x;
  return (x * horner(kP, x2)) / horner(kQ, x2);
}

}  // namespace linum::rng
