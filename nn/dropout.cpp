#include <linum/nn/dropout.hpp>

#include <linum/core/ops/all.hpp>
#include <linum/nn/normalization.hpp>
#include <linum/rng/random.hpp>

#include <cmath>

namespace linum::nn {

void Dropout::validate() const {
  if (!(rate >= 0.0 && rate <= 1.0))
    throw ValueError(detail::cat("Dropout: rate must be in [0, 1], got ", rate));
}

Array Dropout::operator()(Scope& s, const Array& x, std::optional<bool> deterministic_arg,
                          std::optional<rng::Key> rng) const {
  validate();
  const bool det = merge_param("Dropout", "deterministic", deterministic, deterministic_arg);
  if (rate == 0.0 || det) return x;
  if (rate == 1.0) return Array::zeros(x.shape(), x.dtype());
  if (!is_floating(x.dtype()))
    throw ShapeError(detail::cat("Dropout: input must be float32 or bfloat16, got ", dtype_name(x.dtype())));
  const float keep_prob = static_cast<float>(1.0 - rate);  // Python computes 1.0 - rate in double
  const rng::Key key = rng ? *rng : s.make_rng(rng_collection);
  Shape mask_shape = x.shape();
  for (int d : broadcast_dims) mask_shape[mask_shape.normalize_axis(d, "Dropout (broadcast_dims)")] = 1;
  Array mask = rng::bernoulli(key, keep_prob, mask_shape);
  return where(mask, x / keep_prob, Array::scalar(0.0f));
}

}  // namespace linum::nn
