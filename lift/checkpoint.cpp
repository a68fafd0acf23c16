// The checkpoint engine: forward regions that number ops and keep what the policy allows, the
// checkpoint node, and its backward pass, which replays the block and differentiates it locally.
#include <linum/lift/checkpoint.hpp>

#include <linum/core/autodiff/grad.hpp>
#include <linum/core/autodiff/hooks.hpp>
#include <linum/lift/residual_scope.hpp>
#include <linum/modules/scope.hpp>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <sstream>
#include <memory>
#include <optional>
#include <unordered_map>

namespace linum::lift {
namespace {

using autodiff::Node;

struct Counters {
  std::atomic<std::int64_t> calls{0}, recomputations{0}, recomputed{0}, replayed{0}, eliminated{0}, saved{0}, reruns{0};
} g_stats;

std::string current_module_path() {
  const std::vector<std::string>* p = linum::detail::current_module_path();
  return p ? linum::detail::join_module_path(*p) : std::string();
}

// One value a policy kept: the index of the op in the block's record order, its output, and the
// residuals of its primitive that are neither inputs nor outputs (layer_norm's statistics, the
// fused attention's log-sum-exp), so the replay can skip the primitive and still differentiate it.
// The value lives where the policy placed it (RAM, the spill file, compressed); the internals,
// small statistics, stay in RAM.
struct SavedValue {
  std::uint64_t index;
  storage::StoredArray value;
  std::vector<Array> internals;
  const char* op = "";  // what computed it, and its checkpoint_name (for saved-value hooks)
  std::string label;
};

// Where each residual of a primitive comes from, so a replay that skips its forward can rebuild
// them: one of its inputs, one of its outputs, or an array only its forward made (kept with the
// output when the policy saves it).
struct ResidualSource {
  enum Kind : std::uint8_t { none, input, output, internal } kind;
  std::uint32_t index;
};

// What the forward pass learnt of a primitive (shared by its outputs' entries).
struct PrimitiveRecipe {
  std::uint64_t first;  // the op index of output 0
  std::size_t num_outputs;
  std::vector<ResidualSource> sources;
  std::size_t num_internal = 0;
  std::shared_ptr<const void> structure;
};

// One numbered op of the forward pass: its output type, and its primitive (null for an op that
// computed before recording, or a checkpoint: those cannot be skipped).
struct OpRecipe {
  Shape shape;
  DType dtype;
  std::shared_ptr<const PrimitiveRecipe> primitive;
};

std::shared_ptr<const PrimitiveRecipe> recipe_of(std::uint64_t first, const autodiff::detail::PrimitiveCall& call) {
  auto r = std::make_shared<PrimitiveRecipe>();
  r->first = first;
  r->num_outputs = call.num_outputs;
  r->structure = call.structure;
  auto same = [](const Array& a, const Array& b) {
    return a.defined() && a.buffer_identity() == b.buffer_identity() && a.shape() == b.shape() && a.dtype() == b.dtype();
  };
  for (const Array& res : call.residuals) {
    ResidualSource src{ResidualSource::none, 0};
    if (res.defined()) {
      for (std::size_t k = 0; k < call.inputs.size() && src.kind == ResidualSource::none; ++k)
        if (same(*call.inputs[k], res)) src = {ResidualSource::input, static_cast<std::uint32_t>(k)};
      for (std::size_t j = 0; j < call.outputs.size() && src.kind == ResidualSource::none; ++j)
        if (same(call.outputs[j], res)) src = {ResidualSource::output, static_cast<std::uint32_t>(j)};
      if (src.kind == ResidualSource::none) {
        src = {ResidualSource::internal, static_cast<std::uint32_t>(r->num_internal++)};
      }
    }
    r->sources.push_back(src);
  }
  return r;
}

// The residuals of `call` that only its forward made, in the recipe's internal order.
std::vector<Array> internals_of(const PrimitiveRecipe& recipe, const autodiff::detail::PrimitiveCall& call) {
  std::vector<Array> out;
  for (std::size_t k = 0; k < recipe.sources.size(); ++k)
    if (recipe.sources[k].kind == ResidualSource::internal) out.push_back(call.residuals[k].detached());
  return out;
}

std::uint64_t fingerprint(const Array& a) {
  std::uint64_t h = 1469598103934665603ull;
  const auto* p = static_cast<const unsigned char*>(a.raw());
  for (std::size_t i = 0; i < a.nbytes(); ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

// What verify mode remembers of each op of the forward pass: kind, output type, bytes, module.
struct OpPrint {
  std::string op;
  Shape shape;
  DType dtype;
  std::uint64_t hash;
  std::string module_path;
};

std::string describe(const OpPrint& p) {
  std::ostringstream shape;
  shape << dtype_short_name(p.dtype) << "[";
  for (int i = 0; i < p.shape.rank(); ++i) shape << (i ? "," : "") << p.shape[i];
  shape << "]";
  return linum::detail::cat("'", p.op, "' (", shape.str(), ")",
                            p.module_path.empty() ? std::string() : linum::detail::cat(" in module '", p.module_path, "'"));
}

// Numbers the ops recorded by the block's forward pass, keeps what the policy allows, and learns
// the block's data flow for the replay: which op reads which op's output through the graph, which
// outputs backward rules keep (residuals), and which ops can skip their computation.
class ForwardRegion final : public autodiff::detail::RecordHook {
 public:
  // Dead code exists only where something is skipped, i.e. saved; verify mode replays every op. So
  // only then does the region pay for learning the data flow.
  ForwardRegion(const Policy& policy, bool verify)
      : policy_(policy), verify_(verify), analyze_(!policy.saves_nothing() && !verify) {}
  bool is_region() const override { return true; }
  void on_record(const char* op, Array& out, const Node* node, const autodiff::detail::PrimitiveCall* call) override {
    const std::uint64_t index = next_++;
    // A primitive's entry is made at its first output and shared by the others.
    std::shared_ptr<const PrimitiveRecipe> recipe;
    if (call != nullptr && !policy_.saves_nothing()) {
      if (out.output_index() == 0 || recipes_.empty() || !recipes_.back().primitive)
        recipe = recipe_of(index - out.output_index(), *call);
      else
        recipe = recipes_.back().primitive;
    }
    // Any primitive can be skipped when its output is saved (its internal residuals are saved with
    // it); leaving it out as dead code needs its residuals to be inputs or outputs (the replay has
    // those).
    if (analyze_) learn_flow(index, out, node, recipe != nullptr, recipe != nullptr && recipe->num_internal == 0);
    if (verify_) prints_.push_back({op, out.shape(), out.dtype(), fingerprint(out), current_module_path()});
    if (policy_.saves_nothing()) return;
    recipes_.push_back({out.shape(), out.dtype(), recipe});
    const std::string path = current_module_path();
    const OpInfo info{op, out.shape(), out.nbytes(), node ? node->label() : std::string_view(), path, out.dtype()};
    if (const std::optional<storage::Placement> placement = policy_.decide(info)) {
      // The internal residuals go with the first saved output of the primitive.
      std::vector<Array> internals;
      if (recipe != nullptr && recipe->num_internal > 0 && !internals_kept_for(recipe->first))
        internals = internals_of(*recipe, *call);
      saved_.push_back({index, storage::StoredArray::store(out, *placement), std::move(internals), op, std::string(info.name)});
      g_stats.saved.fetch_add(1, std::memory_order_relaxed);
    }
  }
  std::vector<SavedValue> take_saved() { return std::move(saved_); }
  std::vector<OpPrint> take_prints() { return std::move(prints_); }
  std::vector<OpRecipe> take_recipes() { return std::move(recipes_); }

  // After the forward pass: which ops the replay may leave out (see DataFlow::dead_ops); empty when
  // the data flow was not learnt.
  std::vector<bool> dead_ops(const std::vector<Array>& outs) {
    if (!analyze_) return {};
    for (const Array& o : outs) {
      if (o.node() != nullptr)
        if (auto it = producer_.find({o.node()->id(), o.output_index()}); it != producer_.end()) flow_.needed[it->second] = true;
      if (const auto w = writer_of(o)) flow_.needed[*w] = true;
    }
    std::vector<bool> saved(flow_.skippable.size(), false);
    for (const SavedValue& v : saved_) saved[v.index] = true;
    return flow_.dead_ops(saved);
  }

 private:
  // Op `index`'s place in the data flow: who reads whose output, which outputs residuals keep.
  void learn_flow(std::uint64_t index, const Array& out, const Node* node, bool skippable, bool may_be_dead) {
    flow_.skippable.push_back(skippable);
    flow_.may_be_dead.push_back(may_be_dead);
    flow_.consumers.emplace_back();
    flow_.needed.push_back(false);
    const auto me = static_cast<std::uint32_t>(index);
    if (out.defined()) writer_[out.buffer_identity()] = Writer{me, out.weak_buffer()};
    if (node != nullptr) {
      for (const autodiff::Edge& e : node->inputs()) {
        if (!e.node) continue;
        auto it = producer_.find({e.node->id(), e.index});
        if (it != producer_.end()) flow_.consumers[it->second].push_back(me);
      }
      std::vector<Array> residuals;
      node->saved_arrays(residuals);
      for (const Array& r : residuals)
        if (const auto w = writer_of(r)) flow_.needed[*w] = true;
      producer_[{node->id(), out.output_index()}] = me;
    }
  }

  // Whether a saved value of the primitive starting at op `first` already holds its internals.
  bool internals_kept_for(std::uint64_t first) const {
    for (auto it = saved_.rbegin(); it != saved_.rend() && it->index >= first; ++it)
      if (!it->internals.empty()) return true;
    return false;
  }
  // The block's data flow, one entry per numbered op.
  struct DataFlow {
    std::vector<bool> skippable;                      // a primitive the replay can skip when its output is saved
    std::vector<bool> may_be_dead;                    // ... or when nothing reads it (no internal residuals)
    std::vector<std::vector<std::uint32_t>> consumers;  // ops whose graph inputs include its output
    std::vector<bool> needed;                         // its value is a residual or a block output

    // Dead code: an op whose value nothing in the replay reads. It is skippable, its value is
    // neither kept by a backward rule nor returned, and every op reading it is itself skipped
    // (replayed from a saved value, or dead). Decided from the last op back.
    std::vector<bool> dead_ops(const std::vector<bool>& saved) const {
      const std::size_t n = skippable.size();
      std::vector<bool> dead(n, false), skipped(n, false);
      for (std::size_t i = n; i-- > 0;) {
        bool d = may_be_dead[i] && !needed[i] && !saved[i];
        for (std::uint32_t j : consumers[i])
          if (d && !skipped[j]) d = false;
        dead[i] = d;
        skipped[i] = skippable[i] && (saved[i] || d);
      }
      return dead;
    }
  };
  struct PairHash {
    std::size_t operator()(const std::pair<std::uint64_t, std::uint32_t>& k) const {
      return std::hash<std::uint64_t>()(k.first * 31 + k.second);
    }
  };

  const Policy& policy_;
  bool verify_;
  bool analyze_;
  std::vector<SavedValue> saved_;
  std::vector<OpPrint> prints_;
  std::uint64_t next_ = 0;
  std::vector<OpRecipe> recipes_;
  DataFlow flow_;
  std::unordered_map<std::pair<std::uint64_t, std::uint32_t>, std::uint32_t, PairHash> producer_;  // (node id, output) -> op
  // Live buffer -> the last op that produced it. An entry remembers its buffer weakly: a buffer freed
  // during the pass whose address a new one takes is not the same buffer (else which ops the replay
  // leaves out would depend on the allocator's address reuse, which differs between processes --
  // at ZeRO stage 3 every rank must gather the same parameters in the same order).
  struct Writer {
    std::uint32_t op;
    std::weak_ptr<const void> buffer;
  };
  std::unordered_map<const Buffer*, Writer> writer_;
  std::optional<std::uint32_t> writer_of(const Array& a) const {
    if (!a.defined()) return std::nullopt;
    const auto it = writer_.find(a.buffer_identity());
    if (it == writer_.end() || it->second.buffer.expired()) return std::nullopt;
    return it->second.op;
  }
};

// The error verify mode raises, naming the block and the first op that differs.
[[noreturn]] void throw_differs(const std::string& where, const std::string& what) {
  throw AutodiffError(linum::detail::cat(
      "checkpoint '", where, "': the recomputed forward pass differs from the original: ", what,
      ". The block is not deterministic: make it a pure function of its inputs, variables and rng streams (no global "
      "state, no unseeded random numbers)"));
}

// Numbers the ops of the recomputation the same way, hands back the saved values and leaves out
// dead ops (their outputs are placeholders whose reads are detected).
class ReplayRegion final : public autodiff::detail::RecordHook {
  enum class Skipped { no, replayed, eliminated };

 public:
  // With `prints` (verify mode), every recomputed op is compared with the forward pass's. `dead`
  // (may be null) marks the ops to leave out.
  ReplayRegion(const std::vector<SavedValue>& saved, const std::vector<bool>* dead, const std::vector<OpPrint>* prints,
               const std::vector<OpRecipe>& recipes, const std::string& where)
      : saved_(saved), dead_(dead), prints_(prints), recipes_(recipes), where_(where) {}
  bool is_region() const override { return true; }
  // The next primitive's forward is skipped when each of its outputs was saved by the policy or is
  // read by nothing in the replay: the outputs come from the saved values (or are placeholders),
  // the residuals from the replay's inputs, those outputs and the internals saved with them.
  std::optional<autodiff::detail::Replayed> replay_primitive(std::span<const Array* const> inputs) override {
    if (next_ >= recipes_.size() || !recipes_[next_].primitive || recipes_[next_].primitive->first != next_) return std::nullopt;
    const PrimitiveRecipe& p = *recipes_[next_].primitive;
    autodiff::detail::Replayed r;
    r.outs.resize(p.num_outputs);
    pending_.assign(p.num_outputs, Skipped::no);
    const std::vector<Array>* internals = nullptr;
    std::size_t cursor = cursor_;
    for (std::size_t j = 0; j < p.num_outputs; ++j) {
      const std::uint64_t op = next_ + j;
      if (op >= recipes_.size()) return fail();
      while (cursor < saved_.size() && saved_[cursor].index < op) ++cursor;
      if (cursor < saved_.size() && saved_[cursor].index == op) {
        r.outs[j] = saved_[cursor].value.get().detached();
        if (!saved_[cursor].internals.empty()) internals = &saved_[cursor].internals;
        pending_[j] = Skipped::replayed;
      } else if (dead_ != nullptr && op < dead_->size() && (*dead_)[op]) {
        r.outs[j] = Array::elided_placeholder(recipes_[op].shape, recipes_[op].dtype, read_flag_);
        pending_[j] = Skipped::eliminated;
      } else {
        return fail();
      }
    }
    if (p.num_internal > 0 && (internals == nullptr || internals->size() != p.num_internal)) return fail();
    r.residuals.reserve(p.sources.size());
    for (const ResidualSource& src : p.sources) {
      switch (src.kind) {
        case ResidualSource::none: r.residuals.emplace_back(); break;
        case ResidualSource::input:
          if (src.index >= inputs.size()) return fail();
          r.residuals.push_back(inputs[src.index]->detached());
          break;
        case ResidualSource::output: r.residuals.push_back(r.outs[src.index]); break;
        case ResidualSource::internal: r.residuals.push_back((*internals)[src.index]); break;
      }
    }
    r.structure = p.structure;
    return r;
  }
  void on_record(const char* op, Array& out, const Node*, const autodiff::detail::PrimitiveCall*) override {
    if (prints_ != nullptr) check_op(op, out);
    Skipped skipped = Skipped::no;
    if (!pending_.empty()) {
      skipped = pending_.front();
      pending_.erase(pending_.begin());
    }
    if (const SavedValue* s = saved_here()) {
      ++cursor_;
      if (skipped != Skipped::replayed) {  // computed anyway (the op cannot skip): use the saved bits
        Array v = s->value.get().detached();
        check_saved_shape(v, out.shape());
        v.set_node(out.node(), out.output_index());
        out = std::move(v);
        g_stats.recomputed.fetch_add(1, std::memory_order_relaxed);
      } else {
        g_stats.replayed.fetch_add(1, std::memory_order_relaxed);
      }
    } else if (skipped == Skipped::eliminated) {
      g_stats.eliminated.fetch_add(1, std::memory_order_relaxed);
    } else {
      g_stats.recomputed.fetch_add(1, std::memory_order_relaxed);
    }
    ++next_;
  }

  // After the recomputation: it must have recorded as many ops as the forward pass.
  void check_complete() const {
    if (prints_ != nullptr && next_ != prints_->size())
      throw_differs(where_, linum::detail::cat("it recorded ", next_, " ops, the forward pass ", prints_->size()));
  }
  // Whether anything read a value that was left out (the analysis cannot see reads outside the
  // graph, e.g. a comparison or item() on an intermediate): then the replay must run in full.
  bool read_a_left_out_value() const { return read_flag_->load(); }

 private:
  std::optional<autodiff::detail::Replayed> fail() {
    pending_.clear();
    return std::nullopt;
  }
  const SavedValue* saved_here() const {
    return cursor_ < saved_.size() && saved_[cursor_].index == next_ ? &saved_[cursor_] : nullptr;
  }
  static void check_saved_shape(const Array& keep, const Shape& shape) {
    if (!(keep.shape() == shape))
      throw AutodiffError(linum::detail::cat("checkpoint: the recomputation recorded a different op sequence than the "
                                             "forward pass (a saved value of shape ", keep.shape(), " met an op output of shape ",
                                             shape, "); the block must be deterministic"));
  }
  void check_op(const char* op, const Array& out) const {
    const OpPrint now{op, out.shape(), out.dtype(), fingerprint(out), current_module_path()};
    if (next_ >= prints_->size())
      throw_differs(where_, linum::detail::cat("op ", next_, " ", describe(now), " has no counterpart (the forward pass recorded ",
                                               prints_->size(), " ops)"));
    const OpPrint& then = (*prints_)[next_];
    if (then.op != now.op || !(then.shape == now.shape) || then.dtype != now.dtype || then.module_path != now.module_path)
      throw_differs(where_, linum::detail::cat("op ", next_, " is ", describe(now), " where the forward pass had ", describe(then)));
    if (then.hash != now.hash)
      throw_differs(where_, linum::detail::cat("op ", next_, " ", describe(now), " computed different values"));
  }

  const std::vector<SavedValue>& saved_;
  const std::vector<bool>* dead_;
  const std::vector<OpPrint>* prints_;
  const std::vector<OpRecipe>& recipes_;
  const std::string& where_;
  std::size_t cursor_ = 0;
  std::uint64_t next_ = 0;
  std::vector<Skipped> pending_;  // how the outputs of the primitive being replayed were obtained
  std::shared_ptr<std::atomic<bool>> read_flag_ = std::make_shared<std::atomic<bool>>(false);
};

class CheckpointNode final : public Node {
 public:
  CheckpointNode(std::vector<autodiff::Edge> inputs, std::vector<Shape> shapes, std::vector<SavedValue> saved,
                 std::vector<bool> dead, detail::Thunk recompute, bool verify, std::string where,
                 std::vector<std::uint64_t> fingerprints, std::vector<Array> held, std::vector<OpPrint> prints,
                 std::vector<OpRecipe> recipes)
      : Node("checkpoint", std::move(inputs), std::move(shapes)),
        saved_(std::move(saved)),
        dead_(std::move(dead)),
        prints_(std::move(prints)),
        recipes_(std::move(recipes)),
        recompute_(std::move(recompute)),
        verify_(verify),
        where_(std::move(where)),
        fingerprints_(std::move(fingerprints)),
        held_(std::move(held)) {}

  // Create-graph mode: the same recomputation, its block differentiated in create-graph mode (the
  // sweep below inherits it): the input cotangents are functions of the recomputed block, whose
  // graph reaches the checkpoint's inputs, so they are differentiated again like the plain graph's.
  void backward_differentiable(autodiff::Cotangents& c, const std::shared_ptr<Node>&) override { backward(c); }

  // Once its block was recomputed in create-graph mode, the node stands for the recomputed outputs:
  // later sweeps (the outer differentiation) run the recomputed block, whose values the create-graph
  // gradient already reads, instead of recomputing it again. Its cotangents then add up at the same
  // values as in the plain graph, in the same order (the recomputed nodes reuse the block's ids), so
  // second derivatives are bitwise the plain ones.
  const autodiff::Edge* forward_edge(std::uint32_t output) const override {
    return output < recomputed_.size() ? &recomputed_[output] : nullptr;
  }
  void set_block_ids(std::uint64_t first) { block_first_id_ = first; }

  void backward(autodiff::Cotangents& c) override {
    g_stats.recomputations.fetch_add(1, std::memory_order_relaxed);
    const bool create = autodiff::creating_graph();
    if (packed_ != nullptr) {  // values saved-value hooks took: back to the replay
      std::vector<Array> back = unpack_residuals(*packed_, "checkpoint");
      for (std::size_t i = 0; i < back.size(); ++i) saved_[packed_at_[i]].value = storage::StoredArray(std::move(back[i]));
      packed_.reset();
    }
    for (const OffloadedInput& in : offloaded_inputs_) in.value.prefetch();
    for (const SavedValue& s : saved_) s.value.prefetch();  // offloaded values: read back while the replay starts
    if (arguments_) arguments_->put_back(read_inputs());
    std::vector<Array> outs;
    // Dead ops are left out unless verify mode or debug checks want to see every value.
    // (In create-graph mode every op runs: the differentiable rules read their ops' outputs.)
    bool leave_out = !create && !verify_ && !linum::detail::debug_checks_on() &&
                     std::find(dead_.begin(), dead_.end(), true) != dead_.end();
    for (;;) {
      ReplayRegion region(saved_, leave_out ? &dead_ : nullptr, verify_ ? &prints_ : nullptr, recipes_, where_);
      linum::detail::PhaseScope phase(linum::detail::Phase::recomputation);
      autodiff::EnableGradGuard recording;
      autodiff::CreateGraphScope forward(false);  // the recomputation is a forward pass
      std::optional<autodiff::ReuseIdsScope> ids;
      if (create) ids.emplace(block_first_id_, id());
      outs = recompute_();
      region.check_complete();
      if (!leave_out || !region.read_a_left_out_value()) break;
      // Something read a left-out value outside the graph: run the block again, in full.
      outs.clear();
      leave_out = false;
      g_stats.reruns.fetch_add(1, std::memory_order_relaxed);
    }
    if (arguments_) (void)arguments_->take();  // the recomputed graph holds what it needs of them
    if (outs.size() != num_outputs())
      throw AutodiffError(linum::detail::cat("checkpoint '", where_, "': the recomputation returned ", outs.size(),
                                             " arrays, the forward pass ", num_outputs()));
    if (verify_)
      for (std::size_t i = 0; i < outs.size(); ++i)
        if (fingerprint(outs[i]) != fingerprints_[i] || !(outs[i].shape() == output_shape(i)))
          throw_differs(where_, linum::detail::cat("output ", i, " of shape ", outs[i].shape(), " has different values"));
    // Only the recomputed outputs' graph nodes are needed, not their values: dropping the values
    // (and taking the incoming cotangents) frees them before the recomputed block is differentiated.
    if (create) {
      recomputed_.clear();
      for (const Array& o : outs) recomputed_.push_back(autodiff::Edge{o.node(), o.output_index()});
      forwards_ = true;
    }
    std::vector<autodiff::Edge> roots;
    std::vector<Array> cts;
    for (std::size_t i = 0; i < outs.size(); ++i) {
      if (!c.out(i).defined() || outs[i].node() == nullptr) continue;
      if (!(outs[i].shape() == c.out(i).shape()))
        throw AutodiffError(linum::detail::cat("checkpoint '", where_, "': the recomputation's output ", i, " has shape ",
                                               outs[i].shape(), ", the forward pass's ", c.out(i).shape()));
      roots.push_back(autodiff::Edge{outs[i].node(), outs[i].output_index()});
      cts.push_back(c.take_out(i));
    }
    outs.clear();
    std::vector<autodiff::Boundary> boundaries;
    boundaries.reserve(inputs().size());
    for (const autodiff::Edge& e : inputs()) boundaries.push_back({e.node.get(), e.index});
    // The block's contributions to an outer value continue the enclosing sweep's running sum of
    // its gradient, in the block's own order: the sum the plain graph computes, bit for bit (for a
    // value used both inside and outside the block too), holding one array per input however many
    // steps the block spans. (An input listed twice shares its running sum: boundary lookups find
    // its first position.)
    std::vector<Array*> sums(inputs().size(), nullptr);
    std::vector<Array> running(inputs().size());
    for (std::size_t k = 0; k < inputs().size(); ++k) {
      if (std::find(boundaries.begin(), boundaries.begin() + static_cast<std::ptrdiff_t>(k), boundaries[k]) !=
          boundaries.begin() + static_cast<std::ptrdiff_t>(k))
        continue;  // a repeated input: its first position holds the sum
      sums[k] = c.accumulator(k);
      if (sums[k] != nullptr) running[k] = std::exchange(*sums[k], Array());
    }
    running = autodiff::backward_into(std::move(roots), std::move(cts), boundaries, std::move(running), create);
    for (std::size_t k = 0; k < running.size(); ++k) {
      if (sums[k] != nullptr) *sums[k] = std::move(running[k]);
      else if (c.needs(k) && running[k].defined()) c.set(k, std::move(running[k]));
    }
  }

  // The values the policy kept in RAM go through saved-value hooks (core/autodiff/saved_hooks.hpp).
  void pack_residuals(const autodiff::detail::PrimitiveCall*) override {
    std::vector<Array> arrays;
    std::vector<autodiff::SavedValueInfo> infos;
    for (std::size_t k = 0; k < saved_.size(); ++k) {
      if (const Array* a = saved_[k].value.in_ram()) {
        arrays.push_back(*a);
        infos.push_back({"checkpoint", saved_[k].op, saved_[k].label});
        packed_at_.push_back(k);
      }
    }
    if (arrays.empty()) return;
    packed_ = pack(arrays, infos);
    for (std::size_t k : packed_at_) saved_[k].value = storage::StoredArray();
  }

  // Takes the arrays of the arguments the recomputation reads into the spill file (exact copies),
  // after the forward pass; backward() puts them back, graph links included, before recomputing.
  void offload_inputs(std::shared_ptr<pytree::StoredArguments> arguments) {
    const std::vector<Array> taken = arguments->take();
    offloaded_inputs_.resize(taken.size());
    for (std::size_t i = 0; i < taken.size(); ++i) {
      const Array& a = taken[i];
      if (!a.defined()) continue;
      OffloadedInput& in = offloaded_inputs_[i];
      in.node = a.node();
      in.index = a.output_index();
      for (std::size_t j = 0; j < i && in.same_as < 0; ++j)  // the same array passed twice: stored once
        if (taken[j].defined() && taken[j].shares_buffer(a) && taken[j].raw() == a.raw() && taken[j].shape() == a.shape() &&
            taken[j].dtype() == a.dtype())
          in.same_as = static_cast<std::ptrdiff_t>(j);
      if (in.same_as < 0) in.value = storage::StoredArray::store(a.detached(), {storage::Where::disk});
    }
    std::erase_if(held_, [&](const Array& h) {
      return std::any_of(taken.begin(), taken.end(), [&](const Array& a) { return a.defined() && a.shares_buffer(h); });
    });
    arguments_ = std::move(arguments);
  }

  void release() override {
    arguments_.reset();
    offloaded_inputs_.clear();
    packed_.reset();
    saved_.clear();
    dead_.clear();
    prints_.clear();
    recipes_.clear();
    recompute_ = nullptr;
    held_.clear();
  }

  void saved_arrays(std::vector<Array>& out) const override {
    for (const Array& a : held_) out.push_back(a);
    for (const SavedValue& s : saved_)
      if (const Array* a = s.value.in_ram()) out.push_back(*a);
  }

 private:
  std::vector<SavedValue> saved_;
  std::shared_ptr<autodiff::PackedResiduals> packed_;  // saved values handed to saved-value hooks
  std::vector<std::size_t> packed_at_;                 // ... and their places in saved_
  std::vector<bool> dead_;
  std::vector<OpPrint> prints_;
  std::vector<OpRecipe> recipes_;
  detail::Thunk recompute_;
  bool verify_;
  std::string where_;
  std::vector<std::uint64_t> fingerprints_;
  std::vector<Array> held_;
  // Inputs kept in the spill file (offload_inputs), one per argument array, and where they go back.
  struct OffloadedInput {
    storage::StoredArray value;             // undefined: an undefined argument, or same_as another
    std::shared_ptr<autodiff::Node> node;   // the graph link the argument had
    std::uint32_t index = 0;
    std::ptrdiff_t same_as = -1;            // the same array as an earlier argument
  };
  std::vector<OffloadedInput> offloaded_inputs_;
  std::shared_ptr<pytree::StoredArguments> arguments_;
  std::uint64_t block_first_id_ = 0;          // the block's ops had ids [block_first_id_, id()) in the forward pass
  std::vector<autodiff::Edge> recomputed_;    // create-graph mode: the recomputed outputs this node stands for

  std::vector<Array> read_inputs() const {
    std::vector<Array> back(offloaded_inputs_.size());
    for (std::size_t i = 0; i < back.size(); ++i) {
      const OffloadedInput& in = offloaded_inputs_[i];
      if (in.same_as >= 0) back[i] = back[static_cast<std::size_t>(in.same_as)].detached();
      else if (in.value.defined()) back[i] = in.value.get();
      else continue;
      if (in.node) back[i].set_node(in.node, in.index);
    }
    return back;
  }
};

}  // namespace

RecomputeStats recompute_stats() {
  RecomputeStats s;
  s.checkpointed_calls = g_stats.calls.load();
  s.recomputations = g_stats.recomputations.load();
  s.ops_recomputed = g_stats.recomputed.load();
  s.ops_replayed = g_stats.replayed.load();
  s.ops_eliminated = g_stats.eliminated.load();
  s.full_reruns = g_stats.reruns.load();
  s.values_saved = g_stats.saved.load();
  return s;
}

void reset_recompute_stats() {
  g_stats.calls = 0;
  g_stats.recomputations = 0;
  g_stats.recomputed = 0;
  g_stats.replayed = 0;
  g_stats.eliminated = 0;
  g_stats.reruns = 0;
  g_stats.saved = 0;
}

namespace detail {

void check_static_argnums(const std::vector<int>& argnums, std::size_t num_args) {
  for (int i : argnums)
    if (i < 0 || static_cast<std::size_t>(i) >= num_args)
      throw ValueError(linum::detail::cat("checkpoint: static_argnums entry ", i, " is out of range for a call with ", num_args,
                                          " argument(s); count from 0 = the first argument (negative indices are not "
                                          "accepted)"));
}

namespace {
std::vector<Array> run_checkpointed_physical(const Thunk& forward, Thunk recompute, const CheckpointOptions& options,
                                             std::string where, std::vector<Array> held,
                                             const std::function<bool(const std::vector<Array>&)>& keep_plain,
                                             std::shared_ptr<pytree::StoredArguments> arguments);
}  // namespace

// vmap: a block whose outputs are batched (core/batch_levels.hpp) is checkpointed as the physical
// computation it is. Its node and the enclosing sweep see the outputs' physical arrays; the
// recomputation runs the block again on its stored (batched) arguments and hands back the physical
// arrays of the same outputs, so per-example values stay bitwise those of the first run.
std::vector<Array> run_checkpointed(const Thunk& forward, Thunk recompute, const CheckpointOptions& options,
                                    std::string where, std::vector<Array> held,
                                    const std::function<bool(const std::vector<Array>&)>& keep_plain,
                                    std::shared_ptr<pytree::StoredArguments> arguments) {
  auto levels = std::make_shared<std::vector<std::vector<BatchLevel>>>();
  auto physical = [levels, where](std::vector<Array> outs, bool first) {
    if (first) levels->clear();
    for (std::size_t i = 0; i < outs.size(); ++i) {
      const std::span<const BatchLevel> own = outs[i].batch_levels();
      if (first) {
        levels->emplace_back(own.begin(), own.end());
      } else if (i >= levels->size() || !std::equal(own.begin(), own.end(), (*levels)[i].begin(), (*levels)[i].end())) {
        throw AutodiffError(linum::detail::cat("'", where, "': the recomputation's output ", i,
                                               " is batched differently (vmap) from the first run's"));
      }
      outs[i] = outs[i].physical();
    }
    return outs;
  };
  const Thunk forward_physical = [&forward, physical] { return physical(forward(), true); };
  Thunk recompute_physical = [recompute = std::move(recompute), physical] { return physical(recompute(), false); };
  std::function<bool(const std::vector<Array>&)> keep_plain_physical;
  if (keep_plain)
    keep_plain_physical = [&keep_plain, levels](const std::vector<Array>& outs) {
      std::vector<Array> batched = outs;
      for (std::size_t i = 0; i < batched.size() && i < levels->size(); ++i)
        batched[i] = Array::batched_view(batched[i], (*levels)[i]);
      return keep_plain(batched);
    };
  std::vector<Array> outs = run_checkpointed_physical(forward_physical, std::move(recompute_physical), options, std::move(where),
                                                      std::move(held), keep_plain_physical, std::move(arguments));
  for (std::size_t i = 0; i < outs.size() && i < levels->size(); ++i) outs[i] = Array::batched_view(outs[i], (*levels)[i]);
  return outs;
}

namespace {
std::vector<Array> run_checkpointed_physical(const Thunk& forward, Thunk recompute, const CheckpointOptions& options,
                                             std::string where, std::vector<Array> held,
                                             const std::function<bool(const std::vector<Array>&)>& keep_plain,
                                             std::shared_ptr<pytree::StoredArguments> arguments) {
  if (options.policy.batch_splits() > 1)
    throw ValueError(linum::detail::cat("'", where, "': policies::split_batch applies to module calls under lift::RematScope or "
                                        "lift::PlanScope (which split the call); give checkpoint and remat<M> the policy inside it, ",
                                        options.policy.split_policy()->description()));
  if (!autodiff::is_recording() || options.policy.saves_everything()) return forward();
  if (const Policy* placement = options.policy.residual_placement()) {  // policies::residuals: no checkpoint
    ResidualScope placed(*placement);
    return forward();
  }
  const std::uint64_t first = Node::peek_next_id();
  std::vector<Array> outs;
  std::vector<SavedValue> saved;
  std::vector<OpPrint> op_prints;
  std::vector<OpRecipe> recipes;
  std::vector<bool> dead;
  {
    ForwardRegion region(options.policy, options.verify);
    outs = forward();
    dead = region.dead_ops(outs);
    saved = region.take_saved();
    op_prints = region.take_prints();
    recipes = region.take_recipes();
  }
  if (keep_plain && keep_plain(outs)) return outs;
  g_stats.calls.fetch_add(1, std::memory_order_relaxed);
  std::vector<autodiff::Edge> inputs = autodiff::external_inputs(outs, first);
  if (inputs.empty()) {
    for (Array& o : outs) o = o.detached();  // nothing to differentiate: plain constants
    return outs;
  }
  std::vector<Shape> shapes;
  std::vector<std::uint64_t> prints;
  for (const Array& o : outs) {
    shapes.push_back(o.shape());
    if (options.verify) prints.push_back(fingerprint(o));
  }
  // Keep each held array once (the same buffer may be passed twice).
  std::vector<Array> unique_held;
  for (Array& h : held) {
    if (!h.defined()) continue;
    if (std::none_of(unique_held.begin(), unique_held.end(), [&](const Array& u) { return u.shares_buffer(h); }))
      unique_held.push_back(h.detached());
  }
  auto node = std::make_shared<CheckpointNode>(std::move(inputs), std::move(shapes), std::move(saved), std::move(dead),
                                               std::move(recompute),
                                               options.verify, std::move(where), std::move(prints), std::move(unique_held),
                                               std::move(op_prints), std::move(recipes));
  // An array returned twice (an RNN step's new carry that is also its output) stays one value: both
  // places get the first output, so its consumers' cotangents add up at one output in the order the
  // plain graph adds them (two outputs would be summed separately and then together: other bits).
  std::vector<std::size_t> first_of(outs.size());
  for (std::size_t i = 0; i < outs.size(); ++i) {
    first_of[i] = i;
    if (outs[i].node() == nullptr) continue;
    for (std::size_t j = 0; j < i; ++j)
      if (outs[j].node() == outs[i].node() && outs[j].output_index() == outs[i].output_index()) {
        first_of[i] = j;
        break;
      }
  }
  for (std::size_t i = 0; i < outs.size(); ++i) {
    if (first_of[i] != i) {
      outs[i] = outs[first_of[i]];
      continue;
    }
    outs[i] = outs[i].detached();  // drops the block's own graph: its intermediates are freed here
    if (is_floating(outs[i].dtype())) outs[i].set_node(node, static_cast<std::uint32_t>(i));
  }
  node->set_block_ids(first);
  if (arguments && options.policy.offloads_inputs()) node->offload_inputs(std::move(arguments));
  if (autodiff::detail::SavedValueHooksStack::innermost() != nullptr) node->pack_residuals(nullptr);
  if (autodiff::detail::record_hooks_active())
    for (Array& o : outs)
      if (o.node()) autodiff::detail::notify_record_hooks("checkpoint", std::span<Array>(&o, 1), node.get(), nullptr);
  return outs;
}
}  // namespace

}  // namespace detail
}  // namespace linum::lift
