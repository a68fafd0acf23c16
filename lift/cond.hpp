// lift::cond and lift::switch_: Flax's nn.cond / nn.switch for eager C++. Init runs every branch, so
// every branch's variables exist whichever branch the example inputs take; apply runs only the
// selected one.
//
//   struct Model {
//     Array operator()(Scope& s, Array x, bool expert) const {
//       // params/Dense_0 for the true branch, params/Dense_1 for the false one, both made by init.
//       return lift::cond(s, expert, nn::Dense{.features = 8}, nn::Dense{.features = 8}, x);
//     }
//   };
//   // index 0, 1 or 2 selects a head; init creates all three.
//   Array y = lift::switch_(s, head, std::tuple{HeadA{}, HeadB{}, lift::branch("linear", nn::Dense{.features = 4})}, x);
//
// Each branch is a module (anything callable as branch(scope, args...), a lambda too) run in a
// child scope of its own, named in branch order on every call: auto-named by type ("Dense_0",
// "Dense_1", ...) or by lift::branch(name, module). The names, and with them the variable paths and
// the branches' PRNG keys (make_rng hashes the module path), do not depend on which branch runs: a
// model initialized on one branch applies on any other, and later siblings keep their names.
//
// Init runs the branches in order, each as it would run alone (its own variables and keys), and
// returns the selected one's result. Apply runs the selected branch; the variables of the others
// count as used (apply's check for entries the model did not use). The selector is a bool / an
// integer, or a scalar array (bool, int32 or float32; nonzero is true), read eagerly; a selector
// batched under lift::vmap has one value per member and is an error (select with `where` there).
// An index outside [0, branches) is a ValueError (jax.lax.switch clamps it instead). Every branch
// must return the same type; under lift::remat the recomputation runs the same branch again.
#pragma once

#include <linum/core/array.hpp>
#include <linum/lift/pack.hpp>
#include <linum/modules/scope.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace linum::lift {

// A branch with an explicit child-scope name (for lambdas, or to keep a checkpoint's names).
template <class M>
struct NamedBranch {
  std::string name;
  M module;
};
template <class M>
NamedBranch<std::decay_t<M>> branch(std::string name, M&& module) {
  return {std::move(name), std::forward<M>(module)};
}

namespace detail {

// The child-scope name each branch gets at `s`, in order (Scope's auto-naming).
std::string reserve_branch_name(Scope& s, const std::string& type_name);
// Marks the variables under `s`'s child `name` as used (apply's unused-entry check).
void mark_branch_used(Scope& s, const std::string& name);
// The selector as an index: a bool/int32/float32 scalar array's value (nonzero counts as 1 for cond).
std::int64_t read_selector(const Scope& s, const char* transform, const Array& selector, bool as_bool);
[[noreturn]] void throw_branch_error(const Scope& s, const char* transform, const std::string& what);

template <class B>
struct BranchTraits {
  static std::string name(Scope& s, const B&) { return reserve_branch_name(s, module_type_name<B>()); }
  static const B& module(const B& b) { return b; }
};
template <class M>
struct BranchTraits<NamedBranch<M>> {
  static std::string name(Scope&, const NamedBranch<M>& b) { return b.name; }
  static const M& module(const NamedBranch<M>& b) { return b.module; }
};

template <class B, class... Args>
using ResultOf = std::decay_t<decltype(std::declval<Scope&>()(
    std::declval<const std::string&>(), BranchTraits<B>::module(std::declval<const B&>()), std::declval<Args>()...))>;

template <class... Branches, class... Args>
auto run_switch(const char* transform, Scope& s, std::int64_t index, const std::tuple<Branches...>& branches, Args&&... args) {
  constexpr std::size_t n = sizeof...(Branches);
  static_assert(n > 0, "lift::switch_ needs at least one branch");
  using Out = ResultOf<std::tuple_element_t<0, std::tuple<Branches...>>, Args&...>;
  static_assert((std::is_same_v<Out, ResultOf<Branches, Args&...>> && ...),
                "lift::cond / lift::switch_: every branch must return the same type");
  if (index < 0 || index >= static_cast<std::int64_t>(n))
    throw_branch_error(s, transform, linum::detail::cat("index ", index, " is out of range for ", n, " branches (0 to ", n - 1,
                                                        "); pick an index in range (jax.lax.switch would clamp it)"));
  // Names first, in branch order, whichever branch runs.
  std::array<std::string, n> names;
  [&]<std::size_t... Is>(std::index_sequence<Is...>) {
    ((names[Is] = BranchTraits<std::tuple_element_t<Is, std::tuple<Branches...>>>::name(s, std::get<Is>(branches))), ...);
  }(std::index_sequence_for<Branches...>{});
  std::optional<Out> out;
  const bool every = s.is_initializing();
  [&]<std::size_t... Is>(std::index_sequence<Is...>) {
    auto one = [&]<std::size_t I>(std::integral_constant<std::size_t, I>) {
      using B = std::tuple_element_t<I, std::tuple<Branches...>>;
      const bool selected = static_cast<std::int64_t>(I) == index;
      if (selected || every) {
        Out r = s(names[I], BranchTraits<B>::module(std::get<I>(branches)), args...);
        if (selected) out.emplace(std::move(r));
      } else {
        mark_branch_used(s, names[I]);
      }
    };
    (one(std::integral_constant<std::size_t, Is>{}), ...);
  }(std::index_sequence_for<Branches...>{});
  return std::move(*out);
}

}  // namespace detail

// Runs `branches[index](child scope, args...)`; at init every branch runs (see above).
template <class... Branches, class... Args>
auto switch_(Scope& s, std::int64_t index, const std::tuple<Branches...>& branches, Args&&... args) {
  return detail::run_switch("lift::switch_", s, index, branches, std::forward<Args>(args)...);
}
template <class... Branches, class... Args>
auto switch_(Scope& s, const Array& index, const std::tuple<Branches...>& branches, Args&&... args) {
  return detail::run_switch("lift::switch_", s, detail::read_selector(s, "lift::switch_", index, false), branches,
                            std::forward<Args>(args)...);
}

// Runs `if_true` when `pred` holds, else `if_false` (each in its own child scope; see above).
template <class T, class F, class... Args>
auto cond(Scope& s, bool pred, const T& if_true, const F& if_false, Args&&... args) {
  return detail::run_switch("lift::cond", s, pred ? 0 : 1, std::tuple<T, F>(if_true, if_false),
                            std::forward<Args>(args)...);
}
template <class T, class F, class... Args>
auto cond(Scope& s, const Array& pred, const T& if_true, const F& if_false, Args&&... args) {
  const bool p = detail::read_selector(s, "lift::cond", pred, true) != 0;
  return detail::run_switch("lift::cond", s, p ? 0 : 1, std::tuple<T, F>(if_true, if_false),
                            std::forward<Args>(args)...);
}

}  // namespace linum::lift
