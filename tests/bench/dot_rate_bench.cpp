// linum-bench dot-rate: how fast this core issues the two instructions bf16 products can be built on,
// one thread, operands in registers: vfmadd231ps zmm (16 float32 multiply-adds) and vdpbf16ps zmm
// (32 bf16 multiply-adds into 16 float32 lanes). Ten independent accumulators per loop, so the rate is
// the instruction's throughput, not its latency. It is what decides bf16_products() (engine.hpp):
// where vdpbf16ps does fewer multiply-adds per second than the float32 FMA, bf16 products are faster
// widened to float32. Prints one JSON line; without AVX512-BF16 in the build, "available": false.
#include <linum/linum.hpp>

#include <nlohmann/json.hpp>

#include <chrono>
#include <iostream>

#include "bench_util.hpp"

using namespace linum_bench;

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// Seconds for `loops` x 10 instructions of each kind; the sums are returned so no loop is dropped.
struct Rates {
  double fma_s = 0, dot_s = 0, checksum = 0;
};

Rates time_loops(long loops) {
  __m512 acc[10];
  for (auto& a : acc) a = _mm512_setzero_ps();
  __m512 x = _mm512_set1_ps(1e-8f);
  const __m512 y = _mm512_set1_ps(1e-8f);
  __m512bh xb = (__m512bh)_mm512_set1_epi16(0x3000);
  const __m512bh yb = (__m512bh)_mm512_set1_epi16(0x3000);
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < loops; ++i) {
#pragma GCC unroll 10
    for (int j = 0; j < 10; ++j) acc[j] = _mm512_fmadd_ps(x, y, acc[j]);
    asm volatile("" : "+v"(x));
  }
  const auto t1 = std::chrono::steady_clock::now();
  for (long i = 0; i < loops; ++i) {
#pragma GCC unroll 10
    for (int j = 0; j < 10; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], xb, yb);
    asm volatile("" : "+v"(xb));
  }
  const auto t2 = std::chrono::steady_clock::now();
  Rates r;
  for (auto& a : acc) r.checksum += _mm512_reduce_add_ps(a);
  r.fma_s = std::chrono::duration<double>(t1 - t0).count();
  r.dot_s = std::chrono::duration<double>(t2 - t1).count();
  return r;
}
#endif

}  // namespace

int bench_dot_rate(const Flags& f) {
  nlohmann::json out{{"bench", "dot_rate"}, {"bf16_products", linum::bf16_products_name(linum::bf16_products())}};
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const long loops = f.get("loops", 20000000), rounds = f.get("rounds", 5);  // 0.2 G instructions of each per round
  double best_fma = 1e30, best_dot = 1e30, checksum = 0;
  for (long r = 0; r < rounds; ++r) {  // the best of each, alternating
    const Rates t = time_loops(loops);
    best_fma = std::min(best_fma, t.fma_s);
    best_dot = std::min(best_dot, t.dot_s);
    checksum += t.checksum;
  }
  const double instr = 10.0 * static_cast<double>(loops);
  out["available"] = true;
  out["fma_zmm_ginstr_per_s"] = instr / best_fma / 1e9;
  out["vdpbf16ps_zmm_ginstr_per_s"] = instr / best_dot / 1e9;
  out["fma_gflops_one_thread"] = instr * 32.0 / best_fma / 1e9;
  out["vdpbf16ps_gflops_one_thread"] = instr * 64.0 / best_dot / 1e9;
  out["checksum"] = checksum;
#else
  (void)f;
  out["available"] = false;
#endif
  std::cout << out.dump() << std::endl;
  return 0;
}
