#include <linum/train/io/restore.hpp>

#include <linum/core/error.hpp>
#include <linum/core/ops/elementwise.hpp>

#include <map>
#include <set>

namespace linum::serialization {

namespace {

std::string listed(const std::vector<std::string>& paths, std::size_t at_most = 8) {
  std::string s;
  for (std::size_t i = 0; i < paths.size() && i < at_most; ++i) s += (i ? ", " : "") + paths[i];
  if (paths.size() > at_most) s += detail::cat(", ... (", paths.size() - at_most, " more)");
  return s;
}

// Every path of `tree` that is a leaf, and every path that is a dict (to tell a leaf from a dict
// at the same path).
void collect(const Tree& tree, const std::string& prefix, std::map<std::string, const Tree*>& leaves_at,
             std::set<std::string>& dicts_at) {
  if (tree.is_leaf()) {
    leaves_at[prefix] = &tree;
    return;
  }
  if (!prefix.empty()) dicts_at.insert(prefix);
  for (const auto& [key, sub] : tree) collect(sub, prefix.empty() ? key : prefix + "/" + key, leaves_at, dicts_at);
}

}  // namespace

std::string RestoreReport::str() const {
  std::string s = detail::cat("restored ", restored.size());
  if (!missing.empty()) s += detail::cat(", missing ", missing.size(), " (", listed(missing), ")");
  if (!unexpected.empty()) s += detail::cat(", unexpected ", unexpected.size(), " (", listed(unexpected), ")");
  if (!mismatched.empty()) s += detail::cat(", shape mismatched ", mismatched.size(), " (", listed(mismatched), ")");
  return s;
}

RestoreResult restore(const Tree& target, const Tree& loaded, const RestoreOptions& options) {
  std::map<std::string, const Tree*> target_leaves, loaded_leaves;
  std::set<std::string> target_dicts, loaded_dicts;
  collect(target, "", target_leaves, target_dicts);
  collect(loaded, "", loaded_leaves, loaded_dicts);
  for (const auto& [path, leaf] : target_leaves)
    if (loaded_dicts.count(path))
      throw ValueError(detail::cat("restore: '", path, "' is an array in the target but a dict in the loaded tree; ",
                                   "the file belongs to another model (or another level of the variable dict: pass both "
                                   "from the same level, e.g. both with their \"params\" key)"));
  for (const auto& [path, leaf] : loaded_leaves)
    if (target_dicts.count(path))
      throw ValueError(detail::cat("restore: '", path, "' is a dict in the target but an array in the loaded tree; ",
                                   "the file belongs to another model"));
  RestoreResult result{target, {}};
  RestoreReport& report = result.report;
  for (const auto& [path, leaf] : loaded_leaves)
    if (!target_leaves.count(path)) report.unexpected.push_back(path);
  for (const auto& [path, leaf] : target_leaves) {
    const auto found = loaded_leaves.find(path);
    if (found == loaded_leaves.end()) {
      report.missing.push_back(path);
      continue;
    }
    const Array& want = leaf->array();
    Array got = found->second->array();
    if (!(got.shape() == want.shape())) {
      if (!options.skip_mismatched_shapes)
        throw ShapeError(detail::cat("restore: '", path, "' is ", got.type_str(), " in the loaded tree but ", want.type_str(),
                                     " in the target; pass {.skip_mismatched_shapes = true} to keep the target's value "
                                     "(a new layer of another size), or load into the model the file was saved from"));
      report.mismatched.push_back(path);
      continue;
    }
    if (got.dtype() != want.dtype()) {
      if (!is_floating(got.dtype()) || !is_floating(want.dtype()))
        throw ShapeError(detail::cat("restore: '", path, "' is ", got.type_str(), " in the loaded tree but ", want.type_str(),
                                     " in the target; only float arrays convert (float32 <-> bfloat16)"));
      got = astype(got, want.dtype());
    }
    // set_path replaces the leaf; the target's axis names are kept.
    Tree replaced(got);
    if (!leaf->axis_names().empty()) replaced = replaced.with_axis_names(leaf->axis_names());
    result.tree.set_path(path, std::move(replaced));
    report.restored.push_back(path);
  }
  if (options.strict && (!report.missing.empty() || !report.unexpected.empty())) {
    std::string why = "restore: the loaded tree does not match the target";
    if (!report.missing.empty()) why += detail::cat("; missing from it: ", listed(report.missing));
    if (!report.unexpected.empty()) why += detail::cat("; not in the target: ", listed(report.unexpected));
    throw ValueError(why + "; pass {.strict = false} to restore what matches and keep the rest (fine-tuning)");
  }
  return result;
}

}  // namespace linum::serialization
