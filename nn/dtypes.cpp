#include <linum/nn/dtypes.hpp>

#include <linum/core/ops/all.hpp>

namespace linum::nn {

DType computation_dtype(std::initializer_list<const Array*> arrays, std::optional<DType> dtype) {
  if (dtype) return *dtype;
  std::optional<DType> t;
  for (const Array* a : arrays) {
    if (a == nullptr || !a->defined() || !is_floating(a->dtype())) continue;
    t = t ? promote_types(*t, a->dtype()) : a->dtype();
  }
  return t.value_or(DType::f32);
}

std::vector<Array> promote_dtype(std::vector<Array> arrays, std::optional<DType> dtype) {
  DType t = dtype.value_or(DType::f32);
  if (!dtype) {
    std::optional<DType> p;
    for (const Array& a : arrays)
      if (a.defined() && is_floating(a.dtype())) p = p ? promote_types(*p, a.dtype()) : a.dtype();
    t = p.value_or(DType::f32);
  }
  for (Array& a : arrays)
    if (a.defined() && a.dtype() != t) a = astype(a, t);
  return arrays;
}

Initializer initializer_in(Initializer init, DType param_dtype) {
  if (param_dtype == DType::f32) return init;
  return [init = std::move(init), param_dtype](rng::Key key, const Shape& shape) {
    return astype(init(key, shape), param_dtype);
  };
}

void require_float_dtype(DType t, const char* layer, const char* field) {
  if (!is_floating(t))
    throw ValueError(detail::cat(layer, ": ", field, " must be a float dtype (DType::f32 or DType::bf16), got ",
                                 dtype_name(t)));
}

}  // namespace linum::nn
