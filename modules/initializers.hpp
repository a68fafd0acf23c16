// Parameter initializers, as `jax.nn.initializers` (float32).
//
// An initializer maps a PRNG key and a shape to a fresh float32 array. Each one here draws its
// numbers with Linum's JAX-compatible samplers (<linum/rng/rng.hpp>) through the same calls, in the
// same order and with the same float32 scaling arithmetic as JAX's, so for the same key and shape
// it returns the values JAX returns (bit for bit where the sampler is bit-exact, see
// rng/random.hpp):
//
//   Initializer w = initializers::lecun_normal();          // Flax's Dense kernel default
//   Array kernel = w(rng::key(0), {784, 128});
//   Array conv = initializers::he_normal()(key, {3, 3, 16, 32});   // HWIO: fan_in = 3*3*16
//
// They live in `linum::initializers` (Flax: `nn.initializers`); the name `linum::init` is taken
// by the module-initialisation function.
//
// Errors: a shape the initializer cannot use (rank below 2 for the variance-scaling family, an
// axis out of range, no elements) throws linum::ShapeError naming the initializer and the shape;
// a bad hyperparameter (negative scale, lower >= upper) throws linum::ValueError.
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/shape.hpp>
#include <linum/rng/key.hpp>

#include <functional>
#include <utility>

namespace linum {

// Creates a parameter's initial value from a key and a shape (float32). Identical to the alias
// that modules/scope.hpp declares, so either header may come first.
using Initializer = std::function<Array(rng::Key key, const Shape& shape)>;

namespace initializers {

// Which fan divides the scale in variance_scaling: inputs, outputs, or their mean.
enum class FanMode { fan_in, fan_out, fan_avg };

// The distribution variance_scaling draws from. truncated_normal is cut at two standard
// deviations and rescaled so that the result still has the requested variance.
enum class Distribution { truncated_normal, normal, uniform };

// "fan_in", "fan_out" or "fan_avg".
const char* fan_mode_name(FanMode mode);
// "truncated_normal", "normal" or "uniform".
const char* distribution_name(Distribution distribution);

// JAX's `_compute_fans`: the effective (fan_in, fan_out) of a weights shape. The receptive field
// is the product of every axis other than `in_axis` and `out_axis`; fan_in = shape[in_axis] *
// receptive field and fan_out = shape[out_axis] * receptive field. For a dense kernel [in, out]
// that is (in, out); for an HWIO conv kernel [h, w, i, o] it is (h*w*i, h*w*o). Computed in double,
// as JAX does in Python. Throws ShapeError for rank < 2 (as current JAX), an axis out of range,
// in_axis and out_axis naming the same axis (JAX accepts it and divides by that axis twice), or a
// shape with no elements (JAX fails with ZeroDivisionError); `who` names the caller in messages.
std::pair<double, double> compute_fans(const Shape& shape, int in_axis = -2, int out_axis = -1,
                                       const char* who = "compute_fans");

// All zeros (the key is ignored). `jax.nn.initializers.zeros`.
Initializer zeros();

// All ones (the key is ignored). `jax.nn.initializers.ones`.
Initializer ones();

// Every element `value` (the key is ignored). `jax.nn.initializers.constant(value)`.
Initializer constant(float value);

// Uniform on [0, scale): `random.uniform(key, shape) * scale`, as JAX (note: not symmetric).
Initializer uniform(float scale = 1e-2f);

// Normal with mean 0 and standard deviation `stddev`: `random.normal(key, shape) * stddev`.
Initializer normal(float stddev = 1e-2f);

// `random.truncated_normal(key, lower, upper, shape) * stddev`: the bounds apply before scaling,
// so values lie in (lower * stddev, upper * stddev). As in JAX, `stddev` is that of the untruncated
// normal (no variance correction). Throws ValueError unless lower < upper.
Initializer truncated_normal(float stddev = 1e-2f, float lower = -2.0f, float upper = 2.0f);

// JAX's `variance_scaling(scale, mode, distribution, in_axis, out_axis)`: with n the fan chosen by
// `mode` (see compute_fans) and variance = float32(scale / n),
//   truncated_normal: truncated_normal(key, -2, 2) * (sqrt(variance) / 0.87962566103423978)
//   normal:           normal(key) * sqrt(variance)
//   uniform:          uniform(key, -1, 1) * sqrt(3 * variance)
// so the result has standard deviation sqrt(scale / n) in every case. `scale` is a double because
// JAX does the division in Python floats. Throws ValueError for a negative or non-finite scale
// (when called: ShapeError for shapes compute_fans rejects or a zero fan).
Initializer variance_scaling(double scale, FanMode mode, Distribution distribution, int in_axis = -2,
                             int out_axis = -1);

// variance_scaling(1, fan_in, truncated_normal): Flax's default Dense and Conv kernel initializer.
Initializer lecun_normal(int in_axis = -2, int out_axis = -1);
// variance_scaling(1, fan_in, uniform).
Initializer lecun_uniform(int in_axis = -2, int out_axis = -1);
// variance_scaling(2, fan_in, truncated_normal), also called Kaiming normal.
Initializer he_normal(int in_axis = -2, int out_axis = -1);
// variance_scaling(2, fan_in, uniform), also called Kaiming uniform.
Initializer he_uniform(int in_axis = -2, int out_axis = -1);
// variance_scaling(1, fan_avg, truncated_normal), also called Xavier normal.
Initializer glorot_normal(int in_axis = -2, int out_axis = -1);
// variance_scaling(1, fan_avg, uniform), also called Xavier uniform.
Initializer glorot_uniform(int in_axis = -2, int out_axis = -1);
// jax.nn.initializers.orthogonal(scale, column_axis=-1): the shape flattened to (rows = product of
// the other axes, cols = shape[column_axis]) filled with a random matrix with orthonormal rows or
// columns (whichever are fewer): the Q of a normal matrix's QR decomposition, its columns' signs
// fixed by R's diagonal, times `scale`. (Same distribution as JAX; other bits, as the QR differs.)
// Flax's recurrent cells use it for their recurrent kernels.
Initializer orthogonal(float scale = 1.0f, int column_axis = -1);

// Same as he_normal (JAX's `kaiming_normal` alias).
inline Initializer kaiming_normal(int in_axis = -2, int out_axis = -1) { return he_normal(in_axis, out_axis); }
// Same as he_uniform (JAX's `kaiming_uniform` alias).
inline Initializer kaiming_uniform(int in_axis = -2, int out_axis = -1) { return he_uniform(in_axis, out_axis); }
// Same as glorot_normal (JAX's `xavier_normal` alias).
inline Initializer xavier_normal(int in_axis = -2, int out_axis = -1) { return glorot_normal(in_axis, out_axis); }
// Same as glorot_uniform (JAX's `xavier_uniform` alias).
inline Initializer xavier_uniform(int in_axis = -2, int out_axis = -1) { return glorot_uniform(in_axis, out_axis); }

}  // namespace initializers
}  // namespace linum
