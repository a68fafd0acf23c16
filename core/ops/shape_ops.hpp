// Ops that move data without arithmetic: reshape, transpose, slice, concatenate, split, gather
// (take), one_hot, broadcast_to, expand_dims, squeeze. All differentiable except one_hot.
#pragma once

#include <linum/core/array.hpp>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace linum {

// New shape with the same number of elements; one dimension may be -1 (inferred). No copy.
Array reshape(const Array& x, const std::vector<std::int64_t>& shape);
// Permutes axes; an empty `perm` reverses them (as jnp.transpose).
Array transpose(const Array& x, const std::vector<int>& perm = {});
// x[start:limit:stride] per axis (as lax.slice); `strides` empty means 1 everywhere.
Array slice(const Array& x, const std::vector<std::int64_t>& starts, const std::vector<std::int64_t>& limits,
            const std::vector<std::int64_t>& strides = {});
// Zeros added before and after each axis: widths[i] = {before, after} (as jnp.pad with constant 0;
// fewer pairs than axes pad the leading axes only). Differentiable to any order.
Array pad(const Array& x, const std::vector<std::pair<std::int64_t, std::int64_t>>& widths);
// x[start:limit] along one axis.
Array slice_axis(const Array& x, int axis, std::int64_t start, std::int64_t limit);
Array concatenate(const std::vector<Array>& xs, int axis = 0);
// Splits into `sections` equal parts along axis (as jnp.split with an int).
std::vector<Array> split(const Array& x, int sections, int axis = 0);
// Splits at the given indices along axis (as jnp.split with a list).
std::vector<Array> split(const Array& x, const std::vector<std::int64_t>& indices, int axis = 0);
// The slices x[i] along axis 0 (n arrays of shape x.shape[1:]), as one op whose backward pass
// writes all the cotangents into one gradient (unlike n separate slices). With `views`, the slices
// are views of x's buffer wherever their offset keeps the 64-byte alignment (copies elsewhere): no
// memory of their own, but any slice alive keeps all of x alive (lift::scan's per-iteration
// variables, which the stacked variables outlive anyway).
struct UnstackOptions {
  bool views = false;
};
std::vector<Array> unstack(const Array& x, const UnstackOptions& options = {});
// Joins same-shaped arrays along a new leading axis.
Array stack(const std::vector<Array>& xs);
// Gathers x along `axis` at int32 `indices` (embedding lookup). Out-of-range indices are an error.
Array take(const Array& x, const Array& indices, int axis = 0);
// One-hot float32 encoding of int32 labels; out-of-range labels give all-zero rows (as jax.nn.one_hot).
Array one_hot(const Array& indices, std::int64_t num_classes);
Array broadcast_to(const Array& x, const Shape& shape);
Array expand_dims(const Array& x, int axis);
// Removes the given size-1 axes (all size-1 axes when `axes` is empty).
Array squeeze(const Array& x, const std::vector<int>& axes = {});
// Reverses the order of elements along the given axes (jnp.flip).
Array flip(const Array& x, const std::vector<int>& axes);
// Inserts factor - 1 zeros between neighbouring elements along each axis (one factor per axis,
// each >= 1): an axis of size d becomes (d - 1) * factor + 1. lax.pad's interior padding, the
// input dilation of a transposed convolution.
Array dilate(const Array& x, const std::vector<std::int64_t>& factors);

// Axis rearrangements and repetitions as jnp's, built from transpose, broadcast_to and reshape
// (so they differentiate, and policies see, those ops):
// moves axis `source` to position `destination`, the others keeping their order (jnp.moveaxis).
Array moveaxis(const Array& x, int source, int destination);
// exchanges two axes (jnp.swapaxes).
Array swapaxes(const Array& x, int axis1, int axis2);
// the array repeated reps[i] times along axis i; reps shorter than the rank applies to the last
// axes, longer adds leading axes (jnp.tile). Every rep must be >= 0.
Array tile(const Array& x, const std::vector<std::int64_t>& reps);
// every element repeated `repeats` times along `axis` (jnp.repeat with an integer count); with no
// axis the array is flattened first.
Array repeat(const Array& x, std::int64_t repeats, std::optional<int> axis = std::nullopt);
// jnp.cumsum(x, axis): running sums along `axis` (float32 or bf16; summed in float32, each output
// rounded once). Its gradient is the reversed running sum of the cotangent.
Array cumsum(const Array& x, int axis);
// jnp.cumprod(x, axis): running products along `axis` (float32 or bf16; multiplied in float32, each
// output rounded once). Its gradient is exact with zeros in x (no division): dx_j is the product of
// the x_i before j times the reversed running sum of g_k * (the x_i between j and k].
Array cumprod(const Array& x, int axis);
// jnp.take_along_axis(x, indices, axis): out[..., j, ...] = x[..., indices[..., j, ...], ...]; int32
// `indices` of x's rank, the same shape as x except along `axis`. Differentiable in x (through take).
Array take_along_axis(const Array& x, const Array& indices, int axis);
// jax.ops.segment_sum(data, segment_ids, num_segments): out[s] = the sum of the rows data[i] (along
// axis 0) with segment_ids[i] == s; rows whose id is outside [0, num_segments) are dropped, as JAX's.
// Differentiable in data (its gradient gathers the cotangent's rows).
Array segment_sum(const Array& data, const Array& segment_ids, std::int64_t num_segments);
// jnp.argsort(x, axis) (stable: equal values keep their order; NaNs last): int32 indices that sort
// each slice along `axis` ascending (descending: largest first, NaNs first, equal values in order).
Array argsort(const Array& x, int axis = -1, bool descending = false);
// jnp.sort(x, axis): x sorted along `axis` (NaNs last); differentiable (a gather of x).
Array sort(const Array& x, int axis = -1);
// lax.top_k(x, k): the k largest entries along the last axis, largest first (NaNs count as largest,
// ties by position), and their int32 indices; differentiable in the values.
std::pair<Array, Array> top_k(const Array& x, std::int64_t k);

namespace ops::detail {
// Rows of g added into zeros of `xshape` at `indices` (int32) along `axis`: take's transpose, as a
// primitive whose rule is take (used by create-graph rules).
Array take_add(const Array& g, const Array& indices, const Shape& xshape, int axis);
}  // namespace ops::detail

}  // namespace linum
