// Recurrent layers: Flax's parameter names and shapes, each cell's equations checked by hand,
// OptimizedLSTMCell = LSTMCell on the same variables, nn::RNN = the cell looped over time (reverse,
// seq_lengths, return_carry), and remat over time: bitwise gradients with less memory.
#include <doctest/doctest.h>

#include "testing/gradcheck.hpp"

#include <linum/linum.hpp>
#include <linum/core/kernels/gru.hpp>
#include <linum/core/kernels/lstm.hpp>

#include <cmath>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <tuple>
#include <utility>

using namespace linum;
using linum::testing::random_array;

namespace {

// Every element of two value_and_grad results (the value, then each gradient) bitwise equal.
void check_bitwise_one(const Array& a, const Array& b, std::size_t k) {
  CAPTURE(k);
  CHECK(a.bitwise_equal(b));
}
template <class Tuple, std::size_t... K>
void check_bitwise(const Tuple& a, const Tuple& b, std::index_sequence<K...>) {
  (check_bitwise_one(std::get<K>(a), std::get<K>(b), K), ...);
}
template <class Tuple>
void check_bitwise(const Tuple& a, const Tuple& b) {
  check_bitwise(a, b, std::make_index_sequence<std::tuple_size_v<Tuple>>{});
}

Array dense(const Tree& p, const Array& x) {
  Array y = matmul(x, p.at("kernel").array());
  return p.contains("bias") ? y + p.at("bias").array() : y;
}

// int32 lengths [n]: the given values repeated.
Array lengths_repeating(std::int64_t n, std::initializer_list<std::int32_t> values) {
  std::vector<std::int32_t> out;
  for (std::int64_t i = 0; i < n; ++i) out.push_back(values.begin()[i % static_cast<std::int64_t>(values.size())]);
  return Array::from_i32(Shape{n}, out);
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
  // A gate function nn::RNN does not recognize as sigmoid: the cell's ops scanned over time, where
  // remat and schedules are lift's (the GRU layer op's are tested below).
  const nn::GRUCell cell{.features = 64, .gate_fn = [](const Array& x) { return sigmoid(x); }};
  const nn::RNN<nn::GRUCell> plain{.cell = cell};
  const nn::RNN<nn::GRUCell> rematted{.cell = cell, .remat = true};
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
    const nn::RNN<nn::GRUCell> base{.cell = cell, .reverse = reverse};
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

namespace {

// The LSTM cell written with ops, for comparison with the fused op.
std::pair<Array, Array> composed_lstm(const Array& xg, const Array& hg, const Array& c) {
  const std::int64_t h = c.dim(-1);
  const Array z = xg + hg;
  auto gate = [&](int k) { return slice_axis(z, -1, k * h, (k + 1) * h); };
  const Array i = sigmoid(gate(0)), f = sigmoid(gate(1)), g = tanh(gate(2)), o = sigmoid(gate(3));
  const Array c_next = f * c + i * g;
  return {c_next, o * tanh(c_next)};
}

float max_diff_any(const Array& a, const Array& b) {
  return linum::testing::max_abs_diff(astype(a, DType::f32), astype(b, DType::f32));
}

// An LSTM whose gate function is sigmoid but not recognizably so: nn::RNN takes the cell path.
template <class Cell>
Cell unfused(Cell cell) {
  cell.gate_fn = [](const Array& x) { return sigmoid(x); };
  return cell;
}

// The fused path against the cell path on the same variables: the loss's value, and every
// gradient within `tol`; remat and `schedule` give the fused path's gradients bitwise.
template <class Model, class Loss>
void check_fused_against_cell(const Model& fused, const Model& slow, const Tree& vars, Loss loss, float tol,
                              const lift::ScanSchedule& schedule) {
  auto [v_fast, g_fast] = value_and_grad(loss(fused))(vars.at("params"));
  auto [v_slow, g_slow] = value_and_grad(loss(slow))(vars.at("params"));
  CHECK(std::abs(v_fast.item() - v_slow.item()) < 1e-6f);
  const auto fast_leaves = flatten(g_fast), slow_leaves = flatten(g_slow);
  REQUIRE(fast_leaves.size() == slow_leaves.size());
  for (std::size_t k = 0; k < fast_leaves.size(); ++k) {
    CAPTURE(fast_leaves[k].first);
    CHECK(max_diff(fast_leaves[k].second, slow_leaves[k].second) < tol);
  }
  auto rematted = fused;
  rematted.remat = true;
  CHECK(bitwise_equal(grad(loss(rematted))(vars.at("params")), g_fast));
  auto scheduled = fused;
  scheduled.schedule = schedule;
  CHECK(bitwise_equal(grad(loss(scheduled))(vars.at("params")), g_fast));
}

}  // namespace

TEST_CASE("lstm_cell: the LSTM equations in one op, values and gradients, any hidden size, float32 and bf16") {
  for (std::int64_t hidden : {1, 5, 16, 37}) {
    CAPTURE(hidden);
    const Array xg = random_array(Shape{2, 3, 4 * hidden}, 1, -2.0f, 2.0f);
    const Array hg = random_array(Shape{2, 3, 4 * hidden}, 2, -2.0f, 2.0f);
    const Array c = random_array(Shape{2, 3, hidden}, 3, -2.0f, 2.0f);
    auto [c1, h1] = lstm_cell(xg, hg, c);
    auto [c2, h2] = composed_lstm(xg, hg, c);
    CHECK(max_diff(c1, c2) < 1e-6f);
    CHECK(max_diff(h1, h2) < 1e-6f);
    // Gradients: finite differences of a function of both outputs (and of each alone: an output
    // that gets no gradient).
    for (int which = 0; which < 3; ++which) {
      CAPTURE(which);
      auto f = [which](const std::vector<Array>& in) {
        auto [cn, hn] = lstm_cell(in[0], in[1], in[2]);
        return which == 0 ? cn + hn * 3.0f : which == 1 ? cn : hn;
      };
      CHECK(linum::testing::check_gradients("lstm_cell", f, {xg, hg, c}));
    }
    // The same gradients as the composed cell's.
    auto loss = [](auto cell) {
      return [cell](const Array& a, const Array& b, const Array& cc) {
        auto [cn, hn] = cell(a, b, cc);
        return sum(square(hn) + cn * 0.5f);
      };
    };
    auto [fa, fb, fc] = grad<0, 1, 2>(loss([](const Array& a, const Array& b, const Array& cc) { return lstm_cell(a, b, cc); }))(xg, hg, c);
    auto [ca, cb, cc] = grad<0, 1, 2>(loss(composed_lstm))(xg, hg, c);
    CHECK(max_diff(fa, ca) < 1e-5f);
    CHECK(max_diff(fb, cb) < 1e-5f);
    CHECK(max_diff(fc, cc) < 1e-5f);
    // bf16: computed in float32 and rounded once.
    const Array xb = astype(xg, DType::bf16), hb = astype(hg, DType::bf16), cb16 = astype(c, DType::bf16);
    auto [cbn, hbn] = lstm_cell(xb, hb, cb16);
    CHECK(cbn.dtype() == DType::bf16);
    auto [cwant, hwant] = lstm_cell(astype(xb, DType::f32), astype(hb, DType::f32), astype(cb16, DType::f32));
    CHECK(max_diff_any(cbn, astype(astype(cwant, DType::bf16), DType::f32)) == 0.0f);
    CHECK(max_diff_any(hbn, astype(astype(hwant, DType::bf16), DType::f32)) == 0.0f);
  }
}

TEST_CASE("lstm_cell: bad shapes and dtypes are errors naming the op and the shapes") {
  const Array g8 = Array::zeros(Shape{2, 8}), c2 = Array::zeros(Shape{2, 2});
  CHECK_THROWS_WITH_AS(lstm_cell(g8, g8, Array::zeros(Shape{2, 3})), doctest::Contains("lstm_cell"), ShapeError);
  CHECK_THROWS_WITH_AS(lstm_cell(g8, Array::zeros(Shape{2, 4}), c2), doctest::Contains("f32[2,4]"), ShapeError);
  CHECK_THROWS_WITH_AS(lstm_cell(Array::zeros(Shape{2, 6}), Array::zeros(Shape{2, 6}), c2), doctest::Contains("4 * hidden"), ShapeError);
  CHECK_THROWS_AS(lstm_cell(Array::full_i32(Shape{2, 8}, 1), g8, c2), ShapeError);
  CHECK_THROWS_AS(lstm_cell(Array::scalar(1.0f), Array::scalar(1.0f), Array::scalar(1.0f)), ShapeError);
}

TEST_CASE("nn::RNN runs LSTMs on hoisted input products and the fused cell: the cell's parameters and results") {
  const Array xs = random_array(Shape{3, 7, 5}, 21);
  const Array lengths = Array::from_i32(Shape{3}, {7, 2, 5});
  for (bool optimized : {false, true}) {
    CAPTURE(optimized);
    auto check = [&](auto fused, bool reverse, bool masked) {
      CAPTURE(reverse);
      CAPTURE(masked);
      fused.reverse = reverse;
      fused.keep_order = true;
      auto slow = fused;
      slow.cell = unfused(fused.cell);
      // Same parameters (names, order and values), created by the fused path's init.
      const Tree vars = init(fused, rng::key(5), xs);
      const Tree slow_vars = init(slow, rng::key(5), xs);
      CHECK(vars.at_path("params/cell").keys() == slow_vars.at_path("params/cell").keys());
      CHECK(bitwise_equal(vars, slow_vars));
      auto loss = [&](const auto& model) {
        return [&](const Tree& p) {
          const nn::RNNOptions o{.return_carry = true, .seq_lengths = masked ? std::optional<Array>(lengths) : std::nullopt};
          auto [carry, ys] = apply(model, Tree{{"params", p}}, xs, o);
          return mean(square(ys)) + mean(carry.c) + mean(carry.h * 0.5f);
        };
      };
      // Remat per step and schedules over time: the fused path's gradients, bitwise.
      check_fused_against_cell(fused, slow, vars, loss, 1e-6f, lift::ScanSchedule::binomial(2));
    };
    for (bool reverse : {false, true})
      for (bool masked : {false, true}) {
        if (optimized) check(nn::RNN<nn::OptimizedLSTMCell>{.cell = {.features = 6}}, reverse, masked);
        else check(nn::RNN<nn::LSTMCell>{.cell = {.features = 6}}, reverse, masked);
      }
  }
  // Mixed precision (bf16 compute, float32 parameters): within bf16 rounding of the cell path.
  const nn::RNN<nn::LSTMCell> mixed{.cell = {.features = 6, .dtype = DType::bf16}};
  auto slow = mixed;
  slow.cell = unfused(mixed.cell);
  const Tree vars = init(mixed, rng::key(6), xs);
  const Array y_fast = apply(mixed, vars, xs), y_slow = apply(slow, vars, xs);
  CHECK(y_fast.dtype() == y_slow.dtype());
  CHECK(max_diff_any(y_fast, y_slow) < 0.05f);
  const Tree g = grad([&](const Tree& p) { return mean(square(astype(apply(mixed, Tree{{"params", p}}, xs), DType::f32))); })(vars.at("params"));
  CHECK(g.at_path("cell/hi/kernel").array().dtype() == DType::f32);
  CHECK(linum::testing::max_abs(g.at_path("cell/hi/kernel").array()) > 0.0f);
  // Integer inputs, as the cell's Dense layers take them (cast to the computation dtype), for the
  // LSTM and the GRU, in float32 and bf16.
  const Array ints = astype(random_array(Shape{3, 7, 5}, 22) * 3.0f, DType::i32);
  for (std::optional<DType> dt : {std::optional<DType>(), std::optional<DType>(DType::bf16)}) {
    const nn::RNN<nn::LSTMCell> lstm{.cell = {.features = 6, .dtype = dt}};
    auto lstm_slow = lstm;
    lstm_slow.cell = unfused(lstm.cell);
    const Tree lv = init(lstm, rng::key(7), ints);
    CHECK(max_diff_any(apply(lstm, lv, ints), apply(lstm_slow, lv, ints)) < (dt ? 0.05f : 1e-5f));
    const nn::RNN<nn::GRUCell> gru{.cell = {.features = 6, .dtype = dt}};
    auto gru_slow = gru;
    gru_slow.cell = unfused(gru.cell);
    const Tree gv = init(gru, rng::key(8), ints);
    CHECK(max_diff_any(apply(gru, gv, ints), apply(gru_slow, gv, ints)) < (dt ? 0.05f : 1e-5f));
  }
}

namespace {

// run(offset, in_place_grads): a cell kernel's forward and backward results on rows placed `offset`
// floats past a 64-byte boundary, the gates' cotangents written over the activations or apart. The
// aligned rows (computed in place) and the shifted ones (through scratch) must give the same bits,
// and so must both ways of writing the cotangents.
template <class Run>
void same_bits_in_any_layout(const Run& run) {
  for (bool in_place_grads : {false, true}) {
    CAPTURE(in_place_grads);
    const std::vector<float> aligned = run(0, in_place_grads), shifted = run(1, in_place_grads);
    CHECK(std::memcmp(aligned.data(), shifted.data(), aligned.size() * sizeof(float)) == 0);
  }
  CHECK(run(0, true) == run(0, false));
}

}  // namespace

TEST_CASE("the LSTM cell kernel gives the same bits computing in place (aligned rows) as through its scratch") {
  // Rows of whole packets at 64-byte boundaries are computed where they are; anywhere else they are
  // copied into aligned scratch first. Both must give the same bits (a layer's recomputation may
  // see its rows elsewhere than the forward pass did).
  namespace lk = kernels::lstm;
  for (std::int64_t w : {16, 128, 144}) {
    CAPTURE(w);
    const Array src = random_array(Shape{16 * w}, 91, -3.0f, 3.0f);
    Array scratch_buf = Array::empty(Shape{lk::cell_scratch_floats(w) + 16});
    float* scratch = scratch_buf.mutable_data();
    // Two layouts of the same values: at 64-byte boundaries, and one float off.
    auto run = [&](std::int64_t off, bool in_place_grads) {
      Array buf = Array::zeros(Shape{20 * w + 64});
      float* b = buf.mutable_data() + off;
      float *gates = b, *c_prev = b + 4 * w, *c = b + 5 * w, *h = b + 6 * w, *dh = b + 7 * w, *dc = b + 8 * w, *dg = b + 9 * w;
      std::copy(src.data(), src.data() + 4 * w, gates);
      std::copy(src.data() + 4 * w, src.data() + 5 * w, c_prev);
      std::copy(src.data() + 6 * w, src.data() + 7 * w, dh);
      std::copy(src.data() + 7 * w, src.data() + 8 * w, dc);
      lk::cell_row(gates, w, c_prev, c, h, scratch);
      lk::cell_row_backward(gates, w, c_prev, c, dh, dc, in_place_grads ? gates : dg, scratch);
      std::vector<float> out(gates, gates + 4 * w);  // the gates' cotangents when in place
      if (!in_place_grads) out.assign(dg, dg + 4 * w);
      out.insert(out.end(), c, c + w);
      out.insert(out.end(), h, h + w);
      out.insert(out.end(), dc, dc + w);
      return out;
    };
    same_bits_in_any_layout(run);
  }
}

TEST_CASE("the GRU cell kernel gives the same bits computing in place (aligned rows) as through its scratch") {
  namespace gk = kernels::gru;
  for (std::int64_t w : {16, 128, 144}) {
    CAPTURE(w);
    const Array src = random_array(Shape{16 * w}, 92, -3.0f, 3.0f);
    Array scratch_buf = Array::empty(Shape{gk::cell_scratch_floats(w) + 16});
    float* scratch = scratch_buf.mutable_data();
    auto run = [&](std::int64_t off, bool in_place_grads) {
      Array buf = Array::zeros(Shape{20 * w + 64});
      float* b = buf.mutable_data() + off;
      float *gates = b, *hg = b + 3 * w, *bh = b + 6 * w, *h_prev = b + 9 * w, *hgn = b + 10 * w, *h = b + 11 * w;
      float *dh = b + 12 * w, *dxg = b + 13 * w, *dhgn = b + 16 * w, *dh_prev = b + 17 * w;
      std::copy(src.data(), src.data() + 10 * w, b);  // gates, hg, bh, h_prev
      std::copy(src.data() + 12 * w, src.data() + 13 * w, dh);
      gk::cell_row(gates, hg, bh, w, h_prev, hgn, h, scratch);
      gk::cell_row_backward(gates, hgn, w, h_prev, dh, in_place_grads ? gates : dxg, in_place_grads ? hgn : dhgn, dh_prev,
                            scratch);
      std::vector<float> out(in_place_grads ? gates : dxg, (in_place_grads ? gates : dxg) + 3 * w);
      const float* dn = in_place_grads ? hgn : dhgn;
      out.insert(out.end(), dn, dn + w);
      out.insert(out.end(), h, h + w);
      out.insert(out.end(), dh_prev, dh_prev + w);
      return out;
    };
    same_bits_in_any_layout(run);
  }
}

TEST_CASE("lstm_layer: the cell over time; gradients equal finite differences; recompute segments bitwise") {
  // hidden 134: unit blocks of 128 and 6; 37 steps: chunks of 16, 16 and 5; a batch of 0; hidden
  // 160: blocks of 128 and 32 whose rows sit at 64-byte boundaries (the cell computes them in place).
  // Batches of 32 and 48: the rows in two pieces (of 16 and 24) whose steps run without a barrier.
  for (const auto& dims : {std::array<std::int64_t, 4>{37, 3, 5, 134}, {5, 2, 3, 4}, {1, 1, 1, 1}, {20, 0, 3, 5},
                           {37, 4, 8, 160}, {37, 32, 5, 134}, {21, 48, 3, 160}}) {
    const std::int64_t T = dims[0], N = dims[1], I = dims[2], H = dims[3];
    CAPTURE(T);
    CAPTURE(H);
    const Array x = random_array(Shape{T, N, I}, 31);
    const Array wi = random_array(Shape{I, 4 * H}, 32) * 0.5f, wh = random_array(Shape{H, 4 * H}, 33) * 0.3f;
    const Array b = random_array(Shape{4 * H}, 34), c0 = random_array(Shape{N, H}, 35), h0 = random_array(Shape{N, H}, 36);
    auto [ys, c, h] = lstm_layer(x, wi, b, wh, c0, h0);
    REQUIRE(ys.shape() == Shape{T, N, H});
    // Step by step with ops.
    Array cc = c0, hh = h0;
    float worst = 0;
    for (std::int64_t t = 0; t < T; ++t) {
      auto [cn, hn] = composed_lstm(matmul(reshape(slice_axis(x, 0, t, t + 1), {N, I}), wi) + b, matmul(hh, wh), cc);
      cc = cn;
      hh = hn;
      worst = std::max(worst, max_diff(reshape(slice_axis(ys, 0, t, t + 1), {N, H}), hn));
    }
    CHECK(worst < 1e-5f);
    if (N == 0) continue;
    CHECK(max_diff(c, cc) < 1e-5f);
    CHECK(max_diff(h, hh) < 1e-5f);
    auto loss = [](std::int64_t segment) {
      return [segment](const Array& x, const Array& wi, const Array& b, const Array& wh, const Array& c0, const Array& h0) {
        auto [ys, c, h] = lstm_layer(x, wi, b, wh, c0, h0, {.recompute_segment = segment});
        return sum(square(ys)) * 0.5f + sum(c) + sum(h * 0.25f);
      };
    };
    auto plain = value_and_grad<0, 1, 2, 3, 4, 5>(loss(0))(x, wi, b, wh, c0, h0);
    for (std::int64_t segment : {1, 16, 20, 32, 1000}) {
      CAPTURE(segment);
      auto again = value_and_grad<0, 1, 2, 3, 4, 5>(loss(segment))(x, wi, b, wh, c0, h0);
      check_bitwise(again, plain);
    }
    // A loss of the final carry alone (no cotangent reaches the outputs): the same gradients as
    // with the outputs' cotangent present and zero (equal values; a zero's sign may differ).
    auto carry_loss = [](bool zero_outputs) {
      return [zero_outputs](const Array& x, const Array& wi, const Array& b, const Array& wh, const Array& c0, const Array& h0) {
        auto [ys, c, h] = lstm_layer(x, wi, b, wh, c0, h0);
        const Array l = sum(c) + sum(h * 0.25f);
        return zero_outputs ? l + sum(ys * 0.0f) : l;
      };
    };
    auto absent = value_and_grad<0, 1, 2, 3, 4, 5>(carry_loss(false))(x, wi, b, wh, c0, h0);
    auto zeros = value_and_grad<0, 1, 2, 3, 4, 5>(carry_loss(true))(x, wi, b, wh, c0, h0);
    auto as_list = [](const auto& t) { return std::apply([](const auto&... a) { return std::vector<Array>{a...}; }, t); };
    const std::vector<Array> without = as_list(absent), with_zero = as_list(zeros);
    for (std::size_t k = 0; k < without.size(); ++k) {
      CAPTURE(k);
      CHECK(max_diff(without[k], with_zero[k]) == 0.0f);
    }
    if (T <= 5) {
      const auto f = [](const std::vector<Array>& in) {
        auto [ys, c, h] = lstm_layer(in[0], in[1], in[2], in[3], in[4], in[5]);
        return ys * 2.0f + c + h * 3.0f;
      };
      CHECK(linum::testing::check_gradients("lstm_layer", f, {x, wi, b, wh, c0, h0}));
    }
  }
  // Bad arguments: typed errors naming the op and the shapes.
  const Array x = Array::zeros(Shape{4, 2, 3}), wi = Array::zeros(Shape{3, 8}), wh = Array::zeros(Shape{2, 8});
  const Array b = Array::zeros(Shape{8}), c0 = Array::zeros(Shape{2, 2});
  CHECK_THROWS_WITH_AS(lstm_layer(x, wi, b, wh, c0, Array::zeros(Shape{3, 2})), doctest::Contains("lstm_layer"), ShapeError);
  CHECK_THROWS_WITH_AS(lstm_layer(x, Array::zeros(Shape{4, 8}), b, wh, c0, c0), doctest::Contains("input_kernel f32[4,8]"), ShapeError);
  CHECK_THROWS_AS(lstm_layer(reshape(x, {8, 3}), wi, b, wh, c0, c0), ShapeError);
  CHECK_THROWS_AS(lstm_layer(x, wi, b, Array::zeros(Shape{2, 6}), c0, c0), ShapeError);
  CHECK_THROWS_AS(lstm_layer(x, wi, b, wh, c0, c0, {.recompute_segment = -1}), ValueError);
  // Zero steps: the initial carry back, ys empty.
  auto [ys0, c_0, h_0] = lstm_layer(Array::zeros(Shape{0, 2, 3}), wi, b, wh, c0 + 1.0f, c0 + 2.0f);
  CHECK(ys0.shape() == Shape{0, 2, 2});
  CHECK(c_0.bitwise_equal(c0 + 1.0f));
  CHECK(h_0.bitwise_equal(c0 + 2.0f));
}

namespace {

// A [rows, gates * H] (or [gates * H]) array as one array per gate.
std::vector<Array> per_gate(const Array& w, std::int64_t gates) {
  const std::int64_t H = w.dim(-1) / gates;
  std::vector<Array> out;
  for (std::int64_t k = 0; k < gates; ++k) out.push_back(slice_axis(w, -1, k * H, (k + 1) * H));
  return out;
}

}  // namespace

TEST_CASE("lstm_layer and gru_layer take kernels per gate: bitwise the concatenated arrays' results and gradients") {
  const std::int64_t T = 37, N = 3, I = 5, H = 134;  // unit blocks of 128 and 6; chunks of 16, 16 and 5
  const Array x = random_array(Shape{T, N, I}, 41), c0 = random_array(Shape{N, H}, 45), h0 = random_array(Shape{N, H}, 46);
  SUBCASE("lstm_layer") {
    const Array wi = random_array(Shape{I, 4 * H}, 42) * 0.5f, wh = random_array(Shape{H, 4 * H}, 43) * 0.3f;
    const Array b = random_array(Shape{4 * H}, 44);
    const Tree whole{{"wi", wi}, {"b", b}, {"wh", wh}};
    Tree split;
    for (const char* name : {"wi", "b", "wh"}) {
      const std::vector<Array> parts = per_gate(whole.at(name).array(), 4);
      for (std::size_t k = 0; k < parts.size(); ++k) split[std::string(name) + std::to_string(k)] = parts[k];
    }
    auto gates = [](const Tree& p, const char* name) {
      std::vector<Array> out;
      for (int k = 0; k < 4; ++k) out.push_back(p.at(std::string(name) + std::to_string(k)).array());
      return out;
    };
    for (std::int64_t segment : {0, 16}) {
      CAPTURE(segment);
      auto [l_whole, g_whole] = value_and_grad([&](const Tree& p) {
        auto [ys, c, h] = lstm_layer(x, p.at("wi").array(), p.at("b").array(), p.at("wh").array(), c0, h0,
                                     {.recompute_segment = segment});
        return sum(square(ys)) * 0.5f + sum(c) + sum(h * 0.25f);
      })(whole);
      // Every weight per gate, and a mix (one array for the input kernel).
      for (bool mixed : {false, true}) {
        CAPTURE(mixed);
        auto [l_split, g_split] = value_and_grad([&](const Tree& p) {
          const std::vector<Array> wi_parts = mixed ? std::vector<Array>{wi} : gates(p, "wi");
          auto [ys, c, h] = lstm_layer(x, wi_parts, gates(p, "b"), gates(p, "wh"), c0, h0, {.recompute_segment = segment});
          return sum(square(ys)) * 0.5f + sum(c) + sum(h * 0.25f);
        })(split);
        CHECK(l_split.bitwise_equal(l_whole));
        for (const char* name : {"wi", "b", "wh"}) {
          if (mixed && std::string(name) == "wi") continue;
          const std::vector<Array> want = per_gate(g_whole.at(name).array(), 4);
          for (int k = 0; k < 4; ++k) CHECK(g_split.at(std::string(name) + std::to_string(k)).array().bitwise_equal(want[k]));
        }
      }
    }
    // Wrong part counts and shapes: typed errors naming the op and the parts.
    std::vector<Array> three = per_gate(wh, 4);
    three.pop_back();
    CHECK_THROWS_WITH_AS(lstm_layer(x, per_gate(wi, 4), per_gate(b, 4), three, c0, h0),
                         doctest::Contains("recurrent_kernel must be one array or 4 (one per gate)"), ShapeError);
    std::vector<Array> bad = per_gate(wi, 4);
    bad[2] = Array::zeros(Shape{I, H + 1});
    CHECK_THROWS_WITH_AS(lstm_layer(x, bad, per_gate(b, 4), per_gate(wh, 4), c0, h0), doctest::Contains("f32[5,135]"),
                         ShapeError);
  }
  SUBCASE("gru_layer") {
    const Array wi = random_array(Shape{I, 3 * H}, 52) * 0.5f, wh = random_array(Shape{H, 3 * H}, 53) * 0.3f;
    const Array bi = random_array(Shape{3 * H}, 54), bh = random_array(Shape{3 * H}, 55);
    for (bool recompute : {false, true}) {
      CAPTURE(recompute);
      auto loss_whole = [&](const Array& wi_, const Array& bi_, const Array& wh_, const Array& bh_) {
        auto [ys, h] = gru_layer(x, wi_, bi_, wh_, bh_, h0, {.recompute = recompute});
        return sum(square(ys)) * 0.5f + sum(h * 0.25f);
      };
      auto loss_split = [&](const Array& wi_, const Array& bi_, const Array& wh_, const Array& bh_) {
        auto [ys, h] = gru_layer(x, per_gate(wi_, 3), per_gate(bi_, 3), per_gate(wh_, 3), per_gate(bh_, 3), h0,
                                 {.recompute = recompute});
        return sum(square(ys)) * 0.5f + sum(h * 0.25f);
      };
      // The parts' gradients reach the whole arrays through the slices (each slice's gradient
      // placed in zeros, then summed: exact), so the two must agree bitwise.
      auto want = value_and_grad<0, 1, 2, 3>(loss_whole)(wi, bi, wh, bh);
      auto got = value_and_grad<0, 1, 2, 3>(loss_split)(wi, bi, wh, bh);
      check_bitwise(got, want);
    }
  }
}

TEST_CASE("lstm_layer and gru_layer under vmap and in create-graph mode (second derivatives)") {
  const std::int64_t T = 5, N = 2, I = 3, H = 4;
  const Array xs = random_array(Shape{3, T, N, I}, 61);  // three examples
  const Array wi = random_array(Shape{I, 4 * H}, 62) * 0.5f, wh = random_array(Shape{H, 4 * H}, 63) * 0.3f;
  const Array b = random_array(Shape{4 * H}, 64), c0 = random_array(Shape{N, H}, 65), h0 = random_array(Shape{N, H}, 66);
  // vmap over x (the weights shared), per gate: each example as the op alone computes it.
  auto f = [&](const Array& x) {
    auto [ys, c, h] = lstm_layer(x, per_gate(wi, 4), per_gate(b, 4), per_gate(wh, 4), c0, h0);
    return ys + reshape(c * 2.0f, {1, N, H});
  };
  const Array batched = vmap(f, {.in_axes = {0}})(xs);
  for (std::int64_t e = 0; e < 3; ++e)
    CHECK(reshape(slice_axis(batched, 0, e, e + 1), {T, N, H}).bitwise_equal(f(reshape(slice_axis(xs, 0, e, e + 1), {T, N, I}))));
  const Array gwi = random_array(Shape{I, 3 * H}, 67) * 0.5f, gwh = random_array(Shape{H, 3 * H}, 68) * 0.3f;
  const Array gbi = random_array(Shape{3 * H}, 69), gbh = random_array(Shape{3 * H}, 70);
  auto g = [&](const Array& x) { return gru_layer(x, per_gate(gwi, 3), per_gate(gbi, 3), std::vector<Array>{gwh}, per_gate(gbh, 3), h0).first; };
  const Array gru_batched = vmap(g, {.in_axes = {0}})(xs);
  for (std::int64_t e = 0; e < 3; ++e)
    CHECK(reshape(slice_axis(gru_batched, 0, e, e + 1), {T, N, H}).bitwise_equal(g(reshape(slice_axis(xs, 0, e, e + 1), {T, N, I}))));
  // A batch of no examples: empty results of one example's shapes and dtype (bf16 arguments, or
  // the dtype option with float32 carries).
  auto bf = [](const Array& a) { return astype(a, DType::bf16); };
  auto f16 = [&](const Array& x) { return std::get<0>(lstm_layer(x, bf(wi), bf(b), bf(wh), bf(c0), bf(h0))); };
  const Array none16 = vmap(f16, {.in_axes = {0}})(Array::zeros(Shape{0, T, N, I}, DType::bf16));
  CHECK(none16.shape() == Shape{0, T, N, H});
  CHECK(none16.dtype() == DType::bf16);
  auto g16 = [&](const Array& x) { return gru_layer(x, bf(gwi), bf(gbi), bf(gwh), bf(gbh), h0, {.dtype = DType::bf16}).first; };
  const Array none_g = vmap(g16, {.in_axes = {0}})(Array::zeros(Shape{0, T, N, I}));
  CHECK(none_g.shape() == Shape{0, T, N, H});
  CHECK(none_g.dtype() == DType::f32);  // float32 carries promote
  // Second derivatives: d/dwh of sum(dL/dwh) through the op (its rule differentiates the layer
  // written with ops) against the same through the step-by-step composition.
  const Array x = reshape(slice_axis(xs, 0, 0, 1), {T, N, I});
  auto loss_op = [&](const Array& w) {
    auto [ys, c, h] = lstm_layer(x, per_gate(wi, 4), per_gate(b, 4), per_gate(w, 4), c0, h0, {.recompute_segment = 16});
    return sum(square(ys)) * 0.5f + sum(c);
  };
  auto loss_steps = [&](const Array& w) {
    Array cc = c0, hh = h0, total = Array::scalar(0.0f);
    for (std::int64_t t = 0; t < T; ++t) {
      auto [cn, hn] = lstm_cell(matmul(reshape(slice_axis(x, 0, t, t + 1), {N, I}), wi) + b, matmul(hh, w), cc);
      cc = cn;
      hh = hn;
      total = total + sum(square(hn)) * 0.5f;
    }
    return total + sum(cc);
  };
  const Array d2_op = grad([&](const Array& w) { return sum(grad(loss_op)(w)); })(wh);
  const Array d2_steps = grad([&](const Array& w) { return sum(grad(loss_steps)(w)); })(wh);
  CHECK(max_diff(d2_op, d2_steps) < 1e-4f);
  CHECK(max_diff(d2_op, Array::zeros(d2_op.shape())) > 1e-3f);  // not trivially zero
}

namespace {

// An LSTM's (c, h) at each row's length, picked by masks as the steps go (the initial carry for 0).
struct PickedAtLength {
  const Array& lengths;
  Array c, h;
  void after_step(std::int64_t t, const Array& c_next, const Array& h_next) {
    const std::int64_t N = lengths.dim(0);
    std::vector<float> last(static_cast<std::size_t>(N));
    for (std::int64_t n = 0; n < N; ++n) last[static_cast<std::size_t>(n)] = lengths.data_i32()[n] == t + 1 ? 1.0f : 0.0f;
    const Array m = Array::from(Shape{N, 1}, last);
    c = where(m, c_next, c);
    h = where(m, h_next, h);
  }
};

}  // namespace

TEST_CASE("lstm_layer and gru_layer with seq_lengths: every step runs, each row's final carry at its length") {
  // As Flax's nn.RNN: the recurrence is not masked (ys are those without lengths), and row n's final
  // carry is its state after lengths[n] steps (the initial carry for 0); the final carry's cotangent
  // enters there. Lengths 0, 1, a chunk's end (16), mid-chunk and all 37 steps; hidden 134 (blocks
  // of 128 and 6) and 160 (rows computed in place); a batch of 5, and of 32 (two row pieces).
  for (const auto& dims : {std::pair<std::int64_t, std::int64_t>{134, 5}, {160, 5}, {134, 32}, {160, 32}}) {
    const std::int64_t H = dims.first, N = dims.second;  // not a structured binding: lambdas capture these
    CAPTURE(H);
    CAPTURE(N);
    const std::int64_t T = 37, I = 4;
    const Array lengths = lengths_repeating(N, {37, 0, 16, 1, 23});
    const Array x = random_array(Shape{T, N, I}, 81);
    const Array wi = random_array(Shape{I, 4 * H}, 82) * 0.5f, wh = random_array(Shape{H, 4 * H}, 83) * 0.3f;
    const Array b = random_array(Shape{4 * H}, 84), c0 = random_array(Shape{N, H}, 85), h0 = random_array(Shape{N, H}, 86);
    const Array wc = random_array(Shape{N, H}, 87), whl = random_array(Shape{N, H}, 88);
    auto [ys, c, h] = lstm_layer(x, wi, b, wh, c0, h0, {.seq_lengths = lengths});
    auto [ys_all, c_all, h_all] = lstm_layer(x, wi, b, wh, c0, h0);
    CHECK(ys.bitwise_equal(ys_all));
    // Each row's state after its length, from the step-by-step composition.
    Array cc = c0, hh = h0;
    std::vector<Array> c_steps{c0}, h_steps{h0};
    for (std::int64_t t = 0; t < T; ++t) {
      auto [cn, hn] = composed_lstm(matmul(reshape(slice_axis(x, 0, t, t + 1), {N, I}), wi) + b, matmul(hh, wh), cc);
      cc = cn;
      hh = hn;
      c_steps.push_back(cn);
      h_steps.push_back(hn);
    }
    for (std::int64_t n = 0; n < N; ++n) {
      const std::int32_t len = lengths.data_i32()[n];
      CAPTURE(len);
      CHECK(max_diff(slice_axis(c, 0, n, n + 1), slice_axis(c_steps[len], 0, n, n + 1)) < 1e-5f);
      CHECK(max_diff(slice_axis(h, 0, n, n + 1), slice_axis(h_steps[len], 0, n, n + 1)) < 1e-5f);
    }
    // Gradients: recompute segments bitwise the kept activations'; all lengths = T bitwise no lengths.
    auto loss = [&](std::int64_t segment, const std::optional<Array>& lens) {
      return [&, segment, lens](const Array& x, const Array& wi, const Array& b, const Array& wh, const Array& c0, const Array& h0) {
        auto [ys, c, h] = lstm_layer(x, wi, b, wh, c0, h0, {.recompute_segment = segment, .seq_lengths = lens});
        return sum(square(ys)) * 0.5f + sum(c * wc) + sum(h * whl);
      };
    };
    auto grads = [&](std::int64_t segment, const std::optional<Array>& lens) {
      auto r = value_and_grad<0, 1, 2, 3, 4, 5>(loss(segment, lens))(x, wi, b, wh, c0, h0);
      return std::vector<Array>{std::get<0>(r), std::get<1>(r), std::get<2>(r), std::get<3>(r),
                                std::get<4>(r), std::get<5>(r), std::get<6>(r)};
    };
    auto same = [](const std::vector<Array>& a, const std::vector<Array>& b) {
      for (std::size_t k = 0; k < a.size(); ++k) {
        CAPTURE(k);
        CHECK(a[k].bitwise_equal(b[k]));
      }
    };
    const std::vector<Array> kept = grads(0, lengths);
    for (std::int64_t segment : {16, 20, 1000}) {
      CAPTURE(segment);
      same(grads(segment, lengths), kept);
    }
    same(grads(0, Array::full_i32(Shape{N}, static_cast<std::int32_t>(T))), grads(0, std::nullopt));
    // Against the step-by-step composition with each row's carry picked by masks (every input).
    auto composed_loss = [&](const Array& x, const Array& wi, const Array& b, const Array& wh, const Array& c0, const Array& h0) {
      Array cc = c0, hh = h0, total = Array::scalar(0.0f);
      PickedAtLength picked{lengths, c0, h0};
      for (std::int64_t t = 0; t < T; ++t) {
        std::tie(cc, hh) = composed_lstm(matmul(reshape(slice_axis(x, 0, t, t + 1), {N, I}), wi) + b, matmul(hh, wh), cc);
        picked.after_step(t, cc, hh);
        total = total + sum(square(hh)) * 0.5f;
      }
      return total + sum(picked.c * wc) + sum(picked.h * whl);
    };
    auto composed = value_and_grad<0, 1, 2, 3, 4, 5>(composed_loss)(x, wi, b, wh, c0, h0);
    const std::vector<Array> want{std::get<0>(composed), std::get<1>(composed), std::get<2>(composed), std::get<3>(composed),
                                  std::get<4>(composed), std::get<5>(composed), std::get<6>(composed)};
    for (std::size_t k = 0; k < want.size(); ++k) {
      CAPTURE(k);
      CHECK(max_diff(kept[k], want[k]) <= 1e-4f * std::max(1.0f, linum::testing::max_abs(want[k])));
    }
    // The GRU: the same rule for its one carry.
    const Array gwi = random_array(Shape{I, 3 * H}, 89) * 0.5f, gwh = random_array(Shape{H, 3 * H}, 90) * 0.3f;
    const Array gbi = random_array(Shape{3 * H}, 91), gbh = random_array(Shape{3 * H}, 92);
    auto [gys, gh] = gru_layer(x, gwi, gbi, gwh, gbh, h0, {.seq_lengths = lengths});
    auto [gys_all, gh_all] = gru_layer(x, gwi, gbi, gwh, gbh, h0);
    CHECK(gys.bitwise_equal(gys_all));
    for (std::int64_t n = 0; n < N; ++n) {
      const std::int32_t len = lengths.data_i32()[n];
      const Array want = len == 0 ? slice_axis(h0, 0, n, n + 1) : reshape(slice_axis(slice_axis(gys_all, 0, len - 1, len), 1, n, n + 1), {1, H});
      CHECK(slice_axis(gh, 0, n, n + 1).bitwise_equal(want));
    }
    auto gru_grads = [&](bool recompute, const std::optional<Array>& lens) {
      auto r = value_and_grad<0, 1, 2, 3, 4, 5>([&](const Array& x, const Array& wi, const Array& bi, const Array& wh, const Array& bh,
                                                    const Array& h0) {
        auto [ys, h] = gru_layer(x, wi, bi, wh, bh, h0, {.recompute = recompute, .seq_lengths = lens});
        return sum(square(ys)) * 0.5f + sum(h * whl);
      })(x, gwi, gbi, gwh, gbh, h0);
      return std::vector<Array>{std::get<0>(r), std::get<1>(r), std::get<2>(r), std::get<3>(r),
                                std::get<4>(r), std::get<5>(r), std::get<6>(r)};
    };
    same(gru_grads(true, lengths), gru_grads(false, lengths));
    same(gru_grads(false, Array::full_i32(Shape{N}, static_cast<std::int32_t>(T))), gru_grads(false, std::nullopt));
  }
  // Gradients equal finite differences (every input; lengths 5, 0 and 2 of 5 steps).
  const std::int64_t T = 5, N = 3, I = 2, H = 3;
  const Array lengths = Array::from_i32(Shape{N}, {5, 0, 2});
  const Array x = random_array(Shape{T, N, I}, 93);
  const Array wi = random_array(Shape{I, 4 * H}, 94) * 0.5f, wh = random_array(Shape{H, 4 * H}, 95) * 0.3f;
  const Array b = random_array(Shape{4 * H}, 96), c0 = random_array(Shape{N, H}, 97), h0 = random_array(Shape{N, H}, 98);
  CHECK(linum::testing::check_gradients(
      "lstm_layer with seq_lengths",
      [&](const std::vector<Array>& in) {
        auto [ys, c, h] = lstm_layer(in[0], in[1], in[2], in[3], in[4], in[5], {.seq_lengths = lengths});
        return sum(ys) * 0.5f + c * 2.0f + h * 3.0f;
      },
      {x, wi, b, wh, c0, h0}));
  const Array gwi = random_array(Shape{I, 3 * H}, 99) * 0.5f, gwh = random_array(Shape{H, 3 * H}, 100) * 0.3f;
  const Array gb = random_array(Shape{3 * H}, 101);
  CHECK(linum::testing::check_gradients(
      "gru_layer with seq_lengths",
      [&](const std::vector<Array>& in) {
        auto [ys, h] = gru_layer(in[0], in[1], in[2], in[3], in[4], in[5], {.seq_lengths = lengths});
        return sum(ys) * 0.5f + h * 3.0f;
      },
      {x, gwi, gb, gwh, gb * 0.5f, h0}));
  // Second derivatives (create-graph mode differentiates the op written with ops, lengths included)
  // against the same through the step-by-step composition with the carry picked by masks.
  auto loss_op = [&](const Array& w) {
    auto [ys, c, h] = lstm_layer(x, wi, b, w, c0, h0, {.seq_lengths = lengths});
    return sum(square(ys)) * 0.5f + sum(c) + sum(square(h));
  };
  auto loss_steps = [&](const Array& w) {
    Array cc = c0, hh = h0, total = Array::scalar(0.0f);
    PickedAtLength picked{lengths, c0, h0};
    for (std::int64_t t = 0; t < T; ++t) {
      std::tie(cc, hh) = lstm_cell(matmul(reshape(slice_axis(x, 0, t, t + 1), {N, I}), wi) + b, matmul(hh, w), cc);
      picked.after_step(t, cc, hh);
      total = total + sum(square(hh)) * 0.5f;
    }
    return total + sum(picked.c) + sum(square(picked.h));
  };
  const Array d2_op = grad([&](const Array& w) { return sum(grad(loss_op)(w)); })(wh);
  const Array d2_steps = grad([&](const Array& w) { return sum(grad(loss_steps)(w)); })(wh);
  CHECK(max_diff(d2_op, d2_steps) < 1e-4f);
  // vmap with each example's own lengths: each example as the op alone computes it.
  const Array xs = random_array(Shape{2, T, N, I}, 102);
  const Array lens2 = Array::from_i32(Shape{2, N}, {5, 0, 2, 1, 3, 4});
  auto f = [&](const Array& x1, const Array& l1) {
    auto [ys, c, h] = lstm_layer(x1, wi, b, wh, c0, h0, {.seq_lengths = l1});
    return reshape(c, {1, N, H}) + reshape(h * 2.0f, {1, N, H}) + ys;
  };
  const Array batched = vmap(f, {.in_axes = {0, 0}})(xs, lens2);
  auto fg = [&](const Array& x1, const Array& l1) {
    auto [ys, h] = gru_layer(x1, gwi, gb, gwh, gb * 0.5f, h0, {.seq_lengths = l1});
    return reshape(h * 2.0f, {1, N, H}) + ys;
  };
  const Array gru_batched = vmap(fg, {.in_axes = {0, 0}})(xs, lens2);
  for (std::int64_t e = 0; e < 2; ++e) {
    const Array x1 = reshape(slice_axis(xs, 0, e, e + 1), {T, N, I}), l1 = reshape(slice_axis(lens2, 0, e, e + 1), {N});
    CHECK(reshape(slice_axis(batched, 0, e, e + 1), {T, N, H}).bitwise_equal(f(x1, l1)));
    CHECK(reshape(slice_axis(gru_batched, 0, e, e + 1), {T, N, H}).bitwise_equal(fg(x1, l1)));
  }
  // Bad lengths: typed errors naming the op, what is wrong and what is allowed.
  CHECK_THROWS_WITH_AS(lstm_layer(x, wi, b, wh, c0, h0, {.seq_lengths = Array::zeros(Shape{N})}),
                       doctest::Contains("lstm_layer: seq_lengths must be int32 [batch]"), ShapeError);
  CHECK_THROWS_WITH_AS(lstm_layer(x, wi, b, wh, c0, h0, {.seq_lengths = Array::full_i32(Shape{N + 1}, 1)}),
                       doctest::Contains("batch = 3"), ShapeError);
  CHECK_THROWS_WITH_AS(lstm_layer(x, wi, b, wh, c0, h0, {.seq_lengths = Array::from_i32(Shape{N}, {1, 6, 2})}),
                       doctest::Contains("seq_lengths[1] = 6 is not a number of steps in [0, 5]"), ValueError);
  CHECK_THROWS_WITH_AS(gru_layer(x, gwi, gb, gwh, gb, h0, {.seq_lengths = Array::from_i32(Shape{N}, {1, -1, 2})}),
                       doctest::Contains("gru_layer: seq_lengths[1] = -1"), ValueError);
}

TEST_CASE("lstm_layer and gru_layer with bf16 weights: every product on bf16-rounded operands, summed in float32") {
  // As oneDNN's and PyTorch's bf16 layers: the states stay float32, but each product rounds its
  // operands (here h before the recurrent product) to bf16. The step-by-step composition that
  // rounds the same operands agrees to float32 summation order; one that does not round h differs.
  // A batch of 3, and of 32 (the rows in two pieces, each piece's steps on one thread).
  for (std::int64_t N : {3, 32}) {
    CAPTURE(N);
    const std::int64_t T = 20, I = 5, H = 134;
    auto bf = [](const Array& a) { return astype(a, DType::bf16); };
    auto rounded = [](const Array& a) { return astype(astype(a, DType::bf16), DType::f32); };
    const Array x = random_array(Shape{T, N, I}, 121), c0 = random_array(Shape{N, H}, 125), h0 = random_array(Shape{N, H}, 126);
    const Array wi = random_array(Shape{I, 4 * H}, 122) * 0.5f, wh = random_array(Shape{H, 4 * H}, 123) * 0.3f;
    const Array b = random_array(Shape{4 * H}, 124);
    auto [ys, c, h] = lstm_layer(bf(x), bf(wi), bf(b), bf(wh), c0, h0);
    CHECK(ys.dtype() == DType::f32);  // float32 carries: the results promote
    float worst_rounded = 0, worst_unrounded = 0, mean_rounded = 0, mean_unrounded = 0;
    auto mean_abs_diff = [](const Array& a, const Array& b) { return mean(abs(a - b)).item(); };
    Array cr = c0, hr = h0, cu = c0, hu = h0;
    for (std::int64_t t = 0; t < T; ++t) {
      const Array xg = matmul(rounded(reshape(slice_axis(x, 0, t, t + 1), {N, I})), rounded(wi)) + rounded(b);
      auto [cn, hn] = composed_lstm(xg, matmul(rounded(hr), rounded(wh)), cr);
      auto [cn2, hn2] = composed_lstm(xg, matmul(hu, rounded(wh)), cu);
      cr = cn, hr = hn, cu = cn2, hu = hn2;
      const Array yt = reshape(slice_axis(ys, 0, t, t + 1), {N, H});
      worst_rounded = std::max(worst_rounded, max_diff(yt, hn));
      worst_unrounded = std::max(worst_unrounded, max_diff(yt, hn2));
      mean_rounded += mean_abs_diff(yt, hn) / static_cast<float>(T);
      mean_unrounded += mean_abs_diff(yt, hn2) / static_cast<float>(T);
    }
    MESSAGE("bf16 lstm_layer vs composition: ", worst_rounded, " rounding h, ", worst_unrounded, " not");
    // The two sum in different orders, so an h a float32 ulp apart can round to bf16 values an ulp of
    // bf16 apart, after which the rows differ at bf16's precision: the more rows and steps, the likelier,
    // and where depends on the kernels' summation order, which differs between engines and CPUs (at 32
    // rows these operands flip one on the Eigen engine; the GRU's below flip one at 3 rows on AVX2's
    // oneDNN kernels, not on AVX-512's). So the largest difference is held to a flip's reach, and the
    // mean difference, which a flip in one row barely moves, to far below the unrounded composition's.
    CHECK(worst_rounded < 1e-2f);
    CHECK(mean_unrounded > 20 * mean_rounded);
    MESSAGE("mean differences: ", mean_rounded, " rounding h, ", mean_unrounded, " not");
    // With seq_lengths: each row's carry is the rounded composition's state after its length.
    const Array lengths = lengths_repeating(N, {20, 0, 7});
    auto [ys_l, c_l, h_l] = lstm_layer(bf(x), bf(wi), bf(b), bf(wh), c0, h0, {.seq_lengths = lengths});
    CHECK(ys_l.bitwise_equal(ys));
    {
      Array cc = c0, hh = h0;
      std::vector<Array> cs{c0}, hs{h0};
      for (std::int64_t t = 0; t < T; ++t) {
        const Array xg = matmul(rounded(reshape(slice_axis(x, 0, t, t + 1), {N, I})), rounded(wi)) + rounded(b);
        auto [cn, hn] = composed_lstm(xg, matmul(rounded(hh), rounded(wh)), cc);
        cc = cn, hh = hn;
        cs.push_back(cn);
        hs.push_back(hn);
      }
      for (std::int64_t n = 0; n < N; ++n) {
        const std::int32_t len = lengths.data_i32()[n];
        // At 32 rows within a flipped rounding's reach (above), still far closer than another length's state.
        const float tolerance = N == 3 ? 2e-5f : 1e-2f;
        CHECK(max_diff(slice_axis(c_l, 0, n, n + 1), slice_axis(cs[static_cast<std::size_t>(len)], 0, n, n + 1)) < tolerance);
        CHECK(max_diff(slice_axis(h_l, 0, n, n + 1), slice_axis(hs[static_cast<std::size_t>(len)], 0, n, n + 1)) < tolerance);
      }
    }
    // Gradients: recompute segments bitwise the kept activations'; within bf16 rounding of float32's.
    auto grads = [&](const Array& wi_, const Array& b_, const Array& wh_, std::int64_t segment) {
      auto r = value_and_grad<0, 1, 2, 3>([&](const Array& xx, const Array& i, const Array& bb, const Array& hh) {
        auto [y, cl, hl] = lstm_layer(xx, i, bb, hh, c0, h0, {.recompute_segment = segment});
        return sum(square(astype(y, DType::f32))) * 0.5f + sum(astype(cl, DType::f32));
      })(x, wi_, b_, wh_);
      return std::vector<Array>{astype(std::get<1>(r), DType::f32), astype(std::get<2>(r), DType::f32),
                                astype(std::get<3>(r), DType::f32), astype(std::get<4>(r), DType::f32)};
    };
    const std::vector<Array> g16 = grads(bf(wi), bf(b), bf(wh), 0), g16r = grads(bf(wi), bf(b), bf(wh), 16);
    const std::vector<Array> g32 = grads(rounded(wi), rounded(b), rounded(wh), 0);
    for (std::size_t k = 0; k < g16.size(); ++k) {
      CAPTURE(k);
      CHECK(g16[k].bitwise_equal(g16r[k]));
      CHECK(max_diff(g16[k], g32[k]) <= 0.02f * std::max(1.0f, linum::testing::max_abs(g32[k])));
    }
    // The GRU: the same rounding of h before its recurrent product.
    const Array gwi = random_array(Shape{I, 3 * H}, 127) * 0.5f, gwh = random_array(Shape{H, 3 * H}, 128) * 0.3f;
    const Array gbi = random_array(Shape{3 * H}, 129), gbh = random_array(Shape{3 * H}, 130);
    auto [gys, gh] = gru_layer(bf(x), bf(gwi), bf(gbi), bf(gwh), bf(gbh), h0);
    float worst = 0, mean_rounded_h = 0, mean_unrounded_h = 0;
    auto gate = [&](const Array& v, int k) { return slice_axis(v, -1, k * H, (k + 1) * H); };
    auto gru_step = [&](const Array& xg, const Array& hg, const Array& h) {
      const Array r = sigmoid(gate(xg, 0) + gate(hg, 0)), z = sigmoid(gate(xg, 1) + gate(hg, 1));
      const Array n = tanh(gate(xg, 2) + r * gate(hg, 2));
      return (1.0f - z) * n + z * h;
    };
    Array gr = h0, gu = h0;
    for (std::int64_t t = 0; t < T; ++t) {
      const Array xg = matmul(rounded(reshape(slice_axis(x, 0, t, t + 1), {N, I})), rounded(gwi)) + rounded(gbi);
      gr = gru_step(xg, matmul(rounded(gr), rounded(gwh)) + rounded(gbh), gr);
      gu = gru_step(xg, matmul(gu, rounded(gwh)) + rounded(gbh), gu);
      const Array yt = reshape(slice_axis(gys, 0, t, t + 1), {N, H});
      worst = std::max(worst, max_diff(yt, gr));
      mean_rounded_h += mean_abs_diff(yt, gr) / static_cast<float>(T);
      mean_unrounded_h += mean_abs_diff(yt, gu) / static_cast<float>(T);
    }
    MESSAGE("bf16 gru_layer vs composition: worst ", worst, ", mean ", mean_rounded_h, " rounding h, ", mean_unrounded_h, " not");
    CHECK(worst < 1e-2f);  // a flipped rounding's reach (see the LSTM's above)
    CHECK(mean_unrounded_h > 20 * mean_rounded_h);
  }
}

TEST_CASE("lstm_layer and gru_layer with dtype = bf16: bitwise the layer on bf16 casts, gradients too, no cast copies kept") {
  // Flax's dtype=bf16 with float32 parameters: the op reads the float32 arrays and rounds what it
  // reads. Against the same layer on cast copies (differentiated through the casts): the same bits
  // forward and backward, with the weights joined or per gate, kept or recomputed activations, and
  // seq_lengths; second derivatives (create-graph mode) as the step-by-step composition's.
  const std::int64_t T = 19, N = 3, I = 5, H = 134;
  auto bf = [](const Array& a) { return astype(a, DType::bf16); };
  auto bfs = [&](const std::vector<Array>& v) {
    std::vector<Array> out;
    for (const Array& a : v) out.push_back(bf(a));
    return out;
  };
  const Array x = random_array(Shape{T, N, I}, 141), c0 = random_array(Shape{N, H}, 145), h0 = random_array(Shape{N, H}, 146);
  const Array lengths = Array::from_i32(Shape{N}, {19, 0, 7});
  const Array wi = random_array(Shape{I, 4 * H}, 142) * 0.5f, wh = random_array(Shape{H, 4 * H}, 143) * 0.3f;
  const Array b = random_array(Shape{4 * H}, 144);
  for (bool gates : {false, true})
    for (std::int64_t segment : {0, 16})
      for (bool lens : {false, true}) {
        CAPTURE(gates);
        CAPTURE(segment);
        CAPTURE(lens);
        auto parts = [&](const Array& w) { return gates ? per_gate(w, 4) : std::vector<Array>{w}; };
        const std::optional<Array> l = lens ? std::optional<Array>(lengths) : std::nullopt;
        auto loss = [&](bool cast) {
          return [&, cast](const Array& xx, const Array& i, const Array& bb, const Array& hh, const Array& c, const Array& h) {
            auto [y, cl, hl] =
                cast ? lstm_layer(bf(xx), bfs(parts(i)), bfs(parts(bb)), bfs(parts(hh)), c, h,
                                  {.recompute_segment = segment, .seq_lengths = l})
                     : lstm_layer(xx, parts(i), parts(bb), parts(hh), c, h,
                                  {.recompute_segment = segment, .seq_lengths = l, .dtype = DType::bf16});
            CHECK(y.dtype() == DType::f32);  // float32 carries: the results promote, as with casts
            return sum(square(y)) * 0.5f + sum(cl) + sum(hl * 0.25f);
          };
        };
        auto fused = value_and_grad<0, 1, 2, 3, 4, 5>(loss(false))(x, wi, b, wh, c0, h0);
        auto cast = value_and_grad<0, 1, 2, 3, 4, 5>(loss(true))(x, wi, b, wh, c0, h0);
        check_bitwise(fused, cast);
      }
  // The GRU likewise.
  const Array gwi = random_array(Shape{I, 3 * H}, 147) * 0.5f, gwh = random_array(Shape{H, 3 * H}, 148) * 0.3f;
  const Array gbi = random_array(Shape{3 * H}, 149), gbh = random_array(Shape{3 * H}, 150);
  for (bool gates : {false, true})
    for (bool recompute : {false, true})
      for (bool lens : {false, true}) {
        CAPTURE(gates);
        CAPTURE(recompute);
        CAPTURE(lens);
        auto parts = [&](const Array& w) { return gates ? per_gate(w, 3) : std::vector<Array>{w}; };
        const std::optional<Array> l = lens ? std::optional<Array>(lengths) : std::nullopt;
        auto loss = [&](bool cast) {
          return [&, cast](const Array& xx, const Array& i, const Array& bi, const Array& hh, const Array& bh, const Array& h) {
            auto [y, hl] = cast ? gru_layer(bf(xx), bfs(parts(i)), bfs(parts(bi)), bfs(parts(hh)), bfs(parts(bh)), h,
                                            {.recompute = recompute, .seq_lengths = l})
                                : gru_layer(xx, parts(i), parts(bi), parts(hh), parts(bh), h,
                                            {.recompute = recompute, .seq_lengths = l, .dtype = DType::bf16});
            return sum(square(y)) * 0.5f + sum(hl * 0.25f);
          };
        };
        auto fused = value_and_grad<0, 1, 2, 3, 4, 5>(loss(false))(x, gwi, gbi, gwh, gbh, h0);
        auto cast = value_and_grad<0, 1, 2, 3, 4, 5>(loss(true))(x, gwi, gbi, gwh, gbh, h0);
        check_bitwise(fused, cast);
      }
  // Second derivatives (the rule then differentiates the layer written with ops, casts included).
  const Array xs = slice_axis(x, 0, 0, 4);
  auto d2 = [&](bool cast) {
    return grad([&, cast](const Array& w) {
      return sum(grad([&, cast](const Array& ww) {
        auto [y, cl, hl] = cast ? lstm_layer(bf(xs), bf(wi), bf(b), bf(ww), c0, h0)
                                : lstm_layer(xs, wi, b, ww, c0, h0, {.dtype = DType::bf16});
        return sum(square(y)) * 0.5f + sum(cl);
      })(w));
    })(wh);
  };
  const Array d2_fused = d2(false), d2_cast = d2(true);
  auto d2_steps = grad([&](const Array& w) {
    return sum(grad([&](const Array& ww) {
      auto r = [](const Array& a) { return astype(astype(a, DType::bf16), DType::f32); };
      Array cc = c0, hh = h0, total = Array::scalar(0.0f);
      for (std::int64_t t = 0; t < xs.dim(0); ++t) {
        auto [cn, hn] = lstm_cell(matmul(r(reshape(slice_axis(xs, 0, t, t + 1), {N, I})), r(wi)) + r(b), matmul(r(hh), r(ww)), cc);
        cc = cn;
        hh = hn;
        total = total + sum(square(hn)) * 0.5f;
      }
      return total + sum(cc);
    })(w));
  })(wh);
  // (Through bf16 roundings of cotangents the second derivatives agree to bf16's precision: the
  // cast copies' graph rounds in other places than the step-by-step one, each ~0.5% off the other.)
  const float tol = 0.02f * linum::testing::max_abs(d2_steps);
  CHECK(max_diff(d2_fused, d2_steps) < tol);
  CHECK(max_diff(d2_cast, d2_steps) < tol);
  CHECK(max_diff(d2_fused, Array::zeros(d2_fused.shape())) > 1e-3f);  // not trivially zero
  // The activation memory: no float32 or bf16 copy of the weights or of x is kept. The layer on
  // casts keeps its widened copies (the weights' 4 bytes per element).
  auto peak_of = [&](bool cast) {
    const Array big_wh = random_array(Shape{512, 2048}, 151) * 0.05f, big_wi = random_array(Shape{I, 2048}, 152);
    const Array big_b = random_array(Shape{2048}, 153), hc = Array::zeros(Shape{N, 512});
    memory::PeakScope scope;
    Array g = grad([&](const Array& w) {
      auto [y, cl, hl] = cast ? lstm_layer(bf(x), bf(big_wi), bf(big_b), bf(w), hc, hc)
                              : lstm_layer(x, big_wi, big_b, w, hc, hc, {.dtype = DType::bf16});
      return sum(square(y));
    })(big_wh);
    return scope.peak_growth() - byte_count(g);
  };
  const std::int64_t fused_peak = peak_of(false), cast_peak = peak_of(true);
  MESSAGE("peak bytes, dtype = bf16: ", fused_peak, "; on casts: ", cast_peak);
  CHECK(fused_peak + 512 * 2048 * 4 <= cast_peak);
  // A dtype the layers do not compute in: an error naming the op.
  CHECK_THROWS_WITH_AS(lstm_layer(x, wi, b, wh, c0, h0, {.dtype = DType::i32}), doctest::Contains("lstm_layer: dtype"), ValueError);
  CHECK_THROWS_WITH_AS(gru_layer(x, gwi, gbi, gwh, gbh, h0, {.dtype = DType::i32}), doctest::Contains("gru_layer: dtype"), ValueError);
}

TEST_CASE("the dtype option with bf16 carries, with dtype = float32, and under vmap: as the layer on casts") {
  const std::int64_t T = 4, N = 3, I = 5, H = 7;
  auto bf = [](const Array& a) { return astype(a, DType::bf16); };
  auto f32 = [](const Array& a) { return astype(a, DType::f32); };
  const Array x = random_array(Shape{T, N, I}, 161), c0 = random_array(Shape{N, H}, 162), h0 = random_array(Shape{N, H}, 163);
  const Array wi = random_array(Shape{I, 4 * H}, 164) * 0.5f, wh = random_array(Shape{H, 4 * H}, 165) * 0.3f;
  const Array b = random_array(Shape{4 * H}, 166);
  const Array gwi = random_array(Shape{I, 3 * H}, 167) * 0.5f, gwh = random_array(Shape{H, 3 * H}, 168) * 0.3f;
  const Array gbi = random_array(Shape{3 * H}, 169), gbh = random_array(Shape{3 * H}, 170);
  // bf16 carries with dtype = bf16: everything bf16, results bf16; values and gradients bitwise the
  // layer on casts (the gradients of the float32 parameters through the casts).
  {
    auto loss = [&](bool cast) {
      return [&, cast](const Array& xx, const Array& i, const Array& bb, const Array& hh, const Array& c, const Array& h) {
        auto [y, cl, hl] = cast ? lstm_layer(bf(xx), bf(i), bf(bb), bf(hh), c, h)
                                : lstm_layer(xx, i, bb, hh, c, h, {.dtype = DType::bf16});
        CHECK(y.dtype() == DType::bf16);
        return sum(f32(square(y))) * 0.5f + sum(f32(cl)) + sum(f32(hl));
      };
    };
    check_bitwise(value_and_grad<0, 1, 2, 3, 4, 5>(loss(false))(x, wi, b, wh, bf(c0), bf(h0)),
                  value_and_grad<0, 1, 2, 3, 4, 5>(loss(true))(x, wi, b, wh, bf(c0), bf(h0)));
    auto gloss = [&](bool cast) {
      return [&, cast](const Array& xx, const Array& i, const Array& hh, const Array& h) {
        auto [y, hl] = cast ? gru_layer(bf(xx), bf(i), bf(gbi), bf(hh), bf(gbh), h)
                            : gru_layer(xx, i, gbi, hh, gbh, h, {.dtype = DType::bf16});
        CHECK(y.dtype() == DType::bf16);
        return sum(f32(square(y))) * 0.5f + sum(f32(hl));
      };
    };
    check_bitwise(value_and_grad<0, 1, 2, 3>(gloss(false))(x, gwi, gwh, bf(h0)),
                  value_and_grad<0, 1, 2, 3>(gloss(true))(x, gwi, gwh, bf(h0)));
  }
  // dtype = float32 with bf16 arguments: the layer on float32 casts (float32 results; the bf16
  // arguments' gradients rounded as the casts' backward rounds them).
  {
    auto loss = [&](bool cast) {
      return [&, cast](const Array& xx, const Array& i, const Array& hh) {
        auto [y, cl, hl] = cast ? lstm_layer(f32(xx), f32(i), b, f32(hh), c0, h0)
                                : lstm_layer(xx, i, b, hh, c0, h0, {.dtype = DType::f32});
        CHECK(y.dtype() == DType::f32);
        return sum(square(y)) * 0.5f + sum(cl);
      };
    };
    const auto fused = value_and_grad<0, 1, 2>(loss(false))(bf(x), bf(wi), bf(wh));
    check_bitwise(fused, value_and_grad<0, 1, 2>(loss(true))(bf(x), bf(wi), bf(wh)));
    CHECK(std::get<1>(fused).dtype() == DType::bf16);
    auto gloss = [&](bool cast) {
      return [&, cast](const Array& xx, const Array& i, const Array& hh) {
        auto [y, hl] = cast ? gru_layer(f32(xx), f32(i), gbi, f32(hh), gbh, h0) : gru_layer(xx, i, gbi, hh, gbh, h0, {.dtype = DType::f32});
        CHECK(y.dtype() == DType::f32);
        return sum(square(y)) * 0.5f + sum(hl);
      };
    };
    check_bitwise(value_and_grad<0, 1, 2>(gloss(false))(bf(x), bf(gwi), bf(gwh)),
                  value_and_grad<0, 1, 2>(gloss(true))(bf(x), bf(gwi), bf(gwh)));
  }
  // Under vmap (a batch of three sequences, the weights shared), float32 and bf16 carries: each
  // example as the op alone, in the promoted dtype.
  const Array xs = random_array(Shape{3, T, N, I}, 171);
  for (const DType carries : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(carries));
    const Array c = astype(c0, carries), h = astype(h0, carries);
    auto f = [&](const Array& xx) {
      auto [y, cl, hl] = lstm_layer(xx, wi, b, wh, c, h, {.dtype = DType::bf16});
      return y + reshape(cl * 2.0f, {1, N, H});
    };
    auto g = [&](const Array& xx) { return gru_layer(xx, gwi, gbi, gwh, gbh, h, {.dtype = DType::bf16}).first; };
    const Array lb = vmap(f, {.in_axes = {0}})(xs), gb = vmap(g, {.in_axes = {0}})(xs);
    CHECK(lb.dtype() == carries);
    CHECK(gb.dtype() == carries);
    for (std::int64_t e = 0; e < 3; ++e) {
      const Array xe = reshape(slice_axis(xs, 0, e, e + 1), {T, N, I});
      CHECK(reshape(slice_axis(lb, 0, e, e + 1), {T, N, H}).bitwise_equal(f(xe)));
      CHECK(reshape(slice_axis(gb, 0, e, e + 1), {T, N, H}).bitwise_equal(g(xe)));
    }
  }
}

TEST_CASE("nn::RNN with seq_lengths is Flax's: padded steps run unmasked, reverse flips within each length") {
  const Array xs = random_array(Shape{4, 9, 3}, 111);  // [batch, time, in]
  const Array lengths = Array::from_i32(Shape{4}, {9, 0, 4, 1});
  for (bool fused : {true, false}) {
    CAPTURE(fused);
    nn::RNN<nn::LSTMCell> fwd{.cell = {.features = 5}};
    if (!fused) fwd.cell = unfused(fwd.cell);
    const Tree vars = init(fwd, rng::key(12), xs);
    const nn::RNNOptions with_lengths{.return_carry = true, .seq_lengths = lengths};
    auto [carry, ys] = apply(fwd, vars, xs, with_lengths);
    auto [carry_all, ys_all] = apply(fwd, vars, xs, nn::RNNOptions{.return_carry = true});
    CHECK(max_diff(ys, ys_all) < 1e-6f);  // every step of every row, padded ones too
    // Row b's final carry: the h output at its last step (the initial carry's zeros for length 0).
    for (std::int64_t b = 0; b < 4; ++b) {
      const std::int32_t len = lengths.data_i32()[b];
      const Array want = len == 0 ? Array::zeros(Shape{1, 5}) : reshape(slice_axis(slice_axis(ys_all, 0, b, b + 1), 1, len - 1, len), {1, 5});
      CHECK(max_diff(slice_axis(carry.h, 0, b, b + 1), want) < 1e-6f);
    }
    // reverse: each row's valid steps reversed in place (padding after them, also reversed), as
    // Flax's flip_sequences; keep_order gives the outputs back in the inputs' order.
    auto back = fwd;
    back.reverse = true;
    back.keep_order = true;
    auto [rcarry, rys] = apply(back, vars, xs, with_lengths);
    std::vector<Array> rows;
    for (std::int64_t b = 0; b < 4; ++b) {
      const std::int32_t len = lengths.data_i32()[b];
      std::vector<Array> steps;
      for (std::int64_t t = 0; t < 9; ++t) {
        const std::int64_t src = t < len ? len - 1 - t : 9 - 1 - t + len;
        steps.push_back(slice_axis(slice_axis(xs, 0, b, b + 1), 1, src, src + 1));
      }
      rows.push_back(concatenate(steps, 1));
    }
    const Array flipped = concatenate(rows, 0);
    auto [fcarry, fys] = apply(fwd, vars, flipped, with_lengths);
    CHECK(max_diff(rcarry.c, fcarry.c) < 1e-6f);
    CHECK(max_diff(rcarry.h, fcarry.h) < 1e-6f);
    for (std::int64_t b = 0; b < 4; ++b) {
      const std::int32_t len = lengths.data_i32()[b];
      for (std::int64_t t = 0; t < 9; ++t) {
        const std::int64_t src = t < len ? len - 1 - t : 9 - 1 - t + len;
        CHECK(max_diff(slice_axis(slice_axis(rys, 0, b, b + 1), 1, t, t + 1), slice_axis(slice_axis(fys, 0, b, b + 1), 1, src, src + 1)) <
              1e-6f);
      }
    }
  }
  // Bad lengths: errors naming nn::RNN.
  const nn::RNN<nn::GRUCell> gru{.cell = {.features = 2}};
  const Tree gvars = init(gru, rng::key(13), xs);
  CHECK_THROWS_WITH_AS(apply(gru, gvars, xs, nn::RNNOptions{.seq_lengths = Array::from_i32(Shape{4}, {1, 2, 10, 0})}),
                       doctest::Contains("nn::RNN: seq_lengths[2] = 10"), ValueError);
  CHECK_THROWS_WITH_AS(apply(gru, gvars, xs, nn::RNNOptions{.seq_lengths = Array::zeros(Shape{4})}),
                       doctest::Contains("int32 [batch]"), ShapeError);
}

TEST_CASE("nn::RNN over many steps: the layer op's remat and schedules keep less, with the plain gradients bitwise") {
  const Array xs = random_array(Shape{4, 50, 6}, 41);
  const nn::RNN<nn::LSTMCell> plain{.cell = {.features = 70}};
  const Tree vars = init(plain, rng::key(7), xs);
  auto step = [&](const nn::RNN<nn::LSTMCell>& model, std::int64_t& peak) {
    memory::PeakScope scope;
    Tree g = grad([&](const Tree& p) { return mean(square(apply(model, Tree{{"params", p}}, xs))); })(vars.at("params"));
    peak = scope.peak_growth() - byte_count(g);
    return g;
  };
  std::int64_t plain_peak = 0;
  const Tree g_plain = step(plain, plain_peak);
  // Against the cell path (a gate function nn::RNN does not recognize): the same within rounding.
  auto slow = plain;
  slow.cell = unfused(plain.cell);
  std::int64_t slow_peak = 0;
  const Tree g_slow = step(slow, slow_peak);
  const auto a = flatten(g_plain), b = flatten(g_slow);
  for (std::size_t k = 0; k < a.size(); ++k) CHECK(max_diff(a[k].second, b[k].second) < 1e-5f);
  MESSAGE("peak bytes, 50 steps: layer op ", plain_peak, ", cell path ", slow_peak);
  for (int variant = 0; variant < 4; ++variant) {
    CAPTURE(variant);
    auto model = plain;
    if (variant == 0) model.remat = true;
    if (variant == 1) model.schedule = lift::ScanSchedule::sqrt_segments();
    if (variant == 2) model.schedule = lift::ScanSchedule::binomial(2);
    if (variant == 3) model.reverse = true;
    std::int64_t peak = 0;
    const Tree g = step(model, peak);
    if (variant < 3) {
      CHECK(bitwise_equal(g, g_plain));
      CHECK(peak < plain_peak);
      MESSAGE("peak bytes: ", peak);
    }
  }
}

namespace {

// One GRU step with ops, in Flax's GRUCell's form (gates [r | z | n]).
Array composed_gru_step(const Array& x_t, const Array& h, const Array& wi, const Array& bi, const Array& wh, const Array& bh) {
  const std::int64_t H = h.dim(1);
  const Array xg = matmul(x_t, wi) + bi, hg = matmul(h, wh) + bh;
  auto gate = [&](const Array& a, int k) { return slice_axis(a, -1, k * H, (k + 1) * H); };
  const Array r = sigmoid(gate(xg, 0) + gate(hg, 0)), z = sigmoid(gate(xg, 1) + gate(hg, 1));
  const Array n = tanh(gate(xg, 2) + r * gate(hg, 2));
  return (1.0f - z) * n + z * h;
}

}  // namespace

TEST_CASE("gru_layer: the GRU over time; gradients equal finite differences; recomputation bitwise") {
  // hidden 134: unit blocks of 128 and 6; 37 steps: chunks of 16, 16 and 5; a batch of 0; hidden
  // 160: blocks of 128 and 32 whose rows sit at 64-byte boundaries (the cell computes them in place).
  for (const auto& dims :
       {std::array<std::int64_t, 4>{37, 3, 5, 134}, {5, 2, 3, 4}, {1, 1, 1, 1}, {20, 0, 3, 5}, {37, 4, 8, 160}}) {
    const std::int64_t T = dims[0], N = dims[1], I = dims[2], H = dims[3];
    CAPTURE(T);
    CAPTURE(H);
    const Array x = random_array(Shape{T, N, I}, 51);
    const Array wi = random_array(Shape{I, 3 * H}, 52) * 0.5f, wh = random_array(Shape{H, 3 * H}, 53) * 0.3f;
    const Array bi = random_array(Shape{3 * H}, 54), bh = random_array(Shape{3 * H}, 55), h0 = random_array(Shape{N, H}, 56);
    auto [ys, h] = gru_layer(x, wi, bi, wh, bh, h0);
    REQUIRE(ys.shape() == Shape{T, N, H});
    REQUIRE(h.shape() == Shape{N, H});
    Array hh = h0;
    float worst = 0;
    for (std::int64_t t = 0; t < T; ++t) {
      hh = composed_gru_step(reshape(slice_axis(x, 0, t, t + 1), {N, I}), hh, wi, bi, wh, bh);
      worst = std::max(worst, max_diff(reshape(slice_axis(ys, 0, t, t + 1), {N, H}), hh));
    }
    CHECK(worst < 1e-5f);
    CHECK(max_diff(h, hh) < 1e-5f);
    if (N == 0) continue;
    auto loss = [](bool recompute) {
      return [recompute](const Array& x, const Array& wi, const Array& bi, const Array& wh, const Array& bh, const Array& h0) {
        auto [ys, h] = gru_layer(x, wi, bi, wh, bh, h0, {.recompute = recompute});
        return sum(square(ys)) * 0.5f + sum(h * 0.25f);
      };
    };
    auto plain = value_and_grad<0, 1, 2, 3, 4, 5>(loss(false))(x, wi, bi, wh, bh, h0);
    auto again = value_and_grad<0, 1, 2, 3, 4, 5>(loss(true))(x, wi, bi, wh, bh, h0);
    check_bitwise(again, plain);
    // Against the gradients of the composed steps (relative to each gradient's size), with the
    // loss on every output, and on the last state alone (no cotangent reaches ys).
    for (bool last_only : {false, true}) {
      CAPTURE(last_only);
      auto composed_loss = [last_only](const Array& x, const Array& wi, const Array& bi, const Array& wh, const Array& bh,
                                       const Array& h0) {
        Array h = h0, total = Array::scalar(0.0f);
        for (std::int64_t t = 0; t < x.dim(0); ++t) {
          h = composed_gru_step(reshape(slice_axis(x, 0, t, t + 1), {x.dim(1), x.dim(2)}), h, wi, bi, wh, bh);
          if (!last_only) total = total + sum(square(h)) * 0.5f;
        }
        return total + sum(h * 0.25f);
      };
      auto fused_loss = [last_only](bool recompute) {
        return [last_only, recompute](const Array& x, const Array& wi, const Array& bi, const Array& wh, const Array& bh,
                                      const Array& h0) {
          auto [ys, h] = gru_layer(x, wi, bi, wh, bh, h0, {.recompute = recompute});
          return (last_only ? Array::scalar(0.0f) : sum(square(ys)) * 0.5f) + sum(h * 0.25f);
        };
      };
      auto want = value_and_grad<0, 1, 2, 3, 4, 5>(composed_loss)(x, wi, bi, wh, bh, h0);
      auto got = value_and_grad<0, 1, 2, 3, 4, 5>(fused_loss(false))(x, wi, bi, wh, bh, h0);
      auto got_recomputed = value_and_grad<0, 1, 2, 3, 4, 5>(fused_loss(true))(x, wi, bi, wh, bh, h0);
      auto close = [](const Array& a, const Array& b) { return max_diff(a, b) <= 1e-5f * (1.0f + linum::testing::max_abs(b)); };
      CHECK(close(std::get<0>(got), std::get<0>(want)));
      CHECK(close(std::get<1>(got), std::get<1>(want)));
      CHECK(close(std::get<2>(got), std::get<2>(want)));
      CHECK(close(std::get<3>(got), std::get<3>(want)));
      CHECK(close(std::get<4>(got), std::get<4>(want)));
      CHECK(close(std::get<5>(got), std::get<5>(want)));
      CHECK(close(std::get<6>(got), std::get<6>(want)));
      CHECK(std::get<1>(got_recomputed).bitwise_equal(std::get<1>(got)));
      CHECK(std::get<3>(got_recomputed).bitwise_equal(std::get<3>(got)));
      CHECK(std::get<6>(got_recomputed).bitwise_equal(std::get<6>(got)));
    }
    if (T <= 5) {
      for (bool recompute : {false, true}) {
        CAPTURE(recompute);
        const auto f = [recompute](const std::vector<Array>& in) {
          auto [ys, h] = gru_layer(in[0], in[1], in[2], in[3], in[4], in[5], {.recompute = recompute});
          return ys * 2.0f + h * 3.0f;
        };
        CHECK(linum::testing::check_gradients("gru_layer", f, {x, wi, bi, wh, bh, h0}));
      }
    }
  }
  // bf16 arguments: computed in float32, results rounded back, gradients in each argument's dtype.
  {
    const Array x = random_array(Shape{6, 2, 3}, 61), wi = random_array(Shape{3, 15}, 62) * 0.5f;
    const Array wh = random_array(Shape{5, 15}, 63) * 0.3f, bi = random_array(Shape{15}, 64), h0 = random_array(Shape{2, 5}, 65);
    const Array bh = Array::zeros(Shape{15});
    auto [ys, h] = gru_layer(astype(x, DType::bf16), astype(wi, DType::bf16), bi, wh, bh, h0);
    CHECK(ys.dtype() == DType::f32);  // promoted
    auto [yb, hb] = gru_layer(astype(x, DType::bf16), astype(wi, DType::bf16), astype(bi, DType::bf16),
                              astype(wh, DType::bf16), astype(bh, DType::bf16), astype(h0, DType::bf16));
    CHECK(yb.dtype() == DType::bf16);
    CHECK(max_diff_any(yb, ys) < 0.05f);
    const Array g = grad([&](const Array& w) {
      auto [y, hl] = gru_layer(astype(x, DType::bf16), w, astype(bi, DType::bf16), astype(wh, DType::bf16),
                               astype(bh, DType::bf16), astype(h0, DType::bf16));
      return sum(astype(y, DType::f32));
    })(astype(wi, DType::bf16));
    CHECK(g.dtype() == DType::bf16);
    CHECK(linum::testing::max_abs(astype(g, DType::f32)) > 0.0f);
  }
  // Bad arguments: typed errors naming the op and the shapes.
  const Array x = Array::zeros(Shape{4, 2, 3}), wi = Array::zeros(Shape{3, 6}), wh = Array::zeros(Shape{2, 6});
  const Array b = Array::zeros(Shape{6}), h0 = Array::zeros(Shape{2, 2});
  CHECK_THROWS_WITH_AS(gru_layer(x, wi, b, wh, b, Array::zeros(Shape{3, 2})), doctest::Contains("gru_layer"), ShapeError);
  CHECK_THROWS_WITH_AS(gru_layer(x, Array::zeros(Shape{4, 6}), b, wh, b, h0), doctest::Contains("input_kernel f32[4,6]"),
                       ShapeError);
  CHECK_THROWS_AS(gru_layer(reshape(x, {8, 3}), wi, b, wh, b, h0), ShapeError);
  CHECK_THROWS_AS(gru_layer(x, wi, b, Array::zeros(Shape{2, 8}), b, h0), ShapeError);
  CHECK_THROWS_AS(gru_layer(x, wi, b, wh, Array::zeros(Shape{4}), h0), ShapeError);
  CHECK_THROWS_AS(gru_layer(astype(x, DType::i32), wi, b, wh, b, h0), ShapeError);
  // Zero steps: the initial state back, ys empty.
  auto [ys0, h_0] = gru_layer(Array::zeros(Shape{0, 2, 3}), wi, b, wh, b, h0 + 2.0f);
  CHECK(ys0.shape() == Shape{0, 2, 2});
  CHECK(h_0.bitwise_equal(h0 + 2.0f));
  auto [g_wi0, g_h00] = grad<0, 1>([&](const Array& k, const Array& h) {
    auto [y, hl] = gru_layer(Array::zeros(Shape{0, 2, 3}), k, b, wh, b, h);
    return sum(hl * 3.0f);
  })(wi, h0);
  CHECK(g_h00.bitwise_equal(Array::full(h0.shape(), 3.0f)));
  CHECK(g_wi0.bitwise_equal(Array::zeros(wi.shape())));
}

TEST_CASE("nn::RNN runs GRUs on the layer op: the cell's parameters and results; remat keeps less, bitwise") {
  const Array xs = random_array(Shape{3, 40, 5}, 71);
  const Array lengths = Array::from_i32(Shape{3}, {40, 2, 17});
  for (bool reverse : {false, true})
    for (bool masked : {false, true}) {
      CAPTURE(reverse);
      CAPTURE(masked);
      nn::RNN<nn::GRUCell> fused{.cell = {.features = 6}, .reverse = reverse, .keep_order = true};
      auto slow = fused;
      slow.cell = unfused(fused.cell);
      const Tree vars = init(fused, rng::key(8), xs);
      const Tree slow_vars = init(slow, rng::key(8), xs);
      CHECK(vars.at_path("params/cell").keys() == std::vector<std::string>{"ir", "hr", "iz", "hz", "in", "hn"});
      CHECK(bitwise_equal(vars, slow_vars));
      auto loss = [&](const nn::RNN<nn::GRUCell>& model) {
        return [&](const Tree& p) {
          const nn::RNNOptions o{.return_carry = true, .seq_lengths = masked ? std::optional<Array>(lengths) : std::nullopt};
          auto [carry, ys] = apply(model, Tree{{"params", p}}, xs, o);
          return mean(square(ys)) + mean(carry * 0.5f);
        };
      };
      check_fused_against_cell(fused, slow, vars, loss, 1e-5f, lift::ScanSchedule::sqrt_segments());
    }
  // The layer op keeps the gates of every step (4 floats per unit and row); remat keeps only the
  // outputs. (At this small batch the layer's fixed costs, its packed recurrent kernel and a chunk's
  // workspace, outweigh the cell path's per-step activations.)
  const Array long_xs = random_array(Shape{3, 200, 5}, 72);
  const nn::RNN<nn::GRUCell> plain{.cell = {.features = 70}};
  const Tree vars = init(plain, rng::key(9), long_xs);
  auto step = [&](const nn::RNN<nn::GRUCell>& model, std::int64_t& peak) {
    memory::PeakScope scope;
    Tree g = grad([&](const Tree& p) { return mean(square(apply(model, Tree{{"params", p}}, long_xs))); })(vars.at("params"));
    peak = scope.peak_growth() - byte_count(g);
    return g;
  };
  std::int64_t plain_peak = 0, remat_peak = 0, slow_peak = 0;
  const Tree g_plain = step(plain, plain_peak);
  auto rematted = plain;
  rematted.remat = true;
  CHECK(bitwise_equal(step(rematted, remat_peak), g_plain));
  auto slow = plain;
  slow.cell = unfused(plain.cell);
  step(slow, slow_peak);
  MESSAGE("peak bytes, 200 steps: layer op ", plain_peak, ", with remat ", remat_peak, ", cell path ", slow_peak);
  CHECK(remat_peak < plain_peak);
  // What remat spares: the gates of every step but one chunk's (its recomputation's workspace), less
  // the recomputation's packed copy of the recurrent kernel [70, 3 * 70].
  CHECK(plain_peak - remat_peak >= ((200 - kLSTMLayerChunk) * 3 * 4 * 70 - 70 * 3 * 70) * std::int64_t{sizeof(float)});
  // Mixed precision (bf16 compute): the cell path, with the layer op's parameters.
  const nn::RNN<nn::GRUCell> mixed{.cell = {.features = 6, .dtype = DType::bf16}};
  const Tree mixed_vars = init(mixed, rng::key(6), xs);
  const nn::RNN<nn::GRUCell> six{.cell = {.features = 6}};
  CHECK(bitwise_equal(mixed_vars, init(six, rng::key(6), xs)));
  auto mixed_slow = mixed;
  mixed_slow.cell = unfused(mixed.cell);
  // The layer op computes in float32 from the bf16 operands (the cell path rounds each product and
  // gate to bf16): within bf16 rounding.
  const Array y = apply(mixed, mixed_vars, xs);
  CHECK(max_diff_any(y, apply(mixed_slow, mixed_vars, xs)) < 0.05f);
  CHECK(y.dtype() == DType::f32);  // as Flax's: the carry is in param_dtype, and bf16 * f32 promotes
  // A carry of the wrong shape is an error naming the layer and both shapes.
  CHECK_THROWS_WITH_AS(apply(plain, vars, xs, Array::zeros(Shape{3, 69})), doctest::Contains("nn::RNN"), ShapeError);
}
