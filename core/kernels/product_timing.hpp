// How long a step spends inside its matrix products, for profiling.
//
// A training step's time is its products plus everything around them (elementwise passes, casts,
// the tape). The same product runs slower inside a step than alone in a loop: alone, its operands
// stay in cache; in a step, a layer's kept input comes back from memory in the backward pass. To
// tell those two costs apart, turn timing on for one step and read what it counted:
//
//   kernels::ProductTimingScope timing;   // on while alive, counters cleared when it starts
//   auto [loss, grads] = step(params, x);
//   kernels::ProductTiming t = timing.read();  // t.seconds in products, t.flops, t.products
//
// It covers the whole-array products every op reaches (batched_gemm and gemm_bias: matmul,
// dot_general, einsum, the fused linear and their backward rules), not the serial products inside
// fused kernels (attention, the recurrent layers). Off by default; when on, each product reads the
// clock twice. Counters are process-wide (atomics), so time spent in products called from two
// threads at once adds up.
#pragma once

#include <cstdint>

namespace linum::kernels {

struct ProductTiming {
  std::int64_t products = 0;  // products counted
  double flops = 0;           // 2 * m * n * k summed over them
  double seconds = 0;         // wall time inside them
};

// Whether products are being timed now (set by ProductTimingScope).
bool product_timing_on();
// What was counted since the last clear.
ProductTiming product_timing();

// Timing on, counters cleared, while alive; the previous state comes back when it ends. Not for
// nesting across threads: it sets one process-wide switch.
class ProductTimingScope {
 public:
  ProductTimingScope();
  ~ProductTimingScope();
  ProductTimingScope(const ProductTimingScope&) = delete;
  ProductTimingScope& operator=(const ProductTimingScope&) = delete;
  ProductTiming read() const { return product_timing(); }

 private:
  bool previous_;
};

namespace detail {
// Times one product of `flops` multiply-adds x 2 when timing is on (engine.cpp wraps each product).
class ProductClock {
 public:
  explicit ProductClock(double flops);
  ~ProductClock();
  ProductClock(const ProductClock&) = delete;
  ProductClock& operator=(const ProductClock&) = delete;

 private:
  double flops_;
  std::int64_t start_ns_ = -1;  // -1: timing was off when the product started
};
}  // namespace detail

}  // namespace linum::kernels
