// Reductions over axes. `axes` may hold negative axes (counted from the end); the overloads
// without axes reduce over every axis. With keepdims the reduced axes stay as size 1.
#pragma once

#include <linum/core/array.hpp>

#include <vector>

namespace linum {

Array sum(const Array& x);
Array sum(const Array& x, const std::vector<int>& axes, bool keepdims = false);
Array mean(const Array& x);
Array mean(const Array& x, const std::vector<int>& axes, bool keepdims = false);
// Maximum; at ties the gradient is shared equally among the maximal elements (as JAX).
Array max(const Array& x);
Array max(const Array& x, const std::vector<int>& axes, bool keepdims = false);
Array min(const Array& x);
Array min(const Array& x, const std::vector<int>& axes, bool keepdims = false);
// Product (jnp.prod; 1 over no elements). The last running product of cumprod along the reduced
// axes, so its gradient is exact with zeros in x, as JAX's (no division by x).
Array prod(const Array& x);
Array prod(const Array& x, const std::vector<int>& axes, bool keepdims = false);
// Population variance (ddof = 0), as jnp.var.
Array var(const Array& x);
Array var(const Array& x, const std::vector<int>& axes, bool keepdims = false);
// log(sum(exp(x))) computed stably.
Array logsumexp(const Array& x);
Array logsumexp(const Array& x, const std::vector<int>& axes, bool keepdims = false);
// Index of the first maximum along `axis` (int32; not differentiable).
Array argmax(const Array& x, int axis = -1);

}  // namespace linum
