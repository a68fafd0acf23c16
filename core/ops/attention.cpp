#include <linum/core/ops/kind.hpp>
#include <linum/core/ops/attention.hpp>
#include <linum/core/ops/batching.hpp>
#include <linum/core/threading.hpp>

#include <linum/core/autodiff/primitive.hpp>
#include <linum/core/kernels/gemm.hpp>
#include <linum/core/ops/elementwise.hpp>
#include <linum/core/ops/kernel_util.hpp>
#include <linum/core/ops/linalg.hpp>
#include <linum/core/ops/shape_ops.hpp>
#include <linum/core/ops/softmax.hpp>

#include <Eigen/Core>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <new>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace linum {

namespace {

using autodiff::Cotangents;
using Row = Eigen::Map<Eigen::ArrayXf>;
using ConstRow = Eigen::Map<const Eigen::ArrayXf>;

// Query rows per block: the logits of one block ([rows, kv_len] float32) live in thread scratch,
// and with is_causal a block only computes the keys its rows can see.
constexpr std::int64_t kQueryBlock = 64;
constexpr float kLowest = std::numeric_limits<float>::lowest();

using Scratch = ops::detail::AlignedScratch;

// The problem's sizes. Item (n, h) is batch element n (the batch axes flattened) and head h; a
// row of item (n, h) in q is q[n, i, h, :], `heads * head_dim` floats after the previous row.
struct Geometry {
  std::int64_t batch = 1, heads = 0, q_len = 0, kv_len = 0, head_dim = 0, v_dim = 0;
  float scale = 1.0f;
  bool causal = false;
  Shape batch_shape;
  std::int64_t q_offset(std::int64_t n, std::int64_t h) const { return (n * q_len * heads + h) * head_dim; }
  std::int64_t k_offset(std::int64_t n, std::int64_t h) const { return (n * kv_len * heads + h) * head_dim; }
  std::int64_t v_offset(std::int64_t n, std::int64_t h) const { return (n * kv_len * heads + h) * v_dim; }
  std::int64_t o_offset(std::int64_t n, std::int64_t h) const { return (n * q_len * heads + h) * v_dim; }
  std::int64_t qk_stride() const { return heads * head_dim; }
  std::int64_t v_stride() const { return heads * v_dim; }
  // Keys visible to the query rows [begin, end): all, or with is_causal those up to end - 1.
  std::int64_t visible_keys(std::int64_t end, bool has_mask) const {
    return causal && !has_mask ? std::min(kv_len, end) : kv_len;
  }
};

// A float32 mask read in place through broadcasting strides (0 along broadcast axes).
struct MaskView {
  const float* data = nullptr;
  std::vector<std::int64_t> batch_strides;  // one per batch axis of q
  std::int64_t head_stride = 0, row_stride = 0, col_stride = 0;

  // Where item (n, h)'s [q_len, kv_len] mask starts.
  std::int64_t base(const Geometry& g, std::int64_t n, std::int64_t h) const {
    std::int64_t off = h * head_stride;
    for (int a = g.batch_shape.rank() - 1; a >= 0; --a) {
      const std::int64_t d = g.batch_shape[a];
      off += (n % d) * batch_strides[static_cast<std::size_t>(a)];
      n /= d;
    }
    return off;
  }
};

// Rows [0, rows) of a strided [rows, cols] slice of `a` starting at `offset`, as float32: a pointer
// into `a` when it is float32, else the rows widened into `scratch`. Returns the row stride.
const float* f32_rows(const Array& a, std::int64_t offset, std::int64_t rows, std::int64_t cols, std::int64_t stride,
                      Scratch& scratch, std::int64_t& ld) {
  if (a.dtype() == DType::f32) {
    ld = stride;
    return static_cast<const float*>(a.raw()) + offset;
  }
  float* s = scratch.get(rows * cols);
  const bfloat16* src = static_cast<const bfloat16*>(a.raw()) + offset;
  for (std::int64_t r = 0; r < rows; ++r) bf16_to_f32(src + r * stride, s + r * cols, cols);
  ld = cols;
  return s;
}

// Writes float32 rows (row stride `ld`) into the strided slice of `out` at `offset`, rounding for bf16.
void store_rows(Array& out, std::int64_t offset, std::int64_t rows, std::int64_t cols, std::int64_t stride,
                const float* src, std::int64_t ld) {
  if (out.dtype() == DType::f32) {
    float* dst = static_cast<float*>(out.mutable_raw()) + offset;
    if (dst == src) return;
    for (std::int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * stride, src + r * ld, static_cast<std::size_t>(cols) * 4);
    return;
  }
  bfloat16* dst = static_cast<bfloat16*>(out.mutable_raw()) + offset;
  for (std::int64_t r = 0; r < rows; ++r) f32_to_bf16(src + r * ld, dst + r * stride, cols);
}

// Sets the masked entries of logits rows [i0, i0 + rows) (keys [0, keys), row stride ld_s) to
// float32's lowest: where the mask is 0, and with is_causal the keys after each query.
void mask_logits(const Geometry& g, const MaskView* mask, std::int64_t mask_base, std::int64_t i0, std::int64_t rows,
                 std::int64_t keys, float* s, std::int64_t ld_s) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t i = i0 + r;
    float* row = s + r * ld_s;
    if (mask != nullptr) {
      const float* m = mask->data + mask_base + i * mask->row_stride;
      for (std::int64_t j = 0; j < keys; ++j)
        if (m[j * mask->col_stride] == 0.0f) row[j] = kLowest;
    }
    if (g.causal)
      for (std::int64_t j = i + 1; j < keys; ++j) row[j] = kLowest;
  }
}

// The logits of query rows [i0, i0 + rows) against keys [0, keys) into s (row stride ld_s):
// scale * q k^T with masked entries at float32's lowest.
void masked_logits(const Geometry& g, const MaskView* mask, std::int64_t mask_base, const float* q, std::int64_t ldq,
                   const float* k, std::int64_t ldk, std::int64_t i0, std::int64_t rows, std::int64_t keys, float* s,
                   std::int64_t ld_s) {
  kernels::gemm_f32_serial(false, true, rows, keys, g.head_dim, g.scale, q + i0 * ldq, ldq, k, ldk, 0.0f, s, ld_s);
  mask_logits(g, mask, mask_base, i0, rows, keys, s, ld_s);
}

// Softmax of logits rows in place (keys [0, keys), row stride ld), keeping (max, 1 / sum) per row.
void softmax_rows(float* s, std::int64_t ld, std::int64_t rows, std::int64_t keys, float* row_stats) {
  for (std::int64_t r = 0; r < rows; ++r) {
    Row p(s + r * ld, keys);
    const float m = p.maxCoeff();
    p = (p - m).exp();
    const float inv = 1.0f / p.sum();
    p *= inv;
    row_stats[2 * r] = m;
    row_stats[2 * r + 1] = inv;
  }
}

// The weights of logits rows from the saved (max, 1 / sum): exp(s - max) / sum, in place.
void weights_from_stats(float* p, std::int64_t ld, std::int64_t rows, std::int64_t keys, const float* row_stats) {
  for (std::int64_t r = 0; r < rows; ++r) {
    Row pr(p + r * ld, keys);
    pr = (pr - row_stats[2 * r]).exp() * row_stats[2 * r + 1];
  }
}

// ds = p (dp - rowsum(do * o)) in place of dp, zero where the logits were constants (masked, or
// a row that attended to nothing). `d_dot_o(r)` gives row r's rowsum(do * o).
template <class RowDot>
void weights_grad_rows(const Geometry& g, const MaskView* mask, std::int64_t mask_base, std::int64_t i0,
                       std::int64_t rows, std::int64_t keys, const float* p, float* dp, const float* row_stats,
                       RowDot&& d_dot_o) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t i = i0 + r;
    Row dsr(dp + r * g.kv_len, keys);
    if (row_stats[2 * r] == kLowest) {  // nothing attended: the logits were constants
      dsr.setZero();
      continue;
    }
    const float di = d_dot_o(r);
    dsr = ConstRow(p + r * g.kv_len, keys) * (dsr - di);
    if (mask != nullptr) {  // masked logits were constants: no gradient through them
      const float* m = mask->data + mask_base + i * mask->row_stride;
      float* d = dp + r * g.kv_len;
      for (std::int64_t j = 0; j < keys; ++j)
        if (m[j * mask->col_stride] == 0.0f) d[j] = 0.0f;
    }
  }
}

// Runs f(n, h, scratch...) for every item, in parallel when the work is large enough. Items are
// handed out dynamically, so on a busy machine the free core takes more of them.
template <class F>
void for_items(const Geometry& g, F&& f) {
  const std::int64_t items = g.batch * g.heads;
  [[maybe_unused]] const double work = static_cast<double>(items) * static_cast<double>(g.q_len) * static_cast<double>(g.kv_len) *
                      static_cast<double>(g.head_dim + g.v_dim);
  std::exception_ptr error;
  std::mutex error_mutex;
#pragma omp parallel if (work >= kernels::kParallelGemmWork && items > 1) num_threads(linum::team_size())
  {
    linum::detail::enter_compute();
    Scratch scratch[6];
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t item = 0; item < items; ++item) {
      try {
        f(item / g.heads, item % g.heads, scratch);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

// Item (n, h)'s q, k and v rows as float32 (in place, or widened into scratch 0-2), with row strides.
struct ItemInputs {
  std::int64_t ldq = 0, ldk = 0, ldv = 0;  // declared first: the pointers' initializers set them
  const float *q, *k, *v;
  ItemInputs(const Geometry& g, const Array& qa, const Array& ka, const Array& va, std::int64_t n, std::int64_t h,
             Scratch* scratch)
      : q(f32_rows(qa, g.q_offset(n, h), g.q_len, g.head_dim, g.qk_stride(), scratch[0], ldq)),
        k(f32_rows(ka, g.k_offset(n, h), g.kv_len, g.head_dim, g.qk_stride(), scratch[1], ldk)),
        v(f32_rows(va, g.v_offset(n, h), g.kv_len, g.v_dim, g.v_stride(), scratch[2], ldv)) {}
};

// Forward: out = softmax(logits) v, and per query row (max, 1 / sum of exp) in stats.
void attention_forward(const Geometry& g, const Array& q, const Array& k, const Array& v, const MaskView* mask,
                       Array& out, Array& stats) {
  float* stats_data = stats.mutable_data();
  for_items(g, [&](std::int64_t n, std::int64_t h, Scratch* scratch) {
    const ItemInputs in(g, q, k, v, n, h, scratch);
    const std::int64_t mask_base = mask ? mask->base(g, n, h) : 0;
    float* s = scratch[3].get(kQueryBlock * g.kv_len);
    const bool direct = out.dtype() == DType::f32;
    float* o_block = direct ? nullptr : scratch[4].get(kQueryBlock * g.v_dim);
    float* row_stats = stats_data + (n * g.heads + h) * g.q_len * 2;
    for (std::int64_t i0 = 0; i0 < g.q_len; i0 += kQueryBlock) {
      const std::int64_t rows = std::min(kQueryBlock, g.q_len - i0);
      const std::int64_t keys = g.visible_keys(i0 + rows, mask != nullptr);
      masked_logits(g, mask, mask_base, in.q, in.ldq, in.k, in.ldk, i0, rows, keys, s, g.kv_len);
      softmax_rows(s, g.kv_len, rows, keys, row_stats + 2 * i0);
      float* o = direct ? static_cast<float*>(out.mutable_raw()) + g.o_offset(n, h) + i0 * g.v_stride() : o_block;
      const std::int64_t ldo = direct ? g.v_stride() : g.v_dim;
      kernels::gemm_f32_serial(false, false, rows, g.v_dim, keys, 1.0f, s, g.kv_len, in.v, in.ldv, 0.0f, o, ldo);
      if (!direct) store_rows(out, g.o_offset(n, h) + i0 * g.v_stride(), rows, g.v_dim, g.v_stride(), o, ldo);
    }
  });
}

// Backward: recomputes each block's weights from the saved row statistics, then
// dv = p^T do, dp = do v^T, ds = p (dp - rowsum(do * o)), dq = scale ds k, dk = scale ds^T q.
void attention_backward(const Geometry& g, const Array& q, const Array& k, const Array& v, const Array& out,
                        const Array& stats, const MaskView* mask, const Array& d_out, Array& dq, Array& dk, Array& dv) {
  const float* stats_data = stats.data();
  for_items(g, [&](std::int64_t n, std::int64_t h, Scratch* scratch) {
    const ItemInputs in(g, q, k, v, n, h, scratch);
    std::int64_t ldo, lddo;
    const float* of = f32_rows(out, g.o_offset(n, h), g.q_len, g.v_dim, g.v_stride(), scratch[4], ldo);
    const float* dof = f32_rows(d_out, g.o_offset(n, h), g.q_len, g.v_dim, g.v_stride(), scratch[5], lddo);
    // Scratch 3: the p and dp blocks, then the dk and dv accumulators.
    const std::int64_t block = kQueryBlock * g.kv_len;
    float* p = scratch[3].get(2 * block + g.kv_len * (g.head_dim + g.v_dim));
    float* dp = p + block;
    float* dk_acc = dp + block;
    float* dv_acc = dk_acc + g.kv_len * g.head_dim;
    std::fill(dk_acc, dk_acc + g.kv_len * (g.head_dim + g.v_dim), 0.0f);
    const bool dq_direct = dq.dtype() == DType::f32;
    std::vector<float> dq_rows;
    if (!dq_direct) dq_rows.resize(static_cast<std::size_t>(kQueryBlock * g.head_dim));
    const std::int64_t mask_base = mask ? mask->base(g, n, h) : 0;
    const float* row_stats = stats_data + (n * g.heads + h) * g.q_len * 2;
    for (std::int64_t i0 = 0; i0 < g.q_len; i0 += kQueryBlock) {
      const std::int64_t rows = std::min(kQueryBlock, g.q_len - i0);
      const std::int64_t keys = g.visible_keys(i0 + rows, mask != nullptr);
      masked_logits(g, mask, mask_base, in.q, in.ldq, in.k, in.ldk, i0, rows, keys, p, g.kv_len);
      weights_from_stats(p, g.kv_len, rows, keys, row_stats + 2 * i0);
      // dv[0:keys] += p^T do
      kernels::gemm_f32_serial(true, false, keys, g.v_dim, rows, 1.0f, p, g.kv_len, dof + i0 * lddo, lddo, 1.0f, dv_acc,
                               g.v_dim);
      // dp = do v^T
      kernels::gemm_f32_serial(false, true, rows, keys, g.v_dim, 1.0f, dof + i0 * lddo, lddo, in.v, in.ldv, 0.0f, dp, g.kv_len);
      weights_grad_rows(g, mask, mask_base, i0, rows, keys, p, dp, row_stats + 2 * i0, [&](std::int64_t r) {
        const std::int64_t i = i0 + r;
        return (ConstRow(dof + i * lddo, g.v_dim) * ConstRow(of + i * ldo, g.v_dim)).sum();
      });
      // dq = scale ds k
      float* dq_out = dq_direct ? static_cast<float*>(dq.mutable_raw()) + g.q_offset(n, h) + i0 * g.qk_stride()
                                : dq_rows.data();
      const std::int64_t lddq = dq_direct ? g.qk_stride() : g.head_dim;
      kernels::gemm_f32_serial(false, false, rows, g.head_dim, keys, g.scale, dp, g.kv_len, in.k, in.ldk, 0.0f, dq_out, lddq);
      if (!dq_direct) store_rows(dq, g.q_offset(n, h) + i0 * g.qk_stride(), rows, g.head_dim, g.qk_stride(), dq_out, lddq);
      // dk[0:keys] += scale ds^T q
      kernels::gemm_f32_serial(true, false, keys, g.head_dim, rows, g.scale, dp, g.kv_len, in.q + i0 * in.ldq, in.ldq, 1.0f,
                               dk_acc, g.head_dim);
    }
    store_rows(dk, g.k_offset(n, h), g.kv_len, g.head_dim, g.qk_stride(), dk_acc, g.head_dim);
    store_rows(dv, g.v_offset(n, h), g.kv_len, g.v_dim, g.v_stride(), dv_acc, g.v_dim);
  });
}

// The bfloat16 path (bf16 q, k, v on CPUs with AVX512-BF16): the same blocks and float32 softmax,
// with every product on bf16 operands and float32 accumulation, as flash attention does. The
// weights p and their gradient ds are rounded to bf16 before the products that read them; the
// right-hand operands are packed into vdpbf16ps's pair layout once per item (k, v) or block (q, do).
namespace bf16_path {

const bfloat16* rows_of(const Array& a, std::int64_t offset) { return static_cast<const bfloat16*>(a.raw()) + offset; }
std::uint32_t* words(Scratch& s, std::int64_t n) { return reinterpret_cast<std::uint32_t*>(s.get(n)); }
bfloat16* halves(float* f) { return reinterpret_cast<bfloat16*>(f); }
std::int64_t pairs(std::int64_t k) { return (k + 1) / 2; }

// The masked logits of query rows [i0, i0 + rows) against keys [0, keys) into s (row stride
// kv_len), from bf16 q rows and the packed k^T.
void masked_logits(const Geometry& g, const MaskView* mask, std::int64_t mask_base, const bfloat16* q, std::int64_t ldq,
                   const std::uint32_t* kt, std::int64_t i0, std::int64_t rows, std::int64_t keys, float* s) {
  kernels::gemm_bf16_packed_serial(rows, keys, g.head_dim, g.scale, q + i0 * ldq, ldq, kt, g.kv_len, 0.0f, s, g.kv_len);
  mask_logits(g, mask, mask_base, i0, rows, keys, s, g.kv_len);
}

void forward(const Geometry& g, const Array& q, const Array& k, const Array& v, const MaskView* mask, Array& out,
             Array& stats) {
  float* stats_data = stats.mutable_data();
  const std::int64_t ldq = g.qk_stride(), ldv = g.v_stride();
  for_items(g, [&](std::int64_t n, std::int64_t h, Scratch* scratch) {
    const bfloat16* qp = rows_of(q, g.q_offset(n, h));
    // k^T as the right operand of q k^T, v as the right operand of p v
    std::uint32_t* kt = words(scratch[0], pairs(g.head_dim) * g.kv_len);
    kernels::pack_bf16_pairs(rows_of(k, g.k_offset(n, h)), ldq, true, g.head_dim, g.kv_len, kt, g.kv_len);
    std::uint32_t* vb = words(scratch[1], pairs(g.kv_len) * g.v_dim);
    kernels::pack_bf16_pairs(rows_of(v, g.v_offset(n, h)), ldv, false, g.kv_len, g.v_dim, vb, g.v_dim);
    float* s = scratch[3].get(kQueryBlock * g.kv_len);
    bfloat16* p16 = halves(scratch[2].get(pairs(kQueryBlock * g.kv_len)));
    float* o = scratch[4].get(kQueryBlock * g.v_dim);
    const std::int64_t mask_base = mask ? mask->base(g, n, h) : 0;
    float* row_stats = stats_data + (n * g.heads + h) * g.q_len * 2;
    for (std::int64_t i0 = 0; i0 < g.q_len; i0 += kQueryBlock) {
      const std::int64_t rows = std::min(kQueryBlock, g.q_len - i0);
      const std::int64_t keys = g.visible_keys(i0 + rows, mask != nullptr);
      masked_logits(g, mask, mask_base, qp, ldq, kt, i0, rows, keys, s);
      softmax_rows(s, g.kv_len, rows, keys, row_stats + 2 * i0);
      for (std::int64_t r = 0; r < rows; ++r) f32_to_bf16(s + r * g.kv_len, p16 + r * g.kv_len, keys);
      kernels::gemm_bf16_packed_serial(rows, g.v_dim, keys, 1.0f, p16, g.kv_len, vb, g.v_dim, 0.0f, o, g.v_dim);
      store_rows(out, g.o_offset(n, h) + i0 * ldv, rows, g.v_dim, ldv, o, g.v_dim);
    }
  });
}

void backward(const Geometry& g, const Array& q, const Array& k, const Array& v, const Array& out, const Array& stats,
              const MaskView* mask, const Array& d_out, Array& dq, Array& dk, Array& dv) {
  const float* stats_data = stats.data();
  const std::int64_t ldq = g.qk_stride(), ldv = g.v_stride();
  for_items(g, [&](std::int64_t n, std::int64_t h, Scratch* scratch) {
    const bfloat16* qp = rows_of(q, g.q_offset(n, h));
    const bfloat16* kp = rows_of(k, g.k_offset(n, h));
    const bfloat16* vp = rows_of(v, g.v_offset(n, h));
    const bfloat16* op = rows_of(out, g.o_offset(n, h));
    const bfloat16* dop = rows_of(d_out, g.o_offset(n, h));
    // Right operands for the whole item: k^T (logits), v^T (dp = do v^T), k (dq = ds k).
    const std::int64_t kt_words = pairs(g.head_dim) * g.kv_len, vt_words = pairs(g.v_dim) * g.kv_len;
    std::uint32_t* kt = words(scratch[0], kt_words + vt_words);
    std::uint32_t* vt = kt + kt_words;
    kernels::pack_bf16_pairs(kp, ldq, true, g.head_dim, g.kv_len, kt, g.kv_len);
    kernels::pack_bf16_pairs(vp, ldv, true, g.v_dim, g.kv_len, vt, g.kv_len);
    std::uint32_t* kb = words(scratch[1], pairs(g.kv_len) * g.head_dim);
    kernels::pack_bf16_pairs(kp, ldq, false, g.kv_len, g.head_dim, kb, g.head_dim);
    // Float32 blocks p and dp, then the dk and dv accumulators.
    const std::int64_t block = kQueryBlock * g.kv_len;
    float* p = scratch[3].get(2 * block + g.kv_len * (g.head_dim + g.v_dim));
    float* dp = p + block;
    float* dk_acc = dp + block;
    float* dv_acc = dk_acc + g.kv_len * g.head_dim;
    std::fill(dk_acc, dk_acc + g.kv_len * (g.head_dim + g.v_dim), 0.0f);
    // bf16 blocks: ds [rows, keys], p^T or ds^T [keys, rows]; packed do and q blocks.
    const std::int64_t block_halves = pairs(block) + 1;
    const std::int64_t block_pairs = pairs(kQueryBlock);
    float* b16 = scratch[4].get(2 * block_halves + block_pairs * (g.v_dim + g.head_dim));
    bfloat16* ds16 = halves(b16);
    bfloat16* t16 = halves(b16 + block_halves);
    std::uint32_t* do_b = reinterpret_cast<std::uint32_t*>(b16 + 2 * block_halves);
    std::uint32_t* q_b = do_b + block_pairs * g.v_dim;
    float* dq_rows = scratch[5].get(kQueryBlock * g.head_dim);
    const std::int64_t mask_base = mask ? mask->base(g, n, h) : 0;
    const float* row_stats = stats_data + (n * g.heads + h) * g.q_len * 2;
    for (std::int64_t i0 = 0; i0 < g.q_len; i0 += kQueryBlock) {
      const std::int64_t rows = std::min(kQueryBlock, g.q_len - i0);
      const std::int64_t keys = g.visible_keys(i0 + rows, mask != nullptr);
      masked_logits(g, mask, mask_base, qp, ldq, kt, i0, rows, keys, p);
      weights_from_stats(p, g.kv_len, rows, keys, row_stats + 2 * i0);
      // dv[0:keys] += p^T do
      kernels::f32_to_bf16_transposed(p, g.kv_len, rows, keys, t16, kQueryBlock);
      kernels::pack_bf16_pairs(dop + i0 * ldv, ldv, false, rows, g.v_dim, do_b, g.v_dim);
      kernels::gemm_bf16_packed_serial(keys, g.v_dim, rows, 1.0f, t16, kQueryBlock, do_b, g.v_dim, 1.0f, dv_acc, g.v_dim);
      // dp = do v^T, then ds
      kernels::gemm_bf16_packed_serial(rows, keys, g.v_dim, 1.0f, dop + i0 * ldv, ldv, vt, g.kv_len, 0.0f, dp, g.kv_len);
      weights_grad_rows(g, mask, mask_base, i0, rows, keys, p, dp, row_stats + 2 * i0, [&](std::int64_t r) {
        const bfloat16* dor = dop + (i0 + r) * ldv;
        const bfloat16* orow = op + (i0 + r) * ldv;
        float acc = 0.0f;
        for (std::int64_t j = 0; j < g.v_dim; ++j) acc += static_cast<float>(dor[j]) * static_cast<float>(orow[j]);
        return acc;
      });
      // dq = scale ds k
      for (std::int64_t r = 0; r < rows; ++r) f32_to_bf16(dp + r * g.kv_len, ds16 + r * g.kv_len, keys);
      kernels::gemm_bf16_packed_serial(rows, g.head_dim, keys, g.scale, ds16, g.kv_len, kb, g.head_dim, 0.0f, dq_rows,
                                       g.head_dim);
      store_rows(dq, g.q_offset(n, h) + i0 * ldq, rows, g.head_dim, ldq, dq_rows, g.head_dim);
      // dk[0:keys] += scale ds^T q
      kernels::f32_to_bf16_transposed(dp, g.kv_len, rows, keys, t16, kQueryBlock);
      kernels::pack_bf16_pairs(qp + i0 * ldq, ldq, false, rows, g.head_dim, q_b, g.head_dim);
      kernels::gemm_bf16_packed_serial(keys, g.head_dim, rows, g.scale, t16, kQueryBlock, q_b, g.head_dim, 1.0f, dk_acc,
                                       g.head_dim);
    }
    store_rows(dk, g.k_offset(n, h), g.kv_len, g.head_dim, ldq, dk_acc, g.head_dim);
    store_rows(dv, g.v_offset(n, h), g.kv_len, g.v_dim, ldv, dv_acc, g.v_dim);
  });
}

}  // namespace bf16_path

// bf16 inputs take the bf16 path when the CPU has bf16 dot products; everything else widens to float32.
bool use_bf16_path(const Array& q) { return q.dtype() == DType::bf16 && kernels::bf16_dot_available(); }

[[noreturn]] void shape_error(const char* why, const Array& q, const Array& k, const Array& v) {
  throw ShapeError(linum::detail::cat("scaled_dot_product_attention: ", why, " (query ", q.shape(), ", key ", k.shape(),
                                      ", value ", v.shape(), "); the layout is [batch..., length, heads, head_dim]"));
}

Geometry geometry_of(const Array& q, const Array& k, const Array& v, const ScaledDotProductAttentionOptions& o) {
  for (const Array* a : {&q, &k, &v}) ops::detail::require_float(*a, "scaled_dot_product_attention");
  const int r = q.rank();
  if (r < 3 || k.rank() != r || v.rank() != r) shape_error("query, key and value must have the same rank, at least 3", q, k, v);
  Geometry g;
  for (int a = 0; a < r - 3; ++a) {
    if (k.dim(a) != q.dim(a) || v.dim(a) != q.dim(a)) shape_error("batch dims must match", q, k, v);
    g.batch_shape.push_back(q.dim(a));
    g.batch *= q.dim(a);
  }
  g.q_len = q.dim(-3);
  g.kv_len = k.dim(-3);
  g.heads = q.dim(-2);
  g.head_dim = q.dim(-1);
  g.v_dim = v.dim(-1);
  if (k.dim(-2) != g.heads || v.dim(-2) != g.heads) shape_error("num_heads must match", q, k, v);
  if (k.dim(-1) != g.head_dim) shape_error("query and key depths must match", q, k, v);
  if (v.dim(-3) != g.kv_len) shape_error("key and value lengths must match", q, k, v);
  if (g.kv_len == 0 && g.q_len > 0 && g.batch * g.heads > 0)
    shape_error("there must be at least one key for the queries to attend to", q, k, v);
  if (o.scale && !std::isfinite(*o.scale))
    throw ValueError(linum::detail::cat("scaled_dot_product_attention: scale must be finite, got ", *o.scale));
  g.scale = o.scale.value_or(g.head_dim > 0 ? 1.0f / std::sqrt(static_cast<float>(g.head_dim)) : 1.0f);
  g.causal = o.is_causal;
  return g;
}

// The mask as float32 with its broadcasting strides against [batch..., heads, q_len, kv_len].
MaskView mask_view(const Array& mask, const Geometry& g, const Array& q, const Array& k, const Array& v) {
  Shape target = g.batch_shape;
  target.push_back(g.heads);
  target.push_back(g.q_len);
  target.push_back(g.kv_len);
  const int r = target.rank(), rm = mask.rank();
  if (rm > r)
    throw ShapeError(linum::detail::cat("scaled_dot_product_attention: mask of shape ", mask.shape(),
                                        " has more axes than the attention weights ", target, " (query ", q.shape(),
                                        ", key ", k.shape(), ", value ", v.shape(), ")"));
  std::vector<std::int64_t> strides(static_cast<std::size_t>(r), 0);
  std::int64_t stride = 1;
  for (int d = r - 1; d >= r - rm; --d) {
    const std::int64_t md = mask.dim(d - (r - rm));
    if (md != 1 && md != target[d])
      throw ShapeError(linum::detail::cat("scaled_dot_product_attention: mask of shape ", mask.shape(),
                                          " does not broadcast to the attention weights ", target, " (query ", q.shape(),
                                          ", key ", k.shape(), "); use 1 for axes the mask shares"));
    strides[static_cast<std::size_t>(d)] = md == 1 ? 0 : stride;
    stride *= md;
  }
  MaskView view;
  view.data = mask.data();
  view.batch_strides.assign(strides.begin(), strides.end() - 3);
  view.head_stride = strides[static_cast<std::size_t>(r - 3)];
  view.row_stride = strides[static_cast<std::size_t>(r - 2)];
  view.col_stride = strides[static_cast<std::size_t>(r - 1)];
  return view;
}

// The attention written with ops (create-graph mode differentiates it): the products, the masked
// logits and the softmax in float32, as the fused kernels compute them.
Array composed_attention(const Geometry& g, const Array& q_in, const Array& k_in, const Array& v_in, const Array& mask) {
  const std::int64_t B = g.batch, H = g.heads, L = g.q_len, S = g.kv_len;
  auto heads_first = [&](const Array& a, std::int64_t len, std::int64_t dim) {
    return reshape(transpose(astype(reshape(a, {B, len, H, dim}), DType::f32), {0, 2, 1, 3}), {B * H, len, dim});
  };
  const Array q = heads_first(q_in, L, g.head_dim), k = heads_first(k_in, S, g.head_dim), v = heads_first(v_in, S, g.v_dim);
  Array logits = matmul(q, transpose(k, {0, 2, 1})) * g.scale;
  Array allowed;  // 1 where a query may attend a key (a constant)
  if (mask.defined()) {
    Shape full = g.batch_shape;
    for (std::int64_t d : {H, L, S}) full.push_back(d);
    autodiff::NoGradGuard constant;
    allowed = not_equal(reshape(broadcast_to(mask, full), {B * H, L, S}), Array::scalar(0.0f));
  }
  if (g.causal) {
    std::vector<float> tri(static_cast<std::size_t>(L * S));
    for (std::int64_t i = 0; i < L; ++i)
      for (std::int64_t j = 0; j < S; ++j) tri[static_cast<std::size_t>(i * S + j)] = j <= i ? 1.0f : 0.0f;
    const Array causal = Array::from(Shape{L, S}, tri);
    allowed = allowed.defined() ? allowed * causal : causal;
  }
  if (allowed.defined()) logits = where(allowed, logits, Array::scalar(kLowest));
  Array o = matmul(softmax(logits, {-1}), v);
  Shape out = g.batch_shape;
  for (std::int64_t d : {L, H, g.v_dim}) out.push_back(d);
  return astype(reshape(transpose(reshape(o, {B, H, L, g.v_dim}), {0, 2, 1, 3}), out.vec()), q_in.dtype());
}

}  // namespace

Array scaled_dot_product_attention(const Array& q_in, const Array& k_in, const Array& v_in,
                                   const ScaledDotProductAttentionOptions& o) {
  for (const Array* a : {&q_in, &k_in, &v_in}) ops::detail::require_defined(*a, "scaled_dot_product_attention");
  if (q_in.batched() || k_in.batched() || v_in.batched() || o.mask.batched()) [[unlikely]] {
    // vmap: the levels become leading batch axes of q, k, v (the mask broadcasts along those it lacks).
    const std::vector<BatchLevel> levels =
        ops::batching::levels_of({&q_in, &k_in, &v_in, &o.mask}, "scaled_dot_product_attention");
    ScaledDotProductAttentionOptions po = o;
    if (o.mask.defined()) po.mask = ops::batching::aligned(o.mask, levels, std::max(o.mask.rank(), q_in.rank()));
    return ops::batching::wrap(scaled_dot_product_attention(ops::batching::materialized(q_in, levels),
                                                            ops::batching::materialized(k_in, levels),
                                                            ops::batching::materialized(v_in, levels), po),
                               levels);
  }
  // One computation dtype (JAX's promotion); astype is differentiable, so gradients reach each input.
  const DType dt = promote_types(promote_types(q_in.dtype(), k_in.dtype()), v_in.dtype());
  const Array q = q_in.dtype() == dt ? q_in : astype(q_in, dt);
  const Array k = k_in.dtype() == dt ? k_in : astype(k_in, dt);
  const Array v = v_in.dtype() == dt ? v_in : astype(v_in, dt);
  const Geometry g = geometry_of(q, k, v, o);
  Array mask;
  if (o.mask.defined()) mask = o.mask.dtype() == DType::f32 ? o.mask.detached() : astype(o.mask.detached(), DType::f32);
  std::optional<MaskView> view;
  if (mask.defined()) view = mask_view(mask, g, q, k, v);

  Shape out_shape = q.shape();
  out_shape[out_shape.rank() - 1] = g.v_dim;
  // One primitive (the mask is an input that gets no gradient); the rule reads the inputs, the
  // output and the per-row softmax statistics (an internal residual, kept with the output when a
  // remat policy saves it: dots_saveable does, the attention being the products it contains).
  return autodiff::primitive(ops::kind::attention, {&q, &k, &v, &mask},
                             [&](autodiff::Residuals& r) {
                               Array out = Array::empty(out_shape, dt);
                               Array stats = Array::empty(Shape{g.batch, g.heads, g.q_len, 2});
                               if (use_bf16_path(q))
                                 bf16_path::forward(g, q, k, v, view ? &*view : nullptr, out, stats);
                               else
                                 attention_forward(g, q, k, v, view ? &*view : nullptr, out, stats);
                               r.keep(q, k, v, out, stats, mask);
                               return out;
                             },
                     autodiff::higher_order([g](Cotangents& c, autodiff::Saved s) {
                       if (autodiff::creating_graph())
                         return autodiff::composite_rule(c, {s[0], s[1], s[2], s[5].detached()}, [g](const std::vector<Array>& in) {
                           return std::vector<Array>{composed_attention(g, in[0], in[1], in[2], in[3])};
                         });
                       std::optional<MaskView> view;
                       if (s[5].defined()) view = mask_view(s[5], g, s[0], s[1], s[2]);
                       Array dq = Array::empty(s[0].shape(), s[0].dtype());
                       Array dk = Array::empty(s[1].shape(), s[1].dtype());
                       Array dv = Array::empty(s[2].shape(), s[2].dtype());
                       const Array d_out = c.out().dtype() == s[3].dtype() ? c.out() : astype(c.out(), s[3].dtype());
                       const MaskView* m = view ? &*view : nullptr;
                       if (use_bf16_path(s[0]))
                         bf16_path::backward(g, s[0], s[1], s[2], s[3], s[4], m, d_out, dq, dk, dv);
                       else
                         attention_backward(g, s[0], s[1], s[2], s[3], s[4], m, d_out, dq, dk, dv);
                       if (c.needs(0)) c.set(0, std::move(dq));
                       if (c.needs(1)) c.set(1, std::move(dk));
                       if (c.needs(2)) c.set(2, std::move(dv));
                     }));
}

}  // namespace linum
