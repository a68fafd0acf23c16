// softmax and log_softmax over axes (default: the last). Each keeps only its output for the
// backward pass.
#pragma once

#include <linum/core/array.hpp>

#include <vector>

namespace linum {

Array softmax(const Array& x, const std::vector<int>& axes = {-1});
Array log_softmax(const Array& x, const std::vector<int>& axes = {-1});

}  // namespace linum
