// jax.random's float32/int32 samplers on top of the threefry bits (see random.hpp).
#include <linum/rng/random.hpp>

#include <linum/core/error.hpp>
#include <linum/core/ops/elementwise.hpp>
#include <linum/core/ops/reduce.hpp>
#include <linum/core/ops/shape_ops.hpp>
#include <linum/core/autodiff/graph.hpp>
#include <linum/rng/xla_math.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

namespace linum::rng {

namespace {

// float32 sqrt(2), as `np.array(np.sqrt(2), np.float32)`.
constexpr float kSqrt2 = 1.41421354f;

// A random word turned into a float in [0, 1): 23 random mantissa bits under the exponent of 1.0.
inline float unit_float(std::uint32_t word) {
  return std::bit_cast<float>((word >> 9) | 0x3F800000u) - 1.0f;
}

// JAX's `_uniform` for float32: max(minval, u * (maxval - minval) + minval), the multiply-add fused.
inline float scale_uniform(float u, float minval, float span) {
  const float r = std::fma(u, span, minval);
  return r < minval ? minval : r;
}

// Fills `out` (n values) with uniform floats in [minval, maxval).
void uniform_into(Key key, std::int64_t n, float minval, float maxval, Mode mode, float* out) {
  const auto words = bits_u32(key, n, mode);
  const float span = maxval - minval;
  for (std::int64_t i = 0; i < n; ++i) out[i] = scale_uniform(unit_float(words[static_cast<std::size_t>(i)]), minval, span);
}

// XLA's unsigned remainder, which defines x % 0 as x.
inline std::uint32_t urem(std::uint32_t x, std::uint32_t m) { return m == 0 ? x : x % m; }

std::int64_t clip_i32(std::int64_t v) {
  return std::clamp<std::int64_t>(v, std::numeric_limits<std::int32_t>::min(), std::numeric_limits<std::int32_t>::max());
}

}  // namespace

Array draw_per_example(const Key& key, const std::function<Array(const Key&)>& draw) {
  std::vector<Array> per;
  per.reserve(key.batch->keys.size());
  for (const Key& m : key.batch->keys) per.push_back(draw(m));
  autodiff::NoGradGuard constants;
  std::vector<std::int64_t> dims;
  for (const BatchLevel& l : key.batch->levels) dims.push_back(l.size);
  for (std::int64_t d : per.front().shape()) dims.push_back(d);
  return Array::batched_view(reshape(stack(per), dims), key.batch->levels);
}

Array uniform(Key key, const Shape& shape, float minval, float maxval, Mode mode) {
  if (key.batched()) return draw_per_example(key, [&](const Key& m) { return uniform(m, shape, minval, maxval, mode); });
  Array out = Array::empty(shape);
  uniform_into(key, shape.numel(), minval, maxval, mode, out.mutable_data());
  return out;
}

Array normal(Key key, const Shape& shape, Mode mode) {
  if (key.batched()) return draw_per_example(key, [&](const Key& m) { return normal(m, shape, mode); });
  Array out = Array::empty(shape);
  float* p = out.mutable_data();
  const float lo = std::nextafter(-1.0f, 0.0f);
  uniform_into(key, shape.numel(), lo, 1.0f, mode, p);
  for (std::int64_t i = 0; i < shape.numel(); ++i) p[i] = kSqrt2 * erf_inv_f32(p[i]);
  return out;
}

Array truncated_normal(Key key, float lower, float upper, const Shape& shape, Mode mode) {
  if (key.batched()) return draw_per_example(key, [&](const Key& m) { return truncated_normal(m, lower, upper, shape, mode); });
  if (!(lower < upper))
    throw ValueError(detail::cat("rng::truncated_normal: the bounds must satisfy lower < upper, got lower=", lower,
                                 " and upper=", upper));
  const float a = erf_f32(lower / kSqrt2);
  const float b = erf_f32(upper / kSqrt2);
  const float lo = std::nextafter(lower, std::numeric_limits<float>::infinity());
  const float hi = std::nextafter(upper, -std::numeric_limits<float>::infinity());
  Array out = Array::empty(shape);
  float* p = out.mutable_data();
  uniform_into(key, shape.numel(), a, b, mode, p);
  for (std::int64_t i = 0; i < shape.numel(); ++i) p[i] = std::clamp(kSqrt2 * erf_inv_f32(p[i]), lo, hi);
  return out;
}

Array bernoulli(Key key, float p, const Shape& shape, Mode mode) {
  if (key.batched()) return draw_per_example(key, [&](const Key& m) { return bernoulli(m, p, shape, mode); });
  if (std::isnan(p)) throw ValueError("rng::bernoulli: the probability p is NaN; pass a value in [0, 1]");
  Array out = Array::empty(shape);
  float* q = out.mutable_data();
  uniform_into(key, shape.numel(), 0.0f, 1.0f, mode, q);
  for (std::int64_t i = 0; i < shape.numel(); ++i) q[i] = q[i] < p ? 1.0f : 0.0f;
  return out;
}

Array randint(Key key, const Shape& shape, std::int64_t minval, std::int64_t maxval, Mode mode) {
  if (key.batched()) return draw_per_example(key, [&](const Key& m) { return randint(m, shape, minval, maxval, mode); });
  const std::int64_t n = shape.numel();
  const bool maxval_out_of_range = maxval > std::numeric_limits<std::int32_t>::max();
  const std::int64_t lo = clip_i32(minval);
  const std::int64_t hi = clip_i32(maxval);
  auto span = static_cast<std::uint32_t>(static_cast<std::uint64_t>(hi - lo));
  if (hi <= lo) span = 1;
  if (maxval_out_of_range && hi > lo) span += 1;  // may wrap to 0: then the draw is used unreduced
  std::uint32_t multiplier = urem(1u << 16, span);
  multiplier = urem(multiplier * multiplier, span);

  const auto keys = split(key, 2, mode);
  const auto higher = bits_u32(keys[0], n, mode);
  const auto lower = bits_u32(keys[1], n, mode);
  Array out = Array::empty(shape, DType::i32);
  std::int32_t* p = out.mutable_data_i32();
  for (std::int64_t i = 0; i < n; ++i) {
    const auto k = static_cast<std::size_t>(i);
    std::uint32_t offset = urem(higher[k], span) * multiplier + urem(lower[k], span);  // uint32 wrap-around
    offset = urem(offset, span);
    p[i] = static_cast<std::int32_t>(static_cast<std::uint32_t>(lo) + offset);
  }
  return out;
}

Array permutation(Key key, std::int64_t n, Mode mode) {
  if (key.batched()) return draw_per_example(key, [&](const Key& m) { return permutation(m, n, mode); });
  if (n < 0 || n > std::numeric_limits<std::int32_t>::max())
    throw ValueError(detail::cat("rng::permutation: n must be in [0, 2^31), got ", n));
  std::vector<std::int32_t> x(static_cast<std::size_t>(n));
  std::iota(x.begin(), x.end(), 0);
  constexpr double kExponent = 3.0;
  const auto rounds = static_cast<int>(
      std::ceil(kExponent * std::log(static_cast<double>(std::max<std::int64_t>(1, n))) / std::log(4294967295.0)));
  std::vector<std::pair<std::uint32_t, std::int32_t>> keyed(static_cast<std::size_t>(n));
  for (int r = 0; r < rounds; ++r) {
    const auto keys = split(key, 2, mode);
    key = keys[0];
    const auto sort_keys = bits_u32(keys[1], n, mode);
    for (std::size_t i = 0; i < x.size(); ++i) keyed[i] = {sort_keys[i], x[i]};
    std::stable_sort(keyed.begin(), keyed.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = keyed[i].second;
  }
  return Array::from_i32(Shape{n}, x);
}

Array gumbel(Key key, const Shape& shape, Mode mode) {
  if (key.batched()) return draw_per_example(key, [&](const Key& m) { return gumbel(m, shape, mode); });
  Array out = Array::empty(shape);
  float* p = out.mutable_data();
  uniform_into(key, shape.numel(), std::numeric_limits<float>::min(), 1.0f, mode, p);
  for (std::int64_t i = 0; i < shape.numel(); ++i) p[i] = -log_f32(-log_f32(p[i]));  // XLA's log: JAX's bits
  return out;
}

Array categorical(Key key, const Array& logits, int axis, Mode mode) {
  if (key.batched() || logits.batched()) {
    // Per example (lift::vmap, vmap): the Gumbel-max trick with ops, which batch; the same adds and
    // first-maximum comparisons as below.
    if (!logits.defined() || logits.dtype() != DType::f32 || logits.rank() == 0)
      throw ShapeError("rng::categorical: logits must be a float32 array of rank >= 1");
    return argmax(add(logits, gumbel(key, logits.shape(), mode)), axis);
  }
  if (!logits.defined() || logits.dtype() != DType::f32 || logits.rank() == 0)
    throw ShapeError(detail::cat("rng::categorical: logits must be a float32 array of rank >= 1, got ",
                                 logits.defined() ? logits.str() : std::string("an undefined array")));
  const Shape& shape = logits.shape();
  const int ax = shape.normalize_axis(axis, "rng::categorical");
  std::int64_t outer = 1, inner = 1;
  for (int d = 0; d < ax; ++d) outer *= shape[d];
  for (int d = ax + 1; d < shape.rank(); ++d) inner *= shape[d];
  const std::int64_t classes = shape[ax];
  if (classes == 0) throw ShapeError(detail::cat("rng::categorical: axis ", axis, " of logits ", shape, " is empty"));
  Shape out_shape;
  for (int d = 0; d < shape.rank(); ++d)
    if (d != ax) out_shape.push_back(shape[d]);

  const Array g = gumbel(key, shape, mode);
  const float* gp = g.data();
  const float* lp = logits.data();
  Array out = Array::empty(out_shape, DType::i32);
  std::int32_t* op = out.mutable_data_i32();
  for (std::int64_t o = 0; o < outer; ++o) {
    for (std::int64_t in = 0; in < inner; ++in) {
      std::int64_t best = 0;
      float best_v = 0.0f;
      for (std::int64_t c = 0; c < classes; ++c) {
        const std::int64_t idx = (o * classes + c) * inner + in;
        const float v = gp[idx] + lp[idx];
        // jnp.argmax: the first maximum, a NaN counting as the maximum.
        if (c == 0 || (!std::isnan(best_v) && (v > best_v || std::isnan(v)))) {
          best = c;
          best_v = v;
        }
      }
      op[o * inner + in] = static_cast<std::int32_t>(best);
    }
  }
  return out;
}

}  // namespace linum::rng
