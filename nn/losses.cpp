#include <linum/nn/losses.hpp>

#include <linum/core/autodiff/batching.hpp>
#include <linum/core/ops/all.hpp>
#include <linum/nn/activations.hpp>

#include <vector>

namespace linum::nn {

namespace {

void require_same_shape(const Array& a, const Array& b, const char* loss, const char* an, const char* bn) {
  if (!(a.shape() == b.shape()))
    throw ShapeError(detail::cat(loss, ": ", an, " of shape ", a.shape(), " and ", bn, " of shape ", b.shape(),
                                 " must have the same shape"));
  if (!is_floating(a.dtype()) || !is_floating(b.dtype()))
    throw ShapeError(detail::cat(loss, ": ", an, " and ", bn, " must be float32 or bfloat16 (got ", dtype_name(a.dtype()),
                                 " and ", dtype_name(b.dtype()), ")"));
}

// Losses compute and return float32 whatever the inputs' float dtype (bf16 logits are widened
// first), so the sums that losses are made of accumulate in float32.
Array f32(const Array& x) { return x.dtype() == DType::f32 ? x : astype(x, DType::f32); }

}  // namespace

Array softmax_cross_entropy(const Array& logits, const Array& labels) {
  require_same_shape(logits, labels, "softmax_cross_entropy", "logits", "labels");
  if (logits.rank() < 1) throw ShapeError("softmax_cross_entropy: logits must have a class axis");
  return -sum(f32(labels) * log_softmax(f32(logits), {-1}), {-1});
}

Array softmax_cross_entropy_with_integer_labels(const Array& logits, const Array& labels) {
  const char* loss = "softmax_cross_entropy_with_integer_labels";
  if (logits.rank() < 1 || !is_floating(logits.dtype()))
    throw ShapeError(detail::cat(loss, ": logits must be float32 or bfloat16 [..., classes], got ",
                                 dtype_name(logits.dtype()), logits.shape()));
  if (labels.dtype() != DType::i32)
    throw ShapeError(detail::cat(loss, ": labels must be int32 class indices, got ", dtype_name(labels.dtype()),
                                 "; for one-hot or soft labels use softmax_cross_entropy"));
  Shape batch(std::vector<std::int64_t>(logits.shape().begin(), logits.shape().end() - 1));
  if (!(labels.shape() == batch))
    throw ShapeError(detail::cat(loss, ": labels of shape ", labels.shape(), " must have the shape of logits ",
                                 logits.shape(), " without the class axis, ", batch));
  if (logits.batched() || labels.batched()) {  // vmap: the same on every example's logits and labels at once
    const Array* both[] = {&logits, &labels};
    const std::vector<BatchLevel> levels = autodiff::union_levels(both, loss);
    return Array::batched_view(softmax_cross_entropy_with_integer_labels(autodiff::broadcast_levels(logits, levels).physical(),
                                                                         autodiff::broadcast_levels(labels, levels).physical()),
                               levels);
  }
  const std::int64_t classes = logits.dim(-1);
  const std::int32_t* raw = labels.data_i32();
  const std::int64_t n = labels.numel();
  std::vector<std::int32_t> flat(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    if (raw[i] < 0 || raw[i] >= classes)
      throw ValueError(detail::cat(loss, ": label ", raw[i], " at flat position ", i, " is outside [0, ", classes, ")"));
    flat[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i * classes + raw[i]);
  }
  // take_along_axis(logits, labels[..., None], -1)[..., 0] as a gather from the flattened logits.
  const Array wide = f32(logits);
  Array label_logits = reshape(take(reshape(wide, {-1}), Array::from_i32(Shape{n}, flat), 0), batch.vec());
  return logsumexp(wide, {-1}) - label_logits;
}

Array sigmoid_binary_cross_entropy(const Array& logits, const Array& labels) {
  require_same_shape(logits, labels, "sigmoid_binary_cross_entropy", "logits", "labels");
  const Array y = f32(labels), z = f32(logits);
  return -y * log_sigmoid(z) - (1.0f - y) * log_sigmoid(-z);
}

Array squared_error(const Array& predictions, const Array& targets) {
  require_same_shape(predictions, targets, "squared_error", "predictions", "targets");
  return square(f32(predictions) - f32(targets));
}

Array l2_loss(const Array& predictions, const Array& targets) {
  require_same_shape(predictions, targets, "l2_loss", "predictions", "targets");
  return 0.5f * square(f32(predictions) - f32(targets));
}

Array mse(const Array& predictions, const Array& targets) {
  require_same_shape(predictions, targets, "mse", "predictions", "targets");
  return mean(square(f32(predictions) - f32(targets)));
}

Array huber_loss(const Array& predictions, const Array& targets, float delta) {
  require_same_shape(predictions, targets, "huber_loss", "predictions", "targets");
  if (!(delta > 0)) throw ValueError(detail::cat("huber_loss: delta must be positive, got ", delta));
  const Array errors = abs(f32(predictions) - f32(targets));
  const Array quadratic = minimum(errors, Array::scalar(delta));
  const Array linear = errors - quadratic;  // |e| - min(|e|, delta)
  return 0.5f * square(quadratic) + delta * linear;
}

namespace {
// x / max(|x|, epsilon) along the last axis.
Array unit(const Array& x, float epsilon) {
  const Array norm = sqrt(sum(square(x), {-1}, /*keepdims=*/true));
  return x / (epsilon > 0 ? maximum(norm, Array::scalar(epsilon)) : norm);
}
}  // namespace

Array cosine_similarity(const Array& predictions, const Array& targets, float epsilon) {
  require_same_shape(predictions, targets, "cosine_similarity", "predictions", "targets");
  if (predictions.rank() < 1) throw ShapeError("cosine_similarity: needs vectors along the last axis, got scalars");
  return sum(unit(f32(predictions), epsilon) * unit(f32(targets), epsilon), {-1});
}

Array cosine_distance(const Array& predictions, const Array& targets, float epsilon) {
  return 1.0f - cosine_similarity(predictions, targets, epsilon);
}

Array kl_divergence(const Array& log_predictions, const Array& targets) {
  require_same_shape(log_predictions, targets, "kl_divergence", "log_predictions", "targets");
  if (targets.rank() < 1) throw ShapeError("kl_divergence: needs a class axis, got scalars");
  const Array t = f32(targets);
  const Array positive = greater(t, Array::scalar(0.0f));
  // log(targets) where targets > 0, else 0 (its gradient stays finite: the log sees 1 there).
  const Array log_t = where(positive, log(where(positive, t, Array::full(t.shape(), 1.0f))), Array::zeros(t.shape()));
  return sum(t * (log_t - f32(log_predictions)), {-1});
}

Array smooth_labels(const Array& labels, float alpha) {
  if (labels.rank() < 1 || !is_floating(labels.dtype()))
    throw ShapeError(detail::cat("smooth_labels: needs float labels [..., classes], got ", labels.type_str()));
  if (!(alpha >= 0 && alpha <= 1)) throw ValueError(detail::cat("smooth_labels: alpha must be in [0, 1], got ", alpha));
  const float classes = static_cast<float>(labels.dim(-1));
  return (1.0f - alpha) * f32(labels) + alpha / classes;
}

}  // namespace linum::nn
