#include <linum/core/autodiff/batching.hpp>
#include <linum/core/autodiff/primitive.hpp>
#include <linum/core/warnings.hpp>

#include <algorithm>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <cstring>
#include <mutex>
#include <set>
#include <string>

namespace linum::autodiff {
namespace {

using linum::detail::cat;

std::int64_t count_of(std::span<const BatchLevel> levels) {
  std::int64_t n = 1;
  for (const BatchLevel& l : levels) n *= l.size;
  return n;
}

// For each example of `outer` (row-major), the index of the example of `inner` (a subsequence of
// `outer`'s levels) it belongs to.
std::vector<std::int64_t> example_map(std::span<const BatchLevel> outer, std::span<const BatchLevel> inner) {
  const std::int64_t total = count_of(outer);
  std::vector<std::int64_t> map(static_cast<std::size_t>(total));
  std::vector<std::int64_t> index(outer.size(), 0);
  for (std::int64_t n = 0; n < total; ++n) {
    std::int64_t rem = n;
    for (std::size_t l = outer.size(); l-- > 0;) {
      index[l] = rem % outer[l].size;
      rem /= outer[l].size;
    }
    std::int64_t flat = 0;
    for (const BatchLevel& own : inner)
      for (std::size_t l = 0; l < outer.size(); ++l)
        if (outer[l].id == own.id) flat = flat * own.size + index[l];
    map[static_cast<std::size_t>(n)] = flat;
  }
  return map;
}

bool is_subsequence(std::span<const BatchLevel> inner, std::span<const BatchLevel> outer) {
  std::size_t j = 0;
  for (const BatchLevel& l : outer)
    if (j < inner.size() && inner[j] == l) ++j;
  return j == inner.size();
}

Shape physical_shape_of(std::span<const BatchLevel> levels, const Shape& example) {
  std::vector<std::int64_t> dims;
  for (const BatchLevel& l : levels) dims.push_back(l.size);
  for (int i = 0; i < example.rank(); ++i) dims.push_back(example[i]);
  if (static_cast<int>(dims.size()) > Shape::kMaxRank)
    throw BatchingError(cat("vmap: ", levels.size(), " batch levels on an array of rank ", example.rank(),
                            " make rank ", dims.size(), ", above the ", Shape::kMaxRank, " axes an array can have"));
  return Shape(dims);
}

// Physical copy: out example n = x example map[n] (x unbatched physical, `per` elements per example).
Array repeat_examples(const Array& x_phys, const Shape& out_shape, const std::vector<std::int64_t>& map, std::int64_t per) {
  Array out = Array::empty(out_shape, x_phys.dtype());
  const std::size_t bytes = static_cast<std::size_t>(per) * dtype_size(x_phys.dtype());
  const auto* src = static_cast<const char*>(x_phys.raw());
  auto* dst = static_cast<char*>(out.mutable_raw());
  for (std::size_t n = 0; n < map.size(); ++n)
    if (bytes != 0) std::memcpy(dst + n * bytes, src + static_cast<std::size_t>(map[n]) * bytes, bytes);
  return out;
}

// Physical sum: out example k = sum of x examples n with map[n] == k, in order of n (float32 sums,
// rounded once for bf16).
Array sum_examples(const Array& x_phys, const Shape& out_shape, const std::vector<std::int64_t>& map, std::int64_t per) {
  if (!is_floating(x_phys.dtype()))
    throw BatchingError(cat("vmap: cannot sum the examples of a ", x_phys.type_str(), " array (not a float)"));
  std::vector<float> acc(static_cast<std::size_t>(out_shape.numel()), 0.0f);
  std::vector<float> row(static_cast<std::size_t>(per));
  for (std::size_t n = 0; n < map.size(); ++n) {
    const float* src;
    if (x_phys.dtype() == DType::bf16) {
      const bfloat16* b = x_phys.data_bf16() + static_cast<std::int64_t>(n) * per;
      for (std::int64_t i = 0; i < per; ++i) row[static_cast<std::size_t>(i)] = static_cast<float>(b[i]);
      src = row.data();
    } else {
      src = x_phys.data() + static_cast<std::int64_t>(n) * per;
    }
    float* dst = acc.data() + map[n] * per;
    for (std::int64_t i = 0; i < per; ++i) dst[i] += src[i];
  }
  Array out = Array::from(out_shape, acc);
  return x_phys.dtype() == DType::f32 ? out : linum::detail::convert_float(out, x_phys.dtype());
}

Array sum_levels_physical(const Array& x_phys, std::vector<BatchLevel> from, std::vector<BatchLevel> keep, Shape example);

// The physical array of x (batched at `from`) repeated to `to`.
Array broadcast_levels_physical(const Array& x_phys, std::vector<BatchLevel> from, std::vector<BatchLevel> to, Shape example) {
  const Shape out_shape = physical_shape_of(to, example);
  return primitive(
      "broadcast_levels", {&x_phys},
      [&](Residuals&) { return repeat_examples(x_phys, out_shape, example_map(to, from), example.numel()); },
      higher_order([from, to, example](Cotangents& c, Saved) {
        c.set(0, sum_levels_physical(c.out(), to, from, example));
      }));
}

Array sum_levels_physical(const Array& x_phys, std::vector<BatchLevel> from, std::vector<BatchLevel> keep, Shape example) {
  const Shape out_shape = physical_shape_of(keep, example);
  return primitive(
      "sum_levels", {&x_phys},
      [&](Residuals&) { return sum_examples(x_phys, out_shape, example_map(from, keep), example.numel()); },
      higher_order([from, keep, example](Cotangents& c, Saved) {
        c.set(0, broadcast_levels_physical(c.out(), keep, from, example));
      }));
}

Array unstack_physical_one(const Array& x_phys, std::int64_t n, const Shape& example) {
  Array out = Array::empty(example, x_phys.dtype());
  const std::size_t bytes = static_cast<std::size_t>(example.numel()) * dtype_size(x_phys.dtype());
  if (bytes != 0) std::memcpy(out.mutable_raw(), static_cast<const char*>(x_phys.raw()) + static_cast<std::size_t>(n) * bytes, bytes);
  return out;
}

std::vector<Array> unstack_physical(const Array& x_phys, std::vector<BatchLevel> levels, Shape example);

Array stack_physical(const std::vector<Array>& xs, std::vector<BatchLevel> levels, Shape example, DType dtype) {
  std::vector<const Array*> ins;
  ins.reserve(xs.size());
  for (const Array& x : xs) ins.push_back(&x);
  std::vector<Array> out = primitive_multi(
      "stack_examples", std::span<const Array* const>(ins),
      [&](Residuals&) {
        Array o = Array::empty(physical_shape_of(levels, example), dtype);
        const std::size_t bytes = static_cast<std::size_t>(example.numel()) * dtype_size(dtype);
        auto* dst = static_cast<char*>(o.mutable_raw());
        for (std::size_t n = 0; n < xs.size(); ++n)
          if (bytes != 0) std::memcpy(dst + n * bytes, xs[n].raw(), bytes);
        return std::vector<Array>{o};
      },
      higher_order([levels, example](Cotangents& c, Saved) {
        std::vector<Array> parts = unstack_physical(c.out(), levels, example);
        for (std::size_t i = 0; i < parts.size(); ++i)
          if (c.needs(i)) c.set(i, parts[i]);
      }));
  return out.at(0);
}

std::vector<Array> unstack_physical(const Array& x_phys, std::vector<BatchLevel> levels, Shape example) {
  const Array* in[] = {&x_phys};
  return primitive_multi(
      "unstack_examples", std::span<const Array* const>(in),
      [&](Residuals&) {
        std::vector<Array> parts;
        const std::int64_t total = count_of(levels);
        parts.reserve(static_cast<std::size_t>(total));
        for (std::int64_t n = 0; n < total; ++n) parts.push_back(unstack_physical_one(x_phys, n, example));
        return parts;
      },
      higher_order([levels, example, dtype = x_phys.dtype()](Cotangents& c, Saved) {
        std::vector<Array> parts;
        for (std::size_t i = 0; i < c.num_outputs(); ++i)
          parts.push_back(c.out(i).defined() ? c.out(i)
                          : creating_graph()   ? Array()
                                               : Array::zeros(example, dtype));
        if (creating_graph()) {
          // Missing cotangents as zeros linked to a present one (the sum stays a function of them).
          Array any;
          for (const Array& p : parts)
            if (p.defined()) any = p;
          for (Array& p : parts)
            if (!p.defined()) p = linked_zeros(any);
        }
        c.set(0, stack_physical(parts, levels, example, dtype));
      }));
}

// A repeated array's physical array: its one example copied per example, linked to the array's
// node (a leaf of per-example gradients, whose node has the physical shape) by the identity.
Array materialize_repeated(const Array& x) {
  Array handle = x.repeated_example();  // the example's data; the edge below is the array's own node
  if (x.node() != nullptr) handle.set_node(x.node(), x.output_index());
  const std::vector<BatchLevel> levels(x.batch_levels().begin(), x.batch_levels().end());
  const Shape physical = x.physical_shape();
  return primitive(
      "materialize_levels", {&handle},
      [&](Residuals&) {
        std::vector<std::int64_t> map(static_cast<std::size_t>(count_of(levels)), 0);
        return repeat_examples(handle, physical, map, handle.numel());
      },
      higher_order([](Cotangents& c, Saved) { c.set(0, c.out()); }));
}

struct RegisterMaterializer {
  RegisterMaterializer() { linum::detail::set_materialize_repeated(&materialize_repeated); }
} g_register_materializer;

}  // namespace

std::vector<BatchLevel> union_levels(std::span<const Array* const> arrays, const char* op) {
  std::vector<BatchLevel> levels;
  for (const Array* a : arrays)
    for (const BatchLevel& l : a->batch_levels()) {
      auto it = std::find_if(levels.begin(), levels.end(), [&](const BatchLevel& k) { return k.id == l.id; });
      if (it == levels.end()) {
        levels.push_back(l);
      } else if (it->size != l.size) {
        throw BatchingError(cat(op, ": inputs batched over the same vmap level with ", it->size, " and ", l.size,
                                " examples"));
      }
    }
  std::sort(levels.begin(), levels.end(), [](const BatchLevel& a, const BatchLevel& b) { return a.id < b.id; });
  return levels;
}

Array broadcast_levels(const Array& x, std::span<const BatchLevel> levels) {
  const std::span<const BatchLevel> own = x.batch_levels();
  if (own.size() == levels.size()) {
    if (!std::equal(own.begin(), own.end(), levels.begin()))
      throw BatchingError("vmap: an array batched over other levels than the ones it is broadcast to");
    return x;
  }
  if (!is_subsequence(own, levels))
    throw BatchingError("vmap: an array batched over levels that are not open here (a value escaped the vmap that "
                        "made it?)");
  std::vector<BatchLevel> from(own.begin(), own.end()), to(levels.begin(), levels.end());
  return Array::batched_view(broadcast_levels_physical(x.physical(), from, to, x.shape()), levels);
}

Array sum_levels(const Array& x, std::span<const BatchLevel> keep) {
  const std::span<const BatchLevel> own = x.batch_levels();
  if (own.size() == keep.size()) return x;
  if (!is_subsequence(keep, own)) throw BatchingError("vmap: sum_levels keeps levels the array is not batched over");
  std::vector<BatchLevel> from(own.begin(), own.end()), to(keep.begin(), keep.end());
  return Array::batched_view(sum_levels_physical(x.physical(), from, to, x.shape()), keep);
}

Array physical_cotangent(const Array& root, const Array& ct) {
  if (!root.batched() && !ct.batched()) return ct;
  for (const BatchLevel& l : ct.batch_levels())
    if (std::find(root.batch_levels().begin(), root.batch_levels().end(), l) == root.batch_levels().end())
      throw BatchingError(cat("backward: the cotangent (", ct.type_str(), ") is batched over a vmap level the output (",
                              root.type_str(), ") is not; differentiate inside the vmap instead"));
  return broadcast_levels(ct, root.batch_levels()).physical();
}

Array to_open_levels(const Array& x) {
  if (!x.defined()) return x;
  const std::vector<BatchLevel> open = linum::detail::open_batch_levels();
  if (open.empty() || (x.batch_levels().size() == open.size())) return x;
  std::vector<const Array*> one{&x};
  std::vector<BatchLevel> all = union_levels(one, "vmap");
  for (const BatchLevel& l : open)
    if (std::find(all.begin(), all.end(), l) == all.end()) all.push_back(l);
  std::sort(all.begin(), all.end(), [](const BatchLevel& a, const BatchLevel& b) { return a.id < b.id; });
  // A fresh value (no graph node) is repeated without a copy: ops with a fast path read its one
  // example (a Dense's kernel: one product, per-example gradients from one batched product), the
  // others copy it when they need it batched.
  if (!x.batched() && x.node() == nullptr) return Array::repeated_view(x, all);
  return broadcast_levels(x, all);
}

namespace detail {

std::vector<Array> unstack_examples(const Array& x) {
  std::vector<BatchLevel> levels(x.batch_levels().begin(), x.batch_levels().end());
  return unstack_physical(x.physical(), levels, x.shape());
}

Array stack_examples(const std::vector<Array>& examples, std::span<const BatchLevel> levels) {
  if (examples.empty()) throw BatchingError("vmap: no examples to stack");
  const Shape example = examples[0].shape();
  for (const Array& e : examples)
    if (!(e.shape() == example) || e.dtype() != examples[0].dtype())
      throw BatchingError(cat("vmap: an op without a batching rule gave examples of different types (",
                              examples[0].type_str(), " and ", e.type_str(), "); it cannot be batched"));
  std::vector<BatchLevel> lv(levels.begin(), levels.end());
  return Array::batched_view(stack_physical(examples, lv, example, examples[0].dtype()), levels);
}

Array copy_current_example(const Array& x) {
  Array out = Array::empty(x.shape(), x.dtype());
  if (x.nbytes() != 0) std::memcpy(out.mutable_raw(), x.raw(), x.nbytes());
  return out;
}

#ifdef _OPENMP
SerialScope::SerialScope() : previous_(omp_get_max_threads()) { omp_set_num_threads(1); }
SerialScope::~SerialScope() { omp_set_num_threads(previous_); }
#else
SerialScope::SerialScope() : previous_(1) {}
SerialScope::~SerialScope() = default;
#endif

void report_loop(const char* op, std::int64_t examples) {
  static std::mutex mutex;
  static std::set<std::string> reported;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (!reported.insert(op).second) return;
  }
  warn(cat("vmap: op '", op, "' has no batching rule; it runs once per example (", examples,
           " here) and its results are stacked: correct, but slower than a batched op"));
}

}  // namespace detail
}  // namespace linum::autodiff
