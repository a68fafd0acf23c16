#include <linum/core/kernels/engine.hpp>
#include <linum/core/profiler.hpp>
#include <linum/core/error.hpp>
#include <linum/core/kernels/conv.hpp>
#include <linum/core/kernels/gemm.hpp>
#include <linum/core/kernels/product_timing.hpp>

#include <algorithm>
#include <atomic>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

namespace linum {
namespace {

std::atomic<Engine> g_engine{LINUM_HAVE_ONEDNN ? Engine::onednn : Engine::eigen};

void read_environment_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    const char* v = std::getenv("LINUM_ENGINE");
    if (v == nullptr || *v == 0) return;
    if (std::strcmp(v, "eigen") == 0) g_engine = Engine::eigen;
    else if (std::strcmp(v, "onednn") == 0 && engine_available(Engine::onednn)) g_engine = Engine::onednn;
    else
      throw ValueError(detail::cat("LINUM_ENGINE=", v, ": unknown or unavailable engine; use eigen",
                                   engine_available(Engine::onednn) ? " or onednn" : " (this build has no oneDNN)"));
  });
}

}  // namespace

bool engine_available(Engine e) { return e == Engine::eigen || LINUM_HAVE_ONEDNN; }

const char* engine_name(Engine e) { return e == Engine::onednn ? "onednn" : "eigen"; }

bool onednn_has_bf16_kernels() {
#if LINUM_HAVE_ONEDNN
  return kernels::onednn_bf16_matmul_available() && kernels::onednn_bf16_conv_available();
#else
  return false;
#endif
}

bool bf16_products_available(Bf16Products p) {
  switch (p) {
    case Bf16Products::dot_instructions: return onednn_has_bf16_kernels() && kernels::bf16_panels_available();
    case Bf16Products::onednn: return onednn_has_bf16_kernels();
    case Bf16Products::widened: return true;
  }
  return false;
}

const char* bf16_products_name(Bf16Products p) {
  switch (p) {
    case Bf16Products::dot_instructions: return "dot_instructions";
    case Bf16Products::onednn: return "onednn";
    case Bf16Products::widened: return "widened";
  }
  return "?";
}

namespace {

[[maybe_unused]] bool cpu_vendor_is_intel() {  // (unused without oneDNN)
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(0, &a, &b, &c, &d) == 0) return false;
  char vendor[13] = {};
  std::memcpy(vendor, &b, 4);
  std::memcpy(vendor + 4, &d, 4);
  std::memcpy(vendor + 8, &c, 4);
  return std::strcmp(vendor, "GenuineIntel") == 0;
#else
  return false;
#endif
}

// The choice bf16_products() documents (engine.hpp).
Bf16Products detected_bf16_products() {
  if (!onednn_has_bf16_kernels()) return Bf16Products::widened;
#if LINUM_HAVE_ONEDNN
  if (cpu_vendor_is_intel()) return kernels::onednn_uses_amx() ? Bf16Products::onednn : Bf16Products::widened;
#endif
  return kernels::bf16_panels_available() ? Bf16Products::dot_instructions : Bf16Products::onednn;
}

std::atomic<Bf16Products> g_bf16_products{Bf16Products::widened};

void choose_bf16_products_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    g_bf16_products = detected_bf16_products();
    const char* v = std::getenv("LINUM_BF16_PRODUCTS");
    if (v == nullptr || *v == 0) return;
    for (Bf16Products p : {Bf16Products::dot_instructions, Bf16Products::onednn, Bf16Products::widened}) {
      if (std::strcmp(v, bf16_products_name(p)) != 0) continue;
      if (!bf16_products_available(p))
        throw ValueError(detail::cat("LINUM_BF16_PRODUCTS=", v, ": not available on this CPU or build (",
                                     p == Bf16Products::dot_instructions ? "it needs AVX512-BF16 in the build and oneDNN's bf16 kernels"
                                                                         : "oneDNN has no bf16 kernels here",
                                     "); use widened, or unset it for the default, ",
                                     bf16_products_name(detected_bf16_products())));
      g_bf16_products = p;
      return;
    }
    throw ValueError(detail::cat("LINUM_BF16_PRODUCTS=", v, ": unknown; use dot_instructions, onednn or widened"));
  });
}

}  // namespace

Bf16Products bf16_products() {
  choose_bf16_products_once();
  return g_bf16_products.load(std::memory_order_relaxed);
}

void set_bf16_products(Bf16Products p) {
  choose_bf16_products_once();
  if (!bf16_products_available(p))
    throw ValueError(detail::cat("set_bf16_products(", bf16_products_name(p), "): not available on this CPU or build; ",
                                 "bf16_products_available() tells which are"));
  g_bf16_products = p;
}

Engine engine() {
  read_environment_once();
  return g_engine.load(std::memory_order_relaxed);
}

void set_engine(Engine e) {
  read_environment_once();
  if (!engine_available(e))
    throw ValueError(detail::cat("set_engine: this build of Linum has no ", engine_name(e),
                                 "; install libdnnl-dev and reconfigure with -Donednn=enabled"));
  g_engine = e;
}

namespace kernels {
namespace {
// 2 * batch * m * n * k of op(a) @ op(b) (product_timing.hpp), when timing is on (else 0: not read).
double timed_flops(const Array& a, const Array& b, bool ta, bool tb) {
  // (counted only while products are timed or a profiler records: core/profiler.hpp)
  if (!(product_timing_on() || profiler::detail::profiling_now()) || a.rank() < 2 || b.rank() < 2) return 0.0;
  const double batch = a.rank() == 3 ? static_cast<double>(a.dim(0)) : 1.0;
  const double m = static_cast<double>(ta ? a.dim(-1) : a.dim(-2)), k = static_cast<double>(ta ? a.dim(-2) : a.dim(-1));
  const double n = static_cast<double>(tb ? b.dim(-2) : b.dim(-1));
  return 2.0 * batch * m * n * k;
}

// The product on gemm_bf16_panels (uses_bf16_panels(a, ta, b, tb) holds).
Array panels_product(const Array& a, bool ta, const Array& b, bool tb, const Array* bias) {
  const std::int64_t rows = ta ? a.dim(1) : a.dim(0), k = ta ? a.dim(0) : a.dim(1), n = tb ? b.dim(0) : b.dim(1);
  Array y = Array::empty(Shape{rows, n}, DType::bf16);
  gemm_bf16_panels(rows, n, k, static_cast<const bfloat16*>(a.raw()), ta, static_cast<const bfloat16*>(b.raw()), tb,
                   bias == nullptr ? nullptr : static_cast<const bfloat16*>(bias->raw()),
                   Bf16ProductOut{.z = static_cast<bfloat16*>(y.mutable_raw())});
  return y;
}

// The product on gemm_f32_panels (uses_f32_panels(a, ta, b, tb) holds).
Array f32_panels_product(const Array& a, bool ta, const Array& b, bool tb, const Array* bias) {
  const std::int64_t rows = ta ? a.dim(1) : a.dim(0), k = ta ? a.dim(0) : a.dim(1), n = tb ? b.dim(0) : b.dim(1);
  Array y = Array::empty(Shape{rows, n}, DType::f32);
  gemm_f32_panels(rows, n, k, a.data(), ta, b.data(), tb, bias == nullptr ? nullptr : bias->data(), y.mutable_data());
  return y;
}

// The product on gemm_f32_panels_widened (uses_f32_panels_widened(a, false, b, tb) holds); a bf16
// bias widened.
Array widened_panels_product(const Array& a, const Array& b, bool tb, const Array* bias) {
  const std::int64_t rows = a.dim(0), k = a.dim(1), n = tb ? b.dim(0) : b.dim(1);
  const Array bias32 = bias == nullptr ? Array() : linum::detail::convert_float(*bias, DType::f32);
  Array y = Array::empty(Shape{rows, n}, DType::bf16);
  gemm_f32_panels_widened(rows, n, k, static_cast<const bfloat16*>(a.raw()), static_cast<const bfloat16*>(b.raw()), tb,
                          bias == nullptr ? nullptr : bias32.data(), static_cast<bfloat16*>(y.mutable_raw()));
  return y;
}
}  // namespace

// Where the panel kernel is at least as fast as oneDNN's (2 threads, Zen 5, in cache): 1.03-1.18x
// its speed on the MLP, GPT and square shapes with sums up to 2048 long; 0.80-0.89x with 4096-long
// sums (no blocking over k: a panel no longer fits L1) and 0.61x on a 10-wide logits product of
// 128 rows (a panel is 32 columns). Those stay on oneDNN.
constexpr std::int64_t kPanelsMaxDepth = 2048, kPanelsMinColumns = 16;
bool bf16_panels_take(std::int64_t k, std::int64_t n) {
  // (k = 0 stays with the engine, which adds the bias to zeros in float32, keeping a subnormal bias)
  return engine() == Engine::onednn && bf16_products() == Bf16Products::dot_instructions && k > 0 && k <= kPanelsMaxDepth &&
         n >= kPanelsMinColumns;
}

bool uses_bf16_panels(const Array& a, bool ta, const Array& b, bool tb) {
  if (!(a.dtype() == DType::bf16 && b.dtype() == DType::bf16 && a.rank() == 2 && b.rank() == 2)) return false;
  return bf16_panels_take(ta ? a.dim(0) : a.dim(1), tb ? b.dim(0) : b.dim(1));
}

// Where the float32 panel kernel is the faster (2 threads, Zen 5; the left operand from memory, as a
// layer's input is in a step): products of at least 2048 rows, 512-2048 deep, at least 512 wide,
// the right operand transposed or not: forward 1.00-1.07x oneDNN's speed alone (2048 x 512 by
// 512 x 512, the deep MLP's: 1.00-1.04x; 2048-cube: 1.07x), the input gradient (g W^T) a tie alone.
// In the MLP's float32 step, steps alternating in one process: the forward products 2.3-3.9%
// faster with remat every layer, and with the next tile's rows fetched (gemm_f32_panels.cpp) the
// input gradients on it a further 1.3-2.1%. Elsewhere it loses or ties, and stays on oneDNN:
// narrower outputs (256-384 wide: 0.94-0.98x; 16 wide: 0.72x, a tile computes 32 columns), fewer
// rows (1024-cube: 0.97x; packing the right operand costs more for what it serves), 4096-long sums
// (the one measured, a weight gradient's: 0.87x), and a transposed left operand: the weight
// gradient (x^T g), faster alone from memory, tied or slower inside the step (also with its sum in
// parts of 512, 6% slower); it runs on oneDNN's sgemm in row pieces instead (gemm_onednn.cpp).
constexpr std::int64_t kF32PanelsMinRows = 2048, kF32PanelsMinColumns = 512, kF32PanelsMinDepth = 512,
                       kF32PanelsMaxDepth = 2048;
bool uses_f32_panels(const Array& a, bool ta, const Array& b, bool tb) {
  if (ta ||
      !(engine() == Engine::onednn && f32_panels_available() && a.dtype() == DType::f32 && b.dtype() == DType::f32 &&
        a.rank() == 2 && b.rank() == 2))
    return false;
  const std::int64_t m = a.dim(0), k = a.dim(1), n = tb ? b.dim(0) : b.dim(1);  // (not ta: see above)
  return m >= kF32PanelsMinRows && k >= kF32PanelsMinDepth && k <= kF32PanelsMaxDepth && n >= kF32PanelsMinColumns;
}

// bf16 products where bf16_products() is widened: the float32 panel kernel reading the bf16 operands,
// widening them as it goes, and rounding its results (gemm_f32_panels_widened), instead of widening
// both operands into float32 arrays, oneDNN's float32 product into a third and rounding that (what
// gemm_onednn.cpp does elsewhere). Without those passes over memory it wins on narrower and
// shallower shapes than the float32 kernel does. Measured on the 2-core Xeon without AMX (family 6
// model 207), the two paths in alternating processes: alone (best of 30, a busy host) as fast or
// faster on each of the GPT's products (4096 rows; 256 deep by 256, 768 or 1024 wide, 1024 deep by
// 256 wide, either way round), the deep MLP's (2048 x 512 by 512 x 512) and 512 x 64 by 64 x 1024;
// in steps (with the layer before's cotangent pass in the input gradient's epilogue,
// scaled_product_bt), the deep MLP's bf16 step 0.270-0.278 s against 0.286-0.292 (remat every
// layer: 0.355-0.375 against 0.382-0.389), the GPT's 0.722-0.734 against 0.763-0.784 (remat:
// 0.960 against 1.000-1.003). Products with fewer rows, shorter sums or narrower outputs stay on
// the other path; so do transposed left operands (weight gradients), as for float32
// (uses_f32_panels).
constexpr std::int64_t kWidenedPanelsMinRows = 256, kWidenedPanelsMinDepth = 64, kWidenedPanelsMaxDepth = 2048,
                       kWidenedPanelsMinColumns = 64;
bool uses_f32_panels_widened(const Array& a, bool ta, const Array& b, bool tb) {
  if (ta || !(engine() == Engine::onednn && bf16_products() == Bf16Products::widened && f32_panels_widened_available() &&
              a.dtype() == DType::bf16 && b.dtype() == DType::bf16 && a.rank() == 2 && b.rank() == 2))
    return false;
  const std::int64_t m = a.dim(0), k = a.dim(1), n = tb ? b.dim(0) : b.dim(1);
  return m >= kWidenedPanelsMinRows && k >= kWidenedPanelsMinDepth && k <= kWidenedPanelsMaxDepth &&
         n >= kWidenedPanelsMinColumns;
}

void gemm_bias_pairs(const Array& a, const Array& b, const Array& bias, const std::uint32_t* pair_table, Array& y,
                     Array& d) {
  const detail::ProductClock clock(timed_flops(a, b, false, false));
  gemm_bf16_panels(a.dim(0), b.dim(1), a.dim(1), static_cast<const bfloat16*>(a.raw()), false,
                   static_cast<const bfloat16*>(b.raw()), false, bias.defined() ? static_cast<const bfloat16*>(bias.raw()) : nullptr,
                   Bf16ProductOut{.pair_table = pair_table, .y = static_cast<bfloat16*>(y.mutable_raw()),
                                  .d = static_cast<bfloat16*>(d.mutable_raw())});
}

void gemm_bias_pairs_f32_kernel(const Array& a, const Array& kernel, const Array& bias, const std::uint32_t* pair_table,
                                Array& kernel_bf16, Array& y, Array& d) {
  const detail::ProductClock clock(timed_flops(a, kernel, false, false));
  kernel_bf16 = Array::empty(kernel.shape(), DType::bf16);
  gemm_bf16_panels_f32_b(a.dim(0), kernel.dim(1), a.dim(1), static_cast<const bfloat16*>(a.raw()), kernel.data(),
                         static_cast<bfloat16*>(kernel_bf16.mutable_raw()),
                         bias.defined() ? static_cast<const bfloat16*>(bias.raw()) : nullptr,
                         Bf16ProductOut{.pair_table = pair_table, .y = static_cast<bfloat16*>(y.mutable_raw()),
                                        .d = static_cast<bfloat16*>(d.mutable_raw())});
}

Array transposed_product_f32(const Array& a, const Array& b) {
  if (!uses_bf16_panels(a, true, b, false)) {
    const Array z = batched_gemm(a, b, true, false);
    Array out = Array::empty(z.shape(), DType::f32);
    bf16_to_f32(z.data_bf16(), out.mutable_data(), z.numel());
    return out;
  }
  const detail::ProductClock clock(timed_flops(a, b, true, false));
  Array out = Array::empty(Shape{a.dim(1), b.dim(1)}, DType::f32);
  gemm_bf16_panels(a.dim(1), b.dim(1), a.dim(0), static_cast<const bfloat16*>(a.raw()), true,
                   static_cast<const bfloat16*>(b.raw()), false, nullptr, Bf16ProductOut{.z_f32 = out.mutable_data()});
  return out;
}

bool scaled_product_bt_runs(const Array& a, const Array& b, const Array& scale) {
  if (!(a.rank() == 2 && b.rank() == 2 && scale.shape() == Shape{a.dim(0), b.dim(0)} && scale.dtype() == a.dtype())) return false;
  return uses_bf16_panels(a, false, b, true) || uses_f32_panels(a, false, b, true) || uses_f32_panels_widened(a, false, b, true);
}

Array scaled_product_bt(const Array& a, const Array& b, const Array& scale, Array* column_sums, bool selects) {
  if (!scaled_product_bt_runs(a, b, scale))
    throw Error(linum::detail::cat("scaled_product_bt: needs operands of a panel kernel (", a.shape(), " ", dtype_name(a.dtype()),
                                   ", ", b.shape(), " ", dtype_name(b.dtype()),
                                   " transposed) and a scale of the product's shape and dtype; got ", scale.shape(), " ",
                                   dtype_name(scale.dtype())));
  const detail::ProductClock clock(timed_flops(a, b, false, true));
  const std::int64_t m = a.dim(0), n = b.dim(0);
  Array out = Array::empty(Shape{m, n}, a.dtype());
  if (column_sums != nullptr) *column_sums = Array::empty(Shape{(m + kScaledSumRows - 1) / kScaledSumRows, n}, DType::f32);
  float* sums = column_sums != nullptr ? column_sums->mutable_data() : nullptr;
  if (a.dtype() == DType::f32) {
    gemm_f32_panels(m, n, a.dim(1), a.data(), false, b.data(), true, nullptr, out.mutable_data(), scale.data(), sums,
                    selects);
    return out;
  }
  if (uses_f32_panels_widened(a, false, b, true)) {
    gemm_f32_panels_widened(m, n, a.dim(1), static_cast<const bfloat16*>(a.raw()), static_cast<const bfloat16*>(b.raw()), true,
                            nullptr, static_cast<bfloat16*>(out.mutable_raw()), static_cast<const bfloat16*>(scale.raw()), sums,
                            selects);
    return out;
  }
  gemm_bf16_panels(m, n, a.dim(1), static_cast<const bfloat16*>(a.raw()), false, static_cast<const bfloat16*>(b.raw()), true,
                   nullptr,
                   Bf16ProductOut{.z = static_cast<bfloat16*>(out.mutable_raw()),
                                  .scale = static_cast<const bfloat16*>(scale.raw()), .tile_sums = sums,
                                  .scale_selects = selects});
  return out;
}

// Where the team's AVX2 product runs a float32 product (builds without AVX-512, uses_f32_avx2):
// the weight gradients, x^T g. On AVX2 oneDNN 2.6 reads a transposed left operand slowly (2 threads,
// AMD EPYC Zen 3, one run each: [2048, 512]^T [2048, 512] 97-115 GFLOP/s on its sgemm pieces with
// the copies of kTransposeLeftPieces, the GPT's [4096, 256]^T [4096, 1024] 81-83 and [4096,
// 1024]^T [4096, 256] 68-70 as one matmul) where this kernel reads it in place: 119-151, 114-118,
// 109-111 (and with its transposed A copied tile by tile, gemm_f32_avx2.cpp, the first 163-165);
// ties elsewhere (256 x 256, 4096 deep: 120-127 against 119-124). The deep MLP's float32 step, runs
// alternating: median 0.526-0.627 s against 0.600-0.658. The forward and input-gradient products
// stay on oneDNN: on this kernel the same step was 0-4% slower; and still 7-12% slower (median of
// paired steps in one process) with the input gradient's epilogue doing the layer before's
// cotangent pass (its derivative and bias sums, as gemm_f32_panels does on AVX-512), although alone
// in cache the two tie (2048 x 512 by 512 x 512: 173-182 against 176-185 GFLOP/s). In a step their
// operands come from memory, where oneDNN's kernels fetch ahead better.
bool uses_f32_avx2_team(const Array& a, bool ta, const Array& b, bool tb) {
  if (!(ta && !tb && uses_f32_avx2() && a.dtype() == DType::f32 && b.dtype() == DType::f32 && a.rank() == 2 && b.rank() == 2))
    return false;
  const std::int64_t m = a.dim(1), k = a.dim(0), n = b.dim(1);
  // (narrower outputs would leave most of a 16-column panel's lanes idle)
  return m >= 64 && n >= 64 && k >= 64 && static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) >= kParallelGemmWork;
}

Array batched_gemm(const Array& a, const Array& b, bool ta, bool tb) {
  const detail::ProductClock clock(timed_flops(a, b, ta, tb));
  if (uses_bf16_panels(a, ta, b, tb)) return panels_product(a, ta, b, tb, nullptr);
  if (uses_f32_panels(a, ta, b, tb)) return f32_panels_product(a, ta, b, tb, nullptr);
  if (uses_f32_panels_widened(a, ta, b, tb)) return widened_panels_product(a, b, tb, nullptr);
  if (uses_f32_avx2_team(a, ta, b, tb)) {
    Array out = Array::empty(Shape{a.dim(1), b.dim(1)});
    gemm_f32_avx2(out.dim(0), out.dim(1), a.dim(0), a.data(), true, b.data(), false, out.mutable_data());
    return out;
  }
#if LINUM_HAVE_ONEDNN
  if (engine() == Engine::onednn) return batched_gemm_onednn(a, b, ta, tb);
#endif
  return batched_gemm_eigen(a, b, ta, tb);
}

Array gemm_bias(const Array& a, const Array& b, const Array& bias) {
  const detail::ProductClock clock(timed_flops(a, b, false, false));
  if (uses_bf16_panels(a, false, b, false) && bias.dtype() == DType::bf16) return panels_product(a, false, b, false, &bias);
  if (uses_f32_panels(a, false, b, false) && bias.dtype() == DType::f32) return f32_panels_product(a, false, b, false, &bias);
  if (uses_f32_panels_widened(a, false, b, false) && bias.dtype() == DType::bf16) return widened_panels_product(a, b, false, &bias);
#if LINUM_HAVE_ONEDNN
  if (engine() == Engine::onednn) return gemm_bias_onednn(a, b, bias);
#endif
  return gemm_bias_eigen(a, b, bias);
}

// On CPUs without AVX-512 the serial float32 products with a transposed left operand and outputs
// at least 256 wide, or sums at least 512 long, and the PackedProducts, run on Linum's AVX2 kernel:
// one thread, AMD EPYC Zen 3, the fused LSTM layer's shapes (B 32, H 256): its per-step product over
// a row piece, 16 x 256 by a packed 256 x 1024, 97 GFLOP/s against oneDNN 2.6's 42-47; the
// transposed one (16 x 1024 by 1024 x 256) 100 against 88; the weight gradient h^T . d_gates
// (256 x 256^T by 256 x 1024) 78-90 against 44-47; the inputs' cotangents (32 x 1024 by 64 x
// 1024^T) 75-95 against 57-71. oneDNN stays where it is as fast or faster: the input projection
// (512 x 64 by 64 x 1024, b packed on every call: 86 against 93) and the fused attention's block
// products (64 x 64 by 64 x 256 and the like, transposed or not: 84-93 against 91-100).
namespace {
bool avx2_serial_takes(bool ta, std::int64_t n, std::int64_t k) { return uses_f32_avx2() && ((ta && n >= 256) || k >= 512); }
}  // namespace

bool uses_f32_avx2() {
#if LINUM_HAVE_ONEDNN
  return engine() == Engine::onednn && f32_avx2_available() && !f32_panels_available();
#else
  return false;
#endif
}

void gemm_f32_serial(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
                     std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  if (avx2_serial_takes(ta, n, k)) return gemm_f32_avx2_serial(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
#if LINUM_HAVE_ONEDNN
  if (engine() == Engine::onednn) return gemm_f32_serial_onednn(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
#endif
  gemm_f32_serial_eigen(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void gemm_bf16_rounded_serial(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
                              std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k > kRoundedSumPiece) {  // long sums in pieces, each piece's product added to C in float32
    for (std::int64_t k0 = 0; k0 < k; k0 += kRoundedSumPiece) {
      const std::int64_t kk = std::min(kRoundedSumPiece, k - k0);
      gemm_bf16_rounded_serial(ta, tb, m, n, kk, alpha, ta ? a + k0 * lda : a + k0, lda, tb ? b + k0 : b + k0 * ldb, ldb,
                               k0 == 0 ? beta : 1.0f, c, ldc);
    }
    return;
  }
  // Each operand as stored (rows x cols, row stride ld) into a compact rounded copy.
  auto rounded = [](const float* x, std::int64_t rows, std::int64_t cols, std::int64_t ld, DType dt) {
    Array out = Array::empty(Shape{rows * cols}, dt);
    if (dt == DType::bf16) f32_rows_to_bf16(x, ld, rows, cols, static_cast<bfloat16*>(out.mutable_raw()));
    else f32_rows_rounded_to_bf16(x, ld, rows, cols, out.mutable_data());
    return out;
  };
  const std::int64_t a_rows = ta ? k : m, a_cols = ta ? m : k, b_rows = tb ? n : k, b_cols = tb ? k : n;
#if LINUM_HAVE_ONEDNN
  if (engine() == Engine::onednn && k > 0 && onednn_bf16_matmul_used()) {
    const Array a16 = rounded(a, a_rows, a_cols, lda, DType::bf16), b16 = rounded(b, b_rows, b_cols, ldb, DType::bf16);
    return gemm_bf16_serial_onednn(ta, tb, m, n, k, alpha, static_cast<const bfloat16*>(a16.raw()), a_cols,
                                   static_cast<const bfloat16*>(b16.raw()), b_cols, beta, c, ldc);
  }
#endif
  // The rounded values as float32, multiplied by the engine's float32 product (on oneDNN also where
  // it has no bf16 kernels for this CPU).
  const Array ar = rounded(a, a_rows, a_cols, lda, DType::f32), br = rounded(b, b_rows, b_cols, ldb, DType::f32);
  gemm_f32_serial(ta, tb, m, n, k, alpha, ar.data(), a_cols, br.data(), b_cols, beta, c, ldc);
}

PackedProduct::PackedProduct(std::int64_t m, std::int64_t n, std::int64_t k, const float* b, std::int64_t ldb, bool tb,
                             std::int64_t lda, std::int64_t ldc, bool accumulate, Operands operands)
    : m_(m), n_(n), k_(k), ldb_(tb ? k : n), lda_(lda), ldc_(ldc), tb_(tb), accumulate_(accumulate), operands_(operands) {
  const std::int64_t rows = tb ? n : k, cols = ldb_;  // of b (its columns when tb)
  if (uses_f32_avx2() && m > 0 && n > 0 && k > 0) {  // b (rounded for bf16) packed into the AVX2 kernel's panels
    avx2_ = true;
    own_b_ = Array::empty(Shape{avx2_packed_floats(k, n)});
    if (operands == Operands::bf16) {
      Array rounded_b = Array::empty(Shape{rows * cols});
      f32_rows_rounded_to_bf16(b, ldb, rows, cols, rounded_b.mutable_data());
      pack_f32_avx2(rounded_b.data(), cols, tb, k, n, own_b_.mutable_data());
      rounded_a_ = Array::empty(Shape{m * k});
    } else {
      pack_f32_avx2(b, ldb, tb, k, n, own_b_.mutable_data());
    }
    return;
  }
#if LINUM_HAVE_ONEDNN
  if (engine() == Engine::onednn && m > 0 && n > 0 && k > 0) {
    if (operands == Operands::f32 || onednn_bf16_matmul_used()) {
      onednn_ = onednn_pack(m, n, k, b, ldb, tb, lda, ldc, accumulate, operands);
      return;
    }
    // bf16 where this CPU has no oneDNN bf16 matmul: oneDNN's float32 product on the rounded
    // operands (b rounded here, a on every run), the sums bf16 kernels compute.
    Array rounded_b = Array::empty(Shape{rows * cols});
    f32_rows_rounded_to_bf16(b, ldb, rows, cols, rounded_b.mutable_data());
    onednn_ = onednn_pack(m, n, k, rounded_b.data(), cols, tb, k, ldc, accumulate, Operands::f32);
    rounded_a_ = Array::empty(Shape{m * k});
    return;
  }
#endif
  // b's rows (its columns when tb) into a compact copy.
  own_b_ = Array::empty(Shape{rows * cols});
  if (operands == Operands::bf16) rounded_a_ = Array::empty(Shape{m * k});
  if (rows == 0 || cols == 0) return;
  if (operands == Operands::bf16) {
    f32_rows_rounded_to_bf16(b, ldb, rows, cols, own_b_.mutable_data());
    return;
  }
  for (std::int64_t r = 0; r < rows; ++r)
    std::copy(b + r * ldb, b + r * ldb + cols, own_b_.mutable_data() + r * cols);
}

PackedProduct::PackedProduct(const PackedProduct& s, Share)
    : m_(s.m_), n_(s.n_), k_(s.k_), ldb_(s.ldb_), lda_(s.lda_), ldc_(s.ldc_), own_b_(s.own_b_), tb_(s.tb_),
      accumulate_(s.accumulate_), avx2_(s.avx2_), operands_(s.operands_) {
  if (s.rounded_a_.defined()) rounded_a_ = Array::empty(s.rounded_a_.shape());
#if LINUM_HAVE_ONEDNN
  if (s.onednn_ != nullptr) onednn_ = onednn_share(s.onednn_);
#endif
}

std::unique_ptr<PackedProduct> PackedProduct::sharing_weights() const {
  return std::unique_ptr<PackedProduct>(new PackedProduct(*this, Share{}));
}

PackedProduct::~PackedProduct() {
#if LINUM_HAVE_ONEDNN
  if (onednn_ != nullptr) onednn_free(onednn_);
#endif
}

void PackedProduct::run(const float* a, float* c) const {
  if (avx2_) {
    std::int64_t lda = lda_;
    if (operands_ == Operands::bf16) {
      f32_rows_rounded_to_bf16(a, lda_, m_, k_, rounded_a_.mutable_data());
      a = rounded_a_.data();
      lda = k_;
    }
    return gemm_f32_avx2_packed(m_, n_, k_, 1.0f, a, lda, false, own_b_.data(), accumulate_ ? 1.0f : 0.0f, c, ldc_);
  }
#if LINUM_HAVE_ONEDNN
  if (onednn_ != nullptr) {
    if (rounded_a_.defined()) {  // bf16 on oneDNN's float32 kernels (the constructor)
      f32_rows_rounded_to_bf16(a, lda_, m_, k_, rounded_a_.mutable_data());
      a = rounded_a_.data();
    }
    return onednn_run(onednn_, a, c);
  }
#endif
  // Eigen (the engine at construction, or an empty product): not the current engine, which a
  // set_engine between a forward pass and its recomputation could change.
  std::int64_t lda = lda_;
  if (operands_ == Operands::bf16 && m_ > 0 && k_ > 0) {
    f32_rows_rounded_to_bf16(a, lda_, m_, k_, rounded_a_.mutable_data());
    a = rounded_a_.data();
    lda = k_;
  }
  gemm_f32_serial_eigen(false, tb_, m_, n_, k_, 1.0f, a, lda, own_b_.data(), ldb_, accumulate_ ? 1.0f : 0.0f, c, ldc_);
}

}  // namespace kernels

}  // namespace linum
