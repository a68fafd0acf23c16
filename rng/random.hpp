// Sampling functions on JAX-compatible keys, each reproducing the `jax.random` function of the
// same name for float32/int32 outputs (default x32 mode):
//   uniform, normal, truncated_normal, bernoulli, randint, permutation, gumbel, categorical.
//
// Exactness against JAX: bits are bit-identical in both threefry modes; so are uniform on the
// default [0, 1) range, bernoulli, randint and permutation. normal and truncated_normal go
// through XLA's float32 erf_inv/erf polynomials (rng/xla_math.hpp) and match to float32
// rounding. Scaling a uniform to [minval, maxval) is done as fma(u, maxval - minval, minval), as
// XLA does on hardware with FMA. gumbel and categorical use std::log, which may differ from
// XLA's log in the last bit.
//
// Every function takes the threefry Mode last, defaulting to default_mode().
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/shape.hpp>
#include <linum/rng/key.hpp>

#include <cstdint>

namespace linum::rng {

// `jax.random.uniform(key, shape, float32, minval, maxval)`: float32 values in [minval, maxval).
// The 23 high bits of each random word become the mantissa of a float in [1, 2), minus 1, scaled
// and shifted, then raised to at least minval.
Array uniform(Key key, const Shape& shape, float minval = 0.0f, float maxval = 1.0f, Mode mode = default_mode());

// `jax.random.normal(key, shape)`: standard normal float32 values, sqrt(2) * erf_inv(u) with u
// uniform in [nextafter(-1, 0), 1).
Array normal(Key key, const Shape& shape, Mode mode = default_mode());

// `jax.random.truncated_normal(key, lower, upper, shape)`: standard normal values restricted to
// the open interval (lower, upper), by inverting the CDF. Throws ValueError unless lower < upper.
Array truncated_normal(Key key, float lower, float upper, const Shape& shape, Mode mode = default_mode());

// `jax.random.bernoulli(key, p, shape)` (mode "low": uniform < p). JAX returns booleans; this
// returns a float32 array of 0.0 and 1.0 (ready to multiply, e.g. as a dropout mask).
// Throws ValueError if p is NaN.
Array bernoulli(Key key, float p, const Shape& shape, Mode mode = default_mode());

// `jax.random.randint(key, shape, minval, maxval, int32)`: int32 values in [minval, maxval).
// Bounds are clipped to the int32 range (maxval may be 2^31 to include INT32_MAX); when
// maxval <= minval every value is minval, as in JAX. Uses JAX's algorithm: the key is split in
// two, two 32-bit draws form a 64-bit number that is reduced modulo the span (slightly biased
// when the span is not a power of two, exactly as JAX is).
Array randint(Key key, const Shape& shape, std::int64_t minval, std::int64_t maxval, Mode mode = default_mode());

// `jax.random.permutation(key, n)`: a random permutation of 0..n-1 as int32, using JAX's
// algorithm (ceil(3 ln n / ln(2^32 - 1)) rounds of a stable sort by fresh random 32-bit keys).
// Throws ValueError if n < 0 or n >= 2^31.
Array permutation(Key key, std::int64_t n, Mode mode = default_mode());

// `jax.random.gumbel(key, shape)` (mode "low"): -log(-log(u)) with u uniform in [tiny, 1).
Array gumbel(Key key, const Shape& shape, Mode mode = default_mode());

// `jax.random.categorical(key, logits, axis)`: one sample per distribution along `axis` of the
// float32 `logits` (unnormalized log-probabilities), by the Gumbel-max trick: the int32 index of
// the largest logits + gumbel(key, logits.shape()) (first one on ties). The result has the shape
// of logits without `axis`. Throws ShapeError for a rank-0 or non-float32 logits or a bad axis.
Array categorical(Key key, const Array& logits, int axis = -1, Mode mode = default_mode());

}  // namespace linum::rng
