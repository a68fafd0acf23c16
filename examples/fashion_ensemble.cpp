// An ensemble of MLPs learns Fashion-MNIST at once: one lift::vmap (Flax's nn.vmap) holds 8 members,
// each with its own initialization and dropout keys, their parameters stacked on a leading axis;
// every training step runs all members in one batched call, and their mean prediction is the
// ensemble's.
//
//   fashion_ensemble [--members 8] [--epochs 3] [--hidden 256] [--batch 128] [--lr 0.001]
//                    [--dropout 0.2] [--limit N] [--seed 0] [--data DIR] [--synthetic N]
//
// --synthetic N trains on N generated images (examples/fashion_data.hpp) instead of the dataset.
//
// Prints each member's test accuracy, their mean and spread, and the ensemble's accuracy; the last
// line is one JSON object for scripts.
#include <linum/linum.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "flags.hpp"
#include "fashion_data.hpp"

using namespace linum;

namespace {

// One member: Flatten -> Dense(hidden) -> ReLU -> Dropout -> Dense(10).
struct Mlp {
  std::int64_t hidden = 256;
  double dropout = 0.2;
  Array operator()(Scope& s, const Array& images, bool train) const {
    Array h = reshape(images, {images.dim(0), -1});
    h = relu(s(nn::Dense{.features = hidden}, h));
    h = s(nn::Dropout{.rate = dropout}, h, /*deterministic=*/!train);
    return s(nn::Dense{.features = 10}, h);
  }
};

// The members side by side: params/VmapMlp_0/Dense_0/kernel is [members, 784, hidden]. Every member
// sees the same images (in_axes nullopt) and returns its own logits: [members, batch, 10].
struct Ensemble {
  std::int64_t members = 8;
  Mlp member;
  Array operator()(Scope& s, const Array& images, bool train) const {
    return s(lift::vmap<Mlp>{.body = member,
                             .variable_axes = {{"params", 0}},
                             .split_rngs = {{"params", true}, {"dropout", true}},
                             .in_axes = {std::nullopt, std::nullopt},
                             .axis_size = members},
             images, train);
  }
};

Array cross_entropy(const Array& logits, const Array& labels) {
  return mean(nn::softmax_cross_entropy_with_integer_labels(logits, labels));
}

double since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

int main(int argc, char** argv) {
  std::int64_t members = 8, hidden = 256, batch = 128;
  int epochs = 3;
  double lr = 1e-3, dropout = 0.2;
  examples::DataFlags data;
  const examples::Flags flags("fashion_ensemble",
                              "usage: fashion_ensemble [--members 8] [--epochs 3] [--hidden 256] [--batch 128] [--lr 0.001]\n"
                              "                        [--dropout 0.2] [--limit N] [--seed 0] [--data DIR] [--synthetic N]");
  flags.parse(argc, argv, [&](const std::string& name, const std::string& value) {
    if (name == "--members") members = static_cast<std::int64_t>(flags.number(name, value, 1, 256));
    else if (name == "--epochs") epochs = static_cast<int>(flags.number(name, value, 0, 1000));
    else if (name == "--hidden") hidden = static_cast<std::int64_t>(flags.number(name, value, 1, 1 << 14));
    else if (name == "--batch") batch = static_cast<std::int64_t>(flags.number(name, value, 1, 1 << 16));
    else if (name == "--lr") lr = flags.number(name, value, 1e-8, 10);
    else if (name == "--dropout") dropout = flags.number(name, value, 0, 0.99);
    else return data.parse(flags, name, value);
    return true;
  });
  try {
    auto [train, test] = data.load();
    const int seed = data.seed;
    batch = std::min<std::int64_t>(batch, train.size());
    const Ensemble model{.members = members, .member = {.hidden = hidden, .dropout = dropout}};
    const Array sample = slice_axis(train.columns().at("image").array(), 0, 0, batch);
    Tree params = init(model, rng::Streams{{"params", rng::key(seed)}}, sample, false).at("params");
    std::printf("%lld members, each Dense %lld -> ReLU -> Dropout %.2f -> Dense 10; params %s\n",
                static_cast<long long>(members), static_cast<long long>(hidden), dropout,
                params.at_path("VmapMlp_0/Dense_0/kernel").array().type_str().c_str());
    const optim::GradientTransformation optimizer = optim::adam(lr);
    Tree opt_state = optimizer.init(params);

    // Every member's mean loss, summed: each member's gradient is that of its own loss. The members'
    // losses come back as the aux output.
    auto loss_fn = [&](const Tree& p, const Array& images, const Array& labels, rng::Key key) {
      const Array logits = apply(model, Tree{{"params", p}}, {.rngs = {{"dropout", key}}}, images, true);
      const Array losses = vmap(cross_entropy, {.in_axes = {0, std::nullopt}})(logits, labels);
      return std::make_pair(sum(losses), losses);
    };
    std::vector<double> member_losses(static_cast<std::size_t>(members), 0.0);
    datasets::DataLoader loader(train, {.batch_size = batch, .seed = rng::key(seed), .drop_remainder = true, .num_epochs = epochs});
    double train_seconds = 0;
    std::int64_t steps = 0;
    for (int epoch = 0; epoch < epochs; ++epoch) {
      const auto start = std::chrono::steady_clock::now();
      double loss_sum = 0;
      for (std::int64_t k = 0; k < loader.batches_per_epoch(); ++k) {
        const datasets::Batch b = *loader.next();
        const rng::Key key = rng::fold_in(rng::key(seed + 1), static_cast<std::uint32_t>(steps));
        auto [loss, losses, grads] = value_and_grad(loss_fn)(params, b.data.at("image").array(), b.data.at("label").array(), key);
        if (epoch == epochs - 1)
          for (std::int64_t e = 0; e < members; ++e) member_losses[static_cast<std::size_t>(e)] += losses.data()[e];
        // update() and apply_updates() in one call: adam runs it as one pass per leaf, in the moved-in
        // buffers when nothing else holds them.
        auto [next_params, next_state] = optimizer.step(std::move(params), grads, std::move(opt_state));
        params = std::move(next_params);
        opt_state = std::move(next_state);
        loss_sum += loss.item() / static_cast<double>(members);
        ++steps;
      }
      const double seconds = since(start);
      train_seconds += seconds;
      std::printf("epoch %d/%d  mean member loss %.4f  %.1f s\n", epoch + 1, epochs,
                  loss_sum / static_cast<double>(std::max<std::int64_t>(loader.batches_per_epoch(), 1)), seconds);
    }

    // Test accuracy of every member and of the ensemble (the members' mean probabilities).
    autodiff::NoGradGuard no_grad;
    std::vector<std::int64_t> hits(static_cast<std::size_t>(members), 0);
    std::int64_t ensemble_hits = 0;
    datasets::DataLoader batches(test, {.batch_size = 500, .shuffle = false});
    for (const datasets::Batch& b : batches) {
      const Array logits = apply(model, Tree{{"params", params}}, b.data.at("image").array(), false);  // [members, n, 10]
      const Array labels = b.data.at("label").array();
      const Array predicted = argmax(logits, -1);                                                  // [members, n]
      const Array voted = argmax(mean(softmax(logits), {0}), -1);                                  // [n]
      const std::int64_t n = labels.numel();
      for (std::int64_t e = 0; e < members; ++e)
        for (std::int64_t i = 0; i < n; ++i) hits[static_cast<std::size_t>(e)] += predicted.data_i32()[e * n + i] == labels.data_i32()[i];
      for (std::int64_t i = 0; i < n; ++i) ensemble_hits += voted.data_i32()[i] == labels.data_i32()[i];
    }
    std::vector<double> accuracy;
    for (std::int64_t h : hits) accuracy.push_back(static_cast<double>(h) / static_cast<double>(test.size()));
    double mean_acc = 0;
    for (double a : accuracy) mean_acc += a / static_cast<double>(accuracy.size());
    double var = 0;
    for (double a : accuracy) var += (a - mean_acc) * (a - mean_acc) / static_cast<double>(accuracy.size());
    const auto [lo, hi] = std::minmax_element(accuracy.begin(), accuracy.end());
    const double ensemble_accuracy = static_cast<double>(ensemble_hits) / static_cast<double>(test.size());
    std::printf("member test accuracies:");
    for (double a : accuracy) std::printf(" %.4f", a);
    std::printf("\nmean %.4f, std %.4f, range %.4f..%.4f; the ensemble's mean prediction: %.4f\n", mean_acc, std::sqrt(var), *lo,
                *hi, ensemble_accuracy);
    const nlohmann::json result = {{"members", members},
                                   {"epochs", epochs},
                                   {"member_accuracies", accuracy},
                                   {"mean_accuracy", mean_acc},
                                   {"std_accuracy", std::sqrt(var)},
                                   {"min_accuracy", *lo},
                                   {"max_accuracy", *hi},
                                   {"ensemble_accuracy", ensemble_accuracy},
                                   {"member_last_epoch_train_loss_sums", member_losses},
                                   {"step_s", steps ? train_seconds / static_cast<double>(steps) : 0.0}};
    std::printf("%s\n", result.dump().c_str());
  } catch (const linum::Error& e) {
    std::fprintf(stderr, "fashion_ensemble: %s\n", e.what());
    return 1;
  }
  return 0;
}
