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

}  // namespace linum::nn
