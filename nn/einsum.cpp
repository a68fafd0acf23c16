#include <linum/nn/einsum.hpp>

#include <linum/core/error.hpp>
#include <linum/core/ops/all.hpp>

#include <algorithm>
#include <cctype>

namespace linum::nn {

namespace {

std::string without_spaces(std::string_view s) {
  std::string out;
  for (char c : s)
    if (c != ' ') out += c;
  return out;
}

// The "bias" shape and its broadcast over the output: per output axis, the kernel axis it names
// (its size) or 1.
struct BiasShapes {
  Shape bias;
  std::vector<std::int64_t> broadcast;
};

BiasShapes bias_shapes(const std::string& eq, const Array& x, const std::vector<std::int64_t>& kernel_shape) {
  const std::size_t comma = eq.find(','), arrow = eq.find("->");
  const std::string lhs = eq.substr(0, comma), rhs = eq.substr(comma + 1, arrow - comma - 1), out = eq.substr(arrow + 2);
  if (rhs.find("...") != std::string::npos)
    throw ValueError(detail::cat("nn::Einsum: '", eq, "': the kernel's subscripts cannot hold '...' (its shape is fixed: ",
                                 Shape(kernel_shape), "); name each of its axes"));
  if (rhs.size() != kernel_shape.size())
    throw ShapeError(detail::cat("nn::Einsum: '", eq, "' names ", rhs.size(), " kernel axes but the kernel shape ",
                                 Shape(kernel_shape), " has ", kernel_shape.size()));
  std::int64_t named = 0;
  for (char c : lhs) named += std::isalpha(static_cast<unsigned char>(c)) ? 1 : 0;
  const std::int64_t ellipsis_rank = lhs.find("...") != std::string::npos ? std::max<std::int64_t>(x.rank() - named, 0) : 0;
  BiasShapes r;
  for (std::size_t i = 0; i < out.size(); ++i) {
    if (out.compare(i, 3, "...") == 0) {
      for (std::int64_t k = 0; k < ellipsis_rank; ++k) r.broadcast.push_back(1);
      i += 2;
      continue;
    }
    const std::size_t at = rhs.find(out[i]);
    if (at == std::string::npos) {
      r.broadcast.push_back(1);
    } else {
      r.broadcast.push_back(kernel_shape[at]);
      r.bias.push_back(kernel_shape[at]);
    }
  }
  return r;
}

}  // namespace

void Einsum::validate() const {
  if (shape.empty()) throw ValueError("nn::Einsum: shape (the kernel's) is required, e.g. .shape = {512, 8, 64}");
  for (std::int64_t d : shape)
    if (d <= 0) throw ValueError(detail::cat("nn::Einsum: the kernel shape ", Shape(shape), " must have positive sizes"));
  require_float_dtype(param_dtype, "Einsum", "param_dtype");
}

Array Einsum::operator()(Scope& s, const Array& x) const {
  if (einsum_str.empty())
    throw ValueError("nn::Einsum: no subscripts; set .einsum_str (e.g. \"btd,dhk->bthk\") or pass them to the call");
  return (*this)(s, x, std::string_view{});
}

Array Einsum::operator()(Scope& s, const Array& x, std::string_view subscripts) const {
  validate();
  if (!einsum_str.empty() && !subscripts.empty())
    throw ValueError(detail::cat("nn::Einsum: the subscripts are set on the module ('", einsum_str, "') and given to the call ('",
                                 subscripts, "'); set them in one place"));
  const std::string eq = without_spaces(subscripts.empty() ? std::string_view(einsum_str) : subscripts);
  if (eq.find("->") == std::string::npos)
    throw ValueError(detail::cat("nn::Einsum: '", eq, "' must be explicit, with '->' and the output's subscripts"));
  if (std::count(eq.begin(), eq.end(), ',') != 1)
    throw ValueError(detail::cat("nn::Einsum: '", eq, "' must have exactly two operands (the input, then the kernel), so one ','"));
  Array kernel = s.param("kernel", initializer_in(kernel_init, param_dtype), Shape(shape));
  Array bias;
  BiasShapes b;
  if (use_bias) {
    b = bias_shapes(eq, x, shape);
    bias = s.param("bias", initializer_in(bias_init, param_dtype), b.bias);
  }
  auto p = promote_dtype({x, kernel, bias}, dtype);
  Array y = einsum(eq, p[0], p[1]);
  if (use_bias) y = y + reshape(p[2], b.broadcast);
  return y;
}

}  // namespace linum::nn
