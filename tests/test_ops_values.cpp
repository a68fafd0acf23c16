// Forward values of ops against hand-computed references, and the errors every op gives for
// shapes it cannot accept (each names the op and the shapes).
#include <doctest/doctest.h>
#include <linum/linum.hpp>
#include <linum/core/ops/kernel_util.hpp>  // ops::detail::sum_to: what broadcasting ops' gradients sum with

#include "testing/fp_modes.hpp"
#include "testing/gradcheck.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <sstream>
#include <limits>

using namespace linum;

namespace {
void check_close(const Array& a, const std::vector<float>& want, float tol = 1e-6f) {
  REQUIRE(a.numel() == static_cast<std::int64_t>(want.size()));
  for (std::size_t i = 0; i < want.size(); ++i) CHECK(a.data()[i] == doctest::Approx(want[i]).epsilon(tol));
}
// Values in [-3, 3) from the seed, with every `every`-th element replaced by the next of `special`.
std::vector<float> with_specials(const Shape& shape, unsigned seed, const std::vector<float>& special, std::size_t every) {
  std::vector<float> v = testing::random_array(shape, seed, -3.0f, 3.0f).to_vector();
  for (std::size_t i = 0; i < v.size(); i += every) v[i] = special[(i / every + seed) % special.size()];
  return v;
}

// The flat index of an operand's element for each output element (NumPy broadcasting), walking
// the output's indices like an odometer (plain arrays and pointers: the sanitizer build compiles
// tests without optimization).
std::vector<std::int64_t> source_index(const Shape& in, const Shape& out) {
  const int rank = out.rank();
  std::array<std::int64_t, Shape::kMaxRank> dims{}, step{}, at{};
  const auto in_strides = in.strides();
  for (int d = 0; d < rank; ++d) {
    dims[d] = out[d];
    const int din = d - (rank - in.rank());
    step[d] = (din >= 0 && in[din] != 1) ? in_strides[din] : 0;
  }
  const std::int64_t n = out.numel();
  std::vector<std::int64_t> idx(static_cast<std::size_t>(n));
  std::int64_t* p = idx.data();
  std::int64_t flat = 0;
  for (std::int64_t o = 0; o < n; ++o) {
    p[o] = flat;
    for (int d = rank - 1; d >= 0; --d) {  // the next index: carry into the axes before
      flat += step[d];
      if (++at[d] < dims[d]) break;
      flat -= step[d] * dims[d];
      at[d] = 0;
    }
  }
  return idx;
}
}  // namespace

TEST_CASE("broadcasting arithmetic") {
  Array a = Array::from(Shape{2, 3}, {1, 2, 3, 4, 5, 6});
  Array row = Array::from(Shape{3}, {10, 20, 30});
  Array col = Array::from(Shape{2, 1}, {100, 200});
  check_close(a + row, {11, 22, 33, 14, 25, 36});
  check_close(a * col, {100, 200, 300, 800, 1000, 1200});
  check_close(col - row, {90, 80, 70, 190, 180, 170});
  CHECK((col - row).shape() == Shape{2, 3});
  check_close(pow(a, 2.0f), {1, 4, 9, 16, 25, 36});
  check_close(maximum(a, Array::scalar(3.5f)), {3.5f, 3.5f, 3.5f, 4, 5, 6});
}

TEST_CASE("every binary op, on every pair of dtypes and every broadcast, is the float32 op on the widened values rounded once, bitwise") {
  // On bf16 and mixed operands, each op's bits are those of the same op on the operands widened to
  // float32 (exact), rounded once to the result's dtype, in both fp modes (subnormals flushed or
  // not). With IEEE subnormals the float32 op is also checked against a scalar loop over the
  // output, each operand's element found by its broadcast strides. Sizes cross the bf16 kernels' runs
  // (512 elements), the chunks (2048) and the threshold for running on the thread team (2^18
  // elements), and include empty arrays; values
  // include infinities, signed zeros, subnormals and NaN (in the first operand only, so which NaN
  // comes out does not depend on the order the hardware takes the operands in).
  struct Op {
    const char* name;
    Array (*f)(const Array&, const Array&);
    float (*ref)(float, float);
    bool mask;  // a comparison: float32 0/1 whatever the operands
    bool on_team;  // also checked at the sizes run on the thread team (the same code for every op)
  };
  const std::vector<Op> ops_under_test = {
      {"add", [](const Array& a, const Array& b) { return add(a, b); }, [](float x, float z) { return x + z; }, false, true},
      {"sub", [](const Array& a, const Array& b) { return sub(a, b); }, [](float x, float z) { return x - z; }, false, false},
      {"mul", [](const Array& a, const Array& b) { return mul(a, b); }, [](float x, float z) { return x * z; }, false, false},
      {"div", [](const Array& a, const Array& b) { return div(a, b); }, [](float x, float z) { return x / z; }, false, false},
      {"pow", [](const Array& a, const Array& b) { return pow(a, b); }, [](float x, float z) { return std::pow(x, z); }, false, false},
      {"maximum", [](const Array& a, const Array& b) { return maximum(a, b); }, [](float x, float z) { return x > z ? x : z; }, false, true},
      {"minimum", [](const Array& a, const Array& b) { return minimum(a, b); }, [](float x, float z) { return x < z ? x : z; }, false, false},
      {"greater", [](const Array& a, const Array& b) { return greater(a, b); }, [](float x, float z) { return x > z ? 1.0f : 0.0f; }, true, true},
      {"greater_equal", [](const Array& a, const Array& b) { return greater_equal(a, b); }, [](float x, float z) { return x >= z ? 1.0f : 0.0f; }, true, false},
      {"less", [](const Array& a, const Array& b) { return less(a, b); }, [](float x, float z) { return x < z ? 1.0f : 0.0f; }, true, false},
      {"less_equal", [](const Array& a, const Array& b) { return less_equal(a, b); }, [](float x, float z) { return x <= z ? 1.0f : 0.0f; }, true, false},
      {"equal", [](const Array& a, const Array& b) { return equal(a, b); }, [](float x, float z) { return x == z ? 1.0f : 0.0f; }, true, false},
      {"not_equal", [](const Array& a, const Array& b) { return not_equal(a, b); }, [](float x, float z) { return x != z ? 1.0f : 0.0f; }, true, false},
  };
  auto operand = [](const Shape& shape, unsigned seed, bool with_nan) {
    const std::vector<float> special = {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(), -0.0f,
                                        0.0f, 1.0f, 2.5f, std::numeric_limits<float>::denorm_min(), 1e-39f, -2e-39f};
    std::vector<float> v = with_specials(shape, seed, special, 7);
    if (with_nan)
      for (std::size_t i = 3; i < v.size(); i += 29) v[i] = std::numeric_limits<float>::quiet_NaN();
    return Array::from(shape, v);
  };
  auto widened = [](const Array& x) { return astype(x, DType::f32).to_vector(); };
  // Names the first element at which got and want differ.
  auto first_difference = [&](const Array& got, const Array& want, const std::vector<float>& va, const std::vector<float>& vb,
                              const std::vector<std::int64_t>& ia, const std::vector<std::int64_t>& ib) {
    const std::vector<float> g = widened(got), w = widened(want);
    std::size_t i = 0;
    while (i < g.size() && std::memcmp(&g[i], &w[i], sizeof(float)) == 0) ++i;
    std::uint32_t bits[4] = {};
    if (i < g.size()) {
      std::memcpy(&bits[0], &va[static_cast<std::size_t>(ia[i])], 4);
      std::memcpy(&bits[1], &vb[static_cast<std::size_t>(ib[i])], 4);
      std::memcpy(&bits[2], &g[i], 4);
      std::memcpy(&bits[3], &w[i], 4);
    }
    std::ostringstream what;
    what << std::hex << "element " << std::dec << i << std::hex << ": operands 0x" << bits[0] << ", 0x" << bits[1] << " gave 0x"
         << bits[2] << ", not 0x" << bits[3];
    return what.str();
  };
  struct Pair {
    Shape a, b;
  };
  const std::vector<Pair> shapes = {
      {Shape{7}, Shape{7}},               // same shape
      {Shape{}, Shape{3, 5}},             // one side a single value
      {Shape{3, 5}, Shape{}},
      {Shape{3, 5}, Shape{1}},
      {Shape{1}, Shape{1}},
      {Shape{0}, Shape{}},               // empty
      {Shape{2, 0}, Shape{2, 1}},
      {Shape{4, 5}, Shape{5}},            // rows: the other operand steps along the last axis
      {Shape{4, 5}, Shape{4, 1}},         // columns: it is one value per row
      {Shape{4, 1}, Shape{1, 5}},         // an outer product: both broadcast
      {Shape{2, 3, 5}, Shape{3, 1}},
      {Shape{2, 1, 5}, Shape{2, 3, 1}},
      {Shape{2500}, Shape{2500}},         // across a chunk
      {Shape{3, 2500}, Shape{2500}},
      {Shape{3, 2500}, Shape{3, 1}},
      {Shape{270000}, Shape{270000}},     // on the thread team
      {Shape{270000}, Shape{}},
      {Shape{108, 2500}, Shape{2500}},
      {Shape{108, 2500}, Shape{108, 1}},
      {Shape{520, 512}, Shape{512}},      // rows of one bf16 run each, on the team
      {Shape{520, 512}, Shape{520, 1}},
  };
  std::int64_t checked = 0;
  auto check = [&] {
    const bool ieee = !flush_denormals();
    for (const Pair& p : shapes) {
      const Array a32 = operand(p.a, 1 + static_cast<unsigned>(p.a.numel() % 5), true);
      const Array b32 = operand(p.b, 2 + static_cast<unsigned>(p.b.numel() % 3), false);
      const Shape out_shape = add(Array::zeros(p.a), Array::zeros(p.b)).shape();
      const std::vector<std::int64_t> ia = source_index(p.a, out_shape), ib = source_index(p.b, out_shape);
      // The operands as the computation sees them: bf16 ones are rounded first.
      for (const DType da : {DType::f32, DType::bf16}) {
        for (const DType db : {DType::f32, DType::bf16}) {
          for (const bool weak_b : {false, true}) {
            if (weak_b && (p.b.rank() != 0 || db != DType::f32)) continue;  // weak: a scalar, as a C++ float in an expression
            const Array a = astype(a32, da);
            const Array b = weak_b ? Array::scalar(b32.item()) : astype(b32, db);
            const Array a_wide = astype(a, DType::f32);
            const Array b_wide = weak_b ? b : astype(b, DType::f32);
            const std::vector<float> va = widened(a), vb = widened(b);
            for (const Op& op : ops_under_test) {
              if (!op.on_team && out_shape.numel() >= (1 << 18)) continue;
              CAPTURE(std::string(op.name));
              CAPTURE(p.a);
              CAPTURE(p.b);
              CAPTURE(std::string(dtype_name(da)));
              CAPTURE(std::string(dtype_name(db)));
              CAPTURE(weak_b);
              CAPTURE(ieee);
              const Array got = op.f(a, b);
              const DType result = op.mask ? DType::f32 : promote_types(da, false, b.dtype(), b.weak_type());
              REQUIRE(got.dtype() == result);
              REQUIRE(got.shape() == out_shape);
              const Array wide = op.f(a_wide, b_wide);
              const Array want = astype(wide, result);
              if (!got.bitwise_equal(want)) FAIL_CHECK(first_difference(got, want, va, vb, ia, ib));
              if (ieee) {
                std::vector<float> loop(static_cast<std::size_t>(got.numel()));
                const float *pa = va.data(), *pb = vb.data();
                const std::int64_t *pia = ia.data(), *pib = ib.data();
                float* pl = loop.data();
                for (std::int64_t i = 0, n = got.numel(); i < n; ++i) pl[i] = op.ref(pa[pia[i]], pb[pib[i]]);
                const Array ref = Array::from(got.shape(), loop);
                if (!wide.bitwise_equal(ref)) FAIL_CHECK(first_difference(wide, ref, va, vb, ia, ib));
              }
              ++checked;
            }
          }
        }
      }
    }
  };
  testing::in_both_fp_modes(check);
  // Each shape on 4 dtype pairs, and a weak scalar on the 3 shapes whose second operand is one
  // value of rank 0 (one of them run on the team); on the shapes run on the team, only the ops
  // marked on_team.
  const auto on_team = std::count_if(ops_under_test.begin(), ops_under_test.end(), [](const Op& op) { return op.on_team; });
  const auto all = static_cast<std::int64_t>(ops_under_test.size());
  const auto big = std::count_if(shapes.begin(), shapes.end(), [](const Pair& p) { return std::max(p.a.numel(), p.b.numel()) >= (1 << 18); });
  CHECK(big == 6);
  CHECK(checked == 2 * ((static_cast<std::int64_t>(shapes.size()) - big) * 4 * all + big * 4 * on_team + 2 * 2 * all + 2 * on_team));
}

TEST_CASE("where and its gradients move bits: every pair of dtypes, every broadcast, both fp modes, on the thread team") {
  // where(c, a, b) selects a where c is nonzero and b elsewhere: its bits are the chosen operand's,
  // widened to float32 and rounded once to the result's dtype. Its gradients select the cotangent's
  // bits: a's is g where c holds and +0 elsewhere (never g times a mask, so NaN and infinities in
  // the unselected cotangent do not leak into it), b's the reverse, each summed down to its
  // operand's shape (sum_to, as every broadcasting op's gradient) and given its operand's dtype.
  // The condition holds NaN (true), -0 (false) and subnormals (false when they are flushed);
  // operands and cotangents hold NaN, infinities, signed zeros and subnormals.
  auto values = [](const Shape& shape, unsigned seed, const std::vector<float>& special) {
    return Array::from(shape, with_specials(shape, seed, special, 5));
  };
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> specials = {inf, -inf, -0.0f, 0.0f, nan, std::numeric_limits<float>::denorm_min(), 1e-39f, -2e-39f, 1.0f};
  const std::vector<float> conditions = {0.0f, 1.0f, -0.0f, nan, 1e-39f, -2.5f, 0.0f};
  struct Case {
    Shape c, a, b;
  };
  const std::vector<Case> cases = {
      {Shape{7}, Shape{7}, Shape{7}},
      {Shape{5}, Shape{3, 5}, Shape{3, 5}},   // the condition broadcast
      {Shape{3, 1}, Shape{3, 5}, Shape{5}},   // b broadcast: its gradient sums over rows
      {Shape{}, Shape{4}, Shape{}},
      {Shape{2, 3}, Shape{}, Shape{2, 3}},    // a one value: its gradient sums everything selected
      {Shape{0}, Shape{0}, Shape{}},          // empty
      {Shape{520, 512}, Shape{520, 512}, Shape{520, 512}},  // on the thread team
      {Shape{520, 1}, Shape{520, 512}, Shape{512}},
  };
  std::int64_t checked = 0;
  auto check = [&] {
    for (const Case& k : cases) {
      const Array c = values(k.c, 3, conditions);
      const Array a32 = values(k.a, 4, specials), b32 = values(k.b, 5, specials);
      const Shape out_shape = where(c, Array::zeros(k.a), Array::zeros(k.b)).shape();
      const std::vector<std::int64_t> ic = source_index(k.c, out_shape), ia = source_index(k.a, out_shape),
                                      ib = source_index(k.b, out_shape);
      // Which elements c selects a at, as Linum's comparison says in this fp mode (a subnormal is
      // zero when flushed): that op is checked bitwise above.
      const std::vector<float> holds = not_equal(c, Array::zeros({})).to_vector();
      for (const DType da : {DType::f32, DType::bf16}) {
        for (const DType db : {DType::f32, DType::bf16}) {
          CAPTURE(k.c);
          CAPTURE(k.a);
          CAPTURE(k.b);
          CAPTURE(std::string(dtype_name(da)));
          CAPTURE(std::string(dtype_name(db)));
          CAPTURE(flush_denormals());
          const Array a = astype(a32, da), b = astype(b32, db);
          const DType result = promote_types(da, false, db, false);
          const Array g = astype(values(out_shape, 6, specials), result);
          auto [y, pullback] = vjp([&](const Array& x, const Array& z) { return where(c, x, z); }, a, b);
          const auto [ga, gb] = pullback(g);
          // The references: scalar selections of the widened bits, rounded and summed by the ops
          // the library's own rules use.
          const std::vector<float> va = astype(a, DType::f32).to_vector(), vb = astype(b, DType::f32).to_vector(),
                                   vg = astype(g, DType::f32).to_vector();
          const std::size_t n = static_cast<std::size_t>(out_shape.numel());
          std::vector<float> chosen(n), to_a(n), to_b(n);
          for (std::size_t i = 0; i < n; ++i) {
            const bool h = holds[static_cast<std::size_t>(ic[i])] != 0.0f;
            chosen[i] = h ? va[static_cast<std::size_t>(ia[i])] : vb[static_cast<std::size_t>(ib[i])];
            to_a[i] = h ? vg[i] : 0.0f;
            to_b[i] = h ? 0.0f : vg[i];
          }
          REQUIRE(y.dtype() == result);
          REQUIRE(y.shape() == out_shape);
          CHECK(y.bitwise_equal(astype(Array::from(out_shape, chosen), result)));
          REQUIRE(ga.dtype() == da);
          REQUIRE(gb.dtype() == db);
          CHECK(ga.bitwise_equal(astype(ops::detail::sum_to(Array::from(out_shape, to_a), k.a), da)));
          CHECK(gb.bitwise_equal(astype(ops::detail::sum_to(Array::from(out_shape, to_b), k.b), db)));
          ++checked;
        }
      }
    }
  };
  testing::in_both_fp_modes(check);
  CHECK(checked == 2 * static_cast<std::int64_t>(cases.size()) * 4);
}

TEST_CASE("sin, cos, erf, expm1, log2 and rounding against the C library") {
  const std::vector<float> xs{-2.5f, -1.5f, -0.5f, -1e-4f, 0.0f, 0.5f, 1.5f, 2.5f, 3.7f};
  const Array x = Array::from(Shape{static_cast<std::int64_t>(xs.size())}, xs);
  auto each = [&](float (*f)(float)) {
    std::vector<float> out;
    for (float v : xs) out.push_back(f(v));
    return out;
  };
  check_close(sin(x), each([](float v) { return std::sin(v); }), 1e-5f);
  check_close(cos(x), each([](float v) { return std::cos(v); }), 1e-5f);
  check_close(erf(x), each([](float v) { return std::erf(v); }), 1e-5f);
  check_close(expm1(x), each([](float v) { return std::expm1(v); }), 1e-5f);  // accurate at -1e-4, unlike exp - 1
  const Array pos = Array::from(Shape{4}, {0.125f, 1, 3, 1024});
  check_close(log2(pos), {-3, 0, std::log2(3.0f), 10}, 1e-6f);
  check_close(floor(x), each([](float v) { return std::floor(v); }));
  check_close(ceil(x), each([](float v) { return std::ceil(v); }));
  // Ties to even, as jnp.round: -2.5 -> -2, -1.5 -> -2, -0.5 -> -0, 0.5 -> 0, 1.5 -> 2, 2.5 -> 2.
  check_close(round(x), {-2, -2, -0.0f, 0, 0, 0, 2, 2, 4});
  // bf16 in, bf16 out, computed in float32 and rounded once.
  CHECK(sin(astype(x, DType::bf16)).dtype() == DType::bf16);
}

TEST_CASE("math and activations") {
  Array x = Array::from(Shape{4}, {-2, -0.5f, 0, 1.5f});
  check_close(relu(x), {0, 0, 0, 1.5f});
  check_close(abs(x), {2, 0.5f, 0, 1.5f});
  check_close(sigmoid(x), {1 / (1 + std::exp(2.f)), 1 / (1 + std::exp(0.5f)), 0.5f, 1 / (1 + std::exp(-1.5f))}, 1e-5f);
  check_close(softplus(x), {std::log1p(std::exp(-2.f)), std::log1p(std::exp(-0.5f)), std::log(2.f), std::log1p(std::exp(1.5f))}, 1e-5f);
  // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) and x Phi(x) at x = 1.5, computed in double
  CHECK(gelu(Array::scalar(1.5f), true).item() == doctest::Approx(1.3995715f).epsilon(1e-5));
  CHECK(gelu(Array::scalar(1.5f), false).item() == doctest::Approx(1.3997892f).epsilon(1e-5));
  check_close(silu(x), {-2 / (1 + std::exp(2.f)), -0.5f / (1 + std::exp(0.5f)), 0, 1.5f / (1 + std::exp(-1.5f))}, 1e-5f);
  check_close(clip(x, -1, 1), {-1, -0.5f, 0, 1});
  check_close(where(greater(x, Array::scalar(0)), x, Array::scalar(-9)), {-9, -9, -9, 1.5f});
}

TEST_CASE("reductions") {
  Array a = Array::from(Shape{2, 3}, {1, 5, 3, 4, 2, 6});
  check_close(sum(a, {0}), {5, 7, 9});
  check_close(sum(a, {1}, true), {9, 12});
  CHECK(sum(a, {1}, true).shape() == Shape{2, 1});
  check_close(mean(a), {3.5f});
  check_close(max(a, {1}), {5, 6});
  check_close(min(a, {0}), {1, 2, 3});
  check_close(var(a, {1}), {8.0f / 3, 8.0f / 3});
  check_close(logsumexp(a, {1}), {std::log(std::exp(1.f) + std::exp(5.f) + std::exp(3.f)),
                                  std::log(std::exp(4.f) + std::exp(2.f) + std::exp(6.f))}, 1e-5f);
  CHECK(argmax(a, 1).to_vector_i32() == std::vector<std::int32_t>{1, 2});
  // logsumexp of an all -inf row is -inf, not NaN.
  float inf = std::numeric_limits<float>::infinity();
  CHECK(logsumexp(Array::from(Shape{2}, {-inf, -inf})).item() == -inf);
}

TEST_CASE("matmul, dot_general, softmax") {
  Array a = Array::from(Shape{2, 2}, {1, 2, 3, 4});
  Array b = Array::from(Shape{2, 2}, {5, 6, 7, 8});
  check_close(matmul(a, b), {19, 22, 43, 50});
  check_close(matmul(Array::from(Shape{2}, {1, 1}), b), {12, 14});
  DotDims d{.lhs_contracting = {0}, .rhs_contracting = {0}};
  check_close(dot_general(a, b, d), {26, 30, 38, 44});  // a^T b
  Array s = softmax(Array::from(Shape{1, 3}, {1, 2, 3}));
  const float z = std::exp(1.f) + std::exp(2.f) + std::exp(3.f);
  check_close(s, {std::exp(1.f) / z, std::exp(2.f) / z, std::exp(3.f) / z}, 1e-5f);
  check_close(log_softmax(Array::from(Shape{1, 3}, {1, 2, 3})),
              {1 - std::log(z), 2 - std::log(z), 3 - std::log(z)}, 1e-5f);
}

TEST_CASE("data movement") {
  Array a = Array::from(Shape{2, 3}, {0, 1, 2, 3, 4, 5});
  check_close(transpose(a), {0, 3, 1, 4, 2, 5});
  check_close(slice(a, {0, 1}, {2, 3}), {1, 2, 4, 5});
  check_close(concatenate({a, a}, 0), {0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5});
  auto parts = split(a, 3, 1);
  check_close(parts[2], {2, 5});
  check_close(take(a, Array::from_i32(Shape{2}, {2, 0}), 1), {2, 0, 5, 3});
  check_close(one_hot(Array::from_i32(Shape{3}, {1, 0, 7}), 3), {0, 1, 0, 1, 0, 0, 0, 0, 0});
  CHECK(reshape(a, {3, -1}).shape() == Shape{3, 2});
  CHECK(reshape(a, {6}).shares_buffer(a));  // reshape never copies
  check_close(broadcast_to(Array::from(Shape{3}, {1, 2, 3}), Shape{2, 3}), {1, 2, 3, 1, 2, 3});
}

TEST_CASE("transposes of the last two axes (copied in tiles) hold every element where the permutation says, any size and dtype") {
  // Against the element-by-element definition: sizes around the 32-element tiles, rank 2 to 4,
  // large enough to run in parallel and not, float32, bf16 and int32, of arrays and of flipped ones.
  auto check = [](const Shape& shape, const std::vector<int>& perm, DType dtype, bool flipped) {
    CAPTURE(shape);
    CAPTURE(dtype_name(dtype));
    CAPTURE(flipped);
    Array x = Array::empty(shape, dtype);
    const std::int64_t n = x.numel();
    if (dtype == DType::bf16) {
      auto* p = static_cast<bfloat16*>(x.mutable_raw());
      for (std::int64_t i = 0; i < n; ++i) p[i].bits = static_cast<std::uint16_t>(i * 40503u + 7u);
    } else {
      auto* p = static_cast<std::uint32_t*>(x.mutable_raw());
      for (std::int64_t i = 0; i < n; ++i) p[i] = static_cast<std::uint32_t>(i * 2654435761u);
    }
    const Array src = flipped ? flip(x, {shape.rank() - 1}) : x;
    const Array y = transpose(src, perm);
    // y[idx] = src[idx permuted back]: walk y's indices and compare bit patterns.
    const int rank = shape.rank();
    std::vector<std::int64_t> idx(static_cast<std::size_t>(rank), 0);
    const auto xs = shape.strides();
    bool same = true;
    for (std::int64_t k = 0; k < n && same; ++k) {
      std::int64_t rem = k;
      for (int d = rank - 1; d >= 0; --d) {
        idx[static_cast<std::size_t>(d)] = rem % y.dim(d);
        rem /= y.dim(d);
      }
      std::int64_t off = 0;  // src[i] with i[perm[d]] = idx[d]; src is x flipped along its last axis when asked
      for (int d = 0; d < rank; ++d) {
        const int a = perm[static_cast<std::size_t>(d)];
        std::int64_t i = idx[static_cast<std::size_t>(d)];
        if (flipped && a == rank - 1) i = shape[a] - 1 - i;
        off += i * xs[static_cast<std::size_t>(a)];
      }
      if (dtype == DType::bf16)
        same = static_cast<const bfloat16*>(y.raw())[k].bits == static_cast<const bfloat16*>(x.raw())[off].bits;
      else
        same = static_cast<const std::uint32_t*>(y.raw())[k] == static_cast<const std::uint32_t*>(x.raw())[off];
    }
    CHECK(same);
  };
  for (const DType dtype : {DType::f32, DType::bf16, DType::i32}) {
    for (const bool flipped : {false, true}) {
      check(Shape{5, 3}, {1, 0}, dtype, flipped);
      check(Shape{33, 65}, {1, 0}, dtype, flipped);
      check(Shape{640, 513}, {1, 0}, dtype, flipped);  // over 2^18 elements: the parallel loop
      check(Shape{3, 31, 70}, {0, 2, 1}, dtype, flipped);
      check(Shape{2, 3, 40, 33}, {0, 1, 3, 2}, dtype, flipped);
      check(Shape{2, 3, 40, 33}, {1, 0, 3, 2}, dtype, flipped);
    }
  }
}

TEST_CASE("conv2d and pooling") {
  // 1 image 3x3x1, 2x2 kernel of ones, VALID: sums of each 2x2 window.
  Array x = Array::from(Shape{1, 3, 3, 1}, {1, 2, 3, 4, 5, 6, 7, 8, 9});
  Array w = Array::ones(Shape{2, 2, 1, 1});
  check_close(conv2d(x, w, {.padding = Padding::valid()}), {12, 16, 24, 28});
  // SAME pads at the end (low 0, high 1) for an even kernel.
  check_close(conv2d(x, w, {.padding = Padding::same()}), {12, 16, 9, 24, 28, 15, 15, 17, 9});
  check_close(conv2d(x, w, {.strides = {2, 2}, .padding = Padding::valid()}), {12});
  check_close(avg_pool(x, {.window = {2, 2}, .strides = {1, 1}}), {3, 4, 6, 7});
  check_close(max_pool(x, {.window = {2, 2}, .strides = {1, 1}}), {5, 6, 8, 9});
  // Depthwise (groups = channels): each channel convolved alone.
  Array x2 = Array::from(Shape{1, 1, 1, 2}, {3, 5});
  Array w2 = Array::from(Shape{1, 1, 1, 2}, {10, 100});
  check_close(conv2d(x2, w2, {.feature_group_count = 2}), {30, 500});
}

TEST_CASE("avg_pool: each window's in-bounds values summed in order and divided, for every channel count, window, padding and dtype") {
  // The reference written out: per output pixel and channel, 0 + the window's in-bounds values
  // (rows, then columns) in float32, divided by the window's size (or, without count_include_pad,
  // by how many were in bounds), rounded once for bf16. Channel counts for each width of the vector
  // loop (16 lanes; the last partial).
  struct Case {
    std::array<std::int64_t, 2> window, strides;
    std::array<std::int64_t, 4> pads;  // top, bottom, left, right
    bool count_include_pad;
  };
  const Case cases[] = {{{2, 2}, {2, 2}, {0, 0, 0, 0}, true},
                        {{3, 3}, {1, 2}, {1, 1, 1, 1}, false},
                        {{3, 2}, {2, 1}, {2, 0, 0, 1}, true},
                        {{5, 5}, {3, 3}, {4, 4, 4, 4}, false}};  // (windows of the pads alone: 0 / 0)
  for (DType dt : {DType::f32, DType::bf16}) {
    for (std::int64_t C : {1, 15, 16, 17, 24, 40, 70})
      for (const Case& k : cases) {
        CAPTURE(C);
        CAPTURE(k.window[0]);
        const std::string dtype_str(dtype_name(dt));
        CAPTURE(dtype_str);
        const Array x = astype(linum::testing::random_array(Shape{3, 9, 7, C}, 90), dt);
        const auto [pt, pb, pl, pr] = k.pads;
        const Array y = avg_pool(x, {.window = k.window, .strides = k.strides, .padding = Padding::explicit_pads(pt, pb, pl, pr),
                                     .count_include_pad = k.count_include_pad});
        CHECK(y.dtype() == dt);
        const std::vector<float> xv = x.to_vector(), yv = y.to_vector();
        const std::int64_t OH = y.dim(1), OW = y.dim(2);
        bool same = true;
        for (std::int64_t n = 0; n < 3; ++n)
          for (std::int64_t oh = 0; oh < OH; ++oh)
            for (std::int64_t ow = 0; ow < OW; ++ow)
              for (std::int64_t c = 0; c < C; ++c) {
                float sum = 0.0f;
                std::int64_t valid = 0;
                for (std::int64_t i = 0; i < k.window[0]; ++i)
                  for (std::int64_t j = 0; j < k.window[1]; ++j) {
                    const std::int64_t ih = oh * k.strides[0] - pt + i, iw = ow * k.strides[1] - pl + j;
                    if (ih < 0 || ih >= 9 || iw < 0 || iw >= 7) continue;
                    sum += xv[((n * 9 + ih) * 7 + iw) * C + c];
                    ++valid;
                  }
                float want = sum / static_cast<float>(k.count_include_pad ? k.window[0] * k.window[1] : valid);
                if (dt == DType::bf16) want = static_cast<float>(bfloat16(want));
                const float got = yv[((n * OH + oh) * OW + ow) * C + c];
                same = same && std::memcmp(&want, &got, sizeof(float)) == 0;
              }
        CHECK(same);
      }
  }
}

TEST_CASE("one Padding type for conv ops, pooling and the Conv layers: modes, ints and pairs spelled as Flax spells them") {
  const Array x = linum::testing::random_array(Shape{2, 5, 4, 3}, 1);
  const Array w = linum::testing::random_array(Shape{3, 2, 3, 4}, 2);
  // Strings (any case) are the named modes; an int pads every side; one pair stands for every axis.
  CHECK(conv2d(x, w, {.padding = "SAME"}).bitwise_equal(conv2d(x, w, {.padding = Padding::same()})));
  CHECK(conv2d(x, w, {.padding = "valid"}).bitwise_equal(conv2d(x, w, {.padding = Padding::valid()})));
  CHECK(conv2d(x, w, {.padding = 1}).bitwise_equal(conv2d(x, w, {.padding = Padding::explicit_pads(1, 1, 1, 1)})));
  CHECK(conv2d(x, w, {.padding = {{2, 1}}}).bitwise_equal(conv2d(x, w, {.padding = Padding::explicit_pads(2, 1, 2, 1)})));
  CHECK(avg_pool(x, {.window = {2, 2}, .padding = "SAME"}).bitwise_equal(avg_pool(x, {.window = {2, 2}, .padding = Padding::same()})));
  CHECK(max_pool(x, {.window = {3, 3}, .padding = 1}).shape() == Shape{2, 5, 4, 3});
  // The layers take the same values: pooling modules and Conv.
  const Array pooled = apply(nn::MaxPool{.window = {3, 3}, .padding = {{1, 1}, {1, 1}}}, Tree{}, x);
  CHECK(pooled.bitwise_equal(max_pool(x, {.window = {3, 3}, .padding = 1})));
  const nn::Conv conv{.features = 4, .kernel_size = {3, 2}, .padding = 1, .use_bias = false};
  const Tree vars = init(conv, rng::key(0), x);
  CHECK(apply(conv, vars, x).bitwise_equal(conv2d(x, vars.at_path("params/kernel").array(), {.padding = 1})));
  // Mode names: one spelling for reading and writing.
  CHECK(Padding("same").mode() == "SAME");
  CHECK(Padding(3).mode().empty());
  CHECK(Padding("CAUSAL") == Padding::causal());
  // Errors name the op and say what to use.
  CHECK_THROWS_WITH_AS(Padding("CIRCULAR"), doctest::Contains("use \"SAME\", \"VALID\""), ValueError);
  CHECK_THROWS_WITH_AS(Padding(-1), doctest::Contains("negative"), ValueError);
  CHECK_THROWS_WITH_AS(max_pool(x, {.window = {2, 2}, .padding = "CAUSAL"}), doctest::Contains("max_pool: CAUSAL padding is for 1-D"),
                       ShapeError);
  CHECK_THROWS_WITH_AS(conv2d(x, w, {.padding = {{1, 1}, {1, 1}, {1, 1}}}), doctest::Contains("3 padding pairs for 2 spatial axes"),
                       ShapeError);
  CHECK_THROWS_WITH_AS(avg_pool(x, {.window = {2, 2}, .padding = {{1, -1}}}), doctest::Contains("negative"), ShapeError);
  CHECK_THROWS_WITH_AS(apply(nn::Conv{.features = 2, .kernel_size = {3, 3}, .padding = "CAUSAL"}, vars, x),
                       doctest::Contains("CAUSAL padding is only implemented for 1-D"), ValueError);
}

TEST_CASE("every op rejects bad shapes, naming the op and the shapes") {
  Array a = Array::zeros(Shape{2, 3});
  Array b = Array::zeros(Shape{4});
  Array labels = Array::from_i32(Shape{2}, {0, 1});
  auto throws = [](auto fn, const char* needle) {
    CAPTURE(needle);
    CHECK_THROWS_WITH_AS(fn(), doctest::Contains(needle), Error);
  };
  throws([&] { return add(a, b); }, "add: shapes (2, 3) and (4,) cannot be broadcast");
  throws([&] { return mul(a, b); }, "mul: shapes (2, 3) and (4,)");
  throws([&] { return div(a, b); }, "div: shapes");
  throws([&] { return maximum(a, b); }, "maximum: shapes");
  throws([&] { return where(a, a, b); }, "where: shapes");
  throws([&] { return exp(labels); }, "exp: needs float32 or bfloat16 input, got int32(2,)");
  throws([&] { return sum(a, {2}); }, "sum: axis 2 is out of range for rank 2");
  throws([&] { return max(a, {0, 0}); }, "max: repeated axis");
  throws([&] { return matmul(a, a); }, "matmul: contracting dimensions differ: float32(2, 3) and float32(2, 3)");
  throws([&] { return dot_general(a, a, {.lhs_contracting = {0}, .rhs_contracting = {1}}); },
         "dot_general: contracting dimensions differ");
  throws([&] { return reshape(a, {4, -1}); }, "reshape: cannot reshape (2, 3)");
  throws([&] { return transpose(a, {0, 0}); }, "transpose: invalid permutation");
  throws([&] { return slice(a, {0, 0}, {3, 1}); }, "slice: axis 0 of shape (2, 3)");
  throws([&] { return concatenate({a, b}, 0); }, "concatenate: along axis 0 cannot join float32(2, 3) with float32(4,)");
  throws([&] { return split(a, 2, 1); }, "split: axis 1 of shape (2, 3) cannot be split into 2");
  throws([&] { return take(a, Array::from_i32(Shape{1}, {5}), 1); }, "take: index 5");
  throws([&] { return take(a, a, 0); }, "take: indices must be int32");
  throws([&] { return one_hot(a, 3); }, "one_hot: labels must be int32");
  throws([&] { return broadcast_to(b, Shape{2, 3}); }, "broadcast_to");
  throws([&] { return softmax(a, {3}); }, "axis 3 is out of range");
  throws([&] { return conv2d(a, a); }, "conv2d: needs x as [N, H, W, C]");
  throws([&] { return conv2d(Array::zeros(Shape{1, 4, 4, 3}), Array::zeros(Shape{3, 3, 2, 4})); },
         "conv2d: input (1, 4, 4, 3) and kernel (3, 3, 2, 4) do not match");
  throws([&] { return conv2d(Array::zeros(Shape{1, 2, 2, 1}), Array::zeros(Shape{3, 3, 1, 1}), {.padding = Padding::valid()}); },
         "does not fit spatial axis 0");
  throws([&] { return avg_pool(a, {}); }, "avg_pool: needs an NHWC array");
  throws([&] { return max_pool(Array::zeros(Shape{1, 1, 1, 1}), {.window = {2, 2}}); }, "max_pool: window");
  throws([&] { return squeeze(a, {0}); }, "squeeze: axis 0 of shape (2, 3) has size 2");
  throws([&] { return Array::from(Shape{2}, {1, 2, 3}); }, "Array::from: shape (2,) holds 2 elements but 3 values");
  throws([&] { return Array().item(); }, "Array::item");
}

TEST_CASE("sizes that overflow are errors naming the shape, not undefined behaviour") {
  CHECK_THROWS_WITH_AS(broadcast_to(Array::ones({1}), Shape{std::int64_t{1} << 62}), doctest::Contains("would need"), ShapeError);
  CHECK_THROWS_WITH_AS(Array::zeros({std::int64_t{1} << 40, std::int64_t{1} << 40}), doctest::Contains("more than 2^63 elements"),
                       ShapeError);
  CHECK_THROWS_AS((Shape{std::int64_t{1} << 62, std::int64_t{1} << 62, 0}.numel()), ShapeError);
  CHECK(Shape{std::int64_t{1} << 40, 0}.numel() == 0);  // an honest empty shape is fine
}

TEST_CASE("conv2d and pooling: geometries that overflow 64 bits are errors, not wrapped sizes") {
  const Array x = Array::ones(Shape{1, 5, 5, 1}), w = Array::ones(Shape{3, 3, 1, 1});
  CHECK_THROWS_WITH_AS(conv2d(x, w, {.dilation = {std::int64_t{1} << 62, 1}}),
                       doctest::Contains("conv2d: the effective window (window - 1) * dilation + 1 on spatial axis 0 overflows 64 bits"),
                       ShapeError);
  const std::int64_t huge = std::numeric_limits<std::int64_t>::max() - 2;
  CHECK_THROWS_WITH_AS(conv2d(x, w, {.padding = Padding::explicit_pads(huge, huge, 0, 0)}),
                       doctest::Contains("the padded size on spatial axis 0 overflows 64 bits"), ShapeError);
  CHECK_THROWS_AS(max_pool(x, {.window = {2, 2}, .strides = {1, 1}, .padding = Padding::explicit_pads(0, 0, huge, huge)}),
                  ShapeError);
  // A legal but extreme stride: computed (Eigen), or a ShapeError naming the geometry when oneDNN
  // refuses it, never oneDNN's own exception.
  try {
    const Array y = conv2d(x, w, {.strides = {std::int64_t{1} << 62, 1}, .padding = Padding::same()});
    CHECK(y.shape() == Shape{1, 1, 5, 1});
  } catch (const ShapeError& e) {
    CHECK(std::string(e.what()).find("conv2d: oneDNN cannot build a convolution of input [1, 5, 5, 1]") != std::string::npos);
  }
}

TEST_CASE("moveaxis, swapaxes, tile and repeat: jnp's values, finite-difference gradients, errors") {
  // x[i][j][k] = 100 i + 10 j + k, shape (2, 3, 4).
  std::vector<float> v;
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j)
      for (int k = 0; k < 4; ++k) v.push_back(static_cast<float>(100 * i + 10 * j + k));
  const Array x = Array::from(Shape{2, 3, 4}, v);
  auto at = [](const Array& a, std::int64_t flat) { return a.data()[flat]; };

  const Array m = moveaxis(x, 0, -1);  // (3, 4, 2): m[j][k][i] = x[i][j][k]
  CHECK(m.shape() == Shape{3, 4, 2});
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j)
      for (int k = 0; k < 4; ++k) CHECK(at(m, (j * 4 + k) * 2 + i) == static_cast<float>(100 * i + 10 * j + k));
  CHECK(moveaxis(x, 2, 0).shape() == Shape{4, 2, 3});
  const Array s = swapaxes(x, 0, 2);  // (4, 3, 2): s[k][j][i] = x[i][j][k]
  CHECK(s.shape() == Shape{4, 3, 2});
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j)
      for (int k = 0; k < 4; ++k) CHECK(at(s, (k * 3 + j) * 2 + i) == static_cast<float>(100 * i + 10 * j + k));

  const Array y = Array::from(Shape{2, 2}, {1, 2, 3, 4});
  const Array t = tile(y, {2, 3});  // np.tile([[1,2],[3,4]], (2, 3))
  CHECK(t.shape() == Shape{4, 6});
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 6; ++c) CHECK(at(t, r * 6 + c) == at(y, (r % 2) * 2 + c % 2));
  CHECK(tile(y, {2}).shape() == Shape{2, 4});         // reps shorter than the rank: the last axes
  CHECK(tile(y, {3, 1, 1}).shape() == Shape{3, 2, 2});  // longer: leading axes
  CHECK(tile(y, {0, 1}).shape() == Shape{0, 2});

  const Array r0 = repeat(y, 2, 0);  // [[1,2],[1,2],[3,4],[3,4]]
  CHECK(r0.shape() == Shape{4, 2});
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 2; ++c) CHECK(at(r0, r * 2 + c) == at(y, (r / 2) * 2 + c));
  const Array r1 = repeat(y, 3, -1);  // each element three times along the last axis
  CHECK(r1.shape() == Shape{2, 6});
  for (int r = 0; r < 2; ++r)
    for (int c = 0; c < 6; ++c) CHECK(at(r1, r * 6 + c) == at(y, r * 2 + c / 3));
  const Array flat = repeat(y, 2);  // no axis: flattened first
  CHECK(flat.shape() == Shape{8});
  CHECK(flat.to_vector() == std::vector<float>{1, 1, 2, 2, 3, 3, 4, 4});

  // Gradients: each output element's cotangent flows back to the element it came from.
  using V = std::vector<Array>;
  const Array w = linum::testing::random_array(Shape{2, 3, 4}, 7);
  CHECK(linum::testing::check_gradients("moveaxis", [](const V& a) { return moveaxis(a[0], 1, 0); }, {w}));
  CHECK(linum::testing::check_gradients("swapaxes", [](const V& a) { return swapaxes(a[0], -1, 0); }, {w}));
  CHECK(linum::testing::check_gradients("tile", [](const V& a) { return tile(a[0], {2, 1, 3}); }, {w}));
  CHECK(linum::testing::check_gradients("repeat", [](const V& a) { return repeat(a[0], 3, 1); }, {w}));
  // A repeated element's gradient is the sum of its copies' cotangents.
  const Array g = grad([](const Array& a) { return sum(repeat(a, 3, 0) * 2.0f); })(y);
  CHECK(g.to_vector() == std::vector<float>{6, 6, 6, 6});

  CHECK_THROWS_WITH_AS(tile(y, {2, -1}), doctest::Contains("tile: reps must be >= 0, got -1"), ValueError);
  CHECK_THROWS_WITH_AS(repeat(y, -2, 0), doctest::Contains("repeat: repeats must be >= 0, got -2"), ValueError);
  CHECK_THROWS_AS(moveaxis(y, 2, 0), ShapeError);
  CHECK_THROWS_AS(swapaxes(y, 0, -3), ShapeError);
  CHECK_THROWS_WITH_AS(tile(y, {std::int64_t{1} << 62, 1}), doctest::Contains("tile"), ShapeError);
}
