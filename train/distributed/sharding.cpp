#include <linum/train/distributed/sharding.hpp>
#include <linum/core/autodiff/grad.hpp>
#include <linum/core/error.hpp>
#include <linum/core/ops/all.hpp>

#include <sstream>

namespace linum::dist {

Shape LeafSharding::held_shape() const { return scalar ? Shape{1} : shape; }

std::int64_t LeafSharding::begin(int r, int ranks) const { return held_shape()[axis] * r / ranks; }
std::int64_t LeafSharding::end(int r, int ranks) const { return held_shape()[axis] * (r + 1) / ranks; }

Shape LeafSharding::shard_shape(int r, int ranks) const {
  const Shape held = held_shape();
  std::vector<std::int64_t> dims = held.vec();
  dims[static_cast<std::size_t>(axis)] = end(r, ranks) - begin(r, ranks);
  return Shape(dims);
}

std::int64_t LeafSharding::shard_numel(int r, int ranks) const { return shard_shape(r, ranks).numel(); }

namespace {

// The rule's mesh axis for a logical name, or nullptr when no rule names it.
const std::string* rule_for(const ShardingRules& rules, const std::string& name) {
  for (const auto& [logical, mesh] : rules.rules)
    if (logical == name) return &mesh;
  return nullptr;
}

}  // namespace

ShardLayout::ShardLayout(const Tree& params, int ranks, const ShardingRules& rules) : ranks_(ranks) {
  // The structure only: one shared empty array per leaf, so the layout keeps no parameter alive.
  const Array placeholder = Array::empty(Shape{0});
  structure_ = tree_map([&](const Array&) { return placeholder; }, params);
  if (ranks < 1) throw ValueError(detail::cat("dist::ShardLayout: the number of ranks must be at least 1, got ", ranks));
  std::vector<std::pair<std::string, const Tree*>> nodes;
  std::function<void(const Tree&, const std::string&)> walk = [&](const Tree& t, const std::string& path) {
    if (t.is_leaf()) {
      nodes.emplace_back(path, &t);
      return;
    }
    for (const auto& [key, child] : t) walk(child, path.empty() ? key : path + "/" + key);
  };
  walk(params, "");
  for (const auto& [path, node] : nodes) {
    const Array& a = node->array();
    if (a.dtype() != DType::f32 && a.dtype() != DType::bf16)
      throw ShapeError(detail::cat("dist::ShardLayout: parameter '", path, "' is ", a.type_str(),
                                   "; sharded training keeps float32 or bfloat16 parameters (pass integer state elsewhere)"));
    LeafSharding leaf;
    leaf.path = path;
    leaf.shape = a.shape();
    leaf.dtype = a.dtype();
    leaf.scalar = a.rank() == 0;
    const std::vector<std::string>& names = node->axis_names();
    int chosen = -1;
    for (std::size_t i = 0; i < names.size() && chosen < 0; ++i) {
      const std::string* mesh = rule_for(rules, names[i]);
      if (mesh && *mesh == rules.mesh_axis) {
        chosen = static_cast<int>(i);
        leaf.why = detail::cat("rule '", names[i], "' -> '", rules.mesh_axis, "'");
      }
    }
    if (leaf.scalar) {
      leaf.axis = 0;
      leaf.why = "scalar, held as [1] by the last rank";
    } else if (chosen >= 0) {
      leaf.axis = chosen;
    } else {
      int largest = 0;
      for (int i = 1; i < a.rank(); ++i)
        if (a.dim(i) > a.dim(largest)) largest = i;
      leaf.axis = largest;
      leaf.why = names.empty() ? "largest axis (no axis names)" : "largest axis (no rule maps its names to the mesh axis)";
    }
    leaves_.push_back(std::move(leaf));
  }
}

ShardLayout ShardLayout::with_ranks(int ranks) const {
  if (ranks < 1) throw ValueError(detail::cat("dist::ShardLayout: the number of ranks must be at least 1, got ", ranks));
  ShardLayout out = *this;
  out.ranks_ = ranks;
  return out;
}

Array ShardLayout::slice(std::size_t i, const Array& whole, int rank) const {
  const LeafSharding& leaf = leaves_.at(i);
  autodiff::NoGradGuard constants;
  const Array held = leaf.scalar && whole.rank() == 0 ? reshape(whole, std::vector<std::int64_t>{1}) : whole;
  return slice_axis(held, leaf.axis, leaf.begin(rank, ranks_), leaf.end(rank, ranks_));
}

Array ShardLayout::join(std::size_t i, const std::vector<Array>& slices) const {
  const LeafSharding& leaf = leaves_.at(i);
  if (static_cast<int>(slices.size()) != ranks_)
    throw ValueError(detail::cat("dist::ShardLayout: ", slices.size(), " slices of '", leaf.path, "' for ", ranks_, " ranks"));
  for (int r = 0; r < ranks_; ++r)
    if (!(slices[static_cast<std::size_t>(r)].shape() == leaf.shard_shape(r, ranks_)))
      throw ShapeError(detail::cat("dist::ShardLayout: rank ", r, "'s slice of '", leaf.path, "' is ",
                                   slices[static_cast<std::size_t>(r)].type_str(), ", expected shape ",
                                   leaf.shard_shape(r, ranks_), " (parameter ", leaf.shape, " cut along axis ", leaf.axis, ")"));
  autodiff::NoGradGuard constants;
  std::vector<Array> nonempty;
  for (const Array& s : slices)
    if (s.numel() > 0) nonempty.push_back(s);
  Array whole = nonempty.empty() ? Array::zeros(leaf.held_shape(), slices.front().dtype())
                : nonempty.size() == 1 ? nonempty.front() : concatenate(nonempty, leaf.axis);
  return leaf.scalar ? reshape(whole, std::vector<std::int64_t>{}) : whole;
}

Tree ShardLayout::shard(const Tree& params, int rank) const {
  const std::vector<Array> whole = linum::leaves(params);
  if (whole.size() != leaves_.size())
    throw ShapeError(detail::cat("dist::ShardLayout::shard: ", whole.size(), " leaves for a layout of ", leaves_.size()));
  std::vector<Array> out;
  for (std::size_t i = 0; i < whole.size(); ++i) out.push_back(slice(i, whole[i], rank));
  return with_leaves(structure_, out);
}

Tree ShardLayout::assemble(const std::vector<Tree>& shards) const {
  std::vector<std::vector<Array>> per_rank;
  for (const Tree& s : shards) per_rank.push_back(linum::leaves(s));
  std::vector<Array> out;
  for (std::size_t i = 0; i < leaves_.size(); ++i) {
    std::vector<Array> slices;
    for (const auto& r : per_rank) slices.push_back(r.at(i));
    out.push_back(join(i, slices));
  }
  return with_leaves(structure_, out);
}

std::int64_t ShardLayout::shard_numel(int rank) const {
  std::int64_t n = 0;
  for (const auto& l : leaves_) n += l.shard_numel(rank, ranks_);
  return n;
}

std::int64_t ShardLayout::numel() const {
  std::int64_t n = 0;
  for (const auto& l : leaves_) n += l.held_shape().numel();
  return n;
}

std::string ShardLayout::describe() const {
  std::ostringstream s;
  for (const auto& l : leaves_)
    s << l.path << ' ' << dtype_name(l.dtype) << l.shape.str() << " axis " << l.axis << " (" << l.why << ")\n";
  return s.str();
}

}  // namespace linum::dist
