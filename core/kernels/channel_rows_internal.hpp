// Internal to batch_norm.cpp: its row loops over a block of [rows, C] float32 values, in SIMD
// registers, for the few channels of convolutional nets (C <= 64: at most four 16-lane AVX-512
// vectors or eight 8-lane AVX2 ones per row, the last one masked when C is not a multiple of the
// lanes). The per-channel operands (mean, factor, bias) are loaded into registers once per block, and
// the per-channel sums stay in registers across the rows, where the portable loops (a loop over C
// inside a loop over rows, C known only at run time) reload and store them every row: with C = 24
// that left the passes at half the memory's speed.
//
// Each function returns false when it does not apply (C > 64, or a build with neither AVX-512 nor
// AVX2 and FMA) and the caller runs its portable loop. What they compute is fixed by C and the
// build's instruction set alone (per channel, the rows in order; multiply-adds fused as written),
// so the results do not depend on the thread count; where a portable loop and one of these compute
// the same value (the forward's pre-activation and the backward's recomputed relu mask), both go
// through the same function.
#pragma once

#include <cstdint>
#include <utility>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define LINUM_CHANNEL_ROWS_IN_REGISTERS 1
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#include <linum/core/kernels/avx512_bf16_bits_internal.hpp>
#include <linum/core/kernels/avx512_lanes_internal.hpp>
#endif

namespace linum::kernels::detail {

constexpr std::int64_t kRegisterChannels = 64;

#if defined(__AVX512F__)

// The vector the loops run on: 16 float32 lanes; `Mask` picks a vector's first lanes.
struct ChannelVectors {
  using V = __m512;
  using Mask = __mmask16;
  static constexpr int kLanes = 16;
  static Mask first(std::int64_t count) { return lanes(count); }
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
  static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
  static void store(float* p, Mask m, V x) { _mm512_mask_storeu_ps(p, m, x); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }     // a * b + c, one rounding
  static V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }   // c - a * b, one rounding
  static V max(V a, V b) { return _mm512_max_ps(a, b); }                 // a > b ? a : b
  // A value as bfloat16 holds it, widened back (bfloat16::round_bits' rounding).
  static V stored_as_bf16(V v) { return widen_bf16(round_to_bf16(v)); }
};

#elif defined(LINUM_CHANNEL_ROWS_IN_REGISTERS)

// The vector the loops run on: 8 float32 lanes (AVX2 with FMA, as AMD's Zen 2 and Zen 3 have);
// `Mask` picks a vector's first lanes (all ones in a lane's 32 bits).
struct ChannelVectors {
  using V = __m256;
  using Mask = __m256i;
  static constexpr int kLanes = 8;
  static Mask first(std::int64_t count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count < 0 ? 0 : count > 8 ? 8 : count)),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const float* p, Mask m) { return _mm256_maskload_ps(p, m); }  // masked lanes read as 0
  static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static void store(float* p, Mask m, V x) { _mm256_maskstore_ps(p, m, x); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  // bfloat16::round_bits (nearest even; a NaN stays a NaN, made quiet) and widened back, 8 lanes.
  static V stored_as_bf16(V v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), high);
    const __m256i quiet = _mm256_or_si256(_mm256_and_si256(u, high), _mm256_set1_epi32(0x00400000));
    const __m256i is_nan =
        _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    return _mm256_castsi256_ps(_mm256_blendv_epi8(rounded, quiet, is_nan));
  }
};

#endif

#if defined(LINUM_CHANNEL_ROWS_IN_REGISTERS)

using Simd = ChannelVectors;

// NV vectors covering channels [0, C): all but the last full, the last's lanes past C masked off.
template <int NV>
struct ChannelLanes {
  Simd::Mask last;
  bool last_full;
  explicit ChannelLanes(std::int64_t C)
      : last(Simd::first(C - Simd::kLanes * (NV - 1))), last_full(C == Simd::kLanes * NV) {}
  // A [C] operand's values (zeros where p is null).
  void load(const float* p, Simd::V (&out)[NV]) const {
    for (int v = 0; v < NV; ++v) out[v] = p != nullptr ? row(p, v) : Simd::zero();
  }
  Simd::V row(const float* r, int v) const {
    return v < NV - 1 || last_full ? Simd::load(r + Simd::kLanes * v) : Simd::load(r + Simd::kLanes * v, last);
  }
  void store(float* r, int v, Simd::V x) const {
    if (v < NV - 1 || last_full) Simd::store(r + Simd::kLanes * v, x);
    else Simd::store(r + Simd::kLanes * v, last, x);
  }
};

// Calls body.template operator()<NV>() with NV = the vectors C takes (1 to kRegisterChannels /
// lanes); false when C is 0 or more than kRegisterChannels.
template <class Body>
bool with_channel_vectors(std::int64_t C, Body&& body) {
  if (C < 1 || C > kRegisterChannels) return false;
  const std::int64_t vectors = (C + Simd::kLanes - 1) / Simd::kLanes;
  return [&]<int... I>(std::integer_sequence<int, I...>) {
    return ((vectors == I + 1 && (body.template operator()<I + 1>(), true)) || ...);
  }(std::make_integer_sequence<int, kRegisterChannels / Simd::kLanes>{});
}

// out[c] += sum over rows of x[r, c], out[C + c] += sum of x[r, c]^2.
inline bool sums_and_squares(const float* x, std::int64_t rows, std::int64_t C, float* out) {
  return with_channel_vectors(C, [&]<int NV>() {
    const ChannelLanes<NV> L(C);
    Simd::V s[NV], q[NV];
    for (int v = 0; v < NV; ++v) s[v] = q[v] = Simd::zero();
    for (std::int64_t r = 0; r < rows; ++r)
      for (int v = 0; v < NV; ++v) {
        const Simd::V xv = L.row(x + r * C, v);
        s[v] = Simd::add(s[v], xv);
        q[v] = Simd::fmadd(xv, xv, q[v]);
      }
    for (int v = 0; v < NV; ++v) {
      L.store(out, v, Simd::add(L.row(out, v), s[v]));
      L.store(out + C, v, Simd::add(L.row(out + C, v), q[v]));
    }
  });
}

// out[c] += sum over rows of g[r, c], out[C + c] += sum of g[r, c] * ((x[r, c] - mu[c]) * rstd[c]).
inline bool sums_of_cotangent(const float* x, const float* g, const float* mu, const float* rstd, std::int64_t rows,
                              std::int64_t C, float* out) {
  return with_channel_vectors(C, [&]<int NV>() {
    const ChannelLanes<NV> L(C);
    Simd::V m[NV], k[NV], s[NV], t[NV];
    L.load(mu, m);
    L.load(rstd, k);
    for (int v = 0; v < NV; ++v) s[v] = t[v] = Simd::zero();
    for (std::int64_t r = 0; r < rows; ++r)
      for (int v = 0; v < NV; ++v) {
        const Simd::V gv = L.row(g + r * C, v);
        const Simd::V xhat = Simd::mul(Simd::sub(L.row(x + r * C, v), m[v]), k[v]);
        s[v] = Simd::add(s[v], gv);
        t[v] = Simd::fmadd(gv, xhat, t[v]);
      }
    for (int v = 0; v < NV; ++v) {
      L.store(out, v, Simd::add(L.row(out, v), s[v]));
      L.store(out + C, v, Simd::add(L.row(out + C, v), t[v]));
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
    Simd::V m[NV], f[NV], b[NV];
    L.load(mu, m);
    L.load(a, f);
    L.load(Bias ? bias : nullptr, b);
    const Simd::V zero = Simd::zero();
    for (std::int64_t r = 0; r < rows; ++r)
      for (int v = 0; v < NV; ++v) {
        const Simd::V d = Simd::sub(L.row(x + r * C, v), m[v]);
        Simd::V y = Bias ? Simd::fmadd(d, f[v], b[v]) : Simd::mul(d, f[v]);
        if constexpr (Bf16) y = Simd::stored_as_bf16(y);
        if constexpr (Residual) {
          // (y as computed, opaque to the compiler: GCC would contract (x - mu) * a + residual into one
          // multiply-add, which the composed ops, batch_norm then add, do not make)
          asm("" : "+v"(y));
          y = Simd::add(L.row(residual + r * C, v), y);
          if constexpr (Bf16) y = Simd::stored_as_bf16(y);
        }
        if constexpr (Relu) y = Simd::max(zero, y);  // (0 > y ? 0 : y: std::max(y, 0.0f))
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
    Simd::V mu_v[NV], k[NV], f[NV], m1_v[NV], m2_v[NV], gm_v[NV], gv_v[NV];
    L.load(mu, mu_v);
    L.load(rstd, k);
    L.load(a, f);
    L.load(m1, m1_v);
    L.load(m2, m2_v);
    L.load(gm, gm_v);
    L.load(gv, gv_v);
    for (std::int64_t r = 0; r < rows; ++r)
      for (int v = 0; v < NV; ++v) {
        const Simd::V xc = Simd::sub(L.row(x + r * C, v), mu_v[v]);
        Simd::V d = gm_v[v];
        if (g != nullptr) {
          const Simd::V centred =
              Simd::fnmadd(Simd::mul(xc, k[v]), m2_v[v], Simd::sub(L.row(g + r * C, v), m1_v[v]));
          d = Simd::fmadd(f[v], centred, d);
        }
        L.store(out + r * C, v, Simd::fmadd(gv_v[v], xc, d));
      }
  });
}

#else  // neither AVX-512 nor AVX2 with FMA: the callers' portable loops

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
