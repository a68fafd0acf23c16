// Internal to the AVX-512 kernels (gemm_bf16.cpp, gemm_bf16_panels.cpp, gemm_f32_panels.cpp): the mask of a 16-lane
// vector's first `count` lanes (none when count <= 0, all when count >= 16), for rows whose length is
// not a multiple of 16.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace linum::kernels::detail {

inline __mmask16 lanes(std::int64_t count) {
  if (count <= 0) return 0;
  if (count >= 16) return 0xFFFF;
  return static_cast<__mmask16>((1u << count) - 1u);
}

}  // namespace linum::kernels::detail
