// linum-bench hvp: a Hessian-vector product of the deep MLP's loss with respect to its parameters,
// against a plain gradient of the same loss.
//
//   linum-bench hvp [--layers 24] [--width 512] [--batch 2048] [--steps 3]
//
// Variants: grad (the plain gradient, the baseline), reverse_over_reverse (linum::hvp: the gradient
// of <grad f, v>), forward_over_reverse (jvp(grad(f), p, v): forward mode by transposition), each
// plain and with every layer checkpointed (lift::remat). One JSON line per variant: step_s_min,
// peak_activation_bytes (the exact accounting's peak above what was alive before, minus the
// result), and both divided by twice the plain gradient's (time_vs_2grad, peak_vs_2grad).
#include <linum/linum.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <string>

#include "bench_util.hpp"

using namespace linum_bench;

namespace {
struct Layer {
  std::int64_t width = 512;
  Array operator()(Scope& s, const Array& x) const { return gelu(s(nn::Dense{.features = width}, x)); }
};
template <class L>
struct Mlp {
  std::int64_t width = 512;
  int layers = 24;
  Array operator()(Scope& s, const Array& x) const {
    Array h = x;
    L layer{};
    layer.width = width;
    for (int i = 0; i < layers; ++i) h = s(layer, h);
    return h;
  }
};
}  // namespace

int bench_hvp(const Flags& f) {
  const long L = f.get("layers", 24), W = f.get("width", 512), B = f.get("batch", 2048), steps = f.get("steps", 3);
  const Array x = random_normal(Shape{B, W}, 5u, 1.0f);
  const Tree params = init(Mlp<Layer>{.width = W, .layers = static_cast<int>(L)}, rng::key(0), x).at("params");
  const Tree v = tree_map([](const Array& a) { return random_normal(a.shape(), 7u, 1.0f); }, params);
  double grad_s = 0;
  std::int64_t grad_peak = 0;
  auto measure = [&](const std::string& variant, bool remat, auto&& run) {
    double best = 1e30;
    std::int64_t peak = 0;
    for (long s = 0; s < steps; ++s) {
      memory::PeakScope scope;
      const auto start = Clock::now();
      Tree out = run();
      best = std::min(best, seconds_since(start));
      peak = scope.peak_growth() - byte_count(out);
    }
    if (variant == "grad" && !remat) grad_s = best, grad_peak = peak;
    const nlohmann::json line = {{"bench", "hvp"}, {"variant", variant}, {"remat", remat ? "every_layer" : "none"},
                                 {"layers", L}, {"width", W}, {"batch", B}, {"step_s_min", best},
                                 {"peak_activation_bytes", peak}, {"time_vs_2grad", best / (2 * grad_s)},
                                 {"peak_vs_2grad", static_cast<double>(peak) / (2.0 * static_cast<double>(grad_peak))}};
    std::cout << line.dump() << std::endl;
  };
  auto variants = [&](auto model, bool remat) {
    auto loss = [model, x](const Tree& p) { return mean(square(apply(model, Tree{{"params", p}}, x))); };
    measure("grad", remat, [&] { return grad(loss)(params); });
    measure("reverse_over_reverse", remat, [&] { return hvp(loss, params, v); });
    measure("forward_over_reverse", remat, [&] { return jvp([&](const Tree& p) { return grad(loss)(p); }, params, v).second; });
  };
  variants(Mlp<Layer>{.width = W, .layers = static_cast<int>(L)}, false);
  variants(Mlp<lift::remat<Layer>>{.width = W, .layers = static_cast<int>(L)}, true);
  return 0;
}
