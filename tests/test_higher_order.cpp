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

float max_abs(const Array& a) {
  float m = 0.0f;
  for (float v : astype(a, DType::f32).to_vector()) m = std::max(m, std::abs(v));
  return m;
}
float max_abs_diff(const Array& a, const Array& b) { return max_abs(astype(a, DType::f32) - astype(b, DType::f32)); }
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

TEST_CASE("second derivatives through checkpoint policies are bitwise the plain ones, for every op family") {
  const std::vector<lift::Policy> policies = {policies::nothing_saveable{}, policies::dots_saveable{},
                                              policies::everything_saveable{}};
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
