// lift::scan's state handling: which role each collection plays, the variables' slices, the keys
// per iteration (Flax's split), the counters, and stacking and publishing the results.
#include <linum/lift/scan.hpp>

#include <linum/lift/mapped_state_internal.hpp>

#include <linum/rng/key.hpp>

#include <algorithm>
#include <mutex>

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

}  // namespace

void throw_scan_error(const std::vector<std::string>& path, const std::string& what) {
  throw ValueError(linum::detail::cat("lift::scan at '", path.empty() ? std::string("<root>") : join(path), "': ", what));
}

int scanned_axis(const Array& a, int axis, const std::vector<std::string>& path) {
  const int r = a.rank();
  if (axis < -r || axis >= r)
    throw_scan_error(path, linum::detail::cat("axis ", axis, " is out of range for a scanned value of shape ", a.shape(),
                                              "; give an axis in [-", r, ", ", r, ")"));
  return axis < 0 ? axis + r : axis;
}

ScanPlan plan_scan(Scope& s, const ScanSettings& settings, int length) {
  ScanPlan plan;
  plan.path = s.path();
  plan.settings = settings;
  plan.length = length;
  for (const auto& [c, axis] : settings.variable_axes)
    if (axis < 0) throw_scan_error(plan.path, linum::detail::cat("variable_axes['", c, "'] is ", axis, "; use an axis >= 0"));
  plan.pack.emplace(s, LiftFilters{}, "lift::scan");
  const Pack& pack = *plan.pack;
  const std::string prefix = join(plan.path);
  // Variables.
  for (const auto& [collection, tree] : pack.variables()) {
    const Tree* sub = at_prefix(tree, prefix);
    if (sub == nullptr) continue;
    int axis = 0;
    switch (role_of(settings, plan.path, collection, &axis)) {
      case Role::broadcast:
      case Role::carry:
        put_at_prefix(plan.shared[collection], prefix, *sub);
        break;
      case Role::axis: {
        std::vector<std::pair<std::string, std::vector<Array>>> leaves;
        for (const auto& [leaf_path, stacked] : flatten(*sub)) {
          if (stacked.rank() <= axis || stacked.dim(axis) != length)
            throw ShapeError(linum::detail::cat("lift::scan at '", prefix, "': variable '", collection, "/", prefix, "/",
                                                leaf_path, "' has shape ", stacked.shape(), " but a scan of ", length,
                                                " iterations needs ", axis == 0 ? std::string("a leading axis") : linum::detail::cat("an axis ", axis), " of ", length,
                                                " (the dict may come from a scan of another length)"));
          // Views of the stacked variable (no copy per iteration) where the slices stay aligned.
          leaves.emplace_back(leaf_path, unstack(axis_to_front(stacked, axis), {.views = true}));
        }
        plan.slices.emplace_back(collection, std::move(leaves));
        break;
      }
    }
  }
  // Streams: split (one key per slice), broadcast, or not passed in.
  BodyStreams streams = body_streams(pack, settings.split_rngs, length);
  plan.split_keys = std::move(streams.split);
  plan.broadcast_keys = std::move(streams.broadcast);
  plan.counters = pack.counters();
  return plan;
}

ScopeState iteration_state(const ScanPlan& plan, int i) {
  rng::Streams streams;
  for (const auto& [stream, keys] : plan.split_keys) streams.set(stream, keys[static_cast<std::size_t>(i)]);
  for (const auto& [stream, key] : plan.broadcast_keys) streams.set(stream, key);
  Tree variables = plan.shared;
  const std::string prefix = join(plan.path);
  for (const auto& [collection, leaves] : plan.slices) {
    Tree& c = variables[collection];
    for (const auto& [leaf_path, values] : leaves)
      c.set_path(prefix.empty() ? leaf_path : prefix + "/" + leaf_path, Tree(values[static_cast<std::size_t>(i)]));
  }
  return body_state(*plan.pack, std::move(variables), std::move(streams), plan.counters, plan.settings.split_rngs,
                    {plan.split_keys, plan.broadcast_keys}, linum::detail::cat("lift::scan at '", join(plan.path), "' (split_rngs)"));
}

void after_iteration(ScanPlan& plan, const ScopeState& st, bool discarded) {
  const std::string prefix = join(plan.path);
  for (const auto& [collection, tree] : Pack::variables_of(st)) {
    int axis = 0;
    const Role role = role_of(plan.settings, plan.path, collection, &axis);
    if (role == Role::axis || (discarded && role == Role::carry)) continue;
    const Tree* sub = at_prefix(tree, prefix);
    if (sub == nullptr) continue;
    // Carry: the next iteration starts from this one's values. Broadcast: created once, then shared.
    put_at_prefix(plan.shared[collection], prefix, *sub);
  }
}

bool drew_keys(const ScanPlan& plan, const ScopeState& st) { return Pack::counters_of(st) != plan.counters; }

void continue_counters(ScanPlan& plan, const ScopeState& st) { plan.counters = Pack::counters_of(st); }

namespace {

struct Prediction {
  std::string body, path;
  RngCounters entry, after_first_run;
};

std::mutex g_predictions_mutex;
std::vector<Prediction> g_predictions;  // the most recent last; a few per process
constexpr std::size_t kMaxPredictions = 64;

std::uint64_t count_at(const RngCounters& c, const linum::detail::RngCounterKey& k) {
  auto it = c.find(k);
  return it == c.end() ? 0 : it->second;
}

}  // namespace

std::optional<RngCounters> predicted_counters(const std::string& body, const ScanPlan& plan) {
  const std::string path = join(plan.path);
  std::lock_guard<std::mutex> lock(g_predictions_mutex);
  for (auto it = g_predictions.rbegin(); it != g_predictions.rend(); ++it)
    if (it->body == body && it->path == path && it->entry == plan.counters) return it->after_first_run;
  return std::nullopt;
}

void remember_counters(const std::string& body, const ScanPlan& plan, const RngCounters& entry,
                       const RngCounters& after_first_run) {
  const std::string path = join(plan.path);
  std::lock_guard<std::mutex> lock(g_predictions_mutex);
  std::erase_if(g_predictions, [&](const Prediction& p) { return p.body == body && p.path == path && p.entry == entry; });
  if (g_predictions.size() >= kMaxPredictions) g_predictions.erase(g_predictions.begin());
  g_predictions.push_back({body, path, entry, after_first_run});
}

bool prediction_held(const RngCounters& entry, const RngCounters& predicted, const RngCounters& after_iteration) {
  // Every key any of the three names: entry + (what iteration 0 drew) must be the prediction.
  std::vector<linum::detail::RngCounterKey> keys;
  for (const RngCounters* c : {&entry, &predicted, &after_iteration})
    for (const auto& [k, _] : *c) keys.push_back(k);
  for (const auto& k : keys) {
    const std::uint64_t start = count_at(predicted, k), end = count_at(after_iteration, k);
    if (end < start || count_at(entry, k) + (end - start) != start) return false;
  }
  return true;
}

void forget_predicted_counters() {
  std::lock_guard<std::mutex> lock(g_predictions_mutex);
  g_predictions.clear();
}

void finish_scan(const ScanPlan& plan, const std::vector<ScopeState>& states) {
  const std::string prefix = join(plan.path);
  Tree result;
  // Axis collections: what the iterations hold, stacked along their axis (slice order).
  for (const auto& [collection, _] : Pack::variables_of(states.front())) {
    int axis = 0;
    if (role_of(plan.settings, plan.path, collection, &axis) != Role::axis) continue;
    if (!plan.pack->is_mutable(collection)) continue;  // read-only here: nothing to give back
    std::vector<std::vector<std::pair<std::string, Array>>> per_layer;
    for (const ScopeState& st : states) {
      const Tree& c = Pack::variables_of(st).at(collection);
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
    put_at_prefix(result[collection], prefix, unflatten(stacked));
  }
  // Broadcast and carry collections: as they stand after the last iteration.
  for (const auto& [collection, tree] : plan.shared) result[collection] = tree;
  // Counters: as Flax's shared counter dict ends (every iteration ends at the same values).
  std::vector<const ScopeState*> runs;
  for (const ScopeState& st : states) runs.push_back(&st);
  plan.pack->publish(std::move(result), Pack::counters_of(states.front()), runs);
}

}  // namespace linum::lift::detail
