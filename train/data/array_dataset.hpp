// A dataset of records held in memory: a Tree of arrays ("columns") whose leading dimension is the
// record index, like a dict of NumPy arrays handed to grain or tf.data.Dataset.from_tensor_slices.
//
//   datasets::ArrayDataset train(Tree{{"image", images}, {"label", labels}});   // images [N, 28, 28, 1]
//   Tree first = train.record(0);                                            // image [28, 28, 1]
//   Tree batch = train.gather(std::vector<std::int64_t>{4, 2, 7});           // image [3, 28, 28, 1]
#pragma once

#include <linum/core/tree.hpp>

#include <cstdint>
#include <span>

namespace linum::datasets {

class ArrayDataset {
 public:
  ArrayDataset() = default;
  // ValueError when `columns` has no leaf, a scalar leaf, or leaves whose leading dimensions differ
  // (naming the leaves).
  explicit ArrayDataset(Tree columns);

  // The number of records.
  std::int64_t size() const { return size_; }
  const Tree& columns() const { return columns_; }

  // Record i: every column's row i (the leading axis removed). IndexError-like ValueError when out of range.
  Tree record(std::int64_t i) const;
  // The records at `indices`, stacked along a new leading axis in that order (a batch). A plain
  // copy of rows: no autodiff graph, safe on any thread.
  Tree gather(std::span<const std::int64_t> indices) const;
  // Records [begin, end) sharing the buffers' bytes by copy (e.g. a validation split or --limit).
  ArrayDataset slice(std::int64_t begin, std::int64_t end) const;

 private:
  Tree columns_;
  std::int64_t size_ = 0;
};

}  // namespace linum::datasets
