// Internal: the batched matrix product every matmul, dot_general and their backward rules reach.
// Implementations: gemm_onednn.cpp (when built with oneDNN), gemm_bf16_panels.cpp and
// gemm_f32_panels.cpp (the oneDNN engine's bf16 and float32 matrix products where they are the
// faster, when built with AVX512-BF16 and AVX-512F) and gemm_eigen.cpp.
#pragma once

#include <linum/core/array.hpp>

#include <cstdint>
#include <memory>

namespace linum::kernels {

// out[i] = op(a[i]) @ op(b[i]) for stacked matrices; op transposes when asked (oneDNN and Eigen read
// through strides; the panel kernels pack their operands, transposed or not). Rank 2 operands are a
// batch of one; rank 3 are [batch, rows, cols].
// `a` is [.., M, K] (or [.., K, M] when ta), `b` is [.., K, N] (or [.., N, K] when tb). a and b
// have the same float dtype, which the result gets; accumulation is float32.
Array batched_gemm(const Array& a, const Array& b, bool ta, bool tb);

Array batched_gemm_eigen(const Array& a, const Array& b, bool ta, bool tb);
#if LINUM_HAVE_ONEDNN
Array batched_gemm_onednn(const Array& a, const Array& b, bool ta, bool tb);
#endif

// a [M, K] @ b [K, N] + bias [N] (all one float dtype), the bias added to the float32 accumulator
// before the result is rounded to the dtype: one rounding, as PyTorch's addmm and oneDNN's matmul
// with a bias (the product's epilogue; no separate pass over the output).
Array gemm_bias(const Array& a, const Array& b, const Array& bias);
Array gemm_bias_eigen(const Array& a, const Array& b, const Array& bias);
#if LINUM_HAVE_ONEDNN
Array gemm_bias_onednn(const Array& a, const Array& b, const Array& bias);
#endif
// y[r, :] += bias for every row r of a float32 or bf16 [.., n] array (bias in y's dtype).
void add_bias_rows(Array& y, const Array& bias);

// C = alpha * op(A) @ op(B) + beta * C on float32 row-major matrices with row strides lda, ldb,
// ldc (op transposes when asked: A is [m, k], or [k, m] when ta), on the calling thread only. For
// fused kernels that run their own parallel loop (attention); the result depends only on the
// operands' values, shapes and strides, never on the thread, so recomputation is bitwise.
void gemm_f32_serial(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
                     std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc);
void gemm_f32_serial_eigen(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
                           std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc);
#if LINUM_HAVE_ONEDNN
void gemm_f32_serial_onednn(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                            const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
                            std::int64_t ldc);
#endif
// The same with A and B rounded to bfloat16 (to nearest even) and their products summed in float32
// (oneDNN's gemm_bf16bf16f32; Eigen: the rounded values multiplied in float32), for layers whose
// weights are bf16: the rounded copies are Arrays (counted), made on every call. Sums longer than
// kRoundedSumPiece (the weight gradients' sums over a part's rows; the input products of inputs
// wider than that) run in pieces added to C one after the other, so that the copies of a piece stay
// small (a few hundred KB per thread).
inline constexpr std::int64_t kRoundedSumPiece = 256;
void gemm_bf16_rounded_serial(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
                              std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc);
#if LINUM_HAVE_ONEDNN
// Whether this CPU runs oneDNN's bf16 matmul (oneDNN 2.7 builds it for AVX-512 and AMX; on AVX2
// CPUs such as AMD's Zen 3 the bf16 products run on oneDNN's float32 kernels instead: the same
// rounding of the operands, float32 sums, the result rounded once).
bool onednn_bf16_matmul_available();
// Whether bf16 matmuls run on oneDNN's bf16 kernels: they exist and bf16_products() is not widened.
bool onednn_bf16_matmul_used();
// Whether oneDNN runs AMX kernels on this CPU (its effective ISA includes AMX: the CPU has it and
// the kernel lets the process use it).
bool onednn_uses_amx();
void gemm_bf16_serial_onednn(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                             const bfloat16* a, std::int64_t lda, const bfloat16* b, std::int64_t ldb, float beta, float* c,
                             std::int64_t ldc);
#endif

// Repeated serial products with one fixed right operand, for fused kernels that multiply by the same
// weights many times (the LSTM layer, once per time step): c = a . op(b) (+ c when accumulate),
// a [m, k] row-major with row stride lda, c [m, n] with row stride ldc, b [k, n] (row stride ldb;
// [n, k] when tb). b is read on construction only, into a buffer the object owns (oneDNN: a matmul
// on weights packed into its layout, made for one thread, which spares packing b on every call;
// where uses_f32_avx2(), the AVX2 kernel's panels; Eigen: a compact copy), so the caller may free b at once. The buffers are Arrays: the memory
// accounting counts them. run() computes on the calling thread only; one object must not run on two
// threads at once. The result depends only on the operands.
//
// Operands::bf16: a and b are rounded to bfloat16 (to nearest even) and their products summed in
// float32, as oneDNN's and PyTorch's bf16 products are: on oneDNN with AVX512-BF16 about twice the
// float32 speed at the fused layers' shapes (32 x 256 by 256 x 512: 37 against 85 us); on Eigen the
// same rounding with float32 products. a is rounded into a buffer the object owns on every run.
enum class Operands { f32, bf16 };
class PackedProduct {
 public:
  PackedProduct(std::int64_t m, std::int64_t n, std::int64_t k, const float* b, std::int64_t ldb, bool tb, std::int64_t lda,
                std::int64_t ldc, bool accumulate, Operands operands = Operands::f32);
  ~PackedProduct();
  PackedProduct(const PackedProduct&) = delete;
  PackedProduct& operator=(const PackedProduct&) = delete;
  void run(const float* a, float* c) const;
  // Another object on the same packed b (shared, not copied; oneDNN: the same primitive), with the
  // buffers a run writes of its own (scratchpad, rounded a), so that the two may run at once on two
  // threads (oneDNN's primitives are safe to run concurrently with separate scratchpads).
  std::unique_ptr<PackedProduct> sharing_weights() const;

  struct Onednn;  // gemm_onednn.cpp

 private:
  struct Share {};
  PackedProduct(const PackedProduct& source, Share);
  std::int64_t m_, n_, k_, ldb_, lda_, ldc_;
  Array own_b_;            // Eigen: b's compact copy (rounded to bf16 values for Operands::bf16), read by run()
  mutable Array rounded_a_;  // Operands::bf16 on Eigen, or on oneDNN's float32 kernels: a rounded, [m, k]
  bool tb_, accumulate_;
  bool avx2_ = false;      // own_b_ holds b packed for the AVX2 kernel (uses_f32_avx2 at construction)
  Operands operands_;
  Onednn* onednn_ = nullptr;
};
#if LINUM_HAVE_ONEDNN
PackedProduct::Onednn* onednn_share(const PackedProduct::Onednn* source);
PackedProduct::Onednn* onednn_pack(std::int64_t m, std::int64_t n, std::int64_t k, const float* b, std::int64_t ldb, bool tb,
                                   std::int64_t lda, std::int64_t ldc, bool accumulate, Operands operands);
void onednn_run(PackedProduct::Onednn* p, const float* a, float* c);
void onednn_free(PackedProduct::Onednn* p);
#endif

// bfloat16 products with float32 accumulation, serial, for the same fused kernels: C = alpha * A B
// + beta * C, where A is bf16 [m, k] row-major (row stride lda) and B was packed once by
// pack_bf16_pairs (ldp words per pair of B's rows), so a kernel that multiplies many row blocks by
// one B packs it once. On CPUs with AVX512-BF16 each pair of products is one vdpbf16ps lane
// operation (which rounds to nearest even and treats subnormals as zero); elsewhere scalar code
// (fused kernels then widen to float32 instead; see bf16_dot_available). Deterministic: the result
// depends only on the operands, never on the thread.
// bf16_dot_available(): built with AVX512-BF16 and bf16_products() is dot_instructions (engine.hpp).
bool bf16_dot_available();
// Packs B (bf16 [k, n] with row stride ldb, or [n, k] when tb) into (k + 1) / 2 rows of n 32-bit
// pairs, row stride ldp >= n; an odd k's last pair has a zero high half.
void pack_bf16_pairs(const bfloat16* b, std::int64_t ldb, bool tb, std::int64_t k, std::int64_t n, std::uint32_t* packed,
                     std::int64_t ldp);
void gemm_bf16_packed_serial(std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const bfloat16* a,
                             std::int64_t lda, const std::uint32_t* packed_b, std::int64_t ldp, float beta, float* c,
                             std::int64_t ldc);
// out[r, c] = bf16(a[r, c]) for a float32 [rows, cols] (row stride lda); out compact (row stride cols).
void f32_rows_to_bf16(const float* a, std::int64_t lda, std::int64_t rows, std::int64_t cols, bfloat16* out);
// The same rounding, the values kept as float32 (what the Eigen path of the bf16 products multiplies).
void f32_rows_rounded_to_bf16(const float* a, std::int64_t lda, std::int64_t rows, std::int64_t cols, float* out);
// out[c, r] = bf16(a[r, c]) for a float32 [rows, cols] (row stride lda); out's row stride is ldo.
void f32_to_bf16_transposed(const float* a, std::int64_t lda, std::int64_t rows, std::int64_t cols, bfloat16* out,
                            std::int64_t ldo);

// Whole-array bfloat16 products on Linum's own AVX512-BF16 kernel (gemm_bf16_panels.cpp), which
// the oneDNN engine uses for bf16 products of two matrices where it is the faster (sums up to 2048
// long, outputs at least 16 wide: uses_bf16_panels):
// out = op(a) @ op(b) (+ bias [n]), a [m, k] or [k, m] when ta, b [k, n] or [n, k] when tb, all
// compact row-major. Each
// element is summed over k in order on one thread, the bias added, and rounded once to bf16; so the
// bits never depend on the threads. With `pair_table` the rounded values are not written: the
// 32-bit entry for each value's bits is split into y (low half) and d (high half, written around the
// caches), which is the fused linear layer's activation and its derivative, looked up inside the
// product (linear.cpp). bf16_panels_available(): built with AVX512-BF16 (else gemm_bf16_panels throws).
struct Bf16ProductOut {
  bfloat16* z = nullptr;                      // [m, n]: the product (+ bias), when no pair_table
  const std::uint32_t* pair_table = nullptr;  // 65536 pairs, indexed by a bf16 value's bits
  bfloat16* y = nullptr;                      // [m, n]: the pairs' low halves
  bfloat16* d = nullptr;                      // [m, n]: the pairs' high halves
  float* z_f32 = nullptr;                     // [m, n]: the product (+ bias) rounded to bf16, stored widened to
                                              // float32 (instead of z; no pair_table)
  // With z: each rounded value times scale's [m, n] (both widened, one float32 multiply), rounded
  // again (bfloat16::round_bits: subnormals kept), into z; and, when tile_sums is given, each row
  // tile's column sums of those products before their rounding (rows in order, from zero), tile t's
  // at tile_sums + t * n ([ceil(m / kScaledSumRows), n]).
  const bfloat16* scale = nullptr;
  float* tile_sums = nullptr;
  // With scale: each rounded value where scale's is > 0, else 0 (relu's derivative from its output;
  // no second rounding), instead of the product.
  bool scale_selects = false;
};
// The rows of a row tile of gemm_bf16_panels: the blocks of Bf16ProductOut::tile_sums.
inline constexpr std::int64_t kScaledSumRows = 14;
bool bf16_panels_available();
// The same for a [m, k] and b given in float32 (b_f32 [k, n], neither transposed): b is rounded to
// bf16 as it is packed (f32_to_bf16's bits), into b_rounded [k, n] (written), and the product is
// that of a and b_rounded.
void gemm_bf16_panels_f32_b(std::int64_t m, std::int64_t n, std::int64_t k, const bfloat16* a, const float* b_f32,
                            bfloat16* b_rounded, const bfloat16* bias, const Bf16ProductOut& out);
void gemm_bf16_panels(std::int64_t m, std::int64_t n, std::int64_t k, const bfloat16* a, bool ta, const bfloat16* b,
                      bool tb, const bfloat16* bias, const Bf16ProductOut& out);
// Whether the engine's products of op(a) and op(b) run gemm_bf16_panels: the oneDNN engine is
// chosen, the kernel is built, both are bf16 matrices (batches stay on oneDNN, which parallelizes
// over the batch), and the shape is one where the kernel is the faster (engine.cpp says which).
bool uses_bf16_panels(const Array& a, bool ta, const Array& b, bool tb);
// Whether a product summed over k into n columns would run on the panel kernel, bf16 matrices given
// (uses_bf16_panels without the arrays).
bool bf16_panels_take(std::int64_t k, std::int64_t n);
// gemm_bias_pairs with a float32 kernel [k, n]: rounded to bf16 while it is packed (into kernel_bf16,
// allocated here), the product that of a and kernel_bf16. Requires bf16_panels_take(k, n).
void gemm_bias_pairs_f32_kernel(const Array& a, const Array& kernel, const Array& bias, const std::uint32_t* pair_table,
                                Array& kernel_bf16, Array& y, Array& d);
// a^T b for bf16 a [k, m], b [k, n]: astype(batched_gemm(a, b, true, false), f32), the widening
// inside the product's epilogue when the panel kernel runs it.
Array transposed_product_f32(const Array& a, const Array& b);
// a b^T times scale on a panel kernel (Bf16ProductOut::scale; gemm_f32_panels' scale): a [m, k],
// b [n, k] and scale [m, n] all bf16 or all float32; with column_sums, the row tiles' column sums of
// the products into it ([ceil(m / kScaledSumRows), n] float32, allocated here). An input gradient
// handed to the layer before with that layer's kept derivative applied (core/ops/linear.cpp).
// With `selects`, each element where scale's is > 0, else 0, instead of the product (relu's).
// Requires scaled_product_bt_runs(a, b, scale): the engine's a b^T runs on that panel kernel.
bool scaled_product_bt_runs(const Array& a, const Array& b, const Array& scale);
Array scaled_product_bt(const Array& a, const Array& b, const Array& scale, Array* column_sums, bool selects = false);
// The fused linear layer's forward product with its activation pair (see Bf16ProductOut): a [m, k],
// b [k, n], bias [n] or undefined; y and d [m, n] bf16, written. Requires uses_bf16_panels(a, false, b, false).
void gemm_bias_pairs(const Array& a, const Array& b, const Array& bias, const std::uint32_t* pair_table, Array& y,
                     Array& d);

// Whole-array float32 products on Linum's own AVX-512 kernel (gemm_f32_panels.cpp), which the oneDNN
// engine uses for float32 products of two matrices where it is the faster (uses_f32_panels):
// out = op(a) @ op(b) (+ bias [n]), a [m, k] or [k, m] when ta, b [k, n] or [n, k] when tb, all
// compact row-major. Each element is summed over k in order (one fused multiply-add per term) on one
// thread and the bias added; so the bits never depend on the threads.
// f32_panels_available(): built with AVX-512F (else gemm_f32_panels throws).
bool f32_panels_available();
// With `scale` ([m, n]): each element times scale's, into out; and, when tile_sums is given, each
// row tile's column sums of those products (rows in order, from zero), tile t's at tile_sums + t * n
// ([ceil(m / kScaledSumRows), n]), as Bf16ProductOut::scale without the roundings.
void gemm_f32_panels(std::int64_t m, std::int64_t n, std::int64_t k, const float* a, bool ta, const float* b, bool tb,
                     const float* bias, float* out, const float* scale = nullptr, float* tile_sums = nullptr,
                     bool scale_selects = false);
// The same product of bf16 operands, as bf16_products() == widened computes it (engine.hpp): a [m, k]
// (not transposed), b [k, n] or [n, k] when tb, bias float32 [n] (a bf16 bias widened) or null, out
// bf16 [m, n]. The operands are widened as the kernel reads them (b while it is packed, a row tile
// at a time) and each result rounded once to bf16 (bfloat16::round_bits), so out is bit for bit
// gemm_f32_panels' product of the widened operands, rounded, without the widened copies or the
// float32 result ever being written. With `scale` (bf16 [m, n]) and tile_sums, as Bf16ProductOut::scale and
// tile_sums (the rounded results times the scale, rounded again, or selected; the row tiles' column
// sums of those products). f32_panels_widened_available(): built with AVX-512F, BW and VL (else it
// throws).
bool f32_panels_widened_available();
void gemm_f32_panels_widened(std::int64_t m, std::int64_t n, std::int64_t k, const bfloat16* a, const bfloat16* b, bool tb,
                             const float* bias, bfloat16* out, const bfloat16* scale = nullptr, float* tile_sums = nullptr,
                             bool scale_selects = false);
// Whether the engine's products of op(a) and op(b) run gemm_f32_panels: the oneDNN engine is chosen,
// the kernel is built, both are float32 matrices, and the shape is one where the kernel is the faster
// (engine.cpp says which).
bool uses_f32_panels(const Array& a, bool ta, const Array& b, bool tb);
// Whether they run gemm_f32_panels_widened: the oneDNN engine is chosen, bf16_products() is widened,
// the kernel is built, both are bf16 matrices, a is not transposed, and the shape is one where the
// kernel is the faster (engine.cpp says which: from 256 rows).
bool uses_f32_panels_widened(const Array& a, bool ta, const Array& b, bool tb);

// Serial float32 products on Linum's own AVX2 kernel (gemm_f32_avx2.cpp), which the oneDNN engine
// uses on CPUs without AVX-512 where oneDNN's are slow (uses_f32_avx2): c = alpha * op(a) @ op(b) +
// beta * c (c not read when beta is 0), with gemm_f32_serial's arguments, on the calling thread.
// Each element is summed over k in order (one fused multiply-add per term), so the result depends
// only on the operands. f32_avx2_available(): built with AVX2 and FMA (else these throw).
bool f32_avx2_available();
void gemm_f32_avx2_serial(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
                          std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc);
// The same with b packed once (for a kernel that multiplies by the same b many times): b [k, n]
// (row stride ldb; [n, k] when tb) into avx2_packed_floats(k, n) floats at `packed` (32-byte
// aligned): panels of kAvx2PanelCols columns, zero past n.
inline constexpr std::int64_t kAvx2PanelCols = 16;
std::int64_t avx2_packed_floats(std::int64_t k, std::int64_t n);
void pack_f32_avx2(const float* b, std::int64_t ldb, bool tb, std::int64_t k, std::int64_t n, float* packed);
void gemm_f32_avx2_packed(std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a, std::int64_t lda,
                          bool ta, const float* packed_b, float beta, float* c, std::int64_t ldc);
// The whole product on the team: out = op(a) @ op(b), a [m, k] ([k, m] when ta), b [k, n] ([n, k]
// when tb), out [m, n], all compact; b packed once, the rows in pieces dealt to the threads. Each
// element summed as gemm_f32_avx2_serial sums it, so the bits never depend on the team.
void gemm_f32_avx2(std::int64_t m, std::int64_t n, std::int64_t k, const float* a, bool ta, const float* b, bool tb,
                   float* out);
// Whether the engine's product of op(a) and op(b) runs gemm_f32_avx2: where uses_f32_avx2(), the
// float32 weight gradients a^T b (2-D, at least 64 x 64 x 64; engine.cpp says why).
bool uses_f32_avx2_team(const Array& a, bool ta, const Array& b, bool tb);
// Whether the oneDNN engine's serial float32 products (gemm_f32_serial, PackedProduct) run on the
// AVX2 kernel: the engine is chosen and the build has AVX2 and FMA but not AVX-512 (where oneDNN's
// AVX-512 kernels are the faster).
bool uses_f32_avx2();

// Products with fewer multiply-adds than this run on the calling thread only (waking the team
// costs more than it saves, and on a busy machine it stalls the step).
constexpr double kParallelGemmWork = 4.0 * 1024 * 1024;

}  // namespace linum::kernels
