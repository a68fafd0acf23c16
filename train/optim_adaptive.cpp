// optax's other adaptive optimizers (train/optim.hpp): the rescalings of AMSGrad, Adamax, RAdam,
// Yogi, Adadelta and NovoGrad, and the optimizers nadam, nadamw, amsgrad, adamax, radam, yogi,
// adadelta, novograd and lars built from them. Formulas, constants and state layouts are optax
// 0.2.8's, evaluated in float32 with each hyperparameter rounded once from double, as JAX does
// with weakly typed Python floats.
// Compiled with -ffp-contract=off (train/meson.build), as are the other optimizer sources.

#include <linum/train/optim.hpp>
#include <linum/train/square_sums.hpp>
#include <linum/train/optim_internal.hpp>

#include <algorithm>
#include <cmath>
#include <limits>

namespace linum::optim {

using namespace internal;

namespace {

// jnp.maximum: the larger value, NaN when either is NaN.
inline float nan_max(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<float>::quiet_NaN();
  return a > b ? a : b;
}

void check_decay(const char* who, const char* name, double value) {
  if (!(value >= 0.0 && value < 1.0))
    throw ValueError(detail::cat(who, ": ", name, " must be in [0, 1), got ", value));
}

void check_non_negative(const char* who, const char* name, double value) {
  if (!(value >= 0.0) || !std::isfinite(value))
    throw ValueError(detail::cat(who, ": ", name, " must be a finite number >= 0, got ", value));
}

// Adam's hyperparameter checks: decays in [0, 1), finite epsilons >= 0.
void check_adam_hyperparameters(const char* name, double b1, double b2, double eps, double eps_root = 0.0) {
  check_decay(name, "b1", b1);
  check_decay(name, "b2", b2);
  check_non_negative(name, "eps", eps);
  check_non_negative(name, "eps_root", eps_root);
}

// Checks `state` has `keys` and that each listed moment matches the gradients' structure.
void check_moments(const std::string& who, const Tree& updates, const Tree& state, std::initializer_list<std::string_view> keys,
                   std::initializer_list<std::string_view> moments) {
  check_state_keys(who, state, keys);
  for (std::string_view m : moments)
    check_same_structure(who, "grads", updates, detail::cat("state['", m, "']"), state.at(m));
}

// Adam's bias-corrected first moment, or NAdam's look-ahead when nesterov:
// b1 * mu / (1 - b1^(t+1)) + (1 - b1) * g / (1 - b1^t).
Tree first_moment_estimate(const Tree& updates, const Tree& mu, double b1, std::int64_t count, bool nesterov) {
  const float d1 = f32(b1), c1 = f32(1.0 - b1);
  const float bc = bias_correction(d1, count);
  if (!nesterov) return map1(mu, [bc](float m) { return m / bc; });
  const float bc_next = bias_correction(d1, safe_increment(count));
  return map2(mu, updates, [=](float m, float g) { return nesterov_moment(m, g, d1, c1, bc, bc_next); });
}

}  // namespace

// ---- rescalings ----------------------------------------------------------------------------------

GradientTransformation scale_by_amsgrad(double b1, double b2, double eps, double eps_root, bool bias_correction_mu,
                                        bool bias_correction_nu) {
  const char* name = "optim::scale_by_amsgrad";
  check_adam_hyperparameters(name, b1, b2, eps, eps_root);
  const std::string who = "optim::scale_by_amsgrad.update";
  return GradientTransformation(
      name,
      [](const Tree& params) {
        return Tree{{"count", count_array(0)}, {"mu", zeros_like(params)}, {"nu", zeros_like(params)},
                    {"nu_max", zeros_like(params)}};
      },
      [=](const Tree& updates, const Tree& state, const Tree*) {
        check_moments(who, updates, state, {"count", "mu", "nu", "nu_max"}, {"mu", "nu", "nu_max"});
        const float d1 = f32(b1), d2 = f32(b2), e = f32(eps), er = f32(eps_root);
        Tree mu = first_moment(updates, state.at("mu"), b1);
        Tree nu = second_moment(updates, state.at("nu"), b2);
        const std::int64_t count = safe_increment(read_count(who, state));
        const float bc1 = bias_correction_mu ? bias_correction(d1, count) : 1.0f;
        const float bc2 = bias_correction_nu ? bias_correction(d2, count) : 1.0f;
        // The running maximum of the (bias-corrected) second moment.
        Tree nu_max = map2(state.at("nu_max"), nu, [=](float vmax, float v) {
          return nan_max(vmax, bias_correction_nu ? v / bc2 : v);
        });
        Tree out = map2(mu, nu_max, [=](float m, float vmax) {
          return (bias_correction_mu ? m / bc1 : m) / (std::sqrt(vmax + er) + e);
        });
        return UpdateResult{std::move(out), Tree{{"count", count_array(count)}, {"mu", std::move(mu)}, {"nu", std::move(nu)},
                                                 {"nu_max", std::move(nu_max)}}};
      });
}

GradientTransformation scale_by_adamax(double b1, double b2, double eps) {
  const char* name = "optim::scale_by_adamax";
  check_adam_hyperparameters(name, b1, b2, eps);
  const std::string who = "optim::scale_by_adamax.update";
  return GradientTransformation(
      name,
      [](const Tree& params) {
        return Tree{{"count", count_array(0)}, {"mu", zeros_like(params)}, {"nu", zeros_like(params)}};
      },
      [=](const Tree& updates, const Tree& state, const Tree*) {
        check_moments(who, updates, state, {"count", "mu", "nu"}, {"mu", "nu"});
        const float d1 = f32(b1), d2 = f32(b2), e = f32(eps);
        const std::int64_t count = safe_increment(read_count(who, state));
        Tree mu = first_moment(updates, state.at("mu"), b1);
        // The exponentially weighted infinity norm: max(|g| + eps, b2 * nu).
        Tree nu = map2(updates, state.at("nu"), [=](float g, float v) { return nan_max(std::fabs(g) + e, d2 * v); });
        const float bc1 = bias_correction(d1, count);
        Tree out = map2(mu, nu, [=](float m, float v) { return (m / bc1) / v; });
        return UpdateResult{std::move(out), Tree{{"count", count_array(count)}, {"mu", std::move(mu)}, {"nu", std::move(nu)}}};
      });
}

GradientTransformation scale_by_radam(double b1, double b2, double eps, double eps_root, double threshold, bool nesterov) {
  const char* name = "optim::scale_by_radam";
  check_adam_hyperparameters(name, b1, b2, eps, eps_root);
  if (!std::isfinite(threshold)) throw ValueError(detail::cat(name, ": threshold must be finite, got ", threshold));
  const std::string who = "optim::scale_by_radam.update";
  // The length of the approximated simple moving average, at the limit (a Python float in optax).
  const double ro_inf = 2.0 / (1.0 - b2) - 1.0;
  return GradientTransformation(
      name,
      [](const Tree& params) {
        return Tree{{"count", count_array(0)}, {"mu", zeros_like(params)}, {"nu", zeros_like(params)}};
      },
      [=](const Tree& updates, const Tree& state, const Tree*) {
        check_moments(who, updates, state, {"count", "mu", "nu"}, {"mu", "nu"});
        const float d2 = f32(b2), e = f32(eps), er = f32(eps_root);
        Tree mu = first_moment(updates, state.at("mu"), b1);
        Tree nu = second_moment(updates, state.at("nu"), b2);
        const std::int64_t count = safe_increment(read_count(who, state));
        // optax's float32 arithmetic: b2t = b2^t, ro = ro_inf - 2 t b2t / (1 - b2t), and the
        // rectification r = sqrt((ro - 4)(ro - 2) ro_inf / ((ro_inf - 4)(ro_inf - 2) ro)), whose
        // constant factor (ro_inf - 4)(ro_inf - 2) is formed in double.
        const float b2t = static_cast<float>(std::pow(static_cast<double>(d2), static_cast<double>(count)));
        const float ro = f32(ro_inf) - (static_cast<float>(2 * count) * b2t) / (1.0f - b2t);
        const float r = std::sqrt((((ro - 4.0f) * (ro - 2.0f)) * f32(ro_inf)) / (f32((ro_inf - 4.0) * (ro_inf - 2.0)) * ro));
        const bool rectify = ro >= f32(threshold);
        const Tree mu_hat = first_moment_estimate(updates, mu, b1, count, nesterov);
        const float bc2 = bias_correction(d2, count);
        // Adam's step scaled by r once the variance estimate is reliable (ro >= threshold), else
        // momentum SGD (the bias-corrected first moment itself).
        Tree out = rectify ? map2(mu_hat, nu, [=](float m, float v) { return (r * m) / (std::sqrt(v / bc2 + er) + e); })
                           : mu_hat;
        return UpdateResult{std::move(out), Tree{{"count", count_array(count)}, {"mu", std::move(mu)}, {"nu", std::move(nu)}}};
      });
}

GradientTransformation scale_by_yogi(double b1, double b2, double eps, double eps_root, double initial_accumulator_value) {
  const char* name = "optim::scale_by_yogi";
  check_adam_hyperparameters(name, b1, b2, eps, eps_root);
  check_non_negative(name, "initial_accumulator_value", initial_accumulator_value);
  const std::string who = "optim::scale_by_yogi.update";
  const float init = f32(initial_accumulator_value);
  return GradientTransformation(
      name,
      [init](const Tree& params) {
        return Tree{{"count", count_array(0)}, {"mu", full_like(params, init)}, {"nu", full_like(params, init)}};
      },
      [=](const Tree& updates, const Tree& state, const Tree*) {
        check_moments(who, updates, state, {"count", "mu", "nu"}, {"mu", "nu"});
        const float d1 = f32(b1), c2 = f32(1.0 - b2), d2 = f32(b2), e = f32(eps), er = f32(eps_root);
        Tree mu = first_moment(updates, state.at("mu"), b1);
        // Yogi's additive second moment: nu - (1 - b2) sign(nu - g^2) g^2.
        Tree nu = map2(updates, state.at("nu"), [=](float g, float v) {
          const float g2 = g * g;
          const float diff = v - g2;
          const float sign = diff > 0.0f ? 1.0f : diff < 0.0f ? -1.0f : diff;  // jnp.sign
          return v - (c2 * sign) * g2;
        });
        const std::int64_t count = safe_increment(read_count(who, state));
        const float bc1 = bias_correction(d1, count), bc2 = bias_correction(d2, count);
        Tree out = map2(mu, nu, [=](float m, float v) { return (m / bc1) / (std::sqrt(v / bc2 + er) + e); });
        return UpdateResult{std::move(out), Tree{{"count", count_array(count)}, {"mu", std::move(mu)}, {"nu", std::move(nu)}}};
      });
}

GradientTransformation scale_by_adadelta(double rho, double eps) {
  const char* name = "optim::scale_by_adadelta";
  check_decay(name, "rho", rho);
  check_non_negative(name, "eps", eps);
  const std::string who = "optim::scale_by_adadelta.update";
  return GradientTransformation(
      name, [](const Tree& params) { return Tree{{"e_g", zeros_like(params)}, {"e_x", zeros_like(params)}}; },
      [=](const Tree& updates, const Tree& state, const Tree*) {
        check_moments(who, updates, state, {"e_g", "e_x"}, {"e_g", "e_x"});
        const float c = f32(1.0 - rho), d = f32(rho), e = f32(eps);
        // E[g^2] first; the step is g * RMS(previous steps) / RMS(gradients); then E[step^2].
        Tree e_g = map2(updates, state.at("e_g"), [=](float g, float t) { return c * (g * g) + d * t; });
        Tree out = map3(updates, e_g, state.at("e_x"), [=](float g, float eg, float ex) {
          return (std::sqrt(ex + e) / std::sqrt(eg + e)) * g;
        });
        Tree e_x = map2(out, state.at("e_x"), [=](float u, float t) { return c * (u * u) + d * t; });
        return UpdateResult{std::move(out), Tree{{"e_g", std::move(e_g)}, {"e_x", std::move(e_x)}}};
      });
}

GradientTransformation scale_by_novograd(double b1, double b2, double eps, double eps_root, double weight_decay) {
  const char* name = "optim::scale_by_novograd";
  check_adam_hyperparameters(name, b1, b2, eps, eps_root);
  if (!std::isfinite(weight_decay)) throw ValueError(detail::cat(name, ": weight_decay must be finite, got ", weight_decay));
  const std::string who = "optim::scale_by_novograd.update";
  return GradientTransformation(
      name,
      [](const Tree& params) {
        // One second moment per leaf: a scalar of the leaf's dtype.
        return Tree{{"count", count_array(0)},
                    {"mu", zeros_like(params)},
                    {"nu", tree_map([](const Array& p) { return Array::zeros(Shape{}, p.dtype()); }, params)}};
      },
      [=](const Tree& updates, const Tree& state, const Tree* params) {
        check_state_keys(who, state, {"count", "mu", "nu"});
        check_same_structure(who, "grads", updates, "state['mu']", state.at("mu"));
        if (!params) throw ValueError(who + ": NovoGrad needs the parameters; call update(grads, state, params)");
        check_same_structure(who, "grads", updates, "params", *params);
        autodiff::NoGradGuard constants;
        const std::vector<Array> g = leaves(updates), p = leaves(*params), m_prev = leaves(state.at("mu")),
                                 nu_prev = leaves(state.at("nu"));
        if (nu_prev.size() != g.size())
          throw ValueError(who + ": state['nu'] does not match the gradients; pass the state that init(params) returned");
        for (std::size_t i = 0; i < nu_prev.size(); ++i)
          if (nu_prev[i].rank() != 0 || !is_floating(nu_prev[i].dtype()))
            throw ValueError(detail::cat(who, ": state['nu'] holds one float scalar per leaf, got ", dtype_name(nu_prev[i].dtype()),
                                         " ", nu_prev[i].shape(), "; pass the state that init(params) returned"));
        const std::int64_t count = safe_increment(read_count(who, state));
        const bool first = count == 1;
        const float c2 = f32(1.0 - b2), d2 = f32(b2), d1 = f32(b1), e = f32(eps), er = f32(eps_root), wd = f32(weight_decay);
        // Each leaf's squared L2 norm (whole leaves, merged across shards), as jnp.linalg.norm(g)**2.
        const std::vector<SquareSum> sums = leaf_square_sums(g);
        std::vector<Array> mu, nu;
        for (std::size_t i = 0; i < g.size(); ++i) {
          const float norm = static_cast<float>(std::sqrt(sums[i].value()));
          const float norm2 = norm * norm;
          const float v_prev = astype(nu_prev[i], DType::f32).data()[0];
          const float v = first ? norm2 : c2 * norm2 + d2 * v_prev;
          const float denom = std::sqrt(v + er) + e;
          // mu = b1 mu + (g / (sqrt(nu) + eps) + weight_decay * params); at the first step without b1 mu.
          mu.push_back(map3(Tree(g[i]), Tree(p[i]), Tree(m_prev[i]), [=](float gj, float pj, float mj) {
                         const float u = gj / denom + wd * pj;
                         return first ? u : d1 * mj + u;
                       }).array());
          nu.push_back(astype(Array::full(Shape{}, v), nu_prev[i].dtype()));
        }
        Tree mu_tree = with_leaves(updates, mu);
        return UpdateResult{mu_tree, Tree{{"count", count_array(count)}, {"mu", mu_tree}, {"nu", with_leaves(updates, nu)}}};
      });
}

GradientTransformation scale_by_adan(double b1, double b2, double b3, double eps, double eps_root) {
  const char* name = "optim::scale_by_adan";
  check_adam_hyperparameters(name, b1, b2, eps, eps_root);
  check_decay(name, "b3", b3);
  const std::string who = "optim::scale_by_adan.update";
  return GradientTransformation(
      name,
      [](const Tree& params) {
        return Tree{{"m", zeros_like(params)}, {"v", zeros_like(params)}, {"n", zeros_like(params)},
                    {"g", zeros_like(params)}, {"t", count_array(0)}};
      },
      [=](const Tree& updates, const Tree& state, const Tree*) {
        check_moments(who, updates, state, {"m", "v", "n", "g", "t"}, {"m", "v", "n", "g"});
        const std::int64_t t_prev = read_count(who, Tree{{"count", state.at("t")}});
        // The gradient's change since the last step (0 at the first).
        const Tree diff = t_prev == 0 ? zeros_like(updates) : map2(updates, state.at("g"), [](float g, float p) { return g - p; });
        Tree m = first_moment(updates, state.at("m"), b1);
        Tree v = first_moment(diff, state.at("v"), b2);
        const float c2 = f32(1.0 - b2), e = f32(eps), er = f32(eps_root);
        const Tree sq = map2(updates, diff, [=](float g, float d) { return g + c2 * d; });
        Tree n = second_moment(sq, state.at("n"), b3);
        const std::int64_t t = safe_increment(t_prev);
        const float bc1 = bias_correction(f32(b1), t), bc2 = bias_correction(f32(b2), t), bc3 = bias_correction(f32(b3), t);
        Tree out = map3(m, v, n, [=](float mj, float vj, float nj) {
          return (mj / bc1 + c2 * (vj / bc2)) / (std::sqrt(nj / bc3 + er) + e);
        });
        return UpdateResult{std::move(out), Tree{{"m", std::move(m)}, {"v", std::move(v)}, {"n", std::move(n)},
                                                 {"g", updates}, {"t", count_array(t)}}};
      });
}

GradientTransformation scale_by_sign() {
  const std::string who = "optim::scale_by_sign.update";
  return GradientTransformation(
      "optim::scale_by_sign", [](const Tree&) { return empty_state(); },
      [who](const Tree& updates, const Tree& state, const Tree*) {
        check_state_keys(who, state, {});
        // jnp.sign: 0 stays 0 (its sign too), NaN stays NaN.
        return UpdateResult{map1(updates, [](float g) { return g > 0.0f ? 1.0f : g < 0.0f ? -1.0f : g; }), empty_state()};
      });
}

GradientTransformation scale_by_sm3(double b1, double b2, double eps) {
  const char* name = "optim::scale_by_sm3";
  check_decay(name, "b1", b1);
  if (!(b2 >= 0.0 && b2 <= 1.0)) throw ValueError(detail::cat(name, ": b2 must be in [0, 1], got ", b2));
  check_non_negative(name, "eps", eps);
  const std::string who = "optim::scale_by_sm3.update";
  // One accumulator per axis of each leaf: mu[leaf] = {"0": [d0], "1": [d1], ...}.
  auto accumulators = [](const Tree& params) {
    Tree mu;
    for (const auto& [path, p] : flatten(params)) {
      if (p.rank() == 0)
        throw ValueError(detail::cat("optim::scale_by_sm3: leaf '", path, "' is a scalar; SM3 keeps one accumulator per "
                                     "axis, so it needs leaves of rank 1 or more"));
      Tree per_axis;
      for (int i = 0; i < p.rank(); ++i) per_axis.set(std::to_string(i), Tree(Array::zeros(Shape{p.dim(i)}, p.dtype())));
      if (path.empty()) return per_axis;
      mu.set_path(path, per_axis);
    }
    return mu;
  };
  return GradientTransformation(
      name, [accumulators](const Tree& params) { return Tree{{"mu", accumulators(params)}, {"nu", zeros_like(params)}}; },
      [=](const Tree& updates, const Tree& state, const Tree*) {
        check_state_keys(who, state, {"mu", "nu"});
        check_same_structure(who, "grads", updates, "state['nu']", state.at("nu"));
        autodiff::NoGradGuard constants;
        const float c = b2 != 1.0 ? f32(1.0 - b2) : 1.0f, d = f32(b2), e = f32(eps);
        std::vector<Array> ups, mus_flat;
        Tree mu;
        for (const auto& [path, g_any] : flatten(updates)) {
          const Array g = astype(g_any, DType::f32);
          const int r = g.rank();
          const Tree& acc = path.empty() ? state.at("mu") : state.at("mu").at_path(path);
          // The smallest accumulator over the axes, broadcast to the leaf's shape.
          std::vector<float> accum(static_cast<std::size_t>(g.numel()));
          std::vector<std::vector<float>> axis_acc;
          for (int i = 0; i < r; ++i) {
            const Array a = astype(acc.at(std::to_string(i)).array(), DType::f32);
            if (a.rank() != 1 || a.dim(0) != g.dim(i))
              throw ValueError(detail::cat(who, ": state['mu'] for '", path, "' axis ", i, " has shape ", a.shape(),
                                           "; pass the state that init(params) returned"));
            axis_acc.push_back(a.to_vector());
          }
          const std::vector<float> gv = g.to_vector();
          std::vector<std::vector<float>> new_axis(static_cast<std::size_t>(r));
          for (int i = 0; i < r; ++i) new_axis[static_cast<std::size_t>(i)].assign(static_cast<std::size_t>(g.dim(i)),
                                                                                    -std::numeric_limits<float>::infinity());
          std::vector<std::int64_t> index(static_cast<std::size_t>(r), 0);
          for (std::size_t j = 0; j < gv.size(); ++j) {
            float smallest = axis_acc[0][static_cast<std::size_t>(index[0])];
            for (int i = 1; i < r; ++i) smallest = std::min(smallest, axis_acc[static_cast<std::size_t>(i)][static_cast<std::size_t>(index[static_cast<std::size_t>(i)])]);
            accum[j] = c * (gv[j] * gv[j]) + d * smallest;
            for (int i = 0; i < r; ++i) {
              float& m = new_axis[static_cast<std::size_t>(i)][static_cast<std::size_t>(index[static_cast<std::size_t>(i)])];
              m = nan_max(m, accum[j]);
            }
            for (int i = r - 1; i >= 0; --i) {  // the next index, last axis fastest
              if (++index[static_cast<std::size_t>(i)] < g.dim(i)) break;
              index[static_cast<std::size_t>(i)] = 0;
            }
          }
          std::vector<float> up(gv.size());
          for (std::size_t j = 0; j < gv.size(); ++j) up[j] = gv[j] * (accum[j] > 0.0f ? 1.0f / std::sqrt(accum[j] + e) : 0.0f);
          ups.push_back(astype(Array::from(g.shape(), up), g_any.dtype()));
          // A rank-1 leaf keeps the accumulator itself (optax: g.ndim < 2).
          Tree per_axis;
          for (int i = 0; i < r; ++i)
            per_axis.set(std::to_string(i), Tree(astype(Array::from(Shape{g.dim(i)}, r < 2 ? accum : new_axis[static_cast<std::size_t>(i)]),
                                                        g_any.dtype())));
          if (path.empty()) mu = per_axis;
          else mu.set_path(path, per_axis);
        }
        Tree nu = first_moment(with_leaves(updates, ups), state.at("nu"), b1);
        return UpdateResult{nu, Tree{{"mu", std::move(mu)}, {"nu", nu}}};
      });
}

// ---- optimizers ----------------------------------------------------------------------------------

GradientTransformation nadam(LearningRate learning_rate, double b1, double b2, double eps, double eps_root) {
  return chain(scale_by_adam(b1, b2, eps, eps_root, /*nesterov=*/true), scale_by_learning_rate(std::move(learning_rate)));
}

GradientTransformation nadamw(LearningRate learning_rate, double b1, double b2, double eps, double weight_decay, double eps_root,
                              Mask mask) {
  return chain(scale_by_adam(b1, b2, eps, eps_root, /*nesterov=*/true),
               mask ? add_decayed_weights(weight_decay, std::move(mask)) : add_decayed_weights(weight_decay),
               scale_by_learning_rate(std::move(learning_rate)));
}

GradientTransformation amsgrad(LearningRate learning_rate, double b1, double b2, double eps, double eps_root,
                               bool bias_correction_mu, bool bias_correction_nu) {
  return chain(scale_by_amsgrad(b1, b2, eps, eps_root, bias_correction_mu, bias_correction_nu),
               scale_by_learning_rate(std::move(learning_rate)));
}

GradientTransformation adamax(LearningRate learning_rate, double b1, double b2, double eps) {
  return chain(scale_by_adamax(b1, b2, eps), scale_by_learning_rate(std::move(learning_rate)));
}

GradientTransformation radam(LearningRate learning_rate, double b1, double b2, double eps, double eps_root, double threshold,
                             bool nesterov) {
  return chain(scale_by_radam(b1, b2, eps, eps_root, threshold, nesterov), scale_by_learning_rate(std::move(learning_rate)));
}

GradientTransformation yogi(LearningRate learning_rate, double b1, double b2, double eps) {
  return chain(scale_by_yogi(b1, b2, eps), scale_by_learning_rate(std::move(learning_rate)));
}

GradientTransformation adadelta(LearningRate learning_rate, double rho, double eps, double weight_decay, Mask weight_decay_mask) {
  return chain(weight_decay_mask ? add_decayed_weights(weight_decay, std::move(weight_decay_mask)) : add_decayed_weights(weight_decay),
               scale_by_adadelta(rho, eps), scale_by_learning_rate(std::move(learning_rate)));
}

GradientTransformation novograd(LearningRate learning_rate, double b1, double b2, double eps, double eps_root,
                                double weight_decay) {
  return chain(scale_by_novograd(b1, b2, eps, eps_root, weight_decay), scale_by_learning_rate(std::move(learning_rate)));
}

GradientTransformation lars(LearningRate learning_rate, double weight_decay, Mask weight_decay_mask, double trust_coefficient,
                            double eps, Mask trust_ratio_mask, double momentum, bool nesterov) {
  if (!(momentum >= 0) || !std::isfinite(momentum))
    throw ValueError(detail::cat("optim::lars: momentum must be a finite number >= 0, got ", momentum));
  // optax's masks default to True (every leaf): its state then wraps both steps as masked ones.
  const Mask every_leaf = [](const std::string&, const Array&) { return true; };
  return chain(masked(add_decayed_weights(weight_decay), weight_decay_mask ? std::move(weight_decay_mask) : every_leaf),
               masked(scale_by_trust_ratio(0.0, trust_coefficient, eps), trust_ratio_mask ? std::move(trust_ratio_mask) : every_leaf),
               scale_by_learning_rate(std::move(learning_rate)), trace(momentum, nesterov));
}

GradientTransformation adan(LearningRate learning_rate, double b1, double b2, double b3, double eps, double eps_root,
                            double weight_decay, Mask mask) {
  return chain(scale_by_adan(b1, b2, b3, eps, eps_root),
               mask ? add_decayed_weights(weight_decay, std::move(mask)) : add_decayed_weights(weight_decay),
               scale_by_learning_rate(std::move(learning_rate)));
}

GradientTransformation adamaxw(LearningRate learning_rate, double b1, double b2, double eps, double weight_decay, Mask mask) {
  return chain(scale_by_adamax(b1, b2, eps),
               mask ? add_decayed_weights(weight_decay, std::move(mask)) : add_decayed_weights(weight_decay),
               scale_by_learning_rate(std::move(learning_rate)));
}

GradientTransformation sign_sgd(LearningRate learning_rate) {
  return chain(scale_by_sign(), scale_by_learning_rate(std::move(learning_rate)));
}

GradientTransformation sm3(double learning_rate, double momentum) {
  return chain(scale_by_sm3(momentum), scale(-learning_rate));
}

GradientTransformation fromage(double learning_rate, double min_norm) {
  if (!std::isfinite(learning_rate)) throw ValueError(detail::cat("optim::fromage: learning_rate must be finite, got ", learning_rate));
  // optax: the step shrinks the weights by 1 / sqrt(1 + lr^2), in Python floats.
  const double mult = 1.0 / std::pow(1.0 + learning_rate * learning_rate, 0.5);
  return chain(scale_by_trust_ratio(min_norm), scale_by_learning_rate(learning_rate * mult), add_decayed_weights(mult - 1.0));
}

GradientTransformation scale_by_optimistic_gradient(double alpha, double beta) {
  if (!std::isfinite(alpha) || !std::isfinite(beta))
    throw ValueError(detail::cat("optim::scale_by_optimistic_gradient: alpha and beta must be finite, got ", alpha, " and ", beta));
  const float sum = f32(alpha + beta), b = f32(beta);  // (alpha + beta) in Python floats, as optax's
  const std::string who = "optim::scale_by_optimistic_gradient.update";
  return GradientTransformation(
      "optim::scale_by_optimistic_gradient",
      [](const Tree& params) {
        return Tree{{"is_initial_step", Array::full_i32(Shape{}, 1)}, {"previous_gradient", zeros_like(params)}};
      },
      [sum, b, who](const Tree& updates, const Tree& state, const Tree*) {
        check_state_keys(who, state, {"is_initial_step", "previous_gradient"});
        check_f32(who, "update", updates);
        check_same_structure(who, "grads", updates, "state['previous_gradient']", state.at("previous_gradient"));
        const Array& first = state.at("is_initial_step").array();
        const bool initial = first.dtype() == DType::i32 ? first.data_i32()[0] != 0 : first.item() != 0.0f;
        // At the first step the previous gradient is the current one (optax issue 1082).
        Tree next = map2(updates, state.at("previous_gradient"),
                         [=](float g, float prev) { return sum * g - b * (initial ? g : prev); });
        return UpdateResult{std::move(next), Tree{{"is_initial_step", Array::full_i32(Shape{}, 0)}, {"previous_gradient", updates}}};
      });
}

GradientTransformation optimistic_gradient_descent(LearningRate learning_rate, double alpha, double beta) {
  return chain(scale_by_optimistic_gradient(alpha, beta), scale_by_learning_rate(std::move(learning_rate)));
}

}  // namespace linum::optim
