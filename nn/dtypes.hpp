// Flax's dtype conventions for layers (flax.linen.dtypes).
//
// Every layer has two fields:
//   dtype        the dtype of the computation; std::nullopt (the default) promotes the dtypes of the
//                inputs and parameters (bf16 input with float32 params computes in float32).
//   param_dtype  the dtype parameters are created in (float32 by default). Mixed precision as in
//                Flax is dtype = DType::bf16 with param_dtype = DType::f32: float32 master weights,
//                bf16 compute, float32 gradients.
#pragma once

#include <linum/core/array.hpp>
#include <linum/modules/initializers.hpp>

#include <optional>
#include <vector>

namespace linum::nn {

// flax.linen.dtypes.promote_dtype: every defined array cast to `dtype`, or (when it is nullopt)
// to the promoted float dtype of them all. Undefined arrays (an absent bias) stay undefined.
std::vector<Array> promote_dtype(std::vector<Array> arrays, std::optional<DType> dtype);

// The float dtype a computation over these arrays runs in (dtype if given, else the promotion of
// the arrays' dtypes; int32 arrays do not take part).
DType computation_dtype(std::initializer_list<const Array*> arrays, std::optional<DType> dtype);

// `init` creating its array in `param_dtype` (float32 initializers rounded to bf16 when asked).
Initializer initializer_in(Initializer init, DType param_dtype);

// Throws ValueError unless `t` is a float dtype (layer fields dtype and param_dtype).
void require_float_dtype(DType t, const char* layer, const char* field);

}  // namespace linum::nn
