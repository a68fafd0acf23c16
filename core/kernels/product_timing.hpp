// How long a step spends inside its matrix products, for profiling.
//
// A training step's time is its products plus everything around them (elementwise passes, casts,
// the tape). The same product runs slower inside a step than alone in a loop: alone, its operands
// stay in cache; in a step, a layer's kept input comes back from memory in the backward pass. To
// tell those two costs apart, turn timing on for one step and read what it counted:
//
//   kernels::ProductTimingScope timing;   // on while alive
//   auto [loss, grads] = step(params, x);
//   kernels::ProductTiming t = timing.read();  // since the scope began: t.seconds, t.flops, t.products
//
// It covers the whole-array products every op reaches (batched_gemm and gemm_bias: matmul,
// dot_general, einsum, the fused linear and their backward rules), not convolutions (oneDNN's
// convolution primitives, Eigen's im2col products) nor the serial products inside fused kernels
// (attention, the recurrent layers). Off by default; when on, each product reads the clock twice.
// Counters are process-wide (atomics): scopes may nest (each reads what was counted since it
// began), and products that two threads run at once all count, their times added.
#pragma once

#include <cstdint>

namespace linum::kernels {

struct ProductTiming {
  std::int64_t products = 0;  // products counted
  double flops = 0;           // 2 * batch * m * n * k summed over them
  double seconds = 0;         // wall time inside them
};

// Whether products are being timed now (while a ProductTimingScope is alive).
bool product_timing_on();
// Everything counted in this process so far (only while some scope was alive).
ProductTiming product_timing();

// Timing on while alive (scopes count how many are alive; timing stops when the last one ends).
class ProductTimingScope {
 public:
  ProductTimingScope();
  ~ProductTimingScope();
  ProductTimingScope(const ProductTimingScope&) = delete;
  ProductTimingScope& operator=(const ProductTimingScope&) = delete;
  // What was counted since this scope began.
  ProductTiming read() const;

 private:
  ProductTiming start_;
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
