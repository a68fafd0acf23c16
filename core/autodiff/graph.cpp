#include <linum/core/fp_mode.hpp>
#include <linum/core/threading.hpp>
#include <linum/core/autodiff/graph.hpp>
#include <linum/core/autodiff/batching.hpp>
#include <linum/core/autodiff/grad.hpp>
#include <linum/core/autodiff/hooks.hpp>
#include <linum/core/autodiff/primitive.hpp>
#include <linum/core/autodiff/saved_hooks.hpp>
#include <linum/core/error.hpp>

#include <any>
#include <exception>
#include <mutex>
#include <set>
#include <string>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace linum {
// Array's link to the graph lives with the graph: the node learns its output's dtype.
void Array::set_node(std::shared_ptr<autodiff::Node> node, std::uint32_t index) {
  if (node && defined()) node->set_output_dtype(index, dtype_);
  node_ = std::move(node);
  output_index_ = index;
  weak_ = false;
}
}  // namespace linum

namespace linum::autodiff {

// Private access for the sweep (keeps Node's bookkeeping out of its public interface).
struct SweepAccess {
  static std::vector<Array>& grads(Node* n) { return n->grads_; }
  static std::vector<Edge>& inputs(Node* n) { return n->inputs_; }
  static std::uint64_t& mark(Node* n) { return n->mark_; }
  static bool& released(Node* n) { return n->released_; }
  // Output 0's consumers in the sweep marked `mark` (counted while ordering it).
  static void count_consumer(Node* n, std::uint64_t mark) {
    if (n->consumers_mark_ != mark) n->consumers_mark_ = mark, n->consumers_ = 0;
    ++n->consumers_;
  }
  static bool sole_consumer(const Node* n, std::uint64_t mark) { return n->consumers_mark_ == mark && n->consumers_ == 1; }
  static bool& prologue_applied(Node* n) { return n->prologue_applied_; }
  static Array& prologue_sums(Node* n) { return n->prologue_sums_; }
};

namespace {

// The edge a sweep follows for `e`: through nodes that forward their outputs (Node::forwards).
const Edge& resolved(const Edge& e) {
  const Edge* r = &e;
  while (r->node != nullptr && r->node->forwards()) [[unlikely]] {
    const Edge* next = r->node->forward_edge(r->index);
    if (next == nullptr) break;
    r = next;
  }
  return *r;
}

std::atomic<std::uint64_t> g_sweep_counter{0};
std::atomic<std::uint64_t> g_node_counter{1};
std::atomic<std::int64_t> g_prologues_applied{0};

// a + b for same-shaped float arrays: summed in float32 and rounded once to the common dtype (bf16
// only when both are bf16), as ops::add computes, a chunk at a time (no widened copies of a, b or
// the sum). With `in_place` (a running sum of cotangents), written into a's buffer when nothing
// else refers to it.
Array accumulate(const Array& a, const Array& b, bool in_place) {
  const DType common = a.dtype() == DType::bf16 && b.dtype() == DType::bf16 ? DType::bf16 : DType::f32;
  Array out = in_place && a.dtype() == common && a.owns_buffer_alone() ? a : Array::empty(a.shape(), common);
  const std::int64_t n = a.numel();
  // The storage, fetched before the parallel region (the accessors check dtypes and may throw).
  const bool a32 = a.dtype() == DType::f32, b32 = b.dtype() == DType::f32, o32 = common == DType::f32;
  const void* ra = a.raw();
  const void* rb = b.raw();
  void* ro = out.mutable_raw();
  constexpr std::int64_t kChunk = 2048;  // elements widened at a time (on the stack)
  const std::int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for if (n > (1 << 18)) schedule(static) num_threads(linum::team_size())
  for (std::int64_t k = 0; k < chunks; ++k) {
    if ((k & 7) == 0) linum::detail::enter_compute();
    const std::int64_t s = k * kChunk, c = std::min(kChunk, n - s);
    alignas(64) float sa[kChunk], sb[kChunk], so[kChunk];
    auto widened = [&](const void* raw, bool f32, float* scratch) -> const float* {
      if (f32) return static_cast<const float*>(raw) + s;
      bf16_to_f32(static_cast<const bfloat16*>(raw) + s, scratch, c);
      return scratch;
    };
    const float* pa = widened(ra, a32, sa);
    const float* pb = widened(rb, b32, sb);
    float* po = o32 ? static_cast<float*>(ro) + s : so;
    for (std::int64_t i = 0; i < c; ++i) po[i] = pa[i] + pb[i];
    if (!o32) f32_to_bf16(so, static_cast<bfloat16*>(ro) + s, c);
  }
  return out;
}

// A cotangent in the dtype of the value it belongs to (a float32 parameter cast to bf16 for the
// forward pass gets a float32 gradient).
Array in_dtype(Array g, DType want) {
  if (!g.defined() || g.dtype() == want) return g;
  return linum::detail::convert_float(g, want);
}

void add_into(Array& slot, Array g) {
  slot = slot.defined() ? accumulate(slot, g, /*in_place=*/true) : std::move(g).detached();
}

// Create-graph mode: the same sum and dtype conversion as primitives, so that the gradient being
// built stays differentiable (their rules are themselves differentiable: identity and conversion).
Array accumulate_linked(const Array& a, const Array& b) {
  return primitive("add", {&a, &b}, [&](Residuals&) { return accumulate(a, b, /*in_place=*/false); },
                   higher_order([](Cotangents& c, Saved) {
                     if (c.needs(0)) c.set(0, c.out());
                     if (c.needs(1)) c.set(1, c.out());
                   }));
}

Array convert_linked(const Array& g, DType want) {
  if (!g.defined() || g.dtype() == want) return g;
  return primitive("astype", {&g}, [&](Residuals&) { return linum::detail::convert_float(g, want); },
                   higher_order([from = g.dtype()](Cotangents& c, Saved) { c.set(0, convert_linked(c.out(), from)); }));
}

// The sum and conversion a sweep uses, by mode.
struct Accumulation {
  bool create = false;
  Array cast(Array g, DType want) const { return create ? convert_linked(g, want) : in_dtype(std::move(g), want); }
  void add(Array& slot, Array g) const {
    if (!create) return add_into(slot, std::move(g));
    slot = slot.defined() ? accumulate_linked(slot, g) : std::move(g);
  }
};

[[noreturn]] void throw_released(const Node* n) {
  throw AutodiffError(linum::detail::cat(
      "backward: the graph through op '", n->op(),
      "' was already used by a backward pass and freed; compute the forward pass again, or use vjp "
      "(which keeps its graph) to pull back several cotangents. If a checkpointed function (checkpoint, "
      "lift::remat) reads an array it captured by reference ([&]), note that its recomputation runs in the "
      "backward pass, after the enclosing function has returned: capture arrays by value ([=]) or pass them as "
      "arguments"));
}

// The nodes reachable from the roots in creation order (the sweep runs it backwards: the reverse of
// the forward pass, as PyTorch's engine orders ready nodes by sequence number). Nodes for which
// `stop(node)` is true are neither entered nor emitted. A node's inputs exist before it, so creation
// order is topological; and it does not depend on which roots the sweep starts from, so a
// recomputed block (a checkpoint's sub-sweep from its outputs) visits its nodes, and adds up each
// gradient's contributions, in the same order as the plain graph's sweep -- what makes remat'd
// gradients bitwise those of the plain model even when independent branches could run either way
// (e.g. an RNN cell's input projection and its recurrent one).
template <class Stop>
std::vector<std::shared_ptr<Node>> topological_order(std::span<const Array> roots, std::uint64_t mark, Stop stop) {
  std::vector<std::shared_ptr<Node>> order;
  std::vector<std::pair<std::shared_ptr<Node>, std::size_t>> stack;
  for (const Array& root : roots) {
    const Edge r = resolved(Edge{root.node(), root.output_index()});
    if (r.node == nullptr || SweepAccess::mark(r.node.get()) == mark || stop(r.node.get())) continue;
    SweepAccess::mark(r.node.get()) = mark;
    stack.emplace_back(r.node, 0);
    while (!stack.empty()) {
      Node* node = stack.back().first.get();
      std::size_t& next = stack.back().second;
      auto& inputs = SweepAccess::inputs(node);
      if (next < inputs.size()) {
        const Edge& e = resolved(inputs[next++]);
        Node* child = e.node.get();
        if (child != nullptr && !stop(child)) {
          if (e.index == 0) SweepAccess::count_consumer(child, mark);
          if (SweepAccess::mark(child) != mark) {
            if (child->released()) throw_released(child);
            SweepAccess::mark(child) = mark;
            stack.emplace_back(e.node, 0);
          }
        }
      } else {
        order.push_back(std::move(stack.back().first));
        stack.pop_back();
      }
    }
  }
  std::sort(order.begin(), order.end(), [](const std::shared_ptr<Node>& a, const std::shared_ptr<Node>& b) { return a->id() < b->id(); });
  return order;
}

// Runs the sweep over `order` (reverse). `slot(edge)` is where a cotangent for that edge
// accumulates: the target node's gradient, a boundary's running sum, or null (dropped).
template <class AfterNode>
void run_sweep(std::vector<std::shared_ptr<Node>>& order, bool retain_graph, const Cotangents::Accumulators& slot,
               std::uint64_t mark, AfterNode after_node, bool create = false) {
  // Backward rules compute with constants, or in create-graph mode with ops that record.
  std::optional<NoGradGuard> no_grad;
  std::optional<EnableGradGuard> recording;
  if (create) recording.emplace(), retain_graph = true;
  else no_grad.emplace();
  CreateGraphScope mode(create);
  const Accumulation acc{create};
  linum::detail::PhaseScope phase(linum::detail::Phase::backward);
  // A rule that throws leaves cotangents on the nodes not yet run: dropped, so that a later sweep
  // does not add them, and so that create-graph cotangents (which may refer back to their node)
  // cannot keep a cycle alive.
  struct DropPendingOnThrow {
    std::vector<std::shared_ptr<Node>>& order;
    const int uncaught = std::uncaught_exceptions();
    ~DropPendingOnThrow() {
      if (std::uncaught_exceptions() > uncaught)
        for (auto& n : order)
          if (n) {
            SweepAccess::grads(n.get()).clear();
            SweepAccess::prologue_applied(n.get()) = false;
            SweepAccess::prologue_sums(n.get()) = Array();
          }
    }
  } drop_pending{order};
  std::vector<Array> in_grads;
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    Node* node = it->get();
    if (node->is_leaf()) continue;
    auto& grads = SweepAccess::grads(node);
    grads.resize(node->num_outputs());
    const bool any = std::any_of(grads.begin(), grads.end(), [](const Array& g) { return g.defined(); });
    auto& inputs = SweepAccess::inputs(node);
    if (any) {
      in_grads.assign(inputs.size(), Array());
      Cotangents c(grads, in_grads, inputs, &slot, node, create ? 0 : mark);
      if (!create) {
        const profiler::detail::Span span(node->op(), profiler::detail::SpanKind::rule, {}, node);  // (nothing unless profiling)
        node->backward(c);
      } else {
        const profiler::detail::Span span(node->op(), profiler::detail::SpanKind::rule, {}, node);
        const bool linked = std::any_of(grads.begin(), grads.end(), [](const Array& g) { return g.node() != nullptr; });
        node->backward_differentiable(c, *it);
        // A rule that computed a gradient with kernels from a differentiable cotangent would stop the
        // second derivative there: refuse, naming the op, rather than return zeros.
        if (linked)
          for (std::size_t k = 0; k < inputs.size(); ++k)
            if (inputs[k].node != nullptr && in_grads[k].defined() && in_grads[k].node() == nullptr)
              throw AutodiffError(linum::detail::cat(
                  "backward rule of op '", node->op(), "' computed the gradient of input ", k,
                  " outside the graph in create-graph mode, so a second derivative through it would be lost "
                  "(a bug in that op's higher-order rule; please report it)"));
      }
      // Each cotangent goes to its input's node (or out through a boundary).
      for (std::size_t k = 0; k < inputs.size(); ++k) {
        Array g = std::move(in_grads[k]);
        const Edge& e = resolved(inputs[k]);
        if (e.node == nullptr || !g.defined()) continue;
        if (linum::detail::debug_checks_on()) linum::detail::check_finite(g, node->op(), static_cast<int>(k), {});
        Node* target = e.node.get();
        const Shape& want = target->output_shape(e.index);
        if (!(g.shape() == want))
          throw AutodiffError(linum::detail::cat("backward rule of op '", node->op(), "' produced a gradient of shape ",
                                          g.shape(), " for input ", k, " of shape ", want,
                                          " (a bug in that op's rule; please report it)"));
        Array* sum = slot(e);
        if (static_cast<int>(k) == c.applied_input()) {
          // (set_with_prologue checked the offer: the cotangent goes straight into the producer's
          // empty slot; a cast on the way would change what the prologue computed)
          if (g.dtype() != target->output_dtype(0))
            throw AutodiffError(linum::detail::cat("backward rule of op '", node->op(), "' applied the prologue of input ", k,
                                                   "'s producer in ", dtype_name(g.dtype()), ", not in that output's ",
                                                   dtype_name(target->output_dtype(0)),
                                                   " (a bug in that op's rule; please report it)"));
          SweepAccess::prologue_applied(target) = true;
          SweepAccess::prologue_sums(target) = c.take_applied_sums();
          g_prologues_applied.fetch_add(1, std::memory_order_relaxed);
        }
        if (sum != nullptr) acc.add(*sum, acc.cast(std::move(g), target->output_dtype(e.index)));
      }
      in_grads.clear();
      SweepAccess::prologue_applied(node) = false;
      SweepAccess::prologue_sums(node) = Array();
    }
    grads.clear();
    if (!retain_graph) {
      node->release();
      SweepAccess::released(node) = true;
      inputs.clear();
      inputs.shrink_to_fit();
    }
    const char* op = node->op();
    after_node(static_cast<std::size_t>(order.rend() - it) - 1);
    it->reset();  // drop our reference: the node dies now unless an array still refers to it
    if (any && memory::detail::timeline_recording()) memory::detail::timeline_on_op(op, node);  // node: a key only
  }
}

// The gradient slot of an edge in a sweep of the whole graph: its target node's.
Array* node_slot(const Edge& e) {
  auto& grads = SweepAccess::grads(e.node.get());
  grads.resize(e.node->num_outputs());
  return &grads[e.index];
}

void run_sweep(std::vector<std::shared_ptr<Node>>& order, bool retain_graph, const Cotangents::Accumulators& slot,
               std::uint64_t mark, bool create = false) {
  run_sweep(order, retain_graph, slot, mark, [](std::size_t) {}, create);
}

void seed(std::span<const Array> roots, std::span<const Array> cotangents) {
  if (roots.size() != cotangents.size())
    throw AutodiffError(linum::detail::cat("backward: ", roots.size(), " roots but ", cotangents.size(), " cotangents"));
  for (std::size_t i = 0; i < roots.size(); ++i) {
    const Edge r = resolved(Edge{roots[i].node(), roots[i].output_index()});
    Node* n = r.node.get();
    if (n == nullptr || !cotangents[i].defined()) continue;
    if (n->released()) throw_released(n);
    if (!(cotangents[i].shape() == roots[i].shape()))
      throw AutodiffError(linum::detail::cat("backward: cotangent of shape ", cotangents[i].shape(), " for an output of shape ",
                                      roots[i].shape()));
    const Array ct = physical_cotangent(roots[i], cotangents[i]);
    auto& grads = SweepAccess::grads(n);
    grads.resize(n->num_outputs());
    add_into(grads[r.index], in_dtype(ct, n->output_dtype(r.index)));
  }
}

}  // namespace

namespace detail {
namespace {
const std::shared_ptr<const SavedValueHooks> kNoHooks;
}  // namespace

const std::shared_ptr<const SavedValueHooks>& active_saved_value_hooks() {
  const auto* hooks = SavedValueHooksStack::top();
  return hooks != nullptr ? *hooks : kNoHooks;
}

void notify_record_hooks(const char* op, std::span<Array> outs, const Node* node, const PrimitiveCall* call) {
  for (Array& out : outs) {
    bool region_seen = false;
    for (auto* e = RecordHooks::innermost(); e != nullptr; e = e->below()) {
      RecordHook* h = e->value();
      if (h->is_region()) {
        if (region_seen) continue;  // only the innermost checkpoint region numbers and saves ops
        region_seen = true;
      }
      h->on_record(op, out, node, call);
    }
  }
}

void after_record_observed(const char* op, std::span<Array> outs, Node* node, const PrimitiveCall* call) {
  if (record_hooks_active()) notify_record_hooks(op, outs, node, call);
  if (SavedValueHooksStack::innermost() != nullptr) [[unlikely]]
    node->pack_residuals(call);
  if (linum::detail::debug_checks_on()) [[unlikely]] {
    const std::span<const Array* const> inputs = call != nullptr ? call->inputs : std::span<const Array* const>();
    for (const Array& o : outs) linum::detail::check_finite(o, op, -1, inputs);
  }
  if (memory::detail::timeline_recording()) [[unlikely]]
    memory::detail::timeline_on_op(op, node);
  if (profiler::detail::profiling_now()) [[unlikely]]
    profiler::detail::on_record(node);
}

std::optional<Replayed> replay_primitive(std::span<const Array* const> inputs) {
  for (auto* e = RecordHooks::innermost(); e != nullptr; e = e->below())
    if (e->value()->is_region()) return e->value()->replay_primitive(inputs);
  return std::nullopt;
}

const char* intern_op_name(const std::string& name) {
  static std::mutex mutex;
  static std::set<std::string, std::less<>> names;  // never shrinks: nodes keep the pointers
  std::lock_guard<std::mutex> lock(mutex);
  return names.insert(name).first->c_str();
}

void throw_custom_vjp_error(const char* op, const std::string& what) {
  throw AutodiffError(linum::detail::cat("custom_vjp '", op, "': ", what));
}

std::vector<Edge> edges_of(std::span<const Array* const> inputs) {
  std::vector<Edge> edges;
  edges.reserve(inputs.size());
  for (const Array* a : inputs) edges.push_back(Edge{a->node(), a->output_index()});
  return edges;
}

namespace {
bool same_array(const Array& a, const Array& b) {
  return a.defined() && b.defined() && a.buffer_identity() == b.buffer_identity() && a.raw() == b.raw() &&
         a.shape() == b.shape() && a.dtype() == b.dtype();
}
}  // namespace

ResidualOrigins residual_origins(std::span<const Array* const> inputs, std::span<const Array> outputs,
                                 std::span<const Array> residuals) {
  ResidualOrigins origins;
  for (std::size_t i = 0; i < residuals.size(); ++i) {
    const Array& r = residuals[i];
    std::uint64_t tag = 0xFF;
    if (r.defined()) {
      for (std::size_t k = 0; k < inputs.size() && k < 0x80 && tag == 0xFF; ++k)
        if (same_array(*inputs[k], r)) tag = k;
      for (std::size_t j = 0; j < outputs.size() && j < 0x7F && tag == 0xFF; ++j)
        if (same_array(outputs[j], r)) tag = 0x80 | j;
    }
    if (i < 8) {
      origins.first &= ~(std::uint64_t{0xFF} << (8 * i));
      origins.first |= tag << (8 * i);
    } else {
      origins.rest.push_back(static_cast<std::uint8_t>(tag));
    }
  }
  return origins;
}

void relink_residuals(std::vector<Array>& residuals, const ResidualOrigins& origins, const std::vector<Edge>& inputs,
                      const std::shared_ptr<Node>& self) {
  for (std::size_t i = 0; i < residuals.size(); ++i) {
    const unsigned tag = origins.tag(i);
    if (tag == 0xFF || !residuals[i].defined()) continue;
    if (tag < 0x80) {
      if (tag < inputs.size() && inputs[tag].node != nullptr) residuals[i].set_node(inputs[tag].node, inputs[tag].index);
    } else {
      residuals[i].set_node(self, tag & 0x7F);
    }
  }
}

void throw_not_higher_order(const char* op) {
  throw AutodiffError(linum::detail::cat(
      "op '", op, "' does not support higher-order differentiation yet: its backward rule cannot be differentiated "
      "(a gradient of a gradient, hvp, jacrev/hessian or jvp passes through it). Differentiate a function that avoids "
      "it, or give it a differentiable rule (autodiff::higher_order, core/autodiff/graph.hpp)"));
}


std::vector<Array> detach_all(std::initializer_list<Array> saved) {
  std::vector<Array> out;
  out.reserve(saved.size());
  for (const Array& a : saved) out.push_back(a.detached());
  return out;
}
}  // namespace detail

void Node::backward_differentiable(Cotangents&, const std::shared_ptr<Node>&) { detail::throw_not_higher_order(op_); }

namespace detail {
std::int64_t prologues_applied() { return g_prologues_applied.load(std::memory_order_relaxed); }
}  // namespace detail

std::optional<Cotangents::PrologueOffer> Cotangents::producer_prologue(std::size_t i) const {
  if (sweep_ == 0 || accumulators_ == nullptr || i >= edges_.size() || linum::detail::debug_checks_on()) return std::nullopt;
  const Edge& e = edges_[i];
  Node* producer = e.node.get();
  if (producer == nullptr || e.index != 0 || producer->forwards() || !producer->cotangent_prologue() ||
      SweepAccess::mark(producer) != sweep_ || !SweepAccess::sole_consumer(producer, sweep_))
    return std::nullopt;
  // The cotangent must go straight into the producer's own slot, still empty (not a boundary's sum,
  // not a seeded root, not dropped by a pruned sweep).
  Array* slot = (*accumulators_)(e);
  if (slot == nullptr || slot->defined() || SweepAccess::grads(producer).empty() || slot != &SweepAccess::grads(producer)[0])
    return std::nullopt;
  // (a derivative of the cotangent's dtype and size: what the producer's output is)
  const Array* derivative = producer->kept_residual(producer->cotangent_prologue()->derivative);
  if (derivative == nullptr || derivative->dtype() != producer->output_dtype(0) ||
      derivative->numel() != producer->output_shape(0).numel())
    return std::nullopt;
  return PrologueOffer{derivative, producer->cotangent_prologue()->column_sums, producer->cotangent_prologue()->kind};
}

void Cotangents::set_with_prologue(std::size_t i, Array g2, Array column_sums) {
  if (applied_input_ >= 0 && applied_input_ != static_cast<int>(i))
    throw AutodiffError(linum::detail::cat("a backward rule applied the prologues of inputs ", applied_input_, " and ", i,
                                           "'s producers; one input per rule (a bug in that op's rule; please report it)"));
  if (!producer_prologue(i))
    throw AutodiffError(linum::detail::cat("a backward rule applied the prologue of input ", i,
                                           "'s producer where it was not offered (a bug in that op's rule; please report it)"));
  ins_[i] = std::move(g2);
  applied_input_ = static_cast<int>(i);
  applied_sums_ = std::move(column_sums);
}

bool Cotangents::prologue_applied() const { return self_ != nullptr && SweepAccess::prologue_applied(self_); }

Array Cotangents::take_prologue_sums() {
  return self_ == nullptr ? Array() : std::move(SweepAccess::prologue_sums(self_));
}

std::uint64_t Node::next_id() {
  if (detail::IdCursor* const* range = detail::IdRanges::top(); range != nullptr && *range != nullptr) [[unlikely]]
    if ((*range)->next < (*range)->end) return (*range)->next++;
  return g_node_counter.fetch_add(1, std::memory_order_relaxed);
}
std::uint64_t Node::peek_next_id() {
  if (detail::IdCursor* const* range = detail::IdRanges::top(); range != nullptr && *range != nullptr) [[unlikely]]
    if ((*range)->next < (*range)->end) return (*range)->next;
  return g_node_counter.load(std::memory_order_relaxed);
}


bool needs_grad(std::span<const Array> inputs) {
  if (!detail::recording_on()) return false;
  return std::any_of(inputs.begin(), inputs.end(), [](const Array& a) { return a.node() != nullptr; });
}

std::vector<Edge> edges_of(std::initializer_list<const Array*> inputs) {
  return detail::edges_of(std::span<const Array* const>(inputs.begin(), inputs.size()));
}

std::vector<Edge> edges_of(std::span<const Array> inputs) {
  std::vector<Edge> edges;
  edges.reserve(inputs.size());
  for (const Array& a : inputs) edges.push_back(Edge{a.node(), a.output_index()});
  return edges;
}

struct PackedResiduals {
  std::shared_ptr<const SavedValueHooks> hooks;
  std::vector<std::any> packed;
  std::vector<Shape> shapes;
  std::vector<DType> dtypes;
  std::vector<bool> defined;
};

std::vector<SavedValueInfo> Node::infos_of(std::span<const Array> saved, const detail::PrimitiveCall* call, const Node* self) {
  std::vector<SavedValueInfo> out(saved.size(), SavedValueInfo{self->op(), self->op(), self->label()});
  if (call == nullptr) return out;
  for (std::size_t i = 0; i < saved.size(); ++i) {
    const Array& a = saved[i];
    if (!a.defined()) continue;
    for (const Array* in : call->inputs)
      if (in->buffer_identity() == a.buffer_identity() && in->shape() == a.shape() && in->dtype() == a.dtype()) {
        const Node* producer = in->node().get();
        if (producer == nullptr || producer->is_leaf()) out[i].producer_op = nullptr, out[i].label = {};
        else out[i].producer_op = producer->op(), out[i].label = producer->label();
        break;
      }
  }
  return out;
}

std::shared_ptr<PackedResiduals> Node::pack(std::vector<Array>& saved, std::span<const SavedValueInfo> infos) {
  auto p = std::make_shared<PackedResiduals>();
  p->hooks = detail::active_saved_value_hooks();
  for (std::size_t i = 0; i < saved.size(); ++i) {
    const Array& a = saved[i];
    p->defined.push_back(a.defined());
    p->shapes.push_back(a.shape());
    p->dtypes.push_back(a.dtype());
    p->packed.push_back(a.defined() ? p->hooks->pack(a, i < infos.size() ? infos[i] : SavedValueInfo{}) : std::any());
  }
  saved.clear();
  saved.shrink_to_fit();
  return p;
}

std::vector<Array> Node::unpack_residuals(const PackedResiduals& p, const char* op) {
  std::vector<Array> out(p.packed.size());
  for (std::size_t i = 0; i < out.size(); ++i) {
    if (!p.defined[i]) continue;
    out[i] = p.hooks->unpack(p.packed[i]).detached();
    if (!out[i].defined() || !(out[i].shape() == p.shapes[i]) || out[i].dtype() != p.dtypes[i])
      throw AutodiffError(linum::detail::cat("saved-value hooks: unpack returned ", out[i].defined() ? out[i].type_str() : "an undefined array",
                                             " for residual ", i, " of op '", op, "', which was saved as ",
                                             dtype_short_name(p.dtypes[i]), p.shapes[i].str(),
                                             "; unpack must give back the array pack was given (same shape and dtype)"));
  }
  return out;
}

namespace {
std::shared_ptr<const SavedValueHooks> checked(SavedValueHooks hooks) {
  if (!hooks.pack || !hooks.unpack)
    throw ValueError("SavedValueHooksGuard: both pack and unpack must be set");
  return std::make_shared<const SavedValueHooks>(std::move(hooks));
}
}  // namespace

SavedValueHooksGuard::SavedValueHooksGuard(SavedValueHooks hooks) : installed_(checked(std::move(hooks))) {}

Array Node::take_grad(std::size_t i) {
  if (i >= grads_.size()) return Array();
  return std::exchange(grads_[i], Array());
}

namespace detail {
Array link_input(const Array& x) {
  if (x.batched()) return Array::batched_view(link_input(x.physical()), x.batch_levels());
  return primitive("input", {&x}, [&](Residuals&) { return x.detached(); },
                   higher_order([](Cotangents& c, Saved) { c.set(0, c.out()); }));
}
}  // namespace detail

void composite_rule(Cotangents& c, std::vector<Array> inputs,
                    const std::function<std::vector<Array>(const std::vector<Array>&)>& composite) {
  EnableGradGuard recording;
  std::vector<Boundary> boundaries;
  std::vector<std::size_t> tracked;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (i >= c.num_inputs() || !c.needs(i) || !inputs[i].defined() || !is_floating(inputs[i].dtype())) continue;
    inputs[i] = inputs[i].node() != nullptr ? detail::link_input(inputs[i]) : make_leaf(inputs[i]);
    boundaries.push_back({inputs[i].node().get(), inputs[i].output_index()});
    tracked.push_back(i);
  }
  std::vector<Array> outs = [&] {
    CreateGraphScope forward(false);  // the composite is a forward computation
    return composite(inputs);
  }();
  if (outs.size() != c.num_outputs())
    throw AutodiffError(linum::detail::cat("composite rule: the composite returned ", outs.size(), " outputs, the op has ",
                                           c.num_outputs()));
  std::vector<Edge> roots;
  std::vector<Array> cts;
  for (std::size_t j = 0; j < outs.size(); ++j) {
    if (!c.out(j).defined() || outs[j].node() == nullptr) continue;
    if (!(outs[j].shape() == c.out(j).shape()))
      throw AutodiffError(linum::detail::cat("composite rule: output ", j, " of the composite has shape ", outs[j].shape(),
                                             ", the op's ", c.out(j).shape(), " (a bug in that op's rule; please report it)"));
    roots.push_back(Edge{outs[j].node(), outs[j].output_index()});
    cts.push_back(c.out(j));
  }
  outs.clear();
  std::vector<Array> sums = backward_into(std::move(roots), std::move(cts), boundaries, {}, /*create_graph=*/true, /*prune=*/true);
  for (std::size_t k = 0; k < tracked.size(); ++k)
    c.set(tracked[k], sums[k].defined() ? std::move(sums[k]) : linked_zeros(inputs[tracked[k]]));
}

Array linked_zeros(const Array& g) {
  return primitive("zeros_like", {&g}, [&](Residuals&) { return Array::zeros(g.shape(), g.dtype()); },
                   higher_order([](Cotangents& c, Saved) { c.set(0, linked_zeros(c.out())); }));
}

Array make_leaf(const Array& x) {
  if (!is_floating(x.dtype()))
    throw AutodiffError(linum::detail::cat("make_leaf: only float32 and bfloat16 arrays can be differentiated, got ",
                                    dtype_name(x.dtype()), x.shape().str(),
                                    "; pass integer arrays (labels, indices) as non-differentiated arguments"));
  if (x.repeated()) {  // per-example gradients: the leaf's node has the physical shape, its data stays one example
    Array leaf = x.detached();
    leaf.set_node(std::make_shared<LeafNode>(x.physical_shape()), 0);
    return leaf;
  }
  if (x.batched()) return Array::batched_view(make_leaf(x.physical()), x.batch_levels());
  Array leaf = x.detached();
  leaf.set_node(std::make_shared<LeafNode>(x.shape()), 0);
  return leaf;
}


void backward(std::span<const Array> roots, std::span<const Array> cotangents, bool retain_graph) {
  const std::uint64_t mark = ++g_sweep_counter;
  auto order = topological_order(roots, mark, [](Node*) { return false; });
  seed(roots, cotangents);
  LeafGradientListener* const* innermost = detail::LeafGradientListeners::top();
  LeafGradientListener* listener = innermost != nullptr ? *innermost : nullptr;
  if (listener == nullptr) {
    run_sweep(order, retain_graph, node_slot, mark);
    return;
  }
  // A leaf's gradient is final once its last consumer in the sweep (the one with the lowest
  // position in `order`: the sweep runs it backwards) has run.
  std::unordered_map<const Node*, std::size_t> last_consumer;
  for (std::size_t i = 0; i < order.size(); ++i)
    for (const Edge& e : SweepAccess::inputs(order[i].get()))
      if (e.node != nullptr && e.node->is_leaf()) last_consumer.try_emplace(e.node.get(), i);
  std::vector<std::vector<const Node*>> final_after(order.size());
  for (const auto& [leaf, i] : last_consumer) final_after[i].push_back(leaf);
  for (auto& leaves : final_after)  // a fixed order for leaves made final by the same node
    std::sort(leaves.begin(), leaves.end(), [](const Node* a, const Node* b) { return a->id() < b->id(); });
  run_sweep(order, retain_graph, node_slot, mark, [&](std::size_t i) {
    for (const Node* leaf : final_after[i]) {
      auto& grads = SweepAccess::grads(const_cast<Node*>(leaf));
      if (!grads.empty() && grads[0].defined()) listener->on_leaf_gradient(leaf, grads[0]);
    }
  });
}

std::vector<Array> backward_to(std::span<const Array> roots, std::span<const Array> cotangents,
                               std::span<const Boundary> boundaries) {
  if (roots.size() != cotangents.size())
    throw AutodiffError(linum::detail::cat("backward: ", roots.size(), " roots but ", cotangents.size(), " cotangents"));
  std::vector<Edge> edges;
  for (const Array& r : roots) edges.push_back(Edge{r.node(), r.output_index()});
  for (std::size_t i = 0; i < roots.size(); ++i)
    if (roots[i].node() && cotangents[i].defined() && !(cotangents[i].shape() == roots[i].shape()))
      throw AutodiffError(linum::detail::cat("backward: cotangent of shape ", cotangents[i].shape(),
                                             " for an output of shape ", roots[i].shape()));
  std::vector<Array> cts;
  for (std::size_t i = 0; i < roots.size(); ++i)
    cts.push_back(cotangents[i].defined() ? physical_cotangent(roots[i], cotangents[i]) : cotangents[i]);
  return backward_to(std::move(edges), std::move(cts), boundaries);
}

std::vector<Array> backward_into(std::vector<Edge> roots, std::vector<Array> cotangents, std::span<const Boundary> given,
                                 std::vector<Array> sums, bool create_graph, bool prune) {
  const bool create = create_graph || creating_graph();
  const Accumulation acc{create};
  if (roots.size() != cotangents.size())
    throw AutodiffError(linum::detail::cat("backward: ", roots.size(), " roots but ", cotangents.size(), " cotangents"));
  for (Array& ct : cotangents)  // nodes hold physical values (vmap): so do their cotangents
    if (ct.defined() && ct.batched()) ct = ct.physical();
  for (Edge& r : roots) r = resolved(r);
  // Boundaries at nodes that forward their outputs are where those outputs went.
  std::vector<Boundary> resolved_boundaries(given.begin(), given.end());
  for (Boundary& b : resolved_boundaries)
    while (b.node != nullptr && b.node->forwards()) {
      const Edge* next = b.node->forward_edge(b.index);
      if (next == nullptr) break;
      b = Boundary{next->node.get(), next->index};
    }
  const std::span<const Boundary> boundaries(resolved_boundaries);
  std::unordered_set<const Node*> stop_nodes;
  for (const Boundary& b : boundaries) stop_nodes.insert(b.node);
  sums.resize(boundaries.size());
  auto boundary_sum = [&](Node* node, std::uint32_t index) -> Array* {
    const Boundary here{node, index};
    auto b = std::find(boundaries.begin(), boundaries.end(), here);
    return b == boundaries.end() ? nullptr : &sums[static_cast<std::size_t>(b - boundaries.begin())];
  };
  // Roots that are boundaries themselves (an input passed straight through) go straight out; the
  // others are seeded into their nodes.
  std::vector<Array> inner;  // hollow arrays carrying only the root nodes, for the traversal
  for (std::size_t i = 0; i < roots.size(); ++i) {
    Node* n = roots[i].node.get();
    if (n == nullptr || !cotangents[i].defined()) continue;
    if (Array* sum = boundary_sum(n, roots[i].index)) {
      acc.add(*sum, acc.cast(std::move(cotangents[i]), n->output_dtype(roots[i].index)));
      continue;
    }
    if (n->released()) throw_released(n);
    if (!(cotangents[i].shape() == n->output_shape(roots[i].index)))
      throw AutodiffError(linum::detail::cat("backward: cotangent of shape ", cotangents[i].shape(),
                                             " for an output of shape ", n->output_shape(roots[i].index)));
    auto& grads = SweepAccess::grads(n);
    grads.resize(n->num_outputs());
    acc.add(grads[roots[i].index], acc.cast(std::move(cotangents[i]), n->output_dtype(roots[i].index)));
    Array hollow;
    hollow.set_node(roots[i].node, roots[i].index);
    inner.push_back(std::move(hollow));
  }
  cotangents.clear();
  roots.clear();
  const std::uint64_t mark = ++g_sweep_counter;
  auto order = topological_order(inner, mark, [&](Node* n) { return stop_nodes.count(n) > 0; });
  inner.clear();
  // Pruning: in creation order (inputs first), a node reaches a boundary when one of its inputs is
  // a boundary or reaches one. The others neither run nor receive cotangents.
  std::unordered_set<const Node*> reaching;
  if (prune) {
    std::vector<std::shared_ptr<Node>> kept;
    for (auto& n : order) {
      bool reaches = false;
      for (const Edge& input : SweepAccess::inputs(n.get())) {
        const Edge& e = resolved(input);
        if (e.node != nullptr && (stop_nodes.count(e.node.get()) > 0 || reaching.count(e.node.get()) > 0)) reaches = true;
      }
      if (reaches) {
        reaching.insert(n.get());
        kept.push_back(std::move(n));
      } else {
        SweepAccess::grads(n.get()).clear();  // a seeded root that leads nowhere
      }
    }
    order = std::move(kept);
  }
  run_sweep(
      order, /*retain_graph=*/false,
      [&](const Edge& e) -> Array* {
        if (stop_nodes.count(e.node.get())) return boundary_sum(e.node.get(), e.index);
        if (prune && reaching.count(e.node.get()) == 0) return nullptr;
        return node_slot(e);
      },
      mark, create);
  if (!create)
    for (Array& sum : sums)
      if (sum.defined()) sum = std::move(sum).detached();
  return sums;
}

std::vector<Array> backward_to(std::vector<Edge> roots, std::vector<Array> cotangents,
                               std::span<const Boundary> boundaries) {
  return backward_into(std::move(roots), std::move(cotangents), boundaries, {});
}

std::vector<Edge> external_inputs(std::span<const Array> roots, std::uint64_t first_id) {
  std::vector<Edge> found;
  std::unordered_set<const Node*> seen;
  std::vector<std::pair<const Node*, std::uint32_t>> found_keys;
  std::vector<Node*> stack;
  auto consider = [&](const Edge& e) {
    if (e.node == nullptr) return;
    if (e.node->id() < first_id) {
      const auto key = std::make_pair(static_cast<const Node*>(e.node.get()), e.index);
      if (std::find(found_keys.begin(), found_keys.end(), key) == found_keys.end()) {
        found_keys.push_back(key);
        found.push_back(e);
      }
    } else if (seen.insert(e.node.get()).second) {
      stack.push_back(e.node.get());
    }
  };
  for (const Array& r : roots) consider(Edge{r.node(), r.output_index()});
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const Edge& e : SweepAccess::inputs(n)) consider(e);
  }
  return found;
}

}  // namespace linum::autodiff
