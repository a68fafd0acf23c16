// The functional autodiff API, in the style of JAX: transformations that take a function and
// return a function.
//
//   auto loss = [](const Array& w, const Array& x) { return linum::mean(linum::square(linum::matmul(x, w))); };
//   auto [value, dw] = linum::value_and_grad(loss)(w, x);            // gradient w.r.t. argument 0
//   auto [v, dw, dx] = linum::value_and_grad<0, 1>(loss)(w, x);      // one flat tuple: value, then each gradient
//   auto [v, aux, dw, dx] = linum::value_and_grad<0, 1>(loss_and_aux)(w, x);  // f returns std::pair(loss, aux)
//   auto [y, pullback] = linum::vjp(f, w, x);  auto [dw, dx] = pullback(ct);
//
// Differentiated arguments may be Arrays or any type with a `Differentiable<T>` specialisation
// (Tree, the variable dict, has one). Other arguments pass through untouched. Differentiation
// always records, even inside a NoGradGuard; a NoGradGuard *inside* the function still stops it.
//
// Transformations compose as JAX's do: grad(grad(f)), a grad or vjp inside the function another
// one differentiates (a gradient penalty, a physics-informed loss). Called inside another
// transformation's function, they build their gradient as a differentiable function of the
// arguments (PyTorch's create_graph), and return the value, aux and gradients linked to the
// enclosing graph. Ops whose backward rule cannot be differentiated raise an AutodiffError naming
// them. At top level nothing changes: the first-order path is the same as without nesting.
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/autodiff/batching.hpp>
#include <linum/core/autodiff/graph.hpp>
#include <linum/core/autodiff/pytree.hpp>

#include <algorithm>
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
  if (g.defined() && tracked.batched()) return Array::batched_view(g, tracked.batch_levels());  // per example (vmap)
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
// Inside vmap, the gradient is per example: every leaf is first batched at the open vmap levels
// (autodiff::to_open_levels), so its gradient is batched too.
template <class T>
struct Differentiable {
  static T track(const T& value) {
    std::vector<Array> arrays = pytree::flatten(value);
    for (Array& a : arrays)
      if (a.defined() && is_floating(a.dtype())) a = autodiff::make_leaf(autodiff::to_open_levels(a));
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
  static Array track(const Array& x) {  // refuses integer arrays
    return autodiff::make_leaf(is_floating(x.dtype()) ? autodiff::to_open_levels(x) : x);
  }
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

// value_and_grad's result, one flat structure: the value, the aux (when f returns one), then one
// gradient per argnum. One argnum without aux stays a std::pair (value, gradient).
template <std::size_t kArgnums, class Head, class Grads>
auto flat_result(Head head, Grads grads) {
  if constexpr (kArgnums > 1) {  // grads: a std::tuple, one per argnum (a tuple-valued argument's gradient is one)
    return std::tuple_cat(std::move(head), std::move(grads));
  } else if constexpr (std::tuple_size_v<Head> == 1) {
    return std::make_pair(std::get<0>(std::move(head)), std::move(grads));
  } else {
    return std::tuple_cat(std::move(head), std::make_tuple(std::move(grads)));
  }
}

// ---- nested differentiation (a transformation called inside another one's function) ----------

// Whether a transformation called here is nested in another one (whose graph its results must stay
// linked to): create-graph mode. Top-level calls (depth 0) take the first-order path unchanged.
inline bool nested_here() { return differentiation_depth() > 0 && is_recording(); }

// An array of an enclosing graph, continued through an identity node the inner sweep stops at.
Array link_input(const Array& x);

// Tracks the floating arrays of `value` for a nested transformation: an array already in a graph is
// linked through an identity node, others become fresh leaves (boundaries_of finds them again).
template <class T>
T track_nested(const T& value) {
  std::vector<Array> arrays = pytree::flatten(value);
  for (Array& a : arrays)
    if (a.defined() && is_floating(a.dtype())) {
      a = to_open_levels(a);
      a = a.node() != nullptr ? link_input(a) : make_leaf(a);
    }
  return pytree::rebuild(value, std::span<const Array>(arrays));
}

// The boundaries of the floating arrays of an already tracked value, appended.
template <class T>
void boundaries_of(const T& tracked, std::vector<Boundary>& boundaries) {
  for (const Array& a : pytree::flatten(tracked))
    if (a.defined() && is_floating(a.dtype()) && a.node() != nullptr) boundaries.push_back({a.node().get(), a.output_index()});
}

// The gradient of a tracked value from the sums a sweep left at its boundaries (consumed from
// `next` on, in flatten order): zeros where nothing arrived, int32 zeros for integer leaves.
template <class T>
T gradient_from_sums(const T& tracked, std::vector<Array>& sums, std::size_t& next) {
  std::vector<Array> arrays = pytree::flatten(tracked);
  for (Array& a : arrays) {
    if (!a.defined()) continue;
    if (!is_floating(a.dtype()) || a.node() == nullptr) {
      a = Array::zeros(a.shape(), is_floating(a.dtype()) ? a.dtype() : DType::i32);
      continue;
    }
    Array g = next < sums.size() ? std::move(sums[next]) : Array();
    ++next;
    if (g.defined() && a.batched()) g = Array::batched_view(g, a.batch_levels());  // per example (vmap)
    a = g.defined() ? g : Array::zeros(a.shape(), a.dtype());
  }
  return pytree::rebuild(tracked, std::span<const Array>(arrays));
}

// The arguments with the selected ones (Nums) tracked: as fresh leaves at top level, or linked to the
// enclosing graph when nested (kNested, see track_nested); the others passed through by reference.
template <bool kNested, std::size_t... Nums, class... Args, std::size_t... Is>
auto track_selected(std::index_sequence<Is...>, const Args&... args) {
  return std::tuple<std::conditional_t<contains<Is, Nums...>(), std::decay_t<Args>, const Args&>...>(
      [&]() -> decltype(auto) {
        if constexpr (contains<Is, Nums...>()) {
          static_assert(DifferentiableValue<Args>,
                        "value_and_grad/grad: the selected argument's type cannot be differentiated; select "
                        "pytree arguments (Array, Tree, containers of them, structs registered with "
                        "pytree::Fields) with the template argnums, e.g. value_and_grad<0, 2>(f)");
          if constexpr (kNested) {
            return track_nested(args);
          } else {
            return Differentiable<std::decay_t<Args>>::track(args);
          }
        } else {
          return args;
        }
      }()...);
}

template <class Tuple, std::size_t... Nums>
auto collect_nested(const Tuple& tracked, std::vector<Array>& sums) {
  std::size_t next = 0;
  if constexpr (sizeof...(Nums) == 1) {
    constexpr std::size_t n = (Nums, ...);
    return gradient_from_sums(std::get<n>(tracked), sums, next);
  } else {
    // Braced initialisation runs left to right: the sums are consumed in Nums order.
    return std::tuple<std::decay_t<std::tuple_element_t<Nums, Tuple>>...>{gradient_from_sums(std::get<Nums>(tracked), sums, next)...};
  }
}

// The sums a create-graph sweep from `value` (cotangent one) leaves at the selected arguments'
// boundaries (in Nums order, flatten order within each).
template <class Tuple, std::size_t... Nums>
std::vector<Array> nested_sweep(const Array& value, const Tuple& tracked) {
  std::vector<Boundary> boundaries;
  (boundaries_of(std::get<Nums>(tracked), boundaries), ...);
  Array one = physical_cotangent(value, Array::full(value.shape(), 1.0f, value.dtype()));
  return backward_into({Edge{value.node(), value.output_index()}}, {one}, boundaries, {}, /*create_graph=*/true,
                       /*prune=*/true);
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
    if (nested_here()) return nested(args...);
    EnableGradGuard recording;
    auto tracked = track_selected<false, Nums...>(std::index_sequence_for<Args...>{}, args...);
    auto result = [&] {
      DifferentiationScope depth;
      return std::apply(f, tracked);
    }();
    if constexpr (std::is_same_v<std::decay_t<decltype(result)>, Array>) {
      Array value = check_scalar_loss(result, "value_and_grad");
      Array one = Array::full(value.shape(), 1.0f, value.dtype());
      autodiff::backward(std::span<const Array>(&value, 1), std::span<const Array>(&one, 1));
      return flat_result<sizeof...(Nums)>(std::make_tuple(value.detached()), collect_gradients<decltype(tracked), Nums...>(tracked));
    } else {
      // has_aux: f returns (loss, aux); aux comes back detached from the graph.
      Array value = check_scalar_loss(std::get<0>(result), "value_and_grad");
      auto aux = detach_value(std::get<1>(result));
      Array one = Array::full(value.shape(), 1.0f, value.dtype());
      autodiff::backward(std::span<const Array>(&value, 1), std::span<const Array>(&one, 1));
      return flat_result<sizeof...(Nums)>(std::make_tuple(value.detached(), std::move(aux)), collect_gradients<decltype(tracked), Nums...>(tracked));
    }
  }

  // Inside another transformation: the gradient is built as a differentiable function (create-graph
  // mode), and the value, aux and gradients stay linked to the enclosing graph.
  template <class... Args>
  auto nested(const Args&... args) const {
    EnableGradGuard recording;
    auto tracked = track_selected<true, Nums...>(std::index_sequence_for<Args...>{}, args...);
    auto result = [&] {
      DifferentiationScope depth;
      return std::apply(f, tracked);
    }();
    if constexpr (std::is_same_v<std::decay_t<decltype(result)>, Array>) {
      Array value = check_scalar_loss(result, "value_and_grad");
      std::vector<Array> sums = nested_sweep<decltype(tracked), Nums...>(value, tracked);
      return flat_result<sizeof...(Nums)>(std::make_tuple(value), collect_nested<decltype(tracked), Nums...>(tracked, sums));
    } else {
      Array value = check_scalar_loss(std::get<0>(result), "value_and_grad");
      std::vector<Array> sums = nested_sweep<decltype(tracked), Nums...>(value, tracked);
      return flat_result<sizeof...(Nums)>(std::make_tuple(value, std::get<1>(result)), collect_nested<decltype(tracked), Nums...>(tracked, sums));
    }
  }
};

}  // namespace detail
}  // namespace autodiff

// value_and_grad<argnums...>(f)(args...) -> one flat structure: (value, gradient) with one argnum
// (default 0), (value, gradient_0, gradient_1, ...) with several. If f returns std::pair<Array, Aux>
// (Aux any pytree: an Array, a Tree, a struct registered with pytree::Fields, containers, plain
// values) the aux follows the value: (value, aux, gradient...). The aux (e.g. updated batch
// statistics) is not differentiated. The graph is freed as the backward sweep runs.
//   auto [loss, stats, dparams, dx] = value_and_grad<0, 1>(loss_with_stats)(params, x);
template <std::size_t... Argnums, class F>
auto value_and_grad(F f) {
  if constexpr (sizeof...(Argnums) == 0) return autodiff::detail::ValueAndGrad<F, 0>{std::move(f), false};
  else return autodiff::detail::ValueAndGrad<F, Argnums...>{std::move(f), false};
}

// grad<argnums...>(f)(args...) -> the gradient with one argnum, a std::tuple of them with several
// (no value; an aux returned by f is dropped).
template <std::size_t... Argnums, class F>
auto grad(F f) {
  auto vg = value_and_grad<Argnums...>(std::move(f));
  return [vg](const auto&... args) {
    auto r = vg(args...);
    constexpr std::size_t n = sizeof...(Argnums) == 0 ? 1 : sizeof...(Argnums);
    constexpr std::size_t first = std::tuple_size_v<decltype(r)> - n;
    if constexpr (n == 1) {
      return std::get<first>(std::move(r));
    } else {
      return [&]<std::size_t... I>(std::index_sequence<I...>) {
        return std::make_tuple(std::get<first + I>(std::move(r))...);
      }(std::make_index_sequence<n>{});
    }
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
    const bool linked = std::any_of(cts.begin(), cts.end(), [](const Array& c) { return c.node() != nullptr; });
    if (autodiff::detail::nested_here() || linked) {
      // Differentiable pullback (inside a transformation, or a cotangent that is itself tracked):
      // the cotangents come back as functions of the cotangent and of the arguments.
      autodiff::EnableGradGuard recording;
      std::vector<autodiff::Boundary> boundaries;
      std::apply([&](const auto&... t) { (autodiff::detail::boundaries_of(t, boundaries), ...); }, tracked_);
      std::vector<autodiff::Edge> edges;
      for (const Array& r : roots) edges.push_back(autodiff::Edge{r.node(), r.output_index()});
      for (std::size_t i = 0; i < roots.size(); ++i)
        if (roots[i].node() != nullptr && cts[i].defined() && !(cts[i].shape() == roots[i].shape()))
          throw AutodiffError(linum::detail::cat("vjp pullback: cotangent of shape ", cts[i].shape(), " for an output of shape ",
                                                 roots[i].shape()));
      for (std::size_t i = 0; i < roots.size(); ++i)
        if (roots[i].node() != nullptr && cts[i].defined()) cts[i] = autodiff::physical_cotangent(roots[i], cts[i]);
      std::vector<Array> sums = autodiff::backward_into(std::move(edges), std::move(cts), boundaries, {}, true, true);
      std::size_t next = 0;
      if constexpr (sizeof...(Args) == 1) {
        return autodiff::detail::gradient_from_sums(std::get<0>(tracked_), sums, next);
      } else {
        return std::apply(
            [&](const auto&... t) {
              return std::tuple<Args...>{autodiff::detail::gradient_from_sums(t, sums, next)...};
            },
            tracked_);
      }
    }
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
  const bool nested = autodiff::detail::nested_here();
  autodiff::EnableGradGuard recording;
  std::tuple<std::decay_t<Args>...> tracked{nested ? autodiff::detail::track_nested(args)
                                                   : Differentiable<std::decay_t<Args>>::track(args)...};
  auto out = [&] {
    autodiff::DifferentiationScope depth;
    return std::apply(std::forward<F>(f), tracked);
  }();
  using Out = std::decay_t<decltype(out)>;
  auto primal = nested ? out : pytree::detached(out);  // nested: the output stays linked to the enclosing graph
  return std::make_pair(std::move(primal), Pullback<Out, std::decay_t<Args>...>(std::move(out), std::move(tracked)));
}

}  // namespace linum
