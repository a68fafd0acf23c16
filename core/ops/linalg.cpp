// matmul and dot_general. One primitive, a batched GEMM (core/kernels/gemm.hpp: oneDNN or Eigen) with
// its backward rule; everything else
// (promotion of 1-D operands, batch broadcasting, dot_general's axis bookkeeping) is composed from
// reshape/transpose/broadcast_to, whose gradients are their own.
#include <linum/core/ops/kind.hpp>
#include <linum/core/ops/batching.hpp>
#include <linum/core/ops/linalg.hpp>
#include <linum/core/autodiff/primitive.hpp>
#include <linum/core/kernels/gemm.hpp>
#include <linum/core/ops/kernel_util.hpp>
#include <linum/core/ops/shape_ops.hpp>
#include <linum/core/ops/elementwise.hpp>


namespace linum {
namespace {

using autodiff::Cotangents;
using autodiff::needs_grad;

Array gemm(const Array& a, const Array& b, bool ta, bool tb) { return kernels::batched_gemm(a, b, ta, tb); }

// op(a) op(b), op a transpose where asked, as a primitive for create-graph rules (no transposed copies):
// its gradients are products of the same kind (dA = G op(B)^T or op(B) G^T, dB likewise), so it is
// differentiable to any order. [M,K]/[B,M,K] layouts as the kernel's.
Array gemm_op(const Array& a, const Array& b, bool ta, bool tb) {
  return autodiff::primitive(a.rank() == 3 ? ops::kind::batched_matmul : ops::kind::matmul, {&a, &b},
                             [&](autodiff::Residuals& r) {
                               if (r.recording()) r.keep(b.node() ? a : Array(), a.node() ? b : Array());
                               return gemm(a, b, ta, tb);
                             },
                             autodiff::higher_order([ta, tb](Cotangents& c, autodiff::Saved s) {
                               const Array& g = c.out();
                               if (c.needs(0)) c.set(0, ta ? gemm_op(s[1], g, tb, true) : gemm_op(g, s[1], false, !tb));
                               if (c.needs(1)) c.set(1, tb ? gemm_op(g, s[0], true, ta) : gemm_op(s[0], g, !ta, false));
                             }));
}

// The primitive: [M,K]@[K,N] ("matmul", a product without batch dimensions) or
// [B,M,K]@[B,K,N] ("batched_matmul"). The result is viewed as `out_shape`, the op's real output
// shape (e.g. [batch, tokens, features] for a Dense on a sequence), which is what remat policies and
// residual reports see.
// ta / tb: the operand is stored transposed ([K,M] / [B,K,M] for a, [N,K] / [B,N,K] for b) and read
// through strides (dot_general contracting a leading axis, or a trailing one of the right operand):
// the kernel reads it in place, where a transposed copy would cost a pass over the operand (for the
// [2048, 512] operands of a weight gradient, more than the product: 1.9 against 1.1 ms in bf16).
// The gradients are products of the same kind, each in its operand's stored layout.
Array mm(const Array& a, const Array& b, const Shape& out_shape, bool ta = false, bool tb = false) {
  const int r = a.rank();
  const Shape product = r == 3 ? Shape{a.dim(0), a.dim(ta ? 2 : 1), b.dim(tb ? 1 : 2)}
                               : Shape{a.dim(ta ? 1 : 0), b.dim(tb ? 0 : 1)};
  return autodiff::primitive(r == 3 ? ops::kind::batched_matmul : ops::kind::matmul, {&a, &b},
                             [&](autodiff::Residuals& res) {
                               if (res.recording()) res.keep(b.node() ? a : Array(), a.node() ? b : Array());
                               return gemm(a, b, ta, tb).with_shape(out_shape);
                             },
                             autodiff::higher_order([product, ta, tb](Cotangents& c, autodiff::Saved s) {
                               // dA = G op(B)^T, stored transposed when ta: op(B) G^T; dB = op(A)^T G,
                               // stored transposed when tb: G^T op(A) (gemm_op's rule).
                               if (autodiff::creating_graph()) {  // the same products as primitives, which record
                                 const Array g = reshape(c.out(), product.vec());
                                 if (c.needs(0)) c.set(0, ta ? gemm_op(s[1], g, tb, true) : gemm_op(g, s[1], false, !tb));
                                 if (c.needs(1)) c.set(1, tb ? gemm_op(g, s[0], true, ta) : gemm_op(s[0], g, !ta, false));
                                 return;
                               }
                               const Array g = c.out().with_shape(product);
                               if (c.needs(0)) c.set(0, ta ? gemm(s[1], g, tb, true) : gemm(g, s[1], false, !tb));
                               if (c.needs(1)) c.set(1, tb ? gemm(g, s[0], true, ta) : gemm(s[0], g, !ta, false));
                             }));
}

std::string dims_str(const std::vector<int>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(v[i]);
  }
  return s + "]";
}

// vmap, per-example gradients: a [..., K] @ w [K, M] with `a` batched at `levels` and w repeated
// along them (grad inside vmap made it so: its gradient is per example). The forward is one product
// on w's one example, as without vmap; the rule gives a's gradient by one product and w's per
// example, [levels..., K, M], by one batched product (no copy of w per example).
Array matmul_repeated_rhs(const Array& a, const Array& w_repeated, std::span<const BatchLevel> levels_in) {
  const std::vector<BatchLevel> levels(levels_in.begin(), levels_in.end());
  const Array w = w_repeated.repeated_example();
  Array handle = w;  // w's data, and the edge to w's own (per-example) node
  if (w_repeated.node() != nullptr) handle.set_node(w_repeated.node(), w_repeated.output_index());
  std::int64_t n = 1;
  for (const BatchLevel& l : levels) n *= l.size;
  const std::int64_t k = w.dim(0), m = w.dim(1), rows = a.numel() / std::max<std::int64_t>(k, 1);
  std::vector<std::int64_t> out = a.shape().vec();
  out.back() = m;
  const Shape out_shape(out), a_shape = a.shape(), w_physical = w_repeated.physical_shape();
  return autodiff::primitive(
      ops::kind::matmul, {&a, &handle},
      [&](autodiff::Residuals& r) {
        if (r.recording()) r.keep(handle.node() ? a : Array(), a.node() ? w : Array());
        return gemm(a.with_shape(Shape{rows, k}), w, false, false).with_shape(out_shape);
      },
      autodiff::higher_order([=](Cotangents& c, autodiff::Saved s) {
        const std::int64_t per = rows / n;
        if (autodiff::creating_graph()) {  // the same with ops on w copied per example (linked to its node)
          const Array g3 = reshape(c.out(), {n, per, m});
          if (c.needs(0)) {
            Array wr = Array::repeated_view(s[1].detached(), levels);
            wr.set_node(s[1].node(), s[1].output_index());
            c.set(0, reshape(gemm_op(g3, reshape(wr.physical(), {n, k, m}), false, true), a_shape.vec()));
          }
          if (c.needs(1)) c.set(1, reshape(gemm_op(reshape(s[0], {n, per, k}), g3, true, false), w_physical.vec()));
          return;
        }
        const Array g = c.out();
        if (c.needs(0)) c.set(0, gemm(g.with_shape(Shape{rows, m}), s[1], false, true).with_shape(a_shape));
        if (c.needs(1)) c.set(1, gemm(s[0].with_shape(Shape{n, per, k}), g.with_shape(Shape{n, per, m}), true, false).with_shape(w_physical));
      }));
}

}  // namespace

// Both operands in their promoted dtype (bf16 with f32 computes in f32, as JAX).
static std::pair<Array, Array> promoted(const Array& a, const Array& b) {
  const DType t = promote_types(a.dtype(), a.weak_type(), b.dtype(), b.weak_type());
  return {astype(a, t), astype(b, t)};
}

Array matmul(const Array& a_orig, const Array& b_orig) {
  ops::detail::require_float(a_orig, "matmul");
  ops::detail::require_float(b_orig, "matmul");
  const auto [a_in, b_in] = promoted(a_orig, b_orig);
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
  if (a.batched() || b.batched()) [[unlikely]] {
    // vmap: the levels are leading batch axes of the physical product. With b the same for every
    // example, one [levels * ... * M, K] @ [K, N] product; otherwise a batched product (an operand
    // that lacks a level broadcasts along it).
    const std::vector<BatchLevel> levels = ops::batching::levels_of({&a, &b}, "matmul");
    if (!b.batched() && b.rank() == 2) {
      y = ops::batching::wrap(matmul(a.physical(), b), a.batch_levels());
    } else if (b.repeated() && !a.repeated() && b.rank() == 2 && a.batch_levels().size() == levels.size()) {
      y = ops::batching::wrap(matmul_repeated_rhs(a.physical(), b, levels), levels);  // per-example gradients
    } else {
      const int rank = std::max(a.rank(), b.rank());
      y = ops::batching::wrap(matmul(ops::batching::aligned(a, levels, rank), ops::batching::aligned(b, levels, rank)), levels);
    }
  } else if (a.rank() == 2 && b.rank() == 2) {
    y = mm(a, b, Shape{m, n});
  } else if (b.rank() == 2) {
    // [..., M, K] @ [K, N] contracts without batch dimensions (as jnp.matmul's dot_general does):
    // one [prod(...) * M, K] @ [K, N] product, no copies of b.
    std::vector<std::int64_t> out = a.shape().vec();
    out.back() = n;
    y = mm(reshape(a, {-1, k}), b, Shape(out));
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
    y = mm(a3, b3, Shape(out));
  }
  if (a_vec || b_vec) {
    std::vector<std::int64_t> d = y.shape().vec();
    if (b_vec) d.erase(d.end() - 1);
    if (a_vec) d.erase(d.end() - 1 - (b_vec ? 0 : 1));
    y = reshape(y, d);
  }
  return y;
}

Array dot_general(const Array& lhs_orig, const Array& rhs_orig, const DotDims& dims) {
  ops::detail::require_float(lhs_orig, "dot_general");
  ops::detail::require_float(rhs_orig, "dot_general");
  const auto promoted_pair = promoted(lhs_orig, rhs_orig);
  const Array& lhs = promoted_pair.first;  // references, not a structured binding: the lambdas below capture them (clang 14)
  const Array& rhs = promoted_pair.second;
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
  if (lhs.batched() || rhs.batched()) [[unlikely]] {
    const std::vector<BatchLevel> levels = ops::batching::levels_of({&lhs, &rhs}, "dot_general");
    // A Dense inside vmap(grad): per-example inputs times a kernel repeated per example.
    const auto lhs_levels = lhs.batch_levels();
    if (rhs.repeated() && !lhs.repeated() && rhs.rank() == 2 && lb.empty() && rbt.empty() && rc == std::vector<int>{0} &&
        lc == std::vector<int>{lhs.rank() - 1} && lhs_levels.size() == levels.size() && lhs.rank() >= 1)
      return ops::batching::wrap(matmul_repeated_rhs(lhs.physical(), rhs, levels), levels);
    // vmap: the levels become leading batch axes of both operands (the result's batch axes come first).
    const int nl = static_cast<int>(levels.size());
    DotDims pd;
    for (int i = 0; i < nl; ++i) {
      pd.lhs_batch.push_back(i);
      pd.rhs_batch.push_back(i);
    }
    for (int a : lb) pd.lhs_batch.push_back(a + nl);
    for (int a : rbt) pd.rhs_batch.push_back(a + nl);
    for (int a : lc) pd.lhs_contracting.push_back(a + nl);
    for (int a : rc) pd.rhs_contracting.push_back(a + nl);
    return ops::batching::wrap(
        dot_general(ops::batching::materialized(lhs, levels), ops::batching::materialized(rhs, levels), pd), levels);
  }
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
  // An operand already stored as [batch, contracting, free] (lhs) or [batch, free, contracting]
  // (rhs) is the kernel's operand transposed: read in place (mm's ta / tb), not copied.
  auto concat = [](std::vector<int> a, const std::vector<int>& b, const std::vector<int>& c) {
    a.insert(a.end(), b.begin(), b.end());
    a.insert(a.end(), c.begin(), c.end());
    return a;
  };
  const bool ta = !is_identity(lp) && is_identity(concat(lb, lc, lf));
  const bool tb = !is_identity(rp) && is_identity(concat(rbt, rf, rc));
  Array l = is_identity(lp) || ta ? lhs : transpose(lhs, lp);
  Array r = is_identity(rp) || tb ? rhs : transpose(rhs, rp);
  const std::vector<std::int64_t> l2 = ta ? std::vector<std::int64_t>{nk, nm} : std::vector<std::int64_t>{nm, nk};
  const std::vector<std::int64_t> r2 = tb ? std::vector<std::int64_t>{nn, nk} : std::vector<std::int64_t>{nk, nn};
  if (lb.empty())  // no batch dimensions: one 2-D product (what dots_with_no_batch_dims_saveable saves)
    return mm(reshape(l, l2), reshape(r, r2), Shape(out), ta, tb);
  return mm(reshape(l, {nb, l2[0], l2[1]}), reshape(r, {nb, r2[0], r2[1]}), Shape(out), ta, tb);
}

}  // namespace linum
