// Internal: 2-D convolutions on oneDNN (conv_onednn.cpp), used by conv2d (core/ops/conv.cpp) when
// the engine is oneDNN. Layouts are Linum's (Flax's): x [N, H, W, C], kernel [KH, KW, C/G, O],
// y [N, OH, OW, O]; float32 or bf16 (all operands one dtype), float32 accumulation.
#pragma once

#include <linum/core/array.hpp>

#include <cstdint>
#include <tuple>

namespace linum::kernels {

struct ConvShape {
  std::int64_t n, h, w, c;        // input
  std::int64_t kh, kw, cg, o;     // kernel: cg = c / groups input channels per group
  std::int64_t groups;
  std::int64_t oh, ow;            // output
  std::int64_t sh, sw, dh, dw;    // strides, dilations (1 = none)
  std::int64_t pad_top, pad_bottom, pad_left, pad_right;
  DType dtype;
  auto tie() const {
    return std::tie(n, h, w, c, kh, kw, cg, o, groups, oh, ow, sh, sw, dh, dw, pad_top, pad_bottom, pad_left, pad_right, dtype);
  }
  bool operator<(const ConvShape& other) const { return tie() < other.tie(); }
};

// A pass's floating-point operations (forward, input gradient or kernel gradient alike: one
// multiply-add per output element, kernel tap and input channel of its group), for the profiler.
inline double conv_flops(std::int64_t n, std::int64_t oh, std::int64_t ow, std::int64_t o, std::int64_t cg, std::int64_t kh,
                         std::int64_t kw) {
  return 2.0 * static_cast<double>(n) * static_cast<double>(oh) * static_cast<double>(ow) * static_cast<double>(o) *
         static_cast<double>(cg) * static_cast<double>(kh) * static_cast<double>(kw);
}
inline double conv_flops(const ConvShape& s) { return conv_flops(s.n, s.oh, s.ow, s.o, s.cg, s.kh, s.kw); }

#if LINUM_HAVE_ONEDNN
// Whether this CPU runs oneDNN's bf16 convolutions (forward, backward data and weights): a probe,
// read once. Where it does not, the functions below run bf16 on the float32 kernels (operands
// widened, the result rounded once).
bool onednn_bf16_conv_available();
Array conv_forward_onednn(const Array& x, const Array& w, const ConvShape& s);
Array conv_backward_data_onednn(const Array& gy, const Array& w, const ConvShape& s);
Array conv_backward_weights_onednn(const Array& x, const Array& gy, const ConvShape& s);
#endif

}  // namespace linum::kernels
