// Running metrics that merge across batches and ranks, as clu.metrics / flax's training examples
// (Average, Accuracy, Std, LastValue) and torchmetrics / Keras for classifiers (TopKAccuracy, and
// ConfusionMatrix with precision, recall and F1, micro / macro / weighted):
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
#include <vector>

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

// Whether `labels` is one int32 label per row of `logits` [..., classes]; `who` names the metric.
void check_logits_and_labels(const char* who, const Array& logits, const Array& labels);

// The running mean and standard deviation of the values seen (clu.metrics.Std: the population
// standard deviation, sqrt(E[x^2] - E[x]^2), clamped at 0 against rounding).
class Std {
 public:
  void update(double value, double weight = 1.0);
  void update(const Array& values);  // every element, each counted once
  Std merge(const Std& other) const;
  double mean() const { return count_ > 0 ? total_ / count_ : std::numeric_limits<double>::quiet_NaN(); }
  double compute() const;  // NaN before any update
  double count() const { return count_; }
  Tree state() const;  // {"total", "sum_of_squares", "count"}
  static Std from_state(const Tree& state);

 private:
  double total_ = 0, sum_of_squares_ = 0, count_ = 0;
};

// The last value given (clu.metrics.LastValue); merging keeps the other part's.
class LastValue {
 public:
  void update(double value) { value_ = value; }
  LastValue merge(const LastValue& other) const { return std::isnan(other.value_) ? *this : other; }
  double compute() const { return value_; }  // NaN before any update
  Tree state() const { return Tree{{"value", Array::full(Shape{}, static_cast<float>(value_))}}; }
  static LastValue from_state(const Tree& state) {
    LastValue v;
    v.value_ = state.at("value").array().item();
    return v;
  }

 private:
  double value_ = std::numeric_limits<double>::quiet_NaN();
};

// The share of rows whose label is among the k largest logits (Keras' TopKCategoricalAccuracy,
// tf.math.in_top_k: a label tied with the k-th largest logit counts as a hit).
class TopKAccuracy : public Average {
 public:
  explicit TopKAccuracy(int k = 5);
  using Average::update;
  void update(const Array& logits, const Array& labels);
  TopKAccuracy merge(const TopKAccuracy& other) const;
  int k() const { return k_; }
  static TopKAccuracy from_state(const Tree& state, int k);

 private:
  int k_;
};

// How precision, recall and F1 combine the classes (torchmetrics' `average`, sklearn's):
//   micro     from the counts summed over classes (for single-label classes: the accuracy);
//   macro     the unweighted mean over the classes that occur (in labels or predictions);
//   weighted  the mean weighted by each class's number of labels.
enum class Averaging { micro, macro, weighted };

// Counts of (label, predicted class) pairs over the rows seen, and the scores computed from them
// (torchmetrics' MulticlassConfusionMatrix / Precision / Recall / F1Score, Keras' F1Score). A
// class's score whose denominator is 0 counts as 0, as torchmetrics' and sklearn's zero_division=0.
class ConfusionMatrix {
 public:
  explicit ConfusionMatrix(int num_classes);
  // Predictions are the argmax of logits [..., num_classes]; labels int32 [...] in [0, num_classes).
  void update(const Array& logits, const Array& labels);
  // Predicted classes given directly (int32, the shape of labels).
  void update_predictions(const Array& predicted, const Array& labels);
  ConfusionMatrix merge(const ConfusionMatrix& other) const;

  int num_classes() const { return classes_; }
  double count(int label, int predicted) const { return counts_[static_cast<std::size_t>(label * classes_ + predicted)]; }
  Array matrix() const;  // [labels, predicted], float32
  double accuracy() const;
  std::vector<double> precision_per_class() const;
  std::vector<double> recall_per_class() const;
  std::vector<double> f1_per_class() const;
  double precision(Averaging averaging = Averaging::macro) const;
  double recall(Averaging averaging = Averaging::macro) const;
  double f1(Averaging averaging = Averaging::macro) const;

  Tree state() const;  // {"counts": [classes, classes]}, float32 (exact up to 2^24 per cell)
  static ConfusionMatrix from_state(const Tree& state);

 private:
  double average(const std::vector<double>& per_class, Averaging averaging, double micro) const;
  double labels_of(int c) const;     // row sum
  double predicted_as(int c) const;  // column sum
  int classes_;
  std::vector<double> counts_;
};

}  // namespace linum::metrics
