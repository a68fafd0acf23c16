// lift::scan's state handling: which role each collection plays, the variables' slices, the keys
// per iteration (Flax's split), the counters, and stacking and publishing the results.
#include <linum/lift/scan.hpp>

#include <linum/rng/key.hpp>

#include <algorithm>

namespace linum::lift::detail {
namespace {

std::string join(const std::vector<std::string>& parts) { return linum::detail::join_module_path(parts); }

bool contains(const std::vector<std::string>& v, std::string_view x) { return std::find(v.begin(), v.end(), x) != v.end(); }

enum class Role { axis, broadcast, carry };

// The role of `collection`, or an error naming it when the settings leave it out.
Role role_of(const ScanSettings& st, const std::vector<std::string>& path, const std::string& collection, int* axis) {
  if (contains(st.variable_broadcast, collection)) return Role::broadcast;
  if (contains(st.variable_carry, collection)) return Role::carry;
  if (auto it = st.variable_axes.find(collection); it != st.variable_axes.end()) {
    *axis = it->second;
    return Role::axis;
  }
  if (st.variable_axes.empty() && st.variable_broadcast.empty() && st.variable_carry.empty()) {
    *axis = 0;  // the default: every collection scanned along axis 0
    return Role::axis;
  }
  throw_scan_error(path, linum::detail::cat("collection '", collection,
                                            "' is in none of variable_axes, variable_broadcast and variable_carry; "
                                            "say how the iterations share it"));
}

// x with `axis` moved to the front (and back).
Array axis_to_front(const Array& x, int axis) {
  if (axis == 0) return x;
  std::vector<int> perm{axis};
  for (int d = 0; d < x.rank(); ++d)
    if (d != axis) perm.push_back(d);
  return transpose(x, perm);
}
Array front_to_axis(const Array& x, int axis) {
  if (axis == 0) return x;
  std::vector<int> perm;
  for (int d = 1; d <= axis; ++d) perm.push_back(d);
  perm.insert(perm.begin() + axis, 0);
  for (int d = axis + 1; d < x.rank(); ++d) perm.push_back(d);
  return transpose(x, perm);
}

// The subtree of `collection` at `prefix`, if any.
const Tree* at_prefix(const Tree& collection, const std::string& prefix) {
  if (prefix.empty()) return &collection;
  return collection.contains_path(prefix) ? &collection.at_path(prefix) : nullptr;
}

void put_at_prefix(Tree& collection, const std::string& prefix, Tree value) {
  if (prefix.empty()) collection = std::move(value);
  else collection.set_path(prefix, std::move(value));
}

}  // namespace

void throw_scan_error(const std::vector<std::string>& path, const std::string& what) {
  throw ValueError(linum::detail::cat("lift::scan at '", path.empty() ? std::string("<root>") : join(path), "': ", what));
}

ScanPlan plan_scan(Scope& s, const ScanSettings& settings, int length) {
  ScanPlan plan;
  plan.path = s.path();
  plan.outer_note = s.state().lift_note;
  plan.settings = settings;
  plan.length = length;
  for (const auto& [c, axis] : settings.variable_axes)
    if (axis < 0) throw_scan_error(plan.path, linum::detail::cat("variable_axes['", c, "'] is ", axis, "; use an axis >= 0"));
  plan.pack.emplace(s, LiftFilters{}, "lift::scan");
  const ScopeState& entry = plan.pack->entry();
  const std::string prefix = join(plan.path);
  // Variables.
  for (const auto& [collection, tree] : entry.variables) {
    const Tree* sub = at_prefix(tree, prefix);
    if (sub == nullptr) continue;
    int axis = 0;
    switch (role_of(settings, plan.path, collection, &axis)) {
      case Role::broadcast:
      case Role::carry:
        put_at_prefix(plan.shared.variables[collection], prefix, *sub);
        break;
      case Role::axis: {
        std::vector<std::pair<std::string, std::vector<Array>>> leaves;
        for (const auto& [leaf_path, stacked] : flatten(*sub)) {
          if (stacked.rank() <= axis || stacked.dim(axis) != length)
            throw ShapeError(linum::detail::cat("lift::scan at '", prefix, "': variable '", collection, "/", prefix, "/",
                                                leaf_path, "' has shape ", stacked.shape(), " but a scan of ", length,
                                                " iterations needs ", axis == 0 ? std::string("a leading axis") : linum::detail::cat("an axis ", axis), " of ", length,
                                                " (the dict may come from a scan of another length)"));
          leaves.emplace_back(leaf_path, unstack(axis_to_front(stacked, axis)));
        }
        plan.slices.emplace_back(collection, std::move(leaves));
        break;
      }
    }
  }
  // Streams: split (one key per slice), broadcast, or not passed in.
  for (const std::string& stream : entry.rngs.names()) {
    bool split = settings.split_rngs.empty();
    if (!settings.split_rngs.empty()) {
      auto it = settings.split_rngs.find(stream);
      if (it == settings.split_rngs.end()) continue;  // not lifted into the body
      split = it->second;
    }
    if (split) plan.split_keys.emplace_back(stream, rng::split(entry.rngs.at(stream), length));
    else plan.broadcast_keys.emplace_back(stream, entry.rngs.at(stream));
  }
  plan.counters = entry.rng_counters;
  return plan;
}

ScopeState iteration_state(const ScanPlan& plan, int i) {
  ScopeState st = plan.pack->fresh();  // mutability and lifted selection of the scan's scope
  st.variables = plan.shared.variables;
  st.created = Tree();
  st.touched.clear();
  st.rng_counters = plan.counters;
  st.rngs = rng::Streams();
  st.lift_note = plan.outer_note;
  if (!plan.settings.split_rngs.empty()) {  // streams not listed do not reach the body
    std::set<std::string, std::less<>> visible;
    for (const auto& [stream, _] : plan.split_keys) visible.insert(stream);
    for (const auto& [stream, _] : plan.broadcast_keys) visible.insert(stream);
    st.lifted_streams = std::move(visible);
    st.lift_note = linum::detail::cat("lift::scan at '", join(plan.path), "' (split_rngs)");
  }
  for (const auto& [stream, keys] : plan.split_keys) st.rngs.set(stream, keys[static_cast<std::size_t>(i)]);
  for (const auto& [stream, key] : plan.broadcast_keys) st.rngs.set(stream, key);
  const std::string prefix = join(plan.path);
  for (const auto& [collection, leaves] : plan.slices) {
    Tree& c = st.variables[collection];
    for (const auto& [leaf_path, values] : leaves)
      c.set_path(prefix.empty() ? leaf_path : prefix + "/" + leaf_path, Tree(values[static_cast<std::size_t>(i)]));
  }
  return st;
}

void after_iteration(ScanPlan& plan, const ScopeState& st, bool discarded) {
  const std::string prefix = join(plan.path);
  for (const auto& [collection, tree] : st.variables) {
    int axis = 0;
    const Role role = role_of(plan.settings, plan.path, collection, &axis);
    if (role == Role::axis || (discarded && role == Role::carry)) continue;
    const Tree* sub = at_prefix(tree, prefix);
    if (sub == nullptr) continue;
    // Carry: the next iteration starts from this one's values. Broadcast: created once, then shared.
    put_at_prefix(plan.shared.variables[collection], prefix, *sub);
  }
}

bool drew_keys(const ScanPlan& plan, const ScopeState& st) { return st.rng_counters != plan.counters; }

void continue_counters(ScanPlan& plan, const ScopeState& st) { plan.counters = st.rng_counters; }

void finish_scan(const ScanPlan& plan, const std::vector<ScopeState>& states) {
  const std::string prefix = join(plan.path);
  ScopeState result;
  // Axis collections: what the iterations hold, stacked along their axis (slice order).
  for (const auto& [collection, _] : states.front().variables) {
    int axis = 0;
    if (role_of(plan.settings, plan.path, collection, &axis) != Role::axis) continue;
    if (!plan.pack->entry().is_mutable(collection)) continue;  // read-only here: nothing to give back
    std::vector<std::vector<std::pair<std::string, Array>>> per_layer;
    for (const ScopeState& st : states) {
      const Tree& c = st.variables.at(collection);
      const Tree* sub = at_prefix(c, prefix);
      per_layer.push_back(sub ? flatten(*sub) : std::vector<std::pair<std::string, Array>>{});
    }
    std::vector<std::pair<std::string, Array>> stacked;
    for (std::size_t k = 0; k < per_layer.front().size(); ++k) {
      std::vector<Array> values;
      for (std::size_t i = 0; i < per_layer.size(); ++i) {
        if (per_layer[i].size() != per_layer.front().size() || per_layer[i][k].first != per_layer.front()[k].first)
          throw ValueError(linum::detail::cat("lift::scan at '", prefix, "': iteration ", i, " has different '", collection,
                                              "' variables than iteration 0; every iteration must create the same ones"));
        values.push_back(per_layer[i][k].second);
      }
      stacked.emplace_back(per_layer.front()[k].first, front_to_axis(stack(values), axis));
    }
    if (stacked.empty()) continue;
    put_at_prefix(result.variables[collection], prefix, unflatten(stacked));
  }
  // Broadcast and carry collections: as they stand after the last iteration.
  for (const auto& [collection, tree] : plan.shared.variables) result.variables[collection] = tree;
  for (const ScopeState& st : states) result.touched.insert(st.touched.begin(), st.touched.end());
  // Counters: as Flax's shared counter dict ends (every iteration ends at the same values).
  result.rng_counters = states.front().rng_counters;
  plan.pack->publish(result);
}

}  // namespace linum::lift::detail
