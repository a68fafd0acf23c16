// Losses, as optax's. Each returns the loss per example (the leading axes of its inputs), like
// optax; take `mean(...)` for a scalar training loss. Inputs may be float32 or bfloat16; losses are
// computed and returned in float32 (bf16 inputs are widened first), so their sums accumulate in
// float32:
//
//   Array loss = mean(nn::softmax_cross_entropy_with_integer_labels(logits, labels));
#pragma once

#include <linum/core/array.hpp>

namespace linum::nn {

// -sum(labels * log_softmax(logits), -1): logits and labels (probabilities, e.g. one-hot) of the
// same shape [..., classes] -> [...] (optax.softmax_cross_entropy).
Array softmax_cross_entropy(const Array& logits, const Array& labels);

// logsumexp(logits, -1) - logits[..., label]: logits [..., classes], int32 labels [...] -> [...]
// (optax.softmax_cross_entropy_with_integer_labels). A label outside [0, classes) is a ValueError.
Array softmax_cross_entropy_with_integer_labels(const Array& logits, const Array& labels);

// -labels * log_sigmoid(logits) - (1 - labels) * log_sigmoid(-logits), elementwise
// (optax.sigmoid_binary_cross_entropy).
Array sigmoid_binary_cross_entropy(const Array& logits, const Array& labels);

// (predictions - targets)^2, elementwise (optax.squared_error).
Array squared_error(const Array& predictions, const Array& targets);

// 0.5 * (predictions - targets)^2, elementwise (optax.l2_loss).
Array l2_loss(const Array& predictions, const Array& targets);

// The mean squared error over every element: mean(squared_error(predictions, targets)), a scalar
// (optax has no such function; written out here because "MSE" always means this mean).
Array mse(const Array& predictions, const Array& targets);

// 0.5 * e^2 where |e| <= delta, else delta * (|e| - 0.5 * delta), with e = predictions - targets,
// elementwise (optax.huber_loss).
Array huber_loss(const Array& predictions, const Array& targets, float delta = 1.0f);

// The cosine of the angle between predictions and targets along the last axis: [..., d] -> [...]
// (optax.cosine_similarity); each vector's norm is taken as at least `epsilon`.
Array cosine_similarity(const Array& predictions, const Array& targets, float epsilon = 0.0f);
// 1 - cosine_similarity (optax.cosine_distance).
Array cosine_distance(const Array& predictions, const Array& targets, float epsilon = 0.0f);

// sum(targets * (log(targets) - log_predictions), -1), with 0 * log 0 = 0: log_predictions and
// targets (probabilities) [..., classes] -> [...] (optax.kl_divergence).
Array kl_divergence(const Array& log_predictions, const Array& targets);

// (1 - alpha) * labels + alpha / classes: one-hot labels [..., classes] smoothed toward the uniform
// distribution (optax.smooth_labels), for softmax_cross_entropy with label smoothing.
Array smooth_labels(const Array& labels, float alpha);

}  // namespace linum::nn
