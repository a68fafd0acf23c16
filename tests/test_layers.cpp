// The standard layers (linum::nn): outputs against references computed independently (explicit
// loops in double precision here, or values printed by Flax's own docstrings), parameter names and
// shapes against Flax's, BatchNorm statistics, Dropout masks, losses, gradients against finite
// differences, module configurations as JSON, and tabulate.
#include <doctest/doctest.h>
#include <linum/linum.hpp>
#include <linum/nn/config.hpp>

#include "testing/gradcheck.hpp"

#include <cmath>
#include <optional>
#include <limits>
#include <vector>

using namespace linum;
using linum::testing::check_gradients;
using linum::testing::random_array;
using linum::testing::max_abs_diff;

namespace {

void check_close(const Array& a, const std::vector<double>& want, double tol = 1e-5) {
  REQUIRE(a.numel() == static_cast<std::int64_t>(want.size()));
  const std::vector<float> got = a.to_vector();
  for (std::size_t i = 0; i < want.size(); ++i) {
    INFO("element " << i);
    CHECK(got[i] == doctest::Approx(want[i]).epsilon(tol).scale(1.0));
  }
}

std::vector<double> as_double(const Array& a) {
  std::vector<float> v = a.to_vector();
  return {v.begin(), v.end()};
}

Tree params(Tree p) { return Tree{{"params", std::move(p)}}; }

Shape shape_at(const Tree& t, const std::string& path) { return t.at_path(path).array().shape(); }

}  // namespace

// ---- cross-checks against values printed in Flax's docstrings --------------------------------------

TEST_CASE("Flax docstring values: Embed init/lookup and Dense + Dropout (partitionable keys)") {
  rng::ModeGuard mode(rng::Mode::partitionable);
  // flax/linen/linear.py, Embed: nn.Embed(5, 3).init(jax.random.key(0), [[0, 1, 2], [-1, -2, -3]]).
  Array ids = Array::from_i32(Shape{2, 3}, {0, 1, 2, -1, -2, -3});
  nn::Embed embed{.num_embeddings = 5, .features = 3};
  Tree v = init(embed, rng::key(0), ids);
  const std::vector<double> table{0.04396089, -0.9328513, -0.97328115, 0.41147125, 0.66334754, 0.49469155,
                                  0.09719624, 0.49861377, 0.49519277, -0.13316602, 0.6697022,  0.3710195,
                                  -0.5039532, 0.287319,   1.4369922};
  check_close(v.at_path("params/embedding").array(), table, 1e-6);
  Array y = apply(embed, v, ids);
  CHECK(y.shape() == Shape{2, 3, 3});
  check_close(slice_axis(y, 0, 1, 2), {-0.5039532, 0.287319, 1.4369922, -0.13316602, 0.6697022, 0.3710195,
                                       0.09719624, 0.49861377, 0.49519277}, 1e-6);

  // flax/linen/stochastic.py, Dropout: Dense(4) then Dropout(0.5) on ones((1, 3)), init key 0,
  // dropout key 1.
  struct MLP {
    Array operator()(Scope& s, const Array& x, bool train) const {
      Array h = s(nn::Dense{.features = 4}, x);
      return s(nn::Dropout{.rate = 0.5}, h, !train);
    }
  };
  Array x = Array::ones(Shape{1, 3});
  Tree vm = init(MLP{}, rng::key(0), x, false);
  check_close(apply(MLP{}, vm, x, false), {-0.17875527, 1.6255447, -1.2431065, -0.02554005}, 1e-6);
  check_close(apply(MLP{}, vm, {.rngs = {{"dropout", rng::key(1)}}}, x, true).first, {-0.35751054, 3.2510893, 0, 0}, 1e-6);
}

// ---- Dense / DenseGeneral ---------------------------------------------------------------------------

TEST_CASE("Dense: Flax's param names and shapes, values, any rank, no bias") {
  struct Net {
    Array operator()(Scope& s, const Array& x) const { return s(nn::Dense{.features = 3}, x); }
  };
  Array x = random_array(Shape{2, 5}, 1);
  Tree v = init(Net{}, rng::key(0), x);
  CHECK(v.at("params").keys() == std::vector<std::string>{"Dense_0"});
  CHECK(v.at_path("params/Dense_0").keys() == std::vector<std::string>{"kernel", "bias"});
  CHECK(shape_at(v, "params/Dense_0/kernel") == Shape{5, 3});
  CHECK(shape_at(v, "params/Dense_0/bias") == Shape{3});
  CHECK(v.at_path("params/Dense_0/bias").array().to_vector() == std::vector<float>{0, 0, 0});  // zeros

  // Values with chosen params: y[n, o] = sum_i x[n, i] k[i, o] + b[o], in double.
  Array k = random_array(Shape{5, 3}, 2), b = random_array(Shape{3}, 3);
  nn::Dense dense{.features = 3};
  Array x3 = random_array(Shape{2, 2, 5}, 4);  // any rank: contracts the last axis
  Array y = apply(dense, params({{"kernel", k}, {"bias", b}}), x3);
  CHECK(y.shape() == Shape{2, 2, 3});
  std::vector<double> want;
  for (int n = 0; n < 4; ++n)
    for (int o = 0; o < 3; ++o) {
      double acc = b.data()[o];
      for (int i = 0; i < 5; ++i) acc += double(x3.data()[n * 5 + i]) * k.data()[i * 3 + o];
      want.push_back(acc);
    }
  check_close(y, want);

  Tree nb = init(nn::Dense{.features = 3, .use_bias = false}, rng::key(0), x);
  CHECK(nb.at("params").keys() == std::vector<std::string>{"kernel"});

  CHECK_THROWS_WITH_AS(init(nn::Dense{}, rng::key(0), x), doctest::Contains("features must be positive"), ValueError);
  CHECK_THROWS_WITH_AS(apply(Net{}, v, Array::zeros(Shape{2, 4})),
                       doctest::Contains("param 'params/Dense_0/kernel' has shape (5, 3) in the variable dict but the "
                                         "module asks for (4, 3)"),
                       ShapeError);
}

TEST_CASE("DenseGeneral: kernel (in axes..., features...), flattened initializer, values") {
  Shape seen;
  Initializer spy = [&](rng::Key key, const Shape& s) {
    seen = s;
    return initializers::lecun_normal()(key, s);
  };
  nn::DenseGeneral dg{.features = {2, 3}, .kernel_init = spy};
  Array x = random_array(Shape{4, 5}, 5);
  Tree v = init(dg, rng::key(0), x);
  CHECK(shape_at(v, "params/kernel") == Shape{5, 2, 3});
  CHECK(shape_at(v, "params/bias") == Shape{2, 3});
  CHECK(seen == Shape{5, 6});  // Flax's kernel_init_wrap: fans of the flattened matrix

  // Contract the last two axes: y[n, o] = sum_{a, b} x[n, a, b] k[a, b, o] + bias[o].
  nn::DenseGeneral over2{.features = {4}, .axis = {-1, -2}};
  Array x3 = random_array(Shape{2, 3, 2}, 6);
  Tree v2 = init(over2, rng::key(0), x3);
  CHECK(shape_at(v2, "params/kernel") == Shape{3, 2, 4});
  Array k = random_array(Shape{3, 2, 4}, 7), b = random_array(Shape{4}, 8);
  Array y = apply(over2, params({{"kernel", k}, {"bias", b}}), x3);
  CHECK(y.shape() == Shape{2, 4});
  std::vector<double> want;
  for (int n = 0; n < 2; ++n)
    for (int o = 0; o < 4; ++o) {
      double acc = b.data()[o];
      for (int a = 0; a < 3; ++a)
        for (int c = 0; c < 2; ++c) acc += double(x3.data()[n * 6 + a * 2 + c]) * k.data()[(a * 2 + c) * 4 + o];
      want.push_back(acc);
    }
  check_close(y, want);
  CHECK_THROWS_AS(init(nn::DenseGeneral{.features = {2}, .axis = {3}}, rng::key(0), x), ShapeError);
}

// ---- Conv -------------------------------------------------------------------------------------------

namespace {

// Direct convolution in double: x [N, H, W, C], k [KH, KW, C / G, O], explicit (low, high) pads.
std::vector<double> conv_ref(const Array& x, const Array& k, std::array<int, 2> stride, std::array<int, 4> pad,
                             std::array<int, 2> dil, int groups, Shape* out_shape) {
  const int N = int(x.dim(0)), H = int(x.dim(1)), W = int(x.dim(2)), C = int(x.dim(3));
  const int KH = int(k.dim(0)), KW = int(k.dim(1)), CG = int(k.dim(2)), O = int(k.dim(3));
  const int OG = O / groups;
  const int OH = (H + pad[0] + pad[1] - ((KH - 1) * dil[0] + 1)) / stride[0] + 1;
  const int OW = (W + pad[2] + pad[3] - ((KW - 1) * dil[1] + 1)) / stride[1] + 1;
  *out_shape = Shape{N, OH, OW, O};
  std::vector<double> y;
  for (int n = 0; n < N; ++n)
    for (int oh = 0; oh < OH; ++oh)
      for (int ow = 0; ow < OW; ++ow)
        for (int o = 0; o < O; ++o) {
          const int g = o / OG;
          double acc = 0;
          for (int i = 0; i < KH; ++i)
            for (int j = 0; j < KW; ++j) {
              const int h = oh * stride[0] - pad[0] + i * dil[0], w = ow * stride[1] - pad[2] + j * dil[1];
              if (h < 0 || h >= H || w < 0 || w >= W) continue;
              for (int c = 0; c < CG; ++c)
                acc += double(x.data()[((n * H + h) * W + w) * C + g * CG + c]) * k.data()[((i * KW + j) * CG + c) * O + o];
            }
          y.push_back(acc);
        }
  return y;
}

}  // namespace

TEST_CASE("Conv: HWIO kernel, SAME/VALID/explicit padding, strides, dilation, groups") {
  struct Net {
    Array operator()(Scope& s, const Array& x) const { return s(nn::Conv{.features = 4, .kernel_size = {3, 3}}, x); }
  };
  Array x = random_array(Shape{2, 5, 6, 2}, 11);
  Tree v = init(Net{}, rng::key(0), x);
  CHECK(shape_at(v, "params/Conv_0/kernel") == Shape{3, 3, 2, 4});
  CHECK(shape_at(v, "params/Conv_0/bias") == Shape{4});

  struct Case {
    nn::Conv conv;
    std::array<int, 4> pad;  // the (low, high) pads that conv's padding means for this input
  };
  const std::vector<Case> cases{
      {nn::Conv{.features = 4, .kernel_size = {3, 3}}, {1, 1, 1, 1}},                                  // SAME
      {nn::Conv{.features = 4, .kernel_size = {3, 2}, .padding = "VALID"}, {0, 0, 0, 0}},
      {nn::Conv{.features = 4, .kernel_size = {3, 3}, .strides = {2, 2}}, {1, 1, 0, 1}},               // SAME, stride 2
      {nn::Conv{.features = 4, .kernel_size = {2, 2}, .padding = {{1, 0}, {0, 2}}}, {1, 0, 0, 2}},
      {nn::Conv{.features = 4, .kernel_size = {2, 2}, .padding = 1}, {1, 1, 1, 1}},
      {nn::Conv{.features = 4, .kernel_size = {2, 2}, .padding = "VALID", .kernel_dilation = {2}}, {0, 0, 0, 0}},
      {nn::Conv{.features = 4, .kernel_size = {1, 1}, .feature_group_count = 2}, {0, 0, 0, 0}},
  };
  for (const auto& c : cases) {
    const Shape ks{c.conv.kernel_size[0], c.conv.kernel_size[1], 2 / c.conv.feature_group_count, 4};
    Array k = random_array(ks, 12), b = random_array(Shape{4}, 13);
    Tree p = init(c.conv, rng::key(0), x);
    CHECK(shape_at(p, "params/kernel") == ks);
    Array y = apply(c.conv, params({{"kernel", k}, {"bias", b}}), x);
    const auto stride = c.conv.strides.empty() ? std::array<int, 2>{1, 1} : std::array<int, 2>{int(c.conv.strides[0]), int(c.conv.strides[1])};
    const int d = c.conv.kernel_dilation.empty() ? 1 : int(c.conv.kernel_dilation[0]);
    Shape want_shape;
    std::vector<double> want = conv_ref(x, k, stride, c.pad, {d, d}, int(c.conv.feature_group_count), &want_shape);
    for (std::size_t i = 0; i < want.size(); ++i) want[i] += b.data()[i % 4];
    CHECK(y.shape() == want_shape);
    check_close(y, want, 1e-4);
  }
}

TEST_CASE("Conv: unbatched input, 1-D and CAUSAL, errors") {
  nn::Conv conv{.features = 3, .kernel_size = {2, 2}};
  Array x = random_array(Shape{1, 4, 4, 2}, 21);
  Tree v = init(conv, rng::key(0), x);
  // [H, W, C] is one example (Flax adds and removes the batch axis).
  Array y1 = apply(conv, v, reshape(x, {4, 4, 2}));
  CHECK(y1.shape() == Shape{4, 4, 3});
  CHECK(y1.bitwise_equal(reshape(apply(conv, v, x), {4, 4, 3})));
  // Two batch axes are flattened and restored.
  CHECK(apply(conv, v, reshape(concatenate({x, x}, 0), {2, 1, 4, 4, 2})).shape() == Shape{2, 1, 4, 4, 3});
  CHECK_THROWS_WITH_AS(apply(conv, v, Array::zeros(Shape{4, 4})),
                       doctest::Contains("needs NHWC [N, H, W, C]"), ShapeError);

  // 1-D causal convolution: y[t] = sum_j x[t - (K - 1) + j] k[j] (zeros before the start).
  nn::Conv c1{.features = 1, .kernel_size = {3}, .padding = "CAUSAL", .use_bias = false};
  Array seq = Array::from(Shape{1, 5, 1}, {1, 2, 3, 4, 5});
  Tree v1 = init(c1, rng::key(0), seq);
  CHECK(shape_at(v1, "params/kernel") == Shape{3, 1, 1});
  Array y = apply(c1, params({{"kernel", Array::from(Shape{3, 1, 1}, {0.5f, -1, 2})}}), seq);
  check_close(y, {2, 4 - 1, 6 - 2 + 0.5, 8 - 3 + 1, 10 - 4 + 1.5});
  CHECK_THROWS_WITH_AS(init(nn::Conv{.features = 2, .kernel_size = {3, 3}, .padding = "REFLECT"}, rng::key(0), x),
                       doctest::Contains("unknown padding 'REFLECT'"), ValueError);
  CHECK_THROWS_AS(init(nn::Conv{.features = 3, .kernel_size = {1, 1}, .feature_group_count = 2}, rng::key(0), x),
                  ValueError);
}

// ---- Embed ------------------------------------------------------------------------------------------

TEST_CASE("Embed: lookup, attend shares the table, errors") {
  struct Tied {
    Array operator()(Scope& s, const Array& ids) const {
      nn::Embed e{.num_embeddings = 4, .features = 3};
      Array h = s("embed", e, ids);
      return s.call("embed", &nn::Embed::attend, e, h);
    }
  };
  Array ids = Array::from_i32(Shape{2}, {3, 1});
  Tree v = init(Tied{}, rng::key(0), ids);
  CHECK(v.at("params").keys() == std::vector<std::string>{"embed"});
  CHECK(shape_at(v, "params/embed/embedding") == Shape{4, 3});
  Array table = Array::from(Shape{4, 3}, {1, 0, 0, 0, 1, 0, 0, 0, 1, 1, 2, 3});
  Array logits = apply(Tied{}, params({{"embed", Tree{{"embedding", table}}}}), ids);
  // row 3 = (1, 2, 3): dots with the rows (1,0,0) (0,1,0) (0,0,1) (1,2,3) = 1 2 3 14; row 1 = (0,1,0).
  check_close(logits, {1, 2, 3, 14, 0, 1, 0, 2});
  nn::Embed e{.num_embeddings = 4, .features = 3};
  CHECK_THROWS_WITH_AS(apply(e, params({{"embedding", table}}), Array::from_i32(Shape{1}, {4})),
                       doctest::Contains("index 4"), ValueError);
  CHECK_THROWS_WITH_AS(apply(e, params({{"embedding", table}}), Array::zeros(Shape{1})),
                       doctest::Contains("indices must be int32"), ValueError);
  // num_embeddings == 1 broadcasts the single vector.
  nn::Embed one{.num_embeddings = 1, .features = 2};
  check_close(apply(one, params({{"embedding", Array::from(Shape{1, 2}, {5, 6})}}), Array::from_i32(Shape{2}, {0, 0})),
              {5, 6, 5, 6});
}

// ---- normalization ----------------------------------------------------------------------------------

namespace {

// (x - mean) / sqrt(var + eps) * scale + bias over groups of `inner` consecutive elements (the
// reduced block), scale/bias indexed by element % period.
std::vector<double> norm_ref(const std::vector<double>& x, int inner, double eps, const std::vector<double>& scale,
                             const std::vector<double>& bias, bool center = true) {
  std::vector<double> y(x.size());
  for (std::size_t start = 0; start < x.size(); start += inner) {
    double m = 0, m2 = 0;
    for (int i = 0; i < inner; ++i) {
      m += x[start + i] / inner;
      m2 += x[start + i] * x[start + i] / inner;
    }
    const double var = center ? m2 - m * m : m2;
    for (int i = 0; i < inner; ++i) {
      const std::size_t j = start + i;
      y[j] = ((center ? x[j] - m : x[j]) / std::sqrt(var + eps)) * scale[j % scale.size()] + (bias.empty() ? 0 : bias[j % bias.size()]);
    }
  }
  return y;
}

}  // namespace

TEST_CASE("LayerNorm and RMSNorm: params scale/bias, values") {
  Array x = random_array(Shape{3, 4}, 31, -2, 2);
  Tree v = init(nn::LayerNorm{}, rng::key(0), x);
  CHECK(v.at("params").keys() == std::vector<std::string>{"scale", "bias"});
  CHECK(v.at_path("params/scale").array().to_vector() == std::vector<float>{1, 1, 1, 1});
  CHECK(v.at_path("params/bias").array().to_vector() == std::vector<float>{0, 0, 0, 0});
  Array scale = random_array(Shape{4}, 32), bias = random_array(Shape{4}, 33);
  std::vector<double> sc = as_double(scale), bi = as_double(bias);
  check_close(apply(nn::LayerNorm{}, params({{"scale", scale}, {"bias", bias}}), x), norm_ref(as_double(x), 4, 1e-6, sc, bi),
              1e-4);
  nn::LayerNorm big_eps{.epsilon = 0.5};
  check_close(apply(big_eps, params({{"scale", scale}, {"bias", bias}}), x), norm_ref(as_double(x), 4, 0.5, sc, bi), 1e-4);

  Tree vr = init(nn::RMSNorm{}, rng::key(0), x);
  CHECK(vr.at("params").keys() == std::vector<std::string>{"scale"});
  check_close(apply(nn::RMSNorm{}, params({{"scale", scale}}), x), norm_ref(as_double(x), 4, 1e-6, sc, {}, false), 1e-4);
}

TEST_CASE("GroupNorm: groups of channels over every axis but the batch") {
  // x [N=2, H=3, C=4], 2 groups: statistics over (H, 2 channels) per example and group.
  Array x = random_array(Shape{2, 3, 4}, 41, -2, 2);
  nn::GroupNorm gn{.num_groups = 2};
  Tree v = init(gn, rng::key(0), x);
  CHECK(shape_at(v, "params/scale") == Shape{4});
  CHECK(shape_at(v, "params/bias") == Shape{4});
  Array scale = random_array(Shape{4}, 42), bias = random_array(Shape{4}, 43);
  Array y = apply(gn, params({{"scale", scale}, {"bias", bias}}), x);
  std::vector<double> want(24);
  const std::vector<float> xv = x.to_vector();
  for (int n = 0; n < 2; ++n)
    for (int g = 0; g < 2; ++g) {
      double m = 0, m2 = 0;
      for (int h = 0; h < 3; ++h)
        for (int c = 2 * g; c < 2 * g + 2; ++c) {
          const double e = xv[(n * 3 + h) * 4 + c];
          m += e / 6;
          m2 += e * e / 6;
        }
      for (int h = 0; h < 3; ++h)
        for (int c = 2 * g; c < 2 * g + 2; ++c) {
          const int j = (n * 3 + h) * 4 + c;
          want[j] = (xv[j] - m) / std::sqrt(m2 - m * m + 1e-6) * scale.data()[c] + bias.data()[c];
        }
    }
  check_close(y, want, 1e-4);
  // group_size 2 is the same grouping.
  nn::GroupNorm by_size{.num_groups = std::nullopt, .group_size = 2};
  check_close(apply(by_size, params({{"scale", scale}, {"bias", bias}}), x), want, 1e-4);
  CHECK_THROWS_WITH_AS(init(nn::GroupNorm{}, rng::key(0), x), doctest::Contains("number of groups (32) does not divide"),
                       ValueError);
  CHECK_THROWS_WITH_AS(init(nn::GroupNorm{.group_size = 2}, rng::key(0), x), doctest::Contains("exactly one of"), ValueError);
}

TEST_CASE("BatchNorm: batch_stats, train vs eval, running-average updates as Flax") {
  struct Net {
    Array operator()(Scope& s, const Array& x, bool train) const { return s(nn::BatchNorm{}, x, !train); }
  };
  Array x = random_array(Shape{5, 3}, 51, -2, 3);
  Tree v = init(Net{}, rng::key(0), x, true);
  CHECK(v.keys() == std::vector<std::string>{"batch_stats", "params"});
  CHECK(v.at_path("batch_stats/BatchNorm_0").keys() == std::vector<std::string>{"mean", "var"});
  CHECK(v.at_path("params/BatchNorm_0").keys() == std::vector<std::string>{"scale", "bias"});
  // Init does not update the running statistics (Flax: not while initializing).
  CHECK(v.at_path("batch_stats/BatchNorm_0/mean").array().to_vector() == std::vector<float>{0, 0, 0});
  CHECK(v.at_path("batch_stats/BatchNorm_0/var").array().to_vector() == std::vector<float>{1, 1, 1});

  // Batch statistics per feature, biased variance, in double.
  const std::vector<float> xv = x.to_vector();
  std::vector<double> m(3, 0), var(3, 0);
  for (int n = 0; n < 5; ++n)
    for (int c = 0; c < 3; ++c) m[c] += xv[n * 3 + c] / 5.0;
  for (int n = 0; n < 5; ++n)
    for (int c = 0; c < 3; ++c) var[c] += (xv[n * 3 + c] - m[c]) * (xv[n * 3 + c] - m[c]) / 5.0;
  Tree vars = v;
  vars.at("params").at("BatchNorm_0").set("scale", Array::from(Shape{3}, {1, 2, 0.5f}));
  vars.at("params").at("BatchNorm_0").set("bias", Array::from(Shape{3}, {0, -1, 1}));
  vars.at("batch_stats").at("BatchNorm_0").set("mean", Array::from(Shape{3}, {0.5f, -0.5f, 1}));
  vars.at("batch_stats").at("BatchNorm_0").set("var", Array::from(Shape{3}, {2, 0.5f, 1.5f}));
  const std::vector<double> sc{1, 2, 0.5}, bi{0, -1, 1}, ra_m{0.5, -0.5, 1}, ra_v{2, 0.5, 1.5};

  auto [y, updates] = apply(Net{}, vars, {.mutable_collections = {"batch_stats"}}, x, true);
  std::vector<double> want(15);
  for (int n = 0; n < 5; ++n)
    for (int c = 0; c < 3; ++c) want[n * 3 + c] = (xv[n * 3 + c] - m[c]) / std::sqrt(var[c] + 1e-5) * sc[c] + bi[c];
  check_close(y, want, 1e-4);
  std::vector<double> new_m(3), new_v(3);
  for (int c = 0; c < 3; ++c) {
    new_m[c] = 0.99 * ra_m[c] + 0.01 * m[c];
    new_v[c] = 0.99 * ra_v[c] + 0.01 * var[c];
  }
  check_close(updates.at_path("batch_stats/BatchNorm_0/mean").array(), new_m, 1e-5);
  check_close(updates.at_path("batch_stats/BatchNorm_0/var").array(), new_v, 1e-5);

  // Training without a mutable batch_stats is an error, as Flax's ModifyScopeVariableError (it used
  // to skip the update silently), naming the module and the collection to make mutable.
  CHECK_THROWS_WITH_AS(apply(Net{}, vars, ApplyOptions{}, x, true),
                       doctest::Contains("in module 'BatchNorm_0' (BatchNorm): BatchNorm in training mode "
                                         "(use_running_average = false) updates its running statistics in collection "
                                         "'batch_stats', which this call cannot write: apply with .mutable_collections = "
                                         "{\"batch_stats\"}"),
                       ValueError);

  // Eval: the stored statistics.
  Array ye = apply(Net{}, vars, x, false);
  for (int n = 0; n < 5; ++n)
    for (int c = 0; c < 3; ++c) want[n * 3 + c] = (xv[n * 3 + c] - ra_m[c]) / std::sqrt(ra_v[c] + 1e-5) * sc[c] + bi[c];
  check_close(ye, want, 1e-4);

  // momentum as a field; axis as a field (features on axis 0 here).
  nn::BatchNorm bn{.use_running_average = false, .axis = 0, .momentum = 0.5};
  Array xt = transpose(x);  // [3, 5]
  Tree vt = init(bn, rng::key(0), xt);
  CHECK(shape_at(vt, "batch_stats/mean") == Shape{3});
  auto [yt, ut] = apply(bn, vt, {.mutable_collections = {"batch_stats"}}, xt);
  std::vector<double> half_m(3);
  for (int c = 0; c < 3; ++c) half_m[c] = 0.5 * m[c];
  check_close(ut.at_path("batch_stats/mean").array(), half_m, 1e-5);
  // merge_param: both or neither is an error.
  CHECK_THROWS_WITH_AS(apply(bn, vt, xt, true), doctest::Contains("set both on the module and in the call"), ValueError);
  CHECK_THROWS_WITH_AS(init(nn::BatchNorm{}, rng::key(0), x), doctest::Contains("set neither"), ValueError);
}

// ---- Dropout ----------------------------------------------------------------------------------------

TEST_CASE("Dropout: deterministic, rate 0 and 1, masks per key, scaling, fraction, broadcast_dims") {
  Array x = random_array(Shape{100, 100}, 61, 0.5f, 1.5f);
  nn::Dropout d{.rate = 0.3};
  Tree v = init(d, rng::key(0), x, true);
  CHECK(v.empty());
  CHECK(apply(d, v, x, true).shares_buffer(x));
  CHECK(apply(nn::Dropout{.rate = 0.0}, v, x, false).shares_buffer(x));
  auto run = [&](const nn::Dropout& m, int seed) {
    return apply(m, v, {.rngs = {{"dropout", rng::key(seed)}}}, x, false).first;
  };
  Array all = run(nn::Dropout{.rate = 1.0}, 1);
  CHECK(all.to_vector() == std::vector<float>(10000, 0.0f));
  Array a = run(d, 1), b = run(d, 1), c = run(d, 2);
  CHECK(a.bitwise_equal(b));
  CHECK_FALSE(a.bitwise_equal(c));
  // The mask is rng::bernoulli(key, 0.7, shape) with the key from the "dropout" stream; kept
  // elements are x / 0.7.
  rng::Streams streams{{"dropout", rng::key(1)}};
  Array mask = rng::bernoulli(streams.derive("dropout", {}, 1), 0.7f, x.shape());
  int kept = 0;
  bool values_ok = true;
  for (int i = 0; i < 10000; ++i) {
    const float want = mask.data()[i] != 0 ? x.data()[i] / 0.7f : 0.0f;
    values_ok = values_ok && a.data()[i] == want;
    kept += mask.data()[i] != 0;
  }
  CHECK(values_ok);
  CHECK(kept == doctest::Approx(7000).epsilon(0.03));
  // An explicit key overrides the stream.
  CHECK(apply(d, v, x, false, rng::key(7)).bitwise_equal(apply(d, v, x, false, rng::key(7))));
  // broadcast_dims: one mask value per column.
  Array bc = run(nn::Dropout{.rate = 0.5, .broadcast_dims = {0}}, 3);
  bool columns_shared = true;
  for (int r = 1; r < 100; ++r)
    for (int col = 0; col < 100; ++col) columns_shared = columns_shared && ((bc.data()[r * 100 + col] == 0) == (bc.data()[col] == 0));
  CHECK(columns_shared);
  CHECK_THROWS_WITH_AS(apply(d, v, x, false), doctest::Contains("dropout"), ValueError);  // no stream given
  CHECK_THROWS_WITH_AS(apply(nn::Dropout{.rate = 1.5}, v, x, false), doctest::Contains("rate must be in [0, 1]"), ValueError);
}

// ---- attention --------------------------------------------------------------------------------------

namespace {

// softmax(q.k / sqrt(d) masked) . v for q [B, Lq, H, D], k/v [B, Lk, H, D], mask(b, h, i, j) -> bool.
template <class Mask>
std::vector<double> attention_ref(const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v,
                                  int B, int Lq, int Lk, int H, int D, Mask mask) {
  std::vector<double> out(static_cast<std::size_t>(B * Lq * H * D), 0.0);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < Lq; ++i) {
        std::vector<double> logits(Lk);
        double mx = -1e300;
        for (int j = 0; j < Lk; ++j) {
          double dot = 0;
          for (int d = 0; d < D; ++d) dot += q[((b * Lq + i) * H + h) * D + d] * k[((b * Lk + j) * H + h) * D + d];
          logits[j] = mask(b, h, i, j) ? dot / std::sqrt(double(D)) : -3.4028234663852886e38;
          mx = std::max(mx, logits[j]);
        }
        double z = 0;
        for (double& l : logits) z += (l = std::exp(l - mx));
        for (int j = 0; j < Lk; ++j)
          for (int d = 0; d < D; ++d) out[((b * Lq + i) * H + h) * D + d] += logits[j] / z * v[((b * Lk + j) * H + h) * D + d];
      }
  return out;
}

}  // namespace

TEST_CASE("dot_product_attention against loops; masks; fully masked rows are uniform") {
  const int B = 2, L = 3, H = 2, D = 2;
  Array q = random_array(Shape{B, L, H, D}, 71), k = random_array(Shape{B, L, H, D}, 72), v = random_array(Shape{B, L, H, D}, 73);
  auto all = [](int, int, int, int) { return true; };
  Array y = nn::dot_product_attention(q, k, v);
  CHECK(y.shape() == Shape{B, L, H, D});
  check_close(y, attention_ref(as_double(q), as_double(k), as_double(v), B, L, L, H, D, all), 1e-5);

  Array causal = nn::make_causal_mask(Shape{B, L});  // from the shape alone, as from an array of it
  CHECK(causal.shape() == Shape{B, 1, L, L});
  CHECK(causal.bitwise_equal(nn::make_causal_mask(Array::zeros(Shape{B, L}))));
  CHECK(nn::make_causal_mask(Shape{L}, 1).shape() == Shape{1, 1, L, L});
  CHECK_THROWS_AS(nn::make_causal_mask(Shape{}), ShapeError);
  CHECK_THROWS_AS(nn::make_causal_mask(Array()), ValueError);
  check_close(slice_axis(causal, 0, 0, 1), {1, 0, 0, 1, 1, 0, 1, 1, 1});
  check_close(nn::dot_product_attention(q, k, v, {.mask = causal}),
              attention_ref(as_double(q), as_double(k), as_double(v), B, L, L, H, D,
                            [](int, int, int i, int j) { return j <= i; }), 1e-5);

  // Padding mask: the second example has only 2 valid positions.
  Array valid = Array::from(Shape{B, L}, {1, 1, 1, 1, 1, 0});
  Array pad = nn::make_attention_mask(valid, valid);
  CHECK(pad.shape() == Shape{B, 1, L, L});
  Array combined = nn::combine_masks({pad, causal, Array()});
  auto ref_mask = [](int b, int, int i, int j) { return j <= i && !(b == 1 && (i == 2 || j == 2)); };
  check_close(nn::dot_product_attention(q, k, v, {.mask = combined}),
              attention_ref(as_double(q), as_double(k), as_double(v), B, L, L, H, D, ref_mask), 1e-5);
  // Row (b=1, i=2) has nothing to attend to: every logit is the lowest float, so the softmax is
  // uniform over the keys, as in Flax.
  Array w = nn::dot_product_attention_weights(q, k, {.mask = combined});
  CHECK(w.shape() == Shape{B, H, L, L});
  check_close(slice(w, {1, 0, 2, 0}, {2, 1, 3, 3}), {1.0 / 3, 1.0 / 3, 1.0 / 3}, 1e-6);
  CHECK_THROWS_WITH_AS(nn::dot_product_attention(q, k, slice_axis(v, 1, 0, 2)), doctest::Contains("lengths must match"),
                       ShapeError);
}

TEST_CASE("MultiHeadDotProductAttention: Flax's params (query/key/value/out), values, causal mask, dropout") {
  const int B = 1, L = 3, F = 4, H = 2, D = 2, O = 5;
  nn::MultiHeadDotProductAttention mha{.num_heads = H, .out_features = O};
  Array x = random_array(Shape{B, L, F}, 81);
  Tree v = init(mha, rng::key(0), x);
  CHECK(v.at("params").keys() == std::vector<std::string>{"query", "key", "value", "out"});
  for (const char* n : {"query", "key", "value"}) {
    CHECK(shape_at(v, std::string("params/") + n + "/kernel") == Shape{F, H, D});
    CHECK(shape_at(v, std::string("params/") + n + "/bias") == Shape{H, D});
  }
  CHECK(shape_at(v, "params/out/kernel") == Shape{H, D, O});
  CHECK(shape_at(v, "params/out/bias") == Shape{O});

  // Reference from the same params with explicit loops.
  auto p = [&](const char* path) { return as_double(v.at_path(path).array()); };
  const std::vector<double> xv = as_double(x);
  auto project = [&](const char* n) {
    const auto kern = p((std::string("params/") + n + "/kernel").c_str());
    const auto bias = p((std::string("params/") + n + "/bias").c_str());
    std::vector<double> out(L * H * D);
    for (int l = 0; l < L; ++l)
      for (int hd = 0; hd < H * D; ++hd) {
        double acc = bias[hd];
        for (int f = 0; f < F; ++f) acc += xv[l * F + f] * kern[f * H * D + hd];
        out[l * H * D + hd] = acc;
      }
    return out;
  };
  auto reference = [&](auto mask) {
    const auto att = attention_ref(project("query"), project("key"), project("value"), B, L, L, H, D, mask);
    const auto ok = p("params/out/kernel");
    const auto ob = p("params/out/bias");
    std::vector<double> out(L * O);
    for (int l = 0; l < L; ++l)
      for (int o = 0; o < O; ++o) {
        double acc = ob[o];
        for (int hd = 0; hd < H * D; ++hd) acc += att[l * H * D + hd] * ok[hd * O + o];
        out[l * O + o] = acc;
      }
    return out;
  };
  Array y = apply(mha, v, x);
  CHECK(y.shape() == Shape{B, L, O});
  check_close(y, reference([](int, int, int, int) { return true; }), 1e-4);
  Array mask = nn::make_causal_mask(Array::zeros(Shape{B, L}));
  check_close(apply(mha, v, x, nn::AttentionArgs{.mask = mask}), reference([](int, int, int i, int j) { return j <= i; }), 1e-4);
  // Cross-attention with separate inputs: inputs_k/inputs_v default as Flax's.
  CHECK(apply(mha, v, x, x, nn::AttentionArgs{}).bitwise_equal(y));
  CHECK(apply(mha, v, x, x, x).bitwise_equal(y));

  // qkv_features defaults to the input features and must be divisible by num_heads.
  CHECK_THROWS_WITH_AS(init(nn::MultiHeadDotProductAttention{.num_heads = 3}, rng::key(0), x),
                       doctest::Contains("must be divisible by num_heads"), ValueError);
  // Attention dropout needs `deterministic` and a "dropout" stream when active.
  nn::MultiHeadDotProductAttention drop{.num_heads = H, .dropout_rate = 0.5};
  Tree vd = init(drop, rng::key(0), x, nn::AttentionArgs{.deterministic = true});
  CHECK(apply(drop, vd, x, nn::AttentionArgs{.deterministic = true})
            .bitwise_equal(apply(nn::MultiHeadDotProductAttention{.num_heads = H}, vd, x)));
  CHECK_THROWS_WITH_AS(apply(drop, vd, x), doctest::Contains("'deterministic' is set neither"), ValueError);
  auto [yd1, _1] = apply(drop, vd, {.rngs = {{"dropout", rng::key(3)}}}, x, nn::AttentionArgs{.deterministic = false});
  auto [yd2, _2] = apply(drop, vd, {.rngs = {{"dropout", rng::key(3)}}}, x, nn::AttentionArgs{.deterministic = false});
  CHECK(yd1.bitwise_equal(yd2));
  // sow_weights stores the weights [B, H, Lq, Lk] in "intermediates".
  auto [ys, inter] = apply(mha, v, {.mutable_collections = {"intermediates"}}, x, nn::AttentionArgs{.sow_weights = true});
  CHECK(shape_at(inter, "intermediates/attention_weights/0") == Shape{B, H, L, L});
  // normalize_qk adds LayerNorms without bias.
  Tree vq = init(nn::MultiHeadDotProductAttention{.num_heads = H, .normalize_qk = true}, rng::key(0), x);
  CHECK(vq.at_path("params/query_ln").keys() == std::vector<std::string>{"scale"});
}

// ---- Sequential, activations --------------------------------------------------------------------------

TEST_CASE("MultiHeadDotProductAttention: is_causal equals the causal mask; a bad mask is named as the layer's argument") {
  const Array x = random_array(Shape{2, 6, 8}, 85);
  nn::MultiHeadDotProductAttention mha{.num_heads = 2};
  Tree v = init(mha, rng::key(0), x);
  const Array by_flag = apply(mha, v, x, nn::AttentionArgs{.is_causal = true});
  const Array by_mask = apply(mha, v, x, nn::AttentionArgs{.mask = nn::make_causal_mask(Array::zeros(Shape{2, 6}))});
  const auto a = by_flag.to_vector(), b = by_mask.to_vector();
  for (std::size_t i = 0; i < a.size(); ++i) CHECK(a[i] == doctest::Approx(b[i]).epsilon(1e-6));
  // The composed path (sown weights) with is_causal: the same values again.
  auto [y, vars] = apply(mha, v, {.mutable_collections = {"intermediates"}}, x, nn::AttentionArgs{.sow_weights = true, .is_causal = true});
  const auto c = y.to_vector();
  for (std::size_t i = 0; i < a.size(); ++i) CHECK(a[i] == doctest::Approx(c[i]).epsilon(1e-5));
  struct Bad {
    Array operator()(Scope& s, const Array& x) const {
      return s(nn::MultiHeadDotProductAttention{.num_heads = 2}, x, nn::AttentionArgs{.mask = Array::ones(Shape{3, 6})});
    }
  };
  CHECK_THROWS_WITH_AS(init(Bad{}, rng::key(0), x),
                       doctest::Contains("in module 'MultiHeadDotProductAttention_0' (MultiHeadDotProductAttention): "
                                         "dot_product_attention: the mask of shape (3, 6) does not broadcast to the attention "
                                         "weights [batch..., heads, q_length, kv_length] = (2, 2, 6, 6)"),
                       ShapeError);
}

TEST_CASE("Sequential: children layers_<i> as in Flax, plain functions in between") {
  struct Net {
    Array operator()(Scope& s, const Array& x) const {
      return s(nn::Sequential{nn::Dense{.features = 4}, nn::relu, nn::Dense{.features = 2}}, x);
    }
  };
  Array x = random_array(Shape{3, 5}, 91);
  Tree v = init(Net{}, rng::key(0), x);
  CHECK(v.at("params").keys() == std::vector<std::string>{"Sequential_0"});
  CHECK(v.at_path("params/Sequential_0").keys() == std::vector<std::string>{"layers_0", "layers_2"});
  CHECK(shape_at(v, "params/Sequential_0/layers_2/kernel") == Shape{4, 2});
  const Tree& p = v.at_path("params/Sequential_0");
  Array h = relu(apply(nn::Dense{.features = 4}, params(p.at("layers_0")), x));
  CHECK(apply(Net{}, v, x).bitwise_equal(apply(nn::Dense{.features = 2}, params(p.at("layers_2")), h)));
}

TEST_CASE("activations as jax.nn") {
  Array x = Array::from(Shape{5}, {-3, -0.5f, 0, 0.5f, 4});
  const std::vector<double> xs{-3, -0.5, 0, 0.5, 4};
  std::vector<double> leaky, elu, logsig, relu6, hsig, selu;
  for (double e : xs) {
    leaky.push_back(e >= 0 ? e : 0.01 * e);
    elu.push_back(e > 0 ? e : std::expm1(e));
    logsig.push_back(-std::log1p(std::exp(-e)));
    relu6.push_back(std::min(std::max(e, 0.0), 6.0));
    hsig.push_back(std::min(std::max(e + 3, 0.0), 6.0) / 6);
    selu.push_back(1.0507009873554805 * (e > 0 ? e : 1.6732632423543772 * std::expm1(e)));
  }
  check_close(nn::leaky_relu(x), leaky);
  check_close(nn::elu(x), elu, 1e-5);
  check_close(nn::log_sigmoid(x), logsig, 1e-5);
  check_close(nn::relu6(x), relu6);
  check_close(nn::hard_sigmoid(x), hsig);
  check_close(nn::selu(x), selu, 1e-5);
  CHECK(nn::swish(x).bitwise_equal(silu(x)));
  check_close(nn::hard_tanh(x), {-1, -0.5, 0, 0.5, 1});
}

// ---- losses -------------------------------------------------------------------------------------------

TEST_CASE("losses as optax: cross-entropy (one-hot and integer), sigmoid BCE, squared error, l2, mse") {
  Array logits = Array::from(Shape{2, 3}, {1, 2, 3, 0, 0, 0});
  Array labels = Array::from_i32(Shape{2}, {2, 0});
  // -log softmax: row 0: log(e + e^2 + e^3) - 3; row 1: log 3.
  const double r0 = std::log(std::exp(1.0) + std::exp(2.0) + std::exp(3.0)) - 3, r1 = std::log(3.0);
  check_close(nn::softmax_cross_entropy_with_integer_labels(logits, labels), {r0, r1});
  check_close(nn::softmax_cross_entropy(logits, one_hot(labels, 3)), {r0, r1});
  // Soft labels: -sum p log q.
  Array soft = Array::from(Shape{2, 3}, {0.5f, 0.5f, 0, 0.2f, 0.3f, 0.5f});
  const double lse0 = r0 + 3;
  check_close(nn::softmax_cross_entropy(logits, soft), {-(0.5 * (1 - lse0) + 0.5 * (2 - lse0)), std::log(3.0)});
  CHECK_THROWS_WITH_AS(nn::softmax_cross_entropy_with_integer_labels(logits, Array::from_i32(Shape{2}, {3, 0})),
                       doctest::Contains("label 3"), ValueError);
  CHECK_THROWS_AS(nn::softmax_cross_entropy_with_integer_labels(logits, Array::from_i32(Shape{3}, {0, 0, 0})), ShapeError);

  Array z = Array::from(Shape{3}, {-1, 0, 2}), t = Array::from(Shape{3}, {0, 1, 1});
  auto ls = [](double v) { return -std::log1p(std::exp(-v)); };
  check_close(nn::sigmoid_binary_cross_entropy(z, t), {-ls(1), -ls(0), -ls(2)}, 1e-5);
  Array pred = Array::from(Shape{2, 2}, {1, 2, 3, 4}), target = Array::from(Shape{2, 2}, {0, 2, 5, 3.5f});
  check_close(nn::squared_error(pred, target), {1, 0, 4, 0.25});
  check_close(nn::l2_loss(pred, target), {0.5, 0, 2, 0.125});
  check_close(nn::mse(pred, target), {5.25 / 4});
  CHECK_THROWS_AS(nn::l2_loss(pred, z), ShapeError);
}

// ---- gradients against finite differences ----------------------------------------------------------

TEST_CASE("gradients of layers with respect to inputs and params") {
  using V = std::vector<Array>;
  check_gradients("Dense", [](const V& a) {
    return apply(nn::Dense{.features = 3}, params({{"kernel", a[1]}, {"bias", a[2]}}), a[0]);
  }, {random_array(Shape{2, 4}, 101), random_array(Shape{4, 3}, 102), random_array(Shape{3}, 103)});

  check_gradients("DenseGeneral", [](const V& a) {
    return apply(nn::DenseGeneral{.features = {2, 2}, .axis = {-2, -1}}, params({{"kernel", a[1]}, {"bias", a[2]}}), a[0]);
  }, {random_array(Shape{2, 3, 2}, 104), random_array(Shape{3, 2, 2, 2}, 105), random_array(Shape{2, 2}, 106)});

  check_gradients("Conv", [](const V& a) {
    return apply(nn::Conv{.features = 2, .kernel_size = {2, 2}, .strides = {2, 1}}, params({{"kernel", a[1]}, {"bias", a[2]}}), a[0]);
  }, {random_array(Shape{1, 4, 3, 2}, 107), random_array(Shape{2, 2, 2, 2}, 108), random_array(Shape{2}, 109)});

  check_gradients("LayerNorm", [](const V& a) {
    return apply(nn::LayerNorm{}, params({{"scale", a[1]}, {"bias", a[2]}}), a[0]);
  }, {random_array(Shape{2, 5}, 110, -2, 2), random_array(Shape{5}, 111), random_array(Shape{5}, 112)});

  check_gradients("GroupNorm", [](const V& a) {
    return apply(nn::GroupNorm{.num_groups = 2}, params({{"scale", a[1]}, {"bias", a[2]}}), a[0]);
  }, {random_array(Shape{2, 3, 4}, 113, -2, 2), random_array(Shape{4}, 114), random_array(Shape{4}, 115)});

  check_gradients("BatchNorm (train)", [](const V& a) {
    Tree vars{{"params", {{"scale", a[1]}, {"bias", a[2]}}},
              {"batch_stats", {{"mean", Array::zeros(Shape{3})}, {"var", Array::ones(Shape{3})}}}};
    return apply(nn::BatchNorm{}, vars, {.mutable_collections = {"batch_stats"}}, a[0], false).first;
  }, {random_array(Shape{4, 3}, 116, -2, 2), random_array(Shape{3}, 117), random_array(Shape{3}, 118)});

  check_gradients("RMSNorm", [](const V& a) {
    return apply(nn::RMSNorm{}, params({{"scale", a[1]}}), a[0]);
  }, {random_array(Shape{2, 5}, 129, -2, 2, 0.1f), random_array(Shape{5}, 130)});

  check_gradients("Dropout (train, fixed key)", [](const V& a) {
    return apply(nn::Dropout{.rate = 0.4}, Tree{}, a[0], false, rng::key(5));
  }, {random_array(Shape{4, 5}, 132)});

  check_gradients("Embed (table)", [](const V& a) {
    return apply(nn::Embed{.num_embeddings = 4, .features = 3}, params({{"embedding", a[0]}}), Array::from_i32(Shape{3}, {1, 3, 1}));
  }, {random_array(Shape{4, 3}, 119)});

  check_gradients("MultiHeadDotProductAttention (causal)", [](const V& a) {
    const nn::MultiHeadDotProductAttention mha{.num_heads = 2, .qkv_features = 4, .out_features = 3};
    Tree p{{"query", {{"kernel", a[1]}, {"bias", a[2]}}}, {"key", {{"kernel", a[3]}, {"bias", a[2]}}},
           {"value", {{"kernel", a[4]}, {"bias", a[2]}}}, {"out", {{"kernel", a[5]}, {"bias", a[6]}}}};
    return apply(mha, params(p), a[0], nn::AttentionArgs{.mask = nn::make_causal_mask(Array::zeros(Shape{1, 3}))});
  }, {random_array(Shape{1, 3, 3}, 120), random_array(Shape{3, 2, 2}, 121), random_array(Shape{2, 2}, 122),
      random_array(Shape{3, 2, 2}, 123), random_array(Shape{3, 2, 2}, 124), random_array(Shape{2, 2, 3}, 125),
      random_array(Shape{3}, 126)});

  check_gradients("softmax_cross_entropy_with_integer_labels", [](const V& a) {
    return nn::softmax_cross_entropy_with_integer_labels(a[0], Array::from_i32(Shape{2}, {1, 2}));
  }, {random_array(Shape{2, 3}, 127, -2, 2)});
  check_gradients("sigmoid_binary_cross_entropy", [](const V& a) {
    return nn::sigmoid_binary_cross_entropy(a[0], Array::from(Shape{3}, {0, 1, 0.3f}));
  }, {random_array(Shape{3}, 128, -2, 2)});
}

TEST_CASE("value_and_grad through a model's params dict") {
  struct Net {
    Array operator()(Scope& s, const Array& x) const {
      return s(nn::Dense{.features = 2}, s(nn::LayerNorm{}, s(nn::Dense{.features = 3}, x)));
    }
  };
  Array x = random_array(Shape{4, 3}, 131);
  Tree v = init(Net{}, rng::key(0), x);
  auto loss = [&](const Tree& p) { return mean(square(apply(Net{}, Tree{{"params", p}}, x))); };
  auto [value, g] = value_and_grad(loss)(v.at("params"));
  CHECK(same_structure(g, v.at("params")));
  // One finite difference on one kernel element.
  Tree bumped = v.at("params");
  std::vector<float> k = bumped.at_path("Dense_0/kernel").array().to_vector();
  const float h = 1e-2f;
  k[1] += h;
  bumped.at("Dense_0").set("kernel", Array::from(Shape{3, 3}, k));
  const double fd = (loss(bumped).item() - value.item()) / h;
  CHECK(g.at_path("Dense_0/kernel").array().data()[1] == doctest::Approx(fd).epsilon(0.05).scale(1e-2));
}

// ---- module configurations -------------------------------------------------------------------------

struct MyBlock {  // a user's module with nested layer configuration
  int depth = 2;
  double dropout_rate = 0.1;
  nn::Dense head{.features = 10};
  std::string name = "block";
  Array operator()(Scope& s, const Array& x) const { return s(head, x); }
};
BOOST_HANA_ADAPT_STRUCT(MyBlock, depth, dropout_rate, head, name);

TEST_CASE("module_config / module_from_config round trips") {
  nlohmann::json d = nn::module_config(nn::Dense{.features = 10});
  CHECK(d.dump() == R"({"activation":"none","dtype":null,"features":10,"param_dtype":"float32","use_bias":true})");
  // The fused activation travels by name; an unknown name is refused with the list of names.
  const nlohmann::json dg = nn::module_config(nn::Dense{.features = 2, .activation = Activation::gelu_exact});
  CHECK(dg.at("activation") == "gelu_exact");
  CHECK(nn::module_from_config<nn::Dense>(dg).activation == Activation::gelu_exact);
  CHECK_THROWS_WITH_AS(nn::module_from_config<nn::Dense>(nlohmann::json{{"features", 2}, {"activation", "swish"}}),
                       doctest::Contains("one of: none, relu, gelu, gelu_exact, silu, tanh, sigmoid"), ValueError);
  // Flax's dtype and param_dtype travel with the configuration.
  nlohmann::json dbf = nn::module_config(nn::Dense{.features = 4, .dtype = DType::bf16});
  CHECK(dbf.at("dtype") == "bfloat16");
  CHECK(nn::module_from_config<nn::Dense>(dbf).dtype == DType::bf16);
  CHECK(nn::module_from_config<nn::Dense>(nlohmann::json{{"features", 3}, {"param_dtype", "bfloat16"}}).param_dtype == DType::bf16);
  CHECK_THROWS_WITH_AS(nn::module_from_config<nn::Dense>(nlohmann::json{{"dtype", "float16"}}),
                       doctest::Contains("Dense.dtype' must be a dtype"), ValueError);
  // Integers the field cannot hold are refused, not narrowed.
  CHECK_THROWS_WITH_AS(nn::module_from_config<nn::BatchNorm>(nlohmann::json{{"axis", 4294967295LL}}),
                       doctest::Contains("BatchNorm.axis' must be an integer in [-2147483648, 2147483647]"), ValueError);
  CHECK_THROWS_AS(nn::module_from_config<nn::Dense>(nlohmann::json{{"features", 18446744073709551615ULL}}), ValueError);
  CHECK(nn::module_from_config<nn::BatchNorm>(nlohmann::json{{"axis", -2}}).axis == -2);
  CHECK(nn::module_from_config<nn::Dense>(d).features == 10);

  nn::Conv conv{.features = 8, .kernel_size = {3, 3}, .strides = {2, 2}, .padding = {{1, 0}, {0, 1}}, .feature_group_count = 2};
  nlohmann::json c = nn::module_config(conv);
  CHECK(c.at("padding").dump() == "[[1,0],[0,1]]");
  nn::Conv conv2 = nn::module_from_config<nn::Conv>(c);
  CHECK(conv2.padding == conv.padding);
  CHECK(conv2.strides == conv.strides);
  CHECK(conv2.feature_group_count == 2);
  CHECK(nn::module_config(nn::Conv{.features = 1, .kernel_size = {3}, .padding = "CAUSAL"}).at("padding") == "CAUSAL");
  CHECK(nn::module_from_config<nn::Conv>(nlohmann::json{{"features", 2}, {"kernel_size", {3}}, {"padding", 2}}).padding ==
        Padding(2));
  const nn::ConvTranspose up = nn::module_from_config<nn::ConvTranspose>(
      nn::module_config(nn::ConvTranspose{.features = 3, .kernel_size = {4, 4}, .strides = {2, 2}, .padding = "VALID",
                                          .transpose_kernel = true}));
  CHECK(up.strides == std::vector<std::int64_t>{2, 2});
  CHECK(up.padding == Padding("VALID"));
  CHECK(up.transpose_kernel);

  nlohmann::json ln = nn::module_config(nn::LayerNorm{});
  CHECK(ln.at("epsilon").get<double>() == 1e-6);
  CHECK(ln.at("reduction_axes").dump() == "[-1]");
  nlohmann::json gn = nn::module_config(nn::GroupNorm{.num_groups = std::nullopt, .group_size = 4});
  CHECK(gn.at("num_groups").is_null());
  nn::GroupNorm gn2 = nn::module_from_config<nn::GroupNorm>(gn);
  CHECK_FALSE(gn2.num_groups.has_value());
  CHECK(gn2.group_size == 4);
  nlohmann::json bn = nn::module_config(nn::BatchNorm{.momentum = 0.9});
  CHECK(bn.dump() == R"({"activation":"none","axis":-1,"dtype":null,"epsilon":1e-05,"momentum":0.9,"param_dtype":"float32","use_bias":true,)"
                     R"("use_fast_variance":true,"use_running_average":null,"use_scale":true})");
  CHECK(nn::module_from_config<nn::BatchNorm>(bn).momentum == 0.9);
  bn["activation"] = "relu";
  CHECK(nn::module_from_config<nn::BatchNorm>(bn).activation == Activation::relu);
  nlohmann::json m = nn::module_config(nn::MultiHeadDotProductAttention{.num_heads = 4, .qkv_features = 64});
  CHECK(m.at("qkv_features") == 64);
  CHECK(m.at("out_features").is_null());
  CHECK(nn::module_from_config<nn::MultiHeadDotProductAttention>(m).qkv_features == 64);
  CHECK(nn::module_from_config<nn::Dropout>(nn::module_config(nn::Dropout{.rate = 0.25, .deterministic = true})).deterministic == true);
  CHECK(nn::module_config(nn::Embed{.num_embeddings = 7, .features = 2}).dump() == R"({"dtype":null,"features":2,"num_embeddings":7,"param_dtype":"float32"})");

  // A user's module, nested configuration included.
  nlohmann::json u = nn::module_config(MyBlock{});
  CHECK(u.dump() == R"({"depth":2,"dropout_rate":0.1,"head":{"activation":"none","dtype":null,"features":10,"param_dtype":"float32","use_bias":true},"name":"block"})");
  u["head"]["features"] = 3;
  CHECK(nn::module_from_config<MyBlock>(u).head.features == 3);

  // Sequential: a list of layer configurations.
  using Seq = nn::Sequential<nn::Dense, nn::LayerNorm>;
  nlohmann::json s = nn::module_config(Seq{nn::Dense{.features = 5}, nn::LayerNorm{}});
  CHECK(s.at("layers").size() == 2);
  CHECK(std::get<0>(nn::module_from_config<Seq>(s).layers).features == 5);

  // Errors name the field.
  CHECK_THROWS_WITH_AS(nn::module_from_config<nn::Dense>(nlohmann::json{{"featurez", 3}}),
                       doctest::Contains("unknown field 'featurez'; its fields are: features, use_bias"), ValueError);
  CHECK_THROWS_WITH_AS(nn::module_from_config<nn::Dense>(nlohmann::json{{"features", "ten"}}),
                       doctest::Contains("field 'Dense.features' must be an integer"), ValueError);
}

// ---- tabulate ---------------------------------------------------------------------------------------

TEST_CASE("tabulate: one row per module call with outputs, params per collection and totals") {
  struct CNN {
    Array operator()(Scope& s, const Array& x, bool train) const {
      Array h = relu(s(nn::Conv{.features = 4, .kernel_size = {3, 3}}, x));
      h = s(nn::BatchNorm{}, h, !train);
      h = reshape(h, {h.dim(0), -1});
      h = s(nn::Dropout{.rate = 0.5}, h, !train);
      return s("head", nn::Dense{.features = 10}, h);
    }
  };
  Array x = random_array(Shape{2, 4, 4, 1}, 141);
  std::string t = nn::tabulate(CNN{}, rng::Streams{{"params", rng::key(0)}, {"dropout", rng::key(1)}}, x, true);
  MESSAGE(t);
  CHECK(t.find("CNN summary") != std::string::npos);
  CHECK(t.find("| <root>") != std::string::npos);
  CHECK(t.find("| Conv_0 ") != std::string::npos);
  CHECK(t.find("float32[2,4,4,4]") != std::string::npos);   // Conv_0's output
  CHECK(t.find("| BatchNorm_0 ") != std::string::npos);
  CHECK(t.find("| Dropout_0 ") != std::string::npos);
  CHECK(t.find("| head ") != std::string::npos);
  CHECK(t.find("float32[2,10]") != std::string::npos);       // head and root output
  // Conv 3*3*1*4 + 4 = 40, BatchNorm 4 + 4 = 8, head 64*10 + 10 = 650: 698 params, 2792 bytes.
  CHECK(t.find("40 (160 B)") != std::string::npos);
  CHECK(t.find("650 (2.6 KB)") != std::string::npos);
  CHECK(t.find("Total params: 698 (2.8 KB)") != std::string::npos);
  CHECK(t.find("Total batch_stats: 8 (32 B)") != std::string::npos);
  // Activations of the leaf modules: Conv 128 + BatchNorm 128 + Dropout 128 + head 20 floats.
  CHECK(t.find("Total activation bytes (modules without submodules): 1616") != std::string::npos);
}

TEST_CASE("BatchNorm refuses an empty batch and a momentum outside [0, 1]") {
  const Array x = linum::testing::random_array(Shape{4, 3}, 1);
  Tree v = init(nn::BatchNorm{.use_running_average = false}, rng::key(0), x);
  CHECK_THROWS_WITH_AS(apply(nn::BatchNorm{.use_running_average = false}, v, {.mutable_collections = {"batch_stats"}},
                             Array::zeros(Shape{0, 3})),
                       doctest::Contains("empty input of shape"), ShapeError);
  CHECK_THROWS_WITH_AS(init(nn::BatchNorm{.use_running_average = false, .momentum = 2.0}, rng::key(0), x),
                       doctest::Contains("momentum must be in [0, 1]"), ValueError);
}

TEST_CASE("pooling modules are the pooling ops as layers, usable in Sequential") {
  const Array x = linum::testing::random_array(Shape{2, 6, 6, 3}, 9);
  const nn::MaxPool mp{.window = {2, 2}, .strides = {2, 2}};
  const nn::AvgPool ap{.window = {3, 3}, .padding = Padding::same()};
  CHECK(apply(mp, Tree(), x).bitwise_equal(max_pool(x, {.window = {2, 2}, .strides = {2, 2}})));
  CHECK(apply(ap, Tree(), x).bitwise_equal(avg_pool(x, {.window = {3, 3}, .padding = Padding::same()})));
  const auto net = nn::Sequential{nn::Conv{.features = 4, .kernel_size = {3, 3}}, nn::MaxPool{.window = {2, 2}, .strides = {2, 2}}};
  const Tree vars = init(net, rng::key(0), x);
  CHECK(apply(net, vars, x).shape() == Shape{2, 3, 3, 4});
}

namespace {

// lax.conv_transpose written as a scatter in double precision: input element (i, j) lands on the
// stride-dilated, padded grid at (i * s + pad_lo), and output (p, q) correlates the kernel there.
std::vector<double> conv_transpose_ref(const Array& x, const Array& k, std::array<int, 2> s, std::array<int, 4> pad,
                                       std::array<int, 2> d, Shape* out_shape) {
  const int N = int(x.dim(0)), H = int(x.dim(1)), W = int(x.dim(2)), C = int(x.dim(3));
  const int KH = int(k.dim(0)), KW = int(k.dim(1)), O = int(k.dim(3));
  const int OH = (H - 1) * s[0] + 1 + pad[0] + pad[1] - ((KH - 1) * d[0] + 1) + 1;
  const int OW = (W - 1) * s[1] + 1 + pad[2] + pad[3] - ((KW - 1) * d[1] + 1) + 1;
  *out_shape = Shape{N, OH, OW, O};
  std::vector<double> y(static_cast<std::size_t>(N) * OH * OW * O, 0.0);
  const std::vector<float> xv = x.to_vector(), kv = k.to_vector();
  for (int n = 0; n < N; ++n)
    for (int i = 0; i < H; ++i)
      for (int j = 0; j < W; ++j)
        for (int kh = 0; kh < KH; ++kh)
          for (int kw = 0; kw < KW; ++kw) {
            const int p = i * s[0] + pad[0] - kh * d[0], q = j * s[1] + pad[2] - kw * d[1];
            if (p < 0 || p >= OH || q < 0 || q >= OW) continue;
            for (int c = 0; c < C; ++c)
              for (int o = 0; o < O; ++o)
                y[((static_cast<std::size_t>(n) * OH + p) * OW + q) * O + o] +=
                    double(xv[((static_cast<std::size_t>(n) * H + i) * W + j) * C + c]) *
                    double(kv[((static_cast<std::size_t>(kh) * KW + kw) * C + c) * O + o]);
          }
  return y;
}

}  // namespace

TEST_CASE("ConvTranspose: lax.conv_transpose's shapes and values for SAME/VALID/explicit padding, strides, dilation") {
  const Array x = random_array(Shape{2, 4, 5, 3}, 41);
  struct Case {
    nn::ConvTranspose layer;
    std::array<int, 4> pad;  // lax's padding of the dilated input for this case
    Shape out;
  };
  const std::vector<Case> cases{
      // SAME: in * stride. k = 3, s = 2: pad_len 3, low ceil(3 / 2) = 2.
      {nn::ConvTranspose{.features = 6, .kernel_size = {3, 3}, .strides = {2, 2}}, {2, 1, 2, 1}, Shape{2, 8, 10, 6}},
      // VALID: in * stride + max(k - s, 0); low k - 1.
      {nn::ConvTranspose{.features = 6, .kernel_size = {3, 3}, .strides = {2, 2}, .padding = "VALID"}, {2, 2, 2, 2}, Shape{2, 9, 11, 6}},
      // SAME with s > k - 1: low k - 1 = 1, high s - 1 = 2.
      {nn::ConvTranspose{.features = 6, .kernel_size = {2, 2}, .strides = {3, 3}}, {1, 2, 1, 2}, Shape{2, 12, 15, 6}},
      // stride 1 SAME is a SAME convolution.
      {nn::ConvTranspose{.features = 6, .kernel_size = {3, 3}}, {1, 1, 1, 1}, Shape{2, 4, 5, 6}},
      // explicit pairs pad the dilated input as given.
      {nn::ConvTranspose{.features = 6, .kernel_size = {3, 2}, .strides = {2, 1}, .padding = {{1, 2}, {0, 1}}}, {1, 2, 0, 1}, Shape{2, 8, 5, 6}},
      // kernel dilation 2: k = 5 effective, s = 2: pad_len 5, low 3.
      {nn::ConvTranspose{.features = 6, .kernel_size = {3, 3}, .strides = {2, 2}, .kernel_dilation = {2}}, {3, 2, 3, 2}, Shape{2, 8, 10, 6}},
  };
  for (const auto& c : cases) {
    const Shape ks{c.layer.kernel_size[0], c.layer.kernel_size[1], 3, 6};
    Tree p = init(c.layer, rng::key(0), x);
    CHECK(shape_at(p, "params/kernel") == ks);
    CHECK(shape_at(p, "params/bias") == Shape{6});
    const Array k = random_array(ks, 42), b = random_array(Shape{6}, 43);
    const Array y = apply(c.layer, params({{"kernel", k}, {"bias", b}}), x);
    const std::array<int, 2> s = c.layer.strides.empty() ? std::array<int, 2>{1, 1}
                                                         : std::array<int, 2>{int(c.layer.strides[0]), int(c.layer.strides[1])};
    const int d = c.layer.kernel_dilation.empty() ? 1 : int(c.layer.kernel_dilation[0]);
    Shape want_shape;
    std::vector<double> want = conv_transpose_ref(x, k, s, c.pad, {d, d}, &want_shape);
    for (std::size_t i = 0; i < want.size(); ++i) want[i] += b.data()[i % 6];
    CHECK(want_shape == c.out);
    CHECK(y.shape() == c.out);
    check_close(y, want, 1e-4);
  }
}

TEST_CASE("ConvTranspose with transpose_kernel is the gradient of the strided convolution; gradients; 1-D; errors") {
  // transpose_kernel: the kernel is the forward convolution's HWIO kernel (here 5 -> 4 channels),
  // and the layer computes that convolution's input gradient (VALID, stride 2: 7x7 <-> 3x3).
  const Array w = random_array(Shape{3, 3, 5, 4}, 44);
  const Array x = random_array(Shape{2, 3, 3, 4}, 45);
  const nn::ConvTranspose up{.features = 5, .kernel_size = {3, 3}, .strides = {2, 2}, .padding = "VALID", .use_bias = false,
                             .transpose_kernel = true};
  CHECK(shape_at(init(up, rng::key(0), x), "params/kernel") == Shape{3, 3, 5, 4});
  const Array y = apply(up, params({{"kernel", w}}), x);
  auto [z_out, pullback] = vjp([&](const Array& z) { return conv2d(z, w, {.strides = {2, 2}, .padding = Padding::valid()}); },
                               Array::zeros(Shape{2, 7, 7, 5}));
  CHECK(z_out.shape() == x.shape());
  const Array dz = pullback(x);
  CHECK(y.shape() == dz.shape());
  check_close(y, as_double(dz), 1e-5);

  check_gradients("conv_transpose2d", [](const std::vector<Array>& in) {
    return conv_transpose2d(in[0], in[1], {.strides = {2, 2}, .padding = Padding::same(), .dilation = {1, 2}});
  }, {random_array(Shape{1, 3, 2, 2}, 46), random_array(Shape{2, 3, 2, 3}, 47)});
  check_gradients("conv_transpose2d(transpose_kernel)", [](const std::vector<Array>& in) {
    return conv_transpose2d(in[0], in[1], {.strides = {2, 1}, .padding = Padding::valid(), .transpose_kernel = true});
  }, {random_array(Shape{1, 2, 3, 2}, 48), random_array(Shape{2, 2, 3, 2}, 49)});

  // 1-D sequences [N, L, C] and an unbatched image.
  const nn::ConvTranspose seq{.features = 2, .kernel_size = {4}, .strides = {2}};
  const Array xs = random_array(Shape{3, 6, 2}, 50);
  const Tree sv = init(seq, rng::key(1), xs);
  CHECK(shape_at(sv, "params/kernel") == Shape{4, 2, 2});
  const Array ys = apply(seq, sv, xs);
  CHECK(ys.shape() == Shape{3, 12, 2});
  const Array as_image = apply(nn::ConvTranspose{.features = 2, .kernel_size = {1, 4}, .strides = {1, 2}},
                               params({{"kernel", reshape(sv.at_path("params/kernel").array(), {1, 4, 2, 2})},
                                       {"bias", sv.at_path("params/bias").array()}}),
                               reshape(xs, {3, 1, 6, 2}));
  CHECK(ys.bitwise_equal(reshape(as_image, {3, 12, 2})));
  CHECK(apply(up, params({{"kernel", w}}), random_array(Shape{3, 3, 4}, 51)).shape() == Shape{7, 7, 5});

  auto error = [](auto f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK(error([&] { init(nn::ConvTranspose{.features = 2, .kernel_size = {3, 3}, .padding = "CIRCULAR"}, rng::key(0), x); })
            .find("CIRCULAR and REFLECT are not supported") != std::string::npos);
  CHECK(error([&] { init(nn::ConvTranspose{.features = 0, .kernel_size = {3, 3}}, rng::key(0), x); }).find("features must be positive") !=
        std::string::npos);
  CHECK(error([&] { conv_transpose2d(x, random_array(Shape{3, 3, 5, 4}, 1)); }).find("takes 5 input channels") != std::string::npos);
}

TEST_CASE("conv_transpose2d on oneDNN (the data gradient of the convolution it transposes) equals the dilated form") {
  if (!engine_available(Engine::onednn)) {
    MESSAGE("built without oneDNN: only the dilated form exists");
    return;
  }
  const Engine before = engine();
  struct Restore {
    Engine e;
    ~Restore() { set_engine(e); }
  } restore{before};
  struct Geometry {
    std::array<std::int64_t, 2> strides, dilation;
    Padding padding;
    bool transpose_kernel;
    Shape x, w;
  };
  const std::vector<Geometry> cases = {
      {{2, 2}, {1, 1}, Padding::same(), false, Shape{2, 5, 6, 3}, Shape{3, 3, 3, 4}},
      {{2, 2}, {1, 1}, Padding::valid(), false, Shape{2, 5, 6, 3}, Shape{4, 4, 3, 4}},
      {{3, 2}, {1, 1}, Padding::same(), false, Shape{1, 4, 5, 2}, Shape{2, 2, 2, 3}},  // stride beyond the kernel
      {{1, 1}, {1, 1}, Padding::same(), false, Shape{2, 4, 5, 3}, Shape{3, 3, 3, 2}},
      {{2, 2}, {2, 1}, Padding::same(), false, Shape{2, 4, 5, 3}, Shape{3, 3, 3, 4}},  // kernel dilation
      {{2, 1}, {1, 1}, Padding::valid(), true, Shape{1, 2, 3, 2}, Shape{2, 2, 3, 2}},  // transpose_kernel
      {{2, 2}, {1, 1}, Padding({{1, 2}, {0, 1}}), false, Shape{2, 4, 4, 3}, Shape{3, 2, 3, 4}},
      {{2, 2}, {1, 1}, Padding({{3, 0}, {0, 4}}), false, Shape{2, 4, 4, 3}, Shape{3, 2, 3, 4}},  // no such convolution
  };
  for (const DType dt : {DType::f32, DType::bf16})
    for (std::size_t i = 0; i < cases.size(); ++i) {
      CAPTURE(i);
      CAPTURE(dtype_name(dt));
      const Geometry& g = cases[i];
      const ConvTransposeOptions o{.strides = g.strides, .padding = g.padding, .dilation = g.dilation,
                                   .transpose_kernel = g.transpose_kernel};
      const Array x = astype(random_array(g.x, 60 + static_cast<unsigned>(i)), dt);
      const Array w = astype(random_array(g.w, 70 + static_cast<unsigned>(i)), dt);
      auto run = [&](Engine e) {
        set_engine(e);
        const Array y = conv_transpose2d(x, w, o);
        const Array r = random_array(y.shape(), 80);
        auto g2 = grad([&](const std::vector<Array>& in) { return sum(astype(conv_transpose2d(in[0], in[1], o), DType::f32) * r); })(
            std::vector<Array>{x, w});
        return std::vector<Array>{y, g2[0], g2[1]};
      };
      const auto fast = run(Engine::onednn), dilated = run(Engine::eigen);
      const double tol = dt == DType::f32 ? 1e-5 : 3e-2;
      for (std::size_t k = 0; k < 3; ++k) {
        CAPTURE(k);
        REQUIRE(fast[k].shape() == dilated[k].shape());
        CHECK(fast[k].dtype() == dilated[k].dtype());
        check_close(astype(fast[k], DType::f32), as_double(astype(dilated[k], DType::f32)), tol);
      }
    }
  // Remat of a block using it gives bitwise the plain gradients.
  set_engine(Engine::onednn);
  const Array x = random_array(Shape{4, 6, 6, 8}, 90), w = random_array(Shape{3, 3, 8, 8}, 91);
  auto block = [](const Array& a, const Array& k) { return tanh(conv_transpose2d(a * 2.0f, k, {.strides = {2, 2}})); };
  auto plain = grad([&](const std::vector<Array>& in) { return sum(block(in[0], in[1])); })(std::vector<Array>{x, w});
  auto rb = checkpoint(block);
  auto remat = grad([&](const std::vector<Array>& in) { return sum(rb(in[0], in[1])); })(std::vector<Array>{x, w});
  CHECK(plain[0].bitwise_equal(remat[0]));
  CHECK(plain[1].bitwise_equal(remat[1]));
  // Integer operands are refused on either engine (oneDNN would read their bits as floats).
  CHECK_THROWS_AS(conv_transpose2d(astype(x, DType::i32), w), ShapeError);
  CHECK_THROWS_AS(conv_transpose2d(x, astype(w, DType::i32)), ShapeError);
}

TEST_CASE("MultiHeadDotProductAttention decode: the cache collection, one position per call, equal to causal attention") {
  // Flax's test_decoding: decoding position by position with the cache gives the outputs of causal
  // self-attention over the whole sequence.
  struct Decoder {
    bool decode = false;
    Array operator()(Scope& s, const Array& x, const Array& mask) const {
      return s(nn::MultiHeadDotProductAttention{.num_heads = 2, .qkv_features = 8, .decode = decode}, x,
               nn::AttentionArgs{.mask = mask});
    }
  };
  const std::int64_t B = 2, T = 5, F = 6;
  const Array x = random_array(Shape{B, T, F}, 60);
  const Tree vars = init(Decoder{.decode = true}, rng::key(3), x, Array());
  const Tree& cache = vars.at("cache").at("MultiHeadDotProductAttention_0");
  CHECK(cache.at("cached_key").array().shape() == Shape{B, T, 2, 4});
  CHECK(cache.at("cached_value").array().shape() == Shape{B, T, 2, 4});
  CHECK(cache.at("cache_index").array().dtype() == DType::i32);
  CHECK(cache.at("cache_index").array().data_i32()[0] == 0);
  CHECK(cache.at("cached_key").array().to_vector() == std::vector<float>(static_cast<std::size_t>(B * T * 8), 0.0f));

  const Array full = apply(Decoder{}, Tree{{"params", vars.at("params")}}, x, nn::make_causal_mask(Array::zeros(Shape{B, T})));
  Tree state = vars.at("cache");
  for (std::int64_t t = 0; t < T; ++t) {
    auto [y, updates] = apply(Decoder{.decode = true}, Tree{{"params", vars.at("params")}, {"cache", state}},
                              {.mutable_collections = {"cache"}}, slice_axis(x, 1, t, t + 1), Array());
    state = updates.at("cache");
    CHECK(state.at_path("MultiHeadDotProductAttention_0/cache_index").array().data_i32()[0] == t + 1);
    CHECK(y.shape() == Shape{B, 1, F});
    const std::vector<float> got = y.to_vector(), want = slice_axis(full, 1, t, t + 1).to_vector();
    for (std::size_t i = 0; i < got.size(); ++i) CHECK(got[i] == doctest::Approx(want[i]).epsilon(1e-5).scale(1.0));
  }

  auto error = [&](auto f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const Tree cached{{"params", vars.at("params")}, {"cache", vars.at("cache")}};
  CHECK(error([&] { apply(Decoder{.decode = true}, cached, {.mutable_collections = {"cache"}}, slice_axis(x, 1, 0, 2), Array()); })
            .find("autoregressive cache shape error") != std::string::npos);
  CHECK(error([&] { apply(Decoder{.decode = true}, cached, slice_axis(x, 1, 0, 1), Array()); })
            .find("collection 'cache' is not mutable") != std::string::npos);
  CHECK(error([&] { apply(Decoder{.decode = true}, Tree{{"params", vars.at("params")}, {"cache", state}},
                          {.mutable_collections = {"cache"}}, slice_axis(x, 1, 0, 1), Array()); })
            .find("all are written") != std::string::npos);
}

TEST_CASE("InstanceNorm, Einsum, MGUCell, ConvLSTMCell, Bidirectional: their definitions, gradients, configs and errors") {
  using V = std::vector<Array>;
  // InstanceNorm: each example and channel normalized over its spatial axes.
  const Array img = random_array(Shape{2, 3, 4, 5}, 201, -2, 2);
  const Tree vars = init(nn::InstanceNorm{}, rng::key(0), img);
  CHECK(vars.at("params").keys() == std::vector<std::string>{"scale", "bias"});
  CHECK(shape_at(vars, "params/scale") == Shape{5});
  const Array y = apply(nn::InstanceNorm{.epsilon = 0.0}, vars, img);
  const Array m = mean(y, {1, 2}), v = mean(square(y), {1, 2});
  for (float e : m.to_vector()) CHECK(e == doctest::Approx(0.0).scale(1.0).epsilon(1e-5));
  for (float e : v.to_vector()) CHECK(e == doctest::Approx(1.0).epsilon(1e-4));
  check_gradients("InstanceNorm", [](const V& a) {
    return apply(nn::InstanceNorm{}, params({{"scale", a[1]}, {"bias", a[2]}}), a[0]);
  }, {random_array(Shape{2, 3, 2, 4}, 202, -2, 2), random_array(Shape{4}, 203), random_array(Shape{4}, 204)});
  CHECK_THROWS_WITH_AS(init(nn::InstanceNorm{}, rng::key(0), Array::zeros(Shape{2, 5})), doctest::Contains("no axis to normalize"),
                       ShapeError);
  CHECK_THROWS_WITH_AS(init(nn::InstanceNorm{.feature_axes = {0}}, rng::key(0), img), doctest::Contains("batch axis"), ValueError);

  // Einsum: the kernel contracted by the subscripts, plus a bias over the kernel's output axes.
  const Array x = random_array(Shape{2, 3, 4}, 205);
  const nn::Einsum heads{.shape = {4, 2, 5}, .einsum_str = "btd,dhk->bthk"};
  const Tree ev = init(heads, rng::key(1), x);
  CHECK(shape_at(ev, "params/kernel") == Shape{4, 2, 5});
  CHECK(shape_at(ev, "params/bias") == Shape{2, 5});
  const Array want = einsum("btd,dhk->bthk", x, ev.at_path("params/kernel").array()) +
                     reshape(ev.at_path("params/bias").array(), {1, 1, 2, 5});
  CHECK(apply(heads, ev, x).bitwise_equal(want));
  CHECK(apply(nn::Einsum{.shape = {4, 2, 5}}, ev, x, std::string_view("btd,dhk->bthk")).bitwise_equal(want));
  check_gradients("Einsum", [](const V& a) {
    return apply(nn::Einsum{.shape = {4, 3}, .einsum_str = "...d,dk->...k"}, params({{"kernel", a[1]}, {"bias", a[2]}}), a[0]);
  }, {random_array(Shape{2, 3, 4}, 206), random_array(Shape{4, 3}, 207), random_array(Shape{3}, 208)});
  CHECK_THROWS_WITH_AS(init(nn::Einsum{.shape = {4, 2}, .einsum_str = "btd,dk"}, rng::key(0), x), doctest::Contains("->"), ValueError);
  CHECK_THROWS_WITH_AS(init(nn::Einsum{.shape = {4, 2}, .einsum_str = "btd->btd"}, rng::key(0), x), doctest::Contains("two operands"),
                       ValueError);
  CHECK_THROWS_WITH_AS(init(nn::Einsum{.shape = {4, 2}, .einsum_str = "btd,dhk->bthk"}, rng::key(0), x),
                       doctest::Contains("kernel shape"), ShapeError);
  CHECK_THROWS_WITH_AS(apply(heads, ev, x, std::string_view("btd,dhk->bthk")), doctest::Contains("one place"), ValueError);
  CHECK_THROWS_WITH_AS(init(nn::Einsum{.shape = {4, 2}}, rng::key(0), x), doctest::Contains("no subscripts"), ValueError);

  // MGUCell: h' = (1 - f) n + f h, f = sigmoid(if(x) + hf(h)), n = tanh(in(x) + f hn(h)).
  const Array h0 = random_array(Shape{2, 3}, 209), xs = random_array(Shape{2, 4}, 210);
  const nn::MGUCell mgu{.features = 3};
  const Tree mv = init(mgu, rng::key(2), h0, xs);
  CHECK(mv.at("params").keys() == std::vector<std::string>{"if", "hf", "hn", "in"});
  CHECK(mv.at_path("params/if/bias").array().to_vector() == std::vector<float>(3, 1.0f));  // forget_bias_init: ones
  CHECK_FALSE(mv.at_path("params/hf").contains("bias"));
  auto dense = [&](const std::string& name, const Array& in) {
    const Tree& p = mv.at("params").at(name);
    Array out = matmul(in, p.at("kernel").array());
    return p.contains("bias") ? out + p.at("bias").array() : out;
  };
  const Array f = sigmoid(dense("if", xs) + dense("hf", h0));
  const Array n = tanh(dense("in", xs) + f * dense("hn", h0));
  const Array h1 = (1.0f - f) * n + f * h0;
  CHECK(max_abs_diff(apply(mgu, mv, h0, xs).first, h1) < 1e-6f);
  CHECK_FALSE(init(nn::MGUCell{.features = 3, .reset_gate = false}, rng::key(2), h0, xs).at_path("params/hn").contains("bias"));

  // ConvLSTMCell over a sequence of images: the carry keeps the images' shape with `features` channels.
  const nn::RNN<nn::ConvLSTMCell> conv_lstm{.cell = {.features = 2, .kernel_size = {3, 3}}};
  const Array frames = random_array(Shape{2, 4, 5, 5, 3}, 211);
  const Tree cv = init(conv_lstm, rng::key(3), frames);
  CHECK(shape_at(cv, "params/cell/ih/kernel") == Shape{3, 3, 3, 8});
  CHECK(shape_at(cv, "params/cell/hh/kernel") == Shape{3, 3, 2, 8});
  CHECK(apply(conv_lstm, cv, frames).shape() == Shape{2, 4, 5, 5, 2});
  check_gradients("RNN<ConvLSTMCell>", [](const V& a) {
    const Tree p{{"cell", {{"ih", {{"kernel", a[1]}, {"bias", a[2]}}}, {"hh", {{"kernel", a[3]}, {"bias", a[4]}}}}}};
    return apply(nn::RNN<nn::ConvLSTMCell>{.cell = {.features = 1, .kernel_size = {2, 2}}}, params(p), a[0]);
  }, {random_array(Shape{1, 2, 3, 3, 2}, 212), random_array(Shape{2, 2, 2, 4}, 213, -0.5, 0.5), random_array(Shape{4}, 214),
      random_array(Shape{2, 2, 1, 4}, 215, -0.5, 0.5), random_array(Shape{4}, 216)});

  // Bidirectional: the forward RNN's outputs and the backward one's (in input order), concatenated.
  using BiGRU = nn::Bidirectional<nn::RNN<nn::GRUCell>>;
  const BiGRU bi{.forward_rnn = {.cell = {.features = 3}}, .backward_rnn = {.cell = {.features = 2}}};
  const Array seq = random_array(Shape{2, 5, 4}, 217);
  const Tree bv = init(bi, rng::key(4), seq);
  CHECK(bv.at("params").keys() == std::vector<std::string>{"forward_rnn", "backward_rnn"});
  const Array forward = apply(nn::RNN<nn::GRUCell>{.cell = {.features = 3}}, params(bv.at_path("params/forward_rnn")), seq);
  const Array backward = apply(nn::RNN<nn::GRUCell>{.cell = {.features = 2}, .reverse = true, .keep_order = true},
                               params(bv.at_path("params/backward_rnn")), seq);
  CHECK(apply(bi, bv, seq).bitwise_equal(concatenate({forward, backward}, -1)));
  // merge_fn replaces the concatenation; the carries come back with return_carry.
  BiGRU summed = bi;
  summed.backward_rnn.cell.features = 3;
  summed.merge_fn = [](const Array& a, const Array& b) { return a + b; };
  const Tree sv = init(summed, rng::key(4), seq);
  auto [carries, ys] = apply(summed, sv, seq, nn::RNNOptions{.return_carry = true});
  CHECK(ys.shape() == Shape{2, 5, 3});
  // A GRU's carry is its last output: the forward RNN's at the last step, the backward one's at the first.
  const Array f_out = apply(nn::RNN<nn::GRUCell>{.cell = {.features = 3}}, params(sv.at_path("params/forward_rnn")), seq);
  const Array b_out = apply(nn::RNN<nn::GRUCell>{.cell = {.features = 3}, .reverse = true, .keep_order = true},
                            params(sv.at_path("params/backward_rnn")), seq);
  CHECK(carries.first.bitwise_equal(reshape(slice_axis(f_out, 1, 4, 5), {2, 3})));
  CHECK(carries.second.bitwise_equal(reshape(slice_axis(b_out, 1, 0, 1), {2, 3})));
  CHECK(ys.bitwise_equal(f_out + b_out));
  check_gradients("Bidirectional", [](const V& a) {
    const Tree cell{{"ir", {{"kernel", a[1]}, {"bias", a[2]}}}, {"hr", {{"kernel", a[3]}}},
                    {"iz", {{"kernel", a[1]}, {"bias", a[2]}}}, {"hz", {{"kernel", a[3]}}},
                    {"in", {{"kernel", a[1]}, {"bias", a[2]}}}, {"hn", {{"kernel", a[3]}, {"bias", a[2]}}}};
    const Tree p{{"forward_rnn", {{"cell", cell}}}, {"backward_rnn", {{"cell", cell}}}};
    return apply(BiGRU{.forward_rnn = {.cell = {.features = 2}}, .backward_rnn = {.cell = {.features = 2}}}, params(p), a[0]);
  }, {random_array(Shape{1, 3, 2}, 218), random_array(Shape{2, 2}, 219), random_array(Shape{2}, 220), random_array(Shape{2, 2}, 221)});

  // Configurations round-trip.
  const auto in2 = nn::module_from_config<nn::InstanceNorm>(nn::module_config(nn::InstanceNorm{.epsilon = 1e-3}));
  CHECK(in2.epsilon == 1e-3);
  const auto e2 = nn::module_from_config<nn::Einsum>(nn::module_config(heads));
  CHECK(e2.shape == heads.shape);
  CHECK(e2.einsum_str == heads.einsum_str);
  const auto c2 = nn::module_from_config<nn::ConvLSTMCell>(nn::module_config(nn::ConvLSTMCell{.features = 4, .kernel_size = {3, 3}}));
  CHECK(c2.features == 4);
  CHECK(c2.kernel_size == std::vector<std::int64_t>{3, 3});
}

namespace {

template <class Wrapper>
struct Wrapped {  // a weight wrapper called from a parent module
  Wrapper wrapper;
  std::optional<bool> update_stats;
  Array operator()(Scope& s, const Array& x) const {
    if constexpr (requires { wrapper.n_steps; }) return s(wrapper, update_stats.value_or(false), x);
    else return s(wrapper, x);
  }
};

Array identity(std::int64_t n) {
  std::vector<float> e(static_cast<std::size_t>(n * n), 0.0f);
  for (std::int64_t i = 0; i < n; ++i) e[static_cast<std::size_t>(i * n + i)] = 1.0f;
  return Array::from(Shape{n, n}, e);
}

// The largest singular value of a matrix, by many power iterations in double.
double largest_singular_value(const Array& m) {
  const std::int64_t r = m.dim(0), c = m.dim(1);
  const std::vector<float> a = m.to_vector();
  std::vector<double> u(static_cast<std::size_t>(c), 1.0), v(static_cast<std::size_t>(r));
  double sigma = 0;
  for (int it = 0; it < 500; ++it) {
    double nv = 0, nu = 0;
    for (std::int64_t i = 0; i < r; ++i) {
      double acc = 0;
      for (std::int64_t j = 0; j < c; ++j) acc += a[static_cast<std::size_t>(i * c + j)] * u[static_cast<std::size_t>(j)];
      v[static_cast<std::size_t>(i)] = acc;
      nv += acc * acc;
    }
    for (double& e : v) e /= std::sqrt(nv);
    for (std::int64_t j = 0; j < c; ++j) {
      double acc = 0;
      for (std::int64_t i = 0; i < r; ++i) acc += a[static_cast<std::size_t>(i * c + j)] * v[static_cast<std::size_t>(i)];
      u[static_cast<std::size_t>(j)] = acc;
      nu += acc * acc;
    }
    sigma = std::sqrt(nu);
    for (double& e : u) e /= sigma;
  }
  return sigma;
}

}  // namespace

TEST_CASE("WeightNorm and SpectralNorm: layout beside the layer, definitions, gradients, statistics and errors") {
  using V = std::vector<Array>;
  const Array x = random_array(Shape{3, 4}, 21);
  // WeightNorm: the layer's kernel is scale * v / |v| per output; its variables beside the wrapper.
  using WN = Wrapped<nn::WeightNorm<nn::Dense>>;
  const Tree wv = init(WN{{.layer = {.features = 5}}}, rng::key(0), x);
  CHECK(wv.at("params").keys() == std::vector<std::string>{"WeightNorm_0", "Dense_0"});
  CHECK(wv.contains_path("params/WeightNorm_0/Dense_0/kernel/scale"));
  const Array v = random_array(Shape{4, 5}, 22), g = random_array(Shape{5}, 23, 0.5f, 2.0f), b = random_array(Shape{5}, 24);
  auto wn_params = [](const Array& kernel, const Array& scale, const Array& bias) {
    Tree p;
    p.set_path("Dense_0/kernel", Tree(kernel));
    p.set_path("Dense_0/bias", Tree(bias));
    p.set_path("WeightNorm_0/Dense_0/kernel/scale", Tree(scale));
    return params(p);
  };
  const Array w = v * rsqrt(sum(v * v, {0}, true) + 1e-12f) * g;
  CHECK(max_abs_diff(apply(WN{{.layer = {.features = 5}}}, wn_params(v, g, b), x), matmul(x, w) + b) < 1e-5f);
  check_gradients("WeightNorm<Dense>", [&](const V& a) {
    return apply(WN{{.layer = {.features = 5}}}, wn_params(a[1], a[2], a[3]), a[0]);
  }, {x, v, g, b});
  CHECK_THROWS_WITH_AS(init(WN{{.layer = {.features = 5}, .feature_axes = std::vector<int>{2}}}, rng::key(0), x),
                       doctest::Contains("feature axis 2 is out of range"), ValueError);

  // SpectralNorm: with enough power iterations the kernel is divided by its largest singular value.
  using SN = Wrapped<nn::SpectralNorm<nn::Dense>>;
  const SN many{{.layer = {.features = 5}, .n_steps = 200}, true};
  const Tree sv = init(many, rng::key(0), x);
  CHECK(sv.contains_path("batch_stats/SpectralNorm_0/Dense_0/kernel/u"));
  CHECK(sv.at_path("batch_stats/SpectralNorm_0/Dense_0/kernel/u").array().shape() == Shape{1, 5});
  Tree stored = sv;
  stored.set_path("params/Dense_0/kernel", Tree(v));
  auto [y, updates] = apply(many, stored, {.mutable_collections = {"batch_stats"}}, identity(4));
  const Array normalized = y - stored.at_path("params/Dense_0/bias").array();  // I (W / sigma) + b - b
  CHECK(std::abs(largest_singular_value(normalized) - 1.0) < 1e-4);
  CHECK(std::abs(updates.at_path("batch_stats/SpectralNorm_0/Dense_0/kernel/sigma").array().item() -
                 largest_singular_value(v)) < 1e-3 * largest_singular_value(v));
  // Evaluation (no update) needs no mutable collection; an update without one is the usual error.
  CHECK_NOTHROW((void)apply(SN{{.layer = {.features = 5}}, false}, sv, x));
  CHECK_THROWS_WITH_AS((void)apply(SN{{.layer = {.features = 5}}, true}, sv, x), doctest::Contains("not mutable"), ValueError);
  // Gradients hold u and v constant (Flax's stop_gradient), so finite differences, which move them
  // too, do not apply; the oracle test checks the kernel's gradient against Flax's. With respect to
  // the input the layer is linear: finite differences do apply.
  check_gradients("SpectralNorm<Dense> input", [&](const V& a) { return apply(SN{{.layer = {.features = 5}}, false}, sv, a[0]); },
                  {x});
  // A rank-4 kernel is a matrix of its leading dimensions by its last, or an error when asked.
  const Array img = random_array(Shape{2, 5, 5, 3}, 25);
  using SNConv = Wrapped<nn::SpectralNorm<nn::Conv>>;
  CHECK(init(SNConv{{.layer = {.features = 2, .kernel_size = {3, 3}}}, false}, rng::key(0), img)
            .at_path("batch_stats/SpectralNorm_0/Conv_0/kernel/u").array().shape() == Shape{1, 2});
  CHECK_THROWS_WITH_AS(init(SNConv{{.layer = {.features = 2, .kernel_size = {3, 3}}, .error_on_non_matrix = true}, false},
                            rng::key(0), img),
                       doctest::Contains("error_on_non_matrix"), ValueError);
}

TEST_CASE("ConvLocal: each output position its own kernel (a Conv when they are all equal), gradients, errors") {
  using V = std::vector<Array>;
  const Array img = random_array(Shape{2, 4, 5, 3}, 31);
  const nn::ConvLocal local{.features = 2, .kernel_size = {3, 3}};
  const Tree vars = init(local, rng::key(0), img);
  CHECK(vars.at_path("params/kernel").array().shape() == Shape{4, 5, 27, 2});
  CHECK(vars.at_path("params/bias").array().shape() == Shape{4, 5, 2});
  // With the same kernel at every position (rows reordered from Conv's (kh, kw, C) to channel-major
  // (C, kh, kw)) and one bias, ConvLocal is Conv.
  const Array k = random_array(Shape{3, 3, 3, 2}, 32), b = random_array(Shape{2}, 33);
  const Array rows = reshape(transpose(k, {2, 0, 1, 3}), {27, 2});
  std::vector<Array> every(20, rows);
  const Array tiled = reshape(stack(every), {4, 5, 27, 2});
  const Array biases = reshape(stack(std::vector<Array>(20, b)), {4, 5, 2});
  const Array y_local = apply(local, params({{"kernel", tiled}, {"bias", biases}}), img);
  const Array y_conv = apply(nn::Conv{.features = 2, .kernel_size = {3, 3}}, params({{"kernel", k}, {"bias", b}}), img);
  CHECK(max_abs_diff(y_local, y_conv) < 1e-5f);
  check_gradients("ConvLocal", [](const V& a) {
    return apply(nn::ConvLocal{.features = 2, .kernel_size = {2, 2}, .strides = {2}, .padding = "VALID"},
                 params({{"kernel", a[1]}, {"bias", a[2]}}), a[0]);
  }, {random_array(Shape{1, 4, 4, 2}, 34), random_array(Shape{2, 2, 8, 2}, 35), random_array(Shape{2, 2, 2}, 36)});
  CHECK_THROWS_WITH_AS(init(nn::ConvLocal{.features = 2, .kernel_size = {3, 3}, .strides = {1, 1, 1}}, rng::key(0), img),
                       doctest::Contains("strides"), ValueError);
  CHECK_THROWS_WITH_AS(init(nn::ConvLocal{.features = 0, .kernel_size = {3}}, rng::key(0), img),
                       doctest::Contains("features must be positive"), ValueError);
}
