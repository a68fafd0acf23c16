// The bad-input matrix: one test per row of issue 14's list of defects (and rows of our own below),
// each asserting the exception type and the words a user needs to fix the input: the module path,
// the op, the shapes. Deeper tests of each row live with their area (test_remat_scope, test_ops_values,
// test_layers, test_optim, test_scope, test_tree, test_autodiff); the fuzz targets (tests/fuzz/)
// throw random input at the same loaders.
#include <doctest/doctest.h>
#include <linum/linum.hpp>
#include <linum/nn/config.hpp>

#include "testing/errors.hpp"
#include "testing/gradcheck.hpp"

#include <cmath>
#include <csignal>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

using namespace linum;
using linum::testing::contains;
using linum::testing::error_of;
using linum::testing::random_array;
namespace fs = std::filesystem;

namespace {

struct TwoLayers {
  int hidden = 8;
  Array operator()(Scope& s, const Array& x) const {
    return s(nn::Dense{.features = 2}, gelu(s(nn::Dense{.features = hidden}, x)));
  }
};

Tree grads_of(const Tree& vars, const Array& x) {
  return value_and_grad([&](const Tree& p) { return sum(apply(TwoLayers{}, Tree{{"params", p}}, x)); })(
             vars.at("params"))
      .second;
}

}  // namespace

TEST_CASE("row 1: RematScopes may end in any order, and remat stays bitwise") {
  const Array x = random_array(Shape{3, 4}, 1);
  const Tree vars = init(TwoLayers{}, rng::key(0), x);
  const Tree plain = grads_of(vars, x);
  {
    // Scopes held in a container end in the container's order: the outermost first.
    std::vector<std::unique_ptr<lift::RematScope>> scopes;
    scopes.push_back(std::make_unique<lift::RematScope>(lift::RematScopeOptions{.mode = lift::RematMode::full}));
    scopes.push_back(std::make_unique<lift::RematScope>(
        lift::RematScopeOptions{.mode = lift::RematMode::list_of_layers, .layer_names = {"Dense_1"}}));
    scopes.push_back(std::make_unique<lift::RematScope>(lift::RematScopeOptions{.mode = lift::RematMode::full}));
    CHECK(bitwise_equal(grads_of(vars, x), plain));
    scopes.erase(scopes.begin() + 1);  // the middle one first
    CHECK(bitwise_equal(grads_of(vars, x), plain));
    scopes.erase(scopes.begin());
    CHECK(bitwise_equal(grads_of(vars, x), plain));
  }
  CHECK(bitwise_equal(grads_of(vars, x), plain));  // every scope gone: plain calls, nothing dangling
}

TEST_CASE("row 2: size arithmetic that overflows is a ShapeError naming the op and the shape") {
  const std::int64_t big = std::int64_t{1} << 31;
  CHECK(contains(error_of<ShapeError>([&] { Array::zeros(Shape{big, big, 4}); }),
                 "Shape (2147483648, 2147483648, 4) has more than 2^63 elements"));
  CHECK(contains(error_of<ShapeError>([&] { Array::zeros(Shape{big, big / 4}, DType::bf16); }),
                 "shape (2147483648, 536870912) and dtype bfloat16 would need 2.30584e+18 bytes"));
  CHECK(contains(error_of<ShapeError>([&] { reshape(Array::ones({4}), {big, big, big}); }),
                 "reshape: the target shape [2147483648, 2147483648, 2147483648] of (4,) has more than 2^63 elements"));
  // A variable file reaches the same checks, whatever the order of the zero dimension.
  const nlohmann::ordered_json file = {
      {"w", {{"shape", {std::int64_t{1} << 62, std::int64_t{1} << 62, 0}}, {"dtype", "float32"}, {"data", nlohmann::json::array()}}}};
  const std::string load = error_of<IoError>([&] { serialization::from_json(file, "vars.json"); });
  CHECK(contains(load, "vars.json"));
  CHECK(contains(load, "w"));
  // A layer's geometry: the module path and the op.
  const std::string conv = error_of<ShapeError>([] {
    init(nn::Conv{.features = 1, .kernel_size = {3, 3}, .kernel_dilation = {std::int64_t{1} << 62, 1}}, rng::key(0),
         Array::ones(Shape{1, 5, 5, 1}));
  });
  CHECK(contains(conv, "conv2d"));
  CHECK(contains(conv, "overflows 64 bits"));
  // A geometry that fits 64 bits but spans more than 2^31 positions is refused before any engine
  // plans it (fuzzing found oneDNN spending 20+ s and gigabytes on this config, then crashing).
  const std::string wide = error_of<ShapeError>([] {
    init(nn::Conv{.features = 1, .kernel_size = {3, 3}, .kernel_dilation = {3, 608256388001312281}}, rng::key(0),
         Array::ones(Shape{1, 5, 5, 1}));
  });
  CHECK(contains(wide, "in module '<root>' (Conv): conv2d: on spatial axis 1 the effective window (1216512776002624563)"));
  CHECK(contains(wide, "exceeds 2^31 - 1"));
  // CAUSAL padding's left zeros, (k - 1) * dilation, computed with the same care.
  const std::string causal = error_of<ShapeError>([] {
    init(nn::Conv{.features = 1, .kernel_size = {3}, .padding = "CAUSAL", .kernel_dilation = {std::int64_t{1} << 62}},
         rng::key(0), Array::ones(Shape{1, 5, 1}));
  });
  CHECK(contains(causal, "CAUSAL padding of (kernel_size - 1) * kernel_dilation = (3 - 1) * 4611686018427387904 overflows"));
}

TEST_CASE("row 3: configurations and hyperparameters a layer cannot hold are refused, not narrowed") {
  CHECK(contains(error_of<ValueError>([] { nn::module_from_config<nn::Dense>({{"features", 18446744073709551615ULL}}); }),
                 "Dense.features"));
  CHECK(contains(error_of<ValueError>([] { nn::module_from_config<nn::BatchNorm>({{"axis", 4294967295LL}}); }),
                 "BatchNorm.axis"));
  CHECK(contains(error_of<ValueError>([] { nn::module_from_config<nn::Dense>({{"features", 2.5}}); }), "Dense.features"));
  // A non-finite number (a config built in code; JSON text cannot spell one) is refused on load.
  const double inf = std::numeric_limits<double>::infinity();
  const std::string overflowed = error_of<ValueError>([&] { nn::module_from_config<nn::Dropout>({{"rate", inf}}); });
  CHECK(contains(overflowed, "Dropout.rate"));
  CHECK(contains(overflowed, "a finite number"));
  CHECK(contains(error_of<ValueError>([&] { nn::module_from_config<nn::LayerNorm>({{"epsilon", -inf}}); }), "LayerNorm.epsilon"));
  CHECK(contains(error_of<ValueError>([] { nn::module_from_config<nn::LayerNorm>({{"epsilon", std::nan("")}}); }),
                 "LayerNorm.epsilon"));
  CHECK(nn::module_from_config<nn::Dropout>(nlohmann::json::parse(R"({"rate": 0.25})")).rate == 0.25);
  // Every configurable layer checks its ranges on load (not only when it first runs), naming the
  // layer and the field.
  auto refused = [](auto load, const char* words) {
    const std::string msg = error_of<ValueError>(load);
    CAPTURE(msg);
    CHECK(contains(msg, "module config: "));
    CHECK(contains(msg, words));
  };
  using J = nlohmann::json;
  refused([] { nn::module_from_config<nn::Dense>(J{{"features", 0}}); }, "Dense: features must be positive");
  refused([] { nn::module_from_config<nn::DenseGeneral>(J{{"features", {4, -1}}}); }, "DenseGeneral: features must be");
  refused([] { nn::module_from_config<nn::DenseGeneral>(J{{"features", {4}}, {"axis", {-1, -1}}}); }, "axis -1 is listed twice");
  refused([] { nn::module_from_config<nn::Conv>(J{{"features", 4}, {"kernel_size", {3, 3}}, {"strides", {1, 0}}}); },
          "Conv: strides values must be positive");
  refused([] { nn::module_from_config<nn::Conv>(J{{"features", 4}, {"kernel_size", {3, 3}}, {"kernel_dilation", {1, 2, 3}}}); },
          "Conv: kernel_dilation has 3 values but the kernel has 2");
  refused([] { nn::module_from_config<nn::Conv>(J{{"features", 4}, {"kernel_size", {3, 3}}, {"feature_group_count", 3}}); },
          "feature_group_count 3 must be positive and divide features");
  refused([] { nn::module_from_config<nn::Conv>(J{{"features", 4}, {"kernel_size", {3, 3}}, {"padding", "CAUSAL"}}); },
          "CAUSAL padding is only implemented for 1-D");
  refused([] { nn::module_from_config<nn::Conv>(J{{"features", 4}, {"kernel_size", {3, 3, 3}}}); }, "kernel_size must have 1");
  refused([] { nn::module_from_config<nn::ConvTranspose>(J{{"features", 4}, {"kernel_size", {3}}, {"padding", "CAUSAL"}}); },
          "ConvTranspose: unknown padding 'CAUSAL'");
  refused([] { nn::module_from_config<nn::Embed>(J{{"num_embeddings", 10}, {"features", 0}}); }, "Embed: num_embeddings and features");
  refused([] { nn::module_from_config<nn::LayerNorm>(J{{"epsilon", -1e-6}}); }, "LayerNorm: epsilon must be >= 0");
  refused([] { nn::module_from_config<nn::RMSNorm>(J{{"epsilon", -1.0}}); }, "RMSNorm: epsilon must be >= 0");
  refused([] { nn::module_from_config<nn::GroupNorm>(J{{"num_groups", 0}}); }, "GroupNorm: num_groups must be positive");
  refused([] { nn::module_from_config<nn::GroupNorm>(J{{"num_groups", 4}, {"group_size", 2}}); }, "set exactly one of num_groups and group_size");
  refused([] { nn::module_from_config<nn::BatchNorm>(J{{"momentum", 1.5}}); }, "BatchNorm: momentum must be in [0, 1]");
  refused([] { nn::module_from_config<nn::Dropout>(J{{"rate", 1e308}}); }, "Dropout: rate must be in [0, 1]");
  refused([] { nn::module_from_config<nn::MultiHeadDotProductAttention>(J{{"num_heads", 0}}); }, "num_heads must be positive");
  refused([] { nn::module_from_config<nn::MultiHeadDotProductAttention>(J{{"num_heads", 3}, {"qkv_features", 8}}); },
          "qkv_features (8) must be positive and divisible by num_heads (3)");
  refused([] { nn::module_from_config<nn::MultiHeadDotProductAttention>(J{{"num_heads", 2}, {"dropout_rate", -0.1}}); },
          "dropout_rate must be in [0, 1]");
  // The same layers with valid values load.
  CHECK(nn::module_from_config<nn::Conv>(J{{"features", 4}, {"kernel_size", {3}}, {"padding", "CAUSAL"}}).padding.mode() == "CAUSAL");
  CHECK(nn::module_from_config<nn::MultiHeadDotProductAttention>(J{{"num_heads", 2}, {"qkv_features", 8}}).num_heads == 2);
  const Array x = random_array(Shape{4, 3}, 2);
  CHECK(contains(error_of<ValueError>([&] { init(nn::BatchNorm{.use_running_average = false, .momentum = -0.5}, rng::key(0), x); }), "momentum"));
  CHECK(contains(error_of<ShapeError>([&] {
                   const Tree v = init(nn::BatchNorm{.use_running_average = false}, rng::key(0), x);
                   apply(nn::BatchNorm{.use_running_average = false}, v, {.mutable_collections = {"batch_stats"}},
                         Array::zeros(Shape{0, 3}));
                 }),
                 "empty input of shape (0, 3)"));
  CHECK(contains(error_of<ValueError>([] { lift::RematScope({.mode = lift::RematMode::larger_than, .output_size_threshold = -5}); }),
                 "output_size_threshold"));
  CHECK(contains(error_of<ValueError>([] { optim::adam(1e-3, 0.9, 1.0); }), "b2"));
  CHECK(contains(error_of<ValueError>([] { optim::adamw(std::numeric_limits<double>::quiet_NaN()); }), "learning rate"));
  // Legal but surely a mistake: a layer list that matched nothing is a warning naming the calls made.
  std::vector<std::string> warnings;
  const WarningHandler previous = set_warning_handler([&](const std::string& m) { warnings.push_back(m); });
  {
    lift::RematScope scope({.mode = lift::RematMode::list_of_layers, .layer_names = {"Dense_7"}});
    const Array in = random_array(Shape{2, 4}, 3);
    grads_of(init(TwoLayers{}, rng::key(0), in), in);
  }
  set_warning_handler(previous);
  REQUIRE(warnings.size() == 1);
  CHECK(contains(warnings[0], "Dense_7"));
  CHECK(contains(warnings[0], "Dense_0"));
}

TEST_CASE("row 4: errors say what is there instead, name the layer's argument, and wrap allocation failures") {
  const Array x = random_array(Shape{2, 4}, 4);
  const Tree vars = init(TwoLayers{}, rng::key(0), x);
  // An array where the Dense_0 dict belongs.
  Tree flat = vars;
  flat.at("params").set("Dense_0", Array::zeros(Shape{4, 8}));
  const std::string msg = error_of<ValueError>([&] { apply(TwoLayers{}, flat, x); });
  CHECK(contains(msg, "params/Dense_0"));
  CHECK(contains(msg, "(4, 8)"));
  // A mask that does not fit the attention weights: the layer's argument, not an internal op.
  const Array q = random_array(Shape{2, 5, 8}, 5);
  const nn::MultiHeadDotProductAttention mha{.num_heads = 2};
  const Tree av = init(mha, rng::key(0), q);
  const std::string mask = error_of<ShapeError>([&] { apply(mha, av, q, nn::AttentionArgs{.mask = Array::ones(Shape{2, 1, 3, 3})}); });
  CHECK(contains(mask, "mask"));
  CHECK_FALSE(contains(mask, "where:"));
  // Out of memory (here: over a live-byte limit) names the shape and the layer.
  const std::string oom = error_of<MemoryError>([&] {
    memory::LiveLimitScope limit(1 << 20);
    init(TwoLayers{.hidden = 1 << 20}, rng::key(0), x);
  });
  CHECK(contains(oom, "shape (4, 1048576)"));
  CHECK(contains(oom, "limit"));
  CHECK(memory::live_limit() == 0);
}

TEST_CASE("row 5: a writer killed at any moment leaves the old file and no temporary file") {
  const fs::path dir = fs::temp_directory_path() / ("linum_bad_input_kill_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path target = dir / "vars.msgpack";
  const Tree old_tree{{"old", Array::scalar(1.0f)}};
  serialization::save(target, old_tree);
  const std::vector<std::uint8_t> big(std::size_t{64} << 20, 0x5a);
  for (int delay_us : {0, 200, 1000, 3000, 10000, 30000}) {
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      serialization::write_file_atomic(target, big);  // 64 MiB: killed while writing, or just after
      ::_exit(0);
    }
    ::usleep(static_cast<useconds_t>(delay_us));
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
    CAPTURE(delay_us);
    CHECK(names == std::vector<std::string>{"vars.msgpack"});
    const auto size = fs::file_size(target);
    CHECK((size == big.size() || bitwise_equal(serialization::load(target), old_tree)));
  }
  fs::remove_all(dir);
}

TEST_CASE("row 6: debug_nans names the op, the phase and the module path of the first NaN") {
  struct LogLayer {
    Array operator()(Scope& s, const Array& x) const { return log(s(nn::Dense{.features = 3}, x)); }
  };
  struct Net {
    Array operator()(Scope& s, const Array& x) const { return s(LogLayer{}, x); }
  };
  const Array x = random_array(Shape{2, 4}, 6);
  const Tree vars = init(Net{}, rng::key(0), x);
  auto loss = [&](const Tree& p) { return sum(apply(Net{}, Tree{{"params", p}}, x)); };
  CHECK(std::isnan(value_and_grad(loss)(vars.at("params")).first.item()));  // off: NaN passes silently
  DebugNansScope on(true);
  const std::string msg = error_of<FloatingPointError>([&] { value_and_grad(loss)(vars.at("params")); });
  CHECK(contains(msg, "'log'"));
  CHECK(contains(msg, "forward"));
  CHECK(contains(msg, "LogLayer_0"));
  CHECK(contains(msg, "f32[2,3], first at flat index"));
  // Plain inference (no differentiation): the innermost module whose output holds the NaN.
  const std::string plain = error_of<FloatingPointError>([&] { apply(Net{}, vars, x); });
  CHECK(contains(plain, "in module 'LogLayer_0' (LogLayer): debug_nans: output 0 of this module holds NaN (f32[2,3]"));
  CHECK(contains(plain, "run the same call under value_and_grad to name the op"));
}

// Rows of our own.

TEST_CASE("row 7: a gzip IDX file that inflates past its header is refused before it exhausts memory") {
  std::vector<std::uint8_t> raw = {0, 0, 8, 1, 0, 0, 0, 4};  // labels: 4 entries promised
  raw.resize(raw.size() + (std::size_t{64} << 20), 1);        // ... 64 MiB delivered
  uLongf packed_size = compressBound(static_cast<uLong>(raw.size()));
  std::vector<std::uint8_t> packed(packed_size + 32);
  z_stream zs{};
  deflateInit2(&zs, 9, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY);
  zs.next_in = raw.data();
  zs.avail_in = static_cast<uInt>(raw.size());
  zs.next_out = packed.data();
  zs.avail_out = static_cast<uInt>(packed.size());
  deflate(&zs, Z_FINISH);
  packed.resize(zs.total_out);
  deflateEnd(&zs);
  const std::string msg = error_of<IoError>([&] { datasets::idx_bytes(packed, "labels.gz"); });
  CHECK(contains(msg, "labels.gz"));
  CHECK(contains(msg, "inflates to more than the 12 bytes"));
}

TEST_CASE("row 8: apply with options works for modules with a generic operator() (Sequential)") {
  const nn::Sequential<nn::Dense, nn::Dense> seq{nn::Dense{.features = 3}, nn::Dense{.features = 2}};
  const Array x = random_array(Shape{2, 4}, 7);
  const Tree vars = init(seq, rng::key(0), x);
  const auto [y, updated] = apply(seq, vars, {.rngs = {{"dropout", rng::key(1)}}}, x);
  CHECK(bitwise_equal(y, apply(seq, vars, x)));
  CHECK(updated.empty());
}
