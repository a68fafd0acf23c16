// The autodiff API and graph: values, gradients w.r.t. several arguments, vjp, stop_gradient,
// no-grad, per-thread state, memory released after backward, deep graphs, misuse errors.
#include <doctest/doctest.h>
#include <linum/linum.hpp>

#include "testing/gradcheck.hpp"

#include <thread>

using namespace linum;
using linum::testing::random_array;

namespace {
// An aux of a user's own type: a registered pytree (its array is detached), an int carried along.
struct Stats {
  Array mean;
  int count = 0;
};
}  // namespace
template <>
struct linum::pytree::Fields<Stats> {
  static auto of(Stats& s) { return std::tie(s.mean); }
};

TEST_CASE("value_and_grad of a simple function") {
  Array x = Array::from(Shape{3}, {1, 2, 3});
  auto [v, g] = value_and_grad([](const Array& a) { return sum(a * a); })(x);
  CHECK(v.item() == doctest::Approx(14));
  CHECK(g.to_vector() == std::vector<float>{2, 4, 6});
  CHECK(v.node() == nullptr);  // results are detached
}

TEST_CASE("gradients with respect to several arguments, others pass through") {
  Array w = Array::from(Shape{2, 2}, {1, 2, 3, 4});
  Array x = Array::from(Shape{1, 2}, {1, -1});
  auto f = [](const Array& w, const Array& x, float scale) { return sum(matmul(x, w)) * scale; };
  auto [v, dw, dx] = value_and_grad<0, 1>(f)(w, x, 2.0f);  // one flat structure
  CHECK(v.item() == doctest::Approx(2 * ((1 - 3) + (2 - 4))));
  CHECK(dw.to_vector() == std::vector<float>{2, 2, -2, -2});
  CHECK(dx.to_vector() == std::vector<float>{2 * 3, 2 * 7});
  auto only_x = grad<1>(f)(w, x, 1.0f);
  CHECK(only_x.to_vector() == std::vector<float>{3, 7});
}

TEST_CASE("has_aux: auxiliary outputs come back detached") {
  Array x = Array::from(Shape{2}, {3, 4});
  auto [v, aux, g] = value_and_grad([](const Array& a) { return std::make_pair(sum(a * a), a * 2.0f); })(x);
  CHECK(v.item() == doctest::Approx(25));
  CHECK(aux.to_vector() == std::vector<float>{6, 8});
  CHECK(aux.node() == nullptr);
  CHECK(g.to_vector() == std::vector<float>{6, 8});
}

TEST_CASE("has_aux: any pytree aux comes back detached (vectors, tuples, nested, with non-array members)") {
  Array x = Array::from(Shape{2}, {3, 4});
  auto [v, aux, g] = value_and_grad([](const Array& a) {
    using Aux = std::tuple<std::vector<Array>, std::pair<Array, int>, Tree>;
    return std::make_pair(sum(a * a), Aux{{a * 2.0f, a + 1.0f}, {a * a, 7}, Tree{{"h", Tree(a * 3.0f)}}});
  })(x);
  const auto& [list, pair, tree] = aux;
  CHECK(list[0].to_vector() == std::vector<float>{6, 8});
  CHECK(list[1].to_vector() == std::vector<float>{4, 5});
  CHECK(pair.first.to_vector() == std::vector<float>{9, 16});
  CHECK(pair.second == 7);
  for (const Array& a : {list[0], list[1], pair.first, tree.at("h").array()}) CHECK(a.node() == nullptr);
  CHECK(g.to_vector() == std::vector<float>{6, 8});
}

TEST_CASE("several argnums with an aux: one flat structure (value, aux, one gradient per argnum), any pytree aux") {
  const Array w = Array::from(Shape{2}, {1, 2}), x = Array::from(Shape{2}, {3, 4});
  auto f = [](const Array& w, const Array& x) { return std::make_pair(sum(w * x), Stats{mean(x * w), 2}); };
  auto [v, stats, dw, dx] = value_and_grad<0, 1>(f)(w, x);
  CHECK(v.item() == doctest::Approx(11));
  CHECK(stats.mean.item() == doctest::Approx(5.5));
  CHECK(stats.count == 2);
  CHECK(stats.mean.node() == nullptr);
  CHECK(dw.to_vector() == std::vector<float>{3, 4});
  CHECK(dx.to_vector() == std::vector<float>{1, 2});
  // grad drops value and aux: the gradients alone, a tuple with several argnums.
  auto [gw, gx] = grad<0, 1>(f)(w, x);
  CHECK(gw.bitwise_equal(dw));
  CHECK(gx.bitwise_equal(dx));
  // Nested in another transformation, the same flat structure, linked to the outer graph.
  const Array outer = grad([&](const Array& s) {
    auto [inner_v, inner_stats, inner_dw, inner_dx] = value_and_grad<0, 1>(f)(w * s, x);
    return sum(inner_dw) * inner_v + inner_stats.mean;
  })(Array::full(Shape{}, 1.0f));
  // d/ds [sum(x) * s * (w.x) + s * mean(x * w)] at s = 1 = 7 * 11 + 5.5
  CHECK(outer.item() == doctest::Approx(7 * 11 + 5.5));
}

TEST_CASE("unused arguments get zero gradients; a variable used twice accumulates") {
  Array x = Array::from(Shape{2}, {1, 2});
  Array y = Array::from(Shape{2}, {5, 5});
  auto [v, gx, gy] = value_and_grad<0, 1>([](const Array& a, const Array&) { return sum(a * a + a); })(x, y);
  CHECK(gx.to_vector() == std::vector<float>{3, 5});
  CHECK(gy.to_vector() == std::vector<float>{0, 0});
}

TEST_CASE("vjp keeps its graph and can be pulled back several times") {
  Array x = Array::from(Shape{3}, {1, 2, 3});
  auto [y, pullback] = vjp([](const Array& a) { return a * a; }, x);
  CHECK(y.to_vector() == std::vector<float>{1, 4, 9});
  CHECK(pullback(Array::ones(Shape{3})).to_vector() == std::vector<float>{2, 4, 6});
  CHECK(pullback(Array::from(Shape{3}, {1, 0, 2})).to_vector() == std::vector<float>{2, 0, 12});
}

TEST_CASE("stop_gradient and NoGradGuard") {
  Array x = Array::from(Shape{2}, {1, 2});
  auto g = grad([](const Array& a) { return sum(a * stop_gradient(a)); })(x);
  CHECK(g.to_vector() == std::vector<float>{1, 2});
  auto g2 = grad([](const Array& a) {
    Array c;
    {
      autodiff::NoGradGuard off;
      c = a * 10.0f;
    }
    return sum(a + c);
  })(x);
  CHECK(g2.to_vector() == std::vector<float>{1, 1});
  // grad records even when called under a NoGradGuard.
  autodiff::NoGradGuard outer;
  CHECK(grad([](const Array& a) { return sum(a * 3.0f); })(x).to_vector() == std::vector<float>{3, 3});
}

TEST_CASE("recording state is per thread") {
  autodiff::NoGradGuard off_here;
  bool other_thread_records = false;
  std::thread t([&] { other_thread_records = autodiff::is_recording(); });
  t.join();
  CHECK(other_thread_records);
  CHECK_FALSE(autodiff::is_recording());
}

TEST_CASE("graph memory is released after backward") {
  const Array w = random_array(Shape{64, 64}, 1);
  const Array x = random_array(Shape{32, 64}, 2);
  const auto before = memory::stats().live_bytes;
  {
    auto [v, g] = value_and_grad([](const Array& w, const Array& x) {
      Array h = x;
      for (int i = 0; i < 10; ++i) h = tanh(matmul(h, w));
      return mean(h);
    })(w, x);
    // Only the value and the gradient survive.
    CHECK(memory::stats().live_bytes - before == static_cast<std::int64_t>(v.nbytes() + g.nbytes()));
  }
  CHECK(memory::stats().live_bytes == before);
}

TEST_CASE("saved arrays are freed during the sweep, not after it") {
  // A chain of L tanh layers keeps L outputs; the backward sweep frees each as it passes, so the
  // peak during backward is not above the peak at the end of the forward pass.
  const Array x = random_array(Shape{1000}, 3);
  Array y;
  auto leaf = autodiff::make_leaf(x);
  {
    Array h = leaf;
    for (int i = 0; i < 50; ++i) h = tanh(h);
    y = sum(h);
  }
  const auto after_forward = memory::stats().live_bytes;
  memory::PeakScope scope;
  Array one = Array::ones(Shape{});
  autodiff::backward(std::span<const Array>(&y, 1), std::span<const Array>(&one, 1));
  CHECK(scope.peak_bytes() <= after_forward + 3 * 4000);
  CHECK(memory::stats().live_bytes < after_forward - 40 * 4000);
}

TEST_CASE("deep graphs do not overflow the stack") {
  Array x = Array::from(Shape{1}, {0.5f});
  auto g = grad([](const Array& a) {
    Array h = a;
    for (int i = 0; i < 200000; ++i) h = h + 0.0f;
    return sum(h);
  })(x);
  CHECK(g.item() == 1.0f);
}

TEST_CASE("misuse gives clear errors") {
  Array x = Array::from(Shape{2}, {1, 2});
  CHECK_THROWS_WITH_AS(value_and_grad([](const Array& a) { return a * 2.0f; })(x),
                       doctest::Contains("must return a float scalar"), AutodiffError);
  Array labels = Array::from_i32(Shape{2}, {0, 1});
  CHECK_THROWS_WITH_AS(grad([](const Array& a) { return sum(astype(a, DType::f32)); })(labels),
                       doctest::Contains("only float32 and bfloat16 arrays can be differentiated"), AutodiffError);
  // Reusing a graph that a backward pass has consumed.
  Array leaf = autodiff::make_leaf(x);
  Array y = sum(exp(leaf));
  Array one = Array::ones(Shape{});
  autodiff::backward(std::span<const Array>(&y, 1), std::span<const Array>(&one, 1));
  CHECK_THROWS_WITH_AS(autodiff::backward(std::span<const Array>(&y, 1), std::span<const Array>(&one, 1)),
                       doctest::Contains("already used by a backward pass"), AutodiffError);
}

TEST_CASE("debug_nans / debug_infs name the op and the phase where a non-finite value first appears") {
  const Array x = Array::from(Shape{3}, {1.0f, -2.0f, 4.0f});
  auto message_of = [](auto&& f) {
    try {
      f();
    } catch (const FloatingPointError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  // Off by default: NaN passes silently.
  CHECK_NOTHROW(grad([](const Array& v) { return sum(log(v)); })(x));
  {
    DebugNansScope on;
    const std::string m = message_of([&] { grad([](const Array& v) { return sum(log(v) * 2.0f); })(x); });
    CHECK(m.find("debug_nans: op 'log' produced NaN in the forward pass (f32[3], first at flat index 1; inputs f32[3])") !=
          std::string::npos);
    // A NaN born in the backward pass: d/dx sqrt(x) * 0 at x = 0 is 0 * inf.
    const std::string b = message_of([&] {
      grad([](const Array& v) { return sum(sqrt(v) * 0.0f); })(Array::from(Shape{2}, {0.0f, 1.0f}));
    });
    CHECK(b.find("the backward rule of op 'sqrt' produced, as the gradient of its input 0, NaN in the backward pass") !=
          std::string::npos);
    // Infinities only with debug_infs.
    CHECK(message_of([&] { grad([](const Array& v) { return sum(exp(v * 100.0f)); })(x); }) == "no error");
  }
  {
    DebugNansScope both(true, true);
    CHECK(message_of([&] { grad([](const Array& v) { return sum(exp(v * 100.0f)); })(x); }).find("debug_infs: op 'exp' produced inf") !=
          std::string::npos);
  }
  CHECK_FALSE(debug_nans());
  CHECK_FALSE(debug_infs());
}

TEST_CASE("debug_nans inside a module names the module path; in a checkpointed block, the recomputation") {
  struct Logger {
    Array operator()(Scope& s, const Array& x) const { return log(x * s.param("w", initializers::ones(), Shape{x.dim(-1)})); }
  };
  struct Host {
    Array operator()(Scope& s, const Array& x) const { return s(Logger{}, x) * 2.0f; }
  };
  const Array x = Array::from(Shape{2}, {1.0f, -1.0f});
  Tree vars = init(Host{}, rng::key(0), Array::ones(Shape{2}));
  DebugNansScope on;
  try {
    grad([&](const Tree& p) { return sum(apply(Host{}, Tree{{"params", p}}, x)); })(vars.at("params"));
    CHECK(false);
  } catch (const FloatingPointError& e) {
    const std::string what = e.what();
    CAPTURE(what);
    CHECK(std::string(e.what()).find("in module 'Logger_0' (Logger): debug_nans: op 'log' produced NaN") != std::string::npos);
  }
  // A block that is finite when first run and NaN when recomputed.
  int calls = 0;
  auto block = checkpoint([&calls](const Array& v) { return sqrt(v - static_cast<float>(10 * calls++)); });
  try {
    grad([&](const Array& v) { return sum(block(v)); })(Array::from(Shape{2}, {1.0f, 2.0f}));
    CHECK(false);
  } catch (const FloatingPointError& e) {
    CHECK(std::string(e.what()).find("op 'sqrt' produced NaN in the recomputation of a checkpointed block") != std::string::npos);
  }
}

namespace {
// A user op declaring a cotangent prologue: y = x * d (d a constant it keeps), whose rule first
// multiplies its cotangent by d, unless the op computing that cotangent already did.
Array times_kept(const Array& x, const Array& d) {
  Array y = autodiff::primitive(
      "times_kept", {&x},
      [&](autodiff::Residuals& r) {
        r.keep(d);
        return x * d;
      },
      [](autodiff::Cotangents& c, autodiff::Saved s) { c.set(0, c.prologue_applied() ? c.out() : c.out() * s[0]); });
  if (y.node() != nullptr) y.node()->set_cotangent_prologue(autodiff::CotangentPrologue{.derivative = 0});
  return y;
}
// A consumer y = 3 x whose rule applies its input's producer's prologue when offered (`apply`), then,
// with `then_plain`, hands a plain cotangent after all; with `twice`, it takes the offers of both of
// its inputs (x and z), which the protocol refuses.
int g_offers = 0;
Array thrice(const Array& x, bool apply, bool then_plain, const Array& z = Array()) {
  auto rule = [apply, then_plain, has_z = z.defined()](autodiff::Cotangents& c, autodiff::Saved) {
    const Array g = c.out() * 3.0f;
    for (std::size_t i = 0; i < (has_z ? 2u : 1u); ++i) {
      if (auto offer = c.producer_prologue(i)) {
        ++g_offers;
        if (apply) c.set_with_prologue(i, g * *offer->derivative, Array());
        if (then_plain || !apply) c.set(i, g);
      } else {
        c.set(i, g);
      }
    }
  };
  if (z.defined()) return autodiff::primitive("thrice", {&x, &z}, [&](autodiff::Residuals&) { return x * 3.0f + z; }, rule);
  return autodiff::primitive("thrice", {&x}, [&](autodiff::Residuals&) { return x * 3.0f; }, rule);
}
}  // namespace

TEST_CASE("cotangent prologues: offered only to a producer's sole consumer, applied once, the same gradient either way") {
  // d(sum(thrice(x * d))) / dx = 3 d, whether the consumer applies the producer's prologue (offered:
  // one consumer, an empty slot) or not; never offered when the producer's output has a second
  // consumer, is a root given its own cotangent, or debug checks are on; a consumer that takes the
  // offer and then hands a plain cotangent leaves the producer to apply it itself; taking two offers
  // in one rule is an AutodiffError.
  const Array x = Array::from(Shape{4}, {1.0f, -2.0f, 3.0f, 0.5f}), d = Array::from(Shape{4}, {2.0f, 5.0f, -1.0f, 4.0f});
  const Array want = Array::from(Shape{4}, {6.0f, 15.0f, -3.0f, 12.0f});
  for (const bool apply : {true, false}) {
    for (const bool then_plain : {false, true}) {
      CAPTURE(apply);
      CAPTURE(then_plain);
      g_offers = 0;
      const std::int64_t applied = autodiff::detail::prologues_applied();
      CHECK(grad([&](const Array& x) { return sum(thrice(times_kept(x, d), apply, then_plain)); })(x).bitwise_equal(want));
      CHECK(g_offers == 1);
      CHECK(autodiff::detail::prologues_applied() - applied == (apply && !then_plain ? 1 : 0));
    }
  }
  g_offers = 0;
  // a second consumer (recorded after, so its part arrives first; and before)
  CHECK(grad([&](const Array& x) { const Array h = times_kept(x, d); return sum(thrice(h, true, false)) + sum(h); })(x)
            .bitwise_equal(Array::from(Shape{4}, {8.0f, 20.0f, -4.0f, 16.0f})));
  CHECK(grad([&](const Array& x) { const Array h = times_kept(x, d); const Array s = sum(h); return sum(thrice(h, true, false)) + s; })(x)
            .bitwise_equal(Array::from(Shape{4}, {8.0f, 20.0f, -4.0f, 16.0f})));
  {
    DebugNansScope checks;
    CHECK(grad([&](const Array& x) { return sum(thrice(times_kept(x, d), true, false)); })(x).bitwise_equal(want));
  }
  auto [ys, pullback] = vjp([&](const Array& x) {
    const Array h = times_kept(x, d);
    return std::vector<Array>{h, thrice(h, true, false)};
  }, x);
  CHECK(pullback(std::vector<Array>{Array::ones(Shape{4}), Array::ones(Shape{4})})
            .bitwise_equal(Array::from(Shape{4}, {8.0f, 20.0f, -4.0f, 16.0f})));
  CHECK(g_offers == 0);
  // two offers taken in one rule
  CHECK_THROWS_AS(grad([&](const Array& x) { return sum(thrice(times_kept(x, d), true, false, times_kept(x * 2.0f, d))); })(x),
                  AutodiffError);
}
