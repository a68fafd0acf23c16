// A tour of Linum's remat, in the order a user meets it. Compiled and run by the test suite; the
// README quotes it.
#include <linum/linum.hpp>

#include <iostream>

using namespace linum;

// 1. A compact module: a plain struct of hyperparameters with an operator() taking a Scope.
struct Block {
  std::int64_t width = 64;
  double dropout = 0.1;
  Array operator()(Scope& s, const Array& x, bool train) const {
    Array h = gelu(s(nn::Dense{.features = 4 * width}, x));          // child "Dense_0"
    h = s(nn::Dropout{.rate = dropout}, h, /*deterministic=*/!train);
    return x + s(nn::Dense{.features = width}, h);                  // child "Dense_1"
  }
};

// 2. remat<Block> has Block's fields and name; only its inputs are kept in the forward pass.
template <class B>
struct Model {
  int depth = 8;
  Array operator()(Scope& s, Array x, bool train) const {
    for (int i = 0; i < depth; ++i) x = s(B{}, x, train);  // Block_0 .. Block_7 either way
    return s("head", nn::Dense{.features = 10}, x);
  }
};
using Plain = Model<Block>;
using Rematted = Model<lift::remat<Block>>;
using DotsSaved = Model<lift::remat<Block, lift::policy<policies::dots_saveable>>>;

// 3. Methods: only the listed ones are checkpointed. Each call of a method names its children
//    afresh, so methods sharing a scope give their children explicit names.
struct Encoder {
  Array encode(Scope& s, const Array& x) const { return tanh(s("to_code", nn::Dense{.features = 8}, x)); }
  Array decode(Scope& s, const Array& z) const { return s("from_code", nn::Dense{.features = 4}, z); }
};
using LiftedEncoder = lift::remat<Encoder, lift::methods<&Encoder::encode>>;

int main() {
  const Array x = rng::normal(rng::key(42), Shape{512, 64});  // a batch large enough for activations to dominate

  // init -> variable dict; the same dict serves the plain and the rematted model.
  Tree vars = init(Plain{}, rng::Streams{{"params", rng::key(0)}, {"dropout", rng::key(1)}}, x, false);
  std::cout << "params: " << param_count(vars.at("params")) << " in " << vars.at("params").keys().size()
            << " modules; identical init for remat: " << bitwise_equal(vars, init(Rematted{}, rng::key(0), x, false)) << "\n";

  // apply + value_and_grad: the rematted model's loss and gradients equal the plain model's, bit for bit.
  auto loss_of = [&](auto model) {
    return value_and_grad([&, model](const Tree& params) {
      Array y = apply(model, Tree{{"params", params}}, {.rngs = {{"dropout", rng::key(2)}}}, x, true);
      return mean(square(y));
    })(vars.at("params"));
  };
  auto [loss_plain, grads_plain] = loss_of(Plain{});
  auto [loss_remat, grads_remat] = loss_of(Rematted{});
  std::cout << "loss " << loss_plain.item() << "; remat gradients bitwise equal: " << bitwise_equal(grads_plain, grads_remat)
            << "\n";

  // How much memory a training step needs, measured with the exact accounting.
  auto peak = [&](auto model) {
    memory::PeakScope scope;
    auto [value, grads] = loss_of(model);
    return scope.peak_growth() - byte_count(grads);
  };
  std::cout << "peak activation bytes: plain " << peak(Plain{}) << ", remat " << peak(Rematted{}) << ", dots_saveable "
            << peak(DotsSaved{}) << "\n";

  // What a policy keeps: saved_residuals lists the values held for the backward pass.
  auto block_fn = [](const Array& x, const Array& w1, const Array& w2) { return x + matmul(gelu(matmul(x, w1)), w2); };
  const Array w1 = rng::normal(rng::key(3), Shape{64, 256}), w2 = rng::normal(rng::key(4), Shape{256, 64});
  std::cout << "residuals of the plain block:\n" << lift::print_saved_residuals(block_fn, x, w1, w2);
  std::cout << "residuals with checkpoint(dots_saveable):\n"
            << lift::print_saved_residuals(checkpoint(block_fn, {.policy = policies::dots_saveable{}}), x, w1, w2);

  // Lifted methods: encode runs checkpointed, decode plainly; both share the "enc" scope.
  struct Codec {
    Array operator()(Scope& s, const Array& x) const {
      Array z = s.call("enc", &Encoder::encode, LiftedEncoder{}, x);
      return s.call("enc", &Encoder::decode, LiftedEncoder{}, z);
    }
  };
  Tree codec = init(Codec{}, rng::key(5), x);
  lift::reset_recompute_stats();
  grad([&](const Tree& p) { return sum(apply(Codec{}, Tree{{"params", p}}, x)); })(codec.at("params"));
  std::cout << "codec params " << flatten(codec.at("params")).size() << " arrays; recomputed blocks: "
            << lift::recompute_stats().recomputations << " (encode only)\n";
  return bitwise_equal(grads_plain, grads_remat) ? 0 : 1;
}
