// Recurrent layers: Flax's parameter names and shapes, each cell's equations checked by hand,
// OptimizedLSTMCell = LSTMCell on the same variables, nn::RNN = the cell looped over time (reverse,
// seq_lengths, return_carry), and remat over time: bitwise gradients with less memory.
#include <doctest/doctest.h>

#include "testing/gradcheck.hpp"

#include <linum/linum.hpp>

#include <cmath>

using namespace linum;
using linum::testing::random_array;

namespace {

Array dense(const Tree& p, const Array& x) {
  Array y = matmul(x, p.at("kernel").array());
  return p.contains("bias") ? y + p.at("bias").array() : y;
}

float max_diff(const Array& a, const Array& b) {
  REQUIRE(a.shape() == b.shape());
  float worst = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i) worst = std::max(worst, std::abs(a.data()[i] - b.data()[i]));
  return worst;
}

}  // namespace

TEST_CASE("LSTMCell: Flax's parameter names and shapes, and its equations") {
  const Array x = random_array(Shape{2, 3}, 1);
  const nn::LSTMCell cell{.features = 4};
  const auto carry0 = cell.initialize_carry(x.shape());
  CHECK(carry0.c.shape() == Shape{2, 4});
  const Tree vars = init(cell, rng::key(0), carry0, x);
  const Tree& p = vars.at("params");
  CHECK(p.keys() == std::vector<std::string>{"ii", "hi", "if", "hf", "ig", "hg", "io", "ho"});
  CHECK(p.at("ii").keys() == std::vector<std::string>{"kernel"});
  CHECK(p.at_path("hi/kernel").array().shape() == Shape{4, 4});
  CHECK(p.at_path("hi/bias").array().shape() == Shape{4});
  // The recurrent kernel is orthogonal: K^T K = I.
  const Array k = p.at_path("hf/kernel").array();
  const Array ktk = matmul(transpose(k, {1, 0}), k);
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) CHECK(ktk.data()[i * 4 + j] == doctest::Approx(i == j ? 1.0 : 0.0).epsilon(1e-5).scale(1));

  const nn::LSTMCell::Carry carry{random_array(Shape{2, 4}, 2), random_array(Shape{2, 4}, 3)};
  auto [next, y] = apply(cell, vars, carry, x);
  const Array& c = carry.c;
  const Array& h = carry.h;
  const Array i = sigmoid(dense(p.at("ii"), x) + dense(p.at("hi"), h));
  const Array f = sigmoid(dense(p.at("if"), x) + dense(p.at("hf"), h));
  const Array g = tanh(dense(p.at("ig"), x) + dense(p.at("hg"), h));
  const Array o = sigmoid(dense(p.at("io"), x) + dense(p.at("ho"), h));
  const Array want_c = f * c + i * g;
  CHECK(max_diff(next.c, want_c) < 1e-6f);
  CHECK(max_diff(next.h, o * tanh(want_c)) < 1e-6f);
  CHECK(y.bitwise_equal(next.h));

  // OptimizedLSTMCell: the same variables and the same results (one product per side).
  const nn::OptimizedLSTMCell fast{.features = 4};
  const Tree fast_vars = init(fast, rng::key(0), carry0, x);
  CHECK(same_structure(fast_vars, vars));
  auto [fast_next, fast_y] = apply(fast, vars, carry, x);
  CHECK(max_diff(fast_next.c, next.c) < 1e-5f);
  CHECK(max_diff(fast_y, y) < 1e-5f);
}

TEST_CASE("GRUCell and SimpleCell: Flax's names and equations") {
  const Array x = random_array(Shape{2, 3}, 4);
  const Array h = random_array(Shape{2, 5}, 5);
  const nn::GRUCell gru{.features = 5};
  const Tree p = init(gru, rng::key(1), h, x).at("params");
  CHECK(p.keys() == std::vector<std::string>{"ir", "hr", "iz", "hz", "in", "hn"});
  CHECK(p.at("hr").keys() == std::vector<std::string>{"kernel"});
  CHECK(p.at("hn").keys() == std::vector<std::string>{"kernel", "bias"});
  CHECK(p.at("ir").keys() == std::vector<std::string>{"kernel", "bias"});
  auto [next, y] = apply(gru, Tree{{"params", p}}, h, x);
  const Array r = sigmoid(dense(p.at("ir"), x) + dense(p.at("hr"), h));
  const Array z = sigmoid(dense(p.at("iz"), x) + dense(p.at("hz"), h));
  const Array n = tanh(dense(p.at("in"), x) + r * dense(p.at("hn"), h));
  CHECK(max_diff(next, (1.0f - z) * n + z * h) < 1e-6f);

  const nn::SimpleCell simple{.features = 5, .residual = true};
  const Tree sp = init(simple, rng::key(2), h, x).at("params");
  CHECK(sp.keys() == std::vector<std::string>{"i", "h"});
  auto [s_next, s_y] = apply(simple, Tree{{"params", sp}}, h, x);
  CHECK(max_diff(s_next, tanh(dense(sp.at("i"), x) + dense(sp.at("h"), h) + h)) < 1e-6f);
  CHECK_THROWS_AS(apply(gru, Tree{{"params", p}}, random_array(Shape{2, 4}, 6), x), ShapeError);
}

TEST_CASE("cells take Flax's gate_fn and activation_fn") {
  const Array x = random_array(Shape{2, 3}, 7);
  const Array h = random_array(Shape{2, 4}, 8), c = random_array(Shape{2, 4}, 9);
  const auto hard_sigmoid = [](const Array& v) { return minimum(maximum(v * 0.25f + 0.5f, Array::scalar(0.0f)), Array::scalar(1.0f)); };
  const auto relu_fn = [](const Array& v) { return relu(v); };

  const nn::LSTMCell lstm{.features = 4, .gate_fn = hard_sigmoid, .activation_fn = relu_fn};
  const Tree lp = init(lstm, rng::key(0), nn::LSTMCell::Carry{c, h}, x).at("params");
  auto [next, y] = apply(lstm, Tree{{"params", lp}}, nn::LSTMCell::Carry{c, h}, x);
  auto both = [&](const char* a, const char* b) { return dense(lp.at(a), x) + dense(lp.at(b), h); };
  const Array want_c = hard_sigmoid(both("if", "hf")) * c + hard_sigmoid(both("ii", "hi")) * relu(both("ig", "hg"));
  CHECK(max_diff(next.c, want_c) < 1e-6f);
  CHECK(max_diff(y, hard_sigmoid(both("io", "ho")) * relu(want_c)) < 1e-6f);
  const nn::OptimizedLSTMCell fast{.features = 4, .gate_fn = hard_sigmoid, .activation_fn = relu_fn};
  auto [fast_next, fast_y] = apply(fast, Tree{{"params", lp}}, nn::LSTMCell::Carry{c, h}, x);
  CHECK(max_diff(fast_y, y) < 1e-5f);

  const nn::GRUCell gru{.features = 4, .gate_fn = hard_sigmoid, .activation_fn = relu_fn};
  const Tree gp = init(gru, rng::key(1), h, x).at("params");
  auto [g_next, g_y] = apply(gru, Tree{{"params", gp}}, h, x);
  const Array r = hard_sigmoid(dense(gp.at("ir"), x) + dense(gp.at("hr"), h));
  const Array z = hard_sigmoid(dense(gp.at("iz"), x) + dense(gp.at("hz"), h));
  const Array n = relu(dense(gp.at("in"), x) + r * dense(gp.at("hn"), h));
  CHECK(max_diff(g_next, (1.0f - z) * n + z * h) < 1e-6f);

  const nn::SimpleCell simple{.features = 4, .activation_fn = relu_fn};
  const Tree sp = init(simple, rng::key(2), h, x).at("params");
  auto [s_next, s_y] = apply(simple, Tree{{"params", sp}}, h, x);
  CHECK(max_diff(s_next, relu(dense(sp.at("i"), x) + dense(sp.at("h"), h))) < 1e-6f);
}

TEST_CASE("nn::RNN is the cell looped over time: names under cell, reverse, seq_lengths, return_carry") {
  const Array xs = random_array(Shape{3, 6, 2}, 7);  // [batch, time, in]
  const nn::RNN<nn::LSTMCell> rnn{.cell = {.features = 4}};
  const Tree vars = init(rnn, rng::key(3), xs);
  CHECK(vars.at("params").keys() == std::vector<std::string>{"cell"});
  CHECK(vars.at_path("params/cell/hi/kernel").array().shape() == Shape{4, 4});  // shared, not stacked
  const Array ys = apply(rnn, vars, xs);
  CHECK(ys.shape() == Shape{3, 6, 4});

  // By hand: the cell applied step by step.
  const Tree cell_vars{{"params", vars.at_path("params/cell")}};
  auto carry = rnn.cell.initialize_carry(Shape{3, 2});
  std::vector<nn::LSTMCell::Carry> carries;
  for (int t = 0; t < 6; ++t) {
    auto [next, y] = apply(rnn.cell, cell_vars, carry, reshape(slice_axis(xs, 1, t, t + 1), {3, 2}));
    CHECK(max_diff(y, reshape(slice_axis(ys, 1, t, t + 1), {3, 4})) < 1e-6f);
    carry = next;
    carries.push_back(next);
  }
  auto [final_carry, ys2] = apply(rnn, vars, xs, nn::RNNOptions{.return_carry = true});
  CHECK(max_diff(final_carry.h, carry.h) < 1e-6f);
  CHECK(ys2.bitwise_equal(ys));

  // seq_lengths: row b's carry stops after lengths[b] steps.
  const Array lengths = Array::from_i32(Shape{3}, {6, 2, 4});
  auto [len_carry, len_ys] = apply(rnn, vars, xs, nn::RNNOptions{.return_carry = true, .seq_lengths = lengths});
  for (int b = 0; b < 3; ++b) {
    const int len = lengths.data_i32()[b];
    const Array want = slice_axis(carries[len - 1].h, 0, b, b + 1);
    CHECK(max_diff(slice_axis(len_carry.h, 0, b, b + 1), want) < 1e-6f);
  }

  // reverse: the same as running the time-reversed sequence; keep_order puts outputs back in place.
  const nn::RNN<nn::LSTMCell> back{.cell = {.features = 4}, .reverse = true, .keep_order = true};
  std::vector<Array> steps;
  for (int t = 5; t >= 0; --t) steps.push_back(slice_axis(xs, 1, t, t + 1));
  const Array flipped = concatenate(steps, 1);
  const Array ys_back = apply(back, vars, xs);
  const Array ys_flipped = apply(rnn, vars, flipped);
  for (int t = 0; t < 6; ++t)
    CHECK(max_diff(slice_axis(ys_back, 1, t, t + 1), slice_axis(ys_flipped, 1, 5 - t, 6 - t)) < 1e-6f);
  // time_major gives the same outputs, transposed.
  const nn::RNN<nn::LSTMCell> tm{.cell = {.features = 4}, .time_major = true};
  CHECK(max_diff(transpose(apply(tm, vars, transpose(xs, {1, 0, 2})), {1, 0, 2}), ys) < 1e-6f);
}

TEST_CASE("remat over time: gradients bitwise those of the plain RNN, with less memory") {
  const Array xs = random_array(Shape{16, 64, 32}, 8);
  const nn::RNN<nn::GRUCell> plain{.cell = {.features = 64}};
  const nn::RNN<nn::GRUCell> rematted{.cell = {.features = 64}, .remat = true};
  const Tree vars = init(plain, rng::key(4), xs);
  CHECK(same_structure(init(rematted, rng::key(4), xs), vars));
  auto step = [&](const auto& model, std::int64_t& peak) {
    memory::PeakScope scope;
    Tree g = grad([&](const Tree& p) { return mean(square(apply(model, Tree{{"params", p}}, xs))); })(vars.at("params"));
    peak = scope.peak_growth();
    return g;
  };
  std::int64_t plain_peak = 0, remat_peak = 0;
  const Tree g_plain = step(plain, plain_peak);
  const Tree g_remat = step(rematted, remat_peak);
  CHECK(bitwise_equal(g_plain, g_remat));
  MESSAGE("peak bytes of a training step over 64 steps: plain ", plain_peak, ", remat per step ", remat_peak);
  CHECK(remat_peak < plain_peak * 3 / 4);

  // Schedules over time (sqrt(T) segments, or at most s carries with Revolve's fewest
  // recomputations) give the plain gradients bitwise, reverse and seq_lengths included.
  for (bool reverse : {false, true}) {
    const nn::RNN<nn::GRUCell> base{.cell = {.features = 64}, .reverse = reverse};
    const Tree g_base = step(base, plain_peak);
    for (const lift::ScanSchedule& schedule : {lift::ScanSchedule::sqrt_segments(), lift::ScanSchedule::binomial(4)}) {
      CAPTURE(schedule.name());
      CAPTURE(reverse);
      nn::RNN<nn::GRUCell> scheduled = base;
      scheduled.schedule = schedule;
      std::int64_t peak = 0;
      CHECK(bitwise_equal(step(scheduled, peak), g_base));
      MESSAGE("schedule ", schedule.name(), ": peak bytes ", peak);
      // Fewer carries than one per step, and the parameters' gradient contributions summed as the
      // backward pass goes (not kept per step until a segment ends).
      if (!reverse) CHECK(peak < remat_peak);
    }
  }
  const Array lengths = Array::from_i32(Shape{16}, {64, 3, 17, 64, 1, 40, 8, 9, 10, 11, 12, 13, 14, 15, 16, 60});
  auto with_lengths = [&](const nn::RNN<nn::GRUCell>& model) {
    return grad([&](const Tree& p) {
      const std::pair<Array, Array> out = apply(model, Tree{{"params", p}}, xs, nn::RNNOptions{.seq_lengths = lengths});
      return mean(square(out.second)) + mean(out.first);
    })(vars.at("params"));
  };
  nn::RNN<nn::GRUCell> binomial = plain;
  binomial.schedule = lift::ScanSchedule::binomial(3);
  CHECK(bitwise_equal(with_lengths(binomial), with_lengths(plain)));
}
