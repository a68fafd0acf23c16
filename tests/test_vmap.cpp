// vmap (issue 28): every op family batched equals a loop over the examples, per-example gradients
// equal per-example grad calls, grad of vmap, vmap of checkpoint, nested vmap, in/out axes, the
// loop fallback of ops without a batching rule, and clear errors.
#include <doctest/doctest.h>
#include <linum/linum.hpp>

#include "testing/gradcheck.hpp"
#include "testing/op_cases.hpp"

#include <linum/core/ops/kernel_util.hpp>

#include <algorithm>
#include <optional>
#include <set>
#include <string>
#include <vector>

using namespace linum;
using linum::testing::max_abs;
using linum::testing::max_abs_diff;
using linum::testing::OpCase;
using linum::testing::random_array;

namespace {

bool bitwise_equal(const Array& a, const Array& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         astype(a, DType::f32).to_vector() == astype(b, DType::f32).to_vector();
}

Shape with_batch(std::int64_t b, const Shape& s) {
  std::vector<std::int64_t> d{b};
  for (std::int64_t x : s) d.push_back(x);
  return Shape(d);
}

Array example(const Array& batch, std::int64_t i) { return take(batch, Array::from_i32(Shape{}, {static_cast<std::int32_t>(i)}), 0); }

// Families whose batched computation does the same float operations per example as one example
// does (so the results are bitwise equal): the rest sum in another order when batched (products,
// convolutions, attention, normalization statistics).
bool bitwise_family(const OpCase& c) {
  const std::string f = c.family;
  return f != "product" && f != "convolution" && f != "attention" && f != "normalization";
}

// Warnings raised while alive, collected.
struct CollectWarnings {
  std::vector<std::string> seen;
  WarningHandler previous;
  CollectWarnings() {
    previous = set_warning_handler([this](const std::string& m) { seen.push_back(m); });
  }
  ~CollectWarnings() { set_warning_handler(previous); }
};

constexpr std::int64_t kB = 3;

}  // namespace

TEST_CASE("vmap of every op family equals a loop over the examples (mapped x, mapped w, both)") {
  CollectWarnings warnings;
  for (const OpCase& c : linum::testing::op_cases()) {
    const std::string op_name = c.op;
    CAPTURE(op_name);
    const std::string family = c.family;
    CAPTURE(family);
    const Array xs = random_array(with_batch(kB, c.x_shape), 11, -1.0f, 1.0f, 0.05f);
    const Array ws = random_array(with_batch(kB, c.w_shape), 12, -1.0f, 1.0f, 0.05f);
    const Array w0 = example(ws, 1), x0 = example(xs, 2);
    auto f = [c](const Array& x, const Array& w) { return c.apply(x * 1.5f, w); };
    for (int mode = 0; mode < 3; ++mode) {
      CAPTURE(mode);
      std::optional<int> ax = mode == 2 ? std::nullopt : std::optional<int>(0);
      std::optional<int> aw = mode == 1 ? std::nullopt : std::optional<int>(0);
      const Array got = vmap(f, {.in_axes = {ax, aw}})(ax ? xs : x0, aw ? ws : w0);
      std::vector<Array> rows;
      for (std::int64_t b = 0; b < kB; ++b) rows.push_back(f(ax ? example(xs, b) : x0, aw ? example(ws, b) : w0));
      const Array want = stack(rows);
      REQUIRE(got.shape() == want.shape());
      CHECK(!got.batched());
      if (bitwise_family(c)) {
        CHECK(bitwise_equal(got, want));
      } else {
        CHECK(max_abs_diff(got, want) <= 1e-5f * (1.0f + max_abs(want)));
      }
    }
  }
  // Only the user-defined op (custom_vjp) has no batching rule: it ran as a loop and said so once.
  std::set<std::string> looped;
  for (const std::string& m : warnings.seen)
    if (m.find("has no batching rule") != std::string::npos) looped.insert(m.substr(0, m.find("' has")));
  CHECK(looped.size() == 1);
  CHECK(looped.count("vmap: op 'swish") == 1);
}

TEST_CASE("per-example gradients (vmap of grad) equal per-example grad calls, for every op family") {
  CollectWarnings quiet;
  for (const OpCase& c : linum::testing::op_cases()) {
    const std::string op_name = c.op;
    CAPTURE(op_name);
    const Array xs = random_array(with_batch(kB, c.x_shape), 21, -1.0f, 1.0f, 0.05f);
    const Array ws = random_array(with_batch(kB, c.w_shape), 22, -1.0f, 1.0f, 0.05f);
    const Array w = example(ws, 0);
    auto loss = [c](const Array& x, const Array& w) { return sum(square(astype(c.apply(x * 1.5f, w), DType::f32))); };
    // w shared (in_axes nullopt): its gradient is still per example.
    const auto [gx, gw] = vmap(grad<0, 1>(loss), {.in_axes = {0, std::nullopt}})(xs, w);
    REQUIRE(gx.shape() == xs.shape());
    REQUIRE(gw.shape() == with_batch(kB, w.shape()));
    for (std::int64_t b = 0; b < kB; ++b) {
      CAPTURE(b);
      const auto [ex, ew] = grad<0, 1>(loss)(example(xs, b), w);
      const Array gxb = example(gx, b), gwb = example(gw, b);
      if (bitwise_family(c)) {
        CHECK(bitwise_equal(gxb, ex));
        CHECK(bitwise_equal(gwb, ew));
      } else {
        CHECK(max_abs_diff(gxb, ex) <= 1e-5f * (1.0f + max_abs(ex)));
        CHECK(max_abs_diff(gwb, ew) <= 1e-5f * (1.0f + max_abs(ew)));
      }
    }
  }
}

TEST_CASE("grad of vmap equals the gradient of the summed loop, for every op family") {
  CollectWarnings quiet;
  for (const OpCase& c : linum::testing::op_cases()) {
    const std::string op_name = c.op;
    CAPTURE(op_name);
    const Array xs = random_array(with_batch(kB, c.x_shape), 31, -1.0f, 1.0f, 0.05f);
    const Array w = random_array(c.w_shape, 32, -1.0f, 1.0f, 0.05f);
    auto f = [c](const Array& x, const Array& w) { return c.apply(x * 1.5f, w); };
    const auto [gx, gw] = grad<0, 1>([&](const Array& x, const Array& w) {
      return sum(square(astype(vmap(f, {.in_axes = {0, std::nullopt}})(x, w), DType::f32)));
    })(xs, w);
    const auto [lx, lw] = grad<0, 1>([&](const Array& x, const Array& w) {
      Array total = Array::scalar(0.0f);
      for (std::int64_t b = 0; b < kB; ++b) total = total + sum(square(astype(f(example(x, b), w), DType::f32)));
      return total;
    })(xs, w);
    CHECK(max_abs_diff(gx, lx) <= 1e-5f * (1.0f + max_abs(lx)));
    CHECK(max_abs_diff(gw, lw) <= 1e-5f * (1.0f + max_abs(lw)));
  }
}

TEST_CASE("vmap: in_axes and out_axes other than 0, axis_size, pytrees, nested vmap") {
  const Array a = random_array(Shape{4, 3, 5}, 41);
  auto f = [](const Array& x) { return sum(x * x, {0}); };  // one example [4, 5] -> [5]
  SUBCASE("in axis 1, out axis 1") {
    const Array got = vmap(f, {.in_axes = {1}, .out_axes = {1}})(a);
    REQUIRE(got.shape() == Shape({5, 3}));
    for (std::int64_t b = 0; b < 3; ++b)
      CHECK(bitwise_equal(take(got, Array::from_i32(Shape{}, {static_cast<std::int32_t>(b)}), 1),
                          f(take(a, Array::from_i32(Shape{}, {static_cast<std::int32_t>(b)}), 1))));
    CHECK(bitwise_equal(vmap(f, {.in_axes = {-2}, .out_axes = {-1}})(a), got));
  }
  SUBCASE("nothing mapped: axis_size repeats the result") {
    const Array got = vmap(f, {.in_axes = {std::nullopt}, .axis_size = 2})(a);
    REQUIRE(got.shape() == Shape({2, 3, 5}));
    CHECK(bitwise_equal(example(got, 1), f(a)));
    CHECK_THROWS_AS(vmap(f, {.in_axes = {std::nullopt}})(a), ValueError);
  }
  SUBCASE("out_axes nullopt for a result that does not depend on the example") {
    auto g = [](const Array& x, const Array& w) { return std::make_pair(x * w, w * 2.0f); };
    const auto [xw, w2] = vmap(g, {.in_axes = {0, std::nullopt}, .out_axes = {0, std::nullopt}})(a, Array::full(Shape{3, 5}, 2.0f));
    CHECK(xw.shape() == a.shape());
    CHECK(w2.shape() == Shape({3, 5}));
    CHECK_THROWS_AS(vmap(g, {.in_axes = {0, std::nullopt}, .out_axes = {std::nullopt}})(a, Array::full(Shape{3, 5}, 2.0f)),
                    BatchingError);
  }
  SUBCASE("pytrees in and out") {
    Tree params;
    params["w"] = random_array(Shape{5, 2}, 42);
    params["b"] = random_array(Shape{2}, 43);
    auto layer = [](const Tree& p, const Array& x) {
      Tree out;
      out["y"] = tanh(matmul(x, p.at("w").array()) + p.at("b").array());
      return std::make_pair(out, std::vector<Array>{x * 2.0f});
    };
    const auto [out, extra] = vmap(layer, {.in_axes = {std::nullopt, 0}})(params, a);
    REQUIRE(out.at("y").array().shape() == Shape({4, 3, 2}));
    REQUIRE(extra.size() == 1);
    for (std::int64_t b = 0; b < 4; ++b) {
      const auto [o1, e1] = layer(params, example(a, b));
      CHECK(max_abs_diff(example(out.at("y").array(), b), o1.at("y").array()) <= 1e-6f);
      CHECK(bitwise_equal(example(extra[0], b), e1[0]));
    }
  }
  SUBCASE("nested vmap equals a double loop; inner and outer mapped arguments mix") {
    const Array w = random_array(Shape{3, 5}, 44);  // mapped by the outer vmap only (over its 3 rows)
    auto inner = [](const Array& x, const Array& w) { return sum(exp(x) * w); };  // x: [5], w: [5]
    auto outer = [&](const Array& x, const Array& w) { return vmap(inner, {.in_axes = {0, std::nullopt}})(x, w); };
    // a: [4, 3, 5]: outer over axis 1 (3), inner over axis 0 (4) of each outer example [4, 5].
    const Array got = vmap(outer, {.in_axes = {1, 0}})(a, w);
    REQUIRE(got.shape() == Shape({3, 4}));
    for (std::int64_t i = 0; i < 3; ++i)
      for (std::int64_t j = 0; j < 4; ++j) {
        const Array x = example(example(a, j), i);
        const Array wi = example(w, i);
        CHECK(bitwise_equal(example(example(got, i), j), inner(x, wi)));
      }
  }
}

TEST_CASE("vmap of checkpoint: values, plain gradients and per-example gradients bitwise as without it") {
  const Array xs = random_array(Shape{5, 8}, 51);
  const Array w1 = random_array(Shape{8, 16}, 52), w2 = random_array(Shape{16, 4}, 53);
  auto block = [](const Array& x, const Array& w1, const Array& w2) { return matmul(gelu(matmul(x, w1)), w2); };
  for (int policy = 0; policy < 3; ++policy) {
    CAPTURE(policy);
    const lift::Policy p = policy == 0   ? lift::Policy(policies::nothing_saveable{})
                           : policy == 1 ? lift::Policy(policies::dots_saveable{})
                                         : lift::Policy(policies::everything_saveable{});
    auto remat_block = checkpoint(block, {.policy = p});
    auto loss = [](auto f) {
      return [f](const Array& w1, const Array& w2, const Array& xs) {
        return sum(square(vmap(f, {.in_axes = {0, std::nullopt, std::nullopt}})(xs, w1, w2)));
      };
    };
    const auto [g1, g2] = grad<0, 1>(loss(block))(w1, w2, xs);
    const auto [r1, r2] = grad<0, 1>(loss(remat_block))(w1, w2, xs);
    CHECK(bitwise_equal(g1, r1));
    CHECK(bitwise_equal(g2, r2));
    auto per_example = [](auto f) {
      return vmap(grad<1, 2>([f](const Array& x, const Array& w1, const Array& w2) { return sum(square(f(x, w1, w2))); }),
                  {.in_axes = {0, std::nullopt, std::nullopt}});
    };
    const auto [p1, p2] = per_example(block)(xs, w1, w2);
    const auto [q1, q2] = per_example(remat_block)(xs, w1, w2);
    CHECK(p1.shape() == Shape({5, 8, 16}));
    CHECK(bitwise_equal(p1, q1));
    CHECK(bitwise_equal(p2, q2));
  }
}

TEST_CASE("vmap: a classifier's per-example loss with per-example labels (take and one_hot with batched indices)") {
  const Array xs = random_array(Shape{6, 10}, 61);
  const Array labels = linum::testing::random_labels(Shape{6}, 62, 4);
  const Array w = random_array(Shape{10, 4}, 63);
  auto nll = [](const Array& w, const Array& x, const Array& label) {
    const Array logp = log_softmax(matmul(x, w));
    return -sum(take(logp, label, 0)) + 0.0f * sum(one_hot(label, 4) * logp);
  };
  const Array gw = vmap(grad(nll), {.in_axes = {std::nullopt, 0, 0}})(w, xs, labels);
  REQUIRE(gw.shape() == Shape({6, 10, 4}));
  const Array losses = vmap(nll, {.in_axes = {std::nullopt, 0, 0}})(w, xs, labels);
  for (std::int64_t b = 0; b < 6; ++b) {
    const Array lb = example(labels, b);
    CHECK(max_abs_diff(example(gw, b), grad(nll)(w, example(xs, b), lb)) <= 1e-6f);
    CHECK(max_abs_diff(example(losses, b), nll(w, example(xs, b), lb)) <= 1e-6f);
  }
}

TEST_CASE("vmap: reading a per-example value is an error, never a silent wrong result") {
  const Array a = random_array(Shape{3, 4}, 71);
  CHECK_THROWS_AS(vmap([](const Array& x) { return Array::full(Shape{}, x.to_vector()[0]); })(a), BatchingError);
  CHECK_THROWS_AS(vmap([](const Array& x) { return Array::full(Shape{}, sum(x).item()); })(a), BatchingError);
  CHECK_THROWS_AS(vmap([](const Array& x, const Array& y) { return x + y; })(a, random_array(Shape{2, 4}, 72)), BatchingError);
  CHECK_THROWS_AS(vmap([](const Array& x) { return x; }, {.in_axes = {2}})(a), BatchingError);
  CHECK_THROWS_AS(vmap([](const Array& x) { return x; }, {.in_axes = {0, 0}})(a), ValueError);
  // An escaped batched value used after its vmap returned is refused too.
  Array escaped;
  (void)vmap([&](const Array& x) { escaped = x * 2.0f; return x; })(a);
  CHECK(escaped.batched());
  CHECK_THROWS_AS((void)escaped.to_vector(), BatchingError);
}

// ---- lift::vmap: Flax's nn.vmap ----------------------------------------------------------------

namespace {

// One member of an ensemble: Dense, dropout, Dense.
struct Mlp {
  std::int64_t hidden = 4;
  Array operator()(Scope& s, const Array& x, bool train) const {
    Array h = gelu(s(nn::Dense{.features = hidden}, x));
    h = s(nn::Dropout{.rate = 0.5}, h, !train);
    return s(nn::Dense{.features = 3}, h);
  }
};

// The ensemble at child "ens" (the plain model below uses the same path for one member).
template <class Member>
struct EnsembleModel {
  std::int64_t members = 4;
  auto operator()(Scope& s, const Array& x, bool train) const {
    return s("ens", lift::vmap<Member>{.body = {}, .variable_axes = {{"params", 0}},
                                       .split_rngs = {{"params", true}, {"dropout", true}},
                                       .in_axes = {std::nullopt, std::nullopt}, .axis_size = members},
             x, train);
  }
};
struct OneMember {
  Array operator()(Scope& s, const Array& x, bool train) const { return s("ens", Mlp{}, x, train); }
};

Array member_slice(const Array& stacked, std::int64_t e) { return example(stacked, e); }

Tree member_params(const Tree& stacked, std::int64_t e) {
  return tree_map([e](const Array& a) { return member_slice(a, e); }, stacked);
}

}  // namespace

TEST_CASE("lift::vmap init: params stacked on a leading axis, member e initialized with key split(K, members)[e]") {
  const std::int64_t E = 4;
  const Array x = random_array(Shape{6, 5}, 81);
  const rng::Key k = rng::key(7);
  const Tree vars = init(EnsembleModel<Mlp>{.members = E}, rng::Streams{{"params", k}, {"dropout", rng::key(8)}}, x, false);
  const Tree& p = vars.at("params").at("ens");
  CHECK(p.at_path("Dense_0/kernel").array().shape() == Shape({E, 5, 4}));
  CHECK(p.at_path("Dense_0/bias").array().shape() == Shape({E, 4}));
  CHECK(p.at_path("Dense_1/kernel").array().shape() == Shape({E, 4, 3}));
  const std::vector<rng::Key> keys = rng::split(k, E);
  for (std::int64_t e = 0; e < E; ++e) {
    CAPTURE(e);
    const Tree one = init(OneMember{}, rng::Streams{{"params", keys[static_cast<std::size_t>(e)]}}, x, false);
    for (const auto& [path, value] : flatten(one.at("params").at("ens")))
      CHECK(bitwise_equal(member_slice(p.at_path(path).array(), e), value));
  }
  // Members differ (their own keys).
  CHECK(!bitwise_equal(member_slice(p.at_path("Dense_0/kernel").array(), 0), member_slice(p.at_path("Dense_0/kernel").array(), 1)));
}

TEST_CASE("lift::vmap apply: one batched call equals each member applied alone, dropout keys split per member") {
  const std::int64_t E = 4;
  const Array x = random_array(Shape{6, 5}, 82);
  const rng::Key kd = rng::key(11);
  const Tree vars = init(EnsembleModel<Mlp>{.members = E}, rng::Streams{{"params", rng::key(3)}}, x, false);
  const Array y = apply(EnsembleModel<Mlp>{.members = E}, vars, {.rngs = {{"dropout", kd}}}, x, true);
  REQUIRE(y.shape() == Shape({E, 6, 3}));
  CHECK(!y.batched());
  const std::vector<rng::Key> dkeys = rng::split(kd, E);
  for (std::int64_t e = 0; e < E; ++e) {
    CAPTURE(e);
    Tree one;
    one["params"]["ens"] = member_params(vars.at("params").at("ens"), e);
    const Array ye = apply(OneMember{}, one, {.rngs = {{"dropout", dkeys[static_cast<std::size_t>(e)]}}}, x, true);
    CHECK(max_abs_diff(member_slice(y, e), ye) <= 1e-6f);
  }
  // Different members draw different dropout masks.
  CHECK(max_abs_diff(member_slice(y, 0), member_slice(y, 1)) > 1e-3f);
}

TEST_CASE("lift::vmap: gradients of the ensemble's loss equal each member's, bitwise with lift::remat inside or outside") {
  const std::int64_t E = 3;
  const Array x = random_array(Shape{6, 5}, 83);
  const Tree vars = init(EnsembleModel<Mlp>{.members = E}, rng::Streams{{"params", rng::key(4)}}, x, false);
  const rng::Key kd = rng::key(12);
  auto loss_of = [&](auto model) {
    return [model, x, kd](const Tree& params) {
      Tree v;
      v["params"] = params;
      const Array y = apply(model, v, {.rngs = {{"dropout", kd}}}, x, true);
      return sum(square(y));
    };
  };
  const Tree g = grad(loss_of(EnsembleModel<Mlp>{.members = E}))(vars.at("params"));
  const Tree g_inner = grad(loss_of(EnsembleModel<lift::remat<Mlp>>{.members = E}))(vars.at("params"));
  struct RematOuter {
    std::int64_t members = 3;
    Array operator()(Scope& s, const Array& x, bool train) const {
      return s("ens", lift::remat<lift::vmap<Mlp>>{lift::vmap<Mlp>{.body = {}, .variable_axes = {{"params", 0}},
                                                                    .split_rngs = {{"params", true}, {"dropout", true}},
                                                                    .in_axes = {std::nullopt, std::nullopt}, .axis_size = members}},
               x, train);
    }
  };
  const Tree g_outer = grad(loss_of(RematOuter{}))(vars.at("params"));
  const std::vector<rng::Key> dkeys = rng::split(kd, E);
  for (const auto& entry : flatten(g)) {
    const auto& path = entry.first;
    const auto& value = entry.second;
    CAPTURE(path);
    CHECK(bitwise_equal(value, g_inner.at_path(path).array()));
    CHECK(bitwise_equal(value, g_outer.at_path(path).array()));
  }
  for (std::int64_t e = 0; e < E; ++e) {
    Tree one;
    one["ens"] = member_params(vars.at("params").at("ens"), e);
    const Tree ge = grad([&](const Tree& params) {
      Tree v;
      v["params"] = params;
      return sum(square(apply(OneMember{}, v, {.rngs = {{"dropout", dkeys[static_cast<std::size_t>(e)]}}}, x, true)));
    })(one);
    for (const auto& entry : flatten(ge)) {
      const auto& path = entry.first;
      const auto& value = entry.second;
      CAPTURE(path);
      CHECK(max_abs_diff(member_slice(g.at_path(path).array(), e), value) <= 1e-5f * (1.0f + max_abs(value)));
    }
  }
}

TEST_CASE("lift::vmap: mapped batch statistics update per member; a shared collection written per member is an error") {
  struct BnMember {
    Array operator()(Scope& s, const Array& x) const {
      return s(nn::BatchNorm{.use_running_average = false}, s(nn::Dense{.features = 3}, x));
    }
  };
  struct Model {
    bool map_stats = true;
    Array operator()(Scope& s, const Array& x) const {
      std::map<std::string, int> axes{{"params", 0}};
      if (map_stats) axes["batch_stats"] = 0;
      return s("ens", lift::vmap<BnMember>{.body = {}, .variable_axes = axes, .split_rngs = {{"params", true}},
                                           .in_axes = {0}},
               x);
    }
  };
  const Array xs = random_array(Shape{2, 8, 4}, 84);  // one batch per member
  const Tree vars = init(Model{}, rng::key(5), xs);
  CHECK(vars.at("batch_stats").at_path("ens/BatchNorm_0/mean").array().shape() == Shape({2, 3}));
  auto [y, updates] = apply(Model{}, vars, {.mutable_collections = {"batch_stats"}}, xs);
  CHECK(y.shape() == Shape({2, 8, 3}));
  const Array mean = updates.at("batch_stats").at_path("ens/BatchNorm_0/mean").array();
  REQUIRE(mean.shape() == Shape({2, 3}));
  for (std::int64_t e = 0; e < 2; ++e) {
    Tree one;
    one["params"]["ens"] = member_params(vars.at("params").at("ens"), e);
    one["batch_stats"]["ens"] = member_params(vars.at("batch_stats").at("ens"), e);
    struct Plain {
      Array operator()(Scope& s, const Array& x) const { return s("ens", BnMember{}, x); }
    };
    auto [ye, ue] = apply(Plain{}, one, {.mutable_collections = {"batch_stats"}}, example(xs, e));
    CHECK(max_abs_diff(member_slice(mean, e), ue.at("batch_stats").at_path("ens/BatchNorm_0/mean").array()) <= 1e-6f);
    CHECK(max_abs_diff(member_slice(y, e), ye) <= 1e-5f);
  }
  Tree shared_vars = vars;
  shared_vars["batch_stats"]["ens"] = member_params(vars.at("batch_stats").at("ens"), 0);
  CHECK_THROWS_WITH_AS(apply(Model{.map_stats = false}, shared_vars, {.mutable_collections = {"batch_stats"}}, xs),
                       doctest::Contains("a collection they share"), ValueError);
}

TEST_CASE("lift::vmap composes: RematScope over the ensemble, lift::scan inside each member; gradients bitwise") {
  struct Layer {
    Array operator()(Scope& s, const Array& h) const { return tanh(s(nn::Dense{.features = 4}, h)); }
  };
  struct Deep {  // each member: 3 layers by lift::scan (params stacked [3, ...] inside the member's [E, ...])
    Array operator()(Scope& s, const Array& x) const {
      const Array h = s(nn::Dense{.features = 4}, x);
      return s(lift::scan<Layer>{.length = 3}, h);
    }
  };
  struct Model {
    Array operator()(Scope& s, const Array& x) const {
      return s("ens", lift::vmap<Deep>{.body = {}, .variable_axes = {{"params", 0}}, .split_rngs = {{"params", true}},
                                       .in_axes = {std::nullopt}, .axis_size = 3},
               x);
    }
  };
  struct OneDeep {
    Array operator()(Scope& s, const Array& x) const { return s("ens", Deep{}, x); }
  };
  const Array x = random_array(Shape{5, 6}, 91);
  const Tree vars = init(Model{}, rng::key(9), x);
  CHECK(vars.at("params").at_path("ens/ScanLayer_0/Dense_0/kernel").array().shape() == Shape({3, 3, 4, 4}));
  auto loss = [&](const Tree& p) { return sum(square(apply(Model{}, Tree{{"params", p}}, x))); };
  const Tree g = grad(loss)(vars.at("params"));
  for (lift::RematMode mode : {lift::RematMode::full, lift::RematMode::larger_than}) {
    lift::RematScope remat({.mode = mode, .output_size_threshold = 10});
    const Tree r = grad(loss)(vars.at("params"));
    for (const auto& [path, value] : flatten(g)) CHECK(bitwise_equal(value, r.at_path(path).array()));
  }
  const Array y = apply(Model{}, vars, x);
  for (std::int64_t e = 0; e < 3; ++e) {
    Tree one;
    one["params"]["ens"] = member_params(vars.at("params").at("ens"), e);
    CHECK(max_abs_diff(member_slice(y, e), apply(OneDeep{}, one, x)) <= 1e-6f);
  }
}

TEST_CASE("vmap of hessian: per-example second derivatives equal each example's, through a Dense kernel") {
  const Array xs = random_array(Shape{3, 4}, 92);
  const Array w = random_array(Shape{4, 2}, 93);
  auto f = [](const Array& w, const Array& x) { return sum(tanh(matmul(x, w))); };
  auto hessian_at = [&](const Array& x) { return hessian([f, x](const Array& v) { return f(v, x); })(w); };
  const Array h = vmap(hessian_at)(xs);
  REQUIRE(h.shape() == Shape({3, 4, 2, 4, 2}));
  for (std::int64_t b = 0; b < 3; ++b) CHECK(max_abs_diff(example(h, b), hessian_at(example(xs, b))) <= 1e-5f);
}

TEST_CASE("vmap in bfloat16: every op family equals the loop, bitwise where the examples compute alone") {
  CollectWarnings quiet;
  for (const OpCase& c : linum::testing::op_cases()) {
    const std::string op_name = c.op;
    CAPTURE(op_name);
    const Array xs = astype(random_array(with_batch(kB, c.x_shape), 94, -1.0f, 1.0f, 0.05f), DType::bf16);
    const Array w = astype(random_array(c.w_shape, 95, -1.0f, 1.0f, 0.05f), DType::bf16);
    auto f = [c](const Array& x, const Array& w) { return c.apply(x * 1.5f, w); };
    const Array got = vmap(f, {.in_axes = {0, std::nullopt}})(xs, w);
    std::vector<Array> rows;
    for (std::int64_t b = 0; b < kB; ++b) rows.push_back(f(example(xs, b), w));
    const Array want = stack(rows);
    REQUIRE(got.shape() == want.shape());
    CHECK(got.dtype() == want.dtype());
    if (bitwise_family(c)) CHECK(bitwise_equal(got, want));
    else CHECK(max_abs_diff(got, want) <= 1e-2f * (1.0f + max_abs(want)));
  }
}

TEST_CASE("lift::vmap under the planner: a plan for the calls inside the members meets its budget, gradients bitwise") {
  struct Layer {  // several intermediates per layer: what remat per layer saves
    Array operator()(Scope& s, const Array& h) const {
      const Array z = s(nn::Dense{.features = 64}, h);
      return h + gelu(z) * sigmoid(z) + tanh(z);
    }
  };
  struct Member {
    Array operator()(Scope& s, const Array& x) const {
      Array h = x;
      for (int i = 0; i < 6; ++i) h = s(Layer{}, h);
      return h;
    }
  };
  struct Model {
    Array operator()(Scope& s, const Array& x) const {
      return s("ens", lift::vmap<Member>{.body = {}, .variable_axes = {{"params", 0}}, .split_rngs = {{"params", true}},
                                         .in_axes = {std::nullopt}, .axis_size = 4},
               x);
    }
  };
  const Array x = random_array(Shape{64, 64}, 96);
  const Tree params = init(Model{}, rng::key(1), x).at("params");
  auto loss = [&](const Tree& p) { return sum(square(apply(Model{}, Tree{{"params", p}}, x))); };
  const auto [loss0, plain] = value_and_grad(loss)(params);
  auto step = [&] { (void)value_and_grad(loss)(params); };
  step();
  const std::int64_t fixed = memory::stats().live_bytes;
  std::int64_t peak_plain = 0;
  {
    memory::PeakScope peak;
    step();
    peak_plain = peak.peak_bytes();
  }
  const std::int64_t budget = fixed + (peak_plain - fixed) * 6 / 10;
  const lift::RematPlan plan = lift::plan_remat(std::function<void()>(step), budget, {.depths = {1, 2}});
  CAPTURE(plan.str());
  CHECK(plan.measured_peak_bytes <= budget);
  lift::PlanScope apply_plan(plan);
  const auto [l, g] = value_and_grad(loss)(params);
  CHECK(l.item() == loss0.item());
  for (const auto& [path, value] : flatten(plain)) CHECK(bitwise_equal(value, g.at_path(path).array()));
}

TEST_CASE("lift::vmap maps the body's other methods too (Flax's methods): s.call(&Body::encode, wrapper, x)") {
  struct Enc {
    Array operator()(Scope& s, const Array& x) const { return encode(s, x) * 2.0f; }
    Array encode(Scope& s, const Array& x) const { return tanh(s(nn::Dense{.features = 2}, x)); }
  };
  struct Model {
    Array operator()(Scope& s, const Array& x) const {
      const lift::vmap<Enc> mapped{.body = {}, .variable_axes = {{"params", 0}}, .split_rngs = {{"params", true}},
                                   .in_axes = {std::nullopt}, .axis_size = 3};
      return s.call("ens", &Enc::encode, mapped, x);
    }
  };
  struct One {
    Array operator()(Scope& s, const Array& x) const { return s.call("ens", &Enc::encode, Enc{}, x); }
  };
  const Array x = random_array(Shape{5, 4}, 97);
  const Tree vars = init(Model{}, rng::key(2), x);
  CHECK(vars.at("params").at_path("ens/Dense_0/kernel").array().shape() == Shape({3, 4, 2}));
  const Array y = apply(Model{}, vars, x);
  REQUIRE(y.shape() == Shape({3, 5, 2}));
  for (std::int64_t e = 0; e < 3; ++e) {
    Tree one;
    one["params"]["ens"] = member_params(vars.at("params").at("ens"), e);
    CHECK(max_abs_diff(member_slice(y, e), apply(One{}, one, x)) <= 1e-6f);
  }
}

TEST_CASE("vmap of jvp, and lift::vmap inside a lift::scan body") {
  const Array xs = random_array(Shape{3, 4}, 98);
  const Array v = random_array(Shape{4}, 99);
  auto f = [](const Array& x) { return sin(x) * x; };
  auto jvp_at = [&](const Array& x) { return jvp(f, x, v).second; };
  const Array got = vmap(jvp_at)(xs);
  for (std::int64_t b = 0; b < 3; ++b) CHECK(max_abs_diff(example(got, b), jvp_at(example(xs, b))) <= 1e-6f);

  struct Member {
    Array operator()(Scope& s, const Array& x) const { return tanh(s(nn::Dense{.features = 4}, x)); }
  };
  struct Step {  // each scan step: 2 members mapped, their mean the next carry
    Array operator()(Scope& s, const Array& h) const {
      const Array ys = s(lift::vmap<Member>{.body = {}, .variable_axes = {{"params", 0}}, .split_rngs = {{"params", true}},
                                            .in_axes = {std::nullopt}, .axis_size = 2},
                         h);
      return mean(ys, {0});
    }
  };
  struct Model {
    Array operator()(Scope& s, const Array& x) const { return s(lift::scan<Step>{.length = 3}, x); }
  };
  const Array x = random_array(Shape{5, 4}, 100);
  const Tree vars = init(Model{}, rng::key(3), x);
  const Array& k = vars.at("params").at_path("ScanStep_0/VmapMember_0/Dense_0/kernel").array();
  CHECK(k.shape() == Shape({3, 2, 4, 4}));
  // The same by hand: step i, member e with its slice of the stacked kernel.
  Array h = x;
  const Tree& p = vars.at("params").at_path("ScanStep_0/VmapMember_0");
  for (std::int64_t i = 0; i < 3; ++i) {
    Array sum_e = Array::zeros(Shape{5, 4});
    for (std::int64_t e = 0; e < 2; ++e) {
      const Array w = example(example(p.at_path("Dense_0/kernel").array(), i), e);
      const Array b = example(example(p.at_path("Dense_0/bias").array(), i), e);
      sum_e = sum_e + tanh(matmul(h, w) + b);
    }
    h = sum_e / 2.0f;
  }
  CHECK(max_abs_diff(apply(Model{}, vars, x), h) <= 1e-5f);
}

TEST_CASE("lift::vmap: shared params are created once for all members; members that would differ are an error") {
  struct Member {
    Array operator()(Scope& s, const Array& x) const { return s(nn::Dense{.features = 3}, x); }
  };
  struct Model {
    bool split = false;
    Array operator()(Scope& s, const Array& x) const {
      return s("ens", lift::vmap<Member>{.body = {}, .variable_axes = {}, .split_rngs = {{"params", split}},
                                         .in_axes = {0}},
               x);
    }
  };
  const Array xs = random_array(Shape{4, 2, 5}, 101);
  const Tree vars = init(Model{}, rng::key(1), xs);  // not split: every member makes the same params, kept once
  CHECK(vars.at("params").at_path("ens/Dense_0/kernel").array().shape() == Shape({5, 3}));
  const Array y = apply(Model{}, vars, xs);
  for (std::int64_t e = 0; e < 4; ++e) {
    struct One {
      Array operator()(Scope& s, const Array& x) const { return s("ens", Member{}, x); }
    };
    CHECK(max_abs_diff(member_slice(y, e), apply(One{}, vars, example(xs, e))) <= 1e-6f);
  }
  CHECK_THROWS_WITH_AS(init(Model{.split = true}, rng::key(1), xs), doctest::Contains("the members share that collection"),
                       ValueError);
}

namespace {
// A user primitive without a batching rule whose kernel reads its input inside a parallel loop.
Array twice_by_hand(const Array& x) {
  return autodiff::primitive(
      "twice_by_hand", {&x},
      [&](autodiff::Residuals&) {
        Array y = Array::empty(x.shape());
        float* py = y.mutable_data();
        ops::detail::for_blocks(x.numel(), [&](std::int64_t s, std::int64_t n) {
          const float* px = x.data();
          for (std::int64_t i = s; i < s + n; ++i) py[i] = 2.0f * px[i];
        });
        return y;
      },
      autodiff::higher_order([](autodiff::Cotangents& c, autodiff::Saved) { c.set(0, c.out() * 2.0f); }));
}
}  // namespace

TEST_CASE("vmap: a user primitive without a batching rule runs per example, its parallel kernel included") {
  CollectWarnings warnings;
  const Array xs = random_array(Shape{2, 1 << 18}, 102);  // large enough for parallel blocks
  const Array y = vmap(twice_by_hand)(xs);
  CHECK(bitwise_equal(y, xs * 2.0f));
  const Array g = grad([](const Array& x) { return sum(vmap(twice_by_hand)(x)); })(xs);
  CHECK(bitwise_equal(g, Array::full(xs.shape(), 2.0f)));
  CHECK(std::count_if(warnings.seen.begin(), warnings.seen.end(),
                      [](const std::string& m) { return m.find("'twice_by_hand' has no batching rule") != std::string::npos; }) == 1);
}

TEST_CASE("vmap(grad): an argument the same for every example may still be read as one value") {
  const Array xs = random_array(Shape{3, 4}, 103);
  const Array t = Array::full(Shape{}, 2.0f);
  auto loss = [](const Array& temperature, const Array& x) {
    CHECK(temperature.item() == 2.0f);  // repeated per example, not copied: one value
    return sum(exp(x / temperature));
  };
  const Array g = vmap(grad(loss), {.in_axes = {std::nullopt, 0}})(t, xs);
  REQUIRE(g.shape() == Shape({3}));
  for (std::int64_t b = 0; b < 3; ++b) CHECK(max_abs_diff(example(g, b), grad(loss)(t, example(xs, b))) <= 1e-6f);
}

TEST_CASE("vmap of cumsum, take_along_axis and segment_sum equals the loop (per-example indices too)") {
  const Array xs = random_array(Shape{3, 4, 5}, 104);
  std::vector<std::int32_t> raw;
  for (int i = 0; i < 3 * 4 * 2; ++i) raw.push_back((i * 7) % 5);
  const Array idx = Array::from_i32(Shape{3, 4, 2}, raw);
  const Array seg = Array::from_i32(Shape{4}, {1, 0, 1, 5});
  auto f = [&](const Array& x, const Array& i) {
    return cumsum(x, -1) + sum(take_along_axis(x, i, 1)) + sum(segment_sum(x, seg, 2));
  };
  const Array got = vmap(f)(xs, idx);
  for (std::int64_t b = 0; b < 3; ++b) CHECK(bitwise_equal(example(got, b), f(example(xs, b), example(idx, b))));
  const Array g = grad([&](const Array& x) { return sum(square(vmap(f)(x, idx))); })(xs);
  const Array gl = grad([&](const Array& x) {
    Array t = Array::scalar(0.0f);
    for (std::int64_t b = 0; b < 3; ++b) t = t + sum(square(f(example(x, b), example(idx, b))));
    return t;
  })(xs);
  CHECK(max_abs_diff(g, gl) <= 1e-5f * (1.0f + max_abs(gl)));
}

TEST_CASE("vmap of sort and top_k equals the loop") {
  const Array xs = random_array(Shape{3, 2, 6}, 105);
  auto f = [](const Array& x) { return sort(x, -1) + top_k(x, 6).first * 0.5f; };
  const Array got = vmap(f)(xs);
  for (std::int64_t b = 0; b < 3; ++b) CHECK(bitwise_equal(example(got, b), f(example(xs, b))));
}
