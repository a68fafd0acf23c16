// lift::Pack: the lifting engine (Flax's `pack` in core/lift.py). It selects the state a transform
// runs on, builds the states of its runs, and publishes their results back.
#include <linum/lift/pack.hpp>

#include <algorithm>

namespace linum::lift::detail {
namespace {

using linum::detail::join_module_path;

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

ScopeState Pack::select(const ScopeState& outer, const std::vector<std::string>& path, const LiftFilters& selection, std::string note) {
  ScopeState inner;
  const std::string prefix = linum::detail::join_module_path(path);
  inner.initializing = outer.initializing;
  inner.lift_note = std::move(note);
  inner.lifted_collections = narrowed(selection.collections, outer.lifted_collections);
  inner.lifted_streams = narrowed(selection.streams, outer.lifted_streams);
  auto visible = [&](std::string_view c) { return !inner.lifted_collections || inner.lifted_collections->count(c); };
  for (const auto& [name, collection] : outer.variables) {
    if (!visible(name)) continue;
    Tree& mine = inner.variables[name];
    if (const Tree* t = subtree(collection, prefix)) put_subtree(mine, prefix, *t);
  }
  // Mutability: what is mutable here and lifted.
  if (outer.all_mutable && !inner.lifted_collections) {
    inner.all_mutable = true;
  } else {
    for (const auto& [name, _] : outer.variables)
      if (visible(name) && outer.is_mutable(name)) inner.mutable_collections.insert(name);
    for (const auto& name : outer.mutable_collections)
      if (visible(name)) inner.mutable_collections.insert(name);
    if (outer.all_mutable && inner.lifted_collections)
      for (const auto& name : *inner.lifted_collections) inner.mutable_collections.insert(name);
  }
  inner.read_only = outer.read_only;
  // Streams and their counters under this path.
  for (const std::string& name : outer.rngs.names())
    if (!inner.lifted_streams || inner.lifted_streams->count(name)) inner.rngs.set(name, outer.rngs.at(name));
  for (const auto& [key, count] : outer.rng_counters)
    if (under(key.path, prefix) && inner.rngs.has(key.stream)) inner.rng_counters.emplace(key, count);
  return inner;
}

Pack::Pack(Scope& s, const LiftFilters& filters, std::string_view transform)
    : outer_(&s.state()), path_(s.path()), outer_note_(s.state().lift_note) {
  const std::string where = s.path().empty() ? std::string("<root>") : linum::detail::join_module_path(s.path());
  entry_ = std::make_shared<const ScopeState>(select(*outer_, path_, filters, linum::detail::cat(transform, " at '", where, "'")));
}

void Pack::publish(const ScopeState& inner) const {
  ScopeState& outer = *outer_;
  const std::string prefix = linum::detail::join_module_path(path_);
  for (const auto& [name, collection] : inner.variables) {
    if (!outer.is_mutable(name)) continue;
    const Tree* t = subtree(collection, prefix);
    if (t == nullptr) continue;
    put_subtree(outer.variables[name], prefix, *t);
  }
  for (const auto& [key, count] : inner.rng_counters) outer.rng_counters[key] = count;
  outer.touched.insert(inner.touched.begin(), inner.touched.end());
}

ScopeState Pack::replay_base(const ScopeState& after) const {
  ScopeState base = *entry_;
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

std::vector<Array> Pack::variable_leaves() const { return leaves(entry_->variables); }

const Tree& Pack::variables() const { return entry_->variables; }
const rng::Streams& Pack::streams() const { return entry_->rngs; }
const RngCounters& Pack::counters() const { return entry_->rng_counters; }
bool Pack::is_mutable(std::string_view collection) const { return entry_->is_mutable(collection); }

ScopeState Pack::state_on(Tree variables, rng::Streams streams, RngCounters counters,
                          std::optional<std::set<std::string, std::less<>>> visible_streams, std::string note) const {
  ScopeState st;
  st.initializing = entry_->initializing;
  st.all_mutable = entry_->all_mutable;
  st.mutable_collections = entry_->mutable_collections;
  st.read_only = entry_->read_only;
  st.lifted_collections = entry_->lifted_collections;
  st.lifted_streams = entry_->lifted_streams;
  // Errors about collections name the transform that selected them (the enclosing one).
  st.lift_note = outer_note_;
  st.variables = std::move(variables);
  st.rngs = std::move(streams);
  st.rng_counters = std::move(counters);
  if (visible_streams) {
    st.lifted_streams = std::move(visible_streams);
    st.lift_note = std::move(note);
  }
  return st;
}

void Pack::publish(Tree variables, RngCounters counters, const std::vector<const ScopeState*>& runs) const {
  ScopeState result;
  result.variables = std::move(variables);
  result.rng_counters = std::move(counters);
  for (const ScopeState* run : runs) result.touched.insert(run->touched.begin(), run->touched.end());
  publish(result);
}

std::string Pack::next_child_name(Scope& s, const std::string& type_name) { return s.next_auto_name(type_name); }

void Pack::mark_child_used(Scope& s, const std::string& child) {
  ScopeState& state = s.state();
  const std::string prefix = linum::detail::join_module_path(s.path());
  const std::string path = prefix.empty() ? child : prefix + "/" + child;
  for (const auto& [name, collection] : state.variables)
    if (const Tree* t = subtree(collection, path))
      for (const auto& [leaf_path, value] : flatten(*t))
        state.touched.insert(leaf_path.empty() ? name + "/" + path : name + "/" + path + "/" + leaf_path);
}

void Pack::add_reads(ScopeState& into, const ScopeState& run) { into.touched.insert(run.touched.begin(), run.touched.end()); }

void Pack::make_read_only(ScopeState& state, const std::vector<std::string>& collections, const std::string& why) {
  for (const std::string& c : collections) state.read_only.emplace(c, why);
}

}  // namespace linum::lift::detail
