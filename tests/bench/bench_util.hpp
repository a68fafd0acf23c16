// Helpers shared by linum-bench's benchmarks: flags, clocks, /proc memory figures, test data.
#pragma once

#include <linum/linum.hpp>
#include <linum/core/kernels/gemm.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <string>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace linum_bench {

using namespace linum;
using Clock = std::chrono::steady_clock;

inline int omp_get_max_threads_or_1() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

inline double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

inline long status_kib(const char* field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const std::size_t n = std::strlen(field);
  while (std::getline(f, line))
    if (line.compare(0, n, field) == 0) return std::stol(line.substr(n + 1));
  return 0;
}

inline void reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
}

struct Flags {
  std::map<std::string, std::string> values;
  long get(const std::string& k, long d) const {
    auto it = values.find(k);
    return it == values.end() ? d : std::stol(it->second);
  }
  std::string text(const std::string& k, const std::string& d) const {
    auto it = values.find(k);
    return it == values.end() ? d : it->second;
  }
};

inline Flags parse_flags(int argc, char** argv, int first) {
  Flags f;
  for (int i = first; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0 || i + 1 >= argc) {
      std::cerr << "linum-bench: expected --name value, got '" << a << "'\n";
      std::exit(2);
    }
    f.values[a.substr(2)] = argv[++i];
  }
  return f;
}

inline Array random_normal(const Shape& s, unsigned seed, float scale) {
  Array a = Array::empty(s);
  std::uint32_t state = seed * 747796405u + 2891336453u;
  float* p = a.mutable_data();
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    state = state * 1664525u + 1013904223u;
    p[i] = scale * (static_cast<float>(state >> 8) / 16777216.0f - 0.5f) * 3.4641016f;  // unit variance
  }
  return a;
}

// The engine's raw product [m, k] x [k, n] in `dtype` (Linum's matmul on constants: the kernel plus
// the output allocation, which the block cache serves).
// The fastest of `reps` calls of product() (which returns an Array), after one warm-up call that
// creates the primitive.
template <class F>
double best_seconds(int reps, F&& product) {
  (void)product();
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    auto t = Clock::now();
    Array c = product();
    best = std::min(best, seconds_since(t));
  }
  return best;
}

inline double gemm_gflops(std::int64_t m, std::int64_t k, std::int64_t n, DType dtype, int reps) {
  const Array a = astype(random_normal(Shape{m, k}, 11u, 1.0f), dtype);
  const Array b = astype(random_normal(Shape{k, n}, 12u, 1.0f), dtype);
  return 2.0 * m * k * n / best_seconds(reps, [&] { return matmul(a, b); }) / 1e9;
}

// The time of the products a plain step of `layers` dense layers ([m, k] x [k, n], bias in the
// forward product) runs, each kind timed alone on the same operands, so in cache (best of `reps`):
// layers forward products with the bias, layers - 1 input gradients g W^T, layers weight gradients
// x^T g. What the step's products would take with nothing around them.
inline double plain_products_alone_s(std::int64_t layers, std::int64_t m, std::int64_t k, std::int64_t n, DType dtype,
                                     int reps) {
  const Array x = astype(random_normal(Shape{m, k}, 13u, 1.0f), dtype);
  const Array w = astype(random_normal(Shape{k, n}, 14u, 1.0f), dtype);
  const Array b = astype(random_normal(Shape{n}, 15u, 1.0f), dtype);
  const Array g = astype(random_normal(Shape{m, n}, 16u, 1.0f), dtype);
  // (the kernels the fused linear's forward and backward rule call)
  const double forward = best_seconds(reps, [&] { return kernels::gemm_bias(x, w, b); });
  const double dx = best_seconds(reps, [&] { return kernels::batched_gemm(g, w, false, true); });
  const double dw = best_seconds(reps, [&] { return kernels::batched_gemm(x, g, true, false); });
  return static_cast<double>(layers) * forward + static_cast<double>(layers - 1) * dx + static_cast<double>(layers) * dw;
}

inline DType parse_dtype(const std::string& s) {
  if (s == "f32" || s == "float32") return DType::f32;
  if (s == "bf16" || s == "bfloat16") return DType::bf16;
  throw ValueError("--dtype must be f32 or bf16, got '" + s + "'");
}

inline void apply_engine_flag(const Flags& f) {
  const std::string e = f.text("engine", "");
  if (e.empty()) return;
  if (e == "eigen") set_engine(Engine::eigen);
  else if (e == "onednn") set_engine(Engine::onednn);
  else throw ValueError("--engine must be onednn or eigen, got '" + e + "'");
}

// The benchmarks, one per file.
int bench_gpt(const Flags& f);
int bench_scan(const Flags& f);
int bench_plan(const Flags& f);

}  // namespace linum_bench
