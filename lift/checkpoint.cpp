// The checkpoint engine: forward regions that number ops and keep what the policy allows, the
// checkpoint node, and its backward pass, which replays the block and differentiates it locally.
#include <linum/lift/checkpoint.hpp>

#include <linum/core/autodiff/grad.hpp>
#include <linum/core/autodiff/hooks.hpp>
#include <linum/modules/scope.hpp>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <sstream>

namespace linum::lift {
namespace {

using autodiff::Node;

struct Counters {
  std::atomic<std::int64_t> calls{0}, recomputations{0}, recomputed{0}, replayed{0}, saved{0};
} g_stats;

std::string current_module_path() {
  const std::vector<std::string>* p = linum::detail::current_module_path();
  return p ? linum::detail::join_module_path(*p) : std::string();
}

// One value a policy kept: the index of the op in the block's record order, and its output.
struct SavedValue {
  std::uint64_t index;
  Array value;
};

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

// Numbers the ops recorded by the block's forward pass and keeps what the policy allows.
class ForwardRegion final : public autodiff::detail::RecordHook {
 public:
  ForwardRegion(const Policy& policy, bool verify) : policy_(policy), verify_(verify) {}
  bool is_region() const override { return true; }
  void on_record(const char* op, Array& out, const Node* node) override {
    const std::uint64_t index = next_++;
    if (verify_) prints_.push_back({op, out.shape(), out.dtype(), fingerprint(out), current_module_path()});
    if (policy_.saves_nothing()) return;
    const std::string path = current_module_path();
    const OpInfo info{op, out.shape(), out.nbytes(), node ? node->label() : std::string_view(), path, out.dtype()};
    if (policy_.saveable(info)) {
      saved_.push_back({index, out.detached()});
      g_stats.saved.fetch_add(1, std::memory_order_relaxed);
    }
  }
  std::vector<SavedValue> take_saved() { return std::move(saved_); }
  std::vector<OpPrint> take_prints() { return std::move(prints_); }

 private:
  const Policy& policy_;
  bool verify_;
  std::vector<SavedValue> saved_;
  std::vector<OpPrint> prints_;
  std::uint64_t next_ = 0;
};

// The error verify mode raises, naming the block and the first op that differs.
[[noreturn]] void throw_differs(const std::string& where, const std::string& what) {
  throw AutodiffError(linum::detail::cat(
      "checkpoint '", where, "': the recomputed forward pass differs from the original: ", what,
      ". The block is not deterministic: make it a pure function of its inputs, variables and rng streams (no global "
      "state, no unseeded random numbers)"));
}

// Numbers the ops of the recomputation the same way and hands back the saved values.
class ReplayRegion final : public autodiff::detail::RecordHook {
 public:
  // With `prints` (verify mode), every recomputed op is compared with the forward pass's.
  ReplayRegion(const std::vector<SavedValue>& saved, const std::vector<OpPrint>* prints, const std::string& where)
      : saved_(saved), prints_(prints), where_(where) {}
  bool is_region() const override { return true; }
  const Array* peek_replayed_output() const override {
    return cursor_ < saved_.size() && saved_[cursor_].index == next_ ? &saved_[cursor_].value : nullptr;
  }
  void on_record(const char* op, Array& out, const Node*) override {
    if (prints_ != nullptr) check_op(op, out);
    if (cursor_ < saved_.size() && saved_[cursor_].index == next_) {
      const Array& keep = saved_[cursor_++].value;
      if (!(keep.shape() == out.shape()))
        throw AutodiffError(linum::detail::cat("checkpoint: the recomputation recorded a different op sequence than the "
                                               "forward pass (a saved value of shape ", keep.shape(), " met an op output of shape ",
                                               out.shape(), "); the block must be deterministic"));
      Array v = keep.detached();
      v.set_node(out.node(), out.output_index());
      out = std::move(v);
      g_stats.replayed.fetch_add(1, std::memory_order_relaxed);
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

 private:
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
  const std::vector<OpPrint>* prints_;
  const std::string& where_;
  std::size_t cursor_ = 0;
  std::uint64_t next_ = 0;
};

class CheckpointNode final : public Node {
 public:
  CheckpointNode(std::vector<autodiff::Edge> inputs, std::vector<Shape> shapes, std::vector<SavedValue> saved,
                 detail::Thunk recompute, bool verify, std::string where, std::vector<std::uint64_t> fingerprints,
                 std::vector<Array> held, std::vector<OpPrint> prints)
      : Node("checkpoint", std::move(inputs), std::move(shapes)),
        saved_(std::move(saved)),
        prints_(std::move(prints)),
        recompute_(std::move(recompute)),
        verify_(verify),
        where_(std::move(where)),
        fingerprints_(std::move(fingerprints)),
        held_(std::move(held)) {}

  void backward(autodiff::Cotangents& c) override {
    g_stats.recomputations.fetch_add(1, std::memory_order_relaxed);
    std::vector<Array> outs;
    {
      ReplayRegion region(saved_, verify_ ? &prints_ : nullptr, where_);
      linum::detail::PhaseScope phase(linum::detail::Phase::recomputation);
      autodiff::EnableGradGuard recording;
      outs = recompute_();
      region.check_complete();
    }
    if (outs.size() != num_outputs())
      throw AutodiffError(linum::detail::cat("checkpoint '", where_, "': the recomputation returned ", outs.size(),
                                             " arrays, the forward pass ", num_outputs()));
    if (verify_)
      for (std::size_t i = 0; i < outs.size(); ++i)
        if (fingerprint(outs[i]) != fingerprints_[i] || !(outs[i].shape() == output_shapes()[i]))
          throw_differs(where_, linum::detail::cat("output ", i, " of shape ", outs[i].shape(), " has different values"));
    // Only the recomputed outputs' graph nodes are needed, not their values: dropping the values
    // (and taking the incoming cotangents) frees them before the recomputed block is differentiated.
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
    std::vector<Array> grads = autodiff::backward_to(std::move(roots), std::move(cts), boundaries);
    for (std::size_t k = 0; k < grads.size(); ++k)
      if (c.needs(k) && grads[k].defined()) c.set(k, std::move(grads[k]));
  }

  void release() override {
    saved_.clear();
    prints_.clear();
    recompute_ = nullptr;
    held_.clear();
  }

  void saved_arrays(std::vector<Array>& out) const override {
    for (const Array& a : held_) out.push_back(a);
    for (const SavedValue& s : saved_) out.push_back(s.value);
  }

 private:
  std::vector<SavedValue> saved_;
  std::vector<OpPrint> prints_;
  detail::Thunk recompute_;
  bool verify_;
  std::string where_;
  std::vector<std::uint64_t> fingerprints_;
  std::vector<Array> held_;
};

}  // namespace

RecomputeStats recompute_stats() {
  RecomputeStats s;
  s.checkpointed_calls = g_stats.calls.load();
  s.recomputations = g_stats.recomputations.load();
  s.ops_recomputed = g_stats.recomputed.load();
  s.ops_replayed = g_stats.replayed.load();
  s.values_saved = g_stats.saved.load();
  return s;
}

void reset_recompute_stats() {
  g_stats.calls = 0;
  g_stats.recomputations = 0;
  g_stats.recomputed = 0;
  g_stats.replayed = 0;
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

std::vector<Array> run_checkpointed(const Thunk& forward, Thunk recompute, const CheckpointOptions& options,
                                    std::string where, std::vector<Array> held,
                                    const std::function<bool(const std::vector<Array>&)>& keep_plain) {
  if (!autodiff::is_recording() || options.policy.saves_everything()) return forward();
  const std::uint64_t first = Node::peek_next_id();
  std::vector<Array> outs;
  std::vector<SavedValue> saved;
  std::vector<OpPrint> op_prints;
  {
    ForwardRegion region(options.policy, options.verify);
    outs = forward();
    saved = region.take_saved();
    op_prints = region.take_prints();
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
  auto node = std::make_shared<CheckpointNode>(std::move(inputs), std::move(shapes), std::move(saved), std::move(recompute),
                                               options.verify, std::move(where), std::move(prints), std::move(unique_held),
                                               std::move(op_prints));
  for (std::size_t i = 0; i < outs.size(); ++i) {
    outs[i] = outs[i].detached();  // drops the block's own graph: its intermediates are freed here
    if (is_floating(outs[i].dtype())) outs[i].set_node(node, static_cast<std::uint32_t>(i));
  }
  if (autodiff::detail::t_record_hook != nullptr)
    for (Array& o : outs)
      if (o.node()) autodiff::detail::on_record("checkpoint", o, node.get());
  return outs;
}

}  // namespace detail
}  // namespace linum::lift
