#include <linum/train/metrics.hpp>
#include <linum/core/autodiff/graph.hpp>
#include <linum/core/ops/all.hpp>

#include <algorithm>
#include <utility>

namespace linum::metrics {

Array Average::astype_f32(const Array& a) { return astype(a, DType::f32); }

void Accuracy::update(const Array& logits, const Array& labels) {
  if (logits.rank() < 1 || !is_floating(logits.dtype()))
    throw ShapeError(detail::cat("metrics::Accuracy: logits must be float [..., classes], got ", logits.type_str()));
  if (labels.dtype() != DType::i32 || labels.numel() * logits.dim(-1) != logits.numel())
    throw ShapeError(detail::cat("metrics::Accuracy: labels must be int32 with the shape of logits without the class axis; got ",
                                 "logits ", logits.type_str(), " and labels ", labels.type_str()));
  autodiff::NoGradGuard constants;
  const Array predicted = argmax(logits, -1);
  std::int64_t hits = 0;
  for (std::int64_t i = 0; i < labels.numel(); ++i) hits += predicted.data_i32()[i] == labels.data_i32()[i];
  Average::update(labels.numel() > 0 ? static_cast<double>(hits) / static_cast<double>(labels.numel()) : 0.0,
                  static_cast<double>(labels.numel()));
}

}  // namespace linum::metrics

namespace linum::metrics {

void check_logits_and_labels(const char* who, const Array& logits, const Array& labels) {
  if (logits.rank() < 1 || !is_floating(logits.dtype()))
    throw ShapeError(detail::cat(who, ": logits must be float [..., classes], got ", logits.type_str()));
  if (labels.dtype() != DType::i32 || labels.numel() * logits.dim(-1) != logits.numel())
    throw ShapeError(detail::cat(who, ": labels must be int32 with the shape of logits without the class axis; got ",
                                 "logits ", logits.type_str(), " and labels ", labels.type_str()));
}

// ---- Std ------------------------------------------------------------------------------------------

void Std::update(double value, double weight) {
  if (!(weight >= 0)) throw ValueError(detail::cat("metrics::Std: weight must be >= 0, got ", weight));
  total_ += value * weight;
  sum_of_squares_ += value * value * weight;
  count_ += weight;
}

void Std::update(const Array& values) {
  if (!is_floating(values.dtype()))
    throw ValueError(detail::cat("metrics::Std: needs float values, got ", values.type_str()));
  const std::vector<float> v = values.to_vector();
  for (float x : v) update(static_cast<double>(x));
}

Std Std::merge(const Std& other) const {
  Std m = *this;
  m.total_ += other.total_;
  m.sum_of_squares_ += other.sum_of_squares_;
  m.count_ += other.count_;
  return m;
}

double Std::compute() const {
  if (!(count_ > 0)) return std::numeric_limits<double>::quiet_NaN();
  const double mean = total_ / count_;
  return std::sqrt(std::max(sum_of_squares_ / count_ - mean * mean, 0.0));
}

Tree Std::state() const {
  return Tree{{"total", Array::full(Shape{}, static_cast<float>(total_))},
              {"sum_of_squares", Array::full(Shape{}, static_cast<float>(sum_of_squares_))},
              {"count", Array::full(Shape{}, static_cast<float>(count_))}};
}

Std Std::from_state(const Tree& state) {
  Std s;
  s.total_ = state.at("total").array().item();
  s.sum_of_squares_ = state.at("sum_of_squares").array().item();
  s.count_ = state.at("count").array().item();
  return s;
}

// ---- TopKAccuracy ---------------------------------------------------------------------------------

TopKAccuracy::TopKAccuracy(int k) : k_(k) {
  if (k < 1) throw ValueError(detail::cat("metrics::TopKAccuracy: k must be >= 1, got ", k));
}

void TopKAccuracy::update(const Array& logits, const Array& labels) {
  check_logits_and_labels("metrics::TopKAccuracy", logits, labels);
  const std::int64_t classes = logits.dim(-1), rows = labels.numel();
  const std::vector<float> l = astype(logits, DType::f32).to_vector();
  const std::vector<std::int32_t> y = labels.to_vector_i32();
  std::int64_t hits = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int32_t label = y[static_cast<std::size_t>(r)];
    if (label < 0 || label >= classes)
      throw ValueError(detail::cat("metrics::TopKAccuracy: label ", label, " at row ", r, " is outside [0, ", classes, ")"));
    const float* row = l.data() + r * classes;
    std::int64_t above = 0;  // classes with a strictly larger logit
    for (std::int64_t c = 0; c < classes; ++c) above += row[c] > row[label];
    hits += above < k_;
  }
  Average::update(rows > 0 ? static_cast<double>(hits) / static_cast<double>(rows) : 0.0, static_cast<double>(rows));
}

TopKAccuracy TopKAccuracy::merge(const TopKAccuracy& other) const {
  if (other.k_ != k_) throw ValueError(detail::cat("metrics::TopKAccuracy: cannot merge k = ", k_, " with k = ", other.k_));
  TopKAccuracy m(k_);
  static_cast<Average&>(m) = Average::merge(other);
  return m;
}

TopKAccuracy TopKAccuracy::from_state(const Tree& state, int k) {
  TopKAccuracy m(k);
  static_cast<Average&>(m) = Average::from_state(state);
  return m;
}

// ---- ConfusionMatrix ------------------------------------------------------------------------------

ConfusionMatrix::ConfusionMatrix(int num_classes) : classes_(num_classes) {
  if (num_classes < 1) throw ValueError(detail::cat("metrics::ConfusionMatrix: num_classes must be >= 1, got ", num_classes));
  counts_.assign(static_cast<std::size_t>(num_classes) * static_cast<std::size_t>(num_classes), 0.0);
}

void ConfusionMatrix::update(const Array& logits, const Array& labels) {
  check_logits_and_labels("metrics::ConfusionMatrix", logits, labels);
  if (logits.dim(-1) != classes_)
    throw ShapeError(detail::cat("metrics::ConfusionMatrix: logits have ", logits.dim(-1), " classes (", logits.type_str(),
                                 ") but the matrix was made for ", classes_));
  autodiff::NoGradGuard constants;
  update_predictions(reshape(argmax(logits, -1), labels.shape().vec()), labels);
}

void ConfusionMatrix::update_predictions(const Array& predicted, const Array& labels) {
  if (predicted.dtype() != DType::i32 || labels.dtype() != DType::i32 || !(predicted.shape() == labels.shape()))
    throw ShapeError(detail::cat("metrics::ConfusionMatrix: predictions and labels must be int32 of one shape; got ",
                                 predicted.type_str(), " and ", labels.type_str()));
  const std::vector<std::int32_t> p = predicted.to_vector_i32(), y = labels.to_vector_i32();
  for (std::size_t i = 0; i < y.size(); ++i)
    for (const auto& [what, v] : {std::pair<const char*, std::int32_t>{"label", y[i]}, {"prediction", p[i]}})
      if (v < 0 || v >= classes_)
        throw ValueError(detail::cat("metrics::ConfusionMatrix: ", what, " ", v, " at element ", i, " is outside [0, ",
                                     classes_, ")"));
  for (std::size_t i = 0; i < y.size(); ++i) counts_[static_cast<std::size_t>(y[i] * classes_ + p[i])] += 1;
}

ConfusionMatrix ConfusionMatrix::merge(const ConfusionMatrix& other) const {
  if (other.classes_ != classes_)
    throw ValueError(detail::cat("metrics::ConfusionMatrix: cannot merge ", classes_, " classes with ", other.classes_));
  ConfusionMatrix m = *this;
  for (std::size_t i = 0; i < counts_.size(); ++i) m.counts_[i] += other.counts_[i];
  return m;
}

Array ConfusionMatrix::matrix() const {
  std::vector<float> v(counts_.begin(), counts_.end());
  return Array::from(Shape{classes_, classes_}, v);
}

double ConfusionMatrix::labels_of(int c) const {
  double s = 0;
  for (int p = 0; p < classes_; ++p) s += count(c, p);
  return s;
}

double ConfusionMatrix::predicted_as(int c) const {
  double s = 0;
  for (int l = 0; l < classes_; ++l) s += count(l, c);
  return s;
}

double ConfusionMatrix::accuracy() const {
  double hits = 0, all = 0;
  for (int c = 0; c < classes_; ++c) {
    hits += count(c, c);
    all += labels_of(c);
  }
  return all > 0 ? hits / all : std::numeric_limits<double>::quiet_NaN();
}

namespace {
double ratio(double a, double b) { return b > 0 ? a / b : 0.0; }
}  // namespace

std::vector<double> ConfusionMatrix::precision_per_class() const {
  std::vector<double> out;
  for (int c = 0; c < classes_; ++c) out.push_back(ratio(count(c, c), predicted_as(c)));
  return out;
}

std::vector<double> ConfusionMatrix::recall_per_class() const {
  std::vector<double> out;
  for (int c = 0; c < classes_; ++c) out.push_back(ratio(count(c, c), labels_of(c)));
  return out;
}

std::vector<double> ConfusionMatrix::f1_per_class() const {
  std::vector<double> out;  // 2 tp / (2 tp + fp + fn) = 2 tp / (labels + predictions)
  for (int c = 0; c < classes_; ++c) out.push_back(ratio(2 * count(c, c), labels_of(c) + predicted_as(c)));
  return out;
}

double ConfusionMatrix::average(const std::vector<double>& per_class, Averaging averaging, double micro) const {
  if (averaging == Averaging::micro) return micro;
  double sum = 0, weights = 0;
  for (int c = 0; c < classes_; ++c) {
    const double w = averaging == Averaging::weighted ? labels_of(c) : (labels_of(c) + predicted_as(c) > 0 ? 1.0 : 0.0);
    sum += w * per_class[static_cast<std::size_t>(c)];
    weights += w;
  }
  return weights > 0 ? sum / weights : 0.0;
}

// For single-label classes, summed over classes tp = the hits, tp + fp = tp + fn = all rows: micro
// precision, recall and F1 are all the accuracy.
double ConfusionMatrix::precision(Averaging averaging) const {
  return average(precision_per_class(), averaging, accuracy());
}
double ConfusionMatrix::recall(Averaging averaging) const { return average(recall_per_class(), averaging, accuracy()); }
double ConfusionMatrix::f1(Averaging averaging) const { return average(f1_per_class(), averaging, accuracy()); }

Tree ConfusionMatrix::state() const { return Tree{{"counts", matrix()}}; }

ConfusionMatrix ConfusionMatrix::from_state(const Tree& state) {
  const Array& counts = state.at("counts").array();
  if (counts.rank() != 2 || counts.dim(0) != counts.dim(1))
    throw ShapeError(detail::cat("metrics::ConfusionMatrix::from_state: counts must be square, got ", counts.type_str()));
  ConfusionMatrix m(static_cast<int>(counts.dim(0)));
  const std::vector<float> v = astype(counts, DType::f32).to_vector();
  m.counts_.assign(v.begin(), v.end());
  return m;
}

}  // namespace linum::metrics
