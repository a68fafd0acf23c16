// Subnormal floats: flushed to zero in every thread Linum computes in, by default.
//
// Activations of deep stacks decay towards zero; once they are subnormal (below 1.2e-38 in
// float32) the CPU takes a slow microcode path for every operation on them, about 100x slower. A
// 64-layer MLP step took 13.4 s instead of 0.2 s that way. XLA's CPU backend and TensorFlow flush
// subnormals to zero (FTZ) and treat subnormal inputs as zero (DAZ); so does Linum.
//
// The mode is per thread. Linum sets it in the calling thread the first time an op allocates its
// output there, and in its OpenMP worker threads when a parallel region starts; it stays set in
// those threads afterwards (as in TensorFlow's thread pools). Results differ from IEEE arithmetic
// only for values below 1.2e-38, which become 0.
//
// Code of yours in the same thread that needs subnormals (rare) can use IeeeSubnormalScope.
//
// Opt out with linum::set_flush_denormals(false) or the environment variable
// LINUM_FLUSH_DENORMALS=0 (read once, at the first op); threads Linum computes in afterwards get the
// IEEE mode back. On CPUs without FTZ/DAZ control (not x86-64 or AArch64) this is a no-op.
#pragma once

#include <atomic>

namespace linum {

// Whether Linum flushes subnormals in the threads it computes in (true by default).
bool flush_denormals();
void set_flush_denormals(bool on);

// Whether the calling thread's floating-point unit flushes subnormals right now (for tests).
bool thread_flushes_denormals();

// Within its lifetime the calling thread computes with IEEE subnormals (flushing off), then its
// previous mode is restored. Linum's JSON reader and writer use it so that subnormal parameters
// round-trip exactly; use it around your own code that needs subnormals.
class IeeeSubnormalScope {
 public:
  IeeeSubnormalScope();
  ~IeeeSubnormalScope();
  IeeeSubnormalScope(const IeeeSubnormalScope&) = delete;
  IeeeSubnormalScope& operator=(const IeeeSubnormalScope&) = delete;

 private:
  unsigned long saved_;
};

namespace detail {
extern std::atomic<unsigned> g_fp_mode_generation;
extern thread_local unsigned t_fp_mode_generation;
void apply_fp_mode();
// Brings the calling thread's floating-point mode up to date: one thread-local compare when it is.
inline void enter_compute() {
  if (t_fp_mode_generation != g_fp_mode_generation.load(std::memory_order_relaxed)) apply_fp_mode();
}
// The calling thread's floating-point controls that change results (x86-64: MXCSR's flush-to-zero,
// denormals-are-zero and rounding bits; AArch64: FPCR's flush-to-zero, rounding, default-NaN and
// FEAT_AFP bits; elsewhere the rounding mode) as a number below kFpStateKeys: equal keys, equal
// results. Values computed once and reused (bf16 tables) are kept per key.
constexpr unsigned kFpStateKeys = 64;
unsigned fp_state_key();
}  // namespace detail

}  // namespace linum
