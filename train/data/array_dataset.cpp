#include <linum/train/data/array_dataset.hpp>

#include <linum/core/error.hpp>

#include <cstring>
#include <vector>

namespace linum::datasets {
namespace {

using linum::detail::cat;

// The bytes of one record of `a` (its leading axis removed).
std::size_t row_bytes(const Array& a) { return a.dim(0) == 0 ? 0 : a.nbytes() / static_cast<std::size_t>(a.dim(0)); }

Shape with_leading(const Shape& s, std::int64_t n) {
  std::vector<std::int64_t> d = s.vec();
  d[0] = n;
  return Shape(d);
}

}  // namespace

ArrayDataset::ArrayDataset(Tree columns) : columns_(std::move(columns)) {
  const auto leaves = flatten(columns_);
  if (leaves.empty()) throw ValueError("ArrayDataset: the columns tree has no arrays; pass e.g. Tree{{\"x\", xs}, {\"y\", ys}}");
  std::string first_path;
  for (const auto& [path, a] : leaves) {
    if (a.rank() == 0)
      throw ValueError(cat("ArrayDataset: column '", path, "' is a scalar; every column needs a leading record axis"));
    if (first_path.empty()) {
      first_path = path;
      size_ = a.dim(0);
    } else if (a.dim(0) != size_) {
      throw ValueError(cat("ArrayDataset: column '", path, "' has ", a.dim(0), " records (shape ", a.shape(), ") but '",
                           first_path, "' has ", size_, "; every column needs the same leading dimension"));
    }
  }
}

Tree ArrayDataset::record(std::int64_t i) const {
  if (i < 0 || i >= size_) throw ValueError(cat("ArrayDataset::record(", i, "): the dataset has ", size_, " records"));
  const std::int64_t index[1] = {i};
  Tree one = gather(index);
  return tree_map([](const Array& a) {
    std::vector<std::int64_t> d = a.shape().vec();
    d.erase(d.begin());
    return a.with_shape(Shape(d));
  }, one);
}

Tree ArrayDataset::gather(std::span<const std::int64_t> indices) const {
  for (std::int64_t i : indices)
    if (i < 0 || i >= size_)
      throw ValueError(cat("ArrayDataset::gather: index ", i, " is outside the dataset's ", size_, " records"));
  const auto n = static_cast<std::int64_t>(indices.size());
  return tree_map([&](const Array& a) {
    Array out = Array::empty(with_leading(a.shape(), n), a.dtype());
    const std::size_t row = row_bytes(a);
    const auto* src = static_cast<const unsigned char*>(a.raw());
    auto* dst = static_cast<unsigned char*>(out.mutable_raw());
    for (std::int64_t k = 0; k < n; ++k)
      std::memcpy(dst + static_cast<std::size_t>(k) * row, src + static_cast<std::size_t>(indices[static_cast<std::size_t>(k)]) * row, row);
    return out;
  }, columns_);
}

ArrayDataset ArrayDataset::slice(std::int64_t begin, std::int64_t end) const {
  if (begin < 0 || end < begin || end > size_)
    throw ValueError(cat("ArrayDataset::slice(", begin, ", ", end, "): needs 0 <= begin <= end <= ", size_));
  std::vector<std::int64_t> rows;
  for (std::int64_t i = begin; i < end; ++i) rows.push_back(i);
  ArrayDataset out;
  out.columns_ = gather(rows);
  out.size_ = end - begin;
  return out;
}

}  // namespace linum::datasets
