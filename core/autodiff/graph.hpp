// The reverse-mode autodiff graph.
//
// Ops run eagerly. While differentiating (inside grad/value_and_grad/vjp, see grad.hpp), an op
// whose inputs carry graph nodes records a Node holding exactly what its backward rule needs and
// attaches it to its output. The backward sweep orders the reachable nodes topologically once
// (iteratively: deep models cannot overflow the stack), runs each node's rule in reverse order and,
// unless asked to retain the graph, frees each node's saved arrays as soon as it has run.
//
// Ops are primitives declared through one dispatcher (core/autodiff/primitive.hpp), which records
// the node, asks checkpoint regions whether the forward can be skipped, and runs every check and
// observer; user-defined ops use linum::custom_vjp (core/autodiff/custom_vjp.hpp).
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/context.hpp>
#include <linum/core/debug_nans.hpp>
#include <linum/core/memory.hpp>
#include <linum/core/profiler.hpp>

#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <span>
#include <stdexcept>
#include <string_view>
#include <vector>

namespace linum::autodiff {

// ---- per-thread recording state -------------------------------------------------------------

class Node;
class LeafGradientListener;
struct SavedValueHooks;

namespace detail {
class RecordHook;
struct PrimitiveCall;
// The per-thread contexts of the autodiff layer (core/context.hpp): whether ops record, the record
// hooks (checkpoint regions, residual traces), the saved-value hooks, the leaf-gradient listener.
struct RecordingContext { using Value = bool; };
struct RecordHookContext { using Value = RecordHook*; };
struct SavedValueHooksContext { using Value = std::shared_ptr<const SavedValueHooks>; };
struct LeafGradientListenerContext { using Value = LeafGradientListener*; };
// How many differentiation transformations (grad, vjp, jvp) are running their function on this
// thread: a transformation called at depth >= 1 with recording on is nested in another one.
struct DepthContext { using Value = int; };
// True while a backward sweep runs rules to build a differentiable gradient (create-graph mode).
struct CreateGraphContext { using Value = bool; };
// Where node ids come from on this thread (see ReuseIdsScope): the next id to hand out and the end
// of the range, or null for the process-wide counter.
struct IdCursor {
  std::uint64_t next, end;
};
struct IdRangeContext { using Value = IdCursor*; };
using IdRanges = linum::detail::ContextStack<IdRangeContext>;
using Depths = linum::detail::ContextStack<DepthContext>;
using CreateGraph = linum::detail::ContextStack<CreateGraphContext>;
using Recording = linum::detail::ContextStack<RecordingContext>;
using RecordHooks = linum::detail::ContextStack<RecordHookContext>;
using SavedValueHooksStack = linum::detail::ContextStack<SavedValueHooksContext>;
using LeafGradientListeners = linum::detail::ContextStack<LeafGradientListenerContext>;
inline bool recording_on() {
  const bool* on = Recording::top();
  return on == nullptr || *on;
}
}  // namespace detail

// True when ops on this thread may record graph nodes (the default). NoGradGuard turns it off.
inline bool is_recording() { return detail::recording_on(); }

// How many differentiation transformations enclose this point (0 at top level).
inline int differentiation_depth() {
  const int* d = detail::Depths::top();
  return d == nullptr ? 0 : *d;
}

// True while a backward rule runs in create-graph mode: the gradient it computes will itself be
// differentiated (grad of grad, hvp, jvp), so it must be built from ops, which record, reading the
// residuals relinked to the graph. Rules written with raw kernels branch on it (see higher_order).
inline bool creating_graph() {
  const bool* on = detail::CreateGraph::top();
  return on != nullptr && *on;
}

// Marks the function of a differentiation transformation as running (depth + 1) for its lifetime.
class DifferentiationScope {
 public:
  DifferentiationScope() : depth_(differentiation_depth() + 1) {}

 private:
  detail::Depths::Entry depth_;
};

// Sets create-graph mode on or off for its lifetime.
class CreateGraphScope {
 public:
  explicit CreateGraphScope(bool on) : on_(on) {}

 private:
  detail::CreateGraph::Entry on_;
};

// Nodes created on this thread during its lifetime take the ids first, first + 1, ... below `end`,
// then fresh ones. A checkpoint recomputing its block in create-graph mode reuses the ids its block's
// ops had in the forward pass, so the recomputed nodes take the plain graph's places in every later
// sweep's order (creation order stays topological: the block's inputs are older, its consumers newer).
class ReuseIdsScope {
 public:
  ReuseIdsScope(std::uint64_t first, std::uint64_t end) : cursor_{first, end}, entry_(&cursor_) {}
  ReuseIdsScope(const ReuseIdsScope&) = delete;
  ReuseIdsScope& operator=(const ReuseIdsScope&) = delete;

 private:
  detail::IdCursor cursor_;
  detail::IdRanges::Entry entry_;
};

// Within its lifetime no op on this thread records graph nodes: results are constants.
class NoGradGuard {
 public:
  NoGradGuard() = default;

 private:
  detail::Recording::Entry off_{false};
};

// ---- nodes ----------------------------------------------------------------------------------

// Residuals handed to saved-value hooks (core/autodiff/saved_hooks.hpp): what pack returned, per
// residual, and the hooks that unpack them.
struct PackedResiduals;

// What a value handed to saved-value hooks is.
struct SavedValueInfo {
  const char* op = "";                 // the op whose backward rule reads it ("checkpoint" for a checkpoint)
  const char* producer_op = nullptr;   // the op that computed it (the op itself for a value it made);
                                       // null for a constant or a differentiation variable
  std::string_view label;              // the producer's checkpoint_name, if any
  // A value an op computed (not a constant or a variable such as a parameter: alive anyway).
  bool computed() const { return producer_op != nullptr; }
};

// An input of a node: the node that produced it and which of its outputs. A null node means the
// input is a constant and needs no gradient.
struct Edge {
  std::shared_ptr<Node> node;
  std::uint32_t index = 0;
};

// What a node does first with the cotangent g of its output 0, declared so that the node computing
// that cotangent can do it inside its own kernel (a product's epilogue) instead of this node making
// one more pass over it: g2 = g * derivative, elementwise (the node's residual `derivative`, of g's
// shape), rounded once to g's dtype; or, for `select_positive`, g2 = g where derivative > 0 and 0
// elsewhere (relu's rule, from its output); and with `column_sums`, g2's column sums (before that
// rounding) by blocks of rows, handed over as one array. The layout of the sums is agreed between
// the two ops' rules (the fused linear layer, core/ops/linear.cpp, is both producer and consumer).
struct CotangentPrologue {
  enum class Kind : std::uint8_t { multiply, select_positive };
  std::uint32_t derivative = 0;
  bool column_sums = false;
  Kind kind = Kind::multiply;
};

// What a backward rule sees: the cotangents of the node's outputs, and slots for its inputs.
class Cotangents {
 public:
  // Where the gradient of an edge accumulates in the running sweep (null: nowhere, it is dropped).
  using Accumulators = std::function<Array*(const Edge&)>;
  // `self` is the node whose rule runs and `sweep` the running sweep's mark (0: no prologues are
  // offered, as in create-graph mode).
  Cotangents(std::span<Array> outs, std::span<Array> ins, std::span<const Edge> edges,
             const Accumulators* accumulators = nullptr, Node* self = nullptr, std::uint64_t sweep = 0)
      : outs_(outs), ins_(ins), edges_(edges), accumulators_(accumulators), self_(self), sweep_(sweep) {}
  // Cotangent of output i. For single-output nodes it is always defined; for multi-output nodes an
  // output that received no gradient is undefined (check `.defined()`).
  const Array& out(std::size_t i = 0) const { return outs_[i]; }
  std::size_t num_outputs() const { return outs_.size(); }
  std::size_t num_inputs() const { return ins_.size(); }
  // Whether input i needs a gradient (its producer is recorded). Rules skip the others.
  bool needs(std::size_t i) const { return edges_[i].node != nullptr; }
  void set(std::size_t i, Array g) {
    ins_[i] = std::move(g);
    if (static_cast<int>(i) == applied_input_) applied_input_ = -1, applied_sums_ = Array();  // (a plain cotangent again)
  }
  // The running sum of input i's gradient in the enclosing sweep (what the consumers processed so
  // far gave it), or null. A checkpoint continues that sum inside its recomputed block, adding each
  // contribution where the plain graph adds it: bitwise the plain gradient, and one array per input
  // instead of one per contribution.
  Array* accumulator(std::size_t i) const {
    return accumulators_ != nullptr && needs(i) ? (*accumulators_)(edges_[i]) : nullptr;
  }
  // Moves the cotangent of output i out (for rules that want to free it as early as possible).
  Array take_out(std::size_t i) { return std::exchange(outs_[i], Array()); }
  // `value`, standing for input i (rebuilt by a create-graph rule from a residual kept in another
  // form), linked to input i's producer, as create-graph mode relinks residuals that are inputs.
  Array linked_input(std::size_t i, Array value) const {
    if (needs(i)) value.set_node(edges_[i].node, edges_[i].index);
    return value;
  }

  // ---- cotangent prologues (CotangentPrologue) ----
  // The prologue of input i's producer, offered to this rule when the cotangent it computes for input
  // i is the only one that output receives in the sweep and goes straight to it: the rule may then
  // apply the prologue inside the kernel computing that cotangent and hand the result over with
  // set_with_prologue (or ignore the offer and call set). Not offered in create-graph mode, with
  // debug checks on (they check the cotangent itself), or when saved-value hooks hold the residual.
  struct PrologueOffer {
    const Array* derivative;  // the producer's residual, alive until the producer's rule has run
    bool column_sums;
    CotangentPrologue::Kind kind;
  };
  std::optional<PrologueOffer> producer_prologue(std::size_t i) const;
  // Input i's cotangent with its producer's prologue applied (after producer_prologue(i) offered
  // it), and the column sums when the offer asked for them. One input per rule.
  void set_with_prologue(std::size_t i, Array g2, Array column_sums);
  // For a node that declared a prologue: whether the cotangent of its output 0 arrived with it
  // applied (its rule must then not apply it again), and the column sums that came with it.
  bool prologue_applied() const;
  Array take_prologue_sums();
  // (for the sweep) the input handed over with its prologue applied, or -1; and the sums.
  int applied_input() const { return applied_input_; }
  Array take_applied_sums() { return std::move(applied_sums_); }

 private:
  std::span<Array> outs_;
  std::span<Array> ins_;
  std::span<const Edge> edges_;
  const Accumulators* accumulators_;
  Node* self_;
  std::uint64_t sweep_;
  int applied_input_ = -1;
  Array applied_sums_;
};

class Node {
 public:
  // A node with several outputs, or (the common case, no allocation for its type) one.
  Node(const char* op, std::vector<Edge> inputs, std::vector<Shape> output_shapes)
      : inputs_(std::move(inputs)), num_outputs_(static_cast<std::uint32_t>(output_shapes.size())), id_(next_id()), op_(op) {
    if (!output_shapes.empty()) shape0_ = std::move(output_shapes[0]);
    for (std::size_t i = 1; i < output_shapes.size(); ++i) more_.push_back({std::move(output_shapes[i]), DType::f32});
  }
  Node(const char* op, std::vector<Edge> inputs, Shape output_shape)
      : inputs_(std::move(inputs)), shape0_(std::move(output_shape)), num_outputs_(1), id_(next_id()), op_(op) {}
  virtual ~Node() = default;
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  const char* op() const { return op_; }
  const std::vector<Edge>& inputs() const { return inputs_; }
  const Shape& output_shape(std::size_t i) const { return i == 0 ? shape0_ : more_[i - 1].first; }
  // The dtype of output i (set when an array is attached to it; float32 until then). Cotangents
  // reaching this output are converted to it, so every gradient has its value's dtype.
  DType output_dtype(std::size_t i) const { return i == 0 ? dtype0_ : more_[i - 1].second; }
  void set_output_dtype(std::size_t i, DType t) {
    if (i == 0) dtype0_ = t;
    else if (i - 1 < more_.size()) more_[i - 1].second = t;
  }
  std::size_t num_outputs() const { return num_outputs_; }
  virtual bool is_leaf() const { return false; }

  // Computes input cotangents from output cotangents.
  virtual void backward(Cotangents& c) = 0;
  // The same in create-graph mode (creating_graph() is true, recording on): the cotangents computed
  // are differentiable functions of the output cotangents and of the node's inputs. `self` is this
  // node (a rule reading the op's output relinks it to the node). Nodes that cannot raise an
  // AutodiffError naming the op (never a gradient that silently stops there).
  virtual void backward_differentiable(Cotangents& c, const std::shared_ptr<Node>& self);
  // Frees what was saved for the backward pass (after the sweep has used it).
  virtual void release() {}
  // Appends the arrays this node keeps for its backward pass (for memory reports).
  virtual void saved_arrays(std::vector<Array>& /*out*/) const {}
  // Hands the arrays kept for the backward pass to the active saved-value hooks (recording calls
  // it when hooks are in force; core/autodiff/saved_hooks.hpp). `call` (null for ops recorded
  // after computing) tells which residuals are the op's inputs, and so who computed them.
  virtual void pack_residuals(const detail::PrimitiveCall* /*call*/) {}
  // True once release() ran: a second backward through it is an error.
  bool released() const { return released_; }
  // A node that stands for other nodes' outputs: sweeps follow forward_edge(i) instead of entering it
  // (a checkpoint whose block was recomputed in create-graph mode stands for the recomputed block,
  // which later sweeps differentiate like the plain graph).
  bool forwards() const { return forwards_; }
  virtual const Edge* forward_edge(std::uint32_t /*output*/) const { return nullptr; }
  // A label that policies can match (the name given by checkpoint_name), or empty.
  virtual std::string_view label() const { return {}; }
  // Declares what the node's rule does first with its output 0's cotangent (CotangentPrologue), so
  // that the node computing that cotangent may do it instead. The rule must then check
  // Cotangents::prologue_applied.
  void set_cotangent_prologue(CotangentPrologue p) { prologue_ = p; }
  const std::optional<CotangentPrologue>& cotangent_prologue() const { return prologue_; }
  // Residual i as the rule will read it, or null (undefined, handed to saved-value hooks, released).
  virtual const Array* kept_residual(std::size_t /*i*/) const { return nullptr; }
  // Creation order: a node created later has a larger id (process-wide, strictly increasing).
  std::uint64_t id() const { return id_; }
  static std::uint64_t next_id();
  // The id the next node will get (nodes with id >= this value are created after the call).
  static std::uint64_t peek_next_id();

 private:
  friend struct SweepAccess;
  std::vector<Edge> inputs_;
  Shape shape0_;
  DType dtype0_ = DType::f32;
  std::uint32_t num_outputs_;
  std::vector<std::pair<Shape, DType>> more_;  // outputs 1, 2, ... of a multi-output node
  std::vector<Array> grads_;      // accumulated output cotangents during a sweep
  std::uint64_t mark_ = 0;        // visit mark of the current sweep
  std::uint64_t id_;
  const char* op_;
  bool released_ = false;
  bool prologue_applied_ = false;  // output 0's cotangent arrived with the prologue applied
  std::optional<CotangentPrologue> prologue_;
  std::uint32_t consumers_ = 0;        // edges to output 0 from the nodes of the sweep marked consumers_mark_
  std::uint64_t consumers_mark_ = 0;
  Array prologue_sums_;                // the column sums that came with it

 protected:
  bool forwards_ = false;

 public:
  // Accumulated cotangent of output i after a sweep (leaves keep theirs until taken).
  Array take_grad(std::size_t i = 0);

 protected:
  // Packs `saved` (cleared) through the active hooks, infos[i] describing saved[i]. Unpacks for a
  // backward rule of `op`.
  static std::shared_ptr<PackedResiduals> pack(std::vector<Array>& saved, std::span<const SavedValueInfo> infos);
  // What a primitive's residuals are: an input's producer when a residual is an input, else `self`.
  static std::vector<SavedValueInfo> infos_of(std::span<const Array> saved, const detail::PrimitiveCall* call, const Node* self);
  static std::vector<Array> unpack_residuals(const PackedResiduals& packed, const char* op);
};

// A differentiation variable: the node attached to the arrays grad/vjp differentiate against.
class LeafNode final : public Node {
 public:
  explicit LeafNode(Shape shape) : Node("leaf", {}, std::move(shape)) {}
  bool is_leaf() const override { return true; }
  void backward(Cotangents&) override {}
};

// The arrays a backward rule reads, as the rule sees them.
using Saved = std::span<const Array>;

// A backward rule that can also run in create-graph mode (core/autodiff/higher_order.hpp): when
// creating_graph() is true it computes its gradients with ops (which record) from the cotangents and
// the residuals it reads, which are then the op's inputs and outputs relinked to the graph;
// residuals computed inside the forward (masks, counts, statistics) are constants there, so such a
// rule reads them only where they are locally constant, or recomputes them from inputs with ops.
// A rule not wrapped this way makes second derivatives through its op an AutodiffError.
template <class Rule>
struct HigherOrderRule {
  Rule rule;
  void operator()(Cotangents& c, Saved s) { rule(c, s); }
};
template <class Rule>
HigherOrderRule<std::decay_t<Rule>> higher_order(Rule&& rule) {
  return {std::forward<Rule>(rule)};
}
template <class Rule>
inline constexpr bool is_higher_order_v = false;
template <class Rule>
inline constexpr bool is_higher_order_v<HigherOrderRule<Rule>> = true;

namespace detail {
// Where each of a primitive's residuals comes from, 8 bits each: input k (k < 0x80), output j (0x80
// | j), or neither (0xFF: computed inside the forward, an undefined array, or an input or output
// past those indices). Create-graph mode relinks the first two kinds to the graph. The first 8
// residuals' tags are packed in one word (no allocation on the op path); an op that keeps more
// (the recurrent layers with one kernel per gate) stores the rest's.
struct ResidualOrigins {
  std::uint64_t first = ~std::uint64_t{0};
  std::vector<std::uint8_t> rest;
  unsigned tag(std::size_t i) const {
    if (i < 8) return static_cast<unsigned>((first >> (8 * i)) & 0xFF);
    return i - 8 < rest.size() ? rest[i - 8] : 0xFFu;
  }
};
ResidualOrigins residual_origins(std::span<const Array* const> inputs, std::span<const Array> outputs,
                                 std::span<const Array> residuals);
// `residuals` with the ones that are the node's inputs or outputs linked to the graph again.
void relink_residuals(std::vector<Array>& residuals, const ResidualOrigins& origins, const std::vector<Edge>& inputs,
                      const std::shared_ptr<Node>& self);
[[noreturn]] void throw_not_higher_order(const char* op);
}  // namespace detail

// A node whose backward rule is a lambda `rule(Cotangents&, Saved)`. The arrays it keeps for the
// backward pass are declared explicitly (not hidden in captures), so memory reports, remat
// policies and saved-value hooks see them; the lambda captures only small non-array data (shapes,
// axes). Every primitive's node (core/autodiff/primitive.hpp) is one.
template <class Rule>
class RuleNode final : public Node {
 public:
  template <class Shapes>  // std::vector<Shape>, or one Shape
  RuleNode(const char* op, std::vector<Edge> inputs, Shapes shapes, std::vector<Array> saved, Rule rule,
           detail::ResidualOrigins origins = {})
      : Node(op, std::move(inputs), std::move(shapes)), saved_(std::move(saved)), rule_(std::move(rule)),
        origins_(std::move(origins)) {}
  void backward(Cotangents& c) override {
    if (packed_ != nullptr) {
      const std::vector<Array> unpacked = unpack_residuals(*packed_, op());
      (*rule_)(c, Saved(unpacked));
    } else {
      (*rule_)(c, Saved(saved_));
    }
  }
  void backward_differentiable(Cotangents& c, const std::shared_ptr<Node>& self) override {
    if constexpr (!is_higher_order_v<Rule>) {
      detail::throw_not_higher_order(op());
    } else {
      std::vector<Array> linked = packed_ != nullptr ? unpack_residuals(*packed_, op()) : saved_;
      detail::relink_residuals(linked, origins_, inputs(), self);
      (*rule_)(c, Saved(linked));
    }
  }
  void release() override {
    saved_.clear();
    saved_.shrink_to_fit();
    packed_.reset();
    rule_.reset();
  }
  void saved_arrays(std::vector<Array>& out) const override {
    for (const Array& a : saved_)
      if (a.defined()) out.push_back(a);
  }
  void pack_residuals(const detail::PrimitiveCall* call) override {
    if (saved_.empty()) return;
    const std::vector<SavedValueInfo> infos = infos_of(saved_, call, this);
    packed_ = pack(saved_, infos);
  }
  // The arrays the rule reads, positionally (undefined entries included); empty once packed.
  std::span<const Array> residuals() const { return saved_; }
  const Array* kept_residual(std::size_t i) const override {
    return packed_ == nullptr && i < saved_.size() && saved_[i].defined() ? &saved_[i] : nullptr;
  }

 private:
  std::vector<Array> saved_;
  std::shared_ptr<PackedResiduals> packed_;
  std::optional<Rule> rule_;
  detail::ResidualOrigins origins_;
};

// ---- recording ------------------------------------------------------------------------------

// Whether an op applied to these inputs must record a node: recording is on and one input is
// itself recorded. Ops call this before preparing anything, so constants cost nothing.
inline bool needs_grad(const Array& a) { return a.node() != nullptr && is_recording(); }
template <class... More>
bool needs_grad(const Array& a, const More&... more) {
  return is_recording() && (a.node() != nullptr || ((more.node() != nullptr) || ...));
}
bool needs_grad(std::span<const Array> inputs);

std::vector<Edge> edges_of(std::initializer_list<const Array*> inputs);
std::vector<Edge> edges_of(std::span<const Array> inputs);

namespace detail {
// Strips graph nodes from arrays a rule saves (the rule needs their values only).
std::vector<Array> detach_all(std::initializer_list<Array> saved);
// Whether a hook observes recorded ops on this thread (checkpoint regions, residual traces; see
// core/autodiff/hooks.hpp). Ops pay one thread-local load when none is active.
inline bool record_hooks_active() { return RecordHooks::innermost() != nullptr; }
struct PrimitiveCall;
// Runs the hooks, saved-value packing, debug checks and timeline for a freshly recorded node whose
// outputs are `outs` (the same steps for every primitive, core/autodiff/primitive.hpp, and for
// `record` below). A checkpoint replaying its block may replace outputs by the values it saved.
void after_record_observed(const char* op, std::span<Array> outs, Node* node, const PrimitiveCall* call);
// Whether anything observes recorded ops (hooks, saved-value hooks, debug checks, the timeline):
// one branch per op when nothing does, the common case in training.
inline bool observed() {
  return record_hooks_active() || SavedValueHooksStack::innermost() != nullptr || linum::detail::debug_checks_on() ||
         memory::detail::timeline_recording() || profiler::detail::profiling_now();
}
inline void after_record(const char* op, std::span<Array> outs, Node* node, const PrimitiveCall* call) {
  if (observed()) [[unlikely]]
    after_record_observed(op, outs, node, call);
}
// The record hooks' part of after_record alone (checkpoints show their outputs to enclosing regions).
void notify_record_hooks(const char* op, std::span<Array> outs, const Node* node, const PrimitiveCall* call);
}  // namespace detail

// The low-level way to record an op that has already computed `out`: attaches a node to it.
// `inputs` are the op's inputs in the order the rule's Cotangents::set uses, `saved` the arrays
// its backward rule reads (undefined entries allowed for "not needed"). Prefer autodiff::primitive
// (core/autodiff/primitive.hpp) or linum::custom_vjp: an op recorded after computing cannot be
// skipped when a checkpoint replays its block (its value is computed again, then replaced by the
// saved one when the policy saved it).
template <class Rule>
void record(const char* op, Array& out, std::initializer_list<const Array*> inputs, std::initializer_list<Array> saved,
            Rule&& rule) {
  auto node = std::make_shared<RuleNode<std::decay_t<Rule>>>(op, edges_of(inputs), out.shape(), detail::detach_all(saved),
                                                             std::forward<Rule>(rule));
  Node* raw = node.get();
  out.set_node(std::move(node), 0);
  detail::after_record(op, std::span<Array>(&out, 1), raw, nullptr);
}

// The same for ops with several inputs given as a list, or several outputs (each output gets the
// node, with its index).
template <class Rule>
void record_multi(const char* op, std::span<Array> outs, std::vector<Edge> inputs, std::vector<Array> saved, Rule&& rule) {
  std::vector<Shape> shapes;
  shapes.reserve(outs.size());
  for (const Array& o : outs) shapes.push_back(o.shape());
  for (Array& a : saved) a = a.detached();
  auto node = std::make_shared<RuleNode<std::decay_t<Rule>>>(op, std::move(inputs), std::move(shapes), std::move(saved),
                                                             std::forward<Rule>(rule));
  for (std::size_t i = 0; i < outs.size(); ++i) outs[i].set_node(node, static_cast<std::uint32_t>(i));
  detail::after_record(op, outs, node.get(), nullptr);
}

// ---- the backward sweep -----------------------------------------------------------------------

// Runs the backward sweep from `roots` with the given cotangents (same shapes as the roots).
// Gradients accumulate in the leaf nodes (take them with Node::take_grad). Unless
// `retain_graph`, each node's saved arrays are freed as soon as its rule has run, and the graph
// cannot be swept again.
void backward(std::span<const Array> roots, std::span<const Array> cotangents, bool retain_graph = false);

// Observes the backward sweeps of this thread: told as soon as a leaf's gradient is final (no node
// left in the sweep adds to it), while the rest of the sweep still runs. Data parallelism uses it to
// send gradients during the backward pass. Installed for its lifetime (the innermost one on the
// thread is told).
class LeafGradientListener {
 public:
  LeafGradientListener() = default;
  virtual ~LeafGradientListener() = default;
  LeafGradientListener(const LeafGradientListener&) = delete;
  LeafGradientListener& operator=(const LeafGradientListener&) = delete;
  // `grad` is the leaf's accumulated gradient (the one Node::take_grad will return).
  virtual void on_leaf_gradient(const Node* leaf, const Array& grad) = 0;

 private:
  detail::LeafGradientListeners::Entry installed_{this};
};

// One input of a local backward sweep that must not be crossed: a node of an enclosing graph.
struct Boundary {
  Node* node;
  std::uint32_t index;
  friend bool operator==(const Boundary&, const Boundary&) = default;
};

// A backward sweep that stops at `boundaries`: their nodes are neither traversed nor run; the
// cotangents that reach them are returned (one per boundary, undefined if none arrived) instead
// of being accumulated into them. Used by checkpoints to differentiate a recomputed block without
// touching the enclosing graph, which is in the middle of its own sweep.
std::vector<Array> backward_to(std::span<const Array> roots, std::span<const Array> cotangents,
                               std::span<const Boundary> boundaries);
// The same with the roots given as graph edges, so that the caller need not keep the roots' values
// alive during the sweep. The cotangents are consumed (freed as soon as the sweep has used them).
std::vector<Array> backward_to(std::vector<Edge> roots, std::vector<Array> cotangents,
                               std::span<const Boundary> boundaries);
// The same, continuing given running sums: the cotangents reaching boundary b are added, in sweep
// order, to sums[b] (undefined: none yet), which is returned. A checkpoint passes the enclosing
// sweep's running sums of its inputs' gradients, so they are summed in the plain graph's order.
//
// In create-graph mode (`create_graph`, or a sweep started inside a create-graph rule, as a
// checkpoint's recomputation is) rules run as ops that record, the sums are differentiable
// functions of the cotangents and of the graph's values, and the graph is kept. With `prune`, only
// nodes from which a boundary can be reached run: gradients that would flow elsewhere (into an
// enclosing differentiation's variables) are not computed and not accumulated anywhere.
std::vector<Array> backward_into(std::vector<Edge> roots, std::vector<Array> cotangents, std::span<const Boundary> boundaries,
                                 std::vector<Array> sums, bool create_graph = false, bool prune = false);

// The edges from the graph reachable from `roots` (nodes with id >= first_id) into older nodes:
// the values a block of ops computed after `first_id` read from outside, deduplicated, in first-seen
// order. A checkpoint uses it to find its inputs, including arrays its function captured.
std::vector<Edge> external_inputs(std::span<const Array> roots, std::uint64_t first_id);

// A create-graph rule for a primitive whose kernels fuse what ops would do in several steps (a
// normalization, the fused attention, a convolution): its input cotangents are the create-graph
// vjp of `composite`, the same function written with differentiable ops, at `inputs` (the rule's
// relinked residuals, in the node's input order; an input the composite need not read may be
// undefined). Sets the cotangents of c's inputs that need one; the composite's outputs are matched
// to c's outputs.
void composite_rule(Cotangents& c, std::vector<Array> inputs,
                    const std::function<std::vector<Array>(const std::vector<Array>&)>& composite);

// Zeros of g's shape and dtype that stay linked to g's graph (create-graph mode: the gradient of a
// piecewise-constant op, which must still be a function of the cotangent for the check that every
// rule built its gradient with ops).
Array linked_zeros(const Array& g);

// Returns `x` as a new differentiation variable: same data, attached to a fresh LeafNode.
Array make_leaf(const Array& x);

namespace detail {
// How many cotangents reached their producer with its prologue applied (CotangentPrologue), in
// this process so far (for tests and benchmarks).
std::int64_t prologues_applied();
}  // namespace detail

}  // namespace linum::autodiff
