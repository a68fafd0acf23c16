// Internal: the batched matrix product every matmul, dot_general and their backward rules reach.
// Implementations: gemm_onednn.cpp (when built with oneDNN) and gemm_eigen.cpp.
#pragma once

#include <linum/core/array.hpp>

#include <cstdint>

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

// C = alpha * op(A) @ op(B) + beta * C on float32 row-major matrices with row strides lda, ldb,
// ldc (op transposes when asked: A is [m, k], or [k, m] when ta), on the calling thread only. For
// fused kernels that run their own parallel loop (attention); the result depends only on the
// operands' values, shapes and strides, never on the thread, so recomputation is bitwise.
void gemm_f32_serial(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
                     std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc);
void gemm_f32_serial_eigen(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
                           std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc);
#if LINUM_HAVE_ONEDNN
void gemm_f32_serial_onednn(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                            const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
                            std::int64_t ldc);
#endif

// Products with fewer multiply-adds than this run on the calling thread only (waking the team
// costs more than it saves, and on a busy machine it stalls the step).
constexpr double kParallelGemmWork = 4.0 * 1024 * 1024;

}  // namespace linum::kernels
