// nn::SpectralNorm<Layer>: Flax's nn.SpectralNorm (Miyato et al., arXiv:1802.05957). The wrapped
// layer computes with each weight matrix divided by its largest singular value, estimated by power
// iteration; the iteration's vector `u` and the estimate `sigma` live in a collection
// ("batch_stats" by default) and are updated when `update_stats` is true (training).
//
//   auto [y, updates] = apply(model, vars, {.mutable_collections = {"batch_stats"}}, x);
//   // inside: s(nn::SpectralNorm<nn::Dense>{.layer = {.features = 4}}, train, x)
//   // params/Dense_0/{kernel, bias}                      the layer's, beside the wrapper
//   // batch_stats/SpectralNorm_0/Dense_0/kernel/u (1, 4), .../kernel/sigma ()
//
// The update flag comes first in the call (Flax's keyword argument `update_stats`), the layer's
// arguments after it. Every variable of rank 2 or more is normalized (a higher-rank one as the matrix
// of its leading dimensions by its last, or a ValueError with `error_on_non_matrix`); scalars and
// vectors pass unchanged, as do all with `n_steps` < 1. `u` starts as normal noise from the
// "params" stream, `sigma` as 1. Gradients do not flow through u and v (Flax's stop_gradient), so
// the kernel's gradient is that of kernel / sigma with sigma's dependence on the kernel through
// v^T W u only. Layout and init as nn::WeightNorm's (the layer bound to the caller; at init the
// stored kernel is the normalized one, as Flax stores it).
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/dtype.hpp>
#include <linum/core/ops/elementwise.hpp>
#include <linum/core/ops/linalg.hpp>
#include <linum/core/ops/shape_ops.hpp>
#include <linum/lift/map_variables.hpp>
#include <linum/modules/scope.hpp>
#include <linum/nn/dtypes.hpp>
#include <linum/rng/random.hpp>

#include <optional>
#include <string>

namespace linum::nn {

namespace weight_reparam {

// Flax's _spectral_normalize for one variable (spectral_norm.cpp): `value` divided by its power-
// iteration estimate of the largest singular value; u and sigma in `s`'s collection under `name`.
Array spectral_normalize(Scope& s, const std::string& name, const Array& value, int n_steps, double epsilon,
                         std::optional<DType> dtype, DType param_dtype, bool error_on_non_matrix,
                         const std::string& collection, bool update_stats);

}  // namespace weight_reparam

template <class Layer>
struct SpectralNorm {
  Layer layer{};
  int n_steps = 1;
  double epsilon = 1e-12;
  std::optional<DType> dtype;
  DType param_dtype = DType::f32;
  bool error_on_non_matrix = false;
  std::string collection_name = "batch_stats";

  static constexpr std::string_view module_name = "SpectralNorm";
  using layer_bound_to_caller = Layer;  // the layer's scope is the caller's child (Scope::call_wrapper)

  template <class... Args>
  auto operator()(Scope& s, Scope& layer_scope, bool update_stats, const Args&... args) const {
    require_float_dtype(param_dtype, "SpectralNorm", "param_dtype");
    const std::string layer_name = layer_scope.path().back();
    auto normalize = [&](const Tree& vars) {
      Tree out = vars;
      for (const std::string& collection : vars.keys())
        for (const auto& [path, value] : flatten(vars.at(collection)))
          out.set_path(collection + "/" + path,
                       Tree(weight_reparam::spectral_normalize(s, layer_name + "/" + path, value, n_steps, epsilon, dtype,
                                                       param_dtype, error_on_non_matrix, collection_name, update_stats)));
      return out;
    };
    return lift::map_variables<Layer>{.body = layer, .trans_in = normalize}(layer_scope, args...);
  }
};

}  // namespace linum::nn
