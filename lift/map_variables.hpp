// lift::map_variables<Body>: Flax's nn.map_variables. The body sees its variables through a function:
// a masked or causal kernel, weight normalization, a low-rank update added to a frozen kernel,
// weights stored in another form. Gradients flow through the function to the stored variables.
//
//   // A Dense whose kernel is upper-triangular (Flax's CausalDense example): the stored kernel stays
//   // full, the layer computes with its upper triangle, and its gradient is zero below the diagonal.
//   struct CausalDense {
//     std::int64_t features = 4;
//     Array operator()(Scope& s, const Array& x) const {
//       auto triu = [](const Tree& vars) {   // {"params": {"kernel": ..., "bias": ...}}
//         Tree out = vars;
//         const Array k = vars.at_path("params/kernel").array();
//         out.set_path("params/kernel", Tree(k * upper_triangle_mask(k.shape())));
//         return out;
//       };
//       return s(lift::map_variables<nn::Dense>{.body = {.features = features}, .trans_in = triu}, x);
//     }
//   };
//   // params/Map_variablesDense_0/{kernel, bias}, as Flax names it.
//
// The body runs in the wrapper's scope, as a module of its own. `trans_in` gets the mapped
// collections' variables under that scope, {collection: subtree}, and returns what the body reads
// instead; `trans_out` maps what the body wrote back before it is stored. Both may capture an
// enclosing module's Scope& and create variables there (weight norm's scales). Unset: identity.
//
// As Flax's: at init (`init`, unset: the scope's is_initializing()) the body first runs on the
// unmapped variables to create them; trans_out of what it created, then trans_in, is what the body
// runs on again, with the same keys, for the result; what init stores is trans_out of that run's
// variables (with the default identity trans_out: trans_in of the created ones). At apply the body
// runs once on trans_in(stored). With `mutable_` (Flax's `mutable`) the body's writes to the mapped
// collections go back through trans_out; without it a write is an error. Collections not mapped
// pass through unchanged. Composes with lift::remat (inside or outside), lift::scan, lift::vmap and
// grad; other methods of the body run mapped the same way (s.call(&Body::encode, wrapper, x)).
#pragma once

#include <linum/core/tree.hpp>
#include <linum/lift/pack.hpp>
#include <linum/modules/module.hpp>
#include <linum/modules/scope.hpp>

#include <concepts>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace linum::lift {

// {collection: variables under the module} -> the same structure, changed.
using VariablesMap = std::function<Tree(const Tree&)>;

namespace detail {

using linum::detail::ScopeState;

// The state a lift::map_variables runs on (map_variables.cpp).
struct MapVariablesRun {
  std::optional<Pack> pack;
  std::vector<std::string> path;
  std::vector<std::string> collections;
  VariablesMap trans_in, trans_out;
  bool writes_back = false;  // init or mutable_
  Tree original;             // the mapped collections' variables on entry, {collection: subtree}
  Tree target;               // what trans_in maps: the original, or at init trans_out of what was created
};

MapVariablesRun plan_map_variables(Scope& s, std::vector<std::string> collections, VariablesMap trans_in,
                                   VariablesMap trans_out, bool init, bool mutable_);
// The state of the creating run at init (the unmapped variables).
ScopeState creating_state(const MapVariablesRun& run);
// After the creating run: trans_out of what it created becomes the mapped target.
void take_created(MapVariablesRun& run, const ScopeState& created);
// The state the body runs on for its result: trans_in of the target in the mapped collections.
ScopeState mapped_state(const MapVariablesRun& run);
// Publishes the run: the mapped collections through trans_out (or as they were, when not written
// back), everything else as the body left it.
void finish_map_variables(const MapVariablesRun& run, const ScopeState& after);

}  // namespace detail

template <class Body>
struct map_variables {
  Body body{};
  std::vector<std::string> collections{"params"};  // Flax's mapped_collections
  VariablesMap trans_in{};                         // unset: identity
  VariablesMap trans_out{};                        // unset: identity
  std::optional<bool> init{};                      // unset: whether the scope is initializing
  bool mutable_ = false;                           // Flax's mutable: the body's writes go back through trans_out

  // Flax names the transformed module class after the transform and the body: Map_variablesDense_0.
  static std::string type_name() { return "Map_variables" + module_type_name<Body>(); }

  template <class... Args>
    requires std::invocable<const Body&, Scope&, const Args&...>
  auto operator()(Scope& s, const Args&... args) const {
    return mapped(s, [](const Body& b, Scope& inner, const auto&... a) { return b(inner, a...); }, args...);
  }

  // Other methods of the body (s.call(&Body::encode, wrapper, x)), on the same mapped variables.
  template <class Method, class... Args>
  auto lifted_call(Method method, Scope& s, const Args&... args) const {
    return mapped(s, [method](const Body& b, Scope& inner, const auto&... a) { return (b.*method)(inner, a...); }, args...);
  }

 private:
  template <class Invoke, class... Args>
  auto mapped(Scope& s, const Invoke& invoke, const Args&... args) const {
    using linum::detail::ModuleEntry;
    detail::MapVariablesRun run = detail::plan_map_variables(s, collections, trans_in, trans_out,
                                                             init.value_or(s.is_initializing()), mutable_);
    auto call = [&](Scope& in, const auto&... a) { return invoke(body, in, a...); };
    if (init.value_or(s.is_initializing())) {  // create the variables first (Flax's init=True)
      detail::ScopeState first = detail::creating_state(run);
      Scope inner(first, run.path);
      (void)ModuleEntry::run(inner, body, call, args...);
      detail::take_created(run, first);
    }
    detail::ScopeState st = detail::mapped_state(run);
    auto out = [&] {
      Scope inner(st, run.path);
      return ModuleEntry::run(inner, body, call, args...);
    }();
    detail::finish_map_variables(run, st);
    return out;
  }
};

}  // namespace linum::lift
