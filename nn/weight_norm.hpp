// nn::WeightNorm<Layer>: Flax's nn.WeightNorm (Salimans & Kingma, arXiv:1602.07868). The wrapped
// layer computes with its variables L2-normalized over the non-feature axes and multiplied by a
// learned per-feature scale: w = scale * v / |v|.
//
//   Array y = s(nn::WeightNorm<nn::Dense>{.layer = {.features = 4}}, x);
//   // params/Dense_0/{kernel, bias}                    the layer's, beside the wrapper (Flax's layout)
//   // params/WeightNorm_0/Dense_0/kernel/scale (4,)    one scale per feature
//
// As in Flax, the layer stays bound to the calling module: its variables sit beside the wrapper's
// (a wrapped nn::Dense is auto-named first, "Dense_0", then the wrapper, "WeightNorm_0"), and the
// scales are under the wrapper at "<layer>/<variable path>/scale" (flattened paths as Flax's; Flax
// keeps that as one dict key with slashes, Linum as nested dicts). The layer's variables go through
// lift::map_variables, so at init the stored kernel is the normalized one (scale 1), as Flax stores
// it, and gradients reach both the kernel and the scale.
//
// Fields as Flax's: `epsilon` inside the square root; `use_scale`; `scale_init`; `feature_axes`
// (default the last; std::nullopt normalizes over every axis with one scalar scale); and
// `variable_filter`: a variable is normalized when one of the strings occurs in its path
// "<layer>/<variable path>" ({"kernel"} by default; empty: every variable, as Flax's None);
// `dtype` of the result (default the promotion of the variable and its scale), `param_dtype` of the
// scales.
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/dtype.hpp>
#include <linum/core/ops/elementwise.hpp>
#include <linum/core/ops/reduce.hpp>
#include <linum/core/ops/shape_ops.hpp>
#include <linum/lift/map_variables.hpp>
#include <linum/modules/initializers.hpp>
#include <linum/modules/scope.hpp>
#include <linum/nn/dtypes.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace linum::nn {

namespace weight_reparam {

// The axes of a rank-`rank` array other than `feature_axes` (negative ones count from the end);
// ValueError naming `layer` for an axis out of range or given twice.
std::vector<int> reduction_axes(int rank, const std::optional<std::vector<int>>& feature_axes, const char* layer);

// x * rsqrt(sum(x^2 over `axes`, kept) + eps): Flax's _l2_normalize.
Array l2_normalize(const Array& x, const std::vector<int>& axes, double eps);

// Whether one of `filter` occurs in `path` (an empty filter takes every path).
bool path_matches(const std::vector<std::string>& filter, const std::string& path);

}  // namespace weight_reparam

template <class Layer>
struct WeightNorm {
  Layer layer{};
  double epsilon = 1e-12;
  std::optional<DType> dtype;
  DType param_dtype = DType::f32;
  bool use_scale = true;
  Initializer scale_init = initializers::ones();
  std::optional<std::vector<int>> feature_axes = std::vector<int>{-1};
  std::vector<std::string> variable_filter{"kernel"};

  static constexpr std::string_view module_name = "WeightNorm";
  using layer_bound_to_caller = Layer;  // the layer's scope is the caller's child (Scope::call_wrapper)

  template <class... Args>
  auto operator()(Scope& s, Scope& layer_scope, const Args&... args) const {
    require_float_dtype(param_dtype, "WeightNorm", "param_dtype");
    const std::string layer_name = layer_scope.path().back();
    auto normalize = [&](const Tree& vars) {
      Tree out = vars;
      if (!vars.contains("params")) return out;
      for (const auto& [path, value] : flatten(vars.at("params"))) {
        const std::string str_path = layer_name + "/" + path;
        if (!weight_reparam::path_matches(variable_filter, str_path)) continue;
        const std::vector<int> reduce = weight_reparam::reduction_axes(value.rank(), feature_axes, "WeightNorm");
        Array normalized = weight_reparam::l2_normalize(value, reduce, epsilon);
        Array scale;
        if (use_scale) {
          std::vector<std::int64_t> feature_shape(static_cast<std::size_t>(value.rank()), 1), reduced;
          for (int ax = 0; ax < value.rank(); ++ax)
            if (std::find(reduce.begin(), reduce.end(), ax) == reduce.end()) {
              feature_shape[static_cast<std::size_t>(ax)] = value.dim(ax);
              reduced.push_back(value.dim(ax));
            }
          scale = s.param(str_path + "/scale", initializer_in(scale_init, param_dtype), Shape(reduced));
          normalized = normalized * reshape(scale, feature_shape);
        }
        const DType result = dtype.value_or(use_scale ? promote_types(value.dtype(), scale.dtype()) : value.dtype());
        out.set_path("params/" + path, Tree(normalized.dtype() == result ? normalized : astype(normalized, result)));
      }
      return out;
    };
    return lift::map_variables<Layer>{.body = layer, .trans_in = normalize}(layer_scope, args...);
  }
};

}  // namespace linum::nn
