// lift::scan (Flax's nn.scan): stacked variables, per-layer keys derived as Flax derives them, the
// same results as an explicit loop over the layer slices, remat inside the scan, batch statistics
// stacked and updated once; scanned inputs and outputs, pytree carries, broadcast and carried
// collections, split_rngs per stream, reverse.
#include <doctest/doctest.h>
#include <linum/linum.hpp>

#include "testing/gradcheck.hpp"

using namespace linum;
using linum::testing::random_array;

namespace {

struct Layer {
  std::int64_t width = 6;
  Array operator()(Scope& s, const Array& x, bool train) const {
    Array h = gelu(s(nn::Dense{.features = width}, x));
    h = s(nn::Dropout{.rate = 0.25}, h, !train);
    Variable calls = s.variable("stats", "calls", [] { return Array::zeros(Shape{}); });
    if (train && s.is_mutable_collection("stats") && !s.is_initializing()) calls.set(calls.value() + 1.0f);
    return x + h;
  }
};

template <class Body>
struct Net {
  int depth = 4;
  Array operator()(Scope& s, const Array& x, bool train) const {
    return s(lift::scan<Body>{.length = depth}, x, train);
  }
};

// The same computation written as a loop over the layer slices of the stacked variables.
Array manual(const Tree& vars, const Array& x, int depth, rng::Key dropout, bool train) {
  // Keys as Flax derives them: layer i's stream key is split(key, depth)[i], and make_rng inside
  // hashes the full module path with a counter that continues from one whole run of the body
  // (Flax traces the body twice with shared counters), so the Dropout's draw is its second.
  const std::vector<rng::Key> layer_keys = rng::split(dropout, depth);
  Array h = x;
  for (int i = 0; i < depth; ++i) {
    Tree layer = tree_map([i](const Array& a) { return unstack(a)[static_cast<std::size_t>(i)]; },
                          vars.at("params").at("ScanLayer_0"));
    // Apply one layer with the layer's variables and key, mirroring the scan's state: the layer
    // runs twice at the same path, so its make_rng counters continue from one whole run.
    struct TwiceAtScanPath {
      Array operator()(Scope& s, const Array& x, bool train) const {
        (void)s("ScanLayer_0", Layer{}, x, train);
        return s("ScanLayer_0", Layer{}, x, train);
      }
    };
    auto [out, updates] = apply(TwiceAtScanPath{}, Tree{{"params", Tree{{"ScanLayer_0", layer}}}},
                                {.rngs = {{"dropout", layer_keys[static_cast<std::size_t>(i)]}},
                                 .mutable_collections = {"stats"}},
                                h, train);
    h = out;
  }
  return h;
}

}  // namespace

TEST_CASE("scan stacks the variables of its layers along a leading axis") {
  const Array x = random_array(Shape{3, 6}, 1);
  Tree vars = init(Net<Layer>{}, rng::key(0), x, false);
  CHECK(vars.at("params").keys() == std::vector<std::string>{"ScanLayer_0"});
  CHECK(vars.at_path("params/ScanLayer_0/Dense_0/kernel").array().shape() == Shape{4, 6, 6});
  CHECK(vars.at_path("params/ScanLayer_0/Dense_0/bias").array().shape() == Shape{4, 6});
  CHECK(vars.at_path("stats/ScanLayer_0/calls").array().shape() == Shape{4});
  // Each layer got its own initial values.
  auto layers = unstack(vars.at_path("params/ScanLayer_0/Dense_0/kernel").array());
  CHECK_FALSE(layers[0].bitwise_equal(layers[1]));
}

TEST_CASE("scan equals a loop over the layer slices, forward and gradients") {
  const Array x = random_array(Shape{3, 6}, 2);
  Tree vars = init(Net<Layer>{}, rng::key(0), x, false);
  auto run_scan = [&](const Tree& params) {
    return apply(Net<Layer>{}, Tree{{"params", params}, {"stats", vars.at("stats")}},
                 {.rngs = {{"dropout", rng::key(5)}}, .mutable_collections = {"stats"}}, x, true)
        .first;
  };
  Array y = run_scan(vars.at("params"));
  CHECK(y.bitwise_equal(manual(vars, x, 4, rng::key(5), true)));
  // Gradients w.r.t. the stacked params: against finite differences through the whole scan.
  const Array kernel = vars.at_path("params/ScanLayer_0/Dense_0/kernel").array();
  CHECK(linum::testing::check_gradients("scan kernel", [&](const std::vector<Array>& v) {
    Tree p = vars.at("params");
    p.set_path("ScanLayer_0/Dense_0/kernel", Tree(v[0]));
    return run_scan(p);
  }, {kernel}, {.eps = 1e-3, .rtol = 5e-2}));
}

TEST_CASE("remat inside scan: bitwise the gradients of the plain scan; statistics updated once") {
  const Array x = random_array(Shape{3, 6}, 3);
  Tree vars = init(Net<Layer>{}, rng::key(0), x, false);
  CHECK(bitwise_equal(vars, init(Net<lift::remat<Layer>>{}, rng::key(0), x, false)));
  auto step = [&](auto model) {
    return value_and_grad([&](const Tree& params) {
      auto [y, updates] = apply(model, Tree{{"params", params}, {"stats", vars.at("stats")}},
                                {.rngs = {{"dropout", rng::key(9)}}, .mutable_collections = {"stats"}}, x, true);
      return std::make_pair(sum(square(y)), updates);
    })(vars.at("params"));
  };
  auto [v1, u1, g1] = step(Net<Layer>{});
  auto [v2, u2, g2] = step(Net<lift::remat<Layer>>{});
  CHECK(v1.bitwise_equal(v2));
  CHECK(bitwise_equal(g1, g2));
  CHECK(bitwise_equal(u1, u2));
  CHECK(u1.at_path("stats/ScanLayer_0/calls").array().to_vector() == std::vector<float>{1, 1, 1, 1});
}

TEST_CASE("scan errors: a dict from a scan of another length names the variable") {
  const Array x = random_array(Shape{3, 6}, 4);
  Tree vars = init(Net<Layer>{.depth = 4}, rng::key(0), x, false);
  CHECK_THROWS_WITH_AS(apply(Net<Layer>{.depth = 3}, vars, x, false),
                       doctest::Contains("needs a leading axis of 3"), ShapeError);
}

TEST_CASE("scan init keys as Flax derives them: split per layer, counters continuing from one run of the body") {
  const Array x = random_array(Shape{3, 6}, 5);
  Tree vars = init(Net<Layer>{}, rng::key(7), x, false);
  const std::vector<rng::Key> layer_keys = rng::split(rng::key(7), 4);
  const std::vector<std::string> dense{"ScanLayer_0", "Dense_0"};
  const auto kernels = unstack(vars.at_path("params/ScanLayer_0/Dense_0/kernel").array());
  for (int i = 0; i < 4; ++i) {
    CAPTURE(i);
    // Flax: kernel and bias drew counts 1 and 2 in the first trace; the loop's draws are 3 and 4.
    const rng::Key k = rng::Streams{{"params", layer_keys[static_cast<std::size_t>(i)]}}.derive("params", dense, 3);
    CHECK(kernels[static_cast<std::size_t>(i)].bitwise_equal(initializers::lecun_normal()(k, Shape{6, 6})));
  }
}

namespace {

int g_layer_calls = 0;

// Layer, counting its runs; with `extra` it draws one more dropout key (a body that draws differently).
struct CountedLayer {
  bool extra = false;
  Array operator()(Scope& s, const Array& x, bool train) const {
    ++g_layer_calls;
    if (extra && train) (void)s.make_rng("dropout");
    return Layer{}(s, x, train);
  }
};
struct CountedNet {
  bool extra = false;
  Array operator()(Scope& s, const Array& x, bool train) const {
    return s("ScanLayer_0", lift::scan<CountedLayer>{.body = CountedLayer{extra}, .length = 4}, x, train);
  }
};

}  // namespace

TEST_CASE("scan with dropout: one run per layer once the body's counters are known (Flax's keys, no extra iteration)") {
  lift::detail::forget_predicted_counters();
  const Array x = random_array(Shape{3, 6}, 5);
  const Tree vars = init(CountedNet{}, rng::key(7), x, false);
  auto run = [&](const CountedNet& net, rng::Key key) {
    g_layer_calls = 0;
    return apply(net, vars, {.rngs = {{"dropout", key}}, .mutable_collections = {"stats"}}, x, true).first;
  };
  // The first call runs the first layer once more to learn where Flax's counters continue from.
  const Array first = run(CountedNet{}, rng::key(3));
  CHECK(g_layer_calls == 5);
  CHECK(first.bitwise_equal(manual(vars, x, 4, rng::key(3), true)));
  // Later calls (any key: the counters do not depend on it) run each layer once, with the same keys.
  const Array again = run(CountedNet{}, rng::key(3));
  CHECK(g_layer_calls == 4);
  CHECK(again.bitwise_equal(first));
  const Array other = run(CountedNet{}, rng::key(11));
  CHECK(g_layer_calls == 4);
  CHECK(other.bitwise_equal(manual(vars, x, 4, rng::key(11), true)));
  // Under grad too: 4 runs forward (and no recomputation without remat).
  g_layer_calls = 0;
  (void)grad([&](const Tree& p) {
    Tree v = vars;
    v.set("params", p);
    return sum(apply(CountedNet{}, v, {.rngs = {{"dropout", rng::key(3)}}, .mutable_collections = {"stats"}}, x, true).first);
  })(vars.at("params"));
  CHECK(g_layer_calls == 4);
  // A body that now draws differently (same type and path): the prediction fails the check, the call
  // falls back to the extra run and gives what a first call would.
  const Array changed = run(CountedNet{.extra = true}, rng::key(3));
  CHECK(g_layer_calls == 6);  // iteration 0 from the stale prediction, the first run, iteration 0 again, 1..3
  lift::detail::forget_predicted_counters();
  const Array fresh = run(CountedNet{.extra = true}, rng::key(3));
  CHECK(g_layer_calls == 5);
  CHECK(changed.bitwise_equal(fresh));
}

namespace {

// An RNN-style cell: carry (h, steps), input x_t, output y_t.
struct Cell {
  Array operator()(Scope& s, const Array& h, const Array& x) const { return tanh(s(nn::Dense{.features = 4}, h) + x); }
  std::pair<std::pair<Array, Array>, Array> operator()(Scope& s, const std::pair<Array, Array>& carry, const Array& x) const {
    Array h = (*this)(s, carry.first, x);
    return {{h, carry.second + 1.0f}, h * 2.0f};
  }
};

struct ScannedRnn {
  bool reverse = false;
  lift::ScanSchedule schedule{};
  auto operator()(Scope& s, const std::pair<Array, Array>& carry, const Array& xs) const {
    return s(lift::scan<Cell>{.reverse = reverse, .variable_broadcast = {"params"}, .split_rngs = {{"params", false}},
                              .schedule = schedule},
             carry, lift::scanned(xs));
  }
};

// A cell that draws dropout masks, with gates four times the carry's width as an LSTM's:
// y_t = dropout(h_t).
struct DropCell {
  std::pair<Array, Array> operator()(Scope& s, const Array& h, const Array& x) const {
    Array gates = tanh(s(nn::Dense{.features = 32}, h));
    Array next = tanh(s(nn::Dense{.features = 8}, gates) + x);
    return {next, s(nn::Dropout{.rate = 0.3}, next, false)};
  }
};
struct DropRnn {
  lift::ScanSchedule schedule{};
  auto operator()(Scope& s, const Array& h, const Array& xs) const {
    return s(lift::scan<DropCell>{.variable_broadcast = {"params"}, .split_rngs = {{"params", false}, {"dropout", true}},
                                  .schedule = schedule},
             h, lift::scanned(xs));
  }
};

// The same cell unrolled by hand, in the same scope (the name shares its params).
struct UnrolledRnn {
  bool reverse = false;
  auto operator()(Scope& s, const std::pair<Array, Array>& carry, const Array& xs) const {
    const auto steps = unstack(xs);
    std::vector<Array> ys(steps.size());
    std::pair<Array, Array> c = carry;
    for (std::size_t k = 0; k < steps.size(); ++k) {
      const std::size_t t = reverse ? steps.size() - 1 - k : k;
      auto [next, y] = s("ScanCell_0", Cell{}, c, steps[t]);
      c = next;
      ys[t] = y;
    }
    return std::make_pair(c, stack(ys));
  }
};

}  // namespace

TEST_CASE("scan with scanned inputs, stacked outputs and a pytree carry equals the unrolled loop, values and gradients bitwise") {
  const Array xs = random_array(Shape{5, 2, 4}, 6);  // [time, batch, features]
  const std::pair<Array, Array> h0{random_array(Shape{2, 4}, 7), Array::zeros(Shape{})};
  for (bool reverse : {false, true}) {
    CAPTURE(reverse);
    Tree vars = init(ScannedRnn{reverse}, rng::key(1), h0, xs);
    CHECK(bitwise_equal(vars, init(UnrolledRnn{reverse}, rng::key(1), h0, xs)));
    CHECK(vars.at_path("params/ScanCell_0/Dense_0/kernel").array().shape() == Shape{4, 4});  // broadcast: not stacked
    auto run = [&](auto model) {
      return value_and_grad<0, 1>([&](const Tree& p, const Array& x) {
        auto [carry, ys] = apply(model, Tree{{"params", p}}, h0, x);
        CHECK(ys.shape() == Shape{5, 2, 4});
        CHECK(carry.second.item() == 5.0f);
        return sum(square(ys)) + sum(carry.first);
      })(vars.at("params"), xs);
    };
    auto [v1, gp1, gx1] = run(ScannedRnn{reverse});
    auto [v2, gp2, gx2] = run(UnrolledRnn{reverse});
    CHECK(v1.bitwise_equal(v2));
    CHECK(bitwise_equal(gp1, gp2));
    CHECK(gx1.bitwise_equal(gx2));
  }
}

namespace {

// Draws from the "noise" stream and counts its calls in a carried collection.
struct Noisy {
  std::pair<Array, Array> operator()(Scope& s, const Array& h, const Array& x) const {
    Variable calls = s.variable("counter", "calls", [] { return Array::zeros(Shape{}); });
    if (!s.is_initializing()) calls.set(calls.value() + 1.0f);
    const Array noise = rng::uniform(s.make_rng("noise"), Shape{2});
    return {h + x, noise};
  }
};

template <class Body>
auto noisy_scan(const std::map<std::string, bool>& split, Body body = {}) {
  return lift::scan<Body>{.body = body, .variable_carry = {"counter"}, .split_rngs = split};
}

}  // namespace

TEST_CASE("scan split_rngs per stream: split streams differ per iteration, broadcast ones repeat, others are not passed") {
  const Array h = Array::zeros(Shape{2}), xs = random_array(Shape{3, 2}, 8);
  auto ys_for = [&](const std::map<std::string, bool>& split) {
    struct M {
      std::map<std::string, bool> split;
      auto operator()(Scope& s, const Array& h0, const Array& x) const { return s(noisy_scan<Noisy>(split), h0, lift::scanned(x)); }
    };
    const M m{split};
    Tree vars = init(m, rng::Streams{{"params", rng::key(0)}, {"noise", rng::key(1)}}, h, xs);
    auto [out, updates] = apply(m, vars, {.rngs = {{"noise", rng::key(2)}}, .mutable_collections = {"counter"}}, h, xs);
    CHECK(updates.at_path("counter/ScanNoisy_0/calls").array().item() == 3.0f);  // carried through 3 iterations
    return unstack(out.second);
  };
  const auto split = ys_for({{"noise", true}});
  CHECK_FALSE(split[0].bitwise_equal(split[1]));
  CHECK_FALSE(split[1].bitwise_equal(split[2]));
  const auto shared = ys_for({{"noise", false}});
  CHECK(shared[0].bitwise_equal(shared[1]));
  CHECK(shared[1].bitwise_equal(shared[2]));
  CHECK_THROWS_WITH_AS(ys_for({{"params", true}}), doctest::Contains("rng stream 'noise'"), ValueError);
}

TEST_CASE("scan errors: lengths that disagree, a collection without a role, a negative axis") {
  const Array h = Array::zeros(Shape{2});
  struct Mismatch {
    Array operator()(Scope& s, const Array& h0, const Array& a) const {
      auto [c, ys] = s(lift::scan<Noisy>{.length = 4, .variable_carry = {"counter"}}, h0, lift::scanned(a));
      return c;
    }
  };
  CHECK_THROWS_WITH_AS(init(Mismatch{}, rng::Streams{{"params", rng::key(0)}, {"noise", rng::key(1)}}, h, random_array(Shape{3, 2}, 9)),
                       doctest::Contains("length is 4 but a scanned argument has a leading axis of 3"), ValueError);
  struct NoRole {
    Array operator()(Scope& s, const Array& h0, const Array& a) const {
      auto [c, ys] = s(lift::scan<Noisy>{.variable_broadcast = {"params"}}, h0, lift::scanned(a));
      return c;
    }
  };
  CHECK_THROWS_WITH_AS(init(NoRole{}, rng::Streams{{"params", rng::key(0)}, {"noise", rng::key(1)}}, h, random_array(Shape{3, 2}, 9)),
                       doctest::Contains("collection 'counter' is in none of variable_axes"), ValueError);
}

TEST_CASE("scan variable_axes along axis 1: stacked on that axis, same values as axis 0 moved") {
  const Array x = random_array(Shape{3, 6}, 10);
  struct Axis1 {
    Array operator()(Scope& s, const Array& h, bool train) const {
      return s(lift::scan<Layer>{.length = 4, .variable_axes = {{"params", 1}, {"stats", 0}}}, h, train);
    }
  };
  Tree v0 = init(Net<Layer>{}, rng::key(0), x, false);
  Tree v1 = init(Axis1{}, rng::key(0), x, false);
  const Array k0 = v0.at_path("params/ScanLayer_0/Dense_0/kernel").array();
  const Array k1 = v1.at_path("params/ScanLayer_0/Dense_0/kernel").array();
  CHECK(k1.shape() == Shape{6, 4, 6});
  CHECK(transpose(k1, {1, 0, 2}).bitwise_equal(k0));
  CHECK(apply(Axis1{}, v1, x, false).bitwise_equal(apply(Net<Layer>{}, v0, x, false)));
}

namespace {

struct Block {
  Array operator()(Scope& s, const Array& x) const { return x + tanh(s(nn::Dense{.features = 6}, x)); }
};

// The nest remat_scan builds, without remat.
struct PlainLevel {
  std::vector<int> lengths;
  std::size_t level = 0;
  static std::string type_name() { return "Block"; }
  Array operator()(Scope& s, const Array& x) const {
    const int n = lengths[level];
    if (level + 1 == lengths.size()) return lift::scan<Block>{.length = n}(s, x);
    return lift::scan<PlainLevel>{.body = {lengths, level + 1}, .length = n}(s, x);
  }
};

struct Deep {
  bool remat = true;
  Array operator()(Scope& s, const Array& x) const {
    if (remat) return s(lift::remat_scan<Block>{.lengths = {2, 3}}, x);
    return s("Remat_scanBlock_0", PlainLevel{{2, 3}}, x);
  }
};

}  // namespace

TEST_CASE("remat_scan: variables shaped (l1, l2, ...), values and gradients bitwise those of the plain nested scan") {
  const Array x = random_array(Shape{4, 6}, 11);
  const Tree vars = init(Deep{}, rng::key(3), x);
  CHECK(vars.at_path("params/Remat_scanBlock_0/Dense_0/kernel").array().shape() == Shape{2, 3, 6, 6});
  CHECK(bitwise_equal(vars, init(Deep{.remat = false}, rng::key(3), x)));
  auto run = [&](bool remat) {
    return value_and_grad([&](const Tree& p) { return sum(square(apply(Deep{.remat = remat}, Tree{{"params", p}}, x))); })(
        vars.at("params"));
  };
  lift::reset_recompute_stats();
  auto [v1, g1] = run(true);
  CHECK(lift::recompute_stats().recomputations == 2 + 2 * 3);  // each outer iteration, each inner one
  auto [v2, g2] = run(false);
  CHECK(v1.bitwise_equal(v2));
  CHECK(bitwise_equal(g1, g2));
  CHECK_THROWS_AS(init(lift::remat_scan<Block>{.lengths = {2, 0}}, rng::key(0), x), ValueError);
}

TEST_CASE("scan schedules: bitwise the plain gradients; binomial does Griewank's minimal extra steps within its carries") {
  const int L = 12;
  std::vector<Array> ws;
  for (int i = 0; i < L; ++i) ws.push_back(random_array(Shape{64, 64}, 100 + static_cast<unsigned>(i), -0.2f, 0.2f));
  const Array x = random_array(Shape{16, 64}, 99);
  auto loss_with = [&](const lift::ScanSchedule& schedule) {
    return value_and_grad([&](const std::vector<Array>& w) {
      auto step = [w](std::int64_t i, const Array& h) { return tanh(matmul(h, w[static_cast<std::size_t>(i)])) + h; };
      return sum(square(lift::run_steps(L, x, step, schedule)));
    })(ws);
  };
  const auto [v0, g0] = loss_with({});
  // Peak activation bytes of the chain differentiated with respect to its input only.
  const std::int64_t carry_bytes = 16 * 64 * 4;
  auto peak_with = [&](const lift::ScanSchedule& schedule) {
    memory::PeakScope peak;
    auto g = grad([&](const Array& in) {
      auto step = [&ws](std::int64_t i, const Array& h) { return tanh(matmul(h, ws[static_cast<std::size_t>(i)])) + h; };
      return sum(square(lift::run_steps(L, in, step, schedule)));
    })(x);
    return peak.peak_growth();
  };
  CHECK(peak_with({}) > L * carry_bytes);  // every step keeps at least one carry-sized value
  for (const lift::ScanSchedule& schedule :
       {lift::ScanSchedule::every_step(), lift::ScanSchedule::sqrt_segments(), lift::ScanSchedule::binomial(1),
        lift::ScanSchedule::binomial(2), lift::ScanSchedule::binomial(3), lift::ScanSchedule::binomial(5)}) {
    CAPTURE(schedule.name());
    CAPTURE(schedule.snapshots);
    lift::reset_step_evaluations();
    const auto [v, g] = loss_with(schedule);
    CHECK(v.bitwise_equal(v0));
    for (int i = 0; i < L; ++i) CHECK(g[static_cast<std::size_t>(i)].bitwise_equal(g0[static_cast<std::size_t>(i)]));
    const std::int64_t extra = lift::step_evaluations() - L;
    if (schedule.kind == lift::ScanSchedule::Kind::binomial) {
      CHECK(extra == lift::binomial_extra_steps(L, schedule.snapshots));
      // At most `snapshots` carries plus one step's taped values and a few gradients in flight.
      lift::reset_step_evaluations();
      const std::int64_t growth = peak_with(schedule);
      CHECK(growth < (schedule.snapshots + 5) * carry_bytes);
    }
    if (schedule.kind == lift::ScanSchedule::Kind::every) CHECK(extra == L);
  }
  // Griewank's closed form, spot-checked against the worked examples of the literature.
  CHECK(lift::binomial_extra_steps(100, 5) == 316);
  CHECK(lift::binomial_extra_steps(100, 10) == 222);
  CHECK(lift::binomial_extra_steps(1000, 10) == 3636);
  CHECK(lift::binomial_extra_steps(2, 1) == 1);
  CHECK_THROWS_AS(lift::run_steps(3, x, [](std::int64_t, const Array& h) { return h; }, lift::ScanSchedule::binomial(0)),
                  ValueError);
}

TEST_CASE("scan of modules under a schedule: bitwise the plain scan's gradients and updates, dropout keys included") {
  const Array x = random_array(Shape{3, 6}, 12);
  struct Scheduled {
    lift::ScanSchedule schedule;
    Array operator()(Scope& s, const Array& h, bool train) const {
      return s(lift::scan<Layer>{.length = 6, .schedule = schedule}, h, train);
    }
  };
  const Tree vars = init(Scheduled{}, rng::key(0), x, false);
  auto step = [&](const lift::ScanSchedule& schedule) {
    return value_and_grad([&](const Tree& params) {
      auto [y, updates] = apply(Scheduled{schedule}, Tree{{"params", params}, {"stats", vars.at("stats")}},
                                {.rngs = {{"dropout", rng::key(4)}}, .mutable_collections = {"stats"}}, x, true);
      return std::make_pair(sum(square(y)), updates);
    })(vars.at("params"));
  };
  const auto [v0, u0, g0] = step({});
  for (const lift::ScanSchedule& schedule :
       {lift::ScanSchedule::every_step(), lift::ScanSchedule::sqrt_segments(), lift::ScanSchedule::binomial(2)}) {
    CAPTURE(schedule.name());
    const auto [v, u, g] = step(schedule);
    CHECK(v.bitwise_equal(v0));
    CHECK(bitwise_equal(g, g0));
    CHECK(bitwise_equal(u, u0));
  }
  CHECK(u0.at_path("stats/ScanLayer_0/calls").array().to_vector() == std::vector<float>(6, 1.0f));
}

TEST_CASE("schedules over a scan with per-step outputs (an RNN over time): bitwise the plain gradients, less memory") {
  const std::vector<lift::ScanSchedule> schedules{lift::ScanSchedule::every_step(), lift::ScanSchedule::sqrt_segments(),
                                                  lift::ScanSchedule::binomial(3)};
  SUBCASE("pytree carry, reverse, gradients for parameters and inputs") {
    const Array xs = random_array(Shape{9, 2, 4}, 16);
    const std::pair<Array, Array> h0{random_array(Shape{2, 4}, 17), Array::zeros(Shape{})};
    for (bool reverse : {false, true}) {
      CAPTURE(reverse);
      const Tree vars = init(ScannedRnn{reverse}, rng::key(1), h0, xs);
      auto run = [&](const lift::ScanSchedule& schedule) {
        return value_and_grad<0, 1>([&](const Tree& p, const Array& x) {
          auto [carry, ys] = apply(ScannedRnn{reverse, schedule}, Tree{{"params", p}}, h0, x);
          CHECK(ys.shape() == Shape{9, 2, 4});
          return sum(square(ys * Array::arange(4))) + sum(carry.first) + carry.second;
        })(vars.at("params"), xs);
      };
      const auto [v0, gp0, gx0] = run({});
      for (const auto& schedule : schedules) {
        CAPTURE(schedule.name());
        const auto [v, gp, gx] = run(schedule);
        CHECK(v.bitwise_equal(v0));
        CHECK(bitwise_equal(gp, gp0));
        CHECK(gx.bitwise_equal(gx0));
      }
    }
  }
  SUBCASE("dropout keys per step are those of the plain scan; memory falls with the schedule") {
    const std::int64_t T = 64;
    const Array xs = random_array(Shape{T, 16, 8}, 18);
    const Array h0 = random_array(Shape{16, 8}, 19);
    const Tree vars = init(DropRnn{}, rng::Streams{{"params", rng::key(2)}, {"dropout", rng::key(3)}}, h0, xs);
    auto loss = [&](const lift::ScanSchedule& schedule) {
      return [&, schedule](const Tree& p) {
        const std::pair<Array, Array> out = apply(DropRnn{schedule}, Tree{{"params", p}}, {.rngs = {{"dropout", rng::key(5)}}}, h0, xs);
        return sum(square(out.second)) + sum(out.first);
      };
    };
    const auto [v0, g0] = value_and_grad(loss({}))(vars.at("params"));
    auto peak = [&](const lift::ScanSchedule& schedule) {
      memory::PeakScope scope;
      const Tree g = grad(loss(schedule))(vars.at("params"));
      return scope.peak_growth();
    };
    const std::int64_t plain = peak({});
    for (const auto& schedule : schedules) {
      CAPTURE(schedule.name());
      const auto [v, g] = value_and_grad(loss(schedule))(vars.at("params"));
      CHECK(v.bitwise_equal(v0));
      CHECK(bitwise_equal(g, g0));
      const std::int64_t growth = peak(schedule);
      CAPTURE(growth);
      CAPTURE(plain);
      // The ys and the kept carries stay; the steps' activations go.
      CHECK(growth < plain / 2);
    }
  }
}

namespace {

// A layer that shows its kernel to the test: the array the scan hands the iteration.
struct KernelProbe {
  std::int64_t width = 16;
  std::vector<Array>* seen = nullptr;
  Array operator()(Scope& s, const Array& x) const {
    const Array k = s.param("kernel", initializers::lecun_normal(), Shape{x.dim(-1), width});
    if (seen != nullptr && !s.is_initializing()) seen->push_back(k);
    return x + tanh(matmul(x, k));
  }
};

struct ProbeNet {
  int depth = 4;
  std::int64_t width = 16;
  std::vector<Array>* seen = nullptr;
  Array operator()(Scope& s, const Array& x) const {
    lift::scan<KernelProbe> scan{.length = depth};
    scan.body = KernelProbe{width, seen};
    return s(scan, x);
  }
};

}  // namespace

TEST_CASE("scan hands each iteration a view of the stacked variables, not a copy; the same values and gradients") {
  for (std::int64_t width : {16, 6}) {  // 16: 1 KiB slices, all aligned (views); 6: mostly copies
    CAPTURE(width);
    const Array x = random_array(Shape{3, width}, 9);
    std::vector<Array> seen;
    const ProbeNet net{4, width, &seen};
    const Tree vars = init(net, rng::key(0), x);
    const auto leaves = flatten(vars.at("params"));
    REQUIRE(leaves.size() == 1);
    const Array stacked = leaves[0].second;
    REQUIRE(stacked.shape() == Shape{4, width, width});
    const Array before = stacked * 1.0f;  // a copy
    seen.clear();
    const Array y = apply(net, vars, x);
    REQUIRE(seen.size() == 4);
    const std::size_t slice_bytes = static_cast<std::size_t>(width * width) * sizeof(float);
    for (std::size_t i = 0; i < seen.size(); ++i) {
      CAPTURE(i);
      const bool aligned = i * slice_bytes % 64 == 0;
      CHECK((seen[i].raw() == static_cast<const char*>(stacked.raw()) + i * slice_bytes) == aligned);
      CHECK(seen[i].bitwise_equal(unstack(stacked)[i]));
    }
    // The same computation as a loop over copies of the slices: the same bits, forward and backward.
    auto loop = [&](const Array& kernel) {
      Array h = x;
      for (const Array& k : unstack(kernel)) h = h + tanh(matmul(h, k));
      return h;
    };
    CHECK(y.bitwise_equal(loop(stacked)));
    const Array g_scan = grad([&](const Array& k) {
      Tree p = vars.at("params");
      p.set_path(leaves[0].first, Tree(k));
      return sum(square(apply(net, Tree{{"params", p}}, x)));
    })(stacked);
    const Array g_loop = grad([&](const Array& k) { return sum(square(loop(k))); })(stacked);
    CHECK(g_scan.bitwise_equal(g_loop));
    // Nothing writes into a view: the stacked variable is unchanged after the backward pass.
    CHECK(stacked.bitwise_equal(before));
  }
  // What a user relies on: a scan's forward pass allocates no per-layer copies of its variables
  // (8 layers of 512 x 512: 8 MiB of kernels, on a batch of 2).
  const Array x = random_array(Shape{2, 512}, 10);
  const ProbeNet big{8, 512, nullptr};
  const Tree vars = init(big, rng::key(1), x);
  memory::PeakScope scope;
  const Array y = apply(big, vars, x);
  MESSAGE("peak bytes of the forward pass over 8 MiB of stacked kernels: ", scope.peak_growth());
  CHECK(scope.peak_growth() < 1024 * 1024);
  CHECK(y.shape() == Shape{2, 512});
}

namespace {

// ScannedRnn on batch-major inputs [batch, time, features]: sliced along axis 1 (Flax's in_axes=1),
// ys stacked on axis 1 (out_axes=1).
struct BatchMajorRnn {
  lift::ScanSchedule schedule{};
  int axis = 1;
  auto operator()(Scope& s, const std::pair<Array, Array>& carry, const Array& xs) const {
    return s(lift::scan<Cell>{.out_axes = axis, .variable_broadcast = {"params"}, .split_rngs = {{"params", false}},
                              .schedule = schedule},
             carry, lift::scanned(xs, axis));
  }
};

}  // namespace

TEST_CASE("scan in_axes / out_axes: batch-major inputs and outputs equal the time-major scan bitwise, also under a schedule") {
  const Array xs_bt = random_array(Shape{3, 5, 4}, 61);  // [batch, time, features]
  const Array xs_tb = swapaxes(xs_bt, 0, 1);
  const std::pair<Array, Array> carry{random_array(Shape{3, 4}, 62), Array::zeros(Shape{3, 4})};
  const Tree vars = init(ScannedRnn{}, rng::key(0), carry, xs_tb);
  CHECK(init(BatchMajorRnn{}, rng::key(0), carry, xs_bt).at_path("params/ScanCell_0/Dense_0/kernel").array().bitwise_equal(
      vars.at_path("params/ScanCell_0/Dense_0/kernel").array()));
  for (const lift::ScanSchedule schedule : {lift::ScanSchedule{}, lift::ScanSchedule::sqrt_segments()}) {
    const auto [c_tb, ys_tb] = apply(ScannedRnn{.schedule = schedule}, vars, carry, xs_tb);
    const auto [c_bt, ys_bt] = apply(BatchMajorRnn{.schedule = schedule}, vars, carry, xs_bt);
    CHECK(c_bt.first.bitwise_equal(c_tb.first));
    CHECK(ys_bt.shape() == Shape{3, 5, 4});
    CHECK(ys_bt.bitwise_equal(swapaxes(ys_tb, 0, 1)));
    auto loss = [&](auto model, const Array& xs) {
      return [model, xs, &carry](const Tree& p) {
        const auto [c, ys] = apply(model, Tree{{"params", p}}, carry, xs);
        return sum(square(ys)) + sum(c.first);
      };
    };
    const Tree g_tb = grad(loss(ScannedRnn{.schedule = schedule}, xs_tb))(vars.at("params"));
    const Tree g_bt = grad(loss(BatchMajorRnn{.schedule = schedule}, xs_bt))(vars.at("params"));
    for (const auto& entry : flatten(g_tb)) {
      const std::string& path = entry.first;  // named: clang 14 cannot capture a structured binding
      const Array& value = entry.second;
      CAPTURE(path);
      CHECK(value.bitwise_equal(g_bt.at_path(path).array()));
    }
  }
  // A negative axis counts from the end; an axis out of range is an error naming it.
  const auto [c_neg, ys_neg] = apply(BatchMajorRnn{.axis = -2}, vars, carry, xs_bt);
  CHECK(ys_neg.bitwise_equal(apply(BatchMajorRnn{}, vars, carry, xs_bt).second));
  CHECK_THROWS_WITH_AS((void)apply(BatchMajorRnn{.axis = 3}, vars, carry, xs_bt), doctest::Contains("axis 3 is out of range"),
                       ValueError);
}

// ---- lift::while_loop ------------------------------------------------------------------------------

namespace {

// Halves and squashes through one Dense until the carry is small: a data-dependent trip count.
struct Shrink {
  lift::ScanSchedule schedule{};
  std::int64_t max_steps = 0;
  Array operator()(Scope& s, const Array& x) const {
    auto cond = [](Scope&, const Array& h) { return sum(square(h)).item() > 0.05f; };
    auto body = [](Scope& s, const Array& h) { return 0.8f * tanh(s(nn::Dense{.features = 8}, h)) + 0.1f * h; };
    return lift::while_loop(s, cond, body, x, {.schedule = schedule, .max_steps = max_steps});
  }
};

// One iteration of Shrink's body, at the path the loop gives it.
struct ShrinkStep {
  Array operator()(Scope& s, const Array& h) const { return 0.8f * tanh(s("Dense_0", nn::Dense{.features = 8}, h)) + 0.1f * h; }
};

// One Dense at the loop's path (the counter example's body without its counter).
struct ShrinkStepDense {
  Array operator()(Scope& s, const Array& h) const { return s("Dense_0", nn::Dense{.features = 4}, h); }
};

// The same loop unrolled in plain C++ on the same params.
std::pair<Array, int> shrink_by_hand(const Tree& params, const Array& x) {
  Array h = x;
  int trips = 0;
  while (sum(square(h)).item() > 0.05f) {
    h = apply(ShrinkStep{}, Tree{{"params", params}}, h);
    ++trips;
  }
  return {h, trips};
}

}  // namespace

TEST_CASE("lift::while_loop: the body's variables made once and shared by the iterations; values and gradients bitwise the unrolled loop; schedules") {
  const Array x = random_array(Shape{3, 8}, 41, -1.0f, 1.0f);
  const Tree vars = init(Shrink{}, rng::key(0), x);
  CHECK(vars.at("params").size() == 1);  // one Dense, whatever the trip count
  CHECK(vars.at_path("params/Dense_0/kernel").array().shape() == Shape{8, 8});
  const auto [by_hand, trips] = shrink_by_hand(vars.at("params"), x);
  REQUIRE(trips > 3);  // the example loops a data-dependent number of times
  CHECK(apply(Shrink{}, vars, x).bitwise_equal(by_hand));
  // init's output is apply's (the loop runs at init on the variables it made)
  CHECK(init_with_output(Shrink{}, rng::Streams(rng::key(0)), x).first.bitwise_equal(by_hand));

  using ParamsAndInput = std::pair<Tree, Array>;
  auto loss = [&](const lift::ScanSchedule& schedule) {
    return value_and_grad([&](const ParamsAndInput& pi) {
      return sum(square(apply(Shrink{schedule}, Tree{{"params", pi.first}}, pi.second)));
    })(ParamsAndInput{vars.at("params"), x});
  };
  const auto [v_hand, g_hand] = value_and_grad([&](const ParamsAndInput& pi) {
    return sum(square(shrink_by_hand(pi.first, pi.second).first));
  })(ParamsAndInput{vars.at("params"), x});
  const auto [v0, g0] = loss({});
  CHECK(v0.bitwise_equal(v_hand));
  CHECK(bitwise_equal(g0.first, g_hand.first));
  CHECK(g0.second.bitwise_equal(g_hand.second));
  // Gradients are those of the function (finite differences on the input; the trip count is
  // locally constant).
  linum::testing::check_gradients(
      "lift::while_loop", [&](const std::vector<Array>& in) { return sum(square(apply(Shrink{}, vars, in[0]))); }, {x});
  for (const lift::ScanSchedule& schedule :
       {lift::ScanSchedule::every_step(), lift::ScanSchedule::sqrt_segments(), lift::ScanSchedule::binomial(1),
        lift::ScanSchedule::binomial(2), lift::ScanSchedule::binomial(3)}) {
    CAPTURE(schedule.name());
    CAPTURE(schedule.snapshots);
    lift::reset_step_evaluations();
    const auto [v, g] = loss(schedule);
    CHECK(v.bitwise_equal(v0));
    CHECK(bitwise_equal(g.first, g0.first));
    CHECK(g.second.bitwise_equal(g0.second));
    const std::int64_t extra = lift::step_evaluations() - trips;
    if (schedule.kind == lift::ScanSchedule::Kind::every) CHECK(extra == trips);  // each iteration recomputed once
    if (schedule.kind == lift::ScanSchedule::Kind::binomial) CHECK(extra == lift::binomial_extra_steps(trips, schedule.snapshots));
  }
}

TEST_CASE("lift::while_loop under binomial(s): the backward pass holds a bounded number of carries, not one per iteration") {
  // A long loop: the carry is large next to the body's parameters.
  struct Long {
    lift::ScanSchedule schedule{};
    Array operator()(Scope& s, const Array& x) const {
      using Carry = std::pair<Array, Array>;  // (state, iteration count)
      auto cond = [](Scope&, const Carry& c) { return c.second.item() < 40.0f; };
      auto body = [](Scope& s, const Carry& c) {
        return Carry{tanh(s(nn::Dense{.features = 64, .use_bias = false}, c.first)) + c.first, c.second + 1.0f};
      };
      return lift::while_loop(s, cond, body, Carry{x, Array::zeros(Shape{})}, {.schedule = schedule}).first;
    }
  };
  const Array x = random_array(Shape{32, 64}, 5, -0.1f, 0.1f);
  const Tree vars = init(Long{}, rng::key(1), x);
  auto peak_with = [&](const lift::ScanSchedule& schedule, Array* g) {
    memory::PeakScope peak;
    *g = grad([&](const Array& in) { return sum(square(apply(Long{schedule}, vars, in))); })(x);
    return peak.peak_growth();
  };
  const std::int64_t carry_bytes = 32 * 64 * 4;
  Array g0, g;
  const std::int64_t plain = peak_with({}, &g0);
  CHECK(plain > 40 * carry_bytes);  // every iteration keeps at least one carry-sized value
  const std::int64_t bounded = peak_with(lift::ScanSchedule::binomial(3), &g);
  CHECK(g.bitwise_equal(g0));
  CHECK(bounded < (3 + 8) * carry_bytes);
  MESSAGE("while_loop peak growth: plain ", plain, " B, binomial(3) ", bounded, " B");
}

TEST_CASE("lift::while_loop: carried collections (Flax's example), keys per iteration, names continue, a loop that never runs") {
  SUBCASE("a counter in a carried collection; cond reads the variable the body creates") {
    struct Counter {
      Array operator()(Scope& s, const Array& x) const {
        auto cond = [](Scope& s, const Array&) {
          return s.variable("state", "acc", [] { return Array::zeros(Shape{}); }).value().item() < 5.0f;
        };
        auto body = [](Scope& s, const Array& c) {
          Variable acc = s.variable("state", "acc", [] { return Array::zeros(Shape{}); });
          acc.set(acc.value() + 1.0f);
          return s(nn::Dense{.features = 4}, c);
        };
        return lift::while_loop(s, cond, body, x, {.carry_variables = {"state"}});
      }
    };
    const Array x = random_array(Shape{2, 4}, 3);
    Tree vars = init(Counter{}, rng::key(2), x);
    CHECK(vars.at_path("state/acc").array().item() == 5.0f);  // init ran the loop, as apply would
    vars.at("state").set_path("acc", Tree(Array::scalar(2.0f)));
    auto [y, updates] = apply(Counter{}, vars, {.mutable_collections = {"state"}}, x);
    CHECK(updates.at_path("state/acc").array().item() == 5.0f);
    Array h = x;
    for (int i = 0; i < 3; ++i) h = apply(ShrinkStepDense{}, Tree{{"params", vars.at("params")}}, h);
    CHECK(y.bitwise_equal(h));
    // Without the collection mutable, the body's write is refused with the apply's advice.
    CHECK_THROWS_WITH_AS(apply(Counter{}, vars, x), doctest::Contains("not mutable in this apply call"), ValueError);
  }
  SUBCASE("split streams: fold_in(key, i) per iteration; a stream mapped to false repeats") {
    struct Drop {
      bool split = true;
      Array operator()(Scope& s, const Array& x) const {
        using Carry = std::pair<Array, Array>;  // (masks so far, count)
        auto cond = [](Scope&, const Carry& c) { return c.second.item() < 3.0f; };
        auto body = [](Scope& s, const Carry& c) {
          const Array mask = s(nn::Dropout{.rate = 0.5}, Array::ones(Shape{16}), false);
          return Carry{c.first + mask * (c.second + 1.0f), c.second + 1.0f};
        };
        return lift::while_loop(s, cond, body, Carry{x, Array::zeros(Shape{})}, {.split_rngs = {{"dropout", split}}}).first;
      }
    };
    const Array zero = Array::zeros(Shape{16});
    const rng::Key key = rng::key(7);
    const Array y = apply(Drop{true}, Tree{}, {.rngs = {{"dropout", key}}}, zero);
    // By hand: iteration i's Dropout_0 draws its first key from fold_in(key, i).
    struct OneDrop {
      Array operator()(Scope& s) const { return s(nn::Dropout{.rate = 0.5}, Array::ones(Shape{16}), false); }
    };
    Array want = zero;
    for (int i = 0; i < 3; ++i)
      want = want + Array(apply(OneDrop{}, Tree{}, {.rngs = {{"dropout", rng::fold_in(key, static_cast<std::uint32_t>(i))}}})) *
                        static_cast<float>(i + 1);
    CHECK(y.bitwise_equal(want));
    const Array same = apply(Drop{false}, Tree{}, {.rngs = {{"dropout", key}}}, zero);
    const Array once = apply(OneDrop{}, Tree{}, {.rngs = {{"dropout", key}}});
    CHECK(same.bitwise_equal(once * 6.0f));
  }
  SUBCASE("the caller's children before and after the loop are named around the body's") {
    struct Around {
      Array operator()(Scope& s, const Array& x) const {
        Array h = s(nn::Dense{.features = 4}, x);
        using Carry = std::pair<Array, Array>;
        h = lift::while_loop(s, [](Scope&, const Carry& c) { return c.second.item() < 2.0f; },
                             [](Scope& s, const Carry& c) { return Carry{s(nn::Dense{.features = 4}, c.first), c.second + 1.0f}; },
                             Carry{h, Array::zeros(Shape{})})
                .first;
        return s(nn::Dense{.features = 4}, h);
      }
    };
    const Tree vars = init(Around{}, rng::key(3), random_array(Shape{1, 4}, 8));
    CHECK(vars.at("params").size() == 3);
    for (const char* name : {"Dense_0", "Dense_1", "Dense_2"}) CHECK(vars.at("params").contains(name));
  }
  SUBCASE("a loop that runs no iteration returns its carry; the body's variables count as used") {
    const Array small = Array::zeros(Shape{3, 8});
    const Tree vars = init(Shrink{}, rng::key(0), random_array(Shape{3, 8}, 41, -1.0f, 1.0f));
    CHECK(apply(Shrink{}, vars, small).bitwise_equal(small));  // no unused-params error
    const Tree made = init(Shrink{}, rng::key(0), small);    // init still creates the body's variables
    CHECK(bitwise_equal(made, vars));
  }
}

TEST_CASE("lift::while_loop errors: max_steps, a carry that changes shape, cond's value, shared collections, schedules with carried ones") {
  const Array x = random_array(Shape{3, 8}, 41, -1.0f, 1.0f);
  const Tree vars = init(Shrink{}, rng::key(0), x);
  CHECK_THROWS_WITH_AS(apply(Shrink{.max_steps = 2}, vars, x), doctest::Contains("cond still holds after max_steps = 2"), ValueError);
  struct Grows {
    Array operator()(Scope& s, const Array& x) const {
      return lift::while_loop(s, [](Scope&, const Array& h) { return h.dim(1) < 5; },
                              [](Scope&, const Array& h) { return concatenate({h, h}, 1); }, x);
    }
  };
  CHECK_THROWS_WITH_AS(apply(Grows{}, Tree{}, Array::ones(Shape{1, 1})), doctest::Contains("keep the carry's shapes"), ValueError);
  struct VectorCond {
    Array operator()(Scope& s, const Array& x) const {
      return lift::while_loop(s, [](Scope&, const Array& h) { return h; }, [](Scope&, const Array& h) { return h; }, x);
    }
  };
  CHECK_THROWS_WITH_AS(apply(VectorCond{}, Tree{}, Array::ones(Shape{2})), doctest::Contains("return a bool or a scalar"), ValueError);
  struct WritesShared {
    Array operator()(Scope& s, const Array& x) const {
      using Carry = std::pair<Array, Array>;
      return lift::while_loop(s, [](Scope&, const Carry& c) { return c.second.item() < 2.0f; },
                              [](Scope& s, const Carry& c) {
                                Variable v = s.variable("stats", "seen", [] { return Array::zeros(Shape{}); });
                                v.set(v.value() + 1.0f);
                                return Carry{c.first, c.second + 1.0f};
                              },
                              Carry{x, Array::zeros(Shape{})})
          .first;
    }
  };
  // Already at init: the loop runs there as apply would.
  CHECK_THROWS_WITH_AS(init(WritesShared{}, rng::key(0), x), doctest::Contains("list it in carry_variables"), ValueError);
  struct ScheduledCounter {
    Array operator()(Scope& s, const Array& x) const {
      return lift::while_loop(s, [](Scope&, const Array&) { return false; }, [](Scope&, const Array& h) { return h; }, x,
                              {.carry_variables = {"state"}, .schedule = lift::ScanSchedule::every_step()});
    }
  };
  CHECK_THROWS_WITH_AS(grad([&](const Array& in) { return sum(apply(ScheduledCounter{}, Tree{}, in)); })(x),
                       doctest::Contains("cannot be combined with carry_variables"), ValueError);
}
