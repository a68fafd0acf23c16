// linum-bench plan: lift::plan_remat on the deep MLP (L x (Dense(W) + GELU), loss mean(h * h)),
// against the uniform schedules a user would otherwise pick. The layers are grouped into
// floor(sqrt(L)) segment modules; the planner may remat a segment whole or plan inside it. The
// budget is the memory alive before a step (parameters, input), plus the gradients the step
// returns, plus --budget-fraction of the plain step's activations (its peak beyond those). One JSON line: budget_bytes, predicted_peak_bytes,
// measured_peak_bytes (the planned step under the exact accounting), step_s_min,
// plain_step_s_min, plain_peak_bytes, uniform_schedule / uniform_step_s_min / uniform_peak_bytes
// (the fastest of: every layer rematted saving nothing, every layer saving its products, sqrt(L)
// rematted segments, that fits the same budget; null when none fits), uniform (all of them), and
// the plan's policy counts. --memory-plot FILE.svg overlays plain, the uniform schedules and the
// plan. Same flags as `linum-bench mlp` otherwise (--layers --width --batch --steps --threads
// --dtype f32|bf16 --engine onednn|eigen).
// --allow none,full,dots (default) lists what a call may get: run plainly (none, always), remat saving
// nothing (full) or its products (dots), offload (three options: remat with its inputs in the
// spill file, offload(nothing_saveable); with its products there too, offload(dots_saveable); or
// no remat and every residual there, residuals(offload(everything_saveable))),
// compress / compress_bf16 (remat with its products kept int8- / bf16-compressed), offload_all
// (remat keeping every value in the spill file: nothing recomputed), offload_residuals /
// compress_residuals (the call runs plainly, its residuals in the spill file / int8-compressed:
// policies::residuals), split (the call run on 4 slices of its batch, each with its residuals in the
// spill file: policies::split_batch). Beyond recompute, the JSON also holds `recompute_only`: the plan
// over full and dots at the same budget; offloaded_bytes_per_step is what a planned step writes.
// --model gpt plans the transformer stack of `linum-bench gpt` instead (--layers 8 --batch 16
// --seq 256 --dim 256): each block rematted whole or planned inside (attention, MLP, norms),
// against every block rematted saving nothing or saving its products.
#include "bench_util.hpp"
#include "gpt_model.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <optional>

namespace linum_bench {
namespace {

struct Layer {
  std::int64_t width = 512;
  std::optional<DType> dtype;  // --dtype bf16: float32 parameters, bf16 computation (Flax's dtype)
  Array operator()(Scope& s, const Array& h) const { return gelu(s(nn::Dense{.features = width, .dtype = dtype}, h)); }
};
// The layers grouped into floor(sqrt(L)) consecutive segments: the planner chooses per segment
// (rematted whole, or planned layer by layer); the uniform schedules are every layer, or every segment.
struct Segment {
  std::int64_t width = 512;
  int layers = 5;
  std::optional<DType> dtype;
  Array operator()(Scope& s, Array h) const {
    for (int i = 0; i < layers; ++i) h = s(Layer{width, dtype}, h);
    return h;
  }
};
struct SegmentedMlp {
  std::int64_t width = 512;
  int layers = 24;
  std::optional<DType> dtype;
  Array operator()(Scope& s, Array h) const {
    const int per = static_cast<int>(std::ceil(static_cast<double>(layers) / std::floor(std::sqrt(static_cast<double>(layers)))));
    for (int first = 0; first < layers; first += per) h = s(Segment{width, std::min(per, layers - first), dtype}, h);
    return h;
  }
};

struct Trial {
  std::string name;
  double step_s_min = 0;
  std::int64_t peak_bytes = 0;
  std::int64_t offloaded_bytes = 0;  // written to the spill file per step
  memory::Timeline timeline;
};

// --allow: the options a call may get besides running plainly ("none", always allowed).
std::vector<lift::Policy> allowed_policies(const std::string& list) {
  std::vector<lift::Policy> out;
  std::size_t start = 0;
  while (start <= list.size()) {
    const std::size_t comma = std::min(list.find(',', start), list.size());
    const std::string name = list.substr(start, comma - start);
    start = comma + 1;
    if (name == "none" || name.empty()) continue;
    if (name == "full") out.push_back(policies::nothing_saveable{});
    else if (name == "dots") out.push_back(policies::dots_saveable{});
    else if (name == "offload") {  // remat with its inputs (and products) in the spill file; or no remat, its residuals there
      out.push_back(policies::offload(policies::nothing_saveable{}));
      out.push_back(policies::offload(policies::dots_saveable{}));
      out.push_back(policies::residuals(policies::offload(policies::everything_saveable{})));
    }
    else if (name == "split")  // run on 4 slices of the batch, each with its residuals in the spill file
      out.push_back(policies::split_batch(4, policies::residuals(policies::offload(policies::everything_saveable{}))));
    else if (name == "compress") out.push_back(policies::compress(storage::Codec::int8, policies::dots_saveable{}));
    else if (name == "compress_bf16") out.push_back(policies::compress(storage::Codec::bf16, policies::dots_saveable{}));
    else if (name == "offload_all") out.push_back(policies::offload(policies::everything_saveable{}));
    else if (name == "offload_residuals") out.push_back(policies::residuals(policies::offload(policies::everything_saveable{})));
    else if (name == "compress_residuals")
      out.push_back(policies::residuals(policies::compress(storage::Codec::int8, policies::everything_saveable{})));
    else
      throw ValueError("--allow: '" + name + "' is none of none, full, dots, offload, split, compress, compress_bf16, offload_all, "
                     "offload_residuals, compress_residuals");
  }
  return out;
}

// Times `step` (min over `steps`), measures its exact peak and records its timeline, all under `plan`.
Trial run_trial(const std::string& name, const std::function<void()>& step, const lift::RematPlan* plan, long steps) {
  std::optional<lift::PlanScope> scope;
  if (plan != nullptr) scope.emplace(*plan);
  step();  // warm-up
  Trial t{name};
  t.step_s_min = 1e30;
  const std::int64_t written = memory::stats().offload_written_bytes;
  for (long s = 0; s < steps; ++s) {
    memory::PeakScope peak;
    const auto start = Clock::now();
    step();
    t.step_s_min = std::min(t.step_s_min, seconds_since(start));
    t.peak_bytes = std::max(t.peak_bytes, peak.peak_bytes());
  }
  t.offloaded_bytes = (memory::stats().offload_written_bytes - written) / std::max(steps, 1L);
  memory::TimelineRecorder recorder(name);
  step();
  t.timeline = recorder.finish();
  return t;
}

// Where a step's RAM peak happens: the op, its module path and the phase ("backward", ...).
nlohmann::json peak_at(const memory::Timeline& timeline) {
  const memory::TimelinePoint* p = timeline.peak_point();
  if (p == nullptr) return nullptr;
  return {{"op", p->op}, {"path", p->path}, {"phase", p->phase}, {"live_bytes", p->live_bytes}};
}

// A plan that gives every call at depth 1 the same policy.
lift::RematPlan uniform_plan(const std::vector<std::string>& paths, const lift::Policy& p) {
  lift::RematPlan plan;
  for (const auto& path : paths) plan.calls.push_back({path, p, 0, 0.0});
  return plan;
}

}  // namespace

int bench_plan(const Flags& f) {
  const std::string which = f.text("model", "mlp");
  const bool gpt = which == "gpt";
  if (!gpt && which != "mlp") throw ValueError("--model must be mlp or gpt, got '" + which + "'");
  const long L = f.get("layers", gpt ? 8 : 24), W = f.get("width", 512), B = f.get("batch", gpt ? 16 : 2048);
  const long steps = f.get("steps", 3), seq = f.get("seq", 256), dim = f.get("dim", 256);
  const double fraction = std::stod(f.text("budget-fraction", "0.5"));
  const int threads = static_cast<int>(f.get("threads", 2));
#ifdef _OPENMP
  omp_set_num_threads(threads);
#endif
  apply_engine_flag(f);
  const DType dtype = parse_dtype(f.text("dtype", "f32"));
  const std::optional<DType> compute = dtype == DType::f32 ? std::nullopt : std::optional<DType>(dtype);
  // The model and its training step, and the paths the uniform schedules remat.
  const SegmentedMlp mlp{W, static_cast<int>(L), compute};
  const Gpt gpt_model{.dim = dim, .layers = L, .seq = seq, .dtype = compute};
  const Array x = random_normal(Shape{gpt ? 1 : B, W}, 7u, 1.0f);
  const auto [tokens, labels] = make_batch(gpt ? B : 1, seq, gpt_model.vocab, 1000);
  const Tree vars = gpt ? init(gpt_model, rng::key(0), tokens) : init(mlp, rng::key(0), x);
  const std::function<void()> step = [&] {
    (void)value_and_grad([&](const Tree& p) {
      if (gpt)
        return mean(nn::softmax_cross_entropy_with_integer_labels(apply(gpt_model, Tree{{"params", p}}, tokens), labels));
      const Array h = apply(mlp, Tree{{"params", p}}, x);
      return mean(h * h);
    })(vars.at("params"));
  };
  std::vector<std::string> layer_paths, segment_paths;
  for (const auto& [name, sub] : vars.at("params")) {
    if (gpt) {
      if (name.starts_with("GptBlock")) layer_paths.push_back(name);
      continue;
    }
    segment_paths.push_back(name);
    for (const auto& layer : sub.keys()) layer_paths.push_back(name + "/" + layer);
  }
  const std::string unit = gpt ? "block" : "layer";

  const Trial plain = run_trial("plain", step, nullptr, steps);
  step();
  // The budget: what is alive before a step (parameters, input), the gradients the step returns,
  // and the fraction of the plain step's activations (its peak beyond those two).
  const std::int64_t fixed = memory::stats().live_bytes;
  std::int64_t grad_bytes = 0;
  for (const Array& p : leaves(vars.at("params"))) grad_bytes += static_cast<std::int64_t>(p.nbytes());
  const std::int64_t activations = plain.peak_bytes - fixed - grad_bytes;
  const std::int64_t budget = fixed + grad_bytes + static_cast<std::int64_t>(fraction * static_cast<double>(activations));

  std::vector<Trial> uniform;
  for (const auto& [label, p] : {std::pair<std::string, lift::Policy>{"full", policies::nothing_saveable{}},
                                  std::pair<std::string, lift::Policy>{"dots", policies::dots_saveable{}}}) {
    const lift::RematPlan every = uniform_plan(layer_paths, p);
    uniform.push_back(run_trial("every " + unit + ", " + label, step, &every, steps));
  }
  if (!gpt) {
    const lift::RematPlan segments = uniform_plan(segment_paths, policies::nothing_saveable{});
    uniform.push_back(run_trial("sqrt(L) segments, full", step, &segments, steps));
  }
  const Trial* best_uniform = nullptr;
  for (const Trial& t : uniform)
    if (t.peak_bytes <= budget && (best_uniform == nullptr || t.step_s_min < best_uniform->step_s_min)) best_uniform = &t;

  nlohmann::json out = {{"bench", "plan"},        {"model", which},        {"dtype", dtype_short_name(dtype)},        {"layers", L},           {"width", gpt ? dim : W},
                        {"batch", B},             {"threads", threads},    {"steps", steps},
                        {"budget_fraction", fraction}, {"fixed_bytes", fixed}, {"gradient_bytes", grad_bytes},
                        {"plain_activation_bytes", activations}, {"budget_bytes", budget},
                        {"plain_peak_bytes", plain.peak_bytes}, {"plain_step_s_min", plain.step_s_min}};
  nlohmann::json uniform_json = nlohmann::json::array();
  for (const Trial& t : uniform)
    uniform_json.push_back({{"schedule", t.name}, {"step_s_min", t.step_s_min}, {"peak_bytes", t.peak_bytes},
                            {"fits", t.peak_bytes <= budget}, {"peak_at", peak_at(t.timeline)}});
  out["uniform"] = uniform_json;
  out["uniform_schedule"] = best_uniform ? nlohmann::json(best_uniform->name) : nlohmann::json(nullptr);
  out["uniform_step_s_min"] = best_uniform ? nlohmann::json(best_uniform->step_s_min) : nlohmann::json(nullptr);
  out["uniform_peak_bytes"] = best_uniform ? nlohmann::json(best_uniform->peak_bytes) : nlohmann::json(nullptr);
  std::vector<memory::Timeline> timelines = {plain.timeline};
  for (const Trial& t : uniform) timelines.push_back(t.timeline);
  // The plan over the allowed options, and (when those go beyond recompute) the best
  // recompute-only plan at the same budget, for comparison.
  const std::string allow = f.text("allow", "none,full,dots");
  const std::vector<lift::Policy> allowed = allowed_policies(allow);
  out["allow"] = allow;
  auto plan_with = [&](const std::vector<lift::Policy>& options, const std::string& label) {
    nlohmann::json r;
    try {
      const auto start = Clock::now();
      const lift::RematPlan plan = lift::plan_remat(step, budget, {.policies = options, .depths = {1, 2}});
      const double planning_s = seconds_since(start);
      const Trial planned = run_trial(label, step, &plan, steps);
      std::map<std::string, int> counts;
      for (const auto& c : plan.calls) ++counts[c.policy ? c.policy->description() : std::string("none")];
      r["planning_s"] = planning_s;
      r["predicted_peak_bytes"] = plan.predicted_peak_bytes;
      r["measured_peak_bytes"] = planned.peak_bytes;
      r["within_budget"] = planned.peak_bytes <= budget;
      r["prediction_error"] = static_cast<double>(plan.predicted_peak_bytes - planned.peak_bytes) / static_cast<double>(planned.peak_bytes);
      r["step_s_min"] = planned.step_s_min;
      r["predicted_extra_s"] = plan.predicted_extra_s;
      r["offloaded_bytes_per_step"] = planned.offloaded_bytes;
      r["plan"] = counts;
      r["peak_at"] = peak_at(planned.timeline);
      r["predicted_peak_in"] = plan.predicted_peak_in;
      const nlohmann::json pj = plan.to_json();
      if (pj.contains("transfer_bytes_per_s")) r["transfer_bytes_per_s"] = pj["transfer_bytes_per_s"];
      if (pj.contains("spill_windows")) r["spill_windows"] = pj["spill_windows"];
      timelines.push_back(planned.timeline);
    } catch (const ValueError& e) {
      r["error"] = e.what();
      r["measured_peak_bytes"] = nullptr;
      r["step_s_min"] = nullptr;
    }
    return r;
  };
  out.update(plan_with(allowed, "planned"));
  const bool beyond_recompute = std::any_of(allowed.begin(), allowed.end(), [](const lift::Policy& p) {
    return p.description() != "nothing_saveable" && p.description() != "dots_saveable";
  });
  if (beyond_recompute) out["recompute_only"] = plan_with({policies::nothing_saveable{}, policies::dots_saveable{}}, "planned, recompute only");
  std::cout << out.dump() << std::endl;
  const std::string plot = f.text("memory-plot", "");
  if (!plot.empty()) {
    const std::string what = gpt ? "GPT (" + std::to_string(L) + " blocks, dim " + std::to_string(dim) + ", batch " +
                                       std::to_string(B) + " x " + std::to_string(seq) + ")"
                                 : "Deep MLP (" + std::to_string(L) + " x Dense(" + std::to_string(W) + ") + GELU, batch " +
                                       std::to_string(B) + ")";
    memory::save_svg(plot, timelines, {.title = what + ", budget " + std::to_string(budget >> 20) + " MiB: live memory over one step"});
    std::cerr << "wrote the memory timelines to " << plot << "\n";
  }
  return 0;
}

}  // namespace linum_bench
