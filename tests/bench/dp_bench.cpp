// linum-bench dp: the deep-MLP training step data-parallel over the ranks of an MPI job.
//
//   linum-bench dp [--layers 24] [--width 512] [--batch 2048] [--steps 5] [--threads T]
//                  [--reduction fast|reproducible] [--micro-batches 8] [--bucket-mib 4] [--overlap 1|0]
//                  [--zero 0|1|2|3] [--optimizer sgd|adam]
//   mpirun -np 2 linum-bench dp --threads 1 ...
//
// The micro-batch count defaults to 8 (the library's default) whatever the rank count, so
// reproducible runs print the same params_checksum on 1, 2 and 3 ranks (M >= ranks is required).
// With --zero S the step runs through dist::ShardedDataParallel at stage S (0: everything whole,
// the optimizer on every rank; 1: optimizer state sharded; 2: gradients reduce-scattered too; 3:
// parameters sliced too, gathered when a module reads them; the MLP runs as modules at every stage) with
// adam by default, and the line adds this rank's bytes by kind (params, gradients,
// optimizer_state, activations; the largest over ranks) and the parameter gather's time; at stage 3
// with --overlap 1 (the default) exposed_s is the time the step waited in MPI (nonblocking gathers
// and exchanges, and the per-round loss exchange) and prefetched_gathers the gathers per step that
// started ahead of their read.
//
// The model of linum-bench mlp (L x Dense(W) + GELU, loss mean(h * h), float32) trained with SGD on
// a global batch of B split across the ranks by dist::DataParallel. Rank 0 prints one JSON line:
// step_s_min / step_s_median (the whole step, optimizer included), and, per step on rank 0,
// compute_s (forward + backward), communication_s (time inside MPI calls), exposed_s (the time the
// step waited for communication after its backward pass), hidden_fraction (1 - exposed /
// communication: the share of communication that ran during the backward pass), bytes_sent (the
// payload this rank handed to MPI), wire_bytes (what its link carries out with ring algorithms: a
// two-machine job sends this over the network per step) and messages.
#include <linum/linum.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "bench_util.hpp"

using namespace linum_bench;

namespace {

Tree mlp_params(long L, long W) {
  Tree params;
  for (long l = 0; l < L; ++l)
    params.set("layer_" + std::to_string(l),
               Tree{{"kernel", random_normal(Shape{W, W}, static_cast<unsigned>(2 * l + 1), 1.0f / std::sqrt(static_cast<float>(W)))},
                    {"bias", Array::zeros(Shape{W})}});
  return dist::broadcast(params);
}

auto mlp_loss(long L) {
  return [L](const Tree& p, const Tree& b, rng::Key) {
    Array h = b.at("x").array();
    for (long l = 0; l < L; ++l) {
      const Tree& layer = p.at("layer_" + std::to_string(l));
      h = gelu(matmul(h, layer.at("kernel").array()) + layer.at("bias").array());
    }
    return mean(h * h);
  };
}

// The same MLP as modules (stage 3 gathers a parameter when a module reads it).
struct BenchLayer {
  Array operator()(Scope& s, const Array& h) const {
    const Array kernel = s.param("kernel", initializers::zeros(), Shape{h.dim(1), h.dim(1)});
    return gelu(matmul(h, kernel) + s.param("bias", initializers::zeros(), Shape{h.dim(1)}));
  }
};
struct BenchMlp {
  long layers = 0;
  Array operator()(Scope& s, const Array& x) const {
    Array h = x;
    for (long l = 0; l < layers; ++l) h = s("layer_" + std::to_string(l), BenchLayer{}, h);
    return h;
  }
};

std::int64_t max_over_ranks(std::int64_t v) {
  std::int64_t m = 0;
  for (auto x : dist::allgather(static_cast<std::uint64_t>(v))) m = std::max(m, static_cast<std::int64_t>(x));
  return m;
}

int bench_zero(const Flags& f, const dist::DataParallelOptions& options, int stage, const std::string& optimizer, int threads) {
  const long L = f.get("layers", 24), W = f.get("width", 512), B = f.get("batch", 2048), steps = f.get("steps", 5);
  const auto opt = optimizer == "adam" ? optim::adam(1e-3) : optim::sgd(1e-3);
  dist::ShardedDataParallel trainer(mlp_params(L, W), opt, {.stage = stage, .data = options});
  const Tree batch{{"x", random_normal(Shape{B, W}, 7u, 1.0f)}};
  const auto loss = [L](const Tree& p, const Tree& b, rng::Key) {
    const Array h = apply(BenchMlp{L}, Tree{{"params", p}}, b.at("x").array());
    return mean(h * h);
  };
  std::vector<double> times;
  dist::StepStats last;
  double compute = 0, comm = 0, exposed = 0, gather = 0, optimizer_s = 0;
  long prefetched = 0;
  for (long s = 0; s < steps + 1; ++s) {  // the first step warms up
    dist::barrier();
    const auto start = std::chrono::steady_clock::now();
    auto r = trainer.step(dist::Loss(loss), batch, rng::key(0));
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (s == 0) continue;
    times.push_back(took);
    compute += r.stats.compute_s;
    comm += r.stats.communication_s;
    exposed += r.stats.exposed_s;
    prefetched += r.prefetched_gathers;
    gather += r.gather_s;
    optimizer_s += r.optimizer_s;
    last = r.stats;
  }
  dist::check_replicated(trainer.params(), "the parameters after the benchmark's steps");
  std::vector<double> sorted = times;
  std::sort(sorted.begin(), sorted.end());
  const double n = static_cast<double>(times.size());
  const dist::RankBytes bytes = trainer.memory();
  nlohmann::json out = {{"bench", "dp"},
                        {"zero_stage", stage},
                        {"ranks", dist::size()},
                        {"threads_per_rank", threads},
                        {"reduction", options.reduction == dist::Reduction::fast ? "fast" : "reproducible"},
                        {"optimizer", optimizer},
                        {"micro_batches", options.reduction == dist::Reduction::fast ? 0 : options.micro_batches},
                        {"layers", L},
                        {"width", W},
                        {"batch", B},
                        {"steps", steps},
                        {"step_s_min", sorted.front()},
                        {"step_s_median", sorted[sorted.size() / 2]},
                        {"compute_s", compute / n},
                        {"communication_s", comm / n},
                        {"exposed_s", exposed / n},
                        {"overlap", options.overlap},
                        {"prefetched_gathers", static_cast<double>(prefetched) / n},
                        {"gather_s", gather / n},
                        {"optimizer_s", optimizer_s / n},
                        {"param_bytes", byte_count(trainer.params())},
                        {"rank_params_bytes", max_over_ranks(bytes.params)},
                        {"rank_gradient_bytes", max_over_ranks(bytes.gradients)},
                        {"rank_optimizer_state_bytes", max_over_ranks(bytes.optimizer_state)},
                        {"rank_activation_bytes", max_over_ranks(bytes.activations)},
                        {"rank_state_bytes", max_over_ranks(bytes.state())},
                        {"bytes_sent", last.bytes_sent},
                        {"wire_bytes", last.wire_bytes},
                        {"messages", last.messages},
                        {"params_checksum", dist::checksum_hex(trainer.params())}};
  if (dist::rank() == 0) std::cout << out.dump() << std::endl;
  return 0;
}

}  // namespace

int bench_dp(const Flags& f) {
  const long L = f.get("layers", 24), W = f.get("width", 512), B = f.get("batch", 2048), steps = f.get("steps", 5);
  const int threads = static_cast<int>(f.get("threads", 2));
#ifdef _OPENMP
  omp_set_num_threads(threads);
#endif
  const std::string reduction = f.text("reduction", "fast");
  if (reduction != "fast" && reduction != "reproducible") throw ValueError("--reduction must be fast or reproducible");
  dist::DataParallelOptions options;
  options.reduction = reduction == "fast" ? dist::Reduction::fast : dist::Reduction::reproducible;
  options.micro_batches = static_cast<int>(f.get("micro-batches", 8));
  options.bucket_bytes = f.get("bucket-mib", 4) << 20;
  options.overlap = f.get("overlap", 1) != 0;
  const long zero = f.get("zero", -1);
  const std::string optimizer = f.text("optimizer", zero >= 0 ? "adam" : "sgd");
  if (optimizer != "sgd" && optimizer != "adam") throw ValueError("--optimizer must be sgd or adam");
  if (zero >= 0) return bench_zero(f, options, static_cast<int>(zero), optimizer, threads);
  dist::DataParallel dp(options);

  Tree params = mlp_params(L, W);
  const Tree batch{{"x", random_normal(Shape{B, W}, 7u, 1.0f)}};
  const auto loss = mlp_loss(L);
  const auto sgd = optimizer == "adam" ? optim::adam(1e-3) : optim::sgd(1e-3);
  Tree opt_state = sgd.init(params);

  std::vector<double> times;
  dist::StepStats last;
  double compute = 0, comm = 0, exposed = 0;
  for (long s = 0; s < steps + 1; ++s) {  // the first step warms up (primitives, buffers)
    dist::barrier();
    const auto start = std::chrono::steady_clock::now();
    auto r = dp.value_and_grad(dist::Loss(loss), params, batch, rng::key(0));
    auto [updates, next] = sgd.update(r.grads, opt_state, params);
    params = optim::apply_updates(params, updates);
    opt_state = next;
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (s == 0) continue;
    times.push_back(took);
    compute += r.stats.compute_s;
    comm += r.stats.communication_s;
    exposed += r.stats.exposed_s;
    last = r.stats;
  }
  dist::check_replicated(params, "the parameters after the benchmark's steps");
  std::vector<double> sorted = times;
  std::sort(sorted.begin(), sorted.end());
  const double n = static_cast<double>(times.size());
  nlohmann::json out = {{"bench", "dp"},
                        {"ranks", dist::size()},
                        {"threads_per_rank", threads},
                        {"reduction", reduction},
                        {"optimizer", optimizer},
                        {"overlap", options.overlap && options.reduction == dist::Reduction::fast && dist::size() > 1 &&
                                        dist::Session::threads_supported()},
                        {"micro_batches", options.reduction == dist::Reduction::fast ? 0 : options.micro_batches},
                        {"bucket_bytes", options.bucket_bytes},
                        {"layers", L},
                        {"width", W},
                        {"batch", B},
                        {"steps", steps},
                        {"step_s_min", sorted.front()},
                        {"step_s_median", sorted[sorted.size() / 2]},
                        {"compute_s", compute / n},
                        {"communication_s", comm / n},
                        {"exposed_s", exposed / n},
                        {"hidden_fraction", comm > 0 ? std::max(0.0, 1.0 - exposed / comm) : 0.0},
                        {"param_bytes", byte_count(params)},
                        {"bytes_sent", last.bytes_sent},
                        {"wire_bytes", last.wire_bytes},
                        {"messages", last.messages},
                        {"params_checksum", dist::checksum_hex(params)}};
  if (dist::rank() == 0) std::cout << out.dump() << std::endl;
  return 0;
}
