// linum-bench gpt: a GPT-style training step written with Linum's modules, the model of
// tests/bench/torch_gpt.py (its PyTorch peer): token + position Embed, `layers` pre-LayerNorm blocks
// (causal multi-head self-attention, a 4x tanh-GELU MLP, residuals; LayerNorm eps 1e-6), a final
// LayerNorm, a Dense head without bias, softmax cross-entropy on integer labels, adam(3e-4).
//
//   linum-bench gpt [--layers 8] [--batch 16] [--seq 256] [--dim 256] [--heads 4] [--vocab 256]
//                   [--steps 5] [--dtype f32|bf16] [--variant plain|remat|dots|scan_remat]
//
// One JSON line per variant: plain; remat (every block checkpointed, nothing saved); dots (every
// block checkpointed, dots_saveable); scan_remat (lift::scan over the rematted block). Fields:
// step_s_min, step_s_median (forward + backward + adam), fwd_bwd_s_median, adam_s (median of
// opt.step: the update applied to the parameters, in place), peak_activation_bytes (exact accounting: the peak of live
// bytes during forward + backward beyond what was live before, minus the gradients returned), loss
// of the first and last step.
#include "bench_util.hpp"
#include "gpt_model.hpp"

#include <nlohmann/json.hpp>

#include <vector>

namespace linum_bench {

namespace {

const char* stack_name(Stack s) {
  switch (s) {
    case Stack::plain: return "plain";
    case Stack::remat: return "remat";
    case Stack::dots: return "dots";
    case Stack::scan_remat: return "scan_remat";
  }
  return "?";
}

}  // namespace

int bench_gpt(const Flags& f) {
  const long layers = f.get("layers", 8), batch = f.get("batch", 16), seq = f.get("seq", 256), dim = f.get("dim", 256);
  const long heads = f.get("heads", 4), vocab = f.get("vocab", 256), steps = f.get("steps", 5);
  const int threads = static_cast<int>(f.get("threads", 2));
#ifdef _OPENMP
  omp_set_num_threads(threads);
#endif
  apply_engine_flag(f);
  const DType dtype = parse_dtype(f.text("dtype", "f32"));
  const std::string only = f.text("variant", "");
  for (Stack stack : {Stack::plain, Stack::remat, Stack::dots, Stack::scan_remat}) {
    if (!only.empty() && only != stack_name(stack)) continue;
    const Gpt model{.vocab = vocab, .dim = dim, .heads = heads, .layers = layers, .seq = seq,
                    .dtype = dtype == DType::f32 ? std::nullopt : std::optional<DType>(dtype), .stack = stack};
    auto [tokens0, labels0] = make_batch(batch, seq, vocab, 999);
    Tree params = init(model, rng::key(0), tokens0).at("params");
    const optim::GradientTransformation opt = optim::adam(3e-4);
    Tree opt_state = opt.init(params);
    auto loss_and_grads = [&](const Array& tokens, const Array& labels) {
      return value_and_grad([&](const Tree& p) {
        Array logits = apply(model, Tree{{"params", p}}, tokens);
        return mean(nn::softmax_cross_entropy_with_integer_labels(logits, labels));
      })(params);
    };
    std::vector<double> step_s, fb_s, adam_s;
    std::vector<float> losses;
    std::int64_t peak_activation = 0;
    for (long i = 0; i < steps + 1; ++i) {  // step 0 is the warm-up
      auto [tokens, labels] = make_batch(batch, seq, vocab, 1000 + static_cast<std::uint64_t>(i));
      const auto t0 = Clock::now();
      std::int64_t peak = 0;
      Tree grads;
      float loss = 0;
      {
        memory::PeakScope scope;
        auto [value, g] = loss_and_grads(tokens, labels);
        peak = scope.peak_growth() - byte_count(g);
        grads = std::move(g);
        loss = value.item();
      }
      const auto t1 = Clock::now();
      auto [next_params, next_state] = opt.step(std::move(params), grads, std::move(opt_state));
      params = std::move(next_params);
      opt_state = std::move(next_state);
      const auto t2 = Clock::now();
      losses.push_back(loss);
      if (i == 0) continue;
      fb_s.push_back(std::chrono::duration<double>(t1 - t0).count());
      adam_s.push_back(std::chrono::duration<double>(t2 - t1).count());
      step_s.push_back(std::chrono::duration<double>(t2 - t0).count());
      peak_activation = std::max(peak_activation, peak);
    }
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    nlohmann::json out = {
        {"bench", "gpt"},
        {"framework", "linum"},
        {"variant", stack_name(stack)},
        {"dtype", dtype_short_name(dtype)},
        {"engine", engine_name(engine())}, {"onednn_bf16_kernels", onednn_has_bf16_kernels()}, {"bf16_products", bf16_products_name(bf16_products())},
        {"threads", threads},
        {"layers", layers},
        {"batch", batch},
        {"seq", seq},
        {"params", param_count(params)},
        {"steps", steps},
        {"step_s_min", *std::min_element(step_s.begin(), step_s.end())},
        {"step_s_median", median(step_s)},
        {"fwd_bwd_s_median", median(fb_s)},
        {"adam_s", median(adam_s)},
        {"peak_activation_bytes", peak_activation},
        {"loss_first", losses.front()},
        {"loss_last", losses.back()},
    };
    std::cout << out.dump() << std::endl;
  }
  return 0;
}

}  // namespace linum_bench
