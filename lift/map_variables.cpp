// lift::map_variables: the mapped collections' variables under the module, through trans_in on the
// way in and trans_out on the way back (Flax's map_variables in core/lift.py).
#include <linum/lift/map_variables.hpp>

#include <linum/core/error.hpp>

#include <algorithm>

namespace linum::lift::detail {
namespace {

std::string where(const std::vector<std::string>& path) {
  return path.empty() ? std::string("<root>") : linum::detail::join_module_path(path);
}

[[noreturn]] void fail(const std::vector<std::string>& path, const std::string& what) {
  throw ValueError(linum::detail::cat("lift::map_variables at '", where(path), "': ", what));
}

// {collection: the variables under `prefix`} for each mapped collection (an empty dict if none).
Tree target_of(const Tree& variables, const std::string& prefix, const std::vector<std::string>& collections) {
  Tree out;
  for (const std::string& c : collections) {
    Tree sub;
    if (variables.contains(c)) {
      const Tree& coll = variables.at(c);
      if (prefix.empty()) sub = coll;
      else if (coll.contains_path(prefix)) sub = coll.at_path(prefix);
    }
    out.set(c, std::move(sub));
  }
  return out;
}

// Puts `target`'s collections under `prefix` in `variables`.
void put_target(Tree& variables, const std::string& prefix, const Tree& target) {
  for (const std::string& c : target.keys()) {
    const Tree& sub = target.at(c);
    const bool present = variables.contains(c) && (prefix.empty() || variables.at(c).contains_path(prefix));
    if (sub.empty() && !present) continue;  // nothing there, nothing to put
    if (prefix.empty()) variables[c] = sub;
    else variables[c].set_path(prefix, sub);
  }
}

std::string listed(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

// Applies a user's map, checking it returns the mapped collections only.
Tree mapped(const VariablesMap& f, const char* name, const Tree& target, const std::vector<std::string>& path,
            const std::vector<std::string>& collections) {
  if (!f) return target;
  Tree out = f(target);
  if (!out.is_dict())
    fail(path, linum::detail::cat(name, " returned a single array; return a dict {collection: variables}, as it was given"));
  for (const std::string& c : out.keys())
    if (std::find(collections.begin(), collections.end(), c) == collections.end())
      fail(path, linum::detail::cat(name, " returned collection '", c, "', which is not mapped (mapped: ",
                                    listed(collections), "); add it to `collections` or drop it"));
  return out;
}

}  // namespace

MapVariablesRun plan_map_variables(Scope& s, std::vector<std::string> collections, VariablesMap trans_in,
                                   VariablesMap trans_out, bool init, bool mutable_) {
  MapVariablesRun run;
  run.path = s.path();
  if (collections.empty()) fail(run.path, "no collections to map; name them, e.g. {\"params\"}");
  run.pack.emplace(s, LiftFilters{}, "lift::map_variables");
  run.collections = std::move(collections);
  run.trans_in = std::move(trans_in);
  run.trans_out = std::move(trans_out);
  run.writes_back = init || mutable_;
  run.original = target_of(run.pack->variables(), linum::detail::join_module_path(run.path), run.collections);
  run.target = run.original;
  return run;
}

ScopeState creating_state(const MapVariablesRun& run) { return run.pack->fresh(); }

void take_created(MapVariablesRun& run, const ScopeState& created) {
  const Tree made = target_of(Pack::variables_of(created), linum::detail::join_module_path(run.path), run.collections);
  run.target = mapped(run.trans_out, "trans_out", made, run.path, run.collections);
}

ScopeState mapped_state(const MapVariablesRun& run) {
  Tree variables = run.pack->variables();
  put_target(variables, linum::detail::join_module_path(run.path),
             mapped(run.trans_in, "trans_in", run.target, run.path, run.collections));
  ScopeState st = run.pack->state_on(std::move(variables), run.pack->streams(), run.pack->counters());
  if (!run.writes_back)
    for (const std::string& c : run.collections)
      Pack::make_read_only(st, {c}, linum::detail::cat("a lift::map_variables maps collection '", c, "' and does not write it back; set the transform's "
                                                       "mutable_ = true to write through its trans_out"));
  return st;
}

void finish_map_variables(const MapVariablesRun& run, const ScopeState& after) {
  const std::string prefix = linum::detail::join_module_path(run.path);
  Tree variables = Pack::variables_of(after);
  if (run.writes_back)
    put_target(variables, prefix,
               mapped(run.trans_out, "trans_out", target_of(variables, prefix, run.collections), run.path, run.collections));
  else
    put_target(variables, prefix, run.original);  // the stored variables, not their mapped view
  run.pack->publish(std::move(variables), Pack::counters_of(after), {&after});
}

}  // namespace linum::lift::detail
