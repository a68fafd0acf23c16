#include <linum/nn/partitioning.hpp>
#include <linum/core/error.hpp>

#include <functional>

namespace linum::nn {

Initializer with_partitioning(Initializer init, std::vector<std::string> names) {
  if (!init) throw ValueError("nn::with_partitioning: the initializer is empty; pass one, e.g. initializers::lecun_normal()");
  return [init = std::move(init), names = std::move(names)](rng::Key key, const Shape& shape) {
    Array value = init(key, shape);
    if (static_cast<int>(names.size()) != shape.rank()) {
      std::string listed;
      for (const auto& n : names) listed += (listed.empty() ? "\"" : ", \"") + n + "\"";
      throw ShapeError(detail::cat("nn::with_partitioning: ", names.size(), " axis names (", listed, ") for a parameter of shape ",
                                   shape, "; give one name per axis (\"\" for an axis without one)"));
    }
    detail::set_pending_param_axis_names(names);
    return value;
  };
}

std::vector<std::pair<std::string, std::vector<std::string>>> logical_axes(const Tree& variables) {
  std::vector<std::pair<std::string, std::vector<std::string>>> out;
  std::function<void(const Tree&, const std::string&)> walk = [&](const Tree& t, const std::string& path) {
    if (t.is_leaf()) {
      if (!t.axis_names().empty()) out.emplace_back(path, t.axis_names());
      return;
    }
    for (const auto& [key, child] : t) walk(child, path.empty() ? key : path + "/" + key);
  };
  walk(variables, "");
  return out;
}

}  // namespace linum::nn
