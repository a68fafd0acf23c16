// The functional autodiff API, in the style of JAX: transformations that take a function and
// return a function.
//
//   auto loss = [](const Array& w, const Array& x) { return linum::mean(linum::square(linum::matmul(x, w))); };
//   auto [value, dw] = linum::value_and_grad(loss)(w, x);            // gradient w.r.t. argument 0
//   auto [v, grads] = linum::value_and_grad<0, 1>(loss)(w, x);       // std::tuple of both gradients
//   auto [y, pullback] = linum::vjp(f, w, x);  auto [dw, dx] = pullback(ct);
//
// Differentiated arguments may be Arrays or any type with a `Differentiable<T>` specialisation
// (Tree, the variable dict, has one). Other arguments pass through untouched. Differentiation
// always records, even inside a NoGradGuard; a NoGradGuard *inside* the function still stops it.
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/autodiff/graph.hpp>
#include <linum/core/autodiff/pytree.hpp>

#include <array>
#include <cstddef>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace linum {

namespace autodiff {
// The gradient a sweep left on one tracked leaf, in the leaf's dtype (zeros of that dtype if
// nothing reached it; int zeros for an integer leaf, which is never tracked).
inline Array leaf_gradient(const Array& tracked) {
  if (!tracked.defined()) return tracked;
  if (!is_floating(tracked.dtype())) return Array::zeros(tracked.shape(), tracked.dtype());
  Array g = tracked.node() ? tracked.node()->take_grad(tracked.output_index()) : Array();
  return g.defined() ? g : Array::zeros(tracked.shape(), tracked.dtype());
}
}  // namespace autodiff

// How to differentiate with respect to a value of type T: attach fresh leaves to its arrays (track)
// and collect their gradients afterwards. One protocol for every container: any pytree
// (core/autodiff/pytree.hpp: Array, Tree, std::vector, std::pair, std::tuple, and user structs
// registered once with pytree::Fields) is differentiable, with these dtype rules:
//   - every floating leaf (float32, bfloat16, and any float dtype to come) is differentiated, and
//     its gradient has the leaf's dtype (zeros of that dtype when nothing reached it);
//   - an integer leaf inside a container is a constant: its "gradient" is an int32 array of zeros
//     of its shape (JAX's float0 zeros under allow_int=True), never a float that silently stays 0;
//   - an integer Array passed as the whole differentiated argument is an error, as in JAX (its
//     gradient would carry nothing): pass it as a non-differentiated argument.
template <class T>
struct Differentiable {
  static T track(const T& value) {
    std::vector<Array> arrays = pytree::flatten(value);
    for (Array& a : arrays)
      if (a.defined() && is_floating(a.dtype())) a = autodiff::make_leaf(a);
    return pytree::rebuild(value, std::span<const Array>(arrays));
  }
  static T gradient(const T& tracked) {
    std::vector<Array> arrays = pytree::flatten(tracked);
    for (Array& a : arrays) a = autodiff::leaf_gradient(a);
    return pytree::rebuild(tracked, std::span<const Array>(arrays));
  }
};

template <>
struct Differentiable<Array> {
  static Array track(const Array& x) { return autodiff::make_leaf(x); }  // refuses integer arrays
  static Array gradient(const Array& tracked) { return autodiff::leaf_gradient(tracked); }
};

template <class T>
concept DifferentiableValue = pytree::is_pytree_v<std::decay_t<T>>;

namespace autodiff {

// Turns recording on for its lifetime (used by the transformations).
class EnableGradGuard {
 public:
  EnableGradGuard() = default;

 private:
  detail::Recording::Entry on_{true};
};

namespace detail {

template <std::size_t I, std::size_t... Nums>
constexpr bool contains() {
  return ((I == Nums) || ...);
}

template <std::size_t... Nums, class... Args, std::size_t... Is>
auto track_selected(std::index_sequence<Is...>, const Args&... args) {
  return std::tuple<std::conditional_t<contains<Is, Nums...>(), std::decay_t<Args>, const Args&>...>(
      [&]() -> decltype(auto) {
        if constexpr (contains<Is, Nums...>()) {
          static_assert(DifferentiableValue<Args>,
                        "value_and_grad/grad: the selected argument's type cannot be differentiated; select "
                        "pytree arguments (Array, Tree, containers of them, structs registered with "
                        "pytree::Fields) with the template argnums, e.g. value_and_grad<0, 2>(f)");
          return Differentiable<std::decay_t<Args>>::track(args);
        } else {
          return args;
        }
      }()...);
}

inline Array check_scalar_loss(const Array& value, const char* api) {
  if (!value.defined() || value.numel() != 1 || !is_floating(value.dtype()))
    throw AutodiffError(linum::detail::cat(api, ": the function must return a float scalar (one element), got ",
                                           value.type_str(),
                                           "; reduce it first (e.g. mean), or use vjp for non-scalar outputs"));
  return value;
}

template <class Tuple, std::size_t... Nums>
auto collect_gradients(const Tuple& tracked) {
  if constexpr (sizeof...(Nums) == 1) {
    constexpr std::size_t n = (Nums, ...);
    using T = std::decay_t<std::tuple_element_t<n, Tuple>>;
    return Differentiable<T>::gradient(std::get<n>(tracked));
  } else {
    return std::make_tuple(
        Differentiable<std::decay_t<std::tuple_element_t<Nums, Tuple>>>::gradient(std::get<Nums>(tracked))...);
  }
}

}  // namespace detail
}  // namespace autodiff

namespace pytree {
// `value` with every array detached from the graph (same structure; other members unchanged).
template <class T>
T detached(const T& value) {
  std::vector<Array> arrays = pytree::flatten(value);
  for (Array& a : arrays) a = a.detached();
  return pytree::rebuild(value, std::span<const Array>(arrays));
}
}  // namespace pytree

namespace autodiff {
namespace detail {

template <class T>
T detach_value(const T& v) {
  return pytree::detached(v);
}

template <class F, std::size_t... Nums>
struct ValueAndGrad {
  F f;
  bool has_aux;

  template <class... Args>
  auto operator()(const Args&... args) const {
    static_assert(sizeof...(Nums) > 0, "value_and_grad: select at least one argument");
    static_assert(((Nums < sizeof...(Args)) && ...),
                  "value_and_grad: an argnum is out of range (argnums count from 0, the first argument)");
    EnableGradGuard recording;
    auto tracked = track_selected<Nums...>(std::index_sequence_for<Args...>{}, args...);
    auto result = std::apply(f, tracked);
    if constexpr (std::is_same_v<std::decay_t<decltype(result)>, Array>) {
      Array value = check_scalar_loss(result, "value_and_grad");
      Array one = Array::full(value.shape(), 1.0f, value.dtype());
      autodiff::backward(std::span<const Array>(&value, 1), std::span<const Array>(&one, 1));
      return std::make_pair(value.detached(), collect_gradients<decltype(tracked), Nums...>(tracked));
    } else {
      // has_aux: f returns (loss, aux); aux comes back detached from the graph.
      Array value = check_scalar_loss(std::get<0>(result), "value_and_grad");
      auto aux = detach_value(std::get<1>(result));
      Array one = Array::full(value.shape(), 1.0f, value.dtype());
      autodiff::backward(std::span<const Array>(&value, 1), std::span<const Array>(&one, 1));
      return std::make_tuple(value.detached(), std::move(aux), collect_gradients<decltype(tracked), Nums...>(tracked));
    }
  }
};

}  // namespace detail
}  // namespace autodiff

// value_and_grad<argnums...>(f)(args...) -> (value, gradient) with one argnum (default 0), or
// (value, std::tuple of gradients) with several. If f returns std::pair<Array, Aux> the result is
// (value, aux, gradients): the auxiliary output (e.g. updated batch statistics) is not differentiated.
// The graph is freed as the backward sweep runs.
template <std::size_t... Argnums, class F>
auto value_and_grad(F f) {
  if constexpr (sizeof...(Argnums) == 0) return autodiff::detail::ValueAndGrad<F, 0>{std::move(f), false};
  else return autodiff::detail::ValueAndGrad<F, Argnums...>{std::move(f), false};
}

// grad<argnums...>(f)(args...) -> the gradient(s) only.
template <std::size_t... Argnums, class F>
auto grad(F f) {
  auto vg = value_and_grad<Argnums...>(std::move(f));
  return [vg](const auto&... args) {
    auto r = vg(args...);
    if constexpr (std::tuple_size_v<decltype(r)> == 2) return std::get<1>(std::move(r));
    else return std::get<2>(std::move(r));
  };
}

// A pullback returned by vjp: call it with the output's cotangent to get the cotangents of every
// argument (a std::tuple, or the single cotangent for a one-argument function). It keeps its
// graph, so it can be called several times; the graph is freed with the pullback.
template <class Out, class... Args>
class Pullback {
 public:
  Pullback(Out out, std::tuple<Args...> tracked) : out_(std::move(out)), tracked_(std::move(tracked)) {}

  auto operator()(const Out& cotangent) const {
    std::vector<Array> roots = pytree::flatten(out_), cts = pytree::flatten(cotangent);
    if (roots.size() != cts.size())
      throw AutodiffError(linum::detail::cat("vjp pullback: the cotangent has ", cts.size(), " arrays, the output has ",
                                             roots.size()));
    autodiff::backward(roots, cts, /*retain_graph=*/true);
    return collect(std::index_sequence_for<Args...>{});
  }

 private:
  template <std::size_t... Is>
  auto collect(std::index_sequence<Is...>) const {
    if constexpr (sizeof...(Is) == 1) return Differentiable<Args...>::gradient(std::get<0>(tracked_));
    else return std::make_tuple(Differentiable<Args>::gradient(std::get<Is>(tracked_))...);
  }
  Out out_;
  std::tuple<Args...> tracked_;
};

// vjp(f, args...) -> (f(args...), pullback). Every argument is differentiated.
template <class F, class... Args>
auto vjp(F&& f, const Args&... args) {
  static_assert((DifferentiableValue<Args> && ...), "vjp: every argument must be a pytree (Array, Tree, containers of them, structs registered with pytree::Fields)");
  autodiff::EnableGradGuard recording;
  std::tuple<std::decay_t<Args>...> tracked{Differentiable<std::decay_t<Args>>::track(args)...};
  auto out = std::apply(std::forward<F>(f), tracked);
  using Out = std::decay_t<decltype(out)>;
  auto detached = pytree::detached(out);
  return std::make_pair(std::move(detached), Pullback<Out, std::decay_t<Args>...>(std::move(out), std::move(tracked)));
}

}  // namespace linum
