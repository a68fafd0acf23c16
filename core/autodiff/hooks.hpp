// Record hooks: observers of the ops recorded on this thread. Checkpoint regions (lift/) use them
// to number the ops of a block, keep the outputs their policy saves, and hand those values back
// when the block is recomputed; residual traces use them to learn which op produced a value.
// Hooks nest as a stack per thread (constructor pushes, destructor pops).
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/autodiff/graph.hpp>

namespace linum::autodiff::detail {

class RecordHook {
 public:
  RecordHook();
  virtual ~RecordHook();
  RecordHook(const RecordHook&) = delete;
  RecordHook& operator=(const RecordHook&) = delete;

  // Called after an op recorded `node` for `out` (inner to outer; only the innermost region).
  virtual void on_record(const char* op, Array& out, const Node* node) = 0;
  // Checkpoint regions: the value saved for the op about to be recorded, if replaying.
  virtual const Array* peek_replayed_output() const { return nullptr; }
  virtual bool is_region() const { return false; }
  RecordHook* previous() const { return previous_; }

 private:
  RecordHook* previous_;
};

// For expensive ops (matmul, conv2d): the output a replaying checkpoint saved for the op that is
// about to run, so it need not be computed again; null if none.
const Array* peek_replayed_output();

}  // namespace linum::autodiff::detail
