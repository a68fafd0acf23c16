// Jacobians, Hessians and Hessian-vector products, as JAX's jacrev, jacfwd, hessian and the hvp
// recipes; they are compositions of grad, vjp and jvp (core/autodiff/grad.hpp, jvp.hpp), so they
// nest and go through checkpoint policies, remat and scan like those.
//
//   Array J = linum::jacrev(f)(x);          // shape f(x).shape + x.shape, one pullback per output element
//   Array J = linum::jacfwd(f)(x);          // the same, one jvp per input element
//   Array H = linum::hessian(f)(x);         // scalar f: shape x.shape + x.shape
//   auto Hv = linum::hvp(f, x, v);          // H v without forming H (reverse over reverse), x and v pytrees
//
// jacrev and jacfwd take a pytree x (the Jacobian has x's structure, each leaf of shape
// f(x).shape + leaf.shape); jacfwd's function returns one Array, jacrev's any pytree.
#pragma once

#include <linum/core/autodiff/grad.hpp>
#include <linum/core/autodiff/jvp.hpp>
#include <linum/core/ops/reduce.hpp>
#include <linum/core/ops/shape_ops.hpp>

#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

namespace linum {

namespace autodiff::detail {
// An array of `shape` and `dtype` with 1 at flat index i and 0 elsewhere.
Array basis_vector(const Shape& shape, DType dtype, std::int64_t i);
// rows[k] stacked along a new leading axis and viewed as lead + each row's shape.
Array stack_as(const std::vector<Array>& rows, const Shape& lead, const Shape& row_shape, DType dtype);
// The sum over leaves of <a, b>, in float32 (for Hessian-vector products over pytrees).
Array tree_vdot(const std::vector<Array>& a, const std::vector<Array>& b);
}  // namespace autodiff::detail

// The Jacobian by reverse mode: row i is the pullback of the i-th basis cotangent. For a function
// returning one Array: x's structure, each leaf of shape f(x).shape + leaf.shape. For a function
// returning a pytree (a gradient, say): a std::vector with one such x-structured Jacobian per output
// array, in the output's flatten order (JAX nests them in the output's structure).
template <class F>
auto jacrev(F f) {
  return [f](const auto& x) {
    using X = std::decay_t<decltype(x)>;
    auto [y, pullback] = vjp(f, x);
    using Y = std::decay_t<decltype(y)>;
    const std::vector<Array> leaves = pytree::flatten(x), outs = pytree::flatten(y);
    std::vector<X> per_output;
    for (std::size_t o = 0; o < outs.size(); ++o) {
      std::vector<std::vector<Array>> rows(leaves.size());
      for (std::int64_t i = 0; i < outs[o].numel(); ++i) {
        std::vector<Array> cts(outs.size());
        for (std::size_t m = 0; m < outs.size(); ++m)
          cts[m] = m == o ? autodiff::detail::basis_vector(outs[m].shape(), outs[m].dtype(), i)
                          : Array::zeros(outs[m].shape(), outs[m].dtype());
        const std::vector<Array> g = pytree::flatten(pullback(pytree::rebuild(y, std::span<const Array>(cts))));
        for (std::size_t k = 0; k < leaves.size(); ++k) rows[k].push_back(g[k]);
      }
      std::vector<Array> jac(leaves.size());
      for (std::size_t k = 0; k < leaves.size(); ++k)
        jac[k] = autodiff::detail::stack_as(rows[k], outs[o].shape(), leaves[k].shape(),
                                            is_floating(leaves[k].dtype()) ? leaves[k].dtype() : DType::i32);
      per_output.push_back(pytree::rebuild(static_cast<const X&>(x), std::span<const Array>(jac)));
    }
    if constexpr (std::is_same_v<Y, Array>) return per_output.at(0);
    else return per_output;
  };
}

// The Jacobian by forward mode: column j (per leaf) is the jvp along the j-th basis tangent.
template <class F>
auto jacfwd(F f) {
  return [f](const auto& x) {
    using X = std::decay_t<decltype(x)>;
    const std::vector<Array> leaves = pytree::flatten(x);
    Shape out_shape;
    std::vector<Array> jac(leaves.size());
    for (std::size_t k = 0; k < leaves.size(); ++k) {
      std::vector<Array> columns;
      for (std::int64_t j = 0; j < (is_floating(leaves[k].dtype()) ? leaves[k].numel() : 0); ++j) {
        std::vector<Array> t(leaves.size());
        for (std::size_t m = 0; m < leaves.size(); ++m)
          t[m] = m == k ? autodiff::detail::basis_vector(leaves[m].shape(), leaves[m].dtype(), j)
                        : Array::zeros(leaves[m].shape(), leaves[m].dtype());
        auto [y, dy] = jvp(f, x, pytree::rebuild(static_cast<const X&>(x), std::span<const Array>(t)));
        static_assert(std::is_same_v<std::decay_t<decltype(y)>, Array>, "jacfwd: f must return one Array");
        out_shape = y.shape();
        columns.push_back(dy);
      }
      if (columns.empty()) {  // an integer leaf, or an empty one: zeros
        if (out_shape.rank() == 0 && leaves.size() > 0) out_shape = f(x).shape();
        Shape full = out_shape;
        for (std::int64_t d : leaves[k].shape()) full.push_back(d);
        jac[k] = Array::zeros(full, is_floating(leaves[k].dtype()) ? leaves[k].dtype() : DType::i32);
        continue;
      }
      // columns[j] has the output's shape: stacked as [x.numel, out...], then moved behind the output axes.
      const Array stacked = autodiff::detail::stack_as(columns, leaves[k].shape(), out_shape, columns[0].dtype());
      std::vector<int> perm;
      const int xr = leaves[k].rank(), yr = out_shape.rank();
      for (int a = 0; a < yr; ++a) perm.push_back(xr + a);
      for (int a = 0; a < xr; ++a) perm.push_back(a);
      jac[k] = transpose(stacked, perm);
    }
    return pytree::rebuild(static_cast<const X&>(x), std::span<const Array>(jac));
  };
}

// The Hessian of a scalar function: the Jacobian of its gradient (reverse over reverse). For an Array
// x: shape x.shape + x.shape; for a pytree x: a std::vector over x's arrays (in flatten order) of
// x-structured blocks, block [i] leaf j of shape x_i.shape + x_j.shape.
template <class F>
auto hessian(F f) {
  return jacrev([f](const auto& x) { return grad(f)(x); });
}

// H v for a scalar f at x (pytrees of the same structure): the gradient of <grad f, v>, reverse
// over reverse (for forward over reverse write jvp(grad(f), x, v)).
template <class F, class X>
X hvp(F f, const X& x, const X& v) {
  return grad([&](const X& at) { return autodiff::detail::tree_vdot(pytree::flatten(grad(f)(at)), pytree::flatten(v)); })(x);
}

}  // namespace linum
