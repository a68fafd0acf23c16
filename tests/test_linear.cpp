// The fused dense layer (core/ops/linear.hpp): the same values as the ops it fuses, its gradients
// against finite differences and against those ops, bf16, the bias gradient independent of the
// threads, the errors, and nn::Dense / nn::DenseGeneral on it.
#include <doctest/doctest.h>

#include "testing/gradcheck.hpp"
#include "testing/fp_modes.hpp"
#include "testing/threads.hpp"

#include <linum/core/kernels/gemm.hpp>
#include <linum/core/ops/bf16_table_internal.hpp>

#include <linum/nn/config.hpp>

using namespace linum;
using linum::testing::check_gradients;
using linum::testing::random_array;
using V = std::vector<Array>;

namespace {

constexpr Activation kAll[] = {Activation::none, Activation::relu, Activation::gelu, Activation::gelu_exact,
                               Activation::silu, Activation::tanh, Activation::sigmoid};

// The unfused reference: the product, the bias add and the activation as three ops.
Array unfused(const Array& x, const Array& w, const Array& b, Activation act) {
  Array y = matmul(x, w);
  if (b.defined()) y = y + b;
  return activate(y, act);
}

struct Grads {
  Array value, dx, dw, db;
};

template <class F>
Grads grads_of(F f, const Array& x, const Array& w, const Array& b, const Array& probe) {
  auto [v, dx, dw, db] = value_and_grad<0, 1, 2>([&](const Array& x, const Array& w, const Array& b) {
    return sum(astype(f(x, w, b), DType::f32) * probe);
  })(x, w, b);
  return Grads{v, dx, dw, db};
}

// Largest |a - b| over max |b|.
float relative_error(const Array& a, const Array& b) {
  const Array fa = astype(a, DType::f32), fb = astype(b, DType::f32);
  return max(abs(fa - fb)).item() / std::max(1e-30f, max(abs(fb)).item());
}

}  // namespace

TEST_CASE("linear equals the product, the bias add and the activation: float32 values bitwise, gradients of x and W bitwise") {
  // Rows and columns that are not whole packets or whole row blocks (the backward pass's 64-row blocks).
  const Array x = random_array(Shape{3, 67, 40}, 1), w = random_array(Shape{40, 37}, 2), b = random_array(Shape{37}, 3);
  const Array probe = random_array(Shape{3, 67, 37}, 4);
  for (const Activation act : kAll) {
    CAPTURE(activation_name(act));
    const Grads fused = grads_of([&](const Array& x, const Array& w, const Array& b) { return linear(x, w, b, act); }, x, w, b, probe);
    const Grads plain = grads_of([&](const Array& x, const Array& w, const Array& b) { return unfused(x, w, b, act); }, x, w, b, probe);
    CHECK(linear(x, w, b, act).bitwise_equal(unfused(x, w, b, act)));
    CHECK(fused.value.bitwise_equal(plain.value));
    CHECK(fused.dx.bitwise_equal(plain.dx));
    CHECK(fused.dw.bitwise_equal(plain.dw));
    // The bias gradient is summed in fixed row blocks (another order than sum's): rounding apart.
    CHECK(relative_error(fused.db, plain.db) < 1e-5f);
    // Without a bias.
    CHECK(linear(x, w, Array(), act).bitwise_equal(activate(matmul(x, w), act)));
  }
}

TEST_CASE("linear's gradients match finite differences, with every activation") {
  for (const Activation act : kAll) {
    CAPTURE(activation_name(act));
    // relu's kink: inputs kept away from it by the shift below; the others are smooth.
    CHECK(check_gradients(std::string("linear/") + std::string(activation_name(act)),
                          [act](const V& v) { return linear(v[0], v[1], v[2], act); },
                          {random_array(Shape{5, 4}, 11), random_array(Shape{4, 3}, 12), random_array(Shape{3}, 13, 0.3f, 1.0f)}));
    CHECK(check_gradients(std::string("linear without bias/") + std::string(activation_name(act)),
                          [act](const V& v) { return linear(v[0], v[1], Array(), act); },
                          {random_array(Shape{2, 3, 4}, 14), random_array(Shape{4, 6}, 15)}));
  }
}

TEST_CASE("linear in bfloat16 is the float32 computation rounded: values and gradients within bf16 rounding") {
  const Array x = random_array(Shape{130, 48}, 21), w = random_array(Shape{48, 33}, 22), b = random_array(Shape{33}, 23);
  const Array probe = random_array(Shape{130, 33}, 24);
  auto bf = [](const Array& a) { return astype(a, DType::bf16); };
  for (const Activation act : kAll) {
    CAPTURE(activation_name(act));
    // Operands rounded to bf16 first, then both computed from the same values.
    const Array xb = bf(x), wb = bf(w), bb = bf(b);
    const Array y = linear(xb, wb, bb, act);
    CHECK(y.dtype() == DType::bf16);
    const Array want = unfused(astype(xb, DType::f32), astype(wb, DType::f32), astype(bb, DType::f32), act);
    CHECK(relative_error(y, want) < 2e-2f);
    const Grads g = grads_of([&](const Array& x, const Array& w, const Array& b) { return linear(x, w, b, act); }, xb, wb, bb, probe);
    const Grads r = grads_of([&](const Array& x, const Array& w, const Array& b) { return unfused(x, w, b, act); },
                             astype(xb, DType::f32), astype(wb, DType::f32), astype(bb, DType::f32), probe);
    CHECK(g.db.dtype() == DType::bf16);
    CHECK(relative_error(g.dx, r.dx) < 3e-2f);
    CHECK(relative_error(g.dw, r.dw) < 3e-2f);
    CHECK(relative_error(g.db, r.db) < 3e-2f);
  }
  // A bf16 input with float32 parameters computes in float32 (JAX's promotion), as matmul does.
  CHECK(linear(bf(x), w, b).dtype() == DType::f32);
}

TEST_CASE("linear under remat: gradients bitwise the plain ones for every activation, float32 and bf16") {
  // The recorded forward pass computes gelu's and silu's value with their derivative (in the
  // computation dtype) and keeps it; the checkpoint recomputes the layer and differentiates it again, with or without a
  // policy that saves the op (then its kept derivative comes from the saved values). 520 rows reach
  // the bf16 (value, derivative) table (at least 16384 elements): looked up inside the product on the
  // bf16 panel kernel, else in value_and_derivative's streamed pass.
  const Array w1 = random_array(Shape{40, 40}, 72), w2 = random_array(Shape{40, 33}, 73);
  const Array b1 = random_array(Shape{40}, 74), b2 = random_array(Shape{33}, 75);
  for (const std::int64_t rows : {70, 520})
  for (const DType dt : {DType::f32, DType::bf16}) {
    const Array x = random_array(Shape{rows, 40}, 71);
    CAPTURE(rows);
    for (const Activation act : kAll) {
      CAPTURE(activation_name(act));
      CAPTURE(dtype_short_name(dt));
      auto block = [&](const Array& h, const Array& w, const Array& b) { return linear(h, astype(w, dt), astype(b, dt), act); };
      auto loss = [&](auto&& layer) {
        return value_and_grad<0, 1, 2, 3>([&](const Array& w1, const Array& b1, const Array& w2, const Array& b2) {
          return sum(astype(layer(layer(astype(x, dt), w1, b1), w2, b2), DType::f32));
        })(w1, b1, w2, b2);
      };
      const auto plain = loss(block);
      const auto every = loss(checkpoint(block));
      const auto dots = loss(checkpoint(block, {.policy = policies::dots_saveable{}}));
      for (const auto* other : {&every, &dots}) {
        CHECK(std::get<0>(plain).bitwise_equal(std::get<0>(*other)));
        CHECK(std::get<1>(plain).bitwise_equal(std::get<1>(*other)));
        CHECK(std::get<2>(plain).bitwise_equal(std::get<2>(*other)));
        CHECK(std::get<3>(plain).bitwise_equal(std::get<3>(*other)));
        CHECK(std::get<4>(plain).bitwise_equal(std::get<4>(*other)));
      }
    }
  }
}

TEST_CASE("linear in bf16: gradients bitwise the three ops' on the same rounded product, the kept derivative rounded to bf16") {
  // relu, tanh, sigmoid (and none) keep the output: bitwise the unfused ops. gelu, gelu_exact and
  // silu keep their derivative, computed in the forward pass from the rounded product and rounded to
  // bf16 (the bytes of the product it replaces; no second transcendental in the backward pass): the
  // gradients are the unfused ops' products on g2 = round(g * round(act'(z))), one rounding more
  // than the gelu op's own backward rule makes.
  const Array x = astype(random_array(Shape{65, 48}, 81), DType::bf16), w = astype(random_array(Shape{48, 40}, 82), DType::bf16);
  const Array probe = random_array(Shape{65, 40}, 83);
  auto f32 = [](const Array& a) { return astype(a, DType::f32); };
  auto bf = [](const Array& a) { return astype(a, DType::bf16); };
  for (const Activation act : kAll) {
    CAPTURE(activation_name(act));
    // Without a bias the fused product is the unfused one (one rounding of the same float32 sums).
    auto fused = [&](const Array& x, const Array& w) { return sum(f32(linear(x, w, Array(), act)) * probe); };
    auto [vf, xf, wf] = value_and_grad<0, 1>(fused)(x, w);
    if (!(act == Activation::gelu || act == Activation::gelu_exact || act == Activation::silu)) {
      auto ops = [&](const Array& x, const Array& w) { return sum(f32(activate(matmul(x, w), act)) * probe); };
      auto [vo, xo, wo] = value_and_grad<0, 1>(ops)(x, w);
      CHECK(vf.bitwise_equal(vo));
      CHECK(xf.bitwise_equal(xo));
      CHECK(wf.bitwise_equal(wo));
      continue;
    }
    const Array z = matmul(x, w);
    CHECK(vf.bitwise_equal(sum(f32(activate(z, act)) * probe)));
    // act'(z) in float32, as the activation op's backward rule computes it, then rounded.
    const Array d = bf(grad([&](const Array& t) { return sum(activate(t, act)); })(f32(z)));
    const Array g2 = bf(f32(bf(probe)) * f32(d));  // the cotangent reaching the products
    CHECK(xf.bitwise_equal(dot_general(g2, w, DotDims{.lhs_contracting = {1}, .rhs_contracting = {1}})));
    CHECK(wf.bitwise_equal(dot_general(x, g2, DotDims{.lhs_contracting = {0}, .rhs_contracting = {0}})));
    // and one bf16 rounding from the unfused ops' gradients
    auto ops = [&](const Array& x, const Array& w) { return sum(f32(activate(matmul(x, w), act)) * probe); };
    auto [vo, xo, wo] = value_and_grad<0, 1>(ops)(x, w);
    CHECK(relative_error(xf, xo) < 1.0f / 64);
    CHECK(relative_error(wf, wo) < 1.0f / 64);
  }
}

TEST_CASE("linear in bf16 on every bf16 input: the kept derivative and the value read from a table, the computed bits") {
  // x [65536, 1] holds every bf16 bit pattern and the kernel is [[1]], so the product z is x itself
  // (NaNs quieted): large enough for the table of (value, derivative) pairs; against the float32
  // computation rounded, as in the test above, in both floating-point modes and on two threads.
  const Array x = [] {
    Array a = Array::empty(Shape{65536, 1}, DType::bf16);
    auto* bits = static_cast<bfloat16*>(a.mutable_raw());
    for (std::uint32_t i = 0; i < 65536; ++i) bits[i].bits = static_cast<std::uint16_t>(i);
    return a;
  }();
  const Array w = astype(Array::full(Shape{1, 1}, 1.0f), DType::bf16);
  const Array probe = astype(random_array(Shape{65536, 1}, 85), DType::bf16);
  auto f32 = [](const Array& a) { return astype(a, DType::f32); };
  auto bf = [](const Array& a) { return astype(a, DType::bf16); };
  auto check = [&] {
    for (const Activation act : {Activation::gelu, Activation::gelu_exact, Activation::silu}) {
      CAPTURE(activation_name(act));
      Array y;
      auto fused = [&](const Array& x) {
        y = linear(x, w, Array(), act);
        return sum(f32(y) * f32(probe));
      };
      const std::int64_t reads = linum::ops::detail::g_bf16_table_reads.load();
      const Array dx = grad(fused)(x);
      CHECK(linum::ops::detail::g_bf16_table_reads.load() > reads);  // the pair came from a table
      const Array z = matmul(x, w);
      CHECK(y.detached().bitwise_equal(bf(activate(f32(z), act))));
      // The kept derivative, rounded: dx is the product g2 . [[1]] with g2 = round(probe * d) (row by
      // row; the product turns -0 into +0 and, on AVX512-BF16, subnormals into 0, the same in both).
      const Array d = bf(grad([&](const Array& t) { return sum(activate(t, act)); })(f32(z)));
      const Array g2 = bf(f32(probe) * f32(d));
      CHECK(dx.bitwise_equal(dot_general(g2, w, DotDims{.lhs_contracting = {1}, .rhs_contracting = {1}})));
    }
  };
  linum::testing::in_both_fp_modes(check);
  if (!linum::testing::on_threads(2, check)) MESSAGE("built without OpenMP (or no team of two): not run on two threads");
}

TEST_CASE("linear in bf16 with the pairs looked up inside the product: the table's bits, one thread or two, both fp modes") {
  // On the bf16 panel kernel the recorded forward pass looks each product value's (value,
  // derivative) pair up inside the product (kernels::gemm_bias_pairs). Against the product alone
  // (kernels::gemm_bias: the same sums, bias added before the one rounding), the activation op on
  // it, and the products of the backward rule on round(g * round(act'(z))): bitwise, with and
  // without a bias, at a size the table and the product's threads both reach.
  const Array x = astype(random_array(Shape{2048, 64}, 86), DType::bf16), w = astype(random_array(Shape{64, 48}, 87), DType::bf16);
  const Array b = astype(random_array(Shape{48}, 88), DType::bf16), probe = astype(random_array(Shape{2048, 48}, 89), DType::bf16);
  if (!linum::kernels::uses_bf16_panels(x, false, w, false))
    MESSAGE("this engine or build has no bf16 panel kernel: the pairs come from the pass after the product");
  auto f32 = [](const Array& a) { return astype(a, DType::f32); };
  auto bf = [](const Array& a) { return astype(a, DType::bf16); };
  auto check = [&] {
    for (const Activation act : {Activation::gelu, Activation::gelu_exact, Activation::silu}) {
      for (const bool with_bias : {false, true}) {
        CAPTURE(activation_name(act));
        CAPTURE(with_bias);
        const Array bias = with_bias ? b : Array();
        Array y;
        const Array dx = grad([&](const Array& x) {
          y = linear(x, w, bias, act);
          return sum(f32(y) * f32(probe));
        })(x);
        const Array z = with_bias ? linum::kernels::gemm_bias(x, w, b) : linum::kernels::batched_gemm(x, w, false, false);
        CHECK(y.detached().bitwise_equal(activate(z, act)));
        const Array d = bf(grad([&](const Array& t) { return sum(activate(t, act)); })(f32(z)));
        const Array g2 = bf(f32(probe) * f32(d));
        CHECK(dx.bitwise_equal(dot_general(g2, w, DotDims{.lhs_contracting = {1}, .rhs_contracting = {1}})));
      }
    }
  };
  linum::testing::in_both_fp_modes(check);
  if (!linum::testing::on_threads(2, check)) MESSAGE("built without OpenMP (or no team of two): not run on two threads");
}

TEST_CASE("the streaming pair lookup (the kept derivative written around the caches) gives the plain lookup's values") {
  // Every length around the 64-entry staging run and the 16-lane stores, with the second array
  // 32-byte aligned (the streamed path) and not (the plain loop), against bf16_lookup_pair.
  std::vector<std::uint32_t> table(65536);
  for (std::uint32_t i = 0; i < 65536; ++i) table[i] = i * 2654435761u;
  std::vector<bfloat16> x(2200);
  for (std::size_t i = 0; i < x.size(); ++i) x[i].bits = static_cast<std::uint16_t>(i * 40503u);
  for (const std::int64_t n : {0, 1, 15, 63, 64, 65, 127, 128, 1000, 2048, 2100}) {
    for (const std::int64_t offset : {0, 1}) {
      CAPTURE(n);
      CAPTURE(offset);
      alignas(64) static bfloat16 first[2200], second[2240], want_first[2200], want_second[2240];
      linum::ops::detail::bf16_lookup_pair(table.data(), x.data(), want_first, want_second + offset, n);
      linum::ops::detail::bf16_lookup_pair_streaming(table.data(), x.data(), first, second + offset, n);
      bool same = true;
      for (std::int64_t i = 0; i < n; ++i)
        same = same && first[i].bits == want_first[i].bits && second[offset + i].bits == want_second[offset + i].bits;
      CHECK(same);
    }
  }
}

TEST_CASE("linear's bias gradient has the same bits on one thread and on two") {
  // Large enough for the backward pass to run in parallel.
  const Array x = random_array(Shape{2048, 64}, 31), w = random_array(Shape{64, 256}, 32), b = random_array(Shape{256}, 33);
  const Array probe = random_array(Shape{2048, 256}, 34);
  auto run = [&] {
    return grads_of([&](const Array& x, const Array& w, const Array& b) { return linear(x, w, b, Activation::gelu); }, x, w, b, probe);
  };
  // Two threads for certain (adaptive teams would give one on a busy machine), then one.
  Grads two, one;
  if (!linum::testing::on_threads(2, [&] { two = run(); }) || !linum::testing::on_threads(1, [&] { one = run(); })) {
    MESSAGE("built without OpenMP (or no team of two): one thread only");
    return;
  }
  CHECK(one.db.bitwise_equal(two.db));
  CHECK(one.dx.bitwise_equal(two.dx));
  CHECK(one.dw.bitwise_equal(two.dw));
}

TEST_CASE("weight-gradient products (x^T g) at sizes cut into pieces: the exact sums, the same bits on one thread and two") {
  // At 512 and more output rows and columns x^T g runs in pieces of rows on the serial product (on
  // AVX2 builds each piece's columns of x copied into a row-major buffer first). Odd sizes give a
  // short last piece.
  const std::int64_t k = 700, m = 530, n = 515;
  const Array x = random_array(Shape{k, m}, 41), g = random_array(Shape{k, n}, 42);
  const Array got = kernels::batched_gemm(x, g, true, false);
  REQUIRE(got.shape() == Shape{m, n});
  double worst = 0;
  for (std::int64_t i = 0; i < m; i += 37)
    for (std::int64_t j = 0; j < n; ++j) {
      double want = 0, scale = 0;
      for (std::int64_t q = 0; q < k; ++q) {
        const double p = static_cast<double>(x.data()[q * m + i]) * g.data()[q * n + j];
        want += p;
        scale += std::abs(p);
      }
      worst = std::max(worst, std::abs(got.data()[i * n + j] - want) / scale);
    }
  CHECK(worst < 1e-5);
  Array one, two;
  if (!linum::testing::on_threads(2, [&] { two = kernels::batched_gemm(x, g, true, false); }) ||
      !linum::testing::on_threads(1, [&] { one = kernels::batched_gemm(x, g, true, false); })) {
    MESSAGE("built without OpenMP (or no team of two): one thread only");
    return;
  }
  CHECK(one.bitwise_equal(two));
  CHECK(one.bitwise_equal(got));
}

TEST_CASE("linear on empty shapes: no rows, no input features") {
  for (const Activation act : {Activation::none, Activation::gelu, Activation::relu}) {
    CAPTURE(activation_name(act));
    // K = 0: the product is zero, the result is act(bias) on every row.
    const Array x = Array::zeros(Shape{3, 0}), w = Array::zeros(Shape{0, 4}), b = random_array(Shape{4}, 61);
    const Array y = linear(x, w, b, act);
    CHECK(y.shape() == Shape{3, 4});
    CHECK(y.bitwise_equal(unfused(x, w, b, act)));
    const Array probe = random_array(Shape{3, 4}, 62);
    const Grads g = grads_of([&](const Array& x, const Array& w, const Array& b) { return linear(x, w, b, act); }, x, w, b, probe);
    const Grads r = grads_of([&](const Array& x, const Array& w, const Array& b) { return unfused(x, w, b, act); }, x, w, b, probe);
    CHECK(g.dw.shape() == Shape{0, 4});
    CHECK(relative_error(g.db, r.db) < 1e-6f);
    // M = 0: no rows at all.
    const Array e = linear(Array::zeros(Shape{0, 5}), random_array(Shape{5, 2}, 63), random_array(Shape{2}, 64), act);
    CHECK(e.shape() == Shape{0, 2});
  }
}

TEST_CASE("linear refuses bad operands with a ShapeError naming the shapes") {
  const Array x = random_array(Shape{4, 3}, 41);
  CHECK_THROWS_WITH_AS(linear(x, random_array(Shape{5, 2}, 42)), doctest::Contains("linear: x's last axis (3)"), ShapeError);
  CHECK_THROWS_WITH_AS(linear(x, random_array(Shape{3, 2}, 43), random_array(Shape{3}, 44)),
                       doctest::Contains("the bias must have shape (2,)"), ShapeError);
  CHECK_THROWS_WITH_AS(linear(x, random_array(Shape{3}, 45)), doctest::Contains("the kernel two"), ShapeError);
  CHECK_THROWS_AS(linear(Array::full_i32(Shape{4, 3}, 1), random_array(Shape{3, 2}, 46)), ShapeError);
  CHECK_THROWS_WITH_AS(activation_from_name("swish"), doctest::Contains("one of: none, relu"), ValueError);
}

TEST_CASE("nn::Dense with an activation equals the activation applied after it; DenseGeneral is unchanged") {
  const Array x = random_array(Shape{2, 5, 8}, 51);
  for (const Activation act : kAll) {
    CAPTURE(activation_name(act));
    const nn::Dense fused{.features = 6, .activation = act};
    const Tree vars = init(fused, rng::key(0), x);
    const Array plain = apply(nn::Dense{.features = 6}, vars, x);
    CHECK(apply(fused, vars, x).bitwise_equal(activate(plain, act)));
  }
  // DenseGeneral over two axes, against the contraction written with dot_general.
  const nn::DenseGeneral dg{.features = {3, 2}, .axis = {0, 2}};
  const Tree vars = init(dg, rng::key(1), x);
  const Array kernel = vars.at("params").at("kernel").array(), bias = vars.at("params").at("bias").array();
  auto reference = [](const Array& x, const Array& kernel, const Array& bias) {
    return dot_general(x, kernel, DotDims{.lhs_contracting = {0, 2}, .rhs_contracting = {0, 1}}) + bias;
  };
  const Array want = reference(x, kernel, bias);
  const Array got = apply(dg, vars, x);
  CHECK(got.shape() == want.shape());
  CHECK(relative_error(got, want) < 1e-6f);
  // Its gradients (through the transpose and reshapes into the linear op) as the reference's.
  const Array probe = random_array(want.shape(), 52);
  auto [vg, gx, gk, gb] = value_and_grad<0, 1, 2>([&](const Array& x, const Array& k, const Array& b) {
    Tree v = vars;
    v.set_path("params/kernel", Tree(k));
    v.set_path("params/bias", Tree(b));
    return sum(apply(dg, v, x) * probe);
  })(x, kernel, bias);
  auto [vr, rx, rk, rb] = value_and_grad<0, 1, 2>([&](const Array& x, const Array& k, const Array& b) {
    return sum(reference(x, k, b) * probe);
  })(x, kernel, bias);
  CHECK(relative_error(gx, rx) < 1e-5f);
  CHECK(relative_error(gk, rk) < 1e-5f);
  CHECK(relative_error(gb, rb) < 1e-5f);
  // Over the last axis (no transpose): the same as Dense on the flattened features.
  const nn::DenseGeneral last{.features = {6}};
  const Tree lv = init(last, rng::key(2), x);
  CHECK(apply(last, lv, x).bitwise_equal(apply(nn::Dense{.features = 6}, lv, x)));
}

TEST_CASE("product timing counts every product of a step, with its flops, and nothing outside its scope") {
  const Array x = random_array(Shape{8, 16}, 1), w = random_array(Shape{16, 4}, 2), b = random_array(Shape{4}, 3);
  const Array probe = random_array(Shape{8, 4}, 4);
  const Array xs = random_array(Shape{3, 8, 16}, 5), ws = random_array(Shape{3, 16, 4}, 6);
  const double one = 2.0 * 8 * 16 * 4;  // flops of one [8, 16] x [16, 4] product
  for (const Engine e : {Engine::eigen, Engine::onednn}) {
    if (!engine_available(e)) continue;
    CAPTURE(engine_name(e));
    const Engine previous = engine();
    set_engine(e);
    {
      kernels::ProductTimingScope timing;
      CHECK(kernels::product_timing_on());
      (void)matmul(x, w);
      kernels::ProductTiming t = timing.read();
      CHECK(t.products == 1);
      CHECK(t.flops == one);
      CHECK(t.seconds > 0.0);
      (void)matmul(xs, ws);  // a batch of 3
      t = timing.read();
      CHECK(t.products == 2);
      CHECK(t.flops == 4 * one);
    }
    CHECK_FALSE(kernels::product_timing_on());
    const std::int64_t total = kernels::product_timing().products;
    (void)matmul(x, w);  // after the scope: not counted
    CHECK(kernels::product_timing().products == total);
    {
      // A new scope starts from zero. The fused linear's step: its product with the bias, then the
      // backward pass's two (dx = g W^T, dW = x^T g), all of the same size here.
      kernels::ProductTimingScope timing;
      CHECK(timing.read().products == 0);
      (void)value_and_grad<0, 1, 2>([&](const Array& x, const Array& w, const Array& b) {
        return sum(linear(x, w, b, Activation::gelu) * probe);
      })(x, w, b);
      kernels::ProductTiming t = timing.read();
      CHECK(t.products == 3);
      CHECK(t.flops == 3 * one);
      {
        // A scope inside another counts from its own start; the outer one keeps counting, and
        // timing stays on when the inner one ends.
        kernels::ProductTimingScope inner;
        (void)matmul(x, w);
        CHECK(inner.read().products == 1);
      }
      CHECK(kernels::product_timing_on());
      (void)matmul(x, w);
      t = timing.read();
      CHECK(t.products == 5);
      CHECK(t.flops == 5 * one);
    }
    CHECK_FALSE(kernels::product_timing_on());
    {
      // An empty batch: no flops (not NaN).
      kernels::ProductTimingScope timing;
      (void)matmul(Array::zeros(Shape{0, 8, 16}), Array::zeros(Shape{0, 16, 4}));
      CHECK(timing.read().flops == 0.0);
    }
    set_engine(previous);
  }
}

TEST_CASE("linear with a computation dtype: bitwise the casts and linear, each gradient in its input's dtype, casts folded in bf16") {
  // linear(x, W, b, act, bf16) on float32 parameters is linear(astype(x), astype(W), astype(b), act):
  // the values and every gradient bitwise, the parameters' gradients float32. The casts fold into
  // the op for gelu, gelu_exact and silu, on the bf16 panel kernel (2048 rows, also as [2, 1024] rows
  // of a rank-3 input, and 2047: an odd sum for the weight gradient) or not (2049 rows: the weight
  // gradient leaves the panel kernel; and with the Eigen engine: no panel kernel at all); they stay
  // separate ops for relu and none. With and without a bias, 48 and 40 outputs, a bf16 and a float32
  // input, on one thread and two, in both fp modes. The kernel holds subnormals and values halfway
  // between two bf16 values.
  auto kernel_of = [](std::int64_t n) {
    auto v = random_array(Shape{64, n}, 91).to_vector();
    v[0] = 1e-40f;                // subnormal in float32, kept by the rounding to bf16
    v[1] = -3e-39f;
    v[2] = 1.0f + 1.0f / 256.0f;  // a tie: rounds to even (1.0)
    v[3] = 1.0f + 3.0f / 256.0f;  // a tie: rounds to even (1 + 2^-6)
    return Array::from(Shape{64, n}, v);
  };
  auto bf = [](const Array& a) { return astype(a, DType::bf16); };
  auto check = [&] {
    for (const std::int64_t n : {48, 40}) {
      const Array w = kernel_of(n), b = random_array(Shape{n}, 92);
      for (const std::vector<std::int64_t>& xs : {std::vector<std::int64_t>{2048, 64}, std::vector<std::int64_t>{2, 1024, 64},
                                                   std::vector<std::int64_t>{2047, 64}, std::vector<std::int64_t>{2049, 64}}) {
        for (const DType x_dtype : {DType::bf16, DType::f32}) {
          const Shape x_shape(xs);
          const Array x = astype(random_array(x_shape, 93), x_dtype);
          std::vector<std::int64_t> ps = xs;
          ps.back() = n;
          const Array probe = random_array(Shape(ps), 94);
          for (const Activation act : {Activation::gelu, Activation::gelu_exact, Activation::silu, Activation::relu, Activation::none}) {
            for (const bool with_bias : {true, false}) {
              CAPTURE(n);
              CAPTURE(x_shape);
              CAPTURE(x_dtype);
              CAPTURE(activation_name(act));
              CAPTURE(with_bias);
              Array y;
              bool reads_kernel_itself = false;
              const Grads got = grads_of([&](const Array& x, const Array& w, const Array& b) {
                y = linear(x, w, with_bias ? b : Array(), act, DType::bf16);
                // (the graph is released after the sweep: looked at while it is recorded)
                reads_kernel_itself = std::string_view(y.node()->inputs()[1].node->op()) != "astype";
                return y;
              }, x, w, b, probe);
              const Grads want = grads_of([&](const Array& x, const Array& w, const Array& b) {
                return linear(bf(x), bf(w), with_bias ? bf(b) : Array(), act);
              }, x, w, b, probe);
              CHECK(y.dtype() == DType::bf16);
              CHECK(got.value.bitwise_equal(want.value));
              CHECK(got.dx.dtype() == x_dtype);
              CHECK(got.dx.bitwise_equal(want.dx));
              CHECK(got.dw.dtype() == DType::f32);
              CHECK(got.dw.bitwise_equal(want.dw));
              if (with_bias) CHECK(got.db.bitwise_equal(want.db));
              // Folded: one op reading the float32 kernel itself (no cast node between them),
              // whatever the engine and the shapes.
              CHECK(reads_kernel_itself ==
                    (act == Activation::gelu || act == Activation::gelu_exact || act == Activation::silu));
            }
          }
        }
      }
    }
  };
  linum::testing::in_both_fp_modes(check);
  if (!linum::testing::on_threads(2, check)) MESSAGE("built without OpenMP (or no team of two): not run on two threads");
}

TEST_CASE("linear with a computation dtype: only the gradients asked for, each bitwise the casts and linear's") {
  // The folded op's rule skips what no one needs: x as data (the common case), the kernel or the
  // bias alone, under remat (checkpoint) and not.
  const Array x = astype(random_array(Shape{2048, 64}, 81), DType::bf16), w = random_array(Shape{64, 48}, 82);
  const Array b = random_array(Shape{48}, 83), probe = random_array(Shape{2048, 48}, 84);
  auto run = [&](bool fold, bool remat) {
    auto layer = [fold](const Array& x, const Array& w, const Array& b) {
      return fold ? linear(x, w, b, Activation::gelu, DType::bf16)
                  : linear(x, astype(w, DType::bf16), astype(b, DType::bf16), Activation::gelu);
    };
    auto f = [&, layer, remat](const Array& x, const Array& w, const Array& b) {
      const Array y = remat ? checkpoint(layer)(x, w, b) : layer(x, w, b);
      return sum(astype(y, DType::f32) * probe);
    };
    const auto [v1, dw1] = value_and_grad<1>(f)(x, w, b);
    const auto [v2, db2] = value_and_grad<2>(f)(x, w, b);
    const auto [v3, dx3] = value_and_grad<0>(f)(x, w, b);
    const auto [v4, dw4, db4] = value_and_grad<1, 2>(f)(x, w, b);
    return std::vector<Array>{v1, dw1, db2, dx3, dw4, db4};
  };
  for (const bool remat : {false, true}) {
    CAPTURE(remat);
    const std::vector<Array> got = run(true, remat), want = run(false, false);
    for (std::size_t i = 0; i < got.size(); ++i) {
      CAPTURE(i);
      CHECK(got[i].dtype() == want[i].dtype());
      CHECK(got[i].bitwise_equal(want[i]));
    }
  }
}

TEST_CASE("linear with a computation dtype, differentiated twice: the folded op's create-graph rule is the casts and linear") {
  // A Hessian-vector product in the kernel through the folded op against the same through the
  // explicit casts: bitwise (both run linear's separate ops in create-graph mode).
  const Array x = astype(random_array(Shape{2048, 64}, 95), DType::bf16), b = random_array(Shape{48}, 96);
  const Array w = random_array(Shape{64, 48}, 97), v = random_array(Shape{64, 48}, 98), probe = random_array(Shape{2048, 48}, 99);
  bool folded = false;
  auto loss = [&](bool fold) {
    return [&, fold](const Array& w) {
      const Array y = fold ? linear(x, w, b, Activation::gelu, DType::bf16)
                           : linear(x, astype(w, DType::bf16), astype(b, DType::bf16), Activation::gelu);
      if (fold) folded = std::string_view(y.node()->inputs()[1].node->op()) != "astype";
      return sum(astype(y, DType::f32) * probe);
    };
  };
  const Array got = hvp(loss(true), w, v), want = hvp(loss(false), w, v);
  CHECK(folded);
  CHECK(got.dtype() == DType::f32);
  CHECK(got.bitwise_equal(want));
}

TEST_CASE("linear with a computation dtype refuses a non-float dtype and bad shapes with clear errors") {
  const Array x = random_array(Shape{4, 3}, 1), w = random_array(Shape{3, 2}, 2);
  CHECK_THROWS_AS(linear(x, w, Array(), Activation::gelu, DType::i32), ValueError);
  CHECK_THROWS_AS(linear(x, random_array(Shape{4, 2}, 3), Array(), Activation::gelu, DType::bf16), ShapeError);
  CHECK_THROWS_AS(linear(x, w, random_array(Shape{3}, 4), Activation::gelu, DType::bf16), ShapeError);
}

namespace {
// A stack of fused layers (widths[i] -> widths[i + 1]), rows x widths[0] input, summed against a
// probe: the value and every gradient (x, then each layer's kernel and bias).
struct Stack {
  std::vector<std::int64_t> widths;
  Activation act = Activation::gelu;
  bool fold = true;          // float32 parameters, linear(..., bf16); else bf16 parameters
  bool bias_grads = true;    // the biases differentiated (else constants)
  bool remat = false;        // each layer in its own checkpoint
};
std::vector<Array> stack_grads(const Stack& s, const Array& x, const std::vector<Array>& params, const Array& probe) {
  auto layer = [&s](const Array& h, const Array& w, const Array& b) {
    return s.fold ? linear(h, w, b, s.act, DType::bf16) : linear(h, w, b, s.act);
  };
  auto loss = [&](const std::vector<Array>& p, const Array& x) {
    Array h = x;
    for (std::size_t l = 0; l + 1 < s.widths.size(); ++l) {
      const Array b = s.bias_grads ? p[2 * l + 1] : p[2 * l + 1].detached();
      h = s.remat ? checkpoint(layer)(h, p[2 * l], b) : layer(h, p[2 * l], b);
    }
    return sum(astype(h, DType::f32) * probe);
  };
  auto [value, dp, dx] = value_and_grad<0, 1>(loss)(params, x);
  std::vector<Array> out{value, dx};
  for (std::size_t i = 0; i < dp.size(); ++i)
    if (s.bias_grads || i % 2 == 0) out.push_back(dp[i]);
  return out;
}
// The stack's gradients `got` are bitwise those computed with debug checks on (which check each
// cotangent as computed, so no layer offers its cotangent pass to the next).
void check_equals_debug_checked(const std::vector<Array>& got, const Stack& s, const Array& x, const std::vector<Array>& params,
                                const Array& probe) {
  std::vector<Array> debug_checked;
  {
    DebugNansScope checks(true, true);
    debug_checked = stack_grads(s, x, params, probe);
  }
  REQUIRE(got.size() == debug_checked.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    CHECK(got[i].bitwise_equal(debug_checked[i]));
  }
}
}  // namespace

TEST_CASE("a stack of bf16 linear layers: each input gradient does the layer before's cotangent pass in its product, bitwise") {
  // A layer's input gradient g2 W^T on the bf16 panel kernel multiplies in the layer before's kept
  // derivative (relu: selects by its kept output) and takes its bias sums in the product's
  // epilogue, when that layer offers it (gelu, gelu_exact, silu, relu) and the gradient goes to it
  // alone (relu with float32 parameters casts them first: the casts fold only for the others). The
  // gradients are bitwise those of the separate pass: with debug checks on (which check each
  // cotangent as computed, so nothing is offered) and under remat (each layer's checkpoint is a
  // boundary). Rows that fill the last row tile or not (2048, 2047; also as a [2, 1024, 64] input, a layer's input being its producer's
  // output as it is), widths whose panels are full or masked (64, 48, 40), folded casts or
  // bf16 parameters, biases differentiated or not, one thread and two, both fp modes.
  const std::int64_t before = autodiff::detail::prologues_applied();
  auto check = [&] {
    for (const std::vector<std::int64_t>& lead : {std::vector<std::int64_t>{2048}, std::vector<std::int64_t>{2047},
                                                  std::vector<std::int64_t>{2, 1024}}) {
      for (const Activation act : {Activation::gelu, Activation::silu, Activation::gelu_exact, Activation::relu}) {
        for (const bool fold : {true, false}) {
          for (const bool bias_grads : {true, false}) {
            CAPTURE(lead.size());
            CAPTURE(lead[0]);
            CAPTURE(activation_name(act));
            CAPTURE(fold);
            CAPTURE(bias_grads);
            const Stack s{.widths = {64, 48, 40, 64, 48}, .act = act, .fold = fold, .bias_grads = bias_grads};
            std::vector<Array> params;
            for (std::size_t l = 0; l + 1 < s.widths.size(); ++l) {
              const Array w = random_array(Shape{s.widths[l], s.widths[l + 1]}, 200 + l, -0.5f, 0.5f);
              const Array b = random_array(Shape{s.widths[l + 1]}, 300 + l, -0.5f, 0.5f);
              params.push_back(fold ? w : astype(w, DType::bf16));
              params.push_back(fold ? b : astype(b, DType::bf16));
            }
            auto with_last = [&](std::int64_t last) {
              std::vector<std::int64_t> dims = lead;
              dims.push_back(last);
              return Shape(dims);
            };
            const Array x = astype(random_array(with_last(64), 17), DType::bf16);
            const Array probe = random_array(with_last(48), 18);
            const std::int64_t applied = autodiff::detail::prologues_applied();
            const std::vector<Array> got = stack_grads(s, x, params, probe);
            // Three layers have a layer before them; on the panel kernel each hands it its pass.
            const bool panels = kernels::bf16_panels_take(48, 48);
            CHECK(autodiff::detail::prologues_applied() - applied == (panels ? 3 : 0));
            std::vector<Array> debug_checked;
            {
              DebugNansScope checks(true, true);
              debug_checked = stack_grads(s, x, params, probe);
            }
            Stack r = s;
            r.remat = true;
            const std::int64_t before_remat = autodiff::detail::prologues_applied();
            const std::vector<Array> rematted = stack_grads(r, x, params, probe);
            CHECK(autodiff::detail::prologues_applied() == before_remat);  // a checkpoint per layer: no offers
            REQUIRE(got.size() == debug_checked.size());
            for (std::size_t i = 0; i < got.size(); ++i) {
              CAPTURE(i);
              CHECK(got[i].bitwise_equal(debug_checked[i]));
              CHECK(got[i].bitwise_equal(rematted[i]));
            }
          }
        }
      }
    }
  };
  linum::testing::in_both_fp_modes(check);
  if (!linum::testing::on_threads(2, check)) MESSAGE("built without OpenMP (or no team of two): not run on two threads");
  if (!kernels::bf16_panels_take(48, 48)) MESSAGE("no bf16 panel kernel here: the cotangent passes stayed separate");
  else CHECK(autodiff::detail::prologues_applied() > before);
}

TEST_CASE("a stack of float32 linear layers: the input gradients on the float32 panel kernel do the cotangent passes, bitwise") {
  // The same in float32, on shapes the float32 panel kernel takes (2048 rows, 512 wide): the
  // multiply (gelu, gelu_exact, silu) or the select (relu) and the bias sums in the input
  // gradient's epilogue, bitwise the separate pass.
  for (const Activation act : {Activation::gelu, Activation::gelu_exact, Activation::silu, Activation::relu}) {
    CAPTURE(activation_name(act));
    const Stack s{.widths = {512, 512, 512}, .act = act, .fold = false};
    std::vector<Array> params;
    for (std::size_t l = 0; l + 1 < s.widths.size(); ++l) {
      params.push_back(random_array(Shape{512, 512}, 400 + l, -0.05f, 0.05f));
      params.push_back(random_array(Shape{512}, 500 + l));
    }
    const Array x = random_array(Shape{2048, 512}, 19), probe = random_array(Shape{2048, 512}, 20);
    const std::int64_t applied = autodiff::detail::prologues_applied();
    const std::vector<Array> got = stack_grads(s, x, params, probe);
    const Array g2_probe = random_array(Shape{2048, 512}, 21);
    const bool panels = kernels::uses_f32_panels(g2_probe, false, params[0], true);
    CHECK(autodiff::detail::prologues_applied() - applied == (panels ? 1 : 0));
    if (!panels) MESSAGE("no float32 panel kernel here: the cotangent pass stayed separate");
    for (const Array& g : got) CHECK(g.dtype() == DType::f32);
    check_equals_debug_checked(got, s, x, params, probe);
  }
}

TEST_CASE("a stack of bf16 linear layers with widened products: the input gradients do the cotangent passes, bitwise") {
  // Under bf16_products() == widened (Intel CPUs without AMX), on shapes the float32 panel kernel
  // takes (2048 rows, 512 wide): the products read the bf16 operands widened (gemm_f32_panels_widened)
  // and the input gradient does the layer before's multiply or select and bias sums in its
  // epilogue, bitwise the separate pass (debug checks on: nothing offered); folded casts (float32
  // parameters) or bf16 parameters; both fp modes.
  if (!engine_available(Engine::onednn)) return;
  const Engine engine_before = engine();
  const Bf16Products products_before = bf16_products();
  set_engine(Engine::onednn);
  set_bf16_products(Bf16Products::widened);
  auto check = [&] {
    for (const Activation act : {Activation::gelu, Activation::gelu_exact, Activation::silu, Activation::relu}) {
      for (const bool fold : {true, false}) {
        CAPTURE(activation_name(act)); CAPTURE(fold); CAPTURE(flush_denormals());
        const Stack s{.widths = {512, 512, 512}, .act = act, .fold = fold};
        std::vector<Array> params;
        for (std::size_t l = 0; l + 1 < s.widths.size(); ++l) {
          const Array w = random_array(Shape{512, 512}, 600 + l, -0.05f, 0.05f), b = random_array(Shape{512}, 700 + l);
          params.push_back(fold ? w : astype(w, DType::bf16));
          params.push_back(fold ? b : astype(b, DType::bf16));
        }
        const Array x = astype(random_array(Shape{2048, 512}, 22), DType::bf16), probe = random_array(Shape{2048, 512}, 23);
        const std::int64_t applied = autodiff::detail::prologues_applied();
        const std::vector<Array> got = stack_grads(s, x, params, probe);
        const Array g2_probe = astype(random_array(Shape{2048, 512}, 24), DType::bf16);
        const bool widened_panels = kernels::uses_f32_panels_widened(g2_probe, false, astype(params[0], DType::bf16), true);
        CHECK(autodiff::detail::prologues_applied() - applied == (widened_panels ? 1 : 0));
        check_equals_debug_checked(got, s, x, params, probe);
      }
    }
  };
  linum::testing::in_both_fp_modes(check);
  if (!kernels::f32_panels_widened_available()) MESSAGE("no widened bf16 panel kernel here: the cotangent passes stayed separate");
  set_bf16_products(products_before);
  set_engine(engine_before);
}

TEST_CASE("the layer before's cotangent pass stays its own where its output has other cotangents") {
  // h1 = linear(x, W1), y = linear(h1, W2). When h1 also reaches the loss another way (a second
  // consumer, recorded before the layer or after it), or is itself an output given a cotangent (vjp
  // of both), its cotangent is a sum: the layer after must not apply the pass to its part alone. Bitwise the debug-checked gradients (no
  // offers there), and nothing offered.
  const Array x = astype(random_array(Shape{2048, 64}, 41), DType::bf16);
  const Array w1 = random_array(Shape{64, 48}, 42, -0.5f, 0.5f), b1 = random_array(Shape{48}, 43);
  const Array w2 = random_array(Shape{48, 64}, 44, -0.5f, 0.5f), b2 = random_array(Shape{64}, 45);
  const Array p1 = random_array(Shape{2048, 48}, 46), p2 = random_array(Shape{2048, 64}, 47);
  // (the other consumer recorded after the layer, so its part arrives first in the sweep, or before
  // it, so the layer's part arrives first)
  auto two_consumers = [&](const std::vector<Array>& p) {
    const Array h1 = linear(x, p[0], p[1], Activation::gelu, DType::bf16);
    const Array y = linear(h1, p[2], p[3], Activation::gelu, DType::bf16);
    return sum(astype(y, DType::f32) * p2) + sum(astype(h1, DType::f32) * p1);
  };
  auto other_consumer_first = [&](const std::vector<Array>& p) {
    const Array h1 = linear(x, p[0], p[1], Activation::gelu, DType::bf16);
    const Array other = sum(astype(h1, DType::f32) * p1);
    const Array y = linear(h1, p[2], p[3], Activation::gelu, DType::bf16);
    return sum(astype(y, DType::f32) * p2) + other;
  };
  auto both_outputs = [&](const std::vector<Array>& p) {
    const Array h1 = linear(x, p[0], p[1], Activation::silu, DType::bf16);
    return std::vector<Array>{h1, linear(h1, p[2], p[3], Activation::silu, DType::bf16)};
  };
  const std::vector<Array> params{w1, b1, w2, b2};
  auto run = [&] {
    std::vector<Array> out = grad(two_consumers)(params);
    for (const Array& g : grad(other_consumer_first)(params)) out.push_back(g);
    auto [ys, pullback] = vjp(both_outputs, params);
    for (const Array& g : pullback(std::vector<Array>{astype(p1, DType::bf16), astype(p2, DType::bf16)})) out.push_back(g);
    return out;
  };
  const std::int64_t before = autodiff::detail::prologues_applied();
  const std::vector<Array> got = run();
  CHECK(autodiff::detail::prologues_applied() == before);
  std::vector<Array> want;
  {
    DebugNansScope checks(true, true);
    want = run();
  }
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    CHECK(got[i].bitwise_equal(want[i]));
  }
}
