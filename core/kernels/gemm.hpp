// Internal: the batched matrix product every matmul, dot_general and their backward rules reach.
// Implementations: gemm_onednn.cpp (when built with oneDNN) and gemm_eigen.cpp.
#pragma once

#include <linum/core/array.hpp>

namespace linum::kernels {

// out[i] = op(a[i]) @ op(b[i]) for stacked matrices; op transposes when asked (read through
// strides, never copied). Rank 2 operands are a batch of one; rank 3 are [batch, rows, cols].
// `a` is [.., M, K] (or [.., K, M] when ta), `b` is [.., K, N] (or [.., N, K] when tb). a and b
// have the same float dtype, which the result gets; accumulation is float32.
Array batched_gemm(const Array& a, const Array& b, bool ta, bool tb);

Array batched_gemm_eigen(const Array& a, const Array& b, bool ta, bool tb);
#if LINUM_HAVE_ONEDNN
Array batched_gemm_onednn(const Array& a, const Array& b, bool ta, bool tb);
#endif

// Products with fewer multiply-adds than this run on the calling thread only (waking the team
// costs more than it saves, and on a busy machine it stalls the step).
constexpr double kParallelGemmWork = 4.0 * 1024 * 1024;

}  // namespace linum::kernels
