// linum-bench vmap: what batching buys over running the same thing one at a time.
//
//   linum-bench vmap [--members 8] [--batch 128] [--hidden 256] [--in 784] [--steps 3] [--examples 128]
//
// ensemble: one training step (loss, gradients) of `members` MLPs (in -> hidden -> 10, dropout 0.2,
//   each member its own parameters and dropout keys) on one batch: lift::vmap (one batched call,
//   variant "ensemble_vmap") against a loop over the members, each a plain model with its own
//   parameter tree ("ensemble_loop").
// per_example: the gradient of each of `examples` examples' loss with respect to the parameters of
//   one MLP: vmap(grad(loss)) ("per_example_vmap") against a loop of grad calls, one per example
//   ("per_example_loop").
// One JSON line per variant: step_s_min over --steps runs, peak_bytes (the exact accounting's peak
// above what was alive before, minus the result), and time_vs_loop / peak_vs_loop for the vmap ones.
#include <linum/linum.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <iostream>
#include <string>

#include "bench_util.hpp"

using namespace linum_bench;

namespace {

struct Member {
  std::int64_t hidden = 256;
  Array operator()(Scope& s, const Array& x, bool train) const {
    Array h = relu(s(nn::Dense{.features = hidden}, x));
    h = s(nn::Dropout{.rate = 0.2}, h, !train);
    return s(nn::Dense{.features = 10}, h);
  }
};

struct Ensemble {
  std::int64_t hidden = 256, members = 8;
  Array operator()(Scope& s, const Array& x, bool train) const {
    return s("ens", lift::vmap<Member>{.body = {.hidden = hidden}, .variable_axes = {{"params", 0}},
                                       .split_rngs = {{"params", true}, {"dropout", true}},
                                       .in_axes = {std::nullopt, std::nullopt}, .axis_size = members},
             x, train);
  }
};

Array cross_entropy(const Array& logits, const Array& labels) {
  return -mean(sum(log_softmax(logits) * one_hot(labels, 10), {-1}));
}

}  // namespace

int bench_vmap(const Flags& f) {
  const long M = f.get("members", 8), B = f.get("batch", 128), H = f.get("hidden", 256), in = f.get("in", 784);
  const long steps = f.get("steps", 3), N = f.get("examples", 128);
  const Array x = random_normal(Shape{B, in}, 3u, 1.0f);
  Array labels = Array::empty(Shape{B}, DType::i32);
  for (long i = 0; i < B; ++i) labels.mutable_data_i32()[i] = static_cast<std::int32_t>((i * 7) % 10);
  std::map<std::string, std::pair<double, std::int64_t>> loops;
  auto measure = [&](const std::string& bench, const std::string& variant, auto&& run) {
    double best = 1e30;
    std::int64_t peak = 0;
    // Each variant starts from an empty block cache, so that one variant's freed blocks do not
    // decide whether the next one's are kept (step_s_min is then a warm step of its own).
    memory::release_cached();
    for (long s = 0; s < steps; ++s) {
      memory::PeakScope scope;
      const auto start = Clock::now();
      const std::int64_t kept = run();
      best = std::min(best, seconds_since(start));
      peak = scope.peak_growth() - kept;
    }
    nlohmann::json line = {{"bench", "vmap"}, {"variant", variant}, {"members", M}, {"batch", B}, {"hidden", H},
                           {"examples", N}, {"threads", omp_get_max_threads_or_1()}, {"step_s_min", best},
                           {"peak_bytes", peak}};
    if (variant.find("loop") != std::string::npos) loops[bench] = {best, peak};
    else if (loops.count(bench)) {
      line["time_vs_loop"] = best / loops[bench].first;
      line["peak_vs_loop"] = static_cast<double>(peak) / static_cast<double>(std::max<std::int64_t>(loops[bench].second, 1));
    }
    std::cout << line.dump() << std::endl;
  };

  // ---- ensemble ----------------------------------------------------------------------------------
  const Ensemble ensemble{.hidden = H, .members = M};
  const Tree ens_params = init(ensemble, rng::Streams{{"params", rng::key(0)}}, x, false).at("params");
  std::vector<Tree> member_params;
  for (long e = 0; e < M; ++e)
    member_params.push_back(tree_map([e](const Array& a) { return take(a, Array::from_i32(Shape{}, {static_cast<std::int32_t>(e)}), 0); },
                                     ens_params.at("ens")));
  const std::vector<rng::Key> dropout_keys = rng::split(rng::key(1), M);
  // The loops keep every result until the step ends, as the batched variants return them all.
  measure("ensemble", "ensemble_loop", [&] {
    std::vector<Tree> grads;
    std::int64_t kept = 0;
    for (long e = 0; e < M; ++e) {
      auto [loss, g] = value_and_grad([&](const Tree& p) {
        return cross_entropy(apply(Member{.hidden = H}, Tree{{"params", p}}, {.rngs = {{"dropout", dropout_keys[static_cast<std::size_t>(e)]}}}, x, true),
                             labels);
      })(member_params[static_cast<std::size_t>(e)]);
      kept += byte_count(g);
      grads.push_back(std::move(g));
    }
    return kept;
  });
  measure("ensemble", "ensemble_vmap", [&] {
    auto [loss, g] = value_and_grad([&](const Tree& p) {
      // Each member's mean loss, summed: every member's gradient is its own loss's.
      const Array logits = apply(ensemble, Tree{{"params", p}}, {.rngs = {{"dropout", rng::key(1)}}}, x, true);
      return sum(vmap([&](const Array& l) { return cross_entropy(l, labels); })(logits));
    })(ens_params);
    return byte_count(g);
  });

  // ---- per-example gradients ------------------------------------------------------------------------
  const Member one{.hidden = H};
  const Array xs = random_normal(Shape{N, in}, 4u, 1.0f);
  Array ys = Array::empty(Shape{N}, DType::i32);
  for (long i = 0; i < N; ++i) ys.mutable_data_i32()[i] = static_cast<std::int32_t>((i * 3) % 10);
  const Tree params = init(one, rng::key(2), xs, false).at("params");
  auto example_loss = [one](const Tree& p, const Array& xi, const Array& yi) {
    const Array logits = apply(one, Tree{{"params", p}}, expand_dims(xi, 0), false);
    return cross_entropy(logits, expand_dims(yi, 0));
  };
  measure("per_example", "per_example_loop", [&] {
    std::vector<Tree> grads;
    std::int64_t kept = 0;
    for (long i = 0; i < N; ++i) {
      const Array idx = Array::from_i32(Shape{}, {static_cast<std::int32_t>(i)});
      grads.push_back(grad(example_loss)(params, take(xs, idx, 0), take(ys, idx, 0)));
      kept += byte_count(grads.back());
    }
    return kept;
  });
  measure("per_example", "per_example_vmap", [&] {
    return byte_count(vmap(grad(example_loss), {.in_axes = {std::nullopt, 0, 0}})(params, xs, ys));
  });
  return 0;
}
