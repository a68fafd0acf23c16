// lift::vmap<Body>: Flax's nn.vmap. The body runs once on a batch of examples, each with its own
// slice of the mapped variables and its own keys: an ensemble trained at once, a module applied
// per example.
//
//   // 8 MLPs at once: params stacked on a leading axis, each member its own init and dropout keys.
//   using Ensemble = lift::vmap<Mlp>;
//   Array logits = s(Ensemble{.body = {.hidden = 256}, .variable_axes = {{"params", 0}},
//                             .split_rngs = {{"params", true}, {"dropout", true}},
//                             .in_axes = {std::nullopt}, .axis_size = 8}, x, train);   // [8, batch, classes]
//   // params/VmapMlp_0/Dense_0/kernel has shape (8, in, 256)
//
// The body is called as body(scope, args...) on one example's view of everything (shapes without
// the batch axis; core/batch_levels.hpp); arguments and results are pytrees mapped along in_axes /
// out_axes as linum::vmap does (core/transforms/vmap.hpp: one entry per argument or one for all,
// std::nullopt for "the same for every member", default 0).
//
// Variables, per collection (Flax's arguments of the same names):
//   variable_axes   collection -> axis: one slice per member, stacked along that axis (init
//                   creates them so); a collection not listed is shared by every member
//                   (broadcast: created once, and a member may not write a per-member value to it).
// Keys (split_rngs): for a split stream with key K, member e's stream key is
// jax.random.split(K, size)[e] (in the current rng::Mode; in the default, partitionable mode that
// is fold_in(K, e)); a stream mapped to false reaches every member unchanged; a stream not in a
// non-empty split_rngs does not reach the body (empty split_rngs: every stream split, as
// lift::scan). Inside, make_rng hashes the module path and a per-scope counter into the member's
// stream key, as Flax.
//
// Methods (Flax's `methods`): s.call(&Body::encode, wrapper, x) runs body.encode mapped the same way.
//
// The number of members comes from the mapped arguments, the mapped variables, or axis_size.
// Apply runs the body once on batched values (ops batch; a split stream's keys are batched keys,
// so dropout masks are drawn per member in one call). Init runs it once per member and stacks what
// they created, so initializers need no batching rule. Composes with lift::remat (inside or
// outside), lift::scan, checkpoint policies and grad.
#pragma once

#include <linum/core/autodiff/pytree.hpp>
#include <linum/core/ops/shape_ops.hpp>
#include <linum/core/transforms/vmap.hpp>
#include <linum/lift/pack.hpp>
#include <linum/modules/module.hpp>
#include <linum/modules/scope.hpp>

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace linum::lift {

namespace detail {

using linum::detail::ScopeState;

struct VmapSettings {
  std::map<std::string, int> variable_axes;
  std::map<std::string, bool> split_rngs;
};

// The state a lift::vmap runs on (vmap.cpp): the pack at its scope, the mapped variables (stacked,
// with their axis), the shared ones, the streams' keys per member, the counters.
struct VmapPlan {
  std::optional<Pack> pack;
  std::vector<std::string> path;
  VmapSettings settings;
  std::int64_t size = 0;
  struct Mapped {
    std::string collection, leaf_path;
    Array stacked;
    int axis;
  };
  std::vector<Mapped> mapped;
  Tree shared;
  std::vector<std::pair<std::string, std::vector<rng::Key>>> split_keys;
  std::vector<std::pair<std::string, rng::Key>> broadcast_keys;
  RngCounters counters;
};

// `size`: the members the mapped arguments have (if any), `axis_size` the option; checked against
// the mapped variables.
VmapPlan plan_vmap(Scope& s, const VmapSettings& settings, std::optional<std::int64_t> size,
                   std::optional<std::int64_t> axis_size);
// Init: the state of member e (its slice of the mapped variables, its keys).
ScopeState member_state(const VmapPlan& plan, std::int64_t e);
// Init: stacks what the members created in the mapped collections, publishes the rest.
void finish_members(const VmapPlan& plan, const std::vector<ScopeState>& states);
// Apply: the state of all members at once, mapped variables and split keys batched at `level`.
ScopeState batched_state(const VmapPlan& plan, const BatchLevel& level);
// Apply: the mapped collections the body wrote, stacked again; publishes.
void finish_batched(const VmapPlan& plan, const ScopeState& state, const BatchLevel& level);
[[noreturn]] void throw_vmap_error(const std::vector<std::string>& path, const std::string& what);

// Member e's part of an argument mapped along `axis` (or the argument itself).
template <class T>
T member_of(const T& value, std::optional<int> axis, std::int64_t e) {
  if (!axis) return value;
  std::vector<Array> arrays = pytree::flatten(value);
  for (Array& a : arrays)
    if (a.defined()) {
      const int ax = *axis < 0 ? *axis + a.rank() : *axis;
      a = take(a, Array::from_i32(Shape{}, {static_cast<std::int32_t>(e)}), ax);
    }
  return pytree::rebuild(value, std::span<const Array>(arrays));
}

}  // namespace detail

template <class Body>
struct vmap {
  Body body{};
  std::map<std::string, int> variable_axes{};
  std::map<std::string, bool> split_rngs{};
  std::vector<std::optional<int>> in_axes{};   // per argument after the scope, or one for all (default 0)
  std::vector<std::optional<int>> out_axes{};  // per result array, or one for all (default 0)
  std::optional<std::int64_t> axis_size{};

  // Flax names the mapped module after its body: VmapMlp_0.
  static std::string type_name() { return "Vmap" + module_type_name<Body>(); }

  template <class... Args>
    requires std::invocable<const Body&, Scope&, const Args&...>  // so apply(vmap{...}, vars, x) picks its overload
  auto operator()(Scope& s, const Args&... args) const {
    return mapped(s, [](const Body& b, Scope& inner, const auto&... a) { return b(inner, a...); }, args...);
  }

  // Other methods of the body (Flax's `methods`): s.call(&Body::encode, wrapper, x) runs
  // body.encode mapped as operator() is, on the same variables and keys.
  template <class Method, class... Args>
  auto lifted_call(Method method, Scope& s, const Args&... args) const {
    return mapped(s, [method](const Body& b, Scope& inner, const auto&... a) { return (b.*method)(inner, a...); }, args...);
  }

 private:
  template <class Invoke, class... Args>
  auto mapped(Scope& s, const Invoke& invoke, const Args&... args) const {
    constexpr std::size_t n = sizeof...(Args);
    if (in_axes.size() > 1 && in_axes.size() != n)
      detail::throw_vmap_error(s.path(), linum::detail::cat("in_axes has ", in_axes.size(), " entries for ", n,
                                                            " arguments; give one per argument or one for all"));
    auto axis_of = [&](std::size_t i) -> std::optional<int> {
      if (in_axes.empty()) return 0;
      return in_axes.size() == 1 ? in_axes[0] : in_axes[i];
    };
    std::optional<std::int64_t> size;
    std::array<std::vector<Array>, n> flat{pytree::flatten(args)...};
    for (std::size_t i = 0; i < n; ++i) transforms::detail::batch_arguments(flat[i], axis_of(i), i, size);
    detail::VmapPlan plan = detail::plan_vmap(s, {variable_axes, split_rngs}, size, axis_size);
    using linum::detail::ScopeState;
    if (s.is_initializing()) return init_members(plan, invoke, axis_of, args...);
    const BatchLevel level = transforms::detail::open_level(plan.size);
    auto batched = [&]<std::size_t... Is>(std::index_sequence<Is...>) {
      for (std::size_t i = 0; i < n; ++i)
        if (const std::optional<int> axis = axis_of(i))
          for (Array& a : flat[i])
            if (a.defined()) a = transforms::detail::batch_at(a, *axis, level);
      return std::tuple<std::decay_t<Args>...>{pytree::rebuild(args, std::span<const Array>(flat[Is]))...};
    }(std::index_sequence_for<Args...>{});
    ScopeState st = detail::batched_state(plan, level);
    auto result = [&] {
      linum::detail::OpenBatchLevels::Entry open(level);
      Scope inner(st, plan.path);
      auto call = [&](Scope& in, const auto&... a) { return invoke(body, in, a...); };
      return std::apply([&](const auto&... a) { return linum::detail::ModuleEntry::run(inner, body, call, a...); }, batched);
    }();
    detail::finish_batched(plan, st, level);
    std::vector<Array> outs = pytree::flatten(result);
    transforms::detail::unbatch_results(outs, out_axes, level);
    return pytree::rebuild(result, std::span<const Array>(outs));
  }

  // Init: the body once per member (its own keys and slices), the created variables stacked, the
  // results stacked along out_axes.
  template <class Invoke, class AxisOf, class... Args>
  auto init_members(detail::VmapPlan& plan, const Invoke& invoke, const AxisOf& axis_of, const Args&... args) const {
    using linum::detail::ScopeState;
    std::vector<ScopeState> states;
    std::vector<std::vector<Array>> results;
    using Result = std::decay_t<decltype(invoke(body, std::declval<Scope&>(), args...))>;
    std::optional<Result> first;
    for (std::int64_t e = 0; e < plan.size; ++e) {
      ScopeState st = detail::member_state(plan, e);
      Result r = [&]<std::size_t... Is>(std::index_sequence<Is...>) {
        Scope inner(st, plan.path);
        auto call = [&](Scope& in, const auto&... a) { return invoke(body, in, a...); };
        return linum::detail::ModuleEntry::run(inner, body, call, detail::member_of(args, axis_of(Is), e)...);
      }(std::index_sequence_for<Args...>{});
      results.push_back(pytree::flatten(r));
      if (!first) first = std::move(r);
      states.push_back(std::move(st));
    }
    detail::finish_members(plan, states);
    // The members' results as one value batched at a level of their own, then laid out as apply's.
    const BatchLevel level = transforms::detail::open_level(plan.size);
    std::vector<Array> outs;
    for (std::size_t k = 0; k < results.front().size(); ++k) {
      const bool same = out_axes.size() > 1 ? !out_axes[k] : (out_axes.size() == 1 && !out_axes[0]);
      if (same || !results.front()[k].defined()) {
        outs.push_back(results.front()[k]);  // out axis nullopt: the same for every member
        continue;
      }
      std::vector<Array> column;
      for (const auto& r : results) column.push_back(r[k]);
      const Array stacked = stack(column);  // [members, ...] per example of any outer levels
      std::vector<BatchLevel> levels(stacked.batch_levels().begin(), stacked.batch_levels().end());
      levels.push_back(level);
      outs.push_back(Array::batched_view(stacked.physical(), levels));
    }
    transforms::detail::unbatch_results(outs, out_axes, level);
    return pytree::rebuild(*first, std::span<const Array>(outs));
  }
};

}  // namespace linum::lift
