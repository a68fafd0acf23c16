#include <linum/core/kernels/gru.hpp>

#include <linum/core/array.hpp>
#include <linum/core/error.hpp>
#include <linum/core/fp_mode.hpp>
#include <linum/core/kernels/gemm.hpp>
#include <linum/core/kernels/recurrent_passes_internal.hpp>
#include <linum/core/threading.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace linum::kernels::gru {

namespace {

// The shared helpers (recurrent_passes_internal.hpp).
using namespace recurrent;  // NOLINT(google-build-using-namespace)

// The cell on n units: gates [r | z | n] (run k at gates + k * stride) replaced by the activations;
// hg (the same layout) gets the recurrent biases added; hg_n to hgn and the new state to h (either
// null: not written).
void forward_math(float* gates, float* hg, const float* bh, std::int64_t stride, const float* h_prev, float* hgn, float* h,
                  std::int64_t n) {
  for (int k = 0; k < 3; ++k) Aligned(hg + k * stride, n) += ConstAligned(bh + k * stride, n);
  Aligned r(gates, n), z(gates + stride, n), ng(gates + 2 * stride, n);
  const ConstAligned hr(hg, n), hz(hg + stride, n), hn(hg + 2 * stride, n), hp(h_prev, n);
  r = (r + hr).logistic();
  z = (z + hz).logistic();
  ng = (ng + r * hn).tanh();
  if (hgn != nullptr) Aligned(hgn, n) = hn;
  if (h != nullptr) Aligned(h, n) = (1.0f - z) * ng + z * hp;
}

// Its backward step on n units: d_xg may be `acts` and d_hgn may be `hgn` (each run is written after
// its last read); t holds 2 runs of temporaries.
void backward_math(const float* acts, const float* hgn, std::int64_t stride, const float* h_prev, const float* dh_in,
                   float* d_xg, float* d_hgn, float* dh_prev, float* t, std::int64_t n) {
  const ConstAligned r(acts, n), z(acts + stride, n), ng(acts + 2 * stride, n), hn(hgn, n), hp(h_prev, n), dh(dh_in, n);
  Aligned dn(t, n), dhn(t + n, n);
  dn = dh * (1.0f - z) * (1.0f - ng.square());
  dhn = dn * r;
  Aligned(dh_prev, n) = dh * z;
  Aligned(d_xg + stride, n) = dh * (hp - ng) * z * (1.0f - z);
  Aligned(d_xg, n) = dn * hn * r * (1.0f - r);
  Aligned(d_hgn, n) = dhn;
  Aligned(d_xg + 2 * stride, n) = dn;
}

}  // namespace

std::int64_t cell_scratch_floats(std::int64_t w) { return 11 * padded(w); }

// One row of the cell over a block of w units. `gates` holds xg [r | z | n] (w each), replaced by
// the activations r, z, n; hg the recurrent product's row [r | z | n] (the biases are added to it)
// and bh the block's recurrent biases. Writes hg_n (with its bias) to hgn and the new state to h
// (either null: not written).
void cell_row(float* gates, float* hg, const float* bh, std::int64_t w, const float* h_prev, float* hgn, float* h,
              float* scratch) {
  if (in_place(w, {gates, hg, bh, h_prev, hgn, h})) return forward_math(gates, hg, bh, w, h_prev, hgn, h, w);
  const std::int64_t p = padded(w);
  for (int k = 0; k < 3; ++k) {
    load(gates + k * w, w, p, scratch + k * p);
    load(hg + k * w, w, p, scratch + (3 + k) * p);
    load(bh + k * w, w, p, scratch + (6 + k) * p);
  }
  load(h_prev, w, p, scratch + 9 * p);
  forward_math(scratch, scratch + 3 * p, scratch + 6 * p, p, scratch + 9 * p, nullptr, h != nullptr ? scratch + 10 * p : nullptr,
               p);
  for (int k = 0; k < 3; ++k) store(scratch + k * p, w, gates + k * w);
  if (hgn != nullptr) store(scratch + 5 * p, w, hgn);
  if (h != nullptr) store(scratch + 10 * p, w, h);
}

// The backward step of one row of one block: from the activations r, z, n, hg_n, the state before
// the step and the cotangent reaching the new state (dh), the gates' cotangents for the input
// product [r | z | n] into d_xg, the n gate's for the recurrent product into d_hgn (those of r and z
// are d_xg's), and the part of h_prev's cotangent that does not go through the products into
// dh_prev. d_xg may be `acts` and d_hgn `hgn` (in place).
void cell_row_backward(const float* acts, const float* hgn, std::int64_t w, const float* h_prev, const float* dh_in,
                       float* d_xg, float* d_hgn, float* dh_prev, float* scratch) {
  if (in_place(w, {acts, hgn, h_prev, dh_in, d_xg, d_hgn, dh_prev, scratch}))
    return backward_math(acts, hgn, w, h_prev, dh_in, d_xg, d_hgn, dh_prev, scratch, w);
  const std::int64_t p = padded(w);
  for (int k = 0; k < 3; ++k) load(acts + k * w, w, p, scratch + k * p);
  load(hgn, w, p, scratch + 3 * p);
  load(h_prev, w, p, scratch + 4 * p);
  load(dh_in, w, p, scratch + 5 * p);
  backward_math(scratch, scratch + 3 * p, p, scratch + 4 * p, scratch + 5 * p, scratch, scratch + 3 * p, scratch + 6 * p,
                scratch + 7 * p, p);
  for (int k = 0; k < 3; ++k) store(scratch + k * p, w, d_xg + k * w);
  store(scratch + 3 * p, w, d_hgn);
  store(scratch + 6 * p, w, dh_prev);
}

namespace {

struct Pass {
  const Forward& f;
  UnitBlocks bl;
  std::int64_t T, N, I, H, H3;
  Products recurrent;  // per unit block: hg[:, block] = h . wh[:, block], into a per-thread buffer
  // steps: whether the pass runs steps (and packs the recurrent weights for them).
  Pass(const Forward& fw, bool steps)
      : f(fw), bl(blocks_of(fw.d.hidden)), T(fw.d.steps), N(fw.d.rows), I(fw.d.inputs), H(fw.d.hidden),
        H3(kGates * fw.d.hidden) {
    // Into a per-thread buffer of the block's rows (row stride 3w): ldc differs per block.
    if (steps && T > 0)
      recurrent = recurrent_products(bl, f.wh, N, [&](std::int64_t b) { return kGates * bl.width(b); }, /*accumulate=*/false,
                                     step_operands(f.d));
  }
  const float* h_prev(std::int64_t t) const { return t == 0 ? f.h0 : f.ys + (t - 1) * N * H; }
  // Per thread: the recurrent product's rows of a block, then the cell row's scratch.
  std::int64_t thread_floats() const { return padded(N * kGates * bl.unit) + cell_scratch_floats(bl.unit); }

  // The input products of steps [t0, t0 + g) for unit block b into acts (row stride 3H, the chunk's
  // first step at acts), biases added.
  void project(std::int64_t b, std::int64_t t0, std::int64_t g, float* acts) const {
    const std::int64_t base = bl.base(b), w3 = kGates * bl.width(b);
    layer_gemm(f.d, false, false, g * N, w3, I, f.x + t0 * N * I, I, f.wi + base, H3, 0.0f, acts + base, H3);
    for (std::int64_t r = 0; r < g * N; ++r) Run(acts + r * H3 + base, w3) += ConstRun(f.bi + base, w3);
  }
  // Step t for unit block b: the recurrent product, then the cell on every row. h: ys of step t, or
  // null (the recomputation, which reads ys instead); hgn_t: null when nothing reads it.
  void step(std::int64_t b, std::int64_t t, float* acts_t, float* hgn_t, float* h, float* thread_buffer) const {
    const std::int64_t base = bl.base(b), w = bl.width(b), u0 = bl.first(b);
    float* hg = thread_buffer;
    float* scratch = thread_buffer + padded(N * kGates * bl.unit);
    recurrent[static_cast<std::size_t>(b)]->run(h_prev(t), hg);
    const float* hp = h_prev(t);
    for (std::int64_t n = 0; n < N; ++n)
      cell_row(acts_t + n * H3 + base, hg + n * kGates * w, f.bh + base, w, hp + n * H + u0,
               hgn_t == nullptr ? nullptr : hgn_t + n * H + u0, h == nullptr ? nullptr : h + n * H + u0, scratch);
  }
  // The steps [t0, t0 + g) of block b and nothing else: the recomputation (ys are known), inside a
  // worksharing loop over blocks.
  void recompute(std::int64_t b, std::int64_t t0, std::int64_t g, float* acts, float* hgn, float* thread_buffer) const {
    project(b, t0, g, acts);
    for (std::int64_t t = t0; t < t0 + g; ++t) step(b, t, acts + (t - t0) * N * H3, hgn + (t - t0) * N * H, nullptr, thread_buffer);
  }
};

}  // namespace

UnitBlocks blocks_of(std::int64_t hidden) { return UnitBlocks(hidden, kGates); }

void forward(const Forward& f) {
  if (f.d.hidden <= 0) throw Error("gru kernels: hidden must be positive");
  const Pass p(f, true);
  const std::int64_t T = p.T, N = p.N, H = p.H, H3 = p.H3;
  if (T == 0) return;
  const bool keep = f.acts != nullptr;
  Array chunk_acts_buf;
  float* chunk_acts = keep ? nullptr : workspace(chunk_acts_buf, kChunk * N * H3);
  const int team = linum::team_size();
  recurrent::PerThread buffers(team, p.thread_floats());
  Failure failure;
#pragma omp parallel num_threads(team)
  {
    linum::detail::enter_compute();
    recurrent::single_threaded_calls();
    for (std::int64_t t0 = 0; t0 < T; t0 += kChunk) {
      const std::int64_t g = std::min(kChunk, T - t0);
      auto acts_of = [&](std::int64_t t) { return keep ? f.acts + t * N * H3 : chunk_acts + (t - t0) * N * H3; };
      auto hgn_of = [&](std::int64_t t) { return keep ? f.hgn + t * N * H : nullptr; };
      // The same static schedule as the steps' loops: a thread projects the blocks it then steps.
#pragma omp for schedule(static) nowait
      for (std::int64_t b = 0; b < p.bl.count; ++b) failure.run([&] { p.project(b, t0, g, acts_of(t0)); });
      // Each step needs every block's h of the step before: one barrier per step (the loop's end).
      for (std::int64_t t = t0; t < t0 + g; ++t) {
#pragma omp for schedule(static)
        for (std::int64_t b = 0; b < p.bl.count; ++b)
          failure.run([&] { p.step(b, t, acts_of(t), hgn_of(t), f.ys + t * N * H, buffers.of_this_thread()); });
      }
    }
  }
  failure.rethrow();
}

void backward(const Backward& bw) {
  const Forward& f = bw.fw;
  if (f.d.hidden <= 0) throw Error("gru kernels: hidden must be positive");
  const bool keep = f.acts != nullptr;
  const Pass p(f, /*steps=*/!keep);  // the recomputation runs steps
  const std::int64_t T = p.T, N = p.N, I = p.I, H = p.H, H3 = p.H3;
  const UnitBlocks& bl = p.bl;
  // Per unit block of h: dh[:, block] += dhg . wh[block, :]^T. Packed (as the recomputation's
  // products, in p) before the workspaces exist: a block's copy made for packing is then freed while
  // little else is alive.
  Products transposed;
  if (T > 0) transposed = transposed_products(bl, f.wh, N, /*accumulate=*/true, step_operands(f.d));
  Array dh_buf, dxg_buf, dhgn_buf, dhg_buf, chunk_acts_buf, chunk_hgn_buf;
  float* dh = workspace(dh_buf, N * H);
  const std::size_t carry_bytes = static_cast<std::size_t>(N * H) * sizeof(float);
  // The final carry's cotangent enters at the last step, or with lengths at each row's own (below).
  const std::int32_t* lengths = f.lengths;
  if (bw.d_h_last && !lengths) std::memcpy(dh, bw.d_h_last, carry_bytes);
  else std::fill(dh, dh + N * H, 0.0f);
  if (bw.d_wi) std::fill(bw.d_wi, bw.d_wi + I * H3, 0.0f);
  if (bw.d_wh) std::fill(bw.d_wh, bw.d_wh + H * H3, 0.0f);
  if (bw.d_bi) std::fill(bw.d_bi, bw.d_bi + H3, 0.0f);
  if (bw.d_bh) std::fill(bw.d_bh, bw.d_bh + H3, 0.0f);
  if (T > 0) {
    // The gates' cotangents of a part of a chunk (kGradientSteps steps): dxg [r | z | n] for the
    // input product, and the n gate's for the recurrent product, dhgn (its r and z gates' are dxg's).
    // Recompute mode writes them over the recomputed activations and hg_n of the same steps (a step's
    // cell reads those before it writes the cotangents, and nothing reads them after); kept
    // activations are the forward's, which a second backward pass reads again, so then they get
    // buffers of their own, a part's steps long (the weights' gradients are summed a part at a time
    // in both modes, so their bits agree).
    float* chunk_acts = keep ? nullptr : workspace(chunk_acts_buf, kChunk * N * H3);
    float* chunk_hgn = keep ? nullptr : workspace(chunk_hgn_buf, kChunk * N * H);
    float* dxg_part = keep ? workspace(dxg_buf, kGradientSteps * N * H3) : nullptr;
    float* dhgn_part = keep ? workspace(dhgn_buf, kGradientSteps * N * H) : nullptr;
    // One step's cotangents for the recurrent product, [r | z | n] per block as wh's rows are. (Two
    // such buffers used by turns would spare the barrier after the dh product, as the LSTM's
    // backward does without one; at 64 steps of 256 units that step's 98 KB was the remat step's
    // margin below JAX's bytes, for no speed-up measurable here.)
    float* dhg_t = workspace(dhg_buf, N * H3);
    const int team = linum::team_size();
    recurrent::PerThread buffers(team, p.thread_floats() + padded(bl.unit));
    const InputCotangents input_cotangents(f.d, f.wi, H3, team, bw.d_x != nullptr);
    Failure failure;
#pragma omp parallel num_threads(team)
    {
      linum::detail::enter_compute();
      recurrent::single_threaded_calls();
      for (std::int64_t t0 = (T - 1) / kChunk * kChunk; t0 >= 0; t0 -= kChunk) {
        const std::int64_t g = std::min(kChunk, T - t0);
        auto acts_of = [&](std::int64_t t) { return keep ? f.acts + t * N * H3 : chunk_acts + (t - t0) * N * H3; };
        auto hgn_of = [&](std::int64_t t) { return keep ? f.hgn + t * N * H : chunk_hgn + (t - t0) * N * H; };
        if (!keep) {
          // The chunk's gates again, from x and ys (no step waits for another: no barrier per step).
#pragma omp for schedule(static)
          for (std::int64_t b = 0; b < bl.count; ++b)
            failure.run([&] { p.recompute(b, t0, g, chunk_acts, chunk_hgn, buffers.of_this_thread()); });
        }
        for (std::int64_t s0 = t0 + (g - 1) / kGradientSteps * kGradientSteps; s0 >= t0; s0 -= kGradientSteps) {
          const std::int64_t gs = std::min(kGradientSteps, t0 + g - s0);
          float* dxg = keep ? dxg_part : chunk_acts + (s0 - t0) * N * H3;  // the part's first step's
          float* dhgn = keep ? dhgn_part : chunk_hgn + (s0 - t0) * N * H;
          for (std::int64_t t = s0 + gs - 1; t >= s0; --t) {
            float* dxg_t = dxg + (t - s0) * N * H3;
            float* dhgn_t = dhgn + (t - s0) * N * H;
#pragma omp for schedule(static)
            for (std::int64_t b = 0; b < bl.count; ++b) {
              const std::int64_t u0 = bl.first(b), w = bl.width(b), base = bl.base(b);
              float* buffer = buffers.of_this_thread();
              float* scratch = buffer + padded(N * kGates * bl.unit);
              float* dh_in = buffer + p.thread_floats();
              const float* hp = p.h_prev(t);
              for (std::int64_t n = 0; n < N; ++n) {
                // The cotangent reaching h: from the next step, plus the step's output's.
                for (std::int64_t j = 0; j < w; ++j)
                  dh_in[j] = dh[n * H + u0 + j] + (bw.d_ys != nullptr ? bw.d_ys[t * N * H + n * H + u0 + j] : 0.0f);
                if (lengths != nullptr && lengths[n] == t + 1 && bw.d_h_last != nullptr)
                  for (std::int64_t j = 0; j < w; ++j) dh_in[j] += bw.d_h_last[n * H + u0 + j];
                float* dxg_row = dxg_t + n * H3 + base;
                float* dhg_row = dhg_t + n * H3 + base;
                cell_row_backward(acts_of(t) + n * H3 + base, hgn_of(t) + n * H + u0, w, hp + n * H + u0, dh_in, dxg_row,
                                  dhgn_t + n * H + u0, dh + n * H + u0, scratch);
                std::memcpy(dhg_row, dxg_row, static_cast<std::size_t>(2 * w) * sizeof(float));
                std::memcpy(dhg_row + 2 * w, dhgn_t + n * H + u0, static_cast<std::size_t>(w) * sizeof(float));
              }
            }
            // dh += dhg_t . wh^T, by blocks of h's units (each reads every block's gates: after the barrier).
#pragma omp for schedule(static)
            for (std::int64_t b = 0; b < bl.count; ++b)
              failure.run([&] { transposed[static_cast<std::size_t>(b)]->run(dhg_t, dh + bl.first(b)); });
          }
          // The part's weight gradients (one product per weight and block, the recurrent kernel's split
          // where noted) and its inputs' gradients.
#pragma omp for schedule(static) nowait
          for (std::int64_t b = 0; b < bl.count; ++b)
            failure.run([&] {
              const std::int64_t base = bl.base(b), w3 = kGates * bl.width(b);
              const std::int64_t u0 = bl.first(b), w = bl.width(b);
              if (bw.d_wh) {  // the r and z columns from dxg, the n columns from dhgn
                add_recurrent_gradient(f.d, s0, gs, f.h0, f.ys, dxg + base, H3, 2 * w, bw.d_wh + base, H3);
                add_recurrent_gradient(f.d, s0, gs, f.h0, f.ys, dhgn + u0, H, w, bw.d_wh + base + 2 * w, H3);
              }
              if (bw.d_wi)
                layer_gemm(f.d, true, false, I, w3, gs * N, f.x + s0 * N * I, I, dxg + base, H3, 1.0f, bw.d_wi + base, H3);
              for (std::int64_t r = 0; r < gs * N; ++r) {
                if (bw.d_bi) Run(bw.d_bi + base, w3) += ConstRun(dxg + r * H3 + base, w3);
                if (bw.d_bh) {
                  Run(bw.d_bh + base, 2 * w) += ConstRun(dxg + r * H3 + base, 2 * w);
                  Run(bw.d_bh + base + 2 * w, w) += ConstRun(dhgn + r * H + u0, w);
                }
              }
            });
#pragma omp for schedule(static)
          for (std::int64_t t = s0; t < s0 + gs; ++t)
            if (bw.d_x)
              failure.run([&] { input_cotangents.run(dxg + (t - s0) * N * H3, bw.d_x + t * N * I); });
        }
      }
    }
    failure.rethrow();
  }
  if (lengths != nullptr && bw.d_h_last != nullptr)  // rows of length 0: their final carry is h0
    for (std::int64_t n = 0; n < N; ++n)
      if (lengths[n] == 0)
        for (std::int64_t j = 0; j < H; ++j) dh[n * H + j] += bw.d_h_last[n * H + j];
  if (bw.d_h0) std::memcpy(bw.d_h0, dh, carry_bytes);
}

}  // namespace linum::kernels::gru
