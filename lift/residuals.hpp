// saved_residuals: what a function keeps for its backward pass (JAX's saved_residuals /
// print_saved_residuals). Use it to see what a checkpoint policy really saves.
//
//   for (const auto& r : lift::saved_residuals(f, w, x)) std::cout << r.str() << "\n";
//   // f32[512,512] from the argument 0
//   // f32[2048,512] output of matmul in Block_0 (kept by the checkpoint)
#pragma once

#include <linum/core/autodiff/grad.hpp>
#include <linum/core/autodiff/pytree.hpp>

#include <string>
#include <vector>

namespace linum::lift {

// One value kept alive for the backward pass.
struct Residual {
  Shape shape;
  DType dtype = DType::f32;
  std::size_t bytes = 0;
  // "argument", "op" (an op's output), or "constant" (an array created outside the function).
  std::string kind;
  int argument = -1;        // for arguments: the flat index among the array arguments
  std::string op;           // for op outputs: the producing op ("matmul", "gelu", "checkpoint", ...)
  std::string name;         // the checkpoint_name tag, if the value has one
  std::string module_path;  // the module whose code produced it, if any
  // "f32[2048,512] output of matmul in Block_0", in the style of print_saved_residuals.
  std::string str() const;
};

namespace detail {
// Traces `run` (which computes the outputs from `tracked` arguments) and lists the residuals.
std::vector<Residual> trace_residuals(const std::vector<Array>& arguments,
                                      const std::function<std::vector<Array>(const std::vector<Array>&)>& run);
}  // namespace detail

// The residuals of differentiating f at args: every array some recorded node keeps for the backward
// pass, each listed once (values shared by several nodes count once), in the order the backward pass
// would meet them reversed. Every Array/Tree argument is differentiated.
template <class F, class... Args>
std::vector<Residual> saved_residuals(F&& f, const Args&... args) {
  std::vector<Array> flat;
  (pytree::flatten_into(args, flat), ...);
  return detail::trace_residuals(flat, [&](const std::vector<Array>& tracked) {
    std::size_t pos = 0;
    // Braced initialisation evaluates left to right, so `pos` walks the arguments in order.
    std::tuple<std::decay_t<Args>...> rebuilt{pytree::rebuild_from(args, std::span<const Array>(tracked), pos)...};
    return pytree::flatten(std::apply(f, rebuilt));
  });
}

// saved_residuals as text, one residual per line, with the total bytes at the end.
template <class F, class... Args>
std::string print_saved_residuals(F&& f, const Args&... args) {
  std::string out;
  std::size_t total = 0;
  for (const Residual& r : saved_residuals(std::forward<F>(f), args...)) {
    out += r.str() + "\n";
    total += r.bytes;
  }
  return out + "total " + std::to_string(total) + " bytes\n";
}

}  // namespace linum::lift
