#include <Eigen/QR>
#include <linum/modules/initializers.hpp>

#include <linum/core/error.hpp>
#include <linum/rng/random.hpp>
#include <linum/core/ops/shape_ops.hpp>

#include <cmath>
#include <cstdint>
#include <string>

namespace linum::initializers {

namespace {

// x * s elementwise in float32 (one rounding per element, as XLA's multiply). The result is a
// fresh constant: initializers never record autodiff nodes.
Array scaled(const Array& x, float s) {
  Array out = Array::empty(x.shape());
  const float* in = x.data();
  float* o = out.mutable_data();
  const std::int64_t n = x.numel();
  for (std::int64_t i = 0; i < n; ++i) o[i] = in[i] * s;
  return out;
}

// The standard deviation of a standard normal truncated to (-2, 2), as JAX's constant.
constexpr double kTruncatedStddev = .87962566103423978;

}  // namespace

const char* fan_mode_name(FanMode mode) {
  switch (mode) {
    case FanMode::fan_in: return "fan_in";
    case FanMode::fan_out: return "fan_out";
    case FanMode::fan_avg: return "fan_avg";
  }
  return "?";
}

const char* distribution_name(Distribution distribution) {
  switch (distribution) {
    case Distribution::truncated_normal: return "truncated_normal";
    case Distribution::normal: return "normal";
    case Distribution::uniform: return "uniform";
  }
  return "?";
}

std::pair<double, double> compute_fans(const Shape& shape, int in_axis, int out_axis, const char* who) {
  if (shape.rank() < 2)
    throw ShapeError(detail::cat(who, ": cannot compute input and output sizes of a ", shape.rank(),
                                 "-dimensional weights array of shape ", shape,
                                 "; variance-scaling initializers need at least 2 dimensions (use "
                                 "normal, uniform or truncated_normal for biases and scalars)"));
  auto normalize = [&](int axis, const char* what) {
    int a = axis < 0 ? axis + shape.rank() : axis;
    if (a < 0 || a >= shape.rank())
      throw ShapeError(detail::cat(who, ": ", what, " ", axis, " is out of range for a weights array of shape ",
                                   shape, " (rank ", shape.rank(), ")"));
    return a;
  };
  const int in = normalize(in_axis, "in_axis");
  const int out = normalize(out_axis, "out_axis");
  if (in == out)
    throw ShapeError(detail::cat(who, ": in_axis ", in_axis, " and out_axis ", out_axis,
                                 " name the same axis of the weights shape ", shape,
                                 "; pass two different axes"));
  // As JAX: receptive_field = total / in_size / out_size in (Python) floating point.
  const double in_size = static_cast<double>(shape[in]);
  const double out_size = static_cast<double>(shape[out]);
  if (shape.numel() == 0)
    throw ShapeError(detail::cat(who, ": the weights shape ", shape,
                                 " has no elements, so its fans are zero and the variance scale is undefined"));
  const double receptive = static_cast<double>(shape.numel()) / in_size / out_size;
  return {in_size * receptive, out_size * receptive};
}

Initializer zeros() {
  return [](rng::Key, const Shape& shape) { return Array::zeros(shape); };
}

Initializer ones() {
  return [](rng::Key, const Shape& shape) { return Array::ones(shape); };
}

Initializer constant(float value) {
  return [value](rng::Key, const Shape& shape) { return Array::full(shape, value); };
}

Initializer uniform(float scale) {
  return [scale](rng::Key key, const Shape& shape) { return scaled(rng::uniform(key, shape), scale); };
}

Initializer normal(float stddev) {
  return [stddev](rng::Key key, const Shape& shape) { return scaled(rng::normal(key, shape), stddev); };
}

Initializer truncated_normal(float stddev, float lower, float upper) {
  if (!(lower < upper))
    throw ValueError(detail::cat("initializers::truncated_normal: lower (", lower, ") must be below upper (", upper,
                                 ")"));
  return [stddev, lower, upper](rng::Key key, const Shape& shape) {
    return scaled(rng::truncated_normal(key, lower, upper, shape), stddev);
  };
}

namespace {

// variance_scaling under a name for messages ("initializers::lecun_normal", ...).
Initializer make_variance_scaling(std::string name, double scale, FanMode mode, Distribution distribution,
                                  int in_axis, int out_axis) {
  if (!(scale >= 0) || !std::isfinite(scale))
    throw ValueError(detail::cat(name, ": scale must be a finite number >= 0, got ", scale));
  if (mode != FanMode::fan_in && mode != FanMode::fan_out && mode != FanMode::fan_avg)
    throw ValueError(detail::cat(name, ": invalid FanMode; use fan_in, fan_out or fan_avg"));
  if (distribution != Distribution::truncated_normal && distribution != Distribution::normal &&
      distribution != Distribution::uniform)
    throw ValueError(detail::cat(name, ": invalid Distribution; use truncated_normal, normal or uniform"));
  return [=](rng::Key key, const Shape& shape) {
    auto [fan_in, fan_out] = compute_fans(shape, in_axis, out_axis, name.c_str());
    double denominator = mode == FanMode::fan_in ? fan_in : mode == FanMode::fan_out ? fan_out : (fan_in + fan_out) / 2;
    // JAX: variance = jnp.array(scale / denominator, float32) -- the division in double, then one
    // rounding to float32; everything after is float32 arithmetic.
    const float variance = static_cast<float>(scale / denominator);
    switch (distribution) {
      case Distribution::truncated_normal: {
        const float stddev = std::sqrt(variance) / static_cast<float>(kTruncatedStddev);
        return scaled(rng::truncated_normal(key, -2.0f, 2.0f, shape), stddev);
      }
      case Distribution::normal:
        return scaled(rng::normal(key, shape), std::sqrt(variance));
      case Distribution::uniform:
        return scaled(rng::uniform(key, shape, -1.0f, 1.0f), std::sqrt(3.0f * variance));
    }
    throw ValueError(detail::cat(name, ": invalid Distribution"));
  };
}

}  // namespace

Initializer variance_scaling(double scale, FanMode mode, Distribution distribution, int in_axis, int out_axis) {
  return make_variance_scaling(detail::cat("initializers::variance_scaling(", scale, ", ", fan_mode_name(mode), ", ",
                                           distribution_name(distribution), ")"),
                               scale, mode, distribution, in_axis, out_axis);
}

Initializer lecun_normal(int in_axis, int out_axis) {
  return make_variance_scaling("initializers::lecun_normal", 1.0, FanMode::fan_in, Distribution::truncated_normal, in_axis, out_axis);
}
Initializer lecun_uniform(int in_axis, int out_axis) {
  return make_variance_scaling("initializers::lecun_uniform", 1.0, FanMode::fan_in, Distribution::uniform, in_axis, out_axis);
}
Initializer he_normal(int in_axis, int out_axis) {
  return make_variance_scaling("initializers::he_normal", 2.0, FanMode::fan_in, Distribution::truncated_normal, in_axis, out_axis);
}
Initializer he_uniform(int in_axis, int out_axis) {
  return make_variance_scaling("initializers::he_uniform", 2.0, FanMode::fan_in, Distribution::uniform, in_axis, out_axis);
}
Initializer glorot_normal(int in_axis, int out_axis) {
  return make_variance_scaling("initializers::glorot_normal", 1.0, FanMode::fan_avg, Distribution::truncated_normal, in_axis, out_axis);
}
Initializer glorot_uniform(int in_axis, int out_axis) {
  return make_variance_scaling("initializers::glorot_uniform", 1.0, FanMode::fan_avg, Distribution::uniform, in_axis, out_axis);
}

Initializer orthogonal(float scale, int column_axis) {
  return [scale, column_axis](rng::Key key, const Shape& shape) {
    if (shape.rank() < 2)
      throw ShapeError(detail::cat("initializers::orthogonal: needs at least 2 dimensions, got ", shape));
    const int axis = column_axis < 0 ? column_axis + shape.rank() : column_axis;
    if (axis < 0 || axis >= shape.rank())
      throw ValueError(detail::cat("initializers::orthogonal: column_axis ", column_axis, " is out of range for ", shape));
    const std::int64_t cols = shape[axis];
    const std::int64_t rows = shape.numel() / std::max<std::int64_t>(cols, 1);
    // As JAX: a normal matrix of shape (max, min), its QR, Q's columns times sign(diag(R)).
    const std::int64_t big = std::max(rows, cols), small = std::min(rows, cols);
    const Array a = rng::normal(key, Shape{big, small});
    Eigen::MatrixXd m(big, small);
    for (std::int64_t r = 0; r < big; ++r)
      for (std::int64_t c = 0; c < small; ++c) m(r, c) = a.data()[r * small + c];
    Eigen::HouseholderQR<Eigen::MatrixXd> qr(m);
    Eigen::MatrixXd q = qr.householderQ() * Eigen::MatrixXd::Identity(big, small);
    const Eigen::MatrixXd rmat = qr.matrixQR().topRows(small).triangularView<Eigen::Upper>();
    for (std::int64_t c = 0; c < small; ++c)
      if (rmat(c, c) < 0) q.col(c) = -q.col(c);
    // (rows, cols) in row-major order, then the column axis moved into place.
    std::vector<float> flat(static_cast<std::size_t>(rows * cols));
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < cols; ++c)
        flat[static_cast<std::size_t>(r * cols + c)] = scale * static_cast<float>(rows >= cols ? q(r, c) : q(c, r));
    std::vector<std::int64_t> other;
    for (int d = 0; d < shape.rank(); ++d)
      if (d != axis) other.push_back(shape[d]);
    other.push_back(cols);
    Array out = Array::from(Shape(other), flat);
    if (axis == shape.rank() - 1) return out;
    std::vector<int> perm;
    for (int d = 0; d < shape.rank(); ++d) perm.push_back(d < axis ? d : d == axis ? shape.rank() - 1 : d - 1);
    return transpose(out, perm);
  };
}

}  // namespace linum::initializers
