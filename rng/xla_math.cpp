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
  static constexpr float kAlpha[7] = {-2.72614225801306e-10f, 2.77068142495902e-08f,  -2.10102402082508e-06f,
                                      -5.69250639462346e-05f, -7.34990630326855e-04f, -2.95459980854025e-03f,
                                      -1.60960333262415e-02f};
  static constexpr float kBeta[5] = {-1.45660718464996e-05f, -2.13374055278905e-04f, -1.68282697438203e-03f,
                                     -7.37332916720468e-03f, -1.42647390514189e-02f};
  if (std::isnan(x)) return x;
  const float xc = std::fmin(std::fmax(x, -4.0f), 4.0f);
  const float x2 = xc * xc;
  const float erf = (xc * horner(kAlpha, x2)) / horner(kBeta, x2);
  return std::fmin(std::fmax(erf, -1.0f), 1.0f);
}

}  // namespace linum::rng
