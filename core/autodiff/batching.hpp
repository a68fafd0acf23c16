// The autodiff layer's part of vmap (core/transforms/vmap.hpp): moving values between batch levels,
// and running an op that has no batching rule once per example.
//
// A batched array (core/batch_levels.hpp) is a view of one physical array whose leading axes are
// its levels; graph nodes and backward rules always work on physical arrays, so differentiating a
// batched computation is differentiating the physical one. What vmap adds to differentiation is
// where a value enters a level: grad called inside vmap differentiates each example on its own, so
// it first repeats its arguments along every open level (to_open_levels), and the gradient it
// returns is batched too (per-example gradients). The repeat's transpose sums over the levels it
// added, which is what grad of vmap needs.
#pragma once

#include <linum/core/array.hpp>

#include <span>
#include <vector>

namespace linum::autodiff {

// The levels of all batched arrays among `arrays`, sorted by id (a level of several arrays must have
// one size: otherwise BatchingError naming `op`).
std::vector<BatchLevel> union_levels(std::span<const Array* const> arrays, const char* op);

// Whether any of `arrays` is batched.
inline bool any_batched(std::span<const Array* const> arrays) {
  for (const Array* a : arrays)
    if (a->batched()) return true;
  return false;
}

// `x` (batched at some of `levels`, or not at all) batched at exactly `levels`: the value repeated
// along the levels it lacks (a copy; no copy when it has them all). Differentiable: the transpose
// sums over the levels added.
Array broadcast_levels(const Array& x, std::span<const BatchLevel> levels);

// The transpose of broadcast_levels: `x` summed over its levels not in `keep` (sums run over the
// examples in order, in float32 for bf16).
Array sum_levels(const Array& x, std::span<const BatchLevel> keep);

// The physical cotangent of `root` (a value a sweep starts from): `ct`, of root's per-example shape,
// repeated over root's levels it lacks. A cotangent batched over a level the root is not is an error.
Array physical_cotangent(const Array& root, const Array& ct);

// `x` batched at every vmap level open on this thread (grad and vjp inside vmap).
Array to_open_levels(const Array& x);

namespace detail {

// The examples of a batched array, row-major over its levels, each an unbatched array (recorded
// when `x` is; its transpose is stack_examples).
std::vector<Array> unstack_examples(const Array& x);
// The inverse: one array per example (row-major over `levels`, the same shape each) as one array
// batched at `levels`.
Array stack_examples(const std::vector<Array>& examples, std::span<const BatchLevel> levels);

// The example `x` shows under the current loop cursor, copied into an array of its own (ops without
// a batching rule: a residual or output their forward took from a batched array).
Array copy_current_example(const Array& x);

// While alive, this thread's parallel regions run on one thread: an op's forward in the loop over
// examples reads batched arrays through this thread's loop cursor, which other threads lack.
class SerialScope {
 public:
  SerialScope();
  ~SerialScope();
  SerialScope(const SerialScope&) = delete;
  SerialScope& operator=(const SerialScope&) = delete;

 private:
  int previous_;
};

// Reported once per op name: an op that has no batching rule ran as a loop over `examples`.
void report_loop(const char* op, std::int64_t examples);

}  // namespace detail
}  // namespace linum::autodiff
