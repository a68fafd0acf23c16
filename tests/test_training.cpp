// End-to-end training with the nn layers: an MLP (Dense + gelu + Dropout) and a small CNN
// (Conv + BatchNorm + relu + avg_pool + Dense) learn synthetic tasks with optim::adam, and their
// losses fall clearly. Everything is deterministic: fixed keys for data, params and dropout.
#include <doctest/doctest.h>
#include <linum/linum.hpp>

#include <cmath>
#include <tuple>
#include <vector>

using namespace linum;

namespace {

struct MLP {
  int features = 32;
  int depth = 2;
  double dropout_rate = 0.1;
  int classes = 4;
  Array operator()(Scope& s, Array x, bool train) const {
    for (int i = 0; i < depth; ++i) {
      x = nn::gelu(s(nn::Dense{.features = features}, x));
      x = s(nn::Dropout{.rate = dropout_rate}, x, !train);
    }
    return s("head", nn::Dense{.features = classes}, x);
  }
};

struct CNN {
  Array operator()(Scope& s, const Array& x, bool train) const {
    Array h = s(nn::Conv{.features = 8, .kernel_size = {3, 3}}, x);
    h = relu(s(nn::BatchNorm{}, h, !train));
    h = avg_pool(h, PoolOptions{.window = {2, 2}, .strides = {2, 2}});
    h = reshape(h, {h.dim(0), -1});
    return s(nn::Dense{.features = 2}, h);
  }
};

// 4 Gaussian blobs in 8 dimensions; the label is the blob.
std::pair<Array, Array> blobs(int n) {
  Array centers = rng::normal(rng::key(100), Shape{4, 8}) * 2.0f;
  Array labels = rng::randint(rng::key(101), Shape{n}, 0, 4);
  Array x = take(centers, labels, 0) + rng::normal(rng::key(102), Shape{n, 8});
  return {x, labels};
}

// 8x8 single-channel images with a vertical (label 0) or horizontal (label 1) bar, plus noise.
std::pair<Array, Array> bars(int n, unsigned seed) {
  Array labels = rng::randint(rng::key(seed), Shape{n}, 0, 2);
  Array pos = rng::randint(rng::key(seed + 1), Shape{n}, 1, 7);
  Array noise = rng::normal(rng::key(seed + 2), Shape{n, 8, 8, 1}) * 0.3f;
  std::vector<float> img(static_cast<std::size_t>(n) * 64, 0.0f);
  for (int i = 0; i < n; ++i) {
    const int p = pos.data_i32()[i];
    for (int t = 0; t < 8; ++t) {
      const int h = labels.data_i32()[i] == 0 ? t : p, w = labels.data_i32()[i] == 0 ? p : t;
      img[static_cast<std::size_t>(i * 64 + h * 8 + w)] = 1.0f;
    }
  }
  return {Array::from(Shape{n, 8, 8, 1}, img) + noise, labels};
}

}  // namespace

TEST_CASE("an MLP with Dense, gelu and Dropout learns 4 blobs with adam") {
  Array x, labels;
  std::tie(x, labels) = blobs(256);
  const MLP model;
  Tree vars = init(model, rng::key(0), x, false);
  Tree params = vars.at("params");
  auto eval_loss = [&](const Tree& p) {
    return mean(nn::softmax_cross_entropy_with_integer_labels(apply(model, Tree{{"params", p}}, x, false), labels)).item();
  };
  const auto opt = optim::adam(1e-2);
  Tree opt_state = opt.init(params);
  const float before = eval_loss(params);
  for (int step = 0; step < 80; ++step) {
    auto loss = [&](const Tree& p) {
      auto [logits, _] = apply(model, Tree{{"params", p}}, {.rngs = {{"dropout", rng::fold_in(rng::key(7), step)}}}, x, true);
      return mean(nn::softmax_cross_entropy_with_integer_labels(logits, labels));
    };
    auto [value, grads] = value_and_grad(loss)(params);
    auto [updates, state] = opt.update(grads, opt_state, params);
    params = optim::apply_updates(params, updates);
    opt_state = state;
  }
  const float after = eval_loss(params);
  MESSAGE("MLP loss " << before << " -> " << after);
  CHECK(before > 1.0f);
  CHECK(after < 0.1f * before);
  // Accuracy on the training set.
  Array pred = argmax(apply(model, Tree{{"params", params}}, x, false), -1);
  int correct = 0;
  for (int i = 0; i < 256; ++i) correct += pred.data_i32()[i] == labels.data_i32()[i];
  CHECK(correct >= 240);
}

TEST_CASE("a CNN with Conv, BatchNorm, relu, avg_pool and Dense learns bar orientation; batch_stats track") {
  Array x, labels;
  std::tie(x, labels) = bars(128, 200);
  const CNN model;
  Tree vars = init(model, rng::key(1), x, true);
  Tree params = vars.at("params");
  Tree batch_stats = vars.at("batch_stats");
  const auto opt = optim::adam(1e-2);
  Tree opt_state = opt.init(params);
  auto eval_loss = [&](const Tree& p, const Tree& bs, const Array& xs, const Array& ys) {
    return mean(nn::softmax_cross_entropy_with_integer_labels(
        apply(model, Tree{{"params", p}, {"batch_stats", bs}}, xs, false), ys)).item();
  };
  auto [x_test, labels_test] = bars(128, 300);
  float first_train_loss = 0, last_train_loss = 0;
  for (int step = 0; step < 60; ++step) {
    auto loss = [&](const Tree& p) {
      auto [logits, updated] = apply(model, Tree{{"params", p}, {"batch_stats", batch_stats}},
                                     {.mutable_collections = {"batch_stats"}}, x, true);
      return std::make_pair(mean(nn::softmax_cross_entropy_with_integer_labels(logits, labels)), updated);
    };
    auto [value, updated, grads] = value_and_grad(loss)(params);
    if (step == 0) first_train_loss = value.item();
    last_train_loss = value.item();
    batch_stats = updated.at("batch_stats");
    auto [updates, state] = opt.update(grads, opt_state, params);
    params = optim::apply_updates(params, updates);
    opt_state = state;
  }
  MESSAGE("CNN train loss " << first_train_loss << " -> " << last_train_loss);
  CHECK(last_train_loss < 0.2f * first_train_loss);
  // The running statistics moved away from their initial (0, 1).
  CHECK(batch_stats.at_path("BatchNorm_0/mean").array().to_vector() != std::vector<float>(8, 0.0f));
  // Evaluation with the running averages generalises to fresh images.
  const float test_loss = eval_loss(params, batch_stats, x_test, labels_test);
  MESSAGE("CNN test loss (running averages) " << test_loss);
  CHECK(test_loss < 0.3f);
}
