// L-BFGS (optax.scale_by_lbfgs, optax.lbfgs): the update times an approximation of the inverse
// Hessian built from the last memory_size differences of parameters and of gradients, by the
// two-loop recursion (Nocedal and Wright, algorithm 7.4), with optax's state layout, memory order
// and first-step scaling. Float32 arithmetic as optax's; inner products accumulated in double
// per leaf and rounded, then summed over the leaves in float32 (XLA's reduction order differs by
// ulps).
#include <linum/train/optim.hpp>

#include <linum/core/array.hpp>
#include <linum/core/autodiff/graph.hpp>
#include <linum/core/error.hpp>
#include <linum/train/optim_internal.hpp>

#include <algorithm>
#include <cmath>
#include <vector>

namespace linum::optim {

using namespace internal;  // NOLINT(google-build-using-namespace)

namespace {

// A tree's leaves as float32 vectors (bf16 leaves widened), in flatten order.
using Flat = std::vector<std::vector<float>>;

Flat flat_of(const Tree& tree) {
  Flat out;
  for (const Array& leaf : leaves(tree)) {
    const Array a = as_f32(leaf);
    out.emplace_back(a.data(), a.data() + a.numel());
  }
  return out;
}

// Slot k of a memory tree (every leaf [memory_size, ...the parameter's shape]) as float32 vectors.
Flat slot_of(const std::vector<Array>& memory, std::int64_t k) {
  Flat out;
  for (const Array& leaf : memory) {
    const Array a = as_f32(leaf);
    const std::int64_t n = a.numel() / a.shape()[0];
    out.emplace_back(a.data() + k * n, a.data() + (k + 1) * n);
  }
  return out;
}

// optax.tree.vdot: each leaf's inner product (here accumulated in double, rounded), summed in float32.
float vdot(const Flat& a, const Flat& b) {
  float total = 0.0f;
  for (std::size_t l = 0; l < a.size(); ++l) {
    double s = 0.0;
    for (std::size_t i = 0; i < a[l].size(); ++i) s += static_cast<double>(a[l][i]) * static_cast<double>(b[l][i]);
    total += static_cast<float>(s);
  }
  return total;
}

// a + s * b (optax.tree.add_scale).
void add_scaled(Flat& a, float s, const Flat& b) {
  for (std::size_t l = 0; l < a.size(); ++l)
    for (std::size_t i = 0; i < a[l].size(); ++i) a[l][i] = a[l][i] + s * b[l][i];
}

Flat difference(const Flat& a, const Flat& b) {
  Flat out = a;
  for (std::size_t l = 0; l < a.size(); ++l)
    for (std::size_t i = 0; i < a[l].size(); ++i) out[l][i] = a[l][i] - b[l][i];
  return out;
}

// The vectors as arrays with the shapes and dtypes of `like`'s leaves, in its structure.
Tree tree_of(const Flat& values, const Tree& like) {
  const std::vector<Array> shapes = leaves(like);
  std::vector<Array> out;
  for (std::size_t l = 0; l < values.size(); ++l) {
    Array a = Array::empty(shapes[l].shape());
    std::copy(values[l].begin(), values[l].end(), a.mutable_data());
    out.push_back(in_dtype_of(std::move(a), shapes[l]));
  }
  return with_leaves(like, out);
}

// The memory with slot k replaced by `values` (every leaf [memory_size, ...]).
Tree with_slot(const Tree& memory, std::int64_t k, const Flat& values) {
  std::vector<Array> out;
  std::size_t l = 0;
  for (const Array& leaf : leaves(memory)) {
    const Array old = as_f32(leaf);
    Array a = Array::empty(old.shape());
    std::copy(old.data(), old.data() + old.numel(), a.mutable_data());
    const std::int64_t n = a.numel() / a.shape()[0];
    std::copy(values[l].begin(), values[l].end(), a.mutable_data() + k * n);
    out.push_back(in_dtype_of(std::move(a), leaf));
    ++l;
  }
  return with_leaves(memory, out);
}

}  // namespace

GradientTransformation scale_by_lbfgs(std::int64_t memory_size, bool scale_init_precond) {
  if (memory_size < 1) throw ValueError(detail::cat("optim::scale_by_lbfgs: memory_size must be at least 1, got ", memory_size));
  const std::string who = "optim::scale_by_lbfgs";
  const std::int64_t m = memory_size;
  return GradientTransformation(
      who,
      [m](const Tree& params) {
        const Tree stacked = tree_map(
            [m](const Array& leaf) {
              std::vector<std::int64_t> dims{m};
              dims.insert(dims.end(), leaf.shape().begin(), leaf.shape().end());
              return Array::zeros(Shape(dims), leaf.dtype());
            },
            params);
        return Tree{{"count", count_array(0)},
                    {"diff_params_memory", stacked},
                    {"diff_updates_memory", stacked},
                    {"params", zeros_like(params)},
                    {"updates", zeros_like(params)},
                    {"weights_memory", Array::zeros(Shape{m})}};
      },
      [who, m, scale_init_precond](const Tree& updates, const Tree& state, const Tree* params) {
        const std::string w = who + ".update";
        if (params == nullptr)
          throw ValueError(w + ": needs the params (the differences of successive parameters build its curvature estimate); call update(grads, state, params)");
        check_state_keys(w, state, {"count", "diff_params_memory", "diff_updates_memory", "params", "updates", "weights_memory"});
        check_same_structure(w, "params", *params, "state['params']", state.at("params"));
        const Array& weights_in = state.at("weights_memory").array();
        if (weights_in.dtype() != DType::f32 || weights_in.shape() != Shape{m})
          throw ValueError(detail::cat(w, ": state['weights_memory'] must be f32[", m, "], got ", weights_in.type_str(),
                                       "; pass the state init() returned"));
        const std::int64_t count = read_count(w, state);
        const std::int64_t slot = count % m, previous = (count + m - 1) % m;

        // 1. The newest differences go into the memory (zero at the first step: there is no previous step).
        const Flat u = flat_of(updates);
        Flat dp = difference(flat_of(*params), flat_of(state.at("params")));
        Flat du = difference(u, flat_of(state.at("updates")));
        const float curvature = vdot(du, dp);
        float weight = curvature == 0.0f ? 0.0f : 1.0f / curvature;
        if (count == 0) {
          for (Flat* f : {&dp, &du})
            for (auto& leaf : *f) std::fill(leaf.begin(), leaf.end(), 0.0f);
          weight = 0.0f;
        }
        const Tree dp_memory = with_slot(state.at("diff_params_memory"), previous, dp);
        const Tree du_memory = with_slot(state.at("diff_updates_memory"), previous, du);
        std::vector<float> rho(weights_in.data(), weights_in.data() + m);
        rho[static_cast<std::size_t>(previous)] = weight;

        // 2. The initial inverse Hessian gamma I: gamma = (dw . du) / (du . du), and at the first
        // step min(1, 1 / |u|) (optax's trust region of radius 1 for the first step).
        float gamma = 1.0f;
        if (scale_init_precond) {
          const float numerator = vdot(du, dp), denominator = vdot(du, du);
          gamma = denominator > 0.0f ? numerator / denominator : 1.0f;
          if (count == 0) gamma = std::min(1.0f, 1.0f / std::sqrt(vdot(u, u)));
        }

        // 3. The two-loop recursion over the slots from the oldest (slot, slot + 1, ...) to the newest.
        const std::vector<Array> dps = leaves(dp_memory), dus = leaves(du_memory);
        std::vector<std::int64_t> order(static_cast<std::size_t>(m));
        for (std::int64_t j = 0; j < m; ++j) order[static_cast<std::size_t>(j)] = (slot + j) % m;
        Flat v = u;
        std::vector<float> alphas(static_cast<std::size_t>(m));
        for (std::int64_t j = m - 1; j >= 0; --j) {
          const std::int64_t k = order[static_cast<std::size_t>(j)];
          const float alpha = rho[static_cast<std::size_t>(k)] * vdot(slot_of(dps, k), v);
          add_scaled(v, -alpha, slot_of(dus, k));
          alphas[static_cast<std::size_t>(j)] = alpha;
        }
        for (auto& leaf : v)
          for (float& x : leaf) x = gamma * x;
        for (std::int64_t j = 0; j < m; ++j) {
          const std::int64_t k = order[static_cast<std::size_t>(j)];
          const float beta = rho[static_cast<std::size_t>(k)] * vdot(slot_of(dus, k), v);
          add_scaled(v, alphas[static_cast<std::size_t>(j)] - beta, slot_of(dps, k));
        }
        return UpdateResult{tree_of(v, updates),
                            Tree{{"count", count_array(safe_increment(count))},
                                 {"diff_params_memory", dp_memory},
                                 {"diff_updates_memory", du_memory},
                                 {"params", *params},
                                 {"updates", updates},
                                 {"weights_memory", Array::from(Shape{m}, rho)}}};
      });
}

GradientTransformation lbfgs(std::optional<LearningRate> learning_rate, std::int64_t memory_size, bool scale_init_precond,
                             GradientTransformation linesearch) {
  return chain(scale_by_lbfgs(memory_size, scale_init_precond),
               learning_rate ? scale_by_learning_rate(std::move(*learning_rate)) : scale(-1.0), std::move(linesearch));
}

}  // namespace linum::optim
