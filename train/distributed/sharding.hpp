// How parameters are cut among the ranks of a sharded job: one axis per parameter, chosen from its
// logical axis names (nn::with_partitioning) by Flax-style logical axis rules.
//
//   dist::ShardingRules rules{.rules = {{"vocab", "data"}, {"embed", ""}, {"mlp", "data"}}};
//   dist::ShardLayout layout(params, dist::size(), rules);
//   Tree mine = layout.shard(params, dist::rank());          // this rank's slices
//
// Rank r of P holds indices [r*n/P, (r+1)*n/P) of the parameter's sharded axis (n its length):
// contiguous, balanced to one index, possibly empty when n < P. The axis of a parameter is
//  * the first of its axes whose logical name the rules map to the mesh axis (Flax's
//    logical_axis_rules: the first rule naming a logical axis decides; "" means not on the mesh axis);
//  * otherwise its largest axis (the first of equal ones): unannotated parameters, and annotated
//    ones no rule maps, are cut there (ZeRO shards every parameter; the rules only pick where);
//  * a scalar parameter is held as shape [1] inside the sharded optimizer: the last rank holds it.
// The choice depends on names, rules and shapes only, never on the number of ranks, so a sharded
// checkpoint restores onto any rank count.
#pragma once

#include <linum/core/dtype.hpp>
#include <linum/core/shape.hpp>
#include <linum/core/tree.hpp>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace linum::dist {

// Flax's logical axis rules for the one mesh axis of a data-parallel job.
struct ShardingRules {
  // (logical axis name, mesh axis): {"embed", "data"} cuts "embed" axes among the ranks; {"embed", ""}
  // keeps them whole. The first rule for a name decides.
  std::vector<std::pair<std::string, std::string>> rules;
  // The mesh axis the ranks form.
  std::string mesh_axis = "data";
};

// One parameter's place in the layout.
struct LeafSharding {
  std::string path;     // in the params tree
  Shape shape;          // the whole parameter's shape
  DType dtype = DType::f32;
  int axis = 0;         // the axis cut among the ranks (of the held shape: [1] for a scalar)
  bool scalar = false;  // held as [1] by the sharded optimizer
  std::string why;      // how the axis was chosen (for describe())

  // The shape the optimizer sees for the whole parameter ([1] for a scalar).
  Shape held_shape() const;
  // Rank r's indices [begin, end) along `axis`.
  std::int64_t begin(int r, int ranks) const;
  std::int64_t end(int r, int ranks) const;
  Shape shard_shape(int r, int ranks) const;
  std::int64_t shard_numel(int r, int ranks) const;
};

class ShardLayout {
 public:
  ShardLayout() = default;
  // The layout of `params` (float32 or bfloat16 leaves) over `ranks` ranks.
  ShardLayout(const Tree& params, int ranks, const ShardingRules& rules = {});

  int ranks() const { return ranks_; }
  // The same cuts over another number of ranks.
  ShardLayout with_ranks(int ranks) const;
  const std::vector<LeafSharding>& leaves() const { return leaves_; }
  // The parameters' tree structure (its leaves are empty placeholders: use with_leaves).
  const Tree& structure() const { return structure_; }

  // Rank r's slices of the whole `params` (same structure; scalars as [1] on the last rank, [0] elsewhere).
  Tree shard(const Tree& params, int rank) const;
  // The whole parameters from every rank's shards (in rank order).
  Tree assemble(const std::vector<Tree>& shards) const;
  // Leaf i's rank-r slice of a whole (held-shape) array, and the whole array from all slices.
  Array slice(std::size_t i, const Array& whole, int rank) const;
  Array join(std::size_t i, const std::vector<Array>& slices) const;

  // Elements of rank r's shards over all leaves, and of the whole parameters.
  std::int64_t shard_numel(int rank) const;
  std::int64_t numel() const;
  // One line per parameter: path, shape, axis, why.
  std::string describe() const;

 private:
  int ranks_ = 1;
  Tree structure_;
  std::vector<LeafSharding> leaves_;
};

}  // namespace linum::dist
