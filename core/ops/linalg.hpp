// Matrix products: matmul (NumPy semantics) and dot_general (lax semantics). Both run on Eigen's
// GEMM, which uses every core when Linum is built with OpenMP.
#pragma once

#include <linum/core/array.hpp>

#include <vector>

namespace linum {

// a @ b with NumPy rules: 1-D operands are promoted (and the added axis removed), leading batch
// axes broadcast. The backward rule keeps an operand only if the other one needs a gradient.
Array matmul(const Array& a, const Array& b);

// Axes of lax.dot_general: which axes are contracted and which are batch axes, per operand.
struct DotDims {
  std::vector<int> lhs_contracting, rhs_contracting;
  std::vector<int> lhs_batch, rhs_batch;
};

// Generalised contraction: the result's axes are the batch axes, then lhs's free axes, then rhs's
// free axes (as lax.dot_general).
Array dot_general(const Array& lhs, const Array& rhs, const DotDims& dims);

}  // namespace linum
