// Internal to batch_norm.cpp: its row loops over a block of [rows, C] float32 values, on AVX-512,
// for the few channels of convolutional nets (C <= 64: at most four 16-lane vectors per row, the
// last one masked). The per-channel operands (mean, factor, bias) are loaded into registers once
// per block, and the per-channel sums stay in registers across the rows, where the portable loops
// (a loop over C inside a loop over rows, C known only at run time) reload and store them every
// row: with C = 24 that left the passes at half the memory's speed.
//
// Each function returns false when it does not apply (C > 64, or a build without AVX-512) and the
// caller runs its portable loop. What they compute is fixed by C alone (per channel, the rows in
// order; multiply-adds fused as written), so the results do not depend on the thread count; where
// a portable loop and one of these compute the same value (the forward's pre-activation and the
// backward's recomputed relu mask), both go through the same function.
#pragma once

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>

#include <linum/core/kernels/avx512_bf16_bits_internal.hpp>
#include <linum/core/kernels/avx512_lanes_internal.hpp>
#endif

namespace linum::kernels::detail {

constexpr std::int64_t kRegisterChannels = 64;

#if defined(__AVX512F__)

// A value as bfloat16 holds it, widened back (bfloat16::round_bits' rounding).
inline __m512 stored_as_bf16(__m512 v) { return widen_bf16(round_to_bf16(v)); }

// NV vectors covering channels [0, C), the lanes past C masked off.
template <int NV>
struct ChannelLanes {
  __mmask16 mask[NV];
  explicit ChannelLanes(std::int64_t C) {
    for (int v = 0; v < NV; ++v) mask[v] = lanes(C - 16 * v);
  }
  // A [C] operand's values (zeros where p is null).
  void load(const float* p, __m512 (&out)[NV]) const {
    for (int v = 0; v < NV; ++v) out[v] = p != nullptr ? _mm512_maskz_loadu_ps(mask[v], p + 16 * v) : _mm512_setzero_ps();
  }
  __m512 row(const float* r, int v) const { return _mm512_maskz_loadu_ps(mask[v], r + 16 * v); }
  void store(float* r, int v, __m512 x) const { _mm512_mask_storeu_ps(r + 16 * v, mask[v], x); }
};

// Calls body.template operator()<NV>() with NV = the vectors C takes (1 to 4); false when C > 64.
template <class Body>
bool with_channel_vectors(std::int64_t C, Body&& body) {
  switch ((C + 15) / 16) {
    case 1: body.template operator()<1>(); return true;
    case 2: body.template operator()<2>(); return true;
    case 3: body.template operator()<3>(); return true;
    case 4: body.template operator()<4>(); return true;
    default: return false;
  }
}

// out[c] += sum over rows of x[r, c], out[C + c] += sum of x[r, c]^2.
inline bool sums_and_squares(const float* x, std::int64_t rows, std::int64_t C, float* out) {
  return with_channel_vectors(C, [&]<int NV>() {
    const ChannelLanes<NV> L(C);
    __m512 s[NV], q[NV];
    for (int v = 0; v < NV; ++v) s[v] = q[v] = _mm512_setzero_ps();
    for (std::int64_t r = 0; r < rows; ++r)
      for (int v = 0; v < NV; ++v) {
        const __m512 xv = L.row(x + r * C, v);
        s[v] = _mm512_add_ps(s[v], xv);
        q[v] = _mm512_fmadd_ps(xv, xv, q[v]);
      }
    for (int v = 0; v < NV; ++v) {
      L.store(out, v, _mm512_add_ps(L.row(out, v), s[v]));
      L.store(out + C, v, _mm512_add_ps(L.row(out + C, v), q[v]));
    }
  });
}

// out[c] += sum over rows of g[r, c], out[C + c] += sum of g[r, c] * ((x[r, c] - mu[c]) * rstd[c]).
inline bool sums_of_cotangent(const float* x, const float* g, const float* mu, const float* rstd, std::int64_t rows,
                              std::int64_t C, float* out) {
  return with_channel_vectors(C, [&]<int NV>() {
    const ChannelLanes<NV> L(C);
    __m512 m[NV], k[NV], s[NV], t[NV];
    L.load(mu, m);
    L.load(rstd, k);
    for (int v = 0; v < NV; ++v) s[v] = t[v] = _mm512_setzero_ps();
    for (std::int64_t r = 0; r < rows; ++r)
      for (int v = 0; v < NV; ++v) {
        const __m512 gv = L.row(g + r * C, v);
        const __m512 xhat = _mm512_mul_ps(_mm512_sub_ps(L.row(x + r * C, v), m[v]), k[v]);
        s[v] = _mm512_add_ps(s[v], gv);
        t[v] = _mm512_fmadd_ps(gv, xhat, t[v]);
      }
    for (int v = 0; v < NV; ++v) {
      L.store(out, v, _mm512_add_ps(L.row(out, v), s[v]));
      L.store(out + C, v, _mm512_add_ps(L.row(out + C, v), t[v]));
    }
  });
}

// The normalization's rows: (x - mu) * a + bias (bias may be absent), rounded as y's dtype holds it
// (Bf16); with a residual row, residual + that, rounded again; with Relu, max(that, 0) as std::max
// (-0 and NaN stay).
template <bool Bf16, bool Bias, bool Residual, bool Relu>
bool pre_activation(const float* x, const float* residual, const float* mu, const float* a, const float* bias, float* out,
                    std::int64_t rows, std::int64_t C) {
  return with_channel_vectors(C, [&]<int NV>() {
    const ChannelLanes<NV> L(C);
    __m512 m[NV], f[NV], b[NV];
    L.load(mu, m);
    L.load(a, f);
    L.load(Bias ? bias : nullptr, b);
    const __m512 zero = _mm512_setzero_ps();
    for (std::int64_t r = 0; r < rows; ++r)
      for (int v = 0; v < NV; ++v) {
        const __m512 d = _mm512_sub_ps(L.row(x + r * C, v), m[v]);
        __m512 y = Bias ? _mm512_fmadd_ps(d, f[v], b[v]) : _mm512_mul_ps(d, f[v]);
        if constexpr (Bf16) y = stored_as_bf16(y);
        if constexpr (Residual) {
          // (y as computed, opaque to the compiler: GCC would contract (x - mu) * a + residual into one
          // multiply-add, which the composed ops, batch_norm then add, do not make)
          asm("" : "+v"(y));
          y = _mm512_add_ps(L.row(residual + r * C, v), y);
          if constexpr (Bf16) y = stored_as_bf16(y);
        }
        if constexpr (Relu) y = _mm512_max_ps(zero, y);  // (0 > y ? 0 : y: std::max(y, 0.0f))
        L.store(out + r * C, v, y);
      }
  });
}

// The input's gradient rows: a * (g - m1 - xhat * m2) + gm + gv * (x - mu), xhat = (x - mu) * rstd;
// without a cotangent g, gm + gv * (x - mu).
inline bool input_gradient(const float* x, const float* g, const float* mu, const float* rstd, const float* a,
                           const float* m1, const float* m2, const float* gm, const float* gv, float* out,
                           std::int64_t rows, std::int64_t C) {
  return with_channel_vectors(C, [&]<int NV>() {
    const ChannelLanes<NV> L(C);
    __m512 mu_v[NV], k[NV], f[NV], m1_v[NV], m2_v[NV], gm_v[NV], gv_v[NV];
    L.load(mu, mu_v);
    L.load(rstd, k);
    L.load(a, f);
    L.load(m1, m1_v);
    L.load(m2, m2_v);
    L.load(gm, gm_v);
    L.load(gv, gv_v);
    for (std::int64_t r = 0; r < rows; ++r)
      for (int v = 0; v < NV; ++v) {
        const __m512 xc = _mm512_sub_ps(L.row(x + r * C, v), mu_v[v]);
        __m512 d = gm_v[v];
        if (g != nullptr) {
          const __m512 centred = _mm512_fnmadd_ps(_mm512_mul_ps(xc, k[v]), m2_v[v], _mm512_sub_ps(L.row(g + r * C, v), m1_v[v]));
          d = _mm512_fmadd_ps(f[v], centred, d);
        }
        L.store(out + r * C, v, _mm512_fmadd_ps(gv_v[v], xc, d));
      }
  });
}

#else  // no AVX-512: the callers' portable loops

inline bool sums_and_squares(const float*, std::int64_t, std::int64_t, float*) { return false; }
inline bool sums_of_cotangent(const float*, const float*, const float*, const float*, std::int64_t, std::int64_t, float*) {
  return false;
}
template <bool Bf16, bool Bias, bool Residual, bool Relu>
bool pre_activation(const float*, const float*, const float*, const float*, const float*, float*, std::int64_t, std::int64_t) {
  return false;
}
inline bool input_gradient(const float*, const float*, const float*, const float*, const float*, const float*, const float*,
                           const float*, const float*, float*, std::int64_t, std::int64_t) {
  return false;
}

#endif

}  // namespace linum::kernels::detail
