// Optimizers: hand-computed steps of sgd (plain, momentum, nesterov), adam and adamw on a small
// nested tree; clipping by global norm; schedules at known steps; state layout and serialization;
// convergence on a quadratic; errors naming the differing path.
#include <doctest/doctest.h>

#include "testing/errors.hpp"

#include <linum/linum.hpp>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

using namespace linum;

namespace {

// {"w": [1, -2], "b": {"c": [0.5]}}: a tree with a nested dict.
Tree make_tree(float w0, float w1, float c) {
  return Tree{{"w", Array::from({2}, {w0, w1})}, {"b", Tree{{"c", Array::from({1}, {c})}}}};
}

std::vector<double> values(const Tree& t) {
  std::vector<double> out;
  for (const Array& a : leaves(t))
    for (float v : a.to_vector()) out.push_back(v);
  return out;
}

void check_close(const Tree& got, const std::vector<double>& want, double rel = 2e-6) {
  std::vector<double> g = values(got);
  REQUIRE(g.size() == want.size());
  for (std::size_t i = 0; i < g.size(); ++i) {
    CAPTURE(i);
    CHECK(g[i] == doctest::Approx(want[i]).epsilon(rel).scale(1e-30));
  }
}

using linum::testing::contains;
using linum::testing::error_of;

const std::vector<double> P0 = {1.0, -2.0, 0.5};
const std::vector<double> G1 = {0.1, 0.2, -0.3};
const std::vector<double> G2 = {0.4, -0.1, 0.2};
Tree tree_of(const std::vector<double>& v) {
  return make_tree(static_cast<float>(v[0]), static_cast<float>(v[1]), static_cast<float>(v[2]));
}

// The float32 value of x, as a double.
double f32(double x) { return static_cast<double>(static_cast<float>(x)); }

// Adam in double with optax's float32 constants: returns the update for step t (1-based) and
// updates m, v. As in optax (JAX's weak typing), 1 - b is formed in double and then rounded to
// float32, while the bias correction 1 - b^t is float32 arithmetic on the float32 b. So at step 1 with b2 = 0.999,
// v_hat = g^2 * 0.001 / (1 - 0.999f) = g^2 * (1 + 1.3e-5): optax's first Adam step is -lr * sign(g)
// * (1 - 6.4e-6), not exactly -lr * sign(g).
std::vector<double> adam_ref(const std::vector<double>& g, std::vector<double>& m, std::vector<double>& v, int t,
                             double b1 = 0.9, double b2 = 0.999, double eps = 1e-8, double eps_root = 0.0) {
  std::vector<double> u(g.size());
  for (std::size_t i = 0; i < g.size(); ++i) {
    const double gi = f32(g[i]);
    m[i] = f32(1 - b1) * gi + f32(b1) * m[i];
    v[i] = f32(1 - b2) * gi * gi + f32(b2) * v[i];
    // b^t is a float32 value in optax, and 1 - b^t cancels: keep that rounding.
    const double mh = m[i] / (1 - f32(std::pow(f32(b1), t)));
    const double vh = v[i] / (1 - f32(std::pow(f32(b2), t)));
    u[i] = mh / (std::sqrt(vh + f32(eps_root)) + f32(eps));
  }
  return u;
}

}  // namespace

TEST_CASE("sgd without momentum: updates are -lr * grads, state is empty") {
  auto opt = optim::sgd(0.1);
  Tree params = tree_of(P0);
  Tree state = opt.init(params);
  CHECK(state.keys() == std::vector<std::string>{"0", "1"});
  CHECK(state.at("0").empty());
  CHECK(state.at("1").empty());
  auto [u1, s1] = opt.update(tree_of(G1), state, params);
  // Exactly float32(-0.1) * g, one rounding.
  std::vector<float> w = u1.at("w").array().to_vector();
  CHECK(w[0] == -0.1f * 0.1f);
  CHECK(w[1] == -0.1f * 0.2f);
  CHECK(u1.at_path("b/c").array().to_vector()[0] == -0.1f * -0.3f);
  Tree p1 = optim::apply_updates(params, u1);
  CHECK(p1.at("w").array().to_vector()[0] == 1.0f + (-0.1f * 0.1f));
  check_close(p1, {1 - 0.01, -2 - 0.02, 0.5 + 0.03});
}

TEST_CASE("sgd with momentum and nesterov: first and second steps") {
  const double lr = 0.1, mu = 0.9;
  SUBCASE("momentum") {
    auto opt = optim::sgd(lr, mu);
    Tree state = opt.init(tree_of(P0));
    CHECK(state.at("0").keys() == std::vector<std::string>{"trace"});
    auto [u1, s1] = opt.update(tree_of(G1), state);
    check_close(u1, {-lr * G1[0], -lr * G1[1], -lr * G1[2]});
    check_close(s1.at_path("0/trace"), G1);
    auto [u2, s2] = opt.update(tree_of(G2), s1);
    std::vector<double> t2(3), want(3);
    for (int i = 0; i < 3; ++i) t2[i] = G2[i] + mu * G1[i];
    for (int i = 0; i < 3; ++i) want[i] = -lr * t2[i];
    check_close(u2, want);
    check_close(s2.at_path("0/trace"), t2);
  }
  SUBCASE("nesterov") {
    auto opt = optim::sgd(lr, mu, true);
    Tree state = opt.init(tree_of(P0));
    auto [u1, s1] = opt.update(tree_of(G1), state);
    std::vector<double> want(3), t2(3);
    for (int i = 0; i < 3; ++i) want[i] = -lr * (G1[i] + mu * G1[i]);
    check_close(u1, want);
    auto [u2, s2] = opt.update(tree_of(G2), s1);
    for (int i = 0; i < 3; ++i) t2[i] = G2[i] + mu * G1[i];
    for (int i = 0; i < 3; ++i) want[i] = -lr * (G2[i] + mu * t2[i]);
    check_close(u2, want);
    check_close(s2.at_path("0/trace"), t2);
  }
}

TEST_CASE("sgd follows a learning-rate schedule, evaluated at the step count before the step") {
  auto opt = optim::sgd([](std::int64_t step) { return 0.1f * static_cast<float>(step + 1); });
  Tree state = opt.init(tree_of(P0));
  CHECK(state.at("1").at("count").array().dtype() == DType::i32);
  auto [u1, s1] = opt.update(tree_of(G1), state);
  check_close(u1, {-0.1 * G1[0], -0.1 * G1[1], -0.1 * G1[2]});
  CHECK(s1.at_path("1/count").array().data_i32()[0] == 1);
  auto [u2, s2] = opt.update(tree_of(G1), s1);
  check_close(u2, {-0.2 * G1[0], -0.2 * G1[1], -0.2 * G1[2]});
  CHECK(s2.at_path("1/count").array().data_i32()[0] == 2);
}

TEST_CASE("adam: first and second steps with bias correction") {
  const double lr = 0.01;
  auto opt = optim::adam(lr);
  Tree params = tree_of(P0);
  Tree state = opt.init(params);
  CHECK(state.at("0").keys() == std::vector<std::string>{"count", "mu", "nu"});
  CHECK(same_structure(state.at_path("0/mu"), params));
  CHECK(state.at_path("0/count").array().data_i32()[0] == 0);

  std::vector<double> m(3, 0.0), v(3, 0.0);
  auto [u1, s1] = opt.update(tree_of(G1), state, params);
  std::vector<double> r1 = adam_ref(G1, m, v, 1);
  for (double& x : r1) x *= -lr;
  check_close(u1, r1);
  // At step 1 the bias-corrected update is about -lr * sign(g) (see adam_ref for the 6.4e-6).
  CHECK(values(u1)[0] == doctest::Approx(-lr * (1 - 6.4e-6)).epsilon(1e-6));
  check_close(s1.at_path("0/mu"), m);
  check_close(s1.at_path("0/nu"), v);
  CHECK(s1.at_path("0/count").array().data_i32()[0] == 1);

  auto [u2, s2] = opt.update(tree_of(G2), s1, params);
  std::vector<double> r2 = adam_ref(G2, m, v, 2);
  for (double& x : r2) x *= -lr;
  check_close(u2, r2);
  check_close(s2.at_path("0/mu"), m);
  check_close(s2.at_path("0/nu"), v);
  CHECK(s2.at_path("0/count").array().data_i32()[0] == 2);
}

TEST_CASE("adam with eps_root puts it inside the square root") {
  auto opt = optim::adam(1.0, 0.9, 0.999, 1e-8, 0.25);
  Tree p = Tree{{"x", Array::from({1}, {0.0f})}};
  auto [u, s] = opt.update(Tree{{"x", Array::from({1}, {0.5f})}}, opt.init(p));
  // m_hat = 0.5, v_hat = 0.25 (up to optax's float32 bias correction): -0.5 / (sqrt(0.25 + 0.25) + 1e-8)
  std::vector<double> m(1, 0.0), v(1, 0.0);
  const double want = -adam_ref({0.5}, m, v, 1, 0.9, 0.999, 1e-8, 0.25)[0];
  CHECK(want == doctest::Approx(-0.5 / std::sqrt(0.5)).epsilon(2e-5));
  CHECK(u.at("x").array().item() == doctest::Approx(want).epsilon(1e-6));
}

TEST_CASE("adamw: decoupled weight decay added before scaling by -lr") {
  const double lr = 0.01, wd = 0.1;
  auto opt = optim::adamw(lr, 0.9, 0.999, 1e-8, wd);
  Tree params = tree_of(P0);
  Tree state = opt.init(params);
  CHECK(state.keys() == std::vector<std::string>{"0", "1", "2"});
  CHECK(state.at("1").empty());
  std::vector<double> m(3, 0.0), v(3, 0.0), p = P0;

  auto [u1, s1] = opt.update(tree_of(G1), state, params);
  std::vector<double> a1 = adam_ref(G1, m, v, 1), r1(3);
  for (int i = 0; i < 3; ++i) r1[i] = -lr * (a1[i] + wd * p[i]);
  check_close(u1, r1);
  params = optim::apply_updates(params, u1);
  for (int i = 0; i < 3; ++i) p[i] += r1[i];
  check_close(params, p);

  auto [u2, s2] = opt.update(tree_of(G2), s1, params);
  std::vector<double> a2 = adam_ref(G2, m, v, 2), r2(3);
  for (int i = 0; i < 3; ++i) r2[i] = -lr * (a2[i] + wd * p[i]);
  check_close(u2, r2);

  // optax's default weight decay is 1e-4.
  auto dflt = optim::adamw(lr);
  Tree pp = tree_of(P0);
  auto [ud, sd] = dflt.update(tree_of(G1), dflt.init(pp), pp);
  std::vector<double> mm(3, 0.0), vv(3, 0.0);
  std::vector<double> ad = adam_ref(G1, mm, vv, 1), rd(3);
  for (int i = 0; i < 3; ++i) rd[i] = -lr * (ad[i] + 1e-4 * P0[i]);
  check_close(ud, rd);
}

TEST_CASE("clip_by_global_norm rescales all leaves together") {
  Tree g = Tree{{"a", Array::from({2}, {3.0f, 0.0f})}, {"b", Array::from({1, 1}, {4.0f})}};
  CHECK(optim::global_norm(g) == 5.0f);
  auto clip = optim::clip_by_global_norm(1.0);
  Tree state = clip.init(g);
  CHECK(state.empty());
  auto [u, s] = clip.update(g, state);
  CHECK(u.at("a").array().to_vector() == std::vector<float>{(3.0f / 5.0f) * 1.0f, 0.0f});
  CHECK(u.at("b").array().item() == (4.0f / 5.0f) * 1.0f);
  CHECK(optim::global_norm(u) == doctest::Approx(1.0).epsilon(1e-6));
  auto [u2, s2] = optim::clip_by_global_norm(2.5).update(g, state);
  CHECK(u2.at("b").array().item() == (4.0f / 5.0f) * 2.5f);
  // Below the threshold the updates pass through untouched (the same buffers).
  auto [u3, s3] = optim::clip_by_global_norm(10.0).update(g, state);
  CHECK(u3.at("a").array().shares_buffer(g.at("a").array()));
  // In a chain, clipping happens before the optimizer sees the gradients.
  auto opt = optim::chain(optim::clip_by_global_norm(1.0), optim::sgd(1.0));
  auto [u4, s4] = opt.update(g, opt.init(g));
  CHECK(u4.at("b").array().item() == -((4.0f / 5.0f) * 1.0f));
  CHECK(s4.keys() == std::vector<std::string>{"0", "1"});
}

TEST_CASE("schedules at known steps") {
  CHECK(optim::constant_schedule(0.3f)(0) == 0.3f);
  CHECK(optim::constant_schedule(0.3f)(12345) == 0.3f);

  auto cosine = optim::cosine_decay_schedule(2.0f, 100);
  CHECK(cosine(0) == 2.0f);
  CHECK(cosine(50) == doctest::Approx(1.0).epsilon(1e-6));
  CHECK(cosine(25) == doctest::Approx(2.0 * 0.5 * (1 + std::cos(M_PI / 4))).epsilon(1e-6));
  CHECK(cosine(100) == doctest::Approx(0.0).scale(1.0).epsilon(1e-7));
  CHECK(cosine(1000) == cosine(100));
  auto floor = optim::cosine_decay_schedule(1.0f, 100, 0.1f);
  CHECK(floor(50) == doctest::Approx(0.55).epsilon(1e-6));
  CHECK(floor(100) == doctest::Approx(0.1).epsilon(1e-6));

  auto lin = optim::linear_schedule(1.0f, 0.0f, 10, 5);
  CHECK(lin(0) == 1.0f);
  CHECK(lin(5) == 1.0f);
  CHECK(lin(10) == 0.5f);
  CHECK(lin(15) == 0.0f);
  CHECK(lin(100) == 0.0f);
  CHECK(optim::linear_schedule(0.7f, 0.0f, 0)(50) == 0.7f);  // no transition: constant

  auto wc = optim::warmup_cosine_decay_schedule(0.0f, 1.0f, 10, 110, 0.1f);
  for (int step = 0; step <= 10; ++step) {
    CAPTURE(step);
    CHECK(wc(step) == doctest::Approx(step / 10.0).epsilon(1e-6));  // linear warmup to the peak
  }
  CHECK(wc(60) == doctest::Approx(0.55).epsilon(1e-6));  // half way through the decay
  CHECK(wc(110) == doctest::Approx(0.1).epsilon(1e-6));  // end_value
  CHECK(wc(500) == doctest::Approx(0.1).epsilon(1e-6));
  CHECK(wc(11) < wc(10));

  CHECK(contains(error_of<ValueError>([] { optim::cosine_decay_schedule(1.0f, 0); }), "decay_steps"));
  CHECK(contains(error_of<ValueError>([] { optim::warmup_cosine_decay_schedule(0.f, 1.f, 10, 10); }), "warmup_steps"));
}

TEST_CASE("optimizer state saves and loads like the parameters") {
  auto opt = optim::chain(optim::clip_by_global_norm(1.0), optim::adamw(1e-3));
  Tree params = tree_of(P0);
  auto [u, state] = opt.update(tree_of(G1), opt.init(params), params);
  Tree loaded = serialization::from_msgpack(serialization::to_msgpack(state));
  CHECK(bitwise_equal(loaded, state));
  auto [ua, sa] = opt.update(tree_of(G2), state, params);
  auto [ub, sb] = opt.update(tree_of(G2), loaded, params);
  CHECK(bitwise_equal(ua, ub));
  CHECK(bitwise_equal(sa, sb));
}

TEST_CASE("optimizer steps record no autodiff graph") {
  auto opt = optim::adam(0.1);
  Tree params = tree_of(P0);
  Tree state = opt.init(params);
  auto loss = [&](const Tree& p) {
    // An optimizer step inside a differentiated function: its results are constants.
    auto [u, s] = opt.update(p, state, p);
    for (const Array& a : leaves(u)) CHECK(a.node() == nullptr);
    Tree moved = optim::apply_updates(p, u);
    for (const Array& a : leaves(moved)) CHECK(a.node() == nullptr);
    return sum(square(p.at("w").array()));
  };
  auto [value, grads] = value_and_grad(loss)(params);
  CHECK(value.item() == 5.0f);
  check_close(grads, {2.0, -4.0, 0.0});
}

TEST_CASE("every optimizer minimises a quadratic") {
  const Array tw = Array::from({4}, {1.0f, -2.0f, 3.0f, 0.5f});
  const Array tv = Array::from({2, 2}, {-1.0f, 0.25f, 2.0f, -3.0f});
  auto loss = [&](const Tree& p) {
    return sum(square(p.at("w").array() - tw)) + sum(square(p.at_path("n/v").array() - tv));
  };
  struct Case {
    const char* name;
    optim::GradientTransformation opt;
    int steps;
  };
  std::vector<Case> cases = {
      {"sgd", optim::sgd(0.1), 200},
      {"sgd momentum", optim::sgd(0.05, 0.9), 300},
      {"sgd nesterov", optim::sgd(0.05, 0.9, true), 300},
      {"adam", optim::adam(optim::cosine_decay_schedule(0.2f, 600)), 600},
      {"adamw", optim::adamw(optim::cosine_decay_schedule(0.2f, 600), 0.9, 0.999, 1e-8, 1e-4), 600},
      {"clip + adam warmup", optim::chain(optim::clip_by_global_norm(1.0),
                                          optim::adam(optim::warmup_cosine_decay_schedule(0.0f, 0.2f, 50, 600))),
       600},
  };
  for (Case& c : cases) {
    CAPTURE(c.name);
    Tree params = Tree{{"w", Array::zeros({4})}, {"n", Tree{{"v", Array::zeros({2, 2})}}}};
    Tree state = c.opt.init(params);
    const float initial = loss(params).item();
    for (int i = 0; i < c.steps; ++i) {
      auto [value, grads] = value_and_grad(loss)(params);
      auto [updates, next] = c.opt.update(grads, state, params);
      params = optim::apply_updates(params, updates);
      state = std::move(next);
    }
    const float final_loss = loss(params).item();
    CHECK(initial > 20.0f);
    CHECK(final_loss < 1e-4f);
  }
}

TEST_CASE("optimizer errors name the differing path and what to do") {
  auto opt = optim::adam(0.1);
  Tree params = tree_of(P0);
  Tree state = opt.init(params);

  // A gradient tree with another key under "b".
  Tree other = Tree{{"w", Array::from({2}, {0.f, 0.f})}, {"b", Tree{{"d", Array::from({1}, {0.f})}}}};
  std::string e = error_of<ValueError>([&] { opt.update(other, state); });
  CHECK(contains(e, "scale_by_adam"));
  CHECK(contains(e, "b"));
  CHECK(contains(e, "mu"));
  // A leaf of another shape.
  Tree wrong_shape = Tree{{"w", Array::from({3}, {0.f, 0.f, 0.f})}, {"b", Tree{{"c", Array::from({1}, {0.f})}}}};
  e = error_of<ValueError>([&] { opt.update(wrong_shape, state); });
  CHECK(contains(e, "w"));
  CHECK(contains(e, "(3,)"));
  e = error_of<ValueError>([&] { optim::apply_updates(params, wrong_shape); });
  CHECK(contains(e, "apply_updates"));
  CHECK(contains(e, "w"));
  // The params passed to update must match the grads too.
  e = error_of<ValueError>([&] { opt.update(params, state, wrong_shape); });
  CHECK(contains(e, "params"));

  // adamw needs the params.
  auto aw = optim::adamw(0.1);
  e = error_of<ValueError>([&] { aw.update(params, aw.init(params)); });
  CHECK(contains(e, "add_decayed_weights"));
  CHECK(contains(e, "params"));

  // The state of another optimizer.
  auto sgd = optim::sgd(0.1, 0.9);
  e = error_of<ValueError>([&] { sgd.update(params, state); });
  CHECK(contains(e, "trace"));
  CHECK(contains(e, "init()"));
  e = error_of<ValueError>([&] { opt.update(params, Tree{{"0", Tree()}}); });
  CHECK(contains(e, "chain"));

  // Integer leaves are not optimized.
  Tree ints = Tree{{"i", Array::from_i32({2}, {1, 2})}};
  e = error_of<ValueError>([&] { opt.init(ints); });
  CHECK(contains(e, "'i'"));
  CHECK(contains(e, "int32"));

  CHECK(contains(error_of<ValueError>([] { optim::clip_by_global_norm(-1.0); }), "max_norm"));
  CHECK(contains(error_of<ValueError>([] { optim::sgd(0.1, -0.5); }), "momentum"));
}

TEST_CASE("optimizers refuse hyperparameters that would make every update NaN") {
  CHECK_THROWS_WITH_AS(optim::adam(std::nan("")), doctest::Contains("learning rate must be a finite number"), ValueError);
  CHECK_THROWS_WITH_AS(optim::sgd(std::numeric_limits<double>::infinity()), doctest::Contains("finite"), ValueError);
  CHECK_THROWS_WITH_AS(optim::adam(1e-3, 1.5), doctest::Contains("0 <= b1, b2 < 1"), ValueError);
  CHECK_NOTHROW(optim::adam(1e-3));
}

TEST_CASE("step(): adam and adamw fused give bitwise what update + apply_updates give, in place when moved") {
  // Leaves large enough for the parallel blocks, plus a small nested one.
  auto make = [](unsigned seed) {
    return Tree{{"big", rng::normal(rng::key(seed), Shape{300000})},
                {"b", Tree{{"c", rng::normal(rng::key(seed + 1), Shape{7})}}}};
  };
  // A constant learning rate and schedules (the schedule called with the chain's own count).
  const std::vector<std::pair<std::string, optim::LearningRate>> rates = {
      {"constant", 1e-2},
      {"exponential_decay", optim::exponential_decay(1e-2f, 2, 0.5f)},
      {"linear_schedule", optim::linear_schedule(1e-2f, 1e-3f, 3)}};
  for (const auto& named_rate : rates) {
    // Not a structured binding: clang 14 cannot capture one in CAPTURE's lambda.
    const std::string& rate_name = named_rate.first;
    const optim::LearningRate& rate = named_rate.second;
    for (double wd : {0.0, 0.01}) {
      CAPTURE(rate_name);
      CAPTURE(wd);
      const optim::GradientTransformation opt = wd == 0.0 ? optim::adam(rate) : optim::adamw(rate, 0.9, 0.999, 1e-8, wd);
      Tree params_ref = make(1), state_ref = opt.init(params_ref);
      Tree params = make(1), state = opt.init(params);  // separate buffers, so step() may write them
      for (int step = 0; step < 4; ++step) {
        const Tree grads = make(10 + static_cast<unsigned>(step));
        auto [updates, next] = opt.update(grads, state_ref, params_ref);
        params_ref = optim::apply_updates(params_ref, updates);
        state_ref = next;
        const void* before = params.at("big").array().raw();
        const void* mu_before = state.at("0").at("mu").at("big").array().raw();
        auto [p2, s2] = opt.step(std::move(params), grads, std::move(state));
        CHECK(p2.at("big").array().raw() == before);  // written in place: nothing else held them
        CHECK(s2.at("0").at("mu").at("big").array().raw() == mu_before);
        params = std::move(p2);
        state = std::move(s2);
        CHECK(bitwise_equal(params, params_ref));
        CHECK(bitwise_equal(state, state_ref));
      }
    }
  }
}

TEST_CASE("step(): parameters the caller still holds are not modified; schedules fused, bf16 the general path") {
  const optim::GradientTransformation opt = optim::adam(1e-2);
  const Tree params = make_tree(1, -2, 0.5f), grads = make_tree(0.1f, 0.2f, -0.3f);
  const Tree state = opt.init(params);
  const Tree params_copy = params;
  auto [p2, s2] = opt.step(params, grads, state);  // copies: the caller keeps the old values
  CHECK(bitwise_equal(params, params_copy));
  CHECK(!bitwise_equal(p2, params));
  auto [updates, next] = opt.update(grads, state, params);
  CHECK(bitwise_equal(p2, optim::apply_updates(params, updates)));
  CHECK(bitwise_equal(s2, next));

  const optim::GradientTransformation scheduled = optim::adam(optim::linear_schedule(1e-2f, 0.0f, 10));
  auto [p3, s3] = scheduled.step(params, grads, scheduled.init(params));
  auto [u3, n3] = scheduled.update(grads, scheduled.init(params), params);
  CHECK(bitwise_equal(p3, optim::apply_updates(params, u3)));
  CHECK(bitwise_equal(s3, n3));

  const Tree params16 = tree_map([](const Array& a) { return astype(a, DType::bf16); }, params);
  const Tree grads16 = tree_map([](const Array& a) { return astype(a, DType::bf16); }, grads);
  auto [p4, s4] = opt.step(params16, grads16, opt.init(params16));
  CHECK(p4.at("w").array().dtype() == DType::bf16);
  CHECK_THROWS_AS(opt.step(params, make_tree(1, 2, 3).at("b"), state), ValueError);
}

TEST_CASE("SquareSum: exact sums of squares, the same bits for any split and merge order") {
  // Values over the whole float32 range: tiny (subnormal), huge, negative, zeros.
  std::vector<float> x;
  std::uint32_t state = 12345u;
  auto next = [&] { return state = state * 1664525u + 1013904223u; };
  for (int i = 0; i < 5000; ++i) {
    const float mantissa = static_cast<float>(next() % 100000u) / 50000.0f - 1.0f;
    const int exponent = static_cast<int>(next() % 120u) - 60;
    x.push_back(std::ldexp(mantissa, exponent));
  }
  x.push_back(1e-45f);   // the smallest subnormal
  x.push_back(3e38f);    // near the largest float
  x.push_back(0.0f);
  optim::SquareSum whole;
  whole.add(x.data(), static_cast<std::int64_t>(x.size()));
  CHECK(whole.count() == static_cast<std::int64_t>(x.size()));
  // Against a long-double sum in order (double-rounding differences only in the last bits).
  long double reference = 0;
  for (float v : x) reference += static_cast<long double>(v) * v;
  CHECK(std::abs(static_cast<double>(reference) - whole.value()) <= 1e-15 * whole.value());
  // Any split, merged in any order: bitwise the same value.
  for (std::size_t cut : {std::size_t{1}, std::size_t{7}, std::size_t{2500}, x.size() - 1}) {
    optim::SquareSum a, b, ab, ba;
    a.add(x.data(), static_cast<std::int64_t>(cut));
    b.add(x.data() + cut, static_cast<std::int64_t>(x.size() - cut));
    ab.merge(a);
    ab.merge(b);
    ba.merge(b);
    ba.merge(a);
    CHECK(ab.value() == whole.value());
    CHECK(ba.value() == whole.value());
    // Through the words a rank sends.
    std::vector<std::uint64_t> words(optim::SquareSum::kWords);
    b.to_words(words.data());
    optim::SquareSum c = optim::SquareSum::from_words(words.data());
    c.merge(a);
    CHECK(c.value() == whole.value());
  }
  // Reversed order, and a large array summed by threads.
  std::vector<float> reversed(x.rbegin(), x.rend());
  optim::SquareSum r;
  r.add(reversed.data(), static_cast<std::int64_t>(reversed.size()));
  CHECK(r.value() == whole.value());
  const Array big = rng::normal(rng::key(5), Shape{300001});
  optim::SquareSum threaded, serial;
  threaded.add(big);
  for (std::int64_t i = 0; i < big.numel(); ++i) serial.add(big.data() + i, 1);
  CHECK(threaded.value() == serial.value());
  CHECK(optim::global_norm(Tree{{"a", big}}) == static_cast<float>(std::sqrt(serial.value())));
  // bf16 leaves are widened exactly; NaN and infinity propagate.
  optim::SquareSum h;
  h.add(astype(Array::from(Shape{2}, {0.5f, -3.0f}), DType::bf16));
  CHECK(h.value() == 9.25);
  optim::SquareSum nan_sum, inf_sum;
  const float bad[] = {1.0f, std::numeric_limits<float>::infinity()};
  inf_sum.add(bad, 2);
  CHECK(std::isinf(inf_sum.value()));
  const float worse[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()};
  nan_sum.add(worse, 2);
  CHECK(std::isnan(nan_sum.value()));
  // Transformations that need a whole leaf refuse to run while a ShardReductions is installed.
  struct Alone final : optim::ShardReductions {
    void merge_across_shards(std::vector<optim::SquareSum>&) const override {}
    bool all_across_shards(bool v) const override { return v; }
  } alone;
  optim::ShardReductionsScope sharded(&alone);
  CHECK_THROWS_WITH_AS(optim::adafactor(1e-2, 2).init(Tree{{"w", Array::zeros(Shape{4, 4})}}),
                       doctest::Contains("whole shape"), ValueError);
}
