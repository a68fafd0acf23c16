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
  const ScopeState& outer = s.state();
  for (const std::string& stream : outer.rngs.names()) {
    if (outer.lifted_streams && !outer.lifted_streams->count(stream)) continue;
    layers.streams.push_back(stream);
    layers.base_keys.push_back(s.make_rng(stream));
  }
  const std::string prefix = join(layers.path);
  for (const auto& [collection, tree] : outer.variables) {
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

ScopeState layer_state(const ScopeState& outer, const ScanLayers& layers, int i) {
  ScopeState st;
  st.initializing = outer.initializing;
  st.all_mutable = outer.all_mutable;
  st.mutable_collections = outer.mutable_collections;
  st.lifted_collections = outer.lifted_collections;
  st.lifted_streams = outer.lifted_streams;
  st.lift_note = outer.lift_note;
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

void finish_scan(ScopeState& outer, const ScanLayers& layers, const std::vector<ScopeState>& states) {
  const std::string prefix = join(layers.path);
  // Collections the layers may have written (or created, at init).
  std::vector<std::string> collections;
  for (const auto& [name, _] : states.front().variables)
    if (outer.is_mutable(name)) collections.push_back(name);
  for (const std::string& collection : collections) {
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
    if (prefix.empty()) outer.variables[collection] = t;
    else outer.variables[collection].set_path(prefix, t);
  }
  for (const ScopeState& st : states)
    for (const std::string& path : st.touched) outer.touched.insert(path);
}

}  // namespace linum::lift::detail
