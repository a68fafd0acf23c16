// ScopeState's operations for lifted transforms: selecting the state a transform runs on,
// publishing its results back, and the base state its recomputations start from.
#include <linum/modules/scope.hpp>

#include <algorithm>

namespace linum::detail {
namespace {

// True when the module path `where` is `prefix` or below it ("" is above everything).
bool under(std::string_view where, const std::string& prefix) {
  return prefix.empty() || where == prefix ||
         (where.size() > prefix.size() && where.compare(0, prefix.size(), prefix) == 0 && where[prefix.size()] == '/');
}

bool listed(const std::optional<std::vector<std::string>>& filter, std::string_view name) {
  return !filter || std::find(filter->begin(), filter->end(), name) != filter->end();
}

// The subtree of `collection` at `path` ("" = all of it), if present.
const Tree* subtree(const Tree& collection, const std::string& path) {
  if (path.empty()) return &collection;
  return collection.contains_path(path) ? &collection.at_path(path) : nullptr;
}

void put_subtree(Tree& collection, const std::string& path, const Tree& value) {
  if (path.empty()) collection = value;
  else collection.set_path(path, value);
}

// The names of `filter` (all when unset) that an enclosing selection `outer` (all when unset) allows.
std::optional<std::set<std::string, std::less<>>> narrowed(const std::optional<std::vector<std::string>>& filter,
                                                           const std::optional<std::set<std::string, std::less<>>>& outer) {
  if (outer) {
    std::set<std::string, std::less<>> both;
    for (const auto& name : *outer)
      if (listed(filter, name)) both.insert(name);
    return both;
  }
  if (filter) return std::set<std::string, std::less<>>(filter->begin(), filter->end());
  return std::nullopt;
}

}  // namespace

ScopeState ScopeState::lifted(const std::vector<std::string>& path, const LiftSelection& selection) const {
  ScopeState inner;
  const std::string prefix = join_module_path(path);
  inner.initializing = initializing;
  inner.lift_note = selection.note;
  inner.lifted_collections = narrowed(selection.collections, lifted_collections);
  inner.lifted_streams = narrowed(selection.streams, lifted_streams);
  auto visible = [&](std::string_view c) { return !inner.lifted_collections || inner.lifted_collections->count(c); };
  for (const auto& [name, collection] : variables) {
    if (!visible(name)) continue;
    Tree& mine = inner.variables[name];
    if (const Tree* t = subtree(collection, prefix)) put_subtree(mine, prefix, *t);
  }
  // Mutability: what is mutable here and lifted.
  if (all_mutable && !inner.lifted_collections) {
    inner.all_mutable = true;
  } else {
    for (const auto& [name, _] : variables)
      if (visible(name) && is_mutable(name)) inner.mutable_collections.insert(name);
    for (const auto& name : mutable_collections)
      if (visible(name)) inner.mutable_collections.insert(name);
    if (all_mutable && inner.lifted_collections)
      for (const auto& name : *inner.lifted_collections) inner.mutable_collections.insert(name);
  }
  // Streams and their counters under this path.
  for (const std::string& name : rngs.names())
    if (!inner.lifted_streams || inner.lifted_streams->count(name)) inner.rngs.set(name, rngs.at(name));
  for (const auto& [key, count] : rng_counters)
    if (under(key.path, prefix) && inner.rngs.has(key.stream)) inner.rng_counters.emplace(key, count);
  return inner;
}

void ScopeState::publish(const std::vector<std::string>& path, const ScopeState& inner) {
  const std::string prefix = join_module_path(path);
  for (const auto& [name, collection] : inner.variables) {
    if (!is_mutable(name)) continue;
    const Tree* t = subtree(collection, prefix);
    if (t == nullptr) continue;
    put_subtree(variables[name], prefix, *t);
  }
  for (const auto& [key, count] : inner.rng_counters) rng_counters[key] = count;
  touched.insert(inner.touched.begin(), inner.touched.end());
}

ScopeState ScopeState::replay_base(const ScopeState& after) const {
  ScopeState base = *this;
  base.initializing = false;
  // Variables the forward pass created exist for the recomputation, which creates none, at the
  // values they were created with (a variable created and then updated in the same call must be
  // seen as it was when created, as on entry).
  for (const auto& [name, collection] : after.created) {
    Tree& mine = base.variables[name];
    for (const auto& [leaf_path, value] : flatten(collection))
      if (!mine.contains_path(leaf_path)) mine.set_path(leaf_path, Tree(value));
  }
  for (const auto& [name, collection] : after.variables) {
    Tree& mine = base.variables[name];
    for (const auto& [leaf_path, value] : flatten(collection))
      if (!mine.contains_path(leaf_path)) mine.set_path(leaf_path, Tree(value));
  }
  return base;
}

}  // namespace linum::detail
