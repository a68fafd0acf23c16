#include <linum/modules/module.hpp>

namespace linum::detail {

void prepare_apply(ScopeState& state, const Tree& variables, const ApplyOptions& options) {
  if (!variables.is_dict())
    throw ValueError("apply: the variables must be a dict of collections such as {\"params\": {...}}, got a single array");
  state.initializing = false;
  state.variables = variables;
  state.rngs = options.rngs;
  state.all_mutable = options.all_mutable;
  state.mutable_collections.insert(options.mutable_collections.begin(), options.mutable_collections.end());
}

void check_unused_params(const ScopeState& state, const std::string& module_type) {
  if (!state.variables.contains("params")) return;
  std::vector<std::string> unused;
  for (const auto& [path, array] : flatten(state.variables.at("params")))
    if (!state.touched.count("params/" + path)) unused.push_back("params/" + path);
  if (unused.empty()) return;
  std::string list;
  for (std::size_t i = 0; i < unused.size() && i < 10; ++i) list += (i ? ", " : "") + unused[i];
  if (unused.size() > 10) list += detail::cat(", ... (", unused.size(), " in all)");
  throw ValueError(detail::cat("apply(", module_type, "): the variable dict has entries the model did not use: ", list,
                               ". Is it the dict of another model? Pass ApplyOptions{.check_unused = false} if the "
                               "model skips them on purpose"));
}

Tree mutated_collections(const ScopeState& state) {
  Tree out;
  for (const auto& [name, collection] : state.variables)
    if (state.is_mutable(name)) out.set(name, collection);
  return out;
}

Tree initialized_variables(ScopeState& state, bool keep_intermediates) {
  if (!keep_intermediates) state.variables.erase("intermediates");
  return std::move(state.variables);
}

}  // namespace linum::detail
