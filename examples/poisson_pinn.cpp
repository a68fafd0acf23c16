// A physics-informed network: solve the 1-D Poisson equation -u''(x) = pi^2 sin(pi x) on [0, 1]
// with u(0) = u(1) = 0 (exact solution: sin(pi x)) by training a small network u(x) whose loss holds
// its own second derivative with respect to its input.
//
//   poisson_pinn [--steps 1000] [--points 64] [--width 32] [--depth 3] [--lr 0.001] [--remat per-block|none] [--seed 0]
//                [--optimizer adam|lbfgs]
//
// The loss is mean((u''(x) + f(x))^2) at collocation points plus the boundary terms u(0)^2 + u(1)^2:
// u' and u'' are gradients of the network with respect to x taken inside the gradient with respect
// to the parameters (grad of grad of grad, composing as in JAX). Each residual block is
// checkpointed (lift::remat), and the parameters' gradients are bitwise those without remat. It
// prints the loss, the error against the exact solution on a fine grid, and a last line of JSON.
// --optimizer lbfgs trains with L-BFGS and its backtracking linesearch (optim::lbfgs, optax's),
// which physics-informed networks are usually finished with: each step also evaluates the loss at
// the linesearch's trial points (--lr is then unused).
#include "flags.hpp"

#include <linum/linum.hpp>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <numbers>
#include <string>
#include <vector>

using namespace linum;

// A residual block: x + Dense(tanh(Dense(x))).
struct Block {
  std::int64_t width = 32;
  Array operator()(Scope& s, const Array& x) const {
    return x + s(nn::Dense{.features = width}, tanh(s(nn::Dense{.features = width}, x)));
  }
};

// u: [points, 1] -> [points, 1]. The input is lifted to the width, then residual blocks, then one
// output; x (1 - x) times the network's output would build the boundary in, but the boundary term
// is kept in the loss, as physics-informed networks usually do.
template <class B>
struct Net {
  std::int64_t width = 32;
  int depth = 3;
  Array operator()(Scope& s, const Array& x) const {
    Array h = tanh(s(nn::Dense{.features = width}, x));
    B block{};
    block.width = width;  // (lift::remat<Block> is a Block)
    for (int i = 0; i < depth; ++i) h = s(block, h);
    return s(nn::Dense{.features = 1}, h);
  }
};

struct Options {
  long steps = 1000, points = 64, width = 32, depth = 3;
  double lr = 1e-3;
  std::string remat = "per-block", optimizer = "adam";
  int seed = 0;
};

const examples::Flags flags("poisson_pinn",
                            "usage: poisson_pinn [--steps N] [--points N] [--width N] [--depth N] [--lr X]\n"
                            "                    [--remat per-block|none] [--seed N] [--optimizer adam|lbfgs]");

Options parse(int argc, char** argv) {
  Options o;
  flags.parse(argc, argv, [&](const std::string& name, const std::string& value) {
    if (name == "--steps") o.steps = static_cast<long>(flags.number(name, value, 1, 1e7));
    else if (name == "--points") o.points = static_cast<long>(flags.number(name, value, 2, 1e6));
    else if (name == "--width") o.width = static_cast<long>(flags.number(name, value, 1, 4096));
    else if (name == "--depth") o.depth = static_cast<long>(flags.number(name, value, 0, 64));
    else if (name == "--lr") o.lr = flags.number(name, value, 1e-8, 10);
    else if (name == "--seed") o.seed = static_cast<int>(flags.number(name, value, 0, 1e9));
    else if (name == "--remat") {
      if (value != "per-block" && value != "none") flags.fail("--remat needs per-block or none, got '" + value + "'");
      o.remat = value;
    } else if (name == "--optimizer") {
      if (value != "adam" && value != "lbfgs") flags.fail("--optimizer needs adam or lbfgs, got '" + value + "'");
      o.optimizer = value;
    } else {
      return false;
    }
    return true;
  });
  return o;
}

// The loss of the network `net` with parameters p: the equation's residual at the collocation
// points xs and the boundary values.
template <class N>
Array pinn_loss(const N& net, const Tree& p, const Array& xs, const Array& f) {
  auto u_sum = [&](const Array& x) { return sum(apply(net, Tree{{"params", p}}, x)); };  // points are independent
  auto u_x = [&](const Array& x) { return grad(u_sum)(x); };                          // du/dx at every point
  const Array u_xx = grad([&](const Array& x) { return sum(u_x(x)); })(xs);           // d2u/dx2
  const Array ends = apply(net, Tree{{"params", p}}, Array::from(Shape{2, 1}, {0.0f, 1.0f}));
  return mean(square(u_xx + f)) + sum(square(ends));
}

template <class N>
int run(const N& net, const Options& o) {
  const float pi = std::numbers::pi_v<float>;
  std::vector<float> xv(static_cast<std::size_t>(o.points)), fv(xv.size());
  for (std::size_t i = 0; i < xv.size(); ++i) {
    xv[i] = (static_cast<float>(i) + 0.5f) / static_cast<float>(o.points);  // interior points
    fv[i] = pi * pi * std::sin(pi * xv[i]);
  }
  const Array xs = Array::from(Shape{o.points, 1}, xv), f = Array::from(Shape{o.points, 1}, fv);
  Tree params = init(net, rng::key(static_cast<std::uint32_t>(o.seed)), xs).at("params");
  const bool lbfgs = o.optimizer == "lbfgs";
  const auto opt = lbfgs ? optim::lbfgs() : optim::adam(o.lr);
  Tree state = opt.init(params);
  // The linesearch's trial points: the loss alone, without recording for gradients.
  auto loss_at = [&](const Tree& p) {
    autodiff::NoGradGuard value_only;
    return pinn_loss(net, p, xs, f).item();
  };
  // The error against the exact solution on a grid of 201 points, endpoints included.
  std::vector<float> grid(201), exact(201);
  for (std::size_t i = 0; i < grid.size(); ++i) grid[i] = static_cast<float>(i) / 200.0f, exact[i] = std::sin(pi * grid[i]);
  const Array grid_x = Array::from(Shape{201, 1}, grid), exact_u = Array::from(Shape{201, 1}, exact);
  auto errors = [&] {
    const Array diff = apply(net, Tree{{"params", params}}, grid_x) - exact_u;
    return std::make_pair(max(abs(diff)).item(), std::sqrt(sum(square(diff)).item() / sum(square(exact_u)).item()));
  };
  const auto start = std::chrono::steady_clock::now();
  double first_loss = 0, loss_now = 0;
  for (long step = 0; step < o.steps; ++step) {
    auto [loss, grads] = value_and_grad([&](const Tree& p) { return pinn_loss(net, p, xs, f); })(params);
    loss_now = loss.item();
    if (lbfgs) {
      auto [updates, s2] = opt.update(grads, state, params, {.value = static_cast<float>(loss_now), .value_fn = loss_at});
      params = optim::apply_updates(params, updates);
      state = std::move(s2);
    } else {
      auto [p2, s2] = opt.step(std::move(params), grads, std::move(state));
      params = std::move(p2);
      state = std::move(s2);
    }
    if (step == 0) first_loss = loss_now;
    if (step % std::max<long>(1, o.steps / 10) == 0 || step + 1 == o.steps) {
      const auto [max_err, rel_l2] = errors();
      std::printf("step %5ld  loss %.3e  max |u - sin(pi x)| %.3e  relative L2 error %.3e\n", step, loss_now, max_err, rel_l2);
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const auto [max_err, rel_l2] = errors();
  nlohmann::json result = {{"example", "poisson_pinn"}, {"optimizer", o.optimizer}, {"remat", o.remat}, {"steps", o.steps}, {"points", o.points},
                           {"width", o.width}, {"depth", o.depth}, {"first_loss", first_loss}, {"final_loss", loss_now},
                           {"max_error", max_err}, {"relative_l2_error", rel_l2}, {"seconds", seconds},
                           {"params_checksum", dist::checksum_hex(params)}};
  std::cout << result.dump() << std::endl;
  return 0;
}

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  if (o.remat == "per-block") return run(Net<lift::remat<Block>>{.width = o.width, .depth = static_cast<int>(o.depth)}, o);
  return run(Net<Block>{.width = o.width, .depth = static_cast<int>(o.depth)}, o);
}
