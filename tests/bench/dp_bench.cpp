// linum-bench dp: the deep-MLP training step data-parallel over the ranks of an MPI job.
//
//   linum-bench dp [--layers 24] [--width 512] [--batch 2048] [--steps 5] [--threads T]
//                  [--reduction fast|reproducible] [--micro-batches M] [--bucket-mib 4] [--overlap 1|0]
//   mpirun -np 2 linum-bench dp --threads 1 ...
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
  options.micro_batches = static_cast<int>(f.get("micro-batches", std::max(2, dist::size())));
  options.bucket_bytes = f.get("bucket-mib", 4) << 20;
  options.overlap = f.get("overlap", 1) != 0;
  dist::DataParallel dp(options);

  Tree params;
  for (long l = 0; l < L; ++l)
    params.set("layer_" + std::to_string(l),
               Tree{{"kernel", random_normal(Shape{W, W}, static_cast<unsigned>(2 * l + 1), 1.0f / std::sqrt(static_cast<float>(W)))},
                    {"bias", Array::zeros(Shape{W})}});
  params = dist::broadcast(params);
  const Tree batch{{"x", random_normal(Shape{B, W}, 7u, 1.0f)}};
  auto loss = [L](const Tree& p, const Tree& b, rng::Key) {
    Array h = b.at("x").array();
    for (long l = 0; l < L; ++l) {
      const Tree& layer = p.at("layer_" + std::to_string(l));
      h = gelu(matmul(h, layer.at("kernel").array()) + layer.at("bias").array());
    }
    return mean(h * h);
  };
  const auto sgd = optim::sgd(1e-3);
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
