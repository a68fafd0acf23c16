// lift::vmap's state handling: the mapped and shared collections, the keys per member (Flax's split),
// batched keys and variables for the one batched apply, and stacking and publishing the results.
#include <linum/lift/vmap.hpp>

#include <linum/core/autodiff/batching.hpp>
#include <linum/lift/mapped_state_internal.hpp>
#include <linum/rng/key.hpp>

#include <algorithm>

namespace linum::lift::detail {
namespace {

std::string join(const std::vector<std::string>& parts) { return linum::detail::join_module_path(parts); }

std::string full(const std::string& prefix, const std::string& leaf) { return prefix.empty() ? leaf : prefix + "/" + leaf; }

// Member keys (each maybe batched over outer levels) as one key batched over those levels and `level`.
rng::Key stack_keys(const std::vector<rng::Key>& members, const BatchLevel& level) {
  if (!members.front().batched()) return rng::batched_key({level}, members);
  std::vector<BatchLevel> levels = members.front().batch->levels;
  levels.push_back(level);
  std::vector<rng::Key> keys;
  const std::size_t outer = members.front().batch->keys.size();
  for (std::size_t o = 0; o < outer; ++o)
    for (const rng::Key& m : members) keys.push_back(m.batch->keys.at(o));
  return rng::batched_key(std::move(levels), std::move(keys));
}

ScopeState state_on(const VmapPlan& plan, Tree variables, rng::Streams streams) {
  return body_state(*plan.pack, std::move(variables), std::move(streams), plan.counters, plan.settings.split_rngs,
                    {plan.split_keys, plan.broadcast_keys}, linum::detail::cat("lift::vmap at '", join(plan.path), "' (split_rngs)"));
}

}  // namespace

void throw_vmap_error(const std::vector<std::string>& path, const std::string& what) {
  throw ValueError(linum::detail::cat("lift::vmap at '", path.empty() ? std::string("<root>") : join(path), "': ", what));
}

VmapPlan plan_vmap(Scope& s, const VmapSettings& settings, std::optional<std::int64_t> size,
                   std::optional<std::int64_t> axis_size) {
  VmapPlan plan;
  plan.path = s.path();
  plan.settings = settings;
  for (const auto& [c, axis] : settings.variable_axes)
    if (axis < 0) throw_vmap_error(plan.path, linum::detail::cat("variable_axes['", c, "'] is ", axis, "; use an axis >= 0"));
  plan.pack.emplace(s, LiftFilters{}, "lift::vmap");
  const Pack& pack = *plan.pack;
  const std::string prefix = join(plan.path);
  if (size && axis_size && *size != *axis_size)
    throw_vmap_error(plan.path, linum::detail::cat("axis_size is ", *axis_size, " but the mapped arguments have ", *size, " members"));
  if (!size) size = axis_size;
  for (const auto& [collection, tree] : pack.variables()) {
    const Tree* sub = at_prefix(tree, prefix);
    if (sub == nullptr) continue;
    const auto axis_it = settings.variable_axes.find(collection);
    if (axis_it == settings.variable_axes.end()) {
      put_at_prefix(plan.shared[collection], prefix, *sub);
      continue;
    }
    const int axis = axis_it->second;
    for (const auto& [leaf_path, stacked] : flatten(*sub)) {
      if (stacked.rank() <= axis || (size && stacked.dim(axis) != *size))
        throw ShapeError(linum::detail::cat("lift::vmap at '", prefix, "': variable '", collection, "/", full(prefix, leaf_path),
                                            "' has shape ", stacked.shape(), " but ",
                                            size ? linum::detail::cat(*size, " members need an axis ", axis, " of ", *size)
                                                 : linum::detail::cat("variable_axes maps it along axis ", axis),
                                            " (the dict may come from an ensemble of another size)"));
      size = stacked.dim(axis);
      plan.mapped.push_back({collection, leaf_path, stacked, axis});
    }
  }
  if (!size)
    throw_vmap_error(plan.path, "the number of members is unknown: no argument is mapped and no variable exists yet; "
                                "give axis_size");
  if (*size < 1) throw_vmap_error(plan.path, linum::detail::cat("the number of members must be at least 1, got ", *size));
  plan.size = *size;
  BodyStreams streams = body_streams(pack, settings.split_rngs, plan.size);
  plan.split_keys = std::move(streams.split);
  plan.broadcast_keys = std::move(streams.broadcast);
  plan.counters = pack.counters();
  return plan;
}

ScopeState member_state(const VmapPlan& plan, std::int64_t e) {
  rng::Streams streams;
  for (const auto& [stream, keys] : plan.split_keys) streams.set(stream, keys[static_cast<std::size_t>(e)]);
  for (const auto& [stream, key] : plan.broadcast_keys) streams.set(stream, key);
  Tree variables = plan.shared;
  const std::string prefix = join(plan.path);
  for (const VmapPlan::Mapped& m : plan.mapped)
    variables[m.collection].set_path(full(prefix, m.leaf_path),
                                     Tree(take(m.stacked, Array::from_i32(Shape{}, {static_cast<std::int32_t>(e)}), m.axis)));
  return state_on(plan, std::move(variables), std::move(streams));
}

void finish_members(const VmapPlan& plan, const std::vector<ScopeState>& states) {
  const std::string prefix = join(plan.path);
  Tree result;
  for (const auto& [collection, _] : Pack::variables_of(states.front())) {
    const auto axis_it = plan.settings.variable_axes.find(collection);
    if (!plan.pack->is_mutable(collection)) continue;
    const Tree* first = at_prefix(Pack::variables_of(states.front()).at(collection), prefix);
    if (first == nullptr) continue;
    if (axis_it == plan.settings.variable_axes.end()) {  // shared: every member must have made the same
      const auto reference = flatten(*first);
      for (std::size_t e = 1; e < states.size(); ++e) {
        const Tree* sub = at_prefix(Pack::variables_of(states[e]).at(collection), prefix);
        const auto mine = sub ? flatten(*sub) : std::vector<std::pair<std::string, Array>>{};
        bool same = mine.size() == reference.size();
        for (std::size_t k = 0; same && k < mine.size(); ++k)
          same = mine[k].first == reference[k].first && mine[k].second.bitwise_equal(reference[k].second);
        if (!same)
          throw_vmap_error(plan.path, linum::detail::cat(
              "member ", e, " created other '", collection, "' values than member 0, but the members share that "
              "collection; map it with variable_axes (e.g. {\"", collection, "\", 0}) or make its stream the same for every "
              "member (split_rngs {\"params\", false})"));
      }
      put_at_prefix(result[collection], prefix, *first);
      continue;
    }
    std::vector<std::vector<std::pair<std::string, Array>>> per_member;
    for (const ScopeState& st : states) {
      const Tree* sub = at_prefix(Pack::variables_of(st).at(collection), prefix);
      per_member.push_back(sub ? flatten(*sub) : std::vector<std::pair<std::string, Array>>{});
    }
    std::vector<std::pair<std::string, Array>> stacked;
    for (std::size_t k = 0; k < per_member.front().size(); ++k) {
      std::vector<Array> values;
      for (std::size_t e = 0; e < per_member.size(); ++e) {
        if (per_member[e].size() != per_member.front().size() || per_member[e][k].first != per_member.front()[k].first)
          throw_vmap_error(plan.path, linum::detail::cat("member ", e, " has different '", collection,
                                                         "' variables than member 0; every member must create the same ones"));
        values.push_back(per_member[e][k].second);
      }
      stacked.emplace_back(per_member.front()[k].first, moveaxis(stack(values), 0, axis_it->second));
    }
    if (!stacked.empty()) put_at_prefix(result[collection], prefix, unflatten(stacked));
  }
  std::vector<const ScopeState*> runs;
  for (const ScopeState& st : states) runs.push_back(&st);
  plan.pack->publish(std::move(result), Pack::counters_of(states.front()), runs);
}

ScopeState batched_state(const VmapPlan& plan, const BatchLevel& level) {
  rng::Streams streams;
  for (const auto& [stream, keys] : plan.split_keys) streams.set(stream, stack_keys(keys, level));
  for (const auto& [stream, key] : plan.broadcast_keys) streams.set(stream, key);
  Tree variables = plan.shared;
  const std::string prefix = join(plan.path);
  for (const VmapPlan::Mapped& m : plan.mapped)
    variables[m.collection].set_path(full(prefix, m.leaf_path), Tree(transforms::detail::batch_at(m.stacked, m.axis, level)));
  return state_on(plan, std::move(variables), std::move(streams));
}

void finish_batched(const VmapPlan& plan, const ScopeState& state, const BatchLevel& level) {
  const std::string prefix = join(plan.path);
  Tree result;
  for (const auto& [collection, tree] : Pack::variables_of(state)) {
    if (!plan.pack->is_mutable(collection)) continue;
    const Tree* sub = at_prefix(tree, prefix);
    if (sub == nullptr) continue;
    const auto axis_it = plan.settings.variable_axes.find(collection);
    std::vector<std::pair<std::string, Array>> leaves = flatten(*sub);
    std::vector<Array> values;
    for (const auto& [leaf_path, v] : leaves) {
      if (axis_it == plan.settings.variable_axes.end()) {
        const auto own = v.batch_levels();
        if (std::find(own.begin(), own.end(), level) != own.end())
          throw_vmap_error(plan.path, linum::detail::cat("the members wrote different values to '", collection, "/",
                                                         full(prefix, leaf_path), "', a collection they share; map it "
                                                         "with variable_axes (e.g. {\"", collection, "\", 0})"));
      }
      values.push_back(v);
    }
    if (axis_it != plan.settings.variable_axes.end())  // per member: stacked along the collection's axis
      transforms::detail::unbatch_results(values, {axis_it->second}, level);
    for (std::size_t k = 0; k < leaves.size(); ++k) leaves[k].second = values[k];
    if (!leaves.empty()) put_at_prefix(result[collection], prefix, unflatten(leaves));
  }
  plan.pack->publish(std::move(result), Pack::counters_of(state), {&state});
}

}  // namespace linum::lift::detail
