// Derivatives of derivatives (issue 27): grad of grad, Hessian-vector products, jacrev/hessian and
// jvp, over every op family, through checkpoint policies, remat and scan, with clear errors where a
// rule cannot be differentiated.
#include <doctest/doctest.h>
#include <linum/linum.hpp>

#include "testing/gradcheck.hpp"
#include "testing/op_cases.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

using namespace linum;
using linum::testing::random_array;

namespace {

using linum::testing::max_abs;
using linum::testing::max_abs_diff;
bool bitwise_equal(const Array& a, const Array& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         astype(a, DType::f32).to_vector() == astype(b, DType::f32).to_vector();
}

using linum::testing::OpCase;

// The loss every op family is differentiated through: sum of squares of the block's output, so
// that even linear ops have a non-zero Hessian (J^T J).
struct Loss {
  const OpCase* c;
  std::optional<lift::Policy> policy;
  Array operator()(const Array& x, const Array& w) const {
    auto block = [c = c](const Array& x, const Array& w) { return c->apply(x * 1.5f, w); };
    Array y = policy ? checkpoint(block, {.policy = *policy})(x, w) : block(x, w);
    return sum(square(astype(y, DType::f32)));
  }
};

std::tuple<Array, Array> gradient(const Loss& loss, const Array& x, const Array& w) { return grad<0, 1>(loss)(x, w); }

// H (vx, vw), reverse over reverse: the gradient of <grad f, v>.
std::tuple<Array, Array> hvp_rr(const Loss& loss, const Array& x, const Array& w, const Array& vx, const Array& vw) {
  return grad<0, 1>([&](const Array& x, const Array& w) {
    auto [gx, gw] = grad<0, 1>(loss)(x, w);
    return sum(astype(gx, DType::f32) * vx) + sum(astype(gw, DType::f32) * vw);
  })(x, w);
}

struct Inputs {
  Array x, w, vx, vw;
};
Inputs inputs_for(const OpCase& c, DType dtype = DType::f32) {
  Inputs in{random_array(c.x_shape, 11, -1.0f, 1.0f, 0.05f) * 0.5f, random_array(c.w_shape, 12, -1.0f, 1.0f, 0.05f),
            random_array(c.x_shape, 13), random_array(c.w_shape, 14)};
  if (dtype != DType::f32) in.x = astype(in.x, dtype), in.w = astype(in.w, dtype);
  return in;
}

}  // namespace

TEST_CASE("nested grad: second derivatives of tanh and a small MLP's Hessian-vector product") {
  const Array x = Array::from(Shape{3}, {0.3f, -1.0f, 2.0f});
  auto f = [](const Array& x) { return sum(tanh(x)); };
  const Array d2 = grad([&](const Array& x) { return sum(grad(f)(x)); })(x);
  for (int i = 0; i < 3; ++i) {
    const float t = std::tanh(x.to_vector()[static_cast<std::size_t>(i)]);
    CHECK(d2.to_vector()[static_cast<std::size_t>(i)] == doctest::Approx(-2.0f * t * (1.0f - t * t)).epsilon(1e-5));
  }
  // Third derivative: d/dx (-2 t (1 - t^2)) = -2 (1 - t^2)(1 - 3 t^2).
  const Array d3 = grad([&](const Array& x) { return sum(grad([&](const Array& y) { return sum(grad(f)(y)); })(x)); })(x);
  for (int i = 0; i < 3; ++i) {
    const float t = std::tanh(x.to_vector()[static_cast<std::size_t>(i)]);
    CHECK(d3.to_vector()[static_cast<std::size_t>(i)] == doctest::Approx(-2.0f * (1 - t * t) * (1 - 3 * t * t)).epsilon(1e-4));
  }
}

TEST_CASE("second derivatives of every op family equal finite differences of first derivatives (float32)") {
  int checked = 0;
  for (const OpCase& c : linum::testing::op_cases()) {
    if (std::string(c.op) == "swish") continue;  // custom_vjp: an error, checked below
    const std::string op_name = c.op;
    CAPTURE(op_name);
    const Inputs in = inputs_for(c);
    const Loss loss{&c, std::nullopt};
    auto [hx, hw] = hvp_rr(loss, in.x, in.w, in.vx, in.vw);
    if (op_name == "astype") {  // finite differences of bf16 roundings say nothing: compare with the uncast block
      const OpCase uncast{"cast", "mul", c.x_shape, c.w_shape, [](const Array& z, const Array& w) { return z * w; }, false};
      auto [ux, uw] = hvp_rr(Loss{&uncast, std::nullopt}, in.x, in.w, in.vx, in.vw);
      CHECK(max_abs_diff(hx, ux) <= 1e-2f + 5e-2f * max_abs(ux));
      CHECK(max_abs_diff(hw, uw) <= 1e-2f + 5e-2f * max_abs(uw));
      ++checked;
      continue;
    }
    const float e = 1e-3f;
    auto [gpx, gpw] = gradient(loss, in.x + in.vx * e, in.w + in.vw * e);
    auto [gmx, gmw] = gradient(loss, in.x - in.vx * e, in.w - in.vw * e);
    const Array fdx = (gpx - gmx) / (2 * e), fdw = (gpw - gmw) / (2 * e);
    CHECK(hx.shape() == in.x.shape());
    CHECK(hw.shape() == in.w.shape());
    CHECK(max_abs_diff(hx, fdx) <= 2e-3f + 1e-2f * max_abs(fdx));
    CHECK(max_abs_diff(hw, fdw) <= 2e-3f + 1e-2f * max_abs(fdw));
    ++checked;
  }
  CHECK(checked >= 50);
}

TEST_CASE("second derivatives of every op family in bfloat16 stay within 5% (of the largest entry) of float32's") {
  for (const OpCase& c : linum::testing::op_cases()) {
    const std::string op = c.op;
    if (op == "swish" || op == "astype") continue;
    const std::string op_name = c.op;
    CAPTURE(op_name);
    const Inputs in16 = inputs_for(c, DType::bf16);
    // The same values in float32: the difference is the bf16 arithmetic alone.
    const Array x32 = astype(in16.x, DType::f32), w32 = astype(in16.w, DType::f32);
    const Loss loss{&c, std::nullopt};
    auto [hx16, hw16] = hvp_rr(loss, in16.x, in16.w, in16.vx, in16.vw);
    auto [hx32, hw32] = hvp_rr(loss, x32, w32, in16.vx, in16.vw);
    CHECK(hx16.dtype() == DType::bf16);
    CHECK(max_abs_diff(hx16, hx32) <= 1e-2f + 5e-2f * max_abs(hx32));
    CHECK(max_abs_diff(hw16, hw32) <= 1e-2f + 5e-2f * max_abs(hw32));
  }
}

TEST_CASE("second derivatives through checkpoint policies (offload and compression too) are bitwise the plain ones, for every op family") {
  const std::vector<lift::Policy> policies = {policies::nothing_saveable{}, policies::dots_saveable{},
                                              policies::everything_saveable{},
                                              policies::offload(policies::dots_saveable{}),
                                              policies::compress(storage::Codec::int8, policies::nothing_saveable{})};
  for (const OpCase& c : linum::testing::op_cases()) {
    if (std::string(c.op) == "swish") continue;
    const std::string op_name = c.op;
    CAPTURE(op_name);
    const Inputs in = inputs_for(c);
    auto [px, pw] = hvp_rr(Loss{&c, std::nullopt}, in.x, in.w, in.vx, in.vw);
    for (const lift::Policy& p : policies) {
      CAPTURE(p.description());
      auto [rx, rw] = hvp_rr(Loss{&c, p}, in.x, in.w, in.vx, in.vw);
      CHECK(bitwise_equal(rx, px));
      CHECK(bitwise_equal(rw, pw));
    }
  }
}

namespace {
// A user primitive with ten inputs, all kept as residuals: y = x0 x1 ... x9 (elementwise). Its rule
// is built from ops, so in create-graph mode it reads the residuals relinked to the graph.
Array product_of_ten(const std::vector<Array>& x) {
  return autodiff::primitive(
      "product_of_ten", {&x[0], &x[1], &x[2], &x[3], &x[4], &x[5], &x[6], &x[7], &x[8], &x[9]},
      [&](autodiff::Residuals& r) {
        Array y = x[0];
        for (std::size_t k = 1; k < x.size(); ++k) y = y * x[k];
        for (const Array& a : x) r.keep(a);
        return y;
      },
      autodiff::higher_order([](autodiff::Cotangents& c, autodiff::Saved s) {
        for (std::size_t k = 0; k < s.size(); ++k) {
          if (!c.needs(k)) continue;
          Array g = c.out();
          for (std::size_t j = 0; j < s.size(); ++j)
            if (j != k) g = g * s[j];
          c.set(k, g);
        }
      }));
}
}  // namespace

TEST_CASE("second derivatives see every residual an op keeps, not only its first eight") {
  std::vector<Array> x;
  for (unsigned k = 0; k < 10; ++k) x.push_back(random_array(Shape{5}, 40 + k, 0.5f, 1.5f));
  // d/dx9 sum(d/dx0 sum(y)) = x1 x2 ... x8: the ninth and tenth residuals must be linked to x8, x9.
  const Array d2 = grad([&](const Array& last) {
    std::vector<Array> in = x;
    in[9] = last;
    return sum(grad([&](const Array& first) {
      std::vector<Array> inner = in;
      inner[0] = first;
      return sum(product_of_ten(inner));
    })(in[0]));
  })(x[9]);
  Array want = x[1];
  for (std::size_t k = 2; k < 9; ++k) want = want * x[k];
  for (std::int64_t i = 0; i < 5; ++i) CHECK(d2.data()[i] == doctest::Approx(want.data()[i]).epsilon(1e-5));
}

TEST_CASE("a rule that cannot be differentiated is an error naming its op, never zeros") {
  const Array x = random_array(Shape{4, 6}, 3);
  auto f = [](const Array& x) { return sum(square(linum::testing::swish(x))); };
  CHECK(max_abs(grad(f)(x)) > 0.0f);  // first order works
  try {
    (void)grad([&](const Array& x) { return sum(grad(f)(x)); })(x);
    FAIL("expected an AutodiffError");
  } catch (const AutodiffError& e) {
    CHECK(std::string(e.what()).find("'swish'") != std::string::npos);
    CHECK(std::string(e.what()).find("higher-order") != std::string::npos);
  }
}

TEST_CASE("jvp equals the transpose of vjp on random directions, and finite differences, for every op family") {
  for (const OpCase& c : linum::testing::op_cases()) {
    const std::string op_name = c.op;
    if (op_name == "swish") continue;
    CAPTURE(op_name);
    const Inputs in = inputs_for(c);
    auto f = [&c](const Array& x, const Array& w) { return astype(c.apply(x * 1.5f, w), DType::f32); };
    auto [y, dy] = jvp(f, std::tuple{in.x, in.w}, std::tuple{in.vx, in.vw});
    CHECK(y.bitwise_equal(f(in.x, in.w)));
    CHECK(dy.shape() == y.shape());
    const Array u = random_array(y.shape(), 21);
    auto [y2, pullback] = vjp(f, in.x, in.w);
    auto [ux, uw] = pullback(u);
    // <u, J v> = <J^T u, v>
    const float lhs = sum(u * dy).item();
    const float rhs = (sum(astype(ux, DType::f32) * in.vx) + sum(astype(uw, DType::f32) * in.vw)).item();
    // bf16 blocks round J^T u and J v at different places: a bf16 tolerance for them.
    const float tol = op_name == "astype" ? 2e-2f : 1e-4f;
    CHECK(std::abs(lhs - rhs) <= tol * (1.0f + std::abs(rhs)));
    if (op_name == "astype") continue;  // finite differences of bf16 roundings say nothing
    const float e = 1e-3f;
    const Array fd = (f(in.x + in.vx * e, in.w + in.vw * e) - f(in.x - in.vx * e, in.w - in.vw * e)) / (2 * e);
    CHECK(max_abs_diff(dy, fd) <= 2e-3f + 1e-2f * max_abs(fd));
  }
}

TEST_CASE("jacrev, jacfwd and hessian agree with each other and with hvp; jvp of grad is the same hvp") {
  const Array x = random_array(Shape{2, 3}, 31);
  const Array a = random_array(Shape{3, 4}, 32);
  auto f = [&](const Array& x) { return tanh(matmul(x, a)); };  // [2, 4]
  const Array jr = jacrev(f)(x), jf = jacfwd(f)(x);
  CHECK(jr.shape() == Shape{2, 4, 2, 3});
  CHECK(max_abs_diff(jr, jf) < 1e-5f);
  // Column (0, 1) of the Jacobian is the jvp along that basis direction.
  Array e = Array::zeros(Shape{2, 3});
  e.mutable_data()[1] = 1.0f;
  auto [y, dy] = jvp(f, x, e);
  CHECK(max_abs_diff(dy, reshape(slice(jr, {0, 0, 0, 1}, {2, 4, 1, 2}), {2, 4})) < 1e-5f);

  auto g = [&](const Array& x) { return sum(square(f(x))) + sum(x * x * x); };
  const Array h = hessian(g)(x);
  CHECK(h.shape() == Shape{2, 3, 2, 3});
  CHECK(max_abs_diff(h, transpose(h, {2, 3, 0, 1})) < 1e-4f);  // symmetric
  const Array v = random_array(Shape{2, 3}, 33);
  const Array hv = hvp(g, x, v);
  const Array h_v = reshape(matmul(reshape(h, {6, 6}), reshape(v, {6, 1})), {2, 3});
  CHECK(max_abs_diff(hv, h_v) < 1e-4f);
  auto [gx, fwd_over_rev] = jvp([&](const Array& x) { return grad(g)(x); }, x, v);
  CHECK(max_abs_diff(fwd_over_rev, hv) < 1e-4f);
  // Nested, the gradient is computed by the rules' op forms (create-graph mode): equal within rounding.
  CHECK(max_abs_diff(gx, grad(g)(x)) < 1e-6f);
}

namespace {
struct Block {
  std::int64_t width = 8;
  Array operator()(Scope& s, const Array& x) const {
    return x + s(nn::Dense{.features = width}, gelu(s(nn::LayerNorm{}, x)));
  }
};
template <class B>
struct Stack {
  int depth = 3;
  Array operator()(Scope& s, const Array& x) const {
    Array h = s(nn::Dense{.features = 8}, x);
    for (int i = 0; i < depth; ++i) h = s(B{}, h);
    return s(nn::Dense{.features = 1}, tanh(h));
  }
};
template <class Model>
Tree hvp_of_params(const Model& m, const Tree& params, const Tree& v, const Array& x) {
  auto loss = [&](const Tree& p) { return mean(square(apply(m, Tree{{"params", p}}, x))); };
  return hvp(loss, params, v);
}
// A physics-informed residual: u(x) and its first and second derivatives with respect to the input.
template <class Model>
Array pinn_loss(const Model& m, const Tree& params, const Array& x) {
  auto u = [&](const Array& at) { return sum(apply(m, Tree{{"params", params}}, at)); };
  auto u_x = [&](const Array& at) { return grad(u)(at); };
  const Array ux = u_x(x);
  const Array uxx = grad([&](const Array& at) { return sum(u_x(at)); })(x);
  return mean(square(uxx + ux)) + mean(square(apply(m, Tree{{"params", params}}, x)));
}
}  // namespace

TEST_CASE("second derivatives through lift::remat modules are bitwise the plain ones; a physics-informed loss too") {
  const Array x = random_array(Shape{5, 1}, 41);
  const Tree vars = init(Stack<Block>{}, rng::key(0), x);
  const Tree& params = vars.at("params");
  const Tree v = tree_map([](const Array& a) { return random_array(a.shape(), 7); }, params);
  const Tree plain = hvp_of_params(Stack<Block>{}, params, v, x);
  const Tree remat = hvp_of_params(Stack<lift::remat<Block>>{}, params, v, x);
  CHECK(bitwise_equal(plain, remat));
  CHECK(max_abs(plain.at_path("Dense_0/kernel").array()) > 0.0f);
  // d/dparams of a loss holding du/dx and d2u/dx2 (nested grads w.r.t. the input).
  auto [l1, g1] = value_and_grad([&](const Tree& p) { return pinn_loss(Stack<Block>{}, p, x); })(params);
  auto [l2, g2] = value_and_grad([&](const Tree& p) { return pinn_loss(Stack<lift::remat<Block>>{}, p, x); })(params);
  CHECK(l1.bitwise_equal(l2));
  CHECK(bitwise_equal(g1, g2));
  // Against finite differences of the loss along v.
  const float e = 1e-2f;
  auto shifted = [&](float s) { return tree_map([&](const Array& p, const Array& d) { return p + d * s; }, params, v); };
  const float fd = (pinn_loss(Stack<Block>{}, shifted(e), x).item() - pinn_loss(Stack<Block>{}, shifted(-e), x).item()) / (2 * e);
  float dir = 0.0f;
  const std::vector<Array> gl = leaves(g1), vl = leaves(v);
  for (std::size_t i = 0; i < gl.size(); ++i) dir += sum(gl[i] * vl[i]).item();
  CHECK(dir == doctest::Approx(fd).epsilon(2e-2));
}

TEST_CASE("second derivatives through lift::scan with a schedule and nn::RNN (remat over time) are bitwise the plain ones") {
  const Array xs = random_array(Shape{2, 6, 3}, 51);
  auto run = [&](auto rnn) {
    const Tree vars = init(rnn, rng::key(1), xs);
    const Tree v = tree_map([](const Array& a) { return random_array(a.shape(), 8); }, vars.at("params"));
    auto loss = [&](const Tree& p) { return sum(square(apply(rnn, Tree{{"params", p}}, xs))); };
    return hvp(loss, vars.at("params"), v);
  };
  const Tree plain = run(nn::RNN<nn::LSTMCell>{.cell = {.features = 4}});
  CHECK(bitwise_equal(plain, run(nn::RNN<nn::LSTMCell>{.cell = {.features = 4}, .remat = true})));
  CHECK(bitwise_equal(plain, run(nn::RNN<nn::LSTMCell>{.cell = {.features = 4}, .schedule = lift::ScanSchedule::sqrt_segments()})));
  CHECK(bitwise_equal(plain, run(nn::RNN<nn::LSTMCell>{.cell = {.features = 4}, .schedule = lift::ScanSchedule::binomial(2)})));
  const Tree gru = run(nn::RNN<nn::GRUCell>{.cell = {.features = 4}});
  CHECK(bitwise_equal(gru, run(nn::RNN<nn::GRUCell>{.cell = {.features = 4}, .remat = true})));
}

TEST_CASE("nested value_and_grad keeps aux and values linked; grad of vjp's pullback; jacrev over a Tree") {
  const Array x = random_array(Shape{4}, 61);
  // d/dx of (the gradient's norm) where the inner function returns aux.
  auto inner = [](const Array& x) { return std::make_pair(sum(sin(x) * x), x * 2.0f); };
  const Array outer = grad([&](const Array& x) {
    auto [value, aux, g] = value_and_grad(inner)(x);
    return sum(square(g)) + value + sum(aux);
  })(x);
  // By hand: g = cos(x) x + sin(x); d/dx sum(g^2) = 2 g (2 cos x - x sin x); value' = g; aux' = 2.
  const std::vector<float> xv = x.to_vector(), ov = outer.to_vector();
  for (std::size_t i = 0; i < xv.size(); ++i) {
    const float s = std::sin(xv[i]), c = std::cos(xv[i]), g = c * xv[i] + s;
    CHECK(ov[i] == doctest::Approx(2 * g * (2 * c - xv[i] * s) + g + 2.0f).epsilon(1e-4));
  }
  // The gradient of <pullback(u), w> with respect to u is J w (the pullback is linear in u).
  const Array w = random_array(Shape{4}, 62);
  auto f = [](const Array& x) { return exp(x) * 2.0f; };
  auto y_and_pullback = vjp(f, x);
  const auto& pullback = y_and_pullback.second;
  const Array jw = grad([&](const Array& u) { return sum(pullback(u) * w); })(Array::zeros(Shape{4}));
  CHECK(max_abs_diff(jw, f(x) * w) < 1e-5f);
  // jacrev over a Tree of parameters.
  const Tree p{{"a", Tree(random_array(Shape{2}, 63))}, {"b", Tree(random_array(Shape{3}, 64))}};
  const Tree j = jacrev([](const Tree& t) { return concatenate({square(t.at("a").array()), sin(t.at("b").array())}, 0); })(p);
  CHECK(j.at("a").array().shape() == Shape{5, 2});
  CHECK(j.at("b").array().shape() == Shape{5, 3});
  CHECK(j.at("b").array().to_vector()[2 * 3 + 0] == doctest::Approx(std::cos(p.at("b").array().to_vector()[0])));
  // The Hessian over a Tree: blocks d2f / d a d b, symmetric across blocks, and hvp's product.
  auto f2 = [](const Tree& t) { return sum(square(t.at("a").array())) * sum(sin(t.at("b").array())); };
  const std::vector<Tree> h = hessian(f2)(p);
  REQUIRE(h.size() == 2);
  CHECK(h[0].at("b").array().shape() == Shape{2, 3});
  CHECK(h[1].at("a").array().shape() == Shape{3, 2});
  CHECK(max_abs_diff(h[0].at("b").array(), transpose(h[1].at("a").array())) < 1e-5f);
  const Tree dir{{"a", Tree(random_array(Shape{2}, 65))}, {"b", Tree(random_array(Shape{3}, 66))}};
  const Tree hv = hvp(f2, p, dir);
  const Array hv_a = matmul(h[0].at("a").array(), dir.at("a").array()) + matmul(h[0].at("b").array(), dir.at("b").array());
  CHECK(max_abs_diff(hv.at("a").array(), hv_a) < 1e-5f);
}
