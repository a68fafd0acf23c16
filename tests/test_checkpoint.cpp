// linum::checkpoint on plain functions: values and gradients bitwise equal to the plain function,
// recompute counts, policies keep exactly what they promise, captured arrays, static arguments,
// nesting and recursive checkpointing, verification, memory.
#include <doctest/doctest.h>
#include <linum/linum.hpp>

#include "testing/gradcheck.hpp"

#include <cmath>

using namespace linum;
using linum::testing::random_array;

namespace {

// g(W, x) = sin-like(W x) with a chain of ops; counts its calls.
int g_calls = 0;
Array g(const Array& w, const Array& x) {
  ++g_calls;
  return tanh(matmul(x, w));
}

}  // namespace

TEST_CASE("checkpointed values and gradients equal the plain function's, bit for bit") {
  const Array w1 = random_array(Shape{4, 5}, 1), w2 = random_array(Shape{5, 6}, 2), x = random_array(Shape{3, 4}, 3);
  auto plain = [](const Array& a, const Array& b, const Array& x) { return sum(g(b, g(a, x))); };
  auto rematted = [](const Array& a, const Array& b, const Array& x) {
    return sum(checkpoint(g)(b, checkpoint(g)(a, x)));
  };
  auto [v1, a1, b1, x1] = value_and_grad<0, 1, 2>(plain)(w1, w2, x);
  auto [v2, a2, b2, x2] = value_and_grad<0, 1, 2>(rematted)(w1, w2, x);
  CHECK(v1.bitwise_equal(v2));
  CHECK(a1.bitwise_equal(a2));
  CHECK(b1.bitwise_equal(b2));
  CHECK(x1.bitwise_equal(x2));
  // And the gradients are right.
  CHECK(linum::testing::check_gradients("checkpoint(g)", [&](const std::vector<Array>& v) {
    return checkpoint(g)(v[0], v[1]);
  }, {w1, x}));
}

TEST_CASE("recompute counts: once more under nothing_saveable, not at all under everything_saveable") {
  const Array w = random_array(Shape{4, 4}, 4), x = random_array(Shape{2, 4}, 5);
  for (const auto& [policy_case, expected] : {std::pair{lift::Policy(policies::nothing_saveable{}), 2},
                                              std::pair{lift::Policy(policies::everything_saveable{}), 1},
                                              std::pair{lift::Policy(policies::dots_saveable{}), 2}}) {
    const lift::Policy& policy = policy_case;  // a variable the lambdas below can capture (clang 14)
    CAPTURE(policy.description());
    g_calls = 0;
    auto f = checkpoint(g, {.policy = policy});
    auto grads = grad([&](const Array& w) { return sum(f(w, x)); })(w);
    CHECK(g_calls == expected);
  }
  // Without differentiation nothing is recomputed.
  g_calls = 0;
  (void)checkpoint(g)(w, x);
  CHECK(g_calls == 1);
}

TEST_CASE("dots_saveable reuses the saved products: the recomputation runs no matmul") {
  const Array w = random_array(Shape{4, 4}, 4), x = random_array(Shape{2, 4}, 5);
  lift::reset_recompute_stats();
  auto f = checkpoint(g, {.policy = policies::dots_saveable{}});
  auto gw = grad([&](const Array& w) { return sum(f(w, x)); })(w);
  const auto stats = lift::recompute_stats();
  CHECK(stats.values_saved == 1);
  CHECK(stats.ops_replayed == 1);    // the matmul
  CHECK(stats.ops_recomputed == 1);  // the tanh
  CHECK(gw.bitwise_equal(grad([&](const Array& w) { return sum(g(w, x)); })(w)));
}

TEST_CASE("a saved named value is not recomputed, nor the product that only fed it (dead code); gradients stay bitwise") {
  // proj = name(x w1); y = tanh(proj) w2. Under save_only_these_names({"proj"}) the replay takes
  // proj from the forward pass, so x w1 is needed by nothing: JAX leaves it out, so do we.
  const Array w1 = random_array(Shape{6, 8}, 30), w2 = random_array(Shape{8, 3}, 31), x = random_array(Shape{5, 6}, 32);
  auto block = [](const Array& a, const Array& b, const Array& in) {
    return matmul(tanh(checkpoint_name(matmul(in, a), "proj")), b);
  };
  auto loss = [&](auto&& f) {
    return grad([&](const std::vector<Array>& p) { return sum(f(p[0], p[1], x)); })(std::vector<Array>{w1, w2});
  };
  const auto plain = loss(block);
  lift::reset_recompute_stats();
  const auto named = loss(checkpoint(block, {.policy = policies::save_only_these_names({"proj"})}));
  const auto stats = lift::recompute_stats();
  CHECK(stats.values_saved == 1);
  CHECK(stats.ops_replayed == 1);    // checkpoint_name: the saved value
  CHECK(stats.ops_eliminated == 1);  // x w1: only the saved value needed it
  CHECK(stats.ops_recomputed == 2);  // tanh (the next product keeps its output) and the last product
  CHECK(stats.full_reruns == 0);
  for (int i = 0; i < 2; ++i) CHECK(named[static_cast<std::size_t>(i)].bitwise_equal(plain[static_cast<std::size_t>(i)]));
  // Without a saved name, nothing is left out.
  lift::reset_recompute_stats();
  (void)loss(checkpoint(block));
  CHECK(lift::recompute_stats().ops_eliminated == 0);
  CHECK(lift::recompute_stats().ops_recomputed == 4);
}

TEST_CASE("a left-out value read outside the graph is detected and the block is replayed in full, still bitwise") {
  // The block reads x w1 through a detached copy (invisible to the graph) to pick a scale.
  const Array w1 = random_array(Shape{6, 8}, 33), w2 = random_array(Shape{8, 3}, 34), x = random_array(Shape{5, 6}, 35);
  auto block = [](const Array& a, const Array& b, const Array& in) {
    const Array h = matmul(in, a);
    const float s = max(h.detached()).item() > 0.0f ? 2.0f : 3.0f;
    return matmul(tanh(checkpoint_name(h, "proj") * s), b);
  };
  auto loss = [&](auto&& f) {
    return grad([&](const std::vector<Array>& p) { return sum(f(p[0], p[1], x)); })(std::vector<Array>{w1, w2});
  };
  const auto plain = loss(block);
  lift::reset_recompute_stats();
  const auto named = loss(checkpoint(block, {.policy = policies::save_only_these_names({"proj"})}));
  CHECK(lift::recompute_stats().full_reruns == 1);
  for (int i = 0; i < 2; ++i) CHECK(named[static_cast<std::size_t>(i)].bitwise_equal(plain[static_cast<std::size_t>(i)]));
}

TEST_CASE("policies keep exactly the residuals they promise (JAX's notebook example)") {
  // g(W, x) = tanh(W x); f = g(W3, g(W2, g(W1, x))) with W1 (4,5), W2 (5,6), W3 (6,7), x (1,4).
  const Array w1 = random_array(Shape{4, 5}, 1), w2 = random_array(Shape{5, 6}, 2), w3 = random_array(Shape{6, 7}, 3);
  const Array x = random_array(Shape{1, 4}, 4);
  auto layer = [](const Array& w, const Array& x) { return tanh(matmul(x, w)); };
  auto f = [&](const Array& a, const Array& b, const Array& c, const Array& x) { return layer(c, layer(b, layer(a, x))); };
  auto kinds = [](const std::vector<lift::Residual>& rs) {
    std::vector<std::string> out;
    for (const auto& r : rs) out.push_back(r.str());
    std::sort(out.begin(), out.end());
    return out;
  };
  // Plain: the arguments, and each tanh output (matmul keeps its inputs, tanh its output).
  auto plain = kinds(lift::saved_residuals(f, w1, w2, w3, x));
  CHECK(plain == std::vector<std::string>{"f32[1,4] from the argument 3", "f32[1,5] output of tanh", "f32[1,6] output of tanh",
                                          "f32[1,7] output of tanh", "f32[4,5] from the argument 0",
                                          "f32[5,6] from the argument 1", "f32[6,7] from the argument 2"});
  // Every layer checkpointed (nothing_saveable): only the layer inputs, which are the previous outputs.
  auto f2 = [&](const Array& a, const Array& b, const Array& c, const Array& x) {
    auto cl = checkpoint(layer);
    return cl(c, cl(b, cl(a, x)));
  };
  CHECK(kinds(lift::saved_residuals(f2, w1, w2, w3, x)) ==
        std::vector<std::string>{"f32[1,4] from the argument 3", "f32[1,5] output of checkpoint",
                                 "f32[1,6] output of checkpoint", "f32[4,5] from the argument 0",
                                 "f32[5,6] from the argument 1", "f32[6,7] from the argument 2"});
  // The whole function checkpointed with dots_with_no_batch_dims_saveable: arguments plus the 3 products.
  auto f3 = checkpoint(f, {.policy = policies::dots_with_no_batch_dims_saveable{}});
  CHECK(kinds(lift::saved_residuals(f3, w1, w2, w3, x)) ==
        std::vector<std::string>{"f32[1,4] from the argument 3", "f32[1,5] output of matmul", "f32[1,6] output of matmul",
                                 "f32[1,7] output of matmul", "f32[4,5] from the argument 0",
                                 "f32[5,6] from the argument 1", "f32[6,7] from the argument 2"});
  // Names: only the value named 'a' is kept.
  auto f4 = [&](const Array& a, const Array& b, const Array& c, const Array& x) {
    Array h = checkpoint_name(layer(a, x), "a");
    h = checkpoint_name(layer(b, h), "b");
    return checkpoint_name(layer(c, h), "c");
  };
  auto named = kinds(lift::saved_residuals(checkpoint(f4, {.policy = policies::save_only_these_names({"a"})}), w1, w2, w3, x));
  CHECK(named == std::vector<std::string>{"f32[1,4] from the argument 3", "f32[1,5] named 'a' output of checkpoint_name",
                                          "f32[4,5] from the argument 0", "f32[5,6] from the argument 1",
                                          "f32[6,7] from the argument 2"});
  auto but = kinds(lift::saved_residuals(checkpoint(f4, {.policy = policies::save_any_names_but_these({"a"})}), w1, w2, w3, x));
  CHECK(but.size() == 6);  // b and c kept (c is also the output), a not
  CHECK(std::count(but.begin(), but.end(), "f32[1,6] named 'b' output of checkpoint_name") == 1);
  auto both = lift::saved_residuals(
      checkpoint(f4, {.policy = policies::save_from_both_policies(policies::save_only_these_names({"a"}),
                                                                  policies::dots_saveable{})}),
      w1, w2, w3, x);
  CHECK(both.size() == 4 + 1 + 3);  // arguments, 'a', three products
}

TEST_CASE("user predicates see op kind, shape, bytes and checkpoint names") {
  const Array w = random_array(Shape{4, 8}, 1), x = random_array(Shape{2, 4}, 2);
  std::vector<std::string> seen;
  lift::Policy spy("spy", [&](const lift::OpInfo& op) {
    seen.push_back(std::string(op.op) + " " + op.shape.str() + " " + std::to_string(op.bytes) + " " + std::string(op.name));
    return false;
  });
  auto f = checkpoint([](const Array& w, const Array& x) { return checkpoint_name(gelu(matmul(x, w)), "act"); },
                      {.policy = spy});
  (void)grad([&](const Array& w) { return sum(f(w, x)); })(w);
  CHECK(seen == std::vector<std::string>{"matmul (2, 8) 64 ", "gelu (2, 8) 64 ", "checkpoint_name (2, 8) 64 act"});
}

TEST_CASE("arrays the function captures get gradients") {
  const Array w = random_array(Shape{3, 3}, 7), x = random_array(Shape{2, 3}, 8);
  auto plain = grad([&](const Array& w) { return sum(tanh(matmul(x, w))); })(w);
  auto captured = grad([&](const Array& w) {
    auto f = checkpoint([&w](const Array& x) { return tanh(matmul(x, w)); });  // w captured, not an argument
    return sum(f(x));
  })(w);
  CHECK(captured.bitwise_equal(plain));
}

TEST_CASE("trees and several outputs go through checkpoint") {
  Tree params{{"w", random_array(Shape{3, 3}, 1)}, {"b", random_array(Shape{3}, 2)}};
  const Array x = random_array(Shape{2, 3}, 3);
  auto block = [](const Tree& p, const Array& x) {
    Array h = matmul(x, p.at("w").array()) + p.at("b").array();
    return std::make_pair(tanh(h), sum(h));
  };
  auto loss = [&](auto f) {
    return [f, x](const Tree& p) {
      auto [y, s] = f(p, x);
      return sum(y) * s;
    };
  };
  auto [v1, g1] = value_and_grad(loss(block))(params);
  auto [v2, g2] = value_and_grad(loss(checkpoint(block)))(params);
  CHECK(v1.bitwise_equal(v2));
  CHECK(bitwise_equal(g1, g2));
}

TEST_CASE("static_argnums: arrays marked static get no gradient; bad indices are errors") {
  const Array a = random_array(Shape{3}, 1), b = random_array(Shape{3}, 2);
  auto f = [](const Array& a, const Array& b) { return a * b; };
  auto [ga, gb] = grad<0, 1>([&](const Array& a, const Array& b) {
    return sum(checkpoint(f, {.static_argnums = {1}})(a, b));
  })(a, b);
  CHECK(ga.bitwise_equal(b));
  CHECK(gb.bitwise_equal(Array::zeros(Shape{3})));
  CHECK_THROWS_WITH_AS(checkpoint(f, {.static_argnums = {2}})(a, b), doctest::Contains("static_argnums entry 2 is out of range"),
                       ValueError);
  CHECK_THROWS_WITH_AS(checkpoint(f, {.static_argnums = {-1}})(a, b), doctest::Contains("negative indices are not accepted"),
                       ValueError);
  // Non-array arguments are static by type: branching on them works.
  auto h = [](const Array& x, bool twice) { return twice ? x * 2.0f : x; };
  CHECK(grad([&](const Array& x) { return sum(checkpoint(h)(x, true)); })(a).to_vector() == std::vector<float>{2, 2, 2});
}

TEST_CASE("nested checkpoints: correct gradients and the recompute counts the schedule implies") {
  const Array w = random_array(Shape{4, 4}, 11), x = random_array(Shape{2, 4}, 12);
  auto inner = checkpoint(g);
  auto outer = checkpoint([&](const Array& w, const Array& x) { return inner(w, inner(w, x)); });
  g_calls = 0;
  auto gw = grad([&](const Array& w) { return sum(outer(w, x)); })(w);
  // forward: 2; outer recomputation: 2 more; each inner recomputation in the backward: 2.
  CHECK(g_calls == 6);
  CHECK(gw.bitwise_equal(grad([&](const Array& w) { return sum(g(w, g(w, x))); })(w)));
}

namespace {
// JAX's recursive_checkpoint: split the chain in halves, checkpoint each half.
using Fn = std::function<Array(const Array&)>;
Fn recursive_checkpoint(const std::vector<Fn>& funs) {
  if (funs.size() == 1) return funs[0];
  if (funs.size() == 2) return [f0 = funs[0], f1 = funs[1]](const Array& x) { return f1(f0(x)); };
  const std::size_t half = funs.size() / 2;
  Fn f1 = recursive_checkpoint({funs.begin(), funs.begin() + half});
  Fn f2 = recursive_checkpoint({funs.begin() + half, funs.end()});
  return [c1 = checkpoint(f1), c2 = checkpoint(f2)](const Array& x) { return c2(c1(x)); };
}
}  // namespace

TEST_CASE("recursive checkpointing (JAX's example): few residuals, right gradient") {
  std::vector<Fn> chain(8, [](const Array& x) { return tanh(x); });
  const Array x = Array::scalar(0.3f);
  auto plain = [&](const Array& x) {
    Array h = x;
    for (const auto& f : chain) h = f(h);
    return h;
  };
  const Fn rec = recursive_checkpoint(chain);
  CHECK(lift::saved_residuals(plain, x).size() == 8);  // tanh keeps its output: 8 values
  const auto rec_residuals = lift::saved_residuals(rec, x);
  CHECK(rec_residuals.size() <= 3);
  auto g_plain = grad([&](const Array& x) { return sum(plain(x)); })(x);
  auto g_rec = grad([&](const Array& x) { return sum(rec(x)); })(x);
  CHECK(g_rec.bitwise_equal(g_plain));
}

TEST_CASE("verify mode catches a non-deterministic block and names it") {
  const Array x = random_array(Shape{3}, 1);
  int calls = 0;
  auto flaky = checkpoint([&calls](const Array& x) { return x * static_cast<float>(++calls); }, {.verify = true});
  CHECK_THROWS_WITH_AS(grad([&](const Array& x) { return sum(flaky(x)); })(x),
                       doctest::Contains("the recomputed forward pass differs from the original"), AutodiffError);
  auto steady = checkpoint([](const Array& x) { return x * 3.0f; }, {.verify = true});
  CHECK(grad([&](const Array& x) { return sum(steady(x)); })(x).to_vector() == std::vector<float>{3, 3, 3});
}

TEST_CASE("memory: a checkpointed chain keeps only the block inputs") {
  // L blocks of Dense(4W)-GELU-Dense(W) with residuals; plain keeps per block x (W), h1 (4W) and
  // gelu(h1) (4W); checkpointed blocks keep x only.
  const int L = 6, B = 16, W = 32;
  std::vector<Array> params;
  for (int l = 0; l < L; ++l) {
    params.push_back(random_array(Shape{W, 4 * W}, 100 + l, -0.1f, 0.1f));
    params.push_back(random_array(Shape{4 * W, W}, 200 + l, -0.1f, 0.1f));
  }
  const Array x = random_array(Shape{B, W}, 9);
  auto block = [](const Array& x, const Array& w1, const Array& w2) { return x + matmul(gelu(matmul(x, w1)), w2); };
  auto run = [&](bool remat) {
    auto loss = [&](const std::vector<Array>& p) {
      Array h = x;
      for (int l = 0; l < L; ++l) h = remat ? checkpoint(block)(h, p[2 * l], p[2 * l + 1]) : block(h, p[2 * l], p[2 * l + 1]);
      return sum(h);
    };
    // Peak of live bytes at the end of the forward pass = what is kept for the backward pass.
    autodiff::EnableGradGuard on;
    std::vector<Array> tracked;
    for (const Array& p : params) tracked.push_back(autodiff::make_leaf(p));
    const auto before = memory::stats().live_bytes;
    Array y = loss(tracked);
    return memory::stats().live_bytes - before;
  };
  const std::int64_t unit = B * W * 4;  // bytes of one [B, W] activation
  const std::int64_t plain = run(false), rematted = run(true);
  // Plain: per block h1 and gelu(h1) (4 units each) and the block's input (1 unit) — except the
  // first block's input, which is x itself and was alive before (+ 4 bytes: the scalar loss).
  CHECK(plain == (9 * L - 1) * unit + 4);
  // Checkpointed: only the block inputs, i.e. 1 unit per block but the first: 8/9 of it is gone.
  CHECK(rematted == (L - 1) * unit + 4);
}

TEST_CASE("dots_with_no_batch_dims_saveable saves products without batch dimensions, at their real shapes") {
  const Array x = random_array(Shape{2, 5, 4}, 11), w = random_array(Shape{4, 6}, 12), v = random_array(Shape{2, 4, 3}, 13);
  auto residual_text = [](const std::vector<lift::Residual>& rs) {
    std::string all;
    for (const auto& r : rs) all += r.str() + "\n";
    return all;
  };
  // [B, T, D] @ [D, E] contracts without batch dimensions (as jnp.matmul): saved, seen as [2,5,6].
  auto dense_like = checkpoint([](const Array& x, const Array& w) { return tanh(matmul(x, w)); },
                               {.policy = policies::dots_with_no_batch_dims_saveable{}});
  const std::string saved = residual_text(lift::saved_residuals(dense_like, x, w));
  INFO(saved);
  CHECK(saved.find("f32[2,5,6] output of matmul") != std::string::npos);
  // dot_general without batch axes too (Dense, DenseGeneral and attention projections use it).
  auto general = checkpoint([](const Array& x, const Array& w) { return tanh(dot_general(x, w, DotDims{{2}, {0}, {}, {}})); },
                            {.policy = policies::dots_with_no_batch_dims_saveable{}});
  CHECK(residual_text(lift::saved_residuals(general, x, w)).find("f32[2,5,6] output of matmul") != std::string::npos);
  // A product with batch dimensions is not saved by this policy (it is by dots_saveable).
  auto batched = [](const lift::Policy& p) {
    return checkpoint([](const Array& x, const Array& v) { return tanh(matmul(x, v)); }, {.policy = p});
  };
  CHECK(residual_text(lift::saved_residuals(batched(policies::dots_with_no_batch_dims_saveable{}), x, v))
            .find("output of batched_matmul") == std::string::npos);
  CHECK(residual_text(lift::saved_residuals(batched(policies::dots_saveable{}), x, v)).find("f32[2,5,3] output of batched_matmul") !=
        std::string::npos);
  // The policy sees the op's real output shape, not the [1, m, n] of the kernel call.
  std::vector<Shape> shapes;
  lift::Policy spy("spy", [&](const lift::OpInfo& op) {
    if (op.is_dot()) shapes.push_back(op.shape);
    return false;
  });
  (void)grad<1>([&](const Array& x, const Array& w) {
    return sum(checkpoint([](const Array& x, const Array& w) { return tanh(matmul(x, w)); }, {.policy = spy})(x, w));
  })(x, w);
  REQUIRE(!shapes.empty());
  CHECK(shapes.front() == Shape{2, 5, 6});
}

TEST_CASE("saved_residuals names the op that produced a value, not a view of it") {
  const Array x = random_array(Shape{3, 4}, 21), w = random_array(Shape{4, 6}, 22);
  auto f = checkpoint([](const Array& x, const Array& w) { return tanh(reshape(matmul(x, w), {2, 9})); },
                      {.policy = policies::dots_saveable{}});
  std::string all;
  for (const auto& r : lift::saved_residuals(f, x, w)) all += r.str() + "\n";
  INFO(all);
  CHECK(all.find("output of matmul") != std::string::npos);
  CHECK(all.find("output of reshape") == std::string::npos);
}
