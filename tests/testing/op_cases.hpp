// The catalogue of op families the "every op" tests run over: one representative block per
// primitive (and custom_vjp, checkpoint_name), each computing op(z, w) from a scaled input z and a
// second input w, with the name its primitive records.
#pragma once

#include <linum/linum.hpp>

#include <functional>
#include <vector>

namespace linum::testing {

// x * sigmoid(x) with its own backward rule (custom_vjp): residuals are its input and an array only
// its forward makes (sigmoid(x)).
Array swish(const Array& x);

// One op family's representative: `op` is the name its primitive records; the block computes
// op(x * 1.5, w). `input_left_out`: the op's rule does not keep its input, so when the policy saves
// the op's output, the product feeding it (whose rule keeps only the constant) is read by nothing
// in the replay and is left out.
struct OpCase {
  const char* family;
  const char* op;
  Shape x_shape, w_shape;
  std::function<Array(const Array& z, const Array& w)> apply;
  bool input_left_out;
};

std::vector<OpCase> op_cases();

}  // namespace linum::testing
