#include <linum/core/kernels/lstm.hpp>

#include <linum/core/array.hpp>
#include <linum/core/error.hpp>
#include <linum/core/fp_mode.hpp>
#include <linum/core/kernels/gemm.hpp>
#include <linum/core/kernels/recurrent_passes_internal.hpp>
#include <linum/core/threading.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace linum::kernels::lstm {

namespace {

// The shared helpers (recurrent_passes_internal.hpp).
using namespace recurrent;  // NOLINT(google-build-using-namespace)
using Blocks = recurrent::UnitBlocks;

}  // namespace

std::int64_t cell_scratch_floats(std::int64_t units) { return 11 * padded(units); }

namespace {

// The cell on n units: the gates' pre-activations replaced by the activations, c and h written
// (h null: not).
void forward_math(float* gates, std::int64_t stride, const float* c_prev, float* c, float* h, std::int64_t n) {
  Aligned i(gates, n), f(gates + stride, n), g(gates + 2 * stride, n), o(gates + 3 * stride, n), cn(c, n);
  const ConstAligned cr(c_prev, n);
  i = i.logistic();
  f = f.logistic();
  g = g.tanh();
  o = o.logistic();
  cn = f * cr + i * g;
  if (h != nullptr) {
    Aligned hn(h, n);
    hn = o * cn.tanh();
  }
}

// Its backward step on n units: the gates' cotangents into d_gates (run k at d_gates + k * stride),
// which may be `acts` itself (each run is written after its last read), dc replaced by c_prev's
// cotangent; t holds 3 runs of temporaries.
void backward_math(const float* acts, float* d_gates, std::int64_t stride, const float* c_prev, const float* c,
                   const float* dh_in, float* dc, float* t, std::int64_t n) {
  const ConstAligned i(acts, n), f(acts + stride, n), g(acts + 2 * stride, n), o(acts + 3 * stride, n);
  const ConstAligned cp(c_prev, n), cm(c, n), dh(dh_in, n);
  Aligned dcm(dc, n), tc(t, n), dct(t + n, n), di(t + 2 * n, n);
  Aligned d_i(d_gates, n), d_f(d_gates + stride, n), d_g(d_gates + 2 * stride, n), d_o(d_gates + 3 * stride, n);
  tc = cm.tanh();
  dct = dcm + dh * o * (1.0f - tc.square());
  di = dct * g * i * (1.0f - i);
  d_g = dct * i * (1.0f - g.square());
  d_i = di;
  dcm = dct * f;
  d_f = dct * cp * f * (1.0f - f);
  d_o = dh * tc * o * (1.0f - o);
}

}  // namespace

// One step of the cell on one row of one unit block: `gates` holds the block's pre-activations
// [i | f | g | o] (w each), replaced by the activations; c = f * c_prev + i * g, h = o * tanh(c)
// (h null: not written).
void cell_row(float* gates, std::int64_t w, const float* c_prev, float* c, float* h, float* scratch) {
  if (in_place(w, {gates, c_prev, c, h})) return forward_math(gates, w, c_prev, c, h, w);
  const std::int64_t p = padded(w);
  for (int k = 0; k < 4; ++k) load(gates + k * w, w, p, scratch + k * p);
  load(c_prev, w, p, scratch + 4 * p);
  forward_math(scratch, p, scratch + 4 * p, scratch + 5 * p, h != nullptr ? scratch + 6 * p : nullptr, p);
  for (int k = 0; k < 4; ++k) store(scratch + k * p, w, gates + k * w);
  store(scratch + 5 * p, w, c);
  if (h != nullptr) store(scratch + 6 * p, w, h);
}

// The backward step of one row of one unit block: from the activations, c_prev and c, the
// cotangents of h (dh, already including the step's output cotangent) and of c (dc, replaced by
// the cotangent of c_prev), the gates' cotangents.
void cell_row_backward(const float* acts, std::int64_t w, const float* c_prev, const float* c, const float* dh_in, float* dc,
                       float* d_gates, float* scratch) {
  const std::int64_t p = padded(w);
  if (in_place(w, {acts, c_prev, c, dh_in, dc, d_gates, scratch}))
    return backward_math(acts, d_gates, w, c_prev, c, dh_in, dc, scratch, w);
  for (int k = 0; k < 4; ++k) load(acts + k * w, w, p, scratch + k * p);
  load(c_prev, w, p, scratch + 4 * p);
  load(c, w, p, scratch + 5 * p);
  load(dh_in, w, p, scratch + 6 * p);
  load(dc, w, p, scratch + 7 * p);
  backward_math(scratch, scratch, p, scratch + 4 * p, scratch + 5 * p, scratch + 6 * p, scratch + 7 * p, scratch + 8 * p, p);
  for (int k = 0; k < 4; ++k) store(scratch + k * p, w, d_gates + k * w);
  store(scratch + 7 * p, w, dc);
}

namespace {

// Per-thread scratch for the cell rows.
struct Scratch : recurrent::PerThread {
  Scratch(int threads, std::int64_t unit) : PerThread(threads, cell_scratch_floats(unit)) {}
};

struct Pass {
  const Forward& f;
  Blocks bl;
  std::int64_t T, N, I, H, H4;
  RowPieces pieces;
  // The per-step products. One piece: one set, per unit block, over every row: gates[:, block] +=
  // h . wh[:, block]. Several: one product over a piece's rows and every block's columns,
  // gates[rows, :] += h[rows] . wh, an object per thread (one object runs on one thread at a time),
  // all on one packed copy of wh.
  std::vector<Products> recurrent;
  Pass(const Forward& fw, bool steps, int team)
      : f(fw), bl(blocks_of(fw.d.hidden)), T(fw.d.steps), N(fw.d.rows), I(fw.d.inputs), H(fw.d.hidden),
        H4(4 * fw.d.hidden), pieces(fw.d.rows) {
    if (!steps || T == 0) return;
    recurrent = step_product_sets(
        pieces, team,
        [&] { return recurrent_products(bl, f.wh, N, [&](std::int64_t) { return H4; }, /*accumulate=*/true, step_operands(f.d)); },
        [&] { return whole_recurrent_product(bl, f.wh, pieces.rows, false, /*accumulate=*/true, step_operands(f.d)); });
  }
  const float* h_prev(std::int64_t t) const { return t == 0 ? f.h0 : f.ys + (t - 1) * N * H; }

  // The input products of steps [t0, t0 + g) for unit block b, into acts (row stride 4H, the chunk's
  // first step at acts); each step adds the biases (step()).
  void project(std::int64_t b, std::int64_t t0, std::int64_t g, float* acts) const {
    const std::int64_t base = bl.base(b), w4 = 4 * bl.width(b);
    layer_gemm(f.d, false, false, g * N, w4, I, f.x + t0 * N * I, I, f.wi + base, H4, 0.0f, acts + base, H4);
  }
  // Step t for unit block b on rows [n0, n0 + pieces.rows) with the product set `products`: the
  // biases, then the recurrent product added to the step's gates (with several pieces, every
  // block's at block 0), then the cell. The biases are added here, to rows the product is about to
  // read, rather than to each chunk's input products once they are made: those (1 MB a thread at
  // batch 32) have left L2 by then, and that pass took 60-90 us a thread on a quiet host and
  // 250-300 on a busy one (linum-bench rnn at T = 64). The sums are the same: (x . wi + b) + h . wh.
  void step(const Products& products, std::int64_t b, std::int64_t t, std::int64_t n0, float* acts_t, const float* c_prev,
            float* c, float* h, float* scratch) const {
    const std::int64_t base = bl.base(b), w = bl.width(b), u0 = bl.first(b), n1 = n0 + pieces.rows;
    auto add_bias = [&](std::int64_t col0, std::int64_t cols) {
      for (std::int64_t n = n0; n < n1; ++n) Run(acts_t + n * H4 + col0, cols) += ConstRun(f.b + col0, cols);
    };
    if (pieces.count == 1) {
      add_bias(base, 4 * w);
      products[static_cast<std::size_t>(b)]->run(h_prev(t) + n0 * H, acts_t + n0 * H4 + base);
    } else if (b == 0) {  // every block's columns at once
      add_bias(0, H4);
      products[0]->run(h_prev(t) + n0 * H, acts_t + n0 * H4);
    }
    for (std::int64_t n = n0; n < n1; ++n)
      cell_row(acts_t + n * H4 + base, w, c_prev + n * H + u0, c + n * H + u0, h == nullptr ? nullptr : h + n * H + u0,
               scratch);
    // The forward pass (h written) with lengths: the final cell state of rows whose last step this is.
    if (h != nullptr && f.lengths != nullptr)
      for (std::int64_t n = n0; n < n1; ++n)
        if (f.lengths[n] == t + 1)
          std::memcpy(f.c_last + n * H + u0, c + n * H + u0, static_cast<std::size_t>(w) * sizeof(float));
  }
  // The forward pass over steps [t_begin, t_end) (chunk-aligned), inside a parallel region.
  // acts_of(t) / c_of(t): where step t's activations and cell state go; c_before: the cell state
  // before t_begin. write_h: whether ys are written (the recomputation reads them instead). Ends
  // with a barrier.
  template <class ActsOf, class COf>
  void run(std::int64_t t_begin, std::int64_t t_end, const float* c_before, ActsOf acts_of, COf c_of, bool write_h,
           Failure& failure, Scratch& scratch) const {
    const int tid = thread_index(), team = threads_in_region();
    for (std::int64_t t0 = t_begin; t0 < t_end; t0 += kChunk) {
      const std::int64_t g = std::min(kChunk, t_end - t0);
      auto run_step = [&](const Products& products, std::int64_t b, std::int64_t t, std::int64_t n0) {
        const float* c_prev = t == t_begin ? c_before : c_of(t - 1);
        failure.run([&] {
          step(products, b, t, n0, acts_of(t), c_prev, c_of(t), write_h ? f.ys + t * N * H : nullptr, scratch.of_this_thread());
        });
      };
#pragma omp for schedule(static) nowait
      for (std::int64_t b = 0; b < bl.count; ++b) failure.run([&] { project(b, t0, g, acts_of(t0)); });
      if (pieces.count > 1) {
        // Every piece needs every block's input products; then each runs its steps on its own.
#pragma omp barrier
        for (std::int64_t q = tid; q < pieces.count; q += team)
          for (std::int64_t t = t0; t < t0 + g; ++t)
            for (std::int64_t b = 0; b < bl.count; ++b) run_step(recurrent[static_cast<std::size_t>(tid)], b, t, pieces.first(q));
        continue;
      }
      // Each step needs every block's h of the step before: one barrier per step (the loop's end).
      for (std::int64_t t = t0; t < t0 + g; ++t) {
#pragma omp for schedule(static)
        for (std::int64_t b = 0; b < bl.count; ++b) run_step(recurrent[0], b, t, 0);
      }
    }
    if (pieces.count > 1) {
#pragma omp barrier
    }
  }
};

}  // namespace

void check(const Forward& f) {
  if (f.d.hidden <= 0 || f.segment < 0 || f.segment % kChunk != 0)
    throw Error("lstm kernels: hidden must be positive and the segment a multiple of 16 steps");
}

void forward(const Forward& f) {
  check(f);
  const int team = linum::team_size();
  const Pass p(f, true, team);
  const std::int64_t T = p.T, N = p.N, H = p.H, H4 = p.H4;
  if (T == 0) {
    std::memcpy(f.c_last, f.c0, static_cast<std::size_t>(N * H) * sizeof(float));
    return;
  }
  const bool keep_all = f.segment == 0;
  // Recompute mode: a chunk's activations and cell states (slot 0: the state before the chunk).
  Array chunk_acts_buf, chunk_cs_buf;
  float* chunk_acts = keep_all ? nullptr : workspace(chunk_acts_buf, kChunk * N * H4);
  float* chunk_cs = keep_all ? nullptr : workspace(chunk_cs_buf, (kChunk + 1) * N * H);
  Scratch scratch(team, p.bl.unit);
  Failure failure;
#pragma omp parallel num_threads(team)
  {
    linum::detail::enter_compute();
    recurrent::single_threaded_calls();
    if (keep_all) {
      p.run(0, T, f.c0, [&](std::int64_t t) { return f.acts + t * N * H4; }, [&](std::int64_t t) { return f.cs + t * N * H; },
            true, failure, scratch);
    } else {
      for (std::int64_t t0 = 0; t0 < T; t0 += kChunk) {
        const std::int64_t g = std::min(kChunk, T - t0);
        const float* c_before = t0 == 0 ? f.c0 : chunk_cs + kChunk * N * H;  // the last chunk's final state
        if (t0 % f.segment == 0) {
#pragma omp single
          std::memcpy(f.cs + (t0 / f.segment) * N * H, c_before, static_cast<std::size_t>(N * H) * sizeof(float));
        }
#pragma omp single
        if (t0 > 0) std::memcpy(chunk_cs, c_before, static_cast<std::size_t>(N * H) * sizeof(float));
        const float* start = t0 == 0 ? f.c0 : chunk_cs;
        p.run(t0, t0 + g, start, [&](std::int64_t t) { return chunk_acts + (t - t0) * N * H4; },
              [&](std::int64_t t) { return chunk_cs + (t - t0 + 1) * N * H; }, true, failure, scratch);
        if (t0 + g < T) {
          // The chunk's final state must be in the last slot for the next chunk (g < kChunk only at the end).
#pragma omp barrier
        }
      }
    }
  }
  failure.rethrow();
  if (f.lengths != nullptr) {  // the steps wrote the other rows
    for (std::int64_t n = 0; n < N; ++n)
      if (f.lengths[n] == 0) std::memcpy(f.c_last + n * H, f.c0 + n * H, static_cast<std::size_t>(H) * sizeof(float));
    return;
  }
  const float* last = keep_all ? f.cs + (T - 1) * N * H : chunk_cs + ((T - 1) % kChunk + 1) * N * H;
  std::memcpy(f.c_last, last, static_cast<std::size_t>(N * H) * sizeof(float));
}

namespace {

// The final carry's cotangents of w units from `offset` (a row's, with lengths) added to h's and c's.
void add_final_carry(const Backward& bw, std::int64_t offset, std::int64_t w, float* dh, float* dc) {
  if (bw.d_h_last != nullptr)
    for (std::int64_t j = 0; j < w; ++j) dh[j] += bw.d_h_last[offset + j];
  if (bw.d_c_last != nullptr)
    for (std::int64_t j = 0; j < w; ++j) dc[j] += bw.d_c_last[offset + j];
}

}  // namespace

void backward(const Backward& bw) {
  const Forward& f = bw.fw;
  check(f);
  const int team = linum::team_size();
  const Pass p(f, /*steps=*/f.segment != 0, team);  // the recomputation runs steps
  const std::int64_t T = p.T, N = p.N, I = p.I, H = p.H, H4 = p.H4;
  const Blocks& bl = p.bl;
  const RowPieces& pieces = p.pieces;
  const bool keep_all = f.segment == 0;
  const std::int64_t S = keep_all ? std::max<std::int64_t>(T, 1) : f.segment;
  // dh = dz . wh^T: one piece, per unit block of h over every row (dh[:, block] = dz . wh[block,
  // :]^T); several, one product over a piece's rows and all of h, its packed weights shared by the
  // threads. Packed (as the recomputation's products, in p) before the workspaces exist: the
  // interleaved copy made for packing is then freed while little else is alive.
  std::vector<Products> transposed;
  if (T > 0)
    transposed = step_product_sets(
        pieces, team, [&] { return transposed_products(bl, f.wh, N, /*accumulate=*/false, step_operands(f.d)); },
        [&] { return whole_recurrent_product(bl, f.wh, pieces.rows, true, /*accumulate=*/false, step_operands(f.d)); });
  Array dh_buf, dc_buf, dz_buf, seg_acts_buf, seg_cs_buf;
  float* dh = workspace(dh_buf, N * H);
  float* dc = workspace(dc_buf, N * H);
  const std::size_t carry_bytes = static_cast<std::size_t>(N * H) * sizeof(float);
  // The final carry's cotangents enter at the last step, or with lengths at each row's own (below).
  const std::int32_t* lengths = f.lengths;
  if (bw.d_h_last && !lengths) std::memcpy(dh, bw.d_h_last, carry_bytes);
  else std::fill(dh, dh + N * H, 0.0f);
  if (bw.d_c_last && !lengths) std::memcpy(dc, bw.d_c_last, carry_bytes);
  else std::fill(dc, dc + N * H, 0.0f);
  for (float* g : {bw.d_wi, bw.d_wh, bw.d_b})
    if (g != nullptr) std::fill(g, g + (g == bw.d_wi ? I * H4 : g == bw.d_wh ? H * H4 : H4), 0.0f);
  // The gates' cotangents of a part (kGradientSteps steps, whose weight gradients are one product):
  // their own buffer when the activations were kept (they are the forward's, which a second backward
  // pass reads again); in recompute mode they replace the recomputed activations of the same steps
  // in place (a step's cell reads its activations before it writes their cotangents, and nothing
  // reads them after).
  float* dz_kept_mode = keep_all ? workspace(dz_buf, kGradientSteps * N * H4) : nullptr;
  // Recompute mode: a segment's activations and cell states (slot 0: the state before it).
  float* seg_acts = keep_all ? nullptr : workspace(seg_acts_buf, std::min(S, T) * N * H4);
  float* seg_cs = keep_all ? nullptr : workspace(seg_cs_buf, (std::min(S, T) + 1) * N * H);
  Scratch scratch(team, bl.unit);
  const InputCotangents input_cotangents(f.d, f.wi, H4, team, bw.d_x != nullptr);
  Array dh_in_buf = Array::empty(Shape{std::max(1, team) * padded(bl.unit)});
  Failure failure;
#pragma omp parallel num_threads(team)
  {
    linum::detail::enter_compute();
    recurrent::single_threaded_calls();
    const std::int64_t segments = T == 0 ? 0 : (T + S - 1) / S;
    for (std::int64_t k = segments - 1; k >= 0; --k) {
      const std::int64_t s0 = k * S, s1 = std::min(T, s0 + S);
      auto acts_of = [&](std::int64_t t) { return keep_all ? f.acts + t * N * H4 : seg_acts + (t - s0) * N * H4; };
      auto c_of = [&](std::int64_t t) { return keep_all ? f.cs + t * N * H : seg_cs + (t - s0 + 1) * N * H; };
      auto c_prev_of = [&](std::int64_t t) -> const float* {
        if (t == 0) return f.c0;
        return keep_all ? f.cs + (t - 1) * N * H : seg_cs + (t - s0) * N * H;
      };
      if (!keep_all) {
#pragma omp single
        std::memcpy(seg_cs, f.cs + k * N * H, static_cast<std::size_t>(N * H) * sizeof(float));
        p.run(s0, s1, seg_cs, acts_of, c_of, false, failure, scratch);
#pragma omp barrier
      }
      const std::int64_t last_part = s0 + (s1 - s0 - 1) / kGradientSteps * kGradientSteps;
      for (std::int64_t t0 = last_part; t0 >= s0; t0 -= kGradientSteps) {
        const std::int64_t g = std::min(kGradientSteps, s1 - t0);
        float* dz = keep_all ? dz_kept_mode : acts_of(t0);
        // A row's operands of step t's cell backward in unit block b (into L1): they come from memory
        // as short runs (one per array and row) that the hardware prefetchers do not follow in time,
        // so each row fetches those of the row kRowsAhead after it (in its block, then the next
        // block's first rows). In the LSTM step at T = 64 (linum-bench rnn, best of 20 steps,
        // alternating) the cells took 340-390 us a thread instead of 500-560.
        auto fetch_row = [&](std::int64_t t, std::int64_t b, std::int64_t n) {
          const std::int64_t u0 = bl.first(b), w = bl.width(b);
          fetch_lines(acts_of(t) + n * H4 + bl.base(b), 4 * w);
          fetch_lines(c_prev_of(t) + n * H + u0, w);
          fetch_lines(c_of(t) + n * H + u0, w);
          if (bw.d_ys != nullptr) fetch_lines(bw.d_ys + t * N * H + n * H + u0, w);
        };
        // Step t's cell backward for unit block b on rows [n0, n0 + pieces.rows).
        auto cells = [&](std::int64_t t, std::int64_t b, std::int64_t n0) {
          const std::int64_t u0 = bl.first(b), w = bl.width(b), base = bl.base(b);
          float* dz_t = dz + (t - t0) * N * H4;
          float* dh_in = dh_in_buf.mutable_data() + thread_index() * padded(bl.unit);
          const std::int64_t n1 = n0 + pieces.rows;
          for (std::int64_t n = n0; n < n1; ++n) {
            if (n + kRowsAhead < n1) fetch_row(t, b, n + kRowsAhead);
            else if (b + 1 < bl.count && n + kRowsAhead - pieces.rows < n1)
              fetch_row(t, b + 1, n + kRowsAhead - pieces.rows);
            // The cotangent reaching h: from the next step, plus the step's output's.
            for (std::int64_t j = 0; j < w; ++j)
              dh_in[j] = dh[n * H + u0 + j] + (bw.d_ys != nullptr ? bw.d_ys[t * N * H + n * H + u0 + j] : 0.0f);
            if (lengths != nullptr && lengths[n] == t + 1) add_final_carry(bw, n * H + u0, w, dh_in, dc + n * H + u0);
            cell_row_backward(acts_of(t) + n * H4 + base, w, c_prev_of(t) + n * H + u0, c_of(t) + n * H + u0, dh_in,
                              dc + n * H + u0, dz_t + n * H4 + base, scratch.of_this_thread());
          }
        };
        // dh[rows, block b] = dz_t[rows] . wh[block b, :]^T.
        auto dh_product = [&](const Products& products, std::int64_t t, std::int64_t b, std::int64_t n0) {
          failure.run([&] {
            products[static_cast<std::size_t>(b)]->run(dz + (t - t0) * N * H4 + n0 * H4, dh + n0 * H + bl.first(b));
          });
        };
        if (pieces.count > 1) {
          // Each piece's steps on one thread; the part's weight gradients below read every row.
          const int tid = thread_index(), threads = threads_in_region();
          for (std::int64_t q = tid; q < pieces.count; q += threads)
            for (std::int64_t t = t0 + g - 1; t >= t0; --t) {
              for (std::int64_t b = 0; b < bl.count; ++b) cells(t, b, pieces.first(q));
              dh_product(transposed[static_cast<std::size_t>(tid)], t, 0, pieces.first(q));  // every block of h at once
            }
#pragma omp barrier
        } else {
          for (std::int64_t t = t0 + g - 1; t >= t0; --t) {
#pragma omp for schedule(static)
            for (std::int64_t b = 0; b < bl.count; ++b) cells(t, b, 0);
            // dh = dz_t . wh^T, by blocks of h's units (each reads every block's gates: after the barrier).
            // No barrier after it: the same static schedule gives block b to the same thread in both
            // loops, so the thread that writes dh's block b is the one that reads it in the next
            // step's cell loop, and the other thread, still reading dz_t here, never sees that loop
            // write dz_t (it writes the step before's rows; the part ends with the d_x loop's
            // barrier before its buffer is reused).
#pragma omp for schedule(static) nowait
            for (std::int64_t b = 0; b < bl.count; ++b) dh_product(transposed[0], t, b, 0);
          }
        }
        // The part's weight gradients (one product per weight and block) and its inputs' gradients.
#pragma omp for schedule(static) nowait
        for (std::int64_t b = 0; b < bl.count; ++b)
          failure.run([&] {
            const std::int64_t base = bl.base(b), w4 = 4 * bl.width(b);
            if (bw.d_wh) add_recurrent_gradient(f.d, t0, g, f.h0, f.ys, dz + base, H4, w4, bw.d_wh + base, H4);
            if (bw.d_wi)
              layer_gemm(f.d, true, false, I, w4, g * N, f.x + t0 * N * I, I, dz + base, H4, 1.0f, bw.d_wi + base, H4);
            if (bw.d_b)
              for (std::int64_t r = 0; r < g * N; ++r) Run(bw.d_b + base, w4) += ConstRun(dz + r * H4 + base, w4);
          });
#pragma omp for schedule(static)
        for (std::int64_t t = t0; t < t0 + g; ++t)
          if (bw.d_x)
            failure.run([&] { input_cotangents.run(dz + (t - t0) * N * H4, bw.d_x + t * N * I); });
      }
    }
  }
  failure.rethrow();
  if (lengths != nullptr)  // rows of length 0: their final carry is the initial one
    for (std::int64_t n = 0; n < N; ++n)
      if (lengths[n] == 0) add_final_carry(bw, n * H, H, dh + n * H, dc + n * H);
  if (bw.d_c0) std::memcpy(bw.d_c0, dc, carry_bytes);
  if (bw.d_h0) std::memcpy(bw.d_h0, dh, carry_bytes);
}

}  // namespace linum::kernels::lstm
