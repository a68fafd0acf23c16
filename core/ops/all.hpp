// Every op: elementwise, reductions, data movement, matrix products, softmax, convolution, pooling,
// the fused attention, dense layer, normalizations and LSTM cell and layer.
#pragma once

#include <linum/core/ops/attention.hpp>
#include <linum/core/ops/batch_norm.hpp>
#include <linum/core/ops/conv.hpp>
#include <linum/core/ops/einsum.hpp>
#include <linum/core/ops/elementwise.hpp>
#include <linum/core/ops/linalg.hpp>
#include <linum/core/ops/linear.hpp>
#include <linum/core/ops/normalization.hpp>
#include <linum/core/ops/recurrent.hpp>
#include <linum/core/ops/reduce.hpp>
#include <linum/core/ops/shape_ops.hpp>
#include <linum/core/ops/softmax.hpp>
