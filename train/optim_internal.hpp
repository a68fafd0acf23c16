// Internal helpers shared by the optimizer sources (core/optim*.cpp): elementwise maps over trees in
// float32, state checks, the step counter. Not part of the installed API's promises.
#pragma once

#include <linum/train/optim.hpp>
#include <linum/core/ops/kernel_util.hpp>
#include <linum/core/autodiff/graph.hpp>
#include <linum/core/ops/elementwise.hpp>
#include <linum/core/error.hpp>
#include <linum/rng/key.hpp>

#include <array>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

namespace linum::optim::internal {

// ---- tree helpers ------------------------------------------------------------------------------

// Throws unless `a` and `b` have the same keys, kinds, shapes and dtypes everywhere.
inline void check_same_structure(const std::string& who, std::string_view a_name, const Tree& a, std::string_view b_name,
                          const Tree& b) {
  if (auto d = structure_difference(a, b, /*compare_leaves=*/true))
    throw ValueError(detail::cat(who, ": ", a_name, " and ", b_name, " have different structures: ", *d,
                                 "; they must have the structure of the params the optimizer state was built "
                                 "from (call init(params) again if the model changed)"));
}

// Throws unless every leaf of `tree` is float32 or bfloat16.
inline void check_f32(const std::string& who, std::string_view what, const Tree& tree) {
  for (const auto& [path, a] : flatten(tree))
    if (!is_floating(a.dtype()))
      throw ValueError(detail::cat(who, ": ", what, " leaf '", path.empty() ? std::string("<root>") : path, "' is ",
                                   dtype_name(a.dtype()), " ", a.shape(),
                                   "; optimizers update float arrays only (keep integer values out of the "
                                   "trees you optimize)"));
}

// A leaf in float32 (bf16 widened once), and a float32 result back in `like`'s dtype: optimizers
// compute in float32 and keep states and updates in the parameters' dtype.
inline Array as_f32(const Array& a) { return a.dtype() == DType::f32 ? a : astype(a, DType::f32); }
inline Array in_dtype_of(Array a, const Array& like) { return like.dtype() == DType::f32 ? a : astype(a, like.dtype()); }

// A new tree with the structure of the first input whose leaves are f applied elementwise to
// corresponding elements of the inputs (which must already have been checked to share one
// structure and be float), computed in float32. Each result leaf has the dtype of the first
// input's leaf (optimizer states and updates follow the parameters' dtype, as optax). The results
// are fresh constants.
template <std::size_t N, class F>
inline Tree map_elementwise(const std::array<const Tree*, N>& trees, F f) {
  std::array<std::vector<Array>, N> in;
  autodiff::NoGradGuard constants;
  for (std::size_t k = 0; k < N; ++k) {
    in[k] = leaves(*trees[k]);
    for (Array& a : in[k]) a = as_f32(a);
  }
  const std::vector<Array> first_leaves = leaves(*trees[0]);
  std::vector<Array> out;
  out.reserve(in[0].size());
  for (std::size_t i = 0; i < in[0].size(); ++i) {
    const Array& first = in[0][i];
    Array r = Array::empty(first.shape());
    float* o = r.mutable_data();
    std::array<const float*, N> p;
    for (std::size_t k = 0; k < N; ++k) p[k] = in[k][i].data();
    // Captured by value (f, the pointers): stores through o cannot alias them, so the loop vectorizes.
    ops::detail::for_blocks(first.numel(), [=](std::int64_t begin, std::int64_t count) {
      for (std::int64_t j = begin; j < begin + count; ++j) {
        if constexpr (N == 1) o[j] = f(p[0][j]);
        else if constexpr (N == 2) o[j] = f(p[0][j], p[1][j]);
        else o[j] = f(p[0][j], p[1][j], p[2][j]);
      }
    });
    out.push_back(in_dtype_of(std::move(r), first_leaves[i]));
  }
  return with_leaves(*trees[0], out);
}

template <class F>
inline Tree map1(const Tree& a, F f) { return map_elementwise<1>({&a}, f); }
template <class F>
inline Tree map2(const Tree& a, const Tree& b, F f) { return map_elementwise<2>({&a, &b}, f); }
template <class F>
inline Tree map3(const Tree& a, const Tree& b, const Tree& c, F f) { return map_elementwise<3>({&a, &b, &c}, f); }

// A tree with the structure of `params` and zeros of each leaf's dtype at every leaf.
inline Tree zeros_like(const Tree& params) {
  return tree_map([](const Array& a) { return Array::zeros(a.shape(), a.dtype()); }, params);
}

// A tree with the structure of `params` and `value` (rounded to each leaf's dtype) at every element.
inline Tree full_like(const Tree& params, float value) {
  return tree_map([value](const Array& a) { return Array::full(a.shape(), value, a.dtype()); }, params);
}

// An empty dict: the state of a stateless transformation.
inline Tree empty_state() { return Tree(); }

// A transformation built on `inner` (chain, apply_if_finite, multi_steps) that reads extra
// arguments exactly when one of `inner` does, and passes them on; `update` gets ExtraArgs{} when
// none were given.
inline GradientTransformation passing_extra_args(bool inner_uses_them, std::string who, GradientTransformation::InitFn init,
                                                 GradientTransformation::UpdateWithArgsFn update) {
  if (inner_uses_them) return GradientTransformation::with_extra_args(std::move(who), std::move(init), std::move(update));
  return GradientTransformation(std::move(who), std::move(init),
                                [update](const Tree& u, const Tree& s, const Tree* p) { return update(u, s, p, ExtraArgs{}); });
}

// ---- state fields ------------------------------------------------------------------------------

inline std::string key_list(const Tree& t) {
  std::string s = "[";
  bool first = true;
  for (const auto& k : t.keys()) {
    if (!first) s += ", ";
    s += k;
    first = false;
  }
  return s + "]";
}

// Throws unless `state` is a dict with exactly the keys `expected`, in any order.
inline void check_state_keys(const std::string& who, const Tree& state, std::initializer_list<std::string_view> expected) {
  bool ok = state.is_dict() && state.size() == expected.size();
  if (ok)
    for (std::string_view k : expected) ok = ok && state.contains(k);
  if (!ok) {
    std::string want = "[";
    bool first = true;
    for (std::string_view k : expected) {
      if (!first) want += ", ";
      want += k;
      first = false;
    }
    want += "]";
    throw ValueError(detail::cat(who, ": the optimizer state has ",
                                 state.is_leaf() ? std::string("a single array") : "keys " + key_list(state),
                                 " but this transformation's state has keys ", want,
                                 "; pass the state that init() (or the previous update()) returned"));
  }
}

inline constexpr std::int32_t kCountMax = std::numeric_limits<std::int32_t>::max();

// The step counter stored under "count": an int32 scalar (a float32 scalar is accepted too, for
// states that went through a format that does not keep dtypes).
inline std::int64_t read_count(const std::string& who, const Tree& state) {
  const Tree& c = state.at("count");
  if (!c.is_leaf() || c.array().rank() != 0)
    throw ValueError(detail::cat(who, ": the state's 'count' must be a scalar array, got ",
                                 c.is_leaf() ? c.array().shape().str() : std::string("a dict"),
                                 "; pass the state that init() returned"));
  const Array& a = c.array();
  std::int64_t n = a.dtype() == DType::i32 ? a.data_i32()[0] : static_cast<std::int64_t>(a.data()[0]);
  if (n < 0)
    throw ValueError(detail::cat(who, ": the state's 'count' is negative (", n, "); pass the state that init() returned"));
  return n;
}

// optax.safe_increment: count + 1, saturating at the int32 maximum.
inline Array count_array(std::int64_t n) { return Array::full_i32(Shape{}, static_cast<std::int32_t>(n)); }
inline std::int64_t safe_increment(std::int64_t n) { return n < kCountMax ? n + 1 : kCountMax; }

// The float32 rounding of a (double) hyperparameter, as JAX converts a weakly typed Python float.
inline float f32(double x) { return static_cast<float>(x); }

// ---- keys in optimizer states ----------------------------------------------------------------------

// A PRNG key as optax keeps it in a state: its two 32-bit words, as int32[2] (the bits unchanged).
inline Array key_array(rng::Key k) {
  return Array::from_i32(Shape{2}, {static_cast<std::int32_t>(k.hi), static_cast<std::int32_t>(k.lo)});
}

inline rng::Key key_of(const std::string& who, const Tree& state) {
  const Array& a = state.at("rng_key").array();
  if (a.dtype() != DType::i32 || a.numel() != 2)
    throw ValueError(detail::cat(who, ": state['rng_key'] must be int32[2] (the key's two words), got ", a.type_str()));
  return rng::Key{static_cast<std::uint32_t>(a.data_i32()[0]), static_cast<std::uint32_t>(a.data_i32()[1])};
}

// ---- Adam's moments (optax's update_moment, bias_correction) ---------------------------------------

// 1 - decay^count with the float32 decay, as optax's bias_correction.
inline float bias_correction(float decay, std::int64_t count) {
  return 1.0f - static_cast<float>(std::pow(static_cast<double>(decay), static_cast<double>(count)));
}

// optax's update_moment: (1 - b) g + b m, and of the squares: (1 - b) g^2 + b v.
inline Tree first_moment(const Tree& updates, const Tree& mu, double b) {
  const float c = f32(1.0 - b), d = f32(b);
  return map2(updates, mu, [=](float g, float m) { return c * g + d * m; });
}
inline Tree second_moment(const Tree& updates, const Tree& nu, double b) {
  const float c = f32(1.0 - b), d = f32(b);
  return map2(updates, nu, [=](float g, float v) { return c * (g * g) + d * v; });
}

// NAdam's look-ahead first moment of one element, as optax's scale_by_adam(nesterov=True):
// b1 * mu / (1 - b1^(t+1)) + (1 - b1) * g / (1 - b1^t); `bc` and `bc_next` are the bias
// corrections at t and t + 1.
inline float nesterov_moment(float m, float g, float d1, float c1, float bc, float bc_next) {
  return d1 * (m / bc_next) + c1 * (g / bc);
}



}  // namespace linum::optim::internal
