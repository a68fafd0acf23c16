// lift::Pack: the one place lifted transforms (lift::remat, lift::scan, lift::RematScope) take their
// state from the scope they run at and give their results back, as `pack` in Flax's core/lift.py.
//
//   Pack pack(s, {.collections = ..., .streams = ...}, "lift::remat");
//   ScopeState state = pack.fresh();        // the selected state: run the body on it
//   Scope inner(state, pack.path());
//   ... body(inner) ...
//   pack.publish(state);                    // mutable collections, rng counters: back, once
//
// A transform may run its body several times on fresh copies (a recomputation starts from
// pack.replay_base(state_after_forward)), run it on parts of the selection (scan: state_on() with
// one layer's slice per iteration, publish() of the stacked results), or skip publishing what a
// run wrote (recomputations). A new transform (vmap, map_variables) is a new file in lift/ on
// this interface, not an edit to modules/.
#pragma once

#include <linum/modules/scope.hpp>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace linum::lift {

// Which collections and streams a transform lifts (unset: all that are visible where it runs).
struct LiftFilters {
  std::optional<std::vector<std::string>> collections;
  std::optional<std::vector<std::string>> streams;
};

namespace detail {

using linum::detail::RngCounters;
using linum::detail::ScopeState;

// The lifting engine: the only code that selects a transform's state from the scope it runs at,
// builds the states its bodies run on and writes their results back (ScopeState is sealed; see
// modules/scope.hpp).
class Pack {
 public:
  // Selects the state a transform named `transform` runs on at scope `s`: the selected
  // collections' variables under the scope's path, the selected streams with their counters under
  // it, mutable where mutable at `s` and selected. An enclosing transform's selection still applies.
  Pack(Scope& s, const LiftFilters& filters, std::string_view transform);

  const std::vector<std::string>& path() const { return path_; }

  // ---- runs on the whole selection (lift::remat) -------------------------------------------------
  // A copy of the selected state on entry, to run a body on.
  ScopeState fresh() const { return *entry_; }
  // The state recomputations start from, given the forward run's final state: the variables the
  // forward run created exist, at the values they were created with, so a recomputation creates
  // none; not initializing.
  ScopeState replay_base(const ScopeState& after) const;
  // Writes a run's results back to the outer scope, once: the subtrees under path() of collections
  // mutable there, the rng counters it advanced, the variables it touched.
  void publish(const ScopeState& after) const;
  // The variables of the selection (the arrays a checkpointed block reads).
  std::vector<Array> variable_leaves() const;

  // ---- runs on parts of the selection (lift::scan: per-iteration slices, stacked results) -------
  // The selected variables, streams and counters on entry; the note of the enclosing transform.
  const Tree& variables() const;
  const rng::Streams& streams() const;
  const RngCounters& counters() const;
  bool is_mutable(std::string_view collection) const;
  // A state with the selection's mutability and lifted collections, on the given variables,
  // streams and counters; `visible_streams` (when set) narrows the streams a body may draw from,
  // `note` names the transform in errors about them.
  ScopeState state_on(Tree variables, rng::Streams streams, RngCounters counters,
                      std::optional<std::set<std::string, std::less<>>> visible_streams = std::nullopt,
                      std::string note = {}) const;
  static const Tree& variables_of(const ScopeState& state) { return state.variables; }
  static const RngCounters& counters_of(const ScopeState& state) { return state.rng_counters; }
  // publish() for results assembled from several runs: `variables` and `counters` as they end, the
  // variables every run in `runs` touched.
  void publish(Tree variables, RngCounters counters, const std::vector<const ScopeState*>& runs) const;

  // Makes `collections` read-only in `state` (lift::map_variables' mapped collections when it does
  // not write them back, lift::while_loop's shared ones): a write is an error that says `why`.
  static void make_read_only(ScopeState& state, const std::vector<std::string>& collections, const std::string& why);
  // Runs on `state` no longer create variables (lift::while_loop's iterations after init's
  // creating run).
  static void stop_initializing(ScopeState& state) { state.initializing = false; }
  // Adds the variables `run` read or wrote to those `into` counts (for publish()).
  static void add_reads(ScopeState& into, const ScopeState& run);

  // ---- auto-names (lift::while_loop: the body's children named the same on every iteration) -------
  using AutoNames = std::map<std::string, int, std::less<>>;
  static AutoNames auto_names(const Scope& s) { return s.auto_name_counts_; }
  static void set_auto_names(Scope& s, AutoNames names) { s.auto_name_counts_ = std::move(names); }

  // ---- branches (lift::cond, lift::switch_) -------------------------------------------------------
  // The next auto-name for `type_name` at `s` ("Dense_1"), taken as s(module, ...) would take it.
  static std::string next_child_name(Scope& s, const std::string& type_name);
  // Counts every variable under `s`'s child `child` as used, as if read (a branch that did not run).
  static void mark_child_used(Scope& s, const std::string& child);

 private:
  static ScopeState select(const ScopeState& outer, const std::vector<std::string>& path, const LiftFilters& selection,
                           std::string note);
  ScopeState* outer_;  // publish() only: runs while the outer call is alive
  std::vector<std::string> path_;
  std::string outer_note_;  // the enclosing transform's note (runs may outlive the outer state)
  std::shared_ptr<const ScopeState> entry_;
};

}  // namespace detail
}  // namespace linum::lift
