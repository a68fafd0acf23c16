// Batch levels: how vmap (core/transforms/vmap.hpp) carries a batch of examples inside one Array,
// as JAX's BatchTracer and functorch's BatchedTensor do.
//
// A batched Array shows the shape of one example (shape(), rank(), numel() are per example, so
// code written for one example reads the shapes it expects), while its buffer holds every example:
// the physical array has one leading axis per batch level, in the order the levels were opened
// (outer vmap first), then the example's axes. Each level is one vmap call, named by an id that
// grows with every call, so nested vmaps order their axes by nesting and values from sibling calls
// never mix by accident.
//
// Ops see a batched input and apply their batching rule (core/ops/batching.hpp): the same op on the
// physical array with its axes shifted, a batched product, a loop for an op that has no rule. A
// kernel never reads a batched array as if it held one example: raw() refuses, except inside the
// loop of an op without a rule, where the loop cursor (below) says which example is being computed.
#pragma once

#include <linum/core/context.hpp>
#include <linum/core/shape.hpp>

#include <cstdint>
#include <span>
#include <vector>

namespace linum {

class Array;

// One vmap level: its id (larger for levels opened later) and its number of examples.
struct BatchLevel {
  std::uint64_t id = 0;
  std::int64_t size = 0;
  friend bool operator==(const BatchLevel&, const BatchLevel&) = default;
};

namespace detail {

// What a batched Array carries besides its per-example shape: the physical shape (the levels' sizes,
// then the example's shape) and the levels, sorted by id.
struct BatchInfo {
  Shape physical;
  std::vector<BatchLevel> levels;
  // The buffer holds one example, the same for every example of the levels (a value repeated along
  // them without a copy: grad inside vmap makes its arguments so, see autodiff::to_open_levels).
  bool repeated = false;
};

// How a repeated batched array becomes its physical array (a copy per example, linked to the
// array's graph node): set by the autodiff layer (core/autodiff/batching.cpp), which makes them.
using MaterializeRepeated = Array (*)(const Array& repeated);
void set_materialize_repeated(MaterializeRepeated fn);

// The vmap levels open on this thread (innermost on top): grad and vjp called inside vmap
// differentiate each example separately, so they batch their arguments at every open level.
struct OpenBatchLevelsContext {
  using Value = BatchLevel;
};
using OpenBatchLevels = ContextStack<OpenBatchLevelsContext>;

// The open levels, outermost first.
std::vector<BatchLevel> open_batch_levels();

// A fresh level id (thread-safe, increasing).
std::uint64_t next_batch_level_id();

// The example an op without a batching rule is computing while it loops over the batch: for each
// level of `levels`, the index of the example along it. While one is set, a batched array's raw()
// is that example's data.
struct BatchCursorContext {
  struct Value {
    std::span<const BatchLevel> levels;
    std::span<const std::int64_t> index;
  };
};
using BatchCursor = ContextStack<BatchCursorContext>;

}  // namespace detail
}  // namespace linum
