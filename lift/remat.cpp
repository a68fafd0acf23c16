// The lifted state of lift::remat: what a checkpointed module method sees and writes back.
#include <linum/lift/remat.hpp>

namespace linum::lift::detail {
namespace {

std::string join(const std::vector<std::string>& parts) { return linum::detail::join_module_path(parts); }

bool under(std::string_view counter_path, const std::string& prefix) {
  return prefix.empty() || counter_path == prefix ||
         (counter_path.size() > prefix.size() && counter_path.compare(0, prefix.size(), prefix) == 0 &&
          counter_path[prefix.size()] == '/');
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

}  // namespace

std::shared_ptr<ScopeState> make_lifted_state(const ScopeState& outer, const std::vector<std::string>& path,
                                              const LiftFilters& filters) {
  auto lifted = std::make_shared<ScopeState>();
  const std::string prefix = join(path);
  lifted->initializing = outer.initializing;
  lifted->lift_note = "lift::remat at '" + (prefix.empty() ? std::string("<root>") : prefix) + "'";
  if (filters.collections)
    lifted->lifted_collections.emplace(filters.collections->begin(), filters.collections->end());
  if (filters.streams) lifted->lifted_streams.emplace(filters.streams->begin(), filters.streams->end());
  // An enclosing transform's restrictions still apply.
  if (outer.lifted_collections) {
    std::set<std::string, std::less<>> both;
    for (const auto& c : *outer.lifted_collections)
      if (listed(filters.collections, c)) both.insert(c);
    lifted->lifted_collections = std::move(both);
  }
  if (outer.lifted_streams) {
    std::set<std::string, std::less<>> both;
    for (const auto& c : *outer.lifted_streams)
      if (listed(filters.streams, c)) both.insert(c);
    lifted->lifted_streams = std::move(both);
  }
  auto visible = [&](std::string_view c) { return !lifted->lifted_collections || lifted->lifted_collections->count(c); };
  for (const auto& [name, collection] : outer.variables) {
    if (!visible(name)) continue;
    Tree& mine = lifted->variables[name];
    if (const Tree* t = subtree(collection, prefix)) put_subtree(mine, prefix, *t);
  }
  // Mutability: what is mutable outside and lifted.
  if (outer.all_mutable && !lifted->lifted_collections) {
    lifted->all_mutable = true;
  } else {
    for (const auto& [name, _] : outer.variables)
      if (visible(name) && outer.is_mutable(name)) lifted->mutable_collections.insert(name);
    for (const auto& name : outer.mutable_collections)
      if (visible(name)) lifted->mutable_collections.insert(name);
    if (outer.all_mutable && lifted->lifted_collections)
      for (const auto& name : *lifted->lifted_collections) lifted->mutable_collections.insert(name);
  }
  // Streams and their counters under this path.
  for (const std::string& name : outer.rngs.names())
    if (!lifted->lifted_streams || lifted->lifted_streams->count(name)) lifted->rngs.set(name, outer.rngs.at(name));
  for (const auto& [key, count] : outer.rng_counters) {
    const auto nl = key.find('\n');
    const std::string_view stream = std::string_view(key).substr(0, nl);
    const std::string_view where = std::string_view(key).substr(nl + 1);
    if (under(where, prefix) && lifted->rngs.has(stream)) lifted->rng_counters.emplace(key, count);
  }
  return lifted;
}

void write_back(ScopeState& outer, const ScopeState& lifted, const std::vector<std::string>& path) {
  const std::string prefix = join(path);
  for (const auto& [name, collection] : lifted.variables) {
    if (!outer.is_mutable(name)) continue;
    const Tree* t = subtree(collection, prefix);
    if (t == nullptr) continue;
    put_subtree(outer.variables[name], prefix, *t);
  }
  for (const auto& [key, count] : lifted.rng_counters) outer.rng_counters[key] = count;
  outer.touched.insert(lifted.touched.begin(), lifted.touched.end());
}

ScopeState recompute_base(const ScopeState& entry, const ScopeState& after_forward) {
  ScopeState base = entry;
  base.initializing = false;
  // Variables the forward pass created exist for the recomputation, which creates none, at the
  // values they were created with (a variable created and then updated in the same call must be
  // seen as it was when created, as on entry).
  for (const auto& [name, collection] : after_forward.created) {
    Tree& mine = base.variables[name];
    for (const auto& [path, value] : flatten(collection))
      if (!mine.contains_path(path)) mine.set_path(path, Tree(value));
  }
  for (const auto& [name, collection] : after_forward.variables) {
    Tree& mine = base.variables[name];
    for (const auto& [path, value] : flatten(collection))
      if (!mine.contains_path(path)) mine.set_path(path, Tree(value));
  }
  return base;
}

std::vector<Array> variable_leaves(const ScopeState& state) { return leaves(state.variables); }

std::vector<Array> lifted_run(Scope& s, const ScopedBody& body, const CheckpointOptions& options,
                              const LiftFilters& filters, std::vector<Array> held,
                              const std::function<bool(const std::vector<Array>&)>& keep_plain) {
  const std::vector<std::string> path = s.path();
  std::shared_ptr<const ScopeState> entry = make_lifted_state(s.state(), path, filters);
  ScopeState forward_state = *entry;
  auto base = std::make_shared<ScopeState>();
  auto forward = [&] {
    Scope inner(forward_state, path);
    return body(inner);
  };
  auto recompute = [body, base, path] {
    ScopeState state = *base;  // a fresh copy each time: writes made while recomputing are dropped
    Scope inner(state, path);
    linum::detail::ModulePathGuard where(&inner.path());
    return body(inner);
  };
  for (const Array& v : variable_leaves(*entry)) held.push_back(v);
  std::vector<Array> flat = run_checkpointed(forward, recompute, options, s.path_str(), std::move(held), keep_plain);
  *base = recompute_base(*entry, forward_state);
  write_back(s.state(), forward_state, path);
  return flat;
}

}  // namespace linum::lift::detail
