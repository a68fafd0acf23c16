// A character-level LSTM language model trained with remat over time, on a text every Debian
// system has (the GNU GPL, /usr/share/common-licenses/GPL-3).
//
//   char_lstm [--text FILE] [--steps 300] [--seq 128] [--batch 32] [--hidden 256] [--lr 0.003]
//             [--remat sqrt|binomial|per-step|none] [--snapshots 8] [--sample 200] [--seed 0]
//
// Embed -> nn::RNN<LSTMCell> checkpointed over time -> Dense over the byte vocabulary; adam with
// global-norm clipping. --remat sqrt (the default) checkpoints sqrt(T) segments of time steps (about
// 2 sqrt(T) carries kept, each step computed twice); binomial keeps at most --snapshots carries with
// the fewest recomputations (Griewank's Revolve); per-step checkpoints every step (T carries kept).
// Gradients are bitwise those without remat. It prints a progress bar, the activation memory of a
// training step with the chosen remat and without, a sample of generated text, and a last line of
// JSON (loss in bits per character).
#include "flags.hpp"

#include <linum/linum.hpp>

#include <nlohmann/json.hpp>

#include <unistd.h>

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

struct CharModel {
  std::int64_t vocab = 256;
  std::int64_t hidden = 256;
  bool remat_per_step = false;
  lift::ScanSchedule schedule = lift::ScanSchedule::sqrt_segments();
  // tokens [batch, time] (int32) -> logits [batch, time, vocab]
  Array operator()(Scope& s, const Array& tokens) const {
    Array x = s(nn::Embed{.num_embeddings = vocab, .features = 64}, tokens);
    x = s(nn::RNN<nn::LSTMCell>{.cell = {.features = hidden}, .remat = remat_per_step, .schedule = schedule}, x);
    return s(nn::Dense{.features = vocab}, x);
  }
};

struct Options {
  std::string text = "/usr/share/common-licenses/GPL-3";
  long steps = 300, seq = 128, batch = 32, hidden = 256, sample = 200;
  double lr = 3e-3;
  std::string remat = "sqrt";
  int snapshots = 8;
  int seed = 0;
};

const examples::Flags flags("char_lstm",
                            "usage: char_lstm [--text FILE] [--steps N] [--seq N] [--batch N] [--hidden N] [--lr X]\n"
                            "                 [--remat sqrt|binomial|per-step|none] [--snapshots N] [--sample N] [--seed N]");

Options parse(int argc, char** argv) {
  Options o;
  flags.parse(argc, argv, [&](const std::string& a, const std::string& v) {
    auto number = [&](double lo, double hi) { return flags.number(a, v, lo, hi); };
    if (a == "--text") o.text = v;
    else if (a == "--steps") o.steps = static_cast<long>(number(0, 1e7));
    else if (a == "--seq") o.seq = static_cast<long>(number(2, 1 << 16));
    else if (a == "--batch") o.batch = static_cast<long>(number(1, 1 << 16));
    else if (a == "--hidden") o.hidden = static_cast<long>(number(1, 1 << 14));
    else if (a == "--sample") o.sample = static_cast<long>(number(0, 1 << 20));
    else if (a == "--lr") o.lr = number(1e-8, 10);
    else if (a == "--seed") o.seed = static_cast<int>(number(0, 1 << 30));
    else if (a == "--snapshots") o.snapshots = static_cast<int>(number(1, 1 << 16));
    else if (a == "--remat") {
      if (v != "sqrt" && v != "binomial" && v != "per-step" && v != "none")
        flags.fail("--remat must be sqrt, binomial, per-step or none, got '" + v + "'");
      o.remat = v;
    } else return false;
    return true;
  });
  return o;
}

int run(const Options& o) {
  std::ifstream in(o.text, std::ios::binary);
  if (!in) throw IoError("cannot read '" + o.text + "'; pass --text FILE (any text file)");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (static_cast<long>(text.size()) < o.seq + 2)
    throw ValueError("the text has " + std::to_string(text.size()) + " bytes; --seq " + std::to_string(o.seq) + " needs more");
  std::printf("%s: %zu characters\n", o.text.c_str(), text.size());

  CharModel model{.hidden = o.hidden, .remat_per_step = o.remat == "per-step"};
  model.schedule = o.remat == "sqrt"       ? lift::ScanSchedule::sqrt_segments()
                   : o.remat == "binomial" ? lift::ScanSchedule::binomial(o.snapshots)
                                           : lift::ScanSchedule{};
  // A batch: `batch` windows of seq + 1 characters at offsets drawn from the key.
  auto batch_at = [&](rng::Key key) {
    const Array starts = rng::randint(key, Shape{o.batch}, 0, static_cast<std::int64_t>(text.size()) - o.seq - 1);
    std::vector<std::int32_t> x(static_cast<std::size_t>(o.batch * o.seq)), y(x.size());
    for (long b = 0; b < o.batch; ++b)
      for (long t = 0; t < o.seq; ++t) {
        const std::size_t at = static_cast<std::size_t>(starts.data_i32()[b] + t);
        x[static_cast<std::size_t>(b * o.seq + t)] = static_cast<unsigned char>(text[at]);
        y[static_cast<std::size_t>(b * o.seq + t)] = static_cast<unsigned char>(text[at + 1]);
      }
    return std::make_pair(Array::from_i32(Shape{o.batch, o.seq}, x), Array::from_i32(Shape{o.batch, o.seq}, y));
  };
  Array x0, y0;
  std::tie(x0, y0) = batch_at(rng::key(o.seed + 1));
  Tree params = init(model, rng::key(o.seed), x0).at("params");
  const auto opt = optim::chain(optim::clip_by_global_norm(1.0), optim::adam(o.lr));
  Tree state = opt.init(params);
  auto loss_of = [&](const CharModel& m, const Array& x, const Array& y) {
    return [&m, x, y](const Tree& p) {
      return mean(nn::softmax_cross_entropy_with_integer_labels(apply(m, Tree{{"params", p}}, x), y));
    };
  };
  // The activation memory of one training step, with the chosen remat and without.
  auto step_bytes = [&](const CharModel& m) {
    memory::PeakScope scope;
    Tree g = grad(loss_of(m, x0, y0))(params);
    return scope.peak_growth() - byte_count(g);
  };
  CharModel plain = model;
  plain.remat_per_step = false;
  plain.schedule = {};
  const std::int64_t bytes_remat = step_bytes(model), bytes_plain = step_bytes(plain);

  const bool tty = isatty(1);
  const auto start = std::chrono::steady_clock::now();
  double first_loss = 0, last_loss = 0, recent = 0;
  for (long step = 0; step < o.steps; ++step) {
    auto [x, y] = batch_at(rng::fold_in(rng::key(o.seed + 2), static_cast<std::uint32_t>(step)));
    auto [loss, grads] = value_and_grad(loss_of(model, x, y))(params);
    auto [p2, s2] = opt.step(std::move(params), grads, std::move(state));
    params = std::move(p2);
    state = std::move(s2);
    const double l = loss.item();
    if (step == 0) first_loss = l;
    last_loss = l;
    recent = step == 0 ? l : 0.9 * recent + 0.1 * l;
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const bool report = tty || step + 1 == o.steps || (step + 1) % std::max<long>(1, o.steps / 5) == 0;
    if (report) {
      const int width = 30, filled = static_cast<int>(width * (step + 1) / std::max<long>(o.steps, 1));
      std::printf("%sstep %ld/%ld [%s%s] loss %.3f (%.2f bits/char)  %.1f steps/s%s", tty ? "\r" : "", step + 1, o.steps,
                  std::string(filled, '#').c_str(), std::string(width - filled, '.').c_str(), recent, recent / std::log(2.0),
                  (step + 1) / std::max(seconds, 1e-9), tty && step + 1 < o.steps ? "" : "\n");
      std::fflush(stdout);
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  // Sampling, greedy after a prompt: the model on the text so far, its last position's argmax.
  std::string sample = "This ";
  if (o.sample > 0) {
    autodiff::NoGradGuard no_grad;
    const Tree vars{{"params", params}};
    for (long i = 0; i < o.sample; ++i) {
      std::vector<std::int32_t> tokens(sample.begin(), sample.end());
      for (auto& t : tokens) t &= 0xff;
      const Array logits = apply(model, vars, Array::from_i32(Shape{1, static_cast<std::int64_t>(tokens.size())}, tokens));
      const Array last = slice_axis(logits, 1, logits.dim(1) - 1, logits.dim(1));
      sample += static_cast<char>(argmax(reshape(last, {-1}), -1).data_i32()[0]);
    }
    std::printf("sample: %s\n", sample.c_str());
  }
  std::printf("activation memory of a training step (batch %ld x %ld characters): %.1f MiB with remat %s, %.1f MiB without\n",
              o.batch, o.seq, bytes_remat / 1048576.0, o.remat.c_str(), bytes_plain / 1048576.0);
  const nlohmann::json result = {{"steps", o.steps},
                                 {"first_loss", first_loss},
                                 {"final_loss", last_loss},
                                 {"final_bits_per_char", last_loss / std::log(2.0)},
                                 {"seconds", seconds},
                                 {"remat", o.remat},
                                 {"peak_activation_bytes_remat", bytes_remat},
                                 {"peak_activation_bytes_plain", bytes_plain}};
  std::printf("%s\n", result.dump().c_str());
  return 0;
}

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  try {
    return run(o);
  } catch (const linum::Error& e) {
    std::cerr << "char_lstm: " << e.what() << "\n";
    return 1;
  }
}
