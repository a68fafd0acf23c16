// Shape: the dimensions of an array, stored inline (no heap allocation), up to kMaxRank axes.
#pragma once

#include <linum/core/error.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <ostream>
#include <span>
#include <string>
#include <vector>

namespace linum {

class Shape {
 public:
  static constexpr int kMaxRank = 8;

  Shape() = default;
  Shape(std::initializer_list<std::int64_t> dims) { assign(dims.begin(), dims.end()); }
  explicit Shape(std::span<const std::int64_t> dims) { assign(dims.begin(), dims.end()); }
  explicit Shape(const std::vector<std::int64_t>& dims) { assign(dims.begin(), dims.end()); }
  explicit Shape(const std::vector<int>& dims) { assign(dims.begin(), dims.end()); }

  int rank() const { return rank_; }
  std::int64_t operator[](int axis) const { return dims_[static_cast<std::size_t>(axis)]; }
  std::int64_t& operator[](int axis) { return dims_[static_cast<std::size_t>(axis)]; }
  // Axis from the end for negative values, like Python: dim(-1) is the last axis.
  std::int64_t dim(int axis) const { return (*this)[normalize_axis(axis, "Shape::dim")]; }

  // The number of elements. Throws ShapeError when the product of the non-zero dimensions does not
  // fit in 64 bits (no array could be that large, and its strides would overflow), even if a zero
  // dimension makes the array empty.
  std::int64_t numel() const {
    std::int64_t n = 1;
    bool empty = false;
    for (int i = 0; i < rank_; ++i) {
      const std::int64_t d = dims_[static_cast<std::size_t>(i)];
      if (d == 0) {
        empty = true;
        continue;
      }
      if (__builtin_mul_overflow(n, d, &n)) throw_too_large();
    }
    return empty ? 0 : n;
  }

  const std::int64_t* begin() const { return dims_.data(); }
  const std::int64_t* end() const { return dims_.data() + rank_; }
  std::vector<std::int64_t> vec() const { return {begin(), end()}; }

  void push_back(std::int64_t d) {
    if (rank_ == kMaxRank) throw ShapeError(detail::cat("Shape: rank above ", kMaxRank, " is not supported"));
    dims_[static_cast<std::size_t>(rank_++)] = d;
  }

  // Maps a possibly negative axis into [0, rank), or throws naming `op`.
  int normalize_axis(int axis, const char* op) const {
    int a = axis < 0 ? axis + rank_ : axis;
    if (a < 0 || a >= rank_)
      throw ShapeError(detail::cat(op, ": axis ", axis, " is out of range for an array of shape ", str()));
    return a;
  }

  // Row-major strides in elements.
  std::array<std::int64_t, kMaxRank> strides() const {
    std::array<std::int64_t, kMaxRank> s{};
    std::int64_t acc = 1;
    for (int i = rank_ - 1; i >= 0; --i) {
      s[static_cast<std::size_t>(i)] = acc;
      acc *= dims_[static_cast<std::size_t>(i)];
    }
    return s;
  }

  std::string str() const {
    std::string s = "(";
    for (int i = 0; i < rank_; ++i) {
      if (i) s += ", ";
      s += std::to_string(dims_[static_cast<std::size_t>(i)]);
    }
    if (rank_ == 1) s += ",";
    return s + ")";
  }

  friend bool operator==(const Shape& a, const Shape& b) {
    return a.rank_ == b.rank_ && std::equal(a.begin(), a.end(), b.begin());
  }
  friend std::ostream& operator<<(std::ostream& os, const Shape& s) { return os << s.str(); }

 private:
  template <class It>
  void assign(It first, It last) {
    rank_ = 0;
    for (; first != last; ++first) {
      if (*first < 0) throw ShapeError(detail::cat("Shape: negative dimension ", *first));
      push_back(static_cast<std::int64_t>(*first));
    }
  }

  [[noreturn]] void throw_too_large() const {
    throw ShapeError(detail::cat("Shape ", str(), " has more than 2^63 elements; no array can be that large"));
  }

  std::array<std::int64_t, kMaxRank> dims_{};
  int rank_ = 0;
};

}  // namespace linum
