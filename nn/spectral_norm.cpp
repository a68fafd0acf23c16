// nn::SpectralNorm's power iteration (Flax's _spectral_normalize).
#include <linum/nn/spectral_norm.hpp>

#include <linum/core/error.hpp>
#include <linum/nn/weight_norm.hpp>

namespace linum::nn::weight_reparam {

Array spectral_normalize(Scope& s, const std::string& name, const Array& value, int n_steps, double epsilon,
                         std::optional<DType> dtype, DType param_dtype, bool error_on_non_matrix,
                         const std::string& collection, bool update_stats) {
  if (value.rank() <= 1 || n_steps < 1) return value;
  Array matrix = value;
  if (value.rank() > 2) {
    if (error_on_non_matrix)
      throw ValueError(linum::detail::cat("SpectralNorm: variable '", name, "' has shape ", value.shape(), " (rank ",
                                          value.rank(), ") but error_on_non_matrix is set; wrap only layers whose "
                                          "weights are matrices, or unset it to normalize the matrix of the leading "
                                          "dimensions by the last"));
    matrix = reshape(value, {-1, value.dim(-1)});
  }
  const std::int64_t n = matrix.dim(-1);
  Variable u_var = s.variable(collection, name + "/u", [&] {
    const Array u = rng::normal(s.make_rng("params"), Shape{1, n});
    return param_dtype == DType::f32 ? u : astype(u, param_dtype);
  });
  Variable sigma_var = s.variable(collection, name + "/sigma", [&] { return Array::full(Shape{}, 1.0f, param_dtype); });
  const std::vector<int> all{0, 1};
  Array u = u_var.value(), v;
  for (int i = 0; i < n_steps; ++i) {
    v = l2_normalize(matmul(u, transpose(matrix)), all, epsilon);
    u = l2_normalize(matmul(v, matrix), all, epsilon);
  }
  u = stop_gradient(u);
  v = stop_gradient(v);
  const Array sigma = reshape(matmul(matmul(v, matrix), transpose(u)), {});
  const Array divisor = where(not_equal(sigma, Array::full(Shape{}, 0.0f, sigma.dtype())), sigma,
                              Array::full(Shape{}, 1.0f, sigma.dtype()));
  const Array normalized = reshape(matrix / divisor, value.shape().vec());
  if (update_stats) {
    u_var.set(u);
    sigma_var.set(stop_gradient(sigma));
  }
  const DType result =
      dtype.value_or(promote_types(promote_types(value.dtype(), u.dtype()), promote_types(v.dtype(), sigma.dtype())));
  return normalized.dtype() == result ? normalized : astype(normalized, result);
}

}  // namespace linum::nn::weight_reparam
