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

// How the oneDNN engine computes bfloat16 products (matrix products, convolutions, attention's
// blocks), chosen once per process from the CPU:
//  - dot_instructions: Linum's own AVX512-BF16 kernels (vdpbf16ps, with the layer's epilogue inside
//    the product) where they take, oneDNN's bf16 kernels elsewhere. The default on AMD CPUs with
//    AVX512-BF16 (Zen 4, Zen 5), whose vdpbf16ps does twice the float32 FMA's work per cycle.
//  - onednn: oneDNN's bf16 kernels for every product: the default on Intel CPUs with AMX usable
//    (oneDNN runs its AMX tile kernels there).
//  - widened: float32 products of the operands widened (exactly: every bf16 value is a float32), the
//    result rounded once to bf16, as the Eigen engine computes them: on Linum's float32 panel kernel,
//    which widens the operands as it reads them and rounds in its epilogue, for products of at least
//    256 rows (engine.cpp, uses_f32_panels_widened); elsewhere oneDNN's float32 kernels on widened
//    copies. The default on Intel CPUs
//    without AMX: on the 2-core Xeon measured (family 6 model 207, AMX not exposed) vdpbf16ps ran at
//    1.35 G instructions/s against the float32 FMA's 5.2, half the FMA's multiply-adds, and the bf16
//    MLP step took 0.47 s on bf16 kernels against 0.29 s widened. Also on CPUs where oneDNN has no
//    bf16 kernels (AVX2 CPUs such as AMD's Zen 3), and in builds without oneDNN.
// Every choice sums in float32 and rounds the result once; each is deterministic, so recomputation
// under remat is bitwise whichever it is. The environment variable
// LINUM_BF16_PRODUCTS=dot_instructions|onednn|widened overrides the choice; set_bf16_products
// changes it at run time (as set_engine: not while a step runs).
enum class Bf16Products { dot_instructions, onednn, widened };
Bf16Products bf16_products();
void set_bf16_products(Bf16Products p);  // throws ValueError for a choice this CPU or build does not have
bool bf16_products_available(Bf16Products p);
const char* bf16_products_name(Bf16Products p);  // "dot_instructions", "onednn", "widened"

}  // namespace linum
