// Mixed precision: bfloat16 storage and conversion, JAX's promotion rules, every op in bf16 against
// float32 within bf16 tolerance, gradients in their value's dtype, remat vs plain bitwise in bf16,
// the two engines agreeing, serialization round trips, layers' dtype and param_dtype.
#include <doctest/doctest.h>
#include <linum/linum.hpp>

#include "testing/gradcheck.hpp"
#include "testing/fp_modes.hpp"
#include "testing/threads.hpp"

#include <linum/core/ops/bf16_table_internal.hpp>
#include <linum/core/kernels/channel_rows_internal.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

using namespace linum;
using linum::testing::random_array;

namespace {

std::uint16_t bits_of(float v) { return bfloat16(v).bits; }
float from_bits(std::uint32_t u) { return std::bit_cast<float>(u); }

// max |a - b| / (1 + |b|) over the elements, computing on float copies.
double max_rel_diff(const Array& a, const Array& b) {
  const auto va = a.to_vector(), vb = b.to_vector();
  REQUIRE(va.size() == vb.size());
  double worst = 0;
  for (std::size_t i = 0; i < va.size(); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(va[i]) - vb[i]) / (1.0 + std::abs(static_cast<double>(vb[i]))));
  return worst;
}

// max |a - b| / max |b| over the elements.
double diff_of_largest(const Array& a, const Array& b) {
  const auto va = a.to_vector(), vb = b.to_vector();
  REQUIRE(va.size() == vb.size());
  double diff = 0, largest = 0;
  for (std::size_t i = 0; i < va.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(va[i]) - vb[i]));
    largest = std::max(largest, std::abs(static_cast<double>(vb[i])));
  }
  return diff / std::max(largest, 1e-30);
}

Array bf(const Array& x) { return astype(x, DType::bf16); }

}  // namespace

TEST_CASE("bfloat16 conversion rounds to nearest even, as JAX/XLA") {
  CHECK(bits_of(1.0f) == 0x3f80);
  CHECK(bits_of(-2.0f) == 0xc000);
  CHECK(bits_of(from_bits(0x3f808000u)) == 0x3f80);  // exactly halfway, even below: round down
  CHECK(bits_of(from_bits(0x3f818000u)) == 0x3f82);  // exactly halfway, odd below: round up
  CHECK(bits_of(from_bits(0x3f808001u)) == 0x3f81);  // above halfway
  CHECK(bits_of(from_bits(0x3f807fffu)) == 0x3f80);  // below halfway
  CHECK(bits_of(std::numeric_limits<float>::infinity()) == 0x7f80);
  CHECK(bits_of(std::numeric_limits<float>::max()) == 0x7f80);  // rounds up to inf, as XLA
  const float nan = std::numeric_limits<float>::quiet_NaN();
  CHECK(std::isnan(static_cast<float>(bfloat16(nan))));
  CHECK(std::isnan(static_cast<float>(bfloat16(from_bits(0x7f800001u)))));  // a NaN whose payload is in the low bits
  // The bulk converter agrees with the scalar one on every kind of value.
  std::vector<float> v = {0.0f, -0.0f, 1.0f, 0.1f, 1e-40f, 3.4e38f, from_bits(0x3f808000u), from_bits(0x3f818000u),
                          nan, -std::numeric_limits<float>::infinity(), from_bits(0x7f800001u)};
  std::vector<bfloat16> out(v.size());
  f32_to_bf16(v.data(), out.data(), static_cast<std::int64_t>(v.size()));
  for (std::size_t i = 0; i < v.size(); ++i) CHECK(out[i].bits == bfloat16(v[i]).bits);
  // Widening is exact and round-trips.
  std::vector<float> back(v.size());
  bf16_to_f32(out.data(), back.data(), static_cast<std::int64_t>(v.size()));
  for (std::size_t i = 0; i < v.size(); ++i) CHECK(bfloat16(back[i]).bits == out[i].bits);
}

TEST_CASE("the bulk bf16 rounding agrees with the scalar one in whole blocks of 16, subnormals included") {
  // Blocks of 16 take the vector path (AVX512-BF16's instruction where the CPU has it, which
  // flushes subnormals: a block with one must fall back). Ties, NaN payloads, infinities, the
  // largest finite value, signed zeros and subnormals in some blocks but not others.
  const std::uint32_t kinds[] = {0x3f808000u, 0x3f818000u, 0x3f808001u, 0x3f807fffu, 0x7f800001u, 0xffc12345u,
                                 0x7f800000u, 0xff800000u, 0x7f7fffffu, 0x80000000u, 0x00000000u, 0x00800000u,
                                 0x3dcccccdu, 0xc2c80000u, 0x477fe000u, 0x33800000u};
  // Blocks 0, 2, 3, 5, 6 hold no subnormal (the vector path); 1, 4 and 7 hold one each (the fallback):
  // one rounding up to the smallest normal, a negative one doing the same, one staying subnormal.
  const std::uint32_t subnormals[] = {0x007ffffeu, 0x807fffffu, 0x00400000u};
  std::vector<float> v;
  for (int block = 0; block < 8; ++block)
    for (int i = 0; i < 16; ++i) {
      std::uint32_t u = kinds[(i + block) % 16];
      if ((u & 0x7f800000u) != 0) u ^= static_cast<std::uint32_t>(block) << 1;  // vary the low bits of normal values
      if (block % 3 == 1 && i == block) u = subnormals[block / 3];
      v.push_back(from_bits(u));
    }
  std::vector<bfloat16> out(v.size());
  f32_to_bf16(v.data(), out.data(), static_cast<std::int64_t>(v.size()));
  int differ = 0;
  for (std::size_t i = 0; i < v.size(); ++i) differ += out[i].bits != bfloat16::round_bits(v[i]);
  CHECK(differ == 0);
  CHECK(out[16 + 1].bits == 0x0080);       // a subnormal rounds up to 2^-126 (a flushing conversion gives 0)
  CHECK(out[4 * 16 + 4].bits == 0x8080);   // and a negative one to -2^-126
  CHECK(out[7 * 16 + 7].bits == 0x0040);   // one that stays subnormal in bf16
}

TEST_CASE("batch_norm's register loops round to bf16 as the scalar conversion does (AVX-512 and AVX2)") {
#if defined(LINUM_CHANNEL_ROWS_IN_REGISTERS)
  // kernels::detail::ChannelVectors::stored_as_bf16 is the rounding of batch_norm's bf16 outputs on
  // this build's instruction set: every pattern class of the test above, and a sweep of the upper
  // halves with low bits at, below and above the tie.
  using Simd = kernels::detail::ChannelVectors;
  std::vector<std::uint32_t> bits = {0x3f808000u, 0x3f818000u, 0x3f808001u, 0x3f807fffu, 0x7f800001u, 0xffc12345u,
                                     0x7f800000u, 0xff800000u, 0x7f7fffffu, 0x80000000u, 0x00000000u, 0x00800000u,
                                     0x3dcccccdu, 0xc2c80000u, 0x477fe000u, 0x33800000u, 0x007ffffeu, 0x807fffffu,
                                     0x00400000u, 0x7fffffffu, 0xff800001u, 0x7f7f8000u, 0xff7fffffu, 0x7fc00000u};
  for (std::uint32_t high = 0; high < 0x10000u; high += 7)
    for (std::uint32_t low : {0x0000u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) bits.push_back(high << 16 | low);
  while (bits.size() % Simd::kLanes != 0) bits.push_back(0x3f800000u);
  int differ = 0;
  for (std::size_t i = 0; i < bits.size(); i += Simd::kLanes) {
    float in[Simd::kLanes], out[Simd::kLanes];
    for (int l = 0; l < Simd::kLanes; ++l) in[l] = from_bits(bits[i + l]);
    Simd::store(out, Simd::stored_as_bf16(Simd::load(in)));
    for (int l = 0; l < Simd::kLanes; ++l)
      differ += std::bit_cast<std::uint32_t>(out[l]) != static_cast<std::uint32_t>(bfloat16::round_bits(in[l])) << 16;
  }
  CHECK(differ == 0);
#else
  MESSAGE("this build has neither AVX-512 nor AVX2 with FMA: batch_norm runs its portable loops");
#endif
}

TEST_CASE("astype of large arrays (converted in pieces across the team) gives every element's own rounding and widening") {
  // 300,007 values (more than the 2^18 where conversions split across the team, pieces of 2^15 and
  // an odd tail), the special values of the test above spread over every piece, on one thread and on
  // two: each element's bits must be the scalar rounding's, and widening back exact.
  const std::uint32_t kinds[] = {0x3f808000u, 0x3f818000u, 0x007ffffeu, 0x807fffffu, 0x7f800001u, 0xffc12345u,
                                 0x7f800000u, 0xff800000u, 0x7f7fffffu, 0x80000000u, 0x00400000u};
  Array x = random_array(Shape{300007}, 91);
  std::vector<float> v = x.to_vector();
  for (std::size_t i = 0; i < v.size(); i += 997) v[i] = from_bits(kinds[(i / 997) % 11]);
  const Array big = Array::from(Shape{300007}, v);
  for (int threads : {1, 2}) {
    CAPTURE(threads);
    Array r, back;
    if (!linum::testing::on_threads(threads, [&] {
          r = astype(big, DType::bf16);
          back = astype(r, DType::f32);
        }))
      continue;
    const bfloat16* bits = r.data_bf16();
    const float* wide = back.data();
    int differ = 0, widened_wrong = 0;
    for (std::size_t i = 0; i < v.size(); ++i) {
      differ += bits[i].bits != bfloat16::round_bits(v[i]);
      widened_wrong += std::bit_cast<std::uint32_t>(wide[i]) != static_cast<std::uint32_t>(bits[i].bits) << 16;
    }
    CHECK(differ == 0);
    CHECK(widened_wrong == 0);
  }
}

TEST_CASE("costly bf16 ops read a table of all 65536 inputs: the bits their float32 kernel computes, flushing or not") {
  // An array of every bf16 bit pattern (NaNs, infinities, signed zeros, subnormals) is large enough
  // for the table; slices of it are small enough to compute. Both must give the float32 kernel's
  // result on the widened input, rounded once, bit for bit, in both floating-point modes (each mode
  // has its own table).
  static_assert(65536 >= ops::detail::kBf16TableMinElements && 8192 < ops::detail::kBf16TableMinElements);
  Array all = Array::empty(Shape{65536}, DType::bf16);
  auto* bits = static_cast<bfloat16*>(all.mutable_raw());
  for (std::uint32_t i = 0; i < 65536; ++i) bits[i].bits = static_cast<std::uint16_t>(i);
  const std::vector<std::pair<const char*, std::function<Array(const Array&)>>> ops = {
      {"log", [](const Array& a) { return log(a); }},          {"log1p", [](const Array& a) { return log1p(a); }},
      {"log2", [](const Array& a) { return log2(a); }},        {"tanh", [](const Array& a) { return tanh(a); }},
      {"sigmoid", [](const Array& a) { return sigmoid(a); }},  {"sin", [](const Array& a) { return sin(a); }},
      {"cos", [](const Array& a) { return cos(a); }},          {"erf", [](const Array& a) { return erf(a); }},
      {"expm1", [](const Array& a) { return expm1(a); }},      {"softplus", [](const Array& a) { return softplus(a); }},
      {"gelu", [](const Array& a) { return gelu(a); }},        {"gelu_erf", [](const Array& a) { return gelu(a, false); }},
      {"silu", [](const Array& a) { return silu(a); }},
  };
  // Four copies of every pattern: large enough for two threads to read (and fill) tables at once.
  const Array four = concatenate({all, all, all, all}, 0);
  static_assert(4 * 65536 >= ops::detail::kParallelMin);
  auto check_all = [&] {
    for (const auto& entry : ops) {  // (not a structured binding: clang 14 cannot capture one)
      const std::string name = entry.first;
      const auto& f = entry.second;
      CAPTURE(name);
      const std::int64_t reads = ops::detail::g_bf16_table_reads.load();
      const Array tabulated = f(all);
      CHECK(ops::detail::g_bf16_table_reads.load() == reads + 1);  // the op read its table
      const Array rounded = astype(f(astype(all, DType::f32)), DType::bf16);
      std::vector<Array> pieces;
      for (std::int64_t s = 0; s < 65536; s += 8192) pieces.push_back(f(slice_axis(all, 0, s, s + 8192)));
      const Array computed = concatenate(pieces, 0);
      CHECK(ops::detail::g_bf16_table_reads.load() == reads + 1);  // and the slices computed
      CHECK(tabulated.dtype() == DType::bf16);
      CHECK(tabulated.bitwise_equal(rounded));
      CHECK(tabulated.bitwise_equal(computed));
      Array on_two;
      if (linum::testing::on_threads(2, [&] { on_two = f(four); }))
        CHECK(on_two.bitwise_equal(concatenate({computed, computed, computed, computed}, 0)));
    }
  };
  linum::testing::in_both_fp_modes(check_all);
}

TEST_CASE("arrays: bf16 storage is 2 bytes per element, printed as JAX prints types") {
  const Array x = astype(Array::from(Shape{2, 3}, {1, 2, 3, 4, 5, 6}), DType::bf16);
  CHECK(x.dtype() == DType::bf16);
  CHECK(x.nbytes() == 12);
  CHECK(x.type_str() == "bf16[2,3]");
  CHECK(x.to_vector() == std::vector<float>{1, 2, 3, 4, 5, 6});
  CHECK(Array::full(Shape{2}, 0.1f, DType::bf16).to_vector()[0] == static_cast<float>(bfloat16(0.1f)));
  CHECK(astype(x, DType::f32).to_vector() == std::vector<float>{1, 2, 3, 4, 5, 6});
  CHECK(astype(astype(x, DType::i32), DType::bf16).bitwise_equal(x));
}

TEST_CASE("promotion follows JAX: bf16 with f32 gives f32, a C++ scalar does not widen bf16") {
  const Array b = bf(random_array(Shape{3}, 1));
  const Array f = random_array(Shape{3}, 2);
  CHECK((b + f).dtype() == DType::f32);
  CHECK((f * b).dtype() == DType::f32);
  CHECK((b + b).dtype() == DType::bf16);
  CHECK((b * 0.5f).dtype() == DType::bf16);
  CHECK((2.0f - b).dtype() == DType::bf16);
  CHECK((b / Array::scalar(3.0f)).dtype() == DType::bf16);
  CHECK((f * 0.5f).dtype() == DType::f32);
  // A strongly typed f32 scalar array does widen, as a jnp.float32 value does.
  CHECK((b * Array::full(Shape{}, 2.0f)).dtype() == DType::f32);
  CHECK(matmul(bf(random_array(Shape{2, 3}, 3)), random_array(Shape{3, 2}, 4)).dtype() == DType::f32);
  CHECK(promote_types(DType::bf16, DType::i32) == DType::bf16);
  CHECK(maximum(b, f).dtype() == DType::f32);
  CHECK(where(greater(f, Array::scalar(0.0f)), b, b).dtype() == DType::bf16);
  // Comparisons give float32 masks.
  CHECK(greater(b, b).dtype() == DType::f32);
}

TEST_CASE("every op in bf16 matches float32 within bf16 tolerance") {
  const Array x = random_array(Shape{4, 6}, 10, -2.0f, 2.0f);
  const Array y = random_array(Shape{4, 6}, 11, 0.5f, 2.0f);
  const Array row = random_array(Shape{6}, 12);
  const Array w = random_array(Shape{6, 5}, 13);
  struct Case {
    const char* name;
    std::function<Array(const Array&, const Array&)> f;
  };
  const std::vector<Case> cases = {
      {"add", [&](const Array& a, const Array&) { return a + astype(row, a.dtype()); }},
      {"sub", [](const Array& a, const Array& b) { return a - b; }},
      {"mul", [](const Array& a, const Array& b) { return a * b; }},
      {"div", [](const Array& a, const Array& b) { return a / b; }},
      {"pow", [](const Array& a, const Array& b) { return pow(b, a); }},
      {"maximum", [](const Array& a, const Array& b) { return maximum(a, b); }},
      {"neg", [](const Array& a, const Array&) { return -a; }},
      {"exp", [](const Array& a, const Array&) { return exp(a); }},
      {"log", [](const Array&, const Array& b) { return log(b); }},
      {"sqrt", [](const Array&, const Array& b) { return sqrt(b); }},
      {"rsqrt", [](const Array&, const Array& b) { return rsqrt(b); }},
      {"tanh", [](const Array& a, const Array&) { return tanh(a); }},
      {"sigmoid", [](const Array& a, const Array&) { return sigmoid(a); }},
      {"relu", [](const Array& a, const Array&) { return relu(a); }},
      {"gelu", [](const Array& a, const Array&) { return gelu(a); }},
      {"gelu_erf", [](const Array& a, const Array&) { return gelu(a, false); }},
      {"silu", [](const Array& a, const Array&) { return silu(a); }},
      {"softplus", [](const Array& a, const Array&) { return softplus(a); }},
      {"where", [](const Array& a, const Array& b) { return where(greater(a, b), a, b); }},
      {"sum", [](const Array& a, const Array&) { return sum(a, {1}); }},
      {"mean", [](const Array& a, const Array&) { return mean(a); }},
      {"max", [](const Array& a, const Array&) { return max(a, {0}); }},
      {"var", [](const Array& a, const Array&) { return var(a, {1}); }},
      {"logsumexp", [](const Array& a, const Array&) { return logsumexp(a, {1}); }},
      {"softmax", [](const Array& a, const Array&) { return softmax(a); }},
      {"log_softmax", [](const Array& a, const Array&) { return log_softmax(a); }},
      {"matmul", [&](const Array& a, const Array&) { return matmul(a, astype(w, a.dtype())); }},
      {"dot_general", [](const Array& a, const Array& b) { return dot_general(a, b, DotDims{{1}, {1}, {}, {}}); }},
      {"transpose", [](const Array& a, const Array&) { return transpose(a); }},
      {"reshape", [](const Array& a, const Array&) { return reshape(a, {6, 4}); }},
      {"slice", [](const Array& a, const Array&) { return slice_axis(a, 1, 1, 4); }},
      {"concatenate", [](const Array& a, const Array& b) { return concatenate({a, b}, 1); }},
      {"broadcast_to", [](const Array& a, const Array&) { return broadcast_to(a, Shape{2, 4, 6}); }},
      {"take", [](const Array& a, const Array&) { return take(a, Array::from_i32(Shape{3}, {2, 0, 2}), 0); }},
      {"conv2d", [](const Array& a, const Array&) {
         return conv2d(reshape(a, {1, 4, 6, 1}), astype(Array::full(Shape{2, 2, 1, 3}, 0.25f), a.dtype()));
       }},
      {"avg_pool", [](const Array& a, const Array&) { return avg_pool(reshape(a, {1, 4, 6, 1}), {.window = {2, 2}, .strides = {2, 2}}); }},
      {"max_pool", [](const Array& a, const Array&) { return max_pool(reshape(a, {1, 4, 6, 1}), {.window = {2, 2}, .strides = {2, 2}}); }},
  };
  for (const Case& c : cases) {
    CAPTURE(c.name);
    const Array ref = c.f(astype(bf(x), DType::f32), astype(bf(y), DType::f32));  // same inputs, float32 math
    const Array got = c.f(bf(x), bf(y));
    CHECK(got.dtype() == DType::bf16);
    CHECK(got.shape() == ref.shape());
    CHECK(max_rel_diff(got, ref) <= 1.0 / 128);  // one bf16 rounding of the float32 result (2^-8 relative) and change
  }
}

TEST_CASE("gradients come back in the dtype of the value they belong to") {
  const Array w = random_array(Shape{6, 5}, 20);  // float32 "parameter"
  const Array x = bf(random_array(Shape{4, 6}, 21));
  // Flax's dtype=bf16, param_dtype=float32: the parameter is cast for the computation.
  auto loss = [](const Array& w, const Array& x) { return mean(square(gelu(matmul(x, astype(w, DType::bf16))))); };
  auto [value, gw, gx] = value_and_grad<0, 1>(loss)(w, x);
  CHECK(value.dtype() == DType::bf16);
  CHECK(gw.dtype() == DType::f32);
  CHECK(gx.dtype() == DType::bf16);
  // And the values agree with the float32 computation within bf16 tolerance.
  auto loss32 = [](const Array& w, const Array& x) {
    return mean(square(gelu(matmul(x, astype(astype(w, DType::bf16), DType::f32)))));
  };
  auto g32 = grad<0>(loss32)(w, astype(x, DType::f32));
  CHECK(max_rel_diff(gw, g32) < 0.02);
  // A bf16 value mixed into a float32 computation gets a bf16 gradient.
  auto mixed = [](const Array& x) { return sum(x * Array::full(Shape{6}, 2.0f)); };  // promotes to f32
  Array g_mixed = grad(mixed)(x);
  CHECK(g_mixed.dtype() == DType::bf16);
  CHECK(g_mixed.to_vector() == std::vector<float>(24, 2.0f));
}

TEST_CASE("float32 gradient checks pass through astype round trips") {
  linum::testing::check_gradients(
      "astype", [](const std::vector<Array>& in) { return astype(astype(in[0], DType::bf16), DType::f32) * in[0]; },
      {random_array(Shape{3, 4}, 30)}, {.eps = 1e-2, .rtol = 2e-2, .atol = 1e-2});
}

TEST_CASE("remat in bf16: values and gradients bitwise equal to the plain model") {
  const Array w1 = random_array(Shape{8, 8}, 40), w2 = random_array(Shape{8, 8}, 41);
  const Array x = bf(random_array(Shape{5, 8}, 42));
  auto layer = [](const Array& h, const Array& w) { return gelu(matmul(h, astype(w, DType::bf16)) + 0.1f); };
  auto plain = [&](const Array& a, const Array& b, const Array& x) { return mean(square(layer(layer(x, a), b))); };
  auto every = [&](const Array& a, const Array& b, const Array& x) {
    return mean(square(checkpoint(layer)(checkpoint(layer)(x, a), b)));
  };
  auto dots = [&](const Array& a, const Array& b, const Array& x) {
    auto c = checkpoint(layer, {.policy = policies::dots_saveable{}});
    return mean(square(c(c(x, a), b)));
  };
  auto [v1, a1, b1, x1] = value_and_grad<0, 1, 2>(plain)(w1, w2, x);
  auto [v2, a2, b2, x2] = value_and_grad<0, 1, 2>(every)(w1, w2, x);
  auto [v3, a3, b3, x3] = value_and_grad<0, 1, 2>(dots)(w1, w2, x);
  CHECK(v1.bitwise_equal(v2));
  CHECK(v1.bitwise_equal(v3));
  CHECK(a1.dtype() == DType::f32);
  CHECK(x1.dtype() == DType::bf16);
  for (const auto& [a, b, g] : {std::tuple{a2, b2, x2}, std::tuple{a3, b3, x3}}) {
    CHECK(a1.bitwise_equal(a));
    CHECK(b1.bitwise_equal(b));
    CHECK(x1.bitwise_equal(g));
  }
}

TEST_CASE("remat policies and residual reports see dtypes and count 2 bytes per bf16 element") {
  const Array w = random_array(Shape{8, 8}, 50);
  const Array x = bf(random_array(Shape{4, 8}, 51));
  auto f = [](const Array& x, const Array& w) { return tanh(matmul(x, astype(w, DType::bf16))); };
  const auto residuals = lift::saved_residuals(f, x, w);
  std::size_t bf16_bytes = 0;
  bool saw_x = false;
  for (const auto& r : residuals) {
    if (r.dtype == DType::bf16) bf16_bytes += r.bytes;
    if (r.str().rfind("bf16[4,8] from the argument 0", 0) == 0) saw_x = true;
  }
  CHECK(saw_x);
  // A policy sees the dtype and the bytes of each op's output.
  std::vector<std::string> seen;
  lift::Policy spy("spy", [&](const lift::OpInfo& op) {
    seen.push_back(std::string(op.op) + ":" + dtype_short_name(op.dtype) + ":" + std::to_string(op.bytes));
    return false;
  });
  (void)grad<1>([&](const Array& x, const Array& w) { return sum(checkpoint(f, {.policy = spy})(x, w)); })(x, w);
  CHECK(std::find(seen.begin(), seen.end(), "matmul:bf16:64") != seen.end());
  CHECK(std::find(seen.begin(), seen.end(), "astype:bf16:128") != seen.end());
  // x (4x8), the bf16 cast of w (8x8) and tanh's output (4x8), at 2 bytes per element.
  CHECK(bf16_bytes == 2 * (32 + 64 + 32));
}

TEST_CASE("bf16 runs on every CPU: without bf16 kernels, products and convolutions are float32's on widened operands, rounded once") {
  // oneDNN 2.7 has bf16 kernels for AVX-512 and AMX only; on an AVX2 CPU (AMD Zen 3, say) its bf16
  // primitives cannot be built, and the oneDNN engine runs its float32 kernels on the widened
  // operands instead, as the Eigen engine always does. Forward and gradients run on either engine.
  const Engine before = engine();
  const Array a = astype(random_array(Shape{2, 33, 20}, 70), DType::bf16), b = astype(random_array(Shape{2, 20, 17}, 71), DType::bf16);
  const Array x = astype(random_array(Shape{2, 7, 6, 3}, 72), DType::bf16), w = astype(random_array(Shape{3, 3, 3, 5}, 73), DType::bf16);
  auto f32 = [](const Array& v) { return astype(v, DType::f32); };
  auto loss = [f32](const Array& p, const Array& q, const Array& xx, const Array& ww) {
    return sum(square(f32(matmul(p, q)))) + sum(square(f32(conv2d(xx, ww)))) +
           sum(square(f32(conv_transpose2d(xx, ww, {.strides = {2, 2}}))));
  };
  const Bf16Products products_before = bf16_products();
  for (Engine e : {Engine::eigen, Engine::onednn})
  for (Bf16Products p : {Bf16Products::dot_instructions, Bf16Products::onednn, Bf16Products::widened}) {
    if (!engine_available(e) || !bf16_products_available(p)) continue;
    CAPTURE(std::string(engine_name(e)));
    CAPTURE(std::string(bf16_products_name(p)));
    set_engine(e);
    set_bf16_products(p);
    const bool widened = e == Engine::eigen || p == Bf16Products::widened;
    const std::vector<std::pair<Array, Array>> pairs{
        {matmul(a, b), astype(matmul(f32(a), f32(b)), DType::bf16)},
        {conv2d(x, w), astype(conv2d(f32(x), f32(w)), DType::bf16)},
        {conv_transpose2d(x, w, {.strides = {2, 2}}), astype(conv_transpose2d(f32(x), f32(w), {.strides = {2, 2}}), DType::bf16)}};
    for (const auto& [got, want] : pairs) {
      CHECK(got.dtype() == DType::bf16);
      if (widened) CHECK(got.bitwise_equal(want));
      else CHECK(max_rel_diff(f32(got), f32(want)) < 1.0 / 64);  // oneDNN's bf16 kernels: their own sum order
    }
    const auto [value, ga, gb, gx, gw] = value_and_grad<0, 1, 2, 3>(loss)(a, b, x, w);
    const auto [value32, ga32, gb32, gx32, gw32] = value_and_grad<0, 1, 2, 3>(loss)(f32(a), f32(b), f32(x), f32(w));
    CHECK(ga.dtype() == DType::bf16);
    CHECK(gw.dtype() == DType::bf16);
    CHECK(max_rel_diff(f32(ga), ga32) < 1.0 / 16);
    CHECK(max_rel_diff(f32(gw), gw32) < 1.0 / 16);
  }
  set_engine(before);
  set_bf16_products(products_before);
  const std::string has = onednn_has_bf16_kernels() ? "has" : "has no";
  MESSAGE("oneDNN ", has, " bf16 kernels for this CPU; bf16 products: ", bf16_products_name(bf16_products()));
}

TEST_CASE("bf16 products: the CPU's default, every choice available here, and a clear error for the others") {
  const Bf16Products before = bf16_products();
  CHECK(bf16_products_available(before));
  CHECK(bf16_products_available(Bf16Products::widened));  // everywhere, also without oneDNN
  if (!onednn_has_bf16_kernels()) CHECK(before == Bf16Products::widened);
  // The same layer's bf16 step under every choice this CPU has: each is deterministic (the same bits
  // twice, so remat's recomputation is bitwise) and close to the float32 step.
  const Array x = astype(random_array(Shape{64, 96}, 90), DType::bf16), w = astype(random_array(Shape{96, 48}, 91), DType::bf16);
  const Array b = astype(random_array(Shape{48}, 92), DType::bf16);
  auto f32 = [](const Array& v) { return astype(v, DType::f32); };
  auto loss = [f32](const Array& xx, const Array& ww, const Array& bb) {
    return sum(square(f32(linear(xx, ww, bb, Activation::gelu))));
  };
  const auto [v32, gx32, gw32] = value_and_grad<0, 1>(loss)(f32(x), f32(w), f32(b));
  for (Bf16Products p : {Bf16Products::dot_instructions, Bf16Products::onednn, Bf16Products::widened}) {
    CAPTURE(std::string(bf16_products_name(p)));
    if (!bf16_products_available(p)) {
      CHECK_THROWS_WITH_AS(set_bf16_products(p), doctest::Contains("not available on this CPU or build"), ValueError);
      continue;
    }
    set_bf16_products(p);
    CHECK(bf16_products() == p);
    const auto [v1, gx1, gw1] = value_and_grad<0, 1>(loss)(x, w, b);
    const auto [v2, gx2, gw2] = value_and_grad<0, 1>(loss)(x, w, b);
    CHECK(v1.bitwise_equal(v2));
    CHECK(gx1.bitwise_equal(gx2));
    CHECK(gw1.bitwise_equal(gw2));
    // (relative to the largest element: the bf16 roundings of the layer's output and cotangents
    // dominate, and are the same under every choice)
    CHECK(diff_of_largest(f32(v1), v32) < 1.0 / 64);
    CHECK(diff_of_largest(f32(gw1), gw32) < 1.0 / 32);
    CHECK(diff_of_largest(f32(gx1), gx32) < 1.0 / 32);
  }
  set_bf16_products(before);
  CHECK(std::string(bf16_products_name(Bf16Products::widened)) == "widened");
}

TEST_CASE("the oneDNN and Eigen engines agree") {
  if (!engine_available(Engine::onednn)) return;
  const Engine before = engine();
  const Array a = random_array(Shape{3, 37, 29}, 60), b = random_array(Shape{3, 29, 41}, 61);
  for (DType t : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(t));
    set_engine(Engine::onednn);
    const Array y1 = matmul(astype(a, t), astype(b, t));
    const auto g1 = grad<0, 1>([](const Array& p, const Array& q) { return sum(square(matmul(p, q))); })(astype(a, t), astype(b, t));
    set_engine(Engine::eigen);
    const Array y2 = matmul(astype(a, t), astype(b, t));
    const auto g2 = grad<0, 1>([](const Array& p, const Array& q) { return sum(square(matmul(p, q))); })(astype(a, t), astype(b, t));
    CHECK(y1.dtype() == t);
    CHECK(max_rel_diff(y1, y2) < (t == DType::f32 ? 1e-5 : 1.0 / 64));
    CHECK(max_rel_diff(std::get<0>(g1), std::get<0>(g2)) < (t == DType::f32 ? 1e-4 : 1.0 / 16));
    CHECK(max_rel_diff(std::get<1>(g1), std::get<1>(g2)) < (t == DType::f32 ? 1e-4 : 1.0 / 16));
  }
  // Convolutions: strides, dilation, groups and asymmetric padding, forward and both gradients.
  const Array x = random_array(Shape{2, 9, 8, 4}, 62), w = random_array(Shape{3, 2, 2, 6}, 63);
  const ConvOptions opt{.strides = {2, 1}, .padding = Padding::explicit_pads(1, 2, 0, 1), .dilation = {1, 2},
                        .feature_group_count = 2};
  auto conv_loss = [&](const Array& p, const Array& q) { return sum(square(conv2d(p, q, opt))); };
  for (DType t : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(t));
    set_engine(Engine::onednn);
    const Array y1 = conv2d(astype(x, t), astype(w, t), opt);
    const auto g1 = grad<0, 1>(conv_loss)(astype(x, t), astype(w, t));
    set_engine(Engine::eigen);
    const Array y2 = conv2d(astype(x, t), astype(w, t), opt);
    const auto g2 = grad<0, 1>(conv_loss)(astype(x, t), astype(w, t));
    CHECK(y1.dtype() == t);
    CHECK(y1.shape() == y2.shape());
    CHECK(max_rel_diff(y1, y2) < (t == DType::f32 ? 1e-5 : 1.0 / 64));
    CHECK(max_rel_diff(std::get<0>(g1), std::get<0>(g2)) < (t == DType::f32 ? 1e-4 : 1.0 / 16));
    CHECK(max_rel_diff(std::get<1>(g1), std::get<1>(g2)) < (t == DType::f32 ? 1e-4 : 1.0 / 16));
  }
  set_engine(before);
  set_engine(Engine::eigen);
  CHECK(engine() == Engine::eigen);
  set_engine(before);
}

TEST_CASE("serialization keeps bf16 arrays bit for bit, in Flax's msgpack layout") {
  Tree t;
  std::vector<float> specials = {0.0f, -0.0f, 1.0f, -3.5f, 1e-39f, 3e38f, std::numeric_limits<float>::infinity(),
                                 std::numeric_limits<float>::quiet_NaN()};
  t.set_path("params/w", astype(Array::from(Shape{2, 4}, specials), DType::bf16));
  t.set_path("params/f", random_array(Shape{3}, 70));
  const auto mp = serialization::to_msgpack(t);
  const Tree back = serialization::from_msgpack(mp);
  CHECK(back.at("params").at("w").array().dtype() == DType::bf16);
  CHECK(bitwise_equal(back, t));
  // The record holds "bfloat16" and 2 bytes per element, as flax.serialization writes.
  const std::string text(mp.begin(), mp.end());
  CHECK(text.find("bfloat16") != std::string::npos);
  const Tree from_json = serialization::from_json(serialization::to_json(t));
  CHECK(bitwise_equal(from_json, t));
  // A JSON value that bf16 cannot hold exactly is refused, not rounded silently.
  auto j = serialization::to_json(t);
  j["params"]["w"]["data"][0] = 0.1;
  CHECK_THROWS_AS(serialization::from_json(j), IoError);
}

// ---- layers: Flax's dtype and param_dtype --------------------------------------------------------

namespace {
const Array* leaf_at(const Tree& t, const std::string& path) {
  static Array holder;
  holder = t.at_path(path).array();
  return &holder;
}
}  // namespace

TEST_CASE("Dense: dtype sets the computation, param_dtype the parameters, as flax.linen") {
  const Array x = random_array(Shape{3, 4}, 80);
  // Mixed precision: float32 params, bf16 computation, float32 gradients.
  const nn::Dense mixed{.features = 5, .dtype = DType::bf16};
  Tree v = init(mixed, rng::key(0), x);
  CHECK(leaf_at(v, "params/kernel")->dtype() == DType::f32);
  CHECK(apply(mixed, v, x).dtype() == DType::bf16);
  // The same parameters as the float32 layer (param_dtype float32 is the default).
  CHECK(bitwise_equal(v, init(nn::Dense{.features = 5}, rng::key(0), x)));
  Tree params = v.at("params");
  auto loss = [&](const Tree& p) { return mean(square(apply(mixed, Tree{{"params", p}}, x))); };
  Tree g = grad(loss)(params);
  CHECK(g.at("kernel").array().dtype() == DType::f32);
  CHECK(g.at("bias").array().dtype() == DType::f32);
  // bf16 parameters: created in bf16 (the float32 draw rounded); with float32 input the default
  // dtype promotes to float32, with bf16 input it stays bf16.
  const nn::Dense half{.features = 5, .param_dtype = DType::bf16};
  Tree vh = init(half, rng::key(0), x);
  CHECK(leaf_at(vh, "params/kernel")->dtype() == DType::bf16);
  CHECK(leaf_at(vh, "params/kernel")->bitwise_equal(astype(v.at_path("params/kernel").array(), DType::bf16)));
  CHECK(apply(half, vh, x).dtype() == DType::f32);
  CHECK(apply(half, vh, astype(x, DType::bf16)).dtype() == DType::bf16);
  CHECK_THROWS_WITH_AS(init(nn::Dense{.features = 2, .param_dtype = DType::i32}, rng::key(0), x),
                       doctest::Contains("param_dtype must be a float dtype"), ValueError);
}

TEST_CASE("every layer runs in bf16 and matches its float32 output within bf16 tolerance") {
  const Array img = random_array(Shape{2, 6, 6, 3}, 81);
  const Array seq = random_array(Shape{2, 5, 8}, 82);
  auto compare = [](const auto& layer32, const auto& layer16, const Array& x, double tol) {
    Tree v = init(layer32, rng::key(3), x);
    const Array y32 = apply(layer32, v, x);
    const Array y16 = apply(layer16, v, x);
    CHECK(y16.dtype() == DType::bf16);
    CHECK(max_rel_diff(y16, y32) < tol);
  };
  compare(nn::Conv{.features = 4, .kernel_size = {3, 3}}, nn::Conv{.features = 4, .kernel_size = {3, 3}, .dtype = DType::bf16}, img, 0.03);
  compare(nn::DenseGeneral{.features = {2, 3}}, nn::DenseGeneral{.features = {2, 3}, .dtype = DType::bf16}, seq, 0.03);
  compare(nn::LayerNorm{}, nn::LayerNorm{.dtype = DType::bf16}, seq, 0.02);
  compare(nn::RMSNorm{}, nn::RMSNorm{.dtype = DType::bf16}, seq, 0.02);
  compare(nn::GroupNorm{.num_groups = 4}, nn::GroupNorm{.num_groups = 4, .dtype = DType::bf16}, seq, 0.02);
  compare(nn::MultiHeadDotProductAttention{.num_heads = 2},
          nn::MultiHeadDotProductAttention{.num_heads = 2, .dtype = DType::bf16}, seq, 0.05);
  const Array ids = Array::from_i32(Shape{2, 3}, {0, 1, 2, 3, 4, 0});
  compare(nn::Embed{.num_embeddings = 5, .features = 4}, nn::Embed{.num_embeddings = 5, .features = 4, .dtype = DType::bf16},
          ids, 0.01);
  // Normalization of a bf16 input with float32 params gives float32 by default (Flax promotes).
  Tree v = init(nn::LayerNorm{}, rng::key(0), astype(seq, DType::bf16));
  CHECK(apply(nn::LayerNorm{}, v, astype(seq, DType::bf16)).dtype() == DType::f32);
  // BatchNorm keeps float32 running statistics for bf16 inputs.
  const nn::BatchNorm bn{.use_running_average = false, .dtype = DType::bf16};
  Tree vb = init(bn, rng::key(0), img);
  auto [y, updated] = apply(bn, vb, {.mutable_collections = {"batch_stats"}}, astype(img, DType::bf16));
  CHECK(y.dtype() == DType::bf16);
  CHECK(updated.at_path("batch_stats/mean").array().dtype() == DType::f32);
}

TEST_CASE("mixed-precision training: adam keeps float32 masters, bf16 params keep bf16 states, loss falls") {
  const Array x = random_array(Shape{32, 6}, 90);
  const Array labels = linum::testing::random_labels(Shape{32}, 91, 3);
  struct Net {
    Array operator()(Scope& s, const Array& x) const {
      Array h = gelu(s(nn::Dense{.features = 16, .dtype = DType::bf16}, x));
      return s(nn::Dense{.features = 3, .dtype = DType::bf16}, h);
    }
  };
  Tree params = init(Net{}, rng::key(4), x).at("params");
  const auto opt = optim::adam(3e-2);
  Tree state = opt.init(params);
  auto loss = [&](const Tree& p) {
    return mean(nn::softmax_cross_entropy_with_integer_labels(apply(Net{}, Tree{{"params", p}}, x), labels));
  };
  const float before = loss(params).item();
  for (int step = 0; step < 40; ++step) {
    auto [value, grads] = value_and_grad(loss)(params);
    CHECK(value.dtype() == DType::f32);  // losses compute in float32
    auto [updates, next] = opt.update(grads, state, params);
    params = optim::apply_updates(params, updates);
    state = next;
  }
  CHECK(params.at_path("Dense_0/kernel").array().dtype() == DType::f32);
  CHECK(loss(params).item() < 0.5f * before);
  // With bf16 parameters, adam's moments are bf16 too (optax keeps states in the params' dtype).
  Tree p16 = tree_map([](const Array& a) { return astype(a, DType::bf16); }, params);
  Tree s16 = opt.init(p16);
  for (const auto& [path, a] : flatten(s16))
    if (path.find("count") == std::string::npos) CHECK(a.dtype() == DType::bf16);
  auto [u16, n16] = opt.update(p16, s16, p16);
  CHECK(u16.at_path("Dense_0/kernel").array().dtype() == DType::bf16);
  CHECK(optim::apply_updates(p16, u16).at_path("Dense_0/kernel").array().dtype() == DType::bf16);
}

TEST_CASE("bf16 pooling is the float32 pooling rounded once, bitwise, and makes no float32 copy of the images") {
  // Overlapping windows (3x3, stride 2) with SAME padding and border windows dividing by their
  // in-bounds size: every input pixel is summed by up to four windows, forward and backward.
  const Array x = bf(random_array(Shape{3, 9, 11, 20}, 70));
  const Array probe = bf(random_array(Shape{3, 5, 6, 20}, 71));
  const PoolOptions overlap{.window = {3, 3}, .strides = {2, 2}, .padding = "SAME", .count_include_pad = false};
  const PoolOptions tiles{.window = {2, 2}, .strides = {2, 2}};
  for (const PoolOptions& o : {overlap, tiles}) {
    using Pool = Array (*)(const Array&, const PoolOptions&);
    for (Pool pool : {Pool{avg_pool}, Pool{max_pool}}) {
      const Array got = pool(x, o);
      CHECK(got.dtype() == DType::bf16);
      CHECK(got.bitwise_equal(bf(pool(astype(x, DType::f32), o))));
      // The gradient: float32 sums of the bf16 cotangent, rounded once.
      const Array p = slice_axis(slice_axis(probe, 1, 0, got.dim(1)), 2, 0, got.dim(2));
      const Array g = grad([&](const Array& v) { return sum(astype(pool(v, o) * p, DType::f32)); })(x);
      const Array g32 = grad([&](const Array& v) { return sum(pool(v, o) * astype(p, DType::f32)); })(astype(x, DType::f32));
      CHECK(g.dtype() == DType::bf16);
      CHECK(g.bitwise_equal(bf(g32)));
    }
  }
  // Memory: the forward and backward pass of a large bf16 image batch hold no float32 image.
  const Array big = bf(random_array(Shape{16, 64, 64, 24}, 72));
  const std::int64_t image_bytes = static_cast<std::int64_t>(big.nbytes());
  using Pool = Array (*)(const Array&, const PoolOptions&);
  // The gradient, a quarter-size output and the loss's float32 cotangent for it (max_pool: and its
  // int32 positions), no float32 image (2x): the float32 copies took 3x and more.
  const std::pair<Pool, std::int64_t> bounds[] = {{avg_pool, image_bytes * 7 / 4}, {max_pool, image_bytes * 5 / 2}};
  for (const auto& case_ : bounds) {
    const Pool pool = case_.first;  // (a lambda may not capture a structured binding before clang 16)
    const std::int64_t bound = case_.second;
    memory::PeakScope scope;
    const Array g = grad([&](const Array& v) { return sum(astype(pool(v, tiles), DType::f32)); })(big);
    CHECK(g.dtype() == DType::bf16);
    CHECK(scope.peak_growth() < bound);
  }
}

TEST_CASE("bf16 cotangents add up in float32, rounded once, without float32 copies") {
  // x reaches the loss along two paths: its gradient is the sum of two bf16 cotangents.
  const Array x = bf(random_array(Shape{1 << 22}, 80));
  const Array w = bf(random_array(Shape{1 << 22}, 81));
  auto loss = [&](const Array& v) { return sum(astype(v * w + v, DType::f32)); };
  const Array want = bf(astype(w, DType::f32) + 1.0f);  // 1 * w + 1 in float32, rounded once
  const std::int64_t bytes = static_cast<std::int64_t>(x.nbytes());
  memory::PeakScope scope;
  const Array g = grad(loss)(x);
  CHECK(g.dtype() == DType::bf16);
  CHECK(g.bitwise_equal(want));
  // The float32 broadcast of the loss's cotangent (2x) and a few bf16 arrays; widening the sum's
  // operands and result into float32 (as before) took 6x more on top.
  CHECK(scope.peak_growth() < 6 * bytes);
}

TEST_CASE("cotangents add up in place only in buffers nothing else holds: a cotangent the caller passed stays as it was") {
  const Array x = random_array(Shape{1 << 19}, 90);  // large enough for the parallel sum
  for (const DType dt : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_short_name(dt));
    // x + x: the add's rule hands the same cotangent (the caller's array) to both uses of x.
    auto [y, pullback] = vjp([&](const Array& v) { return v + v; }, astype(x, dt));
    const Array ct = astype(random_array(Shape{1 << 19}, 91), dt);
    const Array before = astype(Array::from(ct.shape(), ct.to_vector()), dt);  // a copy in its own buffer
    const Array g = pullback(ct);
    CHECK(ct.bitwise_equal(before));
    CHECK(g.bitwise_equal(astype(astype(ct, DType::f32) * 2.0f, dt)));
  }
}
