// The optax toolbox beyond sgd/adam/adamw (train/optim.hpp): more schedules, the rescalings of
// RMSProp, Adagrad, Lion, AdaBelief, LAMB and Adafactor and those optimizers, and the wrappers
// masked, apply_if_finite and multi_steps. Formulas and state layouts are optax's (current
// main), evaluated in float32 with hyperparameters rounded once from double, as JAX does.
// Compiled with -ffp-contract=off (train/meson.build), as are the other optimizer sources.

#include <linum/train/optim.hpp>
#include <linum/train/square_sums.hpp>
#include <linum/train/optim_internal.hpp>
#include <linum/core/ops/all.hpp>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numbers>

namespace linum::optim {

using namespace internal;

// ---- schedules ---------------------------------------------------------------------------------

Schedule exponential_decay(float init_value, std::int64_t transition_steps, float decay_rate,
                           std::int64_t transition_begin, bool staircase, std::optional<float> end_value) {
  if (transition_steps <= 0) return constant_schedule(init_value);
  if (decay_rate == 0.0f)
    throw ValueError("optim::exponential_decay: decay_rate is 0 (every value after the start would be 0); "
                     "use a rate in (0, 1) to decay");
  if (transition_begin < 0) transition_begin = 0;
  return [=](std::int64_t step) {
    const std::int64_t decreased = step - transition_begin;
    double p = static_cast<double>(decreased) / static_cast<double>(transition_steps);
    if (staircase) p = std::floor(p);
    double value = decreased <= 0 ? init_value : init_value * std::pow(static_cast<double>(decay_rate), p);
    if (end_value) value = decay_rate < 1.0f ? std::max<double>(value, *end_value) : std::min<double>(value, *end_value);
    return static_cast<float>(value);
  };
}

Schedule piecewise_constant_schedule(float init_value, std::vector<std::pair<std::int64_t, float>> boundaries_and_scales) {
  std::sort(boundaries_and_scales.begin(), boundaries_and_scales.end());
  return [=](std::int64_t step) {
    double v = init_value;
    for (const auto& [boundary, scale] : boundaries_and_scales)
      if (step >= boundary) v *= scale;
    return static_cast<float>(v);
  };
}

Schedule polynomial_schedule(float init_value, float end_value, double power, std::int64_t transition_steps,
                             std::int64_t transition_begin) {
  if (transition_steps <= 0) return constant_schedule(init_value);
  if (transition_begin < 0) transition_begin = 0;
  return [=](std::int64_t step) {
    const std::int64_t t = std::clamp<std::int64_t>(step - transition_begin, 0, transition_steps);
    const double frac = 1.0 - static_cast<double>(t) / static_cast<double>(transition_steps);
    return static_cast<float>((static_cast<double>(init_value) - end_value) * std::pow(frac, power) + end_value);
  };
}

Schedule join_schedules(std::vector<Schedule> schedules, std::vector<std::int64_t> boundaries) {
  if (schedules.empty() || boundaries.size() + 1 != schedules.size())
    throw ValueError(detail::cat("optim::join_schedules: needs one boundary fewer than schedules, got ", schedules.size(),
                                 " schedule(s) and ", boundaries.size(), " boundary(ies)"));
  for (const Schedule& s : schedules)
    if (!s) throw ValueError("optim::join_schedules: a schedule is empty; pass callables");
  return [schedules = std::move(schedules), boundaries = std::move(boundaries)](std::int64_t step) {
    float out = schedules[0](step);
    for (std::size_t i = 0; i < boundaries.size(); ++i)
      if (step >= boundaries[i]) out = schedules[i + 1](step - boundaries[i]);
    return out;
  };
}

Schedule cosine_onecycle_schedule(std::int64_t transition_steps, float peak_value, double pct_start, double div_factor,
                                  double final_div_factor) {
  if (transition_steps <= 0)
    throw ValueError(detail::cat("optim::cosine_onecycle_schedule: transition_steps must be positive, got ", transition_steps));
  // optax's piecewise_interpolate_schedule('cosine', peak / div, {pct * T: div, T: 1 / (div * final)}).
  const double init = static_cast<double>(peak_value) / div_factor;
  const std::int64_t b1 = static_cast<std::int64_t>(pct_start * static_cast<double>(transition_steps));
  const std::int64_t b2 = transition_steps;
  const double v0 = init, v1 = init * div_factor, v2 = v1 / (div_factor * final_div_factor);
  auto cosine = [](double start, double end, double pct) {
    return end + (start - end) / 2.0 * (std::cos(std::numbers::pi * pct) + 1.0);
  };
  return [=](std::int64_t step) {
    const double c = static_cast<double>(step);
    double v = 0;
    if (step >= 0 && step < b1) v = cosine(v0, v1, c / static_cast<double>(b1));
    else if (step >= b1 && step < b2) v = cosine(v1, v2, (c - static_cast<double>(b1)) / static_cast<double>(b2 - b1));
    if (step >= b2) v += v2;
    return static_cast<float>(v);
  };
}

// ---- helpers -----------------------------------------------------------------------------------

namespace {

// Each leaf's sum of squares and element count, exact and merged across shards (square_sums.hpp).
std::vector<SquareSum> square_sums(const Tree& tree) { return leaf_square_sums(leaves(tree)); }

// A leaf's root-mean-square from its (whole-parameter) sum of squares.
float rms_of(const SquareSum& s) {
  return static_cast<float>(std::sqrt(s.value() / static_cast<double>(std::max<std::int64_t>(s.count(), 1))));
}

// Leaf-by-leaf f(update, param) -> update, with one float per leaf computed from both.
template <class PerLeaf>
Tree map_leaves(const Tree& updates, const Tree* params, PerLeaf per_leaf) {
  const std::vector<Array> u = leaves(updates);
  std::vector<Array> p = params ? leaves(*params) : std::vector<Array>(u.size());
  std::vector<Array> out;
  out.reserve(u.size());
  for (std::size_t i = 0; i < u.size(); ++i) out.push_back(per_leaf(u[i], p[i]));
  return with_leaves(updates, out);
}

Array scaled(const Array& a, float factor) {
  autodiff::NoGradGuard constants;
  return map1(Tree(a), [factor](float x) { return x * factor; }).array();
}

// The selected leaves of `tree` as a tree (their paths only), and a tree with `sub`'s leaves put
// back into `tree` at those paths.
Tree select(const Tree& tree, const std::vector<std::string>& paths) {
  std::vector<std::pair<std::string, Array>> items;
  for (const std::string& path : paths) items.emplace_back(path, tree.at_path(path).array());
  return paths.empty() ? Tree() : unflatten(items);
}

std::vector<std::string> masked_paths(const Tree& tree, const Mask& mask) {
  std::vector<std::string> out;
  for (const auto& [path, leaf] : flatten(tree))
    if (mask(path, leaf)) out.push_back(path);
  return out;
}

bool all_finite(const Tree& tree) {
  for (const Array& leaf : leaves(tree)) {
    const Array a = leaf.dtype() == DType::f32 ? leaf : astype(leaf, DType::f32);
    const float* p = a.data();
    for (std::int64_t i = 0; i < a.numel(); ++i)
      if (!std::isfinite(p[i])) return false;
  }
  return true;
}

std::int64_t read_scalar(const std::string& who, const Tree& state, std::string_view key) {
  const Tree& c = state.at(key);
  if (!c.is_leaf() || c.array().rank() != 0)
    throw ValueError(detail::cat(who, ": the state's '", key, "' must be a scalar array; pass the state that init() returned"));
  const Array& a = c.array();
  return a.dtype() == DType::i32 ? a.data_i32()[0] : static_cast<std::int64_t>(a.data()[0]);
}

}  // namespace

// ---- rescalings ----------------------------------------------------------------------------------

GradientTransformation scale_by_rms(double decay, double eps, double initial_scale, bool eps_in_sqrt) {
  const std::string who = "optim::scale_by_rms.update";
  const float init = f32(initial_scale);
  return GradientTransformation(
      "optim::scale_by_rms", [init](const Tree& params) { return Tree{{"nu", full_like(params, init)}}; },
      [=](const Tree& updates, const Tree& state, const Tree*) {
        check_state_keys(who, state, {"nu"});
        check_same_structure(who, "grads", updates, "state['nu']", state.at("nu"));
        const float c = f32(1.0 - decay), d = f32(decay), e = f32(eps);
        Tree nu = map2(updates, state.at("nu"), [=](float g, float v) { return c * (g * g) + d * v; });
        Tree out = map2(updates, nu, [=](float g, float v) {
          return eps_in_sqrt ? (1.0f / std::sqrt(v + e)) * g : (1.0f / (std::sqrt(v) + e)) * g;
        });
        return UpdateResult{std::move(out), Tree{{"nu", std::move(nu)}}};
      });
}

GradientTransformation scale_by_stddev(double decay, double eps, double initial_scale, bool eps_in_sqrt) {
  const std::string who = "optim::scale_by_stddev.update";
  const float init = f32(initial_scale);
  return GradientTransformation(
      "optim::scale_by_stddev",
      [init](const Tree& params) { return Tree{{"mu", zeros_like(params)}, {"nu", full_like(params, init)}}; },
      [=](const Tree& updates, const Tree& state, const Tree*) {
        check_state_keys(who, state, {"mu", "nu"});
        check_same_structure(who, "grads", updates, "state['mu']", state.at("mu"));
        check_same_structure(who, "grads", updates, "state['nu']", state.at("nu"));
        const float e = f32(eps);
        Tree mu = first_moment(updates, state.at("mu"), decay);
        Tree nu = second_moment(updates, state.at("nu"), decay);
        Tree out = map3(updates, mu, nu, [=](float g, float m, float v) {
          return eps_in_sqrt ? (1.0f / std::sqrt(v - m * m + e)) * g : (1.0f / (std::sqrt(v - m * m) + e)) * g;
        });
        return UpdateResult{std::move(out), Tree{{"mu", std::move(mu)}, {"nu", std::move(nu)}}};
      });
}

GradientTransformation scale_by_rss(double initial_accumulator_value, double eps) {
  const std::string who = "optim::scale_by_rss.update";
  const float init = f32(initial_accumulator_value);
  return GradientTransformation(
      "optim::scale_by_rss", [init](const Tree& params) { return Tree{{"sum_of_squares", full_like(params, init)}}; },
      [=](const Tree& updates, const Tree& state, const Tree*) {
        check_state_keys(who, state, {"sum_of_squares"});
        check_same_structure(who, "grads", updates, "state['sum_of_squares']", state.at("sum_of_squares"));
        const float e = f32(eps);
        Tree sos = map2(updates, state.at("sum_of_squares"), [](float g, float t) { return g * g + t; });
        Tree out = map2(updates, sos, [e](float g, float t) { return (t > 0.0f ? 1.0f / std::sqrt(t + e) : 0.0f) * g; });
        return UpdateResult{std::move(out), Tree{{"sum_of_squares", std::move(sos)}}};
      });
}

GradientTransformation scale_by_lion(double b1, double b2) {
  const std::string who = "optim::scale_by_lion.update";
  return GradientTransformation(
      "optim::scale_by_lion", [](const Tree& params) { return Tree{{"count", count_array(0)}, {"mu", zeros_like(params)}}; },
      [=](const Tree& updates, const Tree& state, const Tree*) {
        check_state_keys(who, state, {"count", "mu"});
        check_same_structure(who, "grads", updates, "state['mu']", state.at("mu"));
        const float c1 = f32(1.0 - b1), d1 = f32(b1);
        Tree out = map2(updates, state.at("mu"), [=](float g, float m) {
          const float x = c1 * g + d1 * m;
          return x > 0.0f ? 1.0f : x < 0.0f ? -1.0f : x;  // jnp.sign (NaN stays NaN, 0 stays 0)
        });
        Tree mu = first_moment(updates, state.at("mu"), b2);
        const std::int64_t count = safe_increment(read_count(who, state));
        return UpdateResult{std::move(out), Tree{{"count", count_array(count)}, {"mu", std::move(mu)}}};
      });
}

GradientTransformation scale_by_belief(double b1, double b2, double eps, double eps_root) {
  const std::string who = "optim::scale_by_belief.update";
  return GradientTransformation(
      "optim::scale_by_belief",
      [](const Tree& params) { return Tree{{"count", count_array(0)}, {"mu", zeros_like(params)}, {"nu", zeros_like(params)}}; },
      [=](const Tree& updates, const Tree& state, const Tree*) {
        check_state_keys(who, state, {"count", "mu", "nu"});
        check_same_structure(who, "grads", updates, "state['mu']", state.at("mu"));
        check_same_structure(who, "grads", updates, "state['nu']", state.at("nu"));
        const float c2 = f32(1.0 - b2), d1 = f32(b1), d2 = f32(b2), er = f32(eps_root), e = f32(eps);
        Tree mu = first_moment(updates, state.at("mu"), b1);
        // optax: the prediction error uses the new first moment.
        Tree nu = map3(updates, mu, state.at("nu"), [=](float g, float m, float s) {
          const float err = g - m;
          return (c2 * (err * err) + d2 * s) + er;
        });
        const std::int64_t count = safe_increment(read_count(who, state));
        const float bc1 = bias_correction(d1, count);
        const float bc2 = bias_correction(d2, count);
        Tree out = map2(mu, nu, [=](float m, float s) { return (m / bc1) / (std::sqrt(s / bc2) + e); });
        return UpdateResult{std::move(out), Tree{{"count", count_array(count)}, {"mu", std::move(mu)}, {"nu", std::move(nu)}}};
      });
}

GradientTransformation scale_by_trust_ratio(double min_norm, double trust_coefficient, double eps) {
  const std::string who = "optim::scale_by_trust_ratio.update";
  return GradientTransformation(
      "optim::scale_by_trust_ratio", [](const Tree&) { return empty_state(); },
      [=](const Tree& updates, const Tree& state, const Tree* params) {
        check_state_keys(who, state, {});
        if (!params) throw ValueError(who + ": the trust ratio needs the parameters; call update(grads, state, params)");
        check_same_structure(who, "grads", updates, "params", *params);
        const float mn = f32(min_norm), tc = f32(trust_coefficient), e = f32(eps);
        // Both norms of every leaf in one exchange when the leaves are shards.
        std::vector<Array> both = leaves(*params);
        const std::size_t count = both.size();
        for (const Array& u : leaves(updates)) both.push_back(u);
        const std::vector<SquareSum> sums = leaf_square_sums(both);
        std::size_t at = 0;
        Tree out = map_leaves(updates, params, [&](const Array& u, const Array&) {
          const std::size_t i = at++;
          const float param_norm = std::max(static_cast<float>(std::sqrt(sums[i].value())), mn);
          const float update_norm = std::max(static_cast<float>(std::sqrt(sums[count + i].value())), mn);
          const float ratio = (param_norm == 0.0f || update_norm == 0.0f) ? 1.0f : tc * param_norm / (update_norm + e);
          return scaled(u, ratio);
        });
        return UpdateResult{std::move(out), empty_state()};
      });
}

namespace {

// optax's _factored_dims: the two largest dimensions (second-largest first), or none.
std::optional<std::pair<int, int>> factored_dims(const Shape& shape, bool factored, std::int64_t min_dim) {
  if (!factored || shape.rank() < 2) return std::nullopt;
  std::vector<int> order(static_cast<std::size_t>(shape.rank()));
  for (int i = 0; i < shape.rank(); ++i) order[static_cast<std::size_t>(i)] = i;
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return shape[a] < shape[b]; });
  const int d1 = order[order.size() - 2], d0 = order.back();
  if (shape[d1] < min_dim) return std::nullopt;
  return std::make_pair(d1, d0);
}

Shape without_axis(const Shape& s, int axis) {
  std::vector<std::int64_t> dims;
  for (int i = 0; i < s.rank(); ++i)
    if (i != axis) dims.push_back(s[i]);
  return Shape(dims);
}

}  // namespace

GradientTransformation scale_by_factored_rms(bool factored, double decay_rate, std::int64_t step_offset,
                                             std::int64_t min_dim_size_to_factor, double eps) {
  const std::string who = "optim::scale_by_factored_rms.update";
  const std::string whole = "factored second moments depend on each parameter's whole shape (factored = false works)";
  auto init = [=](const Tree& params) {
    if (factored) require_whole_leaves("optim::scale_by_factored_rms.init", whole);
    Tree v_row, v_col, v;
    std::vector<std::pair<std::string, Array>> rows, cols, fulls;
    for (const auto& [path, p] : flatten(params)) {
      const Array one = Array::zeros(Shape{1}, p.dtype());
      if (auto dims = factored_dims(p.shape(), factored, min_dim_size_to_factor)) {
        rows.emplace_back(path, Array::zeros(without_axis(p.shape(), dims->second), p.dtype()));
        cols.emplace_back(path, Array::zeros(without_axis(p.shape(), dims->first), p.dtype()));
        fulls.emplace_back(path, one);
      } else {
        rows.emplace_back(path, one);
        cols.emplace_back(path, one);
        fulls.emplace_back(path, Array::zeros(p.shape(), p.dtype()));
      }
    }
    return Tree{{"count", count_array(0)}, {"v_row", with_leaves(params, [&] {
                                                 std::vector<Array> a;
                                                 for (auto& r : rows) a.push_back(r.second);
                                                 return a;
                                               }())},
                {"v_col", with_leaves(params, [&] {
                   std::vector<Array> a;
                   for (auto& c : cols) a.push_back(c.second);
                   return a;
                 }())},
                {"v", with_leaves(params, [&] {
                   std::vector<Array> a;
                   for (auto& f : fulls) a.push_back(f.second);
                   return a;
                 }())}};
  };
  return GradientTransformation(
      "optim::scale_by_factored_rms", init, [=](const Tree& grads, const Tree& state, const Tree* params) {
        if (factored) require_whole_leaves(who, whole);
        check_state_keys(who, state, {"count", "v_row", "v_col", "v"});
        if (!params) throw ValueError(who + ": Adafactor needs the parameters; call update(grads, state, params)");
        check_same_structure(who, "grads", grads, "params", *params);
        autodiff::NoGradGuard constants;
        const std::int64_t count = read_count(who, state);
        // optax's _decay_rate_pow: 1 - (step + 1)^-decay_rate, in float32.
        const float t = static_cast<float>(count - step_offset + 1);
        const float decay_t = 1.0f - std::pow(t, -f32(decay_rate));
        const float keep = decay_t, fresh = 1.0f - decay_t, e = f32(eps);
        const auto g = leaves(grads), vr = leaves(state.at("v_row")), vc = leaves(state.at("v_col")),
                   vf = leaves(state.at("v"));
        if (vr.size() != g.size() || vc.size() != g.size() || vf.size() != g.size())
          throw ValueError(who + ": the state does not match the gradients; pass the state that init(params) returned");
        std::vector<Array> out, new_r, new_c, new_v;
        for (std::size_t i = 0; i < g.size(); ++i) {
          const Array gi = astype(g[i], DType::f32);
          const Array grad_sqr = square(gi) + e;
          const Array one = Array::zeros(Shape{1}, g[i].dtype());
          if (auto dims = factored_dims(gi.shape(), factored, min_dim_size_to_factor)) {
            const auto [d1, d0] = *dims;
            const Array row = astype(vr[i], DType::f32) * keep + mean(grad_sqr, {d0}) * fresh;
            const Array col = astype(vc[i], DType::f32) * keep + mean(grad_sqr, {d1}) * fresh;
            const int reduced_d1 = d1 > d0 ? d1 - 1 : d1;
            const Array row_col_mean = mean(row, {reduced_d1}, /*keepdims=*/true);
            const Array row_factor = rsqrt(row / row_col_mean);
            const Array col_factor = rsqrt(col);
            out.push_back(astype(gi * expand_dims(row_factor, d0) * expand_dims(col_factor, d1), g[i].dtype()));
            new_r.push_back(astype(row, g[i].dtype()));
            new_c.push_back(astype(col, g[i].dtype()));
            new_v.push_back(one);
          } else {
            const Array v = astype(vf[i], DType::f32) * keep + grad_sqr * fresh;
            out.push_back(astype(gi * rsqrt(v), g[i].dtype()));
            new_r.push_back(one);
            new_c.push_back(one);
            new_v.push_back(astype(v, g[i].dtype()));
          }
        }
        return UpdateResult{with_leaves(grads, out),
                            Tree{{"count", count_array(safe_increment(count))},
                                 {"v_row", with_leaves(grads, new_r)},
                                 {"v_col", with_leaves(grads, new_c)},
                                 {"v", with_leaves(grads, new_v)}}};
      });
}

GradientTransformation clip_by_block_rms(double threshold) {
  if (!(threshold > 0) || !std::isfinite(threshold))
    throw ValueError(detail::cat("optim::clip_by_block_rms: threshold must be a finite number > 0, got ", threshold));
  const std::string who = "optim::clip_by_block_rms.update";
  const float th = f32(threshold);
  return GradientTransformation(
      "optim::clip_by_block_rms", [](const Tree&) { return empty_state(); },
      [=](const Tree& updates, const Tree& state, const Tree*) {
        check_state_keys(who, state, {});
        const std::vector<SquareSum> sums = square_sums(updates);
        std::size_t at = 0;
        Tree out = map_leaves(updates, nullptr, [&](const Array& u, const Array&) {
          const float rms = rms_of(sums[at++]);
          const float denom = std::max(1.0f, rms / th);
          autodiff::NoGradGuard constants;
          return map1(Tree(u), [denom](float x) { return x / denom; }).array();
        });
        return UpdateResult{std::move(out), empty_state()};
      });
}

GradientTransformation scale_by_param_block_rms(double min_scale) {
  const std::string who = "optim::scale_by_param_block_rms.update";
  const float ms = f32(min_scale);
  return GradientTransformation(
      "optim::scale_by_param_block_rms", [](const Tree&) { return empty_state(); },
      [=](const Tree& updates, const Tree& state, const Tree* params) {
        check_state_keys(who, state, {});
        if (!params) throw ValueError(who + ": needs the parameters; call update(grads, state, params)");
        check_same_structure(who, "grads", updates, "params", *params);
        const std::vector<SquareSum> sums = square_sums(*params);
        std::size_t at = 0;
        Tree out = map_leaves(updates, params, [&](const Array& u, const Array&) {
          const float rms = rms_of(sums[at++]);
          return scaled(u, std::max(rms, ms));
        });
        return UpdateResult{std::move(out), empty_state()};
      });
}

GradientTransformation ema(double decay, bool debias) {
  const std::string who = "optim::ema.update";
  return GradientTransformation(
      "optim::ema", [](const Tree& params) { return Tree{{"count", count_array(0)}, {"ema", zeros_like(params)}}; },
      [=](const Tree& updates, const Tree& state, const Tree*) {
        check_state_keys(who, state, {"count", "ema"});
        check_same_structure(who, "grads", updates, "state['ema']", state.at("ema"));
        const float d = f32(decay);
        Tree avg = first_moment(updates, state.at("ema"), decay);
        const std::int64_t count = safe_increment(read_count(who, state));
        Tree out = avg;
        if (debias) {
          const float bc = bias_correction(d, count);
          out = map1(avg, [bc](float m) { return m / bc; });
        }
        return UpdateResult{std::move(out), Tree{{"count", count_array(count)}, {"ema", std::move(avg)}}};
      });
}

GradientTransformation add_decayed_weights(double weight_decay, Mask mask) {
  if (!mask) throw ValueError("optim::add_decayed_weights: the mask is empty; pass a callable (path, leaf) -> bool");
  return masked(add_decayed_weights(weight_decay), std::move(mask));
}

// ---- wrappers ------------------------------------------------------------------------------------

GradientTransformation masked(GradientTransformation inner, Mask mask) {
  if (!mask) throw ValueError("optim::masked: the mask is empty; pass a callable (path, leaf) -> bool");
  const std::string who = "optim::masked(" + inner.name() + ")";
  auto shared = std::make_shared<const GradientTransformation>(std::move(inner));
  return GradientTransformation(
      who,
      [shared, mask](const Tree& params) {
        return Tree{{"inner_state", shared->init(select(params, masked_paths(params, mask)))}};
      },
      [shared, mask, who](const Tree& updates, const Tree& state, const Tree* params) {
        check_state_keys(who + ".update", state, {"inner_state"});
        // The selection follows the params when given (as optax's mask of params), else the updates.
        const std::vector<std::string> paths = masked_paths(params ? *params : updates, mask);
        Tree out = updates;
        if (paths.empty()) return UpdateResult{std::move(out), state};
        const Tree sub_updates = select(updates, paths);
        UpdateResult r = params ? shared->update(sub_updates, state.at("inner_state"), select(*params, paths))
                                : shared->update(sub_updates, state.at("inner_state"));
        for (const auto& [path, leaf] : flatten(r.updates)) out.set_path(path, leaf);
        return UpdateResult{std::move(out), Tree{{"inner_state", std::move(r.state)}}};
      });
}

GradientTransformation multi_transform(std::vector<std::pair<std::string, GradientTransformation>> transforms, Labels labels) {
  if (!labels) throw ValueError("optim::multi_transform: the labels are empty; pass a callable (path, leaf) -> label");
  std::string names;
  for (const auto& [label, t] : transforms) names += (names.empty() ? "" : ", ") + label;
  for (std::size_t i = 0; i < transforms.size(); ++i)
    for (std::size_t j = 0; j < i; ++j)
      if (transforms[i].first == transforms[j].first)
        throw ValueError(detail::cat("optim::multi_transform: label '", transforms[i].first, "' is given twice (", names, ")"));
  const std::string who = "optim::multi_transform(" + names + ")";
  // Every leaf's label must name a transformation (checked on the params at init, on the updates after).
  std::vector<std::string> known;
  for (const auto& [label, t] : transforms) known.push_back(label);
  auto check_labels = [labels, known, names](const std::string& where, const Tree& tree) {
    for (const auto& [path, leaf] : flatten(tree)) {
      const std::string label = labels(path, leaf);
      if (std::find(known.begin(), known.end(), label) == known.end())
        throw ValueError(detail::cat(where, ": leaf '", path, "' has label '", label, "', which has no transformation (labels with one: ",
                                     names.empty() ? std::string("none") : names, ")"));
    }
  };
  auto groups = std::make_shared<std::vector<std::pair<std::string, GradientTransformation>>>();
  for (auto& entry : transforms) {
    const std::string label = entry.first;  // (a copy: clang 14 cannot capture a structured binding)
    groups->emplace_back(label, masked(std::move(entry.second), [labels, label](const std::string& path, const Array& leaf) {
                           return labels(path, leaf) == label;
                         }));
  }
  return GradientTransformation(
      who,
      [groups, check_labels, who](const Tree& params) {
        check_labels(who + ".init", params);
        Tree inner;
        for (const auto& [label, t] : *groups) inner.set(label, t.init(params));
        return Tree{{"inner_states", std::move(inner)}};
      },
      [groups, check_labels, who](const Tree& updates, const Tree& state, const Tree* params) {
        const std::string w = who + ".update";
        check_state_keys(w, state, {"inner_states"});
        check_labels(w, params ? *params : updates);
        const Tree& inner = state.at("inner_states");
        Tree out = updates, next;
        for (const auto& [label, t] : *groups) {
          if (!inner.contains(label))
            throw ValueError(detail::cat(w, ": the state has no inner state for label '", label, "'; pass the state init() returned"));
          UpdateResult r = params ? t.update(out, inner.at(label), *params) : t.update(out, inner.at(label));
          out = std::move(r.updates);
          next.set(label, std::move(r.state));
        }
        return UpdateResult{std::move(out), Tree{{"inner_states", std::move(next)}}};
      });
}

GradientTransformation apply_if_finite(GradientTransformation inner, std::int64_t max_consecutive_errors) {
  if (max_consecutive_errors < 0)
    throw ValueError(detail::cat("optim::apply_if_finite: max_consecutive_errors must be >= 0, got ", max_consecutive_errors));
  const std::string who = "optim::apply_if_finite(" + inner.name() + ")";
  auto shared = std::make_shared<const GradientTransformation>(std::move(inner));
  return passing_extra_args(
      shared->uses_extra_args(), who,
      [shared](const Tree& params) {
        return Tree{{"notfinite_count", count_array(0)},
                    {"last_finite", Array::full_i32(Shape{}, 1)},
                    {"total_notfinite", count_array(0)},
                    {"inner_state", shared->init(params)}};
      },
      [shared, who, max_consecutive_errors](const Tree& updates, const Tree& state, const Tree* params, const ExtraArgs& extra) {
        const std::string w = who + ".update";
        check_state_keys(w, state, {"notfinite_count", "last_finite", "total_notfinite", "inner_state"});
        const bool finite = all_across_shards(all_finite(updates));  // every shard skips, or none
        const std::int64_t notfinite = finite ? 0 : safe_increment(read_scalar(w, state, "notfinite_count"));
        const std::int64_t total = read_scalar(w, state, "total_notfinite");
        Tree out, inner_state;
        if (finite || notfinite > max_consecutive_errors) {
          UpdateResult r = params ? shared->update(updates, state.at("inner_state"), *params, extra)
                                  : shared->update(updates, state.at("inner_state"));
          out = std::move(r.updates);
          inner_state = std::move(r.state);
        } else {
          out = zeros_like(updates);
          inner_state = state.at("inner_state");
        }
        return UpdateResult{std::move(out), Tree{{"notfinite_count", count_array(notfinite)},
                                                 {"last_finite", Array::full_i32(Shape{}, finite ? 1 : 0)},
                                                 {"total_notfinite", count_array(finite ? total : safe_increment(total))},
                                                 {"inner_state", std::move(inner_state)}}};
      });
}

GradientTransformation multi_steps(GradientTransformation inner, std::int64_t every_k_steps) {
  if (every_k_steps < 1)
    throw ValueError(detail::cat("optim::multi_steps: every_k_steps must be at least 1, got ", every_k_steps));
  const std::string who = "optim::multi_steps(" + inner.name() + ")";
  auto shared = std::make_shared<const GradientTransformation>(std::move(inner));
  return passing_extra_args(
      shared->uses_extra_args(), who,
      [shared](const Tree& params) {
        return Tree{{"mini_step", count_array(0)},
                    {"gradient_step", count_array(0)},
                    {"inner_opt_state", shared->init(params)},
                    {"acc_grads", zeros_like(params)},
                    {"skip_state", Tree()}};
      },
      [shared, who, every_k_steps](const Tree& updates, const Tree& state, const Tree* params, const ExtraArgs& extra) {
        const std::string w = who + ".update";
        check_state_keys(w, state, {"mini_step", "gradient_step", "inner_opt_state", "acc_grads", "skip_state"});
        check_same_structure(w, "grads", updates, "state['acc_grads']", state.at("acc_grads"));
        const std::int64_t mini = read_scalar(w, state, "mini_step");
        const std::int64_t gstep = read_scalar(w, state, "gradient_step");
        // optax's running mean: acc + (g - acc) / (n + 1).
        const float n1 = static_cast<float>(mini + 1);
        Tree acc = map2(updates, state.at("acc_grads"), [n1](float g, float a) { return a + (g - a) / n1; });
        const bool emit = mini == every_k_steps - 1;
        if (!emit)
          return UpdateResult{zeros_like(updates), Tree{{"mini_step", count_array(mini + 1)},
                                                        {"gradient_step", count_array(gstep)},
                                                        {"inner_opt_state", state.at("inner_opt_state")},
                                                        {"acc_grads", std::move(acc)},
                                                        {"skip_state", Tree()}}};
        UpdateResult r = params ? shared->update(acc, state.at("inner_opt_state"), *params, extra)
                                : shared->update(acc, state.at("inner_opt_state"));
        return UpdateResult{std::move(r.updates), Tree{{"mini_step", count_array(0)},
                                                       {"gradient_step", count_array(safe_increment(gstep))},
                                                       {"inner_opt_state", std::move(r.state)},
                                                       {"acc_grads", zeros_like(updates)},
                                                       {"skip_state", Tree()}}};
      });
}

Tree incremental_update(const Tree& new_tree, const Tree& old_tree, double step_size) {
  autodiff::NoGradGuard constants;
  const std::string who = "optim::incremental_update";
  check_f32(who, "new", new_tree);
  check_same_structure(who, "new", new_tree, "old", old_tree);
  const float s = f32(step_size), r = f32(1.0 - step_size);
  return map2(new_tree, old_tree, [s, r](float n, float o) { return s * n + r * o; });
}

// ---- optimizers ----------------------------------------------------------------------------------

GradientTransformation rmsprop(LearningRate learning_rate, double decay, double eps, double initial_scale, bool centered,
                               double momentum, bool nesterov, bool eps_in_sqrt) {
  if (!(momentum >= 0) || !std::isfinite(momentum))
    throw ValueError(detail::cat("optim::rmsprop: momentum must be a finite number >= 0, got ", momentum));
  return chain(centered ? scale_by_stddev(decay, eps, initial_scale, eps_in_sqrt) : scale_by_rms(decay, eps, initial_scale, eps_in_sqrt),
               scale_by_learning_rate(std::move(learning_rate)), momentum > 0 ? trace(momentum, nesterov) : identity());
}

GradientTransformation adagrad(LearningRate learning_rate, double initial_accumulator_value, double eps) {
  return chain(scale_by_rss(initial_accumulator_value, eps), scale_by_learning_rate(std::move(learning_rate)));
}

GradientTransformation lion(LearningRate learning_rate, double b1, double b2, double weight_decay) {
  return chain(scale_by_lion(b1, b2), add_decayed_weights(weight_decay), scale_by_learning_rate(std::move(learning_rate)));
}

GradientTransformation lamb(LearningRate learning_rate, double b1, double b2, double eps, double eps_root,
                            double weight_decay) {
  return chain(scale_by_adam(b1, b2, eps, eps_root), add_decayed_weights(weight_decay), scale_by_trust_ratio(),
               scale_by_learning_rate(std::move(learning_rate)));
}

GradientTransformation adabelief(LearningRate learning_rate, double b1, double b2, double eps, double eps_root) {
  return chain(scale_by_belief(b1, b2, eps, eps_root), scale_by_learning_rate(std::move(learning_rate)));
}

GradientTransformation adafactor(LearningRate learning_rate, std::int64_t min_dim_size_to_factor, double decay_rate,
                                 std::int64_t decay_offset, bool multiply_by_parameter_scale, double clipping_threshold,
                                 double momentum, double eps, bool factored) {
  std::vector<GradientTransformation> tx;
  tx.push_back(scale_by_factored_rms(factored, decay_rate, decay_offset, min_dim_size_to_factor, eps));
  if (clipping_threshold > 0) tx.push_back(clip_by_block_rms(clipping_threshold));
  // optax: scale_by_learning_rate(lr, flip_sign=False); the sign flips in the final scale(-1).
  if (learning_rate.is_schedule()) {
    Schedule s = learning_rate.schedule();
    tx.push_back(scale_by_schedule(s));
  } else {
    tx.push_back(scale(learning_rate.value()));
  }
  if (multiply_by_parameter_scale) tx.push_back(scale_by_param_block_rms());
  if (momentum > 0) tx.push_back(ema(momentum, /*debias=*/false));
  tx.push_back(scale(-1.0));
  return chain(std::move(tx));
}

}  // namespace linum::optim
