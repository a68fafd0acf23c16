// Initializers: equality with the rng samplers scaled exactly as JAX does, fans, statistics,
// determinism, JAX's documented values and errors.
#include <doctest/doctest.h>

#include "testing/errors.hpp"

#include <linum/linum.hpp>

#include <cmath>
#include <string>
#include <vector>

using namespace linum;
namespace ini = linum::initializers;

namespace {

// x * s elementwise in float32 (one rounding per element), the reference for JAX's scaling.
Array times(const Array& x, float s) {
  std::vector<float> v = x.to_vector();
  for (float& e : v) e = e * s;
  return Array::from(x.shape(), v);
}

struct Stats {
  double mean = 0, stddev = 0, min = 0, max = 0;
};

Stats stats(const Array& a) {
  std::vector<float> v = a.to_vector();
  double s = 0, s2 = 0, lo = v.at(0), hi = v.at(0);
  for (float x : v) {
    s += x;
    s2 += static_cast<double>(x) * x;
    lo = std::min<double>(lo, x);
    hi = std::max<double>(hi, x);
  }
  const double n = static_cast<double>(v.size());
  const double mean = s / n;
  return {mean, std::sqrt(s2 / n - mean * mean), lo, hi};
}

using linum::testing::contains;
using linum::testing::error_of;

}  // namespace

TEST_CASE("constant initializers ignore the key and fill the shape") {
  const rng::Key k = rng::key(0);
  Array z = ini::zeros()(k, {2, 3});
  CHECK(z.shape() == Shape{2, 3});
  CHECK(z.dtype() == DType::f32);
  for (float v : z.to_vector()) CHECK(v == 0.0f);
  for (float v : ini::ones()(k, {4}).to_vector()) CHECK(v == 1.0f);
  Array c = ini::constant(-7.0f)(k, {2, 2, 2});
  CHECK(c.shape() == Shape{2, 2, 2});
  for (float v : c.to_vector()) CHECK(v == -7.0f);
  CHECK(ini::constant(3.5f)(rng::key(1), {}).item() == 3.5f);
  CHECK(ini::zeros()(rng::key(5), {3}).bitwise_equal(ini::zeros()(rng::key(9), {3})));
}

TEST_CASE("normal, uniform and truncated_normal scale the rng draws exactly as JAX") {
  const rng::Key k = rng::key(42);
  const Shape s{3, 4, 5};
  // JAX: random.normal(key, shape) * stddev
  CHECK(ini::normal(0.5f)(k, s).bitwise_equal(times(rng::normal(k, s), 0.5f)));
  CHECK(ini::normal()(k, s).bitwise_equal(times(rng::normal(k, s), 1e-2f)));
  // JAX: random.uniform(key, shape) * scale -- on [0, scale), not symmetric.
  Array u = ini::uniform(10.0f)(k, s);
  CHECK(u.bitwise_equal(times(rng::uniform(k, s), 10.0f)));
  Stats su = stats(u);
  CHECK(su.min >= 0.0);
  CHECK(su.max < 10.0);
  CHECK(ini::uniform()(k, s).bitwise_equal(times(rng::uniform(k, s), 1e-2f)));
  // JAX: random.truncated_normal(key, lower, upper, shape) * stddev
  Array t = ini::truncated_normal(3.0f, -1.0f, 0.5f)(k, s);
  CHECK(t.bitwise_equal(times(rng::truncated_normal(k, -1.0f, 0.5f, s), 3.0f)));
  Stats st = stats(t);
  CHECK(st.min > -3.0);
  CHECK(st.max < 1.5);
  CHECK(ini::truncated_normal()(k, s).bitwise_equal(times(rng::truncated_normal(k, -2.0f, 2.0f, s), 1e-2f)));
}

TEST_CASE("variance_scaling draws as JAX: same sampler calls, same float32 constants") {
  const rng::Key k = rng::key(7);
  const float trunc = static_cast<float>(.87962566103423978);
  // lecun_normal on a dense [3, 4] kernel: fan_in = 3.
  CHECK(ini::lecun_normal()(k, {3, 4})
            .bitwise_equal(times(rng::truncated_normal(k, -2, 2, {3, 4}), std::sqrt(static_cast<float>(1.0 / 3)) / trunc)));
  // he_normal on an HWIO conv kernel: fan_in = 3*3*5.
  CHECK(ini::he_normal()(k, {3, 3, 5, 8})
            .bitwise_equal(times(rng::truncated_normal(k, -2, 2, {3, 3, 5, 8}),
                                 std::sqrt(static_cast<float>(2.0 / 45)) / trunc)));
  // glorot_normal: fan_avg = (3 + 4) / 2.
  CHECK(ini::glorot_normal()(k, {3, 4})
            .bitwise_equal(times(rng::truncated_normal(k, -2, 2, {3, 4}), std::sqrt(static_cast<float>(1.0 / 3.5)) / trunc)));
  // Uniform variants: uniform(key, -1, 1) * sqrt(3 * variance) with variance in float32.
  CHECK(ini::lecun_uniform()(k, {6, 2})
            .bitwise_equal(times(rng::uniform(k, {6, 2}, -1, 1), std::sqrt(3.0f * static_cast<float>(1.0 / 6)))));
  CHECK(ini::he_uniform()(k, {6, 2})
            .bitwise_equal(times(rng::uniform(k, {6, 2}, -1, 1), std::sqrt(3.0f * static_cast<float>(2.0 / 6)))));
  CHECK(ini::glorot_uniform()(k, {6, 2})
            .bitwise_equal(times(rng::uniform(k, {6, 2}, -1, 1), std::sqrt(3.0f * static_cast<float>(1.0 / 4)))));
  // Normal distribution: normal(key) * sqrt(variance); fan_out of [6, 2] is 2.
  CHECK(ini::variance_scaling(0.5, ini::FanMode::fan_out, ini::Distribution::normal)(k, {6, 2})
            .bitwise_equal(times(rng::normal(k, {6, 2}), std::sqrt(static_cast<float>(0.5 / 2)))));
  // The aliases are the same initializers.
  CHECK(ini::kaiming_normal()(k, {4, 4}).bitwise_equal(ini::he_normal()(k, {4, 4})));
  CHECK(ini::kaiming_uniform()(k, {4, 4}).bitwise_equal(ini::he_uniform()(k, {4, 4})));
  CHECK(ini::xavier_normal()(k, {4, 4}).bitwise_equal(ini::glorot_normal()(k, {4, 4})));
  CHECK(ini::xavier_uniform()(k, {4, 4}).bitwise_equal(ini::glorot_uniform()(k, {4, 4})));
}

TEST_CASE("compute_fans follows JAX's _compute_fans") {
  auto fans = [](const Shape& s, int in = -2, int out = -1) { return ini::compute_fans(s, in, out); };
  CHECK(fans({5, 7}) == std::pair<double, double>(5, 7));                 // dense [in, out]
  CHECK(fans({3, 3, 16, 32}) == std::pair<double, double>(144, 288));     // conv HWIO: h*w*i, h*w*o
  CHECK(fans({2, 3, 3, 4, 6}) == std::pair<double, double>(72, 108));     // 3-d conv
  CHECK(fans({16, 3, 3, 32}, 0, -1) == std::pair<double, double>(144, 288));  // in axis first
  CHECK(fans({4, 10, 20}, 1, 2) == std::pair<double, double>(40, 80));    // a leading "receptive" axis
  // The fans reach the initializers: he_normal's scale on an OIHW kernel with explicit axes.
  const rng::Key k = rng::key(3);
  CHECK(ini::he_normal(1, 0)(k, {8, 5, 3, 3})
            .bitwise_equal(times(rng::truncated_normal(k, -2, 2, {8, 5, 3, 3}),
                                 std::sqrt(static_cast<float>(2.0 / 45)) / static_cast<float>(.87962566103423978))));
}

TEST_CASE("variance_scaling statistics match sqrt(scale / n) on large shapes") {
  struct Case {
    const char* name;
    Initializer init;
    Shape shape;
    double expected_std;
    double bound;  // every |value| must stay below it (0: no bound checked)
  };
  const double t = .87962566103423978;
  const std::vector<Case> cases = {
      {"lecun_normal", ini::lecun_normal(), {256, 512}, std::sqrt(1.0 / 256), 2 * std::sqrt(1.0 / 256) / t},
      {"lecun_uniform", ini::lecun_uniform(), {256, 512}, std::sqrt(1.0 / 256), std::sqrt(3.0 / 256)},
      {"he_normal", ini::he_normal(), {256, 512}, std::sqrt(2.0 / 256), 2 * std::sqrt(2.0 / 256) / t},
      {"he_uniform", ini::he_uniform(), {256, 512}, std::sqrt(2.0 / 256), std::sqrt(6.0 / 256)},
      {"glorot_normal", ini::glorot_normal(), {256, 512}, std::sqrt(1.0 / 384), 2 * std::sqrt(1.0 / 384) / t},
      {"glorot_uniform", ini::glorot_uniform(), {256, 512}, std::sqrt(1.0 / 384), std::sqrt(3.0 / 384)},
      {"fan_out normal", ini::variance_scaling(3.0, ini::FanMode::fan_out, ini::Distribution::normal), {256, 512},
       std::sqrt(3.0 / 512), 0},
      {"he_normal conv", ini::he_normal(), {3, 3, 64, 128}, std::sqrt(2.0 / 576), 2 * std::sqrt(2.0 / 576) / t},
      {"glorot_uniform conv", ini::glorot_uniform(), {3, 3, 64, 128}, std::sqrt(2.0 / (576 + 1152)),
       std::sqrt(6.0 / (576 + 1152))},
  };
  for (const Case& c : cases) {
    CAPTURE(c.name);
    Stats s = stats(c.init(rng::key(11), c.shape));
    CHECK(std::abs(s.mean) < 0.02 * c.expected_std);
    CHECK(std::abs(s.stddev / c.expected_std - 1.0) < 0.01);
    if (c.bound > 0) {
      CHECK(s.max < c.bound);
      CHECK(s.min > -c.bound);
      // The tails do get close to the bound (the distribution is really cut there).
      CHECK(std::max(s.max, -s.min) > 0.95 * c.bound);
    }
  }
}

TEST_CASE("initializers are deterministic per key") {
  for (const Initializer& init : {ini::normal(1.0f), ini::uniform(1.0f), ini::truncated_normal(1.0f),
                                  ini::lecun_normal(), ini::glorot_uniform()}) {
    Array a = init(rng::key(5), {8, 9});
    CHECK(a.bitwise_equal(init(rng::key(5), {8, 9})));
    CHECK(!a.bitwise_equal(init(rng::key(6), {8, 9})));
    CHECK(!a.bitwise_equal(init(rng::fold_in(rng::key(5), 1), {8, 9})));
  }
}

TEST_CASE("values printed in JAX's docstrings for PRNGKey(42), shape (2, 3)") {
  // From the examples in jax/_src/nn/initializers.py (generated with the legacy threefry mode).
  rng::ModeGuard legacy(rng::Mode::legacy);
  const rng::Key k = rng::key(42);
  auto close = [](const Array& a, std::vector<float> want) {
    std::vector<float> got = a.to_vector();
    REQUIRE(got.size() == want.size());
    for (std::size_t i = 0; i < got.size(); ++i) {
      CAPTURE(i);
      CHECK(got[i] == doctest::Approx(want[i]).epsilon(2e-6));
    }
  };
  close(ini::uniform(10.0f)(k, {2, 3}), {7.298188f, 8.691938f, 8.7230015f, 2.0818567f, 1.8662417f, 5.5022564f});
  close(ini::normal(5.0f)(k, {2, 3}), {3.0613258f, 5.6129413f, 5.6866574f, -4.063663f, -4.4520254f, 0.63115686f});
  close(ini::truncated_normal(5.0f)(k, {2, 3}), {2.9047365f, 5.2338114f, 5.29852f, -3.836303f, -4.192359f, 0.6022964f});
  close(ini::glorot_uniform()(k, {2, 3}),
        {0.50350785f, 0.8088631f, 0.81566876f, -0.6393332f, -0.6865721f, 0.11003882f});
  close(ini::glorot_normal()(k, {2, 3}),
        {0.41770416f, 0.75262755f, 0.7619329f, -0.5516644f, -0.6028657f, 0.08661086f});
  close(ini::lecun_uniform()(k, {2, 3}),
        {0.56293887f, 0.90433645f, 0.9119454f, -0.71479625f, -0.7676109f, 0.12302713f});
  close(ini::lecun_normal()(k, {2, 3}),
        {0.46700746f, 0.8414632f, 0.8518669f, -0.61677957f, -0.67402434f, 0.09683388f});
  close(ini::he_uniform()(k, {2, 3}), {0.79611576f, 1.2789248f, 1.2896855f, -1.0108745f, -1.0855657f, 0.17398663f});
  close(ini::he_normal()(k, {2, 3}), {0.6604483f, 1.1900088f, 1.2047218f, -0.87225807f, -0.95321447f, 0.1369438f});
}

TEST_CASE("initializer errors name the initializer and the shape") {
  const rng::Key k = rng::key(0);
  std::string e = error_of<ShapeError>([&] { ini::lecun_normal()(k, {5}); });
  CHECK(contains(e, "lecun_normal"));
  CHECK(contains(e, "(5,)"));
  CHECK(contains(e, "at least 2 dimensions"));
  e = error_of<ShapeError>([&] { ini::glorot_uniform()(k, {}); });
  CHECK(contains(e, "glorot_uniform"));
  CHECK(contains(e, "()"));
  e = error_of<ShapeError>([&] { ini::he_uniform(-3, -1)(k, {4, 5}); });
  CHECK(contains(e, "he_uniform"));
  CHECK(contains(e, "in_axis -3"));
  CHECK(contains(e, "(4, 5)"));
  e = error_of<ShapeError>([&] { ini::variance_scaling(1.0, ini::FanMode::fan_in, ini::Distribution::normal, 1, -1)(k, {4, 5}); });
  CHECK(contains(e, "variance_scaling"));
  CHECK(contains(e, "same axis"));
  e = error_of<ShapeError>([&] { ini::he_normal()(k, {0, 5}); });
  CHECK(contains(e, "he_normal"));
  CHECK(contains(e, "(0, 5)"));
  e = error_of<ValueError>([&] { ini::variance_scaling(-1.0, ini::FanMode::fan_avg, ini::Distribution::uniform); });
  CHECK(contains(e, "scale"));
  e = error_of<ValueError>([&] { ini::truncated_normal(1.0f, 2.0f, -2.0f); });
  CHECK(contains(e, "truncated_normal"));
  CHECK(contains(e, "lower"));
  // Shapes the plain distributions accept: biases and scalars.
  CHECK(ini::normal()(k, {5}).shape() == Shape{5});
  CHECK(ini::truncated_normal()(k, {}).shape() == Shape{});
}
