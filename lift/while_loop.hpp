// lift::while_loop: Flax's nn.while_loop, and differentiable. JAX cannot reverse-differentiate a
// while loop (its trip count is not known when the backward pass is planned); here the loop runs
// eagerly, gradients flow through every iteration to the initial carry and the variables, and a
// schedule bounds the memory the backward pass needs.
//
//   struct Refine {  // applies the same Dense until the update is small
//     Array operator()(Scope& s, Array x) const {
//       auto cond = [](Scope&, const Array& h) { return max(abs(h)).item() > 0.1f; };
//       auto body = [](Scope& s, const Array& h) { return 0.5f * tanh(s(nn::Dense{.features = 8}, h)); };
//       return lift::while_loop(s, cond, body, x, {.schedule = lift::ScanSchedule::binomial(4), .max_steps = 1000});
//     }
//   };
//
// cond(scope, carry) returns a bool or a scalar array (nonzero: go on) and body(scope, carry) the
// next carry, any pytree keeping its structure and shapes. Both run at the scope the loop is
// called from (as in Flax, the loop is not a module of its own): the body's modules are children of
// that scope, named the same on every iteration, so every iteration uses the same variables, and
// the caller's later children are named after them. Cond runs without recording (no gradient
// flows through a decision).
//
// Variables: collections listed in `carry_variables` are carried from one iteration to the next
// (mutable where the caller may write them); every other collection is shared by the iterations
// read-only (Flax's broadcast_variables), and writing it is an error naming the collection.
// Init creates the body's variables, as Flax's documentation has users do by hand: the body runs
// once on the initial carry, its created variables are kept at their initial values, and then the
// loop runs as apply would, on them (so cond may read variables the body creates). The body must
// create the same variables on every iteration.
//
// Keys: a split stream (split_rngs empty: every stream; else those mapped to true) with key K gives
// iteration i's body fold_in(K, i) and its cond fold_in(K, -i), as Flax's; a stream mapped to false
// reaches every iteration unchanged, an unlisted one (when split_rngs is not empty) does not reach
// the loop (Flax's default, split_rngs={}, passes none; here the default splits them). make_rng's
// counters are those of one traced run: every iteration's cond starts from the counters on entry,
// its body from where cond left them, and the loop leaves them where one body run ends, also when
// it runs no iteration (the body then runs once, discarded, as JAX's trace of it).
//
// Reverse mode (lift/schedule.hpp): with schedule `none` every iteration's activations are kept;
// `every` checkpoints each iteration as it runs (one carry kept per iteration, each recomputed
// once); `sqrt` and `binomial(s)` need the trip count, so the loop first runs without recording to
// learn it (one extra forward pass: the price of not knowing it in advance) and then runs as a scan
// of that many steps under the schedule (at most s carries alive for binomial). Gradients are
// bitwise those of the plain loop. Schedules apply when recording, not at init, and cannot carry
// collections. `max_steps` (0: no bound) makes a loop that would run longer a ValueError.
#pragma once

#include <linum/core/autodiff/graph.hpp>
#include <linum/core/autodiff/pytree.hpp>
#include <linum/lift/pack.hpp>
#include <linum/lift/schedule.hpp>
#include <linum/modules/scope.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace linum::lift {

struct WhileLoopOptions {
  std::vector<std::string> carry_variables{};  // collections carried across iterations (Flax's carry_variables)
  std::map<std::string, bool> split_rngs{};    // stream -> folded per iteration; empty: every stream folded
  ScanSchedule schedule{};                     // checkpointing across iterations when differentiating
  std::int64_t max_steps = 0;                  // 0: unbounded; else more iterations are an error
};

namespace detail {

using linum::detail::ScopeState;

// What a run of the body leaves behind: the forward pass everything (its carried collections go on
// to the next iteration); a trace (the probe that counts the trips, the discarded run of a loop
// that runs no iteration) its names, counters and reads only; a recomputation nothing.
enum class BodyRunKind { forward, trace, recompute };

// The state a loop's cond and body run on, and what the loop gives back (while_loop.cpp).
class WhileLoopRun {
 public:
  WhileLoopRun(Scope& s, WhileLoopOptions options);

  const std::vector<std::string>& path() const { return path_; }
  const WhileLoopOptions& options() const { return options_; }
  bool creates() const { return creates_; }  // init: the body's creating run comes first

  // Init's creating run: the selection as on entry, every stream with its own key.
  ScopeState creating_state() const { return pack_->fresh(); }
  // After it: the variables it created exist for the loop, at their initial values.
  void take_created(const ScopeState& created);

  // The states of iteration i's cond and body, on a scope whose auto-names continue the caller's
  // (cond's) or cond's (the body's).
  ScopeState cond_state(std::int64_t i) const;
  ScopeState body_state(std::int64_t i) const;
  void name_cond(Scope& cond_scope) const;
  void name_body(Scope& body_scope) const;
  // After a run of cond or body (see BodyRunKind): the first run's counters and names are what
  // the next part starts from; reads are collected.
  void after_cond(const Scope& cond_scope, const ScopeState& st);
  void after_body(const Scope& body_scope, const ScopeState& st, BodyRunKind kind);
  bool ran_body() const { return ran_body_; }

  // cond's value: a scalar array's (bool, int32 or float32; nonzero is true).
  bool holds(const Array& pred) const;
  // Throws unless the loop may run iteration `i` (max_steps).
  void check_step(std::int64_t i) const;
  template <class Carry>
  void check_carry(std::int64_t i, const Carry& before, const Carry& after) const {
    check_carry_leaves(i, pytree::flatten(before), pytree::flatten(after));
  }

  // Publishes the carried collections, the counters and the variables read; the caller's
  // auto-names continue from the body's.
  void finish(Scope& s);
  [[noreturn]] void fail(const std::string& what) const;

 private:
  ScopeState iteration_state(std::int64_t i, bool cond, const RngCounters& counters) const;
  void fix_read_only();  // the read-only collections of cond and body, from variables_
  void check_carry_leaves(std::int64_t i, const std::vector<Array>& before, const std::vector<Array>& after) const;

  std::optional<Pack> pack_;
  std::vector<std::string> path_;
  WhileLoopOptions options_;
  bool creates_ = false;
  Tree variables_;  // what the iterations read: on entry, plus created ones; carried collections updated
  std::vector<std::pair<std::string, rng::Key>> split_, unchanged_;
  std::optional<std::set<std::string, std::less<>>> visible_streams_;
  RngCounters entry_counters_, body_counters_, end_counters_;
  Pack::AutoNames caller_names_, body_names_, end_names_;
  bool ran_cond_ = false, ran_body_ = false;
  ScopeState reads_;  // the variables the runs read (apply's unused-entry check)
  std::vector<std::string> cond_read_only_;                         // every collection
  std::vector<std::pair<std::string, std::string>> body_read_only_;  // the ones not carried, with the advice
  std::string streams_where_;                                        // names the loop in stream errors
};

}  // namespace detail

// Runs `carry = body(s, carry)` while `cond(s, carry)` holds (see the file comment).
template <class Cond, class Body, class Carry>
Carry while_loop(Scope& s, const Cond& cond, const Body& body, const Carry& init, WhileLoopOptions options = {}) {
  static_assert(std::is_same_v<std::decay_t<std::invoke_result_t<const Body&, Scope&, const Carry&>>, Carry>,
                "lift::while_loop: the body must return the next carry, of the carry's type");
  using linum::detail::ScopeState;
  using Kind = detail::BodyRunKind;
  auto run = std::make_shared<detail::WhileLoopRun>(s, std::move(options));
  auto test = [&run, &cond](std::int64_t i, const Carry& h) {
    autodiff::NoGradGuard no_tape;  // a decision: nothing to differentiate
    ScopeState st = run->cond_state(i);
    Scope inner(st, run->path());
    run->name_cond(inner);
    const auto pred = cond(inner, h);
    bool go = false;
    if constexpr (std::is_same_v<std::decay_t<decltype(pred)>, Array>) go = run->holds(pred);
    else go = static_cast<bool>(pred);
    run->after_cond(inner, st);
    return go;
  };
  // Iteration i's body on carry h (kept by the checkpoints for their recomputations).
  auto step = [run, body](std::int64_t i, const Carry& h, Kind kind) {
    ScopeState st = run->body_state(i);
    Scope inner(st, run->path());
    run->name_body(inner);
    Carry next = body(inner, h);
    run->check_carry(i, h, next);
    run->after_body(inner, st, kind);
    return next;
  };

  if (run->creates()) {  // init: the body once, for its variables (Flax's pattern)
    ScopeState st = run->creating_state();
    Scope inner(st, run->path());
    run->name_body(inner);
    (void)body(inner, init);
    run->take_created(st);
  }

  const ScanSchedule schedule = run->options().schedule;
  const bool scheduled = schedule.kind != ScanSchedule::Kind::none && !s.is_initializing() && autodiff::is_recording();
  if (scheduled && !run->options().carry_variables.empty())
    run->fail("a schedule cannot be combined with carry_variables collections");
  Carry h = init;
  std::int64_t i = 0;
  if (!scheduled) {
    for (; test(i, h); ++i) {
      run->check_step(i);
      h = step(i, h, Kind::forward);
    }
  } else if (schedule.kind == ScanSchedule::Kind::every) {
    for (; test(i, h); ++i) {
      run->check_step(i);
      // A checkpoint per iteration: its forward run is the iteration's, later runs recompute it.
      auto forward = std::make_shared<bool>(true);
      auto once = [step, forward](std::int64_t k, const Carry& c) {
        const Kind kind = *forward ? Kind::forward : Kind::recompute;
        *forward = false;
        return std::make_pair(step(k, c, kind), std::tuple<>{});
      };
      using Once = decltype(once);
      h = detail::checkpointed_range<Carry, std::tuple<>, Once>(std::make_shared<const Once>(std::move(once)), ScanSchedule{},
                                                               i, i + 1, 0, h)
              .carry;
    }
  } else {
    {  // sqrt, binomial: the trip count first, from a run without recording
      autodiff::NoGradGuard no_tape;
      Carry probe = init;
      for (; test(i, probe); ++i) {
        run->check_step(i);
        probe = step(i, probe, Kind::trace);
      }
    }
    if (i > 0) h = run_steps(i, init, [step](std::int64_t k, const Carry& c) { return step(k, c, Kind::recompute); }, schedule);
  }
  if (!run->ran_body()) {  // no iteration ran: the body runs once anyway, discarded, as JAX traces it
    autodiff::NoGradGuard no_tape;
    (void)step(0, init, Kind::trace);
  }
  run->finish(s);
  return h;
}

}  // namespace linum::lift
