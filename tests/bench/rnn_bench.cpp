// linum-bench rnn: an LSTM (or with --model gru a GRU) over sequences of growing length, trained without remat, with remat per
// time step (nn::RNN{.remat = true}) and with checkpointing schedules over time
// (nn::RNN{.schedule = sqrt_segments() / binomial(s)}). A float32 LSTM runs on the fused layer op
// (lstm_layer), where remat and the schedules are its recompute segments (each step computed once
// more in the backward pass); `--cell scan` runs the same model step by step, the cell's own ops in
// lift::scan (a gate function nn::RNN does not recognize as sigmoid), where the schedules are lift's.
// A float32 GRU runs on gru_layer, where remat and the schedules keep only the outputs (each step's
// gates computed once more in the backward pass).
//
//   linum-bench rnn [--lengths 64,256,1024] [--batch 32] [--features 256] [--inputs 64] [--steps 3]
//                   [--snapshots 8] [--variants none,per_step,sqrt,binomial] [--cell layer|scan]
//                   [--model lstm|gru] [--dtype f32|bf16] [--masked 1]
//
// --dtype bf16: the cell computes in bf16 with float32 parameters (Flax's dtype / param_dtype).
// --masked 1: nn::RNN with seq_lengths, rows of lengths spread over [T/2, T] (Flax's rule: all steps
// run, each row's carry is picked at its length), the final carry's h added to the loss.
//
// One JSON line per (length, remat): peak_activation_bytes (the exact accounting's peak of a
// training step above what was alive before it, minus the gradients), step_s_min and the step
// evaluations (forward + recomputations: the plain pass makes `length`; the layer op's recompute
// segments twice that; lift's schedules count theirs).
#include <linum/linum.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "bench_util.hpp"

using namespace linum_bench;

int bench_rnn(const Flags& f) {
  std::vector<long> lengths;
  {
    std::stringstream in(f.text("lengths", "64,256,1024"));
    for (std::string item; std::getline(in, item, ',');) lengths.push_back(std::stol(item));
  }
  const long B = f.get("batch", 32), H = f.get("features", 256), I = f.get("inputs", 64), steps = f.get("steps", 3);
  const int snapshots = static_cast<int>(f.get("snapshots", 8));
  struct Variant {
    std::string key, name;
    bool remat;
    lift::ScanSchedule schedule;
  };
  const std::vector<Variant> variants{{"none", "none", false, {}},
                                      {"per_step", "per_step", true, {}},
                                      {"sqrt", "sqrt", false, lift::ScanSchedule::sqrt_segments()},
                                      {"binomial", "binomial_" + std::to_string(snapshots), false, lift::ScanSchedule::binomial(snapshots)}};
  const std::string chosen = "," + f.text("variants", "none,per_step,sqrt,binomial") + ",";
  const std::string path = f.text("cell", "layer");
  if (path != "layer" && path != "scan") {
    std::cerr << "linum-bench rnn: --cell is layer or scan\n";
    return 2;
  }
  const std::string model = f.text("model", "lstm");
  if (model != "lstm" && model != "gru") {
    std::cerr << "linum-bench rnn: --model is lstm or gru\n";
    return 2;
  }
  const std::string dtype_name = f.text("dtype", "f32");
  if (dtype_name != "f32" && dtype_name != "bf16") {
    std::cerr << "linum-bench rnn: --dtype is f32 or bf16\n";
    return 2;
  }
  const std::optional<DType> dtype = dtype_name == "bf16" ? std::optional<DType>(DType::bf16) : std::nullopt;
  const bool masked = f.get("masked", 0) != 0;
  // The scan path: the same cell with a gate function nn::RNN does not take for the layer op.
  const nn::CellFunction gate = path == "layer" ? nn::CellFunction(nn::Sigmoid{})
                                                : nn::CellFunction([](const Array& x) { return sigmoid(x); });
  for (long T : lengths) {
    const Array xs = random_normal(Shape{B, T, I}, 3u, 1.0f);
    std::vector<std::int32_t> length_values(static_cast<std::size_t>(B));
    for (long b = 0; b < B; ++b) length_values[static_cast<std::size_t>(b)] = static_cast<std::int32_t>(T - (T / 2) * b / std::max(1L, B - 1));
    const std::optional<Array> seq_lengths =
        masked ? std::optional<Array>(Array::from_i32(Shape{B}, length_values)) : std::nullopt;
    for (const Variant& v : variants) {
      if (chosen.find("," + v.key + ",") == std::string::npos) continue;
      const bool gru = model == "gru";
      const std::int64_t segment = gru ? (v.remat || v.schedule.kind != lift::ScanSchedule::Kind::none ? kLSTMLayerChunk : 0)
                                       : nn::recurrent_detail::lstm_recompute_segment(v.remat, v.schedule, T);
      double best = 1e30;
      std::int64_t peak = 0, evaluations = 0;
      auto measure = [&](const auto& rnn) {
        const Tree params = init(rnn, rng::key(0), xs).at("params");
        // Masked: the final carry (each row's at its length) joins the loss, as a user's would.
        auto loss = [&](const Tree& p) {
          auto [carry, ys] = apply(rnn, Tree{{"params", p}}, xs, nn::RNNOptions{.return_carry = masked, .seq_lengths = seq_lengths});
          Array l = mean(square(astype(ys, DType::f32)));
          if (masked) l = l + mean(astype(pytree::flatten(carry).back(), DType::f32));
          return l;
        };
        for (long s = 0; s < steps; ++s) {
          lift::reset_step_evaluations();
          memory::PeakScope scope;
          const auto start = std::chrono::steady_clock::now();
          Tree g = grad(loss)(params);
          best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
          peak = scope.peak_growth() - byte_count(g);
          evaluations = lift::step_evaluations();
        }
      };
      if (gru)
        measure(nn::RNN<nn::GRUCell>{.cell = {.features = H, .gate_fn = gate, .dtype = dtype}, .remat = v.remat, .schedule = v.schedule});
      else
        measure(nn::RNN<nn::LSTMCell>{.cell = {.features = H, .gate_fn = gate, .dtype = dtype}, .remat = v.remat, .schedule = v.schedule});
      if (path == "layer") evaluations = segment > 0 ? 2 * T : T;
      else if (v.schedule.kind == lift::ScanSchedule::Kind::none) evaluations = T;
      nlohmann::json out = {{"bench", "rnn"}, {"cell", gru ? "GRUCell" : "LSTMCell"}, {"path", path}, {"length", T}, {"batch", B},
                                  {"features", H}, {"inputs", I}, {"remat", v.name},
                                  {"step_evaluations", evaluations},
                                  {"peak_activation_bytes", peak}, {"step_s_min", best}, {"dtype", dtype_name}};
      if (masked) out["masked"] = true;
      if (path == "layer" && gru) out["recompute"] = segment > 0;  // nothing kept but the outputs
      else if (path == "layer") out["recompute_segment"] = segment;
      std::cout << out.dump() << std::endl;
    }
  }
  return 0;
}
