// jnp.einsum: contractions written as subscripts ("ij,jk->ik", "bhqd,bhkd->bhqk", "ii->i",
// "...ij,...jk->...ik"). Built from ops (diagonals through take, sums, dot_general, transposes), so it
// is differentiable to any order, batched under vmap, and policies see its products as the
// dot_generals they are (dots_saveable keeps them).
#pragma once

#include <linum/core/array.hpp>

#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

namespace linum {

// Subscripts as NumPy's: letters a-z and A-Z label axes, "..." stands for the leading axes not
// named (broadcast across operands, size 1 against n), a letter repeated within one operand takes
// the diagonal, letters missing from the output are summed. Without "->" the output is "..." then
// the letters used once, in alphabetical order (uppercase first). Operands are contracted left to
// right. Throws ShapeError/ValueError naming the subscripts and the shapes on a bad spec.
Array einsum(std::string_view subscripts, std::span<const Array> operands);

template <class... A>
  requires(sizeof...(A) >= 1 && (std::is_convertible_v<const A&, const Array&> && ...))
Array einsum(std::string_view subscripts, const A&... operands) {
  const std::vector<Array> list{operands...};
  return einsum(subscripts, std::span<const Array>(list));
}

}  // namespace linum
