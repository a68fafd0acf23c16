#include <linum/lift/residual_scope.hpp>

#include <linum/core/debug_nans.hpp>
#include <linum/modules/scope.hpp>

namespace linum::lift {
namespace {

autodiff::SavedValueHooks hooks_for(std::shared_ptr<const Policy> policy) {
  autodiff::SavedValueHooks hooks;
  hooks.pack = [policy](const Array& a, const autodiff::SavedValueInfo& info) -> std::any {
    if (!info.computed() || linum::detail::current_phase() == linum::detail::Phase::recomputation) return a;
    const std::vector<std::string>* parts = linum::detail::current_module_path();
    const std::string path = parts != nullptr ? linum::detail::join_module_path(*parts) : std::string();
    const OpInfo op{info.producer_op, a.shape(), a.nbytes(), info.label, path, a.dtype()};
    const std::optional<storage::Placement> placement = policy->decide(op);
    if (!placement || *placement == storage::Placement{}) return a;
    return storage::StoredArray::store(a, *placement);
  };
  hooks.unpack = [](const std::any& packed) -> Array {
    if (const auto* a = std::any_cast<Array>(&packed)) return *a;
    return std::any_cast<const storage::StoredArray&>(packed).get();
  };
  return hooks;
}

}  // namespace

ResidualScope::ResidualScope(Policy policy)
    : policy_(std::make_shared<const Policy>(std::move(policy))), hooks_(hooks_for(policy_)) {}

}  // namespace linum::lift
