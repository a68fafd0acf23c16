// Array: a dense, row-major, N-dimensional float32, bfloat16 or int32 array.
//
// Buffers are shared and immutable: copying an Array is cheap and never copies data, and no op
// writes into an existing buffer, so a value saved for the backward pass can never change behind
// the autodiff's back. Buffers are 64-byte aligned and allocated through linum::memory, so every
// byte is accounted.
//
// An Array may also carry a reference to the autodiff graph node that produced it (when it was
// computed while differentiating); see core/autodiff/graph.hpp.
#pragma once

#include <atomic>

#include <linum/core/batch_levels.hpp>
#include <linum/core/dtype.hpp>
#include <linum/core/error.hpp>
#include <linum/core/shape.hpp>

#include <cstdint>
#include <cstring>
#include <iosfwd>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace linum {


namespace autodiff {
class Node;
}

// An immutable block of accounted memory, or a view of part of another buffer (no memory of its
// own; it keeps that buffer alive).
class Buffer {
 public:
  explicit Buffer(std::size_t bytes);
  Buffer(std::shared_ptr<Buffer> parent, std::size_t offset, std::size_t bytes);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  std::size_t bytes() const { return bytes_; }
  bool is_view() const { return parent_ != nullptr; }
  void* data() const {
    if (read_flag_) [[unlikely]]
      read_flag_->store(true, std::memory_order_relaxed);
    return data_;
  }

  // Internal (checkpoint replay, lift/checkpoint.cpp): a buffer standing for the value of an op a
  // recomputation skipped because nothing it runs should read it. Any access through data() sets
  // `read_flag`, so the replay can tell that its analysis missed a reader and run again in full.
  void mark_elided(std::shared_ptr<std::atomic<bool>> read_flag) { read_flag_ = std::move(read_flag); }

 private:
  void* data_;
  std::size_t bytes_;
  std::shared_ptr<std::atomic<bool>> read_flag_;
  std::shared_ptr<Buffer> parent_;  // a view's
};

class Array {
 public:
  // An undefined array (no shape, no data). `defined()` is false.
  Array() = default;

  // --- construction -------------------------------------------------------------------------
  // Uninitialised storage of the given shape; fill it through mutable_data() before sharing it.
  static Array empty(const Shape& shape, DType dtype = DType::f32);
  static Array zeros(const Shape& shape, DType dtype = DType::f32);
  static Array ones(const Shape& shape) { return full(shape, 1.0f); }
  // `value` in the given float dtype (rounded to nearest even for bf16).
  static Array full(const Shape& shape, float value, DType dtype = DType::f32);
  static Array full_i32(const Shape& shape, std::int32_t value);
  // Internal (checkpoint replay): storage for a value that is not computed; any read sets
  // `read_flag` (see Buffer::mark_elided).
  static Array elided_placeholder(const Shape& shape, DType dtype, std::shared_ptr<std::atomic<bool>> read_flag);
  // A weakly typed float32 scalar, like a Python scalar in JAX: in a binary op with a bf16 array it
  // takes bf16 instead of widening the result to float32 (x * 0.5f stays bf16).
  static Array scalar(float value) { Array a = full(Shape{}, value); a.weak_ = true; return a; }
  static Array from(const Shape& shape, std::span<const float> values);
  static Array from(const Shape& shape, std::initializer_list<float> values) {
    return from(shape, std::span<const float>(values.begin(), values.size()));
  }
  static Array from_i32(const Shape& shape, std::span<const std::int32_t> values);
  static Array from_i32(const Shape& shape, std::initializer_list<std::int32_t> values) {
    return from_i32(shape, std::span<const std::int32_t>(values.begin(), values.size()));
  }
  // 0, 1, ..., n-1 as float32.
  static Array arange(std::int64_t n);

  // --- inspection ---------------------------------------------------------------------------
  bool defined() const { return buffer_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int rank() const { return shape_.rank(); }
  std::int64_t dim(int axis) const { return shape_.dim(axis); }
  std::int64_t numel() const { return shape_.numel(); }
  DType dtype() const { return dtype_; }
  // A weakly typed scalar (see scalar()); results of ops are never weak.
  bool weak_type() const { return weak_; }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype_); }

  // Typed read access; throws if the dtype does not match.
  const float* data() const { check_dtype(DType::f32, "Array::data"); return static_cast<const float*>(raw()); }
  const std::int32_t* data_i32() const { check_dtype(DType::i32, "Array::data_i32"); return static_cast<const std::int32_t*>(raw()); }
  const bfloat16* data_bf16() const { check_dtype(DType::bf16, "Array::data_bf16"); return static_cast<const bfloat16*>(raw()); }
  const void* raw() const {
    if (batch_) [[unlikely]]
      return batched_raw();
    return buffer_ ? buffer_->data() : nullptr;
  }

  // Write access for code that has just created this array (kernels). Writing into a buffer that
  // is already shared breaks immutability; this is checked.
  float* mutable_data();
  std::int32_t* mutable_data_i32();
  bfloat16* mutable_data_bf16();
  void* mutable_raw();

  // The elements as float (float32 and bfloat16 arrays).
  std::vector<float> to_vector() const;
  std::vector<std::int32_t> to_vector_i32() const;
  // The single element of a size-1 array as float (bf16 and int32 arrays are converted).
  float item() const;

  // True when both arrays are defined, have the same shape and dtype and the same bytes.
  bool bitwise_equal(const Array& other) const;
  // The same buffer (not merely equal contents).
  bool shares_buffer(const Array& other) const { return buffer_ == other.buffer_; }
  // The buffer's identity (null for an undefined array), for analyses that track values by storage.
  const Buffer* buffer_identity() const { return buffer_.get(); }
  // A reference to the buffer that does not keep it alive: expired once the buffer is freed (so an
  // identity seen again is known to be the same buffer, not a new one at the same address).
  std::weak_ptr<const void> weak_buffer() const { return buffer_; }
  // No other Array refers to this buffer: an op that consumes this array may write its result
  // into it (backward rules reuse cotangent buffers this way).
  // A view of part of another buffer never does.
  bool owns_buffer_alone() const {
    return buffer_ != nullptr && batch_ == nullptr && buffer_.use_count() == 1 && !buffer_->is_view();
  }

  // A view of the same buffer with another shape of the same size (no copy, no graph node).
  Array with_shape(const Shape& shape) const;
  // A view of `shape.numel()` elements of this array's buffer from element `offset` (no copy, no
  // graph node), which keeps the whole buffer alive. Views keep buffers' 64-byte alignment: the
  // offset's bytes must be a multiple of 64 (see is_aligned_offset).
  Array part_view(std::int64_t offset, const Shape& shape) const;
  bool is_aligned_offset(std::int64_t offset) const {
    return offset * static_cast<std::int64_t>(dtype_size(dtype_)) % 64 == 0;
  }
  // The same data without the autodiff node: a constant as far as gradients are concerned.
  Array detached() const { Array a = *this; a.node_.reset(); a.output_index_ = 0; return a; }
  // The same array without its weak type (a strongly typed float32 scalar).
  Array strongly_typed() const { Array a = *this; a.weak_ = false; return a; }

  std::string str() const;  // "Array(float32[2,3], [...])": dtype, shape, values of small arrays
  std::string type_str() const;  // "bf16[2048,512]", as JAX prints an array's type

  // --- vmap (see core/batch_levels.hpp) --------------------------------------------------------
  // Whether this array holds one value per example of enclosing vmap levels; shape() is then the
  // shape of one example.
  bool batched() const { return batch_ != nullptr; }
  // The levels this array is batched over, sorted by id (empty when not batched).
  std::span<const BatchLevel> batch_levels() const;
  // The shape of the whole buffer: the levels' sizes, then shape() (shape() when not batched).
  const Shape& physical_shape() const { return batch_ ? batch_->physical : shape_; }
  // Internal (batching rules): the whole buffer as one unbatched array (same buffer and graph node).
  // For a repeated array, a copy per example linked to its node.
  Array physical() const;
  // A batched array whose buffer holds one example shared by all (see detail::BatchInfo::repeated).
  bool repeated() const { return batch_ != nullptr && batch_->repeated; }
  // Internal: that one example, unbatched, without graph node (fast paths of batching rules).
  Array repeated_example() const;
  // Internal: `example` (unbatched) as the same value for every example of `levels`, no copy.
  static Array repeated_view(const Array& example, std::span<const BatchLevel> levels);
  // Internal: `physical`, whose leading axes are `levels` (sorted by id, sizes matching), as a
  // batched array (same buffer and graph node). No levels: `physical` itself.
  static Array batched_view(const Array& physical, std::span<const BatchLevel> levels);

  // --- autodiff plumbing (see core/autodiff/graph.hpp) -----------------------------------------
  const std::shared_ptr<autodiff::Node>& node() const { return node_; }
  std::uint32_t output_index() const { return output_index_; }
  // Attaches this array to output `index` of `node`, which learns the output's dtype (gradients
  // are delivered in the dtype of the value they belong to).
  void set_node(std::shared_ptr<autodiff::Node> node, std::uint32_t index);

 private:
  void check_dtype(DType want, const char* where) const;
  const void* batched_raw() const;
  void refuse_batched_write(const char* where) const;

  Shape shape_;
  DType dtype_ = DType::f32;
  bool weak_ = false;
  std::shared_ptr<Buffer> buffer_;
  std::shared_ptr<autodiff::Node> node_;
  std::uint32_t output_index_ = 0;
  std::shared_ptr<const detail::BatchInfo> batch_;  // null unless batched (vmap)
};

std::ostream& operator<<(std::ostream& os, const Array& a);

namespace detail {
// A float array (f32 or bf16) in the other float dtype, rounded to nearest even, without a graph
// node: the conversion the kernels and the tape use inside their own computations. The
// differentiable conversion is ops::astype.
Array convert_float(const Array& x, DType dtype);
}  // namespace detail

}  // namespace linum
