#include <linum/core/batch_levels.hpp>

#include <algorithm>
#include <atomic>

namespace linum::detail {

std::vector<BatchLevel> open_batch_levels() {
  std::vector<BatchLevel> levels;
  for (auto* e = OpenBatchLevels::innermost(); e != nullptr; e = e->below()) levels.push_back(e->value());
  std::reverse(levels.begin(), levels.end());
  return levels;
}

std::uint64_t next_batch_level_id() {
  static std::atomic<std::uint64_t> counter{0};
  return counter.fetch_add(1, std::memory_order_relaxed) + 1;
}

}  // namespace linum::detail
