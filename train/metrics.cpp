#include <linum/train/metrics.hpp>
#include <linum/core/autodiff/graph.hpp>
#include <linum/core/ops/all.hpp>

namespace linum::metrics {

Array Average::astype_f32(const Array& a) { return astype(a, DType::f32); }

void Accuracy::update(const Array& logits, const Array& labels) {
  if (logits.rank() < 1 || !is_floating(logits.dtype()))
    throw ShapeError(detail::cat("metrics::Accuracy: logits must be float [..., classes], got ", logits.type_str()));
  if (labels.dtype() != DType::i32 || labels.numel() * logits.dim(-1) != logits.numel())
    throw ShapeError(detail::cat("metrics::Accuracy: labels must be int32 with the shape of logits without the class axis; got ",
                                 "logits ", logits.type_str(), " and labels ", labels.type_str()));
  autodiff::NoGradGuard constants;
  const Array predicted = argmax(logits, -1);
  std::int64_t hits = 0;
  for (std::int64_t i = 0; i < labels.numel(); ++i) hits += predicted.data_i32()[i] == labels.data_i32()[i];
  Average::update(labels.numel() > 0 ? static_cast<double>(hits) / static_cast<double>(labels.numel()) : 0.0,
                  static_cast<double>(labels.numel()));
}

}  // namespace linum::metrics
