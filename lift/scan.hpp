// lift::scan<Body>: a stack of `length` layers of the same module, with their variables stacked
// along a new leading axis (Flax's nn.scan over layers with variable_axes={collection: 0} for every
// collection and split_rngs for every stream).
//
//   using Layers = lift::scan<lift::remat<Block>>;                  // scan over rematted layers
//   x = s(Layers{.body = {.features = 512}, .length = 12}, x, train);
//   // params/ScanBlock_0/Dense_0/kernel has shape (12, in, 512)
//
// The body is called as body(scope, carry, extra...) and returns the next carry (an Array of the
// same shape); extra arguments are passed unchanged to every layer (Flax's nn.broadcast). Each
// layer gets its own slice of every variable and its own keys: for each stream, the scan draws one
// key and layer i uses fold_in(key, i). Gradients reach the stacked variables through one unstack
// op, so the backward pass writes them once.
#pragma once

#include <linum/core/autodiff/pytree.hpp>
#include <linum/lift/pack.hpp>
#include <linum/modules/scope.hpp>

#include <optional>
#include <string>
#include <vector>

namespace linum::lift {

namespace detail {

using linum::detail::ScopeState;

// Per-layer state for a scan: the state lift::Pack selects at the scan's scope, sliced per layer
// (layer i's slices of the stacked variables, streams keyed for layer i). `base_keys` are the
// scan's own keys (one per stream).
struct ScanLayers {
  std::optional<Pack> pack;
  std::vector<std::string> path;
  std::string outer_note;  // the enclosing transform's description, for errors inside the layers
  std::vector<std::string> streams;
  std::vector<rng::Key> base_keys;
  // For every (collection, leaf path under the scan), the unstacked layer values.
  std::vector<std::pair<std::string, std::vector<std::pair<std::string, std::vector<Array>>>>> slices;
};

ScanLayers prepare_scan(Scope& s, int length);
ScopeState layer_state(const ScanLayers& layers, int i);
// Stacks the layers' variables and publishes them (for collections that may be written).
void finish_scan(const ScanLayers& layers, const std::vector<ScopeState>& states);

}  // namespace detail

template <class Body>
struct scan {
  Body body{};
  int length = 1;

  // Flax names the scanned module after its body: ScanBlock_0.
  static std::string type_name() { return "Scan" + module_type_name<Body>(); }

  template <class... Extra>
  Array operator()(Scope& s, const Array& carry, const Extra&... extra) const {
    if (length < 1)
      throw ValueError(linum::detail::cat("lift::scan: length must be at least 1, got ", length));
    detail::ScanLayers layers = detail::prepare_scan(s, length);
    std::vector<detail::ScopeState> states;
    states.reserve(static_cast<std::size_t>(length));
    Array h = carry;
    for (int i = 0; i < length; ++i) {
      states.push_back(detail::layer_state(layers, i));
      Scope inner(states.back(), layers.path);
      Array next = inner.run(body, body, h, extra...);
      if (!(next.shape() == h.shape()))
        throw ShapeError(linum::detail::cat("lift::scan: layer ", i, " turned a carry of shape ", h.shape(), " into ",
                                            next.shape(), "; a scanned body must keep the carry's shape"));
      h = std::move(next);
    }
    detail::finish_scan(layers, states);
    return h;
  }
};

}  // namespace linum::lift
