// lift::remat_scan<Body, RematOptions...>: Flax's nn.remat_scan. `lengths = {l1, l2, ...}` nests
// scans, each level's body rematted: L = l1 * l2 * ... applications of Body with variables shaped
// (l1, l2, ..., ...), and activation memory growing like L^(1/levels) instead of L (the carries
// of one iteration per level are kept; the rest is recomputed).
//
//   x = s(lift::remat_scan<Block>{.body = {.features = 512}, .lengths = {8, 8}}, x);   // 64 blocks
//   // params/Remat_scanBlock_0/Dense_0/kernel has shape (8, 8, in, 512)
//
// The body is called as body(scope, carry) and returns the next carry. All levels run in the
// remat_scan's own scope (no scope per level), every collection is scanned along axis 0 and every
// stream split, as Flax's defaults. RematOptions (lift::policy<P>, ...) apply to every level.
// Gradients are bitwise those of the same nested scan without remat.
#pragma once

#include <linum/lift/remat.hpp>
#include <linum/lift/scan.hpp>

#include <string>
#include <vector>

namespace linum::lift {

template <class Body, class... RematOptions>
struct remat_scan {
  Body body{};
  std::vector<int> lengths{};

  // Flax names it "Remat_scan" + the body's name (its transform name, capitalized).
  static std::string type_name() { return "Remat_scan" + module_type_name<Body>(); }

  template <class Carry>
  Carry operator()(Scope& s, const Carry& carry) const {
    if (lengths.empty())
      throw ValueError(linum::detail::cat("lift::remat_scan at '", s.path_str(), "': give at least one length"));
    for (int l : lengths)
      if (l < 1)
        throw ValueError(linum::detail::cat("lift::remat_scan at '", s.path_str(), "': lengths must be at least 1, got ", l));
    return Level{body, lengths, 0}(s, carry);
  }

  // One level of the nest: a scan over lengths[level] of the rematted next level (or of the body).
  struct Level {
    Body body{};
    std::vector<int> lengths{};
    std::size_t level = 0;
    static std::string type_name() { return module_type_name<Body>(); }
    template <class Carry>
    Carry operator()(Scope& s, const Carry& carry) const {
      const int n = lengths[level];
      if (level + 1 == lengths.size()) return scan<remat<Body, RematOptions...>>{.body = {body}, .length = n}(s, carry);
      return scan<remat<Level, RematOptions...>>{.body = {Level{body, lengths, level + 1}}, .length = n}(s, carry);
    }
  };
};

}  // namespace linum::lift
