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

#include <linum/core/dtype.hpp>

namespace linum {

enum class Engine { eigen, onednn };

Engine engine();
void set_engine(Engine e);  // throws ValueError for an engine this build does not have
bool engine_available(Engine e);
const char* engine_name(Engine e);  // "eigen", "onednn"
// The engine that computes products and convolutions of dtype t: engine(), except bfloat16 on
// oneDNN where this CPU has no oneDNN bf16 kernels (oneDNN 2.7 builds them for AVX-512 and AMX
// only, so not on AVX2 CPUs such as AMD's Zen 3): those run on Eigen, operands widened to float32
// and the result rounded once, as Eigen's bf16 path always does. Read once per CPU (a probe).
Engine engine_for(DType t);

}  // namespace linum
