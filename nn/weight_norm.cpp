// nn::WeightNorm's helpers (shared with nn::SpectralNorm): axes, L2 normalization, variable filters.
#include <linum/nn/weight_norm.hpp>

#include <linum/core/error.hpp>

namespace linum::nn::weight_reparam {

std::vector<int> reduction_axes(int rank, const std::optional<std::vector<int>>& feature_axes, const char* layer) {
  std::vector<bool> feature(static_cast<std::size_t>(rank), false);
  if (feature_axes)
    for (int ax : *feature_axes) {
      const int a = ax < 0 ? ax + rank : ax;
      if (a < 0 || a >= rank)
        throw ValueError(linum::detail::cat(layer, ": feature axis ", ax, " is out of range for a variable of rank ", rank,
                                            "; give axes in [-", rank, ", ", rank, ")"));
      if (feature[static_cast<std::size_t>(a)])
        throw ValueError(linum::detail::cat(layer, ": feature axis ", ax, " is given twice"));
      feature[static_cast<std::size_t>(a)] = true;
    }
  std::vector<int> axes;
  for (int a = 0; a < rank; ++a)
    if (!feature[static_cast<std::size_t>(a)]) axes.push_back(a);
  return axes;
}

Array l2_normalize(const Array& x, const std::vector<int>& axes, double eps) {
  if (axes.empty()) return x * rsqrt(x * x + static_cast<float>(eps));
  return x * rsqrt(sum(x * x, axes, /*keepdims=*/true) + static_cast<float>(eps));
}

bool path_matches(const std::vector<std::string>& filter, const std::string& path) {
  if (filter.empty()) return true;
  for (const std::string& f : filter)
    if (path.find(f) != std::string::npos) return true;
  return false;
}

}  // namespace linum::nn::weight_reparam
