// Record hooks: observers of the ops recorded on this thread. Checkpoint regions (lift/) use them
// to number the ops of a block, keep the outputs their policy saves, and hand those values back
// when the block is recomputed; residual traces use them to learn which op produced a value.
// Hooks nest as a stack per thread (constructor pushes, destructor pops).
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/autodiff/graph.hpp>

#include <optional>

namespace linum::autodiff::detail {

class RecordHook {
 public:
  RecordHook();
  virtual ~RecordHook();
  RecordHook(const RecordHook&) = delete;
  RecordHook& operator=(const RecordHook&) = delete;

  // Called after an op recorded `node` for `out` (inner to outer; only the innermost region).
  virtual void on_record(const char* op, Array& out, const Node* node) = 0;
  // Checkpoint regions: see replay_output below.
  virtual std::optional<Array> replay_output(const Shape& /*shape*/, DType /*dtype*/) { return std::nullopt; }
  virtual bool is_region() const { return false; }
  RecordHook* previous() const { return previous_; }

 private:
  RecordHook* previous_;
};

// For ops that can skip their computation when a checkpoint replays its block (matmul, conv2d,
// checkpoint_name): call right before computing an output of `shape` and `dtype` that the op then
// records. Returns the value to use instead of computing it (the output the checkpoint's policy
// saved, or a placeholder for a value nothing in the replay reads), or nullopt: compute as usual.
// In a checkpoint's forward pass it tells the region that this op can be skipped on replay.
std::optional<Array> replay_output(const Shape& shape, DType dtype);

}  // namespace linum::autodiff::detail
