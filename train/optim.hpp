// Optimizers in the style of optax: pure gradient transformations over variable trees.
//
// A GradientTransformation is a pair of pure functions. `init(params)` builds the optimizer
// state; `update(grads, state, params)` turns gradients into updates and returns the next state.
// Nothing is mutated, so a training step is an explicit function of its inputs:
//
//   auto opt = optim::chain(optim::clip_by_global_norm(1.0), optim::adamw(1e-3));
//   Tree state = opt.init(params);
//   for (...) {
//     Tree grads = ...;                                    // same structure as params
//     auto [updates, new_state] = opt.update(grads, state, params);
//     params = optim::apply_updates(params, updates);
//     state = new_state;
//   }
//
// The state is a Tree, so it saves and loads with train/io/serialization.hpp like the parameters.
// Its layout is what `flax.serialization.to_state_dict` gives for the optax state of the same
// optimizer: a chain is {"0": ..., "1": ...}; adam's moments are {"count": int32[], "mu": <params
// structure>, "nu": <params structure>}; sgd's momentum is {"trace": <params structure>};
// stateless steps are empty dicts {}.
//
// The formulas are optax's, evaluated in float32 with optax's constants: hyperparameters are
// doubles (as Python floats) and derived constants such as 1 - b1 are formed in double before the
// single rounding to float32, as JAX does with weakly typed Python scalars. Results agree with
// optax to float32 rounding (the compiler may fuse a multiply and an add where XLA rounds twice;
// global norms are accumulated in double; bias corrections use an exact power). Schedules are
// evaluated in double and rounded to float.
//
// Updates are computed without recording autodiff nodes (under autodiff::NoGradGuard): they are
// constants even inside a differentiated function. Every leaf must be float32 or bfloat16: bf16
// leaves are computed in float32 and their states and updates are kept in bf16, as optax keeps
// states in the parameters' dtype. Trees whose
// structures disagree (grads vs state vs params) throw linum::ValueError naming the first path
// where they differ.
#pragma once

#include <linum/core/tree.hpp>

#include <concepts>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace linum::optim {

// ---- schedules ---------------------------------------------------------------------------------

// A value (usually a learning rate) as a function of the step count, starting at 0.
using Schedule = std::function<float(std::int64_t step)>;

// optax.constant_schedule(value): `value` at every step.
Schedule constant_schedule(float value);

// optax.linear_schedule: init_value until transition_begin, then linear to end_value over
// transition_steps steps, then end_value. With transition_steps <= 0 it is constant at init_value
// (as optax); a negative transition_begin counts as 0.
Schedule linear_schedule(float init_value, float end_value, std::int64_t transition_steps,
                         std::int64_t transition_begin = 0);

// optax.cosine_decay_schedule: init_value * ((1 - alpha) * 0.5 * (1 + cos(pi * t / decay_steps))
// + alpha) with t = min(step, decay_steps). So init_value at step 0, init_value * (1 + alpha) / 2
// half way, and alpha * init_value from decay_steps on. Throws ValueError unless decay_steps > 0.
Schedule cosine_decay_schedule(float init_value, std::int64_t decay_steps, float alpha = 0.0f);

// optax.warmup_cosine_decay_schedule: linear from init_value to peak_value over warmup_steps, then
// a cosine decay from peak_value to end_value that ends at step decay_steps (decay_steps counts the
// warmup, as in optax). Throws ValueError unless decay_steps > warmup_steps >= 0.
Schedule warmup_cosine_decay_schedule(float init_value, float peak_value, std::int64_t warmup_steps,
                                      std::int64_t decay_steps, float end_value = 0.0f);

// optax.exponential_decay: init_value * decay_rate^((step - transition_begin) / transition_steps)
// (the exponent floored with staircase), init_value up to transition_begin, clipped at end_value
// when given (a floor when decaying, a ceiling when growing). transition_steps <= 0 gives the
// constant init_value. Throws ValueError for a zero decay_rate.
Schedule exponential_decay(float init_value, std::int64_t transition_steps, float decay_rate,
                           std::int64_t transition_begin = 0, bool staircase = false,
                           std::optional<float> end_value = std::nullopt);

// optax.piecewise_constant_schedule: init_value, multiplied by each scale from its boundary step on
// ({{1000, 0.1}, {2000, 0.1}}: x0.1 from step 1000, x0.01 from step 2000).
Schedule piecewise_constant_schedule(float init_value, std::vector<std::pair<std::int64_t, float>> boundaries_and_scales);

// optax.polynomial_schedule: (init - end) * (1 - t / transition_steps)^power + end with
// t = clip(step - transition_begin, 0, transition_steps). transition_steps <= 0: constant init_value.
Schedule polynomial_schedule(float init_value, float end_value, double power, std::int64_t transition_steps,
                             std::int64_t transition_begin = 0);

// optax.join_schedules: schedules[0] until boundaries[0], then schedules[1] counted from that
// boundary, and so on. Throws ValueError unless there is one boundary fewer than schedules.
Schedule join_schedules(std::vector<Schedule> schedules, std::vector<std::int64_t> boundaries);

// optax.cosine_onecycle_schedule: cosine from peak/div_factor up to peak_value over the first
// pct_start of transition_steps, then cosine down to peak/(div_factor*final_div_factor).
Schedule cosine_onecycle_schedule(std::int64_t transition_steps, float peak_value, double pct_start = 0.3,
                                  double div_factor = 25.0, double final_div_factor = 1e4);

// A learning rate: a constant (a number) or a Schedule (any callable from the step to a float).
//   optim::adam(1e-3);   optim::adam(optim::cosine_decay_schedule(1e-3, 10000));
class LearningRate {
 public:
  // A constant learning rate.
  LearningRate(double value) : value_(value) {}  // NOLINT(google-explicit-constructor)
  // A learning rate that follows `schedule` (called with the step count 0, 1, 2, ...).
  template <class F>
    requires(!std::is_arithmetic_v<std::decay_t<F>> && std::is_invocable_r_v<float, F&, std::int64_t>)
  LearningRate(F schedule) : schedule_(std::move(schedule)) {}  // NOLINT(google-explicit-constructor)

  // True when this learning rate is a schedule rather than a constant.
  bool is_schedule() const { return static_cast<bool>(schedule_); }
  // The constant value (meaningful when !is_schedule()).
  double value() const { return value_; }
  // The schedule (empty when !is_schedule()).
  const Schedule& schedule() const { return schedule_; }

 private:
  double value_ = 0.0;
  Schedule schedule_;
};

// ---- gradient transformations ------------------------------------------------------------------

// What update() returns: the transformed updates (same structure as the gradients) and the next
// optimizer state. Usable with structured bindings: `auto [updates, state] = opt.update(...)`.
struct UpdateResult {
  // The transformed gradients; add them to the parameters with apply_updates.
  Tree updates;
  // The optimizer state to pass to the next update.
  Tree state;
};

// What step() returns: the parameters after the update and the next optimizer state.
struct StepResult {
  Tree params;
  Tree state;
};

// What some transformations need besides the gradients, the state and the parameters (optax's
// extra_args, GradientTransformationExtraArgs): the objective's value at the parameters (polyak_sgd,
// linesearches), a function giving its value at other parameters (a linesearch's trial points),
// and its gradient at the parameters (a linesearch's slope; when not given, the gradients passed to
// update()). A transformation that needs one that is missing throws ValueError naming it. chain,
// apply_if_finite and multi_steps pass them to their transformations; masked and multi_transform do
// not (theirs see part of the parameters, where value_fn does not apply).
//   auto [loss, grads] = value_and_grad(objective)(params);
//   auto [updates, state2] = opt.update(grads, state, params, {.value = loss.item(), .value_fn = objective_value});
struct ExtraArgs {
  std::optional<float> value;
  std::function<float(const Tree& params)> value_fn;
  std::optional<Tree> grad;
};

// A pure optimizer step, as optax.GradientTransformation: init builds a state from the
// parameters; update maps (gradients, state, parameters) to (updates, next state).
class GradientTransformation {
 public:
  // Builds the initial state from the parameters.
  using InitFn = std::function<Tree(const Tree& params)>;
  // Maps (updates, state, params or nullptr when not given) to (updates, next state).
  using UpdateFn = std::function<UpdateResult(const Tree& updates, const Tree& state, const Tree* params)>;
  // The same with the extra arguments (ExtraArgs; empty when update() was called without them).
  using UpdateWithArgsFn =
      std::function<UpdateResult(const Tree& updates, const Tree& state, const Tree* params, const ExtraArgs& extra)>;

  // A transformation called `name` in error messages (e.g. "optim::scale_by_adam").
  GradientTransformation(std::string name, InitFn init, UpdateFn update)
      : name_(std::move(name)), init_(std::move(init)), update_(std::move(update)) {}
  // One that reads extra arguments (optax's GradientTransformationExtraArgs).
  static GradientTransformation with_extra_args(std::string name, InitFn init, UpdateWithArgsFn update);
  // Whether update() reads extra arguments (then pass them with the four-argument update()).
  bool uses_extra_args() const { return static_cast<bool>(update_with_args_); }

  // The initial state for `params` (which fixes the structure every later call must have).
  Tree init(const Tree& params) const;

  // One step without the parameters. Transformations that need them (add_decayed_weights, hence
  // adamw) throw ValueError asking for them.
  UpdateResult update(const Tree& grads, const Tree& state) const;

  // One step: the updates for `grads` and the next state. `params` are the current parameters.
  UpdateResult update(const Tree& grads, const Tree& state, const Tree& params) const;
  // One step with extra arguments: transformations that read them (and chains of them) get them,
  // the others ignore them. extra.grad defaults to `grads`.
  UpdateResult update(const Tree& grads, const Tree& state, const Tree& params, const ExtraArgs& extra) const;

  // update() and apply_updates() in one call: the parameters after this step and the next state,
  // the same values as
  //   auto [updates, next] = opt.update(grads, state, params); params = apply_updates(params, updates);
  // adam and adamw (float32 leaves; a constant learning rate or a schedule) run it as one parallel
  // pass per leaf that reads each parameter, gradient and moment once; passed by value with
  // std::move, the parameters and state are updated in their own buffers (when nothing else holds
  // them):
  //   auto [params2, state2] = opt.step(std::move(params), grads, std::move(state));
  StepResult step(Tree params, const Tree& grads, Tree state) const;

  // The name used in error messages.
  const std::string& name() const { return name_; }

  // Whether update() takes per-example gradients (every leaf with a leading batch axis in front of
  // its parameter's shape), as differentially_private_aggregate and chains starting with it do.
  bool takes_per_example_gradients() const { return per_example_; }
  GradientTransformation taking_per_example_gradients() const {
    GradientTransformation t = *this;
    t.per_example_ = true;
    return t;
  }

  // A fused step: (params, grads, state) -> StepResult.
  using StepFn = std::function<StepResult(Tree&& params, const Tree& grads, Tree&& state)>;
  // This transformation with a fused step(), which must give exactly what update + apply_updates give.
  GradientTransformation with_fused_step(StepFn step) const {
    GradientTransformation t = *this;
    t.step_ = std::move(step);
    return t;
  }

 private:
  // ValueError unless grads have the params' structure (with a leading batch axis per leaf when
  // this transformation takes per-example gradients).
  void check_grads_against(const Tree& grads, const Tree& params) const;

  std::string name_;
  bool per_example_ = false;
  InitFn init_;
  UpdateFn update_;
  UpdateWithArgsFn update_with_args_;  // set for transformations that read extra arguments
  StepFn step_;
};

// params + updates leaf by leaf (optax.apply_updates). Throws ValueError naming the first path
// where the structures or shapes differ, or a leaf that is not a float array.
Tree apply_updates(const Tree& params, const Tree& updates);

// The L2 norm of all leaves together: sqrt(sum over leaves of sum(x^2)), accumulated in double.
float global_norm(const Tree& tree);

// Applies the transformations in order, each to the previous one's updates (optax.chain). The
// state is {"0": state of the first, "1": state of the second, ...}.
GradientTransformation chain(std::vector<GradientTransformation> transformations);
// chain(a, b, c): the same as chain({a, b, c}).
template <class... T>
  requires(sizeof...(T) >= 1 && (std::convertible_to<T, GradientTransformation> && ...))
GradientTransformation chain(T... transformations) {
  return chain(std::vector<GradientTransformation>{GradientTransformation(std::move(transformations))...});
}

// Leaves updates unchanged; state {} (optax.identity).
GradientTransformation identity();

// Multiplies updates by the constant `step_size`; state {} (optax.scale).
GradientTransformation scale(double step_size);

// Multiplies updates by schedule(count), then counts the step; state {"count": int32[]}
// (optax.scale_by_schedule).
GradientTransformation scale_by_schedule(Schedule schedule);

// Multiplies updates by -learning_rate: scale(-lr) for a constant, scale_by_schedule(-schedule)
// for a schedule (optax.scale_by_learning_rate).
GradientTransformation scale_by_learning_rate(LearningRate learning_rate);

// Momentum (optax.trace): trace = g + decay * trace_prev; the update is the trace, or
// g + decay * trace with nesterov. State {"trace": <params structure>}.
GradientTransformation trace(double decay, bool nesterov = false);

// Adam's rescaling (optax.scale_by_adam): mu = (1-b1) g + b1 mu, nu = (1-b2) g^2 + b2 nu,
// t = count + 1, update = (mu / (1 - b1^t)) / (sqrt(nu / (1 - b2^t) + eps_root) + eps).
// State {"count": int32[], "mu": ..., "nu": ...}.
// With nesterov (NAdam, Dozat 2016) the first moment looks one step ahead:
// mu_hat = b1 mu / (1 - b1^(t+1)) + (1 - b1) g / (1 - b1^t).
GradientTransformation scale_by_adam(double b1 = 0.9, double b2 = 0.999, double eps = 1e-8, double eps_root = 0.0,
                                     bool nesterov = false);

// Adds weight_decay * params to the updates (optax.add_decayed_weights); needs the params.
// State {}. A zero weight decay leaves the updates unchanged (as optax).
GradientTransformation add_decayed_weights(double weight_decay);

// Rescales all updates together so that their global norm is at most max_norm: unchanged when
// global_norm < max_norm, else each leaf becomes (u / norm) * max_norm (optax.clip_by_global_norm).
// State {}. Throws ValueError if max_norm is negative or not finite.
GradientTransformation clip_by_global_norm(double max_norm);

// ---- optimizers ------------------------------------------------------------------------------

// Stochastic gradient descent (optax.sgd): chain(trace(momentum, nesterov), scale_by_learning_rate).
// momentum == 0 means no momentum at all (optax's momentum=None): chain(identity, scale_by_lr),
// state {"0": {}, "1": {...}}, and nesterov is ignored. Throws ValueError for a negative momentum.
GradientTransformation sgd(LearningRate learning_rate, double momentum = 0.0, bool nesterov = false);

// Adam (optax.adam): chain(scale_by_adam(b1, b2, eps, eps_root), scale_by_learning_rate(lr)).
GradientTransformation adam(LearningRate learning_rate, double b1 = 0.9, double b2 = 0.999, double eps = 1e-8,
                            double eps_root = 0.0);

// AdamW (optax.adamw): chain(scale_by_adam(b1, b2, eps, eps_root), add_decayed_weights(weight_decay),
// scale_by_learning_rate(lr)), so the decoupled decay is scaled by the learning rate:
// update = -lr * (adam_update + weight_decay * params). optax's default weight_decay is 1e-4.
// update() needs the params.
GradientTransformation adamw(LearningRate learning_rate, double b1 = 0.9, double b2 = 0.999, double eps = 1e-8,
                             double weight_decay = 1e-4, double eps_root = 0.0);

// ---- the optax toolbox -------------------------------------------------------------------------

// Which leaves a masked transformation touches: called with each leaf's path and value.
using Mask = std::function<bool(const std::string& path, const Array& leaf)>;

// RMSProp's rescaling (optax.scale_by_rms): nu = (1 - decay) g^2 + decay nu (nu starts at
// initial_scale), update = g / sqrt(nu + eps) (eps_in_sqrt) or g / (sqrt(nu) + eps). State {"nu"}.
GradientTransformation scale_by_rms(double decay = 0.9, double eps = 1e-8, double initial_scale = 0.0,
                                    bool eps_in_sqrt = true);
// Centered RMSProp (optax.scale_by_stddev): also mu = (1 - decay) g + decay mu, update =
// g / sqrt(nu - mu^2 + eps). State {"mu", "nu"}.
GradientTransformation scale_by_stddev(double decay = 0.9, double eps = 1e-8, double initial_scale = 0.0,
                                       bool eps_in_sqrt = true);
// Adagrad's rescaling (optax.scale_by_rss): s = g^2 + s (s starts at initial_accumulator_value),
// update = g / sqrt(s + eps) where s > 0, else 0. State {"sum_of_squares"}.
GradientTransformation scale_by_rss(double initial_accumulator_value = 0.1, double eps = 1e-7);
// Lion's rescaling (optax.scale_by_lion): update = sign((1 - b1) g + b1 mu), then
// mu = (1 - b2) g + b2 mu. State {"count", "mu"}.
GradientTransformation scale_by_lion(double b1 = 0.9, double b2 = 0.99);
// AdaBelief's rescaling (optax.scale_by_belief): mu as Adam's; s = (1 - b2) (g - mu)^2 + b2 s + eps_root,
// update = mu_hat / (sqrt(s_hat) + eps) with Adam's bias corrections. State {"count", "mu", "nu"}.
GradientTransformation scale_by_belief(double b1 = 0.9, double b2 = 0.999, double eps = 1e-16, double eps_root = 1e-16);
// LAMB's layer-wise trust ratio (optax.scale_by_trust_ratio): each leaf's update times
// trust_coefficient * |param| / (|update| + eps), or times 1 when either norm is 0 (norms at least
// min_norm). Needs the params. State {}.
GradientTransformation scale_by_trust_ratio(double min_norm = 0.0, double trust_coefficient = 1.0, double eps = 0.0);
// Adafactor's factored second moments (optax.scale_by_factored_rms): leaves of rank >= 2 whose
// second-largest dimension is at least min_dim_size_to_factor keep row and column statistics of
// g^2 + eps instead of a full second moment; decay 1 - (step + 1)^-decay_rate. Needs the params.
// State {"count", "v_row", "v_col", "v"} (unused parts are [1] zeros, as optax).
GradientTransformation scale_by_factored_rms(bool factored = true, double decay_rate = 0.8, std::int64_t step_offset = 0,
                                             std::int64_t min_dim_size_to_factor = 128, double eps = 1e-30);
// Each leaf divided by max(1, rms(leaf) / threshold) (optax.clip_by_block_rms). State {}.
GradientTransformation clip_by_block_rms(double threshold);
// Each leaf times max(rms(param), min_scale) (optax.scale_by_param_block_rms). Needs the params.
GradientTransformation scale_by_param_block_rms(double min_scale = 1e-3);
// Exponential moving average of the updates (optax.ema): ema = (1 - decay) g + decay ema; the
// update is ema, divided by 1 - decay^t with debias. State {"count", "ema"}.
GradientTransformation ema(double decay, bool debias = true);
// add_decayed_weights on the leaves `mask` selects (optax.add_decayed_weights with mask, e.g. no
// decay for biases and norms).
GradientTransformation add_decayed_weights(double weight_decay, Mask mask);

// `inner` on the leaves `mask` selects; the others pass unchanged (optax.masked). The inner state
// is built from the selected leaves only. State {"inner_state": ...}.
GradientTransformation masked(GradientTransformation inner, Mask mask);
// Each leaf's label: which of multi_transform's transformations updates it.
using Labels = std::function<std::string(const std::string& path, const Array& leaf)>;
// A transformation per group of leaves (optax.multi_transform, renamed optax.transforms.partition):
// each leaf goes to the transformation its label names, e.g. adam for the weights and set_to_zero
// for frozen ones. Each transformation runs as masked() on its group. State {"inner_states": {label:
// {"inner_state": ...}}}. A label with no transformation is a ValueError naming both lists.
GradientTransformation multi_transform(std::vector<std::pair<std::string, GradientTransformation>> transforms, Labels labels);
// `inner` while the updates are finite; a step with a NaN or infinity gives zero updates and keeps
// the inner state, unless more than max_consecutive_errors such steps came in a row
// (optax.apply_if_finite). State {"notfinite_count", "last_finite" (int32 0/1: Linum has no bool
// arrays), "total_notfinite", "inner_state"}.
GradientTransformation apply_if_finite(GradientTransformation inner, std::int64_t max_consecutive_errors);
// Gradient accumulation (optax.MultiSteps): the gradients of every_k_steps calls are averaged and
// `inner` runs on the average at every k-th call; the other calls return zero updates. State
// {"mini_step", "gradient_step", "inner_opt_state", "acc_grads", "skip_state": {}}.
GradientTransformation multi_steps(GradientTransformation inner, std::int64_t every_k_steps);

// Differentially private aggregation (optax.differentially_private_aggregate, DP-SGD): the updates
// are per-example gradients, every leaf with one leading batch axis (vmap(grad(loss)) gives them);
// each example's gradient is scaled to global L2 norm at most l2_norm_clip, the scaled gradients
// are summed, Gaussian noise of standard deviation l2_norm_clip * noise_multiplier is added to every
// coordinate, and the result is divided by the batch size: updates shaped as the parameters. The
// noise keys come from jax.random.PRNGKey(seed), split once per step into a next key and one key per
// leaf (flatten order), as optax. State {"rng_key": int32[2], the key's words}.
GradientTransformation differentially_private_aggregate(double l2_norm_clip, double noise_multiplier, std::int64_t seed);
// DP-SGD (optax.dpsgd): chain(differentially_private_aggregate, sgd(learning_rate, momentum, nesterov)).
GradientTransformation dpsgd(LearningRate learning_rate, double l2_norm_clip, double noise_multiplier, std::int64_t seed,
                             double momentum = 0.0, bool nesterov = false);

// step_size * new + (1 - step_size) * old, leaf by leaf (optax.incremental_update): an EMA of the
// parameters, e.g. ema_params = incremental_update(params, ema_params, 1e-3) after each step.
Tree incremental_update(const Tree& new_tree, const Tree& old_tree, double step_size);

// RMSProp (optax.rmsprop): chain(scale_by_rms or, centered, scale_by_stddev; scale_by_learning_rate;
// trace(momentum, nesterov) when momentum > 0, identity otherwise). eps_in_sqrt as optax's: g /
// sqrt(nu + eps) (the default) or g / (sqrt(nu) + eps) (PyTorch's RMSprop). It comes last, after
// the arguments Linum had before it, so no existing positional call changes meaning.
GradientTransformation rmsprop(LearningRate learning_rate, double decay = 0.9, double eps = 1e-8,
                               double initial_scale = 0.0, bool centered = false, double momentum = 0.0,
                               bool nesterov = false, bool eps_in_sqrt = true);
// Adagrad (optax.adagrad): chain(scale_by_rss(initial_accumulator_value, eps), scale_by_learning_rate).
GradientTransformation adagrad(LearningRate learning_rate, double initial_accumulator_value = 0.1, double eps = 1e-7);
// Lion (optax.lion): chain(scale_by_lion(b1, b2), add_decayed_weights(weight_decay), scale_by_learning_rate).
GradientTransformation lion(LearningRate learning_rate, double b1 = 0.9, double b2 = 0.99, double weight_decay = 1e-3);
// LAMB (optax.lamb): chain(scale_by_adam(b1, b2, eps, eps_root), add_decayed_weights(weight_decay),
// scale_by_trust_ratio(), scale_by_learning_rate). Needs the params.
GradientTransformation lamb(LearningRate learning_rate, double b1 = 0.9, double b2 = 0.999, double eps = 1e-6,
                            double eps_root = 0.0, double weight_decay = 0.0);
// AdaBelief (optax.adabelief): chain(scale_by_belief(b1, b2, eps, eps_root), scale_by_learning_rate).
GradientTransformation adabelief(LearningRate learning_rate, double b1 = 0.9, double b2 = 0.999, double eps = 1e-16,
                                 double eps_root = 1e-16);
// Adafactor (optax.adafactor, its defaults): chain(scale_by_factored_rms, clip_by_block_rms(
// clipping_threshold) when > 0, the learning rate without sign flip, scale_by_param_block_rms when
// multiply_by_parameter_scale, ema(momentum, debias = false) when momentum > 0, scale(-1)).
GradientTransformation adafactor(LearningRate learning_rate, std::int64_t min_dim_size_to_factor = 128,
                                 double decay_rate = 0.8, std::int64_t decay_offset = 0,
                                 bool multiply_by_parameter_scale = true, double clipping_threshold = 1.0,
                                 double momentum = 0.0, double eps = 1e-30, bool factored = true);

// ---- more adaptive optimizers (optax's) ----------------------------------------------------------
//
// Each rescaling keeps optax's state layout; each optimizer is optax's chain of a rescaling and
// scale_by_learning_rate (so its state is {"0": <rescaling state>, "1": <learning rate state>}).

// AMSGrad's rescaling (optax.scale_by_amsgrad): Adam's moments, and nu_max, the running maximum of
// the bias-corrected second moment (of nu itself without bias_correction_nu); update =
// mu_hat / (sqrt(nu_max + eps_root) + eps). State {"count", "mu", "nu", "nu_max"}.
GradientTransformation scale_by_amsgrad(double b1 = 0.9, double b2 = 0.999, double eps = 1e-8, double eps_root = 0.0,
                                        bool bias_correction_mu = true, bool bias_correction_nu = true);
// Adamax's rescaling (optax.scale_by_adamax): mu as Adam's, nu = max(|g| + eps, b2 nu) (an
// exponentially weighted infinity norm), update = (mu / (1 - b1^t)) / nu. State {"count", "mu", "nu"}.
GradientTransformation scale_by_adamax(double b1 = 0.9, double b2 = 0.999, double eps = 1e-8);
// Rectified Adam's rescaling (optax.scale_by_radam): Adam's step times the rectification
// r = sqrt((ro - 4)(ro - 2) ro_inf / ((ro_inf - 4)(ro_inf - 2) ro)) once ro = ro_inf -
// 2 t b2^t / (1 - b2^t) reaches threshold (ro_inf = 2 / (1 - b2) - 1), and the bias-corrected first
// moment alone before. nesterov as scale_by_adam's. State {"count", "mu", "nu"}.
GradientTransformation scale_by_radam(double b1 = 0.9, double b2 = 0.999, double eps = 1e-8, double eps_root = 0.0,
                                      double threshold = 5.0, bool nesterov = false);
// Yogi's rescaling (optax.scale_by_yogi): nu = nu - (1 - b2) sign(nu - g^2) g^2 (additive, so nu
// grows slowly after large gradients), mu and nu start at initial_accumulator_value, update as
// Adam's. State {"count", "mu", "nu"}.
GradientTransformation scale_by_yogi(double b1 = 0.9, double b2 = 0.999, double eps = 1e-3, double eps_root = 0.0,
                                     double initial_accumulator_value = 1e-6);
// Adadelta's rescaling (optax.scale_by_adadelta): e_g = (1 - rho) g^2 + rho e_g, update =
// sqrt(e_x + eps) / sqrt(e_g + eps) * g (e_x before this step), then e_x = (1 - rho) update^2 + rho e_x.
// State {"e_g", "e_x"}.
GradientTransformation scale_by_adadelta(double rho = 0.9, double eps = 1e-6);
// NovoGrad's rescaling (optax.scale_by_novograd): a second moment per layer, nu = (1 - b2) |g|^2 +
// b2 nu (|g|^2 at the first step), and mu = b1 mu + g / (sqrt(nu + eps_root) + eps) + weight_decay *
// params (without b1 mu at the first step); the update is mu. Needs the params. State {"count",
// "mu", "nu": one scalar per leaf}.
GradientTransformation scale_by_novograd(double b1 = 0.9, double b2 = 0.25, double eps = 1e-8, double eps_root = 0.0,
                                         double weight_decay = 0.0);

// NAdam (optax.nadam): adam with scale_by_adam(..., nesterov = true).
GradientTransformation nadam(LearningRate learning_rate, double b1 = 0.9, double b2 = 0.999, double eps = 1e-8,
                             double eps_root = 0.0);
// NAdamW (optax.nadamw): adamw with scale_by_adam(..., nesterov = true); `mask` (when given) picks
// the leaves that decay. Needs the params.
GradientTransformation nadamw(LearningRate learning_rate, double b1 = 0.9, double b2 = 0.999, double eps = 1e-8,
                              double weight_decay = 1e-4, double eps_root = 0.0, Mask mask = nullptr);
// AMSGrad (optax.amsgrad): chain(scale_by_amsgrad, scale_by_learning_rate).
GradientTransformation amsgrad(LearningRate learning_rate, double b1 = 0.9, double b2 = 0.999, double eps = 1e-8,
                               double eps_root = 0.0, bool bias_correction_mu = true, bool bias_correction_nu = true);
// Adan's rescaling (optax.scale_by_adan, Xie et al. 2022): m, v and n the moving averages of the
// gradient, of its change since the last step (0 at the first) and of the square of g + (1 - b2)
// change; update = (m_hat + (1 - b2) v_hat) / (sqrt(n_hat + eps_root) + eps), each bias-corrected.
// State {"m", "v", "n", "g", "t"} (g: the last gradient; t: the step count).
GradientTransformation scale_by_adan(double b1 = 0.98, double b2 = 0.92, double b3 = 0.99, double eps = 1e-8,
                                     double eps_root = 0.0);
// The sign of each gradient element (optax.scale_by_sign; 0 stays 0, NaN stays NaN). No state.
GradientTransformation scale_by_sign();
// SM3's rescaling (optax.scale_by_sm3, Anil et al. 2019): one accumulator per axis of each leaf
// instead of one per element; accum = (1 - b2 or 1 when b2 = 1) g^2 + b2 min over the axes'
// accumulators, update = momentum b1 of g / sqrt(accum + eps) (0 where accum is 0); each axis keeps
// the max of accum over the other axes. State {"mu": per leaf {"0": [d0], "1": [d1], ...}, "nu"};
// leaves must have rank >= 1.
GradientTransformation scale_by_sm3(double b1 = 0.9, double b2 = 1.0, double eps = 1e-8);
// Adan (optax.adan): chain(scale_by_adan, add_decayed_weights(weight_decay, mask),
// scale_by_learning_rate).
GradientTransformation adan(LearningRate learning_rate, double b1 = 0.98, double b2 = 0.92, double b3 = 0.99,
                            double eps = 1e-8, double eps_root = 1e-8, double weight_decay = 0.0, Mask mask = nullptr);
// AdamaxW (optax.adamaxw): chain(scale_by_adamax, add_decayed_weights(weight_decay, mask),
// scale_by_learning_rate).
GradientTransformation adamaxw(LearningRate learning_rate, double b1 = 0.9, double b2 = 0.999, double eps = 1e-8,
                               double weight_decay = 1e-4, Mask mask = nullptr);
// signSGD (optax.sign_sgd): chain(scale_by_sign, scale_by_learning_rate).
GradientTransformation sign_sgd(LearningRate learning_rate);
// SM3 (optax.sm3): chain(scale_by_sm3(momentum), scale(-learning_rate)).
GradientTransformation sm3(double learning_rate, double momentum = 0.9);
// Fromage (optax.fromage, Bernstein et al. 2020): chain(scale_by_trust_ratio(min_norm),
// scale_by_learning_rate(lr / sqrt(1 + lr^2)), add_decayed_weights(1 / sqrt(1 + lr^2) - 1)). Needs
// the params.
GradientTransformation fromage(double learning_rate, double min_norm = 1e-6);

// ---- clipping, constraints and noise (optim_constraints.cpp, optim_noise.cpp) -------------------

// Each element clipped to [-max_delta, max_delta] (optax.clip; NaN stays NaN). No state.
GradientTransformation clip(double max_delta);
// Adaptive gradient clipping (optax.adaptive_grad_clip, Brock et al. 2021): each unit of a leaf
// whose gradient norm exceeds clipping * max(its parameter norm, eps) is scaled down to that norm.
// A unit is what optax's unitwise_norm reduces over: the whole leaf when at most one of its axes is
// longer than 1, axis 0 for rank 2 and 3 (a Dense kernel's inputs, per output), axes 0-2 for rank 4
// (a convolution kernel HWIO, per output channel), axes 0-3 for rank 5; other ranks are an error.
// Needs the params. No state.
GradientTransformation adaptive_grad_clip(double clipping, double eps = 1e-3);
// Gradient centralization (optax.centralize, Yong et al. 2020): each leaf of rank >= 2 minus its
// mean over every axis but the first; vectors and scalars unchanged. No state.
GradientTransformation centralize();
// Updates that would make a parameter negative become -param (optax.keep_params_nonnegative): the
// parameter lands on 0. Needs the params. No state.
GradientTransformation keep_params_nonnegative();
// NaN elements replaced by 0 (optax.zero_nans). State {"found_nan": per leaf an int32 scalar, 1 if
// the last update had a NaN there (optax's bool)}.
GradientTransformation zero_nans();
// Every update 0 (optax.set_to_zero): frozen parameters, usually under masked(). No state.
GradientTransformation set_to_zero();
// Annealed Gaussian noise (optax.add_noise, Neelakantan et al. 2015): g + sqrt(eta / t^gamma) n at
// step t = 1, 2, ..., n ~ N(0, 1) drawn as optax draws it (the key split in two, the second split
// once per leaf in tree order, jax.random.normal), so the noise is bitwise optax's for the same
// seed. State {"count", "rng_key": int32[2], the key's words}.
GradientTransformation add_noise(double eta, double gamma, std::int64_t seed);
// Noisy SGD (optax.noisy_sgd): chain(add_noise(eta, gamma, seed), scale_by_learning_rate).
GradientTransformation noisy_sgd(LearningRate learning_rate, double eta = 0.01, double gamma = 0.55, std::int64_t seed = 0);
// Optimistic gradient (optax.scale_by_optimistic_gradient, Daskalakis et al. 2018): (alpha + beta)
// g - beta g_prev, with g_prev = g at the first step. State {"is_initial_step": int32 scalar (optax's
// bool), "previous_gradient"}.
GradientTransformation scale_by_optimistic_gradient(double alpha = 1.0, double beta = 1.0);
// Optimistic gradient descent (optax.optimistic_gradient_descent): chain(scale_by_optimistic_gradient,
// scale_by_learning_rate), for min-max games.
GradientTransformation optimistic_gradient_descent(LearningRate learning_rate, double alpha = 1.0, double beta = 1.0);
// Adamax (optax.adamax): chain(scale_by_adamax, scale_by_learning_rate).
GradientTransformation adamax(LearningRate learning_rate, double b1 = 0.9, double b2 = 0.999, double eps = 1e-8);
// RAdam (optax.radam): chain(scale_by_radam, scale_by_learning_rate).
GradientTransformation radam(LearningRate learning_rate, double b1 = 0.9, double b2 = 0.999, double eps = 1e-8,
                             double eps_root = 0.0, double threshold = 5.0, bool nesterov = false);
// Yogi (optax.yogi): chain(scale_by_yogi(b1, b2, eps), scale_by_learning_rate).
GradientTransformation yogi(LearningRate learning_rate, double b1 = 0.9, double b2 = 0.999, double eps = 1e-3);
// Adadelta (optax.adadelta): chain(add_decayed_weights(weight_decay, weight_decay_mask),
// scale_by_adadelta(rho, eps), scale_by_learning_rate). optax lets the learning rate be None (no
// scaling, so the "update" ascends the gradient); Linum asks for one (1.0 is Adadelta's paper).
GradientTransformation adadelta(LearningRate learning_rate, double rho = 0.9, double eps = 1e-6, double weight_decay = 0.0,
                                Mask weight_decay_mask = nullptr);
// NovoGrad (optax.novograd): chain(scale_by_novograd, scale_by_learning_rate). Needs the params.
GradientTransformation novograd(LearningRate learning_rate, double b1 = 0.9, double b2 = 0.25, double eps = 1e-6,
                                double eps_root = 0.0, double weight_decay = 0.0);
// LARS (optax.lars): chain(masked(add_decayed_weights(weight_decay), weight_decay_mask),
// masked(scale_by_trust_ratio(0, trust_coefficient, eps), trust_ratio_mask), scale_by_learning_rate,
// trace(momentum, nesterov)). An empty mask means every leaf (optax's default True); the state is
// then {"0": {"inner_state": {}}, "1": {"inner_state": {}}, "2": {}, "3": {"trace": ...}}, as optax's.
// Needs the params.
GradientTransformation lars(LearningRate learning_rate, double weight_decay = 0.0, Mask weight_decay_mask = nullptr,
                            double trust_coefficient = 0.001, double eps = 0.0, Mask trust_ratio_mask = nullptr,
                            double momentum = 0.9, bool nesterov = false);

// ---- step sizes from the objective, and L-BFGS (optim_linesearch.cpp, optim_lbfgs.cpp) ---------
//
// These read extra arguments (ExtraArgs): call update(grads, state, params, {.value = loss, ...}).
//   auto opt = optim::lbfgs();                                  // L-BFGS with a backtracking linesearch
//   Tree state = opt.init(params);
//   for (...) {
//     auto [loss, grads] = value_and_grad(objective)(params);  // loss: a scalar Array
//     auto [updates, next] = opt.update(grads, state, params, {.value = loss.item(), .value_fn = objective_value});
//     params = optim::apply_updates(params, updates);
//     state = next;
//   }

// Which Polyak step: optax's variant 'sps' or 'sps+' (the gap to f_min floored at 0).
enum class PolyakVariant { sps, sps_plus };

// Polyak's step size (optax.scale_by_polyak): updates times min((value - f_min) / (|u|^2 + eps),
// max_learning_rate), or times 0 when |u|^2 + eps is below float epsilon. Reads extra.value. State {}.
GradientTransformation scale_by_polyak(double f_min = 0.0, double max_learning_rate = 1.0, double eps = 0.0,
                                       PolyakVariant variant = PolyakVariant::sps);
// Polyak SGD (optax.polyak_sgd): chain(sgd(scaling), scale_by_polyak(f_min, max_learning_rate, eps, variant)),
// so the step is measured on -scaling * g. For objectives whose minimum f_min is known (0 for
// interpolating models). Reads extra.value.
GradientTransformation polyak_sgd(double max_learning_rate = 1.0, LearningRate scaling = 1.0, double f_min = 0.0,
                                  double eps = 0.0, PolyakVariant variant = PolyakVariant::sps);

// A backtracking linesearch ensuring sufficient decrease (optax.scale_by_backtracking_linesearch,
// the Armijo criterion): starting from min(increase_factor * the last step, max_learning_rate), the
// step shrinks by decrease_factor until value_fn(params + step * updates) <= (1 + rtol) value +
// step * slope_rtol * (updates . grad) + atol, at most max_backtracking_steps + 1 trials; a step
// whose trials all gave NaN or infinity becomes 0. The updates come out times the step. Reads
// extra.value, extra.value_fn and extra.grad (default: update()'s gradients); needs the params.
// State {"grad": {} (optax's None: Linum does not store the gradient), "info": {"decrease_error",
// "num_linesearch_steps"}, "learning_rate", "value"} (the value at the chosen step).
GradientTransformation scale_by_backtracking_linesearch(std::int64_t max_backtracking_steps, double slope_rtol = 1e-4,
                                                        double decrease_factor = 0.8, double increase_factor = 1.5,
                                                        double max_learning_rate = 1.0, double atol = 0.0, double rtol = 0.0);

// L-BFGS's direction (optax.scale_by_lbfgs): the updates times the inverse-Hessian approximation of
// the last memory_size differences of parameters and of updates (the two-loop recursion), scaled
// at first by gamma = (dw . du) / (du . du) (scale_init_precond; at the first step min(1, 1 / |u|))
// or 1. Needs the params. State {"count", "diff_params_memory" and "diff_updates_memory" (every
// leaf [memory_size, ...]), "params", "updates", "weights_memory": f32[memory_size]}.
GradientTransformation scale_by_lbfgs(std::int64_t memory_size = 10, bool scale_init_precond = true);
// L-BFGS (optax.lbfgs): chain(scale_by_lbfgs(memory_size, scale_init_precond), scale(-1) without a
// learning rate or scale_by_learning_rate(learning_rate), linesearch). optax's default linesearch is
// its zoom linesearch (strong Wolfe conditions), which Linum does not have: here the default is
// scale_by_backtracking_linesearch(20) (in Python: optax.lbfgs(linesearch=
// optax.scale_by_backtracking_linesearch(max_backtracking_steps=20)) gives the same steps); pass
// identity() for none (optax's linesearch=None). With a linesearch it reads extra arguments.
GradientTransformation lbfgs(std::optional<LearningRate> learning_rate = std::nullopt, std::int64_t memory_size = 10,
                             bool scale_init_precond = true,
                             GradientTransformation linesearch = scale_by_backtracking_linesearch(20));

}  // namespace linum::optim
