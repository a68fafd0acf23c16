// Data-movement ops. They share one strided-copy kernel: every output element reads
// x[base + sum_i idx_i * stride_i], with per-axis strides that express transposes, slices and
// broadcasts.
#include <linum/core/fp_mode.hpp>
#include <linum/core/threading.hpp>
#include <linum/core/autodiff/primitive.hpp>
#include <linum/core/ops/batching.hpp>
#include <linum/core/ops/shape_ops.hpp>
#include <linum/core/ops/elementwise.hpp>
#include <linum/core/ops/kernel_util.hpp>
#include <linum/core/ops/reduce.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

namespace linum {
namespace {

using autodiff::Cotangents;
using autodiff::Residuals;
using autodiff::primitive;
using Strides = std::array<std::int64_t, Shape::kMaxRank>;

// Visits every output row (all axes but the last) and calls f(out_offset, in_offset).
template <class F>
void for_rows(const Shape& out, const Strides& in_strides, std::int64_t base, F f) {
  const int rank = out.rank();
  if (rank == 0) { f(std::int64_t{0}, base); return; }
  const std::int64_t inner = out[rank - 1];
  const std::int64_t rows = inner == 0 ? 0 : out.numel() / inner;
  auto row = [&](std::int64_t r) {
    std::int64_t rem = r, off = base;
    for (int d = rank - 2; d >= 0; --d) {
      off += (rem % out[d]) * in_strides[d];
      rem /= out[d];
    }
    f(r * inner, off);
  };
  ops::detail::for_items(rows, out.numel(), row);
}

// The gather of a transpose of the last two axes (the output's rows run along the input's
// contiguous axis: s[rank - 2] == 1, its columns along a strided one), in square tiles: row by row,
// every element of an output row would come from another input row, one cache line per element,
// and a [2048, 512] bf16 transpose took 0.8 ms; a tile reads kTile consecutive input elements per
// column and writes kTile consecutive output elements per row.
template <class T>
void transpose_tiles(const T* px, T* po, const Shape& out, const Strides& s, std::int64_t base) {
  constexpr std::int64_t kTile = 32;
  const int rank = out.rank();
  const std::int64_t cols = out[rank - 1], rows = out[rank - 2];
  if (cols == 0 || rows == 0) return;
  const std::int64_t outer = out.numel() / (rows * cols), step = s[rank - 1];
  const std::int64_t row_tiles = (rows + kTile - 1) / kTile, items = outer * row_tiles;
  auto tile_rows = [&](std::int64_t item) {
    const std::int64_t o = item / row_tiles, r0 = (item % row_tiles) * kTile, r1 = std::min(rows, r0 + kTile);
    std::int64_t off = base, rem = o;  // the input offset of outer index o (axes 0 .. rank - 3)
    for (int d = rank - 3; d >= 0; --d) {
      off += (rem % out[d]) * s[d];
      rem /= out[d];
    }
    T* dst = po + o * rows * cols;
    for (std::int64_t c0 = 0; c0 < cols; c0 += kTile) {
      const std::int64_t c1 = std::min(cols, c0 + kTile);
      for (std::int64_t r = r0; r < r1; ++r)
        for (std::int64_t c = c0; c < c1; ++c) dst[r * cols + c] = px[off + r + c * step];
    }
  };
  ops::detail::for_items(items, out.numel(), tile_rows);
}

template <class T>
Array strided_gather(const Array& x, const Shape& out_shape, const Strides& s, std::int64_t base) {
  Array out = Array::empty(out_shape, x.dtype());
  const T* px = static_cast<const T*>(x.raw());
  T* po = static_cast<T*>(const_cast<void*>(out.raw()));
  const int rank = out_shape.rank();
  const std::int64_t inner = rank ? out_shape[rank - 1] : 1;
  const std::int64_t step = rank ? s[rank - 1] : 0;
  if (rank >= 2 && s[rank - 2] == 1 && step != 1 && step != 0 && out_shape[rank - 2] > 1) {
    transpose_tiles(px, po, out_shape, s, base);
    return out;
  }
  for_rows(out_shape, s, base, [&](std::int64_t o, std::int64_t i) {
    if (step == 1) std::memcpy(po + o, px + i, static_cast<std::size_t>(inner) * sizeof(T));
    else if (step == 0) std::fill(po + o, po + o + inner, px[i]);  // (a broadcast row: one value, read once)
    else for (std::int64_t j = 0; j < inner; ++j) po[o + j] = px[i + j * step];
  });
  return out;
}

// Data movement only: elements are copied as bit patterns of their size.
Array gather(const Array& x, const Shape& out_shape, const Strides& s, std::int64_t base) {
  return dtype_size(x.dtype()) == 2 ? strided_gather<std::uint16_t>(x, out_shape, s, base)
                                    : strided_gather<std::uint32_t>(x, out_shape, s, base);
}

// dest[base + idx . s] = src[idx] (dest is freshly allocated; the mapping is injective).
template <class T>
void strided_scatter_as(Array& dest, const Array& src, const Strides& s, std::int64_t base) {
  const T* ps = static_cast<const T*>(src.raw());
  T* pd = static_cast<T*>(dest.mutable_raw());
  const int rank = src.rank();
  const std::int64_t inner = rank ? src.shape()[rank - 1] : 1;
  const std::int64_t step = rank ? s[rank - 1] : 0;
  for_rows(src.shape(), s, base, [&](std::int64_t o, std::int64_t i) {
    for (std::int64_t j = 0; j < inner; ++j) pd[i + j * step] = ps[o + j];
  });
}

void strided_scatter(Array& dest, const Array& src, const Strides& s, std::int64_t base) {
  if (dtype_size(src.dtype()) == 2) strided_scatter_as<std::uint16_t>(dest, src, s, base);
  else strided_scatter_as<std::uint32_t>(dest, src, s, base);
}

std::string vec_str(const std::vector<std::int64_t>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// A strided gather (out[idx] = x[base + idx . s]) and the scatter into zeros that is its transpose,
// as primitives whose rules are each other: slice and dilate are these, and create-graph mode
// differentiates them to any order.
Array scatter_op(const char* op, const Array& x, const Shape& out, const Strides& s, std::int64_t base);

Array gather_op(const char* op, const Array& x, const Shape& out, const Strides& s, std::int64_t base) {
  return primitive(op, {&x}, [&](Residuals&) { return gather(x, out, s, base); },
                   autodiff::higher_order([xshape = x.shape(), s, base](Cotangents& c, autodiff::Saved) {
                     if (autodiff::creating_graph()) return c.set(0, scatter_op("pad", c.out(), xshape, s, base));
                     Array g = Array::zeros(xshape, c.out().dtype());
                     strided_scatter(g, c.out(), s, base);
                     c.set(0, g);
                   }));
}

Array scatter_op(const char* op, const Array& x, const Shape& out, const Strides& s, std::int64_t base) {
  return primitive(op, {&x},
                   [&](Residuals&) {
                     Array y = Array::zeros(out, x.dtype());
                     if (x.numel() > 0) strided_scatter(y, x, s, base);
                     return y;
                   },
                   autodiff::higher_order([xshape = x.shape(), s, base](Cotangents& c, autodiff::Saved) {
                     // the cotangent at the elements x was placed on
                     if (autodiff::creating_graph()) return c.set(0, gather_op("slice", c.out(), xshape, s, base));
                     c.set(0, gather(c.out(), xshape, s, base));
                   }));
}

}  // namespace

Array ops::detail::broadcast_raw(const Array& x, const Shape& shape) {
  if (x.shape() == shape) return x.detached();
  broadcast_shapes(x.shape(), shape, "broadcast_to");
  if (x.rank() > shape.rank() || !(broadcast_shapes(x.shape(), shape, "broadcast_to") == shape))
    throw ShapeError(linum::detail::cat("broadcast_to: cannot broadcast shape ", x.shape(), " to ", shape));
  Strides s{};
  const auto xs = x.shape().strides();
  const int lead = shape.rank() - x.rank();
  for (int i = 0; i < shape.rank(); ++i) {
    const int ix = i - lead;
    s[i] = (ix >= 0 && x.shape()[ix] == shape[i]) ? xs[ix] : 0;
  }
  return gather(x, shape, s, 0);
}

namespace {
// The physical dims of an example of shape `dims` batched as x is: x's level sizes first.
std::vector<std::int64_t> with_levels(const Array& x, const std::vector<std::int64_t>& dims) {
  std::vector<std::int64_t> out;
  for (const BatchLevel& l : x.batch_levels()) out.push_back(l.size);
  out.insert(out.end(), dims.begin(), dims.end());
  return out;
}
}  // namespace

Array reshape(const Array& x, const std::vector<std::int64_t>& dims) {
  ops::detail::require_defined(x, "reshape");
  std::vector<std::int64_t> d = dims;
  std::int64_t known = 1;
  int infer = -1;
  for (std::size_t i = 0; i < d.size(); ++i) {
    if (d[i] == -1) {
      if (infer >= 0) throw ShapeError(detail::cat("reshape: more than one -1 in ", vec_str(dims)));
      infer = static_cast<int>(i);
    } else if (d[i] < 0) {
      throw ShapeError(detail::cat("reshape: negative dimension in ", vec_str(dims)));
    } else if (__builtin_mul_overflow(known, d[i], &known)) {
      throw ShapeError(detail::cat("reshape: the target shape ", vec_str(dims), " of ", x.shape(),
                                   " has more than 2^63 elements"));
    }
  }
  if (infer >= 0) {
    if (known == 0 || x.numel() % known != 0)
      throw ShapeError(detail::cat("reshape: cannot reshape ", x.shape(), " (", x.numel(), " elements) to ",
                                   vec_str(dims)));
    d[static_cast<std::size_t>(infer)] = x.numel() / known;
  }
  const Shape target(d);
  if (target.numel() != x.numel())
    throw ShapeError(detail::cat("reshape: cannot reshape ", x.shape(), " (", x.numel(), " elements) to ", target,
                                 " (", target.numel(), " elements)"));
  if (x.batched()) [[unlikely]]  // vmap: every example reshaped
    return ops::batching::wrap(reshape(x.physical(), with_levels(x, target.vec())), x.batch_levels());
  if (target == x.shape()) return x;  // nothing to do, nothing recorded (as jax.lax.reshape)
  return primitive("reshape", {&x}, [&](Residuals&) { return x.with_shape(target); },
                   autodiff::higher_order([xs = x.shape()](Cotangents& c, autodiff::Saved) {
                     c.set(0, autodiff::creating_graph() ? reshape(c.out(), xs.vec()) : c.out().with_shape(xs));
                   }));
}

Array transpose(const Array& x, const std::vector<int>& perm_in) {
  ops::detail::require_defined(x, "transpose");
  std::vector<int> perm = perm_in;
  if (perm.empty()) {
    perm.resize(static_cast<std::size_t>(x.rank()));
    std::iota(perm.rbegin(), perm.rend(), 0);
  }
  if (static_cast<int>(perm.size()) != x.rank())
    throw ShapeError(detail::cat("transpose: permutation has ", perm.size(), " axes for an array of shape ", x.shape()));
  std::vector<int> seen(perm.size(), 0);
  for (int& p : perm) {
    if (p < 0) p += x.rank();
    if (p < 0 || p >= x.rank() || seen[static_cast<std::size_t>(p)]++)
      throw ShapeError(detail::cat("transpose: invalid permutation for an array of shape ", x.shape(),
                                   "; give each axis 0..", x.rank() - 1, " exactly once"));
  }
  if (x.batched()) [[unlikely]] {
    const int n = static_cast<int>(x.batch_levels().size());
    std::vector<int> physical(static_cast<std::size_t>(n));
    std::iota(physical.begin(), physical.end(), 0);
    for (int p : perm) physical.push_back(p + n);
    return ops::batching::wrap(transpose(x.physical(), physical), x.batch_levels());
  }
  Shape out;
  Strides s{};
  const auto xs = x.shape().strides();
  for (std::size_t i = 0; i < perm.size(); ++i) {
    out.push_back(x.shape()[perm[i]]);
    s[i] = xs[static_cast<std::size_t>(perm[i])];
  }
  std::vector<int> inverse(perm.size());
  for (std::size_t i = 0; i < perm.size(); ++i) inverse[static_cast<std::size_t>(perm[i])] = static_cast<int>(i);
  return primitive("transpose", {&x}, [&](Residuals&) { return gather(x, out, s, 0); },
                   autodiff::higher_order([inverse = std::move(inverse)](Cotangents& c, autodiff::Saved) { c.set(0, transpose(c.out(), inverse)); }));
}

Array slice(const Array& x, const std::vector<std::int64_t>& starts, const std::vector<std::int64_t>& limits,
            const std::vector<std::int64_t>& strides_in) {
  ops::detail::require_defined(x, "slice");
  const int rank = x.rank();
  std::vector<std::int64_t> steps = strides_in.empty() ? std::vector<std::int64_t>(static_cast<std::size_t>(rank), 1)
                                                       : strides_in;
  if (static_cast<int>(starts.size()) != rank || static_cast<int>(limits.size()) != rank ||
      static_cast<int>(steps.size()) != rank)
    throw ShapeError(detail::cat("slice: starts ", vec_str(starts), ", limits ", vec_str(limits), " and strides ",
                                 vec_str(steps), " need one entry per axis of shape ", x.shape()));
  if (x.batched()) [[unlikely]] {
    std::vector<std::int64_t> st(starts), sp(steps);
    st.insert(st.begin(), x.batch_levels().size(), 0);  // every example whole along the levels
    sp.insert(sp.begin(), x.batch_levels().size(), 1);
    std::vector<std::int64_t> lim = with_levels(x, limits);
    return ops::batching::wrap(slice(x.physical(), st, lim, sp), x.batch_levels());
  }
  Shape out;
  Strides s{};
  std::int64_t base = 0;
  const auto xs = x.shape().strides();
  for (int i = 0; i < rank; ++i) {
    const auto st = starts[i], li = limits[i], sp = steps[i];
    if (st < 0 || li < st || li > x.shape()[i] || sp < 1)
      throw ShapeError(detail::cat("slice: axis ", i, " of shape ", x.shape(), ": start ", st, ", limit ", li,
                                   ", stride ", sp, " is not a valid range (need 0 <= start <= limit <= ",
                                   x.shape()[i], ", stride >= 1)"));
    out.push_back((li - st + sp - 1) / sp);
    s[i] = xs[i] * sp;
    base += st * xs[i];
  }
  return gather_op("slice", x, out, s, base);
}

Array pad(const Array& x, const std::vector<std::pair<std::int64_t, std::int64_t>>& widths) {
  ops::detail::require_defined(x, "pad");
  if (static_cast<int>(widths.size()) > x.rank())
    throw ShapeError(detail::cat("pad: ", widths.size(), " (before, after) pairs for an array of shape ", x.shape(),
                                 "; give at most one pair per axis"));
  Shape out = x.shape();
  for (std::size_t i = 0; i < widths.size(); ++i) {
    const auto [lo, hi] = widths[i];
    if (lo < 0 || hi < 0)
      throw ValueError(detail::cat("pad: widths must be >= 0, got (", lo, ", ", hi, ") for axis ", i, " of shape ", x.shape(),
                                   "; use slice to crop"));
    std::int64_t d = 0;
    if (__builtin_add_overflow(out[static_cast<int>(i)], lo, &d) || __builtin_add_overflow(d, hi, &d))
      throw ShapeError(detail::cat("pad: axis ", i, " of shape ", x.shape(), " padded by (", lo, ", ", hi, ") overflows 64 bits"));
    out[static_cast<int>(i)] = d;
  }
  if (x.batched()) [[unlikely]] {
    std::vector<std::pair<std::int64_t, std::int64_t>> w(x.batch_levels().size(), {0, 0});
    w.insert(w.end(), widths.begin(), widths.end());
    return ops::batching::wrap(pad(x.physical(), w), x.batch_levels());
  }
  Strides s{};
  const auto os = out.strides();
  std::int64_t base = 0;
  for (int i = 0; i < x.rank(); ++i) {
    s[i] = os[static_cast<std::size_t>(i)];
    if (static_cast<std::size_t>(i) < widths.size()) base += widths[static_cast<std::size_t>(i)].first * os[static_cast<std::size_t>(i)];
  }
  if (out == x.shape()) return x;
  return scatter_op("pad", x, out, s, base);
}

Array slice_axis(const Array& x, int axis_in, std::int64_t start, std::int64_t limit) {
  const int axis = x.shape().normalize_axis(axis_in, "slice_axis");
  std::vector<std::int64_t> starts(static_cast<std::size_t>(x.rank()), 0);
  std::vector<std::int64_t> limits = x.shape().vec();
  starts[axis] = start;
  limits[axis] = limit;
  return slice(x, starts, limits);
}

Array concatenate(const std::vector<Array>& xs, int axis_in) {
  if (xs.empty()) throw ShapeError("concatenate: needs at least one array");
  for (const Array& a : xs) ops::detail::require_defined(a, "concatenate");
  const Shape& first = xs[0].shape();
  const int axis = first.normalize_axis(axis_in, "concatenate");
  Shape out = first;
  std::int64_t total = 0;
  for (const Array& a : xs) {
    bool ok = a.rank() == first.rank() && a.dtype() == xs[0].dtype();
    for (int i = 0; ok && i < first.rank(); ++i) ok = i == axis || a.shape()[i] == first[i];
    if (!ok)
      throw ShapeError(detail::cat("concatenate: along axis ", axis_in, " cannot join ", dtype_name(xs[0].dtype()),
                                   first.str(), " with ", dtype_name(a.dtype()), a.shape().str(),
                                   " (all other axes and the dtype must match)"));
    total += a.shape()[axis];
  }
  out[axis] = total;
  if (std::any_of(xs.begin(), xs.end(), [](const Array& a) { return a.batched(); })) [[unlikely]] {
    std::vector<const Array*> all;
    for (const Array& a : xs) all.push_back(&a);
    const std::vector<BatchLevel> levels = autodiff::union_levels(all, "concatenate");
    std::vector<Array> physical;
    for (const Array& a : xs) physical.push_back(ops::batching::materialized(a, levels));
    return ops::batching::wrap(concatenate(physical, axis + static_cast<int>(levels.size())), levels);
  }
  std::vector<const Array*> ins;
  ins.reserve(xs.size());
  std::vector<std::int64_t> sizes;
  sizes.reserve(xs.size());
  for (const Array& a : xs) {
    ins.push_back(&a);
    sizes.push_back(a.shape()[axis]);
  }
  // One output; primitive_multi because the inputs are a list.
  std::vector<Array> ys = autodiff::primitive_multi(
      "concatenate", std::span<const Array* const>(ins),
      [&](Residuals&) {
        Array y = Array::empty(out, xs[0].dtype());
        std::int64_t outer = 1, inner = 1;
        for (int i = 0; i < axis; ++i) outer *= out[i];
        for (int i = axis + 1; i < out.rank(); ++i) inner *= out[i];
        auto* py = static_cast<char*>(const_cast<void*>(y.raw()));
        std::int64_t offset = 0;
        for (const Array& a : xs) {
          const std::int64_t esize = static_cast<std::int64_t>(dtype_size(a.dtype()));
          const std::int64_t chunk = a.shape()[axis] * inner * esize;
          const auto* pa = static_cast<const char*>(a.raw());
          for (std::int64_t o = 0; o < outer; ++o)
            std::memcpy(py + (o * total * inner) * esize + offset, pa + o * chunk, static_cast<std::size_t>(chunk));
          offset += chunk;
        }
        return std::vector<Array>{std::move(y)};
      },
      autodiff::higher_order([sizes = std::move(sizes), axis](Cotangents& c, autodiff::Saved) {
        std::int64_t start = 0;
        for (std::size_t i = 0; i < sizes.size(); ++i) {
          if (c.needs(i)) c.set(i, slice_axis(c.out(), axis, start, start + sizes[i]));
          start += sizes[i];
        }
      }));
  return std::move(ys[0]);
}

std::vector<Array> split(const Array& x, const std::vector<std::int64_t>& indices, int axis_in) {
  const int axis = x.shape().normalize_axis(axis_in, "split");
  std::vector<Array> parts;
  std::int64_t start = 0;
  for (std::size_t i = 0; i <= indices.size(); ++i) {
    const std::int64_t end = i < indices.size() ? indices[i] : x.shape()[axis];
    if (end < start || end > x.shape()[axis])
      throw ShapeError(detail::cat("split: indices ", vec_str(indices), " are not increasing within axis ", axis_in,
                                   " of shape ", x.shape()));
    parts.push_back(slice_axis(x, axis, start, end));
    start = end;
  }
  return parts;
}

std::vector<Array> split(const Array& x, int sections, int axis_in) {
  const int axis = x.shape().normalize_axis(axis_in, "split");
  if (sections < 1 || x.shape()[axis] % sections != 0)
    throw ShapeError(detail::cat("split: axis ", axis_in, " of shape ", x.shape(), " cannot be split into ", sections,
                                 " equal sections"));
  std::vector<std::int64_t> idx;
  const std::int64_t step = x.shape()[axis] / sections;
  for (int i = 1; i < sections; ++i) idx.push_back(i * step);
  return split(x, idx, axis);
}

std::vector<Array> unstack(const Array& x, const UnstackOptions& options) {
  ops::detail::require_defined(x, "unstack");
  if (x.rank() == 0) throw ShapeError("unstack: needs an array of rank >= 1, got a scalar");
  if (x.batched()) [[unlikely]] {  // the physical axis after the levels, moved to the front
    std::vector<Array> parts = unstack(moveaxis(x.physical(), static_cast<int>(x.batch_levels().size()), 0), options);
    for (Array& p : parts) p = ops::batching::wrap(p, x.batch_levels());
    return parts;
  }
  const std::int64_t n = x.dim(0);
  Shape part;
  for (int i = 1; i < x.rank(); ++i) part.push_back(x.shape()[i]);
  const std::size_t bytes = static_cast<std::size_t>(part.numel()) * dtype_size(x.dtype());
  const Array* const ins[] = {&x};
  return autodiff::primitive_multi(
      "unstack", std::span<const Array* const>(ins),
      [&](Residuals&) {
        std::vector<Array> parts;
        parts.reserve(static_cast<std::size_t>(n));
        for (std::int64_t i = 0; i < n; ++i) {
          if (options.views && x.is_aligned_offset(i * part.numel())) {
            parts.push_back(x.part_view(i * part.numel(), part));
            continue;
          }
          Array p = Array::empty(part, x.dtype());
          std::memcpy(const_cast<void*>(p.raw()), static_cast<const char*>(x.raw()) + static_cast<std::size_t>(i) * bytes,
                      bytes);
          parts.push_back(std::move(p));
        }
        return parts;
      },
      autodiff::higher_order([xs = x.shape(), bytes](Cotangents& c, autodiff::Saved) {
        if (autodiff::creating_graph()) {  // the cotangents stacked again, zeros for the parts that got none
          DType t = DType::f32;
          for (std::size_t i = 0; i < c.num_outputs(); ++i)
            if (c.out(i).defined()) t = c.out(i).dtype();
          Shape part;
          for (int i = 1; i < xs.rank(); ++i) part.push_back(xs[i]);
          std::vector<Array> parts;
          for (std::size_t i = 0; i < c.num_outputs(); ++i)
            parts.push_back(c.out(i).defined() ? astype(c.out(i), t) : Array::zeros(part, t));
          return c.set(0, stack(parts));
        }
        Array g = Array::zeros(xs, c.out(0).defined() ? c.out(0).dtype() : DType::f32);
        for (std::size_t i = 0; i < c.num_outputs(); ++i)
          if (c.out(i).defined()) {
            const Array gi = astype(c.out(i), g.dtype());
            std::memcpy(static_cast<char*>(g.mutable_raw()) + i * bytes, gi.raw(), bytes);
          }
        c.set(0, g);
      }));
}

Array stack(const std::vector<Array>& xs) {
  if (xs.empty()) throw ShapeError("stack: needs at least one array");
  std::vector<Array> expanded;
  expanded.reserve(xs.size());
  for (const Array& a : xs) expanded.push_back(expand_dims(a, 0));
  return concatenate(expanded, 0);
}

namespace {
// take with indices that differ per example (vmap): the levels and x's axis flattened into one axis
// of N * A rows, each example's indices offset to its own rows, one take, then the axes put back.
Array take_batched_indices(const Array& x, const Array& indices, int axis) {
  const std::vector<BatchLevel> levels = ops::batching::levels_of({&x, &indices}, "take");
  const int nl = static_cast<int>(levels.size());
  const std::int64_t a = x.dim(axis);
  std::int64_t count = 1;
  for (const BatchLevel& l : levels) count *= l.size;
  Array xm = moveaxis(ops::batching::materialized(x, levels), nl + axis, nl);  // [levels..., A, pre..., post...]
  std::vector<std::int64_t> rest;
  for (int i = 0; i < x.rank(); ++i)
    if (i != axis) rest.push_back(x.dim(i));
  std::vector<std::int64_t> flat{count * a};
  flat.insert(flat.end(), rest.begin(), rest.end());
  Array rows = reshape(xm, flat);
  Array idx = ops::batching::materialized(indices, levels);  // [levels..., m...]
  const std::int64_t m = indices.numel();
  Array offsets = Array::empty(Shape{count, m}, DType::i32);
  const std::int32_t* pi = idx.data_i32();
  std::int32_t* po = offsets.mutable_data_i32();
  for (std::int64_t e = 0; e < count; ++e)
    for (std::int64_t k = 0; k < m; ++k) {
      const std::int32_t v = pi[e * m + k];
      if (v < 0 || v >= a)
        throw ValueError(detail::cat("take: index ", v, " of example ", e, " is out of range for axis ", axis, " of size ", a,
                                     " (one example of shape ", x.shape(), ")"));
      po[e * m + k] = static_cast<std::int32_t>(e * a + v);
    }
  Array taken = take(rows, offsets, 0);  // [count, m, rest...]
  std::vector<std::int64_t> dims;
  for (const BatchLevel& l : levels) dims.push_back(l.size);
  for (std::int64_t d : indices.shape()) dims.push_back(d);
  dims.insert(dims.end(), rest.begin(), rest.end());
  Array y = ops::batching::wrap(reshape(taken, dims), levels);  // per example: [idx..., pre..., post...]
  // Move the index axes to where x's axis was.
  const int ki = indices.rank();
  std::vector<int> perm;
  for (int i = 0; i < axis; ++i) perm.push_back(ki + i);
  for (int i = 0; i < ki; ++i) perm.push_back(i);
  for (int i = ki + axis; i < y.rank(); ++i) perm.push_back(i);
  return transpose(y, perm);
}
}  // namespace

Array take(const Array& x, const Array& indices, int axis_in) {
  ops::detail::require_defined(x, "take");
  ops::detail::require_defined(indices, "take");
  if (indices.dtype() != DType::i32)
    throw ShapeError(detail::cat("take: indices must be int32, got ", dtype_name(indices.dtype()), indices.shape().str()));
  const int axis = x.shape().normalize_axis(axis_in, "take");
  const std::int64_t n = x.shape()[axis];
  if (indices.batched()) [[unlikely]]
    return take_batched_indices(x, indices, axis);
  if (x.batched()) [[unlikely]]
    return ops::batching::wrap(take(x.physical(), indices, axis + static_cast<int>(x.batch_levels().size())), x.batch_levels());
  const std::int32_t* pi = indices.data_i32();
  for (std::int64_t k = 0; k < indices.numel(); ++k)
    if (pi[k] < 0 || pi[k] >= n)
      throw ValueError(detail::cat("take: index ", pi[k], " at flat position ", k, " is out of range for axis ", axis_in,
                                   " of size ", n, " (array shape ", x.shape(), ")"));
  Shape out;
  std::int64_t outer = 1, inner = 1;
  for (int i = 0; i < axis; ++i) { out.push_back(x.shape()[i]); outer *= x.shape()[i]; }
  for (std::int64_t d : indices.shape()) out.push_back(d);
  for (int i = axis + 1; i < x.rank(); ++i) { out.push_back(x.shape()[i]); inner *= x.shape()[i]; }
  // The indices are an input that gets no gradient, so a replay can rebuild what the rule keeps.
  return primitive("take", {&x, &indices},
                   [&](Residuals& r) {
                     r.keep(indices);
                     Array y = Array::empty(out, x.dtype());
                     const auto* px = static_cast<const char*>(x.raw());
                     auto* py = static_cast<char*>(const_cast<void*>(y.raw()));
                     const std::int64_t m = indices.numel();
                     const std::size_t row = static_cast<std::size_t>(inner) * dtype_size(x.dtype());
                     for (std::int64_t o = 0; o < outer; ++o)
                       for (std::int64_t k = 0; k < m; ++k)
                         std::memcpy(py + (o * m + k) * static_cast<std::int64_t>(row),
                                     px + (o * n + pi[k]) * static_cast<std::int64_t>(row), row);
                     return y;
                   },
                   autodiff::higher_order([xshape = x.shape(), outer, inner, n, axis](Cotangents& c, autodiff::Saved s) {
                     if (autodiff::creating_graph()) return c.set(0, ops::detail::take_add(c.out(), s[0].detached(), xshape, axis));
                     Array g = Array::zeros(xshape);  // accumulated in float32; the sweep rounds it to x's dtype
                     float* pg = g.mutable_data();
                     const Array co = astype(c.out(), DType::f32);
                     const float* pc = co.data();
                     const std::int32_t* ix = s[0].data_i32();
                     const std::int64_t m = s[0].numel();
                     for (std::int64_t o = 0; o < outer; ++o)
                       for (std::int64_t k = 0; k < m; ++k) {
                         float* dst = pg + (o * n + ix[k]) * inner;
                         const float* src = pc + (o * m + k) * inner;
                         for (std::int64_t j = 0; j < inner; ++j) dst[j] += src[j];
                       }
                     c.set(0, g);
                   }));
}

namespace ops::detail {
// The transpose of take, as a primitive (create-graph mode): rows of g added into zeros of
// `xshape` at `indices` along `axis`; its rule is take.
Array take_add(const Array& g, const Array& indices, const Shape& xshape, int axis) {
  std::int64_t outer = 1, inner = 1;
  for (int i = 0; i < axis; ++i) outer *= xshape[i];
  for (int i = axis + 1; i < xshape.rank(); ++i) inner *= xshape[i];
  const std::int64_t n = xshape[axis];
  return primitive("take_add", {&g, &indices},
                   [&](Residuals& r) {
                     r.keep(indices);
                     Array out = Array::zeros(xshape);
                     float* po = out.mutable_data();
                     const Array co = astype(g, DType::f32);
                     const float* pc = co.data();
                     const std::int32_t* ix = indices.data_i32();
                     const std::int64_t m = indices.numel();
                     for (std::int64_t o = 0; o < outer; ++o)
                       for (std::int64_t k = 0; k < m; ++k) {
                         float* dst = po + (o * n + ix[k]) * inner;
                         const float* src = pc + (o * m + k) * inner;
                         for (std::int64_t j = 0; j < inner; ++j) dst[j] += src[j];
                       }
                     return out;
                   },
                   autodiff::higher_order([axis](Cotangents& c, autodiff::Saved s) { c.set(0, take(c.out(), s[0].detached(), axis)); }));
}
}  // namespace ops::detail

Array one_hot(const Array& indices, std::int64_t num_classes) {
  ops::detail::require_defined(indices, "one_hot");
  if (indices.dtype() != DType::i32)
    throw ShapeError(detail::cat("one_hot: labels must be int32, got ", dtype_name(indices.dtype()), indices.shape().str(),
                                 "; convert with astype(labels, DType::i32)"));
  if (num_classes < 1) throw ValueError(detail::cat("one_hot: num_classes must be positive, got ", num_classes));
  if (indices.batched()) [[unlikely]]
    return ops::batching::per_element(indices, [num_classes](const Array& p) { return one_hot(p, num_classes); });
  Shape out = indices.shape();
  out.push_back(num_classes);
  Array y = Array::zeros(out);
  float* py = y.mutable_data();
  const std::int32_t* pi = indices.data_i32();
  for (std::int64_t k = 0; k < indices.numel(); ++k)
    if (pi[k] >= 0 && pi[k] < num_classes) py[k * num_classes + pi[k]] = 1.0f;
  return y;
}

Array broadcast_to(const Array& x, const Shape& shape) {
  ops::detail::require_defined(x, "broadcast_to");
  if (x.batched()) [[unlikely]] {
    const std::vector<BatchLevel> levels(x.batch_levels().begin(), x.batch_levels().end());
    if (x.rank() > shape.rank())
      throw ShapeError(detail::cat("broadcast_to: cannot broadcast ", x.shape(), " to ", shape));
    return ops::batching::wrap(broadcast_to(ops::batching::aligned(x, levels, shape.rank()), Shape(with_levels(x, shape.vec()))),
                               levels);
  }
  return primitive("broadcast_to", {&x}, [&](Residuals&) { return ops::detail::broadcast_raw(x, shape); },
                   autodiff::higher_order([xs = x.shape()](Cotangents& c, autodiff::Saved) { c.set(0, ops::detail::sum_to(c.out(), xs)); }));
}

Array expand_dims(const Array& x, int axis) {
  const int rank = x.rank() + 1;
  const int a = axis < 0 ? axis + rank : axis;
  if (a < 0 || a >= rank)
    throw ShapeError(detail::cat("expand_dims: axis ", axis, " is out of range for shape ", x.shape()));
  std::vector<std::int64_t> d = x.shape().vec();
  d.insert(d.begin() + a, 1);
  return reshape(x, d);
}

Array squeeze(const Array& x, const std::vector<int>& axes_in) {
  std::vector<int> axes = ops::detail::normalize_axes(axes_in, x.rank(), "squeeze");
  std::vector<std::int64_t> d;
  for (int i = 0; i < x.rank(); ++i) {
    const bool listed = std::find(axes.begin(), axes.end(), i) != axes.end();
    if (listed && x.shape()[i] != 1)
      throw ShapeError(detail::cat("squeeze: axis ", i, " of shape ", x.shape(), " has size ", x.shape()[i], ", not 1"));
    if ((axes.empty() && x.shape()[i] == 1) || listed) continue;
    d.push_back(x.shape()[i]);
  }
  return reshape(x, d);
}

Array flip(const Array& x, const std::vector<int>& axes_in) {
  ops::detail::require_defined(x, "flip");
  const std::vector<int> axes = ops::detail::normalize_axes(axes_in, x.rank(), "flip");
  if (x.batched()) [[unlikely]]
    return ops::batching::wrap(flip(x.physical(), ops::batching::physical_axes(axes, x.rank(), x.batch_levels().size(), "flip")),
                               x.batch_levels());
  Strides s{};
  std::int64_t base = 0;
  const auto xs = x.shape().strides();
  for (int i = 0; i < x.rank(); ++i) {
    const bool flipped = std::find(axes.begin(), axes.end(), i) != axes.end();
    s[i] = flipped ? -xs[i] : xs[i];
    if (flipped && x.shape()[i] > 0) base += (x.shape()[i] - 1) * xs[i];
  }
  return primitive("flip", {&x}, [&](Residuals&) { return gather(x, x.shape(), s, base); },
                   autodiff::higher_order([axes](Cotangents& c, autodiff::Saved) {
                     c.set(0, flip(c.out(), std::vector<int>(axes.begin(), axes.end())));  // its own inverse
                   }));
}

Array dilate(const Array& x, const std::vector<std::int64_t>& factors) {
  ops::detail::require_defined(x, "dilate");
  if (static_cast<int>(factors.size()) != x.rank())
    throw ShapeError(detail::cat("dilate: ", factors.size(), " factors for an array of shape ", x.shape(),
                                 "; give one factor per axis (1 leaves an axis alone)"));
  Shape out;
  for (int i = 0; i < x.rank(); ++i) {
    if (factors[static_cast<std::size_t>(i)] < 1)
      throw ShapeError(detail::cat("dilate: factor ", factors[static_cast<std::size_t>(i)], " for axis ", i, " must be >= 1"));
    const std::int64_t d = x.shape()[i];
    out.push_back(d == 0 ? 0 : (d - 1) * factors[static_cast<std::size_t>(i)] + 1);
  }
  if (x.batched()) [[unlikely]] {
    std::vector<std::int64_t> f(x.batch_levels().size(), 1);
    f.insert(f.end(), factors.begin(), factors.end());
    return ops::batching::wrap(dilate(x.physical(), f), x.batch_levels());
  }
  Strides s{};
  const auto ys = out.strides();
  for (int i = 0; i < x.rank(); ++i) s[i] = ys[i] * factors[static_cast<std::size_t>(i)];
  return scatter_op("dilate", x, out, s, 0);
}

namespace {
// a * b for a size, or ShapeError naming the op.
std::int64_t size_product(std::int64_t a, std::int64_t b, const char* op, const Shape& x) {
  std::int64_t n = 0;
  if (__builtin_mul_overflow(a, b, &n))
    throw ShapeError(detail::cat(op, ": the result of x of shape ", x, " would have an axis of ", a, " * ", b,
                                 " elements, beyond 64 bits"));
  return n;
}
}  // namespace

Array moveaxis(const Array& x, int source, int destination) {
  const int src = x.shape().normalize_axis(source, "moveaxis (source)");
  const int dst = x.shape().normalize_axis(destination, "moveaxis (destination)");
  std::vector<int> perm;
  for (int a = 0; a < x.rank(); ++a)
    if (a != src) perm.push_back(a);
  perm.insert(perm.begin() + dst, src);
  return transpose(x, perm);
}

Array swapaxes(const Array& x, int axis1, int axis2) {
  const int a = x.shape().normalize_axis(axis1, "swapaxes (axis1)");
  const int b = x.shape().normalize_axis(axis2, "swapaxes (axis2)");
  std::vector<int> perm(static_cast<std::size_t>(x.rank()));
  for (int i = 0; i < x.rank(); ++i) perm[static_cast<std::size_t>(i)] = i;
  std::swap(perm[static_cast<std::size_t>(a)], perm[static_cast<std::size_t>(b)]);
  return transpose(x, perm);
}

Array tile(const Array& x_in, const std::vector<std::int64_t>& reps_in) {
  for (std::int64_t r : reps_in)
    if (r < 0) throw ValueError(detail::cat("tile: reps must be >= 0, got ", r, " (x of shape ", x_in.shape(), ")"));
  // Same length for both: leading 1s on the shorter one (jnp.tile).
  const std::size_t n = std::max(static_cast<std::size_t>(x_in.rank()), reps_in.size());
  std::vector<std::int64_t> dims(n - static_cast<std::size_t>(x_in.rank()), 1);
  for (std::int64_t d : x_in.shape()) dims.push_back(d);
  std::vector<std::int64_t> reps(n - reps_in.size(), 1);
  reps.insert(reps.end(), reps_in.begin(), reps_in.end());
  // (1, d0, 1, d1, ...) broadcast to (r0, d0, r1, d1, ...), then merged to (r0 d0, r1 d1, ...).
  std::vector<std::int64_t> spread, wide, out;
  for (std::size_t i = 0; i < n; ++i) {
    spread.insert(spread.end(), {1, dims[i]});
    wide.insert(wide.end(), {reps[i], dims[i]});
    out.push_back(size_product(reps[i], dims[i], "tile", x_in.shape()));
  }
  return reshape(broadcast_to(reshape(x_in, spread), Shape(wide)), out);
}

Array repeat(const Array& x_in, std::int64_t repeats, std::optional<int> axis_in) {
  if (repeats < 0)
    throw ValueError(detail::cat("repeat: repeats must be >= 0, got ", repeats, " (x of shape ", x_in.shape(), ")"));
  const Array x = axis_in ? x_in : reshape(x_in, {x_in.numel()});
  const int axis = x.shape().normalize_axis(axis_in.value_or(0), "repeat (axis)");
  // (..., d, 1, ...) broadcast to (..., d, repeats, ...), then merged to (..., d * repeats, ...).
  std::vector<std::int64_t> spread(x.shape().begin(), x.shape().end());
  spread.insert(spread.begin() + axis + 1, 1);
  std::vector<std::int64_t> wide = spread;
  wide[static_cast<std::size_t>(axis) + 1] = repeats;
  std::vector<std::int64_t> out(x.shape().begin(), x.shape().end());
  out[static_cast<std::size_t>(axis)] = size_product(x.dim(axis), repeats, "repeat", x_in.shape());
  return reshape(broadcast_to(reshape(x, spread), Shape(wide)), out);
}

Array cumsum(const Array& x, int axis_in) {
  ops::detail::require_float(x, "cumsum");
  const int axis = x.shape().normalize_axis(axis_in, "cumsum");
  if (x.batched()) [[unlikely]]  // vmap: the same axis of every example
    return ops::batching::wrap(cumsum(x.physical(), axis + static_cast<int>(x.batch_levels().size())), x.batch_levels());
  std::int64_t outer = 1, inner = 1;
  for (int i = 0; i < axis; ++i) outer *= x.dim(i);
  for (int i = axis + 1; i < x.rank(); ++i) inner *= x.dim(i);
  const std::int64_t n = x.dim(axis);
  return primitive("cumsum", {&x},
                   [&](Residuals&) {
                     const Array xf = x.dtype() == DType::f32 ? x : linum::detail::convert_float(x, DType::f32);
                     Array y = Array::empty(x.shape());
                     const float* px = xf.data();
                     float* py = y.mutable_data();
                     for (std::int64_t o = 0; o < outer; ++o)
                       for (std::int64_t i = 0; i < inner; ++i) {
                         float acc = 0.0f;
                         for (std::int64_t k = 0; k < n; ++k) {
                           const std::int64_t at = (o * n + k) * inner + i;
                           acc += px[at];
                           py[at] = acc;
                         }
                       }
                     return x.dtype() == DType::f32 ? y : linum::detail::convert_float(y, x.dtype());
                   },
                   // d/dx_j sum_k>=j... : the cotangent summed from the end (ops: differentiable again)
                   autodiff::higher_order([axis](Cotangents& c, autodiff::Saved) {
                     c.set(0, flip(cumsum(flip(c.out(), {axis}), axis), {axis}));
                   }));
}

namespace {

// cumprod's gradient along the last axis of [rows, n] arrays, written with ops so create-graph mode
// differentiates it again: dx_j = (prod_{i<j} x_i) * sum_{k>=j} g_k * prod_{j<i<=k} x_i. The inner
// products are cumprod of x masked to 1 outside (j, k], one row of n per j: O(n^2) per row, used only
// for derivatives of derivatives.
Array cumprod_grad_ops(const Array& x, const Array& y, const Array& g) {
  const std::int64_t n = x.dim(1);
  std::vector<float> after(static_cast<std::size_t>(n * n)), from(static_cast<std::size_t>(n * n));
  for (std::int64_t j = 0; j < n; ++j)
    for (std::int64_t i = 0; i < n; ++i) {
      after[static_cast<std::size_t>(j * n + i)] = i > j ? 1.0f : 0.0f;
      from[static_cast<std::size_t>(j * n + i)] = i >= j ? 1.0f : 0.0f;
    }
  const Array mask = astype(Array::from(Shape{n, n}, after), x.dtype());   // [j, i]: i > j
  const Array upper = astype(Array::from(Shape{n, n}, from), x.dtype());   // [j, k]: k >= j
  const Array xs = expand_dims(x, 1);                                      // [rows, 1, n]
  const Array between = cumprod(xs * mask + (1.0f - mask), 2);             // [rows, j, k]
  const Array tail = sum(between * expand_dims(g, 1) * upper, {2});        // [rows, j]
  const Array before = concatenate({astype(Array::ones(Shape{x.dim(0), 1}), x.dtype()), slice_axis(y, 1, 0, n - 1)}, 1);
  return before * tail;
}

}  // namespace

Array cumprod(const Array& x, int axis_in) {
  ops::detail::require_float(x, "cumprod");
  const int axis = x.shape().normalize_axis(axis_in, "cumprod");
  if (x.batched()) [[unlikely]]  // vmap: the same axis of every example
    return ops::batching::wrap(cumprod(x.physical(), axis + static_cast<int>(x.batch_levels().size())), x.batch_levels());
  std::int64_t outer = 1, inner = 1;
  for (int i = 0; i < axis; ++i) outer *= x.dim(i);
  for (int i = axis + 1; i < x.rank(); ++i) inner *= x.dim(i);
  const std::int64_t n = x.dim(axis);
  return primitive("cumprod", {&x},
                   [&](Residuals& r) {
                     const Array xf = x.dtype() == DType::f32 ? x : linum::detail::convert_float(x, DType::f32);
                     Array y = Array::empty(x.shape());
                     const float* px = xf.data();
                     float* py = y.mutable_data();
                     for (std::int64_t o = 0; o < outer; ++o)
                       for (std::int64_t i = 0; i < inner; ++i) {
                         float acc = 1.0f;
                         for (std::int64_t k = 0; k < n; ++k) {
                           const std::int64_t at = (o * n + k) * inner + i;
                           acc *= px[at];
                           py[at] = acc;
                         }
                       }
                     Array out = x.dtype() == DType::f32 ? y : linum::detail::convert_float(y, x.dtype());
                     r.keep(x, out);
                     return out;
                   },
                   autodiff::higher_order([axis, outer, inner, n](Cotangents& c, autodiff::Saved s) {
                     const Array& x = s[0];
                     const Array& y = s[1];
                     if (autodiff::creating_graph()) {  // ops on [rows, n], the axis last
                       auto rows = [&](const Array& a) { return reshape(moveaxis(a, axis, -1), {-1, n}); };
                       Array dx = cumprod_grad_ops(rows(x), rows(y), rows(c.out()));
                       std::vector<std::int64_t> moved = moveaxis(x, axis, -1).shape().vec();
                       return c.set(0, moveaxis(reshape(dx, moved), -1, axis));
                     }
                     // r_j = g_j + x_{j+1} r_{j+1} from the end; dx_j = y_{j-1} r_j (y_{-1} = 1).
                     auto f32 = [](const Array& a) { return a.dtype() == DType::f32 ? a : linum::detail::convert_float(a, DType::f32); };
                     const Array xf = f32(x), yf = f32(y), gf = f32(c.out());
                     Array dx = Array::empty(x.shape());
                     const float *px = xf.data(), *py = yf.data(), *pg = gf.data();
                     float* pd = dx.mutable_data();
                     for (std::int64_t o = 0; o < outer; ++o)
                       for (std::int64_t i = 0; i < inner; ++i) {
                         float tail = 0.0f;
                         for (std::int64_t k = n - 1; k >= 0; --k) {
                           const std::int64_t at = (o * n + k) * inner + i;
                           tail = k + 1 < n ? pg[at] + px[at + inner] * tail : pg[at];
                           pd[at] = (k > 0 ? py[at - inner] : 1.0f) * tail;
                         }
                       }
                     c.set(0, x.dtype() == DType::f32 ? dx : linum::detail::convert_float(dx, x.dtype()));
                   }));
}

Array take_along_axis(const Array& x, const Array& indices, int axis_in) {
  ops::detail::require_defined(x, "take_along_axis");
  ops::detail::require_defined(indices, "take_along_axis");
  if (indices.dtype() != DType::i32)
    throw ShapeError(detail::cat("take_along_axis: indices must be int32, got ", indices.type_str()));
  const int axis = x.shape().normalize_axis(axis_in, "take_along_axis");
  bool ok = indices.rank() == x.rank();
  for (int i = 0; ok && i < x.rank(); ++i) ok = i == axis || indices.dim(i) == x.dim(i);
  if (!ok)
    throw ShapeError(detail::cat("take_along_axis: indices ", indices.type_str(), " must have the shape of x ", x.type_str(),
                                 " except along axis ", axis_in));
  if (x.batched() || indices.batched()) [[unlikely]] {  // vmap: every example's x and indices at once
    const std::vector<BatchLevel> levels = ops::batching::levels_of({&x, &indices}, "take_along_axis");
    return ops::batching::wrap(take_along_axis(ops::batching::materialized(x, levels), ops::batching::materialized(indices, levels),
                                               axis + static_cast<int>(levels.size())),
                               levels);
  }
  // The axis last, the other axes flattened into rows: each row's indices offset to its own elements.
  const Array xt = moveaxis(x, axis, -1), it = moveaxis(indices, axis, -1);
  const std::int64_t n = x.dim(axis), m = indices.dim(axis), rows = xt.numel() / std::max<std::int64_t>(n, 1);
  Array offsets = Array::empty(Shape{rows * m}, DType::i32);
  const std::int32_t* pi = it.data_i32();
  std::int32_t* po = offsets.mutable_data_i32();
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < m; ++j) {
      const std::int32_t v = pi[r * m + j];
      if (v < 0 || v >= n)
        throw ValueError(detail::cat("take_along_axis: index ", v, " is out of range for axis ", axis_in, " of size ", n,
                                     " (x ", x.type_str(), ")"));
      po[r * m + j] = static_cast<std::int32_t>(r * n + v);
    }
  std::vector<std::int64_t> dims = it.shape().vec();
  return moveaxis(reshape(take(reshape(xt, {-1}), offsets, 0), dims), -1, axis);
}

Array segment_sum(const Array& data, const Array& segment_ids, std::int64_t num_segments) {
  ops::detail::require_float(data, "segment_sum");
  ops::detail::require_defined(segment_ids, "segment_sum");
  if (segment_ids.dtype() != DType::i32 || segment_ids.rank() != 1 || data.rank() < 1 || segment_ids.dim(0) != data.dim(0))
    throw ShapeError(detail::cat("segment_sum: segment_ids must be int32 [", data.rank() ? data.dim(0) : 0,
                                 "] (one id per row of data ", data.type_str(), "), got ", segment_ids.type_str()));
  if (num_segments < 0) throw ValueError(detail::cat("segment_sum: num_segments must be >= 0, got ", num_segments));
  const std::int32_t* ids = segment_ids.data_i32();  // (BatchingError inside vmap if the ids differ per example)
  std::vector<std::int32_t> kept(static_cast<std::size_t>(segment_ids.numel()));
  std::vector<float> valid(static_cast<std::size_t>(segment_ids.numel()));
  bool dropped = false;
  for (std::int64_t i = 0; i < segment_ids.numel(); ++i) {
    const bool in = ids[i] >= 0 && ids[i] < num_segments;
    kept[static_cast<std::size_t>(i)] = in ? ids[i] : 0;
    valid[static_cast<std::size_t>(i)] = in ? 1.0f : 0.0f;
    dropped = dropped || !in;
  }
  Array rows = data;
  if (dropped) {  // rows with an id out of range add zeros (JAX drops them)
    std::vector<std::int64_t> shape(static_cast<std::size_t>(data.rank()), 1);
    shape[0] = data.dim(0);
    rows = where(reshape(Array::from(Shape{data.dim(0)}, valid), shape), data, Array::zeros({}, data.dtype()));
  }
  Shape out = data.shape();
  out[0] = num_segments;
  const Array id_array = Array::from_i32(segment_ids.shape(), kept);
  if (rows.batched()) [[unlikely]]  // vmap with ids the same for every example: the levels lead each row
    return ops::batching::wrap(moveaxis(segment_sum(moveaxis(rows.physical(), static_cast<int>(rows.batch_levels().size()), 0),
                                                    id_array, num_segments),
                                        0, static_cast<int>(rows.batch_levels().size())),
                               rows.batch_levels());
  return astype(ops::detail::take_add(rows, id_array, out, 0), data.dtype());
}

Array argsort(const Array& x, int axis_in, bool descending) {
  ops::detail::require_float(x, "argsort");
  const int axis = x.shape().normalize_axis(axis_in, "argsort");
  if (x.batched()) [[unlikely]]
    return ops::batching::wrap(argsort(x.physical(), axis + static_cast<int>(x.batch_levels().size()), descending),
                               x.batch_levels());
  const Array xf = x.dtype() == DType::f32 ? x : linum::detail::convert_float(x, DType::f32);
  std::int64_t outer = 1, inner = 1;
  for (int i = 0; i < axis; ++i) outer *= x.dim(i);
  for (int i = axis + 1; i < x.rank(); ++i) inner *= x.dim(i);
  const std::int64_t n = x.dim(axis);
  if (n > std::numeric_limits<std::int32_t>::max())
    throw ShapeError(detail::cat("argsort: axis ", axis_in, " of ", x.type_str(), " is longer than int32 indices reach"));
  Array out = Array::empty(x.shape(), DType::i32);
  const float* px = xf.data();
  std::int32_t* po = out.mutable_data_i32();
  std::vector<std::int32_t> order(static_cast<std::size_t>(n));
  for (std::int64_t o = 0; o < outer; ++o)
    for (std::int64_t i = 0; i < inner; ++i) {
      const float* base = px + o * n * inner + i;
      auto value = [&](std::int32_t k) { return base[static_cast<std::int64_t>(k) * inner]; };
      std::iota(order.begin(), order.end(), 0);
      // NaN counts as the largest value (JAX sorts NaNs last ascending, first descending).
      std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
        const float va = value(a), vb = value(b);
        if (descending) return (std::isnan(va) && !std::isnan(vb)) || va > vb;
        return (!std::isnan(va) && std::isnan(vb)) || va < vb;
      });
      for (std::int64_t k = 0; k < n; ++k) po[(o * n + k) * inner + i] = order[static_cast<std::size_t>(k)];
    }
  return out;
}

Array sort(const Array& x, int axis) { return take_along_axis(x, argsort(x, axis), axis); }

std::pair<Array, Array> top_k(const Array& x, std::int64_t k) {
  ops::detail::require_float(x, "top_k");
  if (x.rank() < 1 || k < 0 || k > x.dim(-1))
    throw ValueError(detail::cat("top_k: k must be in [0, ", x.rank() ? x.dim(-1) : 0, "] for x ", x.type_str(), ", got ", k));
  const Array indices = slice_axis(argsort(x, -1, /*descending=*/true), -1, 0, k);
  return {take_along_axis(x, indices, -1), indices};
}

}  // namespace linum
