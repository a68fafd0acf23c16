// Logical axis names on parameters, as Flax's nn.with_partitioning: the metadata a sharding layer
// (dist::ShardedDataParallel) reads to decide how each parameter is cut among processes.
//
//   struct Block {
//     void operator()(...) {
//       auto up = nn::Dense{.features = 1024,
//                           .kernel_init = nn::with_partitioning(initializers::lecun_normal(), {"embed", "mlp"})};
//       ...
//   };
//   Tree vars = init(Block{}, key, x);
//   vars.at_path("params/Dense_0/kernel").axis_names();   // {"embed", "mlp"}
//
// The names travel with the leaves of the init dict (Tree::axis_names, Flax's nn.Partitioned box:
// copies of the dict keep them) and are checked against the parameter's rank when it is created
// (a ShapeError names the param). They change nothing else: the values are those of the wrapped
// initializer, bit for bit. "" names an axis that has no logical name (Flax's None).
#pragma once

#include <linum/modules/scope.hpp>

#include <string>
#include <utility>
#include <vector>

namespace linum::nn {

// `init` whose parameter carries `names` as its logical axis names (one per axis).
Initializer with_partitioning(Initializer init, std::vector<std::string> names);

// Every leaf of `variables` that carries axis names, with its path: Flax's nn.get_partition_spec
// as a list ({"params/Dense_0/kernel", {"embed", "mlp"}}, ...).
std::vector<std::pair<std::string, std::vector<std::string>>> logical_axes(const Tree& variables);

}  // namespace linum::nn
