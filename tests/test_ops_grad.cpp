// Every op against central finite differences, with per-op tolerances.
#include <doctest/doctest.h>

#include "testing/gradcheck.hpp"

#include <cmath>

using namespace linum;
using linum::testing::check_gradients;
using linum::testing::GradCheckOptions;
using linum::testing::random_array;
using V = std::vector<Array>;

namespace {
Array r(const Shape& s, unsigned seed, float lo = -1.0f, float hi = 1.0f, float away = 0.0f) {
  return random_array(s, seed, lo, hi, away);
}
}  // namespace

TEST_CASE("binary arithmetic with broadcasting") {
  const Shape a{2, 3, 4}, row{4}, col{3, 1};
  CHECK(check_gradients("add", [](const V& v) { return add(v[0], v[1]); }, {r(a, 1), r(row, 2)}));
  CHECK(check_gradients("sub", [](const V& v) { return sub(v[0], v[1]); }, {r(col, 3), r(a, 4)}));
  CHECK(check_gradients("mul", [](const V& v) { return mul(v[0], v[1]); }, {r(a, 5), r(col, 6)}));
  CHECK(check_gradients("div", [](const V& v) { return div(v[0], v[1]); }, {r(a, 7), r(row, 8, 0.5f, 2.0f)}));
  CHECK(check_gradients("pow", [](const V& v) { return pow(v[0], v[1]); }, {r(a, 9, 0.5f, 2.0f), r(row, 10)}));
  CHECK(check_gradients("maximum", [](const V& v) { return maximum(v[0], v[1]); }, {r(a, 11), r(row, 12)},
                        {.eps = 1e-3}));
  CHECK(check_gradients("minimum", [](const V& v) { return minimum(v[0], v[1]); }, {r(a, 13), r(a, 14)},
                        {.eps = 1e-3}));
  CHECK(check_gradients("neg", [](const V& v) { return neg(v[0]); }, {r(a, 15)}));
  CHECK(check_gradients("scalar ops", [](const V& v) { return (2.0f * v[0] - 1.0f) / 3.0f + 0.5f; }, {r(a, 16)}));
}

TEST_CASE("unary math and activations") {
  const Shape s{3, 5};
  struct Case {
    const char* name;
    std::function<Array(const Array&)> fn;
    float lo, hi, away;
  };
  const Case cases[] = {
      {"exp", [](const Array& x) { return exp(x); }, -2, 2, 0},
      {"log", [](const Array& x) { return log(x); }, 0.5f, 3, 0},
      {"log1p", [](const Array& x) { return log1p(x); }, -0.5f, 3, 0},
      {"sqrt", [](const Array& x) { return sqrt(x); }, 0.5f, 3, 0},
      {"rsqrt", [](const Array& x) { return rsqrt(x); }, 0.5f, 3, 0},
      {"square", [](const Array& x) { return square(x); }, -2, 2, 0},
      {"abs", [](const Array& x) { return abs(x); }, -2, 2, 0.05f},
      {"tanh", [](const Array& x) { return tanh(x); }, -2, 2, 0},
      {"sigmoid", [](const Array& x) { return sigmoid(x); }, -4, 4, 0},
      {"sin", [](const Array& x) { return sin(x); }, -3, 3, 0},
      {"cos", [](const Array& x) { return cos(x); }, -3, 3, 0},
      {"erf", [](const Array& x) { return erf(x); }, -2, 2, 0},
      {"expm1", [](const Array& x) { return expm1(x); }, -2, 2, 0},
      {"log2", [](const Array& x) { return log2(x); }, 0.5f, 3, 0},
      {"floor", [](const Array& x) { return floor(x); }, -3, 3, 0},
      {"ceil", [](const Array& x) { return ceil(x); }, -3, 3, 0},
      {"round", [](const Array& x) { return round(x); }, -3, 3, 0},
      {"relu", [](const Array& x) { return relu(x); }, -2, 2, 0.05f},
      {"gelu (tanh)", [](const Array& x) { return gelu(x, true); }, -3, 3, 0},
      {"gelu (erf)", [](const Array& x) { return gelu(x, false); }, -3, 3, 0},
      {"silu", [](const Array& x) { return silu(x); }, -3, 3, 0},
      {"softplus", [](const Array& x) { return softplus(x); }, -3, 3, 0},
      {"clip", [](const Array& x) { return clip(x, -0.5f, 0.5f); }, -1, 1, 0},
  };
  for (const Case& c : cases) {
    CAPTURE(c.name);
    Array x = r(s, 20, c.lo, c.hi, c.away);
    if (std::string(c.name) == "clip") {  // keep away from the clip bounds
      float* p = x.mutable_data();
      for (std::int64_t i = 0; i < x.numel(); ++i)
        if (std::fabs(std::fabs(p[i]) - 0.5f) < 0.05f) p[i] *= 1.2f;
    }
    CHECK(check_gradients(c.name, [&](const V& v) { return c.fn(v[0]); }, {x}, {.eps = 1e-3}));
  }
}

TEST_CASE("where selects and routes gradients") {
  Array cond = Array::from(Shape{3, 1}, {1, 0, 1});
  CHECK(check_gradients("where", [&](const V& v) { return where(cond, v[0], v[1]); },
                        {r(Shape{3, 4}, 30), r(Shape{4}, 31)}));
}

TEST_CASE("reductions") {
  const Shape s{2, 3, 4};
  for (std::vector<int> axes : {std::vector<int>{0}, {1}, {2}, {0, 2}, {-1, -2}, {0, 1, 2}}) {
    for (bool keep : {false, true}) {
      CAPTURE(axes.size());
      CAPTURE(keep);
      CHECK(check_gradients("sum", [&](const V& v) { return sum(v[0], axes, keep); }, {r(s, 40)}));
      CHECK(check_gradients("mean", [&](const V& v) { return mean(v[0], axes, keep); }, {r(s, 41)}));
      CHECK(check_gradients("max", [&](const V& v) { return max(v[0], axes, keep); }, {r(s, 42)}, {.eps = 1e-3}));
      CHECK(check_gradients("min", [&](const V& v) { return min(v[0], axes, keep); }, {r(s, 43)}, {.eps = 1e-3}));
      CHECK(check_gradients("var", [&](const V& v) { return var(v[0], axes, keep); }, {r(s, 44)}));
      CHECK(check_gradients("logsumexp", [&](const V& v) { return logsumexp(v[0], axes, keep); }, {r(s, 45)}));
    }
  }
  CHECK(check_gradients("sum all", [](const V& v) { return sum(v[0]); }, {r(s, 46)}));
}

TEST_CASE("matmul and dot_general") {
  CHECK(check_gradients("matmul 2d", [](const V& v) { return matmul(v[0], v[1]); }, {r({3, 4}, 50), r({4, 5}, 51)}));
  CHECK(check_gradients("matmul vec", [](const V& v) { return matmul(v[0], v[1]); }, {r({4}, 52), r({4, 5}, 53)}));
  CHECK(check_gradients("matmul mat-vec", [](const V& v) { return matmul(v[0], v[1]); }, {r({3, 4}, 54), r({4}, 55)}));
  CHECK(check_gradients("matmul batched+broadcast", [](const V& v) { return matmul(v[0], v[1]); },
                        {r({2, 1, 3, 4}, 56), r({3, 4, 2}, 57)}));
  DotDims dims{.lhs_contracting = {2}, .rhs_contracting = {1}, .lhs_batch = {0}, .rhs_batch = {0}};
  CHECK(check_gradients("dot_general bmm", [&](const V& v) { return dot_general(v[0], v[1], dims); },
                        {r({2, 3, 4}, 58), r({2, 4, 5}, 59)}));
  DotDims attn{.lhs_contracting = {3}, .rhs_contracting = {3}, .lhs_batch = {0, 2}, .rhs_batch = {0, 2}};
  CHECK(check_gradients("dot_general attention", [&](const V& v) { return dot_general(v[0], v[1], attn); },
                        {r({2, 3, 2, 4}, 60), r({2, 5, 2, 4}, 61)}));
}

TEST_CASE("data movement") {
  CHECK(check_gradients("reshape", [](const V& v) { return reshape(v[0], {4, -1}); }, {r({2, 3, 4}, 70)}));
  CHECK(check_gradients("reshape to its own shape", [](const V& v) { return reshape(v[0], {2, -1, 4}) * 2.0f; },
                        {r({2, 3, 4}, 70)}));
  {  // to its own shape: the input itself, nothing recorded (as jax.lax.reshape)
    auto [value, g] = value_and_grad([](const Array& x) {
      const Array y = reshape(x, {2, 3, 4});
      CHECK(y.node() == x.node());
      return sum(y * y);
    })(r({2, 3, 4}, 70));
    CHECK(g.shape() == Shape{2, 3, 4});
  }
  CHECK(check_gradients("transpose", [](const V& v) { return transpose(v[0], {2, 0, 1}); }, {r({2, 3, 4}, 71)}));
  CHECK(check_gradients("slice", [](const V& v) { return slice(v[0], {0, 1, 0}, {2, 3, 4}, {1, 1, 2}); },
                        {r({2, 3, 4}, 72)}));
  CHECK(check_gradients("concatenate", [](const V& v) { return concatenate({v[0], v[1], v[0]}, 1); },
                        {r({2, 3}, 73), r({2, 2}, 74)}));
  CHECK(check_gradients("split", [](const V& v) { auto p = split(v[0], 2, 1); return p[0] * p[1]; },
                        {r({2, 4}, 75)}));
  CHECK(check_gradients("split indices", [](const V& v) { auto p = split(v[0], std::vector<std::int64_t>{1, 3}, 0); return concatenate({p[2], p[0]}, 0); },
                        {r({4, 2}, 76)}));
  Array idx = Array::from_i32(Shape{2, 2}, {0, 2, 2, 1});
  CHECK(check_gradients("take", [&](const V& v) { return take(v[0], idx, 0); }, {r({3, 4}, 77)}));
  CHECK(check_gradients("take axis 1", [&](const V& v) { return take(v[0], idx, 1); }, {r({2, 3, 2}, 78)}));
  CHECK(check_gradients("unstack/stack", [](const V& v) { auto p = unstack(v[0]); return stack({p[2] * p[0], p[1]}); },
                        {r({3, 2, 2}, 81)}));
  CHECK(check_gradients("broadcast_to", [](const V& v) { return broadcast_to(v[0], Shape{2, 3, 4}); }, {r({3, 1}, 79)}));
  CHECK(check_gradients("expand/squeeze", [](const V& v) { return squeeze(expand_dims(v[0], 1)) * 2.0f; }, {r({3, 4}, 80)}));
}

TEST_CASE("softmax and log_softmax") {
  CHECK(check_gradients("softmax", [](const V& v) { return softmax(v[0]); }, {r({3, 5}, 90, -2, 2)}));
  CHECK(check_gradients("softmax axis 0", [](const V& v) { return softmax(v[0], {0}); }, {r({3, 5}, 91, -2, 2)}));
  CHECK(check_gradients("log_softmax", [](const V& v) { return log_softmax(v[0]); }, {r({3, 5}, 92, -2, 2)}));
}

TEST_CASE("conv2d: strides, padding, dilation, groups") {
  struct Case {
    const char* name;
    ConvOptions opt;
    Shape x, w;
  };
  const Case cases[] = {
      {"same", {}, {2, 5, 5, 3}, {3, 3, 3, 4}},
      {"valid stride 2", {.strides = {2, 2}, .padding = Padding::valid()}, {1, 6, 7, 2}, {3, 2, 2, 3}},
      {"dilation 2", {.padding = Padding::same(), .dilation = {2, 2}}, {1, 6, 6, 2}, {3, 3, 2, 2}},
      {"groups 2", {.feature_group_count = 2}, {2, 4, 4, 4}, {3, 3, 2, 6}},
      {"explicit pads", {.strides = {2, 1}, .padding = Padding::explicit_pads(1, 0, 2, 1)}, {1, 5, 4, 1}, {2, 3, 1, 2}},
  };
  for (const Case& c : cases) {
    CAPTURE(c.name);
    CHECK(check_gradients(c.name, [&](const V& v) { return conv2d(v[0], v[1], c.opt); }, {r(c.x, 100), r(c.w, 101)}));
  }
}

TEST_CASE("pooling") {
  CHECK(check_gradients("avg_pool", [](const V& v) { return avg_pool(v[0], {.window = {2, 2}, .strides = {2, 2}}); },
                        {r({2, 4, 4, 3}, 110)}));
  CHECK(check_gradients("avg_pool same, overlapping, exclude pad",
                        [](const V& v) {
                          return avg_pool(v[0], {.window = {3, 3}, .strides = {1, 2}, .padding = Padding::same(),
                                                 .count_include_pad = false});
                        },
                        {r({1, 5, 5, 2}, 111)}));
  CHECK(check_gradients("max_pool", [](const V& v) { return max_pool(v[0], {.window = {2, 2}, .strides = {2, 2}}); },
                        {r({2, 4, 4, 3}, 112)}, {.eps = 1e-3}));
  CHECK(check_gradients("max_pool same overlapping",
                        [](const V& v) { return max_pool(v[0], {.window = {3, 3}, .strides = {1, 1}, .padding = Padding::same()}); },
                        {r({1, 4, 4, 2}, 113)}, {.eps = 1e-3}));
}

TEST_CASE("the gradient check catches a wrong backward rule") {
  // x * 3 recorded with the rule of x * 2: the harness must notice.
  auto wrong = [](const V& v) {
    Array y = v[0] * 3.0f;
    Array out = y.detached();
    if (autodiff::needs_grad(v[0]))
      autodiff::record("wrong", out, {&v[0]}, {}, [](autodiff::Cotangents& c, autodiff::Saved) { c.set(0, c.out() * 2.0f); });
    return out;
  };
  CHECK_FALSE(linum::testing::first_gradient_mismatch("wrong", wrong, {r({3}, 1)}).empty());
  auto right = [](const V& v) { return v[0] * 3.0f; };
  CHECK(linum::testing::first_gradient_mismatch("right", right, {r({3}, 1)}).empty());
}

TEST_CASE("cumsum, take_along_axis and segment_sum: values as jnp's, gradients by finite differences") {
  const Array x = Array::from({2, 3}, {1, 2, 3, 4, 5, 6});
  CHECK(cumsum(x, 1).to_vector() == std::vector<float>{1, 3, 6, 4, 9, 15});
  CHECK(cumsum(x, 0).to_vector() == std::vector<float>{1, 2, 3, 5, 7, 9});
  CHECK(cumsum(astype(x, DType::bf16), -1).dtype() == DType::bf16);
  const Array idx = Array::from_i32(Shape{2, 2}, {2, 0, 1, 1});
  CHECK(take_along_axis(x, idx, 1).to_vector() == std::vector<float>{3, 1, 5, 5});
  CHECK(take_along_axis(x, Array::from_i32(Shape{1, 3}, {1, 0, 1}), 0).to_vector() == std::vector<float>{4, 2, 6});
  const Array ids = Array::from_i32(Shape{2}, {1, 1});
  CHECK(segment_sum(x, ids, 3).to_vector() == std::vector<float>{0, 0, 0, 5, 7, 9, 0, 0, 0});
  CHECK(segment_sum(x, Array::from_i32(Shape{2}, {0, 7}), 2).to_vector() == std::vector<float>{1, 2, 3, 0, 0, 0});  // 7: dropped
  const Array r = random_array(Shape{4, 5}, 31);
  CHECK(check_gradients("cumsum", [](const V& in) { return sum(square(cumsum(in[0], 1))); }, {r}));
  CHECK(check_gradients("cumsum axis 0", [](const V& in) { return sum(square(cumsum(in[0], 0))); }, {r}));
  const Array ia = Array::from_i32(Shape{4, 2}, {4, 0, 1, 1, 3, 2, 0, 4});
  CHECK(check_gradients("take_along_axis", [&](const V& in) { return sum(square(take_along_axis(in[0], ia, 1))); }, {r}));
  const Array seg = Array::from_i32(Shape{4}, {2, 0, 2, -1});
  CHECK(check_gradients("segment_sum", [&](const V& in) { return sum(square(segment_sum(in[0], seg, 3))); }, {r}));
  CHECK_THROWS_AS(take_along_axis(x, Array::from_i32(Shape{2, 1}, {3, 0}), 1), ValueError);
  CHECK_THROWS_AS(segment_sum(x, Array::from_i32(Shape{3}, {0, 0, 0}), 2), ShapeError);
  // Second derivatives through cumsum (its rule is written with ops).
  // f(v) = sum(c^3), c = cumsum(v) = (0.5, -0.5, 1.5): H[j][l] = 6 * sum of c_k for k >= max(j, l).
  const Array h = hessian([](const Array& v) { const Array c = cumsum(v, 0); return sum(c * c * c); })(Array::from({3}, {0.5f, -1.0f, 2.0f}));
  REQUIRE(h.shape() == Shape({3, 3}));
  const std::vector<float> want{9, 6, 9, 6, 6, 9, 9, 9, 9};
  for (int i = 0; i < 9; ++i) CHECK(h.to_vector()[static_cast<std::size_t>(i)] == doctest::Approx(want[static_cast<std::size_t>(i)]));
}

TEST_CASE("cumprod and prod: values as jnp's, exact gradients with zeros in x (finite differences, second order)") {
  const Array x = Array::from({2, 3}, {1, 2, 3, 4, 5, 6});
  CHECK(cumprod(x, 1).to_vector() == std::vector<float>{1, 2, 6, 4, 20, 120});
  CHECK(cumprod(x, 0).to_vector() == std::vector<float>{1, 2, 3, 4, 10, 18});
  CHECK(cumprod(astype(x, DType::bf16), -1).dtype() == DType::bf16);
  CHECK(prod(x).item() == 720.0f);
  CHECK(prod(x, {0}).to_vector() == std::vector<float>{4, 10, 18});
  CHECK(prod(x, {1}, true).shape() == Shape({2, 1}));
  CHECK(prod(x, {1}, true).to_vector() == std::vector<float>{6, 120});
  CHECK(prod(Array::zeros(Shape{2, 0}), {1}).to_vector() == std::vector<float>{1, 1});  // the empty product
  const Array cube = Array::arange(24).with_shape(Shape{2, 3, 4}) * 0.1f + 0.5f;
  const std::vector<float> c = cube.to_vector();
  const std::vector<float> p02 = prod(cube, {0, 2}).to_vector();
  for (int j = 0; j < 3; ++j) {
    double want = 1.0;
    for (int i = 0; i < 2; ++i)
      for (int k = 0; k < 4; ++k) want *= c[static_cast<std::size_t>(i * 12 + j * 4 + k)];
    CHECK(p02[static_cast<std::size_t>(j)] == doctest::Approx(want).epsilon(1e-5));
  }
  const Array r = random_array(Shape{4, 5}, 33);
  CHECK(check_gradients("cumprod", [](const V& in) { return sum(square(cumprod(in[0], 1))); }, {r}));
  CHECK(check_gradients("cumprod axis 0", [](const V& in) { return sum(cumprod(in[0], 0) * Array::arange(5)); }, {r}));
  CHECK(check_gradients("prod", [](const V& in) { return sum(prod(in[0], {1}) * Array::arange(4)); }, {r}));
  CHECK(check_gradients("prod of all", [](const V& in) { return prod(in[0] * 0.5f + 1.0f); }, {r}));
  // With zeros: d prod / dx_j = the product of the others (one zero: nonzero only at the zero).
  const Array z = Array::from({4}, {2, 0, 3, 5});
  CHECK(grad([](const Array& v) { return prod(v); })(z).to_vector() == std::vector<float>{0, 30, 0, 0});
  CHECK(grad([](const Array& v) { return sum(cumprod(v, 0)); })(z).to_vector() == std::vector<float>{1, 2 + 6 + 30, 0, 0});
  const Array two_zeros = Array::from({3}, {0, 4, 0});
  CHECK(grad([](const Array& v) { return prod(v); })(two_zeros).to_vector() == std::vector<float>{0, 0, 0});
  // Second derivatives (create-graph mode writes the rule with ops): f = prod(v), H[j][l] = prod of the
  // others (j != l), 0 on the diagonal; with a zero in v, exact.
  const Array v = Array::from({3}, {2, 0, 3});
  const Array h = hessian([](const Array& a) { return prod(a); })(v);
  CHECK(h.to_vector() == std::vector<float>{0, 3, 0, 3, 0, 2, 0, 2, 0});
  const Array h2 = hessian([](const Array& a) { return sum(square(cumprod(a, 0))); })(Array::from({3}, {0.5f, -1.5f, 2.0f}));
  // Reference: central differences of the first derivative.
  const float eps = 1e-3f;
  for (int l = 0; l < 3; ++l) {
    std::vector<float> up{0.5f, -1.5f, 2.0f}, down = up;
    up[static_cast<std::size_t>(l)] += eps;
    down[static_cast<std::size_t>(l)] -= eps;
    auto g = [](const std::vector<float>& a) {
      return grad([](const Array& t) { return sum(square(cumprod(t, 0))); })(Array::from(Shape{3}, a)).to_vector();
    };
    const std::vector<float> gu = g(up), gd = g(down);
    for (int j = 0; j < 3; ++j)
      CHECK(h2.to_vector()[static_cast<std::size_t>(j * 3 + l)] ==
            doctest::Approx((gu[static_cast<std::size_t>(j)] - gd[static_cast<std::size_t>(j)]) / (2 * eps)).epsilon(1e-2));
  }
}

TEST_CASE("einsum: values against loops, diagonals, ellipsis broadcasting, implicit output, gradients, clear errors") {
  const Array a = random_array(Shape{3, 4}, 41), b = random_array(Shape{4, 5}, 42);
  CHECK(einsum("ij,jk->ik", a, b).bitwise_equal(matmul(a, b)));
  const std::vector<float> va = a.to_vector(), vb = b.to_vector();
  // Reference by loops: sum_j a[i,j] b[j,k], transposed output.
  const Array t = einsum("ij,jk->ki", a, b);
  REQUIRE(t.shape() == Shape({5, 3}));
  for (int i = 0; i < 3; ++i)
    for (int k = 0; k < 5; ++k) {
      double want = 0;
      for (int j = 0; j < 4; ++j) want += va[static_cast<std::size_t>(i * 4 + j)] * vb[static_cast<std::size_t>(j * 5 + k)];
      CHECK(t.to_vector()[static_cast<std::size_t>(k * 3 + i)] == doctest::Approx(want).epsilon(1e-5));
    }
  CHECK(einsum("ij,jk", a, b).shape() == Shape({3, 5}));      // implicit: the letters used once, sorted
  CHECK(einsum("ba", a).shape() == Shape({4, 3}));            // implicit order is alphabetical: a transpose
  CHECK(einsum("ij->", a).item() == doctest::Approx(sum(a).item()));
  CHECK(einsum("ij->j", a).bitwise_equal(sum(a, {0})));
  CHECK(einsum("i,j->ij", Array::from({2}, {1, 2}), Array::from({3}, {1, 10, 100})).to_vector() ==
        std::vector<float>{1, 10, 100, 2, 20, 200});
  const Array sq = Array::arange(9).with_shape(Shape{3, 3});
  CHECK(einsum("ii->i", sq).to_vector() == std::vector<float>{0, 4, 8});
  CHECK(einsum("ii", sq).item() == 12.0f);  // the trace
  // Batched products and attention scores as models write them.
  const Array q = random_array(Shape{2, 3, 5, 4}, 43), k = random_array(Shape{2, 3, 6, 4}, 44);
  const Array scores = einsum("bhqd,bhkd->bhqk", q, k);
  CHECK(scores.shape() == Shape({2, 3, 5, 6}));
  CHECK(max(abs(scores - matmul(q, swapaxes(k, -1, -2)))).item() < 1e-5f);
  // "..." for leading axes, size 1 broadcasting against n.
  const Array x3 = random_array(Shape{2, 3, 4}, 45), m1 = random_array(Shape{1, 4, 5}, 46);
  const Array e = einsum("...ij,...jk->...ik", x3, m1);
  CHECK(e.shape() == Shape({2, 3, 5}));
  CHECK(max(abs(e - matmul(x3, m1))).item() < 1e-5f);
  CHECK(einsum("...j,j->...", x3, Array::ones(Shape{4})).shape() == Shape({2, 3}));
  CHECK(einsum("ijk->kji", x3).bitwise_equal(transpose(x3, {2, 1, 0})));
  // Three operands, contracted left to right.
  const Array c = random_array(Shape{5, 2}, 47);
  CHECK(max(abs(einsum("ij,jk,kl->il", a, b, c) - matmul(matmul(a, b), c))).item() < 1e-5f);
  // Gradients: finite differences through products, diagonals, sums and broadcasts.
  CHECK(check_gradients("einsum ij,jk->ki", [](const V& in) { return sum(square(einsum("ij,jk->ki", in[0], in[1]))); }, {a, b}));
  CHECK(check_gradients("einsum bhqd,bhkd->bhqk", [](const V& in) { return sum(square(einsum("bhqd,bhkd->bhqk", in[0], in[1]))); },
                        {q, k}));
  CHECK(check_gradients("einsum ii,i->i", [](const V& in) { return sum(square(einsum("ii,i->i", in[0], in[1]))); },
                        {random_array(Shape{4, 4}, 48), random_array(Shape{4}, 49)}));
  CHECK(check_gradients("einsum ...ij,...jk", [](const V& in) { return sum(square(einsum("...ij,...jk->...ik", in[0], in[1]))); },
                        {x3, m1}));
  // Bad specs: the subscripts and the shapes in the message.
  CHECK_THROWS_WITH_AS(einsum("ij,jk->ik", a, a), doctest::Contains("einsum('ij,jk->ik', f32[3,4], f32[3,4]): axis 'j'"), ShapeError);
  CHECK_THROWS_WITH_AS(einsum("ijk,jk->ik", a, b), doctest::Contains("operand 0 has rank 2 but 'ijk' names 3 axes"), ShapeError);
  CHECK_THROWS_WITH_AS(einsum("ij->iz", a), doctest::Contains("the output names 'z', which no operand has"), ValueError);
  CHECK_THROWS_WITH_AS(einsum("ij,jk", a), doctest::Contains("the subscripts name 2 operand(s), 1 were given"), ValueError);
  CHECK_THROWS_WITH_AS(einsum("i1->i", a), doctest::Contains("'1' in 'i1' is not a letter"), ValueError);
  CHECK_THROWS_AS(einsum("ii->i", a), ShapeError);  // a diagonal of a non-square pair
}

TEST_CASE("argsort, sort and top_k: stable, NaNs as the largest value, gradients through the gather") {
  const float nan = std::nanf("");
  const Array x = Array::from({2, 4}, {3, 1, 2, 1, nan, -1, 5, -1});
  CHECK(argsort(x).to_vector_i32() == std::vector<std::int32_t>{1, 3, 2, 0, 1, 3, 2, 0});
  CHECK(argsort(x, -1, true).to_vector_i32() == std::vector<std::int32_t>{0, 2, 1, 3, 0, 2, 1, 3});
  CHECK(argsort(x, 0).to_vector_i32() == std::vector<std::int32_t>{0, 1, 0, 1, 1, 0, 1, 0});
  const std::vector<float> sorted = sort(x).to_vector();
  CHECK(sorted[0] == 1.0f);
  CHECK(sorted[3] == 3.0f);
  CHECK(std::isnan(sorted[7]));
  const auto [values, indices] = top_k(x, 2);
  CHECK(values.shape() == Shape({2, 2}));
  CHECK(indices.to_vector_i32() == std::vector<std::int32_t>{0, 2, 0, 2});
  CHECK(values.to_vector()[1] == 2.0f);
  CHECK(std::isnan(values.to_vector()[2]));
  CHECK_THROWS_AS(top_k(x, 5), ValueError);
  const Array r = random_array(Shape{3, 5}, 32);
  CHECK(check_gradients("sort", [](const V& in) { return sum(square(sort(in[0])) * Array::arange(5)); }, {r}));
  // Values apart by more than the finite-difference step, so no perturbation changes the top 3.
  const Array apart = Array::from({3, 5}, {0.3f, -1.2f, 2.1f, 0.9f, -0.4f, 1.5f, 0.2f, -2.0f, 0.7f, 1.1f, -0.6f, 2.4f, 0.05f, -1.4f, 1.8f});
  CHECK(check_gradients("top_k", [](const V& in) { return sum(square(top_k(in[0], 3).first) * Array::arange(3)); }, {apart}));
}
