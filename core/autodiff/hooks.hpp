// Record hooks: observers of the ops recorded on this thread. Checkpoint regions (lift/) use them
// to number the ops of a block, keep the outputs their policy saves, and hand those values back
// when the block is recomputed; residual traces use them to learn which op produced a value.
// Hooks nest as a stack per thread (constructor pushes, destructor pops).
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/autodiff/graph.hpp>
#include <linum/core/autodiff/primitive.hpp>

#include <optional>

namespace linum::autodiff::detail {

class RecordHook {
 public:
  RecordHook() = default;
  virtual ~RecordHook() = default;
  RecordHook(const RecordHook&) = delete;
  RecordHook& operator=(const RecordHook&) = delete;

  // Called after an op recorded `node` for `out` (once per output; inner to outer; only the
  // innermost region). `call` describes a primitive that went through the dispatcher (its
  // inputs and residuals); it is null for an op recorded after computing (autodiff::record) and
  // for checkpoints, which a replay cannot skip.
  virtual void on_record(const char* op, Array& out, const Node* node, const PrimitiveCall* call) = 0;
  // Checkpoint regions: the outputs and residuals of the next primitive when the replay of a block
  // can skip its forward (its outputs were saved by the policy, or nothing reads them), else nullopt.
  virtual std::optional<Replayed> replay_primitive(std::span<const Array* const> /*inputs*/) { return std::nullopt; }
  virtual bool is_region() const { return false; }

 private:
  RecordHooks::Entry installed_{this};  // pushed while the hook lives (core/context.hpp)
};

}  // namespace linum::autodiff::detail
