// User-defined differentiable functions (jax.custom_vjp), and the way to add an op to Linum.
//
//   // y = x * sigmoid(x) ("swish") with a hand-written backward rule.
//   auto swish = linum::custom_vjp(
//       "swish",
//       [](const Array& x) {                        // forward: (output, residuals)
//         Array s = sigmoid(x);
//         return std::make_pair(x * s, std::make_tuple(x, s));
//       },
//       [](const std::tuple<Array, Array>& res, const Array& g) {   // backward: residuals, output
//         const auto& [x, s] = res;                                   // cotangent -> input cotangents
//         return g * s * (1.0f + x * (1.0f - s));
//       });
//   Array y = swish(x);
//
// forward(args...) returns std::pair(output, residuals); backward(residuals, output cotangent)
// returns the cotangents of the arguments: one value for a one-argument function, otherwise a
// std::tuple with one entry per argument. Arguments, outputs, residuals and cotangents are any
// pytrees (Array, Tree, std::vector/pair/tuple of them, structs registered with pytree::Fields);
// arguments of other types (ints, options) are constants and their tuple entry is ignored (return
// anything, e.g. 0). An output cotangent that nothing produced arrives as zeros.
//
// The function is one primitive (core/autodiff/primitive.hpp): its forward runs without recording
// (the ops inside are not differentiated; backward says what the gradient is), its residuals are
// what the rule keeps, and everything the dispatcher gives built-in ops holds for it: remat
// policies see its outputs by its name (a saved output is not computed again on replay), a replay
// rebuilds residuals that are its arguments or outputs and keeps the others with a saved output,
// saved-value hooks pack its residuals, debug_nans names it in the forward and backward passes,
// and it works inside lift::remat, linum::checkpoint, lift::scan and nn::RNN. As for JAX's
// custom_vjp, forward-mode and higher-order differentiation are not defined by it.
#pragma once

#include <linum/core/autodiff/grad.hpp>
#include <linum/core/autodiff/primitive.hpp>
#include <linum/core/autodiff/pytree.hpp>

#include <array>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace linum {

namespace autodiff::detail {
// A stable name for an op named at run time (nodes keep `const char*` names).
const char* intern_op_name(const std::string& name);
[[noreturn]] void throw_custom_vjp_error(const char* op, const std::string& what);
}  // namespace autodiff::detail

template <class Forward, class Backward>
class CustomVjp {
 public:
  CustomVjp(std::string name, Forward forward, Backward backward)
      : name_(autodiff::detail::intern_op_name(name)), forward_(std::move(forward)), backward_(std::move(backward)) {}

  template <class... Args>
  auto operator()(const Args&... args) const
      -> std::decay_t<typename std::decay_t<std::invoke_result_t<const Forward&, const Args&...>>::first_type> {
    using Result = std::decay_t<std::invoke_result_t<const Forward&, const Args&...>>;
    using Out = std::decay_t<typename Result::first_type>;
    using Res = std::decay_t<typename Result::second_type>;
    // The outputs' and residuals' structure without their arrays (what rebuilds them around the
    // node's arrays), and the outputs' types for zero cotangents. Filled by the forward, or by a
    // checkpoint's replay that skipped it.
    struct Structure {
      Out out;
      Res res;
      std::vector<Shape> out_shapes;
      std::vector<DType> out_dtypes;
    };
    auto structure = std::make_shared<std::shared_ptr<const Structure>>();

    std::vector<Array> flat_args;
    (pytree::flatten_into(args, flat_args), ...);
    std::vector<const Array*> inputs;
    inputs.reserve(flat_args.size());
    for (const Array& a : flat_args) inputs.push_back(&a);
    if (autodiff::any_batched(inputs)) [[unlikely]]
      return per_example(flat_args, std::index_sequence_for<Args...>{}, args...);

    std::optional<Out> direct;  // the output as the forward returned it
    std::shared_ptr<const void> erased;
    std::vector<Array> outs = autodiff::primitive_multi(
        name_, inputs,
        [&](autodiff::Residuals& r) {
          Result result = [&] {
            autodiff::NoGradGuard no_grad;  // the backward rule is given, not derived
            return forward_(pytree::detached(args)...);
          }();
          std::vector<Array> out_arrays = pytree::flatten(result.first);
          if (r.recording()) {
            auto s = std::make_shared<Structure>(Structure{hollow(result.first), hollow(result.second), {}, {}});
            for (const Array& o : out_arrays) {
              s->out_shapes.push_back(o.shape());
              s->out_dtypes.push_back(o.defined() ? o.dtype() : DType::f32);
            }
            for (const Array& a : pytree::flatten(result.second)) r.keep(a);
            *structure = s;
            erased = s;
          }
          for (const Array& o : out_arrays)
            if (!o.defined())
              autodiff::detail::throw_custom_vjp_error(name_, "its forward returned an undefined array as an output");
          direct = std::move(result.first);
          return out_arrays;
        },
        [structure, backward = backward_, name = name_](autodiff::Cotangents& c, autodiff::Saved saved) {
          const Structure& s = **structure;
          Res res = pytree::rebuild(s.res, saved);
          std::vector<Array> cts(c.num_outputs());
          for (std::size_t i = 0; i < cts.size(); ++i)
            cts[i] = c.out(i).defined() ? c.out(i) : Array::zeros(s.out_shapes[i], s.out_dtypes[i]);
          Out ct = pytree::rebuild(s.out, std::span<const Array>(cts));
          auto in_cts = backward(static_cast<const Res&>(res), static_cast<const Out&>(ct));
          std::vector<Array> flat;
          if constexpr (sizeof...(Args) == 1) {
            pytree::flatten_into(in_cts, flat);
          } else {
            static_assert(std::tuple_size_v<std::decay_t<decltype(in_cts)>> == sizeof...(Args),
                          "custom_vjp: backward must return a std::tuple with one cotangent per argument");
            flatten_cotangents<Args...>(in_cts, flat, std::index_sequence_for<Args...>{});
          }
          if (flat.size() != c.num_inputs())
            autodiff::detail::throw_custom_vjp_error(
                name, linum::detail::cat("its backward returned ", flat.size(), " arrays, but the arguments hold ", c.num_inputs(),
                                         " (one cotangent per argument array, in the arguments' order)"));
          for (std::size_t i = 0; i < flat.size(); ++i)
            if (c.needs(i)) {
              if (!flat[i].defined())
                autodiff::detail::throw_custom_vjp_error(
                    name, linum::detail::cat("its backward returned an undefined cotangent for argument array ", i));
              c.set(i, std::move(flat[i]));
            }
        },
        &erased);
    if (direct) return pytree::rebuild(*direct, std::span<const Array>(outs));
    // A replay skipped the forward: the structure came back with the saved outputs.
    *structure = std::static_pointer_cast<const Structure>(erased);
    return pytree::rebuild((*structure)->out, std::span<const Array>(outs));
  }

 private:
  // vmap: the function once per example (its own forward and backward on that example's arrays, an
  // ordinary primitive each), the outputs stacked; reported once, as any op without a batching rule.
  template <class... Args, std::size_t... Is>
  auto per_example(const std::vector<Array>& flat, std::index_sequence<Is...>, const Args&... args) const {
    std::vector<const Array*> ptrs;
    for (const Array& a : flat) ptrs.push_back(&a);
    const std::vector<BatchLevel> levels = autodiff::union_levels(ptrs, name_);
    std::int64_t total = 1;
    for (const BatchLevel& l : levels) total *= l.size;
    autodiff::detail::report_loop(name_, total);
    std::vector<std::vector<Array>> examples(flat.size());
    for (std::size_t k = 0; k < flat.size(); ++k)
      if (flat[k].batched()) examples[k] = autodiff::detail::unstack_examples(flat[k]);
    const std::array<std::size_t, sizeof...(Args)> counts{pytree::flatten(args).size()...};
    std::array<std::size_t, sizeof...(Args)> offsets{};
    for (std::size_t i = 1; i < counts.size(); ++i) offsets[i] = offsets[i - 1] + counts[i - 1];
    using Out = std::decay_t<typename std::decay_t<std::invoke_result_t<const Forward&, const Args&...>>::first_type>;
    std::optional<Out> first;
    std::vector<std::vector<Array>> outs;  // [output leaf][example]
    std::vector<std::int64_t> index(levels.size(), 0);
    for (std::int64_t n = 0; n < total; ++n) {
      for (std::int64_t rem = n, l = static_cast<std::int64_t>(levels.size()) - 1; l >= 0; --l) {
        index[static_cast<std::size_t>(l)] = rem % levels[static_cast<std::size_t>(l)].size;
        rem /= levels[static_cast<std::size_t>(l)].size;
      }
      std::vector<Array> at(flat.size());
      for (std::size_t k = 0; k < flat.size(); ++k) {
        if (!flat[k].batched()) {
          at[k] = flat[k];
          continue;
        }
        std::int64_t e = 0;
        for (const BatchLevel& own : flat[k].batch_levels())
          for (std::size_t l = 0; l < levels.size(); ++l)
            if (levels[l].id == own.id) e = e * own.size + index[l];
        at[k] = examples[k][static_cast<std::size_t>(e)];
      }
      Out out = (*this)(pytree::rebuild(args, std::span<const Array>(at).subspan(offsets[Is], counts[Is]))...);
      const std::vector<Array> leaves = pytree::flatten(out);
      if (outs.size() < leaves.size()) outs.resize(leaves.size());
      for (std::size_t j = 0; j < leaves.size(); ++j) outs[j].push_back(leaves[j]);
      if (!first) first = std::move(out);
    }
    std::vector<Array> stacked;
    for (const std::vector<Array>& per : outs) stacked.push_back(autodiff::detail::stack_examples(per, levels));
    return pytree::rebuild(*first, std::span<const Array>(stacked));
  }

  // `value` with every array replaced by one shared scalar: its structure without its data (a Tree
  // cannot hold undefined leaves).
  template <class T>
  static T hollow(const T& value) {
    static const Array hole = Array::zeros(Shape{});
    std::vector<Array> holes(pytree::flatten(value).size(), hole);
    return pytree::rebuild(value, std::span<const Array>(holes));
  }
  template <class... Args, class Tuple, std::size_t... Is>
  static void flatten_cotangents(const Tuple& cts, std::vector<Array>& flat, std::index_sequence<Is...>) {
    // Only pytree arguments have cotangents; other entries are ignored.
    (
        [&] {
          if constexpr (pytree::is_pytree_v<std::decay_t<Args>>) pytree::flatten_into(std::get<Is>(cts), flat);
        }(),
        ...);
  }

  const char* name_;
  Forward forward_;
  Backward backward_;
};

// custom_vjp(name, forward, backward): see above. The name is what remat policies, residual
// reports, memory timelines and error messages show.
template <class Forward, class Backward>
CustomVjp<Forward, Backward> custom_vjp(std::string name, Forward forward, Backward backward) {
  return CustomVjp<Forward, Backward>(std::move(name), std::move(forward), std::move(backward));
}

}  // namespace linum
