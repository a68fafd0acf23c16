// lift::scan<Body>: Flax's nn.scan. The body runs `length` times in one scope; each iteration gets
// its slice of the scanned inputs, of the variables (stacked along an axis), and its own keys, and
// passes a carry to the next.
//
//   using Layers = lift::scan<lift::remat<Block>>;                   // scan over rematted layers
//   x = s(Layers{.body = {.features = 512}, .length = 12}, x, train);
//   // params/ScanBlock_0/Dense_0/kernel has shape (12, in, 512)
//
//   // An RNN cell over time: xs [T, batch, in] scanned, ys [T, batch, hidden] stacked.
//   auto [h, ys] = s(lift::scan<Cell>{.variable_broadcast = {"params"}, .split_rngs = {{"params", false}}},
//                    h0, lift::scanned(xs));
//
// The body is called as body(scope, carry, args...) and returns the next carry, or a
// std::pair(next carry, y) whose ys the scan stacks along a new leading axis (then the scan returns
// std::pair(carry, ys)). The carry and ys may be any pytree (Array, Tree, vector, pair, tuple);
// the carry must keep its structure and shapes. Arguments wrapped in lift::scanned(...) are sliced
// along their leading axis, or lift::scanned(x, axis) along another (Flax's in_axes; `length` may
// then be left 0 and is taken from them); other arguments reach every iteration unchanged
// (nn.broadcast). `out_axes` puts the iterations' axis of the stacked ys elsewhere than first.
//
// Variables, per collection (Flax's arguments of the same names):
//   variable_axes       collection -> axis: one slice per iteration, stacked along that axis
//                       (default when no collection is listed anywhere: every collection, axis 0);
//   variable_broadcast  collections shared by every iteration (created once at init, read-only);
//   variable_carry      collections carried from one iteration to the next (e.g. a step counter).
// A collection in none of them is an error naming it.
//
// Keys (split_rngs, default: every stream split): for a split stream with key K, iteration i's
// stream key is jax.random.split(K, length)[i] (in the current rng::Mode; in the default,
// partitionable mode that is fold_in(K, i)); a stream mapped to false reaches every iteration
// unchanged; a stream not in a non-empty split_rngs does not reach the body. Inside the body,
// make_rng hashes the full module path and a per-scope counter into the iteration's stream key,
// exactly as Flax. Like Flax's default (the body traced twice, with shared counters), the counters
// the iterations use continue from one full run of the body: when the body draws keys, the first
// call runs the first iteration once more to learn them; later calls with the same body, path and
// counters on entry reuse them (checked against what the iteration draws), so a training step with
// dropout runs each iteration once. (Under a schedule, the first iteration still runs once more per
// call, as a forward pass without recording.)
// `reverse` runs the slices from last to first; slice i keeps its keys, variables, input and
// output position, as in Flax.
#pragma once

#include <typeinfo>

#include <linum/core/autodiff/pytree.hpp>
#include <linum/core/ops/shape_ops.hpp>
#include <linum/lift/pack.hpp>
#include <linum/modules/module.hpp>
#include <linum/lift/schedule.hpp>
#include <linum/modules/scope.hpp>

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace linum::lift {

// An argument of a scan sliced along an axis, the leading one by default (see lift::scan; Flax's
// in_axes, per argument; negative axes count from the end).
template <class T>
struct Scanned {
  T value;
  int axis = 0;
};
template <class T>
Scanned<std::decay_t<T>> scanned(T&& value, int axis = 0) {
  return {std::forward<T>(value), axis};
}

// The options of lift::scan that are not templates (see the header comment).
struct ScanSettings {
  int length = 0;
  bool reverse = false;
  std::map<std::string, int> variable_axes;
  std::vector<std::string> variable_broadcast;
  std::vector<std::string> variable_carry;
  std::map<std::string, bool> split_rngs;
};

namespace detail {

using linum::detail::ScopeState;

// The state a scan's iterations run on (scan.cpp): the pack selected at the scan's scope, each
// collection's role, the variables' slices, the streams' keys per iteration, the counters.
struct ScanPlan {
  std::optional<Pack> pack;
  std::vector<std::string> path;
  ScanSettings settings;
  int length = 0;
  // Axis collections: for every (collection, leaf path under the scan), the slices by index.
  std::vector<std::pair<std::string, std::vector<std::pair<std::string, std::vector<Array>>>>> slices;
  Tree shared;  // broadcast and carry collections as they stand (carry: updated per iteration)
  std::vector<std::pair<std::string, std::vector<rng::Key>>> split_keys;  // per split stream, one key per slice
  std::vector<std::pair<std::string, rng::Key>> broadcast_keys;
  RngCounters counters;  // what every iteration starts from
};

ScanPlan plan_scan(Scope& s, const ScanSettings& settings, int length);
// The state of the iteration over slice i.
ScopeState iteration_state(const ScanPlan& plan, int i);
// After an iteration: its carry collections become the next iteration's (unless the run is
// discarded, as the first run when it drew keys); broadcast collections created by it (at init)
// are kept for the others.
void after_iteration(ScanPlan& plan, const ScopeState& st, bool discarded = false);
// Whether the iteration drew keys (its counters moved); then the iterations must start from its
// final counters (Flax's second trace), and it is run again.
bool drew_keys(const ScanPlan& plan, const ScopeState& st);
void continue_counters(ScanPlan& plan, const ScopeState& st);
// That extra run is needed once per body, not on every call: the counters it ends at are remembered
// per (body type, scan path, counters on entry), and a later call predicts them and runs iteration 0
// only once. Each prediction is checked against what iteration 0 then draws: with the predicted
// counters C1, entry C0 and iteration 0's end E, a first run would have ended at C0 + (E - C1), which
// must be C1 (else the call falls back to the extra run and the new counters are remembered).
std::optional<RngCounters> predicted_counters(const std::string& body, const ScanPlan& plan);
void remember_counters(const std::string& body, const ScanPlan& plan, const RngCounters& entry, const RngCounters& after_first_run);
bool prediction_held(const RngCounters& entry, const RngCounters& predicted, const RngCounters& after_iteration);
void forget_predicted_counters();  // tests
// Stacks the axis collections of the iterations (in slice order) and publishes every mutable
// collection, the counters and the touched variables.
void finish_scan(const ScanPlan& plan, const std::vector<ScopeState>& states);
[[noreturn]] void throw_scan_error(const std::vector<std::string>& path, const std::string& what);

template <class T>
struct is_scanned : std::false_type {};
template <class T>
struct is_scanned<Scanned<T>> : std::true_type {};

// Slices of a scanned argument (per slice index), or (a copy of) the argument itself: copies, so
// that a schedule's recomputations, which run after the call returned, still have them.
template <class T>
struct ArgSlices {
  T value;
  const T& at(int) const { return value; }
};
template <class T>
struct ArgSlices<Scanned<T>> {
  std::vector<T> slices;
  const T& at(int i) const { return slices[static_cast<std::size_t>(i)]; }
};

template <class T>
int scanned_length(const T&, const std::vector<std::string>&) {
  return -1;
}
// `axis` of `a` counted from 0, or a scan error naming the argument's rank.
int scanned_axis(const Array& a, int axis, const std::vector<std::string>& path);

template <class T>
int scanned_length(const Scanned<T>& s, const std::vector<std::string>& path) {
  int n = -1;
  for (const Array& a : pytree::flatten(s.value)) {
    if (a.rank() == 0) throw_scan_error(path, "a scanned argument has a scalar leaf; scanned values need a leading axis");
    const int d = static_cast<int>(a.dim(scanned_axis(a, s.axis, path)));
    if (n >= 0 && d != n)
      throw_scan_error(path, linum::detail::cat("scanned arguments disagree on the length: leading axes ", n, " and ", d));
    n = d;
  }
  return n;
}

template <class T>
ArgSlices<T> slice_arg(const T& value, int) {
  return {value};
}
template <class T>
ArgSlices<Scanned<T>> slice_arg(const Scanned<T>& s, int n) {
  std::vector<Array> leaves = pytree::flatten(s.value);
  std::vector<std::vector<Array>> per_leaf;
  for (const Array& a : leaves) {
    const int axis = a.rank() > 0 ? (s.axis < 0 ? s.axis + a.rank() : s.axis) : 0;
    per_leaf.push_back(unstack(axis == 0 ? a : moveaxis(a, axis, 0)));
  }
  ArgSlices<Scanned<T>> out;
  for (int i = 0; i < n; ++i) {
    std::vector<Array> at;
    for (const auto& l : per_leaf) at.push_back(l[static_cast<std::size_t>(i)]);
    out.slices.push_back(pytree::rebuild(s.value, std::span<const Array>(at)));
  }
  return out;
}

template <class T>
struct is_pair : std::false_type {};
template <class A, class B>
struct is_pair<std::pair<A, B>> : std::true_type {};

// The type of a body's y (its result's second member when it returns (carry, y)).
template <class Result, bool WithYs>
struct YsOf {
  using type = int;
};
template <class Result>
struct YsOf<Result, true> {
  using type = typename Result::second_type;
};

// The pytree of ys (per slice index) stacked leaf by leaf along a new axis: the leading one, or
// `out_axis` (Flax's out_axes; negative counts from the end of the stacked array).
template <class Y>
Y stack_ys(const std::vector<Y>& ys, int out_axis, const std::vector<std::string>& path) {
  std::vector<std::vector<Array>> leaves;
  for (const Y& y : ys) leaves.push_back(pytree::flatten(y));
  std::vector<Array> stacked;
  for (std::size_t k = 0; k < leaves.front().size(); ++k) {
    std::vector<Array> column;
    for (const auto& l : leaves) column.push_back(l[k]);
    Array joined = stack(column);
    if (out_axis != 0) joined = moveaxis(joined, 0, scanned_axis(joined, out_axis, path));
    stacked.push_back(std::move(joined));
  }
  return pytree::rebuild(ys.front(), std::span<const Array>(stacked));
}

// What body(scope, carry, slice...) returns (declaration only, for decltype).
template <class Body, class Carry, class Sliced, std::size_t... Is>
auto result_of_body(std::index_sequence<Is...>)
    -> decltype(std::declval<const Body&>()(std::declval<Scope&>(), std::declval<const Carry&>(),
                                            std::get<Is>(std::declval<const Sliced&>()).at(0)...));

template <class Carry>
void check_carry(const std::vector<std::string>& path, int i, const Carry& before, const Carry& after) {
  const std::vector<Array> a = pytree::flatten(before), b = pytree::flatten(after);
  if (a.size() != b.size())
    throw_scan_error(path, linum::detail::cat("iteration ", i, " returned a carry with ", b.size(), " arrays instead of ",
                                              a.size(), "; a scanned body must keep the carry's structure"));
  for (std::size_t k = 0; k < a.size(); ++k)
    if (!(a[k].shape() == b[k].shape()))
      throw_scan_error(path, linum::detail::cat("iteration ", i, " turned carry leaf ", k, " of shape ", a[k].shape(),
                                                " into ", b[k].shape(), "; a scanned body must keep the carry's shapes"));
}

}  // namespace detail

template <class Body>
struct scan {
  Body body{};
  int length = 0;  // 0: the leading axis of the scanned arguments
  bool reverse = false;
  int out_axes = 0;  // the axis of the ys along which iterations are stacked (Flax's out_axes)
  std::map<std::string, int> variable_axes{};
  std::vector<std::string> variable_broadcast{};
  std::vector<std::string> variable_carry{};
  std::map<std::string, bool> split_rngs{};
  // Checkpointing across iterations (lift/schedule.hpp): none, every, sqrt or binomial(s) with at
  // most s carries alive. Applies when differentiating (not at init), to bodies with or without ys
  // (a checkpointed range of iterations outputs its ys), without carried collections.
  ScanSchedule schedule{};

  // Flax names the scanned module after its body: ScanBlock_0.
  static std::string type_name() { return "Scan" + module_type_name<Body>(); }

  template <class Carry, class... Args>
  auto operator()(Scope& s, const Carry& carry, const Args&... args) const {
    int n = length;
    for (int m : std::initializer_list<int>{-1, detail::scanned_length(args, s.path())...}) {
      if (m < 0) continue;
      if (n > 0 && m != n)
        detail::throw_scan_error(s.path(), linum::detail::cat("length is ", n, " but a scanned argument has a leading axis of ", m));
      n = m;
    }
    if (n < 1)
      detail::throw_scan_error(s.path(), linum::detail::cat("length must be at least 1, got ", n,
                                                            " (set .length, or pass inputs with lift::scanned)"));
    detail::ScanPlan plan = detail::plan_scan(
        s, ScanSettings{n, reverse, variable_axes, variable_broadcast, variable_carry, split_rngs}, n);
    const auto sliced = std::make_tuple(detail::slice_arg(args, n)...);
    using Result = std::decay_t<decltype(detail::result_of_body<Body, Carry, std::decay_t<decltype(sliced)>>(
        std::index_sequence_for<Args...>{}))>;
    constexpr bool kWithYs = !std::is_same_v<Result, Carry>;
    static_assert(!kWithYs || detail::is_pair<Result>::value,
                  "lift::scan: the body must return the next carry (same type as the carry) or std::pair(carry, y)");

    using linum::detail::ScopeState;
    auto run_at = [&](int i, const Carry& h, ScopeState& st) -> Result {
      Scope inner(st, plan.path);
      return std::apply([&](const auto&... a) { return linum::detail::ModuleEntry::run(inner, body, body, h, a.at(i)...); }, sliced);
    };
    if (schedule.kind != ScanSchedule::Kind::none && !s.is_initializing() && autodiff::is_recording())
      return scheduled<Result>(std::move(plan), sliced, carry, n);
    std::vector<ScopeState> states(static_cast<std::size_t>(n));
    using Y = typename detail::YsOf<Result, kWithYs>::type;
    std::vector<Y> ys(static_cast<std::size_t>(n));
    Carry h = carry;
    // Flax's counters continue from a first run of the body; predicted when a call like this one
    // ran before (not at init, where that run also creates the broadcast variables).
    const std::string body_id = typeid(Body).name();
    const detail::RngCounters entry = plan.counters;
    std::optional<detail::RngCounters> predicted;
    if (!s.is_initializing() && (!plan.split_keys.empty() || !plan.broadcast_keys.empty()))
      predicted = detail::predicted_counters(body_id, plan);
    if (predicted) plan.counters = *predicted;
    for (int step = 0; step < n; ++step) {
      const int i = reverse ? n - 1 - step : step;
      ScopeState st = detail::iteration_state(plan, i);
      Result r = run_at(i, h, st);
      if (step == 0 && predicted && !detail::prediction_held(entry, *predicted, detail::Pack::counters_of(st))) {
        predicted.reset();  // the body draws differently now: run it from the entry counters
        plan.counters = entry;
        st = detail::iteration_state(plan, i);
        r = run_at(i, h, st);
      }
      if (step == 0 && !predicted && detail::drew_keys(plan, st)) {  // Flax's second trace: counters continue
        detail::continue_counters(plan, st);
        if (!s.is_initializing()) detail::remember_counters(body_id, plan, entry, plan.counters);
        detail::after_iteration(plan, st, /*discarded=*/true);  // broadcast variables it created stay
        st = detail::iteration_state(plan, i);
        r = run_at(i, h, st);
      }
      detail::after_iteration(plan, st);
      states[static_cast<std::size_t>(i)] = std::move(st);
      if constexpr (kWithYs) {
        detail::check_carry(plan.path, i, h, r.first);
        h = std::move(r.first);
        ys[static_cast<std::size_t>(i)] = std::move(r.second);
      } else {
        detail::check_carry(plan.path, i, h, r);
        h = std::move(r);
      }
    }
    detail::finish_scan(plan, states);
    if constexpr (kWithYs) return std::make_pair(std::move(h), detail::stack_ys(ys, out_axes, s.path()));
    else return h;
  }

 private:
  // The iterations under `schedule`: each is a step of lift::run_steps, which decides what is
  // checkpointed; a step's recomputation rebuilds its iteration state from the plan.
  template <class Result, class Carry, class Sliced>
  Result scheduled(detail::ScanPlan plan, const Sliced& sliced, const Carry& carry, int n) const {
    constexpr bool kWithYs = !std::is_same_v<Result, Carry>;
    using linum::detail::ScopeState;
    if (!variable_carry.empty())
      detail::throw_scan_error(plan.path, "a schedule cannot be combined with variable_carry collections");
    struct Context {
      detail::ScanPlan plan;
      Sliced sliced;
      Body body;
      bool reverse;
      std::vector<std::optional<ScopeState>> states;  // the forward pass's, for finish_scan
      bool forward = true;
    };
    auto ctx = std::make_shared<Context>(Context{std::move(plan), sliced, body, reverse, {}, true});
    ctx->states.resize(static_cast<std::size_t>(n));
    auto run_at = [](Context& c, int i, const Carry& h, ScopeState& st) -> Result {
      Scope inner(st, c.plan.path);
      return std::apply([&](const auto&... a) { return linum::detail::ModuleEntry::run(inner, c.body, c.body, h, a.at(i)...); }, c.sliced);
    };
    if (!ctx->plan.split_keys.empty() || !ctx->plan.broadcast_keys.empty()) {
      // Flax's first trace: if the body draws keys, the iterations' counters continue from it.
      autodiff::NoGradGuard probe;
      const int first = reverse ? n - 1 : 0;
      ScopeState st = detail::iteration_state(ctx->plan, first);
      (void)run_at(*ctx, first, carry, st);
      if (detail::drew_keys(ctx->plan, st)) detail::continue_counters(ctx->plan, st);
    }
    auto step = [ctx, run_at, n](std::int64_t k, const Carry& h) {
      const int i = ctx->reverse ? n - 1 - static_cast<int>(k) : static_cast<int>(k);
      ScopeState st = detail::iteration_state(ctx->plan, i);
      Result r = run_at(*ctx, i, h, st);
      if (ctx->forward) ctx->states[static_cast<std::size_t>(i)].emplace(std::move(st));  // recomputations' writes are dropped
      if constexpr (kWithYs) {
        detail::check_carry(ctx->plan.path, i, h, r.first);
        return r;
      } else {
        detail::check_carry(ctx->plan.path, i, h, r);
        return r;
      }
    };
    auto finish = [&] {
      ctx->forward = false;
      std::vector<ScopeState> states;
      for (auto& st : ctx->states) states.push_back(std::move(*st));
      ctx->states.clear();
      detail::finish_scan(ctx->plan, states);
    };
    if constexpr (kWithYs) {
      auto [h, ys] = run_steps_with_ys(n, carry, step, schedule);
      finish();
      if (reverse) std::reverse(ys.begin(), ys.end());  // step k ran slice n - 1 - k; ys go by slice
      return std::make_pair(std::move(h), detail::stack_ys(ys, out_axes, plan.path));
    } else {
      Carry h = run_steps(n, carry, step, schedule);
      finish();
      return h;
    }
  }
};

}  // namespace linum::lift
