#include <linum/lift/residual_scope.hpp>

#include <linum/core/debug_nans.hpp>
#include <linum/modules/scope.hpp>

#include <mutex>
#include <unordered_map>

namespace linum::lift {
namespace {

// What a scope has placed, by buffer: one array that several ops save (a layer's input read by
// the query, key and value projections) is stored once, and each op holds that one copy.
class PlacedValues {
 public:
  std::shared_ptr<const storage::StoredArray> place(const Array& a, const storage::Placement& placement) {
    std::lock_guard<std::mutex> lock(mutex_);
    const void* key = a.buffer_identity();
    if (auto it = placed_.find(key); it != placed_.end()) {
      const Entry& e = it->second;
      if (!e.buffer.expired() && e.placement == placement && e.shape == a.shape() && e.dtype == a.dtype())
        if (auto stored = e.stored.lock()) return stored;
    }
    auto stored = std::make_shared<const storage::StoredArray>(storage::StoredArray::store(a, placement));
    if (placed_.size() > 4096)  // forget what is gone (a step's values are freed by its backward pass)
      std::erase_if(placed_, [](const auto& kv) { return kv.second.buffer.expired() || kv.second.stored.expired(); });
    placed_[key] = Entry{a.weak_buffer(), placement, a.shape(), a.dtype(), stored};
    return stored;
  }

 private:
  struct Entry {
    std::weak_ptr<const void> buffer;  // alive: the key is still this buffer
    storage::Placement placement;
    Shape shape;
    DType dtype;
    std::weak_ptr<const storage::StoredArray> stored;
  };
  std::mutex mutex_;
  std::unordered_map<const void*, Entry> placed_;
};

autodiff::SavedValueHooks hooks_for(std::shared_ptr<const Policy> policy) {
  autodiff::SavedValueHooks hooks;
  auto placed = std::make_shared<PlacedValues>();
  hooks.pack = [policy, placed](const Array& a, const autodiff::SavedValueInfo& info) -> std::any {
    if (!info.computed() || linum::detail::current_phase() == linum::detail::Phase::recomputation) return a;
    const std::vector<std::string>* parts = linum::detail::current_module_path();
    const std::string path = parts != nullptr ? linum::detail::join_module_path(*parts) : std::string();
    const OpInfo op{info.producer_op, a.shape(), a.nbytes(), info.label, path, a.dtype()};
    const std::optional<storage::Placement> placement = policy->decide(op);
    if (!placement || *placement == storage::Placement{}) return a;
    return placed->place(a, *placement);
  };
  hooks.unpack = [](const std::any& packed) -> Array {
    if (const auto* a = std::any_cast<Array>(&packed)) return *a;
    return std::any_cast<const std::shared_ptr<const storage::StoredArray>&>(packed)->get();
  };
  return hooks;
}

}  // namespace

ResidualScope::ResidualScope(Policy policy)
    : policy_(std::make_shared<const Policy>(std::move(policy))), hooks_(hooks_for(policy_)) {}

}  // namespace linum::lift
