// Tests for linum::rng: JAX-compatible keys, bits and samplers, and Flax-style stream derivation.
//
// Where the expected values come from:
//   * [KAT]   Random123 known-answer vectors, also in JAX's tests/random_test.py::testThreefry2x32.
//   * [JAX-legacy] JAX's tests/random_test.py, tests that run with jax_threefry_partitionable=False
//             (testPRNGValues, testRngRandomBits) and the _RANDOM_VALUES_CASES table.
//   * [JAX-seed] tests/random_test.py::test_prng_seeds_and_keys.
//   * [Flax]  the executed outputs stored in Flax's docs/guides/flax_fundamentals/rng_guide.ipynb,
//             which sets jax_threefry_partitionable=True (so these are partitionable-mode values).
//   * [JAX-doc] docs/jep/9263-typed-keys.md.
#include <doctest/doctest.h>
#include <linum/rng/rng.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdint>
#include <set>
#include <string>
#include <thread>
#include <vector>

using namespace linum;
using linum::rng::Key;
using linum::rng::Mode;

namespace {

std::vector<std::uint32_t> as_u32(const Array& a) {
  std::vector<std::uint32_t> out;
  for (std::int32_t v : a.to_vector_i32()) out.push_back(static_cast<std::uint32_t>(v));
  return out;
}

// |actual - expected| <= abs_tol elementwise. Expected values are NumPy printouts: with 8 printed
// decimals, abs_tol = 6e-9 demands the identical float32 for any |value| > 0.06.
void check_close(const std::vector<float>& actual, const std::vector<float>& expected, float abs_tol) {
  REQUIRE(actual.size() == expected.size());
  for (std::size_t i = 0; i < actual.size(); ++i) {
    INFO("element " << i << ": got " << actual[i] << ", expected " << expected[i]);
    CHECK(std::fabs(actual[i] - expected[i]) <= abs_tol);
  }
}

double mean(const std::vector<float>& v) {
  double s = 0;
  for (float x : v) s += x;
  return s / static_cast<double>(v.size());
}

double variance(const std::vector<float>& v) {
  const double m = mean(v);
  double s = 0;
  for (float x : v) s += (x - m) * (x - m);
  return s / static_cast<double>(v.size());
}

}  // namespace

TEST_CASE("threefry2x32 known-answer vectors [KAT]") {
  using rng::threefry2x32;
  CHECK(threefry2x32(0u, 0u, 0u, 0u) == std::array<std::uint32_t, 2>{0x6b200159u, 0x99ba4efeu});
  CHECK(threefry2x32(0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu) ==
        std::array<std::uint32_t, 2>{0x1cb996fcu, 0xbb002be7u});
  CHECK(threefry2x32(0x13198a2eu, 0x03707344u, 0x243f6a88u, 0x85a308d3u) ==
        std::array<std::uint32_t, 2>{0xc4923a9cu, 0x483df7a0u});
}

TEST_CASE("seeding follows JAX [JAX-seed]") {
  CHECK(rng::key(0) == Key{0, 0});
  CHECK(rng::key(1) == Key{0, 1});
  CHECK(rng::key(3) == Key{0, 3});
  // jax_enable_x64=True column of the table.
  CHECK(rng::key(-1) == Key{4294967295u, 4294967295u});
  CHECK(rng::key(-3) == Key{4294967295u, 4294967293u});
  CHECK(rng::key(2147483647LL + 100) == Key{0, 2147483747u});
  CHECK(rng::key(-2147483648LL - 100) == Key{4294967295u, 2147483548u});
  CHECK(rng::key(-2147483648LL - 101) == Key{4294967295u, 2147483547u});
  CHECK(rng::key(0x123456789LL) == Key{0x1u, 0x23456789u});
  // Default x32 column.
  CHECK(rng::key_x32(-1) == Key{0, 4294967295u});
  CHECK(rng::key_x32(-2) == Key{0, 4294967294u});
  CHECK(rng::key_x32(-2147483648LL - 101) == Key{0, 2147483547u});
  CHECK(rng::key_x32(2147483647LL + 100) == Key{0, 2147483747u});
}

TEST_CASE("Key printing and equality") {
  CHECK(Key{1, 2}.str() == "[1, 2]");
  CHECK(Key{1, 2} != Key{2, 1});
  std::ostringstream os;
  os << Key{4294967295u, 0};
  CHECK(os.str() == "[4294967295, 0]");
}

TEST_CASE("legacy split, fold_in and randint of key(0) [JAX-legacy testPRNGValues]") {
  const auto keys = rng::split(rng::key(0), 4, Mode::legacy);
  REQUIRE(keys.size() == 4);
  CHECK(keys[0] == Key{2285895361u, 1501764800u});
  CHECK(keys[1] == Key{1518642379u, 4090693311u});
  CHECK(keys[2] == Key{433833334u, 4221794875u});
  CHECK(keys[3] == Key{839183663u, 3740430601u});
  CHECK(rng::fold_in(rng::key(0), 4) == Key{2285895361u, 433833334u});
  const Array r = rng::randint(rng::key(0), Shape{3, 3}, 0, 8, Mode::legacy);
  CHECK(r.shape() == Shape{3, 3});
  CHECK(r.to_vector_i32() == std::vector<std::int32_t>{2, 1, 3, 6, 1, 5, 6, 3, 4});
}

TEST_CASE("legacy random bits of key(1701) [JAX-legacy testRngRandomBits]") {
  const Key k = rng::key(1701);
  CHECK(as_u32(rng::bits(k, Shape{3}, Mode::legacy)) == std::vector<std::uint32_t>{56197195u, 4200222568u, 961309823u});
  CHECK(rng::bits_wide(k, 8, 3, Mode::legacy) == std::vector<std::uint64_t>{216, 115, 43});
  CHECK(rng::bits_wide(k, 16, 3, Mode::legacy) == std::vector<std::uint64_t>{41682, 1300, 55017});
  CHECK(rng::bits_wide(k, 32, 3, Mode::legacy) == std::vector<std::uint64_t>{56197195u, 4200222568u, 961309823u});
  CHECK(rng::bits_wide(k, 64, 3, Mode::legacy) ==
        std::vector<std::uint64_t>{3982329540505020460ull, 16822122385914693683ull, 7882654074788531506ull});
  // testRngRandomBitsViewProperty: 8/16-bit draws are the little-endian pieces of the 32-bit draw.
  const auto w32 = rng::bits_u32(k, 10, Mode::legacy);
  const auto w8 = rng::bits_wide(k, 8, 40, Mode::legacy);
  for (int i = 0; i < 40; ++i) CHECK(w8[static_cast<std::size_t>(i)] == ((w32[static_cast<std::size_t>(i / 4)] >> (8 * (i % 4))) & 0xFF));
}

TEST_CASE("legacy distribution values [JAX-legacy _RANDOM_VALUES_CASES]") {
  // Seeds are zlib.adler32((name + "threefry2x32").encode()).
  CHECK(as_u32(rng::bits(rng::key(942802475), Shape{5}, Mode::legacy)) ==
        std::vector<std::uint32_t>{1978747883u, 4134381225u, 3628107870u, 689687174u, 2788938207u});
  check_close(rng::uniform(rng::key(1338574713), Shape{5}, 0.0f, 1.0f, Mode::legacy).to_vector(),
              {0.298671f, 0.073213f, 0.873356f, 0.260549f, 0.412797f}, 6e-7f);
  check_close(rng::normal(rng::key(1193674498), Shape{5}, Mode::legacy).to_vector(),
              {-1.173234f, -1.511662f, 0.070593f, -0.099764f, 1.052845f}, 6e-7f);
  check_close(rng::truncated_normal(rng::key(2846034731), 0.0f, 2.0f, Shape{5}, Mode::legacy).to_vector(),
              {0.582807f, 1.709771f, 0.159513f, 0.861376f, 0.36148f}, 6e-7f);
  CHECK(rng::randint(rng::key(1319372649), Shape{5}, 0, 10, Mode::legacy).to_vector_i32() ==
        std::vector<std::int32_t>{0, 5, 7, 7, 5});
  CHECK(rng::bernoulli(rng::key(1612777541), 0.5f, Shape{5}, Mode::legacy).to_vector() ==
        std::vector<float>{0, 1, 1, 1, 0});
  check_close(rng::gumbel(rng::key(1179715317), Shape{5}, Mode::legacy).to_vector(),
              {2.06701f, 0.911726f, 0.145736f, 0.185427f, -0.00711f}, 6e-7f);
}

TEST_CASE("partitionable split equals fold_in of the index [JAX test_threefry_split_fold_in_symmetry]") {
  for (std::int64_t seed : {0, 72, 1701, -5}) {
    const Key k = rng::key(seed);
    const auto keys = rng::split(k, 7, Mode::partitionable);
    for (std::uint32_t i = 0; i < 7; ++i) CHECK(keys[i] == rng::fold_in(k, i));
    // Each element depends only on its index: a prefix of a longer split is the shorter split.
    const auto three = rng::split(k, 3, Mode::partitionable);
    CHECK(std::equal(three.begin(), three.end(), keys.begin()));
  }
  // fold_in is mode independent, and partitionable split(key(0), 4)[4 % 4...]: fold_in(key(0), 4)
  // is the legacy-table value above.
  CHECK(rng::fold_in(rng::key(0), 4) == Key{2285895361u, 433833334u});
}

TEST_CASE("partitionable bits are per-index hashes and prefixes agree; legacy bits depend on the size") {
  const Key k = rng::key(1701);
  const auto five = rng::bits_u32(k, 5, Mode::partitionable);
  const auto three = rng::bits_u32(k, 3, Mode::partitionable);
  CHECK(std::equal(three.begin(), three.end(), five.begin()));
  for (std::uint32_t i = 0; i < 5; ++i) {
    const auto y = rng::threefry2x32(k.hi, k.lo, 0, i);
    CHECK(five[i] == (y[0] ^ y[1]));
  }
  const auto l5 = rng::bits_u32(k, 5, Mode::legacy);
  const auto l3 = rng::bits_u32(k, 3, Mode::legacy);
  CHECK(l5[0] != l3[0]);
  // 64-bit partitionable draws are (y0 << 32) | y1; 8-bit draws truncate y0 ^ y1.
  const auto y = rng::threefry2x32(k.hi, k.lo, 0, 1);
  CHECK(rng::bits_wide(k, 64, 2, Mode::partitionable)[1] == ((std::uint64_t{y[0]} << 32) | y[1]));
  CHECK(rng::bits_wide(k, 8, 2, Mode::partitionable)[1] == ((y[0] ^ y[1]) & 0xFF));
  CHECK_THROWS_AS(rng::bits_wide(k, 12, 2), ValueError);
}

TEST_CASE("Flax make_rng keys and normals, partitionable mode [Flax rng_guide]") {
  rng::ModeGuard guard(Mode::partitionable);
  const std::vector<std::string> root;
  const std::vector<std::string> sub{"RNGSubModule_0"};
  const std::vector<std::string> subsub{"RNGSubModule_0", "RNGSubSubModule_0"};
  const std::vector<std::string> sub1{"RNGSubModule_1"};
  const Key k0 = rng::key(0);
  CHECK(rng::fold_in_path(k0, root, 1) == Key{1428664606u, 3351135085u});
  CHECK(rng::fold_in_path(k0, root, 2) == Key{3456700291u, 3873160899u});
  CHECK(rng::fold_in_path(k0, root, 3) == Key{2411773124u, 4124888837u});
  CHECK(rng::fold_in_path(rng::key(1), root, 1) == Key{3077990774u, 2166202870u});
  CHECK(rng::fold_in_path(rng::key(1), root, 2) == Key{3825832496u, 2886313970u});
  CHECK(rng::fold_in_path(rng::key(1), root, 3) == Key{791337683u, 1373966058u});
  CHECK(rng::fold_in_path(k0, sub, 1) == Key{3858825717u, 2323087578u});
  CHECK(rng::fold_in_path(k0, sub, 2) == Key{601859108u, 3782857444u});
  CHECK(rng::fold_in_path(k0, subsub, 1) == Key{234240654u, 1028548813u});
  CHECK(rng::fold_in_path(k0, subsub, 2) == Key{3650462303u, 2124609379u});
  CHECK(rng::fold_in_path(k0, sub1, 1) == Key{426957352u, 2006350344u});
  CHECK(rng::fold_in_path(k0, sub1, 2) == Key{4006253729u, 4205356731u});

  // produce_hash(('A','B','C',1)) and its colliding spellings.
  const std::vector<std::string> abc{"A", "B", "C"}, ab_c{"AB", "C"}, abc1{"ABC"};
  CHECK(rng::path_hash(abc, 1) == 947574064u);
  CHECK(rng::path_hash(ab_c, 1) == 947574064u);
  CHECK(rng::path_hash(abc1, 1) == 947574064u);
  CHECK(rng::path_hash(abc, 1, true) != rng::path_hash(abc1, 1, true));

  // Model.init({'params': key(0), 'other': key(1)}): normal initializers drawn from derived keys.
  const rng::Streams streams{{"params", rng::key(0)}, {"other", rng::key(1)}};
  const std::vector<std::string> dense0{"Dense_0"}, dense1{"Dense_1"};
  // Printed by NumPy with up to 8 decimals: these tolerances require the same float32 values.
  const float tol = 6e-9f;
  check_close(rng::normal(streams.derive("params", dense0, 1), Shape{2, 2}).to_vector(),
              {-1.6185919f, 0.700908f, -1.3146383f, -0.79342234f}, tol);
  check_close(rng::normal(streams.derive("params", root, 1), Shape{2, 2}).to_vector(),
              {0.0761425f, -1.6157459f, -1.6857724f, 0.7126891f}, tol);
  check_close(rng::normal(streams.derive("params", root, 2), Shape{2, 2}).to_vector(),
              {0.60175574f, 0.2553228f, 0.27367848f, -2.1975214f}, tol);
  check_close(rng::normal(streams.derive("other", root, 1), Shape{2, 2}).to_vector(),
              {1.6249592f, 0.30813068f, 1.6613585f, 1.0404155f}, tol);
  check_close(rng::normal(streams.derive("params", dense1, 1), Shape{2, 2}).to_vector(),
              {0.0030665f, 0.29551846f, 0.16670242f, -0.78252524f}, tol);
  check_close(rng::normal(streams.derive("params", dense1, 2), Shape{1, 2}).to_vector(), {1.582462f, 0.15216611f}, tol);
}

TEST_CASE("partitionable uniform of key(0) [JAX-doc]") {
  check_close(rng::uniform(rng::key(0), Shape{3}, 0.0f, 1.0f, Mode::partitionable).to_vector(),
              {0.947667f, 0.9785799f, 0.33229148f}, 6e-9f);
}

TEST_CASE("default mode, set_default_mode and ModeGuard") {
  CHECK(rng::default_mode() == Mode::partitionable);
  const Key k = rng::key(7);
  CHECK(rng::split(k) == rng::split(k, 2, Mode::partitionable));
  {
    rng::ModeGuard legacy(Mode::legacy);
    CHECK(rng::default_mode() == Mode::legacy);
    CHECK(rng::split(k) == rng::split(k, 2, Mode::legacy));
    {
      rng::ModeGuard inner(Mode::partitionable);
      CHECK(rng::default_mode() == Mode::partitionable);
    }
    CHECK(rng::default_mode() == Mode::legacy);
    // Another thread does not see this thread's guard.
    Mode seen = Mode::legacy;
    std::thread t([&] { seen = rng::default_mode(); });
    t.join();
    CHECK(seen == Mode::partitionable);
  }
  CHECK(rng::default_mode() == Mode::partitionable);
  rng::set_default_mode(Mode::legacy);
  CHECK(rng::default_mode() == Mode::legacy);
  rng::set_default_mode(Mode::partitionable);
  CHECK(rng::parse_mode("legacy") == Mode::legacy);
  CHECK(std::string(rng::mode_name(Mode::partitionable)) == "partitionable");
  CHECK_THROWS_AS(rng::parse_mode("fast"), ValueError);
}

TEST_CASE("split edge cases") {
  CHECK(rng::split(rng::key(3), 0).empty());
  CHECK(rng::split(rng::key(3), 1, Mode::legacy).size() == 1);
  CHECK_THROWS_AS(rng::split(rng::key(3), -1), ValueError);
  // Legacy split of one key is threefry(key, 0, 1) read as one row.
  const auto y = rng::threefry2x32(0, 3, 0, 1);
  CHECK(rng::split(rng::key(3), 1, Mode::legacy)[0] == Key{y[0], y[1]});
}

TEST_CASE("uniform: the mantissa construction, range and moments") {
  for (Mode mode : {Mode::partitionable, Mode::legacy}) {
    const Key k = rng::key(11);
    const Array u = rng::uniform(k, Shape{200000}, 0.0f, 1.0f, mode);
    const auto v = u.to_vector();
    const auto words = rng::bits_u32(k, 200000, mode);
    for (std::size_t i = 0; i < 5; ++i) CHECK(v[i] == std::bit_cast<float>((words[i] >> 9) | 0x3F800000u) - 1.0f);
    CHECK(*std::min_element(v.begin(), v.end()) >= 0.0f);
    CHECK(*std::max_element(v.begin(), v.end()) < 1.0f);
    CHECK(mean(v) == doctest::Approx(0.5).epsilon(0.01));
    CHECK(variance(v) == doctest::Approx(1.0 / 12).epsilon(0.02));
    const auto w = rng::uniform(k, Shape{10000}, -3.0f, 5.0f, mode).to_vector();
    CHECK(*std::min_element(w.begin(), w.end()) >= -3.0f);
    CHECK(*std::max_element(w.begin(), w.end()) < 5.0f);
    CHECK(mean(w) == doctest::Approx(1.0).epsilon(0.05));
  }
  CHECK(rng::uniform(rng::key(0), Shape{2, 3}).shape() == Shape{2, 3});
  CHECK(rng::uniform(rng::key(0), Shape{0}).numel() == 0);
}

TEST_CASE("normal and truncated normal: moments and bounds") {
  const auto n = rng::normal(rng::key(5), Shape{200000}).to_vector();
  CHECK(std::fabs(mean(n)) < 0.01);
  CHECK(variance(n) == doctest::Approx(1.0).epsilon(0.02));
  for (float x : n) REQUIRE(std::isfinite(x));
  const auto t = rng::truncated_normal(rng::key(5), -0.5f, 1.5f, Shape{100000}).to_vector();
  CHECK(*std::min_element(t.begin(), t.end()) > -0.5f);
  CHECK(*std::max_element(t.begin(), t.end()) < 1.5f);
  // Mean of N(0,1) truncated to (a, b): (phi(a) - phi(b)) / (Phi(b) - Phi(a)).
  const auto phi = [](double x) { return std::exp(-x * x / 2) / std::sqrt(2 * M_PI); };
  const auto Phi = [](double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); };
  CHECK(mean(t) == doctest::Approx((phi(-0.5) - phi(1.5)) / (Phi(1.5) - Phi(-0.5))).epsilon(0.02));
  const auto tight = rng::truncated_normal(rng::key(6), 2.0f, 2.001f, Shape{1000}).to_vector();
  for (float x : tight) REQUIRE((x > 2.0f && x < 2.001f));
  CHECK_THROWS_AS(rng::truncated_normal(rng::key(0), 1.0f, 1.0f, Shape{2}), ValueError);
}

TEST_CASE("xla erf and erf_inv agree with the C library to float32 accuracy") {
  for (float x = -0.999f; x < 1.0f; x += 0.0137f) {
    const float y = rng::erf_inv_f32(x);
    CHECK(std::erf(static_cast<double>(y)) == doctest::Approx(x).epsilon(2e-6));
  }
  for (float x = -5.0f; x < 5.0f; x += 0.173f) CHECK(rng::erf_f32(x) == doctest::Approx(std::erf(x)).epsilon(2e-6));
  CHECK(std::isinf(rng::erf_inv_f32(1.0f)));
  CHECK(rng::erf_inv_f32(-1.0f) < 0);
}

TEST_CASE("xla log and log1p: within 2 float32 ulps of the exact values, special values as the C library's") {
  auto ulps = [](float got, double exact) { return std::abs(double(got) - exact) / std::abs(std::nextafter(float(exact), 1e30f) - float(exact)); };
  for (float x = 1e-30f; x < 1e30f; x *= 1.37f) CHECK(ulps(rng::log_f32(x), std::log(double(x))) <= 2.0);
  for (float x = -0.999f; x < 3.0f; x += 0.0071f)
    if (std::abs(x) > 1e-3f) CHECK(ulps(rng::log1p_f32(x), std::log1p(double(x))) <= 2.0);
  CHECK(rng::log_f32(1.0f) == 0.0f);
  CHECK(std::isinf(rng::log_f32(0.0f)));
  CHECK(rng::log_f32(0.0f) < 0);
  CHECK(std::isnan(rng::log_f32(-1.0f)));
  CHECK(std::isnan(rng::log_f32(std::nanf(""))));
  CHECK(std::isinf(rng::log_f32(std::numeric_limits<float>::infinity())));
  CHECK(rng::log1p_f32(0.0f) == 0.0f);
  CHECK(std::isinf(rng::log1p_f32(-1.0f)));
}

TEST_CASE("bernoulli rate and values") {
  const auto b = rng::bernoulli(rng::key(9), 0.3f, Shape{100000}).to_vector();
  for (float x : b) REQUIRE((x == 0.0f || x == 1.0f));
  CHECK(mean(b) == doctest::Approx(0.3).epsilon(0.03));
  const auto zeros = rng::bernoulli(rng::key(9), 0.0f, Shape{100}).to_vector();
  CHECK(std::all_of(zeros.begin(), zeros.end(), [](float x) { return x == 0.0f; }));
  const auto ones = rng::bernoulli(rng::key(9), 1.0f, Shape{100}).to_vector();
  CHECK(std::all_of(ones.begin(), ones.end(), [](float x) { return x == 1.0f; }));
  CHECK_THROWS_AS(rng::bernoulli(rng::key(9), std::nanf(""), Shape{2}), ValueError);
}

TEST_CASE("randint range, coverage and edge cases") {
  const auto r = rng::randint(rng::key(4), Shape{50000}, -3, 7).to_vector_i32();
  CHECK(*std::min_element(r.begin(), r.end()) == -3);
  CHECK(*std::max_element(r.begin(), r.end()) == 6);
  std::vector<int> counts(10);
  for (int v : r) counts[static_cast<std::size_t>(v + 3)]++;
  for (int c : counts) CHECK(c == doctest::Approx(5000).epsilon(0.1));
  // maxval <= minval gives minval.
  const auto same = rng::randint(rng::key(4), Shape{10}, 5, 5).to_vector_i32();
  CHECK(std::all_of(same.begin(), same.end(), [](int v) { return v == 5; }));
  // Full int32 range (maxval = 2^31): every draw is valid, and both signs appear.
  const auto full = rng::randint(rng::key(4), Shape{1000}, INT32_MIN, 2147483648LL).to_vector_i32();
  CHECK(std::any_of(full.begin(), full.end(), [](int v) { return v < 0; }));
  CHECK(std::any_of(full.begin(), full.end(), [](int v) { return v > 0; }));
  // The two-draw algorithm: with span 8 (a power of two) the result is lower % 8 (multiplier 0).
  const Key k = rng::key(0);
  const auto ks = rng::split(k, 2, Mode::partitionable);
  const auto lower = rng::bits_u32(ks[1], 9, Mode::partitionable);
  const auto p = rng::randint(k, Shape{9}, 0, 8, Mode::partitionable).to_vector_i32();
  for (std::size_t i = 0; i < 9; ++i) CHECK(p[i] == static_cast<std::int32_t>(lower[i] % 8));
}

TEST_CASE("permutation is a permutation, uses JAX's round count, and is deterministic") {
  for (std::int64_t n : {0, 1, 2, 10, 1000, 5000}) {
    const auto p = rng::permutation(rng::key(21), n).to_vector_i32();
    std::vector<std::int32_t> sorted = p;
    std::sort(sorted.begin(), sorted.end());
    for (std::int64_t i = 0; i < n; ++i) REQUIRE(sorted[static_cast<std::size_t>(i)] == i);
    CHECK(rng::permutation(rng::key(21), n).bitwise_equal(rng::permutation(rng::key(21), n)));
  }
  // n = 10 takes one round: a stable sort of 0..9 by bits(split(key)[1], 10).
  for (Mode mode : {Mode::partitionable, Mode::legacy}) {
    const Key k = rng::key(21);
    const auto sort_keys = rng::bits_u32(rng::split(k, 2, mode)[1], 10, mode);
    std::vector<std::int32_t> expect(10);
    for (int i = 0; i < 10; ++i) expect[static_cast<std::size_t>(i)] = i;
    std::stable_sort(expect.begin(), expect.end(), [&](int a, int b) { return sort_keys[static_cast<std::size_t>(a)] < sort_keys[static_cast<std::size_t>(b)]; });
    CHECK(rng::permutation(k, 10, mode).to_vector_i32() == expect);
  }
  CHECK(rng::permutation(rng::key(21), 1000).to_vector_i32() != rng::permutation(rng::key(22), 1000).to_vector_i32());
  CHECK_THROWS_AS(rng::permutation(rng::key(0), -1), ValueError);
}

TEST_CASE("categorical frequencies follow softmax(logits), along any axis") {
  const std::vector<float> probs{0.1f, 0.2f, 0.7f};
  std::vector<float> logits;
  const int rows = 30000;
  for (int r = 0; r < rows; ++r)
    for (float p : probs) logits.push_back(std::log(p) + 3.0f);  // a constant shift changes nothing
  const Array l = Array::from(Shape{rows, 3}, logits);
  const Array s = rng::categorical(rng::key(8), l);
  CHECK(s.shape() == Shape{rows});
  std::vector<int> counts(3);
  for (int v : s.to_vector_i32()) counts[static_cast<std::size_t>(v)]++;
  for (std::size_t c = 0; c < 3; ++c) CHECK(counts[c] / double(rows) == doctest::Approx(probs[c]).epsilon(0.05));
  // axis 0 of the transposed logits: same distribution, result shape (rows,).
  std::vector<float> t(logits.size());
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < 3; ++c) t[static_cast<std::size_t>(c * rows + r)] = logits[static_cast<std::size_t>(r * 3 + c)];
  const Array s0 = rng::categorical(rng::key(8), Array::from(Shape{3, rows}, t), 0);
  CHECK(s0.shape() == Shape{rows});
  std::vector<int> counts0(3);
  for (int v : s0.to_vector_i32()) counts0[static_cast<std::size_t>(v)]++;
  for (std::size_t c = 0; c < 3; ++c) CHECK(counts0[c] / double(rows) == doctest::Approx(probs[c]).epsilon(0.05));
  // It is argmax(logits + gumbel(key, logits.shape)).
  const Array small = Array::from(Shape{2, 4}, {0.1f, 2.0f, -1.0f, 0.5f, 1.0f, 1.0f, 1.0f, 1.0f});
  const auto g = rng::gumbel(rng::key(3), Shape{2, 4}).to_vector();
  const auto sv = small.to_vector();
  const auto got = rng::categorical(rng::key(3), small).to_vector_i32();
  for (int r = 0; r < 2; ++r) {
    int best = 0;
    for (int c = 1; c < 4; ++c)
      if (g[static_cast<std::size_t>(r * 4 + c)] + sv[static_cast<std::size_t>(r * 4 + c)] >
          g[static_cast<std::size_t>(r * 4 + best)] + sv[static_cast<std::size_t>(r * 4 + best)])
        best = c;
    CHECK(got[static_cast<std::size_t>(r)] == best);
  }
  CHECK_THROWS_AS(rng::categorical(rng::key(0), Array::scalar(1.0f)), ShapeError);
  CHECK_THROWS_AS(rng::categorical(rng::key(0), small, 2), ShapeError);
}

TEST_CASE("bits array holds uint32 patterns in int32") {
  const Array b = rng::bits(rng::key(1701), Shape{2, 2}, Mode::legacy);
  CHECK(b.dtype() == DType::i32);
  CHECK(b.shape() == Shape{2, 2});
  CHECK(as_u32(b) == rng::bits_u32(rng::key(1701), 4, Mode::legacy));
}

TEST_CASE("Streams: derivation is deterministic across threads and separates paths, counts and streams") {
  const rng::Streams streams{{"params", rng::key(0)}, {"dropout", rng::key(1)}};
  const std::vector<std::string> a{"Encoder", "Dense_0"}, b{"Encoder", "Dense_1"}, c{"Decoder", "Dense_0"};
  const Key ka1 = streams.derive("dropout", a, 1);
  CHECK(ka1 == rng::fold_in_path(rng::key(1), a, 1));
  std::vector<Key> from_threads(4);
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < 4; ++i) threads.emplace_back([&, i] { from_threads[i] = streams.derive("dropout", a, 1); });
  for (auto& t : threads) t.join();
  for (const Key& k : from_threads) CHECK(k == ka1);
  // A copy, or a Streams with an extra unrelated stream, derives the same key.
  rng::Streams more = streams;
  more.set("noise", rng::key(99));
  CHECK(more.derive("dropout", a, 1) == ka1);
  // Siblings drawn in another order, or with a new sibling in between, get the same keys: each
  // key depends only on (stream, path, count).
  const Key kb1 = streams.derive("dropout", b, 1);
  const std::vector<std::string> added{"Encoder", "Extra_0"};
  (void)streams.derive("dropout", added, 1);
  CHECK(streams.derive("dropout", b, 1) == kb1);
  CHECK(streams.derive("dropout", a, 1) == ka1);
  std::set<std::pair<std::uint32_t, std::uint32_t>> distinct;
  for (const auto* p : {&a, &b, &c})
    for (std::uint64_t count : {1, 2, 3, 256})
      for (const char* s : {"params", "dropout"}) {
        const Key k = streams.derive(s, *p, count);
        distinct.insert({k.hi, k.lo});
      }
  CHECK(distinct.size() == 3 * 4 * 2);
  CHECK(rng::Streams(rng::key(5)).names() == std::vector<std::string>{"params"});
  CHECK(streams.at("params") == rng::key(0));
  CHECK(streams.has("dropout"));
  CHECK_FALSE(streams.has("noise"));
  CHECK(rng::format_path(a) == "Encoder/Dense_0");
  CHECK(rng::format_path(std::vector<std::string>{}) == "<root>");
}

TEST_CASE("Streams: a missing stream is an error naming the stream and the module path") {
  const rng::Streams streams{{"params", rng::key(0)}};
  const std::vector<std::string> path{"Encoder", "Dropout_0"};
  try {
    (void)streams.derive("dropout", path, 1);
    FAIL("expected ValueError");
  } catch (const ValueError& e) {
    const std::string msg = e.what();
    CHECK(msg.find("\"dropout\"") != std::string::npos);
    CHECK(msg.find("Encoder/Dropout_0") != std::string::npos);
    CHECK(msg.find("\"params\"") != std::string::npos);  // what was provided
    CHECK(msg.find("init/apply") != std::string::npos);  // how to fix it
  }
  CHECK_THROWS_AS((void)streams.at("dropout"), ValueError);
  CHECK_THROWS_AS((void)rng::Streams{}.derive("params", path, 1), ValueError);
}
