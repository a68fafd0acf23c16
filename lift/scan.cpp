#include <linum/lift/scan.hpp>

#include <linum/core/ops/shape_ops.hpp>
#include <linum/rng/key.hpp>

namespace linum::lift::detail {
namespace {

std::string join(const std::vector<std::string>& parts) { return linum::detail::join_module_path(parts); }

}  // namespace

ScanLayers prepare_scan(Scope& s, int length) {
  ScanLayers layers;
  layers.path = s.path();
  layers.outer_note = s.state().lift_note;
  const ScopeState& outer = s.state();
  // The scan's own keys first (drawing advances this scope's counters, which the pack then sees).
  for (const std::string& stream : outer.rngs.names()) {
    if (outer.lifted_streams && !outer.lifted_streams->count(stream)) continue;
    layers.streams.push_back(stream);
    layers.base_keys.push_back(s.make_rng(stream));
  }
  layers.pack.emplace(s, LiftFilters{}, "lift::scan");
  const std::string prefix = join(layers.path);
  for (const auto& [collection, tree] : layers.pack->entry().variables) {
    if (!tree.contains_path(prefix)) continue;
    std::vector<std::pair<std::string, std::vector<Array>>> leaves;
    for (const auto& [leaf_path, stacked] : flatten(tree.at_path(prefix))) {
      if (stacked.rank() == 0 || stacked.dim(0) != length)
        throw ShapeError(linum::detail::cat("lift::scan at '", prefix, "': variable '", collection, "/", prefix, "/", leaf_path,
                                            "' has shape ", stacked.shape(), " but a scan of ", length,
                                            " layers needs a leading axis of ", length,
                                            " (the dict may come from a scan of another length)"));
      leaves.emplace_back(leaf_path, unstack(stacked));
    }
    layers.slices.emplace_back(collection, std::move(leaves));
  }
  return layers;
}

ScopeState layer_state(const ScanLayers& layers, int i) {
  ScopeState st = layers.pack->fresh();  // mutability and lifted selection of the scan's scope
  st.variables = Tree();
  st.rng_counters.clear();
  st.rngs = rng::Streams();
  st.lift_note = layers.outer_note;
  for (std::size_t k = 0; k < layers.streams.size(); ++k)
    st.rngs.set(layers.streams[k], rng::fold_in(layers.base_keys[k], static_cast<std::uint32_t>(i)));
  const std::string prefix = join(layers.path);
  for (const auto& [collection, leaves] : layers.slices) {
    Tree& c = st.variables[collection];
    for (const auto& [leaf_path, values] : leaves)
      c.set_path(prefix.empty() ? leaf_path : prefix + "/" + leaf_path, Tree(values[static_cast<std::size_t>(i)]));
  }
  return st;
}

void finish_scan(const ScanLayers& layers, const std::vector<ScopeState>& states) {
  const std::string prefix = join(layers.path);
  // What the layers wrote (or created, at init), stacked along a new leading axis.
  ScopeState stacked_state;
  for (const auto& [collection, _] : states.front().variables) {
    if (!layers.pack->entry().is_mutable(collection)) continue;  // read-only here: nothing to give back
    std::vector<std::vector<std::pair<std::string, Array>>> per_layer;
    for (const ScopeState& st : states) {
      const Tree& c = st.variables.at(collection);
      per_layer.push_back(prefix.empty() ? flatten(c) : (c.contains_path(prefix) ? flatten(c.at_path(prefix))
                                                                               : std::vector<std::pair<std::string, Array>>{}));
    }
    std::vector<std::pair<std::string, Array>> stacked;
    for (std::size_t k = 0; k < per_layer.front().size(); ++k) {
      std::vector<Array> values;
      for (std::size_t i = 0; i < per_layer.size(); ++i) {
        if (per_layer[i].size() != per_layer.front().size() || per_layer[i][k].first != per_layer.front()[k].first)
          throw ValueError(linum::detail::cat("lift::scan at '", prefix, "': layer ", i, " has different '", collection,
                                              "' variables than layer 0; every layer of a scan must create the same ones"));
        values.push_back(per_layer[i][k].second);
      }
      stacked.emplace_back(per_layer.front()[k].first, stack(values));
    }
    if (stacked.empty()) continue;
    Tree t = unflatten(stacked);
    if (prefix.empty()) stacked_state.variables[collection] = t;
    else stacked_state.variables[collection].set_path(prefix, t);
  }
  for (const ScopeState& st : states) stacked_state.touched.insert(st.touched.begin(), st.touched.end());
  layers.pack->publish(stacked_state);
}

}  // namespace linum::lift::detail
