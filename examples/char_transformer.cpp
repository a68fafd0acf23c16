// A small character-level transformer trained with remat per block, then sampled two ways: by
// running the model on the whole text so far for every new character, and with the attention
// layers' decode cache (Flax's decode=True: each call takes one position and attends to the keys
// and values cached from the earlier ones). Both give the same characters; the cache does each
// step's work once.
//
//   char_transformer [--text FILE] [--steps 200] [--seq 64] [--batch 16] [--dim 64] [--heads 4]
//                    [--layers 2] [--lr 0.003] [--seed 0]
//
// The last line of output is JSON: losses, both samples, whether they agree, and their times.
#include "flags.hpp"

#include <linum/linum.hpp>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <tuple>
#include <vector>

using namespace linum;

// Pre-LayerNorm block: causal self-attention and a 4x GELU MLP, with residuals. With decode, the
// attention keeps its keys and values in the "cache" collection; `causal` is off when decoding
// (the cache masks the positions not yet written).
struct Block {
  std::int64_t heads = 4;
  bool decode = false;
  bool causal = true;
  Array operator()(Scope& s, const Array& x) const {
    const std::int64_t d = x.dim(-1);
    const nn::LayerNorm ln{};
    Array h = x + s("attn", nn::MultiHeadDotProductAttention{.num_heads = heads, .decode = decode}, s("ln1", ln, x),
                    nn::AttentionArgs{.is_causal = causal});
    Array m = gelu(s("fc1", nn::Dense{.features = 4 * d}, s("ln2", ln, h)));
    return h + s("fc2", nn::Dense{.features = d}, m);
  }
};

struct CharTransformer {
  std::int64_t vocab = 256, dim = 64, heads = 4, layers = 2, max_len = 64;
  bool decode = false;  // the attention layers' decode cache
  bool causal = true;   // false for one-position decoding calls
  bool remat = false;   // checkpoint every block (training)
  // tokens [batch, t] (int32) at positions [t] (int32) -> logits [batch, t, vocab]
  Array operator()(Scope& s, const Array& tokens, const Array& positions) const {
    Array x = s("wte", nn::Embed{.num_embeddings = vocab, .features = dim}, tokens) +
              s("wpe", nn::Embed{.num_embeddings = max_len, .features = dim}, positions);
    const Block block{.heads = heads, .decode = decode, .causal = causal};
    for (std::int64_t l = 0; l < layers; ++l) x = remat ? s(lift::remat<Block>{block}, x) : s(block, x);
    return s("head", nn::Dense{.features = vocab}, s("ln_f", nn::LayerNorm{}, x));
  }
};

struct Options {
  std::string text = "/usr/share/common-licenses/GPL-3";
  long steps = 200, seq = 64, batch = 16, dim = 64, heads = 4, layers = 2;
  double lr = 3e-3;
  int seed = 0;
};

const examples::Flags flags("char_transformer",
                            "usage: char_transformer [--text FILE] [--steps N] [--seq N] [--batch N] [--dim N] [--heads N]\n"
                            "                        [--layers N] [--lr X] [--seed N]");

Options parse(int argc, char** argv) {
  Options o;
  flags.parse(argc, argv, [&](const std::string& a, const std::string& v) {
    auto number = [&](double lo, double hi) { return flags.number(a, v, lo, hi); };
    if (a == "--text") o.text = v;
    else if (a == "--steps") o.steps = static_cast<long>(number(0, 1e7));
    else if (a == "--seq") o.seq = static_cast<long>(number(8, 4096));
    else if (a == "--batch") o.batch = static_cast<long>(number(1, 1 << 16));
    else if (a == "--dim") o.dim = static_cast<long>(number(1, 1 << 14));
    else if (a == "--heads") o.heads = static_cast<long>(number(1, 1024));
    else if (a == "--layers") o.layers = static_cast<long>(number(1, 1024));
    else if (a == "--lr") o.lr = number(1e-8, 10);
    else if (a == "--seed") o.seed = static_cast<int>(number(0, 1 << 30));
    else return false;
    return true;
  });
  if (o.dim % o.heads != 0) flags.fail("--dim must be a multiple of --heads");
  return o;
}

Array positions_from(std::int64_t first, std::int64_t count) {
  std::vector<std::int32_t> p(static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i) p[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(first + i);
  return Array::from_i32(Shape{count}, p);
}

Array tokens_of(const std::string& s) {
  std::vector<std::int32_t> t;
  for (unsigned char c : s) t.push_back(c);
  return Array::from_i32(Shape{1, static_cast<std::int64_t>(t.size())}, t);
}

char greedy(const Array& logits) {  // logits [1, t, vocab]: the last position's argmax
  const Array last = slice_axis(logits, 1, logits.dim(1) - 1, logits.dim(1));
  return static_cast<char>(argmax(reshape(last, {-1}), -1).data_i32()[0]);
}

int run(const Options& o) {
  std::ifstream in(o.text, std::ios::binary);
  if (!in) throw IoError("cannot read '" + o.text + "'; pass --text FILE (any text file)");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (static_cast<long>(text.size()) < o.seq + 2)
    throw ValueError("the text has " + std::to_string(text.size()) + " bytes; --seq " + std::to_string(o.seq) + " needs more");
  std::printf("%s: %zu characters\n", o.text.c_str(), text.size());

  const CharTransformer model{.dim = o.dim, .heads = o.heads, .layers = o.layers, .max_len = o.seq, .remat = true};
  auto batch_at = [&](rng::Key key) {
    const Array starts = rng::randint(key, Shape{o.batch}, 0, static_cast<std::int64_t>(text.size()) - o.seq - 1);
    std::vector<std::int32_t> x, y;
    for (std::int64_t b = 0; b < o.batch; ++b)
      for (long i = 0; i < o.seq; ++i) {
        const auto at = static_cast<std::size_t>(starts.data_i32()[b] + i);
        x.push_back(static_cast<unsigned char>(text[at]));
        y.push_back(static_cast<unsigned char>(text[at + 1]));
      }
    return std::make_pair(Array::from_i32(Shape{o.batch, o.seq}, x), Array::from_i32(Shape{o.batch, o.seq}, y));
  };
  const Array positions = positions_from(0, o.seq);
  Tree params = init(model, rng::key(o.seed), batch_at(rng::key(o.seed + 1)).first, positions).at("params");
  const auto opt = optim::chain(optim::clip_by_global_norm(1.0), optim::adam(o.lr));
  Tree state = opt.init(params);
  double first_loss = 0, last_loss = 0;
  const auto start = std::chrono::steady_clock::now();
  for (long step = 0; step < o.steps; ++step) {
    Array x, y;
    std::tie(x, y) = batch_at(rng::fold_in(rng::key(o.seed + 2), static_cast<std::uint32_t>(step)));
    auto [loss, grads] = value_and_grad([&](const Tree& p) {
      return mean(nn::softmax_cross_entropy_with_integer_labels(apply(model, Tree{{"params", p}}, x, positions), y));
    })(params);
    auto [p2, s2] = opt.step(std::move(params), grads, std::move(state));
    params = std::move(p2);
    state = std::move(s2);
    if (step == 0) first_loss = loss.item();
    last_loss = loss.item();
    if ((step + 1) % std::max<long>(1, o.steps / 5) == 0 || step + 1 == o.steps)
      std::printf("step %ld/%ld loss %.3f (%.2f bits/char)\n", step + 1, o.steps, last_loss, last_loss / std::log(2.0));
  }
  const double train_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  autodiff::NoGradGuard no_grad;
  const std::string prompt = "This ";
  const Tree vars{{"params", params}};
  // 1. The whole text so far through the model for every new character.
  auto t0 = std::chrono::steady_clock::now();
  std::string full = prompt;
  while (static_cast<long>(full.size()) < o.seq)
    full += greedy(apply(model, vars, tokens_of(full), positions_from(0, static_cast<std::int64_t>(full.size()))));
  const double full_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  // 2. The decode cache: init with a full-length input makes the "cache" collection; then one
  // position per call, the prompt first.
  t0 = std::chrono::steady_clock::now();
  CharTransformer decoder = model;
  decoder.remat = false;
  decoder.decode = true;
  Tree cache = init(decoder, rng::key(0), Array::zeros(Shape{1, o.seq}, DType::i32), positions).at("cache");
  decoder.causal = false;
  std::string cached = prompt.substr(0, 1);
  char next = 0;
  for (std::int64_t pos = 0; static_cast<long>(pos) < o.seq; ++pos) {
    auto [logits, updates] = apply(decoder, Tree{{"params", params}, {"cache", cache}}, {.mutable_collections = {"cache"}},
                                   tokens_of(std::string(1, cached[static_cast<std::size_t>(pos)])), positions_from(pos, 1));
    cache = updates.at("cache");
    next = greedy(logits);
    if (static_cast<long>(cached.size()) == o.seq) break;
    cached += pos + 1 < static_cast<std::int64_t>(prompt.size()) ? prompt[static_cast<std::size_t>(pos + 1)] : next;
  }
  const double cached_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  std::printf("sample (whole text each step, %.3f s): %s\n", full_seconds, full.c_str());
  std::printf("sample (decode cache, %.3f s):         %s\n", cached_seconds, cached.c_str());
  std::printf("%s\n", full == cached ? "the two samples agree" : "the two samples DIFFER");
  const nlohmann::json result = {{"steps", o.steps},
                                 {"first_loss", first_loss},
                                 {"final_loss", last_loss},
                                 {"train_seconds", train_seconds},
                                 {"sample_full", full},
                                 {"sample_cached", cached},
                                 {"samples_agree", full == cached},
                                 {"seconds_full", full_seconds},
                                 {"seconds_cached", cached_seconds}};
  std::printf("%s\n", result.dump().c_str());
  return full == cached ? 0 : 1;
}

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  try {
    return run(o);
  } catch (const linum::Error& e) {
    std::cerr << "char_transformer: " << e.what() << "\n";
    return 1;
  }
}
