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
// applies them to every recorded node), and so do what a checkpoint keeps: its block's inputs and
// the values its policy saved. `pack` may also take a second argument, a SavedValueInfo saying
// which op computed the value (null for a constant or a differentiation variable, which stay alive
// anyway; graph.hpp). `unpack` must return an array of the packed one's shape and dtype (checked).
// Hooks nest: the innermost guard applies. Per thread, like the recording switch.
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/autodiff/graph.hpp>

#include <any>
#include <functional>
#include <memory>
#include <type_traits>

namespace linum::autodiff {

// `pack` as PyTorch writes it, (const Array&) -> any, or with the info, (const Array&, const
// SavedValueInfo&) -> any.
class PackFunction {
 public:
  PackFunction() = default;
  template <class F>
    requires std::is_invocable_r_v<std::any, F&, const Array&, const SavedValueInfo&>
  PackFunction(F f) : f_(std::move(f)) {}  // NOLINT(google-explicit-constructor)
  template <class F>
    requires(std::is_invocable_r_v<std::any, F&, const Array&> &&
             !std::is_invocable_r_v<std::any, F&, const Array&, const SavedValueInfo&>)
  PackFunction(F f)  // NOLINT(google-explicit-constructor)
      : f_([f = std::move(f)](const Array& a, const SavedValueInfo&) mutable -> std::any { return f(a); }) {}
  explicit operator bool() const { return static_cast<bool>(f_); }
  std::any operator()(const Array& a, const SavedValueInfo& info) const { return f_(a, info); }

 private:
  std::function<std::any(const Array&, const SavedValueInfo&)> f_;
};

struct SavedValueHooks {
  PackFunction pack;
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
