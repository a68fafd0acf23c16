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
// pack.replay_base(state_after_forward)), slice the selected variables per layer (scan), or skip
// publishing what a run wrote (recomputations).
#pragma once

#include <linum/modules/scope.hpp>

#include <memory>
#include <optional>
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

using linum::detail::ScopeState;

class Pack {
 public:
  // Selects the state a transform named `transform` runs on at scope `s`.
  Pack(Scope& s, const LiftFilters& filters, std::string_view transform);

  const std::vector<std::string>& path() const { return path_; }
  // The selected state on entry.
  const ScopeState& entry() const { return *entry_; }
  std::shared_ptr<const ScopeState> shared_entry() const { return entry_; }
  // A copy of the entry state to run a body on.
  ScopeState fresh() const { return *entry_; }
  // The state recomputations start from, given the forward run's final state.
  ScopeState replay_base(const ScopeState& after) const { return entry_->replay_base(after); }
  // Writes a run's results back to the outer scope (call once).
  void publish(const ScopeState& after) const { outer_->publish(path_, after); }

 private:
  ScopeState* outer_;
  std::vector<std::string> path_;
  std::shared_ptr<const ScopeState> entry_;
};

}  // namespace detail
}  // namespace linum::lift
