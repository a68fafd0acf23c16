// Differentially private aggregation of per-example gradients (optax.differentially_private_aggregate,
// the DP-SGD of Abadi et al. 2016): each example's gradient clipped to a global L2 norm, the clipped
// gradients summed, Gaussian noise added, the sum divided by the batch size.
#include <linum/train/optim.hpp>
#include <linum/train/optim_internal.hpp>

#include <linum/core/autodiff/graph.hpp>
#include <linum/core/ops/all.hpp>
#include <linum/core/ops/kernel_util.hpp>
#include <linum/core/threading.hpp>
#include <linum/rng/random.hpp>

#include <cmath>
#include <limits>

namespace linum::optim {

using namespace internal;

GradientTransformation differentially_private_aggregate(double l2_norm_clip, double noise_multiplier, std::int64_t seed) {
  if (!(l2_norm_clip >= 0) || !std::isfinite(l2_norm_clip))
    throw ValueError(detail::cat("optim::differentially_private_aggregate: l2_norm_clip must be a finite number >= 0, got ",
                                 l2_norm_clip));
  if (!(noise_multiplier >= 0) || !std::isfinite(noise_multiplier))
    throw ValueError(detail::cat("optim::differentially_private_aggregate: noise_multiplier must be a finite number >= 0, got ",
                                 noise_multiplier));
  const float clip = f32(l2_norm_clip), noise_std = f32(l2_norm_clip * noise_multiplier);
  const std::string who = "optim::differentially_private_aggregate.update";
  return GradientTransformation(
      "optim::differentially_private_aggregate",
      [seed](const Tree&) { return Tree{{"rng_key", key_array(rng::key_x32(seed))}}; },  // jax.random.PRNGKey(seed)
      [clip, noise_std, who](const Tree& updates, const Tree& state, const Tree*) {
        check_state_keys(who, state, {"rng_key"});
        check_f32(who, "per-example gradients", updates);
        autodiff::NoGradGuard constants;
        std::vector<std::pair<std::string, Array>> leaves = flatten(updates);
        if (leaves.empty()) return UpdateResult{updates, state};
        const std::int64_t batch = leaves.front().second.rank() > 0 ? leaves.front().second.dim(0) : 0;
        for (const auto& [path, g] : leaves)
          if (g.rank() == 0 || g.dim(0) != batch || batch == 0)
            throw ShapeError(detail::cat(who, ": the updates must be per-example gradients with one leading batch axis of "
                                              "the same size on every leaf (vmap(grad(loss)) gives them); leaf '",
                                         path, "' is ", g.type_str(), ", the first leaf has ", batch, " examples"));
        // Each example's global norm (squares summed in double, as global_norm), and its clipping
        // factor min(clip / norm, 1) (NaN -> 0, as optax). Per-example gradients are large (batch
        // times the parameters): both passes read them once, without temporaries of their size.
        std::vector<Array> values;  // float32 views of the leaves (bf16 widened once)
        for (const auto& [path, g] : leaves) values.push_back(as_f32(g));
        std::vector<double> squares(static_cast<std::size_t>(batch), 0.0);
        for (const Array& g : values) {
          const std::int64_t per = g.numel() / batch;
          const float* pg = g.data();
#pragma omp parallel for schedule(static) num_threads(linum::team_size()) if (g.numel() > (1 << 20))
          for (std::int64_t i = 0; i < batch; ++i) {
            double acc = 0.0;
            for (std::int64_t j = 0; j < per; ++j) acc += static_cast<double>(pg[i * per + j]) * pg[i * per + j];
            squares[static_cast<std::size_t>(i)] += acc;
          }
        }
        std::vector<float> factor(static_cast<std::size_t>(batch));
        for (std::int64_t i = 0; i < batch; ++i) {
          const float m = std::min(clip / static_cast<float>(std::sqrt(squares[static_cast<std::size_t>(i)])), 1.0f);
          factor[static_cast<std::size_t>(i)] = std::isnan(m) ? 0.0f : m;
        }
        const std::vector<rng::Key> keys = rng::split(key_of(who, state), static_cast<std::int64_t>(leaves.size()) + 1);
        for (std::size_t k = 0; k < leaves.size(); ++k) {
          const Array& g = values[k];
          const std::int64_t per = g.numel() / batch;
          Shape shape;
          for (int a = 1; a < g.rank(); ++a) shape.push_back(g.dim(a));
          // (sum_i factor_i g_i + noise) / batch; each output sums the examples in order.
          Array out = rng::normal(keys[k + 1], shape);
          float* po = out.mutable_data();
          const float* pg = g.data();
          const float inv_batch = 1.0f / static_cast<float>(batch);
          ops::detail::for_blocks(per, [&](std::int64_t begin, std::int64_t count) {
            std::vector<float> acc(static_cast<std::size_t>(count), 0.0f);
            for (std::int64_t i = 0; i < batch; ++i) {
              const float f = factor[static_cast<std::size_t>(i)];
              const float* row = pg + i * per + begin;
              for (std::int64_t j = 0; j < count; ++j) acc[static_cast<std::size_t>(j)] += f * row[j];
            }
            for (std::int64_t j = 0; j < count; ++j) po[begin + j] = (acc[static_cast<std::size_t>(j)] + noise_std * po[begin + j]) * inv_batch;
          });
          leaves[k].second = in_dtype_of(std::move(out), leaves[k].second);
        }
        return UpdateResult{unflatten(leaves), Tree{{"rng_key", key_array(keys[0])}}};
      }).taking_per_example_gradients();
}

GradientTransformation dpsgd(LearningRate learning_rate, double l2_norm_clip, double noise_multiplier, std::int64_t seed,
                             double momentum, bool nesterov) {
  return chain(differentially_private_aggregate(l2_norm_clip, noise_multiplier, seed),
               sgd(std::move(learning_rate), momentum, nesterov));
}

}  // namespace linum::optim
