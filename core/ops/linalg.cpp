// matmul and dot_general. One primitive, a batched GEMM with its backward rule; everything else
// (promotion of 1-D operands, batch broadcasting, dot_general's axis bookkeeping) is composed from
// reshape/transpose/broadcast_to, whose gradients are their own.
#include <linum/core/ops/linalg.hpp>
#include <linum/core/autodiff/hooks.hpp>
#include <linum/core/ops/gemm.hpp>
#include <linum/core/ops/kernel_util.hpp>
#include <linum/core/ops/shape_ops.hpp>

#include <Eigen/Core>

namespace linum {
namespace {

using autodiff::Cotangents;
using autodiff::needs_grad;
using autodiff::record;
using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using CMap = Eigen::Map<const RowMat>;
using MMap = Eigen::Map<RowMat>;

// out[b] = op(a[b]) @ op(b[b]) for stacked matrices; op transposes when asked. Rank 2 inputs are a
// batch of one. `a` is [.., M, K] (or [.., K, M] when ta), `b` is [.., K, N] (or [.., N, K]).
Array gemm(const Array& a, const Array& b, bool ta, bool tb) {
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
    if (!ta && !tb) ops::detail::gemm_into(C, A, B);
    else if (ta && !tb) ops::detail::gemm_into(C, A.transpose(), B);
    else if (!ta && tb) ops::detail::gemm_into(C, A, B.transpose());
    else ops::detail::gemm_into(C, A.transpose(), B.transpose());
  }
  return y;
}

// The primitive: [M,K]@[K,N] or [B,M,K]@[B,K,N].
Array mm(const Array& a, const Array& b) {
  const bool recording = needs_grad(a, b);
  // A checkpoint replaying its block may hold this product from the forward pass (dots policies).
  const Array* saved = recording && autodiff::detail::t_record_hook ? autodiff::detail::peek_replayed_output() : nullptr;
  Array y = saved ? saved->detached() : gemm(a, b, false, false);
  if (recording) {
    Array keep_a = b.node() ? a.detached() : Array();
    Array keep_b = a.node() ? b.detached() : Array();
    record(a.rank() == 3 ? "batched_matmul" : "matmul", y, {&a, &b}, {keep_a, keep_b}, [](Cotangents& c, autodiff::Saved s) {
      if (c.needs(0)) c.set(0, gemm(c.out(), s[1], false, true));  // dA = G B^T
      if (c.needs(1)) c.set(1, gemm(s[0], c.out(), true, false));  // dB = A^T G
    });
  }
  return y;
}

std::string dims_str(const std::vector<int>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + "]";
}

}  // namespace

Array matmul(const Array& a_in, const Array& b_in) {
  ops::detail::require_f32(a_in, "matmul");
  ops::detail::require_f32(b_in, "matmul");
  if (a_in.rank() == 0 || b_in.rank() == 0)
    throw ShapeError(detail::cat("matmul: operands must have rank >= 1, got ", ops::detail::shapes_str({&a_in, &b_in}),
                                 "; use mul for scalars"));
  const bool a_vec = a_in.rank() == 1, b_vec = b_in.rank() == 1;
  Array a = a_vec ? reshape(a_in, {1, a_in.dim(0)}) : a_in;
  Array b = b_vec ? reshape(b_in, {b_in.dim(0), 1}) : b_in;
  const std::int64_t m = a.dim(-2), k = a.dim(-1), k2 = b.dim(-2), n = b.dim(-1);
  if (k != k2)
    throw ShapeError(detail::cat("matmul: contracting dimensions differ: ", ops::detail::shapes_str({&a_in, &b_in}),
                                 " (", k, " vs ", k2, ")"));
  Array y;
  if (a.rank() == 2 && b.rank() == 2) {
    y = mm(a, b);
  } else {
    // Broadcast the batch axes, flatten them into one, run the batched primitive, unflatten.
    Shape ba, bb;
    for (int i = 0; i < a.rank() - 2; ++i) ba.push_back(a.shape()[i]);
    for (int i = 0; i < b.rank() - 2; ++i) bb.push_back(b.shape()[i]);
    const Shape batch = ops::detail::broadcast_shapes(ba, bb, "matmul");
    Shape sa = batch, sb = batch;
    sa.push_back(m); sa.push_back(k);
    sb.push_back(k); sb.push_back(n);
    const std::int64_t nb = batch.numel();
    Array a3 = reshape(a.shape() == sa ? a : broadcast_to(a, sa), {nb, m, k});
    Array b3 = reshape(b.shape() == sb ? b : broadcast_to(b, sb), {nb, k, n});
    std::vector<std::int64_t> out = batch.vec();
    out.push_back(m);
    out.push_back(n);
    y = reshape(mm(a3, b3), out);
  }
  if (a_vec || b_vec) {
    std::vector<std::int64_t> d = y.shape().vec();
    if (b_vec) d.erase(d.end() - 1);
    if (a_vec) d.erase(d.end() - 1 - (b_vec ? 0 : 1));
    y = reshape(y, d);
  }
  return y;
}

Array dot_general(const Array& lhs, const Array& rhs, const DotDims& dims) {
  ops::detail::require_f32(lhs, "dot_general");
  ops::detail::require_f32(rhs, "dot_general");
  auto bad = [&](const std::string& why) {
    return ShapeError(detail::cat("dot_general: ", why, " (lhs ", lhs.shape(), ", rhs ", rhs.shape(),
                                  ", contracting ", dims_str(dims.lhs_contracting), "/", dims_str(dims.rhs_contracting),
                                  ", batch ", dims_str(dims.lhs_batch), "/", dims_str(dims.rhs_batch), ")"));
  };
  if (dims.lhs_contracting.size() != dims.rhs_contracting.size() || dims.lhs_batch.size() != dims.rhs_batch.size())
    throw bad("lhs and rhs need the same number of contracting and of batch axes");
  auto norm = [&](std::vector<int> v, int rank) {
    for (int& a : v) {
      if (a < 0) a += rank;
      if (a < 0 || a >= rank) throw bad("axis out of range");
    }
    return v;
  };
  const auto lc = norm(dims.lhs_contracting, lhs.rank()), rc = norm(dims.rhs_contracting, rhs.rank());
  const auto lb = norm(dims.lhs_batch, lhs.rank()), rbt = norm(dims.rhs_batch, rhs.rank());
  auto free_axes = [&](int rank, const std::vector<int>& c, const std::vector<int>& b) {
    std::vector<int> f;
    for (int i = 0; i < rank; ++i)
      if (std::find(c.begin(), c.end(), i) == c.end() && std::find(b.begin(), b.end(), i) == b.end()) f.push_back(i);
    if (static_cast<int>(f.size() + c.size() + b.size()) != rank) throw bad("an axis is listed twice");
    return f;
  };
  const auto lf = free_axes(lhs.rank(), lc, lb), rf = free_axes(rhs.rank(), rc, rbt);
  std::int64_t nb = 1, nk = 1, nm = 1, nn = 1;
  std::vector<std::int64_t> out;
  for (std::size_t i = 0; i < lb.size(); ++i) {
    if (lhs.shape()[lb[i]] != rhs.shape()[rbt[i]]) throw bad("batch dimensions differ");
    nb *= lhs.shape()[lb[i]];
    out.push_back(lhs.shape()[lb[i]]);
  }
  for (std::size_t i = 0; i < lc.size(); ++i) {
    if (lhs.shape()[lc[i]] != rhs.shape()[rc[i]]) throw bad("contracting dimensions differ");
    nk *= lhs.shape()[lc[i]];
  }
  for (int a : lf) { nm *= lhs.shape()[a]; out.push_back(lhs.shape()[a]); }
  for (int a : rf) { nn *= rhs.shape()[a]; out.push_back(rhs.shape()[a]); }
  // lhs -> [batch, free, contracting], rhs -> [batch, contracting, free].
  std::vector<int> lp = lb, rp = rbt;
  lp.insert(lp.end(), lf.begin(), lf.end());
  lp.insert(lp.end(), lc.begin(), lc.end());
  rp.insert(rp.end(), rc.begin(), rc.end());
  rp.insert(rp.end(), rf.begin(), rf.end());
  auto is_identity = [](const std::vector<int>& p) {
    for (std::size_t i = 0; i < p.size(); ++i) if (p[i] != static_cast<int>(i)) return false;
    return true;
  };
  Array l = is_identity(lp) ? lhs : transpose(lhs, lp);
  Array r = is_identity(rp) ? rhs : transpose(rhs, rp);
  Array y = mm(reshape(l, {nb, nm, nk}), reshape(r, {nb, nk, nn}));
  return reshape(y, out);
}

}  // namespace linum
