// A convolutional autoencoder on Fashion-MNIST: two strided convolutions down to 7 x 7 x 32, two
// transposed convolutions (nn::ConvTranspose) back up to 28 x 28, trained on reconstruction error
// with batches from linum::datasets's loader. It prints the test reconstruction error before and after
// training, writes originals above their reconstructions as a PGM image, and ends with a JSON line.
//
//   fashion_autoencoder [--data DIR] [--steps 600] [--batch 64] [--lr 0.002] [--seed 0]
//                       [--image FILE.pgm] [--synthetic N]
//
// --synthetic N trains on N generated images (a bright band whose row depends on the class) instead
// of the dataset, for machines without dataset-fashion-mnist.
#include "flags.hpp"
#include "fashion_data.hpp"

#include <linum/linum.hpp>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

using namespace linum;

struct Autoencoder {
  // images [N, 28, 28, 1] in [0, 1] -> reconstructions, the same shape
  Array operator()(Scope& s, const Array& images) const {
    Array h = relu(s(nn::Conv{.features = 16, .kernel_size = {3, 3}, .strides = {2, 2}}, images));  // 14 x 14
    h = relu(s(nn::Conv{.features = 32, .kernel_size = {3, 3}, .strides = {2, 2}}, h));            // 7 x 7
    h = relu(s(nn::ConvTranspose{.features = 16, .kernel_size = {3, 3}, .strides = {2, 2}}, h));   // 14 x 14
    return sigmoid(s(nn::ConvTranspose{.features = 1, .kernel_size = {3, 3}, .strides = {2, 2}}, h));  // 28 x 28
  }
};

struct Options {
  std::string data = "/usr/share/datasets/fashion-mnist";
  long steps = 600, batch = 64, synthetic = 0;
  double lr = 2e-3;
  int seed = 0;
  std::string image = "fashion_autoencoder.pgm";
};

const examples::Flags flags("fashion_autoencoder",
                            "usage: fashion_autoencoder [--data DIR] [--steps N] [--batch N] [--lr X] [--seed N] [--image FILE.pgm]\n"
                            "                           [--synthetic N]");

Options parse(int argc, char** argv) {
  Options o;
  flags.parse(argc, argv, [&](const std::string& a, const std::string& v) {
    auto number = [&](double lo, double hi) { return flags.number(a, v, lo, hi); };
    if (a == "--data") o.data = v;
    else if (a == "--steps") o.steps = static_cast<long>(number(0, 1e7));
    else if (a == "--batch") o.batch = static_cast<long>(number(1, 1 << 16));
    else if (a == "--lr") o.lr = number(1e-8, 10);
    else if (a == "--seed") o.seed = static_cast<int>(number(0, 1 << 30));
    else if (a == "--image") o.image = v;
    else if (a == "--synthetic") o.synthetic = static_cast<long>(number(16, 1 << 20));
    else return false;
    return true;
  });
  return o;
}


float mse(const Array& a, const Array& b) { return mean(square(a - b)).item(); }

// Originals (top row) above their reconstructions (bottom row), 8 of each, as an 8-bit PGM.
void write_pgm(const std::string& path, const Array& originals, const Array& reconstructions) {
  const std::int64_t n = originals.dim(0), w = 28 * n, h = 56;
  std::string out = "P5\n" + std::to_string(w) + " " + std::to_string(h) + "\n255\n";
  const std::vector<float> top = originals.to_vector(), bottom = reconstructions.to_vector();
  for (std::int64_t y = 0; y < h; ++y)
    for (std::int64_t x = 0; x < w; ++x) {
      const std::vector<float>& src = y < 28 ? top : bottom;
      const float v = src[static_cast<std::size_t>(((x / 28) * 28 + y % 28) * 28 + x % 28)];
      out.push_back(static_cast<char>(static_cast<unsigned char>(std::min(1.0f, std::max(0.0f, v)) * 255.0f + 0.5f)));
    }
  serialization::write_file_atomic(path, std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(out.data()), out.size()));
}

int run(const Options& o) {
  datasets::ArrayDataset train, test;
  if (o.synthetic > 0) {
    train = examples::synthetic(o.synthetic, 1);
    test = examples::synthetic(256, 2);
  } else {
    try {
      train = datasets::load_mnist(o.data, "train");
      test = datasets::load_mnist(o.data, "t10k").slice(0, 1000);
    } catch (const IoError& e) {
      throw IoError(std::string(e.what()) +
                    "\nInstall the dataset with `apt-get install dataset-fashion-mnist`, pass --data DIR, or use --synthetic N");
    }
  }
  std::printf("%lld training images, %lld test images\n", static_cast<long long>(train.size()),
              static_cast<long long>(test.size()));
  const Autoencoder model;
  const Array test_images = test.columns().at("image").array();
  Tree params = init(model, rng::key(o.seed), slice_axis(test_images, 0, 0, 1)).at("params");
  auto test_error = [&] {
    autodiff::NoGradGuard no_grad;
    return mse(apply(model, Tree{{"params", params}}, test_images), test_images);
  };
  const float before = test_error();
  const auto opt = optim::adam(o.lr);
  Tree state = opt.init(params);
  // As many epochs as the steps need; the loader shuffles each one with its own key.
  const std::int64_t per_epoch = std::max<std::int64_t>(1, train.size() / o.batch);
  datasets::DataLoader loader(train, {.batch_size = std::min<std::int64_t>(o.batch, train.size()), .seed = rng::key(o.seed),
                                  .drop_remainder = true, .num_epochs = (o.steps + per_epoch - 1) / per_epoch + 1});
  const auto start = std::chrono::steady_clock::now();
  float last = 0;
  for (long step = 0; step < o.steps; ++step) {
    const datasets::Batch b = *loader.next();
    const Array& x = b.data.at("image").array();
    auto [loss, grads] = value_and_grad([&](const Tree& p) { return mean(square(apply(model, Tree{{"params", p}}, x) - x)); })(params);
    auto [p2, s2] = opt.step(std::move(params), grads, std::move(state));
    params = std::move(p2);
    state = std::move(s2);
    last = loss.item();
    if ((step + 1) % std::max<long>(1, o.steps / 5) == 0 || step + 1 == o.steps)
      std::printf("step %ld/%ld (epoch %lld) train reconstruction error %.5f\n", step + 1, o.steps,
                  static_cast<long long>(b.epoch + 1), last);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const float after = test_error();
  std::printf("test reconstruction error (mean squared, pixels in [0, 1]): %.5f before training, %.5f after\n", before, after);
  {
    autodiff::NoGradGuard no_grad;
    const Array originals = slice_axis(test_images, 0, 0, 8);
    write_pgm(o.image, originals, apply(model, Tree{{"params", params}}, originals));
    std::printf("wrote 8 test images (top) and their reconstructions (bottom) to '%s'\n", o.image.c_str());
  }
  const nlohmann::json result = {{"steps", o.steps},
                                 {"test_mse_before", before},
                                 {"test_mse_after", after},
                                 {"train_mse_last", last},
                                 {"seconds", seconds}};
  std::printf("%s\n", result.dump().c_str());
  return 0;
}

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  try {
    return run(o);
  } catch (const linum::Error& e) {
    std::cerr << "fashion_autoencoder: " << e.what() << "\n";
    return 1;
  }
}
