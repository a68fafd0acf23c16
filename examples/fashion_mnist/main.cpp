// Linum's main example: a residual CNN learns Fashion-MNIST, with its blocks rematerialized.
//
//   fashion_mnist [--epochs 3] [--remat full|dots|none] [--batch 128] [--lr 0.001] [--optimizer adam|sgd]
//                 [--depth 8] [--width 24] [--no-batchnorm] [--dropout 0.0] [--seed 0] [--data DIR]
//                 [--checkpoint FILE] [--resume] [--checkpoint-dir DIR] [--memory-plot FILE.svg|none]
//                 [--measure step|none] [--profile FILE.json]
//                 [--eval] [--limit N] [--dtype f32|bf16] [--param-dtype f32|bf16]
//                 [--micro-batches 4] [--reduction reproducible|fast] [--batch-stats average|per-rank]
//                 [--residuals ram|bf16|int8|fp8_e4m3|disk|disk+int8|...]
//
// The model (model.hpp): a convolution block at full resolution pooled to 14x14, --depth residual
// blocks (Flax's ResNet block, BatchNorm by default) of --width channels, and a dense head. With
// --remat full (the default) every block but the last is lift::remat<...>: its forward keeps only its
// input, the backward pass runs it again. Before training, the example measures what that buys: the
// activation memory of one forward and backward pass with remat and without (exact, from the memory
// accounting), the time of one training step with and without, and draws the pass's memory timeline
// for each remat choice to --memory-plot (fashion_mnist_memory.svg by default); --measure none skips
// that (for runs that only train: the measurement costs about one epoch of a small dataset).
// --profile FILE.json times one training step op by op (linum::profiler, after a warm-up step):
// it prints the ops' table, largest self time first, and writes the step's trace for Perfetto
// (https://ui.perfetto.dev) or chrome://tracing to FILE.json. The learning rate halves every epoch.
//
// --residuals keeps what the training step saves for its backward pass compressed or in the spill
// file (lift::ResidualScope, core/storage/): with --remat none, every residual; with remat, what the
// blocks' backward needs besides their recomputation (the parts outside checkpoints).
//
// Data parallel on several processes or machines: `mpirun -np N fashion_mnist ...` splits each global
// batch across the N ranks (linum::dist::DataParallel). In the default reproducible mode the batch is
// cut into --micro-batches pieces summed in a fixed order, so any N trains bitwise the same model (the
// result line's params_checksum); --reduction fast sums whole shards with a bucketed allreduce that
// overlaps the backward pass. Rank 0 prints and writes the checkpoint; any N can resume from it.
//
// --dtype bf16 trains with mixed precision as Flax does (dtype=bf16, param_dtype=float32): float32
// parameters and optimizer, convolutions and matrix products in bfloat16, the loss in float32.
// Adding --param-dtype bf16 trains in pure bfloat16 (Flax's param_dtype=bf16): bf16 parameters,
// gradients and adam moments, gradients summed across ranks in float32.
//
// It shows what Linum is for: a compact model (modules in a Scope), remat on its blocks
// (lift::remat, which keeps parameter names, so checkpoints load into either model), init/apply
// with variable dicts, data from linum::datasets (the IDX files read into an ArrayDataset, a DataLoader
// shuffling per epoch with an explicit key and preparing the next batches on a background thread),
// training with value_and_grad and an optax-style optimizer, checkpoints written atomically after
// each epoch (with the loader's position), and the activation memory remat saved, measured with the
// exact accounting. The last line of output is one JSON object for scripts.
#include <linum/linum.hpp>

#include "model.hpp"

using fashion::ResNet;
using fashion::Remat;

#include <nlohmann/json.hpp>

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <limits>
#include <map>
#include <optional>
#include <string>

using namespace linum;
namespace fs = std::filesystem;

// ---- command line ------------------------------------------------------------------------------

struct Options {
  int epochs = 3;
  std::int64_t batch = 128;
  double lr = 1e-3;
  std::string optimizer = "adam";
  Remat remat = Remat::full;
  double dropout = 0.0;
  bool batch_norm = true;
  int depth = 8;
  std::int64_t width = 24;
  int seed = 0;
  fs::path data = "/usr/share/datasets/fashion-mnist";
  fs::path checkpoint = "fashion_mnist.msgpack";
  fs::path checkpoint_dir;  // --checkpoint-dir DIR: a CheckpointManager (one step per epoch, last 3 kept)
  bool resume = false;
  bool eval_only = false;
  std::int64_t limit = 0;  // use only the first N training images (0: all)
  DType dtype = DType::f32;
  DType param_dtype = DType::f32;
  int micro_batches = 4;
  dist::Reduction reduction = dist::Reduction::reproducible;
  dist::Sync batch_stats_sync = dist::Sync::average;
  // --memory-plot FILE.svg: the memory timeline of one step, with and without remat ("none": no plot)
  fs::path memory_plot = "fashion_mnist_memory.svg";
  bool measure = true;  // --measure none: no memory or step-time measurement before training (and no plot)
  storage::Placement residuals;  // --residuals: where the step's residuals live (default: RAM, as they are)
  fs::path profile;              // --profile FILE.json: one step's op table printed, its trace written there
};

// The policy --residuals names: every residual placed there.
std::optional<lift::Policy> residual_policy(const storage::Placement& p) {
  if (p == storage::Placement{}) return std::nullopt;
  lift::Policy all = policies::everything_saveable{};
  if (p.codec != storage::Codec::none) all = policies::compress(p.codec, all);
  if (p.where == storage::Where::disk) all = policies::offload(all);
  return all;
}

const char* remat_name(Remat r) { return r == Remat::none ? "none" : r == Remat::full ? "full" : "dots"; }

[[noreturn]] void usage_error(const std::string& message) {
  std::cerr << "fashion_mnist: " << message << "\n"
            << "usage: fashion_mnist [--epochs N] [--remat full|dots|none] [--batch N] [--lr X] [--optimizer adam|sgd]\n"
            << "                     [--memory-plot FILE.svg|none] [--measure step|none] [--profile FILE.json] [--residuals ram|bf16|int8|fp8_e4m3|disk|disk+<codec>]\n"
            << "                     [--dropout X] [--depth N] [--width N] [--no-batchnorm] [--seed N] [--data DIR] [--checkpoint FILE] [--resume]\n"
            << "                     [--checkpoint-dir DIR]\n"
            << "                     [--eval] [--limit N] [--dtype f32|bf16] [--param-dtype f32|bf16]\n"
            << "                     [--micro-batches N] [--reduction reproducible|fast] [--batch-stats average|per-rank]\n";
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(a + " needs a value");
      return argv[++i];
    };
    auto number = [&](double lo, double hi) {
      const std::string v = value();
      char* end = nullptr;
      const double x = std::strtod(v.c_str(), &end);
      if (end == v.c_str() || *end != '\0' || !(x >= lo && x <= hi))
        usage_error(a + " needs a number in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got '" + v + "'");
      return x;
    };
    if (a == "--epochs") o.epochs = static_cast<int>(number(0, 1000));
    else if (a == "--batch") o.batch = static_cast<std::int64_t>(number(1, 1 << 16));
    else if (a == "--lr") o.lr = number(1e-8, 10);
    else if (a == "--dropout") o.dropout = number(0, 0.99);
    else if (a == "--seed") o.seed = static_cast<int>(number(0, 1 << 30));
    else if (a == "--limit") o.limit = static_cast<std::int64_t>(number(0, 1e9));
    else if (a == "--micro-batches") o.micro_batches = static_cast<int>(number(1, 1 << 16));
    else if (a == "--reduction") {
      const std::string r = value();
      if (r == "reproducible") o.reduction = dist::Reduction::reproducible;
      else if (r == "fast") o.reduction = dist::Reduction::fast;
      else usage_error("--reduction must be reproducible or fast, got '" + r + "'");
    } else if (a == "--batch-stats") {
      const std::string r = value();
      if (r == "average") o.batch_stats_sync = dist::Sync::average;
      else if (r == "per-rank") o.batch_stats_sync = dist::Sync::per_rank;
      else usage_error("--batch-stats must be average or per-rank, got '" + r + "'");
    }
    else if (a == "--batchnorm") o.batch_norm = true;
    else if (a == "--no-batchnorm") o.batch_norm = false;
    else if (a == "--depth") o.depth = static_cast<int>(number(1, 64));
    else if (a == "--width") o.width = static_cast<std::int64_t>(number(1, 1024));
    else if (a == "--resume") o.resume = true;
    else if (a == "--eval") o.eval_only = true;
    else if (a == "--data") o.data = value();
    else if (a == "--checkpoint") o.checkpoint = value();
    else if (a == "--checkpoint-dir") o.checkpoint_dir = value();
    else if (a == "--memory-plot") {
      o.memory_plot = value();
      if (o.memory_plot == "none") o.memory_plot.clear();
    } else if (a == "--profile") {
      o.profile = value();
    } else if (a == "--measure") {
      const std::string m = value();
      if (m == "step") o.measure = true;
      else if (m == "none") o.measure = false;
      else usage_error("--measure must be step or none, got '" + m + "'");
    }
    else if (a == "--optimizer") {
      o.optimizer = value();
      if (o.optimizer != "adam" && o.optimizer != "sgd") usage_error("--optimizer must be adam or sgd");
    } else if (a == "--remat") {
      const std::string r = value();
      if (r == "none") o.remat = Remat::none;
      else if (r == "full") o.remat = Remat::full;
      else if (r == "dots") o.remat = Remat::dots;
      else usage_error("--remat must be full, dots or none, got '" + r + "'");
    } else if (a == "--dtype") {
      const std::string d = value();
      if (d == "f32") o.dtype = DType::f32;
      else if (d == "bf16") o.dtype = DType::bf16;
      else usage_error("--dtype must be f32 or bf16, got '" + d + "'");
    } else if (a == "--param-dtype") {
      const std::string d = value();
      if (d == "f32") o.param_dtype = DType::f32;
      else if (d == "bf16") o.param_dtype = DType::bf16;
      else usage_error("--param-dtype must be f32 or bf16, got '" + d + "'");
    } else if (a == "--residuals") {
      const std::string r = value();
      try {
        o.residuals = storage::placement_from_string(r);
      } catch (const ValueError&) {
        usage_error("--residuals must be ram, bf16, int8, fp8_e4m3, disk or disk+<codec>, got '" + r + "'");
      }
    } else if (a == "--help" || a == "-h") {
      usage_error("help");
    } else {
      usage_error("unknown flag '" + a + "'");
    }
  }
  return o;
}

// ---- training ------------------------------------------------------------------------------------

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::int64_t correct(const Array& logits, const Array& labels) {
  const Array predicted = argmax(logits, -1);
  std::int64_t n = 0;
  for (std::int64_t i = 0; i < labels.numel(); ++i) n += predicted.data_i32()[i] == labels.data_i32()[i];
  return n;
}

struct Trainer {
  ResNet model;
  optim::GradientTransformation optimizer;
  Tree params, batch_stats, opt_state;
  std::optional<lift::Policy> residuals;  // --residuals

  Tree variables() const {
    Tree v{{"params", params}};
    if (!batch_stats.empty()) v.set("batch_stats", batch_stats);
    return v;
  }

  // One optimisation step on the global batch (x, y), split across the job's ranks; returns (loss,
  // accuracy), both over the global batch.
  std::pair<float, double> step(dist::DataParallel& dp, const Array& x, const Array& y, rng::Key dropout_key) {
    auto loss_fn = [&](const Tree& p, const Tree& batch, rng::Key key) {
      Tree vars{{"params", p}};
      if (!batch_stats.empty()) vars.set("batch_stats", batch_stats);
      const Array& labels = batch.at("y").array();
      std::optional<lift::ResidualScope> placed;
      if (residuals) placed.emplace(*residuals);
      auto [logits, updates] = apply(model, vars, {.rngs = {{"dropout", key}}, .mutable_collections = {"batch_stats"}},
                                     batch.at("x").array(), true);
      const float hits = static_cast<float>(correct(logits, labels));
      Tree aux{{"accuracy", Array::full(Shape{}, hits / static_cast<float>(labels.numel()))}};
      if (updates.contains("batch_stats")) aux.set("batch_stats", updates.at("batch_stats"));
      return std::make_pair(mean(nn::softmax_cross_entropy_with_integer_labels(logits, labels)), aux);
    };
    auto r = dp.value_and_grad(dist::LossWithAux(loss_fn), params, Tree{{"x", x}, {"y", y}}, dropout_key);
    // update() + apply_updates() in one pass per leaf, written in place (nothing else holds them).
    auto [next_params, next_state] = optimizer.step(std::move(params), r.grads, std::move(opt_state));
    params = std::move(next_params);
    opt_state = std::move(next_state);
    if (r.aux.contains("batch_stats")) batch_stats = r.aux.at("batch_stats");
    return {r.loss.item(), r.aux.at("accuracy").array().item()};
  }

  // Test accuracy; each rank takes its shard of every test batch and the ranks add up their hits.
  double evaluate(const datasets::ArrayDataset& test, std::int64_t batch) const {
    autodiff::NoGradGuard no_grad;
    datasets::DataLoader batches(test, {.batch_size = batch, .shuffle = false, .shard = datasets::ShardOptions::by_process()});
    std::int64_t hits = 0;
    for (const datasets::Batch& b : batches) {
      const Array& labels = b.data.at("label").array();
      if (labels.numel() == 0) continue;
      hits += correct(apply(model, variables(), b.data.at("image").array(), false), labels);
    }
    const Tree total = dist::allreduce_sum(Tree{{"hits", Array::full(Shape{}, static_cast<float>(hits))}});
    return static_cast<double>(total.at("hits").array().item()) / static_cast<double>(test.size());
  }
};

// Peak activation bytes of one forward and backward pass of `model` on (x, y): the peak of live array
// bytes during the pass beyond what was alive before, minus the gradients it returns (exact, from
// linum::memory's accounting). With `timeline`, the pass is also recorded op by op for the plot.
std::int64_t activation_peak(const ResNet& model, const Tree& params, const Tree& batch_stats, const Array& x,
                             const Array& y, const std::optional<lift::Policy>& residuals,
                             memory::Timeline* timeline = nullptr, const std::string& label = "") {
  auto loss_fn = [&](const Tree& p) {
    std::optional<lift::ResidualScope> placed;
    if (residuals) placed.emplace(*residuals);
    Tree vars{{"params", p}};
    if (!batch_stats.empty()) vars.set("batch_stats", batch_stats);
    auto [logits, updates] =
        apply(model, vars, {.rngs = {{"dropout", rng::key(0)}}, .mutable_collections = {"batch_stats"}}, x, true);
    return mean(nn::softmax_cross_entropy_with_integer_labels(logits, y));
  };
  std::optional<memory::TimelineRecorder> recorder;
  if (timeline != nullptr) recorder.emplace(label);
  memory::PeakScope scope;
  Tree grads = grad(loss_fn)(params);
  if (timeline != nullptr) *timeline = recorder->finish();
  return scope.peak_growth() - byte_count(grads);
}

// The wall time of one whole training step (every micro-batch, the reduction across ranks, the
// optimizer), the best of `repeats` runs after a warm-up. `probe` is a copy of the trainer, so the
// model being trained is untouched.
// One training step timed op by op (after a warm-up step): the table printed, the trace written.
void profile_step(Trainer probe, dist::DataParallel& dp, const Array& x, const Array& y, const fs::path& trace, bool lead) {
  probe.step(dp, x, y, rng::key(0));
  profiler::Profiler prof;
  {
    profiler::Range range("train step");
    probe.step(dp, x, y, rng::key(0));
  }
  const profiler::Profile p = prof.finish();
  if (!lead) return;
  std::printf("one training step, op by op (linum::profiler):\n%s", p.table({.row_limit = 20}).c_str());
  p.save_chrome_trace(trace);
  std::printf("wrote the step's trace to '%s' (open it in https://ui.perfetto.dev)\n", trace.c_str());
}

double step_seconds(Trainer probe, dist::DataParallel& dp, const Array& x, const Array& y, int repeats) {
  probe.step(dp, x, y, rng::key(0));
  double best = std::numeric_limits<double>::infinity();
  for (int r = 0; r < repeats; ++r) {
    const auto start = Clock::now();
    probe.step(dp, x, y, rng::key(0));
    best = std::min(best, since(start));
  }
  return best;
}

class Progress {
 public:
  Progress(int epoch, int epochs, std::int64_t total, bool shown)
      : epoch_(epoch), epochs_(epochs), total_(total), tty_(isatty(1)), shown_(shown) {}
  void update(std::int64_t done, double loss, double accuracy, double seconds, bool final) {
    if (!shown_) return;
    const double rate = seconds > 0 ? static_cast<double>(done) / seconds : 0.0;
    if (tty_) {
      const int width = 30, filled = static_cast<int>(width * done / std::max<std::int64_t>(total_, 1));
      std::printf("\repoch %d/%d [%s%s] %lld/%lld  %.0f ex/s  loss %.4f  acc %.4f", epoch_, epochs_,
                  std::string(filled, '#').c_str(), std::string(width - filled, '.').c_str(),
                  static_cast<long long>(done), static_cast<long long>(total_), rate, loss, accuracy);
      if (final) std::printf("\n");
      std::fflush(stdout);
    } else if (final || done >= next_) {
      std::printf("epoch %d/%d %lld/%lld  %.0f ex/s  loss %.4f  acc %.4f\n", epoch_, epochs_, static_cast<long long>(done),
                  static_cast<long long>(total_), rate, loss, accuracy);
      next_ = done + total_ / 5;
      std::fflush(stdout);
    }
  }

 private:
  int epoch_, epochs_;
  std::int64_t total_, next_ = 0;
  bool tty_, shown_;
};

Tree checkpoint_tree(const Trainer& t, int epochs_done, const Options& o, const datasets::DataLoader& loader) {
  Tree c{{"params", t.params}, {"opt_state", t.opt_state}, {"data", loader.state_tree()}};
  if (!t.batch_stats.empty()) c.set("batch_stats", t.batch_stats);
  c.set("progress", Tree{{"epochs_done", Array::full_i32(Shape{}, epochs_done)},
                         {"seed", Array::full_i32(Shape{}, o.seed)},
                         {"batch_norm", Array::full_i32(Shape{}, o.batch_norm)},
                         {"dropout", Array::full(Shape{}, static_cast<float>(o.dropout))}});
  return c;
}

int run(const Options& o) {
  const int rank = dist::rank(), ranks = dist::size();
  const bool lead = rank == 0;  // rank 0 prints, plots and writes the checkpoint
  datasets::ArrayDataset train, test;  // columns "image" f32[N, 28, 28, 1] in [0, 1], "label" i32[N]
  try {
    train = datasets::load_mnist(o.data, "train");
    test = datasets::load_mnist(o.data, "t10k");
  } catch (const IoError& e) {
    throw IoError(std::string("cannot read the dataset: ") + e.what() +
                  "\nInstall it with `apt-get install dataset-fashion-mnist` (files in /usr/share/datasets/fashion-mnist),\n"
                  "or pass --data DIR with train-/t10k-images-idx3-ubyte.gz and -labels-idx1-ubyte.gz (e.g. MNIST).");
  }
  if (o.limit > 0 && o.limit < train.size()) train = train.slice(0, o.limit);
  const std::int64_t n = train.size();
  if (lead) {
    std::printf("Fashion-MNIST: %lld training and %lld test images from %s\n", static_cast<long long>(n),
                static_cast<long long>(test.size()), o.data.c_str());
    if (ranks > 1)
      std::printf("data parallel on %d ranks: %s reduction%s\n", ranks,
                  o.reduction == dist::Reduction::reproducible ? "reproducible" : "fast",
                  o.reduction == dist::Reduction::reproducible
                      ? (" over " + std::to_string(o.micro_batches) + " micro-batches per batch").c_str()
                      : ", bucketed allreduce overlapping the backward pass");
  }
  dist::DataParallel dp({.reduction = o.reduction, .micro_batches = o.micro_batches, .aux = o.batch_stats_sync});

  const std::int64_t batch = std::min<std::int64_t>(o.batch, n);
  // The learning rate halves every epoch: a function of the step count alone (kept in the optimizer
  // state), so a resumed run continues the same schedule.
  const optim::Schedule lr = optim::exponential_decay(static_cast<float>(o.lr), n / batch, 0.5f);
  Trainer t{ResNet{.remat = o.remat, .depth = o.depth, .features = o.width, .batch_norm = o.batch_norm, .dropout = o.dropout,
                .dtype = o.dtype == DType::f32 ? std::nullopt : std::optional<DType>(o.dtype), .param_dtype = o.param_dtype},
            o.optimizer == "adam" ? optim::adam(lr) : optim::sgd(lr, 0.9), {}, {}, {}, residual_policy(o.residuals)};
  const Array& train_images = train.columns().at("image").array();
  const Array& train_labels = train.columns().at("label").array();
  const Array sample = slice_axis(train_images, 0, 0, batch);
  // Every rank starts from rank 0's variables.
  Tree vars = dist::broadcast(
      init(t.model, rng::Streams{{"params", rng::key(o.seed)}, {"dropout", rng::key(o.seed + 1)}}, sample, false));
  t.params = vars.at("params");
  if (vars.contains("batch_stats")) t.batch_stats = vars.at("batch_stats");
  t.opt_state = t.optimizer.init(t.params);
  int first_epoch = 0;
  // Every rank reads the same global batches (dist::DataParallel takes its rows of each): epoch e in
  // the order permutation(fold_in(key(seed), e)), the next batches gathered on the loader's thread.
  datasets::DataLoader loader(train, {.batch_size = batch, .seed = rng::key(o.seed), .drop_remainder = true,
                                  .num_epochs = o.epochs});

  // With --checkpoint-dir, checkpoints go through a CheckpointManager: one directory per epoch, the
  // last 3 kept, --resume from the latest; written on a background thread while the next epoch
  // trains (async_save).
  std::optional<CheckpointManager> manager;
  if (lead && !o.checkpoint_dir.empty())
    manager.emplace(o.checkpoint_dir, CheckpointManagerOptions{.max_to_keep = 3, .async_save = true});
  const std::string source = o.checkpoint_dir.empty() ? o.checkpoint.string() : o.checkpoint_dir.string();
  if (o.resume || o.eval_only) {
    // Rank 0 reads the checkpoint and sends it to the others (they need no shared file system).
    Tree c;
    if (lead) {
      const bool found = manager ? manager->latest_step().has_value() : fs::exists(o.checkpoint);
      if (!found)
        throw ValueError("no checkpoint at '" + source + "' to " + (o.eval_only ? "evaluate" : "resume from") +
                         "; train first (without --resume/--eval)");
      c = manager ? manager->restore(*manager->latest_step(), checkpoint_tree(t, 0, o, loader)) : serialization::load(o.checkpoint);
      const Tree& progress = c.at("progress");
      if (progress.at("seed").array().item() != o.seed ||
          static_cast<bool>(progress.at("batch_norm").array().item()) != o.batch_norm ||
          progress.at("dropout").array().item() != static_cast<float>(o.dropout))
        throw ValueError("the checkpoint was trained with other --seed/--no-batchnorm/--dropout; pass the same flags");
      if (!same_structure(c.at("params"), t.params)) throw ValueError("the checkpoint's parameters do not fit this model");
    }
    c = dist::broadcast(c);
    t.params = c.at("params");
    t.opt_state = c.at("opt_state");
    if (c.contains("batch_stats")) t.batch_stats = c.at("batch_stats");
    first_epoch = static_cast<int>(c.at("progress").at("epochs_done").array().item());
    if (first_epoch < o.epochs) {
      if (c.contains("data")) loader.restore(c.at("data"));  // ValueError if --batch or --limit changed
      else loader.seek({first_epoch, 0});                     // a checkpoint from before the loader
    }
    if (lead) std::printf("loaded '%s' (%d epoch(s) done)\n", source.c_str(), first_epoch);
  }
  dist::check_replicated(t.params, "the parameters at the start");

  // What remat buys: the activation memory of one forward and backward pass (the rows one pass
  // takes: a micro-batch, or the rank's shard with --reduction fast) and the time of one whole
  // training step, with the chosen remat and without; for the plot, each choice's pass op by op.
  const Array mx = slice_axis(train_images, 0, 0, batch);
  const Array my = slice_axis(train_labels, 0, 0, batch);
  const std::int64_t pass_rows =
      std::max<std::int64_t>(1, batch / (o.reduction == dist::Reduction::reproducible ? o.micro_batches : ranks));
  const Array px = slice_axis(mx, 0, 0, pass_rows), py = slice_axis(my, 0, 0, pass_rows);
  const bool plot = lead && o.measure && !o.memory_plot.empty();
  std::map<Remat, std::int64_t> peaks;
  std::map<Remat, double> seconds;
  std::vector<memory::Timeline> runs;
  for (Remat r : {Remat::none, Remat::dots, Remat::full}) {
    if (!o.measure) break;
    if (r != Remat::none && r != o.remat && !plot) continue;
    Trainer probe = t;
    probe.model.remat = r;
    if (r == Remat::none) probe.residuals.reset();  // the plain step keeps every residual in RAM
    if (plot) runs.emplace_back();
    if (lead)
      peaks[r] = activation_peak(probe.model, probe.params, probe.batch_stats, px, py, probe.residuals,
                                 plot ? &runs.back() : nullptr,
                                 r == Remat::none ? "no remat"
                                                  : std::string("remat per block, ") + remat_name(r) +
                                                        (r == Remat::dots ? " (convolutions saved)" : " (nothing saved)"));
    if (r == Remat::none || r == o.remat) seconds[r] = step_seconds(probe, dp, mx, my, /*repeats=*/3);
  }
  if (plot) {
    memory::save_svg(o.memory_plot, runs,
                     {.title = "Fashion-MNIST ResNet, " + std::to_string(o.depth) + " blocks: live array memory over a forward and backward pass (" +
                               std::to_string(pass_rows) + " images)",
                      .above_start = true});
    std::printf("wrote the memory timeline of a forward and backward pass to '%s'\n", o.memory_plot.c_str());
  }

  if (!o.profile.empty()) profile_step(t, dp, mx, my, o.profile, lead);

  double train_seconds = 0, final_train_loss = 0;
  int epochs_run = 0;
  if (!o.eval_only) {
    for (int epoch = first_epoch; epoch < o.epochs; ++epoch) {
      const rng::Key epoch_key = rng::fold_in(rng::key(o.seed + 1), static_cast<std::uint32_t>(epoch));
      Progress bar(epoch + 1, o.epochs, loader.batches_per_epoch() * batch, lead);
      const auto start = Clock::now();
      double loss_sum = 0, accuracy_sum = 0;
      std::int64_t seen = 0, steps = 0;
      for (std::int64_t k = 0; k < loader.batches_per_epoch(); ++k) {
        const datasets::Batch b = *loader.next();
        const std::int64_t count = b.global_rows;
        auto [loss, accuracy] = t.step(dp, b.data.at("image").array(), b.data.at("label").array(),
                                       rng::fold_in(epoch_key, static_cast<std::uint32_t>(b.index)));
        loss_sum += loss;
        accuracy_sum += accuracy * static_cast<double>(count);
        seen += count;
        ++steps;
        bar.update(seen, loss_sum / static_cast<double>(steps), accuracy_sum / static_cast<double>(seen), since(start), false);
      }
      const double seconds = since(start);
      bar.update(seen, loss_sum / static_cast<double>(std::max<std::int64_t>(steps, 1)),
                 accuracy_sum / static_cast<double>(std::max<std::int64_t>(seen, 1)), seconds, true);
      train_seconds += seconds;
      final_train_loss = loss_sum / static_cast<double>(std::max<std::int64_t>(steps, 1));
      ++epochs_run;
      if (manager)  // a directory per epoch, atomic (temporary directory + rename), in the background
        manager->save(epoch + 1, checkpoint_tree(t, epoch + 1, o, loader), {{"train_loss", loss_sum / static_cast<double>(std::max<std::int64_t>(steps, 1))}});
      else if (lead)
        serialization::save(o.checkpoint, checkpoint_tree(t, epoch + 1, o, loader));  // atomic: temp file + rename
    }
  }
  if (manager) manager->wait_until_finished();  // the last epoch's checkpoint on disk (or its error thrown)
  dist::check_replicated(t.params, "the parameters after training");

  const double accuracy = t.evaluate(test, 500);
  if (!lead) return 0;
  const double per_epoch = epochs_run ? train_seconds / epochs_run : 0.0;
  std::printf("test accuracy %.4f", accuracy);
  if (epochs_run) std::printf(", %.1f s per epoch", per_epoch);
  if (o.measure) {
    const std::int64_t peak = peaks.at(o.remat), peak_plain = peaks.at(Remat::none);
    const double step = seconds.at(o.remat), step_plain = seconds.at(Remat::none);
    std::printf("\nactivation memory of a forward and backward pass (%lld images): %.1f MiB with remat=%s%s, %.1f MiB without remat\n",
                static_cast<long long>(pass_rows), peak / 1048576.0, remat_name(o.remat),
                o.residuals == storage::Placement{} ? "" : (" and residuals=" + o.residuals.str()).c_str(), peak_plain / 1048576.0);
    std::printf("time of a training step (batch %lld): %.3f s with remat=%s, %.3f s without remat", static_cast<long long>(batch),
                step, remat_name(o.remat), step_plain);
    if (o.remat != Remat::none && peak > 0)
      std::printf("\nremat: %.1fx less activation memory for %.2fx the step time",
                  static_cast<double>(peak_plain) / static_cast<double>(peak), step / step_plain);
  }
  std::printf("\n");
  nlohmann::json result = {{"test_accuracy", accuracy},
                                 {"epochs", o.eval_only ? first_epoch : o.epochs},
                                 {"seconds_per_epoch", per_epoch},
                                 {"remat", remat_name(o.remat)},
                                 {"residuals", o.residuals.str()},
                                 {"dtype", dtype_short_name(o.dtype)},
                                 {"param_dtype", dtype_short_name(o.param_dtype)},
                                 {"final_train_loss", final_train_loss},
                                 {"ranks", ranks},
                                 {"reduction", o.reduction == dist::Reduction::reproducible ? "reproducible" : "fast"},
                                 {"micro_batches", o.micro_batches},
                                 {"params_checksum", dist::checksum_hex(t.params)},
                                 {"depth", o.depth},
                                 {"width", o.width}};
  if (o.measure) {  // (without the measurement these fields are absent, not zero)
    result["peak_activation_bytes"] = peaks.at(o.remat);
    result["peak_activation_bytes_plain"] = peaks.at(Remat::none);
    result["step_seconds"] = seconds.at(o.remat);
    result["step_seconds_plain"] = seconds.at(Remat::none);
  }
  std::printf("%s\n", result.dump().c_str());
  return 0;
}

int main(int argc, char** argv) {
  dist::Session mpi(argc, argv);  // MPI when started by mpirun; a job of one otherwise
  const Options options = parse(argc, argv);
  if (options.reduction == dist::Reduction::reproducible && options.micro_batches < dist::size())
    usage_error("--micro-batches " + std::to_string(options.micro_batches) + " is fewer than the " +
                std::to_string(dist::size()) + " ranks; pass at least --micro-batches " + std::to_string(dist::size()));
  // An error on any rank ends the whole job with its message (a single process prints it and exits 1).
  return dist::run_or_abort([&] {
    try {
      return run(options);
    } catch (const linum::Error& e) {
      throw linum::Error(std::string("fashion_mnist: ") + e.what());
    }
  });
}
