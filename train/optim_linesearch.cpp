// Step sizes chosen from the objective's value (optax's): Polyak's step (optax.scale_by_polyak,
// optax.polyak_sgd) and the backtracking linesearch (optax.scale_by_backtracking_linesearch). Both
// read extra arguments (ExtraArgs: the value, and for the linesearch the function giving the value
// elsewhere and the gradient); float32 arithmetic in optax's order.
#include <linum/train/optim.hpp>

#include <linum/core/array.hpp>
#include <linum/core/error.hpp>
#include <linum/train/optim_internal.hpp>

#include <algorithm>
#include <cmath>
#include <limits>

namespace linum::optim {

using namespace internal;  // NOLINT(google-build-using-namespace)

namespace {

// The sum of squares of every leaf (optax.tree.norm(squared=True)), accumulated in double.
float squared_norm(const Tree& tree) {
  double s = 0.0;
  for (const Array& leaf : leaves(tree)) {
    const Array a = as_f32(leaf);
    for (std::int64_t i = 0; i < a.numel(); ++i) s += static_cast<double>(a.data()[i]) * static_cast<double>(a.data()[i]);
  }
  return static_cast<float>(s);
}

// optax.tree.vdot: each leaf's inner product (accumulated in double, rounded), summed in float32.
float tree_vdot(const Tree& a, const Tree& b) {
  const std::vector<Array> la = leaves(a), lb = leaves(b);
  float total = 0.0f;
  for (std::size_t l = 0; l < la.size(); ++l) {
    const Array x = as_f32(la[l]), y = as_f32(lb[l]);
    double s = 0.0;
    for (std::int64_t i = 0; i < x.numel(); ++i) s += static_cast<double>(x.data()[i]) * static_cast<double>(y.data()[i]);
    total += static_cast<float>(s);
  }
  return total;
}

float value_of(const std::string& who, const ExtraArgs& extra) {
  if (!extra.value)
    throw ValueError(who + ": needs the objective's value at the parameters; call update(grads, state, params, {.value = loss})");
  return *extra.value;
}

float read_f32(const std::string& who, const Tree& state, std::string_view key) {
  if (!state.contains(key) || !state.at(key).is_leaf() || state.at(key).array().dtype() != DType::f32 ||
      state.at(key).array().numel() != 1)
    throw ValueError(detail::cat(who, ": state['", key, "'] must be a float32 scalar; pass the state init() returned"));
  return state.at(key).array().data()[0];
}

Array f32_scalar(float x) { return Array::full(Shape{}, x); }

}  // namespace

GradientTransformation scale_by_polyak(double f_min, double max_learning_rate, double eps, PolyakVariant variant) {
  const std::string who = "optim::scale_by_polyak";
  return GradientTransformation::with_extra_args(
      who, [](const Tree&) { return empty_state(); },
      [who, f_min, max_learning_rate, eps, variant](const Tree& updates, const Tree& state, const Tree*, const ExtraArgs& extra) {
        const std::string w = who + ".update";
        float gap = value_of(w, extra) - f32(f_min);
        if (variant == PolyakVariant::sps_plus) gap = std::max(gap, 0.0f);
        const float denominator = squared_norm(updates) + f32(eps);
        // optax: no step when the squared norm is below float epsilon (jnp.finfo(float).eps, in float32).
        const float step = denominator <= f32(std::numeric_limits<double>::epsilon())
                               ? 0.0f
                               : std::min(gap / denominator, f32(max_learning_rate));
        return UpdateResult{map1(updates, [step](float u) { return step * u; }), state};
      });
}

GradientTransformation polyak_sgd(double max_learning_rate, LearningRate scaling, double f_min, double eps, PolyakVariant variant) {
  return chain(sgd(std::move(scaling)), scale_by_polyak(f_min, max_learning_rate, eps, variant));
}

GradientTransformation scale_by_backtracking_linesearch(std::int64_t max_backtracking_steps, double slope_rtol,
                                                        double decrease_factor, double increase_factor,
                                                        double max_learning_rate, double atol, double rtol) {
  if (max_backtracking_steps < 0)
    throw ValueError(detail::cat("optim::scale_by_backtracking_linesearch: max_backtracking_steps must be >= 0, got ",
                                 max_backtracking_steps));
  if (!(decrease_factor > 0 && decrease_factor < 1))
    throw ValueError(detail::cat("optim::scale_by_backtracking_linesearch: decrease_factor must be in (0, 1), got ", decrease_factor));
  const std::string who = "optim::scale_by_backtracking_linesearch";
  return GradientTransformation::with_extra_args(
      who,
      [](const Tree&) {
        const float inf = std::numeric_limits<float>::infinity();
        return Tree{{"grad", Tree()},
                    {"info", Tree{{"decrease_error", f32_scalar(inf)}, {"num_linesearch_steps", count_array(0)}}},
                    {"learning_rate", f32_scalar(1.0f)},
                    {"value", f32_scalar(inf)}};
      },
      [=](const Tree& updates, const Tree& state, const Tree* params, const ExtraArgs& extra) {
        const std::string w = who + ".update";
        check_state_keys(w, state, {"grad", "info", "learning_rate", "value"});
        if (params == nullptr) throw ValueError(w + ": needs the params (it evaluates the objective at params + step * updates)");
        const float value = value_of(w, extra);
        if (!extra.value_fn)
          throw ValueError(w + ": needs the objective as a function of the parameters; call update(grads, state, params, "
                               "{.value = loss, .value_fn = objective})");
        const float slope = tree_vdot(updates, *extra.grad);
        // optax's decrease error: how far the new value is above the Armijo line (0: sufficient
        // decrease), infinite for a NaN.
        auto decrease_error = [&](float step, float new_value) {
          float e = new_value - f32(1.0 + rtol) * value - step * f32(slope_rtol) * slope;
          if (std::isnan(e)) e = std::numeric_limits<float>::infinity();
          return std::max(e, 0.0f);
        };
        float step = std::min(f32(increase_factor) * read_f32(w, state, "learning_rate"), f32(max_learning_rate));
        float new_value = value, error = std::numeric_limits<float>::infinity();
        std::int64_t tries = 0;
        while (!(error <= f32(atol)) && tries <= max_backtracking_steps) {
          if (tries > 0) step = f32(decrease_factor) * step;
          const float s = step;
          const Tree trial = map2(*params, updates, [s](float p, float u) { return p + s * u; });
          new_value = extra.value_fn(trial);
          error = decrease_error(step, new_value);
          ++tries;
        }
        // No step at all when every trial gave an infinite or NaN value.
        const float chosen = std::isinf(error) ? 0.0f : step;
        return UpdateResult{map1(updates, [chosen](float u) { return chosen * u; }),
                            Tree{{"grad", Tree()},
                                 {"info", Tree{{"decrease_error", f32_scalar(error)}, {"num_linesearch_steps", count_array(tries)}}},
                                 {"learning_rate", f32_scalar(chosen)},
                                 {"value", f32_scalar(new_value)}}};
      });
}

}  // namespace linum::optim
