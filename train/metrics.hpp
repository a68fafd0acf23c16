// Running metrics that merge across batches and ranks, as clu.metrics / flax's training examples:
//
//   metrics::Average loss;  metrics::Accuracy accuracy;
//   for (batch ...) { loss.update(step_loss, batch_size); accuracy.update(logits, labels); }
//   accuracy = accuracy.merge(other_epoch_part);               // or across ranks:
//   accuracy = metrics::Accuracy::from_state(dist::allreduce_sum(accuracy.state()));
//   std::printf("loss %.4f acc %.4f\n", loss.compute(), accuracy.compute());
//
// Totals are kept in double; state() gives them as a float32 tree (for dist::allreduce_sum or a
// checkpoint), exact for counts up to 2^24.
#pragma once

#include <linum/core/array.hpp>
#include <linum/core/error.hpp>
#include <linum/core/tree.hpp>

#include <cmath>
#include <cstdint>
#include <limits>

namespace linum::metrics {

// The weighted mean of the values seen (clu.metrics.Average).
class Average {
 public:
  // One value counted `weight` times (a batch mean with weight = batch size).
  void update(double value, double weight = 1.0) {
    if (!(weight >= 0)) throw ValueError(detail::cat("metrics::Average: weight must be >= 0, got ", weight));
    total_ += value * weight;
    count_ += weight;
  }
  // Every element of a float array, each counted once.
  void update(const Array& values) {
    if (!is_floating(values.dtype()))
      throw ValueError(detail::cat("metrics::Average: needs float values, got ", values.type_str()));
    const Array v = values.dtype() == DType::f32 ? values : astype_f32(values);
    for (std::int64_t i = 0; i < v.numel(); ++i) total_ += v.data()[i];
    count_ += static_cast<double>(v.numel());
  }
  // The metric over both parts.
  Average merge(const Average& other) const {
    Average m = *this;
    m.total_ += other.total_;
    m.count_ += other.count_;
    return m;
  }
  // total / count (NaN before any update, as clu).
  double compute() const { return count_ > 0 ? total_ / count_ : std::numeric_limits<double>::quiet_NaN(); }
  double total() const { return total_; }
  double count() const { return count_; }
  // {"total", "count"} as float32 scalars, and back.
  Tree state() const {
    return Tree{{"total", Array::full(Shape{}, static_cast<float>(total_))},
                {"count", Array::full(Shape{}, static_cast<float>(count_))}};
  }
  static Average from_state(const Tree& state) {
    Average a;
    a.total_ = state.at("total").array().item();
    a.count_ = state.at("count").array().item();
    return a;
  }

 private:
  static Array astype_f32(const Array& a);
  double total_ = 0, count_ = 0;
};

// The share of correct predictions (clu.metrics.Accuracy): argmax of logits [..., classes]
// against int32 labels [...].
class Accuracy : public Average {
 public:
  using Average::update;
  void update(const Array& logits, const Array& labels);
  Accuracy merge(const Accuracy& other) const {
    Accuracy m;
    static_cast<Average&>(m) = Average::merge(other);
    return m;
  }
  static Accuracy from_state(const Tree& state) {
    Accuracy m;
    static_cast<Average&>(m) = Average::from_state(state);
    return m;
  }
};

}  // namespace linum::metrics
