// The optax toolbox: each optimizer's first steps against the update rules optax publishes
// (written out here per element, in float), each schedule at known steps, the wrappers (masked,
// apply_if_finite, multi_steps), optax's state layouts, losses and running metrics.
#include <doctest/doctest.h>

#include "testing/gradcheck.hpp"

#include <linum/linum.hpp>

#include <cmath>
#include <functional>
#include <vector>

using namespace linum;

namespace {

const std::vector<float> kParams = {0.5f, -1.0f, 2.0f};
const std::vector<std::vector<float>> kGrads = {{0.1f, -0.2f, 0.3f}, {-0.4f, 0.5f, 0.25f}, {0.2f, 0.2f, -0.1f}};

Tree tree_of(const std::vector<float>& v) { return Tree{{"w", Array::from({static_cast<std::int64_t>(v.size())}, v)}}; }

// Runs `opt` for the three gradient steps above and returns the parameters after each step.
std::vector<std::vector<float>> run(const optim::GradientTransformation& opt) {
  Tree params = tree_of(kParams);
  Tree state = opt.init(params);
  std::vector<std::vector<float>> out;
  for (const auto& g : kGrads) {
    auto [updates, next] = opt.update(tree_of(g), state, params);
    params = optim::apply_updates(params, updates);
    state = next;
    out.push_back(params.at("w").array().to_vector());
  }
  return out;
}

// The same three steps by a reference rule: rule(step t from 1, grads, params) -> updates.
using Rule = std::function<std::vector<float>(int t, const std::vector<float>& g, const std::vector<float>& p)>;
std::vector<std::vector<float>> reference(const Rule& rule) {
  std::vector<float> p = kParams;
  std::vector<std::vector<float>> out;
  for (int t = 1; t <= 3; ++t) {
    const auto u = rule(t, kGrads[t - 1], p);
    for (std::size_t i = 0; i < p.size(); ++i) p[i] += u[i];
    out.push_back(p);
  }
  return out;
}

void check_same(const std::vector<std::vector<float>>& got, const std::vector<std::vector<float>>& want, double rel = 1e-5) {
  for (std::size_t s = 0; s < want.size(); ++s)
    for (std::size_t i = 0; i < want[s].size(); ++i) {
      CAPTURE(s);
      CAPTURE(i);
      CHECK(got[s][i] == doctest::Approx(want[s][i]).epsilon(rel));
    }
}

float norm(const std::vector<float>& v) {
  double s = 0;
  for (float x : v) s += static_cast<double>(x) * x;
  return static_cast<float>(std::sqrt(s));
}

}  // namespace

TEST_CASE("rmsprop, centered rmsprop with momentum, adagrad: optax's rules") {
  const float lr = 0.1f;
  {
    std::vector<float> nu(3, 0.0f);
    check_same(run(optim::rmsprop(lr)), reference([&](int, const auto& g, const auto&) {
      std::vector<float> u(3);
      for (int i = 0; i < 3; ++i) {
        nu[i] = 0.1f * g[i] * g[i] + 0.9f * nu[i];
        u[i] = -lr * (g[i] / std::sqrt(nu[i] + 1e-8f));
      }
      return u;
    }));
  }
  {
    // eps_in_sqrt = false: eps added to the root (PyTorch's RMSprop), centered or not.
    std::vector<float> nu(3, 0.0f);
    check_same(run(optim::rmsprop(lr, 0.9, 1e-3, 0.0, false, 0.0, false, /*eps_in_sqrt=*/false)),
               reference([&](int, const auto& g, const auto&) {
                 std::vector<float> u(3);
                 for (int i = 0; i < 3; ++i) {
                   nu[i] = 0.1f * g[i] * g[i] + 0.9f * nu[i];
                   u[i] = -lr * ((1.0f / (std::sqrt(nu[i]) + 1e-3f)) * g[i]);
                 }
                 return u;
               }));
    std::vector<float> mu(3, 0.0f), nu2(3, 0.0f);
    check_same(run(optim::rmsprop(lr, 0.9, 1e-3, 0.0, /*centered=*/true, 0.0, false, /*eps_in_sqrt=*/false)),
               reference([&](int, const auto& g, const auto&) {
                 std::vector<float> u(3);
                 for (int i = 0; i < 3; ++i) {
                   mu[i] = 0.1f * g[i] + 0.9f * mu[i];
                   nu2[i] = 0.1f * g[i] * g[i] + 0.9f * nu2[i];
                   u[i] = -lr * ((1.0f / (std::sqrt(nu2[i] - mu[i] * mu[i]) + 1e-3f)) * g[i]);
                 }
                 return u;
               }));
  }
  {
    std::vector<float> mu(3, 0.0f), nu(3, 0.0f), tr(3, 0.0f);
    check_same(run(optim::rmsprop(lr, 0.9, 1e-8, 0.0, /*centered=*/true, /*momentum=*/0.5)),
               reference([&](int, const auto& g, const auto&) {
                 std::vector<float> u(3);
                 for (int i = 0; i < 3; ++i) {
                   mu[i] = 0.1f * g[i] + 0.9f * mu[i];
                   nu[i] = 0.1f * g[i] * g[i] + 0.9f * nu[i];
                   const float scaled = -lr * (g[i] / std::sqrt(nu[i] - mu[i] * mu[i] + 1e-8f));
                   tr[i] = scaled + 0.5f * tr[i];  // trace comes after the learning rate
                   u[i] = tr[i];
                 }
                 return u;
               }));
  }
  {
    std::vector<float> s(3, 0.1f);
    check_same(run(optim::adagrad(lr)), reference([&](int, const auto& g, const auto&) {
      std::vector<float> u(3);
      for (int i = 0; i < 3; ++i) {
        s[i] += g[i] * g[i];
        u[i] = -lr * g[i] / std::sqrt(s[i] + 1e-7f);
      }
      return u;
    }));
  }
  // State layouts as optax's to_state_dict.
  const Tree st = optim::rmsprop(lr).init(tree_of(kParams));
  CHECK(st.keys() == std::vector<std::string>{"0", "1", "2"});
  CHECK(st.at("0").keys() == std::vector<std::string>{"nu"});
  CHECK(optim::adagrad(lr).init(tree_of(kParams)).at("0").at("sum_of_squares").at("w").array().to_vector()[0] == 0.1f);
}

TEST_CASE("lion, lamb, adabelief: optax's rules") {
  const float lr = 0.05f;
  {
    std::vector<float> mu(3, 0.0f);
    check_same(run(optim::lion(lr, 0.9, 0.99, /*weight_decay=*/0.01)), reference([&](int, const auto& g, const auto& p) {
      std::vector<float> u(3);
      for (int i = 0; i < 3; ++i) {
        const float x = 0.1f * g[i] + 0.9f * mu[i];
        const float sign = x > 0 ? 1.0f : x < 0 ? -1.0f : 0.0f;
        u[i] = -lr * (sign + 0.01f * p[i]);
        mu[i] = 0.01f * g[i] + 0.99f * mu[i];
      }
      return u;
    }));
  }
  {
    std::vector<float> m(3, 0.0f), v(3, 0.0f);
    check_same(run(optim::lamb(lr, 0.9, 0.999, 1e-6, 0.0, /*weight_decay=*/0.01)), reference([&](int t, const auto& g, const auto& p) {
      std::vector<float> a(3);
      for (int i = 0; i < 3; ++i) {
        m[i] = 0.1f * g[i] + 0.9f * m[i];
        v[i] = 0.001f * g[i] * g[i] + 0.999f * v[i];
        const float mh = m[i] / (1.0f - std::pow(0.9f, static_cast<float>(t)));
        const float vh = v[i] / (1.0f - std::pow(0.999f, static_cast<float>(t)));
        a[i] = mh / (std::sqrt(vh) + 1e-6f) + 0.01f * p[i];
      }
      const float ratio = norm(p) / norm(a);  // one leaf: its trust ratio
      std::vector<float> u(3);
      for (int i = 0; i < 3; ++i) u[i] = -lr * a[i] * ratio;
      return u;
    }), 2e-5);
  }
  {
    std::vector<float> m(3, 0.0f), s(3, 0.0f);
    check_same(run(optim::adabelief(lr)), reference([&](int t, const auto& g, const auto&) {
      std::vector<float> u(3);
      for (int i = 0; i < 3; ++i) {
        m[i] = 0.1f * g[i] + 0.9f * m[i];
        const float e = g[i] - m[i];  // optax: the error against the new first moment
        s[i] = 0.001f * e * e + 0.999f * s[i] + 1e-16f;
        const float mh = m[i] / (1.0f - std::pow(0.9f, static_cast<float>(t)));
        const float sh = s[i] / (1.0f - std::pow(0.999f, static_cast<float>(t)));
        u[i] = -lr * mh / (std::sqrt(sh) + 1e-16f);
      }
      return u;
    }), 2e-5);
  }
  CHECK(optim::lion(lr).init(tree_of(kParams)).at("0").keys() == std::vector<std::string>{"count", "mu"});
  CHECK_THROWS_WITH_AS(optim::lamb(lr).update(tree_of(kGrads[0]), optim::lamb(lr).init(tree_of(kParams))),
                       doctest::Contains("parameters"), ValueError);
}

TEST_CASE("adamax, adadelta, novograd: optax's rules; bad hyperparameters and states are ValueErrors") {
  const float lr = 0.05f;
  {
    std::vector<float> m(3, 0.0f), v(3, 0.0f);
    check_same(run(optim::adamax(lr)), reference([&](int t, const auto& g, const auto&) {
      std::vector<float> u(3);
      for (int i = 0; i < 3; ++i) {
        m[i] = 0.1f * g[i] + 0.9f * m[i];
        v[i] = std::max(std::fabs(g[i]) + 1e-8f, 0.999f * v[i]);  // the infinity norm
        u[i] = -lr * (m[i] / (1.0f - std::pow(0.9f, static_cast<float>(t)))) / v[i];
      }
      return u;
    }));
  }
  {
    std::vector<float> eg(3, 0.0f), ex(3, 0.0f);
    check_same(run(optim::adadelta(1.0, 0.9, 1e-6)), reference([&](int, const auto& g, const auto&) {
      std::vector<float> u(3);
      for (int i = 0; i < 3; ++i) {
        eg[i] = 0.1f * g[i] * g[i] + 0.9f * eg[i];
        const float step = std::sqrt(ex[i] + 1e-6f) / std::sqrt(eg[i] + 1e-6f) * g[i];
        ex[i] = 0.1f * step * step + 0.9f * ex[i];
        u[i] = -step;
      }
      return u;
    }));
  }
  {
    std::vector<float> m(3, 0.0f);
    float nu = 0.0f;
    check_same(run(optim::novograd(lr, 0.9, 0.25, 1e-6, 0.0, /*weight_decay=*/0.01)), reference([&](int t, const auto& g, const auto& p) {
      const float n2 = norm(g) * norm(g);  // one leaf: one second moment
      nu = t == 1 ? n2 : 0.75f * n2 + 0.25f * nu;
      std::vector<float> u(3);
      for (int i = 0; i < 3; ++i) {
        const float a = g[i] / (std::sqrt(nu) + 1e-6f) + 0.01f * p[i];
        m[i] = t == 1 ? a : 0.9f * m[i] + a;
        u[i] = -lr * m[i];
      }
      return u;
    }), 2e-5);
  }
  // optax's state layouts.
  const Tree params = tree_of(kParams);
  CHECK(optim::amsgrad(lr).init(params).at("0").keys() == std::vector<std::string>{"count", "mu", "nu", "nu_max"});
  CHECK(optim::adadelta(lr).init(params).at("1").keys() == std::vector<std::string>{"e_g", "e_x"});
  CHECK(optim::novograd(lr).init(params).at("0").at("nu").at("w").array().shape() == Shape{});
  CHECK(optim::lars(lr).init(params).at("1").keys() == std::vector<std::string>{"inner_state"});
  // Yogi starts both moments at initial_accumulator_value.
  CHECK(optim::yogi(lr).init(params).at("0").at("nu").at("w").array().to_vector()[0] == 1e-6f);
  // Bad hyperparameters fail when the optimizer is built; a missing params argument when it steps.
  CHECK_THROWS_WITH_AS(optim::radam(lr, 0.9, 1.5), doctest::Contains("b2"), ValueError);
  CHECK_THROWS_WITH_AS(optim::adadelta(lr, /*rho=*/-0.1), doctest::Contains("rho"), ValueError);
  CHECK_THROWS_WITH_AS(optim::lars(lr, 0.0, nullptr, 0.001, 0.0, nullptr, /*momentum=*/-1.0), doctest::Contains("momentum"),
                       ValueError);
  CHECK_THROWS_WITH_AS(optim::novograd(lr).update(tree_of(kGrads[0]), optim::novograd(lr).init(params)),
                       doctest::Contains("parameters"), ValueError);
  // A state from another optimizer is refused with the keys it should have.
  CHECK_THROWS_WITH_AS(optim::amsgrad(lr).update(tree_of(kGrads[0]), optim::adam(lr).init(params), params),
                       doctest::Contains("nu_max"), ValueError);
  // NAdam's first step: the look-ahead moment b1 m / (1 - b1^2) + (1 - b1) g / (1 - b1), over
  // sqrt(v / (1 - b2)) + eps.
  const auto nadam_steps = run(optim::nadam(lr));
  for (int i = 0; i < 3; ++i) {
    const float g = kGrads[0][i];
    const float m = 0.1f * g, v = 0.001f * g * g;
    const float mh = 0.9f * (m / (1.0f - 0.9f * 0.9f)) + 0.1f * (g / (1.0f - 0.9f));
    CHECK(nadam_steps[0][i] == doctest::Approx(kParams[i] - lr * mh / (std::sqrt(v / (1.0f - 0.999f)) + 1e-8f)).epsilon(1e-5));
  }
}

TEST_CASE("adafactor: factored second moments on a matrix, a full one on a vector, optax's rules") {
  // A [2, 3] kernel (factored with min_dim_size_to_factor = 2) and a [3] bias (not factored).
  const Array k = Array::from({2, 3}, {0.5f, -1.0f, 2.0f, 1.5f, 0.25f, -0.75f});
  const Array b = Array::from({3}, {0.1f, 0.2f, -0.3f});
  const Array gk = Array::from({2, 3}, {0.1f, -0.2f, 0.3f, -0.4f, 0.5f, 0.25f});
  const Array gb = Array::from({3}, {0.2f, -0.1f, 0.05f});
  const float lr = 0.01f;
  auto opt = optim::adafactor(lr, /*min_dim_size_to_factor=*/2);
  Tree params{{"kernel", k}, {"bias", b}};
  Tree state = opt.init(params);
  CHECK(state.at("0").keys() == std::vector<std::string>{"count", "v_row", "v_col", "v"});
  CHECK(state.at("0").at("v_row").at("kernel").array().shape() == Shape{2});
  CHECK(state.at("0").at("v_col").at("kernel").array().shape() == Shape{3});
  CHECK(state.at("0").at("v").at("bias").array().shape() == Shape{3});
  auto [updates, next] = opt.update(Tree{{"kernel", gk}, {"bias", gb}}, state, params);

  // Reference, step 0: decay_t = 1 - 1^-0.8 = 0, so the statistics are those of this gradient.
  const float eps = 1e-30f;
  auto rms_scale = [](const std::vector<float>& p) {
    double s = 0;
    for (float x : p) s += static_cast<double>(x) * x;
    return std::max(static_cast<float>(std::sqrt(s / static_cast<double>(p.size()))), 1e-3f);
  };
  auto clip = [](std::vector<float> u) {
    double s = 0;
    for (float x : u) s += static_cast<double>(x) * x;
    const float denom = std::max(1.0f, static_cast<float>(std::sqrt(s / static_cast<double>(u.size()))) / 1.0f);
    for (float& x : u) x /= denom;
    return u;
  };
  // Kernel: rows (axis 1 reduced) and columns (axis 0 reduced) of g^2 + eps.
  const auto g = gk.to_vector();
  float row[2], col[3];
  for (int r = 0; r < 2; ++r) row[r] = ((g[r * 3] * g[r * 3] + eps) + (g[r * 3 + 1] * g[r * 3 + 1] + eps) + (g[r * 3 + 2] * g[r * 3 + 2] + eps)) / 3.0f;
  for (int c = 0; c < 3; ++c) col[c] = ((g[c] * g[c] + eps) + (g[3 + c] * g[3 + c] + eps)) / 2.0f;
  const float row_mean = (row[0] + row[1]) / 2.0f;
  std::vector<float> uk(6);
  for (int r = 0; r < 2; ++r)
    for (int c = 0; c < 3; ++c) uk[r * 3 + c] = g[r * 3 + c] / std::sqrt(row[r] / row_mean) / std::sqrt(col[c]);
  uk = clip(uk);
  const float sk = rms_scale(k.to_vector());
  std::vector<float> ub(3);
  const auto gbv = gb.to_vector();
  for (int i = 0; i < 3; ++i) ub[i] = gbv[i] / std::sqrt(gbv[i] * gbv[i] + eps);
  ub = clip(ub);
  const float sb = rms_scale(b.to_vector());
  const auto got_k = updates.at("kernel").array().to_vector(), got_b = updates.at("bias").array().to_vector();
  for (int i = 0; i < 6; ++i) CHECK(got_k[i] == doctest::Approx(-lr * uk[i] * sk).epsilon(1e-5));
  for (int i = 0; i < 3; ++i) CHECK(got_b[i] == doctest::Approx(-lr * ub[i] * sb).epsilon(1e-5));
  // A second step runs (decay 1 - 2^-0.8) and stays finite.
  auto second = opt.update(Tree{{"kernel", gk}, {"bias", gb}}, next, optim::apply_updates(params, updates));
  for (float x : second.updates.at("kernel").array().to_vector()) CHECK(std::isfinite(x));
}

TEST_CASE("schedules: exponential, piecewise constant, polynomial, joined, one-cycle cosine") {
  auto e = optim::exponential_decay(1.0f, 10, 0.5f);
  CHECK(e(0) == 1.0f);
  CHECK(e(10) == doctest::Approx(0.5));
  CHECK(e(5) == doctest::Approx(std::sqrt(0.5)));
  CHECK(optim::exponential_decay(1.0f, 10, 0.5f, 0, /*staircase=*/true)(15) == doctest::Approx(0.5));
  CHECK(optim::exponential_decay(1.0f, 10, 0.5f, /*transition_begin=*/5)(15) == doctest::Approx(0.5));
  CHECK(optim::exponential_decay(1.0f, 10, 0.5f, 0, false, /*end_value=*/0.3f)(100) == doctest::Approx(0.3));
  auto pc = optim::piecewise_constant_schedule(1.0f, {{20, 0.5f}, {10, 0.1f}});
  CHECK(pc(9) == 1.0f);
  CHECK(pc(10) == doctest::Approx(0.1));
  CHECK(pc(20) == doctest::Approx(0.05));
  auto poly = optim::polynomial_schedule(1.0f, 0.1f, 2.0, 10);
  CHECK(poly(5) == doctest::Approx(0.325));
  CHECK(poly(20) == doctest::Approx(0.1));
  auto joined = optim::join_schedules({optim::constant_schedule(1.0f), optim::linear_schedule(1.0f, 0.0f, 10)}, {5});
  CHECK(joined(4) == 1.0f);
  CHECK(joined(10) == doctest::Approx(0.5));
  CHECK_THROWS_AS(optim::join_schedules({optim::constant_schedule(1.0f)}, {5}), ValueError);
  auto one = optim::cosine_onecycle_schedule(100, 1.0f);
  CHECK(one(0) == doctest::Approx(0.04));
  CHECK(one(30) == doctest::Approx(1.0));
  CHECK(one(65) == doctest::Approx((1.0 + 4e-6) / 2));
  CHECK(one(100) == doctest::Approx(4e-6));
  // A schedule drives an optimizer: adagrad with a decaying rate.
  CHECK_NOTHROW(run(optim::adagrad(optim::exponential_decay(0.1f, 1, 0.5f))));
}

TEST_CASE("masked, apply_if_finite, multi_steps, ema, incremental_update") {
  const Tree params{{"kernel", Array::from({2}, {1.0f, 2.0f})}, {"bias", Array::from({1}, {3.0f})}};
  const Tree grads{{"kernel", Array::from({2}, {0.0f, 0.0f})}, {"bias", Array::from({1}, {0.0f})}};
  // Weight decay on kernels only.
  auto decay = optim::add_decayed_weights(0.1, [](const std::string& path, const Array&) { return path != "bias"; });
  auto [u, s] = decay.update(grads, decay.init(params), params);
  CHECK(u.at("kernel").array().to_vector() == std::vector<float>{0.1f, 0.2f});
  CHECK(u.at("bias").array().to_vector() == std::vector<float>{0.0f});
  // masked adam: the bias gets no state and passes unchanged.
  auto madam = optim::masked(optim::adam(0.1), [](const std::string& path, const Array&) { return path == "kernel"; });
  const Tree ms = madam.init(params);
  CHECK_FALSE(ms.at("inner_state").at("0").at("mu").contains("bias"));
  const Tree g2{{"kernel", Array::from({2}, {1.0f, -1.0f})}, {"bias", Array::from({1}, {5.0f})}};
  auto mr = madam.update(g2, ms, params);
  CHECK(mr.updates.at("bias").array().to_vector() == std::vector<float>{5.0f});
  CHECK(mr.updates.at("kernel").array().to_vector()[0] == doctest::Approx(-0.1));

  // apply_if_finite: a NaN step gives zeros and keeps the inner state, until too many in a row.
  auto safe = optim::apply_if_finite(optim::sgd(1.0, 0.9), /*max_consecutive_errors=*/1);
  Tree st = safe.init(params);
  const Tree bad{{"kernel", Array::from({2}, {NAN, 1.0f})}, {"bias", Array::from({1}, {1.0f})}};
  auto r1 = safe.update(bad, st, params);
  CHECK(r1.updates.at("bias").array().to_vector()[0] == 0.0f);
  CHECK(r1.state.at("notfinite_count").array().data_i32()[0] == 1);
  CHECK(r1.state.at("last_finite").array().data_i32()[0] == 0);
  CHECK(bitwise_equal(r1.state.at("inner_state"), st.at("inner_state")));
  auto r2 = safe.update(bad, r1.state, params);  // the second in a row: more than 1, so it passes
  CHECK(std::isnan(r2.updates.at("kernel").array().to_vector()[0]));
  CHECK(r2.state.at("total_notfinite").array().data_i32()[0] == 2);
  auto r3 = safe.update(g2, r2.state, params);
  CHECK(r3.state.at("notfinite_count").array().data_i32()[0] == 0);

  // multi_steps: the mean of three gradients applied every third call.
  auto acc = optim::multi_steps(optim::sgd(1.0), 3);
  Tree as = acc.init(params);
  const std::vector<float> gs = {1.0f, 2.0f, 6.0f};
  Tree last;
  for (int k = 0; k < 3; ++k) {
    const Tree g{{"kernel", Array::from({2}, {gs[k], 0.0f})}, {"bias", Array::from({1}, {0.0f})}};
    auto r = acc.update(g, as, params);
    as = r.state;
    last = r.updates;
    if (k < 2) CHECK(r.updates.at("kernel").array().to_vector()[0] == 0.0f);
  }
  CHECK(last.at("kernel").array().to_vector()[0] == doctest::Approx(-3.0));
  CHECK(as.at("gradient_step").array().data_i32()[0] == 1);
  CHECK(as.at("mini_step").array().data_i32()[0] == 0);

  // ema with debiasing: the first update is the gradient itself.
  auto avg = optim::ema(0.9);
  auto er = avg.update(g2, avg.init(params));
  CHECK(er.updates.at("bias").array().to_vector()[0] == doctest::Approx(5.0));
  const Tree p_ema = optim::incremental_update(g2, params, 0.25);
  CHECK(p_ema.at("bias").array().to_vector()[0] == doctest::Approx(0.25 * 5 + 0.75 * 3));
}

TEST_CASE("losses: huber, cosine similarity and distance, KL divergence, label smoothing; gradients by finite differences") {
  const Array p = Array::from({4}, {0.0f, 0.5f, 2.0f, -3.0f});
  const Array t = Array::zeros(Shape{4});
  CHECK(nn::huber_loss(p, t).to_vector() == std::vector<float>{0.0f, 0.125f, 1.5f, 2.5f});
  const Array a = Array::from({2, 2}, {1.0f, 0.0f, 1.0f, 1.0f});
  const Array b = Array::from({2, 2}, {2.0f, 0.0f, -1.0f, 1.0f});
  const auto cs = nn::cosine_similarity(a, b).to_vector();
  CHECK(cs[0] == doctest::Approx(1.0));
  CHECK(cs[1] == doctest::Approx(0.0).epsilon(1e-6));
  CHECK(nn::cosine_distance(a, b).to_vector()[0] == doctest::Approx(0.0));
  const Array targets = Array::from({1, 3}, {0.5f, 0.5f, 0.0f});
  const Array logp = log_softmax(Array::from({1, 3}, {1.0f, 2.0f, 3.0f}), {-1});
  const auto lp = logp.to_vector();
  CHECK(nn::kl_divergence(logp, targets).to_vector()[0] ==
        doctest::Approx(0.5 * (std::log(0.5) - lp[0]) + 0.5 * (std::log(0.5) - lp[1])));
  const auto smooth = nn::smooth_labels(Array::from({1, 4}, {0.0f, 1.0f, 0.0f, 0.0f}), 0.2f).to_vector();
  CHECK(smooth[1] == doctest::Approx(0.85));
  CHECK(smooth[0] == doctest::Approx(0.05));
  // Gradients agree with finite differences (away from the kinks).
  const Array x = Array::from({2, 3}, {0.3f, -1.7f, 2.2f, 0.9f, 0.4f, -0.6f});
  const Array y = Array::from({2, 3}, {0.1f, 0.2f, -0.5f, -0.4f, 1.1f, 0.3f});
  CHECK(linum::testing::check_gradients("huber_loss", [&](const std::vector<Array>& in) { return sum(nn::huber_loss(in[0], y)); }, {x}));
  CHECK(linum::testing::check_gradients("cosine_similarity",
                                        [&](const std::vector<Array>& in) { return sum(nn::cosine_similarity(in[0], y)); }, {x}));
  CHECK(linum::testing::check_gradients("kl_divergence", [&](const std::vector<Array>& in) {
    return sum(nn::kl_divergence(log_softmax(in[0], {-1}), softmax(y, {-1})));
  }, {x}));
  CHECK_THROWS_AS(nn::huber_loss(p, Array::zeros(Shape{3})), ShapeError);
}

TEST_CASE("running metrics merge across batches and through a state tree") {
  metrics::Average loss;
  CHECK(std::isnan(loss.compute()));
  loss.update(2.0, 10);
  metrics::Average other;
  other.update(Array::from({2}, {4.0f, 6.0f}));
  const auto merged = loss.merge(other);
  CHECK(merged.compute() == doctest::Approx((20.0 + 10.0) / 12.0));
  CHECK(metrics::Average::from_state(merged.state()).compute() == doctest::Approx(merged.compute()));
  metrics::Accuracy acc;
  acc.update(Array::from({3, 2}, {0.1f, 0.9f, 0.8f, 0.2f, 0.3f, 0.7f}), Array::from_i32(Shape{3}, {1, 0, 0}));
  CHECK(acc.compute() == doctest::Approx(2.0 / 3.0));
  metrics::Accuracy more;
  more.update(Array::from({1, 2}, {0.0f, 1.0f}), Array::from_i32(Shape{1}, {1}));
  CHECK(acc.merge(more).compute() == doctest::Approx(0.75));
  CHECK_THROWS_AS(acc.update(Array::from({3, 2}, {0, 0, 0, 0, 0, 0}), Array::from_i32(Shape{2}, {0, 0})), ShapeError);
}

TEST_CASE("richer metrics: Std, LastValue, TopKAccuracy, a confusion matrix's precision, recall and F1") {
  metrics::Std std_a, std_b;
  std_a.update(Array::from({2}, {1.0f, 2.0f}));
  std_b.update(3.0);
  std_b.update(4.0);
  const metrics::Std both = metrics::Std::from_state(std_a.merge(std_b).state());
  CHECK(both.mean() == doctest::Approx(2.5));
  CHECK(both.compute() == doctest::Approx(std::sqrt(1.25)));  // population standard deviation, as clu
  CHECK(std::isnan(metrics::Std{}.compute()));
  metrics::LastValue last;
  CHECK(std::isnan(last.compute()));
  last.update(3.0);
  CHECK(last.merge(metrics::LastValue{}).compute() == 3.0);
  // Top-k: a label tied with the k-th largest logit is a hit (tf.math.in_top_k).
  metrics::TopKAccuracy top1(1), top2(2);
  const Array logits = Array::from({3, 3}, {0.1f, 0.5f, 0.4f, 0.5f, 0.5f, 0.1f, 0.9f, 0.05f, 0.01f});
  const Array labels = Array::from_i32(Shape{3}, {2, 1, 2});
  top1.update(logits, labels);
  top2.update(logits, labels);
  CHECK(top1.compute() == doctest::Approx(1.0 / 3.0));  // only the tie
  CHECK(top2.compute() == doctest::Approx(2.0 / 3.0));  // row 3: label 2 is third
  CHECK(metrics::TopKAccuracy::from_state(top2.merge(top2).state(), 2).compute() == doctest::Approx(2.0 / 3.0));
  CHECK_THROWS_AS(top1.merge(top2), ValueError);
  CHECK_THROWS_AS(metrics::TopKAccuracy(0), ValueError);
  // Labels 0 0 1 1 2 2 2, predicted 0 1 1 1 2 0 1; a fourth class never occurs (left out of the
  // macro means, as torchmetrics). Values by hand (sklearn's formulas).
  metrics::ConfusionMatrix cm(4), part(4);
  cm.update_predictions(Array::from_i32(Shape{4}, {0, 1, 1, 1}), Array::from_i32(Shape{4}, {0, 0, 1, 1}));
  part.update(Array::from({3, 4}, {0, 0, 1, 0, 1, 0, 0, 0, 0, 1, 0, 0}), Array::from_i32(Shape{3}, {2, 2, 2}));
  cm = metrics::ConfusionMatrix::from_state(cm.merge(part).state());
  CHECK(cm.matrix().to_vector() == std::vector<float>{1, 1, 0, 0, 0, 2, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0});
  CHECK(cm.accuracy() == doctest::Approx(4.0 / 7.0));
  CHECK(cm.precision_per_class() == std::vector<double>{0.5, 0.5, 1.0, 0.0});
  CHECK(cm.recall_per_class()[2] == doctest::Approx(1.0 / 3.0));
  CHECK(cm.precision() == doctest::Approx(2.0 / 3.0));
  CHECK(cm.recall() == doctest::Approx(11.0 / 18.0));
  CHECK(cm.f1() == doctest::Approx(5.0 / 9.0));
  CHECK(cm.precision(metrics::Averaging::weighted) == doctest::Approx(5.0 / 7.0));
  CHECK(cm.recall(metrics::Averaging::weighted) == doctest::Approx(4.0 / 7.0));
  CHECK(cm.f1(metrics::Averaging::weighted) == doctest::Approx((1.0 + 4.0 / 3.0 + 1.5) / 7.0));
  for (auto a : {metrics::Averaging::micro}) {
    CHECK(cm.precision(a) == doctest::Approx(4.0 / 7.0));
    CHECK(cm.f1(a) == doctest::Approx(4.0 / 7.0));
  }
  CHECK_THROWS_WITH_AS(cm.update_predictions(Array::from_i32(Shape{1}, {4}), Array::from_i32(Shape{1}, {0})),
                       doctest::Contains("prediction 4 at element 0 is outside [0, 4)"), ValueError);
  CHECK_THROWS_AS(cm.update(Array::zeros(Shape{2, 3}), Array::from_i32(Shape{2}, {0, 1})), ShapeError);
  CHECK_THROWS_AS(cm.merge(metrics::ConfusionMatrix(3)), ValueError);
}

TEST_CASE("differentially_private_aggregate and dpsgd: per-example clipping, Gaussian noise, optax's key handling") {
  // Per-example gradients of params {"b": [2], "w": [3]}: 4 examples, norms 5, 0.5, 0, 13.
  Tree grads{{"b", Array::from({4, 2}, {3, 0, 0.3f, 0, 0, 0, 5, 0})},
             {"w", Array::from({4, 3}, {0, 4, 0, 0, 0.4f, 0, 0, 0, 0, 0, 12, 0})}};
  Tree params{{"b", Array::zeros(Shape{2})}, {"w", Array::zeros(Shape{3})}};
  const double clip = 1.0;
  SUBCASE("no noise: the mean of the gradients scaled to norm <= clip") {
    const auto agg = optim::differentially_private_aggregate(clip, 0.0, 3);
    const auto [u, st] = agg.update(grads, agg.init(params), params);
    const float factors[4] = {1.0f / 5.0f, 1.0f, 1.0f, 1.0f / 13.0f};
    for (const char* leaf : {"b", "w"}) {
      const Array& g = grads.at(leaf).array();
      const std::int64_t per = g.dim(1);
      for (std::int64_t j = 0; j < per; ++j) {
        float acc = 0;
        for (int i = 0; i < 4; ++i) acc += factors[i] * g.data()[i * per + j];
        CHECK(u.at(leaf).array().data()[j] == doctest::Approx(acc / 4.0f).epsilon(1e-6));
      }
    }
    CHECK(u.at("w").array().shape() == Shape({3}));
  }
  SUBCASE("noise: clip * noise_multiplier times normal(split(PRNGKey(seed), leaves + 1)[leaf + 1]), then / batch") {
    const auto agg = optim::differentially_private_aggregate(clip, 2.0, 7);
    Tree state = agg.init(params);
    const std::vector<rng::Key> keys = rng::split(rng::key_x32(7), 3);
    const auto [u, next] = agg.update(grads, state, params);
    const auto [u0, next0] = optim::differentially_private_aggregate(clip, 0.0, 7).update(grads, state, params);
    const Array noise_w = rng::normal(keys[2], Shape{3});
    for (int j = 0; j < 3; ++j)
      CHECK(u.at("w").array().data()[j] == doctest::Approx(u0.at("w").array().data()[j] + 2.0f * noise_w.data()[j] / 4.0f).epsilon(1e-5));
    const Array k = next.at("rng_key").array();
    CHECK(static_cast<std::uint32_t>(k.data_i32()[0]) == keys[0].hi);
    CHECK(static_cast<std::uint32_t>(k.data_i32()[1]) == keys[0].lo);
  }
  SUBCASE("dpsgd takes per-example gradients and refuses plain ones") {
    const auto opt = optim::dpsgd(0.1, clip, 0.0, 0);
    CHECK(opt.takes_per_example_gradients());
    const auto [u, st] = opt.update(grads, opt.init(params), params);
    CHECK(u.at("b").array().shape() == Shape({2}));
    CHECK_THROWS_AS(opt.update(params, opt.init(params), params), ValueError);
  }
}

TEST_CASE("adan, adamaxw, sign_sgd, sm3, fromage: their checks and state errors (values: the optax oracles)") {
  const Tree params{{"b", Array::from({2}, {1.0f, -2.0f})}, {"w", Array::from({2, 2}, {0.5f, 0.0f, -1.0f, 2.0f})}};
  CHECK_THROWS_WITH_AS(optim::adan(1e-2, 0.98, 0.92, 1.5), doctest::Contains("b3 must be in [0, 1)"), ValueError);
  CHECK_THROWS_WITH_AS(optim::scale_by_sm3(0.9, 1.5), doctest::Contains("b2 must be in [0, 1]"), ValueError);
  CHECK_THROWS_WITH_AS(optim::sm3(0.1).init(Tree{{"s", Array::full(Shape{}, 1.0f)}}), doctest::Contains("is a scalar"), ValueError);
  CHECK_THROWS_AS(optim::fromage(std::nan("")), ValueError);
  // sign_sgd moves every element by the learning rate against its gradient's sign; 0 stays.
  const auto sgd = optim::sign_sgd(0.1);
  const Tree g{{"b", Array::from({2}, {3.0f, -0.01f})}, {"w", Array::from({2, 2}, {0.0f, 1.0f, -1.0f, 5.0f})}};
  const auto [u, st] = sgd.update(g, sgd.init(params), params);
  CHECK(u.at("b").array().to_vector() == std::vector<float>{-0.1f, 0.1f});
  CHECK(u.at("w").array().to_vector() == std::vector<float>{0.0f, -0.1f, 0.1f, -0.1f});
  // A state from another optimizer is refused with the keys it should have.
  CHECK_THROWS_WITH_AS(optim::adan(1e-2).update(g, optim::adam(1e-2).init(params), params),
                       doctest::Contains("optimizer state"), ValueError);
}

TEST_CASE("clip, adaptive_grad_clip, centralize, keep_params_nonnegative, zero_nans, set_to_zero, add_noise, optimistic gradients: "
          "what each does and refuses (values: the optax oracles)") {
  const Tree params{{"b", Array::from({2}, {1.0f, -2.0f})}, {"w", Array::from({2, 2}, {0.5f, 0.0f, -1.0f, 2.0f})}};
  const Tree g{{"b", Array::from({2}, {3.0f, -0.01f})}, {"w", Array::from({2, 2}, {0.0f, 1.0f, -1.0f, 5.0f})}};
  auto step = [&](const optim::GradientTransformation& t, const Tree& grads) { return t.update(grads, t.init(params), params); };
  CHECK(step(optim::clip(0.5), g).updates.at("w").array().to_vector() == std::vector<float>{0.0f, 0.5f, -0.5f, 0.5f});
  CHECK_THROWS_AS(optim::clip(-1.0), ValueError);
  // centralize: each row of a matrix minus its mean; vectors unchanged.
  const Tree c = step(optim::centralize(), g).updates;
  CHECK(c.at("w").array().to_vector() == std::vector<float>{-0.5f, 0.5f, -3.0f, 3.0f});
  CHECK(c.at("b").array().to_vector() == g.at("b").array().to_vector());
  // keep_params_nonnegative: a step that would cross 0 lands on it.
  const Tree down{{"b", Array::from({2}, {-3.0f, 1.0f})}, {"w", Array::from({2, 2}, {-0.25f, 1.0f, 0.0f, -5.0f})}};
  const Tree kept = step(optim::keep_params_nonnegative(), down).updates;
  CHECK(kept.at("b").array().to_vector() == std::vector<float>{-1.0f, 2.0f});  // 1 - 3 < 0 -> -1; -2 + 1 < 0 -> 2
  CHECK(kept.at("w").array().to_vector() == std::vector<float>{-0.25f, 1.0f, 1.0f, -2.0f});
  // adaptive_grad_clip: a Dense kernel's column whose gradient norm exceeds clipping * its norm is
  // scaled to that norm; the others pass.
  const Tree agc = step(optim::adaptive_grad_clip(1.0), g).updates;
  const std::vector<float> w = agc.at("w").array().to_vector();
  CHECK(w[0] == 0.0f);
  CHECK(w[2] == -1.0f);  // column 0: |g| = 1 below |p| = sqrt(1.25): unchanged
  CHECK(std::hypot(w[1], w[3]) == doctest::Approx(2.0f));  // column 1: |g| = sqrt(26) > |p| = 2 -> scaled to 2
  // Transformations that need the params say so; leaves of rank 6 have no default unit.
  CHECK_THROWS_WITH_AS(optim::adaptive_grad_clip(0.1).update(g, Tree()), doctest::Contains("needs the parameters"), ValueError);
  CHECK_THROWS_WITH_AS(optim::keep_params_nonnegative().update(g, Tree()), doctest::Contains("needs the parameters"),
                       ValueError);
  const Tree six{{"x", Array::ones(Shape{2, 2, 2, 2, 2, 2})}};
  CHECK_THROWS_WITH_AS(optim::adaptive_grad_clip(0.1).update(six, Tree(), six), doctest::Contains("ranks 1 to 5"), ShapeError);
  // zero_nans: NaN elements become 0, and the state flags the leaves that had one.
  const Tree nan{{"b", Array::from({2}, {std::nanf(""), 1.0f})}, {"w", Array::zeros(Shape{2, 2})}};
  const auto [zeroed, flags] = step(optim::zero_nans(), nan);
  CHECK(zeroed.at("b").array().to_vector() == std::vector<float>{0.0f, 1.0f});
  CHECK(flags.at("found_nan").at("b").array().to_vector_i32() == std::vector<std::int32_t>{1});
  CHECK(flags.at("found_nan").at("w").array().to_vector_i32() == std::vector<std::int32_t>{0});
  CHECK(step(optim::set_to_zero(), g).updates.at("b").array().to_vector() == std::vector<float>{0.0f, 0.0f});
  // add_noise: the same seed gives the same noise; its variance anneals with the step.
  const auto noisy = optim::add_noise(1.0, 0.55, 7);
  const auto first = noisy.update(g, noisy.init(params), params);
  CHECK(bitwise_equal(first.updates, noisy.update(g, noisy.init(params), params).updates));
  const auto other_seed = optim::add_noise(1.0, 0.55, 8);  // (the key lives in the state init makes)
  CHECK_FALSE(bitwise_equal(first.updates, other_seed.update(g, other_seed.init(params), params).updates));
  CHECK(first.state.at("count").array().to_vector_i32() == std::vector<std::int32_t>{1});
  CHECK_THROWS_AS(optim::add_noise(-1.0, 0.55, 0), ValueError);
  // optimistic gradients: at the first step (alpha + beta) g - beta g; then 2 g - g_prev.
  const auto og = optim::scale_by_optimistic_gradient();
  const auto [u1, s1] = og.update(g, og.init(params), params);
  CHECK(u1.at("b").array().to_vector() == g.at("b").array().to_vector());
  const auto [u2, s2] = og.update(down, s1, params);
  CHECK(u2.at("b").array().to_vector() == std::vector<float>{-9.0f, 2.01f});
  CHECK(s2.at("is_initial_step").array().to_vector_i32() == std::vector<std::int32_t>{0});
}

TEST_CASE("multi_transform: each group of leaves by its own transformation; unknown labels are refused") {
  const Tree params{{"b", Array::from({2}, {1.0f, -2.0f})}, {"w", Array::from({2, 2}, {0.5f, 0.0f, -1.0f, 2.0f})}};
  const Tree g{{"b", Array::from({2}, {3.0f, -0.01f})}, {"w", Array::from({2, 2}, {0.0f, 1.0f, -1.0f, 5.0f})}};
  const optim::Labels by_name = [](const std::string& path, const Array&) { return path == "b" ? "frozen" : "trained"; };
  const auto opt = optim::multi_transform({{"trained", optim::sgd(0.1)}, {"frozen", optim::set_to_zero()}}, by_name);
  const auto [u, st] = opt.update(g, opt.init(params), params);
  CHECK(u.at("b").array().to_vector() == std::vector<float>{0.0f, 0.0f});
  const Tree w_only{{"w", g.at("w")}};
  CHECK(bitwise_equal(u.at("w"), optim::sgd(0.1).update(w_only, optim::sgd(0.1).init(w_only)).updates.at("w")));
  CHECK(st.at("inner_states").contains("trained"));
  CHECK(st.at("inner_states").at("frozen").contains("inner_state"));
  const auto missing = optim::multi_transform({{"trained", optim::sgd(0.1)}}, by_name);
  CHECK_THROWS_WITH_AS(missing.init(params), doctest::Contains("label 'frozen', which has no transformation (labels with one: trained)"),
                       ValueError);
  CHECK_THROWS_WITH_AS(optim::multi_transform({{"a", optim::sgd(0.1)}, {"a", optim::adam(0.1)}}, by_name),
                       doctest::Contains("given twice"), ValueError);
}

// ---- optimizers that read the objective (ExtraArgs) -------------------------------------------

namespace {

// Rosenbrock's function over a two-leaf tree: sum over i of 100 (y_i - x_i^2)^2 + (1 - x_i)^2,
// minimum 0 at x = y = 1; narrow curved valleys that plain gradient descent crawls along.
Array rosenbrock(const Tree& p) {
  const Array& x = p.at("x").array();
  const Array& y = p.at("y").array();
  const Array r = y - x * x, s = 1.0f - x;
  return sum(100.0f * r * r + s * s);
}

Tree rosenbrock_start() {
  return Tree{{"x", Array::from({3}, {-1.2f, -0.5f, 0.3f})}, {"y", Array::from({3}, {1.0f, 0.8f, -0.2f})}};
}

// Runs opt for `steps` steps with the value and value_fn; returns the values after each step.
std::vector<float> minimize(const optim::GradientTransformation& opt, int steps, Tree& params) {
  auto value_fn = [](const Tree& p) { return rosenbrock(p).item(); };
  Tree state = opt.init(params);
  std::vector<float> values;
  for (int s = 0; s < steps; ++s) {
    auto [value, grads] = value_and_grad(rosenbrock)(params);
    auto [updates, next] = opt.update(grads, state, params, {.value = value.item(), .value_fn = value_fn});
    params = optim::apply_updates(params, updates);
    state = next;
    values.push_back(value_fn(params));
  }
  return values;
}

}  // namespace

TEST_CASE("lbfgs with its backtracking linesearch reaches Rosenbrock's minimum, which sgd and adam do not in as many steps") {
  Tree p = rosenbrock_start();
  const std::vector<float> lbfgs_values = minimize(optim::lbfgs(), 100, p);
  CHECK(lbfgs_values.back() < 1e-9f);
  for (const char* k : {"x", "y"})
    for (float v : p.at(k).array().to_vector()) CHECK(v == doctest::Approx(1.0f).epsilon(1e-4));
  // The Armijo condition: no step increases the objective (until float32's rounding of values near
  // 0, where no trial passes and optax, as here, takes the last, shortest one).
  for (std::size_t s = 1; s < lbfgs_values.size(); ++s)
    if (lbfgs_values[s - 1] > 1e-10f) CHECK(lbfgs_values[s] <= lbfgs_values[s - 1]);
  Tree q = rosenbrock_start();
  CHECK(minimize(optim::adam(1e-2), 100, q).back() > 1e-3f);
}

TEST_CASE("the backtracking linesearch makes a too-long sgd step safe: it shrinks the step until the value decreases") {
  // sgd(1.0) on Rosenbrock diverges at once; behind the linesearch every step decreases the value.
  Tree p = rosenbrock_start();
  const std::vector<float> values = minimize(optim::chain(optim::sgd(1.0), optim::scale_by_backtracking_linesearch(30)), 40, p);
  float before = rosenbrock(rosenbrock_start()).item();
  for (float v : values) {
    CHECK(v <= before);
    before = v;
  }
  Tree q = rosenbrock_start();
  auto [value, grads] = value_and_grad(rosenbrock)(q);
  auto [updates, state] = optim::sgd(1.0).update(grads, optim::sgd(1.0).init(q), q);
  CHECK(rosenbrock(optim::apply_updates(q, updates)).item() > 100 * value.item());
}

TEST_CASE("extra arguments: a missing value is an error naming it; chain, apply_if_finite and multi_steps pass them on") {
  const Tree p = rosenbrock_start();
  auto [value, gradient] = value_and_grad(rosenbrock)(p);
  const Tree grads = gradient;  // (named: clang 14 cannot capture a structured binding)
  const auto polyak = optim::polyak_sgd();
  CHECK(polyak.uses_extra_args());
  CHECK_FALSE(optim::adam(1e-3).uses_extra_args());
  auto message = [&](const optim::GradientTransformation& opt, const optim::ExtraArgs& extra) -> std::string {
    try {
      opt.update(grads, opt.init(p), p, extra);
    } catch (const ValueError& e) {
      return e.what();
    }
    return "";
  };
  CHECK(message(polyak, {}).find(".value = loss") != std::string::npos);
  CHECK(message(optim::lbfgs(), {.value = value.item()}).find(".value_fn") != std::string::npos);
  CHECK(message(polyak, {.value = value.item()}).empty());
  // Without extra arguments at all (the three-argument update), the same error.
  CHECK_THROWS_AS(polyak.update(grads, polyak.init(p), p), ValueError);
  // Wrappers that see every parameter pass them on and give the inner transformation's updates.
  const optim::ExtraArgs extra{.value = value.item()};
  const Tree direct = polyak.update(grads, polyak.init(p), p, extra).updates;
  for (const auto& wrapped : {optim::apply_if_finite(polyak, 2), optim::multi_steps(polyak, 1)}) {
    CHECK(wrapped.uses_extra_args());
    const Tree via = wrapped.update(grads, wrapped.init(p), p, extra).updates;
    for (const char* k : {"x", "y"}) CHECK(via.at(k).array().to_vector() == direct.at(k).array().to_vector());
  }
  // A gradient of another structure than the params is refused.
  CHECK_THROWS_AS(optim::lbfgs().update(grads, optim::lbfgs().init(p), p,
                                        {.value = 1.0f, .value_fn = [](const Tree&) { return 0.0f; }, .grad = Tree{{"x", grads.at("x")}}}),
                  ValueError);
}
