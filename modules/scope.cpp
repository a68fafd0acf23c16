#include <linum/modules/scope.hpp>

#include <optional>
#include <utility>

#include <linum/core/memory.hpp>
#include <linum/core/ops/elementwise.hpp>

#include <cxxabi.h>

#include <algorithm>

#include <cstdlib>
#include <memory>

namespace linum {

namespace detail {

std::string join_module_path(const std::vector<std::string>& parts) {
  std::string s;
  for (const std::string& p : parts) s += (s.empty() ? "" : "/") + p;
  return s;
}

std::string demangled_type_name(const char* mangled) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> demangled(abi::__cxa_demangle(mangled, nullptr, nullptr, &status), std::free);
  std::string name = status == 0 && demangled ? demangled.get() : mangled;
  // Drop template arguments, then namespaces: "linum::nn::Block<3>" -> "Block".
  if (auto lt = name.find('<'); lt != std::string::npos) name.erase(lt);
  if (auto colon = name.rfind("::"); colon != std::string::npos) name.erase(0, colon + 2);
  return name;
}

namespace {
// The innermost value of a context holding a pointer, or null.
template <class Context>
auto innermost(const typename Context::Value fallback = nullptr) {
  const auto* v = ContextStack<Context>::top();
  return v != nullptr ? *v : fallback;
}
}  // namespace

std::vector<ModuleCallHook*> hooks_for(const ModuleCall& call) {
  std::vector<ModuleCallHook*> hooks;
  for (auto* e = ContextStack<ModuleCallHookContext>::innermost(); e != nullptr; e = e->below())
    if (e->value()->wants(call)) hooks.push_back(e->value());
  std::reverse(hooks.begin(), hooks.end());  // outermost first
  return hooks;
}

std::vector<Array> run_hooks(Scope& scope, const ModuleCall& call, const std::vector<ModuleCallHook*>& hooks,
                             const ModuleCallBody& body) {
  // Hook i runs with `next` = hooks i+1.. and then the body, on whatever scope it is given.
  std::function<std::vector<Array>(std::size_t, Scope&)> from = [&](std::size_t i, Scope& s) -> std::vector<Array> {
    if (i == hooks.size()) return body(s);
    const ModuleCallBody next = [&from, i](Scope& inner) { return from(i + 1, inner); };
    return hooks[i]->around(s, call, next, body);
  };
  return from(0, scope);
}
const std::vector<std::string>* current_module_path() { return innermost<ModulePathContext>(); }

// Memory timelines tag each op with the module path running it.
namespace {
std::string timeline_module_path() {
  const std::vector<std::string>* path = current_module_path();
  return path != nullptr ? join_module_path(*path) : std::string();
}
[[maybe_unused]] const bool g_timeline_path_registered =
    (linum::memory::detail::set_timeline_path_provider(&timeline_module_path), true);
}  // namespace

void ScopeState::check_collection_visible(std::string_view collection, std::string_view module_path) const {
  if (!lifted_collections || lifted_collections->count(collection)) return;
  std::string lifted;
  for (const auto& c : *lifted_collections) lifted += (lifted.empty() ? "" : ", ") + c;
  throw ValueError(detail::cat("module '", module_path, "' uses collection '", collection, "', which is not lifted into ",
                               lift_note, " (lifted collections: [", lifted, "]); add it to lift::variables<...>"));
}

}  // namespace detail

namespace detail {
namespace {
thread_local std::optional<std::vector<std::string>> pending_axis_names;
}
void set_pending_param_axis_names(std::vector<std::string> names) { pending_axis_names = std::move(names); }
}  // namespace detail

namespace {
std::string join(const std::vector<std::string>& parts) { return detail::join_module_path(parts); }

// Why `collection/path` is not in `vars`, in terms of what is there instead: the first part of the
// path that is an array where a dict should be, or the dict that lacks the next key (with its keys).
std::string what_is_there(const Tree& vars, const std::string& collection, const std::string& path) {
  if (!vars.contains(collection)) {
    std::string keys;
    for (const std::string& k : vars.keys()) keys += (keys.empty() ? "" : ", ") + ("'" + k + "'");
    return detail::cat(" (the dict has no \"", collection, "\" collection; its top-level entries are ",
                       keys.empty() ? std::string("none") : keys, ")");
  }
  const Tree* node = &vars.at(collection);
  std::string at = collection;
  std::size_t start = 0;
  while (start <= path.size()) {
    if (node->is_leaf())
      return detail::cat(" ('", at, "' is an array of shape ", node->array().shape(), " where a dict is expected)");
    const std::size_t slash = path.find('/', start);
    const std::string key = path.substr(start, slash == std::string::npos ? std::string::npos : slash - start);
    if (!node->contains(key)) {
      std::string keys;
      int shown = 0;
      for (const std::string& k : node->keys()) {
        if (shown++ == 8) {
          keys += ", ...";
          break;
        }
        keys += (keys.empty() ? "" : ", ") + ("'" + k + "'");
      }
      return detail::cat(" ('", at, "' has no entry '", key, "'; its entries are ", keys.empty() ? std::string("none") : keys, ")");
    }
    node = &node->at(key);
    at += "/" + key;
    if (slash == std::string::npos) break;
    start = slash + 1;
  }
  return "";
}
}  // namespace

// ---- Variable -------------------------------------------------------------------------------------

const Array& Variable::value() const {
  const Tree& collection = state_->variables.at(collection_);
  return collection.at_path(path_).array();
}

void Variable::set(Array value) const {
  if (auto it = state_->read_only.find(collection_); it != state_->read_only.end())
    throw ValueError(detail::cat("cannot write variable '", collection_, "/", path_, "': ", it->second));
  if (!state_->is_mutable(collection_))
    throw ValueError(detail::cat("cannot write variable '", collection_, "/", path_, "': collection '", collection_,
                                 "' is not mutable in this apply call; pass it in ApplyOptions::mutable_collections "
                                 "(e.g. {.mutable_collections = {\"", collection_, "\"}})"));
  const Tree& vars = state_->variables;
  const bool exists = vars.contains(collection_) && vars.at(collection_).contains_path(path_);
  const Array old = exists ? vars.at(collection_).at_path(path_).array() : Array();
  if (old.defined() && !(old.shape() == value.shape()))
    throw ShapeError(detail::cat("variable '", collection_, "/", path_, "' has shape ", old.shape(),
                                 "; cannot set a value of shape ", value.shape()));
  state_->variables[collection_].set_path(path_, Tree(std::move(value)));
}

// ---- Scope ----------------------------------------------------------------------------------------

std::string Scope::path_str() const { return path_.empty() ? std::string("<root>") : join(path_); }

std::string Scope::full_path(std::string_view name) const {
  std::string p = join(path_);
  return p.empty() ? std::string(name) : p + "/" + std::string(name);
}

Scope Scope::child_scope(std::string name) const {
  if (name.empty() || name.find('/') != std::string::npos)
    throw ValueError(detail::cat("module name '", name, "' under '", path_str(),
                                 "' is invalid: names must be non-empty and must not contain '/'"));
  std::vector<std::string> p = path_;
  p.push_back(std::move(name));
  return Scope(*state_, std::move(p));
}

std::string Scope::next_auto_name(const std::string& type_name) {
  int& n = auto_name_counts_[type_name];
  return type_name + "_" + std::to_string(n++);
}

Array Scope::param(std::string_view name, const Initializer& init, const Shape& shape) {
  const std::string path = full_path(name);
  const std::string full = "params/" + path;
  state_->check_collection_visible("params", path_str());
  state_->touched.insert(full);
  Tree& vars = state_->variables;
  if (vars.contains("params") && vars.at("params").contains_path(path)) {
    const Tree& entry = vars.at("params").at_path(path);
    if (!entry.is_leaf())
      throw ValueError(detail::cat("param '", full, "' is a dict in the variable dict, not an array"));
    const Array& value = entry.array();
    if (const auto* hook = detail::ContextStack<detail::ParamReadHookContext>::top()) {
      if (std::optional<Array> seen = (*hook)->read(full, value, shape)) {
        if (!(seen->shape() == shape))
          throw ShapeError(detail::cat("param '", full, "': the param-read hook returned shape ", seen->shape(),
                                       " where the module asks for ", shape));
        return *seen;
      }
    }
    if (!(value.shape() == shape))
      throw ShapeError(detail::cat("param '", full, "' has shape ", value.shape(), " in the variable dict but the module asks for ",
                                   shape, "; the inputs differ from those used at init (or the dict belongs to another model)"));
    return value;
  }
  if (!state_->initializing) {
    auto& missing = state_->missing_params;
    const auto listed = [&](const auto& m) { return m.first == full; };
    if (std::any_of(missing.begin(), missing.end(), listed)) return Array::zeros(shape);  // a shared module's, listed
    const std::string why = detail::cat("param '", full, "' of shape ", shape, " is missing from the variable dict",
                                        what_is_there(vars, "params", path));
    if (!state_->defer_missing_params) throw ValueError(why + "; pass the dict returned by init for this model");
    // Reported by apply once the model has run, together with every other missing param and every
    // unused entry (a dict from another model shows all its differences at once). Zeros stand in
    // meanwhile.
    missing.emplace_back(full, missing.empty() ? detail::cat(why, " (in module '", path_str(), "')")
                                               : detail::cat(full, " ", shape));
    return Array::zeros(shape);
  }
  detail::pending_axis_names.reset();
  Array value = init(make_rng("params"), shape);
  std::optional<std::vector<std::string>> names = std::exchange(detail::pending_axis_names, std::nullopt);
  if (!(value.shape() == shape))
    throw ShapeError(detail::cat("the initializer of param '", full, "' returned shape ", value.shape(), " for shape ", shape));
  Tree leaf(value);
  if (names) {
    try {
      leaf = leaf.with_axis_names(std::move(*names));
    } catch (const ShapeError& e) {
      throw ShapeError(detail::cat("param '", full, "': ", e.what()));
    }
  }
  vars["params"].set_path(path, leaf);
  state_->created["params"].set_path(path, leaf);
  return value;
}

Variable Scope::variable(std::string_view collection, std::string_view name, const std::function<Array()>& init) {
  const std::string path = full_path(name);
  const std::string coll(collection);
  state_->check_collection_visible(coll, path_str());
  state_->touched.insert(coll + "/" + path);
  Tree& vars = state_->variables;
  const bool exists = vars.contains(coll) && vars.at(coll).contains_path(path);
  if (!exists) {
    if (!state_->initializing && !state_->is_mutable(coll))
      throw ValueError(detail::cat("variable '", coll, "/", path, "' is missing from the variable dict",
                                   what_is_there(vars, coll, path),
                                   "; pass the full dict returned by init (e.g. {\"params\": ..., \"", coll,
                                   "\": ...}), or make the collection mutable to create it"));
    Array value = init();
    state_->created[coll].set_path(path, Tree(value));
    vars[coll].set_path(path, Tree(std::move(value)));
  }
  return Variable(state_, coll, path, path_str());
}

bool Scope::has_variable(std::string_view collection, std::string_view name) const {
  const Tree& vars = state_->variables;
  return vars.contains(collection) && vars.at(collection).contains_path(full_path(name));
}

rng::Key Scope::make_rng(std::string_view stream) {
  if (state_->lifted_streams && !state_->lifted_streams->count(stream)) {
    std::string lifted;
    for (const auto& c : *state_->lifted_streams) lifted += (lifted.empty() ? "" : ", ") + c;
    throw ValueError(detail::cat("module '", path_str(), "' draws from rng stream '", stream, "', which is not lifted into ",
                                 state_->lift_note, " (lifted streams: [", lifted, "]); add it to lift::rngs<...>"));
  }
  std::uint64_t& count = state_->rng_counters[detail::RngCounterKey{std::string(stream), join(path_)}];
  ++count;
  return state_->rngs.derive(stream, path_, count);
}

bool Scope::sow(std::string_view collection, std::string_view name, const Array& value) {
  return sow(collection, name, std::vector<Array>{value});
}

bool Scope::sow(std::string_view collection, std::string_view name, const std::vector<Array>& values) {
  const std::string coll(collection);
  if (state_->lifted_collections && !state_->lifted_collections->count(coll)) return false;
  if (!state_->is_mutable(coll) || (state_->initializing && coll == "intermediates" && !state_->mutable_collections.count(coll)))
    return false;
  const std::string base = full_path(name);
  Tree& c = state_->variables[coll];
  int i = 0;
  while (c.contains_path(base + "/" + std::to_string(i))) ++i;
  const std::string at = base + "/" + std::to_string(i);
  if (values.size() == 1) {
    c.set_path(at, Tree(values[0]));
  } else {
    Tree tuple;  // {"0": ..., "1": ...}, as flax.serialization stores a tuple (an empty one: {})
    for (std::size_t k = 0; k < values.size(); ++k) tuple.set(std::to_string(k), Tree(values[k]));
    c.set_path(at, std::move(tuple));
  }
  return true;
}

bool Scope::sow(std::string_view collection, std::string_view name, const Array& value,
               const std::function<Array(const Array&, const Array&)>& reduce, const std::function<Array()>& init) {
  if (!reduce || !init) throw ValueError("sow: reduce and init must both be callables (or use sow without them, which appends)");
  const std::string coll(collection);
  if (state_->lifted_collections && !state_->lifted_collections->count(coll)) return false;
  if (!state_->is_mutable(coll) || (state_->initializing && coll == "intermediates" && !state_->mutable_collections.count(coll)))
    return false;
  const std::string at = full_path(name);
  Tree& c = state_->variables[coll];
  if (c.contains_path(at) && !c.at_path(at).is_leaf())
    throw ValueError(detail::cat("sow: '", coll, "/", at, "' holds appended values (a sow without reduce); use one kind of "
                                 "sow per name"));
  const Array previous = c.contains_path(at) ? c.at_path(at).array() : init();
  c.set_path(at, Tree(reduce(previous, value)));
  return true;
}

Array Scope::perturb(std::string_view name, const Array& value, std::string_view collection) {
  const std::string coll(collection);
  if (state_->is_mutable(coll) && !has_variable(coll, name))
    (void)variable(coll, name, [&] { return Array::zeros(value.shape(), value.dtype()); });
  if (!state_->variables.contains(coll)) return value;
  if (!has_variable(coll, name))
    throw ValueError(detail::cat("perturb: the variable dict has a '", coll, "' collection but no entry '", full_path(name),
                                 "'; pass the '", coll, "' that init returned for this model (or leave the collection out)"));
  const Array& delta = variable(coll, name, [] { return Array(); }).value();
  if (delta.shape() != value.shape())
    throw ShapeError(detail::cat("perturb: '", coll, "/", full_path(name), "' is ", delta.type_str(), " but the value it perturbs is ",
                                 value.type_str(), "; pass the '", coll, "' that init returned for this model"));
  return value + delta;
}

void Scope::mark_timeline_return() const noexcept {
  try {
    memory::detail::timeline_mark("return", detail::join_module_path(path_));
  } catch (...) {  // a timeline point that cannot be stored is not worth failing the call for
  }
}

void Scope::rethrow_with_path(const std::string& type_name) const {
  try {
    throw;
  } catch (Error& e) {
    e.set_module(path_str(), type_name);  // the innermost module names itself; the type is kept
    throw;
  }
}

}  // namespace linum
