// Matrix products on oneDNN. Primitives are created once per (shapes, transposes, dtype, threads)
// and cached, so a training step does not rebuild them; executing the same cached primitive on the
// same shapes gives bitwise the same result, which remat's recomputation relies on.
#include <linum/core/fp_mode.hpp>
#include <linum/core/kernels/engine.hpp>
#include <linum/core/kernels/gemm.hpp>
#include <linum/core/kernels/transpose_internal.hpp>
#include <linum/core/threading.hpp>

#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <tuple>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace linum::kernels {
namespace {

using dnnl::memory;

dnnl::engine& cpu_engine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

memory::data_type to_dnnl(DType t) { return t == DType::bf16 ? memory::data_type::bf16 : memory::data_type::f32; }

struct Key {
  std::int64_t batch, m, k, n;
  bool ta, tb;
  DType dtype;
  int threads;
  bool bias = false;  // a bias row added to every output row before rounding (the product's epilogue)
  auto tie() const { return std::tie(batch, m, k, n, ta, tb, dtype, threads, bias); }
  bool operator<(const Key& o) const { return tie() < o.tie(); }
};

struct Cached {
  memory::desc a, b, c, bias;
  dnnl::matmul primitive;
};

std::mutex g_cache_mutex;
std::map<Key, Cached>& cache() {
  static std::map<Key, Cached> c;
  return c;
}

// The primitive for `key`, created on first use. Operands are described through strides, so a
// transposed operand is read in place.
const Cached& primitive_for(const Key& key) {
  std::lock_guard<std::mutex> lock(g_cache_mutex);
  auto it = cache().find(key);
  if (it != cache().end()) return it->second;
  const auto dt = to_dnnl(key.dtype);
  const memory::dim B = key.batch, M = key.m, K = key.k, N = key.n;
  // a is stored [B, M, K] (or [B, K, M] when ta): logical [B, M, K] with the matching strides.
  memory::desc a(memory::dims{B, M, K}, dt, key.ta ? memory::dims{M * K, 1, M} : memory::dims{M * K, K, 1});
  memory::desc b(memory::dims{B, K, N}, dt, key.tb ? memory::dims{K * N, 1, K} : memory::dims{K * N, N, 1});
  memory::desc c(memory::dims{B, M, N}, dt, memory::dims{M * N, N, 1});
  if (key.bias) {  // [1, 1, N], broadcast over the batch and the rows
    memory::desc bias(memory::dims{1, 1, N}, dt, memory::dims{N, N, 1});
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, bias, c), cpu_engine());
    return cache().emplace(key, Cached{a, b, c, bias, dnnl::matmul(pd)}).first->second;
  }
  dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), cpu_engine());
  return cache().emplace(key, Cached{a, b, c, memory::desc(), dnnl::matmul(pd)}).first->second;
}

constexpr std::int64_t kNarrowOutput = 64;  // output columns at or below which oneDNN splits sums
constexpr std::int64_t kRowPiece = 128;     // output rows per piece of a narrow product
// Float32 products with a transposed left operand (x^T g: a layer's weight gradient) of at least
// kPiecedMin rows and columns run in pieces of kPiecedRows output rows on the serial sgemm, the
// pieces shared by the team: 1.10-1.24x the matmul primitive's speed (2 threads, Zen 5, operands
// from memory; [2048, 512]^T x [2048, 512]: 486 against 392 GFLOP/s; 2048-cube 1.13x; 8192-long
// sums 1.13x), and in the deep MLP's float32 step, steps alternating in one process, 4.3-4.8%
// faster with remat every layer and 6.2% plain (the whole product on the 2-thread sgemm instead:
// 0-2.7%, and its bits could depend on the team, which the pieces' cannot). With
// 256 columns the pieces lose (0.93-0.97x), with 256 rows there is one piece, one thread (0.56-0.71x).
constexpr std::int64_t kPiecedRows = 256, kPiecedMin = 512;

#if defined(__AVX512F__)
constexpr bool kTransposeLeftPieces = false;
#else
// On AVX2 CPUs oneDNN 2.7's sgemm reads a transposed left operand slowly: a weight gradient x^T g
// ([2048, 512]^T x [2048, 512], 2 threads, AMD Zen 3) ran at 97-122 GFLOP/s pieced as below, and
// at ~117 as one matmul primitive, against ~180 for the forward product; the same pieces on a
// plain copy of x^T ran at 151-168, and copying each piece's columns first (0.2-0.4 ms a piece) at
// 134-153. So there each piece first copies its columns of a into a row-major buffer: in the deep
// MLP's float32 step, runs alternating, step minimum 0.530-0.576 s against 0.576-0.592. (Builds
// with AVX2 run these weight gradients on Linum's own AVX2 kernel instead, faster still:
// uses_f32_avx2_team, engine.cpp; this copy serves builds for older instruction sets.)
constexpr bool kTransposeLeftPieces = true;
#endif

// op(a) @ op(b) in pieces of `piece` output rows (per batch element), each summed on one thread by
// the serial sgemm, the pieces shared by the team: the bits depend on the shape only. With
// `copy_left` and ta, each piece's rows of op(a) are copied into a row-major buffer of the thread's
// first (see kTransposeLeftPieces).
void row_pieces_gemm_f32(const Array& a, const Array& b, Array& y, bool ta, bool tb, std::int64_t batch, std::int64_t m,
                         std::int64_t n, std::int64_t k, bool b_batched, std::int64_t piece, bool copy_left = false) {
  const float* A = a.data();
  const float* B = b.data();
  float* C = y.mutable_data();
  const std::int64_t lda = ta ? m : k, ldb = tb ? k : n;
  const std::int64_t pieces = (m + piece - 1) / piece, items = batch * pieces;
  copy_left = copy_left && ta;
  int team = 1;
#ifdef _OPENMP
  team = !omp_in_parallel() && items > 1 ? team_size() : 1;
#endif
  // The copies: an Array (counted by the memory accounting), allocated before the parallel region.
  Array copies = copy_left ? Array::empty(Shape{team * piece * k}) : Array();
  std::exception_ptr failure;
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) num_threads(team) if (team > 1)
#endif
  for (std::int64_t item = 0; item < items; ++item) {
    linum::detail::enter_compute();
    const std::int64_t bi = item / pieces, r0 = (item % pieces) * piece, rows = std::min(piece, m - r0);
    try {
      const float* a_piece = A + bi * m * k + (ta ? r0 : r0 * k);
      const float* b_piece = B + (b_batched ? bi * k * n : 0);
      float* c_piece = C + bi * m * n + r0 * n;
      if (copy_left) {
#ifdef _OPENMP
        float* buffer = copies.mutable_data() + omp_get_thread_num() * piece * k;
#else
        float* buffer = copies.mutable_data();
#endif
        transpose_into(a_piece, lda, k, rows, buffer, k);
        gemm_f32_serial_onednn(false, tb, rows, n, k, 1.0f, buffer, k, b_piece, ldb, 0.0f, c_piece, n);
      } else {
        gemm_f32_serial_onednn(ta, tb, rows, n, k, 1.0f, a_piece, lda, b_piece, ldb, 0.0f, c_piece, n);
      }
    } catch (...) {
#ifdef _OPENMP
#pragma omp critical(linum_row_pieces_gemm)
#endif
      failure = std::current_exception();
    }
  }
  if (failure) std::rethrow_exception(failure);
}

}  // namespace

namespace {

Array gemm_onednn(const Array& a, const Array& b, bool ta, bool tb, const Array* bias);

// A widened bf16 weight gradient a^T b (a [k, m], b [k, n]) whose widened copies would take more
// than kWidenedCopyBytes: its sum over the k rows in pieces of kWidenedPieceRows, each piece's rows
// widened alone, the pieces' float32 products added in order, the total rounded once. The GPT's
// (4096 rows; [4096, 1024]^T [4096, 256] widened whole is 20 MB of copies) held its bf16 step's
// peak at 65.4 MB with remat (44 MB on bf16 kernels) and 290.5 MB plain; in pieces 50.7 and 275.8
// MB. The GPT's weight gradients alone took as long either way (best of 24, two processes
// alternating three times, the 2-core Xeon without AMX on a busy host: within its noise). The bits:
// a sum in pieces, fixed by the shape (not one product's order); the same on any team.
constexpr std::int64_t kWidenedCopyBytes = std::int64_t{8} << 20, kWidenedPieceRows = 1024;
bool widened_in_pieces(int ra, int rb, std::int64_t m, std::int64_t n, std::int64_t k, bool ta, bool tb, const Array* bias) {
  return ta && !tb && bias == nullptr && ra == 2 && rb == 2 && k > kWidenedPieceRows && k * (m + n) * 4 > kWidenedCopyBytes;
}
Array widened_weight_gradient(const Array& a, const Array& b, std::int64_t m, std::int64_t n, std::int64_t k) {
  using linum::detail::convert_float;
  Array z;
  for (std::int64_t r0 = 0; r0 < k; r0 += kWidenedPieceRows) {
    const std::int64_t rows = std::min(kWidenedPieceRows, k - r0);
    const Array a32 = convert_float(a.part_view(r0 * m, Shape{rows, m}), DType::f32);
    const Array b32 = convert_float(b.part_view(r0 * n, Shape{rows, n}), DType::f32);
    Array piece;
    if (uses_f32_avx2_team(a32, true, b32, false)) {  // as the float32 weight gradients (engine.cpp)
      piece = Array::empty(Shape{m, n});
      gemm_f32_avx2(m, n, rows, a32.data(), true, b32.data(), false, piece.mutable_data());
    } else {
      piece = gemm_onednn(a32, b32, true, false, nullptr);
    }
    if (r0 == 0) {
      z = std::move(piece);
      continue;
    }
    float* sum = z.mutable_data();
    const float* add = piece.data();
    for (std::int64_t i = 0; i < m * n; ++i) sum[i] += add[i];
  }
  return convert_float(z, DType::bf16);
}

// The product, with `bias` (when given: [n], a's dtype) added to every row in the epilogue.
Array gemm_onednn(const Array& a, const Array& b, bool ta, bool tb, const Array* bias) {
  const int ra = a.rank(), rb = b.rank();
  const std::int64_t batch = ra == 3 ? a.shape()[0] : 1;
  const std::int64_t a0 = a.shape()[ra - 2], a1 = a.shape()[ra - 1];
  const std::int64_t b0 = b.shape()[rb - 2];
  const std::int64_t b1 = b.shape()[rb - 1];
  const std::int64_t m = ta ? a1 : a0, k = ta ? a0 : a1, n = tb ? b0 : b1;
  // bf16 where this CPU has no oneDNN bf16 matmul (oneDNN 2.7 builds it for AVX-512 and AMX, not
  // for AVX2 CPUs such as AMD's Zen 3) or bf16_products() is widened: the float32 product of the operands widened (exactly: every
  // bf16 value is a float32), the bias added in float32 and the result rounded once, as the bf16
  // kernels' epilogue.
  if (a.dtype() == DType::bf16 && !onednn_bf16_matmul_used()) {
    using linum::detail::convert_float;
    if (widened_in_pieces(ra, rb, m, n, k, ta, tb, bias)) return widened_weight_gradient(a, b, m, n, k);
    // (the widened operands freed before the rounding, as the convolutions' in conv_onednn.cpp)
    Array z;
    {
      const Array bias32 = bias != nullptr ? convert_float(*bias, DType::f32) : Array();
      const Array a32 = convert_float(a, DType::f32), b32 = convert_float(b, DType::f32);
      if (bias == nullptr && uses_f32_avx2_team(a32, ta, b32, tb)) {  // a weight gradient: as the float32 one (engine.cpp)
        z = Array::empty(Shape{a32.dim(1), b32.dim(1)});
        gemm_f32_avx2(z.dim(0), z.dim(1), a32.dim(0), a32.data(), true, b32.data(), false, z.mutable_data());
      } else {
        z = gemm_onednn(a32, b32, ta, tb, bias != nullptr ? &bias32 : nullptr);
      }
    }
    return convert_float(z, DType::bf16);
  }
  Array y = Array::empty(ra == 3 ? Shape{batch, m, n} : Shape{m, n}, a.dtype());
  if (y.numel() == 0) return y;
  if (k == 0) {
    std::memset(y.mutable_raw(), 0, y.nbytes());
    if (bias != nullptr) add_bias_rows(y, *bias);
    return y;
  }
  const double work = static_cast<double>(batch) * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  // oneDNN's products with a narrow output (n <= 64: a weight gradient of a thin layer, a logits
  // layer) split their sums over threads, so their bits would depend on the thread count, which
  // adaptive teams change with the machine's load. Those products are cut here into row pieces
  // fixed by the shape, each summed on one thread by the serial sgemm: the same bits on any team.
  if (n <= kNarrowOutput && work >= kParallelGemmWork) {
    if (a.dtype() == DType::f32) {
      row_pieces_gemm_f32(a, b, y, ta, tb, batch, m, n, k, rb == 3, kRowPiece);
      if (bias != nullptr) add_bias_rows(y, *bias);  // float32: the same as adding it in the epilogue
      return y;
    }
    // bfloat16: one thread (the serial path has no bf16 product).
  }
  if (a.dtype() == DType::f32 && ra == 2 && rb == 2 && ta && !tb && bias == nullptr && m >= kPiecedMin && n >= kPiecedMin &&
      work >= kParallelGemmWork) {
    row_pieces_gemm_f32(a, b, y, ta, tb, 1, m, n, k, false, kPiecedRows, kTransposeLeftPieces);
    return y;
  }
  int threads = 1;
#ifdef _OPENMP
  if (n > kNarrowOutput && !omp_in_parallel() &&
      work >= kParallelGemmWork)
    threads = team_size();  // the free cores (core/threading.hpp); the product's bits do not depend on it
  const int previous = omp_get_max_threads();
  if (threads != previous) omp_set_num_threads(threads);
#endif
  const Cached& p = primitive_for(Key{batch, m, k, n, ta, tb, a.dtype(), threads, bias != nullptr});
  memory ma(p.a, cpu_engine(), const_cast<void*>(a.raw()));
  memory mb(p.b, cpu_engine(), const_cast<void*>(b.raw()));
  memory mc(p.c, cpu_engine(), y.mutable_raw());
  dnnl::stream stream(cpu_engine());
  if (bias != nullptr) {
    memory mbias(p.bias, cpu_engine(), const_cast<void*>(bias->raw()));
    p.primitive.execute(stream, {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_BIAS, mbias}, {DNNL_ARG_DST, mc}});
  } else {
    p.primitive.execute(stream, {{DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, mc}});
  }
  stream.wait();
#ifdef _OPENMP
  if (threads != previous) omp_set_num_threads(previous);
#endif
  return y;
}

}  // namespace

Array batched_gemm_onednn(const Array& a, const Array& b, bool ta, bool tb) { return gemm_onednn(a, b, ta, tb, nullptr); }

Array gemm_bias_onednn(const Array& a, const Array& b, const Array& bias) { return gemm_onednn(a, b, false, false, &bias); }

struct PackedProduct::Onednn {
  dnnl::matmul primitive;
  Array b_buffer, scratchpad_buffer;  // the packed weights and the scratchpad, counted as Arrays
  memory a, b, c, scratchpad;
  dnnl::stream stream;
  Array a_bf16;  // Operands::bf16: a rounded, [m, k] (a's row stride lda)
  std::int64_t m = 0, k = 0, lda = 0;
};

namespace {

// The calling thread's OpenMP team size set to one while alive: oneDNN plans a primitive for the
// threads it sees, and the fused kernels make and run theirs on one thread.
struct OneThread {
#ifdef _OPENMP
  int saved = omp_get_max_threads();
  OneThread() { omp_set_num_threads(1); }
  ~OneThread() { omp_set_num_threads(saved); }
#endif
};

// A buffer of at least `bytes` for oneDNN, as an Array so that the memory accounting counts it.
Array counted_buffer(std::size_t bytes) {
  return Array::empty(Shape{static_cast<std::int64_t>((bytes + sizeof(float) - 1) / sizeof(float))});
}

void* handle_of(Array& buffer) { return buffer.numel() == 0 ? DNNL_MEMORY_NONE : buffer.mutable_raw(); }

}  // namespace

PackedProduct::Onednn* onednn_pack(std::int64_t m, std::int64_t n, std::int64_t k, const float* b, std::int64_t ldb, bool tb,
                                   std::int64_t lda, std::int64_t ldc, bool accumulate, Operands operands) {
  const auto f32 = memory::data_type::f32;
  const bool bf16 = operands == Operands::bf16;
  const auto in_type = bf16 ? memory::data_type::bf16 : f32;
  const memory::desc a_md(memory::dims{m, k}, in_type, memory::dims{bf16 ? k : lda, 1});
  const memory::desc b_any(memory::dims{k, n}, in_type, memory::format_tag::any);
  const memory::desc c_md(memory::dims{m, n}, f32, memory::dims{ldc, 1});
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);  // each object its own: runs need no lock
  if (accumulate) {
    dnnl::post_ops ops;
    ops.append_sum(1.0f);
    attr.set_post_ops(ops);
  }
  // Made for one thread, as it runs (a plan made for a team could depend on its size).
  [[maybe_unused]] const OneThread one_thread{};
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_any, c_md), attr, cpu_engine());
  auto* p = new PackedProduct::Onednn{dnnl::matmul(pd), counted_buffer(pd.weights_desc().get_size()),
                                      counted_buffer(pd.scratchpad_desc().get_size()), memory(), memory(), memory(), memory(),
                                      dnnl::stream(cpu_engine())};
  try {
    if (bf16) {
      p->a_bf16 = Array::empty(Shape{m * k}, DType::bf16);
      p->m = m;
      p->k = k;
      p->lda = lda;
    }
    p->a = memory(a_md, cpu_engine(), bf16 ? p->a_bf16.mutable_raw() : DNNL_MEMORY_NONE);
    p->b = memory(pd.weights_desc(), cpu_engine(), handle_of(p->b_buffer));
    p->c = memory(c_md, cpu_engine(), DNNL_MEMORY_NONE);
    p->scratchpad = memory(pd.scratchpad_desc(), cpu_engine(), handle_of(p->scratchpad_buffer));
    // Operands::bf16: b rounded by Linum's rounding first (oneDNN's conversion flushes subnormals
    // to zero), then packed; the compact copy lives while packing only.
    Array rounded;
    memory source;
    if (bf16) {
      const std::int64_t rows = tb ? n : k, cols = tb ? k : n;
      rounded = Array::empty(Shape{rows * cols}, DType::bf16);
      f32_rows_to_bf16(b, ldb, rows, cols, static_cast<bfloat16*>(rounded.mutable_raw()));
      const memory::desc r_md(memory::dims{k, n}, in_type, tb ? memory::dims{1, cols} : memory::dims{cols, 1});
      source = memory(r_md, cpu_engine(), rounded.mutable_raw());
    } else {
      const memory::desc b_md(memory::dims{k, n}, f32, tb ? memory::dims{1, ldb} : memory::dims{ldb, 1});
      source = memory(b_md, cpu_engine(), const_cast<float*>(b));
    }
    dnnl::reorder(source, p->b).execute(p->stream, source, p->b);
    p->stream.wait();
  } catch (...) {
    delete p;
    throw;
  }
  return p;
}

PackedProduct::Onednn* onednn_share(const PackedProduct::Onednn* s) {
  auto* p = new PackedProduct::Onednn{s->primitive, s->b_buffer, counted_buffer(s->scratchpad.get_desc().get_size()), memory(),
                                      memory(), memory(), memory(), dnnl::stream(cpu_engine())};
  try {
    if (s->a_bf16.defined()) {
      p->a_bf16 = Array::empty(s->a_bf16.shape(), DType::bf16);
      p->m = s->m;
      p->k = s->k;
      p->lda = s->lda;
    }
    p->a = memory(s->a.get_desc(), cpu_engine(), p->a_bf16.defined() ? p->a_bf16.mutable_raw() : DNNL_MEMORY_NONE);
    p->b = memory(s->b.get_desc(), cpu_engine(), handle_of(p->b_buffer));
    p->c = memory(s->c.get_desc(), cpu_engine(), DNNL_MEMORY_NONE);
    p->scratchpad = memory(s->scratchpad.get_desc(), cpu_engine(), handle_of(p->scratchpad_buffer));
  } catch (...) {
    delete p;
    throw;
  }
  return p;
}

void onednn_run(PackedProduct::Onednn* p, const float* a, float* c) {
  if (p->a_bf16.defined()) {  // Operands::bf16: a rounded into the object's buffer
    f32_rows_to_bf16(a, p->lda, p->m, p->k, static_cast<bfloat16*>(p->a_bf16.mutable_raw()));
  } else {
    p->a.set_data_handle(const_cast<float*>(a));
  }
  p->c.set_data_handle(c);
  p->primitive.execute(p->stream, {{DNNL_ARG_SRC, p->a}, {DNNL_ARG_WEIGHTS, p->b}, {DNNL_ARG_DST, p->c},
                                   {DNNL_ARG_SCRATCHPAD, p->scratchpad}});
  p->stream.wait();
}

void onednn_free(PackedProduct::Onednn* p) { delete p; }

bool onednn_bf16_matmul_available() {
  static const bool available = [] {
    try {
      const auto bf16 = memory::data_type::bf16;
      const memory::desc a(memory::dims{2, 2}, bf16, memory::dims{2, 1}), c(memory::dims{2, 2}, memory::data_type::f32, memory::dims{2, 1});
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, a, c), cpu_engine());
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return available;
}

bool onednn_bf16_matmul_used() { return onednn_bf16_matmul_available() && bf16_products() != Bf16Products::widened; }

bool onednn_uses_amx() {
  const auto amx = static_cast<unsigned>(dnnl::cpu_isa::avx512_core_amx);
  return (static_cast<unsigned>(dnnl::get_effective_cpu_isa()) & amx) == amx;
}

void gemm_bf16_serial_onednn(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                             const bfloat16* a, std::int64_t lda, const bfloat16* b, std::int64_t ldb, float beta, float* c,
                             std::int64_t ldc) {
  if (alpha != 1.0f || (beta != 0.0f && beta != 1.0f))
    throw Error("gemm_bf16_serial_onednn: alpha must be 1 and beta 0 or 1");
  // A matmul on the calling thread only (made and run with a team of one, as PackedProduct's), its
  // scratchpad an Array of its own; oneDNN's primitive cache makes the repeated creation cheap.
  [[maybe_unused]] const OneThread one_thread{};
  const auto bf16 = memory::data_type::bf16;
  const memory::desc a_md(memory::dims{m, k}, bf16, ta ? memory::dims{1, lda} : memory::dims{lda, 1});
  const memory::desc b_md(memory::dims{k, n}, bf16, tb ? memory::dims{1, ldb} : memory::dims{ldb, 1});
  const memory::desc c_md(memory::dims{m, n}, memory::data_type::f32, memory::dims{ldc, 1});
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (beta == 1.0f) {
    dnnl::post_ops ops;
    ops.append_sum(1.0f);
    attr.set_post_ops(ops);
  }
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_md, c_md), attr, cpu_engine());
  Array scratch = counted_buffer(pd.scratchpad_desc().get_size());
  memory am(a_md, cpu_engine(), const_cast<bfloat16*>(a)), bm(b_md, cpu_engine(), const_cast<bfloat16*>(b));
  memory cm(c_md, cpu_engine(), c), sm(pd.scratchpad_desc(), cpu_engine(), handle_of(scratch));
  dnnl::stream stream(cpu_engine());
  dnnl::matmul(pd).execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}, {DNNL_ARG_SCRATCHPAD, sm}});
  stream.wait();
}

void gemm_f32_serial_onednn(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
                            const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
                            std::int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) return gemm_f32_serial_eigen(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  // dnnl_sgemm is row-major and JIT-compiled for this CPU. It starts a team of its own unless it is
  // called from an active parallel region, so the calling thread's team size is set to one around
  // it: the fused kernels call it once per work item from regions that may have one thread (an
  // adaptive team on a busy machine, or a region below its size threshold), where a team per call
  // cost seconds per step and results could depend on the team.
#ifdef _OPENMP
  const int saved_threads = omp_get_max_threads();
  omp_set_num_threads(1);
#endif
  const dnnl_status_t status =
      dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
#ifdef _OPENMP
  omp_set_num_threads(saved_threads);
#endif
  if (status != dnnl_success)
    throw Error(linum::detail::cat("oneDNN sgemm failed (status ", static_cast<int>(status), ") on a ", m, "x", k, " by ", k,
                            "x", n, " product"));
}

}  // namespace linum::kernels
