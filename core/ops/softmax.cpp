#include <linum/core/ops/softmax.hpp>
#include <linum/core/ops/elementwise.hpp>
#include <linum/core/ops/kernel_util.hpp>
#include <linum/core/ops/reduce.hpp>

namespace linum {

using autodiff::Cotangents;

Array softmax(const Array& x, const std::vector<int>& axes) {
  ops::detail::require_float(x, "softmax");
  Array y;
  {
    autodiff::NoGradGuard no_grad;  // computed in float32, rounded once to x's dtype; only y is kept
    const Array xf = astype(x.detached(), DType::f32);
    Array e = exp(xf - max(xf, axes, true));
    y = astype(e / sum(e, axes, true), x.dtype());
  }
  if (autodiff::needs_grad(x))
    autodiff::record("softmax", y, {&x}, {y}, [axes](Cotangents& c, autodiff::Saved s) {
      // dx = y * (g - sum(g * y))
      Array gy = mul(c.out(), s[0]);
      c.set(0, sub(gy, mul(s[0], sum(gy, axes, true))));
    });
  return y;
}

Array log_softmax(const Array& x, const std::vector<int>& axes) {
  ops::detail::require_float(x, "log_softmax");
  Array y;
  {
    autodiff::NoGradGuard no_grad;  // computed in float32, rounded once to x's dtype
    const Array xf = astype(x.detached(), DType::f32);
    Array shifted = xf - max(xf, axes, true);
    y = astype(shifted - log(sum(exp(shifted), axes, true)), x.dtype());
  }
  if (autodiff::needs_grad(x))
    autodiff::record("log_softmax", y, {&x}, {y}, [axes](Cotangents& c, autodiff::Saved s) {
      // dx = g - exp(y) * sum(g)
      c.set(0, sub(c.out(), mul(exp(s[0]), sum(c.out(), axes, true))));
    });
  return y;
}

}  // namespace linum
