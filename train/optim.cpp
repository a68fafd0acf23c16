// Every multiply and add rounds separately (no fused multiply-add contraction), as XLA evaluates
// optax's formulas; the fused step() and the transformation-by-transformation path then give the
// same floats.
// Compiled with -ffp-contract=off (train/meson.build), as are the other optimizer sources.

#include <linum/train/optim.hpp>
#include <linum/train/square_sums.hpp>
#include <linum/train/optim_internal.hpp>
#include <linum/core/ops/kernel_util.hpp>

#include <Eigen/Core>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include <linum/core/autodiff/graph.hpp>
#include <linum/core/ops/elementwise.hpp>
#include <linum/core/error.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <limits>
#include <memory>
#include <numbers>
#include <optional>
#include <span>
#include <string_view>
#include <type_traits>

namespace linum::optim {

using namespace internal;


// ---- schedules ---------------------------------------------------------------------------------

Schedule constant_schedule(float value) {
  return [value](std::int64_t) { return value; };
}

Schedule linear_schedule(float init_value, float end_value, std::int64_t transition_steps,
                         std::int64_t transition_begin) {
  if (transition_steps <= 0) return [init_value](std::int64_t) { return init_value; };
  if (transition_begin < 0) transition_begin = 0;
  return [=](std::int64_t step) {
    const std::int64_t t = std::clamp<std::int64_t>(step - transition_begin, 0, transition_steps);
    const double frac = 1.0 - static_cast<double>(t) / static_cast<double>(transition_steps);
    return static_cast<float>((static_cast<double>(init_value) - end_value) * frac + end_value);
  };
}

Schedule cosine_decay_schedule(float init_value, std::int64_t decay_steps, float alpha) {
  if (decay_steps <= 0)
    throw ValueError(detail::cat("optim::cosine_decay_schedule: decay_steps must be positive, got ", decay_steps));
  return [=](std::int64_t step) {
    const double t = static_cast<double>(std::min(step, decay_steps));
    const double cosine = 0.5 * (1.0 + std::cos(std::numbers::pi * t / static_cast<double>(decay_steps)));
    const double decayed = (1.0 - alpha) * cosine + alpha;
    return static_cast<float>(init_value * decayed);
  };
}

Schedule warmup_cosine_decay_schedule(float init_value, float peak_value, std::int64_t warmup_steps,
                                      std::int64_t decay_steps, float end_value) {
  if (warmup_steps < 0)
    throw ValueError(detail::cat("optim::warmup_cosine_decay_schedule: warmup_steps must be >= 0, got ", warmup_steps));
  if (decay_steps <= warmup_steps)
    throw ValueError(detail::cat("optim::warmup_cosine_decay_schedule: decay_steps (", decay_steps,
                                 ") must exceed warmup_steps (", warmup_steps,
                                 "); decay_steps counts the warmup, as in optax"));
  // As optax: alpha = end / peak (0 when peak is 0), the cosine part restarts its count at the
  // boundary, and join_schedules switches at step == warmup_steps.
  const float alpha = peak_value == 0.0f ? 0.0f : static_cast<float>(static_cast<double>(end_value) / peak_value);
  Schedule warmup = linear_schedule(init_value, peak_value, warmup_steps);
  Schedule decay = cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha);
  return [=](std::int64_t step) { return step < warmup_steps ? warmup(step) : decay(step - warmup_steps); };
}

// ---- GradientTransformation ------------------------------------------------------------------

Tree GradientTransformation::init(const Tree& params) const {
  autodiff::NoGradGuard no_grad;
  check_f32(name_ + ".init", "params", params);
  return init_(params);
}

UpdateResult GradientTransformation::update(const Tree& grads, const Tree& state) const {
  autodiff::NoGradGuard no_grad;
  check_f32(name_ + ".update", "grads", grads);
  return update_(grads, state, nullptr);
}

GradientTransformation GradientTransformation::with_extra_args(std::string name, InitFn init, UpdateWithArgsFn update) {
  // Called without extra arguments, it sees none (and says what it needs, if it needs any).
  UpdateFn plain = [update](const Tree& u, const Tree& s, const Tree* p) { return update(u, s, p, ExtraArgs{}); };
  GradientTransformation t(std::move(name), std::move(init), std::move(plain));
  t.update_with_args_ = std::move(update);
  return t;
}

void GradientTransformation::check_grads_against(const Tree& grads, const Tree& params) const {
  if (per_example_) {  // the params' structure, every leaf with a leading batch axis
    const auto g = flatten(grads), p = flatten(params);
    bool ok = g.size() == p.size();
    for (std::size_t i = 0; ok && i < g.size(); ++i) {
      const Shape& gs = g[i].second.shape();
      ok = g[i].first == p[i].first && gs.rank() == p[i].second.rank() + 1;
      for (int a = 0; ok && a < p[i].second.rank(); ++a) ok = gs[a + 1] == p[i].second.shape()[a];
    }
    if (!ok)
      throw ValueError(detail::cat(name_, ".update: takes per-example gradients, the params' structure with a leading "
                                          "batch axis on every leaf (vmap(grad(loss)) gives them); got grads of another structure"));
  } else {
    check_same_structure(name_ + ".update", "grads", grads, "params", params);
  }
}

UpdateResult GradientTransformation::update(const Tree& grads, const Tree& state, const Tree& params) const {
  autodiff::NoGradGuard no_grad;
  check_f32(name_ + ".update", "grads", grads);
  check_grads_against(grads, params);
  return update_(grads, state, &params);
}

UpdateResult GradientTransformation::update(const Tree& grads, const Tree& state, const Tree& params,
                                            const ExtraArgs& extra) const {
  if (!update_with_args_) return update(grads, state, params);
  autodiff::NoGradGuard no_grad;
  check_f32(name_ + ".update", "grads", grads);
  check_grads_against(grads, params);
  if (extra.grad) check_same_structure(name_ + ".update", "extra.grad", *extra.grad, "params", params);
  ExtraArgs with_grad = extra;
  if (!with_grad.grad) with_grad.grad = grads;
  return update_with_args_(grads, state, &params, with_grad);
}

StepResult GradientTransformation::step(Tree params, const Tree& grads, Tree state) const {
  autodiff::NoGradGuard no_grad;
  if (step_) {
    check_f32(name_ + ".step", "grads", grads);
    check_same_structure(name_ + ".step", "grads", grads, "params", params);
    return step_(std::move(params), grads, std::move(state));
  }
  UpdateResult r = update(grads, state, params);
  return StepResult{apply_updates(params, r.updates), std::move(r.state)};
}

Tree apply_updates(const Tree& params, const Tree& updates) {
  autodiff::NoGradGuard no_grad;
  const std::string who = "optim::apply_updates";
  check_f32(who, "params", params);
  check_same_structure(who, "params", params, "updates", updates);
  return map2(params, updates, [](float p, float u) { return p + u; });
}

float global_norm(const Tree& tree) {
  check_f32("optim::global_norm", "tree", tree);
  // Exact sums of squares (train/square_sums.hpp): the same bits for any split of the leaves among
  // threads or shards; merged across shards inside a sharded optimizer step.
  SquareSum total;
  for (const SquareSum& leaf : leaf_square_sums(leaves(tree))) total.merge(leaf);
  return static_cast<float>(std::sqrt(total.value()));
}

// ---- transformations ---------------------------------------------------------------------------

GradientTransformation chain(std::vector<GradientTransformation> transformations) {
  const std::string name = detail::cat("optim::chain(", transformations.size(), " transformations)");
  auto ts = std::make_shared<const std::vector<GradientTransformation>>(std::move(transformations));
  auto init = [ts](const Tree& params) {
    Tree state;
    for (std::size_t i = 0; i < ts->size(); ++i) state.set(std::to_string(i), (*ts)[i].init(params));
    return state;
  };
  auto update = [ts, name](const Tree& grads, const Tree& state, const Tree* params, const ExtraArgs& extra) {
    bool ok = state.is_dict() && state.size() == ts->size();
    for (std::size_t i = 0; ok && i < ts->size(); ++i) ok = state.contains(std::to_string(i));
    if (!ok)
      throw ValueError(detail::cat(name, ".update: the optimizer state has ",
                                   state.is_leaf() ? std::string("a single array") : "keys " + key_list(state),
                                   " but a chain of ", ts->size(), " transformations has keys 0..", ts->size() - 1,
                                   "; pass the state that init() (or the previous update()) returned"));
    Tree updates = grads;
    Tree new_state;
    for (std::size_t i = 0; i < ts->size(); ++i) {
      const std::string k = std::to_string(i);
      UpdateResult r = params ? (*ts)[i].update(updates, state.at(k), *params, extra) : (*ts)[i].update(updates, state.at(k));
      updates = std::move(r.updates);
      new_state.set(k, std::move(r.state));
    }
    return UpdateResult{std::move(updates), std::move(new_state)};
  };
  // A chain reads extra arguments when one of its members does, and passes them to every member.
  const bool with_args = std::any_of(ts->begin(), ts->end(), [](const GradientTransformation& t) { return t.uses_extra_args(); });
  GradientTransformation chained = passing_extra_args(with_args, name, std::move(init), std::move(update));
  return !ts->empty() && ts->front().takes_per_example_gradients() ? chained.taking_per_example_gradients() : chained;
}

GradientTransformation identity() {
  return GradientTransformation(
      "optim::identity", [](const Tree&) { return empty_state(); },
      [](const Tree& updates, const Tree& state, const Tree*) {
        check_state_keys("optim::identity.update", state, {});
        return UpdateResult{updates, empty_state()};
      });
}

GradientTransformation scale(double step_size) {
  const float s = f32(step_size);
  return GradientTransformation(
      "optim::scale", [](const Tree&) { return empty_state(); },
      [s](const Tree& updates, const Tree& state, const Tree*) {
        check_state_keys("optim::scale.update", state, {});
        return UpdateResult{map1(updates, [s](float g) { return s * g; }), empty_state()};
      });
}

GradientTransformation scale_by_schedule(Schedule schedule) {
  if (!schedule) throw ValueError("optim::scale_by_schedule: the schedule is empty; pass a callable");
  const std::string who = "optim::scale_by_schedule.update";
  return GradientTransformation(
      "optim::scale_by_schedule", [](const Tree&) { return Tree{{"count", count_array(0)}}; },
      [schedule = std::move(schedule), who](const Tree& updates, const Tree& state, const Tree*) {
        check_state_keys(who, state, {"count"});
        const std::int64_t count = read_count(who, state);
        const float s = schedule(count);
        return UpdateResult{map1(updates, [s](float g) { return s * g; }),
                            Tree{{"count", count_array(safe_increment(count))}}};
      });
}

GradientTransformation scale_by_learning_rate(LearningRate learning_rate) {
  if (!learning_rate.is_schedule() && !std::isfinite(learning_rate.value()))
    throw ValueError(detail::cat("optim: the learning rate must be a finite number, got ", learning_rate.value(),
                                 "; every update would be NaN"));
  if (!learning_rate.is_schedule()) return scale(-learning_rate.value());
  Schedule s = learning_rate.schedule();
  return scale_by_schedule([s](std::int64_t step) { return -s(step); });
}

GradientTransformation trace(double decay, bool nesterov) {
  const float d = f32(decay);
  const std::string who = "optim::trace.update";
  return GradientTransformation(
      "optim::trace", [](const Tree& params) { return Tree{{"trace", zeros_like(params)}}; },
      [d, nesterov, who](const Tree& updates, const Tree& state, const Tree*) {
        check_state_keys(who, state, {"trace"});
        const Tree& prev = state.at("trace");
        check_same_structure(who, "grads", updates, "state['trace']", prev);
        auto f = [d](float g, float t) { return g + d * t; };
        Tree new_trace = map2(updates, prev, f);
        Tree out = nesterov ? map2(updates, new_trace, f) : new_trace;
        return UpdateResult{std::move(out), Tree{{"trace", std::move(new_trace)}}};
      });
}

GradientTransformation scale_by_adam(double b1, double b2, double eps, double eps_root, bool nesterov) {
  if (!(b1 >= 0.0 && b1 < 1.0) || !(b2 >= 0.0 && b2 < 1.0) || !(eps >= 0.0) || !(eps_root >= 0.0) ||
      !std::isfinite(eps) || !std::isfinite(eps_root))
    throw ValueError(detail::cat("optim::scale_by_adam: needs 0 <= b1, b2 < 1 and finite eps, eps_root >= 0; got b1 = ", b1,
                                 ", b2 = ", b2, ", eps = ", eps, ", eps_root = ", eps_root));
  const std::string who = nesterov ? "optim::scale_by_adam(nesterov).update" : "optim::scale_by_adam.update";
  return GradientTransformation(
      nesterov ? "optim::scale_by_adam(nesterov)" : "optim::scale_by_adam",
      [](const Tree& params) {
        return Tree{{"count", count_array(0)}, {"mu", zeros_like(params)}, {"nu", zeros_like(params)}};
      },
      [=](const Tree& updates, const Tree& state, const Tree*) {
        check_state_keys(who, state, {"count", "mu", "nu"});
        const Tree& mu_prev = state.at("mu");
        const Tree& nu_prev = state.at("nu");
        check_same_structure(who, "grads", updates, "state['mu']", mu_prev);
        check_same_structure(who, "grads", updates, "state['nu']", nu_prev);
        // optax: (1 - decay) is formed from the Python float, then rounded to float32.
        const float c1 = f32(1.0 - b1), d1 = f32(b1), d2 = f32(b2);
        Tree mu = first_moment(updates, mu_prev, b1);
        Tree nu = second_moment(updates, nu_prev, b2);
        const std::int64_t count = safe_increment(read_count(who, state));
        // Bias corrections 1 - decay^t with the float32 decay, as optax's float32 arithmetic.
        const float bc1 = bias_correction(d1, count);
        const float bc2 = bias_correction(d2, count);
        const float e = f32(eps), er = f32(eps_root);
        auto rescale = [=](float m_hat, float v) { return m_hat / (std::sqrt(v / bc2 + er) + e); };
        // NAdam (nesterov): the first moment looks one step ahead,
        // b1 * mu / (1 - b1^(t+1)) + (1 - b1) * g / (1 - b1^t), as optax.
        const float bc1_next = bias_correction(d1, safe_increment(count));
        Tree out = nesterov ? map3(mu, updates, nu, [=](float m, float g, float v) {
                     return rescale(nesterov_moment(m, g, d1, c1, bc1, bc1_next), v);
                   })
                            : map2(mu, nu, [=](float m, float v) { return rescale(m / bc1, v); });
        return UpdateResult{std::move(out),
                            Tree{{"count", count_array(count)}, {"mu", std::move(mu)}, {"nu", std::move(nu)}}};
      });
}

GradientTransformation add_decayed_weights(double weight_decay) {
  const float wd = f32(weight_decay);
  const std::string who = "optim::add_decayed_weights.update";
  return GradientTransformation(
      "optim::add_decayed_weights", [](const Tree&) { return empty_state(); },
      [wd, weight_decay, who](const Tree& updates, const Tree& state, const Tree* params) {
        check_state_keys(who, state, {});
        if (weight_decay == 0.0) return UpdateResult{updates, empty_state()};
        if (!params)
          throw ValueError(detail::cat(who, ": weight decay needs the parameters; call update(grads, state, params)"));
        check_same_structure(who, "grads", updates, "params", *params);
        return UpdateResult{map2(updates, *params, [wd](float g, float p) { return g + wd * p; }), empty_state()};
      });
}

GradientTransformation clip_by_global_norm(double max_norm) {
  if (!(max_norm >= 0) || !std::isfinite(max_norm))
    throw ValueError(detail::cat("optim::clip_by_global_norm: max_norm must be a finite number >= 0, got ", max_norm));
  const float m = f32(max_norm);
  const std::string who = "optim::clip_by_global_norm.update";
  return GradientTransformation(
      "optim::clip_by_global_norm", [](const Tree&) { return empty_state(); },
      [m, who](const Tree& updates, const Tree& state, const Tree*) {
        check_state_keys(who, state, {});
        const float norm = global_norm(updates);
        if (norm < m) return UpdateResult{updates, empty_state()};
        return UpdateResult{map1(updates, [norm, m](float t) { return (t / norm) * m; }), empty_state()};
      });
}

// ---- optimizers ------------------------------------------------------------------------------

GradientTransformation sgd(LearningRate learning_rate, double momentum, bool nesterov) {
  if (!(momentum >= 0) || !std::isfinite(momentum))
    throw ValueError(detail::cat("optim::sgd: momentum must be a finite number >= 0, got ", momentum));
  GradientTransformation first = momentum == 0.0 ? identity() : trace(momentum, nesterov);
  return chain(std::move(first), scale_by_learning_rate(std::move(learning_rate)));
}

namespace {

// x[i] = sqrt(x[i]), correctly rounded, vectorized.
void sqrt_in_place(float* x, std::int64_t n) {
  std::int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, _mm512_sqrt_ps(_mm512_loadu_ps(x + i)));
#elif defined(__AVX__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_sqrt_ps(_mm256_loadu_ps(x + i)));
#endif
  for (; i < n; ++i) x[i] = std::sqrt(x[i]);
}

// Takes the array out of a leaf, leaving a placeholder, so that the caller holds the only
// reference when nobody else does (then the buffer may be written in place).
Array take_leaf(Tree& leaf) {
  static const Array placeholder = Array::zeros(Shape{});
  Array a = leaf.array();
  leaf = Tree(placeholder);
  return a;
}

// An array to write leaf-sized results into: `a`'s own buffer when nothing else refers to it,
// else a fresh one.
Array writable(const Array& a) { return a.owns_buffer_alone() && !a.node() ? a : Array::empty(a.shape()); }

// Calls f(param, grad, mu, nu) for corresponding leaves (the structures were checked equal),
// where param/mu/nu are taken out of their trees and replaced by what f leaves in them.
template <class F>
void for_each_adam_leaf(Tree& params, const Tree& grads, Tree& mu, Tree& nu, F& f) {
  if (grads.is_leaf()) {
    Array p = take_leaf(params), m = take_leaf(mu), v = take_leaf(nu);
    f(p, grads.array(), m, v);
    params = Tree(std::move(p));
    mu = Tree(std::move(m));
    nu = Tree(std::move(v));
    return;
  }
  for (const auto& [key, sub] : grads) for_each_adam_leaf(params.at(key), sub, mu.at(key), nu.at(key), f);
}

bool all_f32(const Tree& t) {
  for (const Array& a : leaves(t))
    if (a.dtype() != DType::f32) return false;
  return true;
}

// adam / adamw as one pass per leaf, with a constant learning rate or a schedule. The arithmetic is
// the chain's, operation for operation (scale_by_adam, add_decayed_weights, scale or
// scale_by_schedule, apply_updates), so the results are the same floats; a schedule is called once
// per step with the chain's own count, as scale_by_schedule calls it.
GradientTransformation::StepFn fused_adam_step(GradientTransformation chained, double b1, double b2, double eps,
                                               double eps_root, double weight_decay, LearningRate learning_rate) {
  return [=](Tree&& params, const Tree& grads, Tree&& state) -> StepResult {
    const std::string who = chained.name() + ".step";
    const std::string adam_key = "0", lr_key = weight_decay != 0.0 ? "2" : "1";
    const bool scheduled = learning_rate.is_schedule();
    const bool layout_ok = state.is_dict() && state.contains(adam_key) && state.contains(lr_key) &&
                           state.size() == (weight_decay != 0.0 ? 3u : 2u) && state.at(adam_key).is_dict() &&
                           state.at(adam_key).contains("mu") && state.at(adam_key).contains("nu") &&
                           (!scheduled || (state.at(lr_key).is_dict() && state.at(lr_key).contains("count")));
    if (!layout_ok || !all_f32(params) || !all_f32(grads) || !all_f32(state.at(adam_key).at("mu")) ||
        !all_f32(state.at(adam_key).at("nu"))) {
      UpdateResult r = chained.update(grads, state, params);  // the general path (and its error messages)
      return StepResult{apply_updates(params, r.updates), std::move(r.state)};
    }
    Tree& adam_state = state.at(adam_key);
    check_state_keys("optim::scale_by_adam.update", adam_state, {"count", "mu", "nu"});
    check_same_structure(who, "grads", grads, "state['mu']", adam_state.at("mu"));
    check_same_structure(who, "grads", grads, "state['nu']", adam_state.at("nu"));
    const std::int64_t count = safe_increment(read_count("optim::scale_by_adam.update", adam_state));
    const float c1 = f32(1.0 - b1), d1 = f32(b1), c2 = f32(1.0 - b2), d2 = f32(b2);
    const float bc1 = bias_correction(d1, count);
    const float bc2 = bias_correction(d2, count);
    // The learning rate's factor: scale(-lr) for a constant, scale_by_schedule's -schedule(count)
    // (its own count, read before it is incremented) for a schedule.
    std::int64_t schedule_count = 0;
    float s = 0.0f;
    if (scheduled) {
      const char* schedule_who = "optim::scale_by_schedule.update";
      check_state_keys(schedule_who, state.at(lr_key), {"count"});
      schedule_count = read_count(schedule_who, state.at(lr_key));
      const float rate = learning_rate.schedule()(schedule_count);
      s = -rate;
    } else {
      s = f32(-learning_rate.value());
    }
    const float e = f32(eps), er = f32(eps_root), wd = f32(weight_decay);
    const bool decay = weight_decay != 0.0;
    Tree mu = std::move(adam_state.at("mu")), nu = std::move(adam_state.at("nu"));
    adam_state = Tree();
    auto update_leaf = [&](Array& p_arr, const Array& g_arr, Array& m_arr, Array& v_arr) {
      Array p_out = writable(p_arr), m_out = writable(m_arr), v_out = writable(v_arr);
      const float* g = g_arr.data();
      const float* p_in = p_arr.data();
      const float* m_in = m_arr.data();
      const float* v_in = v_arr.data();
      float* p = p_out.mutable_data();
      float* m = m_out.mutable_data();
      float* v = v_out.mutable_data();
      // Eigen array expressions (explicitly vectorized); every operation rounds as the scalar
      // path's does (IEEE division and square root, no contraction in this file).
      ops::detail::for_blocks(g_arr.numel(), [=](std::int64_t begin, std::int64_t n) {
        using Map = Eigen::Map<Eigen::ArrayXf>;
        using CMap = Eigen::Map<const Eigen::ArrayXf>;
        const CMap gj(g + begin, n), pj(p_in + begin, n);
        Map mj(m + begin, n), vj(v + begin, n), out(p + begin, n);
        mj = c1 * gj + d1 * CMap(m_in + begin, n);
        vj = c2 * (gj * gj) + d2 * CMap(v_in + begin, n);
        thread_local std::vector<float> scratch;
        if (static_cast<std::int64_t>(scratch.size()) < n) scratch.resize(static_cast<std::size_t>(n));
        Map u(scratch.data(), n);
        u = vj / bc2 + er;
        sqrt_in_place(u.data(), n);  // correctly rounded, as std::sqrt (Eigen's fast-math sqrt is not)
        u = (mj / bc1) / (u + e);
        if (decay) u = u + wd * pj;
        u = s * u;
        out = pj + u;
      });
      p_arr = std::move(p_out);
      m_arr = std::move(m_out);
      v_arr = std::move(v_out);
    };
    for_each_adam_leaf(params, grads, mu, nu, update_leaf);
    Tree next = std::move(state);
    next.set(adam_key, Tree{{"count", count_array(count)}, {"mu", std::move(mu)}, {"nu", std::move(nu)}});
    if (scheduled) next.set(lr_key, Tree{{"count", count_array(safe_increment(schedule_count))}});
    return StepResult{std::move(params), std::move(next)};
  };
}

}  // namespace

GradientTransformation adam(LearningRate learning_rate, double b1, double b2, double eps, double eps_root) {
  GradientTransformation t = chain(scale_by_adam(b1, b2, eps, eps_root), scale_by_learning_rate(learning_rate));
  return t.with_fused_step(fused_adam_step(t, b1, b2, eps, eps_root, 0.0, std::move(learning_rate)));
}

GradientTransformation adamw(LearningRate learning_rate, double b1, double b2, double eps, double weight_decay,
                             double eps_root) {
  GradientTransformation t = chain(scale_by_adam(b1, b2, eps, eps_root), add_decayed_weights(weight_decay),
                                   scale_by_learning_rate(learning_rate));
  return t.with_fused_step(fused_adam_step(t, b1, b2, eps, eps_root, weight_decay, std::move(learning_rate)));
}

}  // namespace linum::optim
