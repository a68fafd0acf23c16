// Forward mode: jvp(f, primals, tangents) -> (f(primals), J tangents), as jax.jvp, and jacfwd.
//
//   auto [y, dy] = linum::jvp(f, x, v);                                    // one argument
//   auto [y, dy] = linum::jvp(f, std::tuple{x, w}, std::tuple{vx, vw});   // several
//
// Computed by transposition, exactly: the pullback u -> J^T u is built as a differentiable (linear)
// function of a cotangent u (create-graph mode), and J v is its gradient with respect to u in the
// direction v. It costs a forward pass and two backward passes, and works wherever second
// derivatives do (every op; an op whose rule cannot be differentiated is an AutodiffError naming
// it). jvp composes like the other transformations: jvp of grad is a Hessian-vector product
// (forward over reverse), grad of jvp differentiates a directional derivative.
#pragma once

#include <linum/core/autodiff/grad.hpp>

#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace linum {

namespace autodiff::detail {

template <class T>
struct is_tuple : std::false_type {};
template <class... Ts>
struct is_tuple<std::tuple<Ts...>> : std::true_type {};

// The arrays of `tangents` in flatten order, checked against the primals' (same count and shapes).
std::vector<Array> flat_tangents(const std::vector<Array>& primals, const std::vector<Array>& tangents, const char* api);

// J^T u built as a function of fresh leaves u (one per differentiable output), then J v by a second
// sweep to u: the tangents of `roots` for the primals tracked at `boundaries` moving along `v`.
std::vector<Array> jvp_by_transposition(const std::vector<Array>& roots, const std::vector<Boundary>& boundaries,
                                        const std::vector<Array>& v, bool nested);

template <class F, class... Ps>
auto jvp_tuple(F&& f, const std::tuple<Ps...>& primals, const std::tuple<Ps...>& tangents) {
  static_assert((DifferentiableValue<Ps> && ...), "jvp: every primal must be a pytree (Array, Tree, containers of them, "
                                                   "structs registered with pytree::Fields)");
  const bool nested = nested_here();
  EnableGradGuard recording;
  std::tuple<std::decay_t<Ps>...> tracked =
      std::apply([](const auto&... p) { return std::tuple<std::decay_t<Ps>...>{track_nested(p)...}; }, primals);
  std::vector<Boundary> boundaries;
  std::apply([&](const auto&... t) { (boundaries_of(t, boundaries), ...); }, tracked);
  auto out = [&] {
    DifferentiationScope depth;
    return std::apply(std::forward<F>(f), tracked);
  }();
  using Out = std::decay_t<decltype(out)>;
  // The tangents of the tracked (floating) primal arrays, in the boundaries' order.
  std::vector<Array> flat_p, flat_t;
  std::apply([&](const auto&... p) { (pytree::flatten_into(p, flat_p), ...); }, tracked);
  std::apply([&](const auto&... t) { (pytree::flatten_into(t, flat_t), ...); }, tangents);
  std::vector<Array> v = flat_tangents(flat_p, flat_t, "jvp");
  const std::vector<Array> roots = pytree::flatten(out);
  std::vector<Array> dy = jvp_by_transposition(roots, boundaries, v, nested);
  Out tangent_out = pytree::rebuild(out, std::span<const Array>(dy));
  if (nested) return std::make_pair(std::move(out), std::move(tangent_out));
  return std::make_pair(pytree::detached(out), pytree::detached(tangent_out));
}

}  // namespace autodiff::detail

// jvp(f, primals, tangents) -> (f(primals...), tangent of the output): with std::tuples, f takes
// the tuple's elements as its arguments (jax.jvp's tuples); otherwise f takes the one primal.
// Tangents have the primals' structure and shapes (integer leaves are ignored).
template <class F, class... Ps>
auto jvp(F&& f, const std::tuple<Ps...>& primals, const std::tuple<Ps...>& tangents) {
  return autodiff::detail::jvp_tuple(std::forward<F>(f), primals, tangents);
}
template <class F, class P>
  requires(!autodiff::detail::is_tuple<std::decay_t<P>>::value)
auto jvp(F&& f, const P& primal, const P& tangent) {
  return autodiff::detail::jvp_tuple(std::forward<F>(f), std::tuple<P>(primal), std::tuple<P>(tangent));
}

}  // namespace linum
