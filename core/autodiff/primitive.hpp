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
//   1. constants (no input needs a gradient, or recording is off): runs the forward and returns;
//      nothing is recorded or kept (debug checks see constants per module, see debug_nans.hpp);
//   2. otherwise asks the enclosing checkpoint region first: when it replays a block whose policy
//      saved this op's output, or whose output nothing in the replay reads, the forward is skipped
//      and the region supplies the outputs and the residuals (inputs come from the replay, internal
//      residuals were saved with the output);
//   3. records the node, shows it to the hooks (checkpoint regions number it, decide what to save
//      and learn the data flow; residual traces), packs its residuals through the saved-value hooks
//      (core/autodiff/saved_hooks.hpp), checks its outputs (debug_nans) and tells the memory timeline.
// So remat policies, dead-code elimination, verify mode, debug checks and timelines see every op,
// built-in or user-defined (linum::custom_vjp, core/autodiff/custom_vjp.hpp, builds on this).
//
// The forward and the backward rule run with recording off; both may call ops (they are constants
// then: the primitive is one node). A rule wrapped in autodiff::higher_order (graph.hpp) can also
// run in create-graph mode, with recording on, for derivatives of derivatives: the dispatcher notes
// which residuals are the op's inputs and outputs, and that mode hands them to the rule linked to
// the graph.
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/autodiff/graph.hpp>
#include <linum/core/debug_nans.hpp>
#include <linum/core/memory.hpp>

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

std::vector<Edge> edges_of(std::span<const Array* const> inputs);

// Records the node of a single-output primitive whose output `y` and residuals are known.
template <class Rule>
Array finish_primitive(const char* name, std::span<const Array* const> ins, Array y, std::vector<Array> residuals, Rule&& rule) {
  const ResidualOrigins origins = residual_origins(ins, std::span<const Array>(&y, 1), residuals);
  auto node = std::make_shared<RuleNode<std::decay_t<Rule>>>(name, edges_of(ins), y.shape(), std::move(residuals),
                                                             std::forward<Rule>(rule), origins);
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

}  // namespace detail

// Runs a primitive with one output. `forward(Residuals&) -> Array` computes the output with the
// op's kernels and keeps what `rule(Cotangents&, Saved)` reads; `inputs` are the differentiable
// inputs, in the order the rule's Cotangents::set uses. Shapes and other small data the rule needs
// are captured by value in the rule.
template <class Forward, class Rule>
Array primitive(const char* name, std::initializer_list<const Array*> inputs, Forward&& forward, Rule&& rule) {
  const std::span<const Array* const> ins(inputs.begin(), inputs.size());
  if (!detail::any_needs_grad(ins)) [[likely]] {
    Residuals none(false);
    return forward(none);
  }
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
  if (!detail::any_needs_grad(ins)) [[likely]] {
    Residuals none(false);
    return forward(none);
  }
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
  std::vector<Shape> shapes;
  shapes.reserve(ys.size());
  for (const Array& o : ys) shapes.push_back(o.shape());
  const detail::ResidualOrigins origins = detail::residual_origins(ins, ys, kept.arrays());
  auto node = std::make_shared<RuleNode<std::decay_t<Rule>>>(name, detail::edges_of(ins), std::move(shapes),
                                                                          std::move(kept.arrays()), std::forward<Rule>(rule), origins);
  auto* raw = node.get();
  for (std::size_t i = 0; i < ys.size(); ++i) ys[i].set_node(node, static_cast<std::uint32_t>(i));
  if (detail::observed()) {
    const detail::PrimitiveCall call{ins, ys, raw->residuals(), ys.size(), structure != nullptr ? *structure : nullptr};
    detail::after_record_observed(name, ys, raw, &call);
  }
  return ys;
}

}  // namespace linum::autodiff
