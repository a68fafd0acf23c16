#include "gradcheck.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <sstream>

namespace linum::testing {

Array random_array(const Shape& shape, unsigned seed, float lo, float hi, float away) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  Array a = Array::empty(shape);
  float* p = a.mutable_data();
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    float v = dist(gen);
    if (away > 0 && std::fabs(v) < away) v = v < 0 ? v - away : v + away;
    p[i] = v;
  }
  return a;
}

Array random_labels(const Shape& shape, unsigned seed, int num_classes) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<int> dist(0, num_classes - 1);
  Array a = Array::empty(shape, DType::i32);
  for (std::int64_t i = 0; i < a.numel(); ++i) a.mutable_data_i32()[i] = dist(gen);
  return a;
}

namespace {
double project(const Array& y, const Array& r) {
  double s = 0;
  for (std::int64_t i = 0; i < y.numel(); ++i) s += static_cast<double>(y.data()[i]) * r.data()[i];
  return s;
}
}  // namespace

bool check_gradients(const std::string& op, const OpFn& f, const std::vector<Array>& inputs,
                     const GradCheckOptions& o) {
  const std::string mismatch = first_gradient_mismatch(op, f, inputs, o);
  if (!mismatch.empty()) FAIL_CHECK(mismatch);
  return mismatch.empty();
}

std::string first_gradient_mismatch(const std::string& op, const OpFn& f, const std::vector<Array>& inputs,
                                    const GradCheckOptions& o) {
  auto differentiated = [&](std::size_t i) {
    return inputs[i].dtype() == DType::f32 && (o.wrt.empty() || (i < o.wrt.size() && o.wrt[i]));
  };
  // Analytic gradients with cotangent r.
  std::vector<Array> tracked = inputs;
  for (std::size_t i = 0; i < inputs.size(); ++i)
    if (differentiated(i)) tracked[i] = autodiff::make_leaf(inputs[i]);
  Array y;
  {
    autodiff::EnableGradGuard on;
    y = f(tracked);
  }
  const Array r = random_array(y.shape(), 12345u, -1.0f, 1.0f);
  autodiff::backward(std::span<const Array>(&y, 1), std::span<const Array>(&r, 1));
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (!differentiated(i)) continue;
    Array g = Differentiable<Array>::gradient(tracked[i]);
    for (std::int64_t j = 0; j < inputs[i].numel(); ++j) {
      std::vector<Array> plus = inputs, minus = inputs;
      Array p = Array::from(inputs[i].shape(), std::span<const float>(inputs[i].data(), inputs[i].numel()));
      Array m = Array::from(inputs[i].shape(), std::span<const float>(inputs[i].data(), inputs[i].numel()));
      const float x = inputs[i].data()[j];
      p.mutable_data()[j] = x + static_cast<float>(o.eps);
      m.mutable_data()[j] = x - static_cast<float>(o.eps);
      const double step = static_cast<double>(p.data()[j]) - static_cast<double>(m.data()[j]);
      plus[i] = p;
      minus[i] = m;
      double numeric;
      {
        autodiff::NoGradGuard off;
        numeric = (project(f(plus), r) - project(f(minus), r)) / step;
      }
      const double analytic = g.data()[j];
      if (!(std::fabs(analytic - numeric) <= o.atol + o.rtol * std::fabs(numeric))) {
        std::ostringstream os;
        os << op << ": gradient of input " << i << " " << inputs[i].shape() << " at flat index " << j
           << ": autodiff " << analytic << " vs finite differences " << numeric;
        return os.str();
      }
    }
  }
  return {};
}

float max_abs(const Array& a) {
  float m = 0.0f;
  for (float v : astype(a, DType::f32).to_vector()) m = std::max(m, std::abs(v));
  return m;
}
float max_abs_diff(const Array& a, const Array& b) { return max_abs(astype(a, DType::f32) - astype(b, DType::f32)); }

}  // namespace linum::testing
