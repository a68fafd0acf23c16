// Matrix products on Eigen, with Linum's own threading (core/kernels/eigen_gemm_internal.hpp). bf16 operands are
// widened to float32 and the product rounded back.
#include <linum/core/kernels/gemm.hpp>
#include <linum/core/kernels/eigen_gemm_internal.hpp>

#include <Eigen/Core>

namespace linum::kernels {
namespace {
using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using CMap = Eigen::Map<const RowMat>;
using MMap = Eigen::Map<RowMat>;
}  // namespace

Array batched_gemm_eigen(const Array& a_in, const Array& b_in, bool ta, bool tb) {
  if (a_in.dtype() != DType::f32) {
    return linum::detail::convert_float(batched_gemm_eigen(linum::detail::convert_float(a_in, DType::f32),
                                                           linum::detail::convert_float(b_in, DType::f32), ta, tb),
                                        a_in.dtype());
  }
  const Array& a = a_in;
  const Array& b = b_in;
  const int ra = a.rank(), rb = b.rank();
  const std::int64_t batch = ra == 3 ? a.shape()[0] : 1;
  const std::int64_t a0 = a.shape()[ra - 2], a1 = a.shape()[ra - 1];
  const std::int64_t b0 = b.shape()[rb - 2], b1 = b.shape()[rb - 1];
  const std::int64_t m = ta ? a1 : a0, k = ta ? a0 : a1, n = tb ? b0 : b1;
  Shape out = ra == 3 ? Shape{batch, m, n} : Shape{m, n};
  Array y = Array::empty(out);
  for (std::int64_t i = 0; i < batch; ++i) {
    CMap A(a.data() + i * a0 * a1, a0, a1);
    CMap B(b.data() + i * b0 * b1, b0, b1);
    MMap C(y.mutable_data() + i * m * n, m, n);
    if (k == 0) { C.setZero(); continue; }
    if (!ta && !tb) kernels::detail::gemm_into(C, A, B);
    else if (ta && !tb) kernels::detail::gemm_into(C, A.transpose(), B);
    else if (!ta && tb) kernels::detail::gemm_into(C, A, B.transpose());
    else kernels::detail::gemm_into(C, A.transpose(), B.transpose());
  }
  return y;
}

void add_bias_rows(Array& y, const Array& bias) {
  const std::int64_t n = bias.numel(), rows = n == 0 ? 0 : y.numel() / n;
  if (y.dtype() == DType::f32) {
    const float* b = bias.data();
    float* out = y.mutable_data();
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t j = 0; j < n; ++j) out[r * n + j] += b[j];
    return;
  }
  const auto* b = static_cast<const bfloat16*>(bias.raw());
  auto* out = static_cast<bfloat16*>(y.mutable_raw());
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < n; ++j)
      out[r * n + j].bits = bfloat16::round_bits(static_cast<float>(out[r * n + j]) + static_cast<float>(b[j]));
}

Array gemm_bias_eigen(const Array& a, const Array& b, const Array& bias) {
  if (a.dtype() != DType::f32) {  // the bias added in float32, then one rounding (as oneDNN's epilogue)
    Array y = batched_gemm_eigen(linum::detail::convert_float(a, DType::f32), linum::detail::convert_float(b, DType::f32),
                                 false, false);
    add_bias_rows(y, linum::detail::convert_float(bias, DType::f32));
    return linum::detail::convert_float(y, a.dtype());
  }
  Array y = batched_gemm_eigen(a, b, false, false);
  add_bias_rows(y, bias);
  return y;
}

void gemm_f32_serial_eigen(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
                           std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  using Stride = Eigen::OuterStride<>;
  using CStrided = Eigen::Map<const RowMat, 0, Stride>;
  Eigen::Map<RowMat, 0, Stride> C(c, m, n, Stride(ldc));
  if (beta == 0.0f) C.setZero();
  else if (beta != 1.0f) C *= beta;
  if (m == 0 || n == 0 || k == 0) return;
  CStrided A(a, ta ? k : m, ta ? m : k, Stride(lda));
  CStrided B(b, tb ? n : k, tb ? k : n, Stride(ldb));
  // Eigen's product on the calling thread (its own parallelism is switched off by gemm_into).
  if (!ta && !tb) C.noalias() += alpha * (A * B);
  else if (ta && !tb) C.noalias() += alpha * (A.transpose() * B);
  else if (!ta && tb) C.noalias() += alpha * (A * B.transpose());
  else C.noalias() += alpha * (A.transpose() * B.transpose());
}

}  // namespace linum::kernels
