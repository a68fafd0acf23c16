// linum-bench: measured speed and memory, printed as one JSON line per variant.
//
//   linum-bench mlp [--layers L] [--width W] [--batch B] [--steps S] [--threads T] [--variant V]
//                   [--dtype f32|bf16] [--engine onednn|eigen] [--memory-plot FILE.svg] [--profile ROWS]
//       The deep-MLP training step: L x (Dense(W) + GELU) on a batch of B, loss mean(h * h),
//       parameters kept in float32 and cast to --dtype for the computation (Flax's dtype=bf16 with
//       param_dtype=float32, PyTorch's autocast),
//       forward + backward, in these variants: plain (each layer one fused op: linear(h, W, b,
//       Activation::gelu), as nn::Dense{.activation = gelu}), plain_unfused (the product, the bias
//       add and the GELU as three ops), remat_every (each layer checkpointed,
//       nothing_saveable), remat_dots (each layer unfused, dots_saveable: the product saved, the GELU recomputed), remat_names (each layer, its
//       pre-activation saved by save_only_these_names), remat_sqrt (sqrt(L) segments, all
//       but the last checkpointed, as PyTorch's checkpoint_sequential),
//       offload_every (plain layers, every computed residual in the spill file: lift::ResidualScope
//       with offload(everything_saveable); --spill-dir DIR, default $LINUM_SPILL_DIR or /tmp),
//       compress_bf16_every / compress_int8_every (the same, residuals compressed in RAM),
//       remat_offload_dots (each layer checkpointed, its product kept in the spill file). Fields: bench, variant, dtype, engine, step_s_min, step_s_median, model_gflops
//       (6 B W^2 L / step_s_min), gemm_gflops (the engine's raw product in --dtype on the
//       [B, W] x [W, W] shape, same run: the best of 10 products before the first variant and 10 after
//       each variant's steps),
//       gemm_ratio, peak_activation_bytes (exact accounting: peak live bytes during the step minus live
//       bytes before it), peak_rss_growth_mib, ops_recomputed/replayed/eliminated_per_step
//       (lift::recompute_stats: ops the recomputations ran, took from saved values, left out),
//       offloaded_peak_bytes, offload_written/read_bytes_per_step; then one more step with its
//       products timed (kernels/product_timing.hpp): profiled_step_s, products_per_step, products_s,
//       products_gflops_in_step (their speed inside the step, against gemm_gflops alone),
//       outside_products_s; plain_products_alone_s (the plain step's 3L - 1 products of the three
//       kinds, each timed alone, in cache) and plain_products_alone_ratio (that over step_s_min).
//       --profile ROWS: one more step timed op by op (linum::profiler), the first ROWS of its table on stderr.
//   linum-bench load [--layers L] [--width W] [--batch B] [--steps S] [--dtype f32|bf16] [--rounds R]
//       The plain deep-MLP step on a quiet machine and with one competing CPU-bound process pinned
//       to the last core, alternating R rounds in one invocation. Fields: bench, wait_policy (how
//       OpenMP threads wait in this run), adaptive_threads (core/threading.hpp), quiet_step_s, loaded_step_s (minimum over rounds of the
//       per-round median), slowdown = loaded / quiet.
//   linum-bench gpt [...]
//       A GPT-style training step with adam (see gpt_bench.cpp).
//   linum-bench scan [--layers L] [--width W] [--batch B] [--steps S] [--schedule none|every|sqrt|binomial]
//                    [--snapshots S]
//       The deep MLP as one lift::scan under a checkpointing schedule (see scan_bench.cpp).
//   linum-bench rnn [...]
//       An LSTM over growing sequence lengths: no remat, remat per time step, sqrt and binomial schedules (rnn_bench.cpp).
//   linum-bench dp [...]
//       The deep-MLP step data-parallel over an MPI job's ranks (see dp_bench.cpp).
//   linum-bench hvp [--layers L] [--width W] [--batch B] [--steps S]
//       A Hessian-vector product of the deep MLP, reverse over reverse and forward over reverse, with
//       and without remat per layer, against twice a plain gradient (hvp_bench.cpp).
//   linum-bench vmap [--members M] [--batch B] [--hidden H] [--examples N] [--steps S]
//       an ensemble of M MLPs trained in one lift::vmap call against a loop over M models, and
//       per-example gradients of N examples by vmap(grad) against N grad calls (vmap_bench.cpp).
//   linum-bench data [--records N] [--floats F] [--batch B] [--workers 1,2] [--transform-us U] [--dir DIR]
//       A dataset written in shards by FileDatasetWriter and read back cold through a shuffling
//       DataLoader with each worker count: records per second and peak resident memory (data_bench.cpp).
//   linum-bench dot-rate [--loops N] [--rounds R]
//       vfmadd231ps against vdpbf16ps on one core, the best of R rounds (dot_rate_bench.cpp): what
//       decides bf16_products() (engine.hpp).
//   linum-bench ops [--iters N]
//       Per-op cost on tiny arrays, with and without recording the autodiff graph, and with a
//       profiler recording (profiled_ns, constants: core/profiler.hpp).
//   linum-bench elementwise [--reps R]
//       Unfused binary ops (add, mul, maximum) on [2048, 512] with the second operand of the same
//       shape, a row (bias), a column and a scalar, and on [16, 64] with a row, in float32 and bf16.
//       Fields: bench, op, case, dtype, us_median, us_min (per op, over R timings of a batch of
//       calls), gb_per_s (the operands' and result's bytes over us_median).
//   linum-bench fused [--steps S] [--rounds R] [--dtype f32|bf16]
//       Fused ops against the ops they replace, forward + backward of sum(op(...) * r), alternating
//       R rounds: batch_norm (training statistics) against Flax's composed BatchNorm on the main
//       example's activations [128, 14, 14, 24]; batch_norm_residual_relu (relu(x + batch_norm(h)),
//       its residual and relu in the op) against batch_norm, add and relu on the same;
//       conv_transpose2d (stride 2, SAME, 3x3, 32 -> 16 channels on [128, 7, 7, 32]; on oneDNN the
//       backward-data kernel) against the convolution of the stride-dilated input. Fields: bench, op, dtype, engine, fused_s, composed_s (minimum
//       step), speedup = composed / fused.
#include <linum/linum.hpp>

#include <Eigen/Core>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "bench_util.hpp"

using namespace linum_bench;

namespace {

void run_variant(const std::string& variant, const std::function<Array(const std::vector<Array>&, const Array&)>& loss,
                 const std::vector<Array>& params, const Array& x, long L, long W, long B, long steps, int threads,
                 double gemm, DType dtype, std::vector<memory::Timeline>* timelines, int profile_rows);

int bench_mlp(const Flags& f) {
  const long L = f.get("layers", 24), W = f.get("width", 512), B = f.get("batch", 2048), steps = f.get("steps", 5);
  const int threads = static_cast<int>(f.get("threads", 2));
#ifdef _OPENMP
  omp_set_num_threads(threads);
#endif
  Eigen::setNbThreads(threads);
  apply_engine_flag(f);
  const DType dtype = parse_dtype(f.text("dtype", "f32"));
  const double gemm = gemm_gflops(B, W, W, dtype, 10);

  std::vector<Array> params;
  for (long l = 0; l < L; ++l) {
    params.push_back(random_normal(Shape{W, W}, static_cast<unsigned>(2 * l + 1), 1.0f / std::sqrt(static_cast<float>(W))));
    params.push_back(Array::zeros(Shape{W}));
  }
  const Array x = astype(random_normal(Shape{B, W}, 7u, 1.0f), dtype);

  // One layer: Dense(W) + GELU, as a function of (h, kernel, bias); float32 parameters are cast to
  // the computation dtype (a no-op for f32).
  auto layer = [dtype](const Array& h, const Array& w, const Array& b) {
    return gelu(matmul(h, astype(w, dtype)) + astype(b, dtype));
  };
  // The same layer as one fused op (nn::Dense{.activation = Activation::gelu, .dtype = dtype}): the
  // bias in the product's epilogue, the GELU's derivative and the bias gradient in one backward
  // pass, the parameters' casts inside the op.
  auto fused_layer = [dtype](const Array& h, const Array& w, const Array& b) {
    return linear(h, w, b, Activation::gelu, dtype);
  };
  const long segments = std::max(1L, static_cast<long>(std::sqrt(static_cast<double>(L))));
  struct Variant {
    std::string name;
    std::function<Array(const std::vector<Array>&, const Array&)> forward;
  };
  const auto every = checkpoint(fused_layer);
  const auto dots = checkpoint(layer, {.policy = policies::dots_saveable{}});
  // The same layer with its pre-activation named, saved by name: the replay runs only the GELU
  // (the product and the bias add are dead code once "preact" is saved).
  auto named_layer = [dtype](const Array& h, const Array& w, const Array& b) {
    return gelu(checkpoint_name(matmul(h, astype(w, dtype)) + astype(b, dtype), "preact"));
  };
  const auto names = checkpoint(named_layer, {.policy = policies::save_only_these_names({"preact"})});
  // The plain layers with their residuals placed by a policy (lift::ResidualScope): on disk, or
  // compressed in RAM. Nothing is recomputed.
  auto placed = [&](lift::Policy policy) {
    return [&, policy](const std::vector<Array>& p, const Array& x) {
      lift::ResidualScope scope(policy);
      Array h = x;
      for (long l = 0; l < L; ++l) h = fused_layer(h, p[2 * l], p[2 * l + 1]);
      return h;
    };
  };
  const auto offload_dots = checkpoint(layer, {.policy = policies::offload(policies::dots_saveable{})});
  const std::vector<Variant> variants = {
      {"plain",
       [&](const std::vector<Array>& p, const Array& x) {
         Array h = x;
         for (long l = 0; l < L; ++l) h = fused_layer(h, p[2 * l], p[2 * l + 1]);
         return h;
       }},
      {"plain_unfused",  // the product, the bias add and the GELU as three ops
       [&](const std::vector<Array>& p, const Array& x) {
         Array h = x;
         for (long l = 0; l < L; ++l) h = layer(h, p[2 * l], p[2 * l + 1]);
         return h;
       }},
      {"remat_every",
       [&](const std::vector<Array>& p, const Array& x) {
         Array h = x;
         for (long l = 0; l < L; ++l) h = every(h, p[2 * l], p[2 * l + 1]);
         return h;
       }},
      {"remat_dots",
       [&](const std::vector<Array>& p, const Array& x) {
         Array h = x;
         for (long l = 0; l < L; ++l) h = dots(h, p[2 * l], p[2 * l + 1]);
         return h;
       }},
      {"remat_names",
       [&](const std::vector<Array>& p, const Array& x) {
         Array h = x;
         for (long l = 0; l < L; ++l) h = names(h, p[2 * l], p[2 * l + 1]);
         return h;
       }},
      {"offload_every", placed(policies::offload(policies::everything_saveable{}))},
      {"compress_bf16_every", placed(policies::compress(storage::Codec::bf16, policies::everything_saveable{}))},
      {"compress_int8_every", placed(policies::compress(storage::Codec::int8, policies::everything_saveable{}))},
      {"remat_offload_dots",  // each layer checkpointed, its product kept on disk (the GELU recomputed)
       [&](const std::vector<Array>& p, const Array& x) {
         Array h = x;
         for (long l = 0; l < L; ++l) h = offload_dots(h, p[2 * l], p[2 * l + 1]);
         return h;
       }},
      {"remat_sqrt",  // sqrt(L) segments of consecutive layers, all but the last checkpointed
       [&](const std::vector<Array>& p, const Array& x) {
         // As torch.utils.checkpoint.checkpoint_sequential: segments - 1 checkpointed segments of
         // L / segments layers, then the rest plain (its backward pass follows at once, so
         // recomputing it would be wasted work).
         auto run = [&](long first, long last) {
           return [&, first, last](const Array& in) {
             Array z = in;
             for (long l = first; l < last; ++l) z = fused_layer(z, p[2 * l], p[2 * l + 1]);
             return z;
           };
         };
         Array h = x;
         const long per = L / segments;
         long first = 0;
         for (long s = 0; s + 1 < segments; ++s, first += per) h = checkpoint(run(first, first + per))(h);
         return run(first, L)(h);
       }},
  };
  const std::string only = f.text("variant", "");
  const std::string plot = f.text("memory-plot", "");
  std::vector<memory::Timeline> timelines;
  for (const Variant& v : variants) {
    if (!only.empty() && v.name != only) continue;
    run_variant(v.name, [&](const std::vector<Array>& p, const Array& in) {
      Array h = v.forward(p, in);
      return mean(h * h);
    }, params, x, L, W, B, steps, threads, gemm, dtype, plot.empty() ? nullptr : &timelines, static_cast<int>(f.get("profile", 0)));
  }
  if (!plot.empty()) {
    memory::save_svg(plot, timelines,
                     {.title = "Deep MLP (" + std::to_string(L) + " x Dense(" + std::to_string(W) + ") + GELU, batch " +
                               std::to_string(B) + ", " + dtype_short_name(dtype) + "): live memory over one training step"});
    std::cerr << "wrote the memory timelines to " << plot << "\n";
  }
  return 0;
}

void run_variant(const std::string& variant, const std::function<Array(const std::vector<Array>&, const Array&)>& loss,
                 const std::vector<Array>& params, const Array& x, long L, long W, long B, long steps, int threads,
                 double gemm, DType dtype, std::vector<memory::Timeline>* timelines, int profile_rows) {
  auto step = value_and_grad(loss);
  (void)step(params, x);  // warm-up
  std::vector<double> times;
  std::int64_t peak_activation = 0, offloaded_peak = 0;
  const memory::Stats io_before = memory::stats();
  const long rss_before = status_kib("VmRSS");
  reset_peak_rss();
  lift::reset_recompute_stats();
  for (long s = 0; s < steps; ++s) {
    memory::reset_peak();
    memory::PeakScope scope;
    auto t = Clock::now();
    auto [value, grads] = step(params, x);
    times.push_back(seconds_since(t));
    offloaded_peak = std::max(offloaded_peak, memory::stats().offloaded_peak_bytes);
    // Activations: the peak beyond what was live before, minus the gradients the step returns.
    std::int64_t grad_bytes = 0;
    for (const Array& g : grads) grad_bytes += static_cast<std::int64_t>(g.nbytes());
    peak_activation = std::max(peak_activation, scope.peak_growth() - grad_bytes);
  }
  const long rss_peak = status_kib("VmHWM");
  const memory::Stats io_after = memory::stats();
  const lift::RecomputeStats rs = lift::recompute_stats();
  // One more step with its products timed (after the timed steps, so the clock reads do not touch
  // them): how much of a step is products, and how fast they run inside it (operands coming back
  // from memory) against the same product alone (gemm_gflops, operands in cache).
  kernels::ProductTiming products;
  double timed_step = 0;
  {
    kernels::ProductTimingScope timing;
    auto t = Clock::now();
    (void)step(params, x);
    timed_step = seconds_since(t);
    products = timing.read();
  }
  if (profile_rows > 0) {  // one more step timed op by op (core/profiler.hpp): its table's first rows on stderr
    profiler::Profiler prof;
    {
      profiler::Range range("step");
      (void)step(params, x);
    }
    std::cerr << "mlp " << variant << ", one step op by op:\n" << prof.finish().table({.row_limit = profile_rows});
  }
  if (timelines != nullptr) {  // one more step, recorded op by op (after the timed ones)
    memory::TimelineRecorder recorder(variant);
    (void)step(params, x);
    timelines->push_back(recorder.finish());
  }
  std::sort(times.begin(), times.end());
  const double flops = 6.0 * B * W * W * L;
  // The product's speed is measured again after the steps and the faster measurement counts: one
  // measurement on a moment of this shared machine's noise made the ratio swing from 0.8 to 1.8.
  gemm = std::max(gemm, gemm_gflops(B, W, W, dtype, 10));
  const double products_alone = plain_products_alone_s(L, B, W, W, dtype, 10);
  nlohmann::json out = {
      {"bench", "mlp"},
      {"variant", variant},
      {"dtype", dtype_short_name(dtype)},
      {"engine", engine_name(engine())}, {"onednn_bf16_kernels", onednn_has_bf16_kernels()}, {"bf16_products", bf16_products_name(bf16_products())},
      {"layers", L},
      {"width", W},
      {"batch", B},
      {"threads", threads},
      {"steps", steps},
      {"step_s_min", times.front()},
      {"step_s_median", times[times.size() / 2]},
      {"model_gflops", flops / times.front() / 1e9},
      {"gemm_gflops", gemm},
      {"gemm_ratio", flops / times.front() / 1e9 / gemm},
      {"peak_activation_bytes", peak_activation},
      {"peak_rss_growth_mib", static_cast<double>(rss_peak - rss_before) / 1024.0},
      // The extra step with its products timed (kernels/product_timing.hpp): its time, the time
      // inside its products, their speed there, and the time outside them.
      {"profiled_step_s", timed_step},
      {"products_per_step", products.products},
      {"products_s", products.seconds},
      {"products_gflops_in_step", products.seconds > 0 ? products.flops / products.seconds / 1e9 : 0.0},
      {"outside_products_s", timed_step - products.seconds},
      // The plain step's 3L - 1 products, each kind timed alone in cache (bench_util.hpp), and that
      // time over the step's: the ratio a step with nothing but its products would reach (for
      // variants that recompute, the plain step's products only).
      {"plain_products_alone_s", products_alone},
      {"plain_products_alone_ratio", products_alone / times.front()},
      // Per step: ops the recomputations computed, took from saved values, and left out as dead code.
      {"ops_recomputed_per_step", rs.ops_recomputed / steps},
      {"ops_replayed_per_step", rs.ops_replayed / steps},
      {"ops_eliminated_per_step", rs.ops_eliminated / steps},
      // Residuals beyond RAM (offload_* and compress_* variants): the spill file's peak, bytes
      // written and read back per step.
      {"offloaded_peak_bytes", offloaded_peak},
      {"offload_written_bytes_per_step", (io_after.offload_written_bytes - io_before.offload_written_bytes) / steps},
      {"offload_read_bytes_per_step", (io_after.offload_read_bytes - io_before.offload_read_bytes) / steps},
  };

  std::cout << out.dump() << std::endl;
}

int bench_ops(const Flags& f) {
  const long iters = f.get("iters", 200000);
#ifdef _OPENMP
  omp_set_num_threads(1);
#endif
  const Array a = Array::from(Shape{4}, {1, 2, 3, 4});
  const Array b = Array::from(Shape{4}, {0.5f, 0.25f, 2, 1});
  struct OpCase {
    const char* name;
    std::function<Array(const Array&, const Array&)> fn;
  };
  const std::vector<OpCase> cases = {
      {"add", [](const Array& x, const Array& y) { return x + y; }},
      {"mul", [](const Array& x, const Array& y) { return x * y; }},
      {"exp", [](const Array& x, const Array&) { return exp(x); }},
      {"tanh", [](const Array& x, const Array&) { return tanh(x); }},
      {"sum", [](const Array& x, const Array&) { return sum(x); }},
      {"reshape", [](const Array& x, const Array&) { return reshape(x, {2, 2}); }},
  };
  for (const OpCase& c : cases) {
    auto time_it = [&](const Array& x, long n = 0) {
      if (n == 0) n = iters;
      double best = 1e30;
      for (int rep = 0; rep < 3; ++rep) {
        auto t = Clock::now();
        for (long i = 0; i < n; ++i) {
          Array y = c.fn(x, b);
          if (y.numel() == 0) std::abort();
        }
        best = std::min(best, seconds_since(t));
      }
      return best / static_cast<double>(n) * 1e9;
    };
    const double plain_ns = time_it(a);
    double recorded_ns;
    {
      autodiff::EnableGradGuard on;
      recorded_ns = time_it(autodiff::make_leaf(a));
    }
    double profiled_ns;  // with a profiler recording (an event per op; fewer iterations: each is kept)
    {
      profiler::Profiler prof;
      profiled_ns = time_it(a, std::max(1L, iters / 10));
    }
    nlohmann::json out = {{"bench", "ops"},
                          {"op", c.name},
                          {"shape", "(4,)"},
                          {"plain_ns", plain_ns},
                          {"recorded_ns", recorded_ns},
                          {"recording_overhead_ns", recorded_ns - plain_ns},
                          {"profiled_ns", profiled_ns}};
    std::cout << out.dump() << std::endl;
  }
  return 0;
}

int bench_elementwise(const Flags& f) {
  const long reps = f.get("reps", 31);
  struct Case {
    const char* name;
    Shape a, b;
  };
  const std::vector<Case> cases = {{"same", Shape{2048, 512}, Shape{2048, 512}}, {"row", Shape{2048, 512}, Shape{512}},
                                   {"column", Shape{2048, 512}, Shape{2048, 1}}, {"scalar", Shape{2048, 512}, Shape{}},
                                   {"small_row", Shape{16, 64}, Shape{64}}};
  struct Op {
    const char* name;
    Array (*fn)(const Array&, const Array&);
  };
  const std::vector<Op> ops = {{"add", [](const Array& x, const Array& y) { return add(x, y); }},
                               {"mul", [](const Array& x, const Array& y) { return mul(x, y); }},
                               {"maximum", [](const Array& x, const Array& y) { return maximum(x, y); }}};
  for (const DType dtype : {DType::f32, DType::bf16}) {
    for (const Case& c : cases) {
      const Array a = astype(random_normal(c.a, 1, 1.0f), dtype);
      // A scalar operand is weak, as a C++ float in an expression: it keeps bf16 bf16.
      const Array b = c.b.rank() == 0 ? Array::scalar(0.5f) : astype(random_normal(c.b, 2, 1.0f), dtype);
      const long batch = std::max(1L, 4000000L / std::max<long>(1, static_cast<long>(c.a.numel())));
      for (const Op& op : ops) {
        std::vector<double> us;
        for (long r = 0; r < reps; ++r) {
          auto t = Clock::now();
          for (long i = 0; i < batch; ++i) {
            Array y = op.fn(a, b);
            if (y.numel() == 0) std::abort();
          }
          us.push_back(seconds_since(t) / static_cast<double>(batch) * 1e6);
        }
        std::sort(us.begin(), us.end());
        const double median = us[us.size() / 2];
        const double bytes = static_cast<double>(a.nbytes() + b.nbytes() + a.nbytes());
        nlohmann::json out = {{"bench", "elementwise"}, {"op", op.name},     {"case", c.name},  {"dtype", dtype_short_name(dtype)},
                              {"us_median", median},    {"us_min", us.front()}, {"gb_per_s", bytes / median / 1e3}};
        std::cout << out.dump() << std::endl;
      }
    }
  }
  return 0;
}

int bench_fused(const Flags& f) {
  apply_engine_flag(f);
  const long steps = f.get("steps", 10), rounds = f.get("rounds", 3);
  const DType dtype = parse_dtype(f.text("dtype", "f32"));
  using Fn = std::function<Array(const std::vector<Array>&)>;
  struct Case {
    const char* op;
    std::vector<Array> inputs;
    Fn fused, composed;
  };
  std::vector<Case> cases;
  {
    const Array x = astype(random_normal(Shape{128, 14, 14, 24}, 21u, 1.0f), dtype);
    const Array scale = random_normal(Shape{24}, 22u, 0.1f) + 1.0f, bias = random_normal(Shape{24}, 23u, 0.1f);
    cases.push_back({"batch_norm", {x, scale, bias},
                     [dtype](const std::vector<Array>& in) { return batch_norm(in[0], in[1], in[2], {.dtype = dtype}).y; },
                     [dtype](const std::vector<Array>& in) {  // Flax's _compute_stats and _normalize, as ops
                       const Array xf = astype(in[0], DType::f32);
                       const Array mu = mean(xf, {0, 1, 2}, true);
                       const Array var = maximum(Array::scalar(0.0f), mean(square(xf), {0, 1, 2}, true) - square(mu));
                       return astype((xf - mu) * (rsqrt(var + 1e-5f) * in[1]) + in[2], dtype);
                     }});
  }
  {
    // A ResNet block's end, relu(x + BatchNorm(h)) (the main example's): the residual and relu in
    // the op against batch_norm, add and relu.
    const Array h = astype(random_normal(Shape{128, 14, 14, 24}, 27u, 1.0f), dtype);
    const Array x = astype(random_normal(Shape{128, 14, 14, 24}, 28u, 1.0f), dtype);
    const Array scale = random_normal(Shape{24}, 29u, 0.1f) + 1.0f, bias = random_normal(Shape{24}, 30u, 0.1f);
    cases.push_back({"batch_norm_residual_relu", {h, x, scale, bias},
                     [dtype](const std::vector<Array>& in) {
                       return batch_norm(in[0], in[2], in[3], {.dtype = dtype, .residual = in[1], .activation = Activation::relu}).y;
                     },
                     [dtype](const std::vector<Array>& in) { return relu(in[1] + batch_norm(in[0], in[2], in[3], {.dtype = dtype}).y); }});
  }
  {
    const Array x = astype(random_normal(Shape{128, 7, 7, 32}, 24u, 1.0f), dtype);
    const Array k = astype(random_normal(Shape{3, 3, 32, 16}, 25u, 0.1f), dtype);
    cases.push_back({"conv_transpose2d", {x, k},
                     [](const std::vector<Array>& in) { return conv_transpose2d(in[0], in[1], {.strides = {2, 2}}); },
                     [](const std::vector<Array>& in) {  // lax.conv_transpose's definition (SAME, k 3, s 2: pads 2, 1)
                       return conv2d(dilate(in[0], {1, 2, 2, 1}), in[1], {.padding = Padding::explicit_pads(2, 1, 2, 1)});
                     }});
  }
  for (const Case& c : cases) {
    const Array r = random_normal(c.fused(c.inputs).shape(), 26u, 1.0f);
    auto step_of = [&](const Fn& fn) {
      auto g = value_and_grad([&](const std::vector<Array>& in) { return sum(astype(fn(in), DType::f32) * r); });
      (void)g(c.inputs);  // warm-up (primitive caches)
      double best = 1e30;
      for (long s = 0; s < steps; ++s) {
        const auto t = Clock::now();
        (void)g(c.inputs);
        best = std::min(best, seconds_since(t));
      }
      return best;
    };
    double fused = 1e30, composed = 1e30;
    for (long round = 0; round < rounds; ++round) {
      fused = std::min(fused, step_of(c.fused));
      composed = std::min(composed, step_of(c.composed));
    }
    nlohmann::json out = {{"bench", "fused"},     {"op", c.op},         {"dtype", dtype_short_name(dtype)},
                          {"engine", engine_name(engine())}, {"threads", omp_get_max_threads_or_1()},
                          {"fused_s", fused},     {"composed_s", composed}, {"speedup", composed / fused}};
    std::cout << out.dump() << std::endl;
  }
  return 0;
}

}  // namespace

// A CPU-bound process pinned to `core` until killed.
pid_t start_competitor(int core) {
  const pid_t pid = fork();
  if (pid == 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(core, &set);
    sched_setaffinity(0, sizeof(set), &set);
    volatile std::uint64_t x = 0;
    for (;;) x = x + 1;
  }
  return pid;
}

int bench_load(const Flags& f) {
  const long L = f.get("layers", 24), W = f.get("width", 512), B = f.get("batch", 2048), steps = f.get("steps", 3);
  const long rounds = f.get("rounds", 2);
  const DType dtype = parse_dtype(f.text("dtype", "f32"));
  std::vector<Array> params;
  for (long l = 0; l < L; ++l) {
    params.push_back(random_normal(Shape{W, W}, static_cast<unsigned>(2 * l + 1), 1.0f / std::sqrt(static_cast<float>(W))));
    params.push_back(Array::zeros(Shape{W}));
  }
  const Array x = astype(random_normal(Shape{B, W}, 7u, 1.0f), dtype);
  auto loss = [&](const std::vector<Array>& p, const Array& in) {
    Array h = in;
    for (long l = 0; l < L; ++l) h = gelu(matmul(h, astype(p[2 * l], dtype)) + astype(p[2 * l + 1], dtype));
    return mean(h * h);
  };
  auto step = value_and_grad(loss);
  (void)step(params, x);  // warm-up
  auto median_step = [&] {
    std::vector<double> t;
    for (long s = 0; s < steps; ++s) {
      auto start = Clock::now();
      (void)step(params, x);
      t.push_back(seconds_since(start));
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  const int cores = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  double quiet = 1e30, loaded = 1e30;
  for (long r = 0; r < rounds; ++r) {
    quiet = std::min(quiet, median_step());
    const pid_t competitor = start_competitor(cores - 1);
    if (competitor < 0) throw Error("linum-bench load: fork failed");
    usleep(200000);  // let the scheduler settle
    loaded = std::min(loaded, median_step());
    kill(competitor, SIGKILL);
    waitpid(competitor, nullptr, 0);
  }
  nlohmann::json out = {{"bench", "load"},         {"wait_policy", openmp_wait_policy()}, {"adaptive_threads", adaptive_threads()},
                        {"dtype", dtype_short_name(dtype)}, {"layers", L}, {"width", W}, {"batch", B},
                        {"threads", omp_get_max_threads_or_1()}, {"quiet_step_s", quiet}, {"loaded_step_s", loaded},
                        {"slowdown", loaded / quiet}};
  std::cout << out.dump() << std::endl;
  return 0;
}

int bench_dp(const Flags& f);
int bench_rnn(const Flags& f);
int bench_hvp(const Flags& f);
int bench_vmap(const Flags& f);
int bench_dot_rate(const Flags& f);
int bench_data(const Flags& f);

int main(int argc, char** argv) {
  linum::dist::Session mpi(argc, argv);  // `mpirun -np N linum-bench dp` (MPI only under a launcher)
  if (argc < 2) {
    std::cerr << "usage: linum-bench mlp|gpt|scan|plan|dp|rnn|hvp|vmap|load|ops|fused|dot-rate|data [--name value ...]\n";
    return 2;
  }
  const std::string what = argv[1];
  try {
    const Flags flags = parse_flags(argc, argv, 2);
    // The spill file of every benchmark that offloads: --spill-dir DIR, --write-behind-mib N,
    // --read-ahead-mib N (defaults: $LINUM_SPILL_DIR or /tmp, 16, 16).
    storage::SpillOptions spill;
    spill.directory = flags.text("spill-dir", "");
    spill.write_behind_bytes = flags.get("write-behind-mib", 16) << 20;
    spill.read_ahead_bytes = flags.get("read-ahead-mib", 16) << 20;
    storage::set_spill_options(spill);
    if (what == "mlp") return bench_mlp(flags);
    if (what == "ops") return bench_ops(flags);
    if (what == "load") return bench_load(flags);
    if (what == "fused") return bench_fused(flags);
    if (what == "elementwise") return bench_elementwise(flags);
    if (what == "gpt") return bench_gpt(flags);
    if (what == "scan") return bench_scan(flags);
    if (what == "plan") return bench_plan(flags);
    if (what == "dp") return bench_dp(flags);
    if (what == "rnn") return bench_rnn(flags);
    if (what == "hvp") return bench_hvp(flags);
    if (what == "vmap") return bench_vmap(flags);
    if (what == "dot-rate") return bench_dot_rate(flags);
    if (what == "data") return bench_data(flags);
  } catch (const std::exception& e) {
    std::cerr << "linum-bench: " << e.what() << "\n";
    return 1;
  }
  std::cerr << "linum-bench: unknown benchmark '" << what << "' (choose mlp, gpt, scan, plan, dp, rnn, hvp, vmap, load, ops, elementwise, fused, dot-rate or data)\n";
  return 2;
}
