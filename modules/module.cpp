#include <linum/modules/module.hpp>

namespace linum::detail {

ScopeState ModuleEntry::for_apply(const Tree& variables, const ApplyOptions& options) {
  if (!variables.is_dict())
    throw ValueError("apply: the variables must be a dict of collections such as {\"params\": {...}}, got a single array");
  ScopeState state;
  state.initializing = false;
  state.defer_missing_params = true;
  state.variables = variables;
  state.rngs = options.rngs;
  state.all_mutable = options.all_mutable;
  state.mutable_collections.insert(options.mutable_collections.begin(), options.mutable_collections.end());
  if (options.capture_intermediates) state.mutable_collections.insert("intermediates");
  return state;
}

bool CaptureIntermediates::wants(const ModuleCall& call) const {
  if (call.kind == ModuleCall::Kind::method) return false;  // as Flax's default: __call__ only
  return !filter_ || filter_(join_module_path(call.path), call.type);
}

std::vector<Array> CaptureIntermediates::around(Scope& scope, const ModuleCall&, const ModuleCallBody& next,
                                                const ModuleCallBody&) {
  std::vector<Array> out = next(scope);
  (void)scope.sow("intermediates", "__call__", out);
  return out;
}

CaptureScope::CaptureScope(const ApplyOptions& options) {
  if (!options.capture_intermediates) return;
  hook_ = std::make_unique<CaptureIntermediates>(options.capture_filter);
  guard_ = std::make_unique<ModuleCallHookGuard>(hook_.get());
}

CaptureScope::~CaptureScope() {
  guard_.reset();  // uninstalled before the hook goes
}

void ModuleEntry::check_unused_params(const ScopeState& state, const std::string& module_type) {
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

void ModuleEntry::throw_missing_params(const ScopeState& state, const std::string& module_type) {
  const auto& m = state.missing_params;
  std::string msg = detail::cat("apply(", module_type, "): ", m.front().second);
  if (m.size() > 1) {
    msg += "; also missing: ";
    for (std::size_t i = 1; i < m.size() && i < 11; ++i) msg += (i > 1 ? ", " : "") + m[i].second;
    if (m.size() > 11) msg += detail::cat(", ... (", m.size(), " missing in all)");
  }
  if (state.variables.contains("params") && state.variables.at("params").is_dict()) {
    std::vector<std::string> unused;
    for (const auto& [path, array] : flatten(state.variables.at("params")))
      if (!state.touched.count("params/" + path)) unused.push_back("params/" + path + " " + detail::cat(array.shape()));
    if (!unused.empty()) {
      msg += "; entries the model did not use: ";
      for (std::size_t i = 0; i < unused.size() && i < 10; ++i) msg += (i ? ", " : "") + unused[i];
      if (unused.size() > 10) msg += detail::cat(", ... (", unused.size(), " in all)");
    }
  }
  throw ValueError(msg + ". Pass the dict returned by init for this model (is it the dict of another model, or of "
                         "this model with other hyperparameters?)");
}

Tree ModuleEntry::mutated_collections(const ScopeState& state) {
  Tree out;
  for (const auto& [name, collection] : state.variables)
    if (state.is_mutable(name)) out.set(name, collection);
  return out;
}

ScopeState ModuleEntry::for_init(const rng::Streams& rngs) {
  ScopeState state;
  state.initializing = true;
  state.all_mutable = true;
  state.rngs = rngs;
  return state;
}

Tree ModuleEntry::initialized_variables(ScopeState& state, bool keep_intermediates) {
  if (!keep_intermediates) state.variables.erase("intermediates");
  return std::move(state.variables);
}

}  // namespace linum::detail
