// Putting loaded variables into a model's own variable dict: flax.serialization.from_state_dict
// (strict), and PyTorch's load_state_dict(strict=False) / Hugging Face's ignore_mismatched_sizes
// for fine-tuning (a pretrained backbone, a new head).
//
//   Tree vars = init(model, rng::key(0), x);                                  // the target layout
//   auto [restored, report] = serialization::restore(vars, serialization::load("pretrained.msgpack"),
//                                                    {.strict = false, .skip_mismatched_shapes = true});
//   // restored: the file's arrays where paths and shapes agree, vars' own values elsewhere;
//   // report.missing / .unexpected / .mismatched: what was not taken, path by path.
//
// Paths are compared whole ("params/Dense_0/kernel"). A loaded float array goes into a float leaf
// of the other float dtype by conversion (float32 <-> bfloat16, as Flax restores into a bf16
// model); int32 leaves take int32 arrays only. The result keeps the target's structure, key order
// and partitioning names, so it is what init would have returned with the loaded values.
#pragma once

#include <linum/core/tree.hpp>

#include <string>
#include <vector>

namespace linum::serialization {

struct RestoreOptions {
  // Every path of the target must be in the loaded tree and every loaded path in the target
  // (Flax's from_state_dict); otherwise a ValueError lists all the differences.
  bool strict = true;
  // A path present in both with different shapes (a new head of another size) keeps the target's
  // value and is reported instead of being an error (Hugging Face's ignore_mismatched_sizes).
  bool skip_mismatched_shapes = false;
};

// What a restore did not take, path by path (PyTorch's missing_keys / unexpected_keys).
struct RestoreReport {
  std::vector<std::string> missing;     // in the target, not in the loaded tree: kept as they were
  std::vector<std::string> unexpected;  // in the loaded tree, not in the target: ignored
  std::vector<std::string> mismatched;  // in both, shapes differ: kept (skip_mismatched_shapes)
  std::vector<std::string> restored;    // taken from the loaded tree
  // True when every target path was restored and nothing was left over.
  bool complete() const { return missing.empty() && unexpected.empty() && mismatched.empty(); }
  // One line per kind, for logs: "restored 12, missing 2 (params/Head_0/kernel, ...), ...".
  std::string str() const;
};

struct RestoreResult {
  Tree tree;
  RestoreReport report;
};

// `target` with its arrays replaced by `loaded`'s at the same paths. Throws ValueError (strict:
// missing or unexpected paths, all listed; a leaf in one tree that is a dict in the other) and
// ShapeError (a shape mismatch, unless skip_mismatched_shapes; a dtype that does not convert),
// naming the paths.
RestoreResult restore(const Tree& target, const Tree& loaded, const RestoreOptions& options = {});

}  // namespace linum::serialization
