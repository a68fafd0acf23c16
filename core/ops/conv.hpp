// 2-D convolution and pooling on NHWC images (the layouts of Flax: inputs [N, H, W, C], kernels
// [KH, KW, C / groups, O]).
#pragma once

#include <linum/core/array.hpp>

#include <array>
#include <initializer_list>
#include <string>
#include <vector>
#include <cstdint>
#include <utility>

namespace linum {

// Padding of the spatial axes, one type for convolutions (ops and nn::Conv) and pooling, spelled
// as Flax and lax spell it:
//   "SAME"   output size ceil(in / stride), the extra padding at the end (Padding::same())
//   "VALID"  none (Padding::valid(); also Padding{})
//   "CAUSAL" (k - 1) * dilation zeros before the only spatial axis, none after: 1-D nn::Conv only
//   p        p zeros on both sides of every spatial axis
//   {{lo, hi}, ...}  explicit (low, high) pairs, one per spatial axis (one pair: every axis)
// e.g. nn::Conv{.padding = "VALID"}, avg_pool(x, {.padding = "SAME"}), conv2d(x, w, {.padding = 1}).
struct Padding {
  enum class Kind { same, valid, causal, explicit_pairs } kind = Kind::valid;
  std::vector<std::pair<std::int64_t, std::int64_t>> pairs;  // explicit_pairs only

  Padding() = default;  // VALID
  // "SAME", "VALID" or "CAUSAL" (in any case); anything else throws ValueError.
  Padding(const char* mode);         // NOLINT(google-explicit-constructor)
  Padding(const std::string& mode);  // NOLINT(google-explicit-constructor)
  // `p` zeros on both sides of every spatial axis (p >= 0).
  Padding(int p);  // NOLINT(google-explicit-constructor)
  // Explicit (low, high) pairs: `.padding = {{1, 1}, {2, 2}}`.
  Padding(std::initializer_list<std::pair<std::int64_t, std::int64_t>> p) : kind(Kind::explicit_pairs), pairs(p) {}
  explicit Padding(std::vector<std::pair<std::int64_t, std::int64_t>> p) : kind(Kind::explicit_pairs), pairs(std::move(p)) {}

  static Padding same() { return Padding(Kind::same); }
  static Padding valid() { return Padding(); }
  static Padding causal() { return Padding(Kind::causal); }
  static Padding explicit_pads(std::int64_t top, std::int64_t bottom, std::int64_t left, std::int64_t right) {
    return Padding{{top, bottom}, {left, right}};
  }

  // "SAME", "VALID", "CAUSAL", or "" for explicit pairs.
  std::string mode() const;
  // The explicit (low, high) pair of spatial axis `axis` (one pair stands for every axis).
  std::pair<std::int64_t, std::int64_t> pair(int axis) const;
  // Throws ShapeError (naming `op`) unless this padding fits `spatial_axes` spatial axes: explicit
  // pairs one or one per axis, none negative; CAUSAL only where `causal_ok`.
  void check(const char* op, int spatial_axes, bool causal_ok) const;

  friend bool operator==(const Padding&, const Padding&) = default;

 private:
  explicit Padding(Kind k) : kind(k) {}
};

struct ConvOptions {
  std::array<std::int64_t, 2> strides{1, 1};
  Padding padding = Padding::same();
  std::array<std::int64_t, 2> dilation{1, 1};  // kernel (rhs) dilation
  std::int64_t feature_group_count = 1;
};

// y[n, oh, ow, o] = sum over the window and the group's input channels of x * w.
Array conv2d(const Array& x, const Array& w, const ConvOptions& options = {});

struct ConvTransposeOptions {
  std::array<std::int64_t, 2> strides{1, 1};  // the upsampling factor
  // SAME (output size in * stride), VALID (in * stride + max(k - stride, 0)), or explicit (low,
  // high) padding of the stride-dilated input, as lax.conv_transpose.
  Padding padding = Padding::same();
  std::array<std::int64_t, 2> dilation{1, 1};  // kernel dilation
  // Flip the kernel spatially and swap its I/O axes: the kernel [KH, KW, O, I] of the forward
  // convolution this one is the gradient of (lax.conv_transpose's transpose_kernel).
  bool transpose_kernel = false;
};

// lax.conv_transpose with NHWC/HWIO layouts: the input dilated by the strides (stride - 1 zeros
// between neighbours), padded, and convolved with stride 1. Kernel [KH, KW, C, O] ([KH, KW, O, C]
// with transpose_kernel). Differentiable in both arguments. On oneDNN it runs as what it is, the
// data gradient of the strided convolution it transposes (one primitive, "conv_transpose2d",
// counted as a dot by remat policies; no multiplies by the dilation's zeros); paddings without such
// a convolution (a low pad beyond the dilated kernel) and the Eigen engine dilate and convolve.
Array conv_transpose2d(const Array& x, const Array& w, const ConvTransposeOptions& options = {});

struct PoolOptions {
  std::array<std::int64_t, 2> window{2, 2};
  std::array<std::int64_t, 2> strides{1, 1};  // Flax's default; pass the window for non-overlapping pools
  Padding padding = Padding::valid();
  bool count_include_pad = true;  // average pooling: divide by the full window (Flax's default)
};

Array avg_pool(const Array& x, const PoolOptions& options);
Array max_pool(const Array& x, const PoolOptions& options);

namespace detail {
// (low, high) padding and output size for one spatial axis.
struct AxisPlan {
  std::int64_t pad_lo, pad_hi, out;
};
AxisPlan plan_axis(std::int64_t in, std::int64_t window, std::int64_t stride, std::int64_t dilation,
                   const Padding& padding, int axis, const char* op);
}  // namespace detail

}  // namespace linum
