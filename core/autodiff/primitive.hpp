// The one path every differentiable op takes (as an op passes through PyTorch's dispatcher or
// JAX's Primitive.bind).
//
// An op is declared once, at its call site, as a primitive: a name, its inputs, a forward that
// computes the outputs and keeps what the backward rule reads, and the backward rule. The forward
// and the rule sit next to each other, and the arrays the forward keeps say what is saved:
//
//   Array exp(const Array& x) {
//     return autodiff::primitive("exp", {&x},
//         [&](autodiff::Residuals& r) { Array y = exp_kernel(x); r.keep(y); return y; },
//         [](autodiff::Cotangents& c, autodiff::Saved s) { c.set(0, mul(c.out(), s[0])); });
//   }
//
// The dispatcher (`primitive`) does everything around the kernel, for every op alike:
//   0. batched inputs (vmap) reaching it mean the op has no batching rule of its own (ops with one
//      apply it at their entry, core/ops/batching.hpp): it runs once per example, each run recorded
//      as its own node, and the outputs are stacked (primitive_by_loop; reported once per op);
//   1. constants (no input needs a gradient, or recording is off): runs the forward and returns;
//      nothing is recorded or kept (debug checks see constants per module, see debug_nans.hpp);
//   2. otherwise asks the enclosing checkpoint region first: when it replays a block whose policy
//      saved this op's output, or whose output nothing in the replay reads, the forward is skipped
//      and the region supplies the outputs and the residuals (inputs come from the replay, internal
//      residuals were saved with the output);
//   3. records the node, shows it to the hooks (checkpoint regions number it, decide what to save
//      and learn the data flow; residual traces), packs its residuals through the saved-value hooks
//      (core/autodiff/saved_hooks.hpp), checks its outputs (debug_nans) and tells the memory timeline;
//   and, while a profiler records (core/profiler.hpp), times the op, constants included.
// So remat policies, dead-code elimination, verify mode, debug checks, timelines and the profiler see every op,
// built-in or user-defined (linum::custom_vjp, core/autodiff/custom_vjp.hpp, builds on this).
//
// The forward and the backward rule run with recording off; both may call ops (they are constants
// then: the primitive is one node). A rule wrapped in autodiff::higher_order (graph.hpp) can also
// run in create-graph mode, with recording on, for derivatives of derivatives: the dispatcher notes
// which residuals are the op's inputs and outputs, and that mode hands them to the rule linked to
// the graph.
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/autodiff/batching.hpp>
#include <linum/core/autodiff/graph.hpp>
#include <linum/core/debug_nans.hpp>
#include <linum/core/memory.hpp>
#include <linum/core/profiler.hpp>

#include <initializer_list>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

namespace linum::autodiff {

// What a primitive's forward keeps for its backward rule, in the order the rule's `Saved` indexes
// it. An undefined array holds a place for "not needed" (e.g. mul keeps an operand only when the
// other one needs a gradient). When nothing needs a gradient, keep() does nothing, so the forward
// need not ask.
class Residuals {
 public:
  explicit Residuals(bool recording) : recording_(recording) {}
  // Whether the op is being recorded (a forward may skip preparing what only the rule needs).
  bool recording() const { return recording_; }
  template <class... A>
  void keep(const A&... arrays) {
    if (!recording_) return;
    arrays_.reserve(arrays_.size() + sizeof...(A));
    (arrays_.push_back(static_cast<const Array&>(arrays).detached()), ...);
  }
  std::vector<Array>& arrays() { return arrays_; }

 private:
  bool recording_;
  std::vector<Array> arrays_;
};

namespace detail {

// What the dispatcher shows the record hooks about a primitive it recorded: its inputs and the
// residuals its node keeps (positionally, undefined entries included), and an opaque description
// of its outputs' structure that a replay hands back with them (custom_vjp's output pytree).
struct PrimitiveCall {
  std::span<const Array* const> inputs;
  std::span<const Array> outputs;
  std::span<const Array> residuals;
  std::size_t num_outputs = 1;
  std::shared_ptr<const void> structure;
};

// What a replaying checkpoint region supplies instead of running a primitive's forward.
struct Replayed {
  std::vector<Array> outs;
  std::vector<Array> residuals;
  std::shared_ptr<const void> structure;
};

// The innermost checkpoint region's replacement for the next primitive's forward, or nullopt
// (compute as usual). Only called when a record hook is active.
std::optional<Replayed> replay_primitive(std::span<const Array* const> inputs);

// Whether a primitive on these inputs is recorded: one of them has a graph node and recording is
// on (inputs first: constants cost no thread-local read).
inline bool any_needs_grad(std::span<const Array* const> inputs) {
  for (const Array* a : inputs)
    if (a->node() != nullptr) return recording_on();
  return false;
}

// Whether a primitive on these inputs takes the plain path: no input is batched (vmap) and none
// needs a gradient. One pass over the inputs.
inline bool plain_constant(std::span<const Array* const> inputs) {
  bool node = false;
  for (const Array* a : inputs) {
    if (a->batched()) [[unlikely]]
      return false;
    node = node || a->node() != nullptr;
  }
  return !node || !recording_on();
}

std::vector<Edge> edges_of(std::span<const Array* const> inputs);

// Records the node of a single-output primitive whose output `y` and residuals are known.
template <class Rule>
Array finish_primitive(const char* name, std::span<const Array* const> ins, Array y, std::vector<Array> residuals, Rule&& rule) {
  ResidualOrigins origins = residual_origins(ins, std::span<const Array>(&y, 1), residuals);
  auto node = std::make_shared<RuleNode<std::decay_t<Rule>>>(name, edges_of(ins), y.shape(), std::move(residuals),
                                                             std::forward<Rule>(rule), std::move(origins));
  auto* raw = node.get();
  y.set_node(std::move(node), 0);
  if (observed()) [[unlikely]] {
    const PrimitiveCall call{ins, std::span<const Array>(&y, 1), raw->residuals(), 1, {}};
    after_record_observed(name, std::span<Array>(&y, 1), raw, &call);
  }
  return y;
}

// Inside a checkpoint region: the region may supply the output and residuals instead.
template <class Forward, class Rule>
[[gnu::noinline]] Array primitive_in_region(const char* name, std::span<const Array* const> ins, Forward& forward, Rule&& rule) {
  if (std::optional<Replayed> r = replay_primitive(ins))
    return finish_primitive(name, ins, std::move(r->outs.at(0)), std::move(r->residuals), std::forward<Rule>(rule));
  Residuals kept(true);
  Array y = [&] {
    NoGradGuard inner;
    return forward(kept);
  }();
  return finish_primitive(name, ins, std::move(y), std::move(kept.arrays()), std::forward<Rule>(rule));
}

// Records the node of a primitive with several outputs `ys` whose residuals are known.
template <class Rule>
void finish_primitive_multi(const char* name, std::span<const Array* const> ins, std::vector<Array>& ys,
                            std::vector<Array> residuals, Rule&& rule, std::shared_ptr<const void> structure) {
  std::vector<Shape> shapes;
  shapes.reserve(ys.size());
  for (const Array& o : ys) shapes.push_back(o.shape());
  ResidualOrigins origins = residual_origins(ins, ys, residuals);
  auto node = std::make_shared<RuleNode<std::decay_t<Rule>>>(name, edges_of(ins), std::move(shapes), std::move(residuals),
                                                             std::forward<Rule>(rule), std::move(origins));
  auto* raw = node.get();
  for (std::size_t i = 0; i < ys.size(); ++i) ys[i].set_node(node, static_cast<std::uint32_t>(i));
  if (observed()) {
    const PrimitiveCall call{ins, ys, raw->residuals(), ys.size(), std::move(structure)};
    after_record_observed(name, ys, raw, &call);
  }
}

// A value a primitive's forward handed back while looping over the batch that is itself batched (an
// input kept as a residual, an input returned as is): the current example, as the example's input
// when it is one.
inline Array own_example(const Array& a, std::span<const Array* const> ins, std::span<const Array> examples) {
  for (std::size_t i = 0; i < ins.size(); ++i)
    if (ins[i]->batched() && a.buffer_identity() == ins[i]->buffer_identity() && a.shape() == ins[i]->shape() &&
        a.dtype() == ins[i]->dtype())
      return examples[i].detached();
  return copy_current_example(a);
}

// vmap's fallback for a primitive without a batching rule (some input batched): the primitive runs
// once per example, each run recorded as its own node on that example's inputs (so gradients and
// checkpoint replays work as for any primitive), and the outputs are stacked into batched arrays.
// While an example runs, the loop cursor makes every batched array its forward reads show that
// example (core/batch_levels.hpp); one the rule would read later is copied out first. Reported once
// per op name.
template <bool kSingle, class Forward, class Rule>
std::vector<Array> primitive_by_loop(const char* name, std::span<const Array* const> ins, Forward& forward, const Rule& rule,
                                     std::shared_ptr<const void>* structure) {
  const std::vector<BatchLevel> levels = union_levels(ins, name);
  std::int64_t total = 1;
  for (const BatchLevel& l : levels) total *= l.size;
  report_loop(name, total);
  std::vector<std::vector<Array>> examples(ins.size());
  for (std::size_t i = 0; i < ins.size(); ++i)
    if (ins[i]->batched()) examples[i] = unstack_examples(*ins[i]);
  std::vector<std::vector<Array>> outs;  // [output][example]
  std::vector<std::int64_t> index(levels.size(), 0);
  std::vector<Array> current(ins.size());
  std::vector<const Array*> current_ptrs(ins.size());
  for (std::int64_t n = 0; n < total; ++n) {
    for (std::int64_t rem = n, l = static_cast<std::int64_t>(levels.size()) - 1; l >= 0; --l) {
      index[static_cast<std::size_t>(l)] = rem % levels[static_cast<std::size_t>(l)].size;
      rem /= levels[static_cast<std::size_t>(l)].size;
    }
    linum::detail::BatchCursor::Entry cursor({levels, index});
    for (std::size_t i = 0; i < ins.size(); ++i) {
      if (ins[i]->batched()) {
        std::int64_t flat = 0;
        for (const BatchLevel& own : ins[i]->batch_levels())
          for (std::size_t l = 0; l < levels.size(); ++l)
            if (levels[l].id == own.id) flat = flat * own.size + index[l];
        current[i] = examples[i][static_cast<std::size_t>(flat)];
      } else {
        current[i] = *ins[i];
      }
      current_ptrs[i] = &current[i];
    }
    const std::span<const Array* const> example_ins(current_ptrs);
    const bool recording = any_needs_grad(example_ins);
    Residuals kept(recording);
    std::vector<Array> ys;
    std::shared_ptr<const void> replayed_structure;
    bool replayed = false;
    if (recording && record_hooks_active())
      if (std::optional<Replayed> r = replay_primitive(example_ins)) {
        ys = std::move(r->outs);
        kept.arrays() = std::move(r->residuals);
        replayed_structure = std::move(r->structure);
        replayed = true;
      }
    if (!replayed) {
      NoGradGuard inner;
      SerialScope serial;  // the cursor is this thread's: kernels must read batched arrays here
      if constexpr (kSingle) ys.push_back(forward(kept));
      else ys = forward(kept);
    }
    for (Array& y : ys)
      if (y.batched()) y = own_example(y, ins, current);
    for (Array& r : kept.arrays())
      if (r.defined() && r.batched()) r = own_example(r, ins, current);
    if (recording) {
      if constexpr (std::is_copy_constructible_v<Rule>) {
        if (replayed && structure != nullptr) *structure = replayed_structure;
        finish_primitive_multi(name, example_ins, ys, std::move(kept.arrays()), Rule(rule),
                               structure != nullptr ? *structure : replayed_structure);
      } else {
        throw BatchingError(linum::detail::cat("vmap: op '", name, "' has no batching rule and its backward rule cannot be "
                                               "copied to run once per example; give it a batching rule"));
      }
    }
    if (outs.size() < ys.size()) outs.resize(ys.size());
    for (std::size_t j = 0; j < ys.size(); ++j) outs[j].push_back(std::move(ys[j]));
  }
  std::vector<Array> stacked;
  stacked.reserve(outs.size());
  for (const std::vector<Array>& per_example : outs) stacked.push_back(stack_examples(per_example, levels));
  return stacked;
}

}  // namespace detail

// Runs a primitive with one output. `forward(Residuals&) -> Array` computes the output with the
// op's kernels and keeps what `rule(Cotangents&, Saved)` reads; `inputs` are the differentiable
// inputs, in the order the rule's Cotangents::set uses. Shapes and other small data the rule needs
// are captured by value in the rule.
template <class Forward, class Rule>
Array primitive(const char* name, std::initializer_list<const Array*> inputs, Forward&& forward, Rule&& rule) {
  const std::span<const Array* const> ins(inputs.begin(), inputs.size());
  const profiler::detail::Span span(name, profiler::detail::SpanKind::op, ins);  // (nothing unless profiling)
  if (detail::plain_constant(ins)) [[likely]] {
    Residuals none(false);
    return forward(none);
  }
  if (any_batched(ins)) [[unlikely]]
    return std::move(detail::primitive_by_loop<true>(name, ins, forward, rule, nullptr).at(0));
  if (detail::record_hooks_active()) [[unlikely]]
    return detail::primitive_in_region(name, ins, forward, std::forward<Rule>(rule));
  Residuals kept(true);
  Array y = [&] {
    NoGradGuard inner;  // ops the forward calls are part of this primitive, not nodes of their own
    return forward(kept);
  }();
  return detail::finish_primitive(name, ins, std::move(y), std::move(kept.arrays()), std::forward<Rule>(rule));
}

// Runs a primitive with several outputs (and inputs given as a list). `forward(Residuals&)`
// returns the outputs; the rule reads c.out(i) per output (undefined when output i got no
// cotangent). `structure` (optional) is handed back with the outputs when a checkpoint's replay
// skips the forward (custom_vjp keeps its output pytree there).
template <class Forward, class Rule>
std::vector<Array> primitive_multi(const char* name, std::span<const Array* const> ins, Forward&& forward, Rule&& rule,
                                   std::shared_ptr<const void>* structure = nullptr) {
  const profiler::detail::Span span(name, profiler::detail::SpanKind::op, ins);
  if (detail::plain_constant(ins)) [[likely]] {
    Residuals none(false);
    return forward(none);
  }
  if (any_batched(ins)) [[unlikely]]
    return detail::primitive_by_loop<false>(name, ins, forward, rule, structure);
  Residuals kept(true);
  std::vector<Array> ys;
  bool replayed = false;
  if (detail::record_hooks_active())
    if (std::optional<detail::Replayed> r = detail::replay_primitive(ins)) {
      ys = std::move(r->outs);
      kept.arrays() = std::move(r->residuals);
      if (structure != nullptr) *structure = std::move(r->structure);
      replayed = true;
    }
  if (!replayed) {
    NoGradGuard inner;
    ys = forward(kept);
  }
  detail::finish_primitive_multi(name, ins, ys, std::move(kept.arrays()), std::forward<Rule>(rule),
                                 structure != nullptr ? *structure : nullptr);
  return ys;
}

}  // namespace linum::autodiff
