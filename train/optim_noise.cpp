// Annealed gradient noise (optax.add_noise, noisy_sgd): the noise drawn as optax draws it, so a run
// is bitwise optax's for the same seed up to float32 rounding of the formulas.
#include <linum/train/optim.hpp>
#include <linum/train/optim_internal.hpp>

#include <linum/rng/random.hpp>

#include <cmath>

namespace linum::optim {

using namespace internal;

GradientTransformation add_noise(double eta, double gamma, std::int64_t seed) {
  if (!(eta >= 0) || !std::isfinite(eta)) throw ValueError(detail::cat("optim::add_noise: eta must be a finite number >= 0, got ", eta));
  if (!std::isfinite(gamma)) throw ValueError(detail::cat("optim::add_noise: gamma must be finite, got ", gamma));
  const float e = f32(eta), g = f32(gamma);
  const std::string who = "optim::add_noise.update";
  return GradientTransformation(
      "optim::add_noise",
      [seed](const Tree&) { return Tree{{"count", count_array(0)}, {"rng_key", key_array(rng::key_x32(seed))}}; },
      [e, g, who](const Tree& updates, const Tree& state, const Tree*) {
        check_state_keys(who, state, {"count", "rng_key"});
        check_f32(who, "update", updates);
        autodiff::NoGradGuard constants;
        const std::int64_t count = safe_increment(read_count(who, state));
        // optax: sqrt(eta / count^gamma), in float32.
        const float stddev = std::sqrt(e / std::pow(static_cast<float>(count), g));
        const std::vector<rng::Key> next = rng::split(key_of(who, state));  // (the next state's key, the sample key)
        std::vector<std::pair<std::string, Array>> out = flatten(updates);
        const std::vector<rng::Key> keys = rng::split(next[1], static_cast<std::int64_t>(out.size()));
        for (std::size_t k = 0; k < out.size(); ++k) {
          const Array& leaf = out[k].second;
          Array noise = rng::normal(keys[k], leaf.shape());
          const Array x = as_f32(leaf);
          float* pn = noise.mutable_data();
          const float* px = x.data();
          for (std::int64_t i = 0; i < x.numel(); ++i) pn[i] = px[i] + stddev * pn[i];  // optax's add_scale
          out[k].second = in_dtype_of(std::move(noise), leaf);
        }
        return UpdateResult{unflatten(out), Tree{{"count", count_array(count)}, {"rng_key", key_array(next[0])}}};
      });
}

GradientTransformation noisy_sgd(LearningRate learning_rate, double eta, double gamma, std::int64_t seed) {
  return chain(add_noise(eta, gamma, seed), scale_by_learning_rate(std::move(learning_rate)));
}

}  // namespace linum::optim
