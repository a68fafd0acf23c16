// A first Linum program: a two-layer MLP learns to classify points of three interleaved spirals,
// trained with value_and_grad and plain SGD. It shows the core pieces (arrays, ops, autodiff, the
// memory accounting) before modules and remat arrive on top of them.
#include <linum/linum.hpp>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

using namespace linum;

namespace {

// Three spirals of `per_class` points each: inputs [N, 2], int32 labels [N].
std::pair<Array, Array> spirals(int per_class, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> noise(0.0f, 0.15f);
  const int n = 3 * per_class;
  Array x = Array::empty(Shape{n, 2});
  Array y = Array::empty(Shape{n}, DType::i32);
  for (int c = 0; c < 3; ++c)
    for (int i = 0; i < per_class; ++i) {
      const float r = static_cast<float>(i) / per_class;
      const float t = 4.0f * r + 2.094f * c + noise(gen);
      const int k = c * per_class + i;
      x.mutable_data()[2 * k] = r * std::cos(t);
      x.mutable_data()[2 * k + 1] = r * std::sin(t);
      y.mutable_data_i32()[k] = c;
    }
  return {x, y};
}

Array init_weight(const Shape& shape, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f / std::sqrt(static_cast<float>(shape[0])));
  Array w = Array::empty(shape);
  for (std::int64_t i = 0; i < w.numel(); ++i) w.mutable_data()[i] = dist(gen);
  return w;
}

Array forward(const std::vector<Array>& p, const Array& x) {
  Array h = gelu(matmul(x, p[0]) + p[1]);
  return matmul(h, p[2]) + p[3];
}

// Mean softmax cross-entropy with integer labels.
Array loss_fn(const std::vector<Array>& p, const Array& x, const Array& labels) {
  Array logp = log_softmax(forward(p, x));
  return -mean(sum(logp * one_hot(labels, 3), {-1}));
}

}  // namespace

int main() {
  auto [x, labels] = spirals(200, 0);
  const int hidden = 64;
  std::vector<Array> params = {init_weight(Shape{2, hidden}, 1), Array::zeros(Shape{hidden}),
                               init_weight(Shape{hidden, 3}, 2), Array::zeros(Shape{3})};
  auto step = value_and_grad(loss_fn);
  const float lr = 0.5f;
  for (int epoch = 0; epoch <= 600; ++epoch) {
    memory::PeakScope scope;
    auto [loss, grads] = step(params, x, labels);
    for (std::size_t i = 0; i < params.size(); ++i) params[i] = params[i] - lr * grads[i];
    if (epoch % 100 == 0) {
      Array predicted = argmax(forward(params, x), -1);
      const Array hits = equal(astype(predicted, DType::f32), astype(labels, DType::f32));
      std::printf("epoch %3d  loss %.4f  accuracy %.3f  peak step memory %lld bytes\n", epoch, loss.item(),
                  mean(hits).item(), static_cast<long long>(scope.peak_growth()));
    }
  }
  return 0;
}
