// PyTorch weights into Linum layers: each torch_layouts map, applied to a state dict PyTorch 2.13
// saved as safetensors (tests/oracles/make_torch_fixtures.py), gives the Linum layer that computes
// PyTorch's outputs within 1e-5. (A whole model saved by PyTorch runs in examples/from_pytorch.cpp,
// which the suite runs as example_from_pytorch.)
#include <doctest/doctest.h>
#include <linum/linum.hpp>

#include "testing/errors.hpp"
#include "testing/gradcheck.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>

using namespace linum;
namespace tl = linum::torch_layouts;

namespace {

const Tree& fixture() {
  static const Tree t =
      safetensors::load(std::filesystem::path(LINUM_ORACLE_DIR) / "torch_layers.safetensors").tensors;
  return t;
}

const Array& tensor(const std::string& name) { return fixture().at(name).array(); }

// |got - want| <= 1e-5 (1 + |want|) everywhere.
void check_close(const std::string& what, const Array& got, const Array& want) {
  INFO(what);
  REQUIRE(got.shape() == want.shape());
  const std::vector<float> g = got.to_vector(), w = want.to_vector();
  double worst = 0;
  for (std::size_t i = 0; i < g.size(); ++i) worst = std::max(worst, std::abs(double(g[i]) - w[i]) / (1.0 + std::abs(double(w[i]))));
  INFO("largest |got - want| / (1 + |want|) = " << worst);
  MESSAGE(what << ": largest |got - want| / (1 + |want|) = " << worst);
  CHECK(worst <= 1e-5);
}

template <class M>
void check_layer(const std::string& name, const M& layer, const Tree& variables) {
  CAPTURE(name);
  const Array y = apply(layer, variables, tensor(name + ".__x"));
  check_close(name, y, tensor(name + ".__y"));
}

Tree nested_params(const char* key, const Tree& variables) { return Tree{{"params", Tree{{key, variables.at("params")}}}}; }

}  // namespace

TEST_CASE("torch_layouts: each PyTorch layer's weights give a Linum layer with PyTorch's outputs") {
  const Tree& sd = fixture();
  check_layer("linear", nn::Dense{.features = 3}, tl::linear(sd, "linear"));
  check_layer("conv2d", nn::Conv{.features = 6, .kernel_size = {3, 3}, .strides = {2, 2}, .padding = 1, .feature_group_count = 3},
              tl::conv2d(sd, "conv2d"));
  check_layer("conv2d_dilated",
              nn::Conv{.features = 4, .kernel_size = {3, 2}, .padding = {{2, 2}, {1, 1}}, .kernel_dilation = {2, 1}, .use_bias = false},
              tl::conv2d(sd, "conv2d_dilated"));
  // ConvTranspose2d(k 3, stride 2, padding 1, output_padding 1): pairs (d(k-1) - p, d(k-1) - p + q) = (1, 2).
  check_layer("conv_transpose2d",
              nn::ConvTranspose{.features = 4, .kernel_size = {3, 3}, .strides = {2, 2}, .padding = {{1, 2}, {1, 2}},
                                .transpose_kernel = true},
              tl::conv_transpose2d(sd, "conv_transpose2d"));
  check_layer("layer_norm", nn::LayerNorm{.epsilon = 1e-5}, tl::layer_norm(sd, "layer_norm"));
  check_layer("group_norm", nn::GroupNorm{.num_groups = 3, .epsilon = 1e-5}, tl::group_norm(sd, "group_norm"));
  check_layer("batch_norm", nn::BatchNorm{.use_running_average = true}, tl::batch_norm(sd, "batch_norm"));
  check_layer("embedding", nn::Embed{.num_embeddings = 10, .features = 4}, tl::embedding(sd, "embedding"));
  check_layer("lstm", nn::RNN<nn::LSTMCell>{.cell = {.features = 5}}, nested_params("cell", tl::lstm(sd, "lstm")));
  check_layer("lstm", nn::RNN<nn::OptimizedLSTMCell>{.cell = {.features = 5}}, nested_params("cell", tl::lstm(sd, "lstm")));
  check_layer("gru", nn::RNN<nn::GRUCell>{.cell = {.features = 5}}, nested_params("cell", tl::gru(sd, "gru")));
  check_layer("mha", nn::MultiHeadDotProductAttention{.num_heads = 2}, tl::multihead_attention(sd, "mha", 2));
}

TEST_CASE("torch_layouts: a missing or misshapen tensor is an error naming it") {
  const Tree& sd = fixture();
  using linum::testing::contains;
  using linum::testing::error_of;
  CHECK(contains(error_of<ValueError>([&] { tl::linear(sd, "nope"); }), "no tensor 'nope.weight'"));
  CHECK(contains(error_of<ValueError>([&] { tl::conv2d(sd, "linear"); }), "'linear.weight' has shape"));
  CHECK(contains(error_of<ValueError>([&] { tl::lstm(sd, "gru"); }), "are not four gates"));
  CHECK(contains(error_of<ValueError>([&] { tl::multihead_attention(sd, "mha", 3); }), "not divisible by num_heads 3"));
}
