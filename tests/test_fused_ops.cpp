// Fused ops (attention, normalization, softmax): each against the composed ops it replaces
// (values and gradients), against finite differences, in bf16, and for the memory it saves.
#include <doctest/doctest.h>

#include "testing/fp_modes.hpp"
#include "testing/gradcheck.hpp"
#include "testing/threads.hpp"

#include <linum/core/kernels/gemm.hpp>

#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>


using namespace linum;
using linum::testing::check_gradients;
using linum::testing::random_array;
using V = std::vector<Array>;

namespace {

// The arrays run() returns on one thread, after checking that two threads give the same bits;
// nullopt (with a message) in a build without OpenMP or where no team of two can be had.
std::optional<V> same_bits_on_one_and_two_threads(const std::function<V()>& run) {
  V one, two;
  const bool ran = linum::testing::on_threads(1, [&] { one = run(); }) && linum::testing::on_threads(2, [&] { two = run(); });
  if (!ran) {
    MESSAGE("built without OpenMP (or no team of two): not compared");
    return std::nullopt;
  }
  REQUIRE(one.size() == two.size());
  for (std::size_t i = 0; i < one.size(); ++i) {
    CAPTURE(i);
    CHECK(one[i].bitwise_equal(two[i]));
  }
  return one;
}

// Flax's composed attention: softmax(q k^T / sqrt(d), masked) v through dot_general.
Array composed_attention(const Array& q, const Array& k, const Array& v, const Array& mask) {
  nn::DotProductAttentionOptions o;
  o.mask = mask;
  o.deterministic = true;
  Array w = nn::dot_product_attention_weights(q, k, o);  // [..., h, q, k]
  const int nb = q.rank() - 3;
  std::vector<int> lb, rb;
  for (int i = 0; i < nb; ++i) lb.push_back(i), rb.push_back(i);
  lb.push_back(nb);
  rb.push_back(nb + 1);
  Array y = dot_general(w, v, DotDims{.lhs_contracting = {nb + 2}, .rhs_contracting = {nb}, .lhs_batch = lb, .rhs_batch = rb});
  std::vector<int> perm;
  for (int i = 0; i < nb; ++i) perm.push_back(i);
  perm.push_back(nb + 1);
  perm.push_back(nb);
  perm.push_back(nb + 2);
  return transpose(y, perm);
}

float max_abs_diff(const Array& a, const Array& b) {
  REQUIRE(a.shape() == b.shape());
  const auto x = a.to_vector(), y = b.to_vector();
  float m = 0;
  for (std::size_t i = 0; i < x.size(); ++i) m = std::max(m, std::abs(x[i] - y[i]));
  return m;
}

// Gradients of sum(f(q, k, v) * r) with respect to q, k, v.
V attention_grads(const std::function<Array(const V&)>& f, const V& inputs, const Array& r) {
  auto [value, grads] = value_and_grad([&](const V& in) { return sum(f(in) * r); })(inputs);
  (void)value;
  return grads;
}

}  // namespace

TEST_CASE("fused attention equals the composed attention: no mask, causal, padding mask, both") {
  // [batch 2, length 70 (two query blocks, the second partial), heads 3, depth 8]; values depth 5.
  const Array q = random_array(Shape{2, 70, 3, 8}, 1), k = random_array(Shape{2, 70, 3, 8}, 2);
  const Array v = random_array(Shape{2, 70, 3, 5}, 3);
  const Array r = random_array(Shape{2, 70, 3, 5}, 4);
  const Array causal = nn::make_causal_mask(Array::zeros(Shape{2, 70}));
  // Padding: batch 0 sees all keys, batch 1 only the first 50.
  std::vector<float> valid(2 * 70, 1.0f);
  for (int j = 50; j < 70; ++j) valid[70 + static_cast<std::size_t>(j)] = 0.0f;
  const Array padding = nn::make_attention_mask(Array::ones(Shape{2, 70}), Array::from(Shape{2, 70}, valid));
  struct Case {
    const char* name;
    Array mask;       // for the composed reference
    Array fused_mask;
    bool causal;
  };
  const std::vector<Case> cases = {
      {"no mask", Array(), Array(), false},
      {"is_causal", causal, Array(), true},
      {"causal mask array", causal, causal, false},
      {"padding mask", padding, padding, false},
      {"padding and is_causal", nn::combine_masks({padding, causal}), padding, true},
  };
  for (const Case& c : cases) {
    CAPTURE(c.name);
    auto fused = [&](const V& in) {
      return scaled_dot_product_attention(in[0], in[1], in[2], {.mask = c.fused_mask, .is_causal = c.causal});
    };
    auto reference = [&](const V& in) { return composed_attention(in[0], in[1], in[2], c.mask); };
    CHECK(max_abs_diff(fused({q, k, v}), reference({q, k, v})) < 2e-6f);
    const V gf = attention_grads(fused, {q, k, v}, r), gr = attention_grads(reference, {q, k, v}, r);
    for (int i = 0; i < 3; ++i) CHECK(max_abs_diff(gf[static_cast<std::size_t>(i)], gr[static_cast<std::size_t>(i)]) < 2e-5f);
  }
}

TEST_CASE("fused attention against finite differences") {
  const V in = {random_array(Shape{1, 6, 2, 4}, 5), random_array(Shape{1, 7, 2, 4}, 6), random_array(Shape{1, 7, 2, 3}, 7)};
  CHECK(check_gradients("attention", [](const V& v) { return scaled_dot_product_attention(v[0], v[1], v[2]); }, in));
  CHECK(check_gradients("attention causal",
                        [](const V& v) { return scaled_dot_product_attention(v[0], v[1], v[2], {.is_causal = true}); }, in));
  const Array mask = Array::from(Shape{6, 7}, {1, 0, 1, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0,
                                               1, 0, 0, 0, 0, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 1, 1, 1, 1, 1, 1});
  CHECK(check_gradients("attention masked, scale 0.3", [&](const V& v) {
    return scaled_dot_product_attention(v[0], v[1], v[2], {.mask = mask, .scale = 0.3f});
  }, in));
}

TEST_CASE("fused attention: a query with nothing to attend to averages the values, as Flax") {
  const Array q = random_array(Shape{1, 2, 1, 4}, 8), k = random_array(Shape{1, 3, 1, 4}, 9);
  const Array v = Array::from(Shape{1, 3, 1, 2}, {1, 10, 2, 20, 6, 60});
  const Array mask = Array::from(Shape{2, 3}, {1, 1, 0, 0, 0, 0});  // query 1 sees nothing
  const Array y = scaled_dot_product_attention(q, k, v, {.mask = mask});
  CHECK(y.to_vector()[2] == doctest::Approx(3.0f));
  CHECK(y.to_vector()[3] == doctest::Approx(30.0f));
  CHECK(max_abs_diff(y, composed_attention(q, k, v, mask)) < 1e-6f);
  // Its logits were constants: no gradient reaches q through them, and k only through query 0.
  const V g = attention_grads([&](const V& in) { return scaled_dot_product_attention(in[0], in[1], in[2], {.mask = mask}); },
                              {q, k, v}, Array::ones(Shape{1, 2, 1, 2}));
  const auto gq = g[0].to_vector();
  CHECK(gq[4] == 0.0f);
  CHECK(gq[7] == 0.0f);
}

TEST_CASE("fused attention keeps no [batch, heads, q, k] array for backward") {
  const Array q = random_array(Shape{2, 128, 2, 16}, 10), k = random_array(Shape{2, 128, 2, 16}, 11);
  const Array v = random_array(Shape{2, 128, 2, 16}, 12);
  const std::int64_t weights_bytes = 2 * 2 * 128 * 128 * 4;
  auto peak = [&](const std::function<Array(const V&)>& f) {
    memory::PeakScope scope;
    auto g = grad([&](const V& in) { return sum(f(in)); })(V{q, k, v});
    return scope.peak_growth();
  };
  const std::int64_t fused = peak([](const V& in) { return scaled_dot_product_attention(in[0], in[1], in[2], {.is_causal = true}); });
  const Array causal = nn::make_causal_mask(Array::zeros(Shape{2, 128}));
  const std::int64_t composed = peak([&](const V& in) { return composed_attention(in[0], in[1], in[2], causal); });
  // q, k, v, the output and gradients: 7 arrays of 64 KiB; the composed version holds several
  // weight-sized arrays (256 KiB each) at once.
  CHECK(fused < weights_bytes);
  CHECK(composed > 2 * weights_bytes);
}

TEST_CASE("fused attention in bf16 follows float32 to bf16 precision; gradients come back in bf16") {
  const Array q = random_array(Shape{2, 40, 2, 8}, 13), k = random_array(Shape{2, 40, 2, 8}, 14);
  const Array v = random_array(Shape{2, 40, 2, 8}, 15);
  auto f = [](const V& in) { return scaled_dot_product_attention(in[0], in[1], in[2], {.is_causal = true}); };
  const V b = {astype(q, DType::bf16), astype(k, DType::bf16), astype(v, DType::bf16)};
  const Array y16 = f(b);
  CHECK(y16.dtype() == DType::bf16);
  CHECK(max_abs_diff(astype(y16, DType::f32), f({astype(b[0], DType::f32), astype(b[1], DType::f32), astype(b[2], DType::f32)})) <
        1e-2f);
  const V g = attention_grads(f, b, Array::full(Shape{2, 40, 2, 8}, 1.0f, DType::bf16));
  for (const Array& x : g) CHECK(x.dtype() == DType::bf16);
  // Mixed dtypes promote as JAX does.
  CHECK(f({q, b[1], b[2]}).dtype() == DType::f32);
}

TEST_CASE("bf16 packed products equal the float64 product of the bf16 values (tails, odd depth, transposed B, accumulate)") {
  struct Case { std::int64_t m, n, k; };
  for (const Case c : {Case{1, 1, 1}, Case{7, 33, 5}, Case{8, 32, 64}, Case{13, 50, 17}, Case{64, 64, 64}, Case{9, 17, 2},
                       Case{3, 5, 0}}) {
    for (bool tb : {false, true}) {
      for (float beta : {0.0f, 1.0f}) {
        CAPTURE(c.m); CAPTURE(c.n); CAPTURE(c.k); CAPTURE(tb); CAPTURE(beta);
        const std::int64_t lda = c.k + 3, ldb = (tb ? c.k : c.n) + 2, ldc = c.n + 1, ldp = c.n + 4;
        const auto a32 = random_array(Shape{c.m, lda}, 40).to_vector();
        const auto b32 = random_array(Shape{tb ? c.n : c.k, ldb}, 41).to_vector();
        std::vector<bfloat16> a(a32.size()), b(b32.size());
        for (std::size_t i = 0; i < a.size(); ++i) a[i] = bfloat16(a32[i]);
        for (std::size_t i = 0; i < b.size(); ++i) b[i] = bfloat16(b32[i]);
        // Whatever lies past column k of A (here NaN) must not reach the result.
        for (std::int64_t i = 0; i < c.m; ++i) a[static_cast<std::size_t>(i * lda + c.k)] = bfloat16(NAN);
        std::vector<std::uint32_t> packed(static_cast<std::size_t>((c.k + 1) / 2 * ldp + 1));
        kernels::pack_bf16_pairs(b.data(), ldb, tb, c.k, c.n, packed.data(), ldp);
        std::vector<float> out(static_cast<std::size_t>(c.m * ldc), 0.25f);
        kernels::gemm_bf16_packed_serial(c.m, c.n, c.k, 0.5f, a.data(), lda, packed.data(), ldp, beta, out.data(), ldc);
        double worst = 0;
        for (std::int64_t i = 0; i < c.m; ++i)
          for (std::int64_t j = 0; j < c.n; ++j) {
            double exact = 0, magnitude = 0;
            for (std::int64_t kk = 0; kk < c.k; ++kk) {
              const double x = static_cast<float>(a[static_cast<std::size_t>(i * lda + kk)]);
              const double y = static_cast<float>(b[static_cast<std::size_t>(tb ? j * ldb + kk : kk * ldb + j)]);
              exact += x * y;
              magnitude += std::abs(x * y);
            }
            exact = 0.5 * exact + (beta != 0.0f ? 0.25 : 0.0);
            const double got = out[static_cast<std::size_t>(i * ldc + j)];
            worst = std::max(worst, std::abs(got - exact) / (magnitude + 1.0));
          }
        CHECK(worst < 1e-6);  // float32 accumulation of exact bf16 products
        for (std::int64_t i = 0; i < c.m; ++i) CHECK(out[static_cast<std::size_t>(i * ldc + c.n)] == 0.25f);  // no write past n
      }
    }
  }
}

TEST_CASE("bf16 panel products: the float64 product of the bf16 values (+ bias) rounded once; tails, odd depth, transposes") {
  // gemm_bf16_panels, the engine's whole-array bf16 kernel: rows around its 14-row tile, columns
  // around its 32-column panel, odd and empty depths, either operand transposed, with and without a
  // bias; nothing written past the output. Its pair epilogue (the fused linear layer's activation)
  // gives exactly the table's entry for each value it would have written.
  if (!kernels::bf16_panels_available()) {
    MESSAGE("built without AVX512-BF16: no panel kernel to test");
    return;
  }
  std::vector<std::uint32_t> table(65536);
  for (std::uint32_t i = 0; i < 65536; ++i) table[i] = i * 2654435761u;
  struct Case { std::int64_t m, n, k; };
  // (Case{30, 200, 2048}: 7 panels of 128 KB, in two groups of 4; Case{230, 40, 71}: 17 row tiles,
  // two scheduling items of four tiles, then nine single tiles; Case{168, 33, 4097}: 12 row tiles,
  // one item of four then single tiles, in each of two panel groups of one panel, an odd depth,
  // and enough work for the whole team; Case{15, 48, 67} and Case{15, 16, 64}: a transposed right
  // operand's panel packed by 16 x 16 register transposes, then its leftover rows and pairs one by
  // one, and a panel of exactly 16 columns)
  for (const Case c : {Case{1, 1, 1}, Case{13, 33, 5}, Case{14, 32, 64}, Case{15, 17, 2}, Case{29, 70, 513}, Case{3, 5, 0},
                       Case{57, 96, 130}, Case{28, 16, 3}, Case{30, 200, 2048}, Case{230, 40, 71}, Case{168, 33, 4097},
                       Case{15, 48, 67}, Case{15, 16, 64}}) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        for (bool with_bias : {false, true}) {
          CAPTURE(c.m); CAPTURE(c.n); CAPTURE(c.k); CAPTURE(ta); CAPTURE(tb); CAPTURE(with_bias);
          auto values = [](std::int64_t count, unsigned seed) {
            const auto v = random_array(Shape{std::max<std::int64_t>(count, 1)}, seed).to_vector();
            std::vector<bfloat16> out(static_cast<std::size_t>(count));
            for (std::size_t i = 0; i < out.size(); ++i) out[i] = bfloat16(v[i]);
            return out;
          };
          // a NaN right after each operand: padding past an odd depth or a last row must be zeros,
          // never what lies next to the operand in memory (0 * NaN would show in the product)
          auto a = values(c.m * c.k, 50), b = values(c.k * c.n, 51);
          const auto bias = values(c.n, 52);
          for (auto* v : {&a, &b}) v->emplace_back().bits = 0x7fc0;
          auto at = [&](std::int64_t i, std::int64_t kk) {
            return static_cast<double>(static_cast<float>(a[static_cast<std::size_t>(ta ? kk * c.m + i : i * c.k + kk)]));
          };
          auto bt = [&](std::int64_t kk, std::int64_t j) {
            return static_cast<double>(static_cast<float>(b[static_cast<std::size_t>(tb ? j * c.k + kk : kk * c.n + j)]));
          };
          const std::size_t size = static_cast<std::size_t>(c.m * c.n);
          // one guard element before the output and one past it: both must stay
          std::vector<bfloat16> zs(size + 2), ys(size + 2), ds(size + 2);
          for (auto* v : {&zs, &ys, &ds}) v->front().bits = v->back().bits = 0x7fc1;
          bfloat16 *z = zs.data() + 1, *y = ys.data() + 1, *d = ds.data() + 1;
          const bfloat16* bias_ptr = with_bias ? bias.data() : nullptr;
          kernels::gemm_bf16_panels(c.m, c.n, c.k, a.data(), ta, b.data(), tb, bias_ptr, kernels::Bf16ProductOut{.z = z});
          kernels::gemm_bf16_panels(c.m, c.n, c.k, a.data(), ta, b.data(), tb, bias_ptr,
                                    kernels::Bf16ProductOut{.pair_table = table.data(), .y = y, .d = d});
          double worst = 0;
          bool pairs_equal = true, all_finite = true;
          for (std::int64_t i = 0; i < c.m; ++i)
            for (std::int64_t j = 0; j < c.n; ++j) {
              double exact = with_bias ? static_cast<float>(bias[static_cast<std::size_t>(j)]) : 0.0, magnitude = std::abs(exact);
              for (std::int64_t kk = 0; kk < c.k; ++kk) {
                exact += at(i, kk) * bt(kk, j);
                magnitude += std::abs(at(i, kk) * bt(kk, j));
              }
              const bfloat16 got = z[static_cast<std::size_t>(i * c.n + j)];
              all_finite = all_finite && std::isfinite(static_cast<float>(got));
              // one bf16 rounding (half a unit: 2^-8 relative) of a float32 sum
              worst = std::max(worst, std::abs(static_cast<float>(got) - exact) / (std::abs(exact) / 256 + 1e-5 * (magnitude + 1)));
              const std::uint32_t entry = table[got.bits];
              pairs_equal = pairs_equal && y[static_cast<std::size_t>(i * c.n + j)].bits == static_cast<std::uint16_t>(entry) &&
                            d[static_cast<std::size_t>(i * c.n + j)].bits == static_cast<std::uint16_t>(entry >> 16);
            }
          CHECK(worst <= 1.0);
          CHECK(all_finite);
          CHECK(pairs_equal);
          for (auto* v : {&zs, &ys, &ds}) CHECK((v->front().bits == 0x7fc1 && v->back().bits == 0x7fc1));
          // The same values widened to float32 (Bf16ProductOut::z_f32), guards kept.
          std::vector<float> wide(size + 2, -7.0f);
          kernels::gemm_bf16_panels(c.m, c.n, c.k, a.data(), ta, b.data(), tb, bias_ptr, kernels::Bf16ProductOut{.z_f32 = wide.data() + 1});
          bool widened = wide.front() == -7.0f && wide.back() == -7.0f;
          for (std::size_t i = 0; i < size; ++i) widened = widened && std::bit_cast<std::uint32_t>(wide[i + 1]) == std::uint32_t{z[i].bits} << 16;
          CHECK(widened);
          linum::testing::in_both_fp_modes([&] {
            // Each value times a scale [m, n] (Bf16ProductOut::scale), rounded again as bfloat16()
            // rounds (a subnormal product kept without flushing, a NaN scale giving a NaN), and
            // each row tile's column sums of the products, rows in order from zero; guards kept.
            auto scale = values(c.m * c.n, 54);
            if (size > 0) scale[0].bits = 0x0080;  // 2^-126: its product with a value below 1 is subnormal
            if (size > 1) scale[1].bits = 0x7fc0;  // NaN
            const std::int64_t tiles = (c.m + kernels::kScaledSumRows - 1) / kernels::kScaledSumRows;
            std::vector<bfloat16> scaled(size + 2), scaled_alone(size + 2);
            for (auto* v : {&scaled, &scaled_alone}) v->front().bits = v->back().bits = 0x7fc1;
            std::vector<float> sums(static_cast<std::size_t>(tiles * c.n) + 2, -7.0f), want_sums(sums.size() - 2, 0.0f);
            kernels::gemm_bf16_panels(c.m, c.n, c.k, a.data(), ta, b.data(), tb, bias_ptr,
                                      kernels::Bf16ProductOut{.z = scaled.data() + 1, .scale = scale.data(),
                                                              .tile_sums = sums.data() + 1});
            kernels::gemm_bf16_panels(c.m, c.n, c.k, a.data(), ta, b.data(), tb, bias_ptr,
                                      kernels::Bf16ProductOut{.z = scaled_alone.data() + 1, .scale = scale.data()});
            bool same = sums.front() == -7.0f && sums.back() == -7.0f;
            for (auto* v : {&scaled, &scaled_alone}) same = same && v->front().bits == 0x7fc1 && v->back().bits == 0x7fc1;
            for (std::int64_t i = 0; i < c.m; ++i)
              for (std::int64_t j = 0; j < c.n; ++j) {
                const std::size_t e = static_cast<std::size_t>(i * c.n + j);
                const float product = static_cast<float>(z[e]) * static_cast<float>(scale[e]);
                same = same && scaled[e + 1].bits == bfloat16::round_bits(product) && scaled_alone[e + 1].bits == scaled[e + 1].bits;
                want_sums[static_cast<std::size_t>(i / kernels::kScaledSumRows * c.n + j)] += product;
              }
            for (std::size_t i = 0; i < want_sums.size(); ++i)
              same = same && std::bit_cast<std::uint32_t>(sums[i + 1]) == std::bit_cast<std::uint32_t>(want_sums[i]);
            CHECK(same);
            // Selecting instead (scale_selects, relu's rule from its output): each value where the
            // scale's is > 0 (not NaN), else +0, not rounded again; the sums of those.
            std::vector<bfloat16> selected(size + 2);
            selected.front().bits = selected.back().bits = 0x7fc1;
            std::vector<float> select_sums(sums.size(), -7.0f), want_select(want_sums.size(), 0.0f);
            kernels::gemm_bf16_panels(c.m, c.n, c.k, a.data(), ta, b.data(), tb, bias_ptr,
                                      kernels::Bf16ProductOut{.z = selected.data() + 1, .scale = scale.data(),
                                                              .tile_sums = select_sums.data() + 1, .scale_selects = true});
            bool selects = selected.front().bits == 0x7fc1 && selected.back().bits == 0x7fc1 && select_sums.front() == -7.0f &&
                           select_sums.back() == -7.0f;
            for (std::int64_t i = 0; i < c.m; ++i)
              for (std::int64_t j = 0; j < c.n; ++j) {
                const std::size_t e = static_cast<std::size_t>(i * c.n + j);
                const float picked = static_cast<float>(scale[e]) > 0.0f ? static_cast<float>(z[e]) : 0.0f;
                selects = selects && selected[e + 1].bits == bfloat16::round_bits(picked);
                want_select[static_cast<std::size_t>(i / kernels::kScaledSumRows * c.n + j)] += picked;
              }
            for (std::size_t i = 0; i < want_select.size(); ++i)
              selects = selects && std::bit_cast<std::uint32_t>(select_sums[i + 1]) == std::bit_cast<std::uint32_t>(want_select[i]);
            CHECK(selects);
          });
          if (!ta && !tb && c.k > 0) {
            // b given in float32, not yet rounded (halfway values and a subnormal among them): rounded
            // while packed, f32_to_bf16's bits, and the product of the rounded b.
            auto b32 = random_array(Shape{c.k * c.n}, 53).to_vector();
            b32[0] = 1.0f + 1.0f / 256.0f;
            if (b32.size() > 1) b32[1] = 1e-40f;
            std::vector<bfloat16> want_b(b32.size()), got_b(b32.size() + 1);
            got_b.back().bits = 0x7fc1;
            linum::f32_to_bf16(b32.data(), want_b.data(), static_cast<std::int64_t>(b32.size()));
            std::vector<bfloat16> z1(size), z2(size);
            kernels::gemm_bf16_panels(c.m, c.n, c.k, a.data(), false, want_b.data(), false, bias_ptr, kernels::Bf16ProductOut{.z = z1.data()});
            kernels::gemm_bf16_panels_f32_b(c.m, c.n, c.k, a.data(), b32.data(), got_b.data(), bias_ptr, kernels::Bf16ProductOut{.z = z2.data()});
            bool same = got_b.back().bits == 0x7fc1;
            for (std::size_t i = 0; i < b32.size(); ++i) same = same && got_b[i].bits == want_b[i].bits;
            for (std::size_t i = 0; i < size; ++i) same = same && z1[i].bits == z2[i].bits;
            CHECK(same);
          }
        }
      }
    }
  }
}

TEST_CASE("bf16 panel products have the same bits on one thread and on two, through the engine's products") {
  // Each element is summed on one thread in a fixed order, so the team's size cannot change a bit:
  // the forward product and its transposed-operand forms (the backward rule's products).
  const Array x = astype(random_array(Shape{430, 130}, 60), DType::bf16), w = astype(random_array(Shape{130, 96}, 61), DType::bf16);
  const Array g = astype(random_array(Shape{430, 96}, 62), DType::bf16);
  if (!kernels::uses_bf16_panels(x, false, w, false) || !kernels::uses_bf16_panels(g, false, w, true) ||
      !kernels::uses_bf16_panels(x, true, g, false)) {
    MESSAGE("this engine or build has no bf16 panel kernel: not run");
    return;
  }
  auto run = [&] {
    return std::vector<Array>{kernels::batched_gemm(x, w, false, false), kernels::batched_gemm(g, w, false, true),
                              kernels::batched_gemm(x, g, true, false)};
  };
  const std::optional<V> compared = same_bits_on_one_and_two_threads(run);
  const V one = compared ? *compared : run();  // (the values are checked either way)
  // and the values: the float32 product of the same bf16 values, rounded (within one bf16 rounding)
  auto f32 = [](const Array& a) { return astype(a, DType::f32); };
  const Array want[] = {matmul(f32(x), f32(w)), matmul(f32(g), transpose(f32(w))), matmul(transpose(f32(x)), f32(g))};
  for (std::size_t i = 0; i < one.size(); ++i) {
    CAPTURE(i);
    CHECK(max(abs(f32(one[i]) - want[i])).item() <= max(abs(want[i])).item() / 128);
  }
}

TEST_CASE("f32 panel products: the float64 product within float32 summation error; tails, transposes; the same bits transposed") {
  // gemm_f32_panels, the engine's whole-array float32 kernel: rows around its 14-row tile, columns
  // around its 32-column panel, odd and empty depths, either operand transposed, with and without a
  // bias; nothing written past the output. Each element is summed over k in order whatever the
  // layout, so an operand given transposed gives the same bits as its untransposed copy.
  if (!kernels::f32_panels_available()) {
    MESSAGE("built without AVX-512: no float32 panel kernel to test");
    return;
  }
  struct Case { std::int64_t m, n, k; };
  // (Case{230, 40, 71}: 17 row tiles, items of four then single tiles; Case{90, 200, 2048}: 7 panels
  // of 256 KB, in groups of two; Case{168, 33, 1500}: enough work for the whole team; Case{168, 33,
  // 4097}: 12 row tiles, one item of four then single tiles, in each of two panel groups of one)
  for (const Case c : {Case{1, 1, 1}, Case{13, 33, 5}, Case{14, 32, 64}, Case{15, 17, 2}, Case{29, 70, 513}, Case{3, 5, 0},
                       Case{57, 96, 130}, Case{28, 16, 3}, Case{90, 200, 2048}, Case{230, 40, 71}, Case{168, 33, 1500},
                       Case{168, 33, 4097}}) {
    // a NaN right after each operand: nothing the kernel reads next to an operand may reach the
    // product (0 * NaN would show in it)
    auto values = [](std::int64_t count, unsigned seed) {
      auto v = random_array(Shape{std::max<std::int64_t>(count, 1)}, seed).to_vector();
      v.resize(static_cast<std::size_t>(count));
      v.push_back(std::numeric_limits<float>::quiet_NaN());
      return v;
    };
    const auto a = values(c.m * c.k, 70), b = values(c.k * c.n, 71), bias = values(c.n, 72);
    // the same operands transposed (a^T [k, m], b^T [n, k])
    auto transposed = [](const std::vector<float>& x, std::int64_t rows, std::int64_t cols) {
      std::vector<float> t(static_cast<std::size_t>(rows * cols) + 1, std::numeric_limits<float>::quiet_NaN());
      for (std::int64_t i = 0; i < rows; ++i)
        for (std::int64_t j = 0; j < cols; ++j) t[static_cast<std::size_t>(j * rows + i)] = x[static_cast<std::size_t>(i * cols + j)];
      return t;
    };
    const auto at = transposed(a, c.m, c.k), bt = transposed(b, c.k, c.n);
    const std::size_t size = static_cast<std::size_t>(c.m * c.n);
    for (bool with_bias : {false, true}) {
      const float* bias_ptr = with_bias ? bias.data() : nullptr;
      std::vector<std::vector<float>> outs;
      for (bool ta : {false, true}) {
        for (bool tb : {false, true}) {
          CAPTURE(c.m); CAPTURE(c.n); CAPTURE(c.k); CAPTURE(ta); CAPTURE(tb); CAPTURE(with_bias);
          // one guard element before the output and one past it: both must stay
          std::vector<float> zs(size + 2, -7.0f);
          kernels::gemm_f32_panels(c.m, c.n, c.k, (ta ? at : a).data(), ta, (tb ? bt : b).data(), tb, bias_ptr, zs.data() + 1);
          CHECK((zs.front() == -7.0f && zs.back() == -7.0f));
          outs.emplace_back(zs.begin() + 1, zs.end() - 1);
          double worst = 0;
          bool all_finite = true;
          for (std::int64_t i = 0; i < c.m; ++i)
            for (std::int64_t j = 0; j < c.n; ++j) {
              double exact = with_bias ? bias[static_cast<std::size_t>(j)] : 0.0, magnitude = std::abs(exact);
              for (std::int64_t kk = 0; kk < c.k; ++kk) {
                const double term = static_cast<double>(a[static_cast<std::size_t>(i * c.k + kk)]) * b[static_cast<std::size_t>(kk * c.n + j)];
                exact += term;
                magnitude += std::abs(term);
              }
              const float got = outs.back()[static_cast<std::size_t>(i * c.n + j)];
              all_finite = all_finite && std::isfinite(got);
              // a float32 sum of k + 1 terms: at most (k + 1) roundings of 2^-24 of the running magnitude
              worst = std::max(worst, std::abs(got - exact) / (static_cast<double>(c.k + 2) * 0x1p-24 * magnitude + 1e-30));
            }
          CHECK(worst <= 1.0);
          CHECK(all_finite);
          // Times a scale [m, n] (a NaN among it), and each row tile's column sums of the products,
          // rows in order from zero: the plain product's elements multiplied, bitwise; guards kept.
          auto scale = values(c.m * c.n, 73);
          if (size > 1) scale[1] = std::numeric_limits<float>::quiet_NaN();
          const std::int64_t tiles = (c.m + kernels::kScaledSumRows - 1) / kernels::kScaledSumRows;
          std::vector<float> scaled(size + 2, -7.0f), sums(static_cast<std::size_t>(tiles * c.n) + 2, -7.0f),
              want_sums(sums.size() - 2, 0.0f);
          kernels::gemm_f32_panels(c.m, c.n, c.k, (ta ? at : a).data(), ta, (tb ? bt : b).data(), tb, bias_ptr,
                                   scaled.data() + 1, scale.data(), sums.data() + 1);
          bool same = scaled.front() == -7.0f && scaled.back() == -7.0f && sums.front() == -7.0f && sums.back() == -7.0f;
          for (std::int64_t i = 0; i < c.m; ++i)
            for (std::int64_t j = 0; j < c.n; ++j) {
              const std::size_t e = static_cast<std::size_t>(i * c.n + j);
              const float product = outs.back()[e] * scale[e];
              same = same && std::bit_cast<std::uint32_t>(scaled[e + 1]) == std::bit_cast<std::uint32_t>(product);
              want_sums[static_cast<std::size_t>(i / kernels::kScaledSumRows * c.n + j)] += product;
            }
          for (std::size_t i = 0; i < want_sums.size(); ++i)
            same = same && std::bit_cast<std::uint32_t>(sums[i + 1]) == std::bit_cast<std::uint32_t>(want_sums[i]);
          CHECK(same);
          // Selecting instead (relu's rule from its output): each element where the scale's is > 0
          // (not NaN), else +0; the sums of those.
          std::vector<float> selected(size + 2, -7.0f), select_sums(sums.size(), -7.0f), want_select(want_sums.size(), 0.0f);
          kernels::gemm_f32_panels(c.m, c.n, c.k, (ta ? at : a).data(), ta, (tb ? bt : b).data(), tb, bias_ptr,
                                   selected.data() + 1, scale.data(), select_sums.data() + 1, true);
          bool selects = selected.front() == -7.0f && selected.back() == -7.0f && select_sums.front() == -7.0f &&
                         select_sums.back() == -7.0f;
          for (std::int64_t i = 0; i < c.m; ++i)
            for (std::int64_t j = 0; j < c.n; ++j) {
              const std::size_t e = static_cast<std::size_t>(i * c.n + j);
              const float picked = scale[e] > 0.0f ? outs.back()[e] : 0.0f;
              selects = selects && std::bit_cast<std::uint32_t>(selected[e + 1]) == std::bit_cast<std::uint32_t>(picked);
              want_select[static_cast<std::size_t>(i / kernels::kScaledSumRows * c.n + j)] += picked;
            }
          for (std::size_t i = 0; i < want_select.size(); ++i)
            selects = selects && std::bit_cast<std::uint32_t>(select_sums[i + 1]) == std::bit_cast<std::uint32_t>(want_select[i]);
          CHECK(selects);
        }
      }
      for (std::size_t v = 1; v < outs.size(); ++v) {
        CAPTURE(v);
        CHECK(outs[v] == outs[0]);
      }
    }
  }
}

TEST_CASE("widened bf16 panel products: the float32 panel product of the widened operands, rounded once, bit for bit") {
  // gemm_f32_panels_widened, what bf16_products() == widened runs on the float32 panel kernel's
  // shapes: bf16 operands widened as they are read, each result rounded once. Against
  // gemm_f32_panels on widened copies and bfloat16's rounding: the same tails and depths as above,
  // b transposed or not, with and without a bias; special values (infinities, NaNs, subnormal
  // operands and results) among the operands; nothing read past them, nothing written past the output.
  if (!kernels::f32_panels_widened_available()) {
    MESSAGE("built without AVX-512BW: no widened bf16 panel kernel to test");
    return;
  }
  struct Case { std::int64_t m, n, k; };
  for (const Case c : {Case{1, 1, 1}, Case{13, 33, 5}, Case{14, 32, 64}, Case{15, 17, 2}, Case{29, 70, 513}, Case{3, 5, 0},
                       Case{57, 96, 130}, Case{90, 200, 2048}, Case{230, 40, 71}, Case{168, 33, 1500}}) {
    CAPTURE(c.m); CAPTURE(c.n); CAPTURE(c.k);
    // bf16 operands and a NaN right after each (0 * NaN would show in the product)
    // (special, for a [m, k]: row 1 small enough that many of its results are subnormal; subnormal operands, infinities and a NaN in row 0)
    auto values = [&c](std::int64_t count, unsigned seed, bool special) {
      auto v = random_array(Shape{std::max<std::int64_t>(count, 1)}, seed).to_vector();
      const IeeeSubnormalScope ieee;  // (this thread's flushing would zero the scaled values)
      v.resize(static_cast<std::size_t>(count));
      if (special && c.m >= 2)
        for (std::int64_t i = c.k; i < 2 * c.k; ++i)
          v[static_cast<std::size_t>(i)] *= 0x1p-126f / std::sqrt(static_cast<float>(c.k));
      if (special && c.k > 40) {
        v[3] = std::numeric_limits<float>::infinity();
        v[11] = -std::numeric_limits<float>::infinity();
        v[17] = std::numeric_limits<float>::quiet_NaN();
        for (std::size_t i = 20; i < 40; ++i) v[i] *= 0x1p-130f;
      }
      std::vector<bfloat16> out;
      for (float x : v) out.emplace_back(x);
      out.emplace_back(std::numeric_limits<float>::quiet_NaN());
      return out;
    };
    auto widen = [](const std::vector<bfloat16>& x) {
      std::vector<float> out;
      for (bfloat16 v : x) out.push_back(static_cast<float>(v));
      return out;
    };
    const auto a = values(c.m * c.k, 80, true), b = values(c.k * c.n, 81, false), bias16 = values(c.n, 82, false);
    std::vector<bfloat16> bt(static_cast<std::size_t>(c.k * c.n) + 1, bfloat16(std::numeric_limits<float>::quiet_NaN()));
    for (std::int64_t i = 0; i < c.k; ++i)
      for (std::int64_t j = 0; j < c.n; ++j) bt[static_cast<std::size_t>(j * c.k + i)] = b[static_cast<std::size_t>(i * c.n + j)];
    auto scale = values(c.m * c.n, 87, false);
    if (c.m * c.n > 1) scale[1] = bfloat16(std::numeric_limits<float>::quiet_NaN());
    const auto a32 = widen(a), b32 = widen(b), bt32 = widen(bt), bias = widen(bias16);
    const std::size_t size = static_cast<std::size_t>(c.m * c.n);
    // (in both floating-point modes: subnormal results only with IEEE subnormals)
    linum::testing::in_both_fp_modes([&] {
    for (bool with_bias : {false, true}) {
      for (bool tb : {false, true}) {
        CAPTURE(with_bias); CAPTURE(tb); CAPTURE(flush_denormals());
        const float* bias_ptr = with_bias ? bias.data() : nullptr;
        std::vector<float> want(size);
        kernels::gemm_f32_panels(c.m, c.n, c.k, a32.data(), false, (tb ? bt32 : b32).data(), tb, bias_ptr, want.data());
        std::vector<bfloat16> got(size + 2, bfloat16(-7.0f));
        kernels::gemm_f32_panels_widened(c.m, c.n, c.k, a.data(), (tb ? bt : b).data(), tb, bias_ptr, got.data() + 1);
        bool same = got.front().bits == bfloat16(-7.0f).bits && got.back().bits == bfloat16(-7.0f).bits;
        int subnormal = 0;
        for (std::size_t e = 0; e < size; ++e) {
          same = same && got[e + 1].bits == bfloat16::round_bits(want[e]);
          subnormal += std::fpclassify(want[e]) == FP_SUBNORMAL;
        }
        CHECK(same);
        if (!flush_denormals() && c.m >= 2 && c.k >= 2 && c.n >= 17 && !with_bias) CHECK(subnormal > 0);  // some were rounded
        // Times a bf16 scale (a NaN among it) or selected by it, and the row tiles' column sums:
        // the rounded result times the scale, rounded again (selected: exact), the sums of those
        // products before their rounding (Bf16ProductOut::scale); guards kept.
        const std::int64_t tiles = (c.m + kernels::kScaledSumRows - 1) / kernels::kScaledSumRows;
        for (bool selects : {false, true}) {
          CAPTURE(selects);
          std::vector<bfloat16> scaled(size + 2, bfloat16(-7.0f));
          std::vector<float> sums(static_cast<std::size_t>(tiles * c.n) + 2, -7.0f), want_sums(sums.size() - 2, 0.0f);
          kernels::gemm_f32_panels_widened(c.m, c.n, c.k, a.data(), (tb ? bt : b).data(), tb, bias_ptr, scaled.data() + 1,
                                           scale.data(), sums.data() + 1, selects);
          bool right = scaled.front().bits == bfloat16(-7.0f).bits && scaled.back().bits == bfloat16(-7.0f).bits &&
                       sums.front() == -7.0f && sums.back() == -7.0f;
          for (std::int64_t i = 0; i < c.m; ++i)
            for (std::int64_t j = 0; j < c.n; ++j) {
              const std::size_t e = static_cast<std::size_t>(i * c.n + j);
              const bfloat16 z = bfloat16(want[e]);
              const float sv = static_cast<float>(scale[e]);
              const float product = selects ? (sv > 0.0f ? static_cast<float>(z) : 0.0f) : static_cast<float>(z) * sv;
              const std::uint16_t bits = selects ? (sv > 0.0f ? z.bits : std::uint16_t{0}) : bfloat16::round_bits(product);
              right = right && scaled[e + 1].bits == bits;
              want_sums[static_cast<std::size_t>(i / kernels::kScaledSumRows * c.n + j)] += product;
            }
          for (std::size_t i = 0; i < want_sums.size(); ++i)
            right = right && std::bit_cast<std::uint32_t>(sums[i + 1]) == std::bit_cast<std::uint32_t>(want_sums[i]);
          CHECK(right);
        }
      }
    }
    });
  }
  // Through the engine: under bf16_products() == widened, the deep MLP's products (a layer's forward
  // with its bias, its input gradient g W^T) run this kernel and give the float32 engine's product of
  // the widened operands, rounded (the float32 engine runs the panel kernel on these shapes too);
  // narrower products from 256 rows on (the GPT's) run it as well.
  if (!engine_available(Engine::onednn)) return;
  const Engine engine_before = engine();
  const Bf16Products products_before = bf16_products();
  set_engine(Engine::onednn);
  set_bf16_products(Bf16Products::widened);
  const Array x = astype(random_array(Shape{2048, 512}, 83), DType::bf16), w = astype(random_array(Shape{512, 520}, 84), DType::bf16);
  const Array bias = astype(random_array(Shape{520}, 85), DType::bf16), g = astype(random_array(Shape{2048, 520}, 86), DType::bf16);
  auto f32 = [](const Array& v) { return astype(v, DType::f32); };
  CHECK(kernels::uses_f32_panels_widened(x, false, w, false));
  CHECK(kernels::uses_f32_panels_widened(g, false, w, true));
  CHECK_FALSE(kernels::uses_f32_panels_widened(x, true, g, false));  // weight gradients: not on this kernel
  CHECK(kernels::gemm_bias(x, w, bias).bitwise_equal(astype(kernels::gemm_bias(f32(x), f32(w), f32(bias)), DType::bf16)));
  CHECK(kernels::batched_gemm(g, w, false, true).bitwise_equal(astype(kernels::batched_gemm(f32(g), f32(w), false, true), DType::bf16)));
  const Array p = astype(random_array(Shape{256, 64}, 87), DType::bf16), q = astype(random_array(Shape{64, 96}, 88), DType::bf16);
  CHECK(kernels::uses_f32_panels_widened(p, false, q, false));
  CHECK_FALSE(kernels::uses_f32_panels_widened(p.part_view(0, Shape{255, 64}), false, q, false));  // fewer rows: on oneDNN
  std::vector<float> want(256 * 96);
  kernels::gemm_f32_panels(256, 96, 64, f32(p).data(), false, f32(q).data(), false, nullptr, want.data());
  CHECK(kernels::batched_gemm(p, q, false, false).bitwise_equal(astype(Array::from(Shape{256, 96}, want), DType::bf16)));
  set_bf16_products(products_before);
  set_engine(engine_before);
}

TEST_CASE("widened bf16 weight gradients with long sums: in pieces of rows, each widened alone, added in order") {
  // A weight gradient a^T b whose widened copies would be large (here 3000 rows of 1024 + 512
  // columns: 18 MB) sums its rows in pieces of 1024 (1024, 1024, 952), each piece's rows widened
  // alone: the float32 pieces' products added in order, rounded once; the peak holds one piece's
  // copies, not the whole operands'. Shorter sums (the deep MLP's 2048 rows of 512 + 512 columns:
  // 8 MB) stay one product of the widened operands.
  if (!engine_available(Engine::onednn)) return;
  const Engine engine_before = engine();
  const Bf16Products products_before = bf16_products();
  set_engine(Engine::onednn);
  set_bf16_products(Bf16Products::widened);
  auto f32 = [](const Array& v) { return astype(v, DType::f32); };
  const Array x = astype(random_array(Shape{3000, 1024}, 90), DType::bf16), g = astype(random_array(Shape{3000, 512}, 91), DType::bf16);
  Array want;
  for (std::int64_t r0 = 0; r0 < 3000; r0 += 1024) {
    const std::int64_t rows = std::min<std::int64_t>(1024, 3000 - r0);
    const Array piece = kernels::batched_gemm(f32(x.part_view(r0 * 1024, Shape{rows, 1024})), f32(g.part_view(r0 * 512, Shape{rows, 512})),
                                              true, false);
    want = r0 == 0 ? piece : add(want, piece);
  }
  std::int64_t peak = 0;
  Array got;
  {
    memory::PeakScope scope;
    got = kernels::batched_gemm(x, g, true, false);
    peak = scope.peak_growth();
  }
  CHECK(got.dtype() == DType::bf16);
  CHECK(got.bitwise_equal(astype(want, DType::bf16)));
  CHECK(peak < 3000 * (1024 + 512) * 4);  // less than the whole operands' copies alone (one piece's, the sums)
  const Array whole = kernels::batched_gemm(f32(x), f32(g), true, false);
  CHECK(max(abs(f32(got) - whole)).item() <= max(abs(whole)).item() / 128);
  // (the MLP's: one product, as the float32 engine's of the widened operands)
  const Array xs = astype(random_array(Shape{2048, 512}, 92), DType::bf16), gs = astype(random_array(Shape{2048, 512}, 93), DType::bf16);
  CHECK(kernels::batched_gemm(xs, gs, true, false).bitwise_equal(astype(kernels::batched_gemm(f32(xs), f32(gs), true, false), DType::bf16)));
  set_bf16_products(products_before);
  set_engine(engine_before);
}

TEST_CASE("f32 panel products have the same bits on one thread and on two, through the engine's products") {
  // The engine routes a layer's forward and input-gradient products of this size to the kernel; each
  // element is summed on one thread in a fixed order, so the team's size cannot change a bit. (The
  // weight gradient, x^T g, runs on oneDNN's serial sgemm in row pieces fixed by the shape: also
  // compared, with a last piece of 88 rows.)
  const Array x = random_array(Shape{2048, 512}, 73), w = random_array(Shape{512, 520}, 74), b = random_array(Shape{520}, 75);
  const Array g = random_array(Shape{2048, 520}, 76), x600 = random_array(Shape{2048, 600}, 77);
  if (!kernels::uses_f32_panels(x, false, w, false) || !kernels::uses_f32_panels(g, false, w, true)) {
    MESSAGE("this engine or build has no float32 panel kernel: not run");
    return;
  }
  auto run = [&] {
    return std::vector<Array>{kernels::batched_gemm(x, w, false, false), kernels::gemm_bias(x, w, b),
                              kernels::batched_gemm(g, w, false, true), kernels::batched_gemm(x, g, true, false),
                              kernels::batched_gemm(x600, g, true, false)};
  };
  const std::optional<V> compared = same_bits_on_one_and_two_threads(run);
  const V one = compared ? *compared : run();  // (the values are checked either way)
  // and the values: Eigen's product (another order of the same float32 sums)
  const Array want = kernels::batched_gemm_eigen(x, w, false, false);
  CHECK(max(abs(one[0] - want)).item() <= 1e-4f * max(abs(want)).item());
  CHECK(max(abs(one[1] - (want + b))).item() <= 1e-4f * max(abs(want)).item());
  const Array want_dx = kernels::batched_gemm_eigen(g, w, false, true);
  CHECK(max(abs(one[2] - want_dx)).item() <= 1e-4f * max(abs(want_dx)).item());
  const Array want_dw = kernels::batched_gemm_eigen(x, g, true, false);
  CHECK(max(abs(one[3] - want_dw)).item() <= 1e-4f * max(abs(want_dw)).item());
  const Array want_dw600 = kernels::batched_gemm_eigen(x600, g, true, false);  // pieces of 256, 256 and 88 rows
  CHECK(max(abs(one[4] - want_dw600)).item() <= 1e-4f * max(abs(want_dw600)).item());
}

TEST_CASE("AVX2 float32 products: each element the in-order chain of fused multiply-adds, bit for bit; tails, transposes, packing") {
  // gemm_f32_avx2_serial / _packed and PackedProduct on them (the oneDNN engine's serial products on
  // CPUs without AVX-512): rows around the 6-row tile and its evened-out last tiles, columns around
  // the 16-column panel, empty, short and long sums (in depth chunks, in row blocks), either operand
  // transposed, c with a row stride past n. Each element must be exactly fma(a[i, k-1], b[k-1, j],
  // ... fma(a[i, 0], b[0, j], start)), where start is 0 (beta 0: c is not read, NaN there must not
  // show) or c's value (alpha = beta = 1); nothing past n columns is written. Other alpha and beta:
  // alpha * sum + beta * c. Runs wherever the build has AVX2 (also on AVX-512 CPUs).
  if (!kernels::f32_avx2_available()) {
    MESSAGE("built without AVX2 and FMA: no AVX2 kernel to test");
    return;
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Case { std::int64_t m, n, k; };
  for (const Case c : {Case{1, 1, 1}, Case{5, 15, 3}, Case{6, 16, 64}, Case{7, 17, 2}, Case{16, 40, 256}, Case{13, 33, 0},
                       Case{31, 8, 300}, Case{100, 50, 700}, Case{3, 70, 5000}, Case{22, 1, 9}, Case{200, 20, 257}}) {
    auto values = [](std::int64_t count, unsigned seed) {
      auto v = random_array(Shape{std::max<std::int64_t>(count, 1)}, seed).to_vector();
      v.resize(static_cast<std::size_t>(count));
      v.push_back(std::numeric_limits<float>::quiet_NaN());  // read past the operand: it would show
      return v;
    };
    const auto a = values(c.m * c.k, 80), b = values(c.k * c.n, 81);
    auto transposed = [&](const std::vector<float>& x, std::int64_t rows, std::int64_t cols) {
      std::vector<float> t(static_cast<std::size_t>(rows * cols) + 1, nan);
      for (std::int64_t i = 0; i < rows; ++i)
        for (std::int64_t j = 0; j < cols; ++j) t[static_cast<std::size_t>(j * rows + i)] = x[static_cast<std::size_t>(i * cols + j)];
      return t;
    };
    const auto at = transposed(a, c.m, c.k), bt = transposed(b, c.k, c.n);
    // element (i, j)'s chain of fused multiply-adds, from `start`
    auto chain_from = [&](std::int64_t i, std::int64_t j, float start) {
      float acc = start;
      for (std::int64_t q = 0; q < c.k; ++q)
        acc = std::fma(a[static_cast<std::size_t>(i * c.k + q)], b[static_cast<std::size_t>(q * c.n + j)], acc);
      return acc;
    };
    const std::int64_t ldc = c.n + 3;
    const auto c0 = values(c.m * ldc, 82);
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (float beta : {0.0f, 1.0f}) {
          CAPTURE(c.m); CAPTURE(c.n); CAPTURE(c.k); CAPTURE(ta); CAPTURE(tb); CAPTURE(beta);
          const float* A = (ta ? at : a).data();
          const float* B = (tb ? bt : b).data();
          const std::int64_t lda = ta ? c.m : c.k, ldb = tb ? c.k : c.n;
          std::vector<float> out(c0.begin(), c0.end() - 1);
          if (beta == 0.0f)
            for (std::int64_t i = 0; i < c.m; ++i)
              for (std::int64_t j = 0; j < c.n; ++j) out[static_cast<std::size_t>(i * ldc + j)] = nan;
          const std::vector<float> before = out;
          kernels::gemm_f32_avx2_serial(ta, tb, c.m, c.n, c.k, 1.0f, A, lda, B, ldb, beta, out.data(), ldc);
          std::int64_t wrong = 0, touched = 0;
          for (std::int64_t i = 0; i < c.m; ++i)
            for (std::int64_t j = 0; j < ldc; ++j) {
              const std::size_t at_ij = static_cast<std::size_t>(i * ldc + j);
              if (j >= c.n) {
                touched += std::bit_cast<std::uint32_t>(out[at_ij]) != std::bit_cast<std::uint32_t>(before[at_ij]);
                continue;
              }
              const float want = chain_from(i, j, beta == 0.0f ? 0.0f : before[at_ij]);
              wrong += std::bit_cast<std::uint32_t>(out[at_ij]) != std::bit_cast<std::uint32_t>(want);
            }
          CHECK(wrong == 0);
          CHECK(touched == 0);
          // b packed once: the same bits
          Array packed = Array::empty(Shape{kernels::avx2_packed_floats(c.k, c.n)});
          kernels::pack_f32_avx2(B, ldb, tb, c.k, c.n, packed.mutable_data());
          std::vector<float> again = before;
          kernels::gemm_f32_avx2_packed(c.m, c.n, c.k, 1.0f, A, lda, ta, packed.data(), beta, again.data(), ldc);
          CHECK(std::memcmp(again.data(), out.data(), out.size() * sizeof(float)) == 0);
          // any alpha and beta: alpha * sum + beta * c, to float32 rounding
          std::vector<float> scaled(c0.begin(), c0.end() - 1);
          kernels::gemm_f32_avx2_serial(ta, tb, c.m, c.n, c.k, -0.5f, A, lda, B, ldb, 3.0f, scaled.data(), ldc);
          double worst = 0;
          for (std::int64_t i = 0; i < c.m; ++i)
            for (std::int64_t j = 0; j < c.n; ++j) {
              const std::size_t at_ij = static_cast<std::size_t>(i * ldc + j);
              const double want = -0.5 * chain_from(i, j, 0.0f) + 3.0 * c0[at_ij];
              worst = std::max(worst, std::abs(scaled[at_ij] - want) / (1.0 + std::abs(want)));
            }
          CHECK(worst <= 1e-6);
        }
    // PackedProduct where the engine runs its products on this kernel: the same bits, accumulating or not
    if (kernels::uses_f32_avx2() && c.k > 0) {
      for (bool accumulate : {false, true}) {
        kernels::PackedProduct p(c.m, c.n, c.k, b.data(), c.n, false, c.k, ldc, accumulate);
        std::vector<float> out(c0.begin(), c0.end() - 1), want = out;
        p.run(a.data(), out.data());
        kernels::gemm_f32_avx2_serial(false, false, c.m, c.n, c.k, 1.0f, a.data(), c.k, b.data(), c.n, accumulate ? 1.0f : 0.0f,
                                      want.data(), ldc);
        CHECK(std::memcmp(want.data(), out.data(), out.size() * sizeof(float)) == 0);
      }
    }
  }
}

TEST_CASE("AVX2 weight gradients through the engine: the in-order fma chain, the same bits on one thread and on two") {
  // Where the engine runs float32 weight gradients (x^T g) on the team's AVX2 kernel (builds without
  // AVX-512): rows in pieces dealt dynamically, sums in depth chunks; each element must still be the
  // chain of fused multiply-adds over the rows in order, whatever the team.
  const Array x = random_array(Shape{700, 262}, 83), g = random_array(Shape{700, 197}, 84);
  if (!kernels::uses_f32_avx2_team(x, true, g, false)) {
    MESSAGE("this engine or build does not run weight gradients on the AVX2 kernel: not run");
    return;
  }
  auto run = [&] { return V{kernels::batched_gemm(x, g, true, false)}; };
  const std::optional<V> compared = same_bits_on_one_and_two_threads(run);
  const V one = compared ? *compared : run();
  const auto xs = x.to_vector(), gs = g.to_vector(), got = one[0].to_vector();
  std::int64_t wrong = 0;
  for (std::int64_t i = 0; i < 262; ++i)
    for (std::int64_t j = 0; j < 197; ++j) {
      float acc = 0.0f;
      for (std::int64_t q = 0; q < 700; ++q)
        acc = std::fma(xs[static_cast<std::size_t>(q * 262 + i)], gs[static_cast<std::size_t>(q * 197 + j)], acc);
      wrong += std::bit_cast<std::uint32_t>(acc) != std::bit_cast<std::uint32_t>(got[static_cast<std::size_t>(i * 197 + j)]);
    }
  CHECK(wrong == 0);
}

TEST_CASE("bf16-rounded products: the float64 product of the operands rounded as bfloat16() rounds (long sums, transposes)") {
  // gemm_bf16_rounded_serial (sums longer than kRoundedSumPiece in pieces) and PackedProduct with
  // Operands::bf16 (b packed once, a rounded per run): what the fused recurrent layers' products
  // compute on float32 arrays, on every engine.
  auto r = [](float v) { return static_cast<double>(static_cast<float>(bfloat16(v))); };
  struct Case { std::int64_t m, n, k; };
  for (const Case c : {Case{3, 5, 0}, Case{7, 33, 5}, Case{16, 40, kernels::kRoundedSumPiece}, Case{9, 24, kernels::kRoundedSumPiece + 1},
                       Case{5, 17, 600}}) {
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (float beta : {0.0f, 1.0f}) {
          CAPTURE(c.m); CAPTURE(c.n); CAPTURE(c.k); CAPTURE(ta); CAPTURE(tb); CAPTURE(beta);
          const std::int64_t lda = (ta ? c.m : c.k) + 3, ldb = (tb ? c.k : c.n) + 2, ldc = c.n + 1;
          const auto a = random_array(Shape{ta ? c.k : c.m, lda}, 50).to_vector();
          const auto b = random_array(Shape{tb ? c.n : c.k, ldb}, 51).to_vector();
          auto at = [&](std::int64_t i, std::int64_t kk) { return r(a[static_cast<std::size_t>(ta ? kk * lda + i : i * lda + kk)]); };
          auto bt = [&](std::int64_t kk, std::int64_t j) { return r(b[static_cast<std::size_t>(tb ? j * ldb + kk : kk * ldb + j)]); };
          // The largest error of out [m, n] (row stride ldc, started at 0.25) against the float64
          // product, relative to the sum of the products' magnitudes.
          auto worst_error = [&](const std::vector<float>& out) {
            double worst = 0;
            for (std::int64_t i = 0; i < c.m; ++i)
              for (std::int64_t j = 0; j < c.n; ++j) {
                double exact = beta != 0.0f ? 0.25 : 0.0, magnitude = 1.0;
                for (std::int64_t kk = 0; kk < c.k; ++kk) {
                  exact += at(i, kk) * bt(kk, j);
                  magnitude += std::abs(at(i, kk) * bt(kk, j));
                }
                worst = std::max(worst, std::abs(out[static_cast<std::size_t>(i * ldc + j)] - exact) / magnitude);
              }
            return worst;
          };
          std::vector<float> out(static_cast<std::size_t>(c.m * ldc), 0.25f);
          kernels::gemm_bf16_rounded_serial(ta, tb, c.m, c.n, c.k, 1.0f, a.data(), lda, b.data(), ldb, beta, out.data(), ldc);
          CHECK(worst_error(out) < 1e-6);  // float32 sums of exact products of bf16 values
          for (std::int64_t i = 0; i < c.m; ++i) CHECK(out[static_cast<std::size_t>(i * ldc + c.n)] == 0.25f);
          if (ta) continue;  // PackedProduct: a [m, k] row-major
          std::vector<float> packed_out(static_cast<std::size_t>(c.m * ldc), 0.25f);
          const kernels::PackedProduct product(c.m, c.n, c.k, b.data(), ldb, tb, lda, ldc, beta != 0.0f, kernels::Operands::bf16);
          product.run(a.data(), packed_out.data());
          CHECK(worst_error(packed_out) < 1e-6);
        }
  }
  // The weights are rounded as bfloat16() rounds, also the largest float32 subnormal (up to 2^-126,
  // the smallest normal; a conversion that flushes subnormals would give 0).
  const float subnormal = std::bit_cast<float>(0x007fffffu), one = 1.0f;
  const kernels::PackedProduct product(1, 1, 1, &subnormal, 1, false, 1, 1, false, kernels::Operands::bf16);
  float got = -1.0f;
  product.run(&one, &got);
  CHECK(got == static_cast<float>(bfloat16(subnormal)));
  CHECK(got == std::ldexp(1.0f, -126));
  float got_gemm = -1.0f;
  kernels::gemm_bf16_rounded_serial(false, false, 1, 1, 1, 1.0f, &one, 1, &subnormal, 1, 0.0f, &got_gemm, 1);
  CHECK(got_gemm == std::ldexp(1.0f, -126));
}

TEST_CASE("fused attention in bf16 against float32 attention of the same bf16 values: long, odd, masked, q shorter than k") {
  struct Case {
    const char* name;
    std::int64_t q_len, kv_len, head_dim, v_dim;
    bool causal, masked;
  };
  for (const Case c : {Case{"two blocks, causal", 130, 130, 16, 16, true, false},
                       Case{"odd depths", 70, 70, 7, 5, false, false},
                       Case{"padding mask", 65, 67, 8, 8, false, true},
                       Case{"causal, fewer queries than keys", 33, 71, 9, 3, true, false}}) {
    CAPTURE(c.name);
    auto bf = [](const Array& x) { return astype(x, DType::bf16); };
    const V b = {bf(random_array(Shape{2, c.q_len, 2, c.head_dim}, 50, -2.0f, 2.0f)),
                 bf(random_array(Shape{2, c.kv_len, 2, c.head_dim}, 51, -2.0f, 2.0f)),
                 bf(random_array(Shape{2, c.kv_len, 2, c.v_dim}, 52))};
    const V f32 = {astype(b[0], DType::f32), astype(b[1], DType::f32), astype(b[2], DType::f32)};
    Array mask;
    if (c.masked) {
      std::vector<float> m(static_cast<std::size_t>(c.q_len * c.kv_len));
      for (std::size_t i = 0; i < m.size(); ++i) m[i] = (i * 7919) % 5 == 0 ? 0.0f : 1.0f;
      mask = Array::from(Shape{c.q_len, c.kv_len}, m);
    }
    auto f = [&](const V& in) { return scaled_dot_product_attention(in[0], in[1], in[2], {.mask = mask, .is_causal = c.causal}); };
    const Array r = random_array(Shape{2, c.q_len, 2, c.v_dim}, 53);
    const Array y16 = astype(f(b), DType::f32), y32 = f(f32);
    CHECK(max_abs_diff(y16, y32) < 0.008f);  // observed 0.002-0.003: the output rounds to bf16
    const V g16 = attention_grads(f, b, bf(r)), g32 = attention_grads(f, f32, astype(bf(r), DType::f32));
    for (int i = 0; i < 3; ++i) {
      CAPTURE(i);
      const Array& ref = g32[static_cast<std::size_t>(i)];
      const float scale = max_abs_diff(ref, Array::zeros(ref.shape()));
      CHECK(max_abs_diff(astype(g16[static_cast<std::size_t>(i)], DType::f32), ref) < 0.012f * scale);  // observed 0.25-0.5% of the largest
    }
  }
}

TEST_CASE("fused attention in bf16: remat gives bitwise the plain gradients") {
  auto bf = [](const Array& x) { return astype(x, DType::bf16); };
  const V in = {bf(random_array(Shape{2, 70, 2, 8}, 54)), bf(random_array(Shape{2, 70, 2, 8}, 55)),
                bf(random_array(Shape{2, 70, 2, 8}, 56))};
  auto block = [](const Array& x, const Array& y, const Array& z) {
    return tanh(scaled_dot_product_attention(x * 1.5f, y, z, {.is_causal = true}));
  };
  auto loss = [](const Array& y) { return sum(astype(y, DType::f32)); };
  auto plain = grad([&](const V& v) { return loss(block(v[0], v[1], v[2])); })(in);
  auto rematted_block = checkpoint(block);
  auto remat = grad([&](const V& v) { return loss(rematted_block(v[0], v[1], v[2])); })(in);
  for (int i = 0; i < 3; ++i) CHECK(plain[static_cast<std::size_t>(i)].bitwise_equal(remat[static_cast<std::size_t>(i)]));
}

TEST_CASE("fused attention: remat of a block using it gives bitwise the plain gradients") {
  const Array q = random_array(Shape{2, 70, 2, 8}, 16), k = random_array(Shape{2, 70, 2, 8}, 17);
  const Array v = random_array(Shape{2, 70, 2, 8}, 18);
  auto block = [](const Array& x, const Array& y, const Array& z) {
    return tanh(scaled_dot_product_attention(x * 1.5f, y, z, {.is_causal = true}));
  };
  auto plain = grad([&](const V& in) { return sum(block(in[0], in[1], in[2])); })(V{q, k, v});
  auto rematted_block = checkpoint(block);
  auto remat = grad([&](const V& in) { return sum(rematted_block(in[0], in[1], in[2])); })(V{q, k, v});
  for (int i = 0; i < 3; ++i) CHECK(plain[static_cast<std::size_t>(i)].bitwise_equal(remat[static_cast<std::size_t>(i)]));
}

TEST_CASE("fused attention: errors name the op and the shapes") {
  const Array q = Array::zeros(Shape{2, 5, 2, 4}), k = Array::zeros(Shape{2, 6, 2, 4}), v = Array::zeros(Shape{2, 6, 2, 3});
  CHECK_THROWS_WITH_AS(scaled_dot_product_attention(q, Array::zeros(Shape{2, 6, 3, 4}), v),
                       doctest::Contains("num_heads must match"), ShapeError);
  CHECK_THROWS_WITH_AS(scaled_dot_product_attention(q, k, Array::zeros(Shape{2, 5, 2, 3})),
                       doctest::Contains("key and value lengths"), ShapeError);
  CHECK_THROWS_WITH_AS(scaled_dot_product_attention(q, k, v, {.mask = Array::ones(Shape{5, 5})}),
                       doctest::Contains("does not broadcast to the attention weights (2, 2, 5, 6)"), ShapeError);
  CHECK_THROWS_WITH_AS(scaled_dot_product_attention(Array::zeros(Shape{5, 4}), k, v),
                       doctest::Contains("at least 3"), ShapeError);
  CHECK_THROWS_AS(scaled_dot_product_attention(q, k, v, {.scale = NAN}), ValueError);
}

// ---- layer_norm / rms_norm ------------------------------------------------------------------

namespace {
Array composed_layer_norm(const Array& x, const Array& scale, const Array& bias, float eps, bool center) {
  Array mu = center ? mean(x, {-1}, true) : Array();
  Array var = center ? mean(square(x - mu), {-1}, true) : mean(square(x), {-1}, true);
  Array y = (center ? x - mu : x) * (rsqrt(var + eps) * scale);
  return bias.defined() ? y + bias : y;
}
}  // namespace

TEST_CASE("fused layer_norm and rms_norm equal the composed formulas, values and gradients") {
  const Array x = random_array(Shape{3, 37, 24}, 20, -2.0f, 3.0f);
  const Array scale = random_array(Shape{24}, 21, 0.5f, 1.5f), bias = random_array(Shape{24}, 22);
  const Array r = random_array(Shape{3, 37, 24}, 23);
  for (bool center : {true, false}) {
    CAPTURE(center);
    auto fused = [&](const V& in) {
      return center ? layer_norm(in[0], in[1], in[2], {.epsilon = 1e-5, .fast_variance = false})
                    : rms_norm(in[0], in[1], {.epsilon = 1e-5});
    };
    auto reference = [&](const V& in) { return composed_layer_norm(in[0], in[1], center ? in[2] : Array(), 1e-5f, center); };
    CHECK(max_abs_diff(fused({x, scale, bias}), reference({x, scale, bias})) < 5e-6f);
    auto [v1, gf] = value_and_grad([&](const V& in) { return sum(fused(in) * r); })(V{x, scale, bias});
    auto [v2, gr] = value_and_grad([&](const V& in) { return sum(reference(in) * r); })(V{x, scale, bias});
    CHECK(max_abs_diff(gf[0], gr[0]) < 2e-5f);
    CHECK(max_abs_diff(gf[1], gr[1]) < 2e-4f);
    if (center) CHECK(max_abs_diff(gf[2], gr[2]) < 2e-4f);
  }
}

TEST_CASE("fused layer_norm against finite differences; two normalized axes; no params") {
  const V in = {random_array(Shape{4, 3, 5}, 24), random_array(Shape{3, 5}, 25, 0.5f, 1.5f), random_array(Shape{3, 5}, 26)};
  CHECK(check_gradients("layer_norm", [](const V& v) { return layer_norm(v[0], v[1], v[2], {.num_axes = 2}); }, in));
  CHECK(check_gradients("layer_norm fast variance",
                        [](const V& v) { return layer_norm(v[0], v[1], v[2], {.num_axes = 2, .fast_variance = true}); }, in));
  CHECK(check_gradients("rms_norm", [](const V& v) { return rms_norm(v[0], v[1], {.num_axes = 2}); }, {in[0], in[1]}));
  CHECK(check_gradients("layer_norm without params", [](const V& v) { return layer_norm(v[0], Array(), Array()); }, {in[0]}));
}

TEST_CASE("nn::LayerNorm keeps only its input and two floats per row for backward") {
  const Array x = random_array(Shape{64, 128}, 27);
  Tree vars = init(nn::LayerNorm{}, rng::key(0), x);
  auto f = [&](const Array& in) { return apply(nn::LayerNorm{}, vars, in); };
  const std::string report = lift::print_saved_residuals(f, x);
  CAPTURE(report);
  CHECK(report.find("f32[64,128] output of") == std::string::npos);  // no x-sized intermediate
  CHECK(report.find("f32[64,2]") != std::string::npos);               // the row statistics
}

TEST_CASE("fused layer_norm in bf16: float32 statistics, output in the promoted dtype, gradients in each input's dtype") {
  const Array x = astype(random_array(Shape{8, 64}, 28, -3.0f, 3.0f), DType::bf16);
  const Array scale = random_array(Shape{64}, 29, 0.5f, 1.5f), bias = random_array(Shape{64}, 30);
  CHECK(layer_norm(x, scale, bias).dtype() == DType::f32);
  const Array y = layer_norm(x, scale, bias, {.dtype = DType::bf16});
  CHECK(y.dtype() == DType::bf16);
  CHECK(max_abs_diff(astype(y, DType::f32), layer_norm(astype(x, DType::f32), scale, bias)) < 3e-2f);
  auto g = grad([&](const V& in) { return sum(astype(layer_norm(in[0], in[1], in[2], {.dtype = DType::bf16}), DType::f32)); })(
      V{x, scale, bias});
  CHECK(g[0].dtype() == DType::bf16);
  CHECK(g[1].dtype() == DType::f32);
}

TEST_CASE("fused layer_norm: remat gives bitwise the plain gradients; errors name op and shapes") {
  const Array x = random_array(Shape{100, 48}, 31), scale = random_array(Shape{48}, 32), bias = random_array(Shape{48}, 33);
  auto block = [](const Array& a, const Array& s, const Array& b) { return tanh(layer_norm(a * 2.0f, s, b)); };
  auto plain = grad([&](const V& in) { return sum(block(in[0], in[1], in[2])); })(V{x, scale, bias});
  auto rb = checkpoint(block);
  auto remat = grad([&](const V& in) { return sum(rb(in[0], in[1], in[2])); })(V{x, scale, bias});
  for (int i = 0; i < 3; ++i) CHECK(plain[static_cast<std::size_t>(i)].bitwise_equal(remat[static_cast<std::size_t>(i)]));
  CHECK_THROWS_WITH_AS(layer_norm(x, Array::ones(Shape{47}), Array()),
                       doctest::Contains("layer_norm: scale and bias must have the shape of the normalized axes of x, (48,), got (47,)"), ShapeError);
  CHECK_THROWS_WITH_AS(layer_norm(x, Array(), Array(), {.num_axes = 3}), doctest::Contains("num_axes"), ShapeError);
  CHECK_THROWS_AS(rms_norm(x, Array(), {.epsilon = -1.0}), ValueError);
}

// ---- batch_norm: statistics over every axis but the last -----------------------------------------

namespace {

// Flax's BatchNorm written with ops (nn/normalization.cpp's composed path): y, mean, var.
V composed_batch_norm(const Array& x, const Array& scale, const Array& bias, float eps, bool fast) {
  std::vector<int> axes;
  for (int a = 0; a < x.rank() - 1; ++a) axes.push_back(a);
  const Array xf = astype(x, DType::f32);
  Array mu = mean(xf, axes, true), var;
  if (fast) var = maximum(Array::scalar(0.0f), mean(square(xf), axes, true) - square(mu));
  else var = mean(square(xf - mu), axes, true);
  Array mul = rsqrt(var + eps);
  if (scale.defined()) mul = mul * scale;
  Array y = (xf - mu) * mul;
  if (bias.defined()) y = y + bias;
  return {y, reshape(mu, {x.dim(-1)}), reshape(var, {x.dim(-1)})};
}

// A loss reading all three outputs, so the rule's cotangents of the statistics are exercised.
Array bn_loss(const V& out, const Array& r) {
  return sum(out[0] * r) + sum(out[1] * out[1]) * 0.5f + sum(out[2]) * 0.25f;
}

V bn_outputs(const BatchNormResult& r) { return {r.y, r.mean, r.var}; }

}  // namespace

TEST_CASE("fused batch_norm equals the composed formula, values and gradients (one block, many, in parallel)") {
  // [N, H, W, C]: one row block; ten blocks; enough elements for the parallel passes; a wide channel
  // axis; rows enough for the cap on the number of blocks (larger blocks); and channel counts for
  // each width of the register loops on AVX-512 (1 to 4 vectors of 16, the last one partial or
  // whole) and on AVX2 (1 to 8 vectors of 8: 7, 17 and 63 end in a partial one) and just past them.
  for (const Shape& shape : {Shape{3, 5, 7, 24}, Shape{8, 20, 20, 24}, Shape{8, 40, 40, 24}, Shape{50, 700}, Shape{3000, 800},
                             Shape{6, 9, 11, 1}, Shape{6, 9, 11, 7}, Shape{6, 9, 11, 16}, Shape{6, 9, 11, 17},
                             Shape{6, 9, 11, 40}, Shape{6, 9, 11, 63}, Shape{6, 9, 11, 64}, Shape{6, 9, 11, 65}}) {
    const std::int64_t C = shape.dim(-1);
    const Array x = random_array(shape, 40, -2.0f, 3.0f), r = random_array(shape, 41);
    const Array scale = random_array(Shape{C}, 42, 0.5f, 1.5f), bias = random_array(Shape{C}, 43);
    for (bool fast : {true, false})
      for (bool params : {true, false}) {
        CAPTURE(shape);
        CAPTURE(fast);
        CAPTURE(params);
        const Array s = params ? scale : Array(), b = params ? bias : Array();
        auto fused = [&](const V& in) { return bn_outputs(batch_norm(in[0], in[1], in[2], {.epsilon = 1e-3, .fast_variance = fast})); };
        auto reference = [&](const V& in) { return composed_batch_norm(in[0], in[1], in[2], 1e-3f, fast); };
        const V f = fused({x, s, b}), c = reference({x, s, b});
        CHECK(max_abs_diff(f[0], c[0]) < 2e-5f);
        CHECK(max_abs_diff(f[1], c[1]) < 1e-5f);
        CHECK(max_abs_diff(f[2], c[2]) < 5e-5f);
        const V in = params ? V{x, s, b} : V{x};
        auto take = [&](const V& v) { return params ? v : V{v[0], Array(), Array()}; };
        auto gf = grad([&](const V& v) { return bn_loss(fused(take(v)), r); })(in);
        auto gc = grad([&](const V& v) { return bn_loss(reference(take(v)), r); })(in);
        CHECK(max_abs_diff(gf[0], gc[0]) < 5e-5f);
        if (params) {
          const float tol = 2e-5f * static_cast<float>(shape.numel() / C);  // sums over every row
          CHECK(max_abs_diff(gf[1], gc[1]) < tol);
          CHECK(max_abs_diff(gf[2], gc[2]) < tol);
        }
      }
  }
}

TEST_CASE("fused batch_norm against finite differences: training and evaluation, every input") {
  const Array x = random_array(Shape{4, 3, 5}, 44), scale = random_array(Shape{5}, 45, 0.5f, 1.5f), bias = random_array(Shape{5}, 46);
  const Array r = random_array(Shape{4, 3, 5}, 47);
  for (bool fast : {true, false}) {
    CAPTURE(fast);
    CHECK(check_gradients("batch_norm", [&](const V& v) {
      return bn_loss(bn_outputs(batch_norm(v[0], v[1], v[2], {.fast_variance = fast})), r); }, {x, scale, bias}));
  }
  CHECK(check_gradients("batch_norm without params", [&](const V& v) {
    return bn_loss(bn_outputs(batch_norm(v[0], Array(), Array())), r); }, {x}));
  const Array mu = random_array(Shape{5}, 48), var = random_array(Shape{5}, 49, 0.5f, 2.0f);
  CHECK(check_gradients("batch_norm (given statistics)", [&](const V& v) {
    return batch_norm(v[0], v[1], v[2], v[3], v[4], {.epsilon = 1e-3}) * r; }, {x, mu, var, scale, bias}));
  // Evaluation mode is the composed formula with the given statistics.
  const Array y = batch_norm(x, mu, var, scale, bias, {.epsilon = 1e-3});
  CHECK(max_abs_diff(y, (x - mu) * (rsqrt(var + 1e-3f) * scale) + bias) < 1e-6f);
}

TEST_CASE("fused batch_norm in bf16: float32 statistics, output in the promoted dtype, gradients in each input's dtype") {
  const Array x32 = random_array(Shape{16, 6, 6, 24}, 50, -3.0f, 3.0f);
  const Array x = astype(x32, DType::bf16);
  const Array scale = random_array(Shape{24}, 51, 0.5f, 1.5f), bias = random_array(Shape{24}, 52);
  CHECK(batch_norm(x, scale, bias).y.dtype() == DType::f32);
  const BatchNormResult r = batch_norm(x, scale, bias, {.dtype = DType::bf16});
  CHECK(r.y.dtype() == DType::bf16);
  CHECK(r.mean.dtype() == DType::f32);
  const BatchNormResult ref = batch_norm(astype(x, DType::f32), scale, bias);
  CHECK(max_abs_diff(astype(r.y, DType::f32), ref.y) < 3e-2f);
  CHECK(max_abs_diff(r.mean, ref.mean) < 1e-6f);  // the same float32 values, the same sums
  CHECK(max_abs_diff(r.var, ref.var) < 1e-6f);
  auto g = grad([&](const V& in) { return sum(astype(batch_norm(in[0], in[1], in[2], {.dtype = DType::bf16}).y, DType::f32) * x32); })(
      V{x, scale, astype(bias, DType::bf16)});
  CHECK(g[0].dtype() == DType::bf16);
  CHECK(g[1].dtype() == DType::f32);
  CHECK(g[2].dtype() == DType::bf16);
}

TEST_CASE("fused batch_norm has the same bits on one thread and on two") {
  const Array x = random_array(Shape{16, 40, 40, 24}, 53), r = random_array(Shape{16, 40, 40, 24}, 54);
  const Array scale = random_array(Shape{24}, 55), bias = random_array(Shape{24}, 56);
  auto run = [&] {
    V out = bn_outputs(batch_norm(x, scale, bias));
    V g = grad([&](const V& in) { return bn_loss(bn_outputs(batch_norm(in[0], in[1], in[2])), r); })(V{x, scale, bias});
    out.insert(out.end(), g.begin(), g.end());
    return out;
  };
  same_bits_on_one_and_two_threads(run);
}

TEST_CASE("fused batch_norm: remat gives bitwise the plain gradients; errors name op and shapes") {
  const Array x = random_array(Shape{10, 6, 6, 16}, 57), scale = random_array(Shape{16}, 58), bias = random_array(Shape{16}, 59);
  auto block = [](const Array& a, const Array& s, const Array& b) { return tanh(batch_norm(a * 2.0f, s, b).y); };
  auto plain = grad([&](const V& in) { return sum(block(in[0], in[1], in[2])); })(V{x, scale, bias});
  auto rb = checkpoint(block);
  auto remat = grad([&](const V& in) { return sum(rb(in[0], in[1], in[2])); })(V{x, scale, bias});
  for (std::size_t i = 0; i < 3; ++i) CHECK(plain[i].bitwise_equal(remat[i]));
  CHECK_THROWS_WITH_AS(batch_norm(x, Array::ones(Shape{15}), Array()),
                       doctest::Contains("batch_norm: scale must have the shape of x's last (channel) axis, (16,), got (15,) for x of shape (10, 6, 6, 16)"),
                       ShapeError);
  CHECK_THROWS_WITH_AS(batch_norm(Array::zeros(Shape{0, 4}), Array(), Array()), doctest::Contains("empty input"), ShapeError);
  CHECK_THROWS_AS(batch_norm(x, Array(), Array(), {.epsilon = -1.0}), ValueError);
  CHECK_THROWS_WITH_AS(batch_norm(x, Array(), Array::ones(Shape{16}), Array(), Array()), doctest::Contains("must be given"), ValueError);
  CHECK_THROWS_WITH_AS(batch_norm(x, Array::zeros(Shape{16}), Array::ones(Shape{4}), Array(), Array()),
                       doctest::Contains("batch_norm_eval: var must have the shape"), ShapeError);
}

namespace {

// Every output's and every gradient's bits equal (NaNs included).
void check_all_bitwise(const V& a, const V& b) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    CAPTURE(i);
    CHECK(a[i].defined() == b[i].defined());
    if (a[i].defined() && b[i].defined()) CHECK(a[i].bitwise_equal(b[i]));
  }
}

}  // namespace

TEST_CASE("batch_norm with a residual and relu: the composed ops' bits, values and gradients (f32, bf16; one block, many)") {
  // relu(residual + batch_norm(x)) in one op against the ops written out, outputs and the gradients
  // of x, scale, bias and the residual bit for bit; the residual has zeros of both signs (a
  // pre-activation of -0 stays -0 through relu) and values that cancel the normalized x.
  for (const Shape& shape : {Shape{3, 5, 7, 24}, Shape{8, 20, 20, 24}, Shape{50, 700}, Shape{300, 1}, Shape{4, 9, 11, 7},
                             Shape{4, 9, 11, 17}, Shape{2, 9, 11, 40}, Shape{2, 7, 9, 63}, Shape{2, 7, 9, 64}}) {
    const std::int64_t C = shape.dim(-1);
    for (DType dt : {DType::f32, DType::bf16}) {
      const Array x = astype(random_array(shape, 70, -2.0f, 3.0f), dt), r = random_array(shape, 71);
      const Array scale = random_array(Shape{C}, 72, 0.5f, 1.5f), bias = random_array(Shape{C}, 73);
      std::vector<float> res = random_array(shape, 74, -2.0f, 2.0f).to_vector();
      for (std::size_t i = 0; i < res.size(); i += 7) res[i] = (i / 7) % 2 ? -0.0f : 0.0f;
      const Array residual0 = astype(Array::from(shape, res), dt);
      // (a residual that cancels the normalized x: pre-activations of exactly zero)
      const Array cancel = astype(-batch_norm(x, scale, bias, {.dtype = dt}).y, dt);
      for (const Array& residual : {residual0, cancel, Array()})
        for (Activation act : {Activation::relu, Activation::none})
          for (bool params : {true, false}) {
            CAPTURE(shape);
            const std::string dtype_str(dtype_name(dt));
            CAPTURE(dtype_str);
            CAPTURE(residual.defined());
            CAPTURE(activation_name(act));
            CAPTURE(params);
            const Array s = params ? scale : Array(), b = params ? bias : Array();
            auto fused = [&](const V& in) {
              return bn_outputs(batch_norm(in[0], in[1], in[2], {.dtype = dt, .residual = in[3], .activation = act}));
            };
            auto composed = [&](const V& in) {
              BatchNormResult o = batch_norm(in[0], in[1], in[2], {.dtype = dt});
              Array y = in[3].defined() ? in[3] + o.y : o.y;
              if (act == Activation::relu) y = relu(y);
              return V{y, o.mean, o.var};
            };
            const V in{x, s, b, residual};
            check_all_bitwise(fused(in), composed(in));
            // (every input differentiated; the unused ones' gradients are zeros either way)
            const V args{x, scale, bias, residual.defined() ? residual : Array::zeros(shape, dt)};
            auto used = [&](const V& v) {
              return V{v[0], params ? v[1] : Array(), params ? v[2] : Array(), residual.defined() ? v[3] : Array()};
            };
            auto gf = grad([&](const V& v) { return bn_loss(fused(used(v)), r); })(args);
            auto gc = grad([&](const V& v) { return bn_loss(composed(used(v)), r); })(args);
            check_all_bitwise(gf, gc);
          }
    }
  }
}

TEST_CASE("batch_norm with a residual and an activation: finite differences; other activations, shapes and dtypes as the ops") {
  const Array x = random_array(Shape{4, 3, 5}, 75), scale = random_array(Shape{5}, 76, 0.5f, 1.5f), bias = random_array(Shape{5}, 77);
  const Array residual = random_array(Shape{4, 3, 5}, 78, -1.0f, 1.0f, 0.05f), r = random_array(Shape{4, 3, 5}, 79);
  CHECK(check_gradients("batch_norm + residual + relu", [&](const V& v) {
    return bn_loss(bn_outputs(batch_norm(v[0], v[1], v[2], {.residual = v[3], .activation = Activation::relu})), r); },
    {x, scale, bias, residual}));
  // Not fused (the ops, the same values): another activation, a residual that broadcasts, or one of
  // another dtype than y.
  for (Activation act : {Activation::gelu, Activation::tanh, Activation::silu}) {
    CAPTURE(activation_name(act));
    const V f = bn_outputs(batch_norm(x, scale, bias, {.residual = residual, .activation = act}));
    CHECK(f[0].bitwise_equal(activate(residual + batch_norm(x, scale, bias).y, act)));
    CHECK(check_gradients("batch_norm + residual + activation", [&](const V& v) {
      return bn_loss(bn_outputs(batch_norm(v[0], v[1], v[2], {.residual = v[3], .activation = act})), r); },
      {x, scale, bias, residual}));
  }
  const Array row = random_array(Shape{5}, 80);
  CHECK(batch_norm(x, scale, bias, {.residual = row, .activation = Activation::relu}).y.bitwise_equal(relu(row + batch_norm(x, scale, bias).y)));
  const Array res16 = astype(residual, DType::bf16);
  const Array y = batch_norm(x, scale, bias, {.residual = res16, .activation = Activation::relu}).y;
  CHECK(y.dtype() == DType::f32);
  CHECK(y.bitwise_equal(relu(res16 + batch_norm(x, scale, bias).y)));
  CHECK_THROWS_AS(batch_norm(x, scale, bias, {.residual = Array::zeros(Shape{4, 3, 4})}), ShapeError);
  // Evaluation mode: the ops after the normalization with the given statistics.
  const Array mu = random_array(Shape{5}, 81), var = random_array(Shape{5}, 82, 0.5f, 2.0f);
  CHECK(batch_norm(x, mu, var, scale, bias, {.residual = residual, .activation = Activation::relu})
            .bitwise_equal(relu(residual + batch_norm(x, mu, var, scale, bias))));
}

TEST_CASE("batch_norm with relu keeps no array of y's size: less memory than the ops; remat, threads and grad of grad") {
  const Array x = random_array(Shape{16, 20, 20, 24}, 83), r = random_array(Shape{16, 20, 20, 24}, 84);
  const Array scale = random_array(Shape{24}, 85, 0.5f, 1.5f), bias = random_array(Shape{24}, 86);
  // A consumer that keeps nothing (a sum with weights, as an average pool): relu's output is alive
  // only because the op keeps it; the fused op recomputes the mask from x instead.
  auto peak = [&](bool fused) {
    memory::reset_peak();
    const std::int64_t live = memory::stats().live_bytes;
    auto g = grad([&](const V& v) {
      const Array y = fused ? batch_norm(v[0] * 1.0f, v[1], v[2], {.activation = Activation::relu}).y : relu(batch_norm(v[0] * 1.0f, v[1], v[2]).y);
      return sum(y * r);
    })(V{x, scale, bias});
    return memory::stats().peak_bytes - live;
  };
  const std::int64_t fused_peak = peak(true), composed_peak = peak(false);
  CAPTURE(fused_peak);
  CAPTURE(composed_peak);
  // (relu's output less: x's size, up to a few per-channel arrays)
  CHECK(fused_peak + static_cast<std::int64_t>(x.nbytes()) - 1024 <= composed_peak);
  // Remat: bitwise the plain gradients; one thread and two: the same bits.
  auto block = [](const Array& a, const Array& res, const Array& s, const Array& b) {
    return batch_norm(a * 2.0f, s, b, {.residual = res, .activation = Activation::relu}).y;
  };
  const Array residual = random_array(Shape{16, 20, 20, 24}, 87);
  auto plain = grad([&](const V& in) { return sum(block(in[0], in[1], in[2], in[3]) * r); })(V{x, residual, scale, bias});
  auto rb = checkpoint(block);
  auto remat = grad([&](const V& in) { return sum(rb(in[0], in[1], in[2], in[3]) * r); })(V{x, residual, scale, bias});
  check_all_bitwise(plain, remat);
  same_bits_on_one_and_two_threads([&] { return grad([&](const V& in) { return sum(block(in[0], in[1], in[2], in[3]) * r); })(V{x, residual, scale, bias}); });
  // Grad of grad (create-graph rules): the composed ops' second derivatives.
  const Array xs = random_array(Shape{6, 4, 8}, 88), rs = random_array(Shape{6, 4, 8}, 89), res = random_array(Shape{6, 4, 8}, 90);
  const Array ss = random_array(Shape{8}, 91, 0.5f, 1.5f), bs = random_array(Shape{8}, 92);
  auto second = [&](bool fused) {
    return grad([&](const V& v) {
      auto inner = grad([&](const V& w) {
        const Array y = fused ? batch_norm(w[0], v[1], bs, {.residual = res, .activation = Activation::relu}).y
                              : relu(res + batch_norm(w[0], v[1], bs).y);
        return sum(y * y * rs);
      })(V{v[0]});
      return sum(inner[0] * rs);
    })(V{xs, ss});
  };
  const V f2 = second(true), c2 = second(false);
  CHECK(max_abs_diff(f2[0], c2[0]) < 1e-4f);
  CHECK(max_abs_diff(f2[1], c2[1]) < 1e-4f);
}

TEST_CASE("nn::BatchNorm on the fused op (channels last) matches its composed path (another axis)") {
  // The same data with channels last (fused) and channels second (composed): outputs, running
  // statistics and gradients agree; evaluation too.
  const Array x = random_array(Shape{6, 5, 4, 12}, 60, -1.0f, 2.0f);
  const Array xt = transpose(x, {0, 3, 1, 2});  // [N, C, H, W]
  const nn::BatchNorm last{.use_running_average = false, .momentum = 0.8};
  const nn::BatchNorm second{.use_running_average = false, .axis = 1, .momentum = 0.8};
  Tree v1 = init(last, rng::key(0), x), v2 = init(second, rng::key(0), xt);
  v1.at("params").set("scale", random_array(Shape{12}, 61, 0.5f, 1.5f));
  v1.at("params").set("bias", random_array(Shape{12}, 62));
  v2.at("params").set("scale", v1.at_path("params/scale").array());
  v2.at("params").set("bias", v1.at_path("params/bias").array());
  auto [y1, u1] = apply(last, v1, {.mutable_collections = {"batch_stats"}}, x);
  auto [y2, u2] = apply(second, v2, {.mutable_collections = {"batch_stats"}}, xt);
  CHECK(max_abs_diff(y1, transpose(y2, {0, 2, 3, 1})) < 2e-6f);
  for (const char* stat : {"batch_stats/mean", "batch_stats/var"})
    CHECK(max_abs_diff(u1.at_path(stat).array(), u2.at_path(stat).array()) < 2e-6f);
  const Array r = random_array(Shape{6, 5, 4, 12}, 63);
  auto loss1 = [&](const V& in) {
    Tree v = v1;
    v.at("params").set("scale", in[1]);
    return sum(apply(last, v, {.mutable_collections = {"batch_stats"}}, in[0]).first * r);
  };
  auto loss2 = [&](const V& in) {
    Tree v = v2;
    v.at("params").set("scale", in[1]);
    return sum(transpose(apply(second, v, {.mutable_collections = {"batch_stats"}}, in[0]).first, {0, 2, 3, 1}) * r);
  };
  auto g1 = grad(loss1)(V{x, v1.at_path("params/scale").array()});
  auto g2 = grad(loss2)(V{xt, v1.at_path("params/scale").array()});
  CHECK(max_abs_diff(g1[0], transpose(g2[0], {0, 2, 3, 1})) < 2e-5f);
  CHECK(max_abs_diff(g1[1], g2[1]) < 1e-4f);
  // Evaluation with the updated statistics.
  v1.set("batch_stats", u1.at("batch_stats"));
  v2.set("batch_stats", u2.at("batch_stats"));
  const Array e1 = apply(nn::BatchNorm{.use_running_average = true}, v1, x);
  const Array e2 = apply(nn::BatchNorm{.use_running_average = true, .axis = 1}, v2, xt);
  CHECK(max_abs_diff(e1, transpose(e2, {0, 2, 3, 1})) < 2e-6f);
  // An integer computation dtype is refused on either path (it would silently truncate).
  CHECK_THROWS_AS(init(nn::BatchNorm{.use_running_average = false, .dtype = DType::i32}, rng::key(0), x), ValueError);
  CHECK_THROWS_AS(init(nn::BatchNorm{.use_running_average = false, .axis = 1, .dtype = DType::i32}, rng::key(0), xt), ValueError);
}

TEST_CASE("nn::BatchNorm's activation and residual: relu(x + BatchNorm(h)) with its values, statistics and gradients") {
  // Channels last (the fused op) and another axis (the composed path), training and evaluation,
  // against the layer without them followed by the ops: bit for bit.
  for (int axis : {-1, 1}) {
    CAPTURE(axis);
    const Array h = random_array(Shape{6, 5, 4, 12}, 93, -1.0f, 2.0f), x = random_array(Shape{6, 5, 4, 12}, 94);
    const nn::BatchNorm plain{.axis = axis, .momentum = 0.8};
    nn::BatchNorm fused = plain;
    fused.activation = Activation::relu;
    Tree v = init(plain, rng::key(0), h, false);
    v.at("params").set("scale", random_array(Shape{h.dim(axis)}, 95, 0.5f, 1.5f));
    v.at("params").set("bias", random_array(Shape{h.dim(axis)}, 96));
    auto fused_loss = [&](const V& in) {
      Tree w = v;
      w.at("params").set("scale", in[2]);
      return sum(apply(fused, w, {.mutable_collections = {"batch_stats"}}, in[0], false, in[1]).first * h);
    };
    auto composed_loss = [&](const V& in) {
      Tree w = v;
      w.at("params").set("scale", in[2]);
      return sum(relu(in[1] + apply(plain, w, {.mutable_collections = {"batch_stats"}}, in[0], false).first) * h);
    };
    auto [y1, u1] = apply(fused, v, {.mutable_collections = {"batch_stats"}}, h, false, x);
    auto [y2, u2] = apply(plain, v, {.mutable_collections = {"batch_stats"}}, h, false);
    CHECK(y1.bitwise_equal(relu(x + y2)));
    CHECK(u1.at_path("batch_stats/mean").array().bitwise_equal(u2.at_path("batch_stats/mean").array()));
    CHECK(u1.at_path("batch_stats/var").array().bitwise_equal(u2.at_path("batch_stats/var").array()));
    const V in{h, x, v.at_path("params/scale").array()};
    check_all_bitwise(grad(fused_loss)(in), grad(composed_loss)(in));
    // Evaluation, and the activation alone (no residual).
    v.set("batch_stats", u1.at("batch_stats"));
    CHECK(apply(fused, v, h, true, x).bitwise_equal(relu(x + apply(plain, v, h, true))));
    CHECK(apply(fused, v, {.mutable_collections = {"batch_stats"}}, h, false).first.bitwise_equal(
        relu(apply(plain, v, {.mutable_collections = {"batch_stats"}}, h, false).first)));
  }
}

// ---- softmax / log_softmax over the last axis ---------------------------------------------------

TEST_CASE("fused softmax and log_softmax (last axis) equal the general-axis path; bf16 rounds once") {
  const Array x = random_array(Shape{5, 33, 300}, 40, -8.0f, 8.0f);
  const Array r = random_array(Shape{5, 33, 300}, 41);
  // The general path, reached by normalizing axis 0 of the transposed array.
  auto general = [](const Array& a, bool log) {
    Array t = transpose(a, {2, 0, 1});
    return transpose(log ? log_softmax(t, {0}) : softmax(t, {0}), {1, 2, 0});
  };
  for (bool log : {false, true}) {
    CAPTURE(log);
    auto fused = [log](const V& in) { return log ? log_softmax(in[0]) : softmax(in[0]); };
    auto reference = [&](const V& in) { return general(in[0], log); };
    CHECK(max_abs_diff(fused({x}), reference({x})) < 2e-6f);
    auto gf = grad([&](const V& in) { return sum(fused(in) * r); })(V{x});
    auto gr = grad([&](const V& in) { return sum(reference(in) * r); })(V{x});
    CHECK(max_abs_diff(gf[0], gr[0]) < 2e-6f);
    CHECK(check_gradients(log ? "log_softmax" : "softmax", fused, {random_array(Shape{3, 7}, 42)}));
    const Array y16 = fused({astype(x, DType::bf16)});
    CHECK(y16.dtype() == DType::bf16);
    CHECK(max_abs_diff(astype(y16, DType::f32), fused({astype(astype(x, DType::bf16), DType::f32)})) < (log ? 0.07f : 4e-3f));
  }
}

// ---- in a model ---------------------------------------------------------------------------------

namespace {
// A pre-LayerNorm transformer block (the GPT benchmark's), built on the fused ops.
struct TinyBlock {
  Array operator()(Scope& s, const Array& x) const {
    const std::int64_t d = x.dim(-1);
    Array h = x + s("attn", nn::MultiHeadDotProductAttention{.num_heads = 2}, s("ln1", nn::LayerNorm{}, x),
                    nn::AttentionArgs{.is_causal = true});
    return h + s("fc2", nn::Dense{.features = d}, gelu(s("fc1", nn::Dense{.features = 2 * d}, s("ln2", nn::RMSNorm{}, h))));
  }
};
template <class B>
struct TinyModel {
  Array operator()(Scope& s, Array x) const {
    for (int i = 0; i < 2; ++i) x = s(B{}, x);
    return x;
  }
};
}  // namespace

TEST_CASE("a transformer on the fused ops: remat, dots_saveable and scan give bitwise the plain gradients") {
  const Array x = random_array(Shape{2, 70, 16}, 50);
  const Tree vars = init(TinyModel<TinyBlock>{}, rng::key(0), x);
  auto grads_of = [&](auto model, const Tree& v) {
    return grad([&](const Tree& p) { return sum(square(apply(model, Tree{{"params", p}}, x))); })(v.at("params"));
  };
  const Tree plain = grads_of(TinyModel<TinyBlock>{}, vars);
  CHECK(bitwise_equal(plain, grads_of(TinyModel<lift::remat<TinyBlock>>{}, vars)));
  CHECK(bitwise_equal(plain, grads_of(TinyModel<lift::remat<TinyBlock, lift::policy<policies::dots_saveable>>>{}, vars)));
  for (DType dt : {DType::bf16}) {  // a bf16 input (normalized in float32, promoted with the float32 params)
    const Array x16 = astype(x, dt);
    auto g16 = [&](auto model) {
      return grad([&](const Tree& p) { return sum(square(astype(apply(model, Tree{{"params", p}}, x16), DType::f32))); })(
          vars.at("params"));
    };
    CHECK(bitwise_equal(g16(TinyModel<TinyBlock>{}), g16(TinyModel<lift::remat<TinyBlock>>{})));
  }
}
