// Clipping and constraints on updates, as optax's: clip, adaptive_grad_clip, centralize,
// keep_params_nonnegative, zero_nans, set_to_zero. Each leaf is computed in float32 and returned in
// its own dtype, as the other transformations (optim_internal.hpp).
#include <linum/train/optim.hpp>
#include <linum/train/optim_internal.hpp>

#include <algorithm>
#include <cmath>
#include <limits>

namespace linum::optim {

using namespace internal;

namespace {

// How many leading axes optax's unitwise_norm reduces over (its default axes), for a leaf of this
// shape; -1 for a rank it rejects.
int unit_axes(const Shape& shape) {
  int longer_than_one = 0;
  for (int a = 0; a < shape.rank(); ++a) longer_than_one += shape[a] != 1 ? 1 : 0;
  if (longer_than_one <= 1) return shape.rank();  // jnp.squeeze(x).ndim <= 1: the whole leaf
  switch (shape.rank()) {
    case 2:
    case 3: return 1;
    case 4: return 3;
    case 5: return 4;
    default: return -1;
  }
}

// The L2 norm of each unit of x ([outer, inner] with the reduced axes in outer): inner values,
// squares summed in double.
std::vector<float> unit_norms(const float* x, std::int64_t outer, std::int64_t inner) {
  std::vector<double> squares(static_cast<std::size_t>(inner), 0.0);
  for (std::int64_t o = 0; o < outer; ++o)
    for (std::int64_t j = 0; j < inner; ++j) squares[static_cast<std::size_t>(j)] += static_cast<double>(x[o * inner + j]) * x[o * inner + j];
  std::vector<float> norms(static_cast<std::size_t>(inner));
  for (std::int64_t j = 0; j < inner; ++j) norms[static_cast<std::size_t>(j)] = static_cast<float>(std::sqrt(squares[static_cast<std::size_t>(j)]));
  return norms;
}

GradientTransformation stateless(const char* name, std::function<Tree(const std::string& who, const Tree& updates, const Tree* params)> f) {
  const std::string who = std::string(name) + ".update";
  return GradientTransformation(name, [](const Tree&) { return empty_state(); },
                                [who, f = std::move(f)](const Tree& updates, const Tree& state, const Tree* params) {
                                  check_state_keys(who, state, {});
                                  check_f32(who, "update", updates);
                                  return UpdateResult{f(who, updates, params), empty_state()};
                                });
}

const Tree& needs_params(const std::string& who, const Tree& updates, const Tree* params) {
  if (!params) throw ValueError(detail::cat(who, ": this transformation needs the parameters; call update(grads, state, params)"));
  check_same_structure(who, "grads", updates, "params", *params);
  return *params;
}

}  // namespace

GradientTransformation clip(double max_delta) {
  if (!(max_delta >= 0) || !std::isfinite(max_delta))
    throw ValueError(detail::cat("optim::clip: max_delta must be a finite number >= 0, got ", max_delta));
  const float hi = f32(max_delta), lo = -hi;
  return stateless("optim::clip", [lo, hi](const std::string&, const Tree& updates, const Tree*) {
    return map1(updates, [lo, hi](float g) { return std::isnan(g) ? g : std::min(std::max(g, lo), hi); });
  });
}

GradientTransformation adaptive_grad_clip(double clipping, double eps) {
  if (!(clipping >= 0) || !std::isfinite(clipping))
    throw ValueError(detail::cat("optim::adaptive_grad_clip: clipping must be a finite number >= 0, got ", clipping));
  if (!(eps >= 0) || !std::isfinite(eps))
    throw ValueError(detail::cat("optim::adaptive_grad_clip: eps must be a finite number >= 0, got ", eps));
  const float c = f32(clipping), e = f32(eps);
  return stateless("optim::adaptive_grad_clip", [c, e](const std::string& who, const Tree& updates, const Tree* params) {
    const Tree& p = needs_params(who, updates, params);
    autodiff::NoGradGuard constants;
    std::vector<std::pair<std::string, Array>> out = flatten(updates);
    const std::vector<Array> ps = leaves(p);
    for (std::size_t k = 0; k < out.size(); ++k) {
      const Array& leaf = out[k].second;
      const int axes = unit_axes(leaf.shape());
      if (axes < 0)
        throw ShapeError(detail::cat(who, ": leaf '", out[k].first, "' is ", leaf.type_str(),
                                     "; optax's unit-wise norm covers ranks 1 to 5 (and any shape with at most one axis "
                                     "longer than 1); mask such leaves out with optim::masked"));
      std::int64_t outer = 1;
      for (int a = 0; a < axes; ++a) outer *= leaf.dim(a);
      const std::int64_t inner = outer == 0 ? 0 : leaf.numel() / outer;
      const Array g = as_f32(leaf), w = as_f32(ps[k]);
      const std::vector<float> g_norm = unit_norms(g.data(), outer, inner), p_norm = unit_norms(w.data(), outer, inner);
      Array r = Array::empty(leaf.shape());
      float* o = r.mutable_data();
      const float* pg = g.data();
      for (std::int64_t j = 0; j < inner; ++j) {
        const float max_norm = c * std::max(p_norm[static_cast<std::size_t>(j)], e);
        const float gn = g_norm[static_cast<std::size_t>(j)];
        const float factor = max_norm / std::max(gn, 1e-6f);
        for (std::int64_t i = 0; i < outer; ++i) {
          const float x = pg[i * inner + j];
          o[i * inner + j] = gn < max_norm ? x : x * factor;  // where(g_norm < max_norm, g, g * factor), as optax
        }
      }
      out[k].second = in_dtype_of(std::move(r), leaf);
    }
    return unflatten(out);
  });
}

GradientTransformation centralize() {
  return stateless("optim::centralize", [](const std::string&, const Tree& updates, const Tree*) {
    autodiff::NoGradGuard constants;
    std::vector<std::pair<std::string, Array>> out = flatten(updates);
    for (auto& [path, leaf] : out) {
      if (leaf.rank() < 2) continue;
      const std::int64_t rows = leaf.dim(0), per = rows == 0 ? 0 : leaf.numel() / rows;
      const Array g = as_f32(leaf);
      Array r = Array::empty(leaf.shape());
      float* o = r.mutable_data();
      const float* pg = g.data();
      for (std::int64_t i = 0; i < rows; ++i) {
        double sum = 0.0;
        for (std::int64_t j = 0; j < per; ++j) sum += pg[i * per + j];
        const float mean = static_cast<float>(sum / static_cast<double>(per));
        for (std::int64_t j = 0; j < per; ++j) o[i * per + j] = pg[i * per + j] - mean;
      }
      leaf = in_dtype_of(std::move(r), leaf);
    }
    return unflatten(out);
  });
}

GradientTransformation keep_params_nonnegative() {
  return stateless("optim::keep_params_nonnegative", [](const std::string& who, const Tree& updates, const Tree* params) {
    const Tree& p = needs_params(who, updates, params);
    return map2(updates, p, [](float u, float w) { return (w + u) < 0.0f ? -w : u; });
  });
}

GradientTransformation set_to_zero() {
  return stateless("optim::set_to_zero", [](const std::string&, const Tree& updates, const Tree*) { return zeros_like(updates); });
}

GradientTransformation zero_nans() {
  const std::string who = "optim::zero_nans.update";
  auto flags = [](const Tree& like, auto found) {
    return tree_map([&](const Array& a) { return Array::full_i32(Shape{}, found(a) ? 1 : 0); }, like);
  };
  return GradientTransformation(
      "optim::zero_nans", [flags](const Tree& params) { return Tree{{"found_nan", flags(params, [](const Array&) { return false; })}}; },
      [who, flags](const Tree& updates, const Tree& state, const Tree*) {
        check_state_keys(who, state, {"found_nan"});
        check_f32(who, "update", updates);
        autodiff::NoGradGuard constants;
        const Tree found = flags(updates, [](const Array& a) {
          const Array x = as_f32(a);
          return std::any_of(x.data(), x.data() + x.numel(), [](float v) { return std::isnan(v); });
        });
        return UpdateResult{map1(updates, [](float g) { return std::isnan(g) ? 0.0f : g; }), Tree{{"found_nan", found}}};
      });
}

}  // namespace linum::optim
