// Which library computes matrix products: oneDNN (the CPU kernel library PyTorch uses; it picks
// AMX, AVX-512-BF16, AVX-512 or AVX2 kernels for the machine at run time) or Eigen.
//
// oneDNN is the default when Linum was built with it (Meson option `onednn`, `auto` by default:
// used when Debian's libdnnl-dev is installed). Eigen is always there. The environment variable
// LINUM_ENGINE=eigen|onednn sets the initial choice; set_engine changes it at run time (not while
// a step runs: recomputation under remat must use the kernels of the forward pass).
//
// Both engines accumulate in float32 and agree within float32 rounding; bfloat16 products on Eigen
// widen the operands to float32 first (correct, but without the hardware's bf16 speed).
#pragma once

namespace linum {

enum class Engine { eigen, onednn };

Engine engine();
void set_engine(Engine e);  // throws ValueError for an engine this build does not have
bool engine_available(Engine e);
const char* engine_name(Engine e);  // "eigen", "onednn"
// Whether oneDNN has bf16 kernels for this CPU (oneDNN 2.7 builds them for AVX-512 and AMX). Where
// it has not (AVX2 CPUs such as AMD's Zen 3), bf16 products and convolutions on the oneDNN engine
// run its float32 kernels on the operands widened, the result rounded once: the same values, at
// float32 speed. False in a build without oneDNN.
bool onednn_has_bf16_kernels();

}  // namespace linum
