// Saved-value hooks (PyTorch's torch.autograd.graph.saved_tensors_hooks): while a guard is alive,
// every array an op keeps for its backward rule is handed to `pack` when the op is recorded, and
// the rule gets `unpack(packed)` back when the backward pass needs it. What happens in between is
// the hooks' business: keep the array, move it to a spill file, compress it.
//
//   autodiff::SavedValueHooksGuard hooks({
//       .pack = [](const Array& a) -> std::any { return to_disk(a); },
//       .unpack = [](const std::any& p) { return from_disk(std::any_cast<const DiskRef&>(p)); }});
//   auto [loss, g] = value_and_grad(f)(params);   // every residual of f went through the hooks
//
// Every primitive's residuals pass through them (the dispatcher, core/autodiff/primitive.hpp,
// applies them to every recorded node); values a checkpoint's policy keeps are held by the
// checkpoint, not packed. `unpack` must return an array of the packed one's shape and dtype (checked).
// Hooks nest: the innermost guard applies. Per thread, like the recording switch.
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/autodiff/graph.hpp>

#include <any>
#include <functional>
#include <memory>

namespace linum::autodiff {

struct SavedValueHooks {
  std::function<std::any(const Array&)> pack;
  std::function<Array(const std::any&)> unpack;
};

class SavedValueHooksGuard {
 public:
  explicit SavedValueHooksGuard(SavedValueHooks hooks);

 private:
  detail::SavedValueHooksStack::Entry installed_;
};

namespace detail {
// The hooks in force on this thread (null: none).
const std::shared_ptr<const SavedValueHooks>& active_saved_value_hooks();
}  // namespace detail

}  // namespace linum::autodiff
