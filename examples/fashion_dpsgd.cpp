// Differentially private training (DP-SGD, Abadi et al. 2016) of a small CNN on
// Fashion-MNIST: every example's gradient is computed on its own (vmap of grad: per-example
// gradients in one batched call, through the model's rematerialized blocks), clipped to an L2 norm,
// and the clipped gradients are summed with Gaussian noise (optim::dpsgd, optax's dpsgd).
//
//   fashion_dpsgd [--epochs 1] [--batch 256] [--lr 0.25] [--momentum 0.9] [--clip 1.5] [--noise 1.1]
//                 [--limit N] [--seed 0] [--data DIR] [--synthetic N]
//
// The CNN (fashion::CNN, examples/fashion_mnist/model.hpp: two conv blocks and a dense head, Flax's
// MNIST example) has no BatchNorm (batch statistics mix the examples, which per-example clipping
// must not). --noise 0 --clip 1e9 is plain SGD on the same gradients.
// The last line is one JSON object for scripts.
#include <linum/linum.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>

#include "fashion_mnist/model.hpp"
#include "flags.hpp"
#include "fashion_data.hpp"

using namespace linum;

namespace {

double since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

int main(int argc, char** argv) {
  std::int64_t batch = 256;
  int epochs = 1;
  double lr = 0.25, momentum = 0.9, clip = 1.5, noise = 1.1;
  examples::DataFlags data;
  const examples::Flags flags("fashion_dpsgd",
                              "usage: fashion_dpsgd [--epochs 1] [--batch 256] [--lr 0.25] [--momentum 0.9] [--clip 1.5] [--noise 1.1]\n"
                              "                     [--limit N] [--seed 0] [--data DIR] [--synthetic N]");
  flags.parse(argc, argv, [&](const std::string& name, const std::string& value) {
    if (name == "--epochs") epochs = static_cast<int>(flags.number(name, value, 0, 1000));
    else if (name == "--batch") batch = static_cast<std::int64_t>(flags.number(name, value, 1, 1 << 14));
    else if (name == "--lr") lr = flags.number(name, value, 1e-8, 100);
    else if (name == "--momentum") momentum = flags.number(name, value, 0, 0.999);
    else if (name == "--clip") clip = flags.number(name, value, 1e-6, 1e12);
    else if (name == "--noise") noise = flags.number(name, value, 0, 100);
    else return data.parse(flags, name, value);
    return true;
  });
  try {
    auto [train, test] = data.load();
    const int seed = data.seed;
    batch = std::min<std::int64_t>(batch, train.size());
    const fashion::CNN model{.remat = fashion::Remat::full};
    const Array sample = slice_axis(train.columns().at("image").array(), 0, 0, batch);
    Tree params = init(model, rng::key(seed), sample, false).at("params");
    const optim::GradientTransformation optimizer = optim::dpsgd(lr, clip, noise, seed, momentum);
    Tree opt_state = optimizer.init(params);

    // One example's loss: the model sees a batch of one.
    auto example_loss = [&](const Tree& p, const Array& image, const Array& label) {
      const Array logits = apply(model, Tree{{"params", p}}, expand_dims(image, 0), true);
      return mean(nn::softmax_cross_entropy_with_integer_labels(logits, expand_dims(label, 0)));
    };
    // Every example's gradient at once: each leaf gets a leading batch axis.
    const auto per_example_grads = vmap(value_and_grad(example_loss), {.in_axes = {std::nullopt, 0, 0}});
    std::printf("DP-SGD on %lld images, batch %lld: per-example gradients clipped to %.3g, noise %.3g x clip; %s\n",
                static_cast<long long>(train.size()), static_cast<long long>(batch), clip, noise,
                data.synthetic ? "generated images" : data.dir.c_str());
    datasets::DataLoader loader(train, {.batch_size = batch, .seed = rng::key(seed), .drop_remainder = true, .num_epochs = epochs});
    double train_seconds = 0, last_loss = 0;
    std::int64_t steps = 0;
    for (int epoch = 0; epoch < epochs; ++epoch) {
      const auto start = std::chrono::steady_clock::now();
      double loss_sum = 0;
      for (std::int64_t k = 0; k < loader.batches_per_epoch(); ++k) {
        const datasets::Batch b = *loader.next();
        auto [losses, grads] = per_example_grads(params, b.data.at("image").array(), b.data.at("label").array());
        auto [updates, state] = optimizer.update(grads, opt_state, params);
        params = optim::apply_updates(params, updates);
        opt_state = state;
        loss_sum += mean(losses).item();
        ++steps;
      }
      const double seconds = since(start);
      train_seconds += seconds;
      last_loss = loss_sum / static_cast<double>(std::max<std::int64_t>(loader.batches_per_epoch(), 1));
      std::printf("epoch %d/%d  mean loss %.4f  %.1f s\n", epoch + 1, epochs, last_loss, seconds);
    }
    autodiff::NoGradGuard no_grad;
    std::int64_t hits = 0;
    datasets::DataLoader batches(test, {.batch_size = 500, .shuffle = false});
    for (const datasets::Batch& b : batches) {
      const Array predicted = argmax(apply(model, Tree{{"params", params}}, b.data.at("image").array(), false), -1);
      const Array& labels = b.data.at("label").array();
      for (std::int64_t i = 0; i < labels.numel(); ++i) hits += predicted.data_i32()[i] == labels.data_i32()[i];
    }
    const double accuracy = static_cast<double>(hits) / static_cast<double>(test.size());
    std::printf("test accuracy %.4f\n", accuracy);
    const nlohmann::json result = {{"test_accuracy", accuracy}, {"epochs", epochs},     {"batch", batch},
                                   {"clip", clip},              {"noise", noise},       {"final_train_loss", last_loss},
                                   {"step_s", steps ? train_seconds / static_cast<double>(steps) : 0.0}};
    std::printf("%s\n", result.dump().c_str());
  } catch (const linum::Error& e) {
    std::fprintf(stderr, "fashion_dpsgd: %s\n", e.what());
    return 1;
  }
  return 0;
}
