// Writes the fuzz targets' seed corpus: small valid inputs of every kind each loader reads, so
// fuzzing starts from the formats' real structure. Usage: make_fuzz_corpus tests/fuzz/corpus
// (files are named seed-*; what fuzzing adds is kept beside them, minimized with -merge=1).

#include <linum/linum.hpp>
#include <linum/nn/config.hpp>

#include <zlib.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

namespace {

using namespace linum;
namespace fs = std::filesystem;

void write(const fs::path& path, const std::vector<std::uint8_t>& bytes) {
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
}
std::vector<std::uint8_t> text(const std::string& s) { return {s.begin(), s.end()}; }

std::vector<std::uint8_t> gzip(const std::vector<std::uint8_t>& raw) {
  z_stream zs{};
  deflateInit2(&zs, 9, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY);
  std::vector<std::uint8_t> out(deflateBound(&zs, raw.size()) + 32);
  zs.next_in = const_cast<std::uint8_t*>(raw.data());
  zs.avail_in = static_cast<uInt>(raw.size());
  zs.next_out = out.data();
  zs.avail_out = static_cast<uInt>(out.size());
  deflate(&zs, Z_FINISH);
  out.resize(zs.total_out);
  deflateEnd(&zs);
  return out;
}

std::vector<std::uint8_t> idx(std::uint32_t magic, const std::vector<std::uint32_t>& dims, std::uint8_t fill_mod) {
  std::vector<std::uint8_t> v;
  auto put32 = [&](std::uint32_t x) { for (int s = 24; s >= 0; s -= 8) v.push_back(std::uint8_t(x >> s)); };
  put32(magic);
  std::uint64_t n = 1;
  for (auto d : dims) { put32(d); n *= d; }
  for (std::uint64_t i = 0; i < n; ++i) v.push_back(std::uint8_t(i * 37 % fill_mod));
  return v;
}

// The idx target's input: two bytes giving the image file's length, the image file, the label file.
std::vector<std::uint8_t> split(const std::vector<std::uint8_t>& images, const std::vector<std::uint8_t>& labels) {
  std::vector<std::uint8_t> v{std::uint8_t(images.size() >> 8), std::uint8_t(images.size())};
  v.insert(v.end(), images.begin(), images.end());
  v.insert(v.end(), labels.begin(), labels.end());
  return v;
}

template <class M>
void config_seed(const fs::path& dir, int type, const std::string& name, const M& module) {
  std::vector<std::uint8_t> bytes{std::uint8_t(type)};
  const auto t = text(nn::module_config(module).dump());
  bytes.insert(bytes.end(), t.begin(), t.end());
  write(dir / ("seed-" + name + ".json"), bytes);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: make_fuzz_corpus CORPUS_DIR (e.g. tests/fuzz/corpus)\n";
    return 2;
  }
  const fs::path root = argv[1];
  // Variable files: nested dicts, every dtype, a scalar, an empty array and dict, a NaN payload,
  // and arrays in Flax's chunked layout.
  Array weird = Array::from(Shape{4}, {1.5f, -0.0f, std::numeric_limits<float>::infinity(), std::nanf("7")});
  Tree trees[] = {
      Tree{{"params", {{"Dense_0", {{"kernel", rng::normal(rng::key(0), Shape{3, 2})}, {"bias", Array::zeros(Shape{2})}}}}}},
      Tree{{"step", Array::from_i32(Shape{}, {7})}, {"ids", Array::from_i32(Shape{2, 2}, {1, -2, 3, 2147483647})},
           {"half", astype(weird, DType::bf16)}, {"empty", Array::zeros(Shape{0, 3})}, {"nothing", Tree{}}},
      Tree{{"batch_stats", {{"mean", weird}, {"var", Array::full(Shape{1, 1, 4}, 2.0f)}}}},
  };
  int i = 0;
  for (const Tree& t : trees) {
    write(root / "msgpack" / ("seed-" + std::to_string(i) + ".msgpack"), serialization::to_msgpack(t));
    write(root / "msgpack" / ("seed-" + std::to_string(i) + "-chunked.msgpack"), serialization::to_msgpack(t, 8));
    write(root / "json" / ("seed-" + std::to_string(i) + ".json"), text(serialization::to_json(t).dump()));
    write(root / "safetensors" / ("seed-" + std::to_string(i) + ".safetensors"),
          safetensors::to_bytes(t, {{"format", "linum"}}, '/'));
    ++i;
  }
  // Module configs: each layer type's default and one with fields set.
  const fs::path mc = root / "module_config";
  config_seed(mc, 0, "dense", nn::Dense{.features = 4});
  config_seed(mc, 1, "dense_general", nn::DenseGeneral{.features = {2, 2}, .axis = {-1}});
  config_seed(mc, 2, "conv", nn::Conv{.features = 2, .kernel_size = {3, 3}, .strides = {2, 1}, .padding = "VALID"});
  config_seed(mc, 2, "conv_dilated", nn::Conv{.features = 4, .kernel_size = {2, 2}, .kernel_dilation = {2, 2}, .feature_group_count = 2});
  config_seed(mc, 3, "embed", nn::Embed{.num_embeddings = 3, .features = 4});
  config_seed(mc, 4, "layer_norm", nn::LayerNorm{});
  config_seed(mc, 5, "rms_norm", nn::RMSNorm{});
  config_seed(mc, 6, "group_norm", nn::GroupNorm{.num_groups = 4});
  config_seed(mc, 7, "batch_norm", nn::BatchNorm{.use_running_average = false, .momentum = 0.9});
  config_seed(mc, 8, "dropout", nn::Dropout{.rate = 0.5, .deterministic = false});
  config_seed(mc, 9, "attention", nn::MultiHeadDotProductAttention{.num_heads = 2, .qkv_features = 8});
  config_seed(mc, 10, "sequential",
              nn::Sequential<nn::Dense, nn::LayerNorm, nn::Dense>{nn::Dense{.features = 5}, nn::LayerNorm{}, nn::Dense{.features = 2}});
  // IDX splits: plain and gzip, 3 images of 2x3 with labels, and a label file with a bad label.
  const auto images = idx(0x803, {3, 2, 3}, 251), labels = idx(0x801, {3}, 10), bad_labels = idx(0x801, {3}, 17);
  write(root / "idx" / "seed-plain", split(images, labels));
  write(root / "idx" / "seed-gzip", split(gzip(images), gzip(labels)));
  write(root / "idx" / "seed-bad-label", split(images, bad_labels));
  std::cout << "wrote the seed corpus under " << root << "\n";
  return 0;
}
