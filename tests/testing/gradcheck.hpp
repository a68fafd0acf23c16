// A reusable gradient check: compares the autodiff gradient of <f(inputs), r> (r a fixed random
// cotangent, so every output element matters) with central finite differences computed in double
// precision, element by element, with per-op tolerances.
#pragma once

#include <linum/linum.hpp>

#include <functional>
#include <string>
#include <vector>

namespace linum::testing {

struct GradCheckOptions {
  double eps = 1e-2;   // finite-difference step (applied in float32, the true step is recomputed)
  double rtol = 2e-2;  // |analytic - numeric| <= atol + rtol * |numeric|
  double atol = 2e-3;
  // Which inputs to differentiate (empty: every float32 input).
  std::vector<bool> wrt;
};

using OpFn = std::function<Array(const std::vector<Array>&)>;

// The first element whose autodiff and finite-difference gradients disagree, described in words;
// empty when all agree.
std::string first_gradient_mismatch(const std::string& op, const OpFn& f, const std::vector<Array>& inputs,
                                    const GradCheckOptions& options = {});

// Runs the check and reports each mismatch through doctest (CHECK), naming op, input and element.
// Returns true when everything matched.
bool check_gradients(const std::string& op, const OpFn& f, const std::vector<Array>& inputs,
                     const GradCheckOptions& options = {});

// Deterministic test data: uniform in [lo, hi), optionally pushed at least `away` from zero (to keep
// finite differences off kinks such as |x| and relu at 0).
Array random_array(const Shape& shape, unsigned seed, float lo = -1.0f, float hi = 1.0f, float away = 0.0f);
Array random_labels(const Shape& shape, unsigned seed, int num_classes);

// The largest |a| over the elements (any float dtype), and the largest |a - b|.
float max_abs(const Array& a);
float max_abs_diff(const Array& a, const Array& b);

}  // namespace linum::testing
