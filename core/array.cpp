#include <linum/core/array.hpp>
#include <linum/core/fp_mode.hpp>
#include <linum/core/memory.hpp>
#include <linum/core/threading.hpp>

#include <algorithm>
#include <atomic>
#include <new>
#include <cmath>
#include <iomanip>
#include <ostream>
#include <sstream>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace linum {

Buffer::Buffer(std::size_t bytes) : data_(memory::detail::allocate(bytes)), bytes_(bytes) {}
// (Reading the parent's data marks an elided parent as read: making a view of it is a read.)
Buffer::Buffer(std::shared_ptr<Buffer> parent, std::size_t offset, std::size_t bytes)
    : data_(static_cast<char*>(parent->data()) + offset), bytes_(bytes), parent_(std::move(parent)) {}
Buffer::~Buffer() {
  if (!parent_) memory::detail::deallocate(data_, bytes_);
}

Array Array::elided_placeholder(const Shape& shape, DType dtype, std::shared_ptr<std::atomic<bool>> read_flag) {
  Array a = empty(shape, dtype);
  if (a.buffer_) a.buffer_->mark_elided(std::move(read_flag));
  return a;
}

Array Array::empty(const Shape& shape, DType dtype) {
  detail::enter_compute();  // every op allocates its output first: the calling thread's FP mode is set here
  Array a;
  a.shape_ = shape;
  a.dtype_ = dtype;
  const std::int64_t n = shape.numel();
  std::int64_t bytes = 0;
  if (__builtin_mul_overflow(n, static_cast<std::int64_t>(dtype_size(dtype)), &bytes) || bytes > (std::int64_t{1} << 56))
    throw ShapeError(detail::cat("Array: an array of shape ", shape, " and dtype ", dtype_name(dtype), " would need ",
                                 static_cast<double>(n) * static_cast<double>(dtype_size(dtype)),
                                 " bytes; that is more memory than any machine has (the op or the shapes are wrong)"));
  try {
    a.buffer_ = std::make_shared<Buffer>(static_cast<std::size_t>(bytes));
  } catch (const memory::detail::LiveLimitExceeded&) {
    throw MemoryError(detail::cat("Array: allocating ", bytes, " bytes for an array of shape ", shape, " (",
                                  dtype_name(dtype), ") would take live array bytes from ", memory::stats().live_bytes,
                                  " above the limit of ", memory::live_limit(),
                                  " set with memory::set_live_limit (raise the limit, or remat more)"));
  } catch (const std::bad_alloc&) {
    throw MemoryError(detail::cat("Array: out of memory allocating ", bytes, " bytes for an array of shape ", shape, " (",
                                  dtype_name(dtype), "); live array bytes: ", memory::stats().live_bytes));
  }
  return a;
}

Array Array::zeros(const Shape& shape, DType dtype) {
  Array a = empty(shape, dtype);
  std::memset(a.buffer_->data(), 0, a.nbytes());
  return a;
}

Array Array::full(const Shape& shape, float value, DType dtype) {
  if (dtype == DType::i32)
    throw ValueError("Array::full: needs a float dtype (float32 or bfloat16); use full_i32 for int32 arrays");
  Array a = empty(shape, dtype);
  if (dtype == DType::bf16)
    std::fill_n(a.mutable_data_bf16(), a.numel(), bfloat16(value));
  else
    std::fill_n(a.mutable_data(), a.numel(), value);
  return a;
}

Array Array::full_i32(const Shape& shape, std::int32_t value) {
  Array a = empty(shape, DType::i32);
  std::fill_n(a.mutable_data_i32(), a.numel(), value);
  return a;
}

Array Array::from(const Shape& shape, std::span<const float> values) {
  if (static_cast<std::int64_t>(values.size()) != shape.numel())
    throw ShapeError(detail::cat("Array::from: shape ", shape, " holds ", shape.numel(), " elements but ",
                                 values.size(), " values were given"));
  Array a = empty(shape);
  std::copy(values.begin(), values.end(), a.mutable_data());
  return a;
}

Array Array::from_i32(const Shape& shape, std::span<const std::int32_t> values) {
  if (static_cast<std::int64_t>(values.size()) != shape.numel())
    throw ShapeError(detail::cat("Array::from_i32: shape ", shape, " holds ", shape.numel(), " elements but ",
                                 values.size(), " values were given"));
  Array a = empty(shape, DType::i32);
  std::copy(values.begin(), values.end(), a.mutable_data_i32());
  return a;
}

Array Array::arange(std::int64_t n) {
  Array a = empty(Shape{n});
  float* p = a.mutable_data();
  for (std::int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(i);
  return a;
}

float* Array::mutable_data() {
  check_dtype(DType::f32, "Array::mutable_data");
  if (batch_) [[unlikely]] refuse_batched_write("Array::mutable_data");
  return static_cast<float*>(buffer_->data());
}

std::int32_t* Array::mutable_data_i32() {
  check_dtype(DType::i32, "Array::mutable_data_i32");
  if (batch_) [[unlikely]] refuse_batched_write("Array::mutable_data_i32");
  return static_cast<std::int32_t*>(buffer_->data());
}

bfloat16* Array::mutable_data_bf16() {
  check_dtype(DType::bf16, "Array::mutable_data_bf16");
  if (batch_) [[unlikely]] refuse_batched_write("Array::mutable_data_bf16");
  return static_cast<bfloat16*>(buffer_->data());
}

void* Array::mutable_raw() {
  if (!defined()) throw ValueError("Array::mutable_raw: the array is undefined");
  if (batch_) [[unlikely]] refuse_batched_write("Array::mutable_raw");
  return buffer_->data();
}

std::vector<float> Array::to_vector() const {
  if (defined() && dtype_ == DType::bf16) {
    std::vector<float> out(static_cast<std::size_t>(numel()));
    bf16_to_f32(data_bf16(), out.data(), numel());
    return out;
  }
  const float* p = data();
  return {p, p + numel()};
}

std::vector<std::int32_t> Array::to_vector_i32() const {
  const std::int32_t* p = data_i32();
  return {p, p + numel()};
}

float Array::item() const {
  if (!defined() || numel() != 1)
    throw ShapeError(detail::cat("Array::item: needs an array with exactly one element, got shape ",
                                 defined() ? shape_.str() : std::string("<undefined>")));
  if (dtype_ == DType::bf16) return static_cast<float>(data_bf16()[0]);
  return dtype_ == DType::f32 ? data()[0] : static_cast<float>(data_i32()[0]);
}

bool Array::bitwise_equal(const Array& other) const {
  if (!defined() || !other.defined()) return false;
  if (!(shape_ == other.shape_) || dtype_ != other.dtype_) return false;
  return std::memcmp(raw(), other.raw(), nbytes()) == 0;
}

Array Array::with_shape(const Shape& shape) const {
  if (batch_) [[unlikely]]
    throw BatchingError(detail::cat("Array::with_shape: cannot view a batched array (", type_str(), " per example, ",
                                    batch_->physical.str(), " in all) as shape ", shape,
                                    " inside vmap: use reshape, which has a batching rule"));
  if (shape.numel() != numel())
    throw ShapeError(detail::cat("Array::with_shape: cannot view an array of shape ", shape_, " (", numel(),
                                 " elements) as shape ", shape, " (", shape.numel(), " elements)"));
  Array a = detached();
  a.shape_ = shape;
  return a;
}

Array Array::part_view(std::int64_t offset, const Shape& shape) const {
  if (batch_) [[unlikely]]
    throw BatchingError(detail::cat("Array::part_view: cannot view part of a batched array (", type_str(), ") inside vmap"));
  if (!buffer_ || offset < 0 || offset + shape.numel() > numel() || !is_aligned_offset(offset))
    throw ShapeError(detail::cat("Array::part_view: ", shape.numel(), " elements from element ", offset, " of an array of shape ",
                                 shape_, " (", dtype_name(dtype_), ") are not a 64-byte aligned part of it"));
  Array a;
  a.shape_ = shape;
  a.dtype_ = dtype_;
  const std::size_t size = dtype_size(dtype_);
  a.buffer_ = std::make_shared<Buffer>(buffer_, static_cast<std::size_t>(offset) * size,
                                       static_cast<std::size_t>(shape.numel()) * size);
  return a;
}

std::span<const BatchLevel> Array::batch_levels() const {
  if (!batch_) return {};
  return batch_->levels;
}

namespace {
std::atomic<detail::MaterializeRepeated> g_materialize_repeated{nullptr};
}  // namespace

void detail::set_materialize_repeated(MaterializeRepeated fn) { g_materialize_repeated.store(fn, std::memory_order_relaxed); }

Array Array::repeated_example() const {
  if (!repeated()) throw BatchingError("Array::repeated_example: the array is not a repeated batched array");
  Array a = *this;
  a.batch_.reset();
  a.node_.reset();
  a.output_index_ = 0;
  return a;
}

Array Array::repeated_view(const Array& example, std::span<const BatchLevel> levels) {
  if (example.batch_) throw BatchingError("Array::repeated_view: the example must not be batched");
  if (levels.empty()) return example;
  std::vector<std::int64_t> dims;
  for (const BatchLevel& l : levels) dims.push_back(l.size);
  for (int i = 0; i < example.rank(); ++i) dims.push_back(example.dim(i));
  if (static_cast<int>(dims.size()) > Shape::kMaxRank)
    throw BatchingError(detail::cat("vmap: ", levels.size(), " batch levels on an array of rank ", example.rank(),
                                    " exceed the ", Shape::kMaxRank, " axes an array can have"));
  Array a = example.detached();
  a.batch_ = std::make_shared<const detail::BatchInfo>(detail::BatchInfo{Shape(dims), {levels.begin(), levels.end()}, true});
  return a;
}

Array Array::physical() const {
  if (!batch_) return *this;
  if (batch_->repeated) {
    const detail::MaterializeRepeated materialize = g_materialize_repeated.load(std::memory_order_relaxed);
    if (materialize == nullptr) throw BatchingError("Array::physical: no materializer for repeated arrays");
    return materialize(*this);
  }
  Array a = *this;
  a.shape_ = batch_->physical;
  a.batch_.reset();
  return a;
}

Array Array::batched_view(const Array& physical, std::span<const BatchLevel> levels) {
  if (physical.batch_)
    throw BatchingError("Array::batched_view: the physical array is itself batched (take physical() first)");
  if (levels.empty()) return physical;
  const int n = static_cast<int>(levels.size());
  if (physical.rank() < n)
    throw BatchingError(detail::cat("Array::batched_view: ", physical.type_str(), " has fewer axes than the ", n,
                                    " batch levels it should lead with"));
  std::vector<std::int64_t> example;
  for (int i = 0; i < n; ++i) {
    if (physical.dim(i) != levels[static_cast<std::size_t>(i)].size)
      throw BatchingError(detail::cat("Array::batched_view: axis ", i, " of ", physical.type_str(), " has ",
                                      physical.dim(i), " entries but its batch level has ",
                                      levels[static_cast<std::size_t>(i)].size, " examples"));
    if (i > 0 && levels[static_cast<std::size_t>(i)].id <= levels[static_cast<std::size_t>(i - 1)].id)
      throw BatchingError("Array::batched_view: batch levels must be sorted by id");
  }
  for (int i = n; i < physical.rank(); ++i) example.push_back(physical.dim(i));
  Array a = physical;
  a.shape_ = Shape(example);
  a.batch_ = std::make_shared<const detail::BatchInfo>(detail::BatchInfo{physical.shape_, {levels.begin(), levels.end()}, false});
  return a;
}

const void* Array::batched_raw() const {
  if (!buffer_) return nullptr;
  if (batch_->repeated) return buffer_->data();  // every example alike: its one value may be read
  const auto* cursor = detail::BatchCursor::top();
  if (cursor == nullptr)
    throw BatchingError(detail::cat(
        "a batched array (", type_str(), " per example, ", batch_->physical.str(),
        " in all) was read as one value inside vmap: item(), to_vector(), data() and the kernels of ops without a "
        "batching rule need one value, but this one differs per example. Compute with ops (which batch), or "
        "read the value after vmap returns"));
  // Offset of the cursor's example: row-major over this array's own levels.
  std::int64_t flat = 0;
  for (const BatchLevel& level : batch_->levels) {
    std::int64_t idx = -1;
    for (std::size_t i = 0; i < cursor->levels.size(); ++i)
      if (cursor->levels[i].id == level.id) idx = cursor->index[i];
    if (idx < 0)
      throw BatchingError(detail::cat("a batched array (", type_str(),
                                      ") of a vmap level the op's loop does not cover was read by a kernel: an op "
                                      "without a batching rule reads an array it was not given as an input"));
    flat = flat * level.size + idx;
  }
  return static_cast<const char*>(buffer_->data()) + flat * static_cast<std::int64_t>(nbytes());
}

void Array::refuse_batched_write(const char* where) const {
  throw BatchingError(detail::cat(where, ": cannot write into a batched array (", type_str(),
                                  " per example): arrays are written only by the op that creates them"));
}

void Array::check_dtype(DType want, const char* where) const {
  if (!defined())
    throw ValueError(detail::cat(where, ": the array is undefined (default-constructed); create it with "
                                        "Array::zeros, Array::from or an op first"));
  if (dtype_ != want)
    throw ShapeError(detail::cat(where, ": needs a ", dtype_name(want), " array, got ", dtype_name(dtype_),
                                 shape_.str()));
}

std::string Array::type_str() const {
  if (!defined()) return "<undefined>";
  std::string s = std::string(dtype_short_name(dtype_)) + "[";
  for (int i = 0; i < shape_.rank(); ++i) {
    if (i) s += ',';
    s += std::to_string(shape_[i]);
  }
  return s + "]";
}

std::string Array::str() const {
  std::ostringstream os;
  os << *this;
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const Array& a) {
  if (!a.defined()) return os << "Array(<undefined>)";
  if (a.batched()) return os << "Array(" << dtype_name(a.dtype()) << a.shape().str() << " per example, batched as "
                             << a.physical_shape().str() << ")";
  os << "Array(" << dtype_name(a.dtype()) << a.shape().str();
  if (a.numel() <= 16) {
    os << ", [";
    for (std::int64_t i = 0; i < a.numel(); ++i) {
      if (i) os << ", ";
      if (a.dtype() == DType::f32)
        os << std::setprecision(9) << a.data()[i];
      else if (a.dtype() == DType::bf16)
        os << std::setprecision(4) << static_cast<float>(a.data_bf16()[i]);
      else
        os << a.data_i32()[i];
    }
    os << "]";
  }
  return os << ")";
}

namespace {
// (The parallel threshold is unused in a build without OpenMP.)
constexpr std::int64_t kConvertPiece = 1 << 15;
[[maybe_unused]] constexpr std::int64_t kParallelConvertElements = 1 << 18;
}  // namespace

Array detail::convert_float(const Array& x, DType dtype) {
  if (!x.defined() || !is_floating(x.dtype()) || !is_floating(dtype))
    throw ValueError(cat("convert_float: needs a float array and a float dtype, got ", x.type_str(), " to ", dtype_name(dtype)));
  if (x.dtype() == dtype) return x.detached();
  Array out = Array::empty(x.shape(), dtype);
  // Large arrays in pieces across the team (each element converted alone: the same bits on any
  // team). On AVX2 CPUs, where the bf16 products widen their operands (kernels/gemm_onednn.cpp),
  // the bf16 MLP step converted three [2048, 512] arrays per product on one thread while the other
  // waited.
  const std::int64_t n = x.numel(), pieces = (n + kConvertPiece - 1) / kConvertPiece;
  [[maybe_unused]] int threads = 1;
#ifdef _OPENMP
  if (n >= kParallelConvertElements && !omp_in_parallel()) threads = team_size();
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
#endif
  for (std::int64_t p = 0; p < pieces; ++p) {
    enter_compute();
    const std::int64_t i = p * kConvertPiece, count = std::min(kConvertPiece, n - i);
    if (dtype == DType::bf16) f32_to_bf16(x.data() + i, out.mutable_data_bf16() + i, count);
    else bf16_to_f32(x.data_bf16() + i, out.mutable_data() + i, count);
  }
  return out;
}

}  // namespace linum
