// The small model the data-parallel tests train: a convolution with BatchNorm, a rematerialized
// dense block with dropout, and a classifier, so that remat, mutable collections and PRNG streams
// all take part in a data-parallel step.
#pragma once

#include <linum/linum.hpp>

#include <doctest/doctest.h>

#include <utility>

namespace dist_test {

using namespace linum;

struct DenseBlock {
  Array operator()(Scope& s, const Array& x, bool train) const {
    Array h = gelu(s(nn::Dense{.features = 32}, x));
    return s(nn::Dropout{.rate = 0.25}, h, /*deterministic=*/!train);
  }
};

struct SmallNet {
  Array operator()(Scope& s, const Array& x, bool train) const {
    Array h = s(nn::Conv{.features = 8, .kernel_size = {3, 3}}, x);
    h = relu(s(nn::BatchNorm{}, h, /*use_running_average=*/!train));
    h = avg_pool(h, {.window = {2, 2}, .strides = {2, 2}});
    h = reshape(h, {h.dim(0), -1});
    h = s(lift::remat<DenseBlock>{}, h, train);
    return s(nn::Dense{.features = 10}, h);
  }
};

// A global batch of `rows` 8x8 images with labels, the same on every rank.
inline Tree make_batch(std::int64_t rows, std::uint32_t seed) {
  const Array x = rng::normal(rng::key(seed), Shape{rows, 8, 8, 1});
  const Array y = rng::randint(rng::key(seed + 1), Shape{rows}, 0, 10);
  return Tree{{"x", x}, {"y", y}};
}

struct State {
  Tree params, batch_stats, opt_state;
};

inline State init_state(const optim::GradientTransformation& opt) {
  const Tree vars = init(SmallNet{}, rng::Streams{{"params", rng::key(7)}, {"dropout", rng::key(8)}},
                         make_batch(4, 1).at("x").array(), false);
  return {vars.at("params"), vars.at("batch_stats"), opt.init(vars.at("params"))};
}

// The loss of one piece of the batch: mean cross-entropy, with the new batch statistics as aux.
inline auto loss_of(const Tree& batch_stats) {
  return [batch_stats](const Tree& params, const Tree& batch, rng::Key key) {
    auto [logits, updates] = apply(SmallNet{}, Tree{{"params", params}, {"batch_stats", batch_stats}},
                                   {.rngs = {{"dropout", key}}, .mutable_collections = {"batch_stats"}},
                                   batch.at("x").array(), true);
    return std::make_pair(mean(nn::softmax_cross_entropy_with_integer_labels(logits, batch.at("y").array())),
                          updates.at("batch_stats"));
  };
}

// k data-parallel training steps with Adam; returns the final state.
inline State train(dist::DataParallel& dp, int steps, std::int64_t batch_rows) {
  const auto opt = optim::adam(1e-2);
  State s = init_state(opt);
  for (int step = 0; step < steps; ++step) {
    const Tree batch = make_batch(batch_rows, 100 + static_cast<std::uint32_t>(step));
    auto r = dp.value_and_grad(dist::LossWithAux(loss_of(s.batch_stats)), s.params, batch,
                               rng::fold_in(rng::key(9), static_cast<std::uint32_t>(step)));
    auto [updates, next] = opt.update(r.grads, s.opt_state, s.params);
    s.params = optim::apply_updates(s.params, updates);
    s.opt_state = next;
    s.batch_stats = r.aux;
  }
  return s;
}

// The doctest cases of a test program run under mpirun (the program defines
// DOCTEST_CONFIG_IMPLEMENT): rank 0 reports, the job fails if any rank failed.
inline int run_doctest(int argc, char** argv) {
  dist::Session mpi(argc, argv);
  doctest::Context context(argc, argv);
  if (dist::rank() != 0) context.setOption("minimal", true);
  const int failed = context.run();
  const auto verdicts = dist::allgather(static_cast<std::uint64_t>(failed != 0));
  int any = 0;
  for (auto v : verdicts) any |= static_cast<int>(v);
  return any;
}

}  // namespace dist_test
