// Fuzz target: module configurations (nn::module_from_config) of every standard layer, then the
// layer itself: init and a differentiated apply on a small input.
// The first byte picks the layer type; the rest is the JSON text. Properties: a config a layer
// cannot hold is refused with linum::Error only (no narrowing, no crash); one it accepts writes back
// to the same JSON; the layer then either runs or refuses its input with a linum::Error (shapes it
// cannot take, sizes above the live-byte cap), never undefined behaviour.
#include "fuzz_common.hpp"

#include <linum/linum.hpp>
#include <linum/nn/config.hpp>

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>

namespace {

using namespace linum;

template <class M, class... Inputs>
void exercise(const nlohmann::json& config, const Inputs&... inputs) {
  std::optional<M> parsed;  // (Sequential has no default constructor)
  try {
    parsed.emplace(nn::module_from_config<M>(config));
  } catch (const Error&) {
    return;
  }
  const M& module = *parsed;
  const nlohmann::json written = nn::module_config(module);
  if (nn::module_config(nn::module_from_config<M>(written)) != written)
    linum::fuzz::fail("module_config -> module_from_config -> module_config changed the config");
  try {
    const ApplyOptions options{.rngs = {{"dropout", rng::key(1)}}, .mutable_collections = {"batch_stats"}};
    const Tree variables = init(module, rng::Streams{{"params", rng::key(0)}, {"dropout", rng::key(2)}}, inputs...);
    auto loss = [&](const Tree& params) {
      Tree vars = variables;
      vars.set("params", params);
      return sum(apply(module, vars, options, inputs...).first);
    };
    if (variables.contains("params")) value_and_grad(loss)(variables.at("params"));
    else apply(module, variables, options, inputs...);
  } catch (const Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  memory::LiveLimitScope cap(linum::fuzz::kLiveLimitBytes);
  const auto config = nlohmann::json::parse(data + 1, data + size, nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded()) return 0;
  const Array x = rng::normal(rng::key(3), Shape{2, 3, 8});
  const Array image = rng::normal(rng::key(4), Shape{1, 6, 6, 4});
  const Array ids = Array::from_i32(Shape{2, 3}, {0, 1, 2, 2, 1, 0});
  switch (data[0] % 11) {
    case 0: exercise<nn::Dense>(config, x); break;
    case 1: exercise<nn::DenseGeneral>(config, x); break;
    case 2: exercise<nn::Conv>(config, image); break;
    case 3: exercise<nn::Embed>(config, ids); break;
    case 4: exercise<nn::LayerNorm>(config, x); break;
    case 5: exercise<nn::RMSNorm>(config, x); break;
    case 6: exercise<nn::GroupNorm>(config, x); break;
    case 7: exercise<nn::BatchNorm>(config, x); break;
    case 8: exercise<nn::Dropout>(config, x); break;
    case 9: exercise<nn::MultiHeadDotProductAttention>(config, x); break;
    case 10: exercise<nn::Sequential<nn::Dense, nn::LayerNorm, nn::Dense>>(config, x); break;
  }
  return 0;
}
