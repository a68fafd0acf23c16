// XLA's float32 log, log1p, erf and erf_inv (see xla_math.hpp for where they come from).
#include <linum/rng/xla_math.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
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

float log_f32(float x) {
  // Cephes' polynomial as XLA's CPU backend evaluates it (every product that feeds a sum fused):
  // x = m 2^e with m in [sqrt(1/2), sqrt(2)), log x = e log 2 + log m, log m = t - t^2/2 + t^3 P(t)
  // with t = m - 1, log 2 in two parts (q2 + q1) so e log 2 adds exactly.
  static constexpr float kP[9] = {7.0376836292e-2f,  -1.1514610310e-1f, 1.1676998740e-1f,
                                  -1.2420140846e-1f, 1.4249322787e-1f,  -1.6668057665e-1f,
                                  2.0000714765e-1f,  -2.4999993993e-1f, 3.3333331174e-1f};
  constexpr float kLog2Lo = -2.12194440e-4f, kLog2Hi = 0.693359375f;
  if (std::isnan(x) || x < 0.0f) return std::numeric_limits<float>::quiet_NaN();
  if (x == 0.0f) return -std::numeric_limits<float>::infinity();
  if (std::isinf(x)) return x;
  const auto bits = std::bit_cast<std::uint32_t>(std::max(x, std::numeric_limits<float>::min()));
  float e = 1.0f + static_cast<float>(static_cast<std::int32_t>(bits >> 23) - 0x7f);
  float t = std::bit_cast<float>((bits & 0x807fffffu) | 0x3f000000u);  // the mantissa in [1/2, 1)
  if (t < 0.707106781186547524f) {
    e -= 1.0f;
    t = (t - 1.0f) + t;
  } else {
    t = t - 1.0f;
  }
  const float t2 = t * t, t3 = t2 * t;
  // Three interleaved Horner chains, joined by powers of t^3 (as XLA orders them).
  float y = std::fma(t, kP[0], kP[1]), y1 = std::fma(t, kP[3], kP[4]), y2 = std::fma(t, kP[6], kP[7]);
  y = std::fma(y, t, kP[2]);
  y1 = std::fma(y1, t, kP[5]);
  y2 = std::fma(y2, t, kP[8]);
  y = std::fma(y, t3, y1);
  y = std::fma(y, t3, y2);
  y = std::fma(y, t3, kLog2Lo * e);
  t = std::fma(-0.5f, t2, t);
  t = t + y;
  return std::fma(kLog2Hi, e, t);
}

float log1p_f32(float x) {
  // Below sqrt(2) - 1 in magnitude, Cephes' rational approximation x - x^2/2 + x^3 P(x)/Q(x);
  // above it, log(1 + x) with 1 + x rounded first (as XLA's CPU backend does).
  static constexpr float kP[7] = {4.5270000862445199635215e-5f, 4.9854102823193375972212e-1f,
                                  6.5787325942061044846969e0f,  2.9911919328553073277375e1f,
                                  6.0949667980987787057556e1f,  5.7112963590585538103336e1f,
                                  2.0039553499201281259648e1f};
  static constexpr float kQ[7] = {1.0f,
                                  1.5062909083469192043167e1f,
                                  8.3047565967967209469434e1f,
                                  2.2176239823732856465394e2f,
                                  3.0909872225312059774938e2f,
                                  2.1642788614495947685003e2f,
                                  6.0118660497603843919306e1f};
  if (!(std::fabs(x) < 0.41421356237309504880f)) return log_f32(x + 1.0f);
  const float x2 = x * x;
  const float r = (x * x2) * (horner(kP, x) / horner(kQ, x));
  return x + std::fma(-0.5f, x2, r);
}

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
  float w = -log1p_f32(minus_x_squared);
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
