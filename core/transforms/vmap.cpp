#include <linum/core/transforms/vmap.hpp>

#include <linum/core/ops/batching.hpp>
#include <linum/core/ops/shape_ops.hpp>

#include <algorithm>

namespace linum::transforms::detail {

using linum::detail::cat;

void batch_arguments(std::vector<Array>& arrays, std::optional<int> axis, std::size_t arg, std::optional<std::int64_t>& size) {
  if (!axis) return;
  for (const Array& a : arrays) {
    if (!a.defined()) continue;
    const int ax = *axis < 0 ? *axis + a.rank() : *axis;
    if (ax < 0 || ax >= a.rank())
      throw BatchingError(cat("vmap: in_axes ", *axis, " of argument ", arg, " is out of range for its array ", a.type_str(),
                              a.rank() == 0 ? " (a scalar has no axis to map: give std::nullopt)" : ""));
    const std::int64_t d = a.dim(ax);
    if (size && *size != d)
      throw BatchingError(cat("vmap: the mapped axes have different sizes: ", *size, " and ", d, " (argument ", arg, ", ",
                              a.type_str(), ", axis ", *axis, ")"));
    size = d;
  }
}

BatchLevel open_level(std::int64_t size) { return BatchLevel{linum::detail::next_batch_level_id(), size}; }

Array batch_at(const Array& a, int axis, const BatchLevel& level) {
  const int ax = axis < 0 ? axis + a.rank() : axis;
  const int outer = static_cast<int>(a.batch_levels().size());
  std::vector<BatchLevel> levels(a.batch_levels().begin(), a.batch_levels().end());
  levels.push_back(level);  // the newest level: the last of the leading axes
  const Array p = a.physical();
  return Array::batched_view(ax == 0 ? p : moveaxis(p, outer + ax, outer), levels);
}

void unbatch_results(std::vector<Array>& arrays, const std::vector<std::optional<int>>& out_axes, const BatchLevel& level) {
  if (out_axes.size() > 1 && out_axes.size() != arrays.size())
    throw ValueError(cat("vmap: out_axes has ", out_axes.size(), " entries for a result of ", arrays.size(),
                         " arrays; give one per array (flatten order) or one for all"));
  const std::vector<BatchLevel> open = linum::detail::open_batch_levels();
  for (std::size_t i = 0; i < arrays.size(); ++i) {
    Array& y = arrays[i];
    if (!y.defined()) continue;
    const std::optional<int> out = out_axes.empty() ? std::optional<int>(0) : out_axes.size() == 1 ? out_axes[0] : out_axes[i];
    const std::span<const BatchLevel> own = y.batch_levels();
    for (const BatchLevel& l : own)
      if (l.id != level.id && std::find(open.begin(), open.end(), l) == open.end())
        throw BatchingError(cat("vmap: result ", i, " (", y.type_str(), ") is batched over a vmap level that is not open "
                                "here: a batched value escaped the vmap that made it (kept in a variable outside?)"));
    const auto mine = std::find(own.begin(), own.end(), level);
    if (!out) {
      if (mine != own.end())
        throw BatchingError(cat("vmap: out_axes is std::nullopt for result ", i, " (", y.type_str(),
                                "), but it differs per example; give an out axis (e.g. 0)"));
      continue;
    }
    const int rank = y.rank() + 1;
    const int o = *out < 0 ? *out + rank : *out;
    if (o < 0 || o >= rank)
      throw BatchingError(cat("vmap: out_axes ", *out, " is out of range for result ", i, " (", y.type_str(),
                              " per example, rank ", rank, " with the batch axis)"));
    if (mine == own.end()) {  // the same for every example: repeated along the new axis
      Array e = expand_dims(y, o);
      std::vector<std::int64_t> dims = e.shape().vec();
      dims[static_cast<std::size_t>(o)] = level.size;
      y = broadcast_to(e, Shape(dims));
      continue;
    }
    const int k = static_cast<int>(mine - own.begin());
    std::vector<BatchLevel> rest(own.begin(), own.end());
    rest.erase(rest.begin() + k);
    const Array p = y.physical();
    const int outer = static_cast<int>(rest.size());
    // Physical: [levels before k, this level, levels after k, example...]: this level's axis goes to
    // position outer + o (behind all remaining levels, at o within the example).
    y = Array::batched_view(k == outer + o ? p : moveaxis(p, k, outer + o), rest);
  }
}

}  // namespace linum::transforms::detail
